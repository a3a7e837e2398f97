"""Elementwise kernels on 8-bit inputs as exact lookup tables.

An elementwise kernel of two int8/uint8 inputs sees at most 256 * 256 distinct pairs. Running the
kernel's own integer arithmetic once on every pair gives a table equal to it by construction; a
lookup (one gather) then replaces a dozen int64 passes over the data. Tables are indexed by raw
bytes, ``a.view(uint8) * 256 + b.view(uint8)``, so int8 needs no offset. A one-element operand
(Mul by a constant, Add of a constant) picks one row or column: a 256-entry table.

A 16-bit input beside a one-element operand has 65536 values: ``scalar_table`` runs the kernel
on each once (cached by the kernel's parameters and the operand's value), and the lookup by the
input's 16-bit pattern replaces the int64 passes the same way.
"""

from __future__ import annotations

import functools

import numpy as np

from . import compiled, parallel

BYTE_TYPES = frozenset({np.dtype(np.int8), np.dtype(np.uint8)})  # dtype objects: fast to look up


def byte_values(dtype) -> np.ndarray:
    """Each byte 0..255 read as ``dtype``: the input that table index stands for."""
    return np.arange(256, dtype=np.uint8).view(dtype)


def lookup(table: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``table[x.view(uint8)]`` for an 8-bit ``x``, shaped like ``x`` (a large ``x`` in ranges on
    the cores); for a 16-bit ``x``, ``table[x.view(uint16)]`` (a 65536-entry table)."""
    if x.itemsize == 2:
        return _take16(table, x)
    return _take(table, x.view(np.uint8))


def values_of(dtype) -> np.ndarray:
    """Every value of an 8- or 16-bit ``dtype`` in the order of its bit patterns: the input each
    entry of a ``lookup`` table stands for."""
    dtype = np.dtype(dtype)
    if dtype.itemsize == 2:
        return np.arange(65536, dtype=np.uint16).view(dtype)
    return byte_values(dtype)


def by_pattern(table: np.ndarray, dtype) -> np.ndarray:
    """A table indexed by ``q - qmin`` of a 16-bit ``dtype`` reordered to be indexed by ``q``'s bit
    pattern (for int16, patterns 0..32767 are q = 0..32767 and the rest q = -32768..-1)."""
    return table if np.dtype(dtype).kind == "u" else np.roll(table, len(table) // 2)


def byte_mapped(fn, x: np.ndarray, tables: dict) -> np.ndarray:
    """``fn(x)`` for an elementwise ``fn`` of an 8-bit ``x``: ``fn`` of the 256 byte values, kept
    in ``tables`` by ``x``'s type, then looked up (the same values, one gather)."""
    table = tables.get(x.dtype)
    if table is None:
        table = tables[x.dtype] = fn(byte_values(x.dtype))
    return lookup(table, x)


def by_byte(table: np.ndarray, dtype) -> np.ndarray:
    """A table indexed by ``q - qmin`` of ``dtype`` reordered to be indexed by ``q``'s byte: for
    int8, byte ``b`` holds ``q = b - 256 * (b >= 128)``, ``q + 128 = b ^ 0x80``."""
    return table if np.dtype(dtype) == np.uint8 else table[np.arange(256) ^ 0x80]


def _take(table: np.ndarray, index: np.ndarray) -> np.ndarray:
    if index.ndim and index.dtype == np.uint8:  # a byte index: one compiled pass where numba is installed
        out = compiled.gather(table, index)
        if out is not None:
            return out
    parts = parallel.ranges(index.size, index.size)
    if len(parts) == 1:
        return np.take(table, index) if index.ndim else np.asarray(np.take(table, index))  # 0-d: an array
    flat = np.ascontiguousarray(index).reshape(-1)
    out = np.empty(flat.size, dtype=table.dtype)
    parallel.run_parts(lambda start, stop: np.take(table, flat[start:stop], out=out[start:stop]), parts)
    return out.reshape(index.shape)


@functools.lru_cache(maxsize=512)
def pair_table(kernel, params, dtype_a: np.dtype, dtype_b: np.dtype) -> np.ndarray:
    """``kernel(params, a, b)`` for every byte pair, [256, 256] (read-only; cached per ``params``,
    a hashable frozen dataclass)."""
    table = kernel(params, byte_values(dtype_a)[:, None], byte_values(dtype_b)[None, :])
    table.setflags(write=False)
    return table


def lookup_with_scalar(kernel, params, a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """``kernel(params, a, b)`` where one operand is int16 and the other has one element, by
    the int16 operand's 65536-entry table (``scalar_table``); None for other operands."""
    if a.dtype == np.int16 and b.size == 1 and b.ndim <= a.ndim:
        return _take16(scalar_table(kernel, params, b.dtype, b.reshape(-1)[0].item(), True), a)
    if b.dtype == np.int16 and a.size == 1 and a.ndim <= b.ndim:
        return _take16(scalar_table(kernel, params, a.dtype, a.reshape(-1)[0].item(), False), b)
    return None


@functools.lru_cache(maxsize=256)
def scalar_table(kernel, params, dtype, value, scalar_second: bool) -> np.ndarray:
    """``kernel(params, x, c)`` (or ``kernel(params, c, x)``) for every int16 ``x``, indexed by
    ``x``'s 16-bit pattern, with ``c`` the one-element operand of type ``dtype`` (read-only)."""
    x = values_of(np.int16)
    c = np.array([value], dtype=dtype)
    table = kernel(params, x, c) if scalar_second else kernel(params, c, x)
    table.setflags(write=False)
    return table


def _take16(table: np.ndarray, x: np.ndarray) -> np.ndarray:
    index = x.view(np.uint16)
    out = compiled.gather(table, index) if index.ndim else None
    return np.take(table, index) if out is None else out


def has_pair_table(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype in BYTE_TYPES and b.dtype in BYTE_TYPES


def lookup_pair(table: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``kernel(a, b)`` with numpy broadcasting, from ``kernel``'s ``pair_table``."""
    shape = np.broadcast_shapes(a.shape, b.shape)
    if b.size == 1 and a.shape == shape:
        return lookup(np.ascontiguousarray(table[:, b.view(np.uint8).reshape(-1)[0]]), a)
    if a.size == 1 and b.shape == shape:
        return lookup(table[a.view(np.uint8).reshape(-1)[0]], b)
    if a.shape == shape:  # one value of b per channel (a Mul by a channel attention's weights)
        out = compiled.lookup_per_channel(table, a, b)
        if out is not None:
            return out
    elif b.shape == shape:
        out = compiled.lookup_per_channel(table.T, b, a)
        if out is not None:
            return out
    if a.shape == b.shape:  # one compiled pass where numba is installed
        out = compiled.gather_pairs(table, a.view(np.uint8), b.view(np.uint8))
        if out is not None:
            return out
    flat_table = table.reshape(-1)
    if a.shape != b.shape:  # broadcasting: the index once, the gathers on the cores
        return _take(flat_table, np.bitwise_or(np.left_shift(a.view(np.uint8), 8, dtype=np.uint16),
                                               b.view(np.uint8)))
    parts = parallel.ranges(a.size, a.size)
    a_bytes = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    b_bytes = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    out = np.empty(a.size, dtype=table.dtype)

    def pairs(start: int, stop: int) -> None:
        index = np.left_shift(a_bytes[start:stop], 8, dtype=np.uint16)
        index |= b_bytes[start:stop]
        np.take(flat_table, index, out=out[start:stop])

    parallel.run_parts(pairs, parts)
    return out.reshape(shape)
