"""The Python API (qtool/api.py, docs/api.md): paths, arrays or feed dicts, models as paths or
ModelProtos, the same results as the commands."""

import numpy as np
import onnx
import pytest

from qtool.api import calibrate, execute, quantize, verify
from qtool.errors import QtoolError


@pytest.fixture(scope="module")
def calib(demo_calib):
    return np.load(demo_calib)["input"][:64]


def test_arrays_feed_dicts_and_files_give_the_same_table(tmp_path, demo_model, calib):
    np.savez(tmp_path / "c.npz", input=calib)
    from_file = calibrate(demo_model, tmp_path / "c.npz")
    from_arrays = calibrate(demo_model, {"input": calib})
    # feed dicts of one sample and of batches of 8, from a generator (read once, in order)
    singles = calibrate(demo_model, ({"input": x} for x in calib))
    batches = calibrate(onnx.load(demo_model), ({"input": calib[i:i + 8]} for i in range(0, 64, 8)))
    for table in (from_arrays, singles, batches):
        assert table.samples == 64
        assert table.tensors == from_file.tensors


def test_quantize_and_verify_from_python(demo_model, demo_heldout, calib):
    table = calibrate(demo_model, {"input": calib})
    qmodel, report = quantize(demo_model, table)
    assert isinstance(qmodel, onnx.ModelProto) and sum(report.quantized.values()) == 13
    held = np.load(demo_heldout)["input"][:128]
    checked = verify(demo_model, qmodel, {"input": held})
    assert checked.passed and checked.samples == 128 and checked.outputs[0].sqnr > 30
    # int16 activations and the judged steps of --data, from the same call
    wide, wide_report = quantize(demo_model, table, data={"input": calib}, activation_type="int16")
    assert wide_report.bias_correction is not None
    assert verify(demo_model, wide, {"input": held}).outputs[0].sqnr > checked.outputs[0].sqnr


def test_execute_writes_what_qtool_exec_writes(tmp_path, demo_model, demo_heldout, calib):
    from test_cli import invoke

    qmodel, _ = quantize(demo_model, calibrate(demo_model, {"input": calib}))
    onnx.save(qmodel, tmp_path / "q.onnx")
    held = np.load(demo_heldout)["input"][:20]
    np.savez(tmp_path / "held.npz", input=held)
    result = execute(qmodel, ({"input": x} for x in held), tmp_path / "api.npz", batch_size=8)
    assert result.outputs == {"logits": [20, 10]} and result.integer_steps > 0 and not result.float_nodes
    assert invoke("exec", tmp_path / "q.onnx", "-i", tmp_path / "held.npz", "-o", tmp_path / "cli.npz",
                  "-q").exit_code == 0
    assert np.array_equal(np.load(tmp_path / "api.npz")["logits"], np.load(tmp_path / "cli.npz")["logits"])
    with pytest.raises(QtoolError, match="the image options describe a folder of images"):
        execute(qmodel, {"input": held}, tmp_path / "x.npz", images={"fit": "crop"})
    assert not (tmp_path / "x.npz").exists()


def test_bad_arguments_are_qtool_errors(demo_model, calib):
    with pytest.raises(QtoolError, match="data must be a path, a dict of arrays or an iterable of feed dicts"):
        calibrate(demo_model, 3)
    with pytest.raises(QtoolError, match="item 0 is not a dict of arrays"):
        calibrate(demo_model, [calib])
    with pytest.raises(QtoolError, match="model must be a path or an onnx.ModelProto"):
        calibrate(b"bytes", {"input": calib})
    with pytest.raises(QtoolError, match="data holds no samples"):
        calibrate(demo_model, [])
    table = calibrate(demo_model, {"input": calib})
    with pytest.raises(QtoolError, match="unknown option 'bits'; the options are per_channel, "):
        quantize(demo_model, table, bits=4)


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message and "qtool-api-" not in message and "--" not in message, message
    return message


def test_errors_speak_of_the_data_and_arguments_given(demo_model, demo_heldout, calib):
    """Sweep 9: data errors named the temporary folder the arrays went to and its files
    ('/tmp/qtool-api-XXXX' batch of files '000000000.npz' to ...) and told the caller to use
    --batch-size 1; wrong types raised AttributeError, TypeError or ValueError, or were taken
    (steps="all", per_channel="no", tolerance=(2, 20)); keep_float="Gemm" became 'G', 'e', 'm'."""
    with pytest.raises(QtoolError) as e:
        calibrate(demo_model, {"input": calib[:, :, :4]})
    assert _one_line(e).startswith("data samples 0 to 7 for input 'input' has shape [8, 1, 4, 8]")
    with pytest.raises(QtoolError) as e:
        calibrate(demo_model, {"x": calib, "y": calib})
    assert _one_line(e).startswith("data sample 0 has no array for model input 'input'")
    with pytest.raises(QtoolError) as e:
        calibrate(demo_model, iter([{"input": calib[:1]}, {"input": calib[:1, :, :4]}]))
    assert _one_line(e).endswith("use batch_size=1")
    from qtool.api import _in_api_words

    hint = "onnxruntime failed (on a batch of 8 samples; if the model runs one sample at a time, add --batch-size 1)"
    assert _in_api_words(hint, "/tmp/qtool-api-x").endswith("add batch_size=1)")
    with pytest.raises(QtoolError, match="the dict holds no arrays"):
        calibrate(demo_model, {})
    with pytest.raises(QtoolError, match="params must be a dict of parameter names and values, not str"):
        calibrate(demo_model, {"input": calib}, method="kl", params="bins=10")
    table = calibrate(demo_model, {"input": calib})
    with pytest.raises(QtoolError, match="table must be a path or a qtool.table.Table, not dict"):
        quantize(demo_model, {"tensors": {}})
    with pytest.raises(QtoolError, match="steps must be a qtool.recipe.DataSteps, not str"):
        quantize(demo_model, table, {"input": calib}, steps="all")
    with pytest.raises(QtoolError, match="option per_channel is true or false, not 'no'"):
        quantize(demo_model, table, per_channel="no")
    for bad, said in (({"keep_float": 5}, "option keep_float is a list of names, not 5"),
                      ({"multiplier_bits": "32"}, "option multiplier_bits is a whole number, not '32'"),
                      ({"format": 3}, "option format is a name, not 3")):
        with pytest.raises(QtoolError, match=said):
            quantize(demo_model, table, **bad)
    _, report = quantize(demo_model, table, keep_float=(n for n in ["Gemm"]), multiplier_bits=np.int64(8))
    assert [(op, node) for op, node, _ in report.kept_float] == [("Gemm", "fc")]  # (a generator read once)
    _, report = quantize(demo_model, table, keep_float="Gemm")
    assert [(op, node) for op, node, _ in report.kept_float] == [("Gemm", "fc")]
    qmodel, _ = quantize(demo_model, table)
    held = {"input": np.load(demo_heldout)["input"][:32]}
    with pytest.raises(QtoolError, match=r"COS in \[-1, 1\], got '\[2, 20\]'"):
        verify(demo_model, qmodel, held, tolerance=(2, 20))
    assert verify(demo_model, qmodel, held, tolerance=0.5).tolerance == (0.5, None)
    assert verify(demo_model, qmodel, held, tolerance="0.5,10").tolerance == (0.5, 10.0)
    assert verify(demo_model, qmodel, held, tolerance=(0.5, None)).tolerance == (0.5, None)
    for bad in ((None, 20), [0.9, None, 1]):
        with pytest.raises(QtoolError, match="tolerance must be COS or COS,SQNR"):
            verify(demo_model, qmodel, held, tolerance=bad)
    with pytest.raises(QtoolError, match="verify: unknown keyword argument 'bogus'"):
        verify(demo_model, qmodel, held, bogus=1)
    with pytest.raises(QtoolError, match="execute: unknown keyword argument 'bogus'"):
        execute(qmodel, held, "/nonexistent/out.npz", bogus=1)


def test_verify_takes_labels_beside_the_arrays(demo_model, demo_heldout, calib):
    # the labels array sits beside the inputs in the dict, as in an .npz (the docs sweep found the
    # dict form refused with a message naming a temporary folder and "arrays: none")
    qmodel, _ = quantize(demo_model, calibrate(demo_model, {"input": calib}))
    held = dict(np.load(demo_heldout))
    from_dict = verify(demo_model, qmodel, {"input": held["input"][:64], "label": held["label"][:64]}, labels="label")
    assert from_dict.accuracy["labels"] == "label" and from_dict.accuracy["float"] > 90
    with pytest.raises(QtoolError, match="labels 'label': give data as an .npz path or as one dict of arrays"):
        verify(demo_model, qmodel, ({"input": x[None]} for x in held["input"][:8]), labels="label")
    with pytest.raises(QtoolError, match="that holds 'label' beside the inputs"):
        verify(demo_model, qmodel, {"input": held["input"][:8]}, labels="label")
