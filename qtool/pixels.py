"""Lossless 8-bit input: the quantized model takes the raw pixels (``quantize --input-pixels``).

A model fed ``x = (p * scale - mean) / std`` of 8-bit pixels p loses half a grey level to its input
QuantizeLinear whenever the zero point cannot sit on the pixel grid: with mean 0.5 and scale 1/255
zero is pixel 127.5, so every pixel lands half a step between two int8 codes (the float model
itself loses ~24 dB on PP-OCRv4 det with that much noise). TPU-MLIR fuses the preprocessing into
the model for the same reason.

Here the normalization moves into the Conv layers that read the input. With Z the pixel nearest
the channels' mean (round(mean / scale), one for all channels):

    x_c = (scale * p - mean_c) / std_c = (scale * (p - Z)) / std_c + (scale * Z - mean_c) / std_c

so each such Conv gets weights ``W[:, c] / std_c`` and the bias ``b + sum_{c,k} W[o, c, k] *
(scale * Z - mean_c) / std_c``, and reads ``a = scale * (p - Z)``: exactly the uint8 pixels with
scale ``scale`` and zero point Z. The quantized model's input is then uint8, dequantized as it is:
no rounding. Inside the image the result is the float model's; where a Conv pads, the padded taps
stand for pixel Z instead of mean_c / scale (half a grey level at PP-OCR's 127.5; up to
|Z - mean_c / scale| grey levels where the channels' means differ, as ImageNet's do).

The model's metadata (``qtool.input_pixels``) keeps mean, std and scale, so that qtool's own runs
(exec, verify, the searches) can turn float data made with that preprocessing back into pixels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import DataError, QtoolError

METADATA_KEY = "qtool.input_pixels"


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def channel_count(order: str | None) -> int | None:
    """The channels an image read as ``order`` (gray, rgb, bgr) has; None for no order."""
    return {"gray": 1, "rgb": 3, "bgr": 3}.get(order)


def count_misfit(values: int, channels: int, holder: str) -> str:
    """For messages: ``values`` mean or std values given where ``holder`` has ``channels``."""
    give = "one value" if channels == 1 else f"1 or {channels} values"
    return f"has {plural(values, 'value')} but {holder} has {plural(channels, 'channel')}: give {give}"


@dataclass(frozen=True)
class PixelInput:
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    scale: float = 1 / 255
    # the images' channel order (rgb, bgr, gray) the values were given for: for messages only
    channels: str | None = field(default=None, compare=False, repr=False)

    def check(self) -> None:
        if not self.scale > 0:
            raise QtoolError(f"--input-pixels: --scale must be > 0, got {self.scale}")
        if any(s == 0 for s in self.std):
            raise QtoolError("--input-pixels: --std must not be 0")

    def per_channel(self, channels: int) -> tuple[np.ndarray, np.ndarray]:
        mean, std = (np.asarray(v, np.float64) for v in (self.mean, self.std))
        for key, v in (("mean", mean), ("std", std)):
            if v.size not in (1, channels):
                order = channel_count(self.channels) or channels
                misfit = (f"; --channels {self.channels} ({plural(order, 'channel')}) does not fit it"
                          if order != channels else "")
                counted = count_misfit(v.size, channels, "the model's input")
                raise QtoolError(f"--input-pixels: --{key} {counted}{misfit}")
        return np.broadcast_to(mean, (channels,)), np.broadcast_to(std, (channels,))

    def zero_point(self, channels: int) -> int:
        mean, _ = self.per_channel(channels)
        return int(np.clip(np.rint(float(mean.mean()) / self.scale), 0, 255))


def fold(model: onnx.ModelProto, spec: PixelInput, tensors: dict | None = None) -> tuple[str, int]:
    """Move the normalization of the model's only input into the Conv layers that read it (in
    place; ``model`` is prepared). Returns the input's name and the pixels' zero point.
    ``tensors``: the calibration table's entries (``.min``, ``.max``), whose range for the input
    must be one that pixels 0 to 255 give under ``spec`` (``check_range``)."""
    spec.check()
    inputs = [i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    if len(inputs) != 1:
        raise QtoolError(f"--input-pixels needs a model with one input, this one has {len(inputs)} "
                         f"({', '.join(i.name for i in inputs)})")
    name = inputs[0].name
    dims = inputs[0].type.tensor_type.shape.dim
    if len(dims) != 4:
        raise QtoolError(f"--input-pixels: input '{name}' has rank {len(dims)}; an NCHW image (rank "
                         f"4) is expected")
    readers = [n for n in model.graph.node if name in n.input]
    inits = {t.name: t for t in model.graph.initializer}
    for node in readers:
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        if node.op_type != "Conv" or list(node.input).index(name) != 0 or node.input[1] not in inits \
                or group != 1 or (len(node.input) > 2 and node.input[2] and node.input[2] not in inits):
            raise QtoolError(f"--input-pixels: input '{name}' is read by {node.op_type} node "
                             f"'{node.name}'; only Conv layers (group 1, constant weights) can take "
                             f"the normalization in")
    if not readers:
        raise QtoolError(f"--input-pixels: no node reads input '{name}'")
    shared = {t for node in readers for t in node.input[1:] if t}
    taken = set(inits) | {o for n in model.graph.node for o in n.output}
    channels = numpy_helper.to_array(inits[readers[0].input[1]]).shape[1]
    mean, std = spec.per_channel(channels)
    zero = spec.zero_point(channels)
    entry = (tensors or {}).get(name)
    if entry is not None:
        # a table whose every range is symmetric about 0 keeps one threshold a tensor (a TensorRT
        # cache): its input's range bounds |x| only
        bound_only = all(e.min == -e.max for e in tensors.values())
        check_range(name, spec, channels, entry.min, entry.max, bound_only)
    for node in readers:
        w = numpy_helper.to_array(inits[node.input[1]]).astype(np.float64)
        if w.shape[1] != channels:
            raise QtoolError(f"--input-pixels: Conv '{node.name}' reads {w.shape[1]} channels, "
                             f"'{readers[0].name}' {channels}")
        b = (numpy_helper.to_array(inits[node.input[2]]).astype(np.float64)
             if len(node.input) > 2 and node.input[2] else np.zeros(w.shape[0]))
        shape = (1, -1) + (1,) * (w.ndim - 2)
        offset = (spec.scale * zero - mean) / std  # per input channel
        folded_b = b + (w * offset.reshape(shape)).sum(axis=tuple(range(1, w.ndim)))
        folded_w = w / std.reshape(shape)
        for index, array in ((1, folded_w), (2, folded_b)):
            fresh = _fresh(f"{node.name}_pixels_{'weight' if index == 1 else 'bias'}", taken)
            model.graph.initializer.append(numpy_helper.from_array(array.astype(np.float32), fresh))
            if index < len(node.input):
                node.input[index] = fresh
            else:
                node.input.append(fresh)
    still_used = {t for n in model.graph.node for t in n.input}
    kept = [t for t in model.graph.initializer if t.name not in shared or t.name in still_used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return name, zero


# grey levels beyond 0-255 that float data may reach and still be pixels (clipped): a float resize
# (bicubic, Lanczos) overshoots by a few; other preprocessing misses by far more (3x, 255x)
PIXEL_SLACK = 16


def pixel_span(spec: PixelInput, channels: int) -> tuple[float, float]:
    """The lowest and highest normalized value that pixels -PIXEL_SLACK to 255 + PIXEL_SLACK give
    under ``spec``, over every channel."""
    mean, std = spec.per_channel(channels)
    ends = [(p * spec.scale - mean) / std for p in (-PIXEL_SLACK, 255 + PIXEL_SLACK)]
    return float(np.minimum(*ends).min()), float(np.maximum(*ends).max())


def _settings(spec: PixelInput) -> str:
    def values(v) -> str:
        return ",".join(f"{x:g}" for x in v)
    return f"--scale {spec.scale:g}, --mean {values(spec.mean)}, --std {values(spec.std)}"


def check_range(name: str, spec: PixelInput, channels: int, lo: float, hi: float,
                bound_only: bool = False) -> None:
    """The calibrated range [lo, hi] of input ``name`` is one that 8-bit pixels give under
    ``spec``, or a one-line error: the data were made with other preprocessing, and a uint8 input
    cannot hold what the table measured (at --scale 0.001 for data of range [0, 1]: pixels up to
    1000, clipped to 255). ``bound_only``: the range is a bound on |x| alone (a TensorRT cache
    keeps one threshold a tensor), checked as one."""
    low, high = pixel_span(spec, channels)
    if bound_only and hi > 0:  # the largest |x| the data reached is one that pixels give
        beyond = hi > max(abs(low), abs(high))
    else:
        beyond = lo < low or hi > high
    if beyond:
        raise QtoolError(f"--input-pixels: the table's range of input '{name}' is [{lo:.4g}, {hi:.4g}], "
                         f"beyond [{low:.4g}, {high:.4g}], what pixels 0 to 255 give at {_settings(spec)} "
                         f"({PIXEL_SLACK} levels either side allowed): the calibration data were made with "
                         f"other preprocessing; give the one they were made with")


def _fresh(base: str, taken: set[str]) -> str:
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def metadata(name: str, spec: PixelInput, zero: int) -> onnx.StringStringEntryProto:
    value = {name: {"mean": list(spec.mean), "std": list(spec.std), "scale": spec.scale, "zero_point": zero}}
    return onnx.StringStringEntryProto(key=METADATA_KEY, value=json.dumps(value))


def pixel_inputs(model: onnx.ModelProto) -> dict[str, dict]:
    """Input name -> its preprocessing, for a model ``quantize --input-pixels`` wrote."""
    entry = next((p.value for p in model.metadata_props if p.key == METADATA_KEY), None)
    return json.loads(entry) if entry else {}


def as_pixels(x: np.ndarray, info: dict, name: str = "") -> np.ndarray:
    """Float data normalized as ``info`` says, back to the uint8 pixels they were made from
    (rounded: data that came from 8-bit pixels come back exactly; a few levels beyond 0-255, as a
    float resize overshoots, are clipped). Data that give pixels further beyond (``PIXEL_SLACK``)
    were made with other preprocessing: a one-line error naming input ``name``, not pixels
    clipped without a word."""
    channels = x.shape[1]
    spec = PixelInput(tuple(info["mean"]), tuple(info["std"]), info["scale"])
    mean, std = spec.per_channel(channels)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    p = (x.astype(np.float64) * std.reshape(shape) + mean.reshape(shape)) / info["scale"]
    if p.size and not (p.min() >= -PIXEL_SLACK and p.max() <= 255 + PIXEL_SLACK):
        raise DataError(f"input '{name}': the float data give pixels from {p.min():.4g} to {p.max():.4g} under "
                        f"the preprocessing the model records ({_settings(spec)}), beyond 0 to 255 by more "
                        f"than {PIXEL_SLACK} levels: they were made with other preprocessing; give data made "
                        f"with it, or its uint8 pixels")
    return np.clip(np.rint(p), 0, 255).astype(np.uint8)


def feeds_for(pixels: dict[str, dict], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` with each pixel input given as float turned into its uint8 pixels."""
    if not pixels:
        return feeds
    return {k: as_pixels(v, pixels[k], k) if k in pixels and v.dtype.kind == "f" else v
            for k, v in feeds.items()}
