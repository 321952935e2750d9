"""The autotuner's cost models (:mod:`chainexec.runtime.backends.costmodel`): their rooflines
against formulas written out here, the margin rule, and the choices they make on candidates timed
on an H200 (``benchmarks/results/tuning_h200_benzene.json``, every candidate of a (T) job
timed), read through ``benchmarks/tuning_model.py``."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from chainexec.runtime.backends import costmodel
from chainexec.runtime.backends.costmodel import Operand

REPO = Path(__file__).resolve().parents[2]
RECORD = REPO / "benchmarks" / "results" / "tuning_h200_benzene.json"


def _script():
    spec = importlib.util.spec_from_file_location("tuning_model", REPO / "benchmarks" / "tuning_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _c_order(indices: str, extents: dict) -> Operand:
    shape = tuple(extents[i] for i in indices)
    return Operand(tuple(indices), shape, tuple(math.prod(shape[d + 1:]) for d in range(len(shape))))


@pytest.mark.parametrize("m, n, k", [(96, 80, 64), (8, 300, 17), (513, 9, 1000)])
def test_batched_gemm_is_its_flops_at_the_shapes_rate_plus_its_traffic(m, n, k):
    """``C[m,n] += A[m,k]·B[k,n]`` (row-major, one GEMM): the flops at the tensor-core rate times
    the shape's efficiency, plus A and B read and C read and written, plus one launch; TTGT on
    the same operands makes the same GEMM and moves more, so it is predicted slower."""
    size = {"m": m, "n": n, "k": k}
    out, a, b = _c_order("mn", size), _c_order("mk", size), _c_order("kn", size)
    eff = (m / (m + 32)) * (n / (n + 32)) * (k / (k + 16))
    want = 2 * m * n * k / (costmodel.FLOPS * eff) + 8 * (m * k + k * n + 2 * m * n) / costmodel.BANDWIDTH \
        + costmodel.LAUNCH
    assert costmodel.predict("batched", None, out, a, b, 8, 132) == pytest.approx(want, rel=1e-12)
    assert costmodel.predict("ttgt", None, out, a, b, 8, 132) > want
    assert costmodel.predict("direct", None, out, a, b, 8, 132) > costmodel.predict("kernel", None, out, a, b, 8, 132)


@pytest.mark.parametrize("out_idx, a_idx, b_idx, right", [
    ("abcd", "aecf", "fbed", "b"),  # TCCG 23: the operand holding out's fastest index goes right
    ("abcd", "fbed", "aecf", "a"),  # the operands exchanged
    ("abdc", "aecf", "fbed", "a"),  # out's fastest index in the other operand
])
@pytest.mark.parametrize("chunks", [3, 6])
def test_pipelined_ttgt_runs_all_but_one_chunk_of_its_copies_beside_the_gemm(out_idx, a_idx, b_idx, right, chunks):
    """``ttgt`` with ``{"chunks": n}`` at the odd extents of ``benchmarks/odd_extents.json``'s
    case 106 (TCCG 23's contraction, extents 53 to 73): the right
    operand's copy, then the longer of the GEMM (rows cut n-fold in the shape's efficiency) and
    the left operand's copy with the output's four passes, plus one chunk's share of the latter,
    plus 1 + 3n launches; faster than plain TTGT, which adds every part."""
    size = dict(a=71, b=73, c=67, d=61, e=59, f=53)
    out, a, b = (_c_order(idx, size) for idx in (out_idx, a_idx, b_idx))
    rhs, lhs = (b, a) if right == "b" else (a, b)
    m, n, k = (math.prod(size[i] for i in group) for group in (
        set(lhs.indices) - set(rhs.indices), set(rhs.indices) - set(lhs.indices), set(lhs.indices) & set(rhs.indices)))
    eff = (m // chunks / (m // chunks + 32)) * (n / (n + 32)) * (k / (k + 16))
    compute = 2.0 * m * n * k / (costmodel.FLOPS * eff)
    rest = 8 * (2 * lhs.size + 4 * out.size) / costmodel.BANDWIDTH
    want = 16 * rhs.size / costmodel.BANDWIDTH + max(compute, rest) + rest / chunks + (1 + 3 * chunks) * costmodel.LAUNCH
    got = costmodel.predict("ttgt", {"chunks": chunks}, out, a, b, 8, 132)
    assert got == pytest.approx(want, rel=1e-12)
    assert got < costmodel.predict("ttgt", None, out, a, b, 8, 132)


def test_a_method_without_a_layout_or_model_is_never_predicted_fastest():
    """Batched GEMM where no GEMM layout exists (an index in one operand only) and an unknown
    method are ``inf``; the margin keeps every candidate where no prediction is finite."""
    size = {"i": 9, "j": 10, "k": 11}
    out, a, b = _c_order("i", size), _c_order("ij", size), _c_order("jk", size)
    assert costmodel.predict("batched", None, out, a, b, 8, 132) == math.inf
    assert costmodel.predict("unknown", None, out, a, b, 8, 132) == math.inf
    assert costmodel.ambiguous({"x": math.inf, "y": math.inf}) == ["x", "y"]


def test_candidates_within_the_margin_are_kept_best_first():
    predicted = {"a": 3.0, "b": 1.0, "c": 1.2, "d": 1.3, "e": math.inf}
    assert costmodel.ambiguous(predicted, 1.25) == ["b", "c"]
    assert costmodel.ambiguous(predicted, 1.0) == ["b"]
    assert costmodel.ambiguous(predicted, math.inf) == ["b", "c", "d", "a", "e"]


def test_a_method_near_the_best_has_its_own_best_candidates_timed():
    """``wide``: a method whose best prediction is within it of the best of all keeps its
    candidates within the margin of that method's own best; a method beyond it keeps none, and
    ``wide`` 1 is the margin alone."""
    predicted = {"cutensor": 1.0, "gett:x": 1.6, "gett:y": 1.9, "gett:z": 2.1, "batched": 1.7, "ttgt": 1.8,
                 "kernel": 2.5}
    assert costmodel.ambiguous(predicted, 1.25, 1.75) == ["cutensor", "gett:x", "batched", "gett:y"]
    assert costmodel.ambiguous(predicted, 1.25, 1.0) == costmodel.ambiguous(predicted, 1.25) == ["cutensor"]
    assert costmodel.ambiguous(predicted, 1.0, 1.75) == ["cutensor", "gett:x", "batched"]


def test_recorded_timings_lose_little_at_the_margin():
    """On every decision of the recorded H200 (T) job: keeping only the candidates the models put
    within :data:`~costmodel.MARGIN` of the best (of their own method's best, for a method within
    :data:`~costmodel.WIDE`), the best of them is at most 5 % slower than the best of all for
    single contractions and 10 % for runs of terms (the margin alone), while fewer than 40 % of
    the contraction candidates and at most two strategies per run are timed; the models alone
    (neither margin nor ``WIDE``) would lose more on some decision."""
    tm = _script()
    ratios, rows, runs = tm.evaluate(tm.entries(str(RECORD)))
    assert len(rows) >= 50 and len(runs) >= 5
    regrets = [tm.regret(measured, predicted, costmodel.MARGIN) for measured, predicted in rows]
    assert max(regrets) <= 1.05
    timed = sum(len(costmodel.ambiguous(p, costmodel.MARGIN, costmodel.WIDE)) for _, p in rows)
    assert timed < 0.4 * sum(len(m) for m, _ in rows)
    assert max(tm.regret(best, predicted, costmodel.MARGIN, 1.0) for best, predicted in runs) <= 1.10
    assert max(len(costmodel.ambiguous(p, costmodel.MARGIN)) for _, p in runs) <= 2
    assert max(tm.regret(measured, predicted, 1.0, 1.0) for measured, predicted in rows) > max(regrets)


def test_timings_the_shares_were_not_set_on_lose_little_on_the_whole():
    """On a pyridine-shaped (T) job's timings (``tuning_h200_pyridine.json``), not used to set
    the models' shares: at the margin the kept candidates lose under 3 % on the geometric mean
    and at most 30 % on the worst contraction, and no run of terms loses anything."""
    tm = _script()
    _, rows, runs = tm.evaluate(tm.entries(str(RECORD.with_name("tuning_h200_pyridine.json"))))
    regrets = [tm.regret(measured, predicted, costmodel.MARGIN) for measured, predicted in rows]
    assert len(rows) >= 25 and math.exp(sum(map(math.log, regrets)) / len(regrets)) <= 1.03
    assert max(regrets) <= 1.30
    assert all(tm.regret(best, predicted, costmodel.MARGIN, 1.0) == 1.0 for best, predicted in runs)


@pytest.mark.parametrize("cutensor", [False, True])
def test_the_fastest_method_of_every_tccg_case_is_among_those_timed(cutensor):
    """On the 48 TCCG cases timed by every method on an H200 (``tccg_h200_cutensor.json``,
    cuTENSOR installed; without it, its times left out): the candidates the models keep include
    the fastest of every case. The margin alone (``wide`` 1) does not: with cuTENSOR predicted
    best nearly everywhere, it times cuTENSOR alone and loses 15 % or more on the geometric mean
    (GETT was up to 1.9 times faster)."""
    tm = _script()
    rows = tm.bench_rows(str(RECORD.with_name("tccg_h200_cutensor.json")), cutensor)
    assert len(rows) == 48 and all(any(m.startswith("gett:") for m in measured) for measured, _ in rows)
    assert all(tm.regret(measured, predicted, costmodel.MARGIN) == 1.0 for measured, predicted in rows)
    alone = [tm.regret(measured, predicted, costmodel.MARGIN, 1.0) for measured, predicted in rows]
    assert max(alone) > 1.4
    if cutensor:
        assert math.exp(sum(map(math.log, alone)) / len(alone)) > 1.15


def test_gett_on_packed_copies_is_timed_where_it_is_fastest():
    """On the 48 TCCG cases timed with GETT on packed copies beside every other method
    (``tccg_h200_2026-12-04d_scale1_packed.json``, cuTENSOR installed): a packed candidate is the
    fastest of every (T) case (31–48) and the candidates the models keep include the fastest of
    every case, packed ones named as the autotuner names them."""
    tm = _script()
    rows = tm.bench_rows(str(RECORD.with_name("tccg_h200_2026-12-04d_scale1_packed.json")))
    assert len(rows) == 48
    assert all(min(measured, key=measured.get).startswith("packed:") for measured, _ in rows[30:])
    assert all(tm.regret(measured, predicted, costmodel.MARGIN) == 1.0 for measured, predicted in rows)


def test_the_script_reads_the_decisions_of_a_cache_folder_not_its_shape_classes(tmp_path):
    """A tuning cache folder holds the autotuner's decisions and the files of its shape classes
    (``key`` and ``shapes``, no ``choice``): ``tuning_model.entries`` returns the decisions only,
    as the recorded list's are."""
    import json

    decisions = json.loads(RECORD.read_text())["entries"][:3]
    for n, entry in enumerate(decisions):
        (tmp_path / f"d{n}.json").write_text(json.dumps(entry))
    (tmp_path / "class.json").write_text(json.dumps({"key": "[9]", "shapes": [[2, 3]]}))
    found = _script().entries(str(tmp_path))
    assert sorted(json.dumps(e, sort_keys=True) for e in found) == sorted(json.dumps(e, sort_keys=True) for e in decisions)


def test_split_gett_is_timed_where_it_is_fastest():
    """On the 48 TCCG cases timed with split GETT beside every other method
    (``tccg_h200_2026-12-04f_scale1_splitk.json``, cuTENSOR installed): a split candidate is the
    fastest of case 19 (a 72×5184 output summed over 5184), split candidates are offered on
    cases 13, 14 and 19 alone, and the candidates the models keep include the fastest of every
    case. (GETT's model counts A's one block row of 80 as the raster group's only row tile: as
    eight, 26 MB against the 12 MB it lets A's tiles hold in L2, A would be read once per block
    column and the fastest split predicted past the margin, behind cuTENSOR.)"""
    tm = _script()
    rows = tm.bench_rows(str(RECORD.with_name("tccg_h200_2026-12-04f_scale1_splitk.json")))
    assert len(rows) == 48
    split = [n for n, (measured, _) in enumerate(rows, 1) if any(m.startswith("splitk:") for m in measured)]
    assert split == [13, 14, 19] and min(rows[18][0], key=rows[18][0].get).startswith("splitk:")
    assert all(tm.regret(measured, predicted, costmodel.MARGIN) == 1.0 for measured, predicted in rows)


def test_the_script_reads_a_problem_without_running_its_text():
    """A tuning cache is data: a sum-kernel problem's text is read as calls of the problem's own
    classes with literal arguments (the recorded job's read back to the same ``repr``), and text
    that calls anything else is refused, not run."""
    tm = _script()
    keys = [json.loads(e["key"]) for e in json.loads(RECORD.read_text())["entries"]]
    texts = {key[3] for key in keys if key[2] == "sum"}
    assert texts
    for text in texts:
        assert repr(tm.sum_problem(text)) == text
    for hostile in ("__import__('os').system('true')", "SumProblem(out=open('/etc/passwd'), terms=(), dtype='x')",
                    "View.__init__.__globals__", "(1, 2)", "View(bogus=1)", "SumProblem(**x)", "View("):
        with pytest.raises(ValueError):
            tm.sum_problem(hostile)
