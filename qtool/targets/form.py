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
