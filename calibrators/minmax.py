"""Min/max: the running extremes, or their moving average over batches (TensorRT/ORT style)."""

from __future__ import annotations

import numpy as np

from . import Range, register


@register
class MinMax:
    name = "minmax"

    def __init__(self, moving_average: float | None = None):
        self.moving_average = moving_average
        self.min = np.inf
        self.max = -np.inf
        self.count = 0

    def update(self, x: np.ndarray) -> None:
        if x.size == 0:
            return
        lo, hi = float(x.min()), float(x.max())
        if self.moving_average is None or self.count == 0:
            self.min, self.max = min(self.min, lo), max(self.max, hi)
        else:
            c = self.moving_average
            self.min, self.max = self.min + c * (lo - self.min), self.max + c * (hi - self.max)
        self.count += 1

    def merge(self, other: "MinMax") -> None:
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)
        self.count += other.count

    def result(self) -> Range:
        return Range(self.min, self.max, max(abs(self.min), abs(self.max)))
