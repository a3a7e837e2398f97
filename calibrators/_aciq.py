"""ACIQ (Banner et al., "Post-training 4-bit quantization", 2019): analytical clipping.

For a bell-shaped tensor clipped to ``[mu - a, mu + a]`` and quantized to ``2**bits`` levels, the
expected error is the clipping error plus the rounding error ``a**2 / (3 * 4**bits)``:

* Laplace(b):  ``2 b**2 exp(-a / b)``
* Gauss(sigma): ``(a**2 + sigma**2) erfc(a / (sigma sqrt 2)) - a sigma sqrt(2/pi) exp(-a**2 / (2 sigma**2))``

The optimal ``a`` is a fixed multiple of ``b`` or ``sigma``, found here once per bit width by a
golden-section search (for 8 bits: about 9.89 b and 3.92 sigma).
"""

from __future__ import annotations

import math
from functools import lru_cache

from .histogram import DEFAULT_BINS, HistogramCalibrator, check_whole


def _laplace_error(a: float, bits: int) -> float:
    return 2 * math.exp(-a) + a * a / (3 * 4**bits)


def _gauss_error(a: float, bits: int) -> float:
    clip = (a * a + 1) * math.erfc(a / math.sqrt(2)) - a * math.sqrt(2 / math.pi) * math.exp(-a * a / 2)
    return clip + a * a / (3 * 4**bits)


@lru_cache(maxsize=None)
def optimal_ratio(distribution: str, bits: int = 8) -> float:
    """The clipping point in units of b (laplace) or sigma (gauss)."""
    error = {"laplace": _laplace_error, "gauss": _gauss_error}[distribution]
    lo, hi = 0.0, 50.0
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
        if error(a, bits) < error(b, bits):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


class ACIQCalibrator(HistogramCalibrator):
    distribution = ""
    reductions = ("minmax", "sample", "moments")  # narrowed by each fit to what it reads

    def __init__(self, bits: int = 8, bins: int = DEFAULT_BINS):
        super().__init__(bins)
        check_whole("bits", bits, 2, 16)
        self.bits = bits

    def mean(self) -> float:
        return self.hist.total / self.hist.n if self.hist.n else 0.0

    def spread(self) -> float:
        raise NotImplementedError

    def threshold(self) -> float:
        return abs(self.mean()) + optimal_ratio(self.distribution, self.bits) * self.spread()

    def result(self):
        from . import Range

        h = self.hist
        if not h.finite:
            return Range(math.nan, math.nan, math.nan)
        mu, a = self.mean(), optimal_ratio(self.distribution, self.bits) * self.spread()
        threshold = min(self.threshold(), h.peak())
        return Range(max(h.min, mu - a), min(h.max, mu + a), threshold)
