"""References to one tensor under different index names share buffers (issue 6): at the global
level one buffer and one load per tensor and region, on the device one get per region within a
fused group. Checked on the (T) chain, whose statements read ovvv, ovoo, ovov, t1, t2 and f_vo
under many names, and on small chains with bytes worked out by hand."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import yaml

from chainexec import expr, spec
from chainexec.chem.job import write_config as write_t_config
from chainexec.planner.build import contractions, make_plan
from chainexec.planner.choose import choose
from chainexec.planner.cost import predict_nests
from chainexec.planner.machine import Machine
from chainexec.planner.nest import DeviceGroup, DiskGroup, Emitter, Schedule, same_region
from chainexec.planner.plan import ops
from chainexec.planner.schedule import Context

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def t_spec(folder: Path, nocc: int, nvir: int, global_memory=None, device_memory=None) -> spec.Spec:
    path = folder / "ccsd_t.yaml"
    write_t_config(CONFIGS / "ccsd_t.yaml", path, nocc, nvir)
    if global_memory:
        cfg = yaml.safe_load(path.read_text())
        cfg["machine"] = {"global_memory": global_memory, "device_memory": device_memory}
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return spec.load(path)


def stored_inputs(s: spec.Spec) -> dict[str, int]:
    """Bytes of every input read from a file (the computed Dinv is made on the device from
    e_occ and e_vir, which are inputs themselves)."""
    return {t.name: 8 * math.prod(s.extents[i] for i in t.indices) for t in s.tensors.values()
            if t.source is not None and t.source.expr is None}


def per_reference_bytes(s: spec.Spec) -> int:
    """What loading every distinct reference separately would read: the planner before sharing."""
    refs = set()
    for st in s.statements:
        for r in st.operands:
            t = s.tensors[r.tensor]
            if t.source is None:
                continue
            if t.source.expr is not None:
                rename = dict(zip(t.indices, r.indices))
                refs |= {(x.tensor, tuple(rename[i] for i in x.indices)) for x in expr.refs(expr.parse(t.source.expr))}
            else:
                refs.add((r.tensor, tuple(r.indices)))
    return sum(8 * math.prod(s.extents[i] for i in ix) for _, ix in refs)


@pytest.mark.parametrize("nocc, nvir, memory", [(3, 5, None), (5, 19, None), (21, 93, ("32GiB", "12GiB"))])
def test_triples_loads_each_input_once(tmp_path, nocc, nvir, memory):
    s = t_spec(tmp_path, nocc, nvir, *(memory or ()))
    plan = make_plan(s)
    inputs = stored_inputs(s)
    assert set(inputs) == {"t1", "t2", "ovvv", "ovoo", "ovov", "e_occ", "e_vir", "f_vo"}
    loads = [op for nest in plan.nests for op, _ in ops(nest.body) if op.op == "load"]
    assert sorted(op.tensor for op in loads) == sorted(inputs), "one load per input tensor"
    assert plan.predicted["bytes"]["disk->global"] == sum(inputs.values())
    # The whole chain is one fused device group; at the global level it holds the inputs and E.
    assert len(plan.nests) == 1
    assert plan.predicted["memory_peak"]["global"] == sum(inputs.values()) + 8
    assert per_reference_bytes(s) > 7 * sum(inputs.values())
    if memory:  # the figures: 1.48 GiB read (ovvv six times, t2 eighteen) before, 194 MiB now
        assert per_reference_bytes(s) == 1584557568
        assert sum(inputs.values()) == 203081664


def test_triples_inputs_go_to_the_device_once(tmp_path):
    """At o = 21, v = 93 with 12 GiB of device memory the fused group's inputs fit beside its
    tiles: each input goes to the device once (one get per tensor: the global level holds whole
    tensors, so all its names cover one region), before the parallel loop over i, j, k tiles."""
    s = t_spec(tmp_path, 21, 93, "32GiB", "12GiB")
    plan = make_plan(s)
    (nest,) = plan.nests
    gets = [(op, loops) for op, loops in ops(nest.body) if op.op == "get"]
    assert not any(loop.parallel for _, loops in gets for loop in loops)
    assert sorted(op.tensor for op, _ in gets) == sorted(stored_inputs(s))
    assert plan.predicted["bytes"]["global->device"] == sum(stored_inputs(s).values())
    par = next(loop for _, loops in ops(nest.body) for loop in loops if loop.parallel)
    assert set(par.tiles) == {"i", "j", "k"}


def test_triples_device_gets_share_equal_regions(tmp_path):
    """The same schedule with the inputs fetched per device tile: ovvv[i,a,f,b] and
    ovvv[i,a,f,c] (and the other pairs that differ in whole virtual positions) are fetched once
    per tile."""
    s = t_spec(tmp_path, 21, 93, "32GiB", "12GiB")
    cs, tensors, _ = contractions(s)
    ctx = Context(cs, tensors, s.extents, {"global": s.machine.global_memory, "device": s.machine.device_memory},
                  Machine())
    chosen, _ = choose(ctx)
    for disk in chosen.groups:
        for g in disk.groups:
            g.on_device = []
    (nest,) = ctx.emitter().schedule(chosen)
    predicted = predict_nests([nest], tensors, s.extents, cs, Machine())
    assert predicted["memory_peak"]["device"] <= s.machine.device_memory
    par = next(loop for _, loops in ops(nest.body) for loop in loops if loop.parallel)
    tiled = set(par.tiles)
    assert tiled == {"i", "j", "k"}
    gets = [op for op, _ in ops(nest.body) if op.op == "get"]
    for a in gets:
        for b in gets:
            if a is not b and a.tensor == b.tensor:
                assert not same_region(a.indices, b.indices, tiled), (a, b)
    ovvv = [tuple(op.indices) for op in gets if op.tensor == "ovvv"]
    assert len(ovvv) == 3  # six references, three regions: (i,…), (j,…), (k,…)
    # Bytes per get, independently: enumerate the tile tuples the parallel loop visits (ordered
    # ones i >= j >= k by tile position, E being declared symmetric in i, j, k) and add each
    # get's region.
    assert par.symmetric == ["i", "j", "k"]
    spans = {i: [(a, min(a + par.tiles[i], s.extents[i])) for a in range(0, s.extents[i], par.tiles[i])]
             for i in "ijk"}
    expected = 0
    for p in itertools.product(*(range(len(spans[i])) for i in "ijk")):
        if not p[0] >= p[1] >= p[2]:
            continue
        region = {i: spans[i][q][1] - spans[i][q][0] for i, q in zip("ijk", p)}
        for op in gets:
            t = tensors[op.tensor]
            expected += t.itemsize * math.prod(region.get(i, s.extents[i]) for i in op.indices)
    assert predicted["bytes"]["global->device"] == expected


# A small fused chain: W[i,a,b,c] built from three terms that read A and T under several names.
CHAIN = """
indices: {i: 6, a: 3, b: 3, c: 3, f: 4}
tensors:
  A: {indices: [i, a, f, b], source: {random: 1}}
  B: {indices: [i, a, f, b], source: {random: 2}}
  T: {indices: [c, f], source: {random: 3}}
statements:
  - W[i,a,b,c] = A[i,a,f,b] * T[c,f]
  - W[i,a,b,c] += B[i,b,f,c] * T[a,f]
  - W[i,a,b,c] += A[i,a,f,c] * T[b,f]
outputs:
  W: {file: w.h5, dataset: W}
machine: {global_memory: 1MiB, device_memory: 1MiB}
"""


def _price(tmp_path, dev: dict[str, int]):
    s = spec.loads(CHAIN, str(tmp_path / "c.yaml"))
    cs, tensors, _ = contractions(s)
    full = {i: s.extents[i] for i in s.extents}
    group = DeviceGroup([0, 1, 2], {i: full[i] for i in "iabc"}, full | dev)
    nests = Emitter(cs, s.extents, tensors).schedule(Schedule([DiskGroup([group])]))
    return nests, predict_nests(nests, tensors, s.extents, cs, Machine())


def test_fused_group_shares_device_gets_by_hand(tmp_path):
    """Device tiles of 2 on i only: A[i,a,f,b] (term 1) and A[i,a,f,c] (term 3) cover the same
    region in every tile, so A is fetched once per tile and kept over term 2; T[c,f], T[a,f]
    and T[b,f] are all of T, fetched once per tile."""
    nests, pred = _price(tmp_path, {"i": 2})
    size = {"A": 6 * 3 * 4 * 3, "B": 6 * 3 * 4 * 3, "T": 3 * 4}
    assert pred["bytes"]["disk->global"] == 8 * sum(size.values())
    # Per tile of i (3 tiles): A's and B's slab (a third of each), all of T.
    assert pred["bytes"]["global->device"] == 8 * (size["A"] + size["B"] + 3 * size["T"])
    gets = [(op.tensor, op.indices) for op, _ in ops(nests[0].body) if op.op == "get"]
    assert gets == [("A", ["i", "a", "f", "b"]), ("T", ["c", "f"]), ("B", ["i", "b", "f", "c"])]
    # Device peak: W's tile, A's and T's kept buffers and B's tile at term 2, 8 bytes each element.
    assert pred["memory_peak"]["device"] == 8 * (2 * 27 + 2 * 36 + 12 + 2 * 36)


def test_fused_group_keeps_separate_buffers_when_regions_differ(tmp_path):
    """Tiling c in the fused loop makes A[i,a,f,b] (whole b) and A[i,a,f,c] (a tile of c) differ;
    tiling f in each term's own loop makes every reference with f change inside a term: nothing
    is shared on the device then, and every term fetches its own operands."""
    size = {"A": 6 * 3 * 4 * 3, "B": 6 * 3 * 4 * 3, "T": 3 * 4}
    _, pred = _price(tmp_path, {"i": 2, "c": 1})
    # Per (i, c) tile: A[i,a,f,b] lacks c (3 tiles of c each read A's i-slab), A[i,a,f,c] and
    # B[i,b,f,c] read their c-slab; T[c,f] its c row; T[a,f] and T[b,f] (whole a and b: still
    # one region) all of T, once for both.
    assert pred["bytes"]["global->device"] == 8 * (3 * size["A"] + size["A"] + size["B"]
                                                   + 3 * size["T"] + 3 * 3 * size["T"])
    _, pred = _price(tmp_path, {"i": 2, "f": 2})
    assert pred["bytes"]["global->device"] == 8 * (2 * size["A"] + size["B"] + 3 * 3 * size["T"])
    # The global level is untiled either way: one buffer per input.
    assert pred["bytes"]["disk->global"] == 8 * sum(size.values())


def test_single_contraction_reads_one_tensor_twice(tmp_path):
    """X[i,j] = A[i,k] * A[j,k]: untiled, one load and one get of A; tiled on i, two of each."""
    text = """
indices: {i: 8, j: 8, k: 5}
tensors:
  A: {indices: [i, k], source: {random: 1}}
statements:
  - X[i,j] = A[i,k] * A[j,k]
outputs:
  X: {file: x.h5, dataset: X}
machine: {global_memory: 1MiB, device_memory: 1MiB}
"""
    s = spec.loads(text, str(tmp_path / "c.yaml"))
    cs, tensors, _ = contractions(s)

    def price(glob, dev):
        nests = Emitter(cs, s.extents, tensors).schedule(Schedule([DiskGroup([DeviceGroup([0], glob, dev)])]))
        return predict_nests(nests, tensors, s.extents, cs, Machine())

    whole = price({}, {})
    assert whole["bytes"]["disk->global"] == whole["bytes"]["global->device"] == 8 * 40
    assert whole["memory_peak"]["global"] == 8 * (40 + 64)
    tiled = price({"i": 4}, {"i": 2})
    # A[i,k] is read once in slabs; A[j,k] whole for each of the two global tiles of i.
    assert tiled["bytes"]["disk->global"] == 8 * (40 + 2 * 40)
    assert tiled["bytes"]["global->device"] == 8 * (40 + 4 * 40)
