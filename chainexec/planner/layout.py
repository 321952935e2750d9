"""File layout of the intermediates stored between nests (pure, on emitted nests).

An intermediate that one nest stores and a later nest loads is written in blocks cut by its
producer's global loops and read back in tiles cut by its consumer's. In a row-major file a tile's
part of a block is one contiguous run per combination of its leading indices, so the read is a few
long runs when the indices both loops cut come first, and millions of runs of a few elements when
a cut index is the last one (the four-index transform read its stored intermediate 4 elements at a
time). The binarization chose index orders without knowing the loops; here, once the nests exist,
each such intermediate's indices are reordered: those its consumers' global loops cut (outermost
loop first), then those its producer's cut, then the others as they were. Every reference to the
tensor — contractions, statements and the expressions of fused statements — is permuted alike;
bytes and memory do not change.
Outputs keep the order the config gives them.
"""

from __future__ import annotations

from chainexec.planner.inline import expression
from chainexec.planner.plan import Contraction, Nest, TensorInfo, ops


def _cut_positions(op, loops) -> list[int]:
    """Positions of ``op``'s indices that its enclosing global loops tile, outermost loop first."""
    found: list[int] = []
    for loop in loops:
        if loop.level != "global":
            continue
        for name in loop.tiles:
            if name in op.indices and op.indices.index(name) not in found:
                found.append(op.indices.index(name))
    return found


def stream_order(nests: list[Nest], tensor: str, rank: int) -> list[int]:
    """The new order of ``tensor``'s index positions (a permutation of range(rank))."""
    loads, stores = [], []
    for nest in nests:
        for op, loops in ops(nest.body):
            if op.tensor == tensor and op.op in ("load", "store"):
                (loads if op.op == "load" else stores).append(_cut_positions(op, loops))
    order: list[int] = []
    for cut in loads + stores + [list(range(rank))]:
        order += [p for p in cut if p not in order]
    return order


def relayout(nests: list[Nest], contractions: list[Contraction], tensors: dict[str, TensorInfo]) -> None:
    """Reorder the indices of every stored intermediate (module docstring), in place."""
    stored = {op.tensor for nest in nests for op, _ in ops(nest.body) if op.op == "store"}
    reordered = False
    for name in sorted(stored):
        t = tensors[name]
        if t.role != "intermediate":
            continue
        perm = stream_order(nests, name, len(t.indices))
        if perm == sorted(perm):
            continue

        def permuted(ix: list[str]) -> list[str]:
            return [ix[p] for p in perm]

        reordered = True
        t.indices, t.shape = permuted(t.indices), [t.shape[p] for p in perm]
        for c in contractions:
            if c.out == name:
                c.out_indices = permuted(c.out_indices)
            if c.a == name:
                c.a_indices = permuted(c.a_indices)
            if c.b == name:
                c.b_indices = permuted(c.b_indices)
        for nest in nests:
            for op, _ in ops(nest.body):
                if op.tensor == name:
                    op.indices = permuted(op.indices)
    if reordered:  # a fused statement's expression names its references as they are now
        for nest in nests:
            for op, _ in ops(nest.body):
                if op.op == "fused":
                    op.expression = expression(op, contractions, tensors)
