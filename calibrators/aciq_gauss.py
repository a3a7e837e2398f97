"""ACIQ with a Gaussian fit: clip at ``mu +- alpha * sigma`` (alpha ~ 3.92 for 8 bits).

``mu`` and ``sigma`` come from the exact running sum and sum of squares, so shards merge exactly;
the histogram is not read, so the engine bins nothing for it.
"""

from __future__ import annotations

import math

from . import register
from ._aciq import ACIQCalibrator


@register
class ACIQGauss(ACIQCalibrator):
    name = "aciq_gauss"
    distribution = "gauss"
    # mean and sigma from the moments, the clip to the exact min/max: no histogram sample needed
    reductions = ("minmax", "moments")

    def spread(self) -> float:
        h = self.hist
        if not h.n:
            return 0.0
        return math.sqrt(max(h.total_sq / h.n - self.mean() ** 2, 0.0))
