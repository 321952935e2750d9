"""Configs that reach the planner's costly searches plan in bounded time: a product of more
operands than the exhaustive order search takes, and extents in the tens of millions under small
memory limits. The subprocess timeouts guard against a hang; nothing else here is timed."""

from __future__ import annotations

import json

import pytest

from tests.conftest import fourindex_config, run_cli, write_config


def _chain(n: int) -> dict:
    """A product of n matrices with small uneven extents, HDF5 seeded inputs."""
    return {
        "name": f"chain{n}",
        "indices": {f"i{k}": 2 + k % 3 for k in range(n + 1)},
        "tensors": {f"A{k}": {"indices": [f"i{k}", f"i{k + 1}"],
                              "source": {"file": "in.h5", "dataset": f"A{k}", "seed": k + 1}} for k in range(n)},
        "statements": [f"R[i0,i{n}] = " + " * ".join(f"A{k}[i{k},i{k + 1}]" for k in range(n))],
        "outputs": {"R": {"file": "out/result.h5", "dataset": "R"}},
        "machine": {"global_memory": "1MiB", "device_memory": "64KiB"},
    }


@pytest.mark.parametrize("n, order", [(20, "greedy"), (10, "optimal")])
def test_many_operands_plan_run_and_verify(n, order, tmp_path):
    """Beyond 10 operands the order is greedy, recorded per contraction and shown by `plan`; the
    run's output equals numpy.einsum of the whole product (`verify`)."""
    config = write_config(tmp_path, _chain(n))
    plan = run_cli("plan", config, timeout=60)
    assert plan.returncode == 0, plan.stderr
    contractions = [line for line in plan.stdout.splitlines() if line.startswith("#") and "GFLOP" in line]
    assert len(contractions) == n - 1
    assert all(line.endswith("(greedy order)") == (order == "greedy") for line in contractions)
    data = json.loads(run_cli("plan", config, "--json", timeout=60).stdout)
    assert {c["order"] for c in data["plan"]["contractions"]} == {order}
    assert run_cli("generate", config).returncode == 0
    run = run_cli("run", config, "--quiet")
    assert run.returncode == 0, run.stderr
    check = run_cli("verify", config)
    assert check.returncode == 0 and "einsum" in check.stdout and " ok" in check.stdout, check.stdout


def _one_huge_index(index: str, extent: int) -> dict:
    """The four-index transform under 1 MiB / 64 KiB with ``index`` (s or d) of ``extent``: its
    coefficient matrix is a tensor of its own, D[s,d]."""
    cfg = fourindex_config(global_memory="1MiB", device_memory="64KiB")
    cfg["indices"][index] = extent
    cfg["tensors"]["D"] = {"indices": ["s", "d"], "source": {"file": "in.h5", "dataset": "D", "seed": 3}}
    cfg["statements"] = [cfg["statements"][0].replace("C[s,d]", "D[s,d]")]
    return cfg


@pytest.mark.parametrize("index, extent", [("s", 10_000_000), ("d", 10_000_000), ("s", 2**40), ("d", 2**50)])
def test_huge_extents_under_small_limits_plan_in_bounded_time(index, extent, tmp_path):
    """Planning walks every tile of an index nowhere (closed-form sums, geometric tile steps):
    an extent of 10⁷ or 2⁵⁰ under small limits plans, and its plan keeps within the limits."""
    config = write_config(tmp_path, _one_huge_index(index, extent))
    proc = run_cli("plan", config, "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["plan"]["extents"][index] == extent
    peaks = data["predicted"]["memory_peak"]
    assert peaks["global"] <= 2**20 and peaks["device"] <= 2**16, peaks
