"""Outputs never replace what is not a regular file: symlinks are followed, devices and fifos are
written through, ``-`` is standard output, and several outputs of one command land all or none."""

import io
import json
import os
import stat
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest

from qtool.errors import QtoolError
from qtool.fileio import atomic_write, check_writable, write_all

from test_cli import assert_user_error, invoke


def _leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_symlink_is_followed_and_kept(tmp_path):
    target = tmp_path / "real.bin"
    target.write_bytes(b"old")
    link = tmp_path / "link.bin"
    link.symlink_to(target.name)
    atomic_write(link, b"new")
    assert link.is_symlink() and os.readlink(link) == "real.bin"
    assert target.read_bytes() == b"new" and _leftovers(tmp_path) == []


def test_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link.bin"
    link.symlink_to("made.bin")
    atomic_write(link, b"data")
    assert link.is_symlink() and (tmp_path / "made.bin").read_bytes() == b"data"


def test_fifo_is_written_through_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    atomic_write(fifo, b"through the pipe")
    reader.join(10)
    assert got == [b"through the pipe"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and _leftovers(tmp_path) == []


def test_dev_null_stays_a_device():
    check_writable("/dev/null")
    atomic_write("/dev/null", b"discarded")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_all_outputs_or_none(tmp_path):
    first = tmp_path / "first.txt"
    first.write_bytes(b"old")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(QtoolError, match="cannot write"):
        write_all([(first, b"new"), (tmp_path / "file" / "second.txt", b"x")])
    assert first.read_bytes() == b"old" and _leftovers(tmp_path) == []
    write_all([(first, b"new"), (tmp_path / "second.txt", b"x")])
    assert first.read_bytes() == b"new" and (tmp_path / "second.txt").read_bytes() == b"x"


def test_quantize_to_standard_output(tmp_path, demo_model, demo_table):
    from qtool.table_formats import write_table

    table = tmp_path / "t.yaml"
    write_table(demo_table, table)
    result = invoke("quantize", demo_model, "-t", table, "-o", "-")
    assert result.exit_code == 0, result.output
    model = onnx.load_from_string(result.stdout_bytes)
    assert any(n.op_type == "QuantizeLinear" for n in model.graph.node)
    assert "integer: " in result.stderr and "-> -" in result.stderr  # the report went to stderr
    assert not (tmp_path / "-").exists() and not os.path.exists("-")


def test_quantize_to_standard_output_refuses_a_second_writer(tmp_path, demo_model, demo_table):
    from qtool.table_formats import write_table

    table = tmp_path / "t.yaml"
    write_table(demo_table, table)
    assert_user_error(invoke("quantize", demo_model, "-t", table, "-o", "-", "--json"),
                      "-o - and --json would both write to standard output")
    assert_user_error(invoke("quantize", demo_model, "-t", table, "-o", "-", "--params-out", "-"),
                      "-o - and --params-out - would both write to standard output")


def test_exec_to_standard_output(qmodel, demo_heldout):
    result = invoke("exec", qmodel, "--input", demo_heldout, "-o", "-", "-q")
    assert result.exit_code == 0, result.output
    outputs = np.load(io.BytesIO(result.stdout_bytes))
    assert list(outputs.keys()) == ["logits"] and len(outputs["logits"]) == len(np.load(demo_heldout)["input"])
    assert_user_error(invoke("exec", qmodel, "--input", demo_heldout, "-o", "-", "--json"),
                      "--json and -o - would both write to standard output")


def test_verify_html_report_needs_a_file(demo_model, qmodel, demo_heldout):
    assert_user_error(invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--report", "-"),
                      "--report needs a file name")


def test_quantize_through_a_symlink_and_into_dev_null(tmp_path, demo_model, demo_table):
    from qtool.table_formats import write_table

    table = tmp_path / "t.yaml"
    write_table(demo_table, table)
    (tmp_path / "real.onnx").write_bytes(b"old")
    (tmp_path / "model.onnx").symlink_to("real.onnx")
    result = invoke("quantize", demo_model, "-t", table, "-o", tmp_path / "model.onnx",
                    "--params-out", "/dev/null")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "model.onnx").is_symlink()
    onnx.load(str(tmp_path / "real.onnx"))
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


# -- interruptions ------------------------------------------------------------------------------

_SLOW = """
import sys, time
import qtool.{module} as target
def slow(*args, **kwargs):
    print("working", file=sys.stderr, flush=True)
    time.sleep(60)
target.{function} = slow
from qtool.cli import main
sys.argv = ["qtool"] + sys.argv[1:]
main()
"""


def _interrupted(tmp_path, module: str, function: str, *args) -> tuple[int, str]:
    """Run ``qtool ARGS`` with ``module.function`` made slow, Ctrl-C it once it is there: (exit
    code, stderr after the 'working' line)."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "slow.py"
    script.write_text(_SLOW.format(module=module, function=function))
    # SIGINT handled as in a terminal, even where pytest itself runs with it ignored (a background
    # job of a shell without job control), which a child would inherit and qtool then leaves alone
    proc = subprocess.Popen([sys.executable, str(script), *map(str, args)], stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr.readline() == "working\n"
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        return proc.wait(30), rest
    finally:
        proc.kill()


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, demo_model, demo_calib):
    code, err = _interrupted(tmp_path, "calibrate", "collect", "calibrate", demo_model, "-d", demo_calib,
                             "-o", tmp_path / "t.yaml")
    assert (code, err) == (130, "error: interrupted\n"), err  # the whole line when it is another
    assert not (tmp_path / "t.yaml").exists() and _leftovers(tmp_path) == []


def _demo_job(tmp_path, demo_model, demo_calib, demo_heldout, verify_extra: str = ""):
    """A one-job file on the demo, its outputs in tmp_path/out."""
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {demo_model}\noutput_dir: {tmp_path / 'out'}\n"
                   f"calibrate: {{data: {demo_calib}, batch_size: 64}}\n"
                   f"verify: {{data: {demo_heldout}, num_samples: 64{verify_extra}}}\n")
    return job


def test_interrupted_job_keeps_the_previous_outputs(tmp_path, demo_model, demo_calib, demo_heldout):
    job = _demo_job(tmp_path, demo_model, demo_calib, demo_heldout)
    first = invoke("run", job, "-q")
    assert first.exit_code == 0, first.output
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert len(before) == 3
    # the new table and model are written, then Ctrl-C during verify
    code, err = _interrupted(tmp_path, "job", "verify", "run", job, "--force", "-q")
    assert code == 130 and err.endswith("error: interrupted\n"), err
    after = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert after == before  # the same files, byte for byte, and no staged ones left


# -- progress on a stderr that is no terminal ----------------------------------------------------

def test_long_steps_print_a_line_now_and_then_when_stderr_is_a_log(monkeypatch, capsys):
    import time

    from qtool import report

    monkeypatch.setattr(report, "HEARTBEAT_SECONDS", 0.2)
    start = time.monotonic()
    with report.progress_bar(12, "verify", True) as bar:
        for _ in range(12):
            time.sleep(0.05)
            bar.update(1)
    elapsed = time.monotonic() - start
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("verify: ") and "/12 samples" in line and "left" in line
                         for line in lines), lines
    # whole lines, at most one per 0.2 s (however slow the machine), none in the first 0.2 s
    assert "\r" not in "".join(lines) and len(lines) <= elapsed / 0.2
    with report.progress_bar(12, "verify", False) as bar:  # --quiet
        for _ in range(12):
            time.sleep(0.05)
            bar.update(1)
    assert capsys.readouterr().err == ""
    with report.progress_bar(3, "int16 placement", True, unit="try") as bar:  # sweep 12 read "3/3 trys"
        for _ in range(3):
            time.sleep(0.15)
            bar.update(1)
    lines = capsys.readouterr().err.splitlines()
    assert lines and all("/3 tries," in line for line in lines), lines


def test_usage_errors_point_to_the_command_s_help_and_version_prints():
    import subprocess
    import sys

    def qtool(*args):
        return subprocess.run([sys.executable, "-c", "from qtool.cli import main; main()", *args],
                              capture_output=True, text=True, timeout=60)

    bad = qtool("quantize", "--bogus")
    assert (bad.returncode, bad.stderr) == (2, "error: No such option: --bogus (see qtool quantize --help)\n")
    from qtool import __version__
    version = qtool("--version")
    assert (version.returncode, version.stdout) == (0, f"{__version__}\n")


def test_the_params_metadata_can_be_left_out(tmp_path, demo_model, demo_table):
    from qtool.params import model_params
    from qtool.table_formats import write_table

    write_table(demo_table, tmp_path / "t.yaml")
    sizes = {}
    for flag in ("--params-metadata", "--no-params-metadata"):
        q = tmp_path / f"{flag}.onnx"
        result = invoke("quantize", demo_model, "-t", tmp_path / "t.yaml", "-o", q, flag)
        assert result.exit_code == 0, result.output
        sizes[flag] = q.stat().st_size
        assert f"-> {q.stat().st_size} bytes" in result.stdout
    kept, left = (onnx.load(tmp_path / f"{f}.onnx") for f in ("--params-metadata", "--no-params-metadata"))
    assert "qtool.params" not in {p.key for p in left.metadata_props}
    assert sizes["--no-params-metadata"] < sizes["--params-metadata"]
    assert model_params(left) == model_params(kept)  # derived again from the graph


def test_a_folder_made_for_an_output_is_said(tmp_path, demo_model, demo_calib):
    out = tmp_path / "new" / "deeper" / "t.yaml"
    result = invoke("calibrate", demo_model, "-d", demo_calib, "-o", out)
    assert result.exit_code == 0, result.output
    assert f"made folder '{tmp_path / 'new'}'" in result.stderr and out.exists()
    again = invoke("calibrate", demo_model, "-d", demo_calib, "-o", out)
    assert "made folder" not in again.stderr  # it exists now
    quiet = invoke("calibrate", demo_model, "-d", demo_calib, "-o", tmp_path / "other" / "t.yaml", "-q")
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_a_job_writes_the_html_report_when_asked(tmp_path, demo_model, demo_calib, demo_heldout):
    job = _demo_job(tmp_path, demo_model, demo_calib, demo_heldout, ", report: true")
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["digits_cnn.q.onnx", "digits_cnn.table.yaml", "digits_cnn.verify.html", "digits_cnn.verify.json"]
    html = (tmp_path / "out" / "digits_cnn.verify.html").read_text()
    assert "digits_cnn.q.onnx" in html and ".partial" not in html
    recorded = json.loads((tmp_path / "out" / "digits_cnn.verify.json").read_text())["job"]["outputs"]
    assert "digits_cnn.verify.html" in recorded  # by name: the outputs sit beside the report
    # up to date: skipped; the page removed: run again
    assert "skipped" in invoke("run", job, "--json", "-q").stdout
    (tmp_path / "out" / "digits_cnn.verify.html").unlink()
    assert '"ok"' in invoke("run", job, "--json", "-q").stdout


def test_unnamed_nodes_are_listed_by_op_type_and_place():
    from onnx import TensorProto, helper

    from qtool.executor import IntegerExecutor

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Erf", ["r"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    names = [name for _, name, _ in IntegerExecutor(helper.make_model(graph)).float_nodes()]
    assert names == ["Relu #0 (unnamed)", "Erf #1 (unnamed)"]


def test_dev_stdout_redirected_to_a_file_is_written_through(tmp_path, demo_model, demo_calib):
    import subprocess
    import sys

    target = tmp_path / "table.yaml"
    with open(target, "wb") as out:
        inode = os.fstat(out.fileno()).st_ino
        done = subprocess.run([sys.executable, "-c", "from qtool.cli import main; main()", "calibrate", str(demo_model),
                               "-d", str(demo_calib), "-o", "/dev/stdout", "-q"], stdout=out, timeout=120)
    assert done.returncode == 0
    assert os.stat(target).st_ino == inode  # the shell's file, written into, not replaced
    assert target.read_text().startswith("qtool_table: 1")


_SLOW_JOBS = """
import os, sys, time
import qtool.job as job

def slow(*args, **kwargs):
    os.write(2, b"working\\n")  # one write: two workers' lines do not interleave
    time.sleep(60)

job.quantize_with_data = slow  # also in run's spawned workers, which import this file as __mp_main__
if __name__ == "__main__":
    from qtool.cli import main
    sys.argv = ["qtool"] + sys.argv[1:]
    main()
"""


def _running_in_group(group: int) -> list[int]:
    """The processes of process group ``group`` that still run (not zombies: an orphan's exit is
    reaped by whoever adopts it, which in a container may be never)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found.append(int(entry.parent.name))
    return found


@pytest.mark.parametrize("name, code, line", [("SIGTERM", 143, "error: terminated"), ("SIGHUP", 129, "error: hung up"),
                                              ("SIGKILL", -9, None)])
def test_a_signal_to_a_run_stops_its_workers_and_leaves_nothing(tmp_path, demo_model, demo_calib, demo_heldout,
                                                                name, code, line):
    """SIGTERM sent to `qtool run --jobs 2` alone (not its process group, as `kill PID` does):
    the files sweep found its workers still running minutes later, holding its output streams
    open, and staged files left beside the outputs. Now the workers are stopped, each removes its
    staged files, and run exits 143 with one line. SIGHUP (a closed terminal) likewise, 129;
    sweep 8: after SIGKILL the workers finished their jobs, replaced the outputs and waited for
    ever; now they notice, stop their jobs (removing the staged files) and exit."""
    import os
    import signal
    import subprocess
    import sys

    job = tmp_path / "jobs.yaml"
    job.write_text(f"defaults:\n  model: {demo_model}\n  output_dir: {tmp_path / 'out'}/{{name}}\n"
                   f"  calibrate: {{data: {demo_calib}, batch_size: 64}}\n"
                   f"  verify: {{data: {demo_heldout}, num_samples: 64}}\n"
                   f"jobs:\n  - {{name: a}}\n  - {{name: b}}\n  - {{name: c}}\n")
    script = tmp_path / "slow_jobs.py"
    script.write_text(_SLOW_JOBS)
    proc = subprocess.Popen([sys.executable, str(script), "run", str(job), "--jobs", "2", "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True)
    group = proc.pid  # its own session: every process it starts stays in this group
    try:
        assert proc.stderr.readline() == "working\n"  # a worker is inside its job
        proc.send_signal(getattr(signal, name))
        assert proc.wait(60) == code
        if line is not None:
            rest = proc.stderr.read()
            assert rest.strip().splitlines()[-1] == line, rest
        for _ in range(100):  # the workers are gone with it (and the pool's resource tracker)
            if not _running_in_group(group):
                break
            import time
            time.sleep(0.1)
        else:
            raise AssertionError(f"processes of the run are still alive: {_running_in_group(group)}")
        left = [str(p) for p in (tmp_path / "out").rglob("*")] if (tmp_path / "out").exists() else []
        assert not [p for p in left if ".partial" in p], left
    finally:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("name, code, line", [("SIGINT", 130, "error: interrupted"), ("SIGTERM", 143, "error: terminated")])
def test_a_signal_while_the_console_script_imports_stops_with_one_line(tmp_path, name, code, line):
    """Ctrl-C in the first quarter second (the imports) printed a KeyboardInterrupt traceback or
    'internal error, ImportError: initialization failed' (the files sweep). qtool.entry only notes
    a signal then; main stops with its line before any work."""
    import subprocess
    import sys

    script = (f"import os, signal, sys\nimport qtool.entry as entry\n"
              f"signal.signal(signal.{name}, entry._note)\nos.kill(os.getpid(), signal.{name})\n"
              f"sys.argv = ['qtool', 'version']\nfrom qtool.cli import main\nmain()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert (done.returncode, done.stderr, done.stdout) == (code, line + "\n", ""), done


def test_a_swallowed_ctrl_c_still_leaves_the_previous_output(tmp_path, demo_model, demo_calib):
    """The files sweep: Ctrl-C while numba compiled was swallowed in its callback ('Exception
    ignored'); exec went on, exited 0 and replaced its output. A signal once received, no output
    is put in place and the command exits 130."""
    import subprocess
    import sys

    script = ("import signal, sys\nimport qtool.errors as errors\nimport qtool.calibrate as calibrate\n"
              "real = calibrate.collect\n"
              "def collect(*args, **kwargs):\n"
              "    errors.STOP.append(signal.SIGINT)  # as the handler does, its exception lost on the way\n"
              "    return real(*args, **kwargs)\n"
              "calibrate.collect = collect\n"
              "from qtool.cli import main\nsys.argv = ['qtool'] + sys.argv[1:]\nmain()\n")
    table = tmp_path / "t.yaml"
    table.write_text("previous\n")
    done = subprocess.run([sys.executable, "-c", script, "calibrate", str(demo_model), "-d", str(demo_calib),
                           "-o", str(table), "-q"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert (done.returncode, done.stderr) == (130, "error: interrupted\n"), done
    assert table.read_text() == "previous\n" and _leftovers(tmp_path) == []


@pytest.mark.parametrize("command", ["calibrate", "quantize-params", "quantize-table"])
def test_two_outputs_at_one_path_are_refused(tmp_path, demo_model, demo_calib, demo_table, command):
    # one of them was silently lost (the files sweep): calibrate -o x --stats-out x, quantize -o q
    # --params-out q or --table-out q
    from test_cli import assert_user_error
    from qtool.table_formats import write_table

    same = tmp_path / "same.out"
    write_table(demo_table, tmp_path / "t.yaml")
    demo_table = tmp_path / "t.yaml"
    args, second = {"calibrate": (["calibrate", demo_model, "-d", demo_calib, "-o", same, "--stats-out", same],
                                  "--stats-out"),
                    "quantize-params": (["quantize", demo_model, "-t", demo_table, "-o", same, "--params-out", same],
                                        "--params-out"),
                    "quantize-table": (["quantize", demo_model, "-t", demo_table, "-o", same, "--data", demo_calib,
                                        "--table-out", same], "--table-out")}[command]
    assert_user_error(invoke(*args), f"-o and {second} both name '{same}'; give each its own file")
    assert not same.exists()


def test_the_size_line_counts_a_model_s_external_data(tmp_path, demo_model, demo_table):
    # sweep 6: a ResNet-18 of a 91 KB graph and a 45 MB weights file read '91179 -> 11742149 bytes'
    from qtool.table_formats import write_table

    write_table(demo_table, tmp_path / "t.yaml")
    demo_table = tmp_path / "t.yaml"
    model = onnx.load(str(demo_model))
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.weights", size_threshold=0)
    on_disk = (tmp_path / "m.onnx").stat().st_size + (tmp_path / "m.weights").stat().st_size
    result = invoke("quantize", tmp_path / "m.onnx", "-t", demo_table, "-o", tmp_path / "q.onnx")
    assert result.exit_code == 0, result.output
    assert f"size:    {on_disk} -> " in result.output and (tmp_path / "m.weights").stat().st_size > 10000


def _console(*args, timeout=120):
    """``qtool ARGS`` as the console script runs it (usage errors are one line only there)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", "from qtool.cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("option", ["-o", "--stats-out"])
def test_an_output_path_ending_in_a_slash_is_refused(tmp_path, demo_model, demo_calib, option):
    # the files sweep: pathlib drops the slash, and '-o newdir/' wrote a file named 'newdir'
    folder = f"{tmp_path / 'newdir'}/"
    args = ["calibrate", demo_model, "-d", demo_calib, "-q", option, folder]
    if option != "-o":
        args += ["-o", tmp_path / "t.yaml"]
    done = _console(*args)
    assert done.returncode == 2 and done.stdout == "", done
    named = "'--output' / '-o'" if option == "-o" else f"'{option}'"
    assert done.stderr == (f"error: Invalid value for {named}: '{folder}' names a folder; give a file path "
                           f"(see qtool calibrate --help)\n"), done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_loop_of_symlinks_is_refused_not_replaced(tmp_path, demo_model, demo_calib):
    # the files sweep: the loop was replaced by a regular file, and exit 0
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.symlink_to(second.name)
    second.symlink_to(first.name)
    assert_user_error(invoke("calibrate", demo_model, "-d", demo_calib, "-o", first, "-q"),
                      f"cannot write '{first}': it is a loop of symlinks")
    assert first.is_symlink() and os.readlink(first) == "b.yaml"
    with pytest.raises(QtoolError, match="loop of symlinks"):
        atomic_write(second, b"x")
    assert second.is_symlink() and os.readlink(second) == "a.yaml"


def test_a_link_to_a_folder_is_named_as_given(tmp_path, demo_model, demo_calib):
    (tmp_path / "folder").mkdir()
    link = tmp_path / "out.yaml"
    link.symlink_to("folder")
    assert_user_error(invoke("calibrate", demo_model, "-d", demo_calib, "-o", link, "-q"),
                      f"cannot write '{link}': it is a link to a directory")


def test_a_table_through_a_pipe_is_read_and_a_model_or_data_refused(tmp_path, demo_model, demo_calib, demo_table):
    # `quantize -t <(qtool calibrate ... -o -)` said "table file '/dev/fd/63' not found"
    from qtool.table_formats import write_table

    write_table(demo_table, tmp_path / "t.yaml")
    fifo = tmp_path / "pipe"
    for given, expected in ((tmp_path / "t.yaml", 0), (fifo, 0)):
        if given == fifo:
            os.mkfifo(fifo)
            writer = threading.Thread(target=lambda: fifo.write_bytes((tmp_path / "t.yaml").read_bytes()))
            writer.start()
        done = invoke("quantize", demo_model, "-t", given, "-o", tmp_path / f"{given.name}.onnx", "-q")
        assert done.exit_code == expected, done.output
    writer.join(10)
    assert (tmp_path / "pipe.onnx").read_bytes() == (tmp_path / "t.yaml.onnx").read_bytes()
    assert_user_error(invoke("calibrate", fifo, "-d", demo_calib, "-o", tmp_path / "x.yaml"),
                      f"model file '{fifo}' is not a regular file (a pipe or a device)")
    assert_user_error(invoke("calibrate", demo_model, "-d", fifo, "-o", tmp_path / "x.yaml"),
                      f"data file '{fifo}' is not a regular file (a pipe or a device)")
