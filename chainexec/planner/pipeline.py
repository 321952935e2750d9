"""Overlap of disk traffic with work: which global loops are double-buffered (pure, on emitted nests).

The multi-level paper (section 4) costs each level's movement separately and bounds a plan's time
by the slowest level; reaching that bound needs the levels to run at once. At the disk level this
is software pipelining of a sequential global loop: while iteration n runs its device work,
iteration n+1's loads are read and iteration n-1's stores are written by a background I/O worker.
For that, every global buffer the loop body allocates itself (its *staged* buffers) exists twice —
two slots, alternating between iterations — allocated once at loop entry at full tile size and
released at loop exit. The cost model counts both slots against the global memory limit
(:func:`chainexec.planner.cost.predict_nests`), so the tiles the planner fits are the tiles of the
double-buffered nest.

A loop is double-buffered (``depth`` 2) when it is sequential, at the global level, has at least
two iterations, allocates global buffers and moves data to or from disk itself (a direct ``alloc``
and a direct ``load`` or ``store``), and allocates no global buffer deeper in its body (so that its staged buffers are all its global memory and the
prediction stays exact). Loops of one iteration are dropped first: a fused group's loop inside a
disk group's loop over the same tiles would otherwise hide the loads from the loop that repeats.
"""

from __future__ import annotations

import math

from chainexec.planner.plan import Loop, Nest, Op
from chainexec.planner.tiling import tile_count

DEPTH = 2


def key(op: Op) -> tuple:
    """How the runtime and the cost model know a buffer: tensor, index names, level."""
    return (op.tensor, tuple(op.indices), op.level)


def staged(loop: Loop) -> list[Op]:
    """The ``alloc`` statements of a double-buffered loop's own global buffers (one per buffer);
    empty for any other loop."""
    if loop.depth < 2:
        return []
    seen: dict[tuple, Op] = {}
    for node in loop.body:
        if isinstance(node, Op) and node.op == "alloc" and node.level == "global":
            seen.setdefault(key(node), node)
    return list(seen.values())


def prefetched(loop: Loop) -> list[Op]:
    """The statements a double-buffered loop runs one iteration ahead: the leading ``alloc``/``load``
    statements of its body, keeping each staged buffer whose ``load`` fills it there (a buffer
    allocated empty, such as an output, is set up only when its own iteration starts: its other
    slot may still be being written to disk)."""
    lead = []
    for node in loop.body:
        if not (isinstance(node, Op) and node.op in ("alloc", "load") and node.level == "global"):
            break
        lead.append(node)
    loaded = {key(op) for op in lead if op.op == "load"}
    own = {key(op) for op in staged(loop)}
    return [op for op in lead if key(op) in loaded and key(op) in own]


def _iterations(loop: Loop, ranges: dict[str, int]) -> int:
    """Iterations of ``loop`` in the first (full-size) iteration of the loops around it."""
    return math.prod(tile_count(ranges[i], t) for i, t in loop.tiles.items())


def _allocates_global(body) -> bool:
    for node in body:
        if isinstance(node, Loop):
            if _allocates_global(node.body):
                return True
        elif node.op == "alloc" and node.level == "global":
            return True
    return False


def _moves_disk(body) -> bool:
    return any(isinstance(n, Op) and n.op in ("load", "store") for n in body)


def arrange(body: list, extents: dict[str, int], overlap: bool = True, ranges: dict[str, int] | None = None) -> list:
    """``body`` with one-iteration sequential loops dropped and, if ``overlap``, the loops that
    qualify (module docstring) double-buffered. ``ranges``: each index's range at the global level
    in the first iteration of the enclosing loops (whole extents at the top)."""
    ranges = dict(extents) if ranges is None else ranges
    out = []
    for node in body:
        if not isinstance(node, Loop):
            out.append(node)
            continue
        inner = dict(ranges)
        if node.level == "global":
            inner.update({i: min(ranges[i], t) for i, t in node.tiles.items()})
        count = _iterations(node, ranges) if node.level == "global" else None
        sub = arrange(node.body, extents, overlap, inner)
        if count == 1 and not node.parallel:
            out.extend(sub)
            continue
        own = [n for n in sub if isinstance(n, Op) and n.op == "alloc" and n.level == "global"]
        depth = DEPTH if (overlap and count and count >= 2 and not node.parallel and own and _moves_disk(sub)
                          and not any(isinstance(n, Loop) and _allocates_global(n.body) for n in sub)) else 1
        out.append(Loop(node.level, dict(node.tiles), node.parallel, sub, depth, list(node.symmetric)))
    return out


def arrange_nests(nests: list[Nest], extents: dict[str, int], overlap: bool = True) -> list[Nest]:
    return [Nest(n.contractions, arrange(n.body, extents, overlap)) for n in nests]
