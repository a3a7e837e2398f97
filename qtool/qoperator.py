"""QDQ -> QOperator: each ``DequantizeLinear -> op -> QuantizeLinear`` group that has a quantized
operator form becomes that one node, reading and writing integer tensors.

* Conv, MatMul -> QLinearConv, QLinearMatMul (ONNX); Gemm -> QGemm; Add, Mul -> QLinearAdd,
  QLinearMul; AveragePool, GlobalAveragePool, Sigmoid, LeakyRelu, Concat -> their com.microsoft
  QLinear* contrib ops (onnxruntime).
* Data movement whose input and output share (S, Z) (MaxPool, Reshape, Flatten, Transpose, Squeeze,
  Unsqueeze, Slice, Split, Concat, nearest Resize, constant Pad) runs on the integer tensors as the
  same op; Relu and Clip become an integer Clip at the quantized bounds.
* Lookup-table ops (Sigmoid, HardSigmoid, HardSwish, Tanh, Erf, ...) become ``Gather`` from their
  256-entry table, so onnxruntime computes exactly what the integer executor computes.

A group without such a form stays as it is (DequantizeLinear -> float op -> QuantizeLinear), which
onnxruntime runs as well; the result lists those nodes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .model import all_nodes, names_read

MS = "com.microsoft"
_LINEAR_BINARY = {"Add": "QLinearAdd", "Mul": "QLinearMul"}
_LINEAR_UNARY = {"AveragePool": "QLinearAveragePool", "GlobalAveragePool": "QLinearGlobalAveragePool",
                 "Sigmoid": "QLinearSigmoid", "LeakyRelu": "QLinearLeakyRelu"}
_MOVES = {"MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Split",
          "Concat", "Resize", "Pad"}


@dataclass
class QOperatorResult:
    model: onnx.ModelProto
    converted: dict[str, int] = field(default_factory=dict)  # original op_type -> count
    unchanged: list[tuple[str, str]] = field(default_factory=list)  # (op_type, node) left as QDQ


class _Converter:
    def __init__(self, model: onnx.ModelProto, luts: dict[str, np.ndarray]):
        self.model = model
        self.luts = luts
        self.inits = {t.name: t for t in model.graph.initializer}
        self.values = {}  # initializer name -> numpy, on demand
        self.producer = {o: n for n in model.graph.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in model.graph.node:
            for name in node.input:
                self.consumers[name].append(node)
        self.graph_outputs = {o.name for o in model.graph.output}
        self.taken = set(self.inits) | set(self.producer) | {i.name for i in model.graph.input}
        self.new_inits: list[onnx.TensorProto] = []
        self.result = QOperatorResult(model)

    def value(self, name: str) -> np.ndarray | None:
        if name not in self.values and name in self.inits:
            self.values[name] = numpy_helper.to_array(self.inits[name])
        return self.values.get(name)

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def init(self, base: str, array: np.ndarray) -> str:
        name = self.fresh(base)
        self.new_inits.append(numpy_helper.from_array(array, name))
        return name

    # -- matching ------------------------------------------------------------------------------
    def dq_of(self, name: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        if node is None or node.op_type != "DequantizeLinear" or len(node.input) < 3:
            return None
        if node.input[1] not in self.inits or node.input[2] not in self.inits:
            return None
        return node

    def q_after(self, name: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        if name in self.graph_outputs or len(users) != 1 or users[0].op_type != "QuantizeLinear":
            return None
        q = users[0]
        if len(q.input) < 3 or q.input[1] not in self.inits or q.input[2] not in self.inits:
            return None
        return q

    def same_qparams(self, a: onnx.NodeProto, b: onnx.NodeProto) -> bool:
        return all(np.array_equal(self.value(a.input[i]), self.value(b.input[i]))
                   and self.value(a.input[i]).dtype == self.value(b.input[i]).dtype for i in (1, 2))

    # -- converting ----------------------------------------------------------------------------
    def run(self) -> QOperatorResult:
        nodes = []
        absorbed_q = set()
        for node in self.model.graph.node:
            if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
                nodes.append(node)
                continue
            outs = [self.q_after(o) for o in node.output]
            replacement = None
            if node.output and all(outs):
                replacement = self.convert(node, outs)
            if replacement is None:
                nodes.append(node)
                if all(outs) and node.output and all(self.dq_of(n) for n in node.input if n):
                    self.result.unchanged.append((node.op_type, node.name))
                continue
            nodes.extend(replacement)
            absorbed_q.update(q.name for q in outs)
            self.result.converted[node.op_type] = self.result.converted.get(node.op_type, 0) + 1
        nodes = [n for n in nodes if n.name not in absorbed_q]
        return self.assemble(nodes)

    def convert(self, node, outs) -> list[onnx.NodeProto] | None:
        op = node.op_type
        dqs = [self.dq_of(n) if n else None for n in node.input]
        q = outs[0]
        if op == "Conv" and dqs[0] and dqs[1]:
            inputs = [*dqs[0].input[:3], *dqs[1].input[:3], q.input[1], q.input[2]]
            if len(node.input) > 2 and node.input[2]:
                if dqs[2] is None:
                    return None
                inputs.append(dqs[2].input[0])
            return [self.make("QLinearConv", inputs, q, node, node.attribute)]
        if op == "MatMul" and dqs[0] and dqs[1]:
            inputs = [*dqs[0].input[:3], *dqs[1].input[:3], q.input[1], q.input[2]]
            return [self.make("QLinearMatMul", inputs, q, node)]
        if op == "Gemm" and dqs[0] and dqs[1]:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if attrs.get("beta", 1.0) != 1.0:
                return None
            inputs = [*dqs[0].input[:3], *dqs[1].input[:3]]
            if len(node.input) > 2 and node.input[2]:
                if dqs[2] is None:
                    return None
                inputs.append(dqs[2].input[0])
            else:
                inputs.append("")
            inputs += [q.input[1], q.input[2]]
            kept = [a for a in node.attribute if a.name in ("alpha", "transA", "transB")]
            return [self.make("QGemm", inputs, q, node, kept, domain=MS)]
        if op in _LINEAR_BINARY and len(dqs) == 2 and all(dqs):
            inputs = [*dqs[0].input[:3], *dqs[1].input[:3], q.input[1], q.input[2]]
            return [self.make(_LINEAR_BINARY[op], inputs, q, node, domain=MS)]
        if op in self.luts and dqs[0]:
            return self.lookup(node, dqs[0], q)
        if op in _LINEAR_UNARY and dqs[0]:
            attrs = list(node.attribute)
            if op in ("AveragePool", "GlobalAveragePool"):
                attrs.append(helper.make_attribute("channels_last", 0))
            inputs = [*dqs[0].input[:3], q.input[1], q.input[2]]
            return [self.make(_LINEAR_UNARY[op], inputs, q, node, attrs, domain=MS)]
        if op in ("Relu", "Clip") and dqs[0] and self.same_qparams(dqs[0], q):
            return self.clamp(node, dqs[0], q)
        if op in _MOVES:
            return self.move(node, dqs, outs)
        return None

    def make(self, op_type, inputs, q, node, attributes=(), domain=""):
        new = helper.make_node(op_type, inputs, [q.output[0]], name=node.name, domain=domain)
        new.attribute.extend(attributes)
        return new

    def move(self, node, dqs, outs):
        """Data movement on integer tensors: every quantized input and output share one (S, Z)."""
        # the data inputs; the others (shape, axes, pads, scales) stay as they are
        data = range(len(node.input)) if node.op_type == "Concat" else [0]
        if any(dqs[i] is None for i in data) or any(not self.same_qparams(dqs[i], q)
                                                    for i in data for q in outs):
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Resize" and attrs.get("mode", b"nearest") not in (b"nearest", "nearest"):
            return None
        inputs = [dqs[i].input[0] if i in data else n for i, n in enumerate(node.input)]
        if node.op_type == "Pad":
            if attrs.get("mode", b"constant") in (b"constant", "constant"):
                scale = float(self.value(outs[0].input[1]))
                zero = self.value(outs[0].input[2])
                pad = self.value(inputs[2]) if len(inputs) > 2 and inputs[2] else np.float32(0)
                if pad is None:
                    return None
                qpad = np.clip(np.rint(float(pad) / scale) + int(zero), *_limits(zero.dtype))
                inputs = inputs[:2] + [self.init(f"{node.name}_pad_value", np.array(qpad, zero.dtype))]
        new = helper.make_node(node.op_type, inputs, [q.output[0] for q in outs], name=node.name)
        new.attribute.extend(node.attribute)
        return [new]

    def clamp(self, node, dq, q):
        """Relu (and Clip) with equal (S, Z): an integer Clip at the quantized bounds."""
        scale = float(self.value(q.input[1]))
        zero = self.value(q.input[2])
        lo_real, hi_real = 0.0, None
        if node.op_type == "Clip":
            lo_real = float(self.value(node.input[1])) if len(node.input) > 1 and node.input[1] else None
            hi_real = float(self.value(node.input[2])) if len(node.input) > 2 and node.input[2] else None
        qmin, qmax = _limits(zero.dtype)
        bounds = []
        for real, default in ((lo_real, qmin), (hi_real, qmax)):
            value = default if real is None else np.clip(np.rint(real / scale) + int(zero), qmin, qmax)
            bounds.append(self.init(f"{node.name}_bound", np.array(value, zero.dtype)))
        return [helper.make_node("Clip", [dq.input[0], *bounds], [q.output[0]], name=node.name)]

    def lookup(self, node, dq, q):
        """``y = table[q_x - qmin]``: Cast to int32, shift for int8, Gather."""
        table = self.luts[node.op_type].get(node.name)
        if table is None:
            return None
        x = dq.input[0]
        index = self.fresh(f"{node.name}_index")
        nodes = [helper.make_node("Cast", [x], [index], name=self.fresh(f"{node.name}_Cast"),
                                  to=onnx.TensorProto.INT32)]
        qmin = _limits(self.value(dq.input[2]).dtype)[0]
        if qmin:
            shifted = self.fresh(f"{node.name}_shifted")
            offset = self.init(f"{node.name}_offset", np.array(-qmin, np.int32))
            nodes.append(helper.make_node("Add", [index, offset], [shifted],
                                          name=self.fresh(f"{node.name}_Add")))
            index = shifted
        dtype = self.value(q.input[2]).dtype
        values = self.init(f"{node.name}_table", np.asarray(table, dtype=dtype))
        nodes.append(helper.make_node("Gather", [values, index], [q.output[0]], name=node.name, axis=0))
        return nodes

    def assemble(self, nodes) -> QOperatorResult:
        # drop what nothing reads any more (DequantizeLinear nodes absorbed by the new operators)
        needed = {o.name for o in self.model.graph.output}
        kept = []
        for node in reversed(nodes):
            if any(o in needed for o in node.output):
                kept.append(node)
                needed.update(names_read([node]))  # a subgraph's outer-scope reads too
        kept.reverse()
        inits = [t for t in list(self.model.graph.initializer) + self.new_inits if t.name in needed]
        graph = helper.make_graph(kept, self.model.graph.name, list(self.model.graph.input),
                                  list(self.model.graph.output), inits)
        opsets = [o for o in self.model.opset_import if o.domain != MS]
        if any(n.domain == MS for n in all_nodes(graph)):
            opsets.append(helper.make_opsetid(MS, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name=self.model.producer_name,
                                  producer_version=self.model.producer_version)
        model.ir_version = self.model.ir_version
        model.metadata_props.extend(self.model.metadata_props)
        self.result.model = onnx.shape_inference.infer_shapes(model)
        return self.result


def _limits(dtype) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def to_qoperator(qdq: onnx.ModelProto, luts: dict[str, dict[str, np.ndarray]] | None = None
                 ) -> QOperatorResult:
    """``luts``: op_type -> node name -> 256-entry table, for the lookup-table ops."""
    return _Converter(qdq, luts or {}).run()
