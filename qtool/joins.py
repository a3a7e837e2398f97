"""Graph outputs that join tensors: a Concat of two or more tensors reached back from the output
through ops that keep every value where it is or only move it (Reshape, Transpose, Flatten,
Squeeze, Unsqueeze, Identity, elementwise maps with a constant operand).

A detector's output often concatenates values of very different ranges: YOLOv8's [1, 84, N] holds
box coordinates in pixels (0-640) beside 80 class probabilities (0-1). quantize keeps such a join
float (one int8 scale for both would leave the probabilities a step or two), and verify scores each
part on its own (the whole tensor's cosine is the boxes').

A join's input can itself be a join, reached back through ops that only move values: YOLOX
concatenates each level's boxes, objectness and class scores along the channels, then the levels.
The parts are then the inner Concats' inputs (a level's class scores), not the levels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

MOVES = {"Identity", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze"}
# a value in, a value out at the same position
UNARY = {"Sigmoid", "Relu", "Tanh", "Clip", "HardSigmoid", "HardSwish", "LeakyRelu", "Exp", "Log",
         "Softplus", "Neg", "Abs", "Sqrt", "Cast", "QuantizeLinear", "DequantizeLinear", "Erf",
         "Elu", "Selu", "PRelu"}
BINARY = {"Add", "Sub", "Mul", "Div", "Pow"}  # with one operand constant


@dataclass
class Join:
    """Output ``output`` comes from Concat ``node`` of ``inputs`` along ``axis`` through ``chain``
    (from the Concat's output to the graph output, in order: each node and the input it moves)."""

    output: str
    node: str
    axis: int
    inputs: list[str]
    chain: list[tuple[onnx.NodeProto, str]] = field(default_factory=list)
    # an input that is itself a join (through moves only): its Join, whose output is that input
    nested: dict[str, "Join"] = field(default_factory=dict)

    def parts(self) -> list[str]:
        """The tensors the output's values come from, in order: the Concat's inputs, a nested
        join's replaced by its parts."""
        found = []
        for name in self.inputs:
            found += self.nested[name].parts() if name in self.nested else [name]
        return found

    def concat_of(self, part: str) -> str:
        """The Concat that reads ``part``."""
        for name in self.inputs:
            if name in self.nested and part in self.nested[name].parts():
                return self.nested[name].concat_of(part)
        return self.node

    def nodes(self) -> list[tuple[str, str]]:
        """(name, op type) of the Concats and of the ops between them and the output, the
        outermost Concat first."""
        found = [(self.node, "Concat")] + [(n.name, n.op_type) for n, _ in self.chain]
        for name in self.inputs:
            if name in self.nested:
                found += self.nested[name].nodes()
        return found

    def tensors(self) -> list[str]:
        """The float tensors whose shapes place the parts: the Concats' inputs and every tensor
        of the chains."""
        names = []
        for name in self.inputs:
            names += self.nested[name].tensors() if name in self.nested else [name]
        for node, moved in self.chain:
            names += [moved, node.output[0]]
        return list(dict.fromkeys(names))


def find_joins(model: onnx.ModelProto) -> dict[str, Join]:
    """Graph output -> its join, for the outputs that come from one."""
    constants = {i.name for i in model.graph.initializer}
    producer = {}
    for node in model.graph.node:
        if node.op_type == "Constant":
            constants.update(node.output)
        for out in node.output:
            producer[out] = node
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in model.graph.output}

    def concat(node: onnx.NodeProto, output: str, chain: list) -> Join | None:
        inputs = [n for n in node.input if n]
        if len(inputs) < 2:
            return None
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        join = Join(output, node.name, axis, inputs, chain[::-1])
        for name in dict.fromkeys(inputs):
            inner = _nested(name)
            if inner is not None and inputs.count(name) == 1:
                join.nested[name] = inner
        return join

    def _nested(name: str) -> Join | None:
        """The join that makes ``name`` through moves alone, every tensor on the way read once."""
        chain, current = [], name
        while (node := producer.get(current)) is not None and readers.get(current) == 1 \
                and current not in outputs:
            if node.op_type == "Concat":
                return concat(node, name, chain)
            if node.op_type not in MOVES:
                return None
            chain.append((node, node.input[0]))
            current = node.input[0]
        return None

    joins = {}
    for output in model.graph.output:
        chain, name = [], output.name
        while (node := producer.get(name)) is not None:
            if node.op_type == "Concat":
                join = concat(node, output.name, chain)
                if join is not None:
                    joins[output.name] = join
                break
            if node.op_type in MOVES or node.op_type in UNARY:
                following = node.input[0]
            elif node.op_type in BINARY:
                moving = [n for n in node.input if n and n not in constants]
                if len(moving) != 1:
                    break
                following = moving[0]
            else:
                break
            chain.append((node, following))
            name = following
    return joins


def part_map(join: Join, shapes: dict[str, tuple]) -> np.ndarray | None:
    """Each output element's part number (index into ``join.parts()``), from the float run's
    ``shapes`` of ``join.tensors()``; None where an op changes the number of values (a broadcast)."""
    labels = _labels(join, shapes, 0)
    return None if labels is None else labels[0]


def _labels(join: Join, shapes: dict[str, tuple], first: int) -> tuple[np.ndarray, int] | None:
    """``part_map`` of ``join``, its parts numbered from ``first``; and the number after its last."""
    pieces, number = [], first
    for name in join.inputs:
        if name in join.nested:
            inner = _labels(join.nested[name], shapes, number)
            if inner is None:
                return None
            piece, number = inner
        else:
            piece, number = np.full(shapes[name], number, dtype=np.int16), number + 1
        pieces.append(piece)
    rank = pieces[0].ndim
    if any(p.ndim != rank for p in pieces):
        return None
    labels = np.concatenate(pieces, axis=join.axis % rank if rank else 0)
    for node, moved in join.chain:
        out = tuple(shapes[node.output[0]])
        if tuple(shapes[moved]) != labels.shape:
            return None  # the other operand broadcast this one
        if node.op_type == "Transpose":
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            labels = np.transpose(labels, perm)
        elif labels.size == int(np.prod(out, dtype=np.int64)):
            labels = labels.reshape(out)  # moves in C order, or maps in place
        else:
            return None
        if labels.shape != out:
            return None
    return labels, number
