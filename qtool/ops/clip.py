"""Clip as a clamp: ``q_y = clamp(rescale(q_x), Q(min), Q(max))``, ``Q(v) = sat(round(v / S_y) + Z_y)``.

Quantizing is monotone, so clamping the quantized value at the quantized bounds equals quantizing
the clipped value. min and max are optional constant inputs; a computed bound stays float.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import IntegerOp, NodeView, Raw, Rescale, Unsupported, check_integer, per_tensor, register, rescale
from .lut import quantize_real


@dataclass(frozen=True)
class ClipParams:
    rescale: Rescale
    low: int  # quantized bounds, already inside the output type's range
    high: int


@register
class Clip(IntegerOp):
    op_type = "Clip"

    def constants(self, node):
        return {1: Raw(), 2: Raw()}

    def derive(self, view: NodeView) -> ClipParams:
        x = per_tensor(view.inputs[0].qparams, "Clip input")
        y = per_tensor(view.output, "Clip output")
        bounds = []
        for index, name, default in ((1, "min", -np.inf), (2, "max", np.inf)):
            operand = view.inputs[index] if index < len(view.inputs) else None
            if operand is None:
                bounds.append(default)
                continue
            if operand.qparams is not None or operand.value is None or np.size(operand.value) != 1:
                raise Unsupported(f"Clip {name} must be a constant scalar")
            bounds.append(float(np.asarray(operand.value).reshape(-1)[0]))
        low, high = (int(q) for q in quantize_real(bounds, y, view.rounding))
        return ClipParams(rescale(x, y, view), low, high)

    def elementwise(self, p: ClipParams) -> bool:
        return True

    def run(self, p: ClipParams, x: np.ndarray, *bounds: np.ndarray) -> np.ndarray:
        # bounds: the float min/max constants the executor passes along; derive already folded them
        check_integer(x)
        y = p.rescale(x)
        return np.minimum(np.maximum(y, np.asarray(p.low, y.dtype)), np.asarray(p.high, y.dtype))
