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

from ..fixedpoint import requantize, saturate
from ..ops.conv import ConvParams, conv_accumulate
from ..ops.gemm import MatMulParams
from ..ops.intmatmul import int_matmul

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
@dataclass(frozen=True)
class PairSaturating:
    """An integer Conv / Gemm / MatMul (constant weight) step as onnxruntime computes it on AVX2:
    the exact accumulator plus ``saturation_loss``, then the kernel's own requantization.
    ``offset``: raw byte minus q (128 for an int8 activation, 0 for uint8)."""

    op: object
    offset: int
    takes_table = False
    op_type = "PairSaturating"

    def elementwise(self, params) -> bool:
        return False

    def specialize(self, params, shapes):
        return params

    def run(self, p, x: np.ndarray) -> np.ndarray:
        if isinstance(p, ConvParams):
            return self._conv(p, x)
        return self._matmul(p, x)

    def _conv(self, p: ConvParams, x: np.ndarray) -> np.ndarray:
        n, c_out = x.shape[0], p.weight.shape[0]
        top, left, bottom, right = p.pads
        padded = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=p.zero_in)
        acc, out_h, out_w = conv_accumulate(padded, p.weight, p.group, p.strides, p.dilations)
        c_g = p.weight.shape[1]
        if not (c_g == 1 and c_out == p.group):  # depthwise kernels widen to int16 first: exact
            rows, _, _ = _conv_rows(x.astype(np.int64) + self.offset, p, p.zero_in + self.offset)
            per = c_out // p.group
            for g, (w_k, risky) in enumerate(_conv_risk(p.weight, p.group)):
                if not risky.any():
                    continue
                a = rows[:, :, :, g * c_g:(g + 1) * c_g].reshape(-1, w_k.shape[0])
                loss = saturation_loss(a, w_k, risky).reshape(n, -1, per)
                acc[:, g * per:(g + 1) * per] += loss.transpose(0, 2, 1)
        acc = acc + p.bias[None, :, None]
        y = requantize(acc, p.requant.multiplier[None, :, None], p.requant.rshift[None, :, None], p.rounding)
        return saturate(y + p.zero_out, p.dtype).reshape(n, c_out, out_h, out_w)

    def _matmul(self, p: MatMulParams, x: np.ndarray) -> np.ndarray:
        k = p.weight.shape[0]
        rows = x.reshape(-1, k)
        acc = int_matmul(rows, p.weight) + p.bias
        risky = _matmul_risk(p.weight)
        if risky.any():
            acc = acc + saturation_loss(rows.astype(np.int64) + self.offset, p.weight, risky)
        y = requantize(acc, p.requant.multiplier, p.requant.rshift, p.rounding)
        return saturate(y + p.zero_out, p.dtype).reshape(*x.shape[:-1], -1)


def _conv_risk(weight: np.ndarray, group: int):
    return _cached_risk(weight, group)


def _matmul_risk(weight: np.ndarray) -> np.ndarray:
    return _cached_risk(weight, 0)


_RISK_CACHE: dict[tuple[int, int], tuple[np.ndarray, object]] = {}


def _cached_risk(weight: np.ndarray, group: int):
    """Risky pairs per weight array (kept alive with it), computed once."""
    key = (id(weight), group)
    hit = _RISK_CACHE.get(key)
    if hit is not None and hit[0] is weight:
        return hit[1]
    if group:
        value = [(w_k, risky_pairs(w_k)) for w_k in conv_weight_k(weight, group)]
    else:
        value = risky_pairs(weight)
    _RISK_CACHE[key] = (weight, value)
    return value


# -- which steps onnxruntime runs that way ------------------------------------------------------
def stored_types(model: onnx.ModelProto, node: onnx.NodeProto, constants: dict, dtypes: dict
                 ) -> tuple[str | None, str | None]:
    """(activation type, weight type) as stored in the model for a Conv/Gemm/MatMul QDQ group or
    a QLinearConv / QLinearMatMul / QGemm node; None where not an 8-bit constant-weight product."""
    producer = {o: n for n in model.graph.node for o in n.output}
    if node.op_type in ("Conv", "Gemm", "MatMul"):
        dq_x, dq_w = (producer.get(name) for name in node.input[:2])
        if dq_x is None or dq_w is None or "DequantizeLinear" not in (dq_x.op_type, dq_w.op_type) \
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


def saturating_steps(executor):
    """(step, raw offset) for each integer step of ``executor`` that onnxruntime runs as u8 x s8."""
    for step in executor.steps:
        if step.kind != "integer" or step.node.op_type not in EMULATED \
                or not isinstance(step.params, (ConvParams, MatMulParams)):
            continue
        activation, weight = stored_types(executor.model, step.node, executor.constants,
                                          executor.lowering.dtypes)
        offset = saturating(step.node, activation, weight)
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

    def to_dict(self) -> dict:
        return {"node": self.node, "op_type": self.op_type, "channels_at_risk": self.channels,
                "channels": self.of, "pairs_at_risk": self.pairs, "pairs": self.total}


def hazards(executor) -> list[Hazard]:
    """The layers of a model that can saturate in onnxruntime on an x86 CPU without VNNI: worst
    case over adjacent K pairs of ``255·(|w0| + |w1|)``, the activation as the uint8 byte
    onnxruntime multiplies."""
    found = []
    for step, _ in saturating_steps(executor):
        p = step.params
        if isinstance(p, ConvParams):
            c_out = p.weight.shape[0]
            if p.weight.shape[1] == 1 and c_out == p.group:
                continue
            risky = np.concatenate([r for _, r in _conv_risk(p.weight, p.group)], axis=1)
        else:
            risky = _matmul_risk(p.weight)
        if risky.any():
            found.append(Hazard(step.node.name, step.node.op_type, int(risky.any(axis=0).sum()),
                                risky.shape[1], int(risky.sum()), risky.size))
    return found


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
