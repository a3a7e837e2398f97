"""``--cluster ADDRESS``: calibrate, verify and batch jobs on a dask.distributed cluster.

ADDRESS is ``local`` or ``local:N`` (a ``LocalCluster`` of N worker processes, one thread each,
started here and stopped at the end) or a running scheduler's address (``tcp://HOST:PORT``).

What travels: to the workers, paths, settings and sample ranges, never arrays; the workers read
the model and the data themselves, so they need the same files at the same paths (a shared
filesystem). Back come statistics (calibrate), figures (verify) or a job's outcome (run); the
client merges them in sample order and writes every output, so a worker that dies leaves nothing
half-written: dask runs its task again on another worker.

Exactness: a shard is a contiguous run of the very batches a single process runs (the batch size
is chosen here, as ``collect`` and ``verify`` choose it), and shards merge in sample order.
- calibrate: min/max merge exactly, histogram counts exactly (power-of-two ranges), so minmax,
  percentile, kl and mse give the single-process table byte for byte. ACIQ's mean and spread come
  from float sums, added per shard and then across shards: their thresholds can differ in the
  last bits. A histogram's edge case, shared with ``qtool merge``: a value exactly at a
  power-of-two range, binned before the range grows, lands one bin lower than binned after.
  ``minmax`` with ``moving_average`` depends on every batch before and is refused.
- verify: each batch's sums come back on their own and are added in batch order, as a single
  process adds them, so every figure is identical.

dask is imported only here, and only when ``--cluster`` is given.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import threading
import uuid
from pathlib import Path

from .batching import DEFAULT_LAYERS
from .errors import QtoolError
from .model import first_line
from .report import progress_bar

CONNECT_TIMEOUT = 5  # seconds to reach a scheduler, and for it to have a worker
# a task that raised is not run again: its error (a NaN in a shard's data) is the data's, and the retry
# printed it twice; a lost worker's tasks are rescheduled by dask anyway
RETRIES = 0
INSTALL = "pip install 'qtool[dask]'"


def _distributed():
    try:
        return importlib.import_module("distributed")
    except ImportError:
        raise QtoolError(f"--cluster needs dask.distributed, which is not installed: {INSTALL}") from None


# what qtool's local workers start with:
# - without the glibc trim threshold dask sets in its workers' environment (None unsets it): with
#   it, every large array is a fresh mmap (verify on PP-OCR cls 7.3 s instead of 3.3 s);
# - without dask's statistical profiler: every 10 ms it reads every thread's frame
#   (sys._current_frames), and on Python 3.11 a full garbage collection inside that read, whose
#   callback (dask's GC diagnosis) waits for the GIL while holding the interpreter's thread list,
#   deadlocks a thread that is ending (a fresh clone's CI hung once in a `run --cluster` job, the
#   worker's main thread in the GC callback under sys._current_frames and a ThreadPoolExecutor
#   thread of qtool/runs.py waiting on a lock, for good).
LOCAL_WORKER_CONFIG = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
                       "distributed.worker.profile.enabled": False}


@contextlib.contextmanager
def connect(address: str):
    """A ``distributed.Client`` on ADDRESS (see the module's docstring), closed on exit."""
    if address == "local" or address.startswith("local:"):
        workers = _local_workers(address)
        distributed = _distributed()
        import logging

        import dask

        with dask.config.set(LOCAL_WORKER_CONFIG):
            cluster = _started_ignoring_ctrl_c(lambda: distributed.LocalCluster(
                n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                silence_logs=logging.CRITICAL))
            with cluster, distributed.Client(cluster) as client:
                yield client
        return
    if "://" not in address:
        raise QtoolError(f"--cluster takes local, local:N or a scheduler address such as "
                         f"tcp://HOST:8786, got '{address}'")
    client = _client(_distributed(), address)
    with client:
        try:
            client.wait_for_workers(1, timeout=CONNECT_TIMEOUT)
        except (OSError, TimeoutError):
            raise QtoolError(f"the dask scheduler at '{address}' has no workers; start some with "
                             f"'dask worker {address}'") from None
        yield client


def _started_ignoring_ctrl_c(start):
    """``start()`` (a LocalCluster) with SIGINT ignored while its workers start, so that they
    ignore it (a process started with SIGINT ignored keeps ignoring it, Python included): a
    terminal's Ctrl-C goes to the whole process group, and each worker printed its
    KeyboardInterrupt traceback (68 lines before 'error: interrupted'); the client stops them.
    The client's own handler is back as soon as they run."""
    import signal

    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to change
        return start()
    try:
        return start()
    finally:
        signal.signal(signal.SIGINT, previous)


def _client(distributed, address: str):
    """A Client on a running scheduler, or one line within ``CONNECT_TIMEOUT`` seconds and a few:
    something that accepts the connection but is no scheduler never answers dask's handshake (the
    Client waited for ever), and one that answers another protocol has its bytes read as a frame
    length (an HTTP server: "MemoryError: Unable to allocate 3.07 EiB", exit 3)."""
    made: dict = {}

    def make() -> None:
        try:
            made["client"] = distributed.Client(address, timeout=CONNECT_TIMEOUT)
        except Exception as e:  # whatever the bytes made dask raise
            made["error"] = e

    thread = threading.Thread(target=make, name="qtool-connect", daemon=True)
    thread.start()
    thread.join(CONNECT_TIMEOUT + 2)
    if thread.is_alive():
        raise QtoolError(f"cannot reach the dask scheduler at '{address}': no answer in {CONNECT_TIMEOUT} s "
                         f"(is a dask scheduler listening there?)")
    error = made.get("error")
    if isinstance(error, (OSError, TimeoutError, ValueError)):
        raise QtoolError(f"cannot reach the dask scheduler at '{address}': {first_line(error)}")
    if error is not None:
        raise QtoolError(f"cannot reach the dask scheduler at '{address}': its answer is not dask's "
                         f"({type(error).__name__}: {first_line(error)})")
    return made["client"]


def _local_workers(address: str) -> int:
    import os

    count = address.partition(":")[2]
    if not count:
        return os.cpu_count() or 1
    if not count.isdigit() or int(count) < 1:
        raise QtoolError(f"--cluster local:N takes a number of workers N >= 1, got '{address}'")
    return int(count)


def _shards(total: int, batch_size: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous sample ranges [first, stop), cut at multiples of ``batch_size``: one per worker
    thread, as even in batches as they can be."""
    batches = math.ceil(total / batch_size)
    count = max(1, min(batches, workers))
    bounds = [i * batches // count for i in range(count + 1)]
    return [(a * batch_size, min(b * batch_size, total)) for a, b in zip(bounds[:-1], bounds[1:])]


def _run_shards(client, task, shards: list[tuple[int, int]], what: str, progress: bool, *args) -> list:
    """``task(*args, shard)`` for every shard, on the workers; the results in shard order. The
    first error raised by a task is raised here (a QtoolError stays one)."""
    distributed = _distributed()
    run = uuid.uuid4().hex[:8]
    futures = [client.submit(task, *args, shard, key=f"qtool-{what}-{run}-{i}", retries=RETRIES,
                             pure=False)
               for i, shard in enumerate(shards)]
    sizes = {f.key: stop - first for f, (first, stop) in zip(futures, shards)}
    with progress_bar(sum(sizes.values()), what, progress) as bar:
        for future in distributed.as_completed(futures):
            if future.status == "error":
                future.result()  # raises the task's error
            bar.update(sizes[future.key])
    return [f.result() for f in futures]


def _shared(path: str | Path) -> str:
    """A path as the workers must read it: absolute (a worker started in another folder read the
    client's relative paths from its own)."""
    return os.path.abspath(str(path))


def _workers(client) -> int:
    return max(1, sum(client.nthreads().values()))


# -- calibrate -------------------------------------------------------------------------------------

def collect(address: str, model_path: str | Path, data_path: str | Path, method: str = "minmax",
            params: dict | None = None, num_samples: int | None = None,
            batch_size: int | None = None, progress: bool = True, preprocess=None, log=None,
            histogram_samples: int | None = None, memory_mb: int | None = None):
    """``qtool.calibrate.collect`` with the samples shared out among the workers of ADDRESS: the
    same Statistics (see the module's docstring for the methods whose merge is not exact)."""
    from .batching import DEFAULT_MEMORY_MB
    from .calibrate import batch_plan, calibrator_factory
    from .stats_graph import DEFAULT_SAMPLES_PER_TENSOR

    calibrator_factory(method, params)()  # a bad method or parameter: before any cluster starts
    if method == "minmax" and (params or {}).get("moving_average") not in (None, ""):
        raise QtoolError("minmax with moving_average follows every batch before, so its shards "
                         "cannot merge; calibrate without --cluster")
    memory_mb = DEFAULT_MEMORY_MB if memory_mb is None else memory_mb
    histogram_samples = DEFAULT_SAMPLES_PER_TENSOR if histogram_samples is None else histogram_samples
    total, batch_size, note = batch_plan(model_path, data_path, num_samples, batch_size, memory_mb,
                                         preprocess)
    with connect(address) as client:
        shards = _shards(total, batch_size, _workers(client))
        if log is not None:
            log(f"cluster: {len(shards)} shards of {total} samples on {_workers(client)} workers")
        parts = _run_shards(client, _calibrate_shard, shards, "calibrate", progress, _shared(model_path),
                            _shared(data_path), method, params, batch_size, preprocess, histogram_samples,
                            memory_mb)
    stats = parts[0]
    for i, part in enumerate(parts[1:], 1):
        stats.merge(part, f"shard {i}")
    if log is not None and note and total > 1:
        log(note)
    return stats


def _calibrate_shard(model_path, data_path, method, params, batch_size, preprocess, histogram_samples,
                     memory_mb, shard):
    from .calibrate import collect as run

    return run(model_path, data_path, method, params, batch_size=batch_size, progress=False,
               preprocess=preprocess, histogram_samples=histogram_samples, memory_mb=memory_mb,
               shard=shard)


# -- verify ----------------------------------------------------------------------------------------

def verify(address: str, float_path: str | Path, qmodel_path: str | Path, data_path: str | Path,
           tolerance=(0.99, 20.0), labels: str | None = None, num_samples: int | None = None,
           batch_size: int | None = None, progress: bool = True, preprocess=None,
           run_ort: bool = False, run_analyze: bool = False, analyze_samples: int | None = 16,
           arithmetic: str = "exact", ort_config: dict | None = None, memory_mb: int | None = None,
           log=None, layers: int | None = DEFAULT_LAYERS):
    """``qtool.verify.verify`` with the samples shared out among the workers of ADDRESS: the same
    report, figure for figure (each batch's sums are added on the client in batch order).
    ``run_ort`` and ``run_analyze`` are refused, so ``analyze_samples`` and ``ort_config`` unused."""
    from .batching import DEFAULT_MEMORY_MB, VERIFY_BATCH_CAP, VERIFY_FACTOR, fixed_bytes
    from .sizing import default_batch
    from .data import check_sampling, load_dataset
    from .model import load_model, prepare, weight_bytes
    from .verify.core import accuracy, judge, layer_batches

    if run_ort or run_analyze:
        raise QtoolError("--ort and --analyze run on one machine; verify with them without --cluster")
    check_sampling(num_samples, batch_size)
    memory_mb = DEFAULT_MEMORY_MB if memory_mb is None else memory_mb
    model = prepare(load_model(float_path), f"model file '{float_path}'")
    data = load_dataset(data_path, model, preprocess)
    total = len(data) if num_samples is None else min(num_samples, len(data))
    batch_size, note = default_batch(model, data, batch_size, VERIFY_FACTOR, memory_mb, VERIFY_BATCH_CAP,
                                     held=fixed_bytes(weight_bytes(model), os.path.getsize(qmodel_path)))
    with connect(address) as client:
        shards = _shards(total, batch_size, _workers(client))
        if log is not None:
            log(f"cluster: {len(shards)} shards of {total} samples on {_workers(client)} workers")
        parts = _run_shards(client, _verify_shard, shards, "verify", progress, _shared(float_path),
                            _shared(qmodel_path), _shared(data_path), tolerance, labels, batch_size,
                            preprocess, arithmetic, memory_mb, layer_batches(total, batch_size, layers))
    report, batches = parts[0][0], [batch for _, shard_batches in parts for batch in shard_batches]
    outputs, tensors, joined, _, _ = batches[0]
    for more_outputs, more_tensors, more_joined, _, _ in batches[1:]:
        for mine, more in (*zip(outputs, more_outputs), *zip(tensors, more_tensors)):
            mine.merge(more)
        for name, part in joined.items():
            part.merge(more_joined[name])
    report.samples, report.outputs, report.tensors, report.parts = total, outputs, tensors, joined
    report.layer_samples = sum(shard_report.layer_samples for shard_report, _ in parts)
    report.failures = []
    if labels is not None:
        correct_float, correct_int = (sum(batch[4][i] for batch in batches) for i in range(2))
        report.accuracy = accuracy(labels, correct_float, correct_int, total)
    judge(report, len(batches))
    if log is not None and note and total > 1:
        log(note)
    return report


def _verify_shard(float_path, qmodel_path, data_path, tolerance, labels, batch_size, preprocess,
                  arithmetic, memory_mb, picked, shard):
    """The shard's report (its float nodes, arithmetic) and each of its batches' figures alone:
    (outputs, tensors, parts, ort checks, (correct float, correct integer))."""
    from .verify import verify as run

    batches, counted = [], [0, 0]

    def take(outputs, tensors, parts, ort_checks, correct):
        batches.append(([c.take() for c in outputs], [c.take() for c in tensors],
                        {name: p.take() for name, p in parts.items()}, [c.take() for c in ort_checks],
                        (correct[0] - counted[0], correct[1] - counted[1])))
        counted[:] = correct

    report = run(float_path, qmodel_path, data_path, tolerance, labels, batch_size=batch_size,
                 progress=False, preprocess=preprocess, arithmetic=arithmetic, memory_mb=memory_mb,
                 shard=shard, on_batch=take, layers=picked)
    return report, batches


# -- run -------------------------------------------------------------------------------------------

def run_batch(address: str, plans: list, workers: int = 0, force: bool = False, progress: bool = False,
              log=print, on_done=None) -> list:
    """``qtool.job.run_batch`` with each job a task on the workers of ADDRESS (its stages in order
    on one worker); the outcomes in the file's order. ``workers`` and ``progress`` are the
    cluster's: the workers it has, no progress bars."""
    from .job import run_batch as run

    with connect(address) as client:
        pool = client.get_executor(retries=RETRIES, pure=False)
        return run([plan.absolute() for plan in plans], _workers(client), force, progress=False, log=log,
                   on_done=on_done, pool=pool)


def run_job(address: str, plan, progress: bool = False, log=None):
    """``qtool.job.run_job`` on a worker of ADDRESS: its JobResult (or its error). ``progress``
    and ``log`` stay on the worker: none."""
    from .job import run_job as run

    with connect(address) as client:
        return client.submit(run, plan.absolute(), False, _quiet, key=f"qtool-job-{uuid.uuid4().hex[:8]}",
                             retries=RETRIES, pure=False).result()


def _quiet(message: str) -> None:
    pass
