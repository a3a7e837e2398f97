"""``qtool analyze``: which quantized ops cost the model its accuracy.

For every integer op of the QDQ model, onnxruntime measures the model output's SQNR against the
float model on the same samples:

* **only this op quantized**: every other activation's QuantizeLinear -> DequantizeLinear pair
  bypassed and every other weight dequantized back to float;
* **only this op float**: the pairs after its outputs bypassed and its weights float, everything
  else as quantized.

The ops are ranked by the gain of leaving them float (``only float`` minus the fully quantized
SQNR): the first ones are where finer precision pays. Both variants are graph surgery on one QDQ
model (no re-quantization per op), run by onnxruntime with its graph optimizations off, so that
each variant computes exactly what its graph says.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from .sizing import fixed_batch
from .data import load_dataset
from .errors import DataError, QtoolError
from .joins import find_joins, part_map
from .model import all_nodes, batch_hint, first_line, graph_inputs, prepare_file, subgraphs
from .ops.flat import saturation_window
from .pixels import feeds_for, pixel_inputs
from .prefix import SharedPrefix
from .qparams import real_entries
from .runs import Runs, as_written_bytes
from .report import column_width, finite, progress_bar

FENCE_OPS = ("QuantizeLinear", "DequantizeLinear")
WIDER_THAN_FENCE = 1.01  # a calibrated range beyond its 8-bit fence by more than rounding: cut (QdqModel.widened)


@dataclass(frozen=True)
class QuantizedOp:
    node: str
    op_type: str
    activations: tuple[str, ...]  # the float tensors fenced at its inputs and outputs
    outputs: tuple[str, ...]  # the fenced float tensors it writes
    weights: tuple[str, ...]  # outputs of the DequantizeLinear of its constant inputs


def _constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    value = next((a for a in node.attribute if a.name == "value" and a.HasField("t")), None)
    return None if value is None else value.t


class QdqModel:
    """A QDQ model whose fences and quantized weights can be removed selectively.

    Float weights come from ``float_model`` (the prepared model it was quantized from): each
    quantized node keeps its name, so input ``i`` of node ``n`` there is the float original of the
    DequantizeLinear output at input ``i`` of ``n`` here."""

    def __init__(self, qmodel: onnx.ModelProto, float_model: onnx.ModelProto):
        self.model = qmodel
        graph = qmodel.graph
        self.inits = {i.name: i for i in graph.initializer}
        self.graph_outputs = {o.name for o in graph.output}
        # the ops inside If/Loop/Scan bodies too (every value name is unique across the model: qtool's
        # preparation sees to it), each body's own constants with the main graph's
        everything = list(all_nodes(graph))
        for node in everything:
            for sub in subgraphs(node):
                self.inits.update({i.name: i for i in sub.initializer})
                self.graph_outputs.update(o.name for o in sub.output)
        producer = {o: n for n in everything for o in n.output}
        self.fences: dict[str, list[onnx.NodeProto]] = {}  # float tensor -> its Q and DQ nodes
        self.fenced_by: dict[str, str] = {}  # DequantizeLinear output -> the float tensor
        self.weights: dict[str, onnx.NodeProto] = {}  # DequantizeLinear output -> node
        for node in everything:
            if node.op_type != "DequantizeLinear":
                continue
            if node.input[0] in self.inits:
                self.weights[node.output[0]] = node
                continue
            q = producer.get(node.input[0])
            if q is not None and q.op_type == "QuantizeLinear":
                fence = self.fences.setdefault(q.input[0], [])
                if q not in fence:  # a tensor quantized in the main graph and in a body: two of them
                    fence.append(q)
                fence.append(node)
                self.fenced_by[node.output[0]] = q.input[0]
        float_inits = {i.name: i for i in float_model.graph.initializer}
        float_nodes = {n.name: n for n in all_nodes(float_model.graph)}
        for node in float_nodes.values():  # a body's constants (Constant nodes in the float model)
            for sub in subgraphs(node):
                float_inits.update({i.name: i for i in sub.initializer})
                float_inits.update({n.output[0]: _constant_tensor(n) for n in sub.node
                                    if n.op_type == "Constant" and _constant_tensor(n) is not None})
        self.float_weights: dict[str, onnx.TensorProto] = {}  # DequantizeLinear output -> original
        for node in everything:
            original = float_nodes.get(node.name)
            if original is None or node.op_type in FENCE_OPS:
                continue
            for i, name in enumerate(node.input):
                if name in self.weights and i < len(original.input) and original.input[i] in float_inits:
                    self.float_weights[name] = float_inits[original.input[i]]
        self.wide: dict[str, tuple[onnx.NodeProto, list[onnx.TensorProto]]] = {}  # take_wide_constants
        self.ops: list[QuantizedOp] = []
        for node in everything:
            if node.op_type in FENCE_OPS:
                continue
            outputs = tuple(o for o in node.output if o in self.fences)
            if not outputs:  # a float node between fences
                continue
            inputs = tuple(self.fenced_by[i] for i in node.input if i in self.fenced_by)
            weights = tuple(i for i in node.input if i in self.weights)
            self.ops.append(QuantizedOp(node.name, node.op_type, tuple(dict.fromkeys(inputs + outputs)),
                                        outputs, weights))

    def ablated(self, float_tensors, float_weights) -> onnx.ModelProto:
        """The model with the fences of ``float_tensors`` bypassed (their readers get the float
        tensor) and the weights of ``float_weights`` (DequantizeLinear outputs) made float."""
        float_tensors, float_weights = set(float_tensors), set(float_weights)
        out = onnx.ModelProto()
        out.CopyFrom(self.model)
        dropped, rename, replaced = set(), {}, {}
        for tensor in float_tensors & set(self.fences):
            for fence in self.fences[tensor]:
                dropped.add(fence.name)
                if fence.op_type == "QuantizeLinear":
                    continue
                if fence.output[0] in self.graph_outputs:  # keep the (body's) output name, in place
                    replaced[fence.name] = helper.make_node("Identity", [tensor], [fence.output[0]],
                                                            name=f"{fence.name}_bypassed")
                else:
                    rename[fence.output[0]] = tensor
        for name in float_weights & set(self.float_weights):
            dropped.add(self.weights[name].name)
            original = onnx.TensorProto()
            original.CopyFrom(self.float_weights[name])
            original.name = name
            out.graph.initializer.append(original)

        def resolve(name: str) -> str:  # a body's fence of an outer fence's output: to the float tensor
            seen = set()
            while name in rename and name not in seen:
                seen.add(name)
                name = rename[name]
            return name

        for fence_name, node in replaced.items():
            node.input[0] = resolve(node.input[0])

        def bypass(graph: onnx.GraphProto) -> None:  # in this graph and its bodies
            nodes = []
            for node in graph.node:
                if node.name in replaced:
                    nodes.append(replaced[node.name])
                    continue
                if node.name in dropped:
                    continue
                for i, name in enumerate(node.input):
                    node.input[i] = resolve(name)
                for sub in subgraphs(node):
                    bypass(sub)
                nodes.append(node)
            del graph.node[:]
            graph.node.extend(nodes)

        bypass(out.graph)
        return out

    def only_quantized(self, ops) -> onnx.ModelProto:
        """The model with only ``ops`` quantized: every other op's fences bypassed and weights float."""
        return self.ablated(self.all_tensors() - {t for op in ops for t in op.activations},
                            self.all_weights() - {w for op in ops for w in op.weights})

    def left_float(self, ops) -> onnx.ModelProto:
        """The model with ``ops`` float: their outputs' fences bypassed and their weights float."""
        return self.ablated({t for op in ops for t in op.outputs}, {w for op in ops for w in op.weights})

    def take_wide_constants(self, reference: onnx.ModelProto) -> None:
        """Remember the constants ``reference`` stores int16 and this model int8: ``reference`` is
        the same model quantized with every op int16, where quantize widens a constant operand (an
        Add's bias or position table, a Mul's factor) or an embedding table whose every reader has
        an int16 output. ``widened`` then swaps each in where all its readers are widened, as
        quantize would write that model (a search scored without them ranks the int16 ops with int8
        constants: all-MiniLM-L6-v2 every op int16 29.99 dB scored, 31.28 dB written)."""
        inits = {i.name: i for i in reference.graph.initializer}
        for node in all_nodes(reference.graph):
            for sub in subgraphs(node):
                inits.update({i.name: i for i in sub.initializer})
        for node in all_nodes(reference.graph):
            name = node.output[0] if node.op_type == "DequantizeLinear" else ""
            mine = self.weights.get(name)
            if mine is None or node.input[0] not in inits or mine.input[0] not in self.inits:
                continue
            if inits[node.input[0]].data_type == onnx.TensorProto.INT16 != self.inits[mine.input[0]].data_type:
                self.wide[name] = (node, [inits[i] for i in node.input])

    def widened(self, tensors, ranges: dict[str, float] | None = None) -> onnx.ModelProto:
        """The model with the fences of ``tensors`` made int16 (symmetric, zero point 0) over the
        range their 8-bit (S, Z) covers: what quantize writes for ops promoted to int16, up to the
        range's rounding. ``ranges``: a Sigmoid or Tanh input's calibrated max |x|, which the
        int16 fence covers where the 8-bit one covers clearly less (quantize cuts an 8-bit one to
        where the output saturates, and an int16 one not). Below opset 21 the fences become
        com.microsoft ops."""
        out = onnx.ModelProto()
        out.CopyFrom(self.model)
        inits = {i.name: i for i in out.graph.initializer}
        for node in all_nodes(out.graph):
            for sub in subgraphs(node):
                inits.update({i.name: i for i in sub.initializer})
        nodes = {n.name: n for n in all_nodes(out.graph)}
        opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), 0)
        domain = "" if opset >= 21 else "com.microsoft"
        for tensor in sorted(set(tensors) & set(self.fences)):
            q = self.fences[tensor][0]
            scale = float(numpy_helper.to_array(inits[q.input[1]]))
            zero = numpy_helper.to_array(inits[q.input[2]])
            lo, hi = np.iinfo(zero.dtype).min, np.iinfo(zero.dtype).max
            reach = scale * max(abs(lo - int(zero)), abs(hi - int(zero)))
            calibrated = (ranges or {}).get(tensor, 0.0)
            if calibrated > reach * WIDER_THAN_FENCE:
                reach = calibrated
            scale_name, zero_name = f"{tensor}_int16_scale", f"{tensor}_int16_zero_point"
            scale16 = np.array(reach / np.iinfo(np.int16).max, np.float32)
            out.graph.initializer.extend([numpy_helper.from_array(scale16, scale_name),
                                          numpy_helper.from_array(np.array(0, np.int16), zero_name)])
            for fence in self.fences[tensor]:
                node = nodes[fence.name]
                node.input[1], node.input[2], node.domain = scale_name, zero_name, domain
        self._widen_constants(out, set(tensors), nodes)
        if domain and all(o.domain != domain for o in out.opset_import):
            out.opset_import.append(helper.make_opsetid(domain, 1))
        retyped = {f.output[0] for t in set(tensors) & set(self.fences) for f in self.fences[t]
                   if f.op_type == "QuantizeLinear"}
        for graph in [out.graph, *(sub for node in all_nodes(out.graph) for sub in subgraphs(node))]:
            kept = [vi for vi in graph.value_info if vi.name not in retyped]  # their 8-bit type
            del graph.value_info[:]
            graph.value_info.extend(kept)
        return out

    def _widen_constants(self, out: onnx.ModelProto, tensors: set[str], nodes: dict) -> None:
        """In ``out`` (a copy of this model), the constants of ``take_wide_constants`` int16 where
        every op reading them writes only ``tensors``."""
        if not self.wide:
            return
        wide_ops = {op.node for op in self.ops if set(op.outputs) <= tensors}
        readers: dict[str, set[str]] = {}
        for node in all_nodes(out.graph):
            for name in node.input:
                readers.setdefault(name, set()).add(node.name)
        for name, (reference, constants) in sorted(self.wide.items()):
            if not readers.get(name) or not readers[name] <= wide_ops:
                continue
            node = nodes[self.weights[name].name]
            for i, constant in enumerate(constants):
                copy = onnx.TensorProto()
                copy.CopyFrom(constant)
                copy.name = f"{constant.name}_int16"
                out.graph.initializer.append(copy)
                node.input[i] = copy.name
            del node.attribute[:]
            node.attribute.extend(reference.attribute)
            node.domain = reference.domain

    def all_tensors(self) -> set[str]:
        return set(self.fences)

    def all_weights(self) -> set[str]:
        """The quantized constants that have a float original (weights, biases, constant operands)."""
        return set(self.float_weights)


def sqnr_db(reference: list[np.ndarray], got: list[np.ndarray]) -> float:
    signal = sum(float((r.astype(np.float64) ** 2).sum()) for r in reference)
    noise = sum(float(((r.astype(np.float64) - g) ** 2).sum()) for r, g in zip(reference, got))
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def as_written_session(model: onnx.ModelProto) -> ort.InferenceSession:
    """onnxruntime without graph rewrites: its optimizers change the arithmetic of mixed graphs
    (float weights between activation fences measured 7.0 dB with them, 12.2 dB without, on
    PP-OCRv4 rec), and each variant of a QDQ model must compute what its graph says. The judged
    steps run their variants through ``qtool.runs.Runs``, which makes sessions the same way."""
    return as_written_bytes(model.SerializeToString())


SATURATING = ("Softmax", "LogSoftmax", "Sigmoid")
SHAPE_ONLY = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity")


def scored_node(model: onnx.ModelProto) -> onnx.NodeProto | None:
    """The Softmax/Sigmoid that makes the first output (through shape-only ops), if any."""
    return saturating_producer(model, model.graph.output[0].name)


def saturating_producer(model: onnx.ModelProto, output: str) -> onnx.NodeProto | None:
    """The Softmax/Sigmoid that makes ``output`` (through shape-only ops), if any.

    Its input (the logits) is what variants are scored on: a probability near 0 or 1 hides most
    of a difference, and a few flipped maxima dominate the rest (on PP-OCRv4 rec, two models
    whose only difference is the rounding of three biases scored 28.5 and 17.8 dB on the
    probabilities of four samples)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    node = producer.get(output)
    while node is not None and node.op_type in SHAPE_ONLY:
        node = producer.get(node.input[0])
    return node if node is not None and node.op_type in SATURATING else None


def sigmoid_window(logits: list[np.ndarray]) -> tuple[float, float] | None:
    """The logits over which a Sigmoid output still moves by a quarter of an 8-bit step of its
    range on these samples (``[y_lo, y_hi]`` the float output's, ``s = (y_hi - y_lo) / 255``):
    ``[logit(y_lo + s/4), logit(y_hi - s/4)]``, as quantize cuts a Sigmoid input
    (``_saturated_input``). None where there is no such range."""
    lo, hi = np.inf, -np.inf
    for x in logits:
        if np.size(x):
            x = np.asarray(x, np.float64)
            lo, hi = min(lo, float(x.min())), max(hi, float(x.max()))
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return None
    y_lo, y_hi = 1 / (1 + np.exp(-lo)), 1 / (1 + np.exp(-hi))
    window = saturation_window("Sigmoid", y_lo, y_hi, (y_hi - y_lo) / 255)
    return window if window[0] < window[1] else None


def with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """``model`` with exactly ``names`` as its outputs (a copy, unless they already are)."""
    if [o.name for o in model.graph.output] == names:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.output[:]
    out.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    return out


class Evaluator:
    """Runs models on fixed batches and scores them against the float model: the worst SQNR of
    every float graph output, where an output is a Softmax or Sigmoid (through shape-only ops) its
    input (the logits) instead, and where an output joins tensors (a Concat, qtool/joins.py) each
    part on its own. A detector whose boxes survive while its class scores are lost scores low."""

    # The judged steps of quantize --data each build the evaluators of the same fit and held-out
    # samples, and score the model a step left unchanged again. Inside ``keeping()`` the float
    # references and the scores are kept by content (the float model's bytes, the samples'
    # bytes, the scored model's bytes), so a second evaluator or score of the same things costs a
    # hash; outside it (and after it) nothing is kept between evaluators.
    _KEPT: OrderedDict | None = None
    KEPT_EVALUATORS = 4
    KEPT_SCORES = 64

    @classmethod
    @contextmanager
    def keeping(cls):
        """Evaluators made inside share what they computed (see above); the store is dropped at
        the end. Nested uses share the outermost one."""
        if cls._KEPT is not None:
            yield
            return
        cls._KEPT = OrderedDict()
        try:
            yield
        finally:
            cls._KEPT = None

    def __init__(self, float_model: onnx.ModelProto, batches: list[dict]):
        key = _batches_digest(batches) if Evaluator._KEPT is not None else None
        if key is not None:
            key = (_digest(float_model.SerializeToString()), key)
        kept = None if key is None else self._KEPT.get(key)
        if kept is not None:
            self._KEPT.move_to_end(key)
            self.__dict__.update(kept)
            self.batches = batches
            return
        self._build(float_model, batches)
        self._scores = OrderedDict()
        if key is None or Evaluator._KEPT is None:
            return
        # shared with every later evaluator of these samples: read-only
        for value in [v for run in self.reference for v in run] + [w for _, where in self.pieces for w in where]:
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
        self._KEPT[key] = {k: v for k, v in self.__dict__.items() if k != "batches"}
        while len(self._KEPT) > self.KEPT_EVALUATORS:
            self._KEPT.popitem(last=False)

    _prefixes: tuple = ()

    def share_prefixes(self, *bases: onnx.ModelProto) -> None:
        """Models scored from here on run from the first node where they differ from the one of
        ``bases`` they share most with (qtool/prefix.py): the same numbers, less work."""
        self._prefixes = tuple(SharedPrefix(base, self.runs) for base in bases)

    def _build(self, float_model: onnx.ModelProto, batches: list[dict]) -> None:
        self.batches = batches
        self.runs = Runs(batches)  # what each model runs on: its samples one by one where it can
        self.items = scored_items(float_model)  # (label, node whose input 0 is scored | None, output)
        joins = {name: join for name, join in find_joins(float_model).items()
                 if any(node is None and out == name for _, node, out in self.items)}
        self.scored = (self.items[0][0] if len(self.items) == 1 and not joins else
                       "the worst of " + ", ".join(
                           label if out not in joins else f"each part of {label} (Concat "
                           f"'{joins[out].node}')" for label, _, out in self.items))
        placing = sorted({n for join in joins.values() for n in join.tensors()})
        runs = self._run(float_model, placing)
        self.reference = [run[:len(self.items)] for run in runs]
        # each scored piece: (item index, per batch the flat indices of its values or None: all)
        self.pieces: list[tuple[int, list[np.ndarray | None]]] = []
        for i, (_, node, out) in enumerate(self.items):
            join = joins.get(out) if node is None else None
            placed = None
            if join is not None:
                placed = []
                for run in runs:
                    shapes = dict(zip(placing, (r.shape for r in run[len(self.items):])))
                    labels = part_map(join, shapes)
                    if labels is None or labels.shape != run[i].shape:
                        placed = None
                        break
                    placed.append(np.ravel(labels))
            if placed is None:
                self.pieces.append((i, [None] * len(runs)))
            else:
                self.pieces += [(i, [np.flatnonzero(labels == p) for labels in placed])
                                for p in range(len(join.parts()))]
        # entries of no real value (an output the model pads with -inf) are no part of a piece, as
        # verify leaves them out: found once here, on the float reference
        self.pieces = [(i, [self._real(i, where, b) for b, where in enumerate(wheres)]) for i, wheres in self.pieces]
        # a piece that is zero in float has no SQNR to keep; it does not decide the score
        self.pieces = [p for p in self.pieces if self._energy(p, self.reference) > 0] or self.pieces[:1]
        ops = {n.name: n.op_type for n in float_model.graph.node}
        self.windows = [sigmoid_window([run[i] for run in self.reference])
                        if node is not None and ops.get(node) == "Sigmoid" else None
                        for i, (_, node, _) in enumerate(self.items)]

    def _run(self, model: onnx.ModelProto, extra: list[str] = (), serialized: bytes | None = None,
             cut: int | None = None) -> list[list[np.ndarray]]:
        names = []
        for _, node_name, out in self.items:
            if node_name is None:
                names.append(out)
                continue
            node = next((n for n in model.graph.node if n.name == node_name), None)
            if node is None:
                raise QtoolError(f"the model variant has no node '{node_name}' to score")
            names.append(node.input[0])
        names += [n for n in extra]
        given = model
        pixels = pixel_inputs(model)
        if self._prefixes and not pixels:
            if cut is None:
                cut, prefix = max(((p.shared(model), p) for p in self._prefixes), key=lambda c: c[0])
            else:  # a cut the caller found (sqnrs: the base's, its variants')
                prefix = self._prefixes[0]
            try:
                shared = prefix.run(model, names, cut)
            except Exception:  # the whole run below says what fails, or succeeds
                shared = None
            if shared is not None:
                return shared
        model = with_outputs(model, names)
        try:
            session = self.runs.session(serialized if model is given and serialized is not None
                                        else model.SerializeToString())
            return self.runs.run(session, names, [feeds_for(pixels, feeds) for feeds in self.runs.feeds])
        except DataError:
            raise  # the data, said as they are (qtool/pixels.py), not as onnxruntime's failure
        except Exception as e:
            hint = (" (on one sample: these steps run each sample alone, so a model that needs several in "
                    "one run, such as the frames of one sequence, cannot be scored; quantize it without "
                    "--data)") if self.runs.split else batch_hint(self.batches[0] if self.batches else {})
            raise QtoolError(f"onnxruntime failed on a variant of the model: {first_line(e)}{hint}") from None

    def _real(self, i: int, where: np.ndarray | None, b: int) -> np.ndarray | None:
        """``where`` (flat indices into output ``i`` of batch ``b``, None: all) without the entries
        whose float reference is no real value (``qparams.real_entries``)."""
        value = np.ravel(self.reference[b][i])
        real = real_entries(value if where is None else value[where])
        if real is None:
            return where
        return (np.arange(real.size) if where is None else where)[real]

    @staticmethod
    def _values(piece, runs, b):
        i, where = piece
        value = np.ravel(runs[b][i])
        return value if where[b] is None else value[where[b]]

    def _energy(self, piece, runs) -> float:
        return sum(float((self._values(piece, runs, b).astype(np.float64) ** 2).sum())
                   for b in range(len(runs)))

    def scores(self, model: onnx.ModelProto, cut: int | None = None) -> list[float]:
        """The SQNR of each scored piece (an output, its logits, or one part of a join)."""
        serialized = model.SerializeToString()
        key = _digest(serialized)
        if key not in self._scores:
            self._scores[key] = self._score(model, serialized, cut)
            while len(self._scores) > self.KEPT_SCORES:
                self._scores.popitem(last=False)
        return list(self._scores[key])

    def sqnrs(self, base: onnx.ModelProto, *variants: onnx.ModelProto) -> list[float]:
        """``sqnr`` of ``base`` and of each of ``variants``, where the variants share a first part
        of ``base``'s nodes (a judged step's candidates differ from the model it started from
        where the step changed something): that part runs once, the base and each variant from
        where they part (qtool/prefix.py). The same numbers as scoring each alone: on PP-OCRv4
        rec the int16 placement's groups and the fitted MatMul weights sit in its last blocks."""
        if not variants or pixel_inputs(base):
            return [self.sqnr(m) for m in (base, *variants)]
        kept = self._prefixes
        prefix = SharedPrefix(base, self.runs)
        self._prefixes = (prefix,)
        try:
            cuts = [prefix.shared(v) for v in variants]  # each found once (a cut at the end: run whole)
            return [min(self.scores(m, cut)) for m, cut in ((base, min(cuts)), *zip(variants, cuts))]
        finally:
            self._prefixes = kept

    def _score(self, model: onnx.ModelProto, serialized: bytes | None = None, cut: int | None = None
               ) -> list[float]:
        got = self._run(model, serialized=serialized, cut=cut)
        out = []
        for piece in self.pieces:
            i, b_range = piece[0], range(len(got))
            if any(np.shape(got[b][i]) != np.shape(self.reference[b][i]) for b in b_range):
                out.append(-math.inf)  # a size that depends on values came out different
                continue
            ref = [self._values(piece, self.reference, b) for b in b_range]
            values = [self._values(piece, got, b) for b in b_range]
            window = self.windows[i]
            if window is not None:  # logits where the probability no longer moves: equal
                ref, values = [np.clip(r, *window) for r in ref], [np.clip(v, *window) for v in values]
            out.append(sqnr_db(ref, values))
        return out

    def sqnr(self, model: onnx.ModelProto) -> float:
        return min(self.scores(model))


def _batches_digest(batches: list[dict]) -> bytes | None:
    """The batches' names, types, shapes and values, in order; None where a value is no plain
    array (an object array's bytes are addresses)."""
    chunks = []
    for feeds in batches:
        for name, value in feeds.items():
            value = np.ascontiguousarray(value)
            if value.dtype.hasobject:
                return None
            chunks += [name.encode(), f"{value.dtype.str}{value.shape}".encode(), value.tobytes()]
        chunks.append(b"/")
    return _digest(*chunks)


def _digest(*chunks: bytes) -> bytes:
    h = hashlib.sha256()  # on CPUs with SHA instructions (AMD Zen, Intel since Ice Lake) about twice blake2b's speed
    for chunk in chunks:
        h.update(len(chunk).to_bytes(8, "little"))
        h.update(chunk)
    return h.digest()


def scored_items(model: onnx.ModelProto) -> list[tuple[str, str | None, str]]:
    """What Evaluator scores: per float graph output (the first one when none is float), a label,
    the Softmax/Sigmoid whose input is scored instead (None: the output itself) and the output."""
    outputs = [o for o in model.graph.output
               if o.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                   onnx.TensorProto.DOUBLE, 0)] or model.graph.output[:1]
    items = []
    for output in outputs:
        node = saturating_producer(model, output.name)
        if node is not None:
            items.append((f"the logits '{node.input[0]}' (input of {node.op_type} '{node.name}')",
                          node.name, output.name))
        else:
            items.append((f"output '{output.name}'", None, output.name))
    return items


@dataclass
class OpSensitivity:
    op_type: str
    node: str
    only_quantized_db: float  # this op alone quantized
    only_float_db: float  # everything but this op quantized
    gain_db: float  # only_float_db - the fully quantized model's

    def to_dict(self) -> dict:
        return {"op_type": self.op_type, "node": self.node,
                "only_quantized_db": finite(self.only_quantized_db),
                "only_float_db": finite(self.only_float_db), "gain_db": finite(self.gain_db)}


@dataclass
class GroupSensitivity:
    """A run of consecutive ops (graph order) left float together: what the group costs."""
    first: str  # its first and last ops' nodes
    last: str
    count: int
    only_float_db: float  # everything but this group quantized
    gain_db: float  # only_float_db - the fully quantized model's
    expanded: bool  # its ops were scored one by one

    def to_dict(self) -> dict:
        return {"first": self.first, "last": self.last, "ops": self.count,
                "only_float_db": finite(self.only_float_db), "gain_db": finite(self.gain_db),
                "scored_one_by_one": self.expanded}


@dataclass
class Analysis:
    samples: int
    quantized_db: float  # the fully quantized model
    weights_only_db: float  # only the weights quantized
    activations_only_db: float  # only the activations quantized
    ops: list[OpSensitivity] = field(default_factory=list)  # ranked, largest gain first
    seconds: float = 0.0
    scored: str = "the output"  # the tensor SQNR is measured on (Evaluator.scored)
    groups: list[GroupSensitivity] = field(default_factory=list)  # ranked; empty: every op scored
    skipped: int = 0  # ops not scored one by one (in groups that gained less)

    def to_dict(self) -> dict:
        return {"samples": self.samples, "scored": self.scored, "quantized_db": finite(self.quantized_db),
                "weights_only_db": finite(self.weights_only_db),
                "activations_only_db": finite(self.activations_only_db),
                "ops": [o.to_dict() for o in self.ops], "groups": [g.to_dict() for g in self.groups],
                "skipped_ops": self.skipped}


# A model of more ops than this is first scored in groups of consecutive ops (about sqrt(ops)
# each, every group left float together, one run each); then the ops of the groups that gained
# most are scored one by one (two runs each) until at least EXPANDED_OPS are. PP-OCRv4 rec's 218
# ops: 15 group runs and 2 x 30 op runs instead of 2 x 218.
GROUP_FROM = 64
EXPANDED_OPS = 24


def evaluation_batches(float_model: onnx.ModelProto, data_path: str | Path, num_samples: int | None,
                       batch_size: int, preprocess=None, spread: bool = False) -> "Batches":
    """The first ``num_samples`` of DATA in batches (of the model's own batch size when its batch
    dim is fixed); with ``spread``, that many samples evenly spaced over all of it (sample
    i * len // n), so that a folder sorted by kind is represented."""
    data = load_dataset(data_path, float_model, preprocess)
    total = len(data) if num_samples is None else min(num_samples, len(data))
    fixed = fixed_batch(float_model)
    if fixed:  # a model with a fixed batch dim takes whole batches of it
        if total < fixed:
            raise QtoolError(f"data '{data_path}': the model takes batches of {fixed} samples, "
                             f"and only {total} are used")
        batch_size, total = fixed, total - total % fixed
    axes = None if fixed else _axes(data, float_model)
    if not spread or total == len(data):
        return Batches(data.batches(batch_size, total), samples=total, axes=axes)
    return _picked(data, [i * len(data) // total for i in range(total)], batch_size, axes)


def split_batches(float_model: onnx.ModelProto, data_path: str | Path, fit: int, held: int,
                  batch_size: int, preprocess=None) -> tuple["Batches", "Batches | None"]:
    """Two disjoint sets of DATA's samples, each spread evenly over it: ``fit`` samples that a
    data-driven step fits on and ``held`` others that judge it. With fewer than fit + held samples
    they share DATA in proportion (at least one each); the held-out set is None when ``held`` is 0
    or DATA has a single sample (of the model's fixed batch)."""
    data = load_dataset(data_path, float_model, preprocess)
    pinned = fixed_batch(float_model)  # the model's own batch size, when its batch dim is fixed
    fixed = pinned or 1
    count = len(data) // fixed  # whole batches when the model's batch dim is fixed
    units_fit, units_held = min(fit, len(data)) // fixed, held // fixed
    if units_fit < 1:
        raise QtoolError(f"data '{data_path}': the model takes batches of {fixed} samples, and "
                         f"only {min(fit, len(data))} are used")
    batch_size = pinned or batch_size  # a model fixed at batch 1 takes one sample a run
    axes = None if pinned else _axes(data, float_model)
    if units_held == 0 or count < 2:
        units_fit = min(units_fit, count)
        return _units(data, fixed, _spread(count, units_fit), batch_size, axes), None
    if units_fit + units_held > count:
        units_held = min(count - 1, max(1, round(count * units_held / (units_fit + units_held))))
        units_fit = count - units_held
    chosen = _spread(count, units_fit + units_held)
    # the held-out units spread over the chosen ones: the i-th at position (i + 0.5) * k / n
    at = {int((i + 0.5) * len(chosen) / units_held) for i in range(units_held)}
    held_units = [u for i, u in enumerate(chosen) if i in at]
    fit_units = [u for i, u in enumerate(chosen) if i not in at]
    return (_units(data, fixed, fit_units, batch_size, axes), _units(data, fixed, held_units, batch_size, axes))


def _spread(count: int, n: int) -> list[int]:
    return [i * count // n for i in range(n)]


def _axes(data, model: onnx.ModelProto) -> dict[str, int | None]:
    """Each of ``model``'s inputs' sample axis in ``data`` (``Batches.axes``)."""
    return {vi.name: data.sample_axis(vi.name) for vi in graph_inputs(model)}


def _units(data, fixed: int, units: list[int], batch_size: int, axes) -> "Batches":
    return _picked(data, [u * fixed + k for u in units for k in range(fixed)], batch_size, axes)


def _picked(data, indices: list[int], batch_size: int, axes=None) -> "Batches":
    """The samples ``indices`` of ``data`` in batches of ``batch_size`` (``axes``: see Batches); one
    a batch where each is a whole input."""
    batch_size = 1 if data.whole_samples else batch_size
    picked = [data.batch(i, i + 1) for i in indices]

    def joined(name: str, part: list[dict]) -> np.ndarray:
        axis = data.sample_axis(name)
        return part[0][name] if axis is None else np.concatenate([p[name] for p in part], axis=axis)

    return Batches(({name: joined(name, picked[start:start + batch_size]) for name in picked[0]}
                    for start in range(0, len(indices), batch_size)), samples=len(indices), axes=axes)


class Batches(list):
    """Feeds, batch by batch, and how many samples they hold in all. ``axes``: each input's
    sample axis (``Dataset.sample_axis``) where the model's batch dim is free, so that the
    batches can run sample by sample (qtool/runs.py); None where it is fixed."""

    def __init__(self, feeds, samples: int, axes: dict[str, int | None] | None = None):
        super().__init__(feeds)
        self.samples = samples
        self.axes = axes


def analyze(model_path: str | Path, qmodel: onnx.ModelProto, data_path: str | Path,
            num_samples: int | None = 16, batch_size: int = 8, progress: bool = True,
            preprocess=None, every_op: bool = False) -> Analysis:
    """Per-op sensitivity of ``qmodel`` (qtool's QDQ model of ``model_path``) on DATA
    (``preprocess``: a ``qtool.data.Preprocess`` for a folder of images). A large model's ops
    are scored one by one only in the groups that gain most (``GROUP_FROM``), unless
    ``every_op``."""
    start = time.perf_counter()
    float_model = prepare_file(model_path)
    evaluator = Evaluator(float_model, evaluation_batches(float_model, data_path, num_samples, batch_size,
                                                          preprocess))
    qdq = QdqModel(qmodel, float_model)
    if not qdq.ops:
        raise QtoolError("the quantized model has no QuantizeLinear/DequantizeLinear fences to analyze "
                         "(analyze reads QDQ models: quantize with --format qdq)")
    tensors, weights = qdq.all_tensors(), qdq.all_weights()
    samples = evaluator.batches.samples
    analysis = Analysis(samples, evaluator.sqnr(qmodel), evaluator.sqnr(qdq.ablated(tensors, ())),
                        evaluator.sqnr(qdq.ablated((), weights)), scored=evaluator.scored)
    # a variant below leaves some ops float in the quantized model, or quantizes some in the float
    # one: it runs from its first node that differs from the nearer of the two
    evaluator.share_prefixes(qmodel, qdq.ablated(tensors, weights))
    chosen = qdq.ops
    if not every_op and len(qdq.ops) > GROUP_FROM:
        chosen = _expanded_groups(qdq, evaluator, analysis, progress)
    with progress_bar(len(chosen), "analyze", progress, unit="op") as bar:
        for op in chosen:
            alone = evaluator.sqnr(qdq.only_quantized([op]))
            left_float = evaluator.sqnr(qdq.left_float([op]))
            analysis.ops.append(OpSensitivity(op.op_type, op.node, alone, left_float,
                                              left_float - analysis.quantized_db))
            bar.update(1)
    # ties keep graph order: the ranking is the same on every run
    order = {op.node: i for i, op in enumerate(qdq.ops)}
    analysis.ops.sort(key=lambda o: (-o.gain_db if math.isfinite(o.gain_db) else -math.inf, order[o.node]))
    analysis.seconds = time.perf_counter() - start
    return analysis


def costliest_groups(ops: list, cost, progress: bool, desc: str) -> tuple[list[tuple[float, int, list]], int]:
    """Runs of about sqrt(len(ops)) consecutive ops, each scored once by ``cost(run)`` (higher:
    costlier), as (cost, index, run) costliest first (ties: graph order; NaN last), and how many
    of the first of them hold at least ``EXPANDED_OPS`` ops: those whose ops are scored one by one
    (``analyze`` and the search's ranking)."""
    size = math.ceil(math.sqrt(len(ops)))
    runs = [ops[i:i + size] for i in range(0, len(ops), size)]
    scored = []
    with progress_bar(len(runs), desc, progress, unit="group") as bar:
        for index, run in enumerate(runs):
            scored.append((cost(run), index, run))
            bar.update(1)
    scored.sort(key=lambda g: (-g[0] if not math.isnan(g[0]) else math.inf, g[1]))
    expanded = count = 0
    while expanded < len(scored) and count < EXPANDED_OPS:
        count += len(scored[expanded][2])
        expanded += 1
    return scored, expanded


def _expanded_groups(qdq: QdqModel, evaluator: Evaluator, analysis: Analysis, progress: bool) -> list:
    """Scores runs of consecutive ops left float together (``analysis.groups``, ranked) and
    returns the ops of the best groups, at least ``EXPANDED_OPS`` of them, in graph order."""
    left_float = {}

    def gain(run) -> float:
        left_float[run[0].node] = evaluator.sqnr(qdq.left_float(run))
        return left_float[run[0].node] - analysis.quantized_db

    scored, expanded = costliest_groups(qdq.ops, gain, progress, "analyze: groups")
    analysis.groups = [GroupSensitivity(run[0].node, run[-1].node, len(run), left_float[run[0].node], g, i < expanded)
                       for i, (g, _, run) in enumerate(scored)]
    chosen = {index for _, index, _ in scored[:expanded]}
    ops = [op for _, index, run in sorted(scored, key=lambda g: g[1]) if index in chosen for op in run]
    analysis.skipped = len(qdq.ops) - len(ops)
    return ops


def format_analysis(analysis: Analysis, top: int | None = None) -> str:
    ops = analysis.ops[:top] if top else analysis.ops
    op_width, node_width = column_width([o.op_type for o in ops], 18), column_width([o.node for o in ops], 32)
    lines = [f"analyze: {analysis.samples} samples; SQNR of {analysis.scored} against float: fully "
             f"quantized {analysis.quantized_db:.2f} dB, weights only {analysis.weights_only_db:.2f} dB, "
             f"activations only {analysis.activations_only_db:.2f} dB", "",
             f"{'rank':>4}  {'op':<{op_width}} {'node':<{node_width}} {'only it quantized':>17} {'only it float':>13} "
             f"{'gain':>7}"]
    for rank, o in enumerate(ops, 1):
        lines.append(f"{rank:>4}  {o.op_type:<{op_width}} {o.node:<{node_width}} {o.only_quantized_db:>14.2f} dB "
                     f"{o.only_float_db:>10.2f} dB {o.gain_db:>+7.2f}")
    shown = min(top or len(analysis.ops), len(analysis.ops))
    if shown < len(analysis.ops):
        lines.append(f"      ... {len(analysis.ops) - shown} more (--top 0 for all)")
    lines.append("")
    if analysis.groups:
        best = [g for g in analysis.groups if g.expanded]
        rest = max((g.gain_db for g in analysis.groups if not g.expanded), default=-math.inf)
        lines.append(f"scored one by one: the {sum(g.count for g in best)} ops of the {len(best)} groups of "
                     f"consecutive ops that gained most left float together (of {len(analysis.groups)} groups)"
                     + (f"; {analysis.skipped} ops in groups that gained at most {rest:+.2f} dB were not "
                        f"(analyze --all-ops: every op)" if analysis.skipped else ""))
    lines.append(f"gain: SQNR with only that op float minus the fully quantized SQNR "
                 f"({analysis.seconds:.1f} s)")
    return "\n".join(lines)
