"""How well the autotuner's cost models (``chainexec.runtime.backends.costmodel``) would have chosen,
checked against the timings of a tuning cache made on a GPU.

What: every single-contraction decision in the cache (``<kernel cache>/tuning/*``, or a JSON list of
their entries) holds each candidate's best timed seconds (so does every case of a ``chainexec bench
tccg`` result file, at its full size: :func:`bench_rows`). For each, the candidates are predicted on
the probe they were timed on (``tuning._probe``, as the autotuner cuts it); the script prints, per
method, the ratio of measured to predicted seconds (median, min, max), and, for several margins,
how many candidates model-first tuning times (``costmodel.ambiguous``: those within the margin of the
best prediction, or of their own method's best where that is within ``costmodel.WIDE``) and its
regret: the best measured among them over the best measured of all (1.0: nothing lost).

Why: the margin (``costmodel.MARGIN``) trades the first run's compile and tune seconds against
warm-run speed; this measures that trade on real timings without a GPU.

Usage: ``python3 benchmarks/tuning_model.py TUNING|BENCH.json [--sm-count 132] [--margins 1 1.25 1.5 2 3]``
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import math
import statistics
import types
from pathlib import Path

import numpy as np

from chainexec.kernels import gett, sumkernel
from chainexec.planner.plan import Contraction
from chainexec.runtime.backends import costmodel, methods, termruns, tuning


def entries(path: str) -> list[dict]:
    """The tuning cache's decisions: from a folder of its files (less the files of shape classes,
    which hold no ``choice``), a JSON list of them, or a result file holding that list as
    ``entries``."""
    if Path(path).is_dir():
        found = [json.loads(Path(p).read_text()) for p in glob.glob(str(Path(path) / "*"))]
    else:
        data = json.loads(Path(path).read_text())
        found = data["entries"] if isinstance(data, dict) else data
    return [entry for entry in found if "choice" in entry]


def fake(shape, strides) -> np.ndarray:
    """A view of these shape and element strides over no memory: only its metadata is read."""
    return np.lib.stride_tricks.as_strided(np.empty(1), shape=tuple(shape), strides=tuple(8 * s for s in strides))


def contraction(key: list) -> tuple | None:
    """(contraction, out, a, b, room) of a single contraction's key, or None for a run of terms."""
    if not isinstance(key[2], list):
        return None
    out_i, a_i, b_i, a_s, b_s, o_s, o_st, a_st, b_st, dtype, *room = key[2:]
    c = Contraction(0, "O", list(out_i), "A", list(a_i), "B", list(b_i), 1.0, True, 0, 0)
    return c, fake(o_s, o_st), fake(a_s, a_st), fake(b_s, b_st), (room[0] if room else None)


def gett_configs(c, out, a, b, sm_count: int) -> dict:
    """Candidate name -> GETT configuration (order and fields) on the operands, on their packed
    copies (described by shape, as the runtime describes them) and with the sum split (on a C-contiguous
    output), as the autotuner names them."""
    def problems(c, out, a, b) -> dict:
        strides = tuple(dict(zip(i, [s // 8 for s in x.strides])) for i, x in
                        ((c.out_indices, out), (c.a_indices, a), (c.b_indices, b)))
        sizes = dict(zip(c.a_indices, a.shape)) | dict(zip(c.b_indices, b.shape)) | dict(zip(c.out_indices, out.shape))
        return gett.variants(tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices), sizes, strides)

    def named(c, a, b, method: str) -> dict:
        return methods.Gett.named(gett.candidates(problems(c, out, a, b), sm_count, methods.TUNE_TOP), method)

    moved, pa, pb = methods._packed(c)
    whole = methods._Contiguous(tuple(out.shape), np.float64)
    splitk = methods.SplitK.named([(order, cfg, parts) for order, p in problems(c, whole, a, b).items()
                                   for cfg, parts in gett.split_configs(p, sm_count)])
    return named(c, a, b, "gett") | named(moved, *methods._described(a, b, pa, pb), "packed") | splitk


MADE = {"SumProblem": sumkernel.SumProblem, "View": sumkernel.View, "Term": sumkernel.Term}
"""The classes a tuning cache's sum-kernel problem text may call (their ``repr``)."""


def sum_problem(text: str) -> sumkernel.SumProblem:
    """The sum-kernel problem whose ``repr`` is ``text``, read without running it: calls of the
    classes of :data:`MADE` with literal arguments only (a cache file is data; anything else in
    it is a ValueError)."""

    def value(node):
        if isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in MADE):
                raise ValueError(f"{ast.unparse(node.func)!r} is not one of {sorted(MADE)}")
            return MADE[node.func.id](*map(value, node.args), **{k.arg: value(k.value) for k in node.keywords})
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(map(value, node.elts))
        return ast.literal_eval(node)

    try:
        found = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, TypeError) as err:  # not Python; a class called with arguments it lacks
        raise ValueError(f"not a sum-kernel problem: {text[:80]!r} ({err})") from None
    if not isinstance(found, sumkernel.SumProblem):
        raise ValueError(f"not a sum-kernel problem: {text[:80]!r}")
    return found


def run_of_terms(key: list) -> termruns.Run | None:
    """The run of terms of a strategy decision's key (its sum-kernel problem's text), over views
    of no memory, or None for a single contraction."""
    if key[2] != "sum":
        return None
    problem = sum_problem(key[3])
    cs = [Contraction(n, "O", list(problem.out.indices), "A", list(t.a.indices), "B", list(t.b.indices), t.factor,
                      True, 0, 0) for n, t in enumerate(problem.terms)]
    operands = [(fake(t.a.shape, t.a.strides), fake(t.b.shape, t.b.strides)) for t in problem.terms]
    return termruns.Run(cs, fake(problem.out.shape, problem.out.strides), operands, problem, json.dumps(key))


def strategies(run: termruns.Run, measured: dict) -> tuple[dict, dict]:
    """(strategy -> best measured seconds, strategy -> predicted seconds) of a run's decision."""
    tuner = types.SimpleNamespace(method="auto", _stack_runs={}, _stacks=tuning.Autotuner._stacks)
    out, terms = run.views
    each = [costmodel.library(out, a, b, 8) for a, b in terms]
    best: dict[str, float] = {}
    for name, seconds in measured.items():
        strategy = name.split()[0]
        best[strategy] = min(best.get(strategy, math.inf), seconds)
    return best, {name: termruns.REGISTRY[name].predicted(tuner, run, each) for name in best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tuning")
    ap.add_argument("--sm-count", type=int, default=132)
    ap.add_argument("--margins", type=float, nargs="+", default=[1.0, 1.25, 1.5, 2.0, 3.0])
    args = ap.parse_args()
    data = json.loads(Path(args.tuning).read_text()) if Path(args.tuning).is_file() else None
    if isinstance(data, dict) and "rows" in data:  # a ``chainexec bench tccg`` result
        rows, runs = bench_rows(args.tuning, sm_count=args.sm_count), []
        ratios: dict[str, list[float]] = {}
        for measured, predicted in rows:
            for name, seconds in measured.items():
                ratios.setdefault(name.split(":")[0], []).append(seconds / predicted[name])
    else:
        ratios, rows, runs = evaluate(entries(args.tuning), args.sm_count)
    report(ratios, rows, runs, args.margins)


def evaluate(decisions: list[dict], sm_count: int = 132) -> tuple[dict, list, list]:
    """Per method the measured / predicted ratios; per single contraction (measured, predicted)
    seconds by candidate; per run of terms (measured, predicted) seconds by strategy."""
    ratios: dict[str, list[float]] = {}
    rows = []
    runs = []
    for entry in decisions:
        key = entry["key"] if isinstance(entry["key"], list) else json.loads(entry["key"])
        measured = entry["choice"]["seconds"]
        if len(measured) < 2:
            continue
        found = contraction(key)
        if found is None:
            runs.append(strategies(run_of_terms(key), measured))
            continue
        c, out, a, b, room = found
        limit = tuning.TUNE_BYTES if room is None else min(tuning.TUNE_BYTES, max(tuning.PROBE_FLOOR, room // 4))
        po, pa, pb = tuning._probe(c, out, a, b, limit)
        ops = [costmodel.operand(i, x) for i, x in ((c.out_indices, po), (c.a_indices, pa), (c.b_indices, pb))]
        configs = gett_configs(c, po, pa, pb, sm_count)
        predicted = {}
        for name in measured:
            method = name.split(":")[0]
            if method in ("gett", "packed", "splitk") and name not in configs:
                continue
            predicted[name] = costmodel.predict(method, configs.get(name), *ops, 8, sm_count)
            ratios.setdefault(method, []).append(measured[name] / predicted[name])
        rows.append((measured, predicted))
    return ratios, rows, runs


def regret(measured: dict, predicted: dict, margin: float, wide: float = costmodel.WIDE) -> float:
    """The best measured seconds among the candidates model-first tuning keeps at ``margin`` (and
    ``wide``: :func:`chainexec.runtime.backends.costmodel.ambiguous`) over the best measured of
    all (1.0: nothing lost)."""
    return min(measured[m] for m in costmodel.ambiguous(predicted, margin, wide)) / min(measured.values())


BENCH_METHODS = {"batched": "batched", "relayout": "relayout", "ttgt": "ttgt", "einsum": "cupy_einsum",
                 "kernel": "cogent", "cutensor": "cutensor"}
"""Autotuner method -> the key of its time in a ``chainexec bench tccg`` row (``<key>_ms``)."""


def bench_rows(path: str, cutensor: bool = True, sm_count: int = 132) -> list[tuple[dict, dict]]:
    """(measured, predicted) seconds by candidate, named as the autotuner names them, of every
    case of a ``chainexec bench tccg`` result file (C-contiguous operands at the case's sizes):
    the library methods and the GETT candidates the bench timed that the autotuner offers now;
    cuTENSOR only where ``cutensor``."""
    out = []
    for row in json.loads(Path(path).read_text())["rows"]:
        if "skipped" in row:
            continue
        idx = row["name"].split("-")
        arrays = [fake([row["sizes"][i] for i in x],
                       [math.prod(row["sizes"][i] for i in x[d + 1:]) for d in range(len(x))]) for x in idx]
        c = Contraction(0, "O", list(idx[0]), "A", list(idx[1]), "B", list(idx[2]), 1.0, True, 0, 0)
        ops = [costmodel.operand(i, x) for i, x in zip(idx, arrays)]
        configs = gett_configs(c, *arrays, sm_count)
        measured = {m: row[f"{key}_ms"] / 1e3 for m, key in BENCH_METHODS.items()
                    if f"{key}_ms" in row and (cutensor or m != "cutensor")}
        for method in ("gett", "packed", "splitk"):
            for g in row.get(method, []):
                if (name := f"{method}:{g['order']}:{g['config']}") in configs:
                    measured[name] = g["ms"] / 1e3
        predicted = {m: costmodel.predict(m.split(":")[0], configs.get(m), *ops, 8, sm_count) for m in measured}
        out.append((measured, predicted))
    return out


def report(ratios: dict, rows: list, runs: list, margins: list[float]) -> None:
    print(f"{len(rows)} decisions")
    print(f"{'method':<10}{'n':>5}{'median':>10}{'min':>10}{'max':>10}   measured / predicted")
    for method, r in sorted(ratios.items()):
        print(f"{method:<10}{len(r):>5}{statistics.median(r):>10.2f}{min(r):>10.2f}{max(r):>10.2f}")
    print(f"{'margin':>8}{'timed':>8}{'of':>6}{'untimed':>9}{'regret max':>12}{'geomean':>9}")
    for margin in margins:
        timed = total = untimed = 0
        regrets = []
        for measured, predicted in rows:
            kept = costmodel.ambiguous(predicted, margin, costmodel.WIDE)
            timed += len(kept) if len(kept) > 1 else 0
            untimed += len(kept) == 1
            total += len(measured)
            regrets.append(regret(measured, predicted, margin))
        geo = math.exp(statistics.fmean(math.log(r) for r in regrets))
        print(f"{margin:>8.2f}{timed:>8}{total:>6}{untimed:>9}{max(regrets):>12.3f}{geo:>9.3f}")
    print(f"{len(runs)} runs of terms: strategy measured (predicted) seconds, best measured first")
    for best, predicted in runs:
        print("  " + "  ".join(f"{name} {best[name] * 1e3:.3f} ms ({predicted[name] * 1e3:.3f})"
                               for name in sorted(best, key=best.get)))
    for margin in margins:
        regrets = [regret(best, predicted, margin, 1.0) for best, predicted in runs]
        kept = [len(costmodel.ambiguous(predicted, margin)) for _, predicted in runs]
        print(f"  margin {margin:.2f}: strategies timed per run {kept}, regret max "
              f"{max(regrets, default=1):.3f}")


if __name__ == "__main__":
    main()
