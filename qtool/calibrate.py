"""``qtool calibrate``: run the float model over a dataset and stream per-tensor statistics."""

from __future__ import annotations

import math
from pathlib import Path

import calibrators

from . import __version__
from .data import check_sampling, load_dataset
from .errors import QtoolError
from .model import FloatRunner, file_digest, float_tensors, graph_inputs, input_shape, load_model, prepare
from .report import progress_bar
from .table import Table, TensorEntry


def fixed_batch(model) -> int | None:
    """The batch size a model with a fixed first input dim demands, or None when it is free."""
    dims = [input_shape(vi)[0] for vi in graph_inputs(model) if input_shape(vi)]
    fixed = {d for d in dims if isinstance(d, int) and d > 0}
    return fixed.pop() if len(fixed) == 1 else None


def calibrate(model_path: str | Path, data_path: str | Path, method: str = "minmax",
              num_samples: int | None = None, batch_size: int = 32, progress: bool = True) -> Table:
    try:
        calibrator_cls = calibrators.get(method)
    except KeyError as e:
        raise QtoolError(e.args[0]) from None
    check_sampling(num_samples, batch_size)
    model = prepare(load_model(model_path), f"model file '{model_path}'")
    data = load_dataset(data_path, model)
    batch_size = fixed_batch(model) or batch_size
    names = float_tensors(model)
    runner = FloatRunner(model, names)
    stats = {name: calibrator_cls() for name in names}
    total = len(data) if num_samples is None else min(num_samples, len(data))
    with progress_bar(total, "calibrate", progress) as bar:
        for feeds in data.batches(batch_size, total):
            outputs = runner.run(feeds)
            for name in names:
                stats[name].update(outputs[name])
            bar.update(len(next(iter(feeds.values()))))
    tensors = {}
    for name in names:
        r = stats[name].result()
        if not (math.isfinite(r.min) and math.isfinite(r.max)):
            raise QtoolError(f"tensor '{name}' has NaN or Inf values on the calibration data "
                             f"'{data_path}'")
        tensors[name] = TensorEntry(float(r.min), float(r.max), float(r.threshold), method)
    return Table(model=Path(model_path).name, model_sha256=file_digest(model_path), method=method,
                 samples=total, qtool_version=__version__, tensors=tensors)
