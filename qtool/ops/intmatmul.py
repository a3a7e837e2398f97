"""Exact integer matrix product on a float BLAS.

Every partial sum of a float dot product is an integer, and exact, while the sum of |products|
stays below the mantissa (2**24 for float32, 2**53 for float64), whatever order the BLAS adds in.
``int_matmul`` bounds that sum by ``K * max|a| * max|b|``: below 2**24 it runs one float32 product
(int8 x int8 up to K = 1032); otherwise float64, splitting K into chunks that each stay below
2**53 and adding the chunks in int64.
"""

from __future__ import annotations

import numpy as np

FLOAT32_EXACT = 2**24
FLOAT64_EXACT = 2**53


def k_chunk(max_abs_a: int, max_abs_b: int, mantissa_limit: int = FLOAT64_EXACT) -> int:
    """Largest K whose worst-case sum of |products| stays below ``mantissa_limit``."""
    per_product = max(int(max_abs_a) * int(max_abs_b), 1)
    return max((mantissa_limit - 1) // per_product, 1)


def exact_float_type(k: int, max_abs_a: int, max_abs_b: int) -> type:
    """float32 when a K-long dot product of such operands is exact in it, else float64."""
    return np.float32 if k <= k_chunk(max_abs_a, max_abs_b, FLOAT32_EXACT) else np.float64


def int_matmul(a: np.ndarray, b: np.ndarray, mantissa_limit: int | None = None) -> np.ndarray:
    """``a @ b`` for integer arrays, exact, as int64 (numpy matmul broadcasting).

    ``mantissa_limit`` forces the float64 path with K split at that bound (tests use it to
    exercise the split with small K)."""
    if a.dtype.kind not in "iu" or b.dtype.kind not in "iu":
        raise TypeError(f"int_matmul expects integers, got {a.dtype} and {b.dtype}")
    k = a.shape[-1]
    max_a = int(max(-int(a.min(initial=0)), int(a.max(initial=0))))
    max_b = int(max(-int(b.min(initial=0)), int(b.max(initial=0))))
    if mantissa_limit is None and exact_float_type(k, max_a, max_b) is np.float32:
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(np.int64)
    chunk = k_chunk(max_a, max_b, mantissa_limit or FLOAT64_EXACT)
    fa, fb = a.astype(np.float64), b.astype(np.float64)
    if k <= chunk:
        return (fa @ fb).astype(np.int64)
    total = None
    for start in range(0, k, chunk):
        part = (fa[..., start:start + chunk] @ fb[..., start:start + chunk, :]).astype(np.int64)
        total = part if total is None else total + part
    return total
