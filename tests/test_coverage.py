"""Models qtool is given that are not plain float CNNs (issue 15): already-quantized models,
subgraphs (If) and inputs that are not per sample. Each user-facing refusal is checked as the user
sees it: exit code 2, one line naming the node or input, nothing written."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import packaged_file
from test_cli import assert_user_error, invoke, user_error_leaves_nothing


@pytest.fixture(scope="module")
def dynamic_model(tmp_path_factory, demo_model) -> Path:
    """The demo model through onnxruntime's dynamic quantization (DynamicQuantizeLinear,
    ConvInteger, MatMulInteger), as a user might have it."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path = tmp_path_factory.mktemp("dynamic") / "digits.dyn.onnx"
    quantize_dynamic(str(demo_model), str(path), weight_type=QuantType.QInt8)
    kinds = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "DynamicQuantizeLinear" in kinds, kinds
    return path


@pytest.mark.parametrize("weights", ["QUInt8", "QInt8"])
def test_a_dynamically_quantized_model_runs_and_verifies(tmp_path, demo_model, demo_heldout, weights):
    """onnxruntime's quantize_dynamic writes DynamicQuantizeLinear (scale and zero point computed
    from each batch), then ConvInteger / MatMulInteger reading that zero point at run time: the
    executor runs them integer, and verify compares the model with its float original."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from qtool.executor import IntegerExecutor

    path = tmp_path / "dyn.onnx"
    quantize_dynamic(str(demo_model), str(path), weight_type=getattr(QuantType, weights))
    model = onnx.load(str(path))
    executor = IntegerExecutor(model)
    kinds = {(s.kind, s.node.op_type) for s in executor.steps}
    assert {("boundary", "DynamicQuantizeLinear"), ("integer", "ConvInteger"),
            ("integer", "MatMulInteger")} <= kinds, kinds
    assert all(s.params.zero_at_run[0] for s in executor.steps if s.node.op_type.endswith("Integer"))
    result = invoke("verify", demo_model, path, "--data", demo_heldout, "--num-samples", 64)
    assert result.exit_code == 0, result.output
    assert "PASS" in result.stdout
    out = tmp_path / "out.npz"
    result = invoke("exec", path, "-i", demo_heldout, "-o", out, "-q")
    assert result.exit_code == 0, result.output
    assert np.load(out)["logits"].shape == (len(np.load(demo_heldout)["input"]), 10)
    if weights == "QUInt8":  # u8 x u8 products: onnxruntime's kernels are exact on every CPU
        import onnxruntime as ort

        x = np.load(demo_heldout)["input"][:8]
        want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
        assert np.array_equal(executor.run({"input": x}).outputs["logits"], want)


def if_model(then_nodes: list[onnx.NodeProto], inner: list[onnx.TensorProto]) -> onnx.ModelProto:
    """y = If(sum(x) > 0) then <then_nodes on x, ending in 'u'> else x, for x [N, 4]: the branch
    reads x from the outer scope and its constants from the main graph's initializers."""
    def out(name):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", 4])

    then = helper.make_graph(then_nodes, "then", [], [out("u")])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [out("e")])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0, name="sum"),
             helper.make_node("Greater", ["s", "zero"], ["c"], name="positive"),
             helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other, name="branch")]
    graph = helper.make_graph(nodes, "g", [out("x")], [out("y")],
                              [numpy_helper.from_array(np.float32(0), "zero"), *inner])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("fixture", ["qmodel", "dynamic_model"])
def test_calibrate_refuses_a_quantized_model(request, tmp_path, fixture, demo_heldout):
    model = request.getfixturevalue(fixture)
    line = user_error_leaves_nothing(tmp_path, "calibrate", model, "--data", demo_heldout, "-o",
                                     tmp_path / "t.yaml", expect=(str(model), "already quantized"))
    quantized = "QuantizeLinear" if fixture == "qmodel" else "DynamicQuantizeLinear"
    assert quantized in line and "float model" in line


def test_quantize_and_verify_refuse_a_quantized_float_model(tmp_path, dynamic_model, qmodel,
                                                            demo_table, demo_heldout):
    table = tmp_path / "t.yaml"
    from qtool.table_formats import write_table

    write_table(demo_table, table)
    user_error_leaves_nothing(tmp_path, "quantize", dynamic_model, "-t", table, "-o", tmp_path / "q.onnx",
                              expect=("already quantized", "DynamicQuantizeLinear"))
    # verify's first model is the float one: the two models given the wrong way round
    user_error_leaves_nothing(tmp_path, "verify", qmodel, qmodel, "--data", demo_heldout,
                              expect=(str(qmodel), "already quantized"))


def test_a_quantized_node_inside_a_subgraph_is_found(tmp_path):
    nodes = [helper.make_node("DequantizeLinear", ["w", "scale"], ["t"], name="inner_dq"),
             helper.make_node("Mul", ["x", "t"], ["u"], name="inner_mul")]
    model = if_model(nodes, [numpy_helper.from_array(np.int8([1, 2, 3, 4]), "w"),
                             numpy_helper.from_array(np.float32(0.5), "scale")])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    np.savez(tmp_path / "d.npz", x=np.ones((3, 4), np.float32))
    user_error_leaves_nothing(tmp_path, "calibrate", path, "--data", tmp_path / "d.npz", "-o",
                              tmp_path / "t.yaml", expect=("DequantizeLinear 'inner_dq'", "already quantized"))


# -- subgraphs ----------------------------------------------------------------------------------------
def branching_model() -> onnx.ModelProto:
    """t = x * 0.5 (an integer Mul); y = If(sum(t) > 0) then t * w else t: the branch reads the
    main graph's intermediate t and its initializer w from the outer scope."""
    model = if_model([helper.make_node("Mul", ["t", "w"], ["u"], name="inner_mul")],
                     [numpy_helper.from_array(np.float32([1, -2, 3, 0.5]), "w"),
                      numpy_helper.from_array(np.float32(0.5), "half")])
    graph = model.graph
    graph.node.insert(0, helper.make_node("Mul", ["x", "half"], ["t"], name="scale"))
    for node in graph.node[1:]:
        if node.op_type == "ReduceSum":
            node.input[0] = "t"
    then = next(a.g for a in graph.node[-1].attribute if a.name == "else_branch")
    then.node[0].input[0] = "t"
    return model


def quantized(tmp_path: Path, model: onnx.ModelProto, x: np.ndarray) -> tuple[Path, Path, Path, str]:
    """``model`` saved, calibrated on {"x": x} and quantized by the CLI: (model, data, quantized
    model, quantize's report)."""
    path, data, table, qpath = (tmp_path / n for n in ("m.onnx", "d.npz", "t.yaml", "q.onnx"))
    onnx.save(model, str(path))
    np.savez(data, x=x)
    assert invoke("calibrate", path, "--data", data, "-o", table, "-q").exit_code == 0
    result = invoke("quantize", path, "-t", table, "-o", qpath)
    assert result.exit_code == 0, result.output
    return path, data, qpath, result.output


def test_if_model_calibrates_quantizes_and_verifies(tmp_path):
    """The branch the data takes is calibrated inside and its Mul runs integer (issue 31); the
    other branch's Identity stays float and is named by where it is."""
    x = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)
    path, data, qpath, output = quantized(tmp_path, branching_model(), x)
    assert "integer: 3 ops (Mul 2, ReduceSum 1)" in output
    assert "Identity x1: no integer kernel for this op type ('branch/else_branch/Identity_0')" in output
    assert "body:    branch.then_branch: 1 integer, 0 float" in output
    assert "body:    1 other bodies (If/Loop/Scan) have no integer op" in output
    qmodel = onnx.load(str(qpath))
    onnx.checker.check_model(qmodel, full_check=True)
    then = next(a.g for a in qmodel.graph.node[-1].attribute if a.name == "then_branch")
    # t quantized where the branch reads it, w stored as integers, the product requantized
    assert sorted(n.op_type for n in then.node) == ["DequantizeLinear"] * 3 + ["Mul"] + ["QuantizeLinear"] * 2
    result = invoke("verify", path, qpath, "--data", data, "--json", "-q", "--batch-size", "6")
    assert result.exit_code == 0, result.output
    import json

    report = json.loads(result.stdout)
    assert [f["node"] for f in report["float_nodes"] if f["op_type"] == "If"] == []
    # against the float model computed here: the sum over the batch of t is the branch condition
    t = x * np.float32(0.5)
    expected = t * np.float32([1, -2, 3, 0.5]) if t.sum() > 0 else t
    cos = report["outputs"][0]["cosine"]
    assert cos > 0.999 and report["outputs"][0]["name"] == "y"
    from qtool.executor import IntegerExecutor

    got = IntegerExecutor(onnx.load(str(qpath))).run({"x": x}).outputs["y"]
    np.testing.assert_allclose(got, expected, atol=0.05)


def test_an_unexpected_failure_is_one_line_with_exit_3(monkeypatch, capsys, demo_model, demo_heldout, tmp_path):
    import sys

    import qtool.calibrate
    from qtool.cli import main

    def broken(*args, **kwargs):
        raise RuntimeError("something qtool did not expect\nsecond line")

    monkeypatch.setattr(qtool.calibrate, "collect", broken)
    monkeypatch.delenv("QTOOL_TRACEBACK", raising=False)
    monkeypatch.setattr(sys, "argv", ["qtool", "calibrate", str(demo_model), "--data", str(demo_heldout),
                                      "-o", str(tmp_path / "t.yaml"), "-q"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: internal error, RuntimeError: something qtool did not expect (")
    assert not (tmp_path / "t.yaml").exists()
    # QTOOL_TRACEBACK=1 shows where, and the exit code stays 3 (it was Python's 1: "FAIL" to a script)
    monkeypatch.setenv("QTOOL_TRACEBACK", "1")
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 3
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "in broken" in err
    assert err.splitlines()[-1].startswith("error: internal error, RuntimeError: something qtool did not expect (")


# -- inputs that are not per sample -------------------------------------------------------------------
def stateful_model() -> onnx.ModelProto:
    """y = (x + state[0]) * float(sr), state_out = state * 0.5; x [N, 3], state [2, N, 3] (the
    samples on axis 1, as an LSTM's stacked h/c), sr a scalar."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Gather", ["state", "zero"], ["h"], axis=0, name="first"),
             helper.make_node("Add", ["x", "h"], ["s"], name="add"),
             helper.make_node("Cast", ["sr"], ["srf"], to=f, name="cast"),
             helper.make_node("Mul", ["s", "srf"], ["y"], name="scale"),
             helper.make_node("Mul", ["state", "half"], ["state_out"], name="decay")]
    graph = helper.make_graph(
        nodes, "stateful",
        [helper.make_tensor_value_info("x", f, ["N", 3]),
         helper.make_tensor_value_info("state", f, [2, "N", 3]),
         helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", f, ["N", 3]),
         helper.make_tensor_value_info("state_out", f, [2, "N", 3])],
        [numpy_helper.from_array(np.int64(0), "zero"), numpy_helper.from_array(np.float32(0.5), "half")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.fixture
def stateful(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(stateful_model(), str(path))
    rng = np.random.default_rng(5)
    arrays = {"x": rng.standard_normal((10, 3)).astype(np.float32),
              "state": rng.standard_normal((2, 10, 3)).astype(np.float32), "sr": np.array(2, np.int64)}
    np.savez(tmp_path / "d.npz", **arrays)
    return path, tmp_path / "d.npz", arrays


def test_states_and_scalars_run_through_every_command(tmp_path, stateful):
    import json

    path, data, arrays = stateful
    table, qpath, out = tmp_path / "t.yaml", tmp_path / "q.onnx", tmp_path / "y.npz"
    result = invoke("calibrate", path, "--data", data, "-o", table, "-q", "--batch-size", "4")
    assert result.exit_code == 0, result.output
    assert "samples: 10" in table.read_text()
    assert invoke("quantize", path, "-t", table, "-o", qpath, "-q").exit_code == 0
    result = invoke("verify", path, qpath, "--data", data, "--json", "-q", "--batch-size", "4")
    assert result.exit_code in (0, 1), result.output
    assert json.loads(result.stdout)["samples"] == 10
    result = invoke("exec", path, "--input", data, "-o", out, "-q")
    assert result.exit_code == 0, result.output
    got = np.load(out)
    np.testing.assert_allclose(got["y"], (arrays["x"] + arrays["state"][0]) * 2, rtol=1e-6)
    np.testing.assert_allclose(got["state_out"], arrays["state"] * 0.5, rtol=1e-6)


@pytest.mark.parametrize("bad, expect", [
    ({"sr": np.array([2, 2], np.int64)}, ("'sr'", "shape [2]", "model expects []")),
    ({"state": np.zeros((3, 10, 3), np.float32)}, ("'state'", "axis 0 differs")),
    ({"state": np.zeros((2, 7, 3), np.float32)}, ("different sample counts [7, 10]",)),
    ({"state": np.zeros((2, 10), np.float32)}, ("'state'", "[2,N,3]", "samples on axis 1")),
])
def test_data_for_non_sample_inputs_is_checked(tmp_path, stateful, bad, expect):
    path, _, arrays = stateful
    np.savez(tmp_path / "bad.npz", **(arrays | bad))
    user_error_leaves_nothing(tmp_path, "calibrate", path, "--data", tmp_path / "bad.npz", "-o",
                              tmp_path / "t.yaml", expect=expect)


# -- real models: silero-vad (installed by `make test` without its dependencies) ----------------------
def _silero(name: str) -> Path:
    return packaged_file("silero_vad", f"data/{name}", "silero-vad")


def _speech(n: int, seed: int = 0, width: int = 512) -> np.ndarray:
    """Frames of a made-up voiced sound (a 220 Hz tone, amplitude-modulated, with noise)."""
    rng = np.random.default_rng(seed)
    t = np.arange(n * width) / 16000
    wave = 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t)) + 0.05 * rng.standard_normal(t.size)
    return wave.astype(np.float32).reshape(n, width)


@pytest.mark.parametrize("name", ["silero_vad.onnx", "silero_vad_op18_ifless.onnx", "silero_vad_16k_op15.onnx"])
def test_silero_vad_goes_end_to_end(tmp_path, name):
    """A voice-activity model with a scalar sample-rate input and an LSTM state [2, N, 128], at
    opsets 15, 16 and 18: the whole network inside an If whose subgraphs read main-graph
    initializers, or (opset 15) its convolutions in the main graph and Ifs for the sample rate;
    each calibrated, quantized and verified with no error."""
    import json

    path = _silero(name)
    data = tmp_path / "vad.npz"
    np.savez(data, input=_speech(8), state=np.zeros((2, 8, 128), np.float32), sr=np.array(16000, np.int64))
    table, qpath = tmp_path / "t.yaml", tmp_path / "q.onnx"
    for args in (("calibrate", path, "--data", data, "-o", table, "-q", "--batch-size", "4"),
                 ("quantize", path, "-t", table, "-o", qpath, "-q", "--json")):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    # the convolutions and the LSTM of the 16 kHz network run integer, inside the If or not (issue 31)
    ops = json.loads(result.stdout)["quantized"]
    cell = ops.get("LSTM", 0) or ops.get("Gemm", 0)  # the opset 18 export spells the cell out
    assert ops.get("Conv", 0) >= 4 and cell >= 1, ops
    result = invoke("verify", path, qpath, "--data", data, "--json", "-q", "--tolerance", "0")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["samples"] == 8 and [o["name"] for o in report["outputs"]] == ["output", "stateN"]
    assert all(-1 <= o["cosine"] <= 1 for o in report["outputs"])
    # what stays float inside the If: the 8 kHz branch, which the 16 kHz data never ran
    uncalibrated = [f for f in report["float_nodes"] if f["op_type"] in ("Conv", "LSTM")]
    assert all("never ran" in f["reason"] for f in uncalibrated), uncalibrated


def test_silero_vad_lstm_sequence_model_runs_sample_by_sample(tmp_path):
    """The sequence variant: a top-level LSTM whose states h, c are fixed at [1, 1, 128]: per-sample
    states [N, 1, 128] run one sample at a time through quantize, exec and verify; the LSTM runs
    as integers (qtool/ops/recurrent.py)."""
    import json

    path = _silero("silero_vad_16k_sequence.onnx")
    data = tmp_path / "seq.npz"
    n = 6
    np.savez(data, input=_speech(n, width=576), h=np.zeros((n, 1, 128), np.float32),
             c=np.zeros((n, 1, 128), np.float32))
    table, qpath, out = tmp_path / "t.yaml", tmp_path / "q.onnx", tmp_path / "y.npz"
    for args in (("calibrate", path, "--data", data, "-o", table, "-q"),
                 ("quantize", path, "-t", table, "-o", qpath, "-q"),
                 ("exec", qpath, "--input", data, "-o", out, "-q")):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    got = np.load(out)
    assert got["speech_probs"].shape == (n,) and got["hn"].shape == (n, 1, 128)
    result = invoke("verify", path, qpath, "--data", data, "--json", "-q", "--tolerance", "0")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["samples"] == n
    assert "LSTM" not in {f["op_type"] for f in report["float_nodes"]}
    lstm = [t for t in report["tensors"] if t.get("op_type") == "LSTM"]
    assert lstm and all(t["ran"] == "integer" for t in lstm)


def test_loop_body_reading_the_outer_scope_runs(tmp_path):
    """y = Loop 3 times: v = v * w + b, with w and b initializers of the main graph read from the
    body: the body is calibrated over its iterations (one scale for the carried v) and runs
    integer, and verify agrees with the float model."""
    f = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Mul", ["v_in", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["v_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("v_in", f, ["N", 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", f, ["N", 4])])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Loop", ["trips", "go", "r"], ["y"], body=body, name="repeat")]
    graph = helper.make_graph(nodes, "loop", [helper.make_tensor_value_info("x", f, ["N", 4])],
                              [helper.make_tensor_value_info("y", f, ["N", 4])],
                              [numpy_helper.from_array(np.int64(3), "trips"), numpy_helper.from_array(np.bool_(True), "go"),
                               numpy_helper.from_array(np.float32([0.5, 1, -1, 2]), "w"),
                               numpy_helper.from_array(np.float32([0.1, 0, 0.2, -0.3]), "b")])
    x = np.random.default_rng(2).standard_normal((16, 4)).astype(np.float32)
    path, data, qpath, output = quantized(
        tmp_path, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), x)
    assert "integer: 3 ops (Add 1, Mul 1, Relu 1)" in output
    from qtool.executor import IntegerExecutor

    executor = IntegerExecutor(onnx.load(str(qpath)))
    assert [s.kind for s in executor.steps if s.node.op_type == "Loop"] == ["control"]
    y = executor.run({"x": x}).outputs["y"]
    v = np.maximum(x, 0)
    for _ in range(3):
        v = v * np.float32([0.5, 1, -1, 2]) + np.float32([0.1, 0, 0.2, -0.3])
    # int8 steps of the carried v's range (one scale over the iterations): within a few of them
    np.testing.assert_allclose(y, v, atol=0.03 * np.abs(v).max())
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    ort_y = ort.InferenceSession(str(qpath), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, ort_y, atol=1e-6)  # onnxruntime runs the body's Q/DQ alike
    assert invoke("verify", path, qpath, "--data", data, "-q").exit_code == 0


def test_an_output_whose_size_changes_fails_verification_in_one_line(tmp_path):
    """y = NonZero(Relu(x) > 0.3): values near the threshold cross it once quantized, so the
    executor's y has another length than the float model's; verify says so (exit 1), no crash."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Greater", ["r", "limit"], ["g"], name="above"),
             helper.make_node("NonZero", ["g"], ["y"], name="where")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, ["N", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [2, "K"])],
                              [numpy_helper.from_array(np.float32(0.3), "limit")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = np.linspace(0.25, 0.35, 64, dtype=np.float32)[None].repeat(4, 0) + np.float32(0.0011) * np.arange(4)[:, None]
    path, data, qpath, _ = quantized(tmp_path, model, np.concatenate([x, -x, x * 3]).astype(np.float32))
    result = invoke("verify", path, qpath, "--data", data, "--batch-size", "1", "-q")
    assert result.exit_code == 1, result.output
    assert "output 'y' has another shape than the float model's on" in result.output
    assert "its size depends on values that quantization changed" in result.output


@pytest.mark.parametrize("gamma", [True, False])
def test_layernorm_as_mean_of_squares_minus_square_of_mean(tmp_path, gamma):
    """A LayerNorm exported as E[x^2] - E[x]^2 (JAX/TF): quantized, the two near-equal terms
    would cancel to rounding and the 1 / sqrt(var + eps) that follows span 1 to 1/sqrt(eps). With
    its gamma it is one LayerNormalization at prepare (qtool/fusion.py), integer; without one (a
    form the fusion leaves) its statistics and the normalizing Mul stay float. Either way the
    model keeps its accuracy."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Mul", ["x", "w"], ["h"], name="scale_in"),  # an integer op before
             helper.make_node("ReduceSum", ["h", "axes"], ["s1"], keepdims=1, name="sum"),
             helper.make_node("Mul", ["s1", "inv_n"], ["mean"], name="mean"),
             helper.make_node("Mul", ["h", "h"], ["sq"], name="square"),
             helper.make_node("ReduceSum", ["sq", "axes"], ["s2"], keepdims=1, name="sum_sq"),
             helper.make_node("Mul", ["s2", "inv_n"], ["mean_sq"], name="mean_sq"),
             helper.make_node("Mul", ["mean", "mean"], ["sq_mean"], name="square_mean"),
             helper.make_node("Sub", ["mean_sq", "sq_mean"], ["var"], name="var"),
             helper.make_node("Max", ["var", "zero"], ["var_pos"], name="clamp"),
             helper.make_node("Add", ["var_pos", "eps"], ["var_eps"], name="add_eps"),
             helper.make_node("Sqrt", ["var_eps"], ["std"], name="sqrt"),
             helper.make_node("Reciprocal", ["std"], ["rstd"], name="rstd"),
             helper.make_node("Mul", ["rstd", "gamma"], ["scale"], name="gamma"),
             helper.make_node("Sub", ["h", "mean"], ["centered"], name="center"),
             helper.make_node("Mul", ["centered", "scale"], ["normed"], name="normalize"),
             helper.make_node("Add", ["normed", "beta"], ["y"], name="beta")]
    if not gamma:
        nodes = [n for n in nodes if n.name != "gamma"]
        nodes[-2].input[1] = "rstd"
    rng = np.random.default_rng(4)
    inits = {"w": np.float32(1.5), "axes": np.array([-1], np.int64), "inv_n": np.float32(1 / 16),
             "zero": np.float32(0), "eps": np.float32(1e-6), "gamma": rng.uniform(0.5, 2, 16).astype(np.float32),
             "beta": rng.normal(0, 0.1, 16).astype(np.float32)}
    graph = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", f, ["N", 16])],
                              [helper.make_tensor_value_info("y", f, ["N", 16])],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = (rng.normal(0, 1, (64, 16)) * rng.uniform(0.2, 1, (64, 1)) + rng.normal(3, 0.5, (64, 1))).astype(np.float32)
    path, data, qpath, output = quantized(tmp_path, model, x)
    if gamma:
        assert "integer: 2 ops (LayerNormalization 1, Mul 1)" in output and "float:   0 ops" in output, output
    else:  # mean, mean_sq, square_mean and normalize (the report names the first three)
        assert re.search(r"Mul x4: inside a LayerNormalization \(float by default\) \('mean', 'mean_sq', "
                         r"'square_mean', \.\.\.\)", output), output
        assert "scale_in" not in output.split("float:")[1]
    import json

    result = invoke("verify", path, qpath, "--data", data, "--json", "-q")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["outputs"][0]["sqnr_db"] > 20  # 21.7 dB; 16.0 with these statistics in int8


def test_exec_stacks_sequence_outputs_the_same_for_one_sample_and_many(tmp_path):
    """A batch-1 model whose output leads with its sequence ([T, 1, C]): exec writes [N, T, 1, C],
    N = 1 included."""
    f = TensorProto.FLOAT
    graph = helper.make_graph([helper.make_node("Transpose", ["x"], ["y"], perm=[2, 0, 1], name="t")], "seq",
                              [helper.make_tensor_value_info("x", f, [1, 3, 5])],
                              [helper.make_tensor_value_info("y", f, [5, 1, 3])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    for n in (1, 3):
        x = np.arange(n * 15, dtype=np.float32).reshape(n, 3, 5)
        np.savez(tmp_path / "x.npz", x=x)
        result = invoke("exec", path, "--input", tmp_path / "x.npz", "-o", tmp_path / "y.npz", "-q")
        assert result.exit_code == 0, result.output
        np.testing.assert_array_equal(np.load(tmp_path / "y.npz")["y"], x.transpose(0, 2, 1)[:, :, None, :])
