"""Image preprocessing travels: calibrate records it in the table, quantize in the model, and
quantize --data, verify, exec and jobs reuse it on a folder of images unless told otherwise."""

import json

import numpy as np
import pytest
import yaml

from qtool.data import fitted

from test_cli import assert_user_error, invoke

PIL = pytest.importorskip("PIL.Image")


def test_letterbox_keeps_the_aspect_and_pads():
    img = PIL.fromarray(np.full((10, 20), 200, np.uint8), "L")  # 10 high, 20 wide
    out = np.asarray(fitted(img, (20, 20), "letterbox", 7))
    assert out.shape == (20, 20)
    assert (out[5:15] == 200).all() and (out[:5] == 7).all() and (out[15:] == 7).all()


def test_crop_keeps_the_aspect_and_cuts_the_centre():
    row = np.arange(20, dtype=np.uint8) * 10
    img = PIL.fromarray(np.tile(row, (10, 1)), "L")
    out = np.asarray(fitted(img, (10, 10), "crop", 0))
    assert out.shape == (10, 10) and (out[0] == row[5:15]).all()


def test_stretch_is_a_plain_resize():
    img = PIL.fromarray(np.full((10, 20), 9, np.uint8), "L")
    assert np.asarray(fitted(img, (4, 4), "stretch", 0)).shape == (4, 4)


@pytest.fixture
def images(tmp_path, demo_heldout):
    """40 of the demo's digits as 8x12 grey PNGs (black borders left and right: letterbox matters)."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, a in enumerate(np.load(demo_heldout)["input"][:40]):
        pixels = np.pad(np.uint8(np.round(a[0] * 255)), ((0, 0), (2, 2)))
        PIL.fromarray(pixels, "L").save(folder / f"{i:03d}.png")
    return folder


SETTINGS = ["--channels", "gray", "--fit", "letterbox", "--pad", "0", "--mean", "0.1"]


def _report(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_recorded_preprocessing_is_the_default_everywhere(tmp_path, images, demo_model):
    table, qmodel = tmp_path / "t.yaml", tmp_path / "q.onnx"
    assert invoke("calibrate", demo_model, "-d", images, "-o", table, *SETTINGS, "-q").exit_code == 0
    recorded = yaml.safe_load(table.read_text())["preprocess"]
    assert (recorded["fit"], recorded["pad"], recorded["mean"], recorded["channels"]) == ("letterbox", 0.0, [0.1], "gray")
    # quantize --data on the folder: the table's preprocessing, no options needed
    assert invoke("quantize", demo_model, "-t", table, "-o", qmodel, "-d", images, "-q").exit_code == 0
    plain = _report(invoke("verify", demo_model, qmodel, "-d", images, "--json", "-q"))
    explicit = _report(invoke("verify", demo_model, qmodel, "-d", images, "--json", "-q", *SETTINGS))
    assert plain == explicit and plain["samples"] == 40
    for args, name in (((), "plain"), (SETTINGS, "explicit")):
        assert invoke("exec", qmodel, "-i", images, "-o", tmp_path / f"{name}.npz", "-q", *args).exit_code == 0
    assert np.array_equal(np.load(tmp_path / "plain.npz")["logits"], np.load(tmp_path / "explicit.npz")["logits"])
    # another preprocessing is used when asked, with a warning that names the recorded one
    other = invoke("verify", demo_model, qmodel, "-d", images, "--json", "-q", "--fit", "stretch")
    assert _report(other) != plain
    assert ("warning: image preprocessing: fit stretch given, letterbox recorded in model file "
            f"'{qmodel}' (calibration's); the given one is used") in other.stderr


def test_a_job_takes_image_folders(tmp_path, images, demo_model):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": str(demo_model), "output_dir": str(tmp_path / "out"),
        "calibrate": {"data": str(images), "preprocess": {"channels": "gray", "fit": "letterbox", "pad": 0.0,
                                                           "mean": [0.1]}},
        "verify": {"data": str(images)}}))
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "digits_cnn.verify.json").read_text())
    assert report["samples"] == 40 and report["outputs"][0]["sqnr_db"] > 20


@pytest.mark.parametrize("mean, std", [(0.5, 0.25), (1, [0.25])])
def test_a_jobs_mean_and_std_may_be_one_number_as_on_the_command_line(tmp_path, images, demo_model, mean, std):
    from qtool.job import plan_jobs

    def planned(preprocess):
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump({"model": str(demo_model), "output_dir": str(tmp_path / "out"),
                                       "calibrate": {"data": str(images), "preprocess": preprocess}}))
        return plan_jobs(job)[0].preprocess

    listed = planned({"mean": [float(mean)], "std": std if isinstance(std, list) else [std]})
    assert planned({"mean": mean, "std": std}) == listed
    assert listed.mean == (float(mean),) and listed.std == (0.25,)


def test_analyze_reads_images_as_the_table_recorded(tmp_path, images, demo_model):
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", demo_model, "-d", images, "-o", table, *SETTINGS, "-q").exit_code == 0
    common = ("analyze", demo_model, "-d", images, "--num-samples", "8", "--top", "3", "--json", "-q")
    recorded = _report(invoke(*common, "-t", table))
    explicit = _report(invoke(*common, "-t", table, *SETTINGS))
    calibrated = _report(invoke(*common, *SETTINGS))  # no table: calibrates on the folder itself
    assert recorded["samples"] == 8
    assert recorded["ops"] == explicit["ops"] and recorded["quantized_db"] == explicit["quantized_db"]
    assert calibrated["quantized_db"] == recorded["quantized_db"]  # the same table, made in the same way
    stretched = invoke(*common, "-t", table, "--fit", "stretch")
    assert _report(stretched)["quantized_db"] != recorded["quantized_db"]
    assert "warning: image preprocessing: fit stretch given, letterbox recorded" in stretched.stderr
    # verify --analyze ranks the same ops on the folder, read as the model records
    qmodel = tmp_path / "q.onnx"
    assert invoke("quantize", demo_model, "-t", table, "-o", qmodel, "-q").exit_code == 0
    verified = _report(invoke("verify", demo_model, qmodel, "-d", images, "--analyze", "--analyze-samples", "8",
                              "--json", "-q"))
    assert verified["analysis"]["ops"] == recorded["ops"]


@pytest.mark.parametrize("command", ["calibrate", "quantize", "verify", "exec", "analyze"])
def test_image_options_need_a_folder_of_images(tmp_path, demo_model, demo_calib, qmodel, demo_table, command):
    from qtool.table_formats import write_table

    write_table(demo_table, tmp_path / "t.yaml")
    args = {"calibrate": ("calibrate", demo_model, "-d", demo_calib, "-o", tmp_path / "x.yaml"),
            "quantize": ("quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", tmp_path / "x.onnx"),
            "verify": ("verify", demo_model, qmodel, "-d", demo_calib),
            "exec": ("exec", qmodel, "-i", demo_calib, "-o", tmp_path / "y.npz"),
            "analyze": ("analyze", demo_model, "-d", demo_calib)}[command]
    message = ("the image options describe the images of --data (a folder) or the pixels of --input-pixels"
               if command == "quantize" else "the image options describe a folder of images")
    assert_user_error(invoke(*args, "--fit", "letterbox"), message)


@pytest.mark.parametrize("command", ["calibrate", "verify", "exec", "analyze"])
def test_image_options_on_a_folder_of_arrays_are_refused(tmp_path, demo_model, demo_heldout, qmodel, command):
    folder = tmp_path / "arrays"
    folder.mkdir()
    for i, a in enumerate(np.load(demo_heldout)["input"][:4]):
        np.save(folder / f"{i}.npy", a[None])
    args = {"calibrate": ("calibrate", demo_model, "-d", folder, "-o", tmp_path / "x.yaml"),
            "verify": ("verify", demo_model, qmodel, "-d", folder),
            "exec": ("exec", qmodel, "-i", folder, "-o", tmp_path / "y.npz"),
            "analyze": ("analyze", demo_model, "-d", folder)}[command]
    assert_user_error(invoke(*args, "--fit", "crop"), "the image options describe a folder of images")


def test_unknown_fit_is_a_one_line_error(tmp_path, images, demo_model):
    assert_user_error(invoke("calibrate", demo_model, "-d", images, "-o", tmp_path / "t.yaml", "--channels", "gray",
                             "--fit", "zoom"), "unknown resize fit 'zoom'; choose one of stretch, letterbox, crop")
