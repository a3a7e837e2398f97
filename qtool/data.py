"""Datasets: an ``.npz`` keyed by model input name, samples along the first axis."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from .errors import QtoolError
from .model import graph_inputs, input_shape

_NP_TYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64,
             onnx.TensorProto.FLOAT16: np.float16}


@dataclass
class Dataset:
    path: Path
    arrays: dict[str, np.ndarray]  # model input name -> [samples, ...]
    extra: dict[str, np.ndarray]  # other arrays in the file (labels, ...)

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def batches(self, batch_size: int, limit: int | None = None):
        """Feeds of at most ``batch_size`` samples, in file order."""
        total = len(self) if limit is None else min(limit, len(self))
        for start in range(0, total, batch_size):
            stop = min(start + batch_size, total)
            yield {name: a[start:stop] for name, a in self.arrays.items()}


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    """All arrays of an ``.npz`` (or one ``.npy``), refusing pickled objects."""
    path = Path(path)
    if not path.is_file():
        raise QtoolError(f"data file '{path}' not found")
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.ndarray):
            return {path.stem: loaded}
        with loaded:
            return {key: loaded[key] for key in loaded.files}
    except ValueError as e:
        # numpy says "pickled data" for any file that is neither a zip nor .npy, so look: a pickle
        # starts with its protocol opcode 0x80; object arrays inside an .npz say "Object arrays"
        if str(e).startswith("Object arrays") or _starts_with(path, b"\x80"):
            raise QtoolError(f"data file '{path}' holds pickled objects; refusing to load it") from None
        raise QtoolError(f"data file '{path}' is not a valid .npz/.npy file") from None
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise QtoolError(f"data file '{path}' is not a valid .npz/.npy file ({e})") from None


def _starts_with(path: Path, prefix: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(prefix)) == prefix


def check_sampling(num_samples: int | None, batch_size: int) -> None:
    """Reject counts that would compare nothing or loop forever, before any work starts."""
    if batch_size < 1:
        raise QtoolError(f"batch size must be >= 1, got {batch_size}")
    if num_samples is not None and num_samples < 1:
        raise QtoolError(f"number of samples must be >= 1, got {num_samples}")


def load_dataset(path: str | Path, model: onnx.ModelProto) -> Dataset:
    """Match the file's arrays to the model's inputs by name and check them.

    A file with a single array feeds a single-input model whatever the array's name.
    """
    path = Path(path)
    arrays = read_npz(path)
    inputs = graph_inputs(model)
    names = [vi.name for vi in inputs]
    if not arrays:
        raise QtoolError(f"data file '{path}' holds no arrays")
    if all(n in arrays for n in names):
        chosen = {n: arrays[n] for n in names}
    elif len(names) == 1 and len(arrays) == 1:
        chosen = {names[0]: next(iter(arrays.values()))}
    else:
        missing = [n for n in names if n not in arrays]
        raise QtoolError(f"data file '{path}' has no array for model input '{missing[0]}' "
                         f"(model inputs: {', '.join(names)}; arrays: {', '.join(arrays)})")
    used = {id(a) for a in chosen.values()}
    extra = {k: a for k, a in arrays.items() if id(a) not in used}
    counts = set()
    for vi in inputs:
        chosen[vi.name] = _check_array(path, vi, chosen[vi.name])
        counts.add(len(chosen[vi.name]))
    if len(counts) > 1:
        raise QtoolError(f"data file '{path}': inputs have different sample counts {sorted(counts)}")
    return Dataset(path, chosen, extra)


def _check_array(path: Path, vi: onnx.ValueInfoProto, a: np.ndarray) -> np.ndarray:
    name = vi.name
    elem = vi.type.tensor_type.elem_type
    if a.dtype.kind not in "biuf":
        raise QtoolError(f"data file '{path}' array for input '{name}' has dtype {a.dtype}; "
                         "expected numbers")
    if a.ndim == 0 or len(a) == 0:
        raise QtoolError(f"data file '{path}' array for input '{name}' is empty")
    expected = input_shape(vi)
    if expected and a.ndim != len(expected):
        raise QtoolError(f"data file '{path}' array for input '{name}' has shape {list(a.shape)}; "
                         f"model expects {_shape_text(expected)} (samples on the first axis)")
    for axis, (got, want) in enumerate(zip(a.shape[1:], expected[1:]), start=1):
        if isinstance(want, int) and want > 0 and got != want:
            raise QtoolError(f"data file '{path}' array for input '{name}' has shape {list(a.shape)}; "
                             f"model expects {_shape_text(expected)} (axis {axis} differs)")
    if elem in _NP_TYPES:
        a = a.astype(_NP_TYPES[elem], copy=False)
        bad = ~np.isfinite(a)
        if bad.any():
            sample = int(np.argwhere(bad)[0][0])
            raise QtoolError(f"data file '{path}' array for input '{name}' has NaN or Inf "
                             f"(first in sample {sample})")
    return a


def _shape_text(shape) -> str:
    return "[" + ",".join("N" if i == 0 else str(d if d else "?") for i, d in enumerate(shape)) + "]"
