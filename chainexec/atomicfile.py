"""Files replaced whole: written to a temporary file in the same folder and renamed onto their
name, so that a process reading one meanwhile (another rank, another job on the node) sees the
old file or the new one, never half of one. The caches' files (:mod:`chainexec.diskstore`: plans,
CUBINs, the autotuner's decisions, the warm-up's log, calibrations) are written so. :func:`sync`
makes a file or a rename durable (checkpoints: a node crash after it must not undo it)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write(path: Path, data: bytes | str, mode: int | None = None) -> None:
    """Replace ``path`` by ``data`` (its folder made where missing). ``mode``: the permissions
    (``tempfile.mkstemp`` makes the file private; a cache meant to be shared passes ``0o644``).
    Raises :class:`OSError` as the file system does, leaving no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sync(path: Path) -> None:
    """Flush ``path`` to the storage device: a file's contents, or a folder's entries (a rename
    or a new file in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
