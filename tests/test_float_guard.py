"""Float-kept ops stay float in onnxruntime (issue 13, item 5).

onnxruntime's WeightBiasQuantization pass (it runs even at ORT_ENABLE_BASIC) quantizes the float
weights of a Conv/ConvTranspose/Gemm whose input comes straight from a DequantizeLinear, so the
model onnxruntime runs is not the one written. quantize routes such inputs through an identity
(targets.form.guard_float_ops); these tests check onnxruntime's optimized graph and outputs, with a
control that removes the guard and sees the pass fire.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.executor import IntegerExecutor
from qtool.targets.form import is_guard
from test_cli import assert_no_crash, assert_user_error, invoke

# MatMul + Add reach quantize as one Gemm (onnxruntime's basic fusion, in graph preparation)
KEPT = ("conv_float", "convt_float", "matmul_float/MatMulAddFusion")


def _model(dynamic_spatial: bool) -> onnx.ModelProto:
    """conv (integer) -> conv, convT (float-kept) -> conv (integer) -> MatMul + Add (float-kept,
    which onnxruntime fuses into a Gemm) -> Relu -> Gemm (integer)."""
    rng = np.random.default_rng(3)

    def w(name, *shape, s=0.3):
        return numpy_helper.from_array((rng.normal(size=shape) * s).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv_float", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("ConvTranspose", ["r2", "wt"], ["t"], name="convt_float", strides=[2, 2]),
        helper.make_node("Relu", ["t"], ["rt"], name="relut"),
        helper.make_node("Conv", ["rt", "w3"], ["c3"], name="conv3", strides=[2, 2]),
        helper.make_node("Relu", ["c3"], ["r3"], name="relu3"),
        helper.make_node("GlobalAveragePool", ["r3"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "wm"], ["m"], name="matmul_float"),
        helper.make_node("Add", ["m", "bm"], ["a"], name="add_float"),
        helper.make_node("Relu", ["a"], ["ra"], name="relua"),
        helper.make_node("Gemm", ["ra", "wg", "bg"], ["y"], name="gemm", transB=1),
    ]
    inits = [w("w1", 6, 3, 3, 3), w("b1", 6), w("w2", 6, 6, 3, 3, s=0.2), w("b2", 6),
             w("wt", 6, 4, 2, 2), w("w3", 8, 4, 1, 1), w("wm", 8, 12), w("bm", 12),
             w("wg", 5, 12), w("bg", 5)]
    spatial = ["H", "W"] if dynamic_spatial else [8, 8]
    graph = helper.make_graph(nodes, "guard", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             ["N", 3, *spatial])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["static", "dynamic-hw"])
def quantized(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("guard")
    model = _model(dynamic_spatial=request.param)
    onnx.save(model, folder / "m.onnx")
    x = np.random.default_rng(4).normal(size=(24, 3, 8, 8)).astype(np.float32)
    np.savez(folder / "x.npz", x=x)
    assert invoke("calibrate", folder / "m.onnx", "--data", folder / "x.npz", "-o", folder / "t.yaml",
                  "-q").exit_code == 0
    keep = [a for name in KEPT for a in ("--keep-float", name)]
    reports = {}
    for fmt in ("qdq", "qoperator"):
        result = invoke("quantize", folder / "m.onnx", "-t", folder / "t.yaml", "-o", folder / f"{fmt}.onnx",
                        "--format", fmt, "--json", *keep)
        assert result.exit_code == 0, result.output
        reports[fmt] = json.loads(result.stdout)
    return folder, x, reports, request.param


def _session(model: onnx.ModelProto, level, tmp_path, disabled=(), **config):
    """(the graph onnxruntime built, the session)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    for key, value in config.items():
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"],
                                   disabled_optimizers=list(disabled))
    return onnx.load(options.optimized_model_filepath), session


def _weights_quantized_by_ort(model: onnx.ModelProto, optimized: onnx.ModelProto) -> list[str]:
    """The float-kept nodes whose weight, in ``optimized``, is not a float initializer any more
    (read from a DequantizeLinear, or the node fused into an integer one)."""
    floats = {t.name for t in optimized.graph.initializer if t.data_type == TensorProto.FLOAT}
    by_name = {n.name: n for n in optimized.graph.node}
    return sorted(name for name in KEPT if name not in by_name or by_name[name].input[1] not in floats)


def _unguarded(model: onnx.ModelProto) -> onnx.ModelProto:
    """The control: the same model with every guard removed (its readers read the DequantizeLinear)."""
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    graph = bare.graph
    producer = {o: n for n in graph.node for o in n.output}

    def source(name):
        node = producer.get(name)
        return source(node.input[0]) if node is not None and is_guard(node) else name

    nodes = [n for n in graph.node if not is_guard(n)]
    for node in nodes:
        node.input[0] = source(node.input[0])
    del graph.node[:]
    graph.node.extend(nodes)
    return bare


@pytest.mark.parametrize("fmt", ["qdq", "qoperator"])
def test_float_kept_weights_stay_float_in_onnxruntime(quantized, fmt, tmp_path):
    folder, x, reports, dynamic = quantized
    assert sorted(reports[fmt]["float_weights_guarded"]) == sorted(KEPT)
    model = onnx.load(folder / f"{fmt}.onnx")
    guards = [n.op_type for n in model.graph.node if is_guard(n)]
    # dynamic H and W leave two unknown sizes for the conv inputs: a copy guards them
    assert guards.count("Max") == (2 if dynamic else 0)
    assert guards.count("Flatten") == guards.count("Reshape") == (1 if dynamic else 3)
    onnx.checker.check_model(model, full_check=True)
    basic, all_ = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    bare = _unguarded(model)  # the control: without the guards onnxruntime quantizes those weights
    optimized, _ = _session(model, basic, tmp_path)
    assert _weights_quantized_by_ort(model, optimized) == []
    optimized, _ = _session(bare, basic, tmp_path)
    assert _weights_quantized_by_ort(model, optimized) == sorted(KEPT)
    feeds = {"x": x[:8]}
    for level in (basic, all_):  # at ALL the graph is renamed and re-laid out: compare outputs
        for subject, changed in ((model, False), (bare, True)):
            _, session = _session(subject, level, tmp_path)
            _, reference = _session(subject, level, tmp_path, disabled=["WeightBiasQuantization"])
            same = np.array_equal(session.run(None, feeds)[0], reference.run(None, feeds)[0])
            assert same != changed, (level, "control" if changed else "guarded")
    # as written: the same outputs as with every QDQ pass of onnxruntime switched off
    _, session = _session(model, basic, tmp_path)
    _, off = _session(model, basic, tmp_path, **{"session.disable_quant_qdq": "1"})
    np.testing.assert_array_equal(session.run(None, feeds)[0], off.run(None, feeds)[0])


def test_guards_are_not_reported_as_float_nodes(quantized):
    folder, x, reports, _ = quantized
    executor = IntegerExecutor(onnx.load(folder / "qdq.onnx"))
    floats = {name: reason for _, name, reason in executor.float_nodes()}
    assert set(floats) == set(KEPT)
    assert floats["conv_float"] == "weight 'w2' is float"
    kept = {k["node"] for k in reports["qdq"]["kept_float"]}
    assert kept == set(KEPT)
    # the QOperator conversion does not count float-kept ops as integer groups left in QDQ form
    assert reports["qoperator"]["qdq_groups"] == []
    # the guards change nothing the executor computes: the control runs to the same outputs
    control = IntegerExecutor(_unguarded(onnx.load(folder / "qdq.onnx")))
    np.testing.assert_array_equal(executor.run({"x": x}).outputs["y"], control.run({"x": x}).outputs["y"])


def test_verify_ort_names_the_passes_and_the_quantized_float_weights(quantized, tmp_path):
    folder, _, _, _ = quantized
    args = ("verify", folder / "m.onnx", None, "--data", folder / "x.npz", "--ort", "-q")
    guarded = invoke(*[folder / "qdq.onnx" if a is None else a for a in args])
    assert_no_crash(guarded)
    assert "onnxruntime's graph passes that changed the model: " in guarded.stdout
    assert "WeightBiasQuantization" not in guarded.stdout
    assert "quantized the float weights" not in guarded.stdout
    onnx.save(_unguarded(onnx.load(folder / "qdq.onnx")), tmp_path / "bare.onnx")
    bare = invoke(*[tmp_path / "bare.onnx" if a is None else a for a in args])
    assert_no_crash(bare)
    passes = next(line for line in bare.stdout.splitlines() if "graph passes that changed" in line)
    assert "WeightBiasQuantization" in passes
    assert "onnxruntime quantized the float weights of 3 float-kept node(s)" in bare.stdout
    # the user's session options: with onnxruntime's QDQ passes off, nothing is quantized
    off = invoke(*[tmp_path / "bare.onnx" if a is None else a for a in args],
                 "--ort-config", "session.disable_quant_qdq=1")
    assert_no_crash(off)
    assert "WeightBiasQuantization" not in off.stdout and "quantized the float weights" not in off.stdout


@pytest.mark.parametrize("extra, message", [
    (("--ort-config", "session.disable_quant_qdq=1"), "--ort-config is for --ort"),
    (("--ort", "--ort-config", "session.disable_quant_qdq"), "--ort-config 'session.disable_quant_qdq': "
                                                             "expected KEY=VALUE"),
])
def test_ort_config_errors(quantized, extra, message):
    folder, _, _, _ = quantized
    assert_user_error(invoke("verify", folder / "m.onnx", folder / "qdq.onnx", "--data", folder / "x.npz",
                             *extra), message)
