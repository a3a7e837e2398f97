"""MaxPool with ceil_mode=1: the integer kernel equals onnxruntime's MaxPool on the same int8 and
uint8 values (onnxruntime pools 8-bit tensors directly), shapes where the ceiling adds a window,
and a quantized model keeps it integer."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from qtool.calibrate import calibrate
from qtool.executor import IntegerExecutor
from qtool.ops import REGISTRY, NodeView, Operand, Unsupported
from qtool.qparams import QParams
from qtool.quantize import quantize

CASES = [  # (input H, W), kernel, strides, pads, dilations, whether the ceiling adds a window
    ((5, 5), (2, 2), (2, 2), (0, 0, 0, 0), (1, 1), True),
    ((7, 6), (3, 3), (2, 2), (0, 0, 0, 0), (1, 1), True),
    ((6, 9), (3, 2), (2, 3), (1, 0, 1, 0), (1, 1), True),
    ((9, 8), (3, 3), (3, 2), (1, 1, 1, 1), (1, 1), True),
    ((9, 10), (2, 3), (2, 2), (0, 1, 0, 1), (2, 2), True),
    ((4, 4), (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), True),
    ((32, 32), (3, 3), (2, 2), (0, 0, 0, 0), (1, 1), True),  # a ResNet-style stem
    # the ceiling's extra window would start in the end padding: dropped, as floor
    ((8, 7), (3, 3), (3, 2), (1, 1, 1, 1), (1, 1), False),
    ((4, 6), (1, 2), (2, 2), (0, 0, 0, 1), (1, 1), False),
]


def _node(kernel, strides, pads, dilations, ceil_mode=1):
    return helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=list(kernel), strides=list(strides),
                            pads=list(pads), dilations=list(dilations), ceil_mode=ceil_mode)


def _onnxruntime(node, x):
    elem = TensorProto.INT8 if x.dtype == np.int8 else TensorProto.UINT8
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", elem, None)],
                              [helper.make_tensor_value_info("y", elem, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
@pytest.mark.parametrize("size, kernel, strides, pads, dilations, adds", CASES)
def test_ceil_mode_equals_onnxruntime(dtype, size, kernel, strides, pads, dilations, adds):
    node = _node(kernel, strides, pads, dilations)
    info = np.iinfo(dtype)
    rng = np.random.default_rng(sum(size))
    x = rng.integers(info.min, info.max + 1, (2, 3, *size)).astype(dtype)
    x[0, 0] = info.min  # a channel of minima: padding must not be told from data by its value
    qp = QParams(0.1, 3 if dtype == "uint8" else -2, dtype)
    op = REGISTRY["MaxPool"]
    got = op.run(op.derive(NodeView(node, [Operand(qp)], qp)), x)
    want = _onnxruntime(node, x)
    floor = _onnxruntime(_node(kernel, strides, pads, dilations, ceil_mode=0), x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert (got.shape != floor.shape) == adds
    np.testing.assert_array_equal(got, want)


def test_ceil_mode_by_hand():
    # 5 wide, kernel 2, stride 2: windows [0,1], [2,3] and, ceiled, [4] alone
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[1, 2], strides=[1, 2], ceil_mode=1)
    qp = QParams(1.0, 0, "int8")
    op = REGISTRY["MaxPool"]
    x = np.array([[[[-7, -3, 5, 1, -100]]]], np.int8)
    assert op.run(op.derive(NodeView(node, [Operand(qp)], qp)), x).tolist() == [[[[-3, 5, -100]]]]


def test_average_pool_ceil_mode_stays_float():
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)
    qp = QParams(1.0, 0, "int8")
    with pytest.raises(Unsupported, match="ceil_mode"):
        REGISTRY["AveragePool"].derive(NodeView(node, [Operand(qp)], qp))


def test_quantized_ceil_mode_maxpool_runs_integer(tmp_path):
    node = helper.make_node("MaxPool", ["a"], ["y"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["a"]), node], "pool",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 4, 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              tmp_path / "m.onnx")
    x = np.random.default_rng(0).normal(0, 1, (4, 2, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    qmodel, report = quantize(tmp_path / "m.onnx", calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False))
    assert report.kept_float == [] and report.quantized["MaxPool"] == 1
    got = IntegerExecutor(qmodel).run({"x": x}).outputs["y"]
    want = ort.InferenceSession(qmodel.SerializeToString()).run(None, {"x": x})[0]
    assert got.shape == (4, 2, 4, 4)
    np.testing.assert_array_equal(got, want)


def test_same_upper_2x2_stride_2_on_open_sizes_runs_integer(tmp_path):
    """MTCNN's P-Net pools 2x2 at stride 2 with SAME_UPPER on images of any size: preparation
    writes it as ceil_mode (the same outputs in onnxruntime for odd and even sizes), and the
    quantized model runs it integer (it ran float: "auto_pad SAME_* is not supported")."""
    from qtool.model import prepare

    graph = helper.make_graph(
        [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2], auto_pad="SAME_UPPER",
                          name="pool")], "pnet",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, None, None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.save(model, tmp_path / "m.onnx")
    prepared = prepare(onnx.load(tmp_path / "m.onnx"), "m.onnx")
    attrs = {a.name: helper.get_attribute_value(a) for a in prepared.graph.node[0].attribute}
    assert attrs.get("ceil_mode") == 1 and "auto_pad" not in attrs
    rng = np.random.default_rng(4)
    for size in ((7, 6), (8, 9), (5, 5), (6, 6)):
        x = rng.normal(size=(2, 3, *size)).astype(np.float32)
        want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
        got = ort.InferenceSession(prepared.SerializeToString()).run(None, {"x": x})[0]
        assert want.shape == (2, 3, -(-size[0] // 2), -(-size[1] // 2))
        np.testing.assert_array_equal(got, want)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(8, 3, 7, 6)).astype(np.float32))
    qmodel, report = quantize(tmp_path / "m.onnx", calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False))
    assert report.kept_float == [] and report.quantized == {"MaxPool": 1}
    x = rng.normal(size=(2, 3, 9, 5)).astype(np.float32)
    got = IntegerExecutor(qmodel).run({"x": x}).outputs["y"]
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    want = ort.InferenceSession(qmodel.SerializeToString(), options).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
