"""Plans kept on disk between runs of the same config, machine and chainexec source.

Planning is a pure function of the config's text, the machine model, the run's options (forced
schedule, ranks, inlining) and the planner's code (:func:`chainexec.planner.build.make_plan`), so
a plan made once is read back instead of made again: planning a large job can take longer than
its executor, and a repeated run (a SLURM job resubmitted, a sweep over machines, a benchmark's
warm runs) reads one file instead.

The cache is a :class:`chainexec.diskstore.Store` in ``$CHAINEXEC_PLAN_CACHE`` (default
``~/.cache/chainexec/plans``): one file per key, holding the plan's JSON
(:meth:`chainexec.planner.plan.Plan.to_json`, never a pickle), private to the user. The key is
the SHA-256 of everything planning reads: the store's version, which is :func:`source_digest`
(the plan's format and the bytes of the sources that make plans, :data:`PLANNING`, so that any
change to the planner makes new keys), the config's text, the path it was given by and the
working folder (paths in a plan are resolved from them), the memory limits (a config without them
plans for the limits detected on the machine), the machine model and the options. An entry that
does not match the digest written with it (:meth:`chainexec.diskstore.Store.find`), whose plan
cannot be read back (any error) or that does not fit the config (:func:`fits`) is a miss, planned
again and replaced: a damaged plan that still parses would otherwise fail every later run. The
cache keeps at most :data:`LIMIT` plans: every change to the planner makes new keys, so old plans
would otherwise pile up.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

from chainexec import diskstore, expr
from chainexec.planner.machine import Machine
from chainexec.planner.plan import FORMAT, INTERMEDIATE, Plan, ops
from chainexec.speccheck import check_identifier
from chainexec.spectypes import DTYPES


LIMIT = 256
"""Plans kept at most (files); storing one more removes those read or written longest ago. A
large job's plan is about 100 kB, so the cache stays within tens of MB."""


def cache_dir() -> Path:
    """Folder of the plan cache (created on first store)."""
    return diskstore.folder("plans", "CHAINEXEC_PLAN_CACHE")


PLANNING = ("planner", "__init__.py", "spec.py", "specyaml.py", "speccheck.py", "spectypes.py", "pairs.py", "expr.py",
            "ordering.py", "errors.py", "packing.py", "sources.py", "userfiles.py", "generator.py", "kernels/__init__.py",
            "kernels/orbits.py", "kernels/elementwise.py")
"""The parts of the ``chainexec`` package a plan is made by: the spec's reading, the planner and
every module they import (the cost model prices fused statements by the orbit kernels' bytes,
:mod:`chainexec.kernels.orbits`; the tests keep the list whole). A change anywhere else (the
runtime, the other kernels, the CLI) keeps the cached plans."""


def tree_digest(root: str | Path, parts: tuple[str, ...] | None = None) -> str:
    """SHA-256 of the Python sources under ``root`` (only those that are, or lie under, one of
    ``parts``, paths relative to it, where given): their relative paths and bytes, in path
    order."""
    root = Path(root)
    wanted = None if parts is None else [Path(part).parts for part in parts]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root)
        if wanted is None or any(name.parts[:len(part)] == part for part in wanted):
            h.update(str(name).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@lru_cache(maxsize=1)
def source_digest() -> str:
    """:func:`tree_digest` of the planning sources (:data:`PLANNING`) with the plan's
    :data:`~chainexec.planner.plan.FORMAT`: part of every key, computed once per process."""
    return f"{FORMAT}:{tree_digest(Path(__file__).resolve().parent, PLANNING)}"


def _store() -> diskstore.Store:
    """The plan cache: versioned by :func:`source_digest`, at most :data:`LIMIT` plans."""
    return diskstore.Store(cache_dir(), version=source_digest(), limit=LIMIT)


def key(config: str | Path, text: str, limits: dict[str, int], machine: Machine, schedule: str | None, ranks: int,
        inline: bool) -> str:
    """The cache key of planning ``text`` (the config file's contents, given as ``config``) within
    the memory ``limits`` (bytes per level: the config's, or detected from the machine) for
    ``machine`` with these options: a hex SHA-256."""
    return diskstore.digest(_store().key(str(config), os.getcwd(), text, limits, machine.to_json(), schedule, ranks,
                                         inline))


def load(digest: str) -> tuple[Plan, str] | None:
    """The cached plan of key ``digest`` and its JSON text, or None where there is none, its entry
    is damaged (:meth:`chainexec.diskstore.Store.load`) or reading its plan raises anything: a
    cache only saves work, so no error in it ends a run. A plan found is marked as just used
    (:data:`LIMIT`)."""
    def parse(text: str) -> tuple[Plan, str] | None:
        try:
            return Plan.from_json(text), text
        except Exception:  # an entry of another version or program, whatever its reading raises
            return None

    return _store().load(digest, parse)


def store(digest: str, text: str) -> None:
    """Keep a plan's JSON ``text`` under key ``digest``; a cache folder that cannot be written
    is not an error (the run goes on, planning again next time)."""
    try:
        _store().save(digest, text)
    except OSError:
        pass


def fits(plan: Plan, spec) -> bool:
    """Whether a plan read from the cache is one of ``spec`` (:class:`chainexec.spec.Spec`) in
    what the cache must not be trusted with: its name, the config's extents and scratch folder, every input's
    source and output's file as the spec resolves them, every tensor's dtype and item size
    (:func:`_dtype`: a run trusts them to read, allocate and write), and every tensor and index name
    (:func:`_names`) either one a config may have (:func:`~chainexec.speccheck.check_identifier`)
    or one the planner gives intermediates (:data:`~chainexec.planner.plan.INTERMEDIATE`): names
    reach generated CUDA source, and a config's are validated when it is read, a cached plan's
    are not. A folder others may write to is otherwise trusted as the kernel cache's compiled
    code is."""
    if (plan.name != spec.name or any(plan.extents.get(i) != n for i, n in spec.extents.items())
            or plan.scratch != spec.resolve(spec.scratch)):
        return False
    outputs = spec.output_records()
    for name, t in plan.tensors.items():
        declared = name in spec.tensors
        if (t.source is not None and (not declared or t.source != spec.source_record(name))
                or t.output is not None and t.output != outputs.get(name)
                or t.dtype != _dtype(spec, name) or t.itemsize != DTYPES.get(t.dtype)):
            return False
    try:
        for name in _names(plan):
            if not INTERMEDIATE.fullmatch(name):
                check_identifier(name, "name")
    except ValueError:
        return False
    return True


def _dtype(spec, name: str) -> str | None:
    """The dtype the planner gives tensor ``name`` of ``spec``: a declared tensor's own, an
    intermediate's (:data:`~chainexec.planner.plan.INTERMEDIATE`, ``_s<statement>_…``) that of its
    statement's result (:func:`chainexec.planner.build.contractions`); None for any other name, which
    no plan of ``spec`` holds."""
    if name in spec.tensors:
        return spec.tensors[name].dtype
    if not INTERMEDIATE.fullmatch(name):
        return None
    statement = int(name[2:].split("_")[0])
    return spec.tensors[spec.statements[statement].lhs.tensor].dtype if statement < len(spec.statements) else None


def _names(plan: Plan):
    """Every tensor and index name of a plan that reaches generated source: its contractions', its
    tensors' and extents' keys, and those of its fused expressions (output, domain, reused
    producers and the references of their text)."""
    for c in plan.contractions:
        yield from (n for n in (c.out, c.a, c.b, *c.indices()) if n is not None)
    yield from plan.tensors
    yield from plan.extents
    for nest in plan.nests:
        for op, _ in ops(nest.body):
            f = op.expression
            if f is None:
                continue
            yield f.out
            yield from f.out_indices
            yield from f.domain
            for name, indices, text in f.lets:
                yield name
                yield from indices
                yield from (n for ref in expr.refs(expr.parse(text)) for n in (ref.tensor, *ref.indices))
            yield from (n for ref in expr.refs(f.tree) for n in (ref.tensor, *ref.indices))
