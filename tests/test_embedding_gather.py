"""A Gather of rows from a constant float table (an embedding) by run-time indices: the table is
stored int8 with one scale per row, onnxruntime runs the QDQ model, the executor gathers integers
and requantizes each row, and the two agree within one step."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.calibrate import calibrate
from qtool.errors import IndexOutOfRange
from qtool.executor import IntegerExecutor
from qtool.fixedpoint import Requant
from qtool.ops import REGISTRY, NodeView, Operand, Unsupported
from qtool.ops.embedding import EmbeddingParams
from qtool.qparams import QParams
from qtool.quantize import QuantizeOptions, quantize

ROWS, WIDTH = 1000, 64


def _model(axis=0):
    """ids [N, L] int64 -> Gather(table [ROWS, WIDTH]) -> + position table -> y, as BERT's
    embeddings start; the rows' magnitudes differ by 30x, which one scale for the table would
    spend on the largest."""
    rng = np.random.default_rng(0)
    table = rng.normal(0, 1, (ROWS, WIDTH)) * rng.uniform(0.05, 1.5, (ROWS, 1))
    position = rng.normal(0, 0.2, (1, 8, WIDTH))
    nodes = [helper.make_node("Gather", ["table", "ids"], ["words"], axis=axis, name="embed"),
             helper.make_node("Add", ["words", "position"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, WIDTH])],
                              [numpy_helper.from_array(table.astype(np.float32), "table"),
                               numpy_helper.from_array(position.astype(np.float32), "position")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _ids(n, seed):
    return np.random.default_rng(seed).integers(0, ROWS, (n, 8)).astype(np.int64)


def _every_row():
    """Calibration ids that visit every row once: the output's range is then the table's (rows
    never seen in calibration would saturate)."""
    return np.random.default_rng(1).permutation(ROWS).reshape(-1, 8).astype(np.int64)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    folder = tmp_path_factory.mktemp("embedding")
    onnx.save(_model(), folder / "m.onnx")
    np.savez(folder / "d.npz", ids=_every_row())
    table = calibrate(folder / "m.onnx", folder / "d.npz", progress=False)
    return folder, quantize(folder / "m.onnx", table)


def test_the_table_is_int8_with_one_scale_per_row(quantized):
    folder, (qmodel, report) = quantized
    assert report.kept_float == [] and report.quantized == {"Add": 1, "Gather": 1}
    inits = {t.name: numpy_helper.to_array(t) for t in qmodel.graph.initializer}
    dq = next(n for n in qmodel.graph.node if n.op_type == "DequantizeLinear" and n.output[0] in
              next(g for g in qmodel.graph.node if g.op_type == "Gather").input)
    # one byte an entry: int8, or uint8 with zero point 128 in the default (portable) target's form
    assert inits[dq.input[0]].dtype.itemsize == 1 and inits[dq.input[0]].shape == (ROWS, WIDTH)
    assert inits[dq.input[1]].shape == (ROWS,) and {a.name: a.i for a in dq.attribute}["axis"] == 0
    onnx.checker.check_model(qmodel, full_check=True)
    # the table is a quarter of its float bytes (and its scales a 1/WIDTH); the model carries
    # the per-row scales and multipliers again in its integer parameters (metadata)
    stored = {t.name: len(t.raw_data) for t in qmodel.graph.initializer}
    assert stored[dq.input[0]] == ROWS * WIDTH and stored[dq.input[1]] == ROWS * 4
    assert report.size_before > ROWS * WIDTH * 4 and qmodel.ByteSize() < 0.5 * report.size_before


def test_executor_and_onnxruntime_agree_within_one_step(quantized):
    folder, (qmodel, _) = quantized
    ids = _ids(32, 2)
    ids[0, :3] = [0, ROWS - 1, -1]  # ends, and a negative index counting back
    executor = IntegerExecutor(qmodel)
    assert executor.float_nodes() == []
    gather = next(s for s in executor.steps if s.node.op_type == "Gather")
    assert gather.kind == "integer" and np.shape(gather.params.requant.multiplier) == (ROWS,)
    run = executor.run({"ids": ids}, keep_integer=True)
    want = ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"ids": ids})[0]
    step = executor.integer_tensors()["y_float"].qparams.scale
    assert np.abs(run.outputs["y"] - want).max() <= step * 1.001
    # the gathered rows themselves: the executor's integer rows against onnxruntime's, one step
    words = executor.integer_tensors()["words"].qparams
    probe = onnx.ModelProto()
    probe.CopyFrom(qmodel)
    q_words = next(n for n in qmodel.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "words")
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(words.dtype))
    probe.graph.output.append(helper.make_tensor_value_info(q_words.output[0], elem, None))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ort_words = ort.InferenceSession(probe.SerializeToString(), options).run([q_words.output[0]], {"ids": ids})[0]
    assert np.abs(run.integer["words"].astype(np.int64) - ort_words).max() <= 1
    assert np.mean(run.integer["words"] == ort_words) > 0.99
    # and against the float model: the per-row table costs about one output step
    float_y = ort.InferenceSession(_model().SerializeToString()).run(None, {"ids": ids})[0]
    assert np.abs(run.outputs["y"] - float_y).max() <= 2 * step


def test_per_tensor_table(tmp_path):
    onnx.save(_model(), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", ids=_every_row())
    qmodel, report = quantize(tmp_path / "m.onnx", calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False),
                              QuantizeOptions(per_channel=False))
    executor = IntegerExecutor(qmodel)
    gather = next(s for s in executor.steps if s.node.op_type == "Gather")
    assert gather.kind == "integer" and np.ndim(gather.params.requant.multiplier) == 0
    ids = _ids(8, 3)
    want = ort.InferenceSession(qmodel.SerializeToString()).run(None, {"ids": ids})[0]
    step = executor.integer_tensors()["y_float"].qparams.scale
    assert np.abs(executor.run({"ids": ids}).outputs["y"] - want).max() <= step * 1.001


def test_by_hand():
    op = REGISTRY["Gather"]
    table = np.array([[10, -20], [100, 127], [-3, 4]], np.int8)
    # rows at scales 0.5, 0.25, 1 into an output of scale 0.5, zero point 3: x1, x0.5, x2
    node = helper.make_node("Gather", ["t", "i"], ["y"])
    view = NodeView(node, [Operand(QParams(np.array([0.5, 0.25, 1.0], np.float32), np.zeros(3, np.int64), "int8", 0),
                                   table), Operand(None)], QParams(0.5, 3, "int8"))
    p = op.derive(view)
    y = op.run(p, np.array([[2, 0], [1, -1]], np.int64))
    assert y.tolist() == [[[-3, 11], [13, -17]], [[53, 67], [-3, 11]]]
    same = EmbeddingParams(table, None, 0, "half_up", "int8")
    assert op.run(same, np.array([1], np.int32)).tolist() == [[100, 127]]
    with pytest.raises(IndexOutOfRange, match="outside"):
        op.run(p, np.array([3]))
    half = EmbeddingParams(table, Requant(np.int64(2**30), np.int64(31)), 0, "half_up", "int8")
    assert op.run(half, np.array([0])).tolist() == [[5, -10]]


def test_other_gathers_stay_float(tmp_path):
    """A Gather along another axis, or of a tensor computed at run time (a shape), is not an
    embedding: it stays float, reported with the reason."""
    table = np.random.default_rng(0).normal(0, 1, (ROWS, WIDTH)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["y"], axis=1, name="columns"),
             helper.make_node("Shape", ["y"], ["shape"], name="shape"),
             helper.make_node("Gather", ["shape", "last"], ["width"], axis=0, name="pick")]
    graph = helper.make_graph(nodes, "gathers", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, "N", 8]),
                               helper.make_tensor_value_info("width", TensorProto.INT64, [])],
                              [numpy_helper.from_array(table, "table"),
                               numpy_helper.from_array(np.array(-1, np.int64), "last")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", ids=np.random.default_rng(0).integers(0, WIDTH, (16, 8)).astype(np.int64))
    _, report = quantize(tmp_path / "m.onnx", calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False))
    reasons = {name: why for op_type, name, why in report.kept_float if op_type == "Gather"}
    assert reasons == {"columns": "Gather axis 1: only rows of a table (axis 0) are gathered",
                       "pick": "input 'shape' must be a constant"}


def _table_of(qmodel):
    inits = {t.name: numpy_helper.to_array(t) for t in qmodel.graph.initializer}
    gather = next(n for n in qmodel.graph.node if n.op_type == "Gather")
    dq = next(n for n in qmodel.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == gather.input[0])
    return inits[dq.input[0]], inits[dq.input[1]]


def test_an_int16_gather_stores_a_small_table_int16(tmp_path):
    """With int16 activations a table of at most WIDE_TABLE_VALUES values (a position or token-type
    table) is stored int16 per row: its rows' rounding is no longer an int8 step added to every
    token. onnxruntime runs the model and the executor agrees with it within one step; the rows
    gathered are within one int16 step of the float table's (an int8 table's: ~100 such steps)."""
    from qtool.quantize import WIDE_TABLE_VALUES

    assert ROWS * WIDTH <= WIDE_TABLE_VALUES
    onnx.save(_model(), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", ids=_every_row())
    table = calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False)
    qmodel, _ = quantize(tmp_path / "m.onnx", table, QuantizeOptions(activation_type="int16"))
    values, scales = _table_of(qmodel)
    assert values.dtype == np.int16 and scales.shape == (ROWS,)
    ids = _ids(32, 2)
    executor = IntegerExecutor(qmodel)
    run = executor.run({"ids": ids}, keep_integer=True)
    want = ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"ids": ids})[0]
    step = executor.integer_tensors()["y_float"].qparams.scale
    assert np.abs(run.outputs["y"] - want).max() <= step * 1.001
    words = executor.integer_tensors()["words"].qparams
    rows = run.integer["words"].astype(np.float64) * words.scale
    table_rows = numpy_helper.to_array(_model().graph.initializer[0])[ids]
    assert np.abs(rows - table_rows).max() <= 1.001 * words.scale


def test_a_large_or_int8_gathered_table_stays_one_byte(tmp_path, monkeypatch):
    import qtool.quantize as quantize_module

    monkeypatch.setattr(quantize_module, "WIDE_TABLE_VALUES", ROWS * WIDTH)  # the rule, not the bound's size
    WIDE_TABLE_VALUES = quantize_module.WIDE_TABLE_VALUES
    onnx.save(_model(), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", ids=_every_row())
    table = calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False)
    assert _table_of(quantize(tmp_path / "m.onnx", table)[0])[0].dtype.itemsize == 1  # int8 output
    rows = WIDE_TABLE_VALUES // WIDTH + 1  # a word table beyond the bound, int16 output
    big = _model()
    big.graph.initializer[0].CopyFrom(numpy_helper.from_array(
        np.random.default_rng(3).normal(0, 1, (rows, WIDTH)).astype(np.float32), "table"))
    onnx.save(big, tmp_path / "big.onnx")
    np.savez(tmp_path / "big.npz", ids=np.random.default_rng(4).integers(0, rows, (64, 8)).astype(np.int64))
    table = calibrate(tmp_path / "big.onnx", tmp_path / "big.npz", progress=False)
    qmodel, _ = quantize(tmp_path / "big.onnx", table, QuantizeOptions(activation_type="int16"))
    assert _table_of(qmodel)[0].dtype.itemsize == 1
