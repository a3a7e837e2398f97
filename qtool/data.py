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


class Dataset:
    """Samples keyed by model input name, read in a fixed order, one batch at a time."""

    path: Path
    extra: dict[str, np.ndarray]  # other arrays of an .npz (labels, ...)
    keys: list[str] = []  # every array name in the file, for messages

    def __len__(self) -> int:
        raise NotImplementedError

    def sample_shape(self, name: str) -> list[int]:
        raise NotImplementedError

    def batch(self, start: int, stop: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def batches(self, batch_size: int, limit: int | None = None):
        """Feeds of at most ``batch_size`` samples, in order."""
        total = len(self) if limit is None else min(limit, len(self))
        for start in range(0, total, batch_size):
            yield self.batch(start, min(start + batch_size, total))


class ArrayDataset(Dataset):
    """An .npz (or .npy) held in memory."""

    def __init__(self, path: Path, arrays: dict[str, np.ndarray], extra: dict[str, np.ndarray],
                 keys: list[str]):
        self.path, self.arrays, self.extra, self.keys = path, arrays, extra, keys

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def sample_shape(self, name: str) -> list[int]:
        return list(self.arrays[name].shape[1:])

    def batch(self, start: int, stop: int) -> dict[str, np.ndarray]:
        return {name: a[start:stop] for name, a in self.arrays.items()}


class FileDataset(Dataset):
    """A folder of files, one sample each, read when their batch comes (sorted by name)."""

    def __init__(self, path: Path, files: list[Path], read, model: onnx.ModelProto):
        self.path, self.files, self.read, self.extra = path, files, read, {}
        self.inputs = {vi.name: vi for vi in graph_inputs(model)}
        self._first = self.read(files[0])
        missing = [name for name in self.inputs if name not in self._first]
        if missing:
            raise QtoolError(f"data folder '{path}' gives no data for model input '{missing[0]}' "
                             f"(model inputs: {', '.join(self.inputs)}); images feed one input")

    def __len__(self) -> int:
        return len(self.files)

    def sample_shape(self, name: str) -> list[int]:
        return list(self._first[name].shape)

    def batch(self, start: int, stop: int) -> dict[str, np.ndarray]:
        samples = [self.read(f) for f in self.files[start:stop]]
        feeds = {}
        for name, vi in self.inputs.items():
            shapes = {s[name].shape for s in samples}
            if len(shapes) > 1:
                raise QtoolError(f"data folder '{self.path}': samples for input '{name}' have "
                                 f"different shapes {sorted(shapes)}; use --batch-size 1")
            feeds[name] = _check_array(self.files[start], vi, np.stack([s[name] for s in samples]))
        return feeds


@dataclass(frozen=True)
class Preprocess:
    """Image to tensor: ``(pixel * scale - mean) / std`` per channel after resizing."""

    resize: tuple[int, int] | None = None  # (height, width); default: the model input's fixed dims
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    scale: float = 1 / 255
    channels: str = "rgb"  # rgb, bgr or gray
    layout: str = "nchw"  # nchw or nhwc
    input: str | None = None  # the model input the images feed; default: the only one

    def check(self) -> None:
        if self.channels not in CHANNEL_ORDERS:
            raise QtoolError(f"unknown channel order '{self.channels}'; choose one of "
                             f"{', '.join(CHANNEL_ORDERS)}")
        if self.layout not in LAYOUTS:
            raise QtoolError(f"unknown layout '{self.layout}'; choose one of {', '.join(LAYOUTS)}")
        channels = 1 if self.channels == "gray" else 3
        for key in ("mean", "std"):
            if len(getattr(self, key)) not in (1, channels):
                raise QtoolError(f"preprocess {key} needs 1 or {channels} values, "
                                 f"got {list(getattr(self, key))}")
        if any(v == 0 for v in self.std):
            raise QtoolError("preprocess std must not be 0")


CHANNEL_ORDERS = ("rgb", "bgr", "gray")
LAYOUTS = ("nchw", "nhwc")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")


def _image_reader(model: onnx.ModelProto, pre: Preprocess):
    try:
        from PIL import Image
    except ImportError:
        raise QtoolError("reading images needs Pillow: pip install 'qtool[images]'") from None
    pre.check()
    inputs = graph_inputs(model)
    names = [vi.name for vi in inputs]
    name = pre.input or (names[0] if len(names) == 1 else None)
    if name not in names:
        raise QtoolError(f"images need --input NAME for a model with inputs {', '.join(names)}"
                         if name is None else f"model has no input '{name}' (inputs: {', '.join(names)})")
    shape = input_shape(next(vi for vi in inputs if vi.name == name))
    spatial = shape[2:4] if pre.layout == "nchw" else shape[1:3]
    size = pre.resize or (tuple(spatial) if all(isinstance(d, int) and d > 0 for d in spatial) else None)
    if size is None:
        raise QtoolError(f"input '{name}' has dynamic height/width {spatial}; give --resize HxW")
    mean = np.asarray(pre.mean, np.float32)
    std = np.asarray(pre.std, np.float32)

    def read(path: Path) -> dict[str, np.ndarray]:
        try:
            with Image.open(path) as img:
                img = img.convert("L" if pre.channels == "gray" else "RGB")
                img = img.resize((size[1], size[0]), Image.BILINEAR)
                pixels = np.asarray(img, dtype=np.float32)
        except OSError as e:
            raise QtoolError(f"image '{path}' cannot be read ({e})") from None
        pixels = pixels[..., None] if pixels.ndim == 2 else pixels
        if pre.channels == "bgr":
            pixels = pixels[..., ::-1]
        x = (pixels * pre.scale - mean) / std
        return {name: np.ascontiguousarray(x.transpose(2, 0, 1) if pre.layout == "nchw" else x)}

    return read


def _array_reader(model: onnx.ModelProto):
    inputs = graph_inputs(model)

    def read(path: Path) -> dict[str, np.ndarray]:
        arrays = read_npz(path)
        chosen = _match_inputs(path, arrays, inputs)
        sample = {}
        for vi in inputs:
            a = chosen[vi.name]
            rank = len(input_shape(vi))
            if rank and a.ndim == rank and a.shape[0] == 1:
                a = a[0]
            if rank and a.ndim != rank - 1:
                raise QtoolError(f"data file '{path}' array for input '{vi.name}' has shape "
                                 f"{list(a.shape)}; a folder holds one sample per file "
                                 f"(rank {rank - 1}, or {rank} with a leading 1)")
            sample[vi.name] = a
        return sample

    return read


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
            raise QtoolError(f"data file '{path}' holds pickled objects (object arrays); refusing "
                             "to load it: only plain numeric arrays are read (allow_pickle=False)") from None
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


def load_dataset(path: str | Path, model: onnx.ModelProto, preprocess: Preprocess | None = None) -> Dataset:
    """An .npz/.npy file, a folder of .npy/.npz files or a folder of images, matched to the model.

    In an .npz, arrays are matched to model inputs by name; a file with a single array feeds a
    single-input model whatever the array's name. Folders are read in sorted name order.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        arrays = [p for p in files if p.suffix in (".npy", ".npz")]
        images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
        if arrays and images:
            raise QtoolError(f"data folder '{path}' mixes arrays and images; keep one kind")
        if images:
            return FileDataset(path, images, _image_reader(model, preprocess or Preprocess()), model)
        if arrays:
            return FileDataset(path, arrays, _array_reader(model), model)
        raise QtoolError(f"data folder '{path}' holds no .npy, .npz or image files")
    arrays = read_npz(path)
    inputs = graph_inputs(model)
    chosen = _match_inputs(path, arrays, inputs)
    used = {id(a) for a in chosen.values()}
    extra = {k: a for k, a in arrays.items() if id(a) not in used}
    counts = set()
    for vi in inputs:
        chosen[vi.name] = _check_array(path, vi, chosen[vi.name])
        counts.add(len(chosen[vi.name]))
    if len(counts) > 1:
        raise QtoolError(f"data file '{path}': inputs have different sample counts {sorted(counts)}")
    return ArrayDataset(path, chosen, extra, list(arrays))


def _match_inputs(path: Path, arrays: dict[str, np.ndarray], inputs) -> dict[str, np.ndarray]:
    names = [vi.name for vi in inputs]
    if not arrays:
        raise QtoolError(f"data file '{path}' holds no arrays")
    if all(n in arrays for n in names):
        return {n: arrays[n] for n in names}
    if len(names) == 1 and len(arrays) == 1:
        return {names[0]: next(iter(arrays.values()))}
    missing = [n for n in names if n not in arrays]
    raise QtoolError(f"data file '{path}' has no array for model input '{missing[0]}' "
                     f"(model inputs: {', '.join(names)}; arrays: {', '.join(arrays)})")


def _check_array(path: Path, vi: onnx.ValueInfoProto, a: np.ndarray) -> np.ndarray:
    name = vi.name
    elem = vi.type.tensor_type.elem_type
    if a.dtype.kind not in "biuf":
        raise QtoolError(f"data file '{path}' array for input '{name}' has dtype {a.dtype}; "
                         "expected numbers")
    if elem in _NP_TYPES and a.dtype.kind != "f":  # integers are most likely unscaled pixels or ids
        raise QtoolError(f"data file '{path}' array for input '{name}' has dtype {a.dtype}; "
                         f"model expects {np.dtype(_NP_TYPES[elem])} (convert it with .astype)")
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
