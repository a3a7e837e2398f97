"""Add: ``q_y = ((q_a - Z_a) * M_a + (q_b - Z_b) * M_b) >> rshift + Z_y`` with one shared rshift.

This is seed 003's symmetric form (``M_a / 2**rshift = S_a / S_y``) with the zero points
subtracted first, which also covers the asymmetric case without going through float. The larger
ratio sets the shift so that its multiplier has full precision (32-bit or 8-bit); the products
stay below 2**40 in int64. Two 8-bit inputs are looked up in the table of this arithmetic on every
pair (qtool/ops/bytetable.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..fixedpoint import quantize_multiplier, rounding_rshift, saturate
from . import IntegerOp, NodeView, check_integer, per_tensor, register
from . import compiled
from .bytetable import has_pair_table, lookup_pair, lookup_with_scalar, pair_table


@dataclass(frozen=True)
class AddParams:
    multiplier_a: int
    multiplier_b: int
    rshift: int
    zero_a: int
    zero_b: int
    zero_out: int
    rounding: str
    dtype: str


@register
class Add(IntegerOp):
    op_type = "Add"
    accepts_constants = True

    def derive(self, view: NodeView) -> AddParams:
        a = per_tensor(view.inputs[0].qparams, "Add input A")
        b = per_tensor(view.inputs[1].qparams, "Add input B")
        y = per_tensor(view.output, "Add output")
        ratio_a, ratio_b = a.scale / y.scale, b.scale / y.scale
        _, rshift = quantize_multiplier(max(ratio_a, ratio_b), view.multiplier_bits)
        return AddParams(
            multiplier_a=math.floor(math.ldexp(ratio_a, rshift) + 0.5),
            multiplier_b=math.floor(math.ldexp(ratio_b, rshift) + 0.5),
            rshift=rshift,
            zero_a=a.zero_point,
            zero_b=b.zero_point,
            zero_out=y.zero_point,
            rounding=view.rounding,
            dtype=y.dtype,
        )

    def elementwise(self, p: AddParams) -> bool:
        return True

    def run(self, p: AddParams, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        check_integer(a, b)
        if has_pair_table(a, b):
            return lookup_pair(pair_table(_add, p, a.dtype, b.dtype), a, b)
        fast = lookup_with_scalar(_add, p, a, b)
        if fast is None:
            fast = compiled.add_levels(p, a, b)
        return _add(p, a, b) if fast is None else fast


def _add(p: AddParams, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    acc = ((a.astype(np.int64) - p.zero_a) * p.multiplier_a
           + (b.astype(np.int64) - p.zero_b) * p.multiplier_b)
    return saturate(rounding_rshift(acc, p.rshift, p.rounding) + p.zero_out, p.dtype)
