"""Where an elementwise op stops changing: the input range its readers need.

HardSwish is 0 for every input below -3, HardSigmoid is constant outside its linear part, and
Clip outside its constant bounds. A tensor read only by such ops needs its range only between the
bounds: every value beyond them gives the same output as the bound itself, exactly, whatever the
output's steps. ``qtool quantize`` cuts such an 8-bit tensor's range there (after BatchNorm
folding, a HardSwish input spans [-19.6, 18.8] on PP-OCRv4 rec and [-3, 18.8] is all it needs),
and ``qtool verify`` compares it clipped to the same bounds (the float model's readers, found by
``flat_cuts``: a QOperator model has a lookup Gather where the HardSwish was).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper


def flat_bounds(node: onnx.NodeProto, constant: Callable[[str], np.ndarray | None]) -> tuple[float, float] | None:
    """``(a, b)`` such that ``node``'s output for an input beyond them equals its output at the
    bound (one side may be infinite), or None for an op that is not flat anywhere or whose bounds
    are not constants (``constant(name)``: an initializer's value, or None)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "HardSwish":
        return -3.0, np.inf
    if node.op_type == "HardSigmoid":
        alpha, beta = float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5))
        return (-beta / alpha, (1.0 - beta) / alpha) if alpha > 0 else None
    if node.op_type == "Clip":
        bounds = [float(attrs.get("min", -np.inf)), float(attrs.get("max", np.inf))]
        for i in (1, 2):
            if i < len(node.input) and node.input[i]:
                value = constant(node.input[i])
                if value is None or np.size(value) != 1:
                    return None
                bounds[i - 1] = float(np.asarray(value).reshape(-1)[0])
        return (bounds[0], bounds[1]) if bounds[0] < bounds[1] else None
    return None


def readers_cut(name: str, readers: list[tuple[onnx.NodeProto, list[str]]],
                constant: Callable[[str], np.ndarray | None]) -> tuple[float, float] | None:
    """The widest of the readers' ``flat_bounds`` where every reader is flat and reads ``name``
    as its first input only, else None. ``readers``: each reader's node and the names its inputs
    go by (the node's own, or a QDQ model's tensors as the executor keys them)."""
    if not readers:
        return None
    lo, hi = np.inf, -np.inf
    for node, inputs in readers:
        bounds = flat_bounds(node, constant)
        if bounds is None or not inputs or inputs[0] != name or name in inputs[1:]:
            return None
        lo, hi = min(lo, bounds[0]), max(hi, bounds[1])
    return (float(lo), float(hi)) if np.isfinite(lo) or np.isfinite(hi) else None


def flat_cuts(model: onnx.ModelProto) -> dict[str, tuple[float, float]]:
    """tensor -> ``readers_cut`` for every tensor of ``model``'s graph whose readers are all flat
    beyond some bounds (the float model's readers: verify finds them in either output form)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in dict.fromkeys(node.input):
            if name:
                readers.setdefault(name, []).append(node)
    constants = {i.name: i for i in model.graph.initializer}

    def constant(name: str) -> np.ndarray | None:
        return numpy_helper.to_array(constants[name]) if name in constants else None

    outputs = {o.name for o in model.graph.output}
    cuts = {}
    for name, nodes in readers.items():
        cut = None if name in outputs else readers_cut(name, [(n, list(n.input)) for n in nodes], constant)
        if cut is not None:
            cuts[name] = cut
    return cuts
