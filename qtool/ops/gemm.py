"""Gemm and MatMul.

With a constant B: Conv's derivation with the output channel on the last axis (per-channel B).
MatMul activation x activation (attention's Q.K^T and attn.V, batched with numpy/ONNX broadcasting),
both per tensor: ``acc = sum (q_a - Z_a)(q_b - Z_b)`` exactly (``int_matmul`` on the zero-point
shifted operands, 9-bit values), then one requantization with ``M / 2**rshift = S_a * S_b / S_y``
and ``+ Z_y``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..fixedpoint import Requant, int_range, narrowed, offset_requant, quantize_multipliers, requantize, saturate
from . import (Bias, IntegerOp, NodeView, Unsupported, Weight, check_integer, node_attrs, parallel,
               per_tensor, plan_for, register)
from .conv import (INPUT_MAX, Tail, accumulator_bias, check_int32, fitted_requant,
                   weight_scales)
from .intmatmul import FLOAT32_EXACT, FLOAT64_EXACT, int_matmul


@dataclass(frozen=True)
class MatMulParams:
    weight: np.ndarray  # int8 [K, N]
    bias: np.ndarray  # int64 [N], zero-point compensated
    requant: Requant  # per output column
    zero_out: int
    rounding: str
    dtype: str


def _derive(view: NodeView, weight_axis: int, bias_index: int | None) -> MatMulParams:
    x = per_tensor(view.inputs[0].qparams, f"{view.node.op_type} input A")
    y = per_tensor(view.output, f"{view.node.op_type} output")
    weight = view.inputs[1].value
    if weight is None or weight.ndim != 2:
        raise Unsupported("B must be a 2-D constant")
    channels = weight.shape[weight_axis]
    channel_scale = x.scale * weight_scales(view, 1, channels, weight_axis)
    bias = accumulator_bias(view, bias_index, weight, weight_axis, channel_scale, x.zero_point)
    return MatMulParams(
        weight=weight if weight_axis == 1 else weight.T,
        bias=bias,
        requant=fitted_requant(channel_scale / y.scale, view, weight, weight_axis, bias, x),
        zero_out=y.zero_point,
        rounding=view.rounding,
        dtype=y.dtype,
    )


def _run(p: "MatMulParams | MatMulPlan", x: np.ndarray) -> np.ndarray:
    params, plan = plan_for(p, x, MatMulPlan)
    tail = plan.tails.get(x.dtype)
    split = tail is None and x.dtype == np.int16 and plan.split16 is not None
    if split:
        tail = plan.split16
    if tail is None or (split and tail.unproven.size):
        # columns whose int16 sums may leave int32: the exact path, whose ``requantize`` raises
        # only where their multiplier was not narrowed for 64-bit sums
        return run_scanned(params, x)
    k, n = params.weight.shape
    flat = x.reshape(-1, k)
    # an int16 input by int8 weights in float64, exact (every partial sum an integer below 2**53):
    # one product, where its two byte halves in float32 took two and a join in int64 (PP-OCRv4
    # rec's classifier, [320, 480] by [480, 6625]: 55.9 -> 44.7 ms)
    kind = np.float64 if split else np.float32
    flat = flat.astype(kind)
    # B in float for this call only: a copy kept per plan was 4x the int8 weights for as long
    # as the executor lived (a ViT-S: 89 MB beside its 24 MB), and converting costs about 1/M of
    # the product (M the rows of A)
    weight = params.weight.astype(kind)
    out = np.empty((flat.shape[0], n), dtype=params.dtype)

    def part(start: int, stop: int) -> None:
        acc = np.matmul(flat[start:stop], weight)
        if tail.unproven.size:
            check_int32(acc[:, tail.unproven], params.bias[tail.unproven])
        tail.requant(acc, out=out[start:stop])

    parallel.run_parts(part, plan.row_parts)
    return out.reshape(*x.shape[:-1], n)


def run_scanned(p: MatMulParams, x: np.ndarray, extra=None) -> np.ndarray:
    """Exact products (``int_matmul``) and ``requantize``, which scans for overflow. ``extra(x)``,
    if given, returns int64 [..., N] added to the accumulator (qtool/targets/x86.py)."""
    acc = int_matmul(x, p.weight)
    if extra is not None:
        acc = acc + extra(x)
    acc = acc + p.bias
    y = requantize(acc, p.requant.multiplier, p.requant.rshift, p.rounding)
    return saturate(y + p.zero_out, p.dtype)


@dataclass(frozen=True)
class MatMulPlan:
    """A constant-B MatMul or Gemm for one input shape: per input type the tail
    where B proves float32 exact and the accumulator in range, as ``ConvPlan`` does: output column
    j sums ``q_x * q_w`` whose absolute values add up to at most ``l1_j * max|q_x|`` (``l1_j``
    the column's ``sum |q_w|``). Rows of A are computed in ranges on the cores."""

    params: MatMulParams
    in_shape: tuple[int, ...]
    tails: dict  # input np.dtype -> conv.Tail, per output column
    row_parts: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, p: MatMulParams, shape: tuple[int, ...]) -> "MatMulPlan":
        k, n = p.weight.shape
        if not shape or shape[-1] != k:
            raise ValueError(f"{shape} @ {p.weight.shape}: inner dimensions differ")
        l1 = np.abs(p.weight.astype(np.int64)).sum(axis=0)
        tails = {}
        for dtype, x_max in INPUT_MAX.items():
            if int(l1.max(initial=0)) * x_max >= FLOAT32_EXACT:
                continue
            fused = offset_requant(p.bias, p.requant, p.zero_out, p.dtype, p.rounding, l1 * x_max)
            if fused is not None:
                tails[dtype] = Tail.of(fused)
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        return cls(p, tuple(shape), tails, parallel.ranges(rows, rows * n))

    @functools.cached_property
    def split16(self) -> "Tail | None":
        """For int16 inputs (made on the first one): the tail after their product in float64
        (``_run``), proven for every int16 input; None where a column's ``l1 * 32768`` reaches
        2**53 (the product would not be exact in float64)."""
        p = self.params
        l1 = np.abs(p.weight.astype(np.int64)).sum(axis=0)
        if int(l1.max(initial=0)) * 32768 >= FLOAT64_EXACT:
            return None
        fused = offset_requant(p.bias, p.requant, p.zero_out, p.dtype, p.rounding, l1 * 32768)
        return None if fused is None else Tail.of(fused)


@register
class Gemm(IntegerOp):
    op_type = "Gemm"

    def constants(self, node):
        axis = 0 if node_attrs(node).get("transB", 0) else 1
        return {1: Weight(axis=axis), 2: Bias(activation=0, weight=1)}

    def check(self, node, attrs):
        if attrs.get("transA", 0):
            raise Unsupported("transA=1 is not supported")
        if attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            raise Unsupported("alpha and beta must be 1")

    def derive(self, view):
        self.check(view.node, view.attrs)
        return _derive(view, 0 if view.attr("transB", 0) else 1, 2)

    def specialize(self, p, shapes):
        return MatMulPlan.of(p, tuple(shapes[0]))

    def run(self, p, x):
        if x.ndim != 2:
            raise ValueError(f"Gemm input must be 2-D, got shape {x.shape}")
        return _run(p, x)


@dataclass(frozen=True)
class ActMatMulParams:
    """MatMul of two activations, both per tensor."""

    zero_a: int
    zero_b: int
    requant: Requant  # S_a * S_b / S_y
    zero_out: int
    rounding: str
    dtype: str


def _derive_activations(view: NodeView) -> ActMatMulParams:
    a = per_tensor(view.inputs[0].qparams, "MatMul input A")
    b = per_tensor(view.inputs[1].qparams, "MatMul input B")
    y = per_tensor(view.output, "MatMul output")
    requant = quantize_multipliers(np.float64(a.scale) * np.float64(b.scale) / y.scale,
                                   view.multiplier_bits)
    return ActMatMulParams(a.zero_point, b.zero_point, requant, y.zero_point, view.rounding, y.dtype)


def _run_activations(p: ActMatMulParams, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    check_integer(a, b)
    acc = int_matmul(a.astype(np.int32) - p.zero_a, b.astype(np.int32) - p.zero_b)
    requant = accumulator_requant(p, a.dtype, b.dtype, a.shape[-1])
    y = requantize(acc, requant.multiplier, requant.rshift, p.rounding)
    return saturate(y + p.zero_out, p.dtype)


def accumulator_requant(p: ActMatMulParams, a_type, b_type, k: int) -> Requant:
    """The multiplier for a K-long product of these operand types: the 32-bit one where the sum
    fits int32 (8-bit operands up to K ~ 33000), else narrowed for ``K * max|a - Z_a| *
    max|b - Z_b|`` (16-bit operands, attention's Q.K^T at int16: an int64 accumulator). It depends
    on the shapes only, never on the values."""
    a_max = max(abs(int(v) - p.zero_a) for v in int_range(np.dtype(a_type).name))
    b_max = max(abs(int(v) - p.zero_b) for v in int_range(np.dtype(b_type).name))
    return narrowed(p.requant, int(k) * a_max * b_max)


@register
class MatMul(IntegerOp):
    op_type = "MatMul"

    def constants(self, node):
        # B is a per-channel weight when it is a constant, a per-tensor activation otherwise
        return {1: Weight(axis=1, optional=True)}

    def derive(self, view):
        b = view.inputs[1]
        if b is not None and b.value is None:
            return _derive_activations(view)
        return _derive(view, 1, bias_index=None)

    def specialize(self, p, shapes):
        return MatMulPlan.of(p, tuple(shapes[0])) if isinstance(p, MatMulParams) else p

    def run(self, p, x, *b):
        if isinstance(p, ActMatMulParams):
            if len(b) != 1:
                raise ValueError("MatMul of two activations needs both operands")
            return _run_activations(p, x, b[0])
        return _run(p, x)
