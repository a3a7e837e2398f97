"""The executor's fast paths: runs of elementwise integer steps looked up in one composed table
(``Chain``), the same outputs as the steps one by one on every input value; one BLAS thread while
it runs (qtool/ops/blas.py)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.errors import QtoolError
from qtool.executor import IntegerExecutor


def _scalar(name, value, dtype):
    return numpy_helper.from_array(np.array(value, dtype=dtype), name)


def _qdq_chain_model(extra_reader: bool):
    """x -> Q -> DQ -> HardSwish -> Q/DQ -> Mul(constant) -> Q/DQ -> Add(constant) -> Q/DQ -> y,
    optionally with the HardSwish output also a graph output (so it must be kept)."""
    def qdq(src, name, scale, zero):
        return [helper.make_node("QuantizeLinear", [src, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
                helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_d"])]

    nodes = (qdq("x", "x", 0.05, -3)
             + [helper.make_node("HardSwish", ["x_d"], ["h"])] + qdq("h", "h", 0.03, -40)
             + [helper.make_node("DequantizeLinear", ["c_q", "c_s", "c_z"], ["c_d"]),
                helper.make_node("Mul", ["h_d", "c_d"], ["m"])] + qdq("m", "m", 0.02, 5)
             + [helper.make_node("DequantizeLinear", ["b_q", "b_s", "b_z"], ["b_d"]),
                helper.make_node("Add", ["m_d", "b_d"], ["a"])] + qdq("a", "a", 0.04, 0))
    inits = [_scalar(f"{n}_s", s, np.float32) for n, s in
             (("x", 0.05), ("h", 0.03), ("m", 0.02), ("a", 0.04), ("c", 0.01), ("b", 0.02))]
    inits += [_scalar(f"{n}_z", z, np.int8) for n, z in
              (("x", -3), ("h", -40), ("m", 5), ("a", 0), ("c", 0), ("b", 0))]
    inits += [numpy_helper.from_array(np.array([-77], np.int8), "c_q"),
              numpy_helper.from_array(np.array([55], np.int8), "b_q")]
    outputs = [helper.make_tensor_value_info("a_d", TensorProto.FLOAT, None)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("h_d", TensorProto.FLOAT, None))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, (2, 256))
    graph = helper.make_graph(nodes, "chain", [x], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)


def _model(graph):
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _chains(executor):
    return [[s.node.op_type for s in step.params.steps] for step in executor._chained_steps
            if step.kind == "chain"]


@pytest.mark.parametrize("extra_reader, chains", [(False, [["HardSwish", "Mul", "Add"]]),
                                                  (True, [["Mul", "Add"]])])
@pytest.mark.parametrize("threads", [1, 3])
def test_chained_steps_equal_the_steps_one_by_one(extra_reader, chains, threads, monkeypatch):
    from qtool.ops import parallel

    monkeypatch.setattr(parallel, "WORKERS", threads)
    monkeypatch.setattr(parallel, "SPLIT_FROM", 0)
    executor = IntegerExecutor(_qdq_chain_model(extra_reader))
    assert _chains(executor) == chains
    x = (np.arange(-128, 128, dtype=np.float32) + 3) * 0.05  # every int8 input value
    x = np.stack([x, x[::-1]])
    chained = executor.run({"x": x}).outputs
    one_by_one = executor.run({"x": x}, keep_integer=True).outputs
    assert chained.keys() == one_by_one.keys()
    for name in chained:
        assert chained[name].dtype == one_by_one[name].dtype and (chained[name] == one_by_one[name]).all()


def test_chain_that_cannot_take_every_value_runs_its_steps():
    # integer Adds of constants: x + 100 leaves int8 for x > 27, so no table exists; data that
    # stays inside runs step by step, and data that leaves raises as it would unchained
    nodes = [helper.make_node("Add", ["x", "up"], ["t"], name="add_up"),
             helper.make_node("Add", ["t", "down"], ["y"], name="add_down")]
    graph = helper.make_graph(nodes, "ints", [helper.make_tensor_value_info("x", TensorProto.INT8, (4,))],
                              [helper.make_tensor_value_info("y", TensorProto.INT8, (4,))],
                              [numpy_helper.from_array(np.array([100], np.int8), "up"),
                               numpy_helper.from_array(np.array([-100], np.int8), "down")],
                              value_info=[helper.make_tensor_value_info("t", TensorProto.INT8, (4,))])
    executor = IntegerExecutor(_model(graph))
    assert _chains(executor) == [["Add", "Add"]]
    x = np.array([-128, 0, 5, 27], np.int8)
    assert executor.run({"x": x}).outputs["y"].tolist() == x.tolist()
    with pytest.raises(QtoolError, match="overflow .* in Add node 'add_up'"):
        executor.run({"x": np.array([28, 0, 0, 0], np.int8)})


def test_chain_on_an_input_with_fewer_dimensions_than_a_constant():
    # Add(x[4], c[1, 1]) broadcasts to [1, 4]: the lookup, shaped like x, must not be used
    nodes = [helper.make_node("Add", ["x", "c"], ["t"]), helper.make_node("Add", ["t", "c"], ["y"])]
    graph = helper.make_graph(nodes, "ints", [helper.make_tensor_value_info("x", TensorProto.INT8, (4,))],
                              [helper.make_tensor_value_info("y", TensorProto.INT8, None)],
                              [numpy_helper.from_array(np.array([[1]], np.int8), "c")],
                              value_info=[helper.make_tensor_value_info("t", TensorProto.INT8, None)])
    executor = IntegerExecutor(_model(graph))
    assert _chains(executor) == [["Add", "Add"]]
    x = np.array([1, 2, 3, 4], np.int8)
    assert executor.run({"x": x}).outputs["y"].tolist() == [[3, 4, 5, 6]]
    assert executor.run({"x": x[None]}).outputs["y"].tolist() == [[3, 4, 5, 6]]


def test_blas_is_single_threaded_inside_a_run_and_restored_after():
    import threading

    from qtool.ops import blas

    functions = blas._functions()
    if not functions:
        pytest.skip("numpy's BLAS is not OpenBLAS")
    get, set_ = functions
    before = get()
    set_(2)
    try:
        inside = []
        release = threading.Event()

        def hold():
            with blas.single_threaded():
                inside.append(get())
                release.wait(5)

        other = threading.Thread(target=hold)
        other.start()
        while not inside:
            pass
        with blas.single_threaded():  # overlapping blocks: the first one's count comes back at the end
            inside.append(get())
        assert get() == 1  # the other thread's block is still open
        release.set()
        other.join()
        assert inside == [1, 1] and get() == 2
    finally:
        set_(before)


def test_parallel_ranges_and_errors(monkeypatch):
    from qtool.ops import parallel

    monkeypatch.setattr(parallel, "WORKERS", 3)
    assert parallel.ranges(10, parallel.SPLIT_FROM) == ((0, 3), (3, 6), (6, 10))
    assert parallel.ranges(2, parallel.SPLIT_FROM) == ((0, 1), (1, 2))
    assert parallel.ranges(10, parallel.SPLIT_FROM - 1) == ((0, 10),)
    done = []

    def work(start, stop):
        done.append((start, stop))
        if start == 6:
            raise OverflowError("accumulator exceeds int32")

    with pytest.raises(OverflowError):
        parallel.run_parts(work, parallel.ranges(10, parallel.SPLIT_FROM))
    assert sorted(done) == [(0, 3), (3, 6), (6, 10)]  # every part ran before the error came back


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # the inf and nan inputs
@pytest.mark.parametrize("dtype, zero", [(np.int8, -7), (np.uint8, 131)])
@pytest.mark.parametrize("threads", [1, 3])
def test_quantize_in_ranges_and_dequantize_by_table_equal_the_functions(dtype, zero, threads, monkeypatch):
    from qtool.ops import parallel
    from qtool.qparams import QParams, dequantize_array, quantize_array

    monkeypatch.setattr(parallel, "WORKERS", threads)
    monkeypatch.setattr(parallel, "SPLIT_FROM", 0)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (3, 300))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, (3, 300))],
                              [_scalar("s", 0.0371, np.float32), _scalar("z", zero, dtype)])
    executor = IntegerExecutor(_model(graph))
    rng = np.random.default_rng(3)
    x = (rng.normal(0, 4, (3, 300)) * rng.choice([1, 10], (3, 300))).astype(np.float32)
    x[0, :3] = [np.inf, -np.inf, np.nan]
    qp = QParams(0.0371, zero, np.dtype(dtype).name)
    result = executor.run({"x": x}, keep_integer=True)
    q = quantize_array(x, qp)
    assert result.integer["x"].dtype == q.dtype and (result.integer["x"] == q).all()
    y = dequantize_array(q, qp)
    assert result.outputs["y"].dtype == y.dtype and (result.outputs["y"] == y).all()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork")
def test_parallel_pool_works_in_a_forked_child(monkeypatch):
    import os

    from qtool.ops import parallel

    parallel.run_parts(lambda start, stop: None, ((0, 1), (1, 2)))  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # child: a pool of its own, or this would wait forever on the parent's threads
        done = []
        parallel.run_parts(lambda start, stop: done.append(start), ((0, 1), (1, 2)))
        os._exit(0 if sorted(done) == [0, 1] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _conv_chain_model(extra_reader: bool, rounding: str):
    """x -> Q/DQ -> Conv 3x3 (int8 weights, bias) -> Q/DQ -> HardSwish -> Q/DQ -> Mul(constant) -> Q/DQ
    -> y, optionally with the Conv's output also a graph output (then the chain cannot be folded);
    ``rounding`` as qtool writes it (half_up: the float32 Conv path; half_to_even: the scanned one)."""
    def qdq(src, name):
        return [helper.make_node("QuantizeLinear", [src, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
                helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_d"])]

    rng = np.random.default_rng(11)
    weight = rng.integers(-127, 128, size=(4, 3, 3, 3)).astype(np.int8)
    nodes = (qdq("x", "x")
             + [helper.make_node("DequantizeLinear", ["w_q", "w_s"], ["w_d"], axis=0),
                helper.make_node("DequantizeLinear", ["b_q", "b_s"], ["b_d"], axis=0),
                helper.make_node("Conv", ["x_d", "w_d", "b_d"], ["c"], pads=[1, 1, 1, 1], name="conv")]
             + qdq("c", "c") + [helper.make_node("HardSwish", ["c_d"], ["h"])] + qdq("h", "h")
             + [helper.make_node("DequantizeLinear", ["k_q", "k_s", "k_z"], ["k_d"]),
                helper.make_node("Mul", ["h_d", "k_d"], ["m"])] + qdq("m", "m"))
    scales = {"x": (0.02, -5), "c": (0.3, 7), "h": (0.2, -60), "m": (0.1, 3), "k": (0.01, 0)}
    inits = [_scalar(f"{n}_s", s, np.float32) for n, (s, _) in scales.items()]
    inits += [_scalar(f"{n}_z", z, np.int8) for n, (_, z) in scales.items()]
    inits += [numpy_helper.from_array(weight, "w_q"),
              numpy_helper.from_array(np.full(4, 0.002, np.float32), "w_s"),
              numpy_helper.from_array(np.array([300, -200, 0, 5000], np.int32), "b_q"),
              numpy_helper.from_array(np.full(4, 0.02 * 0.002, np.float32), "b_s"),
              numpy_helper.from_array(np.array(90, np.int8), "k_q")]
    outputs = [helper.make_tensor_value_info("m_d", TensorProto.FLOAT, None)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("c_d", TensorProto.FLOAT, None))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, (2, 3, 6, 7))
    model = helper.make_model(helper.make_graph(nodes, "conv_chain", [x], outputs, inits),
                              opset_imports=[helper.make_opsetid("", 14)], ir_version=8)
    helper.set_model_props(model, {"qtool.rounding": rounding})
    return model


@pytest.mark.parametrize("extra_reader", [False, True])
@pytest.mark.parametrize("summing", ["numpy", "onnxruntime"])
@pytest.mark.parametrize("requant", ["numpy", "compiled"])
@pytest.mark.parametrize("rounding", ["half_up", "half_to_even"])
def test_chain_folded_into_a_conv_equals_the_steps_one_by_one(extra_reader, summing, requant, rounding,
                                                               monkeypatch):
    from qtool.ops import compiled, ortconv
    from qtool.ops.conv import ConvPlan

    if requant == "compiled" and not compiled.available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(compiled, "ENABLED", requant == "compiled")
    monkeypatch.setattr(ortconv, "ENABLED", summing == "onnxruntime")
    executor = IntegerExecutor(_conv_chain_model(extra_reader, rounding))
    folded = [step for step in executor._chained_steps if step.then is not None]
    conv = next(step for step in executor.steps if step.node.name == "conv")
    plan = ConvPlan.of(conv.params, (2, 3, 6, 7))
    assert (np.dtype(np.int8) in plan.tails) == (rounding == "half_up")  # the float32 path, or the scanned
    assert [s.node.name for s in folded] == ([] if extra_reader else ["conv"])
    assert _chains(executor) == ([["HardSwish", "Mul"]] if extra_reader else [])
    rng = np.random.default_rng(12)
    x = rng.normal(0, 1.5, size=(2, 3, 6, 7)).astype(np.float32)
    fast = executor.run({"x": x}).outputs
    one_by_one = executor.run({"x": x}, keep_integer=True).outputs
    for name in one_by_one:
        assert fast[name].dtype == one_by_one[name].dtype and (fast[name] == one_by_one[name]).all()
    # a chain without a table for the Conv's output type runs its steps after the Conv
    if folded:
        monkeypatch.setattr(executor, "_table_of", lambda chain, dtype: None)
        again = executor.run({"x": x}).outputs
        assert all((again[name] == one_by_one[name]).all() for name in one_by_one)


def test_fast_paths_start_only_when_the_plain_ones_would_run_long(monkeypatch, demo_calib, qmodel):
    import onnx

    import qtool.executor as executor_module
    from qtool.ops import compiled, ortconv

    model = onnx.load(qmodel)
    x = np.load(demo_calib)["input"][:32]
    batches = [{"input": x[i:i + 8]} for i in range(0, 32, 8)]
    always = IntegerExecutor(model)
    expected = [always.run(b).outputs["logits"] for b in batches]  # no pace: fast from the first run
    assert always._fast

    seen = []

    def run_paced(executor, fast_from):
        monkeypatch.setattr(executor_module, "FAST_FROM", fast_from)
        got = []
        for i, b in enumerate(batches):
            got.append(executor.run(b, pace=(8, 32 - 8 * (i + 1))).outputs["logits"])
            seen.append((compiled.ENABLED, ortconv.ENABLED))  # restored after each run
            states.append(executor._fast)
        return got

    states = []

    # a target the plain paths never reach: they run to the end, the same integers
    plain = IntegerExecutor(model)
    assert all(np.array_equal(a, b) for a, b in zip(run_paced(plain, 1e9), expected)) and not plain._fast
    # a target of 0: the first run makes the plans, the second is timed, the third starts them
    switched = IntegerExecutor(model)
    got = run_paced(switched, 0.0)
    assert states[4:] == [False, False, True, True] and all(np.array_equal(a, b) for a, b in zip(got, expected))
    assert set(seen) == {(True, True)}


def test_a_last_smaller_batch_runs_without_new_conv_engines(monkeypatch, demo_calib, qmodel):
    # 30 samples at 8 a batch end with 6: new shapes whose onnxruntime Conv engines would cost more
    # to set up than they save on one batch; that batch sums in numpy (the same integers), builds
    # no engine, and leaves no plan for its shapes behind
    import onnx

    import qtool.executor as executor_module
    from qtool.ops import compiled, ortconv

    model = onnx.load(qmodel)
    x = np.load(demo_calib)["input"][:30]
    batches = [x[i:i + 8] for i in range(0, 30, 8)]
    expected = [IntegerExecutor(model).run({"input": b}).outputs["logits"] for b in batches]
    monkeypatch.setattr(executor_module, "FAST_FROM", 0.0)
    built = []
    real = ortconv.build

    def counted(params, in_shape, *args):
        engine = real(params, in_shape, *args)
        if engine is not None:
            built.append(in_shape[0])
        return engine

    monkeypatch.setattr(ortconv, "build", counted)
    executor = IntegerExecutor(model)
    engines = []
    for i, b in enumerate(batches):
        got = executor.run({"input": b}, pace=(len(b), 30 - 8 * i - len(b))).outputs["logits"]
        assert np.array_equal(got, expected[i])
        engines.append(ortconv.ENABLED)
    assert executor._fast and built and set(built) == {8}  # engines for the batches of 8 only
    assert engines == [True] * 4 and compiled.ENABLED  # restored after the last run
    shapes = {s for step in executor.all_steps() for s in step.specialized if isinstance(s, tuple)}
    assert shapes and not any(shape[0][0] == 6 for shape in shapes if shape and np.ndim(shape[0]))
