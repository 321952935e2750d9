"""AO→MO four-index transform: chainexec beside PySCF's ``ao2mo.outcore.full`` on one host.

For each integral layout asked for (``s8``, ``s4``: integrals written by PySCF before the timed
run; ``computed``: none written, each tile computed by libcint where chainexec loads it),
``chainexec chem MOLECULE --job ao2mo --layout L`` prepares the inputs (not timed), then the
whole ``chainexec run`` process is timed (under ``mpiexec -n RANKS`` for several ranks). PySCF's
``ao2mo.outcore.full(mol, C, file, compact=True)`` — integrals computed on the fly, output in the
same compact s4 layout — is timed on the same host with the same threads. Both outputs are
compared element by element, in row blocks (the whole array where it is small), and the summary
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


def compare(ours: Path, theirs: Path, rows: int = 2048) -> dict:
    """Largest absolute difference and largest absolute value of two s4 outputs, in row blocks."""
    with h5py.File(ours) as f, h5py.File(theirs) as g:
        a, b = f["B"], g["eri_mo"]
        if a.shape != b.shape:
            sys.exit(f"shapes differ: chainexec {a.shape}, PySCF {b.shape}")
        worst = largest = 0.0
        for r in range(0, a.shape[0], rows):
            x, y = a[r:r + rows], b[r:r + rows]
            worst = max(worst, float(np.max(np.abs(x - y))))
            largest = max(largest, float(np.max(np.abs(y))))
    return {"max_abs_difference": worst, "max_abs_value": largest, "elements": int(np.prod(a.shape))}


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
    ap.add_argument("--repeat", type=int, default=2, help="chainexec runs per layout; the fastest is compared")
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
    from pyscf import ao2mo, gto, lib

    from chainexec.chem.job import MOLECULES

    lib.num_threads(args.threads)
    mol = gto.M(atom=MOLECULES.get(args.molecule.lower(), args.molecule), basis=args.basis, unit="Angstrom", verbose=0)
    erifile = out / "pyscf_eri.h5"
    t0 = time.perf_counter()
    ao2mo.outcore.full(mol, C, str(erifile), dataname="eri_mo", compact=True)
    summary["pyscf_outcore_seconds"] = time.perf_counter() - t0
    summary["pyscf_output_bytes"] = os.path.getsize(erifile)
    for layout in args.layouts:
        entry = summary["chainexec"][layout]
        entry |= compare(out / f"work_{layout}" / "output.h5", erifile)
        entry["speedup_over_pyscf"] = summary["pyscf_outcore_seconds"] / entry["run_seconds"]
        shutil.rmtree(out / f"work_{layout}")
    erifile.unlink()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "chainexec"} | {
        layout: {k: e[k] for k in ("run_seconds", "executor_seconds", "speedup_over_pyscf", "max_abs_difference",
                                   "input_bytes")} for layout, e in summary["chainexec"].items()}, indent=1))


if __name__ == "__main__":
    main()
