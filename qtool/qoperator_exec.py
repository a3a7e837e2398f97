"""QOperator nodes in the integer executor: each becomes an integer step on the kernels of qtool/ops.

A QOperator model (``qtool quantize --format qoperator``, or any model with ONNX/onnxruntime
quantized operators) carries its integer parameters in the nodes themselves: every ``QLinear*``
node reads its inputs' and output's scale and zero point as constant inputs. Lowering builds the
``NodeView`` a QDQ group would give (``Operand`` qparams from those constants) and reuses the op
classes' ``derive``/``run``:

=============================  =======================================================
node                           kernel
=============================  =======================================================
QLinearConv                    Conv (int8/uint8 weight, int32 bias)
QLinearMatMul                  MatMul (constant 2-D B as a weight, else A x B)
QGemm (com.microsoft)          Gemm (needs y_scale: an int8 output)
QLinearAdd, QLinearMul         Add, Mul
QLinearAveragePool, ...Global  AveragePool, GlobalAveragePool (channels_last=0)
QLinearSigmoid                 Sigmoid (256-entry table)
QLinearLeakyRelu               LeakyRelu
QLinearConcat                  Concat
ConvInteger, MatMulInteger     ops/accumulate.py (int32 accumulators)
=============================  =======================================================

Weights with a non-zero zero point (uint8 weights, ONNX's QLinearConv) are shifted at setup,
``q_w - Z_w`` (int16, exact), so the kernels see symmetric weights. A bias is int32 at the
accumulator's scale ``S_x * S_w`` by the operators' definition.

Plain ONNX ops whose data inputs are integer tensors (8, 16 or 32-bit) only move or pick integers
and run as integer steps too, with the ONNX op's exact semantics on the raw integers: MaxPool,
Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Slice, Split, Concat, Resize (nearest), Pad,
Clip, and Gather from a constant table, Cast between integer types, Add/Sub/Mul of integers (the
table lookup ``Cast -> Add offset -> Gather`` that replaces Sigmoid, Tanh, ...). They reuse the op
classes with the identity (S, Z) = (1, 0) so that no rescale happens. int64 tensors (shape
arithmetic) are left to the float path as before.

Which float tensor an integer tensor stands for: QOperator outputs keep the names of the QDQ
model's QuantizeLinear outputs, ``<tensor>_quantized`` (qtool/quantize.py ``_fence``), so
``float_name`` strips that suffix; other names stand for themselves. A name that was made unique
with a counter (``<tensor>_quantized_1``, only when the float model already had such a name) is
not mapped back. The (S, Z) of an integer tensor comes from the node that writes it (QLinear
output scale and zero point) or, when a plain op writes it (a table Gather, a Clip), from the
nodes that read it (QLinear input scale and zero point, DequantizeLinear), carried through the
data-movement ops, which keep (S, Z).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import onnx

from .ops import REGISTRY, IntegerOp, NodeView, Operand, Raw, Unsupported
from .ops.accumulate import ConvInteger, MatMulInteger
from .ops.rawint import GatherTable, IntArith, IntCast
from .qparams import QParams, centered

QUANTIZED_SUFFIX = "_quantized"
INTEGER_TYPES = ("int8", "uint8", "int16", "uint16", "int32")
INDEX_TYPES = INTEGER_TYPES + ("int64",)

# QOperator node -> (kernel op_type, input triples (tensor, scale, zero point), output (scale, zp))
_UNARY = {"QLinearAveragePool": "AveragePool", "QLinearGlobalAveragePool": "GlobalAveragePool",
          "QLinearSigmoid": "Sigmoid", "QLinearLeakyRelu": "LeakyRelu"}
_BINARY = {"QLinearAdd": "Add", "QLinearMul": "Mul"}
QOPERATOR_TYPES = {"QLinearConv", "QLinearMatMul", "QGemm", "QLinearConcat", "ConvInteger",
                   "MatMulInteger", *_UNARY, *_BINARY}
# ops that only move integers: input and output share (S, Z)
MOVES = {"MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Split",
         "Concat", "Resize", "Pad", "Clip"}

_CONV_INTEGER, _MATMUL_INTEGER = ConvInteger(), MatMulInteger()
_GATHER, _CAST, _ARITH = GatherTable(), IntCast(), IntArith()


def float_name(name: str) -> str:
    """The float tensor an integer tensor of a QOperator model stands for (see the module note)."""
    if name.endswith(QUANTIZED_SUFFIX) and len(name) > len(QUANTIZED_SUFFIX):
        return name[: -len(QUANTIZED_SUFFIX)]
    return name


def identity(dtype: str) -> QParams:
    """(S, Z) = (1, 0): a raw integer tensor, for ops that must not rescale."""
    return QParams(1.0, 0, dtype)


@dataclass
class Lowered:
    """What the executor turns into an integer ``Step``."""

    op: IntegerOp
    params: object
    inputs: list[str]  # the run-time inputs, in ``run``'s order
    outputs: list[str]
    dtypes: list[str]  # of the outputs
    qparams: list[QParams | None] = field(default_factory=list)  # real (S, Z) of each output
    clamps_below_zero: bool = False  # a Clip at real zero and the type's top: a lowered Relu


def _layout(node: onnx.NodeProto):
    """Input triples (tensor, scale, zero point) and the output's (scale, zero point) indices."""
    t = node.op_type
    if t in ("QLinearConv", "QLinearMatMul") or t in _BINARY:
        return [(0, 1, 2), (3, 4, 5)], (6, 7)
    if t == "QGemm":
        return [(0, 1, 2), (3, 4, 5)], (7, 8)
    if t in _UNARY:
        return [(0, 1, 2)], (3, 4)
    if t == "QLinearConcat":
        return [(k, k + 1, k + 2) for k in range(2, len(node.input), 3)], (0, 1)
    return None


class QOperatorLowering:
    """Lowers QOperator nodes and integer data movement for one ``IntegerExecutor``."""

    def __init__(self, model: onnx.ModelProto, constants: dict[str, np.ndarray], rounding: str,
                 multiplier_bits: int, qdq_qparams):
        self.model = model
        self.constants = constants
        self.rounding = rounding
        self.multiplier_bits = multiplier_bits
        self.dtypes: dict[str, str | None] = {}
        graph = model.graph
        for vi in list(graph.value_info) + list(graph.output) + list(graph.input):
            elem = vi.type.tensor_type.elem_type
            if elem:
                try:
                    self.dtypes[vi.name] = str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem)))
                except Exception:  # float8, int4, ...: no plain numpy type
                    self.dtypes[vi.name] = None
        self.dtypes.update({k: str(v.dtype) for k, v in constants.items()})
        self.qparams = self._tensor_qparams(qdq_qparams)

    # -- types and (S, Z) ------------------------------------------------------------------------
    def is_integer(self, name: str, types=INTEGER_TYPES) -> bool:
        return bool(name) and self.dtypes.get(name) in types

    def record(self, names, dtypes) -> None:
        for name, dtype in zip(names, dtypes):
            if name:
                self.dtypes[name] = dtype

    def qp(self, node: onnx.NodeProto, scale_index: int, zero_index: int, dtype: str | None,
           axis: int | None = None) -> QParams:
        """(S, Z) from a node's constant scale and zero point inputs; no zero point: 0 in ``dtype``."""
        if scale_index >= len(node.input) or not node.input[scale_index]:
            raise Unsupported(f"{node.op_type} input {scale_index} (a scale) is missing")
        scale = self.constants.get(node.input[scale_index])
        if scale is None:
            raise Unsupported(f"scale '{node.input[scale_index]}' is not a constant")
        zero = None
        if zero_index < len(node.input) and node.input[zero_index]:
            zero = self.constants.get(node.input[zero_index])
            if zero is None:
                raise Unsupported(f"zero point '{node.input[zero_index]}' is not a constant")
        if zero is None:
            zero = np.zeros(scale.shape, dtype=dtype or "uint8")
        if zero.dtype.kind not in "iu":
            raise Unsupported(f"zero point '{node.input[zero_index]}' is {zero.dtype}")
        if scale.size == 1 and zero.size == 1:
            return QParams(float(scale.reshape(-1)[0]), int(zero.reshape(-1)[0]), str(zero.dtype))
        if scale.ndim > 1 or zero.ndim > 1:
            raise Unsupported("scales and zero points must be scalars or 1-D")
        return QParams(scale.astype(np.float32) if scale.size > 1 else float(scale.reshape(-1)[0]),
                       zero.astype(np.int64) if zero.size > 1 else int(zero.reshape(-1)[0]),
                       str(zero.dtype), axis)

    def _tensor_qparams(self, qdq_qparams) -> dict[str, QParams]:
        """(S, Z) of each integer tensor: from its writer or readers, carried through moves."""
        known: dict[str, QParams] = {}

        def put(name, qp):
            if name and qp is not None and name not in known:
                known[name] = qp

        nodes = list(self.model.graph.node)
        for node in nodes:
            try:
                if node.op_type == "QuantizeLinear":
                    put(node.output[0], qdq_qparams(node))
                elif node.op_type == "DequantizeLinear":
                    put(node.input[0], qdq_qparams(node))
                elif node.op_type in QOPERATOR_TYPES and _layout(node) is not None:
                    triples, (s, z) = _layout(node)
                    for t, ts, tz in triples:
                        if node.input[t] not in self.constants:
                            put(node.input[t], self.qp(node, ts, tz, self.dtypes.get(node.input[t])))
                    put(node.output[0], self.qp(node, s, z, self.dtypes.get(node.input[triples[0][0]])))
            except Exception:  # a malformed node is reported when it is lowered
                continue
        moves = [n for n in nodes if n.op_type in MOVES and n.domain in ("", "ai.onnx")]
        changed = True
        while changed:
            changed = False
            for node in moves:
                data = [n for n in (node.input if node.op_type == "Concat" else node.input[:1]) if n]
                members = data + [o for o in node.output if o]
                source = next((known[n] for n in members if n in known), None)
                if source is None:
                    continue
                for name in members:  # a type not inferred yet (after a contrib op) may be integer
                    if name not in known and self.dtypes.get(name) in (None, *INTEGER_TYPES):
                        known[name] = source
                        changed = True
        return known

    # -- lowering ----------------------------------------------------------------------------------
    def lower(self, node: onnx.NodeProto) -> Lowered | None:
        """The node as an integer step; None when it is not a QOperator node and not an integer op
        on integer tensors. Raises ``Unsupported`` (with the reason) when it is one but cannot be
        lowered, so it runs in float."""
        if node.op_type in QOPERATOR_TYPES and node.domain in ("", "ai.onnx", "com.microsoft"):
            return self._qoperator(node)
        if node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type in MOVES:
            return self._move(node)
        if node.op_type == "Gather":
            return self._gather(node)
        if node.op_type == "Cast":
            return self._cast(node)
        if node.op_type in ("Add", "Sub", "Mul"):
            return self._arith(node)
        return None

    def _view(self, node, operands, output: QParams, outputs=None) -> NodeView:
        return NodeView(node, operands, output, self.rounding, self.multiplier_bits,
                        outputs=outputs or [output])

    def _act(self, node, t: int, s: int, z: int) -> QParams:
        return self.qp(node, s, z, self.dtypes.get(node.input[t]))

    def _weight(self, node, t: int, s: int, z: int, axis: int) -> Operand:
        """A constant quantized weight, its zero point subtracted at setup if not 0."""
        w = self.constants.get(node.input[t])
        if w is None:
            raise Unsupported(f"{node.op_type} weight '{node.input[t]}' is not a constant")
        if w.dtype.kind not in "iu":
            raise Unsupported(f"{node.op_type} weight '{node.input[t]}' is {w.dtype}")
        qp = self.qp(node, s, z, str(w.dtype), axis)
        w, qp = centered(w, qp)
        per_channel = np.size(qp.scale) > 1
        return Operand(QParams(qp.scale, qp.zero_point, str(w.dtype), axis if per_channel else None), w)

    def _bias(self, node, index: int, x: QParams, weight: Operand, channels: int) -> Operand | None:
        """int32 bias at scale ``S_x * S_w`` (per output channel), computed as the kernels do."""
        if index >= len(node.input) or not node.input[index]:
            return None
        b = self.constants.get(node.input[index])
        if b is None:
            raise Unsupported(f"{node.op_type} bias '{node.input[index]}' is not a constant")
        w_scale = np.broadcast_to(np.asarray(weight.qparams.scale, dtype=np.float64).reshape(-1),
                                  (channels,))
        return Operand(QParams(float(x.scale) * w_scale, np.zeros(channels, np.int64), "int32", 0), b)

    def _out(self, node, s: int, z: int, x: QParams) -> QParams:
        return self.qp(node, s, z, x.dtype)

    def _qoperator(self, node) -> Lowered:
        t = node.op_type
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("channels_last", 0):
            raise Unsupported("channels_last=1 is not supported")
        if t == "ConvInteger" or t == "MatMulInteger":
            return self._accumulate(node)
        x = self._act(node, 0, 1, 2) if t != "QLinearConcat" else None
        if t == "QLinearConv":
            y = self._out(node, 6, 7, x)
            w = self._weight(node, 3, 4, 5, axis=0)
            operands = [Operand(x), w, self._bias(node, 8, x, w, w.value.shape[0])]
            return self._derived(node, "Conv", operands, y, [node.input[0]])
        if t == "QLinearMatMul":
            y = self._out(node, 6, 7, x)
            b = self.constants.get(node.input[3])
            if b is not None and b.ndim == 2:
                try:
                    return self._derived(node, "MatMul", [Operand(x), self._weight(node, 3, 4, 5, axis=1)],
                                         y, [node.input[0]])
                except Unsupported:
                    pass  # e.g. a per-tensor B with a zero point: the A x B kernel takes it
            operands = [Operand(x), Operand(self._act(node, 3, 4, 5))]
            return self._derived(node, "MatMul", operands, y, [node.input[0], node.input[3]])
        if t == "QGemm":
            if len(node.input) < 8 or not node.input[7]:
                raise Unsupported("QGemm without y_scale has a float output")
            y = self._out(node, 7, 8, x)
            axis = 0 if attrs.get("transB", 0) else 1
            w = self._weight(node, 3, 4, 5, axis=axis)
            if w.value.ndim != 2:
                raise Unsupported("QGemm B must be 2-D")
            operands = [Operand(x), w, self._bias(node, 6, x, w, w.value.shape[axis])]
            return self._derived(node, "Gemm", operands, y, [node.input[0]])
        if t in _BINARY:
            y = self._out(node, 6, 7, x)
            operands = [Operand(x), Operand(self._act(node, 3, 4, 5))]
            return self._derived(node, _BINARY[t], operands, y, [node.input[0], node.input[3]])
        if t in _UNARY:
            y = self._out(node, 3, 4, x)
            return self._derived(node, _UNARY[t], [Operand(x)], y, [node.input[0]])
        if t == "QLinearConcat":
            triples, _ = _layout(node)
            first = self.dtypes.get(node.input[triples[0][0]]) if triples else None
            y = self.qp(node, 0, 1, first)
            operands = [Operand(self._act(node, *k)) for k in triples]
            return self._derived(node, "Concat", operands, y, [node.input[k[0]] for k in triples])
        raise Unsupported(f"no integer lowering for {t}")

    def _derived(self, node, kernel: str, operands, y: QParams, inputs) -> Lowered:
        op = REGISTRY[kernel]
        params = op.derive(self._view(node, operands, y))
        return Lowered(op, params, list(inputs), [node.output[0]], [y.dtype], [y])

    def _accumulate(self, node) -> Lowered:
        for i in (0, 1):
            if not self.is_integer(node.input[i]):
                raise Unsupported(f"{node.op_type} input '{node.input[i]}' is not an integer tensor")
        operands, at_run = [], []
        for i, z in ((0, 2), (1, 3)):
            zero = np.zeros((), np.int64)
            named = z < len(node.input) and bool(node.input[z])
            value = self.constants.get(node.input[z]) if named else None
            if value is not None:
                zero = value.astype(np.int64)
            at_run.append(named and value is None)  # computed at run time (DynamicQuantizeLinear's)
            operands.append(Operand(QParams(1.0, zero, self.dtypes[node.input[i]])))
        op = _CONV_INTEGER if node.op_type == "ConvInteger" else _MATMUL_INTEGER
        params = dataclasses.replace(op.derive(self._view(node, operands, identity("int32"))),
                                     zero_at_run=tuple(at_run))
        inputs = [node.input[0], node.input[1]] + [node.input[z] for z, run in zip((2, 3), at_run) if run]
        return Lowered(op, params, inputs, [node.output[0]], ["int32"], [None])

    def _move(self, node) -> Lowered | None:
        data = [i for i, n in enumerate(node.input) if n] if node.op_type == "Concat" else [0]
        if not all(self.is_integer(node.input[i]) for i in data):
            return None
        dtype = self.dtypes[node.input[data[0]]]
        if any(self.dtypes[node.input[i]] != dtype for i in data):
            raise Unsupported("integer inputs of different types")
        op = REGISTRY[node.op_type]
        if node.op_type == "Resize":
            mode = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "mode"),
                        b"nearest")
            if (mode.decode() if isinstance(mode, bytes) else mode) != "nearest":
                raise Unsupported("only nearest Resize runs on integer tensors")
        specs = op.constants(node)
        operands, inputs = [], []
        for i, name in enumerate(node.input):
            if not name:
                operands.append(None)
            elif i in data:
                operands.append(Operand(identity(dtype)))
                inputs.append(name)
            elif isinstance(specs.get(i), Raw):
                value = self.constants.get(name)
                if value is None and not specs[i].at_run:
                    raise Unsupported(f"input '{name}' must be a constant")
                operands.append(Operand(None, value))
                if specs[i].at_run:
                    inputs.append(name)
            else:
                raise Unsupported(f"input '{name}' is not an integer data input")
        outputs = [o for o in node.output if o]
        if len(outputs) != len(node.output):
            raise Unsupported("an output is omitted")
        ident = identity(dtype)
        params = op.derive(self._view(node, operands, ident, [ident] * len(outputs)))
        real = [self.qparams.get(o) for o in outputs]
        clamps = False
        if node.op_type == "Clip" and node.input[0] in self.qparams:
            qp = self.qparams[node.input[0]]
            clamps = np.size(qp.zero_point) == 1 and params.low == int(qp.zero_point) and \
                params.high == qp.qmax
        return Lowered(op, params, inputs, outputs, [dtype] * len(outputs), real, clamps)

    def _gather(self, node) -> Lowered | None:
        table = self.constants.get(node.input[0])
        if table is None or str(table.dtype) not in INTEGER_TYPES:
            return None
        if not self.is_integer(node.input[1], INDEX_TYPES):
            return None
        params = _GATHER.derive(self._view(node, [Operand(None, table), Operand(None)],
                                           identity(str(table.dtype))))
        return Lowered(_GATHER, params, [node.input[1]], [node.output[0]], [str(table.dtype)],
                       [self.qparams.get(node.output[0])])

    def _cast(self, node) -> Lowered | None:
        if not self.is_integer(node.input[0]):
            return None
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        target = str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(to))) if to else None
        if target not in INTEGER_TYPES:
            return None  # e.g. to float: a dequantization by hand, left to the float path
        source = self.dtypes[node.input[0]]
        params = _CAST.derive(self._view(node, [Operand(identity(source))], identity(target)))
        return Lowered(_CAST, params, [node.input[0]], [node.output[0]], [target],
                       [self.qparams.get(node.output[0])])

    def _arith(self, node) -> Lowered | None:
        if len(node.input) != 2 or not all(self.is_integer(n) for n in node.input):
            return None
        dtype = self.dtypes[node.input[0]]
        if self.dtypes[node.input[1]] != dtype:
            return None
        params = _ARITH.derive(self._view(node, [Operand(identity(dtype))] * 2, identity(dtype)))
        return Lowered(_ARITH, params, list(node.input), [node.output[0]], [dtype],
                       [self.qparams.get(node.output[0])])
