"""Options and messages sweep 9 found taken without a word, or said in words that did not name the
option or the file: each is one line, exit 2, naming it (or a warning where the result stands)."""

import pytest

from qtool.table_formats import write_table
from test_cli import assert_user_error, invoke


@pytest.fixture(scope="module")
def table(tmp_path_factory, demo_table):
    path = tmp_path_factory.mktemp("checks") / "t.yaml"
    write_table(demo_table, path)
    return path


@pytest.mark.parametrize("args, message", [
    (["--holdout", "4"], "--holdout sets how --data's samples are used: add --data DATA, or drop it"),
    (["--num-samples", "4"], "--num-samples sets how --data's samples are used"),
    (["--num-samples", "16"], "--num-samples sets how --data's samples are used"),  # the default, given
    (["--batch-size", "4"], "--batch-size sets how --data's samples are used"),
    (["--multiplier-bits", "16"], "--multiplier-bits must be one of 32, 8, got 16"),
])
def test_quantize_refusals_name_the_option(tmp_path, demo_model, table, args, message):
    result = invoke("quantize", demo_model, "-t", table, "-o", tmp_path / "q.onnx", *args)
    assert_user_error(result, message)
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.parametrize("args, message", [
    (["--num-samples", "0"], "--num-samples must be at least 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--target-sqnr", "-5"], "--target-sqnr must be a finite number of dB above 0, got -5.0"),
])
def test_quantize_with_data_refusals(tmp_path, demo_model, demo_calib, table, args, message):
    result = invoke("quantize", demo_model, "-t", table, "-o", tmp_path / "q.onnx", "--data", demo_calib, *args)
    assert_user_error(result, message)
    assert "None" not in result.stderr


def test_analyze_top_below_zero(demo_model, demo_heldout, table):
    assert_user_error(invoke("analyze", demo_model, "--data", demo_heldout, "-t", table, "--top", "-1"),
                      "--top must be >= 0 (0: every op), got -1")


def test_labels_that_name_the_input(demo_model, demo_heldout, qmodel):
    # it said "has no labels array 'input' (arrays: input, label)"
    assert_user_error(invoke("verify", demo_model, qmodel, "-d", demo_heldout, "--labels", "input", "-q"),
                      "--labels 'input' names the model's input in data file", "not an array of labels")


def test_merge_names_a_missing_statistics_file(tmp_path):
    assert_user_error(invoke("merge", tmp_path / "a.npz", tmp_path / "b.npz", "-o", tmp_path / "t.yaml"),
                      f"statistics file '{tmp_path / 'a.npz'}' not found")


def test_a_precision_table_that_contradicts_itself(tmp_path, demo_model, table):
    (tmp_path / "p.txt").write_text("conv1 INT16\n# the same op again\nconv1 INT8\n")
    result = invoke("quantize", demo_model, "-t", table, "-o", tmp_path / "q.onnx", "--precision-table",
                    tmp_path / "p.txt")
    assert_user_error(result, "line 3: 'conv1' is INT8 here and INT16 on line 1: give one type")
    (tmp_path / "p.txt").write_text("conv1 INT16\nconv1 int16\n")  # said twice alike: fine
    result = invoke("quantize", demo_model, "-t", table, "-o", tmp_path / "q.onnx", "--precision-table",
                    tmp_path / "p.txt", "-q")
    assert result.exit_code == 0, result.output


def test_blocks_beside_per_tensor_weights_are_said(tmp_path, demo_model, table):
    result = invoke("quantize", demo_model, "-t", table, "-o", tmp_path / "q.onnx", "--block-size", "16",
                    "--per-tensor", "-q")
    assert result.exit_code == 0, result.output
    assert ("warning: --per-tensor applies to the other ops' weights: MatMul/Gemm weights keep a scale per "
            "block of 16 (--block-size)") in result.stderr


def test_a_foreign_table_on_standard_input_is_named_so(tmp_path, demo_model, demo_table):
    write_table(demo_table, tmp_path / "t_cali_table")
    text = "\n".join(line for line in (tmp_path / "t_cali_table").read_text().splitlines()
                     if "sha256" not in line) + "\n"
    from test_cli import runner
    from qtool.cli import app

    result = runner.invoke(app, ["quantize", str(demo_model), "-t", "-", "-o", str(tmp_path / "q.onnx"), "-q"],
                           input=text)
    assert result.exit_code == 0, result.output
    assert "warning: the table on standard input carries no model digest" in result.stderr


def test_a_name_folded_away_at_preparation_is_said_so(tmp_path, demo_model, table):
    """Sweep 9: 'bn1' (a BatchNormalization of the file, folded into conv1) was 'not a node' of
    the model; the message says where it went, and a name of no node says nothing more."""
    folded = "'bn1' is a node of the model file that preparation removed or folded into other ops"
    result = invoke("quantize", demo_model, "-t", table, "-o", tmp_path / "q.onnx", "--keep-float", "bn1")
    assert_user_error(result, "--keep-float: 'bn1' is neither an op type nor a node name", folded)
    (tmp_path / "p.txt").write_text("bn1 INT16\n")
    result = invoke("quantize", demo_model, "-t", table, "-o", tmp_path / "q.onnx", "--precision-table",
                    tmp_path / "p.txt")
    assert_user_error(result, "line 1: the model has no node or op type 'bn1'", folded)
    result = invoke("quantize", demo_model, "-t", table, "-o", tmp_path / "q.onnx", "--keep-float", "nope")
    assert_user_error(result, "--keep-float: 'nope' is neither")
    assert "folded" not in result.stderr


def test_table_out_to_a_tensorrt_cache_says_what_it_leaves_out(tmp_path, demo_model, demo_calib, table):
    """quantize --table-out x.cache wrote the cache without a word about the preprocessing it has no
    room for (convert-table, calibrate and merge said it)."""
    import yaml

    doc = yaml.safe_load(table.read_text())
    doc["preprocess"] = {"resize": None, "fit": "stretch", "pad": 114.0, "mean": [0.0], "std": [1.0],
                         "scale": 1 / 16, "channels": "gray", "layout": "nchw", "input": None}
    given = tmp_path / "t.yaml"
    given.write_text(yaml.safe_dump(doc, sort_keys=False))
    result = invoke("quantize", demo_model, "-t", given, "-o", tmp_path / "q.onnx", "--data", demo_calib,
                    "--table-out", tmp_path / "t.cache")
    assert result.exit_code == 0, result.output
    assert "warning: a TensorRT cache cannot hold the image preprocessing: they are left out" in result.stderr
    assert (tmp_path / "t.cache").read_text().startswith("TRT-")


def test_stored_bytes_follows_external_data(tmp_path):
    """The size kept for a model file is not kept where its weights live in another file, whose
    size can change under the same graph."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from qtool.model import stored_bytes

    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, location="w.bin",
              size_threshold=0)
    before = stored_bytes(path)
    assert before == path.stat().st_size + (tmp_path / "w.bin").stat().st_size
    with open(tmp_path / "w.bin", "ab") as f:
        f.write(b"\0" * 1000)
    assert stored_bytes(path) == before + 1000
