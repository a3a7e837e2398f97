"""Layout ops, Resize, ConvTranspose and MatMul of two activations: golden vectors computed by
hand, then derivations against hand-computed parameters."""

import dataclasses

import numpy as np
import pytest
from onnx import helper

from qtool.fixedpoint import Requant
from qtool.ops import REGISTRY, NodeView, Operand, Rescale, Unsupported, Weight
from qtool.ops.convtranspose import ConvTransposeParams
from qtool.ops.gemm import ActMatMulParams
from qtool.ops.layout import PadParams, SliceParams, SplitParams, pad_value
from qtool.ops.resize import (CUBIC_BITS, FRACTION_BITS, RUN_TIME_PLANS, cubic_coefficients, cubic_taps, linear_taps, nearest_index,
                              original_coordinates)
from qtool.qparams import QParams

IDENTITY = Rescale(0, 0, None, "half_up", "int8")


def i8(x):
    return np.array(x, dtype=np.int8)


def _view(node, inputs, output, bits=32, outputs=None, rounding="half_up"):
    return NodeView(node, inputs, output, rounding, bits, outputs=outputs or [])


def _raw(value):
    return Operand(None, np.asarray(value))


X = Operand(QParams(0.5, 0))  # an activation at the output's (S, Z) below
Y = QParams(0.5, 0)


# -- data movement ------------------------------------------------------------------------------

def test_transpose_squeeze_unsqueeze_by_hand():
    x = i8([[1, 2, 3], [4, 5, 6]])
    p = REGISTRY["Transpose"].derive(_view(helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0]), [X], Y))
    assert REGISTRY["Transpose"].run(p, x).tolist() == [[1, 4], [2, 5], [3, 6]]
    p = REGISTRY["Transpose"].derive(_view(helper.make_node("Transpose", ["x"], ["y"]), [X], Y))
    assert REGISTRY["Transpose"].run(p, x[None]).shape == (3, 2, 1)  # no perm: reversed

    node = helper.make_node("Squeeze", ["x", "axes"], ["y"])
    p = REGISTRY["Squeeze"].derive(_view(node, [X, _raw([-2])], Y))
    assert REGISTRY["Squeeze"].run(p, i8([[[7], [8]]]).reshape(1, 2, 1, 1)).tolist() == [[[7], [8]]]
    node = helper.make_node("Unsqueeze", ["x", "axes"], ["y"])
    p = REGISTRY["Unsqueeze"].derive(_view(node, [X, _raw([0, -1])], Y))
    y = REGISTRY["Unsqueeze"].run(p, i8([7, 8]))
    assert y.shape == (1, 2, 1) and y.dtype == np.int8 and y.ravel().tolist() == [7, 8]


def test_slice_clamps_like_onnx():
    x = np.arange(10, dtype=np.int8)
    cases = [((8,), (1,), None, (-3,), [8, 5, 2]),
             ((2,), (-100,), None, (-1,), [2, 1, 0]),  # end clamps to "before 0"
             ((-100,), (100,), None, None, list(range(10))),
             ((-3,), (2**62,), (0,), (2,), [7, 9])]
    for starts, ends, axes, steps, want in cases:
        assert REGISTRY["Slice"].run(SliceParams(IDENTITY, starts, ends, axes, steps), x).tolist() == want
    m = np.arange(12, dtype=np.int8).reshape(3, 4)
    p = SliceParams(IDENTITY, (1, 3), (3, -100), (-1, 0), (1, -2))  # columns 1..2; rows 2, 0
    assert REGISTRY["Slice"].run(p, m).tolist() == [[9, 10], [1, 2]]


def test_slice_derivation_needs_constant_inputs():
    node = helper.make_node("Slice", ["x", "starts", "ends"], ["y"])
    p = REGISTRY["Slice"].derive(_view(node, [X, _raw([1]), _raw([3])], Y))
    assert (p.starts, p.ends, p.axes, p.steps) == ((1,), (3,), None, None)
    with pytest.raises(Unsupported, match="constant"):
        REGISTRY["Slice"].derive(_view(node, [X, Operand(None, None), _raw([3])], Y))


def test_split_sizes_equal_parts_and_per_output_rescale():
    x = np.arange(6, dtype=np.int8)
    assert [a.tolist() for a in REGISTRY["Split"].run(SplitParams((IDENTITY,) * 3, 0, (1, 2, 3)), x)] == \
        [[0], [1, 2], [3, 4, 5]]
    assert [a.tolist() for a in REGISTRY["Split"].run(SplitParams((IDENTITY,) * 2, -1, None), x)] == \
        [[0, 1, 2], [3, 4, 5]]
    # second output at twice the scale, Z = 1: [3, 4, 5] * 0.5 / 1.0 -> 1.5, 2, 2.5 -> 2, 2, 3 (half up)
    node = helper.make_node("Split", ["x"], ["a", "b"], axis=0)
    outs = [QParams(0.5, 0), QParams(1.0, 1)]
    p = REGISTRY["Split"].derive(_view(node, [X], outs[0], outputs=outs))
    a, b = REGISTRY["Split"].run(p, x)
    assert a.tolist() == [0, 1, 2] and b.tolist() == [3, 3, 4]


def test_concat_rescales_each_input_to_the_output():
    # a at the output's (0.5, 0): unchanged; b (0.25, Z 1): q 5 is real 1.0 -> 2; q -3 is -1.0 -> -2
    node = helper.make_node("Concat", ["a", "b"], ["y"], axis=0)
    p = REGISTRY["Concat"].derive(_view(node, [Operand(QParams(0.5, 0)), Operand(QParams(0.25, 1))], Y))
    assert p.rescales[0].requant is None and p.rescales[1].requant is not None
    assert REGISTRY["Concat"].run(p, i8([2, 4]), i8([5, -3])).tolist() == [2, 4, 2, -2]


def test_pad_value_quantized_at_the_output():
    y = QParams(0.25, -3)
    assert pad_value(0.0, y) == -3  # real zero is Z_y
    assert pad_value(0.7, y) == 0  # 2.8 -> 3, - 3
    assert pad_value(0.625, y) == -1  # 2.5 -> 2 (half to even, as QuantizeLinear), - 3
    assert pad_value(0.875, y) == 1  # 3.5 -> 4, - 3
    assert pad_value(100.0, y) == 127 and pad_value(-100.0, y) == -128  # saturates
    node = helper.make_node("Pad", ["x", "pads", "value"], ["y"])
    p = REGISTRY["Pad"].derive(_view(node, [Operand(y), _raw([1, 0, 0, 2]), _raw(np.float32(0.7))], y))
    assert (p.pads, p.mode, p.fill) == ((1, 0, 0, 2), "constant", 0)
    node = helper.make_node("Pad", ["x", "pads"], ["y"])
    assert REGISTRY["Pad"].derive(_view(node, [Operand(y), _raw([1, 1])], y)).fill == -3


def test_pad_modes_by_hand():
    x = i8([1, 2, 3])
    run = REGISTRY["Pad"].run
    assert run(PadParams(IDENTITY, (2, 1), None, "constant", -7), x).tolist() == [-7, -7, 1, 2, 3, -7]
    assert run(PadParams(IDENTITY, (2, 1), None, "reflect", 0), x).tolist() == [3, 2, 1, 2, 3, 2]
    assert run(PadParams(IDENTITY, (2, 1), None, "edge", 0), x).tolist() == [1, 1, 1, 2, 3, 3]
    assert run(PadParams(IDENTITY, (-1, 2), None, "constant", 9), x).tolist() == [2, 3, 9, 9]  # crop
    m = i8([[1, 2], [3, 4]])
    assert run(PadParams(IDENTITY, (1, 0), (-1,), "constant", 0), m).tolist() == [[0, 1, 2], [0, 3, 4]]


def test_pad_rejects_unknown_modes():
    node = helper.make_node("Pad", ["x", "pads"], ["y"], mode="mirror")
    with pytest.raises(Unsupported, match="mirror"):
        REGISTRY["Pad"].check(node, {"mode": b"mirror"})


# -- Resize ---------------------------------------------------------------------------------------

def _resize(node, x, raw, xq=QParams(0.5, 0), yq=QParams(0.5, 0), bits=32):
    op = REGISTRY["Resize"]
    setup = op.derive(_view(node, [Operand(xq), *raw], yq, bits))
    plan = op.specialize(setup, [x.shape])
    return op.run(plan, x), setup


def test_resize_nearest_ppocr_2x():
    node = helper.make_node("Resize", ["x", "roi", "scales"], ["y"], mode="nearest",
                            coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    y, _ = _resize(node, i8([[[[1, 2], [3, 4]]]]), [None, _raw(np.float32([1, 1, 2, 2]))])
    assert y.tolist() == [[[[1, 1, 2, 2], [1, 1, 2, 2], [3, 3, 4, 4], [3, 3, 4, 4]]]]


def test_resize_nearest_coordinates_and_rounding_by_hand():
    half = np.float32(0.5)
    # half_pixel, downsample by 2: coordinates 2x + 0.5 = 0.5, 2.5 -> ties
    coords = original_coordinates("half_pixel", 2, 4, half)
    assert coords.tolist() == [0.5, 2.5]
    assert nearest_index(coords, "round_prefer_floor", 4).tolist() == [0, 2]
    assert nearest_index(coords, "round_prefer_ceil", 4).tolist() == [1, 3]
    # tf_half_pixel_for_nearest, 2x: (x + 0.5) / 2 = .25, .75, 1.25, 1.75, 2.25, 2.75; ceil clamps to 2
    coords = original_coordinates("tf_half_pixel_for_nearest", 6, 3, np.float32(2))
    assert nearest_index(coords, "ceil", 3).tolist() == [1, 1, 2, 2, 2, 2]
    assert nearest_index(coords, "floor", 3).tolist() == [0, 0, 1, 1, 2, 2]
    # align_corners 3 -> 5: x * 2 / 4 = 0, .5, 1, 1.5, 2
    coords = original_coordinates("align_corners", 5, 3, np.float32(5 / 3))
    assert nearest_index(coords, "round_prefer_floor", 3).tolist() == [0, 0, 1, 1, 2]
    # pytorch_half_pixel to length 1 is coordinate 0; half_pixel would be (0.5 / 0.25) - 0.5 = 1.5
    assert original_coordinates("pytorch_half_pixel", 1, 4, np.float32(0.25)).tolist() == [0.0]
    assert original_coordinates("half_pixel", 1, 4, np.float32(0.25)).tolist() == [1.5]


def test_resize_nearest_sizes():
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="nearest")
    x = np.arange(6, dtype=np.int8).reshape(1, 1, 2, 3)
    # H 2 -> 1: half_pixel (0 + .5) * 2 - .5 = 0.5 -> prefer floor 0; W 3 -> 6: (x+.5)/2-.5 -> 0,0,1,1,2,2
    # (-0.25 -> round -> 0; 0.25 -> 0; 0.75 -> 1; 1.25 -> 1; 1.75 -> 2; 2.25 -> 2)
    y, _ = _resize(node, x, [None, None, _raw(np.int64([1, 1, 1, 6]))])
    assert y.tolist() == [[[[0, 0, 1, 1, 2, 2]]]]


def test_resize_linear_by_hand():
    # half_pixel 2x on [0, 10]: coordinates -0.25 (clamped to 0), 0.25, 0.75, 1.25 (clamped to 1)
    # -> 0, 2.5, 7.5, 10 -> half up 0, 3, 8, 10; the zero points shift in and out
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear")
    raw = [None, _raw(np.float32([1, 1, 1, 2]))]
    y, setup = _resize(node, i8([[[[0, 10]]]]), raw)
    assert y.tolist() == [[[[0, 3, 8, 10]]]]
    # S_x = S_y: M / 2**rshift = 1 / 4**11 = 2**30 / 2**52, an exact shift
    assert (int(setup.requant.multiplier), int(setup.requant.rshift)) == (2**30, 52)
    y, _ = _resize(node, i8([[[[5, 15]]]]), raw, QParams(0.5, 5), QParams(0.5, -3))
    assert y.tolist() == [[[[-3, 0, 5, 7]]]]
    # output at twice the scale: 0, 1.25, 3.75, 5 -> 0, 1, 4, 5
    y, _ = _resize(node, i8([[[[0, 10]]]]), raw, QParams(0.5, 0), QParams(1.0, 0))
    assert y.tolist() == [[[[0, 1, 4, 5]]]]


def test_resize_bilinear_2d_by_hand():
    # asymmetric 2x on [[0, 4], [8, 12]]: coordinates 0, .5, 1, 1.5 (clamped to 1) on both axes
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear",
                            coordinate_transformation_mode="asymmetric")
    y, _ = _resize(node, i8([[[[0, 4], [8, 12]]]]), [None, _raw(np.float32([1, 1, 2, 2]))])
    assert y.tolist() == [[[[0, 2, 4, 4], [4, 6, 8, 8], [8, 10, 12, 12], [8, 10, 12, 12]]]]


def test_linear_weights_fixed_point():
    i0, i1, w0, w1 = linear_taps(np.float32([0, 1 / 3, 1.5, 2.9, 7]), 3)
    assert i0.tolist() == [0, 0, 1, 2, 2] and i1.tolist() == [1, 1, 2, 2, 2]
    assert w1.tolist() == [0, 683, 1024, 0, 0]  # 2048 / 3 = 682.67 -> 683; clamped to the last pixel
    assert (w0 + w1).tolist() == [2**FRACTION_BITS] * 5


def _float_linear(d: np.ndarray, out_hw, scales) -> np.ndarray:
    """Bilinear in float64 on the last two axes: half_pixel coordinates clamped to the input,
    weights from the true fractions."""
    def taps(out_len, in_len, scale):
        c = np.clip((np.arange(out_len) + 0.5) / float(scale) - 0.5, 0, in_len - 1)
        lo = np.floor(c).astype(int)
        return lo, np.minimum(lo + 1, in_len - 1), c - lo

    (ya, yb, ly), (xa, xb, lx) = (taps(o, i, s) for o, i, s in zip(out_hw, d.shape[-2:], scales))
    rows = d[..., ya, :] * (1 - ly)[:, None] + d[..., yb, :] * ly[:, None]
    return rows[..., xa] * (1 - lx) + rows[..., xb] * lx


def _float_cubic(d: np.ndarray, out_hw, scales) -> np.ndarray:
    """Cubic in float64 on the last two axes: half_pixel float32 coordinates as onnxruntime's, the
    four taps clamped to the edges, ONNX's coefficients (a = -0.75) unrounded."""
    def taps(out_len, in_len, scale):
        c = (np.arange(out_len, dtype=np.float32) + np.float32(0.5)) / np.float32(scale) - np.float32(0.5)
        base = np.floor(c.astype(np.float64))
        return np.clip(base[:, None].astype(int) + np.arange(-1, 3), 0, in_len - 1), \
            cubic_coefficients(c.astype(np.float64) - base, -0.75)

    (yi, yw), (xi, xw) = (taps(o, i, s) for o, i, s in zip(out_hw, d.shape[-2:], scales))
    rows = sum(d[..., yi[:, k], :] * yw[:, k, None] for k in range(4))
    return sum(rows[..., xi[:, k]] * xw[:, k] for k in range(4))


def test_resize_linear_lsb_bound_on_random_data():
    # Against the exact bilinear value (float64, weights from the true fractions), computed here:
    # |q - v| <= 0.5 (one rounding) + 255 / 2**11 + 510 / 4**12 (weights rounded to 11 bits).
    rng = np.random.default_rng(7)
    x = rng.integers(-128, 128, size=(2, 3, 7, 6)).astype(np.int8)
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear",
                            coordinate_transformation_mode="pytorch_half_pixel")
    scales = np.float32([1, 1, 1.7, 2.3])
    y, _ = _resize(node, x, [None, _raw(scales)], QParams(0.5, 3), QParams(0.5, 3))
    oh, ow = int(7 * np.float32(1.7)), int(6 * np.float32(2.3))
    assert y.shape == (2, 3, oh, ow)
    v = _float_linear(x.astype(np.float64) - 3, (oh, ow), scales[2:]) + 3
    err = np.abs(y - v)
    bound = 0.5 + 255 / 2**11 + 510 / 4**12
    assert err.max() <= bound + 1e-4  # float32 coordinates: about 1e-7 relative
    assert err.max() > 0.45  # the bound is not vacuous: rounding alone reaches ~0.5


def test_resize_unsupported_forms():
    op = REGISTRY["Resize"]
    for attrs, reason in [({"mode": b"area"}, "area"),
                          ({"coordinate_transformation_mode": b"tf_crop_and_resize"}, "tf_crop"),
                          ({"antialias": 1}, "antialias")]:
        node = helper.make_node("Resize", ["x", "", "scales"], ["y"])
        with pytest.raises(Unsupported, match=reason):
            op.check(node, attrs)
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear")
    with pytest.raises(Unsupported, match="last two axes"):
        op.derive(_view(node, [X, None, _raw(np.float32([1, 2, 2, 2]))], Y))
    cubic = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="cubic")
    with pytest.raises(Unsupported, match="cubic Resize only on the last two axes"):
        op.derive(_view(cubic, [X, None, _raw(np.float32([1, 2, 2, 2]))], Y))
    with pytest.raises(Unsupported, match="roi"):
        op.derive(_view(helper.make_node("Resize", ["x", "roi", "scales"], ["y"]),
                        [X, Operand(None, None), _raw(np.float32([1, 1, 2, 2]))], Y))


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_targets_computed_at_run_time_give_the_constant_targets_result(mode):
    # a decoder's sizes come from a Shape node: the plan is made at run time for what arrives
    op = REGISTRY["Resize"]
    x = np.random.default_rng(3).integers(-128, 128, (2, 3, 5, 4)).astype(np.int8)
    for index, target in [(2, np.float32([1, 1, 2, 1.5])), (3, np.int64([2, 3, 9, 7]))]:
        inputs = ["x", "", "scales", "sizes"][:index + 1]
        if index == 3:
            inputs[2] = ""
        node = helper.make_node("Resize", inputs, ["y"], mode=mode)
        fixed = op.derive(_view(node, [X, None] + [None] * (index - 2) + [_raw(target)], Y))
        late = op.derive(_view(node, [X, None] + [None] * (index - 2) + [Operand(None, None)], Y))
        assert late.at_run and not fixed.at_run and late.named == (index,)
        want = op.run(op.specialize(fixed, [x.shape, target.shape]), x, target)
        plan = op.specialize(late, [x.shape, target.shape])
        got = op.run(plan, x, target)
        assert got.dtype == want.dtype and np.array_equal(got, want)
        assert got.shape[-2:] != x.shape[-2:]
        op.run(plan, x, target)
        assert len(plan.plans) == 1  # the same shape and target: the plan made once
        if index == 3:  # ever new sizes: the plans kept stay bounded
            for width in range(4, 44):
                op.run(plan, x, np.int64([2, 3, 9, width]))
            assert len(plan.plans) == RUN_TIME_PLANS
    if mode != "nearest":
        node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode=mode)
        late = op.derive(_view(node, [X, None, None, Operand(None, None)], Y))
        plan = op.specialize(late, [x.shape, (4,)])
        with pytest.raises(ValueError, match=r"^Resize .*changes a leading axis"):
            op.run(plan, x, np.int64([2, 6, 10, 8]))
        with pytest.raises(ValueError, match=r"^Resize scales must be positive"):
            op.run(op.specialize(op.derive(_view(helper.make_node("Resize", ["x", "", "s"], ["y"], mode=mode),
                                                 [X, None, Operand(None, None)], Y)), [x.shape, (4,)]),
                   x, np.float32([1, 1, 0, 2]))


def test_cubic_weights_by_hand():
    # a = -0.75 at t = 0.5: (-0.09375, 0.59375, 0.59375, -0.09375); t = 0: (0, 1, 0, 0); the rows
    # sum to 2**CUBIC_BITS exactly, the largest weight taking the rounding remainder
    w = cubic_coefficients(np.array([0.5, 0.0, 0.25]), -0.75)
    assert np.allclose(w[0], [-0.09375, 0.59375, 0.59375, -0.09375]) and w[1].tolist() == [0, 1, 0, 0]
    assert np.allclose(w.sum(axis=1), 1.0)
    index, iw = cubic_taps(np.float32([-0.25, 0.5, 2.75]), 3, -0.75, False)
    assert index.tolist() == [[0, 0, 0, 1], [0, 0, 1, 2], [1, 2, 2, 2]]  # clamped to the edges
    assert (iw.sum(axis=1) == 2**CUBIC_BITS).all()
    # exclude_outside: taps beyond the input weigh 0, the rest scaled to sum to 1
    index, iw = cubic_taps(np.float32([0.5]), 3, -0.75, True)
    assert iw[0, 0] == 0 and iw.sum() == 2**CUBIC_BITS
    assert abs(iw[0, 1] / 2**CUBIC_BITS - 0.59375 / (1 + 0.09375)) < 2**-CUBIC_BITS


def test_resize_cubic_against_float64_on_random_data():
    # against the cubic value in float64 (the same taps and ONNX coefficients, unrounded): within
    # the one final rounding plus the weights' rounding (8 * 2**-17 of the 255-step span); values
    # past the input's range saturate, as the output type does
    rng = np.random.default_rng(5)
    x = rng.integers(-128, 128, size=(2, 3, 7, 6)).astype(np.int8)
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="cubic",
                            coordinate_transformation_mode="half_pixel")
    scales = np.float32([1, 1, 1.7, 2.3])
    y, _ = _resize(node, x, [None, _raw(scales)], QParams(0.5, 3), QParams(0.5, 3))
    oh, ow = int(7 * np.float32(1.7)), int(6 * np.float32(2.3))
    assert y.shape == (2, 3, oh, ow)
    v = np.clip(_float_cubic(x.astype(np.float64) - 3, (oh, ow), scales[2:]) + 3, -128, 127)
    err = np.abs(y - v)
    assert err.max() <= 0.5 + 255 * 8 * 2.0**-17 + 1e-4
    assert err.max() > 0.45  # the bound is not vacuous: rounding alone reaches ~0.5


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_int16_interpolates_full_range_values_within_one_lsb(mode):
    # int16 sums pass int32 (32767 * 4**11 for linear): the multiplier is narrowed, no overflow;
    # against float64 bilinear/cubic on the same integers, S_x = S_y: within the final rounding
    rng = np.random.default_rng(8)
    x = rng.choice(np.int16([-32768, -32767, 32767, 0, 12345]), size=(1, 2, 5, 4)).astype(np.int16)
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode=mode)
    q = QParams(0.001, 0, "int16")
    y, _ = _resize(node, x, [None, _raw(np.float32([1, 1, 2, 2]))], q, q)
    assert y.dtype == np.int16 and y.shape == (1, 2, 10, 8)
    d = x.astype(np.float64)
    if mode == "linear":
        # 2x fractions (1/4, 3/4) are exact in 11 bits and S_x = S_y: one rounding, half up
        assert np.abs(y - _float_linear(d, (10, 8), (2, 2))).max() <= 0.5 + 1e-9
    else:  # saturated as int16 saturates; within the weights' 16-bit rounding
        v = np.clip(_float_cubic(d, (10, 8), (2, 2)), -32768, 32767)
        assert np.abs(y - v).max() <= 0.5 + 65535 * 8 * 2.0**-17
    assert int(np.abs(y.astype(np.int64)).max()) > 2**14  # full-range values went through


# -- ConvTranspose -------------------------------------------------------------------------------

def _ct_params(weight, zero_in=0, bias=None, pads=(0, 0, 0, 0), strides=(1, 1), dilations=(1, 1),
               output_padding=(0, 0), group=1, requant=None):
    weight = i8(weight)
    c_in, per_group, kh, kw = weight.shape
    c_out = per_group * group
    conv = (weight.astype(np.int64).reshape(group, c_in // group, per_group, kh, kw)
            .transpose(0, 2, 1, 3, 4).reshape(c_out, c_in // group, kh, kw))
    requant = requant or Requant(np.full(c_out, 2**30), np.full(c_out, 30))  # x1
    return ConvTransposeParams(weight, conv.sum(axis=1), np.zeros(c_out, np.int64) if bias is None
                               else np.array(bias), requant, zero_in, 0, pads, strides, dilations,
                               output_padding, group, "half_up", "int8")


def test_convtranspose_stride_1_full_correlation():
    # 2x2 input, 2x2 ones kernel: every input pixel adds itself to a 2x2 block of the 3x3 output
    y = REGISTRY["ConvTranspose"].run(_ct_params([[[[1, 1], [1, 1]]]]), i8([[[[1, 2], [3, 4]]]]))
    assert y.tolist() == [[[[1, 3, 2], [4, 10, 6], [3, 7, 4]]]]


def test_convtranspose_ppocr_stride_2_kernel_2():
    # no overlap: output block (i, j) is x[i, j] * w
    p = _ct_params([[[[1, 2], [3, 4]]]], bias=[1], strides=(2, 2))
    y = REGISTRY["ConvTranspose"].run(p, i8([[[[1, 2], [3, 4]]]]))
    assert y.tolist() == [[[[2, 3, 3, 5], [4, 5, 7, 9], [4, 7, 5, 9], [10, 13, 13, 17]]]]


def test_convtranspose_input_zero_point_counts_only_reached_taps():
    # the same real input [[1, 2], [3, 4]] stored with Z_x = 2: each output pixel receives a
    # different set of taps, so the compensation -2 * sum(reached q_w) varies per pixel
    p = _ct_params([[[[1, 2], [3, 4]]]], zero_in=2, bias=[1], strides=(2, 2))
    y = REGISTRY["ConvTranspose"].run(p, i8([[[[3, 4], [5, 6]]]]))
    assert y.tolist() == [[[[2, 3, 3, 5], [4, 5, 7, 9], [4, 7, 5, 9], [10, 13, 13, 17]]]]
    # stride 1, pads 1 crop the border: output is the centre of the 3x3 full result
    p = _ct_params([[[[1, 1], [1, 1]]]], zero_in=-5, pads=(1, 1, 0, 0))
    y = REGISTRY["ConvTranspose"].run(p, i8([[[[-4, -3], [-2, -1]]]]))
    assert y.tolist() == [[[[10, 6], [7, 4]]]]


def test_convtranspose_pads_output_padding_dilation():
    # 1-D along W (H = 1): x [1, 2], w [1, 10], stride 2, dilation 2: taps at 0 and 2 of each
    # input pixel: pixel 0 -> positions 0, 2; pixel 1 -> 2, 4. Full length (2-1)*2 + 2*1 + 1 = 5,
    # + output_padding 1 = 6: [1, 0, 10 + 2, 0, 20, 0]; pads left 1, right 2 -> [0, 12, 0]
    p = _ct_params([[[[1, 10]]]], strides=(1, 2), dilations=(1, 2), output_padding=(0, 1),
                   pads=(0, 1, 0, 2))
    assert REGISTRY["ConvTranspose"].run(p, i8([[[[1, 2]]]])).tolist() == [[[[0, 12, 0]]]]


def test_convtranspose_groups_by_hand():
    # group 2, C_in 2, one output channel per group: channel g reads only input channel g
    p = _ct_params([[[[2]]], [[[-3]]]], group=2, strides=(2, 2))
    y = REGISTRY["ConvTranspose"].run(p, i8([[[[1, 2]], [[3, 4]]]]))
    assert y.tolist() == [[[[2, 0, 4]], [[-9, 0, -12]]]]


def test_convtranspose_derivation_by_hand():
    # S_x 0.5, Z_x 3; weight [C_in 4, 1 per group... ] group 2 -> C_out 2 * 2 = 4 channels
    # per-channel scales along axis 1: [0.25, 0.125] for channels (0, 2) and (1, 3);
    # S_y 0.125 -> S_x*S_w/S_y = [1, 0.5, 1, 0.5] -> (2**30, 30), (2**30, 31)
    w = i8(np.arange(4 * 2 * 1 * 2).reshape(4, 2, 1, 2) - 6)
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], group=2, strides=[2, 2])
    bias_scale = np.float32([0.125, 0.0625, 0.125, 0.0625])
    view = _view(node, [Operand(QParams(0.5, 3)),
                        Operand(QParams(np.float32([0.25, 0.125]), np.zeros(2, np.int64), "int8", 1), w),
                        Operand(QParams(bias_scale, np.zeros(4, np.int64), "int32", 0),
                                np.array([8, -4, 0, 16], np.int32))],
                 QParams(0.125, -5))
    p = REGISTRY["ConvTranspose"].derive(view)
    assert p.requant.multiplier.tolist() == [2**30] * 4 and p.requant.rshift.tolist() == [30, 31, 30, 31]
    # the bias stays in accumulator units; the zero-point term is per pixel (tap sums below)
    assert p.bias.tolist() == [8, -4, 0, 16]
    # tap sums: output channel g*2 + c sums w[ci, c] over the group's input channels ci
    # w[:, :, 0, :] = [[-6,-5],[-4,-3]], [[-2,-1],[0,1]], [[2,3],[4,5]], [[6,7],[8,9]]
    assert p.tap_sums[:, 0].tolist() == [[-8, -6], [-4, -2], [8, 10], [12, 14]]
    assert (p.zero_in, p.zero_out, p.strides, p.group) == (3, -5, (2, 2), 2)


def test_convtranspose_weight_axis_and_unsupported_forms():
    op = REGISTRY["ConvTranspose"]
    assert op.constants(helper.make_node("ConvTranspose", ["x", "w"], ["y"]))[1] == Weight(axis=1)
    assert op.constants(helper.make_node("ConvTranspose", ["x", "w"], ["y"], group=2))[1] == Weight(None)
    with pytest.raises(Unsupported, match="output_shape"):
        op.check(helper.make_node("ConvTranspose", ["x", "w"], ["y"]), {"output_shape": [4, 4]})
    with pytest.raises(Unsupported, match="SAME"):
        op.check(helper.make_node("ConvTranspose", ["x", "w"], ["y"]), {"auto_pad": b"SAME_UPPER"})


# -- MatMul of two activations ------------------------------------------------------------------

def test_act_matmul_by_hand():
    # (a - 1) = [[0, 1], [2, 3]], (b - 5) = [[0], [1]] -> [[1], [3]]; * 0.5 -> 0.5, 1.5 -> 1, 2
    # (half up); + Z_y 3 -> 4, 5
    p = ActMatMulParams(1, 5, Requant(2**30, 31), 3, "half_up", "int8")
    assert REGISTRY["MatMul"].run(p, i8([[1, 2], [3, 4]]), i8([[5], [6]])).tolist() == [[4], [5]]


def test_act_matmul_broadcasts_batches():
    rng = np.random.default_rng(3)
    a = rng.integers(-128, 128, size=(2, 1, 3, 4)).astype(np.int8)
    b = rng.integers(-128, 128, size=(1, 5, 4, 2)).astype(np.int8)
    p = ActMatMulParams(-7, 9, Requant(2**30, 40), 1, "half_up", "int8")  # * 2**-10
    y = REGISTRY["MatMul"].run(p, a, b)
    assert y.shape == (2, 5, 3, 2)
    for i in range(2):
        for j in range(5):
            for r in range(3):
                for c in range(2):
                    acc = sum((int(a[i, 0, r, k]) + 7) * (int(b[0, j, k, c]) - 9) for k in range(4))
                    assert y[i, j, r, c] == (acc + 512) // 1024 + 1  # half up


def test_act_matmul_derivation_by_hand():
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    op = REGISTRY["MatMul"]
    assert op.constants(node) == {1: Weight(axis=1, optional=True)}
    # S_a 0.5, S_b 0.25, S_y 0.0625: ratio 2.0 -> m 0.5 * 2**2 -> (2**30, 29)
    p = op.derive(_view(node, [Operand(QParams(0.5, 3)), Operand(QParams(0.25, -4))], QParams(0.0625, 7)))
    assert isinstance(p, ActMatMulParams)
    assert (p.zero_a, p.zero_b, p.zero_out) == (3, -4, 7)
    assert (int(p.requant.multiplier), int(p.requant.rshift)) == (2**30, 29)
    p8 = op.derive(_view(node, [Operand(QParams(0.5, 3)), Operand(QParams(0.25, -4))], QParams(0.0625, 7),
                         bits=8))
    assert (int(p8.requant.multiplier), int(p8.requant.rshift)) == (64, 5)  # 2.0 = 64 / 2**5
    # a per-channel operand is refused: attention operands are per tensor
    with pytest.raises(Unsupported, match="per tensor"):
        op.derive(_view(node, [Operand(QParams(0.5, 3)),
                               Operand(QParams(np.float32([0.1, 0.2]), np.zeros(2), "int8", 1))],
                        QParams(0.0625, 7)))


@pytest.mark.parametrize(("c_in, per_group, group, kernel, strides, dilations, pads, output_padding, "
                          "shuffle"), [
    (3, 2, 1, (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), (0, 0), True),  # PP-OCR's upsampling
    (4, 1, 2, (2, 3), (2, 3), (1, 1), (0, 0, 0, 0), (0, 0), True),
    (3, 2, 1, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), (1, 0), False),  # overlapping taps, cropped
    (4, 3, 2, (2, 2), (1, 2), (2, 1), (0, 1, 1, 0), (0, 1), False),
    (2, 2, 1, (2, 2), (2, 2), (1, 1), (1, 0, 0, 1), (0, 0), False),  # stride = kernel but padded
])
@pytest.mark.parametrize("dtype, zero_in", [("int8", -128), ("int8", 37), ("uint8", 0), ("uint8", 200)])
@pytest.mark.parametrize("threads", [1, 3])
def test_convtranspose_float32_path_equals_the_scanned_path(c_in, per_group, group, kernel, strides,
                                                            dilations, pads, output_padding, shuffle, dtype,
                                                            zero_in, threads, monkeypatch):
    from qtool.ops import parallel
    from qtool.ops.convtranspose import run_scanned

    monkeypatch.setattr(parallel, "WORKERS", threads)  # input rows in 3 ranges, on the pool
    monkeypatch.setattr(parallel, "SPLIT_FROM", 0)

    rng = np.random.default_rng(c_in * 7 + per_group + kernel[1])
    lo, hi = (-128, 127) if dtype == "int8" else (0, 255)
    weight = rng.integers(-127, 128, (c_in, per_group, *kernel))
    c_out = per_group * group
    p = _ct_params(weight, zero_in=zero_in, bias=rng.integers(-9000, 9000, c_out), pads=pads, strides=strides,
                   dilations=dilations, output_padding=output_padding, group=group,
                   requant=Requant(rng.integers(2**30, 2**31, c_out), rng.integers(10, 20, c_out)))
    x = rng.integers(lo, hi + 1, (2, c_in, 4, 5)).astype(dtype)
    x[0, :, 0] = lo
    x[1, :, -1] = hi
    plan = REGISTRY["ConvTranspose"].specialize(p, [x.shape])
    assert plan.shuffle == shuffle and np.dtype(dtype) in plan.tails
    got = REGISTRY["ConvTranspose"].run(plan, x)
    want = run_scanned(p, x)
    assert got.shape == want.shape and got.dtype == want.dtype and (got == want).all()


@pytest.mark.parametrize("c_in, fast", [(518, True), (519, False)])
def test_convtranspose_float32_path_is_exact_at_its_bound(c_in, fast):
    # int8 with Z_x = -128: q_x - Z_x reaches 255; 1x1 taps of 127 over c_in channels sum to
    # c_in * 32385, inside float32's 2**24 for 518 channels (16,775,430), not for 519
    p = _ct_params(np.full((c_in, 1, 1, 1), 127), zero_in=-128)
    p = type(p)(**{**p.__dict__, "dtype": "int32"})  # scale 1, int32 out: the accumulator itself
    plan = REGISTRY["ConvTranspose"].specialize(p, [(1, c_in, 1, 2)])
    assert (np.dtype("int8") in plan.tails) == fast
    y = REGISTRY["ConvTranspose"].run(plan, np.full((1, c_in, 1, 2), 127, np.int8))
    assert y.tolist() == [[[[255 * 127 * c_in] * 2]]]


@pytest.mark.parametrize("target,message", [
    (("scales", np.float32([1, 1, np.nan, 2])), "positive and finite"),
    (("scales", np.float32([1, 1, 1e-3, 2])), "empty output"),
    (("sizes", np.int64([1, 3, -2, 4])), "sizes must be positive"),
    (("sizes", np.int64([1, 3, 0, 4])), "sizes must be positive")])
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_targets_a_model_computes_badly_are_one_line_errors(target, message, mode):
    # the executor turns a ValueError starting "Resize " into a one-line error naming the node
    op = REGISTRY["Resize"]
    name, value = target
    inputs = ["x", "", "s"] if name == "scales" else ["x", "", "", "s"]
    late = op.derive(_view(helper.make_node("Resize", inputs, ["y"], mode=mode),
                           [X, None] + [None] * (len(inputs) - 3) + [Operand(None, None)], Y))
    x = np.zeros((1, 3, 5, 4), np.int8)
    with pytest.raises(ValueError, match=rf"^Resize .*{message}"):
        op.run(op.specialize(late, [x.shape, value.shape]), x, value)


@pytest.mark.parametrize("kwargs", [dict(strides=(2, 2)),  # PP-OCR's 2x2 stride 2: each pixel one tap
                                    dict(strides=(2, 2), pads=(1, 0, 0, 1), output_padding=(1, 1)),
                                    dict(group=2, strides=(1, 1), dilations=(2, 1))])
def test_convtranspose_int16_input_as_two_byte_halves_equals_the_exact_path(kwargs):
    from qtool.ops.convtranspose import ConvTransposePlan, run_scanned

    rng = np.random.default_rng(7)
    c_in, per_group = 6, 3
    kh, kw = (2, 2) if kwargs.get("strides") == (2, 2) else (3, 3)
    weight = rng.integers(-127, 128, size=(c_in, per_group, kh, kw))
    group = kwargs.get("group", 1)
    p = dataclasses.replace(_ct_params(weight, bias=rng.integers(-2**20, 2**20, size=per_group * group), **kwargs),
                            requant=Requant(np.full(per_group * group, 2**30), np.full(per_group * group, 40)),
                            dtype="int16")
    shape = (2, c_in, 5, 7)
    plan = ConvTransposePlan.of(p, shape)
    assert plan.split16 is not None and np.dtype(np.int16) not in plan.tails
    x = rng.choice(np.array([-32768, -32767, -256, -255, -1, 0, 1, 255, 256, 32767], np.int16), size=shape)
    x[0, 0] = rng.integers(-32768, 32768, size=shape[2:])
    got = REGISTRY["ConvTranspose"].run(plan, x)
    assert got.dtype == np.int16 and np.array_equal(got, run_scanned(p, x))
    assert np.abs(got.astype(np.int64)).max() > 2**10  # not all saturated or zero
    # a zero point other than 0, or weights too large for the halves: the exact path
    assert dataclasses.replace(plan, params=dataclasses.replace(p, zero_in=3)).split16 is None
