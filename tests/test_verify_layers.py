"""verify --layers: the outputs compared on every sample, the tensors on whole batches spread over
the data (16 samples by default), and the report says so."""

import dataclasses
import json

import numpy as np
import pytest

from qtool.verify import verify
from qtool.verify.core import layer_batches

from test_cli import assert_user_error, invoke


def test_layer_batches_are_whole_batches_spread_evenly():
    assert layer_batches(540, 16, 48) == {0, 11, 22}  # 34 batches, 3 of them
    assert layer_batches(540, 16, 1) == {0}
    assert layer_batches(540, 16, None) is None  # every batch
    assert layer_batches(40, 8, 40) is None and layer_batches(40, 8, 100) is None  # that is all of them


def _figures(comparisons) -> list:
    return [dataclasses.astuple(c) for c in comparisons]


def test_outputs_on_every_sample_tensors_on_the_picked_batches(tmp_path, demo_model, qmodel, demo_heldout):
    held = np.load(demo_heldout)
    every = verify(demo_model, qmodel, demo_heldout, labels="label", batch_size=16, progress=False, layers=None)
    some = verify(demo_model, qmodel, demo_heldout, labels="label", batch_size=16, progress=False, layers=48)
    # the outputs, the accuracy and the verdict are those of the full comparison, figure for figure
    assert _figures(some.outputs) == _figures(every.outputs)
    assert some.accuracy == every.accuracy and some.passed == every.passed
    assert some.samples == every.samples == 540
    assert every.layer_samples == 540 and some.layer_samples == 48
    # the tensors: as a full comparison of batches 0, 11 and 22 alone (samples 0-15, 176-191, 352-367)
    rows = np.r_[0:16, 176:192, 352:368]
    np.savez(tmp_path / "picked.npz", **{k: held[k][rows] for k in held.files})
    alone = verify(demo_model, qmodel, tmp_path / "picked.npz", batch_size=16, progress=False, layers=None)
    assert _figures(some.tensors) == _figures(alone.tensors)
    assert _figures(some.tensors) != _figures(every.tensors)


def test_report_says_how_many_samples_the_tensors_saw(demo_model, qmodel, demo_heldout):
    default = invoke("verify", demo_model, qmodel, "-d", demo_heldout, "--batch-size", "8", "-q")
    assert default.exit_code == 0
    assert ("tensors compared on 16 of the 540 samples, in batches spread over them (--layers all: every "
            "sample)") in default.stdout
    full = invoke("verify", demo_model, qmodel, "-d", demo_heldout, "--batch-size", "8", "-q", "--layers", "all")
    assert full.exit_code == 0 and "tensors compared on" not in full.stdout
    report = json.loads(invoke("verify", demo_model, qmodel, "-d", demo_heldout, "--batch-size", "8", "-q",
                               "--layers", "20", "--json").stdout)
    assert report["layer_samples"] == 24 and report["samples"] == 540  # whole batches: 3 of 8


@pytest.mark.parametrize("value, message", [("0", "--layers must be at least 1 (or all), got 0"),
                                            ("some", "--layers takes a number of samples or all, got 'some'")])
def test_bad_layers_is_a_one_line_error(demo_model, qmodel, demo_heldout, value, message):
    assert_user_error(invoke("verify", demo_model, qmodel, "-d", demo_heldout, "--layers", value), message)


def test_a_job_takes_verify_layers(tmp_path, demo_model, demo_calib, demo_heldout):
    from test_outputs import _demo_job

    for value, compared in (("all", 64), ("8", 8)):
        job = _demo_job(tmp_path, demo_model, demo_calib, demo_heldout, f", batch_size: 8, layers: {value}")
        assert invoke("run", job, "-q", "--force").exit_code == 0
        report = json.loads(next((tmp_path / "out").glob("*.verify.json")).read_text())
        assert report["samples"] == 64 and report["layer_samples"] == compared
    bad = _demo_job(tmp_path, demo_model, demo_calib, demo_heldout, ", layers: 0")
    assert_user_error(invoke("run", bad), "verify.layers: expected a number of samples >= 1 or all, got 0")


def test_the_page_says_how_many_samples_the_tensors_saw(tmp_path, demo_model, qmodel, demo_heldout):
    page = tmp_path / "r.html"
    assert invoke("verify", demo_model, qmodel, "-d", demo_heldout, "--batch-size", "8", "-q", "--report",
                  page).exit_code == 0
    assert "Compared on 16 of the 540 samples, in batches spread over them" in page.read_text()
    assert invoke("verify", demo_model, qmodel, "-d", demo_heldout, "--batch-size", "8", "-q", "--report",
                  page, "--layers", "all").exit_code == 0
    assert "Compared on" not in page.read_text()
