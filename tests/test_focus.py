"""YOLOX's Focus and its kin as data movement: SpaceToDepth, DepthToSpace (DCR and CRD) and a
Gather of an activation by a constant list of indices (prepared as Slices and a Concat) run
integer; the prepared model computes what the original did; the executor moves the same integers
as onnxruntime running the QDQ model as written."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.analyze import as_written_session
from qtool.calibrate import calibrate
from qtool.executor import IntegerExecutor
from qtool.model import prepare
from qtool.quantize import QuantizeOptions, quantize


def focus(path, mode):
    rng = np.random.default_rng(0)
    order = np.array([0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11], np.int64)  # YOLOX's reorder
    inits = [numpy_helper.from_array(order, "order"),
             numpy_helper.from_array(rng.normal(0, 0.3, (16, 12, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(0, 0.1, 16).astype(np.float32), "b")]
    nodes = [helper.make_node("SpaceToDepth", ["x"], ["s2d"], blocksize=2, name="s2d"),
             helper.make_node("Gather", ["s2d", "order"], ["picked"], axis=1, name="pick"),
             helper.make_node("Conv", ["picked", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("DepthToSpace", ["c"], ["y"], blocksize=2, mode=mode, name="d2s")]
    graph = helper.make_graph(nodes, "focus", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_focus_runs_integer_and_moves_the_same_integers(tmp_path, mode):
    path = focus(tmp_path / "focus.onnx", mode)
    x = np.random.default_rng(1).normal(0, 1, (4, 3, 8, 8)).astype(np.float32)
    prepared = prepare(onnx.load(path), "m")
    ops = [n.op_type for n in prepared.graph.node]
    assert "Gather" not in ops and ops.count("Slice") == 4 and ops.count("Concat") == 1
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(run(prepared), run(onnx.load(path)))  # the same values, moved
    np.savez(tmp_path / "x.npz", x=x)
    table = calibrate(path, tmp_path / "x.npz", progress=False)
    qmodel, report = quantize(path, table, QuantizeOptions())
    assert report.kept_float == [] and {"SpaceToDepth", "DepthToSpace", "Slice", "Concat"} <= set(report.quantized)
    names = ["s2d", "picked", "c"]
    reference = onnx.ModelProto()
    reference.CopyFrom(qmodel)
    quantized = {n.input[0]: n.output[0] for n in qmodel.graph.node if n.op_type == "QuantizeLinear"}
    reference.graph.output.extend(onnx.ValueInfoProto(name=quantized[n]) for n in names)
    theirs = as_written_session(reference).run([quantized[n] for n in names], {"x": x})
    ours = IntegerExecutor(qmodel).run({"x": x}, keep_integer=True).integer
    for name, value in zip(names, theirs):
        diff = np.abs(ours[name].astype(np.int64) - value.astype(np.int64))
        # data movement is exact; the Conv's requantization may round a float tie the other way
        assert diff.max() <= (0 if name != "c" else 1), (name, diff.max())
    y_q, y = IntegerExecutor(qmodel).run({"x": x}).outputs["y"], run(onnx.load(path))
    assert 10 * np.log10(np.sum(y ** 2) / np.sum((y - y_q) ** 2)) > 25  # int8 end to end
