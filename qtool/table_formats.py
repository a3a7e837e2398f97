"""Calibration tables in other tools' formats, and the choice of format by name and content.

* ``cali_table``: TPU-MLIR's text table, ``#`` comment lines then ``name threshold min max`` rows.
  qtool writes its header facts as ``# key: value`` comments, so a table it wrote reads back whole.
* ``trt``: TensorRT's calibration cache, ``TRT-<version>-<algorithm>`` then ``name: <hex>`` rows,
  the hex being the big-endian bits of the float32 scale ``threshold / 127``.
* ``ort``: onnxruntime's ``calibration.json`` (``write_calibration_table``, ``save_tensors_data``),
  read only. The ``calibration.cache`` written beside it is refused: its ``name value`` lines keep
  only ``max(highest, lowest)``, each range's maximum, without the minimum.

``read_table`` and ``write_table`` read and write a table in any of these or qtool's own YAML/JSON
(qtool/table.py), chosen by the file's name and content.

A foreign table knows nothing of the model it was made for: its ``model_sha256`` is empty, and
``quantize`` warns that it cannot match it to the model. Errors in a text table name the line.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from pathlib import Path

from .errors import QtoolError
from .fileio import atomic_write, check_writable
from .table import Table, TensorEntry, int16_ranges_of, parse_table, unbounded_of

READ_FORMATS = ("yaml", "json", "cali_table", "trt", "ort")
WRITE_FORMATS = ("yaml", "json", "cali_table", "trt")
FORMAT_NAMES = {"yaml": "qtool YAML", "json": "qtool JSON", "cali_table": "TPU-MLIR cali_table",
                "trt": "TensorRT calibration cache", "ort": "onnxruntime calibration.json"}

# The version field of the TensorRT header we write: TensorRT 8.6.1's. A fixed number keeps the
# output deterministic; a TensorRT of another version may decline the cache and recalibrate.
TRT_VERSION = 8601
TRT_QMAX = 127  # TensorRT's int8 scale is amax / 127
_TRT_HEADER = re.compile(r"TRT-(\d+)-(\w+)")
_TRT_METHODS = {"EntropyCalibration2": "kl", "EntropyCalibration": "kl",
                "MinMaxCalibration": "minmax"}
_HEX = re.compile(r"[0-9A-Fa-f]{1,8}")
# TPU-MLIR appends other sections after the int8 rows (``#int4_th`` thresholds, ``#asym_op``
# names); a bare ``#word`` line starts one, and the rest of the file is not int8 ranges.
_CALI_SECTION = re.compile(r"#[A-Za-z]\w*")
_CALI_FACT = re.compile(r"#\s*([^:]+?)\s*:\s*(.*?)\s*")
# onnxruntime's CalibrationMethod names; its Entropy is the same KL-divergence threshold search
_ORT_METHODS = {"MinMax": "minmax", "Entropy": "kl", "Percentile": "percentile",
                "Distribution": "distribution"}


# -- choosing a format --------------------------------------------------------------------------

def _choice(fmt: str, allowed: tuple[str, ...], what: str) -> str:
    if fmt in READ_FORMATS and fmt not in allowed:
        raise QtoolError(f"cannot write table format '{fmt}' ({FORMAT_NAMES[fmt]} is read only); "
                         f"choose one of {', '.join(allowed)}")
    if fmt not in allowed:
        raise QtoolError(f"unknown {what} table format '{fmt}'; choose one of {', '.join(allowed)}")
    return fmt


def output_format(path: str | Path, fmt: str | None = None) -> str:
    """``fmt`` if given, else from the name: .json, .cache (TensorRT's name), *cali_table
    (TPU-MLIR's), anything else YAML."""
    if fmt is not None:
        return _choice(fmt, WRITE_FORMATS, "output")
    name = str(path).lower()
    if name.endswith(".json"):
        return "json"
    if name.endswith(".cache"):
        return "trt"
    if name.endswith("cali_table"):
        return "cali_table"
    return "yaml"


def detect_format(path: Path, text: str) -> str:
    """The format of a table file, from its content first (a TensorRT header, a JSON object with
    or without ``qtool_table``), then its name, then the shape of its lines."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if _TRT_HEADER.fullmatch(first):
        return "trt"
    suffix = path.suffix.lower()
    if first.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            return "json"  # its reader reports the syntax error
        return "json" if isinstance(data, dict) and "qtool_table" in data else "ort"
    if suffix == ".json":
        return "json"  # YAML in a .json file, as qtool has always read
    if suffix in (".yaml", ".yml") or any(line.startswith("qtool_table:") for line in lines):
        return "yaml"
    if first.startswith("#") or len(first.split()) == 4:
        return "cali_table"
    return "yaml"


# -- reading ------------------------------------------------------------------------------------

STDIO = "-"  # a table path that means standard input or output: calibrate -o - | quantize -t -


def load_table(path: str | Path, fmt: str | None = None) -> tuple[Table, str]:
    """The table in ``path`` (``-``: standard input) and its format (``fmt``, or detected)."""
    if fmt is not None:
        _choice(fmt, READ_FORMATS, "input")
    if str(path) == STDIO:
        return _parse(Path("<stdin>"), sys.stdin.read(), fmt)
    path = Path(path)
    if path.is_dir():
        raise QtoolError(f"table file '{path}' is a directory")
    if not path.exists():  # a pipe is read as it is (quantize -t <(qtool calibrate ... -o -))
        raise QtoolError(f"table file '{path}' not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise QtoolError(f"table file '{path}' is not a text file (byte {e.start} is not UTF-8)") from None
    except OSError as e:
        raise QtoolError(f"cannot read table file '{path}': {e.strerror or e}") from None
    return _parse(path, text, fmt)


def _parse(path: Path, text: str, fmt: str | None) -> tuple[Table, str]:
    if not text.strip():
        raise QtoolError(f"table file '{path}' is empty")
    fmt = fmt or detect_format(path, text)
    if fmt == "yaml" and _is_ort_cache(text):
        raise QtoolError(f"table file '{path}' is onnxruntime's calibration.cache, which keeps only each "
                         f"tensor's maximum (no minimum); pass the calibration.json written beside it")
    if fmt == "json" and text.lstrip().startswith("{"):
        _json(path, text)  # JSON's own error, with the line; YAML would accept some broken JSON
    parse = {"yaml": parse_table, "json": parse_table, "cali_table": parse_cali_table,
             "trt": parse_trt_cache, "ort": parse_ort_json}[fmt]
    table = parse(path, text)
    if not table.tensors and not table.unbounded:
        raise QtoolError(f"table file '{path}' ({FORMAT_NAMES[fmt]}) holds no tensor")
    return table, fmt


def _is_ort_cache(text: str) -> bool:
    """Whether ``text`` is onnxruntime's ``calibration.cache``: ``name value`` lines, nothing else
    (not YAML's ``key: value``)."""
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or fields[0].endswith(":") or fields[0] == "-":  # ('- 1': a YAML list)
            return False
        try:
            float(fields[1])
        except ValueError:
            return False
    return True


def _entry(where: str, lo: float, hi: float, threshold: float, method: str) -> TensorEntry:
    if not all(math.isfinite(v) for v in (lo, hi, threshold)):
        raise QtoolError(f"{where}: non-finite range (threshold {threshold}, min {lo}, max {hi})")
    if threshold < 0:
        raise QtoolError(f"{where}: negative threshold {threshold}")
    if lo > hi:
        raise QtoolError(f"{where}: min {lo} is above max {hi}")
    return TensorEntry(lo, hi, threshold, method)


def _number(where: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise QtoolError(f"{where}: '{text}' is not a number") from None


def _add(tensors: dict, lines: dict, where: str, name: str, entry: TensorEntry, line: int) -> None:
    if name in tensors:
        raise QtoolError(f"{where}: tensor '{name}' is already on line {lines[name]}")
    tensors[name], lines[name] = entry, line


def parse_cali_table(path: Path, text: str) -> Table:
    facts, rows = {}, []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            if _CALI_SECTION.fullmatch(line):
                break
            fact = _CALI_FACT.fullmatch(line)
            if fact:
                facts.setdefault(fact.group(1).lower(), (fact.group(2), number))
            continue
        rows.append((number, line.split()))
    method = facts.get("quantization threshold calculation method", ("unknown", 0))[0]
    tensors, lines = {}, {}
    for number, fields in rows:
        where = f"table file '{path}', line {number}"
        if len(fields) != 4:
            raise QtoolError(f"{where}: expected 4 columns (name threshold min max), got {len(fields)}")
        threshold, lo, hi = (_number(where, v) for v in fields[1:])
        _add(tensors, lines, where, fields[0], _entry(where, lo, hi, threshold, method), number)
    model = facts.get("model") or facts.get("mlir") or ("", 0)
    header = {"model": model[0], "model_sha256": facts.get("model sha256", ("", 0))[0],
              "method": method, "qtool_version": facts.get("qtool version", ("", 0))[0]}
    samples, number = facts.get("sample number", ("0", 0))
    try:
        header["samples"] = int(samples)
    except ValueError:
        raise QtoolError(f"table file '{path}', line {number}: sample number '{samples}' is not "
                         f"an integer") from None
    for key, fact in (("params", "qtool params"), ("input_shapes", "qtool input shapes"),
                      ("preprocess", "qtool preprocess"), ("int16_ranges", "qtool int16 ranges"),
                      ("unbounded", "qtool unbounded")):
        if fact in facts:
            value, number = facts[fact]
            try:
                header[key] = json.loads(value)
            except ValueError:
                header[key] = None
            kind = list if key == "unbounded" else dict
            if not isinstance(header[key], kind):
                raise QtoolError(f"table file '{path}', line {number}: '{fact}' is not a JSON "
                                 f"{'list' if kind is list else 'object'}")
    header["int16_ranges"] = int16_ranges_of(path, header.get("int16_ranges"))
    header["unbounded"] = unbounded_of(path, header.get("unbounded"))
    return Table(**header, tensors=tensors)


def parse_trt_cache(path: Path, text: str) -> Table:
    lines = list(enumerate(text.splitlines(), 1))
    while lines and not lines[0][1].strip():
        lines.pop(0)
    header = _TRT_HEADER.fullmatch(lines[0][1].strip()) if lines else None
    if header is None:
        raise QtoolError(f"table file '{path}', line {lines[0][0] if lines else 1}: expected a "
                         f"TensorRT cache header like 'TRT-{TRT_VERSION}-EntropyCalibration2'")
    method = _TRT_METHODS.get(header.group(2), header.group(2))
    tensors, seen = {}, {}
    for number, raw in lines[1:]:
        if not raw.strip():
            continue
        where = f"table file '{path}', line {number}"
        name, colon, code = raw.strip().rpartition(":")  # layer names may hold spaces and colons
        name, code = name.strip(), code.strip()
        if not colon or not name:
            raise QtoolError(f"{where}: expected 'TENSOR_NAME: HEX', got '{raw.strip()}'")
        if not _HEX.fullmatch(code):
            raise QtoolError(f"{where}: '{code}' is not a float32 scale in 8 hex digits")
        scale = struct.unpack(">f", bytes.fromhex(code.rjust(8, "0")))[0]
        if math.copysign(1.0, scale) < 0:  # the sign bit: -0.0 is refused as well
            raise QtoolError(f"{where}: negative scale {scale} ({code})")
        threshold = scale * TRT_QMAX  # exact: a float32 times 127 fits a float64 mantissa
        # the cache holds one scale per tensor, no asymmetric range: min/max are -/+threshold
        _add(tensors, seen, where, name, _entry(where, -threshold, threshold, threshold, method),
             number)
    return Table("", "", method, 0, "", tensors)


def _json(path: Path, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise QtoolError(f"table file '{path}', line {e.lineno}: not valid JSON ({e.msg})") from None


def parse_ort_json(path: Path, text: str) -> Table:
    data = _json(path, text)
    if not isinstance(data, dict):
        raise QtoolError(f"table file '{path}': expected a JSON object of tensor ranges")
    method = "unknown"
    if data.get("CLS") == "TensorsData":  # TensorsData.to_dict(): the ranges are under "data"
        method = _ort_method(data.get("calibration_method"))
        data = data.get("data")
        if not isinstance(data, dict):
            raise QtoolError(f"table file '{path}': 'data' must map tensor names to ranges")
    tensors = {}
    for name, value in data.items():
        where = f"table file '{path}': tensor '{name}'"
        lo, hi = _ort_range(where, value)
        tensors[name] = _entry(where, lo, hi, max(abs(lo), abs(hi)), method)
    return Table("", "", method, 0, "", tensors)


def _ort_method(value) -> str:
    """{"CLS": "CalibrationMethod", "value": "CalibrationMethod.MinMax"} or a bare name."""
    if isinstance(value, dict):
        value = value.get("value")
    name = str(value).rpartition(".")[2] if value is not None else ""
    return _ORT_METHODS.get(name, name or "unknown")


def _ort_range(where: str, value) -> tuple[float, float]:
    """A TensorData dict {"lowest": ..., "highest": ...} or a [min, max] pair (older writers
    serialized tuples, with a histogram after the pair for the histogram methods)."""
    if isinstance(value, dict) and "lowest" in value and "highest" in value:
        return _ort_scalar(where, value["lowest"]), _ort_scalar(where, value["highest"])
    if isinstance(value, list) and len(value) >= 2:
        return _ort_scalar(where, value[0]), _ort_scalar(where, value[1])
    raise QtoolError(f"{where} is not an onnxruntime range ({{\"lowest\": .., \"highest\": ..}} "
                     f"or [min, max]), and the file has no 'qtool_table' key")


def _ort_scalar(where: str, value) -> float:
    """A number, or a numpy array as CalibrationCacheEncoder writes it:
    {"data": [x], "dtype": "float32", "CLS": "numpy.array"}."""
    if isinstance(value, dict) and value.get("CLS") == "numpy.array":
        value = value.get("data")
    while isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, list):
        raise QtoolError(f"{where}: {len(value)} values where one was expected (per-channel "
                         f"ranges are not supported)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise QtoolError(f"{where}: {json.dumps(value)} is not a number")
    return float(value)


# -- writing ------------------------------------------------------------------------------------

def dumps_table(table: Table, fmt: str) -> str:
    _choice(fmt, WRITE_FORMATS, "output")
    if fmt in ("yaml", "json"):
        return table.dumps(fmt)
    return dumps_cali_table(table) if fmt == "cali_table" else dumps_trt_cache(table)


def _cali_number(value: float) -> str:
    """The shortest text that reads back as the same float64, without '+': TPU-MLIR matches
    numbers with [-0-9.e]+."""
    return repr(float(value)).replace("e+", "e")


def dumps_cali_table(table: Table) -> str:
    """No generation time (TPU-MLIR writes one) so that the same table gives the same bytes, and
    no blank lines: TPU-MLIR's first importer refused any line that is neither a row nor '#...'."""
    facts = {"qtool version": table.qtool_version, "model": table.model,
             "model sha256": table.model_sha256,
             "quantization threshold calculation method": table.method,  # TPU-MLIR's wording
             "sample number": table.samples, "qtool params": json.dumps(table.params),
             "qtool input shapes": json.dumps(table.input_shapes)}
    # what only qtool reads, where the table has it (the others' bytes are as before)
    if table.preprocess:
        facts["qtool preprocess"] = json.dumps(table.preprocess, sort_keys=True)
    if table.unbounded:
        facts["qtool unbounded"] = json.dumps(list(table.unbounded))
    if table.int16_ranges:
        facts["qtool int16 ranges"] = json.dumps({name: [float(lo), float(hi)]
                                                  for name, (lo, hi) in table.int16_ranges.items()})
    lines = ["# qtool calibration table in TPU-MLIR cali_table format"]
    lines += [f"# {key}: {value}" for key, value in facts.items() if value != ""]  # "" = unknown
    lines += ["###", "# op_name    threshold    min    max"]
    for name, e in table.tensors.items():
        if not name or len(name.split()) != 1 or name.startswith("#"):
            raise QtoolError(f"tensor name '{name}' cannot be written to a cali_table (it holds "
                             f"whitespace, is empty or starts with '#')")
        lines.append(f"{name} {_cali_number(e.threshold)} {_cali_number(e.min)} {_cali_number(e.max)}")
    return "\n".join(lines) + "\n"


def trt_hex(threshold: float) -> str:
    """The cache's text for ``threshold``: the float32 scale threshold/127, as 8 hex digits of its
    big-endian bits (127.0 -> scale 1.0 -> '3f800000')."""
    try:
        return struct.pack(">f", threshold / TRT_QMAX).hex()
    except OverflowError:
        raise QtoolError(f"threshold {threshold} does not fit a float32 scale") from None


def dropped(table: Table, fmt: str) -> str:
    """What writing ``table`` as ``fmt`` leaves out, for a warning ('' where nothing): a TensorRT
    cache holds one scale a tensor and nothing else."""
    if fmt != "trt":
        return ""
    lost = [what for what, held in (("the tensors without a range (unbounded)", table.unbounded),
                                    ("the int16 ranges", table.int16_ranges),
                                    ("the image preprocessing", table.preprocess)) if held]
    if not lost:
        return ""
    return (f"a TensorRT cache cannot hold {', '.join(lost)}: they are left out (a YAML, JSON or "
            f"cali_table keeps them)")


def dumps_trt_cache(table: Table) -> str:
    algorithm = "EntropyCalibration2" if table.method == "kl" else "MinMaxCalibration"
    lines = [f"TRT-{TRT_VERSION}-{algorithm}"]
    for name, e in table.tensors.items():
        if not name or "\n" in name or "\r" in name:
            raise QtoolError(f"tensor name {name!r} cannot be written to a TensorRT cache")
        lines.append(f"{name}: {trt_hex(e.threshold)}")
    return "\n".join(lines) + "\n"


def convert_table(source: str | Path, target: str | Path, to: str | None = None,
                  source_format: str | None = None) -> tuple[Table, str, str]:
    """Read ``source`` and write it to ``target`` as ``to`` (or as its name suggests); returns the
    table and the two formats."""
    fmt = output_format(target, to)
    check_table_target(target)
    table, origin = load_table(source, source_format)
    write_text(target, dumps_table(table, fmt))
    return table, origin, fmt


def check_table_target(path: str | Path) -> None:
    """``check_writable``, where ``-`` (standard output) is always writable."""
    if str(path) != STDIO:
        check_writable(path)


def write_text(path: str | Path, text: str) -> None:
    """To standard output for ``-``, else atomically to the file."""
    if str(path) == STDIO:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        atomic_write(path, text.encode())


def write_table(table: Table, path: str | Path, fmt: str | None = None) -> None:
    """Write ``table`` as ``fmt`` (see ``table_formats.WRITE_FORMATS``), or as the name of
    ``path`` suggests (.json, .cache, *cali_table; else YAML); ``-`` is standard output."""
    write_text(path, dumps_table(table, output_format(path, fmt)))


def read_table(path: str | Path, fmt: str | None = None) -> Table:
    """Read a table in any of ``table_formats.READ_FORMATS``, detected from the file's name and
    content unless ``fmt`` says."""
    return load_table(path, fmt)[0]
