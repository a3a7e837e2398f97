"""Relu: ``q_y = max(q_x, Z_x)``; after threshold propagation input and output share (S, Z)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import IntegerOp, NodeView, Rescale, check_integer, per_tensor, register, rescale


@dataclass(frozen=True)
class ReluParams:
    zero_in: int
    rescale: Rescale


@register
class Relu(IntegerOp):
    op_type = "Relu"
    shares_qparams = True
    clamps_below_zero = True

    def derive(self, view: NodeView) -> ReluParams:
        x = per_tensor(view.inputs[0].qparams, "Relu input")
        y = per_tensor(view.output, "Relu output")
        return ReluParams(x.zero_point, rescale(x, y, view))

    def elementwise(self, p: ReluParams) -> bool:
        return True

    def run(self, p: ReluParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        return p.rescale(np.maximum(x, np.asarray(p.zero_in, dtype=x.dtype)))
