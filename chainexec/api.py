"""Everything the CLI does, callable from Python: plan, run, generate, verify.

``run`` is collective: every MPI rank calls it. Rank 0 loads the config, plans, and checks inputs
and outputs; any problem is broadcast so that all ranks raise the same :class:`ChainexecError`
before anything is written.

Memory limits a config leaves out are detected on the machine (:mod:`chainexec.detect`; ``run``
gathers every rank's figures on rank 0), and the rates come from a machine file or this machine's
calibration (:mod:`chainexec.machinecache`); a plan records where each came from (``Plan.machine``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import traceback
from functools import lru_cache
from pathlib import Path

import numpy as np

from chainexec import calibrate, detect, machinecache, plancache, report, safepaths, stopsignals
from chainexec import spec as spec_mod
from chainexec.detect import Limit
from chainexec.errors import ChainexecError, RankFailed, of_machine, say
from chainexec.planner.machine import Machine
from chainexec.planner.cost import locked_inputs, predict
from chainexec.planner.plan import Loop, Plan
from chainexec.runtime import hostcopy, store, uselog
from chainexec.runtime.checkpoint import EVERY, Checkpoint, Stopped, check_intervals, saved_planning
from chainexec.runtime.comm import SIMULATE_HOSTS, abort, barrier, world
from chainexec.runtime.device import select
from chainexec.runtime.watchdog import Watchdog, check_timeout
from chainexec.verify import Check, verify as verify_spec


def plan(config: str | Path, machine: str | None = None, schedule: str | None = None, ranks: int = 1,
         inline: bool = True, plan_cache: bool = False, backend: str = "auto",
         reports: dict[str, str | None] | None = None) -> Plan:
    """Load and plan a config (pure apart from reading files and the machine's figures);
    ``schedule`` forces a named alternative, ``ranks`` spreads parallel loops over that many ranks,
    ``inline`` False keeps point-wise intermediates in buffers (see
    :func:`chainexec.planner.build.make_plan`). ``plan_cache``: read the plan from
    :mod:`chainexec.plancache` where :func:`run` would, and keep a new one there, so that a run of
    the same config, machine and options (``ranks``: the run's rank count) from the same folder
    does not plan again.

    Memory limits the config leaves out are detected as for ``ranks`` ranks on this host with
    ``backend`` (:func:`chainexec.detect.local`). The rates come from the machine file
    ``machine``, else as :mod:`chainexec.machinecache` says: this machine's calibration, made first
    where there is none (a quick one on ``ranks`` ranks, at most one per CPU). ``plan.machine``
    says where each limit and rate came from. ``reports``: files the caller writes from the plan,
    by the option that names them (``--plot``), refused first where they would write over the
    config, an input or an output (:func:`chainexec.safepaths.check_reports`)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ChainexecError(f"ranks must be a whole number, at least 1, not {ranks!r}")
    text = spec_mod.read(config)
    s = spec_mod.loads(text, str(config))
    _check_reports(safepaths.check_reports(s, reports or {}, machinecache.named_file(machine)))
    rates = machinecache.named(machine)
    figures = detect.local(backend, ranks) if _missing(s) else None
    limits = _limits(s, figures)
    if rates is None:
        rates, ident = _cache_lookup(figures, backend)
        if rates is None:
            calibrate.writable(ident)
            with machinecache.held(ident):
                rates = machinecache.cached(ident)  # made by another process while this one waited
                if rates is None:
                    machinecache.announce(ident)
                    calibrate.first_use(ident, backend, min(ranks, len(os.sched_getaffinity(0))))
                    rates = _calibrated(ident)
    p = _planned(s, text, limits, rates[0], schedule, ranks, inline, plan_cache)[0]
    _price_cached(p, rates[0], ranks)
    p.machine = _record(limits, rates[1])
    return p


def _check_reports(paths: safepaths.RunPaths) -> None:
    """Each report file of ``paths`` can be written, and matplotlib is there where one is a
    picture (``--plot``): found before the plan or run, not after it."""
    for path, option in paths.reports.items():
        store.check_writable([path], f"{option} file")
    if "--plot" in paths.reports.values():
        report.pyplot()


def _price_cached(p: Plan, machine: Machine, ranks: int) -> bool:
    """Price ``p`` again where the page cache holds some of its mapped inputs' bytes
    (:func:`chainexec.runtime.store.cached_inputs`): a run's loads of those map them and move
    nothing, so a job run again, or run right after its inputs were written, takes less than
    the same plan with every byte on the disk; and a pinned plan's gets of mapped inputs' rows go
    through staging buffers at their own rate (:meth:`Machine.transfer_seconds`), or by DMA from
    the mapping locked where it lies where that pays (:func:`chainexec.planner.cost.locked_inputs`,
    :attr:`Plan.locked`). Whether it did."""
    shares = store.cached_inputs(p)
    if not (any(shares.values()) or p.pinned and shares):
        return False
    p.locked = locked_inputs(p, machine, ranks, shares)
    p.predicted = predict(p, machine, ranks, shares)
    return True


def generate(config: str | Path, missing: bool = False) -> list[str]:
    """Write the seeded random inputs of a config to its HDF5 files; returns ``file:dataset`` names.
    Every file is checked (:func:`chainexec.safepaths.check_generate`) and every input's seed
    found before any file is written; each file is written anew and renamed into place.
    ``missing``: only where none of the input files exists (a batch job's first run); where all
    do, nothing is written (``[]``: ``run`` checks them), and where some do, a
    :class:`ChainexecError` names the missing ones: generating would write over the others,
    which may be a user's real inputs."""
    s = spec_mod.load(config)
    files = safepaths.check_generate(s)
    absent = [str(f) for f in files if not f.exists()]
    if missing and len(absent) < len(files):
        if not absent:
            return []
        raise ChainexecError(f"some of the config's input files exist and {', '.join(absent)} does not; generating "
                             "would write over the others: generate without --missing, or supply the missing ones",
                             str(s.path))
    # The plan only lists the inputs: limits the config leaves out need no detecting.
    limits = {level: getattr(s.machine, f"{level}_memory") or spec_mod.MAX_SIZE for level in ("global", "device")}
    return store.write_random_inputs(_make_plan(_within(s, limits), Machine(), None, 1, True))


def run(config: str | Path, backend: str = "auto", machine: str | None = None, schedule: str | None = None,
        balance: str = "dynamic", progress: bool = False, checkpoint: str | Path | None = None,
        checkpoint_every: float | None = None, stop_after: float | None = None, inline: bool = True,
        plan_cache: bool = True, reports: dict[str, str | None] | None = None,
        stall_timeout: float | None = None) -> dict:
    """Execute a config on all ranks; returns ``{"predicted", "measured", "run"}`` on every rank
    (``run["memory_limit"]``: the bytes per level planned for, for
    :func:`chainexec.report.run_report`; ``run["machine"]``: where each limit and rate came from,
    as ``Plan.machine``).

    ``checkpoint``: a folder where resumable loops and finished nests save the run's progress at
    most every ``checkpoint_every`` seconds (None: :data:`~chainexec.runtime.checkpoint.EVERY`)
    and from which a later run of the same plan resumes (:mod:`chainexec.runtime.checkpoint`);
    it is emptied when the run completes. An interval without a checkpoint is refused, as is
    ``stop_after``: it would checkpoint nothing. ``stop_after``:
    stop at the first checkpoint after that many seconds, raising :class:`Stopped` on every rank
    (a batch job's way to end before its time limit and go on in the next one). ``inline``: as
    in :func:`plan`. ``plan_cache``: read the plan from :mod:`chainexec.plancache` where this
    config, limits, machine, options and source were planned before (``run["plan_cached"]``),
    and keep a new one there. ``reports``: files the caller writes after the run, by the option
    that names them (``{"--report-json": path}``), checked with the run's own paths before
    anything runs. ``stall_timeout``: seconds after which a rank that has finished no statement
    ends every rank with status :data:`~chainexec.runtime.watchdog.STALLED`
    (:mod:`chainexec.runtime.watchdog`; None: never).

    Rank 0 checks every path (:func:`chainexec.safepaths.check_run`) and that each output and
    report file can be written, then the machine file, the plan, the inputs and the checkpoint;
    every rank starts its backend; only then does rank 0 remove the older outputs of this config
    and the older report files (a run refused before then leaves them as they were; one that
    fails or stops later must not leave them looking like its result) and make its folders,
    moving the older outputs' parts folders aside first, removed while the run goes on, unless a
    checkpoint resumes (its shards lie there). Where the config leaves a memory limit out, every
    rank reads its machine's figures and rank 0 derives the limits
    (:func:`chainexec.detect.gather`, :func:`chainexec.detect.limits`); rank 0 notes ranks that
    Open MPI bound to one core (:func:`chainexec.runtime.hostcopy.bound_narrowly`); where no
    machine file names the rates and this machine has no calibration in the cache, all ranks
    make a quick one together first (:func:`chainexec.calibrate.in_process`; rank 0 says so on
    stderr).

    ``run["phases"]``: this rank's seconds spent planning (rank 0 loads, detects, plans and
    checks the inputs; the others wait), calibrating (only where a calibration was made),
    starting the backend (CuPy's import and the device's context), in the executor (slowest rank)
    — of which, on a backend that compiles and tunes, ``compile`` and ``tune`` seconds
    (:meth:`~chainexec.runtime.device.Backend.startup_seconds`: what a run with warm caches does
    not pay) — and in all of this call; the rest of a process's wall time is the interpreter's
    start and imports.

    A run that fails in its executor on every rank alike (or on its only one) frees its
    windows (:meth:`~chainexec.runtime.executor.Executor.release`) and, given no checkpoint,
    removes its shards' folders that nothing can use (:func:`_discard`); one that a
    rank's own failure aborts, or that a signal ends (:mod:`chainexec.stopsignals`), leaves
    them as a killed one would, for its next run to replace.

    The folders this run locks (:meth:`chainexec.safepaths.RunPaths.lock`) are let go when it
    ends, however it ends: a process that runs again, or leaves a later run to another
    process, holds none of them."""
    ours: dict = {}  # rank 0's state from one step to the next
    try:
        return _run(ours, config, backend, machine, schedule, balance, progress, checkpoint, checkpoint_every,
                    stop_after, inline, plan_cache, reports, stall_timeout)
    finally:
        if "watch" in ours:
            ours["watch"].stop()
        if "paths" in ours:
            ours["paths"].unlock()


def _run(ours: dict, config, backend, machine, schedule, balance, progress, checkpoint, checkpoint_every, stop_after,
         inline, plan_cache, reports, stall_timeout) -> dict:
    """:func:`run`, with rank 0's state from one step to the next in ``ours``."""
    # imported here: the global arrays start MPI as they are imported, which plan and verify never need
    from chainexec.runtime.buffers import maps_inputs
    from chainexec.runtime.executor import Executor

    comm = world()
    started = time.perf_counter()
    stopsignals.forget_landed()  # a signal names only this run's outputs as completed
    _agreed(comm, {"the config": str(config), "--backend": backend, "--machine": machine, "--schedule": schedule,
                   "--balance": balance, "--checkpoint": None if checkpoint is None else str(checkpoint),
                   "--checkpoint-every": checkpoint_every, "--stop-after": stop_after, "--no-inline": not inline,
                   "--no-plan-cache": not plan_cache, "--stall-timeout": stall_timeout,
                   f"${SIMULATE_HOSTS}": os.environ.get(SIMULATE_HOSTS)})
    # the executor's loads map inputs' pages: priced by what the page cache holds
    maps = _on_each(comm, lambda: maps_inputs(comm))
    every = EVERY if checkpoint_every is None else checkpoint_every

    def read() -> bool:
        for option, value in (("--stop-after", stop_after), ("--checkpoint-every", checkpoint_every)):
            if value is not None and checkpoint is None:
                raise ChainexecError(f"{option} needs --checkpoint (where the run goes on from)")
        if checkpoint is not None and balance != "dynamic":
            raise ChainexecError("checkpoints need --balance dynamic")
        if checkpoint is not None:
            check_intervals(every, stop_after)
        check_timeout(stall_timeout)
        ours["text"] = spec_mod.read(config)  # read once: the plan cache's key is of the text planned
        ours["spec"] = s = spec_mod.loads(ours["text"], str(config))
        ours["paths"] = safepaths.check_run(s, checkpoint, reports, machinecache.named_file(machine))
        ours["paths"].lock()
        store.check_writable(ours["paths"].outputs)
        _check_reports(ours["paths"])
        ours["rates"] = machinecache.named(machine)
        return bool(_missing(s))

    figures = detect.gather(comm, backend) if on_rank0(comm, read) else None

    def limits_and_rates() -> tuple[Path, dict] | None:
        """The calibration file to make and the identity it is for, where one must be made first
        (held by rank 0 until it is made, :func:`chainexec.machinecache.held`)."""
        ours["limits"] = _limits(ours["spec"], figures)
        if checkpoint is not None:
            _as_checkpointed(ours, checkpoint, comm.size)
        if ours["rates"] is None:
            ours["rates"], ident = _cache_lookup(figures, backend)
            if ours["rates"] is None:
                where = calibrate.writable(ident)
                ours["held"] = held = contextlib.ExitStack()
                held.enter_context(machinecache.held(ident))
                ours["rates"] = machinecache.cached(ident)  # made by another process while this one waited
                if ours["rates"] is None:
                    machinecache.announce(ident)
                    return where, ident
                ours.pop("held").close()
        return None

    bound = sum(comm.gather(hostcopy.bound_narrowly(), root=0) or [])
    if bound:
        say(f"chainexec: note: {hostcopy.narrow_note(bound, comm.size)}")
    calibration = on_rank0(comm, limits_and_rates)
    calibrating = time.perf_counter()
    if calibration is not None:
        try:
            calibrate.in_process(comm, calibration[0], backend, calibration[1])
        except Exception as err:
            _end_all(comm, err)
        finally:
            if "held" in ours:
                ours.pop("held").close()
    calibrated = time.perf_counter()

    def prepare() -> tuple:
        if calibration is not None:
            ours["rates"] = _calibrated(calibration[1])
        s, limits, (rates, record) = ours["spec"], ours["limits"], ours["rates"]
        p, text, cached = _planned(s, ours["text"], limits, rates, schedule, comm.size, inline, plan_cache)
        _check_fits_here(p, ours.get("here", {}), limits)
        store.check_inputs(p)
        store.check_space(p)
        if maps and _price_cached(p, rates, comm.size):
            text = p.to_json()
        kept = None
        if checkpoint is not None:
            ck = Checkpoint.open(checkpoint, p, comm.size, every, stop_after)
            kept = (ck.digest, ck.saved)
            if not (any(isinstance(node, Loop) and node.resume for nest in p.nests for node in nest.body)
                    or any(nest.checkpoint_after for nest in p.nests[:-1])):
                say(f"chainexec: note: no resumable loop or nest end in this plan (see `chainexec plan`); "
                    f"{checkpoint} will hold nothing until the run's end")
        return text, kept, cached, _record(limits, record)

    text, kept, cached, record = on_rank0(comm, prepare)
    p = _on_each(comm, lambda: Plan.from_json(text))
    p.machine = record
    planned = time.perf_counter()
    # every rank watches its progress from here (the plan made: rank 0's planning, which the
    # others wait for, may take longer than a stall timeout) to the executor's last nest
    ours["watch"] = watch = Watchdog(stall_timeout, comm)
    watch.start()
    uselog.set_job(uselog.job_of(config))  # what a warm-up of this config's next run replays
    chosen = _selected(comm, backend)
    watch.beat("the backend's start")

    def land() -> None:
        """The older outputs and report files removed and the run's folders made: every check
        has passed."""
        paths = ours["paths"]
        # a report as named, not as resolved: where it is a link, the write replaces the link
        store.remove_outputs([*paths.outputs, *(os.path.abspath(f) for f in (reports or {}).values() if f)])
        store.make_folders(paths.outputs, paths.scratch, fresh=kept is None or kept[1] is None)
        if checkpoint is not None:
            for folder in [paths.scratch, *(store.parts_dir(Path(f)) for f in paths.outputs)]:
                safepaths.note_checkpoint(folder, paths.checkpoint)
        ours["landed"] = True  # the folders are this run's, locked by it

    on_rank0(comm, land)
    watch.beat("the outputs' folders made")
    ready = time.perf_counter()
    ck = None if checkpoint is None else Checkpoint(checkpoint, *kept, every=every, stop_after=stop_after)
    executor = _on_each(comm, lambda: Executor(p, comm, chosen, balance, progress, ck, watch))
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
    except Exception as failure:
        watch.stop()  # what follows cleans up, and the failure's own line must not give way to a stall's
        err = of_machine(failure) or failure  # a full disk or too little memory: one line, not a traceback
        if comm.size == 1 or getattr(err, "collective", False):
            with contextlib.suppress(Exception):  # the run's own error is the one reported
                executor.release()
            if ck is None:
                _discard(comm, ours, executor, p.scratch)
        _end_all(comm, err)
    if ck is not None:  # the outputs are complete: the progress saved is no longer needed
        barrier(comm)
        if comm.rank == 0:
            ck.clear()
    phases = {"plan": planned - started - (calibrated - calibrating),
              **({"calibrate": calibrated - calibrating} if calibration is not None else {}),
              "backend": ready - planned, "executor": measured["total_seconds"], **chosen.startup_seconds(),
              "run": time.perf_counter() - started}
    return {"predicted": p.predicted, "measured": measured,
            "run": {"config": str(config), "ranks": comm.size, "hosts": executor.hosts, "rank": comm.rank, "backend": chosen.name,
                    "balance": balance, "plan_cached": cached, "resumed_tiles": executor.resumed,
                    "checkpoints": executor.checkpoints,
                    "per_rank": executor.rank_times(measured["total_seconds"]),
                    "memory_limit": p.memory_limit, "machine": p.machine, "phases": phases}}


def _discard(comm, ours: dict, executor, scratch: str) -> None:
    """After a failure that every rank raised alike (or the only rank), in a run given no
    checkpoint: each rank closes the files it reads and writes, and once all have, rank 0 removes the
    folders of the run's shards that nothing can use (:func:`chainexec.runtime.store.discard_folders`;
    they hold as many bytes as its outputs and intermediates). A removal that fails leaves
    them for the next run; the run's own error is what is reported."""
    executor.store.close()
    barrier(comm)
    if comm.rank == 0 and ours.get("landed"):
        with contextlib.suppress(OSError):
            store.discard_folders(ours["paths"].outputs, Path(scratch))


def on_rank0(comm, step):
    """``step()`` on rank 0, its result on every rank. What it raises there is raised on every
    rank: a :class:`ChainexecError` as one (the machine's refusals too, :func:`of_machine`), a
    defect as itself on rank 0 and as :class:`RankFailed` on the others (which must not wait for
    rank 0 for ever)."""
    result = error = defect = None
    if comm.rank == 0:
        try:
            result = step()
        except ChainexecError as err:
            error = str(err)
        except Exception as err:
            refused = of_machine(err)
            if refused is not None:
                error = str(refused)
            else:
                defect, error = err, f"rank 0 failed while planning ({type(err).__name__}: {err})"
    barrier(comm)  # the others wait for rank 0 here without keeping a core busy
    result, error, failed = comm.bcast((result, error, defect is not None), root=0)
    if defect is not None:
        raise defect
    if failed:
        raise RankFailed(error)
    if error is not None:
        raise ChainexecError(error)
    return result


def _selected(comm, backend: str):
    """Every rank's backend (:func:`~chainexec.runtime.device.select`), once every rank has one:
    a rank that cannot start its backend (no GPU on its node) is an error raised on every rank
    alike, naming that rank, before rank 0 removes any older output; a defect there ends the
    whole job (:func:`_end_all`)."""
    chosen = error = None
    try:
        chosen = select(backend, comm)
    except ChainexecError as err:
        error = f"rank {comm.rank}: {err}" if comm.size > 1 else str(err)
    except Exception as err:
        _end_all(comm, err)
    failed = next(filter(None, comm.allgather(error)), None)
    if failed is not None:
        raise ChainexecError(failed, collective=True)
    return chosen


def _agreed(comm, started: dict) -> None:
    """Refuse, on every rank alike (a collective :class:`ChainexecError`), a run whose ranks were
    started differently: ``started`` is what this rank was given (options, config path, the
    simulated hosts), gathered with this chainexec's sources before anything else the ranks do
    together. Rank 0 decides the config's text alone, but each rank runs its own options and
    code: where they differ the ranks met different collectives and waited for each other until
    the job's time limit."""
    if comm.size == 1:
        return
    found = comm.allgather({**started, "chainexec": _package_digest()})
    for rank, theirs in enumerate(found):
        for what, value in theirs.items():
            if value != found[0][what]:
                shown = "other sources" if what == "chainexec" else repr(value)
                raise ChainexecError(f"rank {rank} was started with {what} {shown} where rank 0 has "
                                     f"{'its own' if what == 'chainexec' else repr(found[0][what])}: every rank of a "
                                     "run takes the same command, chainexec and environment", collective=True)


@lru_cache(maxsize=1)
def _package_digest() -> str:
    """SHA-256 of this chainexec's Python sources (:func:`chainexec.plancache.tree_digest`)."""
    return plancache.tree_digest(Path(__file__).resolve().parent)


def _on_each(comm, make):
    """``make()`` on this rank, where the other ranks may go on to a collective: an error on this
    rank alone ends every rank (:func:`_end_all`) instead of leaving them waiting for it."""
    try:
        return make()
    except Exception as err:
        _end_all(comm, of_machine(err) or err)


def _end_all(comm, err: Exception):
    """End every rank on ``err``, raised on this rank while the others may wait for it in a
    collective for ever: report it and abort the whole job (no output has been renamed into
    place, so nothing looks complete). A run of one rank, or an error every rank raises alike
    (``collective``), raises it instead."""
    if comm.size == 1 or getattr(err, "collective", False):
        raise err
    if isinstance(err, ChainexecError):
        say(f"chainexec: rank {comm.rank}: {err}")
    else:
        traceback.print_exc()
    abort(comm, 2 if isinstance(err, ChainexecError) else 1)


def _missing(s) -> tuple[str, ...]:
    """The levels (``global``, ``device``) whose memory limit the config ``s`` leaves out."""
    return tuple(level for level in ("global", "device") if getattr(s.machine, f"{level}_memory") is None)


def _limits(s, figures: list | None) -> dict[str, Limit]:
    """Each level's memory limit: the config's, or detected from the ranks' ``figures``
    (:func:`chainexec.detect.limits`; a rank's error, sent in their place, is raised here)."""
    found = {}
    for level in ("global", "device"):
        given = getattr(s.machine, f"{level}_memory")
        if given is not None:
            line = s.lines.get(("machine", f"{level}_memory"))
            found[level] = Limit(given, "config", s.path if line is None else f"{s.path}:{line}")
    if len(found) < 2:
        failed = [f for f in figures if isinstance(f, str)]
        if failed:
            raise ChainexecError(failed[0])
        found |= detect.limits(figures, _missing(s))
    return {level: found[level] for level in ("global", "device")}


def _as_checkpointed(ours: dict, folder, ranks: int) -> None:
    """A resumed run's limits and rates (in ``ours``): those its checkpoint's plan was made with
    (:func:`chainexec.runtime.checkpoint.saved_planning`), so that it plans the same work where
    the memory detected on this node, or this node's calibration, differ from the one that
    made it (a job submitted again runs on other nodes). A level whose limit the config sets
    keeps it (another config is another plan, which the checkpoint refuses); a detected one takes
    the saved limit, the figure detected here kept in ``ours["here"]`` for :func:`_check_fits_here`.
    A checkpoint of another rank count is left to :meth:`Checkpoint.open`, which names it."""
    saved = saved_planning(folder, ranks)
    if saved is None:
        return
    sizes, rates, path = saved
    machine, given = Machine.parse(rates, str(path))
    ours["here"] = {level: limit for level, limit in ours["limits"].items() if limit.origin == "detected"}
    ours["limits"] = {level: Limit(sizes[level], "checkpoint", str(path)) if level in ours["here"] else limit
                      for level, limit in ours["limits"].items()}
    ours["rates"] = machine, machinecache.record(machine, given, "checkpoint", str(path))


def _check_fits_here(p: Plan, here: dict[str, Limit], limits: dict[str, Limit]) -> None:
    """A plan made with a checkpoint's memory limits (:func:`_as_checkpointed`) that needs more
    memory of a level than this node has (``here``, detected) is a :class:`ChainexecError`
    naming both: the run would fail for memory part way."""
    for level, limit in here.items():
        peak = p.predicted["memory_peak"][level]
        if peak > limit.bytes:
            raise ChainexecError(
                f"the checkpoint's plan needs {spec_mod.format_size(peak)} of {level} memory per rank (planned with "
                f"{spec_mod.format_size(limits[level].bytes)}); this node has {spec_mod.format_size(limit.bytes)} "
                f"({limit.detail}): free memory here, or remove the checkpoint folder to start again",
                limits[level].detail)


def _within(s, limits: dict[str, int]):
    """The spec ``s`` with these memory limits (bytes per level)."""
    return dataclasses.replace(s, machine=spec_mod.Machine(limits["global"], limits["device"]))


def _record(limits: dict[str, Limit], rates: dict[str, dict]) -> dict[str, dict]:
    """Each memory limit and rate planned with, by name (``global_memory``, ``device_memory``,
    then the machine model's fields): ``{"value", "from", "detail"}``."""
    return {f"{level}_memory": {"value": limit.bytes, "from": limit.origin, "detail": limit.detail}
            for level, limit in limits.items()} | rates


def _cache_lookup(figures: list | None, backend: str) -> tuple[tuple[Machine, dict] | None, dict]:
    """This machine's calibration in the cache with its record (None where there is none), and
    the identity it is kept for: with the GPU of rank 0 (``figures[0]``, else the one ``backend``
    takes at local rank 0, which rank 0 always is)."""
    ident = machinecache.identity(figures[0].gpu if figures else detect.gpu_name(backend))
    return machinecache.cached(ident), ident


def _calibrated(ident: dict) -> tuple[Machine, dict]:
    """The calibration of ``ident`` just made, with its record (:func:`chainexec.machinecache.cached`)."""
    found = machinecache.cached(ident)
    if found is None:
        raise ChainexecError("the calibration just made cannot be read back", str(machinecache.path(ident)))
    return found


def _make_plan(s, machine: Machine, schedule: str | None, ranks: int, inline: bool) -> Plan:
    """:func:`chainexec.planner.build.make_plan`, imported on first use: a run whose plan is in
    the plan cache never loads the planner's search, whose imports are a large part of a short
    run's start."""
    from chainexec.planner.build import make_plan

    return make_plan(s, machine, schedule, ranks, inline)


def _planned(s, text: str, limits: dict[str, Limit], machine: Machine, schedule: str | None, ranks: int,
             inline: bool, use_cache: bool) -> tuple[Plan, str, bool]:
    """The plan of spec ``s`` (parsed from the config ``text``) within ``limits``, its JSON, and
    whether it came from the plan cache (:mod:`chainexec.plancache`; only where ``use_cache``,
    which also keeps a new one). A cached plan that does not match ``s``
    (:func:`chainexec.plancache.fits`) is made again. A planning error where a limit was
    detected says so."""
    sizes = {level: limit.bytes for level, limit in limits.items()}
    digest = plancache.key(s.path, text, sizes, machine, schedule, ranks, inline) if use_cache else None
    found = None if digest is None else plancache.load(digest)
    if found is not None and plancache.fits(found[0], s):
        return *found, True
    try:
        p = _make_plan(_within(s, sizes), machine, schedule, ranks, inline)
    except ChainexecError as err:
        detected = [f"{level} {spec_mod.format_size(limit.bytes)}" for level, limit in limits.items()
                    if limit.origin == "detected"]
        if not detected:
            raise
        raise ChainexecError(f"{err} (memory detected on this machine: {', '.join(detected)}; the config's "
                             "machine.global_memory and machine.device_memory set it)") from None
    made = p.to_json()
    if digest is not None:
        plancache.store(digest, made)
    return p, made, False


def verify(config: str | Path, samples: int = 300, limit: int | None = None) -> list[Check]:
    """Check a config's outputs independently: NumPy einsum over the whole chain where its
    tensors take at most ``limit`` bytes, else explicit sums at ``samples`` output elements of
    each output. ``limit`` None: a fifth of the host memory available to this process
    (:func:`chainexec.detect.host_memory`), since the check holds the chain's tensors about three
    times over (the values, their magnitudes, the output read and einsum's temporaries): the
    explicit sums expand every intermediate into products of inputs, and a scalar output such as
    a (T) energy then costs the whole chain once per product term, hours where einsum takes a
    minute."""
    if limit is None:
        limit = detect.host_memory()[0] // 5
    return verify_spec(spec_mod.load(config), samples=samples, limit=limit)
