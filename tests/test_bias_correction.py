"""Bias correction: per-channel output means of the quantized Conv/Gemm match float on the samples."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.bias_correction import _channel_means, quantize_corrected, targets
from qtool.calibrate import calibrate
from qtool.errors import QtoolError
from qtool.executor import IntegerExecutor
from qtool.model import load_model, prepare
from qtool.quantize import QuantizeOptions, quantize
from qtool.table_formats import write_table
from test_cli import assert_user_error, invoke


def _means(model, batches):
    found = targets(model)
    return {t.node: m for t, (m, _) in zip(found, _channel_means(
        model, [t.output for t in found], [t.axis for t in found], batches))}


@pytest.fixture(scope="module")
def corrected(demo_model, demo_table, demo_calib):
    qmodel, report, correction = quantize_corrected(demo_model, demo_table, QuantizeOptions(), "t",
                                                    demo_calib, 16, 8, progress=False)
    batches = [{"input": np.load(demo_calib)["input"][::16]}]  # the 16 samples it measured on
    return qmodel, report, correction, batches


def test_each_output_mean_is_within_half_a_bias_step_of_float(demo_model, demo_table, corrected):
    qmodel, _, correction, batches = corrected
    float_model = prepare(load_model(demo_model))
    plain, _ = quantize(demo_model, demo_table)
    outputs = {n.name: n.output[0] for n in float_model.graph.node}
    found = targets(qmodel)
    assert [t.node for t in found] == ["conv1", "block_conv1", "block_conv2", "conv2", "fc"]
    reference = _channel_means(float_model, [outputs[t.node] for t in found], [t.axis for t in found],
                               batches)
    float_means = {t.node: m for t, (m, _) in zip(found, reference)}
    after, before = _means(qmodel, batches), _means(plain, batches)
    scales = {t.node: t.scale for t in found}
    for node, want in float_means.items():
        # later corrections only move ops downstream, so every op keeps its own correction
        assert np.all(np.abs(after[node] - want) <= 0.5 * scales[node] * (1 + 1e-3) + 1e-6), node
    # the uncorrected model really was off by more than that somewhere
    assert max(float(np.max(np.abs(before[n] - float_means[n]) / scales[n])) for n in float_means) > 2


def test_held_out_sqnr_improves_on_the_integer_executor(demo_model, demo_table, demo_heldout, tmp_path,
                                                        corrected):
    qmodel = corrected[0]
    plain, _ = quantize(demo_model, demo_table)
    x = np.load(demo_heldout)["input"][:256]
    ref = ort.InferenceSession(str(demo_model), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]

    def sqnr(model):
        y = IntegerExecutor(model).run({"input": x}).outputs["logits"]
        return 10 * np.log10((ref.astype(np.float64) ** 2).sum() / ((ref - y) ** 2).sum())

    assert sqnr(qmodel) > sqnr(plain) + 1.0  # measured: 33.7 -> 36.1 dB on all 540


def test_shifts_are_whole_steps_of_the_bias_scale(demo_model, demo_table, corrected):
    qmodel, report, correction, _ = corrected
    plain, _ = quantize(demo_model, demo_table)
    inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
    plain_inits = {i.name: numpy_helper.to_array(i) for i in plain.graph.initializer}
    for t in targets(qmodel):
        steps = correction.deltas[t.node] / t.scale
        assert np.array_equal(steps, np.rint(steps))
        assert np.array_equal(inits[t.bias].astype(np.int64) - plain_inits[t.bias], steps.astype(np.int64))
    assert report.bias_correction["ops"] == 5 and report.bias_correction["samples"] == 16


def _corrected_on_8(graph, path, rng):
    """``graph`` saved at ``path``, calibrated on 8 random [3, 8, 8] samples and bias-corrected
    on them with ``--holdout 0`` (applied as fitted, whatever it scores: what is tested is the
    correction itself): (path, data, table, model, correction)."""
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    data = path.with_suffix(".npz")
    np.savez(data, x=(rng.random((8, 3, 8, 8)) + 0.5).astype(np.float32))
    table = calibrate(path, data, "minmax", progress=False)
    qmodel, _, correction = quantize_corrected(path, table, QuantizeOptions(), "t", data, 8, 8, False,
                                               holdout=0)
    return path, data, table, qmodel, correction


def test_a_conv_without_bias_gets_one(tmp_path):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["y"], ["z"], name="relu")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 8, 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [None, 4, 8, 8])], [w])
    path, data, table, qmodel, correction = _corrected_on_8(graph, tmp_path / "nobias.onnx", rng)
    assert correction.factor == 1.0 and correction.heldout == 0
    conv = next(n for n in qmodel.graph.node if n.op_type == "Conv")
    assert len(conv.input) == 3 and conv.input[2]
    assert list(correction.deltas) == ["conv"]
    out = IntegerExecutor(qmodel).run({"x": np.load(data)["x"]}).outputs["z"]
    assert out.shape == (8, 4, 8, 8)
    plain, _ = quantize(path, table)
    assert len(next(n for n in plain.graph.node if n.op_type == "Conv").input) == 2


def test_a_conv_after_an_if_whose_branches_read_the_main_graph_is_corrected(tmp_path):
    # conv2 reads an If whose branches read "r" from around them and nothing else does (Silero
    # VAD's op15 decoder): the part of the model that computes conv2 needs r's producer too
    rng = np.random.default_rng(1)
    w1 = numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w2")
    b = numpy_helper.from_array(np.zeros(4, np.float32), "b")
    then = helper.make_graph([helper.make_node("Relu", ["r"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["r"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1", "b"], ["y1"], name="conv1", pads=[1, 1, 1, 1]),
         helper.make_node("Sigmoid", ["y1"], ["r"], name="sig"),
         helper.make_node("ReduceMax", ["x"], ["m"], name="max", keepdims=0),
         helper.make_node("Greater", ["m", "zero"], ["c"], name="positive"),
         helper.make_node("If", ["c"], ["f"], name="branch", then_branch=then, else_branch=other),
         helper.make_node("Conv", ["f", "w2", "b"], ["y"], name="conv2")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4, 8, 8])],
        [w1, w2, b, numpy_helper.from_array(np.array(0, np.float32), "zero")])
    _, data, _, qmodel, correction = _corrected_on_8(graph, tmp_path / "if.onnx", rng)
    assert set(correction.deltas) == {"conv1", "conv2"}
    assert IntegerExecutor(qmodel).run({"x": np.load(data)["x"]}).outputs["y"].shape == (8, 4, 8, 8)


@pytest.fixture
def table_file(demo_table, tmp_path):
    path = tmp_path / "t.yaml"
    write_table(demo_table, path)
    return path


def test_cli_reports_the_correction_and_is_deterministic(demo_model, table_file, demo_calib, tmp_path):
    outs = []
    for k in range(2):
        out = tmp_path / f"q{k}.onnx"
        result = invoke("quantize", demo_model, "-t", table_file, "-o", out, "--data", demo_calib, "-q")
        assert result.exit_code == 0, result.output
        line = re.search(r"^bias: +5 ops fitted on 16 samples; held-out SQNR on 16 other samples: "
                         r"none ([\d.]+) dB, full ([\d.]+) dB, half ([\d.]+) dB -> applied full "
                         r"\(\+([\d.]+) dB\)", result.stdout, re.MULTILINE)
        assert line, result.stdout
        none, full, half, gain = map(float, line.groups())
        assert full > max(none, half) and gain == pytest.approx(full - none, abs=0.01)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    result = invoke("quantize", demo_model, "-t", table_file, "-o", tmp_path / "q.onnx", "--data",
                    demo_calib, "--no-bias-correction", "--json")
    assert result.exit_code == 0 and "bias_correction" not in json.loads(result.stdout)


def test_bias_correction_needs_data(demo_model, table_file, tmp_path):
    result = invoke("quantize", demo_model, "-t", table_file, "-o", tmp_path / "q.onnx",
                    "--bias-correction")
    assert_user_error(result, "--bias-correction needs calibration samples", "--data")
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.parametrize("option", ["--num-samples", "--batch-size"])
def test_sample_counts_must_be_positive(demo_model, table_file, demo_calib, tmp_path, option):
    result = invoke("quantize", demo_model, "-t", table_file, "-o", tmp_path / "q.onnx",
                    "--data", demo_calib, option, "0")
    assert_user_error(result, f"{option} must be at least 1, got 0")


def test_bad_data_file_is_one_line(demo_model, table_file, tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, other=np.zeros((2, 3), np.float32))
    result = invoke("quantize", demo_model, "-t", table_file, "-o", tmp_path / "q.onnx", "--data", bad)
    assert_user_error(result, "bad.npz")
    assert not (tmp_path / "q.onnx").exists()


def _fixed_batch_model(demo_model, demo_calib, size: int, tmp_path):
    """The demo model with its batch dim fixed at ``size``, saved, and its table."""
    model = onnx.load(demo_model)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = size
    path = tmp_path / f"batch{size}.onnx"
    onnx.save(model, path)
    return path, calibrate(path, demo_calib, progress=False)


def test_a_model_with_a_fixed_batch_dim_is_fed_whole_batches(demo_model, demo_table, demo_calib, tmp_path):
    path, table = _fixed_batch_model(demo_model, demo_calib, 4, tmp_path)
    qmodel, report, correction = quantize_corrected(path, table, QuantizeOptions(), "t", demo_calib, 10, 8,
                                                    progress=False)
    assert report.bias_correction["samples"] == 8 and len(correction.deltas) == 5
    with pytest.raises(QtoolError, match="the model takes batches of 4 samples, and only 3 are used"):
        quantize_corrected(path, table, QuantizeOptions(), "t", demo_calib, 3, 8, progress=False)


def test_fit_and_held_out_samples_are_disjoint_and_spread(demo_model, tmp_path):
    from qtool.analyze import split_batches

    float_model = prepare(load_model(demo_model))
    data = tmp_path / "numbered.npz"
    np.savez(data, input=np.arange(40, dtype=np.float32).reshape(40, 1, 1, 1) * np.ones((1, 1, 8, 8), np.float32))

    def numbers(batches):
        return [int(v) for feeds in batches for v in feeds["input"][:, 0, 0, 0]]

    fit, held = split_batches(float_model, data, 10, 10, 4)
    assert numbers(fit) == [0, 4, 8, 12, 16, 20, 24, 28, 32, 36]  # every other of 20 spread over 40
    assert numbers(held) == [2, 6, 10, 14, 18, 22, 26, 30, 34, 38]
    assert (fit.samples, held.samples) == (10, 10)
    # fewer samples than asked: shared in proportion, never overlapping
    fit, held = split_batches(float_model, data, 30, 10, 8)
    assert len(numbers(fit)) == 30 and len(numbers(held)) == 10
    assert not set(numbers(fit)) & set(numbers(held))
    fit, held = split_batches(float_model, data, 16, 0, 8)
    assert held is None and len(numbers(fit)) == 16


def test_a_correction_that_loses_on_held_out_samples_is_not_applied(demo_model, demo_table, demo_calib,
                                                                    monkeypatch):
    import qtool.bias_correction as bias_module

    fitted = bias_module.correct_biases

    def reversed_and_amplified(*args, **kwargs):  # a fit that cannot hold: 20 times the wrong way
        result = fitted(*args, **kwargs)
        result.deltas = {node: -20 * delta for node, delta in result.deltas.items()}
        return result

    monkeypatch.setattr(bias_module, "correct_biases", reversed_and_amplified)
    qmodel, report, correction = quantize_corrected(demo_model, demo_table, QuantizeOptions(), "t",
                                                    demo_calib, 16, 8, progress=False)
    assert correction.factor == 0.0 and correction.applied == {}
    summary = report.bias_correction
    assert summary["applied"] == 0.0 and summary["heldout_samples"] == 16
    scores = summary["heldout_sqnr_db"]
    assert scores["none"] > max(scores["1.0"], scores["0.5"])
    plain, _ = quantize(demo_model, demo_table)
    # exactly the plain model's integers
    assert {i.name: numpy_helper.to_array(i).tobytes() for i in qmodel.graph.initializer} == \
        {i.name: numpy_helper.to_array(i).tobytes() for i in plain.graph.initializer}
    # the held-out score of no correction, computed here: onnxruntime running the plain QDQ model as
    # written on the 16 held-out samples (odd positions of 32 spread over the 256)
    x = np.load(demo_calib)["input"][8::16]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    got = ort.InferenceSession(plain.SerializeToString(), options,
                               providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    ref = ort.InferenceSession(str(demo_model), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    ref64 = ref.astype(np.float64)
    expected = 10 * np.log10((ref64 ** 2).sum() / ((ref64 - got) ** 2).sum())
    assert scores["none"] == pytest.approx(expected, abs=0.01)


def test_holdout_must_not_be_negative(demo_model, table_file, demo_calib, tmp_path):
    result = invoke("quantize", demo_model, "-t", table_file, "-o", tmp_path / "q.onnx",
                    "--data", demo_calib, "--holdout", "-1")
    assert_user_error(result, "--holdout must be >= 0, got -1")
    assert not (tmp_path / "q.onnx").exists()


def test_one_sample_leaves_nothing_to_judge_on(demo_model, demo_table, demo_calib, tmp_path):
    one = tmp_path / "one.npz"
    np.savez(one, input=np.load(demo_calib)["input"][:1])
    qmodel, report, correction = quantize_corrected(demo_model, demo_table, QuantizeOptions(), "t", one,
                                                    16, 8, progress=False)
    assert correction.deltas and correction.factor == 0.0
    assert "no sample left to judge it on (1 used to fit)" in report.bias_correction["not_judged"]


def test_a_model_fixed_at_batch_one_is_fed_one_sample_a_run(demo_model, demo_table, demo_calib, tmp_path):
    path, table = _fixed_batch_model(demo_model, demo_calib, 1, tmp_path)
    _, report, _ = quantize_corrected(path, table, QuantizeOptions(), "t", demo_calib, 8, 8, progress=False)
    assert report.bias_correction["samples"] == 8 and report.bias_correction["heldout_samples"] == 8


def _both_ways(model_path, table, data, batch_size, monkeypatch):
    """correct_biases by pieces (kept tensors) and by whole prefixes, on the same QDQ model."""
    from qtool import bias_correction as bc
    from qtool.analyze import split_batches

    float_model = prepare(load_model(model_path))
    fit, _ = split_batches(float_model, data, 8, 8, batch_size, None)
    every = {n.name: 0.0 for n in float_model.graph.node if n.op_type in bc.CHANNEL_AXIS}
    work, _ = quantize(model_path, table, QuantizeOptions(), "t", every)
    assert bc._Pieces.applies(work)
    pieces = bc.correct_biases(float_model, work, fit, progress=False)
    monkeypatch.setattr(bc._Pieces, "applies", staticmethod(lambda model: False))
    prefixes = bc.correct_biases(float_model, work, fit, progress=False)
    return pieces, prefixes


def test_pieces_give_the_prefixes_shifts_bit_for_bit(demo_model, demo_table, demo_calib, monkeypatch):
    # the same onnxruntime kernels on the same inputs: each target's mean, so each shift, is equal;
    # the demo has a residual block (a tensor kept for a later Add while the branch is corrected)
    pieces, prefixes = _both_ways(demo_model, demo_table, demo_calib, 8, monkeypatch)
    assert list(pieces.deltas) == list(prefixes.deltas) and len(pieces.deltas) == 5
    assert any(np.any(d != 0) for d in prefixes.deltas.values())
    for node, delta in prefixes.deltas.items():
        np.testing.assert_array_equal(pieces.deltas[node], delta, err_msg=node)


def test_pieces_equal_prefixes_on_ppocr_rec(tmp_path, monkeypatch):
    from test_real_models import _model, _strokes

    model = _model("ch_PP-OCRv4_rec_infer.onnx")
    data = tmp_path / "lines.npz"
    np.savez(data, x=_strokes(16, 0, 48, 320))
    table = calibrate(model, data, progress=False)
    pieces, prefixes = _both_ways(model, table, data, 8, monkeypatch)
    assert len(prefixes.deltas) > 30
    for node, delta in prefixes.deltas.items():
        np.testing.assert_array_equal(pieces.deltas[node], delta, err_msg=node)


def test_the_float_means_come_in_runs_bounded_by_bytes_with_the_same_shifts(demo_model, demo_table, demo_calib,
                                                                           monkeypatch):
    # the float reference's per-channel means: as many outputs a run as hold REFERENCE_BYTES of
    # one sample (sizes by shape inference at the first feed's shapes), else REFERENCE_CHUNK; each
    # tensor's sums are the same in any grouping, so the shifts are
    from qtool import bias_correction as bc
    from qtool.analyze import split_batches
    from qtool.runs import Runs

    float_model = prepare(load_model(demo_model))
    fit, _ = split_batches(float_model, demo_calib, 8, 8, 8, None)
    every = {n.name: 0.0 for n in float_model.graph.node if n.op_type in bc.CHANNEL_AXIS}
    work, _ = quantize(demo_model, demo_table, QuantizeOptions(), "t", every)
    outputs = {n.name: n.output[0] for n in float_model.graph.node}
    found = [t for t in targets(work) if t.node in outputs]
    names = [outputs[t.node] for t in found]
    one = Runs(fit).feeds[:1]  # one sample
    sizes = bc.one_feed_bytes(float_model, names, one)
    first = np.asarray(one[0]["input"])
    assert first.shape[0] == 1
    assert set(sizes) == set(names)
    conv = next(n for n in float_model.graph.node if n.op_type == "Conv")
    channels = next(t.dims[0] for t in float_model.graph.initializer if t.name == conv.input[1])
    assert sizes[conv.output[0]] == 4 * channels * first.shape[0] * first.shape[2] * first.shape[3]  # same padding

    runs = []
    original = bc._channel_means
    monkeypatch.setattr(bc, "_channel_means", lambda model, n, *a: runs.append(len(n)) or original(model, n, *a))
    whole = bc.correct_biases(float_model, work, fit, progress=False)
    assert runs == [len(found)]  # the demo's outputs fit one run
    runs.clear()
    monkeypatch.setattr(bc, "REFERENCE_BYTES", 2 * max(sizes.values()))
    split = bc.correct_biases(float_model, work, fit, progress=False)
    assert len(runs) > 1 and sum(runs) == len(found)
    runs.clear()
    monkeypatch.setattr(bc, "one_feed_bytes", lambda *a: None)  # no sizes: REFERENCE_CHUNK a run
    monkeypatch.setattr(bc, "REFERENCE_CHUNK", 2)
    fixed = bc.correct_biases(float_model, work, fit, progress=False)
    assert runs == [2] * (len(found) // 2) + [len(found) % 2] * (len(found) % 2)
    for other in (split, fixed):
        assert list(other.deltas) == list(whole.deltas)
        for node, delta in whole.deltas.items():
            np.testing.assert_array_equal(other.deltas[node], delta, err_msg=node)
