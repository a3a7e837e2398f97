"""Min/max: the running extremes, or with ``moving_average=c`` an exponential moving average over
batches (``m <- m + c * (batch_m - m)``, as TensorFlow's and onnxruntime's calibrators offer).

Merging takes the extremes of both shards, which equals a single pass exactly for plain min/max;
a moving average depends on batch order and merges only approximately."""

from __future__ import annotations

import math

import numpy as np

from . import Range, register


@register
class MinMax:
    name = "minmax"

    reductions = ("minmax",)  # what the engine reduces inside onnxruntime (qtool.stats_graph)

    def __init__(self, moving_average: float | None = None):
        number = isinstance(moving_average, (int, float)) and not isinstance(moving_average, bool)
        if moving_average is not None and not (number and 0 < moving_average <= 1):
            raise ValueError(f"moving_average must be a number in (0, 1], got {moving_average!r}")
        self.moving_average = moving_average
        self.min = np.inf
        self.max = -np.inf
        self.count = 0
        self.nonfinite = False  # a NaN or Inf was seen: the result says so instead of hiding it

    def update(self, x: np.ndarray) -> None:
        if x.size:
            self._fold(float(x.min()), float(x.max()))

    def update_reduced(self, stats) -> None:
        self._fold(stats.min, stats.max)

    def _fold(self, lo: float, hi: float) -> None:
        if not (math.isfinite(lo) and math.isfinite(hi)):
            self.nonfinite = True
            return
        if self.moving_average is None or self.count == 0:
            self.min, self.max = min(self.min, lo), max(self.max, hi)
        else:
            c = self.moving_average
            self.min, self.max = self.min + c * (lo - self.min), self.max + c * (hi - self.max)
        self.count += 1

    def merge(self, other: "MinMax") -> None:
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)
        self.count += other.count
        self.nonfinite |= other.nonfinite

    def state(self) -> dict[str, np.ndarray]:
        return {"scalars": np.array([self.min, self.max]),
                "integers": np.array([self.count, int(self.nonfinite)])}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        self.min, self.max = (float(v) for v in state["scalars"])
        self.count, self.nonfinite = int(state["integers"][0]), bool(state["integers"][1])

    def result(self) -> Range:
        if self.nonfinite:
            return Range(math.nan, math.nan, math.nan)
        return Range(self.min, self.max, max(abs(self.min), abs(self.max)))
