"""A tensor read only by Sigmoid or Tanh gets the input range where their output still changes
(qtool/quantize.py ``_saturated_input``): a class score's logits reach -20 where its probability
is 0 to eight bits, so their steps are spent where the probability moves. The output is the same
or better, never worse, and a tensor with any other reader keeps its calibrated range."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.calibrate import calibrate
from qtool.quantize import QuantizeOptions, quantize
from qtool.verify import verify


def head(path, extra_reader=False):
    """x -> Conv (logits mostly far below 0, a few near it) -> Sigmoid [-> and a Relu of the logits]."""
    w = np.zeros((4, 3, 1, 1), np.float32)
    w[:, 0, 0, 0] = [3.5, 3.0, 3.2, 3.4]  # logits -12 + 3.5 x: about [-26, 2] for x ~ N(0, 1)
    b = np.full(4, -12.0, np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["logits"], name="conv"),
             helper.make_node("Sigmoid", ["logits"], ["p"], name="sigmoid")]
    outputs = [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 4, 8, 8])]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["logits"], ["r"], name="relu"))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", 4, 8, 8]))
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              outputs, [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def data(path, n, seed):
    x = np.random.default_rng(seed).normal(0, 1.0, (n, 3, 8, 8)).astype(np.float32)
    np.savez(path, x=x)
    return path


def _scale(qmodel, tensor):
    inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
    return float(next(inits[n.input[1]] for n in qmodel.graph.node  # a graph output's Q reads NAME_float
                      if n.op_type == "QuantizeLinear" and n.input[0] in (tensor, f"{tensor}_float")))


def test_logits_get_the_steps_where_the_probability_moves(tmp_path):
    model = head(tmp_path / "head.onnx")
    table = calibrate(model, data(tmp_path / "fit.npz", 32, 1), progress=False)
    entry, out = table.tensors["logits"], table.tensors["p"]
    assert entry.min < -20 and out.max < 0.999  # the sigmoid is flat over most of the logits' range
    qmodel, _ = quantize(model, table, QuantizeOptions())
    full_step = (max(entry.max, 0) - entry.min) / 255
    quarter = _scale(qmodel, "p") / 4  # within a quarter step of the output's ends, it does not move

    def logit(p):
        return np.log(p / (1 - p))
    lo, hi = logit(out.min + quarter), min(entry.max, logit(out.max - quarter))
    assert _scale(qmodel, "logits") < 0.6 * full_step
    assert abs(_scale(qmodel, "logits") - (max(hi, 0) - lo) / 255) < 1e-3 * full_step
    onnx.save(qmodel, tmp_path / "cut.onnx")
    held = data(tmp_path / "held.npz", 16, 2)
    report = verify(model, tmp_path / "cut.onnx", held, progress=False)
    cut_db = report.outputs[0].sqnr
    # verify compares the logits within the window, from the output's 8-bit levels (qtool/ops/flat.py)
    logits = next(t for t in report.tensors if t.name == "logits")
    assert logits.cut is not None
    assert abs(logits.cut[0] - lo) < 0.05 * (hi - lo) and logits.cut[1] > hi - 0.05 * (hi - lo)
    assert logits.sqnr > 25

    # the same model where the logits have another reader: the calibrated range, as before
    other = head(tmp_path / "other.onnx", extra_reader=True)
    table2 = calibrate(other, data(tmp_path / "fit2.npz", 32, 1), progress=False)
    qother, _ = quantize(other, table2, QuantizeOptions())
    e2 = table2.tensors["logits"]
    assert abs(_scale(qother, "logits") - (max(e2.max, 0) - e2.min) / 255) < 1e-3 * full_step
    onnx.save(qother, tmp_path / "other.q.onnx")
    whole_db = verify(other, tmp_path / "other.q.onnx", held, progress=False).outputs[0].sqnr
    assert cut_db > whole_db + 1, (cut_db, whole_db)  # the probabilities, from finer logits: 34.0 vs 31.7 dB
