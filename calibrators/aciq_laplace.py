"""ACIQ with a Laplace fit: clip at ``mu +- alpha * b`` (alpha ~ 9.89 for 8 bits), where
``b = E|x - mu|`` is read off the signed histogram (exact to one bin width)."""

from __future__ import annotations

import numpy as np

from . import register
from ._aciq import ACIQCalibrator


@register
class ACIQLaplace(ACIQCalibrator):
    name = "aciq_laplace"
    distribution = "laplace"
    reductions = ("minmax", "sample", "sum")  # the mean, and the spread from the histogram

    def spread(self) -> float:
        h = self.hist
        if not h.n:
            return 0.0
        centres = (np.arange(-h.bins, h.bins) + 0.5) * h.width
        return float(h.counts @ np.abs(centres - self.mean())) / h.n
