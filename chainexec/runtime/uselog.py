"""What runs on a device loaded on first use, kept so that the next process loads it early.

Why: CUDA loads a library's kernels and a module's functions on their first use in a process
(lazy loading). In a fresh (T) process at benzene's shapes (o=21, v=93) those first uses held up
the executor for about 0.1 s (``torch.profiler``, H200 and H100, 2026-11-27): 13–24 ms before each
of the first cuBLAS GEMM kernels ran, about 5 ms before each generated kernel's first launch. A
second run in the same process does not pay them, and runs 2–5 of one process took 0.19 s
against 0.28–0.34 s in fresh processes. The kernel cuBLAS picks depends on the call's shape, so
the log keeps the calls themselves; :mod:`chainexec.runtime.warmup` makes them again on stand-in
matrices, and loads the logged generated kernels, on a thread that starts with the process.

The file is ``<kernel cache>/uses.json``: per device name and job (a config file's path, so that
a warm-up loads what this job used, not what every job on the device did) and per kind, the
newest :data:`KEPT` uses in the order first noted. ``gemms``: cuBLAS calls, each ``[precision,
strided, transa, transb, m, n, k, lda, ldb, ldc, count, beta]`` (precision ``d`` or ``s``;
strided: the strided-batched entry point, else the pointer-array one; beta 0 or 1). ``modules``:
generated contraction kernels, each ``[CUBIN cache key, function name]``
(:func:`chainexec.runtime.kernels.load_function`). ``sources``: point-wise kernels, each
``[function name, source]`` (:mod:`chainexec.runtime.pointwise`, compiled and cached by CuPy). A
use not in the file is added and the file replaced atomically; two processes adding at once may
lose one addition (a later run adds it again). Unreadable means empty.
Nothing here is needed for a run's results: the log only moves a load earlier.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from pathlib import Path

KEPT = 64
"""Uses kept per device, job and kind (the newest): a (T) run at benzene's shapes makes 12
distinct cuBLAS calls and launches 11 point-wise kernels (2026-11-27)."""

JOBS = 16
"""Jobs whose uses are kept per device (those that added a use most recently): a warm-up
replays one job's uses, not those of every job the device ran."""

KINDS = ("gemms", "modules", "sources")

_LOCK = threading.Lock()
_SEEN: dict[str, dict[str, set[tuple]]] = {}  # entry -> kind -> uses in the file or added by this process
_JOB = [""]  # the job this process runs now (:func:`set_job`)


def job_of(config) -> str:
    """The job a config file is: its resolved path (a job run again finds what it used)."""
    return str(Path(config).resolve())


def set_job(job: str) -> None:
    """Log this process's uses under ``job`` from now on (:func:`chainexec.api.run` sets it)."""
    _JOB[0] = job


def current_job() -> str:
    """The job :func:`set_job` set last ("" before that)."""
    return _JOB[0]


def _entry(device: str, job: str) -> str:
    return f"{device} | {job}"


def path() -> Path:
    from chainexec.runtime.kernels import cache_dir

    return cache_dir() / "uses.json"


def _file(where: Path) -> dict:
    try:
        data = json.loads(where.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def uses(device: str, job: str, where: Path | None = None) -> dict[str, list[tuple]]:
    """Every kind's uses (:data:`KINDS`) kept for ``job`` on ``device``, oldest first, from one
    read of the file; empty lists where it is missing or unreadable."""
    entry = _file(where or path()).get(_entry(device, job))
    entry = entry if isinstance(entry, dict) else {}
    return {kind: [tuple(use) for use in entry[kind] if _valid(use)] if isinstance(entry.get(kind), list) else []
            for kind in KINDS}


def _valid(use) -> bool:
    """A use as :func:`note` writes it: a list of numbers and strings (anything else is a file
    written by something else, read as nothing)."""
    return isinstance(use, list) and all(isinstance(x, (str, int, float)) for x in use)


_PAUSED = threading.local()


@contextlib.contextmanager
def paused():
    """Within it, this thread's uses are not logged: the autotuner's timing runs load every
    candidate it times, and a warm-up that loaded them all would take longer than the loads it
    saves (each generated kernel about 1–5 ms)."""
    _PAUSED.depth = getattr(_PAUSED, "depth", 0) + 1
    try:
        yield
    finally:
        _PAUSED.depth -= 1


def note(device: str, kind: str, use: tuple, where: Path | None = None) -> None:
    """Record that ``use`` happened on ``device`` in the current job (:func:`set_job`), outside
    :func:`paused`: the first time this process meets a use the file does not hold, it is
    appended (the newest :data:`KEPT` kept, the newest :data:`JOBS` jobs per device) and the file
    replaced atomically. A folder that cannot be written leaves it as it was."""
    if getattr(_PAUSED, "depth", 0):
        return
    with _LOCK:
        name = _entry(device, _JOB[0])
        known = _SEEN.get(name)
        if known is not None and use in known[kind]:  # the common case, once per launch: no file read
            return
        where = where or path()
        if known is None:
            known = _SEEN[name] = {k: set(v) for k, v in uses(device, _JOB[0], where).items()}
            if use in known[kind]:
                return
        known[kind].add(use)
        data = _file(where)
        entry = data.pop(name, None)
        entry = entry if isinstance(entry, dict) else {}
        kept = entry.get(kind) if isinstance(entry.get(kind), list) else []
        kept = [u for u in kept if _valid(u) and tuple(u) != use]  # another process may have added it
        data[name] = entry | {kind: (kept + [list(use)])[-KEPT:]}  # the job now the newest on the device
        jobs = [k for k in data if k.startswith(f"{device} | ")]
        for old in jobs[:-JOBS]:
            del data[old]
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=where.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is meant to be shared
            os.replace(tmp, where)
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
