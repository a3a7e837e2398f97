"""The forms jax2tf exports (Magika): GELU's cubic term as ``x * (x * (0.044715 * x))``,
LayerNorm from the moments (``E[x^2] - E[x]^2``, reduced without keepdims and broadcast back by
Reshape and Expand, over an axis that need not be the last) and softmax as ``exp(x - max) / sum``
become one Gelu, LayerNormalization and Softmax at prepare, computing what the pieces did; near
misses stay as they are. Quantized, they run integer, as does GlobalMaxPool."""

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.calibrate import calibrate
from qtool.model import prepare
from qtool.quantize import QuantizeOptions, quantize
from qtool.verify import verify

C, L = 6, 5


def _const(inits, name, value, dtype=np.float32):
    inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
    return name


def _broadcast_back(nodes, inits, reduced, out, axis):
    """jax2tf's broadcast of a reduced [N, L] (axis 1 gone) or [N, C] (axis 2 gone) back to
    [N, C, L]: Reshape to a shape computed from x's, then Expand to it."""
    if "shape" not in {n.output[0] for n in nodes}:
        nodes += [helper.make_node("Shape", ["x"], ["x_shape"]),
                  helper.make_node("Slice", ["x_shape", _const(inits, "s0", [0], np.int64),
                                             _const(inits, "s1", [1], np.int64)], ["n"]),
                  helper.make_node("Concat", ["n", _const(inits, "mid", [1, L] if axis == 1 else [C, 1],
                                                          np.int64)], ["shape64"], axis=0),
                  helper.make_node("Cast", ["shape64"], ["shape"], to=TensorProto.INT64)]
    nodes += [helper.make_node("Reshape", [reduced, "shape"], [out + "_r"]),
              helper.make_node("Expand", [out + "_r", "shape"], [out])]


def _layernorm(axis=1, gamma_axis=None, beta=True, guard=True):
    """x [N, C, L] -> LayerNorm over ``axis`` written from the moments; gamma and beta hold one
    value per position along ``gamma_axis`` (default: ``axis``)."""
    gamma_axis = axis if gamma_axis is None else gamma_axis
    rng = np.random.default_rng(0)
    n = C if axis == 1 else L
    shape = [1, 1, 1]
    shape[gamma_axis] = C if gamma_axis == 1 else L
    inits, nodes = [], []
    axes = _const(inits, "axes", [axis], np.int64)
    inverse = _const(inits, "inv_n", 1.0 / n)
    nodes += [helper.make_node("ReduceSum", ["x", axes], ["sum"], keepdims=0),
              helper.make_node("Mul", ["sum", inverse], ["mean"])]
    _broadcast_back(nodes, inits, "mean", "mean_b", axis)
    nodes += [helper.make_node("Sub", ["x", "mean_b"], ["centred"]),
              helper.make_node("Mul", ["mean", "mean"], ["mean_sq"]),
              helper.make_node("Mul", ["x", "x"], ["x_sq"]),
              helper.make_node("ReduceSum", ["x_sq", axes], ["sum_sq"], keepdims=0),
              helper.make_node("Mul", ["sum_sq", inverse], ["mean_of_sq"]),
              helper.make_node("Sub", ["mean_of_sq", "mean_sq"], ["var0"])]
    if guard:
        nodes.append(helper.make_node("Max", [_const(inits, "zero", 0.0), "var0"], ["var"]))
    _broadcast_back(nodes, inits, "var" if guard else "var0", "var_b", axis)
    nodes += [helper.make_node("Add", ["var_b", _const(inits, "eps", 1e-6)], ["var_eps"]),
              helper.make_node("Sqrt", ["var_eps"], ["std"]),
              helper.make_node("Reciprocal", ["std"], ["inv_std"]),
              helper.make_node("Mul", ["inv_std", _const(inits, "gamma", rng.uniform(0.5, 1.5, shape))], ["scale"]),
              helper.make_node("Mul", ["centred", "scale"], ["normed" if beta else "y"])]
    if beta:
        nodes.append(helper.make_node("Add", ["normed", _const(inits, "beta", rng.normal(0, 0.2, shape))], ["y"]))
    return nodes, inits


def _gelu_jax():
    inits = []
    nodes = [helper.make_node("Mul", [_const(inits, "c", 0.044715), "x"], ["cx"]),
             helper.make_node("Mul", ["x", "cx"], ["cx2"]),
             helper.make_node("Mul", ["x", "cx2"], ["cx3"]),
             helper.make_node("Add", ["x", "cx3"], ["t"]),
             helper.make_node("Mul", [_const(inits, "k", 0.7978845834732056), "t"], ["u"]),
             helper.make_node("Tanh", ["u"], ["th"]),
             helper.make_node("Add", [_const(inits, "one", 1.0), "th"], ["p"]),
             helper.make_node("Mul", [_const(inits, "half", 0.5), "p"], ["h"]),
             helper.make_node("Mul", ["x", "h"], ["y"])]
    return nodes, inits


def _softmax_jax(axis=2):
    inits = []
    axes = _const(inits, "axes", [axis], np.int64)
    nodes = [helper.make_node("ReduceMax", ["x"], ["peak0"], keepdims=0, axes=[axis]),
             helper.make_node("Max", [_const(inits, "minus_inf", -np.inf), "peak0"], ["peak"])]
    _broadcast_back(nodes, inits, "peak", "peak_b", axis)
    nodes += [helper.make_node("Sub", ["x", "peak_b"], ["shifted"]),
              helper.make_node("Exp", ["shifted"], ["e"]),
              helper.make_node("ReduceSum", ["e", axes], ["total"], keepdims=0)]
    _broadcast_back(nodes, inits, "total", "total_b", axis)
    nodes.append(helper.make_node("Div", ["e", "total_b"], ["y"]))
    return nodes, inits


def _save(path, pieces, opset=15):
    nodes, inits = pieces
    graph = helper.make_graph(nodes, "jax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, L])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", C, L])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _x(n=8, seed=0, offset=3.0):
    rng = np.random.default_rng(seed)
    # rows near a constant of their own, as Magika's: the moments form cancels catastrophically
    return (rng.normal(0, 0.3, (n, C, L)) + offset * rng.normal(0, 1, (n, 1, 1))).astype(np.float32)


def _run(model, x):
    session = ort.InferenceSession(model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("axis", [1, 2])
def test_layernorm_from_the_moments_becomes_one_op(tmp_path, axis):
    path = _save(tmp_path / "ln.onnx", _layernorm(axis))
    prepared = prepare(onnx.load(path), "m")
    ops = [n.op_type for n in prepared.graph.node]
    assert ops.count("LayerNormalization") == 1 and "ReduceSum" not in ops and "Sqrt" not in ops
    # over the middle axis: Transpose it last, normalize, Transpose back
    assert ops.count("Transpose") == (2 if axis == 1 else 0)
    x = _x()
    exact = _exact_layernorm(onnx.load(path), x, axis)
    fused, pieces = _run(prepared, x), _run(onnx.load(path), x)
    # float32's E[x^2] - E[x]^2 cancels on rows far from 0 (0.5% off here); the fused op centres first
    assert np.abs(fused - exact).max() < 1e-4 and np.abs(fused - exact).max() <= np.abs(pieces - exact).max()


def _exact_layernorm(model, x, axis):
    """The LayerNorm the pieces stand for, in float64 (gamma, beta and eps read from the model)."""
    inits = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    x = x.astype(np.float64)
    centred = x - x.mean(axis=axis, keepdims=True)
    normed = centred / np.sqrt((centred ** 2).mean(axis=axis, keepdims=True) + inits["eps"])
    return normed * inits["gamma"] + inits.get("beta", 0.0)


@pytest.mark.parametrize("form", ["gamma along another axis", "no beta", "no guard"])
def test_layernorm_near_misses(tmp_path, form):
    pieces = {"gamma along another axis": lambda: _layernorm(1, gamma_axis=2),
              "no beta": lambda: _layernorm(1, beta=False), "no guard": lambda: _layernorm(2, guard=False)}[form]()
    path = _save(tmp_path / "ln.onnx", pieces)
    prepared = prepare(onnx.load(path), "m")
    fused = [n.op_type for n in prepared.graph.node].count("LayerNormalization")
    assert fused == (0 if form == "gamma along another axis" else 1)
    x = _x()
    axis = 2 if form == "no guard" else 1
    exact = _exact_layernorm(onnx.load(path), x, axis)
    got, pieces = _run(prepared, x), _run(onnx.load(path), x)
    assert np.abs(got - exact).max() <= np.abs(pieces - exact).max() + 1e-6


def test_gelu_with_the_coefficient_innermost_becomes_one_op(tmp_path):
    path = _save(tmp_path / "gelu.onnx", _gelu_jax())
    prepared = prepare(onnx.load(path), "m")
    gelu = [n for n in prepared.graph.node if n.op_type == "Gelu"]
    assert len(gelu) == 1 and len(prepared.graph.node) == 1
    assert {a.name: helper.get_attribute_value(a) for a in gelu[0].attribute}["approximate"] in ("tanh", b"tanh")
    x = _x(offset=1.0)
    np.testing.assert_allclose(_run(prepared, x), _run(onnx.load(path), x), atol=1e-5)


def test_a_wrong_coefficient_stays_pieces(tmp_path):
    nodes, inits = _gelu_jax()
    inits[0] = numpy_helper.from_array(np.asarray(0.05, np.float32), "c")
    prepared = prepare(onnx.load(_save(tmp_path / "gelu.onnx", (nodes, inits))), "m")
    assert "Gelu" not in [n.op_type for n in prepared.graph.node]


@pytest.mark.parametrize("axis", [1, 2])
def test_softmax_from_exp_over_sum_becomes_one_op(tmp_path, axis):
    path = _save(tmp_path / "softmax.onnx", _softmax_jax(axis))
    prepared = prepare(onnx.load(path), "m")
    softmax = [n for n in prepared.graph.node if n.op_type == "Softmax"]
    assert len(softmax) == 1 and "Exp" not in [n.op_type for n in prepared.graph.node]
    assert {a.name: helper.get_attribute_value(a) for a in softmax[0].attribute}["axis"] == axis
    x = _x(offset=2.0)
    np.testing.assert_allclose(_run(prepared, x), _run(onnx.load(path), x), atol=1e-6)


def test_quantized_they_run_integer_and_verify(tmp_path):
    """LayerNorm over the channels, GELU, GlobalMaxPool, then softmax over the channels: every op
    integer (the shape arithmetic of the broadcasts is gone with the pieces)."""
    ln_nodes, inits = _layernorm(1)
    gelu_nodes, gelu_inits = _gelu_jax()
    rename = {"x": "y", "y": "g"}
    gelu_nodes = [helper.make_node(n.op_type, [rename.get(i, i) for i in n.input],
                                   [rename.get(o, o) for o in n.output]) for n in gelu_nodes]
    pool = [helper.make_node("GlobalMaxPool", ["g"], ["pooled"]),
            helper.make_node("Reshape", ["pooled", _const(inits, "flat", [0, C], np.int64)], ["z"])]
    graph = helper.make_graph(ln_nodes + gelu_nodes + pool, "jax",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, L])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", C])], inits + gelu_inits)
    path = tmp_path / "block.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)]), path)
    np.savez(tmp_path / "fit.npz", x=_x(32, 1))
    np.savez(tmp_path / "held.npz", x=_x(16, 2))
    table = calibrate(path, tmp_path / "fit.npz", progress=False)
    qmodel, report = quantize(path, table, QuantizeOptions())
    assert {t for t, _, _ in report.kept_float} == set(), report.kept_float
    assert {"LayerNormalization", "Gelu", "GlobalMaxPool"} <= set(report.quantized)
    onnx.save(qmodel, tmp_path / "q.onnx")
    result = verify(path, tmp_path / "q.onnx", tmp_path / "held.npz", progress=False)
    assert result.float_nodes == [] and result.outputs[0].sqnr > 25, result.outputs[0].sqnr
