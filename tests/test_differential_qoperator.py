"""The integer executor against onnxruntime on the same QOperator model, step by step.

Each model is quantized with ``QuantizeOptions(format="qoperator")``: QLinearConv, QLinearMatMul,
QGemm, QLinearAdd/Mul, QLinearAveragePool, QLinearGlobalAveragePool, QLinearLeakyRelu, table
Gathers, integer Clip and data movement on int8 tensors. onnxruntime runs the model and returns
every intermediate integer tensor; each integer step of the executor, fed onnxruntime's own
inputs, must give onnxruntime's output:

* within 1 LSB everywhere with 32-bit multipliers (onnxruntime requantizes with a float scale,
  the executor with a fixed-point multiplier; the two roundings may differ by one), within
  1 + 255/63 LSB with 8-bit multipliers (relative error below 1/63, as in test_differential.py);
* exactly for ops that only move or pick integers (MaxPool, Reshape, Clip, Gather, ...);
* the fraction exactly equal is printed per case (``-s``) and must be >= 99% over all single-op
  cases and on the demo model (>= 95% for each single op, as for QDQ).

The expected values are onnxruntime's; nothing here is computed by qtool's kernels.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.calibrate import calibrate
from qtool.executor import IntegerExecutor
from qtool.model import FloatRunner
from qtool.quantize import QuantizeOptions, quantize
from test_differential import CASES as BASE_CASES
from test_differential import _model
from test_differential_elementwise import CASES as ELEMENTWISE_CASES
from test_differential_elementwise import _model as _model_at_opset
from test_differential_layout import _model as _moves_model
from test_real_models import real_tables  # noqa: F401 (a fixture)

RNG = np.random.default_rng(777)
EXACT_OPS = {"MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Split",
             "Concat", "Resize", "Pad", "Clip", "Gather", "Cast", "Add", "Sub"}
# single-op cases whose op has a QOperator form (the others stay QDQ groups inside the model)
QOPERATOR_FORM = {"Conv": "QLinearConv", "MatMul": "QLinearMatMul", "Gemm": "QGemm", "Add": "QLinearAdd",
                  "Mul": "QLinearMul", "AveragePool": "QLinearAveragePool",
                  "GlobalAveragePool": "QLinearGlobalAveragePool", "LeakyRelu": "QLinearLeakyRelu",
                  "Relu": "Clip", "MaxPool": "MaxPool", "Flatten": "Flatten", "Reshape": "Reshape",
                  "Sigmoid": "Gather", "Tanh": "Gather", "Erf": "Gather", "HardSigmoid": "Gather",
                  "HardSwish": "Gather", "Gelu": "Gather", "Clip": "Clip"}


def _f(*values):
    return np.array(values, dtype=np.float32)


X = {"x": (8, 4, 6, 6)}
MOVE_CASES = {
    "transpose": (helper.make_node("Transpose", ["x"], ["y"], perm=[0, 2, 3, 1]), X, {}),
    "slice": (helper.make_node("Slice", ["x", "s", "e", "a"], ["y"]), X,
              {"s": np.array([1, 0], np.int64), "e": np.array([5, 3], np.int64),
               "a": np.array([2, 1], np.int64)}),
    "split": (helper.make_node("Split", ["x", "sizes"], ["y0", "y1"], axis=1), X,
              {"sizes": np.array([1, 3], np.int64)}),
    "concat": (helper.make_node("Concat", ["a", "b"], ["y"], axis=1),
               {"a": (8, 2, 5, 5), "b": (8, 3, 5, 5)}, {}),
    "pad": (helper.make_node("Pad", ["x", "pads"], ["y"], mode="constant"), X,
            {"pads": np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64)}),
    "resize_nearest": (helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest"), X,
                       {"scales": _f(1, 1, 2, 2)}),
    "squeeze_unsqueeze": (helper.make_node("Unsqueeze", ["x", "axes"], ["y"]), X,
                          {"axes": np.array([2], np.int64)}),
}


def _single_op_cases():
    cases = {}
    for name, (node, inputs, inits) in BASE_CASES.items():
        cases[name] = (lambda n=node, i=inputs, c=inits: _model(n, i, c), inputs, node, 1.0)
    for name, (node, inputs, inits, opset, spread) in ELEMENTWISE_CASES.items():
        if node.op_type == "Clip":  # ONNX Clip bounds are scalars (qoperator.py reads them as such)
            inits = {k: v.reshape(()) for k, v in inits.items()}
        cases[name] = (lambda n=node, i=inputs, c=inits, o=opset: _model_at_opset(n, i, c, o), inputs,
                       node, spread)
    for name, (node, inputs, inits) in MOVE_CASES.items():
        cases[name] = (lambda n=node, i=inputs, c=inits: _moves_model(n, i, c), inputs, node, 1.0)
    return cases


CASES = _single_op_cases()


def step_differences(qmodel, feeds, allow_float: bool = False):
    """Per integer step and output: (op_type, |executor - onnxruntime|) on onnxruntime's inputs.
    A group left in QDQ form inside the QOperator model is listed as ``QDQ:<op_type>``.
    The executor predicts this host's onnxruntime (``host``: u8 x s8 pair saturation where it has
    no VNNI), so the comparison holds on every CPU."""
    executor = IntegerExecutor(qmodel, arithmetic="host")
    assert allow_float or not executor.float_nodes(), executor.float_nodes()
    names = [o for node in qmodel.graph.node for o in node.output if o]
    reference = FloatRunner(qmodel, names).run(feeds)
    diffs = {}
    for step in executor.steps:
        if step.kind != "integer":
            continue
        values = [reference[n] if n in reference else executor.constants[n] for n in step.inputs]
        got = executor._run_step(step, values)
        for out, value in zip(step.outputs, got):
            want = reference[out]
            assert value.dtype == want.dtype and value.shape == want.shape, (step.node.name, out)
            op_type = f"QDQ:{step.node.op_type}" if step.absorbs else step.node.op_type
            diffs[out] = (op_type, np.abs(value.astype(np.int64) - want.astype(np.int64)))
    return executor, diffs


def _quantized(tmp_path, case, **options):
    build, inputs, node, spread = CASES[case]
    path = tmp_path / "m.onnx"
    onnx.save(build(), path)
    data = {n: (spread * RNG.normal(0.2, 1.0, s)).astype(np.float32) for n, s in inputs.items()}
    if case == "div_activation":  # as test_differential_elementwise: a divisor that rounds to 0 makes 0 / 0,
        data["b"] = np.abs(data["b"]) + np.float32(0.25)  # NaN, whose QuantizeLinear ONNX leaves open
    np.savez(tmp_path / "d.npz", **data)
    table = calibrate(path, tmp_path / "d.npz", progress=False)
    qmodel, report = quantize(path, table, QuantizeOptions(format="qoperator", **options))
    assert report.kept_float == []
    return qmodel, data, node


def _summary(diffs) -> tuple[int, float, int]:
    """(worst LSB, fraction exactly equal, element count) over every compared step output."""
    flat = np.concatenate([d.ravel() for _, d in diffs.values()])
    return int(flat.max(initial=0)), float(np.mean(flat == 0)) if flat.size else 1.0, int(flat.size)


TOTALS: dict[tuple, list] = {}


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_single_op_qoperator_matches_onnxruntime(tmp_path, case, symmetric, bits):
    qmodel, data, node = _quantized(tmp_path, case, symmetric=symmetric, multiplier_bits=bits)
    form = QOPERATOR_FORM.get(node.op_type)
    if form is not None:  # the op really is in QOperator form, not a QDQ group
        ops = {n.op_type for n in qmodel.graph.node}
        assert form in ops, f"{case}: {sorted(ops)}"
    executor, diffs = step_differences(qmodel, data)
    assert diffs, f"{case}: no integer step"
    worst, exact, size = _summary(diffs)
    print(f"\n{case} symmetric={symmetric} bits={bits}: worst {worst} LSB, {exact:.2%} exact of {size}")
    for op_type, d in diffs.values():
        if op_type in EXACT_OPS:
            assert int(d.max(initial=0)) == 0, f"{case}: {op_type} moves integers, must be exact"
    bound = 1 if bits == 32 else 1 + 255 / 63
    assert worst <= bound, f"{case}: {worst} LSB"
    if bits == 32:
        assert exact >= 0.95, f"{case}: only {exact:.1%} exactly equal"
        for op_type, d in diffs.values():
            total = TOTALS.setdefault(op_type, [0, 0, 0])
            total[0] += int((d == 0).sum())
            total[1] += d.size
            total[2] = max(total[2], int(d.max(initial=0)))


def test_single_op_cases_are_99_percent_exact():
    """Over every 32-bit single-op case run above (pytest runs this file's tests in order)."""
    if not TOTALS:
        pytest.skip("run with the single-op cases")
    print("\nop (32-bit multipliers): worst LSB, exactly equal")
    for op_type, (equal, size, worst) in sorted(TOTALS.items()):
        print(f"  {op_type:<26} {worst}  {equal / size:.3%} of {size}")
    equal = sum(t[0] for t in TOTALS.values())
    size = sum(t[1] for t in TOTALS.values())
    print(f"  all: {equal / size:.3%} of {size}")
    assert equal / size >= 0.99


@pytest.mark.parametrize("symmetric", [False, True])
def test_demo_qoperator_matches_onnxruntime(demo_model, demo_table, demo_heldout, symmetric):
    qmodel, _ = quantize(demo_model, demo_table, QuantizeOptions(format="qoperator", symmetric=symmetric))
    x = np.load(demo_heldout)["input"][:64]
    executor, diffs = step_differences(qmodel, {"input": x})
    kinds = [s.kind for s in executor.steps]
    assert kinds.count("integer") == 13 and "float" not in kinds
    worst, exact, size = _summary(diffs)
    print(f"\ndemo symmetric={symmetric}: worst {worst} LSB, {exact:.3%} exact of {size}")
    for name, (op_type, d) in diffs.items():
        print(f"  {op_type:<26} {name:<28} worst {int(d.max())}  exact {np.mean(d == 0):.3%}")
    assert worst <= 1
    assert exact >= 0.99
    # and end to end: the executor's logits against onnxruntime's on the whole model
    session = ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, {"input": x})[0]
    got = executor.run({"input": x}).outputs["logits"]
    assert np.mean(got.argmax(1) == want.argmax(1)) >= 0.98


@pytest.mark.parametrize("kind", ["rec", "det"])
def test_ppocr_qoperator_matches_onnxruntime(real_tables, kind):
    """PP-OCRv4 rec and det in QOperator form: every integer step within 1 LSB of onnxruntime.
    Only what quantize keeps float runs float (rec: the int64 shape arithmetic; LayerNormalization
    and Softmax, integer in the executor, stay DQ -> op -> Q in this form; det: nothing, its
    upsampling BatchNorms fold into their ConvTranspose)."""
    model, table, x = real_tables(kind)
    qmodel, report = quantize(model, table, QuantizeOptions(format="qoperator"))
    executor, diffs = step_differences(qmodel, {"x": x[:1]}, allow_float=True)
    ran_float = {(t, n) for t, n, _ in executor.float_nodes()}
    assert ran_float <= {(t, n) for t, n, _ in report.kept_float}  # nothing else falls back
    assert {"QLinearConv", "QLinearAdd", "Gather"} <= {op for op, _ in diffs.values()}
    worst, exact, size = _summary(diffs)
    print(f"\nPP-OCRv4 {kind}: {len(diffs)} integer tensors, worst {worst} LSB, "
          f"{exact:.5%} exact of {size}")
    assert worst <= 1 and exact >= 0.999
