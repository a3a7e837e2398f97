"""KL: TensorRT's entropy calibration on the |x| histogram.

For every candidate threshold ``i`` bins (from ``levels`` up to the last used bin) the reference
distribution P is the histogram clipped at ``i`` with the outliers added to its last bin; Q merges
those ``i`` bins into ``levels`` groups (``i // levels`` bins each, the last group takes the rest)
and spreads each group's count evenly over its bins that are non-zero in P. The threshold is the
middle of bin ``argmin KL(P || Q)``.

The search is vectorised and needs no per-candidate copy of the histogram: with prefix sums of
``h``, ``h log h`` and ``h > 0``, each candidate's divergence is a sum over its ``levels`` groups,
``KL = sum_b P_b log P_b - sum_k M_k log(L_k / (c_k * H_i))``, where ``L_k`` is a group's count,
``c_k`` its non-zero bins, ``M_k`` its share of P and ``H_i`` the count below the candidate.
A candidate whose P puts mass where Q has none is rejected (TensorRT smooths instead).

``variant="tpu_mlir"`` leaves exact zeros out of the histogram, as TPU-MLIR's KLD calibrator does
(common after Relu, they otherwise pull the threshold down); its bins centred on multiples of the
width are not reproduced.
"""

from __future__ import annotations

import numpy as np

from . import register
from .histogram import DEFAULT_BINS, HistogramCalibrator

VARIANTS = ("tensorrt", "tpu_mlir")


def kl_threshold_bins(counts: np.ndarray, levels: int = 128) -> float:
    """The KL-optimal clipping point in bins (fractional), for |x| counts starting at 0."""
    counts = np.asarray(counts, dtype=np.float64)
    used = int(np.flatnonzero(counts)[-1]) + 1 if counts.any() else 0
    if used <= levels:
        return float(used)
    total = counts.sum()
    h = counts[:used]
    prefix = np.concatenate([[0.0], np.cumsum(h)])
    h_log_h = np.where(h > 0, h * np.log(np.where(h > 0, h, 1.0)), 0.0)
    prefix_hlogh = np.concatenate([[0.0], np.cumsum(h_log_h)])
    prefix_nonzero = np.concatenate([[0], np.cumsum(h > 0)])

    cand = np.arange(levels, used + 1)  # threshold after bin cand - 1
    outliers = total - prefix[cand]
    last = h[cand - 1]
    # sum_b P log P (unnormalised, then normalised by total)
    last_mass = last + outliers
    plogp = (prefix_hlogh[cand - 1] + np.where(last_mass > 0, last_mass * np.log(np.maximum(last_mass, 1e-300)), 0.0))
    plogp = plogp / total - np.log(total)
    # groups: boundaries k * (cand // levels), the last group ends at cand
    merged = cand // levels
    starts = merged[:, None] * np.arange(levels)[None, :]
    ends = np.concatenate([starts[:, 1:], cand[:, None]], axis=1)
    group = prefix[ends] - prefix[starts]  # L_k
    nonzero = (prefix_nonzero[ends] - prefix_nonzero[starts]).astype(np.float64)  # c_k
    mass = group.copy()  # M_k * total
    mass[:, -1] += outliers
    # the outliers make the last bin non-zero in P even where the histogram is empty there
    nonzero[:, -1] += (last == 0) & (outliers > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_q = np.log(group / (nonzero * prefix[cand][:, None]))
        terms = np.where(mass > 0, mass * log_q, 0.0)
    cross = terms.sum(axis=1) / total
    impossible = ((mass > 0) & (group == 0)).any(axis=1)
    divergence = np.where(impossible, np.inf, plogp - cross)
    best = int(np.argmin(divergence))
    return float(cand[best])


@register
class KL(HistogramCalibrator):
    name = "kl"

    def __init__(self, bins: int = DEFAULT_BINS, levels: int = 128, variant: str = "tensorrt"):
        if variant not in VARIANTS:
            raise ValueError(f"unknown kl variant '{variant}'; choose one of {', '.join(VARIANTS)}")
        super().__init__(bins)
        self.levels, self.variant = levels, variant
        if variant == "tpu_mlir":
            self.reductions = ("minmax", "sample", "zeros")

    def threshold(self) -> float:
        h = self.hist
        counts = h.abs_counts().astype(np.float64)
        if self.variant == "tpu_mlir":
            counts[0] -= h.zeros  # exact zeros say nothing about the range
        return (kl_threshold_bins(counts, self.levels) + 0.5) * h.width
