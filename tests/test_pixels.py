"""quantize --input-pixels: the quantized model takes the uint8 pixels, the normalization folded into
the Conv layers that read the input (qtool/pixels.py).

Expected values come from the float model run by onnxruntime on the normalized data, computed here
from the pixels with numpy."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.calibrate import calibrate
from qtool.errors import QtoolError
from qtool.executor import IntegerExecutor
from qtool.model import load_model, prepare
from qtool.pixels import PixelInput, as_pixels, fold, pixel_inputs
from qtool.quantize import QuantizeOptions, quantize
from test_cli import assert_user_error, invoke

MEAN, STD, SCALE = (0.5, 0.4, 0.3), (0.5, 0.25, 0.2), 1 / 255


def _model(pads: int, reader: str = "Conv") -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, .3, (4, 3, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(0, .1, 4).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.normal(0, .3, (2, 4, 1, 1)).astype(np.float32), "w2")]
    first = (helper.make_node("Conv", ["x", "w1", "b1"], ["h"], name="conv1", pads=[pads] * 4)
             if reader == "Conv" else helper.make_node("Relu", ["x"], ["h0"], name="relu0"))
    nodes = [first] if reader == "Conv" else [
        first, helper.make_node("Conv", ["h0", "w1", "b1"], ["h"], name="conv1", pads=[pads] * 4)]
    nodes += [helper.make_node("Relu", ["h"], ["r"], name="relu"),
              helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, None, None])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _pixels(n: int = 16) -> np.ndarray:
    return np.random.default_rng(1).integers(0, 256, (n, 3, 8, 8), dtype=np.uint8)


def _normalized(p: np.ndarray) -> np.ndarray:
    mean, std = (np.asarray(v, np.float32).reshape(1, 3, 1, 1) for v in (MEAN, STD))
    return ((p.astype(np.float32) * np.float32(SCALE) - mean) / std).astype(np.float32)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.fixture
def files(tmp_path):
    p = _pixels()
    paths = {"model": tmp_path / "m.onnx", "padded": tmp_path / "padded.onnx", "data": tmp_path / "d.npz",
             "relu": tmp_path / "relu.onnx"}
    onnx.save(_model(0), str(paths["model"]))
    onnx.save(_model(1), str(paths["padded"]))
    onnx.save(_model(0, "Relu"), str(paths["relu"]))
    np.savez(paths["data"], x=_normalized(p))
    return paths, p


def test_folded_conv_reads_the_pixels_and_gives_the_float_result():
    p = _pixels()
    model = prepare(_model(0))
    reference = _run(model, _normalized(p))
    name, zero = fold(model, PixelInput(MEAN, STD, SCALE))
    assert (name, zero) == ("x", 102)  # round(mean(0.5, 0.4, 0.3) * 255)
    folded = _run(model, (SCALE * (p.astype(np.float64) - zero)).astype(np.float32))
    np.testing.assert_allclose(folded, reference, rtol=1e-4, atol=1e-4)


def test_padding_differs_only_where_the_kernel_reads_padded_taps():
    p = _pixels()
    model = prepare(_model(1))
    reference = _run(model, _normalized(p))
    _, zero = fold(model, PixelInput(MEAN, STD, SCALE))
    folded = _run(model, (SCALE * (p.astype(np.float64) - zero)).astype(np.float32))
    # conv2 (1x1) keeps positions: conv1's border is the output's border
    np.testing.assert_allclose(folded[:, :, 1:-1, 1:-1], reference[:, :, 1:-1, 1:-1], rtol=1e-4, atol=1e-4)
    assert not np.allclose(folded, reference, atol=1e-4)


def test_quantized_model_takes_uint8_pixels_without_rounding(files):
    paths, p = files
    table = calibrate(paths["model"], paths["data"], progress=False)
    qmodel, _ = quantize(paths["model"], table, QuantizeOptions(input_pixels=PixelInput(MEAN, STD, SCALE)))
    assert qmodel.graph.input[0].type.tensor_type.elem_type == TensorProto.UINT8
    assert pixel_inputs(qmodel)["x"]["zero_point"] == 102
    executor = IntegerExecutor(qmodel)
    from_floats = executor.run({"x": _normalized(p)}, keep_integer=True)
    from_pixels = executor.run({"x": p}).outputs["y"]
    np.testing.assert_array_equal(from_floats.outputs["y"], from_pixels)  # the data came from pixels
    np.testing.assert_array_equal(as_pixels(_normalized(p), pixel_inputs(qmodel)["x"]), p)
    # onnxruntime runs the model on the pixels, and it scores better than the float input's rounding
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    got = ort.InferenceSession(qmodel.SerializeToString(), options,
                               providers=["CPUExecutionProvider"]).run(None, {"x": p})[0]
    plain, _ = quantize(paths["model"], table)
    ref = _run(onnx.load(str(paths["model"])), _normalized(p)).astype(np.float64)

    def sqnr(y):
        return 10 * np.log10((ref ** 2).sum() / ((ref - y) ** 2).sum())

    assert sqnr(got) > sqnr(_run(plain, _normalized(p)))
    # onnxruntime's float Conv may round a tie the other way on another CPU: one output step at most
    step = max(float(np.abs(np.diff(np.unique(from_pixels))).min()), 1e-6)
    assert np.abs(got - from_pixels).max() <= step * 1.001 and np.mean(got == from_pixels) > 0.98


def test_cli_input_pixels_and_verify(files, tmp_path):
    paths, _ = files
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", paths["model"], "-d", paths["data"], "-o", table, "-q").exit_code == 0
    out = tmp_path / "q.onnx"
    result = invoke("quantize", paths["model"], "-t", table, "-o", out, "--input-pixels", "--mean", "0.5,0.4,0.3",
                    "--std", "0.5,0.25,0.2", "-q")
    assert result.exit_code == 0, result.output
    result = invoke("verify", paths["model"], out, "-d", paths["data"], "--ort", "-q")
    assert result.exit_code == 0, result.output


def test_input_read_by_another_op_is_one_line(files, tmp_path):
    paths, _ = files
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", paths["relu"], "-d", paths["data"], "-o", table, "-q").exit_code == 0
    result = invoke("quantize", paths["relu"], "-t", table, "-o", tmp_path / "q.onnx", "--input-pixels")
    assert_user_error(result, "--input-pixels: input 'x' is read by Relu node 'relu0'")
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.parametrize("args, message", [
    (["--mean", "0.5"], "the image options describe the images of --data (a folder) or the pixels of "
                        "--input-pixels: add one"),
    (["--input-pixels", "--mean", "0.5,0.5"], "--input-pixels: --mean has 2 values but the model's input has 3 "
                                              "channels: give 1 or 3 values"),
    (["--input-pixels", "--std", "0"], "--input-pixels: --std must not be 0"),
    (["--input-pixels", "--mean", "a"], "--mean takes comma-separated numbers, got 'a'"),
])
def test_bad_pixel_settings(files, tmp_path, args, message):
    paths, _ = files
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", paths["model"], "-d", paths["data"], "-o", table, "-q").exit_code == 0
    result = invoke("quantize", paths["model"], "-t", table, "-o", tmp_path / "q.onnx", *args)
    assert_user_error(result, message)


@pytest.mark.parametrize("args, message", [
    (["--mean", "0.5,0.5,0.5"], "--input-pixels: --mean has 3 values but the model's input has 1 channel: "
                                "give one value"),
    (["--channels", "rgb", "--std", "0.5,0.5,0.5"],
     "--input-pixels: --std has 3 values but the model's input has 1 channel: give one value; "
     "--channels rgb (3 channels) does not fit it"),
])
def test_values_for_three_channels_on_a_one_channel_input(demo_model, demo_calib, tmp_path, args, message):
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", demo_model, "-d", demo_calib, "-o", table, "-q").exit_code == 0
    result = invoke("quantize", demo_model, "-t", table, "-o", tmp_path / "q.onnx", "--input-pixels", *args)
    line = assert_user_error(result, message)
    assert line.endswith(message)
    assert not (tmp_path / "q.onnx").exists()


def test_a_job_folds_its_calibration_preprocessing(files, tmp_path):
    import json

    import yaml

    paths, _ = files
    job = {"model": str(paths["model"]), "output_dir": str(tmp_path / "out"),
           "calibrate": {"data": str(paths["data"]),
                         "preprocess": {"mean": list(MEAN), "std": list(STD), "scale": SCALE}},
           "quantize": {"input_pixels": True}}
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job))
    result = invoke("run", spec)
    assert result.exit_code == 0, result.output
    qmodel = load_model(tmp_path / "out" / "m.q.onnx")
    assert qmodel.graph.input[0].type.tensor_type.elem_type == TensorProto.UINT8
    assert pixel_inputs(qmodel)["x"] == {"mean": list(MEAN), "std": list(STD), "scale": SCALE, "zero_point": 102}
    assert json.loads((tmp_path / "out" / "m.verify.json").read_text())["passed"]


def test_input_pixels_given_other_than_recorded_is_said(files, tmp_path):
    """--mean/--std that differ from the normalization calibrate recorded are folded in as given,
    and quantize says so as exec and verify do (it said nothing, and the model's own recorded
    preprocessing then disagreed with its folded one)."""
    import yaml

    paths, _ = files
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", paths["model"], "-d", paths["data"], "-o", table, "-q").exit_code == 0
    doc = yaml.safe_load(table.read_text())
    doc["preprocess"] = {"resize": None, "fit": "stretch", "pad": 114.0, "mean": [0.5, 0.4, 0.3],
                         "std": [0.5, 0.25, 0.2], "scale": 1 / 255, "channels": "rgb", "layout": "nchw", "input": None}
    table.write_text(yaml.safe_dump(doc, sort_keys=False))
    same = invoke("quantize", paths["model"], "-t", table, "-o", tmp_path / "a.onnx", "--input-pixels", "-q")
    assert same.exit_code == 0 and "warning: image preprocessing" not in same.stderr, same.output
    other = invoke("quantize", paths["model"], "-t", table, "-o", tmp_path / "b.onnx", "--input-pixels",
                   "--mean", "0.45,0.4,0.3", "-q")
    assert other.exit_code == 0, other.output
    assert "warning: image preprocessing: mean" in other.stderr and "given, " in other.stderr \
        and "recorded in table file" in other.stderr and "the given one is used" in other.stderr, other.stderr


def test_exec_turns_float_data_into_the_pixels_and_refuses_other_preprocessing(files, tmp_path):
    """exec reads float data made with the recorded preprocessing as verify does (it refused them:
    "model expects uint8 (token ids, positions or a mask ...)"): the same outputs as from the
    pixels. Float data beyond what pixels give (made with other preprocessing) are one line,
    exit 2, in exec and verify (verify clipped them to 0-255 without a word), and not retried
    one sample at a time."""
    paths, p = files
    table, out = tmp_path / "t.yaml", tmp_path / "q.onnx"
    assert invoke("calibrate", paths["model"], "-d", paths["data"], "-o", table, "-q").exit_code == 0
    assert invoke("quantize", paths["model"], "-t", table, "-o", out, "--input-pixels", "--mean", "0.5,0.4,0.3",
                  "--std", "0.5,0.25,0.2", "-q").exit_code == 0
    np.savez(tmp_path / "pixels.npz", x=p)
    for data, name in ((paths["data"], "from_floats.npz"), (tmp_path / "pixels.npz", "from_pixels.npz")):
        result = invoke("exec", out, "-i", data, "-o", tmp_path / name, "-q")
        assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(np.load(tmp_path / "from_floats.npz")["y"], np.load(tmp_path / "from_pixels.npz")["y"])
    np.savez(tmp_path / "other.npz", x=_normalized(p) * 3)  # pixels up to ~3x255
    result = invoke("exec", out, "-i", tmp_path / "other.npz", "-o", tmp_path / "o.npz", "-q")
    assert_user_error(result, "input 'x': the float data give pixels from")
    assert "beyond 0 to 255" in result.stderr and "one sample at a time" not in result.stderr
    assert not (tmp_path / "o.npz").exists()
    result = invoke("verify", paths["model"], out, "-d", tmp_path / "other.npz", "-q")
    assert_user_error(result, "input 'x': the float data give pixels from")


def test_a_table_range_no_pixels_give_is_refused(files, tmp_path):
    """--input-pixels with a scale the calibration data were not made with: the table's input
    range [-1.6, 3.5] is beyond what pixels 0-255 give, so a uint8 input cannot hold it (quantize
    wrote the model without a word, and verify failed it at -1 dB)."""
    paths, _ = files
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", paths["model"], "-d", paths["data"], "-o", table, "-q").exit_code == 0
    result = invoke("quantize", paths["model"], "-t", table, "-o", tmp_path / "q.onnx", "--input-pixels",
                    "--scale", "0.001")
    assert_user_error(result, "--input-pixels: the table's range of input 'x' is [")
    assert "what pixels 0 to 255 give at --scale 0.001, --mean 0, --std 1" in result.stderr
    assert not (tmp_path / "q.onnx").exists()


def test_a_tensorrt_cache_table_takes_input_pixels(files, tmp_path):
    """A TensorRT cache keeps one threshold a tensor, so the input's range reads [-T, T]: checked as
    a bound on |x| (review: every such table was refused as 'other preprocessing')."""
    paths, _ = files
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", paths["model"], "-d", paths["data"], "-o", table, "-q").exit_code == 0
    assert invoke("convert-table", table, "-o", tmp_path / "t.cache").exit_code == 0
    result = invoke("quantize", paths["model"], "-t", tmp_path / "t.cache", "-o", tmp_path / "q.onnx",
                    "--input-pixels", "--mean", "0.5,0.4,0.3", "--std", "0.5,0.25,0.2", "-q")
    assert result.exit_code == 0, result.output
    result = invoke("quantize", paths["model"], "-t", tmp_path / "t.cache", "-o", tmp_path / "q.onnx",
                    "--input-pixels", "--scale", "0.001", "--mean", "0.5,0.4,0.3", "--std", "0.5,0.25,0.2")
    assert_user_error(result, "--input-pixels: the table's range of input 'x' is [")
    # a qtool table whose input happens to be symmetric keeps both ends checked (review: [-1, 1] passed
    # as a bound at mean 0, std 1, where pixels give [0, 1])
    from qtool.pixels import check_range

    with pytest.raises(QtoolError, match=r"is \[-1, 1\], beyond"):
        check_range("x", PixelInput((0.0,), (1.0,), 1 / 255), 3, -1.0, 1.0)
    check_range("x", PixelInput((0.0,), (1.0,), 1 / 255), 3, -1.0, 1.0, bound_only=True)


def test_float_data_a_little_beyond_the_pixels_are_clipped(files, tmp_path):
    """A float resize overshoots 0-255 by a few levels: clipped (within PIXEL_SLACK), not refused;
    quantize --data on data made otherwise says so as the data's error, not as onnxruntime's."""
    from qtool.pixels import PIXEL_SLACK

    paths, p = files
    info = {"mean": list(MEAN), "std": list(STD), "scale": SCALE}
    over = _normalized(p) + np.float32(3 * SCALE / 0.2)  # up to 3 to 7.5 levels beyond 255 (channels 2 to 0)
    np.testing.assert_array_equal(as_pixels(over, info, "x").max(), 255)
    far = _normalized(p) + np.float32((PIXEL_SLACK + 4) * SCALE / 0.2)
    with pytest.raises(QtoolError, match="beyond 0 to 255 by more than 16 levels"):
        as_pixels(far, info, "x")
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", paths["model"], "-d", paths["data"], "-o", table, "-q").exit_code == 0
    np.savez(tmp_path / "other.npz", x=_normalized(p) * 3)
    result = invoke("quantize", paths["model"], "-t", table, "-o", tmp_path / "q.onnx", "--input-pixels", "--mean",
                    "0.5,0.4,0.3", "--std", "0.5,0.25,0.2", "--data", tmp_path / "other.npz")
    assert_user_error(result, "input 'x': the float data give pixels from")
    assert "onnxruntime failed" not in result.stderr
