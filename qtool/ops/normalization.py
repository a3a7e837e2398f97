"""LayerNormalization on integers: integer mean and variance, an integer square root, one division.

Over a row of ``N`` elements (the axes from ``axis`` on), ``d = N q - sum(q)`` is ``N`` times the
deviation from the mean in input steps, exactly, whatever ``Z_x``; the normalized value is

    (x - mean) / sqrt(var + eps) = d sqrt(N) / sqrt(T),   T = sum(d^2) + E,   E = eps N^3 / S_x^2

(``S_x`` cancels but in ``E``). ``T`` is shifted left by an even ``2k`` until it fills 61 bits,
so ``s = isqrt(T 4^k)`` (qtool.fixedpoint.isqrt, exact) carries about 30 significant bits; then
``z = round(d 2^(P + k) / s)`` is the normalized value times ``2^P / sqrt(N)``, ``P = 28``. The
affine part is per channel ``c`` of the row: ``q_y = round(z m_c + beta_c / S_y) + Z_y`` with
``m_c = gamma_c sqrt(N) / (2^P S_y)`` a signed 32-bit multiplier ``M_c / 2^r_c``, computed as
``(z M_c + B_c) >> r_c`` in the model's rounding, ``B_c = round(beta_c / S_y * 2^r_c)``.

Bounds (checked at setup; a form outside them stays float): ``N (N (qmax - qmin))^2 + E < 2^61``
keeps ``T`` in int64 (8-bit rows up to ~25,000 elements, 16-bit ~800); ``|d| 2^k <= s + 1`` so
``|d| 2^(P + k) < 2^60``; ``|z| <= 2^P``, so ``|z M_c| < 2^59``, and ``|B_c|`` is capped where
the output saturates anyway. Floats appear only at setup (``E``, ``M_c``, ``B_c``); against float
LayerNormalization followed by QuantizeLinear the result differs only within about ``2^-20`` LSB
of a rounding tie. Scale and bias (gamma, beta) stay float constants in the model, as onnxruntime
reads them; the integer parameters are derived from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..fixedpoint import bit_length, divide_rounded, isqrt, rounding_rshift, saturate
from . import IntegerOp, NodeView, Raw, Unsupported, check_integer, per_tensor, register
from .mul import signed_multipliers

FRACTION_BITS = 28  # P: z = normalized * 2^P / sqrt(N)
T_BITS = 61  # T is shifted up to just under 2^T_BITS before its square root


@dataclass(frozen=True)
class LayerNormParams:
    axis: int
    size: int  # N, the elements of a row
    epsilon: int  # E = eps N^3 / S_x^2 in units of d^2
    multiplier: np.ndarray  # [N] int64, signed: M_c / 2^r_c = gamma_c sqrt(N) / (2^P S_y)
    rshift: np.ndarray  # [N] int64
    offset: np.ndarray  # [N] int64: round(beta_c / S_y * 2^r_c)
    zero_out: int
    rounding: str
    dtype: str


def _row_constant(view: NodeView, index: int, what: str, size: int | None) -> np.ndarray | None:
    operand = view.inputs[index] if index < len(view.inputs) else None
    if operand is None:
        return None
    if operand.value is None or operand.qparams is not None:
        raise Unsupported(f"LayerNormalization {what} must be a float constant")
    value = np.asarray(operand.value, dtype=np.float64).reshape(-1)
    if size is not None and value.size not in (1, size):
        raise Unsupported(f"LayerNormalization {what} has {value.size} values for rows of {size}")
    return value


@register
class LayerNormalization(IntegerOp):
    op_type = "LayerNormalization"

    def constants(self, node):
        return {1: Raw(), 2: Raw()}

    def derive(self, view: NodeView) -> LayerNormParams:
        x = per_tensor(view.inputs[0].qparams, "LayerNormalization input")
        y = per_tensor(view.output, "LayerNormalization output")
        if len([o for o in view.node.output if o]) > 1:
            raise Unsupported("LayerNormalization with Mean or InvStdDev outputs")
        gamma = _row_constant(view, 1, "scale", None)
        if gamma is None:
            raise Unsupported("LayerNormalization needs a constant scale")
        axis = int(view.attr("axis", -1))
        scale_shape = np.shape(view.inputs[1].value)
        if axis >= 0 or len(scale_shape) != -axis:
            raise Unsupported(f"LayerNormalization axis {axis} with scale shape {list(scale_shape)}: the "
                              f"row length is read from the scale, whose shape must be the row's")
        n = gamma.size
        beta = _row_constant(view, 2, "bias", n)
        beta = np.zeros(n) if beta is None else np.broadcast_to(beta, (n,))
        span = x.qmax - x.qmin
        s_x, s_y = float(x.scale), float(y.scale)
        epsilon = float(view.attr("epsilon", 1e-5)) * n**3 / s_x**2
        if n * (n * span) ** 2 + epsilon >= 2**T_BITS:
            raise Unsupported(f"LayerNormalization rows of {n} {x.dtype} values would leave int64")
        ratios = gamma * math.sqrt(n) / (2**FRACTION_BITS * s_y)
        live = ratios != 0
        requant = signed_multipliers(np.where(live, ratios, 1.0), view.multiplier_bits)
        # where |beta / S_y| exceeds the output's span plus the most z m_c can add, the output
        # saturates whatever z is: the offset is capped there
        reach = (y.qmax - y.qmin) + np.abs(ratios) * 2**FRACTION_BITS + 2
        bias = np.clip(beta / s_y, -reach, reach)
        multiplier, rshift, offset = [], [], []
        for m, r, b, on, most in zip(requant.multiplier.tolist(), requant.rshift.tolist(), bias.tolist(),
                                     live.tolist(), reach.tolist()):
            if not on:
                m, r = 0, 0
            # a tiny gamma_c asks for a shift that would carry beta_c out of int64: fewer bits of
            # M_c instead (they weigh under 2^-16 LSB there)
            cut = max(0, r - (60 - math.ceil(math.log2(most))))
            m, r = (m >> cut if m >= 0 else -(-m >> cut)), r - cut
            multiplier.append(m), rshift.append(r), offset.append(round(b * 2.0**r))
        multiplier, rshift, offset = (np.array(v, dtype=np.int64) for v in (multiplier, rshift, offset))
        return LayerNormParams(axis, n, int(round(epsilon)), multiplier, rshift, offset,
                               int(y.zero_point), view.rounding, y.dtype)

    def run(self, p: LayerNormParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        if math.prod(x.shape[p.axis:]) != p.size:
            raise ValueError(f"LayerNormalization rows of shape {list(x.shape[p.axis:])}, "
                             f"parameters for {p.size} elements")
        q = x.reshape(-1, p.size).astype(np.int64)
        d = p.size * q - q.sum(axis=1, keepdims=True)
        total = (d * d).sum(axis=1, keepdims=True) + p.epsilon
        k = np.maximum(T_BITS - bit_length(total), 0) // 2
        root = np.maximum(isqrt(np.left_shift(total, 2 * k)), 1)
        z = divide_rounded(np.left_shift(d, FRACTION_BITS + k), root)
        y = rounding_rshift(z * p.multiplier + p.offset, p.rshift, p.rounding)
        return saturate(y + p.zero_out, p.dtype).reshape(x.shape)
