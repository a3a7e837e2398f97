"""onnxruntime's u8 x s8 arithmetic on x86 CPUs without VNNI (AVX2; seed 002), and this host's.

MLAS multiplies the raw uint8 activation by the raw int8 weight and adds adjacent products along
the reduction axis K in pairs into int16 with saturation (VPMADDUBSW), then sums the pairs exactly:

    acc = sum_j sat16(a[2j]·w[2j] + a[2j+1]·w[2j+1])      (K padded with a zero to even length)

Zero points are applied afterwards, exactly, so saturation depends on the raw activation byte: an
int8 activation becomes ``q + 128`` (onnxruntime moves int8 QDQ tensors to uint8 before fusing),
padding holds the raw zero point. K is the flattened reduction axis in memory order: for Gemm and
MatMul the K axis; for a convolution the NHWC im2col order ``(kh·KW + kw)·C_g + c`` (taps outer,
channels inner: pairs cross taps when C_g is odd). u8 x u8, s8 x s8 (a QOperator node with int8
activations runs MLAS's portable kernel) and depthwise convolutions (one input and one output
channel per group; a channel multiplier saturates) are exact. Measured against onnxruntime 1.32 on
an emulated AVX2 CPU (qemu-x86_64 -cpu Haswell-v4), see tests/test_targets.py.

The executor emulates it by adding to its exact accumulator what saturation takes away,
``sum_j (sat16(p_j) − p_j)``, computed only for the (pair, channel) combinations whose worst case
can leave int16: ``max_a·(|w0| + |w1|) > 32767`` with w0, w1 of one sign (with opposite signs
a pair stays within ``max_a·128``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import onnx

from ..ops.accumulate import MatMulInteger, MatMulIntegerParams
from ..ops.conv import ConvParams, run_scanned as conv_run_scanned
from ..ops.gemm import MatMulParams, run_scanned as matmul_run_scanned

INT16_MIN, INT16_MAX = -32768, 32767
RAW_MAX = 255  # the largest uint8 activation byte
# the kernels that run u8 x s8 products: QDQ groups onnxruntime fuses, and QOperator nodes
EMULATED = {"Conv", "Gemm", "MatMul", "QLinearConv", "QLinearMatMul", "QGemm"}


# -- the arithmetic ------------------------------------------------------------------------------
def risky_pairs(weight_k: np.ndarray, raw_max: int = RAW_MAX) -> np.ndarray:
    """bool [K/2, N]: pairs of ``weight_k`` [K, N] (K order as the kernel reads it) that can
    saturate for some activation bytes up to ``raw_max``."""
    w = _even(weight_k.astype(np.int64))
    w0, w1 = w[0::2], w[1::2]
    same_sign = (w0 * w1) >= 0
    return same_sign & (raw_max * (np.abs(w0) + np.abs(w1)) > INT16_MAX)


def saturation_loss(a_raw: np.ndarray, weight_k: np.ndarray, risky: np.ndarray | None = None) -> np.ndarray:
    """int64 [rows, N]: ``sum_j sat16(p_j) − p_j`` for raw activation rows ``a_raw`` [rows, K]
    and weights ``weight_k`` [K, N]; 0 where no pair saturates. Loops over the risky pairs only."""
    w = _even(weight_k.astype(np.int64))
    a = _even(a_raw.astype(np.int64).T).T
    risky = risky_pairs(weight_k) if risky is None else risky
    loss = np.zeros((a.shape[0], w.shape[1]), np.int64)
    for j in np.flatnonzero(risky.any(axis=1)):
        cols = np.flatnonzero(risky[j])
        p = a[:, 2 * j, None] * w[2 * j, cols] + a[:, 2 * j + 1, None] * w[2 * j + 1, cols]
        loss[:, cols] += np.clip(p, INT16_MIN, INT16_MAX) - p
    return loss


def _even(k_first: np.ndarray) -> np.ndarray:
    """Pad axis 0 with one zero row if its length is odd (the kernel pads K to pairs)."""
    if k_first.shape[0] % 2 == 0:
        return k_first
    return np.concatenate([k_first, np.zeros((1, *k_first.shape[1:]), k_first.dtype)])


def conv_weight_k(weight: np.ndarray, group: int) -> list[np.ndarray]:
    """Per group, the weight as [K, C_out/group] in NHWC im2col order (kh, kw, c)."""
    c_out, c_g, kh, kw = weight.shape
    per = c_out // group
    return [weight[g * per:(g + 1) * per].transpose(2, 3, 1, 0).reshape(kh * kw * c_g, per)
            for g in range(group)]


def _conv_rows(x_raw: np.ndarray, p: ConvParams, pad_value: int) -> tuple[np.ndarray, int, int]:
    """Raw activations as im2col rows [n, out_h·out_w, kh·kw, C] (NHWC order), padding = ``pad_value``."""
    top, left, bottom, right = p.pads
    x = np.pad(x_raw.astype(np.int64), ((0, 0), (0, 0), (top, bottom), (left, right)),
               constant_values=pad_value)
    kh, kw = p.weight.shape[2:]
    (sh, sw), (dh, dw) = p.strides, p.dilations
    out_h = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1
    out_w = (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
    taps = [x[:, :, i * dh:i * dh + sh * (out_h - 1) + 1:sh, j * dw:j * dw + sw * (out_w - 1) + 1:sw]
            for i in range(kh) for j in range(kw)]
    rows = np.stack(taps, 1).transpose(0, 3, 4, 1, 2)  # [n, out_h, out_w, taps, C]
    return rows.reshape(x.shape[0], out_h * out_w, kh * kw, x.shape[1]), out_h, out_w


# -- kernels for the executor --------------------------------------------------------------------
def weight_risk(params) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per group of a Conv (one for a Gemm/MatMul): the weight as [K, N] in the kernel's K order
    and its ``risky_pairs``. Empty for a depthwise conv, whose kernels are exact."""
    if isinstance(params, MatMulParams):
        return [(params.weight, risky_pairs(params.weight))]
    c_out, c_g = params.weight.shape[:2]
    if c_g == 1 and c_out == params.group:
        return []
    return [(w_k, risky_pairs(w_k)) for w_k in conv_weight_k(params.weight, params.group)]


@dataclass(frozen=True)
class PairSaturating:
    """An integer Conv / Gemm / MatMul (constant weight) step as onnxruntime computes it on AVX2:
    the kernel's exact scanned path (``run_scanned``) with ``saturation_loss`` added to its
    accumulator. ``offset``: raw byte minus q (128 for an int8 activation, 0 for uint8);
    ``risk``: ``weight_risk`` of the step's parameters, found at setup."""

    offset: int
    risk: list
    takes_table = False
    clamps_below_zero = False  # as the Conv / Gemm / MatMul it stands in for (IntegerOp's attributes)
    op_type = "PairSaturating"

    def elementwise(self, params) -> bool:
        return False

    def specialize(self, params, shapes):
        return params

    def run(self, p, x: np.ndarray) -> np.ndarray:
        if isinstance(p, ConvParams) and p.rank == 1:  # [N, C, L] as [N, C, 1, L]
            return self.run(p, x[:, :, None, :])[:, :, 0, :]
        if isinstance(p, ConvParams):
            return conv_run_scanned(p, x, functools.partial(self._conv_loss, p))
        return matmul_run_scanned(p, x, self._matmul_loss)

    def _conv_loss(self, p: ConvParams, x: np.ndarray) -> np.ndarray:
        """int64 [n, C_out, out_h·out_w]: what saturation takes from each output's sum."""
        c_out, c_g = p.weight.shape[:2]
        rows, out_h, out_w = _conv_rows(x.astype(np.int64) + self.offset, p, p.zero_in + self.offset)
        n, per = x.shape[0], c_out // p.group
        loss = np.zeros((n, c_out, out_h * out_w), np.int64)
        for g, (w_k, risky) in enumerate(self.risk):
            if risky.any():
                a = rows[:, :, :, g * c_g:(g + 1) * c_g].reshape(-1, w_k.shape[0])
                loss[:, g * per:(g + 1) * per] = saturation_loss(a, w_k, risky).reshape(n, -1, per) \
                    .transpose(0, 2, 1)
        return loss

    def _matmul_loss(self, x: np.ndarray) -> np.ndarray:
        (w_k, risky), = self.risk
        rows = x.reshape(-1, w_k.shape[0]).astype(np.int64) + self.offset
        return saturation_loss(rows, w_k, risky).reshape(*x.shape[:-1], -1)


@dataclass(frozen=True)
class SaturatingMatMulInteger:
    """A MatMulInteger with a constant int8 B and a uint8 A (onnxruntime's ``quantize_dynamic``
    models) as onnxruntime computes its int32 output on AVX2: the exact sums plus
    ``saturation_loss`` of the raw bytes (zero points are applied after the pairs, exactly).
    ConvInteger is not emulated: measured on this kind of CPU, onnxruntime's ConvInteger gave the
    exact sums."""

    risk: tuple  # (B as [K, N], its risky_pairs)
    takes_table = False
    clamps_below_zero = False
    op_type = "PairSaturating"

    def elementwise(self, params) -> bool:
        return False

    def specialize(self, params, shapes):
        return params

    def run(self, p: MatMulIntegerParams, a: np.ndarray, b: np.ndarray, *zeros: np.ndarray) -> np.ndarray:
        exact = MatMulInteger().run(p, a, b, *zeros)
        w_k, risky = self.risk
        loss = saturation_loss(a.reshape(-1, w_k.shape[0]).astype(np.int64), w_k, risky)
        return (exact.astype(np.int64) + loss.reshape(*a.shape[:-1], -1)).astype(np.int32)


def is_volume(params) -> bool:
    """A 3-D Conv: its products are not emulated (the order in which onnxruntime's AVX2 kernel
    pairs them is known for 1-D and 2-D convolutions only)."""
    return isinstance(params, ConvParams) and params.rank == 3


# -- which steps onnxruntime runs that way ------------------------------------------------------
def stored_types(executor, node: onnx.NodeProto) -> tuple[str | None, str | None]:
    """(activation type, weight type) as stored in the model for a Conv/Gemm/MatMul QDQ group or
    a QLinearConv / QLinearMatMul / QGemm node; None where not an 8-bit constant-weight product."""
    constants, dtypes = executor.constants, executor.lowering.dtypes
    if node.op_type in ("Conv", "Gemm", "MatMul"):
        dq_x, dq_w = (executor.producer.get(name) for name in node.input[:2])
        if dq_x is None or dq_w is None or dq_x.op_type != "DequantizeLinear" \
                or dq_w.op_type != "DequantizeLinear" or dq_w.input[0] not in constants:
            return None, None
        return dtypes.get(dq_x.input[0]), str(constants[dq_w.input[0]].dtype)
    weight_index = {"QLinearConv": 3, "QLinearMatMul": 3, "QGemm": 3}.get(node.op_type)
    if weight_index is None or node.input[weight_index] not in constants:
        return None, None
    return dtypes.get(node.input[0]), str(constants[node.input[weight_index]].dtype)


def saturating(node: onnx.NodeProto, activation: str | None, weight: str | None) -> int | None:
    """The raw-byte offset of a step onnxruntime runs as u8 x s8 on AVX2, else None. In QDQ form
    int8 activations are moved to uint8 (+128) before fusing; a QOperator node with int8
    activations runs s8 x s8, which is exact."""
    if weight != "int8" or activation not in ("int8", "uint8"):
        return None
    if node.op_type.startswith("Q"):
        return 0 if activation == "uint8" else None
    return 128 if activation == "int8" else 0


def saturating_integer_steps(executor):
    """MatMulInteger steps of ``executor`` with a uint8 A and a constant int8 2-D B: the u8 x s8
    GEMM of onnxruntime's dynamically quantized models."""
    for step in executor.steps:
        if step.kind != "integer" or not isinstance(step.params, MatMulIntegerParams):
            continue
        a, b = step.node.input[0], step.node.input[1]
        weight = executor.constants.get(b)
        if weight is not None and weight.dtype == np.int8 and weight.ndim == 2 \
                and executor.lowering.dtypes.get(a) == "uint8":
            yield step, weight


def saturating_steps(executor):
    """(step, raw offset) for each integer step of ``executor`` that onnxruntime runs as u8 x s8."""
    for step in executor.steps:
        if step.kind != "integer" or step.node.op_type not in EMULATED \
                or not isinstance(step.params, (ConvParams, MatMulParams)):
            continue
        offset = saturating(step.node, *stored_types(executor, step.node))
        if offset is not None:
            yield step, offset


@dataclass(frozen=True)
class Hazard:
    """A layer whose u8 x s8 pairs can leave int16: ``channels`` of ``of`` output channels have at
    least one such pair; ``pairs`` of ``total`` (pair, channel) combinations can."""

    node: str
    op_type: str
    channels: int
    of: int
    pairs: int
    total: int
    # False for a 3-D Conv, whose K order in onnxruntime's kernel is not known here: any two
    # same-sign weights of a channel count as a possible pair, and pairs/total count channels
    order_known: bool = True

    def to_dict(self) -> dict:
        found = {"node": self.node, "op_type": self.op_type, "channels_at_risk": self.channels,
                 "channels": self.of, "pairs_at_risk": self.pairs, "pairs": self.total}
        if not self.order_known:
            found["pair_order"] = "unknown (3-D Conv): any two weights of a channel may pair"
        return found


def any_pair_risk(weight: np.ndarray) -> np.ndarray:
    """bool [C_out]: some two same-sign weights of the output channel could saturate as a u8 x s8
    pair, whatever order the kernel reads them in (a bound for a conv whose order is unknown)."""
    w = weight.reshape(weight.shape[0], -1).astype(np.int64)
    top = [np.sort(np.where(sign * w > 0, sign * w, 0), axis=1)[:, -2:].sum(axis=1) for sign in (1, -1)]
    return RAW_MAX * np.maximum(*top) > INT16_MAX


def hazards(executor) -> list[Hazard]:
    """The layers of a model that can saturate in onnxruntime on an x86 CPU without VNNI: worst
    case over adjacent K pairs of ``255·(|w0| + |w1|)``, the activation as the uint8 byte
    onnxruntime multiplies."""
    found = []
    for step, _ in saturating_steps(executor):
        if is_volume(step.params):
            risky = any_pair_risk(step.params.weight)
            if risky.any():
                found.append(Hazard(step.node.name, step.node.op_type, int(risky.sum()), risky.size,
                                    int(risky.sum()), risky.size, order_known=False))
            continue
        risk = weight_risk(step.params)
        if not risk:
            continue
        risky = np.concatenate([r for _, r in risk], axis=1)
        if risky.any():
            found.append(Hazard(step.node.name, step.node.op_type, int(risky.any(axis=0).sum()),
                                risky.shape[1], int(risky.sum()), risky.size))
    return found


def hazard_summary(found: list[dict], layers: int) -> str:
    """What quantize warns and verify reports of the ``found`` hazards (``Hazard.to_dict()``)
    among ``layers`` Conv/Gemm/MatMul layers."""
    shown = ", ".join(f"{h['node']} ({h['channels_at_risk']}/{h['channels']} channels)" for h in found[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return (f"{len(found)} of {layers} Conv/Gemm/MatMul layers can saturate in onnxruntime on x86 CPUs "
            f"without VNNI (u8 x s8 pairs beyond int16): {shown}{more}; --target portable avoids it")


# -- the host ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def cpu_flags() -> dict[str, bool]:
    """This CPU's relevant features, read from CPUID through numpy's dispatch table."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # numpy < 2
        from numpy.core._multiarray_umath import __cpu_features__ as features
    return {name: bool(features.get(key, False)) for name, key in
            (("avx2", "AVX2"), ("avx512bw", "AVX512BW"), ("avx512_vnni", "AVX512VNNI"),
             ("asimddp", "ASIMDDP"))}


@functools.lru_cache(maxsize=None)
def ort_saturates() -> bool:
    """Whether this machine's onnxruntime adds u8 x s8 pairs in int16 with saturation: one
    MatMulInteger whose exact answer (2·255·127 per pair of K) is outside int16. A probe rather
    than the flags alone, since AVX-VNNI (without AVX-512) is not among numpy's features."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])],
        [numpy_helper.from_array(np.full((4, 1), 127, np.int8), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    y = session.run(None, {"a": np.full((1, 4), 255, np.uint8)})[0]
    return int(y.reshape(-1)[0]) != 4 * 255 * 127


def host_arithmetic() -> str:
    """The arithmetic this machine's onnxruntime uses for u8 x s8 products."""
    return "x86-avx2" if ort_saturates() else "exact"


def describe_host() -> str:
    flags = cpu_flags()
    shown = ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in flags.items())
    how = ("adds u8 x s8 pairs in int16 with saturation" if ort_saturates()
           else "accumulates u8 x s8 products exactly")
    return f"this CPU ({shown}): onnxruntime {how}"
