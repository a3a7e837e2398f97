"""``qtool exec`` as a library call: run a quantized model on the integer-only executor over a
dataset and write its outputs to an ``.npz`` as they come (memory does not grow with the samples).

How samples are batched: on each array's first axis, ``batch_size`` at a time (chosen from the
memory budget when None, started again one at a time when a chosen size fails on its first batch).
Inputs that carry no sample axis (every array shaped exactly as its input) run once as they are;
states in and out whose samples lie on another axis run in one batch, written as they are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .batching import DEFAULT_MEMORY_MB, EXEC_BATCH_CAP, EXEC_FACTOR, EXEC_FACTOR_WIDE, OneAtATime, fixed_bytes
from .sizing import batch_is_chosen, default_batch, wide_activations
from .data import check_sampling, images_for, load_dataset, output_sample_axes
from .errors import DataError, QtoolError
from .executor import IntegerExecutor
from .fileio import NpzWriter
from .model import load_model
from .report import progress_bar


@dataclass
class ExecResult:
    steps: int  # executor steps
    integer_steps: int
    float_nodes: list  # (op type, node, reason) of what ran in float
    outputs: dict  # output name -> shape written ([samples, ...]); None for one written per sample
    per_sample: dict  # output name -> samples, for the outputs written as NAME/0, NAME/1, ...
    note: str = ""  # how the batch size was chosen, or why it fell to 1
    warnings: list = field(default_factory=list)  # image preprocessing given against recorded
    moved: dict = field(default_factory=dict)  # output name -> the axis its samples were on, written first


def execute(qmodel_path: str | Path, inputs: str | Path, output: str | Path, batch_size: int | None = None,
            memory_mb: int = DEFAULT_MEMORY_MB, target: str = "exact", images: dict | None = None,
            progress: bool = True) -> ExecResult:
    """Run ``qmodel_path`` over ``inputs`` (an .npz, a folder of samples or of images, preprocessed
    as the model records unless ``images``, Preprocess fields, say otherwise) and write its outputs
    to ``output`` (a path, or ``-`` for standard output); nothing is left at ``output`` on failure."""
    check_sampling(None, batch_size)
    model = load_model(qmodel_path)
    executor = IntegerExecutor(model, arithmetic=target)
    pre, warnings = images_for(model, inputs, images or {}, f"model file '{qmodel_path}'")
    data = load_dataset(inputs, model, pre)
    as_they_are = all(data.sample_axis(name) is None for name in executor.input_names) and not data.whole_samples
    chosen = batch_is_chosen(model, batch_size)
    factor = EXEC_FACTOR_WIDE if wide_activations(model) else EXEC_FACTOR
    batch_size, note = ((1, "") if as_they_are else
                        default_batch(model, data, batch_size, factor, memory_mb, EXEC_BATCH_CAP,
                                      held=fixed_bytes(0, os.path.getsize(qmodel_path))))
    # states in and out with their samples on another axis: one batch, written as it is
    one_batch = any(data.sample_axis(name) not in (0, None) for name in executor.input_names) \
        and any(axis != 0 for axis in output_sample_axes(model).values())
    if one_batch:
        batch_size, note = len(data), ""
    whole = as_they_are or one_batch
    chosen = chosen and not whole
    writer = NpzWriter(output, None if whole else len(data))
    # per_sample's: where each output's samples are, from the model where it declares them (so a
    # batch of one sample writes [T, C] per sample as a larger one does, not [T, 1, C])
    declared = {name: axis for name, axis in output_sample_axes(model).items() if axis}
    axes, moved = dict(declared), set()
    try:
        try:
            shapes = _batches(executor, data, batch_size, writer, whole, progress, chosen, axes, moved)
        except OneAtATime as retry:  # the batch size exec chose failed on its first batch
            writer.discard()
            batch_size, note = 1, retry.note
            writer = NpzWriter(output, None if whole else len(data))
            axes, moved = dict(declared), set()
            shapes = _batches(executor, data, 1, writer, whole, progress, False, axes, moved)
        per_sample = dict(writer.ragged)
        writer.close()
    except BaseException:
        writer.discard()
        raise
    for name in per_sample:
        shapes[name] = None
    return ExecResult(len(list(executor.all_steps())), sum(s.kind == "integer" for s in executor.all_steps()),
                      executor.float_nodes(), shapes, per_sample, note if len(data) > 1 else "", warnings,
                      {name: axes[name] for name in sorted(moved)})


def _batches(executor, data, batch_size: int, writer, whole: bool, progress: bool, chosen: bool,
             axes: dict, moved: set) -> dict:
    """Each batch's outputs to ``writer``: the outputs' shapes. A first batch of a ``chosen``
    size above 1 that fails raises ``OneAtATime``. ``axes``, ``moved``: per_sample's, filled in."""
    shapes, done = {}, 0  # (a disabled bar counts nothing)
    with progress_bar(len(data), "exec", progress) as bar:
        for feeds in data.batches(batch_size):
            n = data.samples_in(feeds)
            try:
                outputs = executor.run(feeds, pace=(n, max(0, len(data) - done - n))).outputs
                if data.whole_samples:  # each output whole, on a new first axis of samples
                    outputs = {name: np.asarray(value)[None] for name, value in outputs.items()}
                elif not whole:  # an output of no sample axis (a state [25]): one at a time too
                    outputs = per_sample(outputs, n, axes, moved)
            except QtoolError as e:
                if chosen and done == 0 and batch_size > 1 and n > 1 and not isinstance(e, DataError):
                    raise OneAtATime(batch_size, e, e.note if isinstance(e, Unsplittable) else "") from None
                raise
            shapes = {name: list(value.shape) if whole else [len(data), *value.shape[1:]]
                      for name, value in outputs.items()}
            writer.append(outputs)
            done += n
            bar.update(n)
    return shapes


def per_sample(outputs: dict, n: int, axes: dict | None = None, moved: set | None = None) -> dict:
    """A batch's outputs with the samples on the first axis: one sample's output whose first axis
    is not its batch of 1 (a sequence [T, 1, C]) gains a leading axis, one per sample, unless
    ``axes`` knows its sample axis (declared by the model, or seen in an earlier batch); an output
    of a larger batch whose one axis of that size is not the first (a state [2, N, 128], a
    time-major [T, N, C]) has it moved first, and ``axes`` (kept from batch to batch) remembers
    where, for a later batch whose size matches more than one axis; otherwise an output of a
    larger batch that does not lead with it cannot be split, a one-line error. ``moved`` gets the
    names of the outputs whose sample axis was moved first."""
    axes = {} if axes is None else axes
    shaped = {}
    for name, value in outputs.items():
        matching = [k for k, size in enumerate(np.shape(value)) if size == n]
        if n > 1 and name not in axes and len(matching) == 1:
            axes[name] = matching[0]
        if axes.get(name, 0) != 0 and axes[name] in matching:  # a batch of one too, once the axis is known
            shaped[name] = np.moveaxis(value, axes[name], 0)
            if moved is not None:
                moved.add(name)
        elif value.ndim and value.shape[0] == n:
            shaped[name] = value
        elif n == 1:
            shaped[name] = value[None]
        else:
            raise Unsplittable(name, list(value.shape), n)
    return shaped


class Unsplittable(QtoolError):
    """An output of a batch with no axis of the batch's samples (a state [25] beside frames)."""

    def __init__(self, name: str, shape: list, n: int):
        super().__init__(f"output '{name}' has shape {shape} for a batch of {n} samples, so exec cannot "
                         f"tell which part is whose; with --batch-size 1 each sample's output is written "
                         f"whole, one per sample")
        # where exec chose the batch size, it starts again one sample at a time, and says this
        self.note = (f"batch size 1: output '{name}' has shape {shape}, no axis of the batch's {n} "
                     f"samples; each sample runs alone and its output is written whole")

