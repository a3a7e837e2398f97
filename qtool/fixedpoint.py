"""Fixed-point requantization: a float scale as ``multiplier / 2**rshift`` and the integer shift.

Setup (float) and run (integer) are separate: ``quantize_multiplier`` turns a scale into integers
once; ``rounding_rshift``/``requantize``/``saturate`` touch only int64 arrays.

Conventions (../shared/DESIGN.md, "Fixed-point requantization"):

* 32-bit: ``scale = m * 2**e`` with ``m`` in [0.5, 1); ``multiplier = round(m * 2**31)`` lies in
  [2**30, 2**31) and ``rshift = 31 - e``. A multiplier that rounds to 2**31 is halved and the shift
  reduced by one. ``rshift`` is negative (a left shift) only for scales >= 2**31.
* 8-bit (TPU-MLIR ``getRShiftAndMultiplierFromQScale``, max multiplier 127): the smallest
  ``rshift >= 0`` with ``scale * 2**(rshift + 1) >= 127``, ``multiplier = trunc(scale * 2**rshift)``.
  For scales of 128 and more, where TPU-MLIR clamps the multiplier to 127, the shift goes negative
  (the largest ``multiplier <= 127`` times ``2**-rshift``) so the value is kept.
* The shift rounds in one of ``ROUNDING_MODES``. Products are int64: an int32 accumulator times a
  multiplier below 2**31 stays below 2**62.
* A wider accumulator (16-bit activations: int64, TFLite's 16x8 kernels) takes a multiplier cut
  to fit (``narrowed``): ``bit_length(|acc|) + bit_length(multiplier) <= 63`` for the largest
  accumulator the layer can produce, so the product is still one int64.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

ROUNDING_MODES = ("half_up", "half_away_from_zero", "half_to_even", "toward_zero")
DEFAULT_ROUNDING = "half_up"
MULTIPLIER_BITS = (32, 8)

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_INT_RANGES = {
    "int8": (-128, 127),
    "uint8": (0, 255),
    "int16": (-(2**15), 2**15 - 1),
    "uint16": (0, 2**16 - 1),
    "int32": (INT32_MIN, INT32_MAX),
}


@dataclass(frozen=True)
class Requant:
    """``y = rounding_rshift(x * multiplier, rshift)``; fields are ints or per-channel int64 arrays."""

    multiplier: int | np.ndarray
    rshift: int | np.ndarray


def check_rounding(mode: str) -> str:
    if mode not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding mode {mode!r}; choose one of {', '.join(ROUNDING_MODES)}")
    return mode


def quantize_multiplier(scale: float, bits: int = 32) -> tuple[int, int]:
    """Return ``(multiplier, rshift)`` with ``multiplier / 2**rshift`` approximating ``scale``."""
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    if bits == 32:
        m, e = math.frexp(scale)
        multiplier = math.floor(m * 2**31 + 0.5)  # m * 2**31 is exact in a double
        if multiplier == 2**31:
            multiplier //= 2
            e += 1
        return multiplier, 31 - e
    if bits == 8:
        if scale >= 128:  # TPU-MLIR clamps here; a left shift keeps the value instead
            rshift = -1
            while int(math.ldexp(scale, rshift)) > 127:
                rshift -= 1
        else:
            rshift = 0
            while math.ldexp(scale, rshift + 1) < 127:  # ldexp is exact
                rshift += 1
        return int(math.ldexp(scale, rshift)), rshift
    raise ValueError(f"multiplier bits must be one of {', '.join(map(str, MULTIPLIER_BITS))}, got {bits}")


def quantize_multipliers(scales, bits: int = 32) -> Requant:
    """Per-channel ``quantize_multiplier``: int64 arrays shaped like ``scales``."""
    flat = np.asarray(scales, dtype=np.float64).reshape(-1)
    shape = np.shape(scales)
    if bits == 32 and flat.size and np.all(np.isfinite(flat) & (flat > 0)):
        # quantize_multiplier's 32-bit steps on every channel at once: frexp and the scaling by
        # 2**31 are exact in float64, so the floor rounds the same value
        m, e = np.frexp(flat)
        multiplier = np.floor(m * 2.0**31 + 0.5).astype(np.int64)
        carry = multiplier == 2**31
        multiplier[carry] //= 2
        rshift = 31 - (e.astype(np.int64) + carry)
        return Requant(multiplier.reshape(shape), rshift.reshape(shape))
    pairs = [quantize_multiplier(s, bits) for s in flat]
    multiplier = np.array([p[0] for p in pairs], dtype=np.int64).reshape(shape)
    rshift = np.array([p[1] for p in pairs], dtype=np.int64).reshape(shape)
    return Requant(multiplier, rshift)


def _half_up(x: np.ndarray, r: np.ndarray) -> np.ndarray:
    return np.right_shift(x + np.left_shift(np.int64(1), r - 1), r)


def _half_away_from_zero(x: np.ndarray, r: np.ndarray) -> np.ndarray:
    magnitude = _half_up(np.abs(x), r)
    return np.where(x < 0, -magnitude, magnitude)


# the modes that are "add half, shift" (on |x| for away from zero), for shifts of at least 1
_ADD_HALF = {"half_up": _half_up, "half_away_from_zero": _half_away_from_zero}


def _within(x: np.ndarray, bound: int) -> bool:
    return x.size == 0 or (int(x.min()) > -bound and int(x.max()) < bound)


def rounding_rshift(x, rshift, mode: str = DEFAULT_ROUNDING) -> np.ndarray:
    """``x / 2**rshift`` rounded in ``mode``; ``x`` int64, ``rshift`` broadcastable ints.

    A negative ``rshift`` is a left shift that saturates at about +-2**62. Shifts above 63 act as
    63, which is exact for ``|x| < 2**62`` (the result is 0 in every mode).
    """
    x = np.asarray(x)
    if x.dtype != np.int64:
        raise TypeError(f"rounding_rshift expects int64, got {x.dtype}")
    r = np.asarray(rshift, dtype=np.int64)
    if mode in _ADD_HALF and r.size and r.min() > 0 and _within(x, 2**62):
        # adding half of a shift of at most 63 cannot leave int64: one add and one shift
        return _ADD_HALF[mode](x, np.minimum(r, 63))
    if np.any(r < 0):
        left = np.clip(-r, 0, 62)
        limit = np.right_shift(np.int64(2**62), left)
        x = np.where(r < 0, np.left_shift(np.clip(x, -limit, limit), left), x)
    r = np.clip(r, 1, 63)
    floor = np.right_shift(x, r)
    rem = x - np.left_shift(floor, r)  # in [0, 2**r)
    half = np.left_shift(np.int64(1), r - 1)
    if mode == "half_up":
        up = rem >= half
    elif mode == "half_away_from_zero":
        up = (rem > half) | ((rem == half) & (x >= 0))
    elif mode == "half_to_even":
        up = (rem > half) | ((rem == half) & ((floor & 1) == 1))
    elif mode == "toward_zero":
        up = (rem != 0) & (x < 0)
    else:
        check_rounding(mode)
    shifted = floor + up.astype(np.int64)
    return np.where(np.asarray(rshift) > 0, shifted, x)


def narrowed(requant: Requant, bound) -> Requant:
    """``requant`` with each multiplier cut so that an accumulator of at most ``bound`` (per
    channel, like the multiplier) in absolute value times it fits int64: a multiplier ``k`` bits
    too long becomes ``round_half_up(multiplier / 2**k)`` with ``rshift - k``. Where the bound is
    within int32 a 31-bit multiplier fits already and nothing changes. Setup only."""
    multiplier = np.asarray(requant.multiplier, dtype=np.int64)
    bound = np.broadcast_to(np.asarray(bound, dtype=np.int64), multiplier.shape)
    k = np.maximum(bit_length(np.abs(bound)) + bit_length(np.abs(multiplier)) - 63, 0)
    if not k.any():
        return requant
    half = np.where(k > 0, np.left_shift(np.int64(1), np.maximum(k - 1, 0)), 0)
    cut = np.right_shift(multiplier + half, k)
    rshift = np.asarray(requant.rshift, dtype=np.int64) - k
    if np.ndim(requant.multiplier) == 0:
        return Requant(int(cut), int(rshift))
    return Requant(cut, rshift)


def requantize(acc, multiplier, rshift, mode: str = DEFAULT_ROUNDING) -> np.ndarray:
    """``rounding_rshift(acc * multiplier, rshift)`` with the product in int64.

    An ``acc`` within int32 always fits; a wider one only with a multiplier ``narrowed`` for it
    (else ``OverflowError``, never a wrapped product).
    """
    acc = np.asarray(acc)
    if acc.dtype.kind not in "iu":
        raise TypeError(f"requantize expects an integer accumulator, got {acc.dtype}")
    acc = acc.astype(np.int64, copy=False)
    multiplier = np.asarray(multiplier, dtype=np.int64)
    if acc.size and (acc.min() < INT32_MIN or acc.max() > INT32_MAX):
        # |acc| < 2**a and |M| <= 2**c with c = bit_length(|M| - 1): |acc * M| < 2**(a + c)
        if acc.min() == np.iinfo(np.int64).min or np.any(
                bit_length(np.abs(acc)) + bit_length(np.maximum(np.abs(multiplier) - 1, 0)) > 63):
            raise OverflowError("accumulator exceeds int32 and its multiplier was not narrowed for it")
        return rounding_rshift(acc * multiplier, rshift, mode)
    r = np.asarray(rshift, dtype=np.int64)
    if mode in _ADD_HALF and r.size and r.min() > 0 and np.abs(multiplier).max(initial=0) < 2**31:
        # int32 accumulator times a 31-bit multiplier: |product| < 2**62 without looking
        return _ADD_HALF[mode](acc * multiplier, np.minimum(r, 63))
    return rounding_rshift(acc * multiplier, rshift, mode)


@dataclass(frozen=True)
class OffsetRequant:
    """``saturate(requantize(x + bias) + Z_y)`` (half_up) as one multiply, one add and one shift.

    ``floor(((x + b) * M + 2**(r-1)) / 2**r) + Z_y == floor((x * M + offset) / 2**r)`` with
    ``offset = b * M + 2**(r-1) + Z_y * 2**r``: a multiple of ``2**r`` added before an arithmetic
    shift comes out as that multiple over ``2**r`` after it. Where ``Z_y * 2**r`` would leave
    int64, ``Z_y`` is added after the shift instead (``zero_out``). A channel whose ``x`` is
    always 0 (all its weights 0) is the constant it requantizes to: ``M = 0, r = 0``. Channels
    share one ``rshift`` (a scalar) where scaling ``M`` and ``offset`` by ``2**(rshift - r)``
    stays inside int64.
    ``offset_requant`` builds one where a bound on ``|x|`` proves it equal to ``requantize``.
    Fields are int64 arrays broadcastable against ``x``, one entry per channel.
    """

    multiplier: np.ndarray
    offset: np.ndarray
    rshift: np.ndarray
    zero_out: int  # added after the shift; 0 when folded into ``offset``
    dtype: str

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``x`` integer-valued (a float32 BLAS sum is fine: converting it is exact); the result
        goes to ``out`` if given (a ``dtype`` array shaped like ``x``)."""
        y = x.astype(np.int64)
        y *= self.multiplier
        y += self.offset
        y >>= self.rshift
        if self.zero_out:
            y += self.zero_out
        np.clip(y, *_INT_RANGES[self.dtype], out=y)  # dtype: a normalized name
        if out is None:
            return y.astype(self.dtype)
        np.copyto(out, y, casting="unsafe")  # values inside the type: the cast is exact
        return out


def offset_requant(bias, requant: Requant, zero_out, dtype: str, mode: str,
                   x_bound, exact: bool = False) -> tuple[OffsetRequant, np.ndarray] | None:
    """``OffsetRequant`` equal to ``saturate(requantize(x + bias, M, r, mode) + zero_out, dtype)``
    for every ``|x| <= x_bound``, and the channels whose ``x + bias`` may leave int32: the caller
    must scan those (``requantize`` raises there). None where no such form is proven.

    ``bias``, ``M``, ``r``, ``x_bound`` and ``zero_out`` (one, or one per channel: then folded into
    the offset) broadcast to one entry per channel. Checked per channel
    in Python integers: the mode is half_up; ``1 <= r <= 63`` (``x`` not always 0);
    ``|x * M| + |offset| < 2**63``, so no int64 step overflows.

    The checks run on Python integers (``exact``), or on int64 where a float64 bound puts every
    intermediate below 2**62: the same integers either way, the latter without Python's loops.
    """
    if mode != "half_up":
        return None
    arrays = [np.asarray(v, dtype=np.int64) for v in (bias, requant.multiplier, requant.rshift, x_bound)]
    shape = np.broadcast(*arrays).shape
    flat = [np.broadcast_to(a, shape).reshape(-1) for a in arrays]
    per_channel = np.ndim(zero_out) > 0  # one zero point per channel: folded, or no form
    if per_channel:
        zero_out = np.broadcast_to(np.asarray(zero_out, dtype=np.int64), shape).reshape(-1)
    if exact or not _int64_holds(*flat, zero_out):
        # one entry per channel as Python integers (an object array: numpy runs the loops, the
        # arithmetic is Python's, exact at any size, so no bound below can overflow while checked)
        flat = [a.astype(object) for a in flat]
        if per_channel:
            zero_out = zero_out.astype(object)
        exact = True
    b, m, r, xb = flat
    unproven = np.flatnonzero(((b - xb) < INT32_MIN) | ((b + xb) > INT32_MAX))
    live = xb != 0  # a channel whose x is always 0 is a constant
    if np.any(live & ((r < 1) | (r > 63))):
        return None
    shift = np.where(live, r, 1)
    half, scale = np.left_shift(1, shift - 1), np.left_shift(1, shift)

    def fits(zero) -> bool:
        return bool(np.all(~live | (xb * np.abs(m) + np.abs(b * m + half + zero * scale) < 2**63)))

    fold = fits(zero_out)
    if not fold and (per_channel or not fits(0)):
        return None
    zero = zero_out if fold else 0
    constants = np.zeros(len(b), dtype=object if exact else np.int64)
    # x is 0: the channel's output is its bias requantized
    dead = np.flatnonzero(~live & (b >= INT32_MIN) & (b <= INT32_MAX))
    if dead.size:
        values = requantize(np.array(b[dead].tolist(), dtype=np.int64), np.array(m[dead].tolist(), dtype=np.int64),
                            np.array(r[dead].tolist(), dtype=np.int64), mode)
        constants[dead] = values.tolist()
    multiplier = np.where(live, m, 0)
    offset = np.where(live, b * m + half + zero * scale, constants + zero)
    rshift = np.where(live, r, 0)
    # One shift for every channel where the int64 bound allows: floor(v / 2**r) equals
    # floor(v * 2**k / 2**(r + k)), and numpy shifts by a scalar about twice as fast.
    common = np.max(rshift)
    if _common_shift_fits(xb, multiplier, offset, common - rshift, exact):
        multiplier, offset = np.left_shift(multiplier, common - rshift), np.left_shift(offset, common - rshift)
        rshift = common
    fields = [np.array(v.tolist(), dtype=np.int64).reshape(shape) for v in (multiplier, offset)]
    fields.append(np.int64(rshift) if np.ndim(rshift) == 0 else
                  np.array(rshift.tolist(), dtype=np.int64).reshape(shape))
    return (OffsetRequant(*fields, zero_out=0 if fold else zero_out, dtype=str(np.dtype(dtype))),
            np.array(unproven, dtype=np.int64))


def _int64_holds(bias, multiplier, rshift, x_bound, zero_out) -> bool:
    """Every product, sum and shift ``offset_requant`` forms stays below 2**62 in magnitude, by a
    float64 bound (its relative error, under 2**-50, is far inside the factor 2 left over)."""
    if not bias.size:
        return False
    top = lambda a: float(np.max(np.abs(np.asarray(a, dtype=np.float64))))  # noqa: E731
    if int(np.max(rshift)) > 61 or int(np.min(rshift)) < -63:
        return False
    b, m, xb, z = top(bias), top(multiplier), top(x_bound), top(zero_out)
    return (xb * m + b * m + (z + 1.0) * 2.0 ** int(np.max(rshift)) < 2.0**62) and b + xb < 2.0**62


def _common_shift_fits(xb, multiplier, offset, k, exact: bool) -> bool:
    """``|x * M| + |offset| < 2**63`` with ``M`` and ``offset`` shifted left by ``k`` per channel.
    On int64 a float64 bound decides where it is clearly inside (below 2**62) or outside (2**64
    and up); between the two, and in ``exact`` mode, Python integers do."""
    if not exact:
        bound = ((np.asarray(xb, dtype=np.float64) * np.abs(multiplier.astype(np.float64))
                  + np.abs(offset.astype(np.float64))) * np.exp2(k.astype(np.float64)))
        if np.all(bound < 2.0**62):
            return True
        if np.any(bound >= 2.0**64):
            return False
        xb, multiplier, offset, k = (a.astype(object) for a in (xb, multiplier, offset, k))
    scaled_m, scaled_o = np.left_shift(multiplier, k), np.left_shift(offset, k)
    return bool(np.all(xb * np.abs(scaled_m) + np.abs(scaled_o) < 2**63))


def saturate(x, dtype: str) -> np.ndarray:
    """Clamp to the range of integer ``dtype`` and cast."""
    lo, hi = int_range(dtype)
    return np.clip(x, lo, hi).astype(dtype, copy=False)


def int_range(dtype: str) -> tuple[int, int]:
    try:
        return _int_range(dtype)  # np.dtype() and str() of it take microseconds: remembered
    except TypeError:  # unhashable: looked up as it is
        return _int_range.__wrapped__(dtype)


@functools.lru_cache(maxsize=None)
def _int_range(dtype) -> tuple[int, int]:
    try:
        return _INT_RANGES[str(np.dtype(dtype))]
    except KeyError:
        raise ValueError(f"unsupported integer type {dtype!r}; choose one of {', '.join(_INT_RANGES)}")


def bit_length(x) -> np.ndarray:
    """``int.bit_length`` of each element of a non-negative int64 array (0 for 0), by a binary
    search on shifts: integers only."""
    x = np.asarray(x, dtype=np.int64)
    if x.size and x.min() < 0:
        raise ValueError("bit_length expects non-negative values")
    length = np.zeros(x.shape, dtype=np.int64)
    for step in (32, 16, 8, 4, 2, 1):
        length += step * (np.right_shift(x, length + step - 1) > 0)
    return length + (np.right_shift(x, length) > 0)


def isqrt(x) -> np.ndarray:
    """``floor(sqrt(x))`` of each element of a non-negative int64 array, exactly.

    Newton's iteration on integers, ``s <- (s + x // s) // 2``, from a start at or above the root
    (``2**ceil(bits / 2)``): the iterates fall monotonically to the floor of the root and stop there
    (Heron's method; I-BERT's integer square root)."""
    x = np.asarray(x, dtype=np.int64)
    if x.size and x.min() < 0:
        raise ValueError("isqrt expects non-negative values")
    s = np.left_shift(np.int64(1), (bit_length(x) + 1) // 2)
    while True:
        nxt = np.maximum((s + x // s) // 2, 1)  # 1 only for x = 0, where it stays
        smaller = nxt < s
        if not smaller.any():
            return np.where(x == 0, 0, s)
        s = np.where(smaller, nxt, s)


def divide_away(numerator, denominator) -> np.ndarray:
    """``numerator / denominator`` rounded half away from zero, int64 arrays, ``denominator > 0``;
    the caller keeps ``|numerator| + denominator`` inside int64."""
    numerator = np.asarray(numerator, dtype=np.int64)
    denominator = np.asarray(denominator, dtype=np.int64)
    return np.sign(numerator) * ((np.abs(numerator) + denominator // 2) // denominator)


def divide_rounded(numerator, denominator) -> np.ndarray:
    """``numerator / denominator`` rounded half up, int64 arrays, ``denominator > 0``; the caller
    keeps ``2 * |numerator| + denominator`` inside int64."""
    numerator = np.asarray(numerator, dtype=np.int64)
    denominator = np.asarray(denominator, dtype=np.int64)
    return (2 * numerator + denominator) // (2 * denominator)
