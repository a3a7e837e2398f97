"""Targets (qtool/targets): the portable form, the x86-avx2 arithmetic, the hazard listing.

The emulation is checked on every host against a brute-force reference written here (explicit
loops over output positions, the NHWC tap-major K order, int16 pair saturation). Its comparison
with onnxruntime itself needs an AVX2 CPU without VNNI: this host if it is one (a probe tells),
else the same CPU emulated by qemu-x86_64 when installed (.ci/run installs it), else only that
part is not run.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.executor import IntegerExecutor
from qtool.fixedpoint import quantize_multipliers
from qtool.ops.conv import ConvParams
from qtool.ops.gemm import MatMulParams
from qtool.quantize import QuantizeOptions, quantize
from qtool.targets import x86
from test_cli import assert_no_crash, assert_user_error, invoke

RNG = np.random.default_rng(13)


# -- the arithmetic, by hand and against a brute-force reference --------------------------------
def test_a_pair_beyond_int16_saturates_and_opposite_signs_cannot():
    a = np.array([[255, 255, 255, 255, 200]], np.uint8)  # K = 5: padded with a zero to 6
    w = np.array([[127], [127], [127], [-128], [100]], np.int8)
    # pairs: 255·127·2 = 64770 -> 32767; 255·127 − 255·128 = −255 (exact); 200·100 = 20000
    assert x86.saturation_loss(a, w)[0, 0] == 32767 - 64770
    assert x86.risky_pairs(w).tolist() == [[True], [False], [False]]


def _sat16(v: int) -> int:
    return max(-32768, min(32767, v))


def _conv_reference(x_raw, weight, pads, strides, dilations, group, pad_raw):
    """Pair-saturating conv accumulator, one output element at a time (raw bytes in)."""
    n, c, h, w = x_raw.shape
    c_out, c_g, kh, kw = weight.shape
    top, left, bottom, right = pads
    x = np.pad(x_raw.astype(np.int64), ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=pad_raw)
    out_h = (x.shape[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    out_w = (x.shape[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    per = c_out // group
    depthwise = c_g == 1 and c_out == group
    acc = np.zeros((n, c_out, out_h, out_w), np.int64)
    for b in range(n):
        for o in range(c_out):
            g = o // per
            for i in range(out_h):
                for j in range(out_w):
                    a, k = [], []
                    for ti in range(kh):
                        for tj in range(kw):
                            for ci in range(c_g):  # channels inner: NHWC im2col
                                a.append(int(x[b, g * c_g + ci, i * strides[0] + ti * dilations[0],
                                               j * strides[1] + tj * dilations[1]]))
                                k.append(int(weight[o, ci, ti, tj]))
                    if depthwise:
                        acc[b, o, i, j] = sum(p * q for p, q in zip(a, k))
                        continue
                    a, k = a + [0], k + [0]
                    acc[b, o, i, j] = sum(_sat16(a[t] * k[t] + a[t + 1] * k[t + 1])
                                          for t in range(0, len(a) - 1, 2))
    return acc


def _identity_requant(channels):
    return quantize_multipliers(np.ones(channels), 32)


@pytest.mark.parametrize("c_in, c_out, group, pads, strides, dilations", [
    (3, 4, 1, (1, 1, 1, 1), (1, 1), (1, 1)),  # odd channels: pairs cross taps
    (4, 6, 1, (0, 1, 2, 0), (2, 1), (1, 1)),
    (5, 4, 1, (1, 1, 1, 1), (1, 2), (2, 1)),
    (6, 4, 2, (1, 1, 1, 1), (1, 1), (1, 1)),  # grouped, 3 channels a group
    (4, 8, 4, (1, 1, 1, 1), (1, 1), (1, 1)),  # channel multiplier 2: saturates
    (4, 4, 4, (1, 1, 1, 1), (1, 1), (1, 1)),  # depthwise: exact
    (1, 5, 1, (1, 1, 1, 1), (1, 1), (1, 1)),  # one input channel, dense: saturates
])
@pytest.mark.parametrize("dtype, offset", [("int8", 128), ("uint8", 0)])
def test_conv_emulation_matches_the_reference(c_in, c_out, group, pads, strides, dilations, dtype, offset):
    info = np.iinfo(dtype)
    x = RNG.integers(info.max - 40, info.max + 1, (2, c_in, 5, 6)).astype(dtype)  # large bytes
    weight = RNG.integers(-128, 128, (c_out, c_in // group, 3, 3)).astype(np.int8)
    zero_in = int(info.min) + 7
    params = ConvParams(weight, np.zeros(c_out, np.int64), _identity_requant(c_out), zero_in, 0, pads,
                        strides, dilations, group, "half_up", "int32")
    got = x86.PairSaturating(offset, x86.weight_risk(params)).run(params, x)
    raw = x.astype(np.int64) + offset
    want = _conv_reference(raw, weight, pads, strides, dilations, group, zero_in + offset)
    # with a zero bias the kernel sums q·w = (raw − offset)·w over the whole window
    want = want - offset * weight.astype(np.int64).sum(axis=(1, 2, 3))[None, :, None, None]
    assert np.array_equal(got, want)
    if not (c_in // group == 1 and c_out == group):  # the inputs were chosen so that saturation shows
        assert any(risky.any() for _, risky in x86.weight_risk(params))


def test_matmul_emulation_matches_the_reference():
    x = RNG.integers(60, 128, (3, 4, 9)).astype(np.int8)
    w = RNG.integers(-128, 128, (9, 5)).astype(np.int8)
    params = MatMulParams(w, np.zeros(5, np.int64), _identity_requant(5), 0, "half_up", "int32")
    got = x86.PairSaturating(128, x86.weight_risk(params)).run(params, x)
    raw = np.concatenate([x.reshape(-1, 9).astype(np.int64) + 128, np.zeros((12, 1), np.int64)], 1)
    wk = np.concatenate([w.astype(np.int64), np.zeros((1, 5), np.int64)])
    want = np.array([[sum(_sat16(r[t] * wk[t, c] + r[t + 1] * wk[t + 1, c]) for t in range(0, 10, 2))
                      for c in range(5)] for r in raw]) - 128 * w.astype(np.int64).sum(0)
    assert np.array_equal(got.reshape(-1, 5), want)
    assert not np.array_equal(want, x.reshape(-1, 9).astype(np.int64) @ w.astype(np.int64))


# -- the forms a target writes ---------------------------------------------------------------
def test_portable_and_exact_compute_the_same_integers(demo_model, demo_table, demo_heldout):
    x = {"input": np.load(demo_heldout)["input"][:64]}
    outputs = {}
    for target in ("portable", "exact"):
        qmodel, report = quantize(demo_model, demo_table, QuantizeOptions(target=target))
        meta = {p.key: p.value for p in qmodel.metadata_props}
        assert meta["qtool.target"] == target and report.target == target
        outputs[target] = IntegerExecutor(qmodel).run(x).outputs["logits"]
    assert np.array_equal(outputs["portable"], outputs["exact"])


def test_int8_targets_list_the_layers_at_risk(demo_model, demo_table):
    _, portable = quantize(demo_model, demo_table)
    assert portable.hazards == [] and not any("saturate" in w for w in portable.warnings)
    _, vnni = quantize(demo_model, demo_table, QuantizeOptions(target="x86-vnni"))
    names = [h["node"] for h in vnni.hazards]
    assert names[0] == "conv1" and "fc" in names
    for h in vnni.hazards:
        assert 0 < h["channels_at_risk"] <= h["channels"] and 0 < h["pairs_at_risk"] <= h["pairs"]
    warning = next(w for w in vnni.warnings if "saturate" in w)
    assert warning.startswith("target x86-vnni: 5 of 5 Conv/Gemm/MatMul layers can saturate")
    assert warning.endswith("--target portable avoids it")


def test_a_qoperator_model_of_int8_activations_lists_no_hazard(demo_model, demo_table, demo_heldout):
    """--format qoperator --target x86-vnni writes QLinearConv/QGemm of int8 activations and
    weights, which onnxruntime runs s8 x s8, exact on every CPU: no hazard, and the AVX2
    emulation computes the exact integers (the warning said "5 of 5 can saturate", read from the
    QDQ form before the conversion, whose int8 activations onnxruntime moves to uint8)."""
    qmodel, report = quantize(demo_model, demo_table, QuantizeOptions(target="x86-vnni", format="qoperator"))
    assert {n.op_type for n in qmodel.graph.node} >= {"QLinearConv", "QGemm"}
    assert report.hazards == [] and not any("saturate" in w for w in report.warnings)
    x = {"input": np.load(demo_heldout)["input"][:16]}
    exact = IntegerExecutor(qmodel).run(x).outputs["logits"]
    assert np.array_equal(IntegerExecutor(qmodel, arithmetic="x86-avx2").run(x).outputs["logits"], exact)


def test_quantize_cli_prints_the_hazard_warning(tmp_path, demo_model, demo_calib):
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", demo_model, "-d", demo_calib, "-o", table).exit_code == 0
    result = invoke("quantize", demo_model, "-t", table, "-o", tmp_path / "q.onnx", "--target", "exact")
    assert_no_crash(result)
    assert result.exit_code == 0
    assert "warning: target exact: 5 of 5 Conv/Gemm/MatMul layers can saturate" in result.stderr


@pytest.mark.parametrize("command", ["quantize", "exec", "verify"])
def test_unknown_target_is_a_user_error(tmp_path, demo_model, demo_calib, demo_heldout, command):
    args = {"quantize": ["quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx"],
            "exec": ["exec", tmp_path / "q.onnx", "-i", demo_heldout, "-o", tmp_path / "y.npz"],
            "verify": ["verify", demo_model, tmp_path / "q.onnx", "-d", demo_heldout, "-q"]}[command]
    assert invoke("calibrate", demo_model, "-d", demo_calib, "-o", tmp_path / "t.yaml").exit_code == 0
    assert invoke("quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx").exit_code == 0
    choices = "portable, x86-vnni, exact" if command == "quantize" else "exact, x86-avx2, host"
    assert_user_error(invoke(*args, "--target", "avx"), f"unknown target 'avx'; choose one of {choices}")


def test_exec_target_x86_avx2_differs_only_where_saturation_does(tmp_path, demo_model, demo_table, demo_heldout):
    qmodel, _ = quantize(demo_model, demo_table, QuantizeOptions(target="x86-vnni", symmetric=True))
    onnx.save(qmodel, tmp_path / "q.onnx")
    outs = {}
    for target in ("exact", "x86-avx2"):
        result = invoke("exec", tmp_path / "q.onnx", "-i", demo_heldout, "-o", tmp_path / f"{target}.npz",
                        "--target", target)
        assert_no_crash(result)
        assert result.exit_code == 0, result.output
        outs[target] = np.load(tmp_path / f"{target}.npz")["logits"]
    assert not np.array_equal(outs["exact"], outs["x86-avx2"])
    # the portable model has no u8 x s8 product: both arithmetics agree
    portable, _ = quantize(demo_model, demo_table, QuantizeOptions(symmetric=True))
    x = {"input": np.load(demo_heldout)["input"][:64]}
    a = IntegerExecutor(portable, "exact").run(x).outputs["logits"]
    assert np.array_equal(a, IntegerExecutor(portable, "x86-avx2").run(x).outputs["logits"])


def test_verify_target_x86_avx2_on_a_vnni_model(tmp_path, demo_model, demo_table, demo_heldout):
    # the saturating stand-in for Conv/Gemm used to lack an op's attributes: exit 3
    qmodel, _ = quantize(demo_model, demo_table, QuantizeOptions(target="x86-vnni"))
    onnx.save(qmodel, tmp_path / "q.onnx")
    figures = {}
    for target in ("exact", "x86-avx2"):
        result = invoke("verify", demo_model, tmp_path / "q.onnx", "-d", demo_heldout, "--target", target, "--json",
                        "-q")
        assert_no_crash(result)
        assert result.exit_code in (0, 1), result.output
        figures[target] = json.loads(result.stdout)["outputs"][0]["sqnr_db"]
    assert figures["x86-avx2"] != figures["exact"]  # the saturation shows in the figures


def test_verify_target_x86_avx2_names_the_saturation_and_the_portable_target(tmp_path, demo_model, demo_table,
                                                                             demo_heldout):
    qmodel, report = quantize(demo_model, demo_table, QuantizeOptions(target="x86-vnni"))
    onnx.save(qmodel, tmp_path / "q.onnx")
    args = ["verify", demo_model, tmp_path / "q.onnx", "-d", demo_heldout, "--num-samples", "64", "-q"]
    result = invoke(*args, "--target", "x86-avx2")
    assert result.exit_code == 1, result.output  # FAIL: the saturation costs the output about 10 dB
    warned = next(w for w in report.warnings if "saturate" in w)  # quantize's warning, in the same words
    assert f"x86-avx2 arithmetic: {warned.removeprefix('target x86-vnni: ')}" in result.stdout.splitlines()
    steps = result.stdout.split("next steps:\n")[1].splitlines()
    assert steps[0] == "  - quantize with --target portable (not x86-vnni): 5 layers can saturate with the x86-avx2 " \
                       "arithmetic (above)"
    hazards = json.loads(invoke(*args, "--target", "x86-avx2", "--json").stdout)["saturation_hazards"]
    assert hazards == report.hazards
    exact = invoke(*args, "--target", "exact", "--json")
    assert "saturation_hazards" not in json.loads(exact.stdout)
    assert "quantize with --target portable" not in " ".join(json.loads(exact.stdout).get("next_steps", []))


def test_verify_ort_names_the_host(tmp_path, demo_model, demo_table, demo_heldout):
    qmodel, _ = quantize(demo_model, demo_table)
    onnx.save(qmodel, tmp_path / "q.onnx")
    result = invoke("verify", demo_model, tmp_path / "q.onnx", "-d", demo_heldout, "--ort", "-q")
    assert result.exit_code == 0, result.output
    assert "  this CPU (avx2 " in result.stdout
    assert "onnxruntime fused QDQ groups into 4 QLinearConv" in result.stdout


# -- against onnxruntime on an AVX2 CPU without VNNI -------------------------------------------
_RUN = """
import sys, numpy as np, onnxruntime as ort
data = np.load(sys.argv[2])
options = ort.SessionOptions()
options.log_severity_level = 3
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
names = [i.name for i in session.get_inputs()]
np.savez(sys.argv[3], *session.run(None, {n: data[n] for n in names}))
"""


def _avx2_onnxruntime(tmp_path, model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """onnxruntime's outputs (default session options) on an AVX2 CPU without VNNI."""
    if x86.ort_saturates():  # this host is one
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, feeds)
    qemu = shutil.which("qemu-x86_64")
    if qemu is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the comparison with onnxruntime needs an AVX2 CPU without VNNI, or qemu-x86_64 "
                    "to emulate one (the emulation itself is tested above on every host)")
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", **feeds)
    (tmp_path / "run.py").write_text(_RUN)
    subprocess.run([qemu, "-cpu", "Haswell-v4", sys.executable, str(tmp_path / "run.py"),
                    str(tmp_path / "m.onnx"), str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                   check=True, stderr=subprocess.DEVNULL, timeout=600)
    out = np.load(tmp_path / "out.npz")
    return [out[f"arr_{i}"] for i in range(len(out.files))]


def _qlinearconv(c_in, c_out, group, x_type, pads):
    """One QLinearConv (uint8 or int8 activations, int8 weights) whose pairs saturate."""
    w = RNG.integers(-128, 128, (c_out, c_in // group, 3, 3)).astype(np.int8)
    np_type = np.dtype(x_type)
    zero = np.array(int(np.iinfo(np_type).min) + 20, np_type)
    inits = [numpy_helper.from_array(a, n) for a, n in [
        (np.array(0.02, np.float32), "xs"), (zero, "xz"), (w, "w"),
        (np.full(c_out, 0.01, np.float32), "ws"), (np.zeros(c_out, np.int8), "wz"),
        (np.array(0.3, np.float32), "ys"), (zero, "yz"),
        (RNG.integers(-5000, 5000, c_out).astype(np.int32), "b")]]
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"],
                            pads=list(pads), group=group)
    elem = TensorProto.UINT8 if x_type == "uint8" else TensorProto.INT8
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, [2, c_in, 7, 7])],
                              [helper.make_tensor_value_info("y", elem, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    info = np.iinfo(np_type)
    x = RNG.integers(info.max - 60, info.max + 1, (2, c_in, 7, 7)).astype(np_type)
    return model, {"x": x}


@pytest.mark.parametrize("c_in, c_out, group", [(3, 8, 1), (16, 16, 1), (5, 6, 1), (8, 8, 2)])
def test_x86_avx2_emulation_predicts_onnxruntime_on_avx2(tmp_path, c_in, c_out, group):
    model, feeds = _qlinearconv(c_in, c_out, group, "uint8", (1, 1, 1, 1))
    (got,) = _avx2_onnxruntime(tmp_path, model, feeds)
    emulated = IntegerExecutor(model, "x86-avx2").run(feeds).outputs["y"]
    exact = IntegerExecutor(model, "exact").run(feeds).outputs["y"]
    diff = np.abs(emulated.astype(np.int64) - got.astype(np.int64))
    # onnxruntime requantizes in float32 and rounds half to even: 1 LSB at most from that
    assert diff.max() <= 1 and np.mean(diff == 0) >= 0.97
    assert np.mean(exact != got) > 0.2, np.mean(exact != got)  # the inputs make saturation matter


def test_demo_targets_in_onnxruntime_on_avx2(tmp_path, demo_model, demo_table, demo_heldout):
    """The portable default runs exactly in onnxruntime on AVX2; the int8 form does not, and the
    x86-avx2 arithmetic predicts what it computes instead."""
    feeds = {"input": np.load(demo_heldout)["input"][:256]}
    portable, _ = quantize(demo_model, demo_table, QuantizeOptions(symmetric=True))
    (got,) = _avx2_onnxruntime(tmp_path, portable, feeds)
    assert np.mean(IntegerExecutor(portable).run(feeds).outputs["logits"] == got) >= 0.99
    vnni, _ = quantize(demo_model, demo_table, QuantizeOptions(target="x86-vnni"))
    (tmp_path / "vnni").mkdir()
    (got,) = _avx2_onnxruntime(tmp_path / "vnni", vnni, feeds)
    emulated = IntegerExecutor(vnni, "x86-avx2").run(feeds).outputs["logits"]
    exact = IntegerExecutor(vnni, "exact").run(feeds).outputs["logits"]
    assert np.mean(emulated == got) >= 0.99
    assert np.mean(exact == got) < 0.5


def _conv3d_model(path) -> None:
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 2, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[0, 1, 1, 1, 1, 1], name="conv3d")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 4, 6, 6])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), path)


@pytest.mark.parametrize("command", ["exec", "verify"])
def test_x86_avx2_emulation_refuses_a_3d_conv(tmp_path, command):
    # a 3-D Conv runs integer, but its u8 x s8 pair order on AVX2 is not known: the emulation
    # refuses it in one line, quantize lists it as a hazard whose order is unknown
    _conv3d_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(4).normal(0, 1, (6, 3, 4, 6, 6)).astype(np.float32))
    assert invoke("calibrate", tmp_path / "m.onnx", "-d", tmp_path / "x.npz", "-o", tmp_path / "t.yaml").exit_code == 0
    from qtool.table_formats import read_table

    _, report = quantize(tmp_path / "m.onnx", read_table(tmp_path / "t.yaml"), QuantizeOptions(target="x86-vnni"))
    assert report.quantized == {"Conv": 1}
    assert [h["node"] for h in report.hazards] == ["conv3d"] and "unknown" in report.hazards[0]["pair_order"]
    result = invoke("quantize", tmp_path / "m.onnx", "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx",
                    "--target", "x86-vnni")
    assert result.exit_code == 0, result.output
    args = {"exec": ["exec", tmp_path / "q.onnx", "-i", tmp_path / "x.npz", "-o", tmp_path / "y.npz"],
            "verify": ["verify", tmp_path / "m.onnx", tmp_path / "q.onnx", "-d", tmp_path / "x.npz", "-q"]}[command]
    assert_user_error(invoke(*args, "--target", "x86-avx2"),
                      "--target x86-avx2 cannot emulate 3-D Conv node 'conv3d'", "--target exact")
    assert not (tmp_path / "y.npz").exists()
    assert invoke(*args, "--target", "exact").exit_code == 0


def test_verify_ort_names_where_onnxruntime_parts_from_the_executor(demo_model, demo_table, demo_heldout):
    from qtool.targets.ortview import first_parting

    qmodel, _ = quantize(demo_model, demo_table)
    executor = IntegerExecutor(qmodel)
    feeds = {"input": np.load(demo_heldout)["input"][:8]}
    assert first_parting(qmodel, executor, feeds) is None  # the portable model: they agree

    class Parted:  # the executor, with one tensor 5 steps off
        steps, arithmetic = executor.steps, executor.arithmetic
        constants, producer, lowering = executor.constants, executor.producer, executor.lowering

        @staticmethod
        def run(feeds, keep_integer=False):
            result = executor.run(feeds, keep_integer=keep_integer)
            result.integer["block_bn2_out"] = result.integer["block_bn2_out"].astype(np.int64) + 5
            return result

    line = first_parting(qmodel, Parted, feeds)
    assert line.startswith("first tensor where onnxruntime and the executor part: 'block_bn2_out' (Conv node")
    assert "max diff 5 LSB, 0.00% equal, on the first batch" in line


def test_verify_ort_on_a_qoperator_model_says_its_kernel_requantizes_in_float(tmp_path, demo_model, demo_table,
                                                                             demo_heldout):
    qmodel, _ = quantize(demo_model, demo_table, QuantizeOptions(format="qoperator", rounding="toward_zero"))
    onnx.save(qmodel, tmp_path / "q.onnx")
    result = invoke("verify", demo_model, tmp_path / "q.onnx", "-d", demo_heldout, "--num-samples", "8", "--ort",
                    "-q")
    assert result.exit_code == 0, result.output
    line = next(n for n in result.stdout.splitlines() if "first tensor where onnxruntime" in n)
    assert "(QLinearConv node '" in line, line
    assert line.endswith("(onnxruntime's QLinearConv kernel requantizes in float, rounding half to even; the "
                         "executor in integers: a rounding rule)"), line
    assert "DequantizeLinear" not in line


def test_x86_avx2_emulates_quantize_dynamic_matmulinteger(tmp_path):
    """onnxruntime's quantize_dynamic writes MatMulInteger with a uint8 A (DynamicQuantizeLinear's)
    and a constant int8 B: on AVX2 its pairs saturate, and --target x86-avx2 predicts its int32
    output exactly (the zero point, given at run time, is applied after the pairs)."""
    w = RNG.integers(60, 128, (16, 6)).astype(np.int8) * np.where(RNG.random((16, 6)) < 0.5, 1, -1).astype(np.int8)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xz"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    x = RNG.uniform(-0.2, 1.0, (4, 16)).astype(np.float32)
    (got,) = _avx2_onnxruntime(tmp_path, model, {"x": x})
    emulated = IntegerExecutor(model, "x86-avx2").run({"x": x}).outputs["y"]
    exact = IntegerExecutor(model, "exact").run({"x": x}).outputs["y"]
    np.testing.assert_array_equal(emulated, got)
    assert np.mean(exact != got) > 0.2  # the inputs make saturation matter
