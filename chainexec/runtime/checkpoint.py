"""Checkpoints (:mod:`chainexec.planner.resume`), so that a run killed (a node failure, the batch
system's time limit) or stopped on purpose (``run --stop-after``) goes on from its last checkpoint
instead of from the start.

A checkpoint falls at the end of a nest that ``Nest.checkpoint_after`` allows, or between two
tiles of a resumable loop (``Loop.resume``): an ``accumulate`` loop's (every rank between tiles,
its accumulation targets' rows saved) or a ``store`` loop's (between two iterations, the stored
blocks sealed: :meth:`chainexec.runtime.store.Store.seal`).

The folder holds ``checkpoint.json``, the manifest, and for an accumulate loop
``rank<R>-<N>.npz``: rank R's rows of every accumulation target at checkpoint N. Every rank makes
its part durable (its rows written and synced, its shard files sealed) before rank 0 replaces the
manifest (atomically, by rename): the manifest is the commit point, and the files it names are
complete. Checkpoint numbers grow over the whole run (and on from a resumed one), so no
checkpoint writes over the files the manifest names. It records the plan (SHA-256 of the plan's
JSON and the rank count; ``inputs.json`` beside it identifies the input files by content,
:func:`_check_inputs`); where the run goes on (``nest``: the
nests before it are finished; ``position``: the resumable loop of that nest with ``done`` of its
``tiles`` tiles finished, or None at the nest's start); the closed versions (``stored``, the
latest of each tensor; ``joined``, each output's blocks per rank) and the sealed blocks of the
versions being written (``open``); the identity of every shard file sealed (``files``: stamp and
content digest, :mod:`chainexec.runtime.fileid`), which a resumed run checks before it reads any,
so that a file damaged or written over since is refused, not read into the results; what the
finished work had counted (``banked``: the finished
nests and store loops of the nest, which a resumed run skips; ``counts``: the loop's tiles done;
bytes per category, flops, statements, streamed bytes and parallel tiles, all ranks), which a
resumed run adds to its own, and the memory peaks reached, which it keeps (the tiles left may
all be smaller edge tiles), so that its totals and peaks still equal the prediction.

No pickle: the rank files are plain ``.npz`` arrays read with ``allow_pickle=False``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from pathlib import Path

import h5py
import numpy as np

from chainexec import atomicfile, datafiles, safepaths
from chainexec.errors import ChainexecError
from chainexec.spectypes import MAX_SIZE
from chainexec.planner.plan import CATEGORIES, Plan, TensorInfo, stores, to_dict
from chainexec.runtime import fileid
from chainexec.runtime.store import version_base

MANIFEST = "checkpoint.json"
INPUTS = "inputs.json"
_PART = re.compile(r"rank[0-9]+-[0-9]+\.npz")
"""The names of the rank files."""
FORMAT = 5
"""Version of the manifest's layout (its shard files identified by stamp and digest), of the tile
order its counts refer to and of its plan digest (the work, not :data:`RECORDS`): a checkpoint of
another version is refused, since its counts or files cannot be read as this one's."""
_SHARD = re.compile(r"rank[0-9]+(s[0-9]+)?(-[0-9]+)?\.h5")
"""The names of shard files (:class:`chainexec.runtime.store.Store`)."""
COUNTS = len(CATEGORIES) + 4
"""Counts a manifest records: bytes per category, flops, statements, streamed bytes, parallel tiles."""


class Stopped(Exception):
    """Every rank stopped after a checkpoint (``--stop-after``); the same command resumes."""

    def __init__(self, done: int, count: int, folder: Path, unit: str = "tiles"):
        super().__init__(f"stopped at a checkpoint after {done} of {count} {unit} ({folder}); "
                         f"run the same command to resume")
        self.done, self.count, self.folder = done, count, folder


RECORDS = ("predicted", "alternatives", "machine", "memory_limit")
"""Fields of a plan's data that describe it rather than make its work: its prediction (priced
again for the page cache's contents, which a resumed run finds changed), the alternatives
weighed, where its limits and rates came from, and the limits themselves (detected from the
memory free at the start). A resumed run may differ in them and still do the same work."""


def plan_digest(plan: Plan, ranks: int) -> str:
    """What a checkpoint belongs to: the plan's work (every tile, every buffer, the input files'
    paths: its data but :data:`RECORDS`) and the rank count (each rank saves its own rows). The
    inputs' contents are checked apart (:func:`_check_inputs`)."""
    work = {k: v for k, v in to_dict(plan).items() if k not in RECORDS}
    return hashlib.sha256("\0".join([json.dumps(work, sort_keys=True), f"ranks={ranks}"]).encode()).hexdigest()


def planned_with(plan: Plan) -> dict:
    """What ``plan`` was made with, for a manifest (``planned_with``): the memory limit of each
    level (bytes) and the machine model's rates (:attr:`Plan.machine`'s values, by field): a
    resumed run plans with them (:func:`saved_planning`) where memory it detects or a calibration
    of another node would otherwise make another plan, which the checkpoint does not fit."""
    return {"limits": dict(plan.memory_limit),
            "rates": {name: record["value"] for name, record in plan.machine.items() if not name.endswith("_memory")}}


def saved_planning(folder: str | Path, ranks: int) -> tuple[dict[str, int], str, Path] | None:
    """The memory limits (bytes per level) and the machine file's text of rates that the plan of
    the checkpoint in ``folder`` was made with (:func:`planned_with`), and its manifest's path;
    None where there is no manifest there, it was made on other than ``ranks`` ranks, or it
    names none that can be read (the run then plans as a new one, and :meth:`Checkpoint.open`
    says what is wrong with the folder)."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        limits, rates = manifest["planned_with"]["limits"], manifest["planned_with"]["rates"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (manifest.get("ranks") == ranks and isinstance(limits, dict) and set(limits) == {"global", "device"}
            and all(type(v) is int and 0 < v <= MAX_SIZE for v in limits.values()) and isinstance(rates, dict)
            and rates):
        return None
    return limits, json.dumps(rates), path


def _input_files(plan: Plan) -> list[str]:
    """Every file the run's inputs read (:func:`chainexec.datafiles.of`)."""
    return sorted({file for t in plan.tensors.values() if t.from_file()
                   for file in datafiles.of(t.source["file"], t.source["dataset"])})


def _check_inputs(folder: Path, plan: Plan, resuming: bool) -> None:
    """Identify the run's input files by content in ``folder/inputs.json``: a new checkpoint
    records each file's stamp and content digest (:func:`chainexec.runtime.fileid.identity`); a
    resumed one accepts a file whose stamp is unchanged, or whose content digest is (a copy, a
    touch: the new stamp is recorded), and refuses one whose content differs, so that partial
    sums of other inputs are never mixed in."""
    path = folder / INPUTS
    files = _input_files(plan)
    record = None
    if resuming:
        try:
            record = json.loads(path.read_text())
            valid = (isinstance(record, dict) and set(record) == set(files)
                     and all(fileid.is_record(r) for r in record.values()))
        except (OSError, ValueError):
            valid = False
        if not valid:
            raise ChainexecError("the checkpoint does not record its input files (remove the folder or choose "
                                 "another)", str(path))
    if record is None:
        atomicfile.write(path, json.dumps({file: fileid.identity(file) for file in files}, indent=1))
        return
    before = json.dumps(record)
    for file in files:
        if not fileid.unchanged(file, record[file]):  # takes the new stamp where only that changed
            raise ChainexecError(f"the input file {file} changed since the checkpoint was written; its partial "
                                 "sums would mix with the new values: remove the folder or choose another", str(path))
    if json.dumps(record) != before:
        atomicfile.write(path, json.dumps(record, indent=1))


def _loops(plan: Plan) -> dict[tuple[int, int], tuple[str, int]]:
    """Every resumable loop, (nest, position) → its kind (``Loop.resume``) and number of tiles
    (``Loop.count``)."""
    return {(k, pos): (node.resume, node.count)
            for k, nest in enumerate(plan.nests) for pos, node in enumerate(nest.body) if getattr(node, "resume", None)}


def _blocks(per_rank, t: TensorInfo, ranks: int) -> bool:
    """Whether ``per_rank`` holds each rank's blocks of tensor ``t`` as a manifest records them:
    [shard file, dataset, region] each, named as the store names them, the region inside ``t``."""
    return (isinstance(per_rank, list) and len(per_rank) == ranks
            and all(isinstance(b, list) and len(b) == 3 and isinstance(b[0], str) and _SHARD.fullmatch(b[0])
                    and isinstance(b[1], str) and re.fullmatch(r"b[0-9]+", b[1])
                    and isinstance(b[2], list) and len(b[2]) == len(t.shape)
                    and all(isinstance(r, list) and [type(x) for x in r] == [int, int] and 0 <= r[0] < r[1] <= n
                            for r, n in zip(b[2], t.shape))
                    for blocks in per_rank for b in blocks))


def _valid(saved: dict, plan: Plan, ranks: int) -> bool:
    """Whether a manifest's fields are all there and in range for ``plan`` on ``ranks`` ranks:
    a place to go on from that this plan checkpoints, counts, peaks, and closed and open versions
    of tensors it writes, with their blocks."""
    if not (all(type(saved.get(k)) is int and saved[k] >= 0 for k in ("nest", "done", "tiles", "number", "ranks"))
            and saved["ranks"] == ranks
            and all(isinstance(saved.get(k), list) and len(saved[k]) == COUNTS
                    and all(type(c) is int and 0 <= c < 2**63 for c in saved[k]) for k in ("counts", "banked"))
            and isinstance(saved.get("peaks"), dict) and set(saved["peaks"]) == {"global", "device"}
            and all(type(v) is int and v >= 0 for v in saved["peaks"].values())):
        return False
    nest, position, tensors = saved["nest"], saved.get("position"), plan.tensors
    if position is None:
        at = (0 < nest <= len(plan.nests) and plan.nests[nest - 1].checkpoint_after
              and saved["done"] == saved["tiles"] == 0)
    else:
        loop = _loops(plan).get((nest, position)) if type(position) is int else None
        at = loop is not None and loop[1] == saved["tiles"] and saved["done"] < saved["tiles"]
    stored, joined, opened = saved.get("stored"), saved.get("joined"), saved.get("open")
    files = saved.get("files")
    nonfinite = saved.get("nonfinite", {})  # absent from a manifest of before it: none counted
    outputs = {t for t, info in tensors.items() if info.role == "output"}
    if not (isinstance(nonfinite, dict) and set(nonfinite) <= outputs
            and all(type(n) is int and 0 <= n < 2**63 for n in nonfinite.values())):
        return False
    if not (at and isinstance(stored, dict) and isinstance(joined, dict) and isinstance(opened, list)
            and isinstance(files, dict) and all(isinstance(f, str) and fileid.is_record(r) for f, r in files.items())
            and all(tensors.get(t) is not None and tensors[t].role != "input" and type(v) is int and v > 0
                    for t, v in stored.items())
            and set(joined) == {t for t in stored if tensors[t].role == "output"}
            and all(_blocks(blocks, tensors[t], ranks) for t, blocks in joined.items())):
        return False
    writing = stores(plan.nests[nest].body).items() if nest < len(plan.nests) else ()
    return all(isinstance(o, list) and len(o) == 3 and isinstance(o[0], str) and (o[0], o[1]) in writing
               and _blocks(o[2], tensors[o[0]], ranks) for o in opened)


def _missing(saved: dict, plan: Plan) -> Path | None:
    """The first file that a valid manifest names and a resumed run reads but that is not there:
    a shard file of a block it records, or (where nests are left to run) a closed version's VDS
    or a shard file that VDS maps (a scratch file system that purges files one by one leaves
    the VDS without them, and the read of the version would fail mid-run). A VDS that cannot be
    read or holds no virtual dataset ``data`` (damaged, written over) is a :class:`ChainexecError`
    naming it."""
    named = [(t, v, b[0]) for t, v, blocks in saved["open"] for rank in blocks for b in rank]
    named += [(t, saved["stored"][t], b[0]) for t, blocks in saved["joined"].items() for rank in blocks for b in rank]
    paths = [version_base(plan, plan.tensors[t], v) / file for t, v, file in named]
    if saved["nest"] < len(plan.nests):
        for t, v in saved["stored"].items():
            vds = Path(f"{version_base(plan, plan.tensors[t], v)}.h5")
            paths += _version_files(vds) if vds.is_file() else [vds]
    return next((p for p in paths if not p.is_file()), None)


def _version_files(vds: Path) -> list[Path]:
    """A closed version's VDS file and the shard files its dataset ``data`` maps; a
    :class:`ChainexecError` naming it where it cannot be read or ``data`` is not a virtual
    dataset (damaged, or another file written in its place)."""
    try:
        with h5py.File(vds, "r") as f:
            data = f.get("data")
            joined = isinstance(data, h5py.Dataset) and data.is_virtual
        if joined:
            return [vds] + [Path(f) for f in datafiles.of(str(vds), "data")[1:]]
        problem = "its dataset 'data' is not the virtual dataset chainexec writes"
    except OSError as err:
        problem = str(err)
    raise ChainexecError(f"a stored version this checkpoint names cannot be read ({problem}): remove the "
                         "checkpoint folder to start again", str(vds))


EVERY = 600.0
"""Seconds at most between a run's checkpoints where ``--checkpoint-every`` is not given."""


def check_intervals(every: float, stop_after: float | None) -> None:
    """Refuse (:class:`ChainexecError`) intervals between checkpoints, or a time to stop after,
    that are not finite or are negative, naming the option: checked before a run makes its
    folders."""
    for option, seconds in (("--checkpoint-every", every), ("--stop-after", stop_after)):
        if seconds is not None and not (math.isfinite(seconds) and seconds >= 0):
            raise ChainexecError(f"{option} must be a finite number of seconds, not negative, not {seconds:g}")


class Checkpoint:
    """Where and how often a run checkpoints: ``every`` seconds at most between checkpoints (of
    a resumable loop or at a nest's end), and a stop after the first checkpoint past
    ``stop_after`` seconds (None: run to the end). ``saved`` is the manifest found at the start
    (None: start from scratch), read and checked on rank 0 by :meth:`open` and passed to every
    rank. ``committed`` is the number of the checkpoint the manifest names now; numbers only
    grow, so a new checkpoint never writes over the files of the committed one."""

    def __init__(self, folder: str | Path, digest: str, saved: dict | None = None, every: float = 600.0,
                 stop_after: float | None = None):
        check_intervals(every, stop_after)
        self.folder = Path(folder)
        self.digest = digest
        self.every = every
        self.stop_after = stop_after
        self.saved = saved
        self.committed = saved["number"] if saved is not None else None
        self.files: dict[str, dict] = dict(saved["files"]) if saved is not None else {}
        self.started = self.last = time.monotonic()

    @classmethod
    def open(cls, folder: str | Path, plan: Plan, ranks: int, every: float = 600.0,
             stop_after: float | None = None) -> "Checkpoint":
        """Create the folder, or read its manifest and check it (rank 0, before anything runs):
        same plan, ranks and inputs; fields that name a place this plan checkpoints at and
        versions it writes (:func:`_valid`); every rank's part readable, every shard file it
        names there. A one-line ChainexecError naming the file otherwise. ``every``: seconds
        between checkpoints; ``stop_after``: seconds after which the run checkpoints and stops
        (None: it runs to the end)."""
        folder = Path(folder)
        digest = plan_digest(plan, ranks)
        path = folder / MANIFEST
        saved = None
        try:
            safepaths.make_owned(folder, safepaths.CHECKPOINT)
            safepaths.lock_owned(folder, "checkpoint folder")
            if path.exists():
                saved = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ChainexecError(f"cannot use it as a checkpoint: {err}", str(path if path.exists() else folder)) from None
        ck = cls(folder, digest, None, every, stop_after)
        if saved is not None:
            ck._check(saved, path, plan, ranks)
            ck.saved, ck.committed = saved, saved["number"]
        try:
            _check_inputs(folder, plan, saved is not None)
        except OSError as err:
            raise ChainexecError(f"cannot identify the inputs: {err}", str(folder / INPUTS)) from None
        return ck

    def _check(self, saved, path: Path, plan: Plan, ranks: int) -> None:
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise ChainexecError("not a chainexec checkpoint of this version", str(path))
        if type(saved.get("ranks")) is int and saved["ranks"] >= 1 and saved["ranks"] != ranks:
            raise ChainexecError(f"a checkpoint of a run on {saved['ranks']} rank{'s' * (saved['ranks'] != 1)}; this "
                                 f"one has {ranks}: run it on {saved['ranks']} to go on, or remove the folder", str(path))
        if saved.get("plan") != self.digest:
            raise ChainexecError("a checkpoint of another plan (the config, its files' paths as resolved, the "
                                 "machine, the input files or chainexec's version differ); remove the folder or "
                                 "choose another", str(path))
        if not _valid(saved, plan, ranks):
            raise ChainexecError("damaged checkpoint manifest (a field is missing, out of range or names "
                                 "no place this plan checkpoints at)", str(path))
        if saved["position"] is not None and _loops(plan)[saved["nest"], saved["position"]][0] == "accumulate":
            for rank in range(ranks):
                self.read_rank(rank, saved["number"])
        for file, record in saved["files"].items():
            if os.path.exists(file) and not fileid.unchanged(file, record):
                raise ChainexecError("a shard file this checkpoint saved has changed since (damaged, or written "
                                     "over): the results resumed from it would be wrong; remove the checkpoint "
                                     "folder to start again", file)
        missing = _missing(saved, plan)
        if missing is not None:
            raise ChainexecError("a shard file or stored version this checkpoint names is missing", str(missing))

    def record_files(self, sealed: list[dict[str, dict]]) -> None:
        """Take the identities of the shard files every rank sealed for the checkpoint being
        committed (rank 0), and drop those of files no longer there (versions superseded)."""
        for mine in sealed:
            self.files.update(mine)
        self.files = {file: record for file, record in self.files.items() if os.path.exists(file)}

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
        try:
            with atomicfile.replacing(path, durable=True) as tmp, open(tmp, "wb") as f:
                np.savez(f, *arrays)
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
        try:
            with atomicfile.replacing(path, durable=True) as tmp, open(tmp, "w") as f:
                json.dump({"format": FORMAT, "plan": self.digest, **manifest}, f, indent=1)
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
        atomicfile.sync(self.folder)
        for path in self.folder.iterdir():
            made = atomicfile.replaced(path.name)
            if _PART.fullmatch(path.name) or path.name == INPUTS or made and (_PART.fullmatch(made) or made == MANIFEST):
                path.unlink(missing_ok=True)
        (self.folder / safepaths.MARK).unlink(missing_ok=True)
        safepaths.unlock(self.folder)
