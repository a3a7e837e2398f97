"""The calibration table: a header and one entry per tensor, as YAML or JSON.

The writer is deterministic (graph order, fixed float repr) so two runs give identical bytes.
Other tools' formats (TPU-MLIR cali_table, TensorRT cache, onnxruntime calibration.json) are in
``table_formats``, with ``read_table`` and ``write_table``, which handle every format (this
module imports nothing of qtool's but its errors).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from .errors import QtoolError

# libyaml's parser and emitter where PyYAML has them (its wheels do), 5-7x faster on a large table
# than the pure-Python ones, whose bytes the emitter writes as long as every string is printable
# (tests/test_table_formats.py); a key with a control character is written as a "? " key by one
# and not the other, so such a table goes to the pure-Python emitter.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorEntry:
    min: float
    max: float
    threshold: float
    method: str


@dataclass
class Table:
    model: str
    model_sha256: str
    method: str
    samples: int
    qtool_version: str
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    params: dict = field(default_factory=dict)  # the method's parameters
    input_shapes: dict = field(default_factory=dict)  # input name -> ["N", dims...] seen in the data
    preprocess: dict = field(default_factory=dict)  # how images became tensors (qtool.data.Preprocess)
    # tensor -> (min, max) an int16 activation takes instead of its entry's: the table as
    # calibrated, where quantize --data's method choice clipped the 8-bit ranges (a clip made for
    # 256 steps is far too deep for 65536); written after the tensors where there are any, so
    # that a table --table-out wrote quantizes its int16 ops as quantize --data did
    int16_ranges: dict = field(default_factory=dict)
    # tensors that held inf or NaN on the calibration data (the model's computing: a constant -inf
    # padding, a log of 0), or no element at all (a size of 0): no range, and the ops that read or
    # write them stay float
    unbounded: list = field(default_factory=list)

    def to_dict(self) -> dict:
        header = {k: v for k, v in asdict(self).items()
                  if k not in ("tensors", "int16_ranges", "unbounded") and (k != "preprocess" or v)}
        ranges = {"int16_ranges": {name: [float(lo), float(hi)] for name, (lo, hi) in self.int16_ranges.items()}} \
            if self.int16_ranges else {}
        unbounded = {"unbounded": list(self.unbounded)} if self.unbounded else {}
        return {"qtool_table": FORMAT_VERSION, **header,
                "tensors": {name: asdict(e) for name, e in self.tensors.items()}, **ranges, **unbounded}

    def dumps(self, fmt: str = "yaml") -> str:
        if fmt == "json":
            return json.dumps(self.to_dict(), indent=1) + "\n"
        doc = self.to_dict()
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper) if _printable(doc) else yaml.SafeDumper
        return yaml.dump(doc, Dumper=dumper, sort_keys=False, width=120)


def _printable(value) -> bool:
    """Every string in ``value`` (keys too, in dicts and lists) is printable."""
    if isinstance(value, str):
        return value.isprintable()
    if isinstance(value, dict):
        return all(_printable(k) and _printable(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_printable(v) for v in value)
    return True


def parse_table(path: Path, text: str) -> Table:
    """qtool's own table, YAML or JSON, from the text of ``path``."""
    try:
        data = yaml.load(text, Loader=SAFE_LOADER)  # JSON is YAML too
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        where = f"line {mark.line + 1}: {problem}" if mark and problem else str(e).splitlines()[0]
        raise QtoolError(f"table file '{path}' is not valid YAML/JSON ({where})") from None
    if not isinstance(data, dict) or data.get("qtool_table") != FORMAT_VERSION:
        raise QtoolError(f"table file '{path}' is not a qtool calibration table "
                         f"(missing key 'qtool_table: {FORMAT_VERSION}')")
    entries = data.get("tensors") or {}
    if not isinstance(entries, dict):
        raise QtoolError(f"table file '{path}': 'tensors' must be a mapping of tensor name to entry")
    tensors = {str(name): _entry(path, str(name), e) for name, e in entries.items()}
    header = {}
    for key, kind in (("model", str), ("model_sha256", str), ("method", str), ("samples", int),
                      ("qtool_version", str)):
        if key not in data:
            raise QtoolError(f"table file '{path}': missing header key '{key}'")
        try:
            header[key] = kind(data[key])
        except (TypeError, ValueError):
            raise QtoolError(f"table file '{path}': header key '{key}' is not {kind.__name__}") from None
    extra = {key: data[key] for key in ("params", "input_shapes", "preprocess") if isinstance(data.get(key), dict)}
    return Table(**header, tensors=tensors, int16_ranges=int16_ranges_of(path, data.get("int16_ranges")),
                 unbounded=unbounded_of(path, data.get("unbounded")), **extra)


def unbounded_of(path: Path, names) -> list:
    """The optional ``unbounded`` list (tensor names) of a table file."""
    unbounded = names or []
    if not isinstance(unbounded, list) or not all(isinstance(name, str) for name in unbounded):
        raise QtoolError(f"table file '{path}': 'unbounded' must be a list of tensor names")
    return unbounded


def int16_ranges_of(path: Path, ranges) -> dict:
    """The optional ``int16_ranges`` mapping (tensor -> [min, max]) of a table file."""
    if ranges is None:
        return {}
    if not isinstance(ranges, dict):
        raise QtoolError(f"table file '{path}': 'int16_ranges' must be a mapping of tensor name to [min, max]")
    out = {}
    for name, pair in ranges.items():
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 \
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair):
            raise QtoolError(f"table file '{path}': int16_ranges of tensor '{name}' must be two numbers "
                             f"[min, max]")
        lo, hi = float(pair[0]), float(pair[1])
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
            raise QtoolError(f"table file '{path}': int16_ranges of tensor '{name}' is not a finite range "
                             f"(min {lo}, max {hi})")
        out[str(name)] = (lo, hi)
    return out


def _entry(path: Path, name: str, e) -> TensorEntry:
    try:
        entry = TensorEntry(float(e["min"]), float(e["max"]), float(e["threshold"]), str(e["method"]))
    except (KeyError, TypeError, ValueError):
        missing = [k for k in ("min", "max", "threshold", "method") if isinstance(e, dict) and k not in e]
        wrong = [k for k in ("min", "max", "threshold") if isinstance(e, dict) and k not in missing
                 and not _is_number(e[k])]
        what = ("is not an entry" if not isinstance(e, dict) else f"has no {', '.join(missing)}" if missing
                else f"{', '.join(wrong)} is not a number" if wrong else "is not an entry")
        raise QtoolError(f"table file '{path}': tensor '{name}' {what} (it needs numbers min, max, threshold "
                         f"and a method)") from None
    if not all(math.isfinite(v) for v in (entry.min, entry.max, entry.threshold)):
        raise QtoolError(f"table file '{path}': tensor '{name}' has a non-finite range")
    if entry.min > entry.max or entry.threshold < 0:
        raise QtoolError(f"table file '{path}': tensor '{name}' has an invalid range "
                         f"(min {entry.min}, max {entry.max}, threshold {entry.threshold})")
    return entry


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bool)
