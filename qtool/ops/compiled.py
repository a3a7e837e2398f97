"""Compiled integer loops (numba), for the executor's hottest integer step: requantization.

``OffsetRequant`` in numpy makes six passes over int64 arrays (cast, multiply, add, shift, clip,
cast back), and numpy's int64 multiply has no vector instruction on AVX2 machines: on PP-OCRv4 it
costs as much as the convolutions themselves. The same integer arithmetic as one compiled loop
reads each float32 sum once (a Conv's border outputs twice) and writes its int8 once, ten to
twenty times faster.

The loop computes exactly ``OffsetRequant``'s integers (``min(max(((x * M + offset) >> r) +
Z_y, lo), hi)`` in int64, with ``x`` the integer-valued float32 sum), so the results are
bit-identical; ``tests/test_fast_kernels.py`` checks it against the numpy form on random and
extreme sums. The loops themselves are in qtool/ops/_loops.py. numba is optional (``pip install
'qtool[fast]'``): without it, or with ``ENABLED`` off, ``requantizer`` returns the numpy form. The
first use compiles the loops (a few seconds; numba caches them on disk for later runs).
"""

from __future__ import annotations

import functools

import numpy as np

from . import parallel

ENABLED = True

_loops = None  # qtool/ops/_loops.py once imported; False when numba is not installed
_NO_BAND = np.zeros((0, 0, 0), dtype=np.float32)


@functools.lru_cache(maxsize=None)
def _no_table(dtype: np.dtype) -> np.ndarray:
    """The empty ``table`` of an output type: no lookup (the loop's argument types stay fixed)."""
    return np.zeros(0, dtype=dtype)


def _build():
    global _loops
    if _loops is None:
        try:
            from . import _loops as loops
        except Exception:  # no numba (ImportError), or numba unable to set up its disk cache
            loops = False
        _loops = loops
    return _loops


def available() -> bool:
    return ENABLED and bool(_build())


def no_border(rows: int, cols: int) -> tuple:
    """``border`` for ``CompiledRequant.rows`` that corrects nothing."""
    return (0, rows, 0, cols, _NO_BAND, _NO_BAND, _NO_BAND, _NO_BAND)


class CompiledRequant:
    """``OffsetRequant`` as one compiled loop over [n, C, H, W] sums, channels on axis 1, or a
    MatMul's [rows, N], one channel per column; other shapes go to the numpy form."""

    def __init__(self, exact):
        self.exact = exact
        shape = np.broadcast(exact.multiplier, exact.offset, exact.rshift).shape
        # where the channels lie: [C, 1, 1] along axis 1 of [n, C, H, W] sums, [N] along the columns
        self.layout = None
        if len(shape) == 3 and shape[1:] == (1, 1):
            self.layout = "rows"
        elif len(shape) == 1:
            self.layout = "columns"
        self.multiplier, self.offset, self.rshift = (
            np.ascontiguousarray(np.broadcast_to(np.asarray(v, dtype=np.int64), shape).reshape(-1))
            for v in (exact.multiplier, exact.offset, exact.rshift))
        from ..fixedpoint import int_range

        self.lo, self.hi = int_range(exact.dtype)

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = np.empty(x.shape, dtype=self.exact.dtype)
        if x.dtype not in (np.float32, np.float64, np.int64) or (x.ndim, self.layout) not in ((2, "columns"), (4, "rows")) \
                or x.shape[1] != self.multiplier.size:
            return self.exact(x, out=out)
        if x.ndim == 2:  # a MatMul's [rows, N]: one channel per column, the loop along the columns
            _loops.requantize_columns(x, self.multiplier, self.offset, self.rshift, self.exact.zero_out,
                                      self.lo, self.hi, out)
        else:
            self.rows(x, out, 0, x.shape[2])
        return out

    def joined(self, high: np.ndarray, low: np.ndarray, extra: np.ndarray, out: np.ndarray | None = None,
               channels: tuple[int, int] | None = None) -> np.ndarray:
        """The levels of [n, C, H, W] sums given in parts, ``256 * high + low + extra`` (float32
        integer-valued ``high`` and ``low``, int64 ``extra`` per channel): an int16 Conv's
        (``conv.ConvPlan.split_sums``), joined in int64 inside the same pass. With ``channels``
        (lo, hi), the parts hold only those output channels, written to ``out[:, lo:hi]``."""
        if self.layout != "rows":
            raise ValueError("these requantization parameters are not one per channel of [n, C, H, W] sums")
        if out is None:
            out = np.empty(high.shape, dtype=self.exact.dtype)
        lo, hi = channels if channels is not None else (0, self.multiplier.size)
        _fits(out, high, lo, hi)
        _loops.requantize_joined(high, low, extra, self.multiplier[lo:hi], self.offset[lo:hi], self.rshift[lo:hi],
                                 self.exact.zero_out, self.lo, self.hi, out, lo)
        return out

    def depthwise(self, x: np.ndarray, weight: np.ndarray, per_input: int, strides, dilations, pads,
                  out: np.ndarray, channels: tuple[int, int]) -> None:
        """Output channels [lo, hi) of a depthwise Conv of ``x`` (zero point 0, padded with 0),
        summed and requantized into ``out`` in one compiled pass (``_loops.depthwise_requantized``;
        ``weight`` float64 [C_out, kh, kw])."""
        if self.layout != "rows":
            raise ValueError("these requantization parameters are not one per channel of [n, C, H, W] sums")
        lo, hi = channels
        if out.ndim != 4 or out.shape[1] != self.multiplier.size or not 0 <= lo <= hi <= out.shape[1] \
                or weight.shape[0] != out.shape[1] or x.shape[1] * per_input != out.shape[1]:
            raise ValueError(f"a depthwise Conv of input {list(x.shape)} and weight {list(weight.shape)} does not "
                             f"fit an output of shape {list(out.shape)}")
        (sh, sw), (dh, dw), (top, left) = strides, dilations, pads[:2]
        _loops.depthwise_requantized(x, weight, per_input, sh, sw, dh, dw, top, left, self.multiplier,
                                     self.offset, self.rshift, self.exact.zero_out, self.lo, self.hi, out, lo, hi)

    def rows(self, acc: np.ndarray, out: np.ndarray, start: int, stop: int, table: np.ndarray | None = None,
             border: tuple | None = None, channels: tuple[int, int] | None = None) -> None:
        """Rows [start, stop) (axis 2) of [n, C, H, W] float32 ``acc`` into ``out``: the loop
        runs fastest on whole C-contiguous arrays, which a kernel splitting rows over threads can
        pass as they are. With ``table`` (256 entries, for an 8-bit output), each output is
        ``table[byte of the requantized value]``: the lookup of the elementwise steps after it
        (the executor's chains), in the same pass. ``border`` adds a Conv's zero-point padding
        correction to the border rows and columns first (``ortconv.OrtConv.border``). With
        ``channels`` (lo, hi), ``acc`` holds only those output channels, written to ``out[:, lo:hi]``."""
        if self.layout != "rows":
            raise ValueError("these requantization parameters are not one per channel of [n, C, H, W] sums")
        if table is None:
            table = _no_table(out.dtype)
        if border is None:
            border = no_border(acc.shape[2], acc.shape[3])
        lo, hi = channels if channels is not None else (0, self.multiplier.size)
        if channels is not None:
            border = border[:4] + tuple(band[lo:hi] for band in border[4:])
        _fits(out, acc, lo, hi)
        _loops.requantize_rows(acc, start, stop, self.multiplier[lo:hi], self.offset[lo:hi],
                               self.rshift[lo:hi], self.exact.zero_out, self.lo, self.hi, table, border, out, lo)


def _fits(out: np.ndarray, sums: np.ndarray, lo: int, hi: int) -> None:
    """The compiled loops write channels [lo, hi) of ``out`` without bounds checks: refuse an
    ``out`` they would write past."""
    if out.ndim != 4 or sums.ndim != 4 or out.shape[1] < hi or sums.shape[1] != hi - lo \
            or out.shape[0] != sums.shape[0] or out.shape[3] != sums.shape[3] or out.shape[2] < sums.shape[2]:
        raise ValueError(f"sums {list(sums.shape)} for channels [{lo}, {hi}) do not fit an output of "
                         f"shape {list(out.shape)}")


def lookup_per_channel(table: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """``table[a byte, b byte]`` (a [256, 256] pair table) for ``a`` [n, C, H, W] and ``b`` one
    value per channel ([1 or n, C, 1, 1]), as one compiled gather; None where numba is missing or
    the shapes are not these (the caller looks up in numpy)."""
    if not available() or a.ndim != 4 or b.ndim != 4 or b.shape[2:] != (1, 1) or b.shape[1] != a.shape[1] \
            or b.shape[0] not in (1, a.shape[0]):
        return None
    out = np.empty(a.shape, dtype=table.dtype)
    _loops.lookup_per_channel(table, np.ascontiguousarray(a).view(np.uint8),
                              np.ascontiguousarray(b.reshape(b.shape[:2])).view(np.uint8), out)
    return out


def gather(table: np.ndarray, index: np.ndarray) -> np.ndarray | None:
    """``table[index]`` for a 256-entry ``table`` and uint8 ``index``, or a 65536-entry one and
    uint16 ``index``, of any shape, as one compiled loop; None where numba is missing."""
    if not available() or table.ndim != 1 or (table.size, index.dtype) not in ((256, np.uint8), (65536, np.uint16)):
        return None
    out = np.empty(index.size, dtype=table.dtype)
    _loops.gather(np.ascontiguousarray(table), np.ascontiguousarray(index).reshape(-1), out)
    return out.reshape(index.shape)


def gather_pairs(table: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """``table[a, b]`` for a [256, 256] ``table`` and uint8 ``a``, ``b`` of one shape, as one
    compiled loop; None where numba is missing."""
    if not available() or table.shape != (256, 256) or a.shape != b.shape:
        return None
    out = np.empty(a.size, dtype=table.dtype)
    _loops.gather_pairs(np.ascontiguousarray(table), np.ascontiguousarray(a).reshape(-1),
                        np.ascontiguousarray(b).reshape(-1), out)
    return out.reshape(a.shape)


def _bound(array: np.ndarray, zero: int) -> int:
    """The largest ``|q - Z|`` of an integer type: a bound that holds for every value of it."""
    info = np.iinfo(array.dtype)
    return max(abs(int(info.min) - zero), abs(int(info.max) - zero))


_INT16_OPERANDS = (np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int16))


def add_levels(p, a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """qtool/ops/add.py's ``_add`` for an int16 output, half_up, shift 1 to 63, as one compiled
    pass (numpy broadcasting); None where numba is missing or the case is another."""
    if not available() or p.dtype != "int16" or p.rounding != "half_up" or not 1 <= p.rshift <= 63 \
            or a.dtype not in _INT16_OPERANDS or b.dtype not in _INT16_OPERANDS:
        return None
    # |acc| <= 2**17 * 2**31 * 2: far inside int64, and adding half the shift keeps it there
    if max(abs(p.multiplier_a), abs(p.multiplier_b)) >= 2**32:
        return None
    rows = _rows_form(a, b)
    if rows is not None:
        a2, b2, swapped, shape = rows
        (za, ma), (zb, mb) = ((p.zero_a, p.multiplier_a), (p.zero_b, p.multiplier_b))[::-1 if swapped else 1]
        return _by_rows(lambda x, y, out: _loops.add_int16_rows(
            x, y, np.int64(za), np.int64(zb), np.int64(ma), np.int64(mb), np.int64(p.rshift),
            np.int64(p.zero_out), out), a2, b2, shape)
    return _loops.add_int16(a, b, p.zero_a, p.zero_b, p.multiplier_a, p.multiplier_b, p.rshift, p.zero_out)


def mul_levels(p, a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """qtool/ops/mul.py's ``_mul`` for an int16 output, half_up, shift 1 to 63, as one compiled
    pass, where every product of the operand types lies inside int32 (zero points 0, as int16
    activations have), so that ``requantize`` takes its plain path; None otherwise."""
    if not available() or p.dtype != "int16" or p.rounding != "half_up" or not 1 <= p.rshift <= 63 \
            or a.dtype not in _INT16_OPERANDS or b.dtype not in _INT16_OPERANDS:
        return None
    if _bound(a, p.zero_a) * _bound(b, p.zero_b) > 2**31 - 1 or abs(p.multiplier) >= 2**31:
        return None
    rows = _rows_form(a, b)
    if rows is not None:
        a2, b2, swapped, shape = rows
        za, zb = (p.zero_b, p.zero_a) if swapped else (p.zero_a, p.zero_b)
        return _by_rows(lambda x, y, out: _loops.mul_int16_rows(
            x, y, np.int64(za), np.int64(zb), np.int64(p.multiplier), np.int64(p.rshift),
            np.int64(p.zero_out), out), a2, b2, shape)
    return _loops.mul_int16(a, b, p.zero_a, p.zero_b, p.multiplier, p.rshift, p.zero_out)


def _rows_form(a: np.ndarray, b: np.ndarray):
    """Two operands as ``(a2, b2, swapped, shape)``: contiguous [R, L] views of the larger one and
    [R, L] or [R, 1] of the other (``swapped``: ``b`` was the larger), ``shape`` the output's,
    where their shapes are equal or one is the other's leading dims followed by 1s ([N, C, 1, 1]
    against [N, C, H, W]); None for other broadcasts."""
    swapped = a.size < b.size
    big, small = (b, a) if swapped else (a, b)
    if big.ndim == 0 or big.size == 0 or small.ndim > big.ndim:
        return None
    dims = (1,) * (big.ndim - small.ndim) + small.shape
    if dims == big.shape:
        width = big.shape[-1]
    else:
        lead = 0
        while lead < big.ndim and dims[lead] == big.shape[lead]:
            lead += 1
        if lead == 0 or any(d != 1 for d in dims[lead:]):
            return None
        width = 1
        for d in big.shape[lead:]:
            width *= d
    rows = big.size // width
    b2 = np.ascontiguousarray(small).reshape(rows, -1)
    return np.ascontiguousarray(big).reshape(rows, width), b2, swapped, big.shape


def _by_rows(loop, a2: np.ndarray, b2: np.ndarray, shape: tuple) -> np.ndarray:
    """``loop(a_rows, b_rows, out_rows)`` over ranges of rows on the cores (the loops release
    the GIL); operands of one shape over ranges of their flat elements instead."""
    out = np.empty(a2.shape, dtype=np.int16)
    if b2.shape == a2.shape:
        a2, b2, out2 = a2.reshape(1, -1), b2.reshape(1, -1), out.reshape(1, -1)
        parts = parallel.ranges(a2.shape[1], a2.size)
        parallel.run_parts(lambda lo, hi: loop(a2[:, lo:hi], b2[:, lo:hi], out2[:, lo:hi]), parts)
    else:
        parts = parallel.ranges(a2.shape[0], a2.size)
        parallel.run_parts(lambda lo, hi: loop(a2[lo:hi], b2[lo:hi], out[lo:hi]), parts)
    return out.reshape(shape)


def softmax(p, x: np.ndarray) -> np.ndarray | None:
    """qtool/ops/softmax.py's ``_softmax`` without hidden positions, along the last axis (after
    the flattening of opsets before 13), half_up, a shift of 1 to 63, as one compiled pass; None
    where numba is missing or the case is another. The same integers: the table, the floor
    division and the rounding shift of the numpy form, element by element."""
    axis = p.axis % max(x.ndim, 1)
    if not available() or p.rounding != "half_up" or not 1 <= p.rshift <= 63 or x.ndim == 0 \
            or (not p.flatten and axis != x.ndim - 1) or x.size == 0:
        return None
    rows = x.reshape(-1, x.shape[-1]) if not p.flatten else x.reshape(int(np.prod(x.shape[:axis])), -1)
    from ..fixedpoint import int_range

    lo, hi = int_range(p.dtype)
    out = np.empty(rows.shape, dtype=p.dtype)
    _loops.softmax_rows(np.ascontiguousarray(rows), p.exp_values, np.int64(p.multiplier), np.int64(p.rshift),
                        np.int64(p.zero_out), np.int64(lo), np.int64(hi), out)
    return out.reshape(x.shape)


def requantizer(exact):
    """``exact`` (an ``OffsetRequant``) compiled where numba is installed, else ``exact`` itself."""
    return CompiledRequant(exact) if available() else exact
