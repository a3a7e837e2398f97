"""Attention masks (qtool/masks.py): found in every form exporters write, kept out of the quantized
ranges, and applied exactly by the integer Softmax; no constant dequantizes to inf or NaN.

The model is a two-layer attention block written the way transformer exporters write it (opset
14): the 0/1 ``mask`` input becomes ``(1 - mask) * finfo(float32).min`` (or -1e4, or
``Where(mask, 0, -inf)``) added to the scaled scores before Softmax, or the scores are selected
with ``Where(mask, scores, finfo.min)``.
"""

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool import masks
from qtool.calibrate import calibrate
from qtool.executor import IntegerExecutor
from qtool.ops import NodeView, Operand
from qtool.ops.softmax import MaskedSoftmax
from qtool.qparams import QParams, dequantize_array
from qtool.quantize import quantize
from qtool.verify import verify
from test_cli import assert_no_crash, invoke

LOWEST = float(np.finfo(np.float32).min)
D, HEADS, T = 32, 2, 12


def attention_model(path, form="mul", mask_value=LOWEST, layers=2, seed=0, width=D, same_qk=False,
                    scale=1.0):
    """``form``: "mul" ((1 - m) * value), "where_add" (Where(m, 0, value) added), "select"
    (Where(m, scores, value)), "select_not" (Where(not m, value, scores)), "bias" (a float bias
    input added: not a mask). ``same_qk``: one projection for queries and keys; ``scale``: of the
    projections' weights."""
    rng = np.random.default_rng(seed)
    dh = width // HEADS
    inits, nodes = [], []

    def init(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], name=f"{out}_node", **attrs))
        return out

    node("Unsqueeze", ["mask", init("axes", np.array([1, 2], np.int64))], "m4")
    if form == "mul":
        node("Cast", ["m4"], "m4f", to=TensorProto.FLOAT)
        node("Sub", [init("one", np.array(1.0, np.float32)), "m4f"], "inv")
        node("Mul", ["inv", init("low", np.array(mask_value, np.float32))], "ext")
    elif form == "where_add":
        node("Cast", ["m4"], "m4b", to=TensorProto.BOOL)
        node("Where", ["m4b", init("zero", np.array(0.0, np.float32)), init("low", np.array(mask_value, np.float32))],
             "ext")
    elif form == "where_expand":  # Where(not m, value, zeros_like(m)): torch's masked_fill
        node("Not", [node("Cast", ["m4"], "m4b", to=TensorProto.BOOL)], "m4n")
        node("Expand", [init("zero", np.array(0.0, np.float32)), node("Shape", ["m4n"], "m4s")], "zeros")
        node("Where", ["m4n", init("low", np.array(mask_value, np.float32)), "zeros"], "ext")
    elif form in ("select", "select_not"):
        node("Cast", ["m4"], "m4b", to=TensorProto.BOOL)
        if form == "select_not":
            node("Not", ["m4b"], "m4n")
        init("low", np.array(mask_value, np.float32))
    x = "x"
    for layer in range(layers):
        p = f"l{layer}_"
        wq, wk, wv, wo = (rng.normal(0, scale * width ** -0.5, (width, width)).astype(np.float32) for _ in range(4))
        wk = wq if same_qk else wk
        shape = init(p + "shape", np.array([0, 0, HEADS, dh], np.int64))
        q = node("Transpose", [node("Reshape", [node("MatMul", [x, init(p + "wq", wq)], p + "q"), shape], p + "qr")],
                 p + "qh", perm=[0, 2, 1, 3])
        k = node("Transpose", [node("Reshape", [node("MatMul", [x, init(p + "wk", wk)], p + "k"), shape], p + "kr")],
                 p + "kh", perm=[0, 2, 3, 1])
        v = node("Transpose", [node("Reshape", [node("MatMul", [x, init(p + "wv", wv)], p + "v"), shape], p + "vr")],
                 p + "vh", perm=[0, 2, 1, 3])
        s = node("Div", [node("MatMul", [q, k], p + "s"), init(p + "sq", np.array(np.sqrt(dh), np.float32))], p + "sd")
        if form in ("mul", "where_add", "where_expand"):
            s = node("Add", [s, "ext"], p + "sm")
        elif form == "select":
            s = node("Where", ["m4b", s, "low"], p + "sm")
        elif form == "select_not":
            s = node("Where", ["m4n", "low", s], p + "sm")
        elif form == "bias":
            s = node("Add", [s, "bias"], p + "sm")
        a = node("Softmax", [s], p + "a", axis=-1)
        c = node("Reshape", [node("Transpose", [node("MatMul", [a, v], p + "c")], p + "ct", perm=[0, 2, 1, 3]),
                             init(p + "shape2", np.array([0, 0, width], np.int64))], p + "cr")
        x = node("Add", [x, node("MatMul", [c, init(p + "wo", wo)], p + "o")], p + "res")
    node("ReduceMean", [x], "pooled", axes=[1], keepdims=0)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", T, width]),
              helper.make_tensor_value_info("mask", TensorProto.INT64, ["N", T])]
    if form == "bias":
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["N", 1, 1, T]))
    graph = helper.make_graph(nodes, "attention", inputs,
                              [helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["N", width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def attention_data(path, n=24, seed=1, width=D, bias=None):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, T + 1, n)
    arrays = {"x": rng.normal(0, 1, (n, T, width)).astype(np.float32),
              "mask": (np.arange(T)[None] < lengths[:, None]).astype(np.int64)}
    if bias is not None:
        arrays["bias"] = np.full((n, 1, 1, T), bias, np.float32)
    np.savez(path, **arrays)
    return path


def _pipeline(tmp_path, form, **kw):
    model = attention_model(tmp_path / f"{form}.onnx", form, **kw)
    calib, held = attention_data(tmp_path / "calib.npz", seed=1), attention_data(tmp_path / "held.npz", seed=2)
    qmodel, report = quantize(model, calibrate(model, calib, progress=False))
    return model, qmodel, report, held


# -- recognition -----------------------------------------------------------------------------------

@pytest.mark.parametrize("form, value", [("mul", LOWEST), ("mul", -1e4), ("mul", -1e9), ("where_add", -np.inf),
                                         ("where_expand", -np.inf),
                                         ("where_add", LOWEST), ("select", LOWEST), ("select_not", -1e4)])
def test_every_exporter_form_is_a_masked_softmax(tmp_path, form, value):
    plan = masks.find(onnx.load(attention_model(tmp_path / "m.onnx", form, value)))
    assert sorted(plan.joins) == ["l0_a_node", "l1_a_node"]
    assert {j.form for j in plan.joins.values()} == {"where_not" if form == "select_not" else
                                                    "where" if form == "select" else "add"}
    if form in ("mul", "where_add"):
        assert plan.tensors == {"ext"} and "ext_node" in plan.arithmetic
    if form == "where_expand":  # the zeros made at run time are no mask, but the Where of them is
        assert plan.tensors == {"ext"} and {"ext_node", "zeros_node"} <= plan.arithmetic
    assert not plan.arithmetic & {"l0_sd_node", "l0_s_node", "l0_a_node"}


@pytest.mark.parametrize("form, value", [("mul", -100.0), ("bias", 0.0)])
def test_a_bias_is_not_a_mask(tmp_path, form, value):
    """-100 is a large value, not a mask's minus infinity; an input added to the scores is a bias."""
    plan = masks.find(onnx.load(attention_model(tmp_path / "m.onnx", form, value)))
    assert not plan.joins and not plan.tensors


# -- the kernel ------------------------------------------------------------------------------------

def _float_masked_softmax(q, x: QParams, y: QParams, hidden):
    scores = dequantize_array(q, x).astype(np.float64)
    scores = np.where(hidden, -np.inf, scores)
    full = hidden.all(axis=-1, keepdims=True)  # a fully hidden row: softmax over all positions
    scores = np.where(full, dequantize_array(q, x), scores)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    return np.clip(np.floor(p / y.scale + 0.5) + y.zero_point, y.qmin, y.qmax).astype(np.int64)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16"])
@pytest.mark.parametrize("form", ["add", "where", "where_not"])
def test_masked_softmax_kernel_matches_float(dtype, form):
    rng = np.random.default_rng(7)
    x = QParams(np.float32(0.07), 3 if dtype != "int16" else 0, dtype)
    y = QParams(np.float32(1 / 255), -128, "int8") if dtype != "int16" else QParams(np.float32(1 / 32767), 0, "int16")
    q = rng.integers(x.qmin, x.qmax + 1, (6, 4, 9)).astype(dtype)
    hidden = rng.random((6, 1, 9)) < 0.4
    hidden[0] = True  # every position hidden in these rows
    hidden[1] = False
    node = helper.make_node("Softmax", ["x"], ["y"], axis=-1)
    params = MaskedSoftmax().derive(NodeView(node, [Operand(x)], y, opset=14), form)
    operand = {"add": np.where(hidden, LOWEST, 0.0).astype(np.float32), "where": ~hidden, "where_not": hidden}[form]
    got = MaskedSoftmax().run(params, q, operand).astype(np.int64)
    want = _float_masked_softmax(q, x, y, np.broadcast_to(hidden, q.shape))
    assert np.abs(got - want).max() <= 1 and np.mean(got == want) > 0.99
    # hidden positions get exactly the level of probability 0, rows not fully hidden
    visible_rows = ~np.broadcast_to(hidden, q.shape).all(axis=-1, keepdims=True)
    zero = np.broadcast_to(hidden, q.shape) & visible_rows
    assert np.all(got[zero] == y.zero_point)


def test_an_additive_mask_with_other_values_is_refused():
    with pytest.raises(masks.MaskError, match="holds -50"):
        masks.masked_positions("add", np.array([0.0, -1e4, -50.0], np.float32))
    assert masks.masked_positions("add", np.array([0.0, -np.inf, LOWEST], np.float32)).tolist() == [False, True, True]


# -- end to end ------------------------------------------------------------------------------------

@pytest.mark.parametrize("form, value", [("mul", LOWEST), ("mul", -1e4), ("where_add", -np.inf),
                                         ("where_expand", -np.inf), ("select", LOWEST)])
def test_masked_attention_quantizes_and_verifies(tmp_path, form, value):
    """int8 with masks as exporters write them: the masked scores never get a range, the Softmax
    is integer and gives padding exactly probability 0, onnxruntime agrees with the executor."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy warning is a bug
        model, qmodel, report, held = _pipeline(tmp_path, form, mask_value=value)
        assert report.quantized["Softmax"] == 2 and sorted(report.masked) == ["l0_a_node", "l1_a_node"]
        executor = IntegerExecutor(qmodel)
        assert {s.op.op_type for s in executor.steps if s.kind == "integer" and s.node.op_type == "Softmax"} \
            == {"MaskedSoftmax"}
        data = dict(np.load(held))
        result = executor.run({"x": data["x"][:4], "mask": data["mask"][:4]}, keep_integer=True)
    qp = executor.integer_tensors()["l0_a"].qparams
    probabilities = result.integer["l0_a"].astype(np.int64)  # [4, heads, T, T]
    hidden = np.broadcast_to((data["mask"][:4] == 0)[:, None, None, :], probabilities.shape)
    assert hidden.any() and np.all(probabilities[hidden] == qp.zero_point)
    sums = ((probabilities - qp.zero_point) * qp.scale).sum(axis=-1)
    assert np.all(np.abs(sums - 1) < 0.05)
    # against float: the block keeps its accuracy (without masks recognized: 9.5 dB on this model)
    onnx.save(qmodel, tmp_path / "q.onnx")
    outcome = verify(model, tmp_path / "q.onnx", held, progress=False)
    assert outcome.outputs[0].sqnr > 25
    session = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    feeds = {k: data[k][:4] for k in ("x", "mask")}
    assert np.allclose(session.run(None, feeds)[0], result.outputs["pooled"], atol=1e-6)


def test_no_constant_dequantizes_to_inf(tmp_path):
    """A -3.4e38 constant added where no Softmax follows is no mask: its range is clipped to 1e30,
    so no DequantizeLinear of the model gives inf or NaN, and quantize says so."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    low = numpy_helper.from_array(np.array([0, 0, LOWEST, 0], np.float32), "low")
    graph = helper.make_graph([helper.make_node("Add", ["x", "low"], ["s"], name="add"),
                               helper.make_node("Mul", ["s", "half"], ["y"], name="half")], "g", [x], [y],
                              [low, numpy_helper.from_array(np.array(0.5, np.float32), "half")])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), model)
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qmodel, report = quantize(model, calibrate(model, tmp_path / "d.npz", progress=False))
    assert "s" in report.widened
    inits = {t.name: numpy_helper.to_array(t) for t in qmodel.graph.initializer}
    session_model = tmp_path / "q.onnx"
    onnx.save(qmodel, session_model)
    for node in qmodel.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            scale = inits[node.input[1]].astype(np.float32)
            zero = inits[node.input[2]].astype(np.int64) if len(node.input) > 2 else 0
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                values = (inits[node.input[0]].astype(np.int64) - zero).astype(np.float32) * scale
            assert np.all(np.isfinite(values)), node.name
    out = ort.InferenceSession(str(session_model), providers=["CPUExecutionProvider"]).run(
        None, {"x": np.ones((2, 4), np.float32)})[0]
    assert np.all(np.isfinite(out))


def test_cli_names_the_softmax_of_a_bad_mask(tmp_path):
    """An additive mask whose values turn out other than 0 and -1e4 or below at run time: verify
    exits 2 naming the Softmax node."""
    model, qmodel, _, held = _pipeline(tmp_path, "mul", mask_value=-1e4)
    onnx.save(qmodel, tmp_path / "q.onnx")
    data = dict(np.load(held))
    data["mask"] = data["mask"] * 2  # (1 - 2) * -1e4 = 1e4: a bias, not a mask
    np.savez(tmp_path / "bad.npz", **data)
    result = invoke("verify", model, tmp_path / "q.onnx", "-d", tmp_path / "bad.npz", "-q")
    assert_no_crash(result)
    assert result.exit_code == 2, result.output
    assert "neither 0 nor at most -10000 at Softmax node 'l0_a_node'" in result.output
