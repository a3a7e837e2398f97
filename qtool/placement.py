"""Where int16 goes in a transformer (``quantize --data``): groups of ops, chosen by held-out score.

A transformer loses its int8 accuracy in the same few places in every model, and each is a
group of ops that only helps as a whole:

* the **residual stream**: the LayerNormalization ops and the Adds whose sums they read, back
  through Adds (the residual sum, the bias Adds of the layers that feed it: the stream carries outlier channels a hundred times the median, so one int8 scale per tensor
  leaves the other channels a few steps);
* the **attention probabilities**: the Softmax ops and the scaling of the scores they read
  (most probabilities are far below the largest, and int8 steps of 1/255 round them to 0), and
  where a Softmax's weights pool an activation (a Mul, then a ReduceSum or ReduceMean over it),
  that Mul and sum;
* the **GELU outputs**;
* the **attention MatMuls**: MatMuls of two activations (scores and context).

The groups are chosen greedily on the fit samples of DATA: each round adds the group that
raises the worst output's SQNR most (``qtool.analyze.Evaluator``), if by at least ``GAIN_DB``;
where none does, the groups left are tried all together once (two bottlenecks in a row, each
capping the output while the other stays int8: smart-turn's speech encoder, its GELU outputs and
its attention pooling, 11.3 dB on the fit samples with either and 43 dB on others with both).
The groups chosen are then scored on held-out samples against the all-int8 model and kept only
where they score higher there (where the groups taken together lose there, the greedy rounds' own
choice is judged instead). A model with no LayerNormalization, no Gelu (after fusion) and no
Softmax of attention scores (a MatMul of two activations) is not a transformer: nothing is tried.
Costs one quantize and one onnxruntime run over the fit samples per try (at most 10 for the four
groups), then two over the held-out ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import onnx

from .analyze import Evaluator
from .model import prepare_file
from .quantize import quantize
from .report import finite, progress_bar
from .search import fit_and_heldout
from .table import Table
from .targets import DEFAULT_TARGET

GAIN_DB = 1.0
MARKERS = ("LayerNormalization", "Gelu")  # and a Softmax of attention scores (_reads)
_FEEDERS = ("Add", "Sub", "Mul", "Div", "Where", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten")
_RESHAPES = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Expand")


def groups(model: onnx.ModelProto) -> dict[str, list[str]]:
    """The candidate groups of ``model`` (prepared: LayerNorm and GELU fused), by name: node names
    in graph order; a group the model lacks is left out."""
    nodes = list(model.graph.node)
    constants = {i.name for i in model.graph.initializer} | {n.output[0] for n in nodes if n.op_type == "Constant"}
    producer = {o: n for n in nodes for o in n.output}
    attention = {n.name for n in nodes if n.op_type == "MatMul" and not any(i in constants for i in n.input[:2])}
    if not any(n.op_type in MARKERS for n in nodes) and not any(
            n.op_type == "Softmax" and _reads(producer, n, attention) for n in nodes):
        return {}

    def with_feeders(core: set[str]) -> list[str]:
        """``core`` and the ops that make its inputs, back through elementwise and shape-only ops
        (a bias Add, the residual sum, the scaling of scores, Reshape/Transpose into heads), so
        that a MatMul's output is fenced int16 where the group reads it; graph order."""
        found, todo = set(core), [i for n in nodes if n.name in core for i in n.input]
        while todo:
            node = producer.get(todo.pop())
            if node is not None and node.op_type in _FEEDERS and node.name not in found:
                found.add(node.name)
                todo += list(node.input)
        return [n.name for n in nodes if n.name in found]

    found = {
        "residual stream": with_feeders({n.name for n in nodes if n.op_type == "LayerNormalization"}),
        "attention probabilities": with_feeders({n.name for n in nodes if n.op_type == "Softmax"}
                                                | _pooling(nodes, constants)),
        "GELU outputs": with_feeders({n.name for n in nodes if n.op_type == "Gelu"}),
        "attention MatMuls": with_feeders(attention),
    }
    return {name: members for name, members in found.items() if members}


def _pooling(nodes: list[onnx.NodeProto], constants: set[str]) -> set[str]:
    """Attention pooling: a Mul of a Softmax's weights by an activation and the ReduceSum or
    ReduceMean over it, through ops that only reshape on the way (PyTorch's
    ``softmax(s).unsqueeze(-1) * x``), those included (a speech encoder's pooling over 400 frames:
    each int8 product of a weight near 1/400 is a few steps, and the sum adds 400 roundings;
    smart-turn's pooled features fell from 39 to 17 dB there). Node names."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def onward(tensor: str, wanted) -> tuple[list[onnx.NodeProto], list[str]]:
        """The nodes ``wanted`` accepts that read ``tensor`` through reshaping ops, and those ops."""
        found, moved, todo = [], [], [tensor]
        while todo:
            for reader in readers.get(todo.pop(), []):
                if wanted(reader):
                    found.append(reader)
                elif reader.op_type in _RESHAPES:
                    moved.append(reader.name)
                    todo += [o for o in reader.output if o]
        return found, moved

    out: set[str] = set()
    for softmax in (n for n in nodes if n.op_type == "Softmax"):
        muls, on_way = onward(softmax.output[0], lambda r: r.op_type == "Mul" and
                              not any(i in constants for i in r.input))
        for mul in muls:
            sums, more = onward(mul.output[0], lambda r: r.op_type in ("ReduceSum", "ReduceMean"))
            out |= {mul.name, *on_way, *{s.name for s in sums}, *(more if sums else [])}
    return out


def _reads(producer: dict, node: onnx.NodeProto, sources: set[str]) -> bool:
    """Whether ``node`` reads, back through elementwise and shape-only ops, one of ``sources``
    (a Softmax of attention scores; a classifier's Softmax reads a Gemm)."""
    todo, seen = list(node.input[:1]), set()
    while todo:
        source = producer.get(todo.pop())
        if source is None or source.name in seen:
            continue
        seen.add(source.name)
        if source.name in sources:
            return True
        if source.op_type in _FEEDERS:
            todo += list(source.input)
    return False


@dataclass
class Placement:
    """The groups tried and chosen, with their scores (``to_dict`` goes into the report)."""

    groups: dict[str, int] = field(default_factory=dict)  # name -> ops in it
    rounds: list[dict[str, float]] = field(default_factory=list)  # per round: group -> fit SQNR with it
    chosen: list[str] = field(default_factory=list)  # groups chosen on the fit samples
    int16: list[str] = field(default_factory=list)  # the ops given int16 (empty: all-int8 kept)
    fit_samples: int = 0
    fit_int8_db: float = 0.0
    fit_chosen_db: float = 0.0
    heldout: int = 0
    heldout_int8_db: float = 0.0
    heldout_chosen_db: float = 0.0
    scored: str = ""
    seconds: float = 0.0

    @property
    def kept(self) -> bool:
        return bool(self.int16)

    def to_dict(self) -> dict:
        return {"groups": self.groups, "rounds": [{g: finite(v) for g, v in r.items()} for r in self.rounds],
                "chosen": self.chosen, "kept": self.kept, "int16": self.int16, "gain_db": GAIN_DB,
                "fit_samples": self.fit_samples, "fit_int8_sqnr_db": finite(self.fit_int8_db),
                "fit_chosen_sqnr_db": finite(self.fit_chosen_db), "heldout_samples": self.heldout,
                "heldout_int8_sqnr_db": finite(self.heldout_int8_db),
                "heldout_chosen_sqnr_db": finite(self.heldout_chosen_db), "scored": self.scored,
                "seconds": round(self.seconds, 2)}


def applies(options) -> bool:
    """Placement is for int8 QDQ models for the default target whose int16 ops nobody named."""
    return (options.activation_type == "int8" and options.format == "qdq" and options.target == DEFAULT_TARGET
            and not options.int16)


def place(model_path, table: Table, options, table_name: str, data_path, num_samples: int | None = None,
          batch_size: int = 8, progress: bool = True, preprocess=None, holdout: int | None = None):
    """``options`` with int16 given to the groups chosen (see the module's docstring), and the
    Placement (None where the model is not a transformer or ``options`` do not apply)."""
    start = time.perf_counter()
    float_model = prepare_file(model_path)
    found = groups(float_model) if applies(options) else {}
    if not found:
        return options, None
    result = Placement(groups={name: len(members) for name, members in found.items()})
    fit, held = fit_and_heldout(float_model, data_path, num_samples, holdout, batch_size, preprocess)
    evaluator = Evaluator(float_model, fit)
    result.scored, result.fit_samples = evaluator.scored, fit.samples

    def build(chosen: list[str]) -> onnx.ModelProto:
        names = tuple(n for g in chosen for n in found[g])
        return quantize(model_path, table, replace(options, int16=names, strict=False), table_name,
                        scored_only=True)[0]

    models = {(): build([])}
    best = None
    chosen: list[str] = []
    greedy: list[str] = []  # the groups greedy rounds chose, where the groups left together won after
    tries = len(found) * (len(found) + 1) // 2
    with progress_bar(tries, "int16 placement", progress, unit="try") as bar:
        while len(chosen) < len(found):
            names = [name for name in found if name not in chosen]
            for name in names:
                models[tuple(chosen + [name])] = build(chosen + [name])
                bar.update(1)
            # each try changes the model from its group's first op on: what comes before runs once
            got = evaluator.sqnrs(models[tuple(chosen)], *(models[tuple(chosen + [n])] for n in names))
            if best is None:
                result.fit_int8_db = best = got[0]
            scores = dict(zip(names, got[1:]))
            result.rounds.append(scores)
            pick = max(scores, key=lambda g: scores[g])
            if not scores[pick] >= best + GAIN_DB:
                if len(names) > 1:  # none alone, maybe all together: two bottlenecks in a row
                    together = tuple(chosen + names)
                    models[together] = build(list(together))
                    bar.update(1)
                    score = evaluator.sqnrs(models[tuple(chosen)], models[together])[1]
                    result.rounds.append({" + ".join(names): score})
                    if score >= best + GAIN_DB:
                        greedy, chosen, best = list(chosen), list(together), score
                break
            chosen.append(pick)
            best = scores[pick]
            for key in [k for k in models if k and k != tuple(chosen)]:
                del models[key]  # only the chosen model is judged
    result.chosen, result.fit_chosen_db = chosen, best
    if chosen and held is not None:
        judge = Evaluator(float_model, held)
        result.heldout = held.samples
        result.heldout_int8_db, result.heldout_chosen_db = judge.sqnrs(models[()], models[tuple(chosen)])
        if not result.heldout_chosen_db > result.heldout_int8_db and greedy:
            # the groups left together lost there: the greedy rounds' choice is judged as before
            chosen, result.fit_chosen_db = greedy, result.rounds[len(greedy) - 1][greedy[-1]]
            result.chosen = chosen
            result.heldout_chosen_db = judge.sqnrs(models[()], models[tuple(chosen)])[1]
        if result.heldout_chosen_db > result.heldout_int8_db:
            result.int16 = [n for g in chosen for n in found[g]]
    result.seconds = time.perf_counter() - start
    if not result.int16:
        return options, result
    return replace(options, int16=tuple(result.int16)), result
