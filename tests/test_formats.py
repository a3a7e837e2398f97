"""QOperator output, the integer parameters (embedded and --params-out), and --strict.

Expected parameters are computed here from the quantized model's own initializers (scales, zero
points, int8 weights, float bias) with exact Fraction arithmetic, never by qtool's derivation.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.params import PARAMS_KEY, model_params
from qtool.quantize import QuantizeOptions, quantize
from test_cli import assert_no_crash, invoke, quantize_error

QLINEAR = {"QLinearConv", "QLinearAdd", "QLinearGlobalAveragePool", "QGemm"}


def _ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [32, 8])
def test_demo_qoperator_runs_in_onnxruntime_like_qdq(demo_model, demo_table, demo_heldout, symmetric, bits):
    options = dict(symmetric=symmetric, multiplier_bits=bits)
    qdq, _ = quantize(demo_model, demo_table, QuantizeOptions(**options))
    qop, report = quantize(demo_model, demo_table, QuantizeOptions(format="qoperator", **options))
    onnx.checker.check_model(qop, full_check=True)
    ops = {n.op_type for n in qop.graph.node}
    assert QLINEAR <= ops
    assert not ops & {"Conv", "Gemm", "Add", "GlobalAveragePool"}  # no float compute left
    # only the graph input is quantized and only the logits dequantized
    assert [n.op_type for n in qop.graph.node].count("QuantizeLinear") == 1
    assert [n.op_type for n in qop.graph.node].count("DequantizeLinear") == 1
    assert report.qdq_groups == [] and report.format == "qoperator"
    x = np.load(demo_heldout)["input"]
    a, b = _ort(qdq, x), _ort(qop, x)
    assert np.mean(a.argmax(1) == b.argmax(1)) >= 0.99
    cos = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
    assert cos > 0.999


def _init(model, name):
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def _dq_inputs(model, tensor):
    node = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == tensor)
    return [_init(model, n) if i else n for i, n in enumerate(node.input)]


@pytest.mark.parametrize("target, dtype", [("portable", "uint8"), ("exact", "int8")])
def test_conv_parameters_match_a_hand_derivation(tmp_path, demo_model, demo_table, target, dtype):
    qmodel, _ = quantize(demo_model, demo_table, QuantizeOptions(target=target))
    params = model_params(qmodel)
    assert params["rounding"] == "half_up" and params["multiplier_bits"] == 32
    conv = next(op for op in params["ops"] if op["node"] == "conv1")
    node = next(n for n in qmodel.graph.node if n.name == "conv1")
    x_q, x_scale, x_zero = _dq_inputs(qmodel, node.input[0])
    w_q, w_scale, w_zero = _dq_inputs(qmodel, node.input[1])
    assert w_q.endswith("_quantized") and np.all(w_zero == (128 if dtype == "uint8" else 0))
    w_q = _init(qmodel, w_q).astype(np.int64) - w_zero.astype(np.int64).reshape(-1, 1, 1, 1)
    b_q, b_scale, _ = _dq_inputs(qmodel, node.input[2])
    b_q = _init(qmodel, b_q)
    q_out = next(n for n in qmodel.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == node.output[0])
    y_scale = _init(qmodel, q_out.input[1])
    for c in range(w_q.shape[0]):
        ratio = Fraction(float(x_scale)) * Fraction(float(w_scale[c])) / Fraction(float(y_scale))
        shift = 31 - math.floor(math.log2(ratio)) - 1  # M in [2^30, 2^31)
        multiplier = round(ratio * 2 ** shift)
        if multiplier == 2 ** 31:
            multiplier, shift = 2 ** 30, shift - 1
        assert conv["params"]["requant"]["multiplier"][c] == multiplier
        assert conv["params"]["requant"]["rshift"][c] == shift
        # the int32 bias in accumulator units, minus Z_x * sum(q_w)
        assert float(b_scale[c]) == pytest.approx(float(x_scale) * float(w_scale[c]), rel=1e-6)
        assert conv["params"]["bias"][c] == int(b_q[c]) - int(x_zero) * int(w_q[c].astype(np.int64).sum())
    assert conv["inputs"][0]["qparams"] == {"scale": float(x_scale), "zero_point": int(x_zero), "dtype": dtype}
    assert "weight" not in conv["params"]  # int8 weights stay in the model


def test_params_are_embedded_and_written_by_params_out(tmp_path, demo_model, demo_calib):
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", demo_model, "--data", demo_calib, "-o", table).exit_code == 0
    result = invoke("quantize", demo_model, "-t", table, "-o", tmp_path / "q.onnx",
                    "--params-out", tmp_path / "params.json")
    assert_no_crash(result)
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "params.json").read_text())
    qmodel = onnx.load(str(tmp_path / "q.onnx"))
    embedded = json.loads(next(p.value for p in qmodel.metadata_props if p.key == PARAMS_KEY))
    assert written == embedded
    assert [op["op_type"] for op in written["ops"]].count("Conv") == 4
    # the default target (portable) writes uint8 activations
    assert all(op["outputs"][0]["qparams"]["dtype"] == "uint8" for op in written["ops"])


def test_params_out_unwritable_leaves_nothing(tmp_path, demo_model, demo_table):
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", demo_model, "--data", "qtool/demo/digits_calib.npz", "-o", table).exit_code == 0
    # a folder on the way is a file
    quantize_error(tmp_path, demo_model, table, "--params-out", table / "p.json",
                   expect=["p.json", "not a directory"])


def test_unknown_format(tmp_path, demo_model):
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", demo_model, "--data", "qtool/demo/digits_calib.npz", "-o", table).exit_code == 0
    quantize_error(tmp_path, demo_model, table, "--format", "qdqq", expect=["qdqq", "qdq", "qoperator"])


def _sin_model(path):
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["a"], name="conv"),
         helper.make_node("Sin", ["a"], ["y"], name="sin")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 4, 4])],
        [numpy_helper.from_array(rng.normal(0, 1, (2, 3, 1, 1)).astype(np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), path)
    np.savez(path.with_suffix(".npz"), x=rng.normal(0, 1, (4, 3, 4, 4)).astype(np.float32))


def test_strict_lists_what_cannot_be_integer(tmp_path):
    _sin_model(tmp_path / "m.onnx")
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", tmp_path / "m.onnx", "--data", tmp_path / "m.npz", "-o", table).exit_code == 0
    quantize_error(tmp_path, tmp_path / "m.onnx", table, "--strict",
                   expect=["--strict", "1 op(s)", "Sin 'sin'", "no integer kernel"])
    result = invoke("quantize", tmp_path / "m.onnx", "-t", table, "-o", tmp_path / "q.onnx",
                    "--strict", "--keep-float", "Sin")
    assert_no_crash(result)
    assert result.exit_code == 0 and (tmp_path / "q.onnx").exists()


def test_shape_arithmetic_makes_no_float():
    """A Cast of a shape to float computes values (review): it is not shape arithmetic."""
    from qtool.quantize import _shape_arithmetic

    graph = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"], name="shape"),
         helper.make_node("Gather", ["s", "zero"], ["n"], name="batch", axis=0),
         helper.make_node("Cast", ["n"], ["nf"], name="to_float", to=TensorProto.FLOAT),
         helper.make_node("Mul", ["x", "nf"], ["y"], name="scale")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(np.array(0, np.int64), "zero")])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    assert _shape_arithmetic(model) == {"shape", "batch"}


def test_strict_passes_shape_arithmetic(tmp_path):
    """Sweep 9: --strict refused PP-OCR's mobile cls for its Shape node ('Shape_180', the batch of
    a Reshape): ops on shapes are no quantization's business. It is still listed as float."""
    from conftest import packaged_file

    model = packaged_file("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx", "rapidocr-onnxruntime")
    np.savez(tmp_path / "cls.npz", x=np.random.default_rng(0).uniform(-1, 1, (4, 3, 48, 192)).astype(np.float32))
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", model, "--data", tmp_path / "cls.npz", "-o", table, "-q").exit_code == 0
    result = invoke("quantize", model, "-t", table, "-o", tmp_path / "q.onnx", "--strict")
    assert result.exit_code == 0, result.output
    assert "Shape x1: no integer kernel for this op type ('Shape_180')" in result.output
