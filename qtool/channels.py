"""One scale and zero point per channel for the activations that can take them (``quantize --data``).

A tensor quantized per tensor gets one step for all its channels; where the channels' ranges
differ by 100x (a depthwise block's first convolution after BatchNorm folding: PicoDet's channels
reach 0.2 and 44), the small ones are a few steps or none, and a depthwise Conv after them, which
reads each channel alone, cannot recover them. QuantizeLinear and DequantizeLinear take ``axis``
(a scale and zero point per channel), and the integer kernels take one (S, Z) per channel exactly
where the arithmetic stays per channel:

* a Conv's output: the requantization is per output channel anyway (``M_c = S_x S_w[c] / S_y[c]``,
  the zero point ``Z_y[c]`` folded into the offset);
* an elementwise lookup (HardSwish, Sigmoid, Tanh, GELU, ...): one 256-entry table per channel;
* a depthwise Conv's input (one input channel per group): ``M_c = S_x[c] S_w[c] / S_y``; its
  channels share one zero point (each is symmetric about it), which is what padding fills with.

So the candidates are the tensors made by a Conv or a lookup and read only by lookups and
depthwise Convs (``candidates``); a pointwise Conv, an Add or a Concat reading a tensor needs one
scale for the whole of it. The step (``fit``) measures each candidate's per-channel min and max on
the fit samples (inside onnxruntime: two small reductions a tensor), clips them to the table's
range for the tensor (the calibration method's clipping stays), and keeps the per-channel model
only where it scores at least ``GAIN_DB`` higher than the per-tensor one on the held-out samples.
Kept, the ranges are measured again on all of DATA, as the method choice calibrates its chosen
method again: a channel the fit samples barely reach is then not cut short on the others
(PicoDet on the zoo's evaluation images: every output 0.2-1.3 dB higher than with the fit
samples' ranges).
QDQ for the portable target only: QLinearConv and the x86 forms take one input scale.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import onnx
from onnx import helper

from .analyze import Evaluator
from .data import load_dataset
from .errors import QtoolError
from .model import FloatRunner, first_line, prepare_file
from .ops import REGISTRY
from .ops.lut import LookupTable
from .quantize import quantize
from .report import progress_bar
from .search import JudgedStep
from .sizing import fixed_batch
from .table import Table
from .targets import DEFAULT_TARGET

GAIN_DB = 0.5  # as fitted weight rounding: a smaller held-out gain is within the noise of 16 samples


def _lookup(node: onnx.NodeProto) -> bool:
    op = REGISTRY.get(node.op_type)
    return node.domain in ("", "ai.onnx") and isinstance(op, LookupTable)


def _depthwise(node: onnx.NodeProto, tensor: str, inits: dict) -> bool:
    """``node`` is a Conv reading ``tensor`` as its input with one input channel per group."""
    if node.op_type != "Conv" or node.input[0] != tensor or len(node.input) < 2 or node.input[1] not in inits:
        return False
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    weight = inits[node.input[1]]
    return len(weight.dims) >= 3 and weight.dims[1] == 1 and group > 1 and tensor not in node.input[1:]


def candidates(model: onnx.ModelProto) -> list[str]:
    """The main graph's tensors that may take one (S, Z) per channel (see the module's note), in
    graph order."""
    inits = {i.name: i for i in model.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in set(node.input):
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in model.graph.output}
    found = []
    for node in model.graph.node:
        if not (node.op_type == "Conv" or _lookup(node)) or not node.output or not node.output[0]:
            continue
        t = node.output[0]
        users = readers.get(t, [])
        if t in outputs or not users:
            continue
        if all((_lookup(u) and u.input[0] == t) or _depthwise(u, t, inits) for u in users):
            found.append(t)
    return found


def channel_ranges(float_model: onnx.ModelProto, tensors: list[str], batches, progress: bool = True,
                   count: int | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-channel (axis 1) min and max of ``tensors`` over ``batches`` (``count`` of them where
    they come as a generator), reduced inside onnxruntime: each tensor leaves the session as two
    vectors of its channels. Minima and maxima: the same whatever the batches' sizes."""
    model = onnx.ModelProto()
    model.CopyFrom(float_model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    shape = helper.make_tensor("qtool_channels_shape", onnx.TensorProto.INT64, [3], [0, 0, -1])
    model.graph.initializer.append(shape)
    names = []
    for k, t in enumerate(tensors):
        flat = f"qtool_channels_{k}_flat"
        model.graph.node.append(helper.make_node("Reshape", [t, shape.name], [flat]))
        for op in ("ReduceMin", "ReduceMax"):
            out = f"qtool_channels_{k}_{op}"
            if opset >= 18:
                axes = "qtool_channels_axes"
                if k == 0 and op == "ReduceMin":
                    model.graph.initializer.append(helper.make_tensor(axes, onnx.TensorProto.INT64, [2], [0, 2]))
                model.graph.node.append(helper.make_node(op, [flat, axes], [out], keepdims=0))
            else:
                model.graph.node.append(helper.make_node(op, [flat], [out], keepdims=0, axes=[0, 2]))
            names.append(out)
    runner = FloatRunner(model, names, layouts=False)  # the ranges go into the model: the same on every CPU
    lo: dict[str, np.ndarray] = {}
    hi: dict[str, np.ndarray] = {}
    with progress_bar(len(batches) if count is None else count, "channel ranges", progress, unit="batch") as bar:
        for feeds in batches:
            values = runner.run(feeds, names)
            for k, t in enumerate(tensors):
                a, b = (np.asarray(values[f"qtool_channels_{k}_{op}"], np.float64) for op in ("ReduceMin", "ReduceMax"))
                lo[t] = a if t not in lo else np.minimum(lo[t], a)
                hi[t] = b if t not in hi else np.maximum(hi[t], b)
            bar.update(1)
    return {t: (lo[t], hi[t]) for t in tensors if t in lo}


@dataclass
class ChannelPick(JudgedStep):
    BEFORE: ClassVar[str] = "per_tensor"
    AFTER: ClassVar[str] = "per_channel"
    tensors: int = 0
    gain_db: float = GAIN_DB
    all_samples: bool = False  # kept: the ranges measured again on all of DATA

    def to_dict(self) -> dict:
        return {"tensors": self.tensors, **self.judged_dict(), "ranges_from_all_samples": self.all_samples}


def not_applicable(options) -> str:
    """Why the step does not apply to ``options``, or ''."""
    if options.format != "qdq":
        return "QOperator's QLinearConv takes one input scale"
    if options.target != DEFAULT_TARGET:
        return f"the {options.target} target's forms take one scale a tensor"
    if options.activation_type == "int16":
        return "int16 activations"
    if options.symmetric:
        return "--symmetric"
    return ""


def wanted(model_path, options) -> list[str]:
    """The candidates of MODEL where the step applies to ``options``, else none: what an earlier
    pass over all of DATA can measure for ``fit`` (``measured``)."""
    return [] if not_applicable(options) else candidates(prepare_file(model_path))


def fit(model_path, table: Table, options, table_name: str, data_path, num_samples: int | None = None,
        batch_size: int = 8, progress: bool = True, preprocess=None, holdout: int | None = None,
        measured: dict | None = None, measured_fit: dict | None = None) -> tuple[dict | None, ChannelPick]:
    """Per-channel ranges for the candidates of MODEL (see the module's note), or None where the
    per-channel model does not score ``GAIN_DB`` higher on the held-out samples (or the step does
    not apply). ``measured``: per-channel ranges over all of DATA that an earlier pass took (the
    method choice's calibration, ``wanted``): kept, the ranges come from there where it has
    every tensor, instead of a pass of their own; ``measured_fit`` likewise, over the fit samples
    (the same split: ``JudgedStep.split``)."""
    start = time.perf_counter()
    pick = ChannelPick()
    pick.reason = not_applicable(options)
    if pick.reason:
        return None, pick
    float_model = prepare_file(model_path)
    found = [t for t in candidates(float_model) if t in table.tensors]
    pick.tensors = len(found)
    if not found:
        pick.reason = "no activation made by a Conv or a lookup and read only by lookups and depthwise Convs"
        return None, pick
    fit_batches, held = pick.split(float_model, data_path, num_samples, holdout, batch_size, preprocess, start)
    if held is None:
        return None, pick
    try:
        if measured_fit and all(t in measured_fit for t in found):
            ranges = {t: measured_fit[t] for t in found}
        else:
            ranges = channel_ranges(float_model, found, fit_batches, progress)
    except QtoolError:
        raise
    except Exception as e:  # onnxruntime on the model with the reductions added
        raise QtoolError(f"channel scales: onnxruntime failed: {first_line(e)}") from None
    judge = Evaluator(float_model, held)
    pick.heldout, pick.scored = held.samples, judge.scored
    plain = replace(options, strict=False)
    pick.judge(*judge.sqnrs(quantize(model_path, table, plain, table_name, scored_only=True)[0],
                            quantize(model_path, table, plain, table_name, channel_ranges=ranges,
                                     scored_only=True)[0]))
    if pick.kept:
        if measured and fixed_batch(float_model) is None and all(t in measured for t in ranges):
            ranges = {t: measured[t] for t in ranges}  # the same numbers (tests/test_channels.py)
        else:
            ranges = _on_all(float_model, list(ranges), data_path, batch_size, preprocess, progress)
        pick.all_samples = True
    pick.seconds = time.perf_counter() - start
    return (ranges if pick.kept else None), pick


def _on_all(float_model: onnx.ModelProto, tensors: list[str], data_path, batch_size: int, preprocess,
            progress: bool) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``channel_ranges`` over all of DATA, its batches read as they come (whole batches of the
    model's own size where its batch dim is fixed)."""
    data = load_dataset(data_path, float_model, preprocess)
    size = fixed_batch(float_model) or batch_size
    total = len(data) - len(data) % size if fixed_batch(float_model) else len(data)
    try:
        return channel_ranges(float_model, tensors, data.batches(size, total), progress, count=-(-total // size))
    except QtoolError:
        raise
    except Exception as e:  # onnxruntime on the model with the reductions added
        raise QtoolError(f"channel scales: onnxruntime failed: {first_line(e)}") from None
