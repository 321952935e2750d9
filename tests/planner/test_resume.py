"""Which loops and nest ends a run can checkpoint, as the plan records them (``Loop.resume``,
``Nest.checkpoint_after``): the (T) energy's loop over occupied tiles (accumulate), the
four-index transform's loops (store), not loops that carry state from one tile to the next in
global buffers, nor loops inside other loops, nor loops after a store that would run again."""

from __future__ import annotations

import pytest
import yaml

from chainexec import spec
from chainexec.planner.build import make_plan
from chainexec.planner.plan import Loop, Nest, Op, Plan
from chainexec.planner.resume import accumulating, mark, storing
from tests.conftest import fourindex_config, run_cli, write_config


def _synthetic(tmp_path, machine):
    assert run_cli("chem", "synthetic", "--synthetic", 4, 6, 7, "--out", tmp_path).returncode == 0
    config = tmp_path / "ccsd_t.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["machine"] = machine
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return make_plan(spec.load(config))


def _resumes(nest: Nest) -> dict[int, str]:
    return {k: node.resume for k, node in enumerate(nest.body) if isinstance(node, Loop) and node.resume}


def test_triples_loop_is_resumable(tmp_path):
    plan = _synthetic(tmp_path, {"global_memory": "1GiB", "device_memory": "48KiB"})
    (nest,) = plan.nests
    ((pos, kind),) = _resumes(nest).items()
    assert kind == "accumulate" and accumulating(nest) == [pos]
    assert nest.body[pos].parallel and nest.body[pos].symmetric == ["i", "j", "k"]
    assert nest.checkpoint_after


def test_triples_loop_inside_a_global_loop_is_not(tmp_path):
    """With 16 KiB of global memory the occupied tiles loop at the global level too (loads in
    it), the energy added up over its iterations: neither loop is resumable."""
    plan = _synthetic(tmp_path, {"global_memory": "16KiB", "device_memory": "1MiB"})
    assert any(isinstance(node, Loop) and not node.parallel for node in plan.nests[0].body)
    assert _resumes(plan.nests[0]) == {} and storing(plan.nests[0]) == []


def test_fourindex_loops_store(tmp_path):
    """The four-index transform's global loops store a tile of their output each iteration:
    resumable by iterations, each nest's end a checkpoint; the marks survive the plan's JSON."""
    plan = make_plan(spec.load(write_config(tmp_path, fourindex_config())))
    assert len(plan.nests) == 2
    for nest in plan.nests:
        assert list(_resumes(nest).values()) == ["store"] and nest.checkpoint_after
    again = Plan.from_json(plan.to_json())
    assert [(_resumes(n), n.checkpoint_after) for n in again.nests] == [(_resumes(n), True) for n in plan.nests]


def _store_loop(inner, tiles=None) -> Loop:
    """A global loop over tiles of i around ``inner``: allocates T[i] there, stores it at v1."""
    return Loop("global", tiles or {"i": 2}, body=[Op("alloc", "global", "T", ["i"]), *inner,
                                                     Op("store", "global", "T", ["i"], version=1),
                                                     Op("free", "global", "T", ["i"])])


@pytest.mark.parametrize("inner,expected", [
    ([Op("get", "device", "A", ["i"]), Op("accumulate", "device", "E", [])], [1]),
    ([Op("get", "device", "A", ["i"])], []),  # nothing accumulated: nothing to save
    ([Op("load", "global", "A", ["i"]), Op("accumulate", "device", "E", [])], []),
    ([Op("store", "global", "E", []), Op("accumulate", "device", "E", [])], []),
])
def test_accumulate_rules(inner, expected):
    body = [Op("alloc", "global", "E", []), Loop("device", {"i": 2}, parallel=True, body=inner),
            Loop("device", {"i": 2}, parallel=False, body=inner)]
    assert accumulating(Nest([0], body)) == expected


@pytest.mark.parametrize("loop,expected", [
    (_store_loop([Op("load", "global", "A", ["i"], version=0)]), [0]),
    (_store_loop([Op("accumulate", "device", "T", ["i"])]), [0]),
    (_store_loop([]), [0]),
    (_store_loop([Op("accumulate", "device", "E", [])]), []),  # E lives on across iterations
    (_store_loop([], {"j": 2}), []),  # every iteration would store the same tile
    (_store_loop([Op("load", "global", "T", ["i"], version=1)]), []),  # reads what it stores
    (Loop("global", {"i": 2}, body=[Op("store", "global", "E", [], version=1)]), []),  # E allocated outside
    (Loop("device", {"i": 2}, parallel=True, body=_store_loop([]).body), []),
])
def test_store_rules(loop, expected):
    body = [loop, Loop("global", {"i": 2}, body=[Op("load", "global", "A", ["i"], version=0)])]
    assert storing(Nest([0], body)) == expected


def test_marks():
    """A loop after a store that a resumed run would run again is not resumable; a store loop
    before it is skipped, so a loop after that stays resumable. A nest end after which a buffer
    lives on is no checkpoint."""
    parallel = Loop("device", {"i": 2}, parallel=True, body=[Op("accumulate", "device", "E", [])])
    first = Nest([0], [Op("alloc", "global", "E", []), _store_loop([]), parallel,
                       Op("store", "global", "E", [], version=1), _store_loop([])])
    second = Nest([1], [Op("alloc", "global", "K", []), _store_loop([]),
                        Loop("global", {"i": 2}, body=[Op("load", "global", "A", ["i"], version=0)])])
    third = Nest([2], [parallel, Op("free", "global", "K", []), Op("free", "global", "E", [])])
    mark([first, second, third])
    assert [_resumes(n) for n in (first, second, third)] == [{1: "store", 2: "accumulate"}, {1: "store"},
                                                             {0: "accumulate"}]
    assert [n.checkpoint_after for n in (first, second, third)] == [False, False, True]
