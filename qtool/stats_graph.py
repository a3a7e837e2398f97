"""Statistics computed inside onnxruntime, in the same pass as the float model.

Copying every activation out of onnxruntime costs more than the inference itself (PP-OCRv4 rec
makes about 200 MB of activations per 48x320 line). So the float graph gets, right after each
calibrated tensor's producer, a few nodes whose small outputs are all that leaves the session:

* ``minmax``: ReduceMin and ReduceMax over every axis but the channel, finished in numpy;
* ``sum``: the element count and the sum; ``moments``: those and the sum of squares;
* ``zeros``: the number of exact zeros;
* ``sample``: for histograms, every ``k``-th element of each sample, where
  ``k = ceil(n / samples_per_tensor)`` and ``n`` is the tensor's size per sample: its static size
  (shapes inferred with the batch dim fixed) divided by the batch, or, when shape inference could
  not tell it, the same computed in the graph at run time. The subsample depends only on each
  sample, so batch sizes and shards do not change it; tensors of at most ``samples_per_tensor``
  elements per sample are taken whole.

Min, max and moments always cover every element; the histogram is binned in numpy from the
sample, with the range taken from the exact min and max. Each statistic costs one pass over the
tensor (the sample touches every k-th element), so calibrators ask only for what they use.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .model import default_opset

REDUCTIONS = ("minmax", "sum", "moments", "zeros", "sample")
DEFAULT_SAMPLES_PER_TENSOR = 4096


class BatchStats:
    """What one batch contributes for one tensor."""

    __slots__ = ("min", "max", "count", "total", "total_sq", "zeros", "sample")

    def __init__(self, min: float, max: float, count: int = 0, total: float = 0.0,
                 total_sq: float = 0.0, zeros: int = 0, sample: np.ndarray | None = None):
        self.min, self.max = min, max
        self.count = count  # elements (sum, moments)
        self.total, self.total_sq = total, total_sq
        self.zeros = zeros
        self.sample = sample  # float32 values to bin

    def __repr__(self) -> str:
        return (f"BatchStats(min={self.min}, max={self.max}, count={self.count}, total={self.total}, "
                f"total_sq={self.total_sq}, zeros={self.zeros}, "
                f"sample={None if self.sample is None else self.sample.shape})")


class _Builder:
    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.outputs: list[str] = []
        self.count = 0

    def name(self, base: str) -> str:
        self.count += 1
        return f"__qtool_stats_{self.count}_{base}"

    def const(self, value, dtype) -> str:
        name = self.name("const")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out


def build(model: onnx.ModelProto, tensors: list[str], types: dict[str, int],
          shapes: dict[str, list], reductions: set[str],
          samples_per_tensor: int = DEFAULT_SAMPLES_PER_TENSOR):
    """The model with statistics outputs; returns (model, {tensor: {statistic: output name}}).

    ``shapes`` gives each tensor's shape where known (batch dim first): static sizes, inferred
    with the batch dim fixed, let the subsampling stride be a constant.
    """
    unknown = set(reductions) - set(REDUCTIONS)
    if unknown:
        raise ValueError(f"unknown reductions {sorted(unknown)}; choose from {', '.join(REDUCTIONS)}")
    b = _Builder()
    layout: dict[str, dict[str, str]] = {}
    consts: dict[str, str] = {}

    def const(key, value, dtype):
        if key not in consts:
            consts[key] = b.const(value, dtype)
        return consts[key]

    opset = default_opset(model)

    def reduce(op_type: str, x: str, shape) -> str:
        """Min or max keeping the channel axis (rank >= 3): onnxruntime spreads such a reduction
        over its threads better than one over every axis; numpy finishes it over C values."""
        if not shape or len(shape) < 3:
            return b.op(op_type, [x], keepdims=0)
        axes = [a for a in range(len(shape)) if a != 1]
        if opset >= 18:  # axes became an input
            return b.op(op_type, [x, const(f"axes{len(shape)}", axes, np.int64)], keepdims=0)
        return b.op(op_type, [x], keepdims=0, axes=axes)

    def add_stats(t: str) -> None:
        x = t
        if types.get(t, TensorProto.FLOAT) != TensorProto.FLOAT:
            x = b.op("Cast", [t], to=TensorProto.FLOAT)
        out = {"min": reduce("ReduceMin", x, shapes.get(t)), "max": reduce("ReduceMax", x, shapes.get(t))}
        if "moments" in reductions or "sum" in reductions:  # float32 sums: ACIQ needs mean and spread
            out["count"] = b.op("Size", [x])
            out["total"] = b.op("ReduceSum", [x], keepdims=0)
        if "moments" in reductions:
            out["total_sq"] = b.op("ReduceSumSquare", [x], keepdims=0)
        if "zeros" in reductions:
            is_zero = b.op("Equal", [x, const("zero", 0.0, np.float32)])
            out["zeros"] = b.op("ReduceSum", [b.op("Cast", [is_zero], to=TensorProto.INT64)], keepdims=0)
        if "sample" in reductions:
            shape = shapes.get(t)
            step = 1 if shape == [] else _step(shape, samples_per_tensor, batch_dim)  # a scalar: itself
            if step == 1:
                out["sample"] = x
            else:
                if shape is None:  # rank unknown, maybe 0: Flatten needs rank >= 1, and [..., 1] flattens alike
                    x = (b.op("Unsqueeze", [x, const("last_axis", [-1], np.int64)]) if opset >= 13
                         else b.op("Unsqueeze", [x], axes=[-1]))
                flat = b.op("Flatten", [x], axis=1)  # [rows, n]
                if step is None:
                    # k = ceil(elements per sample / cap) with elements per sample = size / batch,
                    # known at run time: dim 0 may be the batch times something ([N*T, C])
                    per_sample = b.op("Div", [b.op("Cast", [b.op("Size", [x])], to=TensorProto.FLOAT),
                                              batch_size()])
                    # max(1, ...) in float: integer Max needs opset 12
                    ratio = b.op("Ceil", [b.op("Div", [per_sample,
                                                       const("cap", float(samples_per_tensor), np.float32)])])
                    k = b.op("Max", [ratio, const("one", 1.0, np.float32)])
                    step_input = b.op("Reshape", [b.op("Cast", [k], to=TensorProto.INT64),
                                                  const("shape1", [1], np.int64)])
                else:
                    step_input = const(f"step{step}", [step], np.int64)
                out["sample"] = b.op("Slice", [flat, const("start", [0], np.int64),
                                               const("end", [np.iinfo(np.int64).max], np.int64),
                                               const("axis1", [1], np.int64), step_input])
        layout[t] = out
        b.outputs.extend(out.values())

    inputs = {vi.name for vi in model.graph.input}
    first_input = next((vi for vi in model.graph.input if vi.name in shapes), None)
    batch_dim = (shapes.get(first_input.name) or [None])[0] if first_input is not None else None
    batch_node: list[str] = []

    def batch_size() -> str:
        """The run's batch size as float, from the first graph input (built once, at first use)."""
        if not batch_node:
            dims = b.op("Shape", [first_input.name])
            first = b.op("Gather", [dims, const("zero_index", 0, np.int64)], axis=0)
            batch_node.append(b.op("Cast", [first], to=TensorProto.FLOAT))
        return batch_node[0]

    wanted = set(tensors)
    for name in tensors:
        if name in inputs:
            add_stats(name)
    graph_nodes = list(b.nodes)
    for node in model.graph.node:
        b.nodes = []
        for o in node.output:
            if o in wanted and o not in inputs:
                add_stats(o)
        graph_nodes.append(node)
        graph_nodes.extend(b.nodes)  # right after the producer, so the tensor can be freed early
    out_model = onnx.ModelProto()
    out_model.CopyFrom(model)
    del out_model.graph.node[:]
    out_model.graph.node.extend(graph_nodes)
    out_model.graph.initializer.extend(b.inits)
    del out_model.graph.output[:]
    # a whole-tensor sample is the tensor itself, which may also be listed for another reason
    out_model.graph.output.extend(onnx.ValueInfoProto(name=o) for o in dict.fromkeys(b.outputs))
    return out_model, layout


def _step(shape, samples_per_tensor: int, batch_dim=None) -> int | None:
    """Subsampling stride from the static size per sample; None when only run time knows it.

    With a symbolic batch dim, the size per sample is static when every other dim is and dim 0 is
    the model input's batch dim (rows are samples). With shapes inferred for a fixed batch
    (``batch_dim`` an int), it is the static size divided by the batch, whatever dim 0 is
    ([N*T, C] included), as the run-time computation in the graph would find.
    """
    if not shape or not all(isinstance(d, int) and d > 0 for d in shape[1:]):
        return None
    if isinstance(batch_dim, int) and batch_dim > 0 and isinstance(shape[0], int) and shape[0] > 0:
        size = int(np.prod(shape, dtype=np.int64))
        if size % batch_dim:
            return None
        per_sample = size // batch_dim
    elif batch_dim is not None and shape[0] != batch_dim:
        return None
    else:
        per_sample = int(np.prod(shape[1:], dtype=np.int64))
    return max(1, -(-per_sample // samples_per_tensor))  # ceil: at most samples_per_tensor kept


def unpack(values: dict[str, np.ndarray], layout: dict[str, dict[str, str]]) -> dict[str, BatchStats]:
    """Each tensor's statistics of the batch; none for a tensor with no elements in it (a
    ConstantOfShape of a zero size: brainmaze's spindle detector makes [N, 0, 1])."""
    stats = {}
    for tensor, names in layout.items():
        lo, hi = values[names["min"]], values[names["max"]]
        if lo.size == 0 or np.any(lo > hi):  # nothing reduced: no channel, or min +inf above max -inf
            continue
        s = BatchStats(float(lo.min() if lo.ndim else lo), float(hi.max() if hi.ndim else hi))
        if "count" in names:
            s.count, s.total = int(values[names["count"]]), float(values[names["total"]])
            if "total_sq" in names:
                s.total_sq = float(values[names["total_sq"]])
        if "zeros" in names:
            s.zeros = int(values[names["zeros"]])
        if "sample" in names:
            s.sample = values[names["sample"]]
        stats[tensor] = s
    return stats
