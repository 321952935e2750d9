"""``chainexec`` command line: parse arguments, call :mod:`chainexec.api`, print.

User errors print one line and exit with status 2; a run whose measured movement differs from the
prediction exits with status 1 (that is a bug in chainexec); a run stopped at a checkpoint
(``--stop-after``) exits with status 3; a run a stalled rank held past ``--stall-timeout`` exits
with status 4 (:mod:`chainexec.runtime.watchdog`).
"""

from __future__ import annotations

if __name__ == "__main__":  # ``python -m chainexec.cli``: a signal from here on ends it as one later does
    import sys

    from chainexec import stopsignals

    stopsignals.starting(sys.argv[1:])

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

from chainexec import atomicfile, calibrate, server, stopsignals
from chainexec.chem import job
from chainexec.chem.job import MOLECULES
from chainexec.errors import ArgumentParser, ChainexecError, RankFailed, of_machine, say
from chainexec.runtime import comm, fdtable, warmup


NO_INLINE = "keep every point-wise intermediate in a device buffer of its own (no fused statements)"


DESCRIPTION = "Out-of-core chains of tensor contractions on one or many GPUs and nodes."


def _parse(argv) -> argparse.Namespace:
    """The command line's arguments; an option its subcommand does not know is refused by that
    subcommand's parser, so that the line names it and its help (``chainexec run -h``)."""
    ap = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = ap.parse_known_args(argv)
    if extra:
        before = argv[:argv.index(args.command)]  # options before the command are chainexec's own
        commands = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices
        (ap if any(e in before for e in extra) else commands[args.command]).error(
            f"unrecognized arguments: {' '.join(extra)}")
    return args


def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="chainexec", description=DESCRIPTION)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="dry run: print the loop nest and the predicted movement")
    p.add_argument("config")
    p.add_argument("--json", action="store_true", help="print the plan and prediction as JSON")
    p.add_argument("--machine", help="machine file (JSON) with bandwidths and flop rate (default: $CHAINEXEC_MACHINE, "
                   "else this machine's calibration in $CHAINEXEC_CACHE, made on first use)")
    p.add_argument("--backend", default="auto", choices=("auto", "numpy", "cupy"),
                   help="the backend whose device memory a config without machine.device_memory plans for")
    p.add_argument("--plot", metavar="FILE.png", help="draw the alternatives weighed (needs matplotlib)")
    p.add_argument("--schedule", help="use this alternative instead of the cheapest, e.g. 'unfused'")
    p.add_argument("--ranks", type=_ranks, default=1,
                   help=f"plan for this many MPI ranks, at most {MAX_RANKS:,} (run plans for its own)")
    p.add_argument("--no-inline", dest="inline", action="store_false", help=NO_INLINE)
    p.add_argument("--no-plan-cache", dest="plan_cache", action="store_false",
                   help="plan again and keep nothing (by default the plan is read from, or kept in, the plan "
                        "cache that `run` reads: plan ahead with --ranks N and the run of N ranks starts at once)")
    r = sub.add_parser("run", help="execute a config (under mpirun/mpiexec for several ranks)")
    r.add_argument("config")
    r.add_argument("--backend", default="auto", choices=("auto", "numpy", "cupy"))
    r.add_argument("--machine", help="machine file (JSON) with bandwidths and flop rate (default: as for plan)")
    r.add_argument("--schedule", help="use this alternative instead of the cheapest, e.g. 'unfused'")
    r.add_argument("--no-inline", dest="inline", action="store_false", help=NO_INLINE)
    r.add_argument("--no-plan-cache", dest="plan_cache", action="store_false",
                   help="plan again even where this config, machine and chainexec were planned before "
                        "(plans are kept in $CHAINEXEC_PLAN_CACHE, default ~/.cache/chainexec/plans)")
    r.add_argument("--quiet", action="store_true", help="no progress bar / progress lines on stderr")
    r.add_argument("--balance", default="dynamic", choices=("dynamic", "static"),
                   help="hand parallel tiles out through a shared counter (dynamic) or round-robin (static)")
    r.add_argument("--report-json", metavar="PATH", help="write {predicted, measured, run} as JSON")
    r.add_argument("--report", action="store_true",
                   help="print achieved vs the machine model's rate per level, wall vs bound, memory vs limits")
    r.add_argument("--plot", metavar="FILE.png", help="draw the --report comparison (needs matplotlib)")
    r.add_argument("--checkpoint", metavar="DIR",
                   help="save the progress of resumable loops and finished nests in DIR (on a file system every "
                        "rank sees) and resume from it; emptied when the run completes")
    r.add_argument("--checkpoint-every", type=float, metavar="SECONDS",
                   help="with --checkpoint: seconds at most between checkpoints (default 600)")
    r.add_argument("--stop-after", type=float, metavar="SECONDS",
                   help="stop at the first checkpoint after SECONDS and exit with status 3 (run again to resume)")
    r.add_argument("--stall-timeout", type=float, metavar="SECONDS",
                   help="end every rank with status 4 where one has finished no statement for SECONDS (a rank "
                        "stalled, or waiting for one that is), instead of waiting until the job's time limit; "
                        "longer than a healthy rank goes without finishing one, waits for the others' last "
                        "tiles included (default: never)")
    g = sub.add_parser("generate", help="write a config's seeded random inputs to HDF5")
    g.add_argument("config")
    g.add_argument("--missing", action="store_true",
                   help="only where none of the input files exists (nothing where all do; refused where some do)")
    v = sub.add_parser("verify", help="check a config's outputs against NumPy, independently of the runtime")
    v.add_argument("config")
    v.add_argument("--samples", type=int, default=300, help="output elements checked when too large for einsum")
    v.add_argument("--full-limit", type=int, help="bytes of the chain's tensors up to which the whole chain is "
                   "einsum'd (default: a fifth of the host memory available)")
    ch = sub.add_parser("chem", help="prepare a CCSD(T) job: PySCF inputs (HDF5) and the config that reads them")
    ch.add_argument("molecule", help=f"one of {', '.join(MOLECULES)}, or a PySCF atom string (Angstrom)")
    ch.add_argument("--basis", default="cc-pvdz")
    ch.add_argument("--charge", type=int, help="the molecule's charge (default 0): an ion, closed-shell like every "
                    "molecule the jobs take (an even number of electrons)")
    ch.add_argument("--frozen", type=int, help="frozen core orbitals, fewer than the occupied ones (default 0)")
    ch.add_argument("--out", required=True, help="folder for inputs.h5 and the job's config (ccsd_t.yaml or ao2mo.yaml)")
    ch.add_argument("--job", default="ccsd_t", choices=tuple(job.TEMPLATES),
                    help="ccsd_t: the (T) energy job; ao2mo: the AO->MO four-index transform of the molecule's integrals")
    ch.add_argument("--template", help="the config to copy (default: configs/ccsd_t.yaml or configs/ao2mo.yaml)")
    ch.add_argument("--synthetic", nargs=3, type=int, metavar=("NOCC", "NVIR", "SEED"),
                    help="seeded random inputs of any size that fits the disk and memory, instead of PySCF")
    ch.add_argument("--layout", choices=("s8", "s4", "dense", "computed"),
                    help="ao2mo: how the AO integrals are written and read (PySCF's aosym; default s8), or "
                         "'computed': not written, each tile computed by libcint where it is loaded")
    ch.add_argument("--scf-conv-tol", type=float, metavar="HARTREE",
                    help="RHF energy convergence threshold (default 1e-12; ao2mo 1e-10)")
    ch.add_argument("--scf-max-cycle", type=int, metavar="N", help="RHF iterations at most (default 50)")
    ch.add_argument("--ccsd-conv-tol", type=float, metavar="HARTREE",
                    help="CCSD energy convergence threshold; the amplitudes' to its square root (default 1e-12)")
    ch.add_argument("--ccsd-max-cycle", type=int, metavar="N", help="CCSD iterations at most (default 50)")
    ch.add_argument("--missing", action="store_true",
                    help="only where --out holds neither inputs.h5 nor the config (a batch job submitted again); "
                         "where it holds both, they are kept once found made for this molecule, basis and template")
    b = sub.add_parser("bench", help="GPU benchmarks: 'tccg' checks and times the generated kernels on the "
                       "48 TCCG contractions (options: chainexec bench tccg -h)")
    b.add_argument("suite", choices=("tccg",))
    b.add_argument("options", nargs=argparse.REMAINDER)
    c = sub.add_parser("calibrate", help="measure this machine's bandwidths and flop rate into a machine file")
    calibrate.add_arguments(c)
    s = sub.add_parser("serve", help="keep a process with everything a run loads, and run in it the `run` and "
                       "`plan` commands of this user on this host (see docs/serve.md)")
    s.add_argument("--idle", type=float, default=server.IDLE, metavar="SECONDS",
                   help=f"end after this many seconds without a run (default {server.IDLE:g})")
    s.add_argument("--stop", action="store_true", help="end the server that answers, once its run in progress ends")
    return ap


MAX_RANKS = 1 << 20
"""Ranks ``plan --ranks`` plans for at most: beyond any machine's GPUs, and a bound on the
planning's work and memory, which grow with the ranks."""


def _ranks(text: str) -> int:
    """``plan --ranks``: a count (:func:`_count`) of at most :data:`MAX_RANKS`."""
    value = _count(text)
    if value > MAX_RANKS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_RANKS:,}, not {text!r}")
    return value


def _count(text: str) -> int:
    """A command-line count: a whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number, at least 1, not {text!r}")
    return value


def _write_json(path: str, data: dict) -> None:
    try:
        atomicfile.write(Path(path), json.dumps(data, indent=1), atomicfile.USER_FILE)
    except OSError as err:
        raise ChainexecError(f"cannot write the report ({err.strerror or err})", path) from None


def main(argv=None, own: bool = False) -> int:
    """The command line; an interrupt (Ctrl-C, SIGINT from the launcher) ends the process at once
    with one line and status 130, leaving what a killed run leaves (no output renamed into place,
    the last checkpoint). In a process of its own (``own``: not a server's run of a client's
    command), every command but ``serve`` (which handles its signals itself) has SIGINT and SIGTERM
    watched by a thread (:mod:`chainexec.stopsignals`): they end it even while its main thread
    waits inside MPI or on the device."""
    args = _parse(argv)
    if args.command in ("run", "serve"):
        fdtable.raise_limit()  # every rank may open a virtual input's every source file
        fdtable.reserve()  # while the process has one thread (before the signals' watch): no RCU grace period
    if own and args.command != "serve":
        stopsignals.watch(speaks=stopsignals.speaks(args.command), run=args.command == "run")
    try:
        return _main(args)
    except BrokenPipeError:  # the reader of our output went away (`| head`): nothing left to say
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
        return 0
    except KeyboardInterrupt:
        number = stopsignals.stopping()  # SIGINT, or the signal a served run's client was stopped by
        if args.command != "run" or _rank() == 0:
            with contextlib.suppress(OSError):  # a reader that has gone (a served client's pipe)
                print(stopsignals.line(number, args.command == "run"), end="", file=sys.stderr, flush=True)
        # not through the interpreter's exit, which would wait for the run's threads
        os._exit(stopsignals.STATUS[number])


def _main(args) -> int:
    if args.command == "run":
        warmup.start(args.config, args.backend)
    # Imported after the GPU warm-up began, so that its CUDA context is made beside these imports
    # (the runtime, h5py, MPI's start) instead of before the run's first
    # statements; then CuPy is imported here and the warm-up goes on (warmup.proceed).
    try:
        from chainexec import api, report
        from chainexec.runtime.checkpoint import Stopped
    finally:
        warmup.proceed()

    try:
        if args.command == "plan":
            plan = api.plan(args.config, args.machine, args.schedule, args.ranks, args.inline, args.plan_cache,
                            args.backend, reports={"--plot": args.plot})
            if args.json:
                print(json.dumps(report.plan_json(plan), indent=1))
            else:
                print(report.loop_nest(plan))
                print()
                print(report.summary(plan))
                print()
                print(report.machine(plan.machine))
                print()
                print(report.alternatives(plan))
            if args.plot:
                report.plot_alternatives(plan, args.plot)
        elif args.command == "chem":
            options = {k: getattr(args, k) for k in job.OPTIONS if getattr(args, k) is not None}
            summary = job.prepare(args.molecule, args.out, basis=args.basis, job=args.job,
                                  template=args.template or job.TEMPLATES[args.job],
                                  synthetic=tuple(args.synthetic) if args.synthetic else None,
                                  missing=args.missing, **options)
            if summary.get("kept"):
                print(f"kept {summary['path']} and {summary['config']}: made for this job; nothing written")
            else:
                print(json.dumps({k: v for k, v in summary.items() if k not in ("path", "config")}))
                print(f"wrote {summary['path']} and {summary['config']}")
        elif args.command == "bench":
            from chainexec import bench

            return bench.main(args.options)
        elif args.command == "calibrate":
            options = {k: v for k, v in vars(args).items() if k != "command"}
            machine, written = calibrate.calibrate(**options)
            print(machine.to_json())
            print(f"wrote {written}")
        elif args.command == "serve":
            if args.stop:
                stopped = server.stop()
                print("no server answers" if stopped is None else
                      f"the server (pid {stopped[0]}) ends " + ("once its run ends" if stopped[1] else "now"))
            else:
                server.serve(idle=args.idle)
        elif args.command == "generate":
            written = api.generate(args.config, missing=args.missing)
            for name in written:
                print(f"wrote {name}")
            if args.missing and not written:
                print("the inputs exist: nothing written")
        elif args.command == "verify":
            checks = api.verify(args.config, samples=args.samples, limit=args.full_limit)
            for c in checks:
                status = "ok" if c.ok else "FAILED"
                print(f"{c.tensor}: {c.method} over {c.elements} elements, relative error "
                      f"{c.relative_error:.3e} (tolerance {c.tolerance:.0e}) {status}")
            return 0 if all(c.ok for c in checks) else 1
        else:
            try:
                result = api.run(args.config, backend=args.backend, machine=args.machine, schedule=args.schedule,
                                 balance=args.balance, progress=not args.quiet, checkpoint=args.checkpoint,
                                 checkpoint_every=args.checkpoint_every, stop_after=args.stop_after,
                                 inline=args.inline, plan_cache=args.plan_cache,
                                 reports={"--report-json": args.report_json, "--plot": args.plot},
                                 stall_timeout=args.stall_timeout)
            except Stopped as stop:
                if _rank() == 0:
                    say(f"chainexec: {stop}")
                return 3
            if result["run"]["rank"] == 0:
                print(report.comparison(result["predicted"], result["measured"]))
                print(report.ranks(result["run"]["per_rank"]))
                print(report.machine(result["run"]["machine"]))
                if args.report:
                    print()
                    print(report.run_report(result["predicted"], result["measured"], result["run"]["memory_limit"],
                                            result["run"]["phases"]))
                    print(report.statements(result["measured"]["by_statement"], result["predicted"]["by_statement"]))
                    if result["run"]["plan_cached"]:
                        print("plan read from the plan cache (--no-plan-cache plans again)")
                if args.report_json:
                    _write_json(args.report_json, {k: result[k] for k in ("predicted", "measured", "run")})
                if args.plot:
                    report.plot_run(result["predicted"], result["measured"], args.plot)
            if not report.matches(result["predicted"], result["measured"]):
                if result["run"]["rank"] == 0:
                    say("chainexec: measured movement, peaks, flops or streamed bytes differ from the prediction "
                        "(a bug)")
                return 1
    except ChainexecError as err:
        if args.command != "run" or _rank() == 0:
            say(f"chainexec: {err}")
        return 2
    except (OSError, MemoryError) as err:  # a full disk or too little memory, outside a run's steps
        if of_machine(err) is None:
            raise
        say(f"chainexec: {of_machine(err)}")
        return 2
    except RankFailed:
        return 1
    return 0


def command() -> NoReturn:
    """The ``chainexec`` program: :func:`main` in a process of its own, then
    :func:`chainexec.runtime.comm.end` with its status."""
    comm.end(main(own=True))


def _rank() -> int:
    from chainexec.runtime.comm import world

    return world().rank


if __name__ == "__main__":
    command()
