"""Integer kernels: golden vectors computed by hand, then derivations against hand-computed
parameters."""

import dataclasses

import numpy as np
import pytest
from onnx import helper

from qtool.fixedpoint import Requant, narrowed
from qtool.ops import REGISTRY, NodeView, Operand, Rescale
from qtool.ops.conv import ConvParams
from qtool.ops.gemm import MatMulParams
from qtool.ops.intmatmul import exact_float_type, int_matmul, k_chunk
from qtool.ops.pool import AvgPoolParams, MaxPoolParams, Window
from qtool.qparams import QParams

IDENTITY = Rescale(0, 0, None, "half_up", "int8")


def i8(x):
    return np.array(x, dtype=np.int8)


def test_conv_pads_with_input_zero_point():
    # 2x2 input, 3x3 ones kernel, pad 1: every window holds the 4 pixels and 5 pads.
    # Z_x = 3, so real values are [0, 0, 0, 2]; pads must count as real 0 (i.e. q = 3).
    weight = np.ones((1, 1, 3, 3), dtype=np.int8)
    p = ConvParams(weight=weight, bias=np.array([0 - 3 * 9]), requant=Requant(np.array([2**30]), np.array([30])),
                   zero_in=3, zero_out=0, pads=(1, 1, 1, 1), strides=(1, 1), dilations=(1, 1), group=1,
                   rounding="half_up", dtype="int8")
    x = i8([[[[3, 3], [3, 5]]]])
    assert REGISTRY["Conv"].run(p, x).tolist() == [[[[2, 2], [2, 2]]]]


def test_conv_bias_requantize_zero_point():
    # sum q_x*q_w = 1*1 + 4*(-1) = -3; bias 10; * 0.5 -> 3.5 -> 4 (half up); + Z_y -2 -> 2
    p = ConvParams(weight=i8([[[[1, 0], [0, -1]]]]), bias=np.array([10]),
                   requant=Requant(np.array([2**30]), np.array([31])), zero_in=0, zero_out=-2,
                   pads=(0, 0, 0, 0), strides=(1, 1), dilations=(1, 1), group=1, rounding="half_up",
                   dtype="int8")
    assert REGISTRY["Conv"].run(p, i8([[[[1, 2], [3, 4]]]])).tolist() == [[[[2]]]]


def test_conv_groups_stride_and_saturation():
    # depthwise (group 2), stride 2, 1x1 kernels: channel 0 * 2, channel 1 * -3, then clamp
    p = ConvParams(weight=i8([[[[2]]], [[[-3]]]]), bias=np.array([0, 0]),
                   requant=Requant(np.array([2**30, 2**30]), np.array([30, 30])), zero_in=0, zero_out=0,
                   pads=(0, 0, 0, 0), strides=(2, 2), dilations=(1, 1), group=2, rounding="half_up",
                   dtype="int8")
    x = i8([[[[10, 1], [1, 1]], [[50, 1], [1, 1]]]])
    assert REGISTRY["Conv"].run(p, x).tolist() == [[[[20]], [[-128]]]]


def _conv3d_by_definition(x, w, pads, strides, dilations, group, zero_in):
    """int64 sums of a 3-D Conv, one output at a time from the ONNX definition (padding Z_x)."""
    n, c_in, depth, h, wd = x.shape
    c_out, c_g, kd, kh, kw = w.shape
    xp = np.full((n, c_in, depth + pads[0] + pads[3], h + pads[1] + pads[4], wd + pads[2] + pads[5]), zero_in,
                 np.int64)
    xp[:, :, pads[0]:pads[0] + depth, pads[1]:pads[1] + h, pads[2]:pads[2] + wd] = x
    out = [(xp.shape[2 + a] - dilations[a] * (w.shape[2 + a] - 1) - 1) // strides[a] + 1 for a in range(3)]
    y = np.zeros((n, c_out, *out), np.int64)
    per = c_out // group
    for b, o, i, j, k in np.ndindex(n, c_out, *out):
        g = o // per
        for c, a, e, f in np.ndindex(c_g, kd, kh, kw):
            y[b, o, i, j, k] += int(w[o, c, a, e, f]) * xp[b, g * c_g + c, i * strides[0] + a * dilations[0],
                                                           j * strides[1] + e * dilations[1],
                                                           k * strides[2] + f * dilations[2]]
    return y


@pytest.mark.parametrize("pads, strides, dilations, group, c_in, c_out", [
    ((1, 1, 1, 1, 1, 1), (1, 1, 1), (1, 1, 1), 1, 3, 4),
    ((0, 1, 2, 1, 0, 1), (2, 1, 3), (2, 1, 1), 2, 4, 6),
    ((1, 0, 1, 1, 2, 0), (1, 2, 1), (1, 1, 2), 3, 3, 3),  # depthwise
])
def test_conv3d_equals_its_definition(pads, strides, dilations, group, c_in, c_out):
    # identity requantization into int32: the output is the sum + bias + Z_y itself
    rng = np.random.default_rng(c_in * 10 + c_out)
    w = rng.integers(-128, 128, (c_out, c_in // group, 2, 3, 2)).astype(np.int8)
    x = rng.integers(-128, 128, (2, c_in, 5, 6, 7)).astype(np.int8)
    bias = rng.integers(-1000, 1000, c_out)
    p = ConvParams(weight=w, bias=bias, requant=Requant(np.full(c_out, 2**30), np.full(c_out, 30)), zero_in=-5,
                   zero_out=7, pads=pads, strides=strides, dilations=dilations, group=group, rounding="half_up",
                   dtype="int32", rank=3)
    want = _conv3d_by_definition(x, w, pads, strides, dilations, group, -5) + bias[None, :, None, None, None] + 7
    op = REGISTRY["Conv"]
    got = op.run(op.specialize(p, [x.shape]), x)
    assert got.dtype == np.int32 and got.shape == want.shape and (got == want).all()


def test_gemm_transposed_weight():
    # x [1, 2] @ W^T with W = [[1, 1], [2, -1]] -> [3, 0]; + bias [1, 2] -> [4, 2]; * 0.5 -> [2, 1]
    p = MatMulParams(weight=i8([[1, 1], [2, -1]]).T, bias=np.array([1, 2]),
                     requant=Requant(np.array([2**30, 2**30]), np.array([31, 31])), zero_out=0,
                     rounding="half_up", dtype="int8")
    assert REGISTRY["Gemm"].run(p, i8([[1, 2]])).tolist() == [[2, 1]]


def test_maxpool_pads_never_win():
    p = MaxPoolParams(Window((2, 2), (0, 0, 1, 1), (1, 1), (1, 1)), -128, IDENTITY)
    x = i8([[[[-5, 7], [3, -128]]]])
    assert REGISTRY["MaxPool"].run(p, x).tolist() == [[[[7, 7], [3, -128]]]]


def test_average_pool_subtracts_zero_point():
    # window [1, 2, 3, 5] with Z_x = 1: sum(q - Z) = 7; 7 / 4 = 1.75 -> 2; + Z_y 1 -> 3
    p = AvgPoolParams(Window((2, 2), (0, 0, 0, 0), (1, 1), (1, 1)), Requant(2**30, 32), 1, 1,
                      "half_up", "int8")
    assert REGISTRY["AveragePool"].run(p, i8([[[[1, 2], [3, 5]]]])).tolist() == [[[[3]]]]
    assert REGISTRY["GlobalAveragePool"].run(p, i8([[[[1, 2], [3, 5]]]])).tolist() == [[[[3]]]]


def test_relu_clamps_at_zero_point():
    from qtool.ops.relu import ReluParams

    assert REGISTRY["Relu"].run(ReluParams(-1, IDENTITY), i8([-3, -1, 0, 5])).tolist() == [-1, -1, 0, 5]


def test_flatten_and_reshape_move_data_only():
    from qtool.ops.shape import ShapeParams

    x = np.arange(6, dtype=np.int8).reshape(2, 3, 1, 1)
    assert REGISTRY["Flatten"].run(ShapeParams(IDENTITY, axis=1), x).shape == (2, 3)
    y = REGISTRY["Reshape"].run(ShapeParams(IDENTITY), x, np.array([0, -1]))
    assert y.shape == (2, 3) and y.dtype == np.int8 and y.ravel().tolist() == list(range(6))


def test_kernels_refuse_float_data():
    p = MaxPoolParams(Window((1, 1), (0, 0, 0, 0), (1, 1), (1, 1)), -128, IDENTITY)
    with pytest.raises(TypeError, match="float"):
        REGISTRY["MaxPool"].run(p, np.zeros((1, 1, 2, 2), dtype=np.float32))


# -- derivations against hand-computed parameters ----------------------------------------------

def _view(node, inputs, output, bits=32):
    return NodeView(node, inputs, output, "half_up", bits)


def test_conv_derivation_by_hand():
    # S_x 0.5, Z_x 3; S_w 0.25; S_y 0.125 -> S_x*S_w/S_y = 1.0 -> (2**30, 30)
    # bias 1.0 stored as round(1.0 / (0.5 * 0.25)) = 8; compensation -Z_x * sum(q_w) = -3 * 10
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[0, 0, 0, 0])
    w = i8([[[[1, 2], [3, 4]]]])
    view = _view(node, [Operand(QParams(0.5, 3)),
                        Operand(QParams(np.array([0.25], np.float32), np.array([0]), "int8", 0), w),
                        Operand(QParams(np.array([0.125], np.float32), np.array([0]), "int32", 0),
                                np.array([8], np.int32))],
                 QParams(0.125, -5))
    p = REGISTRY["Conv"].derive(view)
    assert p.requant.multiplier.tolist() == [2**30] and p.requant.rshift.tolist() == [30]
    assert p.bias.tolist() == [8 - 30]
    assert (p.zero_in, p.zero_out) == (3, -5)


def test_add_derivation_and_run_by_hand():
    # a: S 0.5, Z 2; b: S 0.25, Z 0; y: S 0.5, Z 1. Real a = [4, -11], b = [1, 1] -> y = [5, -10]
    # -> q_y = [11, -19]. Ratios 1 and 0.5 share rshift 30: M_a = 2**30, M_b = 2**29.
    node = helper.make_node("Add", ["a", "b"], ["y"])
    p = REGISTRY["Add"].derive(_view(node, [Operand(QParams(0.5, 2)), Operand(QParams(0.25, 0))],
                                     QParams(0.5, 1)))
    assert (p.multiplier_a, p.multiplier_b, p.rshift) == (2**30, 2**29, 30)
    assert REGISTRY["Add"].run(p, i8([10, -20]), i8([4, 4])).tolist() == [11, -19]


def test_add_derivation_8_bit():
    node = helper.make_node("Add", ["a", "b"], ["y"])
    p = REGISTRY["Add"].derive(_view(node, [Operand(QParams(0.5, 0)), Operand(QParams(0.25, 0))],
                                     QParams(0.5, 0), bits=8))
    # larger ratio 1.0 -> (64, 6); the other 0.5 * 2**6 = 32
    assert (p.multiplier_a, p.multiplier_b, p.rshift) == (64, 32, 6)


def test_global_average_pool_derives_per_input_shape():
    node = helper.make_node("GlobalAveragePool", ["x"], ["y"])
    op = REGISTRY["GlobalAveragePool"]
    setup = op.derive(_view(node, [Operand(QParams(0.5, 0))], QParams(0.5, 0)))
    p = op.specialize(setup, [(1, 3, 2, 2)])  # k = 4 -> scale 1/4 -> (2**30, 32)
    assert (int(p.requant.multiplier), int(p.requant.rshift)) == (2**30, 32)


@pytest.mark.parametrize("op_type", ["GlobalAveragePool", "AveragePool"])
def test_an_int16_average_over_a_large_map_is_the_rounded_mean(op_type):
    # the sum of 500 x 500 int16 values passes 2**32: the multiplier is narrowed for count * 32768
    # (it overflowed before: "accumulator exceeds int32"); the mean of a constant map is itself
    q = QParams(8.0 / 32767, 0, "int16")
    attrs = {"kernel_shape": [500, 500]} if op_type == "AveragePool" else {}
    node = helper.make_node(op_type, ["x"], ["y"], **attrs)
    op = REGISTRY[op_type]
    x = np.full((1, 2, 500, 500), 20000, dtype=np.int16)
    x[0, 1] = -32768
    x[0, 1, :, ::3] = -32767  # mean -32767.67 (500 columns: 167 of them -32767)
    p = op.specialize(op.derive(_view(node, [Operand(q)], q)), [x.shape])
    assert op.run(p, x).reshape(-1).tolist() == [20000, round(float(x[0, 1].astype(np.float64).mean()))]


def test_an_int16_mean_too_long_for_its_multiplier_is_refused_not_wrapped():
    node = helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=0)
    op = REGISTRY["ReduceMean"]
    p = op.derive(NodeView(node, [Operand(QParams(1 / 32767, 0, "int16"))], QParams(1 / 32767 / 0.999, 0, "int16"),
                           "half_up", 32, opset=17))
    assert op.run(p, np.full((1, 4096), 32767, dtype=np.int16)).tolist() == [round(32767 * 0.999)]
    with pytest.raises(OverflowError, match="accumulator"):
        op.run(p, np.full((1, 2**26 + 2**24), 32767, dtype=np.int16))  # it gave -19695


def test_relu_with_different_output_scale_requantizes():
    node = helper.make_node("Relu", ["x"], ["y"])
    op = REGISTRY["Relu"]
    p = op.derive(_view(node, [Operand(QParams(0.5, 0))], QParams(1.0, 0)))
    # values [-4, 3, 5] * 0.5 -> relu -> [0, 1.5, 2.5] -> / 1.0 -> [0, 2, 3] half up
    assert op.run(p, i8([-4, 3, 5])).tolist() == [0, 2, 3]


# -- exact integer matmul on a float BLAS ----------------------------------------------------------

def test_int_matmul_splits_k_at_the_mantissa_bound():
    # worst case: every product is 127 * -128 and K is large, so the sum of |products| passes a
    # float32-sized mantissa limit and K must be split
    k = 4096
    a = np.full((2, k), 127, dtype=np.int8)
    b = np.full((k, 3), -128, dtype=np.int8)
    limit = 2**24
    assert k_chunk(127, 128, limit) < k  # the split is really exercised
    exact = sum(127 * -128 for _ in range(k))
    assert int_matmul(a, b, mantissa_limit=limit).tolist() == [[exact] * 3] * 2


@pytest.mark.parametrize("k, float_type", [(1032, np.float32), (1033, np.float64)])
def test_int_matmul_float32_path_is_exact_at_its_bound(k, float_type):
    # worst case for int8: every product 127 * -128 = -16256; 1032 of them sum to -16,776,192,
    # just inside float32's 2**24 mantissa, and one more product needs float64
    assert exact_float_type(k, 127, 128) is float_type
    a = np.full((2, k), 127, dtype=np.int8)
    b = np.full((k, 3), -128, dtype=np.int8)
    a[1, ::2] = -128  # the second row alternates signs: partial sums swing, the total is small
    expected = [[-16256 * k] * 3, [sum(-16256 if i % 2 else 16384 for i in range(k))] * 3]
    assert int_matmul(a, b).tolist() == expected


def test_int_matmul_random_uint8_by_int8_against_python_ints():
    # uint8 activations (up to 255) times int8 weights: the float32 bound is K <= 514
    rng = np.random.default_rng(1)
    for k in (514, 515, 1500):
        a = rng.integers(0, 256, size=(2, 3, k)).astype(np.uint8)
        b = rng.integers(-128, 128, size=(k, 5)).astype(np.int8)
        a[0, 0] = 255
        b[:, 0] = -128
        expected = a.astype(object) @ b.astype(object)
        assert (int_matmul(a, b) == expected.astype(np.int64)).all()
    assert exact_float_type(514, 255, 128) is np.float32 and exact_float_type(515, 255, 128) is np.float64


def test_int_matmul_random_against_python_ints():
    rng = np.random.default_rng(0)
    a = rng.integers(-128, 128, size=(3, 700)).astype(np.int8)
    b = rng.integers(-128, 128, size=(700, 4)).astype(np.int8)
    expected = [[sum(int(a[i, k]) * int(b[k, j]) for k in range(700)) for j in range(4)] for i in range(3)]
    assert int_matmul(a, b, mantissa_limit=2**20).tolist() == expected
    assert int_matmul(a, b).tolist() == expected


def _naive_conv(x, w, group, strides, dilations):
    """Direct loops over output pixels, channels and taps, in Python ints."""
    n, c_in, h, wd = x.shape
    c_out, c_per_group, kh, kw = w.shape
    per_group = c_out // group
    out_h = (h - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    out_w = (wd - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    y = np.zeros((n, c_out, out_h, out_w), dtype=object)
    for b in range(n):
        for o in range(c_out):
            g = o // per_group
            for r in range(out_h):
                for c in range(out_w):
                    y[b, o, r, c] = sum(
                        int(x[b, g * c_per_group + ci, r * strides[0] + i * dilations[0],
                              c * strides[1] + j * dilations[1]]) * int(w[o, ci, i, j])
                        for ci in range(c_per_group) for i in range(kh) for j in range(kw))
    return y.reshape(n, c_out, -1)


@pytest.mark.parametrize("c_in, c_out, group, kernel, strides, dilations", [
    (4, 4, 4, 3, (1, 1), (1, 1)),  # depthwise
    (3, 6, 3, 3, (2, 1), (1, 2)),  # depthwise with a channel multiplier of 2
    (4, 6, 2, 2, (1, 2), (2, 1)),  # two groups of two input channels
    (3, 5, 1, 1, (1, 1), (1, 1)),  # dense 1x1
])
def test_conv_accumulate_against_direct_loops(c_in, c_out, group, kernel, strides, dilations):
    from qtool.ops.conv import conv_accumulate

    rng = np.random.default_rng(c_in * 10 + c_out)
    x = rng.integers(0, 256, size=(2, c_in, 7, 8)).astype(np.uint8)
    w = rng.integers(-128, 128, size=(c_out, c_in // group, kernel, kernel)).astype(np.int8)
    acc, out_h, out_w = conv_accumulate(x, w, group, strides, dilations)
    expected = _naive_conv(x, w, group, strides, dilations)
    assert acc.shape == expected.shape and acc.shape[2] == out_h * out_w
    assert (acc == expected.astype(np.int64)).all()


# -- Conv on float32 where the weights bound the sums (ConvPlan) -------------------------------------

def _conv_params(weight, bias, multiplier, rshift, zero_in=0, zero_out=0, pads=(0, 0, 0, 0), strides=(1, 1),
                 dilations=(1, 1), group=1, dtype="int8"):
    c_out = weight.shape[0]
    return ConvParams(weight=weight, bias=np.broadcast_to(np.asarray(bias, np.int64), (c_out,)).copy(),
                      requant=Requant(np.broadcast_to(np.asarray(multiplier, np.int64), (c_out,)).copy(),
                                      np.broadcast_to(np.asarray(rshift, np.int64), (c_out,)).copy()),
                      zero_in=zero_in, zero_out=zero_out, pads=pads, strides=strides, dilations=dilations,
                      group=group, rounding="half_up", dtype=dtype)


@pytest.fixture(params=["numpy", "onnxruntime", "onnxruntime float"])
def conv_engine(request, monkeypatch):
    """Each float32 Conv test on every way of summing: numpy's (taps, BLAS), onnxruntime's
    ConvInteger (dense convs; else its Conv) and onnxruntime's Conv alone."""
    from qtool.ops import ortconv

    monkeypatch.setattr(ortconv, "ENABLED", request.param != "numpy")
    monkeypatch.setattr(ortconv, "INTEGER", request.param == "onnxruntime")
    return request.param


@pytest.fixture(params=["numpy", "compiled"])
def requant_form(request, monkeypatch):
    """Each float32 Conv test with the requantization in numpy and as a compiled loop (numba)."""
    from qtool.ops import compiled

    if request.param == "compiled" and not compiled.available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(compiled, "ENABLED", request.param == "compiled")
    return request.param


@pytest.mark.parametrize("dtype, x_value, k, fast", [
    # sum of |products| = k * 127 * max|x| against float32's 2**24: 1032 * 127 * 128 = 16,776,192
    ("int8", -128, 1032, True), ("int8", -128, 1033, False),
    ("uint8", 255, 518, True), ("uint8", 255, 519, False),  # 518 * 127 * 255 = 16,774,930
])
def test_conv_float32_path_is_exact_at_its_bound(dtype, x_value, k, fast, conv_engine, requant_form):
    from qtool.ops.conv import ConvPlan

    # a 1x1 conv over k channels with every product at its largest: int32 output at scale 1 shows the
    # accumulator itself (M / 2**r = 2**30 / 2**30)
    weight = np.full((2, k, 1, 1), 127, dtype=np.int8)
    weight[1, ::2] = -127  # the second channel's partial sums swing, the total is small
    p = _conv_params(weight, [5, -5], 2**30, 30, dtype="int32")
    plan = REGISTRY["Conv"].specialize(p, [(1, k, 2, 3)])
    assert (np.dtype(dtype) in plan.tails) == fast
    x = np.full((1, k, 2, 3), x_value, dtype=dtype)
    want = [x_value * 127 * k + 5, x_value * 127 * (k // 2) - x_value * 127 * (k - k // 2) - 5]
    got = REGISTRY["Conv"].run(plan, x)
    assert got.dtype == np.int32 and got[0, :, 0, 0].tolist() == want
    assert isinstance(plan, ConvPlan)
    assert (plan.engine(np.dtype(dtype)) is not None) == (fast and conv_engine != "numpy")


def test_depthwise_float32_taps_are_exact_at_their_bound(conv_engine, requant_form):
    # 32x32 taps of 127 on -128: 1024 * 16256 = 16,646,144, just below 2**24 (a 33x33 kernel is not);
    # the padding is Z_x = -128 too, so every output, border included, is the full sum
    for size, fast in ((32, True), (33, False)):
        weight = np.full((2, 1, size, size), 127, dtype=np.int8)
        p = _conv_params(weight, 0, 2**30, 30, group=2, pads=(1, 1, 1, 1), zero_in=-128, dtype="int32")
        plan = REGISTRY["Conv"].specialize(p, [(1, 2, size, size)])
        assert (np.dtype("int8") in plan.tails) == fast
        got = REGISTRY["Conv"].run(plan, np.full((1, 2, size, size), -128, dtype=np.int8))
        assert got.shape == (1, 2, 3, 3) and (got == -128 * 127 * size * size).all()
        assert (plan.engine(np.dtype("int8")) is not None) == (fast and conv_engine != "numpy")


@pytest.mark.parametrize("c_in, c_out, group, kernel, strides, dilations, pads, method", [
    (4, 4, 4, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), "depthwise_rows"),
    (4, 4, 4, (2, 3), (1, 1), (2, 2), (0, 2, 1, 0), "depthwise_rows"),  # dilated, uneven pads
    (3, 6, 3, (3, 2), (2, 1), (1, 2), (0, 1, 2, 0), "depthwise"),  # strided, channel multiplier 2
    (3, 6, 3, (3, 2), (1, 1), (1, 2), (0, 1, 2, 0), "depthwise_rows"),  # channel multiplier 2
    (1, 3, 1, (2, 2), (1, 1), (1, 1), (1, 0, 0, 1), "depthwise_rows"),  # one input channel, multiplier 3
    (1, 6, 1, (1, 4), (1, 2), (1, 1), (0, 0, 0, 0), "im2col"),  # one input channel, strided (an STFT)
    (4, 6, 2, (2, 2), (1, 2), (2, 1), (1, 1, 0, 0), "im2col"),  # two groups of two input channels
    (5, 3, 1, (1, 1), (1, 1), (1, 1), (0, 0, 0, 0), "pointwise"),
    (5, 3, 1, (1, 1), (2, 1), (1, 1), (1, 0, 1, 0), "im2col"),  # 1x1 with stride and pads
    (6, 2, 1, (3, 2), (1, 1), (2, 1), (2, 1, 0, 1), "taps"),  # fewer outputs than inputs, stride 1
    (2, 5, 1, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), "im2col"),  # more outputs than inputs
    (6, 2, 1, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), "im2col"),  # strided
])
@pytest.mark.parametrize("dtype", ["int8", "uint8"])
@pytest.mark.parametrize("summing", ["numpy, channels first", "numpy, channels last", "onnxruntime",
                                     "onnxruntime float"])
@pytest.mark.parametrize("threads", [1, 3])
def test_conv_float32_paths_equal_the_scanned_path(c_in, c_out, group, kernel, strides, dilations, pads,
                                                   method, dtype, summing, threads, requant_form, monkeypatch):
    from qtool.ops import conv, ortconv, parallel

    monkeypatch.setattr(ortconv, "ENABLED", summing.startswith("onnxruntime"))
    monkeypatch.setattr(ortconv, "INTEGER", summing == "onnxruntime")
    monkeypatch.setattr(conv, "CHANNELS_LAST_FROM", 1 if summing.endswith("last") else 10**9)
    monkeypatch.setattr(parallel, "WORKERS", threads)  # output rows in 3 ranges, on the pool
    monkeypatch.setattr(parallel, "SPLIT_FROM", 0)
    rng = np.random.default_rng(c_in * 100 + c_out * 10 + kernel[0])
    lo, hi = (-128, 127) if dtype == "int8" else (0, 255)
    weight = rng.integers(-127, 128, size=(c_out, c_in // group, *kernel)).astype(np.int8)
    x = rng.integers(lo, hi + 1, size=(2, c_in, 7, 8)).astype(dtype)
    x[0, :, :2] = lo  # extremes
    x[1, :, -2:] = hi
    p = _conv_params(weight, rng.integers(-5000, 5000, c_out), rng.integers(2**30, 2**31, c_out),
                     rng.integers(8, 20, c_out), zero_in=int(rng.integers(lo, hi + 1)), zero_out=3, pads=pads,
                     strides=strides, dilations=dilations, group=group)
    plan = REGISTRY["Conv"].specialize(p, [x.shape])
    assert plan.method.startswith(method) and np.dtype(dtype) in plan.tails
    assert len(plan.row_parts) == min(threads, plan.out_hw[0])
    got = REGISTRY["Conv"].run(plan, x)
    want = conv.run_scanned(p, x)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got == want).all()
    engine = plan.engine(np.dtype(dtype))
    assert (engine is not None) == summing.startswith("onnxruntime")
    if engine is not None:  # ConvInteger for a dense conv unless switched off; Conv otherwise
        assert engine.integer == (summing == "onnxruntime" and group == 1)


def test_conv_scans_only_channels_whose_bias_may_overflow(monkeypatch):
    # channel 0's bias is 100 below int32's top: positive sums above 100 overflow, the executor must
    # still say so; channel 1 has all-zero weights and a saturated bias, its output is constant
    from qtool.ops import parallel

    monkeypatch.setattr(parallel, "SPLIT_FROM", 0)  # the overflow is in the second row range
    weight = np.zeros((2, 3, 1, 1), dtype=np.int8)
    weight[0] = 1
    p = _conv_params(weight, [2**31 - 1 - 100, -(2**31)], 2**30, 60)
    plan = REGISTRY["Conv"].specialize(p, [(1, 3, 2, 2)])
    assert plan.tails[np.dtype("int8")].unproven.tolist() == [0]
    ok = np.full((1, 3, 2, 2), 33, dtype=np.int8)  # sum 99
    from qtool.ops.conv import run_scanned

    assert (REGISTRY["Conv"].run(plan, ok) == run_scanned(p, ok)).all()
    over = ok.copy()
    over[0, :, 1, 1] = 34  # sum 102
    with pytest.raises(OverflowError, match="accumulator"):
        REGISTRY["Conv"].run(plan, over)


# -- MatMul and Gemm with a constant B on float32 (MatMulPlan) -----------------------------------------

@pytest.mark.parametrize("dtype, x_value, k, fast", [
    ("int8", -128, 1032, True), ("int8", -128, 1033, False),  # k * 127 * 128 against 2**24
    ("uint8", 255, 518, True), ("uint8", 255, 519, False),  # k * 127 * 255
])
def test_matmul_float32_path_is_exact_at_its_bound(dtype, x_value, k, fast):
    weight = np.full((k, 2), 127, dtype=np.int8)
    weight[::2, 1] = -127  # the second column's partial sums swing
    p = MatMulParams(weight=weight, bias=np.array([3, -3]), zero_out=0, rounding="half_up", dtype="int32",
                     requant=Requant(np.full(2, 2**30), np.full(2, 30)))
    plan = REGISTRY["MatMul"].specialize(p, [(2, 3, k)])
    assert (np.dtype(dtype) in plan.tails) == fast
    got = REGISTRY["MatMul"].run(plan, np.full((2, 3, k), x_value, dtype=dtype))
    want = [x_value * 127 * k + 3, x_value * 127 * (k // 2) - x_value * 127 * (k - k // 2) - 3]
    assert got.shape == (2, 3, 2) and (got.reshape(-1, 2) == want).all()


@pytest.mark.parametrize("op_type, shape", [("MatMul", (2, 5, 7)), ("MatMul", (7,)), ("Gemm", (9, 7))])
@pytest.mark.parametrize("dtype", ["int8", "uint8"])
@pytest.mark.parametrize("threads", [1, 3])
def test_matmul_float32_path_equals_the_scanned_path(op_type, shape, dtype, threads, monkeypatch):
    from qtool.ops import gemm, parallel

    monkeypatch.setattr(parallel, "WORKERS", threads)
    monkeypatch.setattr(parallel, "SPLIT_FROM", 0)
    rng = np.random.default_rng(len(shape) * 10 + threads)
    lo, hi = (-128, 127) if dtype == "int8" else (0, 255)
    weight = rng.integers(-127, 128, (7, 4)).astype(np.int8)
    p = MatMulParams(weight=weight, bias=rng.integers(-5000, 5000, 4), zero_out=-3, rounding="half_up",
                     requant=Requant(rng.integers(2**30, 2**31, 4), rng.integers(8, 20, 4)), dtype="int8")
    x = rng.integers(lo, hi + 1, shape).astype(dtype)
    plan = REGISTRY[op_type].specialize(p, [x.shape])
    assert np.dtype(dtype) in plan.tails
    got = REGISTRY[op_type].run(plan, x)
    want = gemm.run_scanned(p, x)
    assert got.shape == want.shape and got.dtype == want.dtype and (got == want).all()


@pytest.mark.parametrize("op_type, shape", [("MatMul", (2, 5, 40)), ("Gemm", (9, 40))])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("numba_on", [True, False])
def test_matmul_int16_input_in_float64_equals_the_scanned_path(op_type, shape, threads, numba_on, monkeypatch):
    from qtool.ops import compiled, gemm, parallel

    monkeypatch.setattr(parallel, "WORKERS", threads)
    monkeypatch.setattr(parallel, "SPLIT_FROM", 0)
    monkeypatch.setattr(compiled, "ENABLED", numba_on)
    rng = np.random.default_rng(len(shape) * 10 + threads)
    weight = rng.integers(-127, 128, (40, 6)).astype(np.int8)
    p = MatMulParams(weight=weight, bias=rng.integers(-2**20, 2**20, 6), zero_out=5, rounding="half_up",
                     requant=Requant(rng.integers(2**30, 2**31, 6), rng.integers(38, 46, 6)), dtype="int16")
    # the extremes of int16 (high byte -128 or 127, low byte 0 or 255) and random values
    x = rng.choice(np.array([-32768, -32767, -256, -255, -1, 0, 1, 255, 256, 32767], np.int16), size=shape)
    x.reshape(-1, 40)[0] = rng.integers(-32768, 32768, 40)
    plan = REGISTRY[op_type].specialize(p, [x.shape])
    assert np.dtype(np.int16) not in plan.tails and plan.split16 is not None
    got = REGISTRY[op_type].run(plan, x)
    want = gemm.run_scanned(p, x)
    assert got.shape == want.shape and got.dtype == want.dtype and (got == want).all()
    assert len(np.unique(got)) > 10  # not all saturated
    # weights whose sums may leave int32 (multipliers narrowed for 64-bit sums): the exact path's
    # integers, where the float64 product would have to scan them
    heavy = dataclasses.replace(p, weight=np.full((600, 6), 127, np.int8), requant=narrowed(
        p.requant, np.full(6, 600 * 127 * 32768 + 2**20)))
    plan = REGISTRY[op_type].specialize(heavy, [(2, 600)])
    assert plan.split16 is not None and plan.split16.unproven.size
    x = np.full((2, 600), 32767, np.int16)
    x[1] = rng.integers(-32768, 32768, 600)
    assert (REGISTRY[op_type].run(plan, x) == gemm.run_scanned(heavy, x)).all()
