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
A model whose batch dim is fixed keeps its batches (``Batches.axes`` None) and runs them one at a
time with onnxruntime's threads.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort

from .batching import CORES

MAX_WORKERS = 8  # runs in flight at once: each holds one sample's activations


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

    def session(self, serialized: bytes) -> ort.InferenceSession:
        """Split samples run on one thread each, on every machine: a kernel that shares a sum
        between threads could otherwise give other last bits on another number of cores."""
        return as_written_bytes(serialized, threads=1 if self.split else 0)

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
