"""What runs on a device loaded on first use, kept so that the next process loads it early.

CUDA loads a library's kernels and a module's functions on their first use in a process (lazy
loading), so a fresh process's first cuBLAS calls and first launch of each generated kernel wait
for a load that a second run in the same process does not pay. The kernel cuBLAS picks depends
on the call's shape, so the log keeps the calls themselves; :mod:`chainexec.runtime.warmup`
makes them again on stand-in matrices, and loads the logged generated kernels, on a thread that
starts with the process.

The file is ``<kernel cache>/uses.json``: per device name and job (a config file's path, so that
a warm-up loads what this job used, not what every job on the device did) and per kind, the
newest :data:`KEPT` uses in the order first noted. ``gemms``: cuBLAS calls, each ``[precision,
strided, transa, transb, m, n, k, lda, ldb, ldc, count, beta]`` (precision ``d`` or ``s``;
strided: the strided-batched entry point, else the pointer-array one; beta 0 or 1). ``modules``:
generated contraction kernels, each ``[CUBIN cache key, function name]``
(:func:`chainexec.runtime.kernelcache.note`, at each launch). ``sources``: point-wise kernels, each
``[function name, source]`` (:mod:`chainexec.runtime.pointwise`; compiled through the same cache).
``prepared``: host-side preparations of point-wise kernels, each ``[name, arguments as JSON]``
(:func:`chainexec.runtime.pointwise.prepare`), made again by the next process while its warm-up
loads (:func:`chainexec.runtime.warmup.prepare`). A
run's uses are gathered in memory (:func:`note`: no file touched while the executor runs) and
merged into the file once, after the executor (:func:`flush`, from :func:`chainexec.api.run`),
which is replaced whole and only where it changes; two processes flushing at once may lose
one's additions (a later run adds them again). Unreadable means empty. Nothing here is needed
for a run's results: the log only moves a load earlier.

The log is not a :class:`chainexec.diskstore.Store` of entries: it is one file that each process
merges its uses into (read, merge, replace whole). It shares the caches' folder (the kernel
cache's), their tolerant read (:func:`chainexec.diskstore.read`) and their whole-file write,
readable by the node's other users (:data:`chainexec.diskstore.SHARED`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path

from chainexec import atomicfile, diskstore

KEPT = 64
"""Uses kept per device, job and kind (the newest): more than the distinct cuBLAS calls and
point-wise kernels that one run of a job meets, so that none of a job's uses is dropped."""

JOBS = 16
"""Jobs whose uses are kept per device (those that added a use most recently): a warm-up
replays one job's uses, not those of every job the device ran."""

KINDS = ("gemms", "modules", "sources", "prepared")

_LOCK = threading.Lock()
_PENDING: dict[str, dict[str, dict[tuple, None]]] = {}  # entry -> kind -> uses (in order) not yet flushed
_JOB = ""  # the job this process runs now (:func:`set_job`)


def job_of(config) -> str:
    """The job a config file is: its absolute path with links resolved (a job run again finds what
    it used). Never raises: a path that cannot be resolved is kept as it is absolute."""
    return os.path.realpath(os.fspath(config))


def set_job(job: str) -> None:
    """Log this process's uses under ``job`` from now on (:func:`chainexec.api.run` sets it)."""
    global _JOB
    _JOB = job


def job() -> str:
    """The job this process logs its uses under now (:func:`set_job`)."""
    return _JOB


def _entry(device: str, job: str) -> str:
    return f"{device} | {job}"


def path() -> Path:
    """``<kernel cache>/uses.json`` (:func:`chainexec.runtime.kernelcache.cache_dir`)."""
    from chainexec.runtime.kernelcache import cache_dir

    return cache_dir() / "uses.json"


def _file(where: Path) -> dict:
    data = diskstore.read(where, json.loads)
    return data if isinstance(data, dict) else {}


def _kinds(entry) -> dict[str, list[tuple]]:
    entry = entry if isinstance(entry, dict) else {}
    return {kind: [tuple(use) for use in entry[kind] if _valid(use)] if isinstance(entry.get(kind), list) else []
            for kind in KINDS}


def uses(device: str, job: str, where: Path | None = None) -> dict[str, list[tuple]]:
    """Every kind's uses (:data:`KINDS`) kept for ``job`` on ``device``, oldest first, from one
    read of the file; empty lists where it is missing or unreadable."""
    return _kinds(_file(where or path()).get(_entry(device, job)))


def _valid(use) -> bool:
    """A use as :func:`flush` writes it: a list of numbers and strings (anything else is a file
    written by something else, read as nothing)."""
    return isinstance(use, list) and all(isinstance(x, (str, int, float)) for x in use)


_PAUSED = threading.local()


@contextlib.contextmanager
def paused():
    """Within it, this thread's uses are not logged: the autotuner's timing runs load every
    candidate it times, and a warm-up that loaded them all would take longer than the loads it
    saves."""
    _PAUSED.depth = getattr(_PAUSED, "depth", 0) + 1
    try:
        yield
    finally:
        _PAUSED.depth -= 1


def note(device: str, kind: str, use: tuple) -> None:
    """Gather that ``use`` happened on ``device`` in the current job (:func:`set_job`), outside
    :func:`paused`, for :func:`flush`. In memory only: called once per launch."""
    if getattr(_PAUSED, "depth", 0):
        return
    with _LOCK:
        entry = _PENDING.get(_entry(device, _JOB))
        if entry is None:
            entry = _PENDING[_entry(device, _JOB)] = {k: {} for k in KINDS}
        entry[kind][use] = None


def flush(where: Path | None = None) -> None:
    """Merge the uses gathered since the last flush into the file: per entry and kind, those not
    there yet are appended (the newest :data:`KEPT` kept), an entry that gained one becomes its
    device's newest job (the newest :data:`JOBS` kept per device). The file is replaced
    atomically, and only where it changes; a folder that cannot be written leaves it as it was."""
    with _LOCK:
        pending = dict(_PENDING)
        _PENDING.clear()
    if not pending:
        return
    where = where or path()
    data = _file(where)
    changed = False
    for name, gathered in pending.items():
        kept = _kinds(data.get(name))
        new = {kind: [u for u in gathered[kind] if u not in there] for kind in KINDS
               for there in [set(kept[kind])]}
        if not any(new.values()):
            continue
        changed = True
        data.pop(name, None)
        data[name] = {kind: [list(u) for u in (kept[kind] + new[kind])[-KEPT:]] for kind in KINDS}
        device = name.split(" | ", 1)[0]
        for old in [k for k in data if k.split(" | ", 1)[0] == device][:-JOBS]:
            del data[old]
    if not changed:
        return
    try:
        atomicfile.write(where, json.dumps(data), diskstore.SHARED)
    except OSError:
        pass


_NAMES: dict[int, str] = {}


def device_name(cupy, device: int | None = None) -> str:
    """The name of CuPy device ``device`` (default: the current one), the log's key per device."""
    device = cupy.cuda.Device().id if device is None else device
    name = _NAMES.get(device)
    if name is None:
        raw = cupy.cuda.runtime.getDeviceProperties(device)["name"]
        name = _NAMES[device] = raw.decode() if isinstance(raw, bytes) else str(raw)
    return name
