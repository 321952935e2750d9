"""Operation-minimal binarization of multi-operand products.

A statement ``B[a,b,c,d] = C[p,a] * C[q,b] * C[r,c] * C[s,d] * A[p,q,r,s]`` is one sum over eight
indices (O(N⁸) as written); contracted pairwise in the right order it is four O(N⁵) steps. For
up to :data:`MAX_OPTIMAL` operands this module finds the order with the fewest floating-point
operations by dynamic programming over subsets of operands (the exact "optimal" search of
opt_einsum, O(3ⁿ) in the number of operands n), which is exhaustive and therefore equals the
brute-force minimum over all binary trees. Beyond that, as opt_einsum's ``auto`` does, it takes a
greedy order (:func:`_greedy`, O(n² log n)): the exhaustive search weighs three times as many
splits per operand more (3²⁰ ≈ 3.5·10⁹ at 20). :func:`strategy` names the one used; plans record
it per contraction.

Costs are counted as 2 flops (multiply + add) per point of a contraction's index space.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

# Operands up to which the order is the exhaustive optimum: at most 3¹⁰ = 59 049 splits weighed.
MAX_OPTIMAL = 10


@dataclass(frozen=True)
class Step:
    """One binary contraction of the chosen order: ``out = left * right``.

    ``left``/``right`` are operand positions (< n) or earlier steps (n + step number); ``indices``
    lists the indices the result keeps, in order.
    """

    left: int
    right: int
    indices: tuple[str, ...]
    flops: int


def contraction_flops(left: tuple[str, ...], right: tuple[str, ...], extents: dict[str, int]) -> int:
    """2 × the size of the joint index space of a binary contraction (flops)."""
    return 2 * math.prod(extents[i] for i in set(left) | set(right))


def _kept(mask: int, operands: list[tuple[str, ...]], keep: tuple[str, ...], big: int) -> tuple[str, ...]:
    """Indices of the partial product over ``mask`` that are still needed outside it: those of the
    largest operand ``big`` first in its order (when ``mask`` holds it), then first-seen order."""
    inside: list[str] = list(operands[big]) if mask >> big & 1 else []
    outside = set(keep)
    for k, idx in enumerate(operands):
        if mask >> k & 1:
            inside.extend(i for i in idx if i not in inside)
        else:
            outside.update(idx)
    return tuple(i for i in inside if i in outside)


def _layout_score(mask: int, kept: tuple[str, ...], operands: list[tuple[str, ...]], big: int) -> int:
    """How far back in the largest operand the indices an intermediate keeps of it sit (Σ of their
    positions; lower is better). An intermediate holding the largest operand (usually the one read
    from disk) is produced inside loops over the indices it keeps of it; keeping the leading ones
    makes those loops cut the row-major file into contiguous slabs instead of strided columns."""
    if not mask >> big & 1:
        return 0
    return sum(operands[big].index(i) for i in kept if i in operands[big])


def strategy(n: int) -> str:
    """How :func:`binarize` orders a product of ``n`` operands: ``optimal`` (the exhaustive
    minimum) up to :data:`MAX_OPTIMAL` operands, ``greedy`` beyond."""
    return "optimal" if n <= MAX_OPTIMAL else "greedy"


def binarize(operands: list[tuple[str, ...]], keep: tuple[str, ...], extents: dict[str, int]) -> list[Step]:
    """The sequence of binary contractions for the product of ``operands`` kept on ``keep``: the
    flop-minimal one, or the greedy one beyond :data:`MAX_OPTIMAL` operands (:func:`strategy`).

    Ties between flop-minimal orders are broken by the smaller sum of intermediate sizes, then by
    the disk layout (the intermediates that hold the largest operand keep its leading indices:
    :func:`_layout_score`; the four-index transform then contracts the file's last index first),
    then by the first split found, so the result is deterministic. The last step's indices are
    reordered to ``keep``.
    """
    n = len(operands)
    if n < 2:
        return []
    if strategy(n) == "greedy":
        return _greedy(operands, keep, extents)
    full = (1 << n) - 1
    big = max(range(n), key=lambda k: (math.prod(extents[i] for i in operands[k]), -k))
    kept = {m: _kept(m, operands, keep, big) for m in range(1, full + 1)}
    best: dict[int, tuple[int, int, int, tuple[int, int] | None]] = {1 << k: (0, 0, 0, None) for k in range(n)}
    for mask in sorted(range(1, full + 1), key=lambda m: bin(m).count("1")):
        if mask in best:
            continue
        choice = None
        sub = (mask - 1) & mask
        while sub:
            other = mask ^ sub
            if sub < other:
                fl = best[sub][0] + best[other][0] + contraction_flops(kept[sub], kept[other], extents)
                size = best[sub][1] + best[other][1] + math.prod(extents[i] for i in kept[mask])
                layout = best[sub][2] + best[other][2] + _layout_score(mask, kept[mask], operands, big)
                if choice is None or (fl, size, layout) < choice[:3]:
                    choice = (fl, size, layout, (sub, other))
            sub = (sub - 1) & mask
        best[mask] = choice
    steps: list[Step] = []
    position: dict[int, int] = {1 << k: k for k in range(n)}

    def emit(mask: int) -> int:
        if mask in position:
            return position[mask]
        sub, other = best[mask][3]
        left, right = emit(sub), emit(other)
        indices = keep if mask == full else kept[mask]
        steps.append(Step(left, right, indices, contraction_flops(kept[sub], kept[other], extents)))
        position[mask] = n + len(steps) - 1
        return position[mask]

    emit(full)
    return steps


def _greedy(operands: list[tuple[str, ...]], keep: tuple[str, ...], extents: dict[str, int]) -> list[Step]:
    """Pairwise greedy order: at each step, of all pairs of the tensors left (operands and results
    of earlier steps), contract the one with the fewest flops, then the smallest result, then the
    lowest positions. A result keeps the indices of its pair that a tensor left or ``keep`` still
    holds, in the order they first appear in the pair. O(n² log n) for n operands: a pair's cost
    never changes while both its tensors are left (a result holds every index its pair shared
    with others), so each pair is priced once, in a heap."""
    n = len(operands)
    left = dict(enumerate(operands))  # position (operand, or n + step) -> indices
    holders: dict[str, int] = {}  # index -> how many tensors left hold it
    for idx in operands:
        for i in set(idx):
            holders[i] = holders.get(i, 0) + 1
    heap: list = []

    def price(x: int, y: int) -> None:
        a, b = left[x], left[y]
        kept = tuple(i for i in dict.fromkeys(a + b) if i in keep or holders[i] > (i in a) + (i in b))
        heapq.heappush(heap, (contraction_flops(a, b, extents), math.prod(extents[i] for i in kept), x, y, kept))

    for x in range(n):
        for y in range(x + 1, n):
            price(x, y)
    steps: list[Step] = []
    while len(left) > 1:
        flops, _, x, y, kept = heapq.heappop(heap)
        if x not in left or y not in left:
            continue
        for i in [*set(left.pop(x)), *set(left.pop(y))]:  # an index of both leaves with two holders
            holders[i] -= 1
        for i in kept:
            holders[i] += 1
        steps.append(Step(x, y, kept if left else keep, flops))
        others = list(left)
        left[n + len(steps) - 1] = kept
        for z in others:
            price(z, n + len(steps) - 1)
    return steps
