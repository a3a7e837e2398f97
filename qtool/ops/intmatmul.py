"""Exact integer matrix product on a float BLAS.

Every partial sum of a float64 dot product is exact while the sum of |products| stays below 2**53
(the mantissa), whatever order the BLAS adds in. ``int_matmul`` bounds that sum by
``K * max|a| * max|b|`` and splits K into chunks that each stay below it, adding chunks in int64.
"""

from __future__ import annotations

import numpy as np

FLOAT64_EXACT = 2**53


def k_chunk(max_abs_a: int, max_abs_b: int, mantissa_limit: int = FLOAT64_EXACT) -> int:
    """Largest K whose worst-case sum of |products| stays below ``mantissa_limit``."""
    per_product = max(int(max_abs_a) * int(max_abs_b), 1)
    return max((mantissa_limit - 1) // per_product, 1)


def int_matmul(a: np.ndarray, b: np.ndarray, mantissa_limit: int = FLOAT64_EXACT) -> np.ndarray:
    """``a @ b`` for integer arrays, exact, as int64 (numpy matmul broadcasting)."""
    if a.dtype.kind not in "iu" or b.dtype.kind not in "iu":
        raise TypeError(f"int_matmul expects integers, got {a.dtype} and {b.dtype}")
    k = a.shape[-1]
    max_a = int(np.abs(a.astype(np.int64)).max(initial=0))
    max_b = int(np.abs(b.astype(np.int64)).max(initial=0))
    chunk = k_chunk(max_a, max_b, mantissa_limit)
    fa, fb = a.astype(np.float64), b.astype(np.float64)
    if k <= chunk:
        return (fa @ fb).astype(np.int64)
    total = None
    for start in range(0, k, chunk):
        part = (fa[..., start:start + chunk] @ fb[..., start:start + chunk, :]).astype(np.int64)
        total = part if total is None else total + part
    return total
