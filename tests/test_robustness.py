"""Robustness battery: bad inputs to every command that reads files.

Each case of ``CASES`` must fail as a user error: exit code 2, exactly one ``error: ...`` line on
stderr naming the problem and the file, key, tensor or node, nothing on stdout, no traceback, and
nothing left behind: neither the ``-o`` file nor a temporary file beside it (the whole case folder is
compared before and after). The checks are test_cli.py's ``user_error_leaves_nothing``, run through
typer's CliRunner, which captures stderr apart from stdout; usage errors that only the console script
turns into one line run as a subprocess of it.

A case is ``(id, command arguments, files to create, expected fragments of the message)``. Arguments
and fragments are templates: ``{tmp}`` is the case's folder, ``{model}``, ``{calib}``, ``{heldout}``
the demo files, ``{table}``, ``{qmodel}``, ``{stats}``, ``{stats_kl}`` good artifacts made once for
the module. A file maker takes the same mapping and returns the file's bytes; a name ending in "/"
is a folder.

Two inputs are not errors and have their own tests below: a tensor that is zero everywhere and a
table made for another model.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from test_cli import assert_no_crash, invoke, snapshot, user_error_leaves_nothing

Maker = Callable[[dict], bytes]


class Case(NamedTuple):
    id: str
    args: list[str]
    files: dict[str, Maker | None]
    expect: list[str]
    console: bool = False  # run the installed console script instead of the CliRunner


# -- file makers -------------------------------------------------------------------------------------

def text(content: str) -> Maker:
    return lambda ctx: content.encode()


def raw(content: bytes) -> Maker:
    return lambda ctx: content


def npz(**arrays) -> Maker:
    def make(ctx):
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()
    return make


def images(n: int = 10, width: int = 8, at: tuple | None = None, value: float = 0.0) -> np.ndarray:
    """Inputs shaped like the demo model's ([N,1,8,8] float32), with ``value`` at index ``at``
    (sample, channel, row, column)."""
    x = np.random.default_rng(0).random((n, 1, 8, width), dtype=np.float32)
    if at is not None:
        x[at] = value
    return x


def objects() -> np.ndarray:
    a = np.empty(3, dtype=object)
    a[:] = [1, "a", None]
    return a


def first_half(key: str) -> Maker:
    def make(ctx):
        whole = Path(ctx[key]).read_bytes()
        return whole[:len(whole) // 2]
    return make


def copy_of(key: str) -> Maker:
    return lambda ctx: Path(ctx[key]).read_bytes()


def table_edit(edit: Callable[[dict], None]) -> Maker:
    """The module's good table, edited."""
    def make(ctx):
        data = yaml.safe_load(Path(ctx["table"]).read_text())
        edit(data)
        return yaml.safe_dump(data, sort_keys=False).encode()
    return make


def stats_edit(edit: Callable[[dict], None], key: str = "stats") -> Maker:
    """One of the module's good statistics files (calibrate --stats-out), its arrays edited."""
    def make(ctx):
        with np.load(ctx[key]) as loaded:
            arrays = {k: loaded[k] for k in loaded.files}
        edit(arrays)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()
    return make


def set_header(**changes) -> Callable[[dict], None]:
    def edit(arrays):
        header = json.loads(str(arrays["header"]))
        for key, value in changes.items():
            if value is None:
                del header[key]
            else:
                header[key] = value
        arrays["header"] = np.array(json.dumps(header))
    return edit


def drop_state(arrays: dict) -> None:
    for key in [k for k in arrays if k.startswith("0.")]:
        del arrays[key]


def fewer_bins(arrays: dict) -> None:
    """The first tensor's histogram claims 3 bins but holds counts for 2048."""
    arrays["0.integers"] = np.array([3, 1, 0])


def external_model(location: str | Callable[[dict], str], length: int = 16) -> Maker:
    """``y = x + w`` with ``w`` (4 floats) stored as external data at ``location``."""
    def make(ctx):
        w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4])
        w.data_location = TensorProto.EXTERNAL
        where = location(ctx) if callable(location) else location
        for key, value in (("location", where), ("offset", "0"), ("length", str(length))):
            entry = w.external_data.add()
            entry.key, entry.value = key, value
        graph = helper.make_graph(
            [helper.make_node("Add", ["x", "w"], ["y"], name="add")], "external",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], [w])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
        return model.SerializeToString()
    return make


SECRET = np.arange(4, dtype=np.float32).tobytes()  # what a hostile model would like to read


def png(pixels: np.ndarray) -> Maker:
    def make(ctx):
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        return buffer.getvalue()
    return make


def job(**content) -> Maker:
    """A job file: the demo model and calibration data, with ``content`` on top; string values are
    templates (``{tmp}``, ``{model}``, ...) and a value of None drops the key."""
    def make(ctx):
        data = {"model": "{model}", "output_dir": "{tmp}/out", "calibrate": {"data": "{calib}"}}
        data.update(content)
        return yaml.safe_dump(fill({k: v for k, v in data.items() if v is not None}, ctx),
                              sort_keys=False).encode()
    return make


def fill(value, ctx):
    if isinstance(value, str):
        return value.format(**ctx)
    if isinstance(value, dict):
        return {k: fill(v, ctx) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, ctx) for v in value]
    return value


# -- the battery -------------------------------------------------------------------------------------

CAL = ["calibrate", "{model}", "-d", "{calib}", "-o", "{tmp}/t.yaml"]
QUANT = ["quantize", "{model}", "-t", "{table}", "-o", "{tmp}/q.onnx"]
VER = ["verify", "{model}", "{qmodel}", "-d", "{heldout}", "-q"]
EXEC = ["exec", "{qmodel}", "-i", "{heldout}", "-o", "{tmp}/y.npz"]
RUN = ["run", "{tmp}/job.yaml", "-q"]
FILE = {"file.txt": text("a regular file where a folder is needed\n")}
BAD_DATA = "{tmp}/d.npz"


def calibrate_data(maker: Maker) -> tuple[list[str], dict]:
    return ["calibrate", "{model}", "-d", BAD_DATA, "-o", "{tmp}/t.yaml"], {"d.npz": maker}


CASES = [
    # models
    Case("calibrate-missing-model", ["calibrate", "{tmp}/nosuch.onnx", *CAL[2:]], {},
         ["model file '{tmp}/nosuch.onnx' not found"]),
    Case("calibrate-model-is-text", ["calibrate", "{tmp}/m.onnx", *CAL[2:]],
         {"m.onnx": text("this is not an ONNX model\n")},
         ["model file '{tmp}/m.onnx'", "not a valid ONNX model"]),
    Case("calibrate-model-is-truncated", ["calibrate", "{tmp}/m.onnx", *CAL[2:]],
         {"m.onnx": first_half("model")}, ["model file '{tmp}/m.onnx'", "not a valid ONNX model"]),
    Case("calibrate-model-is-a-directory", ["calibrate", "{tmp}/m.onnx", *CAL[2:]],
         {"m.onnx/": None}, ["model file '{tmp}/m.onnx' is a directory"]),
    Case("calibrate-external-data-outside-folder", ["calibrate", "{tmp}/m/m.onnx", *CAL[2:]],
         {"secret.bin": raw(SECRET), "m/m.onnx": external_model("../secret.bin")},
         ["model file '{tmp}/m/m.onnx'", "tensor 'w'", "'../secret.bin'", "outside the model's folder"]),
    Case("quantize-external-data-absolute-path", ["quantize", "{tmp}/m/m.onnx", *QUANT[2:]],
         {"secret.bin": raw(SECRET),
          "m/m.onnx": external_model(lambda ctx: str(Path(ctx["tmp"]) / "secret.bin"))},
         ["model file '{tmp}/m/m.onnx'", "tensor 'w'", "'{tmp}/secret.bin'", "absolute path"]),
    Case("exec-external-data-file-missing", ["exec", "{tmp}/m.onnx", *EXEC[2:]],
         {"m.onnx": external_model("weights.bin")},
         ["model file '{tmp}/m.onnx'", "cannot read its external data"]),
    Case("quantize-missing-model", ["quantize", "{tmp}/nosuch.onnx", *QUANT[2:]], {},
         ["model file '{tmp}/nosuch.onnx' not found"]),
    Case("verify-missing-qmodel", ["verify", "{model}", "{tmp}/nosuch.q.onnx", *VER[3:]], {},
         ["model file '{tmp}/nosuch.q.onnx' not found"]),
    Case("verify-qmodel-is-truncated", ["verify", "{model}", "{tmp}/q.onnx", *VER[3:]],
         {"q.onnx": first_half("qmodel")}, ["model file '{tmp}/q.onnx'", "not a valid ONNX model"]),
    Case("verify-qmodel-of-another-model", ["verify", "{model}", "{tmp}/other.q.onnx", *VER[3:]],
         {"other.q.onnx": copy_of("other_qmodel")},
         ["quantized model '{tmp}/other.q.onnx' has input 'x'", "float model '{model}' lacks",
          "inputs: input"]),
    Case("exec-missing-model", ["exec", "{tmp}/nosuch.onnx", *EXEC[2:]], {},
         ["model file '{tmp}/nosuch.onnx' not found"]),
    Case("exec-model-is-text", ["exec", "{tmp}/q.onnx", *EXEC[2:]],
         {"q.onnx": text("hello\n")}, ["model file '{tmp}/q.onnx'", "not a valid ONNX model"]),

    # data
    Case("calibrate-missing-data", ["calibrate", "{model}", "-d", "{tmp}/nosuch.npz", *CAL[4:]], {},
         ["data file '{tmp}/nosuch.npz' not found"]),
    Case("calibrate-zero-samples", *calibrate_data(npz(input=np.zeros((0, 1, 8, 8), np.float32))),
         ["data file '{tmp}/d.npz'", "input 'input' is empty"]),
    Case("calibrate-npz-without-arrays", *calibrate_data(npz()),
         ["data file '{tmp}/d.npz' holds no arrays"]),
    Case("calibrate-nan-sample", *calibrate_data(npz(input=images(at=(3, 0, 2, 2), value=np.nan))),
         ["data file '{tmp}/d.npz'", "input 'input' has NaN or Inf", "sample 3"]),
    Case("calibrate-inf-sample", *calibrate_data(npz(input=images(at=(7, 0, 0, 5), value=-np.inf))),
         ["data file '{tmp}/d.npz'", "input 'input' has NaN or Inf", "sample 7"]),
    Case("calibrate-wrong-shape", *calibrate_data(npz(input=images(width=9))),
         ["data file '{tmp}/d.npz'", "'input'", "[10, 1, 8, 9]", "[N,1,8,8]"]),
    Case("calibrate-wrong-rank", *calibrate_data(npz(input=np.zeros((10, 8, 8), np.float32))),
         ["data file '{tmp}/d.npz'", "'input'", "[10, 8, 8]", "[N,1,8,8]"]),
    Case("calibrate-int64-data", *calibrate_data(npz(input=np.ones((10, 1, 8, 8), np.int64))),
         ["data file '{tmp}/d.npz'", "input 'input' has dtype int64", "expects float32"]),
    Case("calibrate-string-data", *calibrate_data(npz(input=np.array(["a", "bc"]))),
         ["data file '{tmp}/d.npz'", "input 'input' has dtype <U2", "expected numbers"]),
    Case("calibrate-wrong-input-name", *calibrate_data(npz(image=images(), label=np.arange(10))),
         ["data file '{tmp}/d.npz' has no array for model input 'input'", "arrays: image, label"]),
    Case("calibrate-pickled-objects", *calibrate_data(npz(input=objects())),
         ["data file '{tmp}/d.npz' holds pickled objects (object arrays); refusing"]),
    Case("calibrate-empty-data-folder", ["calibrate", "{model}", "-d", "{tmp}/empty", *CAL[4:]],
         {"empty/": None}, ["data folder '{tmp}/empty' holds no .npy, .npz or image files"]),
    Case("calibrate-image-folder-with-non-image",
         ["calibrate", "{model}", "-d", "{tmp}/images", *CAL[4:], "--channels", "gray", "-q"],
         {"images/a.png": png(np.zeros((8, 8), np.uint8)), "images/b.png": text("not an image\n")},
         ["image '{tmp}/images/b.png' cannot be read"]),
    Case("verify-inf-sample", [*VER[:4], BAD_DATA, "-q"],
         {"d.npz": npz(input=images(at=(5, 0, 0, 0), value=np.inf))},
         ["data file '{tmp}/d.npz'", "NaN or Inf", "sample 5"]),
    Case("verify-unknown-labels", [*VER, "--labels", "nosuch"], {},
         ["labels array 'nosuch'", "'{heldout}'", "arrays: input, label"]),
    Case("verify-labels-of-another-length", [*VER[:4], BAD_DATA, "-q", "--labels", "label"],
         {"d.npz": npz(input=images(20), label=np.arange(5))},
         ["data file '{tmp}/d.npz' labels array 'label' has shape [5]",
          "one integer class per sample ([20])"]),
    Case("verify-labels-not-integers", [*VER[:4], BAD_DATA, "-q", "--labels", "label"],
         {"d.npz": npz(input=images(3), label=np.array(["cat", "dog", "cat"]))},
         ["data file '{tmp}/d.npz' labels array 'label'", "dtype <U3"]),
    Case("exec-wrong-input-name", [*EXEC[:3], BAD_DATA, *EXEC[4:]],
         {"d.npz": npz(a=images(), b=images())},
         ["data file '{tmp}/d.npz' has no array for model input 'input'", "arrays: a, b"]),
    Case("exec-nan-input", [*EXEC[:3], BAD_DATA, *EXEC[4:]],
         {"d.npz": npz(input=images(at=(0, 0, 1, 1), value=np.nan))},
         ["data file '{tmp}/d.npz'", "NaN or Inf", "sample 0"]),
    Case("exec-pickled-input", [*EXEC[:3], BAD_DATA, *EXEC[4:]], {"d.npz": npz(input=objects())},
         ["data file '{tmp}/d.npz' holds pickled objects"]),

    # options
    Case("calibrate-negative-num-samples", [*CAL, "--num-samples", "-3"], {},
         ["number of samples must be >= 1, got -3"]),
    Case("calibrate-zero-batch-size", [*CAL, "--batch-size", "0"], {},
         ["batch size must be >= 1, got 0"]),
    Case("calibrate-unknown-method", [*CAL, "--method", "nosuch"], {},
         ["calibration method 'nosuch'", "minmax"]),
    Case("calibrate-bad-method-parameter", [*CAL, "--method", "percentile", "--param", "percentile=abc"],
         {}, ["parameter 'percentile' of method 'percentile'", "'abc'"]),
    Case("quantize-unknown-format", [*QUANT, "--format", "qlinear"], {},
         ["unknown format 'qlinear'", "qdq, qoperator"]),
    Case("quantize-keep-float-matches-nothing", [*QUANT, "--keep-float", "conv9", "--keep-float", "Relu"],
         {}, ["--keep-float: 'conv9' is neither an op type nor a node name of the prepared model"]),
    Case("verify-bad-tolerance", [*VER, "--tolerance", "abc"], {}, ["tolerance", "'abc'"]),
    Case("console-non-integer-num-samples", [*CAL, "--num-samples", "many"], {},
         ["Invalid value for '--num-samples'", "is not a valid int"], console=True),
    Case("console-merge-without-files", ["merge", "-o", "{tmp}/t.yaml"], {},
         ["Missing argument"], console=True),

    # outputs that cannot be written
    Case("calibrate-output-under-a-file", [*CAL[:5], "{tmp}/file.txt/t.yaml", "-q"], FILE,
         ["cannot write '{tmp}/file.txt/t.yaml'", "'{tmp}/file.txt' is not a directory"]),
    Case("calibrate-output-is-a-directory", [*CAL[:5], "{tmp}/out", "-q"], {"out/": None},
         ["cannot write '{tmp}/out': it is a directory"]),
    Case("quantize-output-under-a-file", [*QUANT[:5], "{tmp}/file.txt/q.onnx"], FILE,
         ["cannot write '{tmp}/file.txt/q.onnx'"]),
    Case("quantize-params-out-under-a-file", [*QUANT, "--params-out", "{tmp}/file.txt/p.json"], FILE,
         ["cannot write '{tmp}/file.txt/p.json'"]),
    Case("verify-report-under-a-file", [*VER, "--report", "{tmp}/file.txt/r.html"], FILE,
         ["cannot write '{tmp}/file.txt/r.html'"]),
    Case("exec-output-under-a-file", [*EXEC[:5], "{tmp}/file.txt/y.npz"], FILE,
         ["cannot write '{tmp}/file.txt/y.npz'"]),
    Case("merge-output-under-a-file", ["merge", "{stats}", "-o", "{tmp}/file.txt/t.yaml"], FILE,
         ["cannot write '{tmp}/file.txt/t.yaml'"]),

    # tables
    Case("quantize-table-lacks-a-tensor", [*QUANT[:3], "{tmp}/t.yaml", *QUANT[4:]],
         {"t.yaml": table_edit(lambda t: t["tensors"].pop("bn1_out"))},
         ["tensor 'bn1_out' (Conv node 'conv1') is not in the calibration table '{tmp}/t.yaml'"]),
    Case("quantize-table-is-not-yaml", [*QUANT[:3], "{tmp}/t.yaml", *QUANT[4:]],
         {"t.yaml": text("tensors: [unclosed\n\t- x\n")}, ["table file '{tmp}/t.yaml'"]),
    Case("quantize-table-is-binary", [*QUANT[:3], "{tmp}/t.yaml", *QUANT[4:]],
         {"t.yaml": raw(bytes(range(256)))}, ["table file '{tmp}/t.yaml'"]),
    Case("quantize-table-tensors-is-a-list", [*QUANT[:3], "{tmp}/t.yaml", *QUANT[4:]],
         {"t.yaml": table_edit(lambda t: t.update(tensors=[1, 2]))},
         ["table file '{tmp}/t.yaml'", "'tensors' must be a mapping"]),
    Case("quantize-table-range-is-text", [*QUANT[:3], "{tmp}/t.yaml", *QUANT[4:]],
         {"t.yaml": table_edit(lambda t: t["tensors"]["relu1_out"].update(max="big"))},
         ["table file '{tmp}/t.yaml'", "tensor 'relu1_out'"]),

    # statistics files for merge
    Case("merge-missing-file", ["merge", "{tmp}/nosuch.npz", "-o", "{tmp}/t.yaml"], {},
         ["'{tmp}/nosuch.npz' not found"]),
    Case("merge-not-a-statistics-file", ["merge", "{calib}", "-o", "{tmp}/t.yaml"], {},
         ["'{calib}' is not a qtool statistics file"]),
    Case("merge-header-lacks-a-key", ["merge", "{tmp}/s.npz", "-o", "{tmp}/t.yaml"],
         {"s.npz": stats_edit(set_header(model=None))},
         ["statistics file '{tmp}/s.npz' is damaged", "header key 'model'"]),
    Case("merge-header-tensors-not-a-list", ["merge", "{tmp}/s.npz", "-o", "{tmp}/t.yaml"],
         {"s.npz": stats_edit(set_header(tensors=5))},
         ["statistics file '{tmp}/s.npz' is damaged", "header key 'tensors'"]),
    Case("merge-state-is-missing", ["merge", "{tmp}/s.npz", "-o", "{tmp}/t.yaml"],
         {"s.npz": stats_edit(drop_state)},
         ["statistics file '{tmp}/s.npz' is damaged", "tensor 'input'", "no 'scalars'"]),
    Case("merge-histogram-state-does-not-fit", ["merge", "{tmp}/s.npz", "-o", "{tmp}/t.yaml"],
         {"s.npz": stats_edit(fewer_bins, "stats_kl")},
         ["statistics file '{tmp}/s.npz' is damaged", "tensor 'input'", "for 3 bins"]),
    Case("merge-different-methods", ["merge", "{tmp}/a.npz", "{tmp}/b.npz", "-o", "{tmp}/t.yaml"],
         {"a.npz": copy_of("stats"), "b.npz": copy_of("stats_kl")},
         ["cannot merge '{tmp}/b.npz'", "method 'kl' differs from 'minmax'"]),
    Case("merge-pickled-objects", ["merge", "{tmp}/s.npz", "-o", "{tmp}/t.yaml"],
         {"s.npz": npz(header=objects())}, ["'{tmp}/s.npz' holds pickled objects"]),

    # jobs (qtool run)
    Case("run-yaml-with-a-tab", RUN, {"job.yaml": text("model: m.onnx\n\tcalibrate: {}\n")},
         ["job file '{tmp}/job.yaml' is not valid YAML at line 2", "'\\t'"]),
    Case("run-yaml-unclosed-bracket", RUN, {"job.yaml": text("model: [m.onnx\ncalibrate: {}\n")},
         ["job file '{tmp}/job.yaml' is not valid YAML at line"]),
    Case("run-yaml-not-text", RUN, {"job.yaml": raw(b"\xff\xfe\x00 model")},
         ["job file '{tmp}/job.yaml' is not text"]),
    Case("run-job-is-a-list", RUN, {"job.yaml": text("- model\n- calibrate\n")},
         ["job file '{tmp}/job.yaml': job: expected a mapping, got list"]),
    Case("run-num-samples-is-text", RUN,
         {"job.yaml": job(calibrate={"data": "{calib}", "num_samples": "many"})},
         ["job file '{tmp}/job.yaml': calibrate.num_samples: expected an integer, got 'many'"]),
    Case("run-list-where-a-mapping-goes", RUN, {"job.yaml": job(calibrate=["{calib}"])},
         ["job file '{tmp}/job.yaml': calibrate: expected a mapping, got list"]),
    Case("run-preprocess-mean-is-text", RUN,
         {"job.yaml": job(calibrate={"data": "{calib}", "preprocess": {"mean": "half"}})},
         ["calibrate.preprocess.mean: expected a number or a list, got 'half'"]),
    Case("run-preprocess-std-is-zero", RUN,
         {"job.yaml": job(calibrate={"data": "{calib}", "preprocess": {"std": 0}})},
         ["job file '{tmp}/job.yaml': calibrate.preprocess: preprocess std must not be 0"]),
    Case("run-per-channel-is-text", RUN, {"job.yaml": job(quantize={"per_channel": "yes"})},
         ["quantize.per_channel: expected true or false, got 'yes'"]),
    Case("run-keep-float-not-names", RUN, {"job.yaml": job(quantize={"keep_float": [1, 2]})},
         ["job file '{tmp}/job.yaml': quantize.keep_float", "[1, 2]"]),
    Case("run-tolerance-not-numbers", RUN, {"job.yaml": job(verify={"tolerance": [0.9, "x"]})},
         ["job file '{tmp}/job.yaml': verify.tolerance"]),
    Case("run-unknown-key", RUN, {"job.yaml": job(calibrate={"data": "{calib}", "methd": "kl"})},
         ["calibrate.methd: unknown key", "method"]),
    Case("run-missing-model", RUN, {"job.yaml": job(model="{tmp}/nosuch.onnx")},
         ["job file '{tmp}/job.yaml': model: file '{tmp}/nosuch.onnx' not found"]),
    Case("run-model-is-a-directory", RUN, {"job.yaml": job(model="{tmp}")},
         ["job file '{tmp}/job.yaml': model: '{tmp}' is a directory"]),
    Case("run-output-dir-under-a-file", RUN,
         {**FILE, "job.yaml": job(output_dir="{tmp}/file.txt/out")},
         ["job file '{tmp}/job.yaml': output_dir: cannot write", "'{tmp}/file.txt' is not a directory"]),
    # the table and the model are written before verify reads its data: they must go again
    Case("run-verify-data-has-nan", RUN,
         {"d.npz": npz(input=images(at=(2, 0, 0, 0), value=np.nan)),
          "job.yaml": job(verify={"data": "{tmp}/d.npz"})},
         ["data file '{tmp}/d.npz'", "NaN or Inf", "sample 2"]),
]

OUTPUT_OPTIONS = ("-o", "--output", "--params-out", "--report", "--stats-out")


def test_battery_is_large_and_distinct():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)
    commands = {c.args[0] for c in CASES}
    assert {"calibrate", "quantize", "verify", "exec", "merge", "run"} <= commands


# -- module artifacts --------------------------------------------------------------------------------

def zero_model() -> onnx.ModelProto:
    """x -> Conv -> c; z = c * 0 (zero everywhere); y = z + c. The Conv's first output channel has
    all-zero weights too, so one per-channel weight scale has nothing to see either."""
    w = np.random.default_rng(1).normal(0, 1, (3, 2, 3, 3)).astype(np.float32)
    w[0] = 0
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Mul", ["c", "zero"], ["z"], name="times_zero"),
         helper.make_node("Add", ["z", "c"], ["y"], name="add")], "zero",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 4, 4])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.zeros(1, np.float32), "zero")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, demo_model, demo_calib, demo_heldout) -> dict:
    """Good artifacts for the cases to use or spoil, made once."""
    from qtool.calibrate import collect
    from qtool.quantize import quantize
    from qtool.table_formats import write_table

    folder = tmp_path_factory.mktemp("artifacts")
    stats = collect(demo_model, demo_calib, progress=False)
    stats.save(folder / "stats.npz")
    collect(demo_model, demo_calib, "kl", progress=False).save(folder / "stats_kl.npz")
    table = stats.table()
    write_table(table, folder / "table.yaml")
    qmodel, _ = quantize(demo_model, table)
    onnx.save(qmodel, folder / "model.q.onnx")

    other = folder / "zero.onnx"
    onnx.save(zero_model(), other)
    np.savez(folder / "zero.npz", x=np.random.default_rng(2).normal(0, 1, (8, 2, 4, 4)).astype(np.float32))
    other_q, _ = quantize(other, collect(other, folder / "zero.npz", progress=False).table())
    onnx.save(other_q, folder / "zero.q.onnx")
    return {"model": demo_model, "calib": demo_calib, "heldout": demo_heldout,
            "table": folder / "table.yaml", "qmodel": folder / "model.q.onnx",
            "stats": folder / "stats.npz", "stats_kl": folder / "stats_kl.npz",
            "other_qmodel": folder / "zero.q.onnx"}


def make_files(folder: Path, files: dict, context: dict) -> None:
    for name, maker in files.items():
        path = folder / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(maker(context))


def console_error_leaves_nothing(tmp_path: Path, *args, expect=()) -> str:
    """The console script's twin of test_cli's ``user_error_leaves_nothing``."""
    qtool = shutil.which("qtool") or str(Path(sys.executable).parent / "qtool")
    before = snapshot(tmp_path)
    result = subprocess.run([qtool, *args], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in result.stderr
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in expect:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert snapshot(tmp_path) == before
    return lines[0]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_user_error_leaving_nothing(tmp_path, ctx, case):
    context = {**ctx, "tmp": tmp_path}
    make_files(tmp_path, case.files, context)
    args = [fill(a, context) for a in case.args]
    expect = [fill(e, context) for e in case.expect]
    check = console_error_leaves_nothing if case.console else user_error_leaves_nothing
    check(tmp_path, *args, expect=expect)
    outputs = [Path(args[i + 1]) for i, a in enumerate(args[:-1]) if a in OUTPUT_OPTIONS]
    for output in outputs:
        assert not output.is_file(), f"{output} was written"
        if output.parent.is_dir():  # no temporary file beside it either
            assert not [p for p in output.parent.iterdir() if p.name.startswith(f".{output.name}.")]
    if case.args[0] == "run":
        assert not (tmp_path / "out").exists()


# -- inputs that are not errors ----------------------------------------------------------------------

def test_tensor_zero_everywhere_gets_a_positive_scale(tmp_path):
    """z = c * 0 is zero on every sample (and one Conv channel has all-zero weights): quantize
    succeeds, widens the zero-width range, names the tensor, and no scale is 0, NaN or Inf."""
    model, data = tmp_path / "zero.onnx", tmp_path / "x.npz"
    onnx.save(zero_model(), model)
    x = np.random.default_rng(2).normal(0, 1, (8, 2, 4, 4)).astype(np.float32)
    np.savez(data, x=x)
    table, qmodel = tmp_path / "t.yaml", tmp_path / "q.onnx"
    assert invoke("calibrate", model, "-d", data, "-o", table, "-q").exit_code == 0
    entry = yaml.safe_load(table.read_text())["tensors"]["z"]
    assert entry["min"] == entry["max"] == entry["threshold"] == 0.0  # the premise

    result = invoke("quantize", model, "-t", table, "-o", qmodel, "--json")
    assert_no_crash(result)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["widened_ranges"] == ["z"]
    text_report = invoke("quantize", model, "-t", table, "-o", tmp_path / "q2.onnx")
    assert "ranges made safe (zero width widened, beyond ±1e30 clipped): z" in text_report.stdout

    q = onnx.load(str(qmodel))
    inits = {i.name: numpy_helper.to_array(i) for i in q.graph.initializer}
    scales = {node.input[1] for node in q.graph.node
              if node.op_type in ("QuantizeLinear", "DequantizeLinear")}
    assert {"z_scale", "zero_scale", "w_scale"} <= scales
    for name in scales:
        assert np.all(np.isfinite(inits[name])) and np.all(inits[name] > 0), (name, inits[name])
    assert inits["w_scale"].shape == (3,)  # per channel, the all-zero channel included

    result = invoke("exec", qmodel, "-i", data, "-o", tmp_path / "y.npz", "-q")
    assert result.exit_code == 0, result.output
    with np.load(tmp_path / "y.npz") as y:
        assert np.all(np.isfinite(y["y"]))
    result = invoke("verify", model, qmodel, "-d", data, "--json", "-q")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    z = next(t for t in report["tensors"] if t["name"] == "z")
    assert z["cosine"] == 1.0 and z["max_diff_lsb"] == 0.0


def test_table_for_another_model_is_reported_by_digest(tmp_path, ctx, demo_model):
    """The table's model_sha256 is another model's: quantize warns on stderr naming both models
    and both digests, and still writes the model (the tensor names match, so it can run)."""
    other = tmp_path / "zero.onnx"
    onnx.save(zero_model(), other)
    other_digest = hashlib.sha256(other.read_bytes()).hexdigest()
    demo_digest = hashlib.sha256(demo_model.read_bytes()).hexdigest()
    data = yaml.safe_load(Path(ctx["table"]).read_text())
    data.update(model="zero.onnx", model_sha256=other_digest)
    table = tmp_path / "t.yaml"
    table.write_text(yaml.safe_dump(data, sort_keys=False))
    output = tmp_path / "q.onnx"

    result = invoke("quantize", demo_model, "-t", table, "-o", output)
    assert_no_crash(result)
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: "), result.stderr
    for fragment in (str(table), "made for model 'zero.onnx'", other_digest[:12],
                     f"not '{demo_model.name}'", demo_digest[:12]):
        assert fragment in lines[0]
    assert output.is_file()


def test_external_data_inside_the_model_folder_is_read(tmp_path):
    """The check refuses only locations outside the folder: a sub-folder, even spelled with '..',
    is read."""
    (tmp_path / "m" / "weights").mkdir(parents=True)
    (tmp_path / "m" / "weights" / "w.bin").write_bytes(SECRET)
    model = tmp_path / "m" / "m.onnx"
    model.write_bytes(external_model("weights/../weights/w.bin")({}))
    np.savez(tmp_path / "x.npz", x=np.ones((3, 4), np.float32))
    result = invoke("calibrate", model, "-d", tmp_path / "x.npz", "-o", tmp_path / "t.yaml", "-q")
    assert_no_crash(result)
    assert result.exit_code == 0, result.output
    y = yaml.safe_load((tmp_path / "t.yaml").read_text())["tensors"]["y"]
    assert (y["min"], y["max"]) == (1.0, 4.0)  # x + [0, 1, 2, 3] with x = 1: the bytes were read
    assert math.isfinite(y["threshold"])


def test_tensors_the_model_makes_infinite_or_float64_keep_their_ops_float(tmp_path):
    """swift-f0 pads its scores with a constant -inf before a GatherElements, and computes in
    float64 after a Cast: calibrate stopped ("tensor has NaN or Inf values on the calibration
    data", blaming the data), then quantize failed inside onnx (QuantizeLinear takes no double).
    Now the table lists the infinite tensors as ``unbounded`` (written and read back), and the ops
    around them and those on float64 tensors stay float with the reason; the rest is integer."""
    from qtool.table_formats import read_table

    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("Pad", ["r", "pads", "lowest"], ["padded"], mode="constant", name="pad"),
         helper.make_node("Mul", ["padded", "two"], ["y"], name="scale"),
         helper.make_node("Cast", ["r"], ["r64"], to=TensorProto.DOUBLE, name="to_double"),
         helper.make_node("Mul", ["r64", "three"], ["m64"], name="scale64"),
         helper.make_node("Cast", ["m64"], ["z"], to=f, name="to_float")], "inf",
        [helper.make_tensor_value_info("x", f, ["N", 6])],
        [helper.make_tensor_value_info("y", f, ["N", 8]), helper.make_tensor_value_info("z", f, ["N", 6])],
        [numpy_helper.from_array(np.array([0, 1, 0, 1], np.int64), "pads"),
         numpy_helper.from_array(np.array(-np.inf, np.float32), "lowest"),
         numpy_helper.from_array(np.float32(2), "two"), numpy_helper.from_array(np.float64(3), "three")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32))
    calibrated = invoke("calibrate", tmp_path / "m.onnx", "-d", tmp_path / "d.npz", "-o", tmp_path / "t.yaml")
    assert calibrated.exit_code == 0, calibrated.output
    assert "no range for 2 tensor(s) that held inf or NaN" in calibrated.stderr and "'padded', 'y'" in calibrated.stderr
    table = read_table(tmp_path / "t.yaml")
    assert table.unbounded == ["padded", "y"] and "r" in table.tensors and "padded" not in table.tensors
    quantized = invoke("quantize", tmp_path / "m.onnx", "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx")
    assert quantized.exit_code == 0, quantized.output
    assert "integer: 1 ops (Relu 1)" in quantized.stdout, quantized.stdout
    assert "'padded' held inf or NaN on the calibration data" in quantized.stdout
    assert "'r64' is float64, which QuantizeLinear does not take" in quantized.stdout
    executed = invoke("exec", tmp_path / "q.onnx", "--input", tmp_path / "d.npz", "-o", tmp_path / "o.npz", "-q")
    assert executed.exit_code == 0, executed.output
    # quantize --data scores the output without its -inf entries, as verify does (every score read -inf)
    scored = invoke("quantize", tmp_path / "m.onnx", "-t", tmp_path / "t.yaml", "-o", tmp_path / "qd.onnx",
                    "--data", tmp_path / "d.npz", "--holdout", "4", "--num-samples", "4")
    assert scored.exit_code == 0, scored.output
    method = next(line for line in scored.stdout.splitlines() if line.startswith("method:"))
    assert "inf" not in method and "nan" not in method and "minmax " in method, method
    out, x = np.load(tmp_path / "o.npz"), np.load(tmp_path / "d.npz")["x"]
    assert np.isneginf(out["y"][:, 0]).all() and np.isneginf(out["y"][:, -1]).all()
    np.testing.assert_allclose(out["z"], 3 * np.maximum(x, 0), atol=0.05)
    text = (tmp_path / "t.yaml").read_text().replace("unbounded:\n- padded\n- y\n", "unbounded: 3\n")
    (tmp_path / "bad.yaml").write_text(text)
    result = invoke("quantize", tmp_path / "m.onnx", "-t", tmp_path / "bad.yaml", "-o", tmp_path / "q2.onnx")
    assert result.exit_code == 2 and "'unbounded' must be a list of tensor names" in result.stderr, result.output


def test_an_output_that_is_an_input_is_refused_and_the_input_kept(tmp_path, demo_model, demo_calib):
    """`quantize m.onnx -o m.onnx` replaced the float model the command was reading (a user's files
    are sacred): every command that writes refuses an output path that is one of its inputs, by
    the file it names (a symlink or another spelling of the path too), before any work."""
    model, data = tmp_path / "m.onnx", tmp_path / "d.npz"
    shutil.copy(demo_model, model)
    shutil.copy(demo_calib, data)
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", model, "-d", data, "-o", table, "-q").exit_code == 0
    assert invoke("quantize", model, "-t", table, "-o", tmp_path / "q.onnx", "-q").exit_code == 0
    (tmp_path / "link.onnx").symlink_to(model)
    kept = {p: p.read_bytes() for p in (model, data, table, tmp_path / "q.onnx")}
    cases = [
        (("calibrate", model, "-d", data, "-o", data), data),
        (("calibrate", model, "-d", data, "-o", table, "--stats-out", model), model),
        (("quantize", model, "-t", table, "-o", tmp_path / "link.onnx"), model),
        (("quantize", model, "-t", table, "-o", tmp_path / "sub" / ".." / "t.yaml"), table),
        (("quantize", model, "-t", table, "-o", tmp_path / "q2.onnx", "--data", data, "--params-out", data), data),
        (("exec", tmp_path / "q.onnx", "--input", data, "-o", data), data),
        (("verify", model, tmp_path / "q.onnx", "-d", data, "--report", tmp_path / "q.onnx"), tmp_path / "q.onnx"),
        (("merge", data, "-o", data), data),
    ]
    (tmp_path / "sub").mkdir()
    for args, target in cases:
        result = invoke(*args)
        assert result.exit_code == 2, (args, result.output)
        assert "which this command reads; choose another output path" in result.stderr, (args, result.stderr)
        assert f"it is '{target}'" in result.stderr, (args, result.stderr)
    assert {p: p.read_bytes() for p in kept} == kept
    # an output inside a folder of data the command reads would be a sample of the next run
    (tmp_path / "samples").mkdir()
    np.save(tmp_path / "samples" / "0.npy", np.load(data)[list(np.load(data).keys())[0]][0])
    result = invoke("exec", tmp_path / "q.onnx", "--input", tmp_path / "samples", "-o", tmp_path / "samples" / "y.npz")
    assert result.exit_code == 2 and "it is inside" in result.stderr and "a folder of data this command reads" \
        in result.stderr, result.output
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["0.npy"]
    # --table-out may replace TABLE itself: it is read whole before anything is written
    result = invoke("quantize", model, "-t", table, "-o", tmp_path / "q3.onnx", "--data", data, "--table-out", table,
                    "--num-samples", 4, "--holdout", 4, "-q")
    assert result.exit_code == 0, result.output
