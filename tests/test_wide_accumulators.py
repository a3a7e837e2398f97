"""16-bit activations and 64-bit accumulators (TFLite's 16x8 semantics): an int16 x int8 or
int16 x int16 Conv/Gemm/MatMul whose sums can leave int32 accumulates in int64, and its multiplier
is narrowed (qtool.fixedpoint.narrowed) so that ``acc * multiplier`` is still one int64. The
reference is the exact rational: ``round(acc * S_x * S_w / S_y)``, computed with Python integers
and fractions, never with the code under test.
"""

from fractions import Fraction

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings, strategies as st
from onnx import helper

from qtool.fixedpoint import INT32_MAX, Requant, narrowed, quantize_multipliers, requantize
from qtool.ops import NodeView, Operand
from qtool.ops.conv import Conv
from qtool.ops.gemm import Gemm, MatMul
from qtool.qparams import QParams
from qtool.executor import IntegerExecutor
from qtool.quantize import QuantizeOptions, quantize
from qtool.calibrate import calibrate
from qtool.verify import verify
from test_masks import attention_data, attention_model

RNG = np.random.default_rng(16)


def _exact(acc: np.ndarray, scale: Fraction, dtype: str) -> np.ndarray:
    """round half up of acc * scale, saturated, with exact rationals"""
    lo, hi = {"int8": (-128, 127), "int16": (-32768, 32767)}[dtype]
    flat = [min(hi, max(lo, int((Fraction(int(a)) * scale + Fraction(1, 2)).__floor__()))) for a in acc.reshape(-1)]
    return np.array(flat, dtype=np.int64).reshape(acc.shape)


def test_narrowed_multipliers_fit_int64_and_keep_int32_ones():
    r = Requant(np.array([2**31 - 1, 1356797349, 2**30]), np.array([40, 40, 45]))
    same = narrowed(r, np.array([INT32_MAX, INT32_MAX, 2**31 - 1]))
    assert same is r  # an int32 accumulator keeps its 31-bit multiplier
    wide = narrowed(r, np.array([2**40, 2**36, 2**47]))
    # 2**40 needs 41 bits: 22 bits left; 2**36 -> 26 bits; 2**47 -> 15 bits
    assert wide.multiplier.tolist() == [2**22, round(1356797349 / 2**5), 2**14]
    assert wide.rshift.tolist() == [31, 35, 29]
    for m, b in zip(wide.multiplier, [2**40, 2**36, 2**47]):
        assert int(m) * b < 2**63 + int(m)  # |acc| <= bound: the product fits int64


@settings(max_examples=200, deadline=None)
@given(st.integers(-(2**46), 2**46), st.floats(1e-12, 1e-3))
def test_a_narrowed_requantization_is_within_one_step_of_the_exact_value(acc, scale):
    r = narrowed(quantize_multipliers(np.array([scale])), np.array([2**46]))
    got = int(requantize(np.array([acc], np.int64), r.multiplier, r.rshift)[0])
    exact = Fraction(acc) * Fraction(scale)
    assert abs(Fraction(got) - exact) <= Fraction(1, 2) + abs(exact) * Fraction(1, 2**14)


def test_an_unnarrowed_wide_accumulator_is_refused():
    with pytest.raises(OverflowError, match="not narrowed"):
        requantize(np.array([2**40], np.int64), np.array([2**30]), np.array([40]))


def _node(op, inputs, **attrs):
    return helper.make_node(op, inputs, ["y"], **attrs)


def test_int16_attention_matmul_accumulates_in_int64():
    """Q.K^T with int16 operands over K = 64 at full range: sums up to 2**36."""
    a_qp, b_qp = QParams(np.float32(0.01), 0, "int16"), QParams(np.float32(0.02), 0, "int16")
    y_qp = QParams(np.float32(40.0), 0, "int16")
    a = RNG.integers(-32768, 32768, (2, 3, 5, 64)).astype(np.int16)
    b = RNG.integers(-32768, 32768, (2, 3, 64, 7)).astype(np.int16)
    a[0, 0, 0] = 32767
    b[0, 0, :, 0] = 32767
    acc = a.astype(np.int64) @ b.astype(np.int64)
    assert np.abs(acc).max() > INT32_MAX  # the case needs 64 bits
    op = MatMul()
    params = op.derive(NodeView(_node("MatMul", ["a", "b"]), [Operand(a_qp), Operand(b_qp)], y_qp))
    got = op.run(params, a, b).astype(np.int64)
    scale = Fraction(float(a_qp.scale)) * Fraction(float(b_qp.scale)) / Fraction(float(y_qp.scale))
    want = _exact(acc, scale, "int16")
    assert np.abs(got - want).max() <= 1 and np.mean(got == want) > 0.99


@pytest.mark.parametrize("op_type", ["Gemm", "Conv"])
def test_int16_by_int8_layers_accumulate_in_int64(op_type):
    """int16 x int8 with long rows of large weights: sums beyond int32."""
    x_qp, y_qp = QParams(np.float32(0.001), 0, "int16"), QParams(np.float32(0.5), 0, "int16")
    if op_type == "Gemm":
        w = RNG.integers(-127, 128, (3072, 6)).astype(np.int8)
        w[:, 0] = 127
        x = RNG.integers(-32768, 32768, (4, 3072)).astype(np.int16)
        x[0] = 32767
        acc = x.astype(np.int64) @ w.astype(np.int64)
        node, op = _node("Gemm", ["x", "w"]), Gemm()
    else:
        w = RNG.integers(-127, 128, (6, 256, 3, 3)).astype(np.int8)
        w[0] = 127
        x = RNG.integers(-32768, 32768, (2, 256, 5, 5)).astype(np.int16)
        x[0, :, :3, :3] = 32767
        acc = np.einsum("nchw,kchw->nk", x[:, :, :3, :3].astype(np.int64), w.astype(np.int64))[:, :, None, None]
        node, op = _node("Conv", ["x", "w"], kernel_shape=[3, 3]), Conv()
    w_qp = QParams(np.full(6, 0.004, np.float32), np.zeros(6, np.int64), "int8", 1 if op_type == "Gemm" else 0)
    assert np.abs(acc).max() > INT32_MAX
    params = op.derive(NodeView(node, [Operand(x_qp), Operand(w_qp, w)], y_qp))
    got = op.run(op.specialize(params, [x.shape]), x).astype(np.int64)
    got = got if op_type == "Gemm" else got[:, :, :1, :1]
    scale = Fraction(float(x_qp.scale)) * Fraction(float(np.float32(0.004))) / Fraction(float(y_qp.scale))
    want = _exact(acc, scale, "int16")
    assert np.abs(got - want).max() <= 1 and np.mean(got == want) > 0.95


def test_an_int16_transformer_whose_attention_leaves_int32_verifies(tmp_path):
    """Self-attention with Q = K (the same projection): the diagonal scores are |q|^2, and at
    int16 their integer sums pass 2**31. The executor used to refuse the model ("int32
    accumulator overflow in MatMul node"); now it runs it integer, as close to float as
    onnxruntime running the same QDQ graph in float."""
    model = attention_model(tmp_path / "m.onnx", same_qk=True, scale=4.0)
    data_path = attention_data(tmp_path / "d.npz", seed=2)
    qmodel, _ = quantize(model, calibrate(model, data_path, progress=False), QuantizeOptions(activation_type="int16"))
    executor = IntegerExecutor(qmodel)
    data = dict(np.load(data_path))
    result = executor.run({"x": data["x"], "mask": data["mask"]}, keep_integer=True)
    q, k = result.integer["l0_qh"].astype(np.int64), result.integer["l0_kh"].astype(np.int64)
    assert np.abs(q @ k).max() > INT32_MAX  # the attention sums need 64 bits
    onnx.save(qmodel, tmp_path / "q.onnx")
    outcome = verify(model, tmp_path / "q.onnx", data_path, progress=False)
    assert outcome.passed
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    written = ort.InferenceSession(str(tmp_path / "q.onnx"), options, providers=["CPUExecutionProvider"])
    reference = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    feeds = {"x": data["x"], "mask": data["mask"]}
    want = reference.run(None, feeds)[0].astype(np.float64)
    as_written = written.run(None, feeds)[0]
    sqnr = lambda got: 10 * np.log10((want ** 2).sum() / ((want - got) ** 2).sum())
    assert sqnr(result.outputs["pooled"]) > sqnr(as_written) - 1.5 and sqnr(result.outputs["pooled"]) > 20
