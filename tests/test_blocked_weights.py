"""Blockwise-quantized MatMul/Gemm weights (issue 31): int4 and int8 weights with one scale per
block of K rows and column, written by ``quantize --weight-type int4 --block-size N`` as standard
QDQ (DequantizeLinear with ``block_size``, opset 21), run integer by the executor
(qtool/ops/blocked.py) and by onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.boundary import Boundary, dynamic_quantize
from qtool.executor import IntegerExecutor
from qtool.fixedpoint import quantize_multipliers
from qtool.ops import blocked
from qtool.ops.gemm import MatMulParams, run_scanned
from qtool.qparams import QParams
from test_cli import assert_user_error, invoke

K, N = 96, 40


def _mlp(path, seed=0):
    """x [n, K] -> MatMul -> Add -> Relu -> Gemm(transB=1) -> y [n, 24], opset 17; its data."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(K, N)).astype(np.float32)
    w[:, 3] *= 20  # a column of much larger weights: its own scales
    w2 = rng.normal(size=(24, N)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="add"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="gemm", transB=1)]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 24])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(rng.normal(size=N).astype(np.float32), "b"),
         numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(rng.normal(size=24).astype(np.float32), "b2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path / "f.onnx"))
    np.savez(path / "fit.npz", x=rng.normal(size=(64, K)).astype(np.float32))
    np.savez(path / "held.npz", x=rng.normal(size=(64, K)).astype(np.float32))
    return path / "f.onnx"


def _ort(path, x) -> np.ndarray:
    """onnxruntime running the QDQ model as written (no fused int8 kernels)."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _lsb_diff(a, b, step) -> np.ndarray:
    return np.rint(np.abs(a.astype(np.float64) - b.astype(np.float64)) / step)


def test_one_block_equals_the_per_channel_kernel():
    """A block as long as K is per-channel quantization: the blocked kernel then computes what the
    plain MatMul kernel computes (its own multipliers and sums, written apart)."""
    rng = np.random.default_rng(1)
    w = rng.integers(-7, 8, size=(K, N)).astype(np.int8)
    scales = rng.uniform(0.01, 0.2, size=(1, N)).astype(np.float32)
    x_qp, y_qp = QParams(0.05, 3, "int8"), QParams(0.9, -5, "int8")
    p = blocked.derive(x_qp, w, scales, K, y_qp, "half_up")
    # the plain kernel: x @ w plus its bias, which holds -Z_x * sum(w) per column
    plain = MatMulParams(w, -3 * w.astype(np.int64).sum(axis=0),
                         quantize_multipliers(0.05 * scales[0].astype(np.float64) / 0.9), -5, "half_up", "int8")
    x = rng.integers(-128, 128, size=(200, K)).astype(np.int8)
    want = run_scanned(plain, x)
    got = blocked.run(p, x)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype,block,k", [("int8", 32, 96), ("uint8", 16, 100), ("int16", 32, 2048)])
def test_blocks_against_the_real_sum(dtype, block, k):
    """Many blocks, a short last block, an int16 input over a long K (its shifts narrowed so the sum
    stays in int64): within one step of the exact real result, equal to it nearly everywhere."""
    rng = np.random.default_rng(2)
    lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
    w = rng.integers(-8, 8, size=(k, N)).astype(np.int8)
    blocks = -(-k // block)
    scales = rng.uniform(0.001, 0.3, size=(blocks, N)).astype(np.float32)
    x_qp = QParams(0.02, 0 if dtype == "int16" else int(rng.integers(lo, hi)), dtype)
    x = rng.integers(lo, int(hi) + 1, size=(64, k)).astype(dtype)
    shifted = x.astype(np.float64) - x_qp.zero_point
    expanded = np.repeat(scales.astype(np.float64), block, axis=0)[:k]
    real = shifted @ (w.astype(np.float64) * expanded) * x_qp.scale  # float64: exact enough here
    y_qp = QParams(float(np.float32(np.abs(real).max() / 120)), 0, "int8")
    got = blocked.run(blocked.derive(x_qp, w, scales, block, y_qp, "half_up"), x).astype(np.int64)
    want = np.clip(np.floor(real / y_qp.scale + 0.5), -128, 127)
    diff = np.abs(got - want)
    assert diff.max() <= 1
    assert (diff == 0).mean() > 0.98
    assert np.ptp(got) > 50  # the outputs use the range: the comparison is not of saturated values


def test_quantize_writes_int4_blocks_that_onnxruntime_runs(tmp_path):
    model = _mlp(tmp_path)
    table, q = tmp_path / "t.yaml", tmp_path / "q.onnx"
    assert invoke("calibrate", model, "--data", tmp_path / "fit.npz", "-o", table, "-q").exit_code == 0
    result = invoke("quantize", model, "-t", table, "-o", q, "--weight-type", "int4", "--block-size", "32")
    assert result.exit_code == 0, result.output
    assert "weights: 2 MatMul/Gemm weights int4, one scale per 32 rows along K and column" in result.stdout
    qmodel = onnx.load(str(q))
    assert next(o.version for o in qmodel.opset_import if o.domain in ("", "ai.onnx")) == 21
    dq = [n for n in qmodel.graph.node if n.op_type == "DequantizeLinear"
          and any(a.name == "block_size" and a.i == 32 for a in n.attribute)]
    inits = {i.name: i for i in qmodel.graph.initializer}
    assert len(dq) == 2 and all(inits[n.input[0]].data_type == TensorProto.INT4 for n in dq)
    values = numpy_helper.to_array(inits[dq[0].input[0]]).astype(np.int8)
    assert values.min() >= -7 and values.max() <= 7 and len(np.unique(values)) == 15
    executor = IntegerExecutor(qmodel)
    assert [type(s.op).__name__ for s in executor.steps if s.kind == "integer"] == \
        ["BlockedMatMul", "Relu", "BlockedMatMul"]
    x = np.load(tmp_path / "held.npz")["x"]
    got = executor.run({"x": x}).outputs["y"]
    step = float(numpy_helper.to_array(inits[next(n for n in qmodel.graph.node if n.output[0] == "y").input[1]]))
    diff = _lsb_diff(got, _ort(q, x), step)
    assert diff.max() <= 1 and (diff == 0).mean() >= 0.99
    # and it verifies against the float model as any quantized model does
    result = invoke("verify", model, q, "--data", tmp_path / "held.npz", "--tolerance", "0.99,15", "-q")
    assert result.exit_code == 0, result.output


def test_foreign_uint4_blocks_with_zero_points(tmp_path):
    """A blockwise model another tool wrote: uint4 weights with a zero point per block (the layout
    of onnxruntime's weight-only quantizer), an int8 activation around the MatMul."""
    rng = np.random.default_rng(3)
    k, n, block = 64, 16, 16
    w = rng.integers(0, 16, size=(k, n)).astype(np.uint8)
    zero = rng.integers(6, 10, size=(k // block, n)).astype(np.uint8)
    scale = rng.uniform(0.01, 0.1, size=(k // block, n)).astype(np.float32)
    import ml_dtypes

    inits = [numpy_helper.from_array(w.astype(ml_dtypes.uint4), "wq"), numpy_helper.from_array(scale, "ws"),
             numpy_helper.from_array(zero.astype(ml_dtypes.uint4), "wz"),
             numpy_helper.from_array(np.float32(0.04), "xs"), numpy_helper.from_array(np.int8(0), "xz"),
             numpy_helper.from_array(np.float32(0.5), "ys"), numpy_helper.from_array(np.int8(0), "yz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0, block_size=block),
             helper.make_node("MatMul", ["xd", "wd"], ["m"], name="mm"),
             helper.make_node("QuantizeLinear", ["m", "ys", "yz"], ["mq"]),
             helper.make_node("DequantizeLinear", ["mq", "ys", "yz"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    path = tmp_path / "foreign.onnx"
    onnx.save(model, str(path))
    executor = IntegerExecutor(model)
    assert [type(s.op).__name__ for s in executor.steps if s.kind == "integer"] == ["BlockedMatMul"]
    x = rng.normal(size=(32, k)).astype(np.float32) * 2
    diff = _lsb_diff(executor.run({"x": x}).outputs["y"], _ort(path, x), 0.5)
    assert diff.max() <= 1 and (diff == 0).mean() >= 0.99


@pytest.mark.parametrize("args,fragments", [
    (("--weight-type", "int3"), ("unknown weight type 'int3'", "int8, int4")),
    (("--block-size", "1"), ("--block-size must be 0 (per channel) or at least 2, got 1",)),
    (("--weight-type", "int4", "--format", "qoperator"), ("int4 and blocked weights are written as QDQ",
                                                          "drop --format qoperator")),
])
def test_weight_option_errors(tmp_path, args, fragments):
    model = _mlp(tmp_path)
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", model, "--data", tmp_path / "fit.npz", "-o", table, "-q").exit_code == 0
    assert_user_error(invoke("quantize", model, "-t", table, "-o", tmp_path / "q.onnx", *args), *fragments)
    assert not (tmp_path / "q.onnx").exists()


def _blocked_gemm(weight: np.ndarray, bias: np.ndarray | None = None, block: int = 2) -> onnx.ModelProto:
    """xq (uint8) -> DQ -> Gemm(B from a blocked DQ of ``weight``, C from a DQ of ``bias``) -> Q."""
    k, n = weight.shape
    nodes = [helper.make_node("DequantizeLinear", ["xq", "xs"], ["x"], name="dqx"),
             helper.make_node("DequantizeLinear", ["W", "ws"], ["w"], name="dqw", axis=0, block_size=block),
             helper.make_node("Gemm", ["x", "w"] + (["c"] if bias is not None else []), ["y"], name="mm"),
             helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["yq"], name="qy")]
    inits = [numpy_helper.from_array(np.float32(0.1), "xs"), numpy_helper.from_array(weight, "W"),
             numpy_helper.from_array(np.full((-(-k // block), n), 1e-2, np.float32), "ws"),
             numpy_helper.from_array(np.float32(0.05), "ys"), numpy_helper.from_array(np.int8(0), "yz")]
    if bias is not None:
        nodes.insert(2, helper.make_node("DequantizeLinear", ["C", "cs"], ["c"], name="dqc"))
        inits += [numpy_helper.from_array(bias, "C"), numpy_helper.from_array(np.float32(0.001), "cs")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("xq", TensorProto.UINT8, [2, k])],
                              [helper.make_tensor_value_info("yq", TensorProto.INT8, [2, n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_blocked_weights_outside_int8_are_not_wrapped():
    """int32 weights blocked (valid ONNX) beyond int8: computed as the specification does (in
    float), never wrapped into int8 or int16."""
    from onnx.reference import ReferenceEvaluator

    model = _blocked_gemm(np.array([[65541, 0], [0, 1]], np.int32))
    executor = IntegerExecutor(model)
    assert "Gemm" in [s.node.op_type for s in executor.steps if s.kind == "float"]
    xq = np.array([[20, 0], [0, 10]], np.uint8)
    want = ReferenceEvaluator(model).run(None, {"xq": xq})[0]
    np.testing.assert_array_equal(executor.run({"xq": xq}).outputs["yq"], want)


def test_a_blocked_gemm_with_a_2d_bias_runs_in_float():
    model = _blocked_gemm(np.array([[1, 3], [-2, 4], [1, 1], [0, 2]], np.int8), np.array([[1, 2], [3, 4]], np.int32))
    executor = IntegerExecutor(model)
    floats = {op: why for op, _, why in executor.float_nodes()}
    assert "is not one value per column" in floats["Gemm"]
    xq = np.array([[10, 20, 30, 40], [1, 2, 3, 4]], np.uint8)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"xq": xq})[0]
    np.testing.assert_array_equal(executor.run({"xq": xq}).outputs["yq"], want)


def test_int4_leaves_a_3d_matmul_weight_as_int8_would(tmp_path):
    """--weight-type int4 on a MatMul whose constant B has 3 axes: the op is treated as with int8
    (float, with the reason), not a failed quantize."""
    rng = np.random.default_rng(6)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 3, 5])],
                              [numpy_helper.from_array(rng.normal(size=(2, 4, 5)).astype(np.float32), "W")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(4, 2, 3, 4)).astype(np.float32))
    assert invoke("calibrate", path, "--data", tmp_path / "d.npz", "-o", tmp_path / "t.yaml", "-q").exit_code == 0
    result = invoke("quantize", path, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx", "--weight-type", "int4")
    assert result.exit_code == 0, result.output
    assert "MatMul x1: B must be a 2-D constant ('mm')" in result.stdout


def test_a_4bit_tensor_into_a_float_op_is_one_line(tmp_path):
    """Q(int4) -> Transpose -> DQ: the executor hands ml_dtypes tensors only to Q/DQ, and says so."""
    nodes = [helper.make_node("QuantizeLinear", ["x", "s"], ["q"], output_dtype=TensorProto.INT4, name="q"),
             helper.make_node("Transpose", ["q"], ["qt"], perm=[1, 0], name="t"),
             helper.make_node("DequantizeLinear", ["qt", "s"], ["y"], name="dq")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])],
                              [numpy_helper.from_array(np.float32(0.5), "s")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    np.savez(tmp_path / "x.npz", x=np.zeros((2, 3), np.float32))
    assert_user_error(invoke("exec", path, "-i", tmp_path / "x.npz", "-o", tmp_path / "o.npz"),
                      "Transpose node 't' takes a int4 tensor")
    assert not (tmp_path / "o.npz").exists()


@pytest.mark.parametrize("make,message", [
    (lambda: dynamic_quantize(np.zeros((0,), np.float32), "d"), "got an empty tensor"),
    (lambda: dynamic_quantize(np.array([1.0, np.nan], np.float32), "d"), "NaN or infinity"),
    (lambda: Boundary("DequantizeLinear", "dq", axis=0, block_size=2).dequantize(
        np.zeros((4, 3), np.int8), np.ones((3, 3), np.float32), None), "blocked scale of shape \\[3, 3\\]"),
    (lambda: Boundary("QuantizeLinear", "q", axis=3).quantize(
        np.zeros((4, 3), np.float32), np.ones(3, np.float32), None), "axis 3 is outside a 2-D input"),
    (lambda: Boundary("QuantizeLinear", "q", output_type=TensorProto.INT8).quantize(
        np.zeros(3, np.float32), np.float32(1), np.uint8(0)), "output_dtype int8 differs from its zero point's type uint8"),
])
def test_boundary_errors_name_the_node(make, message):
    from qtool.errors import QtoolError

    with pytest.raises(QtoolError, match=message):
        make()
