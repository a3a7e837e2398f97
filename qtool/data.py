"""Datasets: an ``.npz`` keyed by model input name, samples along the first axis."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from .errors import QtoolError
from .model import graph_inputs, input_shape, open_first, state_inputs
from .pixels import channel_count, count_misfit, pixel_inputs, plural

_NP_TYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64,
             onnx.TensorProto.FLOAT16: np.float16}


class Dataset:
    """Samples keyed by model input name, read in a fixed order, one batch at a time."""

    path: Path
    extra: dict[str, np.ndarray]  # other arrays of an .npz (labels, ...)
    keys: list[str] = []  # every array name in the file, for messages
    preprocess: "Preprocess | None" = None  # how a folder of images became tensors; None for arrays
    # each sample is a whole input (the arrays hold one more axis than the model's inputs, which
    # have no batch axis: frames [T, F]): fed one at a time, as it is
    whole_samples: bool = False

    def __len__(self) -> int:
        raise NotImplementedError

    def sample_shape(self, name: str) -> list[int]:
        """The shape of one sample of input ``name`` (the sample axis left out), or the whole
        array's shape when it is fed whole (``sample_axis`` None)."""
        raise NotImplementedError

    def sample_axis(self, name: str) -> int | None:
        """The axis of input ``name`` that holds the samples (0 unless the model says otherwise, see
        ``load_dataset``), or None for an array fed whole to every run."""
        return 0

    def samples_in(self, feeds: dict[str, np.ndarray]) -> int:
        """How many samples a batch of ``feeds`` holds."""
        for name, value in feeds.items():
            axis = self.sample_axis(name)
            if axis is not None:
                return value.shape[axis]
        return 1

    def batch(self, start: int, stop: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def batches(self, batch_size: int, limit: int | None = None, start: int = 0):
        """Feeds of at most ``batch_size`` samples (one where each is a whole input), in order, from
        sample ``start``."""
        batch_size = 1 if self.whole_samples else batch_size
        total = len(self) if limit is None else min(limit, len(self))
        for first in range(start, total, batch_size):
            yield self.batch(first, min(first + batch_size, total))


class ArrayDataset(Dataset):
    """An .npz (or .npy); large arrays stay in the file (``RowFile``, see read_npz) and each batch
    is read, and converted to the model's input type, when it comes."""

    def __init__(self, path: Path, arrays: dict[str, np.ndarray], extra: dict[str, np.ndarray],
                 keys: list[str], dtypes: dict[str, np.dtype] | None = None):
        self.path, self.arrays, self.extra, self.keys = path, arrays, extra, keys
        self.dtypes = dtypes or {}
        self.axes: dict[str, int | None] = {}  # input -> its sample axis, None: fed whole (load_dataset)
        self.stacked: set[str] = set()  # inputs whose arrays stack whole inputs (``whole_samples``)

    @property
    def whole_samples(self) -> bool:
        return bool(self.stacked)

    def __len__(self) -> int:
        if self.stacked:
            return len(self.arrays[next(iter(self.stacked))])
        counts = [a.shape[axis] for name, a in self.arrays.items()
                  if (axis := self.sample_axis(name)) is not None]
        return counts[0] if counts else 1

    def sample_axis(self, name: str) -> int | None:
        return self.axes.get(name, 0)

    def sample_shape(self, name: str) -> list[int]:
        shape, axis = list(self.arrays[name].shape), self.sample_axis(name)
        if name in self.stacked:
            return shape[1:]
        return shape if axis is None else shape[:axis] + shape[axis + 1:]

    def batch(self, start: int, stop: int) -> dict[str, np.ndarray]:
        if self.stacked and stop != start + 1:
            raise ValueError("whole inputs are fed one at a time")  # batches() gives them so
        feeds = {}
        for name, a in self.arrays.items():
            axis = self.sample_axis(name)
            if name in self.stacked:
                part = a[start:stop][0]
            elif axis is None:
                part = a[()] if a.ndim == 0 else a[:]
            elif axis == 0:
                part = a[start:stop]
            else:  # (arrays with the samples elsewhere than first are loaded whole: see load_dataset)
                part = a[(slice(None),) * axis + (slice(start, stop),)]
            feeds[name] = np.ascontiguousarray(part, dtype=self.dtypes.get(name, a.dtype))
        return feeds


class FileDataset(Dataset):
    """A folder of files, one sample each, read when their batch comes (sorted by name); where the
    first file's arrays are whole inputs (``_ArrayReader.whole``), every file's are, fed one at a time
    as they are (sequences of any length)."""

    def __init__(self, path: Path, files: list[Path], read, model: onnx.ModelProto):
        self.path, self.files, self.read, self.extra = path, files, read, {}
        self.inputs = {vi.name: vi for vi in graph_inputs(model)}
        self.pixels = set(pixel_inputs(model))  # quantize --input-pixels: float data are converted
        self._first = self.read(files[0])
        missing = [name for name in self.inputs if name not in self._first]
        if missing:
            raise QtoolError(f"data folder '{path}' gives no data for model input '{missing[0]}' "
                             f"(model inputs: {', '.join(self.inputs)}); images feed one input")
        self.whole_samples = isinstance(read, _ArrayReader) and read.whole(files[0], self._first)

    def __len__(self) -> int:
        return len(self.files)

    def sample_axis(self, name: str) -> int | None:
        return None if self.whole_samples else 0

    def sample_shape(self, name: str) -> list[int]:
        return list(self._first[name].shape)

    def batch(self, start: int, stop: int) -> dict[str, np.ndarray]:
        if self.whole_samples:
            if stop != start + 1:
                raise ValueError("whole inputs are fed one at a time")  # batches() gives them so
            sample = self.read(self.files[start])
            if not self.read.whole(self.files[start], sample):
                raise QtoolError(f"data folder '{self.path}': '{self.files[start].name}' holds no whole "
                                 f"inputs where '{self.files[0].name}' does (arrays of the model inputs' own rank)")
            source = _file_array(self.files[start])
            return {name: np.ascontiguousarray(sample[name], dtype=_check_array(source, vi, sample[name], None,
                                                                               pixels=name in self.pixels))
                    for name, vi in self.inputs.items()}
        samples = [self.read(f) for f in self.files[start:stop]]
        feeds = {}
        for name, vi in self.inputs.items():
            shapes = {s[name].shape for s in samples}
            if len(shapes) > 1:
                raise QtoolError(f"data folder '{self.path}': samples for input '{name}' have "
                                 f"different shapes {sorted(shapes)}; use --batch-size 1")
            stacked = np.stack([s[name] for s in samples])
            feeds[name] = stacked.astype(_check_array(self._batch_array(start, stop), vi, stacked,
                                                      pixels=name in self.pixels), copy=False)
        return feeds

    def _batch_array(self, start: int, stop: int) -> str:
        """What a batch's stacked array is, for messages: the folder and its files."""
        if stop - start == 1:
            return f"data folder '{self.path}' file '{self.files[start].name}'"
        return (f"data folder '{self.path}' batch of files '{self.files[start].name}' to "
                f"'{self.files[stop - 1].name}'")


@dataclass(frozen=True)
class Preprocess:
    """Image to tensor: ``(pixel * scale - mean) / std`` per channel after resizing."""

    resize: tuple[int, int] | None = None  # (height, width); default: the model input's fixed dims
    mean: tuple[float, ...] = (0.0,)  # one value, or one per channel
    std: tuple[float, ...] = (1.0,)
    scale: float = 1 / 255
    channels: str = "rgb"  # rgb, bgr or gray
    layout: str = "nchw"  # nchw or nhwc
    input: str | None = None  # the model input the images feed; default: the only one
    fit: str = "stretch"  # stretch, letterbox (keep the aspect, pad) or crop (keep it, cut the centre)
    pad: float = 114.0  # letterbox: the pixel value (0-255) of the padding, as YOLO exporters use

    def to_dict(self) -> dict:
        """The record a table and a quantized model keep (``qtool.preprocess``)."""
        return {"resize": list(self.resize) if self.resize else None, "fit": self.fit, "pad": self.pad,
                "mean": list(self.mean), "std": list(self.std), "scale": self.scale, "channels": self.channels,
                "layout": self.layout, "input": self.input}

    @classmethod
    def from_dict(cls, record: dict, where: str) -> "Preprocess":
        """``to_dict``'s record read back; ``where`` names it in errors."""
        try:
            pre = cls(tuple(int(v) for v in record["resize"]) if record.get("resize") else None,
                      tuple(float(v) for v in record["mean"]), tuple(float(v) for v in record["std"]),
                      float(record["scale"]), str(record["channels"]), str(record["layout"]),
                      None if record.get("input") is None else str(record["input"]),
                      str(record.get("fit", "stretch")), float(record.get("pad", 114.0)))
        except (KeyError, TypeError, ValueError):
            raise QtoolError(f"{where}: the recorded image preprocessing is not readable") from None
        pre.check()
        return pre

    def check(self) -> None:
        if self.fit not in FITS:
            raise QtoolError(f"unknown resize fit '{self.fit}'; choose one of {', '.join(FITS)}")
        if self.channels not in CHANNEL_ORDERS:
            raise QtoolError(f"unknown channel order '{self.channels}'; choose one of "
                             f"{', '.join(CHANNEL_ORDERS)}")
        if self.layout not in LAYOUTS:
            raise QtoolError(f"unknown layout '{self.layout}'; choose one of {', '.join(LAYOUTS)}")
        channels = channel_count(self.channels)
        for key in ("mean", "std"):
            if len(getattr(self, key)) not in (1, channels):
                raise QtoolError(f"preprocess {key} {list(getattr(self, key))} "
                                 f"{count_misfit(len(getattr(self, key)), channels, f'--channels {self.channels}')}")
        if any(v == 0 for v in self.std):
            raise QtoolError("preprocess std must not be 0")


PREPROCESS_KEY = "qtool.preprocess"  # a quantized model's metadata entry: Preprocess.to_dict() as JSON


def recorded_preprocess(model: onnx.ModelProto, where: str) -> "Preprocess | None":
    """The image preprocessing a quantized model records (its table's, from calibrate), if any."""
    import json

    for prop in model.metadata_props:
        if prop.key == PREPROCESS_KEY:
            try:
                record = json.loads(prop.value)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                raise QtoolError(f"{where}: the recorded image preprocessing is not readable")
            return Preprocess.from_dict(record, where)
    return None


def resolve_preprocess(given: dict, recorded: "Preprocess | None", source: str
                       ) -> tuple["Preprocess | None", list[str]]:
    """The preprocessing a command applies to a folder of images: the fields the user ``given``
    over the ones ``recorded`` in ``source`` (a table or a quantized model: calibration's), over
    the defaults; and a warning for each given field that differs from the recorded one. None
    when nothing is given or recorded (the defaults then apply to images)."""
    if recorded is None:
        return (Preprocess(**given) if given else None), []
    warnings = []
    for key, value in given.items():
        if value != getattr(recorded, key):
            warnings.append(f"image preprocessing: {key} {_shown(value)} given, {_shown(getattr(recorded, key))} "
                            f"recorded in {source} (calibration's); the given one is used")
    return dataclasses.replace(recorded, **given), warnings


def holds_images(path) -> bool:
    """Whether ``path`` is a folder with image files (what the image options describe)."""
    folder = Path(path)
    return folder.is_dir() and any(p.suffix.lower() in IMAGE_SUFFIXES for p in folder.iterdir())


def images_for(model: onnx.ModelProto, data_path, given: dict, where: str) -> tuple["Preprocess | None", list[str]]:
    """The image preprocessing for DATA: None unless it is a folder; the ``given`` fields over the
    ones ``model`` records (calibration's), and the warnings where they differ."""
    if not holds_images(data_path):
        if given:
            raise QtoolError(f"the image options describe a folder of images; '{data_path}' is not one")
        return None, []
    pre, warnings = resolve_preprocess(given, recorded_preprocess(model, where), where)
    if pre is not None:
        pre.check()
    return pre, warnings


def _shown(value) -> str:
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


CHANNEL_ORDERS = ("rgb", "bgr", "gray")
FITS = ("stretch", "letterbox", "crop")
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
    _check_channels(name, shape, pre)
    spatial = shape[2:4] if pre.layout == "nchw" else shape[1:3]
    size = pre.resize or (tuple(spatial) if all(isinstance(d, int) and d > 0 for d in spatial) else None)
    if size is None:
        raise QtoolError(f"input '{name}' has dynamic height/width {spatial}; give --resize HxW")
    mean = np.asarray(pre.mean, np.float32)
    std = np.asarray(pre.std, np.float32)

    def read(path: Path) -> dict[str, np.ndarray]:
        try:
            with Image.open(path) as img:
                img = fitted(img.convert("L" if pre.channels == "gray" else "RGB"), size, pre.fit, pre.pad)
                pixels = np.asarray(img, dtype=np.float32)
        except OSError as e:
            raise QtoolError(f"image '{path}' cannot be read ({e})") from None
        pixels = pixels[..., None] if pixels.ndim == 2 else pixels
        if pre.channels == "bgr":
            pixels = pixels[..., ::-1]
        x = (pixels * pre.scale - mean) / std
        return {name: np.ascontiguousarray(x.transpose(2, 0, 1) if pre.layout == "nchw" else x)}

    return read


def _check_channels(name: str, shape: list, pre: Preprocess) -> None:
    """A one-line error where a 4-d model input cannot take the images as ``pre`` lays them out:
    its channels (1 or 3) lie on the other axis than ``pre.layout`` puts them, or it has another
    number of them than ``pre.channels`` gives."""
    if len(shape) != 4:
        return
    axis, other = (1, 3) if pre.layout == "nchw" else (3, 1)
    if shape[axis] not in (1, 3) and shape[other] in (1, 3):
        looks = "nhwc" if pre.layout == "nchw" else "nchw"
        raise QtoolError(f"input '{name}' is {_shape_text(shape, None)}: it looks {looks.upper()} (channels "
                         f"{'last' if looks == 'nhwc' else 'first'}) but the images are laid out "
                         f"{pre.layout.upper()}; give --layout {looks}")
    channels = channel_count(pre.channels)
    if isinstance(shape[axis], int) and shape[axis] > 0 and shape[axis] != channels:
        fix = {1: "; give --channels gray", 3: "; give --channels rgb or bgr"}.get(shape[axis], "")
        raise QtoolError(f"input '{name}' is {_shape_text(shape, None)}: it takes {plural(shape[axis], 'channel')} "
                         f"but the images are read as {pre.channels} ({channels}){fix}")


def fitted(img, size: tuple[int, int], fit: str, pad: float):
    """A PIL image brought to ``size`` (height, width), bilinear: ``stretch`` resizes to it;
    ``letterbox`` scales it to fit inside, keeping its aspect, centred on a ``pad``-valued canvas;
    ``crop`` scales it to cover the size, keeping its aspect, and cuts out the centre."""
    from PIL import Image

    height, width = size
    if fit == "stretch":
        return img.resize((width, height), Image.BILINEAR)
    ratio = (min if fit == "letterbox" else max)(width / img.width, height / img.height)
    inner = (max(1, round(img.width * ratio)), max(1, round(img.height * ratio)))
    img = img.resize(inner, Image.BILINEAR)
    if fit == "crop":
        left, top = (inner[0] - width) // 2, (inner[1] - height) // 2
        return img.crop((left, top, left + width, top + height))
    fill = int(round(pad)) if img.mode == "L" else (int(round(pad)),) * 3
    canvas = Image.new(img.mode, (width, height), fill)
    canvas.paste(img, ((width - inner[0]) // 2, (height - inner[1]) // 2))
    return canvas


class _ArrayReader:
    """One sample's arrays from a file of a folder: an array of the input's rank less 1 (or of its
    rank with a leading 1), or, where the file holds whole inputs (``whole``), each as it is."""

    def __init__(self, model: onnx.ModelProto):
        self.inputs = graph_inputs(model)

    def whole(self, path: Path, arrays: dict[str, np.ndarray]) -> bool:
        """Whether the file's arrays are whole inputs: one of the input's own rank, first size
        not 1, where the model leaves that size open (frames [T, F] of a model without a batch
        axis); every other array then shaped exactly as its input."""
        found = {vi.name for vi in self.inputs if _whole_file_array(vi, arrays[vi.name])}
        if found:
            _fed_whole_beside(f"data file '{path}'", arrays, self.inputs, found)
        return bool(found)

    def __call__(self, path: Path) -> dict[str, np.ndarray]:
        arrays = read_npz(path)
        chosen = _match_inputs(path, arrays, self.inputs)
        if self.whole(path, chosen):
            return chosen
        sample = {}
        for vi in self.inputs:
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


def _whole_file_array(vi: onnx.ValueInfoProto, a: np.ndarray) -> bool:
    """A folder's array that is one whole input: the input's own rank, a first size other than
    1 that the model leaves open."""
    dims = input_shape(vi)
    return open_first(dims) and a.ndim == len(dims) and a.shape[0] != 1


# arrays larger than this are read from the file batch by batch rather than loaded whole
LAZY_BYTES = 16 << 20


def read_npz(path: str | Path, lazy: bool = False) -> dict[str, np.ndarray]:
    """All arrays of an ``.npz`` (or one ``.npy``), refusing pickled objects.

    ``lazy``: arrays over ``LAZY_BYTES`` come as ``RowFile``s, read a batch of rows at a time
    (a member stored uncompressed, as ``np.savez`` writes it, in place; a compressed one is first
    inflated into a temporary file), so that memory does not grow with the number of samples.
    """
    path = Path(path)
    if not path.is_file():
        if path.exists() and not path.is_dir():
            raise QtoolError(f"data file '{path}' is not a regular file (a pipe or a device); an .npz "
                             f"is read out of order, so save it to a file first")
        raise QtoolError(f"data file '{path}' not found")
    try:
        if lazy:
            return _mapped(path)
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
    except (OSError, zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise QtoolError(f"data file '{path}' is not a valid .npz/.npy file ({e})") from None


class RowFile:
    """A C-ordered array stored in a file, read a slice of rows at a time (``a[i:j]`` is an
    ndarray). Plain reads rather than a memory map: pages of a map that were read stay in the
    process's resident set, which then grows with the samples read."""

    def __init__(self, file, offset: int, shape: tuple, dtype: np.dtype, path: Path):
        self._file = file  # kept open (a temporary file is gone once closed)
        self._lock = threading.Lock()  # one seek + read at a time
        self.offset, self.shape, self.dtype = offset, tuple(shape), np.dtype(dtype)
        self.ndim = len(self.shape)
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        if os.fstat(file.fileno()).st_size < offset + self.shape[0] * self.row_bytes:
            raise QtoolError(f"data file '{path}' is truncated: an array of shape "
                             f"{list(self.shape)} does not fit in it")

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("RowFile reads contiguous slices of rows")
        start, stop, _ = key.indices(len(self))
        stop = max(start, stop)
        out = np.empty((stop - start,) + self.shape[1:], self.dtype)
        if out.size == 0:
            return out
        with self._lock:
            self._file.seek(self.offset + start * self.row_bytes)
            self._file.readinto(memoryview(out).cast("B"))
        return out

    def __array__(self, dtype=None, copy=None):
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


def _mapped(path: Path) -> dict[str, np.ndarray]:
    if not zipfile.is_zipfile(path):
        raw = open(path, "rb")
        shape, dtype, fortran = _npy_header(raw)
        if shape is None or fortran or not shape or _nbytes(shape, dtype) <= LAZY_BYTES:
            raw.close()
            return read_npz(path)
        return {path.stem: RowFile(raw, raw.tell(), shape, dtype, path)}
    arrays = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            with archive.open(info) as member:
                shape, dtype, fortran = _npy_header(member)
            if shape is None or fortran or not shape or _nbytes(shape, dtype) <= LAZY_BYTES:
                with archive.open(info) as member:
                    arrays[name] = np.lib.format.read_array(member, allow_pickle=False)
            elif info.compress_type == zipfile.ZIP_STORED:
                raw = open(path, "rb")
                raw.seek(info.header_offset)
                local = raw.read(30)  # the local file header: its name and extra field lengths
                raw.seek(info.header_offset + 30 + int.from_bytes(local[26:28], "little")
                         + int.from_bytes(local[28:30], "little"))
                _npy_header(raw)
                arrays[name] = RowFile(raw, raw.tell(), shape, dtype, path)
            else:  # compressed: inflated once into a temporary file, deleted when closed
                tmp = tempfile.TemporaryFile(prefix="qtool-data-")
                with archive.open(info) as member:
                    _npy_header(member)
                    shutil.copyfileobj(member, tmp, 1 << 20)
                tmp.flush()
                arrays[name] = RowFile(tmp, 0, shape, dtype, path)
    return arrays


def _npy_header(f) -> tuple[tuple | None, np.dtype | None, bool]:
    """(shape, dtype, fortran order) of the .npy at ``f``'s position, read up to its data; shape
    None when it holds objects (read_array then refuses it) or has a header version this does not
    read (read_array then reads it whole)."""
    version = np.lib.format.read_magic(f)
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in readers:
        return None, None, False
    shape, fortran, dtype = readers[version](f)
    return (None, None, False) if dtype.hasobject else (shape, dtype, fortran)


def _nbytes(shape: tuple, dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _starts_with(path: Path, prefix: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(prefix)) == prefix


def check_sampling(num_samples: int | None, batch_size: int | None) -> None:
    """Reject counts that would compare nothing or loop forever, before any work starts."""
    if batch_size is not None and batch_size < 1:
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
            pre = preprocess or Preprocess()
            dataset = FileDataset(path, images, _image_reader(model, pre), model)
            dataset.preprocess = pre
            return dataset
        if arrays:
            return FileDataset(path, arrays, _ArrayReader(model), model)
        raise QtoolError(f"data folder '{path}' holds no .npy, .npz or image files")
    arrays = read_npz(path, lazy=True)
    inputs = graph_inputs(model)
    chosen = _match_inputs(path, arrays, inputs)
    used = {id(a) for a in chosen.values()}
    extra = {k: a for k, a in arrays.items() if id(a) not in used}
    axes = {vi.name: sample_axis(vi, chosen[vi.name]) for vi in inputs}
    stacked = {vi.name for vi in inputs if _stacks_whole(vi, chosen[vi.name])}
    if stacked:
        axes = _whole_inputs(path, chosen, inputs, stacked)
    for name, axis in axes.items():
        if axis not in (None, 0) and isinstance(chosen[name], RowFile):
            chosen[name] = chosen[name][:]  # a state or the like: small, and read across rows
    pixels = pixel_inputs(model)
    dtypes = {vi.name: _check_array(_file_array(path), vi, chosen[vi.name], axes[vi.name], vi.name in stacked,
                                    pixels=vi.name in pixels) for vi in inputs}
    if not stacked:
        check_named_dims(f"data file '{path}'", inputs, chosen, axes)
    check_indices(f"data file '{path}'", model, chosen)
    dataset = ArrayDataset(path, chosen, extra, list(arrays), dtypes)
    dataset.axes = axes
    if stacked:
        dataset.stacked = stacked
        return dataset
    # an array shaped exactly as its model input (every size fixed above 1 first) is fed whole to
    # every run beside an input whose first size is open (a state [25] beside frames [T, 266],
    # also when there happen to be 25 frames: fixed_batch's rule), and also when the sample
    # counts disagree: a state, or inputs of different fixed leading sizes
    states = state_inputs(model)
    for vi in inputs:
        if vi.name in states and tuple(input_shape(vi)) == tuple(chosen[vi.name].shape):
            axes[vi.name] = None
    counts = {chosen[n].shape[a] for n, a in axes.items() if a is not None}
    if len(counts) > 1:
        for vi in inputs:
            if tuple(input_shape(vi)) == tuple(chosen[vi.name].shape):
                axes[vi.name] = None
        counts = {chosen[n].shape[a] for n, a in axes.items() if a is not None}
    if len(counts) > 1:
        raise QtoolError(f"data file '{path}': inputs have different sample counts {sorted(counts)} "
                         f"(an array shaped exactly as its model input, every size fixed, is fed "
                         f"whole to every run)")
    return dataset


def _stacks_whole(vi: onnx.ValueInfoProto, a) -> bool:
    """Whether array ``a`` stacks whole inputs ``vi``: one axis more than the input's declared rank
    (at least 1), whose first size the model leaves open (frames [T, F] of a model without a
    batch axis, given as [N, T, F])."""
    dims = input_shape(vi)
    return open_first(dims) and a.ndim == len(dims) + 1


def _whole_inputs(path: Path, chosen: dict, inputs, stacked: set[str]) -> dict[str, None]:
    """The sample axes where the arrays of ``stacked`` hold one whole input per entry of their
    first axis: none in what a run is fed, every other input's array fed whole to every run
    (shaped exactly as the model input); or a one-line error."""
    _fed_whole_beside(f"data file '{path}'", chosen, inputs, stacked)
    counts = {len(chosen[name]) for name in stacked}
    if len(counts) > 1:
        raise QtoolError(f"data file '{path}': inputs have different sample counts {sorted(counts)}")
    return {vi.name: None for vi in inputs}


def _fed_whole_beside(where: str, arrays: dict, inputs, whole: set[str]) -> None:
    """A one-line error unless every input but ``whole`` has an array shaped exactly as the model
    input: beside whole inputs, every other input is one whole too (a state)."""
    for vi in inputs:
        shape = list(arrays[vi.name].shape)
        if vi.name not in whole and tuple(input_shape(vi)) != tuple(shape):
            raise QtoolError(f"{where}: the array for input '{sorted(whole)[0]}' holds whole inputs, so the array "
                             f"for '{vi.name}' must be one whole input too (model input "
                             f"{_shape_text(input_shape(vi), None)}), not {shape}")


def output_sample_axes(model: onnx.ModelProto) -> dict[str, int]:
    """Per model output, the axis its samples lie on by ``sample_axis``'s rule on its declared
    shape (0 when it declares none)."""
    return {vi.name: _open_axis(input_shape(vi)) for vi in model.graph.output}


def sample_axis(vi: onnx.ValueInfoProto, a: np.ndarray) -> int | None:
    """Where input ``vi``'s samples lie in its data array ``a``: None for a scalar input (declared
    0-d, or of unknown shape and ``a`` 0-d: fed whole), else the first axis whose size the model
    leaves open when its first size is fixed above 1 (a state [2, batch, 128]: axis 1), else 0."""
    dims = input_shape(vi)
    if not dims and (a.ndim == 0 or vi.type.tensor_type.HasField("shape")):
        return None  # a scalar (a 0-d array for an input of unknown shape is one too)
    return _open_axis(dims)


def _open_axis(dims: list) -> int:
    """The first open size of ``dims`` when the first is fixed above 1 (a first size of 1 is a
    fixed batch: the samples run one at a time), else 0."""
    fixed = [isinstance(d, int) and d > 0 for d in dims]
    if dims and fixed[0] and dims[0] != 1 and not all(fixed):
        return fixed.index(False)
    return 0


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


def _check_array(source: str, vi: onnx.ValueInfoProto, a: np.ndarray, axis: int | None = 0,
                 stacked: bool = False, pixels: bool = False) -> np.dtype:
    """``a`` (``source`` names it: "data file 'x.npz' array") checked against the model input
    (numbers, shape, finite values: read in chunks, so a large array in a file is not loaded
    whole), its samples along ``axis`` (None: fed whole), or
    whole inputs stacked along its first axis (``stacked``); returns the type to feed it as (the
    input's float type for floats), for the caller to convert. ``pixels``: the uint8 input of a
    ``quantize --input-pixels`` model, which also takes float data made with the preprocessing it
    records (fed as float32; the executor turns them back into pixels, qtool/pixels.py)."""
    name = vi.name
    elem = vi.type.tensor_type.elem_type
    if a.dtype.kind not in "biuf":
        raise QtoolError(f"{source} for input '{name}' has dtype {a.dtype}; "
                         "expected numbers")
    if elem in _NP_TYPES and a.dtype.kind != "f":  # integers are most likely unscaled pixels or ids
        raise QtoolError(f"{source} for input '{name}' has dtype {a.dtype}; "
                         f"model expects {np.dtype(_NP_TYPES[elem])} (convert it with .astype)")
    wanted = _integer_type(elem)
    if pixels and a.dtype.kind == "f":
        wanted, elem = None, onnx.TensorProto.FLOAT  # normalized images: converted when fed
    if wanted is not None and a.dtype.kind == "f":  # ids, positions, a mask: no float will do
        raise QtoolError(f"{source} for input '{name}' has dtype {a.dtype}; model expects {wanted} "
                         f"(token ids, positions or a mask: save it as integers)")
    expected = input_shape(vi)
    if stacked:  # [N, *input]: the samples on a new first axis
        expected, axis = [None, *expected], 0
    if axis is None:  # a scalar, or an array fed whole
        if a.ndim != len(expected) or any(isinstance(want, int) and want > 0 and got != want
                                          for got, want in zip(a.shape, expected)):
            raise QtoolError(f"{source} for input '{name}' has shape {list(a.shape)}; "
                             f"model expects {_shape_text(expected, None)}")
    elif a.ndim == 0 or a.shape[axis] == 0:
        raise QtoolError(f"{source} for input '{name}' is empty")
    else:
        where = "on the first axis" if axis == 0 else f"on axis {axis}, the model's open size"
        if expected and a.ndim != len(expected):
            raise QtoolError(f"{source} for input '{name}' has shape {list(a.shape)}; "
                             f"model expects {_shape_text(expected, axis)} (samples {where})")
        for i, (got, want) in enumerate(zip(a.shape, expected)):
            if i != axis and isinstance(want, int) and want > 0 and got != want:
                raise QtoolError(f"{source} for input '{name}' has shape "
                                 f"{list(a.shape)}; model expects {_shape_text(expected, axis)} "
                                 f"(axis {i} differs)")
    dtype = np.dtype(_NP_TYPES[elem]) if elem in _NP_TYPES else a.dtype
    if wanted is not None and a.dtype != wanted:  # int32 ids for an int64 input: fed as int64
        _check_fits(source, name, a, wanted)
        dtype = wanted
    if dtype.kind == "f" and (a.ndim == 0 or axis != 0):  # small: checked whole
        if not np.isfinite(np.asarray(a, dtype=dtype)).all():
            raise QtoolError(f"{source} for input '{name}' has NaN or Inf")
    elif dtype.kind == "f":
        rows = max(1, LAZY_BYTES // max(1, a[:1].nbytes))
        for start in range(0, len(a), rows):
            chunk = a[start:start + rows].astype(dtype, copy=False)
            finite = np.isfinite(chunk).reshape(len(chunk), -1).all(axis=1)
            if not finite.all():
                raise QtoolError(f"{source} for input '{name}' has NaN or Inf "
                                 f"(first in sample {start + int(np.argmin(finite))})")
    return dtype


def _integer_type(elem: int) -> np.dtype | None:
    """The numpy type of an integer or boolean model input type (None for the others)."""
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
    except (KeyError, TypeError, ValueError):
        return None
    return dtype if dtype.kind in "biu" else None


def _value_range(a) -> tuple[int, int] | None:
    """(min, max) of an integer array or of a ``RowFile`` (read in chunks of rows); None if empty."""
    if int(np.prod(a.shape, dtype=np.int64)) == 0:
        return None
    if isinstance(a, np.ndarray) or not a.shape:
        return int(np.min(a)), int(np.max(a))
    rows = max(1, LAZY_BYTES // max(1, a[:1].nbytes))
    lo = hi = None
    for start in range(0, len(a), rows):
        chunk = a[start:start + rows]
        lo = int(chunk.min()) if lo is None else min(lo, int(chunk.min()))
        hi = int(chunk.max()) if hi is None else max(hi, int(chunk.max()))
    return lo, hi


def _check_fits(source: str, name: str, a, wanted: np.dtype) -> None:
    """Integers of ``a`` that ``wanted`` (the model input's integer type) holds too, or a one-line
    error: converted, they would wrap."""
    found = None if a.dtype.kind == "b" else _value_range(a)
    if wanted.kind == "b":
        if found is not None and (found[0] < 0 or found[1] > 1):
            raise QtoolError(f"{source} for input '{name}' has dtype {a.dtype} with values other "
                             f"than 0 and 1; model expects bool")
        return
    if found is None or np.can_cast(a.dtype, wanted, "safe"):
        return
    info = np.iinfo(wanted)
    lo, hi = found
    if lo < info.min or hi > info.max:
        raise QtoolError(f"{source} for input '{name}' has dtype {a.dtype} with values in [{lo}, {hi}]; "
                         f"model expects {wanted}, which holds [{info.min}, {info.max}]")


def check_named_dims(source: str, inputs, arrays: dict[str, np.ndarray], axes: dict[str, int | None]) -> None:
    """Inputs whose shapes name the same size (input_ids and attention_mask both
    [batch, sequence_length]) get arrays that agree on it, or a one-line error naming both: else
    onnxruntime fails deep in the graph with a broadcasting message."""
    seen: dict[str, tuple[str, int]] = {}
    for vi in inputs:
        a, axis = arrays.get(vi.name), axes.get(vi.name)
        if a is None:
            continue
        dims = input_shape(vi)
        for i, dim in enumerate(dims):
            # a name that is no word ('?') or that one input gives twice (paddle2onnx's [?, 3, ?, ?])
            # is a placeholder, not a size shared
            if not isinstance(dim, str) or i >= a.ndim or i == axis or not (dim[:1].isalpha() or dim[:1] == "_") \
                    or dims.count(dim) > 1:
                continue
            size = int(a.shape[i])
            if dim in seen and seen[dim][1] != size:
                other, had = seen[dim]
                raise QtoolError(f"{source}: arrays for inputs '{other}' and '{vi.name}' differ in "
                                 f"'{dim}' ({had} and {size}); the model names that size in both, so "
                                 f"they must agree")
            seen.setdefault(dim, (vi.name, size))


def check_indices(source: str, model: onnx.ModelProto, arrays: dict[str, np.ndarray]) -> None:
    """Integer inputs that a Gather reads as indices into a constant table (token ids into an
    embedding) hold indices the table has, or a one-line error naming the input, the file and the
    table's size: onnxruntime's own names only the Gather node."""
    inits = {t.name: t for t in model.graph.initializer}
    # a quantized model's table: the DequantizeLinear of a constant
    tables = {n.output[0]: inits[n.input[0]] for n in model.graph.node
              if n.op_type == "DequantizeLinear" and n.input and n.input[0] in inits}
    tables.update(inits)
    for node in model.graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[0] not in tables:
            continue
        name = node.input[1]
        a = arrays.get(name)
        if a is None or a.dtype.kind not in "iu":
            continue
        axis = next((attr.i for attr in node.attribute if attr.name == "axis"), 0)
        dims = list(tables[node.input[0]].dims)
        found = _value_range(a)
        if not dims or found is None:
            continue
        rows = int(dims[axis % len(dims)])
        lo, hi = found
        if lo < -rows or hi >= rows:
            bad = hi if hi >= rows else lo
            raise QtoolError(f"{source} array for input '{name}' holds {bad}, outside the {rows} rows of the "
                             f"table Gather '{node.name}' reads it into (indices from {-rows} to {rows - 1})")


def _file_array(path: Path) -> str:
    return f"data file '{path}' array"


def _shape_text(shape, axis: int | None = 0) -> str:
    return "[" + ",".join("N" if i == axis else str(d if d else "?") for i, d in enumerate(shape)) + "]"
