"""The ONNX backend node cases of the standard quantized ops, run on the integer executor.

The installed onnx package generates them (``onnx.backend.test.case.node``): a one-node model,
its inputs and the spec's expected outputs. Every case of QuantizeLinear, DequantizeLinear,
QLinearConv, QLinearMatMul, ConvInteger and MatMulInteger runs through ``IntegerExecutor``.

* The executor resolves scales, zero points and weights at setup (integer-only kernels), so the
  case's parameter inputs become initializers with the case's values; the data inputs stay inputs
  (x; both operands of QLinearMatMul and MatMulInteger, which run as activation x activation).
* QLinearConv and QLinearMatMul requantize in float in the spec (``round(acc * S_x S_w / S_y)``)
  while the executor uses a fixed-point multiplier: a difference of 1 there is allowed and
  counted. Everything else must be exact: the int32 accumulators of ConvInteger/MatMulInteger,
  QuantizeLinear (float at the boundary, as the spec computes it) and DequantizeLinear's floats.
* Out of scope, skipped and counted: float8/int4/uint4/int2/uint2/float4 types (qtool quantizes
  to 8 and 16-bit integers) and blocked quantization (``block_size``), which the executor must
  refuse with a clear error rather than compute something else.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from qtool.errors import QtoolError
from qtool.executor import IntegerExecutor

OPS = ("QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger",
       "MatMulInteger")
FLOAT_REQUANT = {"QLinearConv", "QLinearMatMul"}  # the spec requantizes in float: +-1 allowed
RUNTIME_INPUTS = {"QLinearMatMul": {0, 3}, "MatMulInteger": {0, 1}}  # else input 0 only
OUT_OF_SCOPE_TYPES = {
    getattr(TensorProto, name): name.lower()
    for name in ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT8E8M0",
                 "INT4", "UINT4", "INT2", "UINT2", "FLOAT4E2M1")
    if hasattr(TensorProto, name)}


def _collect():
    import warnings

    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # other ops' generators warn about overflow in casts
        cases = collect_testcases("")
    return [c for c in cases if len(c.model.graph.node) == 1 and c.model.graph.node[0].op_type in OPS]


CASES = _collect()


def _skip_reason(case) -> str | None:
    node = case.model.graph.node[0]
    graph = case.model.graph
    for vi in list(graph.input) + list(graph.output):
        elem = vi.type.tensor_type.elem_type
        if elem in OUT_OF_SCOPE_TYPES:
            return f"{OUT_OF_SCOPE_TYPES[elem]} type (qtool quantizes to 8/16-bit integers)"
    if any(a.name == "block_size" and a.i for a in node.attribute):
        return "blocked quantization (block_size)"
    return None


def _frozen(case) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The case's model with its parameter inputs as initializers, and the data feeds."""
    model = onnx.ModelProto.FromString(case.model.SerializeToString())
    node = model.graph.node[0]
    inputs, _ = case.data_sets[0]
    runtime = RUNTIME_INPUTS.get(node.op_type, {0})
    values = dict(zip([vi.name for vi in model.graph.input], inputs))
    position = {name: i for i, name in enumerate(node.input)}
    feeds, kept = {}, []
    for vi in model.graph.input:
        if position.get(vi.name) in runtime:
            feeds[vi.name] = np.asarray(values[vi.name])
            kept.append(vi)
        else:
            model.graph.initializer.append(numpy_helper.from_array(np.asarray(values[vi.name]), vi.name))
    del model.graph.input[:]
    model.graph.input.extend(kept)
    return model, feeds


def _outcome(case) -> tuple[str, str]:
    """("pass" | "pm1" | "fail" | "skip", detail)."""
    op = case.model.graph.node[0].op_type
    reason = _skip_reason(case)
    if reason is not None:
        return "skip", reason
    model, feeds = _frozen(case)
    executor = IntegerExecutor(model)
    kinds = {s.kind for s in executor.steps}
    if "float" in kinds:
        return "fail", f"ran in float: {executor.float_nodes()}"
    got = executor.run(feeds).outputs[model.graph.output[0].name]
    want = np.asarray(case.data_sets[0][1][0])
    if got.shape != want.shape or got.dtype != want.dtype:
        return "fail", f"got {got.dtype}{got.shape}, want {want.dtype}{want.shape}"
    if want.dtype.kind == "f":
        same = np.array_equal(got, want, equal_nan=True)
        return ("pass", "") if same else ("fail", f"max |diff| {np.abs(got - want).max()}")
    diff = np.abs(got.astype(np.int64) - want.astype(np.int64))
    if diff.max(initial=0) == 0:
        return "pass", ""
    if op in FLOAT_REQUANT and diff.max() <= 1:
        return "pm1", f"{int((diff == 1).sum())} of {diff.size} elements off by 1"
    return "fail", f"max |diff| {diff.max()}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_node_case(case):
    outcome, detail = _outcome(case)
    if outcome == "skip":
        pytest.skip(detail)
    assert outcome in ("pass", "pm1"), f"{case.name}: {detail}"


def test_blocked_quantization_is_refused_by_name():
    blocked = [c for c in CASES if _skip_reason(c) == "blocked quantization (block_size)"]
    assert blocked, "onnx no longer generates blocked cases"
    for case in blocked:
        model, _ = _frozen(case)
        with pytest.raises(QtoolError, match="blocked quantization"):
            IntegerExecutor(model)


# pass / +-1 / fail / skipped per op, onnx 1.23 (the counts move with the onnx version)
EXPECTED_1_23 = {
    "QuantizeLinear": (4, 0, 0, 9),
    "DequantizeLinear": (4, 0, 0, 10),
    "QLinearConv": (1, 0, 0, 0),
    "QLinearMatMul": (8, 0, 0, 0),
    "ConvInteger": (2, 0, 0, 0),
    "MatMulInteger": (1, 0, 0, 0),
}


def test_counts_per_op(record_property):
    counts = {op: Counter() for op in OPS}
    for case in CASES:
        counts[case.model.graph.node[0].op_type][_outcome(case)[0]] += 1
    table = {op: (c["pass"], c["pm1"], c["fail"], c["skip"]) for op, c in counts.items()}
    record_property("node_case_counts", table)
    print("\nop: pass / +-1 / fail / skipped")
    for op, row in table.items():
        print(f"  {op}: {row[0]} / {row[1]} / {row[2]} / {row[3]}")
    assert all(row[2] == 0 for row in table.values()), table
    assert all(row[0] + row[1] > 0 for row in table.values()), table  # every op really ran
    if onnx.__version__.startswith("1.23."):
        assert table == EXPECTED_1_23
