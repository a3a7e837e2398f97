"""Reshape and Flatten: integer data moves, values and (S, Z) unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import IntegerOp, NodeView, Raw, Rescale, check_integer, per_tensor, register, rescale


@dataclass(frozen=True)
class ShapeParams:
    rescale: Rescale
    axis: int = 1
    allowzero: int = 0


def onnx_reshape(x: np.ndarray, shape: np.ndarray, allowzero: int = 0) -> np.ndarray:
    target = [int(d) for d in shape]
    if not allowzero:
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    return x.reshape(target)


@register
class Reshape(IntegerOp):
    op_type = "Reshape"
    shares_qparams = True

    def constants(self, node):
        return {1: Raw(at_run=True)}

    def derive(self, view: NodeView) -> ShapeParams:
        x = per_tensor(view.inputs[0].qparams, "Reshape input")
        y = per_tensor(view.output, "Reshape output")
        return ShapeParams(rescale(x, y, view), allowzero=view.attr("allowzero", 0))

    def run(self, p: ShapeParams, x: np.ndarray, shape: np.ndarray) -> np.ndarray:
        check_integer(x, shape)
        return p.rescale(onnx_reshape(x, shape, p.allowzero))


@register
class Flatten(IntegerOp):
    op_type = "Flatten"
    shares_qparams = True

    def derive(self, view: NodeView) -> ShapeParams:
        x = per_tensor(view.inputs[0].qparams, "Flatten input")
        y = per_tensor(view.output, "Flatten output")
        return ShapeParams(rescale(x, y, view), axis=view.attr("axis", 1))

    def run(self, p: ShapeParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        axis = p.axis + x.ndim if p.axis < 0 else p.axis
        outer = int(np.prod(x.shape[:axis], dtype=np.int64))
        return p.rescale(x.reshape(outer, -1))
