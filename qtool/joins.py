"""Graph outputs that join tensors: a Concat of two or more tensors reached back from the output
through ops that keep every value where it is or only move it (Reshape, Transpose, Flatten,
Squeeze, Unsqueeze, Identity, elementwise maps with a constant operand).

A detector's output often concatenates values of very different ranges: YOLOv8's [1, 84, N] holds
box coordinates in pixels (0-640) beside 80 class probabilities (0-1). quantize keeps such a join
float (one int8 scale for both would leave the probabilities a step or two), and verify scores each
part on its own (the whole tensor's cosine is the boxes').
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

    def tensors(self) -> list[str]:
        """The float tensors whose shapes place the parts: the Concat's inputs and every tensor
        of the chain."""
        names = list(self.inputs)
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
    joins = {}
    for output in model.graph.output:
        chain, name = [], output.name
        while (node := producer.get(name)) is not None:
            if node.op_type == "Concat":
                inputs = [n for n in node.input if n]
                if len(inputs) >= 2:
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    joins[output.name] = Join(output.name, node.name, axis, inputs, chain[::-1])
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
    """Each output element's part number (index into ``join.inputs``), from the float run's
    ``shapes`` of ``join.tensors()``; None where an op changes the number of values (a broadcast)."""
    sizes = [shapes[n] for n in join.inputs]
    rank = len(sizes[0])
    axis = join.axis % rank if rank else 0
    labels = np.concatenate([np.full(s, i, dtype=np.int16) for i, s in enumerate(sizes)], axis=axis)
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
    return labels
