"""Elementwise non-linear ops as lookup tables (DESIGN.md, seed 003).

``T[q - qmin] = sat(round(f(S_x * (q - Z_x)) / S_y) + Z_y)`` for every input value ``q``: 256
entries for int8/uint8 inputs, 65536 for int16/uint16 (128 KB, as TFLite's 16-bit LUT kernels).
The input is dequantized in float32 exactly as DequantizeLinear does, ``f`` runs in float64 and
the table is rounded once, at setup; the kernel is a gather.

Rounding: ``half_up``, ``half_away_from_zero`` and ``half_to_even`` round the table as they round
shifts. ``toward_zero`` is a run-time speed knob for shifts; a table costs nothing to round well,
so it rounds to nearest, ties to even (as QuantizeLinear does). Ties are measure-zero for
transcendental ``f``; they occur for the piecewise-linear HardSigmoid and HardSwish.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx

from ..fixedpoint import saturate
from ..qparams import QParams, dequantize_array
from . import NOT_DUMPED, IntegerOp, NodeView, Unsupported, check_integer, per_tensor, register
from .bytetable import by_byte, by_pattern, lookup


def round_real(values, mode: str) -> np.ndarray:
    """Float values to integers (int64) in rounding ``mode``; see the module note on toward_zero."""
    v = np.asarray(values, dtype=np.float64)
    if mode == "half_up":
        r = np.floor(v + 0.5)
    elif mode == "half_away_from_zero":
        r = np.sign(v) * np.floor(np.abs(v) + 0.5)
    else:  # half_to_even, toward_zero
        r = np.rint(v)
    return r.astype(np.int64)


def quantize_real(values, qp: QParams, mode: str) -> np.ndarray:
    """``sat(round(values / S) + Z)`` in ``qp``'s type, ``values`` float (setup only)."""
    scaled = np.asarray(values, dtype=np.float64) / float(qp.scale)
    scaled = np.clip(scaled, -(2.0**40), 2.0**40)  # inf (e.g. an open clamp bound) saturates
    return saturate(round_real(scaled, mode) + int(qp.zero_point), qp.dtype)


TABLE_TYPES = ("int8", "uint8", "int16", "uint16")


@dataclass(frozen=True)
class LutParams:
    # [256] in the output type, indexed by q - qmin of the 8-bit input type; None for a 16-bit input,
    # whose 65536 entries (``wide``) follow from the op and the (S, Z) written with it: 128 KB an op
    # would make the parameters (and the model's metadata) megabytes
    table: np.ndarray | None
    in_dtype: str
    wide: np.ndarray | None = field(default=None, metadata=NOT_DUMPED)
    # [C, 256] where the input or the output is quantized per channel (axis 1): one table per
    # channel, row c indexed as ``table``; ``table`` is then None. Not dumped either: they follow
    # from the op and the per-channel (S, Z) written with it
    channel_tables: np.ndarray | None = field(default=None, metadata=NOT_DUMPED)


def _channel(qp: QParams, c: int) -> QParams:
    """Channel ``c``'s (S, Z) of ``qp`` (per tensor: ``qp`` itself)."""
    if np.ndim(qp.scale) == 0:
        return qp
    return QParams(float(np.asarray(qp.scale).reshape(-1)[c]), int(np.asarray(qp.zero_point).reshape(-1)[c]),
                   qp.dtype)


def _per_channel(qp: QParams) -> int:
    """How many channels ``qp`` holds along axis 1 (0: per tensor)."""
    if np.ndim(qp.scale) == 0 or np.size(qp.scale) == 1:
        return 0
    if qp.axis != 1:
        raise Unsupported("a lookup table's input and output are quantized per tensor or per channel (axis 1)")
    return int(np.size(qp.scale))


class LookupTable(IntegerOp):
    """Base class: subclasses define ``f`` (float64 in, float64 out)."""

    def f(self, x: np.ndarray, view: NodeView) -> np.ndarray:
        raise NotImplementedError

    def derive(self, view: NodeView) -> LutParams:
        x_qp, y_qp = view.inputs[0].qparams, view.output
        channels = {_per_channel(x_qp), _per_channel(y_qp)} - {0}
        if channels:
            return self._derive_channels(view, x_qp, y_qp, channels)
        x = per_tensor(x_qp, f"{self.op_type} input")
        y = per_tensor(y_qp, f"{self.op_type} output")
        if x.dtype not in TABLE_TYPES:
            raise Unsupported(f"a lookup table needs an 8- or 16-bit input, got {x.dtype}")
        table = self._table(x, y, view)
        if table.size > 256:
            return LutParams(None, x.dtype, table)
        return LutParams(table, x.dtype)

    def _table(self, x: QParams, y: QParams, view: NodeView) -> np.ndarray:
        """``f`` on every value of ``x``'s type, in ``y``'s: the input dequantized in float32, as
        DequantizeLinear computes, ``f`` in float64, rounded once."""
        q = np.arange(x.qmin, x.qmax + 1, dtype=np.int64)
        real = dequantize_array(q, x).astype(np.float64)
        return quantize_real(self.f(real, view), y, view.rounding)

    def _derive_channels(self, view: NodeView, x_qp: QParams, y_qp: QParams, channels: set) -> LutParams:
        """One 256-entry table per channel: channel c's input (S, Z) to its output's."""
        if len(channels) > 1:
            raise Unsupported(f"{self.op_type} input and output have different channel counts")
        if x_qp.dtype not in ("int8", "uint8"):
            raise Unsupported("a table per channel needs an 8-bit input")
        rows = [self._table(_channel(x_qp, c), _channel(y_qp, c), view) for c in range(channels.pop())]
        return LutParams(None, x_qp.dtype, channel_tables=np.stack(rows))

    def elementwise(self, p: LutParams) -> bool:
        return p.channel_tables is None  # a table per channel depends on where the element is

    def run(self, p: LutParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        if x.dtype != np.dtype(p.in_dtype):
            raise TypeError(f"{self.op_type} table is for {p.in_dtype} input, got {x.dtype}")
        if p.channel_tables is not None:
            return per_channel_lookup(p.channel_tables, x)
        if x.itemsize == 1:
            return lookup(by_byte(p.table, p.in_dtype), x)
        if x.itemsize == 2:
            return lookup(by_pattern(p.wide, x.dtype), x)
        return np.take(p.wide, x.astype(np.int32) - np.iinfo(x.dtype).min)


def per_channel_lookup(tables: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``tables[c, q - qmin]`` for each element ``q`` of 8-bit ``x`` [N, C, ...] in channel ``c``."""
    if x.ndim < 2 or x.shape[1] != tables.shape[0]:
        raise ValueError(f"{tables.shape[0]} channel tables for an input of shape {x.shape}")
    rows = tables.shape[0]
    index = x.astype(np.int32) - np.iinfo(x.dtype).min  # [0, 256)
    index += (np.arange(rows, dtype=np.int32) * 256).reshape((1, rows) + (1,) * (x.ndim - 2))
    return np.take(tables.reshape(-1), index)


_erf = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    return _erf(np.asarray(x, dtype=np.float64)).astype(np.float64)


def hard_sigmoid(x: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    return np.clip(alpha * x + beta, 0.0, 1.0)


@register
class Sigmoid(LookupTable):
    op_type = "Sigmoid"

    def f(self, x, view):
        # exp of |x| never overflows: e^-|x| in (0, 1]; the same values as 1 / (1 + e^-x)
        e = np.exp(-np.abs(x))
        return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@register
class Tanh(LookupTable):
    op_type = "Tanh"

    def f(self, x, view):
        return np.tanh(x)


@register
class Erf(LookupTable):
    op_type = "Erf"

    def f(self, x, view):
        return erf(x)


@register
class HardSigmoid(LookupTable):
    op_type = "HardSigmoid"

    def f(self, x, view):
        # attributes are float32 in the model; onnxruntime computes with those values
        return hard_sigmoid(x, view.attr("alpha", np.float32(0.2)), view.attr("beta", np.float32(0.5)))


@register
class HardSwish(LookupTable):
    op_type = "HardSwish"  # opset 14

    def f(self, x, view):
        return x * hard_sigmoid(x, 1.0 / 6.0, 0.5)


@register
class Elu(LookupTable):
    op_type = "Elu"

    def f(self, x, view):
        alpha = float(view.attr("alpha", np.float32(1.0)))
        return np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0)))


@register
class Selu(LookupTable):
    op_type = "Selu"

    def f(self, x, view):
        alpha = float(view.attr("alpha", np.float32(1.67326319217681884765625)))
        gamma = float(view.attr("gamma", np.float32(1.05070102214813232421875)))
        return gamma * np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0)))


@register
class Celu(LookupTable):
    op_type = "Celu"  # opset 12

    def f(self, x, view):
        alpha = float(view.attr("alpha", np.float32(1.0)))
        return np.maximum(x, 0.0) + np.minimum(0.0, alpha * np.expm1(np.minimum(x, 0.0) / alpha))


@register
class Softplus(LookupTable):
    op_type = "Softplus"

    def f(self, x, view):
        return np.logaddexp(0.0, x)


@register
class Softsign(LookupTable):
    op_type = "Softsign"

    def f(self, x, view):
        return x / (1.0 + np.abs(x))


@register
class ThresholdedRelu(LookupTable):
    op_type = "ThresholdedRelu"

    def f(self, x, view):
        return np.where(x > float(view.attr("alpha", np.float32(1.0))), x, 0.0)


class Gelu(LookupTable):
    op_type = "Gelu"  # opset 20

    def check(self, node, attrs):
        approximate = attrs.get("approximate", b"none")
        approximate = approximate.decode() if isinstance(approximate, bytes) else approximate
        if approximate not in ("none", "tanh"):
            raise Unsupported(f"Gelu approximate='{approximate}' is not one of none, tanh")

    def derive(self, view):
        self.check(view.node, view.attrs)
        return super().derive(view)

    def f(self, x, view):
        if view.attr("approximate", "none") == "tanh":
            return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
        return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


if onnx.defs.has("Gelu"):
    register(Gelu)
