"""Mul and Div by a constant.

Mul: ``q_y = ((q_a - Z_a) * (q_b - Z_b) * M >> rshift) + Z_y`` with ``M / 2**rshift = S_a S_b / S_y``,
numpy broadcasting (the SE block's ``x[N,C,H,W] * s[N,C,1,1]``). A float constant operand is
quantized per tensor like an activation (``accepts_constants``). The product of two 8-bit
differences is below 2**16, times a multiplier below 2**31 it stays inside int64. Two 8-bit inputs
are looked up in the table of this arithmetic on every pair (qtool/ops/bytetable.py).

Div(x, c), c a constant: a multiply by 1/c, ``q_y = ((q_x - Z_x) * M_c >> rshift_c) + Z_y`` with
``M_c / 2**rshift_c = S_x / (c S_y)`` per element of c. ``c`` is the *dequantized* int8 constant,
the value onnxruntime divides by in the QDQ model, not the original float: the integer step must
reproduce the QDQ model.

Div(a, b), b an activation (a mean pooling's count, an L2 norm):
``q_y = round(round((q_a - Z_a) * M / (q_b - Z_b)) / 2**rshift) + Z_y`` with
``M / 2**rshift = S_a / (S_b S_y)``; the inner quotient keeps ``rshift`` fractional bits, so the
result is within one step of the exact rounding. A divisor of zero (q_b = Z_b) gives the output's
largest or smallest value by the sign of the dividend, Z_y for 0 / 0 (float: +-inf, NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..fixedpoint import Requant, divide_away, quantize_multiplier, requantize, rounding_rshift, saturate
from ..qparams import dequantize_array
from . import IntegerOp, NodeView, Unsupported, Weight, check_integer, per_tensor, register
from . import compiled
from .bytetable import has_pair_table, lookup_pair, lookup_with_scalar, pair_table


@dataclass(frozen=True)
class MulParams:
    multiplier: int
    rshift: int
    zero_a: int
    zero_b: int
    zero_out: int
    rounding: str
    dtype: str


@register
class Mul(IntegerOp):
    op_type = "Mul"
    accepts_constants = True

    def derive(self, view: NodeView) -> MulParams:
        a = per_tensor(view.inputs[0].qparams, "Mul input A")
        b = per_tensor(view.inputs[1].qparams, "Mul input B")
        y = per_tensor(view.output, "Mul output")
        multiplier, rshift = quantize_multiplier(a.scale * b.scale / y.scale, view.multiplier_bits)
        return MulParams(multiplier, rshift, a.zero_point, b.zero_point, y.zero_point, view.rounding,
                         y.dtype)

    def elementwise(self, p: MulParams) -> bool:
        return True

    def run(self, p: MulParams, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        check_integer(a, b)
        if has_pair_table(a, b):
            return lookup_pair(pair_table(_mul, p, a.dtype, b.dtype), a, b)
        fast = lookup_with_scalar(_mul, p, a, b)
        if fast is None:
            fast = compiled.mul_levels(p, a, b)
        return _mul(p, a, b) if fast is None else fast


def _mul(p: MulParams, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    acc = (a.astype(np.int64) - p.zero_a) * (b.astype(np.int64) - p.zero_b)
    return saturate(requantize(acc, p.multiplier, p.rshift, p.rounding) + p.zero_out, p.dtype)


@dataclass(frozen=True)
class DivActivationParams(MulParams):
    """Div by an activation: Mul's fields, ``M / 2**rshift = S_a / (S_b S_y)``."""


@dataclass(frozen=True)
class DivParams:
    requant: Requant  # shaped like the constant divisor, signed multipliers
    zero_in: int
    zero_out: int
    rounding: str
    dtype: str


def signed_multipliers(ratios: np.ndarray, bits: int) -> Requant:
    """``quantize_multiplier`` per element of ``ratios`` (non-zero), the sign on the multiplier."""
    flat = np.asarray(ratios, dtype=np.float64).reshape(-1)
    pairs = [quantize_multiplier(abs(r), bits) for r in flat]
    sign = np.where(flat < 0, -1, 1)
    multiplier = (sign * np.array([m for m, _ in pairs], dtype=np.int64)).reshape(np.shape(ratios))
    rshift = np.array([s for _, s in pairs], dtype=np.int64).reshape(np.shape(ratios))
    return Requant(multiplier, rshift)


@register
class Div(IntegerOp):
    op_type = "Div"

    def constants(self, node):
        return {1: Weight(axis=None, optional=True)}

    def derive(self, view: NodeView) -> DivParams | DivActivationParams:
        x = per_tensor(view.inputs[0].qparams, "Div input A")
        y = per_tensor(view.output, "Div output")
        divisor = view.inputs[1]
        if divisor is not None and divisor.value is None and divisor.qparams is not None:
            b = per_tensor(divisor.qparams, "Div input B")
            multiplier, rshift = quantize_multiplier(x.scale / (b.scale * y.scale), view.multiplier_bits)
            return DivActivationParams(multiplier, rshift, x.zero_point, b.zero_point, y.zero_point,
                                       view.rounding, y.dtype)
        if divisor is None or divisor.value is None or divisor.qparams is None:
            raise Unsupported("Div needs a quantized divisor")
        c = dequantize_array(divisor.value, divisor.qparams).astype(np.float64)
        if np.any(c == 0):
            raise Unsupported("Div by a constant that quantizes to 0")
        return DivParams(signed_multipliers(x.scale / (c * y.scale), view.multiplier_bits),
                         x.zero_point, y.zero_point, view.rounding, y.dtype)

    def elementwise(self, p: DivParams | DivActivationParams) -> bool:
        if isinstance(p, DivActivationParams):
            return False
        return np.size(p.requant.multiplier) == 1  # else one multiplier per element of the divisor

    def run(self, p: DivParams | DivActivationParams, x: np.ndarray, *divisor: np.ndarray) -> np.ndarray:
        if isinstance(p, DivActivationParams):
            return _divide(p, x, *divisor)
        check_integer(x)
        acc = x.astype(np.int64) - p.zero_in
        return saturate(requantize(acc, p.requant.multiplier, p.requant.rshift, p.rounding) + p.zero_out,
                        p.dtype)


def _divide(p: DivActivationParams, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    check_integer(a, b)
    num = (a.astype(np.int64) - p.zero_a) * p.multiplier  # |.| < 2**17 * 2**31
    den = b.astype(np.int64) - p.zero_b
    num, den = np.broadcast_arrays(num, den)
    quotient = np.sign(den) * divide_away(num, np.where(den == 0, 1, np.abs(den)))
    y = rounding_rshift(quotient, p.rshift, p.rounding) + p.zero_out
    low, high = np.iinfo(p.dtype).min, np.iinfo(p.dtype).max
    y = np.where(den == 0, np.where(num > 0, high, np.where(num < 0, low, p.zero_out)), y)
    return saturate(y, p.dtype)
