"""Terms of a run stacked along their summed ranges: one GEMM where there were several.

A term added on its own to an output reads and writes all of it: 2·itemsize bytes an element
for 2·depth flops (depth: its summed length). In the (T) tile with occupied tiles of one, the six
``ovoo·t2`` terms sum over m (o of them), so each is a pass over all of W (hundreds of MB) for
little arithmetic: one by one, each costs about its bytes, not its flops.
Where two terms split the output's indices the same way between their operands (W[a,(bc)] from
``ovoo[i,a,j,m]·t2[m,k,b,c]`` and ``ovoo[i,a,k,m]·t2[m,j,c,b]``), they are one GEMM over the
concatenated summed ranges, ``[A1 A2]·[B1; B2]``: copies of the operands (each small beside the
output) in place of a pass over it. The strided-batched GEMM paper's
reshaping of operands into GEMM form, applied across terms (beyond the papers).

Pure: which terms stack, and the index orders of the stacked operands. The runtime builds them
(:meth:`chainexec.runtime.backends.tuning.Autotuner._stacked`) and the autotuner decides whether
they win.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STACK_SHARE = 2
"""How much less a stack's copies must move than the passes over the output it saves. A stack
of n terms saves n - 1 passes (each reads and writes the output: 2·size elements) for one write
of its operands' copies (Σ their elements; its GEMM reads them where the terms would read the
operands): it is kept where that sum is at most 2·(n - 1)·size / STACK_SHARE, its largest
terms left out until it is. A term whose own operands hold more than 2·size / STACK_SHARE
elements stays alone. At (T)'s occupied tiles of two (o=40, v=400), an ``ovvv·t2`` term's
operands hold a quarter of W: it stacks with the ``ovoo·t2`` term of its split, whose pass over
W moves more than the copies."""


@dataclass(frozen=True)
class Stack:
    """Terms (positions in the run) added as one contraction ``out += L·R``: ``L`` indexed by the
    stacked summed index then ``left``, ``R`` by it then ``right`` (both in the output's order;
    the output's extent-1 indices go with ``left``). ``sides[n]`` is True where term
    ``terms[n]``'s first operand supplies ``left``'s indices."""

    terms: tuple[int, ...]
    left: tuple[str, ...]
    right: tuple[str, ...]
    sides: tuple[bool, ...]


def _split(out: tuple[str, ...], a: tuple[str, ...], b: tuple[str, ...], extent: dict[str, int]):
    """The output's indices of extent > 1 that ``a`` and ``b`` each carry, or None where the term
    does not fit one GEMM: an index of extent > 1 in both operands and the output (a batch
    index), or an index of one operand only that is not the output's (summed over one side)."""
    if any(i in b and i in out and extent[i] > 1 for i in a):
        return None
    if any(i not in out and i not in other for x, other in ((a, b), (b, a)) for i in x):
        return None
    return (frozenset(i for i in a if i in out and extent[i] > 1),
            frozenset(i for i in b if i in out and extent[i] > 1))


def groups(out: tuple[str, ...], terms: list[tuple[tuple[str, ...], tuple[str, ...]]],
           extents: list[dict[str, int]], share: int = STACK_SHARE) -> list[Stack]:
    """Stacks of two or more terms of a run into ``out`` (term ``n``: operand index tuples
    ``terms[n]``, extents of its indices and the output's ``extents[n]``), in order of their first
    term. Terms stack where they split the output's indices of extent > 1 the same way between
    their operands, where their copies move less than the passes they save (:data:`STACK_SHARE`,
    ``share``)."""
    size = math.prod(extents[0][i] for i in out) if terms else 0
    found: dict[tuple[frozenset, frozenset], list[tuple[int, bool, int]]] = {}
    for n, ((a, b), ext) in enumerate(zip(terms, extents)):
        split = _split(out, a, b, ext)
        elements = math.prod(ext[i] for i in a) + math.prod(ext[i] for i in b)
        if split is None or elements * share > 2 * size:
            continue
        key = tuple(sorted(split, key=lambda s: sorted(out.index(i) for i in s)))
        found.setdefault(key, []).append((n, split[0] == key[0], elements))
    stacks = []
    for (left, right), members in found.items():
        members = sorted(members, key=lambda m: m[2])
        while len(members) > 1 and sum(m[2] for m in members) * share > 2 * (len(members) - 1) * size:
            members.pop()
        if len(members) < 2:
            continue
        members.sort()
        ones = {i for i in out if extents[members[0][0]][i] == 1}
        stacks.append(Stack(tuple(n for n, _, _ in members), tuple(i for i in out if i in left or i in ones),
                            tuple(i for i in out if i in right), tuple(s for _, s, _ in members)))
    return sorted(stacks, key=lambda s: s.terms[0])
