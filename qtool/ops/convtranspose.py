"""ConvTranspose 2-D: ``q_y = ((sum q_x * q_w + b_i32 - Z_x * sum_valid q_w) * M >> rshift) + Z_y``.

The weight is ``[C_in, C_out/group, kh, kw]``: output channel ``g * C_out/group + c`` reads slice
``c`` of axis 1 within group ``g``, so per-channel scales run along axis 1 (shared by the groups).
The kernel scatters: one exact integer GEMM per group (``int_matmul``, int8 x int8 products) gives,
for every input pixel, its contribution to each tap; the taps are added (int64) into the
``(H - 1) * stride + dilation * (k - 1) + 1 + output_padding`` output, then ``pads`` are cropped.

Zero-point compensation: ``sum (q_x - Z_x) q_w = sum q_x q_w - Z_x * sum q_w`` where the second
sum runs over the taps that reach the output pixel. Unlike Conv, that set varies with the position
(borders, and the stride phase: a 2x2 stride-2 kernel gives each pixel one tap), so the
compensation is ``Z_x`` times ConvTranspose of an all-ones input, an integer map built by the same
scatter from the per-tap channel sums of the weight. The bias itself is ``round(B / (S_x * S_w))``
(``accumulator_bias`` without the uniform term).

Where the weights prove it (``ConvTransposePlan``, per input shape), the kernel instead multiplies
``q_x - Z_x`` on float32, so the input's real zeros need no compensation, adds the taps in
float32, and requantizes with ``OffsetRequant``; a stride equal to the kernel (PP-OCR's 2x2,
stride 2) places each tap's product without any addition.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..fixedpoint import (Requant, int_range, offset_requant, quantize_multipliers, requantize,
                          saturate)
from . import (Bias, IntegerOp, NodeView, Unsupported, Weight, node_attrs, parallel,
               per_tensor, plan_for, register)
from .conv import Tail, accumulator_bias, byte_halves, check_int32, fitted_requant, join_halves, weight_scales
from .intmatmul import FLOAT32_EXACT, int_matmul


@dataclass(frozen=True)
class ConvTransposeParams:
    weight: np.ndarray  # int8 [C_in, C_out/group, kh, kw]
    tap_sums: np.ndarray  # int64 [C_out, kh, kw]: sum of q_w over the group's input channels
    bias: np.ndarray  # int64 [C_out], accumulator units, no zero-point term
    requant: Requant  # per output channel
    zero_in: int
    zero_out: int
    pads: tuple[int, int, int, int]  # top, left, bottom, right
    strides: tuple[int, int]
    dilations: tuple[int, int]
    output_padding: tuple[int, int]
    group: int
    rounding: str
    dtype: str


def _text(value, default: str) -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else value


@register
class ConvTranspose(IntegerOp):
    op_type = "ConvTranspose"

    def constants(self, node):
        # Per channel along axis 1. With groups, the quantizer would need to tile the C_out/group
        # scales to the bias's C_out entries, which it does not: grouped weights go per tensor.
        axis = 1 if node_attrs(node).get("group", 1) == 1 else None
        return {1: Weight(axis=axis), 2: Bias(activation=0, weight=1)}

    def check(self, node, attrs):
        if _text(attrs.get("auto_pad"), "NOTSET") not in ("NOTSET", "VALID"):
            raise Unsupported("auto_pad SAME_* is not supported")
        if attrs.get("output_shape") is not None:
            raise Unsupported("the output_shape attribute is not supported")
        if len(attrs.get("kernel_shape", [0, 0])) != 2:
            raise Unsupported("only 2-D ConvTranspose is supported")

    def derive(self, view: NodeView) -> ConvTransposeParams:
        self.check(view.node, view.attrs)
        x = per_tensor(view.inputs[0].qparams, "ConvTranspose input")
        y = per_tensor(view.output, "ConvTranspose output")
        weight = view.inputs[1].value
        if weight is None or weight.ndim != 4:
            raise Unsupported("only 2-D ConvTranspose is supported")
        group = int(view.attr("group", 1))
        c_in, per_group, kh, kw = weight.shape
        if c_in % group:
            raise Unsupported("input channels do not divide into groups")
        c_out = per_group * group
        channel_scale = x.scale * np.tile(weight_scales(view, 1, per_group, 1), group)
        # the group's weights as Conv lays them out: [C_out, C_in/group, kh, kw]
        conv_layout = (weight.reshape(group, c_in // group, per_group, kh, kw)
                       .transpose(0, 2, 1, 3, 4).reshape(c_out, c_in // group, kh, kw))
        pads = tuple(view.attr("pads", [0, 0, 0, 0]))
        if _text(view.attr("auto_pad"), "NOTSET") == "VALID":
            pads = (0, 0, 0, 0)
        bias = accumulator_bias(view, 2, conv_layout, 0, channel_scale, 0)
        return ConvTransposeParams(
            weight=weight,
            tap_sums=conv_layout.astype(np.int64).sum(axis=1),
            bias=bias,
            # an output sums a subset of its channel's taps, less Z_x times theirs: bounded by all
            requant=fitted_requant(channel_scale / y.scale, view, conv_layout, 0,
                                   np.abs(bias) + abs(x.zero_point) * _l1(conv_layout), x),
            zero_in=x.zero_point,
            zero_out=y.zero_point,
            pads=(pads[0], pads[1], pads[2], pads[3]),
            strides=tuple(view.attr("strides", [1, 1])),
            dilations=tuple(view.attr("dilations", [1, 1])),
            output_padding=tuple(view.attr("output_padding", [0, 0])),
            group=group,
            rounding=view.rounding,
            dtype=y.dtype,
        )

    def specialize(self, p: ConvTransposeParams, shapes) -> "ConvTransposePlan":
        return ConvTransposePlan.of(p, tuple(shapes[0]))

    def run(self, p: "ConvTransposeParams | ConvTransposePlan", x: np.ndarray) -> np.ndarray:
        params, plan = plan_for(p, x, ConvTransposePlan)
        tail = plan.tails.get(x.dtype)
        if tail is None and x.dtype == np.int16 and plan.split16 is not None:
            return _run_tail(plan, plan.split16, x, split=True)
        if tail is None:
            return run_scanned(params, x)
        return _run_tail(plan, tail, x)


def _run_tail(plan: "ConvTransposePlan", tail: Tail, x: np.ndarray, split: bool = False) -> np.ndarray:
    """The float32 sums of ``plan`` requantized by ``tail``. ``split``: an int16 input (zero point
    0) as ``256 * hi + lo``, its high bytes (int8) and low bytes (0 to 255) summed apart, each
    exact in float32 (``ConvTransposePlan.split16``), and joined in int64."""
    params = plan.params
    n, _, h, w = x.shape
    _, per_group, kh, kw = params.weight.shape
    c_out = per_group * params.group
    if split:
        inputs = byte_halves(x)
    else:
        inputs = [x.astype(np.float32)]
        inputs[0] -= params.zero_in  # real zero is 0: taps outside the input need no compensation
    inputs = [v.reshape(n, params.group, -1, h * w) for v in inputs]
    out = np.empty((n, c_out, *plan.out_hw), dtype=params.dtype)
    # with ``shuffle``, input rows [start, stop) fill output rows [start * kh, stop * kh)
    target = out.reshape(n, c_out, h, kh, w, kw) if plan.shuffle else None

    def rows(start: int, stop: int) -> None:
        acc = plan.accumulate(inputs[0], start, stop)
        if split:
            acc = join_halves(acc, plan.accumulate(inputs[1], start, stop))
        if tail.unproven.size:
            bias = params.bias[tail.unproven].reshape((-1,) + (1,) * (acc.ndim - 2))
            check_int32(acc[:, tail.unproven], bias)
        tail.requant(acc, out=target[:, :, start:stop] if plan.shuffle else out)

    parallel.run_parts(rows, plan.row_parts)
    return out


def _l1(weight: np.ndarray) -> np.ndarray:
    return np.abs(weight.astype(np.int64)).reshape(weight.shape[0], -1).sum(axis=1)


def run_scanned(p: ConvTransposeParams, x: np.ndarray) -> np.ndarray:
    """Exact int64 sums with the zero-point map, and ``requantize``, which scans for overflow."""
    n, c_in, h, w = x.shape
    _, per_group, kh, kw = p.weight.shape
    c_per_group = c_in // p.group
    sh, sw = p.strides
    dh, dw = p.dilations
    full_h = (h - 1) * sh + dh * (kh - 1) + 1 + p.output_padding[0]
    full_w = (w - 1) * sw + dw * (kw - 1) + 1 + p.output_padding[1]
    acc = np.zeros((n, per_group * p.group, full_h, full_w), dtype=np.int64)

    def tap(i, j):  # the output pixels that tap (i, j) of the input pixels reaches
        return (slice(i * dh, i * dh + (h - 1) * sh + 1, sh),
                slice(j * dw, j * dw + (w - 1) * sw + 1, sw))

    for g in range(p.group):
        xg = x[:, g * c_per_group:(g + 1) * c_per_group].reshape(n, c_per_group, h * w)
        wg = p.weight[g * c_per_group:(g + 1) * c_per_group].reshape(c_per_group, -1).T
        contrib = int_matmul(wg[None], xg).reshape(n, per_group, kh, kw, h, w)
        out = acc[:, g * per_group:(g + 1) * per_group]
        for i in range(kh):
            for j in range(kw):
                out[(slice(None), slice(None), *tap(i, j))] += contrib[:, :, i, j]
    if p.zero_in:
        reached = np.zeros(acc.shape[1:], dtype=np.int64)  # ConvTranspose of an all-ones input
        for i in range(kh):
            for j in range(kw):
                reached[(slice(None), *tap(i, j))] += p.tap_sums[:, i, j, None, None]
        acc -= p.zero_in * reached[None]
    top, left, bottom, right = p.pads
    acc = acc[:, :, top:full_h - bottom, left:full_w - right] + p.bias[None, :, None, None]
    y = requantize(acc, p.requant.multiplier[None, :, None, None],
                   p.requant.rshift[None, :, None, None], p.rounding)
    return saturate(y + p.zero_out, p.dtype)


@dataclass(frozen=True)
class ConvTransposePlan:
    """A ConvTranspose specialized for one input shape: float32 weights, and per input type the
    tail where the weights prove float32 exact and the accumulator in range.

    The kernel multiplies ``d = q_x - Z_x`` (``|d| <= max(qmax - Z_x, Z_x - qmin)``, a bound of
    the input type). Output channel o of a pixel sums ``d * q_w`` over input channels and the taps
    that reach it, at most once per weight, so every partial sum of the BLAS and of the tap
    additions is at most ``l1_o * max|d|`` (``l1_o = sum |q_w|`` of the channel); below 2**24 it
    is exact in float32. ``offset_requant`` then proves the int32 range with the bias (as Conv).
    """

    params: ConvTransposeParams
    in_shape: tuple[int, ...]
    out_hw: tuple[int, int]
    weight: np.ndarray  # float32 [group, C_out/group * kh * kw, C_in/group]
    shuffle: bool  # stride == kernel, no dilation, pads or output padding: each output pixel one tap
    tails: dict  # input np.dtype -> conv.Tail
    row_parts: tuple[tuple[int, int], ...]  # input row ranges, one per thread (``shuffle``), else all

    @classmethod
    def of(cls, p: ConvTransposeParams, shape: tuple[int, ...]) -> "ConvTransposePlan":
        if len(shape) != 4:
            raise ValueError(f"ConvTranspose is 2-D: got input shape {shape}")
        _, c_in, h, w = shape
        _, per_group, kh, kw = p.weight.shape
        if c_in != p.weight.shape[0]:
            raise ValueError(f"ConvTranspose input {shape} does not match weight {p.weight.shape}")
        (sh, sw), (dh, dw) = p.strides, p.dilations
        top, left, bottom, right = p.pads
        out_hw = ((h - 1) * sh + dh * (kh - 1) + 1 + p.output_padding[0] - top - bottom,
                  (w - 1) * sw + dw * (kw - 1) + 1 + p.output_padding[1] - left - right)
        shuffle = ((sh, sw) == (kh, kw) and (dh, dw) == (1, 1) and not any(p.pads)
                   and not any(p.output_padding))
        c_per_group = c_in // p.group
        weight = (p.weight.astype(np.float32).reshape(p.group, c_per_group, per_group * kh * kw)
                  .transpose(0, 2, 1).copy())
        c_out = per_group * p.group
        # the group's weights of output channel g * per_group + o: weight[g, o*kh*kw:(o+1)*kh*kw]
        l1 = np.abs(weight.astype(np.int64)).reshape(c_out, -1).sum(axis=1)
        column = (-1,) + (1,) * (4 if shuffle else 2)  # broadcast over [h, kh, w, kw] or [H, W]
        tails = {}
        for dtype in (np.dtype(np.int8), np.dtype(np.uint8)):
            lo, hi = int_range(dtype)
            if not lo <= p.zero_in <= hi:
                continue
            d_max = max(hi - p.zero_in, p.zero_in - lo)
            if int(l1.max(initial=0)) * d_max >= FLOAT32_EXACT:
                continue
            fused = offset_requant(p.bias.reshape(column), Requant(p.requant.multiplier.reshape(column),
                                                                   p.requant.rshift.reshape(column)),
                                   p.zero_out, p.dtype, p.rounding, (l1 * d_max).reshape(column))
            if fused is not None:
                tails[dtype] = Tail.of(fused)
        rows = parallel.ranges(h, shape[0] * c_out * out_hw[0] * out_hw[1]) if shuffle else ((0, h),)
        return cls(p, tuple(shape), out_hw, weight, shuffle, tails, rows)

    @functools.cached_property
    def split16(self) -> Tail | None:
        """For int16 inputs with zero point 0 (made on the first one): the tail after the sums of
        their high and low bytes (``_run_tail``), proven for every int16 input; None where the
        weights do not bound the halves' sums below 2**24 (the low bytes reach 255)."""
        p = self.params
        c_out = p.weight.shape[1] * p.group
        l1 = np.abs(self.weight.astype(np.int64)).reshape(c_out, -1).sum(axis=1)  # as ``of``'s
        if p.zero_in != 0 or int(l1.max(initial=0)) * 255 >= FLOAT32_EXACT:
            return None
        column = (-1,) + (1,) * (4 if self.shuffle else 2)
        fused = offset_requant(p.bias.reshape(column), Requant(p.requant.multiplier.reshape(column),
                                                               p.requant.rshift.reshape(column)),
                               p.zero_out, p.dtype, p.rounding, (l1 * 32768).reshape(column))
        return None if fused is None else Tail.of(fused)

    def accumulate(self, shifted: np.ndarray, start: int, stop: int) -> np.ndarray:
        """float32 sums from input rows [start, stop) of ``shifted`` (``q_x - Z_x``, [n, group,
        C_in/group, h * w]): with ``shuffle`` [n, C_out, stop - start, kh, w, kw] (output pixel
        (r*kh + i, c*kw + j) is tap (i, j) of input pixel (r, c)), else all rows, [n, C_out, out_h,
        out_w]."""
        p = self.params
        n, _, h, w = self.in_shape
        _, per_group, kh, kw = p.weight.shape
        rows = stop - start
        contrib = np.matmul(self.weight, shifted[..., start * w:stop * w])
        contrib = contrib.reshape(n, p.group * per_group, kh, kw, rows, w)
        if self.shuffle:
            return contrib.transpose(0, 1, 4, 2, 5, 3)
        (sh, sw), (dh, dw) = p.strides, p.dilations
        top, left, bottom, right = p.pads
        full_h = (h - 1) * sh + dh * (kh - 1) + 1 + p.output_padding[0]
        full_w = (w - 1) * sw + dw * (kw - 1) + 1 + p.output_padding[1]
        acc = np.zeros((n, p.group * per_group, full_h, full_w), dtype=np.float32)
        for i in range(kh):
            for j in range(kw):
                acc[:, :, i * dh:i * dh + (h - 1) * sh + 1:sh, j * dw:j * dw + (w - 1) * sw + 1:sw] += \
                    contrib[:, :, i, j]
        return acc[:, :, top:full_h - bottom, left:full_w - right]
