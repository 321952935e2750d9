"""End to end: the four-index transform on 1–4 ranks equals numpy.einsum and moves exactly the
predicted bytes; the plan really tiles at both levels."""

from __future__ import annotations

import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from chainexec import spec
from chainexec.planner.build import make_plan
from chainexec.planner.cost import parallel_tiles
from chainexec.planner.machine import Machine
from chainexec.planner.plan import Loop, ops
from tests.conftest import fourindex_config, read_report, run_cli, write_config


def _tiled_levels(plan) -> set[str]:
    levels = set()

    def walk(body):
        for node in body:
            if isinstance(node, Loop):
                if node.tiles:
                    levels.add(node.level)
                walk(node.body)

    for nest in plan.nests:
        walk(nest.body)
    return levels


@pytest.fixture(scope="module")
def fourindex(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fourindex")
    config = write_config(folder, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    return config


def test_plan_tiles_at_both_levels(fourindex):
    plan = make_plan(spec.load(fourindex))
    assert _tiled_levels(plan) == {"global", "device"}
    # Out of core: the disk traffic of the global loops overlaps their work (two buffers each).
    assert any(loop.depth == 2 for nest in plan.nests for _, loops in ops(nest.body) for loop in loops)
    assert plan.predicted["memory_peak"]["global"] <= plan.memory_limit["global"]
    assert plan.predicted["memory_peak"]["device"] <= plan.memory_limit["device"]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_fourindex_matches_einsum_and_prediction(fourindex, ranks):
    report = fourindex.parent / f"report{ranks}.json"
    proc = run_cli("run", fourindex, "--report-json", report, ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    result = read_report(report)
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    assert result["measured"]["memory_peak"] == result["predicted"]["memory_peak"]
    assert result["measured"]["flops"] == result["predicted"]["flops"]
    assert result["run"]["ranks"] == ranks
    with h5py.File(fourindex.parent / "out" / "result.h5", "r") as f:
        assert f.attrs["chainexec_complete"]
        assert f["B"].attrs["indices"] == "a,b,c,d"
        assert list(f["B"].attrs["extents"]) == [8, 8, 8, 8]
    check_fourindex(fourindex.parent)


def check_fourindex(folder: Path) -> None:
    """The small four-index transform's output in ``folder`` equals numpy.einsum's of its inputs."""
    with h5py.File(folder / "in.h5", "r") as f:
        a, c = f["A"][...], f["C"][...]
    expected = np.einsum("pa,qb,rc,sd,pqrs->abcd", c, c, c, c, a)
    with h5py.File(folder / "out" / "result.h5", "r") as f:
        got = f["B"][...]
    assert np.max(np.abs(got - expected)) <= 1e-12 * np.max(np.abs(expected))


def fourindex_copied_back(folder: Path, ranks: int, backend: str = "numpy") -> None:
    """The small four-index transform with 12 KiB of device memory on ``ranks`` ranks (3 or
    more): both tile loops copy their results back aside (``Loop.back``; a machine file lets
    tiles of any size take that path); the result equals numpy.einsum's, movement and peaks the
    plan's."""
    config = write_config(folder, fourindex_config(device_memory="12KiB"))
    machine = folder / "machine.json"
    machine.write_text(Machine(aside_copy_bytes=0).to_json())
    plan = make_plan(spec.load(config), Machine(aside_copy_bytes=0), ranks=ranks)
    backs = [loop.back for nest in plan.nests for _, loops in ops(nest.body) for loop in loops
             if loop.level == "device"]
    assert {tuple(b[0][1]) for b in backs if b} == {("c", "d", "p", "q"), ("a", "b", "c", "d")}
    assert run_cli("generate", config).returncode == 0
    proc = run_cli("run", config, "--backend", backend, "--machine", machine, "--report-json", folder / "r.json",
                   ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = read_report(folder / "r.json")
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    assert result["measured"]["memory_peak"] == result["predicted"]["memory_peak"]
    check_fourindex(folder)


def test_results_copied_back_aside_on_several_ranks(tmp_path):
    fourindex_copied_back(tmp_path, 3)


def test_run_without_mpiexec_is_one_rank(fourindex):
    proc = run_cli("run", fourindex)
    assert proc.returncode == 0, proc.stderr
    assert "MISMATCH" not in proc.stdout
    check = run_cli("verify", fourindex)
    assert check.returncode == 0 and " ok" in check.stdout, check.stdout + check.stderr


def test_disk_statements_are_timed(fourindex):
    """Every load and store of the plan has the disk worker's seconds in the report's statements,
    and on one rank they add up to the disk level's seconds."""
    report = fourindex.parent / "report-disk.json"
    proc = run_cli("run", fourindex, "--report-json", report)
    assert proc.returncode == 0, proc.stderr
    result = read_report(report)
    disk = {name: s for name, s in result["measured"]["by_statement"].items() if name.split()[0] in ("load", "store")}
    planned = {f"{op.op} {op.tensor}" for nest in make_plan(spec.load(fourindex)).nests for op, _ in ops(nest.body)
               if op.op in ("load", "store")}
    assert set(disk) == planned and {name.split()[0] for name in planned} == {"load", "store"}
    assert all(s > 0 for s in disk.values())
    assert sum(disk.values()) == pytest.approx(result["measured"]["seconds"]["disk"], rel=1e-9)


@pytest.mark.parametrize("job", ["fourindex", "ccsd_t"])
def test_every_timed_statement_is_predicted(fourindex, tmp_path, job):
    """The report sets each statement's measured seconds beside its predicted ones: the runtime
    times statements under the names the plan predicts, loads and stores, transfers, contractions,
    the runs of (T)'s W terms and its fused energy statement alike."""
    config = fourindex
    if job == "ccsd_t":
        assert run_cli("chem", "synthetic", "--synthetic", 3, 7, 2, "--out", tmp_path).returncode == 0
        config = tmp_path / "ccsd_t.yaml"
    report = tmp_path / "report.json"
    proc = run_cli("run", config, "--report-json", report)
    assert proc.returncode == 0, proc.stderr
    result = read_report(report)
    measured, predicted = result["measured"]["by_statement"], result["predicted"]["by_statement"]
    assert set(measured) == set(predicted)
    kinds = {name.split()[0][0] if name.startswith("#") else name.split()[0] for name in measured}
    assert kinds == ({"load", "store", "get", "accumulate", "#"} | ({"fused", "eval"} if job == "ccsd_t" else set()))


@pytest.mark.parametrize("balance", ["static", "dynamic"])
def test_load_balance_modes(fourindex, balance):
    """Tiles handed out round-robin or through the shared counter: same bytes, same result, every
    parallel tile done exactly once over the ranks."""
    report = fourindex.parent / f"report-{balance}.json"
    began = time.perf_counter()
    proc = run_cli("run", fourindex, "--balance", balance, "--report-json", report, ranks=3)
    wall = time.perf_counter() - began
    assert proc.returncode == 0, proc.stderr
    result = read_report(report)
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    per_rank = result["run"]["per_rank"]
    assert [r["rank"] for r in per_rank] == [0, 1, 2]
    plan = make_plan(spec.load(fourindex))
    expected = executions = 0

    def iterations(loops) -> int:
        """Times the innermost of ``loops`` runs its body, enumerated over all their tiles."""
        n = 1
        for i in {i for loop in loops for i in loop.tiles}:
            ranges = [(0, plan.extents[i])]
            for loop in loops:
                if i in loop.tiles:
                    ranges = [(s, min(s + loop.tiles[i], b)) for a, b in ranges for s in range(a, b, loop.tiles[i])]
            n *= len(ranges)
        return n

    def count(body, loops):
        nonlocal expected, executions
        for node in body:
            if isinstance(node, Loop):
                if node.parallel:
                    expected += iterations(loops + [node])
                    executions += iterations(loops)
                count(node.body, loops + [node])

    for nest in plan.nests:
        count(nest.body, [])
    assert sum(r["tiles"] for r in per_rank) == expected == parallel_tiles(plan)
    if balance == "static":  # round-robin: at most one tile apart per execution of a parallel loop
        assert max(r["tiles"] for r in per_rank) - min(r["tiles"] for r in per_rank) <= executions
    assert all(r["busy_seconds"] >= 0 and r["idle_seconds"] >= 0 for r in per_rank)
    # each rank's start (process start to executor start) lies within the launcher's wall time, and
    # the report's seconds per level are the busiest rank's
    assert all(0 < r["start_seconds"] < wall for r in per_rank)
    assert {level: max(r["level_seconds"][level] for r in per_rank) for level in result["measured"]["seconds"]} \
        == result["measured"]["seconds"]
    with h5py.File(fourindex.parent / "in.h5", "r") as f:
        a, c = f["A"][...], f["C"][...]
    expected_b = np.einsum("pa,qb,rc,sd,pqrs->abcd", c, c, c, c, a)
    with h5py.File(fourindex.parent / "out" / "result.h5", "r") as f:
        got = f["B"][...]
    assert np.max(np.abs(got - expected_b)) <= 1e-12 * np.max(np.abs(expected_b))


def test_progress_lines(fourindex):
    """Off a terminal, rank 0 logs one line per nest on stderr, ending at all tiles; --quiet is silent."""
    plan = make_plan(spec.load(fourindex))
    proc = run_cli("run", fourindex, ranks=2)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("chainexec: nest ")]
    assert len(lines) == len(plan.nests)
    total = parallel_tiles(plan)
    assert f"nest {len(plan.nests)}/{len(plan.nests)}, tiles {total}/{total}," in lines[-1]
    quiet = run_cli("run", fourindex, "--quiet", ranks=2)
    assert quiet.returncode == 0 and "chainexec: nest" not in quiet.stderr


def test_run_prices_page_cached_inputs_as_loads_that_move_nothing(tmp_path):
    """The same one-tile run with its input file dropped from the page cache and then read into
    it: the second predicts the disk level as its writes alone (the built-in rates); the
    bytes, and so the measured movement, do not change."""
    import os

    from chainexec import api

    config = write_config(tmp_path, fourindex_config(global_memory="1GiB", device_memory="1GiB"))
    assert run_cli("generate", config).returncode == 0
    path = tmp_path / "in.h5"
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    dropped = api.run(config, backend="numpy")
    path.read_bytes()
    cached = api.run(config, backend="numpy")
    machine = Machine()
    moved = cached["predicted"]["bytes"]
    assert moved == dropped["predicted"]["bytes"] == cached["measured"]["bytes"]
    assert cached["predicted"]["seconds"]["disk"] == pytest.approx(machine.write_seconds(moved["global->disk"]), rel=1e-12)
    assert dropped["predicted"]["seconds"]["disk"] > cached["predicted"]["seconds"]["disk"]
