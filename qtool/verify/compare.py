"""Running cosine / SQNR / max-LSB of the executor's values against a float reference.

A comparison keeps four sums (``ref . got``, ``ref . ref``, ``got . got``, ``err . err``) and the
largest difference, so batches add up and nothing of a sample outlives its batch. With numba
installed (``qtool[fast]``) each tensor is one compiled pass (qtool/verify/_loops.py) that reads
the executor's 8-bit integers with their dequantized value for each of the 256 bytes, instead of
numpy's dequantization, float64 copies and four products; without numba the same sums come from
numpy. The two add in different orders, so their sums can differ in the last bits (about 1e-16
of the sum), far below the digits a report prints.

Entries whose reference is not a real value are left out of the sums and counted (``excluded``):
infinities, NaN and sentinels of ``RANGE_LIMIT`` (1e30) or more in magnitude, such as an attention
mask's float32 lowest, whose energy would otherwise be the whole tensor's (756 dB on a BERT mask
Add, whatever happened to the scores).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ..ops.bytetable import BYTE_TYPES, byte_values
from ..qparams import QParams, dequantize_array, real_entries
from ..report import finite

ENABLED = True
_loops = None  # qtool/verify/_loops.py once imported; False without numba
_NO_TABLE = np.zeros(0, dtype=np.float64)


def _compiled():
    global _loops
    if not ENABLED:
        return False
    if _loops is None:
        try:
            from . import _loops as loops
        except Exception:  # no numba, or numba unable to set up its disk cache
            loops = False
        _loops = loops
    return _loops


@dataclass
class Comparison:
    """Streaming cosine / SQNR / max-LSB between a float reference and the executor's values."""

    name: str
    op_type: str = ""
    ran: str = "integer"  # integer, float (computed in float, then quantized) or input
    qparams: QParams | None = None
    clamped: bool = False  # compared after the Relu that reads it (its range is Relu's)
    # compared clipped to these bounds: its readers do not change beyond them (qtool/ops/flat.py)
    cut: tuple[float, float] | None = None
    dot: float = 0.0
    ref_sq: float = 0.0
    got_sq: float = 0.0
    err_sq: float = 0.0
    max_lsb: float = 0.0
    # batches whose two sides differ in shape (a Loop that stops on a value), left out of the
    # sums, and the first such pair of shapes
    mismatched: int = 0
    shapes: tuple | None = None
    excluded: int = 0  # reference entries that are no real value (inf, NaN, |x| >= 1e30)

    def update(self, ref: np.ndarray, got: np.ndarray) -> None:
        """Add a batch: ``got`` the executor's float values."""
        if self._same_shape(ref, got):
            self._add(ref, got, None)

    def _same_shape(self, ref: np.ndarray, got: np.ndarray) -> bool:
        if np.shape(ref) == np.shape(got):
            return True
        self.mismatched += 1
        if self.shapes is None:
            self.shapes = (list(np.shape(ref)), list(np.shape(got)))
        return False

    def update_integer(self, ref: np.ndarray, q: np.ndarray, tables: dict) -> None:
        """Add a batch of the executor's integers ``q``, dequantized with ``qparams`` (``tables``:
        this comparison's dequantized bytes, kept between batches)."""
        qp = self.qparams
        if not self._same_shape(ref, q):
            return
        if q.dtype in BYTE_TYPES and qp.axis is None:
            table = tables.get(q.dtype)
            if table is None:
                table = tables[q.dtype] = dequantize_array(byte_values(q.dtype), qp).astype(np.float64)
            self._add(ref, q.view(np.uint8), table)
        else:
            self._add(ref, dequantize_array(q, qp), None)

    def _add(self, ref: np.ndarray, got: np.ndarray, table: np.ndarray | None) -> None:
        """``got``: values, or bytes standing for ``table[byte]``."""
        if self.clamped:
            ref = np.maximum(ref, 0)
            if table is None:
                got = np.maximum(got, 0)
            else:
                table = np.maximum(table, 0)
        if self.cut is not None:
            ref = np.clip(ref, *self.cut)
            if table is None:
                got = np.clip(got, *self.cut)
            else:
                table = np.clip(table, *self.cut)
        ref, got = self._meaningful(ref, got)
        dot, ref_sq, got_sq, err_sq, hi, lo = _sums(ref, got, table)
        self.dot += dot
        self.ref_sq += ref_sq
        self.got_sq += got_sq
        self.err_sq += err_sq
        if self.qparams is not None and np.size(ref):
            # per channel: in steps of the finest channel's scale (the most a step can be off)
            self.max_lsb = max(self.max_lsb, max(hi, -lo) / float(np.min(self.qparams.scale)))

    def _meaningful(self, ref: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``ref`` and ``got`` without the entries whose reference is no real value (two
        reductions decide that the usual tensor has none; NaN fails both comparisons)."""
        keep = real_entries(ref)
        if keep is None:
            return ref, got
        self.excluded += int(ref.size - np.count_nonzero(keep))
        return np.ascontiguousarray(ref[keep]), np.ascontiguousarray(np.broadcast_to(got, ref.shape)[keep])

    def take(self) -> "Comparison":
        """A copy holding the figures so far, which start again from zero here: qtool/cluster.py
        sends each batch's figures to the client, which adds them up (``merge``) in batch order,
        so that the sums are the ones a single process makes."""
        taken = dataclasses.replace(self)
        self.dot = self.ref_sq = self.got_sq = self.err_sq = self.max_lsb = 0.0
        self.mismatched, self.shapes, self.excluded = 0, None, 0
        return taken

    def merge(self, other: "Comparison") -> None:
        """Add the figures of ``other``, the same tensor on later samples."""
        self.dot += other.dot
        self.ref_sq += other.ref_sq
        self.got_sq += other.got_sq
        self.err_sq += other.err_sq
        self.max_lsb = max(self.max_lsb, other.max_lsb)
        self.mismatched += other.mismatched
        self.shapes = self.shapes or other.shapes
        self.excluded += other.excluded

    @property
    def cosine(self) -> float:
        if self.ref_sq == 0 and self.got_sq == 0:
            return 1.0
        if self.ref_sq == 0 or self.got_sq == 0:
            return 0.0
        return self.dot / math.sqrt(self.ref_sq * self.got_sq)

    @property
    def sqnr(self) -> float:
        if self.err_sq == 0:
            return math.inf
        if self.ref_sq == 0:
            return -math.inf
        return 10 * math.log10(self.ref_sq / self.err_sq)

    def to_dict(self) -> dict:
        d = {"name": self.name, "cosine": round(self.cosine, 6), "sqnr_db": finite(self.sqnr)}
        if self.qparams is not None:
            d.update(op_type=self.op_type, ran=self.ran, max_diff_lsb=round(self.max_lsb, 3),
                     compared_after_relu=self.clamped)
            if self.cut is not None:
                d.update(compared_within=[finite(v) for v in self.cut])
        if self.excluded:
            d.update(excluded_entries=self.excluded)
        if self.mismatched:
            d.update(shape_mismatches=self.mismatched, shapes={"float": self.shapes[0], "integer": self.shapes[1]})
        return d


def _sums(ref: np.ndarray, got: np.ndarray, table: np.ndarray | None) -> tuple[float, ...]:
    """(ref.got, ref.ref, got.got, err.err, max err, min err) in float64, err = ref - got."""
    loops = _compiled()
    if loops and ref.dtype == np.float32 and (table is not None or got.dtype == np.float32) \
            and ref.size == got.size:
        out = np.empty(6)
        loops.compare(np.ascontiguousarray(ref).reshape(-1), np.ascontiguousarray(got).reshape(-1),
                      _NO_TABLE if table is None else table, out)
        return tuple(float(v) for v in out)
    if table is not None:
        got = np.take(table, got)
    ref, got = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    sums = [float(ref @ got), float(ref @ ref), float(got @ got)]
    diff = np.subtract(ref, got, out=ref)  # ref is a copy already: no third array
    sums.append(float(diff @ diff))
    if not diff.size:
        return (*sums, -math.inf, math.inf)
    return (*sums, float(diff.max()), float(diff.min()))
