"""The compiled loop of qtool/verify/compare.py (importing this module needs numba).

One pass over a float reference and the executor's values gives the sums a comparison keeps:
``ref . got``, ``ref . ref``, ``got . got``, ``(ref - got) . (ref - got)`` in float64, and the
largest and smallest ``ref - got``. Each sum is kept as four partial sums (of elements 4k, 4k + 1,
4k + 2 and 4k + 3) added in that order at the end: the order of additions is fixed, so the figures
do not depend on the CPU, and a step makes four independent additions rather than one chain.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload


def _value(got, table, i):  # pragma: no cover (typed by _value_of)
    raise NotImplementedError


@overload(_value, inline="always")
def _value_of(got, table, i):  # pragma: no cover (compiled)
    """Element ``i`` of the executor's values: ``table[byte]`` for bytes, else the value."""
    if isinstance(got.dtype, types.Integer):
        return lambda got, table, i: table[got[i]]
    return lambda got, table, i: np.float64(got[i])


@numba.njit(nogil=True, cache=True, inline="always")
def _add(sums, hi, lo, r, g):  # pragma: no cover (compiled)
    """One element into one set of partial sums (dot, ref_sq, got_sq, err_sq) and the extremes."""
    d = r - g
    sums = (sums[0] + r * g, sums[1] + r * r, sums[2] + g * g, sums[3] + d * d)
    return sums, max(hi, d), min(lo, d)


@numba.njit(nogil=True, cache=True)
def compare(ref, got, table, out):  # pragma: no cover (compiled)
    """``ref`` float32 [n]; ``got`` [n] float32 values, or uint8 bytes each standing for
    ``table[byte]`` (float64 [256]). ``out`` [6] float64 receives dot, ref_sq, got_sq, err_sq,
    max(ref - got) and min(ref - got) (-inf and inf when n = 0)."""
    n = ref.size
    s0 = s1 = s2 = s3 = (0.0, 0.0, 0.0, 0.0)
    hi = -np.inf
    lo = np.inf
    whole = n - n % 4
    for i in range(0, whole, 4):
        s0, hi, lo = _add(s0, hi, lo, np.float64(ref[i]), _value(got, table, i))
        s1, hi, lo = _add(s1, hi, lo, np.float64(ref[i + 1]), _value(got, table, i + 1))
        s2, hi, lo = _add(s2, hi, lo, np.float64(ref[i + 2]), _value(got, table, i + 2))
        s3, hi, lo = _add(s3, hi, lo, np.float64(ref[i + 3]), _value(got, table, i + 3))
    for i in range(whole, n):  # the last n % 4 elements, into the first partial sums
        s0, hi, lo = _add(s0, hi, lo, np.float64(ref[i]), _value(got, table, i))
    for k in range(4):
        out[k] = ((s0[k] + s1[k]) + s2[k]) + s3[k]
    out[4] = hi
    out[5] = lo
