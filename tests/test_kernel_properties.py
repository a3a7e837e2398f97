"""Hypothesis properties of the integer kernels against a float reference.

For random shapes, attributes, scales and zero points, each kernel's output is compared with the
float op run by ``onnx.reference`` (a trusted, independent implementation) on the dequantized
inputs, then quantized to the output's (S, Z): ``clip(round(f(dq(inputs)) / S_y) + Z_y)``. With
32-bit multipliers the kernel must be within 1 LSB everywhere: the float reference is exact up to
float64 rounding, and the fixed-point multiplier's relative error (2**-31) plus the rounding of
the int32 bias at ``S_x * S_w`` (half an accumulator unit, at most half an LSB when
``S_x * S_w <= S_y``) stay below one step.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper
from onnx.reference import ReferenceEvaluator

from qtool.ops import REGISTRY, NodeView, Operand
from qtool.qparams import QParams

SETTINGS = settings(max_examples=60, deadline=None)


def _dequantize(q: np.ndarray, qp: QParams) -> np.ndarray:
    scale = np.asarray(qp.scale, np.float64)
    zero = np.asarray(qp.zero_point, np.float64)
    if qp.axis is not None:
        shape = [1] * q.ndim
        shape[qp.axis] = -1
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    return (q.astype(np.float64) - zero) * scale


def _output_qparams(reference: np.ndarray, rng, dtype="int8") -> QParams:
    """An output range around the reference's, sometimes narrower so that saturation is tested."""
    lo, hi = min(float(reference.min()), 0.0), max(float(reference.max()), 0.0)
    width = max(hi - lo, 1e-3) * rng.uniform(0.6, 1.3)
    scale = width / 255
    zero = int(np.clip(np.round(-128 - lo / scale), -128, 127)) if dtype == "int8" else 0
    return QParams(scale, zero, dtype)


def _expected(reference: np.ndarray, qp: QParams) -> np.ndarray:
    lo, hi = qp.qmin, qp.qmax
    return np.clip(np.round(reference / qp.scale) + qp.zero_point, lo, hi).astype(np.int64)


def _run_kernel(node, operands, run_inputs, out_qp: QParams) -> np.ndarray:
    op = REGISTRY[node.op_type]
    params = op.derive(NodeView(node, operands, out_qp))
    params = op.specialize(params, [tuple(v.shape) for v in run_inputs])
    return op.run(params, *run_inputs).astype(np.int64)


def _activation(rng, shape, dtype="int8"):
    lo, hi = (-128, 127) if dtype == "int8" else (0, 255)
    q = rng.integers(lo, hi + 1, size=shape).astype(dtype)
    qp = QParams(float(np.exp(rng.uniform(np.log(1e-3), np.log(0.5)))), int(rng.integers(lo, hi + 1)), dtype)
    return q, qp


def _assert_within_one_lsb(got, want):
    diff = np.abs(got - want)
    assert diff.max(initial=0) <= 1, f"{int(diff.max())} LSB off at {np.unravel_index(diff.argmax(), diff.shape)}"


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), group=st.integers(1, 3), c_in_per_group=st.integers(1, 3),
       c_out_per_group=st.integers(1, 3), kernel=st.integers(1, 3), stride=st.integers(1, 2),
       dilation=st.integers(1, 2), pads=st.lists(st.integers(0, 2), min_size=4, max_size=4),
       with_bias=st.booleans(), dtype=st.sampled_from(["int8", "uint8"]))
def test_conv_within_one_lsb_of_onnx_reference(seed, group, c_in_per_group, c_out_per_group, kernel,
                                               stride, dilation, pads, with_bias, dtype):
    rng = np.random.default_rng(seed)
    c_in, c_out = group * c_in_per_group, group * c_out_per_group
    size = dilation * (kernel - 1) + 1 + int(rng.integers(0, 5))
    x, x_qp = _activation(rng, (2, c_in, size, size + 1), dtype)
    w_float = rng.normal(0, 1, (c_out, c_in_per_group, kernel, kernel)) * rng.uniform(0.01, 2, (c_out, 1, 1, 1))
    w_scale = np.abs(w_float).reshape(c_out, -1).max(axis=1) / 127
    w = np.clip(np.round(w_float / w_scale[:, None, None, None]), -127, 127).astype(np.int8)
    w_qp = QParams(w_scale, np.zeros(c_out, np.int64), "int8", axis=0)
    channel_scale = (x_qp.scale * w_scale).astype(np.float32)
    inputs = ["x", "w"]
    operands = [Operand(x_qp), Operand(w_qp, w)]
    feeds = {"x": _dequantize(x, x_qp), "w": _dequantize(w, w_qp)}
    if with_bias:
        b = np.round(rng.normal(0, 50, c_out)).astype(np.int32)
        operands.append(Operand(QParams(channel_scale, np.zeros(c_out, np.int64), "int32", axis=0), b))
        feeds["b"] = b.astype(np.float64) * channel_scale.astype(np.float64)
        inputs.append("b")
    node = helper.make_node("Conv", inputs, ["y"], group=group, strides=[stride, stride],
                            dilations=[dilation, dilation], pads=pads, kernel_shape=[kernel, kernel])
    reference = ReferenceEvaluator(node).run(None, feeds)[0]
    y_qp = _output_qparams(reference, rng)
    _assert_within_one_lsb(_run_kernel(node, operands, [x], y_qp), _expected(reference, y_qp))


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), op_type=st.sampled_from(["Add", "Mul"]),
       broadcast=st.booleans(), dtype=st.sampled_from(["int8", "uint8"]))
def test_add_and_mul_within_one_lsb_of_onnx_reference(seed, op_type, broadcast, dtype):
    rng = np.random.default_rng(seed)
    a, a_qp = _activation(rng, (2, 3, 4, 5), dtype)
    b, b_qp = _activation(rng, (1, 3, 1, 1) if broadcast else (2, 3, 4, 5), dtype)
    node = helper.make_node(op_type, ["a", "b"], ["y"])
    reference = ReferenceEvaluator(node).run(None, {"a": _dequantize(a, a_qp), "b": _dequantize(b, b_qp)})[0]
    y_qp = _output_qparams(reference, rng)
    got = _run_kernel(node, [Operand(a_qp), Operand(b_qp)], [a, b], y_qp)
    _assert_within_one_lsb(got, _expected(reference, y_qp))


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), kernel=st.integers(1, 3), stride=st.integers(1, 2),
       pads=st.lists(st.integers(0, 1), min_size=4, max_size=4), global_pool=st.booleans())
def test_average_pools_within_one_lsb_of_onnx_reference(seed, kernel, stride, pads, global_pool):
    rng = np.random.default_rng(seed)
    x, x_qp = _activation(rng, (2, 3, 5 + kernel, 6 + kernel))
    if global_pool:
        node = helper.make_node("GlobalAveragePool", ["x"], ["y"])
    else:  # padding averages in real zeros (count_include_pad=1), the form the kernel supports
        node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[kernel, kernel],
                                strides=[stride, stride], pads=pads, count_include_pad=1)
    reference = ReferenceEvaluator(node).run(None, {"x": _dequantize(x, x_qp)})[0]
    y_qp = _output_qparams(reference, rng)
    _assert_within_one_lsb(_run_kernel(node, [Operand(x_qp)], [x], y_qp), _expected(reference, y_qp))


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 6), k=st.integers(1, 40), n=st.integers(1, 6))
def test_matmul_of_two_activations_within_one_lsb_of_onnx_reference(seed, m, k, n):
    rng = np.random.default_rng(seed)
    a, a_qp = _activation(rng, (2, m, k))
    b, b_qp = _activation(rng, (2, k, n))
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    reference = ReferenceEvaluator(node).run(None, {"a": _dequantize(a, a_qp), "b": _dequantize(b, b_qp)})[0]
    y_qp = _output_qparams(reference, rng)
    got = _run_kernel(node, [Operand(a_qp), Operand(b_qp)], [a, b], y_qp)
    _assert_within_one_lsb(got, _expected(reference, y_qp))
