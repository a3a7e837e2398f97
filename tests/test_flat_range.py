"""A tensor read only by ops that are constant beyond some bounds (HardSwish below -3, HardSigmoid
outside its linear part, Clip outside its constant bounds) gets only the range between them
(qtool/ops/flat.py, quantize's ``_flat_input``): every value beyond a bound gives the bound's own
output, exactly, so the steps go where the output moves. A tensor with any other reader keeps its
calibrated range, and verify compares a cut tensor clipped to the same bounds."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.calibrate import calibrate
from qtool.cli import app
from qtool.ops.flat import flat_bounds, readers_cut
from qtool.quantize import QuantizeOptions, quantize
from qtool.verify import verify
from typer.testing import CliRunner


def model(path, reader: str, extra_reader: bool = False):
    """x -> Conv (outputs about N(-4, 6): a long negative tail) -> READER [-> and a Relu of the
    Conv's output]. ``reader``: HardSwish, HardSigmoid (alpha 0.2, beta 0.5) or Clip [-1, 2]."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 2.0, (4, 3, 3, 3)).astype(np.float32)
    b = np.full(4, -4.0, np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    if reader == "Clip":
        inits += [numpy_helper.from_array(np.array(-1.0, np.float32), "lo"),
                  numpy_helper.from_array(np.array(2.0, np.float32), "hi")]
        last = helper.make_node("Clip", ["c", "lo", "hi"], ["y"], name="act")
    elif reader == "HardSigmoid":
        last = helper.make_node("HardSigmoid", ["c"], ["y"], name="act", alpha=0.2, beta=0.5)
    else:
        last = helper.make_node(reader, ["c"], ["y"], name="act")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]), last]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["c"], ["r"], name="relu"))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", 4, 8, 8]))
    graph = helper.make_graph(nodes, "flat", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              outputs, inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def data(path, n, seed):
    np.savez(path, x=np.random.default_rng(seed).normal(0, 1.0, (n, 3, 8, 8)).astype(np.float32))
    return path


def _qparams(qmodel, tensor):
    """(S, Z, qmin, qmax) of the QuantizeLinear of ``tensor``."""
    inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
    q = next(n for n in qmodel.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    zero = inits[q.input[2]]
    return float(inits[q.input[1]]), int(zero), int(np.iinfo(zero.dtype).min), int(np.iinfo(zero.dtype).max)


@pytest.mark.parametrize("reader, bounds", [("HardSwish", (-3.0, np.inf)), ("HardSigmoid", (-2.5, 2.5)),
                                            ("Clip", (-1.0, 2.0))])
def test_the_range_is_cut_where_the_reader_stops_changing(tmp_path, reader, bounds):
    path = model(tmp_path / "m.onnx", reader)
    table = calibrate(path, data(tmp_path / "fit.npz", 32, 1), progress=False)
    e = table.tensors["c"]
    assert e.min < bounds[0] - 5 and e.max > 5  # calibrated far beyond the bounds
    qmodel, _ = quantize(path, table, QuantizeOptions())
    lo, hi = max(e.min, bounds[0]), min(e.max, bounds[1])
    margin = (hi - lo) / 500
    lo, hi = lo - margin, hi + (margin if hi < e.max else 0)
    scale, zero, qmin, qmax = _qparams(qmodel, "c")
    assert scale == pytest.approx((hi - lo) / 255, rel=1e-3)
    # the lowest (and for two bounds the highest) level dequantizes at or beyond the bound
    assert scale * (qmin - zero) <= bounds[0]
    if np.isfinite(bounds[1]):
        assert scale * (qmax - zero) >= bounds[1]
    onnx.save(qmodel, tmp_path / "q.onnx")
    held = data(tmp_path / "held.npz", 16, 2)
    report = verify(path, tmp_path / "q.onnx", held, progress=False)
    cut_db = report.outputs[0].sqnr
    c = next(t for t in report.tensors if t.name == "c")
    assert c.cut == pytest.approx(bounds)
    assert c.sqnr > 30  # compared within the bounds; the values beyond them were clipped on purpose

    # another reader: the calibrated range, and a worse output
    other = model(tmp_path / "other.onnx", reader, extra_reader=True)
    table2 = calibrate(other, data(tmp_path / "fit2.npz", 32, 1), progress=False)
    qother, _ = quantize(other, table2, QuantizeOptions())
    e2 = table2.tensors["c"]
    assert _qparams(qother, "c")[0] == pytest.approx((e2.max - e2.min) / 255, rel=1e-3)
    onnx.save(qother, tmp_path / "other.q.onnx")
    whole = verify(other, tmp_path / "other.q.onnx", held, progress=False)
    assert next(t for t in whole.tensors if t.name == "c").cut is None
    assert cut_db > whole.outputs[0].sqnr + 1, (cut_db, whole.outputs[0].sqnr)


def test_verify_says_how_it_compared_a_cut_tensor(tmp_path):
    path = model(tmp_path / "m.onnx", "HardSwish")
    fit = data(tmp_path / "fit.npz", 16, 1)
    runner = CliRunner()
    assert runner.invoke(app, ["calibrate", str(path), "--data", str(fit), "-o", str(tmp_path / "t.yaml"),
                               "-q"]).exit_code == 0
    assert runner.invoke(app, ["quantize", str(path), "-t", str(tmp_path / "t.yaml"), "-o",
                               str(tmp_path / "q.onnx"), "-q"]).exit_code == 0
    text = runner.invoke(app, ["verify", str(path), str(tmp_path / "q.onnx"), "--data", str(fit)])
    assert text.exit_code in (0, 1)
    assert "Conv+flat" in text.output and "(+flat: " in text.output
    result = runner.invoke(app, ["verify", str(path), str(tmp_path / "q.onnx"), "--data", str(fit), "--json", "-q"])
    c = next(t for t in json.loads(result.stdout)["tensors"] if t["name"] == "c")
    assert c["compared_within"] == [-3.0, "inf"]


def test_flat_bounds_of_each_op_and_of_mixed_readers():
    def node(op, inputs=("c",), **attrs):
        return helper.make_node(op, list(inputs), ["y"], **attrs)

    consts = {"lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32), "v": np.zeros(2, np.float32)}
    assert flat_bounds(node("HardSigmoid", alpha=1 / 6, beta=0.5), consts.get) == pytest.approx((-3, 3))
    assert flat_bounds(node("Clip", ("c", "lo", "hi")), consts.get) == (0.0, 6.0)
    assert flat_bounds(node("Clip", ("c", "", "hi")), consts.get) == (-np.inf, 6.0)
    assert flat_bounds(node("Clip", ("c", "computed")), consts.get) is None  # not a constant
    assert flat_bounds(node("Clip", ("c", "v")), consts.get) is None  # not a scalar
    assert flat_bounds(node("Clip", min=-1.0, max=1.0), consts.get) == (-1.0, 1.0)  # opset 6 attributes
    assert flat_bounds(node("Sigmoid"), consts.get) is None
    swish, clip = node("HardSwish"), node("Clip", ("c", "lo", "hi"))
    assert readers_cut("c", [(swish, ["c"]), (clip, ["c", "lo", "hi"])], consts.get) == (-3.0, np.inf)  # widest
    assert readers_cut("c", [(swish, ["c"]), (node("Relu"), ["c"])], consts.get) is None
    assert readers_cut("c", [(node("Clip", ("lo", "c")), ["lo", "c"])], consts.get) is None  # c is a bound
    assert readers_cut("c", [], consts.get) is None


def test_a_channel_wholly_beyond_the_cut_keeps_a_step_at_the_cut(tmp_path):
    """Per-channel ranges (qtool/channels.py) are put inside the tensor's range: a channel whose
    values all lie above the cut used to get an inverted range and a scale of 1e-8."""
    path = model(tmp_path / "m.onnx", "HardSigmoid")
    table = calibrate(path, data(tmp_path / "fit.npz", 32, 1), progress=False)
    e = table.tensors["c"]
    ranges = {"c": (np.array([3.5, e.min, -1.0, e.min]), np.array([8.0, -4.0, 1.0, e.max]))}
    qmodel, _ = quantize(path, table, QuantizeOptions(), channel_ranges=ranges)
    inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
    q = next(n for n in qmodel.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "c")
    scale, zero = inits[q.input[1]].astype(np.float64), inits[q.input[2]]
    info = np.iinfo(zero.dtype)
    zero = zero.astype(np.int64)
    assert scale.shape == (4,) and scale.min() > 1e-3
    low, high = scale * (info.min - zero), scale * (info.max - zero)
    assert high[0] >= 2.5 and low[1] <= -2.5  # the channels beyond the cut reach it
    assert np.all(low <= 0) and np.all(high >= 0)


def test_int16_activations_keep_the_calibrated_range(tmp_path):
    """At int16 the steps are fine already: no cut, and verify compares the whole tensor."""
    path = model(tmp_path / "m.onnx", "HardSwish")
    table = calibrate(path, data(tmp_path / "fit.npz", 32, 1), progress=False)
    e = table.tensors["c"]
    qmodel, _ = quantize(path, table, QuantizeOptions(activation_type="int16"))
    scale, zero, _, qmax = _qparams(qmodel, "c")
    assert zero == 0 and scale == pytest.approx(max(-e.min, e.max) / qmax, rel=1e-6)
    onnx.save(qmodel, tmp_path / "q.onnx")
    report = verify(path, tmp_path / "q.onnx", data(tmp_path / "held.npz", 8, 2), progress=False)
    assert next(t for t in report.tensors if t.name == "c").cut is None


def test_verify_finds_the_cut_in_a_qoperator_model(tmp_path):
    """QOperator writes the HardSwish as a lookup Gather: verify finds the cut from the float
    model's readers, and compares the Conv's output within it."""
    path = model(tmp_path / "m.onnx", "HardSwish")
    table = calibrate(path, data(tmp_path / "fit.npz", 32, 1), progress=False)
    qmodel, _ = quantize(path, table, QuantizeOptions(format="qoperator"))
    assert "HardSwish" not in {n.op_type for n in qmodel.graph.node}
    onnx.save(qmodel, tmp_path / "q.onnx")
    report = verify(path, tmp_path / "q.onnx", data(tmp_path / "held.npz", 16, 2), progress=False)
    c = next(t for t in report.tensors if t.name == "c")
    assert c.cut == (-3.0, np.inf) and c.sqnr > 30
