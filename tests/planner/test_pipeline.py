"""Double-buffered loops: which global loops qualify, their slots in the predicted memory peak,
one-iteration loops dropped, the fall-back to single buffers, and the plan's JSON form; device
loops whose input tiles are fetched one tile ahead where the device limit leaves room."""

from __future__ import annotations

import math

import pytest

from chainexec import spec
from chainexec.planner import build, pipeline
from chainexec.planner.build import make_plan
from chainexec.planner.cost import predict_nests
from chainexec.planner.machine import Machine
from chainexec.planner.plan import Loop, Nest, Op, Plan, TensorInfo, ops, fetched, prefetched, returned, staged
from tests.conftest import fourindex_config, triples_config, write_config


def _loops(body, around=()):
    for node in body:
        if isinstance(node, Loop):
            yield node, around
            yield from _loops(node.body, around + (node,))


def _global_allocs(body) -> bool:
    return any(isinstance(n, Op) and n.op == "alloc" and n.level == "global" for n in body) or any(
        _global_allocs(n.body) for n in body if isinstance(n, Loop))


@pytest.mark.parametrize("n, nmo, limit", [(10, 8, "24KiB"), (11, 7, "40KiB"), (9, 9, "16KiB")])
def test_out_of_core_loops_are_double_buffered(tmp_path, n, nmo, limit):
    plan = make_plan(spec.load(write_config(tmp_path, fourindex_config(n, nmo, limit, "3KiB"))))
    doubled = [(loop, around) for nest in plan.nests for loop, around in _loops(nest.body)
               if loop.depth > 1 and loop.level == "global"]
    assert doubled
    for loop, around in doubled:
        assert loop.level == "global" and not loop.parallel
        assert any(isinstance(x, Op) and x.op in ("load", "store") for x in loop.body)
        assert not any(_global_allocs(x.body) for x in loop.body if isinstance(x, Loop))
        ranges = {i: min([plan.extents[i]] + [o.tiles[i] for o in around if o.level == "global" and i in o.tiles])
                  for i in loop.tiles}
        assert math.prod(-(-ranges[i] // t) for i, t in loop.tiles.items()) >= 2
    assert plan.predicted["memory_peak"]["global"] <= plan.memory_limit["global"]


def _tensor(name, indices, shape):
    return TensorInfo(name, list(indices), list(shape), "float64", 8, "input", {"file": "x.h5", "dataset": name})


def test_slots_are_two_full_tiles_for_the_whole_loop():
    """Loop over s (extent 5, tiles of 2) loading X[s,t] (t = 3) into its own buffer, beside a
    resident Y[t]: the peak is Y plus two full-size slots of X, also when the last tile is short."""
    x = Op("alloc", "global", "X", ["s", "t"])
    body = [x, Op("load", "global", "X", ["s", "t"], version=0), Op("free", "global", "X", ["s", "t"])]
    tensors = {"X": _tensor("X", "st", (5, 3)), "Y": _tensor("Y", "t", (3,))}
    extents = {"s": 5, "t": 3}
    for depth, slots in ((1, 1), (2, 2)):
        nest = [Op("alloc", "global", "Y", ["t"]), Loop("global", {"s": 2}, False, list(body), depth),
                Op("free", "global", "Y", ["t"])]
        record = predict_nests([Nest([], nest)], tensors, extents, [], Machine())
        assert record["memory_peak"]["global"] == 8 * (3 + slots * 2 * 3)
        assert record["bytes"]["disk->global"] == 8 * 5 * 3  # the bytes do not depend on buffering


def test_staged_and_prefetched():
    out = Op("alloc", "global", "O", ["s"])
    a = Op("alloc", "global", "A", ["s", "k"])
    load_a = Op("load", "global", "A", ["s", "k"], version=0)
    loop = Loop("global", {"s": 2}, False, [out, a, load_a, Loop("device", {"s": 1}, True, []),
                                            Op("store", "global", "O", ["s"], version=1)], 2)
    assert [op.tensor for op in staged(loop)] == ["O", "A"]
    # The output is zero-filled in its own iteration (its other slot may still be on its way to disk).
    assert prefetched(loop) == [a, load_a]
    loop.depth = 1
    assert staged(loop) == []


def test_one_iteration_loops_are_dropped():
    inner = Loop("global", {"s": 8}, False, [Op("alloc", "global", "X", ["s"]), Op("load", "global", "X", ["s"], version=0),
                                           Op("free", "global", "X", ["s"])])
    outer = Loop("global", {"s": 4}, False, [inner])
    (kept,) = pipeline.arrange([outer], {"s": 16})
    assert kept.tiles == {"s": 4} and [op.op for op in kept.body] == ["alloc", "load", "free"]
    assert kept.depth == 2
    (single,) = pipeline.arrange([outer], {"s": 16}, overlap=False)
    assert single.depth == 1
    # A loop of one tile is no loop at all (and is not double-buffered).
    assert [n.op for n in pipeline.arrange([outer], {"s": 4})] == ["alloc", "load", "free"]


def test_single_buffers_when_double_ones_do_not_fit(tmp_path):
    """Limits that leave no room for a second slot (a few unit tiles) still get a plan, with
    single buffers; a little more room and the same chain is double-buffered."""
    config = fourindex_config(10, 8, "24KiB", "3KiB")
    depths = {}
    for limit in (24, 40, 48, 64):
        config["machine"]["global_memory"] = limit
        plan = make_plan(spec.load(write_config(tmp_path, config)))
        assert plan.predicted["memory_peak"]["global"] <= limit
        depths[limit] = {loop.depth for nest in plan.nests for loop, _ in _loops(nest.body) if loop.level == "global"}
    assert depths == {24: {1}, 40: {1}, 48: {1, 2}, 64: {1, 2}}


def test_depth_survives_json(tmp_path, monkeypatch):
    """Double-buffered loops' depths, fetched tiles and results copied back aside survive JSON:
    the four-index transform's, and the (T) loop's with its tiles not kept across groups
    (:mod:`chainexec.planner.keep`, which would take the room first)."""
    monkeypatch.setattr(build, "keep", lambda nests, *args: nests)
    plan = make_plan(spec.load(write_config(tmp_path, fourindex_config())))
    again = Plan.from_json(plan.to_json())
    depths = [loop.depth for nest in plan.nests for loop, _ in _loops(nest.body)]
    assert 2 in depths and depths == [loop.depth for nest in again.nests for loop, _ in _loops(nest.body)]
    triples = make_plan(spec.load(triples_config(tmp_path, "260KiB")), Machine(aside_copy_bytes=0))
    ahead = [(loop.depth, loop.ahead, loop.back) for nest in triples.nests for loop, _ in _loops(nest.body)]
    assert ahead[0][0] == 2 and len(ahead[0][1]) == 6 and ahead[0][2] == [["E", []]]
    assert ahead == [(loop.depth, loop.ahead, loop.back) for nest in Plan.from_json(triples.to_json()).nests
                     for loop, _ in _loops(nest.body)]


def test_device_loops_fetch_ahead_as_many_tiles_as_fit(tmp_path, monkeypatch):
    """(T) at o=8, v=10 fetches 34 input tiles in each tile of its loop (tiles of 2; its peak
    111,360 B with every tile freed after use), none kept across groups here
    (:mod:`chainexec.planner.keep`, which would take the room first). The second slots may take
    half the room the device limit leaves beside that peak (the rest stays for the
    contractions' temporaries): none fits with 128 or 160 KiB; with more, the plan fetches
    ahead the most first tiles that fit, and one more would not. The tiles are those of the
    single-buffered plan. With 320 KiB the inputs are whole on the device and stream in: no
    tile is fetched in the loop. The tile's energy (8 B, below ``Machine.aside_copy_bytes``) is
    not copied back aside."""
    import dataclasses

    monkeypatch.setattr(build, "keep", lambda nests, *args: nests)
    config = triples_config(tmp_path, "128KiB")
    seen = []
    for kib in (128, 160, 200, 260, 320):
        text = config.read_text()
        config.write_text(text.replace(text[text.index("device_memory"):].splitlines()[0], f"device_memory: {kib}KiB"))
        plan = make_plan(spec.load(config))
        at, loop = next((k, n) for k, n in enumerate(plan.nests[0].body) if isinstance(n, Loop))
        seen.append((loop.tiles, loop.depth, len(loop.ahead), loop.back))
        if not loop.ahead:
            continue
        room = (plan.memory_limit["device"] + 111360) // 2
        assert plan.predicted["memory_peak"]["device"] <= room
        gets = [op for op in loop.body if isinstance(op, Op) and op.op == "get"]
        assert len(gets) == 34 and loop.ahead == [[op.tensor, op.indices] for op in gets[:len(loop.ahead)]]
        body = plan.nests[0].body
        more = dataclasses.replace(loop, ahead=[[op.tensor, op.indices] for op in gets[:len(loop.ahead) + 1]])
        peak = predict_nests([Nest([], body[:at] + [more] + body[at + 1:])], plan.tensors, plan.extents,
                             plan.contractions, None)["memory_peak"]
        assert peak["device"] > room
        assert [op.op for op in fetched(loop)] == ["alloc", "get"] * len(loop.ahead)
    assert [s[1:3] for s in seen] == [(1, 0), (1, 0), (2, 3), (2, 6), (1, 0)]
    assert all(tiles == {"i": 2, "j": 2, "k": 2} and back == [] for tiles, _, _, back in seen)


def test_device_slots_are_two_full_tiles_for_the_whole_loop():
    """A device loop over s (extent 5, tiles of 2) inside a parallel one, fetching X[s,t]
    (t = 3) and adding it into Y[t]: double-buffered, the peak is Y plus two full slots of X
    from loop entry to exit; the moved bytes do not change."""
    extents = {"s": 5, "t": 3}
    tensors = {"X": _tensor("X", "st", (5, 3)), "Y": _tensor("Y", "t", (3,))}
    body = [Op("alloc", "device", "X", ["s", "t"]), Op("get", "device", "X", ["s", "t"]),
            Op("free", "device", "X", ["s", "t"])]
    for depth, ahead, slots in ((1, [], 1), (2, [["X", ["s", "t"]]], 2)):
        inner = Loop("device", {"s": 2}, False, list(body), depth, ahead=ahead)
        nest = [Loop("device", {"t": 3}, True, [Op("alloc", "device", "Y", ["t"]), inner, Op("free", "device", "Y", ["t"])])]
        record = predict_nests([Nest([], nest)], tensors, extents, [], Machine())
        assert record["memory_peak"]["device"] == 8 * (3 + slots * 2 * 3)
        assert record["bytes"]["global->device"] == 8 * 5 * 3


def test_results_copied_back_are_two_full_tiles_for_the_whole_loop():
    """A device loop over s (extent 5, tiles of 2) computing Z[s,t] (t = 3) and adding it into its
    global array: with its result copied back aside (``back``) the peak is two full slots of Z
    from loop entry to exit, the body's own alloc and free no longer counted."""
    extents = {"s": 5, "t": 3}
    tensors = {"Z": _tensor("Z", "st", (5, 3))}
    body = [Op("alloc", "device", "Z", ["s", "t"]), Op("accumulate", "device", "Z", ["s", "t"]),
            Op("free", "device", "Z", ["s", "t"])]
    for depth, back, slots in ((1, [], 1), (2, [["Z", ["s", "t"]]], 2)):
        loop = Loop("device", {"s": 2}, True, list(body), depth, back=back)
        assert [op.op for op in returned(loop)] == ["alloc"] * len(back)
        peak = predict_nests([Nest([], [loop])], tensors, extents, [], None)["memory_peak"]
        assert peak["device"] == 8 * slots * 2 * 3


def test_results_copied_back_from_their_full_tile_size(tmp_path):
    """A result is copied back aside where its full device tile, inside all the loops around
    it, has at least ``Machine.aside_copy_bytes``: the four-index transform on 3 ranks with
    12 KiB of device memory, the threshold at each result's tile size and one byte above."""
    from chainexec.planner.cost import buffer_elements

    config = write_config(tmp_path, fourindex_config(device_memory="12KiB"))

    def backs(threshold):
        plan = make_plan(spec.load(config), Machine(aside_copy_bytes=threshold), ranks=3)
        found = {}
        for nest in plan.nests:
            for op, loops in ops(nest.body):
                if op.op == "alloc" and loops and [op.tensor, op.indices] in loops[-1].back:
                    whole = 8 * math.prod(plan.tensors[op.tensor].shape)
                    found[op.tensor] = (8 * buffer_elements(op.indices, list(loops), "device", plan.extents), whole)
        return found

    sizes = backs(0)
    assert len(sizes) == 2 and all(0 < n < whole for n, whole in sizes.values())  # tiles, not whole tensors
    for tensor, (nbytes, _) in sizes.items():
        assert tensor in backs(nbytes) and tensor not in backs(nbytes + 1)


def test_which_device_loops_fetch_ahead():
    """Only a device loop of one rank's own tiles (parallel, or inside a parallel loop) with at
    least two tiles fetches ahead; never a tile whose tensor the body also writes (accumulates,
    computes, evaluates; in a nested loop too), nor a buffer allocated twice in its body. Its
    results are copied back aside where it allocates, accumulates and frees them itself, once
    each, and fetches nothing of their tensor."""
    from types import SimpleNamespace

    x = [Op("alloc", "device", "X", ["s"]), Op("get", "device", "X", ["s"])]
    z = [Op("alloc", "device", "Z", ["s"]), Op("get", "device", "Z", ["s"]), Op("accumulate", "device", "Z", ["s"])]
    twice = [Op("alloc", "device", "T", ["s"]), Op("get", "device", "T", ["s"]), Op("free", "device", "T", ["s"]),
             Op("alloc", "device", "T", ["s"]), Op("get", "device", "T", ["s"])]
    added = [Loop("device", {"t": 1}, False, [Op("alloc", "device", "Y", ["s"]), Op("compute", "device", contraction=0),
                                               Op("accumulate", "device", "Y", ["s"]), Op("free", "device", "Y", ["s"])]),
             Op("alloc", "device", "Y", ["s"]), Op("get", "device", "Y", ["s"])]
    computed = [Op("alloc", "device", "W", ["s"]), Op("get", "device", "W", ["s"]), Op("compute", "device", contraction=1)]
    cs = [SimpleNamespace(out="Y"), SimpleNamespace(out="W")]

    def deepened(nest):
        (out,) = pipeline.deepen([Nest([], nest)], {"s": 4, "t": 4}, cs, lambda body: True)
        return [(loop.depth, [op.tensor for op in fetched(loop) if op.op == "get"])
                + ((loop.back,) if loop.back else ()) for loop, _ in _loops(out.body)]

    assert deepened([Loop("device", {"s": 1}, True, x + z + twice + computed)]) == [(2, ["X"])]
    assert deepened([Loop("device", {"s": 1}, True, added)]) == [(1, []), (2, [], [["Y", ["s"]]])]
    result = [Op("alloc", "device", "R", ["s"]), Op("compute", "device", contraction=2),
              Op("accumulate", "device", "R", ["s"]), Op("free", "device", "R", ["s"])]
    cs.append(SimpleNamespace(out="R"))
    assert deepened([Loop("device", {"s": 1}, True, x + result)]) == [(2, ["X"], [["R", ["s"]]])]
    assert deepened([Loop("device", {"s": 1}, True, result + result)]) == [(1, [])]  # allocated twice
    assert deepened([Loop("device", {"s": 1}, True, result + [Op("get", "device", "R", ["t"])])]) == [(1, [])]
    assert deepened([Loop("device", {"s": 1}, True, result[1:3])]) == [(1, [])]  # allocated outside
    written = result[:3] + [Op("compute", "device", contraction=2)] + result[3:]
    assert deepened([Loop("device", {"s": 1}, True, written)]) == [(1, [])]  # changed while it is copied
    (small,) = pipeline.deepen([Nest([], [Loop("device", {"s": 1}, True, x + result)])], {"s": 4}, cs,
                               lambda body: True, lambda op, loops: op.tensor != "R")
    assert (small.body[0].depth, small.body[0].back) == (2, [])  # a result tile too small for a stream of its own
    assert deepened([Loop("device", {"s": 1}, False, list(x))]) == [(1, [])]  # all ranks: collectives
    assert deepened([Loop("device", {"t": 1}, True, [Loop("device", {"s": 2}, False, list(x))])]) == [(1, []), (2, ["X"])]
    assert deepened([Loop("device", {"s": 4}, True, list(x))]) == [(1, [])]  # one tile
    (kept,) = pipeline.deepen([Nest([], [Loop("device", {"s": 1}, True, list(x))])], {"s": 4}, cs, lambda body: False)
    assert kept.body[0].depth == 1


@pytest.mark.parametrize("memory, expected", [
    ("224KiB", {"ovvv": 2, "ovoo": 2, "t1": 2}),  # whole inputs before a loop over tiles of 2
    ("128KiB", None),  # inputs fetched tile by tile in the loop: nothing opens the nest
    ("1GiB", None),  # one tile: no symmetric loop
])
def test_streamed_inputs_of_the_triples_loop(tmp_path, memory, expected):
    """(T) at o=6, v=10: the inputs read only at an occupied index of the symmetric tile loop
    first stream in rows of one tile; not ``t2`` (also read as ``t2[m,k,b,c]``), ``f_vo`` (read
    as ``f_vo[c,k]``), ``ovov`` or the orbital energies (read through the expressions of the pair
    sums and of the denominator)."""
    plan = make_plan(spec.load(triples_config(tmp_path, memory, 6, 10)))
    found = [pipeline.streamed(nest.body, plan.contractions, plan.tensors) for nest in plan.nests]
    if expected is None:
        assert found == [None]
        return
    (at, rows), = found
    loop = plan.nests[0].body[at]
    assert isinstance(loop, Loop) and loop.symmetric and rows == expected
    assert all(op.op in ("alloc", "load", "get") for op in plan.nests[0].body[:at])
