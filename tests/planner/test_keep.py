"""Device tiles kept across a group of a symmetric loop's tiles (:mod:`chainexec.planner.keep`)."""

from __future__ import annotations

import itertools

import pytest

from chainexec import spec
from chainexec.planner import build
from chainexec.planner.build import make_plan
from chainexec.planner.cost import Loops, units
from chainexec.planner.pipeline import written
from chainexec.planner.plan import Loop, Op, Plan, key
from chainexec.runtime.frame import groups, tuples
from tests.conftest import triples_config


def _loop(plan: Plan) -> Loop:
    return next(node for node in plan.nests[0].body if isinstance(node, Loop))


def _spans(loop: Loop, extents: dict[str, int]) -> list[list[tuple[int, int]]]:
    return [[(s, min(s + t, extents[i])) for s in range(0, extents[i], t)] for i, t in loop.tiles.items()]


@pytest.mark.parametrize("nocc, nvir, device, tile, ovvv", [
    (6, 10, "96KiB", 1, 2), (8, 10, "128KiB", 2, 0), (8, 10, "160KiB", 2, 1), (7, 9, "120KiB", 2, 1)])
def test_kept_tiles_are_fetched_first_and_freed_last(tmp_path, nocc, nvir, device, tile, ovvv):
    """(T) whose inputs do not fit the device: its loop fetches its tiles tuple by tuple, and
    keeps those over the second and third occupied indices across each group of tuples that
    differ only in the first (``ovvv[j]``, ``ovvv[k]`` where they fit beside the rest): their
    ``alloc``/``get`` pairs open the body, their ``free`` statements close it, none of them
    over ``i`` or of a tensor the body writes. The loop's count is the runtime's number of
    groups; the plan stays within the device limit."""
    plan = make_plan(spec.load(triples_config(tmp_path, device, nocc, nvir)))
    loop = _loop(plan)
    assert loop.tiles == dict.fromkeys("ijk", tile) and loop.symmetric == ["i", "j", "k"]
    kept = [(tensor, tuple(indices), "device") for tensor, indices in loop.kept]
    assert kept and sum(tensor == "ovvv" for tensor, _, _ in kept) == ovvv
    head = loop.body[:2 * len(kept)]
    assert [(op.op, key(op)) for op in head] == [(op, k) for k in kept for op in ("alloc", "get")]
    assert sorted(key(op) for op in loop.body[-len(kept):] if op.op == "free") == sorted(kept)
    changed = written(loop.body, plan.contractions)
    assert all("i" not in indices and tensor not in changed for tensor, indices, _ in kept)
    combos, _ = tuples(list(loop.tiles), _spans(loop, plan.extents), loop.symmetric)
    assert loop.count == len(groups(list(loop.tiles), combos, loop.symmetric)) < len(combos)
    assert plan.predicted["memory_peak"]["device"] <= plan.memory_limit["device"]
    assert Plan.from_json(plan.to_json()).nests[0].body[[type(n) for n in plan.nests[0].body].index(Loop)].kept \
        == loop.kept


def test_keeping_moves_fewer_bytes(tmp_path, monkeypatch):
    """The same (T) plan with its tiles fetched on every tuple moves more to the device, by the
    kept tiles' bytes on every tuple that is not its group's first; the flops stay."""
    config = triples_config(tmp_path, "96KiB", 6, 10)
    plan = make_plan(spec.load(config))
    monkeypatch.setattr(build, "keep", lambda nests, *args: nests)
    plain = make_plan(spec.load(config))
    assert not _loop(plain).kept and _loop(plain).tiles == _loop(plan).tiles
    loop = _loop(plan)
    combos, _ = tuples(list(loop.tiles), _spans(loop, plan.extents), loop.symmetric)
    saved = 0
    for tensor, indices in loop.kept:
        size = plan.tensors[tensor].itemsize * plan.extents["a"] ** (len(indices) - sum(i in "ijkm" for i in indices))
        size *= plan.extents["m"] ** ("m" in indices)
        saved += size * (len(combos) - loop.count)
    assert plain.predicted["bytes"]["global->device"] - plan.predicted["bytes"]["global->device"] == saved
    assert plain.predicted["flops"] >= plan.predicted["flops"]


def test_nothing_kept_where_nothing_is_fetched_per_tile_or_groups_are_too_few(tmp_path):
    """With the inputs whole on the device the loop fetches nothing tile by tile: nothing to
    keep. On four ranks the H2O-sized job (o=5) is cut into tiles of 3 and fetches its tiles
    tuple by tuple (four tuples, three groups): it keeps nothing, so that every rank gets work."""
    from pathlib import Path

    assert not _loop(make_plan(spec.load(triples_config(tmp_path, "320KiB", 8, 10)))).kept
    plan = make_plan(spec.load(Path(__file__).resolve().parents[2] / "configs" / "ccsd_t.yaml"), ranks=4)
    loop = _loop(plan)
    combos, _ = tuples(list(loop.tiles), _spans(loop, plan.extents), loop.symmetric)
    assert len(combos) == 4 and len(groups(list(loop.tiles), combos, loop.symmetric)) == 3
    assert any(isinstance(op, Op) and op.op == "get" and op.tensor == "ovvv" for op in loop.body)
    assert not loop.kept


@pytest.mark.parametrize("positions, symmetric", [(1, 2), (3, 2), (4, 3), (5, 3), (3, 4)])
def test_groups_partition_the_tuples_and_match_the_count(positions, symmetric):
    """The runtime's groups (:func:`chainexec.runtime.frame.groups`) partition a symmetric loop's
    ordered tuples into runs of consecutive tuples equal but for the first index, handed out
    largest first; their number is the cost model's (:func:`chainexec.planner.cost.units`),
    which a brute force over the tuples' other positions confirms."""
    names = list("ijkl")[:symmetric]
    extents = dict.fromkeys(names, 2 * positions - 1)
    loop = Loop("device", dict.fromkeys(names, 2), parallel=True, symmetric=names, kept=[["x", names[1:]]])
    combos, _ = tuples(names, _spans(loop, extents), names)
    found = groups(names, combos, names)
    assert sorted(itertools.chain(*found)) == list(range(len(combos)))
    assert [len(g) for g in found] == sorted((len(g) for g in found), reverse=True)
    for g in found:
        assert g == list(range(g[0], g[0] + len(g)))
        assert len({combos[n][1:] for n in g}) == 1
    assert len({combos[g[0]][1:] for g in found}) == len(found)
    assert units(loop, extents) == len(found) == Loops([loop]).points([], extents, "device", grouped=True)
    assert units(Loop("device", loop.tiles, True, symmetric=names), extents) == len(combos)


def test_kept_statements_are_direct_and_single(tmp_path):
    """Only tiles fetched by one ``alloc``/``get``/``free`` each directly in the loop's body are
    kept, and none of a tensor the body writes (W, the energy) or over ``i``."""
    plan = make_plan(spec.load(triples_config(tmp_path, "96KiB", 6, 10)))
    loop = _loop(plan)
    held = {(tensor, tuple(indices), "device") for tensor, indices in loop.kept}
    for k in held:
        named = [op.op for op in loop.body if isinstance(op, Op) and op.tensor is not None and key(op) == k]
        assert sorted(named) == ["alloc", "free", "get"]
    assert not {"W", "E", "P", "Q"} & {k[0] for k in held}
