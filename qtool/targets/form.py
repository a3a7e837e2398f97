"""A target's storage form: int8 QDQ tensors rewritten as uint8 with their zero points moved by 128.

``q_u8 = q_s8 + 128`` and ``Z_u8 = Z_s8 + 128`` leave every ``S·(q − Z)`` and every integer kernel's
arithmetic as it was (kernels subtract zero points first), so the model computes exactly what the
int8 model does; only the types onnxruntime sees change: uint8 activations with uint8 weights
(zero point 128) select its u8 x u8 kernels, which cannot saturate.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ..model import without_weights

_Q_DQ = ("QuantizeLinear", "DequantizeLinear")


def _shifted(t: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array((numpy_helper.to_array(t).astype(np.int16) + 128).astype(np.uint8), t.name)


def to_unsigned(model: onnx.ModelProto) -> int:
    """Rewrite, in place, every int8 QuantizeLinear/DequantizeLinear of a QDQ model (and the int8
    weights they read) as uint8 + 128. Returns how many nodes changed."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    int8 = onnx.TensorProto.INT8
    shifted: set[str] = set()  # initializers already moved (zero points shared by a Q and its DQ)
    retyped: set[str] = set()  # tensors now uint8 (QuantizeLinear outputs, weights)
    changed = 0
    for node in graph.node:
        if node.op_type not in _Q_DQ or len(node.input) < 3 or node.input[2] not in inits:
            continue
        zero = inits[node.input[2]]
        if zero.data_type != int8 and node.input[2] not in shifted:
            continue
        if node.input[0] not in inits and len(zero.dims) == 1 and zero.dims[0] > 1:
            continue  # an activation per channel: its type was chosen (quantize._alternate_types)
        names = [node.input[2]]
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            names.append(node.input[0])  # a weight: its values move with its zero point
            retyped.add(node.input[0])
        for name in names:
            if name not in shifted and inits[name].data_type == int8:
                inits[name].CopyFrom(_shifted(inits[name]))
                shifted.add(name)
        if node.op_type == "QuantizeLinear":
            retyped.add(node.output[0])
        changed += 1
    for info in list(graph.value_info) + list(graph.input) + list(graph.output):
        if info.name in retyped and info.type.tensor_type.elem_type == int8:
            info.type.tensor_type.elem_type = onnx.TensorProto.UINT8
    return changed


# -- float-kept ops that onnxruntime would quantize -----------------------------------------------

_WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")  # MatMul + Add becomes a Gemm in onnxruntime
GUARD_SUFFIX = "_float_guard"


def is_guard(node: onnx.NodeProto) -> bool:
    """One of the identity nodes ``guard_float_ops`` writes."""
    return node.op_type in ("Flatten", "Reshape", "Max") and GUARD_SUFFIX in node.name


def _guard_shape(info: onnx.ValueInfoProto | None) -> list[int] | None:
    """Reshape's target restoring a tensor after ``Flatten(axis=1)``: 0 (copy) for the first axis,
    known sizes as they are, -1 for at most one unknown size; None when that cannot be said."""
    if info is None or not info.type.tensor_type.HasField("shape"):
        return None
    dims = info.type.tensor_type.shape.dim
    if len(dims) < 2:
        return None
    spec = [0] + [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in dims[1:]]
    return spec if spec.count(-1) <= 1 else None


def exposed_float_ops(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The float Conv/ConvTranspose/Gemm/MatMul nodes (float initializer weight) whose input comes
    straight from a DequantizeLinear: those whose weights onnxruntime quantizes."""
    return [model.graph.node[i] for i in _exposed(model)]


def _exposed(model: onnx.ModelProto) -> list[int]:
    graph = model.graph
    float_inits = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    return [i for i, node in enumerate(graph.node)
            if node.op_type in _WEIGHTED and node.domain in ("", "ai.onnx") and len(node.input) > 1
            and node.input[1] in float_inits and node.input[0] in dequantized]


def guard_float_ops(model: onnx.ModelProto) -> list[str]:
    """Route, in place, the input of every float-kept Conv/ConvTranspose/Gemm/MatMul that reads a
    DequantizeLinear directly through ``Flatten(axis=1) -> Reshape`` back to its shape.

    onnxruntime's WeightBiasQuantization pass (graph level 1: it runs even at ORT_ENABLE_BASIC)
    quantizes the float weights of such a node to int8 when its input comes straight from a
    DequantizeLinear, so the model onnxruntime runs is not the one written. The pair computes the
    identity, costs no copy in onnxruntime, and onnxruntime neither removes it nor moves the
    DequantizeLinear across it. When the shape is not known well enough for the Reshape (rank < 2
    or two unknown sizes after the first), a one-input ``Max`` (a copy) does the same. A second
    reader of the DequantizeLinear output, such as a Shape node, is avoided: it would cost the
    neighbouring integer op its fusion. Returns the names of the guarded nodes.
    """
    graph = model.graph
    exposed = set(_exposed(model))
    if not exposed:
        return []
    inferred = without_weights(onnx.shape_inference.infer_shapes, model).graph
    shapes = {v.name: v for v in list(inferred.value_info) + list(inferred.input) + list(inferred.output)}
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    taken |= {n.name for n in graph.node} | {i.name for i in graph.input}

    def fresh(base: str) -> str:
        name, k = base, 1
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        taken.add(name)
        return name

    guarded_input: dict[str, str] = {}  # DequantizeLinear output -> its guarded copy
    guarded: list[str] = []
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(graph.node):
        if i in exposed:
            source = node.input[0]
            if source not in guarded_input:
                base = fresh(source + GUARD_SUFFIX)
                spec = _guard_shape(shapes.get(source))
                if spec is None:
                    nodes.append(onnx.helper.make_node("Max", [source], [base], name=fresh(base + "_copy")))
                else:
                    flat, target = fresh(base + "_flat"), fresh(base + "_shape")
                    graph.initializer.append(numpy_helper.from_array(np.array(spec, np.int64), target))
                    nodes.append(onnx.helper.make_node("Flatten", [source], [flat], axis=1,
                                                       name=fresh(base + "_flatten")))
                    nodes.append(onnx.helper.make_node("Reshape", [flat, target], [base],
                                                       name=fresh(base + "_reshape")))
                guarded_input[source] = base
            node.input[0] = guarded_input[source]
            guarded.append(node.name)
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return guarded
