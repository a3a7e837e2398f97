"""A model whose input says N but that runs only one sample at a time (a Reshape to a fixed
leading 1): where qtool chooses the batch size it finds out on the first batch and starts again
at 1, saying so; where the user chose it, the error says to add --batch-size 1."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from test_cli import assert_user_error, invoke

NOTE = "batch size 1: the model failed on a batch of 8 samples and runs one sample at a time"
HINT = "if the model runs one sample at a time, add --batch-size 1"


@pytest.fixture
def one_at_a_time(tmp_path):
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("Reshape", ["r", "shape"], ["f"], name="reshape"),
         helper.make_node("MatMul", ["f", "w"], ["y"], name="matmul")], "b1",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [numpy_helper.from_array(np.array([1, 32], np.int64), "shape"),
         numpy_helper.from_array(rng.normal(size=(32, 10)).astype(np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(16, 4, 8)).astype(np.float32))
    return tmp_path


def test_every_command_takes_it(one_at_a_time):
    folder = one_at_a_time
    model, data, table = folder / "m.onnx", folder / "d.npz", folder / "t.yaml"
    calibrated = invoke("calibrate", model, "-d", data, "-o", table)
    assert calibrated.exit_code == 0, calibrated.output
    assert NOTE in calibrated.stderr
    for extra in ((), ("--data", data, "--batch-size", 1)):
        quantized = invoke("quantize", model, "-t", table, "-o", folder / "q.onnx", *extra)
        assert quantized.exit_code == 0, quantized.output
    verified = invoke("verify", model, folder / "q.onnx", "-d", data)
    assert verified.exit_code == 0, verified.output
    assert NOTE in verified.stderr and "verify: 16 samples" in verified.stdout
    executed = invoke("exec", folder / "q.onnx", "--input", data, "-o", folder / "y.npz")
    assert executed.exit_code == 0, executed.output
    assert NOTE in executed.stderr
    assert np.load(folder / "y.npz")["y"].shape == (16, 10)  # each sample's [1, 10] on the sample axis


def test_a_batch_size_the_user_chose_fails_with_the_way_out(one_at_a_time):
    folder = one_at_a_time
    model, data, table = folder / "m.onnx", folder / "d.npz", folder / "t.yaml"
    assert_user_error(invoke("calibrate", model, "-d", data, "-o", table, "--batch-size", 4),
                      "onnxruntime failed on the float model", "on a batch of 4 samples", HINT)
    assert not table.exists()
    assert invoke("calibrate", model, "-d", data, "-o", table, "-q").exit_code == 0
    assert invoke("quantize", model, "-t", table, "-o", folder / "q.onnx").exit_code == 0
    assert_user_error(invoke("quantize", model, "-t", table, "-o", folder / "qd.onnx", "--data", data),
                      "on a batch of 8 samples", HINT)
    assert_user_error(invoke("verify", model, folder / "q.onnx", "-d", data, "--batch-size", 4),
                      "Reshape node 'reshape' cannot take inputs of shapes [4, 4, 8]", HINT)
    assert_user_error(invoke("exec", folder / "q.onnx", "--input", data, "-o", folder / "y.npz", "--batch-size", 2),
                      "Reshape node 'reshape'", "on a batch of 2 samples", HINT)


def test_a_job_says_which_key_to_set(one_at_a_time):
    folder = one_at_a_time
    job = folder / "job.yaml"
    job.write_text(f"model: {folder / 'm.onnx'}\noutput_dir: {folder / 'out'}\ncalibrate: {{data: {folder / 'd.npz'}}}\n")
    failed = invoke("run", job, "-q")
    assert failed.exit_code == 2, failed.output
    assert "if the model runs one sample at a time, set calibrate.batch_size: 1" in failed.output
    job.write_text(job.read_text().replace("d.npz'}", "d.npz', batch_size: 1}").replace(
        f"{{data: {folder / 'd.npz'}}}", f"{{data: {folder / 'd.npz'}, batch_size: 1}}"))
    passed = invoke("run", job, "-q")
    assert passed.exit_code == 0, passed.output
