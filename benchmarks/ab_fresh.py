"""Versions of chainexec against each other in fresh ``chainexec run`` processes, alternating.

What: each side is a copy of the ``chainexec`` package (for a commit: ``git archive REV chainexec
| tar -x -C DIR``) run from its own folder under OUT with its own kernel cache and its own copy of
the config (inputs read from where the config names them, outputs written beside the copy). Each
side first makes its kernel cache in one cold run (or, with ``--share-cache``, the first side
makes it and the others start from a copy of it, so that every side runs the same autotuner
choices). Then every round runs each side once, in turn, the order reversed every other round.
The script prints, and writes to OUT/summary.json, per side: the executor seconds of each round
(the report's ``run.phases.executor``), the process's wall seconds (end to end: the interpreter's
start, imports, planning, the backend's start, the executor, the outputs; ``api.run``'s share as
``run_median_s``) and the autotuner decisions each round added to its cache
(none once the cache has seen the job),
their median, minimum and maximum over the rounds kept,
whether every measured count equals the prediction, the outputs' scalar values, and, where an
input file carries PySCF's (T) energy and seconds (``chainexec chem``), the ratio of PySCF's (T)
seconds to the median and each side's energy minus PySCF's.

Why: an A/B comparison has two pitfalls this script guards against. ``python -m chainexec.cli``
started in the repository imports the working tree ahead of ``PYTHONPATH``, so every side would
run the same code: here the processes start in OUT and the script prints the file each side
imports. And versions
tuned by separate cold runs may differ by their autotuner's choices rather than by their code:
``--share-cache`` removes that.

Usage: ``python3 benchmarks/ab_fresh.py OUT CONFIG --side base=DIR --side new=DIR [--rounds 12]
[--skip 0] [--backend cupy] [--machine FILE] [--share-cache] [--config-for NAME=CONFIG]``
(``--config-for``: a side that runs another config, e.g. a rewritten chain).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import h5py
import yaml

from chainexec import spec, verify

COUNTS = ("flops", "statements", "streamed", "bytes", "memory_peak")
"""The report's counts that must equal the plan's prediction in every run."""


def side_config(config: Path, folder: Path) -> Path:
    """A copy of ``config`` in ``folder`` reading its inputs where the original does and writing
    its outputs (and scratch) into ``folder``."""
    cfg = yaml.safe_load(config.read_text())
    home = config.resolve().parent
    for t in cfg.get("tensors", {}).values():
        source = t.get("source") if isinstance(t, dict) else None
        if isinstance(source, dict) and "file" in source:
            source["file"] = str((home / source["file"]).resolve())
    for out in cfg.get("outputs", {}).values():
        out["file"] = str(folder / Path(out["file"]).name)
    cfg.pop("scratch", None)
    copy = folder / config.name
    copy.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return copy


def environment(code: Path, cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code), CHAINEXEC_KERNEL_CACHE=str(cache))
    env.pop("CHAINEXEC_GPU_METHOD", None)
    return env


def imported(code: Path, cache: Path, cwd: Path) -> str:
    """The ``chainexec`` package a process of this side imports (it must be ``code``'s)."""
    out = subprocess.run([sys.executable, "-c", "import chainexec; print(chainexec.__file__)"], cwd=cwd,
                         env=environment(code, cache), capture_output=True, text=True, check=True)
    return out.stdout.strip()


def decisions(cache: Path) -> int:
    """The autotuner's decisions kept in a kernel cache (files of its ``tuning/`` folder)."""
    folder = cache / "tuning"
    return sum(1 for _ in folder.glob("*.json")) if folder.is_dir() else 0


def run(code: Path, cache: Path, config: Path, report: Path, args, cwd: Path) -> dict:
    """One fresh ``chainexec run`` of ``config``; its report, with the autotuner decisions it
    added to the kernel cache (``tuned``: none, once the cache has seen the job) and the process's
    wall seconds from its start to its end (``wall``: the interpreter's start and imports, planning,
    the backend's start, the executor, writing the outputs)."""
    before = decisions(cache)
    command = [sys.executable, "-m", "chainexec.cli", "run", str(config), "--backend", args.backend, "--quiet",
               "--report-json", str(report)] + (["--machine", args.machine] if args.machine else [])
    began = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=environment(code, cache), capture_output=True, text=True,
                          timeout=args.timeout)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"ab_fresh: {report.stem} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(report.read_text()) | {"tuned": decisions(cache) - before, "wall": wall}


def pyscf(config: Path) -> tuple[float, float] | None:
    """PySCF's (T) energy (Hartree) and seconds, where an input file of ``config`` carries them."""
    cfg = yaml.safe_load(config.read_text())
    for t in cfg.get("tensors", {}).values():
        source = t.get("source") if isinstance(t, dict) else None
        if isinstance(source, dict) and "file" in source:
            with h5py.File(source["file"], "r") as f:
                if "e_t" in f.attrs and "e_t_seconds" in f.attrs:
                    return float(f.attrs["e_t"]), float(f.attrs["e_t_seconds"])
    return None


def summarize(reports: dict[str, list[dict]], values: dict[str, dict], reference, skip: int) -> dict:
    """Per side: the executor seconds of every round, statistics over the rounds after ``skip``,
    whether every count equalled the prediction, the outputs, and the comparison with PySCF."""
    result = {}
    for name, reps in reports.items():
        seconds = [r["run"]["phases"]["executor"] for r in reps]
        kept = seconds[skip:]
        walls = [r["wall"] for r in reps[skip:]]
        side = {"executor_s": [round(s, 4) for s in seconds], "tuned": [r["tuned"] for r in reps],
                "rounds_kept": len(kept),
                "median_s": round(statistics.median(kept), 4), "min_s": round(min(kept), 4),
                "max_s": round(max(kept), 4),
                "process_wall_s": [round(r["wall"], 3) for r in reps],
                "process_wall_median_s": round(statistics.median(walls), 3),
                "run_median_s": round(statistics.median(r["run"]["phases"]["run"] for r in reps[skip:]), 4),
                "measured_equals_predicted": all(r["measured"][k] == r["predicted"][k] for r in reps for k in COUNTS),
                "outputs": values[name]}
        if reference is not None and "E" in values[name]:
            energy, pyscf_seconds = reference
            side["pyscf_t_s"] = round(pyscf_seconds, 3)
            side["ratio_to_pyscf"] = round(pyscf_seconds / statistics.median(kept), 1)
            side["e_minus_pyscf_eh"] = values[name]["E"] - energy
        result[name] = side
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("config", type=Path)
    parser.add_argument("--side", action="append", required=True, help="NAME=DIR holding a chainexec package")
    parser.add_argument("--config-for", action="append", default=[], help="NAME=CONFIG for one side")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--skip", type=int, default=0, help="rounds left out of the statistics")
    parser.add_argument("--backend", default="cupy")
    parser.add_argument("--machine")
    parser.add_argument("--share-cache", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = parser.parse_args(argv)
    sides = dict(s.split("=", 1) for s in args.side)
    configs = {name: Path(c) for name, c in (s.split("=", 1) for s in args.config_for)}
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "reports").mkdir(exist_ok=True)
    plan = {}
    for name, source in sides.items():
        folder = out / name
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "code").mkdir(parents=True)
        shutil.copytree(Path(source) / "chainexec", folder / "code" / "chainexec",
                        ignore=shutil.ignore_patterns("__pycache__"))
        (folder / "cache").mkdir()
        plan[name] = (folder / "code", folder / "cache", side_config(configs.get(name, args.config), folder))
        print(f"{name} imports {imported(plan[name][0], plan[name][1], out)}", flush=True)
    first = next(iter(plan))
    for name, (code, cache, config) in plan.items():
        if args.share_cache and name != first:
            shutil.copytree(plan[first][1], cache, dirs_exist_ok=True)
            continue
        cold = run(code, cache, config, out / "reports" / f"{name}_cold.json", args, out)
        print(f"{name} cold: executor {cold['run']['phases']['executor']:.2f} s", flush=True)
    reports = {name: [] for name in plan}
    for r in range(args.rounds):
        for name in (list(plan) if r % 2 == 0 else list(plan)[::-1]):
            code, cache, config = plan[name]
            reports[name].append(run(code, cache, config, out / "reports" / f"{name}_r{r}.json", args, out))
    values = {name: verify.scalar_outputs(spec.load(config)) for name, (_, _, config) in plan.items()}
    summary = summarize(reports, values, pyscf(plan[first][2]), args.skip)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for name, side in summary.items():
        print(name, json.dumps({k: v for k, v in side.items() if k not in ("executor_s", "process_wall_s")}), flush=True)
    return summary


if __name__ == "__main__":
    main()
