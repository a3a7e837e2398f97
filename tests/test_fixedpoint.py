"""Fixed-point core: exact tables and properties against exact rational arithmetic."""

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.fixedpoint import (INT32_MAX, INT32_MIN, ROUNDING_MODES, Requant, _int64_holds, offset_requant,
                              quantize_multiplier, quantize_multipliers, requantize, rounding_rshift,
                              saturate)
from qtool.qparams import MIN_THRESHOLD, RANGE_LIMIT, asymmetric, per_channel_activation, symmetric

# (scale, multiplier, rshift); each row checked by hand: multiplier / 2**rshift vs scale.
TABLE_32 = [
    (0.1234, 2119995857, 34),  # TPU-MLIR's worked example
    (0.25, 1073741824, 32),  # = 2**30 / 2**32 exactly
    (0.5, 1073741824, 31),
    (1.0, 1073741824, 30),  # scale 1: M0 = 0.5, shift 30
    (3.0, 1610612736, 29),  # scale >= 1: 0.75 * 2**31 >> 29
    (0.99999999, 2147483627, 31),  # near 1 from below: 0.99999999 * 2**31 = 2147483626.52
    (1 - 2**-40, 1073741824, 30),  # rounds to 2**31: halved, shift one less
    (2.0**-40, 1073741824, 70),  # tiny
    (1e-10, 1844674407, 64),  # tiny: 0.8589934592 * 2**31 = 1844674407.37, e = -33
    (2.0**31, 1073741824, -1),  # >= 2**31: a left shift
    (2.0**31 - 1, 2147483647, 0),
]

TABLE_8 = [
    (0.1234, 126, 10),  # TPU-MLIR's worked example: 0.1234 * 2**10 = 126.36
    (1.0, 64, 6),  # 2**7 >= 127 first at rshift 6
    (0.5, 64, 7),
    (63.4, 126, 1),  # 63.4 * 2 = 126.8 < 127, so rshift 1
    (63.5, 63, 0),  # 63.5 * 2 = 127 >= 127
    (100.0, 100, 0),
    (127.0, 127, 0),
    (127.5, 127, 0),  # trunc
    (128.0, 64, -1),  # beyond TPU-MLIR's clamp: 64 << 1
    (255.0, 127, -1),  # 127 << 1 = 254, the closest with M <= 127
    (300.0, 75, -2),
]


@pytest.mark.parametrize("scale,multiplier,rshift", TABLE_32)
def test_multiplier_32_table(scale, multiplier, rshift):
    assert quantize_multiplier(scale, 32) == (multiplier, rshift)


@pytest.mark.parametrize("scale,multiplier,rshift", TABLE_8)
def test_multiplier_8_table(scale, multiplier, rshift):
    assert quantize_multiplier(scale, 8) == (multiplier, rshift)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_multiplier_rejects_bad_scales(bad):
    with pytest.raises(ValueError, match="finite and > 0"):
        quantize_multiplier(bad)


def test_multiplier_rejects_other_widths():
    with pytest.raises(ValueError, match="one of"):
        quantize_multiplier(0.5, 16)


def test_per_channel_multipliers_match_scalar():
    scales = np.array([0.1234, 1.0, 3.0, 2.0**-40])
    r = quantize_multipliers(scales)
    assert r.multiplier.tolist() == [2119995857, 1073741824, 1610612736, 1073741824]
    assert r.rshift.tolist() == [34, 30, 29, 70]


def test_per_channel_multipliers_are_the_scalar_ones_at_every_exponent_and_at_the_carry():
    # the vectorized 32-bit path against quantize_multiplier one scale at a time, over 90 octaves,
    # the mantissas just under 1 (the multiplier rounds up to 2**31 and halves) and a 2-D shape
    rng = np.random.default_rng(0)
    below_one = np.nextafter(1.0, 0.0) * 2.0 ** np.arange(-20, 20)
    for scales in (np.exp(rng.uniform(-60, 30, 2000)), below_one, np.float32(rng.uniform(0, 1, (3, 5)) + 1e-6)):
        r = quantize_multipliers(scales)
        pairs = [quantize_multiplier(s) for s in np.ravel(scales)]
        assert r.multiplier.shape == r.rshift.shape == np.shape(scales)
        assert r.multiplier.ravel().tolist() == [m for m, _ in pairs]
        assert r.rshift.ravel().tolist() == [s for _, s in pairs]
    assert quantize_multipliers(below_one).multiplier.tolist() == [2**30] * len(below_one)
    with pytest.raises(ValueError, match="finite and > 0"):
        quantize_multipliers(np.array([0.5, 0.0]))


scales = st.floats(min_value=1e-30, max_value=2.0**31 - 1, allow_nan=False, allow_infinity=False)


@given(scales)
def test_multiplier_32_in_range_and_accurate(scale):
    multiplier, rshift = quantize_multiplier(scale, 32)
    assert 2**30 <= multiplier < 2**31
    error = abs(Fraction(multiplier, 1) / Fraction(2) ** rshift - Fraction(scale)) / Fraction(scale)
    assert error <= Fraction(1, 2**31)


@given(st.floats(min_value=1e-12, max_value=127.0))
def test_multiplier_8_matches_tpu_mlir_rule(scale):
    multiplier, rshift = quantize_multiplier(scale, 8)
    assert rshift >= 0
    # smallest rshift with scale * 2**(rshift+1) >= 127, multiplier = trunc(scale * 2**rshift)
    assert Fraction(scale) * 2 ** (rshift + 1) >= 127
    assert rshift == 0 or Fraction(scale) * 2**rshift < 127
    assert multiplier == math.floor(Fraction(scale) * 2**rshift)
    assert multiplier <= 127


def _exact(value: Fraction, mode: str) -> int:
    """Rounding of an exact rational, written independently of the shift arithmetic."""
    if mode == "half_up":
        return math.floor(value + Fraction(1, 2))
    if mode == "half_away_from_zero":
        sign = 1 if value >= 0 else -1
        return sign * math.floor(abs(value) + Fraction(1, 2))
    if mode == "half_to_even":
        return round(value)  # Fraction.__round__ rounds half to even
    if mode == "toward_zero":
        return math.trunc(value)
    raise AssertionError(mode)


int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)


@settings(max_examples=400)
@given(int32, st.integers(min_value=-(2**31) + 1, max_value=2**31 - 1),
       st.integers(min_value=0, max_value=80), st.sampled_from(ROUNDING_MODES))
def test_requantize_matches_exact_rational_rounding(acc, multiplier, rshift, mode):
    got = requantize(np.array([acc], dtype=np.int32), multiplier, rshift, mode)[0]
    assert got == _exact(Fraction(acc * multiplier, 2**rshift), mode)


@settings(max_examples=200)
@given(st.lists(st.integers(-(2**20), 2**20), min_size=1, max_size=8),
       st.integers(min_value=1, max_value=40),
       st.sampled_from(ROUNDING_MODES))
def test_rounding_rshift_ties(values, rshift, mode):
    # put values exactly on .5 boundaries, where the modes differ
    ties = np.array([v * 2**rshift + 2 ** (rshift - 1) for v in values], dtype=np.int64)
    got = rounding_rshift(ties, rshift, mode)
    assert got.tolist() == [_exact(Fraction(int(t), 2**rshift), mode) for t in ties]


def test_rounding_modes_on_halves():
    x = np.array([-5, -3, -1, 1, 3, 5], dtype=np.int64)  # /2 -> -2.5 -1.5 -0.5 0.5 1.5 2.5
    assert rounding_rshift(x, 1, "half_up").tolist() == [-2, -1, 0, 1, 2, 3]
    assert rounding_rshift(x, 1, "half_away_from_zero").tolist() == [-3, -2, -1, 1, 2, 3]
    assert rounding_rshift(x, 1, "half_to_even").tolist() == [-2, -2, 0, 0, 2, 2]
    assert rounding_rshift(x, 1, "toward_zero").tolist() == [-2, -1, 0, 0, 1, 2]


def test_negative_rshift_is_a_saturating_left_shift():
    x = np.array([-3, 5, 2**61, -(2**61)], dtype=np.int64)
    assert rounding_rshift(x, -3).tolist() == [-24, 40, 2**62, -(2**62)]


def test_per_channel_shift_broadcasts():
    acc = np.array([[100, 100], [-100, -100]], dtype=np.int32)
    got = requantize(acc, np.array([1, 3]), np.array([1, 2]))
    assert got.tolist() == [[50, 75], [-50, -75]]


def test_requantize_takes_a_wide_accumulator_only_where_the_product_fits_int64():
    # 2**31 * 2**30 = 2**61: exact; a 34-bit sum times a 31-bit multiplier would not fit
    assert requantize(np.array([2**31], dtype=np.int64), 2**30, 31).tolist() == [2**30]
    with pytest.raises(OverflowError, match="not narrowed"):
        requantize(np.array([2**33], dtype=np.int64), 2**30 + 1, 31)


def test_requantize_rejects_float_input():
    with pytest.raises(TypeError):
        requantize(np.array([1.5]), 2**30, 31)


def test_saturate_clamps_to_type():
    x = np.array([-1000, -129, -128, 0, 127, 128, 1000], dtype=np.int64)
    assert saturate(x, "int8").tolist() == [-128, -128, -128, 0, 127, 127, 127]
    assert saturate(x, "uint8").tolist() == [0, 0, 0, 0, 127, 128, 255]
    assert saturate(x, "int8").dtype == np.int8


@pytest.mark.parametrize("mode", ROUNDING_MODES)
def test_requantize_extremes(mode):
    # the largest products (|acc| 2**31, |multiplier| 2**31 - 1) with the shifts where adding half
    # comes closest to int64's limit
    accs = np.array([-(2**31), 2**31 - 1, -1, 1, 0], dtype=np.int64)
    for multiplier in (2**31 - 1, -(2**31) + 1):
        for rshift in (1, 31, 62, 63, 64):
            got = requantize(accs, multiplier, rshift, mode)
            assert got.tolist() == [_exact(Fraction(int(a) * multiplier, 2**rshift), mode) for a in accs]


# -- the folded tail: requantize(x + bias) + Z_y as one multiply, add and shift -----------------------

def _reference_tail(x, bias, multiplier, rshift, zero_out, dtype):
    return saturate(requantize(x + bias, multiplier, rshift, "half_up") + zero_out, dtype)


@settings(max_examples=300)
@given(st.lists(st.tuples(int32, st.integers(1, 2**31 - 1), st.integers(1, 63), st.integers(0, 2**24)),
                min_size=1, max_size=4),
       st.integers(-128, 255), st.sampled_from(["int8", "uint8", "int16", "int32"]),
       st.integers(0, 2**32 - 1))
def test_offset_requant_equals_requantize_within_its_bound(channels, zero_out, dtype, seed):
    bias, multiplier, rshift, bound = (np.array(v, dtype=np.int64) for v in zip(*channels))
    column = (slice(None), None)  # one row of x per channel
    built = offset_requant(bias[column], Requant(multiplier[column], rshift[column]), zero_out, dtype,
                           "half_up", bound[column])
    if built is None:  # only where x * M + b * M + 2**(r-1) may leave int64
        assert any(xb * m + abs(b * m + 2 ** (r - 1)) >= 2**63 for b, m, r, xb in channels if xb)
        return
    tail, unproven = built
    # every |x| <= bound: the extremes and random values, one row per channel
    rng = np.random.default_rng(seed)
    x = np.concatenate([-bound[:, None], bound[:, None], np.zeros((len(bound), 1), np.int64),
                        rng.integers(-bound[:, None], bound[:, None] + 1, size=(len(bound), 50))], axis=1)
    fits = ((x + bias[:, None] >= INT32_MIN) & (x + bias[:, None] <= INT32_MAX)).all(axis=1)
    assert set(np.nonzero(~fits)[0].tolist()) <= set(unproven.tolist())
    rows = np.nonzero(fits)[0]
    got = tail(x)[rows]
    want = _reference_tail(x[rows], bias[rows, None], multiplier[rows, None], rshift[rows, None], zero_out,
                           dtype)
    assert got.dtype == np.dtype(dtype) and got.tolist() == want.tolist()


def _same_offset_requant(args, zero_out):
    fast, exact = (offset_requant(*args[:2], zero_out, *args[2:], exact=e) for e in (False, True))
    assert (fast is None) == (exact is None)
    if fast is not None:
        (a, ua), (b, ub) = fast, exact
        for field in ("multiplier", "offset", "rshift"):
            assert np.asarray(getattr(a, field)).tolist() == np.asarray(getattr(b, field)).tolist(), field
            assert np.asarray(getattr(a, field)).dtype == np.int64
        assert (a.zero_out == b.zero_out if np.ndim(a.zero_out) == 0 else
                np.asarray(a.zero_out).tolist() == np.asarray(b.zero_out).tolist())
        assert a.dtype == b.dtype and ua.tolist() == ub.tolist()
    return fast


@settings(max_examples=400)
@given(st.lists(st.tuples(int32, st.integers(1, 2**31 - 1), st.integers(1, 63),
                          st.one_of(st.integers(0, 2**24), st.integers(2**24, 2**40))), min_size=1, max_size=6),
       st.one_of(st.integers(-2**15, 2**16), st.lists(st.integers(-128, 255), min_size=6, max_size=6)))
def test_offset_requant_on_int64_builds_what_python_integers_build(channels, zero_out):
    # the int64 path (taken where a float bound keeps everything under 2**62) and the Python
    # integers give the same fields, and the same None, on both sides of every bound
    bias, multiplier, rshift, bound = (np.array(v, dtype=np.int64) for v in zip(*channels))
    if isinstance(zero_out, list):
        zero_out = np.array(zero_out[:len(bias)], dtype=np.int64)
    _same_offset_requant((bias, Requant(multiplier, rshift), "int16", "half_up", bound), zero_out)
    # both paths are reached: small cases go through int64, the largest through Python integers
    if int(bound.max()) <= 2**24 and np.abs(bias).max() < 2**28 and int(rshift.max()) <= 40 \
            and np.max(np.abs(zero_out)) < 2**16:  # under 2**55 + 2**59 + 2**56
        assert _int64_holds(bias, multiplier, rshift, bound, zero_out)
    if int(bound.max()) * int(multiplier.max()) > 2**62:  # the largest of each, as _int64_holds bounds them
        assert not _int64_holds(bias, multiplier, rshift, bound, zero_out)


def test_offset_requant_on_int64_for_a_conv_as_lowered(monkeypatch):
    # the usual sizes (a 31-bit multiplier, shifts 35-45, a bound of 2**20): the int64 path is
    # taken, the common shift applies, and the result is the Python integers' one
    import qtool.fixedpoint as fixedpoint

    taken = []
    original = fixedpoint._int64_holds
    monkeypatch.setattr(fixedpoint, "_int64_holds", lambda *a: taken.append(original(*a)) or taken[-1])
    rng = np.random.default_rng(3)
    bias = rng.integers(-2**20, 2**20, 64)[:, None, None]
    requant = Requant(rng.integers(2**30, 2**31, 64)[:, None, None], rng.integers(35, 46, 64)[:, None, None])
    built = _same_offset_requant((bias, requant, "int8", "half_up", np.full((64, 1, 1), 2**20)),
                                 rng.integers(-128, 128, 64)[:, None, None])
    assert built is not None and np.ndim(built[0].rshift) == 0 and built[0].offset.shape == (64, 1, 1)
    assert taken == [True]  # the default call went through int64 (the exact one does not ask)


def test_offset_requant_worst_cases():
    # a product at 2**62 (int32 accumulator times a 31-bit multiplier), the largest shift, a zero
    # point that cannot be folded at that shift, and a channel whose weights are all 0 (bound 0)
    # with a bias at each end of int32
    bias = np.array([0, INT32_MIN, INT32_MAX, -5])
    multiplier = np.array([2**31 - 1, 2**31 - 1, 12345, 2**30])
    rshift = np.array([63, 40, 63, 3])
    bound = np.array([2**31 - 1, 0, 0, 2**20])
    tail, unproven = offset_requant(bias[:, None], Requant(multiplier[:, None], rshift[:, None]), -100,
                                    "int32", "half_up", bound[:, None])
    assert unproven.tolist() == [] and tail.zero_out == -100  # added after the shift
    x = np.array([[-(2**31) + 1, 2**31 - 1, 0], [0, 0, 0], [0, 0, 0], [-(2**20), 2**20, 7]])
    want = _reference_tail(x, bias[:, None], multiplier[:, None], rshift[:, None], -100, "int32")
    assert tail(x).tolist() == want.tolist()


def test_offset_requant_flags_channels_that_may_leave_int32():
    bias = np.array([INT32_MAX - 100, 100, INT32_MIN])
    tail, unproven = offset_requant(bias, Requant(np.array([2**30] * 3), np.array([31] * 3)), 0, "int8",
                                    "half_up", np.array([127 * 128, 127 * 128, 0]))
    assert unproven.tolist() == [0]


@pytest.mark.parametrize("mode, rshift", [("half_to_even", 31), ("half_away_from_zero", 31),
                                          ("toward_zero", 31), ("half_up", 0), ("half_up", 64)])
def test_offset_requant_only_for_half_up_and_right_shifts(mode, rshift):
    assert offset_requant(np.array([0]), Requant(np.array([2**30]), np.array([rshift])), 0, "int8", mode,
                          np.array([100])) is None


def test_quantize_saturates_infinities_and_nan_deterministically():
    """A float op feeding a QuantizeLinear can produce inf or NaN (a variance quantized to 0, then
    divided by): the cast to an integer must not be left to the CPU."""
    from qtool.qparams import QParams, quantize_array

    x = np.array([np.nan, np.inf, -np.inf, 3e38, -3e38, 1e12, 0.0, 0.05, 0.15], np.float32)
    got = quantize_array(x, QParams(0.1, 3, "int8"))
    assert got.tolist() == [-128, 127, -128, 127, -128, 127, 3, 3, 5]  # 0.5 and 1.5 round to even
    per_channel = QParams(np.array([0.1, 0.2], np.float32), np.array([0, 5]), "uint8", 0)
    got = quantize_array(np.array([[np.nan, 1e20], [-np.inf, 0.5]], np.float32), per_channel)
    assert got.tolist() == [[0, 255], [0, 7]]


def test_divide_away_rounds_half_away_from_zero():
    from qtool.fixedpoint import divide_away

    pairs = [(7, 2, 4), (-7, 2, -4), (5, 3, 2), (-5, 3, -2), (4, 3, 1), (-4, 3, -1), (0, 5, 0), (9, 1, 9)]
    got = divide_away([n for n, _, _ in pairs], [d for _, d, _ in pairs])
    assert got.tolist() == [q for _, _, q in pairs]


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16"])
def test_per_channel_activation_is_each_channels_scalar_qparams(dtype):
    # the vectorized form against asymmetric / symmetric channel by channel, on the edges of
    # safe_range too: inverted, infinite, beyond RANGE_LIMIT, narrower than MIN_THRESHOLD
    rng = np.random.default_rng(7)
    edges = [0.0, -0.0, 1e-12, -1e-12, MIN_THRESHOLD, -MIN_THRESHOLD, MIN_THRESHOLD / 2, 2 * RANGE_LIMIT,
             -2 * RANGE_LIMIT, np.inf, -np.inf, 3.5, -3.5, 1e-3, -1e-3, 127.0, -128.0]
    scales = rng.choice([1e-9, 1e-5, 1e-2, 1.0, 100.0, 1e6], 1000)
    lo = np.concatenate([rng.normal(size=1000) * scales, rng.choice(edges, 1500)])
    hi = np.concatenate([rng.normal(size=1000) * scales[::-1], rng.choice(edges, 1500)])
    got = per_channel_activation(lo, hi, dtype)
    each = [asymmetric(a, b, dtype) for a, b in zip(lo, hi)]
    assert np.array_equal(got.scale, np.array([q.scale for q in each], np.float32))
    assert np.array_equal(got.zero_point, np.array([q.zero_point for q in each], np.int64))
    centred = per_channel_activation(lo, hi, dtype, centred=True)
    each = [symmetric(max(abs(a), abs(b)), "int8") for a, b in zip(lo, hi)]
    assert np.array_equal(centred.scale, np.array([q.scale for q in each], np.float32))
    # a channel whose range is not a number gets the smallest range, as safe_range gives it
    nan = per_channel_activation(np.array([np.nan, 1.0]), np.array([1.0, np.nan]), dtype, centred=True)
    assert np.array_equal(nan.scale, np.full(2, symmetric(MIN_THRESHOLD).scale, np.float32))
