"""Exported decompositions become one op in the prepared graph (HardSwish; constant affine ops and BatchNorm fold into a conv)."""

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qtool.fusion import fold_affine_into_conv
from qtool.model import default_opset, prepare


def _const(name, value):
    return numpy_helper.from_array(np.array(value, dtype=np.float32), name)


def _model(extra_output=None, six=6.0):
    """conv -> x * clip(x + 3, 0, 6) / six -> y, and Mul(z, HardSigmoid(z)) after it."""
    nodes = [
        helper.make_node("Conv", ["in", "w"], ["x"]),
        helper.make_node("Add", ["x", "three"], ["a"]),
        helper.make_node("Clip", ["a", "zero", "six"], ["c"]),
        helper.make_node("Mul", ["x", "c"], ["m"]),
        helper.make_node("Div", ["m", "divisor"], ["y"]),
        helper.make_node("Conv", ["y", "w2"], ["z"]),
        helper.make_node("HardSigmoid", ["z"], ["h"], alpha=1 / 6, beta=0.5),
        helper.make_node("Mul", ["h", "z"], ["out"]),
    ]
    rng = np.random.default_rng(0)
    inits = [_const("three", 3.0), _const("zero", 0.0), _const("six", 6.0), _const("divisor", six),
             numpy_helper.from_array(rng.normal(0, 1, (4, 3, 1, 1)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(0, 1, (4, 4, 1, 1)).astype(np.float32), "w2")]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
    if extra_output:
        outputs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "hs", [helper.make_tensor_value_info("in", TensorProto.FLOAT, [1, 3, 5, 5])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _run(model, x):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["out"], {"in": x})[0]


def test_both_forms_fuse_and_compute_the_same():
    model = _model()
    prepared = prepare(model)
    ops = [n.op_type for n in prepared.graph.node]
    assert ops == ["Conv", "HardSwish", "Conv", "HardSwish"]
    assert default_opset(prepared) == 14
    assert [n.output[0] for n in prepared.graph.node if n.op_type == "HardSwish"] == ["y", "out"]
    x = np.random.default_rng(1).normal(0, 3, (1, 3, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-5, atol=1e-5)


def test_no_fusion_when_an_intermediate_is_used_elsewhere_or_constants_differ():
    assert [n.op_type for n in prepare(_model(extra_output="c")).graph.node].count("HardSwish") == 1
    assert [n.op_type for n in prepare(_model(six=5.0)).graph.node].count("HardSwish") == 1


def _affine_model(conv_output_also_graph_output=False):
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Conv", ["in", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["scale", "c"], ["m"]),
             helper.make_node("Add", ["m", "shift"], ["a"]),
             helper.make_node("Relu", ["a"], ["out"])]
    inits = [numpy_helper.from_array(rng.normal(0, 1, (4, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(0, 1, (4,)).astype(np.float32), "b"),
             _const("scale", [0.7]),
             numpy_helper.from_array(rng.normal(0, 1, (1, 4, 1, 1)).astype(np.float32), "shift")]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
    if conv_output_also_graph_output:
        outputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "affine", [helper.make_tensor_value_info("in", TensorProto.FLOAT, [1, 3, 5, 5])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_constant_mul_and_add_after_conv_fold_into_it():
    model = _affine_model()
    prepared = prepare(model)
    assert [n.op_type for n in prepared.graph.node] == ["Conv", "Relu"]
    assert prepared.graph.node[0].output[0] == "a"  # the tensor after the affine ops keeps its name
    x = np.random.default_rng(1).normal(0, 1, (1, 3, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-5, atol=1e-5)


def test_no_fold_when_the_conv_output_is_read_elsewhere():
    prepared = prepare(_affine_model(conv_output_also_graph_output=True))
    assert [n.op_type for n in prepared.graph.node] == ["Conv", "Mul", "Add", "Relu"]


def test_chained_affine_blocks_fold_in_one_pass():
    """Two Conv -> Mul -> Add blocks in a row: every Mul and Add folds, each into its own Conv,
    and the tensors between the blocks keep their names."""
    rng = np.random.default_rng(3)
    nodes, inits, x = [], [], "in"
    for k in range(2):
        nodes += [helper.make_node("Conv", [x, f"w{k}"], [f"c{k}"], name=f"conv{k}"),
                  helper.make_node("Mul", [f"c{k}", f"scale{k}"], [f"m{k}"], name=f"mul{k}"),
                  helper.make_node("Add", [f"shift{k}", f"m{k}"], [f"a{k}"], name=f"add{k}")]
        inits += [numpy_helper.from_array(rng.normal(0, 1, (3, 3, 1, 1)).astype(np.float32), f"w{k}"),
                  numpy_helper.from_array(rng.normal(0, 1, (1, 3, 1, 1)).astype(np.float32), f"scale{k}"),
                  _const(f"shift{k}", 0.25 * (k + 1))]
        x = f"a{k}"
    nodes.append(helper.make_node("Relu", [x], ["out"], name="relu"))
    graph = helper.make_graph(nodes, "affine2", [helper.make_tensor_value_info("in", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    folded = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    assert fold_affine_into_conv(folded) == 4
    assert [(n.op_type, n.output[0]) for n in folded.graph.node] == [("Conv", "a0"), ("Conv", "a1"),
                                                                      ("Relu", "out")]
    assert list(folded.graph.node[1].input) == ["a0", "conv1_w_folded_1", "conv1_b_folded_1"]
    x = np.random.default_rng(1).normal(0, 1, (1, 3, 4, 4)).astype(np.float32)
    np.testing.assert_allclose(_run(folded, x), _run(model, x), rtol=1e-5, atol=1e-5)


def _upsampling_model(group=1):
    """PP-OCRv4 det's upsampling: ConvTranspose (no bias) -> Add(bias per channel) -> BatchNorm."""
    rng = np.random.default_rng(5)
    c_in, c_out = 4, 6
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, (c_in, c_out // group, 2, 2)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(0, 1, (c_out, 1, 1)).astype(np.float32), "b"),
             numpy_helper.from_array(rng.uniform(0.5, 2, c_out).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.normal(0, 1, c_out).astype(np.float32), "beta"),
             numpy_helper.from_array(rng.normal(0, 1, c_out).astype(np.float32), "mean"),
             numpy_helper.from_array(rng.uniform(0.1, 3, c_out).astype(np.float32), "var")]
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["t"], strides=[2, 2], group=group),
             helper.make_node("Add", ["t", "b"], ["u"]),
             helper.make_node("BatchNormalization", ["u", "gamma", "beta", "mean", "var"], ["y"], epsilon=1e-5)]
    graph = helper.make_graph(nodes, "up", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c_in, 5, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", c_out, 10, 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_bias_and_batchnorm_after_a_conv_transpose_fold_into_it():
    model = _upsampling_model()
    prepared = prepare(model)
    assert [n.op_type for n in prepared.graph.node] == ["ConvTranspose"]
    x = np.random.default_rng(0).normal(0, 1, (3, 4, 5, 5)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    got = ort.InferenceSession(prepared.SerializeToString()).run(None, {"x": x})[0]
    assert np.allclose(got, want, atol=1e-5)


def test_a_grouped_conv_transpose_keeps_its_batchnorm():
    assert "BatchNormalization" in [n.op_type for n in prepare(_upsampling_model(group=2)).graph.node]


def _select_model():
    """PyTorch's select on a packed projection: x [N, 3, 4, 8] -> q = x[:, 0], k = x[:, 1],
    v = x[:, -1] (Gathers by constant scalars), and a shape Gather that must stay."""
    nodes = [helper.make_node("Relu", ["in"], ["x"], name="relu"),
             helper.make_node("Gather", ["x", "i0"], ["q"], name="select_q", axis=1),
             helper.make_node("Gather", ["x", "i1"], ["k"], name="select_k", axis=1),
             helper.make_node("Gather", ["x", "last"], ["v"], name="select_v", axis=1),
             helper.make_node("Add", ["q", "k"], ["qk"], name="add"),
             helper.make_node("Mul", ["qk", "v"], ["out"], name="mul"),
             helper.make_node("Shape", ["x"], ["shape"], name="shape"),
             helper.make_node("Gather", ["shape", "i1"], ["dim"], name="dim")]
    ints = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("i0", 0), ("i1", 1), ("last", -1))]
    graph = helper.make_graph(nodes, "select", [helper.make_tensor_value_info("in", TensorProto.FLOAT, ["N", 3, 4, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 4, 8]),
                               helper.make_tensor_value_info("dim", TensorProto.INT64, [])], ints)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_select_by_a_constant_scalar_becomes_slice_and_squeeze(tmp_path):
    import onnx

    from qtool.calibrate import calibrate
    from qtool.quantize import quantize

    model = _select_model()
    prepared = prepare(model)
    ops = {n.name: n.op_type for n in prepared.graph.node}
    assert {ops[n] for n in ("select_q", "select_k", "select_v")} == {"Squeeze"}  # name and output kept
    assert sum(op == "Slice" for op in ops.values()) == 3 and ops["dim"] == "Gather"  # shapes untouched
    x = np.random.default_rng(0).normal(0, 1, (2, 3, 4, 8)).astype(np.float32)
    for a, b in zip(_run(model, x), _run(prepared, x)):
        np.testing.assert_array_equal(a, b)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", **{"in": x})
    _, report = quantize(tmp_path / "m.onnx", calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False))
    floats = {n for _, n, _ in report.kept_float}
    assert not floats & {"select_q", "select_k", "select_v", "select_q/slice", "select_v/slice"}
    assert report.quantized["Slice"] == 3 and report.quantized["Squeeze"] == 3
