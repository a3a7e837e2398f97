"""One scale and zero point per channel (qtool/channels.py): the tensors that may take them, the
judged step of quantize --data, the integer kernels (Conv output, depthwise Conv input, a lookup
per channel) against onnxruntime running the QDQ model as written, onnxruntime's own optimized
session on the model (no QLinear fusion of a per-channel group), the same bytes every run, the
CLI's refusals.

The model is a depthwise block as BatchNorm folding leaves it: a Conv whose output channels span
0.02 to 4, HardSwish, a depthwise Conv that scales each channel back up, Sigmoid, HardSwish and a
pointwise Conv. One scale for the first Conv's output loses its small channels, which the
depthwise Conv then amplifies.
"""

import json
from functools import partial

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from qtool.analyze import as_written_session
from qtool.channels import GAIN_DB, candidates, fit
from qtool.executor import IntegerExecutor
from qtool.model import load_model, prepare
from qtool.quantize import QuantizeOptions, quantize
from qtool.verify import verify
from graphs import fit_and_held, normal_samples, saved_model
from test_cli import assert_user_error, invoke

C = 8


def block(path, seed=0):
    rng = np.random.default_rng(seed)
    gains = np.geomspace(0.02, 4.0, C)
    w0 = rng.normal(0, 0.4, (C, 3, 3, 3)) * gains[:, None, None, None]
    b0 = rng.normal(0, 0.5, C) * gains
    dw = rng.normal(1.0, 0.3, (C, 1, 3, 3)) / gains[:, None, None, None] / 9
    pw = rng.normal(0, C ** -0.5, (4, C, 1, 1))
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in
             (("w0", w0), ("b0", b0), ("dw", dw), ("db", rng.normal(0, 0.1, C)), ("pw", pw))]
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["a"], name="conv0", pads=[1, 1, 1, 1]),
             helper.make_node("HardSwish", ["a"], ["b"], name="hs0"),
             helper.make_node("Conv", ["b", "dw", "db"], ["c"], name="dw", pads=[1, 1, 1, 1], group=C),
             helper.make_node("Sigmoid", ["c"], ["d"], name="sig"),
             helper.make_node("HardSwish", ["d"], ["e"], name="hs1"),
             helper.make_node("Conv", ["e", "pw"], ["y"], name="pw")]
    return saved_model(path, "block", nodes, inits, {"x": ["N", 3, 12, 12]}, {"y": ["N", 4, 12, 12]})


images = partial(normal_samples, shape=(3, 12, 12))  # images(path, n, seed)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    folder = tmp_path_factory.mktemp("channels")
    model = block(folder / "block.onnx")
    return (folder, model, *fit_and_held(folder, model, images))


def _fences(qmodel):
    """tensor -> (zero point type, channels) of each activation's QuantizeLinear."""
    inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
    return {n.input[0]: (str(inits[n.input[2]].dtype), inits[n.input[2]].size)
            for n in qmodel.graph.node if n.op_type == "QuantizeLinear"}


def test_candidates(made):
    _, model, *_ = made
    assert candidates(prepare(load_model(model), "m")) == ["a", "b", "c", "d"]


def test_the_step_is_judged_kept_and_the_model_verifies(made):
    folder, model, data, held, table = made
    ranges, pick = fit(model, table, QuantizeOptions(), "t", data, progress=False)
    assert pick.tensors == 4 and pick.fit_samples == 16 and pick.heldout == 16, pick.to_dict()
    assert pick.after_db >= pick.before_db + GAIN_DB and pick.kept, pick.to_dict()
    assert set(ranges) == {"a", "b", "c", "d"} and all(lo.shape == (C,) for lo, _ in ranges.values())
    # judged with the fit samples' ranges, kept ones are measured again on all of DATA (32 here)
    from qtool.analyze import split_batches
    from qtool.channels import channel_ranges

    float_model = prepare(load_model(model), "m")
    everything = channel_ranges(float_model, list(ranges), [{"x": np.load(data)["x"]}], progress=False)
    fitted, _ = split_batches(float_model, data, 16, 16, 8)
    fit_only = channel_ranges(float_model, list(ranges), fitted, progress=False)
    assert pick.to_dict()["ranges_from_all_samples"]
    for t, (lo, hi) in ranges.items():
        np.testing.assert_array_equal(lo, everything[t][0], err_msg=t)
        np.testing.assert_array_equal(hi, everything[t][1], err_msg=t)
    assert any(not np.array_equal(hi, fit_only[t][1]) for t, (_, hi) in ranges.items())
    qmodel, report = quantize(model, table, QuantizeOptions(), "t", channel_ranges=ranges)
    fences = _fences(qmodel)
    # 'd' sits between two links that pin it to both types (int8 after 'c', uint8 before the
    # per-tensor 'e'): it goes back to one scale; the others alternate so that no Conv or
    # Sigmoid reads and writes one type
    assert report.channel_scales == ["a", "b", "c"]
    assert fences["x"] == ("uint8", 1) and fences["e"] == ("uint8", 1) and fences["d"] == ("uint8", 1)
    assert fences["a"] == ("int8", C) and fences["b"] == ("uint8", C) and fences["c"] == ("int8", C)
    assert report.kept_float == []
    plain, _ = quantize(model, table, QuantizeOptions(), "t")
    onnx.save(qmodel, folder / "channels.onnx")
    onnx.save(plain, folder / "plain.onnx")
    by_channel = verify(model, folder / "channels.onnx", held, progress=False)
    by_tensor = verify(model, folder / "plain.onnx", held, progress=False)
    assert by_channel.float_nodes == [] and by_tensor.float_nodes == []
    assert by_channel.outputs[0].sqnr > by_tensor.outputs[0].sqnr + 6, (by_channel.outputs[0].sqnr,
                                                                        by_tensor.outputs[0].sqnr)


def test_kernels_equal_onnxruntime_as_written_and_its_optimized_session_runs(made):
    folder, model, data, held, table = made
    ranges, _ = fit(model, table, QuantizeOptions(), "t", data, progress=False)
    qmodel, _ = quantize(model, table, QuantizeOptions(), "t", channel_ranges=ranges)
    x = np.load(held)["x"]
    names = ["a_quantized", "b_quantized", "c_quantized", "d_quantized", "e_quantized"]
    names = [n for n in names if n in {o for node in qmodel.graph.node for o in node.output}]
    reference = onnx.ModelProto()
    reference.CopyFrom(qmodel)
    reference.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    session = as_written_session(reference)
    got = session.run(names, {"x": x})
    run = IntegerExecutor(qmodel).run({"x": x}, keep_integer=True)
    assert len(names) == 5
    for name, theirs in zip(names, got):
        ours = run.integer[name.removesuffix("_quantized")]
        assert ours.dtype == theirs.dtype
        diff = np.abs(ours.astype(np.int64) - theirs.astype(np.int64))
        # onnxruntime computes each op in float between DequantizeLinear and QuantizeLinear: ties
        # and a float sum's last bit may round the other way
        assert diff.max() <= 1 and np.mean(diff == 0) > 0.99, (name, diff.max(), np.mean(diff == 0))
    options = ort.SessionOptions()
    options.log_severity_level = 4
    optimized = ort.InferenceSession(qmodel.SerializeToString(), options, providers=["CPUExecutionProvider"])
    y = optimized.run(None, {"x": x})[0]
    steps = np.abs(y - IntegerExecutor(qmodel).run({"x": x}).outputs["y"])
    scale = float(numpy_helper.to_array({i.name: i for i in qmodel.graph.initializer}[
        next(n.input[1] for n in qmodel.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "y")]))
    assert steps.max() <= 1.01 * scale


def test_fast_paths_give_the_plain_integers(made, monkeypatch):
    import qtool.executor as executor_module

    _, model, data, held, table = made
    ranges, _ = fit(model, table, QuantizeOptions(), "t", data, progress=False)
    qmodel, _ = quantize(model, table, QuantizeOptions(), "t", channel_ranges=ranges)
    x = np.load(held)["x"]
    fast = IntegerExecutor(qmodel)
    expected = fast.run({"x": x}).outputs["y"]
    assert fast._fast
    monkeypatch.setattr(executor_module, "FAST_FROM", 1e9)
    plain = IntegerExecutor(qmodel)
    got = plain.run({"x": x}, pace=(16, 0)).outputs["y"]
    assert not plain._fast and np.array_equal(got, expected)


def test_cli_step_report_bytes_and_refusals(made):
    folder, model, data, held, _ = made
    table = folder / "t.yaml"
    assert invoke("calibrate", model, "--data", data, "-o", table, "-q").exit_code == 0
    outs = []
    for k in range(2):
        out = folder / f"cli{k}.onnx"
        result = invoke("quantize", model, "-t", table, "-o", out, "--data", data, "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["channel_scales_step"]["kept"] and report["channel_scales"] == ["a", "b", "c"]
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]  # same data, same bytes
    result = invoke("quantize", model, "-t", table, "-o", folder / "human.onnx", "--data", data)
    assert "scales:  4 activations measured per channel on 16 samples" in result.stderr + result.stdout
    assert "; kept, measured again on all of DATA" in result.stderr + result.stdout
    result = invoke("quantize", model, "-t", table, "-o", folder / "off.onnx", "--data", data,
                    "--no-channel-scales", "--json")
    assert result.exit_code == 0 and "channel_scales" not in json.loads(result.stdout)
    assert all(size == 1 for _, size in _fences(onnx.load(folder / "off.onnx")).values())
    assert_user_error(invoke("quantize", model, "-t", table, "-o", folder / "r.onnx", "--channel-scales"),
                      "--channel-scales needs samples", "--data")
    assert_user_error(invoke("quantize", model, "-t", table, "-o", folder / "r.onnx", "--data", data,
                             "--channel-scales", "--format", "qoperator"),
                      "--channel-scales does not apply here", "QLinearConv")
    assert_user_error(invoke("quantize", model, "-t", table, "-o", folder / "r.onnx", "--data", data,
                             "--channel-scales", "--target-sqnr", "20"),
                      "--channel-scales does not combine with the search")


def test_a_scored_only_build_is_the_same_graph(made):
    """The judged steps score candidates built without the executor's lowering and parameters
    (``quantize(..., scored_only=True)``): the graph, what onnxruntime runs, is the same."""
    _, model, data, _, table = made
    ranges, _ = fit(model, table, QuantizeOptions(), "t", data, progress=False)
    full, report = quantize(model, table, QuantizeOptions(), "t", channel_ranges=ranges)
    scored, _ = quantize(model, table, QuantizeOptions(), "t", channel_ranges=ranges, scored_only=True)
    assert full.graph.SerializeToString() == scored.graph.SerializeToString()
    keys = {p.key for p in scored.metadata_props}
    assert "qtool.params" in {p.key for p in full.metadata_props} and "qtool.params" not in keys


def test_a_model_with_a_fixed_batch_is_measured_again_in_whole_batches(made, tmp_path):
    # all of DATA in batches of the model's own size: 32 samples at a fixed batch of 5 are 30
    _, model, data, _, table = made
    fixed = onnx.load(str(model))
    fixed.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 5
    path = tmp_path / "fixed.onnx"
    onnx.save(fixed, str(path))
    ranges, pick = fit(path, table, QuantizeOptions(), "t", data, progress=False)
    assert pick.kept, pick.to_dict()
    from qtool.channels import channel_ranges

    x = np.load(data)["x"]
    want = channel_ranges(prepare(load_model(path), "m"), list(ranges),
                          [{"x": x[i:i + 5]} for i in range(0, 30, 5)], progress=False)
    for t, (lo, hi) in ranges.items():
        np.testing.assert_array_equal(lo, want[t][0], err_msg=t)
        np.testing.assert_array_equal(hi, want[t][1], err_msg=t)


def test_a_calibration_measures_the_same_ranges_on_the_way(made, monkeypatch):
    """quantize --data's method choice calibrates a chosen method on all of DATA; the per-channel
    ranges its reductions keep anyway are the numbers the step's own pass would measure, and the
    step then makes no pass of its own: the same model."""
    from qtool import channels
    from qtool.calibrate import collect
    from qtool.channels import channel_ranges, wanted

    _, model, data, _, table = made
    tensors = wanted(model, QuantizeOptions())
    assert tensors == ["a", "b", "c", "d"]
    assert wanted(model, QuantizeOptions(format="qoperator")) == []
    stats = collect(model, data, "mse", progress=False, batch_size=8, channels=tensors)
    float_model = prepare(load_model(model), "m")
    own = channel_ranges(float_model, tensors, [{"x": np.load(data)["x"]}], progress=False)
    assert set(stats.channel_ranges) == set(tensors)
    for t in tensors:
        np.testing.assert_array_equal(stats.channel_ranges[t][0], own[t][0], err_msg=t)
        np.testing.assert_array_equal(stats.channel_ranges[t][1], own[t][1], err_msg=t)
    assert collect(model, data, "mse", progress=False, batch_size=8).channel_ranges == {}
    passes = []
    monkeypatch.setattr(channels, "_on_all", lambda *a, **k: passes.append(a) or {})
    ranges, pick = fit(model, table, QuantizeOptions(), "t", data, progress=False, measured=stats.channel_ranges)
    assert pick.kept and not passes
    for t, (lo, hi) in ranges.items():
        np.testing.assert_array_equal(lo, own[t][0], err_msg=t)
        np.testing.assert_array_equal(hi, own[t][1], err_msg=t)
    # one tensor missing: the step measures them all itself
    fit(model, table, QuantizeOptions(), "t", data, progress=False,
        measured={t: stats.channel_ranges[t] for t in tensors[1:]})
    assert len(passes) == 1
    # the fit samples' ranges likewise, from the method choice's calibration of its candidates
    from qtool.analyze import split_batches

    fitted, _ = split_batches(float_model, data, 16, 16, 8)
    on_fit = collect(model, data, "mse", progress=False, batch_size=8, feeds=fitted, channels=tensors)
    own_fit = channel_ranges(float_model, tensors, fitted, progress=False)
    for t in tensors:
        np.testing.assert_array_equal(on_fit.channel_ranges[t][0], own_fit[t][0], err_msg=t)
        np.testing.assert_array_equal(on_fit.channel_ranges[t][1], own_fit[t][1], err_msg=t)
    own_passes = []
    monkeypatch.setattr(channels, "channel_ranges", lambda *a, **k: own_passes.append(a) or {})
    _, again = fit(model, table, QuantizeOptions(), "t", data, progress=False, measured=stats.channel_ranges,
                   measured_fit=on_fit.channel_ranges)
    def judged(p):
        return {k: v for k, v in p.to_dict().items() if k != "seconds"}

    assert not own_passes and judged(again) == judged(pick)
