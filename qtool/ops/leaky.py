"""LeakyRelu and PRelu (DESIGN.md): input and output share (S, Z) by threshold propagation.

Positive branch ``q_x - Z_x + Z_y`` (a rescale when the scales differ), negative branch
``((q_x - Z_x) * M_c >> rshift) + Z_y`` with ``M_c / 2**rshift = alpha_c S_x / S_y``. PRelu has
one multiplier per slope element and one shared rshift, set by the largest |slope| so that its
multiplier has full width (31 bits, or 7 with 8-bit multipliers); smaller slopes get fewer bits.
The slopes are the dequantized int8 constants onnxruntime multiplies by in the QDQ model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..fixedpoint import quantize_multiplier, requantize, saturate
from ..qparams import dequantize_array
from . import (IntegerOp, NodeView, Rescale, Unsupported, Weight, check_integer, per_tensor, register,
               rescale)


@dataclass(frozen=True)
class LeakyParams:
    positive: Rescale
    multiplier: np.ndarray  # int64, signed, broadcastable against the input (PRelu: slope's shape)
    rshift: int
    zero_in: int
    zero_out: int
    rounding: str
    dtype: str


def _derive(view: NodeView, slopes: np.ndarray) -> LeakyParams:
    x = per_tensor(view.inputs[0].qparams, f"{view.node.op_type} input")
    y = per_tensor(view.output, f"{view.node.op_type} output")
    ratios = np.asarray(slopes, dtype=np.float64) * (x.scale / y.scale)
    largest = float(np.abs(ratios).max(initial=0.0))
    rshift = quantize_multiplier(largest, view.multiplier_bits)[1] if largest > 0 else 0
    magnitude = np.floor(np.ldexp(np.abs(ratios), rshift) + 0.5).astype(np.int64)
    multiplier = np.where(ratios < 0, -magnitude, magnitude)
    return LeakyParams(rescale(x, y, view), multiplier, rshift, x.zero_point,
                       y.zero_point, view.rounding, y.dtype)


def _run(p: LeakyParams, x: np.ndarray) -> np.ndarray:
    check_integer(x)
    acc = x.astype(np.int64) - p.zero_in
    negative = saturate(requantize(acc, p.multiplier, p.rshift, p.rounding) + p.zero_out, p.dtype)
    return np.where(acc >= 0, p.positive(x), negative)


@register
class LeakyRelu(IntegerOp):
    op_type = "LeakyRelu"
    shares_qparams = True

    def derive(self, view: NodeView) -> LeakyParams:
        alpha = view.attr("alpha", np.float32(0.01))  # a float32 attribute, as onnxruntime uses it
        return _derive(view, np.array(alpha))

    def elementwise(self, p: LeakyParams) -> bool:
        return True

    def run(self, p: LeakyParams, x: np.ndarray) -> np.ndarray:
        return _run(p, x)


@register
class PRelu(IntegerOp):
    op_type = "PRelu"
    shares_qparams = True

    def constants(self, node):
        return {1: Weight(axis=0)}  # [C, 1, 1] slopes: per channel; [1] or scalar: per tensor

    def elementwise(self, p: LeakyParams) -> bool:
        return np.size(p.multiplier) == 1  # else one slope per channel

    def derive(self, view: NodeView) -> LeakyParams:
        slope = view.inputs[1]
        if slope is None or slope.value is None or slope.qparams is None:
            raise Unsupported("PRelu needs a quantized constant slope")
        return _derive(view, dequantize_array(slope.value, slope.qparams))

    def run(self, p: LeakyParams, x: np.ndarray) -> np.ndarray:
        return _run(p, x)
