"""Elementwise integer kernels (lookup tables, Mul, Div, Clip, LeakyRelu, PRelu): golden vectors
computed by hand, then derivations against hand-computed parameters."""

import math

import numpy as np
import onnx
import pytest
from onnx import helper

from qtool.ops import REGISTRY, NodeView, Operand, Unsupported
from qtool.ops.lut import round_real
from qtool.qparams import QParams


def i8(x):
    return np.array(x, dtype=np.int8)


def u8(x):
    return np.array(x, dtype=np.uint8)


def _view(node, inputs, output, bits=32, rounding="half_up"):
    return NodeView(node, inputs, output, rounding, bits)


def _unary(op_type, x_qp, y_qp, rounding="half_up", **attrs):
    node = helper.make_node(op_type, ["x"], ["y"], **attrs)
    op = REGISTRY[op_type]
    return op, op.derive(_view(node, [Operand(x_qp)], y_qp, rounding=rounding))


def _at(op, p, q, dtype=np.int8):
    """Table entries for inputs ``q`` through the kernel."""
    return op.run(p, np.array(q, dtype=dtype)).tolist()


# -- lookup tables -----------------------------------------------------------------------------------

def test_sigmoid_table_by_hand():
    # S_x 0.5 (int8), S_y 1/256 (uint8): sigmoid(1) * 256 = 187.15 -> 187, sigmoid(-1) * 256 = 68.85
    # -> 69, sigmoid(63.5) * 256 = 256 -> saturates at 255
    op, p = _unary("Sigmoid", QParams(0.5, 0), QParams(1 / 256, 0, "uint8"))
    assert p.table.dtype == np.uint8 and p.table.shape == (256,)
    assert _at(op, p, [0, 2, -2, 127, -128]) == [128, 187, 69, 255, 0]
    assert p.table[2 - (-128)] == 187  # stored at q - qmin


def test_sigmoid_uint8_input_with_zero_point():
    # uint8 input, Z_x 128: q = 130 is x = 1 again; the table index is q itself (qmin 0)
    op, p = _unary("Sigmoid", QParams(0.5, 128, "uint8"), QParams(1 / 256, 0, "uint8"))
    assert _at(op, p, [128, 130, 126, 0, 255], np.uint8) == [128, 187, 69, 0, 255]
    assert p.table[130] == 187
    with pytest.raises(TypeError, match="uint8"):
        op.run(p, i8([0]))


def test_tanh_table_by_hand():
    # tanh(1) * 127 = 96.72, tanh(0.5) * 127 = 58.69, tanh(3.97) * 127 = 126.91
    op, p = _unary("Tanh", QParams(1 / 32, 0), QParams(1 / 127, 0))
    assert _at(op, p, [32, -32, 16, 0, 127]) == [97, -97, 59, 0, 127]


def test_erf_table_with_output_zero_point():
    # erf(1) * 127 = 107.02, erf(0.5) * 127 = 66.10; + Z_y -20, saturating at -128
    op, p = _unary("Erf", QParams(1 / 64, 0), QParams(1 / 127, -20))
    assert _at(op, p, [64, 32, -64, 0]) == [87, 46, -127, -20]
    assert _at(op, p, [-128]) == [-128]  # erf(-2) * 127 - 20 = -146.4 -> saturates


def test_hardswish_table_by_hand():
    # S 0.125 both: x = 1 -> 1 * (1/6 + 1/2) = 0.667 -> 5.33 -> 5; x = -2 -> -0.333 -> -2.67 -> -3;
    # x = 3 -> 3 -> 24; x = -3 -> 0; x = 15.875 -> itself
    op, p = _unary("HardSwish", QParams(0.125, 0), QParams(0.125, 0))
    assert _at(op, p, [8, -16, 24, -24, 127, -128]) == [5, -3, 24, 0, 127, 0]


@pytest.mark.parametrize("rounding, expected", [
    ("half_up", [3, 2, 1, 0, 4]),
    ("half_away_from_zero", [3, 2, 1, 0, 4]),
    ("half_to_even", [2, 2, 0, 0, 4]),
    ("toward_zero", [2, 2, 0, 0, 4]),  # a table rounds to nearest even in this mode (module note)
])
def test_hardsigmoid_table_rounds_ties_in_the_mode(rounding, expected):
    # alpha 0.125, beta 0.5, S_x 1, S_y 0.25: (0.125 q + 0.5) * 4 = 0.5 q + 2, clamped to [0, 4];
    # q = 1, -1, -3 are exact ties 2.5, 1.5, 0.5
    op, p = _unary("HardSigmoid", QParams(1.0, 0), QParams(0.25, 0), rounding, alpha=0.125, beta=0.5)
    assert _at(op, p, [1, -1, -3, -100, 100]) == expected


@pytest.mark.parametrize("rounding, expected", [("half_up", -11), ("half_away_from_zero", -12),
                                                 ("half_to_even", -12)])
def test_hardswish_negative_tie_follows_the_mode(rounding, expected):
    # x = -1.5 (S_x 0.5): -1.5 * (-0.25 + 0.5) = -0.375 -> / 0.25 = -1.5 exactly, + Z_y -10
    op, p = _unary("HardSwish", QParams(0.5, 0), QParams(0.25, -10), rounding)
    assert _at(op, p, [-3]) == [expected]


@pytest.mark.skipif(not onnx.defs.has("Gelu"), reason="onnx without Gelu (opset 20)")
def test_gelu_exact_and_tanh_approximation_by_hand():
    # x = -2.25 (S_x 1/16), S_y 1/128: exact gelu(x) * 128 = -3.521 -> -4; the tanh form gives
    # -3.482 -> -3; x = 0.25 -> 42.07 at S_y 1/50 in both
    op, exact = _unary("Gelu", QParams(1 / 16, 0), QParams(1 / 128, 0))
    _, approx = _unary("Gelu", QParams(1 / 16, 0), QParams(1 / 128, 0), approximate="tanh")
    assert _at(op, exact, [-36]) == [-4] and _at(op, approx, [-36]) == [-3]
    _, coarse = _unary("Gelu", QParams(0.25, 0), QParams(1 / 50, 0))
    assert _at(op, coarse, [4, -4, -8, 8]) == [42, -8, -2, 98]
    with pytest.raises(Unsupported, match="approximate"):
        _unary("Gelu", QParams(0.25, 0), QParams(1 / 50, 0), approximate="fast")


def test_lookup_table_per_channel_by_hand_and_refusals():
    node = helper.make_node("Sigmoid", ["x"], ["y"])
    per_channel = QParams(np.array([0.1, 0.2], np.float32), np.array([0, 3]), "int8", 1)
    p = REGISTRY["Sigmoid"].derive(_view(node, [Operand(per_channel)], QParams(1 / 256, -128)))
    x = i8([[[-128, 0, 3, 127], [-128, 0, 3, 127]]])  # [1, 2 channels, 4]
    y = REGISTRY["Sigmoid"].run(p, x)
    # channel 0: sigmoid(0.1 * q); channel 1: sigmoid(0.2 * (q - 3)); out q = round(p * 256) - 128
    by_hand = [[round(256 / (1 + math.exp(-0.1 * q))) - 128 for q in (-128, 0, 3, 127)],
               [round(256 / (1 + math.exp(-0.2 * (q - 3)))) - 128 for q in (-128, 0, 3, 127)]]
    by_hand = np.clip(by_hand, -128, 127)
    assert y.dtype == np.int8 and y[0].tolist() == by_hand.tolist()
    assert not REGISTRY["Sigmoid"].elementwise(p)  # a table per channel depends on the position
    along_rows = QParams(np.array([0.1, 0.2], np.float32), np.array([0, 0]), "int8", 0)
    with pytest.raises(Unsupported, match="per channel \\(axis 1\\)"):
        REGISTRY["Sigmoid"].derive(_view(node, [Operand(along_rows)], QParams(0.1, 0)))
    with pytest.raises(Unsupported, match="needs an 8- or 16-bit input, got int32"):
        REGISTRY["Sigmoid"].derive(_view(node, [Operand(QParams(0.1, 0, "int32"))], QParams(0.1, 0)))


def test_round_real_modes_by_hand():
    v = [2.5, -2.5, 1.5, -0.5, 0.49, -1.51]
    assert round_real(v, "half_up").tolist() == [3, -2, 2, 0, 0, -2]
    assert round_real(v, "half_away_from_zero").tolist() == [3, -3, 2, -1, 0, -2]
    assert round_real(v, "half_to_even").tolist() == [2, -2, 2, 0, 0, -2]


# -- Mul and Div ---------------------------------------------------------------------------------------

def test_mul_run_by_hand_with_broadcast():
    # a: S 0.5, Z 2; b: S 0.25, Z -1; y: S 0.125, Z 3 -> ratio 1.0 -> (2**30, 30)
    # a = [[2, -1, 0]] real, b = [[0], [2], [25.25]] real -> products / 0.125 + 3
    node = helper.make_node("Mul", ["a", "b"], ["y"])
    op = REGISTRY["Mul"]
    p = op.derive(_view(node, [Operand(QParams(0.5, 2)), Operand(QParams(0.25, -1))], QParams(0.125, 3)))
    assert (p.multiplier, p.rshift) == (2**30, 30)
    a, b = i8([[6, 0, 2]]), i8([[-1], [7], [100]])
    # row b = 2: [4, -2, 0] / 0.125 = [32, -16, 0]; row b = 25.25: [50.5, -25.25, 0] -> 404 sat, -202 sat
    assert op.run(p, a, b).tolist() == [[3, 3, 3], [35, -13, 3], [127, -128, 3]]


def test_mul_rounds_half_up():
    # a = b = S 1, y S 4 -> ratio 0.25; 3 * 2 / 4 = 1.5 -> 2; -3 * 2 / 4 = -1.5 -> -1 (half up)
    node = helper.make_node("Mul", ["a", "b"], ["y"])
    p = REGISTRY["Mul"].derive(_view(node, [Operand(QParams(1.0, 0)), Operand(QParams(1.0, 0))],
                                     QParams(4.0, 0)))
    assert (p.multiplier, p.rshift) == (2**30, 32)
    assert REGISTRY["Mul"].run(p, i8([3, -3, 5]), i8([2, 2, 2])).tolist() == [2, -1, 3]


@pytest.mark.parametrize("bits, expected", [(32, (2**30, 33)), (8, (64, 9))])
def test_mul_derivation_by_hand(bits, expected):
    # S_a S_b / S_y = 0.5 * 0.25 / 1 = 0.125: 32-bit 2**30 >> 33; 8-bit smallest rshift with
    # 0.125 * 2**(r + 1) >= 127 is 9, multiplier trunc(0.125 * 2**9) = 64
    node = helper.make_node("Mul", ["a", "b"], ["y"])
    p = REGISTRY["Mul"].derive(_view(node, [Operand(QParams(0.5, 0)), Operand(QParams(0.25, 0))],
                                     QParams(1.0, 5), bits=bits))
    assert (p.multiplier, p.rshift, p.zero_out) == (*expected, 5)


def _div(divisor, scale, y_qp, bits=32, rounding="half_up"):
    node = helper.make_node("Div", ["x", "c"], ["y"])
    c = Operand(QParams(scale, 0), i8(divisor))
    return REGISTRY["Div"].derive(_view(node, [Operand(QParams(0.5, 0)), c], y_qp, bits, rounding))


def test_div_by_constant_by_hand():
    # c = 64 * 1/16 = 4 (dequantized); S_x 0.5, S_y 0.25 -> ratio 0.5 / (4 * 0.25) = 0.5 -> 2**30 >> 31
    # x = [4, -3.5, 1.5, 50] -> / 4 / 0.25 = [4, -3.5, 1.5, 50]
    op = REGISTRY["Div"]
    p = _div(64, 1 / 16, QParams(0.25, 0))
    assert (int(p.requant.multiplier), int(p.requant.rshift)) == (2**30, 31)
    x = i8([8, -7, 3, 100])
    assert op.run(p, x).tolist() == [4, -3, 2, 50]
    assert op.run(_div(64, 1 / 16, QParams(0.25, 0), rounding="half_to_even"), x).tolist() == [4, -4, 2, 50]
    # negative divisor: the sign moves onto the multiplier; -3.5 * -1 = 3.5 -> 4, -1.5 -> -1
    neg = _div(-64, 1 / 16, QParams(0.25, 0))
    assert int(neg.requant.multiplier) == -(2**30)
    assert op.run(neg, x).tolist() == [-4, 4, -1, -50]


def test_div_uses_the_dequantized_constant():
    # 6 stored as int8 127 at scale 0.05 dequantizes to 6.35: the QDQ model divides by 6.35
    # S_x 1, S_y 1/127: x = 127 -> 127 / 6.35 * 127 = 2540 -> saturates; x = 10 -> 200.0 -> 127;
    # x = 3 -> 60; x = -1 -> -20; dividing by 6 instead would give 64 and -21
    op = REGISTRY["Div"]
    node = helper.make_node("Div", ["x", "c"], ["y"])
    p = op.derive(_view(node, [Operand(QParams(1.0, 0)), Operand(QParams(0.05, 0), i8(127))],
                        QParams(1 / 127, 0)))
    assert op.run(p, i8([3, -1, 10])).tolist() == [60, -20, 127]


def test_div_per_element_constant_broadcasts():
    # c = [[2], [-1]] at S_c 1 with S_x = S_y = 1: rows divide by 2 and by -1
    node = helper.make_node("Div", ["x", "c"], ["y"])
    op = REGISTRY["Div"]
    p = op.derive(_view(node, [Operand(QParams(1.0, 0)), Operand(QParams(1.0, 0), i8([[2], [-1]]))],
                        QParams(1.0, 0)))
    assert p.requant.multiplier.tolist() == [[2**30], [-(2**30)]]
    assert p.requant.rshift.tolist() == [[31], [30]]
    assert op.run(p, i8([[10, -7, 127]])).tolist() == [[5, -3, 64], [-10, 7, -127]]


def test_div_refuses_zero_divisor():
    with pytest.raises(Unsupported, match="0"):
        _div(0, 0.1, QParams(0.25, 0))


def test_div_by_an_activation_derives_its_own_form():
    from qtool.ops.mul import DivActivationParams

    assert REGISTRY["Div"].constants(helper.make_node("Div", ["x", "c"], ["y"]))[1].optional
    node = helper.make_node("Div", ["x", "c"], ["y"])
    p = REGISTRY["Div"].derive(_view(node, [Operand(QParams(0.5, 3)), Operand(QParams(0.25, -2))], QParams(1.0, 1)))
    # M / 2**rshift = S_a / (S_b S_y) = 2
    assert isinstance(p, DivActivationParams) and (p.zero_a, p.zero_b, p.zero_out) == (3, -2, 1)
    assert p.multiplier / 2**p.rshift == 2.0


# -- Clip -------------------------------------------------------------------------------------------

def _clip(x_qp, y_qp, low, high, rounding="half_up"):
    inputs = ["x", "" if low is None else "lo", "" if high is None else "hi"]
    node = helper.make_node("Clip", inputs, ["y"])
    operands = [Operand(x_qp)]
    operands += [None if v is None else Operand(None, np.array(v, np.float32)) for v in (low, high)]
    return REGISTRY["Clip"].derive(_view(node, operands, y_qp, rounding=rounding))


def test_clip_rescales_then_clamps_by_hand():
    # S_x 0.5 -> S_y 0.25, Z_y -100; Clip(0, 6): Q(0) = -100, Q(6) = 24 - 100 = -76
    # x = [-5, 0, 2.5, 5.5, 6.5, 63.5] -> [0, 0, 2.5, 5.5, 6, 6] -> [0, 0, 10, 22, 24, 24] - 100
    p = _clip(QParams(0.5, 0), QParams(0.25, -100), 0.0, 6.0)
    assert (p.low, p.high) == (-100, -76)
    x = i8([-10, 0, 5, 11, 13, 127])
    lo, hi = np.float32(0), np.float32(6)
    assert REGISTRY["Clip"].run(p, x, lo, hi).tolist() == [-100, -100, -90, -78, -76, -76]


def test_clip_min_only_and_saturating_bounds():
    # min 1.3 at S_y 0.5 -> 2.6 -> 3; no max: the output type's maximum
    p = _clip(QParams(0.5, 0), QParams(0.5, 0), 1.3, None)
    assert (p.low, p.high) == (3, 127)
    assert REGISTRY["Clip"].run(p, i8([-128, 2, 3, 127]), np.float32(1.3)).tolist() == [3, 3, 3, 127]
    # bounds beyond the representable range saturate; max only: lower bound is the type's minimum
    p = _clip(QParams(0.5, 0), QParams(0.5, 0), None, 1000.0)
    assert (p.low, p.high) == (-128, 127)
    assert REGISTRY["Clip"].run(p, i8([-128, 127])).tolist() == [-128, 127]


def test_clip_bound_ties_follow_the_rounding_mode():
    # max 1.25 at S_y 0.5 is 2.5: half up 3, half to even 2
    assert _clip(QParams(0.5, 0), QParams(0.5, 0), None, 1.25).high == 3
    assert _clip(QParams(0.5, 0), QParams(0.5, 0), None, 1.25, "half_to_even").high == 2


def test_clip_min_above_max_gives_max():
    p = _clip(QParams(1.0, 0), QParams(1.0, 0), 5.0, 2.0)
    assert REGISTRY["Clip"].run(p, i8([-3, 3, 9])).tolist() == [2, 2, 2]


def test_clip_refuses_computed_bounds():
    node = helper.make_node("Clip", ["x", "lo", ""], ["y"])
    computed = Operand(None, None)  # a Raw input that is no constant
    with pytest.raises(Unsupported, match="min"):
        REGISTRY["Clip"].derive(_view(node, [Operand(QParams(1.0, 0)), computed], QParams(1.0, 0)))
    quantized = Operand(QParams(1.0, 0))  # a bound that is an activation
    with pytest.raises(Unsupported, match="min"):
        REGISTRY["Clip"].derive(_view(node, [Operand(QParams(1.0, 0)), quantized], QParams(1.0, 0)))


# -- LeakyRelu and PRelu ------------------------------------------------------------------------

@pytest.mark.parametrize("bits, expected", [
    # float32(0.1) = 13421773 * 2**-27: 32-bit 13421773 * 2**7 >> 34
    (32, (1717986944, 34)),
    # 8-bit: smallest rshift with 0.1 * 2**(r + 1) >= 127 is 10; round(0.1 * 2**10) = 102
    (8, (102, 10)),
])
def test_leaky_relu_derivation_by_hand(bits, expected):
    node = helper.make_node("LeakyRelu", ["x"], ["y"], alpha=0.1)
    p = REGISTRY["LeakyRelu"].derive(_view(node, [Operand(QParams(0.5, 3))], QParams(0.5, 3), bits))
    assert (int(p.multiplier), p.rshift) == expected
    assert p.positive.requant is None  # shared (S, Z): the positive branch is the identity


def test_leaky_relu_run_by_hand():
    # S 0.5, Z 3 shared: d = q - 3; d >= 0 passes; d = -10 -> -1 -> 2; d = -131 -> -13.1 -> -13 -> -10
    node = helper.make_node("LeakyRelu", ["x"], ["y"], alpha=0.1)
    op = REGISTRY["LeakyRelu"]
    p = op.derive(_view(node, [Operand(QParams(0.5, 3))], QParams(0.5, 3)))
    assert op.run(p, i8([3, 10, 127, -7, -128])).tolist() == [3, 10, 127, 2, -10]
    # 8-bit: 102 / 1024 = 0.0996: -131 * 102 / 1024 = -13.05 -> -13
    p8 = op.derive(_view(node, [Operand(QParams(0.5, 3))], QParams(0.5, 3), bits=8))
    assert op.run(p8, i8([3, 10, -7, -128])).tolist() == [3, 10, 2, -10]


def test_leaky_relu_with_different_scales_rescales_both_branches():
    # S_x 0.5 -> S_y 0.25, Z 0; alpha 0.25: x = 3 -> 12; x = 40 -> 160 saturates;
    # x = -1.5 -> -0.375 -> -1.5 -> -1 (half up); x = -50 -> -12.5 -> -50
    node = helper.make_node("LeakyRelu", ["x"], ["y"], alpha=0.25)
    op = REGISTRY["LeakyRelu"]
    p = op.derive(_view(node, [Operand(QParams(0.5, 0))], QParams(0.25, 0)))
    assert (int(p.multiplier), p.rshift) == (2**30, 31)  # 0.25 * 0.5 / 0.25 = 0.5
    assert op.run(p, i8([6, 80, -3, -100])).tolist() == [12, 127, -1, -50]


def _prelu(slopes, scales, x_qp, y_qp, bits=32):
    node = helper.make_node("PRelu", ["x", "s"], ["y"])
    slope = Operand(QParams(np.array(scales, np.float32), np.zeros(len(scales), np.int64), "int8", 0),
                    i8(slopes))
    return REGISTRY["PRelu"].derive(_view(node, [Operand(x_qp), slope], y_qp, bits))


@pytest.mark.parametrize("bits, multipliers, rshift", [(32, [2**30, -(2**30), 2**29], 33),
                                                        (8, [64, -64, 32], 9)])
def test_prelu_per_channel_derivation_by_hand(bits, multipliers, rshift):
    # slopes 64/512 = 0.125, -32/256 = -0.125, 16/256 = 0.0625: the largest |slope| sets the shared
    # rshift (0.125 -> 33 or 9), the others get their multiplier at that shift
    p = _prelu([[[64]], [[-32]], [[16]]], [1 / 512, 1 / 256, 1 / 256], QParams(1.0, 0), QParams(1.0, 0), bits)
    assert p.multiplier.reshape(-1).tolist() == multipliers and p.rshift == rshift


def test_prelu_run_per_channel_by_hand():
    # channel 0 slope 0.125: -16 -> -2, -12 -> -1.5 -> -1 (half up); channel 1 slope -0.125:
    # -16 -> 2, -12 -> 1.5 -> 2; channel 2 slope 0.0625: -12 -> -0.75 -> -1; positives pass
    p = _prelu([[[64]], [[-32]], [[16]]], [1 / 512, 1 / 256, 1 / 256], QParams(1.0, 0), QParams(1.0, 0))
    x = i8([[[[-16, -12, 5]], [[-16, -12, 5]], [[-16, -12, 5]]]])  # [1, 3, 1, 3]
    assert REGISTRY["PRelu"].run(p, x).tolist() == [[[[-2, -1, 5]], [[2, 2, 5]], [[-1, -1, 5]]]]


def test_prelu_scalar_slope_with_zero_point():
    # one slope 0.25 (64 * 1/256), S 1, Z -20 shared: q = -60 -> d = -40 -> -10 -> -30
    node = helper.make_node("PRelu", ["x", "s"], ["y"])
    op = REGISTRY["PRelu"]
    p = op.derive(_view(node, [Operand(QParams(1.0, -20)), Operand(QParams(1 / 256, 0), i8([64]))],
                        QParams(1.0, -20)))
    assert op.run(p, i8([-60, -20, 0, -128])).tolist() == [-30, -20, 0, -47]


def test_prelu_zero_slopes_is_relu():
    p = _prelu([[[0]], [[0]]], [0.1, 0.1], QParams(1.0, 0), QParams(1.0, 0))
    x = i8([[[[-5, 7]], [[-128, 0]]]])
    assert REGISTRY["PRelu"].run(p, x).tolist() == [[[[0, 7]], [[0, 0]]]]


def test_elementwise_kernels_refuse_float_data():
    _, p = _unary("Tanh", QParams(1 / 32, 0), QParams(1 / 127, 0))
    with pytest.raises(TypeError, match="float"):
        REGISTRY["Tanh"].run(p, np.zeros(3, np.float32))
    node = helper.make_node("Mul", ["a", "b"], ["y"])
    pm = REGISTRY["Mul"].derive(_view(node, [Operand(QParams(1.0, 0)), Operand(QParams(1.0, 0))],
                                      QParams(1.0, 0)))
    with pytest.raises(TypeError, match="float"):
        REGISTRY["Mul"].run(pm, i8([1]), np.ones(1, np.float32))


# -- Add and Mul of 8-bit inputs through the table of their own arithmetic -----------------------------

@pytest.mark.parametrize("op_type", ["Add", "Mul"])
@pytest.mark.parametrize("dtype_a, dtype_b", [("int8", "int8"), ("uint8", "int8"), ("int8", "uint8"),
                                              ("uint8", "uint8")])
@pytest.mark.parametrize("rounding", ["half_up", "half_to_even"])
@pytest.mark.parametrize("threads", [1, 3])
def test_add_and_mul_tables_equal_their_arithmetic(op_type, dtype_a, dtype_b, rounding, threads, monkeypatch):
    from qtool.ops import add, mul, parallel
    from qtool.ops.bytetable import byte_values

    monkeypatch.setattr(parallel, "WORKERS", threads)  # lookups in 3 ranges, on the pool
    monkeypatch.setattr(parallel, "SPLIT_FROM", 0)

    arithmetic = {"Add": add._add, "Mul": mul._mul}[op_type]
    node = helper.make_node(op_type, ["a", "b"], ["y"])
    zero = {"int8": -3, "uint8": 130}
    op = REGISTRY[op_type]
    operands = [Operand(QParams(0.043, zero[dtype_a], dtype_a)),
                Operand(QParams(0.011, zero[dtype_b], dtype_b))]
    p = op.derive(_view(node, operands, QParams(0.05, 7), rounding=rounding))
    every_a = byte_values(dtype_a).reshape(16, 16)
    rng = np.random.default_rng(0)
    b_values = byte_values(dtype_b)
    # all pairs, a one-element operand on either side, a per-channel operand, and broadcasting both ways
    cases = [(every_a[:, :, None], b_values.reshape(1, 1, 256)),
             (np.repeat(every_a.reshape(-1), 256), np.tile(b_values, 256)),  # same shapes
             (every_a, b_values[5:6]), (every_a[:1, :1], b_values.reshape(2, 128)),
             (every_a.reshape(1, 4, 8, 8), rng.choice(b_values, (1, 4, 1, 1))),
             (rng.choice(b_values, (2, 1, 3)).astype(dtype_a), rng.choice(b_values, (1, 5, 1)))]
    for a, b in cases:
        got = op.run(p, a, b)
        want = arithmetic(p, a, b)
        assert got.shape == want.shape and got.dtype == want.dtype and (got == want).all()


def test_add_of_wider_inputs_takes_the_arithmetic():
    node = helper.make_node("Add", ["a", "b"], ["y"])
    wide = QParams(1.0, 0, "int16")
    p = REGISTRY["Add"].derive(_view(node, [Operand(wide), Operand(wide)], wide))
    a = np.array([30000, -30000, 5], dtype=np.int16)
    b = np.array([3000, -3000, 5], dtype=np.int16)
    assert REGISTRY["Add"].run(p, a, b).tolist() == [32767, -32768, 10]
