"""16-bit weights (``quantize --activation-type int16 --weight-type int16``): the weights of Conv,
ConvTranspose, MatMul and Gemm stored int16 per channel, behind standard DequantizeLinear; the
executor's exact 64-bit sums against onnxruntime running the model as written; a smaller error
than int8 weights on samples the table was not made on; the refusals."""

import json
from functools import partial

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.executor import IntegerExecutor
from qtool.quantize import WIDE_WEIGHT_OPS, QuantizeOptions, quantize
from qtool.verify import verify
from graphs import fit_and_held, normal_samples, saved_model
from test_cli import assert_user_error, invoke


def backbone(path, seed=0):
    """Conv (16 input channels: 16x16 sums leave int32) -> HardSwish -> depthwise Conv ->
    ConvTranspose (stride 2) -> GlobalAveragePool -> Flatten -> Gemm -> MatMul, opset 17."""
    rng = np.random.default_rng(seed)
    arrays = {"w0": rng.normal(0, 0.3, (8, 16, 3, 3)), "b0": rng.normal(0, 0.2, 8),
              "dw": rng.normal(0, 1.0, (8, 1, 3, 3)), "db": rng.normal(0, 0.1, 8),
              "wt": rng.normal(0, 0.3, (8, 4, 2, 2)), "bt": rng.normal(0, 0.1, 4),
              "wg": rng.normal(0, 0.5, (6, 4)), "bg": rng.normal(0, 0.1, 6), "wm": rng.normal(0, 0.5, (6, 5))}
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in arrays.items()]
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["a"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("HardSwish", ["a"], ["b"], name="hs"),
             helper.make_node("Conv", ["b", "dw", "db"], ["c"], name="dwconv", pads=[1, 1, 1, 1], group=8),
             helper.make_node("ConvTranspose", ["c", "wt", "bt"], ["d"], name="up", strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["d"], ["e"], name="gap"),
             helper.make_node("Flatten", ["e"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "wg", "bg"], ["g"], name="gemm", transB=1),
             helper.make_node("MatMul", ["g", "wm"], ["y"], name="mm")]
    return saved_model(path, "backbone", nodes, inits, {"x": ["N", 16, 8, 8]},
                       {"d": ["N", 4, 16, 16], "y": ["N", 5]})


samples = partial(normal_samples, shape=(16, 8, 8))  # samples(path, n, seed)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wide_weights")
    model = backbone(folder / "backbone.onnx")
    return (folder, model, *fit_and_held(folder, model, samples))


def _weight_types(qmodel) -> dict[str, str]:
    """node -> the stored type of its weight input (the initializer behind its DequantizeLinear)."""
    inits = {i.name: i for i in qmodel.graph.initializer}
    producer = {o: n for n in qmodel.graph.node for o in n.output}
    found = {}
    for node in qmodel.graph.node:
        if node.op_type in WIDE_WEIGHT_OPS:
            dq = producer[node.input[1]]
            found[node.name] = TensorProto.DataType.Name(inits[dq.input[0]].data_type)
    return found


def test_the_weights_are_int16_and_the_executor_agrees_with_onnxruntime(made):
    folder, model, data, held, table = made
    options = QuantizeOptions(activation_type="int16", weight_type="int16")
    qmodel, report = quantize(model, table, options)
    assert _weight_types(qmodel) == {n: "INT16" for n in ("conv", "dwconv", "up", "gemm", "mm")}
    assert report.opset == 17  # no upgrade: below opset 21 the int16 DequantizeLinear is com.microsoft's
    narrow, _ = quantize(model, table, QuantizeOptions(activation_type="int16"))
    assert set(_weight_types(narrow).values()) <= {"INT8", "UINT8"}  # 8-bit: the default
    path = folder / "q16.onnx"
    onnx.save(qmodel, path)
    x = np.load(held)["x"]
    mine = IntegerExecutor(onnx.load(path)).run({"x": x}).outputs["y"]
    options_ort = ort.SessionOptions()
    options_ort.add_session_config_entry("session.disable_quant_qdq", "1")
    theirs = ort.InferenceSession(str(path), options_ort, providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
    step = float(np.abs(theirs).max()) / 32767  # the output's int16 step, about
    diff = np.rint(np.abs(mine.astype(np.float64) - theirs.astype(np.float64)) / step)
    # onnxruntime sums float32 products of dequantized values; the executor sums the integers
    assert diff.max() <= 4 and (diff <= 1).mean() >= 0.95, (diff.max(), (diff <= 1).mean())


def test_int16_weights_verify_closer_to_float(made):
    folder, model, data, held, table = made
    scores = {}
    for weights in ("int8", "int16"):
        qmodel, _ = quantize(model, table, QuantizeOptions(activation_type="int16", weight_type=weights))
        onnx.save(qmodel, folder / f"w_{weights}.onnx")
        checked = verify(model, folder / f"w_{weights}.onnx", held, progress=False)
        scores[weights] = checked.outputs[0].sqnr  # the ConvTranspose's output: no range to exceed
    assert scores["int16"] > scores["int8"] + 10, scores


def test_cli_writes_16x16(made):
    folder, model, data, held, _ = made
    table = folder / "t.yaml"
    assert invoke("calibrate", model, "--data", data, "-o", table, "-q").exit_code == 0
    out = folder / "cli16.onnx"
    result = invoke("quantize", model, "-t", table, "-o", out, "--activation-type", "int16", "--weight-type", "int16",
                    "--data", data, "-q")
    assert result.exit_code == 0, result.output
    assert set(_weight_types(onnx.load(out)).values()) == {"INT16"}
    checked = invoke("verify", model, out, "--data", held, "-q")
    assert checked.exit_code == 0, checked.output


@pytest.mark.parametrize("args,fragments", [
    (("--weight-type", "int16"), ("--weight-type int16 goes with --activation-type int16",)),
    (("--weight-type", "int16", "--activation-type", "int16", "--block-size", "32"),
     ("--block-size is for int8 and int4 weights",)),
])
def test_refusals(made, args, fragments):
    folder, model, data, _, _ = made
    table = folder / "t_refusals.yaml"
    assert invoke("calibrate", model, "--data", data, "-o", table, "-q").exit_code == 0
    out = folder / "refused.onnx"
    assert_user_error(invoke("quantize", model, "-t", table, "-o", out, *args), *fragments)
    assert not out.exists()


def test_a_failing_int16_model_points_to_int16_weights(made):
    folder, model, data, held, _ = made
    table = folder / "t_steps.yaml"
    assert invoke("calibrate", model, "--data", data, "-o", table, "-q").exit_code == 0
    strict = ("--tolerance", "0.99999,90", "--json", "-q")
    steps = {}
    for weights in ("int8", "int16"):
        out = folder / f"steps_{weights}.onnx"
        assert invoke("quantize", model, "-t", table, "-o", out, "--activation-type", "int16",
                      "--weight-type", weights, "-q").exit_code == 0
        result = invoke("verify", model, out, "--data", held, *strict)
        assert result.exit_code == 1, result.output
        steps[weights] = " ".join(json.loads(result.stdout)["next_steps"])
    assert "--weight-type int16" in steps["int8"]
    assert "--weight-type int16" not in steps["int16"] and "qtool analyze" in steps["int16"]
