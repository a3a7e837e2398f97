"""Data for integer model inputs (token ids, attention masks), checked before any run: float ids
refused in one line, narrower integers fed as the model's type, values that would wrap refused,
and two inputs that name the same size (sequence_length) with arrays that disagree on it named
together (sweep 4: onnxruntime's messages named neither the input nor the file)."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from test_cli import assert_no_crash, assert_user_error, invoke


def _token_model(path):
    """ids and mask [N, sequence_length] (int64) -> embeddings zeroed where the mask is 0."""
    table = numpy_helper.from_array(np.random.default_rng(0).normal(0, 1, (50, 4)).astype(np.float32), "table")
    axes = numpy_helper.from_array(np.array([2], np.int64), "axes")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
             helper.make_node("Cast", ["mask"], ["maskf"], name="cast", to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["maskf", "axes"], ["mask3"], name="unsqueeze"),
             helper.make_node("Mul", ["emb", "mask3"], ["y"], name="masked")]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["N", "sequence_length"]) for n in ("ids", "mask")]
    graph = helper.make_graph(nodes, "tokens", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "sequence_length", 4])],
                              [table, axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _data(path, ids_type=np.int64, mask_type=np.int64, mask_length=12):
    rng = np.random.default_rng(1)
    np.savez(path, ids=rng.integers(0, 50, (8, 12)).astype(ids_type),
             mask=(np.arange(mask_length)[None, :] < rng.integers(4, mask_length + 1, (8, 1))).astype(mask_type))
    return path


def test_float_ids_are_refused_naming_the_input_and_the_file(tmp_path):
    model, data = _token_model(tmp_path / "m.onnx"), _data(tmp_path / "d.npz", ids_type=np.float32)
    assert_user_error(invoke("calibrate", model, "-d", data, "-o", tmp_path / "t.yaml"),
                      f"data file '{data}' array for input 'ids' has dtype float32; model expects int64",
                      "save it as integers")
    assert not (tmp_path / "t.yaml").exists()


def test_narrower_integers_are_fed_as_the_model_s_type(tmp_path):
    model = _token_model(tmp_path / "m.onnx")
    tables = []
    for name, kinds in (("wide", (np.int64, np.int64)), ("narrow", (np.int32, np.uint8))):
        data = _data(tmp_path / f"{name}.npz", *kinds)
        result = invoke("calibrate", model, "-d", data, "-o", tmp_path / f"{name}.yaml", "-q")
        assert_no_crash(result)
        assert result.exit_code == 0, result.output
        tables.append([line for line in (tmp_path / f"{name}.yaml").read_text().splitlines() if "sha256" not in line])
    assert tables[0] == tables[1]
    huge = tmp_path / "huge.npz"
    np.savez(huge, ids=np.full((8, 12), 2 ** 63, np.uint64), mask=np.ones((8, 12), np.int64))
    assert_user_error(invoke("calibrate", model, "-d", huge, "-o", tmp_path / "h.yaml"),
                      "input 'ids' has dtype uint64 with values in [9223372036854775808, 9223372036854775808]",
                      "model expects int64")


def test_inputs_that_name_one_size_must_agree_on_it(tmp_path):
    model, data = _token_model(tmp_path / "m.onnx"), _data(tmp_path / "d.npz", mask_length=16)
    assert_user_error(invoke("calibrate", model, "-d", data, "-o", tmp_path / "t.yaml"),
                      f"data file '{data}': arrays for inputs 'ids' and 'mask' differ in 'sequence_length' "
                      f"(12 and 16)")
    qmodel = tmp_path / "q.onnx"
    assert invoke("calibrate", model, "-d", _data(tmp_path / "ok.npz"), "-o", tmp_path / "ok.yaml", "-q").exit_code == 0
    assert invoke("quantize", model, "-t", tmp_path / "ok.yaml", "-o", qmodel, "-q").exit_code == 0
    assert_user_error(invoke("exec", qmodel, "--input", data, "-o", tmp_path / "y.npz"),
                      "arrays for inputs 'ids' and 'mask' differ in 'sequence_length' (12 and 16)")


def test_placeholder_names_are_no_shared_size():
    # paddle2onnx writes every open size as '?' ([?, 3, ?, ?]: height 48, width 192), and a name
    # one input gives twice is no size two inputs share either
    from qtool.data import check_named_dims

    image = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["?", 3, "?", "?"])
    other = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["?", "?"])
    square = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", "side", "side"])
    arrays = {"x": np.zeros((2, 3, 48, 192)), "y": np.zeros((2, 7)), "z": np.zeros((2, 5, 6))}
    check_named_dims("f", [image, other, square], arrays, {"x": 0, "y": 0, "z": 0})  # nothing to refuse
    named = helper.make_tensor_value_info("w", TensorProto.FLOAT, ["N", "side"])
    check_named_dims("f", [square, named], {"z": arrays["z"], "w": np.zeros((2, 9))}, {"z": 0, "w": 0})


def test_ids_beyond_the_embedding_table_are_named_with_the_file(tmp_path):
    model = _token_model(tmp_path / "m.onnx")  # its table has 50 rows
    data = _data(tmp_path / "d.npz")
    arrays = dict(np.load(data))
    arrays["ids"][3, 5] = 60
    np.savez(data, **arrays)
    assert_user_error(invoke("calibrate", model, "-d", data, "-o", tmp_path / "t.yaml"),
                      f"data file '{data}' array for input 'ids' holds 60, outside the 50 rows of the table "
                      f"Gather 'embed' reads it into (indices from -50 to 49)")
    arrays["ids"][3, 5] = -51
    np.savez(data, **arrays)
    assert_user_error(invoke("calibrate", model, "-d", data, "-o", tmp_path / "t.yaml"), "holds -51, outside")


def test_the_checks_read_a_large_file_a_chunk_at_a_time(tmp_path, monkeypatch):
    # arrays over LAZY_BYTES are read in rows (RowFile): the ranges come chunk by chunk
    import qtool.data

    monkeypatch.setattr(qtool.data, "LAZY_BYTES", 64)
    model = _token_model(tmp_path / "m.onnx")
    narrow = _data(tmp_path / "narrow.npz", np.int32, np.int32)
    result = invoke("calibrate", model, "-d", narrow, "-o", tmp_path / "t.yaml", "-q")
    assert result.exit_code == 0, result.output
    arrays = dict(np.load(narrow))
    arrays["ids"][7, 11] = 50
    np.savez(tmp_path / "bad.npz", **arrays)
    assert_user_error(invoke("calibrate", model, "-d", tmp_path / "bad.npz", "-o", tmp_path / "b.yaml"),
                      "array for input 'ids' holds 50, outside the 50 rows")


def test_ids_beyond_the_table_of_a_quantized_model_are_named_too(tmp_path):
    # exec and verify read the quantized model, whose table is a DequantizeLinear of int8 rows
    model = _token_model(tmp_path / "m.onnx")
    good, bad = _data(tmp_path / "d.npz"), tmp_path / "bad.npz"
    arrays = dict(np.load(good))
    arrays["ids"][2, 1] = 77
    np.savez(bad, **arrays)
    qmodel = tmp_path / "q.onnx"
    assert invoke("calibrate", model, "-d", good, "-o", tmp_path / "t.yaml", "-q").exit_code == 0
    assert invoke("quantize", model, "-t", tmp_path / "t.yaml", "-o", qmodel, "-q").exit_code == 0
    assert_user_error(invoke("exec", qmodel, "--input", bad, "-o", tmp_path / "y.npz"),
                      f"data file '{bad}' array for input 'ids' holds 77, outside the 50 rows of the table "
                      f"Gather 'embed' reads it into")
    assert_user_error(invoke("verify", model, qmodel, "--data", bad), "holds 77, outside the 50 rows")


def test_ids_that_reach_the_table_through_other_ops_are_named_by_the_executor(tmp_path):
    # sweep 7's name romanizer: the last token is picked by a Gather of a constant index before the
    # embedding; the executor's table lookup raised IndexError (exit 3, naming nothing)
    table = numpy_helper.from_array(np.random.default_rng(0).normal(0, 1, (50, 4)).astype(np.float32), "table")
    last = numpy_helper.from_array(np.array(-1, np.int64), "last")
    nodes = [helper.make_node("Gather", ["ids", "last"], ["token"], name="pick", axis=1),
             helper.make_node("Gather", ["table", "token"], ["y"], name="embed")]
    graph = helper.make_graph(nodes, "pick", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], [table, last])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    rng = np.random.default_rng(2)
    np.savez(tmp_path / "d.npz", ids=rng.integers(0, 50, (8, 6)))
    ids = rng.integers(0, 50, (8, 6))
    ids[4, -1] = 99
    np.savez(tmp_path / "bad.npz", ids=ids)
    qmodel = tmp_path / "q.onnx"
    assert invoke("calibrate", model, "-d", tmp_path / "d.npz", "-o", tmp_path / "t.yaml", "-q").exit_code == 0
    assert invoke("quantize", model, "-t", tmp_path / "t.yaml", "-o", qmodel, "-q").exit_code == 0
    assert_user_error(invoke("exec", qmodel, "--input", tmp_path / "bad.npz", "-o", tmp_path / "y.npz"),
                      "Gather node 'embed' reads index 99, outside the 50 rows of its table (from -50 to 49)")
