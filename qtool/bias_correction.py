"""Empirical bias correction: the per-channel mean of every integer Conv, ConvTranspose and Gemm
output is brought back to the float model's on calibration data.

Quantization errors are not zero-mean. Rounding a constant region (the background of a text line)
gives the same error at every pixel, and the shift grows through the network: on PP-OCRv4 rec the
mean of the last convs' outputs is off by up to 3.4 where their RMS is 0.6. Correcting the bias
removes that shift at no cost at run time.

The ops are corrected one at a time in graph order, each measured on the QDQ model with the earlier
corrections applied. Corrected all at once, an op downstream of another is corrected twice for the
same upstream shift (PP-OCRv4 rec then fell to 0% word accuracy).

A correction fitted on some samples need not hold on others (text rendered another way, another
detector: it lowered two of five real models by 3-9 dB on their own data). So it is fitted on one
part of DATA and judged on another, disjoint part (``holdout`` samples, spread over DATA like the
fitted ones): applied in full, at half, or not at all, whichever gives the best output SQNR
against float on the held-out samples, and only when that beats no correction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .analyze import Batches, Evaluator, split_batches, with_outputs
from .errors import DataError, QtoolError
from .model import first_line, node_reads, prepare_file
from .pixels import feeds_for, pixel_inputs
from .quantize import quantize
from .report import finite, progress_bar
from .runs import Runs
from .sizing import one_feed_bytes

CHANNEL_AXIS = {"Conv": 1, "ConvTranspose": 1, "Gemm": -1}  # the axis the bias runs along
REFERENCE_CHUNK = 16  # float tensors fetched per run where their sizes are not known
REFERENCE_BYTES = 64 << 20  # else as many as hold this much of one sample (runs hold a few samples each)
BIAS_SAMPLES = 16  # channel means over 16 samples x H x W positions are stable to well under a step
FACTORS = (1.0, 0.5)  # the fitted shifts tried on the held-out samples, beside none


@dataclass
class Target:
    node: str
    output: str  # the op's float output, before its QuantizeLinear
    bias: str  # the int32 initializer read by the bias's DequantizeLinear
    scale: np.ndarray  # float64, the bias's per-channel scale
    axis: int


@dataclass
class BiasCorrection:
    deltas: dict[str, np.ndarray] = field(default_factory=dict)  # node -> float shift of its bias
    samples: int = 0
    seconds: float = 0.0
    largest: tuple[str, float] = ("", 0.0)  # node and the largest |shift| in units of its output RMS
    # the held-out judgement: samples, output SQNR without correction and per factor tried, the
    # factor applied (0: none); heldout 0 means not judged (then ``applied`` says whether applied)
    heldout: int = 0
    plain_db: float | None = None
    scores: dict[float, float] = field(default_factory=dict)
    factor: float = 1.0
    scored: str = ""
    reason: str = ""  # why it was not judged
    fitted_in_rounding: bool = False  # fitted by the weight rounding's judge (its seconds are that step's)

    @property
    def score_db(self) -> float | None:
        """The held-out SQNR of the model with the shifts applied (None: not scored)."""
        return self.scores[self.factor] if self.factor and self.factor in self.scores else self.plain_db

    @property
    def applied(self) -> dict[str, np.ndarray]:
        """The shifts quantize applies: the fitted ones times the chosen factor."""
        if not self.factor:
            return {}
        return {node: delta * self.factor for node, delta in self.deltas.items()}

    def to_dict(self) -> dict:
        out = {"ops": len(self.deltas), "samples": self.samples, "seconds": round(self.seconds, 2),
               "largest_shift": {"node": self.largest[0], "relative": round(self.largest[1], 4)},
               "applied": self.factor, "heldout_samples": self.heldout}
        if self.heldout:
            out["heldout_sqnr_db"] = {"none": finite(self.plain_db)} | {
                str(f): finite(db) for f, db in self.scores.items()}
            out["scored"] = self.scored
        if self.reason:
            out["not_judged"] = self.reason
        if self.fitted_in_rounding:
            out["fitted_in_rounding"] = True
        return out


def targets(qmodel: onnx.ModelProto) -> list[Target]:
    """The integer Conv, ConvTranspose and Gemm nodes of a QDQ model whose bias is an int32
    initializer behind a DequantizeLinear, in graph order."""
    inits = {i.name: i for i in qmodel.graph.initializer}
    producer = {o: n for n in qmodel.graph.node for o in n.output}
    found = []
    for node in qmodel.graph.node:
        if node.op_type not in CHANNEL_AXIS or len(node.input) < 3 or not node.input[2]:
            continue
        dq = producer.get(node.input[2])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue
        bias = inits[dq.input[0]]
        if bias.data_type != onnx.TensorProto.INT32 or dq.input[1] not in inits:
            continue
        scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float64)
        found.append(Target(node.name, node.output[0], bias.name, scale, CHANNEL_AXIS[node.op_type]))
    return found


def correct_biases(float_model: onnx.ModelProto, qmodel: onnx.ModelProto, batches: list[dict],
                   progress: bool = True) -> BiasCorrection:
    """The float shift to add to each target's bias so that its output's per-channel mean on
    ``batches`` matches ``float_model``'s (the prepared model ``qmodel`` was quantized from: nodes
    keep their names)."""
    start = time.perf_counter()
    result = BiasCorrection(samples=batches.samples)
    found = targets(qmodel)
    float_outputs = {n.name: n.output[0] for n in float_model.graph.node}
    found = [t for t in found if t.node in float_outputs]
    if not found:
        result.seconds = time.perf_counter() - start
        return result
    reference = []
    for chunk in _reference_chunks(float_model, found, [float_outputs[t.node] for t in found], batches):
        reference += _channel_means(float_model, [float_outputs[t.node] for t in chunk],
                                    [t.axis for t in chunk], batches)
    work = onnx.ModelProto()
    work.CopyFrom(qmodel)
    inits = {i.name: i for i in work.graph.initializer}
    pieces = _Pieces(work, batches) if _Pieces.applies(work) else None
    with progress_bar(len(found), "bias correction", progress, unit="op") as bar:
        for target, (want, rms) in zip(found, reference):
            if pieces is not None:
                got, _ = pieces.means(target.output, target.axis, target.bias)
            else:
                got, _ = _channel_means(_prefix(work, target.output), [target.output], [target.axis],
                                        batches)[0]
            steps = np.rint((want - got) / target.scale)
            bias = inits[target.bias]
            q = numpy_helper.to_array(bias).astype(np.int64)
            q = np.clip(q + steps.astype(np.int64), -(2**31), 2**31 - 1)
            bias.CopyFrom(numpy_helper.from_array(q.astype(np.int32), target.bias))
            delta = steps * target.scale
            result.deltas[target.node] = delta
            shift = float(np.abs(delta).max()) / rms if rms > 0 else 0.0
            if shift > result.largest[1]:
                result.largest = (target.node, shift)
            bar.update(1)
    result.seconds = time.perf_counter() - start
    return result


class _Pieces:
    """The QDQ model run piece by piece for ``correct_biases``: the tensors whose values can no
    longer change are kept (per batch), and each target's output is computed from them by the
    nodes between, not by the whole prefix again. A tensor is final once every target above it is
    corrected; targets go in graph order, and a target's ancestors come before it, so every node
    computed for target ``i`` except target ``i`` itself (its bias is about to move) is final then.
    The same onnxruntime kernels on the same inputs: the same means as the prefixes, in a time of
    about one pass over the model instead of one per target. Kept values are dropped once every
    node reading them is final."""

    def __init__(self, model: onnx.ModelProto, batches):
        self.model, self.runs = model, Runs(batches)
        self.nodes = list(model.graph.node)
        self.producer = {o: i for i, n in enumerate(self.nodes) for o in n.output}
        self.readers: dict[str, set[int]] = {}
        for i, n in enumerate(self.nodes):
            for name in n.input:
                self.readers.setdefault(name, set()).add(i)
        self.inits = {i.name for i in model.graph.initializer}
        typed = model if model.graph.value_info else onnx.shape_inference.infer_shapes(model)
        self.types = {vi.name: vi.type.tensor_type.elem_type
                      for vi in [*typed.graph.value_info, *typed.graph.output, *typed.graph.input]}
        pixels = pixel_inputs(model)
        self.values = [dict(feeds_for(pixels, feeds)) for feeds in self.runs.feeds]  # graph inputs, then kept tensors
        self.final: set[int] = set()

    @staticmethod
    def applies(model: onnx.ModelProto) -> bool:
        """Not for a graph with If/Loop/Scan (their bodies read outer tensors a piece would have to
        pass in by name): those run by prefixes."""
        return not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                       for n in model.graph.node for a in n.attribute)

    def means(self, tensor: str, axis: int, bias: str) -> tuple[np.ndarray, float]:
        """Per-channel mean and RMS of ``tensor`` (a target's output, its bias initializer ``bias``)."""
        known = self.values[0]
        piece, stack = set(), [tensor]
        while stack:
            name = stack.pop()
            if not name or name in known or name in self.inits:
                continue
            index = self.producer[name]
            if index not in piece:
                piece.add(index)
                stack.extend(self.nodes[index].input)
        order = sorted(piece)
        inputs = list(dict.fromkeys(n for i in order for n in self.nodes[i].input if n in known))
        # the target runs again for the next piece, from kept inputs, with its corrected bias: it
        # and the node reading that bias are not final
        target = self.producer[tensor]
        moving = {target} | {i for i in piece if bias in self.nodes[i].input}
        done = self.final | (piece - moving)
        keep = [o for i in order if i not in moving for o in self.nodes[i].output
                if o and any(r not in done for r in self.readers.get(o, ()))]
        used = {n for i in order for n in self.nodes[i].input}
        graph = helper.make_graph(
            [self.nodes[i] for i in order], "piece",
            [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(known[n].dtype), None)
             for n in inputs],
            [helper.make_tensor_value_info(n, self.types.get(n, onnx.TensorProto.FLOAT), None)
             for n in [tensor, *keep]],
            [i for i in self.model.graph.initializer if i.name in used])
        model = helper.make_model(graph, opset_imports=list(self.model.opset_import))
        model.ir_version = self.model.ir_version
        mean = _Mean(axis)
        try:
            runs = self.runs.each(self.runs.session(model.SerializeToString()), [tensor, *keep],
                                  [{n: values[n] for n in inputs} for values in self.values])
            for values, got in zip(self.values, runs):  # in the samples' order: the same sums
                mean.add(got[0])
                values.update(zip(keep, got[1:]))
        except Exception as e:
            raise QtoolError(f"bias correction: onnxruntime failed: {first_line(e)}") from None
        self.final |= piece - moving
        for name in list(known):  # nothing left to read it
            if name in self.readers and self.readers[name] <= self.final:
                for values in self.values:
                    del values[name]
        return mean.result()


class _Mean:
    """Per-channel mean (float64) along ``axis`` and overall RMS of the arrays added, batch by batch."""

    def __init__(self, axis: int):
        self.axis, self.total, self.squares, self.count = axis, None, 0.0, 0

    def add(self, y: np.ndarray) -> None:
        y = np.moveaxis(y.astype(np.float64), self.axis, -1).reshape(-1, y.shape[self.axis])
        self.total = y.sum(axis=0) if self.total is None else self.total + y.sum(axis=0)
        self.squares += float((y * y).sum())
        self.count += y.shape[0]

    def result(self) -> tuple[np.ndarray, float]:
        return self.total / self.count, (self.squares / (self.count * len(self.total))) ** 0.5


def _prefix(model: onnx.ModelProto, tensor: str) -> onnx.ModelProto:
    """The part of ``model`` that computes ``tensor``, with it as the only output. A node with
    subgraphs (If, Loop, Scan) needs what they read from around it too (``node_reads``): without
    those producers onnxruntime refuses the part (Silero VAD's If branches read the decoder's
    tensors)."""
    producer = {o: i for i, n in enumerate(model.graph.node) for o in n.output}
    needed, stack = set(), [tensor]
    while stack:
        index = producer.get(stack.pop())
        if index is None or index in needed:
            continue
        needed.add(index)
        stack.extend(node_reads(model.graph.node[index]))
    nodes = [n for i, n in enumerate(model.graph.node) if i in needed]
    used = {name for n in nodes for name in node_reads(n)}
    graph = helper.make_graph(nodes, model.graph.name, list(model.graph.input),
                              [helper.make_tensor_value_info(tensor, onnx.TensorProto.FLOAT, None)],
                              [i for i in model.graph.initializer if i.name in used])
    out = helper.make_model(graph, opset_imports=list(model.opset_import))
    out.ir_version = model.ir_version
    out.functions.extend(model.functions)
    out.metadata_props.extend(model.metadata_props)  # an --input-pixels model's preprocessing
    return out


def _reference_chunks(model: onnx.ModelProto, found: list, names: list[str], batches) -> list[list]:
    """``found`` (targets, their float outputs ``names``) in runs of consecutive ones whose outputs
    hold at most REFERENCE_BYTES of one sample, by the sizes shape inference gives at the first
    feed's input shapes; REFERENCE_CHUNK at a time where any size is unknown. Each tensor's means
    are the same sums whatever else a run returns: only the number of float runs changes (PP-OCRv4
    rec: 38 targets, three runs before, one now)."""
    first = list(batches[:1])  # its samples one by one where they split (qtool/runs.py): the first
    sizes = one_feed_bytes(model, names, Runs(Batches(first, 0, getattr(batches, "axes", None))).feeds[:1])
    if sizes is None or any(n not in sizes for n in names):
        return [found[i:i + REFERENCE_CHUNK] for i in range(0, len(found), REFERENCE_CHUNK)]
    chunks, held = [[]], 0
    for target, name in zip(found, names):
        if chunks[-1] and held + sizes[name] > REFERENCE_BYTES:
            chunks.append([])
            held = 0
        chunks[-1].append(target)
        held += sizes[name]
    return chunks


def _channel_means(model: onnx.ModelProto, names: list[str], axes: list[int],
                   batches: list[dict]) -> list[tuple[np.ndarray, float]]:
    """Per-channel mean (float64) and overall RMS of each tensor over all batches."""
    means = [_Mean(axis) for axis in axes]
    runs = Runs(batches)
    try:
        session = runs.session(with_outputs(model, names).SerializeToString())
        pixels = pixel_inputs(model)
        for got in runs.each(session, names, [feeds_for(pixels, feeds) for feeds in runs.feeds]):
            for mean, y in zip(means, got):
                mean.add(y)
    except DataError:
        raise  # the data, said as they are (qtool/pixels.py), not as onnxruntime's failure
    except Exception as e:
        raise QtoolError(f"bias correction: onnxruntime failed: {first_line(e)}") from None
    return [mean.result() for mean in means]


def fit_correction(model_path, table, options, table_name: str, data_path,
                   num_samples: int | None = BIAS_SAMPLES, batch_size: int = 8, progress: bool = True,
                   preprocess=None, holdout: int | None = None, rounded_weights: dict | None = None,
                   channel_ranges: dict | None = None, scored: bool = False) -> BiasCorrection:
    """The bias correction of ``quantize_corrected``, fitted and judged (``BiasCorrection.score_db``:
    the held-out SQNR of the model it gives, where it was judged; ``scored``: also where nothing
    is corrected)."""
    start = time.perf_counter()
    float_model = prepare_file(model_path)
    fit_count = BIAS_SAMPLES if num_samples is None else num_samples
    held_count = fit_count if holdout is None else holdout
    fit, held = split_batches(float_model, data_path, fit_count, held_count, batch_size, preprocess)
    every = {n.name: 0.0 for n in float_model.graph.node if n.op_type in CHANNEL_AXIS}
    qdq = replace(options, format="qdq", strict=False)
    work, _ = quantize(model_path, table, qdq, table_name, every, rounded_weights, channel_ranges, scored_only=True)
    correction = correct_biases(float_model, work, fit, progress)
    if held is not None and (correction.deltas or scored):
        evaluator = Evaluator(float_model, held)
        correction.plain_db = evaluator.sqnr(work)  # the zero shifts change no integer
        correction.scored = evaluator.scored
    if held is not None and correction.deltas:
        correction.heldout = held.samples
        best, best_db = 0.0, correction.plain_db
        for factor in FACTORS:
            correction.factor = factor
            candidate, _ = quantize(model_path, table, qdq, table_name, correction.applied, rounded_weights,
                                    channel_ranges, scored_only=True)
            correction.scores[factor] = db = evaluator.sqnr(candidate)
            if db > best_db:
                best, best_db = factor, db
        correction.factor = best
    elif correction.deltas and holdout != 0:
        correction.factor = 0.0
        correction.reason = (f"DATA has no sample left to judge it on ({fit.samples} used to fit); "
                             f"--holdout 0 applies it unjudged")
    elif correction.deltas:
        correction.reason = "--holdout 0: applied as fitted"
    correction.seconds = time.perf_counter() - start
    return correction


def quantize_corrected(model_path, table, options, table_name: str, data_path,
                       num_samples: int | None = BIAS_SAMPLES, batch_size: int = 8, progress: bool = True,
                       preprocess=None, holdout: int | None = None, rounded_weights: dict | None = None,
                       channel_ranges: dict | None = None, correction: BiasCorrection | None = None):
    """``quantize`` with bias correction fitted on ``num_samples`` of DATA and judged on
    ``holdout`` others (None: as many; 0: not judged, applied as fitted), both spread over DATA:
    returns the model, its report (with a ``bias_correction`` entry) and the correction.
    ``rounded_weights``: fitted weight integers (qtool.rounding), ``channel_ranges``: per-channel
    activation ranges (qtool.channels), in every model built here; ``correction``: the one
    ``fit_correction`` gave for these already (the weight rounding's judge fitted it)."""
    fitted_here = correction is None
    if fitted_here:
        correction = fit_correction(model_path, table, options, table_name, data_path, num_samples, batch_size,
                                    progress, preprocess, holdout, rounded_weights, channel_ranges)
    start = time.perf_counter()
    qmodel, report = quantize(model_path, table, options, table_name, correction.applied, rounded_weights,
                              channel_ranges)
    # a correction the weight rounding's judge fitted is in that step's seconds already
    correction.fitted_in_rounding = not fitted_here
    correction.seconds = (correction.seconds if fitted_here else 0.0) + time.perf_counter() - start
    report.bias_correction = correction.to_dict()
    return qmodel, report, correction
