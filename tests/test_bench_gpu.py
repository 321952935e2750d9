"""The TCCG bench's per-case work on a GPU: every method of a case checked against
``cupy.einsum`` (a library that shares no code with chainexec's kernels) and timed, and the GETT
configurations far slower than a method timed before them timed once.

Skipped without CuPy or a CUDA device.
"""

from __future__ import annotations

import math

import pytest

from tests.conftest import TCCG, require_gpu

cupy = require_gpu()

from chainexec.bench import gett_rows, load_cases, run_case  # noqa: E402
from chainexec.kernels.kernelconf import choose_config  # noqa: E402
from chainexec.runtime.launch import device_model, get_kernel  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = {case["id"]: case for case in load_cases(str(TCCG))}


def _operands(case):
    rng = cupy.random.default_rng(case["id"])
    sizes = case["sizes"]
    A = rng.standard_normal([sizes[i] for i in case["A"]])
    B = rng.standard_normal([sizes[i] for i in case["B"]])
    C = cupy.full([sizes[i] for i in case["C"]], cupy.nan)
    return sizes, A, B, C, cupy.einsum(f"{case['A']},{case['B']}->{case['C']}", A, B)


@pytest.mark.parametrize("case_id", [3, 9, 31])
def test_a_case_checks_every_method_and_names_the_fastest(case_id):
    case = CASES[case_id]
    sizes = case["sizes"]
    cfg = choose_config(case["C"], case["A"], case["B"], sizes, "float64", device_model())
    kernel = get_kernel(case["C"], case["A"], case["B"], sizes, "float64", config=cfg)
    row = run_case(case, 1, kernel, 0.002, False, (50_000.0, 3_000.0))
    assert row["rel_err"] <= 1e-12 and row["rel_err_beta"] <= 1e-12
    assert row["gett"] and all(r["rel_err"] <= 1e-12 and r["rel_err_beta"] <= 1e-12 for r in row["gett"])
    timed = {k[:-3] for k in row if k.endswith("_ms") and k[:-3] + "_reps" in row}
    assert {"gett", "cogent", "ttgt", "cupy_einsum"} <= timed
    assert row["selector"] in timed and row["chainexec_ms"] > 0 and row["of_bound"] > 0


def test_configurations_far_slower_than_a_method_timed_before_are_timed_once():
    case = CASES[5]
    sizes, A, B, C, ref = _operands(case)
    args = (case["C"], case["A"], case["B"], sizes, A, B, C, ref, 0.05)
    cut, _ = gett_rows(*args, before_ms=1e-6)
    assert cut and all(r["reps"] == 1 and r["rel_err"] <= 1e-12 for r in cut)
    whole, _ = gett_rows(*args, before_ms=math.inf)
    assert [r["config"] for r in whole] == [r["config"] for r in cut] and whole[0]["reps"] >= 3
