"""The executor's fast forms against its plain ones: the compiled requantization (numba), onnxruntime's
float32 Conv as the summing engine, and the garbage collector paused during a run."""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest

from qtool.fixedpoint import Requant, narrowed, offset_requant
from qtool.ops import REGISTRY, compiled, conv, ortconv, parallel
from qtool.ops.conv import ConvParams, ConvPlan, run_scanned

needs_numba = pytest.mark.skipif(not compiled.available(), reason="numba is not installed")


def _exact(channels, dtype, zero_out, seed, trailing=2, shifts=(10, 40)):
    """An ``OffsetRequant`` for random channels (biases, 31-bit multipliers, shifts), one per entry
    of axis 1 of sums with ``trailing`` more axes, and the bound."""
    rng = np.random.default_rng(seed)
    bias = rng.integers(-50_000, 50_000, channels)
    multiplier = rng.integers(2**30, 2**31, channels)
    rshift = rng.integers(*shifts, channels)
    bound = np.full(channels, 127 * 128 * 9)
    column = (slice(None),) + (None,) * trailing
    exact, unproven = offset_requant(bias[column], Requant(multiplier[column], rshift[column]), zero_out, dtype,
                                     "half_up", bound[column])
    assert unproven.size == 0
    return exact, bound[0]


def _sums(shape, bound, seed):
    """Integer-valued float32 sums within ``bound``, both ends included."""
    rng = np.random.default_rng(seed)
    acc = rng.integers(-bound, bound + 1, size=shape).astype(np.float32)
    acc.reshape(-1)[:2] = (-bound, bound)
    return acc


@needs_numba
@pytest.mark.parametrize("dtype, zero_out, shifts", [
    ("int8", -7, (10, 40)), ("uint8", 128, (10, 40)), ("int32", 5, (10, 40)), ("int8", 0, (10, 40)),
    ("int8", -7, (58, 62)),  # Z_y * 2**r leaves int64: the zero point is added after the shift
])
def test_compiled_requant_equals_numpy_form(dtype, zero_out, shifts):
    exact, bound = _exact(6, dtype, zero_out, seed=len(dtype) + abs(zero_out), shifts=shifts)
    assert (exact.zero_out != 0) == (shifts[0] > 50)
    fast = compiled.requantizer(exact)
    assert isinstance(fast, compiled.CompiledRequant)
    acc = _sums((2, 6, 5, 7), bound, seed=1)
    assert fast(acc).tolist() == exact(acc).tolist()
    # rows of whole arrays, as a Conv splits them over threads, and a strided view
    out = np.zeros(acc.shape, dtype=dtype)
    fast.rows(acc, out, 1, 4)
    assert out[:, :, 1:4].tolist() == exact(acc)[:, :, 1:4].tolist() and not out[:, :, :1].any()
    view = acc[:, :, ::2, 1:]
    assert fast(view).tolist() == exact(view).tolist()


@needs_numba
def test_compiled_requant_on_a_matmul_and_other_shapes():
    # a MatMul's [rows, N] sums have one channel per column
    rng = np.random.default_rng(3)
    bias, multiplier, rshift = rng.integers(-999, 999, 5), rng.integers(2**30, 2**31, 5), rng.integers(12, 30, 5)
    exact, _ = offset_requant(bias, Requant(multiplier, rshift), 3, "int8", "half_up", np.full(5, 2**20))
    fast = compiled.requantizer(exact)
    acc = _sums((9, 5), 2**20, seed=4)
    assert fast(acc).tolist() == exact(acc).tolist()
    # shapes the loop does not take (a ConvTranspose's 6-D view) go to the numpy form
    exact, bound = _exact(3, "int8", 1, seed=5, trailing=4)
    six = _sums((1, 3, 2, 2, 2, 2), bound, seed=6)
    assert compiled.requantizer(exact)(six).tolist() == exact(six).tolist()


def test_requantizer_is_the_numpy_form_without_numba(monkeypatch):
    exact, _ = _exact(2, "int8", 0, seed=7)
    monkeypatch.setattr(compiled, "ENABLED", False)
    assert compiled.requantizer(exact) is exact
    monkeypatch.setattr(compiled, "ENABLED", True)
    monkeypatch.setattr(compiled, "_loops", False)  # as when ``import numba`` failed
    assert not compiled.available() and compiled.requantizer(exact) is exact


def _params(weight, zero_in, pads=(0, 0, 0, 0), strides=(1, 1), dilations=(1, 1), group=1):
    c_out = weight.shape[0]
    return ConvParams(weight=weight, bias=np.arange(c_out, dtype=np.int64) * 7 - 9,
                      requant=Requant(np.full(c_out, 2**30, np.int64), np.full(c_out, 36, np.int64)),
                      zero_in=zero_in, zero_out=-3, pads=pads, strides=strides, dilations=dilations,
                      group=group, rounding="half_up", dtype="int8")


@pytest.mark.parametrize("shape, c_out, kernel, pads, strides, dilations, group", [
    ((1, 2, 2, 3), 4, (3, 3), (2, 2, 2, 2), (1, 1), (1, 1), 1),  # padding reaches every output: whole map
    ((2, 3, 6, 5), 3, (3, 2), (0, 3, 2, 0), (2, 1), (1, 2), 3),  # one-sided pads, depthwise, strided, dilated
    ((1, 4, 5, 5), 4, (1, 1), (1, 1, 1, 1), (1, 1), (1, 1), 2),  # a 1x1 whose border is all padding
])
def test_onnxruntime_engine_restores_the_zero_point_padding(shape, c_out, kernel, pads, strides, dilations, group):
    rng = np.random.default_rng(sum(shape))
    weight = rng.integers(-127, 128, size=(c_out, shape[1] // group, *kernel)).astype(np.int8)
    p = _params(weight, zero_in=-77, pads=pads, strides=strides, dilations=dilations, group=group)
    plan = REGISTRY["Conv"].specialize(p, [shape])
    assert plan.engine(np.dtype(np.int8)) is not None
    x = rng.integers(-128, 128, size=shape).astype(np.int8)
    assert (REGISTRY["Conv"].run(plan, x) == run_scanned(p, x)).all()
    assert np.array_equal(plan.engine(np.dtype(np.int8))(x), plan.numpy_sums(x))


def _int16_params(weight, pads, strides, dilations, group):
    """An int16-activation Conv (zero point 0, int16 output) whose sums leave int32: the
    multipliers are narrowed for a 64-bit accumulator, as quantize writes them."""
    c_out = weight.shape[0]
    l1 = np.abs(weight.astype(np.int64)).reshape(c_out, -1).sum(axis=1)
    requant = narrowed(Requant(np.full(c_out, 2**31 - 1, np.int64), np.full(c_out, 44, np.int64)), l1 * 32768 + 10**6)
    return ConvParams(weight=weight, bias=np.arange(c_out, dtype=np.int64) * 99991 - 7, requant=requant,
                      zero_in=0, zero_out=0, pads=pads, strides=strides, dilations=dilations, group=group,
                      rounding="half_up", dtype="int16")


@pytest.mark.parametrize("engine, numba_on, integer", [(True, True, True), (True, True, False), (False, True, True),
                                                       (True, False, True)])
@pytest.mark.parametrize("shape, c_out, kernel, pads, strides, dilations, group", [
    ((2, 8, 7, 9), 6, (3, 3), (1, 1, 1, 1), (1, 1), (1, 1), 1),  # im2col
    ((1, 16, 6, 6), 16, (3, 3), (1, 0, 2, 1), (2, 2), (1, 1), 16),  # depthwise, strided, one-sided pads
    ((2, 12, 5, 4), 4, (1, 1), (0, 0, 0, 0), (1, 1), (1, 1), 1),  # pointwise
    ((1, 6, 9, 9), 3, (3, 3), (0, 0, 0, 0), (1, 1), (2, 2), 1),  # taps (fewer outputs), dilated
    # large enough for the engine's sessions by ranges of output channels, each range joined apart
    ((2, 24, 48, 48), 24, (3, 3), (1, 1, 1, 1), (1, 1), (1, 1), 24),
    ((2, 16, 48, 48), 40, (1, 1), (0, 0, 0, 0), (1, 1), (1, 1), 1),
])
def test_int16_input_as_two_byte_halves_equals_the_exact_path(engine, numba_on, integer, shape, c_out, kernel,
                                                              pads, strides, dilations, group, monkeypatch):
    monkeypatch.setattr(ortconv, "ENABLED", engine)
    monkeypatch.setattr(ortconv, "INTEGER", integer)
    monkeypatch.setattr(compiled, "ENABLED", numba_on)
    rng = np.random.default_rng(sum(shape) + c_out)
    weight = rng.integers(-127, 128, size=(c_out, shape[1] // group, *kernel)).astype(np.int8)
    p = _int16_params(weight, pads, strides, dilations, group)
    plan = REGISTRY["Conv"].specialize(p, [shape])
    assert plan.split16 is not None
    # the extremes of int16 (whose high byte is -128 or 127, low byte 0 or 255) and random values
    x = rng.choice(np.array([-32768, -32767, -256, -255, -1, 0, 1, 255, 256, 32767], np.int16), size=shape)
    x[0, 0] = rng.integers(-32768, 32768, size=shape[2:])
    got = REGISTRY["Conv"].run(plan, x)
    assert got.dtype == np.int16 and np.array_equal(got, run_scanned(p, x))
    if group == shape[1] and numba_on and plan.out_hw[1] >= conv.DEPTHWISE_ROWS_FROM:
        # a depthwise conv with rows this wide takes the one-pass compiled kernel instead
        assert plan.depthwise16 is not None and "split16" not in plan.engines
        return
    high = plan.engines["split16"][0]
    assert (high is not None) == engine
    if engine:  # dense convs on ConvInteger unless switched off
        assert high.integer == (integer and group == 1)
    if engine and shape[2] > 40:  # one session a core
        assert len(high.parts) == min(parallel.WORKERS, shape[1])


@pytest.mark.parametrize("shape, c_out, kernel, pads, strides, dilations", [
    ((2, 5, 7, 9), 5, (3, 3), (1, 1, 1, 1), (1, 1), (1, 1)),
    ((1, 4, 11, 10), 8, (3, 3), (0, 2, 1, 0), (2, 1), (1, 1)),  # two outputs per input, one-sided pads
    ((2, 3, 9, 12), 3, (5, 5), (2, 2, 2, 2), (1, 2), (1, 1)),
    ((1, 6, 8, 8), 6, (3, 3), (2, 2, 2, 2), (1, 1), (2, 2)),  # dilated
    ((1, 2, 3, 3), 2, (5, 5), (3, 3, 3, 3), (2, 2), (1, 1)),  # taps wholly on padding
    ((1, 4, 1, 40), 4, (1, 7), (0, 3, 0, 3), (1, 1), (1, 1)),  # a 1-D depthwise conv
])
def test_int16_depthwise_in_one_compiled_pass_equals_the_exact_path(shape, c_out, kernel, pads, strides,
                                                                     dilations, monkeypatch):
    if not compiled.available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(conv, "DEPTHWISE_ROWS_FROM", 1)  # these small shapes too
    rng = np.random.default_rng(sum(shape) + c_out)
    weight = rng.integers(-127, 128, size=(c_out, 1, *kernel)).astype(np.int8)
    weight[0] = 127  # the largest sums the kernel must hold exactly
    p = _int16_params(weight, pads, strides, dilations, shape[1])
    plan = REGISTRY["Conv"].specialize(p, [shape])
    assert plan.depthwise16 is not None
    x = rng.choice(np.array([-32768, -32767, -256, -1, 0, 1, 255, 32767], np.int16), size=shape)
    x[0, 0] = 32767
    x[-1, -1] = rng.integers(-32768, 32768, size=shape[2:])
    got = REGISTRY["Conv"].run(plan, x)
    assert got.dtype == np.int16 and np.array_equal(got, run_scanned(p, x))
    assert "split16" not in plan.engines


def test_int16_depthwise_with_narrow_rows_keeps_the_byte_halves():
    weight = np.ones((4, 1, 3, 3), np.int8)
    p = _int16_params(weight, (1, 1, 1, 1), (1, 1), (1, 1), 4)
    wide = REGISTRY["Conv"].specialize(p, [(1, 4, 8, conv.DEPTHWISE_ROWS_FROM)])
    narrow = REGISTRY["Conv"].specialize(p, [(1, 4, 8, conv.DEPTHWISE_ROWS_FROM - 1)])
    assert (wide.depthwise16 is not None) == compiled.available() and narrow.depthwise16 is None


def test_int16_depthwise_whose_bias_may_overflow_keeps_the_scanning_path():
    # as test_int16_split_raises_where_the_exact_path_does: a channel the one-pass kernel could not
    # refuse goes to the paths that do
    weight = np.full((3, 1, 3, 3), 127, np.int8)
    p = dataclasses.replace(_int16_params(weight, (0, 0, 0, 0), (1, 1), (1, 1), 3),
                            bias=np.array([0, 2**32 + 2**30, 0], np.int64),
                            requant=Requant(np.full(3, 2**30 + 1, np.int64), np.full(3, 44, np.int64)))
    plan = REGISTRY["Conv"].specialize(p, [(1, 3, 3, 3)])
    assert plan.split16 is not None and plan.split16.unproven.tolist() == [1]
    assert plan.depthwise16 is None
    x = np.full((1, 3, 3, 3), 32767, np.int16)
    for run in (lambda: REGISTRY["Conv"].run(plan, x), lambda: run_scanned(p, x)):
        with pytest.raises(OverflowError):
            run()


@pytest.mark.parametrize("faster", ["integer", "float"])
def test_a_dense_conv_keeps_the_faster_of_two_engines_that_check_out(faster, monkeypatch):
    # both engines give the same sums; by default (INTEGER None) the quicker on the probe is kept
    monkeypatch.setattr(ortconv, "INTEGER", None)
    monkeypatch.setattr(ortconv, "_seconds", lambda engine, probe: float(engine.integer != (faster == "integer")))
    rng = np.random.default_rng(11)
    weight = rng.integers(-127, 128, size=(6, 8, 3, 3)).astype(np.int8)
    p = _params(weight, zero_in=-77, pads=(1, 1, 1, 1))
    plan = REGISTRY["Conv"].specialize(p, [(2, 8, 7, 9)])
    engine = plan.engine(np.dtype(np.int8))
    assert engine is not None and engine.integer == (faster == "integer")
    x = rng.integers(-128, 128, size=(2, 8, 7, 9)).astype(np.int8)
    assert np.array_equal(engine(x), plan.numpy_sums(x))
    assert (REGISTRY["Conv"].run(plan, x) == run_scanned(p, x)).all()
    # a depthwise conv has the float engine only, and is not raced
    depthwise = _params(rng.integers(-127, 128, size=(8, 1, 3, 3)).astype(np.int8), zero_in=0, group=8)
    monkeypatch.setattr(ortconv, "_seconds", lambda engine, probe: pytest.fail("raced"))
    assert not REGISTRY["Conv"].specialize(depthwise, [(1, 8, 6, 6)]).engine(np.dtype(np.int8)).integer


def test_int16_split_raises_where_the_exact_path_does():
    # sums past int32 with a multiplier not narrowed for them: both paths refuse, neither wraps
    weight = np.full((2, 56, 3, 3), 127, np.int8)
    p = dataclasses.replace(_int16_params(weight, (0, 0, 0, 0), (1, 1), (1, 1), 1),
                            bias=np.array([2**32 + 2**30, 0], np.int64),
                            requant=Requant(np.full(2, 2**30 + 1, np.int64), np.full(2, 44, np.int64)))
    plan = ConvPlan.of(p, (1, 56, 3, 3))
    assert plan.split16 is not None and plan.split16.unproven.tolist() == [0]  # its bias takes it past
    x = np.full((1, 56, 3, 3), 32767, np.int16)
    for run in (lambda: REGISTRY["Conv"].run(plan, x), lambda: run_scanned(p, x)):
        with pytest.raises(OverflowError):
            run()


def test_int16_split_needs_zero_point_zero_and_bounded_weights():
    weight = np.full((2, 2, 3, 3), 127, np.int8)
    p = _int16_params(weight, (0, 0, 0, 0), (1, 1), (1, 1), 1)
    assert ConvPlan.of(p, (1, 2, 5, 5)).split16 is not None
    assert ConvPlan.of(dataclasses.replace(p, zero_in=5), (1, 2, 5, 5)).split16 is None
    heavy = _int16_params(np.full((2, 600, 3, 3), 127, np.int8), (0, 0, 0, 0), (1, 1), (1, 1), 1)
    assert ConvPlan.of(heavy, (1, 600, 5, 5)).split16 is None  # 600*9*127*255 >= 2**24


def test_onnxruntime_engine_that_disagrees_or_fails_is_not_used(monkeypatch):
    weight = np.ones((2, 2, 1, 1), dtype=np.int8)
    p = _params(weight, zero_in=0)
    plan = ConvPlan.of(p, (1, 2, 3, 3))
    dtype = np.dtype(np.int8)

    # its self-check, whole or a row at a time: sums that differ from the numpy path's by one in
    # the last row of the last channel
    def wrong(x):
        rows = plan.numpy_rows(x)

        def differing(start, stop):
            sums = rows(start, stop)
            if stop == 3:
                sums[0, 1, -1, -1] += 1
            return sums
        return differing

    for rows_at_a_time in (False, True):
        monkeypatch.setattr(ortconv, "CHECK_ELEMENTS", 1 if rows_at_a_time else 1 << 20)
        assert ortconv.build(p, plan.in_shape, plan.out_hw, dtype, wrong) is None
        assert ortconv.build(p, plan.in_shape, plan.out_hw, dtype, plan.numpy_rows) is not None

    # onnxruntime that cannot run the session it built, or cannot build it
    class Unrunnable:
        def run(self, *args):
            raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(ortconv, "_session", lambda *args: Unrunnable())
    assert ortconv.build(p, plan.in_shape, plan.out_hw, dtype, plan.numpy_rows) is None

    def broken(*args):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(ortconv, "_session", broken)
    assert ortconv.build(p, plan.in_shape, plan.out_hw, dtype, plan.numpy_rows) is None
    x = np.arange(18, dtype=np.int8).reshape(1, 2, 3, 3)
    assert plan.engine(dtype) is None and (REGISTRY["Conv"].run(plan, x) == run_scanned(p, x)).all()


def test_qtool_runs_without_numba(tmp_path):
    # a process where ``import numba`` fails: qtool imports, the executor requantizes in numpy
    import subprocess
    import sys

    script = """
import sys
sys.modules["numba"] = None  # import numba raises ImportError
import numpy as np
from qtool.ops import REGISTRY, compiled
from qtool.ops.conv import ConvParams, run_scanned
from qtool.fixedpoint import Requant
assert not compiled.available()
w = np.arange(-8, 10, dtype=np.int8).reshape(2, 1, 3, 3)
p = ConvParams(w, np.array([3, -3]), Requant(np.full(2, 2**30), np.full(2, 12)), -4, 1, (1, 1, 1, 1), (1, 1),
               (1, 1), 2, "half_up", "int8")
x = np.arange(-40, 40, dtype=np.int8).reshape(1, 2, 5, 8)
plan = REGISTRY["Conv"].specialize(p, [x.shape])
assert (REGISTRY["Conv"].run(plan, x) == run_scanned(p, x)).all()
assert "numba" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("requant", ["numpy", "compiled"])
def test_onnxruntime_engine_with_numpy_requantization_scans_too(requant, monkeypatch):
    # the unproven channel's check on the engine's corrected sums, whichever requantizes
    from qtool.ops import parallel

    if requant == "compiled" and not compiled.available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(compiled, "ENABLED", requant == "compiled")
    monkeypatch.setattr(parallel, "SPLIT_FROM", 0)
    weight = np.ones((2, 2, 3, 3), dtype=np.int8)
    p = ConvParams(weight=weight, bias=np.array([0, 2**31 - 1 - 300], np.int64),
                   requant=Requant(np.full(2, 2**30, np.int64), np.full(2, 60, np.int64)), zero_in=-9, zero_out=0,
                   pads=(1, 0, 2, 1), strides=(1, 1), dilations=(1, 1), group=1, rounding="half_up", dtype="int8")
    plan = REGISTRY["Conv"].specialize(p, [(1, 2, 4, 4)])
    assert plan.tails[np.dtype(np.int8)].unproven.tolist() == [1] and plan.engine(np.dtype(np.int8)) is not None
    ok = np.full((1, 2, 4, 4), 16, dtype=np.int8)  # 18 taps of 16 = 288 inside; -9 on padding
    assert (REGISTRY["Conv"].run(plan, ok) == run_scanned(p, ok)).all()
    with pytest.raises(OverflowError, match="accumulator"):
        REGISTRY["Conv"].run(plan, np.full((1, 2, 4, 4), 17, dtype=np.int8))  # 18 * 17 = 306


def test_garbage_collector_is_paused_during_a_run_only(monkeypatch):
    from onnx import TensorProto, helper

    from qtool.executor import IntegerExecutor

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])])
    executor = IntegerExecutor(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    seen = []
    run = executor._run
    monkeypatch.setattr(executor, "_run", lambda *a: (seen.append(gc.isenabled()), run(*a))[1])
    was = gc.isenabled()
    try:
        gc.enable()
        executor.run({"x": np.ones((1, 2), np.float32)})
        assert seen == [False] and gc.isenabled()
        gc.disable()  # a caller that turned it off keeps it off
        executor.run({"x": np.ones((1, 2), np.float32)})
        assert seen == [False, False] and not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


@needs_numba
@pytest.mark.parametrize("a_shape, b_shape", [((2, 3, 4, 5), (1, 3, 1, 1)), ((2, 3, 4, 5), (2, 3, 1, 1)),
                                              ((1, 3, 1, 1), (2, 3, 4, 5))])  # the second: swapped
@pytest.mark.parametrize("dtypes", [("int8", "int8"), ("uint8", "int8")])
def test_compiled_per_channel_lookup_equals_the_numpy_gather(a_shape, b_shape, dtypes, monkeypatch):
    from qtool.ops.bytetable import lookup_pair

    rng = np.random.default_rng(len(a_shape) + a_shape[0] + b_shape[0])
    table = rng.integers(-128, 128, size=(256, 256)).astype(np.int8)
    a = rng.integers(0, 256, size=a_shape).astype(np.uint8).view(dtypes[0])
    b = rng.integers(0, 256, size=b_shape).astype(np.uint8).view(dtypes[1])
    want = table[a.view(np.uint8).astype(np.int64), b.view(np.uint8).astype(np.int64)]  # broadcast indices
    got = lookup_pair(table, a, b)
    assert got.shape == want.shape and (got == want).all()
    monkeypatch.setattr(compiled, "ENABLED", False)
    assert (lookup_pair(table, a, b) == want).all()


@needs_numba
@pytest.mark.parametrize("table_type", ["int8", "uint8", "float32", "int32"])
@pytest.mark.parametrize("shape", [(3, 5, 7), (70000,), (1, 1)])
def test_compiled_byte_gathers_equal_the_numpy_gather(table_type, shape, monkeypatch):
    # one table, one pair table and the lookups built on them (the executor's chains, HardSwish,
    # Dequantize of 8-bit values, elementwise pairs of equal shape), compiled and in numpy
    from qtool.ops.bytetable import lookup, lookup_pair

    rng = np.random.default_rng(sum(shape) + len(table_type))
    table = rng.integers(-1000, 1000, size=256).astype(table_type)
    pairs = rng.integers(-1000, 1000, size=(256, 256)).astype(table_type)
    a = rng.integers(0, 256, size=shape).astype(np.uint8).view(np.int8)
    b = rng.integers(0, 256, size=shape).astype(np.uint8)
    want = table[a.view(np.uint8).astype(np.int64)]
    want_pairs = pairs[a.view(np.uint8).astype(np.int64), b.astype(np.int64)]
    assert compiled.gather(table, a.view(np.uint8)) is not None  # the compiled loop is what runs
    assert compiled.gather_pairs(pairs, a.view(np.uint8), b) is not None
    for enabled in (True, False):
        monkeypatch.setattr(compiled, "ENABLED", enabled)
        got, got_pairs = lookup(table, a), lookup_pair(pairs, a, b)
        assert got.dtype == want.dtype and got.shape == shape and (got == want).all()
        assert got_pairs.dtype == want_pairs.dtype and got_pairs.shape == shape and (got_pairs == want_pairs).all()


@pytest.mark.parametrize("workers", [1, 2])
def test_onnxruntime_engine_scans_channels_whose_bias_may_overflow(workers, monkeypatch):
    # a padded depthwise conv (split by channels over two threads) whose channel 3 has a bias 100
    # below int32's top: its corrected sum (padding Z_x = 5 included) must be scanned, in its part
    from qtool.ops import parallel

    monkeypatch.setattr(parallel, "WORKERS", workers)
    monkeypatch.setattr(parallel, "SPLIT_FROM", 0)
    weight = np.ones((4, 1, 3, 3), dtype=np.int8)
    p = ConvParams(weight=weight, bias=np.array([0, 0, 0, 2**31 - 1 - 100], np.int64),
                   requant=Requant(np.full(4, 2**30, np.int64), np.full(4, 60, np.int64)), zero_in=5, zero_out=0,
                   pads=(1, 1, 1, 1), strides=(1, 1), dilations=(1, 1), group=4, rounding="half_up", dtype="int8")
    plan = REGISTRY["Conv"].specialize(p, [(1, 4, 3, 3)])
    assert plan.tails[np.dtype(np.int8)].unproven.tolist() == [3]
    assert len(plan.engine(np.dtype(np.int8)).parts) == workers
    ok = np.full((1, 4, 3, 3), 11, dtype=np.int8)  # centre 9 * 11 = 99, corners 4 * 11 + 5 * 5 = 69
    assert (REGISTRY["Conv"].run(plan, ok) == run_scanned(p, ok)).all()
    over = ok.copy()
    over[0, 3, 0, 0] = 12  # the centre's window: 7 * 11 + 2 * 12 = 101, one past the bias's room
    over[0, 3, 1, 1] = 12
    with pytest.raises(OverflowError, match="accumulator"):
        REGISTRY["Conv"].run(plan, over)
    corner = ok.copy()
    corner[0, 3] = 5  # padding and inputs all 5: 45 everywhere; with Z_x forgotten the corner would read 20
    assert (REGISTRY["Conv"].run(plan, corner) == run_scanned(p, corner)).all()


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16"])
@pytest.mark.parametrize("kernel, pads, strides, dilations", [
    ((3, 2), (1, 0, 2, 1), (2, 1), (1, 2)), ((2, 2), (0, 0, 0, 0), (2, 2), (1, 1)), ((1, 3), (0, 1, 0, 1), (1, 3), (1, 1)),
])
def test_window_tap_sums_equal_the_patch_sums(dtype, kernel, pads, strides, dilations):
    from qtool.ops.pool import Window

    info = np.iinfo(dtype)
    rng = np.random.default_rng(kernel[0] * 10 + strides[0])
    x = rng.integers(info.min, info.max, size=(2, 3, 7, 9), endpoint=True).astype(dtype)
    x[0, 0] = info.max  # the extreme sums
    window = Window(kernel, pads, strides, dilations)
    fill = int(info.min)
    got = window.tap_sums(x, fill)
    want = window.patches(x, fill).astype(np.int64).sum(axis=2)
    assert got.dtype == np.int32 and got.shape == want.shape and (got == want).all()


def test_global_average_pool_sums_in_int64_when_int32_may_not_hold():
    # 129 * 256 uint16 values of 65535 sum past int32 (into 32 bits): with a 31-bit multiplier the
    # product still fits int64, so the average is exact; 1024 * 256 of them (34 bits) would not,
    # and the kernel says so, where a sum taken in int32 would have wrapped into a wrong average
    from qtool.fixedpoint import quantize_multiplier
    from qtool.ops.pool import AvgPoolParams, GlobalAveragePool

    x = np.full((1, 1, 129, 256), 65535, dtype=np.uint16)
    assert 65535 * x.size > 2**31
    p = AvgPoolParams(None, Requant(*quantize_multiplier(1 / x.size)), 0, 0, "half_up", "uint16")
    assert GlobalAveragePool().run(p, x).reshape(-1).tolist() == [65535]
    big = np.full((1, 1, 1024, 256), 65535, dtype=np.uint16)
    p = AvgPoolParams(None, Requant(*quantize_multiplier(1 / big.size)), 0, 0, "half_up", "uint16")
    with pytest.raises(OverflowError, match="accumulator"):
        GlobalAveragePool().run(p, big)
    fits = x[:, :, :100]  # 25,600 values: 1.68e9, inside int32
    p = AvgPoolParams(None, Requant(*quantize_multiplier(1 / fits.size)), 0, 0, "half_up", "uint16")
    assert GlobalAveragePool().run(p, np.ascontiguousarray(fits)).reshape(-1).tolist() == [65535]


@needs_numba
@pytest.mark.parametrize("types", [("int16", "int16"), ("int16", "int8"), ("uint8", "int16")])
@pytest.mark.parametrize("shapes", [
    ((2, 5, 4, 6), (2, 5, 1, 1)),  # one value per channel: by rows
    ((2, 5, 4, 6), (2, 5, 4, 6)),  # one shape: by flat ranges
    ((3, 40, 30, 30), (3, 40, 30, 30)),  # 108,000 values: split over the cores
    ((3, 40, 30, 30), (3, 40, 1, 1)),
    ((2, 5, 4, 6), (6,)),  # other broadcasts: the ufunc
    ((2, 5, 4, 6), (1,)),
])
def test_compiled_int16_add_and_mul_equal_the_numpy_forms(types, shapes):
    from qtool.ops.add import AddParams, _add
    from qtool.ops.mul import MulParams, _mul

    rng = np.random.default_rng(11)

    def operand(dtype, shape):
        info = np.iinfo(dtype)
        x = rng.integers(info.min, int(info.max) + 1, size=shape).astype(dtype)
        x.reshape(-1)[:2] = (info.min, info.max)[:x.size]  # the extremes
        return x

    a, b = operand(types[0], shapes[0]), operand(types[1], shapes[1])
    for zeros in ((0, 0, 0), (3, -2, 7)):
        for multipliers, rshift in (((2**31 - 1, 1359), 31), ((3, 5), 1), ((2**30, 2**30 + 5), 45)):
            add = AddParams(*multipliers, rshift, *zeros, "half_up", "int16")
            got = compiled.add_levels(add, a, b)
            assert got.dtype == np.int16 and np.array_equal(got, _add(add, a, b))
            assert np.array_equal(compiled.add_levels(add, b, a), _add(add, b, a))
            mul = MulParams(multipliers[0], rshift, *zeros, "half_up", "int16")
            got = compiled.mul_levels(mul, a, b)
            if zeros == (0, 0, 0):  # every product of these types lies inside int32: compiled
                assert got is not None and got.dtype == np.int16
            if got is not None:  # (with zero points, only where the products still fit)
                assert np.array_equal(got, _mul(mul, a, b))
    # other modes, output types and shifts keep the numpy forms
    assert compiled.add_levels(AddParams(3, 5, 0, 0, 0, 0, "half_to_even", "int16"), a, b) is None
    assert compiled.add_levels(AddParams(3, 5, 1, 0, 0, 0, "half_up", "int8"), a, b) is None
    assert compiled.mul_levels(MulParams(3, 0, 0, 0, 0, "half_up", "int16"), a, b) is None


@pytest.mark.parametrize("numba_on", [True, False])
def test_int16_beside_a_constant_is_looked_up_by_its_65536_entry_table(numba_on, monkeypatch):
    from qtool.ops.add import AddParams, _add
    from qtool.ops.bytetable import lookup_with_scalar
    from qtool.ops.mul import MulParams, _mul

    monkeypatch.setattr(compiled, "ENABLED", numba_on)
    rng = np.random.default_rng(12)
    x = rng.integers(-32768, 32768, size=(2, 3, 5, 7)).astype(np.int16)
    x.reshape(-1)[:2] = (-32768, 32767)
    add = AddParams(2**30 + 7, 1234567, 33, 0, -5, 3, "half_up", "int16")
    mul = MulParams(1518500250, 38, 0, 9, -2, "half_away_from_zero", "int16")
    for kernel, p in ((_add, add), (_mul, mul)):
        for c in (np.array([200], np.uint8), np.full((1, 1, 1, 1), -3, np.int16), np.array(-128, np.int8)):
            assert np.array_equal(lookup_with_scalar(kernel, p, x, c), kernel(p, x, c))
            assert np.array_equal(lookup_with_scalar(kernel, p, c, x), kernel(p, c, x))
    # operands it does not take: two full tensors, a constant with more axes than the input
    assert lookup_with_scalar(_add, add, x, x) is None
    assert lookup_with_scalar(_add, add, x[0, 0, 0], np.zeros((1, 1, 1, 1), np.int16)) is None


@needs_numba
@pytest.mark.parametrize("in_type, out_type", [("int8", "int8"), ("uint8", "uint8"), ("int16", "int16"),
                                               ("int8", "int16")])
@pytest.mark.parametrize("opset, axis, shape", [(14, -1, (3, 4, 17)), (14, 2, (2, 3, 1)), (11, 1, (2, 3, 5)),
                                                (11, 2, (2, 3, 4, 5)), (14, 1, (2, 6, 5))])
def test_compiled_softmax_equals_the_numpy_form(in_type, out_type, opset, axis, shape, monkeypatch):
    # the attention Softmax of the executor: one compiled pass against _softmax (numpy), on
    # random rows, rows at the extremes of the input type, 8- and 32-bit multipliers; an axis
    # other than the last (opset 13 on) keeps the numpy form
    from onnx import helper

    from qtool.ops import NodeView, Operand
    from qtool.ops.softmax import Softmax, _softmax
    from qtool.qparams import QParams

    rng = np.random.default_rng(sum(shape) + opset)
    info = np.iinfo(in_type)
    x = QParams(np.float32(0.05 if in_type != "int16" else 0.0004), 0 if in_type != "uint8" else 131, in_type)
    y = (QParams(np.float32(1 / 255), -128 if out_type == "int8" else 0, out_type) if out_type != "int16"
         else QParams(np.float32(1 / 32767), 0, "int16"))
    q = rng.integers(info.min, int(info.max) + 1, size=shape).astype(in_type)
    q.reshape(-1)[:3] = (info.min, info.max, info.max)  # a tie for the largest, the widest span
    node = helper.make_node("Softmax", ["x"], ["y"], axis=axis)
    for bits in (32, 8):
        params = Softmax().derive(NodeView(node, [Operand(x)], y, opset=opset, multiplier_bits=bits))
        want = _softmax(params, q)
        fast = compiled.softmax(params, q)
        if opset >= 13 and axis % len(shape) != len(shape) - 1:
            assert fast is None
        else:
            assert fast is not None and fast.dtype == want.dtype and np.array_equal(fast, want)
        assert np.array_equal(Softmax().run(params, q), want)
        monkeypatch.setattr(compiled, "ENABLED", False)
        assert compiled.softmax(params, q) is None and np.array_equal(Softmax().run(params, q), want)
        monkeypatch.setattr(compiled, "ENABLED", True)
    other = dataclasses.replace(params, rounding="half_to_even")
    assert compiled.softmax(other, q) is None


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16"])
def test_dequantizing_8_and_16_bit_integers_in_float32_gives_the_int64_forms_floats(dtype):
    # dequantize_array computes (q - Z) * S in float32 for these types: the same bits as the
    # int64 difference times the scale in float64, rounded to float32 once, for every scale
    # (normal, subnormal results) and zero point, per tensor and per channel
    from qtool.qparams import QParams, _broadcastable, dequantize_array

    def int64_form(q, qp):
        scale, zero = _broadcastable(qp, q.ndim)
        return ((q.astype(np.int64) - zero) * scale).astype(np.float32)

    rng = np.random.default_rng(5)
    info = np.iinfo(dtype)
    for trial in range(120):
        q = rng.integers(info.min, int(info.max) + 1, (2, 4, 3, 5)).astype(dtype)
        q.reshape(-1)[:2] = (info.min, info.max)
        exponent = rng.uniform(-140, 40)  # results from subnormal to large
        if trial % 2:
            qp = QParams(np.float32(2.0 ** exponent * rng.uniform(1, 2)),
                         int(rng.integers(info.min, int(info.max) + 1)), dtype)
        else:
            qp = QParams((2.0 ** exponent * rng.uniform(1, 2, 4)).astype(np.float32),
                         rng.integers(info.min, int(info.max) + 1, 4), dtype, axis=1)
        want, got = int64_form(q, qp), dequantize_array(q, qp)
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (trial, qp)


@needs_numba
def test_compiled_requantization_refuses_an_output_it_would_write_past():
    # the loops index without bounds checks: channels [lo, hi) must lie inside the output given
    exact, bound = _exact(4, "int8", 0, seed=12)
    fast = compiled.requantizer(exact)
    sums = _sums((2, 2, 3, 5), bound, seed=13)
    out = np.zeros((2, 4, 3, 5), np.int8)
    fast.rows(sums, out, 0, 3, channels=(2, 4))  # the last two channels: fits
    assert out[:, :2].tolist() == np.zeros((2, 2, 3, 5)).tolist() and out[:, 2:].any()
    for bad_out, channels in ((np.zeros((2, 3, 3, 5), np.int8), (2, 4)),  # one channel short
                              (np.zeros((1, 4, 3, 5), np.int8), (2, 4)),  # one sample short
                              (np.zeros((2, 4, 3, 5), np.int8), (1, 4))):  # sums for 2, range of 3
        with pytest.raises(ValueError, match="do not fit"):
            fast.rows(sums, bad_out, 0, 3, channels=channels)
        with pytest.raises(ValueError, match="do not fit"):
            fast.joined(sums, sums, np.zeros(2, np.int64), out=bad_out, channels=channels)


@pytest.mark.parametrize("shape, c_out, kernel, strides, group", [
    ((4, 16, 40, 60), 6, (5, 5), (1, 3), 1),  # im2col: the patches are the large part
    ((2, 12, 18, 10), 4, (3, 3), (1, 1), 1),  # taps (fewer outputs than inputs)
    ((2, 8, 18, 40), 8, (3, 3), (1, 1), 8),  # depthwise
])
def test_numpy_path_works_in_bands_of_rows_with_the_same_integers(shape, c_out, kernel, strides, group, monkeypatch):
    """The numpy path's working arrays stay within BAND_BYTES a band of output rows: the same
    output as in one band, and for im2col a traced peak well below one thread's patches at once
    (basic-pitch's exec at batch 8 had peaked at 1.6 GB)."""
    import tracemalloc

    monkeypatch.setattr(ortconv, "ENABLED", False)
    rng = np.random.default_rng(sum(shape))
    weight = rng.integers(-127, 128, size=(c_out, shape[1] // group, *kernel)).astype(np.int8)
    p = _params(weight, zero_in=-5, pads=(2, 1, 2, 1), strides=strides, group=group)
    x = rng.integers(-128, 128, size=shape).astype(np.int8)
    whole = ConvPlan.of(p, shape)
    assert whole.band >= whole.out_hw[0]  # these small shapes: one band by default
    expected = REGISTRY["Conv"].run(whole, x)
    monkeypatch.setattr(conv, "BAND_BYTES", 1)  # a row at a time
    banded = ConvPlan.of(p, shape)
    assert banded.band == 1
    REGISTRY["Conv"].run(banded, x)  # first: numba compiles its loops for the bands' views, out of the count
    tracemalloc.start()
    try:
        got = REGISTRY["Conv"].run(banded, x)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(got, expected) and np.array_equal(got, run_scanned(p, x))
    assert np.array_equal(banded.numpy_sums(x), whole.numpy_sums(x))
    if whole.method == "im2col":
        patches = shape[0] * shape[1] * kernel[0] * kernel[1] * whole.out_hw[0] * whole.out_hw[1] * 4  # all rows'
        assert peak < patches / 4, (peak, patches)
