"""quantize.keeping_candidates: inside quantize --data, a scored-only build asked for again with
arguments of the same content is handed out as a copy of the first, not built again."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx

from qtool import quantize as quantize_module
from qtool.quantize import QuantizeOptions, keeping_candidates, quantize
from qtool.table import TensorEntry


def _counting(monkeypatch) -> list:
    builds = []
    original = quantize_module._quantize
    monkeypatch.setattr(quantize_module, "_quantize", lambda *a: builds.append(1) or original(*a))
    return builds


def test_the_same_candidate_is_built_once_and_handed_out_as_copies(demo_model, demo_table, monkeypatch):
    builds = _counting(monkeypatch)
    quantize(demo_model, demo_table, scored_only=True)
    quantize(demo_model, demo_table, scored_only=True)
    assert len(builds) == 2  # nothing kept outside the context
    with keeping_candidates():
        first, report = quantize(demo_model, demo_table, scored_only=True)
        first_bytes = first.SerializeToString()
        first.graph.node.pop()  # a caller's change to its copy
        report.warnings.append("changed")
        again, again_report = quantize(demo_model, demo_table, scored_only=True)
        assert len(builds) == 3
        assert again.SerializeToString() == first_bytes and "changed" not in again_report.warnings
        # the same content in other objects is the same candidate
        table = replace(demo_table, tensors=dict(demo_table.tensors))
        quantize(demo_model, table, QuantizeOptions(), scored_only=True)
        assert len(builds) == 3
        # any other content is another one: a table entry, an option, a bias shift
        name = next(iter(table.tensors))
        entry = table.tensors[name]
        table.tensors[name] = TensorEntry(entry.min, entry.max * 1.5, entry.threshold, entry.method)
        wider = quantize(demo_model, table, scored_only=True)[0]
        quantize(demo_model, demo_table, QuantizeOptions(symmetric=True), scored_only=True)
        float_model = onnx.load(str(demo_model))
        conv = next(n for n in float_model.graph.node if n.op_type == "Conv")
        channels = next(t.dims[0] for t in float_model.graph.initializer if t.name == conv.input[1])
        for shift in (1e-3, 2e-3):
            quantize(demo_model, demo_table, bias_corrections={conv.name: np.full(channels, shift, np.float32)},
                     scored_only=True)
        assert len(builds) == 7 and wider.SerializeToString() != first_bytes
        # a model to write is never kept
        quantize(demo_model, demo_table)
        quantize(demo_model, demo_table)
        assert len(builds) == 9
    assert quantize_module._CANDIDATES is None


def test_a_candidate_asked_for_again_is_kept_before_the_others(demo_model, demo_table, monkeypatch):
    # the judged steps' pattern: a step's base, its candidates, the next step's base again
    builds = _counting(monkeypatch)
    monkeypatch.setattr(quantize_module, "KEPT_CANDIDATES", 2)
    base, first, *others = [QuantizeOptions(), QuantizeOptions(symmetric=True), QuantizeOptions(per_channel=False),
                            QuantizeOptions(symmetric=True, per_channel=False)]
    with keeping_candidates():
        for options in (base, first, base):
            quantize(demo_model, demo_table, options, scored_only=True)
        assert len(builds) == 2
        for options in others:  # each new one takes the place of the last one not asked for again
            quantize(demo_model, demo_table, options, scored_only=True)
        assert len(builds) == 4 and len(quantize_module._CANDIDATES) == 2
        quantize(demo_model, demo_table, base, scored_only=True)
        quantize(demo_model, demo_table, others[-1], scored_only=True)
        assert len(builds) == 4
        quantize(demo_model, demo_table, first, scored_only=True)  # gone
        assert len(builds) == 5


def test_weights_rounded_once_give_the_bytes_of_fresh_builds(demo_model, demo_table, monkeypatch):
    # inside keeping_candidates each weight's nearest integers are kept by the model's digest, the
    # pixel folding (which changes the first weights), the opset and the weight's (S, Z): builds
    # that differ in anything else reuse them, and every build is the bytes of a fresh one
    from qtool.pixels import PixelInput

    options = [QuantizeOptions(), QuantizeOptions(symmetric=True), QuantizeOptions(per_channel=False),
               QuantizeOptions(input_pixels=PixelInput((0.5,), (0.25,), 1 / 255)), QuantizeOptions(weight_type="int4"),
               QuantizeOptions(symmetric=True, rounding="half_to_even")]
    fresh = [quantize(demo_model, demo_table, o, scored_only=True)[0].SerializeToString() for o in options]
    rounded = []  # per build, how many weights (arrays of two or more axes) quantize_array rounded
    original = quantize_module.quantize_array
    monkeypatch.setattr(quantize_module, "quantize_array",
                        lambda x, qp: rounded.__setitem__(-1, rounded[-1] + (np.ndim(x) > 1)) or original(x, qp))
    with keeping_candidates():
        kept = []
        for o in options:
            rounded.append(0)
            kept.append(quantize(demo_model, demo_table, o, scored_only=True)[0].SerializeToString())
    assert kept == fresh
    assert rounded[0] > 0 and rounded[2] > 0  # the first build, and weights per tensor: new scales
    assert rounded[1] == rounded[5] == 0  # activation options only: every weight's integers kept
    assert rounded[3] == rounded[0]  # pixels folded into the weights: another model, rounded anew
