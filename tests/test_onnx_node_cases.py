"""The ONNX backend node cases of the standard quantized ops, run on the integer executor.

The installed onnx package generates them (``onnx.backend.test.case.node``): a small model, its
inputs and the spec's expected outputs. Every case of QuantizeLinear, DequantizeLinear,
DynamicQuantizeLinear (and its expanded form), QLinearConv, QLinearMatMul, ConvInteger and
MatMulInteger runs through ``IntegerExecutor``, in two ways:

* frozen: the case's parameter inputs (scales, zero points, weights) become initializers with the
  case's values, the data inputs stay inputs (x; both operands of QLinearMatMul and
  MatMulInteger, which run as activation x activation). This is how a quantized model holds them,
  and what the integer kernels take.
* fed (QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear): every input given at run time,
  as a scale or zero point computed in the graph is.

QLinearConv and QLinearMatMul requantize in float in the spec (``round(acc * S_x S_w / S_y)``)
while the executor uses a fixed-point multiplier: a difference of 1 there is allowed and counted.
Everything else must be exact: the int32 accumulators of ConvInteger/MatMulInteger, QuantizeLinear
(float at the boundary, as the spec computes it) and DequantizeLinear's floats, for every type
(4- and 2-bit integers, float8 and float4 held in ``ml_dtypes`` arrays) and blocked scales.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qtool.executor import IntegerExecutor

OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
       "ConvInteger", "MatMulInteger")
BOUNDARY = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}
FLOAT_REQUANT = {"QLinearConv", "QLinearMatMul"}  # the spec requantizes in float: +-1 allowed
RUNTIME_INPUTS = {"QLinearMatMul": {0, 3}, "MatMulInteger": {0, 1}}  # else input 0 only


def _op(case) -> str:
    """The case's op: its one node's, or for an expanded case (a function's body) the op it expands."""
    nodes = case.model.graph.node
    if len(nodes) == 1:
        return nodes[0].op_type
    return next(op for op in OPS if case.name.startswith(f"test_{op.lower()}"))


def _collect():
    import warnings

    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # other ops' generators warn about overflow in casts
        cases = collect_testcases("")
    return [c for c in cases if any(c.name.startswith(f"test_{op.lower()}") for op in OPS)
            and (len(c.model.graph.node) == 1 and c.model.graph.node[0].op_type in OPS
                 or c.name.endswith("_expanded"))]


CASES = _collect()


def _array(value) -> np.ndarray:
    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else np.asarray(value)


def _frozen(case) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The case's model with its parameter inputs as initializers, and the data feeds."""
    model = onnx.ModelProto.FromString(case.model.SerializeToString())
    node = model.graph.node[0]
    inputs, _ = case.data_sets[0]
    runtime = RUNTIME_INPUTS.get(_op(case), {0})
    values = dict(zip([vi.name for vi in model.graph.input], inputs))
    position = {name: i for i, name in enumerate(node.input)} if len(model.graph.node) == 1 else {}
    feeds, kept = {}, []
    for i, vi in enumerate(model.graph.input):
        if position.get(vi.name, i) in runtime:
            feeds[vi.name] = _array(values[vi.name])
            kept.append(vi)
        else:
            model.graph.initializer.append(numpy_helper.from_array(_array(values[vi.name]), vi.name))
    del model.graph.input[:]
    model.graph.input.extend(kept)
    return model, feeds


def _fed(case) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The case's model as generated, every input given at run time."""
    inputs, _ = case.data_sets[0]
    return case.model, {vi.name: _array(v) for vi, v in zip(case.model.graph.input, inputs)}


def _outcome(case, how=_frozen) -> tuple[str, str]:
    """("pass" | "pm1" | "fail", detail)."""
    op = _op(case)
    model, feeds = how(case)
    executor = IntegerExecutor(model)
    kinds = {s.kind for s in executor.steps}
    if "float" in kinds and not case.name.endswith("_expanded"):
        return "fail", f"ran in float: {executor.float_nodes()}"
    got = executor.run(feeds).outputs
    for vi, want in zip(model.graph.output, case.data_sets[0][1]):
        want, value = _array(want), got[vi.name]
        if value.shape != want.shape or value.dtype != want.dtype:
            return "fail", f"{vi.name}: got {value.dtype}{value.shape}, want {want.dtype}{want.shape}"
        if want.dtype.kind not in "iu":  # floats, and the float8/float4 types by their values
            if not np.array_equal(value.astype(np.float64), want.astype(np.float64), equal_nan=True):
                return "fail", f"{vi.name}: max |diff| {np.nanmax(np.abs(value.astype(np.float64) - want.astype(np.float64)))}"
            continue
        diff = np.abs(value.astype(np.int64) - want.astype(np.int64))
        if diff.max(initial=0) == 0:
            continue
        if op in FLOAT_REQUANT and diff.max() <= 1:
            return "pm1", f"{int((diff == 1).sum())} of {diff.size} elements off by 1"
        return "fail", f"{vi.name}: max |diff| {diff.max()}"
    return "pass", ""


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_node_case(case):
    outcome, detail = _outcome(case)
    assert outcome in ("pass", "pm1"), f"{case.name}: {detail}"


FED = [c for c in CASES if _op(c) in BOUNDARY]


@pytest.mark.parametrize("case", FED, ids=[c.name for c in FED])
def test_node_case_with_scales_at_run_time(case):
    outcome, detail = _outcome(case, _fed)
    assert outcome == "pass", f"{case.name}: {detail}"


def test_blocked_quantization_runs_as_the_spec_says():
    blocked = [c for c in CASES if any(a.name == "block_size" and a.i for a in c.model.graph.node[0].attribute)]
    assert len(blocked) >= 3, "onnx no longer generates blocked cases"
    for case in blocked:
        model, feeds = _frozen(case)
        assert [s.kind for s in IntegerExecutor(model).steps] == ["boundary"], case.name
        assert _outcome(case) == ("pass", "")


# pass / +-1 / fail per op, onnx 1.23 (the counts move with the onnx version)
EXPECTED_1_23 = {
    "QuantizeLinear": (13, 0, 0),
    "DequantizeLinear": (14, 0, 0),
    "DynamicQuantizeLinear": (6, 0, 0),
    "QLinearConv": (1, 0, 0),
    "QLinearMatMul": (8, 0, 0),
    "ConvInteger": (2, 0, 0),
    "MatMulInteger": (1, 0, 0),
}


def test_counts_per_op(record_property):
    counts = {op: Counter() for op in OPS}
    for case in CASES:
        counts[_op(case)][_outcome(case)[0]] += 1
    table = {op: (c["pass"], c["pm1"], c["fail"]) for op, c in counts.items()}
    record_property("node_case_counts", table)
    print("\nop: pass / +-1 / fail")
    for op, row in table.items():
        print(f"  {op}: {row[0]} / {row[1]} / {row[2]}")
    assert all(row[2] == 0 for row in table.values()), table
    assert all(row[0] + row[1] > 0 for row in table.values()), table  # every op really ran
    if onnx.__version__.startswith("1.23."):
        assert table == EXPECTED_1_23
