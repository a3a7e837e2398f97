"""The judge (``analyze.Evaluator``) scores a Sigmoid output on its logits, within the window where
the float probability still moves by a quarter of an 8-bit step (``sigmoid_window``): quantize cuts
an 8-bit Sigmoid input there (``_saturated_input``), and a text detector's map of mostly deep
background logits (-30) scored whole read 1.3 dB for every candidate, so that its judged steps
chose at random."""

import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.analyze import Evaluator, sigmoid_window


def sigmoid_map(clip: tuple[float, float] | None = None, shift: float = 0.0):
    """x -> Conv 1x1 (logits about -12 + 4x: mostly far below 0) [-> Clip] [+ shift] -> Sigmoid."""
    w = numpy_helper.from_array(np.full((1, 1, 1, 1), 4.0, np.float32), "w")
    b = numpy_helper.from_array(np.array([-12.0], np.float32), "b")
    inits, nodes, t = [w, b], [helper.make_node("Conv", ["x", "w", "b"], ["logits"], name="conv")], "logits"
    if clip is not None:
        inits += [numpy_helper.from_array(np.array(v, np.float32), n) for v, n in zip(clip, ("lo", "hi"))]
        nodes.append(helper.make_node("Clip", [t, "lo", "hi"], ["clipped"], name="clip"))
        t = "clipped"
    if shift:
        inits.append(numpy_helper.from_array(np.array(shift, np.float32), "shift"))
        nodes.append(helper.make_node("Add", [t, "shift"], ["shifted"], name="add"))
        t = "shifted"
    nodes.append(helper.make_node("Sigmoid", [t], ["p"], name="sigmoid"))
    graph = helper.make_graph(nodes, "map", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8])],
                              [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 1, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_window_is_where_the_probability_moves():
    lo, hi = sigmoid_window([np.array([-30.0, 0.0]), np.array([3.0])])
    y_lo, y_hi = 1 / (1 + math.exp(30)), 1 / (1 + math.exp(-3))
    step = (y_hi - y_lo) / 255
    assert 1 / (1 + math.exp(-lo)) == pytest.approx(y_lo + step / 4)
    assert 1 / (1 + math.exp(-hi)) == pytest.approx(y_hi - step / 4)
    assert -8 < lo < -6 and 2.5 < hi < 3
    assert sigmoid_window([np.full(4, 2.0)]) is None  # one value: no range
    assert sigmoid_window([np.zeros(0)]) is None


def test_logits_cut_outside_the_window_score_as_float_and_inside_it_do_not():
    x = np.random.default_rng(0).normal(0, 1.5, (16, 1, 8, 8)).astype(np.float32)
    batches = [{"x": x[:8]}, {"x": x[8:]}]
    judge = Evaluator(sigmoid_map(), batches)
    logits = -12 + 4 * x.astype(np.float64)
    lo, hi = judge.windows[0]
    assert logits.min() < lo - 10  # most of the map is deep background
    # cut where the probability has stopped moving: nothing the output could show
    assert judge.sqnr(sigmoid_map(clip=(lo - 0.01, hi + 0.01))) == math.inf
    # cut inside the window, or moved: scored
    inside = judge.sqnr(sigmoid_map(clip=(lo + 1.0, hi + 0.01)))
    assert 0 < inside < 40
    assert judge.sqnr(sigmoid_map(shift=0.05)) < judge.sqnr(sigmoid_map(shift=0.01)) < math.inf
    # scored whole, the cut logits would read low whatever the candidate did inside the window
    whole = 10 * math.log10((logits ** 2).sum() / ((logits - np.clip(logits, lo - 0.01, hi + 0.01)) ** 2).sum())
    assert whole < 15
