"""Statements over packed tensors as contractions over *pair indices* (pure).

A tensor stored packed (:mod:`chainexec.pairs`; ``docs/symmetry.md``) is, for the planner, a
tensor over pair indices: a symmetric pair ``(p, q)`` becomes one index ``p_q`` of
``n (n + 1) / 2`` positions (``pair(p, q) = p (p + 1) / 2 + q``, ``p >= q``), and with the
pairs' exchange the two pair indices become one index of their own pairs. So an s4 tensor
``A[p,q,r,s]`` is ``A[p_q, r_s]`` — its dataset as PySCF writes it — and its tiles are row
ranges of that matrix: they move packed through every level, and the cost model counts packed
bytes as it counts any tensor's.

Two kinds of step relate a pair index to its members (:attr:`Contraction.pairs`), each a
gather on the device:

- **unpack**: ``X[…, r, s, …] = A[…, r_s, …]`` — the output holds both members where the operand
  holds the pair (both triangles filled);
- **pack**: ``Y[…, c_d, …] = T[…, c, d, …]`` — the output keeps the triangle ``c >= d`` of a
  result symmetric in ``c, d``.

Neither sums; its joint index space is its output's, so a loop never cuts the operand's side of
the pair (:meth:`chainexec.planner.plan.Contraction.indices`).

**The four-index transform** — one packed four-index tensor times matrices, each contracting one
of its indices into an index of the result (``B[a,b,c,d] = C[p,a] C[q,b] C[r,c] C[s,d]
A[p,q,r,s]``, and its partial and general forms) — becomes the two half-transforms over pairs
that PySCF's ``ao2mo`` runs (:func:`transform`): unpack the column pair, contract its members,
pack the result's column pair where the result declares it; then the same for the row pair. The
first half runs over pair rows, ``n (n + 1) / 2`` instead of ``n²``, and the second over the
result's column pairs: half the work of the dense chain. Any other statement reading a packed
tensor reads it unpacked whole, and any other statement into a packed tensor computes it dense
and packs it (:func:`unpacked`, :func:`packed`): correct for every chain, with no saving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chainexec.pairs import npair

LAYOUT_PAIRS = {"s2": (0,), "s2ij": (0,), "s2kl": (2,), "s4": (0, 2), "s8": (0, 2)}
"""The index positions where each packed layout's pairs start."""


def pair_name(a: str, b: str, names: set[str]) -> str:
    """The name of the pair index of members ``a`` and ``b``: ``a_b``, with ``_`` appended while
    ``names`` (the chain's own index names) has it."""
    name = f"{a}_{b}"
    while name in names:
        name += "_"
    return name


@dataclass(frozen=True)
class Form:
    """A tensor reference's packed form: its indices with each packed pair replaced by its pair
    index (``indices``), and the pair indices with their members (``pairs``), outermost first:
    the pair of pairs of an s8 tensor, then the pairs."""

    indices: tuple[str, ...]
    pairs: tuple[tuple[str, tuple[str, str]], ...]


def form(indices: tuple[str, ...], kind: str | None, names: set[str], extents: dict[str, int]) -> Form:
    """The packed form of a reference ``indices`` to a tensor of layout ``kind`` (None: dense);
    every pair index's extent is added to ``extents``."""
    if kind is None:
        return Form(tuple(indices), ())
    idx = list(indices)
    pairs = []
    for at in reversed(LAYOUT_PAIRS[kind]):
        a, b = idx[at], idx[at + 1]
        name = pair_name(a, b, names)
        extents[name] = npair(extents[a])
        idx[at:at + 2] = [name]
        pairs.insert(0, (name, (a, b)))
    if kind == "s8":
        row, col = idx
        name = pair_name(row, col, names)
        extents[name] = npair(extents[row])
        pairs.insert(0, (name, (row, col)))
        idx = [name]
    return Form(tuple(idx), tuple(pairs))


@dataclass
class Step:
    """One step of a lowered statement: ``out[out] = a[a_indices] · b[b_indices]`` (a contraction,
    ``b`` None: a copy) or, with ``pairs`` (the pair index and its members), a pack or an unpack.
    ``a`` None reads the step before's output; the last step writes the statement's result."""

    out: tuple[str, ...]
    a: str | None
    a_indices: tuple[str, ...]
    b: str | None = None
    b_indices: tuple[str, ...] | None = None
    pairs: dict[str, list[str]] | None = None

    def flops(self, extents: dict[str, int]) -> int:
        """2 per point of the joint index space of a contraction, 1 per output element of a
        copy, pack or unpack."""
        if self.b is None:
            return math.prod(extents[i] for i in self.out)
        joint = dict.fromkeys(list(self.out) + list(self.a_indices) + list(self.b_indices))
        return 2 * math.prod(extents[i] for i in joint)


def _unpack(name: str | None, indices: tuple[str, ...], pair: str, members: tuple[str, str]) -> Step:
    at = indices.index(pair)
    return Step(indices[:at] + members + indices[at + 1:], name, indices, pairs={pair: list(members)})


def _pack(name: str | None, indices: tuple[str, ...], pair: str, members: tuple[str, str]) -> Step:
    at = indices.index(members[0])
    return Step(indices[:at] + (pair,) + indices[at + 2:], name, indices, pairs={pair: list(members)})


def unpacked(name: str, ref: Form) -> list[Step]:
    """The steps that unpack every pair of reference ``ref`` to tensor ``name``, outermost first."""
    steps, current, indices = [], name, ref.indices
    for pair, members in ref.pairs:
        steps.append(_unpack(current, indices, pair, members))
        current, indices = None, steps[-1].out
    return steps


def packed(indices: tuple[str, ...], result: Form) -> list[Step]:
    """The steps that pack a dense result over ``indices`` into ``result``'s form (the step
    before's output; its pairs, then its pair of pairs)."""
    steps, current = [], indices
    for pair, members in reversed(result.pairs):
        steps.append(_pack(None, current, pair, members))
        current = steps[-1].out
    return steps


def transform(name: str, ref: Form, statement: tuple[str, ...], matrices: list[tuple[str, tuple[str, str]]],
              lhs: tuple[str, ...], result: Form) -> list[Step] | None:
    """The steps of a four-index transform of tensor ``name`` (its reference's packed form
    ``ref``, the statement's indices of it ``statement``) by ``matrices`` (name and the indices of
    its reference: one of the operand's, one of the result's) into the result ``lhs`` of packed
    form ``result``; None where the statement is no such transform (each matrix contracts one
    index of the operand into a result index, and the result's indices are the operand's with
    those replaced, in order)."""
    by_index = {}
    for m, ix in matrices:
        inner = [i for i in ix if i in statement]
        if len(inner) != 1:
            return None
        i, o = inner[0], next(x for x in ix if x != inner[0])
        if i in by_index or o not in lhs or o in (x for _, x, _ in by_index.values()):
            return None
        by_index[i] = (m, o, ix)
    if len(statement) != 4 or tuple(by_index[i][1] if i in by_index else i for i in statement) != lhs:
        return None
    rename = dict(zip(statement, lhs))
    wanted = dict(result.pairs)
    steps: list[Step] = []
    current, indices = name, ref.indices
    pairs = dict(ref.pairs)
    if len(indices) == 1:  # s8: its pair of pairs first
        steps.append(_unpack(current, indices, indices[0], pairs[indices[0]]))
        current, indices = None, steps[-1].out
    for at in (2, 0):  # the column pair, then the row pair
        i, j = statement[at], statement[at + 1]
        pair = next((p for p, m in pairs.items() if m == (i, j)), None)
        moved = [k for k in (j, i) if k in by_index]
        if pair is not None and moved:
            steps.append(_unpack(current, indices, pair, (i, j)))
            current, indices = None, steps[-1].out
        for k in moved:
            m, o, ix = by_index[k]
            steps.append(Step(tuple(o if x == k else x for x in indices), current, indices, m, tuple(ix)))
            current, indices = None, steps[-1].out
        members = (rename[i], rename[j])
        target = next((p for p, mm in wanted.items() if mm == members), None)
        if target is not None and pair is not None and not moved:
            indices = tuple(target if x == pair else x for x in indices)  # the same pair, renamed
            if target != pair:
                steps.append(Step(indices, current, tuple(pair if x == target else x for x in indices)))
                current = None
        elif target is not None:
            steps.append(_pack(current, indices, target, members))
            current, indices = None, steps[-1].out
        elif pair is not None and not moved:
            steps.append(_unpack(current, indices, pair, (i, j)))
            current, indices = None, steps[-1].out
    outer = next((p for p, (row, col) in result.pairs if (row, col) == indices), None) if len(indices) == 2 else None
    if outer is not None:  # an s8 result: its pair of pairs
        steps.append(_pack(current, indices, outer, indices))
        current, indices = None, steps[-1].out
    if indices != result.indices or not steps:
        return None
    return steps
