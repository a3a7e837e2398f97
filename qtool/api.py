"""The Python API: ``qtool.calibrate``, ``qtool.quantize``, ``qtool.verify`` (docs/api.md).

The commands' library functions take file paths (they hash, shard and stream them). These take
what a Python user has: a model as a path or an ``onnx.ModelProto``, and data as a path (an
``.npz``, a folder of samples or of images), a dict of arrays keyed by input name (samples on the
first axis), or an iterable of feed dicts (one sample, or a batch on the first axis, each). Arrays
and feed dicts are written to a temporary folder first, one sample per file, so that an iterable
of any length is read in bounded memory, as a file would be.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import numbers
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import onnx

from .errors import QtoolError

__all__ = ["calibrate", "execute", "quantize", "verify"]


def calibrate(model, data, method: str = "minmax", params: dict | None = None, num_samples: int | None = None,
              batch_size: int | None = None, preprocess=None, progress: bool = False):
    """Run the float ``model`` over ``data`` and return its calibration ``Table`` (``method``:
    minmax, kl, percentile, mse, aciq_gauss, aciq_laplace, or a plugin's; ``params`` its
    parameters). ``preprocess``: a ``qtool.data.Preprocess`` for a folder of images."""
    from .calibrate import collect

    if params is not None and not isinstance(params, Mapping):
        raise QtoolError(f"params must be a dict of parameter names and values, not {type(params).__name__}")
    with _paths(model, data) as (model_path, data_path):
        return collect(model_path, data_path, method, params, num_samples, batch_size, progress,
                       preprocess).table()


def quantize(model, table, data=None, progress: bool = False, steps=None, **options):
    """Quantize ``model`` with ``table`` (a ``Table`` or a table file's path): returns the quantized
    ``onnx.ModelProto`` and its report. ``options`` are ``qtool.quantize.QuantizeOptions``'s fields
    (``activation_type="int16"``, ``per_channel``, ``format="qoperator"``, ``target``...). With
    ``data``, the judged steps of ``quantize --data`` run (``steps``: a ``qtool.recipe.DataSteps``
    to choose them; by default all that apply)."""
    from .quantize import QuantizeOptions, quantize as run
    from .recipe import DataSteps, check_runs_on_ranges, quantize_with_data
    from .table_formats import read_table

    from .table import Table

    opts = _options(QuantizeOptions, options)
    if steps is not None and not isinstance(steps, DataSteps):
        raise QtoolError(f"steps must be a qtool.recipe.DataSteps, not {type(steps).__name__}")
    if not isinstance(table, (str, Path, Table)):
        raise QtoolError(f"table must be a path or a qtool.table.Table, not {type(table).__name__}")
    name = str(table) if isinstance(table, (str, Path)) else "table"
    if isinstance(table, (str, Path)):
        table = read_table(table)
    with _paths(model, data) as (model_path, data_path):
        if data_path is None:
            qmodel, report = run(model_path, table, opts, name)
            check_runs_on_ranges(qmodel, model_path, table)
            return qmodel, report
        qmodel, report, _, _ = quantize_with_data(model_path, table, opts, name, data_path, steps or DataSteps(),
                                                  progress)
        return qmodel, report


def verify(model, qmodel, data, tolerance: tuple[float, float | None] = (0.99, 20.0), progress: bool = False,
           **kwargs):
    """Compare the float ``model`` with the quantized ``qmodel`` (a path or a ModelProto) on
    ``data``, output by output and tensor by tensor: a ``VerifyReport`` (``.passed``,
    ``.outputs``, ``.tensors``, ``.to_dict()``; ``qtool.verify.format_report`` prints it).
    ``kwargs``: ``qtool.verify.verify``'s (``labels``, ``num_samples``, ``run_ort``...)."""
    from .verify import parse_tolerance, verify as run

    _check_keywords(run, kwargs, "verify")
    # (cosine, SQNR dB or None), a cosine alone, or the command line's "COS,SQNR"
    if isinstance(tolerance, (list, tuple)) and len(tolerance) == 2 and tolerance[1] is None:
        tolerance = tolerance[:1]
    if not isinstance(tolerance, (str, int, float, list, tuple)) or isinstance(tolerance, bool):
        raise QtoolError(f"tolerance must be (cosine, SQNR dB or None), got {tolerance!r}")
    tolerance = parse_tolerance(list(tolerance) if isinstance(tolerance, (list, tuple)) else str(tolerance))
    labels = kwargs.get("labels")
    if labels is not None and not isinstance(data, (str, Path)):
        # the labels array is read from the data's own file: one .npz, not a folder of samples
        if not isinstance(data, Mapping) or labels not in data:
            raise QtoolError(f"labels '{labels}': give data as an .npz path or as one dict of arrays that "
                             f"holds '{labels}' beside the inputs")
        with tempfile.TemporaryDirectory(prefix="qtool-api-") as folder, \
                _model_path(model, "model") as model_path, _model_path(qmodel, "qmodel") as qmodel_path:
            data_path = Path(folder) / "data.npz"
            np.savez(data_path, **{k: np.asarray(v) for k, v in data.items()})
            return run(model_path, qmodel_path, data_path, tolerance, progress=progress, **kwargs)
    with _paths(model, data) as (model_path, data_path), _model_path(qmodel, "qmodel") as qmodel_path:
        return run(model_path, qmodel_path, data_path, tolerance, progress=progress, **kwargs)


def execute(qmodel, data, output, progress: bool = False, **kwargs):
    """Run the quantized ``qmodel`` on the integer-only executor over ``data`` and write its
    outputs to the ``.npz`` at ``output`` as they come: an ``ExecResult`` (``.outputs``: the shapes
    written, ``.float_nodes``...). ``kwargs``: ``qtool.execute.execute``'s (``batch_size``,
    ``target``, ``images``)."""
    from .execute import execute as run

    _check_keywords(run, kwargs, "execute")
    with _model_path(qmodel, "qmodel") as qmodel_path, _data_path(data) as data_path:
        return run(qmodel_path, data_path, output, progress=progress, **kwargs)


def _options(kind, options: dict):
    """``kind`` (a dataclass of options) from keyword arguments, checked as the command line's
    parsing checks them: a known name, a flag given as a bool, a list of names as a list (one
    name given as a string is that name, not its letters)."""
    fields = {f.name: f for f in dataclasses.fields(kind)}
    for key, value in options.items():
        if key not in fields:
            raise QtoolError(f"unknown option '{key}'; the options are {', '.join(fields)}")
        default = fields[key].default
        if isinstance(default, bool) and not isinstance(value, bool):
            raise QtoolError(f"option {key} is true or false, not {value!r}")
        if isinstance(default, int) and not isinstance(default, bool):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise QtoolError(f"option {key} is a whole number, not {value!r}")
            options[key] = int(value)
        if isinstance(default, str) and not isinstance(value, str):
            raise QtoolError(f"option {key} is a name, not {value!r}")
        if isinstance(default, tuple):
            names = () if value is None else (value,) if isinstance(value, str) else value
            names = tuple(names) if isinstance(names, Iterable) else None  # (a generator: read once)
            if names is None or not all(isinstance(n, str) for n in names):
                raise QtoolError(f"option {key} is a list of names, not {value!r}")
            options[key] = names
    return kind(**options)


def _check_keywords(function, kwargs: dict, name: str) -> None:
    """Keyword arguments ``function`` takes, or a one-line QtoolError naming the first it does not."""
    known = inspect.signature(function).parameters
    for key in kwargs:
        if key not in known:
            raise QtoolError(f"{name}: unknown keyword argument '{key}'")


# what the data's temporary folder is called in the commands' messages, in the API's words
_SAMPLE_FILES = re.compile(r"(?:batch of )?files? '(\d{9})\.npz'(?: to '(\d{9})\.npz')?")


def _in_api_words(message: str, folder: str) -> str:
    """A message about the temporary folder the data went to, about the data as given: samples
    by number, not files the caller never made, and the API's argument for the CLI's flag."""
    message = message.replace(f"data folder '{folder}'", "data").replace(f"'{folder}/", "'")
    message = message.replace(f"'{folder}'", "data")
    message = _SAMPLE_FILES.sub(lambda m: f"samples {int(m.group(1))} to {int(m.group(2))}" if m.group(2)
                                else f"sample {int(m.group(1))}", message)
    return message.replace("--batch-size 1", "batch_size=1")


@contextlib.contextmanager
def _paths(model, data):
    with _model_path(model, "model") as model_path, _data_path(data) as data_path:
        yield model_path, data_path


@contextlib.contextmanager
def _model_path(model, name: str):
    if isinstance(model, (str, Path)):
        yield Path(model)
        return
    if not isinstance(model, onnx.ModelProto):
        raise QtoolError(f"{name} must be a path or an onnx.ModelProto, not {type(model).__name__}")
    with tempfile.TemporaryDirectory(prefix="qtool-api-") as folder:
        path = Path(folder) / f"{name}.onnx"
        onnx.save(model, str(path))
        yield path


@contextlib.contextmanager
def _data_path(data):
    if data is None or isinstance(data, (str, Path)):
        yield None if data is None else Path(data)
        return
    if isinstance(data, Mapping):
        if not data:
            raise QtoolError("data: the dict holds no arrays (give one array per model input, keyed by its name)")
        data = [dict(data)]  # one feed dict holding every sample
    elif not isinstance(data, Iterable):
        raise QtoolError(f"data must be a path, a dict of arrays or an iterable of feed dicts, "
                         f"not {type(data).__name__}")
    with tempfile.TemporaryDirectory(prefix="qtool-api-") as folder:
        count = 0
        for feeds in data:
            if not isinstance(feeds, Mapping) or not feeds:
                raise QtoolError(f"data: item {count} is not a dict of arrays keyed by input name")
            arrays = {k: np.asarray(v) for k, v in feeds.items()}
            sizes = {a.shape[0] if a.ndim else None for a in arrays.values()}
            if len(sizes) != 1 or None in sizes:
                raise QtoolError(f"data: the arrays of item {count} need the same first (sample) axis, "
                                 f"got shapes {[list(a.shape) for a in arrays.values()]}")
            for i in range(sizes.pop()):
                np.savez(Path(folder) / f"{count:09d}.npz", **{k: a[i:i + 1] for k, a in arrays.items()})
                count += 1
        if not count:
            raise QtoolError("data holds no samples")
        try:
            yield Path(folder)
        except QtoolError as e:
            e.args = (_in_api_words(str(e), folder), *e.args[1:])
            raise
