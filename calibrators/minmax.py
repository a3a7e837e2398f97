"""Min/max: the running extremes, or with ``moving_average=c`` an exponential moving average over
batches (``m <- m + c * (batch_m - m)``, as TensorFlow's and onnxruntime's calibrators offer).

Merging takes the extremes of both shards, which equals a single pass exactly for plain min/max;
a moving average depends on batch order and merges only approximately."""

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

    def state(self) -> dict[str, np.ndarray]:
        return {"scalars": np.array([self.min, self.max]), "integers": np.array([self.count])}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        self.min, self.max = (float(v) for v in state["scalars"])
        self.count = int(state["integers"][0])

    def result(self) -> Range:
        return Range(self.min, self.max, max(abs(self.min), abs(self.max)))
