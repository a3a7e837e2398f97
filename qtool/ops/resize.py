"""Resize: nearest, linear and cubic.

Input and output share (S, Z) (``shares_qparams``): nearest only moves values and a bilinear value
is a convex combination of its neighbours, so the output range lies in the input's.

* nearest: pure data movement, one index table per axis, computed at setup exactly as onnxruntime
  does (float32 coordinates, its ``nearest_mode`` rounding, clamped to the input), for the
  coordinate modes half_pixel, asymmetric, pytorch_half_pixel, tf_half_pixel_for_nearest and
  align_corners (tf_crop_and_resize, with its roi and extrapolation, is not supported).
* linear (bilinear on the last two axes; any leading axes must keep their size): each output
  coordinate ``c`` (clamped to the input) gives neighbours ``i0 = floor(c)``, ``i1 = min(i0 + 1,
  n - 1)`` and the fraction ``l = c - i0``, stored as ``w1 = round(l * 2**K)``, ``w0 = 2**K - w1``
  (K = ``FRACTION_BITS``). The kernel accumulates exactly in int64
  ``acc = sum wy * wx * (q_x - Z_x)`` (scale ``S_x / 4**K``) and requantizes once with
  ``M / 2**rshift = S_x / (S_y * 4**K)`` (a power of two when S_x = S_y, so exact), then ``+ Z_y``.

  LSB bound: rounding each weight moves it by at most ``2**-(K+1)``; since a bilinear value changes
  along one axis by at most the neighbours' difference (<= 255 steps of the 8-bit input), the
  accumulated value is off by at most ``255 / 2**K + 510 / 4**(K+1) < 0.125`` input LSB at K = 11.
  With S_x = S_y the result is the exact interpolation rounded once after an error below 0.125, so
  it differs from a float reference by at most 1 LSB, and not at all when every fraction is a
  multiple of 2**-K (2x upsampling: fractions 0.25 / 0.75). ``|acc| <= 255 * 4**11 < 2**31``;
  an int16 input's sums reach ``32767 * 4**11`` (int64), and the multiplier is narrowed for them.
* cubic (on the last two axes, as linear): each output coordinate ``c`` (not clamped) has the four
  taps ``floor(c) - 1 .. floor(c) + 2``, clamped to the input (edge values), weighted by the cubic
  convolution kernel of ONNX's ``cubic_coeff_a`` at ``t = c - floor(c)``; with ``exclude_outside``
  the taps beyond the input get 0 and the others are scaled to sum to 1. The weights are stored
  as integers of ``2**CUBIC_BITS`` whose sum per output is exactly ``2**CUBIC_BITS`` (the largest
  takes the rounding remainder), so a flat region stays exact. The kernel accumulates
  ``sum wy * wx * (q_x - Z_x)`` in int64 (16 taps) and requantizes once with
  ``M / 2**rshift = S_x / (S_y * 4**CUBIC_BITS)``, its multiplier narrowed so that the largest
  possible sum times it stays in int64. Weights are negative in the lobes, so the value may leave
  the input's range a little: it saturates at the output type. Rounding the weights moves a value
  by at most ``sum |dw| * max|q - Z|``, under 0.03 LSB of an 8-bit input at 16 bits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..fixedpoint import Requant, narrowed, quantize_multipliers, requantize, saturate
from . import IntegerOp, NodeView, Raw, Rescale, Unsupported, check_integer, per_tensor, register, rescale
from .layout import raw_input

FRACTION_BITS = 11
CUBIC_BITS = 16  # the cubic weights' fraction bits (their sums need int64 anyway: narrowed)
# "tf_half_pixel_for_nn" is onnxruntime's spelling of the ONNX "tf_half_pixel_for_nearest"
COORDINATE_MODES = ("half_pixel", "asymmetric", "pytorch_half_pixel", "tf_half_pixel_for_nearest",
                    "tf_half_pixel_for_nn", "align_corners")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
RUN_TIME_PLANS = 16  # plans kept per Resize whose targets arrive at run time (the oldest go first)


def _text(value, default: str) -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class ResizeSetup:
    mode: str
    coordinate_mode: str
    nearest_mode: str
    scales: tuple[float, ...] | None  # float32 values, as the model stores them
    sizes: tuple[int, ...] | None
    rescale: Rescale  # nearest
    requant: Requant | None  # linear: S_x / (S_y * 4**FRACTION_BITS); cubic: 4**CUBIC_BITS
    zero_in: int
    zero_out: int
    rounding: str
    dtype: str
    cubic_a: float = -0.75  # cubic_coeff_a
    exclude_outside: bool = False
    in_bound: int = 0  # the largest |q_x - Z_x| of the input type (narrows the multiplier)
    # the inputs that reach ``run`` after the data, by index (2: scales, 3: sizes), and whether
    # their values are read there (computed at run time: a decoder's sizes from a Shape node)
    named: tuple[int, ...] = ()
    at_run: bool = False


@dataclass
class RunTimePlan:
    """A Resize whose scales or sizes are computed at run time: its plans, one for each input
    shape and target met (few: the sizes follow from shapes)."""

    setup: ResizeSetup
    plans: dict


@dataclass(frozen=True)
class CubicPlan:
    out_lead: tuple[int, ...]
    y_index: np.ndarray  # [out_h, 4] input rows of each output row
    y_weight: np.ndarray  # [out_h, 4] int64, each row summing to 2**CUBIC_BITS
    x_index: np.ndarray  # [out_w, 4]
    x_weight: np.ndarray
    requant: Requant  # narrowed for the largest |acc|
    zero_in: int
    zero_out: int
    rounding: str
    dtype: str


@dataclass(frozen=True)
class NearestPlan:
    rescale: Rescale
    index: tuple[np.ndarray | None, ...]  # per axis, the input index of each output index


@dataclass(frozen=True)
class LinearPlan:
    out_lead: tuple[int, ...]  # the leading (unscaled) dimensions
    y0: np.ndarray
    y1: np.ndarray
    wy0: np.ndarray  # int64, wy0 + wy1 = 2**FRACTION_BITS
    wy1: np.ndarray
    x0: np.ndarray
    x1: np.ndarray
    wx0: np.ndarray
    wx1: np.ndarray
    requant: Requant
    zero_in: int
    zero_out: int
    rounding: str
    dtype: str


def output_shape(setup: ResizeSetup, shape: tuple[int, ...]) -> tuple[list[int], list[np.float32]]:
    """Output dimensions and per-axis float32 scales as onnxruntime computes them."""
    if setup.sizes is not None:
        if len(setup.sizes) != len(shape):
            raise ValueError(f"Resize sizes {list(setup.sizes)} do not match the input's rank {len(shape)}")
        scales = [np.float32(np.float32(o) / np.float32(i)) if i else np.float32(1)
                  for o, i in zip(setup.sizes, shape)]
        return list(setup.sizes), scales
    if len(setup.scales) != len(shape):
        raise ValueError(f"Resize scales {list(setup.scales)} do not match the input's rank {len(shape)}")
    scales = [np.float32(s) for s in setup.scales]
    return [int(s * np.float32(i)) for s, i in zip(scales, shape)], scales


def _targets(scales, sizes) -> tuple[tuple[float, ...] | None, tuple[int, ...] | None]:
    """Resize's scales and sizes inputs as tuples (None when absent or empty)."""
    scales = None if scales is None or np.size(scales) == 0 else tuple(
        float(s) for s in np.asarray(scales).astype(np.float32).reshape(-1))
    sizes = None if sizes is None or np.size(sizes) == 0 else tuple(int(s) for s in np.asarray(sizes).reshape(-1))
    if scales is None and sizes is None:
        raise Unsupported("Resize needs scales or sizes")
    if scales is not None and not all(np.isfinite(s) and s > 0 for s in scales):
        raise Unsupported(f"Resize scales must be positive and finite, got {list(scales)}")
    if sizes is not None and min(sizes) <= 0:
        raise Unsupported(f"Resize sizes must be positive, got {list(sizes)}")
    return scales, sizes


def original_coordinates(mode: str, out_len: int, in_len: int, scale: np.float32) -> np.ndarray:
    """Input coordinate of each output index, in float32 like onnxruntime."""
    x = np.arange(out_len, dtype=np.float32)
    half = np.float32(0.5)
    if mode == "asymmetric":
        return x / scale
    if mode == "half_pixel":
        return (x + half) / scale - half
    if mode == "pytorch_half_pixel":
        return (x + half) / scale - half if out_len > 1 else np.zeros(out_len, np.float32)
    if mode in ("tf_half_pixel_for_nearest", "tf_half_pixel_for_nn"):
        return (x + half) / scale
    if mode == "align_corners":
        if out_len == 1:
            return np.zeros(out_len, np.float32)
        return x * np.float32(in_len - 1) / np.float32(out_len - 1)
    raise ValueError(f"unknown coordinate transformation mode {mode!r}")


def nearest_index(coords: np.ndarray, mode: str, in_len: int) -> np.ndarray:
    c = coords.astype(np.float64)  # float32 values: every step below is exact in float64
    away = np.sign(c) * np.floor(np.abs(c) + 0.5)  # C's round(): half away from zero
    if mode == "round_prefer_floor":
        idx = np.where(c == np.trunc(c) + 0.5, np.floor(c), away)
    elif mode == "round_prefer_ceil":
        idx = away
    elif mode == "floor":
        idx = np.floor(c)
    elif mode == "ceil":
        idx = np.ceil(c)
    else:
        raise ValueError(f"unknown nearest mode {mode!r}")
    return np.clip(idx, 0, in_len - 1).astype(np.int64)


def cubic_coefficients(t: np.ndarray, a: float) -> np.ndarray:
    """[n, 4] weights of the taps at floor(c) - 1 .. floor(c) + 2 for fractions ``t`` in [0, 1)
    (Keys' cubic convolution with parameter ``a``, as the ONNX Resize operator defines it)."""
    t = np.asarray(t, dtype=np.float64)[:, None]
    d = np.concatenate([t + 1, t, 1 - t, 2 - t], axis=1)  # distance of each tap
    near = ((a + 2) * d - (a + 3)) * d * d + 1  # |d| <= 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a  # 1 < |d| < 2
    return np.where(d <= 1, near, far)


def cubic_taps(coords: np.ndarray, in_len: int, a: float, exclude_outside: bool, bits: int = CUBIC_BITS):
    """Indices ([n, 4], clamped to the input) and integer weights ([n, 4], each row summing to
    exactly ``2**bits``) of each coordinate."""
    c = coords.astype(np.float64)
    base = np.floor(c)
    weights = cubic_coefficients(c - base, a)
    index = base.astype(np.int64)[:, None] + np.arange(-1, 3)
    if exclude_outside:
        weights = np.where((index >= 0) & (index < in_len), weights, 0.0)
        weights = weights / weights.sum(axis=1, keepdims=True)
    index = np.clip(index, 0, in_len - 1)
    w = np.floor(weights * 2**bits + 0.5).astype(np.int64)
    largest = np.argmax(np.abs(weights), axis=1)
    w[np.arange(len(w)), largest] += 2**bits - w.sum(axis=1)
    return index, w


def linear_taps(coords: np.ndarray, in_len: int, bits: int = FRACTION_BITS):
    """Neighbours and fixed-point weights (``w0 + w1 = 2**bits``) of each coordinate."""
    c = np.clip(coords, np.float32(0), np.float32(in_len - 1)).astype(np.float64)
    i0 = np.minimum(np.floor(c).astype(np.int64), in_len - 1)
    i1 = np.minimum(i0 + 1, in_len - 1)
    w1 = np.floor((c - i0) * 2**bits + 0.5).astype(np.int64)
    return i0, i1, 2**bits - w1, w1


@register
class Resize(IntegerOp):
    op_type = "Resize"
    shares_qparams = True

    def constants(self, node):
        return {1: Raw(), 2: Raw(at_run=True), 3: Raw(at_run=True)}

    def check(self, node, attrs):
        mode = _text(attrs.get("mode"), "nearest")
        if mode not in ("nearest", "linear", "cubic"):
            raise Unsupported(f"Resize mode {mode!r} is not supported")
        coordinate = _text(attrs.get("coordinate_transformation_mode"), "half_pixel")
        if coordinate not in COORDINATE_MODES:
            raise Unsupported(f"coordinate_transformation_mode {coordinate!r} is not supported")
        nearest = _text(attrs.get("nearest_mode"), "round_prefer_floor")
        if mode == "nearest" and nearest not in NEAREST_MODES:
            raise Unsupported(f"nearest_mode {nearest!r} is not supported")
        if attrs.get("antialias", 0):
            raise Unsupported("antialias is not supported")
        if attrs.get("axes") is not None:
            raise Unsupported("the axes attribute is not supported")
        if _text(attrs.get("keep_aspect_ratio_policy"), "stretch") != "stretch":
            raise Unsupported("keep_aspect_ratio_policy other than stretch is not supported")
        if len(node.input) < 3:
            raise Unsupported("Resize before opset 11 is not supported")

    def derive(self, view: NodeView) -> ResizeSetup:
        self.check(view.node, view.attrs)
        x = per_tensor(view.inputs[0].qparams, "Resize input")
        y = per_tensor(view.output, "Resize output")
        raw_input(view, 1, "Resize roi")  # a constant (tf_crop_and_resize, which reads it, is refused)
        named = tuple(i for i in (2, 3) if i < len(view.node.input) and view.node.input[i])
        at_run = any(view.inputs[i].value is None for i in named)
        scales = sizes = None
        if not at_run:
            scales, sizes = _targets(*(view.inputs[i].value if i in named else None for i in (2, 3)))
        mode = view.attr("mode", "nearest")
        requant = None
        if mode in ("linear", "cubic"):
            if scales is not None and (len(scales) < 2 or any(s != 1 for s in scales[:-2])):
                raise Unsupported(f"{mode} Resize only on the last two axes")
            bits = FRACTION_BITS if mode == "linear" else CUBIC_BITS
            requant = quantize_multipliers(x.scale / (y.scale * 4**bits), view.multiplier_bits)
        return ResizeSetup(mode, view.attr("coordinate_transformation_mode", "half_pixel"),
                           view.attr("nearest_mode", "round_prefer_floor"), scales, sizes,
                           rescale(x, y, view), requant, x.zero_point, y.zero_point, view.rounding,
                           y.dtype, float(view.attr("cubic_coeff_a", np.float32(-0.75))),
                           bool(view.attr("exclude_outside", 0)),
                           x.max_offset,
                           named, at_run)

    def specialize(self, setup: ResizeSetup, shapes) -> NearestPlan | LinearPlan | CubicPlan | RunTimePlan:
        if setup.at_run:
            return RunTimePlan(setup, {})
        return self._plan(setup, tuple(shapes[0]))

    def _plan(self, setup: ResizeSetup, shape: tuple[int, ...]) -> NearestPlan | LinearPlan | CubicPlan:
        out, scales = output_shape(setup, shape)
        if any(o <= 0 for o, i in zip(out, shape) if i > 0):
            raise ValueError(f"Resize from {list(shape)} gives an empty output {out}")
        if setup.mode == "nearest":
            index = []
            for o, i, s in zip(out, shape, scales):
                idx = nearest_index(original_coordinates(setup.coordinate_mode, o, i, s),
                                    setup.nearest_mode, i)
                index.append(None if o == i and np.array_equal(idx, np.arange(i)) else idx)
            return NearestPlan(setup.rescale, tuple(index))
        if len(shape) < 2 or tuple(out[:-2]) != shape[:-2]:
            raise ValueError(f"Resize ({setup.mode}) from {list(shape)} to {out} changes a leading axis")
        if setup.mode == "cubic":
            taps = []
            for o, i, s in zip(out[-2:], shape[-2:], scales[-2:]):
                coords = (np.arange(o, dtype=np.float32) if s == 1 else
                          original_coordinates(setup.coordinate_mode, o, i, s))
                taps.append(cubic_taps(coords, i, setup.cubic_a, setup.exclude_outside))
            (yi, yw), (xi, xw) = taps
            bound = setup.in_bound * int(np.abs(yw).sum(axis=1).max()) * int(np.abs(xw).sum(axis=1).max())
            return CubicPlan(tuple(out[:-2]), yi, yw, xi, xw, narrowed(setup.requant, bound), setup.zero_in,
                             setup.zero_out, setup.rounding, setup.dtype)
        taps = []
        for o, i, s in zip(out[-2:], shape[-2:], scales[-2:]):
            if s == 1:  # onnxruntime keeps the coordinate as is when an axis is not scaled
                coords = np.arange(o, dtype=np.float32)
            else:
                coords = original_coordinates(setup.coordinate_mode, o, i, s)
            taps.append(linear_taps(coords, i))
        (y0, y1, wy0, wy1), (x0, x1, wx0, wx1) = taps
        # an int16 input's sums pass int32 (32767 * 4**11): the multiplier narrowed for them
        requant = narrowed(setup.requant, setup.in_bound * 4**FRACTION_BITS)
        return LinearPlan(tuple(out[:-2]), y0, y1, wy0, wy1, x0, x1, wx0, wx1, requant,
                          setup.zero_in, setup.zero_out, setup.rounding, setup.dtype)

    def run(self, p: NearestPlan | LinearPlan | CubicPlan | RunTimePlan, x: np.ndarray, *targets) -> np.ndarray:
        check_integer(x)
        if isinstance(p, RunTimePlan):
            values = dict(zip(p.setup.named, targets))
            try:
                scales, sizes = _targets(values.get(2), values.get(3))
            except Unsupported as e:
                raise ValueError(str(e)) from None  # "Resize ...": the executor's one-line error
            key = (x.shape, scales, sizes)
            if key not in p.plans:
                if len(p.plans) >= RUN_TIME_PLANS:  # inputs of ever new sizes: memory stays bounded
                    del p.plans[next(iter(p.plans))]
                p.plans[key] = self._plan(replace(p.setup, scales=scales, sizes=sizes, at_run=False), x.shape)
            p = p.plans[key]
        if isinstance(p, NearestPlan):
            for axis, idx in enumerate(p.index):
                if idx is not None:
                    x = np.take(x, idx, axis=axis)
            return p.rescale(x)
        if isinstance(p, CubicPlan):
            d = x.astype(np.int64) - p.zero_in
            rows = sum(d[..., p.y_index[:, k], :] * p.y_weight[:, k, None] for k in range(4))
            acc = sum(rows[..., p.x_index[:, k]] * p.x_weight[:, k] for k in range(4))
            y = requantize(acc, p.requant.multiplier, p.requant.rshift, p.rounding)
            return saturate(y + p.zero_out, p.dtype)
        d = x.astype(np.int64) - p.zero_in
        rows = d[..., p.y0, :] * p.wy0[:, None] + d[..., p.y1, :] * p.wy1[:, None]
        acc = rows[..., p.x0] * p.wx0 + rows[..., p.x1] * p.wx1  # scale S_x / 4**FRACTION_BITS
        y = requantize(acc, p.requant.multiplier, p.requant.rshift, p.rounding)
        return saturate(y + p.zero_out, p.dtype)
