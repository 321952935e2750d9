"""Files replaced whole: written to a temporary file in the same folder and renamed onto their
name, so that a process reading one meanwhile (another rank, another job on the node) sees the
old file or the new one, never half of one. The caches' files (:mod:`chainexec.diskstore`: plans,
CUBINs, the autotuner's decisions, the warm-up's log, calibrations) are written so. :func:`sync`
makes a file or a rename durable (checkpoints: a node crash after it must not undo it)."""

from __future__ import annotations

import errno
import os
import re
import secrets
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path


TEMPORARY = ".XXXXXXXX.tmp"
"""What a temporary file's name adds to the name of the file it replaces (and a dot before it)."""


_TEMPORARY = re.compile(r"\.(.+)\.[0-9a-f]{8}\.tmp")


def replaced(name: str) -> str | None:
    """The name of the file a temporary file named ``name`` was to replace (:func:`replacing`),
    or None where ``name`` is no such temporary file's: what a folder's clean-up removes after
    a crash left one."""
    found = _TEMPORARY.fullmatch(name)
    return found.group(1) if found else None


_PENDING: set[Path] = set()
"""The temporary files of :func:`replacing` blocks not yet ended in this process."""
_PENDING_LOCK = threading.Lock()


def remove_pending() -> None:
    """Remove every temporary file of a :func:`replacing` block not yet ended: what a process
    ended at once by a signal (:mod:`chainexec.stopsignals`) would leave, with a name nothing
    else removes."""
    with _PENDING_LOCK:
        pending = list(_PENDING)
    for tmp in pending:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            continue


@contextmanager
def replacing(path: str | os.PathLike, durable: bool = False):
    """A new file beside ``path`` to write whole (``.NAME.XXXXXXXX.tmp``: made here, so never a
    file that was there before, with the permissions a new file gets under the umask), renamed
    onto ``path`` where the block ends without an exception and removed where it raises, or
    where a signal ends the process first (:func:`remove_pending`).
    ``durable``: the file's contents reach the storage device before the rename, and the rename
    before this returns (:func:`sync`), so that a node's crash leaves the old file or the whole
    new one."""
    path = Path(path)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            with _PENDING_LOCK:
                os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
                _PENDING.add(tmp.absolute())
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        if durable:
            sync(tmp)
        os.replace(tmp, path)
        if durable:
            sync(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        with _PENDING_LOCK:
            _PENDING.discard(tmp.absolute())


def probe(path: Path, folders_made: bool = False) -> None:
    """Make a file of a fresh name beside ``path`` and remove it at once (no file of the user's
    is touched): an :class:`OSError` where no file can be written in its folder, found before
    a command computes what it would write there. ``folders_made``: the command makes ``path``'s
    missing folders itself, so the nearest folder that exists is probed (where they would be
    made; one that is a file is ``NotADirectoryError``)."""
    folder = Path(path).absolute().parent
    if folders_made:
        folder = next(p for p in (folder, *folder.parents) if p.exists())
        if not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
    fd, made = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
    os.close(fd)
    os.unlink(made)


USER_FILE = -1
"""The ``mode`` of a file a user asked for (a report, a config, a benchmark's results): the
permissions a new file gets under the umask, as any program's output."""


def write(path: Path, data: bytes | str, mode: int | None = None) -> None:
    """Replace ``path`` by ``data`` (its folder made where missing; :func:`replacing`). ``mode``:
    the permissions (private, ``0o600``, unless given; a cache meant to be shared passes
    ``0o644``; :data:`USER_FILE` those of the umask). Raises :class:`OSError` as the file system
    does, leaving no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        if mode != USER_FILE:
            os.chmod(tmp, 0o600 if mode is None else mode)
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)


def sync(path: Path) -> None:
    """Flush ``path`` to the storage device: a file's contents, or a folder's entries (a rename
    or a new file in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
