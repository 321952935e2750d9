"""Which loops of a plan a run can checkpoint and resume (pure).

A parallel loop over device tiles whose body only reads global buffers and adds into global
buffers that exist before it (the (T) energy: every tile adds its share to E) has a progress
that is small to save: the tiles handed out so far and the accumulation targets' contents. Both
are consistent at any moment when every rank has finished its tile and no rank has started
another, which the runtime arranges (:mod:`chainexec.runtime.checkpoint`). Loops with loads or
stores inside (the disk level changes as they go) or nested in other loops are not resumable;
they rerun from their start.
"""

from __future__ import annotations

from .plan import Loop, Nest, ops


def resumable(nest: Nest) -> list[int]:
    """Positions in ``nest.body`` of its resumable loops: top-level parallel loops with at least
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
