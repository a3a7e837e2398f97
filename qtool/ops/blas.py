"""One BLAS thread while the integer executor runs (``single_threaded``).

numpy's OpenBLAS runs a product on a worker per core, and after each product the workers keep
polling for the next one for a while. The integer kernels call the BLAS between single-threaded
numpy passes, so the polling workers compete with the main thread for the cores; on a 2-core
machine that also runs other work, a product waits for a descheduled worker and every pass waits
for a core (measured on PP-OCRv4 det: 400-1100 ms per image with the default threads, 170 ms
with one; rec 42-430 ms against 44 ms). With the machine idle, the second thread saves ~5% on
rec.

The thread count is set through the loaded OpenBLAS's own ``*set_num_threads`` function (found
the way threadpoolctl finds it) and restored afterwards; with another BLAS nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

_LOCK = threading.Lock()
_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_", "openblas_set_num_threads")
_GETTERS = tuple(name.replace("set_", "get_") for name in _SETTERS)
_openblas = None  # (get, set) once looked up; () when there is no OpenBLAS


def _functions():
    global _openblas
    if _openblas is None:
        _openblas = ()
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line}
        except OSError:
            paths = set()
        for path in sorted(paths):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for get, set_ in zip(_GETTERS, _SETTERS):
                if hasattr(lib, get) and hasattr(lib, set_):
                    getter, setter = getattr(lib, get), getattr(lib, set_)
                    getter.restype = ctypes.c_int
                    setter.argtypes = [ctypes.c_int]
                    _openblas = (getter, setter)
                    return _openblas
    return _openblas


_active = 0  # blocks inside single_threaded(), across threads
_previous = 0  # the count before the first of them


@contextlib.contextmanager
def single_threaded():
    """Run the block with one OpenBLAS thread; the count from before the first of any overlapping
    blocks (other threads' too) is restored when the last one ends."""
    global _active, _previous
    functions = _functions()
    if not functions:
        yield
        return
    get, set_ = functions
    with _LOCK:
        if _active == 0:
            _previous = get()
            set_(1)
        _active += 1
    try:
        yield
    finally:
        with _LOCK:
            _active -= 1
            if _active == 0:
                set_(_previous)
