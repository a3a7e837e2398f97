"""Prepared float models kept on disk between commands.

``calibrate``, ``quantize`` and ``verify`` each prepare the float model they are given (opset
upgrade, onnxruntime's constant folding, fusions, shape inference: 0.24 s of a 0.67 s
``qtool calibrate`` of one PP-OCRv4 rec line), and a pipeline gives them the same file. The
prepared model's bytes are kept in a folder of their own, named by a digest of

* the float model's bytes,
* the source of this qtool package (every ``.py`` file under it: a changed preparation, even
  uncommitted, is another key),
* numpy's, onnx's and onnxruntime's versions (preparation runs onnx's converter and
  onnxruntime's optimizer, and folds constants in numpy),

so an entry can only be what preparing that model with this code would give again. An entry is
written to a temporary file and renamed, so a reader sees a whole entry or none; one that does
not parse is prepared again. The folder keeps at most ``LIMIT_BYTES``, the entries read least
recently removed first. Nothing here is ever an error: a folder that cannot be made, read or
written means preparing again, as without a cache.

The folder: ``$QTOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/qtool``, else ``~/.cache/qtool``;
``QTOOL_NO_CACHE=1`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from .errors import QtoolError
from .fileio import atomic_write

LIMIT_BYTES = 1 << 30
SUFFIX = ".prepared.onnx"
TEMPORARY = ".*" + SUFFIX + ".*.tmp"  # atomic_write's temporary files, left by a writer killed

_code_digest: bytes | None = None


def folder() -> Path | None:
    """Where entries go, or None when the cache is off."""
    if os.environ.get("QTOOL_NO_CACHE", "") not in ("", "0"):
        return None
    given = os.environ.get("QTOOL_CACHE_DIR")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qtool"


def _code() -> bytes:
    """A digest of this package's source and of the numpy, onnx and onnxruntime versions."""
    global _code_digest
    if _code_digest is None:
        import numpy
        import onnx
        import onnxruntime

        h = hashlib.sha256(f"numpy {numpy.__version__} onnx {onnx.__version__} "
                           f"onnxruntime {onnxruntime.__version__}".encode())
        package = Path(__file__).resolve().parent
        for path in sorted(package.rglob("*.py")):
            h.update(str(path.relative_to(package)).encode() + b"\0")
            h.update(path.read_bytes())
        _code_digest = h.digest()
    return _code_digest


def key(model_digest: bytes) -> str:
    """The entry name of a model whose serialized bytes have sha256 ``model_digest``."""
    return hashlib.sha256(_code() + model_digest).hexdigest()


def read(name: str) -> bytes | None:
    """The bytes kept under ``name``, or None (no cache, no entry, unreadable). A hit marks the
    entry as just used."""
    where = folder()
    if where is None:
        return None
    path = where / (name + SUFFIX)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        os.utime(path)
    except OSError:  # a folder this process may read but not write: the entry serves all the same
        pass
    return data


def write(name: str, data: bytes) -> None:
    """Keep ``data`` under ``name`` (whole or not at all: ``fileio.atomic_write``), then trim the
    folder to ``LIMIT_BYTES``."""
    where = folder()
    if where is None or len(data) > LIMIT_BYTES:
        return
    try:
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(where / (name + SUFFIX), data)
    except (OSError, QtoolError):
        return
    _trim(where)


def forget(name: str) -> None:
    """Remove the entry ``name`` (one that did not parse)."""
    where = folder()
    if where is not None:
        try:
            (where / (name + SUFFIX)).unlink()
        except OSError:
            pass


def _trim(where: Path) -> None:
    """Remove the least recently read entries beyond ``LIMIT_BYTES``, and what a writer killed
    mid-write left (an hour old)."""
    stale = time.time() - 3600
    for path in where.glob(TEMPORARY):
        try:
            if path.stat().st_mtime < stale:
                path.unlink()
        except OSError:
            pass
    entries = []
    for path in where.glob("*" + SUFFIX):
        try:
            st = path.stat()
        except OSError:  # removed meanwhile by another process
            continue
        entries.append((st.st_mtime_ns, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries, key=lambda e: (e[0], e[2].name)):
        if total <= LIMIT_BYTES:
            break
        try:
            path.unlink()
        except OSError:
            pass
        total -= size
