"""QOperator models in the integer executor beyond qtool's own: hand-built contrib nodes and
onnxruntime's ``quantize_static`` output against onnxruntime, overflow, ``verify`` and ``exec``.

Expected values are onnxruntime's outputs on the same model, or hand-computed.
"""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.errors import QtoolError
from qtool.executor import IntegerExecutor
from qtool.qoperator_exec import float_name
from qtool.quantize import QuantizeOptions, quantize
from qtool.verify import verify
from test_cli import assert_no_crash, invoke
from test_differential_qoperator import step_differences

RNG = np.random.default_rng(99)
MS = "com.microsoft"


def _one_node(node, inputs: dict[str, tuple[int, tuple]], inits: dict[str, np.ndarray], out_type):
    graph = helper.make_graph(
        [node], "one", [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(node.output[0], out_type, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(MS, 1)],
                              ir_version=8)
    return model


def _u8(*shape):
    return RNG.integers(0, 256, shape).astype(np.uint8)


def _i8(*shape):
    return RNG.integers(-128, 128, shape).astype(np.int8)


def _qp(prefix, scale, zero, dtype=np.uint8):
    return {f"{prefix}_s": np.array(scale, np.float32), f"{prefix}_z": np.array(zero, dtype)}


U8, I8 = TensorProto.UINT8, TensorProto.INT8
HAND = {
    "qlinearconcat": (
        helper.make_node("QLinearConcat", ["y_s", "y_z", "a", "a_s", "a_z", "b", "b_s", "b_z"], ["y"],
                         domain=MS, axis=1),
        {"a": (U8, (4, 3, 16)), "b": (U8, (4, 5, 16))},
        {**_qp("y", 0.083, 128), **_qp("a", 0.031, 100), **_qp("b", 0.067, 140)}, U8),
    "qlinearsigmoid": (
        helper.make_node("QLinearSigmoid", ["x", "x_s", "x_z", "y_s", "y_z"], ["y"], domain=MS),
        {"x": (I8, (4, 64))}, {**_qp("x", 0.05, -3, np.int8), **_qp("y", 1 / 256, -128, np.int8)}, I8),
    "qlinearleakyrelu": (
        helper.make_node("QLinearLeakyRelu", ["x", "x_s", "x_z", "y_s", "y_z"], ["y"], domain=MS, alpha=0.2),
        {"x": (U8, (4, 64))}, {**_qp("x", 0.04, 128), **_qp("y", 0.03, 40)}, U8),
    "qlinearmul_uint8": (
        helper.make_node("QLinearMul", ["a", "a_s", "a_z", "b", "b_s", "b_z", "y_s", "y_z"], ["y"], domain=MS),
        {"a": (U8, (4, 8, 3, 3)), "b": (U8, (4, 8, 1, 1))},
        {**_qp("a", 0.02, 130), **_qp("b", 0.03, 110), **_qp("y", 0.06, 128)}, U8),
    "qlinearaveragepool_pad": (
        helper.make_node("QLinearAveragePool", ["x", "x_s", "x_z", "y_s", "y_z"], ["y"], domain=MS,
                         kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1),
        {"x": (U8, (2, 3, 7, 7))}, {**_qp("x", 0.02, 100), **_qp("y", 0.015, 90)}, U8),
    "qlinearconv_uint8_weight_zero_points": (
        helper.make_node("QLinearConv", ["x", "x_s", "x_z", "w", "w_s", "w_z", "y_s", "y_z", "b"], ["y"],
                         pads=[1, 0, 0, 1], strides=[1, 2]),
        {"x": (U8, (2, 3, 6, 7))},
        {**_qp("x", 0.02, 120), "w": _u8(4, 3, 3, 3), "w_s": np.array([0.01, 0.02, 0.005, 0.03], np.float32),
         "w_z": np.array([128, 120, 135, 128], np.uint8), **_qp("y", 0.5, 128),
         "b": RNG.integers(-2000, 2000, 4).astype(np.int32)}, U8),
    "qlinearmatmul_constant_b_per_column": (
        helper.make_node("QLinearMatMul", ["a", "a_s", "a_z", "b", "b_s", "b_z", "y_s", "y_z"], ["y"]),
        {"a": (I8, (3, 5, 16))},
        {**_qp("a", 0.02, 3, np.int8), "b": _i8(16, 6), "b_s": np.linspace(0.01, 0.03, 6).astype(np.float32),
         "b_z": np.zeros(6, np.int8), **_qp("y", 0.4, -5, np.int8)}, I8),
    "convinteger": (
        helper.make_node("ConvInteger", ["x", "w", "x_z", "w_z"], ["y"], pads=[1, 1, 1, 1], group=2),
        {"x": (U8, (2, 4, 5, 5))},
        {"w": _u8(6, 2, 3, 3), "x_z": np.array(128, np.uint8), "w_z": np.array(7, np.uint8)}, TensorProto.INT32),
    "matmulinteger": (
        helper.make_node("MatMulInteger", ["a", "b", "a_z", "b_z"], ["y"]),
        {"a": (U8, (2, 3, 40)), "b": (U8, (40, 7))},
        {"a_z": np.array(12, np.uint8), "b_z": np.array(200, np.uint8)}, TensorProto.INT32),
}


@pytest.mark.parametrize("case", sorted(HAND))
def test_hand_built_node_matches_onnxruntime(case):
    node, inputs, inits, out_type = HAND[case]
    model = _one_node(node, inputs, inits, out_type)
    rng = np.random.default_rng(zlib.crc32(case.encode()))  # the same data whichever tests run
    feeds = {n: rng.integers(*((0, 256) if t == U8 else (-128, 128)), s).astype(np.uint8 if t == U8 else np.int8)
             for n, (t, s) in inputs.items()}
    executor = IntegerExecutor(model)
    assert [s.kind for s in executor.steps] == ["integer"], executor.float_nodes()
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = executor.run(feeds).outputs["y"]
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = np.abs(got.astype(np.int64) - want.astype(np.int64))
    bound = 0 if node.op_type in ("ConvInteger", "MatMulInteger") else 1  # int32 sums are exact
    print(f"\n{case}: worst {diff.max()}, {np.mean(diff == 0):.2%} exact of {diff.size}")
    assert diff.max() <= bound, f"{case}: {diff.max()}"
    assert np.mean(diff == 0) >= 0.95, f"{case}: {np.mean(diff == 0):.1%} exact"


def test_accumulator_overflow_names_the_node():
    k = 40000  # 255 * 255 * 40000 > 2**31
    node = helper.make_node("MatMulInteger", ["a", "b"], ["y"], name="big_mm")
    model = _one_node(node, {"a": (U8, (1, k))}, {"b": np.full((k, 1), 255, np.uint8)}, TensorProto.INT32)
    executor = IntegerExecutor(model)
    assert executor.run({"a": np.ones((1, k), np.uint8)}).outputs["y"].tolist() == [[255 * k]]
    with pytest.raises(QtoolError, match="overflow in MatMulInteger node 'big_mm'"):
        executor.run({"a": np.full((1, k), 255, np.uint8)})


def test_float_name_maps_quantize_outputs_back():
    assert float_name("conv1_out_quantized") == "conv1_out"
    assert float_name("x_quantized_quantized") == "x_quantized"
    assert float_name("y") == "y" and float_name("_quantized") == "_quantized"


@pytest.mark.parametrize("weight_type", ["QInt8", "QUInt8"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_onnxruntime_quantize_static_qoperator_runs_integer(tmp_path, demo_model, demo_calib, demo_heldout,
                                                             weight_type, per_channel):
    """onnxruntime's own QOperator output (uint8 activations, int8 or uint8 weights with zero
    points, per channel or not) runs every node as an integer step, within 1 LSB of onnxruntime."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from qtool.model import load_model, prepare

    x = np.load(demo_calib)["input"][:128]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"input": x[i:i + 32]} for i in range(0, len(x), 32)])

        def get_next(self):
            return next(self.batches, None)

    onnx.save(prepare(load_model(demo_model)), tmp_path / "prepared.onnx")
    quantize_static(str(tmp_path / "prepared.onnx"), str(tmp_path / "q.onnx"), Reader(),
                    quant_format=QuantFormat.QOperator, per_channel=per_channel,
                    weight_type=getattr(QuantType, weight_type), activation_type=QuantType.QUInt8)
    qmodel = onnx.load(str(tmp_path / "q.onnx"))
    assert {"QLinearConv", "QLinearAdd", "QGemm"} <= {n.op_type for n in qmodel.graph.node}
    executor, diffs = step_differences(qmodel, {"input": np.load(demo_heldout)["input"][:64]})
    assert len(diffs) == 9
    flat = np.concatenate([d.ravel() for _, d in diffs.values()])
    assert flat.max() <= 1 and np.mean(flat == 0) >= 0.99


def test_verify_reads_a_qoperator_model_like_its_qdq_twin(tmp_path, demo_model, demo_table, demo_heldout):
    reports = {}
    for fmt in ("qdq", "qoperator"):
        qmodel, _ = quantize(demo_model, demo_table, QuantizeOptions(format=fmt))
        onnx.save(qmodel, tmp_path / f"{fmt}.onnx")
        reports[fmt] = verify(demo_model, tmp_path / f"{fmt}.onnx", demo_heldout, num_samples=128,
                              progress=False)
    qdq, qop = reports["qdq"], reports["qoperator"]
    assert qop.passed and not qop.float_nodes
    by_name = {c.name: c for c in qop.tensors}
    # every tensor the QDQ report compares is in the QOperator report, integer, with the same
    # (S, Z), the same Relu handling and the same numbers (both runs agree with onnxruntime)
    for c in qdq.tensors:
        other = by_name[c.name]
        assert other.ran == c.ran and other.clamped == c.clamped
        assert float(other.qparams.scale) == float(c.qparams.scale)
        assert int(other.qparams.zero_point) == int(c.qparams.zero_point)
        assert other.cosine == pytest.approx(c.cosine, abs=1e-4)
    assert by_name["logits"].op_type == "QGemm"  # the graph output maps back as well
    assert qop.outputs[0].cosine == pytest.approx(qdq.outputs[0].cosine, abs=1e-4)


def test_exec_cli_runs_a_qoperator_model(tmp_path, demo_model, demo_table, demo_heldout):
    qmodel, _ = quantize(demo_model, demo_table, QuantizeOptions(format="qoperator"))
    onnx.save(qmodel, tmp_path / "q.onnx")
    x = np.load(demo_heldout)["input"][:32]
    np.savez(tmp_path / "x.npz", input=x)
    result = invoke("exec", tmp_path / "q.onnx", "--input", tmp_path / "x.npz", "-o", tmp_path / "y.npz")
    assert_no_crash(result)
    assert result.exit_code == 0, result.output
    assert "0 in float" in result.output
    session = ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, {"input": x})[0]
    got = np.load(tmp_path / "y.npz")["logits"]
    assert np.mean(got.argmax(1) == want.argmax(1)) >= 0.97
