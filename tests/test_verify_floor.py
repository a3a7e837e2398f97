"""What verify judges by: the default tolerance's SQNR floor (cosine 0.99 alone passes a 17 dB
output), figures over the entries that are real values (a mask's -3.4e38 or an inf left out and
counted), and the first tensor where the loss starts."""

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.calibrate import calibrate
from qtool.quantize import quantize
from qtool.table import TensorEntry
from qtool.verify import Comparison, VerifyReport, format_report
from test_cli import assert_no_crash, invoke

LOWEST = float(np.finfo(np.float32).min)


def _scaled_model(tmp_path, widen: float):
    """y = 2x, int8, with x's range widened ``widen`` times past the data: coarse steps."""
    graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["y"], name="mul")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64])],
                              [numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), model)
    data = tmp_path / "d.npz"
    np.savez(data, x=np.random.default_rng(0).uniform(-1, 1, (32, 64)).astype(np.float32))
    table = calibrate(model, data, progress=False)
    table.tensors = {name: TensorEntry(e.min * widen, e.max * widen, e.threshold * widen, e.method)
                     for name, e in table.tensors.items()}
    qmodel, _ = quantize(model, table)
    onnx.save(qmodel, tmp_path / "q.onnx")
    return model, tmp_path / "q.onnx", data


def test_the_default_tolerance_fails_an_output_below_20_db_that_cosine_passes(tmp_path):
    model, qmodel, data = _scaled_model(tmp_path, widen=30.0)
    result = invoke("verify", model, qmodel, "-d", data, "--json", "-q")
    assert_no_crash(result)
    out = json.loads(result.stdout)["outputs"][0]
    assert out["cosine"] >= 0.99 and out["sqnr_db"] < 20  # the case cosine alone lets through
    assert result.exit_code == 1
    assert json.loads(result.stdout)["failures"] == [f"output 'y' SQNR {out['sqnr_db']:.2f} dB < 20.0 dB"]
    # a tolerance given as COS alone keeps its old meaning: cosine only
    assert invoke("verify", model, qmodel, "-d", data, "--tolerance", "0.99", "-q").exit_code == 0
    # and the floor passes a model above it
    model, qmodel, data = _scaled_model(tmp_path, widen=1.0)
    assert invoke("verify", model, qmodel, "-d", data, "-q").exit_code == 0


def test_figures_leave_out_entries_that_are_no_real_value(tmp_path):
    """An output holding float32's lowest where a mask hides it: the SQNR is that of the other
    entries, and the report says how many were left out."""
    mask = np.zeros(64, np.float32)
    mask[::4] = LOWEST
    inits = [numpy_helper.from_array(mask, "mask"), numpy_helper.from_array(np.float32(0.02), "s"),
             numpy_helper.from_array(np.uint8(0), "z")]

    def save(nodes, name):
        graph = helper.make_graph(nodes + [helper.make_node("Add", ["r", "mask"], ["y"], name="add")], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64])], inits)
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / name)
        return tmp_path / name

    model = save([helper.make_node("Relu", ["x"], ["r"], name="relu")], "m.onnx")
    # the same with an integer Relu (QDQ around it); the mask Add stays float in both
    qmodel = save([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q0"),
                   helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq0"),
                   helper.make_node("Relu", ["xd"], ["rf"], name="relu"),
                   helper.make_node("QuantizeLinear", ["rf", "s", "z"], ["rq"], name="q1"),
                   helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["r"], name="dq1")], "q.onnx")
    data = tmp_path / "d.npz"
    np.savez(data, x=np.random.default_rng(1).uniform(0, 5, size=(16, 64)).astype(np.float32))
    result = invoke("verify", model, qmodel, "-d", data, "--json", "-q")
    assert_no_crash(result)
    report = json.loads(result.stdout)
    assert report["outputs"][0]["excluded_entries"] == 16 * 16
    assert report["outputs"][0]["sqnr_db"] > 30  # the unmasked entries: 0.02-step rounding of [0, 5]
    text = invoke("verify", model, qmodel, "-d", data, "-q").stdout
    assert "left out of the figures" in text and "y 256" in text


def _comparison(name, sqnr_db, ran="integer"):
    return Comparison(name, "Add", ran, ref_sq=1.0, err_sq=10 ** (-sqnr_db / 10), dot=1.0, got_sq=1.0)


def test_the_loss_starts_at_the_first_sharp_drop_in_graph_order():
    tensors = [_comparison("x", 50, "input"), _comparison("a", 40), _comparison("b", 37),
               _comparison("c", 30), _comparison("d", 5), _comparison("e", 4)]
    report = VerifyReport(4, (0.99, 20.0), [_comparison("e", 4)], tensors, [])
    start, drop = report.loss_start()
    assert start.name == "c" and abs(drop - 7) < 1e-9  # 7 dB below b, the lowest before it
    assert "where the loss starts: c (Add) at 30.00 dB, 7.0 dB below every tensor before it" in format_report(report)
    assert report.to_dict()["loss_start"] == {"tensor": "c", "op_type": "Add", "sqnr_db": 30.0, "drop_db": 7.0}
    # d falls 25 dB below c: the larger drop, named too (the start alone pointed at a 7 dB step)
    largest, most = report.largest_drop()
    assert largest.name == "d" and abs(most - 25) < 1e-9
    assert "where it drops most: d (Add) at 5.00 dB, 25.0 dB below every tensor before it" in format_report(report)
    assert report.to_dict()["largest_drop"] == {"tensor": "d", "op_type": "Add", "sqnr_db": 5.0, "drop_db": 25.0}
    gentle = VerifyReport(4, (0.99, 20.0), [], [_comparison(n, 40 - 3 * i) for i, n in enumerate("abcdef")], [])
    assert gentle.loss_start() is None and gentle.to_dict()["loss_start"] is None
    assert gentle.largest_drop() is None and gentle.to_dict()["largest_drop"] is None
    assert "drops most" not in format_report(gentle)


def test_a_drop_that_leaves_a_high_level_is_no_loss():
    # sweep 10: MiniLM's position table (a Gather) at 64.6 dB, 0.55 LSB from float, 10 dB below
    # the token table, was "where the loss starts" of a model that passed at 31.7 dB
    tensors = [_comparison("ids", 300, "input"), _comparison("tokens", 75.0), _comparison("positions", 64.6),
               _comparison("ln", 58.0), _comparison("attention", 31.0)]
    report = VerifyReport(4, (0.99, 20.0), [], tensors, [])
    start, drop = report.loss_start()
    assert start.name == "attention" and abs(drop - 27.0) < 1e-9


def test_a_move_of_the_input_sets_no_level_to_drop_from():
    # sweep 6's NHWC siamese VGG: the Transpose of its input, at the input's 57.9 dB, made the first
    # Conv "where the loss starts" (17 dB below it); the real drop was the float |a - b| further on
    tensors = [_comparison("input", 57.9, "input"), Comparison("nchw", "Transpose", "integer", ref_sq=1.0,
                                                                 err_sq=10 ** -5.79, dot=1.0, got_sq=1.0),
               _comparison("conv1", 40.8), _comparison("conv2", 36.0), _comparison("abs", 21.1, "float"),
               _comparison("dense", 22.9)]
    report = VerifyReport(4, (0.99, 20.0), [], tensors, [])
    start, drop = report.loss_start()
    assert start.name == "abs" and abs(drop - 14.9) < 1e-9
    assert report.largest_drop()[0] is start


def test_a_float_op_that_drops_most_is_named_as_run_in_float():
    """A float Log of a quantized power spectrum (sweep 2's DNSMOS SBO) falls far more than the
    Conv where the loss starts; the report and the next steps name it, run in float."""
    tensors = [_comparison("x", 90, "input"), _comparison("conv", 52), _comparison("power", 45.9),
               _comparison("log", -6.5, "float"), _comparison("out", 4)]
    report = VerifyReport(4, (0.99, 20.0), [_comparison("out", 4)], tensors, [])
    report.failures.append("output 'out' SQNR 4.00 dB < 20.0 dB")
    assert report.loss_start()[0].name == "power"
    text = format_report(report)
    assert "where it drops most: log (Add, run in float) at -6.50 dB, 52.4 dB below every tensor before it" in text
    assert "the loss starts at power (Add) and drops most at log (Add, run in float)" in text
    single = VerifyReport(4, (0.99, 20.0), [], tensors[:3], [])
    assert single.largest_drop()[0] is single.loss_start()[0] and "drops most" not in format_report(single)


def test_verify_of_a_float_model_is_a_one_line_error(demo_model, demo_heldout):
    from test_cli import assert_user_error, invoke

    assert_user_error(invoke("verify", demo_model, demo_model, "--data", demo_heldout),
                      "digits_cnn.onnx' has no integer op", "nothing to verify: give the model qtool quantize wrote")


def test_a_fail_says_what_to_try_next(tmp_path, demo_model, demo_calib, demo_heldout, demo_table):
    from qtool.table_formats import write_table

    write_table(demo_table, tmp_path / "t.yaml")
    for extra, name in (((), "plain"), (("--data", demo_calib), "data")):
        assert invoke("quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / f"{name}.onnx",
                      *extra).exit_code == 0
    strict = ("--tolerance", "0.99999,60", "-q")
    plain = invoke("verify", demo_model, tmp_path / "plain.onnx", "-d", demo_heldout, *strict)
    assert plain.exit_code == 1
    steps = plain.stdout.split("next steps:\n")[1]
    assert "quantize with samples" in steps and "--activation-type int16" in steps and "qtool analyze" in steps
    data = invoke("verify", demo_model, tmp_path / "data.onnx", "-d", demo_heldout, *strict, "--json")
    assert data.exit_code == 1
    steps = json.loads(data.stdout)["next_steps"]
    assert not any("quantize with samples" in s for s in steps) and any("int16" in s for s in steps)
    passed = invoke("verify", demo_model, tmp_path / "data.onnx", "-d", demo_heldout, "-q")
    assert passed.exit_code == 0 and "next steps" not in passed.stdout


def test_an_output_of_probabilities_names_its_logits():
    from qtool.verify.core import _probabilities

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"], name="mm"),
         helper.make_node("Softmax", ["logits"], ["p"], name="sm"),
         helper.make_node("Sigmoid", ["logits"], ["s"], name="sg"),
         helper.make_node("Relu", ["logits"], ["r"], name="relu")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 4]) for n in ("p", "s", "r")],
        [numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")])
    assert _probabilities(helper.make_model(graph), ["p", "s", "r"]) == {"p": ("Softmax", "logits"),
                                                                          "s": ("Sigmoid", "logits")}
