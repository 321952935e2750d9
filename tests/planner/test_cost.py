"""The predicted run time (chainexec.planner.cost): each nest's levels as a pipeline over its
outermost double-buffered loop, global memory's preparation, and loads of page-cached pages."""

from __future__ import annotations

import itertools
import math

import pytest
import yaml

from chainexec import spec
from chainexec.planner.build import make_plan
from chainexec.planner.cost import predict, predict_nests, wall
from chainexec.planner.machine import Machine
from chainexec.planner.plan import Loop, Op
from tests.conftest import busiest_counted, fourindex_config

LEVELS = {"disk": 3.0, "global<->device": 1.0, "compute": 2.0}
# the level each moving statement's seconds count in
MOVED = {"load": "disk", "store": "disk", "get": "global<->device", "accumulate": "global<->device"}


@pytest.mark.parametrize("overlapped, prepare, expected", [
    (1, 0.0, 6.0),                   # no double-buffered loop: one level after the other
    (2, 0.0, (6.0 + 3.0) / 2),       # two stages: the slowest level hides the others once
    (10**9, 0.0, 3.0),               # a long pipeline: the slowest level alone
    (4, 0.5, 0.5 + (6.0 + 9.0) / 4), # the preparation comes first
])
def test_wall_is_a_pipeline_of_the_levels(overlapped, prepare, expected):
    assert wall(LEVELS, overlapped, prepare) == pytest.approx(expected, rel=1e-9)


def _plan(global_memory: str, device_memory: str, machine: Machine, ranks: int = 1):
    s = spec.loads(yaml.safe_dump(fourindex_config(global_memory=global_memory, device_memory=device_memory)),
                   "/tmp/fourindex.yaml")
    return make_plan(s, machine, ranks=ranks)


def _overlapped(body, extents: dict[str, int], around: int = 1) -> int | None:
    """Iterations of the first double-buffered loop in ``body`` (depth first), its enclosing
    loops' iterations included, counted from the loops' tiles."""
    for node in body:
        if isinstance(node, Loop):
            count = around * math.prod(-(-extents[i] // t) for i, t in node.tiles.items())
            if node.depth >= 2:
                return count
            found = _overlapped(node.body, extents, count)
            if found is not None:
                return found
    return None


def test_one_tile_nest_runs_its_levels_one_after_the_other():
    """One tile: the levels one after the other, the host's time per statement after the compute."""
    machine = Machine()
    p = _plan("1GiB", "1GiB", machine)
    assert len(p.nests) == 1 and _overlapped(p.nests[0].body, p.extents) is None
    host = p.predicted["statements"] * machine.statement_seconds
    assert p.predicted["statements"] > 0
    assert p.predicted["total_seconds"] == pytest.approx(sum(p.predicted["seconds"].values()) + host, rel=1e-12)


@pytest.mark.parametrize("queued", [False, True])
def test_many_small_statements_cost_their_host_time(queued):
    """Tiles far smaller than the limits force: thousands of statements whose flops take less than
    their bookkeeping. The host's time per statement adds to the compute level's, or hides it
    where statements are queued on a device stream (the larger of the two)."""
    machine = Machine(statement_seconds=1.0e-3, async_statements=queued)
    p = _plan("24KiB", "3KiB", machine)
    host = p.predicted["statements"] * machine.statement_seconds
    compute = p.predicted["seconds"]["compute"]
    assert host > 10 * compute
    busy = max(compute, host) if queued else compute + host
    others = sum(t for level, t in p.predicted["seconds"].items() if level != "compute")
    assert busy <= p.predicted["total_seconds"] <= busy + others + 1e-12


def _calls(body, ranges: dict[str, int]) -> dict[str, int]:
    """Transfer calls per level of one rank's run of ``body`` within tiles of ``ranges``
    elements per index: each load, store, get and accumulate once per iteration of its enclosing
    loops, every tile of each loop visited (the last one of an index the rest of its range; none
    of the loops keeps a tile across groups)."""
    found = {"disk": 0, "global<->device": 0}
    for node in body:
        if isinstance(node, Loop):
            assert not node.kept and not node.symmetric
            sizes = {i: [min(t, ranges[i] - start) for start in range(0, ranges[i], t)] for i, t in node.tiles.items()}
            for tile in itertools.product(*sizes.values()):
                inner = _calls(node.body, ranges | dict(zip(sizes, tile)))
                found = {k: found[k] + inner[k] for k in found}
        elif node.op in MOVED:
            found[MOVED[node.op]] += 1
    return found


@pytest.mark.parametrize("memory", [("24KiB", "3KiB"), ("1GiB", "1GiB")])
def test_each_transfer_call_costs_its_host_time(memory):
    """Per get or accumulate and per load or store, the machine's per-call seconds: a level's
    seconds grow by its calls (counted here from the plan's loops) times them; the run's seconds
    count them as the host thread's, with its statements': at least their sum."""
    p = _plan(*memory, Machine())
    calls = {"disk": 0, "global<->device": 0}
    for nest in p.nests:
        found = _calls(nest.body, p.extents)
        calls = {k: calls[k] + found[k] for k in calls}
    assert calls["disk"] > 0 and calls["global<->device"] > 0
    per_call = {"disk": 2.0e-3, "global<->device": 1.0e-3}
    plain = predict(p, Machine())
    priced = predict(p, Machine(disk_call_seconds=per_call["disk"], transfer_call_seconds=per_call["global<->device"]))
    assert predict_nests(p.nests, p.tensors, p.extents, p.contractions, Machine())["calls"] == calls
    for level, n in calls.items():
        assert priced["seconds"][level] - plain["seconds"][level] == pytest.approx(n * per_call[level], rel=1e-9)
    assert priced["seconds"]["compute"] == plain["seconds"]["compute"]
    host = sum(n * per_call[level] for level, n in calls.items())
    host += priced["statements"] * Machine().statement_seconds
    assert host <= priced["total_seconds"] <= host + sum(plain["seconds"].values()) + 1e-12


@pytest.mark.parametrize("ranks", [1, 3])
def test_double_buffered_nests_are_pipelines(ranks):
    machine = Machine()
    p = _plan("24KiB", "3KiB", machine, ranks)
    expected, busy = 0.0, dict(p.predicted["seconds"])
    for nest in p.nests:
        n = _overlapped(nest.body, p.extents)
        assert n is not None and n > 1
        alone = predict_nests([nest], p.tensors, p.extents, p.contractions, machine, ranks)
        # the statements (each inside the nest's parallel loop) at the busiest rank's share
        host = alone["statements"] * busiest_counted(nest.body, p.extents, ranks) * machine.statement_seconds
        busy["compute"] += host / ranks
        levels = alone["seconds"] | {"compute": alone["seconds"]["compute"] + host}
        expected += wall({k: v / ranks for k, v in levels.items()}, n)
    assert p.predicted["total_seconds"] == pytest.approx(expected, rel=1e-12)
    assert max(busy.values()) < p.predicted["total_seconds"] < sum(busy.values())


def test_global_buffers_are_prepared_but_inputs_read_from_files():
    """One tile: the output B is the only global buffer not read from a file; its preparation
    adds its bytes at the fill rate."""
    plain, filled = (_plan("1GiB", "1GiB", Machine(global_fill=rate)).predicted for rate in (None, 2.0e9))
    b_bytes = 8 ** 4 * 8
    assert filled["seconds"] == plain["seconds"]
    assert filled["total_seconds"] - plain["total_seconds"] == pytest.approx(b_bytes / 2.0e9, rel=1e-9)


@pytest.mark.parametrize("share", [0.0, 0.25, 1.0])
def test_loads_of_page_cached_inputs_move_nothing(share):
    machine = Machine()
    p = _plan("1GiB", "1GiB", machine)
    on_disk = predict(p, machine)
    cached = predict(p, machine, cached={"A": share})
    a_bytes = 10 ** 4 * 8  # loaded once: one tile
    assert cached["bytes"] == on_disk["bytes"]
    assert on_disk["seconds"]["disk"] - cached["seconds"]["disk"] == pytest.approx(share * a_bytes / machine.disk_read,
                                                                                   rel=1e-9, abs=1e-15)
    assert cached["seconds"]["compute"] == on_disk["seconds"]["compute"]


COMPUTED = """
name: computed
ranges: {ao: 7, mo: 5}
indices: {p: ao, q: ao, r: ao, s: ao, a: mo, b: mo, c: mo, d: mo}
tensors:
  A:
    indices: [p, q, r, s]
    symmetry: {pairs: [[p, q], [r, s]], exchange: true}
    layout: s8
    source: {compute: pyscf.int2e, atoms: "O 0 0 0.1173; H 0 0.7572 -0.4692; H 0 -0.7572 -0.4692", basis: sto-3g%s}
  C: {indices: [p, a], source: {file: in.h5, dataset: C}}
statements:
- B[a,b,c,d] = C[p,a] * C[q,b] * C[r,c] * C[s,d] * A[p,q,r,s]
outputs: {B: {file: out.h5, dataset: B}}
machine: {global_memory: 1GiB, device_memory: 1GiB}
"""


def test_computed_source_loads_at_its_stated_rate():
    """The integrals of a computed source, loaded once (one tile), at the config's
    ``bytes_per_second`` instead of the disk's read rate; the bytes are the same."""
    machine = Machine()
    read, stated = (make_plan(spec.loads(COMPUTED % extra, "/tmp/computed.yaml"), machine).predicted
                    for extra in ("", ", bytes_per_second: 2000000.0"))
    npair = 7 * 8 // 2
    a_bytes = npair * (npair + 1) // 2 * 8
    assert read["bytes"] == stated["bytes"]
    assert stated["seconds"]["disk"] - read["seconds"]["disk"] == pytest.approx(
        a_bytes / 2.0e6 - a_bytes / machine.disk_read, rel=1e-9)


def _by_level(by_statement: dict[str, float]) -> dict[str, float]:
    """Per-statement seconds (:func:`predict`'s ``by_statement``) added up per level."""
    found = dict.fromkeys(LEVELS, 0.0)
    for name, seconds in by_statement.items():
        found[MOVED.get(name.split()[0], "compute")] += seconds
    return found


@pytest.mark.parametrize("memory, ranks, cached, pinned_from", [
    (("1GiB", "1GiB"), 1, 0.0, 4 << 30), (("24KiB", "3KiB"), 1, 0.5, 4 << 30), (("24KiB", "3KiB"), 3, 0.0, 4 << 30),
    (("24KiB", "3KiB"), 3, 0.0, 0)])
def test_statement_seconds_add_up_to_the_levels(memory, ranks, cached, pinned_from):
    """Each statement's predicted seconds (all ranks together), summed per level, are the level's
    seconds: the report sets them beside the statements the runtime times."""
    machine = Machine(device_bandwidth=5.0e10, disk_write_cached=4.0e9, write_cache_bytes=4096,
                      host_to_device=3.0e10, device_to_host=2.0e10, pinned_from_bytes=pinned_from,
                      transfer_call_seconds=3.0e-5, disk_call_seconds=7.0e-5)
    p = predict(_plan(*memory, machine, ranks), machine, ranks, cached={"A": cached})
    assert {name.split()[0] for name in p["by_statement"]} >= {"load", "store", "get", "accumulate"}
    assert _by_level(p["by_statement"]) == pytest.approx({k: v * ranks for k, v in p["seconds"].items()}, rel=1e-12)


def test_statement_seconds_of_a_computed_source():
    machine = Machine()
    p = make_plan(spec.loads(COMPUTED % ", bytes_per_second: 2000000.0", "/tmp/computed.yaml"), machine).predicted
    npair = 7 * 8 // 2
    assert p["by_statement"]["load A"] == pytest.approx(npair * (npair + 1) // 2 * 8 / 2.0e6, rel=1e-12)
    assert _by_level(p["by_statement"]) == pytest.approx(p["seconds"], rel=1e-12)


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_plan_pins_from_the_machines_bytes_per_rank(ranks):
    """``Plan.pinned``, what a GPU run's host buffers are: page-locked where the run moves at
    least ``pinned_from_bytes`` between global and device memory per rank."""
    moved = _plan("24KiB", "3KiB", Machine(), ranks).predicted["bytes"]
    per_rank = (moved["global->device"] + moved["device->global"]) // ranks
    for threshold, expected in ((per_rank, True), (per_rank + 1, False), (0, True)):
        assert _plan("24KiB", "3KiB", Machine(pinned_from_bytes=threshold), ranks).pinned is expected


def test_a_pinned_plan_moves_global_arrays_at_the_page_locked_rates():
    """One tile: the output B goes back from the device by DMA into its locked global array at
    ``device_to_host``; the inputs' tiles, mapped from their files or read into global memory,
    go through a staging copy at ``global_to_device`` whether or not the run pins. Unpinned,
    every transfer is staged."""
    rates = dict(global_to_device=1.0e10, device_to_global=8.0e9, host_to_device=4.0e10, device_to_host=3.0e10)
    plain, locked = (_plan("1GiB", "1GiB", Machine(**rates, pinned_from_bytes=b)) for b in (1 << 50, 0))
    assert (plain.pinned, locked.pinned) == (False, True)
    assert plain.predicted["bytes"] == locked.predicted["bytes"]
    b_bytes = locked.predicted["bytes"]["device->global"]
    assert b_bytes == 8 ** 4 * 8
    assert plain.predicted["by_statement"]["accumulate B"] == pytest.approx(b_bytes / 8.0e9, rel=1e-12)
    assert locked.predicted["by_statement"]["accumulate B"] == pytest.approx(b_bytes / 3.0e10, rel=1e-12)
    gets = {k: v for k, v in locked.predicted["by_statement"].items() if k.startswith("get ")}
    assert len(gets) >= 2 and gets == {k: plain.predicted["by_statement"][k] for k in gets}
    assert sum(gets.values()) == pytest.approx(locked.predicted["bytes"]["global->device"] / 1.0e10, rel=1e-12)
    # a machine without measured page-locked rates prices a pinned run's transfers as staged
    unmeasured = _plan("1GiB", "1GiB", Machine(global_to_device=1.0e10, device_to_global=8.0e9, pinned_from_bytes=0))
    assert unmeasured.pinned and unmeasured.predicted["seconds"] == plain.predicted["seconds"]


@pytest.mark.parametrize("global_memory, device_memory, n, nmo", [("24KiB", "3KiB", 10, 8), ("64KiB", "64KiB", 10, 8),
                                                               ("128KiB", "32KiB", 12, 10)])
def test_a_pinned_plan_moves_by_dma_only_the_tiles_in_one_piece_of_host_memory(global_memory, device_memory, n, nmo):
    """Each get and accumulate of a pinned plan is priced at the page-locked DMA rates where its
    device tile is one piece of its global buffer, found here from the plan's loops: every index
    past the first whole in the tile, the buffer's extents those of the global loop it is
    allocated in (a buffer allocated outside the global loops is whole: ``_s0_1`` in the
    transform's first nest, whose global loop tiles it), an accumulate fresh, not an input read
    from its file. Any other at the staged rates, as a plain plan prices them all."""
    rates = dict(global_to_device=1.0e10, device_to_global=8.0e9, host_to_device=4.0e10, device_to_host=3.0e10)
    config = fourindex_config(n=n, nmo=nmo, global_memory=global_memory, device_memory=device_memory)
    plain, locked = (make_plan(spec.loads(yaml.safe_dump(config), "/tmp/fourindex.yaml"),
                               Machine(**rates, pinned_from_bytes=b)) for b in (1 << 50, 0))
    assert (plain.pinned, locked.pinned) == (False, True)
    one_piece = {}

    def walk(body, tiles, held):
        for node in body:
            if isinstance(node, Loop):
                inner = {i: min(tiles.get(i, locked.extents[i]), t) for i, t in node.tiles.items()}
                walk(node.body, {**tiles, **inner}, held)
            elif node.op == "alloc" and node.level == "global":
                held[node.tensor, tuple(node.indices)] = {i: tiles.get(i, locked.extents[i]) for i in node.indices}
            elif node.op in ("get", "accumulate"):
                buffer = held[node.tensor, tuple(node.indices)]
                whole = all(tiles.get(i, locked.extents[i]) >= buffer[i] for i in node.indices[1:])
                piece = whole and not locked.tensors[node.tensor].from_file() and (node.op == "get" or node.fresh)
                one_piece.setdefault(f"{node.op} {node.tensor}", set()).add(piece)

    for nest in locked.nests:
        walk(nest.body, {}, {})
    assert {name.split()[0] for name in one_piece} >= {"get", "accumulate"}
    staged, dma = plain.predicted["by_statement"], locked.predicted["by_statement"]
    for name, pieces in one_piece.items():
        assert len(pieces) == 1, name  # (each statement once in these plans)
        ratio = (1.0e10 / 4.0e10 if name.startswith("get") else 8.0e9 / 3.0e10) if pieces == {True} else 1.0
        assert dma[name] == pytest.approx(staged[name] * ratio, rel=1e-12), name
    if (global_memory, device_memory) == ("64KiB", "64KiB"):  # the case the global loop's tiles hid
        assert one_piece["accumulate _s0_1"] == {False} and one_piece["get _s0_1"] == {False}
    whole = _plan("1GiB", "1GiB", Machine(**rates, pinned_from_bytes=0)).predicted["by_statement"]
    assert whole["accumulate B"] == pytest.approx(8 ** 4 * 8 / 3.0e10, rel=1e-12)


@pytest.mark.parametrize("op, fresh, loop, from_file, locked, dma", [
    ("accumulate", True, {}, False, False, True),
    ("accumulate", None, {}, False, False, False),  # added to what the patch holds: on the host
    ("accumulate", True, {"symmetric": ["i", "j"]}, False, False, False),  # scaled by the tuple's weight
    ("accumulate", True, {"back": [["T", ["i", "j", "k"]]], "depth": 2}, False, False, False),  # copied aside
    ("get", None, {}, False, False, True),
    ("get", None, {}, True, False, False),  # an input's tile read from its file
    ("get", None, {}, True, True, True),  # ... whose mapping the run locks
])
def test_dma_transfers_are_the_tiles_the_backend_copies_in_one_piece(op, fresh, loop, from_file, locked, dma):
    """:func:`chainexec.planner.cost.dma_transfer` for a device tile of whole rows (tiled along its
    first index alone) and, for each case, the same tile cut along its second index: never."""
    from chainexec.planner.cost import dma_transfer

    node = Op(op, "device", "T", ["i", "j", "k"], fresh=fresh)
    extents = {"i": 8, "j": 6, "k": 4}
    loops = [Loop("device", {"i": 2}, parallel=True, **loop)]
    rows = {"global": {}, "device": {"i": 2}}
    assert dma_transfer(node, loops, rows, extents, from_file, locked) is dma
    assert dma_transfer(node, loops, {"global": {}, "device": {"i": 2, "j": 3}}, extents, from_file, locked) is False


def _loops(body):
    """Every loop in ``body``, outermost first."""
    for node in body:
        if isinstance(node, Loop):
            yield node
            yield from _loops(node.body)


def test_a_pinned_plan_locks_its_global_arrays_once_each():
    """One tile: B, the only global buffer not read from a file, is prepared at the fill rate and,
    in a pinned plan, also page-locked at ``host_lock`` before its first transfer."""
    rates = dict(global_fill=2.0e9, host_lock=4.0e9)
    plain, locked = (_plan("1GiB", "1GiB", Machine(**rates, pinned_from_bytes=b)).predicted for b in (1 << 50, 0))
    unlocked = _plan("1GiB", "1GiB", Machine(global_fill=2.0e9)).predicted
    b_bytes = 8 ** 4 * 8
    assert plain["total_seconds"] == pytest.approx(unlocked["total_seconds"], rel=1e-12)
    assert locked["total_seconds"] - plain["total_seconds"] == pytest.approx(
        b_bytes / 4.0e9 + locked["seconds"]["global<->device"] - plain["seconds"]["global<->device"], rel=1e-9)


@pytest.mark.parametrize("pinned_from", [0, 1 << 50])
def test_mapped_inputs_reach_the_device_at_their_own_rate_in_a_pinned_plan(pinned_from):
    """An input whose loads map its file (one the page-cache shares name) goes to the device
    through the staging buffers at ``mapped_to_device`` in a pinned plan; in a plan that does not
    pin, at ``global_to_device`` as any staged tile."""
    machine = Machine(global_to_device=1.0e10, mapped_to_device=4.0e9, pinned_from_bytes=pinned_from)
    p = _plan("1GiB", "1GiB", machine)
    inputs = {name: 0.0 for name, t in p.tensors.items() if t.from_file()}
    assert "A" in inputs
    staged, mapped = predict(p, machine), predict(p, machine, cached=inputs)
    a_bytes = 10 ** 4 * 8
    assert staged["by_statement"]["get A"] == pytest.approx(a_bytes / 1.0e10, rel=1e-12)
    assert mapped["by_statement"]["get A"] == pytest.approx(a_bytes / (4.0e9 if p.pinned else 1.0e10), rel=1e-12)


def test_mapped_inputs_fetched_many_times_their_size_are_locked(tmp_path):
    """(T) at o=6, v=10 with 96 KiB of device memory fetches ``ovvv`` tile by tile, several times
    its size: in a pinned plan the planner names it among the inputs to lock in place
    (:func:`chainexec.planner.cost.locked_inputs`), whose gets are then priced by DMA at
    ``mapped_locked_to_device`` (else ``host_to_device``), and whose lock (every rank locks the
    whole mapping) at ``host_lock``
    joins the nest's preparation. Inputs fetched once (whole on the device before the loop, with
    320 KiB at o=8) save less than their locks cost and are not named; nothing is named without
    the rates, where the plan is not pinned, or where locking is too slow to repay."""
    import dataclasses

    from chainexec.planner.cost import locked_inputs
    from tests.conftest import triples_config

    machine = Machine(global_to_device=1.0e10, mapped_to_device=2.0e10, host_to_device=5.0e10, host_lock=2.0e10,
                      pinned_from_bytes=0)
    p = make_plan(spec.load(triples_config(tmp_path, "96KiB", 6, 10)), machine)
    assert p.pinned
    cached = {name: 1.0 for name, t in p.tensors.items() if t.from_file()}
    named = locked_inputs(p, machine, 1, cached)
    assert "ovvv" in named
    # t2's tiles are cut along its second index (t2[k,j,...] in tiles of j): never whole rows of
    # the mapping, so always gathered through the staging buffers, and not worth locking
    assert "t2" not in named
    as_staged = predict(dataclasses.replace(p, locked=["t2"]), machine, cached=cached)["by_statement"]
    assert as_staged["get t2"] == predict(p, machine, cached=cached)["by_statement"]["get t2"]
    whole = make_plan(spec.load(triples_config(tmp_path / "whole", "320KiB", 8, 10)), machine)
    assert whole.pinned and locked_inputs(whole, machine, 1, cached) == []
    assert locked_inputs(p, dataclasses.replace(machine, host_lock=1.0e3), 1, cached) == []
    assert locked_inputs(p, dataclasses.replace(machine, host_to_device=None), 1, cached) == []
    assert locked_inputs(dataclasses.replace(p, pinned=False), machine, 1, cached) == []
    plain = predict(p, machine, cached=cached)
    locked = predict(dataclasses.replace(p, locked=named), machine, cached=cached)
    ovvv = p.tensors["ovvv"]
    fetched = plain["by_statement"]["get ovvv"] * 2.0e10
    assert locked["by_statement"]["get ovvv"] == pytest.approx(fetched / 5.0e10, rel=1e-12)
    assert locked["bytes"] == plain["bytes"]
    # where measured, the DMA from the locked page cache is priced at its own rate
    direct = dataclasses.replace(machine, mapped_locked_to_device=3.5e10)
    assert predict(dataclasses.replace(p, locked=named), direct, cached=cached)["by_statement"]["get ovvv"] \
        == pytest.approx(fetched / 3.5e10, rel=1e-12)
    held = ovvv.itemsize * math.prod(ovvv.shape)
    assert fetched / 2.0e10 - fetched / 5.0e10 > held / 2.0e10


@pytest.mark.parametrize("nocc, nvir, device_memory, tiled", [(7, 12, "1GiB", False), (5, 9, "96KiB", True)])
def test_an_orbit_kernel_costs_its_points_bytes_at_the_orbit_bandwidth(tmp_path, nocc, nvir, device_memory, tiled):
    """The (T) energy, a fused reduction with a reused value, takes at least the points its
    kernel visits (in a loop over i, j, k tiles the ordered ones, C(o+2, 3)·v³: i ≤ j ≤ k; as one
    tile every one, o³·v³) times the bytes per point its orbit kernel moves
    through L1 and shared memory (:func:`chainexec.kernels.orbits.fused_point_bytes`, at the
    plan's device tile) over ``orbit_bandwidth``; every other statement is priced as without the
    rate, as is the energy where that rate is so high that its roofline time is the larger."""
    import dataclasses

    from chainexec.kernels import orbits
    from chainexec.planner.plan import ops
    from tests.conftest import triples_config

    machine = Machine(device_bandwidth=3.0e12, flop_rate=5.0e13, async_statements=True)
    p = make_plan(spec.load(triples_config(tmp_path, device_memory, nocc, nvir)), machine)
    fused = [(op, loops) for nest in p.nests for op, loops in ops(nest.body) if op.op == "fused" and op.expression.lets]
    assert len(fused) == 1
    op, loops = fused[0]
    f = op.expression
    tile = {i: n for loop in loops if loop.level == "device" for i, n in loop.tiles.items()}
    per_point = orbits.fused_point_bytes(f, {i: tile.get(i, p.extents[i]) for i in f.domain},
                                         {t: info.dtype for t, info in p.tensors.items()})
    assert per_point > 0
    assert any(loop.symmetric for loop in loops) == tiled
    points = (math.comb(nocc + 2, 3) if tiled else nocc ** 3) * nvir ** 3
    base = predict(p, machine)["by_statement"]
    (name,) = [k for k in base if k.startswith("fused E")]
    slow = predict(p, dataclasses.replace(machine, orbit_bandwidth=1.0e6))["by_statement"]
    assert slow[name] == pytest.approx(points * per_point / 1.0e6, rel=1e-12)
    assert slow[name] > base[name]
    assert {k: v for k, v in slow.items() if k != name} == {k: v for k, v in base.items() if k != name}
    assert predict(p, dataclasses.replace(machine, orbit_bandwidth=1.0e30))["by_statement"] == base


@pytest.mark.parametrize("extent, outer, inner, ranks, expected", [
    (16, 8, 2, 4, 1.0),  # 4 tiles a run: one each
    (14, 7, 1, 4, 8 / 7),  # 7 tiles a run: the busiest rank takes 2 where the mean is 7/4
    (8, 2, 2, 4, 4.0),  # 1 tile a run: three ranks wait at its barrier
    (12, 12, 4, 1, 1.0),  # one rank
])
def test_a_parallel_loops_busiest_rank_takes_the_ceiling_of_a_runs_tiles(extent, outer, inner, ranks, expected):
    from chainexec.planner.cost import busiest_share

    loop = Loop("device", {"i": inner}, parallel=True)
    assert busiest_share(loop, [Loop("global", {"i": outer}, body=[loop])], {"i": extent}, ranks) == pytest.approx(
        expected, rel=1e-12)
