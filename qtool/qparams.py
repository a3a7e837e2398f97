"""Scale and zero point from a calibrated range: ``r = S * (q - Z)``.

Scales are rounded to float32 once, here, because that is what the ONNX model stores; every later
derivation starts from the stored float32 value so quantizer and executor agree bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .fixedpoint import int_range

# A zero-width or non-finite range would give S = 0 or NaN; it is widened to this threshold.
MIN_THRESHOLD = 1e-6
# A range reaching beyond this is clipped to it: an end near float32's largest value (an attention
# mask's -3.4e38 that was not recognized as one) would dequantize to -inf once rounded to a step,
# and 0 * -inf is NaN. Clipped, the largest dequantized value times a weight still fits float32.
RANGE_LIMIT = 1e30


def real_entries(values: np.ndarray) -> np.ndarray | None:
    """Where ``values`` hold real values (not inf, NaN or beyond ``RANGE_LIMIT``: a padding of
    -inf, an attention mask's lowest), or None where all do: two reductions decide that the usual
    tensor has none (NaN fails both comparisons)."""
    values = np.asarray(values)
    if not values.size or values.dtype.kind != "f" or (values.min() > -RANGE_LIMIT and values.max() < RANGE_LIMIT):
        return None
    return np.isfinite(values) & (np.abs(values) < RANGE_LIMIT)


@dataclass(frozen=True)
class QParams:
    """Scale and zero point of one tensor; per-channel fields are arrays along ``axis``."""

    scale: float | np.ndarray
    zero_point: int | np.ndarray
    dtype: str = "int8"
    axis: int | None = None

    @property
    def qmin(self) -> int:
        return int_range(self.dtype)[0]

    @property
    def qmax(self) -> int:
        return int_range(self.dtype)[1]

    @property
    def max_offset(self) -> int:
        """The largest ``|q - Z|`` of the type (per tensor): what bounds a kernel's sums."""
        zero = int(self.zero_point)
        return max(abs(self.qmin - zero), abs(self.qmax - zero))


def _f32(x: float) -> float:
    return float(np.float32(x))


def safe_range(lo: float, hi: float) -> tuple[float, float, bool]:
    """Return ``(lo, hi, changed)``: the range made finite, containing 0, not narrower than
    ``MIN_THRESHOLD`` and within ``RANGE_LIMIT``. ``changed`` tells the caller to report it."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
        return -MIN_THRESHOLD, MIN_THRESHOLD, True
    if lo < -RANGE_LIMIT or hi > RANGE_LIMIT:
        lo, hi = max(lo, -RANGE_LIMIT), min(hi, RANGE_LIMIT)
        return min(lo, 0.0), max(hi, 0.0), True
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi - lo < MIN_THRESHOLD:
        return (lo, lo + MIN_THRESHOLD, True) if lo < 0 else (0.0, MIN_THRESHOLD, True)
    return lo, hi, False


def symmetric(threshold: float, dtype: str = "int8") -> QParams:
    """``S = threshold / qmax`` and ``Z = 0``; uint8 covers [0, threshold] (a non-negative tensor)."""
    _, threshold, _ = safe_range(0.0, abs(float(threshold)))
    _, qmax = int_range(dtype)
    return QParams(_f32(threshold / qmax), 0, dtype)


def asymmetric(lo: float, hi: float, dtype: str = "int8") -> QParams:
    """``S = (max - min) / (qmax - qmin)``, ``Z = round(qmin - min / S)``.

    The range is widened to contain 0 first so that real 0 is exactly representable (padding and
    Relu rely on it).
    """
    lo, hi, _ = safe_range(float(lo), float(hi))
    qmin, qmax = int_range(dtype)
    scale = _f32((hi - lo) / (qmax - qmin))
    zero_point = int(np.clip(round(qmin - lo / scale), qmin, qmax))
    return QParams(scale, zero_point, dtype)


def per_channel_activation(lo: np.ndarray, hi: np.ndarray, dtype: str = "int8", centred: bool = False,
                           axis: int = 1) -> QParams:
    """One (S, Z) per channel along ``axis`` for an activation whose channel ``c`` spans
    ``[lo[c], hi[c]]``: each ``asymmetric``, or with ``centred`` each ``symmetric`` about one zero
    point shared by every channel (0 for int8, 128 for uint8: a depthwise Conv pads with it)."""
    lo, hi = np.asarray(lo, np.float64).reshape(-1), np.asarray(hi, np.float64).reshape(-1)
    qmin, qmax = int_range(dtype)
    if centred:  # each channel ``symmetric`` at int8
        zero = (qmin + qmax + 1) // 2
        threshold = np.maximum(np.abs(lo), np.abs(hi))
        with np.errstate(invalid="ignore"):  # NaN: safe_ranges replaces it
            _, threshold = safe_ranges(np.zeros_like(threshold), threshold)
        scale = (threshold / int_range("int8")[1]).astype(np.float32)
        return QParams(scale, np.full(scale.shape, zero, np.int64), dtype, axis)
    lo, hi = safe_ranges(lo, hi)  # each channel ``asymmetric``
    scale = ((hi - lo) / (qmax - qmin)).astype(np.float32)
    zero_point = np.clip(np.round(qmin - lo / scale.astype(np.float64)), qmin, qmax).astype(np.int64)
    return QParams(scale, zero_point, dtype, axis)


def safe_ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``safe_range`` of each ``(lo[i], hi[i])`` (float64 arrays), without the ``changed`` flags."""
    lo, hi = lo.astype(np.float64, copy=True), hi.astype(np.float64, copy=True)
    with np.errstate(invalid="ignore"):
        bad = ~(np.isfinite(lo) & np.isfinite(hi)) | (lo > hi)
        limited = ~bad & ((lo < -RANGE_LIMIT) | (hi > RANGE_LIMIT))
    lo[limited], hi[limited] = np.maximum(lo[limited], -RANGE_LIMIT), np.minimum(hi[limited], RANGE_LIMIT)
    lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
    narrow = ~bad & ~limited & (hi - lo < MIN_THRESHOLD)
    below = narrow & (lo < 0)
    hi[below] = lo[below] + MIN_THRESHOLD
    at_zero = narrow & ~(lo < 0)
    lo[at_zero], hi[at_zero] = 0.0, MIN_THRESHOLD
    lo[bad], hi[bad] = -MIN_THRESHOLD, MIN_THRESHOLD
    return lo, hi


def per_channel_symmetric(weights: np.ndarray, axis: int = 0, dtype: str = "int8") -> QParams:
    """One symmetric scale per slice along ``axis`` (weights: per output channel)."""
    moved = np.moveaxis(np.asarray(weights, dtype=np.float64), axis, 0)
    thresholds = np.abs(moved.reshape(moved.shape[0], -1)).max(axis=1)
    _, qmax = int_range(dtype)
    thresholds = np.clip(thresholds, MIN_THRESHOLD, RANGE_LIMIT)
    scale = (thresholds / qmax).astype(np.float32)
    return QParams(scale, np.zeros(scale.shape, dtype=np.int64), dtype, axis)


def quantize_array(x: np.ndarray, qp: QParams) -> np.ndarray:
    """Float to integer as ONNX QuantizeLinear does: divide, round half to even, add Z, saturate.

    The quotient is bounded in float first, so that no value leaves int64 when cast (a cast of
    inf, NaN or 1e30 is undefined, and differs between CPUs): ±inf saturate, and NaN, which ONNX
    leaves undefined, becomes the lowest integer (``fmax`` takes the bound over a NaN)."""
    scale, zero_point = _broadcastable(qp, np.ndim(x))
    with np.errstate(over="ignore"):  # a quotient beyond float32 is inf: saturated below
        r = np.asarray(x, dtype=np.float32) / scale
    reach = float(qp.qmax - qp.qmin) + 1.0  # beyond it every value saturates whatever Z is
    lo, hi = float(qp.qmin) - float(np.max(zero_point)) - reach, float(qp.qmax) - float(np.min(zero_point)) + reach
    r = np.fmin(np.fmax(r, np.float32(lo), out=r if r.ndim else None), np.float32(hi), out=r if r.ndim else None)
    q = np.rint(r).astype(np.int64) + zero_point
    return np.clip(q, qp.qmin, qp.qmax).astype(qp.dtype)


def dequantize_array(q: np.ndarray, qp: QParams) -> np.ndarray:
    scale, zero_point = _broadcastable(qp, np.ndim(q))
    q = np.asarray(q)
    if q.dtype.kind in "iu" and q.dtype.itemsize <= 2 and not np.any(np.abs(zero_point) >= 1 << 16):
        # |q - Z| < 2**17 is exact in float32, and the float32 product of exact operands is their
        # exact product (41 bits, exact in float64) rounded once: the floats of the int64 form
        # below, without its int64 and float64 passes (a PP-OCRv4 rec int16 output: 8x faster)
        out = q.astype(np.float32)
        if np.any(zero_point != 0):
            out = out - zero_point.astype(np.float32)
        if out.shape != np.broadcast_shapes(out.shape, scale.shape):
            return out * scale
        out *= scale
        return out
    return ((q.astype(np.int64) - zero_point) * scale).astype(np.float32)


def _broadcastable(qp: QParams, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """Scale (float32) and zero point (int64) shaped to broadcast against a rank-``ndim`` tensor."""
    scale = np.asarray(qp.scale, dtype=np.float32)
    zero_point = np.asarray(qp.zero_point, dtype=np.int64)
    if qp.axis is not None:
        shape = [1] * ndim
        shape[qp.axis] = -1
        scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
    return scale, zero_point


def centered(q: np.ndarray, qp: QParams) -> tuple[np.ndarray, QParams]:
    """A constant's integers with its zero point subtracted (``q − Z``, the same reals with Z = 0):
    int8 where the values fit (uint8 weights with zero point 128), else int16. Setup only."""
    zero = np.asarray(qp.zero_point, dtype=np.int64)
    per_channel = np.size(qp.scale) > 1
    if not np.any(zero != 0):
        return q, qp
    shape = [1] * q.ndim
    if zero.size > 1:
        shape[qp.axis] = -1
    moved = q.astype(np.int16) - zero.reshape(shape).astype(np.int16)
    fits = moved.size == 0 or (moved.min() >= -128 and moved.max() <= 127)
    moved = moved.astype(np.int8 if fits else np.int16)
    return moved, QParams(qp.scale, np.zeros(np.shape(qp.scale), np.int64) if per_channel else 0,
                          str(moved.dtype), qp.axis if per_channel else None)
