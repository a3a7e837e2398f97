"""Automatic mixed precision: the fewest ops to give int16 activations (or, with ``allow_float``,
to leave float) so that the output SQNR against the float model reaches a target (``quantize
--target-sqnr``), or the N ops that cost the most (``--max-float-layers``).

1. Every integer op is scored by the output SQNR of the model with only that op quantized (one
   onnxruntime run each, graph surgery on the QDQ model, as ``qtool analyze`` does); the lowest
   scores are the ops whose quantization costs the most on their own. A model of more than 64
   ops is scored in groups of consecutive ops first, and only the costliest groups' ops one by
   one (``_rank``).
   With a target and no budget, every op picked at once is scored first: where even that misses
   the target, the search gives every op int16 (or float) without ranking them.
2. The candidates, most costly first, are picked in growing prefixes. A prefix is scored as
   quantize would build it. With bias correction, it is quantized with its bias correction
   fitted again: the all-int8 model's corrections, fitted to its 8-bit errors, are wrong for a
   model with int16 ops (PP-OCRv4 rec, every op int16 at once: 14.5 dB with them, 33.9 dB with
   its own), and the ops are ranked without them (they shift an op whose inputs are float).
   Without bias correction, a prefix is graph surgery on the QDQ model: its ops' fences made
   int16 over the same ranges, with the constants quantize stores int16 around int16 ops (or,
   float, an activation fenced only while an integer op reads or writes it). With a target, a
   binary search finds the shortest prefix that reaches it; with only a budget of N ops, the
   best of eight prefix lengths up to N.
3. The model is quantized again with those ops int16 or float (and bias correction redone around
   them), then scored once more. With only a budget, a result below the all-int8 model's SQNR
   gives the all-int8 model back.

The score is the worst SQNR over the outputs: the logits of an output made by a Softmax or
Sigmoid, and each part of an output that concatenates tensors (``qtool.analyze.Evaluator``).
Costs: one run per integer op, then about log2(ops) runs for the target search (eight for a
budget), each over the same samples and, with bias correction, each after a quantize and a bias
correction fit; the same inputs give the same choice.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import ClassVar

import onnx

from .analyze import GROUP_FROM, Evaluator, QdqModel, costliest_groups, split_batches
from .bias_correction import BIAS_SAMPLES, CHANNEL_AXIS, quantize_corrected
from .calibrate import calibrate, collect, collect_methods, past_last_layer
from .errors import QtoolError
from .model import prepare_file
from .quantize import quantize, record_float_nodes
from .report import finite, progress_bar
from .table import Table
from .targets import DEFAULT_TARGET


@dataclass
class SearchResult:
    kept_float: list[tuple[str, str]] = field(default_factory=list)  # (op_type, node), costliest first
    int16: list[tuple[str, str]] = field(default_factory=list)  # promoted to int16 activations
    precision: str = "int16"  # what the search gives the ops it picks: "int16" or "float"
    activations: str = "int8"  # the activation type of the all-integer model it starts from
    integer_db: float = 0.0  # every op integer
    final_db: float = 0.0  # the model returned, on the same samples
    target_db: float | None = None
    max_float: int | None = None
    candidates: int = 0
    evaluations: int = 0
    samples: int = 0
    seconds: float = 0.0
    scored: str = ""  # the tensor SQNR is measured on
    # the held-out judgement (0 samples: not judged): both models on samples the search never saw
    heldout: int = 0
    heldout_integer_db: float = 0.0
    heldout_final_db: float = 0.0
    reverted: bool = False  # the float ops lost there: the all-integer model was returned
    # every op given int16 (or kept float) at once, scored before any ranking: None when not tried
    whole_db: float | None = None
    phases: dict = field(default_factory=dict)  # phase -> seconds (quantize, score, rank, narrow, judge)

    @property
    def reached(self) -> bool:
        return self.target_db is None or self.final_db >= self.target_db

    def to_dict(self) -> dict:
        return {"kept_float": [{"op_type": t, "node": n} for t, n in self.kept_float],
                "int16": [{"op_type": t, "node": n} for t, n in self.int16], "precision": self.precision,
                "activations": self.activations,
                "integer_sqnr_db": finite(self.integer_db), "final_sqnr_db": finite(self.final_db),
                "target_sqnr_db": self.target_db, "max_float_layers": self.max_float,
                "reached": self.reached, "candidates": self.candidates, "evaluations": self.evaluations,
                "samples": self.samples, "scored": self.scored, "seconds": round(self.seconds, 2),
                "heldout_samples": self.heldout, "heldout_integer_sqnr_db": finite(self.heldout_integer_db),
                "heldout_final_sqnr_db": finite(self.heldout_final_db), "reverted": self.reverted,
                "whole_sqnr_db": None if self.whole_db is None else finite(self.whole_db),
                "phases": {k: round(v, 2) for k, v in self.phases.items()}}


def realizable(qdq: QdqModel, float_ops: set[str]) -> onnx.ModelProto:
    """The QDQ model as quantize would write it with ``float_ops`` float: their weights float and
    every fence that no integer op reads or writes removed."""
    integer = [op for op in qdq.ops if op.node not in float_ops]
    fenced = {t for op in integer for t in op.activations}
    weights = {w for op in qdq.ops if op.node in float_ops for w in op.weights}
    return qdq.ablated(qdq.all_tensors() - fenced, weights)


def check_search_options(options, allow_float: bool) -> None:
    """Refuse a search the options leave nothing to do for, before any data step runs: int16
    activations need the QDQ form of the default target, and an int16 model has them everywhere."""
    if not allow_float and (options.format != "qdq" or options.target != DEFAULT_TARGET):
        raise QtoolError(f"the search gives ops int16 activations, written as QDQ for the "
                         f"{DEFAULT_TARGET} target; add --allow-float to keep them float instead")
    if not allow_float and options.activation_type == "int16":
        raise QtoolError("the search gives ops int16 activations, and --activation-type int16 has given them "
                         "to every op already; add --allow-float to keep ops float instead")


def search(model_path, table, options, table_name: str, data_path, target_db: float | None = None,
           max_float: int | None = None, num_samples: int | None = BIAS_SAMPLES, batch_size: int = 8,
           bias_correction: bool = True, progress: bool = True, preprocess=None,
           holdout: int | None = None, allow_float: bool = False):
    """Quantize MODEL giving int16 activations (or, with ``allow_float``, keeping float) the fewest
    ops that bring the output SQNR on DATA to ``target_db`` (at most ``max_float`` of them), or
    with no target the costliest-first set of at most ``max_float`` that scores best. int16 keeps
    the model integer; float ops need a device that runs float. The search scores on
    ``num_samples`` of DATA; ``holdout`` others (None: as many, 0: none) judge the result, and
    where the picked ops do not raise the SQNR there the all-int8 model is returned. Returns the model, its quantize report (with a
    ``search`` entry) and the search result."""
    if target_db is None and max_float is None:
        raise QtoolError("the search needs a target SQNR or a number of layers to keep float")
    if max_float is not None and max_float < 0:
        raise QtoolError(f"--max-float-layers must be >= 0, got {max_float}")
    check_search_options(options, allow_float)
    start = time.perf_counter()
    result = SearchResult(target_db=target_db, max_float=max_float,
                          precision="float" if allow_float else "int16", activations=options.activation_type)
    clock = [start]

    def phase(name: str) -> None:  # the time since the last phase ended, added to ``name``
        now = time.perf_counter()
        result.phases[name] = result.phases.get(name, 0.0) + now - clock[0]
        clock[0] = now

    def build(keep: tuple[str, ...], fmt: str | None = None):
        picked = {"keep_float": tuple(options.keep_float) + keep} if allow_float else \
            {"int16": tuple(options.int16) + keep}
        opts = replace(options, **picked, **({"format": fmt, "strict": False} if fmt else {}))
        if bias_correction:
            return quantize_corrected(model_path, table, opts, table_name, data_path, num_samples,
                                      batch_size, False, preprocess, holdout)[:2]
        return quantize(model_path, table, opts, table_name)

    float_model = prepare_file(model_path)
    fit, held = fit_and_heldout(float_model, data_path, num_samples, holdout, batch_size, preprocess)
    evaluator = Evaluator(float_model, fit)
    result.samples = evaluator.batches.samples
    result.scored = evaluator.scored
    qmodel, qreport = build((), "qdq")
    # the build the search returns where it was made on the way: the all-int8 one, or one ``score`` kept
    kept = {"ops": frozenset(), "built": (qmodel, qreport), "db": -math.inf}
    # ops are ranked quantized alone in the float model, without the corrections bias correction
    # fitted to the all-int8 model's errors (they shift an op whose inputs are float)
    plain = quantize(model_path, table, replace(options, format="qdq", strict=False), table_name,
                     scored_only=True)[0] if bias_correction else qmodel
    phase("quantize")
    qdq = QdqModel(plain, float_model)
    if bias_correction:
        # a prefix is scored as the search would write it, its bias correction fitted again:
        # variants of the corrected all-int8 model keep corrections fitted to int8 errors
        # (PP-OCRv4 rec, every op int16 at once: 14.5 dB so, 33.9 dB as written)
        scores: dict[tuple[str, ...], float] = {}

        def score(ops: set[str]) -> float:
            key = tuple(op.node for op in qdq.ops if op.node in ops)
            if key not in scores:
                built = build(key, "qdq")
                scores[key] = evaluator.sqnr(built[0])
                # the one build the search can end on, kept so that it is not built again: with a
                # target, the latest that reaches it (the binary search's answer, each smaller than
                # the one before); without, the best so far (``_best_prefix`` keeps the first best)
                if (scores[key] >= target_db) if target_db is not None else scores[key] > kept["db"]:
                    kept.update(ops=frozenset(key), built=built, db=scores[key])
            return scores[key]
    else:
        if not allow_float:  # the constants quantize stores int16 around int16 ops, for the variants
            every = tuple(options.int16) + tuple(op.node for op in qdq.ops)
            qdq.take_wide_constants(quantize(model_path, table, replace(options, int16=every, strict=False),
                                             table_name, scored_only=True)[0])
        # quantize cuts an 8-bit Sigmoid/Tanh input to where the output saturates, and an int16 one not
        saturating = {n.input[0] for n in float_model.graph.node if n.op_type in ("Sigmoid", "Tanh") and n.input}
        reach = {name: max(abs(e.min), abs(e.max)) for name, e in table.tensors.items() if name in saturating}

        def score(ops: set[str]) -> float:
            return evaluator.sqnr(realizable(qdq, ops) if allow_float else widened(qdq, ops, reach))
    # the ranking quantizes ops alone in the float model, the narrowing widens some in the
    # quantized one: each runs from its first node that differs from the nearer (qtool/prefix.py)
    evaluator.share_prefixes(qmodel, qdq.ablated(qdq.all_tensors(), qdq.all_weights()))
    result.integer_db = evaluator.sqnr(qmodel)
    kept["db"] = result.integer_db  # what ``_best_prefix``'s first pick must beat
    result.evaluations = 1
    chosen: list = []
    whole = max_float is None or max_float >= len(qdq.ops)
    if target_db is not None and result.integer_db < target_db and whole:
        # every op at once first: when even that misses the target, no ranking can do better
        # (the search would end with every op picked); when it reaches it, the narrowing
        # below need not score it again
        result.whole_db = score({op.node for op in qdq.ops})
        result.evaluations += 1
        if not result.whole_db >= target_db:
            chosen = list(qdq.ops)
            result.candidates = len(chosen)
    phase("score")
    if (target_db is None or result.integer_db < target_db) and not chosen:
        ranked, runs = _rank(qdq, evaluator, progress)
        result.candidates = len(ranked)
        result.evaluations += runs
        phase("rank")
        limit = len(ranked) if max_float is None else min(max_float, len(ranked))
        if target_db is None:
            count, runs = _best_prefix(score, ranked, limit, result.integer_db)
            result.evaluations += runs
        else:
            count, runs = _shortest_prefix(score, ranked, limit, target_db,
                                           reached=result.whole_db is not None and limit == len(ranked))
            result.evaluations += runs
        chosen = ranked[:count]
        phase("narrow")
    evaluator.share_prefixes()  # the carried tensors go: the variants are scored
    picked = [(op.op_type, op.node) for op in chosen]
    if allow_float:
        result.kept_float = picked
    else:
        result.int16 = picked
    # the builds were made as QDQ without --strict: what it writes otherwise is built as asked
    as_built = options.format == "qdq" and not options.strict
    final, report = (as_built and _built(kept, chosen)) or build(tuple(op.node for op in chosen))
    phase("quantize")
    names = {op.node for op in chosen} - set(options.keep_float)
    report.kept_float = [(t, n, "kept float by the search" if n in names and t not in options.keep_float
                          else r) for t, n, r in report.kept_float]
    record_float_nodes(final, report.kept_float)
    check = final if options.format == "qdq" else \
        (_built(kept, chosen) or build(tuple(op.node for op in chosen), "qdq"))[0]
    result.final_db = evaluator.sqnr(check)
    result.evaluations += 1
    revert = bool(target_db is None and chosen and result.final_db < result.integer_db)
    if held is not None and chosen:
        judge = Evaluator(float_model, held)
        result.heldout = held.samples
        result.heldout_integer_db, result.heldout_final_db = judge.sqnr(qmodel), judge.sqnr(check)
        result.evaluations += 2
        # what the float ops buy must show on samples the search did not choose them on
        revert = revert or not result.heldout_final_db > result.heldout_integer_db
    result.reverted = revert
    phase("judge")
    if revert:
        # re-quantized around the picked ops (bias correction redone), they bought nothing
        chosen, result.kept_float, result.int16 = [], [], []
        kept.update(ops=frozenset(), built=(qmodel, qreport))
        final, report = (as_built and _built(kept, chosen)) or build(())
        result.final_db = result.integer_db
        result.heldout_final_db = result.heldout_integer_db
        phase("quantize")
    result.seconds = time.perf_counter() - start
    report.search = result.to_dict()
    return final, report, result


@dataclass
class JudgedStep:
    """A ``quantize --data`` step fitted on the fit samples and kept where the held-out ones score
    it ``gain_db`` higher: the held-out SQNR without (``before_db``) and with it (``after_db``).
    Subclasses name the two in their reports (``BEFORE``, ``AFTER``)."""

    BEFORE: ClassVar[str] = "before"
    AFTER: ClassVar[str] = "after"
    fit_samples: int = 0
    heldout: int = 0
    before_db: float = 0.0
    after_db: float = 0.0
    kept: bool = False
    scored: str = ""
    seconds: float = 0.0
    reason: str = ""
    gain_db: float = 0.0

    def judge(self, before_db: float, after_db: float) -> bool:
        self.before_db, self.after_db = before_db, after_db
        self.kept = after_db >= before_db + self.gain_db
        return self.kept

    def split(self, float_model, data_path, num_samples, holdout, batch_size, preprocess, start: float):
        """The fit and held-out batches (``fit_and_heldout``); held-out None, with the reason and
        the seconds so far set, where there is nothing to judge on."""
        fit, held = fit_and_heldout(float_model, data_path, num_samples, holdout, batch_size, preprocess)
        self.fit_samples = fit.samples
        if held is None:
            self.reason = "no held-out samples to judge it on"
            self.seconds = time.perf_counter() - start
        return fit, held

    def judged_dict(self) -> dict:
        return {"fit_samples": self.fit_samples, "heldout_samples": self.heldout,
                f"heldout_{self.BEFORE}_sqnr_db": finite(self.before_db),
                f"heldout_{self.AFTER}_sqnr_db": finite(self.after_db), "kept": self.kept,
                "gain_db": self.gain_db, "scored": self.scored, "seconds": round(self.seconds, 2),
                "reason": self.reason}


def fit_and_heldout(float_model, data_path, num_samples, holdout, batch_size, preprocess):
    """The samples a search fits on and those that judge it (None: not judged)."""
    fit = BIAS_SAMPLES if num_samples is None else num_samples
    return split_batches(float_model, data_path, fit, fit if holdout is None else holdout, batch_size,
                         preprocess)


def _built(kept: dict, chosen: list) -> tuple | None:
    """The kept build (``search``'s ``kept``: QDQ, without ``--strict``) of exactly the ops
    ``chosen``, else None. Taken once: the caller may change the model and report."""
    if kept.get("ops") != frozenset(op.node for op in chosen):
        return None
    built, kept["ops"] = kept["built"], None
    return built


def _rank(qdq: QdqModel, evaluator: Evaluator, progress: bool) -> tuple[list, int]:
    """The integer ops, the one whose quantization alone costs the most first (ties: graph order),
    and the runs it took. A model of more than ``GROUP_FROM`` ops is ranked in groups first
    (``costliest_groups``, as ``qtool analyze`` does, each group scored quantized alone): the ops
    of the costliest groups, at least ``EXPANDED_OPS``, are ranked one by one, and the other ops
    follow group by group (costliest group first, graph order within)."""
    def alone(ops) -> float:
        return evaluator.sqnr(qdq.only_quantized(ops))

    indexed = list(enumerate(qdq.ops))
    runs, rest = 0, []
    one_by_one = indexed
    if len(indexed) > GROUP_FROM:
        scored, expanded = costliest_groups(indexed, lambda run: -alone([op for _, op in run]), progress,
                                            "search: rank groups")
        runs = len(scored)
        one_by_one = [item for _, _, run in scored[:expanded] for item in run]
        rest = [op for _, _, run in scored[expanded:] for _, op in run]
    ranked = []
    with progress_bar(len(one_by_one), "search: rank", progress, unit="op") as bar:
        for index, op in one_by_one:
            ranked.append((alone([op]), index, op))
            bar.update(1)
    ranked.sort(key=lambda s: (s[0] if not math.isnan(s[0]) else math.inf, s[1]))
    return [op for _, _, op in ranked] + rest, runs + len(one_by_one)


def widened(qdq: QdqModel, ops: set[str], reach: dict[str, float] | None = None) -> onnx.ModelProto:
    """The QDQ model with every activation of ``ops`` int16, as quantize would write it with
    those ops promoted (up to the ranges' rounding; ``reach``: see ``QdqModel.widened``)."""
    return qdq.widened({t for op in qdq.ops if op.node in ops for t in op.activations}, reach)


def _best_prefix(score, ranked: list, limit: int, integer_db: float) -> tuple[int, int]:
    """Within a budget of ``limit`` ops, the prefix length (of 0, limit/8, ..., limit) with
    the best SQNR: the ops that cost most alone are not always the ones whose removal pays most
    together (PP-OCRv4 rec: its 30 costliest kept float scored below the all-integer model)."""
    lengths = sorted({round(limit * i / 8) for i in range(1, 9)} - {0})
    best, best_db = 0, integer_db
    for k in lengths:
        db = score({op.node for op in ranked[:k]})
        if db > best_db:
            best, best_db = k, db
    return best, len(lengths)


def _shortest_prefix(score, ranked: list, limit: int, target_db: float,
                     reached: bool = False) -> tuple[int, int]:
    """The smallest k <= limit whose first k ops picked reach ``target_db`` (binary search:
    SQNR grows with k on the whole, not at every step), else ``limit``; and the runs it took.
    ``reached``: the first ``limit`` ops are known to reach it (scored already)."""
    runs = 0

    def reaches(k: int) -> bool:
        nonlocal runs
        runs += 1
        return score({op.node for op in ranked[:k]}) >= target_db

    if limit == 0 or not (reached or reaches(limit)):
        return limit, runs
    lo, hi = 0, limit  # reaches(hi) holds; reaches(lo) does not (the all-integer model missed it)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if reaches(mid):
            hi = mid
        else:
            lo = mid
    return hi, runs


@dataclass
class MethodChoice:
    chosen: dict[str, str] = field(default_factory=dict)  # tensor -> method, where not the table's
    methods: tuple[str, ...] = ()
    before_db: float = 0.0  # every tensor with the table's range
    after_db: float = 0.0
    evaluations: int = 0
    samples: int = 0
    seconds: float = 0.0
    scored: str = ""
    # the held-out judgement (0 samples: not judged); not kept: the table's own ranges returned
    heldout: int = 0
    heldout_before_db: float = 0.0
    heldout_after_db: float = 0.0
    kept: bool = True

    def to_dict(self) -> dict:
        counts = {m: 0 for m in self.methods}
        for m in self.chosen.values():
            counts[m] += 1
        return {"methods": list(self.methods), "changed_tensors": counts,
                "before_sqnr_db": finite(self.before_db), "after_sqnr_db": finite(self.after_db),
                "evaluations": self.evaluations, "samples": self.samples, "scored": self.scored,
                "seconds": round(self.seconds, 2), "heldout_samples": self.heldout,
                "heldout_before_sqnr_db": finite(self.heldout_before_db),
                "heldout_after_sqnr_db": finite(self.heldout_after_db), "kept": self.kept}


def choose_methods(model_path, table: Table, methods: list[str], options, table_name: str, data_path,
                   num_samples: int | None = BIAS_SAMPLES, batch_size: int = 8, progress: bool = True,
                   preprocess=None, calibrate_batch: int | None = None,
                   bias_corrections: dict | None = None,
                   holdout: int | None = None) -> tuple[Table, MethodChoice]:
    """Per activation, the calibration method (``table``'s or one of ``methods``, calibrated here
    on DATA) whose range gives the best output SQNR on ``num_samples`` of DATA, one tensor at a
    time in graph order with the earlier choices kept. Tensors that share (S, Z) (an op's input
    and output that quantize joins) are decided together. ``bias_corrections`` (from the table's
    own model) are applied to every candidate. ``holdout`` other samples (None: as many, 0: none)
    judge the choice: where it does not raise the SQNR there, ``table`` comes back unchanged.
    Returns the mixed table and the summary."""
    start = time.perf_counter()
    candidates = [table.method] + [m for m in dict.fromkeys(methods) if m != table.method]
    tables = {table.method: table}
    for method in candidates[1:]:
        tables[method] = calibrate(model_path, data_path, method, batch_size=calibrate_batch,
                                   progress=False, preprocess=preprocess)
    qdq_options = replace(options, format="qdq", strict=False)
    built = {m: quantize(model_path, t, qdq_options, table_name, bias_corrections, scored_only=True)
             for m, t in tables.items()}
    models = {m: model for m, (model, _) in built.items()}
    joined = {name: members for members in built[table.method][1].qparam_groups for name in members}
    float_model = prepare_file(model_path)
    fit, held = fit_and_heldout(float_model, data_path, num_samples, holdout, batch_size, preprocess)
    evaluator = Evaluator(float_model, fit)
    result = MethodChoice(methods=tuple(candidates), scored=evaluator.scored, samples=fit.samples)
    work = onnx.ModelProto()
    work.CopyFrom(models[table.method])
    # what a tensor's range decides in the model: its fence's (S, Z) and the int32 biases (at
    # S_x * S_w) of the ops that read it; the candidate models differ in nothing else
    decided = _decided_initializers(work)
    sources = {m: {i.name: i for i in model.graph.initializer} for m, model in models.items()}
    groups: dict[str, list[str]] = {}
    for tensor in decided:
        members = joined.get(tensor, [tensor])
        groups.setdefault(min(members), [t for t in members if t in decided])
    inits = {i.name: i for i in work.graph.initializer}
    best = result.before_db = evaluator.sqnr(work)
    result.evaluations = 1
    with progress_bar(len(groups), "search: methods", progress, unit="tensor") as bar:
        for members in groups.values():
            names = [n for t in members for n in decided[t]]
            current = table.method
            for method in candidates[1:]:
                if all(sources[method][n] == sources[current][n] for n in names):
                    continue
                for n in names:
                    inits[n].CopyFrom(sources[method][n])
                score = evaluator.sqnr(work)
                result.evaluations += 1
                if score > best:
                    best, current = score, method
                else:
                    for n in names:
                        inits[n].CopyFrom(sources[current][n])
            if current != table.method:
                result.chosen.update({t: current for t in joined.get(members[0], members)})
            bar.update(1)
    result.after_db = best
    if held is not None and result.chosen:
        judge = Evaluator(float_model, held)
        result.heldout = held.samples
        result.heldout_before_db, result.heldout_after_db = judge.sqnr(models[table.method]), judge.sqnr(work)
        result.evaluations += 2
        result.kept = result.heldout_after_db > result.heldout_before_db
    if not result.kept:
        result.seconds = time.perf_counter() - start
        return table, result
    mixed = replace(table, method=f"{table.method}+{'+'.join(candidates[1:])}",
                    tensors={name: tables[result.chosen.get(name, table.method)].tensors.get(name, entry)
                             for name, entry in table.tensors.items()})
    result.seconds = time.perf_counter() - start
    return mixed, result


def _decided_initializers(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Fenced activation (by its table name) -> the initializers its range sets: the scale and
    zero point of its QuantizeLinear/DequantizeLinear, and the int32 bias and bias scale of each op
    reading it."""
    inits = {i.name for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    decided: dict[str, list[str]] = {}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] not in inits:
            decided[node.input[0]] = [node.input[1], node.input[2]]
    for node in model.graph.node:
        if node.op_type not in CHANNEL_AXIS or len(node.input) < 3 or not node.input[2]:
            continue
        bias, x = producer.get(node.input[2]), producer.get(node.input[0])
        q = producer.get(x.input[0]) if x is not None and x.op_type == "DequantizeLinear" else None
        if (bias is not None and bias.op_type == "DequantizeLinear" and bias.input[0] in inits
                and q is not None and q.op_type == "QuantizeLinear" and q.input[0] in decided):
            decided[q.input[0]] += [bias.input[0], bias.input[1]]
    # a graph output's fence reads '<name>_float' and gives back '<name>': the table knows '<name>'
    outputs = {o.name for o in model.graph.output}
    renamed = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.output[0] in outputs:
            q = producer.get(node.input[0])
            if q is not None and q.op_type == "QuantizeLinear" and q.input[0] in decided:
                renamed[q.input[0]] = node.output[0]
    return {renamed.get(name, name): names for name, names in decided.items()}


MODEL_METHODS = ("minmax", "percentile", "mse")  # what --data tries for the whole model by default


@dataclass
class MethodPick:
    """One calibration method for the whole model, chosen on the fit samples and kept only where
    it beats the table on the held-out ones."""

    table_method: str
    chosen: str  # the table's method when nothing else was kept
    fit_db: dict[str, float] = field(default_factory=dict)  # each method calibrated on the fit samples
    fit_samples: int = 0
    heldout: int = 0  # 0: not judged (nothing changed)
    heldout_table_db: float = 0.0  # the table as given
    heldout_chosen_db: float = 0.0  # the best method on the fit samples, calibrated on them
    scored: str = ""
    seconds: float = 0.0
    ends: int = 0  # tensors past the last layer the clipping methods' tables keep at min-max
    reason: str = ""  # why no other method was tried
    # per-channel ranges of ``channels`` over all of DATA measured with the chosen method's
    # calibration, and over the fit samples with the candidates' (not reported)
    channel_ranges: dict = field(default_factory=dict, repr=False)
    fit_channel_ranges: dict = field(default_factory=dict, repr=False)

    @property
    def changed(self) -> bool:
        return self.chosen != self.table_method

    def to_dict(self) -> dict:
        return {"table_method": self.table_method, "chosen": self.chosen, "changed": self.changed,
                "fit_sqnr_db": {m: finite(v) for m, v in self.fit_db.items()},
                "fit_samples": self.fit_samples, "heldout_samples": self.heldout,
                "heldout_table_sqnr_db": finite(self.heldout_table_db),
                "heldout_chosen_sqnr_db": finite(self.heldout_chosen_db), "scored": self.scored,
                "seconds": round(self.seconds, 2), "ends_at_whole_range": self.ends, "reason": self.reason}


def choose_method(model_path, table: Table, options, table_name: str, data_path,
                  methods=MODEL_METHODS, num_samples: int | None = BIAS_SAMPLES, batch_size: int = 8,
                  progress: bool = True, preprocess=None,
                  holdout: int | None = None, channels: list[str] = ()) -> tuple[Table, MethodPick]:
    """The calibration method for the whole model: ``table`` as given and each other of
    ``methods`` calibrated on the fit samples of DATA, scored there (Evaluator: the worst output
    or part); where another method scores best, it is scored on the held-out samples against
    ``table`` and kept only where it is higher there, then calibrated again on all of DATA.

    No method suits every model (zoo, no data: percentile gains PP-OCRv4 det 4.3 dB and costs
    YOLOv8n's class scores 6.4 dB; mse gains orientation 2.2 dB and costs YOLOX 4 dB), so the
    choice is per model and judged on samples it was not made on. Without held-out samples
    (``holdout`` 0, or one sample), nothing changes.

    Nor with 16-bit activations: the clipping methods cut where an 8-bit grid's rounding and
    clipping errors balance (mse) or at a fixed tail (percentile), far too deep for 65536 steps,
    and the fit-sample score that preferred them came before bias correction, which undoes most
    of what it measured (zoo and transformer bench, `--activation-type int16 --data`: the only
    two models where another method was chosen lost 7.4 dB (CRNN + BiLSTM, mse) and 3.0 dB
    (PP-OCRv4 rec, mse) against keeping the minmax table).

    ``channels``: tensors whose per-channel ranges the candidates' calibration on the fit samples
    and a chosen method's on all of DATA measure on the way (``pick.fit_channel_ranges``,
    ``pick.channel_ranges``), for the per-channel scales step."""
    start = time.perf_counter()
    pick = MethodPick(table_method=table.method, chosen=table.method)
    if options.activation_type == "int16":
        pick.reason = "int16 activations: percentile's and mse's cuts are made for 8-bit steps"
        return table, pick
    float_model = prepare_file(model_path)
    fit, held = fit_and_heldout(float_model, data_path, num_samples, holdout, batch_size, preprocess)
    if held is None:
        pick.seconds = time.perf_counter() - start
        return table, pick
    qdq_options = replace(options, format="qdq", strict=False)
    evaluator = Evaluator(float_model, fit)
    pick.scored, pick.fit_samples = evaluator.scored, fit.samples
    candidates = list(dict.fromkeys([table.method, *methods]))
    ends = past_last_layer(float_model)
    pick.ends = len(ends & set(table.tensors))
    # one pass over the fit samples for the methods that read the same histograms
    collected = collect_methods(model_path, data_path, [m for m in candidates if m != table.method],
                                batch_size=batch_size, progress=False, preprocess=preprocess, feeds=fit,
                                channels=channels)
    pick.fit_channel_ranges = next((s.channel_ranges for s in collected.values() if s.channel_ranges), {})
    models = {}
    with progress_bar(len(candidates), "methods", progress, unit="method") as bar:
        for method in candidates:
            fitted = table if method == table.method else collected[method].table_keeping_ends(ends)
            models[method], _ = quantize(model_path, fitted, qdq_options, table_name, scored_only=True)
            pick.fit_db[method] = evaluator.sqnr(models[method])
            bar.update(1)
    best = max(candidates, key=lambda m: (pick.fit_db[m], m == table.method))
    if best == table.method:
        pick.seconds = time.perf_counter() - start
        return table, pick
    judge = Evaluator(float_model, held)
    pick.heldout = held.samples
    pick.heldout_table_db = judge.sqnr(models[table.method])
    pick.heldout_chosen_db = judge.sqnr(models[best])
    if not pick.heldout_chosen_db > pick.heldout_table_db:
        pick.seconds = time.perf_counter() - start
        return table, pick
    pick.chosen = best
    stats = collect(model_path, data_path, best, batch_size=batch_size, progress=False, preprocess=preprocess,
                    channels=channels)
    pick.channel_ranges = stats.channel_ranges
    pick.seconds = time.perf_counter() - start
    return stats.table_keeping_ends(ends), pick
