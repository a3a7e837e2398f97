"""int16 activations (``--activation-type int16``): symmetric, zero point 0, int8 weights.

Below opset 21 the int16 QuantizeLinear/DequantizeLinear are onnxruntime's com.microsoft ops; from
21 the standard ones. The integer executor runs the model; onnxruntime runs the same QDQ graph in
float (graph optimizations off) as the second implementation, and each differs from float by far
less than the int8 model does. Lookup-table ops take 16-bit inputs with a 65536-entry table, checked
here against sigmoid computed with numpy.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.calibrate import calibrate
from qtool.executor import IntegerExecutor
from qtool.quantize import QuantizeOptions, quantize
from qtool.table_formats import write_table
from test_cli import assert_user_error, invoke


def _sqnr(ref, got):
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    noise = ((ref - got) ** 2).sum()
    return math.inf if noise == 0 else 10 * math.log10((ref ** 2).sum() / noise)


def _as_written(model, feeds):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _small_cnn(path, opset):
    """Conv -> Relu -> Conv -> Sigmoid -> Add (residual) -> GlobalAveragePool."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, .4, (6, 3, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(0, .1, 6).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.normal(0, .3, (6, 6, 1, 1)).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2"),
             helper.make_node("Sigmoid", ["c2"], ["s2"], name="sigmoid"),
             helper.make_node("Add", ["s2", "r1"], ["a"], name="add"),
             helper.make_node("GlobalAveragePool", ["a"], ["y"], name="gap")]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6, 1, 1])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10 if opset >= 21 else 8
    onnx.save(model, path)


@pytest.fixture(scope="module", params=[13, 21])
def cnn(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"int16_{request.param}")
    _small_cnn(folder / "m.onnx", request.param)
    x = np.random.default_rng(1).normal(0, 1, (16, 3, 8, 8)).astype(np.float32)
    np.savez(folder / "d.npz", x=x)
    return request.param, folder / "m.onnx", folder / "d.npz", x


def test_int16_fences_are_symmetric_and_in_the_opsets_domain(cnn):
    opset, model, data, _ = cnn
    qmodel, report = quantize(model, calibrate(model, data, progress=False),
                              QuantizeOptions(activation_type="int16"))
    inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
    fences = [n for n in qmodel.graph.node if n.op_type == "QuantizeLinear"]
    assert fences and all(n.domain == ("com.microsoft" if opset < 21 else "") for n in fences)
    for node in fences:
        zero_point = inits[node.input[2]]
        assert zero_point.dtype == np.int16 and not zero_point.any()
    if opset < 21:
        assert "com.microsoft" in {o.domain for o in qmodel.opset_import}
    assert report.quantized == {"Add": 1, "Conv": 2, "GlobalAveragePool": 1, "Relu": 1, "Sigmoid": 1}


def test_the_executor_runs_int16_all_integer_and_far_closer_than_int8(cnn):
    _, model, data, x = cnn
    table = calibrate(model, data, progress=False)
    q16, _ = quantize(model, table, QuantizeOptions(activation_type="int16"))
    q8, _ = quantize(model, table, QuantizeOptions())
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    executor = IntegerExecutor(q16)
    assert not [s for s in executor.steps if s.kind == "float"]  # the Sigmoid's table included
    got16 = executor.run({"x": x}).outputs["y"]
    got8 = IntegerExecutor(q8).run({"x": x}).outputs["y"]
    ort16 = _as_written(q16, {"x": x})
    # int8 weights bound both; int16 activations remove most of the rest
    assert _sqnr(ref, got16) > _sqnr(ref, got8) + 6
    # two implementations of the same QDQ graph: integer requantization against float
    assert _sqnr(ort16, got16) > 60
    step = float(np.abs(ref).max()) / 32767
    assert np.abs(got16 - ort16).max() <= 8 * step


def test_a_16_bit_lookup_table_equals_the_function_rounded_once():
    from qtool.ops import REGISTRY, NodeView, Operand
    from qtool.qparams import QParams

    node = helper.make_node("Sigmoid", ["x"], ["y"], name="s")
    x_qp, y_qp = QParams(8.0 / 32767, 0, "int16"), QParams(1.0 / 32767, 0, "int16")
    view = NodeView(node, [Operand(x_qp)], y_qp)
    op = REGISTRY["Sigmoid"]
    params = op.derive(view)
    assert params.wide.shape == (65536,) and params.table is None  # not written out: 128 KB
    q = np.arange(-32768, 32768, dtype=np.int16)
    real = q.astype(np.float32) * np.float32(x_qp.scale)  # DequantizeLinear's float32
    expected = np.clip(np.floor(1 / (1 + np.exp(-real.astype(np.float64))) / y_qp.scale + 0.5), -32768, 32767)
    got = op.run(params, q)
    assert got.dtype == np.int16
    assert np.array_equal(got, expected.astype(np.int16))


@pytest.mark.parametrize("extra, message", [
    (["--format", "qoperator"], "--activation-type int16 is written as QDQ for the portable target "
                                "(the QLinear ops and the x86 forms take 8-bit activations); drop --format qoperator"),
    (["--target", "x86-vnni"], "drop --target x86-vnni"),
])
def test_int16_refuses_8_bit_forms(demo_model, demo_table, tmp_path, extra, message):
    write_table(demo_table, tmp_path / "t.yaml")
    result = invoke("quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx",
                    "--activation-type", "int16", *extra)
    assert_user_error(result, message)
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.parametrize("extra", [["--format", "qoperator"], ["--target", "x86-vnni"]])
def test_a_precision_tables_int16_refuses_8_bit_forms_naming_the_table(demo_model, demo_table, tmp_path, extra):
    write_table(demo_table, tmp_path / "t.yaml")
    (tmp_path / "qtable.txt").write_text("block_conv1 INT16\nfc F32\n")
    result = invoke("quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx",
                    "--precision-table", tmp_path / "qtable.txt", *extra)
    line = assert_user_error(result, "the precision table's INT16 (block_conv1) is written as QDQ for the portable "
                                     "target (the QLinear ops and the x86 forms take 8-bit activations); "
                                     f"drop {' '.join(extra)}")
    assert "--activation-type" not in line
    assert not (tmp_path / "q.onnx").exists()


def test_a_precision_table_widens_the_named_ops_and_keeps_others_float(cnn, tmp_path):
    _, model, data, x = cnn
    write_table(calibrate(model, data, progress=False), tmp_path / "t.yaml")
    (tmp_path / "qtable.txt").write_text("# node  type\nconv2 INT16   # the second conv\n\nGlobalAveragePool F32\n")
    result = invoke("quantize", model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx",
                    "--precision-table", tmp_path / "qtable.txt", "--json")
    assert result.exit_code == 0, result.output
    qmodel = onnx.load(tmp_path / "q.onnx")
    inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
    types = {n.input[0]: inits[n.input[2]].dtype for n in qmodel.graph.node if n.op_type == "QuantizeLinear"}
    assert types["r1"] == types["c2"] == np.int16  # conv2's input and output
    assert types["x"] != np.int16 and types["s2"] != np.int16
    assert [f["node"] for f in json.loads(result.stdout)["kept_float"]] == ["gap"]
    executor = IntegerExecutor(qmodel)
    got = executor.run({"x": x}).outputs["y"]
    assert np.array_equal(got, _as_written(qmodel, {"x": x}))  # int8 and int16 ops side by side


def test_the_report_lists_the_int16_ops_and_credits_the_precision_table(demo_model, demo_table, tmp_path):
    write_table(demo_table, tmp_path / "t.yaml")
    (tmp_path / "qtable.txt").write_text("block_conv1 INT16\nfc F32\n")
    args = ["quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx",
            "--precision-table", tmp_path / "qtable.txt"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    # block_conv1's input is relu1's output (and conv1's, which relu1 shares), its output block_relu1's input
    assert lines[1] == "int16:   4 ops (Conv 2, Relu 2) with int16 activations ('conv1', 'relu1', 'block_conv1', ...)"
    assert "  Gemm x1: kept float (--precision-table) ('fc')" in lines
    report = json.loads(invoke(*args, "--json").stdout)
    assert [(i["op_type"], i["node"]) for i in report["int16"]] == [
        ("Conv", "conv1"), ("Relu", "relu1"), ("Conv", "block_conv1"), ("Relu", "block_relu1")]
    assert report["kept_float"] == [{"op_type": "Gemm", "node": "fc", "reason": "kept float (--precision-table)"}]
    # the model records the same reason, so verify shows it too
    recorded = next(p.value for p in onnx.load(tmp_path / "q.onnx").metadata_props if p.key == "qtool.float_nodes")
    assert "--precision-table" in recorded and "--keep-float" not in recorded
    given = invoke(*args, "--keep-float", "Gemm")  # named by --keep-float as well: its reason
    assert "  Gemm x1: kept float (--keep-float) ('fc')" in given.stdout.splitlines()
    plain = json.loads(invoke("quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q8.onnx",
                              "--json").stdout)
    assert "int16" not in plain


@pytest.mark.parametrize("text, message", [
    ("conv2 INT4\n", "line 1: unknown type 'INT4'; choose one of INT16, INT8, F32, F16, BF16"),
    ("# ok\nconv9 INT16\n", "line 2: the model has no node or op type 'conv9'"),
    ("conv2\n", "line 1: expected 'NODE TYPE', got 'conv2'"),
])
def test_precision_table_errors_name_the_line(tmp_path, text, message, cnn):
    _, model, data, _ = cnn
    write_table(calibrate(model, data, progress=False), tmp_path / "t.yaml")
    (tmp_path / "qtable.txt").write_text(text)
    result = invoke("quantize", model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx",
                    "--precision-table", tmp_path / "qtable.txt")
    assert_user_error(result, f"precision table '{tmp_path / 'qtable.txt'}' {message}")
    assert not (tmp_path / "q.onnx").exists()


def test_a_precision_table_not_in_utf8(demo_model, demo_table, tmp_path):
    """One Latin-1 byte after a good line: one line, exit 2 (was exit 3, an AttributeError)."""
    write_table(demo_table, tmp_path / "t.yaml")
    (tmp_path / "qtable.txt").write_bytes(b"conv1 INT16\n\xff\xfe\n")
    result = invoke("quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx",
                    "--precision-table", tmp_path / "qtable.txt")
    assert_user_error(result, f"precision table '{tmp_path / 'qtable.txt'}' is not a text file (byte 12 is not UTF-8)")
    assert not (tmp_path / "q.onnx").exists()


def test_a_missing_precision_table(demo_model, demo_table, tmp_path):
    write_table(demo_table, tmp_path / "t.yaml")
    result = invoke("quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx",
                    "--precision-table", tmp_path / "none.txt")
    assert_user_error(result, f"precision table '{tmp_path / 'none.txt'}': No such file or directory")


def test_the_search_gives_ops_int16_and_keeps_the_model_integer(demo_model, demo_table, demo_calib):
    from qtool.analyze import split_batches
    from qtool.model import load_model, prepare
    from qtool.search import search

    qmodel, report, result = search(demo_model, demo_table, QuantizeOptions(), "t", demo_calib, target_db=34.5,
                                    bias_correction=False, progress=False, holdout=0)
    assert result.precision == "int16" and result.int16 and not result.kept_float
    assert not report.kept_float and result.reached
    executor = IntegerExecutor(qmodel)
    assert not [s for s in executor.steps if s.kind == "float"]  # all integer
    inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
    wide = {n.input[0] for n in qmodel.graph.node
            if n.op_type == "QuantizeLinear" and inits[n.input[2]].dtype == np.int16}
    promoted = {name for _, name in result.int16}
    for node in qmodel.graph.node:  # every promoted op reads and writes int16 fences
        if node.name in promoted:
            assert node.output[0] in wide
    # the SQNR it reports is the written model's, recomputed here on the same samples
    float_model = prepare(load_model(demo_model))
    fit, _ = split_batches(float_model, demo_calib, 16, 0, 8)
    name = float_model.graph.input[0].name
    ref = np.concatenate([_as_written(float_model, {name: b[name]}) for b in fit])
    got = np.concatenate([_as_written(qmodel, {name: b[name]}) for b in fit])
    assert result.final_db == pytest.approx(_sqnr(ref, got), abs=1e-3)
    assert result.final_db >= 34.5 > result.integer_db


def test_an_int16_search_refuses_8_bit_forms(demo_model, demo_table, demo_calib, tmp_path):
    write_table(demo_table, tmp_path / "t.yaml")
    result = invoke("quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx", "--data",
                    demo_calib, "--target-sqnr", "40", "--format", "qoperator")
    assert_user_error(result, "the search gives ops int16 activations, written as QDQ for the portable "
                              "target; add --allow-float to keep them float instead")
    result = invoke("quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx",
                    "--allow-float")
    assert_user_error(result, "--allow-float is for the search: add --target-sqnr or --max-float-layers")
    assert not (tmp_path / "q.onnx").exists()


def test_an_int16_search_of_an_int16_model_is_refused_and_float_search_names_its_base(demo_model, demo_table,
                                                                                      demo_calib, tmp_path):
    # every op has int16 activations already: an int16 search has nothing to give (it reported
    # "0 ops given int16 activations; SQNR 43.9 dB all int8 -> 43.9 dB ... all int8 kept")
    write_table(demo_table, tmp_path / "t.yaml")
    args = ("quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx", "--data", demo_calib,
            "--target-sqnr", "60", "--activation-type", "int16")
    result = invoke(*args)
    assert_user_error(result, "the search gives ops int16 activations, and --activation-type int16 has given "
                              "them to every op already; add --allow-float to keep ops float instead")
    assert not (tmp_path / "q.onnx").exists()
    result = invoke(*args, "--allow-float")
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("search:"))
    assert "dB all int16 -> " in line and "int8" not in line


def test_16_bit_tables_are_not_written_into_the_model(cnn):
    # the integer parameters travel in the model's metadata; a 65536-entry table per op made a
    # PP-OCRv4 rec with every op int16 15.7 MB instead of 4 MB
    _, model, data, _ = cnn
    qmodel, _ = quantize(model, calibrate(model, data, progress=False), QuantizeOptions(activation_type="int16"))
    params = json.loads(next(p.value for p in qmodel.metadata_props if p.key == "qtool.params"))
    sigmoid = next(op for op in params["ops"] if op["node"] == "sigmoid")
    assert sigmoid["params"]["table"] is None and sigmoid["params"]["in_dtype"] == "int16"
    assert len(qmodel.SerializeToString()) < 20_000


def test_int16_activations_take_the_ranges_as_calibrated_where_a_method_choice_clipped_them(cnn):
    # quantize --data's method choice may clip the 8-bit ranges (mse, percentile); an op the
    # placement or the search gives int16 takes the table's own range (PP-OCRv6 small rec, mse
    # chosen, every op int16: 11.4 dB with mse's ranges, 29.9 dB with the calibrated ones)
    from dataclasses import replace

    from qtool.recipe import int16_as_calibrated
    from qtool.table import TensorEntry

    _, model, data, _ = cnn
    given = calibrate(model, data, progress=False)
    clipped = replace(given, method="mse", tensors={
        name: TensorEntry(e.min / 4, e.max / 4, e.threshold / 4, "mse") if name != "x" else e
        for name, e in given.tensors.items()})
    chosen = int16_as_calibrated(clipped, given)
    assert chosen.int16_ranges == {name: (e.min, e.max) for name, e in given.tensors.items() if name != "x"}
    # what --table-out writes: the chosen ranges, and the calibrated ones after them for int16
    written = chosen.to_dict()
    assert {k: v for k, v in written.items() if k != "int16_ranges"} == clipped.to_dict()
    assert written["int16_ranges"] == {name: [lo, hi] for name, (lo, hi) in chosen.int16_ranges.items()}
    from pathlib import Path

    from qtool.table import parse_table
    assert parse_table(Path("t.yaml"), chosen.dumps()) == chosen and parse_table(Path("t.json"), chosen.dumps("json")) \
        == chosen

    def fences(qmodel):  # tensor -> (scale, zero point type)
        inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
        return {n.input[0]: (float(inits[n.input[1]]), inits[n.input[2]].dtype)
                for n in qmodel.graph.node if n.op_type == "QuantizeLinear"}

    plain = fences(quantize(model, clipped, QuantizeOptions(int16=("conv2",)))[0])
    kept = fences(quantize(model, chosen, QuantizeOptions(int16=("conv2",)))[0])
    for name in ("r1", "c2"):  # conv2's input and output: int16, over the calibrated range
        whole = max(abs(given.tensors[name].min), abs(given.tensors[name].max))
        assert kept[name] == (pytest.approx(whole / 32767, rel=1e-6), np.int16)
        assert plain[name][0] == pytest.approx(kept[name][0] / 4, rel=1e-6)
    # the 8-bit ones keep the chosen ranges: every int8 fence as without int16_ranges
    assert {n: v for n, v in kept.items() if v[1] != np.int16} == {n: v for n, v in plain.items() if v[1] != np.int16}
    # and a model with no int16 op is the same bytes either way
    assert quantize(model, chosen, QuantizeOptions())[0].SerializeToString() == \
        quantize(model, clipped, QuantizeOptions())[0].SerializeToString()


def test_a_table_written_with_int16_ranges_quantizes_the_same_model(cnn, tmp_path):
    # --table-out's file carries int16_ranges: quantize from it gives the int16 ops the ranges
    # quantize --data gave them, the same bytes as from the table in memory
    from dataclasses import replace

    from qtool.recipe import int16_as_calibrated
    from qtool.table import TensorEntry
    from qtool.table_formats import load_table

    _, model, data, _ = cnn
    given = calibrate(model, data, progress=False)
    clipped = replace(given, method="mse", tensors={
        name: TensorEntry(e.min / 3, e.max / 3, e.threshold / 3, "mse") for name, e in given.tensors.items()})
    chosen = int16_as_calibrated(clipped, given)
    path = tmp_path / "chosen.yaml"
    path.write_text(chosen.dumps())
    options = QuantizeOptions(int16=("conv2",))
    assert quantize(model, load_table(path)[0], options)[0].SerializeToString() == \
        quantize(model, chosen, options)[0].SerializeToString() != \
        quantize(model, clipped, options)[0].SerializeToString()


@pytest.mark.parametrize("ranges, message", [
    ("[1, 2]", "'int16_ranges' must be a mapping of tensor name to [min, max]"),
    ("{c2: 3}", "int16_ranges of tensor 'c2' must be two numbers [min, max]"),
    ("{c2: '38'}", "int16_ranges of tensor 'c2' must be two numbers [min, max]"),
    ("{c2: [true, 1]}", "int16_ranges of tensor 'c2' must be two numbers [min, max]"),
    ("{c2: [1, 2, 3]}", "int16_ranges of tensor 'c2' must be two numbers [min, max]"),
    ("{c2: [2, -1]}", "int16_ranges of tensor 'c2' is not a finite range (min 2.0, max -1.0)"),
    ("{c2: [.nan, 1]}", "int16_ranges of tensor 'c2' is not a finite range"),
])
def test_a_bad_int16_ranges_entry_is_a_one_line_error(cnn, tmp_path, ranges, message):
    _, model, data, _ = cnn
    path = tmp_path / "t.yaml"
    path.write_text(calibrate(model, data, progress=False).dumps() + f"int16_ranges: {ranges}\n")
    assert_user_error(invoke("quantize", model, "-t", path, "-o", tmp_path / "q.onnx"),
                      f"table file '{path}': {message}")
