"""Percentile: the threshold below which ``percentile`` % of |x| lies (default 99.99).

For asymmetric ranges the two tails are cut separately, each keeping half of the rest:
min and max are the (100 - p)/2 and (100 + p)/2 percentiles of the signed values.
Values are read off the histogram, so they are exact to one bin width.
"""

from __future__ import annotations

import math

import numpy as np

from . import Range, register
from .histogram import DEFAULT_BINS, HistogramCalibrator, clipped_range


def _quantile_edge(counts: np.ndarray, fraction: float) -> int:
    """Index of the first bin whose cumulative count reaches ``fraction`` of the total."""
    cumulative = np.cumsum(counts)
    return int(np.searchsorted(cumulative, fraction * cumulative[-1], side="left"))


@register
class Percentile(HistogramCalibrator):
    name = "percentile"

    def __init__(self, percentile: float = 99.99, bins: int = DEFAULT_BINS):
        if not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        super().__init__(bins)
        self.percentile = percentile

    def threshold(self) -> float:
        h = self.hist
        return (_quantile_edge(h.abs_counts(), self.percentile / 100) + 1) * h.width

    def result(self) -> Range:
        h = self.hist
        if not h.finite:
            return Range(math.nan, math.nan, math.nan)
        threshold = min(self.threshold(), h.peak())
        tail = (1 - self.percentile / 100) / 2
        lo = (_quantile_edge(h.counts, tail) - h.bins) * h.width
        hi = (_quantile_edge(h.counts, 1 - tail) - h.bins + 1) * h.width
        return clipped_range(h, lo, hi, threshold)
