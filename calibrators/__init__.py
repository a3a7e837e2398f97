"""Calibration methods, one module each, found by name.

A calibrator keeps streaming state for one tensor: ``update(batch)`` folds in a batch,
``merge(other)`` folds in another calibrator's state (a shard of the same dataset), and
``result()`` gives the range and threshold as a ``Range``. ``state()`` returns that state as a
dict of numpy arrays and ``load_state(state)`` restores it (``--stats-out`` and ``qtool merge``).
Constructor keyword arguments are the method's parameters (``--param NAME=VALUE``).

A calibrator may also declare ``reductions`` (a subset of ``qtool.stats_graph.REDUCTIONS``) and
``update_reduced(batch_stats)``: the engine then computes those statistics inside onnxruntime and
never copies the tensor out, which is what keeps calibration near inference speed. Calibrators
without them receive each batch's full tensors through ``update``. Third parties add methods through the
entry-point group ``qtool.calibrators``, whose objects are calibrator classes with a ``name``.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points

REGISTRY: dict[str, type] = {}


@dataclass(frozen=True)
class Range:
    min: float
    max: float
    threshold: float  # for symmetric quantization: the tensor is taken as [-threshold, threshold]


def register(cls):
    REGISTRY[cls.name] = cls
    return cls


def _load_entry_points() -> None:
    for ep in entry_points(group="qtool.calibrators"):
        if ep.name not in REGISTRY:
            cls = ep.load()
            REGISTRY[ep.name] = cls


def names() -> list[str]:
    _load_entry_points()
    return sorted(REGISTRY)


def get(name: str) -> type:
    if name not in REGISTRY:
        _load_entry_points()
    if name not in REGISTRY:
        raise KeyError(f"unknown calibration method '{name}'; choose one of {', '.join(names())}")
    return REGISTRY[name]


from . import aciq_gauss, aciq_laplace, kl, minmax, mse, percentile  # noqa: E402,F401  (registration)
