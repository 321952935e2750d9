"""Everything the CLI does, callable from Python: plan, run, generate, verify.

``run`` is collective: every MPI rank calls it. Rank 0 loads the config, plans, and checks inputs
and outputs; any problem is broadcast so that all ranks raise the same :class:`ChainexecError`
before anything is written.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import numpy as np

from chainexec import plancache, safepaths
from chainexec import spec as spec_mod
from chainexec.errors import ChainexecError, RankFailed
from chainexec.planner.machine import Machine
from chainexec.planner.plan import Loop, Plan
from chainexec.runtime import store, uselog
from chainexec.runtime.checkpoint import Checkpoint, Stopped
from chainexec.runtime.comm import world
from chainexec.runtime.device import select
from chainexec.runtime.executor import Executor
from chainexec.verify import Check, verify as verify_spec


def load_machine(path: str | None) -> Machine:
    """The machine file at ``path`` (:meth:`Machine.from_file`, which checks every field), or
    the built-in model."""
    return Machine() if path is None else Machine.from_file(path)


def plan(config: str | Path, machine: str | None = None, schedule: str | None = None, ranks: int = 1,
         inline: bool = True, plan_cache: bool = False) -> Plan:
    """Load and plan a config (pure apart from reading the two files); ``schedule`` forces a
    named alternative, ``ranks`` spreads parallel loops over that many ranks, ``inline`` False
    keeps point-wise intermediates in buffers (see :func:`chainexec.planner.build.make_plan`).
    ``plan_cache``: read the plan from :mod:`chainexec.plancache` where :func:`run` would, and
    keep a new one there, so that a run of the same config, machine and options (``ranks``: the
    run's rank count) from the same folder does not plan again."""
    if not plan_cache:
        return _make_plan(spec_mod.load(config), load_machine(machine), schedule, ranks, inline)
    text = spec_mod.read(config)
    return _planned(spec_mod.loads(text, str(config)), text, load_machine(machine), schedule, ranks, inline, True)[0]


def generate(config: str | Path) -> list[str]:
    """Write the seeded random inputs of a config to its HDF5 files; returns ``file:dataset`` names.
    Every file is checked (:func:`chainexec.safepaths.check_generate`) and every input's seed
    found before any file is written; each file is written anew and renamed into place."""
    s = spec_mod.load(config)
    safepaths.check_generate(s)
    return store.write_random_inputs(_make_plan(s, Machine(), None, 1, True))


def run(config: str | Path, backend: str = "auto", machine: str | None = None, schedule: str | None = None,
        balance: str = "dynamic", progress: bool = False, checkpoint: str | Path | None = None,
        checkpoint_every: float = 600.0, stop_after: float | None = None, inline: bool = True,
        plan_cache: bool = True, reports: dict[str, str | None] | None = None) -> dict:
    """Execute a config on all ranks; returns ``{"predicted", "measured", "run"}`` on every rank
    (``run["memory_limit"]``: the configured bytes per level, for :func:`chainexec.report.run_report`).

    ``checkpoint``: a folder where resumable loops and finished nests save the run's progress at
    most every ``checkpoint_every`` seconds and from which a later run of the same plan resumes
    (:mod:`chainexec.runtime.checkpoint`); it is emptied when the run completes. ``stop_after``:
    stop at the first checkpoint after that many seconds, raising :class:`Stopped` on every rank
    (a batch job's way to end before its time limit and go on in the next one). ``inline``: as
    in :func:`plan`. ``plan_cache``: read the plan from :mod:`chainexec.plancache` where this
    config, machine, options and source were planned before (``run["plan_cached"]``), and keep
    a new one there. ``reports``: files the caller writes after the run, by the option that names
    them (``{"--report-json": path}``), checked with the run's own paths before anything runs.

    Rank 0 checks every path (:func:`chainexec.safepaths.check_run`) before it removes anything:
    then the older outputs of this config (a run that fails later must not leave them looking
    like its result), then the plan, the inputs and the checkpoint, and only then makes its
    folders, removing the older outputs' parts folders first unless a checkpoint resumes (its
    shards lie there).

    ``run["phases"]``: this rank's seconds spent planning (rank 0 loads, plans and checks the
    inputs; the others wait), starting the backend (CuPy's import and the device's context), in
    the executor (slowest rank) and in all of this call; the rest of a process's wall time is
    the interpreter's start and imports."""
    comm = world()
    started = time.perf_counter()
    text = error = defect = kept = cached = None
    if comm.rank == 0:
        try:
            if stop_after is not None and checkpoint is None:
                raise ChainexecError("--stop-after needs --checkpoint (where the run goes on from)")
            if checkpoint is not None and balance != "dynamic":
                raise ChainexecError("checkpoints need --balance dynamic")
            text = spec_mod.read(config)  # read once: the plan cache's key is of the text planned
            s = spec_mod.loads(text, str(config))
            paths = safepaths.check_run(s, checkpoint, reports)
            store.remove_outputs(paths.outputs)
            p, text, cached = _planned(s, text, load_machine(machine), schedule, comm.size, inline, plan_cache)
            store.check_inputs(p)
            if checkpoint is not None:
                ck = Checkpoint.open(checkpoint, p, text, comm.size, checkpoint_every, stop_after)
                kept = (ck.digest, ck.saved)
                if not (any(isinstance(node, Loop) and node.resume for nest in p.nests for node in nest.body)
                        or any(nest.checkpoint_after for nest in p.nests[:-1])):
                    print(f"chainexec: note: no resumable loop or nest end in this plan (see `chainexec plan`); "
                          f"{checkpoint} will hold nothing until the run's end", file=sys.stderr)
            store.make_folders(paths.outputs, paths.scratch, fresh=kept is None or kept[1] is None)
        except ChainexecError as err:
            error = str(err)
        except Exception as err:  # a defect: the other ranks must not wait for the plan for ever
            defect, error = err, f"rank 0 failed while planning ({type(err).__name__}: {err})"
    text, error, kept, cached, failed = comm.bcast((text, error, kept, cached, defect is not None), root=0)
    if defect is not None:
        raise defect
    if failed:
        raise RankFailed(error)
    if error is not None:
        raise ChainexecError(error)
    p = Plan.from_json(text)
    planned = time.perf_counter()
    uselog.set_job(uselog.job_of(config))  # what a warm-up of this config's next run replays
    chosen = select(backend, comm)
    ready = time.perf_counter()
    ck = None if checkpoint is None else Checkpoint(checkpoint, *kept, every=checkpoint_every, stop_after=stop_after)
    executor = Executor(p, comm, chosen, balance, progress, ck)
    try:
        try:
            with np.errstate(all="ignore"):  # values that are not finite are counted at the output (Store)
                measured = executor.run()
            chosen.settle_locks()  # the unlocks of host memory the run locked (begun beside its end)
            uselog.flush()  # the first uses of this run, for the next run's warm-up
        except ChainexecError as err:
            if err.path is not None:
                raise
            raise ChainexecError(str(err), str(config), collective=err.collective) from None
    except Stopped:
        raise
    except Exception as err:
        # A failure on one rank would leave the others waiting in a collective for ever: report it
        # and end the whole job (no output has been renamed into place, so nothing looks complete).
        if comm.size == 1 or getattr(err, "collective", False):
            raise
        if isinstance(err, ChainexecError):
            print(f"chainexec: rank {comm.rank}: {err}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
            sys.stderr.flush()
        code = 2 if isinstance(err, ChainexecError) else 1
        comm.Abort(code)
        raise SystemExit(code) from None  # Abort may return before the launcher ends this process
    if ck is not None:  # the outputs are complete: the progress saved is no longer needed
        comm.Barrier()
        if comm.rank == 0:
            ck.clear()
    phases = {"plan": planned - started, "backend": ready - planned,
              "executor": measured["total_seconds"], "run": time.perf_counter() - started}
    return {"predicted": p.predicted, "measured": measured,
            "run": {"config": str(config), "ranks": comm.size, "hosts": executor.hosts, "rank": comm.rank, "backend": chosen.name,
                    "balance": balance, "plan_cached": cached, "resumed_tiles": executor.resumed,
                    "checkpoints": executor.checkpoints,
                    "per_rank": executor.rank_times(measured["total_seconds"]),
                    "statement_seconds": executor.statement_seconds(),
                    "memory_limit": p.memory_limit, "phases": phases}}


def _make_plan(s, machine: Machine, schedule: str | None, ranks: int, inline: bool) -> Plan:
    """:func:`chainexec.planner.build.make_plan`, imported on first use: a run whose plan is in
    the plan cache never loads the planner's search (networkx among it: 0.27 s of imports on the
    2-core VM)."""
    from chainexec.planner.build import make_plan

    return make_plan(s, machine, schedule, ranks, inline)


def _planned(s, text: str, machine: Machine, schedule: str | None, ranks: int, inline: bool,
             use_cache: bool) -> tuple[Plan, str, bool]:
    """The plan of spec ``s`` (parsed from the config ``text``), its JSON, and whether it came
    from the plan cache (:mod:`chainexec.plancache`; only where ``use_cache``, which also keeps a
    new one). A cached plan that does not match ``s`` (:func:`chainexec.plancache.fits`) is made
    again."""
    digest = plancache.key(s.path, text, machine, schedule, ranks, inline) if use_cache else None
    found = None if digest is None else plancache.load(digest)
    if found is not None and plancache.fits(found[0], s):
        return *found, True
    p = _make_plan(s, machine, schedule, ranks, inline)
    made = p.to_json()
    if digest is not None:
        plancache.store(digest, made)
    return p, made, False


def verify(config: str | Path, samples: int = 300, limit: int = 2 << 30) -> list[Check]:
    """Check a config's outputs independently (NumPy einsum or sampled explicit sums)."""
    return verify_spec(spec_mod.load(config), samples=samples, limit=limit)
