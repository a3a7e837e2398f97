"""Softmax on integers: an exponential table, an integer sum and one division per element.

Along the axis, ``d = q - max(q)`` lies in ``[-(qmax - qmin), 0]`` whatever the zero point, and
``exp(S_x d)`` is looked up in a table of ``2**EXP_BITS``-scaled integers made at setup
(``E[d] = round(exp(S_x d) * 2**30)``, 256 entries for an 8-bit input, 65536 for a 16-bit one).
The row's largest element contributes exactly ``2**30``, so the sum is never 0. The output is
``q_y = round(E / sum(E) / S_y) + Z_y``: with ``1 / S_y ~ M / 2**rshift`` (a 32-bit multiplier),
``floor(E * M / sum(E))`` then the model's rounding shift (an 8-bit ``M`` is widened by guard
bits first, ``M 2**g / 2**(rshift + g)``, so the floor stays far below one step) (I-BERT's integer softmax divides the
same way; its polynomial exp is a table here, which costs nothing at 8 and 16 bits).

Bounds: ``E <= 2**30`` and ``M < 2**31``, so ``E * M < 2**61``. Against float softmax followed by
QuantizeLinear the result differs only where the real value is within about ``2**-20`` LSB of a
rounding tie (the table's and the floor's errors).

Axis: ONNX before opset 13 normalizes the input flattened to 2-D at ``axis`` (default 1), from 13
along ``axis`` alone (default -1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..fixedpoint import quantize_multiplier, rounding_rshift, saturate
from ..masks import masked_positions
from ..qparams import dequantize_array
from . import NOT_DUMPED, IntegerOp, NodeView, Unsupported, check_integer, per_tensor, register
from . import compiled
from .lut import TABLE_TYPES

EXP_BITS = 30
# the first opset whose Softmax normalizes along one axis instead of the flattened trailing axes
ONE_AXIS_OPSET = 13


@dataclass(frozen=True)
class SoftmaxParams:
    axis: int
    flatten: bool  # before opset 13: the axes from ``axis`` on are one row
    # [qmax - qmin + 1] int64 ``round(exp(S_x d) 2**EXP_BITS)`` at index ``d + qmax - qmin``; for a
    # 16-bit input (65536 entries) it follows from S_x and is not written into the parameters
    exp_table: np.ndarray | None
    multiplier: int  # multiplier / 2**rshift ~ 1 / S_y
    rshift: int
    zero_out: int
    rounding: str
    in_dtype: str
    dtype: str
    wide: np.ndarray | None = field(default=None, metadata=NOT_DUMPED)

    @property
    def exp_values(self) -> np.ndarray:
        return self.exp_table if self.exp_table is not None else self.wide


@register
class Softmax(IntegerOp):
    op_type = "Softmax"

    def derive(self, view: NodeView) -> SoftmaxParams:
        x = per_tensor(view.inputs[0].qparams, "Softmax input")
        y = per_tensor(view.output, "Softmax output")
        if x.dtype not in TABLE_TYPES:
            raise Unsupported(f"integer Softmax needs an 8- or 16-bit input, got {x.dtype}")
        flatten = view.opset < ONE_AXIS_OPSET
        axis = view.attr("axis", 1 if flatten else -1)
        span = x.qmax - x.qmin
        steps = dequantize_array(np.arange(x.qmin, x.qmax + 1), x).astype(np.float64)
        d = steps - steps[-1]  # S_x (q - qmax): the dequantized differences, as DequantizeLinear gives
        table = np.floor(np.exp(d) * 2.0**EXP_BITS + 0.5).astype(np.int64)
        multiplier, rshift = quantize_multiplier(1.0 / float(y.scale), view.multiplier_bits)
        if multiplier >= 2**31:
            raise Unsupported(f"Softmax output scale {y.scale} needs a multiplier of {multiplier}")
        # the quotient is floored before the rounding shift: a short (8-bit) multiplier gets guard
        # bits, so the floor costs under 2**-20 LSB whatever the width
        guard = max(0, 61 - EXP_BITS - multiplier.bit_length())
        multiplier, rshift = multiplier << guard, rshift + guard
        wide = span + 1 > 256
        return SoftmaxParams(int(axis), flatten, None if wide else table, multiplier, rshift,
                             int(y.zero_point), view.rounding, x.dtype, y.dtype,
                             table if wide else None)

    def run(self, p: SoftmaxParams, x: np.ndarray) -> np.ndarray:
        # the compiled pass takes only the table's own input type; anything else, and the
        # checks' errors, come from the numpy form
        fast = compiled.softmax(p, x) if x.dtype == np.dtype(p.in_dtype) else None
        return fast if fast is not None else _softmax(p, x)


def _softmax(p: SoftmaxParams, x: np.ndarray, hidden: np.ndarray | None = None) -> np.ndarray:
    """The integer Softmax of ``x``; ``hidden`` (boolean, broadcastable to ``x``): positions that
    get probability 0, except in a row where every position is hidden, which takes all of them."""
    check_integer(x)
    if x.dtype != np.dtype(p.in_dtype):
        raise TypeError(f"Softmax table is for {p.in_dtype} input, got {x.dtype}")
    shape = x.shape
    axis = p.axis % max(x.ndim, 1)
    if hidden is not None:
        hidden = np.broadcast_to(hidden, shape)
    if p.flatten:
        x = x.reshape(math.prod(shape[:axis]), -1)
        hidden = None if hidden is None else hidden.reshape(x.shape)
        axis = 1
    q = x.astype(np.int64)
    span = len(p.exp_values) - 1
    if hidden is None:
        e = p.exp_values[q - q.max(axis=axis, keepdims=True) + span]
    else:
        hidden = hidden & ~hidden.all(axis=axis, keepdims=True)  # a fully hidden row: all count
        top = np.where(hidden, np.iinfo(np.int64).min, q).max(axis=axis, keepdims=True)
        e = np.where(hidden, 0, p.exp_values[np.clip(q - top + span, 0, span)])
    ratio = e * p.multiplier // e.sum(axis=axis, keepdims=True)
    y = saturate(rounding_rshift(ratio, p.rshift, p.rounding) + p.zero_out, p.dtype)
    return y.reshape(shape)


@dataclass(frozen=True)
class MaskedSoftmaxParams:
    softmax: SoftmaxParams
    form: str  # qtool.masks.Join.form: how the mask operand hides positions


class MaskedSoftmax(IntegerOp):
    """``Softmax(Add(scores, mask))`` or ``Softmax(Where(cond, scores, K))`` with an attention mask
    (qtool/masks.py): the scores' integers and the mask operand in, the Softmax's integers out.
    The mask operand only selects positions (0 or at most ``SENTINEL``; a condition): hidden ones
    get probability exactly 0, as float Softmax gives them (``exp`` of -1e4 or less is 0 in
    float32). Not in ``REGISTRY``: the executor lowers the pair to it (qtool/executor.py)."""

    op_type = "MaskedSoftmax"

    def derive(self, view: NodeView, form: str = "add") -> MaskedSoftmaxParams:
        return MaskedSoftmaxParams(Softmax().derive(view), form)

    def run(self, p: MaskedSoftmaxParams, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return _softmax(p.softmax, x, masked_positions(p.form, mask))
