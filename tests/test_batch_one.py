"""A model whose input says N but that runs only one sample at a time (a Reshape to a fixed
leading 1): where qtool chooses the batch size it finds out on the first batch and starts again
at 1, saying so; where the user chose it, the error says to add --batch-size 1."""

import numpy as np
import onnxruntime as ort
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


@pytest.fixture
def frames_and_states(tmp_path):
    """madmom's recurrent beat trackers: frames [T, F] (the frames are the samples) beside states
    of fixed sizes [25] fed whole, whose outputs [25] have no axis of the frames."""
    rng = np.random.default_rng(1)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
         helper.make_node("Relu", ["m"], ["y"], name="relu"),
         helper.make_node("Mul", ["state", "half"], ["state_out"], name="decay")], "frames",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 6]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, [5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", 3]),
         helper.make_tensor_value_info("state_out", TensorProto.FLOAT, [5])],
        [numpy_helper.from_array(rng.normal(size=(6, 3)).astype(np.float32), "w"),
         numpy_helper.from_array(np.float32(0.5), "half")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(16, 6)).astype(np.float32),
             state=rng.normal(size=5).astype(np.float32))
    return tmp_path


def test_fixed_states_beside_open_frames_set_no_batch_size(frames_and_states):
    """The states' 5 is no batch: quantize --data ran (it said 'the model takes batches of 5
    samples'), calibrate says nothing of them, and exec, whose outputs [5] cannot be split by
    sample, runs the frames one at a time and says so (where the user asked for batches of 4:
    the error with the way out)."""
    from qtool.sizing import fixed_batch

    folder = frames_and_states
    model, data, table = folder / "m.onnx", folder / "d.npz", folder / "t.yaml"
    assert fixed_batch(onnx.load(model)) is None
    calibrated = invoke("calibrate", model, "-d", data, "-o", table)
    assert calibrated.exit_code == 0, calibrated.output
    assert "input 'state'" not in calibrated.stderr
    quantized = invoke("quantize", model, "-t", table, "-o", folder / "q.onnx", "--data", data, "--holdout", "0")
    assert quantized.exit_code == 0, quantized.output
    executed = invoke("exec", folder / "q.onnx", "--input", data, "-o", folder / "y.npz")
    assert executed.exit_code == 0, executed.output
    assert "batch size 1: output 'state_out' has shape [5], no axis of the batch's 8 samples" in executed.stderr
    out = np.load(folder / "y.npz")
    assert out["y"].shape == (16, 3) and out["state_out"].shape == (16, 5)
    assert_user_error(invoke("exec", folder / "q.onnx", "--input", data, "-o", folder / "z.npz", "--batch-size", 4),
                      "output 'state_out' has shape [5] for a batch of 4 samples", "with --batch-size 1")
    assert not (folder / "z.npz").exists()


def test_frames_too_few_for_a_conv_are_a_one_line_error_and_no_reason_to_refuse_a_model(tmp_path):
    """A Conv over frames [T, 4] made [1, 1, T, 4] (madmom's TCN): with int16 activations and no
    --data, quantize's executor check draws one frame, too few for the 3x3 kernel in onnxruntime's
    float model too, so the check has nothing to say and the model is written (it stopped with an
    internal error, negative dimensions); the executor given too few frames says which node."""
    rng = np.random.default_rng(2)
    graph = helper.make_graph(
        [helper.make_node("Unsqueeze", ["x", "axes"], ["x4"], name="add_axes"),
         helper.make_node("Conv", ["x4", "w"], ["y"], name="conv")], "tcn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, "T2", 2])],
        [numpy_helper.from_array(np.array([0, 1], np.int64), "axes"),
         numpy_helper.from_array(rng.normal(size=(2, 1, 3, 3)).astype(np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(16, 4)).astype(np.float32))
    np.savez(tmp_path / "one.npz", x=rng.normal(size=(1, 4)).astype(np.float32))
    model, table = tmp_path / "m.onnx", tmp_path / "t.yaml"
    assert invoke("calibrate", model, "-d", tmp_path / "d.npz", "-o", table, "-q").exit_code == 0
    quantized = invoke("quantize", model, "-t", table, "-o", tmp_path / "q.onnx", "--activation-type", "int16", "-q")
    assert quantized.exit_code == 0, quantized.output
    from qtool.executor import IntegerExecutor
    import onnxruntime as ort

    frames = np.load(tmp_path / "d.npz")["x"][:8]  # within the calibrated ranges
    got = IntegerExecutor(onnx.load(tmp_path / "q.onnx")).run({"x": frames}).outputs["y"]
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": frames})[0]
    assert got.shape == want.shape == (1, 2, 6, 2)
    np.testing.assert_allclose(got, want, atol=0.01 * np.abs(want).max())  # 8-bit weights
    assert_user_error(invoke("exec", tmp_path / "q.onnx", "--input", tmp_path / "one.npz", "-o", tmp_path / "z.npz"),
                      "Conv node 'conv' cannot take inputs of shapes [1, 1, 1, 4]",
                      "Conv input [1, 1, 1, 4] is smaller than its 3x3 kernel")
    # quantize --data scores each sample (here: frame) alone: it says so, not "add --batch-size 1"
    assert_user_error(invoke("quantize", model, "-t", table, "-o", tmp_path / "qd.onnx", "--data", tmp_path / "d.npz"),
                      "onnxruntime failed on a variant of the model", "Conv node",
                      "(on one sample: these steps run each sample alone", "quantize it without --data)")
    assert not (tmp_path / "qd.onnx").exists()


def test_whole_inputs_stacked_on_a_new_first_axis_run_one_at_a_time(tmp_path):
    """A model without a batch axis (frames [T, 4] through a Conv over time, madmom's TCN) takes
    data of one more axis: [N, T, 4] is N whole inputs, each run alone as it is, by every command
    (quantize --data's scoring too, which failed on single frames), and exec writes one output a
    sample. An input beside them shaped exactly as the model's is fed whole to each; one of
    another shape is a one-line error."""
    rng = np.random.default_rng(5)
    graph = helper.make_graph(
        [helper.make_node("Unsqueeze", ["x", "axes"], ["x4"], name="add_axes"),
         helper.make_node("Conv", ["x4", "w"], ["c"], name="conv"),
         helper.make_node("Mul", ["c", "gain"], ["y"], name="gain_mul")], "tcn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 4]),
         helper.make_tensor_value_info("gain", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, "T2", 2])],
        [numpy_helper.from_array(np.array([0, 1], np.int64), "axes"),
         numpy_helper.from_array(rng.normal(size=(2, 1, 3, 3)).astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.save(model, tmp_path / "m.onnx")
    gain = np.array([0.5, 2.0], np.float32)
    frames = rng.normal(size=(12, 10, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=frames, gain=gain)
    np.savez(tmp_path / "e.npz", x=frames[:3, :7], gain=gain)  # shorter, within the calibrated ranges
    folder = tmp_path
    m, table = folder / "m.onnx", folder / "t.yaml"
    calibrated = invoke("calibrate", m, "-d", folder / "d.npz", "-o", table)
    assert calibrated.exit_code == 0, calibrated.output
    assert "on 12 samples" in calibrated.stderr, calibrated.stderr
    for extra in ((), ("--data", folder / "d.npz", "--holdout", "4", "--num-samples", "8")):
        quantized = invoke("quantize", m, "-t", table, "-o", folder / "q.onnx", *extra, "-q")
        assert quantized.exit_code == 0, quantized.output
    verified = invoke("verify", m, folder / "q.onnx", "-d", folder / "e.npz")
    assert verified.exit_code == 0, verified.output
    assert "verify: 3 samples" in verified.stdout
    executed = invoke("exec", folder / "q.onnx", "--input", folder / "e.npz", "-o", folder / "y.npz", "-q")
    assert executed.exit_code == 0, executed.output
    want = ort.InferenceSession(str(m), providers=["CPUExecutionProvider"])
    x = np.load(folder / "e.npz")["x"]
    got = np.load(folder / "y.npz")["y"]
    assert got.shape == (3, 1, 2, 5, 2)
    for i in range(3):
        ref = want.run(None, {"x": x[i], "gain": gain})[0]
        np.testing.assert_allclose(got[i], ref, atol=0.03 * np.abs(ref).max())
    # a folder: one whole input a file, of any length; exec writes each sample's output apart
    (folder / "seq").mkdir()
    for i, length in enumerate((10, 8, 12)):
        np.savez(folder / "seq" / f"{i}.npz", x=frames[i, :length] if length <= 10 else frames[i:i + 2].reshape(20, 4)[:12],
                 gain=gain)
    assert invoke("calibrate", m, "-d", folder / "seq", "-o", folder / "t2.yaml", "-q").exit_code == 0
    executed = invoke("exec", folder / "q.onnx", "--input", folder / "seq", "-o", folder / "s.npz", "-q")
    assert executed.exit_code == 0, executed.output
    written = np.load(folder / "s.npz")
    for i, length in enumerate((10, 8, 12)):
        x_i = np.load(folder / "seq" / f"{i}.npz")["x"]
        ref = want.run(None, {"x": x_i, "gain": gain})[0]
        assert written[f"y/{i}"].shape == ref.shape == (1, 2, length - 2, 2)
        np.testing.assert_allclose(written[f"y/{i}"], ref, atol=0.03 * np.abs(ref).max())
    np.savez(folder / "bad.npz", x=x, gain=np.stack([gain] * 3))
    assert_user_error(invoke("exec", folder / "q.onnx", "--input", folder / "bad.npz", "-o", folder / "z.npz"),
                      "the array for input 'x' holds whole inputs", "the array for 'gain' must be one whole input "
                      "too (model input [2]), not [3, 2]")


def test_a_float_op_that_takes_one_sample_is_found_on_the_first_batch(tmp_path):
    """A GRU kept float with a fixed initial state [1, 1, H] (speechmos's AECMOS at int16, where its
    GRUs stay float): onnxruntime refuses a batch of 8 there. That is a one-line error naming the
    node (it was an internal error, exit 3), so exec starts again one sample at a time where it
    chose the batch size, and names the way out where the user did."""
    from test_recurrent import H, I, T, rnn_model

    model = rnn_model("GRU")
    rng = np.random.default_rng(6)
    model.graph.initializer.append(numpy_helper.from_array(rng.normal(0, 0.3, (1, 1, H)).astype(np.float32), "h0"))
    model.graph.node[0].input.extend(["h0"])  # x, W, R, B, sequence_lens "", initial_h
    model.graph.node[0].input[0] = "x_tni"  # the samples first: x [N, T, I] transposed to the GRU's [T, N, I]
    model.graph.node.insert(0, helper.make_node("Transpose", ["x"], ["x_tni"], perm=[1, 0, 2], name="to_tni"))
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", T, I]))
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(8, T, I)).astype(np.float32))
    m, table = tmp_path / "m.onnx", tmp_path / "t.yaml"
    assert invoke("calibrate", m, "-d", tmp_path / "d.npz", "-o", table, "--batch-size", 1, "-q").exit_code == 0
    assert invoke("quantize", m, "-t", table, "-o", tmp_path / "q.onnx", "--keep-float", "GRU", "-q").exit_code == 0
    executed = invoke("exec", tmp_path / "q.onnx", "--input", tmp_path / "d.npz", "-o", tmp_path / "y.npz")
    assert executed.exit_code == 0, executed.output
    assert "batch size 1: the model failed on a batch of 8 samples" in executed.stderr
    assert "onnxruntime failed on GRU node 'rnn', which runs in float" in executed.stderr
    assert np.load(tmp_path / "y.npz")["y"].shape[0] == 8
    assert_user_error(invoke("exec", tmp_path / "q.onnx", "--input", tmp_path / "d.npz", "-o", tmp_path / "z.npz",
                             "--batch-size", 4),
                      "onnxruntime failed on GRU node 'rnn', which runs in float", HINT)


def test_an_input_fixed_at_1_beside_an_open_one_is_still_a_batch_of_1(tmp_path):
    """x [N, 4] beside m [1, 4] (one input exported without its dynamic axis): the model takes one
    sample a run, and quantize --data runs its steps so (fixed_batch said None for a moment, and
    the steps ran 8 at a time into onnxruntime's refusal). A state [5] beside 5 frames is still fed
    whole (the counts agree by chance)."""
    from qtool.sizing import fixed_batch

    rng = np.random.default_rng(8)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "m"], ["s"], name="add"),
         helper.make_node("MatMul", ["s", "w"], ["y"], name="matmul")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("m", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(rng.normal(size=(4, 3)).astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert fixed_batch(model) == 1
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(24, 4)).astype(np.float32),
             m=rng.normal(size=(24, 4)).astype(np.float32))
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", tmp_path / "m.onnx", "-d", tmp_path / "d.npz", "-o", table, "-q").exit_code == 0
    quantized = invoke("quantize", tmp_path / "m.onnx", "-t", table, "-o", tmp_path / "q.onnx",
                       "--data", tmp_path / "d.npz", "-q")
    assert quantized.exit_code == 0, quantized.output


def test_a_state_whose_size_equals_the_frame_count_is_fed_whole(frames_and_states):
    folder = frames_and_states
    rng = np.random.default_rng(9)
    np.savez(folder / "five.npz", x=rng.normal(size=(5, 6)).astype(np.float32),
             state=rng.normal(size=5).astype(np.float32))
    calibrated = invoke("calibrate", folder / "m.onnx", "-d", folder / "five.npz", "-o", folder / "t.yaml", "-q")
    assert calibrated.exit_code == 0, calibrated.output


def test_a_whole_input_file_of_a_wrong_fixed_size_is_a_one_line_error(tmp_path):
    rng = np.random.default_rng(10)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", 8])],
                              [numpy_helper.from_array(rng.normal(size=(4, 8)).astype(np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    (tmp_path / "seq").mkdir()
    np.save(tmp_path / "seq" / "0.npy", rng.normal(size=(10, 4)).astype(np.float32))
    np.save(tmp_path / "seq" / "1.npy", rng.normal(size=(7, 5)).astype(np.float32))
    assert_user_error(invoke("calibrate", tmp_path / "m.onnx", "-d", tmp_path / "seq", "-o", tmp_path / "t.yaml",
                             "-q"), "1.npy' array for input 'x' has shape [7, 5]; model expects [T,4]")
    assert not (tmp_path / "t.yaml").exists()
