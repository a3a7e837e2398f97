"""KL: TensorRT's entropy calibration on the |x| histogram.

For every candidate threshold ``i`` bins (from ``levels`` up to the last used bin) the reference
distribution P is the histogram clipped at ``i`` with the outliers added to its last bin; Q merges
those ``i`` bins into ``levels`` groups (``i // levels`` bins each, the last group takes the rest)
and spreads each group's count evenly over its bins that are non-zero in P. The threshold is the
middle of bin ``argmin KL(P || Q)``.

The search costs O(bins), not O(bins * levels): with prefix sums of ``h``, ``h log h`` and
``h > 0``, each candidate's divergence is ``KL = sum_b P_b log P_b - sum_k M_k log(L_k / (c_k H_i))``
over its ``levels`` groups, where ``L_k`` is a group's count, ``c_k`` its non-zero bins, ``M_k`` its
share of P and ``H_i`` the count below the candidate. All groups but the last span
``k * w .. (k + 1) * w`` with ``w = i // levels``, the same for every candidate of that width, so
their part of the sum is computed once per width (a handful) and only the last group per candidate.
A candidate whose P puts mass where Q has none is rejected (TensorRT smooths instead). Candidates
whose divergences agree to 1e-12 are ties, and the first (smallest) wins, as in a plain loop.

``variant="tpu_mlir"`` leaves exact zeros out of the histogram, as TPU-MLIR's KLD calibrator does
(common after Relu, they otherwise pull the threshold down); its bins centred on multiples of the
width are not reproduced.
"""

from __future__ import annotations

import numpy as np

from . import register
from .histogram import DEFAULT_BINS, HistogramCalibrator, check_whole

VARIANTS = ("tensorrt", "tpu_mlir")


def _xlogx(v: np.ndarray) -> np.ndarray:
    return np.where(v > 0, v * np.log(np.where(v > 0, v, 1.0)), 0.0)


def kl_threshold_bins(counts: np.ndarray, levels: int = 128) -> float:
    """The KL-optimal clipping point in bins (fractional), for |x| counts starting at 0."""
    counts = np.asarray(counts, dtype=np.float64)
    used = int(np.flatnonzero(counts)[-1]) + 1 if counts.any() else 0
    if used <= levels:
        return float(used)
    total = counts.sum()
    h = counts[:used]
    prefix = np.concatenate([[0.0], np.cumsum(h)])
    prefix_nonzero = np.concatenate([[0], np.cumsum(h > 0)])
    prefix_hlogh = np.concatenate([[0.0], np.cumsum(_xlogx(h))])

    cand = np.arange(levels, used + 1)  # threshold after bin cand - 1
    outliers = total - prefix[cand]
    last = h[cand - 1]
    plogp = prefix_hlogh[cand - 1] + _xlogx(last + outliers)  # sum P log P, unnormalised

    # the first levels - 1 groups depend only on the width w = cand // levels
    width = cand // levels
    w = width - width[0]
    edges = np.arange(width[0], width[-1] + 1)[:, None] * np.arange(levels)[None, :]
    group = prefix[edges[:, 1:]] - prefix[edges[:, :-1]]  # L_k
    nonzero = (prefix_nonzero[edges[:, 1:]] - prefix_nonzero[edges[:, :-1]]).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        head = np.where(group > 0, group * (np.log(group) - np.log(nonzero)), 0.0).sum(axis=1)
    start = edges[w, -1]  # the last group: start .. cand, plus the outliers in P
    head_mass = prefix[start]
    group_last = prefix[cand] - prefix[start]
    nonzero_last = (prefix_nonzero[cand] - prefix_nonzero[start]).astype(np.float64)
    # the outliers make the last bin non-zero in P even where the histogram is empty there
    nonzero_last += (last == 0) & (outliers > 0)
    mass_last = group_last + outliers
    impossible = (mass_last > 0) & (group_last == 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_below = np.log(prefix[cand])  # H_i
        tail = np.where(mass_last > 0,
                        mass_last * (np.log(group_last) - np.log(nonzero_last) - log_below), 0.0)
        cross = head[w] - head_mass * log_below + tail  # sum_k M_k log Q_k, unnormalised
        divergence = np.where(impossible, np.inf, (plogp - cross) / total - np.log(total))
    best = float(divergence.min())
    ties = divergence <= best + 1e-12 * max(1.0, abs(best))
    return float(cand[int(np.argmax(ties))])


@register
class KL(HistogramCalibrator):
    name = "kl"

    def __init__(self, bins: int = DEFAULT_BINS, levels: int = 128, variant: str = "tensorrt"):
        if variant not in VARIANTS:
            raise ValueError(f"unknown kl variant '{variant}'; choose one of {', '.join(VARIANTS)}")
        # tpu_mlir: the exact zeros among the binned values, counted in numpy from the sample
        self.counts_zeros = variant == "tpu_mlir"
        super().__init__(bins)
        check_whole("levels", levels, 2, bins, f"bins ({bins})")
        self.levels, self.variant = levels, variant

    def threshold(self) -> float:
        h = self.hist
        counts = h.abs_counts().astype(np.float64)
        if self.variant == "tpu_mlir":
            counts[0] -= h.zeros  # exact zeros say nothing about the range
        # A tensor that keeps away from 0 (all of |x| above some m) has empty bins below m, and
        # the search from 0 degenerates: its first candidate holds all the mass in one bin, so P
        # equals Q and the threshold lands at m, clipping every value. Search from m instead.
        first = int(np.argmax(counts > 0))
        return (first + kl_threshold_bins(counts[first:], self.levels) + 0.5) * h.width
