"""Tile sizes for one contraction on three levels: the schemes of the multi-level paper, section 4.

The paper groups a contraction C[i,j] = Σ_k A[i,k]·B[k,j] into three composite indices: i (output
indices from A, batch indices included), j (output indices from B) and k (contracted). With
sizes in elements, Mβ the global budget and Mγ the device budget:

- **one array fits** (Fig. 1, section 4): the smallest array stays at its level for the whole
  contraction and the other two stream, so every array moves exactly once (eq. 4.1); when the
  smallest array lies between Mβ/3 and Mβ this is the *mixed* scheme of eq. 4.10–4.12, with the
  streamed tile Tj ≤ (Mβ − Ni·Nk)/(Ni + Nk);
- **streaming** (eq. 4.4–4.7): output-stationary, Ti = Tj ≈ √Mβ, Tk = 1;
- **equal tiles** (eq. 4.8): Ti = Tj = Tk = √(Mβ/3), trading a little disk traffic for much less
  global↔device traffic;
- the choice rule eq. 4.9: equal tiles win when √Mβ ≥ (√3 − 1)·Λαβ/Λβγ + √3 (the extracted text
  prints Mβ on the left; the derivation from eq. 4.4, 4.5 and 4.8 with q_k = 2 gives √Mβ).

A composite tile size T is spread over its indices innermost-first (the fastest-varying index of
the tensor gets its whole extent before the next is cut), so that tiles stay contiguous. Every
scheme's tiles are then checked against the real footprint (element size, all three buffers) and
shrunk greedily where the continuous formula overshoots (:func:`choose_tiles`).
"""

from __future__ import annotations

import math

from chainexec.planner.plan import Contraction


# Tile counts :func:`choose_tiles` steps an index through: every count up to this, then each about
# 1/STEPS more than the last.
STEPS = 64


def tile_count(extent: int, tile: int) -> int:
    return -(-extent // tile)


def _next_count(count: int) -> int:
    """The tile count after ``count`` in :func:`choose_tiles`' steps (:data:`STEPS`)."""
    return count + max(1, count // STEPS)


def buffers(c: Contraction) -> list[list[str]]:
    """Index lists of the buffers a contraction holds at once at one level (output, a[, b])."""
    return [c.out_indices, c.a_indices] + ([c.b_indices] if c.b is not None else [])


def composites(c: Contraction) -> dict[str, list[str]]:
    """The paper's composite indices: i (out indices of a, batch included), j (out indices of b
    only), k (contracted), each listed innermost (fastest-varying in its operand) first."""
    b = c.b_indices or []
    i = [x for x in reversed(c.a_indices) if x in c.out_indices]
    j = [x for x in reversed(b) if x in c.out_indices and x not in c.a_indices]
    k = [x for x in reversed(c.a_indices) if x not in c.out_indices]
    return {"i": i, "j": j, "k": k}


def spread(names: list[str], extents: dict[str, int], size: float) -> dict[str, int]:
    """Per-index tiles whose product is about ``size`` (≥ 1), innermost index filled first."""
    tiles, left = {}, max(1.0, size)
    for name in names:
        t = max(1, min(extents[name], int(left)))
        tiles[name] = t
        left = max(1.0, left / t)
    return tiles


def footprint(c: Contraction, tiles: dict[str, int], itemsize: int, whole: dict[str, int] | None = None) -> int:
    """Bytes of the output and operand tiles held together at full tile size; the buffers named in
    ``whole`` (role → its element count: ``"a"`` or ``"b"``) are held entire (resident)."""
    whole = whole or {}
    return itemsize * sum(whole[role] if role in whole else math.prod(tiles[i] for i in idx)
                          for role, idx in zip(("out", "a", "b"), buffers(c)))


def movement(c: Contraction, extents: dict[str, int], tiles: dict[str, int]) -> int:
    """Elements moved into and out of a level by the output-stationary nest:

        |A| · Π_{i ∈ out, i ∉ A} n_i + |B| · Π_{i ∈ out, i ∉ B} n_i + |C| · (1 + p · Π_{k ∉ out} n_k)

    n_i = ⌈E_i / T_i⌉; an operand is re-read once per tile of each output index it lacks, and the
    output tile takes one accumulation from the device per contracted tile (p = Π_{k ∉ out} n_k,
    eq. 4.5's q_k term)."""
    n = {i: tile_count(extents[i], tiles[i]) for i in tiles}
    out = set(c.out_indices)
    ks = [i for i in tiles if i not in out]
    total = math.prod(extents[i] for i in c.out_indices) * (1 + math.prod(n[i] for i in ks))
    for idx in buffers(c)[1:]:
        reloads = math.prod(n[i] for i in out - set(idx))
        total += math.prod(extents[i] for i in idx) * reloads
    return total


def minimal_footprint(c: Contraction, itemsize: int, extents: dict[str, int]) -> int:
    """Bytes the smallest possible tiling (every tile 1, but for what the contraction keeps
    whole) needs at one level."""
    return footprint(c, {i: extents[i] if i in c.whole() else 1 for i in c.indices()}, itemsize)


def choose_tiles(c: Contraction, extents: dict[str, int], itemsize: int, budget: int,
                 start: dict[str, int] | None = None, free: list[str] | None = None,
                 whole: dict[str, int] | None = None) -> dict[str, int] | None:
    """Tiles (≤ ``extents``, from ``start`` or whole extents) shrunk until the three buffers fit
    ``budget`` bytes, cutting only ``free`` indices (default: all) and never those the
    contraction keeps whole (:meth:`~chainexec.planner.plan.Contraction.whole`); None if that
    cannot fit.

    Greedy: among single-index steps to the next larger tile count, take the one with the least
    extra movement per byte freed (ties: larger tile, then name, for determinism). The counts
    are 1, 2, …, :data:`STEPS`, then each larger by a factor of about 1 + 1/STEPS, so that an
    index of extent E takes at most STEPS · (1 + ln(E / STEPS)) steps (about 830 for E = 10⁷,
    2 800 for E = 2⁶³) and the whole search that many per free index, whatever the extents."""
    tiles = {i: extents[i] if i in c.whole() else min(extents[i], (start or extents).get(i, extents[i]))
             for i in c.indices()}
    free = set(tiles if free is None else free) - set(c.whole())
    if footprint(c, {i: 1 if i in free else tiles[i] for i in tiles}, itemsize, whole) > budget:
        return None
    mem, cost = footprint(c, tiles, itemsize, whole), movement(c, extents, tiles)
    while mem > budget:
        best = None
        for i in sorted(free, key=lambda j: (-tiles[j], j)):
            if tiles[i] == 1:
                continue
            trial = dict(tiles)
            trial[i] = min(tile_count(extents[i], _next_count(tile_count(extents[i], tiles[i]))), tiles[i] - 1)
            freed = mem - footprint(c, trial, itemsize, whole)
            if freed <= 0:
                continue
            score = (movement(c, extents, trial) - cost) / freed
            if best is None or score < best[0]:
                best = (score, trial)
        if best is None:
            return None
        tiles = best[1]
        mem, cost = footprint(c, tiles, itemsize, whole), movement(c, extents, tiles)
    return tiles


def equal_tiles_win(m_beta: float, lam_ab: float, lam_bg: float) -> bool:
    """Eq. 4.9: equal tiles beat streaming when √Mβ ≥ (√3 − 1)·Λαβ/Λβγ + √3 (Mβ in elements)."""
    return math.sqrt(m_beta) >= (math.sqrt(3) - 1) * lam_ab / lam_bg + math.sqrt(3)


def scheme_tiles(c: Contraction, extents: dict[str, int], itemsize: int, budget: int,
                 scheme: str) -> tuple[dict[str, int], list[str]] | None:
    """Tiles for one level by the named scheme, and the operands it keeps resident; None when the
    scheme does not apply (e.g. no array fits) or nothing fits at all. ``budget``: the level's
    bytes; ``itemsize``: bytes per element; M = budget / itemsize, the level's elements.

    ``streaming``: Ti = Tj = √M, Tk = 1 (eq. 4.4–4.7). ``equal``: Ti = Tj = Tk = √(M/3) (eq. 4.8).
    ``fits``: the smallest array whole and the others streamed so that it is read once (Fig. 1,
    eq. 4.10–4.12). ``greedy``: whole extents shrunk by :func:`choose_tiles`."""
    m = budget / itemsize
    comp = composites(c)
    if scheme == "greedy":
        tiles = choose_tiles(c, extents, itemsize, budget)
        return (tiles, []) if tiles is not None else None
    if scheme in ("streaming", "equal"):
        side = math.sqrt(m) if scheme == "streaming" else math.sqrt(m / 3)
        start = spread(comp["i"], extents, side) | spread(comp["j"], extents, side)
        start |= spread(comp["k"], extents, 1 if scheme == "streaming" else side)
        tiles = choose_tiles(c, extents, itemsize, budget, start)
        return (tiles, []) if tiles is not None else None
    if scheme != "fits":
        raise ValueError(f"unknown tiling scheme {scheme!r}")
    return _fits(c, extents, itemsize, budget)


def _fits(c: Contraction, extents, itemsize, budget):
    """Fig. 1: keep the smallest array X whole and never tile X's output indices, so that no
    streamed array sits inside a loop that does not index it and every array moves once
    (resident A: tiles over j and k; resident B: over i and k; resident C: over k only)."""
    idx = dict(zip(("out", "a", "b"), buffers(c)))
    sizes = {name: math.prod(extents[i] for i in ix) for name, ix in idx.items()}
    smallest = min(sizes, key=lambda n: (sizes[n], n))
    if sizes[smallest] * itemsize >= budget:
        return None
    free = [i for i in c.indices() if not (i in idx[smallest] and i in c.out_indices)]
    whole = {} if smallest == "out" else {smallest: sizes[smallest]}
    tiles = choose_tiles(c, extents, itemsize, budget, free=free, whole=whole)
    if tiles is None:
        return None
    return tiles, ([] if smallest == "out" else [c.a if smallest == "a" else c.b])
