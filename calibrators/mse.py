"""MSE: the threshold that minimises the expected int8 quantization error of |x|.

For a threshold t (step s = t / 127), values above t are clipped, costing (|x| - t)**2, and values
below are rounded, costing s**2 / 12 on average. With suffix sums of h, h*c and h*c**2 over bin
centres c, every candidate bin edge is scored at once.
"""

from __future__ import annotations

import numpy as np

from . import register
from .histogram import DEFAULT_BINS, HistogramCalibrator, check_whole


def mse_threshold(counts: np.ndarray, width: float, qmax: int = 127) -> float:
    counts = np.asarray(counts, dtype=np.float64)
    used = int(np.flatnonzero(counts)[-1]) + 1 if counts.any() else 0
    if used == 0:
        return 0.0
    h = counts[:used]
    centres = (np.arange(used) + 0.5) * width
    edges = (np.arange(used) + 1) * width  # candidate thresholds: each bin's upper edge

    def suffix(v):  # sum over bins strictly above each candidate's bin
        return np.concatenate([np.cumsum(v[::-1])[::-1][1:], [0.0]])

    n_above, c_above, c2_above = suffix(h), suffix(h * centres), suffix(h * centres**2)
    clip = c2_above - 2 * edges * c_above + edges**2 * n_above
    rounding = (edges / qmax) ** 2 / 12 * (h.sum() - n_above)
    return float(edges[int(np.argmin(clip + rounding))])


@register
class MSE(HistogramCalibrator):
    name = "mse"

    def __init__(self, bins: int = DEFAULT_BINS, qmax: int = 127):
        super().__init__(bins)
        check_whole("qmax", qmax, 1)
        self.qmax = qmax

    def threshold(self) -> float:
        return mse_threshold(self.hist.abs_counts(), self.hist.width, self.qmax)
