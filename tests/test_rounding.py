"""Weight rounding fitted to the layer's inputs (qtool/rounding.py, GPTQ's closed form): nearest
rounding where inputs are uncorrelated, a smaller layer-output error where they are correlated,
the same integers every run; in quantize --data a judged step whose model verifies; the CLI's
refusal."""

import json

import numpy as np
import onnx

from qtool.calibrate import calibrate
from qtool.qparams import per_channel_symmetric
from qtool.quantize import QuantizeOptions, quantize
from qtool.rounding import GAIN_DB, fit, gptq, layers
from qtool.verify import verify
from test_cli import assert_user_error, invoke
from test_placement import samples, transformer

RNG = np.random.default_rng(7)


def _nearest(w, scale):
    return np.clip(np.rint(w / scale), -128, 127)


def test_uncorrelated_inputs_give_nearest_rounding():
    w = RNG.normal(0, 1, (24, 6))
    scale = per_channel_symmetric(w, 1).scale.astype(np.float64)
    gram = np.diag(RNG.uniform(0.5, 2.0, 24))  # independent inputs: no error to move elsewhere
    np.testing.assert_array_equal(gptq(w, scale, gram), _nearest(w, scale))


def test_correlated_inputs_lower_the_layer_output_error():
    k, n = 64, 16
    mixing = RNG.normal(0, 1, (k, k)) * 0.3 + np.eye(k)
    x = RNG.normal(0, 1, (2000, k)) @ mixing  # correlated inputs, as a layer's are
    w = RNG.normal(0, 1, (k, n))
    scale = per_channel_symmetric(w, 1).scale.astype(np.float64)
    fitted = gptq(w, scale, x[:1000].T @ x[:1000])
    assert fitted.min() >= -128 and fitted.max() <= 127
    np.testing.assert_array_equal(fitted, gptq(w, scale, x[:1000].T @ x[:1000]))  # reproducible

    def error(q):  # on inputs it was not fitted on
        return float(np.sum((x[1000:] @ w - x[1000:] @ (q * scale)) ** 2))
    assert error(fitted) < 0.8 * error(_nearest(w, scale))


def test_an_input_that_is_always_zero_is_harmless():
    w = RNG.normal(0, 1, (8, 3))
    x = RNG.normal(0, 1, (100, 8))
    x[:, 2] = 0.0
    q = gptq(w, per_channel_symmetric(w, 1).scale, x.T @ x)
    assert q[2].tolist() == [0, 0, 0] and np.isfinite(q).all()


def test_quantize_data_fits_judges_and_verifies(tmp_path):
    model = transformer(tmp_path / "block.onnx", outlier=1.0)
    data, held = samples(tmp_path / "data.npz", 32, 1), samples(tmp_path / "held.npz", 16, 2)
    table = calibrate(model, data, progress=False)
    options = QuantizeOptions(activation_type="int16")
    assert len(layers(onnx.load(model))) == 12  # q, k, v, o, ff1, ff2 in two layers
    rounded, pick = fit(model, table, options, "t", data, progress=False)
    assert pick.layers == 12 and pick.heldout == 16 and pick.fit_samples == 16
    assert pick.after_db > pick.before_db, pick.to_dict()  # correlated inputs after LayerNorm
    assert pick.kept == (pick.after_db >= pick.before_db + GAIN_DB) and pick.kept  # 42.2 -> 43.0 dB
    plain, _ = quantize(model, table, options)
    fitted, _ = quantize(model, table, options, "t", None, rounded)
    changed = [i.name for i, j in zip(plain.graph.initializer, fitted.graph.initializer)
               if i.name == j.name and i.raw_data != j.raw_data]
    assert changed and all(name.endswith("_quantized") for name in changed)  # only weight integers
    scales = {i.name: i.raw_data for i in plain.graph.initializer if i.name.endswith("_scale")}
    assert all(scales[i.name] == i.raw_data for i in fitted.graph.initializer if i.name in scales)
    reports = {}
    for name, q in (("plain", plain), ("fitted", fitted)):
        onnx.save(q, tmp_path / f"{name}.onnx")
        reports[name] = verify(model, tmp_path / f"{name}.onnx", held, progress=False)
    assert reports["fitted"].float_nodes == reports["plain"].float_nodes
    assert reports["fitted"].outputs[0].sqnr > reports["plain"].outputs[0].sqnr


def test_cli_reports_weight_rounding_and_refuses_it_without_data(tmp_path):
    model = transformer(tmp_path / "block.onnx")
    data = samples(tmp_path / "data.npz", 32, 1)
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", model, "--data", data, "-o", table, "-q").exit_code == 0
    result = invoke("quantize", model, "-t", table, "-o", tmp_path / "q.onnx", "--data", data, "--json", "-q")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["weight_rounding"]["layers"] == 12
    off = invoke("quantize", model, "-t", table, "-o", tmp_path / "q.onnx", "--data", data, "--json", "-q",
                 "--no-weight-rounding")
    assert off.exit_code == 0 and "weight_rounding" not in json.loads(off.stdout)
    assert_user_error(invoke("quantize", model, "-t", table, "-o", tmp_path / "q2.onnx", "--weight-rounding"),
                      "--weight-rounding needs samples", "--data")
    assert not (tmp_path / "q2.onnx").exists()
