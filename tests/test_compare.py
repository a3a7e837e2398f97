"""verify's running comparisons (qtool/verify/compare.py): the compiled one-pass sums against
sums computed here exactly (``math.fsum`` of the float64 products, which are exact for float32
operands), the numpy fallback against the same, and verify streaming the executor's tensors.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest

import qtool.verify.compare as compare
from qtool.executor import IntegerExecutor
from qtool.ops import parallel
from qtool.qparams import QParams, dequantize_array
from qtool.quantize import quantize
from qtool.verify import Comparison, verify

SIZES = [0, 1, 3, 4, 5, 8, 1001, 65539]


def exact_figures(ref: np.ndarray, got: np.ndarray, clamp: bool = False) -> tuple:
    """(dot, ref_sq, got_sq, err_sq, largest |err|) with every sum correctly rounded."""
    r, g = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    if clamp:
        r, g = np.maximum(r, 0), np.maximum(g, 0)
    e = r - g  # exact: both are float32 values
    largest = float(np.abs(e).max()) if e.size else 0.0
    return (math.fsum(r * g), math.fsum(r * r), math.fsum(g * g), math.fsum(e * e), largest)


def assert_close(c: Comparison, expected: tuple, scale: float) -> None:
    for got, want in zip((c.dot, c.ref_sq, c.got_sq, c.err_sq), expected[:4]):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-300)
    assert c.max_lsb == expected[4] / scale  # a max and one division: no rounding to differ


def cases():
    rng = np.random.default_rng(7)
    for size in SIZES:
        for dtype, zero in ((np.int8, 3), (np.uint8, 128)):
            ref = (rng.standard_normal(size) * 2).astype(np.float32)
            q = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max + 1, size).astype(dtype)
            yield size, QParams(0.02, zero, np.dtype(dtype).name), ref, q


@pytest.fixture(params=["compiled", "numpy"])
def path(request, monkeypatch):
    if request.param == "compiled":
        pytest.importorskip("numba")
        monkeypatch.setattr(compare, "ENABLED", True)
        assert compare._compiled()
    else:
        monkeypatch.setattr(compare, "ENABLED", False)
    return request.param


@pytest.mark.parametrize("clamp", [False, True])
def test_integer_sums_equal_exact_sums(path, clamp):
    for size, qp, ref, q in cases():
        c = Comparison("t", qparams=qp, clamped=clamp)
        c.update_integer(ref, q, {})
        assert_close(c, exact_figures(ref, dequantize_array(q, qp), clamp), qp.scale)


def test_float_values(path):
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    got = (ref + rng.standard_normal(ref.shape) * 0.01).astype(np.float32)
    c = Comparison("out")
    c.update(ref, got)
    expected = exact_figures(ref, got)
    for value, want in zip((c.dot, c.ref_sq, c.got_sq, c.err_sq), expected[:4]):
        assert value == pytest.approx(want, rel=1e-12)


def test_batches_add_up_to_the_whole(path):
    _, qp, ref, q = next((s, qp, r, q) for s, qp, r, q in cases() if s == 1001)
    whole, parts = Comparison("t", qparams=qp), Comparison("t", qparams=qp)
    whole.update_integer(ref, q, {})
    tables = {}
    for lo, hi in ((0, 400), (400, 401), (401, 1001)):
        parts.update_integer(ref[lo:hi], q[lo:hi], tables)
    assert parts.cosine == pytest.approx(whole.cosine, rel=1e-12)
    assert parts.sqnr == pytest.approx(whole.sqnr, rel=1e-12)
    assert parts.max_lsb == whole.max_lsb


def test_compiled_and_numpy_reports_print_the_same(tmp_path, monkeypatch, demo_model, demo_table,
                                                   demo_heldout):
    pytest.importorskip("numba")
    model, _ = quantize(demo_model, demo_table)
    path = tmp_path / "q.onnx"
    onnx.save(model, str(path))
    reports = []
    for enabled in (True, False):
        monkeypatch.setattr(compare, "ENABLED", enabled)
        report = verify(demo_model, path, demo_heldout, num_samples=64, batch_size=16, progress=False)
        reports.append(json.dumps(report.to_dict(), sort_keys=True))
    assert reports[0] == reports[1]
    assert len(json.loads(reports[0])["tensors"]) > 5


def test_executor_streams_what_it_would_keep(tmp_path, demo_model, demo_table, demo_heldout):
    model, _ = quantize(demo_model, demo_table)
    executor = IntegerExecutor(model)
    x = np.load(demo_heldout)["input"][:4]
    kept = executor.run({"input": x}, keep_integer=True)
    streamed = {}
    result = executor.run({"input": x}, on_integer=lambda k, v: streamed.setdefault(k, []).append(v.copy()))
    assert result.integer == {}
    assert sorted(streamed) == sorted(kept.integer) == sorted(executor.integer_tensors())
    for key, values in streamed.items():
        assert len(values) == 1
        np.testing.assert_array_equal(values[0], kept.integer[key])
    for name, value in kept.outputs.items():
        np.testing.assert_array_equal(result.outputs[name], value)


def test_serial_keeps_kernels_on_one_thread():
    assert len(parallel.ranges(1000, parallel.SPLIT_FROM)) == min(parallel.WORKERS, 1000)
    with parallel.serial():
        with parallel.serial():
            assert parallel.ranges(1000, parallel.SPLIT_FROM) == ((0, 1000),)
        assert parallel.ranges(1000, parallel.SPLIT_FROM) == ((0, 1000),)
    assert len(parallel.ranges(1000, parallel.SPLIT_FROM)) == min(parallel.WORKERS, 1000)
