"""ConvInteger and MatMulInteger (ONNX): the int32 accumulator itself, no requantization.

``y = sum (q_x - Z_x)(q_w - Z_w)`` exactly (``int_matmul`` on the zero-point shifted operands),
returned as int32. A sum outside int32 raises ``OverflowError`` (the executor names the node);
it is never wrapped.

* ConvInteger: ``x_zero_point`` is a scalar, ``w_zero_point`` a scalar or one per output channel.
  Padding adds real zeros (``Z_x`` before the shift, 0 after it), as the ONNX reference does.
* MatMulInteger: ``a_zero_point`` a scalar or one per row of A (its second-to-last axis),
  ``b_zero_point`` a scalar or one per column of B (its last axis); numpy matmul broadcasting.
* A zero point may be a run-time tensor (``DynamicQuantizeLinear``'s, in onnxruntime's dynamically
  quantized models): ``zero_at_run`` says which; those reach ``run`` after the two operands.

These classes are not in ``REGISTRY``: no float op quantizes to them; the executor lowers the
ONNX nodes of these types to them directly (qtool/qoperator_exec.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..fixedpoint import INT32_MAX, INT32_MIN
from . import IntegerOp, NodeView, Unsupported, check_integer
from .conv import conv_accumulate
from .intmatmul import int_matmul


def _to_int32(acc: np.ndarray) -> np.ndarray:
    if acc.size and (acc.min() < INT32_MIN or acc.max() > INT32_MAX):
        raise OverflowError("accumulator exceeds int32")
    return acc.astype(np.int32)


def _run_zeros(at_run: tuple[bool, bool], fixed: tuple, zeros: tuple) -> list[np.ndarray]:
    """The two zero points: the fixed ones, or in their place the run-time ones (in order)."""
    given = iter(zeros)
    out = []
    for run, value in zip(at_run, fixed):
        if run:
            value = np.asarray(next(given))
            if value.dtype.kind not in "iu":
                raise ValueError(f"a zero point must be an integer tensor, got {value.dtype}")
            value = value.astype(np.int64).reshape(-1)
            value = value.reshape(()) if value.size == 1 else value
        out.append(value)
    return out


def _zero_point(view: NodeView, index: int) -> np.ndarray:
    """The zero point operand ``index`` carries (its ``qparams.zero_point``) as int64, 0 if absent."""
    if index >= len(view.inputs) or view.inputs[index] is None or view.inputs[index].qparams is None:
        return np.zeros((), np.int64)
    return np.asarray(view.inputs[index].qparams.zero_point, dtype=np.int64)


@dataclass(frozen=True)
class ConvIntegerParams:
    zero_x: int
    zero_w: np.ndarray  # int64, shape () or [C_out]
    pads: tuple[int, int, int, int]  # top, left, bottom, right
    strides: tuple[int, int]
    dilations: tuple[int, int]
    group: int
    zero_at_run: tuple[bool, bool] = (False, False)


class ConvInteger(IntegerOp):
    """Operands: 0 the input, 1 the weight (an activation or a constant, it reaches ``run``);
    their ``qparams.zero_point`` are the node's zero points."""

    op_type = "ConvInteger"

    def derive(self, view: NodeView) -> ConvIntegerParams:
        if view.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            raise Unsupported("auto_pad SAME_* is not supported")
        kernel = view.attr("kernel_shape")
        if kernel is not None and len(kernel) != 2:
            raise Unsupported("only 2-D convolution is supported")
        zero_x = _zero_point(view, 0)
        if zero_x.size != 1:
            raise Unsupported("x_zero_point must be a scalar")
        zero_w = _zero_point(view, 1).reshape(-1)
        pads = tuple(view.attr("pads", [0, 0, 0, 0]))
        if len(pads) != 4:
            raise Unsupported("only 2-D convolution is supported")
        zero_w = zero_w if zero_w.size > 1 else zero_w.reshape(())
        return ConvIntegerParams(int(zero_x.reshape(-1)[0]), zero_w, (pads[0], pads[1], pads[2], pads[3]),
                                 tuple(view.attr("strides", [1, 1])), tuple(view.attr("dilations", [1, 1])),
                                 int(view.attr("group", 1)))

    def run(self, p: ConvIntegerParams, x: np.ndarray, w: np.ndarray, *zeros: np.ndarray) -> np.ndarray:
        check_integer(x, w)
        if x.ndim != 4 or w.ndim != 4:
            raise ValueError(f"ConvInteger is 2-D: got input {x.shape} and weight {w.shape}")
        n, c_out = x.shape[0], w.shape[0]
        zero_x, zero_w = _run_zeros(p.zero_at_run, (p.zero_x, p.zero_w), zeros)
        if np.ndim(zero_x):
            raise ValueError(f"ConvInteger's x_zero_point must be a scalar, got shape {list(np.shape(zero_x))}")
        zero_w = zero_w.reshape(-1, 1, 1, 1) if zero_w.ndim else zero_w
        ws = w.astype(np.int32) - zero_w.astype(np.int32)
        top, left, bottom, right = p.pads
        xs = np.pad(x.astype(np.int32) - np.int32(zero_x), ((0, 0), (0, 0), (top, bottom), (left, right)))
        acc, out_h, out_w = conv_accumulate(xs, ws, p.group, p.strides, p.dilations)
        return _to_int32(acc).reshape(n, c_out, out_h, out_w)


@dataclass(frozen=True)
class MatMulIntegerParams:
    zero_a: np.ndarray  # int64, () or [M]
    zero_b: np.ndarray  # int64, () or [N]
    zero_at_run: tuple[bool, bool] = (False, False)


class MatMulInteger(IntegerOp):
    """Operands: 0 A, 1 B (both reach ``run``); their ``qparams.zero_point`` are the zero points."""

    op_type = "MatMulInteger"

    def derive(self, view: NodeView) -> MatMulIntegerParams:
        zero_a, zero_b = _zero_point(view, 0).reshape(-1), _zero_point(view, 1).reshape(-1)
        return MatMulIntegerParams(zero_a if zero_a.size > 1 else zero_a.reshape(()),
                                   zero_b if zero_b.size > 1 else zero_b.reshape(()))

    def run(self, p: MatMulIntegerParams, a: np.ndarray, b: np.ndarray, *zeros: np.ndarray) -> np.ndarray:
        check_integer(a, b)
        zero_a, zero_b = _run_zeros(p.zero_at_run, (p.zero_a, p.zero_b), zeros)
        zero_a = zero_a[:, None] if zero_a.ndim else zero_a  # one per row of A
        acc = int_matmul(a.astype(np.int32) - zero_a.astype(np.int32),
                         b.astype(np.int32) - zero_b.astype(np.int32))
        return _to_int32(acc)
