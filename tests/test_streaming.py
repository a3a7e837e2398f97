"""Bounded memory: data files read a batch at a time, exec's outputs written as they come (issue 14)."""

from __future__ import annotations

import hashlib
import os
import re
import zipfile

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool.data as data_module
from qtool.data import RowFile, load_dataset
from qtool.executor import IntegerExecutor
from qtool.quantize import quantize
from test_cli import assert_no_crash, assert_user_error, invoke, snapshot


def _relu_model(shape=("N", 3, 8, 8)) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))])
    return helper.make_model(graph)


@pytest.fixture
def small_lazy(monkeypatch):
    """Every array over 1 KB is read lazily."""
    monkeypatch.setattr(data_module, "LAZY_BYTES", 1024)


@pytest.mark.parametrize("form", ["savez", "savez_compressed", "npy"])
def test_large_arrays_are_read_batch_by_batch(tmp_path, small_lazy, form):
    x = np.random.default_rng(0).normal(size=(37, 3, 8, 8))  # float64: converted per batch
    labels = np.arange(37)
    path = tmp_path / ("x.npy" if form == "npy" else "x.npz")
    if form == "npy":
        np.save(path, x)
    else:
        getattr(np, form)(path, x=x, label=labels)
    data = load_dataset(path, _relu_model())
    assert isinstance(data.arrays["x"], RowFile)
    assert len(data) == 37 and data.sample_shape("x") == [3, 8, 8]
    got = np.concatenate([b["x"] for b in data.batches(5)])
    assert got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, x.astype(np.float32))
    if form != "npy":
        np.testing.assert_array_equal(data.extra["label"][:], labels)


def test_nan_is_found_in_a_later_chunk(tmp_path, small_lazy):
    x = np.ones((40, 3, 8, 8), np.float32)
    x[29, 1, 2, 3] = np.inf
    np.savez(tmp_path / "x.npz", x=x)
    with pytest.raises(Exception, match=r"has NaN or Inf \(first in sample 29\)"):
        load_dataset(tmp_path / "x.npz", _relu_model())


def test_object_arrays_are_refused_when_read_lazily(tmp_path, small_lazy):
    np.savez(tmp_path / "x.npz", x=np.array([{"a": 1}] * 300, dtype=object))
    result = invoke("calibrate", _save(tmp_path, _relu_model()), "--data", tmp_path / "x.npz",
                    "-o", tmp_path / "t.yaml")
    assert_user_error(result, "holds pickled objects")


def _save(folder, model, name="m.onnx"):
    onnx.save(model, folder / name)
    return folder / name


@pytest.fixture(scope="module")
def demo_q(tmp_path_factory, demo_model, demo_table):
    folder = tmp_path_factory.mktemp("stream")
    qmodel, _ = quantize(demo_model, demo_table)
    onnx.save(qmodel, folder / "q.onnx")
    return folder / "q.onnx"


def test_exec_in_batches_writes_what_one_run_computes(tmp_path, demo_q, demo_heldout):
    x = np.load(demo_heldout)["input"][:50]
    np.savez(tmp_path / "x.npz", input=x)
    whole = IntegerExecutor(onnx.load(demo_q)).run({"input": x}).outputs
    digests = set()
    for batch in (1, 7, 64):
        out = tmp_path / f"y{batch}.npz"
        result = invoke("exec", demo_q, "--input", tmp_path / "x.npz", "-o", out, "--batch-size", batch, "-q")
        assert result.exit_code == 0, result.output
        with np.load(out) as y:
            assert sorted(y.files) == sorted(whole)
            for name, value in whole.items():
                np.testing.assert_array_equal(y[name], value)
        with zipfile.ZipFile(out) as archive:  # as np.savez stores it
            assert {i.compress_type for i in archive.infolist()} == {zipfile.ZIP_STORED}
        digests.add(hashlib.sha256(out.read_bytes()).hexdigest())
    assert len(digests) == 1  # the same bytes whatever the batch size, on every run


def test_exec_failure_leaves_nothing(tmp_path, demo_q):
    np.savez(tmp_path / "x.npz", input=np.zeros((4, 1, 5, 5), np.float32))  # the wrong image size
    before = snapshot(tmp_path)
    result = invoke("exec", demo_q, "--input", tmp_path / "x.npz", "-o", tmp_path / "y.npz")
    assert_no_crash(result)
    assert result.exit_code == 2
    assert snapshot(tmp_path) == before


def test_exec_batch_size_must_be_positive(tmp_path, demo_q, demo_heldout):
    assert_user_error(invoke("exec", demo_q, "--input", demo_heldout, "-o", tmp_path / "y.npz",
                             "--batch-size", 0), "batch size must be >= 1")


def _qlinear_matmul() -> onnx.ModelProto:
    """ONNX's QLinearMatMul node case shapes: a [2,4] x b [4,3], both fixed."""
    inits = [numpy_helper.from_array(np.array(v, dtype), n) for n, v, dtype in (
        ("a_s", 0.0066, np.float32), ("a_z", 113, np.uint8), ("b_s", 0.00705, np.float32),
        ("b_z", 114, np.uint8), ("y_s", 0.0107, np.float32), ("y_z", 118, np.uint8))]
    node = helper.make_node("QLinearMatMul", ["a", "a_s", "a_z", "b", "b_s", "b_z", "y_s", "y_z"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 4]),
                                            helper.make_tensor_value_info("b", TensorProto.UINT8, [4, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, [2, 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_exec_feeds_arrays_shaped_as_the_inputs_as_they_are(tmp_path):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (2, 4), dtype=np.uint8)
    b = rng.integers(0, 256, (4, 3), dtype=np.uint8)
    np.savez(tmp_path / "x.npz", a=a, b=b)
    model = _save(tmp_path, _qlinear_matmul())
    result = invoke("exec", model, "--input", tmp_path / "x.npz", "-o", tmp_path / "y.npz", "-q")
    assert result.exit_code == 0, result.output
    # onnxruntime's u8 x u8 QLinearMatMul is exact on every CPU
    expected = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"a": a, "b": b})[0]
    got = np.load(tmp_path / "y.npz")["y"]
    assert got.shape == (2, 3)
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1  # fixed-point multiplier vs float


def test_exec_different_sample_counts_is_a_user_error(tmp_path):
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "g",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 4]) for n in "ab"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    model = _save(tmp_path, helper.make_model(graph))
    np.savez(tmp_path / "x.npz", a=np.zeros((2, 4), np.float32), b=np.zeros((3, 4), np.float32))
    assert_user_error(invoke("calibrate", model, "--data", tmp_path / "x.npz", "-o", tmp_path / "t.yaml"),
                      "inputs have different sample counts [2, 3]")


# -- default batch sizes (qtool/batching.py) ---------------------------------------------------------

def test_choose_batch_fits_the_budget():
    from qtool.batching import choose_batch

    assert choose_batch(10 << 20, 2.0, 512, 8)[0] == 8  # 20 MB a sample: 25 fit, capped
    assert choose_batch(100 << 20, 2.0, 512, 8)[0] == 2  # 200 MB a sample
    assert choose_batch(1 << 30, 4.0, 512, 8)[0] == 1  # never below 1
    assert choose_batch(0, 1.0, 512, 8)[0] == 8


def test_choose_batch_counts_what_the_batch_does_not_change():
    from qtool.batching import PROCESS_BYTES, choose_batch, fixed_bytes

    # 100 MB a sample: 5 fit in 512 MB alone, 2 beside 250 MB of process and models
    assert choose_batch(50 << 20, 2.0, 512, 8)[0] == 5
    size, note = choose_batch(50 << 20, 2.0, 512, 8, 250 << 20)
    assert size == 2 and "beside about 250 MB for the process and its models" in note
    # models larger than the budget: one sample at a time, and the log says the budget is exceeded
    size, note = choose_batch(1 << 20, 1.0, 512, 8, 600 << 20)
    assert size == 1 and "the models alone take more than --memory" in note
    size, note = choose_batch(300 << 20, 1.0, 512, 8, 250 << 20)
    assert size == 1 and "one sample beside them takes more than --memory" in note
    # verify: the process, 4 copies of the float model and 5 of the integer one
    assert fixed_bytes(90 << 20, 26 << 20) == PROCESS_BYTES + (4 * 90 + 5 * 26 << 20)


def test_verify_log_names_the_memory_the_models_take(tmp_path, demo_model, demo_q, demo_heldout):
    result = invoke("verify", demo_model, demo_q, "--data", demo_heldout, "--memory", 200)
    assert result.exit_code == 0, result.output
    assert re.search(r"batch size \d \(about [0-9.]+ MB a sample beside about 15\d MB for the process "
                     r"and its models; --memory 200\)", result.stderr), result.stderr


@pytest.mark.parametrize("command", ["calibrate", "exec", "verify"])
def test_memory_budget_must_be_positive(tmp_path, demo_model, demo_q, demo_heldout, command):
    args = {"calibrate": ("calibrate", demo_model, "--data", demo_heldout, "-o", tmp_path / "t.yaml"),
            "exec": ("exec", demo_q, "--input", demo_heldout, "-o", tmp_path / "y.npz"),
            "verify": ("verify", demo_model, demo_q, "--data", demo_heldout)}[command]
    assert_user_error(invoke(*args, "--memory", 0), "--memory must be at least 1 MB, got 0")


def test_default_batch_is_logged_and_follows_the_budget(tmp_path, demo_model, demo_heldout):
    wide = invoke("calibrate", demo_model, "--data", demo_heldout, "-o", tmp_path / "demo.yaml")
    assert wide.exit_code == 0, wide.output
    assert re.search(r"batch size 8 \(about [0-9.]+ MB a sample beside about 1\d\d MB for the process and its "
                     r"models; --memory 512\)", wide.stderr)
    # 2 MB of activations a sample (input and output of a Relu): a 1 MB budget runs one at a time
    model = _save(tmp_path, _relu_model(("N", 16, 128, 128)))
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(2).normal(size=(6, 16, 128, 128)).astype(np.float32))
    tables = []
    for extra in ((), ("--memory", 1), ("--batch-size", 5)):
        out = tmp_path / f"t{len(tables)}.yaml"
        result = invoke("calibrate", model, "--data", tmp_path / "x.npz", "-o", out, *extra)
        assert result.exit_code == 0, result.output
        chosen = re.search(r"batch size (\d+) ", result.stderr)
        assert (chosen and chosen.group(1)) == {0: "8", 1: "1", 2: None}[len(tables)], result.stderr
        tables.append(out.read_bytes())
    assert tables[0] == tables[1] == tables[2]  # the batch size does not change the table
    assert invoke("quantize", model, "-t", tmp_path / "t0.yaml", "-o", tmp_path / "q.onnx").exit_code == 0
    ran = invoke("exec", tmp_path / "q.onnx", "--input", tmp_path / "x.npz", "-o", tmp_path / "y.npz",
                 "--memory", 1)
    assert "batch size 1 " in ran.stderr, ran.stderr
    checked = invoke("verify", model, tmp_path / "q.onnx", "--data", tmp_path / "x.npz", "-q", "--memory", 1)
    assert_no_crash(checked)
    assert "batch size 1 " in checked.stderr, checked.stderr


@pytest.mark.parametrize("form", ["savez", "savez_compressed"])
def test_a_damaged_large_file_is_a_user_error(tmp_path, small_lazy, form):
    x = np.random.default_rng(5).normal(size=(40, 3, 8, 8)).astype(np.float32)
    getattr(np, form)(tmp_path / "x.npz", x=x)
    raw = bytearray((tmp_path / "x.npz").read_bytes())
    if form == "savez":  # a stored member whose header promises ten times the bytes it holds
        cut = tmp_path / "cut.npz"
        with zipfile.ZipFile(cut, "w", zipfile.ZIP_STORED) as archive:
            with archive.open(zipfile.ZipInfo("x.npy"), "w") as member:
                header = {"descr": "<f4", "fortran_order": False, "shape": (400, 3, 8, 8)}
                np.lib.format.write_array_header_2_0(member, header)
                member.write(x.tobytes())  # a tenth of what the header promises
        damaged, message = cut, "is truncated"
    else:  # flip bytes inside the deflated stream
        middle = len(raw) // 2
        raw[middle:middle + 64] = bytes(64)
        (tmp_path / "bad.npz").write_bytes(bytes(raw))
        damaged, message = tmp_path / "bad.npz", "is not a valid .npz/.npy file"
    model = _save(tmp_path, _relu_model())
    assert_user_error(invoke("calibrate", model, "--data", damaged, "-o", tmp_path / "t.yaml"), message)


def test_verify_lets_each_reference_go_once_compared(demo_model, qmodel, demo_heldout):
    # the float side's tensors are released as the comparisons consume them: after a batch only
    # the model's outputs (which the caller compares) remain of the reference, and every
    # comparison has taken its batch
    import concurrent.futures

    from qtool.model import FloatRunner, load_model, prepare
    from qtool.verify.compare import Comparison
    from qtool.verify.core import _side_by_side

    executor = IntegerExecutor(load_model(qmodel))
    model = prepare(load_model(demo_model), "demo")
    known = {o for node in model.graph.node for o in node.output}
    tensors = {name: Comparison(name, t.op_type, "integer", t.qparams)
               for name, t in executor.integer_tensors().items() if name in known}
    assert len(tensors) > 3
    runner = FloatRunner(model, list(tensors), threads=1, arena=False)
    x = np.load(demo_heldout)
    feeds = {executor.input_names[0]: x[x.files[0]][:2]}
    with concurrent.futures.ThreadPoolExecutor(1) as side:
        reference, result = _side_by_side(executor, runner, feeds, tensors, {n: {} for n in tensors}, side)
    assert set(reference) == set(executor.output_names) == set(result.outputs)
    assert all(c.ref_sq > 0 for c in tensors.values())


def test_npz_writer_stores_an_output_that_changes_shape_per_sample(tmp_path):
    # "y" keeps its rows' shape for 3 samples, then changes: every sample of it is stored alone
    # (the rows already written moved there), in order, with the same bytes whatever the batch
    from qtool.fileio import NpzWriter

    rows = [np.full((2, k), k, np.int16) for k in (3, 3, 3, 5, 4, 4)]
    same = np.arange(12, dtype=np.float32).reshape(6, 2)
    digests = set()
    for batches in ([1, 1, 1, 1, 1, 1], [3, 1, 2]):
        writer = NpzWriter(tmp_path / "y.npz", 6)
        start = 0
        for n in batches:
            block = rows[start:start + n]
            if len({r.shape for r in block}) == 1:
                writer.append({"same": same[start:start + n], "y": np.stack(block)})
            else:  # a batch's rows share one shape in a real run
                raise AssertionError("test batches must not mix shapes")
            start += n
        assert writer.ragged == {"y": 6}
        writer.close()
        with np.load(tmp_path / "y.npz") as y:
            assert y.files == ["same", *[f"y/{i}" for i in range(6)]]
            np.testing.assert_array_equal(y["same"], same)
            for i, row in enumerate(rows):
                assert y[f"y/{i}"].dtype == np.int16 and y[f"y/{i}"].tolist() == row.tolist()
        digests.add(hashlib.sha256((tmp_path / "y.npz").read_bytes()).hexdigest())
    assert len(digests) == 1


def _data_dependent_slice(path) -> None:
    """y = x[:, :ceil(max(x))]: its width depends on the sample's values (nodes without names, each
    its own float session in the executor)."""
    nodes = [helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
             helper.make_node("Ceil", ["m"], ["c"]),
             helper.make_node("Cast", ["c"], ["e"], to=TensorProto.INT64),
             helper.make_node("Reshape", ["e", "one"], ["ends"]),
             helper.make_node("Slice", ["x", "zero", "ends", "axis"], ["y"])]
    consts = [numpy_helper.from_array(np.array(v, np.int64), n)
              for n, v in (("one", [1]), ("zero", [0]), ("axis", [1]))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "W"])], consts)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), path)


def test_exec_writes_an_output_that_changes_shape_per_sample(tmp_path):
    _data_dependent_slice(tmp_path / "m.onnx")
    x = np.array([[0.5, 0, 0, 0, 0, 0], [1.5, 1, 0, 0, 0, 0], [2.5, 0, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]],
                 np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    result = invoke("exec", tmp_path / "m.onnx", "-i", tmp_path / "x.npz", "-o", tmp_path / "y.npz",
                    "--batch-size", 1)
    assert_no_crash(result)
    assert result.exit_code == 0, result.output
    assert "output 'y' changes shape from sample to sample: written per sample, as 'y/0' ... 'y/3'" \
        in result.stderr
    with np.load(tmp_path / "y.npz") as y:
        assert y.files == ["y/0", "y/1", "y/2", "y/3"]
        # each sample's row, without the sample axis
        assert [y[k].tolist() for k in y.files] == [x[0, :1].tolist(), x[1, :2].tolist(), x[2, :3].tolist(),
                                                      x[3, :1].tolist()]


# -- verify's float reference in segments (qtool/segments.py) ---------------------------------------

def test_reference_parts_split_only_what_does_not_fit():
    from qtool.batching import REFERENCE_FACTOR, REFERENCE_PARTS_MAX, VERIFY_FACTOR, reference_parts

    sizes = [10 << 20] * 20  # 200 MB of compared tensors a sample
    assert reference_parts(sizes, 1, 4096) == [0]  # fits whole: one part
    # estimated at 1200 MB of a 1024 MB budget, within REFERENCE_SPLIT_FROM's margin: still whole;
    # at 1360 MB, past it: split
    assert reference_parts(sizes, 1, 1024, 400 << 20) == [0]
    assert len(reference_parts(sizes, 1, 1024, 560 << 20)) > 1
    # beside 200 MB of the rest of the sample, 512 MB leave room for 156 MB of reference
    starts = reference_parts(sizes, 1, 512)
    room = (512 - (VERIFY_FACTOR - REFERENCE_FACTOR) * 200) / REFERENCE_FACTOR
    assert len(starts) > 1 and starts[0] == 0 and starts == sorted(set(starts))
    bounds = [*starts, len(sizes)]
    assert all(10 * (b - a) <= max(room, 200 / REFERENCE_PARTS_MAX) for a, b in zip(bounds, bounds[1:]))
    # nothing fits: REFERENCE_PARTS_MAX parts, never a part per tensor
    assert len(reference_parts([20 << 20] * 20, 1, 1, 600 << 20)) == REFERENCE_PARTS_MAX
    # a part ends after the tensor that passes its share, however large that tensor is, and the
    # tensors after a large one do not each make a part of their own
    assert reference_parts([1, 1000 << 20, 1], 1, 1) == [0, 2]
    assert reference_parts([1000 << 20, 1, 1, 1, 1], 1, 1) == [0, 1]
    assert len(reference_parts([40 << 20] * 8 + [0], 1, 1)) <= REFERENCE_PARTS_MAX
    # a small reference is never split, however short of memory: a part would save nothing
    assert reference_parts([1 << 20] * 8, 1, 1, 600 << 20) == [0]
    assert len(reference_parts([1 << 20] * 64, 1, 1, 600 << 20)) == 2


def _compared(model, executor):
    known = {o for node in model.graph.node for o in node.output} | set(executor.input_names)
    return [name for name in executor.integer_tensors() if name in known]


def test_float_segments_give_the_whole_models_tensors(demo_model, qmodel, demo_heldout):
    from qtool.model import FloatRunner, load_model, prepare
    from qtool.segments import FloatSegments

    executor = IntegerExecutor(load_model(qmodel))
    model = prepare(load_model(demo_model), "demo")
    names = _compared(model, executor)
    assert executor.input_names[0] in names  # the input is compared too: the first part gives it
    groups = [names[i:i + 3] for i in range(0, len(names), 3)]
    segments = FloatSegments(model, groups, threads=1, arena=False)
    assert len(segments.segments) > 2
    x = np.load(demo_heldout)
    feeds = {executor.input_names[0]: x[x.files[0]][:3]}
    whole = FloatRunner(model, names, threads=1, arena=False).run(feeds)
    seen = {}
    for values in segments.parts(feeds):
        assert len(values) < len(names)  # a part, not the whole reference
        assert not set(values) & set(seen)
        seen.update(values)
    assert set(names) <= set(seen)
    for name in names:
        np.testing.assert_allclose(seen[name], whole[name], rtol=1e-5, atol=1e-6, err_msg=name)
    outputs = segments.run(feeds)
    assert list(outputs) == [o.name for o in model.graph.output]
    for name, value in outputs.items():
        np.testing.assert_allclose(value, whole[name], rtol=1e-5, atol=1e-6)


def test_verify_in_segments_compares_what_the_whole_reference_does(tmp_path, demo_model, demo_q, demo_heldout,
                                                                   monkeypatch):
    # a budget one sample does not fit: the float model runs in segments, said in the log, and
    # every tensor is compared as with the whole model's reference (last bits aside)
    import json

    import qtool.batching

    monkeypatch.setattr(qtool.batching, "REFERENCE_PART_MIN", 1)  # the demo's reference is small

    figures = {}
    for memory in (4096, 1):
        result = invoke("verify", demo_model, demo_q, "--data", demo_heldout, "--memory", memory, "--json",
                        "--layers", "all")  # the same samples compared, whatever the batch size
        assert result.exit_code == 0, result.output
        assert ("segments" in result.stderr) == (memory == 1), result.stderr
        # at 1 MB even one sample in segments passes the budget (the process alone does): said, with the figure
        assert ("; one sample still takes about " in result.stderr) == (memory == 1), result.stderr
        assert re.search(r"one sample still takes about \d+ MB with them: raise --memory, or expect a larger peak",
                         result.stderr) or memory == 4096
        report = json.loads(result.stdout)
        figures[memory] = {t["name"]: t for t in report["tensors"]}
    assert figures[1].keys() == figures[4096].keys() and len(figures[1]) > 5
    for name, whole in figures[4096].items():
        assert figures[1][name]["sqnr_db"] == pytest.approx(whole["sqnr_db"], abs=0.01), name


def test_verify_short_of_memory_keeps_one_copy_of_the_weights_and_no_compiled_loops(demo_model, demo_q,
                                                                                   demo_heldout, monkeypatch):
    # where the models alone take more than --memory: onnxruntime does not pack a second copy of
    # the float weights, numba's loops are not loaded, and the figures are the same
    import qtool.verify.core as core
    from qtool.ops import compiled
    from qtool.verify import compare

    made, states = [], []
    runner, side_by_side = core.FloatRunner, core._side_by_side

    def record_runner(*args, **kwargs):
        made.append(kwargs.get("prepack", True))
        return runner(*args, **kwargs)

    def record_loops(*args, **kwargs):
        states.append((compiled.available(), bool(compare._compiled())))
        return side_by_side(*args, **kwargs)

    monkeypatch.setattr(core, "FloatRunner", record_runner)
    monkeypatch.setattr(core, "_side_by_side", record_loops)
    reports = {}
    outside = (compiled.available(), bool(compare._compiled()))  # with numba installed: (True, True)
    for memory in (4096, 1):
        made.clear(), states.clear()
        reports[memory] = core.verify(demo_model, demo_q, demo_heldout, progress=False, memory_mb=memory,
                                      batch_size=4, layers=None)
        assert made == [memory == 4096]
        assert set(states) == {(False, False) if memory == 1 else outside}
    assert (compiled.available(), bool(compare._compiled())) == outside  # as they were
    for a, b in zip(reports[1].tensors, reports[4096].tensors):  # numpy's sums and numba's: last bits
        assert a.name == b.name and a.sqnr == pytest.approx(b.sqnr, rel=1e-9, abs=1e-9)


def _zipfile_npz(path, arrays: dict) -> None:
    """The archive zipfile itself writes for ``arrays`` in order, members as NpzWriter names and
    dates them: the reference for the member NpzWriter streams by hand."""
    import io
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, value in arrays.items():
            buffer = io.BytesIO()
            np.lib.format.write_array_header_2_0(buffer, {"descr": np.lib.format.dtype_to_descr(value.dtype),
                                                          "fortran_order": False, "shape": value.shape})
            buffer.write(np.ascontiguousarray(value).tobytes())
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            with archive.open(info, "w", force_zip64=True) as member:
                member.write(buffer.getvalue())


@pytest.mark.parametrize("first_ragged", [False, True])
def test_npz_writer_streams_its_first_array_into_the_archive_zipfile_would_write(tmp_path, first_ragged):
    # the first array goes straight into the archive's file (its header rewritten at the end),
    # the others after it: the bytes zipfile writes for the same members; a first array whose rows
    # change shape is read back and stored per sample, as any other
    from qtool.fileio import NpzWriter

    rng = np.random.default_rng(3)
    big = rng.normal(size=(7, 5, 33)).astype(np.float32)
    ids = rng.integers(0, 100, size=(7, 2)).astype(np.int64)
    rows = [np.full((1, k), k, np.int16) for k in (3, 3, 3, 6, 6, 2, 2)] if first_ragged else None
    writer = NpzWriter(tmp_path / "y.npz", 7)
    for start, stop in ((0, 3), (3, 5), (5, 7)):
        first = np.concatenate(rows[start:stop]) if first_ragged else big[start:stop]
        writer.append({"first": first, "ids": ids[start:stop]})
    writer.close()
    expected = {**{f"first/{i}": r[0] for i, r in enumerate(rows)}, "ids": ids} if first_ragged else \
        {"first": big, "ids": ids}
    _zipfile_npz(tmp_path / "expected.npz", expected)
    assert (tmp_path / "y.npz").read_bytes() == (tmp_path / "expected.npz").read_bytes()
    with np.load(tmp_path / "y.npz") as y:
        assert y.files == list(expected) and all(np.array_equal(y[k], v) for k, v in expected.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["expected.npz", "y.npz"]


def test_npz_writer_discarded_midway_leaves_the_target_as_it_was(tmp_path):
    from qtool.fileio import NpzWriter

    target = tmp_path / "y.npz"
    target.write_bytes(b"the previous results")
    writer = NpzWriter(target, 4)
    writer.append({"a": np.ones((2, 3), np.float32), "b": np.zeros((2, 1), np.int8)})
    # the archive's temporary file: nameless where the system has O_TMPFILE, else beside the target
    assert len(list(tmp_path.iterdir())) == (1 if _nameless(tmp_path) else 2)
    writer.discard()
    assert target.read_bytes() == b"the previous results" and list(tmp_path.iterdir()) == [target]
    writer.discard()  # twice: nothing more to do
    # an output in folders that did not exist: made at the first batch, removed with the rest
    nested = NpzWriter(tmp_path / "new" / "sub" / "y.npz", 4)
    nested.append({"a": np.ones((2, 3), np.float32)})
    assert (tmp_path / "new" / "sub").is_dir()
    nested.discard()
    assert list(tmp_path.iterdir()) == [target]


def _nameless(folder) -> bool:
    from qtool.fileio import _anonymous

    fd = _anonymous(folder)
    if fd is not None:
        os.close(fd)
    return fd is not None


def test_an_exec_output_killed_midway_leaves_nothing_beside_the_target(tmp_path):
    # SIGKILL runs no cleanup: the .npz being written has no name until it is complete, so the
    # folder holds the previous results and nothing else
    import signal
    import subprocess
    import sys

    if not _nameless(tmp_path):
        pytest.skip("no O_TMPFILE here: the temporary file is named until renamed")
    target = tmp_path / "y.npz"
    target.write_bytes(b"the previous results")
    code = (f"import os, signal, numpy as np\nfrom qtool.fileio import NpzWriter\n"
            f"w = NpzWriter({str(target)!r}, 8)\n"
            f"w.append({{'a': np.ones((4, 1000), np.float32), 'b': np.ones((4, 3), np.int8)}})\n"
            f"os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert target.read_bytes() == b"the previous results" and list(tmp_path.iterdir()) == [target]


def test_atomic_file_nameless_named_or_unlinkable_replaces_the_target_whole(tmp_path, monkeypatch):
    from qtool import fileio

    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    for case in ("nameless", "named", "no-link"):
        if case == "nameless":
            pass  # O_TMPFILE where the system has it
        elif case == "named":
            monkeypatch.setattr(fileio, "_anonymous", lambda folder: None)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(fileio.os, "link", lambda *a, **k: (_ for _ in ()).throw(PermissionError(1, "no")))
        with fileio.atomic_file(target) as f:
            f.write(case.encode())
        assert target.read_bytes() == case.encode() and list(tmp_path.iterdir()) == [target]
        assert (target.stat().st_mode & 0o777) == 0o644
        with pytest.raises(RuntimeError):
            with fileio.atomic_file(target) as f:
                f.write(b"half")
                raise RuntimeError("stopped")
        assert target.read_bytes() == case.encode() and list(tmp_path.iterdir()) == [target]
        with pytest.raises(RuntimeError):  # the folders made for a failed output go with it
            with fileio.atomic_file(tmp_path / "new" / "sub" / "out.bin"):
                raise RuntimeError("stopped")
        assert list(tmp_path.iterdir()) == [target]


def test_the_working_set_counts_what_is_alive_at_once():
    # calibrate's batch estimate: a (4) read by b and c; alive together a, b and c (9), then a
    # freed after its last reader; d is an output and stays
    from onnx import helper

    from qtool.sizing import live_peak_bytes

    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Relu", ["a"], ["c"]), helper.make_node("Add", ["b", "c"], ["d"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("d", onnx.TensorProto.FLOAT, [1])])
    model = helper.make_model(graph)
    assert live_peak_bytes(model, {"a": 4, "b": 2, "c": 3, "d": 1}) == 9
    assert live_peak_bytes(model, {"a": 4, "b": 2, "c": 3, "d": 20}) == 25  # d made beside b and c
