"""Output files are written whole or not at all.

A regular file (or a path that does not exist yet) is written to a temporary file beside it, then
renamed over it. A symlink is followed: its target is what gets replaced, the link stays. What is
not a regular file (``-`` for standard output, ``/dev/null``, a fifo, a terminal, ``/dev/stdout``)
is never replaced: the output is built in a temporary file first and copied into it only when
complete, so a failed command writes nothing there either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from .errors import QtoolError

STDOUT = "-"


def _streamed(path: Path) -> bool:
    """Whether ``path`` is written through rather than replaced: ``-``, or something that exists
    and is neither a regular file nor a directory (a device, a fifo, a socket), or a link under
    /dev or /proc to a regular file (``/dev/stdout`` redirected to a file by the shell: the file
    the shell holds open, not one to replace)."""
    if str(path) == STDOUT:
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if not stat.S_ISREG(mode):
        return not stat.S_ISDIR(mode)
    return os.path.islink(path) and os.path.abspath(path).startswith(("/proc/", "/dev/"))


def replaced(path: Path) -> Path:
    """The regular file a rename must replace for ``path``: the symlink's final target."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def check_writable(path: str | Path) -> None:
    """Fail early, before long work, when ``path`` could not be created or written."""
    path = Path(path)
    if _streamed(path):
        if str(path) != STDOUT and not os.access(path, os.W_OK):
            raise QtoolError(f"cannot write '{path}': permission denied")
        return
    path = replaced(path)
    if path.is_dir():
        raise QtoolError(f"cannot write '{path}': it is a directory")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise QtoolError(f"cannot write '{path}': '{folder}' is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise QtoolError(f"cannot write '{path}': '{folder}' is not writable")


@contextlib.contextmanager
def atomic_file(path: str | Path):
    """A binary file that becomes ``path`` when the block ends without error, and is removed
    otherwise: a temporary file beside it, then a rename; for standard output and other targets
    that are not regular files, a temporary file copied into them at the end (module docstring)."""
    path = Path(path)
    if _streamed(path):
        with _spooled(path) as f:
            yield f
        return
    target = replaced(path)
    folder = target.parent if str(target.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise QtoolError(f"cannot write '{path}': {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise QtoolError(f"cannot write '{path}': {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _spooled(path: Path):
    """A temporary file whose bytes go to ``path`` (or standard output) when the block ends."""
    with tempfile.TemporaryFile(prefix="qtool-out-") as spool:
        yield spool
        spool.seek(0)
        try:
            if str(path) == STDOUT:
                sys.stdout.flush()
                shutil.copyfileobj(spool, sys.stdout.buffer, 1 << 20)
                sys.stdout.buffer.flush()
            else:
                with open(path, "wb") as out:
                    shutil.copyfileobj(spool, out, 1 << 20)
        except OSError as e:
            raise QtoolError(f"cannot write '{path}': {e.strerror or e}") from None


def atomic_write(path: str | Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def write_all(items: list[tuple[str | Path, bytes]]) -> None:
    """Several outputs, every one or none: each is written to its temporary file first, and only
    when all are complete do they take their places (a failure leaves every target as it was)."""
    with contextlib.ExitStack() as stack:
        for path, data in items:
            stack.enter_context(atomic_file(path)).write(data)


@dataclasses.dataclass
class _Part:
    """One array of an NpzWriter: its temporary .npy (header written), what each batch must be,
    and how far it got."""

    file: object
    dtype: np.dtype
    row: tuple | None  # the shape of one row; None: the array comes in one piece
    expected: int  # rows (pieces, for a whole array) to come
    done: int = 0


class NpzWriter:
    """An ``.npz`` of arrays that arrive in batches along their first axis, in bounded memory:
    each array goes to a temporary ``.npy`` as its batches come, and ``close`` stores them
    (uncompressed, as ``np.savez`` does, with fixed timestamps so that equal arrays give equal
    bytes) into a temporary file beside ``path``, then renames it. Nothing is left behind when
    it fails or is abandoned (``discard``).

    An array whose rows change shape (or type) from one batch to the next (a decoder that stops on
    a value) cannot be one array: it is stored per sample instead, as ``NAME/0``, ``NAME/1``, ...
    (the rows written before are moved there, one at a time). The archive lists the arrays in the
    order they first came, each ragged one's samples in order, whatever the batch size.
    """

    def __init__(self, path: str | Path, total: int | None):
        """``total``: the rows every array will have; None: each array comes in one piece."""
        self.path, self.total = Path(path), total
        self.parts: dict[str, _Part] = {}
        self.ragged: dict[str, int] = {}  # an array stored per sample: how many samples so far
        self.names: list[str] = []  # the arrays, in the order they first came

    def append(self, arrays: dict[str, np.ndarray]) -> None:
        for name, value in arrays.items():
            value = np.ascontiguousarray(value)
            if name in self.ragged:
                self._per_sample(name, value)
                continue
            part = self.parts.get(name)
            if part is None:
                self.names.append(name)
                part = self.parts[name] = self._new_part(value, self.total)
            if part.row is None:
                if part.done:
                    raise RuntimeError(f"NpzWriter: output '{name}' given twice")
                part.file.write(value.tobytes())
                part.done = 1
                continue
            if value.shape[1:] != part.row or value.dtype != part.dtype:
                self._split(name, part)
                self._per_sample(name, value)
                continue
            part.file.write(value.tobytes())
            part.done += len(value)

    @staticmethod
    def _new_part(value: np.ndarray, total: int | None) -> _Part:
        """A temporary .npy for ``value``: whole (``total`` None), or the first rows of ``total``."""
        whole = total is None
        part = _Part(tempfile.TemporaryFile(prefix="qtool-out-"), value.dtype, None if whole else value.shape[1:],
                     1 if whole else total)
        header = {"descr": np.lib.format.dtype_to_descr(value.dtype), "fortran_order": False,
                  "shape": value.shape if whole else (total,) + value.shape[1:]}
        np.lib.format.write_array_header_2_0(part.file, header)
        return part

    def _split(self, name: str, part: _Part) -> None:
        """The rows of ``name`` written so far, moved to one array per sample (``NAME/i``)."""
        self.ragged[name] = 0
        part.file.seek(0)
        np.lib.format.read_magic(part.file)
        np.lib.format.read_array_header_2_0(part.file)
        size = int(np.prod(part.row, dtype=np.int64)) * part.dtype.itemsize
        for _ in range(part.done):
            row = np.frombuffer(part.file.read(size), dtype=part.dtype).reshape(part.row)
            self._per_sample(name, row[None])
        part.file.close()
        del self.parts[name]

    def _per_sample(self, name: str, rows: np.ndarray) -> None:
        for row in rows:
            key = f"{name}/{self.ragged[name]}"
            part = self.parts[key] = self._new_part(row, None)
            part.file.write(np.ascontiguousarray(row).tobytes())
            part.done = 1
            self.ragged[name] += 1

    def close(self) -> None:
        short = [(n, p) for n, p in self.parts.items() if p.done != p.expected]
        if short:  # a bug in the caller, not a user error
            name, part = short[0]
            raise RuntimeError(f"NpzWriter: output '{name}' got {part.done} of {part.expected} samples")
        if self.total is not None and any(count != self.total for count in self.ragged.values()):
            raise RuntimeError(f"NpzWriter: a per-sample output got {self.ragged} of {self.total} samples")
        try:
            with atomic_file(self.path) as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as archive:
                for name, part in self._in_order():
                    part.file.seek(0)
                    info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                    with archive.open(info, "w", force_zip64=True) as member:
                        shutil.copyfileobj(part.file, member, 1 << 20)
        finally:
            self.discard()

    def _in_order(self):
        """(name, part) in the order the arrays first came; a ragged one's samples in order."""
        order = []
        for name in self.names:
            order += [f"{name}/{i}" for i in range(self.ragged[name])] if name in self.ragged else [name]
        return [(key, self.parts[key]) for key in order]

    def discard(self) -> None:
        for part in self.parts.values():
            part.file.close()
        self.parts = {}
