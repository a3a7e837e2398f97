"""``qtool analyze``: per-op sensitivity by graph surgery on the QDQ model."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qtool.analyze import Evaluator, QdqModel, analyze, format_analysis, sqnr_db
from qtool.model import load_model, prepare
from qtool.quantize import quantize
from test_cli import assert_no_crash, assert_user_error, invoke


@pytest.fixture(scope="module")
def demo(demo_model, demo_table, demo_heldout):
    float_model = prepare(load_model(demo_model))
    qmodel, _ = quantize(demo_model, demo_table)
    batches = [{"input": np.load(demo_heldout)["input"][:64]}]
    return float_model, qmodel, Evaluator(float_model, batches), batches


def _run(model, feeds, optimized=False):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_removing_every_fence_and_weight_gives_back_the_float_model(demo):
    float_model, qmodel, evaluator, batches = demo
    qdq = QdqModel(qmodel, float_model)
    assert len(qdq.ops) == 13 and len(qdq.all_weights()) == 10  # 5 weighted ops: weight + bias
    restored = _run(qdq.ablated(qdq.all_tensors(), qdq.all_weights()), batches[0])
    np.testing.assert_array_equal(restored, _run(float_model, batches[0]))
    # nothing removed: the quantized model itself
    np.testing.assert_array_equal(_run(qdq.ablated((), ()), batches[0]), _run(qmodel, batches[0]))


def test_each_variant_removes_what_it_says(demo):
    float_model, qmodel, _, _ = demo
    qdq = QdqModel(qmodel, float_model)
    conv = next(op for op in qdq.ops if op.node == "block_conv2")
    variant = qdq.ablated(conv.outputs, conv.weights)
    fences = {n.input[0] for n in variant.graph.node if n.op_type == "QuantizeLinear"}
    assert fences == qdq.all_tensors() - set(conv.outputs)
    dq_inputs = {n.output[0] for n in variant.graph.node if n.op_type == "DequantizeLinear"}
    assert not set(conv.weights) & dq_inputs
    floats = {i.name: i for i in variant.graph.initializer}
    originals = {i.name: i for i in float_model.graph.initializer}
    node = next(n for n in float_model.graph.node if n.name == "block_conv2")
    assert onnx.numpy_helper.to_array(floats[conv.weights[0]]).tobytes() == \
        onnx.numpy_helper.to_array(originals[node.input[1]]).tobytes()


def test_analysis_figures_match_a_direct_measurement(demo, demo_model, demo_heldout):
    float_model, qmodel, evaluator, batches = demo
    result = analyze(demo_model, qmodel, demo_heldout, num_samples=64, batch_size=64, progress=False)
    reference = _run(float_model, batches[0])
    assert result.quantized_db == pytest.approx(sqnr_db([reference], [_run(qmodel, batches[0])]), abs=1e-9)
    assert [o.node for o in result.ops] != [] and len(result.ops) == 13
    gains = [o.gain_db for o in result.ops]
    assert gains == sorted(gains, reverse=True)  # ranked, largest gain first
    for o in result.ops:
        assert o.gain_db == pytest.approx(o.only_float_db - result.quantized_db)
        assert math.isfinite(o.only_quantized_db) and o.only_quantized_db > result.quantized_db
    # deterministic: the same ranking and figures on a second run
    again = analyze(demo_model, qmodel, demo_heldout, num_samples=64, batch_size=64, progress=False)
    assert again.to_dict() == result.to_dict()


def test_cli_analyze_json_and_text(tmp_path, demo_model, demo_heldout):
    result = invoke("analyze", demo_model, "-d", demo_heldout, "--num-samples", "32", "--json", "-q")
    assert_no_crash(result)
    report = json.loads(result.stdout)
    assert report["samples"] == 32 and len(report["ops"]) == 13
    assert {o["op_type"] for o in report["ops"]} >= {"Conv", "Gemm", "Relu", "Add"}
    text = invoke("analyze", demo_model, "-d", demo_heldout, "--num-samples", "32", "--top", "3", "-q")
    assert text.exit_code == 0
    assert "... 10 more" in text.stdout and text.stdout.count(" dB ") >= 3


def test_cli_analyze_columns_stay_aligned_for_long_node_names(tmp_path, demo_model, demo_heldout):
    model = onnx.load(demo_model)
    for node in model.graph.node:  # as exporters name them: longer than the 32 columns of the node name
        node.name = f"/model/backbone/stage_one/{node.name}/{node.op_type}_output_0"
    onnx.save(model, tmp_path / "long.onnx")
    result = invoke("analyze", tmp_path / "long.onnx", "-d", demo_heldout, "--num-samples", "16", "-q")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("rank"))
    rows = lines[header + 1:header + 14]
    assert all(len(row.split()[2]) > 32 for row in rows)  # the node names
    end = lines[header].index("only it quantized") + len("only it quantized")
    assert all(row.index(" dB") + len(" dB") == end for row in rows), "\n".join(lines[header:header + 14])
    assert len({len(row) for row in rows + [lines[header]]}) == 1


def test_cli_analyze_errors(tmp_path, demo_model, demo_heldout):
    assert_user_error(invoke("analyze", tmp_path / "none.onnx", "-d", demo_heldout), "none.onnx", "not found")
    assert_user_error(invoke("analyze", demo_model, "-d", demo_heldout, "--batch-size", "0"), "batch")
    assert_user_error(invoke("analyze", demo_model, "-d", demo_heldout, "-t", tmp_path / "t.yaml"),
                      "t.yaml", "not found")


def test_a_large_model_is_scored_in_groups_first(demo, demo_model, demo_heldout, monkeypatch):
    import qtool.analyze as analyze_module

    float_model, qmodel, evaluator, batches = demo
    every = analyze(demo_model, qmodel, demo_heldout, num_samples=64, batch_size=64, progress=False)
    assert every.groups == [] and every.skipped == 0
    # as if the demo's 13 ops were many: groups of ceil(sqrt(13)) = 4 consecutive ops, and the
    # best groups' ops scored one by one until at least 5 are
    monkeypatch.setattr(analyze_module, "GROUP_FROM", 4)
    monkeypatch.setattr(analyze_module, "EXPANDED_OPS", 5)
    grouped = analyze(demo_model, qmodel, demo_heldout, num_samples=64, batch_size=64, progress=False)
    qdq = QdqModel(qmodel, float_model)
    runs = [qdq.ops[i:i + 4] for i in range(0, 13, 4)]
    assert [g.count for g in sorted(grouped.groups, key=lambda g: g.first)] == \
        [len(r) for r in sorted(runs, key=lambda r: r[0].node)]
    gains = [g.gain_db for g in grouped.groups]
    assert gains == sorted(gains, reverse=True)
    for g in grouped.groups:  # each group's figure: its ops' fences and weights all removed, measured here
        run = next(r for r in runs if r[0].node == g.first)
        left = evaluator.sqnr(qdq.ablated({t for op in run for t in op.outputs}, {w for op in run for w in op.weights}))
        assert g.only_float_db == pytest.approx(left, abs=1e-9) and g.last == run[-1].node
    expanded = [g for g in grouped.groups if g.expanded]
    assert expanded == grouped.groups[:len(expanded)] and sum(g.count for g in expanded[:-1]) < 5 <= \
        sum(g.count for g in expanded)
    # the ops scored are those groups' ops, with the figures the full analysis gives them
    by_node = {o.node: o for o in every.ops}
    assert len(grouped.ops) == sum(g.count for g in expanded) == 13 - grouped.skipped
    assert all(o == by_node[o.node] for o in grouped.ops)
    text = format_analysis(grouped)
    assert f"{grouped.skipped} ops in groups that gained at most" in text and "--all-ops" in text
    assert analyze(demo_model, qmodel, demo_heldout, num_samples=64, batch_size=64, progress=False,
                   every_op=True).to_dict() == every.to_dict()


def test_an_evaluator_of_the_same_samples_and_a_score_of_the_same_model_are_not_run_again(
        demo, demo_model, demo_heldout, monkeypatch):
    # quantize --data's steps build evaluators of the same samples and score unchanged models
    # again: the second costs a hash. Other samples, another float model or another scored model
    # run anew, and what is kept equals what a run gives.
    float_model, qmodel = demo[0], demo[1]
    x = np.load(demo_heldout)["input"]
    batches = [{"input": x[:8]}, {"input": x[8:16]}]
    runs = []
    original = Evaluator._run
    monkeypatch.setattr(Evaluator, "_run", lambda self, *a, **k: runs.append(1) or original(self, *a, **k))
    assert Evaluator._KEPT is None  # nothing kept outside Evaluator.keeping()
    outside = Evaluator(float_model, batches)
    outside.sqnr(qmodel)
    Evaluator(float_model, batches)
    assert len(runs) == 3 and Evaluator._KEPT is None
    runs.clear()
    with Evaluator.keeping():
        first = Evaluator(float_model, batches)
        db = first.sqnr(qmodel)
        assert len(runs) == 2  # the references, then the model
        again = Evaluator(float_model, [{"input": x[:8].copy()}, {"input": x[8:16].copy()}])
        assert again.sqnr(qmodel) == db and len(runs) == 2
        other = Evaluator(float_model, [{"input": x[:8]}, {"input": x[16:24]}])
        assert len(runs) == 3
        changed = onnx.ModelProto()
        changed.CopyFrom(qmodel)
        changed.graph.initializer[0].raw_data = bytes(len(changed.graph.initializer[0].raw_data))
        changed_db = again.sqnr(changed)
        assert len(runs) == 4 and changed_db != db
        other_db = other.sqnr(qmodel)
    assert Evaluator._KEPT is None  # dropped at the end
    assert Evaluator(float_model, batches).sqnr(qmodel) == db
    assert Evaluator(float_model, [{"input": x[:8]}, {"input": x[16:24]}]).sqnr(qmodel) == other_db


def test_variants_run_from_where_they_differ_compute_what_they_compute_whole(demo):
    # qtool/prefix.py: each variant (an op left float in the quantized model, an op quantized in
    # the float one) runs from its first node that differs from the nearer base, on the base's
    # tensors there; its outputs are the same numbers as its whole run, in graph order and out of it
    from qtool.analyze import Batches
    from qtool.prefix import SharedPrefix
    from qtool.runs import Runs

    float_model, qmodel, _, _ = demo
    qdq = QdqModel(qmodel, float_model)
    # 24 samples in 3 batches, run sample by sample on the cores
    runs = Runs(Batches([{"input": b} for b in np.split(np.asarray(demo[3][0]["input"][:24]), 3)], 24,
                        axes={"input": 0}))
    batches = runs.feeds
    assert len(batches) == 24
    names = [o.name for o in qmodel.graph.output]
    bases = (qmodel, qdq.ablated(qdq.all_tensors(), qdq.all_weights()))
    prefixes = [SharedPrefix(base, runs) for base in bases]
    shared = 0
    for op in [*qdq.ops, *reversed(qdq.ops)]:
        for variant, prefix in ((qdq.left_float([op]), prefixes[0]), (qdq.only_quantized([op]), prefixes[1])):
            got = prefix.run(variant, names)
            whole = [_run(variant, b) for b in batches]
            if got is None:
                continue
            shared += 1
            assert prefix.state[0] > 0  # it ran from a cut, holding the base's tensors there
            for b, value in enumerate(whole):
                np.testing.assert_array_equal(got[b][0], value, err_msg=op.node)
    assert shared >= len(qdq.ops)  # most variants differ late enough to share a prefix


def test_a_base_and_its_variants_scored_together_score_what_each_scores_alone(demo, monkeypatch):
    # Evaluator.sqnrs (the judged steps' base and candidates): the base runs from the earliest
    # place a variant leaves it, each variant from its own; the figures equal lone scorings
    from qtool.analyze import Batches
    from qtool.prefix import SharedPrefix

    float_model, qmodel, _, batches = demo
    qdq = QdqModel(qmodel, float_model)
    split = Batches([{"input": b} for b in np.split(np.asarray(batches[0]["input"][:16]), 2)], 16,
                    axes={"input": 0})
    ops = {op.node: op for op in qdq.ops}
    middle, last = qdq.left_float([ops["block_conv2"]]), qdq.left_float([ops["fc"]])
    alone = [Evaluator(float_model, split).sqnr(m) for m in (qmodel, middle, last)]
    shared = []
    original = SharedPrefix.run

    def run(self, *args, **kwargs):
        shared.append(original(self, *args, **kwargs))
        return shared[-1]

    monkeypatch.setattr(SharedPrefix, "run", run)
    evaluator = Evaluator(float_model, split)
    assert evaluator.sqnrs(qmodel, last, middle) == alone[:1] + alone[:0:-1]
    assert len(set(alone)) == 3
    assert len(shared) == 3 and all(r is not None for r in shared)  # none of the three ran whole
    assert evaluator._prefixes == ()  # the base's prefix is not left behind for later scorings
    # a candidate that changes constants only (fitted weight integers) leaves the base at the first
    # node that reads one of them: the fc weight's DequantizeLinear, near the end
    refitted = onnx.ModelProto()
    refitted.CopyFrom(qmodel)
    fc = next(n for n in refitted.graph.node if n.name == "fc")
    dq = next(n for n in refitted.graph.node if n.output[0] == fc.input[1])
    weight = next(t for t in refitted.graph.initializer if t.name == dq.input[0])
    values = onnx.numpy_helper.to_array(weight).copy()
    values.flat[0] = values.flat[0] // 2
    weight.CopyFrom(onnx.numpy_helper.from_array(values, weight.name))
    prefix = SharedPrefix(qmodel, evaluator.runs)
    nodes = list(refitted.graph.node)
    assert prefix.shared(refitted) == nodes.index(dq) and prefix.cut([n.SerializeToString() for n in nodes]) == len(nodes)
    shared.clear()
    lone = Evaluator(float_model, split).sqnr(refitted)
    assert evaluator.sqnrs(qmodel, refitted) == [alone[0], lone] and lone != alone[0]
    assert len(shared) == 1 and shared[0] is not None  # the base's score was kept; the candidate ran from the cut


def test_the_analysis_is_the_same_with_and_without_shared_prefixes(demo_model, demo_heldout, demo, monkeypatch):
    _, qmodel, _, _ = demo
    shared = analyze(demo_model, qmodel, demo_heldout, num_samples=32, batch_size=8, progress=False)
    monkeypatch.setattr(Evaluator, "share_prefixes", lambda self, *bases: None)
    whole = analyze(demo_model, qmodel, demo_heldout, num_samples=32, batch_size=8, progress=False)
    assert shared.to_dict() == whole.to_dict() and shared.ops


def test_a_constant_listed_as_a_graph_input_is_read_from_the_model_not_the_batches(demo):
    # an initializer that is also a graph input (older exporters list them) is the model's
    # constant for the suffix of a variant, not a feed: the shared run equals the whole one
    from qtool.prefix import SharedPrefix
    from qtool.runs import Runs

    float_model, qmodel, _, batches = demo
    listed = onnx.ModelProto()
    listed.CopyFrom(qmodel)
    # the scale of the last activation fence: read after the cut of a variant of an earlier op
    inits = {i.name: i for i in listed.graph.initializer}
    last = next(n for n in reversed(listed.graph.node) if n.op_type == "DequantizeLinear"
                and n.input[0] not in inits)
    scale = inits[last.input[1]]
    listed.graph.input.append(onnx.helper.make_tensor_value_info(scale.name, scale.data_type, list(scale.dims)))
    qdq = QdqModel(listed, float_model)
    prefix = SharedPrefix(listed, Runs(batches))
    variant = qdq.left_float([qdq.ops[-3]])
    got = prefix.run(variant, [o.name for o in listed.graph.output])
    assert got is not None
    np.testing.assert_array_equal(got[0][0], _run(variant, batches[0]))


def test_runs_come_back_in_the_samples_order_with_at_most_one_a_core_ahead(monkeypatch):
    # qtool/runs.py: samples split from their batch run on the cores; results come back in the
    # samples' order whatever order they finish in, and a caller reducing them as they come
    # holds at most one run a core beyond the one it reads
    import threading
    import time

    from qtool import runs as runs_module
    from qtool.analyze import Batches
    from qtool.runs import Runs

    monkeypatch.setattr(runs_module, "CORES", 2)
    runs = Runs(Batches([{"x": np.arange(6, dtype=np.float32).reshape(6, 1)}], 6, axes={"x": 0}))
    assert len(runs) == 6 and runs.workers == 2 and all(f["x"].shape == (1, 1) for f in runs.feeds)
    lock, started, active, peak = threading.Lock(), [0], [0], [0]

    class Session:
        def run(self, names, feeds):
            with lock:
                started[0] += 1
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.02 * (6 - float(feeds["x"][0, 0])))  # the later samples finish first
            with lock:
                active[0] -= 1
            return [feeds["x"] * 2]

    got = []
    for read, out in enumerate(runs.each(Session(), ["y"]), start=1):
        time.sleep(0.03)  # a slow reader
        assert started[0] - read <= runs.workers
        got.append(float(out[0][0, 0]))
    assert got == [0, 2, 4, 6, 8, 10] and peak[0] == 2


def test_a_prefix_whose_held_tensors_would_pass_the_bound_runs_the_variant_whole(demo, monkeypatch):
    # qtool/prefix.py: the base's tensors at a cut are held for every feed; where that would take
    # more than STATE_BYTES (sized by shape inference at the first feed's shapes), the variant
    # runs whole, with the same outputs
    from qtool import prefix as prefix_module
    from qtool.prefix import SharedPrefix
    from qtool.runs import Runs

    float_model, qmodel, _, batches = demo
    qdq = QdqModel(qmodel, float_model)
    variant = qdq.left_float([next(op for op in qdq.ops if op.node == "fc")])
    names = [o.name for o in qmodel.graph.output]
    runs = Runs(batches)
    roomy = SharedPrefix(qmodel, runs)
    got = roomy.run(variant, names)
    assert got is not None and roomy.state is not None
    cut, kept = roomy.state
    held = roomy._held_bytes(list(kept[0]))
    assert held > 0 and held == sum(np.asarray(v).nbytes for state in kept for v in state.values())
    monkeypatch.setattr(prefix_module, "STATE_BYTES", held - 1)
    tight = SharedPrefix(qmodel, runs)
    assert tight.run(variant, names) is None and tight.state is None
    np.testing.assert_array_equal(got[0][0], _run(variant, batches[0]))
