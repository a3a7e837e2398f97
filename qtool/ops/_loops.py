"""The compiled loops of qtool/ops/compiled.py (importing this module needs numba).

Each is ``OffsetRequant``'s integer arithmetic, element by element: ``min(max(((x * M + offset)
>> r) + Z_y, lo), hi)`` in int64 on an integer-valued float32 sum ``x``.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True, inline="always")
def _level(x, m, o, r, zero, lo, hi):  # pragma: no cover (compiled)
    return min(max(((np.int64(x) * m + o) >> r) + zero, lo), hi)


@numba.njit(nogil=True, cache=True)
def requantize_rows(acc, start, stop, multiplier, offset, rshift, zero, lo, hi, table, border,
                    out, c0):  # pragma: no cover
    """Rows [start, stop) of [n, C, H, W] ``acc`` into channels [c0, c0 + C) of ``out``
    (whole, so that the loop writes a C-contiguous array: a view of some of its channels, with
    more than one sample, is strided and ran 4x slower); an output is ``table[byte]`` when
    ``table`` has entries. ``border`` = (first, last, lead, tail, top, bottom, left, right) adds,
    before requantizing, a per-channel correction to rows [0, first) (``top`` [C, first, W]) and
    [last, H) (``bottom``), and in the rows between to columns [0, lead) (``left``) and [tail, W)
    (``right``): the zero-point padding ``ortconv`` restores.

    Each row goes through a small buffer: the plain loop over the whole row (it vectorizes), the
    border's outputs again with their correction, then the lookup (a gather by byte)."""
    n, channels, _, cols = acc.shape
    first, last, lead, tail, top, bottom, left, right = border
    mapped = table.size > 0
    row = np.empty(cols, dtype=np.int32)  # levels lie in [lo, hi], inside int32
    for b in range(n):
        for c in range(channels):
            m, o, r = multiplier[c], offset[c], rshift[c]
            for i in range(start, stop):
                for j in range(cols):
                    row[j] = _level(acc[b, c, i, j], m, o, r, zero, lo, hi)
                if i < first:
                    for j in range(cols):
                        row[j] = _level(acc[b, c, i, j] + top[c, i, j], m, o, r, zero, lo, hi)
                elif i >= last:
                    for j in range(cols):
                        row[j] = _level(acc[b, c, i, j] + bottom[c, i - last, j], m, o, r, zero, lo, hi)
                else:
                    for j in range(lead):
                        row[j] = _level(acc[b, c, i, j] + left[c, i - first, j], m, o, r, zero, lo, hi)
                    for j in range(tail, cols):
                        extra = right[c, i - first, j - tail]
                        row[j] = _level(acc[b, c, i, j] + extra, m, o, r, zero, lo, hi)
                if mapped:
                    for j in range(cols):
                        out[b, c0 + c, i, j] = table[np.uint8(row[j] & 255)]
                else:
                    for j in range(cols):
                        out[b, c0 + c, i, j] = row[j]


@numba.njit(nogil=True, cache=True)
def requantize_joined(high, low, extra, multiplier, offset, rshift, zero, lo, hi, out, c0):  # pragma: no cover
    """[n, C, H, W] sums given as ``256 * high + low + extra[c]`` (an int16 Conv's two byte
    halves, qtool/ops/conv.py) joined in int64 and requantized into channels [c0, c0 + C)
    of ``out`` (whole, as ``requantize_rows``)."""
    n, channels, rows, cols = high.shape
    for b in range(n):
        for c in range(channels):
            m, o, r, e = multiplier[c], offset[c], rshift[c], extra[c]
            for i in range(rows):
                for j in range(cols):
                    x = np.int64(high[b, c, i, j]) * 256 + np.int64(low[b, c, i, j]) + e
                    out[b, c0 + c, i, j] = min(max(((x * m + o) >> r) + zero, lo), hi)


@numba.njit(nogil=True, cache=True)
def depthwise_requantized(x, weight, per_input, sh, sw, dh, dw, top, left, multiplier, offset, rshift, zero,
                          lo, hi, out, c_lo, c_hi):  # pragma: no cover
    """Output channels [c_lo, c_hi) of a depthwise Conv of [n, C_in, H, W] integer ``x`` with
    zero padding, requantized into ``out`` [n, C_out, out_h, out_w]: output channel ``c`` reads
    input channel ``c // per_input`` through ``weight[c]`` [kh, kw] (float64 integer values).

    The sums are float64, exact for an int16 input and int8 weights (every partial sum below
    2**53). Each tap adds its weight times the input rows it reaches to the output rows it reaches
    (the ranges where the tap falls inside the image, worked out once per tap), a block of output
    rows at a time that stays in the core's first cache: the inner loop has no bounds to test and
    vectorizes, and its indexes are unsigned, so it has no negative-index wraparound to test either."""
    n, _, h, w = x.shape
    kh, kw = weight.shape[1], weight.shape[2]
    out_h, out_w = out.shape[2], out.shape[3]
    block = max(1, min(out_h, 2048 // out_w))  # output rows summed at a time: 16 KB of float64
    acc = np.empty((block, out_w), dtype=np.float64)
    step = np.uintp(sw)
    for b in range(n):
        for c in range(c_lo, c_hi):
            plane = x[b, c // per_input]
            m, o, r = multiplier[c], offset[c], rshift[c]
            for first_row in range(0, out_h, block):
                rows = min(block, out_h - first_row)
                acc[:rows] = 0.0
                for ky in range(kh):
                    down = ky * dh - top  # input row = oy * sh + down
                    y0 = max(first_row, 0 if down >= 0 else (sh - 1 - down) // sh)
                    y1 = min(first_row + rows, (h - 1 - down) // sh + 1)
                    for kx in range(kw):
                        across = kx * dw - left  # input column = ox * sw + across
                        x0 = 0 if across >= 0 else (sw - 1 - across) // sw
                        x1 = min(out_w, (w - 1 - across) // sw + 1)
                        if x1 <= x0:
                            continue
                        tap = weight[c, ky, kx]
                        count, start, base = np.uintp(x1 - x0), np.uintp(x0), np.uintp(x0 * sw + across)
                        for oy in range(y0, y1):
                            row = plane[oy * sh + down]
                            sums = acc[oy - first_row]
                            if sw == 1:
                                for i in range(count):
                                    sums[start + i] += tap * np.float64(row[base + i])
                            else:
                                for i in range(count):
                                    sums[start + i] += tap * np.float64(row[base + i * step])
                for i in range(rows):
                    sums = acc[i]
                    levels = out[b, c, first_row + i]
                    for j in range(out_w):
                        levels[j] = _level(sums[j], m, o, r, zero, lo, hi)


@numba.njit(nogil=True, cache=True)
def requantize_columns(acc, multiplier, offset, rshift, zero, lo, hi, out):  # pragma: no cover
    """[rows, N] ``acc`` with one channel per column (a MatMul's) into ``out``."""
    rows, channels = acc.shape
    for i in range(rows):
        for c in range(channels):
            out[i, c] = _level(acc[i, c], multiplier[c], offset[c], rshift[c], zero, lo, hi)


@numba.njit(nogil=True, cache=True)
def lookup_per_channel(table, a, b, out):  # pragma: no cover
    """``out[i, c, h, w] = table[a[i, c, h, w], b[i or 0, c]]``: a [256, 256] table of a kernel
    on byte pairs, ``a`` [n, C, H, W] and ``b`` [1 or n, C] as raw bytes (uint8)."""
    n, channels, rows, cols = a.shape
    for i in range(n):
        for c in range(channels):
            column = b[i if b.shape[0] > 1 else 0, c]
            for h in range(rows):
                for w in range(cols):
                    out[i, c, h, w] = table[a[i, c, h, w], column]


@numba.njit(nogil=True, cache=True)
def gather(table, index, out):  # pragma: no cover
    """``out[i] = table[index[i]]``, flat ``index`` of raw bytes (uint8): numpy's take first
    widens every index to intp, this reads each once."""
    for i in range(index.size):
        out[i] = table[index[i]]


@numba.njit(nogil=True, cache=True)
def gather_pairs(table, a, b, out):  # pragma: no cover
    """``out[i] = table[a[i], b[i]]``: a [256, 256] pair table, flat ``a`` and ``b`` raw bytes."""
    for i in range(a.size):
        out[i] = table[a[i], b[i]]


# 16-bit elementwise steps (no byte table: 65536 x 65536 pairs), as numpy ufuncs so that they
# broadcast; each compiles on first use for the input types it meets. The arithmetic is that of
# qtool/ops/add.py and mul.py for half_up with a shift of 1 to 63, on operands whose bounds the
# caller proved (compiled.add_levels, compiled.mul_levels): no int64 step can overflow.

@numba.vectorize(nopython=True, cache=True)
def add_int16(a, b, zero_a, zero_b, multiplier_a, multiplier_b, rshift, zero_out):  # pragma: no cover
    acc = (np.int64(a) - zero_a) * multiplier_a + (np.int64(b) - zero_b) * multiplier_b
    y = ((acc + (np.int64(1) << (rshift - 1))) >> rshift) + zero_out
    return np.int16(min(max(y, -32768), 32767))


@numba.vectorize(nopython=True, cache=True)
def mul_int16(a, b, zero_a, zero_b, multiplier, rshift, zero_out):  # pragma: no cover
    acc = (np.int64(a) - zero_a) * (np.int64(b) - zero_b) * multiplier
    y = ((acc + (np.int64(1) << (rshift - 1))) >> rshift) + zero_out
    return np.int16(min(max(y, -32768), 32767))


# The same two steps over [R, L] rows, ``b`` [R, L] or [R, 1] (one value a row: an SE block's
# [N, C, 1, 1] scale on [N, C, H, W]), written into ``out``: plain loops over contiguous rows
# vectorise where the ufuncs above, broadcasting scalars, run about six times slower, and they
# release the GIL, so the rows split over the cores (compiled.add_levels, mul_levels).

@numba.njit(nogil=True, cache=True)
def add_int16_rows(a, b, zero_a, zero_b, multiplier_a, multiplier_b, rshift, zero_out, out):  # pragma: no cover
    half = np.int64(1) << (rshift - 1)
    per_row = b.shape[1] == 1
    for r in range(a.shape[0]):
        for j in range(a.shape[1]):
            q_b = b[r, 0] if per_row else b[r, j]
            acc = (np.int64(a[r, j]) - zero_a) * multiplier_a + (np.int64(q_b) - zero_b) * multiplier_b
            out[r, j] = min(max(((acc + half) >> rshift) + zero_out, -32768), 32767)


@numba.njit(nogil=True, cache=True)
def mul_int16_rows(a, b, zero_a, zero_b, multiplier, rshift, zero_out, out):  # pragma: no cover
    half = np.int64(1) << (rshift - 1)
    per_row = b.shape[1] == 1
    for r in range(a.shape[0]):
        for j in range(a.shape[1]):
            q_b = b[r, 0] if per_row else b[r, j]
            acc = (np.int64(a[r, j]) - zero_a) * (np.int64(q_b) - zero_b) * multiplier
            out[r, j] = min(max(((acc + half) >> rshift) + zero_out, -32768), 32767)


@numba.njit(nogil=True, cache=True)
def softmax_rows(x, table, multiplier, rshift, zero, lo, hi, out):  # pragma: no cover
    """qtool/ops/softmax.py's integer Softmax along the last axis of [rows, L] ``x`` (half_up,
    ``1 <= rshift <= 63``): ``E = table[q - max + span]``, ``floor(E * M / sum E)``, the rounding
    shift, ``Z_y`` and saturation, a row at a time in one buffer. ``E <= 2**30`` and
    ``M < 2**31``, so ``E * M`` and the added half stay below 2**62."""
    rows, length = x.shape
    span = table.size - 1
    half = np.int64(1) << (rshift - 1)
    e = np.empty(length, dtype=np.int64)
    for i in range(rows):
        top = np.int64(x[i, 0])
        for j in range(1, length):
            top = max(top, np.int64(x[i, j]))
        total = np.int64(0)
        for j in range(length):
            e[j] = table[np.int64(x[i, j]) - top + span]
            total += e[j]
        for j in range(length):
            ratio = e[j] * multiplier // total
            out[i, j] = min(max(((ratio + half) >> rshift) + zero, lo), hi)
