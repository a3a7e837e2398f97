"""Each integer step against onnxruntime running the same QDQ model.

onnxruntime computes ``Q(op(DQ(inputs)))`` in float: the exact reference for one requantization.
Fed onnxruntime's own integer inputs, every integer step must match its QuantizeLinear output
within 1 LSB with 32-bit multipliers (float rounding and the tie rule may differ by one). With
8-bit multipliers (relative error < 1/63) the bound is 1 + 255/63 LSB.
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from qtool.calibrate import calibrate
from qtool.executor import IntegerExecutor
from qtool.model import FloatRunner
from qtool.quantize import QuantizeOptions, quantize

RNG = np.random.default_rng(1234)


def _model(node, inputs: dict, inits: dict):
    """A one-node float model; the output shape comes from onnx.reference on a sample."""
    def build(out_shape):
        graph = helper.make_graph(
            [node], "single",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", *s[1:]]) for n, s in inputs.items()],
            [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, out_shape)],
            [numpy_helper.from_array(v, k) for k, v in inits.items()])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)

    sample = {n: np.zeros(s, np.float32) for n, s in inputs.items()}
    y = ReferenceEvaluator(build([])).run(None, sample)[0]
    return build(["N", *y.shape[1:]])


def _w(*shape):
    return RNG.normal(0, 0.5, shape).astype(np.float32)


CASES = {
    "conv_pad_bias": (helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1]),
                      {"x": (8, 3, 7, 7)}, {"w": _w(4, 3, 3, 3), "b": _w(4)}),
    "conv_stride_dilation_asympad": (
        helper.make_node("Conv", ["x", "w"], ["y"], strides=[2, 2], dilations=[2, 2], pads=[0, 1, 1, 0]),
        {"x": (8, 3, 9, 9)}, {"w": _w(5, 3, 3, 3)}),
    "conv_depthwise": (helper.make_node("Conv", ["x", "w", "b"], ["y"], group=4, pads=[1, 1, 1, 1]),
                       {"x": (8, 4, 6, 6)}, {"w": _w(4, 1, 3, 3), "b": _w(4)}),
    # auto_pad SAME with stride 1: explicit pads after preparation (PP-OCRv6's 2x2 stem convs)
    "conv_same_upper": (helper.make_node("Conv", ["x", "w", "b"], ["y"], auto_pad="SAME_UPPER"),
                        {"x": (8, 3, 7, 6)}, {"w": _w(4, 3, 2, 2), "b": _w(4)}),
    "conv_same_lower_dilated": (helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_LOWER",
                                                 dilations=[2, 1]), {"x": (8, 3, 7, 6)}, {"w": _w(4, 3, 2, 3)}),
    "maxpool_same_upper": (helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], auto_pad="SAME_UPPER"),
                           {"x": (8, 3, 7, 6)}, {}),
    # stride 2: explicit pads from the model's fixed spatial sizes (MTCNN's MaxPools)
    "maxpool_same_upper_stride2": (helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2],
                                                    auto_pad="SAME_UPPER"), {"x": (8, 3, 7, 6)}, {}),
    "conv_same_lower_stride2": (helper.make_node("Conv", ["x", "w", "b"], ["y"], auto_pad="SAME_LOWER",
                                                 strides=[2, 3]), {"x": (8, 3, 9, 8)}, {"w": _w(4, 3, 4, 3), "b": _w(4)}),
    # 1-D: the executor runs them as 2-D convs of height 1
    "conv1d_pad_bias": (helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[2, 1]),
                        {"x": (8, 3, 17)}, {"w": _w(4, 3, 5), "b": _w(4)}),
    "conv1d_stride_dilation": (helper.make_node("Conv", ["x", "w"], ["y"], strides=[2], dilations=[3]),
                               {"x": (8, 4, 30)}, {"w": _w(6, 4, 3)}),
    "conv1d_depthwise": (helper.make_node("Conv", ["x", "w", "b"], ["y"], group=4, pads=[1, 1]),
                         {"x": (8, 4, 12)}, {"w": _w(4, 1, 3), "b": _w(4)}),
    # 3-D: one 2-D accumulation per depth tap (ops/conv.py run_volume)
    "conv3d_pad_bias": (helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1, 1, 1]),
                        {"x": (4, 3, 5, 6, 7)}, {"w": _w(4, 3, 3, 3, 3), "b": _w(4)}),
    "conv3d_stride_dilation_asympad": (
        helper.make_node("Conv", ["x", "w"], ["y"], strides=[2, 1, 2], dilations=[2, 1, 1], group=2,
                         pads=[0, 1, 1, 1, 0, 2]), {"x": (4, 4, 7, 5, 8)}, {"w": _w(6, 2, 2, 3, 2)}),
    "conv3d_depthwise": (helper.make_node("Conv", ["x", "w", "b"], ["y"], group=4, pads=[1, 0, 1, 1, 0, 1]),
                         {"x": (4, 4, 4, 5, 6)}, {"w": _w(4, 1, 3, 1, 3), "b": _w(4)}),
    "gemm_transB": (helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1),
                    {"x": (8, 6)}, {"w": _w(5, 6), "b": _w(5)}),
    "gemm_plain": (helper.make_node("Gemm", ["x", "w"], ["y"]), {"x": (8, 6)}, {"w": _w(6, 5)}),
    "matmul_3d": (helper.make_node("MatMul", ["x", "w"], ["y"]), {"x": (8, 5, 6)}, {"w": _w(6, 7)}),
    "add_broadcast": (helper.make_node("Add", ["a", "b"], ["y"]), {"a": (8, 4, 5, 5), "b": (8, 4, 1, 1)}, {}),
    "add_constant": (helper.make_node("Add", ["a", "c"], ["y"]), {"a": (8, 4, 5, 5)},
                     {"c": np.array(3.0, dtype=np.float32)}),
    "add_constant_per_channel": (helper.make_node("Add", ["a", "c"], ["y"]), {"a": (8, 4, 5, 5)},
                                 {"c": _w(4, 1, 1)}),
    "maxpool": (helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2],
                                 pads=[1, 1, 1, 1]), {"x": (8, 3, 7, 7)}, {}),
    "averagepool": (helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2]),
                    {"x": (8, 3, 6, 6)}, {}),
    "globalaveragepool": (helper.make_node("GlobalAveragePool", ["x"], ["y"]), {"x": (8, 3, 5, 4)}, {}),
    "relu": (helper.make_node("Relu", ["x"], ["y"]), {"x": (8, 3, 4, 4)}, {}),
    "flatten": (helper.make_node("Flatten", ["x"], ["y"], axis=1), {"x": (8, 3, 2, 2)}, {}),
    "reshape": (helper.make_node("Reshape", ["x", "shape"], ["y"]), {"x": (8, 3, 2, 2)},
                {"shape": np.array([0, -1], dtype=np.int64)}),
}


def per_step_differences(qmodel, feeds):
    """For each integer step: |executor - onnxruntime| in LSB, on onnxruntime's own inputs."""
    executor = IntegerExecutor(qmodel)
    names = [o for node in qmodel.graph.node for o in node.output]
    reference = FloatRunner(qmodel, names).run(feeds)
    diffs = {}
    for step in executor.steps:
        if step.kind != "integer":
            continue
        values = [reference.get(n, executor.constants.get(n)) for n in step.inputs]
        got = executor._run_step(step, values)[0]
        want = reference[step.outputs[0]]
        assert got.dtype == want.dtype, step.node.name
        diffs[step.node.name] = np.abs(got.astype(np.int64) - want.astype(np.int64))
    return diffs


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_single_op_matches_onnxruntime(tmp_path, case, symmetric, bits):
    node, inputs, inits = CASES[case]
    model_path = tmp_path / "m.onnx"
    onnx.save(_model(node, inputs, inits), model_path)
    data = {n: RNG.normal(0.2, 1.0, s).astype(np.float32) for n, s in inputs.items()}
    np.savez(tmp_path / "d.npz", **data)
    table = calibrate(model_path, tmp_path / "d.npz", progress=False)
    qmodel, report = quantize(model_path, table, QuantizeOptions(symmetric=symmetric, multiplier_bits=bits))
    assert report.kept_float == [] and report.quantized == {node.op_type: 1}
    diffs = per_step_differences(qmodel, data)
    assert list(diffs) == [node.name] or len(diffs) == 1
    bound = 1 if bits == 32 else 1 + 255 / 63
    worst = max(int(d.max()) for d in diffs.values())
    assert worst <= bound, f"{case}: {worst} LSB"
    if bits == 32:
        exact = np.mean(np.concatenate([(d == 0).ravel() for d in diffs.values()]))
        assert exact >= 0.95, f"{case}: only {exact:.1%} exactly equal"


def test_demo_layers_match_onnxruntime(demo_model, demo_table, demo_heldout):
    qmodel, _ = quantize(demo_model, demo_table)
    feeds = {"input": np.load(demo_heldout)["input"][:64]}
    diffs = per_step_differences(qmodel, feeds)
    assert len(diffs) == 13  # every op of the demo runs integer
    assert max(int(d.max()) for d in diffs.values()) <= 1
    exact = np.mean(np.concatenate([(d == 0).ravel() for d in diffs.values()]))
    assert exact >= 0.99
