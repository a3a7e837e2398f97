"""Calibrators against direct computations on known data."""

import math

import numpy as np
import pytest

import calibrators
from calibrators.histogram import Histogram
from calibrators.kl import kl_threshold_bins
from qtool.calibrate import make_calibrator

RNG = np.random.default_rng(7)
NORMAL = RNG.normal(0.3, 1.0, 200_000).astype(np.float32)
HIST_METHODS = ["kl", "percentile", "mse", "aciq_gauss", "aciq_laplace"]


def fed(method, *batches, **params):
    c = calibrators.get(method)(**params)
    for b in batches:
        c.update(b)
    return c


def test_registry_lists_every_method():
    assert calibrators.names() == ["aciq_gauss", "aciq_laplace", "kl", "minmax", "mse", "percentile"]
    with pytest.raises(KeyError, match="unknown calibration method 'kll'; choose one of aciq_gauss"):
        calibrators.get("kll")


def test_minmax_is_the_extremes():
    r = fed("minmax", NORMAL[:1000], NORMAL[1000:]).result()
    assert (r.min, r.max) == (float(NORMAL.min()), float(NORMAL.max()))
    assert r.threshold == max(-r.min, r.max)


def test_minmax_moving_average():
    batches = [np.array([-1.0, 2.0]), np.array([-3.0, 4.0]), np.array([0.0, 1.0])]
    r = fed("minmax", *batches, moving_average=0.5).result()
    # min: -1 -> -1 + 0.5 * (-3 + 1) = -2 -> -2 + 0.5 * (0 + 2) = -1; max: 2 -> 3 -> 2
    assert (r.min, r.max) == (-1.0, 2.0)


@pytest.mark.parametrize("method", ["minmax", *HIST_METHODS])
def test_merge_equals_single_pass(method):
    shards = np.array_split(NORMAL, 5)
    whole = fed(method, *shards)
    merged = fed(method, shards[0])
    for shard in shards[1:]:
        merged.merge(fed(method, shard))
    assert merged.result() == whole.result()


@pytest.mark.parametrize("method", ["minmax", *HIST_METHODS])
def test_state_round_trip(method):
    c = fed(method, NORMAL)
    restored = calibrators.get(method)()
    restored.load_state(c.state())
    assert restored.result() == c.result()


def test_histogram_growing_mid_stream_equals_single_pass():
    small, large = NORMAL[:5000] * 0.001, NORMAL[5000:] * 40
    grown = Histogram()
    grown.update(small)
    grown.update(large)
    single = Histogram()
    single.update(np.concatenate([small, large]))
    assert grown.range == single.range == 256.0  # max|x| ~ 200 -> the next power of two
    assert np.array_equal(grown.counts, single.counts)
    assert grown.counts.sum() == NORMAL.size


def test_histogram_merge_across_ranges_and_empty_shards():
    a, b = Histogram(), Histogram()
    a.update(NORMAL[:100] * 1e-3)
    b.update(NORMAL[100:])
    b.merge(a)
    a.merge(Histogram())  # an empty shard changes nothing
    single = Histogram()
    single.update(np.concatenate([NORMAL[100:], NORMAL[:100] * 1e-3]))
    assert np.array_equal(b.counts, single.counts)


def test_histogram_all_zero_tensor():
    h = Histogram()
    h.update(np.zeros(100, np.float32))
    assert h.range == 0.0 and h.abs_counts()[0] == 100 and h.zeros == 100
    h.update(np.array([3.0], np.float32))
    assert h.range == 4.0 and h.abs_counts()[0] == 100


def test_percentile_matches_numpy_within_one_bin():
    c = fed("percentile", NORMAL, percentile=99.9)
    width = c.hist.width
    assert abs(c.result().threshold - np.percentile(np.abs(NORMAL), 99.9)) <= width
    r = c.result()
    assert abs(r.max - np.percentile(NORMAL, 99.95)) <= width
    assert abs(r.min - np.percentile(NORMAL, 0.05)) <= width


def _kl_reference(counts, levels=128):
    """TensorRT's entropy search written plainly, one candidate at a time (no smoothing)."""
    counts = np.asarray(counts, dtype=np.float64)
    used = int(np.flatnonzero(counts)[-1]) + 1
    best, best_kl = None, math.inf
    for i in range(levels, used + 1):
        p = counts[:i].copy()
        p[-1] += counts[i:].sum()
        merged = i // levels
        q = np.zeros(i)
        for k in range(levels):
            start, stop = k * merged, (i if k == levels - 1 else (k + 1) * merged)
            nz = p[start:stop] > 0
            if nz.any():
                q[start:stop][nz] = counts[start:stop].sum() / nz.sum()
        p, q = p / p.sum(), q / q.sum()
        if np.any((p > 0) & (q == 0)):
            continue
        kl = float(np.sum(p[p > 0] * np.log(p[p > 0] / q[p > 0])))
        if kl < best_kl:
            best, best_kl = i, kl
    return best


@pytest.mark.parametrize("data", ["normal", "laplace", "relu"])
def test_kl_search_matches_plain_implementation(data):
    x = {"normal": NORMAL, "laplace": RNG.laplace(0, 1, 100_000),
         "relu": np.maximum(NORMAL, 0)}[data]
    h = Histogram(512)  # fewer bins keep the plain loop quick
    h.update(x)
    assert kl_threshold_bins(h.abs_counts(), 32) == _kl_reference(h.abs_counts(), 32)


def test_kl_clips_a_long_tail():
    x = np.concatenate([NORMAL, np.array([60.0], np.float32)])  # one far outlier
    r = fed("kl", x).result()
    assert r.threshold < 10 and r.max == r.threshold  # the outlier is clipped
    assert fed("kl", x, variant="tpu_mlir").result().threshold < 10


@pytest.mark.parametrize("variant", ["tensorrt", "tpu_mlir"])
def test_kl_on_a_tensor_that_keeps_away_from_zero(variant):
    # every value in [-2, -1] (PP-OCR's SE-block convs do this): no mass below |x| = 1, which once
    # made the first candidate win with KL = 0 and clipped the range to the single point -1
    x = RNG.uniform(-2.0, -1.0, 50_000).astype(np.float32)
    r = fed("kl", x, variant=variant).result()
    assert r.threshold > 1.9  # a flat distribution without a tail keeps (nearly) everything
    assert r.min < -1.9 and r.max == pytest.approx(float(x.max()))


def test_kl_tpu_mlir_variant_ignores_exact_zeros():
    relu = np.maximum(NORMAL, 0)  # about 38% exact zeros
    c = fed("kl", relu, variant="tpu_mlir")
    assert c.hist.zeros == int(np.sum(relu == 0))
    assert c.result().threshold != fed("kl", relu).result().threshold


def test_mse_threshold_is_near_the_brute_force_optimum():
    x = RNG.laplace(0, 1, 100_000).astype(np.float32)
    t = fed("mse", x).result().threshold

    def quant_mse(t):
        s = t / 127
        return float(np.mean((x - np.clip(np.round(x / s), -127, 127) * s) ** 2))

    grid = np.linspace(1.0, float(np.abs(x).max()), 400)
    best = min(quant_mse(g) for g in grid)
    assert quant_mse(t) <= best * 1.02


def test_aciq_thresholds_follow_the_fitted_distribution():
    gauss = RNG.normal(0, 2.0, 400_000).astype(np.float32)
    assert fed("aciq_gauss", gauss).result().threshold == pytest.approx(3.92 * 2.0, rel=0.02)
    laplace = RNG.laplace(0, 0.5, 400_000).astype(np.float32)
    r = fed("aciq_laplace", laplace).result()
    assert r.threshold == pytest.approx(min(9.90 * 0.5, float(np.abs(laplace).max())), rel=0.02)


@pytest.mark.parametrize("method", HIST_METHODS)
def test_ranges_stay_inside_the_data_and_contain_the_bulk(method):
    r = fed(method, NORMAL).result()
    assert NORMAL.min() <= r.min < 0 < r.max <= NORMAL.max()
    assert 0 < r.threshold <= max(-NORMAL.min(), NORMAL.max())
    assert np.mean((NORMAL >= r.min) & (NORMAL <= r.max)) > 0.99


def test_non_finite_values_are_reported_not_binned():
    r = fed("kl", np.array([1.0, np.inf], np.float32)).result()
    assert math.isnan(r.threshold)


@pytest.mark.parametrize("method", ["minmax", "kl"])
def test_a_shard_with_nan_spoils_the_merge(method):
    good, bad = fed(method, NORMAL), fed(method, np.array([1.0, np.nan], np.float32))
    good.merge(bad)
    assert math.isnan(good.result().threshold)


@pytest.mark.parametrize("method", ["mse", "percentile", "kl", "aciq_gauss", "aciq_laplace"])
@pytest.mark.parametrize("value", [32.0, -33.0, 1e-3])
def test_a_constant_tensor_gets_a_range_not_inverted(method, value):
    # YOLOv8n's anchor grid offset is a constant 32: mse put its threshold on the bin edge below
    # (31.984) and kept the observed min, giving min 32 > max 31.98, which quantize refused
    c = make_calibrator(method)
    c.update(np.full((4, 100), value, np.float32))
    r = c.result()
    assert r.min <= r.max
    assert abs(r.max if value > 0 else r.min) == pytest.approx(abs(value), rel=0.01)


@pytest.mark.parametrize("params, message", [
    (("--method", "percentile", "--param", "bins=0"), "method 'percentile': bins must be a whole number of at least 2, got 0"),
    (("--method", "kl", "--param", "levels=0"), "method 'kl': levels must be a whole number from 2 to bins (2048), got 0"),
    (("--method", "kl", "--param", "bins=100", "--param", "levels=200"), "levels must be a whole number from 2 to bins (100)"),
    (("--method", "mse", "--param", "qmax=0"), "method 'mse': qmax must be a whole number of at least 1, got 0"),
    (("--method", "aciq_gauss", "--param", "bits=40"), "method 'aciq_gauss': bits must be a whole number from 2 to 16"),
    (("--method", "minmax", "--param", "moving_average=2"), "moving_average must be a number in (0, 1], got 2"),
    (("--method", "minmax", "--param", "moving_average=abc"), "moving_average must be a number in (0, 1], got 'abc'"),
])
def test_a_parameter_out_of_range_is_a_one_line_error(tmp_path, demo_model, demo_calib, params, message):
    """bins=0 and levels=0 ended in internal errors (the second after a numpy warning), qmax=0 wrote
    a useless table with exit 0: every calibrator checks its parameters before any work."""
    from test_cli import assert_user_error, invoke

    assert_user_error(invoke("calibrate", demo_model, "-d", demo_calib, "-o", tmp_path / "t.yaml", *params), message)
    assert not (tmp_path / "t.yaml").exists()


def test_moving_average_from_the_command_line_is_a_number(tmp_path, demo_model, demo_calib):
    """--param moving_average=0.01 reached the calibrator as a string: an internal error."""
    from qtool.table_formats import read_table
    from test_cli import invoke

    result = invoke("calibrate", demo_model, "-d", demo_calib, "-o", tmp_path / "t.yaml", "--param",
                    "moving_average=0.01", "--batch-size", 4, "-q")
    assert result.exit_code == 0, result.output
    table = read_table(tmp_path / "t.yaml")
    assert float(table.params["moving_average"]) == 0.01
    plain = invoke("calibrate", demo_model, "-d", demo_calib, "-o", tmp_path / "p.yaml", "--batch-size", 4, "-q")
    assert plain.exit_code == 0
    assert table.tensors != read_table(tmp_path / "p.yaml").tensors  # the average, not the extremes
