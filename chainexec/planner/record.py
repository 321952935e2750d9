"""What the runtime reads of a plan's nests besides their statements, recorded on them as data
(pure, in place): the runtime interprets these fields and never works them out again, and the
cost model prices the same fields, so that "measured = predicted" compares two readings of one
plan.

- :attr:`Op.run` on the first compute statement of each run of terms
  (:func:`chainexec.planner.plan.term_run`, as the executor meets them:
  :func:`chainexec.planner.plan.executed`): how many statements it adds in one pass.
- :attr:`Op.fill` False on an ``alloc`` whose buffer is written whole before anything reads it
  (a global buffer that a ``load`` of the input's source fills; a device buffer that the run of
  terms after it writes first), and :attr:`Op.fresh` on that run's first statement: no zero fill,
  the run writes the buffer as if it held zeros.
- :attr:`Op.fresh` on an ``accumulate`` that is the only write of its global buffer, once per
  region (:func:`_results`), and ``fill`` False on that buffer's ``alloc``: each tile is then
  written into the buffer, not added to zeros.
- :attr:`Nest.streamed`: the inputs a symmetric tile loop starts on before they are all in
  (:func:`chainexec.planner.pipeline.streamed`).
- :attr:`Loop.count` on each top-level loop a checkpoint can stop in: the number of tiles, or of
  groups of them, it hands out (:func:`chainexec.planner.cost.units`).

:func:`runs` is called before every full prediction (the cost model reads ``Op.run``);
:func:`finish` once on the chosen nests.
"""

from __future__ import annotations

from chainexec.planner import symmetry
from chainexec.planner.cost import units
from chainexec.planner.pipeline import streamed
from chainexec.planner.plan import Contraction, Loop, Nest, Op, TensorInfo, ops


def _bodies(body: list, loop: Loop | None = None):
    """Every loop-nest body with the loop it is the body of (None for a nest's own)."""
    yield body, loop
    for node in body:
        if isinstance(node, Loop):
            yield from _bodies(node.body, node)


def runs(nests: list[Nest], contractions: list[Contraction]) -> list[Nest]:
    """Set :attr:`Op.run` on the first statement of every run of terms (None on every other
    compute statement); returns ``nests``."""
    for nest in nests:
        for body, loop in _bodies(nest.body):
            for node in body:
                if isinstance(node, Op) and node.op == "compute":
                    node.run = None
            for run in symmetry.runs(body, loop, contractions):
                body[run[0]].run = len(run)
    return nests


def finish(nests: list[Nest], contractions: list[Contraction], tensors: dict[str, TensorInfo],
           extents: dict[str, int]) -> None:
    """Record every field of the module docstring on the chosen nests."""
    runs(nests, contractions)
    for nest in nests:
        _fills(nest.body, contractions)
        _results(nest.body)
        found = streamed(nest.body, contractions, tensors)
        nest.streamed = None if found is None else {"loop": found[0], "rows": found[1]}
        for node in nest.body:
            if isinstance(node, Loop) and node.resume is not None:
                node.count = units(node, extents)


def _fills(body: list, contractions: list[Contraction]) -> None:
    """:attr:`Op.fill` and :attr:`Op.fresh` in ``body`` and its loops' bodies."""
    for op, _ in ops(body):
        op.fill = op.fresh = None
    after: dict[str, Op] = {}
    for op, _ in reversed(list(ops(body))):
        if op.op == "alloc" and op.level == "global":
            nxt = after.get(op.tensor)
            if (nxt is not None and nxt.op == "load" and nxt.level == "global" and nxt.indices == op.indices
                    and nxt.version == 0):
                op.fill = False
        if op.tensor is not None:
            after[op.tensor] = op
    for inner, _ in _bodies(body):
        for k, node in enumerate(inner):
            if isinstance(node, Op) and node.op == "compute" and node.run and symmetry.fresh(inner, k, contractions):
                c = contractions[node.contraction]
                if c.out not in (c.a, c.b):
                    alloc = next(n for n in reversed(inner[:k]) if isinstance(n, Op) and n.op == "alloc"
                                 and n.level == "device" and n.tensor == c.out)
                    alloc.fill = False
                    node.fresh = True


def _results(body: list) -> None:
    """Mark the ``accumulate`` of a tensor as ``fresh`` and its global ``alloc`` as needing no
    fill where the nest allocates the tensor in global memory once, accumulates it once and
    writes it no other way, and every loop between the two cuts only the tensor's own indices
    (no loop over a summed index, no symmetric loop): every element is then accumulated exactly
    once, so the tile can be written instead of added to zeros."""
    found = list(ops(body))
    for tensor in {op.tensor for op, _ in found if op.op == "accumulate"}:
        named = [(op, loops) for op, loops in found if op.tensor == tensor]
        allocs = [(op, loops) for op, loops in named if op.op == "alloc" and op.level == "global"]
        adds = [(op, loops) for op, loops in named if op.op == "accumulate"]
        if len(allocs) != 1 or len(adds) != 1 or any(op.op in ("load", "eval", "fused") for op, _ in named):
            continue
        (alloc, outer), (add, inner) = allocs[0], adds[0]
        if list(inner[:len(outer)]) != list(outer) or any(
                loop.symmetric or set(loop.tiles) - set(add.indices) for loop in inner[len(outer):]):
            continue
        add.fresh, alloc.fill = True, False
