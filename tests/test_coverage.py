"""Models qtool is given that are not plain float CNNs (issue 15): already-quantized models,
subgraphs (If) and inputs that are not per sample. Each user-facing refusal is checked as the user
sees it: exit code 2, one line naming the node or input, nothing written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from test_cli import invoke, user_error_leaves_nothing


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


def test_if_model_calibrates_quantizes_and_verifies(tmp_path):
    path, data = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(branching_model(), str(path))
    x = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)
    np.savez(data, x=x)
    table, qpath = tmp_path / "t.yaml", tmp_path / "q.onnx"
    assert invoke("calibrate", path, "--data", data, "-o", table, "-q").exit_code == 0
    result = invoke("quantize", path, "-t", table, "-o", qpath)
    assert result.exit_code == 0, result.output
    assert "control flow: runs in float with the 2 nodes of its 2 subgraphs ('branch')" in result.output
    onnx.checker.check_model(onnx.load(str(qpath)), full_check=True)
    result = invoke("verify", path, qpath, "--data", data, "--json", "-q", "--batch-size", "6")
    assert result.exit_code == 0, result.output
    import json

    report = json.loads(result.stdout)
    assert [f["node"] for f in report["float_nodes"] if f["op_type"] == "If"] == ["branch"]
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
