"""Calibration tables in other tools' formats: TPU-MLIR cali_table, TensorRT calibration cache,
onnxruntime calibration.json (qtool/table_formats.py, ``qtool convert-table``, ``calibrate
--format``, ``quantize --table-format``).

Expected values are literals, hand-computed bit patterns, or computed here with numpy, struct and
onnxruntime; the onnxruntime table is written by onnxruntime's own ``write_calibration_table``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from qtool.table import Table, TensorEntry, parse_table
from qtool.table_formats import detect_format, dumps_table, load_table, read_table, write_table
from test_cli import assert_no_crash, invoke, snapshot, user_error_leaves_nothing

FLOAT32_ROUNDING = 2.0 ** -24  # round to nearest float32: relative error at most half an ulp
TPU_MLIR_ROW = re.compile(r"\S+\s+[-0-9.e]+\s+[-0-9.e]+\s+[-0-9.e]+")  # TPU-MLIR's importer


def small_table(method: str = "minmax", **tensors: tuple[float, float, float]) -> Table:
    entries = {name: TensorEntry(lo, hi, thr, method) for name, (lo, hi, thr) in tensors.items()}
    return Table("m.onnx", "ab" * 32, method, 10, "0.1.0", entries)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- TPU-MLIR cali_table -----------------------------------------------------------------------------

def test_cali_table_round_trip_is_exact(tmp_path, demo_table):
    path = tmp_path / "digits_cali_table"
    write_table(demo_table, path)
    back = read_table(path)
    assert back == demo_table  # repr floats: every threshold, min and max to the last bit
    assert (back.model, back.model_sha256, back.method, back.samples) == (
        "digits_cnn.onnx", demo_table.model_sha256, "minmax", 256)
    assert len(back.model_sha256) == 64
    assert back.input_shapes == {"input": ["N", 1, 8, 8]}


def test_cali_table_keeps_what_only_qtool_reads(tmp_path, demo_table):
    """A table's image preprocessing, unbounded tensors and int16 ranges go into a cali_table as
    '# qtool ...' lines and come back (they were dropped without a word: a table calibrated on
    grey images then asked for --channels gray, an unbounded tensor was "not in the table");
    every row still reads as TPU-MLIR's importer reads one. A TensorRT cache cannot hold them:
    the CLI says what it leaves out."""
    from dataclasses import replace

    name = next(iter(demo_table.tensors))
    full = replace(demo_table, preprocess={"channels": "gray", "mean": [0.5], "std": [0.25], "scale": 1 / 255},
                   unbounded=["gone"], int16_ranges={name: (-1.25, 3.0000000000000004)})
    path = tmp_path / "digits_cali_table"
    write_table(full, path)
    text = path.read_text()
    assert "# qtool unbounded: [\"gone\"]" in text and "# qtool preprocess: {" in text
    rows = [line for line in text.splitlines() if not line.startswith("#")]
    assert rows and all(TPU_MLIR_ROW.fullmatch(line) for line in rows)
    assert read_table(path) == full
    # a table without them writes the bytes it wrote before
    write_table(demo_table, tmp_path / "plain_cali_table")
    assert "qtool unbounded" not in (tmp_path / "plain_cali_table").read_text()
    source = tmp_path / "full.yaml"
    write_table(full, source)
    result = invoke("convert-table", source, "-o", tmp_path / "t.cache")
    assert result.exit_code == 0, result.output
    assert ("warning: a TensorRT cache cannot hold the tensors without a range (unbounded), the int16 ranges, "
            "the image preprocessing: they are left out") in result.stderr
    result = invoke("convert-table", source, "-o", tmp_path / "again_cali_table")
    assert result.exit_code == 0 and "warning" not in result.stderr, result.output


def test_cali_table_text_follows_tpu_mlir(tmp_path):
    table = small_table(input=(0.0, 1.0, 1.0), conv_out=(-3.25, 1e20, 1e20), tiny=(0.0, 1.5e-7, 1.5e-7))
    text = dumps_table(table, "cali_table")
    lines = text.splitlines()
    assert "" not in lines  # TPU-MLIR's importer refuses blank lines
    assert all(TPU_MLIR_ROW.fullmatch(line) or line.startswith("#") for line in lines)
    assert lines[-3:] == ["input 1.0 0.0 1.0", "conv_out 1e20 -3.25 1e20", "tiny 1.5e-07 0.0 1.5e-07"]
    assert "# model sha256: " + "ab" * 32 in lines
    assert "# quantization threshold calculation method: minmax" in lines
    assert "# sample number: 10" in lines
    assert read_table(write(tmp_path / "t_cali_table", text)) == table


def test_reads_a_table_as_tpu_mlir_writes_it(tmp_path):
    # the layout of TPU-MLIR's run_calibration output, with the int4 section newer versions append
    path = write(tmp_path / "resnet_cali_table", """\
# mlir version: 1.3 cali version 1.0
# mlir: resnet18.mlir
# genetated time: 2022-08-11 10:00:59.743675
# quantization threshold calculation method: kl
# histogram number: 2048
# sample number: 100
###
# tune number: 5
###
# op_name    threshold    min    max
images 1.0000080 0.0000000 1.0000080
122_Conv 56.4281803 -102.5830231 97.6811752

#int4_th
images 0.5 -0.5714286 0.5
""")
    table = read_table(path)
    assert (table.model, table.model_sha256, table.method, table.samples) == ("resnet18.mlir", "", "kl", 100)
    assert table.tensors == {"images": TensorEntry(0.0, 1.000008, 1.000008, "kl"),
                             "122_Conv": TensorEntry(-102.5830231, 97.6811752, 56.4281803, "kl")}


# -- TensorRT calibration cache -----------------------------------------------------------------------

def test_trt_lines_are_hand_computed_bit_patterns():
    table = small_table(a=(-127.0, 127.0, 127.0), b=(0.0, 254.0, 254.0), c=(-1.0, 1.0, 1.0),
                        d=(0.0, 0.0, 0.0))
    assert dumps_table(table, "trt").splitlines() == [
        "TRT-8601-MinMaxCalibration",
        "a: 3f800000",  # 127/127 = 1.0: sign 0, exponent 127 (0x7f << 23), fraction 0
        "b: 40000000",  # 254/127 = 2.0: exponent 128
        "c: 3c010204",  # 1/127 = 2^-7 (1 + 1/127): exponent 120 (0x3c0...), fraction round(2^23/127) = 0x10204
        "d: 00000000",
    ]
    assert dumps_table(small_table("kl", a=(-1.0, 1.0, 1.0)), "trt").splitlines()[0] == (
        "TRT-8601-EntropyCalibration2")


def test_trt_cache_reads_scale_times_127(tmp_path):
    path = write(tmp_path / "calib.cache", "TRT-8510-EntropyCalibration2\n"
                 "input: 3f800000\n(Unnamed Layer* 3) [Convolution]_output: 3C010204\n")
    table = read_table(path)
    assert table.method == "kl" and table.model_sha256 == ""
    assert table.tensors["input"] == TensorEntry(-127.0, 127.0, 127.0, "kl")
    scale = float(np.float32(1 / 127))
    assert table.tensors["(Unnamed Layer* 3) [Convolution]_output"].threshold == scale * 127


def test_trt_round_trip_keeps_thresholds_to_float32_rounding(tmp_path, demo_table):
    path = tmp_path / "digits.cache"
    write_table(demo_table, path)
    back = read_table(path)
    assert list(back.tensors) == list(demo_table.tensors)
    errors = []
    for name, entry in demo_table.tensors.items():
        threshold = back.tensors[name].threshold
        # the cache stores float32(threshold / 127): one rounding to float32, half an ulp at most
        errors.append(abs(threshold - entry.threshold) / entry.threshold)
        assert threshold == float(np.float32(entry.threshold / 127)) * 127
        assert (back.tensors[name].min, back.tensors[name].max) == (-threshold, threshold)
    assert max(errors) <= FLOAT32_ROUNDING < 1e-6
    assert max(errors) > 0  # the thresholds are not all float32/127 by chance: rounding happened


# -- onnxruntime calibration.json ----------------------------------------------------------------

@pytest.fixture(scope="module")
def ort_calibration(tmp_path_factory, demo_model, demo_calib):
    """calibration.json written by onnxruntime's own MinMax calibrator and write_calibration_table,
    with the first 64 calibration samples; and those samples."""
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, create_calibrator
    from onnxruntime.quantization.quant_utils import write_calibration_table

    folder = tmp_path_factory.mktemp("ort")
    x = np.load(demo_calib)["input"][:64]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"input": x[i:i + 16]} for i in range(0, len(x), 16)])

        def get_next(self):
            return next(self.batches, None)

    calibrator = create_calibrator(demo_model, augmented_model_path=str(folder / "augmented.onnx"),
                                   calibrate_method=CalibrationMethod.MinMax)
    calibrator.collect_data(Reader())
    write_calibration_table(calibrator.compute_data(), dir=str(folder))
    return folder / "calibration.json", x


def test_reads_onnxruntime_calibration_json(ort_calibration, demo_model):
    path, x = ort_calibration
    raw = json.loads(path.read_text())
    assert raw["CLS"] == "TensorsData"  # the layout this onnxruntime writes
    table, fmt = load_table(path)
    assert fmt == "ort"
    assert table.method == "minmax" and table.model_sha256 == ""
    assert set(table.tensors) == set(raw["data"])
    assert table.tensors["input"] == TensorEntry(float(x.min()), float(x.max()), float(x.max()), "minmax")
    # logits computed here by onnxruntime on the float model
    session = ort.InferenceSession(str(demo_model), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], {"input": x})[0]
    entry = table.tensors["logits"]
    assert entry.min == pytest.approx(float(logits.min()), rel=1e-6)
    assert entry.max == pytest.approx(float(logits.max()), rel=1e-6)
    assert entry.threshold == max(abs(entry.min), abs(entry.max))
    for name, entry in table.tensors.items():
        assert entry.min == raw["data"][name]["lowest"]["data"][0]
        assert entry.max == raw["data"][name]["highest"]["data"][0]


@pytest.mark.parametrize("command", ["quantize", "convert-table"])
def test_onnxruntime_calibration_cache_is_refused_for_the_json(tmp_path, ort_calibration, demo_model, command):
    cache = ort_calibration[0].parent / "calibration.cache"  # written beside calibration.json
    assert all(len(line.split()) == 2 for line in cache.read_text().splitlines())  # 'name max' lines
    args = (["quantize", demo_model, "-t", cache, "-o", tmp_path / "q.onnx"] if command == "quantize"
            else ["convert-table", cache, "-o", tmp_path / "t.yaml"])
    line = user_error_leaves_nothing(tmp_path, *args)
    assert line == (f"error: table file '{cache}' is onnxruntime's calibration.cache, which keeps only each "
                    f"tensor's maximum (no minimum); pass the calibration.json written beside it")


@pytest.mark.parametrize("content", [
    {"conv_out": [-2.5, 1.5], "relu_out": [0.0, 1.5]},
    {"conv_out": {"lowest": -2.5, "highest": 1.5, "CLS": "TensorData"},
     "relu_out": {"lowest": {"data": 0.0, "dtype": "float32", "CLS": "numpy.array"},
                  "highest": {"data": [1.5], "dtype": "float32", "CLS": "numpy.array"},
                  "CLS": "TensorData"}},
], ids=["pairs", "tensor-data"])
def test_reads_plain_onnxruntime_shapes(tmp_path, content):
    table = read_table(write(tmp_path / "calibration.json", json.dumps(content)))
    assert table.tensors == {"conv_out": TensorEntry(-2.5, 1.5, 2.5, "unknown"),
                             "relu_out": TensorEntry(0.0, 1.5, 1.5, "unknown")}


# -- detection -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, text, expected", [
    ("t.yaml", "qtool_table: 1\n", "yaml"),
    ("table", "qtool_table: 1\nmodel: m\n", "yaml"),
    ("t.json", '{"qtool_table": 1}', "json"),
    ("t.json", '{"x": [0.0, 1.0]}', "ort"),
    ("calibration", '{"CLS": "TensorsData", "data": {}}', "ort"),
    ("calib.cache", "TRT-8601-MinMaxCalibration\nx: 3f800000\n", "trt"),
    ("t.yaml", "TRT-8601-MinMaxCalibration\n", "trt"),
    ("m_cali_table", "# genetated time: now\nx 1.0 -1.0 1.0\n", "cali_table"),
    ("t.txt", "x 1.0 -1.0 1.0\n", "cali_table"),
])
def test_detect_format(name, text, expected):
    assert detect_format(Path(name), text) == expected


def test_format_override(tmp_path):
    path = write(tmp_path / "looks.yaml", "x 2.0 -1.0 2.0\n")  # a cali_table under a YAML name
    table, fmt = load_table(path, "cali_table")
    assert fmt == "cali_table" and table.tensors == {"x": TensorEntry(-1.0, 2.0, 2.0, "unknown")}


def test_writing_twice_gives_identical_bytes(tmp_path, demo_table):
    for fmt in ("yaml", "json", "cali_table", "trt"):
        first, second = tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"
        write_table(demo_table, first, fmt)
        write_table(demo_table, second, fmt)
        assert first.read_bytes() == second.read_bytes()


# -- the command line ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tables(tmp_path_factory, demo_table, ort_calibration):
    """The demo table in every readable format, by format."""
    folder = tmp_path_factory.mktemp("tables")
    paths = {"yaml": folder / "t.yaml", "json": folder / "t.json", "cali_table": folder / "t_cali_table",
             "trt": folder / "t.cache"}
    for path in paths.values():
        write_table(demo_table, path)
    return {**paths, "ort": ort_calibration[0]}


@pytest.mark.parametrize("fmt", ["yaml", "json", "cali_table", "trt", "ort"])
def test_quantize_from_each_format(tmp_path, demo_model, demo_heldout, tables, fmt):
    output = tmp_path / "q.onnx"
    result = invoke("quantize", demo_model, "--table", tables[fmt], "-o", output)
    assert_no_crash(result)
    assert result.exit_code == 0, result.output
    if fmt in ("trt", "ort"):  # no model digest in these
        assert result.stderr == (f"warning: {tables[fmt]} carries no model digest: it cannot be "
                                 f"matched to model '{demo_model.name}' (make sure it was made for it)\n")
    else:
        assert result.stderr == ""  # cali_table keeps qtool's digest in a comment
    data = np.load(demo_heldout)
    session = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input": data["input"]})[0]
    assert logits.shape == (len(data["label"]), 10)
    assert np.mean(logits.argmax(-1) == data["label"]) > 0.95


def test_quantize_table_format_override(tmp_path, demo_model, tables):
    disguised = tmp_path / "table.yaml"
    disguised.write_bytes(tables["cali_table"].read_bytes())
    result = invoke("quantize", demo_model, "-t", disguised, "--table-format", "cali_table",
                    "-o", tmp_path / "q.onnx")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""


@pytest.mark.parametrize("args, suffix, first_line", [
    (["--format", "cali_table"], "out.txt", "# qtool calibration table in TPU-MLIR cali_table format"),
    (["--format", "trt"], "out.txt", "TRT-8601-MinMaxCalibration"),
    ([], "calib.cache", "TRT-8601-MinMaxCalibration"),
    ([], "digits_cali_table", "# qtool calibration table in TPU-MLIR cali_table format"),
    (["--format", "yaml"], "out.json", "qtool_table: 1"),
])
def test_calibrate_output_format(tmp_path, demo_model, demo_calib, args, suffix, first_line):
    output = tmp_path / suffix
    result = invoke("calibrate", demo_model, "-d", demo_calib, "-o", output, "-q", *args)
    assert result.exit_code == 0, result.output
    assert output.read_text().splitlines()[0] == first_line
    assert [p.name for p in tmp_path.iterdir()] == [suffix]


def test_calibrate_unknown_format_fails_first(tmp_path, demo_model, demo_calib):
    user_error_leaves_nothing(tmp_path, "calibrate", demo_model, "-d", demo_calib,
                              "-o", tmp_path / "t.yaml", "--format", "onnx",
                              expect=["table format 'onnx'", "yaml, json, cali_table, trt"])


def test_convert_table_chain(tmp_path, tables, demo_table):
    cali, cache, back = tmp_path / "m_cali_table", tmp_path / "m.cache", tmp_path / "back.yaml"
    result = invoke("convert-table", tables["yaml"], "-o", cali)
    assert_no_crash(result)
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr == f"converted 14 tensors: qtool YAML -> TPU-MLIR cali_table -> {cali}\n"
    assert invoke("convert-table", cali, "-o", cache).exit_code == 0
    assert cache.read_bytes() == tables["trt"].read_bytes()  # same bytes as written from YAML directly
    assert invoke("convert-table", cache, "-o", back).exit_code == 0
    data = yaml.safe_load(back.read_text())
    assert data["qtool_table"] == 1 and data["model_sha256"] == ""
    for name, entry in demo_table.tensors.items():
        assert data["tensors"][name]["threshold"] == pytest.approx(entry.threshold, rel=FLOAT32_ROUNDING)


def test_convert_table_from_and_to_override(tmp_path):
    source = write(tmp_path / "plain.txt", "x 127.0 -1.0 2.0\n")
    output = tmp_path / "out.bin"
    result = invoke("convert-table", source, "--from", "cali_table", "-o", output, "--to", "trt")
    assert result.exit_code == 0, result.output
    assert output.read_text() == "TRT-8601-MinMaxCalibration\nx: 3f800000\n"


def test_convert_table_cannot_write_ort(tmp_path, tables):
    user_error_leaves_nothing(tmp_path, "convert-table", tables["yaml"], "-o", tmp_path / "c.json",
                              "--to", "ort", expect=["'ort'", "read only", "yaml, json, cali_table, trt"])


def test_convert_table_help_has_examples():
    result = invoke("convert-table", "--help")
    assert result.exit_code == 0
    assert "Examples" in result.stdout and "qtool convert-table table.yaml -o calib.cache" in result.stdout


BAD_FILES = [
    ("bad.cache", "TRT-8601-EntropyCalibration2\ninput: 3f800000\nconv_out: 3g800000\n",
     ["line 3", "'3g800000'", "hex"]),
    ("bad.cache", "TRT-8601-EntropyCalibration2\ninput: 3f800000 1\n", ["line 2", "'3f800000 1'"]),
    ("bad.cache", "TRT-8601-EntropyCalibration2\n\ninput 3f800000\n", ["line 3", "TENSOR_NAME: HEX"]),
    ("bad.cache", "TRT-8601-EntropyCalibration2\ninput: bf800000\n", ["line 2", "negative scale -1.0"]),
    ("bad.cache", "TRT-8601-EntropyCalibration2\ninput: 7fc00000\n", ["line 2", "non-finite"]),
    ("bad.cache", "TRT-8601-EntropyCalibration2\ninput: 3f800000\ninput: 40000000\n",
     ["line 3", "tensor 'input' is already on line 2"]),
    ("bad_cali_table", "# sample number: 3\ninput 1.0 0.0 1.0\nconv_out 2.0 -1.0\n",
     ["line 3", "expected 4 columns", "got 3"]),
    ("bad_cali_table", "#\ninput 1.0 0.0 1.0 7\n", ["line 2", "expected 4 columns", "got 5"]),
    ("bad_cali_table", "# x\ninput 1.0 abc 1.0\n", ["line 2", "'abc' is not a number"]),
    ("bad_cali_table", "# x\ninput nan 0.0 1.0\n", ["line 2", "non-finite"]),
    ("bad_cali_table", "# x\n\ninput -1.0 0.0 1.0\n", ["line 3", "negative threshold -1.0"]),
    ("bad_cali_table", "# x\ninput 1.0 2.0 1.0\n", ["line 2", "min 2.0 is above max 1.0"]),
    ("bad_cali_table", "# sample number: many\ninput 1.0 0.0 1.0\n", ["line 1", "'many'"]),
    ("calibration.json", '{"input": [0.0, 1.0],\n "conv": [0.0, NaN]}', ["tensor 'conv'", "non-finite"]),
    ("calibration.json", '{"input": [0.0, 1.0],\n "conv": }', ["line 2", "not valid JSON"]),
    ("calibration.json", '{"input": {"lowest": {"data": [0.0, 1.0], "CLS": "numpy.array"}, "highest": 1.0}}',
     ["tensor 'input'", "per-channel"]),
    # sweep 9: a YAML list was taken for onnxruntime's calibration.cache; an entry's missing or wrong
    # key was 'needs numbers min, max, threshold and a method' whatever it was
    ("list.yaml", "- 1\n- 2\n", ["is not a qtool calibration table"]),
    ("t.yaml", "qtool_table: 1\nmodel: m\nmodel_sha256: ''\nmethod: minmax\nsamples: 1\nqtool_version: x\n"
               "tensors:\n  a: {min: 2.0, max: 1.0, threshold: 2.0}\n", ["tensor 'a' has no method"]),
    ("t.yaml", "qtool_table: 1\nmodel: m\nmodel_sha256: ''\nmethod: minmax\nsamples: 1\nqtool_version: x\n"
               "tensors:\n  a: {min: x, max: 1.0, threshold: 2.0, method: minmax}\n", ["tensor 'a' min is not a number"]),
    ("t.yaml", "qtool_table: 1\nmodel: m\nmodel_sha256: ''\nmethod: minmax\nsamples: 1\nqtool_version: x\n"
               "tensors:\n  a: 5\n", ["tensor 'a' is not an entry"]),
]


@pytest.mark.parametrize("name, text, expect", BAD_FILES)
def test_quantize_rejects_malformed_table(tmp_path, demo_model, name, text, expect):
    table = write(tmp_path / name, text)
    user_error_leaves_nothing(tmp_path, "quantize", demo_model, "--table", table,
                              "-o", tmp_path / "q.onnx", expect=[f"table file '{table}'", *expect])


@pytest.mark.parametrize("name, text, expect", BAD_FILES[:1] + BAD_FILES[6:7])
def test_convert_table_rejects_malformed_table(tmp_path, name, text, expect):
    table = write(tmp_path / name, text)
    user_error_leaves_nothing(tmp_path, "convert-table", table, "-o", tmp_path / "out.yaml",
                              expect=[f"table file '{table}'", *expect])


def test_console_script_malformed_table_is_one_line(tmp_path):
    import subprocess
    import sys

    table = write(tmp_path / "bad.cache", "TRT-8601-MinMaxCalibration\nx: zz\n")
    qtool = Path(sys.executable).parent / "qtool"
    result = subprocess.run([str(qtool), "convert-table", str(table), "-o", str(tmp_path / "o.yaml")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == f"error: table file '{table}', line 2: 'zz' is not a float32 scale in 8 hex digits\n"
    assert snapshot(tmp_path) == [Path("bad.cache")]


@pytest.mark.skipif(not getattr(yaml, "__with_libyaml__", False), reason="PyYAML without libyaml")
@settings(max_examples=200, deadline=None)
@given(names=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6, unique=True),
       values=st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=3, max_size=3),
       model=st.text(max_size=30))
def test_libyaml_writes_and_reads_what_pure_python_yaml_does(names, values, model):
    """qtool writes tables with libyaml's emitter where PyYAML has it (unless a string is not
    printable): a machine without it must write the same bytes, and read them back the same."""
    lo, hi, threshold = min(values[:2]), max(values[:2]), abs(values[2])
    table = Table(model, "", "minmax", len(names), "0.1.0", tensors={
        name: TensorEntry(lo, hi, threshold, "minmax") for name in names})
    fast = table.dumps()
    plain = yaml.safe_dump(table.to_dict(), sort_keys=False, width=120)
    assert fast == plain
    assert yaml.load(fast, Loader=yaml.CSafeLoader) == yaml.safe_load(plain)
    assert parse_table(Path("t.yaml"), fast) == table


@pytest.mark.parametrize("name, text, kind", [
    ("empty.cache", "TRT-8601-MinMaxCalibration\n", "TensorRT calibration cache"),
    ("empty_cali_table", "# qtool calibration table in TPU-MLIR cali_table format\n###\n", "TPU-MLIR cali_table"),
    ("empty.json", "{}\n", "onnxruntime calibration.json"),
])
def test_a_table_of_no_tensor_is_refused(tmp_path, name, text, kind):
    """Sweep 9: these converted with exit 0 ('converted 0 tensors'); quantize failed on them later."""
    result = invoke("convert-table", write(tmp_path / name, text), "-o", tmp_path / "t.yaml")
    said = f"table file '{tmp_path / name}' ({kind}) holds no tensor"
    assert result.exit_code == 2 and said in result.stderr, result.output
    assert not (tmp_path / "t.yaml").exists()
