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
