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

The same pipelining one level down (:func:`deepen`): a device loop (parallel, or inside a parallel
one) whose body fetches input tiles (``alloc``/``get`` at the device level) gets ``depth`` 2 where the device limit leaves
room for a second copy of those buffers (of all of them, else of as many as fit). Their two
slots are allocated at loop entry; the runtime copies those inputs of tile n+1 host→device on a
second CUDA stream while the device computes tile n (:meth:`chainexec.runtime.executor.Executor._ahead`). Unlike the disk level,
the tiles are chosen first and the second slots only added where they fit, so a plan that fills
the device limit keeps its tiles and single buffers. Results flow back the same way: a tile the
loop accumulates into a global array (``alloc``, ``accumulate`` and ``free`` in its body) gets two
slots too where they fit (``Loop.back``), and its copy to the host runs on a third stream while
the device computes the next tile into the other slot
(:meth:`chainexec.runtime.landing.Landing.accumulate`).
"""

from __future__ import annotations

import dataclasses
import math

from chainexec import expr
from chainexec.planner.plan import DEPTH, Contraction, Loop, Nest, Op, TensorInfo, key, ops
from chainexec.planner.tiling import tile_count

def _gets(body: list, contractions: list[Contraction], kept: list = ()) -> list[tuple]:
    """The buffers (keys, in body order) that one device ``alloc`` and one ``get`` directly in
    ``body`` fill with an input tile, where nothing else in the body, nested loops included,
    allocates or fetches the same buffer or writes its tensor (accumulates it, computes it,
    evaluates it): a tile fetched one tile ahead would miss what the tile before wrote. Not the
    tiles the loop keeps across a group (``kept``, :mod:`chainexec.planner.keep`)."""
    counts: dict[tuple, list[str]] = {}
    for op, _ in ops(body):
        if op.level == "device" and op.op in ("alloc", "get"):
            counts.setdefault(key(op), []).append(op.op)
    found = written(body, contractions)
    held = {(tensor, tuple(indices), "device") for tensor, indices in kept}
    direct = [key(node) for node in body if isinstance(node, Op) and node.op == "get" and node.level == "device"
              and key(node) not in held]
    return [k for k in direct if sorted(counts[k]) == ["alloc", "get"] and k[0] not in found]


def _results(body: list, contractions: list[Contraction]) -> list[tuple]:
    """The buffers (keys, in body order) that one device ``alloc``, one ``accumulate`` and one
    ``free`` directly in ``body`` name and no other statement of the body, nested loops included,
    does (no ``get`` of the tensor either, and nothing writes it after the accumulate, which the
    copy aside would race): a tile computed, accumulated into its global array and dropped
    within each iteration, whose two slots then alternate between iterations."""
    counts: dict[tuple, list[str]] = {}
    got = set()
    for op, _ in ops(body):
        if op.level == "device" and op.op in ("alloc", "accumulate", "free", "get"):
            counts.setdefault(key(op), []).append(op.op)
        if op.op == "get":
            got.add(op.tensor)
    own = [key(n) for n in body if isinstance(n, Op) and n.op in ("alloc", "accumulate", "free")]
    direct = [(k, key(node)) for k, node in enumerate(body) if isinstance(node, Op) and node.op == "accumulate"]
    return [b for k, b in direct if sorted(counts[b]) == ["accumulate", "alloc", "free"] and own.count(b) == 3
            and b[0] not in got | written(body[k + 1:], contractions)]


def written(body: list, contractions: list[Contraction]) -> set[str]:
    """The tensors statements of ``body`` (nested loops included) write: accumulate, compute
    (their output), evaluate or fuse."""
    out = set()
    for op, _ in ops(body):
        if op.op in ("accumulate", "eval", "fused"):
            out.add(op.tensor)
        elif op.op == "compute":
            out.add(contractions[op.contraction].out)
    return out


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
        if node.level == "global":
            inner = ranges | {i: min(ranges[i], t) for i, t in node.tiles.items()}
            count = _iterations(node, ranges)
        else:
            inner, count = ranges, None
        sub = arrange(node.body, extents, overlap, inner)
        if count == 1 and not node.parallel:
            out.extend(sub)
            continue
        depth = DEPTH if (overlap and count and count >= 2 and not node.parallel
                          and any(isinstance(n, Op) and n.op == "alloc" and n.level == "global" for n in sub)
                          and _moves_disk(sub)
                          and not any(isinstance(n, Loop) and _allocates_global(n.body) for n in sub)) else 1
        out.append(Loop(node.level, dict(node.tiles), node.parallel, sub, depth, list(node.symmetric)))
    return out


def streamed(body: list, contractions: list[Contraction], tensors: dict[str, TensorInfo]) -> tuple[int, dict[str, int]] | None:
    """Whole inputs a symmetric tile loop can start on before they are all in (pure).

    A nest that opens with ``alloc``/``load``/``get`` statements (inputs read whole to global
    memory, then copied whole to the device) followed by a parallel device loop over symmetric
    indices visits its tiles with the largest position slowest
    (:func:`chainexec.runtime.frame.tuples`): a tile at largest position p reads only the
    first ``(p + 1)·tile`` rows of an input whose every reference in the loop has one of the
    symmetric indices first. Such an input can be read from disk and copied to the device in rows
    of one tile while the loop runs (the runtime does; on several ranks each reads its share
    and the others wait for it, :meth:`chainexec.runtime.streaming.Streams.ready`), so that the loop starts after
    its first rows instead of after every input: in (T) ``ovvv``, ``ovoo``, ``ovov`` and ``t1``; at
    o=40 v=400 ``ovvv`` alone is 20 GB of the 23 GB read, seconds of disk and copy time that would
    otherwise come before the first tile.

    Returns the loop's position in ``body`` and, per streamed tensor, its rows per chunk (the
    symmetric indices' tile); None where nothing can be streamed. A tensor read through a computed
    tensor's expression, or at another first index, or named by a statement of the loop, is not
    streamed."""
    at = next((k for k, node in enumerate(body) if isinstance(node, Loop)), None)
    if at is None or any(node.op not in ("alloc", "load", "get") for node in body[:at]):
        return None
    loop = body[at]
    if not (loop.parallel and loop.level == "device" and loop.symmetric):
        return None
    loads = [op.tensor for op in body[:at] if op.op == "load"]
    gets = [op.tensor for op in body[:at] if op.op == "get"]
    first: dict[str, set[str]] = {}
    for op, _ in ops(loop.body):
        group = [op.contraction] if op.op == "compute" else (op.group or []) if op.op == "fused" else []
        for k in group:
            for name, indices in contractions[k].operands():
                first.setdefault(name, set()).add(indices[0] if indices else "")
    through = {r.tensor for t in tensors.values() if t.computed() for r in expr.text_refs(t.source["expr"])}
    named = {op.tensor for op, _ in ops(loop.body)}  # fetched, freed or written in the loop
    chosen = {t: loop.tiles[next(iter(first[t]))] for t in dict.fromkeys(gets)
              if loads.count(t) == 1 and gets.count(t) == 1 and t not in through | named and first.get(t)
              and first[t] <= set(loop.symmetric)}
    return (at, chosen) if chosen else None


def deepen(nests: list[Nest], extents: dict[str, int], contractions: list[Contraction], fits,
           large=lambda op, loops: True) -> list[Nest]:
    """``nests`` with every device loop that fetches input tiles (:func:`_gets`) or accumulates
    results (:func:`_results`), runs at least two tiles and is or lies in a parallel loop (one
    rank's own tiles: no collective call among its statements) double-buffered (``depth`` 2,
    :func:`fetched`, :func:`returned`) where ``fits`` (a loop-nest body → whether its memory
    peaks are acceptable: the cost model's, which counts the second slots) allows: all its input
    tiles fetched ahead, else as many as fit, first ones first (their frees inside the body no
    longer lower its peak, so the second slots can cost more than the tiles' bytes); at each
    count, with its results copied back aside if they fit too, else without. A result is copied
    back aside only where ``large`` (its ``alloc`` statement, the loops around it → bool: its
    tile is worth a stream of its own, :attr:`chainexec.planner.machine.Machine.aside_copy_bytes`)
    says so. Loops are taken in order, each keeping the room the ones before it left. The tiles
    are not changed."""

    def candidates(body, ranges, shared=False, path=()):
        for k, node in enumerate(body):
            if not isinstance(node, Loop):
                continue
            inside = shared or node.parallel
            moves = _gets(node.body, contractions, node.kept) or _results(node.body, contractions)
            if node.level == "device" and inside and moves and _iterations(node, ranges) >= 2:
                yield path + (k,)
            inner = dict(ranges) | {i: min(ranges[i], t) for i, t in node.tiles.items()}
            yield from candidates(node.body, inner, inside, path + (k,))

    def at(body, path):
        return body[path[0]] if len(path) == 1 else at(body[path[0]].body, path[1:])

    def chain(body, path):
        """The loops along ``path``, outermost first."""
        return [at(body, path[:k]) for k in range(1, len(path) + 1)]

    def replaced(body, path, ahead, back):
        k, rest = path[0], path[1:]
        loop = body[k]
        loop = (dataclasses.replace(loop, body=replaced(loop.body, rest, ahead, back)) if rest
                else dataclasses.replace(loop, depth=DEPTH, ahead=ahead, back=back))
        return body[:k] + [loop] + body[k + 1:]

    def named(keys):
        return [[tensor, list(indices)] for tensor, indices, _ in keys]

    out = []
    for nest in nests:
        body = list(nest.body)
        for path in list(candidates(body, dict(extents))):
            loop, loops = at(body, path), chain(body, path)
            allocs = {key(op): op for op in loop.body if isinstance(op, Op) and op.op == "alloc"}
            keys = _gets(loop.body, contractions, loop.kept)
            results = [k for k in _results(loop.body, contractions) if large(allocs[k], loops)]
            trials = (replaced(body, path, named(keys[:count]), back)
                      for count in range(len(keys), -1, -1) for back in ([named(results), []] if results else [[]])
                      if count or back)
            body = next((trial for trial in trials if fits(trial)), body)
        out.append(Nest(nest.contractions, body))
    return out
