"""quantize --target-sqnr / --max-float-layers: the fewest ops float that reach a target SQNR."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import onnx
from onnx import helper

from qtool.analyze import Batches, Evaluator, QdqModel, evaluation_batches, scored_node
from qtool.model import load_model, prepare
from qtool.quantize import QuantizeOptions, quantize
from qtool.report import search_summary
from qtool.search import choose_methods, realizable, search
from qtool.table_formats import write_table
from test_cli import assert_user_error, invoke


@pytest.fixture
def table_file(demo_table, tmp_path):
    path = tmp_path / "t.yaml"
    write_table(demo_table, path)
    return path


def _searched(calib) -> list[dict]:
    """The samples the searches score on: 16 of the 256, every 16th, in batches of 8 (run sample
    by sample: the demo's batch dim is free)."""
    x = np.load(calib)["input"][::16]
    return Batches([{"input": x[:8]}, {"input": x[8:]}], 16, axes={"input": 0})


def _judged(calib) -> list[dict]:
    """The held-out samples that judge a search: the odd positions of 32 spread over the 256."""
    held = np.load(calib)["input"][8::16]
    return Batches([{"input": held[:8]}, {"input": held[8:]}], 16, axes={"input": 0})


def test_searches_score_samples_spread_over_the_data(demo_model, demo_calib):
    float_model = prepare(load_model(demo_model))
    batches = evaluation_batches(float_model, demo_calib, 16, 8, spread=True)
    for got, want in zip(batches, _searched(demo_calib)):
        assert np.array_equal(got["input"], want["input"])
    first = evaluation_batches(float_model, demo_calib, 16, 8)
    assert np.array_equal(first[1]["input"], np.load(demo_calib)["input"][8:16])
    everything = evaluation_batches(float_model, demo_calib, 999, 100, spread=True)
    assert sum(len(b["input"]) for b in everything) == 256


def _float_nodes(report) -> set[str]:
    return {n for _, n, _ in report.kept_float}


def test_target_is_reached_with_the_ops_it_reports(demo_model, demo_table, demo_calib):
    qmodel, report, result = search(demo_model, demo_table, QuantizeOptions(), "t", demo_calib, allow_float=True,
                                    target_db=40.0, progress=False)
    assert result.integer_db < 40.0 <= result.final_db and result.reached
    assert 0 < len(result.kept_float) < result.candidates
    assert _float_nodes(report) == {n for _, n in result.kept_float}
    assert all(r == "kept float by the search" for _, _, r in report.kept_float)
    # the reported SQNR is the returned model's, scored independently on the same samples
    float_model = prepare(load_model(demo_model))
    evaluator = Evaluator(float_model, _searched(demo_calib))
    assert evaluator.sqnr(qmodel) == pytest.approx(result.final_db, abs=1e-3)
    # all-integer, one per op, the bound then a binary search over 13 candidates, the final model,
    # then the all-integer and the final model on the held-out samples
    assert report.search["evaluations"] == result.evaluations <= 1 + 13 + (1 + 4) + 1 + 2
    # judged on 16 other samples (the odd positions of 32 spread over the 256), scored here
    judge = Evaluator(float_model, _judged(demo_calib))
    integer, _ = quantize(demo_model, demo_table, QuantizeOptions(), "t")
    assert result.heldout == 16 and not result.reverted
    assert judge.sqnr(qmodel) == pytest.approx(result.heldout_final_db, abs=1e-3)
    assert result.heldout_final_db > result.heldout_integer_db


def test_a_target_every_op_at_once_misses_is_not_ranked_for(demo_model, demo_table, demo_calib):
    # int16 everywhere scores first; 200 dB is beyond it, so every op is given int16 unranked
    qmodel, report, result = search(demo_model, demo_table, QuantizeOptions(), "t", demo_calib, target_db=200.0,
                                    progress=False, bias_correction=False)
    float_model = prepare(load_model(demo_model))
    integer, _ = quantize(demo_model, demo_table, QuantizeOptions(), "t")
    everything = QdqModel(integer, float_model)
    widened_db = Evaluator(float_model, _searched(demo_calib)).sqnr(everything.widened(everything.all_tensors()))
    assert result.whole_db == pytest.approx(widened_db, abs=1e-9) and result.whole_db < 200.0
    assert {n for _, n in result.int16} == {op.node for op in everything.ops} and not result.reached
    # all int8, every op at once, the final model, the held-out pair: no run per op
    assert result.evaluations == 1 + 1 + 1 + 2
    assert set(result.phases) == {"quantize", "score", "judge"} and all(v >= 0 for v in result.phases.values())
    line = search_summary(report.search)
    assert f"every op int16 at once: {round(result.whole_db, 3)} dB, below the target: no ranking" in line
    # phases under 0.05 s are left out of the line (the demo's can be); the rest are named with their time
    # (as the report rounds them: a phase of 0.0496 s is 0.05 there, and shown)
    reported = report.search["phases"]
    shown = {k: v for k, v in reported.items() if v >= 0.05}
    assert all(f"{k} {v:.1f} s" in line for k, v in shown.items())
    assert all(f"{k} " not in line.split(" runs in ")[1] for k in set(reported) - set(shown))
    timed = search_summary({**report.search, "phases": {"quantize": 1.25, "score": 0.01, "judge": 3.0}})
    assert timed.endswith("runs in {:.1f} s (quantize 1.2 s, judge 3.0 s)".format(report.search["seconds"]))


def test_a_target_every_op_reaches_is_narrowed_without_scoring_them_all_again(demo_model, demo_table, demo_calib):
    _, _, result = search(demo_model, demo_table, QuantizeOptions(), "t", demo_calib, target_db=40.0,
                          progress=False)
    assert result.whole_db >= 40.0 and result.reached and 0 < len(result.int16) < result.candidates
    assert "rank" in result.phases and "narrow" in result.phases
    # all int8, every op at once, one per op, the binary search (without the bound again), final, held-out
    assert result.evaluations <= 1 + 1 + 13 + 4 + 1 + 2


def test_a_target_already_met_keeps_everything_integer(demo_model, demo_table, demo_calib):
    _, report, result = search(demo_model, demo_table, QuantizeOptions(), "t", demo_calib, allow_float=True,
                               target_db=10.0, progress=False)
    assert result.kept_float == [] and result.evaluations == 2 and not report.kept_float


def test_max_float_layers_caps_the_search_and_says_when_the_target_is_missed(demo_model, demo_table,
                                                                              demo_calib):
    _, report, result = search(demo_model, demo_table, QuantizeOptions(), "t", demo_calib, allow_float=True,
                               target_db=200.0, max_float=2, progress=False)
    assert len(result.kept_float) == 2 and not result.reached
    assert report.search["reached"] is False
    _, _, zero = search(demo_model, demo_table, QuantizeOptions(), "t", demo_calib, allow_float=True, max_float=0,
                        progress=False)
    assert zero.kept_float == []


def test_the_costliest_ops_come_first(demo_model, demo_table, demo_calib):
    _, _, result = search(demo_model, demo_table, QuantizeOptions(), "t", demo_calib, allow_float=True, target_db=200.0,
                          max_float=3, bias_correction=False, progress=False)
    float_model = prepare(load_model(demo_model))
    qmodel, _ = quantize(demo_model, demo_table)
    qdq = QdqModel(qmodel, float_model)
    evaluator = Evaluator(float_model, _searched(demo_calib))
    alone = {}
    for op in qdq.ops:
        alone[op.node] = evaluator.sqnr(qdq.ablated(qdq.all_tensors() - set(op.activations),
                                                    qdq.all_weights() - set(op.weights)))
    chosen = [n for _, n in result.kept_float]
    assert max(alone[n] for n in chosen) <= min(v for n, v in alone.items() if n not in chosen)


def test_realizable_matches_quantize_with_keep_float(demo_model, demo_table, demo_calib):
    """The surgery the search scores is the model quantize writes with those ops float."""
    float_model = prepare(load_model(demo_model))
    qmodel, _ = quantize(demo_model, demo_table)
    qdq = QdqModel(qmodel, float_model)
    evaluator = Evaluator(float_model, [{"input": np.load(demo_calib)["input"][:16]}])
    keep = {"block_conv1", "block_relu1", "block_conv2"}
    kept, _ = quantize(demo_model, demo_table, QuantizeOptions(keep_float=tuple(keep)))
    assert evaluator.sqnr(realizable(qdq, keep)) == pytest.approx(evaluator.sqnr(kept), abs=1e-6)


def test_search_is_deterministic(demo_model, table_file, demo_calib, tmp_path):
    outs = []
    for k in range(2):
        out = tmp_path / f"q{k}.onnx"
        result = invoke("quantize", demo_model, "-t", table_file, "-o", out, "--data", demo_calib,
                        "--target-sqnr", "40", "--allow-float", "--json", "-q")
        assert result.exit_code == 0, result.output
        outs.append(out.read_bytes())
        report = json.loads(result.stdout)
        assert report["search"]["reached"] and report["search"]["kept_float"]
    assert outs[0] == outs[1]


def test_cli_summary_line(demo_model, table_file, demo_calib, tmp_path):
    result = invoke("quantize", demo_model, "-t", table_file, "-o", tmp_path / "q.onnx", "--data",
                    demo_calib, "--max-float-layers", "1", "--target-sqnr", "100", "--allow-float", "-q")
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stdout.splitlines() if x.startswith("search:"))
    assert "1 ops kept float" in line and "target 100 dB NOT reached on 16 samples" in line
    assert re.search(r"held-out [\d.]+ -> [\d.]+ dB on 16 others; \d+ runs in", line), line


def test_a_budget_alone_never_scores_below_the_integer_model(demo_model, demo_table, demo_calib):
    for budget in (1, 4, 13):
        _, report, result = search(demo_model, demo_table, QuantizeOptions(), "t", demo_calib, allow_float=True,
                                   max_float=budget, progress=False)
        assert len(result.kept_float) <= budget and result.final_db >= result.integer_db
        assert len(report.kept_float) == len(result.kept_float)


@pytest.mark.parametrize("option,value,message", [
    ("--target-sqnr", "30", "--target-sqnr needs samples to score on: add --data DATA"),
    ("--max-float-layers", "3", "--max-float-layers needs samples to score on: add --data DATA"),
])
def test_search_needs_data(demo_model, table_file, tmp_path, option, value, message):
    result = invoke("quantize", demo_model, "-t", table_file, "-o", tmp_path / "q.onnx", option, value)
    assert_user_error(result, message)
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.parametrize("option,value,message", [
    ("--max-float-layers", "-1", "--max-float-layers must be >= 0, got -1"),
    ("--target-sqnr", "nan", "--target-sqnr must be a finite number of dB"),
])
def test_bad_search_settings(demo_model, table_file, demo_calib, tmp_path, option, value, message):
    result = invoke("quantize", demo_model, "-t", table_file, "-o", tmp_path / "q.onnx", "--data",
                    demo_calib, option, value)
    assert_user_error(result, message)


def test_chosen_methods_give_the_model_that_was_scored(demo_model, demo_table, demo_calib):
    mixed, choice = choose_methods(demo_model, demo_table, ["percentile", "mse", "kl"], QuantizeOptions(),
                                   "t", demo_calib, progress=False, holdout=0)  # kept unjudged
    assert choice.after_db > choice.before_db and choice.chosen and choice.heldout == 0
    float_model = prepare(load_model(demo_model))
    evaluator = Evaluator(float_model, _searched(demo_calib))
    # the in-place patches (fences and the biases they scale) are exactly what quantize writes
    assert evaluator.sqnr(quantize(demo_model, mixed)[0]) == choice.after_db
    assert evaluator.sqnr(quantize(demo_model, demo_table)[0]) == choice.before_db
    for name, entry in mixed.tensors.items():
        assert entry.method == choice.chosen.get(name, "minmax")
    assert sum(choice.to_dict()["changed_tensors"].values()) == len(choice.chosen)


def test_scoring_reads_the_logits_under_a_softmax(demo_model, tmp_path):
    model = onnx.load(demo_model)
    logits = model.graph.output[0].name
    model.graph.node.append(helper.make_node("Softmax", [logits], ["prob"], name="softmax", axis=-1))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("prob", onnx.TensorProto.FLOAT, None))
    assert scored_node(model).name == "softmax"
    x = np.random.default_rng(0).random((4, 1, 8, 8)).astype(np.float32)
    evaluator = Evaluator(model, [{"input": x}])
    assert "(input of Softmax 'softmax')" in evaluator.scored
    logits = evaluator.reference[0][0]  # batch 0, scored tensor 0
    assert logits.shape == (4, 10) and not np.allclose(logits.sum(1), 1)


def test_a_method_choice_that_loses_on_held_out_samples_gives_the_table_back(demo_model, demo_table,
                                                                             demo_calib):
    # on the demo the choice raises the SQNR on the 16 samples it was made on and lowers it on
    # the 16 others (the README's PP-OCR finding in small)
    table, choice = choose_methods(demo_model, demo_table, ["percentile", "mse", "kl"], QuantizeOptions(),
                                   "t", demo_calib, progress=False)
    assert choice.after_db > choice.before_db and choice.chosen
    assert choice.heldout == 16 and not choice.kept and table is demo_table
    judge = Evaluator(prepare(load_model(demo_model)), _judged(demo_calib))
    assert judge.sqnr(quantize(demo_model, demo_table)[0]) == pytest.approx(choice.heldout_before_db, abs=1e-9)
    assert choice.heldout_after_db <= choice.heldout_before_db


def test_table_out_requantizes_to_the_same_model(demo_model, table_file, demo_calib, tmp_path):
    chosen = tmp_path / "chosen.yaml"
    first = invoke("quantize", demo_model, "-t", table_file, "-o", tmp_path / "a.onnx", "--data", demo_calib,
                   "--try-methods", "mse,kl", "--table-out", chosen, "--no-bias-correction")
    assert first.exit_code == 0, first.output
    assert "methods: tensors moved off minmax: " in first.stdout
    again = invoke("quantize", demo_model, "-t", chosen, "-o", tmp_path / "b.onnx")
    assert again.exit_code == 0, again.output
    a, b = onnx.load(tmp_path / "a.onnx"), onnx.load(tmp_path / "b.onnx")
    # the same model; only the first records that quantize --data made it (its judged steps)
    steps = [p for p in a.metadata_props if p.key == "qtool.data_steps"]
    assert len(steps) == 1 and steps[0].value.startswith("method")
    a.metadata_props.remove(steps[0])
    assert a.SerializeToString() == b.SerializeToString()


@pytest.mark.parametrize("args,message", [
    (["--try-methods", "mse"], "--try-methods needs samples to score on: add --data DATA"),
    (["--data", "{calib}", "--try-methods", "kll"], "unknown calibration method 'kll'; choose one of"),
    (["--data", "{calib}", "--try-methods", ","], "--try-methods: no method named"),
    (["--data", "{calib}", "--no-method-choice", "--table-out", "t2.yaml"],
     "--table-out writes the table --try-methods or --method-choice chooses"),
    (["--data", "{calib}", "--try-methods", "mse", "--table-out", "-"], "--table-out needs a file name"),
], ids=["no-data", "unknown", "empty", "table-out-alone", "table-out-stdout"])
def test_bad_method_choice_settings(demo_model, table_file, demo_calib, tmp_path, args, message):
    args = [a.replace("{calib}", str(demo_calib)) for a in args]
    result = invoke("quantize", demo_model, "-t", table_file, "-o", tmp_path / "q.onnx", *args)
    assert_user_error(result, message)
    assert not (tmp_path / "q.onnx").exists()


def test_verify_lists_the_float_ops_quantize_listed(demo_model, table_file, demo_calib, demo_heldout, tmp_path):
    # one list: the search's reason travels in the model, and verify shows it
    q = tmp_path / "q.onnx"
    result = invoke("quantize", demo_model, "-t", table_file, "-o", q, "--data", demo_calib,
                    "--max-float-layers", "1", "--allow-float", "--json", "-q")
    assert result.exit_code == 0, result.output
    listed = [(k["op_type"], k["node"], k["reason"]) for k in json.loads(result.stdout)["kept_float"]]
    assert any(r == "kept float by the search" for _, _, r in listed)
    shown = invoke("verify", demo_model, q, "-d", demo_heldout, "--json", "-q", "--num-samples", "32")
    assert shown.exit_code in (0, 1), shown.output
    assert [(f["op_type"], f["node"], f["reason"]) for f in json.loads(shown.stdout)["float_nodes"]] == listed


def test_a_large_model_is_ranked_in_groups_first(demo_model, demo_table, demo_calib, monkeypatch):
    import qtool.search as search_module

    float_model = prepare(load_model(demo_model))
    qmodel, _ = quantize(demo_model, demo_table, QuantizeOptions(), "t")
    qdq = QdqModel(qmodel, float_model)
    evaluator = Evaluator(float_model, _searched(demo_calib))
    every, runs = search_module._rank(qdq, evaluator, False)
    assert runs == 13 and sorted(op.node for op in every) == sorted(op.node for op in qdq.ops)
    # as if the demo's 13 ops were many: 4 groups of 4, 4, 4 and 1, the costliest first
    import qtool.analyze as analyze_module

    monkeypatch.setattr(search_module, "GROUP_FROM", 4)
    monkeypatch.setattr(analyze_module, "EXPANDED_OPS", 5)
    ranked, runs = search_module._rank(qdq, evaluator, False)
    tensors, weights = qdq.all_tensors(), qdq.all_weights()

    def alone(ops):
        return evaluator.sqnr(qdq.ablated(tensors - {t for op in ops for t in op.activations},
                                          weights - {w for op in ops for w in op.weights}))

    pieces = [qdq.ops[i:i + 4] for i in range(0, 13, 4)]
    order = sorted(range(4), key=lambda g: (alone(pieces[g]), g))
    expanded, count = [], 0
    for g in order:
        if count >= 5:
            break
        expanded.append(g)
        count += len(pieces[g])
    one_by_one = sorted((op for g in expanded for op in pieces[g]), key=lambda op: (alone([op]), qdq.ops.index(op)))
    rest = [op for g in order if g not in expanded for op in pieces[g]]
    assert [op.node for op in ranked] == [op.node for op in one_by_one + rest]
    assert runs == 4 + count


def test_the_summary_reads_an_infinite_whole_model_figure():
    """An SQNR JSON holds as "-inf" (a variant whose outputs changed length) is still compared with
    the target: one line, no TypeError (SLANet's decoder, issue 31)."""
    sr = {"precision": "int16", "int16": [], "kept_float": [], "target_sqnr_db": 30.0, "reached": False,
          "integer_sqnr_db": 10.0, "final_sqnr_db": 10.0, "samples": 4, "whole_sqnr_db": "-inf",
          "evaluations": 2, "seconds": 1.0, "phases": {}}
    assert "every op int16 at once: -inf dB, below the target: no ranking" in search_summary(sr)


def test_widening_a_cut_sigmoid_input_covers_its_calibrated_range_as_an_int16_quantize_does(tmp_path):
    # at 8 bits quantize cuts a Sigmoid's input to where its output saturates (about +-5.5 here,
    # of a calibrated +-30); at int16 it keeps the whole range. The search's widened variant must
    # write the int16 fence quantize writes, or no variant reaches what the real model scores
    # (PP-OCRv4 det: every op int16 at once scored 1.6 dB as variants, 30.1 dB once widened so)
    from qtool.calibrate import calibrate
    from qtool.search import widened

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["logits"], name="scale"),
         helper.make_node("Sigmoid", ["logits"], ["y"], name="sigmoid")], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 64])],
        [onnx.numpy_helper.from_array(np.array(10.0, np.float32), "k")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              tmp_path / "m.onnx")
    x = np.random.default_rng(3).uniform(-3, 3, (32, 64)).astype(np.float32)
    x[0, :2] = (-3, 3)
    np.savez(tmp_path / "d.npz", x=x)
    table = calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False)
    int8, _ = quantize(tmp_path / "m.onnx", table, QuantizeOptions())
    wide, _ = quantize(tmp_path / "m.onnx", table, QuantizeOptions(int16=("scale", "sigmoid")))
    float_model = prepare(load_model(tmp_path / "m.onnx"))
    qdq = QdqModel(int8, float_model)
    reach = {name: max(abs(e.min), abs(e.max)) for name, e in table.tensors.items()}

    def fence_scale(model):
        inits = {i.name: i for i in model.graph.initializer}
        q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "logits")
        return float(onnx.numpy_helper.to_array(inits[q.input[1]]))

    assert fence_scale(int8) * 127 < 8  # the 8-bit fence covers the saturating cut only
    assert fence_scale(wide) == pytest.approx(reach["logits"] / 32767, rel=1e-6)
    assert fence_scale(widened(qdq, {"scale", "sigmoid"}, reach)) == pytest.approx(fence_scale(wide), rel=1e-6)
    assert fence_scale(widened(qdq, {"scale", "sigmoid"})) < fence_scale(wide) / 3  # the cut, as before


def test_widened_variants_take_the_int16_constants_quantize_writes_around_int16_ops(tmp_path):
    # quantize stores a constant operand int16 where every op reading it has an int16 output
    # (_wide_operands); the search's variants must too, or they score below the model it writes
    # (all-MiniLM-L6-v2: every op int16 at once 29.99 dB scored, 31.28 dB written)
    from qtool.analyze import as_written_session
    from qtool.calibrate import calibrate
    from qtool.search import widened

    rng = np.random.default_rng(5)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
         helper.make_node("Add", ["h", "b"], ["y"], name="add"),
         helper.make_node("Add", ["h", "shared"], ["z"], name="add2"),
         helper.make_node("Add", ["y", "shared"], ["u"], name="add3")], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, ["N", 8]) for o in ("z", "u")],
        [onnx.numpy_helper.from_array(rng.normal(0, 0.25, (16, 8)).astype(np.float32), "w"),
         onnx.numpy_helper.from_array(rng.normal(0, 1, 8).astype(np.float32), "b"),
         onnx.numpy_helper.from_array(rng.normal(0, 1, 8).astype(np.float32), "shared")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              tmp_path / "m.onnx")
    x = rng.normal(0, 1, (32, 16)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    table = calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", progress=False)
    int8, _ = quantize(tmp_path / "m.onnx", table, QuantizeOptions())
    every, _ = quantize(tmp_path / "m.onnx", table, QuantizeOptions(int16=("mm", "add", "add2", "add3")))
    float_model = prepare(load_model(tmp_path / "m.onnx"))

    def constant(model, name):  # the initializer its DequantizeLinear reads
        inits = {i.name: i for i in model.graph.initializer}
        dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == f"{name}_dequantized")
        return inits[dq.input[0]], onnx.numpy_helper.to_array(inits[dq.input[1]])

    EIGHT, INT16 = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8), onnx.TensorProto.INT16
    assert constant(int8, "b")[0].data_type in EIGHT and constant(int8, "shared")[0].data_type in EIGHT
    assert constant(every, "b")[0].data_type == constant(every, "shared")[0].data_type == INT16
    plain = QdqModel(int8, float_model)
    assert constant(widened(plain, {"add"}), "b")[0].data_type in EIGHT  # as it was: no reference taken
    qdq = QdqModel(int8, float_model)
    qdq.take_wide_constants(every)
    # the constants widened are the ones quantize widens with the same ops given int16 (an op whose
    # output another's int16 input makes int16 counts: with add3 alone, add writes y at int16)
    for ops, wide in (({"add"}, {"b"}), ({"add2"}, set()), ({"add3"}, {"b"}), ({"add2", "add3"}, {"b", "shared"}),
                      ({"mm", "add", "add2", "add3"}, {"b", "shared"})):
        variant = widened(qdq, ops)
        written, _ = quantize(tmp_path / "m.onnx", table, QuantizeOptions(int16=tuple(sorted(ops))))
        for name in ("b", "shared"):
            got, scale = constant(variant, name)
            if name in wide:  # the integers and scale quantize wrote
                assert got.data_type == constant(written, name)[0].data_type == INT16, (ops, name)
                assert got.raw_data == constant(every, name)[0].raw_data and scale == constant(every, name)[1]
            else:  # a reader of "shared" (add3 or add2) still writes 8 bits
                assert got.data_type in EIGHT and constant(written, name)[0].data_type in EIGHT, (ops, name)
        onnx.checker.check_model(variant)
        outputs = as_written_session(variant).run(None, {"x": x[:4]})
        assert all(np.isfinite(o).all() for o in outputs)


def test_with_bias_correction_a_prefix_is_scored_as_the_model_written_with_its_own_correction(
        demo_model, demo_table, demo_calib):
    # the all-int8 model's bias corrections are fitted to its 8-bit errors; a variant that kept
    # them scored every op int16 at once at 14.5 dB on PP-OCRv4 rec, the model written 33.9 dB
    from qtool.bias_correction import quantize_corrected

    qmodel, report, result = search(demo_model, demo_table, QuantizeOptions(), "t", demo_calib, target_db=200.0,
                                    progress=False)
    assert {n for _, n in result.int16} == {op.node for op in QdqModel(qmodel, prepare(load_model(demo_model))).ops}
    assert result.whole_db == pytest.approx(result.final_db, abs=1e-9) and not result.reached
    float_model = prepare(load_model(demo_model))
    corrected = quantize_corrected(demo_model, demo_table, QuantizeOptions(), "t", demo_calib, progress=False)[0]
    kept = QdqModel(corrected, float_model)
    kept_db = Evaluator(float_model, _searched(demo_calib)).sqnr(kept.widened(kept.all_tensors()))
    assert abs(kept_db - result.whole_db) > 0.1  # the corrections do matter here


@pytest.mark.parametrize("target, budget", [(40.0, None), (None, 4)])
def test_the_search_writes_the_build_it_scored(demo_model, demo_table, demo_calib, monkeypatch, target, budget):
    # the prefix the search ends on was quantized and bias-corrected when it was scored: that build
    # is written, not made again; --strict (which the reuse leaves to a build of its own) gives the
    # same model, built once more
    import qtool.search as search_module

    calls = []
    real = search_module.quantize_corrected

    def counted(*args, **kwargs):
        calls.append(args[2].strict)
        return real(*args, **kwargs)

    monkeypatch.setattr(search_module, "quantize_corrected", counted)
    written = {}
    for strict in (False, True):
        calls.clear()
        qmodel, _, result = search(demo_model, demo_table, QuantizeOptions(strict=strict), "t", demo_calib,
                                   target_db=target, max_float=budget, progress=False)
        assert result.int16 and not result.reverted
        written[strict] = (qmodel.SerializeToString(), len(calls))
    assert written[False][0] == written[True][0]
    assert written[True][1] == written[False][1] + 1  # the final build, made again under --strict
