"""Compiled integer loops (numba), for the executor's hottest integer step: requantization.

``OffsetRequant`` in numpy makes six passes over int64 arrays (cast, multiply, add, shift, clip,
cast back), and numpy's int64 multiply has no vector instruction on AVX2 machines: on PP-OCRv4 it
costs as much as the convolutions themselves. The same integer arithmetic as one compiled loop
reads each float32 sum once and writes its int8 once, ten to twenty times faster.

The loop computes exactly ``OffsetRequant``'s integers (``min(max(((x * M + offset) >> r) +
Z_y, lo), hi)`` in int64, with ``x`` the integer-valued float32 sum), so the results are
bit-identical; ``tests/test_compiled.py`` checks it against the numpy form on random and extreme
sums. numba is optional (``pip install 'qtool[fast]'``): without it, or with ``ENABLED`` off,
``requantizer`` returns the numpy form. The first use compiles the loop (about a second; numba
caches it on disk for later runs).
"""

from __future__ import annotations

import numpy as np

ENABLED = True

_kernel = None  # the compiled loop once built; False when numba is not installed


def _build():
    global _kernel
    if _kernel is None:
        try:
            import numba
        except ImportError:
            _kernel = False
            return _kernel

        @numba.njit(nogil=True, cache=True)
        def requantize4(acc, start, stop, multiplier, offset, rshift, zero, lo, hi, out):  # pragma: no cover
            n, channels, _, cols = acc.shape
            for b in range(n):
                for c in range(channels):
                    m, o, r = multiplier[c], offset[c], rshift[c]
                    for i in range(start, stop):
                        for j in range(cols):
                            v = ((np.int64(acc[b, c, i, j]) * m + o) >> r) + zero
                            out[b, c, i, j] = min(max(v, lo), hi)

        _kernel = requantize4
    return _kernel


def available() -> bool:
    return ENABLED and bool(_build())


class CompiledRequant:
    """``OffsetRequant`` as one compiled loop over [n, C, H, W] sums, channels on axis 1 (a
    MatMul's [rows, N] runs as [rows, N, 1, 1]); other shapes go to the numpy form."""

    def __init__(self, exact):
        self.exact = exact
        shape = np.broadcast(exact.multiplier, exact.offset, exact.rshift).shape
        self.multiplier, self.offset, self.rshift = (
            np.ascontiguousarray(np.broadcast_to(np.asarray(v, dtype=np.int64), shape).reshape(-1))
            for v in (exact.multiplier, exact.offset, exact.rshift))
        from ..fixedpoint import int_range

        self.lo, self.hi = int_range(exact.dtype)

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = np.empty(x.shape, dtype=self.exact.dtype)
        acc, target = x, out
        if x.ndim == 2:  # a MatMul's [rows, N]: one channel per column
            acc, target = x[:, :, None, None], out[:, :, None, None]
        if acc.ndim != 4 or acc.shape[1] != self.multiplier.size or x.dtype != np.float32:
            return self.exact(x, out=out)
        self.rows(acc, target, 0, acc.shape[2])
        return out

    def rows(self, acc: np.ndarray, out: np.ndarray, start: int, stop: int) -> None:
        """Rows [start, stop) (axis 2) of [n, C, H, W] float32 ``acc`` into ``out``: the loop
        runs fastest on whole C-contiguous arrays, which a kernel splitting rows over threads can
        pass as they are."""
        _kernel(acc, start, stop, self.multiplier, self.offset, self.rshift, self.exact.zero_out, self.lo, self.hi,
                out)


def requantizer(exact):
    """``exact`` (an ``OffsetRequant``) compiled where numba is installed, else ``exact`` itself."""
    return CompiledRequant(exact) if available() else exact
