"""Checkpoints of resumable loops (:mod:`chainexec.planner.resume`), so that a run killed (a node
failure, the batch system's time limit) or stopped on purpose (``run --stop-after``) goes on from
its last checkpoint instead of from the start.

The folder holds ``checkpoint.json``, the manifest, and ``rank<R>-<N>.npz``: rank R's rows of
every accumulation target of the loop at checkpoint N. Every rank writes and syncs its file
before rank 0 replaces the manifest (atomically, by rename): the manifest is the commit point,
and the files it names are complete. Checkpoint numbers grow over the whole run (and on from a
resumed one), so no checkpoint writes over the files the manifest names. It records the plan
(SHA-256 of the plan's JSON and the rank count; ``inputs.json`` beside it identifies the input
files by content, :func:`_check_inputs`), the nest and
loop, the tasks handed out before the
checkpoint (all finished then: :meth:`chainexec.runtime.executor.Executor` stops every rank
between tiles), what the loop had counted (bytes per category, flops, statements, streamed
bytes), which a resumed run adds to its own, and the memory peaks reached, which it keeps (the
tiles left may all be smaller edge tiles), so that its totals and peaks still equal the
prediction.

No pickle: the rank files are plain ``.npz`` arrays read with ``allow_pickle=False``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import socket
import time
from pathlib import Path

import numpy as np

from chainexec import atomicfile, safepaths
from chainexec.errors import ChainexecError
from chainexec.planner.cost import points
from chainexec.planner.plan import CATEGORIES, Plan
from chainexec.planner.resume import resumable

MANIFEST = "checkpoint.json"
INPUTS = "inputs.json"
_PART = re.compile(r"rank[0-9]+-[0-9]+\.(npz|tmp)")
"""The names of the rank files and their temporary files."""
_held: dict[Path, int] = {}
"""Checkpoint folders this process has locked (:func:`_lock`), with the lock file's descriptor."""
FORMAT = 2
"""Version of the manifest's layout and of the tile order its counts refer to (2: symmetric
loops visit their tuples in another order since 2026-11-24, so a checkpoint of 1 would resume the
wrong tiles)."""


class Stopped(Exception):
    """Every rank stopped after a checkpoint (``--stop-after``); the same command resumes."""

    def __init__(self, done: int, count: int, folder: Path):
        super().__init__(f"stopped at a checkpoint after {done} of {count} tiles ({folder}); "
                         f"run the same command to resume")
        self.done, self.count, self.folder = done, count, folder


def plan_digest(plan: Plan, plan_text: str, ranks: int) -> str:
    """What a checkpoint belongs to: the plan (every tile, every buffer, the input files' paths)
    and the rank count (each rank saves its own rows). The inputs' contents are checked apart
    (:func:`_check_inputs`)."""
    return hashlib.sha256("\0".join([plan_text, f"ranks={ranks}"]).encode()).hexdigest()


def _input_files(plan: Plan) -> list[str]:
    return sorted({t.source["file"] for t in plan.tensors.values()
                   if t.role == "input" and t.source and "file" in t.source})


def _stamp(path: str) -> list[int]:
    """What changes whenever a file's bytes do: size, modification and change times (the change
    time cannot be set back by a user), inode and device."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def content_digest(path: str, chunk: int = 64 << 20) -> str:
    """SHA-256 over the SHA-256 of each ``chunk`` bytes of the file, the chunks hashed on as
    many threads as there are CPUs (hashlib releases the GIL): a file's identity by content,
    read once at disk or page-cache speed."""
    from concurrent.futures import ThreadPoolExecutor

    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        def one(offset: int) -> bytes:
            return hashlib.sha256(os.pread(fd, chunk, offset)).digest()

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            parts = list(pool.map(one, range(0, size, chunk)))
    finally:
        os.close(fd)
    return hashlib.sha256(b"".join(parts) + str(size).encode()).hexdigest()


def _check_inputs(folder: Path, plan: Plan, resuming: bool) -> None:
    """Identify the run's input files by content in ``folder/inputs.json``: a new checkpoint
    records each file's stamp (:func:`_stamp`) and :func:`content_digest`; a resumed one accepts
    a file whose stamp is unchanged, or whose content digest is (a copy, a touch: the new stamp
    is recorded), and refuses one whose content differs, so that partial sums of other inputs
    are never mixed in."""
    path = folder / INPUTS
    files = _input_files(plan)
    record = None
    if resuming:
        try:
            record = json.loads(path.read_text())
            valid = isinstance(record, dict) and set(record) == set(files) and all(
                isinstance(r, dict) and {"stamp", "sha256"} <= set(r) for r in record.values())
        except (OSError, ValueError):
            valid = False
        if not valid:
            raise ChainexecError("the checkpoint does not record its input files (remove the folder or choose "
                                 "another)", str(path))
    changed = False
    for file in files:
        stamp = _stamp(file)
        if record is not None and record[file]["stamp"] == stamp:
            continue
        digest = content_digest(file)
        if record is not None and record[file]["sha256"] != digest:
            raise ChainexecError(f"the input file {file} changed since the checkpoint was written; its partial "
                                 "sums would mix with the new values: remove the folder or choose another", str(path))
        record = record or {}
        record[file] = {"stamp": stamp, "sha256": digest}
        changed = True
    if changed or record is None:
        atomicfile.write(path, json.dumps(record or {}, indent=1))


def _loops(plan: Plan) -> dict[tuple[int, int], int]:
    """Every resumable loop, (nest, position) → its number of tiles."""
    return {(k, pos): points([], [nest.body[pos]], plan.extents, "device")
            for k, nest in enumerate(plan.nests) for pos in resumable(nest)}


def _lock(folder: Path) -> None:
    """Lock ``folder`` for this process until it exits (a POSIX record lock on the mark file,
    which NFS and Lustre honour): a second run given the same checkpoint folder is refused
    instead of mixing its parts with this run's. The lock goes with the process, also when it
    is killed."""
    folder = safepaths.resolved(folder)
    if folder in _held:
        return
    fd = os.open(folder / safepaths.MARK, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").partition("held by ")[2].strip()
        os.close(fd)
        raise ChainexecError(f"checkpoint folder in use by another run{f' ({holder})' if holder else ''}",
                             str(folder)) from None
    os.pwrite(fd, f"\nheld by pid {os.getpid()} on {socket.gethostname()}\n".encode(), os.fstat(fd).st_size)
    _held[folder] = fd


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a node crash after it must not undo it)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpoint:
    """Where and how often a run checkpoints: ``every`` seconds at most between checkpoints of a
    resumable loop, and a stop after the first checkpoint past ``stop_after`` seconds (None: run
    to the end). ``saved`` is the manifest found at the start (None: start from scratch), read
    and checked on rank 0 by :meth:`open` and passed to every rank. ``committed`` is the number
    of the checkpoint the manifest names now; numbers only grow, so a new checkpoint never
    writes over the files of the committed one."""

    def __init__(self, folder: str | Path, digest: str, saved: dict | None = None, every: float = 600.0,
                 stop_after: float | None = None):
        if not (math.isfinite(every) and every >= 0) or (
                stop_after is not None and not (math.isfinite(stop_after) and stop_after >= 0)):
            raise ChainexecError("checkpoint intervals must be finite and not negative")
        self.folder = Path(folder)
        self.digest = digest
        self.every = every
        self.stop_after = stop_after
        self.saved = saved
        self.committed = saved["number"] if saved is not None else None
        self.started = self.last = time.monotonic()

    @classmethod
    def open(cls, folder: str | Path, plan: Plan, plan_text: str, ranks: int, every: float = 600.0,
             stop_after: float | None = None) -> "Checkpoint":
        """Create the folder, or read its manifest and check it (rank 0, before anything runs):
        same plan, ranks and inputs; fields that name a resumable loop of this plan and a
        position inside it; every rank's part readable. A one-line ChainexecError naming the
        file otherwise."""
        folder = Path(folder)
        digest = plan_digest(plan, plan_text, ranks)
        path = folder / MANIFEST
        saved = None
        try:
            safepaths.make_owned(folder, "a run's checkpoint")
            _lock(folder)
            if path.exists():
                saved = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ChainexecError(f"cannot use it as a checkpoint: {err}", str(path if path.exists() else folder)) from None
        ck = cls(folder, digest, None, every, stop_after)
        if saved is not None:
            ck._check(saved, path, _loops(plan), ranks)
            ck.saved, ck.committed = saved, saved["number"]
        try:
            _check_inputs(folder, plan, saved is not None)
        except OSError as err:
            raise ChainexecError(f"cannot identify the inputs: {err}", str(folder / INPUTS)) from None
        return ck

    def _check(self, saved, path: Path, loops: dict[tuple[int, int], int], ranks: int) -> None:
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise ChainexecError("not a chainexec checkpoint of this version", str(path))
        if saved.get("plan") != self.digest:
            raise ChainexecError("a checkpoint of another plan (config, machine, rank count or input files "
                                 "differ); remove the folder or choose another", str(path))
        fields = ("nest", "position", "done", "tiles", "number", "ranks")
        counts = saved.get("counts")
        if (not all(type(saved.get(k)) is int and saved[k] >= 0 for k in fields)
                or not isinstance(counts, list) or len(counts) != len(CATEGORIES) + 3
                or not all(type(c) is int and 0 <= c < 2**63 for c in counts)
                or loops.get((saved["nest"], saved["position"])) != saved["tiles"]
                or not saved["done"] < saved["tiles"] or saved["ranks"] != ranks
                or not isinstance(saved.get("peaks"), dict) or set(saved["peaks"]) != {"global", "device"}
                or not all(type(v) is int and v >= 0 for v in saved["peaks"].values())):
            raise ChainexecError("damaged checkpoint manifest (a field is missing, out of range or names "
                                 "no resumable loop of this plan)", str(path))
        for rank in range(ranks):
            self.read_rank(rank, saved["number"])

    def due(self) -> bool:
        """Whether to checkpoint now (asked by rank 0 between tiles)."""
        now = time.monotonic()
        return now - self.last >= self.every or self.stopping()

    def stopping(self) -> bool:
        return self.stop_after is not None and time.monotonic() - self.started >= self.stop_after

    def _rank_file(self, rank: int, number: int) -> Path:
        return self.folder / f"rank{rank}-{number}.npz"

    def write_rank(self, rank: int, number: int, arrays: list[np.ndarray]) -> None:
        """This rank's part of checkpoint ``number``, complete on disk when this returns."""
        path = self._rank_file(rank, number)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                np.savez(f, *arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as err:
            raise ChainexecError(f"cannot write a checkpoint part ({err})", str(path)) from None

    def read_rank(self, rank: int, number: int, like: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Every array of a rank's part, in order; with ``like``, checked to have their shapes
        and dtypes (the rows the run holds)."""
        path = self._rank_file(rank, number)
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = [z[f"arr_{k}"] for k in range(len(z.files))]
        except Exception as err:  # a damaged zip raises BadZipFile, EOFError, OSError, ValueError …
            raise ChainexecError(f"unreadable checkpoint part ({type(err).__name__}: {err})", str(path)) from None
        if like is not None and [(a.shape, a.dtype) for a in arrays] != [(b.shape, b.dtype) for b in like]:
            raise ChainexecError("checkpoint part does not hold this run's rows (shapes or dtypes differ)", str(path))
        return arrays

    def commit(self, manifest: dict) -> None:
        """Replace the manifest (rank 0, after every rank's part is on disk)."""
        path = self.folder / MANIFEST
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump({"format": FORMAT, "plan": self.digest, **manifest}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(self.folder)
        except OSError as err:
            raise ChainexecError(f"cannot write the checkpoint manifest ({err})", str(path)) from None
        self.last = time.monotonic()

    def supersede(self, rank: int, number: int) -> None:
        """After checkpoint ``number`` is committed: remove this rank's part of the one before."""
        if self.committed is not None:
            self._rank_file(rank, self.committed).unlink(missing_ok=True)
        self.committed = number

    def clear(self) -> None:
        """Remove the manifest, then every part, the temporary files of both and the folder's
        mark (rank 0, after the outputs are complete; the manifest first, so a crash in between
        leaves no manifest naming a missing part). Only files named as this module names them
        are removed: the folder keeps anything else."""
        (self.folder / MANIFEST).unlink(missing_ok=True)
        _fsync_dir(self.folder)
        for path in self.folder.iterdir():
            if _PART.fullmatch(path.name) or path.name in (Path(MANIFEST).with_suffix(".tmp").name, INPUTS):
                path.unlink(missing_ok=True)
        (self.folder / safepaths.MARK).unlink(missing_ok=True)
        fd = _held.pop(safepaths.resolved(self.folder), None)
        if fd is not None:
            os.close(fd)
