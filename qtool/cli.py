"""The ``qtool`` command: parse, call one library function, print. Domain errors become one line on
stderr and an exit code; data goes to stdout, progress and logs to stderr."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
from pathlib import Path
from typing import List, Optional

import typer

from . import __version__
from .errors import EXIT_INTERNAL_ERROR, EXIT_USER_ERROR, EXIT_VERIFY_FAILED, STOP, QtoolError
from .fixedpoint import DEFAULT_ROUNDING, quantize_multiplier
from .fileio import STDOUT, atomic_write, check_distinct, check_not_reading, check_writable, write_all
from .report import bias_summary, channels_summary, float_node_lines, int16_summary, methods_summary, \
    pick_summary, placement_summary, rounding_summary, search_summary
from .batching import CALIBRATE_BATCH_CAP, DEFAULT_LAYERS, DEFAULT_MEMORY_MB, EXEC_BATCH_CAP, VERIFY_BATCH_CAP

# how arrays of an .npz feed the model's inputs (qtool/data.py load_dataset), in every --data help
DATA_AXES = (" Samples lie on each array's first axis, except: a scalar input takes a 0-d array, fed "
             "whole to every run; an input whose first size is fixed above 1 and another open (a state "
             "[2,N,128]) takes them on that open axis.")
EXIT_CODES = ("Exit codes: 0 ok, 1 verification failed, 2 user error (bad file, key, option), "
              "3 internal error (a model or case qtool does not handle).")

app = typer.Typer(
    help=f"Calibrate, quantize and verify ONNX models with exact integer derivations.\n\n"
         f"Pipeline: calibrate -> table -> quantize -> model.q.onnx -> exec / verify.\n\n{EXIT_CODES}",
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]}, rich_markup_mode=None,
)


class _GroupedCommand(typer.core.TyperCommand):
    """Plain-text help with the options under headings (each option's ``rich_help_panel``, without
    rich's boxes, so that help reads the same in a terminal, a pipe or a log)."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        # typer writes a required argument as {MODEL}; a usage line reads MODEL, optional ones [X]
        return [piece.replace("{", "").replace("}", "") for piece in super().collect_usage_pieces(ctx)]

    def format_options(self, ctx, formatter) -> None:
        arguments, groups = [], {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append(record)
            else:
                groups.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        if arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(arguments)
        for heading, records in groups.items():
            with formatter.section(heading):
                formatter.write_dl(records)


def _panels(**headings: str):
    """Put a command's options under headings in its help: ``heading="param param ..."``
    (underscores in a heading read as spaces)."""
    def apply(function):
        import inspect

        defaults = inspect.signature(function).parameters
        for heading, names in headings.items():
            for name in names.split():
                defaults[name].default.rich_help_panel = heading.replace("_", " ")
        return function
    return apply


def _print_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="Print the qtool version and exit.")) -> None:
    pass


def _cluster_option():
    """--cluster, shared by calibrate, verify and run (qtool/cluster.py)."""
    return typer.Option(None, "--cluster", metavar="ADDRESS", help="Run on a dask.distributed "
                        "cluster: local or local:N (N worker processes started here) or a "
                        "scheduler's tcp://HOST:PORT. Workers read the same paths (a shared "
                        "filesystem); needs pip install 'qtool[dask]'.")


def _fail(e: QtoolError) -> typer.Exit:
    typer.echo(f"error: {e}", err=True)
    return typer.Exit(e.exit_code)


def _key_value(option: str, entry: str) -> tuple[str, str]:
    key, sep, value = entry.partition("=")
    if not sep or not key.strip():
        raise QtoolError(f"{option} '{entry}': expected KEY=VALUE")
    return key.strip(), value.strip()


def _log(message: str) -> None:
    typer.echo(message, err=True)


def _output_path(value: str) -> Path:
    """An output option's path as typed: one ending in a slash names a folder, where a file of
    that name would otherwise be written (pathlib drops the slash)."""
    if value != STDOUT and value.endswith(("/", os.sep)):
        raise typer.BadParameter(f"'{value}' names a folder; give a file path")
    return Path(value)


_output_path.__name__ = "path"  # typer's help shows a parser's name as the metavar: <path>, as for the other paths


def _new_folders(*paths) -> list[Path]:
    """For each output path, the outermost of its folders that does not exist yet (writing it
    will make them): to say so afterwards (``_made``)."""
    folders = []
    for path in paths:
        if path is None or str(path) == STDOUT:
            continue
        missing, folder = None, Path(path).parent
        while str(folder) not in ("", ".") and not folder.exists() and folder != folder.parent:
            missing, folder = folder, folder.parent
        if missing is not None and missing not in folders:
            folders.append(missing)
    return folders


def _made(folders: list[Path], quiet: bool) -> None:
    for folder in folders:
        if folder.is_dir() and not quiet:
            _log(f"made folder '{folder}'")


def _layers(text: str) -> int | None:
    """verify --layers: N samples, or all (None)."""
    if text.strip().lower() == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise QtoolError(f"--layers takes a number of samples or all, got '{text}'") from None


def _one_stdout_writer(as_json: bool, output) -> None:
    """A table piped to standard output leaves no room for a JSON report there."""
    if as_json and str(output) == "-":
        raise QtoolError("--json and -o - would both write to standard output; choose one")


# image preprocessing, the same options for every command that reads DATA (a folder of images);
# unset ones come from what calibrate recorded in the table or the quantized model (calibrate's
# own: ``recorded=False``, the plain defaults)
_IMAGES = "Images (a folder as DATA)"  # their heading in --help


def _image_option(flag: str, text: str, default: str, recorded: bool = True, **kw):
    said = f"recorded by calibrate, else {default}" if recorded else default
    return typer.Option(None, flag, help=f"Images: {text} (default: {said}).", rich_help_panel=_IMAGES, **kw)


def _image_options(recorded: bool) -> tuple:
    """--resize, --fit, --mean, --std, --scale, --channels and --layout."""
    return (_image_option("--resize", "HEIGHTxWIDTH", "the model input's", recorded, metavar="HxW"),
            _image_option("--fit", "stretch, letterbox (keep the aspect, pad) or crop (keep it, cut the "
                          "centre)", "stretch", recorded),
            _image_option("--mean", "per-channel mean after scaling, e.g. 0.5,0.5,0.5", "0", recorded),
            _image_option("--std", "per-channel std, e.g. 0.5,0.5,0.5", "1", recorded),
            _image_option("--scale", "pixel multiplier before mean/std", "1/255", recorded),
            _image_option("--channels", "rgb, bgr or gray", "rgb", recorded),
            _image_option("--layout", "nchw or nhwc", "nchw", recorded))


_RESIZE, _FIT, _MEAN, _STD, _SCALE, _CHANNELS, _LAYOUT = _image_options(recorded=True)
# calibrate's (``_C_``): the command that records them
_C_RESIZE, _C_FIT, _C_MEAN, _C_STD, _C_SCALE, _C_CHANNELS, _C_LAYOUT = _image_options(recorded=False)
_PAD = typer.Option(None, "--pad", help="Images: letterbox padding pixel value, 0-255 (default 114).",
                    rich_help_panel=_IMAGES)
_IMAGE_INPUT = typer.Option(None, "--image-input", help="Images: the model input they feed.", rich_help_panel=_IMAGES)


def _image_given(resize, fit, pad, mean, std, scale, channels, layout, image_input) -> dict:
    """The image preprocessing fields set on the command line (qtool.data.Preprocess's names)."""
    def floats(text, what):
        try:
            return tuple(float(v) for v in text.split(","))
        except ValueError:
            raise QtoolError(f"--{what} takes comma-separated numbers, got '{text}'") from None

    given = {}
    if resize:
        try:
            height, width = (int(v) for v in resize.lower().split("x"))
            given["resize"] = (height, width)
        except ValueError:
            raise QtoolError(f"--resize takes HEIGHTxWIDTH, e.g. 48x320, got '{resize}'") from None
    for key, value in (("fit", fit), ("pad", pad), ("scale", scale), ("channels", channels), ("layout", layout),
                       ("input", image_input)):
        if value is not None:
            given[key] = value
    for key, value in (("mean", mean), ("std", std)):
        if value is not None:
            given[key] = floats(value, key)
    return given


def _recorded_images(qmodel: Path, data: Path, given: dict):
    """verify's Preprocess for DATA: given over what QMODEL records (calibrate's)."""
    from .data import holds_images, images_for

    if not holds_images(data):
        return images_for(None, data, given, "")[0]  # the image options need a folder of images
    import onnx

    try:
        model = onnx.load(str(qmodel), load_external_data=False)
    except Exception:  # verify's own loading says what is wrong with the file
        return None
    pre, warnings = images_for(model, data, given, f"model file '{qmodel}'")
    for w in warnings:
        _log(f"warning: {w}")
    return pre


def _image_preprocess(data, given: dict, recorded, source: str):
    """The Preprocess for DATA when it is a folder of images (else None), warnings logged."""
    from .data import Preprocess, holds_images, resolve_preprocess

    if data is None or not holds_images(data):
        return None
    pre, warnings = resolve_preprocess(given, recorded, source)
    for w in warnings:
        _log(f"warning: {w}")
    if pre is not None:
        Preprocess.check(pre)
    return pre


@app.command(epilog=EXIT_CODES, cls=_GroupedCommand)
def calibrate(
    model: Path = typer.Argument(..., metavar="MODEL", help="Float ONNX model."),
    data: Path = typer.Option(..., "--data", "-d", help=".npz keyed by model input name, or a "
                                                        "folder of .npy/.npz or images." + DATA_AXES),
    output: Optional[Path] = typer.Option(None, "--output", "-o", parser=_output_path, help="Calibration table (.yaml, "
                                                                       ".json; see --format); - for "
                                                                       "standard output."),
    table_format: Optional[str] = typer.Option(None, "--format", help="Table format: yaml, json, "
                                               "cali_table (TPU-MLIR) or trt (TensorRT cache). "
                                               "Default from the -o name: .json, .cache, "
                                               "*cali_table, else yaml."),
    method: str = typer.Option("minmax", help="minmax, kl, percentile, mse, aciq_gauss, "
                                              "aciq_laplace, or a plugin's."),
    param: List[str] = typer.Option([], help="Method parameter NAME=VALUE (repeatable), e.g. "
                                             "percentile=99.9, variant=tpu_mlir."),
    num_samples: Optional[int] = typer.Option(None, help="Use only the first N samples."),
    batch_size: Optional[int] = typer.Option(None, help="Samples per onnxruntime run. Default: "
                                             "chosen from --memory (at most "
                                             f"{CALIBRATE_BATCH_CAP}), and logged."),
    memory: int = typer.Option(DEFAULT_MEMORY_MB, "--memory", metavar="MB",
                               help="Peak memory the default batch size aims to stay under."),
    stats_out: Optional[Path] = typer.Option(None, parser=_output_path, help="Also save the raw statistics (.npz) for "
                                                        "qtool merge."),
    histogram_samples: int = typer.Option(4096, help="Histogram methods: values binned per sample "
                                                     "and tensor (every k-th); 0 bins them all."),
    resize: Optional[str] = _C_RESIZE,
    fit: Optional[str] = _C_FIT,
    pad: Optional[float] = _PAD,
    mean: Optional[str] = _C_MEAN,
    std: Optional[str] = _C_STD,
    scale: Optional[float] = _C_SCALE,
    channels: Optional[str] = _C_CHANNELS,
    layout: Optional[str] = _C_LAYOUT,
    input_name: Optional[str] = typer.Option(None, "--input", "--image-input", help="Images: the "
                                             "model input they feed."),
    as_json: bool = typer.Option(False, "--json", help="Print a summary (tensors, samples, method, "
                                                       "output) as JSON on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or log."),
    cluster: Optional[str] = _cluster_option(),
):
    """Run the float model over DATA and write per-tensor ranges and thresholds.

    \b
    Examples:
      qtool calibrate model.onnx --data calib.npz -o table.yaml
      qtool calibrate model.onnx --data calib.npz -o table.yaml --method kl
      qtool calibrate model.onnx --data calib.npz -o model_cali_table --method kl   # TPU-MLIR
      qtool calibrate model.onnx --data calib.npz -o calib.cache --format trt       # TensorRT
      qtool calibrate model.onnx --data calib.npz -o t.yaml --method percentile --param percentile=99.9
      qtool calibrate model.onnx --data images/ -o t.yaml --resize 224x224 --mean 0.485,0.456,0.406 --std 0.229,0.224,0.225
      qtool calibrate model.onnx --data shard1.npz --stats-out part1.npz   # then: qtool merge part*.npz -o t.yaml
      qtool calibrate model.onnx -d calib.npz -o - | qtool quantize model.onnx -t - -o model.q.onnx
      qtool calibrate model.onnx -d calib.npz -o table.yaml --cluster tcp://scheduler:8786
    """
    from .calibrate import collect, parse_params
    from .data import holds_images
    from .table_formats import STDIO, check_table_target, dropped, output_format, write_table

    try:
        if output is None and stats_out is None:
            raise QtoolError("give -o TABLE, --stats-out STATS, or both")
        _one_stdout_writer(as_json, output)
        fmt = output_format(output or "", table_format)
        if output is not None:
            check_table_target(output)
        if stats_out is not None:
            check_writable(stats_out)
        check_distinct(**{"-o": output, "--stats-out": stats_out})
        for written in (output, stats_out):
            check_not_reading(written, model, data)
        given = _image_given(resize, fit, pad, mean, std, scale, channels, layout, input_name)
        if given and not holds_images(data):
            raise QtoolError(f"the image options describe a folder of images; '{data}' is not one")
        pre = _image_preprocess(data, given, None, "")
        if histogram_samples < 0:
            raise QtoolError(f"--histogram-samples must be >= 0, got {histogram_samples}")
        if cluster is not None:
            from .cluster import collect as collect_on

            collect = functools.partial(collect_on, cluster)
        stats = collect(model, data, method, parse_params(param), num_samples, batch_size,
                        progress=not quiet, preprocess=pre, log=None if quiet else _log,
                        histogram_samples=histogram_samples, memory_mb=memory)
        table = stats.table()
        folders = _new_folders(stats_out, output)
        if stats_out is not None:
            stats.save(stats_out)
        if output is not None:
            write_table(table, output, fmt)
            if dropped(table, fmt):
                _log(f"warning: {dropped(table, fmt)}")
        _made(folders, quiet)
    except QtoolError as e:
        raise _fail(e)
    if as_json:
        typer.echo(json.dumps({"tensors": len(table.tensors), "unbounded": table.unbounded,
                               "samples": table.samples, "method": method,
                               "params": table.params, "input_shapes": table.input_shapes,
                               "output": None if output is None else str(output),
                               "stats_out": None if stats_out is None else str(stats_out)}, indent=1))
    if not quiet:
        written = " and ".join("standard output" if str(p) == STDIO else str(p)
                               for p in (output, stats_out) if p is not None)
        _log(f"calibrated {len(table.tensors)} tensors on {table.samples} samples ({method}) -> {written}")
        if table.unbounded:
            _log(f"no range for {len(table.unbounded)} tensor(s) that held inf or NaN (the model computes them: "
                 f"a constant -inf, a log of 0, ...); the ops around them stay float: "
                 f"{', '.join(repr(n) for n in table.unbounded[:4])}{', ...' if len(table.unbounded) > 4 else ''}")


@app.command(epilog=EXIT_CODES, cls=_GroupedCommand)
def merge(
    stats: List[Path] = typer.Argument(..., metavar="STATS", help="Statistics files from calibrate --stats-out."),
    output: Path = typer.Option(..., "--output", "-o", parser=_output_path, help="Calibration table (.yaml, .json, "
                                "*cali_table, .cache); - for standard output (YAML)."),
    as_json: bool = typer.Option(False, "--json", help="Print a summary as JSON on stdout."),
):
    """Merge statistics of disjoint shards into one table, as if calibrated in a single pass.

    Min/max merge exactly; histogram methods merge their histograms exactly (power-of-two ranges).

    \b
    Examples:
      qtool calibrate model.onnx -d shard1.npz --method kl --stats-out part1.npz
      qtool calibrate model.onnx -d shard2.npz --method kl --stats-out part2.npz
      qtool merge part1.npz part2.npz -o table.yaml
    """
    from .calibrate import merge as run
    from .table_formats import check_table_target, dropped, output_format, write_table

    try:
        _one_stdout_writer(as_json, output)
        check_table_target(output)
        check_not_reading(output, *stats)
        table = run(stats)
        write_table(table, output)
        if dropped(table, output_format(output)):
            _log(f"warning: {dropped(table, output_format(output))}")
    except QtoolError as e:
        raise _fail(e)
    if as_json:
        typer.echo(json.dumps({"files": [str(p) for p in stats], "tensors": len(table.tensors),
                               "samples": table.samples, "method": table.method,
                               "output": str(output)}, indent=1))
    _log(f"merged {len(stats)} files: {len(table.tensors)} tensors on {table.samples} samples -> {output}")


@app.command("convert-table", epilog=EXIT_CODES, cls=_GroupedCommand)
def convert_table(
    table: Path = typer.Argument(..., metavar="TABLE", help="Calibration table in any format qtool reads; - for "
                                            "standard input."),
    output: Path = typer.Option(..., "--output", "-o", parser=_output_path, help="The converted table; - for standard "
                                                            "output."),
    to: Optional[str] = typer.Option(None, "--to", help="yaml, json, cali_table (TPU-MLIR) or trt "
                                     "(TensorRT cache). Default from the -o name: .json, .cache, "
                                     "*cali_table, else yaml."),
    source: Optional[str] = typer.Option(None, "--from", help="Format of TABLE: yaml, json, "
                                         "cali_table, trt or ort (detected when omitted)."),
):
    """Convert a calibration table between qtool's YAML/JSON, TPU-MLIR's cali_table and TensorRT's
    calibration cache; onnxruntime's calibration.json is read too.

    A TensorRT cache holds only a float32 scale (threshold / 127) per tensor: read back, min/max
    become -threshold/+threshold. Foreign tables carry no model digest.

    \b
    Examples:
      qtool convert-table table.yaml -o model_cali_table          # to TPU-MLIR
      qtool convert-table table.yaml -o calib.cache               # to TensorRT
      qtool convert-table model_cali_table -o table.yaml
      qtool convert-table calibration.json -o table.yaml          # from onnxruntime
      qtool convert-table calib.txt --from cali_table -o t.bin --to trt
    """
    from .table_formats import FORMAT_NAMES, convert_table as run, dropped

    try:
        converted, origin, fmt = run(table, output, to, source)
    except QtoolError as e:
        raise _fail(e)
    if dropped(converted, fmt):
        _log(f"warning: {dropped(converted, fmt)}")
    _log(f"converted {len(converted.tensors)} tensors: {FORMAT_NAMES[origin]} -> {FORMAT_NAMES[fmt]} "
         f"-> {output}")


@app.command(epilog=EXIT_CODES, cls=_GroupedCommand)
@_panels(Input_and_output="table table_format output params_out params_metadata quiet as_json",
         Number_formats="format per_channel symmetric activation_type weight_type block_size multiplier_bits "
                        "rounding target",
         Ops_left_float_or_int16="keep_float precision_table strict",
         Steps_fitted_on_DATA="data num_samples holdout batch_size method_choice try_methods table_out "
                              "bias_correction channel_scales placement weight_rounding target_sqnr "
                              "max_float_layers "
                              "allow_float",
         Images_as_input="input_pixels")
def quantize(
    model: Path = typer.Argument(..., metavar="MODEL", help="Float ONNX model (the one the table was made for)."),
    table: Path = typer.Option(..., "--table", "-t", help="Calibration table: qtool's (YAML/JSON), "
                               "TPU-MLIR cali_table, TensorRT cache or onnxruntime calibration.json; "
                               "- for standard input."),
    table_format: Optional[str] = typer.Option(None, "--table-format", help="Format of TABLE: yaml, "
                                               "json, cali_table, trt or ort (detected when "
                                               "omitted)."),
    output: Path = typer.Option(..., "--output", "-o", parser=_output_path, help="Quantized ONNX model; - for standard "
                                "output (the report then goes to standard error)."),
    format: str = typer.Option("qdq", "--format", help="qdq (QuantizeLinear/DequantizeLinear around "
                               "float ops) or qoperator (QLinearConv, QLinearMatMul, com.microsoft "
                               "QLinear* ops, integer data movement, LUTs as Gather)."),
    per_channel: bool = typer.Option(True, "--per-channel/--per-tensor", help="Weight scales."),
    symmetric: bool = typer.Option(False, "--symmetric/--asymmetric", help="Activation ranges."),
    activation_type: str = typer.Option("int8", help="int8, uint8 or int16 (symmetric, zero point 0; "
                                        "weights stay int8 unless --weight-type int16; below opset 21 "
                                        "its QuantizeLinear/DequantizeLinear are onnxruntime's "
                                        "com.microsoft ones)."),
    weight_type: str = typer.Option("int8", "--weight-type", help="int8; int4: MatMul/Gemm weights "
                                    "(symmetric, -7..7; opset 21, which the model is upgraded to; Conv "
                                    "weights stay int8); int16: Conv, ConvTranspose, MatMul and Gemm "
                                    "weights, with --activation-type int16 (16x16)."),
    block_size: int = typer.Option(0, "--block-size", help="MatMul/Gemm weights: one scale per BLOCK "
                                   "rows along K and column (DequantizeLinear's block_size, opset 21); "
                                   "0: one per column."),
    multiplier_bits: int = typer.Option(32, help="Fixed-point multiplier width: 32 or 8."),
    rounding: str = typer.Option(DEFAULT_ROUNDING, help="half_up, half_away_from_zero, half_to_even "
                                                        "or toward_zero."),
    keep_float: List[str] = typer.Option([], help="Op type or node name to leave float (repeatable)."),
    precision_table: Optional[Path] = typer.Option(None, "--precision-table", help="Per-op types, one "
                                                   "'NODE TYPE' a line (TPU-MLIR's qtable): INT16 gives "
                                                   "the op int16 activations, INT8 8-bit ones; F32, F16 "
                                                   "or BF16 keeps it float."),
    strict: bool = typer.Option(False, "--strict", help="Fail (exit 2), listing every op that "
                                "cannot run integer-only, unless named by --keep-float (ops on shapes, "
                                "such as Shape, are not counted)."),
    target: str = typer.Option("portable", "--target", help="What the model is written for: portable "
                               "(uint8 activations and weights, zero point 128: exact in onnxruntime "
                               "on every x86-64 and arm64 CPU), x86-vnni (int8: onnxruntime's u8 x s8 "
                               "kernels, exact only with VNNI) or exact (int8, for an integer device "
                               "with int32 accumulation). The same integers either way."),
    params_out: Optional[Path] = typer.Option(None, "--params-out", parser=_output_path, help="Also write the integer "
                                              "parameters per op as JSON."),
    params_metadata: bool = typer.Option(True, "--params-metadata/--no-params-metadata", help="Keep the "
                                         "integer parameters per op in the model's metadata "
                                         "(qtool.params); --no-params-metadata leaves them out (a "
                                         "smaller file; qtool derives them again from the graph)."),
    input_pixels: bool = typer.Option(False, "--input-pixels", help="The quantized model takes the "
                                      "raw uint8 pixels that --mean/--std/--scale normalize for the "
                                      "float model: the normalization moves into the Conv layers "
                                      "that read the input, and the input adds no rounding."),
    resize: Optional[str] = _RESIZE,
    fit: Optional[str] = _FIT,
    pad: Optional[float] = _PAD,
    mean: Optional[str] = _MEAN,
    std: Optional[str] = _STD,
    scale: Optional[float] = _SCALE,
    channels: Optional[str] = _CHANNELS,
    layout: Optional[str] = _LAYOUT,
    image_input: Optional[str] = _IMAGE_INPUT,
    data: Optional[Path] = typer.Option(None, "--data", "-d", help=".npz keyed by model input name "
                                        "(or a folder of .npy/.npz): calibration samples for bias "
                                        "correction and the searches." + DATA_AXES),
    bias_correction: Optional[bool] = typer.Option(None, "--bias-correction/--no-bias-correction",
                                                   help="Shift each Conv/Gemm bias so that its output's "
                                                   "per-channel mean matches float on DATA, applied "
                                                   "in full, at half or not at all as the --holdout "
                                                   "samples score it [default: on with --data]."),
    target_sqnr: Optional[float] = typer.Option(None, "--target-sqnr", help="Give int16 activations "
                                                "(with --allow-float: keep float) the fewest ops that "
                                                "bring the output SQNR against float on DATA to this "
                                                "many dB (needs --data)."),
    max_float_layers: Optional[int] = typer.Option(None, "--max-float-layers", help="At most this many "
                                                   "ops int16 (or float); alone, the costliest-first "
                                                   "set of at most N that scores best (needs --data)."),
    allow_float: bool = typer.Option(False, "--allow-float", help="The search keeps the ops it picks "
                                     "float instead of giving them int16 activations."),
    method_choice: Optional[bool] = typer.Option(None, "--method-choice/--no-method-choice",
                                                 help="Score TABLE against minmax, percentile and mse "
                                                 "calibrated on DATA's fit samples; the best replaces "
                                                 "TABLE (recalibrated on DATA) only if it also scores "
                                                 "higher on the --holdout samples; with 16-bit activations "
                                                 "TABLE stays [default: on with --data, unless "
                                                 "--try-methods]."),
    placement: Optional[bool] = typer.Option(None, "--placement/--no-placement", help="In a "
                                             "transformer, give int16 to the groups (residual stream, "
                                             "Softmax, GELU, attention MatMuls) that raise the SQNR on "
                                             "DATA's fit samples, kept only if higher on the --holdout "
                                             "ones [default: on with --data for int8 QDQ]."),
    channel_scales: Optional[bool] = typer.Option(None, "--channel-scales/--no-channel-scales",
                                                  help="One scale per channel for the activations "
                                                  "the kernels take so (Conv outputs and lookups read "
                                                  "only by lookups and depthwise Convs), ranges from "
                                                  "DATA's fit samples, kept only if at least 0.5 dB "
                                                  "higher on the --holdout ones [default: on with "
                                                  "--data for 8-bit QDQ, the portable target]."),
    weight_rounding: Optional[bool] = typer.Option(None, "--weight-rounding/--no-weight-rounding",
                                                   help="Round MatMul/Gemm weights to fit their inputs "
                                                   "on DATA's fit samples (GPTQ), kept only if at least "
                                                   "0.5 dB higher on the --holdout ones [default: on "
                                                   "with --data]."),
    try_methods: Optional[str] = typer.Option(None, "--try-methods", help="Calibration methods to "
                                              "try per tensor against TABLE's, e.g. percentile,mse,kl "
                                              "(calibrated on DATA); each tensor keeps the one with the "
                                              "best output SQNR (needs --data)."),
    table_out: Optional[Path] = typer.Option(None, "--table-out", parser=_output_path, help="With --try-methods or the "
                                             "method choice, also write the table chosen."),
    num_samples: Optional[int] = typer.Option(None, help="Samples of DATA (spread evenly over it) that bias "
                                              "correction and the searches fit on [default: 16]."),
    holdout: Optional[int] = typer.Option(None, "--holdout", help="Other samples of DATA (spread "
                                          "over it, disjoint from those) that judge each fitted "
                                          "step: it is kept only if it scores better there "
                                          "[default: as many as --num-samples; 0: keep unjudged]."),
    batch_size: Optional[int] = typer.Option(None, help="Samples per onnxruntime run [default: 8, fewer "
                                             "where a sample's activations are large: within 512 MB, as "
                                             "calibrate chooses]."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
):
    """Rewrite MODEL as quantized ONNX using TABLE, ready for onnxruntime and qtool exec.

    The model carries 8-bit weights, int32 biases, scales and zero points, the rounding mode and
    multiplier width, and (metadata 'qtool.params') the integer parameters of every op: (S, Z) of
    inputs and outputs, per-channel multiplier and rshift, zero-point-compensated int32 bias, LUTs.

    \b
    Examples:
      qtool quantize model.onnx --table table.yaml -o model.q.onnx
      qtool quantize model.onnx --table calibration.json -o model.q.onnx   # onnxruntime's table
      qtool quantize model.onnx -t table.yaml -o model.q.onnx --symmetric --multiplier-bits 8
      qtool quantize model.onnx -t table.yaml -o model.q.onnx --keep-float Gemm --strict
      qtool quantize model.onnx -t table.yaml -o model.qop.onnx --format qoperator
      qtool quantize model.onnx -t table.yaml -o model.q.onnx --target x86-vnni   # int8 form
      qtool quantize model.onnx -t table.yaml -o model.q.onnx --params-out params.json
      qtool quantize model.onnx -t table.yaml -o model.q.onnx --activation-type int16   # 16x8
      qtool quantize model.onnx -t table.yaml -o model.q.onnx --weight-type int4 --block-size 32   # 4-bit MatMul weights
      qtool quantize model.onnx -t table.yaml -o model.q.onnx --activation-type int16 --weight-type int16   # 16x16
      qtool quantize model.onnx -t table.yaml -o model.q.onnx --precision-table qtable.txt
      qtool quantize model.onnx -t table.yaml -o model.q.onnx --data calib.npz   # method, biases
      qtool quantize model.onnx -t table.yaml -o model.q.onnx --data calib.npz --target-sqnr 30
      qtool quantize model.onnx -t table.yaml -o model.q.onnx --data calib.npz --max-float-layers 5
      qtool quantize model.onnx -t table.yaml -o model.q.onnx --data calib.npz --try-methods mse,kl
      qtool quantize model.onnx -t table.yaml -o model.q.onnx --input-pixels --mean 0.5 --std 0.5

    With --target-sqnr, --max-float-layers, --try-methods and the bias-correction judge, the score
    is the worst SQNR over the outputs: an output made by a Softmax/Sigmoid is scored on its input
    (the logits; a Sigmoid's where its probability still moves), an output that concatenates
    tensors (a detector's boxes and scores) part by part.
    """
    from .calibrate import make_calibrator
    from .channels import not_applicable as channels_not_applicable
    from .placement import applies as placement_applies
    from .recipe import DataSteps, check_runs_on_ranges, quantize_with_data
    from .params import drop_params, model_params
    from .model import load_model, prepare
    from .data import Preprocess, holds_images, resolve_preprocess
    from .pixels import PixelInput
    from .precision import Precisions, read_precision_table
    from .quantize import QuantizeOptions, quantize as run
    from .table_formats import dropped, dumps_table, output_format, read_table

    try:
        given = _image_given(resize, fit, pad, mean, std, scale, channels, layout, image_input)
        if given and not input_pixels and (data is None or not holds_images(data)):
            raise QtoolError("the image options describe the images of --data (a folder) or the pixels "
                             "of --input-pixels: add one")
        precisions = Precisions()
        if precision_table is not None:
            precisions = read_precision_table(precision_table, prepare(load_model(model), str(model)), model)
        options = QuantizeOptions(per_channel, symmetric, activation_type, multiplier_bits, rounding,
                                  format=format, strict=strict, target=target, weight_type=weight_type,
                                  block_size=block_size, **precisions.options(keep_float))
        if bias_correction and data is None:
            raise QtoolError("--bias-correction needs calibration samples: add --data DATA")
        if method_choice and data is None:
            raise QtoolError("--method-choice needs samples to score on: add --data DATA")
        if weight_rounding and data is None:
            raise QtoolError("--weight-rounding needs samples to fit on: add --data DATA")
        if placement and data is None:
            raise QtoolError("--placement needs samples to score on: add --data DATA")
        if channel_scales and data is None:
            raise QtoolError("--channel-scales needs samples to measure the channels on: add --data DATA")
        if channel_scales and channels_not_applicable(options):
            raise QtoolError(f"--channel-scales does not apply here ({channels_not_applicable(options)}): "
                             f"drop it")
        if placement and not placement_applies(options):
            raise QtoolError("--placement gives chosen ops int16 in an int8 QDQ model for the default "
                             "target: drop --activation-type, --precision-table, --format or --target")
        if (placement or weight_rounding or channel_scales) and (target_sqnr is not None
                                                                  or max_float_layers is not None):
            given_step = ("--placement" if placement else "--weight-rounding" if weight_rounding
                          else "--channel-scales")
            raise QtoolError(f"{given_step} does not combine with the search (--target-sqnr, "
                             f"--max-float-layers), which places int16 itself")
        if method_choice and try_methods is not None:
            raise QtoolError("--method-choice and --try-methods both choose the table's methods: "
                             "give one")
        picking = data is not None and try_methods is None and method_choice is not False
        searching = target_sqnr is not None or max_float_layers is not None
        needs = [o for o, v in (("--target-sqnr", target_sqnr), ("--max-float-layers", max_float_layers),
                                ("--try-methods", try_methods)) if v is not None]
        if needs and data is None:
            raise QtoolError(f"{needs[0]} needs samples to score on: add --data DATA")
        if table_out is not None and try_methods is None and not picking:
            raise QtoolError("--table-out writes the table --try-methods or --method-choice chooses: "
                             "add --data (and not --no-method-choice)")
        if table_out is not None and str(table_out) == "-":
            raise QtoolError("--table-out needs a file name (standard output carries the report)")
        if str(output) == STDOUT and (as_json or str(params_out) == STDOUT):
            raise QtoolError(f"-o - and {'--json' if as_json else '--params-out -'} would both write to "
                             f"standard output; choose one")
        methods = [m.strip() for m in (try_methods or "").split(",") if m.strip()]
        if try_methods is not None and not methods:
            raise QtoolError("--try-methods: no method named; e.g. --try-methods percentile,mse,kl")
        for method in methods:
            make_calibrator(method)
        if allow_float and not searching:
            raise QtoolError("--allow-float is for the search: add --target-sqnr or --max-float-layers")
        if max_float_layers is not None and max_float_layers < 0:
            raise QtoolError(f"--max-float-layers must be >= 0, got {max_float_layers}")
        if target_sqnr is not None and not (math.isfinite(target_sqnr) and target_sqnr > 0):
            raise QtoolError(f"--target-sqnr must be a finite number of dB above 0, got {target_sqnr}")
        if num_samples is not None and num_samples < 1:
            raise QtoolError(f"--num-samples must be at least 1, got {num_samples}")
        if batch_size is not None and batch_size < 1:
            raise QtoolError(f"--batch-size must be at least 1, got {batch_size}")
        if holdout is not None and holdout < 0:
            raise QtoolError(f"--holdout must be >= 0, got {holdout}")
        unused = [flag for flag, given in (("--num-samples", num_samples is not None),
                                           ("--holdout", holdout is not None),
                                           ("--batch-size", batch_size is not None)) if given]
        if unused and data is None:
            raise QtoolError(f"{unused[0]} sets how --data's samples are used: add --data DATA, or drop it")
        check_writable(output)
        if params_out is not None:
            check_writable(params_out)
        check_distinct(**{"-o": output, "--params-out": params_out, "--table-out": table_out})
        for written in (output, params_out, table_out):  # (--table-out may replace TABLE: read whole first)
            check_not_reading(written, model, data, precision_table, *([table] if written != table_out else []))
        loaded = read_table(table, table_format)
        if table_out is not None:
            check_writable(table_out)
        recorded = (Preprocess.from_dict(loaded.preprocess, f"table file '{table}'") if loaded.preprocess
                    else None)
        if input_pixels:  # the normalization given, else the one calibrate recorded, folded in
            pre, differing = resolve_preprocess(given, recorded, f"table file '{table}'")
            for w in differing:  # as exec and verify say it: the model folds in the given one
                _log(f"warning: {w}")
            pre = pre or Preprocess()
            order = pre.channels if "channels" in given or recorded is not None else None  # (for messages)
            pixels = PixelInput(pre.mean, pre.std, pre.scale, order)
            options = dataclasses.replace(options, input_pixels=pixels)
        if data is not None:
            steps = DataSteps(tuple(methods), method_choice, placement, weight_rounding, bias_correction,
                              target_sqnr, max_float_layers, allow_float,
                              DataSteps.num_samples if num_samples is None else num_samples, batch_size, holdout,
                              _image_preprocess(data, given, recorded, f"table file '{table}'"),
                              channel_scales=channel_scales)
            qmodel, report, loaded, _ = quantize_with_data(model, loaded, options, str(table), data, steps,
                                                           progress=not quiet)
        else:
            qmodel, report = run(model, loaded, options, str(table))
            check_runs_on_ranges(qmodel, model, loaded)
        extras = []
        if table_out is not None:
            extras.append((table_out, dumps_table(loaded, output_format(table_out)).encode()))
            if dropped(loaded, output_format(table_out)):
                report.warnings.append(dropped(loaded, output_format(table_out)))
        if params_out is not None:
            extras.append((params_out, (json.dumps(model_params(qmodel), indent=1) + "\n").encode()))
        if not params_metadata:
            drop_params(qmodel)
        outputs = [(output, qmodel.SerializeToString()), *extras]
        report.size_after = len(outputs[0][1])
        folders = _new_folders(*(path for path, _ in outputs))
        write_all(outputs)  # every output or none
        _made(folders, quiet)
    except QtoolError as e:
        raise _fail(e)
    say = _log if str(output) == STDOUT else typer.echo  # the model is on standard output
    for w in report.warnings:
        _log(f"warning: {w}")
    if as_json:
        say(json.dumps(report.to_dict(), indent=1))
        return
    ops = ", ".join(f"{t} {n}" for t, n in report.quantized.items())
    say(f"integer: {sum(report.quantized.values())} ops ({ops})")
    if report.int16:
        say(f"int16:   {int16_summary(report.int16)}")
    say(f"float:   {len(report.kept_float)} ops")
    for line in float_node_lines(report.kept_float):
        say(line)
    if report.guarded:
        say(f"guarded: {len(report.guarded)} float ops read their input through Flatten -> "
            f"Reshape, so that onnxruntime keeps their weights float")
    if report.format == "qoperator" and report.qdq_groups:
        say(f"qoperator: {len(report.qdq_groups)} integer ops without a quantized-operator "
            f"form stay DequantizeLinear -> op -> QuantizeLinear")
        for line in float_node_lines([(t, n, "no QLinear form") for t, n in report.qdq_groups]):
            say(line)
    shown = [b for b in report.bodies if b["integer"]]
    for body in shown:
        say(f"body:    {body['node']}.{body['body']}: {body['integer']} integer, {body['float']} float")
    if len(report.bodies) > len(shown):
        say(f"body:    {len(report.bodies) - len(shown)} other bodies (If/Loop/Scan) have no integer op")
    if report.blocked is not None:
        b = report.blocked
        say(f"weights: {b['weights']} MatMul/Gemm weights {b['type']}, "
            + (f"one scale per {b['block_size']} rows along K and column" if b["block_size"]
               else "one scale per column"))
    if report.widened:
        say(f"ranges made safe (zero width widened, beyond ±1e30 clipped): {', '.join(report.widened)}")
    if report.method_choice is not None:
        say(f"methods: {methods_summary(report.method_choice, loaded.method.split('+')[0])}")
    if report.method_pick is not None:
        say(f"method:  {pick_summary(report.method_pick)}")
    if report.channels is not None:
        say(f"scales:  {channels_summary(report.channels)}")
    if report.placement is not None:
        say(f"int16:   {placement_summary(report.placement)}")
    if report.rounding is not None:
        say(f"weights: {rounding_summary(report.rounding)}")
    if report.bias_correction is not None:
        say(f"bias:    {bias_summary(report.bias_correction)}")
    if report.search is not None:
        say(f"search:  {search_summary(report.search)}")
    say(f"size:    {report.size_before} -> {report.size_after} bytes (opset {report.opset}) "
        f"-> {output}")


@app.command(epilog=EXIT_CODES, cls=_GroupedCommand)
def analyze(
    model: Path = typer.Argument(..., metavar="MODEL", help="Float ONNX model."),
    data: Path = typer.Option(..., "--data", "-d", help=".npz keyed by model input name, or a folder of "
                                                        ".npy/.npz files or images: the samples every "
                                                        "variant is scored on." + DATA_AXES),
    table: Optional[Path] = typer.Option(None, "--table", "-t", help="Calibration table (any format "
                                         "quantize reads); default: calibrate on DATA with --method."),
    method: str = typer.Option("minmax", help="Calibration method when there is no --table."),
    per_channel: bool = typer.Option(True, "--per-channel/--per-tensor", help="Weight scales."),
    symmetric: bool = typer.Option(False, "--symmetric/--asymmetric", help="Activation ranges."),
    activation_type: str = typer.Option("int8", help="int8, uint8 or int16."),
    keep_float: List[str] = typer.Option([], help="Op type or node name to leave float (repeatable)."),
    num_samples: Optional[int] = typer.Option(16, help="Samples to score on (each op costs two runs "
                                                       "over them)."),
    batch_size: int = typer.Option(8, help="Samples per onnxruntime run."),
    top: int = typer.Option(20, help="Ops to list in the text (0: all; --json lists every op)."),
    all_ops: bool = typer.Option(False, "--all-ops", help="Score every op one by one. By default a "
                                 "model of more than 64 ops is first scored in groups of consecutive ops, "
                                 "and only the ops of the groups that gain most are scored one by one."),
    as_json: bool = typer.Option(False, "--json", help="Print the analysis as JSON on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    resize: Optional[str] = _RESIZE,
    fit: Optional[str] = _FIT,
    pad: Optional[float] = _PAD,
    mean: Optional[str] = _MEAN,
    std: Optional[str] = _STD,
    scale: Optional[float] = _SCALE,
    channels: Optional[str] = _CHANNELS,
    layout: Optional[str] = _LAYOUT,
    image_input: Optional[str] = _IMAGE_INPUT,
):
    """Rank the quantized ops by what they cost: the output SQNR against float with only that op
    quantized, and with only that op left float.

    The ops at the top of the ranking are the ones to keep float (quantize --keep-float) or give
    finer steps.

    \b
    Examples:
      qtool analyze model.onnx --data calib.npz
      qtool analyze model.onnx --data heldout.npz --table table.yaml --top 10 --json
      qtool analyze rec.onnx --data lines/ --table table.yaml   # images, as calibrate read them
    """
    from .analyze import analyze as run, format_analysis
    from .calibrate import calibrate as calibrate_table
    from .data import Preprocess, check_sampling, holds_images
    from .quantize import QuantizeOptions, quantize as quantize_model
    from .table_formats import read_table

    options = QuantizeOptions(per_channel, symmetric, activation_type, keep_float=tuple(keep_float))
    try:
        check_sampling(num_samples, batch_size)
        if top < 0:
            raise QtoolError(f"--top must be >= 0 (0: every op), got {top}")
        given = _image_given(resize, fit, pad, mean, std, scale, channels, layout, image_input)
        if given and not holds_images(data):
            raise QtoolError(f"the image options describe a folder of images; '{data}' is not one")
        table_ = read_table(table) if table is not None else None
        recorded = (Preprocess.from_dict(table_.preprocess, f"table file '{table}'")
                    if table_ is not None and table_.preprocess else None)
        pre = _image_preprocess(data, given, recorded, f"table file '{table}'")
        if table_ is None:
            table_ = calibrate_table(model, data, method, progress=not quiet, preprocess=pre)
        qmodel, _ = quantize_model(model, table_, options, str(table or "calibration"))
        result = run(model, qmodel, data, num_samples, batch_size, progress=not quiet, preprocess=pre,
                     every_op=all_ops)
    except QtoolError as e:
        raise _fail(e)
    typer.echo(json.dumps(result.to_dict(), indent=1) if as_json
               else format_analysis(result, top or None))


@app.command(epilog=EXIT_CODES, cls=_GroupedCommand)
def verify(
    model: Path = typer.Argument(..., metavar="MODEL", help="Float ONNX model."),
    qmodel: Path = typer.Argument(..., metavar="QMODEL", help="Quantized model from qtool quantize."),
    data: Path = typer.Option(..., "--data", "-d", help=".npz keyed by model input name, or a folder "
                              "of .npy/.npz or images (preprocessed as calibrate recorded in QMODEL, "
                              "unless the image options say otherwise)." + DATA_AXES),
    resize: Optional[str] = _RESIZE,
    fit: Optional[str] = _FIT,
    pad: Optional[float] = _PAD,
    mean: Optional[str] = _MEAN,
    std: Optional[str] = _STD,
    scale: Optional[float] = _SCALE,
    channels: Optional[str] = _CHANNELS,
    layout: Optional[str] = _LAYOUT,
    image_input: Optional[str] = _IMAGE_INPUT,
    tolerance: str = typer.Option("0.99,20", help="COS or COS,SQNR: minimum output cosine and SQNR (dB), "
                                 "for every output and every part of an output that joins tensors "
                                 "(each input of its Concat, e.g. boxes and class scores). COS alone "
                                 "sets no SQNR floor."),
    labels: Optional[str] = typer.Option(None, help="Array in DATA with class labels: adds top-1 "
                                                    "accuracy of both models."),
    num_samples: Optional[int] = typer.Option(None, help="Use only the first N samples."),
    layers: str = typer.Option(str(DEFAULT_LAYERS), "--layers", metavar="N|all", help="Samples the "
                               "tensors are compared on, in whole batches spread over the data (the "
                               "outputs are compared on every sample); all: every sample."),
    batch_size: Optional[int] = typer.Option(None, help="Samples per run (every compared tensor "
                                             "of a batch is held in memory). Default: chosen "
                                             "from --memory (at most "
                                             f"{VERIFY_BATCH_CAP}), and logged."),
    memory: int = typer.Option(DEFAULT_MEMORY_MB, "--memory", metavar="MB",
                               help="Peak memory the default batch size aims to stay under."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
    report_path: Optional[Path] = typer.Option(None, "--report", parser=_output_path, help="Also write the report as "
                                               "one self-contained HTML page (with an SQNR plot "
                                               "when matplotlib is installed)."),
    run_ort: bool = typer.Option(False, "--ort", help="Also run onnxruntime on QMODEL: its outputs "
                                 "against the float model and against the integer executor, and "
                                 "which of its graph passes changed the model."),
    ort_config: Optional[List[str]] = typer.Option(None, "--ort-config", metavar="KEY=VALUE",
                                                   help="A session config entry for --ort's "
                                                   "onnxruntime session, as you deploy it "
                                                   "(repeatable), e.g. "
                                                   "session.x64quantprecision=1."),
    run_analyze: bool = typer.Option(False, "--analyze", help="Also rank the quantized ops by "
                                     "sensitivity, as qtool analyze does (QMODEL must be QDQ)."),
    analyze_samples: Optional[int] = typer.Option(None, help="Samples --analyze scores on, the first "
                                                  "of the compared ones (each op costs two "
                                                  "onnxruntime runs over them). Default: 16."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    target: str = typer.Option("exact", "--target", help="Arithmetic of the executor: exact "
                               "(int32 accumulation, the integer device), x86-avx2 (onnxruntime's "
                               "u8 x s8 products on an x86 CPU without VNNI: adjacent pairs added in "
                               "int16 with saturation, as an AVX2 host computes) or host (whichever "
                               "of the two this machine's onnxruntime uses)."),
    cluster: Optional[str] = _cluster_option(),
):
    """Compare the float model with the integer executor, output by output and tensor by tensor.

    Exits 1 when an output, or a part of one, misses the tolerance (the --report page is written
    all the same). An output that comes from a Concat (through reshapes, transposes and
    elementwise maps) is also scored part by part, each Concat input where its values land: a
    detector's class scores beside its box coordinates cannot hide behind them.

    \b
    Examples:
      qtool verify model.onnx model.q.onnx --data heldout.npz
      qtool verify model.onnx model.q.onnx --data heldout.npz --labels label --tolerance 0.999,30
      qtool verify model.onnx model.q.onnx --data heldout.npz --ort --report report.html
      qtool verify model.onnx model.q.onnx --data heldout.npz --ort --ort-config session.disable_quant_qdq=1
      qtool verify model.onnx model.q.onnx --data heldout.npz --analyze --report report.html
      qtool verify model.onnx model.q.onnx --data heldout.npz --target x86-avx2   # as on AVX2
      qtool verify model.onnx model.q.onnx --data heldout.npz --cluster local:4
    """
    from .html_report import render_html
    from .verify import format_report, parse_tolerance, verify as run

    try:
        if analyze_samples is not None and not run_analyze:
            raise QtoolError("--analyze-samples is for --analyze; add --analyze or drop it")
        if ort_config and not run_ort:
            raise QtoolError("--ort-config is for --ort; add --ort or drop it")
        config = dict(_key_value("--ort-config", entry) for entry in ort_config or [])
        if report_path is not None:
            if str(report_path) == STDOUT:
                raise QtoolError("--report needs a file name (standard output carries the report)")
            check_writable(report_path)
            check_not_reading(report_path, model, qmodel, data)
        if cluster is not None:
            from .cluster import verify as verify_on

            run = functools.partial(verify_on, cluster)
        pre = _recorded_images(qmodel, data, _image_given(resize, fit, pad, mean, std, scale, channels, layout,
                                                          image_input))
        report = run(model, qmodel, data, parse_tolerance(tolerance), labels, num_samples, batch_size,
                     progress=not quiet, preprocess=pre, run_ort=run_ort, run_analyze=run_analyze,
                     analyze_samples=16 if analyze_samples is None else analyze_samples,
                     arithmetic=target, ort_config=config, memory_mb=memory,
                     log=_log, layers=_layers(layers))
        if report_path is not None:
            folders = _new_folders(report_path)
            atomic_write(report_path, render_html(report, model.name, qmodel.name).encode())
            _made(folders, quiet)
    except QtoolError as e:
        raise _fail(e)
    typer.echo(json.dumps(report.to_dict(), indent=1) if as_json else format_report(report))
    if not report.passed:
        raise typer.Exit(EXIT_VERIFY_FAILED)


@app.command("exec", epilog=EXIT_CODES, cls=_GroupedCommand)
def exec_(
    qmodel: Path = typer.Argument(..., metavar="QMODEL", help="Quantized model from qtool quantize."),
    inputs: Path = typer.Option(..., "--input", "-i", help=".npz keyed by model input name, or a "
                                "folder of .npy/.npz or images (preprocessed as calibrate recorded in "
                                "QMODEL, unless the image options say otherwise)." + DATA_AXES),
    resize: Optional[str] = _RESIZE,
    fit: Optional[str] = _FIT,
    pad: Optional[float] = _PAD,
    mean: Optional[str] = _MEAN,
    std: Optional[str] = _STD,
    scale: Optional[float] = _SCALE,
    channels: Optional[str] = _CHANNELS,
    layout: Optional[str] = _LAYOUT,
    image_input: Optional[str] = _IMAGE_INPUT,
    output: Path = typer.Option(..., "--output", "-o", parser=_output_path, help=".npz of the model outputs; - for standard "
                                "output."),
    as_json: bool = typer.Option(False, "--json", help="Print the report (steps, float nodes, "
                                                       "outputs) as JSON on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No report and no progress bar on "
                                                             "stderr."),
    batch_size: Optional[int] = typer.Option(None, help="Samples per run. Default: chosen from "
                                             f"--memory (at most {EXEC_BATCH_CAP}), and logged."),
    memory: int = typer.Option(DEFAULT_MEMORY_MB, "--memory", metavar="MB",
                               help="Peak memory the default batch size aims to stay under."),
    target: str = typer.Option("exact", "--target", help="Arithmetic of the executor: exact "
                               "(int32 accumulation, the integer device), x86-avx2 (onnxruntime's "
                               "u8 x s8 products on an x86 CPU without VNNI: adjacent pairs added in "
                               "int16 with saturation, as an AVX2 host computes) or host (whichever "
                               "of the two this machine's onnxruntime uses)."),
):
    """Run QMODEL on the integer-only executor and save its outputs.

    Samples are on the first axis of each array and run --batch-size at a time; the outputs are
    written as they come (memory does not grow with the number of samples). A scalar input takes a
    0-d array, fed whole to every run; an input whose first size is fixed above 1 and another open
    (a state [2,N,128]) takes its samples on that axis, and an output shaped so is written in one
    batch. Otherwise an output whose one axis of the batch's size is not its first (a state
    [2,N,128], a time-major [T,N,C]) is written with that axis moved first, and the log says so. An array shaped
    exactly as its model input (every size fixed) is fed whole to every run when the arrays' sample
    counts disagree: a state, or inputs of different fixed sizes run once as they are. An output
    whose shape changes from sample to sample (a decoder that stops on a value) is written per
    sample, as arrays NAME/0, NAME/1, ... of the .npz.

    \b
    Examples:
      qtool exec model.q.onnx --input x.npz -o y.npz
      qtool exec model.q.onnx --input images/ -o y.npz --batch-size 1
      qtool exec model.q.onnx --input x.npz -o y.npz --target x86-avx2   # what an AVX2 host computes
    """
    from .execute import execute

    try:
        _one_stdout_writer(as_json, output)
        check_writable(output)
        check_not_reading(output, qmodel, inputs)
        folders = _new_folders(output)
        result = execute(qmodel, inputs, output, batch_size, memory, target,
                         _image_given(resize, fit, pad, mean, std, scale, channels, layout, image_input),
                         progress=not quiet)
        _made(folders, quiet)
    except QtoolError as e:
        raise _fail(e)
    for w in result.warnings:
        _log(f"warning: {w}")
    if result.note and not quiet and not as_json:
        _log(result.note)
    if not quiet and not as_json:
        for name, count in result.per_sample.items():
            _log(f"output '{name}' changes shape from sample to sample: written per sample, as "
                 f"'{name}/0' ... '{name}/{count - 1}'")
        for name, axis in result.moved.items():
            _log(f"output '{name}' has its samples on axis {axis}: written with them first, as "
                 f"{result.outputs.get(name)}")
    if not result.integer_steps:
        _log(f"warning: no op of '{qmodel}' ran integer; is it a float model? (see qtool quantize)")
    if as_json:
        typer.echo(json.dumps({
            "steps": result.steps, "integer_steps": result.integer_steps,
            "float_nodes": [{"op_type": t, "node": n, "reason": r} for t, n, r in result.float_nodes],
            "outputs": result.outputs, "per_sample_outputs": list(result.per_sample),
            "samples_moved_first": result.moved, "output": str(output)}, indent=1))
    elif not quiet:
        _log(f"ran {result.steps} steps, {len(result.float_nodes)} in float -> {output}")
        for line in float_node_lines(result.float_nodes):
            _log(line)


# ignore_unknown_options: so that "-1" is a value
@app.command(context_settings={"ignore_unknown_options": True}, epilog=EXIT_CODES, cls=_GroupedCommand)
def scale(
    value: str = typer.Argument(..., metavar="SCALE", help="A positive float scale, e.g. 0.1234."),
    bits: int = typer.Option(32, help="Multiplier width: 32 or 8."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Show a float scale as a fixed-point multiplier and right shift: scale ~ M / 2^rshift.

    \b
    Examples:
      qtool scale 0.1234              # multiplier 2119995857, rshift 34
      qtool scale 0.1234 --bits 8     # multiplier 126, rshift 10
      qtool scale 0.1234 --json
    """
    try:
        s = float(value)
    except ValueError:
        raise _fail(QtoolError(f"scale must be a number, got '{value}'"))
    try:
        multiplier, rshift = quantize_multiplier(s, bits)
    except ValueError as e:
        raise _fail(QtoolError(str(e)))
    approx = math.ldexp(multiplier, -rshift)
    info = {"scale": s, "multiplier": multiplier, "rshift": rshift, "bits": bits,
            "approx": approx, "relative_error": abs(approx - s) / s}
    if as_json:
        typer.echo(json.dumps(info))
        return
    left = f"  (a left shift by {-rshift})" if rshift < 0 else ""
    typer.echo(f"multiplier      {multiplier}\nrshift          {rshift}{left}\nbits            {bits}\n"
               f"approx          {approx!r}\nrelative_error  {info['relative_error']:.3g}")


@app.command(epilog=EXIT_CODES, cls=_GroupedCommand)
def run(
    job: Path = typer.Argument(..., metavar="JOB", help="YAML job file: one job (see configs/demo.yaml) or a batch "
                                         "with defaults and jobs (see configs/ppocr.yaml)."),
    jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="Run up to N jobs at once, each in its "
                                                           "own process."),
    force: bool = typer.Option(False, "--force", help="Run jobs whose outputs are up to date too."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the file and print the plan; run "
                                                          "nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars or stage logs."),
    cluster: Optional[str] = _cluster_option(),
):
    """Run YAML jobs: calibrate -> quantize -> verify, writing every artifact under output_dir.

    The whole file is checked before any work starts. A job whose inputs (file contents) and
    settings are unchanged since its last passing run, with its outputs intact, is skipped unless
    --force. A failing job does not stop the others; a summary table lists every job.

    A file of one job prints that job's verify report when it runs (the table when it is up to
    date, or with --json).

    Exit codes: 0 every job passed (or was up to date), 1 a verification or accuracy check
    failed, 2 a job could not run (or the file is invalid), 3 a job stopped on an internal error.

    \b
    Examples:
      qtool run configs/demo.yaml
      qtool run configs/ppocr.yaml --jobs 2
      qtool run configs/ppocr.yaml --dry-run
      qtool run configs/ppocr.yaml --force --json > summary.json
      qtool run configs/ppocr.yaml --cluster tcp://scheduler:8786   # each job a task on the cluster
    """
    from .job import describe_plan, format_summary, plan_dict, plan_jobs, run_batch, up_to_date
    from .verify import format_report

    log = (lambda m: None) if quiet else _log
    try:
        if cluster is not None and jobs != 1:
            raise QtoolError("--jobs and --cluster both say where jobs run (--cluster runs as many at "
                             "once as it has workers); give one of them")
        plans = plan_jobs(job)
    except QtoolError as e:
        raise _fail(e)
    if dry_run:
        skips = [not force and up_to_date(plan) is not None for plan in plans]
        if as_json:
            typer.echo(json.dumps([plan_dict(plan, skip) for plan, skip in zip(plans, skips)], indent=1))
            return
        for plan, skip in zip(plans, skips):
            typer.echo("\n".join(describe_plan(plan, skip)))
        return
    single = len(plans) == 1 and not plans[0].where
    if single and (force or up_to_date(plans[0]) is None) and not as_json:
        from .job import run_job  # one job: its full verify report, as before batches existed

        try:
            if cluster is not None:
                from .cluster import run_job as run_on

                run_job = functools.partial(run_on, cluster)
            result = run_job(plans[0], progress=not quiet, log=log)
        except QtoolError as e:  # found while the job ran: the file, and the keys instead of the flags
            from .job import in_job_words

            text = in_job_words(str(e))
            worded = QtoolError(text if text.startswith("job file") else f"job file '{job}': {text}")
            worded.exit_code = e.exit_code
            raise _fail(worded)
        typer.echo(format_report(result.verify))
        for failure in result.failures[len(result.verify.failures):]:
            typer.echo(f"FAIL: {failure}")
        if result.failures:
            raise typer.Exit(EXIT_VERIFY_FAILED)
        return

    def done(outcome):
        log(f"job '{outcome.name}': {outcome.status}"
            + (f" ({outcome.message})" if outcome.message and outcome.status != "ok" else ""))

    try:
        if cluster is not None:
            from .cluster import run_batch as run_on

            run_batch = functools.partial(run_on, cluster)
        outcomes = run_batch(plans, jobs, force, progress=not quiet and jobs == 1, log=log, on_done=done)
    except QtoolError as e:
        raise _fail(e)
    typer.echo(json.dumps([o.to_dict() for o in outcomes], indent=1) if as_json
               else format_summary(outcomes))
    if any(o.internal for o in outcomes):  # a bug in qtool, as a single command would exit
        raise typer.Exit(EXIT_INTERNAL_ERROR)
    if any(o.status == "error" for o in outcomes):
        raise typer.Exit(EXIT_USER_ERROR)
    if any(o.status == "failed" for o in outcomes):
        raise typer.Exit(EXIT_VERIFY_FAILED)


@app.command()
def version():
    """Print the qtool version."""
    typer.echo(__version__)


class Interrupted(BaseException):
    """Ctrl-C or SIGTERM: raised by qtool's handlers instead of KeyboardInterrupt, which click
    turns into a blank line, or instead of dying at once. A BaseException, so that every cleanup
    (temporary outputs, a job's staged files, ``run``'s workers) runs as it unwinds."""

    def __init__(self, signum: int = int(signal.SIGINT)):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, frame) -> None:
    STOP.append(signum)
    raise Interrupted(signum)


def _stopped(signum: int) -> None:
    """The one line and exit code of a Ctrl-C (130), a SIGTERM (143) or a SIGHUP (129: the
    terminal closed)."""
    words = {signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}.get(signum, "interrupted")
    typer.echo(f"error: {words}", err=True)
    raise SystemExit(128 + int(signum) if signum in (signal.SIGTERM, signal.SIGHUP) else 130)


def main() -> None:
    """The console script: like ``app()``, but click's own usage errors (an unknown option, a
    value of the wrong type) are one ``error:`` line too, with exit code 2; Ctrl-C prints
    ``error: interrupted`` and exits 130."""
    import sys

    from . import entry

    noting = signal.getsignal(signal.SIGINT) is entry._note, signal.getsignal(signal.SIGTERM) is entry._note
    if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, entry._note):  # not ignored (a background job)
        signal.signal(signal.SIGINT, _interrupt)
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, entry._note):  # kill's default: clean up, then exit 143
        signal.signal(signal.SIGTERM, _interrupt)
    if signal.getsignal(signal.SIGHUP) == signal.SIG_DFL:  # not nohup's: clean up as for SIGTERM, exit 129
        signal.signal(signal.SIGHUP, _interrupt)
    if entry.NOTED and any(noting):  # Ctrl-C or SIGTERM while the console script imported this
        _stopped(entry.NOTED[0])
    try:
        command = typer.main.get_command(app)
        code = command.main(args=sys.argv[1:], prog_name="qtool", standalone_mode=False)
    except Exception as e:  # click's exception classes are private to typer: match by behaviour
        if STOP:  # a signal inside an import or a callback came back as another error
            _stopped(STOP[0])
        if not (hasattr(e, "format_message") and hasattr(e, "exit_code")):
            _internal_error(e)
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `qtool CMD`: show that command's help
            e.show()
            raise SystemExit(e.exit_code) from None
        message = " ".join(e.format_message().split())
        where = getattr(getattr(e, "ctx", None), "command_path", None) or "qtool"
        typer.echo(f"error: {message} (see {where} --help)", err=True)
        raise SystemExit(e.exit_code) from None
    except (KeyboardInterrupt, Interrupted) as e:
        _stopped(STOP[0] if STOP else getattr(e, "signum", signal.SIGINT))
    if STOP:  # swallowed on the way (numba's compiler calls back into Python): still stopped
        _stopped(STOP[0])
    raise SystemExit(code if isinstance(code, int) else 0)


def _internal_error(e: Exception) -> None:
    """A bug, or a model qtool does not handle yet: still one line, with exit code 3 (the
    traceback with QTOOL_TRACEBACK=1)."""
    if os.environ.get("QTOOL_TRACEBACK"):
        import traceback

        traceback.print_exception(e)  # and still exit 3: a script's exit codes do not change
    from .model import first_line

    typer.echo(f"error: internal error, {type(e).__name__}: {first_line(e)} (qtool could not "
               f"handle this; QTOOL_TRACEBACK=1 shows where; please report it)", err=True)
    raise SystemExit(EXIT_INTERNAL_ERROR) from None

