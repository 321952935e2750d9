"""Device tiles kept across a group of a symmetric loop's tiles (pure, on emitted nests).

A parallel device loop over ordered tuples of symmetric tile positions (the (T) loop over
i ≤ j ≤ k) visits them with its first symmetric index fastest
(:func:`chainexec.runtime.frame.tuples`): the consecutive tuples that differ only in that
index's position form a *group* (:func:`chainexec.runtime.frame.groups`), and an input tile
whose indices do not include that one is the same on every tuple of a group: in (T),
``ovvv[j]``, ``ovvv[k]``, ``t2[k,j]`` and the ``ovoo`` and ``ovov`` tiles of ``j`` and ``k``. Where
the inputs do not fit the device, the loop fetches its tiles from the global array on every tuple
(three ``ovvv`` slabs per tuple in (T)); fetching such a tile once per group instead moves its
bytes once per group of tuples, not once per tuple.

The loop is the paper's loop nest seen from inside one flattened loop: the multi-level paper
(section 4) places each read at the outermost loop its tile does not depend on; a symmetric
loop's tuples have no loop of their own per index, so the group stands in for the loops outside
the first index's.

:func:`keep` chooses the tiles: each fetched by one ``alloc`` and one ``get`` directly in the
loop's body and freed by one ``free`` there, of a tensor nothing in the body writes, over
indices without the first symmetric one; largest first, as many as ``fits`` (the planner's test
of a body's memory peaks, the same room as :func:`chainexec.planner.pipeline.deepen`'s) allows
once their ``alloc`` and ``get`` move to the start of the body and their ``free`` to its end:
the memory model then holds them through every tuple, as the runtime does. ``Loop.kept`` names
them; the runtime hands out whole groups and runs the kept statements at a group's first tuple
(``alloc``, ``get``) and last (``free``) only (:meth:`chainexec.runtime.executor.Executor._held`),
and the cost model counts their gets once per group (:func:`chainexec.planner.cost.units`), so
that the bytes measured equal the prediction whichever rank takes which group. Only in a loop
that tiles its symmetric indices alone: tiles of another index inside a group would change the
kept tiles' neighbours from tuple to tuple.
"""

from __future__ import annotations

import dataclasses

from chainexec.planner.cost import Loops, buffer_elements
from chainexec.planner.pipeline import written
from chainexec.planner.plan import Contraction, Loop, Nest, Op, TensorInfo, key, ops


def groups_loop(loop: Loop, extents: dict[str, int]) -> bool:
    """Whether ``loop`` may keep tiles across groups: a parallel device loop over two or more
    symmetric indices and no other, single-buffered, whose first symmetric index takes more
    than one tile position (else every group is one tuple)."""
    sym = loop.symmetric
    return (loop.level == "device" and loop.parallel and len(sym) >= 2 and set(loop.tiles) == set(sym)
            and loop.depth == 1 and loop.tiles[sym[0]] < extents[sym[0]])


def candidates(loop: Loop, contractions: list[Contraction]) -> list[Op]:
    """The ``alloc`` statements of the tiles ``loop`` could keep (module docstring), in body order."""
    named: dict[tuple, list[Op]] = {}
    for op, around in ops(loop.body):
        if op.level == "device" and op.tensor is not None:
            named.setdefault(key(op), []).append(op if not around else None)
    changed = written(loop.body, contractions)
    found = []
    for node in loop.body:
        if not (isinstance(node, Op) and node.op == "alloc" and node.level == "device"):
            continue
        statements = named[key(node)]
        if (None not in statements and sorted(op.op for op in statements) == ["alloc", "free", "get"]
                and node.tensor not in changed and loop.symmetric[0] not in node.indices):
            found.append(node)
    return found


def moved(loop: Loop, kept: list[tuple]) -> Loop:
    """``loop`` keeping the tiles ``kept`` (keys): their ``alloc`` and ``get`` first in its body,
    in body order, their ``free`` last, and ``Loop.kept`` naming them."""
    held = set(kept)
    head = [op for op in loop.body if isinstance(op, Op) and op.op in ("alloc", "get") and key(op) in held]
    tail = [op for op in loop.body if isinstance(op, Op) and op.op == "free" and key(op) in held]
    taken = {id(op) for op in head + tail}
    rest = [node for node in loop.body if id(node) not in taken]
    order = [key(op) for op in head if op.op == "alloc"]
    return dataclasses.replace(loop, body=head + rest + tail, kept=[[k[0], list(k[1])] for k in order])


def keep(nests: list[Nest], extents: dict[str, int], contractions: list[Contraction],
         tensors: dict[str, TensorInfo], fits, ranks: int = 1) -> list[Nest]:
    """``nests`` with every loop at the top of a nest that may (:func:`groups_loop`) keeping the
    tiles that fit (module docstring); ``fits``: a nest's body → whether its memory peaks are
    acceptable. Not in a loop with fewer groups than ``ranks``: every rank gets work, as
    :func:`chainexec.planner.schedule.split_for_ranks` cut the loop for."""
    out = []
    for nest in nests:
        body = list(nest.body)
        for k, node in enumerate(body):
            if not (isinstance(node, Loop) and groups_loop(node, extents)
                    and Loops([node]).points([], extents, "device", grouped=True) >= ranks):
                continue
            size = {key(op): tensors[op.tensor].itemsize * buffer_elements(op.indices, [node], "device", extents)
                    for op in candidates(node, contractions)}
            chosen: list[tuple] = []
            for buffer in sorted(size, key=lambda b: -size[b]):
                trial = body[:k] + [moved(node, chosen + [buffer])] + body[k + 1:]
                if fits(trial):
                    chosen.append(buffer)
            if chosen:
                body[k] = moved(node, chosen)
        out.append(Nest(nest.contractions, body))
    return out
