"""Which loops and nest ends of a plan a run can checkpoint and resume (pure); :func:`mark` writes
the answer into the plan (``Loop.resume``, ``Nest.checkpoint_after``), which the runtime
(:mod:`chainexec.runtime.checkpoint`, :class:`chainexec.runtime.executor.Executor`) and
``chainexec plan`` read instead of deciding again.

- An **accumulate** loop is a parallel loop over device tiles at the top of a nest whose body
  only reads global buffers and adds into global buffers that exist before it (the (T) energy:
  every tile adds its share to E). Its progress is small to save: the tiles handed out so far
  and the accumulation targets' contents, both consistent when every rank has finished its tile
  and no rank has started another, which the runtime arranges.
- A **store** loop is a sequential global loop at the top of a nest whose iterations each store
  their own tiles (the four-index transform's loops, out-of-core chains): every tensor it stores
  or accumulates into has its global buffer allocated inside it, so that nothing but the disk
  carries over from one iteration to the next; each stored tensor has every index the loop
  tiles, so that iterations store disjoint tiles; nothing inside loads a version stored inside.
  Its progress is the iterations finished, whose stored blocks every rank has made durable.
- A **nest end** where no global or device buffer lives on leaves everything the nests so far
  made in their stored versions: a resumed run skips those nests.

A loop is resumable only where every store before it in its nest lies inside a store loop, which
a resumed run skips: a store that ran again would write its tiles twice. Loops nested in other
loops are not resumable; they rerun from their start.
"""

from __future__ import annotations

import collections

from .plan import Loop, Nest, ops


def accumulating(nest: Nest) -> list[int]:
    """Positions in ``nest.body`` of its accumulate loops: top-level parallel loops with at least
    one ``accumulate`` and no ``load``, ``store`` or global allocation in their body (a device
    loop's tiles fetched one ahead do not matter: the runtime takes the next tile, and fetches
    it, only once the last one's statements are queued)."""
    out = []
    for k, node in enumerate(nest.body):
        if not (isinstance(node, Loop) and node.parallel):
            continue
        inner = [op for op, _ in ops(node.body)]
        if any(op.op in ("load", "store") or (op.op == "alloc" and op.level == "global") for op in inner):
            continue
        if any(op.op == "accumulate" for op in inner):
            out.append(k)
    return out


def storing(nest: Nest) -> list[int]:
    """Positions in ``nest.body`` of its store loops: top-level sequential global loops with at
    least one ``store``, whose stored and accumulated tensors are allocated at the global level
    inside them, whose stores each have every index the loop tiles, and which load no version
    they store."""
    out = []
    for k, node in enumerate(nest.body):
        if not (isinstance(node, Loop) and node.level == "global" and not node.parallel):
            continue
        inner = [op for op, _ in ops(node.body)]
        stores = [op for op in inner if op.op == "store"]
        own = {op.tensor for op in inner if op.op == "alloc" and op.level == "global"}
        written = {op.tensor for op in inner if op.op in ("store", "accumulate")}
        loaded = {(op.tensor, op.version) for op in inner if op.op == "load"}
        if (stores and written <= own and all(set(node.tiles) <= set(op.indices) for op in stores)
                and not loaded & {(op.tensor, op.version) for op in stores}):
            out.append(k)
    return out


def mark(nests: list[Nest]) -> None:
    """Set ``Loop.resume`` on every top-level loop (``accumulate``, ``store`` or None) and
    ``Nest.checkpoint_after`` on every nest, by the rules of this module."""
    live: collections.Counter = collections.Counter()
    for nest in nests:
        kinds = {k: "accumulate" for k in accumulating(nest)} | {k: "store" for k in storing(nest)}
        stored = False  # a store before this point that a resumed run would run again
        for k, node in enumerate(nest.body):
            if isinstance(node, Loop):
                node.resume = None if stored else kinds.get(k)
                stored |= node.resume != "store" and any(op.op == "store" for op, _ in ops(node.body))
            else:
                stored |= node.op == "store"
        for op, _ in ops(nest.body):
            if op.op in ("alloc", "free") and op.level in ("global", "device"):
                live[(op.tensor, tuple(op.indices), op.level)] += 1 if op.op == "alloc" else -1
        nest.checkpoint_after = not any(live.values())
