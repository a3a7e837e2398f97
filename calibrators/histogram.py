"""The streaming histogram behind the kl, percentile, mse and aciq calibrators.

Signed counts over ``[-R, R)`` in ``2 * bins`` bins, with ``R`` always a power of two: when a batch
exceeds ``R``, the range doubles as often as needed and each new bin is the exact sum of
``2**k`` old bins, so a histogram that grows mid-stream holds the same counts as one built in a
single pass, and two shards merge by adding counts after growing to the larger range. The price is
resolution: the data's ``max|x|`` occupies between half and all of the bins.

Alongside: min, max, the element count, sum and sum of squares (for ACIQ's Gaussian fit), and, when
asked for (``count_zeros``, TPU-MLIR's KLD leaves them out), the number of exact zeros among the
binned values: with a subsampled batch that is the sample's, so it matches the zero bin's count.
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_BINS = 2048


class Histogram:
    def __init__(self, bins: int = DEFAULT_BINS, count_zeros: bool = True):
        self.bins = bins
        self.count_zeros = count_zeros
        self.range = 0.0  # R: bins cover [-R, R); 0 while every value seen is 0
        self.counts = np.zeros(2 * bins, dtype=np.int64)  # [-R, 0) then [0, R)
        self.min, self.max = math.inf, -math.inf
        self.n = 0
        self.total = 0.0
        self.total_sq = 0.0
        self.zeros = 0

    # -- streaming -----------------------------------------------------------------------------
    def update(self, x: np.ndarray) -> None:
        if x.size == 0:
            return
        x = np.asarray(x, dtype=np.float32).ravel()
        x64 = x.astype(np.float64)
        self._fold(float(x.min()), float(x.max()), x.size, float(x64.sum()), float(x64 @ x64), x)

    def add_batch(self, stats) -> None:
        """Fold in a batch reduced inside onnxruntime (``qtool.stats_graph.BatchStats``): exact
        min, max and moments of the whole tensor, and a sample of it to bin."""
        self._fold(stats.min, stats.max, stats.count, stats.total, stats.total_sq, stats.sample)

    def _fold(self, lo, hi, count, total, total_sq, values) -> None:
        if self._fold_scalars(lo, hi, count, total, total_sq) and values is not None:
            values = np.asarray(values).ravel()
            self.counts += _bin_many([values], [self._scale()], self.bins)[0]
            self._count_zeros(values)

    def _count_zeros(self, values: np.ndarray) -> None:
        if self.count_zeros:
            self.zeros += values.size - int(np.count_nonzero(values))

    def _fold_scalars(self, lo, hi, count, total, total_sq) -> bool:
        """Everything but the binning; False when the batch is not finite (nothing to bin)."""
        if not (math.isfinite(lo) and math.isfinite(hi)):
            self.min, self.max = math.nan, math.nan  # reported by the caller, never binned
            return False
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        self._grow(max(-lo, hi))
        self.n += count
        self.total += total
        self.total_sq += total_sq
        return True

    def _scale(self) -> np.float32:
        """Bins per unit; 0 while the range is 0 (every value lands in the zero bin)."""
        return np.float32(self.bins / self.range) if self.range else np.float32(0.0)

    @staticmethod
    def add_batches(histograms: list["Histogram"], stats: list) -> None:
        """``add_batch`` for many histograms at once: one vectorised binning for the batch."""
        values, scales, targets = [], [], []
        for h, s in zip(histograms, stats):
            if h._fold_scalars(s.min, s.max, s.count, s.total, s.total_sq) \
                    and s.sample is not None and s.sample.size:
                v = np.asarray(s.sample).ravel()
                values.append(v)
                scales.append(h._scale())
                targets.append(h)
                h._count_zeros(v)
        if not targets:
            return
        bins = targets[0].bins
        for h, counts in zip(targets, _bin_many(values, scales, bins)):
            h.counts += counts

    def _grow(self, peak: float) -> None:
        if peak <= self.range or peak == 0.0:
            return
        new_range = math.ldexp(1.0, math.ceil(math.log2(peak)))
        if self.range == 0.0:
            self.range = new_range
            return
        factor = int(round(new_range / self.range))
        self.counts = _rebin(self.counts, self.bins, factor)
        self.range = new_range

    def merge(self, other: "Histogram") -> None:
        if other.bins != self.bins:
            raise ValueError(f"cannot merge histograms of {self.bins} and {other.bins} bins")
        other_counts = other.counts
        if other.range > self.range:
            self._grow(other.range)
        elif other.range < self.range and other.range > 0:
            other_counts = _rebin(other.counts, self.bins, int(round(self.range / other.range)))
        self.counts = self.counts + other_counts
        if math.isnan(other.min) or math.isnan(other.max):  # min() drops a NaN given second
            self.min, self.max = math.nan, math.nan
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)
        self.n += other.n
        self.total += other.total
        self.total_sq += other.total_sq
        self.zeros += other.zeros

    # -- views ---------------------------------------------------------------------------------
    @property
    def width(self) -> float:
        return self.range / self.bins

    @property
    def finite(self) -> bool:
        return math.isfinite(self.min) and math.isfinite(self.max)

    def abs_counts(self) -> np.ndarray:
        """Counts of |x| over [0, R) in ``bins`` bins."""
        return self.counts[self.bins:] + self.counts[:self.bins][::-1]

    def peak(self) -> float:
        return max(abs(self.min), abs(self.max)) if self.finite else math.nan

    # -- state for sharding ----------------------------------------------------------------------
    def state(self) -> dict[str, np.ndarray]:
        return {"counts": self.counts,
                "scalars": np.array([self.range, self.min, self.max, self.total, self.total_sq]),
                "integers": np.array([self.bins, self.n, self.zeros], dtype=np.int64)}

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> "Histogram":
        bins, n, zeros = (int(v) for v in state["integers"])
        counts = np.asarray(state["counts"])
        if bins < 1 or counts.shape != (2 * bins,):
            raise ValueError(f"{list(counts.shape)} counts for {bins} bins (expected [{2 * bins}])")
        h = cls(bins)
        h.counts = counts.astype(np.int64)
        h.range, h.min, h.max, h.total, h.total_sq = (float(v) for v in state["scalars"])
        if h.range < 0 or not math.isfinite(h.range) or (h.range and math.frexp(h.range)[0] != 0.5):
            raise ValueError(f"range {h.range} is not 0 or a power of two")
        h.n, h.zeros = n, zeros
        return h


def _bin_many(values: list[np.ndarray], scales: list, bins: int) -> np.ndarray:
    """Signed-bin counts [len(values), 2 * bins] of several arrays, each with its own scale
    (bins per unit), in one bincount over shared buffers."""
    total = sum(v.size for v in values)
    scaled = np.empty(total, dtype=np.float32)
    bounds = np.cumsum([0] + [v.size for v in values])
    for v, scale, start, stop in zip(values, scales, bounds[:-1], bounds[1:]):
        np.multiply(v, scale, out=scaled[start:stop], casting="unsafe")
    np.floor(scaled, out=scaled)
    np.clip(scaled, -bins, bins - 1, out=scaled)
    index = scaled.astype(np.int64)
    for i, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        index[start:stop] += bins + i * 2 * bins  # each array gets its own block of bins
    return np.bincount(index, minlength=len(values) * 2 * bins).reshape(len(values), 2 * bins)


def _rebin(counts: np.ndarray, bins: int, factor: int) -> np.ndarray:
    """Counts over a range ``factor`` (a power of two) times wider: new bins sum old ones."""
    if factor == 1:
        return counts
    negative, positive = counts[:bins][::-1], counts[bins:]  # both ordered by |x|

    def shrink(side):
        out = np.zeros(bins, dtype=np.int64)
        if factor >= bins:
            out[0] = side.sum()
        else:
            merged = side.reshape(bins // factor, factor).sum(axis=1)
            out[:merged.size] = merged
        return out

    return np.concatenate([shrink(negative)[::-1], shrink(positive)])


def check_whole(name: str, value, least: int, most: int | None = None, most_name: str = "") -> None:
    """A ``ValueError`` (calibrate's one-line error) unless ``value`` is a whole number in
    ``[least, most]`` (``most_name``: what bounds it, for the message)."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if whole and value >= least and (most is None or value <= most):
        return
    bound = f"of at least {least}" if most is None else f"from {least} to {most_name or most}"
    raise ValueError(f"{name} must be a whole number {bound}, got {value!r}")


class HistogramCalibrator:
    """Base for calibrators that keep a ``Histogram``; subclasses define ``threshold()``."""

    name = ""

    counts_zeros = False  # whether the histogram counts exact zeros (``Histogram.zeros``)

    def __init__(self, bins: int = DEFAULT_BINS):
        check_whole("bins", bins, 2)
        self.hist = Histogram(bins, count_zeros=self.counts_zeros)

    # what the engine reduces inside onnxruntime for this calibrator (qtool.stats_graph)
    reductions = ("minmax", "sample")

    def update(self, x: np.ndarray) -> None:
        self.hist.update(x)

    def update_reduced(self, stats) -> None:
        self.hist.add_batch(stats)

    @classmethod
    def update_reduced_many(cls, calibrators: list, stats: list) -> None:
        Histogram.add_batches([c.hist for c in calibrators], stats)

    def merge(self, other: "HistogramCalibrator") -> None:
        self.hist.merge(other.hist)

    def state(self) -> dict[str, np.ndarray]:
        return self.hist.state()

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        self.hist = Histogram.from_state(state)
        self.hist.count_zeros = self.counts_zeros

    def shared_key(self) -> tuple:
        """What this calibrator's state holds: calibrators of equal keys keep the same histogram
        of the same data, so one pass can serve them all (``Statistics.read_as``)."""
        return ("histogram", self.hist.bins, self.counts_zeros, tuple(self.reductions))

    def threshold(self) -> float:
        raise NotImplementedError

    def result(self):
        from . import Range

        h = self.hist
        if not h.finite:
            return Range(math.nan, math.nan, math.nan)
        threshold = min(self.threshold(), h.peak())
        return clipped_range(h, -threshold, threshold, threshold)


def clipped_range(h: Histogram, lo: float, hi: float, threshold: float):
    """The observed [min, max] cut to [lo, hi]. Where every value lies beyond the cut on one side
    (a constant 32 whose threshold is a bin edge below it), the range is that edge alone, not an
    inverted [32, 31.98]."""
    from . import Range

    lo, hi = max(h.min, lo), min(h.max, hi)
    if lo > hi:
        lo = hi = hi if h.min > 0 else lo
    return Range(lo, hi, threshold)
