"""GELU as exporters write it (erf and tanh forms, in their orders and groupings) becomes one
``Gelu`` node at prepare, computing what the pieces did; near misses stay as they are; quantized,
the Gelu is one integer lookup table."""

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.calibrate import calibrate
from qtool.executor import IntegerExecutor
from qtool.model import default_opset, prepare
from qtool.quantize import quantize

SQRT2 = math.sqrt(2.0)


def _erf_nodes(half_where="after", scale="div", swap=False, half=0.5):
    """``x * 0.5 * (1 + erf(x / sqrt 2))`` on ``x``, writing ``y``: the 0.5 applied ``after`` the
    product with x, ``before`` it on x, or ``inner`` on (1 + erf); ``swap`` flips every operand."""
    o = (lambda a, b: [b, a]) if swap else (lambda a, b: [a, b])
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["s"]) if scale == "div"
             else helper.make_node("Mul", o("x", "inv_sqrt2"), ["s"]),
             helper.make_node("Erf", ["s"], ["e"]),
             helper.make_node("Add", o("e", "one"), ["p"])]
    if half_where == "after":
        nodes += [helper.make_node("Mul", o("x", "p"), ["m"]), helper.make_node("Mul", o("m", "half"), ["y"])]
    elif half_where == "before":
        nodes += [helper.make_node("Mul", o("x", "half"), ["h"]), helper.make_node("Mul", o("h", "p"), ["y"])]
    else:
        nodes += [helper.make_node("Mul", o("p", "half"), ["h"]), helper.make_node("Mul", o("x", "h"), ["y"])]
    return nodes, {"half": half}


def _tanh_nodes(cube="pow", swap=False, coefficient=0.044715):
    """``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``."""
    o = (lambda a, b: [b, a]) if swap else (lambda a, b: [a, b])
    if cube == "pow":
        nodes = [helper.make_node("Pow", ["x", "three"], ["x3"])]
    else:
        nodes = [helper.make_node("Mul", ["x", "x"], ["x2"]), helper.make_node("Mul", o("x", "x2"), ["x3"])]
    nodes += [helper.make_node("Mul", o("x3", "c"), ["k"]),
              helper.make_node("Add", o("x", "k"), ["t"]),
              helper.make_node("Mul", o("t", "sqrt_2_pi"), ["u"]),
              helper.make_node("Tanh", ["u"], ["th"]),
              helper.make_node("Add", o("th", "one"), ["p"]),
              helper.make_node("Mul", o("half", "x"), ["h"]),
              helper.make_node("Mul", o("h", "p"), ["y"])]
    return nodes, {"c": coefficient}


def _model(pieces, overrides=None, extra_output=None):
    """conv -> GELU pieces -> conv, at opset 13, the 1-D constants as PaddlePaddle writes them."""
    nodes, values = pieces
    rng = np.random.default_rng(0)
    constants = {"sqrt2": 1.4142135, "inv_sqrt2": 0.70710677, "one": 1.0, "half": 0.5, "three": 3.0,
                 "c": 0.044715, "sqrt_2_pi": 0.7978845608, **values, **(overrides or {})}
    inits = [numpy_helper.from_array(np.array([v], np.float32), k) for k, v in constants.items()]
    inits += [numpy_helper.from_array(rng.normal(0, 1, (4, 3, 1, 1)).astype(np.float32), "w"),
              numpy_helper.from_array(rng.normal(0, 1, (2, 4, 1, 1)).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["in", "w"], ["x"]), *nodes, helper.make_node("Conv", ["y", "w2"], ["out"])]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 2, 5, 5])]
    if extra_output:
        outputs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, ["N", 4, 5, 5]))
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("in", TensorProto.FLOAT, ["N", 3, 5, 5])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _run(model, x):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["out"], {"in": x})[0]


VARIANTS = [("none", _erf_nodes(where, scale, swap))
            for where in ("after", "before", "inner") for scale in ("div", "mul") for swap in (False, True)]
VARIANTS += [("tanh", _tanh_nodes(cube, swap)) for cube in ("pow", "mul") for swap in (False, True)]


@pytest.mark.parametrize("approximate, pieces", VARIANTS)
def test_each_form_fuses_to_one_gelu_that_computes_the_same(approximate, pieces):
    model = _model(pieces)
    prepared = prepare(model)
    assert [n.op_type for n in prepared.graph.node] == ["Conv", "Gelu", "Conv"]
    gelu = prepared.graph.node[1]
    assert list(gelu.input) == ["x"] and list(gelu.output) == ["y"]
    assert {a.name: a.s.decode() for a in gelu.attribute}.get("approximate", "none") == approximate
    assert default_opset(prepared) == 20
    x = np.random.default_rng(1).normal(0, 2, (2, 3, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", [
    _model(_erf_nodes(half=0.6)),
    _model(_erf_nodes(scale="mul", swap=True), {"inv_sqrt2": 0.75}),
    _model(_erf_nodes(), {"one": 2.0}),
    _model(_tanh_nodes(coefficient=0.05)),
    _model(_tanh_nodes(), {"three": 2.0}),
    _model(_erf_nodes(), extra_output="s"),  # x / sqrt(2) read by another node
    _model(_erf_nodes(half_where="before"), extra_output="h"),  # x * 0.5 read elsewhere
    _model(_tanh_nodes(cube="mul"), extra_output="x2"),
], ids=["half-0.6", "scale-0.75", "one-2", "coefficient-0.05", "square-not-cube", "scaled-x-read",
        "half-x-read", "square-read"])
def test_near_misses_are_not_fused(model):
    prepared = prepare(model)
    assert "Gelu" not in [n.op_type for n in prepared.graph.node]
    assert default_opset(prepared) == 13


def test_the_other_operand_must_be_the_same_x():
    nodes, values = _erf_nodes()
    nodes[3] = helper.make_node("Mul", ["in_relu", "p"], ["m"])  # the product takes another tensor
    model = _model(([helper.make_node("Relu", ["x"], ["in_relu"]), *nodes], values))
    assert "Gelu" not in [n.op_type for n in prepare(model).graph.node]


@pytest.mark.parametrize("op_type, approximate", [("Gelu", "none"), ("FastGelu", "tanh")])
def test_onnxruntime_contrib_gelu_becomes_the_onnx_op(op_type, approximate):
    node = helper.make_node(op_type, ["x"], ["y"], domain="com.microsoft")
    model = _model(([node], {}))
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    prepared = prepare(model)
    gelu = prepared.graph.node[1]
    assert (gelu.op_type, gelu.domain) == ("Gelu", "")
    assert {a.name: a.s.decode() for a in gelu.attribute}.get("approximate", "none") == approximate
    x = np.random.default_rng(1).normal(0, 2, (2, 3, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-5, atol=1e-5)


def test_fastgelu_with_a_bias_stays():
    node = helper.make_node("FastGelu", ["x", "bias"], ["y"], domain="com.microsoft")
    model = _model(([node], {}))
    model.graph.initializer.append(numpy_helper.from_array(np.ones(5, np.float32), "bias"))
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    assert [n.op_type for n in prepare(model).graph.node] == ["Conv", "FastGelu", "Conv"]


@pytest.mark.parametrize("approximate, pieces", [VARIANTS[0], VARIANTS[-1]])
def test_quantized_gelu_is_one_integer_table(tmp_path, approximate, pieces):
    onnx.save(_model(pieces), tmp_path / "m.onnx")
    x = np.random.default_rng(2).normal(0, 1, (8, 3, 5, 5)).astype(np.float32)
    np.savez(tmp_path / "d.npz", **{"in": x})
    table = calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False)
    qmodel, report = quantize(tmp_path / "m.onnx", table)
    assert report.kept_float == [] and report.quantized == {"Conv": 2, "Gelu": 1}
    executor = IntegerExecutor(qmodel)
    assert executor.float_nodes() == []
    assert [s.node.op_type for s in executor.steps if s.node.op_type not in ("QuantizeLinear", "DequantizeLinear")] \
        == ["Conv", "Gelu", "Conv"]
    assert next(s for s in executor.steps if s.node.op_type == "Gelu").params.table.size == 256
    got = executor.run({"in": x}).outputs["out"]
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    want = ort.InferenceSession(qmodel.SerializeToString(), options).run(None, {"in": x})[0]
    reference = _run(_model(pieces), x)
    # the integer run is the QDQ model up to a rounding step, and both are near the float model
    step = np.abs(want).max() / 127
    assert np.abs(got - want).max() <= step * 1.001
    assert np.abs(got - reference).max() <= 0.05 * np.abs(reference).max()
