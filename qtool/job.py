"""``qtool run JOB.yaml``: calibrate -> quantize -> verify from one YAML file.

The file is validated whole before any work starts; errors name the YAML path and the allowed
values. Paths in the file are relative to the file's folder.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

import calibrators

from . import __version__
from .batching import DEFAULT_LAYERS
from .bias_correction import BIAS_SAMPLES
from .calibrate import collect, make_calibrator
from .data import CHANNEL_ORDERS, FITS, LAYOUTS, Preprocess, read_npz
from .errors import STOP, QtoolError
from .fileio import atomic_write, check_not_reading, check_writable, mode_for, replaced
from .fixedpoint import MULTIPLIER_BITS, ROUNDING_MODES
from .model import file_digest, first_line, load_model, prepare
from .params import drop_params
from .pixels import PixelInput
from .precision import Precisions, read_precision_table
from .quantize import ACTIVATION_TYPES, FORMATS, WEIGHT_TYPES, QuantizeOptions
from .report import bias_summary, channels_summary, methods_summary, pick_summary, placement_summary, \
    rounding_summary, search_summary
from .targets import TARGETS
from .channels import not_applicable as channels_not_applicable
from .placement import applies as placement_applies
from .recipe import DataSteps, quantize_with_data
from .stats_graph import DEFAULT_SAMPLES_PER_TENSOR
from .table_formats import write_table
from .verify import DEFAULT_TOLERANCE, VerifyReport, parse_tolerance, verify

_NUMBER = (int, float)
SCHEMA = {
    "name": ("file name", False),  # names the outputs and the summary row; default: the model's stem
    "model": (str, True),
    "output_dir": ("output folder", False),  # relative to the file; "{name}" stands for the job's name
    "calibrate": ({
        "data": (str, True),
        "method": ("choice:calibrators", False),
        "params": (dict, False),
        "histogram_samples": (int, False),
        "num_samples": ("posint", False),
        "batch_size": ("posint", False),
        "preprocess": ({
            "resize": (list, False),
            "mean": ((float, list), False),  # one number for every channel, or one a channel
            "std": ((float, list), False),
            "scale": (float, False),
            "channels": (("choice", CHANNEL_ORDERS), False),
            "layout": (("choice", LAYOUTS), False),
            "input": (str, False),
            "fit": (("choice", FITS), False),
            "pad": (float, False),
        }, False),
    }, True),
    "quantize": ({
        "per_channel": (bool, False),
        "symmetric": (bool, False),
        "activation_type": (("choice", ACTIVATION_TYPES), False),
        "weight_type": (("choice", WEIGHT_TYPES), False),
        "block_size": ("count", False),
        "multiplier_bits": (("choice", MULTIPLIER_BITS), False),
        "rounding": (("choice", ROUNDING_MODES), False),
        "keep_float": (list, False),
        "format": (("choice", FORMATS), False),
        "strict": (bool, False),
        "target": (("choice", tuple(TARGETS)), False),
        "input_pixels": (bool, False),  # the calibrate preprocessing folded in: uint8 pixels in
        "bias_correction": (bool, False),
        "bias_samples": ("posint", False),
        "holdout": ("count", False),
        "target_sqnr": (float, False),
        "max_float_layers": (int, False),
        "try_methods": (list, False),
        "method_choice": (bool, False),
        "placement": (bool, False),
        "weight_rounding": (bool, False),
        "channel_scales": (bool, False),
        "params_metadata": (bool, False),
        "allow_float": (bool, False),
        "precision_table": (str, False),  # quantize --precision-table: a path, as data paths are
    }, False),
    "verify": ({
        "data": (str, False),
        "labels": (str, False),
        "tolerance": ((float, list), False),
        "num_samples": ("posint", False),
        "batch_size": ("posint", False),
        "max_accuracy_drop": (float, False),
        "report": (bool, False),  # also write NAME.verify.html (qtool verify --report)
        "layers": ("layers", False),  # verify --layers: samples the tensors are compared on, or "all"
    }, False),
}
QUANTIZE_KEYS = frozenset(SCHEMA["quantize"][0])  # what a job's quantize step may set
# quantize keys that are not QuantizeOptions: steps measured on the calibration data
DATA_DRIVEN = ("bias_correction", "bias_samples", "holdout", "target_sqnr", "max_float_layers",
               "try_methods", "method_choice", "placement", "weight_rounding", "channel_scales", "allow_float",
               "params_metadata")
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false", float: "a number",
               list: "a list", dict: "a mapping"}


def _check(value, schema: dict, path: str, required: bool = True) -> None:
    if not isinstance(value, dict):
        raise QtoolError(f"{path or 'job'}: expected a mapping, got {type(value).__name__}")
    for key in value:
        if key not in schema:
            raise QtoolError(f"{path + '.' if path else ''}{key}: unknown key; "
                             f"allowed keys: {', '.join(schema)}")
    for key, (kind, needed) in schema.items():
        where = f"{path + '.' if path else ''}{key}"
        if key not in value:
            if needed and required:
                raise QtoolError(f"{where}: required key is missing")
            continue
        v = value[key]
        if isinstance(kind, dict):
            _check(v, kind, where, required)
        elif kind == "choice:calibrators":
            _choice(v, calibrators.names(), where)
        elif isinstance(kind, tuple) and kind[0] == "choice":
            _choice(v, kind[1], where)
        elif kind == "posint":
            _type(v, int, where)
            if v < 1:
                raise QtoolError(f"{where}: must be >= 1, got {v}")
        elif kind == "layers":
            if v != "all" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise QtoolError(f"{where}: expected a number of samples >= 1 or all, got {v!r}")
        elif kind == "count":
            _type(v, int, where)
            if v < 0:
                raise QtoolError(f"{where}: must be >= 0, got {v}")
        elif kind == "file name":  # a job's outputs are NAME.table.yaml, ... in output_dir
            _type(v, str, where)
            if not v or v.startswith(".") or "/" in v or "\\" in v:
                raise QtoolError(f"{where}: {v!r} cannot name the job's files: give a name with no '/' "
                                 f"that does not start with '.'")
        elif kind == "output folder":
            _type(v, str, where)
            if "{" in v.replace("{name}", "") or "}" in v.replace("{name}", ""):
                raise QtoolError(f"{where}: {v!r} has a placeholder other than {{name}} (the job's name), "
                                 f"the only one")
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


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (two ``calibrate:`` blocks:
    the first was dropped without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path):
    if path.is_dir():
        raise QtoolError(f"job file '{path}' is a directory")
    if not path.is_file():
        raise QtoolError(f"job file '{path}' not found")
    try:
        doc = yaml.load(path.read_text(), Loader=_UniqueKeys)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise QtoolError(f"job file '{path}' is not valid YAML{where}: "
                         f"{getattr(e, 'problem', None) or e}") from None
    except UnicodeDecodeError:
        raise QtoolError(f"job file '{path}' is not text") from None
    if doc is None:
        raise QtoolError(f"job file '{path}' is empty; expected a mapping with model, calibrate, ... "
                         f"(one job) or defaults and jobs (a batch)")
    return doc


def _merged(defaults: dict, job: dict) -> dict:
    """``job`` over ``defaults``: mappings merge key by key, anything else is replaced, and a key
    the job sets to null is unset (``verify: {labels: null}`` for a job whose data has no labels:
    it was "expected a string, got None")."""
    out = dict(defaults)
    for key, value in job.items():
        if value is None:
            out.pop(key, None)
            continue
        out[key] = _merged(out[key] if isinstance(out.get(key), dict) else {}, value) if isinstance(value, dict) \
            else value
    return out


def load_jobs(path: str | Path) -> list[tuple[str, dict]]:
    """The jobs of a file, each as (its YAML path, its settings), validated against the schema.

    A file is one job (model, calibrate, ...) or a batch: ``defaults`` (any job keys) and a list of
    ``jobs``, each merged over the defaults."""
    path = Path(path)
    doc = _read_yaml(path)
    try:
        if not (isinstance(doc, dict) and ("jobs" in doc or "defaults" in doc)):
            if isinstance(doc, dict):
                doc = _merged({}, doc)  # a null key is not given
            _check(doc, SCHEMA, "")
            return [("", doc)]
        for key in doc:
            if key not in ("defaults", "jobs"):
                raise QtoolError(f"{key}: unknown key; allowed keys in a batch: defaults, jobs")
        defaults = doc.get("defaults") or {}
        _check(defaults, SCHEMA, "defaults", required=False)
        jobs = doc.get("jobs")
        if not isinstance(jobs, list) or not jobs:
            raise QtoolError(f"jobs: expected a non-empty list of jobs, got {jobs!r}")

        def spec(i: int, job) -> tuple[str, dict]:
            where = f"jobs[{i}]"
            if not isinstance(job, dict):
                raise QtoolError(f"{where}: expected a mapping, got {type(job).__name__}")
            merged = _merged(defaults, job)
            _check(merged, SCHEMA, where)
            return where, merged

        return _each_job(list(enumerate(jobs)), lambda item: spec(*item))
    except QtoolError as e:
        raise QtoolError(f"job file '{path}': {e}") from None


def _each_job(items: list, check, what: str = "in their settings (the files of every job are checked "
                                                 "once these are right)"):
    """``check`` of every job's item; where jobs fail, one error that gives each failing job's
    first problem (a batch file with three broken jobs is fixed in one pass, not three); ``what``
    says which problems those are."""
    results, failed = [], []
    for item in items:
        try:
            results.append(check(item))
        except QtoolError as e:
            failed.append(str(e))
    if len(failed) == 1:
        raise QtoolError(failed[0])
    if failed:
        raise QtoolError(f"{len(failed)} of {len(items)} jobs have errors {what}: " + "; ".join(failed))
    return results


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

    name: str
    where: str  # its YAML path in the file ("" for a one-job file, else "jobs[i]")
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
    settings: dict  # the job as written (merged over the defaults), for the digest
    precision_table: Path | None = None

    @property
    def html(self) -> Path | None:
        """verify.report: the HTML page beside the JSON report."""
        return self.report.with_name(f"{self.name}.verify.html") if self.verify.get("report") else None

    def outputs(self) -> list[Path]:
        """What the job writes, in the order the files take their places: the report last."""
        return [self.table, self.qmodel] + ([self.html] if self.html else []) + [self.report]

    def absolute(self) -> "JobPlan":
        """The plan with every path absolute: for workers that do not share the client's folder."""
        paths = ("model", "calibrate_data", "verify_data", "table", "qmodel", "report", "precision_table")
        return replace(self, **{f: Path(os.path.abspath(getattr(self, f))) for f in paths
                                if getattr(self, f) is not None})

    def digest(self) -> str:
        """What the outputs depend on: qtool's version, the settings and the input files' bytes."""
        # by role, not by path: the same job run from another folder, or named by its absolute path,
        # is the same job (a path as given made every such run start again)
        files = {"model": self.model, "calibrate.data": self.calibrate_data, "verify.data": self.verify_data,
                 "precision_table": self.precision_table}
        inputs = {"qtool": __version__, "settings": self.settings,
                  "files": {role: _digest(p) for role, p in files.items() if p is not None}}
        return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def _digest(path: Path) -> str | dict:
    """A file's digest; for a folder of samples, each file's by name (the files a dataset reads)."""
    if not path.is_dir():
        return file_digest(path)
    return {p.name: file_digest(p) for p in sorted(path.iterdir()) if p.is_file() and not p.name.startswith(".")}


def resolve_path(base: Path, value: str) -> Path:
    """A path in a job file: relative to the file's folder, or ``pkg:PACKAGE/PATH`` for a file
    inside an installed Python package (the PP-OCR models inside the rapidocr wheel)."""
    if value.startswith("pkg:"):
        package, _, rest = value[4:].partition("/")
        spec = importlib.util.find_spec(package) if package.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise QtoolError(f"package '{package}' is not installed")
        return Path(spec.submodule_search_locations[0]) / rest
    return Path(os.path.normpath(base / value))


# the command-line options the quantize step's messages name, and the job keys that set them
_JOB_KEYS = {"input-pixels": "quantize.input_pixels", "mean": "calibrate.preprocess.mean",
             "std": "calibrate.preprocess.std", "scale": "calibrate.preprocess.scale",
             "channels": "calibrate.preprocess.channels", "layout": "calibrate.preprocess.layout",
             "resize": "calibrate.preprocess.resize", "fit": "calibrate.preprocess.fit",
             "pad": "calibrate.preprocess.pad", "image-input": "calibrate.preprocess.input"}
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")


def in_job_words(message: str) -> str:
    """``message`` with the options it names (``--block-size``, ``--input-pixels: --std``) as the
    job keys that set them (``quantize.block_size``, ``calibrate.preprocess.std``); an option a
    job has no key for stays as it is."""
    def key(match: re.Match) -> str:
        flag = match.group(1)
        if flag in _JOB_KEYS:
            return _JOB_KEYS[flag]
        field = flag.replace("-", "_")
        return f"quantize.{field}" if field in QUANTIZE_KEYS else match.group(0)
    return _FLAG.sub(key, message)


def plan_job(path: Path, where: str, job: dict) -> JobPlan:
    """Check one job before any work: files, labels, settings, output folder."""
    prefix = f"{where}." if where else ""

    def resolve(key: str, p: str) -> Path:
        try:
            return resolve_path(path.parent, p)
        except QtoolError as e:
            raise fail(key, str(e)) from None

    def fail(key: str, message: str) -> QtoolError:  # plan_jobs names the file, once
        return QtoolError(f"{prefix}{key}: {message}")

    cal, qz, ver = job["calibrate"], job.get("quantize", {}), job.get("verify", {})
    model = resolve("model", job["model"])
    name = job.get("name", model.stem)
    # "{name}" in output_dir is the job's name, so that defaults can place every job's outputs
    out = resolve("output_dir", job.get("output_dir", "build/{name}").replace("{name}", name))
    files = {"model": model, "calibrate.data": resolve("calibrate.data", cal["data"]),
             "verify.data": resolve("verify.data", ver.get("data", cal["data"]))}
    for key, file in files.items():
        if file.is_dir() and key != "model":  # a folder of samples (.npy/.npz or images)
            continue
        if file.is_dir():
            raise fail(key, f"'{file}' is a directory, not a file")
        if not file.is_file():
            raise fail(key, f"file '{file}' not found")
    try:
        tolerance = parse_tolerance(ver.get("tolerance", list(DEFAULT_TOLERANCE)))
    except QtoolError as e:
        raise fail("verify.tolerance", str(e)) from None
    if "labels" in ver and files["verify.data"].is_dir():
        raise fail("verify.labels", f"needs an .npz holding the labels; '{files['verify.data']}' is a folder")
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
                if not isinstance(pre[key], list):  # a number (the schema's other choice), as --mean 0.5
                    pre[key] = [pre[key]]
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
    for i, method in enumerate(qz.get("try_methods", [])):
        if not isinstance(method, str):
            raise fail(f"quantize.try_methods[{i}]", f"expected a method name, got {method!r}")
        _choice(method, calibrators.names(), f"{prefix}quantize.try_methods[{i}]")
    if qz.get("max_float_layers", 0) < 0:
        raise fail("quantize.max_float_layers", f"must be >= 0, got {qz['max_float_layers']}")
    pixels = None
    if qz.get("input_pixels"):
        if preprocess is None:
            raise fail("quantize.input_pixels", "needs calibrate.preprocess (the mean, std and scale "
                                                "that make the float input from the pixels)")
        given = cal["preprocess"].get("channels")  # (for messages: a channel order the job did not set is none)
        pixels = PixelInput(preprocess.mean, preprocess.std, preprocess.scale, given)
    precision_table, precisions = None, Precisions()
    if "precision_table" in qz:
        precision_table = resolve("quantize.precision_table", qz["precision_table"])
        try:
            precisions = read_precision_table(precision_table, prepare(load_model(model), str(model)), model)
        except QtoolError as e:
            raise fail("quantize.precision_table", str(e)) from None
    options = QuantizeOptions(**{k: v for k, v in qz.items()
                                 if k not in DATA_DRIVEN + ("input_pixels", "keep_float", "precision_table")},
                              **precisions.options(qz.get("keep_float", ())), input_pixels=pixels)
    try:  # the options' own rules (a block size of 1, int4 with QOperator): before any work
        options.check()
    except QtoolError as e:
        raise fail("quantize", in_job_words(str(e))) from None
    plan = JobPlan(name, where, model, files["calibrate.data"], files["verify.data"],
                   out / f"{name}.table.yaml", out / f"{name}.q.onnx", out / f"{name}.verify.json",
                   cal, preprocess, options, tolerance, ver, job, precision_table)
    for target in plan.outputs():
        try:
            check_writable(target)
            if target.exists() and not replaced(target).is_file():
                raise QtoolError(f"'{target}' exists and is not a regular file; a job replaces its outputs")
            # a job named after its own model, with its outputs beside it, replaced the model
            check_not_reading(target, model, files["calibrate.data"], files["verify.data"], precision_table,
                              reader="job")
        except QtoolError as e:
            raise fail("output_dir", str(e)) from None
    return plan


def plan_jobs(path: str | Path) -> list[JobPlan]:
    """Every job of the file, checked whole before any work. Outputs are named after the job, so
    two jobs may share an output_dir but not a name."""
    path = Path(path)
    jobs = load_jobs(path)
    try:  # the file named once, before every job's problem
        plans = _each_job(jobs, lambda spec: plan_job(path, *spec), "in their files")
    except QtoolError as e:
        raise QtoolError(f"job file '{path}': {e}") from None
    names = {}
    for plan in plans:
        if plan.name in names:
            raise QtoolError(f"job file '{path}': {plan.where}.name: '{plan.name}' is the name of "
                             f"{names[plan.name]} too; give each job its own name")
        names[plan.name] = plan.where
    return plans


def up_to_date(plan: JobPlan) -> dict | None:
    """The summary a finished run of this very job left (its report), if its outputs are intact."""
    try:
        summary = json.loads(plan.report.read_text())
        recorded = summary["job"]
        if summary["job_failures"] or recorded["digest"] != plan.digest():  # failures run again
            return None
        # the outputs sit beside the report (recorded by name; by the path as given before)
        if any(file_digest(plan.report.parent / Path(p).name) != d for p, d in recorded["outputs"].items()):
            return None
        return summary
    except (OSError, ValueError, KeyError, TypeError):
        return None


def staged(path: Path) -> Path:
    """Where a job builds the output ``path`` before it takes its place: a hidden file beside the
    file it replaces (a symlink's target: the link stays), so that the rename is atomic."""
    target = replaced(path)
    # the process's own, named by its host and pid: two runs of one job at once do not take each
    # other's staged files, on one machine or on the hosts of a cluster sharing the folder
    return target.with_name(f".{target.stem}.partial-{_HOST}-{os.getpid()}{target.suffix}")


# this machine's name as a staged file carries it (letters, digits, '.', '_'; never a '-')
_HOST = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "host"


def _left_by_the_dead(path: Path) -> list[Path]:
    """The staged files of ``path`` that a process no longer running on this machine left (killed:
    SIGKILL, or a cluster's worker stopped under its job), for the next run to remove. Another
    host's are left alone: whether its process still runs cannot be told from here."""
    target = replaced(path)
    found = []
    pattern = re.compile(rf"\.{re.escape(target.stem)}\.partial-(?:([^-]+)-)?(\d+){re.escape(target.suffix)}")
    for candidate in target.parent.glob(f".{glob.escape(target.stem)}.partial-*{glob.escape(target.suffix)}"):
        match = pattern.fullmatch(candidate.name)
        # (a name without a host: staged before hosts were named, here)
        if match is None or match.group(1) not in (None, _HOST) or int(match.group(2)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(2)), 0)
        except ProcessLookupError:
            found.append(candidate)
        except OSError:  # alive, another user's
            continue
    return found


def run_job(plan: JobPlan, progress: bool = True, log=print) -> JobResult:
    """Run a job. Its table, model and report are built aside (``staged``) and take their places
    together when the job completes, the report last (a later run trusts the report's digests of
    the others); when a stage fails or the run is interrupted, the staged files are removed and
    the previous outputs stay as they were, as do the folders (those made for it are removed).
    Staged files that a killed process left beside the outputs are removed first."""
    for final in plan.outputs():
        for left in _left_by_the_dead(final):
            left.unlink(missing_ok=True)
    folders = []  # the output folders that do not exist yet, deepest first
    folder = plan.table.parent
    while not folder.exists():
        folders.append(folder)
        folder = folder.parent
    written: list[Path] = []
    try:
        try:  # the folder first: its error names it, not the first staged file's hidden name
            plan.table.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise QtoolError(f"cannot make the output folder '{plan.table.parent}': {e.strerror or e}") from None
        result = _run(plan, progress, log, written)
        for final in plan.outputs():
            os.chmod(staged(final), mode_for(replaced(final)))  # a private table stays private
            os.replace(staged(final), replaced(final))
        return result
    except BaseException:
        for artifact in written:
            artifact.unlink(missing_ok=True)
        for folder in folders:
            try:
                folder.rmdir()
            except OSError:  # not empty: something else was put there meanwhile
                break
        raise


def _stop_if_stopped() -> None:
    """Between a job's stages: a Ctrl-C or SIGTERM that a stage swallowed (numba's compiler calls
    back into Python) still stops the job (a run --jobs worker stopped inside its calibrate went
    on to the next stage and ran it to its end: 1 stop in 20)."""
    if STOP:
        raise KeyboardInterrupt


def _run(plan: JobPlan, progress: bool, log, written: list[Path]) -> JobResult:
    """The job's stages, each output written to its ``staged`` path (listed in ``written``)."""
    table_path, qmodel_path, report_path = staged(plan.table), staged(plan.qmodel), staged(plan.report)
    cal, ver = plan.calibrate, plan.verify
    seconds = {}

    t0 = time.perf_counter()
    table = collect(plan.model, plan.calibrate_data, cal.get("method", "minmax"), cal.get("params"),
                    cal.get("num_samples"), cal.get("batch_size"), progress, plan.preprocess,
                    histogram_samples=cal.get("histogram_samples", DEFAULT_SAMPLES_PER_TENSOR)).table()
    written.append(table_path)
    write_table(table, table_path)
    seconds["calibrate"] = time.perf_counter() - t0
    log(f"calibrate: {table.samples} samples, {len(table.tensors)} tensors -> {plan.table} "
        f"({seconds['calibrate']:.1f} s)")
    _stop_if_stopped()

    t0 = time.perf_counter()
    qz = plan.settings.get("quantize", {})
    samples, batch = qz.get("bias_samples", BIAS_SAMPLES), min(cal["batch_size"], 8) if cal.get("batch_size") else None
    steps = DataSteps(tuple(qz.get("try_methods") or ()), qz.get("method_choice", "method" not in cal),
                      qz.get("placement"), qz.get("weight_rounding"), qz.get("bias_correction", True),
                      qz.get("target_sqnr"), qz.get("max_float_layers"), qz.get("allow_float", False),
                      samples, batch, qz.get("holdout"), plan.preprocess, cal.get("batch_size"),
                      qz.get("channel_scales"))
    try:
        qmodel, qreport, table, changed = quantize_with_data(plan.model, table, plan.options, str(plan.table),
                                                             plan.calibrate_data, steps, progress)
    except QtoolError as e:  # the command line's advice, in the job's words
        raise QtoolError(in_job_words(str(e).replace("add --batch-size 1", "set calibrate.batch_size: 1"))) from None
    if changed:
        write_table(table, table_path)  # the table the model is quantized from
    if not qz.get("params_metadata", True):
        drop_params(qmodel)
    written.append(qmodel_path)
    atomic_write(qmodel_path, qmodel.SerializeToString())
    seconds["quantize"] = time.perf_counter() - t0
    log(f"quantize: {sum(qreport.quantized.values())} ops integer, {len(qreport.kept_float)} float "
        f"-> {plan.qmodel} ({seconds['quantize']:.1f} s)")
    if qreport.method_choice is not None:
        log(f"methods: {methods_summary(qreport.method_choice, table.method.split('+')[0])}")
    if qreport.method_pick is not None:
        log(f"method: {pick_summary(qreport.method_pick)}")
    if qreport.channels is not None:
        log(f"scales: {channels_summary(qreport.channels)}")
    if qreport.placement is not None:
        log(f"int16: {placement_summary(qreport.placement)}")
    if qreport.rounding is not None:
        log(f"weights: {rounding_summary(qreport.rounding)}")
    if qreport.bias_correction is not None:
        log(f"bias: {bias_summary(qreport.bias_correction)}")
    if qreport.search is not None:
        log(f"search: {search_summary(qreport.search)}")
    _stop_if_stopped()

    t0 = time.perf_counter()
    report = verify(plan.model, qmodel_path, plan.verify_data, plan.tolerance, ver.get("labels"),
                    ver.get("num_samples"), ver.get("batch_size"), progress, plan.preprocess,
                    layers=None if ver.get("layers") == "all" else ver.get("layers", DEFAULT_LAYERS))
    seconds["verify"] = time.perf_counter() - t0
    failures = list(report.failures)
    drop = ver.get("max_accuracy_drop")
    if drop is not None:
        lost = report.accuracy["float"] - report.accuracy["integer"]
        if lost > drop:
            failures.append(f"accuracy drop {lost:.2f} points > max_accuracy_drop {drop}")
    # the job's digest and its outputs' digests let a later run skip it while nothing changed
    if plan.html is not None:
        from .html_report import render_html

        written.append(staged(plan.html))
        atomic_write(staged(plan.html), render_html(report, plan.model.name, plan.qmodel.name).encode())
    job = {"name": plan.name, "digest": plan.digest(),
           "outputs": {p.name: file_digest(staged(p)) for p in plan.outputs()[:-1]}}
    # no timings in the file: the same job gives the same bytes (they are in run's summary)
    summary = report.to_dict() | {"job_failures": failures, "job": job}
    written.append(report_path)
    atomic_write(report_path, (json.dumps(summary, indent=1) + "\n").encode())
    log(f"verify: {report.samples} samples -> {plan.report} ({seconds['verify']:.1f} s)")
    return JobResult(plan.table, plan.qmodel, plan.report, report, qreport, seconds, failures)


# -- batches -------------------------------------------------------------------------------------

@dataclass
class JobOutcome:
    """One row of the summary of ``qtool run``."""

    name: str
    status: str  # "ok", "failed" (verification), "error" (could not run), "skipped" (up to date)
    seconds: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)  # table, qmodel, report
    figures: dict = field(default_factory=dict)  # first output's cosine and SQNR, top-1 accuracy
    message: str = ""
    internal: bool = False  # an "error" that was a bug in qtool, not the job's (exit code 3)

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "seconds": self.seconds,
                "outputs": self.outputs, "figures": self.figures, "message": self.message,
                **({"internal": True} if self.internal else {})}


def _outcome(plan: JobPlan, summary: dict, status: str, seconds: dict | None = None) -> JobOutcome:
    first = (summary.get("outputs") or [{}])[0]
    figures = {"cosine": first.get("cosine"), "sqnr_db": first.get("sqnr_db")}
    accuracy = summary.get("accuracy")
    if accuracy:
        figures |= {"top1_float": accuracy["float"], "top1_integer": accuracy["integer"]}
    outputs = {"table": str(plan.table), "qmodel": str(plan.qmodel), "report": str(plan.report)}
    if plan.html is not None:
        outputs["html"] = str(plan.html)
    failures = summary.get("job_failures") or []
    return JobOutcome(plan.name, status, seconds or {}, outputs, figures, "; ".join(failures))


def execute(plan: JobPlan, progress: bool = False, log=None) -> JobOutcome:
    """Run one job of a batch; its errors become its outcome, so the other jobs go on."""
    try:
        result = run_job(plan, progress, log or (lambda message: None))
    except QtoolError as e:  # the job keys that set what the message names, not the flags
        return JobOutcome(plan.name, "error", message=in_job_words(str(e)))
    except Exception as e:  # a bug in one job must not stop the batch; the summary names it
        return JobOutcome(plan.name, "error", message=f"internal error: {type(e).__name__}: {first_line(e)}",
                          internal=True)
    summary = json.loads(plan.report.read_text())
    return _outcome(plan, summary, "failed" if result.failures else "ok", result.seconds)


def run_batch(plans: list[JobPlan], workers: int = 1, force: bool = False, progress: bool = True,
              log=print, on_done=None, pool=None) -> list[JobOutcome]:
    """Run the jobs that are not up to date (all with ``force``), in order or in ``workers``
    separate processes, or on ``pool`` (a concurrent.futures executor: qtool/cluster.py's); the
    outcomes come back in the file's order."""
    outcomes: list[JobOutcome | None] = [None] * len(plans)
    pending = []
    for i, plan in enumerate(plans):
        summary = None if force else up_to_date(plan)
        if summary is not None:
            outcomes[i] = _outcome(plan, summary, "skipped")
            outcomes[i].message = "up to date"
            if on_done:
                on_done(outcomes[i])
        else:
            pending.append(i)
    if pool is None and (workers <= 1 or len(pending) <= 1):
        for i in pending:
            log(f"job '{plans[i].name}' ({i + 1}/{len(plans)})")
            outcomes[i] = execute(plans[i], progress, log)
            if on_done:
                on_done(outcomes[i])
        return outcomes
    import concurrent.futures
    import contextlib
    import multiprocessing

    # spawn, not fork: onnxruntime's thread pools do not survive a fork
    context = multiprocessing.get_context("spawn")
    own = pool is None
    with (contextlib.nullcontext(pool) if pool is not None else
          concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context,
                                                 initializer=_worker_start, initargs=(os.getpid(),))) as pool:
        futures = {pool.submit(execute if not own else _worker_execute, plans[i]): i for i in pending}
        try:
            for future in concurrent.futures.as_completed(futures):
                i = futures[future]
                outcomes[i] = future.result()
                if on_done:
                    on_done(outcomes[i])
        except BaseException:  # Ctrl-C or SIGTERM on this process alone: its workers stop too
            if own:
                _interrupt_workers(pool)
            raise
    return outcomes


_WORKER = {"stopping": False, "running": False}


def _worker_start(parent: int) -> None:
    """A run's worker process: Ctrl-C (from the terminal, or passed on by an interrupted ``run``)
    stops the job it runs, which removes its staged files as it unwinds, and every job after it;
    the worker itself lives on until the pool shuts down. Killed at once, or killed by the pool
    once another worker died of it, a worker left its staged files behind (the next run removes
    them). A worker whose ``run`` died without a word (SIGKILL, the OOM killer) stops its job the
    same way and exits: the workers had finished their jobs, replaced the outputs after ``run``
    was gone, and waited for work for ever."""
    import signal
    import threading

    def stop(signum, frame):
        STOP.append(signum)
        first = not _WORKER["stopping"]
        _WORKER["stopping"] = True
        if first and _WORKER["running"]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, stop)  # a closed terminal: as Ctrl-C, ``run`` says what it was
    # ``parent``: the pid of ``run``, given by it (a worker still starting when run died has
    # another parent already)

    def watch() -> None:
        # the signals go to the main thread, where the job runs: one delivered to this thread left
        # the job asleep until its sleep ended (run waited on it for a minute, 1 run in 10)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGHUP, signal.SIGTERM})
        while os.getppid() == parent:
            time.sleep(0.5)
        if _WORKER["running"]:
            os.kill(os.getpid(), signal.SIGINT)  # ``stop``: the job unwinds, removing its staged files
            deadline = time.monotonic() + ORPHAN_GRACE
            while _WORKER["running"] and time.monotonic() < deadline:
                time.sleep(0.1)
        os._exit(1)

    threading.Thread(target=watch, name="qtool-parent-watch", daemon=True).start()


ORPHAN_GRACE = 30  # seconds an orphaned worker's job has to unwind before the worker exits


def _worker_execute(plan: JobPlan) -> JobOutcome:
    """``execute`` in a worker (``_worker_start``): an interrupted job, or one that comes after
    the interrupt, is an outcome, not the worker's death. ``stopping`` is read once ``running``
    is set: a Ctrl-C between the two (a job taken just as the run was interrupted) had set
    ``stopping`` without stopping anything, and the job ran to its end."""
    try:
        _WORKER["running"] = True
        if _WORKER["stopping"]:
            return JobOutcome(plan.name, "error", message="interrupted")
        return execute(plan)
    except KeyboardInterrupt:
        return JobOutcome(plan.name, "error", message="interrupted")
    finally:
        _WORKER["running"] = False


def _interrupt_workers(pool) -> None:
    """Ctrl-C to each worker of ``pool`` (a job there removes its staged files as it unwinds) and no
    new job: a SIGTERM sent to ``qtool run`` alone left its workers running for minutes, holding
    its output streams open."""
    import signal

    for future in getattr(pool, "_pending_work_items", {}).values():
        future.future.cancel()
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            os.kill(process.pid, signal.SIGINT)
        except (OSError, AttributeError):
            pass


def describe_plan(plan: JobPlan, skip: bool) -> list[str]:
    """``--dry-run``: what a job would read, do and write."""
    cal = plan.calibrate
    return [f"job '{plan.name}'{' (' + plan.where + ')' if plan.where else ''}: "
            f"{'up to date, would be skipped' if skip else 'would run'}",
            f"  model      {plan.model}",
            f"  calibrate  {plan.calibrate_data}: {cal.get('method', 'minmax')}"
            f"{', ' + str(cal['num_samples']) + ' samples' if 'num_samples' in cal else ''}",
            f"  quantize   {_quantize_text(plan)}",
            f"  verify     {plan.verify_data}: tolerance {plan.tolerance[0]}"
            f"{', ' + str(plan.tolerance[1]) + ' dB' if plan.tolerance[1] is not None else ''}"
            f"{', labels ' + plan.verify['labels'] if 'labels' in plan.verify else ''}",
            f"  outputs    {', '.join(map(str, plan.outputs()))}"]


def plan_dict(plan: JobPlan, skip: bool) -> dict:
    """``--dry-run --json``: ``describe_plan`` as data."""
    cal = plan.calibrate
    return {"name": plan.name, "where": plan.where, "status": "skipped" if skip else "run",
            "model": str(plan.model),
            "calibrate": {"data": str(plan.calibrate_data), "method": cal.get("method", "minmax"),
                          "num_samples": cal.get("num_samples")},
            "quantize": _quantize_text(plan),
            "verify": {"data": str(plan.verify_data), "tolerance": list(plan.tolerance),
                       "labels": plan.verify.get("labels")},
            "outputs": [str(p) for p in plan.outputs()]}


def _quantize_text(plan: JobPlan) -> str:
    """What the quantize stage will do, in words."""
    opt = plan.options
    quantize = (f"{opt.format}, {'per-channel' if opt.per_channel else 'per-tensor'}, "
                f"{'symmetric' if opt.symmetric else 'asymmetric'} {opt.activation_type}, "
                f"{opt.multiplier_bits}-bit multipliers, {opt.rounding}, target {opt.target}")
    if opt.weight_type != "int8" or opt.block_size:
        which = "Conv/MatMul/Gemm" if opt.weight_type == "int16" else "MatMul/Gemm"
        quantize += f", {which} weights {opt.weight_type}" + (f" in blocks of {opt.block_size}"
                                                            if opt.block_size else "")
    if opt.keep_float:
        quantize += f", keep float: {', '.join(opt.keep_float)}"
    if opt.int16:
        quantize += f", int16: {', '.join(opt.int16)}"
    if opt.input_pixels is not None:
        quantize += ", uint8 pixel input (the preprocessing folded into the first Conv layers)"
    qz = plan.settings.get("quantize", {})
    if qz.get("bias_correction", True):
        quantize += (f", bias correction on {qz.get('bias_samples', BIAS_SAMPLES)} samples, judged on "
                     f"{qz.get('holdout', qz.get('bias_samples', BIAS_SAMPLES))} others")
    if qz.get("try_methods"):
        quantize += f", per-tensor choice of {', '.join(qz['try_methods'])}"
    elif qz.get("method_choice", "method" not in plan.settings.get("calibrate", {})):
        quantize += ", calibration method chosen of minmax/percentile/mse on held-out samples"
    if qz.get("placement", True) and "target_sqnr" not in qz and "max_float_layers" not in qz \
            and placement_applies(opt):
        quantize += ", int16 for the transformer groups that score higher on held-out samples (if any)"
    if qz.get("channel_scales", True) and "target_sqnr" not in qz and "max_float_layers" not in qz \
            and not channels_not_applicable(opt):
        quantize += ", scales per channel where the kernels take them and that scores higher held out"
    if qz.get("weight_rounding", True) and "target_sqnr" not in qz and "max_float_layers" not in qz:
        quantize += ", MatMul/Gemm weights rounded to fit their inputs where that scores higher held out"
    if "target_sqnr" in qz:
        quantize += (f", {'float' if qz.get('allow_float') else 'int16'} ops searched for "
                     f"{qz['target_sqnr']:g} dB")
    if "max_float_layers" in qz:
        quantize += f", at most {qz['max_float_layers']} ops {'float' if qz.get('allow_float') else 'int16'}"
    return quantize


def format_summary(outcomes: list[JobOutcome]) -> str:
    def num(value, spec: str, unit: str = "") -> str:
        return format(value, spec) + unit if isinstance(value, (int, float)) else "-"

    lines = [f"{'job':<22} {'status':<8} {'calibrate':>9} {'quantize':>8} {'verify':>7} "
             f"{'cosine':>9} {'SQNR dB':>8} {'top-1 float/int':>16}  outputs"]
    for o in outcomes:
        s, f = o.seconds, o.figures
        top1 = (f"{num(f.get('top1_float'), '.2f')}/{num(f.get('top1_integer'), '.2f')}"
                if "top1_float" in f else "-")
        where = str(Path(o.outputs["report"]).parent) if o.outputs else "-"
        lines.append(f"{o.name:<22} {o.status:<8} {num(s.get('calibrate'), '.1f', ' s'):>9} "
                     f"{num(s.get('quantize'), '.1f', ' s'):>8} {num(s.get('verify'), '.1f', ' s'):>7} "
                     f"{num(f.get('cosine'), '.6f'):>9} {num(f.get('sqnr_db'), '.2f'):>8} {top1:>16}  {where}")
        if o.message and o.status != "skipped":
            lines.append(f"{'':<22} {o.message}")
    counts = {status: sum(o.status == status for o in outcomes) for status in ("ok", "failed", "error", "skipped")}
    lines.append(", ".join(f"{n} {status}" for status, n in counts.items() if n) or "no jobs")
    return "\n".join(lines)
