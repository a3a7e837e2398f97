"""qtool/runs.py: the DequantizeLinear nodes of constants computed before a session gives the
same bits as onnxruntime computing them in the session, so the judged steps score the same."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool import runs
from qtool.runs import Runs, as_written_bytes, dequantized_constants

TYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32]


def _onnxruntime_dequantized(q, scale, zero, axis):
    node = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=axis)
    graph = helper.make_graph([node], "dq", [helper.make_tensor_value_info(
        "q", helper.np_dtype_to_tensor_dtype(q.dtype), q.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, q.shape)],
        [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zero, "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return as_written_bytes(model.SerializeToString()).run(None, {"q": q})[0]


@pytest.mark.parametrize("dtype", TYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("per_axis", [False, True], ids=["per-tensor", "per-axis"])
def test_constants_dequantized_as_onnxruntime_does(dtype, per_axis):
    """Both ends of the type and random values between, scales over 25 decades: bit for bit
    onnxruntime's."""
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    q = rng.integers(info.min, info.max, (37, 5, 3, 3), endpoint=True).astype(dtype)
    q.flat[:2] = info.min, info.max
    n = 5 if per_axis else 1
    scale = np.exp(rng.uniform(-20, 5, n)).astype(np.float32)
    zero = np.zeros(n, dtype) if dtype == np.int32 else rng.integers(info.min, info.max, n, endpoint=True).astype(dtype)
    if not per_axis:
        scale, zero = scale.reshape(()), zero.reshape(())
    expected = _onnxruntime_dequantized(q, scale, zero, 1)
    node = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=1)
    inits = {name: numpy_helper.from_array(v, name) for name, v in (("q", q), ("s", scale), ("z", zero))}
    got = runs._dequantized(node, inits)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def _qdq_model():
    """x -> Conv (DQ weights, per channel) -> Add (DQ constant, itself an output too) -> Mul (DQ
    constant) -> MatMul (DQ weights) -> y, with the activations quantized between them; and an
    initializer that an older exporter also lists as a graph input, read by nothing."""
    rng = np.random.default_rng(3)

    def q8(name, values, scale):
        per_row = np.reshape(scale, (-1,) + (1,) * (values.ndim - 1)) if np.ndim(scale) else scale
        q = np.clip(np.rint(values / per_row), -127, 127).astype(np.int8)
        return [numpy_helper.from_array(q, name + "_q"), numpy_helper.from_array(np.asarray(scale, np.float32), name + "_s"),
                numpy_helper.from_array(np.zeros(np.shape(scale), np.int8), name + "_z")]

    w_scale = np.array([0.011, 0.007, 0.013, 0.009], np.float32)
    inits = (q8("w", rng.normal(0, 0.5, (4, 3, 3, 3)), w_scale) + q8("c", rng.normal(0, 1, (1, 4, 1, 1)), np.float32(0.02))
             + q8("k", rng.normal(1, 0.3, (1, 4, 1, 1)), np.float32(0.013))
             + q8("m", rng.normal(0, 0.3, (6, 5)), np.float32(0.004)))
    inits.append(numpy_helper.from_array(np.ones(3, np.float32), "unused"))
    inits += [numpy_helper.from_array(np.float32(0.05), "a_s"), numpy_helper.from_array(np.uint8(128), "a_z")]

    def fence(x, name):
        return [helper.make_node("QuantizeLinear", [x, "a_s", "a_z"], [name + "_q8"]),
                helper.make_node("DequantizeLinear", [name + "_q8", "a_s", "a_z"], [name + "_f"])]

    nodes = [*fence("x", "x"),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"], axis=0),
             helper.make_node("Conv", ["x_f", "w"], ["conv"], pads=[1, 1, 1, 1]), *fence("conv", "conv"),
             helper.make_node("DequantizeLinear", ["c_q", "c_s", "c_z"], ["c"]),
             helper.make_node("Add", ["conv_f", "c"], ["add"]), *fence("add", "add"),
             helper.make_node("DequantizeLinear", ["k_q", "k_s", "k_z"], ["k"]),
             helper.make_node("Mul", ["add_f", "k"], ["mul"]), *fence("mul", "mul"),
             helper.make_node("DequantizeLinear", ["m_q", "m_s", "m_z"], ["m"]),
             helper.make_node("MatMul", ["mul_f", "m"], ["y"])]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 6, 6]),
                                             helper.make_tensor_value_info("unused", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4, 6, 5]),
                               helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 4, 1, 1])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # an initializer may be an input
    onnx.checker.check_model(model)
    return model


def test_constants_before_the_session_same_outputs():
    """The Conv's weights and the Mul's constant become float32 constants; the MatMul's weights
    (onnxruntime packs a constant B and sums it in other blocks) and a DQ whose result is an
    output stay, as does an initializer listed as an input; the samples' outputs are the same
    bits either way."""
    model = _qdq_model()
    folded = dequantized_constants(model)
    dq = [n.output[0] for n in folded.graph.node if n.op_type == "DequantizeLinear"]
    assert "w" not in dq and "k" not in dq
    assert "m" in dq and "c" in dq
    inits = {t.name: t for t in folded.graph.initializer}
    assert inits["w"].data_type == TensorProto.FLOAT and "w_q" not in inits
    assert inits["k"].data_type == TensorProto.FLOAT and "k_q" not in inits
    assert "m_q" in inits and "unused" in inits
    x = np.random.default_rng(5).normal(0, 2, (6, 3, 6, 6)).astype(np.float32)
    batches = [{"x": x[i:i + 1]} for i in range(6)]
    on = Runs(batches)
    assert len(on.feeds) >= runs.FOLD_FROM_FEEDS
    from qtool.analyze import with_outputs

    names = ["y", "c", "mul"]
    model = with_outputs(model, names)
    plain = as_written_bytes(model.SerializeToString(), threads=1)
    for a, b in zip(on.run(plain, names), on.run(on.session(model), names)):
        assert all(np.array_equal(u, v) for u, v in zip(a, b))


def test_constants_within_the_budget(monkeypatch):
    """No more float32 bytes than FOLD_BYTES are made: past them the DQ nodes stay."""
    model = _qdq_model()
    monkeypatch.setattr(runs, "FOLD_BYTES", 50)  # the Mul's 4 values fit, the Conv's 108 do not
    folded = dequantized_constants(model)
    dq = {n.output[0] for n in folded.graph.node if n.op_type == "DequantizeLinear"}
    assert "w" in dq and "k" not in dq


def test_blocked_and_unknown_dequantize_stay():
    """A blocked scale (block_size) or an integer type of other kernels is left to onnxruntime."""
    inits = {"q": numpy_helper.from_array(np.ones((4, 8), np.int8), "q"),
             "s": numpy_helper.from_array(np.ones((4, 2), np.float32), "s"),
             "q4": helper.make_tensor("q4", TensorProto.INT4, [4], [1, 2, 3, 4]),
             "s1": numpy_helper.from_array(np.float32(0.5), "s1")}
    blocked = helper.make_node("DequantizeLinear", ["q", "s"], ["y"], axis=1, block_size=4)
    assert runs._dequantized(blocked, inits) is None
    assert runs._dequantized(helper.make_node("DequantizeLinear", ["q4", "s1"], ["y"]), inits) is None
    assert runs._dequantized(helper.make_node("DequantizeLinear", ["q", "s1"], ["y"]), inits) is not None
