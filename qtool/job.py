"""``qtool run JOB.yaml``: calibrate -> quantize -> verify from one YAML file.

The file is validated whole before any work starts; errors name the YAML path and the allowed
values. Paths in the file are relative to the file's folder.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import calibrators

from .calibrate import collect, make_calibrator
from .data import CHANNEL_ORDERS, LAYOUTS, Preprocess, read_npz
from .errors import QtoolError
from .fileio import atomic_write, check_writable
from .fixedpoint import MULTIPLIER_BITS, ROUNDING_MODES
from .quantize import ACTIVATION_TYPES, QuantizeOptions, quantize
from .stats_graph import DEFAULT_SAMPLES_PER_TENSOR
from .table import write_table
from .verify import DEFAULT_BATCH as VERIFY_BATCH
from .verify import VerifyReport, parse_tolerance, verify

_NUMBER = (int, float)
SCHEMA = {
    "model": (str, True),
    "output_dir": (str, False),
    "calibrate": ({
        "data": (str, True),
        "method": ("choice:calibrators", False),
        "params": (dict, False),
        "histogram_samples": (int, False),
        "num_samples": ("posint", False),
        "batch_size": ("posint", False),
        "preprocess": ({
            "resize": (list, False),
            "mean": (list, False),
            "std": (list, False),
            "scale": (float, False),
            "channels": (("choice", CHANNEL_ORDERS), False),
            "layout": (("choice", LAYOUTS), False),
            "input": (str, False),
        }, False),
    }, True),
    "quantize": ({
        "per_channel": (bool, False),
        "symmetric": (bool, False),
        "activation_type": (("choice", ACTIVATION_TYPES), False),
        "multiplier_bits": (("choice", MULTIPLIER_BITS), False),
        "rounding": (("choice", ROUNDING_MODES), False),
        "keep_float": (list, False),
    }, False),
    "verify": ({
        "data": (str, False),
        "labels": (str, False),
        "tolerance": ((float, list), False),
        "num_samples": ("posint", False),
        "batch_size": ("posint", False),
        "max_accuracy_drop": (float, False),
    }, False),
}
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false", float: "a number",
               list: "a list", dict: "a mapping"}


def _check(value, schema: dict, path: str) -> None:
    if not isinstance(value, dict):
        raise QtoolError(f"{path or 'job'}: expected a mapping, got {type(value).__name__}")
    for key in value:
        if key not in schema:
            raise QtoolError(f"{path + '.' if path else ''}{key}: unknown key; "
                             f"allowed keys: {', '.join(schema)}")
    for key, (kind, required) in schema.items():
        where = f"{path + '.' if path else ''}{key}"
        if key not in value:
            if required:
                raise QtoolError(f"{where}: required key is missing")
            continue
        v = value[key]
        if isinstance(kind, dict):
            _check(v, kind, where)
        elif kind == "choice:calibrators":
            _choice(v, calibrators.names(), where)
        elif isinstance(kind, tuple) and kind[0] == "choice":
            _choice(v, kind[1], where)
        elif kind == "posint":
            _type(v, int, where)
            if v < 1:
                raise QtoolError(f"{where}: must be >= 1, got {v}")
        else:
            _type(v, kind, where)


def _choice(v, allowed, where: str) -> None:
    if v not in allowed or isinstance(v, bool):
        raise QtoolError(f"{where}: unknown {v!r}; choose one of {', '.join(map(str, allowed))}")


def _type(v, kind, where: str) -> None:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = any(isinstance(v, _NUMBER) and not isinstance(v, bool) if k is float
             else isinstance(v, k) and not (k is int and isinstance(v, bool)) for k in kinds)
    if not ok:
        expected = " or ".join(_TYPE_NAMES[k] for k in kinds)
        raise QtoolError(f"{where}: expected {expected}, got {v!r}")


def load_job(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise QtoolError(f"job file '{path}' not found")
    try:
        job = yaml.safe_load(path.read_text())
        if job is None:
            raise QtoolError(f"job file '{path}' is empty; expected a mapping with model, calibrate, ...")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise QtoolError(f"job file '{path}' is not valid YAML{where}: "
                         f"{getattr(e, 'problem', None) or e}") from None
    except UnicodeDecodeError:
        raise QtoolError(f"job file '{path}' is not text") from None
    try:
        _check(job, SCHEMA, "")
    except QtoolError as e:
        raise QtoolError(f"job file '{path}': {e}") from None
    return job


@dataclass
class JobResult:
    table: Path
    qmodel: Path
    report_json: Path
    verify: VerifyReport
    quantize_report: object
    seconds: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class JobPlan:
    """A validated job: every path resolved, every setting parsed."""

    model: Path
    calibrate_data: Path
    verify_data: Path
    table: Path
    qmodel: Path
    report: Path
    calibrate: dict
    preprocess: Preprocess | None
    options: QuantizeOptions
    tolerance: tuple[float, float | None]
    verify: dict


def plan_job(path: str | Path) -> JobPlan:
    """Load and check a job whole, before any work: schema, files, labels, output folder."""
    path = Path(path)
    job = load_job(path)

    def resolve(p: str) -> Path:
        return Path(os.path.normpath(path.parent / p))

    def fail(key: str, message: str) -> QtoolError:
        return QtoolError(f"job file '{path}': {key}: {message}")

    cal, qz, ver = job["calibrate"], job.get("quantize", {}), job.get("verify", {})
    model = resolve(job["model"])
    out = resolve(job.get("output_dir", f"build/{model.stem}"))
    files = {"model": model, "calibrate.data": resolve(cal["data"]),
             "verify.data": resolve(ver.get("data", cal["data"]))}
    for key, file in files.items():
        if file.is_dir():
            raise fail(key, f"'{file}' is a directory, not a file")
        if not file.is_file():
            raise fail(key, f"file '{file}' not found")
    try:
        tolerance = parse_tolerance(ver.get("tolerance", 0.99))
    except QtoolError as e:
        raise fail("verify.tolerance", str(e)) from None
    if "labels" in ver:
        arrays = read_npz(files["verify.data"])
        if ver["labels"] not in arrays:
            raise fail("verify.labels", f"no array '{ver['labels']}' in '{files['verify.data']}' "
                                        f"(arrays: {', '.join(arrays)})")
    if "max_accuracy_drop" in ver and "labels" not in ver:
        raise fail("verify.max_accuracy_drop", "needs verify.labels")
    if cal.get("histogram_samples", 0) < 0:
        raise fail("calibrate.histogram_samples", f"must be >= 0, got {cal['histogram_samples']}")
    try:
        make_calibrator(cal.get("method", "minmax"), cal.get("params"))
    except QtoolError as e:
        raise fail("calibrate.params", str(e)) from None
    preprocess = None
    if "preprocess" in cal:
        pre = dict(cal["preprocess"])
        if "resize" in pre:
            if len(pre["resize"]) != 2 or not all(isinstance(v, int) and v > 0 for v in pre["resize"]):
                raise fail("calibrate.preprocess.resize", f"expected [height, width], got {pre['resize']}")
            pre["resize"] = tuple(pre["resize"])
        for key in ("mean", "std"):
            if key in pre:
                if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pre[key]):
                    raise fail(f"calibrate.preprocess.{key}", f"expected numbers, got {pre[key]}")
                pre[key] = tuple(float(v) for v in pre[key])
        preprocess = Preprocess(**pre)
        try:
            preprocess.check()
        except QtoolError as e:
            raise fail("calibrate.preprocess", str(e)) from None
    if not all(isinstance(v, str) for v in qz.get("keep_float", [])):
        raise fail("quantize.keep_float", f"expected a list of op types or node names, "
                                          f"got {qz['keep_float']}")
    options = QuantizeOptions(**{k: tuple(v) if k == "keep_float" else v for k, v in qz.items()})
    plan = JobPlan(model, files["calibrate.data"], files["verify.data"],
                   out / f"{model.stem}.table.yaml", out / f"{model.stem}.q.onnx",
                   out / f"{model.stem}.verify.json", cal, preprocess, options, tolerance, ver)
    for target in (plan.table, plan.qmodel, plan.report):
        try:
            check_writable(target)
        except QtoolError as e:
            raise fail("output_dir", str(e)) from None
    return plan


def run_job(path: str | Path, progress: bool = True, log=print) -> JobResult:
    """Run a job; when a stage fails, the artifacts written by the earlier ones are removed (and
    the folders made for them), so that a failed job leaves nothing, as every command does."""
    plan = plan_job(path)
    folders = []  # the output folders that do not exist yet, deepest first
    folder = plan.table.parent
    while not folder.exists():
        folders.append(folder)
        folder = folder.parent
    written: list[Path] = []
    try:
        return _run(plan, progress, log, written)
    except BaseException:
        for artifact in written:
            artifact.unlink(missing_ok=True)
        for folder in folders:
            try:
                folder.rmdir()
            except OSError:  # not empty: something else was put there meanwhile
                break
        raise


def _run(plan: JobPlan, progress: bool, log, written: list[Path]) -> JobResult:
    cal, ver = plan.calibrate, plan.verify
    seconds = {}

    t0 = time.perf_counter()
    table = collect(plan.model, plan.calibrate_data, cal.get("method", "minmax"), cal.get("params"),
                    cal.get("num_samples"), cal.get("batch_size", 32), progress, plan.preprocess,
                    histogram_samples=cal.get("histogram_samples", DEFAULT_SAMPLES_PER_TENSOR)).table()
    write_table(table, plan.table)
    written.append(plan.table)
    seconds["calibrate"] = time.perf_counter() - t0
    log(f"calibrate: {table.samples} samples, {len(table.tensors)} tensors -> {plan.table} "
        f"({seconds['calibrate']:.1f} s)")

    t0 = time.perf_counter()
    qmodel, qreport = quantize(plan.model, table, plan.options, str(plan.table))
    atomic_write(plan.qmodel, qmodel.SerializeToString())
    written.append(plan.qmodel)
    seconds["quantize"] = time.perf_counter() - t0
    log(f"quantize: {sum(qreport.quantized.values())} ops integer, {len(qreport.kept_float)} float "
        f"-> {plan.qmodel} ({seconds['quantize']:.1f} s)")

    t0 = time.perf_counter()
    report = verify(plan.model, plan.qmodel, plan.verify_data, plan.tolerance, ver.get("labels"),
                    ver.get("num_samples"), ver.get("batch_size", VERIFY_BATCH), progress, plan.preprocess)
    seconds["verify"] = time.perf_counter() - t0
    failures = list(report.failures)
    drop = ver.get("max_accuracy_drop")
    if drop is not None:
        lost = report.accuracy["float"] - report.accuracy["integer"]
        if lost > drop:
            failures.append(f"accuracy drop {lost:.2f} points > max_accuracy_drop {drop}")
    summary = report.to_dict() | {"job_failures": failures, "seconds": seconds}
    atomic_write(plan.report, (json.dumps(summary, indent=1) + "\n").encode())
    log(f"verify: {report.samples} samples -> {plan.report} ({seconds['verify']:.1f} s)")
    return JobResult(plan.table, plan.qmodel, plan.report, report, qreport, seconds, failures)
