"""AO→MO four-index transform: chainexec beside PySCF's ``ao2mo.outcore.full`` on one host.

For each integral layout asked for (``s8``, ``s4``: integrals written by PySCF before the timed
run; ``computed``: none written, each tile computed by libcint where chainexec loads it),
``chainexec chem MOLECULE --job ao2mo --layout L`` prepares the inputs (not timed), then the
whole ``chainexec run`` process is timed (under ``mpiexec -n RANKS`` for several ranks). PySCF's
``ao2mo.outcore.full(mol, C, file, compact=True)`` — integrals computed on the fly, output in the
same compact s4 layout — is timed on the same host with the same threads. Both outputs are
compared element by element, in row blocks (every row, or a sample of rows spread over the whole
array with ``--sample-rows`` where the disk cannot hold both outputs at once), and the summary
records both times (chainexec's fastest of ``--repeat`` runs: the first compiles and tunes its
kernels), both sides' output bytes and chainexec's run reports. Every layout and PySCF use the
orbitals of the first layout's SCF (degenerate orbitals differ between SCF runs).

Usage (repository root, PySCF importable)::

    python3 benchmarks/ao2mo_pyscf.py OUT --molecule benzene --basis cc-pvtz --layouts s8 computed \\
        [--ranks 1] [--backend auto] [--launcher mpirun] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import h5py
import numpy as np


def run(cmd: list[str], env: dict) -> float:
    """Seconds of one command, which must succeed."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return seconds


def row_blocks(n: int, sample: int, block: int = 64) -> list[slice]:
    """The row blocks of an output of ``n`` rows to compare: every row (blocks of 2048) where
    ``sample`` is 0 or its blocks would cover half of them, else about ``sample`` rows in blocks
    of ``block`` spread evenly from the first row to the last (at least a block apart: none
    compared twice)."""
    count = max(2, -(-sample // block))
    if not sample or 2 * count * block >= n:
        return [slice(r, min(n, r + 2048)) for r in range(0, n, 2048)]
    starts = np.linspace(0, n - block, count).astype(int)
    return [slice(int(r), min(n, int(r) + block)) for r in starts]


def compare(ours, theirs: Path, blocks: list[slice], shape: tuple) -> dict:
    """Largest absolute difference and largest absolute value of two s4 outputs over the row
    ``blocks``; ``ours`` is chainexec's output file or its rows of those blocks, read before the
    file was removed (one array per block), ``shape`` its output's shape, which PySCF's must have."""
    with h5py.File(theirs) as g, (h5py.File(ours) if isinstance(ours, Path) else nullcontext()) as f:
        b = g["eri_mo"]
        if b.shape != tuple(shape):
            sys.exit(f"shapes differ: chainexec {tuple(shape)}, PySCF {b.shape}")
        worst = largest = 0.0
        for k, rows in enumerate(blocks):
            x, y = (f["B"][rows] if f is not None else ours[k]), b[rows]
            worst = max(worst, float(np.max(np.abs(x - y))))
            largest = max(largest, float(np.max(np.abs(y))))
    compared = sum(r.stop - r.start for r in blocks)
    return {"max_abs_difference": worst, "max_abs_value": largest, "elements": int(np.prod(shape)),
            "rows_compared": compared, "rows": shape[0]}


def say(*what) -> None:
    """A line of progress, at once (a run cut short keeps what it had printed)."""
    print(*what, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--molecule", default="benzene")
    ap.add_argument("--basis", default="cc-pvtz")
    ap.add_argument("--layouts", nargs="+", default=["s8", "computed"], choices=("s8", "s4", "dense", "computed"))
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--launcher", default="mpirun")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--keep", action="store_true",
                    help="keep each layout's folder OUT/work_LAYOUT (inputs.h5, and output.h5 where every row is compared), "
                         "e.g. for benchmarks/ao2mo_accuracy.py --ours")
    ap.add_argument("--repeat", type=int, default=2, help="chainexec runs per layout; the fastest is compared")
    ap.add_argument("--sample-rows", type=int, default=0,
                    help="compare about this many rows (0: all); each chainexec output is then read and removed "
                         "before the next run, for disks that cannot hold chainexec's and PySCF's outputs at once")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    chainexec = [sys.executable, "-m", "chainexec.cli"]
    launch = [args.launcher, "-n", str(args.ranks)] if args.ranks > 1 else []
    summary = {"molecule": args.molecule, "basis": args.basis, "threads": args.threads, "ranks": args.ranks,
               "backend": args.backend, "chainexec": {}}
    C = None
    kept, shapes = {}, {}  # per layout: its output file, or its sampled rows; its output's shape
    for layout in args.layouts:
        work = out / f"work_{layout}"
        shutil.rmtree(work, ignore_errors=True)
        prepare = run(chainexec + ["chem", args.molecule, "--basis", args.basis, "--job", "ao2mo", "--layout", layout,
                                   "--out", str(work)], env)
        with h5py.File(work / "inputs.h5", "a") as f:
            summary["nao"], summary["nmo"] = int(f.attrs["nao"]), int(f.attrs["nmo"])
            if C is None:
                C = f["C"][...]
            else:  # one set of orbitals for every layout and for PySCF (degenerate ones differ between SCF runs)
                f["C"][...] = C
            input_bytes = int(f["A"].nbytes) if "A" in f else 0
        report = work / "report.json"
        command = launch + chainexec + ["run", str(work / "ao2mo.yaml"), "--quiet", "--backend", args.backend,
                                        "--report-json", str(report)]
        runs = []
        for _ in range(args.repeat):  # the first compiles and tunes the kernels
            for old in (work / "output.h5", work / "output.h5.parts"):  # as PySCF, into a new file
                shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)
            runs.append(run(command, env))
        record = json.loads(report.read_text())
        summary["chainexec"][layout] = {"prepare_seconds": prepare, "run_seconds": min(runs), "runs_seconds": runs,
                                        "command": " ".join(command), "input_bytes": input_bytes,
                                        "executor_seconds": record["measured"]["total_seconds"], "report": record}
        say(layout, "prepared in", round(prepare, 2), "s, runs", [round(r, 2) for r in runs], "s")
        with h5py.File(work / "output.h5") as f:
            shapes[layout] = f["B"].shape
            blocks = row_blocks(f["B"].shape[0], args.sample_rows)
            kept[layout] = [f["B"][rows] for rows in blocks] if args.sample_rows else work / "output.h5"
        if args.sample_rows and args.keep:
            shutil.rmtree(work / "output.h5.parts")
            (work / "output.h5").unlink()
        elif args.sample_rows:
            shutil.rmtree(work)
    from pyscf import ao2mo, gto, lib

    from chainexec.chem.job import MOLECULES

    lib.num_threads(args.threads)
    mol = gto.M(atom=MOLECULES.get(args.molecule.lower(), args.molecule), basis=args.basis, unit="Angstrom", verbose=0)
    erifile = out / "pyscf_eri.h5"
    t0 = time.perf_counter()
    ao2mo.outcore.full(mol, C, str(erifile), dataname="eri_mo", compact=True)
    summary["pyscf_outcore_seconds"] = time.perf_counter() - t0
    summary["pyscf_output_bytes"] = os.path.getsize(erifile)
    say("PySCF outcore", round(summary["pyscf_outcore_seconds"], 2), "s")
    for layout in args.layouts:
        entry = summary["chainexec"][layout]
        entry |= compare(kept[layout], erifile, blocks, shapes[layout])
        entry["speedup_over_pyscf"] = summary["pyscf_outcore_seconds"] / entry["run_seconds"]
        if not args.keep:
            shutil.rmtree(out / f"work_{layout}", ignore_errors=True)
    erifile.unlink()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "chainexec"} | {
        layout: {k: e[k] for k in ("run_seconds", "executor_seconds", "speedup_over_pyscf", "max_abs_difference",
                                   "input_bytes")} for layout, e in summary["chainexec"].items()}, indent=1))


if __name__ == "__main__":
    main()
