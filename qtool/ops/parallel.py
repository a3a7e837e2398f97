"""A kernel's large output split into row ranges, one per core.

numpy runs each call on one core, and the executor keeps the BLAS on one thread as well
(qtool/ops/blas.py); both release the GIL inside their loops. So a kernel with a large output
computes its row ranges on Python threads, each range's products, sums and requantization
writing its own slice of the output. The threads sleep on a queue when idle: unlike the BLAS's
polling workers, a busy machine only delays them.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

from ..batching import CORES

WORKERS = CORES
# Outputs smaller than this many elements run on one thread: handing a range to another thread
# and waiting for it costs tens of microseconds (PP-OCRv4 rec's layers have 60k to 250k outputs).
SPLIT_FROM = 1 << 16

_pool: ThreadPoolExecutor | None = None
_serial = 0  # while above 0 (``serial``), every kernel runs on the calling thread


def _forget_pool() -> None:
    global _pool
    _pool = None  # a forked child has none of the parent's threads: it starts its own pool


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def ranges(length: int, elements: int) -> tuple[tuple[int, int], ...]:
    """``[0, length)`` as up to ``WORKERS`` near-equal ranges when the work has at least
    ``SPLIT_FROM`` output ``elements``, else the whole."""
    parts = max(1, min(WORKERS, length)) if elements >= SPLIT_FROM and not _serial else 1
    bounds = [length * i // parts for i in range(parts + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


@contextlib.contextmanager
def serial():
    """Kernels unsplit while inside: for a caller whose own threads keep the other cores busy
    (verify runs the float model and the comparisons beside the executor)."""
    global _serial
    _serial += 1
    try:
        yield
    finally:
        _serial -= 1


def run_parts(work, parts) -> None:
    """``work(start, stop)`` for every part: the first on this thread, the others on the pool (so
    ``work`` must not itself call ``run_parts``). Every part has finished when this returns or
    raises; the first error is raised."""
    global _pool
    if len(parts) == 1:
        work(*parts[0])
        return
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=WORKERS - 1, thread_name_prefix="qtool-kernel")
    futures = [_pool.submit(work, *part) for part in parts[1:]]
    try:
        work(*parts[0])
    finally:
        errors = [f.exception() for f in futures]  # waits for each
    for error in errors:
        if error is not None:
            raise error
