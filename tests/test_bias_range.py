"""A channel whose weights are all but zero gets a tiny weight scale, and its bias, stored at
S_x * S_w, would leave int32 (PP-OCRv6 det: max |w| = 1e-6 on some channels). quantize raises
that channel's weight scale until the bias fits, so the bias keeps its value and the integer
executor does not overflow."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qtool.calibrate import calibrate
from qtool.executor import IntegerExecutor
from qtool.quantize import quantize


def _model(path, small=1e-7):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.5, (3, 2, 3, 3)).astype(np.float32)
    w[1] = small * np.sign(w[1])  # a dead channel (1e-7 of the others)
    b = np.array([0.1, 5.0, -0.2], np.float32)  # whose bias carries its whole output
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 6, 6])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), path)


def test_a_dead_channel_keeps_its_bias(tmp_path):
    _model(tmp_path / "m.onnx")
    x = np.random.default_rng(1).uniform(0, 0.01, (4, 2, 6, 6)).astype(np.float32)  # S_x ~ 4e-5
    np.savez(tmp_path / "d.npz", x=x)
    qmodel, report = quantize(tmp_path / "m.onnx", calibrate(tmp_path / "m.onnx", tmp_path / "d.npz",
                                                              progress=False))
    assert any("the weight scale of 1 channel(s) in 1 layer(s) raised so that their int32 bias cannot "
               "overflow: 'conv' (1) (all of them with weights under 1e-06 of their layer's largest: outputs "
               "that are their bias)" in w for w in report.warnings)
    inits = {i.name: numpy_helper.to_array(i).astype(np.int64) for i in qmodel.graph.initializer}
    bias_q = inits["b_quantized"]
    w_q = inits["w_quantized"] - inits["w_zero_point"].reshape(-1, 1, 1, 1)
    reach = np.abs(w_q).reshape(3, -1).sum(axis=1) * 255  # uint8 input, every |q_x - Z_x| <= 255
    assert (np.abs(bias_q) + reach).max() <= 2**31 - 1  # no input can overflow the accumulator
    ref = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = IntegerExecutor(qmodel).run({"x": x}).outputs["y"]
    step = (ref.max() - min(ref.min(), 0)) / 255
    assert np.abs(got - ref).max() <= 1.01 * step  # the dead channel reads 5.0, as in float
    assert np.abs(got[:, 1] - 5.0).max() <= 1.01 * step


def test_a_small_channel_that_is_not_dead_is_not_called_dead(tmp_path):
    _model(tmp_path / "m.onnx", small=1e-5)  # 1e-5 of the layer's largest weight
    x = np.random.default_rng(1).uniform(0, 0.01, (4, 2, 6, 6)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    _, report = quantize(tmp_path / "m.onnx", calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False))
    raised = [w for w in report.warnings if "raised so that their int32 bias cannot overflow" in w]
    assert raised and raised[0].endswith("'conv' (1)")  # no note that it is all but zero
