"""Gather from a constant float table (an embedding: BERT's word table [30522, 384]) by run-time
indices, as an integer gather.

The table is stored int8, symmetric, one scale per row (``DequantizeLinear`` with ``axis=0``):
``T[r] = S_r * q_T[r]``. A gathered row requantized to the output's (S_y, Z_y) is
``q_y = requant_r(q_T[r]) + Z_y`` with ``M_r / 2**rshift_r = S_r / S_y``: the per-channel
requantization of seed 003, the channel picked by the index at run time. With one scale for the
table equal to S_y and Z_y = 0 the gather is all there is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import IndexOutOfRange
from ..fixedpoint import Requant, quantize_multipliers, requantize, saturate
from . import IntegerOp, NodeView, Raw, Unsupported, Weight, check_integer, per_tensor, register


@dataclass(frozen=True)
class EmbeddingParams:
    weight: np.ndarray  # the int8 table [rows, ...]
    requant: Requant | None  # per row (arrays [rows]) or one for the table; None: identity
    zero_out: int
    rounding: str
    dtype: str


@register
class Gather(IntegerOp):
    op_type = "Gather"

    def constants(self, node):
        return {0: Weight(axis=0), 1: Raw(at_run=True)}

    def check(self, node, attrs):
        if attrs.get("axis", 0) != 0:
            raise Unsupported(f"Gather axis {attrs['axis']}: only rows of a table (axis 0) are gathered")

    def derive(self, view: NodeView) -> EmbeddingParams:
        self.check(view.node, view.attrs)
        table = view.inputs[0]
        if table is None or table.value is None or table.qparams is None:
            raise Unsupported("Gather data must be a quantized constant table")
        if np.any(np.asarray(table.qparams.zero_point) != 0):
            raise Unsupported("the Gather table must be quantized symmetrically (zero point 0)")
        y = per_tensor(view.output, "Gather output")
        ratio = np.asarray(table.qparams.scale, np.float64) / float(y.scale)
        if np.all(ratio == 1.0) and y.zero_point == 0 and y.dtype == str(table.value.dtype):
            return EmbeddingParams(table.value, None, 0, view.rounding, y.dtype)
        if ratio.size > 1 and ratio.size != table.value.shape[0]:
            raise Unsupported(f"Gather table scales {ratio.shape} are neither one per row nor one")
        requant = quantize_multipliers(ratio if ratio.size > 1 else float(ratio.reshape(-1)[0]),
                                       view.multiplier_bits)
        return EmbeddingParams(table.value, requant, int(y.zero_point), view.rounding, y.dtype)

    def run(self, p: EmbeddingParams, index: np.ndarray) -> np.ndarray:
        check_integer(index, p.weight)
        rows = p.weight.shape[0]
        if index.size and (index.min() < -rows or index.max() >= rows):
            bad = int(index.max()) if index.max() >= rows else int(index.min())
            raise IndexOutOfRange(f"index {bad}, outside the {rows} rows of its table (from {-rows} to {rows - 1})")
        index = np.where(index < 0, index + rows, index).astype(np.int64)
        q = p.weight[index]
        if p.requant is None:
            return q
        multiplier, rshift = np.asarray(p.requant.multiplier), np.asarray(p.requant.rshift)
        if multiplier.ndim:  # the row's own multiplier for each gathered row
            per_row = index.shape + (1,) * (p.weight.ndim - 1)
            multiplier, rshift = multiplier[index].reshape(per_row), rshift[index].reshape(per_row)
        y = requantize(q, multiplier, rshift, p.rounding)
        return saturate(y + p.zero_out, p.dtype)
