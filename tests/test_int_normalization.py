"""Integer Softmax and LayerNormalization kernels against float over the whole input range, and the
integer square root they rest on.

The reference is what the QDQ model means: dequantize (float32, as DequantizeLinear), the float op
in float64, then round to the output's steps. The kernels may differ from it only at rounding ties
(the module notes bound their errors at about 2^-20 LSB), so at most one step, and almost never.
"""

import math

import numpy as np
import onnx
import pytest
from hypothesis import given, settings, strategies as st
from onnx import helper

from qtool.fixedpoint import bit_length, isqrt, saturate
from qtool.ops import NodeView, Operand, Unsupported
from qtool.ops.normalization import LayerNormalization
from qtool.ops.softmax import EXP_BITS, Softmax
from qtool.qparams import QParams, dequantize_array

RNG = np.random.default_rng(2026)


# -- integer square root ---------------------------------------------------------------------------

EDGES = [0, 1, 2, 3, 4, 8, 15, 16, 17, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**52 + 1,
         2**53 - 1, 2**53 + 1, (2**31 - 1) ** 2, (2**31 - 1) ** 2 - 1, 2**62, 2**63 - 1]


def test_isqrt_and_bit_length_at_edges():
    x = np.array(EDGES, dtype=np.int64)
    assert isqrt(x).tolist() == [math.isqrt(v) for v in EDGES]
    assert bit_length(x).tolist() == [v.bit_length() for v in EDGES]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=64))
def test_isqrt_is_the_floor_of_the_root(values):
    x = np.array(values, dtype=np.int64)
    assert isqrt(x).tolist() == [math.isqrt(v) for v in values]
    assert bit_length(x).tolist() == [v.bit_length() for v in values]


def test_isqrt_refuses_negative_values():
    with pytest.raises(ValueError, match="non-negative"):
        isqrt(np.array([4, -1], dtype=np.int64))


# -- helpers ---------------------------------------------------------------------------------------

def _view(op_type, x: QParams, y: QParams, constants=(), opset=17, **attrs):
    node = helper.make_node(op_type, ["x"] + [f"c{i}" for i in range(len(constants))], ["y"], **attrs)
    operands = [Operand(x)] + [Operand(None, c) for c in constants]
    return NodeView(node, operands, y, opset=opset)


def _quantize_float(values: np.ndarray, y: QParams) -> np.ndarray:
    """round half up to the output's steps, as the kernels' default rounding does"""
    return saturate(np.floor(values / np.float64(y.scale) + 0.5).astype(np.int64) + y.zero_point, y.dtype)


def _rows_over_range(x: QParams, rows: int, width: int) -> np.ndarray:
    """Random rows and the hard ones: constant rows, the two extremes, one outlier, full-range noise."""
    lo, hi = x.qmin, x.qmax
    q = RNG.integers(lo, hi + 1, (rows, width))
    q[0] = lo
    q[1] = hi
    q[2] = RNG.integers(lo, hi + 1)
    q[3] = lo
    q[3, width // 2] = hi
    q[4, ::2], q[4, 1::2] = lo, hi
    q[5] = np.clip(RNG.integers(-2, 3, width) + (lo + hi) // 2, lo, hi)  # within a few steps
    return q.astype(x.dtype)


def _assert_close(got, want, what):
    diff = np.abs(got.astype(np.int64) - want.astype(np.int64))
    assert diff.max() <= 1, f"{what}: {diff.max()} steps"
    assert np.mean(diff == 0) >= 0.999, f"{what}: {np.mean(diff == 0):.4%} equal"


# -- Softmax ---------------------------------------------------------------------------------------

SOFTMAX_CASES = [
    (QParams(0.05, -3, "int8"), QParams(np.float32(1 / 255), -128, "int8")),
    (QParams(0.2, 0, "int8"), QParams(np.float32(1 / 255), 0, "uint8")),
    (QParams(0.01, 128, "uint8"), QParams(np.float32(1 / 255), -128, "int8")),
    (QParams(3e-4, 0, "int16"), QParams(np.float32(1 / 32767), 0, "int16")),
    (QParams(0.7, 5, "int8"), QParams(np.float32(1 / 255), -128, "int8")),  # exp underflows to 0
]


@pytest.mark.parametrize("x, y", SOFTMAX_CASES)
def test_softmax_matches_float_over_the_input_range(x, y):
    params = Softmax().derive(_view("Softmax", x, y, axis=-1))
    q = _rows_over_range(x, 400, 37)
    got = Softmax().run(params, q)
    real = dequantize_array(q, x).astype(np.float64)
    e = np.exp(real - real.max(axis=-1, keepdims=True))
    _assert_close(got, _quantize_float(e / e.sum(axis=-1, keepdims=True), y), f"softmax {x.dtype}")


def test_softmax_exp_table_is_exact_to_its_last_bit():
    x = QParams(0.05, 0, "int8")
    params = Softmax().derive(_view("Softmax", x, QParams(np.float32(1 / 255), -128, "int8")))
    d = dequantize_array(np.arange(-128, 128), x).astype(np.float64)
    want = np.exp(d - d[-1]) * 2.0**EXP_BITS
    assert np.abs(params.exp_table - want).max() <= 0.5
    assert params.exp_table[-1] == 2**EXP_BITS  # the row's maximum counts exactly 1


def test_softmax_before_opset_13_normalizes_the_flattened_axes():
    x, y = QParams(0.1, 0, "int8"), QParams(np.float32(1 / 255), -128, "int8")
    q = RNG.integers(-128, 128, (4, 3, 5)).astype(np.int8)
    old = Softmax().run(Softmax().derive(_view("Softmax", x, y, opset=11, axis=1)), q)
    flat = Softmax().run(Softmax().derive(_view("Softmax", x, y, opset=13, axis=-1)), q.reshape(4, 15))
    assert np.array_equal(old, flat.reshape(4, 3, 5))
    new = Softmax().run(Softmax().derive(_view("Softmax", x, y, opset=13, axis=1)), q)
    assert not np.array_equal(old, new)  # along axis 1 alone from opset 13


# -- LayerNormalization ----------------------------------------------------------------------------

def _layernorm_float(q, x: QParams, gamma, beta, eps, axes):
    real = dequantize_array(q, x).astype(np.float64)
    mean = real.mean(axis=axes, keepdims=True)
    var = ((real - mean) ** 2).mean(axis=axes, keepdims=True)
    return (real - mean) / np.sqrt(var + eps) * gamma + beta


LAYERNORM_CASES = [
    ("int8 asymmetric", QParams(0.04, -7, "int8"), QParams(0.03, 3, "int8"), 120, 1e-5),
    ("uint8", QParams(0.02, 128, "uint8"), QParams(0.05, -10, "int8"), 64, 1e-6),
    ("int16", QParams(2e-4, 0, "int16"), QParams(2.5e-4, 0, "int16"), 96, 1e-5),
    ("large eps", QParams(0.01, 0, "int8"), QParams(0.02, 0, "int8"), 32, 0.5),
    ("wide rows", QParams(0.04, 0, "int8"), QParams(0.03, 0, "int8"), 2048, 1e-5),
]


@pytest.mark.parametrize("name, x, y, width, eps", LAYERNORM_CASES, ids=[c[0] for c in LAYERNORM_CASES])
def test_layernorm_matches_float_over_the_input_range(name, x, y, width, eps):
    gamma = RNG.normal(0.6, 0.4, width).astype(np.float32)
    gamma[:3] = [0.0, -0.5, 1e-9]  # a dead channel, a negative one, a tiny one
    beta = RNG.normal(0, 0.5, width).astype(np.float32)
    beta[3] = 1e4  # saturates whatever the row
    params = LayerNormalization().derive(
        _view("LayerNormalization", x, y, (gamma, beta), epsilon=eps))
    q = _rows_over_range(x, 300, width).reshape(100, 3, width)
    got = LayerNormalization().run(params, q)
    want = _quantize_float(_layernorm_float(q, x, gamma.astype(np.float64), beta.astype(np.float64),
                                            np.float64(np.float32(eps)), -1), y)
    _assert_close(got, want, name)


def test_layernorm_over_two_axes_and_without_bias():
    x, y = QParams(0.05, 2, "int8"), QParams(0.04, 0, "int8")
    gamma = RNG.normal(1, 0.3, (4, 6)).astype(np.float32)
    params = LayerNormalization().derive(_view("LayerNormalization", x, y, (gamma,), axis=-2))
    q = _rows_over_range(x, 40, 24).reshape(2, 20, 4, 6)
    got = LayerNormalization().run(params, q)
    want = _quantize_float(_layernorm_float(q, x, gamma.astype(np.float64), 0.0, np.float64(np.float32(1e-5)),
                                            (-2, -1)), y)
    _assert_close(got, want, "two axes")


@pytest.mark.parametrize("attrs, shape, match", [
    ({"axis": 1}, (8,), "must be the row's"),
    ({"axis": -1}, (2, 8), "must be the row's"),
])
def test_layernorm_forms_outside_the_kernel_stay_float(attrs, shape, match):
    view = _view("LayerNormalization", QParams(0.1, 0, "int8"), QParams(0.1, 0, "int8"),
                 (np.ones(shape, np.float32),), **attrs)
    with pytest.raises(Unsupported, match=match):
        LayerNormalization().derive(view)


def test_layernorm_rows_that_would_leave_int64_stay_float():
    view = _view("LayerNormalization", QParams(1e-3, 0, "int16"), QParams(1e-3, 0, "int16"),
                 (np.ones(4096, np.float32),))
    with pytest.raises(Unsupported, match="leave int64"):
        LayerNormalization().derive(view)


def test_layernorm_is_onnx_layernormalization():
    """The float reference above is ONNX's own definition (onnx.reference), not a copy of ours."""
    from onnx.reference import ReferenceEvaluator

    width = 16
    gamma, beta = RNG.normal(1, 0.2, width).astype(np.float32), RNG.normal(0, 0.2, width).astype(np.float32)
    node = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], epsilon=1e-3)
    graph = helper.make_graph([node], "ln", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [8, width])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [8, width])],
                              [onnx.numpy_helper.from_array(gamma, "g"), onnx.numpy_helper.from_array(beta, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = QParams(0.05, 0, "int8")
    q = _rows_over_range(x, 8, width)
    real = dequantize_array(q, x)
    want = ReferenceEvaluator(model).run(None, {"x": real})[0]
    got = _layernorm_float(q, x, gamma.astype(np.float64), beta.astype(np.float64), np.float64(np.float32(1e-3)), -1)
    assert np.allclose(got, want, atol=1e-5)
