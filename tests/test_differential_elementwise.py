"""Elementwise integer steps against onnxruntime running the same one-node QDQ model.

As in test_differential.py: fed onnxruntime's own integer inputs, each integer step must match its
QuantizeLinear output within 1 LSB with 32-bit multipliers (>= 95% exactly), within 1 + 255/63 LSB
with 8-bit multipliers.
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from qtool.calibrate import calibrate
from qtool.quantize import QuantizeOptions, quantize
from test_differential import per_step_differences

RNG = np.random.default_rng(4321)
HAS_GELU = onnx.defs.has("Gelu")


def _model(node, inputs: dict, inits: dict, opset: int = 13):
    """A one-node float model at ``opset``; the output shape comes from onnx.reference."""
    def build(out_shape):
        graph = helper.make_graph(
            [node], "single",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", *s[1:]]) for n, s in inputs.items()],
            [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, out_shape)],
            [numpy_helper.from_array(v, k) for k, v in inits.items()])
        ir = 8 if opset <= 18 else 9
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)

    sample = {n: np.ones(s, np.float32) for n, s in inputs.items()}
    y = ReferenceEvaluator(build([])).run(None, sample)[0]
    return build(["N", *y.shape[1:]])


def _f(*values):
    return np.array(values, dtype=np.float32)


def _case(op_type, inputs, inits=None, opset=13, spread=1.0, **attrs):
    names = list(inputs) + list(inits or {})
    if op_type == "Clip":  # optional inputs keep their position
        names = ["x", "lo" if "lo" in (inits or {}) else "", "hi" if "hi" in (inits or {}) else ""]
    node = helper.make_node(op_type, names, ["y"], name=f"{op_type}_0", **attrs)
    return node, inputs, inits or {}, opset, spread


X = {"x": (8, 4, 6, 6)}
CASES = {
    "sigmoid": _case("Sigmoid", X, spread=3.0),
    "tanh": _case("Tanh", X, spread=1.5),
    "erf": _case("Erf", X),
    "hardsigmoid": _case("HardSigmoid", X, spread=3.0, alpha=0.3, beta=0.4),
    "hardswish": _case("HardSwish", X, opset=14, spread=3.0),
    "mul_broadcast": _case("Mul", {"a": (8, 4, 5, 5), "b": (8, 4, 1, 1)}),
    "mul_constant": _case("Mul", {"a": (8, 4, 5, 5)}, {"c": _f(0.37)}),
    "mul_constant_per_channel": _case("Mul", {"a": (8, 4, 5, 5)},
                                      {"c": RNG.normal(0, 1, (4, 1, 1)).astype(np.float32)}),
    "div_constant": _case("Div", {"a": (8, 4, 5, 5)}, {"c": _f(6.0)}),
    "div_constant_negative": _case("Div", {"a": (8, 4, 5, 5)}, {"c": _f(-0.7)}),
    "div_constant_per_channel": _case("Div", {"a": (8, 4, 5, 5)},
                                      {"c": _f(1.5, -2.0, 3.0, 0.8).reshape(4, 1, 1)}),
    "clip_relu6": _case("Clip", X, {"lo": _f(0.0), "hi": _f(6.0)}, spread=4.0),
    "clip_min_only": _case("Clip", X, {"lo": _f(-0.3)}),
    "clip_max_only": _case("Clip", X, {"hi": _f(0.5)}),
    "leakyrelu": _case("LeakyRelu", X, alpha=0.1),
    "leakyrelu_steep": _case("LeakyRelu", X, alpha=0.7),
    "prelu_per_channel": _case("PRelu", X, {"slope": _f(0.25, 0.1, -0.3, 0.02).reshape(4, 1, 1)}),
    "prelu_scalar": _case("PRelu", X, {"slope": _f(0.2)}),
}
CASES.update({
    "softmax": _case("Softmax", {"x": (8, 4, 6, 10)}, spread=3.0),
    "softmax_axis1": _case("Softmax", {"x": (8, 5, 7)}, spread=2.0, axis=1),
    "layernorm": _case("LayerNormalization", {"x": (8, 6, 24)},
                       {"gamma": RNG.normal(1.0, 0.5, 24).astype(np.float32),
                        "beta": RNG.normal(0.0, 0.5, 24).astype(np.float32)}, opset=17),
    "layernorm_two_axes": _case("LayerNormalization", {"x": (8, 3, 4, 5)},
                                {"gamma": RNG.normal(0.0, 1.0, (4, 5)).astype(np.float32)},
                                opset=17, axis=-2, epsilon=0.1),
})
CASES.update({  # a sentence encoder's mean pooling and L2 normalization
    "reducesum": _case("ReduceSum", {"x": (8, 12, 16)}, {"axes": np.array([1], np.int64)}),
    "reducesum_flat": _case("ReduceSum", {"x": (8, 12, 16)}, {"axes": np.array([1, 2], np.int64)}, keepdims=0),
    "reducel2": _case("ReduceL2", {"x": (8, 12, 16)}, axes=[-1]),
    "reducemean_spatial": _case("ReduceMean", {"x": (8, 4, 6, 6)}, axes=[2, 3]),  # an SE block's average
    "reducemean_flat": _case("ReduceMean", {"x": (8, 12, 16)}, axes=[-1], keepdims=0),
    "reducel2_opset18": _case("ReduceL2", {"x": (8, 12, 16)}, {"axes": np.array([-1], np.int64)}, opset=18,
                              keepdims=0),
    "div_activation": _case("Div", {"a": (8, 12, 16), "b": (8, 12, 1)}),
})
CASES.update({  # one table each, as Sigmoid (madmom's TCN runs Elu after every Conv)
    "elu": _case("Elu", X, spread=2.0),
    "elu_alpha": _case("Elu", X, spread=2.0, alpha=0.3),
    "selu": _case("Selu", X, spread=2.0),
    "celu": _case("Celu", X, opset=12, spread=2.0, alpha=1.5),
    "softplus": _case("Softplus", X, spread=3.0),
    "softsign": _case("Softsign", X, spread=3.0),
    "thresholdedrelu": _case("ThresholdedRelu", X, opset=10, spread=2.0, alpha=0.5),
})
if HAS_GELU:
    CASES["gelu"] = _case("Gelu", X, opset=20, spread=2.0)
    CASES["gelu_tanh"] = _case("Gelu", X, opset=20, spread=2.0, approximate="tanh")


def _quantize(tmp_path, case, options):
    node, inputs, inits, opset, spread = CASES[case]
    model_path = tmp_path / "m.onnx"
    onnx.save(_model(node, inputs, inits, opset), model_path)
    data = {n: (spread * RNG.normal(0.2, 1.0, s)).astype(np.float32) for n, s in inputs.items()}
    if case == "div_activation":  # divisors away from 0: 0 / 0 is NaN, whose QuantizeLinear ONNX leaves open
        data["b"] = np.abs(data["b"]) + np.float32(0.25)
    np.savez(tmp_path / "d.npz", **data)
    table = calibrate(model_path, tmp_path / "d.npz", progress=False)
    qmodel, report = quantize(model_path, table, options)
    assert report.kept_float == [] and report.quantized == {node.op_type: 1}
    return qmodel, data, node


def _check(diffs, node, bits, case):
    assert len(diffs) == 1, f"{case}: integer steps {list(diffs)}"  # prepare may rename the node
    d = next(iter(diffs.values()))
    worst = int(d.max())
    bound = 1 if bits == 32 else 1 + 255 / 63
    assert worst <= bound, f"{case}: {worst} LSB"
    if bits == 32:
        exact = float(np.mean(d == 0))
        assert exact >= 0.95, f"{case}: only {exact:.1%} exactly equal"


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_elementwise_op_matches_onnxruntime(tmp_path, case, symmetric, bits):
    qmodel, data, node = _quantize(tmp_path, case, QuantizeOptions(symmetric=symmetric, multiplier_bits=bits))
    _check(per_step_differences(qmodel, data), node, bits, case)


@pytest.mark.parametrize("case", ["sigmoid", "hardswish", "mul_broadcast", "div_constant", "clip_relu6",
                                  "leakyrelu", "prelu_per_channel"])
def test_elementwise_op_uint8_activations(tmp_path, case):
    options = QuantizeOptions(activation_type="uint8")
    qmodel, data, node = _quantize(tmp_path, case, options)
    _check(per_step_differences(qmodel, data), node, 32, case)


def test_hardswish_decomposition_is_one_table(tmp_path):
    """PP-OCR's ``x * clip(x + 3, 0, 6) / 6`` is fused into HardSwish and runs as one table."""
    nodes = [helper.make_node("Add", ["x", "three"], ["t0"]),
             helper.make_node("Clip", ["t0", "zero", "six"], ["t1"]),
             helper.make_node("Mul", ["x", "t1"], ["t2"]),
             helper.make_node("Div", ["t2", "six"], ["y"])]
    inits = [numpy_helper.from_array(_f(v).reshape(()), n) for n, v in
             (("three", 3.0), ("zero", 0.0), ("six", 6.0))]
    graph = helper.make_graph(nodes, "hswish", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)
    model_path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), model_path)
    data = {"x": (3 * RNG.normal(0, 1, (64, 4))).astype(np.float32)}
    np.savez(tmp_path / "d.npz", **data)
    table = calibrate(model_path, tmp_path / "d.npz", progress=False)
    qmodel, report = quantize(model_path, table)
    assert report.kept_float == [] and report.quantized == {"HardSwish": 1}
    diffs = per_step_differences(qmodel, data)
    assert len(diffs) == 1 and max(int(d.max()) for d in diffs.values()) <= 1


def test_div_by_an_activation_by_hand():
    """``q_y = round(round(d_a * M / d_b) / 2**rshift) + Z_y``, M / 2**rshift = 1 here; a zero
    divisor gives the type's end by the dividend's sign (float: +-inf) and Z_y for 0 / 0."""
    from qtool.ops.mul import Div, DivActivationParams

    p = DivActivationParams(2**30, 30, zero_a=1, zero_b=-2, zero_out=3, rounding="half_up", dtype="int8")
    a = np.array([11, -9, 1, 10, 8, 1], np.int8)  # d_a = 10, -10, 0, 9, 7, 0
    b = np.array([-2, -2, -2, 0, -4, 5], np.int8)  # d_b = 0, 0, 0, 2, -2, 7
    # 9 / 2 = 4.5 -> 5 (half up), 7 / -2 = -3.5 -> -3 (half up), 0 / 7 = 0; then + 3
    assert Div().run(p, a, b).tolist() == [127, -128, 3, 8, 0, 3]
