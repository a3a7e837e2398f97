"""Output files are written whole or not at all: a temporary file beside the target, then rename."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from .errors import QtoolError


def check_writable(path: str | Path) -> None:
    """Fail early, before long work, when ``path`` could not be created."""
    path = Path(path)
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
    otherwise: a temporary file beside it, then a rename."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise QtoolError(f"cannot write '{path}': {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise QtoolError(f"cannot write '{path}': {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


class NpzWriter:
    """An ``.npz`` of arrays that arrive in batches along their first axis, in bounded memory:
    each array goes to a temporary ``.npy`` as its batches come, and ``close`` stores them
    (uncompressed, as ``np.savez`` does, with fixed timestamps so that equal arrays give equal
    bytes) into a temporary file beside ``path``, then renames it. Nothing is left behind when
    it fails or is abandoned (``discard``).
    """

    def __init__(self, path: str | Path, total: int | None):
        """``total``: the rows every array will have; None: each array comes in one piece."""
        self.path, self.total = Path(path), total
        # name -> [temporary file, dtype, shape of a row, rows written, rows expected]
        self.parts: dict[str, list] = {}

    def append(self, arrays: dict[str, np.ndarray]) -> None:
        for name, value in arrays.items():
            value = np.ascontiguousarray(value)
            if name not in self.parts:
                part = tempfile.TemporaryFile(prefix="qtool-out-")
                whole = self.total is None  # written as it is, any shape
                shape = value.shape if whole else (self.total,) + value.shape[1:]
                header = {"descr": np.lib.format.dtype_to_descr(value.dtype), "fortran_order": False,
                          "shape": shape}
                np.lib.format.write_array_header_2_0(part, header)
                self.parts[name] = [part, value.dtype, None if whole else value.shape[1:], 0,
                                    1 if whole else self.total]
            part, dtype, row, done, expected = self.parts[name]
            if row is None:
                if done:
                    raise RuntimeError(f"NpzWriter: output '{name}' given twice")
                part.write(value.tobytes())
                self.parts[name][3] = 1
                continue
            if value.shape[1:] != row or value.dtype != dtype:
                raise QtoolError(f"output '{name}' is {value.dtype} {list(value.shape[1:])} per sample in "
                                 f"samples {done}-{done + len(value) - 1} but {dtype} {list(row)} "
                                 f"before; outputs that differ between batches cannot be stacked into "
                                 f"one array (use --batch-size 1 and one sample per file)")
            part.write(value.tobytes())
            self.parts[name][3] = done + len(value)

    def close(self) -> None:
        short = [n for n, (_, _, _, rows, expected) in self.parts.items() if rows != expected]
        if short:  # a bug in the caller, not a user error
            raise RuntimeError(f"NpzWriter: output '{short[0]}' got {self.parts[short[0]][3]} of "
                               f"{self.parts[short[0]][4]} samples")
        try:
            with atomic_file(self.path) as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as archive:
                for name, (part, *_rest) in self.parts.items():
                    part.seek(0)
                    info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                    with archive.open(info, "w", force_zip64=True) as member:
                        shutil.copyfileobj(part, member, 1 << 20)
        finally:
            self.discard()

    def discard(self) -> None:
        for part, *_rest in self.parts.values():
            part.close()
        self.parts = {}
