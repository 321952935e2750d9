"""Arithmetic of ordered tile tuples and ordered elements, shared by the planner (which prices
them) and the runtime (which runs them): which symmetric indices share a tile, how many
non-decreasing points a tile holds, and each point's weight.

A loop over ordered tuples of symmetric indices (:attr:`chainexec.planner.plan.Loop.symmetric`)
visits tile positions ``p_1 ≤ p_2 ≤ …``; a tuple's *pattern* numbers its blocks of equal
positions (``(0, 1, 1)``: the second and third equal). Within a tile whose positions are equal, a
full reduction sums only the points whose coordinates are non-decreasing within each group of
equal positions, each weighted by the number of its distinct permutations
(:mod:`chainexec.planner.ordered` says when).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np


def pattern_of(positions: list[int]) -> tuple[int, ...]:
    """The pattern (:func:`patterns`) of ordered tile positions."""
    if not positions:
        return ()
    blocks = [0]
    for p, q in zip(positions, positions[1:]):
        blocks.append(blocks[-1] + (q != p))
    return tuple(blocks)


def groups(symmetric: list[str], pattern: tuple[int, ...], ones: bool = False) -> tuple[tuple[str, ...], ...]:
    """The groups of ``symmetric`` indices (loop order) that share a tile in a tile tuple of
    ``pattern`` (:func:`chainexec.planner.symmetry.pattern_of`), groups of one left out unless
    ``ones`` (a group of one orders nothing: its weights are all 1)."""
    found = [tuple(i for i, b in zip(symmetric, pattern) if b == block) for block in sorted(set(pattern))]
    return tuple(g for g in found if ones or len(g) > 1)


def dims(within: tuple[tuple[str, ...], ...], indices) -> tuple[tuple[int, ...], ...]:
    """The groups of index names ``within`` as positions in ``indices`` (a buffer's or a domain's
    order), as the backends take them."""
    return tuple(tuple(list(indices).index(i) for i in g) for g in within)


def ordered_count(extents: list[int]) -> int:
    """Non-decreasing tuples of elements of indices sharing one tile (``extents``: each one's
    elements there, all equal): ``C(s + g - 1, g)`` for ``g`` indices of ``s`` elements."""
    if len(set(extents)) != 1:
        raise ValueError(f"indices sharing a tile with unequal extents {extents}")
    return math.comb(extents[0] + len(extents) - 1, len(extents))


def points(sizes: dict[str, int], within: tuple[tuple[str, ...], ...]) -> int:
    """Points of a statement over the indices of ``sizes`` (index -> elements of its tile) that an
    ordered reduction sums where the indices of each group of ``within`` share one tile: each
    group's non-decreasing tuples, times the other indices' elements."""
    grouped = {i for g in within for i in g}
    return math.prod(n for i, n in sizes.items() if i not in grouped) * math.prod(
        ordered_count([sizes[i] for i in g]) for g in within)


@lru_cache(maxsize=64)
def weights(shape: tuple[int, ...], within: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """Per point of a tile of ``shape``: the number of distinct permutations of its coordinates
    within each group of dimensions of ``within`` (multiplied over the groups) where they are
    non-decreasing in every group, else 0. Extent 1 along the dimensions of no group (it
    broadcasts over them). float64, read-only: made once per shape and pattern, with array
    operations over the points (a (T) run meets a new pattern on each of its first tiles).

    A group's non-decreasing coordinates fall in runs of equal values of lengths L1, L2, …; its
    distinct permutations number n! / (L1!·L2!·…), and the product of those factorials is the
    product over the coordinates of each one's place in its run (1 at a run's start, one more
    for each equal coordinate before it)."""
    grouped = sorted({d for g in within for d in g})
    if not grouped:
        out = np.ones((1,) * len(shape))
        out.flags.writeable = False
        return out
    grid = np.indices([shape[d] for d in grouped]).reshape(len(grouped), -1)
    where = {d: n for n, d in enumerate(grouped)}
    out = np.ones(grid.shape[1])
    for g in within:
        values = grid[[where[d] for d in g]]
        out *= math.factorial(len(g))
        place = np.ones(grid.shape[1])
        for t in range(1, len(g)):
            out *= values[t] >= values[t - 1]
            place = np.where(values[t] == values[t - 1], place + 1, 1)
            out /= place
    out = out.reshape([shape[d] if d in where else 1 for d in range(len(shape))])
    out.flags.writeable = False
    return out
