"""Spreading a plan's parallel loops over ranks (``make_plan(..., ranks)``), and the memory peaks
that fitting tiles counts alone (``Context.peaks``) against the full price's.

Iterations are counted on the emitted plan, independently of the planner: each parallel loop's
tiles against the range its enclosing global loops leave (their first, full tile)."""

import functools
import itertools
import math
from pathlib import Path

import pytest

from chainexec import spec
from chainexec.planner import build
from chainexec.planner.build import make_plan
from chainexec.planner.cost import predict_nests
from chainexec.planner.machine import Machine
from chainexec.planner.plan import Loop, ops
from tests.conftest import busiest_counted, read_report, run_cli

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def parallel_loops(plan) -> list[tuple[int, dict]]:
    """(iterations, tiles) of every parallel loop of the plan, in nest order."""
    found = []

    def walk(body, span):
        for node in body:
            if not isinstance(node, Loop):
                continue
            inner = dict(span)
            if node.parallel:
                counts = {i: -(-span[i] // t) for i, t in node.tiles.items()}
                sym = node.symmetric
                # A symmetric loop visits ordered tuples of its indices' tile positions only.
                ordered = math.comb(counts[sym[0]] + len(sym) - 1, len(sym)) if sym else 1
                found.append((ordered * math.prod(n for i, n in counts.items() if i not in sym), node.tiles))
            if node.level == "global":
                inner.update({i: min(t, span[i]) for i, t in node.tiles.items()})
            walk(node.body, inner)

    for nest in plan.nests:
        walk(nest.body, dict(plan.extents))
    return found


def parallel_iterations(plan) -> list[int]:
    return [n for n, _ in parallel_loops(plan)]


@functools.cache
def _one_rank(config: str, marked: bool):
    """A config's plan for one rank, its runs symmetrized (``marked``) or not (``build.mark`` a
    no-op): the same for every rank count it is compared with, so planned once per worker."""
    s = spec.load(CONFIGS / config)
    if marked:
        return make_plan(s)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "mark", lambda *args: None)
        return make_plan(s)


@pytest.mark.parametrize("config", ["ccsd_t.yaml", "fourindex.yaml", "expr_d.yaml"])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_parallel_loops_get_a_tile_per_rank(config, ranks, monkeypatch):
    """A loop with enough iterations is left alone; a shorter one is cut to at least one tile per
    rank, or to unit tiles; both levels still fit. The flops are the same, except that cutting
    the (T) loop over i, j, k makes it visit ordered tiles only (its energy is symmetric in them).
    That holds for the plans before their runs are symmetrized (:mod:`chainexec.planner.symmetry`;
    the (T) plan of one tile symmetrizes W over the whole cube, the cut one cannot where the cut
    splits a, b, c); symmetrizing never adds flops."""
    s = spec.load(CONFIGS / config)
    marked = _one_rank(config, True), make_plan(s, ranks=ranks)
    monkeypatch.setattr(build, "mark", lambda *args: None)
    one, many = _one_rank(config, False), make_plan(s, ranks=ranks)
    assert all(m.predicted["flops"] <= p.predicted["flops"] for m, p in zip(marked, (one, many)))
    pairs = list(zip(parallel_iterations(one), parallel_loops(many)))
    assert len(pairs) == len(parallel_iterations(many)) > 0
    for n_one, (n_many, tiles) in pairs:
        if n_one >= ranks:
            assert n_many == n_one
        else:
            assert n_many >= ranks or all(t == 1 for t in tiles.values())
    symmetric = any(loop.symmetric for p in (one, many) for nest in p.nests for _, loops in ops(nest.body)
                    for loop in loops)
    if symmetric:
        assert many.predicted["flops"] <= one.predicted["flops"]
    else:
        assert many.predicted["flops"] == one.predicted["flops"]
    for level in ("global", "device"):
        assert many.predicted["memory_peak"][level] <= many.memory_limit[level]


def test_triples_on_four_ranks_is_split_and_everyone_works(tmp_path):
    """H2O-sized (T): planned for 4 ranks its fused loop has at least 4 tiles (ordered i >= j >= k
    tiles, E being symmetric), and a 4-rank run gives every rank a tile, bytes as predicted."""
    s = spec.load(CONFIGS / "ccsd_t.yaml")
    (n,) = parallel_iterations(make_plan(s, ranks=4))
    assert n >= 4
    assert run_cli("chem", "synthetic", "--synthetic", 5, 19, 3, "--out", tmp_path).returncode == 0
    proc = run_cli("run", tmp_path / "ccsd_t.yaml", "--report-json", tmp_path / "r.json", ranks=4)
    assert proc.returncode == 0, proc.stderr
    report = read_report(tmp_path / "r.json")
    assert report["measured"]["bytes"] == report["predicted"]["bytes"]
    assert all(r["tiles"] >= 1 for r in report["run"]["per_rank"])


def test_predicted_seconds_are_the_busiest_ranks():
    """Bytes and flops are totals over the ranks; each level's predicted seconds are the ranks
    working at once at the machine's per-rank rates, the busiest rank's: a nest's one-rank time
    of the same amounts divided by the rank count, times its parallel loop's ⌈T/R⌉·R/T for T
    tiles a run (counted here by walking the runs)."""
    s = spec.load(CONFIGS / "fourindex.yaml")
    machine = Machine()
    plan = make_plan(s, machine, ranks=3)
    p = plan.predicted
    expected = dict.fromkeys(("global<->device", "compute"), 0.0)
    shares = []
    for nest in plan.nests:
        one = predict_nests([nest], plan.tensors, plan.extents, plan.contractions, machine, 3)
        alone = predict_nests([nest], plan.tensors, plan.extents, plan.contractions, machine, 1)
        # the defaults have no device bandwidth: compute is the flops' time
        moves = (one["bytes"]["global->device"] / machine.global_to_device
                 + one["bytes"]["device->global"] / machine.device_to_global)
        assert alone["seconds"]["global<->device"] == pytest.approx(
            (alone["bytes"]["global->device"] / machine.global_to_device
             + alone["bytes"]["device->global"] / machine.device_to_global), rel=1e-12)
        share = busiest_counted(nest.body, plan.extents, 3)
        shares.append(share)
        expected["global<->device"] += share * moves / 3
        expected["compute"] += share * machine.compute_seconds(one["flops"], one["streamed"]) / 3
    assert max(shares) > 1  # a run whose tiles the 3 ranks do not share evenly
    assert {k: p["seconds"][k] for k in expected} == pytest.approx(expected, rel=1e-12)


def test_split_that_would_overflow_the_device_is_not_taken():
    """Found in review: cutting i splits the buffer V[i,k] and V[j,k] shared while i was whole,
    and the device peak rose 45 % over the limit. A step that does not fit is undone."""
    text = """
indices: {i: 48, j: 48, k: 2048, l: 48}
tensors:
  V: {indices: [i, k], source: {random: 1}}
  W: {indices: [j, l], source: {random: 2}}
statements:
  - U[i,l] = V[i,k] * V[j,k] * W[j,l]
outputs:
  U: {file: u.h5, dataset: U}
machine: {global_memory: 64MiB, device_memory: 800KiB}
"""
    s = spec.loads(text, "/tmp/u.yaml")
    one = make_plan(s)
    for ranks in (2, 4, 8):
        many = make_plan(s, ranks=ranks)
        assert many.predicted["memory_peak"]["device"] <= many.memory_limit["device"]
        assert many.predicted["flops"] == one.predicted["flops"]


@pytest.mark.parametrize("config", ["fourindex", "expr_d_small", "triples"])
def test_memory_peaks_alone_equal_the_priced_ones(config, tmp_path):
    """``Context.peaks`` (what fitting tiles asks at every halving, counted without movement or
    flops) equals the memory peaks of the full price, on every step of halving every fused
    group's tiles, for every way of cutting the chain into fused groups."""
    import copy

    from chainexec.planner.build import contractions
    from chainexec.planner.choose import compositions
    from chainexec.planner.nest import DeviceGroup, DiskGroup, Schedule
    from chainexec.planner.schedule import Context, _halve
    from tests.conftest import fourindex_config, write_config

    if config == "fourindex":
        s = spec.load(write_config(tmp_path, fourindex_config(n=12, nmo=10, global_memory="96KiB",
                                                             device_memory="8KiB")))
    elif config == "expr_d_small":
        text = (CONFIGS / "expr_d.yaml").read_text().replace("N: 40", "N: 5").replace("32GiB", "64KiB")
        s = spec.loads(text.replace("1GiB", "6KiB"), str(CONFIGS / "expr_d.yaml"))
    else:
        text = (CONFIGS / "ccsd_t.yaml").read_text().replace("occ: 5", "occ: 4").replace("vir: 19", "vir: 7")
        s = spec.loads(text.replace("256MiB", "96KiB"), str(CONFIGS / "ccsd_t.yaml"))
    cs, tensors, _ = contractions(s)
    limits = {"global": s.machine.global_memory, "device": s.machine.device_memory}
    alone, priced = (Context(cs, tensors, s.extents, limits, Machine()) for _ in range(2))
    ids = [c.id for c in cs]
    checked = 0
    cuts = (compositions(ids) if len(ids) <= 8 else
            [[ids], [[k] for k in ids], [ids[:12], ids[12:24], ids[24:]], [ids[:24], ids[24:]]])
    for parts in cuts:
        groups = [DeviceGroup(list(g), {i: s.extents[i] for i in alone.emitter().group_common(g)},
                              {i: s.extents[i] for c in g for i in cs[c].indices()}) for g in parts]
        group = DiskGroup(groups, {})
        for _ in range(60):
            schedule = Schedule([copy.deepcopy(group)])
            assert alone.peaks(schedule) == priced.price(schedule)["memory_peak"], (parts, group)
            checked += 1
            if not any(_halve(group, level) for level in ("device", "global")):
                break
    assert checked > 100


def _small_t_context():
    """A context planning (T) at o=4, v=7 with 64 KiB of global and 8 KiB of device memory, and its spec."""
    from chainexec.planner.build import contractions
    from chainexec.planner.schedule import Context

    text = (CONFIGS / "ccsd_t.yaml").read_text().replace("occ: 5", "occ: 4").replace("vir: 19", "vir: 7")
    s = spec.loads(text.replace("1GiB", "64KiB").replace("256MiB", "8KiB"), str(CONFIGS / "ccsd_t.yaml"))
    cs, tensors, _ = contractions(s)
    return Context(cs, tensors, s.extents, {"global": s.machine.global_memory, "device": s.machine.device_memory},
                   Machine()), s


def _emitted_alike(ctx, before, group, levels=("global", "device", "global")) -> int:
    """Halve ``group``'s tiles (in place) at each of ``levels`` in turn, up to 40 times each,
    asserting at every step that the context's emitter emits for ``before`` (disk groups, left
    alone) followed by ``group`` the nests a fresh emitter, sharing nothing, does; the steps."""
    import copy

    from chainexec.planner.nest import Emitter, Schedule
    from chainexec.planner.schedule import _halve

    steps = 0
    for level in levels:
        for _ in range(40):
            schedule = Schedule(before + [copy.deepcopy(group)])
            assert ctx.emitter().schedule(schedule) == Emitter(ctx.cs, ctx.extents, ctx.tensors).schedule(schedule)
            steps += 1
            if not _halve(group, level):
                break
    return steps


def test_shared_emission_equals_a_fresh_emitters():
    """The parts of nests that a context's emitters share (``Emitter._memo``: device bodies of
    fused groups, global loads, per-sub-chain facts) change nothing: on every step of halving
    the tiles of (T) cut into fused groups, with and without inputs held on the device, the
    context's emitter emits the nests a fresh emitter, sharing nothing, does."""
    from chainexec.planner.nest import DeviceGroup, DiskGroup

    ctx, s = _small_t_context()
    ids = [c.id for c in ctx.cs]
    inputs = [t.name for t in ctx.tensors.values() if t.role == "input"]
    steps = 0
    for parts in ([ids], [ids[:12], ids[12:24], ids[24:]], [ids[:24], ids[24:]]):
        for on_device in ([], inputs):
            groups = [DeviceGroup(list(g), {i: s.extents[i] for i in ctx.emitter().group_common(g)},
                                  {i: s.extents[i] for c in g for i in ctx.cs[c].indices()}, on_device=on_device)
                      for g in parts]
            steps += _emitted_alike(ctx, [], DiskGroup(groups, {i: s.extents[i] for i in ctx.emitter().group_common(ids)}))
    assert steps > 100


def test_shared_single_contractions_equal_a_fresh_emitters():
    """Single contractions' nests shared between emitters (``Emitter.single``) change nothing,
    stored versions included: (T) cut into single contractions, the last ones in a disk group
    after the first ones, each in a disk group of its own or all in one (so that the last ones
    find other versions of what they read and add to, and keep other tensors in the global
    array), with and without resident operands, halved at both levels; each emitted as a fresh
    emitter does."""
    from chainexec.planner.nest import DeviceGroup, DiskGroup

    ctx, s = _small_t_context()
    ids = [c.id for c in ctx.cs]
    inputs = [t.name for t in ctx.tensors.values() if t.role == "input"]
    steps = 0
    for cut, together, resident in itertools.product((5, 17, 25), (False, True), ([], inputs)):
        def single(k):
            whole = {i: s.extents[i] for i in ctx.cs[k].indices()}
            return DeviceGroup([k], dict(whole), dict(whole), resident=resident)

        first = [single(k) for k in ids[:cut]]
        before = [DiskGroup(first)] if together else [DiskGroup([g]) for g in first]
        rest = ids[cut:]
        group = DiskGroup([single(k) for k in rest], {i: s.extents[i] for i in ctx.emitter().group_common(rest)})
        steps += _emitted_alike(ctx, before, group, ("device", "global", "device"))
    assert steps > 100


def test_host_time_adds_to_compute_or_overlaps_it():
    """``work_seconds``: per-statement host seconds add to compute (NumPy) or overlap it when
    statements are queued on a device stream (``async_statements``): the norm of the two, the
    longer where one dominates, √2 times it where they are alike."""
    from dataclasses import replace

    from chainexec.planner.schedule import work_seconds

    predicted = {"seconds": {"disk": 1.0, "global<->device": 2.0, "compute": 10.0}, "statements": 1000}
    machine = Machine(statement_seconds=4e-3)
    ctx = type("Ctx", (), {"machine": machine})
    assert work_seconds(ctx, predicted) == pytest.approx(1 + 2 + 10 + 4)
    ctx.machine = replace(machine, async_statements=True)
    assert work_seconds(ctx, predicted) == pytest.approx(1 + 2 + (10**2 + 4**2) ** 0.5)
    ctx.machine = replace(machine, async_statements=True, statement_seconds=0.01)
    assert work_seconds(ctx, predicted) == pytest.approx(1 + 2 + 10 * 2**0.5)
    ctx.machine = replace(machine, async_statements=True, statement_seconds=1e-4)
    assert work_seconds(ctx, predicted) == pytest.approx(1 + 2 + 10, rel=1e-3)


H100 = Machine(disk_read=1.77e9, disk_write=1.0e9, global_to_device=5.28e9, device_to_global=7.16e9,
               flop_rate=5.43e13, statement_seconds=2.36e-4, device_bandwidth=2.79e12)
"""machine_h100_2026-11-23.json's rates with queued statements off (the file has had
``async_statements: true`` since the ninth session)."""


def _triples(occ: int, vir: int, device: str):
    """configs/ccsd_t.yaml at ``occ``, ``vir`` with 64 GiB of global and ``device`` of device memory."""
    text = (CONFIGS / "ccsd_t.yaml").read_text().replace("occ: 5", f"occ: {occ}").replace("vir: 19", f"vir: {vir}")
    return spec.loads(text.replace("1GiB", "64GiB").replace("256MiB", device), str(CONFIGS / "ccsd_t.yaml"))


def test_overlapped_host_time_lets_triples_take_smaller_tiles(monkeypatch):
    """The measured case (H100, 2026-11-23, machine_h100_2026-11-23.json's rates): (T) at o=32
    v=300 with 40 GiB of device memory. Added up, 120 tiles of 4x4x4 occupied (4,080 statements)
    beat 816 tiles of 2x2x2 (27,744 statements: 6.5 s of host time at 236 us each), though the
    smaller tiles skip 15 % of the flops; on the GPU the tiles of 2 ran in 55.8 s, those of 4 in
    61.8 s. With the host's time overlapped the planner takes the tiles of 2."""
    from dataclasses import replace

    # the tiles are chosen before W's run is symmetrized, which then leaves both at nearly the
    # same flops (each tile's repeated products skipped): compared as the tile search priced them
    monkeypatch.setattr(build, "mark", lambda *args: None)
    added, overlapped = (make_plan(_triples(32, 300, "40GiB"), m) for m in (H100, replace(H100, async_statements=True)))
    tiles = [[t for _, t in parallel_loops(p)] for p in (added, overlapped)]
    assert tiles == [[{"i": 4, "j": 4, "k": 4}], [{"i": 2, "j": 2, "k": 2}]]
    assert overlapped.predicted["flops"] < 0.86 * added.predicted["flops"]
    assert overlapped.predicted["statements"] > 6 * added.predicted["statements"]


H100_QUICK = Machine(disk_read=1.22e9, disk_write=9.52e8, global_to_device=2.08e10, device_to_global=1.28e10,
                     flop_rate=5.57e13, statement_seconds=2.52e-4, transfer_call_seconds=6.54e-5,
                     disk_call_seconds=6.48e-5, device_bandwidth=2.63e12, orbit_bandwidth=1.71e13,
                     async_statements=True)
"""A quick calibration's rates on an H100 (``tiles_ccsd_t_h100_2026-12-06b.json``)."""


def test_overlap_of_host_and_device_takes_the_triples_tiles_that_ran_faster():
    """The measured case (``tiles_ccsd_t_h100_2026-12-06b.json``): (T) at o=40 v=400 with 40 GiB
    of device memory, the H100's own quick calibration. Occupied tiles of one (311,680
    statements, 79 s of host time at the calibrated rate against 90 s of compute) ran in 115.9 s,
    tiles of two (40,640 statements) in 100.8 s. With host and device time overlapped as their
    maximum the planner took the tiles of one; as their norm it takes the tiles of two, and
    keeps them where more memory would allow larger ones (which ran slower still)."""
    from chainexec.planner import machine as machine_module

    for device in ("40GiB", "78GiB"):
        plan = make_plan(_triples(40, 400, device), H100_QUICK)
        assert [t for _, t in parallel_loops(plan)] == [{"i": 2, "j": 2, "k": 2}], device

    def maximum(self, compute, statements, calls=0.0):
        return max(compute, statements * self.statement_seconds + calls)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(machine_module.Machine, "busy_seconds", maximum)
        plan = make_plan(_triples(40, 400, "40GiB"), H100_QUICK)
    assert [t for _, t in parallel_loops(plan)] == [{"i": 1, "j": 1, "k": 1}]


@pytest.mark.parametrize("config", ["fourindex", "triples"])
def test_compute_seconds_are_the_roofline_of_each_statement(config):
    """A plan's compute seconds are the sum over its statements of the larger of flops /
    flop_rate and streamed bytes / device_bandwidth: the flops' time alone when memory is
    infinitely fast, the bytes' alone when the flops are free. The plan is fixed first, then
    priced under each machine. With the H100's rates every statement of the four-index
    transform is byte-bound, so compute is the bytes' time; in (T) at v=300 W's sums over a
    virtual index are flop-bound and its sums over an occupied one and the epilogue byte-bound,
    so compute lies well above the larger of the two totals and well below their sum (the
    additive model of the twelfth session gave the sum)."""
    from dataclasses import replace

    from chainexec.planner.cost import predict

    s = spec.load(CONFIGS / "fourindex.yaml") if config == "fourindex" else _triples(8, 300, "40GiB")
    plan = make_plan(s, H100)
    p = plan.predicted
    flop_s, byte_s = p["flops"] / H100.flop_rate, p["streamed"] / H100.device_bandwidth
    fast_memory, free_flops = replace(H100, device_bandwidth=1e300), replace(H100, flop_rate=1e300)
    assert predict(plan, fast_memory)["seconds"]["compute"] == pytest.approx(flop_s, rel=1e-12)
    assert predict(plan, free_flops)["seconds"]["compute"] == pytest.approx(byte_s, rel=1e-12)
    compute = p["seconds"]["compute"]
    if config == "fourindex":
        assert compute == pytest.approx(byte_s, rel=1e-12) and flop_s < 0.5 * byte_s
    else:
        assert 1.1 * max(flop_s, byte_s) < compute < 0.9 * (flop_s + byte_s)
