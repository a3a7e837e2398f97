"""``qtool run`` on batch files: defaults and jobs, up-to-date skipping, failures, --jobs, --dry-run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from test_cli import assert_no_crash, assert_user_error, invoke, snapshot


@pytest.fixture
def inputs(tmp_path, demo_model, demo_calib, demo_heldout):
    """Copies of the demo files (tests change them) and a batch of two jobs over them."""
    folder = tmp_path / "in"
    folder.mkdir()
    for source in (demo_model, demo_calib, demo_heldout):
        shutil.copy(source, folder / source.name)
    return folder


def batch(inputs: Path, **job_overrides) -> dict:
    jobs = [{"name": "asym"},
            {"name": "sym8", "calibrate": {"method": "percentile"},
             "quantize": {"symmetric": True, "multiplier_bits": 8}}]
    for i, override in job_overrides.items():
        jobs[int(i[1:])].update(override)
    return {"defaults": {"model": str(inputs / "digits_cnn.onnx"),
                         "output_dir": str(inputs.parent / "out" / "{name}"),
                         "calibrate": {"data": str(inputs / "digits_calib.npz"), "batch_size": 64},
                         "verify": {"data": str(inputs / "digits_heldout.npz"), "labels": "label",
                                    "num_samples": 128}},
            "jobs": jobs}


def write(tmp_path: Path, content) -> Path:
    path = tmp_path / "jobs.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
    return path


def statuses(result) -> dict[str, str]:
    assert_no_crash(result)
    return {o["name"]: o["status"] for o in json.loads(result.stdout)}


def test_batch_runs_every_job_with_its_settings_and_a_summary(tmp_path, inputs):
    result = invoke("run", write(tmp_path, batch(inputs)), "-q")
    assert_no_crash(result)
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:-1]}
    assert rows["asym"][1] == "ok" and rows["sym8"][1] == "ok"
    assert result.stdout.splitlines()[-1] == "2 ok"
    out = tmp_path / "out"
    for name in ("asym", "sym8"):
        assert sorted(p.name for p in (out / name).iterdir()) == sorted(
            [f"{name}.table.yaml", f"{name}.q.onnx", f"{name}.verify.json"])
    # each job got its own settings over the defaults
    assert yaml.safe_load((out / "sym8" / "sym8.table.yaml").read_text())["method"] == "percentile"
    assert yaml.safe_load((out / "asym" / "asym.table.yaml").read_text())["method"] == "minmax"
    report = json.loads((out / "sym8" / "sym8.verify.json").read_text())
    assert report["samples"] == 128 and report["job"]["name"] == "sym8"


def test_up_to_date_jobs_are_skipped_until_an_input_or_setting_changes(tmp_path, inputs):
    path = write(tmp_path, batch(inputs))
    assert statuses(invoke("run", path, "-q", "--json")) == {"asym": "ok", "sym8": "ok"}
    model_bytes = (tmp_path / "out" / "asym" / "asym.q.onnx").read_bytes()
    assert statuses(invoke("run", path, "-q", "--json")) == {"asym": "skipped", "sym8": "skipped"}
    assert statuses(invoke("run", path, "-q", "--json", "--force")) == {"asym": "ok", "sym8": "ok"}
    assert (tmp_path / "out" / "asym" / "asym.q.onnx").read_bytes() == model_bytes  # deterministic

    # a setting of one job: only that job runs again
    write(tmp_path, batch(inputs, j1={"quantize": {"symmetric": True, "multiplier_bits": 32}}))
    assert statuses(invoke("run", path, "-q", "--json")) == {"asym": "skipped", "sym8": "ok"}
    # the content of an input file shared by both (same name, other bytes): both run again
    data = dict(np.load(inputs / "digits_calib.npz"))
    data["input"] = data["input"][:200]
    np.savez(inputs / "digits_calib.npz", **data)
    assert statuses(invoke("run", path, "-q", "--json")) == {"asym": "ok", "sym8": "ok"}
    # an output changed by hand: that job runs again
    (tmp_path / "out" / "sym8" / "sym8.table.yaml").write_text("edited")
    assert statuses(invoke("run", path, "-q", "--json")) == {"asym": "skipped", "sym8": "ok"}


def test_a_failing_job_does_not_stop_the_others(tmp_path, inputs):
    bad = inputs / "nan.npz"
    data = dict(np.load(inputs / "digits_heldout.npz"))
    data["input"] = data["input"].copy()
    data["input"][3, 0, 0, 0] = np.nan
    np.savez(bad, **data)
    spec = batch(inputs, j0={"verify": {"data": str(bad)}})
    result = invoke("run", write(tmp_path, spec), "-q")
    assert_no_crash(result)
    assert result.exit_code == 2
    lines = result.stdout.splitlines()
    assert lines[1].split()[:2] == ["asym", "error"] and "nan.npz" in lines[2]
    assert any(line.split()[:2] == ["sym8", "ok"] for line in lines)
    assert lines[-1] == "1 ok, 1 error"
    assert not (tmp_path / "out" / "asym").exists()  # the failed job left nothing
    assert (tmp_path / "out" / "sym8" / "sym8.q.onnx").is_file()


def test_a_job_s_input_pixels_error_names_the_job_keys_not_the_flags(tmp_path, inputs):
    """The normalization folded in at quantize time is the job's calibrate.preprocess: a mean of
    three values for the demo's one-channel input is said in those words, not --mean's."""
    spec = batch(inputs, j0={"calibrate": {"preprocess": {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}},
                             "quantize": {"input_pixels": True}})
    spec["jobs"] = spec["jobs"][:1]
    result = invoke("run", write(tmp_path, spec), "-q")
    assert_no_crash(result)
    assert result.exit_code == 2
    lines = result.stdout.splitlines()
    assert lines[1].split()[:2] == ["asym", "error"]
    assert lines[2].strip() == ("quantize.input_pixels: calibrate.preprocess.mean has 3 values but the model's "
                                "input has 1 channel: give one value"), lines[2]
    assert "--" not in lines[2]


def test_a_job_that_hits_a_bug_exits_3_as_the_command_would(tmp_path, inputs, monkeypatch):
    """A job stopped by an internal error (sweep 5: weight rounding's ValueError) is no user error:
    the batch exits 3, as a single quantize would; the other job still runs."""
    import qtool.job

    real = qtool.job.quantize_with_data

    def broken(model, *args, **kwargs):
        if "asym" in str(args[2]):  # the table's path names the job
            raise ValueError("cannot reshape array of size 6400 into shape (200,32,1,2)")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(qtool.job, "quantize_with_data", broken)
    result = invoke("run", write(tmp_path, batch(inputs)), "-q", "--json")
    assert_no_crash(result)
    assert result.exit_code == 3, result.output
    outcomes = {o["name"]: o for o in json.loads(result.stdout)}
    assert outcomes["asym"]["status"] == "error" and outcomes["asym"]["internal"] is True
    assert outcomes["asym"]["message"] == ("internal error: ValueError: cannot reshape array of size 6400 into "
                                           "shape (200,32,1,2)")
    assert outcomes["sym8"]["status"] == "ok" and "internal" not in outcomes["sym8"]


def test_a_failed_verification_exits_1_and_runs_again_next_time(tmp_path, inputs):
    spec = batch(inputs, j1={"verify": {"max_accuracy_drop": -100.0}})  # impossible to meet
    path = write(tmp_path, spec)
    result = invoke("run", path, "-q")
    assert_no_crash(result)
    assert result.exit_code == 1
    assert "accuracy drop" in result.stdout
    assert statuses(invoke("run", path, "-q", "--json")) == {"asym": "skipped", "sym8": "failed"}


def test_parallel_jobs_write_the_same_bytes_as_sequential(tmp_path, inputs):
    path = write(tmp_path, batch(inputs))
    assert invoke("run", path, "-q").exit_code == 0
    out = tmp_path / "out"
    first = {p: p.read_bytes() for p in out.rglob("*") if p.suffix in (".yaml", ".onnx")}
    shutil.rmtree(out)
    result = invoke("run", path, "-q", "--jobs", "2")
    assert_no_crash(result)
    assert result.exit_code == 0, result.output
    assert {p: p.read_bytes() for p in out.rglob("*") if p.suffix in (".yaml", ".onnx")} == first


def test_dry_run_with_json_prints_the_plan_as_json(tmp_path, inputs):
    # sweep 8: `run --json --dry-run` printed the text plan
    path = write(tmp_path, batch(inputs))
    result = invoke("run", path, "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)
    assert [(p["name"], p["where"], p["status"]) for p in plans] == [("asym", "jobs[0]", "run"),
                                                                      ("sym8", "jobs[1]", "run")]
    assert plans[1]["calibrate"]["method"] == "percentile" and plans[0]["verify"]["labels"] == "label"
    assert plans[0]["outputs"][-1].endswith("asym.verify.json") and "bias correction" in plans[0]["quantize"]
    assert not (inputs.parent / "out").exists()


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, inputs):
    path = write(tmp_path, batch(inputs))
    before = snapshot(tmp_path)
    result = invoke("run", path, "--dry-run")
    assert_no_crash(result)
    assert result.exit_code == 0
    assert "job 'asym' (jobs[0]): would run" in result.stdout
    assert "symmetric int8, 8-bit multipliers" in result.stdout
    assert str(tmp_path / "out" / "sym8" / "sym8.q.onnx") in result.stdout
    assert snapshot(tmp_path) == before


def test_pkg_paths_name_files_inside_installed_packages(tmp_path, inputs):
    spec = batch(inputs)
    spec["defaults"]["model"] = "pkg:qtool/demo/digits_cnn.onnx"
    result = invoke("run", write(tmp_path, spec), "--dry-run")
    assert_no_crash(result)
    assert str(Path("qtool") / "demo" / "digits_cnn.onnx") in result.stdout


@pytest.mark.parametrize("edit, fragments", [
    (lambda s: s["jobs"][1]["calibrate"].update(method="kll"),
     ["jobs[1].calibrate.method: unknown 'kll'; choose one of", "minmax"]),
    (lambda s: s["defaults"]["calibrate"].update(methd="kl"), ["defaults.calibrate.methd: unknown key"]),
    (lambda s: s.update(job=[]), ["job: unknown key; allowed keys in a batch: defaults, jobs"]),
    (lambda s: s.update(jobs={"a": 1}), ["jobs: expected a non-empty list"]),
    (lambda s: s["jobs"].append("x"), ["jobs[2]: expected a mapping"]),
    (lambda s: s["jobs"][1].update(name="asym"), ["jobs[1].name: 'asym' is the name of jobs[0] too"]),
    (lambda s: s["jobs"][0].update(model="pkg:no_such_package/m.onnx"),
     ["jobs[0].model: package 'no_such_package' is not installed"]),
    (lambda s: s["jobs"][1].update(verify={"num_samples": "many"}),
     ["jobs[1].verify.num_samples: expected an integer, got 'many'"]),
    (lambda s: s["jobs"][0].update(quantize={"format": "qlinear"}),
     ["jobs[0].quantize.format: unknown 'qlinear'; choose one of qdq, qoperator"]),
    (lambda s: s["jobs"][0].update(quantize={"max_float_layers": -2}),
     ["jobs[0].quantize.max_float_layers: must be >= 0, got -2"]),
    (lambda s: s["jobs"][0].update(quantize={"target_sqnr": "high"}),
     ["jobs[0].quantize.target_sqnr: expected a number, got 'high'"]),
    (lambda s: s["jobs"][0].update(quantize={"try_methods": ["mse", "kll"]}),
     ["jobs[0].quantize.try_methods[1]: unknown 'kll'; choose one of"]),
    (lambda s: s["jobs"][0].update(quantize={"target": "avx2"}),
     ["jobs[0].quantize.target: unknown 'avx2'; choose one of portable, x86-vnni, exact"]),
    (lambda s: s["jobs"][0].update(quantize={"holdout": -1}), ["jobs[0].quantize.holdout: must be >= 0, got -1"]),
    (lambda s: s["jobs"][0].update(quantize={"input_pixels": True}),
     ["jobs[0].quantize.input_pixels: needs calibrate.preprocess"]),
    (lambda s: s["jobs"][0].update(quantize={"method_choice": "yes"}),
     ["jobs[0].quantize.method_choice: expected true or false, got 'yes'"]),
    (lambda s: s["jobs"][0].update(quantize={"weight_type": "int3"}),
     ["jobs[0].quantize.weight_type: unknown 'int3'; choose one of int8, int4"]),
    (lambda s: s["jobs"][0].update(quantize={"block_size": -4}), ["jobs[0].quantize.block_size: must be >= 0, got -4"]),
    (lambda s: s["jobs"][0].update(quantize={"block_size": 1}),
     ["jobs[0].quantize: quantize.block_size must be 0 (per channel) or at least 2, got 1"]),
    (lambda s: s["jobs"][0].update(quantize={"weight_type": "int16"}),
     ["jobs[0].quantize: quantize.weight_type int16 goes with quantize.activation_type int16"]),
    # sweep 8: a name with '/' or '..' wrote outside output_dir, an empty one hidden files
    (lambda s: s["jobs"][1].update(name="../../escaped"),
     ["jobs[1].name: '../../escaped' cannot name the job's files: give a name with no '/'"]),
    (lambda s: s["jobs"][0].update(name=""), ["jobs[0].name: '' cannot name the job's files"]),
    (lambda s: s["jobs"][0].update(name=".hidden"), ["jobs[0].name: '.hidden' cannot name"]),
    # and a misspelled placeholder made a folder named '{nme}'
    (lambda s: s["defaults"].update(output_dir=s["defaults"]["output_dir"].replace("{name}", "{nme}")),
     ["defaults.output_dir: '", "{nme}' has a placeholder other than {name} (the job's name), the only one"]),
], ids=["method", "defaults-key", "top-key", "jobs-type", "job-type", "same-name",
        "pkg", "type", "format", "max-float", "target", "try-methods", "quantize-target", "holdout", "pixels",
        "method-choice", "weight-type", "block-size", "block-size-1", "weight-type-int16", "name-escapes",
        "name-empty", "name-hidden", "placeholder"])
def test_batch_file_errors_name_the_yaml_path_before_any_work(tmp_path, inputs, edit, fragments):
    spec = batch(inputs)
    edit(spec)
    path = write(tmp_path, spec)
    before = snapshot(tmp_path)
    assert_user_error(invoke("run", path), f"job file '{path}'", *fragments)
    assert snapshot(tmp_path) == before


def test_forced_reruns_write_the_same_bytes_reports_included(tmp_path, inputs):
    path = write(tmp_path, batch(inputs))
    assert invoke("run", path, "-q").exit_code == 0
    out = tmp_path / "out"
    first = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert any(p.suffix == ".json" for p in first)
    assert invoke("run", path, "-q", "--force").exit_code == 0
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == first


def test_jobs_correct_biases_by_default_and_search_when_asked(tmp_path, inputs):
    spec = batch(inputs)
    spec["jobs"] = [{"name": "plain", "quantize": {"bias_correction": False}},
                    {"name": "corrected"},
                    {"name": "searched", "quantize": {"max_float_layers": 2, "target_sqnr": 100.0, "allow_float": True,
                                                      "try_methods": ["mse"], "holdout": 0}}]
    result = invoke("run", write(tmp_path, spec))
    assert result.exit_code == 0, result.output
    assert "search: 2 ops kept float" in result.stderr
    assert "methods: tensors moved off minmax: mse " in result.stderr
    assert "method: mse" in (tmp_path / "out" / "searched" / "searched.table.yaml").read_text()
    out = tmp_path / "out"
    models = {n: (out / n / f"{n}.q.onnx").read_bytes() for n in ("plain", "corrected", "searched")}
    assert models["plain"] != models["corrected"]
    floats = {n: json.loads((out / n / f"{n}.verify.json").read_text())["float_nodes"] for n in models}
    assert floats["plain"] == floats["corrected"] == []
    assert len(floats["searched"]) == 2


def test_a_precision_table_gives_its_ops_int16_and_its_bytes_count(tmp_path, inputs):
    """quantize.precision_table: a path like the data's; the named op gets int16 fences, and a
    change of the file's content runs the job again."""
    import onnx
    from onnx import numpy_helper

    (inputs / "qtable.txt").write_text("conv2 INT16\n")
    path = write(tmp_path, batch(inputs, j0={"quantize": {"precision_table": str(inputs / "qtable.txt")}}))
    assert statuses(invoke("run", path, "-q", "--json")) == {"asym": "ok", "sym8": "ok"}
    qmodel = onnx.load(tmp_path / "out" / "asym" / "asym.q.onnx")
    inits = {i.name: numpy_helper.to_array(i) for i in qmodel.graph.initializer}
    types = {n.input[0]: inits[n.input[2]].dtype for n in qmodel.graph.node if n.op_type == "QuantizeLinear"}
    assert types["bn2_out"] == np.int16 and types["relu1_out"] != np.int16
    assert statuses(invoke("run", path, "-q", "--json")) == {"asym": "skipped", "sym8": "skipped"}
    (inputs / "qtable.txt").write_text("conv2 INT16\nconv1 INT16\n")
    assert statuses(invoke("run", path, "-q", "--json")) == {"asym": "ok", "sym8": "skipped"}


@pytest.mark.parametrize("text, message", [
    (None, "No such file or directory"),
    ("conv7 INT16\n", "line 1: the model has no node or op type 'conv7'"),
])
def test_precision_table_errors_name_the_job_key_and_the_line(tmp_path, inputs, text, message):
    table = inputs / "qtable.txt"
    if text is not None:
        table.write_text(text)
    path = write(tmp_path, batch(inputs, j1={"quantize": {"precision_table": str(table)}}))
    result = invoke("run", path, "-q")
    assert_user_error(result, f"job file '{path}': jobs[1].quantize.precision_table: precision table "
                              f"'{table}'")
    assert message in result.stderr
    assert not (tmp_path / "out").exists()  # the whole file is checked before any work


def test_every_broken_job_of_a_batch_is_named_in_one_error(tmp_path, inputs):
    """A batch with two broken jobs names both (each job's first problem), so it is fixed in one
    pass: the settings checks and then the file checks (a model not found), before any work."""
    spec = batch(inputs)
    spec["jobs"][0]["calibrate"] = {"method": "bogus"}
    spec["jobs"][1]["quantize"] = {"format": "qlinear"}
    spec["jobs"].append({"name": "fine"})
    path = write(tmp_path, spec)
    before = snapshot(tmp_path)
    assert_user_error(invoke("run", path), f"job file '{path}'",
                      "2 of 3 jobs have errors in their settings (the files of every job are checked once "
                      "these are right)",
                      "jobs[0].calibrate.method: unknown 'bogus'", "jobs[1].quantize.format: unknown 'qlinear'")
    spec["jobs"][0]["calibrate"] = {"method": "minmax"}
    spec["jobs"][1]["quantize"] = {}
    spec["jobs"][1]["model"] = str(tmp_path / "missing.onnx")
    spec["jobs"][2]["model"] = str(tmp_path / "gone.onnx")
    path = write(tmp_path, spec)
    message = assert_user_error(invoke("run", path), f"job file '{path}': 2 of 3 jobs have errors in their "
                                f"files: jobs[1].model", "missing.onnx", "; jobs[2].model", "gone.onnx")
    assert "jobs[0]" not in message and message.count("job file") == 1  # the file named once
    assert snapshot(tmp_path) == before


def test_a_job_never_writes_over_what_it_reads(tmp_path, inputs):
    """The files sweep: a job named after its own model with its outputs beside it replaced the
    float model with the quantized one, and a data file named like the report was replaced by
    the report; the single commands refused the same."""
    out = tmp_path / "out" / "asym"
    out.mkdir(parents=True)
    model = out / "asym.q.onnx"
    shutil.copy(inputs / "digits_cnn.onnx", model)
    spec = batch(inputs)
    spec["jobs"] = [{"name": "asym", "model": str(model)}]
    before = model.read_bytes()
    assert_user_error(invoke("run", write(tmp_path, spec)), "jobs[0].output_dir: cannot write",
                      "asym.q.onnx", "which this job reads")
    assert model.read_bytes() == before
    data = out / "asym.verify.json"
    shutil.copy(inputs / "digits_heldout.npz", data)
    spec["jobs"] = [{"name": "asym", "verify": {"data": str(data), "labels": "label"}}]
    assert_user_error(invoke("run", write(tmp_path, spec)), "asym.verify.json", "which this job reads")


def test_replaced_outputs_keep_their_permissions(tmp_path, inputs):
    import os
    import stat

    spec = batch(inputs)
    spec["jobs"] = spec["jobs"][:1]
    path = write(tmp_path, spec)
    assert invoke("run", path, "-q").exit_code == 0
    table = tmp_path / "out" / "asym" / "asym.table.yaml"
    os.chmod(table, 0o600)
    assert invoke("run", path, "-q", "--force").exit_code == 0
    assert stat.S_IMODE(os.stat(table).st_mode) == 0o600
    single = tmp_path / "single.yaml"
    single.write_text("old")
    os.chmod(single, 0o640)
    assert invoke("calibrate", inputs / "digits_cnn.onnx", "-d", inputs / "digits_calib.npz", "-o", single,
                  "-q").exit_code == 0
    assert stat.S_IMODE(os.stat(single).st_mode) == 0o640 and single.read_text() != "old"
    assert not [p for p in (tmp_path / "out" / "asym").iterdir() if ".partial" in p.name]


def test_staged_files_a_killed_run_left_are_removed_by_the_next(tmp_path, inputs):
    # sweep 8: a cluster run stopped under its jobs (and any SIGKILL) left '.NAME.table.partial-PID.yaml'
    # beside the outputs for good; a live process's staged file is not touched
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = inputs.parent / "out" / "asym"
    out.mkdir(parents=True)
    from qtool.job import _HOST

    left = [out / f".asym.table.partial-{_HOST}-{dead.pid}.yaml", out / f".asym.q.partial-{dead.pid}.onnx"]
    alive = out / f".asym.table.partial-{_HOST}-{os.getppid()}.yaml"
    # another host of a cluster sharing the folder: its process may run, whatever its pid is here
    elsewhere = out / f".asym.table.partial-other.host-{dead.pid}.yaml"
    for path in left + [alive, elsewhere]:
        path.write_text("half")
    spec = batch(inputs)
    spec["jobs"] = spec["jobs"][:1]
    result = invoke("run", write(tmp_path, spec), "-q")
    assert result.exit_code == 0, result.output
    assert not any(path.exists() for path in left) and alive.read_text() == "half"
    assert elsewhere.read_text() == "half"
    assert (out / "asym.table.yaml").exists()


def test_a_job_is_up_to_date_however_its_file_is_named(tmp_path, inputs, monkeypatch):
    # sweep 8: the digest keyed the input files by the path as given, so naming the job file by its
    # absolute path, or running it from its folder, ran every job again
    spec = batch(inputs)
    spec["jobs"] = spec["jobs"][:1]
    path = write(tmp_path, spec)
    assert statuses(invoke("run", path, "-q", "--json")) == {"asym": "ok"}
    monkeypatch.chdir(tmp_path)
    assert statuses(invoke("run", path.name, "-q", "--json")) == {"asym": "skipped"}
    monkeypatch.chdir(inputs)
    assert statuses(invoke("run", f"../{path.name}", "-q", "--json")) == {"asym": "skipped"}


def test_a_cluster_gets_every_path_absolute(tmp_path, inputs, monkeypatch):
    # sweep 8: a worker started in another folder read the client's relative paths from its own, and
    # wrote a job's outputs there while the summary said ok
    from qtool.job import plan_jobs

    monkeypatch.chdir(tmp_path)
    spec = batch(inputs)
    spec["defaults"]["output_dir"] = "out/{name}"
    spec["defaults"]["model"] = str(Path("in") / "digits_cnn.onnx")
    write(tmp_path, spec)
    plans = plan_jobs("jobs.yaml")
    assert not plans[0].model.is_absolute()
    shared = plans[0].absolute()
    assert all(Path(p).is_absolute() for p in (shared.model, shared.calibrate_data, shared.verify_data,
                                                shared.table, shared.qmodel, shared.report))
    assert shared.table == tmp_path / "out" / "asym" / "asym.table.yaml" and shared.digest() == plans[0].digest()


def test_an_error_found_while_a_job_runs_names_the_job_keys(tmp_path, inputs):
    # sweep 8: an image folder read as RGB for a 1-channel model said "give --channels gray", a flag
    # the job file has no place for; a one-job file's error named no job file either
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(images / f"{i}.png")
    spec = batch(inputs)
    spec["jobs"] = spec["jobs"][:1]
    spec["defaults"]["calibrate"] = {"data": str(images)}
    spec["defaults"]["verify"] = {"data": str(images)}
    result = invoke("run", write(tmp_path, spec), "-q", "--json")
    outcome = json.loads(result.stdout)[0]
    assert outcome["status"] == "error" and outcome["message"].endswith("give calibrate.preprocess.channels gray")
    single = {k: v for k, v in spec["defaults"].items() if k != "output_dir"} | {"output_dir": str(tmp_path / "one")}
    path = write(tmp_path, single)
    assert_user_error(invoke("run", path, "-q"), f"job file '{path}': input 'input' is [N,1,8,8]",
                      "give calibrate.preprocess.channels gray")


def test_a_key_given_twice_and_jobs_with_a_cluster_are_refused(tmp_path, inputs):
    # sweep 8: two `calibrate:` blocks, the first dropped without a word; --jobs 2 --cluster local:2
    # accepted without saying which applies
    path = tmp_path / "twice.yaml"
    path.write_text(f"model: {inputs / 'digits_cnn.onnx'}\ncalibrate: {{data: {inputs / 'digits_calib.npz'}}}\n"
                    f"calibrate: {{data: x}}\n")
    assert_user_error(invoke("run", path), f"job file '{path}' is not valid YAML at line 3: key 'calibrate' is "
                                           f"given twice in one mapping")
    assert_user_error(invoke("run", write(tmp_path, batch(inputs)), "--jobs", "2", "--cluster", "local:2"),
                      "--jobs and --cluster both say where jobs run")
    assert not (inputs.parent / "out").exists()


def test_a_job_unsets_a_default_with_null(tmp_path, inputs):
    # sweep 8: `verify: {labels: null}` said "expected a string, got None": a job could not drop a key
    # that its defaults set
    spec = batch(inputs)
    spec["jobs"] = spec["jobs"][:1]
    spec["jobs"][0]["verify"] = {"labels": None}
    from qtool.job import plan_jobs

    plans = plan_jobs(write(tmp_path, spec))
    assert "labels" not in plans[0].verify and plans[0].verify["num_samples"] == 128
    assert "labels" in plan_jobs(write(tmp_path, batch(inputs)))[0].verify


def test_an_output_path_too_long_for_the_system_is_one_line(tmp_path, inputs):
    # found beside sweep 8: a name longer than the file system takes was exit 3 ("internal error,
    # OSError: File name too long") in every command and in jobs
    spec = batch(inputs)
    folder = tmp_path / ("x" * 300)
    spec["defaults"]["output_dir"] = str(folder / "{name}")
    path = write(tmp_path, spec)
    assert_user_error(invoke("run", path), f"job file '{path}'", "output_dir: cannot write",
                      "File name too long")
    assert_user_error(invoke("calibrate", inputs / "digits_cnn.onnx", "-d", inputs / "digits_calib.npz",
                             "-o", f"{folder}.yaml"), f"cannot write '{folder}.yaml': File name too long")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or not Path("/proc/self").exists(),
                    reason="root on Linux: /proc passes the writable check and refuses the folder")
def test_an_output_folder_that_cannot_be_made_is_named(tmp_path, inputs):
    # sweep 8: output_dir /proc/nope passed the checks (root may write anywhere) and the error named
    # the hidden staged file '/proc/nope/.digits_cnn.table.partial-PID.yaml'
    spec = batch(inputs)
    spec["jobs"] = spec["jobs"][:1]
    spec["defaults"]["output_dir"] = "/proc/qtool-no-such/{name}"
    result = invoke("run", write(tmp_path, spec), "-q", "--json")
    message = json.loads(result.stdout)[0]["message"]
    assert message.startswith("cannot make the output folder '/proc/qtool-no-such/asym': "), message
