"""The parts of a graph output that joins tensors, so that verify scores each part on its own.

A detector's output often concatenates values of very different ranges: YOLOv8's [1, 84, N] holds
box coordinates in pixels (0-640) beside 80 class probabilities (0-1). Its whole-tensor cosine is
the boxes' (0.9993 with every class score destroyed), so verify compares each part as well.

Each input of the Concat an output joins (qtool/joins.py) is a part, or the parts of a join
that makes that input (YOLOX's levels, each boxes, objectness and class scores). Where the values of a part end
up in the output is found per batch shape by moving a map of part numbers through the same ops
(their shapes taken from the float model's run), so parts are exact whatever the transposes and
reshapes between the join and the output.
"""

from __future__ import annotations

import copy

import numpy as np

from ..joins import Join, part_map
from .compare import Comparison


class PartComparisons:
    """The running comparisons of one output's parts."""

    def __init__(self, join: Join):
        self.join = join
        self.parts = [Comparison(name) for name in join.parts()]
        self.unplaced = False  # the parts could not be placed in the output (then no figures)
        self._cache: dict[tuple, list[np.ndarray]] = {}

    def update(self, ref: np.ndarray, got: np.ndarray, shapes: dict[str, tuple]) -> None:
        if np.shape(ref) != np.shape(got):
            return  # the whole output's comparison counts the mismatch
        key = tuple(tuple(shapes[n]) for n in self.join.tensors())
        if key not in self._cache:
            labels = part_map(self.join, shapes)
            if labels is None or labels.shape != np.shape(ref):
                self._cache[key] = None
            else:
                self._cache[key] = [np.flatnonzero(labels == i) for i in range(len(self.parts))]
        where = self._cache[key]
        if where is None:
            self.unplaced = True
            return
        ref, got = np.ravel(ref), np.ravel(got)
        for part, index in zip(self.parts, where):
            part.update(ref[index], got[index])

    def take(self) -> "PartComparisons":
        """``Comparison.take`` for every part."""
        taken = copy.copy(self)
        taken.parts, taken._cache = [c.take() for c in self.parts], {}
        self.unplaced = False
        return taken

    def merge(self, other: "PartComparisons") -> None:
        for part, more in zip(self.parts, other.parts):
            part.merge(more)
        self.unplaced |= other.unplaced

    def worst(self) -> Comparison:
        return min(self.parts, key=lambda c: (c.sqnr, c.cosine))

    def to_dict(self) -> dict:
        return {"concat": self.join.node, "axis": self.join.axis,
                "parts": [c.to_dict() for c in self.parts], "worst": self.worst().name,
                "placed": not self.unplaced}
