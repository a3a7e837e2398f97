"""``--cluster``: calibrate, verify and run on a real dask.distributed cluster (qtool/cluster.py).

The results must be the single process's, byte for byte: tables, verify's sums, job summaries.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

distributed = pytest.importorskip("distributed")

from qtool import cluster  # noqa: E402
from qtool.calibrate import collect  # noqa: E402
from qtool.verify import Comparison, verify  # noqa: E402
from test_cli import assert_no_crash, assert_user_error, invoke, snapshot  # noqa: E402
from test_jobs_batch import batch, inputs, write  # noqa: E402,F401  (inputs: a fixture)


def _local_cluster(**kwargs):
    """Two worker processes, started as qtool starts its own (cluster.LOCAL_WORKER_CONFIG: no
    statistical profiler, whose sys._current_frames can deadlock a worker on Python 3.11)."""
    import logging

    import dask

    with dask.config.set(cluster.LOCAL_WORKER_CONFIG):
        return distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                        dashboard_address=":0", silence_logs=logging.ERROR, **kwargs)


@pytest.fixture(scope="module")
def scheduler():
    """A scheduler's address with two worker processes, joined as --cluster tcp://... is."""
    with _local_cluster() as running:
        yield running.scheduler_address


def test_shards_are_contiguous_runs_of_whole_batches():
    assert cluster._shards(256, 32, 2) == [(0, 128), (128, 256)]
    assert cluster._shards(540, 8, 3) == [(0, 176), (176, 360), (360, 540)]  # 68 batches: 22, 23, 23
    assert cluster._shards(100, 64, 4) == [(0, 64), (64, 100)]  # no more shards than batches
    assert cluster._shards(5, 8, 2) == [(0, 5)]


@pytest.mark.parametrize("method", ["minmax", "kl", "percentile", "mse"])
def test_calibrate_table_is_the_single_process_table(tmp_path, scheduler, demo_model, demo_calib, method):
    alone, spread = tmp_path / "alone.yaml", tmp_path / "spread.yaml"
    common = ["calibrate", demo_model, "--data", demo_calib, "--method", method, "--batch-size", 32, "-q"]
    assert invoke(*common, "-o", alone).exit_code == 0
    result = invoke(*common, "-o", spread, "--cluster", scheduler)
    assert_no_crash(result)
    assert result.exit_code == 0
    assert spread.read_bytes() == alone.read_bytes()


def test_calibrate_statistics_equal_every_state_array(scheduler, demo_model, demo_calib):
    """Not only the table: every calibrator's state (histogram counts, range, float sums)."""
    alone = collect(demo_model, demo_calib, "kl", progress=False)  # the default batch size
    spread = cluster.collect(scheduler, demo_model, demo_calib, "kl", batch_size=None, progress=False)
    assert spread.samples == alone.samples == 256
    assert list(spread.calibrators) == list(alone.calibrators)
    for name, calibrator in alone.calibrators.items():
        state, other = calibrator.state(), spread.calibrators[name].state()
        assert state.keys() == other.keys()
        for key in state:
            assert np.array_equal(state[key], other[key]), (name, key)


def _figures(report) -> list:
    return [dataclasses.astuple(c)[4:] for c in report.outputs + report.tensors]


def test_verify_sums_are_the_single_process_sums(scheduler, demo_model, qmodel, demo_heldout):
    """Each batch's sums added in batch order: the float64 sums themselves are equal."""
    alone = verify(demo_model, qmodel, demo_heldout, labels="label", batch_size=16, progress=False)
    spread = cluster.verify(scheduler, demo_model, qmodel, demo_heldout, labels="label",
                            batch_size=16, progress=False)
    assert _figures(spread) == _figures(alone)
    assert any(f[0] != 0.0 for f in _figures(alone))
    assert spread.to_dict() == alone.to_dict()
    assert spread.samples == 540 and spread.accuracy == alone.accuracy


def test_comparison_taken_per_batch_and_merged_is_the_running_one():
    rng = np.random.default_rng(0)
    running, merged = Comparison("x"), None
    for _ in range(7):
        ref = rng.standard_normal(1001).astype(np.float32)
        got = (ref + rng.standard_normal(1001).astype(np.float32) / 100).astype(np.float32)
        running.update(ref, got)
        one = Comparison("x")
        one.update(ref, got)
        taken = one.take()
        assert one.dot == one.ref_sq == 0.0  # taken away
        if merged is None:
            merged = taken
        else:
            merged.merge(taken)
    assert dataclasses.astuple(merged) == dataclasses.astuple(running)


def test_verify_cli_on_a_local_cluster_prints_the_same_report(tmp_path, demo_model, qmodel, demo_heldout):
    common = ["verify", demo_model, qmodel, "--data", demo_heldout, "--labels", "label", "-q"]
    alone = invoke(*common)
    spread = invoke(*common, "--cluster", "local:2")
    assert_no_crash(spread)
    assert spread.exit_code == alone.exit_code == 0
    assert spread.stdout == alone.stdout
    assert "cluster: 2 shards of 540 samples on 2 workers" in spread.stderr


def test_verify_cluster_refuses_ort_and_analyze(scheduler, demo_model, qmodel, demo_heldout):
    result = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--ort", "--cluster", scheduler)
    assert_user_error(result, "--ort and --analyze run on one machine")


def test_run_batch_gives_the_summary_of_jobs_2(tmp_path, scheduler, inputs):
    jobs = batch(inputs)
    jobs["jobs"].append({"name": "strict", "verify": {"tolerance": 0.999999}})  # fails verification
    local = write(tmp_path, jobs)
    spread_dir = tmp_path / "spread"
    spread_dir.mkdir()
    jobs["defaults"]["output_dir"] = str(tmp_path / "spread_out" / "{name}")
    spread = write(spread_dir, jobs)

    alone = invoke("run", local, "--jobs", "2", "--json", "-q")
    on_cluster = invoke("run", spread, "--cluster", scheduler, "--json", "-q")
    assert_no_crash(on_cluster)
    assert on_cluster.exit_code == alone.exit_code == 1  # one job failed, the others ran
    rows, cluster_rows = json.loads(alone.stdout), json.loads(on_cluster.stdout)
    assert [(r["name"], r["status"], r["figures"], r["message"]) for r in rows] == \
           [(r["name"], r["status"], r["figures"], r["message"]) for r in cluster_rows]
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
    for row, other in zip(rows, cluster_rows):
        for kind in ("table", "qmodel"):
            assert Path(row["outputs"][kind]).read_bytes() == Path(other["outputs"][kind]).read_bytes()

    again = invoke("run", spread, "--cluster", scheduler, "--json", "-q")  # up to date: skipped
    assert [r["status"] for r in json.loads(again.stdout)] == ["skipped", "skipped", "failed"]


def test_run_one_job_prints_its_full_report_as_without(tmp_path, scheduler, inputs):
    job = batch(inputs)["defaults"] | {"name": "one"}
    alone = invoke("run", write(tmp_path, job), "-q")
    job["output_dir"] = str(tmp_path / "spread" / "{name}")
    (tmp_path / "c").mkdir()
    spread = invoke("run", write(tmp_path / "c", job), "-q", "--cluster", scheduler)
    assert_no_crash(spread)
    assert spread.exit_code == alone.exit_code == 0
    assert spread.stdout == alone.stdout and "PASS" in spread.stdout


class KillOnce(distributed.WorkerPlugin):
    """Kills the worker process that starts a task of ``prefix`` while ``marker`` does not exist
    (creating it first): the first such task dies with its worker, its retry runs elsewhere."""

    def __init__(self, marker: str, prefix: str):
        self.marker, self.prefix = marker, prefix

    def transition(self, key, start, finish, **kwargs):
        if finish == "executing" and str(key).startswith(self.prefix) and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_mid_task_is_survived(tmp_path, demo_model, demo_calib, inputs):
    """A calibration shard and a batch job each kill their worker once: dask runs them again on
    another worker, and the results are those of a run without a death."""
    alone = tmp_path / "alone.yaml"
    out = tmp_path / "calibrated"  # (the jobs write to out/)
    out.mkdir()
    common = ["calibrate", demo_model, "--data", demo_calib, "--method", "kl", "--batch-size", 32, "-q"]
    assert invoke(*common, "-o", alone).exit_code == 0
    jobs = write(tmp_path, batch(inputs))
    with _local_cluster() as running, distributed.Client(running) as client:
        pids = set(client.run(os.getpid).values())
        for name, prefix in (("shard", "qtool-calibrate"), ("job", "execute")):  # run's tasks: job.execute
            client.register_plugin(KillOnce(str(tmp_path / f"killed-{name}"), prefix), name=f"kill-{name}")
        result = invoke(*common, "-o", out / "spread.yaml", "--cluster", running.scheduler_address)
        ran = invoke("run", jobs, "--json", "-q", "--cluster", running.scheduler_address)
    assert_no_crash(result)
    assert result.exit_code == 0, result.stderr
    assert int((tmp_path / "killed-shard").read_text()) in pids  # a worker did die in a task
    assert snapshot(out) == [Path("spread.yaml")]  # nothing half-written beside it
    assert (out / "spread.yaml").read_bytes() == alone.read_bytes()
    assert (tmp_path / "killed-job").exists()
    assert ran.exit_code == 0, ran.stderr
    rows = json.loads(ran.stdout)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    for row in rows:
        assert json.loads(Path(row["outputs"]["report"]).read_text())["job_failures"] == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_scheduler_is_one_line(tmp_path, monkeypatch, demo_model, demo_calib):
    monkeypatch.setattr(cluster, "CONNECT_TIMEOUT", 1)
    address = f"tcp://127.0.0.1:{_free_port()}"
    result = invoke("calibrate", demo_model, "--data", demo_calib, "-o", tmp_path / "t.yaml", "-q",
                    "--cluster", address)
    assert_user_error(result, f"cannot reach the dask scheduler at '{address}'")
    assert snapshot(tmp_path) == []


@pytest.mark.parametrize("answer", [None, b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"],
                         ids=["silent", "http"])
def test_a_server_that_is_no_scheduler_is_one_line_in_seconds(tmp_path, monkeypatch, demo_model, demo_calib,
                                                              answer):
    # sweep 8: a port that accepts and never answers hung for ever; an HTTP server's bytes read as a
    # frame length gave "internal error, MemoryError: Unable to allocate 3.07 EiB" (exit 3)
    import threading
    import time

    monkeypatch.setattr(cluster, "CONNECT_TIMEOUT", 1)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    held = []

    def serve():
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            held.append(connection)
            if answer is not None:
                connection.recv(65536)
                connection.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    start = time.perf_counter()
    try:
        result = invoke("calibrate", demo_model, "--data", demo_calib, "-o", tmp_path / "t.yaml", "-q",
                        "--cluster", address)
    finally:
        server.close()
        for connection in held:
            connection.close()
    assert time.perf_counter() - start < 10
    line = assert_user_error(result, f"cannot reach the dask scheduler at '{address}'")
    assert ("no answer in 1 s" if answer is None else "its answer is not dask's") in line
    assert snapshot(tmp_path) == []


@pytest.mark.parametrize("address, message", [
    ("scheduler:8786", "--cluster takes local, local:N or a scheduler address"),
    ("local:0", "--cluster local:N takes a number of workers N >= 1, got 'local:0'"),
    ("local:two", "got 'local:two'"),
])
def test_bad_address_is_one_line(tmp_path, demo_model, demo_calib, address, message):
    result = invoke("calibrate", demo_model, "--data", demo_calib, "-o", tmp_path / "t.yaml",
                    "--cluster", address)
    assert_user_error(result, message)


def test_without_dask_the_error_says_what_to_install(tmp_path, monkeypatch, demo_model, demo_calib):
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed raises ImportError
    result = invoke("calibrate", demo_model, "--data", demo_calib, "-o", tmp_path / "t.yaml",
                    "--cluster", "local:2")
    assert_user_error(result, "pip install 'qtool[dask]'")
    assert result.stderr.startswith("error: --cluster needs dask.distributed")


def test_moving_average_is_refused(tmp_path, demo_model, demo_calib):
    result = invoke("calibrate", demo_model, "--data", demo_calib, "-o", tmp_path / "t.yaml",
                    "--param", "moving_average=0.1", "--cluster", "local:2")
    assert_user_error(result, "moving_average", "without --cluster")


def test_dask_is_not_imported_without_cluster(tmp_path, demo_model, demo_calib):
    script = ("import sys\nfrom qtool.cli import main\nsys.argv = ['qtool', *sys.argv[1:]]\n"
              "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
              "print(code, sorted(m for m in ('dask', 'distributed') if m in sys.modules))\n")
    table = tmp_path / "t.yaml"

    def run(*more: str) -> str:
        done = subprocess.run([sys.executable, "-c", script, "calibrate", str(demo_model), "--data",
                               str(demo_calib), "-o", str(table), "-q", *more],
                              capture_output=True, text=True, timeout=120)
        return done.stdout.strip()

    assert run() == "0 []"
    assert yaml.safe_load(table.read_text())["samples"] == 256
    # the check sees dask when it is imported: a --cluster whose address dask refuses
    assert run("--cluster", "nowhere://x") == "2 ['dask', 'distributed']"


def test_local_workers_run_without_the_statistical_profiler():
    """qtool's local workers start without dask's profiler (cluster.LOCAL_WORKER_CONFIG): its
    sys._current_frames every 10 ms deadlocked a worker once in CI, a full garbage collection's
    callback inside it waiting for the GIL while a qtool/runs.py thread ended."""
    def settings():
        import dask

        return (dask.config.get("distributed.worker.profile.enabled"),
                dask.config.get("distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_", None))

    with cluster.connect("local:2") as client:
        assert set(client.run(settings).values()) == {(False, None)}
