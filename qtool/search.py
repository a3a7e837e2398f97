"""Automatic mixed precision: the fewest ops to leave float so that the output SQNR against the
float model reaches a target (``quantize --target-sqnr``), or the N ops that cost the most
(``--max-float-layers``).

1. Every integer op is scored by the output SQNR of the model with only that op quantized (one
   onnxruntime run each, graph surgery on the QDQ model, as ``qtool analyze`` does); the lowest
   scores are the ops whose quantization costs the most on their own.
2. The candidates, most costly first, are kept float in growing prefixes. A prefix is scored as
   quantize would build it: an activation stays fenced only while an integer op reads or writes
   it. With a target, a binary search finds the shortest prefix that reaches it.
3. The model is quantized again with those ops float (and bias correction redone around them),
   then scored once more.

Costs: one run per integer op, about log2(ops) runs for the search, each over the same samples;
the same inputs give the same choice.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import onnx

from .analyze import Evaluator, QdqModel, evaluation_batches
from .bias_correction import BIAS_SAMPLES, quantize_corrected
from .errors import QtoolError
from .model import load_model, prepare
from .quantize import quantize
from .report import progress_bar


@dataclass
class SearchResult:
    kept_float: list[tuple[str, str]] = field(default_factory=list)  # (op_type, node), costliest first
    integer_db: float = 0.0  # every op integer
    final_db: float = 0.0  # the model returned, on the same samples
    target_db: float | None = None
    max_float: int | None = None
    candidates: int = 0
    evaluations: int = 0
    samples: int = 0
    seconds: float = 0.0

    @property
    def reached(self) -> bool:
        return self.target_db is None or self.final_db >= self.target_db

    def to_dict(self) -> dict:
        return {"kept_float": [{"op_type": t, "node": n} for t, n in self.kept_float],
                "integer_sqnr_db": _finite(self.integer_db), "final_sqnr_db": _finite(self.final_db),
                "target_sqnr_db": self.target_db, "max_float_layers": self.max_float,
                "reached": self.reached, "candidates": self.candidates, "evaluations": self.evaluations,
                "samples": self.samples, "seconds": round(self.seconds, 2)}


def _finite(x: float):
    return round(x, 3) if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def realizable(qdq: QdqModel, float_ops: set[str]) -> onnx.ModelProto:
    """The QDQ model as quantize would write it with ``float_ops`` float: their weights float and
    every fence that no integer op reads or writes removed."""
    integer = [op for op in qdq.ops if op.node not in float_ops]
    fenced = {t for op in integer for t in op.activations}
    weights = {w for op in qdq.ops if op.node in float_ops for w in op.weights}
    return qdq.ablated(qdq.all_tensors() - fenced, weights)


def search(model_path, table, options, table_name: str, data_path, target_db: float | None = None,
           max_float: int | None = None, num_samples: int | None = BIAS_SAMPLES, batch_size: int = 8,
           bias_correction: bool = True, progress: bool = True, preprocess=None):
    """Quantize MODEL keeping float the fewest ops that bring the output SQNR on DATA to
    ``target_db`` (at most ``max_float`` of them), or with no target the ``max_float`` costliest.
    Returns the model, its quantize report (with a ``search`` entry) and the search result."""
    if target_db is None and max_float is None:
        raise QtoolError("the search needs a target SQNR or a number of layers to keep float")
    if max_float is not None and max_float < 0:
        raise QtoolError(f"--max-float-layers must be >= 0, got {max_float}")
    start = time.perf_counter()
    result = SearchResult(target_db=target_db, max_float=max_float)

    def build(keep: tuple[str, ...], fmt: str | None = None):
        opts = replace(options, keep_float=tuple(options.keep_float) + keep,
                       **({"format": fmt, "strict": False} if fmt else {}))
        if bias_correction:
            return quantize_corrected(model_path, table, opts, table_name, data_path, num_samples,
                                      batch_size, False, preprocess)[:2]
        return quantize(model_path, table, opts, table_name)

    float_model = prepare(load_model(model_path), f"model file '{model_path}'")
    evaluator = Evaluator(float_model, evaluation_batches(float_model, data_path, num_samples, batch_size,
                                                             preprocess))
    result.samples = sum(len(next(iter(b.values()))) for b in evaluator.batches)
    qmodel, _ = build((), "qdq")
    qdq = QdqModel(qmodel, float_model)
    result.integer_db = evaluator.sqnr(qmodel)
    result.evaluations = 1
    chosen: list = []
    if target_db is None or result.integer_db < target_db:
        ranked = _rank(qdq, evaluator, progress)
        result.candidates = len(ranked)
        result.evaluations += len(ranked)
        limit = len(ranked) if max_float is None else min(max_float, len(ranked))
        if target_db is None:
            count = limit
        else:
            count, runs = _shortest_prefix(qdq, evaluator, ranked, limit, target_db)
            result.evaluations += runs
        chosen = ranked[:count]
    result.kept_float = [(op.op_type, op.node) for op in chosen]
    final, report = build(tuple(op.node for op in chosen))
    names = {op.node for op in chosen} - set(options.keep_float)
    report.kept_float = [(t, n, "kept float by the search" if n in names and t not in options.keep_float
                          else r) for t, n, r in report.kept_float]
    check = final if options.format == "qdq" else build(tuple(op.node for op in chosen), "qdq")[0]
    result.final_db = evaluator.sqnr(check)
    result.evaluations += 1
    result.seconds = time.perf_counter() - start
    report.search = result.to_dict()
    return final, report, result


def _rank(qdq: QdqModel, evaluator: Evaluator, progress: bool) -> list:
    """The integer ops, the one whose quantization alone costs the most first (ties: graph order)."""
    tensors, weights = qdq.all_tensors(), qdq.all_weights()
    scored = []
    with progress_bar(len(qdq.ops), "search: rank", progress, unit="op") as bar:
        for index, op in enumerate(qdq.ops):
            alone = evaluator.sqnr(qdq.ablated(tensors - set(op.activations), weights - set(op.weights)))
            scored.append((alone, index, op))
            bar.update(1)
    scored.sort(key=lambda s: (s[0] if not math.isnan(s[0]) else math.inf, s[1]))
    return [op for _, _, op in scored]


def _shortest_prefix(qdq: QdqModel, evaluator: Evaluator, ranked: list, limit: int,
                     target_db: float) -> tuple[int, int]:
    """The smallest k <= limit whose first k ops kept float reach ``target_db`` (binary search:
    SQNR grows with k on the whole, not at every step), else ``limit``; and the runs it took."""
    runs = 0

    def reaches(k: int) -> bool:
        nonlocal runs
        runs += 1
        return evaluator.sqnr(realizable(qdq, {op.node for op in ranked[:k]})) >= target_db

    if limit == 0 or not reaches(limit):
        return limit, runs
    lo, hi = 0, limit  # reaches(hi) holds; reaches(lo) does not (the all-integer model missed it)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if reaches(mid):
            hi = mid
        else:
            lo = mid
    return hi, runs
