"""Plain ONNX ops on integer tensors, as a QOperator model uses them: exact numpy, no (S, Z).

* ``GatherTable``: Gather from a constant integer table (a lookup-table op: ``y = T[index]``).
* ``IntCast``: Cast between integer types where the target holds every source value.
* ``IntArith``: Add, Sub, Mul of integer tensors (the index offset before a table Gather),
  computed in int64; a result outside the output type raises ``OverflowError`` (ONNX would wrap).

Not in ``REGISTRY``: they are never the float op of a QDQ group. The executor lowers such nodes
to them when their inputs are integer tensors (qtool/qoperator_exec.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import IndexOutOfRange
from ..fixedpoint import int_range
from . import IntegerOp, NodeView, Unsupported, check_integer


@dataclass(frozen=True)
class GatherParams:
    values: np.ndarray  # not ``table``: params.lookup_tables looks for that name (QDQ LUT ops)
    axis: int


class GatherTable(IntegerOp):
    """Operand 0: the constant table (``value``); operand 1 the indices (reach ``run``)."""

    op_type = "Gather"

    def derive(self, view: NodeView) -> GatherParams:
        table = view.inputs[0].value if view.inputs[0] is not None else None
        if table is None:
            raise Unsupported("Gather data must be a constant table")
        if table.dtype.kind not in "iu":
            raise Unsupported(f"Gather table is {table.dtype}, not an integer type")
        return GatherParams(table, int(view.attr("axis", 0)))

    def elementwise(self, p: GatherParams) -> bool:
        return p.values.ndim == 1  # each index picks one value

    def run(self, p: GatherParams, index: np.ndarray) -> np.ndarray:
        check_integer(index)
        axis = p.axis + p.values.ndim if p.axis < 0 else p.axis
        size = p.values.shape[axis]
        if index.size and (index.min() < -size or index.max() >= size):
            bad = int(index.max()) if index.max() >= size else int(index.min())
            raise IndexOutOfRange(f"index {bad}, outside the {size} entries of its table (from {-size} to {size - 1})")
        return np.take(p.values, index.astype(np.int64), axis=axis)  # negative indices count back


@dataclass(frozen=True)
class CastParams:
    dtype: str


class IntCast(IntegerOp):
    op_type = "Cast"

    def derive(self, view: NodeView) -> CastParams:
        source = view.inputs[0].qparams.dtype
        target = str(view.output.dtype)
        lo, hi = int_range(source)
        t_lo, t_hi = int_range(target)
        if lo < t_lo or hi > t_hi:
            raise Unsupported(f"Cast from {source} to {target} may not hold every value")
        return CastParams(target)

    def elementwise(self, p: CastParams) -> bool:
        return True

    def run(self, p: CastParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        return x.astype(p.dtype)


@dataclass(frozen=True)
class ArithParams:
    op: str
    dtype: str


_ARITH = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}


class IntArith(IntegerOp):
    op_type = "IntArith"

    def derive(self, view: NodeView) -> ArithParams:
        if view.node.op_type not in _ARITH:
            raise Unsupported(f"{view.node.op_type} is not an integer elementwise op")
        int_range(view.output.dtype)  # a type the executor knows
        return ArithParams(view.node.op_type, str(view.output.dtype))

    def elementwise(self, p: ArithParams) -> bool:
        return True

    def run(self, p: ArithParams, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        check_integer(a, b)
        y = _ARITH[p.op](a.astype(np.int64), b.astype(np.int64))
        lo, hi = int_range(p.dtype)
        if y.size and (y.min() < lo or y.max() > hi):
            raise OverflowError(f"integer {p.op} leaves {p.dtype}")
        return y.astype(p.dtype)
