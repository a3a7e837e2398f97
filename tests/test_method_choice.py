"""The whole-model calibration method: chosen on the fit samples of --data among the table's own,
percentile and mse, kept only where it also scores higher on the held-out samples.

Figures are recomputed here: candidate ranges by calibrating .npz files that hold exactly the fit
samples, SQNR with numpy over onnxruntime runs (graph optimizations off) on the held-out samples."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.analyze import split_batches
from qtool.calibrate import calibrate, collect, past_last_layer
from qtool.model import load_model, prepare
from qtool.quantize import QuantizeOptions, quantize
from qtool.search import choose_method
from qtool.table_formats import write_table
from test_cli import assert_user_error, invoke


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    """Conv -> Relu -> Conv on Student-t inputs: rare large values stretch minmax ranges."""
    folder = tmp_path_factory.mktemp("heavy")
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["h"], name="conv"),
         helper.make_node("Relu", ["h"], ["r"], name="relu"),
         helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 16, 16])],
        [numpy_helper.from_array(rng.normal(0, .5, (4, 4, 1, 1)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.normal(0, .5, (4, 4, 1, 1)).astype(np.float32), "w2")])
    model = folder / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), model)
    np.savez(folder / "d.npz", x=rng.standard_t(3, (64, 4, 16, 16)).astype(np.float32))
    return model, folder / "d.npz"


def _run(model, batches):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, feeds)[0] for feeds in batches])


def _sqnr(ref, got):
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    return 10 * math.log10((ref ** 2).sum() / ((ref - got) ** 2).sum())


def test_a_method_that_wins_on_held_out_samples_replaces_the_table(heavy, tmp_path):
    model, data = heavy
    table = calibrate(model, data, progress=False)
    chosen, pick = choose_method(model, table, QuantizeOptions(), "t", data, progress=False)
    method = pick.chosen
    assert pick.changed and method == chosen.method and method in ("percentile", "mse")
    # calibrated again on all of DATA; the model's output, past its last layer, at its whole range
    whole = calibrate(model, data, method, progress=False).tensors
    whole["y"] = table.tensors["y"]
    assert chosen.tensors == whole and whole["y"].method == "minmax" and pick.ends == 1
    float_model = prepare(load_model(model))
    fit, held = split_batches(float_model, data, 16, 16, 8)
    np.savez(tmp_path / "fit.npz", x=np.concatenate([b["x"] for b in fit]))
    options = QuantizeOptions(format="qdq")
    fit_table = calibrate(model, tmp_path / "fit.npz", method, progress=False)
    fit_table.tensors["y"] = calibrate(model, tmp_path / "fit.npz", progress=False).tensors["y"]
    fitted = quantize(model, fit_table, options)[0]
    ref = _run(float_model, held)
    assert pick.heldout == 16
    assert pick.heldout_chosen_db == pytest.approx(_sqnr(ref, _run(fitted, held)), abs=1e-3)
    assert pick.heldout_table_db == pytest.approx(_sqnr(ref, _run(quantize(model, table, options)[0], held)),
                                                  abs=1e-3)
    assert pick.heldout_chosen_db > pick.heldout_table_db
    fit_ref = _run(float_model, fit)
    assert pick.fit_db[method] == pytest.approx(_sqnr(fit_ref, _run(fitted, fit)), abs=1e-3)


def test_past_the_last_layer_are_the_tensors_no_layer_reads_later():
    # x -> Conv -> a -> Relu -> b -> Conv -> c -> Sigmoid -> d;  b -> Identity -> side
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Conv", ["b", "w"], ["c"]), helper.make_node("Sigmoid", ["c"], ["d"]),
             helper.make_node("Identity", ["b"], ["side"])]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "g", [value("x", TensorProto.FLOAT, [1, 2, 4, 4])],
                              [value("d", TensorProto.FLOAT, None), value("side", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.ones((2, 2, 1, 1), np.float32), "w")])
    assert past_last_layer(helper.make_model(graph)) == {"c", "d", "side"}


def test_a_clipping_method_keeps_a_detection_head_whole(tmp_path):
    # scores past the last layer whose few large values are the detections: percentile would
    # cut them to the background's level (YOLOv8n's class logits: at most -4.2 instead of 1.7)
    rng = np.random.default_rng(3)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["logits"]), helper.make_node("Sigmoid", ["logits"], ["scores"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 64, 64])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 1, 64, 64])],
        [numpy_helper.from_array(np.ones((1, 1, 1, 1), np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), tmp_path / "m.onnx")
    x = rng.normal(-8, 0.5, (8, 1, 64, 64)).astype(np.float32)
    x[5, 0, 3, 5] = 2.0  # one detection in 32768 values
    np.savez(tmp_path / "d.npz", x=x)
    stats = collect(tmp_path / "m.onnx", tmp_path / "d.npz", "percentile", progress=False)
    ends = past_last_layer(prepare(load_model(tmp_path / "m.onnx")))
    assert ends == {"logits", "scores"}
    assert stats.table().tensors["logits"].max < 0  # cut below every detection
    kept = stats.table_keeping_ends(ends).tensors
    assert (kept["logits"].min, kept["logits"].max) == (float(x.min()), 2.0)
    assert kept["scores"].max == pytest.approx(1 / (1 + np.exp(-2.0)))
    assert kept["x"] == stats.table().tensors["x"]  # the input reaches a layer: clipped as before


def test_methods_that_read_the_same_histograms_share_one_pass(heavy, monkeypatch):
    import qtool.calibrate as calibrate_module
    from qtool.calibrate import collect, collect_methods

    model, data = heavy
    alone = {m: collect(model, data, m, progress=False).table() for m in ("percentile", "mse", "minmax")}
    passes = []
    monkeypatch.setattr(calibrate_module, "collect", lambda *a, **k: passes.append(a[2]) or collect(*a, **k))
    shared = collect_methods(model, data, ["percentile", "mse", "minmax"], progress=False)
    assert passes == ["percentile", "minmax"]  # mse reads percentile's histograms
    for method, table in alone.items():
        assert shared[method].method == method
        assert shared[method].table().tensors == table.tensors, method
    assert alone["mse"].tensors != alone["percentile"].tensors  # the two read them differently


def test_a_method_that_loses_on_held_out_samples_leaves_the_table(demo_model, demo_table, demo_calib):
    # on the demo, mse scores best on the 16 fit samples and below minmax on the 16 held-out ones
    chosen, pick = choose_method(demo_model, demo_table, QuantizeOptions(), "t", demo_calib, progress=False)
    best = max(pick.fit_db, key=pick.fit_db.get)
    assert best != "minmax" and pick.heldout == 16
    assert not pick.changed and chosen is demo_table
    assert pick.heldout_chosen_db <= pick.heldout_table_db


def test_without_held_out_samples_nothing_is_chosen(heavy):
    model, data = heavy
    table = calibrate(model, data, progress=False)
    chosen, pick = choose_method(model, table, QuantizeOptions(), "t", data, holdout=0, progress=False)
    assert chosen is table and not pick.fit_db and not pick.changed


def test_quantize_with_data_chooses_and_reports(heavy, tmp_path):
    model, data = heavy
    write_table(calibrate(model, data, progress=False), tmp_path / "t.yaml")
    result = invoke("quantize", model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx", "--data", data,
                    "--table-out", tmp_path / "chosen.yaml", "--json")
    assert result.exit_code == 0, result.output
    pick = json.loads(result.stdout)["method_pick"]
    assert pick["chosen"] in ("percentile", "mse") and pick["changed"] and pick["ends_at_whole_range"] == 1
    assert f"method: {pick['chosen']}" in (tmp_path / "chosen.yaml").read_text()
    result = invoke("quantize", model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q2.onnx", "--data", data,
                    "--no-method-choice", "--json")
    assert result.exit_code == 0 and "method_pick" not in json.loads(result.stdout)


@pytest.mark.parametrize("args, message", [
    (["--method-choice"], "--method-choice needs samples to score on: add --data DATA"),
    (["--method-choice", "--data", "DATA", "--try-methods", "mse"],
     "--method-choice and --try-methods both choose the table's methods: give one"),
    (["--table-out", "t2.yaml"], "--table-out writes the table --try-methods or --method-choice chooses"),
])
def test_method_choice_errors(demo_model, demo_calib, tmp_path, args, message):
    write_table(calibrate(demo_model, demo_calib, progress=False), tmp_path / "t.yaml")
    args = [str(demo_calib) if a == "DATA" else a for a in args]
    result = invoke("quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx", *args)
    assert_user_error(result, message)
    assert not (tmp_path / "q.onnx").exists()


def test_int16_activations_keep_the_table(heavy, tmp_path, monkeypatch):
    # the clipping methods' cuts are made for 8-bit steps: nothing is calibrated or scored
    import qtool.search as search_module

    model, data = heavy
    table = calibrate(model, data, progress=False)
    monkeypatch.setattr(search_module, "collect_methods", lambda *a, **k: pytest.fail("calibrated"))
    chosen, pick = choose_method(model, table, QuantizeOptions(activation_type="int16"), "t", data, progress=False)
    assert chosen is table and not pick.changed and not pick.fit_db
    assert pick.reason.startswith("int16 activations")
    monkeypatch.undo()
    write_table(table, tmp_path / "t.yaml")
    result = invoke("quantize", model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx", "--data", data,
                    "--activation-type", "int16")
    assert result.exit_code == 0, result.output
    assert ("method:  minmax kept (int16 activations: percentile's and mse's cuts are made for 8-bit steps)"
            in result.output)


def test_the_steps_run_batches_that_fit_the_memory_budget(demo_model, demo_calib, tmp_path, monkeypatch):
    """quantize --data without --batch-size runs at most 8 samples at a time, fewer where a sample's
    activations are large, as calibrate chooses (speechmos's DNSMOS, 1.4 GB a sample: 8 at a time
    peaked at 8 GB in the method choice); --batch-size is taken as given."""
    import qtool.recipe
    import qtool.sizing

    seen = []
    real = qtool.recipe.choose_method

    def spy(*args, **kwargs):
        seen.append(kwargs["batch_size"])
        return real(*args, **kwargs)

    monkeypatch.setattr(qtool.recipe, "choose_method", spy)
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", demo_model, "-d", demo_calib, "-o", table, "-q").exit_code == 0
    args = ("quantize", demo_model, "-t", table, "-o", tmp_path / "q.onnx", "--data", demo_calib, "--num-samples", 8,
            "--no-bias-correction", "--no-weight-rounding", "--no-channel-scales", "-q")
    assert invoke(*args).exit_code == 0 and seen == [8]  # the demo's samples are small
    # a working set of 30 MB a sample (calibrate's estimate: 4.5 times it, 135 MB): 2 beside the process
    monkeypatch.setattr(qtool.sizing, "live_peak_bytes", lambda *a, **k: 30 << 20)
    assert invoke(*args).exit_code == 0 and seen == [8, 2]
    assert invoke(*args, "--batch-size", 5).exit_code == 0 and seen == [8, 2, 5]
