"""Shell pipelines: ``-`` for tables on standard input and output, data on stdout and logs on
stderr, --json summaries, and exit codes in every command's help."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_cli import COMMANDS, assert_no_crash, assert_user_error, invoke, snapshot


def _qtool() -> str:
    return shutil.which("qtool") or str(Path(sys.executable).parent / "qtool")


def test_calibrate_to_stdout_equals_the_file_and_logs_stay_on_stderr(tmp_path, demo_model, demo_calib):
    piped = invoke("calibrate", demo_model, "-d", demo_calib, "-o", "-")
    assert_no_crash(piped)
    assert piped.exit_code == 0
    assert "calibrated 14 tensors" in piped.stderr and "standard output" in piped.stderr
    written = invoke("calibrate", demo_model, "-d", demo_calib, "-o", tmp_path / "t.yaml", "-q")
    assert written.exit_code == 0
    assert piped.stdout == (tmp_path / "t.yaml").read_text()  # nothing but the table on stdout
    assert yaml.safe_load(piped.stdout)["qtool_table"] == 1


def test_calibrate_pipe_into_quantize_then_verify(tmp_path, demo_model, demo_calib, demo_heldout):
    """A real shell pipe through the installed console script."""
    qmodel = tmp_path / "q.onnx"
    script = (f"'{_qtool()}' calibrate '{demo_model}' -d '{demo_calib}' -o - -q "
              f"| '{_qtool()}' quantize '{demo_model}' -t - -o '{qmodel}' --json "
              f"&& '{_qtool()}' verify '{demo_model}' '{qmodel}' -d '{demo_heldout}' -q --json")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    decoder = json.JSONDecoder()  # two JSON documents, one after the other
    quantize_report, end = decoder.raw_decode(result.stdout)
    verify_report, _ = decoder.raw_decode(result.stdout[end:].lstrip())
    assert quantize_report["quantized"]["Conv"] == 4
    assert verify_report["passed"] is True and verify_report["samples"] == 540
    assert "Traceback" not in result.stderr


def test_other_table_formats_go_through_pipes(tmp_path, demo_model, demo_calib):
    trt = invoke("calibrate", demo_model, "-d", demo_calib, "-o", "-", "--format", "trt", "-q")
    assert trt.exit_code == 0 and trt.stdout.startswith("TRT-8601-MinMaxCalibration\n")
    table = tmp_path / "t.yaml"
    assert invoke("calibrate", demo_model, "-d", demo_calib, "-o", table, "-q").exit_code == 0
    converted = invoke("convert-table", table, "-o", "-", "--to", "cali_table")
    assert_no_crash(converted)
    assert converted.exit_code == 0
    rows = [line.split() for line in converted.stdout.splitlines() if not line.startswith("#")]
    assert rows[0][0] == "input" and len(rows) == 14 and all(len(r) == 4 for r in rows)


def test_calibrate_json_summary(tmp_path, demo_model, demo_calib):
    result = invoke("calibrate", demo_model, "-d", demo_calib, "-o", tmp_path / "t.yaml", "--json", "-q")
    assert_no_crash(result)
    summary = json.loads(result.stdout)
    assert summary["tensors"] == 14 and summary["samples"] == 256 and summary["method"] == "minmax"
    assert summary["output"] == str(tmp_path / "t.yaml") and summary["stats_out"] is None


def test_json_and_table_on_stdout_conflict(tmp_path, demo_model, demo_calib):
    before = snapshot(tmp_path)
    assert_user_error(invoke("calibrate", demo_model, "-d", demo_calib, "-o", "-", "--json"),
                      "--json and -o -", "choose one")
    assert snapshot(tmp_path) == before


def test_empty_table_on_stdin_is_a_user_error(tmp_path, demo_model):
    before = snapshot(tmp_path)
    result = subprocess.run([_qtool(), "quantize", str(demo_model), "-t", "-", "-o", str(tmp_path / "q.onnx")],
                            input="", capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == "error: table file '<stdin>' is empty\n"
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "version"])
def test_every_command_documents_its_exit_codes(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "Exit codes: 0 ok, 1 verification failed, 2 user error" in " ".join(result.stdout.split())


def test_exec_json_report(tmp_path, demo_model, demo_table, demo_heldout):
    from qtool.quantize import quantize

    qmodel, _ = quantize(demo_model, demo_table)
    path = tmp_path / "q.onnx"
    path.write_bytes(qmodel.SerializeToString())
    result = invoke("exec", path, "-i", demo_heldout, "-o", tmp_path / "y.npz", "--json")
    assert_no_crash(result)
    report = json.loads(result.stdout)
    assert report["integer_steps"] == 13 and report["float_nodes"] == []
    assert report["outputs"] == {"logits": [540, 10]}


def test_merge_json_summary_and_stdout_conflict(tmp_path, demo_model, demo_calib):
    part = tmp_path / "part.npz"
    assert invoke("calibrate", demo_model, "-d", demo_calib, "--stats-out", part, "-q").exit_code == 0
    result = invoke("merge", part, "-o", tmp_path / "t.yaml", "--json")
    assert_no_crash(result)
    assert json.loads(result.stdout) == {"files": [str(part)], "tensors": 14, "samples": 256,
                                         "method": "minmax", "output": str(tmp_path / "t.yaml")}
    assert_user_error(invoke("merge", part, "-o", "-", "--json"), "--json and -o -")
