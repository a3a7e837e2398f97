"""Pooling.

MaxPool compares integers and shares (S, Z) with its input. With ``ceil_mode=1`` its output has
``ceil((n + pads - (k - 1) * d - 1) / s) + 1`` positions per axis, less the last when that window
would start past the input and its leading pad (the ONNX spec, as onnxruntime and PyTorch): the
input is padded at the end with the type's minimum as far as the last window reaches, so a window
running past the end takes the max of its valid elements. AveragePool and GlobalAveragePool
(seed 003): ``q_y = requant(sum(q_x - Z_x)) + Z_y`` with ``M / 2**rshift = S_x / (S_y * k)``,
which is the seed's ``Scale * sum(q_x) - Offset`` with the offset folded into the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..fixedpoint import Requant, narrowed, quantize_multipliers, requantize, saturate
from . import IntegerOp, NodeView, Rescale, Unsupported, check_integer, per_tensor, register, rescale
from .conv import _im2col


@dataclass(frozen=True)
class Window:
    kernel: tuple[int, int]
    pads: tuple[int, int, int, int]  # top, left, bottom, right
    strides: tuple[int, int]
    dilations: tuple[int, int]
    ceil_mode: bool = False

    def _ceil_extra(self, size: int, axis: int) -> int:
        """Positions past the end padding that the last ceil_mode window of an axis reaches."""
        if not self.ceil_mode:
            return 0
        begin, end = self.pads[axis], self.pads[axis + 2]
        reach = (self.kernel[axis] - 1) * self.dilations[axis] + 1
        stride = self.strides[axis]
        out = -(-(size + begin + end - reach) // stride) + 1
        if (out - 1) * stride >= size + begin:  # that window would start in the end padding
            out -= 1
        return max((out - 1) * stride + reach - (size + begin + end), 0)

    def patches(self, x: np.ndarray, fill: int):
        """[n, C, kh*kw, out_h, out_w] windows of ``x`` padded with ``fill``."""
        top, left, bottom, right = self.pads
        bottom += self._ceil_extra(x.shape[2], 0)
        right += self._ceil_extra(x.shape[3], 1)
        padded = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=fill)
        cols, out_h, out_w = _im2col(padded, *self.kernel, self.strides, self.dilations)
        return cols.reshape(*cols.shape[:3], out_h, out_w)


    def tap_sums(self, x: np.ndarray, fill: int) -> np.ndarray:
        """``sum`` over each window of ``x`` (8- or 16-bit) padded with ``fill``, [n, C, out_h,
        out_w] int32: one strided slice added per tap, instead of a copy of every window."""
        top, left, bottom, right = self.pads
        if any(self.pads):
            x = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=fill)
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.strides, self.dilations
        out_h = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1
        out_w = (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
        acc = np.zeros((*x.shape[:2], out_h, out_w), dtype=np.int32)
        for i in range(kh):
            for j in range(kw):
                rows = slice(i * dh, i * dh + sh * (out_h - 1) + 1, sh)
                acc += x[:, :, rows, j * dw:j * dw + sw * (out_w - 1) + 1:sw]
        return acc


def _window(view: NodeView) -> Window:
    kernel = tuple(view.attr("kernel_shape"))
    if len(kernel) != 2:
        raise Unsupported("only 2-D pooling is supported")
    if view.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise Unsupported("auto_pad SAME_* is not supported")
    pads = tuple(view.attr("pads", [0, 0, 0, 0]))
    return Window(kernel, (pads[0], pads[1], pads[2], pads[3]), tuple(view.attr("strides", [1, 1])),
                  tuple(view.attr("dilations", [1, 1])), bool(view.attr("ceil_mode", 0)))


@dataclass(frozen=True)
class MaxPoolParams:
    window: Window
    fill: int  # the input type's minimum: never wins a comparison
    rescale: Rescale


@register
class MaxPool(IntegerOp):
    op_type = "MaxPool"
    shares_qparams = True

    def derive(self, view: NodeView) -> MaxPoolParams:
        if len(view.node.output) > 1 and view.node.output[1]:
            raise Unsupported("the Indices output is not supported")
        x = per_tensor(view.inputs[0].qparams, "MaxPool input")
        y = per_tensor(view.output, "MaxPool output")
        return MaxPoolParams(_window(view), x.qmin, rescale(x, y, view))

    def run(self, p: MaxPoolParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        return p.rescale(p.window.patches(x, p.fill).max(axis=2))


@register
class GlobalMaxPool(IntegerOp):
    """The largest value of each channel over its spatial axes: with one (S, Z) in and out the
    largest level is the level of the largest value (a rescale where they differ)."""

    op_type = "GlobalMaxPool"
    shares_qparams = True

    def derive(self, view: NodeView) -> Rescale:
        x = per_tensor(view.inputs[0].qparams, "GlobalMaxPool input")
        y = per_tensor(view.output, "GlobalMaxPool output")
        return rescale(x, y, view)

    def run(self, p: Rescale, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        if x.ndim < 3:
            raise ValueError(f"GlobalMaxPool needs [N, C, ...], got shape {x.shape}")
        return p(x.max(axis=tuple(range(2, x.ndim)), keepdims=True))


@dataclass(frozen=True)
class AverageSetup:
    """What an average's derivation needs besides the element count. GlobalAveragePool's count
    is the input's spatial size, known only once a shape arrives: ``specialize`` finishes it."""

    scale_ratio: float  # S_x / S_y, to be divided by the count
    zero_in: int
    zero_out: int
    multiplier_bits: int
    rounding: str
    dtype: str
    in_bound: int = 0  # the largest |q_x - Z_x| of the input type: count * it bounds the sum

    @classmethod
    def of(cls, view: NodeView) -> "AverageSetup":
        op = view.node.op_type
        x = per_tensor(view.inputs[0].qparams, f"{op} input")
        y = per_tensor(view.output, f"{op} output")
        return cls(x.scale / y.scale, x.zero_point, y.zero_point, view.multiplier_bits, view.rounding,
                   y.dtype, x.max_offset)

    def params(self, window: "Window | None", count: int) -> "AvgPoolParams":
        # an int16 map's sum passes int32 from 2**16 elements on: the multiplier narrowed for it
        requant = narrowed(quantize_multipliers(self.scale_ratio / count, self.multiplier_bits),
                           count * self.in_bound)
        return AvgPoolParams(window, requant, self.zero_in, self.zero_out, self.rounding, self.dtype)


@dataclass(frozen=True)
class AvgPoolParams:
    window: Window | None  # None: global
    requant: Requant
    zero_in: int
    zero_out: int
    rounding: str
    dtype: str


def _avg_params(view: NodeView, window: Window | None, count: int) -> AvgPoolParams:
    return AverageSetup.of(view).params(window, count)


def _avg_run(p: AvgPoolParams, summed: np.ndarray) -> np.ndarray:
    y = requantize(summed, p.requant.multiplier, p.requant.rshift, p.rounding)
    return saturate(y + p.zero_out, p.dtype)


@register
class AveragePool(IntegerOp):
    op_type = "AveragePool"

    def derive(self, view: NodeView) -> AvgPoolParams:
        window = _window(view)
        if window.ceil_mode:  # the windows past the end would average fewer elements
            raise Unsupported("ceil_mode=1 is not supported")
        if any(window.pads) and not view.attr("count_include_pad", 0):
            raise Unsupported("padding with count_include_pad=0 is not supported")
        return _avg_params(view, window, window.kernel[0] * window.kernel[1])

    def run(self, p: AvgPoolParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        # padding with Z_x adds real zeros, which count_include_pad=1 averages in
        kh, kw = p.window.kernel
        if x.dtype.itemsize > 2 or kh * kw >= 2**15:  # a sum that int32 may not hold
            patches = p.window.patches(x, p.zero_in).astype(np.int64) - p.zero_in
            return _avg_run(p, patches.sum(axis=2))
        return _avg_run(p, p.window.tap_sums(x, p.zero_in).astype(np.int64) - p.zero_in * kh * kw)




@register
class GlobalAveragePool(IntegerOp):
    op_type = "GlobalAveragePool"

    def derive(self, view: NodeView) -> AverageSetup:
        return AverageSetup.of(view)

    def specialize(self, setup: AverageSetup, shapes) -> AvgPoolParams:
        return setup.params(None, int(np.prod(shapes[0][2:], dtype=np.int64)))

    def run(self, p: AvgPoolParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        count = int(np.prod(x.shape[2:], dtype=np.int64))
        # sum(q - Z) = sum(q) - Z * count, without a wider copy of x; in int32 where it must fit
        wide = np.int32 if x.dtype.itemsize <= 2 and count < 2**15 else np.int64
        summed = x.reshape(*x.shape[:2], -1).sum(axis=2, dtype=wide).astype(np.int64) - p.zero_in * count
        return _avg_run(p, summed).reshape(*x.shape[:2], *([1] * (x.ndim - 2)))
