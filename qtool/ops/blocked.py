"""MatMul and Gemm with blockwise-quantized weights (int4 or int8 in blocks along K).

A weight ``W [K, N]`` stored in blocks of ``block`` rows (``DequantizeLinear`` with ``block_size``,
opset 21) has a scale per block and column, ``S_w[b, n]``. With the input per tensor,

    y[n] / S_y = sum_b (S_x S_w[b, n] / S_y) * P[b, n],   P[b, n] = sum_{k in b} (q_x[k] - Z_x) q_w[k, n]

Each block's partial sum ``P`` is exact (``int_matmul``); the block ratios of a column share one
right shift, that of the column's largest ratio, each a multiplier ``m[b, n] = round(ratio * 2**r_n)``
(31 bits for the largest). So

    q_y[n] = Z_y + rounding_rshift(sum_b m[b, n] P[b, n] + c[n], r_n)

in int64, with the bias (Gemm's C, int32 at its own scale ``S_c``) at the same fixed point,
``c[n] = round(q_c[n] * S_c[n] / S_y * 2**r_n)``. Setup checks that the sum cannot leave int64
for any input of its type, narrowing the shifts where it could (an int16 input over a long K).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..fixedpoint import bit_length, int_range, rounding_rshift, saturate
from ..qparams import QParams
from . import IntegerOp, Unsupported, check_integer
from .intmatmul import int_matmul

# the multiplier of a column's largest block ratio: 31 bits, as the other kernels' (fixedpoint)
MULTIPLIER_BITS = 31


@dataclass(frozen=True)
class BlockedParams:
    weight: np.ndarray  # int8 [B, block, N]: the weight's integers, K padded with zeros to B * block
    k: int  # the weight's K before padding
    multipliers: np.ndarray  # int64 [B, N]
    offset: np.ndarray  # int64 [N]: the bias at the same fixed point (0 without one)
    rshift: np.ndarray  # int64 [N]
    zero_x: int
    zero_out: int
    rounding: str
    dtype: str


def derive(x: QParams, weight: np.ndarray, scales: np.ndarray, block: int, y: QParams, rounding: str,
           bias: np.ndarray | None = None, bias_scale: np.ndarray | None = None) -> BlockedParams:
    """``weight`` int [K, N] (integer values of any width up to 8 bits), ``scales`` [B, N] (blocks of
    ``block`` rows along K, the last one possibly short); ``x`` and ``y`` per tensor; ``bias`` int
    [N] at ``bias_scale`` (one or [N])."""
    if x.axis is not None or y.axis is not None:
        raise Unsupported("a blocked weight's input and output must be quantized per tensor")
    k, n = weight.shape
    blocks = -(-k // block)
    if scales.shape != (blocks, n):
        raise Unsupported(f"blocked scales of shape {list(scales.shape)} for a [{k}, {n}] weight in "
                          f"blocks of {block}")
    ratio = np.float64(x.scale) * scales.astype(np.float64) / np.float64(y.scale)
    if not np.all(np.isfinite(ratio)) or np.any(ratio < 0):
        raise Unsupported("blocked scales must be finite and not negative")
    top = np.maximum(ratio.max(axis=0), np.finfo(np.float64).tiny)
    # 2**r * top lies in [2**30, 2**31): the largest multiplier has 31 bits
    rshift = np.array([MULTIPLIER_BITS - math.frexp(t)[1] for t in top], dtype=np.int64)
    # what one column's sum can reach, for any input of its type: narrow the shift until it fits
    lo, hi = int_range(x.dtype)
    reach_x = max(abs(lo - int(x.zero_point)), abs(hi - int(x.zero_point)))
    reach = np.abs(weight.astype(np.int64)).sum(axis=0) * reach_x  # per column, sum over K
    bias_fixed = np.zeros(n, dtype=np.float64)
    if bias is not None:
        bias_fixed = bias.astype(np.float64).reshape(-1) * np.asarray(bias_scale, np.float64) / np.float64(y.scale)
    cut = np.maximum(bit_length(reach) + MULTIPLIER_BITS + 1 - 62, 0)
    bias_bits = np.array([0 if b == 0 else math.frexp(abs(b))[1] for b in bias_fixed], dtype=np.int64)
    cut = np.maximum(cut, bias_bits + rshift - 61)
    rshift = rshift - cut
    scale = np.ldexp(1.0, rshift.astype(np.int32))
    multipliers = np.rint(ratio * scale).astype(np.int64)
    offset = np.rint(bias_fixed * scale).astype(np.int64)
    padded = np.zeros((blocks * block, n), dtype=np.int8)
    padded[:k] = weight
    return BlockedParams(padded.reshape(blocks, block, n), k, multipliers, offset, rshift,
                         int(x.zero_point), int(y.zero_point), rounding, y.dtype)


def run(p: BlockedParams, x: np.ndarray) -> np.ndarray:
    check_integer(x)
    if x.shape[-1] != p.k:
        raise ValueError(f"operands could not be broadcast: input {list(x.shape)} for a weight of K = {p.k}")
    blocks, block, n = p.weight.shape
    rows = x.reshape(-1, p.k).astype(np.int32) - np.int32(p.zero_x)
    shifted = np.zeros((rows.shape[0], blocks * block), dtype=np.int32)
    shifted[:, :p.k] = rows
    # each block's exact partial sums [R, N], weighted by its multipliers, one block at a time
    acc = np.broadcast_to(p.offset, (rows.shape[0], n)).copy()
    for b in range(blocks):
        acc += int_matmul(shifted[:, b * block:(b + 1) * block], p.weight[b]) * p.multipliers[b]
    y = rounding_rshift(acc, p.rshift, p.rounding) + p.zero_out
    return saturate(y, p.dtype).reshape(*x.shape[:-1], n)


class BlockedMatMul(IntegerOp):
    """The integer step of a MatMul/Gemm whose B is blocked (lowered by the executor itself, not in
    ``REGISTRY``: quantize writes the standard ops, DequantizeLinear with ``block_size``)."""

    op_type = "MatMul"

    def derive(self, view):  # the executor derives the parameters itself (``derive`` above)
        raise Unsupported("a blocked weight is lowered by the executor")

    def run(self, p: BlockedParams, x: np.ndarray) -> np.ndarray:
        return run(p, x)
