"""Output files are written whole or not at all.

A regular file (or a path that does not exist yet) is written to a temporary file beside it, then
renamed over it; where the system allows (``O_TMPFILE``), that file has no name until it is
complete, so a killed process leaves nothing behind. A symlink is followed: its target is what gets replaced, the link stays. What is
not a regular file (``-`` for standard output, ``/dev/null``, a fifo, a terminal, ``/dev/stdout``)
is never replaced: the output is built in a temporary file first and copied into it only when
complete, so a failed command writes nothing there either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import stat
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .errors import STOP, QtoolError

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
    """The regular file a rename must replace for ``path``: the symlink's final target. A loop of
    symlinks is refused: renaming over it would replace a link, not a file. A path the system
    cannot look up at all (a name too long for it) is refused in one line (it was exit 3)."""
    try:
        if not path.is_symlink():
            return path
    except OSError as e:
        raise QtoolError(f"cannot write '{path}': {e.strerror or e}") from None
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise QtoolError(f"cannot write '{path}': it is a loop of symlinks") from None
    return Path(os.path.realpath(path))


def check_writable(path: str | Path) -> None:
    """Fail early, before long work, when ``path`` could not be created or written."""
    path = Path(path)
    if _streamed(path):
        if str(path) != STDOUT and not os.access(path, os.W_OK):
            raise QtoolError(f"cannot write '{path}': permission denied")
        return
    target = replaced(path)
    try:
        if target.is_dir():
            what = "a link to a directory" if target != path else "a directory"
            raise QtoolError(f"cannot write '{path}': it is {what}")
        folder = target.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
    except OSError as e:  # a folder's name too long for the system
        raise QtoolError(f"cannot write '{path}': {e.strerror or e}") from None
    if not folder.is_dir():
        raise QtoolError(f"cannot write '{path}': '{folder}' is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise QtoolError(f"cannot write '{path}': '{folder}' is not writable")


def check_distinct(**outputs) -> None:
    """Fail when two of a command's outputs (option name: path, None where not given) are one file:
    one of them would be lost (``calibrate -o x.yaml --stats-out x.yaml``)."""
    seen: dict[str, str] = {}
    for option, path in outputs.items():
        if path is None or str(path) == STDOUT:
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise QtoolError(f"{seen[key]} and {option} both name '{path}'; give each its own file")
        seen[key] = option


def check_not_reading(output: str | Path | None, *inputs: str | Path | None, reader: str = "command") -> None:
    """Fail when ``output`` is one of the files the command reads (``inputs``), or lies in a
    folder of data it reads: writing it would replace the model, table or data that the command
    still reads (`quantize m.onnx -o m.onnx` replaced the float model), or add a sample to the
    folder for the next run."""
    if output is None or _streamed(Path(output)):
        return
    for given in inputs:
        if given is None or str(given) == STDOUT or not Path(given).exists():
            continue
        if Path(given).is_dir() and Path(output).resolve().is_relative_to(Path(given).resolve()):
            raise QtoolError(f"cannot write '{output}': it is inside '{given}', a folder of data this command "
                             f"reads; choose another output path")
        if Path(output).exists() and os.path.samefile(output, given):
            raise QtoolError(f"cannot write '{output}': it is '{given}', which this {reader} reads; "
                             f"choose another output path")


@contextlib.contextmanager
def atomic_file(path: str | Path):
    """A binary file (readable too) that becomes ``path`` when the block ends without error, and
    is removed otherwise: a temporary file beside it, then a rename; for standard output and other
    targets that are not regular files, a temporary file copied into them at the end (module
    docstring).

    Where the system has them (Linux's ``O_TMPFILE``), the temporary file has no name until the
    block ends: a process killed while writing (SIGKILL, SIGTERM, which run no cleanup) leaves
    nothing beside ``path``, however long it wrote (an exec's .npz streams into it for the whole
    run). It is linked in under a temporary name only to be renamed over ``path``. Where the
    system has none, the named temporary file exists for as long as the block runs."""
    path = Path(path)
    if _streamed(path):
        with _spooled(path) as f:
            yield f
        return
    target = replaced(path)
    folder = target.parent if str(target.parent) else Path(".")
    made = _missing_folders(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QtoolError(f"cannot write '{path}': {e.strerror or e}") from None
    with _removed_on_failure(made):
        fd = _anonymous(folder)
        named = fd is None
        tmp = None
        try:
            if named:
                fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
            with os.fdopen(fd, "w+b") as f:
                yield f
                f.flush()
                os.fchmod(f.fileno(), mode_for(target))
                if not named:
                    tmp = _linked(f, target, folder)
            if STOP:  # a Ctrl-C swallowed on the way: the previous output stays
                raise KeyboardInterrupt
            os.replace(tmp, target)
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise QtoolError(f"cannot write '{path}': {e.strerror or e}") from None
        except BaseException:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise


def mode_for(target: Path) -> int:
    """The permissions a new ``target`` gets: those of the file it replaces (a 0600 table stays
    private), else what the umask leaves of 0666, as a plain ``open`` would give."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


@contextlib.contextmanager
def _removed_on_failure(made: list[Path]):
    """The folders in ``made`` (deepest first, created for an output) removed again, where nothing
    else came into them, when the block fails: a failed or abandoned output leaves no trace."""
    try:
        yield
    except BaseException:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and its parents that do not exist yet, deepest first."""
    missing = []
    while str(folder) and not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _anonymous(folder: Path) -> int | None:
    """A file descriptor of a new nameless file in ``folder`` (``O_TMPFILE``), or None where the
    system or the file system has none."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(folder, flag | os.O_RDWR, 0o600)
    except OSError:  # a file system without it (some network and overlay ones): a named temporary
        return None


def _linked(f, target: Path, folder: Path) -> str:
    """The nameless file ``f`` given a temporary name beside ``target`` (a link from its
    descriptor); where the link fails, its bytes copied into a named temporary file instead."""
    for _ in range(100):
        tmp = os.path.join(folder, f".{target.name}.{os.urandom(6).hex()}.tmp")
        try:
            os.link(f"/proc/self/fd/{f.fileno()}", tmp)
            return tmp
        except FileExistsError:
            continue
        except OSError:
            break
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as copy:
            f.seek(0)
            shutil.copyfileobj(f, copy, 1 << 20)
        os.chmod(tmp, mode_for(target))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


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


class _Streamed:
    """The first array of an NpzWriter written straight into the archive's temporary file, as
    the archive's first member: its local header (``zipfile.ZipInfo.FileHeader``, as ``zipfile``
    writes it for ``open(info, "w", force_zip64=True)``) at offset 0, rewritten with the CRC and
    sizes at the end, then its .npy bytes as the batches come. The other members follow it at
    ``close``. The archive's bytes are those ``zipfile`` writes for the same members in the same
    order; what it saves is the copy of the largest array from a temporary file (542 MB for 512
    PP-OCRv4 rec lines)."""

    def __init__(self, file, name: str):
        self.file = file
        self.info = _member_info(name)
        self.info.external_attr = 0o600 << 16  # as zipfile's _open_to_write sets it
        self.info.compress_size = self.info.CRC = self.info.file_size = 0
        self.info.header_offset = 0
        file.seek(0)
        file.write(self.info.FileHeader(True))
        self.start = file.tell()
        self.crc = self.size = 0

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)

    def finish(self) -> zipfile.ZipInfo:
        """The member's header rewritten with its CRC and sizes; the file left at its end."""
        self.info.CRC, self.info.compress_size, self.info.file_size = self.crc, self.size, self.size
        end = self.file.tell()
        self.file.seek(0)
        self.file.write(self.info.FileHeader(True))
        self.file.seek(end)
        return self.info

    def read_back(self):
        """What was written, copied a block at a time into a temporary file, from its start (for
        ``NpzWriter._split``, which reads it a row at a time); the archive's file emptied."""
        self.file.flush()
        self.file.seek(self.start)
        copy = tempfile.TemporaryFile(prefix="qtool-out-")
        left = self.size
        while left:
            block = self.file.read(min(left, 1 << 20))
            copy.write(block)
            left -= len(block)
        copy.seek(0)
        self.file.seek(0)
        self.file.truncate()
        return copy


def _member_info(name: str) -> zipfile.ZipInfo:
    return zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))


class NpzWriter:
    """An ``.npz`` of arrays that arrive in batches along their first axis, in bounded memory:
    the first array goes straight into a temporary file beside ``path`` as the archive's first
    member (``_Streamed``), each other array to a temporary ``.npy`` as its batches come, and
    ``close`` stores those after it (uncompressed, as ``np.savez`` does, with fixed timestamps so
    that equal arrays give equal bytes) and renames the file. Nothing is left behind when it fails
    or is abandoned (``discard``).

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
        self._archive = None  # (the atomic_file context, its file) once the first array came
        self._streamed: _Streamed | None = None

    def append(self, arrays: dict[str, np.ndarray]) -> None:
        for name, value in arrays.items():
            value = np.ascontiguousarray(value)
            if name in self.ragged:
                self._per_sample(name, value)
                continue
            part = self.parts.get(name)
            if part is None:
                self.names.append(name)
                part = self.parts[name] = self._new_part(name, value, self.total)
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

    def _new_part(self, name: str, value: np.ndarray, total: int | None) -> _Part:
        """``value``'s array: whole (``total`` None), or the first rows of ``total``; the first
        array of all streamed into the archive, the others in a temporary .npy."""
        whole = total is None
        if not self.names[:-1] and self._archive is None:
            self._open_archive()
            self._streamed = file = _Streamed(self._archive[1], name)
        else:
            file = tempfile.TemporaryFile(prefix="qtool-out-")
        part = _Part(file, value.dtype, None if whole else value.shape[1:], 1 if whole else total)
        header = {"descr": np.lib.format.dtype_to_descr(value.dtype), "fortran_order": False,
                  "shape": value.shape if whole else (total,) + value.shape[1:]}
        np.lib.format.write_array_header_2_0(part.file, header)
        return part

    def _split(self, name: str, part: _Part) -> None:
        """The rows of ``name`` written so far, moved to one array per sample (``NAME/i``)."""
        self.ragged[name] = 0
        if part.file is self._streamed:  # the archive's first member no longer: read back
            source, self._streamed = part.file.read_back(), None
        else:
            source = part.file
            source.seek(0)
        np.lib.format.read_magic(source)
        np.lib.format.read_array_header_2_0(source)
        size = int(np.prod(part.row, dtype=np.int64)) * part.dtype.itemsize
        for _ in range(part.done):
            row = np.frombuffer(source.read(size), dtype=part.dtype).reshape(part.row)
            self._per_sample(name, row[None])
        source.close()
        del self.parts[name]

    def _per_sample(self, name: str, rows: np.ndarray) -> None:
        for row in rows:
            key = f"{name}/{self.ragged[name]}"
            part = self.parts[key] = self._new_part(key, row, None)
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
            if self._archive is None:  # no array came
                self._open_archive()
            context, f = self._archive
            first = self._streamed.finish() if self._streamed is not None else None
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as archive:
                if first is not None:  # as zipfile records a member it wrote itself
                    archive.filelist.append(first)
                    archive.NameToInfo[first.filename] = first
                for name, part in self._in_order():
                    if part.file is self._streamed:
                        continue
                    part.file.seek(0)
                    with archive.open(_member_info(name), "w", force_zip64=True) as member:
                        shutil.copyfileobj(part.file, member, 1 << 20)
            self._archive = None
            context.__exit__(None, None, None)  # renamed into place
        finally:
            self.discard()

    def _open_archive(self) -> None:
        """The archive's temporary file (``atomic_file``), opened at the first array."""
        context = atomic_file(self.path)
        self._archive = (context, context.__enter__())

    def _in_order(self):
        """(name, part) in the order the arrays first came; a ragged one's samples in order."""
        order = []
        for name in self.names:
            order += [f"{name}/{i}" for i in range(self.ragged[name])] if name in self.ragged else [name]
        return [(key, self.parts[key]) for key in order]

    def discard(self) -> None:
        for part in self.parts.values():
            if part.file is not self._streamed:
                part.file.close()
        self.parts, self._streamed = {}, None
        if self._archive is not None:  # the temporary file removed, the target left as it was
            context, self._archive = self._archive[0], None
            context.__exit__(_Discarded, _Discarded(), None)  # and the folders made for it


class _Discarded(Exception):
    """Thrown into ``atomic_file`` to make it remove its temporary file (``NpzWriter.discard``)."""
