"""ReduceSum, ReduceMean and ReduceL2: a sentence encoder's mean pooling and L2 normalization,
a squeeze-and-excitation block's global average.

ReduceSum: ``q_y = (sum(q_x - Z_x) * M >> rshift) + Z_y`` with ``M / 2**rshift = S_x / S_y``, the
sum in int64 over the reduced axes; the multiplier is narrowed (qtool.fixedpoint.narrowed) so that
a sum of up to 2**40 still fits int64 times it.

ReduceMean: the same sum, ``q_y = round(sum(q_x - Z_x) * M / n) >> rshift`` with ``n`` the count
of values reduced (known at run time); the quotient keeps ``rshift`` fractional bits, so the
result is within one step of the exact rounding.

ReduceL2: ``y = sqrt(sum((S_x (q_x - Z_x))**2)) = S_x sqrt(T)`` with ``T = sum(d**2)`` exact in
int64. The root is taken exactly on integers with ``ROOT_BITS`` = 15 fractional bits,
``r = isqrt(T * 4**k) * 2**(15 - k) ~ sqrt(T) 2**15`` (k = 15 while T * 4**k fits 62 bits, fewer
for larger T, whose root needs no fraction), then ``q_y = (r * M >> (rshift + 15)) + Z_y``; sums
of squares up to 2**50.

Axes are a constant input (opset 13 ReduceSum, opset 18 ReduceL2) or an attribute; ``keepdims``
and ``noop_with_empty_axes`` as ONNX defines them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..fixedpoint import Requant, divide_away, isqrt, narrowed, quantize_multiplier, requantize, rounding_rshift, saturate
from . import IntegerOp, NodeView, Raw, Unsupported, check_integer, per_tensor, register
from .layout import raw_input

ACC_BOUND = 2**40  # the largest |accumulator| (sum, or root times 2**ROOT_BITS) a multiplier is narrowed for
ROOT_BITS = 15  # fractional bits of the integer square root
ROOT_LIMIT = 2**50  # the largest sum of squares (its root times 2**ROOT_BITS below 2**40)


@dataclass(frozen=True)
class ReduceParams:
    axes: tuple[int, ...] | None  # None: every axis (or none, with noop_with_empty_axes)
    keepdims: bool
    requant: Requant
    zero_in: int
    zero_out: int
    rounding: str
    dtype: str


def _reduce_params(view: NodeView, what: str, bound: int) -> ReduceParams:
    x = per_tensor(view.inputs[0].qparams, f"{what} input")
    y = per_tensor(view.output, f"{what} output")
    axes = raw_input(view, 1, f"{what} axes")
    axes = tuple(int(a) for a in axes.reshape(-1)) if axes is not None else view.attr("axes")
    if axes is not None and len(axes) == 0:
        axes = None
    if axes is None and view.attr("noop_with_empty_axes", 0):
        raise Unsupported(f"{what} with noop_with_empty_axes and no axes is an identity")
    requant = narrowed(Requant(*quantize_multiplier(x.scale / y.scale, view.multiplier_bits)), bound)
    return ReduceParams(None if axes is None else tuple(axes), bool(view.attr("keepdims", 1)), requant,
                        x.zero_point, y.zero_point, view.rounding, y.dtype)


class _Reduce(IntegerOp):
    def constants(self, node):
        return {1: Raw()}

    def _sum(self, p: ReduceParams, values: np.ndarray) -> np.ndarray:
        return values.sum(axis=p.axes, keepdims=p.keepdims, dtype=np.int64)


@register
class ReduceSum(_Reduce):
    op_type = "ReduceSum"

    def derive(self, view: NodeView) -> ReduceParams:
        return _reduce_params(view, "ReduceSum", ACC_BOUND)

    def run(self, p: ReduceParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        acc = self._sum(p, x.astype(np.int64) - p.zero_in)
        return saturate(requantize(acc, p.requant.multiplier, p.requant.rshift, p.rounding) + p.zero_out, p.dtype)


@register
class ReduceMean(_Reduce):
    op_type = "ReduceMean"

    def derive(self, view: NodeView) -> ReduceParams:
        return _reduce_params(view, "ReduceMean", ACC_BOUND)

    def run(self, p: ReduceParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        acc = self._sum(p, x.astype(np.int64) - p.zero_in)
        n = max(1, x.size // max(1, acc.size))  # values per output element
        if acc.size and int(np.abs(acc).max()) >= ACC_BOUND:  # the multiplier is narrowed for 2**40
            raise OverflowError(f"ReduceMean accumulator over {n} values exceeds 2**40")
        quotient = divide_away(acc * np.int64(p.requant.multiplier), n)
        return saturate(rounding_rshift(quotient, p.requant.rshift, p.rounding) + p.zero_out, p.dtype)


@register
class ReduceL2(_Reduce):
    op_type = "ReduceL2"

    def derive(self, view: NodeView) -> ReduceParams:
        p = _reduce_params(view, "ReduceL2", ACC_BOUND)
        return ReduceParams(p.axes, p.keepdims, Requant(p.requant.multiplier, p.requant.rshift + ROOT_BITS),
                            p.zero_in, p.zero_out, p.rounding, p.dtype)

    def run(self, p: ReduceParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        d = x.astype(np.int64) - p.zero_in
        squares = self._sum(p, d * d)
        if squares.size and squares.max() > ROOT_LIMIT:
            raise OverflowError(f"ReduceL2 sum of squares {int(squares.max())} exceeds {ROOT_LIMIT}")
        top = int(squares.max(initial=0))
        k = min(ROOT_BITS, (62 - top.bit_length()) // 2)
        root = np.left_shift(isqrt(np.left_shift(squares, 2 * k)), ROOT_BITS - k)
        return saturate(requantize(root, p.requant.multiplier, p.requant.rshift, p.rounding) + p.zero_out, p.dtype)
