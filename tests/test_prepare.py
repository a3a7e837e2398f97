"""onnx's version converter and shape inference run without the weights' bytes, with the same result."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.model import LARGE_TENSOR, without_weights


def _model(opset=12):
    """Conv with a large Constant weight, Gemm with a large initializer, a Reshape whose shape
    shape inference reads, and a Softmax that the converter rewrites going to opset 13."""
    rng = np.random.default_rng(0)
    conv_w = rng.normal(0, 1, (16, 8, 3, 3)).astype(np.float32)  # 1152 elements
    gemm_w = rng.normal(0, 1, (16 * 4 * 4, 10)).astype(np.float32)
    assert conv_w.size > LARGE_TENSOR and gemm_w.size > LARGE_TENSOR
    nodes = [
        helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(conv_w)),
        helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(np.array([1, -1], np.int64))),
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["c", "shape"], ["r"]),
        helper.make_node("Gemm", ["r", "g"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["y"], axis=1),
    ]
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(gemm_w, "g")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize("transform", [
    lambda m: onnx.version_converter.convert_version(m, 13),
    lambda m: onnx.version_converter.convert_version(m, 14),
    onnx.shape_inference.infer_shapes,
    lambda m: onnx.shape_inference.infer_shapes(m, data_prop=True),
], ids=["to13", "to14", "shapes", "shapes_data_prop"])
def test_same_bytes_as_with_the_weights(transform):
    model = _model()
    before = model.SerializeToString()
    result = without_weights(transform, model)
    assert result.SerializeToString() == transform(_model()).SerializeToString()
    assert model.SerializeToString() == before  # the input is left as it was
    assert any(o.output[0] == "r" for o in result.graph.node)


def test_a_transform_that_needs_the_bytes_runs_on_the_whole_model():
    def needs_bytes(m):
        if any(not t.raw_data for t in m.graph.initializer):
            raise ValueError("no data")
        return onnx.shape_inference.infer_shapes(m)

    assert without_weights(needs_bytes, _model()).SerializeToString() == needs_bytes(_model()).SerializeToString()


def test_a_transform_that_renames_a_weight_runs_on_the_whole_model():
    def rename(m):
        out = onnx.ModelProto()
        out.CopyFrom(m)
        out.graph.initializer[0].name = "g2"
        out.graph.node[4].input[1] = "g2"
        return out

    result = without_weights(rename, _model())
    assert result.SerializeToString() == rename(_model()).SerializeToString()
    assert numpy_helper.to_array(result.graph.initializer[0]).shape == (256, 10)


def test_errors_are_those_of_the_whole_model():
    def fails(m):
        raise RuntimeError("opset not supported")

    with pytest.raises(RuntimeError, match="opset not supported"):
        without_weights(fails, _model())


def test_a_model_prepared_again_gets_the_same_preparation_as_a_model_of_its_own(demo_model, monkeypatch):
    import qtool.model as model_module
    from qtool.model import load_model, prepare

    calls = []
    real = model_module._prepare
    monkeypatch.setattr(model_module, "_prepare", lambda m, s: calls.append(s) or real(m, s))
    monkeypatch.setattr(model_module, "_last_prepared", None)
    monkeypatch.setenv("QTOOL_NO_CACHE", "1")  # within one process (tests/test_diskcache.py: between)
    first = prepare(load_model(demo_model), "a")
    assert model_module._last_prepared[1] is None  # prepared once: no bytes kept
    second = prepare(load_model(demo_model), "b")
    third = prepare(load_model(demo_model), "c")
    assert calls == ["a", "b"]  # the third came from the kept bytes
    assert first.SerializeToString() == second.SerializeToString() == third.SerializeToString()
    third.graph.node[0].name = "changed"  # a model of its own: the next one is as prepared
    assert prepare(load_model(demo_model), "d").graph.node[0].name == first.graph.node[0].name
    other = load_model(demo_model)
    other.graph.node[0].name = "another model"
    prepare(other, "e")
    assert calls == ["a", "b", "e"]


def test_a_model_file_prepared_again_is_not_read_again_until_it_changes(demo_model, tmp_path, monkeypatch):
    import os
    import shutil

    import qtool.model as model_module
    from qtool.errors import QtoolError
    from qtool.model import file_opset, prepare, prepare_file

    path = tmp_path / "m.onnx"
    shutil.copy(demo_model, path)
    reads = []
    real = model_module.load_model
    monkeypatch.setattr(model_module, "load_model", lambda p: reads.append(str(p)) or real(p))
    monkeypatch.setattr(model_module, "_last_file", None)
    monkeypatch.setattr(model_module, "_last_prepared", None)
    want = prepare(real(demo_model)).SerializeToString()
    first, second = prepare_file(path), prepare_file(path)
    assert model_module._last_file[1] is not None and model_module._last_prepared is None  # one copy kept
    third = prepare_file(path)
    assert len(reads) == 2  # the third came from the kept bytes
    assert first.SerializeToString() == second.SerializeToString() == third.SerializeToString() == want
    third.graph.node[0].name = "changed"  # a model of its own
    assert prepare_file(path).graph.node[0].name == first.graph.node[0].name and len(reads) == 2
    assert file_opset(path) == model_module.default_opset(real(demo_model)) and len(reads) == 2
    # the file changes (another model written over it): read and prepared again
    other = real(demo_model)
    other.graph.node[0].name = "rewritten"
    onnx.save(other, path)
    os.utime(path, ns=(1, 1))  # a modification time of its own, whatever the clock's resolution
    assert prepare_file(path).graph.node[0].name == "rewritten" and len(reads) == 3
    path.unlink()  # gone: the user's error, not the kept bytes
    with pytest.raises(QtoolError, match="not found"):
        prepare_file(path)


def _vit_like(height=8, width=6):
    """What a ViT exporter writes: a position table resized (cubic) to the patch grid read off the
    input's fixed H and W, and a decoder Resize to H x W whose batch comes from Shape; the batch
    is open."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "two"], ["h"], axis=0),
        helper.make_node("Slice", ["shape", "three", "four"], ["w"]),
        helper.make_node("Div", ["h", "two"], ["gh"]),
        helper.make_node("Unsqueeze", ["gh", "zero"], ["gh1"]),
        helper.make_node("Concat", ["one_one", "gh1", "w"], ["grid"], axis=0),
        helper.make_node("Resize", ["pos", "", "", "grid"], ["pos_resized"], mode="cubic"),
        helper.make_node("Resize", ["x", "", "halve"], ["half"], mode="nearest"),
        helper.make_node("Add", ["half", "pos_resized"], ["mixed"]),  # [N, 1, h/2, w]
        helper.make_node("Slice", ["shape", "zero", "two_1d"], ["lead"]),
        helper.make_node("Concat", ["lead", "hw"], ["sizes"], axis=0),
        helper.make_node("Resize", ["mixed", "", "", "sizes"], ["y"], mode="linear"),
    ]
    inits = {"two": np.array(2, np.int64), "two_1d": np.array([2], np.int64), "three": np.array([3], np.int64), "four": np.array([4], np.int64),
             "zero": np.array([0], np.int64), "one_one": np.array([1, 1], np.int64),
             "pos": rng.normal(0, 1, (1, 1, 3, 3)).astype(np.float32),
             "halve": np.array([1, 1, 0.5, 1], np.float32), "hw": np.array([height, width], np.int64)}
    graph = helper.make_graph(nodes, "vit", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, height, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_the_fixed_dimensions_of_a_shape_fold_and_what_they_feed_with_them():
    import onnxruntime as ort

    from qtool.model import fold_static_shapes, prepare

    model = _vit_like()
    prepared = prepare(model)
    ops = [n.op_type for n in prepared.graph.node]
    # the position table's cubic Resize folded (its grid came from the fixed H and W); the batch's
    # Slice of the Shape stays, and so does the decoder Resize it sizes
    assert sorted(ops) == ["Add", "Concat", "Resize", "Resize", "Shape", "Slice"]
    assert not any("pos" in n.input for n in prepared.graph.node)
    x = np.random.default_rng(2).normal(0, 1, (3, 1, 8, 6)).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.array_equal(run(prepared), run(model))
    # an open H leaves every pick of the Shape in place
    open_h = _vit_like()
    open_h.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "H"
    assert fold_static_shapes(open_h) == 1  # the Slice of W (index 3) alone
    assert [n.op_type for n in open_h.graph.node].count("Gather") == 1


def test_a_copy_without_weight_bytes_keeps_the_graph_and_leaves_the_original_whole():
    from qtool.model import without_weight_bytes

    model = _model(13)
    before = model.SerializeToString()
    light = without_weight_bytes(model)
    assert model.SerializeToString() == before
    big = {t.name for t in model.graph.initializer if np.prod(t.dims) > LARGE_TENSOR}
    assert big == {"g"}  # the Gemm weight (the Conv's is a Constant node, kept)
    for t, s in zip(light.graph.initializer, model.graph.initializer):
        assert (t.name, list(t.dims), t.data_type) == (s.name, list(s.dims), s.data_type)
        assert (t.raw_data == b"") == (t.name in big) and (t.name in big or t.raw_data == s.raw_data)
    assert light.graph.node == model.graph.node and len(light.SerializeToString()) < len(before) - 16 * 16 * 10 * 4


def _shape_slice(starts, ends, steps, shape_start=1, idx_is_input=False):
    """Shape(x, start=...) of [N, 3, 224, 224], then a Slice (or, with idx_is_input, a Gather
    whose index initializer is also a graph input) into an output through an Identity."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=shape_start)]
    if idx_is_input:
        nodes.append(helper.make_node("Gather", ["s", "idx"], ["picked"], axis=0))
    else:
        nodes.append(helper.make_node("Slice", ["s", "st", "en", "ax", "sp"], ["picked"]))
    nodes.append(helper.make_node("Identity", ["picked"], ["y"]))
    inits = [numpy_helper.from_array(np.array([v], np.int64), k)
             for k, v in (("st", starts), ("en", ends), ("ax", 0), ("sp", steps), ("idx", 0))]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 224, 224])]
    if idx_is_input:
        inputs.append(helper.make_tensor_value_info("idx", TensorProto.INT64, [1]))
    graph = helper.make_graph(nodes, "s", inputs, [helper.make_tensor_value_info("y", TensorProto.INT64, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)


@pytest.mark.parametrize("starts,ends,steps", [(-100, -2**63, -1), (0, 2**62, 1), (2, 0, -1), (-1, -100, -2),
                                               (1, 1, 1), (5, 9, 1), (-2, 3, 1)])
def test_a_folded_slice_of_a_shape_takes_what_onnxruntime_takes(starts, ends, steps):
    import onnxruntime as ort

    from qtool.model import fold_static_shapes

    model = _shape_slice(starts, ends, steps)
    x = {"x": np.zeros((2, 3, 224, 224), np.float32)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]
    want = run(model)
    fold_static_shapes(model)  # the Shape's window [3, 224, 224] holds no open dimension
    assert "Slice" not in [n.op_type for n in model.graph.node]
    assert run(model).tolist() == want.tolist()


def test_an_index_a_caller_may_feed_is_not_folded():
    from qtool.model import fold_static_shapes

    model = _shape_slice(0, 0, 1, idx_is_input=True)
    assert fold_static_shapes(model) == 0 and "Gather" in [n.op_type for n in model.graph.node]


def test_a_quantized_model_imports_the_domains_its_source_declares_or_uses(tmp_path):
    """onnxruntime's optimizer writes every domain it knows into the model it saves; the prepared
    and the quantized model import only the source's domains (and any a node uses)."""
    from qtool.calibrate import calibrate
    from qtool.model import load_model, prepare
    from qtool.quantize import QuantizeOptions, quantize

    source = _model(opset=13)
    source.graph.output[0].type.tensor_type.shape.dim.add().dim_value = 1
    source.graph.output[0].type.tensor_type.shape.dim.add().dim_value = 10
    path = tmp_path / "m.onnx"
    onnx.save(source, path)
    prepared = prepare(load_model(path))
    assert [(o.domain, o.version) for o in prepared.opset_import] == [("", 13)]
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(0).normal(0, 1, (4, 8, 4, 4)).astype(np.float32))
    table = calibrate(path, tmp_path / "calib.npz", progress=False)
    for fmt in ("qdq", "qoperator"):
        qmodel, _ = quantize(path, table, QuantizeOptions(format=fmt))
        assert {o.domain for o in qmodel.opset_import} == {""} | {n.domain for n in qmodel.graph.node}, fmt
