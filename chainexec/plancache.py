"""Plans kept on disk between runs of the same config, machine and chainexec source.

Planning is a pure function of the config's text, the machine model, the run's options (forced
schedule, ranks, inlining) and the planner's code (:func:`chainexec.planner.build.make_plan`), so
a plan made once can be read back instead of made again: at the (T) job's sizes planning takes
longer than the executor, and a repeated run (a SLURM job resubmitted, a sweep over machines,
the benchmarks' warm runs) reads its plan in milliseconds.

Plans are JSON (:meth:`chainexec.planner.plan.Plan.to_json`), never pickles, in
``$CHAINEXEC_PLAN_CACHE`` (default ``~/.cache/chainexec/plans``), one file per key. The key is the
SHA-256 of everything planning reads: the config's text, the path it was given by and the working
folder (paths in a plan are resolved from them), the memory limits (a config without them plans
for the limits detected on the machine), the machine model, the options, the plan's format
version and the bytes of the sources that make plans (:data:`PLANNING`), so that any change to
the planner makes new keys.
A file that does not parse is a miss and is replaced. Files are written to a temporary name and
renamed, so concurrent runs never read half a plan. The cache keeps at most :data:`LIMIT` plans:
every change to the planner makes new keys, so old plans would otherwise pile up.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from functools import lru_cache
from pathlib import Path

from chainexec import atomicfile
from chainexec.planner.machine import Machine
from chainexec.planner.plan import FORMAT, Plan


PLAN_NAME = re.compile(r"[0-9a-f]{64}\.json")
"""A cached plan's file name: its key."""
LIMIT = 256
"""Plans kept at most; storing one more removes those read or written longest ago (a plan's
file is touched when it is read). The (T) plan at benzene's sizes is 100 kB."""


def cache_dir() -> Path:
    """Folder of the plan cache (created on first store)."""
    return Path(os.environ.get("CHAINEXEC_PLAN_CACHE", Path.home() / ".cache" / "chainexec" / "plans"))


PLANNING = ("planner", "spec.py", "expr.py", "ordering.py", "errors.py")
"""The parts of the ``chainexec`` package a plan is made by (the spec's reading and the
planner): a change anywhere else (the runtime, the kernels, the CLI) keeps the cached plans."""


def tree_digest(root: str | Path, parts: tuple[str, ...] | None = None) -> str:
    """SHA-256 of the Python sources under ``root`` (only those under ``parts``, paths relative
    to it, where given): their relative paths and bytes, in path order."""
    root = Path(root)
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root)
        if parts is None or name.parts[0] in parts:
            h.update(str(name).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@lru_cache(maxsize=1)
def source_digest() -> str:
    """:func:`tree_digest` of the planning sources (:data:`PLANNING`) with the plan's
    :data:`~chainexec.planner.plan.FORMAT`: part of every key, computed once per process."""
    return f"{FORMAT}:{tree_digest(Path(__file__).resolve().parent, PLANNING)}"


def key(config: str | Path, text: str, limits: dict[str, int], machine: Machine, schedule: str | None, ranks: int,
        inline: bool) -> str:
    """The cache key of planning ``text`` (the config file's contents, given as ``config``) within
    the memory ``limits`` (bytes per level: the config's, or detected from the machine) for
    ``machine`` with these options: a hex SHA-256."""
    parts = [source_digest(), str(config), os.getcwd(), text, limits, machine.to_json(), schedule, ranks, inline]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def load(digest: str) -> tuple[Plan, str] | None:
    """The cached plan of key ``digest`` and its JSON text, or None where there is none or its
    file does not parse; a plan found is marked as just used (:data:`LIMIT`)."""
    path = cache_dir() / f"{digest}.json"
    try:
        text = path.read_text()
        found = Plan.from_json(text), text
    except (OSError, ValueError, KeyError, TypeError):  # unreadable, or not a plan's JSON
        return None
    try:
        os.utime(path)
    except OSError:  # a cache this process may read but not write: the plan serves all the same
        pass
    return found


def store(digest: str, text: str) -> None:
    """Keep a plan's JSON ``text`` under key ``digest``; a cache folder that cannot be written
    is not an error (the run goes on, planning again next time)."""
    folder = cache_dir()
    try:
        atomicfile.write(folder / f"{digest}.json", text)
    except OSError:
        return
    _prune(folder, LIMIT)


def _prune(folder: Path, keep: int) -> None:
    """Remove all but the ``keep`` plans of ``folder`` used last (by modification time), and
    temporary files older than a day (a process killed while writing); only this cache's own
    names are touched, and a file that cannot be removed (another process's, or gone) is left."""
    used, now = [], time.time()
    for path in folder.iterdir():
        try:
            if PLAN_NAME.fullmatch(path.name):
                used.append((path.stat().st_mtime, path))
            elif path.suffix == ".tmp" and now - path.stat().st_mtime > 86400:
                path.unlink()
        except OSError:
            continue
    for _, path in sorted(used)[:-keep]:
        try:
            path.unlink()
        except OSError:
            continue


def fits(plan: Plan, spec) -> bool:
    """Whether a plan read from the cache is one of ``spec`` (:class:`chainexec.spec.Spec`) in
    what the cache must not be trusted with: its name, the config's extents and scratch folder, every input's
    source and output's file as the spec resolves them, and every tensor and index name an
    identifier (names reach generated CUDA source; a config's are validated when it is read, a
    cached plan's are not). A folder others may write to is otherwise trusted as the kernel
    cache's compiled code is."""
    if (plan.name != spec.name or any(plan.extents.get(i) != n for i, n in spec.extents.items())
            or plan.scratch != spec.resolve(spec.scratch)):
        return False
    outputs = spec.output_records()
    for name, t in plan.tensors.items():
        declared = name in spec.tensors
        if (t.source is not None and (not declared or t.source != spec.source_record(name))
                or t.output is not None and t.output != outputs.get(name)):
            return False
    names = [n for c in plan.contractions for n in (c.out, c.a, c.b, *c.indices()) if n is not None]
    return all(n.isidentifier() and n.isascii() for n in names + list(plan.tensors) + list(plan.extents))
