"""A model run as written over a few samples, one sample per core at a time.

The data-driven steps of ``quantize --data``, ``--target-sqnr`` and ``analyze`` run dozens of
variants of a QDQ model over the same 16 or so samples with onnxruntime's graph optimizations
off. A variant's run is mostly small element-wise nodes (every QuantizeLinear/DequantizeLinear
pair), which onnxruntime's own threads share poorly, and a batch of 8 PP-OCRv4 rec lines
outgrows the caches. Run one sample at a time on single-threaded sessions, one run per core at
once: a 16-line variant took 0.86 s at batch 8 and 0.71 s this way, its float reference 0.54 and
0.38 s (2-core AMD EPYC).

Each run computes its sample alone on one thread, whatever runs beside it, so the outputs do not
depend on the number of cores or on the order the runs finish in (a 1-core machine runs the same
single samples one after another); callers get them in the samples' order.

A session that runs several feeds gets the DequantizeLinear nodes of constants that Convs and
element-wise ops read (the weights, biases and constant operands) computed once, before the
session, instead of once a feed (``dequantized_constants``): the same float32 bits as
onnxruntime's kernel computes (checked for every integer type, per tensor and per axis, on an
AVX-512 and an AVX2 CPU: tests/test_runs.py), read by kernels that compute alike from a
constant, so the same outputs. Not a MatMul's or a Gemm's: onnxruntime packs a constant B ahead
and sums it in other blocks (other last bits, PP-OCRv4 rec's attention).
A model whose batch dim is fixed keeps its batches (``Batches.axes`` None) and runs them one at a
time with onnxruntime's threads.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from .batching import CORES
from .model import node_reads

MAX_WORKERS = 8  # runs in flight at once: each holds one sample's activations
# float32 bytes of dequantized constants a session holds at most: a VGG16's 553 MB would stay
# held for the session's life where onnxruntime makes one layer's at a time
FOLD_BYTES = 64 << 20
FOLD_FROM_FEEDS = 4  # fewer feeds: computing the constants before the session saves little
# the integer types whose DequantizeLinear ``dequantized_constants`` computes as onnxruntime does
FOLDED_TYPES = (np.int8, np.uint8, np.int16, np.uint16, np.int32)
# the ops that compute the same from a constant as from a value made at run time (checked on
# PP-OCRv4 rec and det, every tensor: Conv, ConvTranspose, Add, Mul); a MatMul or Gemm packs a
# constant B ahead and sums it in other blocks, an RNN packs its weights
_GRAPHS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
FOLDED_READERS = frozenset({"Conv", "ConvTranspose", "Add", "Sub", "Mul", "Div", "Max", "Min", "PRelu",
                            "Where", "Concat", "Gather", "Clip", "Reshape", "Transpose", "Squeeze",
                            "Unsqueeze", "Expand", "Slice", "Identity"})


def as_written_bytes(serialized: bytes, threads: int = 0) -> ort.InferenceSession:
    """onnxruntime's session of a serialized model, run as written (no graph rewrites);
    ``threads``: its intra-op threads (0: onnxruntime's default, one per core)."""
    options = ort.SessionOptions()
    options.log_severity_level = 4  # errors come back as exceptions, told in one line
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])


class Runs:
    """The feeds to run (a model's samples one by one where its batch dim is free, else its
    batches) and how many run at once."""

    def __init__(self, batches):
        axes = getattr(batches, "axes", None)
        self.split = axes is not None
        self.feeds = [one for batch in batches for one in _samples(batch, axes)] if self.split else list(batches)
        self.workers = max(1, min(CORES, MAX_WORKERS, len(self.feeds))) if self.split else 1

    def __len__(self) -> int:
        return len(self.feeds)

    def session(self, model: onnx.ModelProto) -> ort.InferenceSession:
        """Split samples run on one thread each, on every machine: a kernel that shares a sum
        between threads could otherwise give other last bits on another number of cores. Where
        several feeds run, the model's DequantizeLinear nodes of constants are computed first
        (``dequantized_constants``)."""
        if len(self.feeds) >= FOLD_FROM_FEEDS:
            model = dequantized_constants(model)
        return as_written_bytes(model.SerializeToString(), threads=1 if self.split else 0)

    def run(self, session: ort.InferenceSession, names: list[str], feeds: list[dict] | None = None,
            ) -> list[list[np.ndarray]]:
        """``names`` of every feed of ``feeds`` (default: all of this run's), in their order."""
        return list(self.each(session, names, feeds))

    def each(self, session: ort.InferenceSession, names: list[str], feeds: list[dict] | None = None):
        """``run``'s results one at a time, in the feeds' order, with at most ``workers`` runs
        ahead of the caller: a caller that reduces each result as it comes (bias correction's
        channel means) holds a few samples' tensors, not all of them."""
        feeds = self.feeds if feeds is None else feeds
        if self.workers == 1 or len(feeds) < 2:
            for f in feeds:
                yield session.run(names, f)
            return
        with ThreadPoolExecutor(min(self.workers, len(feeds)), thread_name_prefix="qtool-run") as pool:
            pending = deque(pool.submit(session.run, names, f) for f in feeds[:self.workers])
            for f in feeds[self.workers:] + [None] * len(pending):
                done = pending.popleft().result()
                if f is not None:
                    pending.append(pool.submit(session.run, names, f))
                yield done


def _samples(batch: dict[str, np.ndarray], axes: dict[str, int | None]) -> list[dict[str, np.ndarray]]:
    """A batch's samples, each a batch of one (views); an input without a sample axis is fed
    whole to each."""
    counts = {v.shape[axes[k]] for k, v in batch.items() if axes.get(k) is not None}
    if len(counts) != 1:  # nothing to split by, or inputs that disagree: run the batch as it is
        return [batch]
    out = []
    for i in range(counts.pop()):
        one = {}
        for name, value in batch.items():
            axis = axes.get(name)
            one[name] = value if axis is None else np.ascontiguousarray(
                value[(slice(None),) * axis + (slice(i, i + 1),)])
        out.append(one)
    return out


def _dequantized(node: onnx.NodeProto, inits: dict) -> np.ndarray | None:
    """What onnxruntime's DequantizeLinear computes for ``node`` on constants: ``(q - z)`` in
    int32, converted to float32, times the float32 scale (one rounding each: the same bits); None
    where ``node`` is not one of these (a blocked scale, another output type, an integer type
    of other kernels)."""
    if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    if any(a.name != "axis" and not (a.name == "block_size" and a.i == 0) for a in node.attribute):
        return None
    names = [n for n in node.input if n]
    if any(n not in inits for n in names):
        return None
    q = numpy_helper.to_array(inits[node.input[0]])
    scale = numpy_helper.to_array(inits[node.input[1]])
    zero = numpy_helper.to_array(inits[node.input[2]]) if len(node.input) > 2 and node.input[2] else None
    if q.dtype.type not in FOLDED_TYPES or scale.dtype != np.float32 or (zero is not None and zero.dtype != q.dtype):
        return None
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    if scale.size == 1 and scale.ndim <= 1:  # per tensor
        shape: tuple | list = ()
    elif scale.ndim == 1 and q.ndim and -q.ndim <= axis < q.ndim and scale.size == q.shape[axis]:
        shape = [1] * q.ndim
        shape[axis] = -1
    else:
        return None
    z = np.zeros(scale.shape, np.int32) if zero is None else zero.astype(np.int32)
    if z.shape != scale.shape or (q.dtype == np.int32 and z.any()):  # int32 less z could wrap
        return None
    return (q.astype(np.int32) - z.reshape(shape)).astype(np.float32) * scale.reshape(shape)


def dequantized_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each main-graph DequantizeLinear of constants replaced by its result, a
    float32 constant (``_dequantized``), up to ``FOLD_BYTES`` of them; the integer constants only
    they read are dropped. ``model`` itself where there is none to replace."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    for vi in graph.input:  # an initializer that an input can override is no constant
        inits.pop(vi.name, None)
    outputs = {o.name for o in graph.output}
    dequantizing = [n for n in graph.node if n.op_type == "DequantizeLinear" and n.output and n.output[0] not in outputs
                    and n.input and n.input[0] in inits]
    if not dequantizing:
        return model
    readers: dict[str, set[str]] = {n.output[0]: set() for n in dequantizing}
    for node in graph.node:
        plain = node.domain in ("", "ai.onnx") and not any(a.type in _GRAPHS for a in node.attribute)
        for name in (node.input if plain else node_reads(node)):
            if name in readers:
                readers[name].add(node.op_type if plain else "")
    made, total = {}, 0
    for node in dequantizing:
        if not readers[node.output[0]] or not readers[node.output[0]] <= FOLDED_READERS:
            continue
        value = _dequantized(node, inits)
        if value is None or total + value.nbytes > FOLD_BYTES:
            continue
        made[node.output[0]] = value
        total += value.nbytes
    if not made:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [n for n in out.graph.node if not (n.op_type == "DequantizeLinear" and n.output and n.output[0] in made)]
    # (an initializer an older exporter also lists as an input stays: onnxruntime would ask for it)
    read = {name for n in kept for name in node_reads(n)} | outputs | {vi.name for vi in graph.input}
    inits_kept = [t for t in out.graph.initializer if t.name in read]
    del out.graph.node[:]
    out.graph.node.extend(kept)
    del out.graph.initializer[:]
    out.graph.initializer.extend(inits_kept)
    out.graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in made.items())
    return out
