"""Integer ops, one module per ONNX op_type, found through ``REGISTRY``.

Each op class has three parts:

* ``constants(node)``: for ``qtool quantize``, which inputs are weights, biases or raw constants;
* ``derive(view)``: setup, where floats are allowed: scales become integer parameters;
* ``run(params, *inputs)``: the kernel, integers only, in the order
  accumulate -> requantize -> + zero point -> clamp -> cast.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx

from ..fixedpoint import DEFAULT_ROUNDING, Requant, quantize_multipliers, requantize, saturate
from ..qparams import QParams

REGISTRY: dict[str, "IntegerOp"] = {}

# metadata of a params dataclass field that ``qtool.params`` leaves out of the parameters it
# writes: another weight, or a table that a formula and other fields define
NOT_DUMPED_KEY = "qtool.not_dumped"
NOT_DUMPED = {NOT_DUMPED_KEY: True}
# ... and a field written only where it is set (not None): a part some models have (LSTM's
# peepholes), so that the parameters of those without it read as they did before it existed
DUMPED_WHEN_SET_KEY = "qtool.dumped_when_set"
DUMPED_WHEN_SET = {DUMPED_WHEN_SET_KEY: True}


def register(cls):
    REGISTRY[cls.op_type] = cls()
    return cls


@dataclass(frozen=True)
class Weight:
    """A constant input quantized symmetrically, per slice along ``axis`` when per-channel.
    ``optional``: the input may also be an activation (MatMul's B), quantized as one."""

    axis: int | None
    optional: bool = False


@dataclass(frozen=True)
class Bias:
    """A constant input stored as int32 with scale ``S_in[activation] * S_in[weight]``.
    ``recurrent``: the bias is [directions, 2 * rows], the input weight's bias then the recurrent
    weight's (LSTM's B); the second half's scale is ``S_hidden * S_in[recurrent]``, the hidden
    state's (S, Z) being those of the node's first named output."""

    activation: int
    weight: int
    recurrent: int | None = None


@dataclass(frozen=True)
class Raw:
    """An input kept as it is (shapes, axes, bounds), read by ``derive`` from the constant.
    ``at_run``: the input may also be computed at run time (Reshape's shape from a Shape node);
    it then reaches ``run`` as well. Otherwise it must be a constant."""

    at_run: bool = False


@dataclass(frozen=True)
class Operand:
    """One input of a node as a kernel sees it: a quantized activation, a quantized constant
    (``value`` set, ``qparams`` set) or a raw constant (``qparams`` None)."""

    qparams: QParams | None
    value: np.ndarray | None = None


@dataclass
class NodeView:
    """Everything ``derive`` may read: the node, its resolved inputs and output, the options."""

    node: onnx.NodeProto
    inputs: list[Operand | None]
    output: QParams
    rounding: str = DEFAULT_ROUNDING
    multiplier_bits: int = 32
    outputs: list[QParams] = field(default_factory=list)  # every output's; ``output`` is the first
    attrs: dict = field(default_factory=dict)
    opset: int = field(default_factory=onnx.defs.onnx_opset_version)  # the model's default domain's

    def __post_init__(self):
        self.outputs = self.outputs or [self.output]
        self.attrs = {a.name: onnx.helper.get_attribute_value(a) for a in self.node.attribute}

    def attr(self, name, default=None):
        value = self.attrs.get(name, default)
        return value.decode() if isinstance(value, bytes) else value


class Unsupported(Exception):
    """Raised by ``derive`` or ``check`` when a node's form is outside what the kernel handles;
    the node then runs in float and the reason is reported."""


class IntegerOp:
    op_type: ClassVar[str]
    # Output takes the input's (S, Z): no arithmetic, only threshold propagation (DESIGN.md).
    shares_qparams: ClassVar[bool] = False
    # The op passes values through unchanged or clamps at zero; its input may take the output's
    # range (backward propagation) when it has no other consumer.
    clamps_below_zero: ClassVar[bool] = False
    # Inputs that are constants (initializers) and not named by ``constants()`` are quantized
    # per tensor like an activation and reach ``run`` as integer arrays (Add x + 3, Mul x * 0.5).
    accepts_constants: ClassVar[bool] = False
    # ``run`` takes ``table=``: a 256-entry lookup applied to each 8-bit output byte as it is
    # written (the executor's elementwise chain after the op, in the same pass)
    takes_table: ClassVar[bool] = False

    def constants(self, node: onnx.NodeProto) -> dict[int, Weight | Bias | Raw]:
        return {}

    def tied(self, node: onnx.NodeProto) -> list[list[str]]:
        """Groups of the node's activations that ``qtool quantize`` gives one (S, Z) (a recurrent
        op's hidden state in and out), besides ``shares_qparams``."""
        return []

    def check(self, node: onnx.NodeProto, view_attrs: dict) -> None:
        """Raise ``Unsupported`` for attribute combinations the kernel does not handle."""

    def derive(self, view: NodeView):
        raise NotImplementedError

    def elementwise(self, params) -> bool:
        """True when every output element is a function of the input elements at its position
        alone (numpy broadcasting, one-element operands), whatever the shape: the executor may then
        evaluate a run of such steps on all 256 values of an 8-bit input and look them up."""
        return False

    def specialize(self, params, shapes: list[tuple[int, ...]]):
        """Finish ``derive`` for concrete input shapes (setup, cached per shape by the executor)."""
        return params

    def run(self, params, *inputs: np.ndarray) -> np.ndarray:
        raise NotImplementedError


def node_attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def check_integer(*arrays: np.ndarray) -> None:
    for a in arrays:
        if a.dtype.kind not in "iu":
            raise TypeError(f"integer kernel received {a.dtype} data")


def plan_for(p, x: np.ndarray, plan_type):
    """``(params, plan)`` for a kernel whose ``specialize`` makes a ``plan_type`` per input shape:
    the plan given when it is for ``x``'s shape, else one made now (``p`` may be the bare params,
    or a plan for another shape). The integer check comes first, before any plan is built."""
    params = p.params if isinstance(p, plan_type) else p
    check_integer(x, params.weight)
    if isinstance(p, plan_type) and p.in_shape == x.shape:
        return params, p
    return params, plan_type.of(params, x.shape)


@dataclass(frozen=True)
class Rescale:
    """``y = requant(x - Z_x) + Z_y`` with ``M / 2**rshift = S_x / S_y``; identity when equal."""

    zero_in: int
    zero_out: int
    requant: Requant | None
    rounding: str
    dtype: str

    def __call__(self, q: np.ndarray) -> np.ndarray:
        if self.requant is None:
            return q
        acc = q.astype(np.int64) - self.zero_in
        y = requantize(acc, self.requant.multiplier, self.requant.rshift, self.rounding)
        return saturate(y + self.zero_out, self.dtype)


def rescale(src: QParams, dst: QParams, view: NodeView) -> Rescale:
    same = float(src.scale) == float(dst.scale) and int(src.zero_point) == int(dst.zero_point)
    requant = None
    if not (same and src.dtype == dst.dtype):
        requant = quantize_multipliers(float(src.scale) / float(dst.scale), view.multiplier_bits)
    return Rescale(int(src.zero_point), int(dst.zero_point), requant, view.rounding, dst.dtype)


def per_tensor(qp: QParams, what: str) -> QParams:
    if np.ndim(qp.scale) != 0 and np.size(qp.scale) != 1:
        raise Unsupported(f"{what} must be quantized per tensor")
    return QParams(float(np.asarray(qp.scale).reshape(-1)[0]),
                   int(np.asarray(qp.zero_point).reshape(-1)[0]), qp.dtype)


def _register_all() -> None:
    """Import every module of this package: each registers its op classes. Private modules
    (``_loops``: compiled loops that need the optional numba) are imported by their users."""
    import importlib
    import pkgutil

    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


_register_all()


@contextlib.contextmanager
def fast_paths(enabled: bool, engines: bool = True):
    """The compiled loops (``compiled``) and onnxruntime's Conv engine (``ortconv``) as they are
    (``enabled``) or off for the duration: the kernels then take their numpy forms, which give
    the same integers. ``engines`` False: the engine alone off, the compiled loops as they are.
    Plans made while they are off keep the numpy forms."""
    from . import compiled, ortconv

    saved = compiled.ENABLED, ortconv.ENABLED
    if not enabled:
        compiled.ENABLED = ortconv.ENABLED = False
    if not engines:
        ortconv.ENABLED = False
    try:
        yield
    finally:
        compiled.ENABLED, ortconv.ENABLED = saved
