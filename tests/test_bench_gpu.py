"""The TCCG bench's per-case work on a GPU: every method of a case checked against
``cupy.einsum`` (a library that shares no code with chainexec's kernels) and timed, the
configurations cut against the fastest method timed before them, and a configuration far slower
than that timed once.

Skipped without CuPy or a CUDA device.
"""

from __future__ import annotations

import math

import pytest

from tests.conftest import TCCG, require_gpu

cupy = require_gpu()

import chainexec.bench as bench  # noqa: E402
from chainexec.kernels import gett  # noqa: E402
from chainexec.kernels.kernelconf import choose_config  # noqa: E402
from chainexec.runtime import launch  # noqa: E402
from chainexec.runtime.launch import device_model, get_kernel  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = {case["id"]: case for case in bench.load_cases(str(TCCG))}


@pytest.mark.parametrize("case_id", [3, 9, 31])
def test_a_case_checks_every_method_and_cuts_against_those_timed_first(monkeypatch, case_id):
    """Every method checked (errors ≤ 1e-12) and timed; the GETT configurations are cut against
    the fastest of batched GEMM, relayout and TTGT, the packed and split ones against that and
    GETT's fastest."""
    befores = {}

    def recording(name, rows):
        def call(*args, before_ms=math.inf, **kw):
            befores[name] = before_ms
            return rows(*args, before_ms=before_ms, **kw)
        return call

    monkeypatch.setattr(bench, "gett_rows", recording("gett", bench.gett_rows))
    method_rows = bench.method_rows
    monkeypatch.setattr(bench, "method_rows", lambda backend, name, *a, **kw:
                        recording(name, method_rows)(backend, name, *a, **kw))
    case = CASES[case_id]
    sizes = case["sizes"]
    cfg = choose_config(case["C"], case["A"], case["B"], sizes, "float64", device_model())
    kernel = get_kernel(case["C"], case["A"], case["B"], sizes, "float64", config=cfg)
    row = bench.run_case(case, 1, kernel, 0.002, False, (50_000.0, 3_000.0))
    assert row["rel_err"] <= 1e-12 and row["rel_err_beta"] <= 1e-12
    assert row["gett"] and all(r["rel_err"] <= 1e-12 and r["rel_err_beta"] <= 1e-12 for r in row["gett"])
    timed = {k[:-3] for k in row if k.endswith("_ms") and k[:-3] + "_reps" in row}
    assert {"gett", "cogent", "ttgt", "cupy_einsum"} <= timed
    assert row["selector"] in timed and row["chainexec_ms"] > 0 and row["of_bound"] > 0
    first = [row[f"{k}_ms"] for k in timed if k.split(":")[0] in ("batched", "relayout", "ttgt")]
    assert befores["gett"] == min(first)
    assert befores["packed"] == min(first + [row["gett_ms"]])


def test_a_configuration_far_slower_than_a_method_timed_before_is_timed_once(monkeypatch):
    """The model's first configuration is timed in full whatever came before; the same
    configuration again is timed in full after it, but once where a method before was far faster:
    by its checked launch, two launches in all."""
    case = CASES[5]
    sizes = case["sizes"]
    rng = cupy.random.default_rng(5)
    A = rng.standard_normal([sizes[i] for i in case["A"]])
    B = rng.standard_normal([sizes[i] for i in case["B"]])
    C = cupy.full([sizes[i] for i in case["C"]], cupy.nan)
    ref = cupy.einsum(f"{case['A']},{case['B']}->{case['C']}", A, B)

    def twice(problems, sm_count):
        return gett.candidates(problems, sm_count, top=3)[:1] * 2

    launches = []
    launch_gett = launch.launch_gett
    monkeypatch.setattr(launch, "launch_gett", lambda *a: launches.append(a[-2:]) or launch_gett(*a))
    args = (case["C"], case["A"], case["B"], sizes, A, B, C, ref, 0.05)
    cut, _ = bench.gett_rows(*args, choose=twice, before_ms=1e-6)
    cut_launches, launches[:] = list(launches), []
    whole, _ = bench.gett_rows(*args, choose=twice, before_ms=math.inf)
    assert all(r["rel_err"] <= 1e-12 and r["rel_err_beta"] <= 1e-12 for r in cut + whole)
    assert [r["reps"] >= 3 for r in cut] == [True, False] and cut[1]["reps"] == 1
    assert all(r["reps"] >= 3 for r in whole)
    # each configuration: its two checks (the first timed), then its repeats where not cut
    assert cut_launches[-2:] == [(1.0, 0.0), (0.5, -2.0)]
    assert launches[-2:] == [(1.0, 0.0), (1.0, 0.0)]


def test_a_method_whose_call_takes_longer_than_the_budget_is_timed_once():
    """Alone, each method is timed once where its call takes longer than the whole budget (here
    a microsecond), COGENT without a warm-up; the GETT model's first configuration is still
    timed in full, and the contenders again together."""
    case = CASES[3]
    sizes = case["sizes"]
    cfg = choose_config(case["C"], case["A"], case["B"], sizes, "float64", device_model())
    kernel = get_kernel(case["C"], case["A"], case["B"], sizes, "float64", config=cfg)
    calls = []

    class Counted:
        config = kernel.config

        def __call__(self, *args, **kwargs):
            calls.append(1)
            return kernel(*args, **kwargs)

    row = bench.run_case(case, 1, Counted(), 1e-6, False, (50_000.0, 3_000.0))
    alone = [k[:-5] for k in row if k.endswith("_reps") and k[:-5] not in ("gett", "packed", "splitk")]
    assert "cogent" in alone and "cupy_einsum" in alone
    assert all(row[f"{k}_reps"] == 1 for k in alone), {k: row[f"{k}_reps"] for k in alone}
    together = row["head_to_head"]["cogent"]["reps"] + 1 if "cogent" in row["head_to_head"] else 0
    assert len(calls) == 2 + 1 + together  # its two checks, then one timed call, no warm-up
    assert row["gett"][0]["reps"] >= 3
    assert all(v["reps"] >= 5 for v in row["head_to_head"].values())
