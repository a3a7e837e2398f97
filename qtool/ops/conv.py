"""Conv: ``q_y = ((sum q_x * q_w + b_i32) * M >> rshift) + Z_y`` per output channel.

``b_i32 = round(B / (S_x * S_w)) - Z_x * sum(q_w)`` folds the input zero point into the bias, so
padding fills with ``Z_x`` (real zero) and the weights need zero point 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..fixedpoint import INT32_MAX, Requant, quantize_multipliers, requantize, saturate
from . import Bias, IntegerOp, NodeView, Unsupported, Weight, check_integer, per_tensor, register
from .intmatmul import int_matmul


@dataclass(frozen=True)
class ConvParams:
    weight: np.ndarray  # int8 [C_out, C_in/group, kh, kw]
    bias: np.ndarray  # int64 [C_out], zero-point compensated
    requant: Requant  # per output channel
    zero_in: int
    zero_out: int
    pads: tuple[int, int, int, int]  # top, left, bottom, right
    strides: tuple[int, int]
    dilations: tuple[int, int]
    group: int
    rounding: str
    dtype: str


def accumulator_bias(view: NodeView, bias_index: int | None, weight_q: np.ndarray, axis: int,
                     channel_scale: np.ndarray, zero_in: int) -> np.ndarray:
    """int32 bias in accumulator units minus ``Z_x * sum(q_w)`` per output channel."""
    channels = weight_q.shape[axis]
    sums = np.moveaxis(weight_q.astype(np.int64), axis, 0).reshape(channels, -1).sum(axis=1)
    bias = np.zeros(channels, dtype=np.int64)
    operand = None
    if bias_index is not None and bias_index < len(view.inputs):
        operand = view.inputs[bias_index]
    if operand is not None:
        if operand.qparams is None:
            raise Unsupported("bias must be quantized")
        stored = operand.value.astype(np.int64).reshape(-1)
        bias_scale = np.broadcast_to(np.asarray(operand.qparams.scale, np.float64), (channels,))
        if np.any(np.asarray(operand.qparams.zero_point) != 0):
            raise Unsupported("bias zero point must be 0")
        if np.array_equal(bias_scale.astype(np.float32), channel_scale.astype(np.float32)):
            bias = stored
        else:  # a bias stored at another scale is moved to the accumulator's, at setup
            bias = np.rint(stored * bias_scale / channel_scale).astype(np.int64)
    return bias - zero_in * sums


def weight_scales(view: NodeView, index: int, channels: int, axis: int) -> np.ndarray:
    operand = view.inputs[index]
    if operand is None or operand.value is None or operand.qparams is None:
        raise Unsupported("weight must be a quantized constant")
    qp = operand.qparams
    if np.any(np.asarray(qp.zero_point) != 0):
        raise Unsupported("weight zero point must be 0 (symmetric weights)")
    if qp.axis is not None and qp.axis % operand.value.ndim != axis:
        raise Unsupported(f"weight must be quantized along axis {axis}")
    return np.broadcast_to(np.asarray(qp.scale, dtype=np.float64).reshape(-1), (channels,))


@register
class Conv(IntegerOp):
    op_type = "Conv"

    def constants(self, node):
        return {1: Weight(axis=0), 2: Bias(activation=0, weight=1)}

    def check(self, node, attrs):
        if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID", "NOTSET", "VALID"):
            raise Unsupported("auto_pad SAME_* is not supported")
        if len(attrs.get("kernel_shape", [0, 0])) != 2:
            raise Unsupported("only 2-D convolution is supported")

    def derive(self, view: NodeView) -> ConvParams:
        self.check(view.node, view.attrs)
        x = per_tensor(view.inputs[0].qparams, "Conv input")
        y = per_tensor(view.output, "Conv output")
        weight = view.inputs[1].value
        if weight.ndim != 4:
            raise Unsupported("only 2-D convolution is supported")
        channels = weight.shape[0]
        channel_scale = x.scale * weight_scales(view, 1, channels, 0)
        pads = tuple(view.attr("pads", [0, 0, 0, 0]))
        return ConvParams(
            weight=weight,
            bias=accumulator_bias(view, 2, weight, 0, channel_scale, x.zero_point),
            requant=quantize_multipliers(channel_scale / y.scale, view.multiplier_bits),
            zero_in=x.zero_point,
            zero_out=y.zero_point,
            pads=(pads[0], pads[1], pads[2], pads[3]),
            strides=tuple(view.attr("strides", [1, 1])),
            dilations=tuple(view.attr("dilations", [1, 1])),
            group=view.attr("group", 1),
            rounding=view.rounding,
            dtype=y.dtype,
        )

    def run(self, p: ConvParams, x: np.ndarray) -> np.ndarray:
        check_integer(x, p.weight)
        n, c_out = x.shape[0], p.weight.shape[0]
        top, left, bottom, right = p.pads
        padded = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=p.zero_in)
        acc, out_h, out_w = conv_accumulate(padded, p.weight, p.group, p.strides, p.dilations)
        acc = acc + p.bias[None, :, None]
        y = requantize(acc, p.requant.multiplier[None, :, None], p.requant.rshift[None, :, None],
                       p.rounding)
        return saturate(y + p.zero_out, p.dtype).reshape(n, c_out, out_h, out_w)


def conv_accumulate(x: np.ndarray, weight: np.ndarray, group: int, strides, dilations):
    """``sum x * w`` over each window of the (already padded) integer ``x`` [n, C, H, W], exact:
    returns (int64 [n, C_out, out_h * out_w], out_h, out_w).

    Depthwise (one input channel per group) multiplies and adds tap by tap in int32, or int64
    when the sum could leave int32; every other conv is one batched ``int_matmul`` over the groups.
    """
    n = x.shape[0]
    c_out, c_per_group, kh, kw = weight.shape
    per_group = c_out // group
    if c_per_group == 1:
        return _depthwise(x, weight, per_group, strides, dilations)
    cols, out_h, out_w = _im2col(x, kh, kw, strides, dilations)  # [n, C, kh*kw, L]
    patch = cols.reshape(n, group, c_per_group * kh * kw, out_h * out_w)
    acc = int_matmul(weight.reshape(1, group, per_group, -1), patch)  # [n, group, per_group, L]
    return acc.reshape(n, c_out, out_h * out_w), out_h, out_w


def _depthwise(x: np.ndarray, weight: np.ndarray, per_group: int, strides, dilations):
    n, _, h, w = x.shape
    c_out, _, kh, kw = weight.shape
    sh, sw = strides
    dh, dw = dilations
    out_h = (h - dh * (kh - 1) - 1) // sh + 1
    out_w = (w - dw * (kw - 1) - 1) // sw + 1
    bound = kh * kw * int(np.abs(x).max(initial=0)) * int(np.abs(weight).max(initial=0))
    dtype = np.int32 if bound <= INT32_MAX else np.int64
    if per_group > 1:  # a channel multiplier: output channel o reads input channel o // per_group
        x = np.repeat(x, per_group, axis=1)
    x = x.astype(dtype, copy=False)
    taps = weight.reshape(c_out, kh * kw).astype(dtype)[None, :, :, None, None]
    acc = np.zeros((n, c_out, out_h, out_w), dtype=dtype)
    for i in range(kh):
        for j in range(kw):
            window = x[:, :, i * dh:i * dh + sh * (out_h - 1) + 1:sh, j * dw:j * dw + sw * (out_w - 1) + 1:sw]
            acc += taps[:, :, i * kw + j] * window
    return acc.reshape(n, c_out, out_h * out_w).astype(np.int64), out_h, out_w


def _im2col(x: np.ndarray, kh: int, kw: int, strides, dilations):
    """Patches of ``x`` [n, C, H, W] as [n, C, kh*kw, out_h*out_w] (a copy, integer dtype kept)."""
    n, c, h, w = x.shape
    sh, sw = strides
    dh, dw = dilations
    out_h = (h - dh * (kh - 1) - 1) // sh + 1
    out_w = (w - dw * (kw - 1) - 1) // sw + 1
    cols = np.empty((n, c, kh * kw, out_h, out_w), dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            cols[:, :, i * kw + j] = x[:, :, i * dh:i * dh + sh * out_h:sh, j * dw:j * dw + sw * out_w:sw]
    return cols.reshape(n, c, kh * kw, out_h * out_w), out_h, out_w
