"""Elementwise kernels on 8-bit inputs as exact lookup tables.

An elementwise kernel of two int8/uint8 inputs sees at most 256 * 256 distinct pairs. Running the
kernel's own integer arithmetic once on every pair gives a table equal to it by construction; a
lookup (one gather) then replaces a dozen int64 passes over the data. Tables are indexed by raw
bytes, ``a.view(uint8) * 256 + b.view(uint8)``, so int8 needs no offset. A one-element operand
(Mul by a constant, Add of a constant) picks one row or column: a 256-entry table.
"""

from __future__ import annotations

import functools

import numpy as np

BYTE_TYPES = frozenset({np.dtype(np.int8), np.dtype(np.uint8)})  # dtype objects: fast to look up


def byte_values(dtype) -> np.ndarray:
    """Each byte 0..255 read as ``dtype``: the input that table index stands for."""
    return np.arange(256, dtype=np.uint8).view(dtype)


def lookup(table: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``table[x.view(uint8)]`` for an 8-bit ``x``, shaped like ``x``."""
    return np.take(table, x.view(np.uint8))


@functools.lru_cache(maxsize=512)
def pair_table(kernel, params, dtype_a: np.dtype, dtype_b: np.dtype) -> np.ndarray:
    """``kernel(params, a, b)`` for every byte pair, [256, 256] (read-only; cached per ``params``,
    a hashable frozen dataclass)."""
    table = kernel(params, byte_values(dtype_a)[:, None], byte_values(dtype_b)[None, :])
    table.setflags(write=False)
    return table


def has_pair_table(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype in BYTE_TYPES and b.dtype in BYTE_TYPES


def lookup_pair(table: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``kernel(a, b)`` with numpy broadcasting, from ``kernel``'s ``pair_table``."""
    shape = np.broadcast_shapes(a.shape, b.shape)
    if b.size == 1 and a.shape == shape:
        return lookup(np.ascontiguousarray(table[:, b.view(np.uint8).reshape(-1)[0]]), a)
    if a.size == 1 and b.shape == shape:
        return lookup(table[a.view(np.uint8).reshape(-1)[0]], b)
    index = np.bitwise_or(np.left_shift(a.view(np.uint8), 8, dtype=np.uint16), b.view(np.uint8))
    return np.take(table.reshape(-1), index)
