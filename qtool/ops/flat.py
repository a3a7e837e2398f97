"""Where an elementwise op stops changing: the input range its readers need.

HardSwish is 0 for every input below -3, HardSigmoid is constant outside its linear part, and
Clip outside its constant bounds. A tensor read only by such ops needs its range only between the
bounds: every value beyond them gives the same output as the bound itself, exactly, whatever the
output's steps. ``qtool quantize`` cuts such an 8-bit tensor's range there (after BatchNorm
folding, a HardSwish input spans [-19.6, 18.8] on PP-OCRv4 rec and [-3, 18.8] is all it needs),
and ``qtool verify`` compares it clipped to the same bounds (the float model's readers, found by
``flat_cuts``: a QOperator model has a lookup Gather where the HardSwish was). Sigmoid and Tanh
are flat only to their output's steps (``saturation_window``): quantize cuts an 8-bit input read
only by them where the output is within a quarter step of its ends, and verify compares it there.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper


# increasing ops flat at both ends, by op type: (their output's open range, their inverse)
SATURATING = {"Sigmoid": ((0.0, 1.0), lambda p: float(np.log(p / (1.0 - p)))),
              "Tanh": ((-1.0, 1.0), lambda p: float(np.arctanh(p)))}


def saturation_window(op_type: str, y_lo: float, y_hi: float, step: float) -> tuple[float, float] | None:
    """For a Sigmoid or Tanh whose output spans ``[y_lo, y_hi]`` in steps of ``step``: the inputs
    between which the output is more than a quarter step from its ends, ``[f^-1(y_lo + step/4),
    f^-1(y_hi - step/4)]`` (an end where that is outside the output's open range is infinite), as
    quantize cuts an 8-bit input read only by them; None for other ops."""
    if op_type not in SATURATING:
        return None
    (f_lo, f_hi), inverse = SATURATING[op_type]
    bottom, top = y_lo + step / 4, y_hi - step / 4
    return (inverse(bottom) if f_lo < bottom < f_hi else -np.inf,
            inverse(top) if f_lo < top < f_hi else np.inf)


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
    return _widest(name, readers, lambda node: flat_bounds(node, constant))


def _widest(name: str, readers: list[tuple[onnx.NodeProto, list[str]]], bounds_of) -> tuple[float, float] | None:
    """The widest of ``bounds_of(node)`` over the readers, where each has bounds and reads ``name``
    as its first input only; else None (also for no reader, or no finite bound)."""
    if not readers:
        return None
    lo, hi = np.inf, -np.inf
    for node, inputs in readers:
        bounds = bounds_of(node)
        if bounds is None or not inputs or inputs[0] != name or name in inputs[1:]:
            return None
        lo, hi = min(lo, bounds[0]), max(hi, bounds[1])
    return (float(lo), float(hi)) if lo < hi and (np.isfinite(lo) or np.isfinite(hi)) else None


def flat_cuts(model: onnx.ModelProto, output_range=None) -> dict[str, tuple[float, float]]:
    """tensor -> the bounds beyond which its readers in ``model``'s graph (the float model: verify
    finds them in either output form) do not change: ``readers_cut``, or where every reader is a
    Sigmoid (or every one a Tanh) and ``output_range(output)`` gives their outputs' ``(y_lo, y_hi,
    step)``, the widest ``saturation_window``."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in dict.fromkeys(node.input):
            if name:
                readers.setdefault(name, []).append(node)
    constants = {i.name: i for i in model.graph.initializer}

    def constant(name: str) -> np.ndarray | None:
        return numpy_helper.to_array(constants[name]) if name in constants else None

    def saturating(node: onnx.NodeProto) -> tuple[float, float] | None:
        given = output_range(node.output[0]) if node.output and node.domain in ("", "ai.onnx") else None
        return None if given is None else saturation_window(node.op_type, *given)

    outputs = {o.name for o in model.graph.output}
    cuts = {}
    for name, nodes in readers.items():
        if name in outputs:
            continue
        pairs = [(n, list(n.input)) for n in nodes]
        cut = readers_cut(name, pairs, constant)
        if cut is None and output_range is not None and len({n.op_type for n in nodes}) == 1:
            cut = _widest(name, pairs, saturating)
        if cut is not None:
            cuts[name] = cut
    return cuts
