"""Additive attention masks: found in the graph, kept out of every quantized range.

Exporters write a transformer's padding (and causal) mask as a tensor added to the attention
scores before Softmax: 0 where a position is attended, a huge negative number where it is not
(``(1 - mask) * finfo(float32).min``, ``* -10000``, ``Where(mask, 0, -inf)``), or select the
scores with ``Where(mask, scores, finfo.min)``. Quantized as an ordinary tensor, that number is the
whole range: every real score rounds to one step and attention comes out uniform, and a constant of
-3.4e38 dequantizes to -inf. So:

* a **mask tensor** is one whose values are 0 or at most ``SENTINEL`` (-1e4): a constant of such
  values, ``Mul`` by a scalar at most ``SENTINEL``, ``Where`` between such values, the sum or
  minimum of masks, and what Unsqueeze/Reshape/Expand/Cast/... make of one;
* **mask arithmetic** is the nodes that compute mask tensors and those that compute only for them
  (``Cast`` and ``Sub(1, mask)`` of the 0/1 input): they stay float, exactly as written;
* a **masked Softmax** reads ``Add(scores, mask)`` or ``Where(cond, scores, K)`` (K at most
  ``SENTINEL``), that tensor read by the Softmax alone. The scores are quantized, not the sum, and
  the executor runs the pair as one integer step (qtool/ops/softmax.py ``MaskedSoftmax``) in which
  masked positions get probability exactly 0, as float Softmax gives them.

The same functions read a float model (quantize) and the QDQ model qtool writes (the executor): the
mask chain is not quantized, so it looks the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

SENTINEL = -1e4
# ops that move, copy or retype a mask's values without changing them (the data input is 0)
# why mask arithmetic runs in float, as quantize and the executor report it
REASON = f"attention-mask arithmetic (0 or below {SENTINEL:g}: float, exact)"
_CARRIERS = {"Unsqueeze", "Squeeze", "Reshape", "Expand", "Transpose", "Tile", "Identity", "Flatten",
             "Slice", "Gather", "Cast", "CastLike", "Concat"}


def is_sentinel(value: np.ndarray) -> bool:
    """A constant whose every value is 0 or at most ``SENTINEL``, at least one of them the latter."""
    value = np.asarray(value)
    if value.dtype.kind != "f" or value.size == 0:
        return False
    low = value <= SENTINEL
    return bool(low.any() and np.all(low | (value == 0)))


def _all_low(value: np.ndarray | None) -> bool:
    return value is not None and np.asarray(value).dtype.kind == "f" and np.asarray(value).size > 0 \
        and bool(np.all(np.asarray(value) <= SENTINEL))


class MaskError(ValueError):
    """An additive mask that holds a value other than 0 and at most ``SENTINEL``."""


@dataclass(frozen=True)
class Join:
    """The node that applies a mask to scores, and the Softmax that reads its output."""

    node: str  # the Add or Where
    softmax: str
    scores: str  # the scores tensor (quantized)
    mask: str  # Add: the mask tensor; Where: the condition
    form: str  # "add"; "where": masked where the condition is false; "where_not": where it is true
    output: str  # the masked scores (the Softmax's input, never quantized)


@dataclass
class MaskPlan:
    tensors: set[str] = field(default_factory=set)  # mask tensors
    arithmetic: set[str] = field(default_factory=set)  # node names that compute only for masks
    joins: dict[str, Join] = field(default_factory=dict)  # by Softmax node name

    @property
    def join_nodes(self) -> dict[str, Join]:
        return {j.node: j for j in self.joins.values()}


def find(model: onnx.ModelProto, constants: dict[str, np.ndarray] | None = None) -> MaskPlan:
    graph = model.graph
    if constants is None:
        constants = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    else:
        constants = dict(constants)
    for node in graph.node:  # Constant nodes are constants too
        if node.op_type == "Constant" and node.output:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                constants[node.output[0]] = onnx.numpy_helper.to_array(value)
    plan = MaskPlan()
    masks = plan.tensors

    zeros: set[str] = set()  # all-zero tensors made at run time (zeros_like: Expand of a 0 constant)

    def mask_like(name: str) -> bool:
        return name in masks or (name in constants and (is_sentinel(constants[name]) or _all_low(constants[name])))

    def zero(name: str) -> bool:
        return name in zeros or (name in constants and constants[name].dtype.kind == "f"
                                 and not np.any(constants[name]))

    producer = {}
    for node in graph.node:
        for out in node.output:
            producer[out] = node
        ins = [n for n in node.input if n]
        op = node.op_type
        made = False
        if op == "Mul" and len(ins) == 2:
            made = any(n in constants and _all_low(constants[n]) and constants[n].size == 1 for n in ins) \
                or all(n in masks for n in ins)
        elif op == "Where" and len(ins) == 3:
            made = all(mask_like(n) or zero(n) for n in ins[1:]) and any(mask_like(n) for n in ins[1:])
        elif op in ("Add", "Sum", "Min") and ins:
            made = all(n in masks for n in ins)
        elif op in _CARRIERS and ins and ins[0] in masks:
            made = op != "Concat" or all(n in masks for n in ins)
            if op in ("Cast", "CastLike"):
                to = next((a.i for a in node.attribute if a.name == "to"), onnx.TensorProto.FLOAT)
                made = made and (op == "CastLike" or to in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                                                             onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16))
        if made:
            masks.update(o for o in node.output if o)
        elif op in _CARRIERS and op != "Concat" and ins and zero(ins[0]):
            zeros.update(o for o in node.output if o)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    for node in graph.node:
        if node.op_type != "Softmax" or node.input[0] in outputs:
            continue
        source = producer.get(node.input[0])
        if source is None or len(readers.get(node.input[0], [])) != 1:
            continue
        join = _join(source, node, masks, constants)
        if join is not None:
            plan.joins[node.name] = join
    # mask arithmetic: the nodes that make masks, and, walking back, those whose every output is
    # read only by mask arithmetic (the Cast and 1 - x of the 0/1 input)
    arithmetic = {n.name for n in graph.node if any(o in masks for o in n.output)}
    for node in reversed(graph.node):
        if node.name in arithmetic or not node.output:
            continue
        users = [u for o in node.output if o for u in readers.get(o, [])]
        if users and not any(o in outputs for o in node.output) and all(u.name in arithmetic for u in users):
            arithmetic.add(node.name)
    plan.arithmetic = arithmetic
    return plan


def _join(source: onnx.NodeProto, softmax: onnx.NodeProto, masks: set[str], constants) -> Join | None:
    ins = list(source.input)
    if source.op_type == "Add" and len(ins) == 2:
        is_mask = [n in masks or (n in constants and is_sentinel(constants[n])) for n in ins]
        if is_mask.count(True) != 1:
            return None
        k = is_mask.index(True)
        return Join(source.name, softmax.name, ins[1 - k], ins[k], "add", source.output[0])
    if source.op_type == "Where" and len(ins) == 3:
        low = [n in constants and _all_low(constants[n]) for n in ins[1:]]
        if low == [False, True]:
            return Join(source.name, softmax.name, ins[1], ins[0], "where", source.output[0])
        if low == [True, False]:
            return Join(source.name, softmax.name, ins[2], ins[0], "where_not", source.output[0])
    return None


def masked_positions(form: str, mask: np.ndarray) -> np.ndarray:
    """Where a join's mask operand hides a position (boolean). An additive mask must hold only 0
    and values at most ``SENTINEL`` (-inf included): anything else is a bias, not a mask."""
    if form == "where":
        return ~np.asarray(mask, dtype=bool)
    if form == "where_not":
        return np.asarray(mask, dtype=bool)
    mask = np.asarray(mask)
    hidden = mask <= SENTINEL
    if not np.all(hidden | (mask == 0)):
        bad = mask[~(hidden | (mask == 0))].reshape(-1)[0]
        raise MaskError(f"the additive mask holds {float(bad):g}, neither 0 nor at most {SENTINEL:g}")
    return hidden
