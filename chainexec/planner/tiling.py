"""Tile sizes for one contraction at one memory level.

Planner v1 tiles every contraction output-stationary at both levels (the loop structure of Fig. 1 of
the multi-level paper, section 4, with the output tile held while the contracted indices stream):
for each output tile, for each contracted tile, the A and B tiles are brought in. The movement that
results is, in elements,

    |A| · Π_{i ∈ out, i ∉ A} n_i  +  |B| · Π_{i ∈ out, i ∉ B} n_i  +  |C| · (1 + p · Π_{k ∉ out} n_k)

with n_i = ⌈E_i / T_i⌉ tiles of index i: an operand is re-read once per tile of each output index
it lacks. At the global level (p = 1) the output tile also receives one accumulation from the
device per contracted tile; at the device level (p = 0) the output tile stays put over them. :func:`choose_tiles` shrinks tiles greedily, always taking the step that buys the most
memory per element of extra movement, until the three buffers fit the level's budget.
"""

from __future__ import annotations

import math

from chainexec.planner.plan import Contraction


def tile_count(extent: int, tile: int) -> int:
    return -(-extent // tile)


def buffers(c: Contraction) -> list[list[str]]:
    """Index lists of the buffers a contraction holds at once at one level (output, a[, b])."""
    return [c.out_indices, c.a_indices] + ([c.b_indices] if c.b is not None else [])


def footprint(c: Contraction, tiles: dict[str, int], itemsize: int) -> int:
    """Bytes of the output and operand tiles held together at full tile size."""
    return itemsize * sum(math.prod(tiles[i] for i in idx) for idx in buffers(c))


def movement(c: Contraction, extents: dict[str, int], tiles: dict[str, int], passes: bool) -> int:
    """Elements moved into and out of the level by the output-stationary nest (module docstring);
    ``passes`` counts the output's accumulations from the level below (the global level)."""
    n = {i: tile_count(extents[i], tiles[i]) for i in tiles}
    out = set(c.out_indices)
    ks = [i for i in tiles if i not in out]
    total = math.prod(extents[i] for i in c.out_indices) * (1 + (math.prod(n[i] for i in ks) if passes else 0))
    for idx in buffers(c)[1:]:
        reloads = math.prod(n[i] for i in out - set(idx))
        total += math.prod(extents[i] for i in idx) * reloads
    return total


def minimal_footprint(c: Contraction, itemsize: int) -> int:
    """Bytes the smallest possible tiling (every tile 1) needs at one level."""
    return footprint(c, {i: 1 for i in c.indices()}, itemsize)


def choose_tiles(c: Contraction, extents: dict[str, int], itemsize: int, budget: int,
                 passes: bool) -> dict[str, int] | None:
    """Tile size per index of ``c`` (≤ ``extents``) whose buffers fit ``budget`` bytes, or None.

    Greedy: start from whole extents; while too large, among all single-index steps to the next
    larger tile count, take the one with the least extra movement per byte freed (ties: the larger
    index extent first, then name order, for determinism).
    """
    tiles = {i: extents[i] for i in c.indices()}
    if footprint(c, {i: 1 for i in tiles}, itemsize) > budget:
        return None
    mem, cost = footprint(c, tiles, itemsize), movement(c, extents, tiles, passes)
    while mem > budget:
        best = None
        for i in sorted(tiles, key=lambda j: (-tiles[j], j)):
            if tiles[i] == 1:
                continue
            trial = dict(tiles)
            trial[i] = tile_count(extents[i], tile_count(extents[i], tiles[i]) + 1)
            trial[i] = min(trial[i], tiles[i] - 1)
            freed = mem - footprint(c, trial, itemsize)
            if freed <= 0:
                continue
            extra = movement(c, extents, trial, passes) - cost
            score = extra / freed
            if best is None or score < best[0]:
                best = (score, trial)
        if best is None:
            return None
        tiles = best[1]
        mem, cost = footprint(c, tiles, itemsize), movement(c, extents, tiles, passes)
    return tiles
