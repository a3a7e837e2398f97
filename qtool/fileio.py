"""Output files are written whole or not at all: a temporary file beside the target, then rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

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


def atomic_write(path: str | Path, data: bytes) -> None:
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise QtoolError(f"cannot write '{path}': {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise QtoolError(f"cannot write '{path}': {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
