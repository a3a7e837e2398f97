"""The integer-only executor: runs a QDQ or QOperator model the way an integer device would.

Lowering (setup) finds each ``DequantizeLinear -> op -> QuantizeLinear`` group whose op has an
integer kernel and derives its integer parameters; floats are used only there. QOperator nodes
(QLinearConv, QLinearMatMul, QGemm, QLinearAdd, ..., ConvInteger, MatMulInteger) and plain ops on
integer tensors (MaxPool, Reshape, Clip, a table Gather, ...) are lowered to the same kernels by
qtool/qoperator_exec.py. At run time a kernel sees only integer arrays. Everything else runs as
what it is: QuantizeLinear and DequantizeLinear at the float boundaries, and fenced float ops one
node at a time in onnxruntime.

Unless the integer tensors are kept, a run of elementwise steps on an 8- or 16-bit tensor
(HardSwish's table, then Mul and Add by constants) is one lookup: the steps themselves, evaluated
once on all 256 or 65536 input values, give the composed table (``Chain``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort

from . import boundary, control, masks
from .errors import DataError, IndexOutOfRange, QtoolError
from .model import (batch_hint, first_line, graph_inputs, initializers, outer_reads, subgraph_reason, subgraphs,
                    without_weight_bytes)
from .pixels import feeds_for, pixel_inputs
from .ops import REGISTRY, Bias, IntegerOp, NodeView, Operand, Raw, Unsupported, Weight, node_attrs
from .ops import blas, blocked, fast_paths, parallel
from .ops.softmax import MaskedSoftmax
from .ops.bytetable import BYTE_TYPES, byte_mapped, lookup, values_of
from .qoperator_exec import QOperatorLowering, float_name
from .targets import check_arithmetic, x86
from .targets.form import is_guard
from .qparams import QParams, centered, dequantize_array, quantize_array

# numpy's messages for an input of a shape the model's ops cannot take (a model that runs one
# sample at a time given several): user errors, not bugs
_SHAPE_ERRORS = ("cannot reshape array", "operands could not be broadcast", "Resize ", "Conv input ")


# what onnxruntime raises for a run it refuses (its own checks of shapes and values); a TypeError
# or the like from qtool's side stays an internal error
ORT_ERRORS = tuple(getattr(ort.capi.onnxruntime_pybind11_state, name) for name in (
    "Fail", "InvalidArgument", "RuntimeException", "InvalidGraph", "NotImplemented", "EPFail")
    if hasattr(ort.capi.onnxruntime_pybind11_state, name))

FOREIGN_ROUNDING = "half_to_even"
SPECIALIZED_KEPT = 16  # setups kept per step, one per input shapes met (the oldest go first)


@dataclass
class Step:
    kind: str  # "integer", "float", "quantize", "dequantize", "boundary" or "chain"
    node: onnx.NodeProto
    inputs: list[str]
    outputs: list[str]
    op: IntegerOp | None = None
    params: object = None
    # per output of an integer or quantize step, the float tensor its integer output stands for
    # and that tensor's (S, Z); a dequantize step's (S, Z) is its input's. None where unknown (a
    # QOperator step's int32 accumulator, a table index): the output is integer but reported by
    # no key.
    keys: list[str | None] = field(default_factory=list)
    qparams: list[QParams | None] = field(default_factory=list)
    reason: str = ""  # why a node with a kernel runs in float
    absorbs: list[str] = field(default_factory=list)  # QuantizeLinear nodes an integer step replaces
    specialized: dict = field(default_factory=dict)
    # a QOperator step that clamps at real zero (the integer Clip a Relu becomes)
    clamps_below_zero: bool = False
    # the chain that reads this integer step's output and nothing else does: the step writes the
    # chain's outputs, through its table where the op takes one (``IntegerOp.takes_table``)
    then: "Chain | None" = None


# The fast paths (the compiled loops of numba, onnxruntime's float Conv as the summing engine)
# give the same integers as the plain numpy ones, but take seconds to set up (numba's first call
# about 1.2 s, an engine per Conv checked against numpy 2.4 s on PP-OCRv4 rec) for what they save,
# about 40% of the plain time (rec: 88 -> 52 ms a line). A caller that says how many samples are
# left (``run``'s ``pace``) gets them once the plain paths would still run this many seconds:
# then they pay back their setup; a command on a few samples never sets them up.
FAST_FROM = 8.0

# the input types whose every value a chain's table holds (256 or 65536 entries)
TABLE_INPUTS = BYTE_TYPES | {np.dtype(np.int16)}


@dataclass
class Chain:
    """Integer steps each elementwise in one input, the next reading only the previous one's output,
    run as one lookup: ``tables[dtype]`` is the steps' output on every value of an 8- or 16-bit input,
    computed at the first run with that input type (None where the steps could not run on every
    value, e.g. an integer Add that would leave its type: the steps then run one by one)."""

    steps: list[Step]
    # the most dimensions of a constant operand: an input with fewer would broadcast to a new shape
    ndim: int = 0
    tables: dict[np.dtype, np.ndarray | None] = field(default_factory=dict)


@dataclass
class Result:
    outputs: dict[str, np.ndarray]
    integer: dict[str, np.ndarray] = field(default_factory=dict)  # key -> integer tensor


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while a sample runs (back on after, if it was on).

    A run allocates a few thousand small containers (step inputs and outputs), enough to set off
    collections; in a process that holds many objects (after calibrating, in a batch job) a full
    collection costs milliseconds: 6 ms of PP-OCRv4 rec's 29 ms per line after an in-process
    calibration. Whatever cycles a run leaves (an exception's traceback) are collected later.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _metadata(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


class IntegerExecutor:
    def __init__(self, model: onnx.ModelProto, arithmetic: str = "exact",
                 outer_constants: dict[str, np.ndarray] | None = None):
        """``arithmetic``: ``exact`` (the integer device), ``x86-avx2`` (onnxruntime's u8 x s8
        products on a CPU without VNNI, qtool/targets/x86.py) or ``host`` (whichever of the two this
        machine's onnxruntime computes). ``outer_constants``: for the body of an If, Loop or Scan
        (qtool/control.py), the initializers of the enclosing graphs it reads."""
        self._fast = False  # the fast paths are on (``run``'s ``pace``)
        self._per_sample = None  # seconds a sample took on the plain paths, the last batch
        self._plain_runs = 0
        self._widest = 0  # the most samples a paced run has had
        meta = _metadata(model)
        # a model qtool did not quantize follows ONNX, which rounds half to even everywhere
        # (QuantizeLinear, QLinearConv's reference); qtool's own models say which mode they use
        self.rounding = meta.get("qtool.rounding", FOREIGN_ROUNDING)
        self.multiplier_bits = int(meta.get("qtool.multiplier_bits", "32"))
        self.opsets = {o.domain or "": o.version for o in model.opset_import}
        self.constants = {**(outer_constants or {}), **initializers(model)}
        # the weights are read from ``constants``, the graph from a copy without their bytes: the
        # steps keep nodes of it, and protobuf keeps a message's memory while any part of it is
        # referenced (a ViT-S's int8 weights, 24 MB, would stay twice for as long as the executor)
        self.model = model = without_weight_bytes(model, any_type=True)
        self.producer = {out: node for node in model.graph.node for out in node.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        # a node with subgraphs (If, Loop, Scan) reads what they read from the main graph too
        self.outer = {id(node): outer_reads(node) for node in model.graph.node if subgraphs(node)}
        for node in model.graph.node:
            for name in self._reads(node):
                self.consumers.setdefault(name, []).append(node)
        self.output_names = [o.name for o in model.graph.output]
        self.input_names = [i.name for i in graph_inputs(model)]
        self.pixels = pixel_inputs(model)  # quantize --input-pixels: float data become pixels
        self._qparams_memo: dict[tuple, QParams] = {}
        self.lowering = None  # _qparams_of, which QOperatorLowering calls, checks for it
        self.lowering = QOperatorLowering(model, self.constants, self.rounding, self.multiplier_bits,
                                          self._qparams_of)
        self.arithmetic = x86.host_arithmetic() if check_arithmetic(arithmetic) == "host" else arithmetic
        self.masks = masks.find(model, self.constants)
        self.steps = self._prune(self._lower())
        if self.arithmetic == "x86-avx2":
            self._emulate_pair_saturation()
        self._chained_steps = self._fuse_chains(self._chain(self.steps))
        # per step of each list, the values no later step reads: freed after it runs
        self._frees = {True: self._releases(self.steps), False: self._releases(self._chained_steps)}
        self._float_sessions: dict[tuple, ort.InferenceSession] = {}
        self._key_producer = {key: step for step in self.steps if step.kind in ("integer", "quantize")
                              for key in step.keys if key is not None}

    def _reads(self, node: onnx.NodeProto) -> list[str]:
        """The tensors ``node`` reads, once each: its inputs, then what its subgraphs read from
        the main graph."""
        return [n for n in dict.fromkeys([*node.input, *self.outer.get(id(node), [])]) if n]

    # -- lowering ----------------------------------------------------------------------------------
    def _qparams_of(self, node: onnx.NodeProto) -> QParams:
        """(S, Z) of a QuantizeLinear/DequantizeLinear node from its constant inputs. Raises
        ``Unsupported`` for the forms qtool/boundary.py computes instead (blocked, scales computed
        at run time, types other than 8, 16 and 32-bit integers): no integer kernel takes them.

        Lowering asks for a node's (S, Z) once per reader: kept, keyed by what decides them (its
        constant inputs and attributes), when it has a zero point (else the type comes from
        ``lowering``, which may learn it later)."""
        key = None
        if len(node.input) > 2 and node.input[2]:
            key = (node.op_type, *node.input, *((a.name, a.i) for a in node.attribute))
            known = self._qparams_memo.get(key)
            if known is not None:
                return known
        qp = self._derive_qparams(node)
        if key is not None:
            for value in (qp.scale, qp.zero_point):  # per channel: one array for every reader
                if isinstance(value, np.ndarray):
                    value.flags.writeable = False
            self._qparams_memo[key] = qp
        return qp

    def _derive_qparams(self, node: onnx.NodeProto) -> QParams:
        attrs = node_attrs(node)
        if attrs.get("block_size", 0):
            raise Unsupported(f"'{node.input[0]}' is quantized in blocks of {attrs['block_size']}")
        if node.input[1] not in self.constants:
            raise Unsupported(f"the scale of '{node.input[0]}' is computed at run time")
        scale = self.constants[node.input[1]]
        if scale.ndim > 1:
            raise Unsupported(f"the scale of '{node.input[0]}' has {scale.ndim} axes")
        if len(node.input) > 2 and node.input[2]:
            zero = self.constants.get(node.input[2])
            if zero is None:
                raise Unsupported(f"the zero point of '{node.input[0]}' is computed at run time")
        else:  # no zero point: Q's output_dtype, DQ's input type, else uint8 (the ONNX default)
            dtype = "uint8"
            if node.op_type == "QuantizeLinear" and attrs.get("output_dtype", 0):
                dtype = onnx.helper.tensor_dtype_to_np_dtype(attrs["output_dtype"])
            elif node.op_type == "DequantizeLinear" and self.lowering is not None:
                dtype = self.lowering.dtypes.get(node.input[0]) or dtype
            if not boundary.is_plain(np.dtype(dtype) if not isinstance(dtype, str) else dtype):
                raise Unsupported(f"'{node.input[0]}' is {dtype}")
            zero = np.zeros(scale.shape, dtype=dtype)
        if not boundary.is_plain(zero.dtype):
            raise Unsupported(f"'{node.input[0]}' is {zero.dtype}")
        axis = None
        if scale.ndim == 1 and scale.size > 1:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        if scale.ndim == 0 or scale.size == 1:
            return QParams(float(scale.reshape(-1)[0]), int(zero.reshape(-1)[0]), str(zero.dtype))
        return QParams(scale.astype(np.float32), zero.astype(np.int64), str(zero.dtype), axis)

    def _lower(self) -> list[Step]:
        absorbed_q = set()
        steps = []
        joins, joined = self.masks.join_nodes, set()  # masked Softmax: the Add/Where, the Softmax
        for node in self.model.graph.node:
            if node.name in joined:
                continue
            if node.name in joins:
                step = self._masked_softmax_step(joins[node.name])
                if step is not None:
                    joined.add(joins[node.name].softmax)
                    absorbed_q.update(step.absorbs)
                    steps.append(step)
                    self.lowering.record(step.outputs, [qp.dtype for qp in step.qparams])
                    continue
            if node.op_type in ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"):
                try:
                    qp = None if node.op_type == "DynamicQuantizeLinear" else self._qparams_of(node)
                except Unsupported:
                    qp = None
                if qp is None:  # a form no kernel takes: computed as the specification says
                    steps.append(Step("boundary", node, [n for n in node.input if n], list(node.output),
                                      params=boundary.of(node)))
                    self.lowering.record(node.output, [self._boundary_type(node, o) for o in node.output])
                    continue
            if node.op_type == "QuantizeLinear":
                if node.name not in absorbed_q:
                    steps.append(Step("quantize", node, [node.input[0]], [node.output[0]],
                                      keys=[node.input[0]], qparams=[qp]))
                self.lowering.record(node.output, [qp.dtype])
                continue
            if node.op_type == "DequantizeLinear":
                out = self._dequantized_type(node)
                steps.append(Step("dequantize", node, [node.input[0]], [node.output[0]],
                                  qparams=[qp], params=out))
                self.lowering.record(node.output, [out])
                continue
            if control.is_control(node):
                step = self._control_step(node)
                if step is not None:
                    steps.append(step)
                    self.lowering.record(node.output, [self._declared_type(o) for o in node.output])
                    continue
            step, reason = self._integer_step(node)
            if step is None:
                step, reason = self._qoperator_step(node, reason)
            if step is not None:
                absorbed_q.update(step.absorbs)
                steps.append(step)
                if step.absorbs:  # a QDQ group: its outputs are the QuantizeLinear outputs
                    self.lowering.record(step.outputs, [qp.dtype for qp in step.qparams])
            else:
                reason = masks.REASON if node.name in self.masks.arithmetic else reason
                steps.append(Step("float", node, self._reads(node), list(node.output), reason=reason))
                self.lowering.record(node.output, [self._declared_type(o) for o in node.output])
        return steps

    def _emulate_pair_saturation(self) -> None:
        """Each Conv / Gemm / MatMul with a constant int8 weight computes as onnxruntime's u8 x s8
        kernels do on AVX2 (in place: its op becomes ``x86.PairSaturating``)."""
        for step, offset in list(x86.saturating_steps(self)):
            if x86.is_volume(step.params):
                raise QtoolError(f"--target x86-avx2 cannot emulate 3-D Conv node '{step.node.name}': "
                                 f"the order in which onnxruntime's AVX2 kernel pairs its products is "
                                 f"known for 1-D and 2-D convolutions only (verify with --target exact, "
                                 f"or quantize with --target portable, which has no such pairs)")
            step.op = x86.PairSaturating(offset, x86.weight_risk(step.params))
        for step, weight in list(x86.saturating_integer_steps(self)):  # quantize_dynamic's MatMulInteger
            step.op = x86.SaturatingMatMulInteger((weight, x86.risky_pairs(weight)))

    def _qoperator_step(self, node: onnx.NodeProto, qdq_reason: str):
        """A QOperator node or a plain op on integer tensors as an integer step (qoperator_exec)."""
        try:
            lowered = self.lowering.lower(node)
        except Unsupported as e:
            return None, str(e)
        if lowered is None:
            return None, qdq_reason
        self.lowering.record(lowered.outputs, lowered.dtypes)
        keys = [float_name(o) if qp is not None else None
                for o, qp in zip(lowered.outputs, lowered.qparams)]
        return Step("integer", node, lowered.inputs, lowered.outputs, op=lowered.op,
                    params=lowered.params, keys=keys, qparams=list(lowered.qparams),
                    clamps_below_zero=lowered.clamps_below_zero), ""

    def _boundary_type(self, node: onnx.NodeProto, output: str) -> str | None:
        """The type of a boundary step's output where setup knows it (by name, see
        ``boundary.is_plain``), else the model's declaration."""
        if node.op_type == "DynamicQuantizeLinear":
            return "float32" if output == node.output[1] else "uint8"
        attrs = node_attrs(node)
        if node.op_type == "QuantizeLinear":
            if attrs.get("output_dtype", 0):
                return boundary.type_name(attrs["output_dtype"])
            zero = self.constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
            if zero is not None:
                return str(zero.dtype)
        return self._declared_type(output)

    def _declared_type(self, name: str) -> str | None:
        """A float step's output type as the model declares it (value_info), if it does."""
        return self.lowering.dtypes.get(name)

    def _dequantized_type(self, node: onnx.NodeProto) -> str:
        """DequantizeLinear's output type: ``output_dtype``, else the scale's type."""
        attrs = node_attrs(node)
        if attrs.get("output_dtype", 0):
            return str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(attrs["output_dtype"])))
        scale = self.constants.get(node.input[1])
        return str(scale.dtype) if scale is not None and scale.dtype.kind == "f" else "float32"

    def _integer_step(self, node: onnx.NodeProto):
        if node.op_type in ("MatMul", "Gemm") and self._blocked_source(node) is not None:
            try:
                return self._blocked_step(node), ""
            except Unsupported as e:
                return None, str(e)
        op = REGISTRY.get(node.op_type)
        if op is None:
            return None, subgraph_reason(node) or "no integer kernel"
        q_nodes = []  # per output; None for an omitted optional output ("")
        for out in node.output:
            if not out:
                q_nodes.append(None)
                continue
            users = self.consumers.get(out, [])
            if len(users) != 1 or users[0].op_type != "QuantizeLinear" or out in self.output_names:
                return None, f"output '{out}' is not followed by a single QuantizeLinear"
            q_nodes.append(users[0])
        operands, run_inputs = [], []
        consts = op.constants(node)
        for i, name in enumerate(node.input):
            if not name:
                operands.append(None)
                continue
            source = self.producer.get(name)
            if source is not None and source.op_type == "DequantizeLinear":
                try:
                    qp = self._qparams_of(source)
                except Unsupported as e:
                    return None, str(e)
                value = self.constants.get(source.input[0])
                if value is not None and isinstance(consts.get(i), Weight):
                    value, qp = centered(value, qp)  # uint8 weights (zero point 128): int8 again
                operands.append(Operand(qp, value))
                if value is None or not isinstance(consts.get(i), (Weight, Bias)):
                    run_inputs.append(source.input[0])  # activations and quantized operands
            elif isinstance(consts.get(i), Raw):
                operands.append(Operand(None, self.constants.get(name)))
                if consts[i].at_run:
                    run_inputs.append(name)
            elif source is not None and is_guard(source) and len(node.input) > 1:
                return None, f"weight '{node.input[1]}' is float"  # kept float by quantize
            else:
                return None, f"input '{name}' is not quantized"
        try:
            outputs = [None if q is None else self._qparams_of(q) for q in q_nodes]
        except Unsupported as e:
            return None, str(e)
        present = [q for q in q_nodes if q is not None]
        view = NodeView(node, operands, next(o for o in outputs if o is not None), self.rounding,
                        self.multiplier_bits, outputs=outputs, opset=self.opsets.get("", 1))
        try:
            params = op.derive(view)
        except Unsupported as e:
            return None, str(e)
        step = Step("integer", node, run_inputs, [q.output[0] for q in present], op=op, params=params,
                    keys=[o for o in node.output if o], qparams=[o for o in outputs if o is not None],
                    absorbs=[q.name for q in present])
        return step, ""

    def _control_step(self, node: onnx.NodeProto) -> Step | None:
        """An If, Loop or Scan whose bodies hold integer ops: each body an executor of its own
        (qtool/control.py), run by the op's semantics. None when no body has an integer op: the
        node then runs whole in onnxruntime, as any float op."""
        bodies = {}
        for attr, graph in control.body_graphs(node).items():
            outer = [n for n in control.graph_outer_reads(graph) if n not in self.constants]
            model = control.body_model(graph, outer, self.model.opset_import, self.model.ir_version)
            model.metadata_props.extend(p for p in self.model.metadata_props  # the arithmetic only
                                        if p.key in ("qtool.rounding", "qtool.multiplier_bits"))
            bodies[attr] = IntegerExecutor(model, self.arithmetic, control.constant_reads(graph, self.constants))
        if not any(body.has_integer() for body in bodies.values()):
            return None
        return Step("control", node, self._reads(node), list(node.output), params=bodies)

    def has_integer(self) -> bool:
        """Some op runs integer, in this graph or in a body of its If, Loop or Scan nodes."""
        return any(s.kind == "integer" or (s.kind == "control" and any(b.has_integer() for b in s.params.values()))
                   for s in self.steps)

    def all_steps(self):
        """This executor's steps and, depth first, those of its control steps' bodies."""
        for step in self.steps:
            yield step
            if step.kind == "control":
                for body in step.params.values():
                    yield from body.all_steps()

    def _blocked_source(self, node: onnx.NodeProto) -> onnx.NodeProto | None:
        """The DequantizeLinear with ``block_size`` that gives a MatMul/Gemm its constant B, if any."""
        source = self.producer.get(node.input[1]) if len(node.input) > 1 else None
        if source is None or source.op_type != "DequantizeLinear" or source.input[0] not in self.constants:
            return None
        return source if node_attrs(source).get("block_size", 0) else None

    def _blocked_step(self, node: onnx.NodeProto) -> Step:
        """``DQ(x) -> MatMul|Gemm(B from a blocked DQ) -> Q`` as one integer step (ops/blocked.py)."""
        weight_dq = self._blocked_source(node)
        attrs, dq = node_attrs(node), node_attrs(weight_dq)
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            raise Unsupported("a blocked weight's Gemm must have transA=0, alpha=1 and beta=1")
        users = self.consumers.get(node.output[0], [])
        source = self.producer.get(node.input[0])
        if len(users) != 1 or users[0].op_type != "QuantizeLinear" or node.output[0] in self.output_names:
            raise Unsupported(f"output '{node.output[0]}' is not followed by a single QuantizeLinear")
        if source is None or source.op_type != "DequantizeLinear" or source.input[0] in self.constants:
            raise Unsupported(f"input '{node.input[0]}' is not quantized")
        x, y = self._qparams_of(source), self._qparams_of(users[0])
        values = self.constants[weight_dq.input[0]]
        if values.dtype.kind not in "iu" and boundary.type_of(values.dtype) not in boundary.INTEGER_RANGES:
            raise Unsupported(f"weight '{weight_dq.input[0]}' is {values.dtype}, not an integer type")
        scales = self.constants.get(weight_dq.input[1])
        zero = self.constants.get(weight_dq.input[2]) if len(weight_dq.input) > 2 and weight_dq.input[2] else None
        if scales is None or (len(weight_dq.input) > 2 and weight_dq.input[2] and zero is None):
            raise Unsupported(f"the blocked scales of '{weight_dq.input[0]}' are not constants")
        if values.ndim != 2:
            raise Unsupported(f"blocked weight '{weight_dq.input[0]}' has {values.ndim} axes, not 2")
        trans = bool(attrs.get("transB", 0)) if node.op_type == "Gemm" else False
        block_axis = int(dq.get("axis", 1)) % 2
        if block_axis != (1 if trans else 0):
            raise Unsupported(f"weight '{weight_dq.input[0]}' is blocked along N, not along K")
        rule = boundary.of(weight_dq)
        w = values.astype(np.int64)  # any integer type: checked to fit int8 below
        if zero is not None:
            w = w - rule.spread(zero, values.shape, "zero point").astype(np.int64)
        if w.size and (w.min() < -128 or w.max() > 127):
            raise Unsupported(f"blocked weight '{weight_dq.input[0]}' less its zero point leaves int8")
        w, scales = (w.T, scales.T) if trans else (w, scales)
        bias = bias_scale = None
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
            bias_dq = self.producer.get(node.input[2])
            if bias_dq is None or bias_dq.op_type != "DequantizeLinear" or bias_dq.input[0] not in self.constants:
                raise Unsupported(f"bias '{node.input[2]}' is not a quantized constant")
            qb = self._qparams_of(bias_dq)
            bias = self.constants[bias_dq.input[0]].astype(np.int64) - np.asarray(qb.zero_point, np.int64)
            if bias.size not in (1, w.shape[1]):
                raise Unsupported(f"bias '{node.input[2]}' of shape {list(bias.shape)} is not one value per column")
            bias = np.broadcast_to(bias.reshape(-1), (w.shape[1],))
            bias_scale = np.broadcast_to(np.asarray(qb.scale, np.float64).reshape(-1), (w.shape[1],))
        params = blocked.derive(x, w.astype(np.int8), scales.astype(np.float32), int(dq["block_size"]), y,
                                self.rounding, bias, bias_scale)
        return Step("integer", node, [source.input[0]], [users[0].output[0]], op=blocked.BlockedMatMul(),
                    params=params, keys=[node.output[0]], qparams=[y], absorbs=[users[0].name])

    def _masked_softmax_step(self, join: masks.Join) -> Step | None:
        """``DQ(scores) -> Add(mask) | Where -> Softmax -> Q`` as one integer step (qtool/masks.py),
        or None when the group is not in that form (both nodes then run in float)."""
        softmax = next(n for n in self.model.graph.node if n.name == join.softmax)
        source = self.producer.get(join.scores)
        users = self.consumers.get(softmax.output[0], [])
        if (source is None or source.op_type != "DequantizeLinear" or source.input[0] in self.constants
                or len(users) != 1 or users[0].op_type != "QuantizeLinear"
                or softmax.output[0] in self.output_names):
            return None
        try:
            out = self._qparams_of(users[0])
            view = NodeView(softmax, [Operand(self._qparams_of(source))], out, self.rounding,
                            self.multiplier_bits, opset=self.opsets.get("", 1))
            params = MaskedSoftmax().derive(view, join.form)
        except Unsupported:
            return None
        return Step("integer", softmax, [source.input[0], join.mask], [users[0].output[0]], op=MaskedSoftmax(),
                    params=params, keys=[softmax.output[0]], qparams=[out], absorbs=[users[0].name])

    def _prune(self, steps: list[Step]) -> list[Step]:
        """Drop steps whose outputs nothing needs (e.g. DequantizeLinear absorbed by a group)."""
        needed = set(self.output_names)
        kept = []
        for step in reversed(steps):
            if any(o in needed for o in step.outputs):
                kept.append(step)
                needed.update(step.inputs)
        return kept[::-1]

    def _chain(self, steps: list[Step]) -> list[Step]:
        """``steps`` with each run of two or more chainable steps replaced by one "chain" step, placed
        where its last step was (every input of the run exists by then)."""
        readers = self._readers(steps)
        runs: list[list[Step]] = []
        open_runs: dict[str, list[Step]] = {}  # output of a run's last step -> the run
        for step in steps:
            source = self._chain_input(step)
            if source is None:
                continue
            run = open_runs.pop(source, None) if readers.get(source) == 1 else None
            if run is None:
                run = [step]
                runs.append(run)
            else:
                run.append(step)
            open_runs[step.outputs[0]] = run
        last = {id(run[-1]): run for run in runs if len(run) > 1}
        members = {id(s) for run in last.values() for s in run}
        chained = []
        for step in steps:
            if id(step) in last:
                run = last[id(step)]
                ndim = max((self.constants[n].ndim for s in run for n in s.inputs if n in self.constants),
                           default=0)
                chained.append(Step("chain", step.node, [self._chain_input(run[0])], list(step.outputs),
                                    params=Chain(run, ndim)))
            elif id(step) not in members:
                chained.append(step)
        return chained

    def _readers(self, steps: list[Step]) -> dict[str, int]:
        """How many steps read each tensor, a graph output counting as one reader."""
        readers: dict[str, int] = {name: 1 for name in self.output_names}
        for step in steps:
            for name in step.inputs:
                readers[name] = readers.get(name, 0) + 1
        return readers

    def _fuse_chains(self, steps: list[Step]) -> list[Step]:
        """``steps`` with each chain whose input is the 8-bit output of a kernel that takes a table
        (a Conv), and read by nothing else, folded into that kernel's step: the kernel then writes
        the chain's lookup as it requantizes, one pass instead of two."""
        readers = self._readers(steps)
        producers = {step.outputs[0]: step for step in steps if step.kind == "integer"
                     and getattr(step.op, "takes_table", False) and len(step.outputs) == 1}
        fused, folded = {}, set()
        for step in steps:
            source = step.inputs[0] if step.kind == "chain" else None
            producer = producers.get(source)
            if producer is None or readers.get(source) != 1 or step.params.ndim > 4 \
                    or producer.qparams[0] is None or np.dtype(producer.qparams[0].dtype) not in TABLE_INPUTS:
                continue
            fused[id(producer)] = dataclasses.replace(producer, outputs=list(step.outputs), then=step.params)
            folded.add(id(step))
        return [fused.get(id(step), step) for step in steps if id(step) not in folded]

    def _chain_input(self, step: Step) -> str | None:
        """The one input a chainable step maps elementwise; None if the step is not chainable: not an
        integer step with one output, not elementwise, or reading more than one non-constant or a
        constant of more than one element."""
        if step.kind != "integer" or len(step.outputs) != 1 or not step.op.elementwise(step.params):
            return None
        varying = [name for name in step.inputs if name not in self.constants]
        if len(varying) != 1 or any(self.constants[name].size != 1 for name in step.inputs
                                    if name in self.constants):
            return None
        return varying[0]

    # -- running -----------------------------------------------------------------------------------
    def run(self, feeds: dict[str, np.ndarray], keep_integer: bool = False, on_integer=None,
            pace: tuple[int, int] | None = None) -> Result:
        """The model on ``feeds``. ``keep_integer``: every integer tensor in ``Result.integer`` (by
        the float tensor it stands for), or, with ``on_integer``, passed to ``on_integer(key,
        value)`` as soon as it is computed and not kept (verify compares it while the run goes on).
        ``pace``: (samples in ``feeds``, samples the caller will run after them), when it knows:
        the fast paths then start only once the plain ones would still run ``FAST_FROM`` seconds
        (see there); without it they run from the first call."""
        if not self._fast and (pace is None or (self._per_sample is not None
                                                and self._per_sample * (pace[0] + pace[1]) >= FAST_FROM)):
            self._fast = True
            for step in self.all_steps():  # plans made for the plain paths: made again
                if step.kind == "integer":
                    step.specialized.clear()
        # the last batch, smaller than those before it (512 samples at 3 a batch end with 2): its
        # shapes are new, and onnxruntime's Conv engines for them would take longer to set up and
        # check than they save on it (PP-OCRv4 rec: 0.77 s for its 38 Convs, against a few tens
        # of ms for two lines summed in numpy); it runs without them, and its plans go after it
        tail = self._fast and pace is not None and pace[1] == 0 and pace[0] < self._widest
        if pace is not None:
            self._widest = max(self._widest, pace[0])
        kept = [(step, dict(step.specialized)) for step in self.all_steps()] if tail else []
        start = time.perf_counter()
        try:
            with blas.single_threaded(), _collector_paused(), fast_paths(self._fast, engines=not tail):
                result = self._run(feeds, keep_integer or on_integer is not None, on_integer)
        finally:
            for step, plans in kept:  # the plans as they were (none evicted by the batch's own)
                step.specialized.clear()
                step.specialized.update(plans)
        if not self._fast:  # the first run also makes the plans and tables: the second one is timed
            self._plain_runs += 1
            if self._plain_runs > 1:
                self._per_sample = (time.perf_counter() - start) / max(1, pace[0])
        return result

    def _run(self, feeds: dict[str, np.ndarray], keep_integer: bool, on_integer=None) -> Result:
        env = dict(self.constants)
        for name in self.input_names:
            if name not in feeds:
                raise QtoolError(f"missing input '{name}' (inputs: {', '.join(self.input_names)})")
            env[name] = feeds[name]
        if self.pixels:
            env.update(feeds_for(self.pixels, {n: env[n] for n in self.pixels if n in env}))
        result = Result({})
        steps = self.steps if keep_integer else self._chained_steps
        for step, done in zip(steps, self._frees[keep_integer]):
            values = [env[n] for n in step.inputs]
            try:
                outputs = self._run_step(step, values)
            except QtoolError as e:
                if step.kind == "integer":  # an overflow, a mask: the batch has nothing to do with it
                    raise
                raise QtoolError(f"{e}{batch_hint(feeds)}") from None
            except ValueError as e:
                if not str(e).startswith(_SHAPE_ERRORS):
                    raise  # a bug
                shapes = ", ".join(str(list(np.shape(v))) for v in values)
                raise QtoolError(f"{step.node.op_type} node '{step.node.name}' cannot take inputs of shapes "
                                 f"{shapes} ({e}){batch_hint(feeds)}") from None
            for name, value in zip(step.outputs, outputs):
                env[name] = value
            if keep_integer and step.kind in ("integer", "quantize"):
                for key, value in zip(step.keys, outputs):
                    if key is None or self._key_producer[key] is not step:
                        continue  # a key two steps write is the later one's (integer_tensors)
                    if on_integer is None:
                        result.integer[key] = value
                    else:
                        on_integer(key, value)
            del values, outputs
            for name in done:  # memory is the live set of activations, not their sum
                env.pop(name, None)
        result.outputs = {name: env[name] for name in self.output_names}
        return result

    def _releases(self, steps: list[Step]) -> list[list[str]]:
        """Per step, the values not needed after it (read last there, or never read), neither
        constants nor model outputs."""
        last = {}
        for i, step in enumerate(steps):
            for name in (*step.inputs, *step.outputs):
                last[name] = i
        keep = set(self.constants) | set(self.output_names)
        frees: list[list[str]] = [[] for _ in steps]
        for name, i in last.items():
            if name not in keep:
                frees[i].append(name)
        return frees

    def _run_step(self, step: Step, values: list[np.ndarray]) -> list[np.ndarray]:
        if step.kind == "chain":
            return [self._run_chain(step.params, values[0])]
        if step.kind == "integer":
            shapes = tuple(v.shape for v in values)
            params = step.specialized.get(shapes)
            if params is None:
                if len(step.specialized) >= SPECIALIZED_KEPT:  # inputs of ever new shapes: bounded
                    del step.specialized[next(iter(step.specialized))]
                params = step.specialized[shapes] = step.op.specialize(step.params, list(shapes))
            try:
                if step.then is not None:
                    return [self._run_fused(step, params, values)]
                out = step.op.run(params, *values)
            except OverflowError as e:
                what = ("int32 accumulator overflow" if "exceeds int32" in str(e) else
                        "accumulator overflow" if "accumulator" in str(e) else f"overflow ({e})")
                raise QtoolError(f"{what} in {step.node.op_type} node '{step.node.name}'") from None
            except masks.MaskError as e:
                raise QtoolError(f"{e} at Softmax node '{step.node.name}'") from None
            except IndexOutOfRange as e:
                raise DataError(f"{step.node.op_type} node '{step.node.name}' reads {e}: the data holds "
                                 f"ids the model has no entry for") from None
            # a 0-d result of numpy arithmetic is a numpy scalar (a Loop counter's Add, chars2vec):
            # an array again, for onnxruntime's float steps and the executor's own
            out = list(out) if isinstance(out, (list, tuple)) else [out]
            return [np.asarray(o) if isinstance(o, np.generic) else o for o in out]
        if step.kind == "quantize":
            return [self._quantize(values[0], step.qparams[0])]
        if step.kind == "dequantize":
            return [self._dequantize(step, values[0])]
        if step.kind == "boundary":
            return step.params.run(*values)
        if step.kind == "control":
            return self._run_control(step, values)
        return self._run_float(step, values)

    def _run_control(self, step: Step, values: list[np.ndarray]) -> list[np.ndarray]:
        """An If, Loop or Scan: its bodies run on this run's paths (plain or fast)."""
        def run_body(attr: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            body = step.params[attr]
            outputs = body._run({n: feeds[n] for n in body.input_names}, False).outputs
            return [outputs[name] for name in body.output_names]

        return control.run(step.node, dict(zip(step.inputs, values)), run_body)

    @staticmethod
    def _quantize(x: np.ndarray, qp: QParams) -> np.ndarray:
        """``quantize_array``, elementwise: a large per-tensor input in ranges on the cores."""
        parts = parallel.ranges(np.size(x), np.size(x))
        if qp.axis is not None or len(parts) == 1:
            return np.asarray(quantize_array(x, qp))
        flat = np.ascontiguousarray(x).reshape(-1)
        out = np.empty(flat.size, dtype=qp.dtype)

        def quantize(start: int, stop: int) -> None:
            out[start:stop] = quantize_array(flat[start:stop], qp)

        parallel.run_parts(quantize, parts)
        return out.reshape(np.shape(x))

    @staticmethod
    def _dequantized(q: np.ndarray, qp: QParams, dtype: str | None) -> np.ndarray:
        out = np.asarray(dequantize_array(q, qp))  # an array even for a 0-d input (a scalar constant)
        return out if dtype in (None, "float32") else out.astype(dtype)

    def _dequantize(self, step: Step, q: np.ndarray) -> np.ndarray:
        """An 8-bit per-tensor input is looked up in ``dequantize_array`` of its 256 values (kept per
        input type in ``step.specialized``), which is elementwise: the same floats."""
        qp = step.qparams[0]
        if qp.axis is not None or q.dtype not in BYTE_TYPES:
            return self._dequantized(q, qp, step.params)
        return byte_mapped(lambda v: self._dequantized(v, qp, step.params), q, step.specialized)

    def _run_fused(self, step: Step, params, values: list[np.ndarray]) -> np.ndarray:
        """An integer step with the chain after it: through the chain's table where it has one
        for the step's output type, else the chain after the step."""
        dtype = np.dtype(step.qparams[0].dtype)
        table = self._table_of(step.then, dtype)
        if table is not None:  # (a chain is folded only where its constants have at most 4 axes)
            return step.op.run(params, *values, table=table)
        return self._run_chain(step.then, step.op.run(params, *values))

    def _table_of(self, chain: Chain, dtype: np.dtype) -> np.ndarray | None:
        if dtype not in chain.tables:
            chain.tables[dtype] = self._chain_table(chain, dtype) if dtype in TABLE_INPUTS else None
        return chain.tables[dtype]

    def _run_chain(self, chain: Chain, x: np.ndarray) -> np.ndarray:
        table = self._table_of(chain, x.dtype)
        if table is not None and x.ndim >= chain.ndim:
            return lookup(table, x)
        for step in chain.steps:
            x = self._run_step(step, [x if name not in self.constants else self.constants[name]
                                      for name in step.inputs])[0]
        return x

    def _chain_table(self, chain: Chain, dtype: np.dtype) -> np.ndarray | None:
        """The chain's steps run on every value of ``dtype`` (8 or 16 bits): its output for each
        input bit pattern."""
        values = values_of(dtype)
        count = values.size
        try:
            for step in chain.steps:
                values = self._run_step(step, [values if name not in self.constants else self.constants[name]
                                               for name in step.inputs])[0]
        except (QtoolError, OverflowError, ValueError):
            return None  # a value the data may never hold: run the steps themselves
        return values if values.shape == (count,) else None

    def _run_float(self, step: Step, values: list[np.ndarray]) -> list[np.ndarray]:
        """A fenced float op, run alone in onnxruntime (session built once per input types)."""
        odd = next((v.dtype for v in values if not boundary.numpy_native(v.dtype)), None)
        if odd is not None:
            raise QtoolError(f"{step.node.op_type} node '{step.node.name}' takes a {odd} tensor, which the "
                             f"executor passes only to QuantizeLinear/DequantizeLinear (onnxruntime's Python "
                             f"interface cannot take it)")
        key = (id(step), tuple(v.dtype.str for v in values))  # by step: node names may be empty or repeat
        session = self._float_sessions.get(key)
        if session is None:
            session = self._float_sessions[key] = self._float_session(step.node, step.inputs, values)
        try:
            return session.run(None, dict(zip(step.inputs, values)))
        except ORT_ERRORS as e:  # onnxruntime's own checks (a state of fixed batch 1 for a batch of 8)
            raise QtoolError(f"onnxruntime failed on {step.node.op_type} node '{step.node.name}', which runs in "
                             f"float: {first_line(e)}") from None

    def _float_session(self, node: onnx.NodeProto, names: list[str],
                       values: list[np.ndarray]) -> ort.InferenceSession:
        """A session of ``node`` alone, its graph inputs ``names`` (the node's inputs, once each,
        and what its subgraphs read from the main graph) typed as ``values``."""
        typed = dict(zip(names, values))
        inputs = [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), None)
                  for n, v in typed.items()]
        outputs = [onnx.ValueInfoProto(name=n) for n in node.output if n]
        graph = onnx.helper.make_graph([node], "fenced", inputs, outputs)
        model = onnx.helper.make_model(graph, opset_imports=list(self.model.opset_import),
                                       ir_version=self.model.ir_version)
        options = ort.SessionOptions()
        options.log_severity_level = 4  # errors come back as exceptions, told in one line
        # one node at a time: no thread pool of its own, whose threads would spin after each run
        # and take the cores from the BLAS threads of the integer kernels in between (measured on
        # PP-OCRv4 rec: 503 ms per line with the default pools, 92-96 ms without)
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            return ort.InferenceSession(model.SerializeToString(), options,
                                        providers=["CPUExecutionProvider"])
        except Exception as e:
            raise QtoolError(f"cannot run float {node.op_type} node '{node.name}': "
                             f"{str(e).splitlines()[0]}") from None

    # -- reporting ---------------------------------------------------------------------------------
    def float_nodes(self) -> list[tuple[str, str, str]]:
        """Nodes that run in float: (op_type, name, why); not the identities that keep onnxruntime
        from quantizing a float op's weights (targets.form.guard_float_ops)."""
        index = {tuple(node.output): i for i, node in enumerate(self.model.graph.node)}

        def name(node) -> str:  # an unnamed node by its op type and place in the graph
            return node.name or f"{node.op_type} #{index.get(tuple(node.output), '?')} (unnamed)"

        found = []
        for s in self.steps:
            if s.kind == "float" and not is_guard(s.node):
                found.append((s.node.op_type, name(s.node), s.reason))
            elif s.kind == "control":  # the float ops inside its bodies, an unnamed one by where it is
                for attr, body in s.params.items():
                    found.extend((t, f"{n} in {name(s.node)}.{attr}" if n.endswith("(unnamed)") else n, r)
                                 for t, n, r in body.float_nodes())
        return found

    def integer_tensors(self) -> dict[str, "TensorInfo"]:
        """Float tensor name -> how the executor holds it, for every integer tensor."""
        users: dict[str, list[Step]] = {}
        for step in self.steps:
            for name in step.inputs:
                users.setdefault(name, []).append(step)
        info = {}
        for step in self.steps:
            if step.kind not in ("integer", "quantize"):
                continue
            op_type = step.node.op_type if step.kind == "integer" else "QuantizeLinear"
            for key, out, qp in zip(step.keys, step.outputs, step.qparams):
                if key is None or qp is None:
                    continue
                readers = users.get(out, [])
                clamped = bool(readers) and all(
                    r.kind == "integer" and (r.op.clamps_below_zero or r.clamps_below_zero)
                    for r in readers)
                info[key] = TensorInfo(op_type, qp, clamped)
        return info


@dataclass(frozen=True)
class TensorInfo:
    op_type: str
    qparams: QParams
    # every reader clamps at zero (Relu), so the tensor was quantized with the clamped range
    clamped: bool
