"""Two graphs from sweep 5's EEG spindle detector: a tensor with no elements (a ConstantOfShape of
a zero size, [N, 0, 1]) crashed calibrate's statistics, and a Concat reading a constant-filled
tensor of -1e9 (found as a mask, so never calibrated) stopped quantize with 'not in the
calibration table'."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from test_cli import assert_no_crash, invoke


def _save(path, nodes, inits, out_dims: list):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", *out_dims])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _run_all(tmp_path, model):
    data = tmp_path / "d.npz"
    np.savez(data, x=np.random.default_rng(0).normal(0, 1, (16, 4)).astype(np.float32))
    table, qmodel = tmp_path / "t.yaml", tmp_path / "q.onnx"
    results = [invoke("calibrate", model, "-d", data, "-o", table, "-q"),
               invoke("quantize", model, "-t", table, "-o", qmodel),
               invoke("exec", qmodel, "--input", data, "-o", tmp_path / "y.npz", "-q")]
    for result in results:
        assert_no_crash(result)
        assert result.exit_code == 0, result.output
    return table.read_text(), results[1].output


def test_a_tensor_without_elements_is_calibrated_as_unbounded_and_stays_float(tmp_path):
    # [N, 0, 1]: the statistics keep the channel axis, of no size: min and max of nothing
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
             (("zero", [0]), ("axis", [1]), ("last", [2]))]
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Unsqueeze", ["r", "last"], ["r3"], name="unsqueeze"),
             helper.make_node("Slice", ["r3", "zero", "zero", "axis"], ["empty"], name="take_none"),
             helper.make_node("Concat", ["r3", "empty"], ["y"], name="join", axis=1)]
    table, report = _run_all(tmp_path, _save(tmp_path / "m.onnx", nodes, inits, [4, 1]))
    assert "unbounded:\n- empty" in table
    assert ("Concat x1: 'empty' held inf or NaN on the calibration data, or no element at all (no range to "
            "quantize it to) ('join')") in report


def test_an_op_reading_a_mask_tensor_stays_float(tmp_path):
    inits = [numpy_helper.from_array(np.array(-1e9, np.float32), "lowest")]
    nodes = [helper.make_node("Shape", ["x"], ["shape"], name="shape"),
             helper.make_node("ConstantOfShape", ["shape"], ["ones"], name="fill",
                              value=numpy_helper.from_array(np.array([1.0], np.float32))),
             helper.make_node("Mul", ["ones", "lowest"], ["mask"], name="mask"),
             helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Concat", ["r", "mask"], ["y"], name="join", axis=1)]
    _, report = _run_all(tmp_path, _save(tmp_path / "m.onnx", nodes, inits, [8]))
    assert "reads 'mask', a mask tensor (a huge negative constant, kept float and never calibrated)" in report
