"""Permutational symmetry of a tensor's indices, as a config declares it, and the packed layout
that stores each of its values once.

A tensor declares symmetric *pairs* of adjacent indices (``A[p,q,r,s] = A[q,p,r,s]`` for the
pair ``(p, q)``) and, with exactly two pairs of one extent, their *exchange*
(``A[p,q,r,s] = A[r,s,p,q]``: the 8-fold symmetry of real two-electron integrals ``(pq|rs)``)::

    tensors:
      A:
        indices: [p, q, r, s]
        symmetry: {pairs: [[p, q], [r, s]], exchange: true}
        layout: packed          # or dense (the default)

A packed tensor stores each pair's lower triangle ``p >= q`` as one index of ``n (n + 1) / 2``
positions (``pair(p, q) = p (p + 1) / 2 + q``), and with the exchange the lower triangle of the
pairs' matrix again: PySCF's layouts (:mod:`chainexec.packing`; ``docs/symmetry.md``). A
four-index tensor's packed layout has PySCF's name (:attr:`Symmetry.kind`): one pair ``s2ij`` or
``s2kl``, both ``s4``, both and their exchange ``s8``; a matrix's one pair is ``s2``.

A statement that assigns a tensor declared symmetric must keep that symmetry: exchanging the
members of a pair (or the two pairs) in its result must give the same sum, up to renaming the
indices it sums over and to the symmetries its operands declare (:func:`preserved`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

LAYOUTS = ("s2", "s2ij", "s2kl", "s4", "s8")
"""PySCF's names of the packed layouts (``aosym`` of ``mol.intor``; ``s2`` packs a matrix)."""

MAX_SUMMED = 8
"""Most indices a statement into a symmetric tensor may sum over: :func:`preserved` tries every
renaming of them (``8! = 40,320``)."""


def npair(n: int) -> int:
    """Number of symmetric pairs ``p >= q`` of an index of extent ``n``: ``n (n + 1) / 2``."""
    return n * (n + 1) // 2


@dataclass(frozen=True)
class Symmetry:
    """Symmetric pairs of adjacent indices, by the position of their first index in the tensor
    (``(0, 2)``: indices 0–1 and 2–3), and whether the two pairs exchange."""

    pairs: tuple[int, ...]
    exchange: bool = False

    def kind(self, rank: int) -> str:
        """PySCF's name of the packed layout of a tensor of ``rank`` indices with this symmetry."""
        if rank == 2:
            return "s2"
        if self.exchange:
            return "s8"
        return {(0, 2): "s4", (0,): "s2ij", (2,): "s2kl"}[self.pairs]

    def layouts(self, rank: int) -> tuple[str, ...]:
        """The packed layouts a tensor of ``rank`` indices with this symmetry may be stored in:
        those packing only pairs (and an exchange) it declares."""
        if rank == 2:
            return ("s2",)
        found = [{(0,): "s2ij", (2,): "s2kl", (0, 2): "s4"}[p] for p in ((0,), (2,), (0, 2)) if set(p) <= set(self.pairs)]
        return tuple(found + (["s8"] if self.exchange else []))

    def permutations(self, rank: int) -> list[tuple[int, ...]]:
        """Every order of a tensor's ``rank`` index positions that the symmetry maps the tensor
        onto itself by (the identity first)."""
        generators = [{a: a + 1, a + 1: a} for a in self.pairs]
        if self.exchange:
            a, c = self.pairs
            generators.append({a: c, a + 1: c + 1, c: a, c + 1: a + 1})
        found = [tuple(range(rank))]
        frontier = list(found)
        while frontier:
            current = frontier.pop()
            for g in generators:
                image = tuple(g.get(i, i) for i in current)
                if image not in found:
                    found.append(image)
                    frontier.append(image)
        return found


def parse(value, indices: tuple[str, ...], extents: dict[str, int]) -> Symmetry:
    """A ``symmetry:`` declaration of a tensor over ``indices``; raises :class:`ValueError` with
    the problem."""
    if not isinstance(value, dict) or not set(value) <= {"pairs", "exchange"} or "pairs" not in value:
        raise ValueError(f"symmetry is a mapping {{pairs: [[p, q], ...], exchange: true|false}}, not {value!r}")
    pairs = value["pairs"]
    exchange = value.get("exchange", False)
    if not isinstance(exchange, bool):
        raise ValueError(f"symmetry: exchange is true or false, not {exchange!r}")
    if (not isinstance(pairs, list) or not pairs
            or not all(isinstance(x, list) and len(x) == 2 and all(isinstance(i, str) for i in x) for x in pairs)):
        raise ValueError(f"symmetry: pairs is a list of index pairs such as [[p, q], [r, s]], not {pairs!r}")
    members = [i for x in pairs for i in x]
    if len(set(members)) != len(members):
        raise ValueError(f"symmetry: an index is in two pairs: {pairs}")
    for a, b in pairs:
        if a not in indices or b not in indices:
            raise ValueError(f"symmetry: pair [{a}, {b}] names an index the tensor does not have ({', '.join(indices)})")
        if indices.index(b) != indices.index(a) + 1:
            raise ValueError(f"symmetry: pair [{a}, {b}] is not two adjacent indices of the tensor, in its order")
        if extents[a] != extents[b]:
            raise ValueError(f"symmetry: pair [{a}, {b}] has extents {extents[a]} and {extents[b]}; a symmetric "
                             "pair's indices have one extent")
    if len(indices) == 2 and exchange:
        raise ValueError("symmetry: exchange needs two pairs")
    if len(indices) not in (2, 4):
        raise ValueError(f"symmetry: declared on tensors of 2 or 4 indices (the packed layouts), not {len(indices)}")
    if len(indices) == 4 and exchange:
        if len(pairs) != 2 or extents[pairs[0][0]] != extents[pairs[1][0]]:
            raise ValueError("symmetry: exchange needs two pairs of one extent")
    return Symmetry(tuple(sorted(indices.index(a) for a, _ in pairs)), exchange)


def preserved(lhs: tuple[str, ...], symmetry: Symmetry, refs: list[tuple[str, tuple[str, ...]]],
              declared: dict[str, Symmetry], extents: dict[str, int]) -> str | None:
    """Whether a statement ``lhs = Π refs`` (``refs``: tensor name and its indices) keeps the
    symmetry of its result: for each generator of ``symmetry`` (a pair's members swapped, the
    pairs exchanged), renaming the result's indices by it must map the product onto itself, up to
    a renaming of the summed indices (among indices of one extent) and the permutations each
    operand's own declared symmetry allows. Returns None where it does, else why not."""
    summed = sorted({i for _, ix in refs for i in ix} - set(lhs))
    if len(summed) > MAX_SUMMED:
        return f"it sums over {len(summed)} indices; a symmetric result is checked for at most {MAX_SUMMED}"

    def canonical(mapping: dict[str, str]) -> list:
        terms = []
        for name, ix in refs:
            renamed = tuple(mapping.get(i, i) for i in ix)
            sym = declared.get(name)
            if sym is not None:
                renamed = min(tuple(renamed[n] for n in perm) for perm in sym.permutations(len(ix)))
            terms.append((name, renamed))
        return sorted(terms)

    original = canonical({})
    generators = [((lhs[a], lhs[a + 1]),) for a in symmetry.pairs]
    if symmetry.exchange:
        a, c = symmetry.pairs
        generators.append(((lhs[a], lhs[c]), (lhs[a + 1], lhs[c + 1])))
    for swaps in generators:
        sigma = {}
        for x, y in swaps:
            sigma[x], sigma[y] = y, x
        if not any(canonical(sigma | dict(zip(summed, perm))) == original
                   for perm in itertools.permutations(summed)
                   if all(extents[i] == extents[j] for i, j in zip(summed, perm))):
            shown = ", ".join(f"{x}<->{y}" for x, y in swaps)
            return f"exchanging {shown} in the result does not give the same sum"
    return None
