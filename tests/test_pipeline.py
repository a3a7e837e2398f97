"""The demo end to end through the library: calibrate -> quantize -> exec / verify."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.calibrate import calibrate
from qtool.errors import QtoolError
from qtool.executor import IntegerExecutor
from qtool.model import prepare
from qtool.quantize import QuantizeOptions, quantize
from qtool.table_formats import read_table, write_table
from qtool.verify import verify


def _weight_of(qmodel, node_name):
    """(stored weight, scale) feeding a node's input 1 through its DequantizeLinear."""
    inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
    node = next(n for n in qmodel.graph.node if n.name == node_name)
    dq = next(n for n in qmodel.graph.node if n.output[0] == node.input[1])
    assert dq.op_type == "DequantizeLinear"
    return inits[dq.input[0]], inits[dq.input[1]]


def _accuracy(logits, labels):
    return 100.0 * float(np.mean(logits.argmax(-1) == labels))


@pytest.mark.parametrize("symmetric,bits", [(False, 32), (True, 32), (False, 8), (True, 8)])
def test_demo_int8_accuracy_within_one_point(demo_model, demo_table, demo_heldout, symmetric, bits):
    held = np.load(demo_heldout)
    x, labels = held["input"], held["label"]
    float_logits = ort.InferenceSession(str(demo_model)).run(None, {"input": x})[0]
    qmodel, report = quantize(demo_model, demo_table, QuantizeOptions(symmetric=symmetric, multiplier_bits=bits))
    assert report.kept_float == []
    int_logits = IntegerExecutor(qmodel).run({"input": x}).outputs["logits"]
    float_acc, int_acc = _accuracy(float_logits, labels), _accuracy(int_logits, labels)
    assert float_acc >= 95.0
    assert int_acc >= float_acc - 1.0


def test_quantized_model_is_valid_onnx_that_onnxruntime_runs(demo_model, demo_table, demo_heldout):
    qmodel, report = quantize(demo_model, demo_table)
    onnx.checker.check_model(qmodel, full_check=True)
    ops = {n.op_type for n in qmodel.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv", "Gemm"} <= ops
    assert "BatchNormalization" not in ops  # folded by onnxruntime's basic optimizer
    weight, scale = _weight_of(qmodel, "conv1")
    # the portable target: uint8 weights with zero point 128 (int8 + 128)
    assert weight.dtype == np.uint8 and weight.shape == (16, 1, 3, 3)
    assert scale.shape == (16,)  # per output channel
    meta = {p.key: p.value for p in qmodel.metadata_props}
    assert meta["qtool.rounding"] == "half_up" and meta["qtool.multiplier_bits"] == "32"
    assert meta["qtool.target"] == "portable"
    x = np.load(demo_heldout)["input"][:4]
    y = ort.InferenceSession(qmodel.SerializeToString()).run(None, {"input": x})[0]
    assert y.shape == (4, 10)
    assert report.size_after < report.size_before


def test_per_tensor_weights(demo_model, demo_table):
    qmodel, _ = quantize(demo_model, demo_table, QuantizeOptions(per_channel=False))
    weight, scale = _weight_of(qmodel, "conv1")
    assert scale.shape == () and np.abs(weight.astype(np.int64) - 128).max() == 127


@pytest.mark.parametrize("method, fmt", [("minmax", "qdq"), ("kl", "qoperator")])
def test_pipeline_is_deterministic(tmp_path, demo_model, demo_calib, demo_heldout, demo_table,
                                   method, fmt):
    """calibrate -> quantize -> verify --json through the CLI, twice, each run in its own folder:
    the table, the quantized model and the report are the same bytes; so is a table written from
    the session's own calibration (the library path)."""
    from typer.testing import CliRunner

    from qtool.cli import app

    runner = CliRunner()
    runs = []
    for name in ("first", "second"):
        folder = tmp_path / name
        folder.mkdir()
        table, qmodel = folder / "table.yaml", folder / "model.q.onnx"
        for args in (["calibrate", demo_model, "-d", demo_calib, "-o", table, "-q", "--method", method],
                     ["quantize", demo_model, "-t", table, "-o", qmodel, "--format", fmt],
                     ["verify", demo_model, qmodel, "-d", demo_heldout, "--json", "-q"]):
            result = runner.invoke(app, [str(a) for a in args])
            assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["passed"] is True
        runs.append({"table": table.read_bytes(), "model": qmodel.read_bytes(),
                     "report": result.stdout.encode()})
    first, second = runs
    for artifact in ("table", "model", "report"):
        assert first[artifact] == second[artifact], f"the {artifact} differs between runs"
    if method == "minmax":
        write_table(demo_table, tmp_path / "library.yaml")
        assert (tmp_path / "library.yaml").read_bytes() == first["table"]
        qmodel, _ = quantize(demo_model, read_table(tmp_path / "library.yaml"))
        assert qmodel.SerializeToString() == first["model"]


def test_table_round_trips_through_json(tmp_path, demo_table):
    write_table(demo_table, tmp_path / "t.json")
    assert read_table(tmp_path / "t.json") == demo_table


def test_relu_shares_range_with_its_producer(demo_model, demo_table):
    # backward propagation: conv1's output takes relu1's range, so asymmetric Z = -128 (real 0)
    qmodel, _ = quantize(demo_model, demo_table, QuantizeOptions(target="exact"))
    inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
    assert inits["bn1_out_zero_point"] == inits["relu1_out_zero_point"] == -128
    assert inits["bn1_out_scale"] == inits["relu1_out_scale"]
    entry = demo_table.tensors["relu1_out"]
    assert inits["relu1_out_scale"] == np.float32(entry.max / 255)


def test_verify_on_demo(demo_model, demo_table, demo_heldout, tmp_path):
    qmodel, _ = quantize(demo_model, demo_table)
    onnx.save(qmodel, tmp_path / "q.onnx")
    report = verify(demo_model, tmp_path / "q.onnx", demo_heldout, labels="label", progress=False)
    assert report.passed
    assert report.outputs[0].name == "logits" and report.outputs[0].cosine > 0.999
    # the input and the output of 12 integer ops; the 13th writes the graph output 'logits'
    assert len(report.tensors) == 13
    assert all(c.ran in ("integer", "input") for c in report.tensors)
    assert report.accuracy["integer"] >= report.accuracy["float"] - 1.0
    strict = verify(demo_model, tmp_path / "q.onnx", demo_heldout, tolerance=(1.0, 200.0), progress=False)
    assert not strict.passed and "logits" in strict.failures[0]


def test_unsupported_op_stays_float_and_is_reported(tmp_path):
    # Conv -> Sin -> Conv: Sin has no integer kernel, so it is fenced by Q/DQ
    rng = np.random.default_rng(0)
    w1, w2 = (rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32),
              rng.normal(0, 0.5, (2, 4, 1, 1)).astype(np.float32))
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1"], ["a"], name="c1", pads=[1, 1, 1, 1]),
         helper.make_node("Sin", ["a"], ["s"], name="sin"),
         helper.make_node("Conv", ["s", "w2"], ["y"], name="c2")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 6, 6])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              tmp_path / "m.onnx")
    x = rng.normal(0, 1, (16, 3, 6, 6)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    table = calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False)
    qmodel, report = quantize(tmp_path / "m.onnx", table)
    assert report.kept_float == [("Sin", "sin", "no integer kernel for this op type")]
    executor = IntegerExecutor(qmodel)
    assert [(t, n) for t, n, _ in executor.float_nodes()] == [("Sin", "sin")]
    got = executor.run({"x": x}).outputs["y"]
    want = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"x": x})[0]
    cos = float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))
    assert cos > 0.99


def test_table_for_another_model_warns(demo_model, demo_table):
    other = type(demo_table)(**{**demo_table.__dict__, "model_sha256": "0" * 64})
    _, report = quantize(demo_model, other)
    assert any("was made for model" in w for w in report.warnings)


def test_executor_reports_accumulator_overflow(demo_model, demo_table, demo_heldout):
    from qtool.errors import QtoolError

    qmodel, _ = quantize(demo_model, demo_table)
    executor = IntegerExecutor(qmodel)
    step = next(s for s in executor.steps if s.node.name == "conv1")
    # a bias at the edge of int32 makes the accumulator leave int32
    step.params = type(step.params)(**{**step.params.__dict__,
                                        "bias": np.full_like(step.params.bias, 2**31 - 1)})
    with pytest.raises(QtoolError, match="overflow in Conv node 'conv1'"):
        executor.run({"input": np.load(demo_heldout)["input"][:2]})


def test_float_model_in_the_executor_is_exact(demo_model, demo_heldout):
    # the executor runs every node of an unquantized model in float (onnxruntime, one node at a
    # time, BatchNormalization included): it must reproduce the whole-model run
    executor = IntegerExecutor(onnx.load(demo_model))
    assert len(executor.float_nodes()) == 17  # the unprepared graph: BatchNormalization not folded
    x = np.load(demo_heldout)["input"][:64]
    got = executor.run({"input": x}).outputs["logits"]
    want = ort.InferenceSession(str(demo_model)).run(None, {"input": x})[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_verify_refuses_a_model_with_no_integer_op(demo_model, demo_heldout):
    # float against float would PASS: a user who verifies the wrong file must be told
    with pytest.raises(QtoolError, match="has no integer op .17 nodes would run in float., so there is nothing to verify"):
        verify(demo_model, demo_model, demo_heldout, num_samples=64, progress=False)


def test_data_movement_ops_share_their_input_range(demo_model, demo_table):
    # forward propagation: MaxPool and Flatten outputs take their inputs' (S, Z), so their
    # kernels need no requantization; the group's range covers every member
    qmodel, _ = quantize(demo_model, demo_table)
    inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
    for a, b in [("block_relu2_out", "pool_out"), ("gap_out", "flatten_out")]:
        assert inits[f"{a}_scale"] == inits[f"{b}_scale"] and inits[f"{a}_zero_point"] == inits[f"{b}_zero_point"]
    widest = max(demo_table.tensors[n].max for n in ("block_add_out", "block_relu2_out", "pool_out"))
    assert inits["pool_out_scale"] == np.float32(widest / 255)
    executor = IntegerExecutor(qmodel)
    pool = next(s for s in executor.steps if s.node.op_type == "MaxPool")
    assert pool.params.rescale.requant is None  # identity: no arithmetic at all


def _layernorm_decomposition(tmp_path, gamma: bool, mean_axis: int | None = None):
    """x -> (x - mean) / sqrt(var + eps) [* gamma] as exporters write it, at opset 13. With
    ``mean_axis``, Paddle's form: x is [N, 8, 5], the mean is over ``mean_axis``, and the centred
    tensor is transposed to [N, 5, 8] before the variance over the last axis."""
    rng = np.random.default_rng(0)
    if mean_axis is None:
        nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1], name="mean"),
                 helper.make_node("Sub", ["x", "mean"], ["centred"], name="sub")]
    else:
        nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[mean_axis], name="mean"),
                 helper.make_node("Sub", ["x", "mean"], ["centred_t"], name="sub"),
                 helper.make_node("Transpose", ["centred_t"], ["centred"], perm=[0, 2, 1], name="transpose")]
    nodes += [helper.make_node("Pow", ["centred", "two"], ["sq"], name="pow"),
             helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1], name="var"),
             helper.make_node("Add", ["var", "eps"], ["var_eps"], name="add_eps"),
             helper.make_node("Sqrt", ["var_eps"], ["std"], name="sqrt"),
             helper.make_node("Div", ["centred", "std"], ["normed" if gamma else "y"], name="div")]
    if gamma:
        nodes.append(helper.make_node("Mul", ["normed", "gamma"], ["y"], name="gamma_mul"))
    graph = helper.make_graph(
        nodes, "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5, 8] if mean_axis is None else ["N", 8, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5, 8])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
         numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
         numpy_helper.from_array(rng.normal(1, 0.1, 8).astype(np.float32), "gamma")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              tmp_path / "m.onnx")
    x = rng.normal(0, 2, (8, 5, 8) if mean_axis is None else (8, 8, 5)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    table = calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False)
    return x, quantize(tmp_path / "m.onnx", table)


def test_layernorm_decomposition_is_one_integer_op(tmp_path):
    """With its gamma, the decomposition becomes one LayerNormalization (opset 17) that the
    executor runs integer, equal to onnxruntime's float LayerNorm on the same QDQ fences."""
    x, (qmodel, report) = _layernorm_decomposition(tmp_path, gamma=True)
    assert report.kept_float == [] and report.quantized == {"LayerNormalization": 1}
    assert any("upgraded from 13 to 17" in w for w in report.warnings)
    executor = IntegerExecutor(qmodel)
    assert executor.float_nodes() == []
    got = executor.run({"x": x}).outputs["y"]
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    want = ort.InferenceSession(qmodel.SerializeToString(), options).run(None, {"x": x})[0]
    dq = next(n for n in qmodel.graph.node if n.output[0] == "y")
    step = float(numpy_helper.to_array(next(t for t in qmodel.graph.initializer if t.name == dq.input[1])))
    assert np.abs(got - want).max() <= step * 1.001  # one output step at most
    assert np.mean(got == want) >= 0.99


def test_transposed_layernorm_decomposition_is_one_integer_op(tmp_path):
    """Paddle's form (mean over axis 1, the centred tensor transposed before the variance; PP-OCRv6
    rec) becomes Transpose -> LayerNormalization, the same function in float, integer in the
    executor."""
    x, (qmodel, report) = _layernorm_decomposition(tmp_path, gamma=True, mean_axis=1)
    assert report.kept_float == [] and report.quantized == {"LayerNormalization": 1, "Transpose": 1}
    assert IntegerExecutor(qmodel).float_nodes() == []
    prepared = prepare(onnx.load(tmp_path / "m.onnx"), "m.onnx")
    assert [n.op_type for n in prepared.graph.node] == ["Transpose", "LayerNormalization"]
    want = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"x": x})[0]
    got = ort.InferenceSession(prepared.SerializeToString()).run(None, {"x": x})[0]
    assert got.shape == (8, 5, 8) and np.abs(got - want).max() < 1e-5


def test_transposed_layernorm_needs_the_mean_axis_moved_last(tmp_path):
    # a mean over axis 2, which the transpose moves to the middle: not a LayerNorm, stays float
    _, (_, report) = _layernorm_decomposition(tmp_path, gamma=True, mean_axis=2)
    assert ("Add", "add_eps", "inside a LayerNormalization (float by default)") in report.kept_float


def test_a_sum_over_a_complex_values_two_parts_is_no_normalization(tmp_path):
    """basic-pitch's constant-Q magnitude: sqrt of the squared real and imaginary parts summed over
    an axis of 2. That ReduceSum is no LayerNorm's statistic: the Conv after it runs integer (the
    whole network downstream of it had been kept float, "inside a LayerNormalization"), and a sum
    over the 8 values of a row still is one (the Sqrt's neighbours stay float)."""
    rng = np.random.default_rng(3)
    for parts, integer_conv in ((2, True), (8, False)):
        graph = helper.make_graph(
            [helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),
             helper.make_node("ReduceSum", ["sq", "axes"], ["power"], keepdims=0, name="sum"),
             helper.make_node("Sqrt", ["power"], ["magnitude"], name="sqrt"),
             helper.make_node("Conv", ["magnitude", "w"], ["y"], name="conv")], "cqt",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 5, parts])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 6, 5])],
            [numpy_helper.from_array(np.array([4], np.int64), "axes"),
             numpy_helper.from_array(rng.normal(size=(3, 4, 1, 1)).astype(np.float32), "w")])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
        np.savez(tmp_path / "d.npz", x=rng.normal(size=(8, 4, 6, 5, parts)).astype(np.float32))
        table = calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False)
        _, report = quantize(tmp_path / "m.onnx", table)
        kept = {name: reason for _, name, reason in report.kept_float}
        assert ("conv" not in kept) == integer_conv, kept
        assert ("sum" in kept) == (not integer_conv), kept


def test_layernorm_variance_stays_float(tmp_path):
    # without a gamma the decomposition is not fused: the Add(variance, eps) before Sqrt stays float
    _, (_, report) = _layernorm_decomposition(tmp_path, gamma=False)
    assert ("Add", "add_eps", "inside a LayerNormalization (float by default)") in report.kept_float


@pytest.mark.parametrize("network_before", [False, True, "relu6", "floor"])
def test_the_front_end_of_a_log_spectrum_stays_float(tmp_path, network_before):
    """An STFT as a Conv, its power and an epsilon, then a Log (speechmos's DNSMOS, basic-pitch):
    the small powers round to 0 on any 8- or 16-bit grid and their logs to log(eps), so the ops
    that only compute the Log's input from the model's input stay float, the network after it
    is integer; an epsilon floor (Max with 1e-8) belongs to the front end too. A Relu, or a Clip
    at 0 and 6 (ReLU6), before the Log makes it a network: quantized as before."""
    rng = np.random.default_rng(7)
    nodes = [helper.make_node("Conv", ["x", "frames"], ["spectrum"], strides=[8], name="stft"),
             helper.make_node("Mul", ["spectrum", "spectrum"], ["power"], name="square"),
             helper.make_node("Add", ["power", "eps"], ["floor"], name="add_eps"),
             helper.make_node("Log", ["floor"], ["log_power"], name="log"),
             helper.make_node("Conv", ["log_power", "w"], ["y"], name="head")]
    if network_before is True:
        nodes.insert(1, helper.make_node("Relu", ["spectrum"], ["spectrum_relu"], name="relu"))
        nodes[2].input[:] = ["spectrum_relu", "spectrum_relu"]
    elif network_before == "relu6":
        nodes.insert(1, helper.make_node("Clip", ["spectrum", "zero", "six"], ["spectrum_relu"], name="relu"))
        nodes[2].input[:] = ["spectrum_relu", "spectrum_relu"]
    elif network_before == "floor":  # Add(eps) as Max(power, eps)
        nodes[2] = helper.make_node("Max", ["power", "eps"], ["floor"], name="add_eps")
    graph = helper.make_graph(
        nodes, "logspec", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 7])],
        [numpy_helper.from_array(rng.normal(size=(8, 1, 16)).astype(np.float32), "frames"),
         numpy_helper.from_array(np.array(1e-8, np.float32), "eps"),
         numpy_helper.from_array(np.array(0, np.float32), "zero"), numpy_helper.from_array(np.array(6, np.float32), "six"),
         numpy_helper.from_array(rng.normal(size=(4, 8, 1)).astype(np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    # quiet and loud frames, as audio: a power range far wider than 16 bits
    x = (rng.normal(size=(16, 1, 64)) * 10.0 ** rng.uniform(-4, 0, (16, 1, 8)).repeat(8, axis=2)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    qmodel, report = quantize(tmp_path / "m.onnx", calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False))
    kept = {name: reason for _, name, reason in report.kept_float}
    if network_before in (True, "relu6"):
        assert "stft" not in kept and "square" not in kept and report.quantized.get("Conv") == 2, kept
        return
    assert {"stft", "square", "add_eps"} <= set(kept) and "head" not in kept, kept
    assert kept["stft"] == "in the front end of Log 'log' (a log of linearly quantized values loses the small ones)"
    want = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"x": x})[0]
    got = IntegerExecutor(qmodel).run({"x": x}).outputs["y"]
    sqnr = 10 * np.log10(np.sum(want.astype(np.float64) ** 2) / np.sum((want - got).astype(np.float64) ** 2))
    assert sqnr > 30, sqnr
