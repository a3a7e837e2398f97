"""``qtool calibrate`` and ``qtool merge``: stream per-tensor statistics over a dataset.

One onnxruntime session on the prepared float model returns every float tensor; each batch's
tensors update one calibrator per tensor and are dropped, so memory holds about one batch of
activations. The statistics can be saved (``--stats-out``) and merged across shards.
"""

from __future__ import annotations

import inspect
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

import calibrators

from . import __version__, stats_graph
from .data import Dataset, check_sampling, load_dataset
from .errors import QtoolError
from .fileio import atomic_write
from .model import FloatRunner, file_digest, float_tensors, graph_inputs, input_shape, load_model, prepare
from .report import progress_bar
from .table import Table, TensorEntry

STATS_VERSION = 1


def fixed_batch(model) -> int | None:
    """The batch size a model with a fixed first input dim demands, or None when it is free."""
    dims = [input_shape(vi)[0] for vi in graph_inputs(model) if input_shape(vi)]
    fixed = {d for d in dims if isinstance(d, int) and d > 0}
    return fixed.pop() if len(fixed) == 1 else None


def make_calibrator(method: str, params: dict | None = None):
    """A calibrator of ``method`` with ``params``; string values (from the command line) are
    converted to the type of the parameter's default."""
    try:
        cls = calibrators.get(method)
    except KeyError as e:
        raise QtoolError(e.args[0]) from None
    signature = inspect.signature(cls.__init__)
    allowed = {n: p.default for n, p in signature.parameters.items() if n != "self"}
    kwargs = {}
    for name, value in (params or {}).items():
        if name not in allowed:
            listed = ", ".join(allowed) or "none"
            raise QtoolError(f"unknown parameter '{name}' for method '{method}'; parameters: {listed}")
        default = allowed[name]
        if isinstance(value, str) and default is not None and not isinstance(default, str):
            try:
                value = type(default)(value)
            except ValueError:
                raise QtoolError(f"parameter '{name}' of method '{method}' must be "
                                 f"{type(default).__name__}, got '{value}'") from None
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise QtoolError(f"method '{method}': {e}") from None


def parse_params(items: list[str]) -> dict[str, str]:
    """``["percentile=99.9", ...]`` -> ``{"percentile": "99.9"}``."""
    params = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise QtoolError(f"--param takes NAME=VALUE, got '{item}'")
        params[name.strip()] = value.strip()
    return params


@dataclass
class Statistics:
    """Per-tensor calibrator state plus what it was computed on."""

    model: str
    model_sha256: str
    method: str
    params: dict
    samples: int
    input_shapes: dict[str, list]
    calibrators: dict = field(default_factory=dict)  # tensor name -> calibrator

    def table(self) -> Table:
        tensors = {}
        for name, calibrator in self.calibrators.items():
            r = calibrator.result()
            if not (math.isfinite(r.min) and math.isfinite(r.max) and math.isfinite(r.threshold)):
                raise QtoolError(f"tensor '{name}' has NaN or Inf values on the calibration data")
            tensors[name] = TensorEntry(float(r.min), float(r.max), float(r.threshold), self.method)
        return Table(self.model, self.model_sha256, self.method, self.samples, __version__, tensors,
                     params=dict(sorted(self.params.items())), input_shapes=self.input_shapes)

    def header(self) -> dict:
        return {"qtool_stats": STATS_VERSION, "model": self.model, "model_sha256": self.model_sha256,
                "method": self.method, "params": self.params, "samples": self.samples,
                "input_shapes": self.input_shapes, "qtool_version": __version__,
                "tensors": list(self.calibrators)}

    def save(self, path: str | Path) -> None:
        if any(not hasattr(c, "state") for c in self.calibrators.values()):
            raise QtoolError(f"method '{self.method}' cannot save its statistics (its calibrator "
                             "has no state()); calibrate without --stats-out")
        arrays = {"header": np.array(json.dumps(self.header()))}
        for i, calibrator in enumerate(self.calibrators.values()):
            for key, value in calibrator.state().items():
                arrays[f"{i}.{key}"] = np.asarray(value)
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **arrays)
        atomic_write(path, buffer.getvalue())

    @classmethod
    def load(cls, path: str | Path) -> "Statistics":
        from .data import read_npz

        arrays = read_npz(path)
        try:
            header = json.loads(str(arrays["header"]))
            version = header["qtool_stats"]
        except (KeyError, ValueError, TypeError):
            version = None
        if version != STATS_VERSION:
            raise QtoolError(f"'{path}' is not a qtool statistics file (from calibrate --stats-out)")
        stats = cls(header["model"], header["model_sha256"], header["method"], header["params"],
                    header["samples"], header["input_shapes"])
        for i, name in enumerate(header["tensors"]):
            calibrator = make_calibrator(stats.method, stats.params)
            calibrator.load_state({k.split(".", 1)[1]: v for k, v in arrays.items()
                                   if k.startswith(f"{i}.")})
            stats.calibrators[name] = calibrator
        return stats

    def merge(self, other: "Statistics", other_name: str = "shard") -> None:
        for key in ("model_sha256", "method", "params"):
            if getattr(self, key) != getattr(other, key):
                raise QtoolError(f"cannot merge {other_name}: its {key} {getattr(other, key)!r} "
                                 f"differs from {getattr(self, key)!r}")
        if set(self.calibrators) != set(other.calibrators):
            raise QtoolError(f"cannot merge {other_name}: it holds other tensors")
        for name, calibrator in self.calibrators.items():
            calibrator.merge(other.calibrators[name])
        self.samples += other.samples


def _fix_dims(model: onnx.ModelProto, data: Dataset) -> tuple[onnx.ModelProto, dict[str, list]]:
    """A copy of ``model`` with every input dim but the batch fixed to the data's, shapes inferred.

    Only used to learn tensor types and shapes; the graph that runs keeps its dynamic dims.
    """
    fixed = onnx.ModelProto.FromString(model.SerializeToString())
    shapes = {}
    for vi in graph_inputs(fixed):
        sample_shape = data.sample_shape(vi.name)
        dims = vi.type.tensor_type.shape.dim
        for dim, size in zip(list(dims)[1:], sample_shape):
            dim.Clear()
            dim.dim_value = size
        shapes[vi.name] = ["N", *sample_shape]
    try:
        fixed = onnx.shape_inference.infer_shapes(fixed)
    except Exception:  # shape inference is a help here, not a requirement
        pass
    return fixed, shapes


def collect(model_path: str | Path, data_path: str | Path, method: str = "minmax",
            params: dict | None = None, num_samples: int | None = None, batch_size: int = 32,
            progress: bool = True, preprocess=None, log=None,
            histogram_samples: int = stats_graph.DEFAULT_SAMPLES_PER_TENSOR) -> Statistics:
    make_calibrator(method, params)  # validate before any work
    check_sampling(num_samples, batch_size)
    model = prepare(load_model(model_path), f"model file '{model_path}'")
    data = load_dataset(data_path, model, preprocess)
    typed, shapes = _fix_dims(model, data)
    if log is not None:
        for vi in graph_inputs(model):
            declared = ["N" if i == 0 else (d if d else "?") for i, d in enumerate(input_shape(vi))]
            if declared != shapes[vi.name]:
                log(f"input '{vi.name}': dims {declared} fixed to {shapes[vi.name]} from the data")
    batch_size = fixed_batch(model) or batch_size
    names = float_tensors(typed)
    stats = Statistics(Path(model_path).name, file_digest(model_path), method, dict(params or {}),
                       0, shapes, {name: make_calibrator(method, params) for name in names})
    update = _updater(model, typed, names, stats.calibrators, histogram_samples)
    total = len(data) if num_samples is None else min(num_samples, len(data))
    with progress_bar(total, "calibrate", progress) as bar:
        for feeds in data.batches(batch_size, total):
            update(feeds)
            n = len(next(iter(feeds.values())))
            stats.samples += n
            bar.update(n)
    return stats


def _updater(model, typed, names: list[str], calibrators_by_name: dict, histogram_samples: int):
    """A function feeding one batch to every calibrator: through statistics reduced inside
    onnxruntime when the method declares them, else through the full tensors."""
    prototype = next(iter(calibrators_by_name.values()), None)
    reductions = getattr(prototype, "reductions", None)
    if not reductions or not hasattr(prototype, "update_reduced"):
        runner = FloatRunner(model, names)

        def update_full(feeds):
            outputs = runner.run(feeds)
            for name, calibrator in calibrators_by_name.items():
                calibrator.update(outputs[name])

        return update_full
    infos = [*typed.graph.value_info, *typed.graph.input, *typed.graph.output]
    types = {vi.name: vi.type.tensor_type.elem_type for vi in infos}
    shapes = {vi.name: input_shape(vi) for vi in infos}
    cap = histogram_samples if histogram_samples > 0 else np.iinfo(np.int64).max
    stats_model, layout = stats_graph.build(model, names, types, shapes, set(reductions), cap)
    runner = FloatRunner(stats_model)

    names_in_order = list(calibrators_by_name)
    many = getattr(type(prototype), "update_reduced_many", None)

    def update_reduced(feeds):
        batch = stats_graph.unpack(runner.run(feeds), layout)
        if many is not None:  # one vectorised update for every tensor (histogram binning)
            many([calibrators_by_name[n] for n in names_in_order], [batch[n] for n in names_in_order])
            return
        for name, calibrator in calibrators_by_name.items():
            calibrator.update_reduced(batch[name])

    return update_reduced


def calibrate(model_path: str | Path, data_path: str | Path, method: str = "minmax",
              num_samples: int | None = None, batch_size: int = 32, progress: bool = True,
              params: dict | None = None, preprocess=None) -> Table:
    return collect(model_path, data_path, method, params, num_samples, batch_size, progress,
                   preprocess).table()


def merge(paths: list[str | Path]) -> Table:
    if not paths:
        raise QtoolError("merge needs at least one statistics file")
    stats = Statistics.load(paths[0])
    for path in paths[1:]:
        stats.merge(Statistics.load(path), f"'{path}'")
    return stats.table()
