"""Checkpoints of resumable loops (:mod:`chainexec.planner.resume`), so that a run killed (a node
failure, the batch system's time limit) or stopped on purpose (``run --stop-after``) goes on from
its last checkpoint instead of from the start.

The folder holds ``checkpoint.json``, the manifest, and ``rank<R>-<N>.npz``: rank R's rows of
every accumulation target of the loop at checkpoint N. Every rank writes and syncs its file
before rank 0 replaces the manifest (atomically, by rename): the manifest is the commit point,
and the files it names are complete. It records the plan (SHA-256 of the plan's JSON and the
rank count), the nest and loop, the tasks handed out before the
checkpoint (all finished then: :meth:`chainexec.runtime.executor.Executor` stops every rank
between tiles), and what the loop had counted (bytes per category, flops, statements, streamed
bytes), which a resumed run adds to its own, so that its totals still equal the prediction.

No pickle: the rank files are plain ``.npz`` arrays read with ``allow_pickle=False``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from chainexec.errors import ChainexecError
from chainexec.planner.plan import CATEGORIES

MANIFEST = "checkpoint.json"
FORMAT = 1
"""Version of the manifest's layout."""


class Stopped(Exception):
    """Every rank stopped after a checkpoint (``--stop-after``); the same command resumes."""

    def __init__(self, done: int, count: int, folder: Path):
        super().__init__(f"stopped at a checkpoint after {done} of {count} tiles ({folder}); "
                         f"run the same command to resume")
        self.done, self.count, self.folder = done, count, folder


def plan_digest(plan_text: str, ranks: int) -> str:
    """What a checkpoint belongs to: the plan (every tile, every buffer) and the rank count (each
    rank saves its own rows)."""
    return hashlib.sha256(f"{plan_text}\0ranks={ranks}".encode()).hexdigest()


class Checkpoint:
    """Where and how often a run checkpoints: ``every`` seconds at most between checkpoints of a
    resumable loop, and a stop after the first checkpoint past ``stop_after`` seconds (None: run
    to the end). ``saved`` is the manifest found at the start (None: start from scratch), read
    and checked on rank 0 by :meth:`open` and passed to every rank."""

    def __init__(self, folder: str | Path, digest: str, every: float = 600.0, stop_after: float | None = None,
                 saved: dict | None = None):
        if every < 0 or (stop_after is not None and stop_after < 0):
            raise ChainexecError("checkpoint intervals must not be negative")
        self.folder = Path(folder)
        self.digest = digest
        self.every = every
        self.stop_after = stop_after
        self.saved = saved
        self.started = self.last = time.monotonic()

    @classmethod
    def open(cls, folder: str | Path, plan_text: str, ranks: int, every: float = 600.0,
             stop_after: float | None = None) -> "Checkpoint":
        """Create the folder, or read its manifest and check that it belongs to this plan (rank 0;
        one-line ChainexecError naming the file otherwise)."""
        folder = Path(folder)
        digest = plan_digest(plan_text, ranks)
        path = folder / MANIFEST
        saved = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if path.exists():
                saved = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ChainexecError(f"cannot use it as a checkpoint: {err}", str(path if path.exists() else folder)) from None
        if saved is not None:
            if not isinstance(saved, dict) or saved.get("format") != FORMAT:
                raise ChainexecError("not a chainexec checkpoint of this version", str(path))
            if saved.get("plan") != digest:
                raise ChainexecError("a checkpoint of another plan (config, machine or rank count differ); "
                                     "remove the folder or choose another", str(path))
            fields = ("nest", "position", "done", "tiles", "number")
            if (not all(isinstance(saved.get(k), int) and saved[k] >= 0 for k in fields)
                    or not isinstance(saved.get("counts"), list) or len(saved["counts"]) != len(CATEGORIES) + 3
                    or not all(isinstance(c, int) for c in saved["counts"])):
                raise ChainexecError("damaged checkpoint manifest (a field is missing or not a count)", str(path))
        return cls(folder, digest, every, stop_after, saved)

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
        with open(tmp, "wb") as f:
            np.savez(f, *arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def read_rank(self, rank: int, number: int, count: int) -> list[np.ndarray]:
        path = self._rank_file(rank, number)
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = [z[f"arr_{k}"] for k in range(count)]
        except (OSError, KeyError, ValueError) as err:
            raise ChainexecError(f"unreadable checkpoint part: {err}", str(path)) from None
        return arrays

    def commit(self, manifest: dict) -> None:
        """Replace the manifest (rank 0, after every rank's part is on disk)."""
        path = self.folder / MANIFEST
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, "plan": self.digest, **manifest}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.last = time.monotonic()

    def remove_rank(self, rank: int, number: int) -> None:
        self._rank_file(rank, number).unlink(missing_ok=True)

    def remove_manifest(self) -> None:
        (self.folder / MANIFEST).unlink(missing_ok=True)

    def clear_rank(self, rank: int) -> None:
        """Remove every part of this rank (after the manifest: a crash in between leaves no
        manifest naming a missing part)."""
        for path in self.folder.glob(f"rank{rank}-*.npz"):
            path.unlink(missing_ok=True)
