"""Outputs that join values of very different ranges (a detector's boxes in pixels beside its class
probabilities): quantize keeps the join float so that each part keeps its own scale, and verify
scores every part, failing a model whose narrow part is destroyed.

The expected per-part figures are computed here with numpy from onnxruntime's float outputs and
the integer executor's outputs, sliced by hand (the model's layout is known), not by the part
placement under test.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import qtool.quantize as quantize_module
from qtool.calibrate import calibrate
from qtool.cli import app
from qtool.executor import IntegerExecutor
from qtool.analyze import Evaluator
from qtool.joins import find_joins, part_map
from qtool.quantize import quantize

runner = CliRunner()
BOXES, SCORES, POSITIONS = 4, 6, 64


def _init(name, array, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(array, dtype), name)


def detector(box_scale: float = 300.0, opset: int = 13) -> onnx.ModelProto:
    """Conv -> Relu, then boxes (Sigmoid * box_scale, 4 channels) and scores (Sigmoid, 6 channels),
    concatenated on the channel axis, transposed to NHWC and reshaped to [N, 64, 10]."""
    rng = np.random.default_rng(0)
    inits = [_init("w1", rng.normal(0, .3, (8, 3, 3, 3))), _init("b1", rng.normal(0, .1, 8)),
             _init("wb", rng.normal(0, .3, (BOXES, 8, 1, 1))),
             _init("wc", rng.normal(0, .3, (SCORES, 8, 1, 1))), _init("k", [box_scale]),
             _init("shape", [0, -1, BOXES + SCORES], np.int64)]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h"], ["hr"], name="relu"),
             helper.make_node("Conv", ["hr", "wb"], ["box0"], name="convbox"),
             helper.make_node("Sigmoid", ["box0"], ["box1"], name="boxsig"),
             helper.make_node("Mul", ["box1", "k"], ["boxes"], name="scale"),
             helper.make_node("Conv", ["hr", "wc"], ["cls0"], name="convcls"),
             helper.make_node("Sigmoid", ["cls0"], ["scores"], name="clssig"),
             helper.make_node("Concat", ["boxes", "scores"], ["joined"], name="join", axis=1),
             helper.make_node("Transpose", ["joined"], ["t"], name="tr", perm=[0, 2, 3, 1]),
             helper.make_node("Reshape", ["t", "shape"], ["out"], name="rs")]
    graph = helper.make_graph(
        nodes, "detector", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", POSITIONS, BOXES + SCORES])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(1)
    paths = {"model": folder / "det.onnx", "data": folder / "data.npz",
             "narrow": folder / "narrow.onnx"}
    onnx.save(detector(), str(paths["model"]))
    onnx.save(detector(box_scale=2.0), str(paths["narrow"]))
    np.savez(paths["data"], x=rng.normal(0, 1, (24, 3, 8, 8)).astype(np.float32))
    return paths


def _sqnr(ref, got) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    return 10 * math.log10((ref * ref).sum() / ((ref - got) ** 2).sum())


def _cosine(ref, got) -> float:
    ref, got = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    return float(ref @ got / math.sqrt((ref @ ref) * (got @ got)))


def _outputs(files, qmodel):
    x = np.load(files["data"])["x"]
    ref = ort.InferenceSession(str(files["model"]), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = IntegerExecutor(qmodel).run({"x": x}).outputs["out"]
    return ref, got


def test_find_joins_walks_back_through_moves(files):
    join = find_joins(onnx.load(str(files["model"])))["out"]
    assert (join.node, join.axis, join.inputs) == ("join", 1, ["boxes", "scores"])
    assert [n.name for n, _ in join.chain] == ["tr", "rs"]


def test_part_map_places_each_part_where_its_values_land():
    join = find_joins(detector())["out"]
    shapes = {"boxes": (2, BOXES, 8, 8), "scores": (2, SCORES, 8, 8), "joined": (2, 10, 8, 8),
              "t": (2, 8, 8, 10), "out": (2, POSITIONS, 10)}
    labels = part_map(join, shapes)
    expected = np.zeros((2, POSITIONS, 10), np.int16)
    expected[..., BOXES:] = 1  # NHWC then flattened positions: the channels are the last axis
    np.testing.assert_array_equal(labels, expected)
    # a broadcast in the chain cannot be followed: no placement rather than a wrong one
    assert part_map(join, shapes | {"t": (1, 8, 8, 10)}) is None


def test_quantize_keeps_a_mixed_range_join_float(files):
    table = calibrate(files["model"], files["data"], progress=False)
    qmodel, report = quantize(files["model"], table)
    kept = {n: r for _, n, r in report.kept_float}
    assert set(kept) == {"join", "tr", "rs"}
    assert "joins ranges" in kept["join"] and "output 'out'" in kept["join"]
    ref, got = _outputs(files, qmodel)
    # each part dequantized with its own scale: the scores keep about int8's precision
    assert _sqnr(ref[..., BOXES:], got[..., BOXES:]) > 30
    assert _sqnr(ref[..., :BOXES], got[..., :BOXES]) > 30


def test_quantize_keeps_a_join_of_like_ranges_integer(files):
    table = calibrate(files["narrow"], files["data"], progress=False)
    _, report = quantize(files["narrow"], table)
    assert not report.kept_float
    assert report.quantized["Concat"] == 1


def _verify_json(files, qpath):
    result = runner.invoke(app, ["verify", str(files["model"]), str(qpath), "--data", str(files["data"]),
                                 "--json", "-q"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result, json.loads(result.stdout)


def test_verify_fails_a_destroyed_part_behind_a_good_whole(files, tmp_path, monkeypatch):
    monkeypatch.setattr(quantize_module, "JOIN_RATIO", math.inf)  # the join quantized as one tensor
    table = calibrate(files["model"], files["data"], progress=False)
    qmodel, report = quantize(files["model"], table)
    assert not report.kept_float
    qpath = tmp_path / "det.q.onnx"
    onnx.save(qmodel, str(qpath))
    ref, got = _outputs(files, qmodel)
    assert _cosine(ref, got) > 0.99  # the boxes dominate the whole tensor
    assert _cosine(ref[..., BOXES:], got[..., BOXES:]) < 0.99
    result, report = _verify_json(files, qpath)
    assert result.exit_code == 1
    out = report["outputs"][0]
    assert out["cosine"] == pytest.approx(_cosine(ref, got), abs=2e-6)
    parts = {p["name"]: p for p in out["parts"]["parts"]}
    assert parts["boxes"]["sqnr_db"] == pytest.approx(_sqnr(ref[..., :BOXES], got[..., :BOXES]), abs=2e-3)
    assert parts["scores"]["sqnr_db"] == pytest.approx(_sqnr(ref[..., BOXES:], got[..., BOXES:]), abs=2e-3)
    assert parts["scores"]["cosine"] == pytest.approx(_cosine(ref[..., BOXES:], got[..., BOXES:]), abs=2e-6)
    assert out["parts"]["worst"] == "scores"
    assert report["failures"][0] == (f"output 'out' part 'scores' (input of Concat 'join') cosine "
                                     f"{parts['scores']['cosine']:.6f} < 0.99")
    # the default SQNR floor (20 dB) fails the destroyed part too, and nothing else
    assert report["failures"][1:] == [f"output 'out' part 'scores' (input of Concat 'join') SQNR "
                                      f"{parts['scores']['sqnr_db']:.2f} dB < 20.0 dB"]
    text = runner.invoke(app, ["verify", str(files["model"]), str(qpath), "--data", str(files["data"]), "-q"])
    assert text.exit_code == 1
    assert "part scores" in text.stdout and "<- worst part" in text.stdout


def test_verify_passes_the_default_quantization(files, tmp_path):
    table = calibrate(files["model"], files["data"], progress=False)
    qpath = tmp_path / "det.q.onnx"
    onnx.save(quantize(files["model"], table)[0], str(qpath))
    result, report = _verify_json(files, qpath)
    assert result.exit_code == 0, report["failures"]
    assert [p["name"] for p in report["outputs"][0]["parts"]["parts"]] == ["boxes", "scores"]


def _as_written(model, x):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_searches_score_the_worst_part_of_a_join(files, monkeypatch):
    # the searches' and the held-out judge's score (Evaluator) is the worst part, not the whole output
    monkeypatch.setattr(quantize_module, "JOIN_RATIO", math.inf)
    float_model = onnx.load(str(files["model"]))
    qmodel, _ = quantize(files["model"], calibrate(files["model"], files["data"], progress=False))
    x = np.load(files["data"])["x"]
    evaluator = Evaluator(float_model, [{"x": x[:12]}, {"x": x[12:]}])
    assert "each part of output 'out' (Concat 'join')" in evaluator.scored
    ref, got = _as_written(float_model, x), _as_written(qmodel, x)
    expected = [_sqnr(ref[..., :BOXES], got[..., :BOXES]), _sqnr(ref[..., BOXES:], got[..., BOXES:])]
    assert evaluator.scores(qmodel) == pytest.approx(expected, abs=1e-6)
    assert evaluator.sqnr(qmodel) == pytest.approx(min(expected), abs=1e-6)
    assert evaluator.sqnr(qmodel) < _sqnr(ref, got) - 10  # the whole output hides the scores' loss


def test_searches_score_every_output(files):
    # two graph outputs, one under a Sigmoid: its logits are scored, and the worst output decides
    model = onnx.load(str(files["model"]))
    model.graph.output.append(helper.make_tensor_value_info("scores", TensorProto.FLOAT, None))
    model.graph.output.append(helper.make_tensor_value_info("ints", TensorProto.INT64, None))
    model.graph.node.append(helper.make_node("Shape", ["x"], ["ints"], name="shape_of_x"))
    x = np.load(files["data"])["x"][:8]
    evaluator = Evaluator(model, [{"x": x}])
    labels = [label for label, _, _ in evaluator.items]
    assert labels == ["output 'out'", "the logits 'cls0' (input of Sigmoid 'clssig')"]  # not the INT64 one
    noisy = onnx.load(str(files["model"]))
    noisy.graph.output.append(helper.make_tensor_value_info("scores", TensorProto.FLOAT, None))
    wc = next(i for i in noisy.graph.initializer if i.name == "wc")
    wc.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(wc) * 1.1, "wc"))
    scores = evaluator.scores(noisy)
    assert len(scores) == 3  # the boxes part, the scores part of 'out', the logits
    assert scores[0] == math.inf  # the boxes do not read wc
    # logits scaled by 1.1: 20 dB, compared within the window where the probability moves
    logits = np.concatenate([np.ravel(run[1]) for run in evaluator.reference]).astype(np.float64)
    lo, hi = evaluator.windows[1]
    assert logits.min() < lo or logits.max() > hi  # some are clipped: not exactly 20 dB
    ref, got = np.clip(logits, lo, hi), np.clip(1.1 * logits, lo, hi)
    assert scores[2] == pytest.approx(10 * math.log10((ref ** 2).sum() / ((ref - got) ** 2).sum()), abs=1e-3)
    assert scores[2] == pytest.approx(20 * math.log10(1 / 0.1), abs=0.5)
    assert evaluator.sqnr(noisy) == min(scores)


def test_an_output_whose_size_changes_scores_minus_infinity(files):
    # an output whose length depends on values (a decoder loop, NonZero) can come out of a
    # variant with another size: the worst score, not a broadcast error
    model = onnx.load(str(files["model"]))
    model.graph.node.append(helper.make_node("NonZero", ["scores"], ["nz"], name="nonzero"))
    model.graph.node.append(helper.make_node("Cast", ["nz"], ["picked"], name="cast", to=TensorProto.FLOAT))
    model.graph.output.append(helper.make_tensor_value_info("picked", TensorProto.FLOAT, None))
    x = np.load(files["data"])["x"][:4]
    evaluator = Evaluator(model, [{"x": x}])
    shifted = onnx.load(str(files["model"]))
    shifted.graph.node.append(helper.make_node("Sub", ["scores", "half"], ["centred"], name="sub"))
    shifted.graph.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "half"))
    shifted.graph.node.append(helper.make_node("Relu", ["centred"], ["kept"], name="relu_kept"))
    shifted.graph.node.append(helper.make_node("NonZero", ["kept"], ["nz"], name="nonzero"))
    shifted.graph.node.append(helper.make_node("Cast", ["nz"], ["picked"], name="cast", to=TensorProto.FLOAT))
    shifted.graph.output.append(helper.make_tensor_value_info("picked", TensorProto.FLOAT, None))
    scores = evaluator.scores(shifted)
    assert scores[-1] == -math.inf and evaluator.sqnr(shifted) == -math.inf
    assert scores[0] == math.inf  # the first output is unchanged


def yolox_like(box_scale: float = 40.0) -> onnx.ModelProto:
    """A YOLOX-style head on two levels: each level's boxes (a raw Conv times box_scale), objectness
    (1 channel) and class scores (SCORES channels), both Sigmoids, concatenated on the channels and
    reshaped to [N, C, HW]; the levels (8x8 and 4x4) concatenated on the positions, then transposed
    to [N, 80, C]."""
    rng = np.random.default_rng(2)
    channels = BOXES + 1 + SCORES
    inits = [_init("w1", rng.normal(0, .3, (8, 3, 3, 3))), _init("k", [box_scale]),
             _init("w2", rng.normal(0, .3, (8, 8, 3, 3))),
             _init("flat", [0, channels, -1], np.int64)]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["h1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h1"], ["f1"], name="relu1"),
             helper.make_node("Conv", ["f1", "w2"], ["h2"], name="conv2", pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["h2"], ["f2"], name="relu2")]
    levels = []
    for level in (1, 2):
        inits += [_init(f"wb{level}", rng.normal(0, .3, (BOXES, 8, 1, 1))),
                  _init(f"wo{level}", rng.normal(0, .3, (1, 8, 1, 1))),
                  _init(f"wc{level}", rng.normal(0, .3, (SCORES, 8, 1, 1)))]
        f = f"f{level}"
        nodes += [helper.make_node("Conv", [f, f"wb{level}"], [f"raw{level}"], name=f"convbox{level}"),
                  helper.make_node("Mul", [f"raw{level}", "k"], [f"boxes{level}"], name=f"scale{level}"),
                  helper.make_node("Conv", [f, f"wo{level}"], [f"obj0{level}"], name=f"convobj{level}"),
                  helper.make_node("Sigmoid", [f"obj0{level}"], [f"obj{level}"], name=f"objsig{level}"),
                  helper.make_node("Conv", [f, f"wc{level}"], [f"cls0{level}"], name=f"convcls{level}"),
                  helper.make_node("Sigmoid", [f"cls0{level}"], [f"cls{level}"], name=f"clssig{level}"),
                  helper.make_node("Concat", [f"boxes{level}", f"obj{level}", f"cls{level}"], [f"head{level}"],
                                   name=f"head{level}", axis=1),
                  helper.make_node("Reshape", [f"head{level}", "flat"], [f"flat{level}"], name=f"flat{level}")]
        levels.append(f"flat{level}")
    nodes += [helper.make_node("Concat", levels, ["levels"], name="levels", axis=2),
              helper.make_node("Transpose", ["levels"], ["out"], name="tr", perm=[0, 2, 1])]
    graph = helper.make_graph(
        nodes, "yolox_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 80, channels])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


# each field's channels and each level's positions in yolox_like's [N, 80, C] output, by hand
FIELDS = {"boxes": slice(0, BOXES), "obj": slice(BOXES, BOXES + 1), "cls": slice(BOXES + 1, BOXES + 1 + SCORES)}
LEVELS = {1: slice(0, 64), 2: slice(64, 80)}


def test_a_join_of_joins_has_each_level_s_fields_as_parts():
    # YOLOX: each level's boxes, objectness and class scores joined on the channels, then the levels:
    # the parts are the fields of each level, not the levels (whose figures are the boxes')
    join = find_joins(yolox_like())["out"]
    assert (join.node, join.inputs, sorted(join.nested)) == ("levels", ["flat1", "flat2"], ["flat1", "flat2"])
    assert join.parts() == ["boxes1", "obj1", "cls1", "boxes2", "obj2", "cls2"]
    assert join.concat_of("cls2") == "head2" and join.concat_of("boxes1") == "head1"
    assert {name for name, _ in join.nodes()} == {"levels", "tr", "head1", "flat1", "head2", "flat2"}
    shapes = {f"{field}{level}": (2, width, side, side) for level, side in ((1, 8), (2, 4))
              for field, width in (("boxes", BOXES), ("obj", 1), ("cls", SCORES))}
    shapes |= {"head1": (2, 11, 8, 8), "flat1": (2, 11, 64), "head2": (2, 11, 4, 4), "flat2": (2, 11, 16),
               "levels": (2, 11, 80), "out": (2, 80, 11)}
    labels = part_map(join, shapes)
    expected = np.zeros((2, 80, 11), np.int16)
    for level, positions in LEVELS.items():
        for number, channels in enumerate(FIELDS.values()):
            expected[:, positions, channels] = 3 * (level - 1) + number
    np.testing.assert_array_equal(labels, expected)
    # an inner Concat whose output is read twice is no part of the join: keeping it float would
    # change what the other reader gets
    twice = yolox_like()
    twice.graph.node.append(helper.make_node("Identity", ["head2"], ["seen"], name="seen"))
    twice.graph.output.append(helper.make_tensor_value_info("seen", TensorProto.FLOAT, None))
    assert find_joins(twice)["out"].parts() == ["boxes1", "obj1", "cls1", "flat2"]


def test_quantize_and_verify_keep_each_field_of_each_level(tmp_path):
    model_path, data_path = tmp_path / "yolox.onnx", tmp_path / "x.npz"
    onnx.save(yolox_like(), str(model_path))
    x = np.random.default_rng(3).normal(0, 1, (24, 3, 8, 8)).astype(np.float32)
    np.savez(data_path, x=x)
    table = calibrate(model_path, data_path, progress=False)
    qmodel, report = quantize(model_path, table)
    kept = {n for _, n, _ in report.kept_float}
    assert kept == {"levels", "tr", "head1", "flat1", "head2", "flat2"}
    ref = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = IntegerExecutor(qmodel).run({"x": x}).outputs["out"]
    # every field keeps its own scale: the class scores are not rounded on the boxes' steps
    for level, positions in LEVELS.items():
        for field, channels in FIELDS.items():
            assert _sqnr(ref[:, positions, channels], got[:, positions, channels]) > 28, (level, field)
    qpath = tmp_path / "yolox.q.onnx"
    onnx.save(qmodel, str(qpath))
    result = runner.invoke(app, ["verify", str(model_path), str(qpath), "--data", str(data_path), "--json", "-q"])
    assert result.exit_code == 0, result.output
    parts = {p["name"]: p for p in json.loads(result.stdout)["outputs"][0]["parts"]["parts"]}
    assert list(parts) == ["boxes1", "obj1", "cls1", "boxes2", "obj2", "cls2"]
    for level, positions in LEVELS.items():
        for field, channels in FIELDS.items():
            assert parts[f"{field}{level}"]["sqnr_db"] == pytest.approx(
                _sqnr(ref[:, positions, channels], got[:, positions, channels]), abs=2e-3)
    # the judged steps of quantize --data score the same six parts (onnxruntime running the QDQ model)
    evaluator = Evaluator(yolox_like(), [{"x": x[:12]}, {"x": x[12:]}])
    ref, got = _as_written(yolox_like(), x), _as_written(qmodel, x)
    expected = [_sqnr(ref[:, positions, channels], got[:, positions, channels])
                for positions in LEVELS.values() for channels in FIELDS.values()]
    assert evaluator.scores(qmodel) == pytest.approx(expected, abs=1e-6)


def test_a_join_of_joins_quantized_whole_fails_verify_on_the_field_it_destroys(tmp_path, monkeypatch):
    # the sweep's CapSpot detector: one scale over boxes and objectness rounded the objectness to 0,
    # and verify, scoring whole levels, named no field
    monkeypatch.setattr(quantize_module, "JOIN_RATIO", math.inf)
    model_path, data_path = tmp_path / "yolox.onnx", tmp_path / "x.npz"
    onnx.save(yolox_like(box_scale=400.0), str(model_path))
    np.savez(data_path, x=np.random.default_rng(3).normal(0, 1, (24, 3, 8, 8)).astype(np.float32))
    qmodel, report = quantize(model_path, calibrate(model_path, data_path, progress=False))
    assert not report.kept_float
    qpath = tmp_path / "yolox.q.onnx"
    onnx.save(qmodel, str(qpath))
    result = runner.invoke(app, ["verify", str(model_path), str(qpath), "--data", str(data_path), "--json", "-q"])
    assert result.exit_code == 1, result.output
    failures = json.loads(result.stdout)["failures"]
    assert any(f.startswith("output 'out' part 'obj1' (input of Concat 'head1')") for f in failures), failures
    assert not any("'boxes" in f for f in failures), failures
