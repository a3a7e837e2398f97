"""With int16 activations, a constant operand of an integer op (an Add's bias or position table,
a Mul's factor) is stored int16 where every op reading it has an int16 output: stored int8, one
scale for the whole tensor, its rounding is one error added to every token (on a ViT-S saliency
model, 11 dB of its int16 model's output). onnxruntime runs the model as written and the executor agrees."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qtool.calibrate import calibrate
from qtool.executor import IntegerExecutor
from qtool.quantize import QuantizeOptions, quantize


def _model(path, second_reader: bool = False):
    """x [N, 16, 32] @ w + bias (one large entry, the rest small) + pos; optionally the bias
    also read by a float-only op's neighbour (an int8 Add)."""
    rng = np.random.default_rng(0)
    bias = rng.normal(0, 0.01, 32).astype(np.float32)
    bias[3] = 4.0  # one entry sets an int8 scale of 4/127: the others round to 0
    pos = rng.normal(0, 0.02, (16, 32)).astype(np.float32)
    pos[0, 0] = 3.0
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "bias"], ["hb"], name="add_bias"),
             helper.make_node("Add", ["hb", "pos"], ["y"], name="add_pos")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16, 32])]
    if second_reader:
        nodes.append(helper.make_node("Add", ["x2", "bias"], ["z"], name="add_other"))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 32]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16, 32])]
    if second_reader:
        inputs.append(helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["N", 32]))
    graph = helper.make_graph(nodes, "g", inputs, outputs, [
        numpy_helper.from_array(rng.normal(0, 0.2, (32, 32)).astype(np.float32), "w"),
        numpy_helper.from_array(bias, "bias"), numpy_helper.from_array(pos, "pos")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    feeds = {"x": rng.normal(0, 1, (8, 16, 32)).astype(np.float32)}
    if second_reader:
        feeds["x2"] = rng.normal(0, 1, (8, 32)).astype(np.float32)
    return feeds


def _stored(qmodel, name):
    inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
    return inits[f"{name}_quantized"], inits[f"{name}_scale"]


def test_an_int16_add_stores_its_constants_int16(tmp_path):
    feeds = _model(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", **feeds)
    table = calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False)
    wide, _ = quantize(tmp_path / "m.onnx", table, QuantizeOptions(activation_type="int16"))
    narrow, _ = quantize(tmp_path / "m.onnx", table)
    for name in ("bias", "pos"):
        values, scale = _stored(wide, name)
        assert values.dtype == np.int16 and scale.shape == ()
        assert _stored(narrow, name)[0].dtype.itemsize == 1  # int8 activations: one byte as before
    # the small bias entries survive: within one int16 step of float (int8: all of them 0)
    values, scale = _stored(wide, "bias")
    bias = numpy_helper.to_array(onnx.load(tmp_path / "m.onnx").graph.initializer[1])
    assert np.abs(values * scale - bias).max() <= 0.5001 * scale
    assert np.count_nonzero(values) >= 30  # int8 keeps the large entry and one other:
    assert np.count_nonzero(_stored(narrow, "bias")[0].astype(np.int64) - 128) <= 2
    # the executor and onnxruntime (the QDQ model as written) agree within one output step
    executor = IntegerExecutor(wide)
    got = executor.run(feeds).outputs["y"]
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    want = ort.InferenceSession(wide.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, feeds)[0]
    step = executor.integer_tensors()["y_float"].qparams.scale
    assert np.abs(got - want).max() <= 1.001 * step


def test_a_constant_an_int8_op_also_reads_stays_one_byte(tmp_path):
    feeds = _model(tmp_path / "m.onnx", second_reader=True)
    np.savez(tmp_path / "d.npz", **feeds)
    table = calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False)
    qmodel, _ = quantize(tmp_path / "m.onnx", table, QuantizeOptions(int16=("add_bias",)))
    assert IntegerExecutor(qmodel).integer_tensors()["hb"].qparams.dtype == "int16"
    assert _stored(qmodel, "bias")[0].dtype.itemsize == 1  # 'add_other' reads it at int8
