"""If, Loop and Scan: their subgraphs as models of their own, and the three ops' semantics.

A subgraph reads three kinds of names: its formal inputs (Loop's iteration number, condition and
carried values; Scan's states and slices; none for If), its own initializers and Constant nodes,
and names of the scope around it (tensors and initializers of the enclosing graphs). ``body_model``
makes it a model whose graph inputs are the formal inputs followed by the outer tensors it reads;
outer initializers stay with the caller, which hands them over as constants. calibrate runs such
models in onnxruntime to see the tensors inside a body (qtool/calibrate.py), quantize rewrites them
as it rewrites a main graph (qtool/quantize.py), and the executor runs them integer
(qtool/executor.py), each calling ``run`` below with a function that runs one body.

The semantics are the ONNX specification's:
* If: the ``then_branch`` when the condition (a one-element bool tensor) is true, else the
  ``else_branch``; the node's outputs are the branch's outputs.
* Loop (``M``, ``cond``, carried...): while ``i < M`` (absent: no limit) and ``cond`` (absent:
  true), the body maps ``(i, cond, carried...)`` to ``(cond, carried..., scan outputs...)``; the
  outputs are the final carried values, then each scan output stacked over the iterations.
* Scan (opset 9+): ``num_scan_inputs`` inputs sliced along ``scan_input_axes`` (reversed where
  ``scan_input_directions`` says 1); the body maps ``(states..., slices...)`` to
  ``(states..., output slices...)``; outputs are the final states, then each output's slices
  stacked along ``scan_output_axes`` (in reverse order where ``scan_output_directions`` says 1).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import QtoolError
from .model import (FloatRunner, constants_to_initializers, float_tensors, graphs_outer_reads, node_reads,
                    subgraphs)

CONTROL_OPS = ("If", "Loop", "Scan")
# a Loop with neither a trip count nor a condition input would never end: refused past this
MAX_ITERATIONS = 1_000_000


def body_graphs(node: onnx.NodeProto) -> dict[str, onnx.GraphProto]:
    """Attribute name -> subgraph of an If, Loop or Scan node."""
    return {a.name: a.g for a in node.attribute if a.HasField("g")}


def graph_outer_reads(graph: onnx.GraphProto) -> list[str]:
    """The names ``graph`` reads from the scopes around it, in first-read order."""
    return graphs_outer_reads([graph])


def body_model(graph: onnx.GraphProto, outer: list[str], opset_import, ir_version: int,
               types: dict[str, onnx.TypeProto] | None = None) -> onnx.ModelProto:
    """``graph`` as a model: graph inputs its formal inputs, then the ``outer`` names (typed from
    ``types`` where known); its Constant nodes as initializers."""
    graph = onnx.GraphProto.FromString(graph.SerializeToString())
    inputs = list(graph.input)
    for vi in inputs:  # a carried value may change shape from iteration to iteration: types only
        if vi.type.HasField("tensor_type"):
            vi.type.tensor_type.ClearField("shape")
    for name in outer:
        vi = onnx.ValueInfoProto(name=name)
        if types and name in types and types[name].HasField("tensor_type"):
            vi.type.tensor_type.elem_type = types[name].tensor_type.elem_type  # shapes vary by batch
        elif types and name in types:
            vi.type.CopyFrom(types[name])
        inputs.append(vi)
    constants_to_initializers(graph)
    del graph.input[:]
    graph.input.extend(inputs)
    model = helper.make_model(graph, opset_imports=list(opset_import))
    model.ir_version = ir_version
    return model


def is_control(node: onnx.NodeProto) -> bool:
    return node.op_type in CONTROL_OPS and node.domain in ("", "ai.onnx") and bool(subgraphs(node))


RunBody = Callable[[str, dict[str, np.ndarray]], list[np.ndarray]]


def run(node: onnx.NodeProto, values: dict[str, np.ndarray], run_body: RunBody) -> list[np.ndarray]:
    """The node's outputs. ``values``: its inputs and what its bodies read from outside, by name;
    ``run_body(attribute name, feeds)`` runs that body on its formal inputs and the outer values
    (``values`` is passed on whole) and returns its outputs in order."""
    if node.op_type == "If":
        cond = np.asarray(values[node.input[0]])
        if cond.size != 1:
            raise QtoolError(f"If node '{node.name}': its condition has {cond.size} elements, not 1")
        return run_body("then_branch" if bool(cond.reshape(-1)[0]) else "else_branch", values)
    if node.op_type == "Loop":
        return _loop(node, values, run_body)
    return _scan(node, values, run_body)


def _loop(node, values, run_body: RunBody) -> list[np.ndarray]:
    body = body_graphs(node)["body"]
    formal = [vi.name for vi in body.input]
    limit = values[node.input[0]] if node.input[0] else None
    limit = None if limit is None else int(np.asarray(limit).reshape(-1)[0])
    cond = True
    if len(node.input) > 1 and node.input[1]:
        cond = bool(np.asarray(values[node.input[1]]).reshape(-1)[0])
    carried = [values[name] for name in node.input[2:]]
    n_carried = len(carried)
    scans: list[list[np.ndarray]] = []
    i = 0
    while cond and (limit is None or i < limit):
        if limit is None and i >= MAX_ITERATIONS:
            raise QtoolError(f"Loop node '{node.name}' ran {MAX_ITERATIONS} iterations without its "
                             f"condition turning false")
        feeds = dict(values)
        feeds[formal[0]] = np.array(i, dtype=np.int64)
        feeds[formal[1]] = np.array(cond, dtype=np.bool_)
        feeds.update(zip(formal[2:], carried))
        out = run_body("body", feeds)
        cond = bool(np.asarray(out[0]).reshape(-1)[0])
        carried = list(out[1:1 + n_carried])
        if not scans:
            scans = [[] for _ in out[1 + n_carried:]]
        for acc, value in zip(scans, out[1 + n_carried:]):
            acc.append(np.asarray(value))
        i += 1
    declared = list(body.output)[1 + n_carried:]
    if not scans:  # no iteration: empty, of the type and the known sizes the body declares
        return [np.asarray(v) for v in carried] + [_empty(vi, 0) for vi in declared]
    return [np.asarray(v) for v in carried] + [np.stack(acc) for acc in scans]


def _scan(node, values, run_body: RunBody) -> list[np.ndarray]:
    body = body_graphs(node)["body"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if not a.HasField("g")}
    m = int(attrs["num_scan_inputs"])
    inputs = [values[name] if name else None for name in node.input]
    n = len(inputs) - m
    states, scanned = inputs[:n], [np.asarray(v) for v in inputs[n:]]
    in_axes = list(attrs.get("scan_input_axes", [0] * m))
    in_dirs = list(attrs.get("scan_input_directions", [0] * m))
    k = len(body.output) - n
    out_axes = list(attrs.get("scan_output_axes", [0] * k))
    out_dirs = list(attrs.get("scan_output_directions", [0] * k))
    in_axes = [a % v.ndim for a, v in zip(in_axes, scanned)]
    lengths = {v.shape[a] for a, v in zip(in_axes, scanned)}
    if len(lengths) != 1:
        raise QtoolError(f"Scan node '{node.name}': its scanned inputs have different lengths {sorted(lengths)}")
    steps = lengths.pop()
    formal = [vi.name for vi in body.input]
    outs: list[list[np.ndarray]] = [[] for _ in range(k)]
    for t in range(steps):
        feeds = dict(values)
        feeds.update(zip(formal[:n], states))
        for j, (v, axis, direction) in enumerate(zip(scanned, in_axes, in_dirs)):
            feeds[formal[n + j]] = np.take(v, steps - 1 - t if direction else t, axis=axis)
        out = run_body("body", feeds)
        states = out[:n]
        for acc, value in zip(outs, out[n:]):
            acc.append(np.asarray(value))
    results = [np.asarray(s) for s in states]
    for acc, axis, direction, vi in zip(outs, out_axes, out_dirs, list(body.output)[n:]):
        if direction:
            acc = acc[::-1]
        if not acc:  # no step: empty along the scan axis
            rank = len(vi.type.tensor_type.shape.dim) + 1
            results.append(_empty(vi, axis % rank))
            continue
        results.append(np.stack(acc, axis=axis % (acc[0].ndim + 1)))
    return results


def _empty(vi: onnx.ValueInfoProto, axis: int) -> np.ndarray:
    """What zero iterations stack of a body output: 0 along ``axis``, the declared sizes elsewhere
    (0 where a size is not known), in the declared type."""
    tensor = vi.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tensor.shape.dim]
    dims.insert(axis, 0)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type) if tensor.elem_type else np.float32
    return np.zeros(dims, dtype=dtype)


def constant_reads(graph: onnx.GraphProto, constants: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outer initializers (of ``constants``) that ``graph`` reads."""
    return {name: constants[name] for name in graph_outer_reads(graph) if name in constants}


def to_initializers(arrays: dict[str, np.ndarray]) -> list[onnx.TensorProto]:
    return [numpy_helper.from_array(np.asarray(v), name) for name, v in arrays.items()]


class BodyStats:
    """Calibration inside the If, Loop and Scan nodes of a graph: each body runs as a model of its
    own in onnxruntime (``body_model``) on the values the enclosing run gave its node, through the
    op's semantics (``run``: the branch taken, every iteration), and each float tensor an integer op
    inside reads or writes updates its calibrator with the whole tensor. Bodies inside bodies too.

    ``feeds_needed``: what the enclosing run must return for this: the control nodes' inputs and
    the outer tensors their bodies read."""

    def __init__(self, model: onnx.ModelProto, needed, new_calibrator, calibrators: dict,
                 constants: dict[str, np.ndarray], types: dict[str, onnx.TypeProto],
                 seen: set[str] | None = None):
        """``needed(body model, its float tensors)``: the tensors to calibrate (qtool.calibrate's
        ``needed_tensors``); ``calibrators``: name -> calibrator, shared with the caller, which
        gains one per body tensor; ``types``: the enclosing graph's value types; ``seen``: the
        set of computed body tensors, shared by every level (None: a new one)."""
        self.controls = [node for node in model.graph.node if is_control(node)]
        self.feeds_needed = list(dict.fromkeys(
            n for node in self.controls for n in node_reads(node) if n not in constants))
        self.bodies: dict[tuple[str, str], tuple] = {}
        # constant inputs of the control nodes (a Loop's trip count)
        self.constant_inputs = {n: constants[n] for node in self.controls for n in node.input if n in constants}
        self.calibrators = calibrators
        # body tensors that were computed, at any depth (a branch may never be taken)
        self.seen: set[str] = set() if seen is None else seen
        for node in self.controls:
            for attr, graph in body_graphs(node).items():
                outer = [n for n in graph_outer_reads(graph) if n not in constants]
                body = body_model(graph, outer, model.opset_import, model.ir_version, types)
                body.graph.initializer.extend(to_initializers(constant_reads(graph, constants)))
                inner_types = dict(types)
                inner_types.update({vi.name: vi.type for vi in [*graph.value_info, *graph.input, *graph.output]
                                    if vi.type.HasField("tensor_type")})
                names = [n for n in needed(body, float_tensors(body)) if n not in calibrators]
                for name in names:
                    calibrators[name] = new_calibrator()
                inner_constants = {**constants, **{t.name: numpy_helper.to_array(t) for t in body.graph.initializer}}
                inner = BodyStats(body, needed, new_calibrator, calibrators, inner_constants, inner_types,
                                  self.seen)
                self.bodies[(node.name, attr)] = (body, names, inner, None)

    def unseen(self) -> list[str]:
        """Body tensors no run computed (in a branch never taken, a loop that never iterated)."""
        return [name for _, names, inner, _ in self.bodies.values()
                for name in [*names, *inner.unseen()] if name not in self.seen]

    def names(self) -> list[str]:
        """Every body tensor calibrated here, computed or not."""
        return [name for _, names, inner, _ in self.bodies.values() for name in [*names, *inner.names()]]

    def tensors(self) -> int:
        return len(self.names())

    def update(self, values: dict[str, np.ndarray]) -> None:
        """One run of the enclosing graph: ``values`` holds ``feeds_needed``."""
        values = {**self.constant_inputs, **values}
        for node in self.controls:
            run(node, values, lambda attr, feeds, node=node: self._run_body(node, attr, feeds))

    def _run_body(self, node: onnx.NodeProto, attr: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        body, names, inner, runner = self.bodies[(node.name, attr)]
        inputs = {vi.name for vi in body.graph.input} - {t.name for t in body.graph.initializer}
        if runner is None:
            runner = FloatRunner(body, names + [n for n in inner.feeds_needed if n not in names and n not in inputs],
                                 layouts=False)  # every tensor an output: as calibrate's main session
            self.bodies[(node.name, attr)] = (body, names, inner, runner)
        out = runner.run({n: feeds[n] for n in inputs})
        for name in names:
            self.calibrators[name].update(out[name])
        self.seen.update(names)
        if inner.controls:
            inner.update({**feeds, **out})
        return [out[o.name] for o in body.graph.output]
