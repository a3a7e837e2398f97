"""Weight rounding fitted to the layer's inputs (``quantize --data``): GPTQ's closed form.

Rounding each int8 weight to its nearest step is optimal weight by weight, not for the layer's
output ``y = x W``: the errors of one output channel add up over its inputs, and inputs are
correlated. GPTQ (Frantar et al. 2023, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", after OBQ, Frantar & Alistarh 2022) rounds the rows of ``W`` [K, N]
one at a time and moves each row's rounding error onto the rows not yet rounded, weighted by the
inverse of the inputs' Gram matrix ``H = X^T X`` (X: the layer's float inputs on the fit samples,
[samples * positions, K]), so that ``|X W - X Q|`` stays small:

    U = cholesky(inverse(H + damp I)) (upper)
    for k in 0 .. K-1:  Q[k] = round(W[k] / s);  e = (W[k] - s Q[k]) / U[k, k];
                        W[k+1:] -= U[k, k+1:]^T e

``s`` are the per-output-channel scales quantize computes anyway (qtool.qparams), so only the
integers change, never the scales or the model's form. ``damp`` is 1% of H's mean diagonal; the
rows go in the order of H's diagonal, largest first (GPTQ's act-order).

The layers: MatMul and Gemm whose weight is a constant matrix (transformers' dense layers), and
depthwise Convs (one input channel per group, 2-D) with int16 activations: each output channel
is a layer of its own whose ``K`` inputs are the kh x kw taps of its input channel, ``H`` summed
over the windows of the fit samples (padding included; at most ``WINDOW_POSITIONS`` output
positions a sample, spread over the map). A depthwise kernel often sums to almost nothing (an
edge filter: PP-OCRv4 rec's second conv has a channel of taps up to 8.3 summing to 0.004), so
nearest rounding can change its sum tenfold, and every window's common level (the brightness of
the line) leaks into the output; fitted rounding keeps the taps' sum where the inputs move
together. With int8 activations they keep nearest rounding: on the zoo and bench models with
depthwise Convs (PP-OCRv4/v6 rec and det, PicoDet, PP-LCNet orientation) the judge kept it on 2
of 8, which then scored +2.7 dB (orientation) and -0.85 dB (PP-OCRv6 rec) on their evaluation
samples, and the second bias correction it needs costs every one of them (PicoDet's ``quantize
--data`` 35 -> 53 s, PP-OCRv4 rec's 9 -> 13 s).

Convs of group 1 with int16 activations too: ``K`` = C x kh x kw, the windows of every input
channel side by side, ``H`` over the same output positions, damped ten times more than a dense
layer (``CONV_DAMP``). With int16 activations the 8-bit weights are what is left of the error
(PP-OCRv4 rec: every Conv's weights int8 14.3 dB, on an int16 grid 42.6 dB, before bias
correction), and fitted on its windows each Conv's output error falls on other samples (PP-OCRv4
rec, per Conv: 1-7 dB after the mean error is removed). A Conv with no more rows (fit samples x
positions) than inputs keeps nearest rounding: an SE block's 1 x 1 convs read one row a sample,
and fitted on 16 lost up to 25 dB of their output on other samples.

Bias correction follows a fitted depthwise Conv: the rounding moves the error of the mean output,
and the correction removes it. So where bias correction is on and depthwise Convs are fitted,
the two models are judged each after its own correction (``qtool.recipe``): uncorrected, the
scores can rank them the wrong way round (PP-OCRv6 rec at int16: nearest 13.70 -> fitted 13.80
dB uncorrected, 28.79 -> 29.60 dB corrected). The rounding is judged like every data-driven
step: the model with it scored on held-out samples against the model without, and kept only
where at least ``GAIN_DB`` higher there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar, NamedTuple

import numpy as np
import onnx

from .analyze import Evaluator
from .model import FloatRunner, prepare_file
from .qparams import per_channel_symmetric, symmetric
from .quantize import quantize
from .report import finite, progress_bar
from .search import JudgedStep
from .table import Table

DAMP = 0.01
# a group-1 Conv's damping: its Gram matrix comes from a few samples' windows, and GPTQ moves the
# rounding error into the directions they leave weak; held out (bench/transformers.py held.npz,
# --activation-type int16 --data), PP-OCRv4 rec 27.4 / 27.4 / 34.7 / 29.8 dB at 0.01 / 0.03 / 0.1 /
# 1.0, PP-OCRv6 small rec 28.9 / 33.4 / 32.2 dB at 0.01 / 0.1 / 1.0 (chosen there: on lines used for
# no choice, before -> after fitting at 0.1, logits 27.23 -> 27.14 and 28.35 -> 32.01 dB)
CONV_DAMP = 0.1
GRAM_BYTES = 128 << 20  # the Gram matrices one pass over the fit samples holds at once (_gram_groups)
# a layer of more inputs keeps nearest rounding: its Gram alone is GRAM_BYTES, and GPTQ holds a few
# copies of it (inverse, Cholesky factor); a VGG16 head's 25088 inputs (a 5 GB Gram) took a
# quantize --data to 20 GB and a crash. No zoo or bench layer has more than 2880.
MAX_INPUTS = 4096
# the held-out gain that keeps fitted rounding: on PP-OCRv4 rec it scored 0.04 dB higher on 16
# judging samples and 0.75 dB lower on the job's evaluation set; a gain that small is noise
GAIN_DB = 0.5


@dataclass(frozen=True)
class Rounded:
    """A weight's integers and the scales they were fitted on."""

    scale: np.ndarray
    values: np.ndarray  # int8, the weight's shape


class SharedWeight(NamedTuple):
    """The sum key of a weight several dense layers read: one Gram summed over all of them."""

    weight: str


class Layer(NamedTuple):
    """A layer whose weight rounding is fitted: its input, its weight and how it reads the input."""

    x: str
    weight: str
    transposed: bool = False  # a Gemm's transB: the weight is [N, K]
    depthwise: tuple | None = None  # a depthwise Conv's (pads, strides, dilations); weight [C, 1, kh, kw]
    conv: tuple | None = None  # a Conv of group 1: (pads, strides, dilations); weight [N, C, kh, kw]
    kernel: tuple = ()  # a Conv's (kh, kw): its windows' size

    @property
    def gram_key(self):
        """Layers of one key read the same rows: one Gram matrix serves them (two Convs reading one
        input with the same pads and strides but other kernels do not: oskut's 1x1 and 1x2)."""
        if self.conv is not None:
            return (self.x, "conv", self.conv, self.kernel)
        return self.x if self.depthwise is None else (self.x, self.depthwise, self.kernel)

    def sum_key(self, shared: frozenset = frozenset()):
        """Where its Gram is summed: its ``gram_key``'s, or for a weight several dense layers read
        (``shared``: an unrolled recurrence's steps) one sum over all of their inputs' rows."""
        return SharedWeight(self.weight) if self.weight in shared else self.gram_key


FITTED_AUTO_PAD = (b"NOTSET", b"VALID", b"", "NOTSET", "VALID")  # a Conv's own pads, or none (VALID)


def layers(model: onnx.ModelProto) -> dict[str, Layer]:
    """node name -> ``Layer`` of each MatMul/Gemm whose weight is a 2-D constant and of each 2-D
    Conv, depthwise (a constant weight [C, 1, kh, kw]) or of one group ([N, C, kh, kw]), with
    explicit pads (or auto_pad VALID: none)."""
    inits = {i.name: i for i in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm", "Conv") or len(node.input) < 2 or node.input[1] not in inits:
            continue
        if node.input[0] in inits:
            continue
        dims = list(inits[node.input[1]].dims)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Conv":
            pad = attrs.get("auto_pad", b"NOTSET")
            if len(dims) != 4 or pad not in FITTED_AUTO_PAD:
                continue
            geometry = (tuple(attrs.get("pads", (0, 0, 0, 0))), tuple(attrs.get("strides", (1, 1))),
                        tuple(attrs.get("dilations", (1, 1))))
            if attrs.get("group", 1) == 1:
                found[node.name] = Layer(node.input[0], node.input[1], conv=geometry, kernel=tuple(dims[2:]))
            elif dims[1] == 1:
                found[node.name] = Layer(node.input[0], node.input[1], depthwise=geometry, kernel=tuple(dims[2:]))
            continue
        if len(dims) != 2 or attrs.get("transA", 0):
            continue
        found[node.name] = Layer(node.input[0], node.input[1], bool(attrs.get("transB", 0)))
    return found


def _nothing_to_fit(model: onnx.ModelProto, options) -> str:
    """Why ``layers`` gives ``fit`` nothing: no MatMul/Gemm of a constant weight, and the Convs with
    int16 activations, if any, none of the kind it takes."""
    wide = [n for n in model.graph.node if n.op_type == "Conv" and _int16(options, n)]
    if not wide:
        return "no MatMul or Gemm with a constant weight, no Conv with int16 activations"
    auto = sum(any(a.name == "auto_pad" and a.s not in FITTED_AUTO_PAD for a in n.attribute) for n in wide)
    told = ("; it sets auto_pad" if len(wide) == 1 else f"; {auto} of them set auto_pad") if auto else ""
    which = "the Conv with int16 activations is not" if len(wide) == 1 else \
        f"none of the {len(wide)} Convs with int16 activations is"
    return (f"no MatMul or Gemm with a constant weight, and {which} one it fits: 2-D, a constant weight, group 1 "
            f"or depthwise, explicit pads or VALID{told}")


def _int16(options, node: onnx.NodeProto) -> bool:
    """The node's activations are int16 (``--activation-type int16``, or the node or its op type
    given int16)."""
    return options.activation_type == "int16" or node.name in options.int16 or node.op_type in options.int16


def gptq(weight: np.ndarray, scale: np.ndarray, gram: np.ndarray, qmin: int = -128, qmax: int = 127,
         damp: float = DAMP) -> np.ndarray:
    """The integers of ``weight`` [K, N] with per-column ``scale`` [N] (or one), rounded row by row
    with each row's error moved onto the later rows through the Gram matrix ``gram`` [K, K]; or
    of a stack of such layers, each with its own Gram matrix (``weight`` [B, K, N], ``scale``
    [B, N], ``gram`` [B, K, K]: a depthwise Conv's channels)."""
    single = np.ndim(gram) == 2
    w = np.array(weight, dtype=np.float64)
    h = np.array(gram, dtype=np.float64)
    if single:
        w, h = w[None], h[None]
    s = np.broadcast_to(np.asarray(scale, dtype=np.float64), (w.shape[0], w.shape[2]))
    batch, rows = np.nonzero(np.diagonal(h, axis1=1, axis2=2) == 0)  # inputs always zero: weights that do not matter
    h[batch, rows, rows] = 1.0
    w[batch, rows] = 0.0
    diag = np.diagonal(h, axis1=1, axis2=2).copy()
    h += (damp * diag.mean(axis=1))[:, None, None] * np.eye(h.shape[1])
    order = np.argsort(-diag, axis=1, kind="stable")  # the inputs of most energy first (act-order)
    w = np.take_along_axis(w, order[:, :, None], axis=1)
    h = np.take_along_axis(np.take_along_axis(h, order[:, :, None], axis=1), order[:, None, :], axis=2)
    u = np.linalg.cholesky(np.linalg.inv(h)).transpose(0, 2, 1)  # upper: inverse(h) = u^T u
    q = np.empty(w.shape, dtype=np.int64)
    for k in range(w.shape[1]):
        q[:, k] = np.clip(np.rint(w[:, k] / s), qmin, qmax)
        error = (w[:, k] - q[:, k] * s) / u[:, k, k, None]
        w[:, k + 1:] -= u[:, k, k + 1:, None] * error[:, None, :]
    out = np.empty_like(q)
    np.put_along_axis(out, order[:, :, None], q, axis=1)
    return out[0] if single else out


WINDOW_VALUES = 1 << 22  # float64 window values a depthwise layer's Gram adds at once (32 MiB)
# a sample's output positions whose windows a depthwise layer's Gram takes, at most (spread over
# the map): a 9 x 9 Gram is settled long before the 30,000 positions of a detector's first maps
WINDOW_POSITIONS = 512


def windows(x: np.ndarray, kernel: tuple[int, int], depthwise: tuple) -> np.ndarray:
    """The kh x kw windows a depthwise Conv reads in ``x`` [n, C, H, W] (zero padding), at most
    ``WINDOW_POSITIONS`` of a sample's output positions spread evenly over them: [C, n * L,
    kh * kw] float64, L the output positions taken."""
    (top, left, bottom, right), (stride_h, stride_w), (dilation_h, dilation_w) = depthwise
    kh, kw = kernel
    x = np.pad(np.asarray(x).transpose(1, 0, 2, 3), ((0, 0), (0, 0), (top, bottom), (left, right)))
    out_h = (x.shape[2] - dilation_h * (kh - 1) - 1) // stride_h + 1
    out_w = (x.shape[3] - dilation_w * (kw - 1) - 1) // stride_w + 1
    taken = np.arange(out_h * out_w)
    if taken.size > WINDOW_POSITIONS:
        taken = np.linspace(0, taken.size - 1, WINDOW_POSITIONS).round().astype(np.int64)
    corner = (taken // out_w) * stride_h * x.shape[3] + (taken % out_w) * stride_w  # in the padded plane
    plane = x.reshape(x.shape[:2] + (-1,))
    found = np.empty(x.shape[:2] + (taken.size, kh * kw))  # [C, n, L, k]
    for i in range(kh):
        for j in range(kw):
            found[..., i * kw + j] = np.take(plane, corner + i * dilation_h * x.shape[3] + j * dilation_w, axis=2)
    return found.reshape(x.shape[0], -1, kh * kw)


def grams(float_model: onnx.ModelProto, found: dict[str, Layer], batches, shared: frozenset = frozenset()) -> dict:
    """``X^T X`` of each layer's input rows over ``batches`` (float64, summed batch by batch), by
    ``Layer.sum_key``: [K, K], or [C, k, k] per input channel of a depthwise layer; and a Conv's
    rows under ``("rows", key)`` (its Gram left out where they are fewer than its inputs). A
    weight of ``shared`` (dense layers only) gets one sum, over every layer that reads it."""
    inits = {i.name: i for i in float_model.graph.initializer}
    readers: dict = {}  # sum key -> the layers whose rows it adds: one a gram key, each of a shared weight's
    for layer in found.values():
        key = layer.sum_key(shared)
        if key not in readers or isinstance(key, SharedWeight):
            readers.setdefault(key, []).append(layer)
    # without the blocked convs, whose sums differ between CPUs: the integers go into the model
    runner = FloatRunner(float_model, sorted({layer.x for layer in found.values()}), layouts=False)
    sums: dict = {}
    # the samples in all (a depthwise layer's ``samples`` below are a chunk's)
    total, too_few = getattr(batches, "samples", None), set()
    for feeds in batches:
        values = runner.run(feeds)
        for key, layer in ((key, layer) for key, layers_ in readers.items() for layer in layers_):
            x = np.asarray(values[layer.x])
            if layer.conv is not None:  # every input channel's windows side by side: [rows, C * kh * kw]
                kernel = tuple(inits[layer.weight].dims[2:])
                for i in range(x.shape[0]):
                    if key in too_few:
                        break
                    win = windows(x[i:i + 1], kernel, layer.conv)
                    if key not in sums and total is not None and win.shape[1] * total < win.shape[0] * win.shape[2]:
                        # fewer rows in all than inputs: it keeps nearest rounding (fit), no Gram needed
                        too_few.add(key)
                        sums[("rows", key)] = win.shape[1] * total
                        break
                    rows = win.transpose(1, 0, 2).reshape(win.shape[1], -1)
                    sums[key] = sums.get(key, 0.0) + rows.T @ rows
                    sums[("rows", key)] = sums.get(("rows", key), 0) + rows.shape[0]
                continue
            if layer.depthwise is None:
                rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
                sums[key] = sums.get(key, 0.0) + rows.T @ rows
                sums[("rows", key)] = sums.get(("rows", key), 0) + rows.shape[0]
                continue
            kernel = tuple(inits[layer.weight].dims[2:])
            k = kernel[0] * kernel[1]
            gram = sums.setdefault(key, np.zeros((x.shape[1], k, k)))
            plane = min(x[0, 0].size, WINDOW_POSITIONS) * k  # one sample's windows of one channel, about
            samples = max(1, WINDOW_VALUES // max(1, plane * x.shape[1]))
            channels = max(1, WINDOW_VALUES // max(1, plane * samples))
            for i in range(0, x.shape[0], samples):
                for c in range(0, x.shape[1], channels):
                    rows = windows(x[i:i + samples, c:c + channels], kernel, layer.depthwise)
                    gram[c:c + channels] += np.matmul(rows.transpose(0, 2, 1), rows)
    return sums


def _inputs(layer: Layer, inits: dict) -> int:
    """``K``: the inputs of one output of ``layer`` (a depthwise Conv's: of one channel)."""
    dims = list(inits[layer.weight].dims)
    if layer.conv is not None or layer.depthwise is not None:
        return int(np.prod(dims[1:]))
    return dims[1] if layer.transposed else dims[0]


def _gram_groups(found: dict[str, Layer], inits: dict, shared: frozenset = frozenset()) -> list[dict[str, Layer]]:
    """``found`` in groups whose Gram matrices (float64) together hold at most ``GRAM_BYTES``, in
    graph order, the layers of one ``Layer.sum_key`` in one group: each group is one pass over the
    fit samples (YOLOX's 69 Convs hold 208 MB of Gram matrices, a ResNet-50's several GB)."""
    size: dict = {}
    for layer in found.values():
        k = _inputs(layer, inits)
        channels = inits[layer.weight].dims[0] if layer.depthwise is not None else 1
        size[layer.sum_key(shared)] = channels * k * k * 8
    groups: list[dict[str, Layer]] = []
    held, placed = 0, {}
    for name, layer in found.items():
        key = layer.sum_key(shared)
        if key not in placed:
            if groups and held + size[key] <= GRAM_BYTES:
                held += size[key]
            else:
                groups.append({})
                held = size[key]
            placed[key] = len(groups) - 1
        groups[placed[key]][name] = layer
    return groups


def _fittable(model: onnx.ModelProto, found: dict[str, Layer], inits: dict
              ) -> tuple[dict[str, Layer], frozenset, int, int]:
    """``found`` less the layers that keep nearest rounding: those of more than ``MAX_INPUTS``
    inputs, and those whose weight another node reads too, unless every reader is a dense layer
    (MatMul/Gemm) reading it the same way: then the weight is fitted once, on the sum of their
    Grams (the weights so shared are returned). With the two counts."""
    wide = {name for name, layer in found.items() if _inputs(layer, inits) > MAX_INPUTS}
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            if name in inits:
                readers.setdefault(name, set()).add(node.name)
    kept = {name: layer for name, layer in found.items() if name not in wide}
    apart, shared = set(), set()
    for weight in {layer.weight for layer in kept.values()}:
        names = readers.get(weight, set())
        if len(names) < 2:
            continue
        kinds = {(kept[n].transposed, kept[n].depthwise, kept[n].conv) for n in names if n in kept}
        if names <= set(kept) and kinds in ({(False, None, None)}, {(True, None, None)}):
            shared.add(weight)
        else:
            apart |= {n for n in names if n in kept}
    return ({name: layer for name, layer in kept.items() if name not in apart}, frozenset(shared),
            len(wide), len(apart))


def _left_nearest(pick) -> str:
    """For the report: the layers ``_fittable`` left nearest."""
    parts = []
    if pick.too_wide:
        parts.append(f"{pick.too_wide} of more than {MAX_INPUTS} inputs")
    if pick.shared_apart:
        parts.append(f"{pick.shared_apart} whose weight other nodes read in other ways")
    return "layers left nearest: " + " and ".join(parts)


def _fitted(layer: Layer, w: np.ndarray, qp, gram: np.ndarray) -> np.ndarray:
    """The integers of ``w`` (the weight as stored) fitted on ``gram``."""
    if layer.conv is not None:
        q = gptq(w.reshape(w.shape[0], -1).T, qp.scale, gram, qp.qmin, qp.qmax, CONV_DAMP)
        return q.T.reshape(w.shape)
    if layer.depthwise is None:
        kn = w.T if layer.transposed else w  # [K, N]
        q = gptq(kn, qp.scale, gram, qp.qmin, qp.qmax)
        return q.T if layer.transposed else q
    c_out, k = w.shape[0], w.shape[2] * w.shape[3]
    per_group = c_out // gram.shape[0]  # a depthwise Conv's output channels per input channel
    scale = np.broadcast_to(np.asarray(qp.scale, dtype=np.float64).reshape(-1), (c_out,))
    # each output channel is a layer of its own, reading its input channel's windows
    q = gptq(w.reshape(c_out, k, 1), scale[:, None], np.repeat(gram, per_group, axis=0), qp.qmin, qp.qmax)
    return q.reshape(w.shape)


@dataclass
class RoundingPick(JudgedStep):
    BEFORE: ClassVar[str] = "nearest"
    AFTER: ClassVar[str] = "fitted"
    layers: int = 0  # MatMul/Gemm layers
    depthwise: int = 0  # depthwise Conv layers
    convs: int = 0  # Convs of group 1 (int16 activations, more rows than inputs)
    gain_db: float = GAIN_DB
    corrected: bool = False  # judged after bias correction (each model its own)
    # with Convs of group 1 and other layers fitted: the held-out SQNR with the Convs fitted too and
    # with them left nearest (None: not scored), and whether the latter is the fitted one judged
    with_convs_db: float | None = None
    without_convs_db: float | None = None
    convs_nearest: bool = False
    too_wide: int = 0  # layers of more than MAX_INPUTS inputs, left nearest
    shared_apart: int = 0  # layers whose weight other nodes read too, in other ways: left nearest
    few_rows: int = 0  # dense layers with fewer rows on the fit samples than inputs, left nearest
    shared_weights: int = 0  # weights several dense layers read, fitted on the sum of their Grams
    shared_layers: int = 0  # the layers that read them

    @property
    def variant(self) -> str:
        """The key of the fitted model judged (its bias correction's, in ``corrected_judge``)."""
        return "fitted without convs" if self.convs_nearest else "fitted"

    def to_dict(self) -> dict:
        return {"layers": self.layers, "depthwise": self.depthwise, "convs": self.convs,
                "after_bias_correction": self.corrected,
                "heldout_with_convs_sqnr_db": None if self.with_convs_db is None else finite(self.with_convs_db),
                "heldout_without_convs_sqnr_db": None if self.without_convs_db is None else finite(
                    self.without_convs_db), "convs_left_nearest": self.convs_nearest,
                "too_wide": self.too_wide, "max_inputs": MAX_INPUTS, "shared_apart": self.shared_apart,
                "few_rows": self.few_rows,
                "shared_weights": self.shared_weights, "shared_layers": self.shared_layers,
                **self.judged_dict()}


def fit(model_path, table: Table, options, table_name: str, data_path, num_samples: int | None = None,
        batch_size: int = 8, progress: bool = True, preprocess=None, holdout: int | None = None,
        channel_ranges=None, corrected_judge=None) -> tuple[dict[str, Rounded] | None, RoundingPick]:
    """The fitted integers of every MatMul/Gemm weight, and of every Conv's (depthwise, or of one
    group with more rows than inputs) whose activations are int16 (see the module's docstring),
    or None where they do not score higher on the held-out samples (or there is nothing to fit or
    judge). ``corrected_judge(rounded or None, key) -> dB``: bias correction follows, and scores a
    model (nearest rounding for None) with its own correction, kept under ``key``; it judges where
    Convs are fitted (elsewhere, or without it, the models are scored as quantized). Convs of one
    group are judged apart too: the better of the fitted model with and without them is the one
    judged against nearest (``RoundingPick.variant``)."""
    start = time.perf_counter()
    pick = RoundingPick()
    float_model = prepare_file(model_path)
    nodes = {node.name: node for node in float_model.graph.node}
    found = {name: layer for name, layer in layers(float_model).items()
             if (layer.depthwise is None and layer.conv is None) or _int16(options, nodes[name])}
    if not found:
        pick.reason = _nothing_to_fit(float_model, options)
        return None, pick
    inits = {i.name: i for i in float_model.graph.initializer}
    found, shared, pick.too_wide, pick.shared_apart = _fittable(float_model, found, inits)
    pick.shared_weights = len(shared)
    pick.shared_layers = sum(layer.weight in shared for layer in found.values())
    pick.depthwise = sum(layer.depthwise is not None for layer in found.values())
    pick.layers = sum(layer.depthwise is None and layer.conv is None for layer in found.values())
    if not found:
        pick.reason = _left_nearest(pick)
        return None, pick
    fit_batches, held = pick.split(float_model, data_path, num_samples, holdout, batch_size, preprocess, start)
    if held is None:
        return None, pick
    rounded: dict[str, Rounded] = {}
    conv_weights: set[str] = set()
    pick.convs = 0
    with progress_bar(len(found), "weight rounding", progress, unit="layer") as bar:
        for group in _gram_groups(found, inits, shared):  # one pass over the fit samples each
            sums = grams(float_model, group, fit_batches, shared)
            by_weight: dict[str, list[Layer]] = {}
            for layer in group.values():
                by_weight.setdefault(layer.weight, []).append(layer)
            for weight, readers in by_weight.items():
                layer, key = readers[0], readers[0].sum_key(shared)
                # a Conv or dense layer whose rows do not outnumber its inputs K (C kh kw) keeps
                # nearest rounding: its Gram is singular, and the fit moves the error where the fit
                # samples do not look (an SE block's 1 x 1 convs see one row a sample: fitted on 16,
                # PP-OCRv4 rec's lost 25 dB of their output on other lines; a classifier's head or
                # a dense layer applied to one vector a step, oskut's 200-input Dense read by 16
                # steps of 8 samples: 37.5 -> 21.1 dB held out)
                if layer.depthwise is None and sums[("rows", key)] < _inputs(layer, inits):
                    pick.few_rows += len(readers) if layer.conv is None else 0
                    bar.update(len(readers))
                    continue
                pick.convs += len(readers) if layer.conv is not None else 0
                if layer.conv is not None:
                    conv_weights.add(weight)
                w = onnx.numpy_helper.to_array(inits[weight]).astype(np.float32)
                axis = 0 if layer.transposed or layer.depthwise is not None or layer.conv is not None else 1
                qp = per_channel_symmetric(w, axis) if options.per_channel else \
                    symmetric(float(np.abs(w).max(initial=0.0)), "int8")
                # a weight read by several layers (an unrolled recurrence's steps): their outputs'
                # errors add, so it is fitted on the sum of their Grams (the first step alone
                # reads a zero state, whose Gram says its weights do not matter)
                q = _fitted(layer, w, qp, sums[key])
                rounded[weight] = Rounded(np.asarray(qp.scale), q.astype(np.int8))
                bar.update(len(readers))
            del sums
    if not rounded:
        pick.reason = "no Conv, MatMul or Gemm with more rows on the fit samples than inputs" + (
            f"; {_left_nearest(pick)}" if pick.too_wide or pick.shared_apart else "")
        pick.seconds = time.perf_counter() - start
        return None, pick
    pick.heldout = held.samples
    if corrected_judge is not None and pick.depthwise + pick.convs > 0:
        pick.corrected = True
        nearest_db, fitted_db = corrected_judge(None, "nearest"), corrected_judge(rounded, "fitted")
        others = {w: r for w, r in rounded.items() if w not in conv_weights}
        if pick.convs and others:
            # the Convs judged apart from the other layers: on the ViT-S saliency model its patch
            # embedding fitted too scored 37.11 dB where the MatMuls alone scored 37.97 (held out
            # 44.64 against 45.12 dB)
            pick.with_convs_db = fitted_db
            pick.without_convs_db = corrected_judge(others, "fitted without convs")
            if pick.without_convs_db > fitted_db:
                rounded, fitted_db, pick.convs_nearest = others, pick.without_convs_db, True
        pick.judge(nearest_db, fitted_db)
    else:
        evaluator = Evaluator(float_model, held)
        pick.scored = evaluator.scored
        plain = replace(options, format="qdq", strict=False)
        pick.judge(*evaluator.sqnrs(
            quantize(model_path, table, plain, table_name, channel_ranges=channel_ranges, scored_only=True)[0],
            quantize(model_path, table, plain, table_name, None, rounded, channel_ranges, scored_only=True)[0]))
    pick.seconds = time.perf_counter() - start
    return (rounded if pick.kept else None), pick
