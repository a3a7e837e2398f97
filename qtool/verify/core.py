"""``qtool verify``: the float model (onnxruntime) against the integer executor, tensor by tensor."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import queue
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..analyze import Analysis, analyze, format_analysis
from ..segments import FloatSegments
from ..sizing import activation_sizes, batch_is_chosen, default_batch, fixed_batch, tensor_sizes
from ..data import check_sampling, load_dataset
from ..errors import DataError, QtoolError
from ..executor import IntegerExecutor
from ..batching import DEFAULT_LAYERS, DEFAULT_MEMORY_MB, VERIFY_BATCH_CAP, VERIFY_FACTOR, OneAtATime, fixed_bytes, \
    reference_parts, release_freed, run_or_one_at_a_time, split_peak
from ..ops import blas, compiled, parallel
from ..model import FloatRunner, first_line, graph_inputs, load_model, prepare, weight_bytes, without_weight_bytes
from ..pixels import feeds_for, pixel_inputs
from ..fixedpoint import int_range
from ..qparams import QParams
from ..report import column_width, finite, float_node_lines, progress_bar
from ..targets import x86
from ..targets.ortview import AGREEMENT, deployed_session, fd2_to, first_parting, ort_notes
from . import compare
from .compare import Comparison
from ..ops.flat import flat_cuts
from ..joins import MOVES, find_joins
from .parts import PartComparisons


@dataclass
class OrtCheck:
    """One model output of onnxruntime on the quantized model: against the float model
    (``vs_float``) and against the integer executor on the same model (exact agreement)."""

    vs_float: Comparison
    qparams: QParams | None = None  # of the integers the output is dequantized from, if it is
    max_diff: float = 0.0  # executor vs onnxruntime: in the output's LSB with qparams, else absolute
    equal: int = 0
    count: int = 0

    @property
    def name(self) -> str:
        return self.vs_float.name

    @property
    def unit(self) -> str:
        return "absolute" if self.qparams is None else "lsb"

    @property
    def equal_fraction(self) -> float:
        return self.equal / self.count if self.count else 1.0

    def update(self, ref: np.ndarray, got: np.ndarray, executor: np.ndarray) -> None:
        self.vs_float.update(ref, got)
        if executor.shape != got.shape:  # counted as unequal elements (a Loop stopping elsewhere)
            self.count += max(executor.size, got.size)
            return
        diff = np.abs(executor.astype(np.float64) - got.astype(np.float64))
        if self.qparams is not None:
            diff = diff / _scale_like(self.qparams, diff.ndim)
        if diff.size:
            self.max_diff = max(self.max_diff, float(diff.max()))
        self.equal += int(np.count_nonzero(executor == got))
        self.count += diff.size

    def take(self) -> "OrtCheck":
        """``Comparison.take`` for these figures too."""
        taken = dataclasses.replace(self, vs_float=self.vs_float.take())
        self.max_diff, self.equal, self.count = 0.0, 0, 0
        return taken

    def merge(self, other: "OrtCheck") -> None:
        self.vs_float.merge(other.vs_float)
        self.max_diff = max(self.max_diff, other.max_diff)
        self.equal += other.equal
        self.count += other.count

    def to_dict(self) -> dict:
        max_diff = round(self.max_diff, 3) if self.unit == "lsb" else float(f"{self.max_diff:.6g}")
        return self.vs_float.to_dict() | {"vs_executor": {
            "max_diff": max_diff, "unit": self.unit,
            "equal_fraction": round(self.equal_fraction, 6)}}


@dataclass
class VerifyReport:
    samples: int
    tolerance: tuple[float, float | None]
    outputs: list[Comparison]
    tensors: list[Comparison]
    float_nodes: list[tuple[str, str, str]]
    accuracy: dict | None = None
    failures: list[str] = field(default_factory=list)
    ort: list[OrtCheck] | None = None  # with verify(..., run_ort=True)
    arithmetic: str = "exact"  # the executor's (qtool/targets)
    ort_notes: list[str] = field(default_factory=list)  # the host, onnxruntime's rewrites, causes
    analysis: Analysis | None = None  # with verify(..., run_analyze=True)
    parts: dict[str, PartComparisons] = field(default_factory=dict)  # output -> its joined parts
    made: dict = field(default_factory=dict)  # the quantized model's qtool.* metadata: how it was made
    probabilities: dict = field(default_factory=dict)  # output -> (Softmax or Sigmoid, the logits it reads)
    layer_samples: int | None = None  # the samples the tensors were compared on (None: all)
    # with the x86-avx2 arithmetic: the layers whose u8 x s8 pairs can saturate (x86.Hazard.to_dict()),
    # and what quantize warns of them
    saturation: list[dict] = field(default_factory=list)
    saturation_note: str = ""

    @property
    def passed(self) -> bool:
        return not self.failures

    def worst(self, n: int = 3) -> list[str]:
        ranked = sorted(self.tensors, key=lambda c: c.sqnr)
        return [c.name for c in ranked[:n] if c.ran != "input"]

    def loss_start(self) -> tuple[Comparison, float] | None:
        """The first tensor, in graph order, whose SQNR is ``LOSS_STEP_DB`` or more below every
        tensor computed before it, and below ``LOSS_CEILING_DB``, and by how much: where the
        damage begins, which the worst tensors (downstream of it) do not show."""
        drops = self._drops()
        return drops[0] if drops else None

    def largest_drop(self) -> tuple[Comparison, float] | None:
        """Of the tensors ``LOSS_STEP_DB`` or more below every tensor before them, the one that
        falls most (the first of equal ones): where the loss starts can be a small step from a
        high level (a Conv from 52 to 46 dB) before the op that costs the output most (a float
        Log of a quantized power spectrum, 46 -> -6 dB)."""
        drops = self._drops()
        return max(drops, key=lambda d: d[1]) if drops else None

    def _drops(self) -> list[tuple[Comparison, float]]:
        """The sharp drops in graph order: (tensor, dB below the lowest tensor before it)."""
        floor, out = math.inf, []
        for c in self.tensors:
            if c.ran == "input" or not math.isfinite(c.sqnr) or c.op_type in MOVES_VALUES:
                continue
            if math.isfinite(floor) and c.sqnr <= floor - LOSS_STEP_DB and c.sqnr < LOSS_CEILING_DB:
                out.append((c, floor - c.sqnr))
            floor = min(floor, c.sqnr)
        return out

    def to_dict(self) -> dict:
        d = {"passed": self.passed, "samples": self.samples, "layer_samples": self.layer_samples,
             "tolerance": {"cosine": self.tolerance[0], "sqnr_db": self.tolerance[1]},
             "outputs": [c.to_dict() | ({"parts": self.parts[c.name].to_dict()} if c.name in self.parts
                                        else {}) for c in self.outputs],
             "tensors": [c.to_dict() for c in self.tensors],
             "worst": self.worst(),
             "loss_start": _drop_dict(self.loss_start()),
             "largest_drop": _drop_dict(self.largest_drop()),
             "float_nodes": [{"op_type": t, "node": n, "reason": r} for t, n, r in self.float_nodes],
             "accuracy": self.accuracy,
             "ort": None if self.ort is None else [c.to_dict() for c in self.ort],
             "arithmetic": self.arithmetic,
             "failures": self.failures}
        if self.saturation:
            d["saturation_hazards"] = self.saturation
        d["quantized_with"] = self.made
        if not self.passed:
            d["next_steps"] = next_steps(self)
        if self.ort is not None:
            d["ort_notes"] = self.ort_notes
        if self.analysis is not None:
            d["analysis"] = self.analysis.to_dict()
        return d


# verify copies every compared tensor out of onnxruntime (PP-OCRv4 rec: about 200 MB a sample)
# ops of the sensitivity ranking in the text and HTML reports (the JSON report has them all)
ANALYSIS_TOP = 10


# The default tolerance: cosine 0.99 alone passes a 17 dB output (an error of 14% of the signal's
# RMS); the SQNR floor asks for 20 dB (10%). A tolerance given as COS alone has no floor.
DEFAULT_TOLERANCE = (0.99, 20.0)
# "where the loss starts": the first tensor, in graph order, this far below every tensor before it
LOSS_STEP_DB = 6.0
# ... and below this: a tensor above it has lost nothing worth naming (sweep 10: MiniLM's position
# table at 64.6 dB, 0.55 LSB from float, and an int16 model's first GELU at 67 dB were named)
LOSS_CEILING_DB = 50.0
# ops that only move or select their one input's values on its own scale: they lose nothing, so
# they neither set the level a later drop is measured from nor count as one (an NHWC model's
# Transpose of its input, at the input's 57.9 dB, made its first Conv "where the loss starts", 17 dB
# below it). Not Concat (its inputs can be requantized to one scale) nor Gather (a quantized table)
MOVES_VALUES = MOVES | {"Slice", "Split", "Expand", "Tile", "SpaceToDepth", "DepthToSpace"}


def parse_tolerance(text: str | float | list) -> tuple[float, float | None]:
    """``"0.99"`` or ``"0.99,30"``: minimum output cosine, optional minimum output SQNR in dB."""
    parts = text if isinstance(text, (list, tuple)) else str(text).split(",")
    try:
        values = [float(p) for p in parts]
    except (TypeError, ValueError):
        raise QtoolError(f"tolerance must be COS or COS,SQNR (numbers), got '{text}'") from None
    if not 1 <= len(values) <= 2 or not -1 <= values[0] <= 1:
        raise QtoolError(f"tolerance must be COS or COS,SQNR with COS in [-1, 1], got '{text}'")
    return values[0], (values[1] if len(values) == 2 else None)


def verify(float_path: str | Path, qmodel_path: str | Path, data_path: str | Path,
           tolerance: tuple[float, float | None] = DEFAULT_TOLERANCE, labels: str | None = None,
           num_samples: int | None = None, batch_size: int | None = None, progress: bool = True,
           preprocess=None, run_ort: bool = False, run_analyze: bool = False,
           analyze_samples: int | None = 16, arithmetic: str = "exact",
           ort_config: dict[str, str] | None = None, memory_mb: int = DEFAULT_MEMORY_MB,
           log=None, shard: tuple[int, int] | None = None, on_batch=None,
           layers: int | frozenset | None = DEFAULT_LAYERS) -> VerifyReport:
    """Run the float model and the integer executor over DATA, comparing every output and every
    integer tensor; with ``run_ort``, also onnxruntime on the quantized model, output by output;
    with ``run_analyze``, also ``qtool analyze``'s per-op sensitivity ranking of the (QDQ) quantized
    model on the first ``analyze_samples`` of the compared samples. ``arithmetic``: the executor's
    (exact, x86-avx2 or host; qtool/targets). ``ort_config``: session config entries for
    onnxruntime's session (e.g. ``session.x64quantprecision``), as a user deploys it.
    ``batch_size`` None: chosen from ``memory_mb`` (qtool/batching.py) and told to ``log``.
    ``shard``: samples [first, stop) only; ``on_batch(outputs, tensors, parts, ort_checks,
    (correct_float, correct_int))`` after each batch (qtool/cluster.py takes each batch's figures).
    ``layers``: the samples the tensors are compared on, in whole batches spread over the data
    (``layer_batches``; the outputs on every sample); None: every sample; a set: those batches
    (numbered from sample 0 in steps of the batch size, as a shard's are)."""
    args = (float_path, qmodel_path, data_path, tolerance, labels, num_samples)
    rest = dict(progress=progress, preprocess=preprocess, run_ort=run_ort, run_analyze=run_analyze,
                analyze_samples=analyze_samples, arithmetic=arithmetic, ort_config=ort_config,
                memory_mb=memory_mb, log=log, shard=shard, on_batch=on_batch, layers=layers)
    return run_or_one_at_a_time(lambda size: _verify(*args, size, **rest), batch_size, log)


def _levels(qp) -> tuple[float, float, float] | None:
    """(lowest level, highest level, step) of an 8-bit tensor's (S, Z) (over its channels where it
    has several: the widest ends and the largest step); None for other types."""
    if qp is None or qp.dtype not in ("int8", "uint8"):
        return None
    scale = np.asarray(qp.scale, np.float64)
    zero = np.asarray(qp.zero_point, np.float64)
    qmin, qmax = int_range(qp.dtype)
    return float(np.min(scale * (qmin - zero))), float(np.max(scale * (qmax - zero))), float(scale.max())


def _cut_at(cut: tuple[float, float] | None, qp) -> tuple[float, float] | None:
    """``cut`` (the float readers' bounds, ``flat_cuts``) where the tensor is 8-bit and its levels
    end within two steps of the bounds, as quantize cuts it; else None."""
    levels = _levels(qp)
    if cut is None or levels is None:
        return None
    low, high, step = levels
    if np.isfinite(cut[0]) and low < cut[0] - 2 * step or np.isfinite(cut[1]) and high > cut[1] + 2 * step:
        return None
    return cut


def layer_batches(samples: int, batch_size: int, layers: int | None) -> frozenset | None:
    """The batches (index = first sample // batch size) whose tensors verify compares: enough
    whole batches for ``layers`` samples, spread evenly over the ``samples``; None: all of them."""
    batches = math.ceil(samples / batch_size)
    if layers is None:
        return None
    wanted = min(batches, math.ceil(layers / batch_size))
    return None if wanted >= batches else frozenset(i * batches // wanted for i in range(wanted))


def _verify(float_path, qmodel_path, data_path, tolerance, labels, num_samples, batch_size, progress,
            preprocess, run_ort, run_analyze, analyze_samples, arithmetic, ort_config, memory_mb, log,
            shard, on_batch, layers) -> VerifyReport:
    check_sampling(num_samples, batch_size)
    if isinstance(layers, int) and layers < 1:
        raise QtoolError(f"--layers must be at least 1 (or all), got {layers}")
    if run_analyze:
        check_sampling(analyze_samples, batch_size)
    model = prepare(load_model(float_path), f"model file '{float_path}'")
    qmodel = load_model(qmodel_path)
    executor = IntegerExecutor(qmodel, arithmetic=arithmetic)
    if not executor.has_integer():
        raise QtoolError(f"model file '{qmodel_path}' has no integer op ({len(executor.float_nodes())} nodes "
                         f"would run in float), so there is nothing to verify: give the model qtool "
                         f"quantize wrote (its report says how many ops it made integer)")
    _check_same_interface(model, qmodel, executor.output_names, float_path, qmodel_path)
    data = load_dataset(data_path, model, preprocess)
    input_names = {vi.name for vi in graph_inputs(model)}
    if labels is not None and labels in input_names:
        raise QtoolError(f"--labels '{labels}' names the model's input in data file '{data_path}', not an "
                         f"array of labels beside it")
    if labels is not None and labels not in data.extra:
        raise QtoolError(f"data file '{data_path}' has no labels array '{labels}' "
                         f"(arrays: {', '.join(data.keys) or 'none'})")
    if labels is not None:
        truth = data.extra[labels]
        if truth.ndim != 1 or len(truth) != len(data) or truth.dtype.kind not in "iu":
            raise QtoolError(f"data file '{data_path}' labels array '{labels}' has shape "
                             f"{list(truth.shape)} and dtype {truth.dtype}; expected one integer "
                             f"class per sample ([{len(data)}])")
        _check_classes(data_path, labels, truth, model, executor.output_names[0])
    known = {o for node in model.graph.node for o in node.output} | input_names
    outputs = [Comparison(name) for name in executor.output_names]
    integer_tensors = executor.integer_tensors()

    def output_levels(name: str):  # a graph output is quantized as NAME_float (qtool quantize)
        t = integer_tensors.get(name) or integer_tensors.get(f"{name}_float")
        return None if t is None else _levels(t.qparams)

    cuts = flat_cuts(model, output_levels)
    tensors = [Comparison(name, t.op_type, _ran(name, t.op_type, input_names), t.qparams, t.clamped,
                          None if t.clamped else _cut_at(cuts.get(name), t.qparams))
               for name, t in integer_tensors.items() if name in known]
    # outputs that join tensors (a Concat of boxes and class scores): each part compared too
    joins = {name: join for name, join in find_joins(model).items() if name in executor.output_names}
    parts = {name: PartComparisons(join) for name, join in joins.items()}
    placing = {n for join in joins.values() for n in join.tensors()}  # their shapes place the parts
    # sized when the memory budget decides (a model whose batch is fixed at 1 too: its float
    # reference may be cut below); a batch size given is the user's call. Sizing may run the
    # model's first nodes once (sizing.probe_model)
    sized = batch_is_chosen(model, batch_size) or (batch_size is None and fixed_batch(model) == 1)
    sizes = activation_sizes(model, data) if sized else ({}, [])
    extra = [c.name for c in tensors] + sorted(placing - {c.name for c in tensors})
    held = fixed_bytes(weight_bytes(model), os.path.getsize(qmodel_path))
    # where the models alone take more than --memory, onnxruntime keeps one copy of the float
    # weights, not a second one packed for its GEMM kernels (a ViT-S: 55 MB less, its float runs
    # about 15% slower), and numba's compiled loops are not loaded (``_compiled_loops``)
    tight = held > memory_mb * (1 << 20)
    session = dict(threads=1, arena=False, prepack=not tight)
    # measured before verify's own session is made: the probe's weights are gone by then
    per_tensor = tensor_sizes(model, data, sizes=sizes, prepack=session["prepack"]) if sized else {}
    # the float model on one thread, beside the executor on the other (two intra-op threads
    # spinning for work took the executor's core: rec 58 ms a line instead of 37)
    runner = FloatRunner(model, extra, **session)
    chosen = batch_is_chosen(model, batch_size) and shard is None
    batch_size, note = default_batch(model, data, batch_size, VERIFY_FACTOR, memory_mb, VERIFY_BATCH_CAP,
                                     held=held, sizes=(per_tensor, []))
    starts = (reference_parts([per_tensor.get(c.name, 0) for c in tensors], batch_size, memory_mb, held)
              if per_tensor else [0])
    if len(starts) > 1:
        groups = [[c.name for c in tensors[a:b]] for a, b in zip(starts, [*starts[1:], len(tensors)])]
        runner = None  # the whole model's session goes before the segments' come
        release_freed()
        try:
            runner = FloatSegments(model, groups, sorted(placing), **session)
        except Exception:  # NotSegmented (a tensor without a known type), a segment onnxruntime refuses
            runner = None
            release_freed()
            runner = FloatRunner(model, extra, **session)
    if isinstance(runner, FloatSegments):
        split = (f"the float model in {len(runner.segments)} segments, run one after another, so that "
                 f"a compared batch's float tensors are not all alive at once (--memory {memory_mb})")
        peak = split_peak([per_tensor.get(c.name, 0) for c in tensors], starts, batch_size, held)
        if batch_size == 1 and peak > memory_mb << 20:  # nothing left to make smaller
            split += (f"; one sample still takes about {peak >> 20} MB with them: raise --memory, or expect a "
                      f"larger peak")
        note = f"{note}; {split}" if note else split
    model = without_weight_bytes(model)  # onnxruntime has the weights; from here on verify reads the graph
    release_freed()
    ort_session, ort_graph, ort_passes = (_ort_session(qmodel, qmodel_path, ort_config) if run_ort
                                          else (None, None, []))
    dequantized = {s.outputs[0]: s.qparams[0] for s in executor.steps if s.kind == "dequantize"}
    pixels = pixel_inputs(qmodel)  # quantize --input-pixels: onnxruntime gets the pixels
    ort_checks = [OrtCheck(Comparison(name), dequantized.get(name)) for name in executor.output_names]
    begin, total = shard or (0, len(data) if num_samples is None else min(num_samples, len(data)))
    picked = layers if isinstance(layers, frozenset) else layer_batches(total - begin, batch_size, layers)
    layer_samples = 0
    outputs_only = list(executor.output_names) + sorted(placing - set(executor.output_names))
    analysis = None
    if run_analyze:  # before the long verify run: a QOperator model fails here, in seconds
        samples = total if analyze_samples is None else min(analyze_samples, total)
        analysis = analyze(float_path, qmodel, data_path, samples, batch_size, progress, preprocess)
    if ort_session is None:  # onnxruntime does not run it again: the graph is read from here on
        qmodel = executor.model
        release_freed()
    correct_float = correct_int = 0
    first_feeds = None  # onnxruntime's first batch: where it parts from the executor is found on it
    tables = {c.name: {} for c in tensors}  # per tensor, its dequantized bytes (Comparison.update_integer)
    by_name = {c.name: c for c in tensors}
    # the comparisons' dot products on one BLAS thread, as the executor's (qtool/ops/blas.py): with
    # the default threads a 2-core machine doing other work spent 4 ms per tensor waiting for them
    # and the executor's kernels on this thread alone: the second thread has work of its own
    with progress_bar(total - begin, "verify", progress) as bar, blas.single_threaded(), \
            parallel.serial(), _compiled_loops(not tight), \
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qtool-float") as side:
        start, batches = begin, 0
        for feeds in data.batches(batch_size, total, begin):
            full = picked is None or start // batch_size in picked
            n = data.samples_in(feeds)
            pace = (n, max(0, total - start - n))
            try:
                if full:
                    reference, result = _side_by_side(executor, runner, feeds, by_name, tables, side, placing,
                                                      pace)
                else:  # the outputs alone: the float model asked for them only, the executor's fast run
                    float_side = side.submit(runner.run, feeds, outputs_only)
                    try:
                        result = executor.run(feeds, pace=pace)
                    finally:
                        reference = float_side.result()
            except QtoolError as e:
                if chosen and batches == 0 and batch_size > 1 and data.samples_in(feeds) > 1 \
                        and not isinstance(e, DataError):
                    raise OneAtATime(batch_size, e) from None
                raise
            for c in outputs:
                if c.name not in reference:
                    raise QtoolError(f"the float model has no output '{c.name}'")
                c.update(reference[c.name], result.outputs[c.name])
                if c.name in parts:
                    parts[c.name].update(reference[c.name], result.outputs[c.name],
                                         {n: np.shape(reference[n]) for n in joins[c.name].tensors()})
            if ort_session is not None:
                first_feeds = first_feeds if batches else feeds
                got = _ort_run(ort_session, feeds_for(pixels, feeds), qmodel_path)
                for c in ort_checks:
                    c.update(reference[c.name], got[c.name], result.outputs[c.name])
            layer_samples += n if full else 0
            if labels is not None:
                truth = data.extra[labels][start:start + n]
                first = executor.output_names[0]
                correct_float += int((reference[first].argmax(-1) == truth).sum())
                correct_int += int((result.outputs[first].argmax(-1) == truth).sum())
            start += n
            bar.update(n)
            batches += 1
            if on_batch is not None:
                on_batch(outputs, tensors, parts, ort_checks, (correct_float, correct_int))
    if log is not None and note and total > 1:
        log(note)
    report = VerifyReport(total - begin, tolerance, outputs, tensors, _float_nodes(executor, qmodel),
                          layer_samples=layer_samples,
                          ort=ort_checks if run_ort else None, analysis=analysis,
                          arithmetic=executor.arithmetic, parts=parts,
                          made={p.key: p.value for p in qmodel.metadata_props
                                if p.key.startswith("qtool.") and p.key not in ("qtool.params", "qtool.float_nodes")},
                          probabilities=_probabilities(model, executor.output_names))
    if executor.arithmetic == "x86-avx2":
        report.saturation = [h.to_dict() for h in x86.hazards(executor)]
        layers = sum(1 for s in executor.steps if s.kind == "integer" and s.node.op_type in x86.EMULATED)
        report.saturation_note = x86.hazard_summary(report.saturation, layers) if report.saturation else ""
    if run_ort:
        report.ort_notes = ort_notes(qmodel, ort_graph, executor, ort_checks, ort_passes)
        if any(c.equal_fraction < AGREEMENT or (c.unit == "lsb" and c.max_diff > 1) for c in ort_checks):
            parting = first_parting(qmodel, executor, feeds_for(pixels, first_feeds), ort_config)
            if parting is not None:
                report.ort_notes.append(parting)
    if labels is not None:
        report.accuracy = accuracy(labels, correct_float, correct_int, report.samples)
    judge(report, batches)
    return report


def _float_nodes(executor: IntegerExecutor, qmodel) -> list[tuple[str, str, str]]:
    """What runs float, with the reasons quantize gave (its qtool.float_nodes record) where it did:
    the list quantize printed."""
    import json

    said = next((p.value for p in qmodel.metadata_props if p.key == "qtool.float_nodes"), None)
    try:
        reasons = json.loads(said) if said else {}
    except ValueError:
        reasons = {}
    reasons = reasons if isinstance(reasons, dict) else {}
    return [(t, n, str(reasons.get(n, r))) for t, n, r in executor.float_nodes()]


def _probabilities(model, outputs: list[str]) -> dict:
    """The outputs a Softmax or Sigmoid makes: (its op type, the logits it reads)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    found = {}
    for name in outputs:
        node = producer.get(name)
        while node is not None and node.op_type in ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze"):
            node = producer.get(node.input[0])  # a Softmax of opset < 13 comes back as Flatten, Softmax, Reshape
        if node is not None and node.op_type in ("Softmax", "Sigmoid"):
            found[name] = (node.op_type, node.input[0])
    return found


def next_steps(report: VerifyReport) -> list[str]:
    """What to try after a FAIL, from how the model was made and where the loss is."""
    steps = []
    made = report.made
    if report.saturation:
        made_for = made.get("qtool.target")
        steps.append(f"quantize with --target portable{f' (not {made_for})' if made_for else ''}: "
                     f"{len(report.saturation)} layers can saturate with the x86-avx2 arithmetic (above)")
    if "qtool.data_steps" not in made:
        steps.append("quantize with samples: qtool quantize MODEL -t TABLE -o QMODEL --data CALIB.npz "
                     "(chooses the calibration method, corrects biases, places int16 in transformers; each "
                     "step kept only where held-out samples score better)")
    if made.get("qtool.activation_type", "int8") in ("int8", "uint8"):
        steps.append("16-bit activations: --activation-type int16 for all, or --data CALIB.npz --target-sqnr DB "
                     "for the fewest ops that reach DB dB (the model stays integer)")
    elif made.get("qtool.weight_type", "int8") == "int8":
        steps.append("16-bit weights too: --activation-type int16 --weight-type int16 (Conv, ConvTranspose, "
                     "MatMul and Gemm weights int16: 16x16)")
    start, largest = report.loss_start(), report.largest_drop()
    where = f"; the loss starts at {start[0].name} ({start[0].op_type})" if start is not None else ""
    if largest is not None and largest[0] is not start[0]:
        where += f" and drops most at {largest[0].name} ({largest[0].op_type}{_in_float(largest[0])})"
    steps.append(f"find the costly ops: qtool analyze MODEL --data CALIB.npz --table TABLE, or verify "
                 f"--analyze{where}; give them int16 (--precision-table) or keep them float (--keep-float)")
    return steps


def _in_float(c: Comparison) -> str:
    return ", run in float" if c.ran == "float" else ""


def _drop_text(c: Comparison, drop: float) -> str:
    return (f"{c.name} ({c.op_type}{_in_float(c)}) at {c.sqnr:.2f} dB, {drop:.1f} dB below every tensor "
            f"before it")


def _drop_dict(found: tuple[Comparison, float] | None) -> dict | None:
    if found is None:
        return None
    c, drop = found
    return {"tensor": c.name, "op_type": c.op_type, "sqnr_db": finite(c.sqnr), "drop_db": round(drop, 2)}


def _check_classes(data_path, labels: str, truth: np.ndarray, model, output: str) -> None:
    """Labels the scored output's classes can hold (sweep 8: a label of -3, or 99 for 10 classes,
    was counted as a miss without a word): where that output's last size is fixed."""
    vi = next((o for o in model.graph.output if o.name == output), None)
    dims = list(vi.type.tensor_type.shape.dim) if vi is not None and vi.type.HasField("tensor_type") else []
    if not dims or not dims[-1].HasField("dim_value") or not truth.size:
        return
    classes = int(dims[-1].dim_value)
    lo, hi = int(truth.min()), int(truth.max())
    if lo < 0 or hi >= classes:
        raise QtoolError(f"data file '{data_path}' labels array '{labels}' holds {lo if lo < 0 else hi}, "
                         f"outside the {classes} classes of output '{output}' (0 to {classes - 1})")


def accuracy(labels: str, correct_float: int, correct_int: int, samples: int) -> dict:
    return {"labels": labels, "float": 100.0 * correct_float / samples,
            "integer": 100.0 * correct_int / samples}


def judge(report: VerifyReport, batches: int) -> None:
    """The report's failures: every output, and each part of one, against the tolerance."""
    parts = report.parts
    min_cos, min_sqnr = report.tolerance
    for c in report.outputs:
        if c.mismatched:
            report.failures.append(f"output '{c.name}' has another shape than the float model's on "
                                   f"{c.mismatched} of {batches} batches (float {c.shapes[0]}, "
                                   f"integer {c.shapes[1]}): its size depends on values that "
                                   f"quantization changed")
        if c.cosine < min_cos:
            report.failures.append(f"output '{c.name}' cosine {c.cosine:.6f} < {min_cos}")
        if min_sqnr is not None and c.sqnr < min_sqnr:
            report.failures.append(f"output '{c.name}' SQNR {c.sqnr:.2f} dB < {min_sqnr} dB")
        joined = parts.get(c.name)
        if joined is None or joined.unplaced or c.mismatched:
            continue
        # the tolerance holds for every part: a destroyed part of a join fails the output
        for part in joined.parts:
            where = f"output '{c.name}' part '{part.name}' (input of Concat '{joined.join.concat_of(part.name)}')"
            if part.cosine < min_cos:
                report.failures.append(f"{where} cosine {part.cosine:.6f} < {min_cos}")
            if min_sqnr is not None and part.sqnr < min_sqnr:
                report.failures.append(f"{where} SQNR {part.sqnr:.2f} dB < {min_sqnr} dB")


@contextlib.contextmanager
def _compiled_loops(enabled: bool):
    """numba's compiled loops, the executor's and the comparisons', as they are (``enabled``) or
    off for the duration, when numba is not loaded at all: numba and LLVM add about 75 MB of
    mapped libraries to the process. On a ViT-S, whose time goes to BLAS products, verify took as
    long without them (20.7 s against 20.0-22.4 s, 16 samples). onnxruntime's Conv engine stays
    (``ops.fast_paths`` would turn it off too): it loads no numba, and a CNN's Convs run about 40%
    slower without it, for no memory that showed beyond the ViT-S's run-to-run spread."""
    saved = compiled.ENABLED, compare.ENABLED
    compiled.ENABLED, compare.ENABLED = saved if enabled else (False, False)
    try:
        yield
    finally:
        compiled.ENABLED, compare.ENABLED = saved


def _side_by_side(executor: IntegerExecutor, runner: FloatRunner, feeds: dict, comparisons: dict,
                  tables: dict, side: concurrent.futures.Executor, keep: set[str] = frozenset(), pace=None):
    """One batch through the float model and the executor, every integer tensor compared as soon
    as the executor computes it: the float model runs on ``side`` (a second thread; onnxruntime and
    the compiled comparisons release the GIL) while the executor runs here, then both threads take
    the computed tensors from a queue until the executor is done. Each tensor is compared whole by
    one thread, so the sums are the same whichever thread does it. (reference, executor result);
    the reference keeps the outputs and ``keep``.

    ``runner`` may be the float model in segments (qtool/segments.py), when a batch's float
    tensors together do not fit the memory budget: then the side thread runs one segment at a
    time, when the executor gives a tensor of the next, and alone compares."""
    computed: queue.SimpleQueue = queue.SimpleQueue()
    keep = set(executor.output_names) | set(keep)

    def compare(reference: dict) -> None:
        while (item := computed.get()) is not None:
            name, value = item
            c = comparisons.get(name)
            if c is not None:
                # a reference compared is let go (the outputs are kept for the caller): the
                # batch's float tensors do not all stay alive until the executor is done
                c.update_integer(reference[name] if name in keep else reference.pop(name), value,
                                 tables[name])
            del item, value
        computed.put(None)  # the end, for the other thread

    def compare_in_parts() -> dict:
        segments = runner.parts(feeds)
        reference: dict = {}
        kept: dict = {}

        def next_segment() -> bool:
            values = next(segments, None)
            if values is not None:
                kept.update((n, v) for n, v in values.items() if n in keep)
                reference.update(values)
            return values is not None

        while (item := computed.get()) is not None:
            name, value = item
            c = comparisons.get(name)
            if c is not None:
                while name not in reference and next_segment():  # each tensor let go once compared
                    pass
                c.update_integer(reference.pop(name), value, tables[name])
            del item, value
        reference.clear()
        while next_segment():  # the outputs may come last
            reference.clear()
        return kept

    if isinstance(runner, FloatSegments):
        float_side = side.submit(compare_in_parts)
        try:
            result = executor.run(feeds, on_integer=lambda name, value: computed.put((name, value)), pace=pace)
        finally:
            computed.put(None)
        return float_side.result(), result
    float_side = side.submit(runner.run, feeds)
    side_compares = side.submit(lambda: compare(float_side.result()))
    try:
        result = executor.run(feeds, on_integer=lambda name, value: computed.put((name, value)), pace=pace)
    finally:
        computed.put(None)
    reference = float_side.result()
    compare(reference)
    side_compares.result()
    return reference, result


def _check_same_interface(model, qmodel, qoutputs, float_path, qmodel_path) -> None:
    """The quantized model must read the float model's inputs and write outputs it has: else it
    was made from another model, and nothing can be compared."""
    inputs = [vi.name for vi in graph_inputs(model)]
    outputs = [o.name for o in model.graph.output]
    for kind, names, known in (("input", [vi.name for vi in graph_inputs(qmodel)], inputs),
                               ("output", qoutputs, outputs)):
        unknown = [n for n in names if n not in known]
        if unknown:
            raise QtoolError(f"quantized model '{qmodel_path}' has {kind} '{unknown[0]}', which "
                             f"float model '{float_path}' lacks ({kind}s: {', '.join(known)}); "
                             f"was it quantized from another model?")


def _ort_session(qmodel, path, config: dict[str, str] | None):
    """onnxruntime on the quantized model as it would be deployed (default optimizations, which
    fuse QDQ groups into its own integer kernels, and the user's session config entries): the
    session, the graph it built and the passes that changed it (targets.ortview)."""
    try:
        return deployed_session(qmodel, config)
    except Exception as e:
        raise QtoolError(f"onnxruntime cannot load quantized model '{path}': {first_line(e)}") from None


def _ort_run(session: ort.InferenceSession, feeds: dict, path) -> dict[str, np.ndarray]:
    names = [i.name for i in session.get_inputs()]
    try:
        with fd2_to(os.devnull):  # the deployed session logs at INFO: its run-time warnings not on the terminal
            values = session.run(None, {n: feeds[n] for n in names})
    except Exception as e:  # a KeyError too: an input the float model does not have
        raise QtoolError(f"onnxruntime failed on quantized model '{path}': {first_line(e)}") from None
    return dict(zip([o.name for o in session.get_outputs()], values))


def _scale_like(qp: QParams, ndim: int) -> np.ndarray:
    """The scale shaped to broadcast against a rank-``ndim`` tensor (per-channel along its axis)."""
    scale = np.asarray(qp.scale, dtype=np.float64)
    if qp.axis is not None:
        shape = [1] * ndim
        shape[qp.axis] = -1
        scale = scale.reshape(shape)
    return scale


def _ran(name: str, op_type: str, inputs) -> str:
    if name in inputs:
        return "input"
    return "float" if op_type == "QuantizeLinear" else "integer"


def format_report(report: VerifyReport) -> str:
    out_w = column_width([c.name for c in report.outputs], 32)
    lines = [f"verify: {report.samples} samples, float model (onnxruntime) vs integer executor", "",
             f"{'output':<{out_w}} {'cosine':>9} {'SQNR dB':>8}"]
    for c in report.outputs:
        lines.append(f"{c.name:<{out_w}} {c.cosine:>9.6f} {c.sqnr:>8.2f}")
        joined = report.parts.get(c.name)
        if joined is not None and joined.unplaced:
            lines.append(f"  (its parts, the inputs of Concat '{joined.join.node}', could not be placed "
                         f"in it: not scored one by one)")
        elif joined is not None:
            worst_part = joined.worst().name
            for part in joined.parts:
                mark = "  <- worst part" if part.name == worst_part else ""
                lines.append(f"  part {part.name:<25} {part.cosine:>9.6f} {part.sqnr:>8.2f}{mark}")
    if report.parts:
        lines.append("(part: an input of the Concat the output joins, scored where its values land)")
    worst = set(report.worst())
    lines += [""]
    if report.layer_samples is not None and report.layer_samples < report.samples:
        lines.append(f"tensors compared on {report.layer_samples} of the {report.samples} samples, in batches "
                     f"spread over them (--layers all: every sample)")
    ops = [c.op_type + ("+Relu" if c.clamped else "+flat" if c.cut is not None else "") for c in report.tensors]
    name_w, op_w = column_width([c.name for c in report.tensors], 32), column_width(ops, 18)
    lines += [f"{'tensor':<{name_w}} {'op':<{op_w}} {'ran':<8} {'cosine':>9} {'SQNR dB':>8} {'max LSB':>8}"]
    for c, op in zip(report.tensors, ops):
        mark = "  <- worst" if c.name in worst else ""
        lines.append(f"{c.name:<{name_w}} {op:<{op_w}} {c.ran:<8} {c.cosine:>9.6f} {c.sqnr:>8.2f} "
                     f"{c.max_lsb:>8.2f}{mark}")
    if any(c.clamped for c in report.tensors):
        lines.append("(+Relu: quantized with the range of the Relu that reads it; compared after it)")
    if any(c.cut is not None for c in report.tensors):
        lines.append("(+flat: read only by ops constant beyond some bounds (HardSwish below -3, HardSigmoid, "
                     "Clip; a Sigmoid or Tanh where its 8-bit output stops moving), quantized within them; "
                     "compared clipped to them)")
    excluded = [c for c in (*report.outputs, *report.tensors) if c.excluded]
    if excluded:
        lines.append("(left out of the figures: reference entries that are no real value, inf, NaN or "
                     "beyond 1e30 such as an attention mask's lowest: "
                     + ", ".join(f"{c.name} {c.excluded}" for c in excluded[:5])
                     + (f" and {len(excluded) - 5} more tensors" if len(excluded) > 5 else "") + ")")
    start, largest = report.loss_start(), report.largest_drop()
    if start is not None:
        lines.append(f"where the loss starts: {_drop_text(*start)}")
    if largest is not None and largest[0] is not start[0]:
        lines.append(f"where it drops most: {_drop_text(*largest)}")
    if report.float_nodes:
        lines += ["", f"ran in float: {len(report.float_nodes)} nodes"]
        lines += float_node_lines(report.float_nodes)
    if report.ort is not None:
        ort_w = column_width([c.name for c in report.ort], 32)
        lines += ["", "onnxruntime on the quantized model: cosine and SQNR against the float model, "
                      "max diff and equal elements against the integer executor",
                  f"{'output':<{ort_w}} {'cosine':>9} {'SQNR dB':>8} {'max diff':>12} {'equal':>8}"]
        for c in report.ort:
            lines.append(f"{c.name:<{ort_w}} {c.vs_float.cosine:>9.6f} {c.vs_float.sqnr:>8.2f} "
                         f"{format_diff(c):>12} {100 * c.equal_fraction:>7.2f}%")
        lines += [f"  {note}" for note in report.ort_notes]
    if report.accuracy:
        a = report.accuracy
        lines += ["", f"top-1 accuracy on '{a['labels']}': float {a['float']:.2f}%, "
                      f"integer {a['integer']:.2f}% ({a['integer'] - a['float']:+.2f} points)"]
    if report.analysis is not None:
        lines += ["", "most sensitive ops (qtool analyze: onnxruntime on the QDQ model)",
                  format_analysis(report.analysis, ANALYSIS_TOP).replace("(--top 0 for all)",
                                                                         "(--json for all)")]
    by_name = {c.name: c for c in report.tensors}
    for output, (op_type, logits) in report.probabilities.items():
        c = by_name.get(logits)
        figure = f" (here {c.sqnr:.2f} dB)" if c is not None else ""
        lines.append(f"(output '{output}' holds the probabilities of a {op_type}: quantize --data and analyze "
                     f"score its input, the logits '{logits}'{figure})")
    rule = tolerance_rule(report.tolerance, bool(report.parts))
    if report.saturation_note:
        lines += ["", f"x86-avx2 arithmetic: {report.saturation_note}"]
    lines.append("")
    lines.append(f"PASS ({rule})" if report.passed else f"FAIL ({rule}): " + "; ".join(report.failures))
    if not report.passed:
        lines += ["next steps:"] + [f"  - {step}" for step in next_steps(report)]
    return "\n".join(lines)


def tolerance_rule(tolerance: tuple[float, float | None], parts: bool = False) -> str:
    cos, sqnr = tolerance
    return (f"output cosine >= {cos}" + (f", SQNR >= {sqnr} dB" if sqnr is not None else "")
            + (", each joined part too" if parts else ""))


def format_diff(c: OrtCheck) -> str:
    return f"{c.max_diff:.2f} LSB" if c.unit == "lsb" else f"{c.max_diff:.3g}"
