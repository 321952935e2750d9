"""Runs of terms that permutations of their output's indices map onto themselves, computed once
per orbit on the tiles that such a permutation maps onto themselves (pure).

A symmetric tile loop (:attr:`chainexec.planner.plan.Loop.symmetric`) visits the tile tuples
``p_i ≤ p_j ≤ p_k`` only. Where two of those positions are equal, a permutation of the
symmetric indices (with its partners among the other indices) maps the tile onto itself. A run
of terms into one output (:func:`chainexec.planner.plan.term_run`) that the same permutation
maps onto itself, as a set, then adds on that tile the same products several times, each read
with permuted axes. The (T) W run is one: the pair permutations of ``(i a)(j b)(k c)`` map its
six ``ovvv·t2`` terms onto each other, and so its six ``ovoo·t2`` terms. So on such a tile one
term per orbit of the tile's stabilizer H is enough, added into the output, which then becomes
Σ over H of itself read with each permutation's axes (in place: every point's new value is read
from its own orbit of points, :meth:`chainexec.runtime.device.Backend.symmetrize`). That
restores the run only where the output held nothing before it, so only runs into a buffer
allocated just before them are marked (:func:`fresh`). A term that some element of H maps onto
itself is taken at its factor divided by the number of such elements, so that the sum over H
restores it exactly once.

Over the whole loop the terms run add up to Σ over the tile cube of each tile once instead of
each ordered tile tuple times the number of terms: at benzene's (T) sizes (o=21, v=93, tiles of
6) the plan's flops fall from 3.38 to 1.79 TFLOP, W's twelve terms to 2·o³v³(o+v) = 1.70. On a
tile with i = j = k that is two terms, one GEMM and a pass reading six permuted views, and with
two of them equal six terms, instead of twelve.

The planner marks a run (:attr:`chainexec.planner.plan.Op.symmetrized` on its first statement);
the cost model (:mod:`chainexec.planner.cost`) prices each pattern of equal positions with the
terms and the pass the executor runs there, so predicted flops, statements, streamed bytes and
peaks still equal the measured ones. The terms go into the output itself, symmetrized in place,
not into a scratch tile whose permuted views are then added to the output (``+= Σ``): that
would take a second tile of device memory and, on a diagonal (T) tile, eight passes over the
tile instead of two.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from functools import lru_cache

from chainexec.ordering import ordered_count
from chainexec.planner.plan import Contraction, Loop, Op, ops, pattern_key, term_run
from chainexec.planner.plan import runs as plan_runs

Term = tuple
"""A term as plain data: ``(a, a_indices, b, b_indices, factor)`` (``b`` None for a copy)."""


def terms(cs: list[Contraction]) -> tuple[Term, ...]:
    """The run's terms as hashable plain data, in run order."""
    return tuple((c.a, tuple(c.a_indices), c.b, tuple(c.b_indices or ()), float(c.factor)) for c in cs)


def _renamed(term: Term, names: dict[str, str]) -> Term:
    a, ai, b, bi, factor = term
    return a, tuple(names.get(i, i) for i in ai), b, tuple(names.get(i, i) for i in bi), factor


def _key(term: Term):
    """A term up to the order of its two factors."""
    a, ai, b, bi, factor = term
    return tuple(sorted([(a, ai), (str(b), bi)])), factor


@lru_cache(maxsize=256)
def invariances(run: tuple[Term, ...], out: tuple[str, ...], symmetric: tuple[str, ...],
                free: frozenset[str], extents: tuple[tuple[str, int], ...]) -> tuple[tuple[tuple[str, str], ...], ...]:
    """The renamings of ``out``'s indices that map the run's terms onto themselves (as a
    multiset), identity first: each permutes ``symmetric`` among themselves and moves another
    output index only within ``free`` (indices every tile sees whole), to one of equal extent.
    A renaming is given as ``(index, image)`` pairs in ``out``'s order; summed indices stay.
    Every output index is an index of the first term (a run of contractions), so where an
    invariance maps that term fixes it: at most two candidates per term are checked (an output
    index neither operand of it holds stays where it is)."""
    extent = dict(extents)
    identity = (tuple((i, i) for i in out),)
    if not set(symmetric) <= set(out):
        return identity  # a symmetric index the output lacks: left as it is
    found = []
    wanted = Counter(_key(t) for t in run)
    a, ai, b, bi, factor = run[0]
    for target in run:  # an invariance maps the first term onto some term; that fixes it on out
        ta, tai, tb, tbi, tfactor = target
        matchings = [(ai + bi, tai + tbi)] if (a, b) == (ta, tb) else []
        if (a, b) == (tb, ta):
            matchings.append((ai + bi, tbi + tai))
        for source, image in matchings:
            if len(source) != len(image) or tfactor != factor:
                continue
            names = {}
            if any(names.setdefault(i, j) != j for i, j in zip(source, image)):
                continue
            moved = {i: j for i, j in names.items() if i != j}
            if (any(i not in out or j not in out for i, j in moved.items())  # summed indices stay
                    or sorted(names.get(i, i) for i in out) != sorted(out)
                    or any((i in symmetric) != (j in symmetric) or (i not in symmetric and i not in free)
                           or extent[i] != extent[j] for i, j in moved.items())):
                continue
            renaming = tuple((i, names.get(i, i)) for i in out)
            if renaming not in found and Counter(_key(_renamed(t, names)) for t in run) == wanted:
                found.append(renaming)
    found.sort(key=lambda g: any(i != j for i, j in g))  # identity first
    return tuple(found)


def stabilizer(group, symmetric: tuple[str, ...], blocks: tuple[int, ...]):
    """The renamings of ``group`` that keep each symmetric index within its block: ``blocks[n]``
    names the tile position of ``symmetric[n]`` (equal positions: the same tile)."""
    where = dict(zip(symmetric, blocks))
    return tuple(g for g in group if all(where[i] == where[j] for i, j in g if i in where))


def gemm_score(out: tuple[str, ...], side: frozenset, other: frozenset, sizes: dict[str, int]) -> int:
    """Elements of one GEMM of a term that splits ``out``'s indices into ``side`` and ``other``
    (each operand's own), in the batched-GEMM form of its operands copied into ``out``'s order
    (:func:`chainexec.kernels.batchedgemm.operand_orders`): one GEMM dimension is the run of
    consecutive output indices of one side that ends at ``out``'s unit-stride last index, the
    other the largest such run of the other side; the rest are batched. At (T)'s W in the order
    W[i,j,k,a,b,c] the split (a|bc) makes GEMMs of v²×(o·v), (ab|c) v²×v, (ac|b) only o²×v."""
    runs: dict[frozenset, list[int]] = {side: [], other: []}
    for n, i in enumerate(out):
        for s in runs:
            if i in s:
                runs[s].append(sizes[i] * runs[s][-1] if n and out[n - 1] in s else sizes[i])
    if not out or out[-1] not in side | other:
        return 0
    last = side if out[-1] in side else other
    rest = other if last is side else side
    return runs[last][-1] * max(runs[rest], default=1)


@lru_cache(maxsize=1024)
def orbit_terms(run: tuple[Term, ...], out: tuple[str, ...], H,
                sizes: tuple[tuple[str, int], ...] = ()) -> tuple[tuple[int, float], ...] | None:
    """One term per orbit of ``H`` on the run's terms, as (position, factor scale), or None where
    that would not run fewer terms. Within an orbit the term is taken whose GEMM is the largest
    (:func:`gemm_score` at the extents ``sizes``), and of those one whose split of the output's
    indices between its two operands is that of a term already taken, where one is, so that the
    backend can still stack them into one GEMM (:mod:`chainexec.kernels.stacking`); the scale is
    1 / (the elements of ``H`` that map it onto itself). Why the GEMM first: on a (T) tile with
    i = j, W in the order W[i,j,k,a,b,c], the orbits pair an (ac|b) term with an (a|bc) one;
    taken as they come, two of the three stacks are GEMMs of o²×v, each as slow as the tile's
    other stacks together."""
    keys = [_key(t) for t in run]
    extent = dict.fromkeys(out, 1) | dict(sizes)

    # each term's output indices held by its first and by its second operand
    sides = [(frozenset(i for i in t[1] if i in out), frozenset(i for i in t[3] if i in out)) for t in run]
    taken, seen = [], set()
    for k, t in enumerate(run):
        if k in seen:
            continue
        images = [_key(_renamed(t, dict(g))) for g in H]
        orbit = sorted({n for n, key in enumerate(keys) if key in images})
        seen.update(orbit)
        splits = {frozenset(sides[n]) for n, _ in taken}
        pick = max(orbit, key=lambda n: (gemm_score(out, *sides[n], extent), frozenset(sides[n]) in splits, -n))
        fixed = sum(_key(_renamed(run[pick], dict(g))) == keys[pick] for g in H)
        taken.append((pick, 1.0 / fixed))
    return tuple(taken) if len(taken) < len(run) else None


def axes(H, out: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """The axis permutation of ``out``'s tile for each renaming of ``H``: the orbit terms' sum
    read through ``transpose(p)`` is their sum under that renaming (the sum over the whole
    group is the same in either direction, as the group holds each inverse)."""
    return tuple(tuple(out.index(dict(g)[i]) for i in out) for g in H)


def patterns(m: int) -> list[tuple[int, ...]]:
    """The patterns of equal positions of ``m`` ordered tile positions, as block numbers per
    index: (0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 1, 2) for three; ``()`` for none (a run in no
    symmetric loop, whose tiles every permutation of its free indices maps onto themselves)."""
    if m == 0:
        return [()]
    found = []
    for cuts in itertools.product((False, True), repeat=m - 1):
        block, blocks = 0, [0]
        for cut in cuts:
            block += cut
            blocks.append(block)
        found.append(tuple(blocks))
    return found


def pattern_sums(factors: list[list[int]], ordered: bool = False) -> dict[tuple[int, ...], int]:
    """Σ over tile positions p_0 ≤ … ≤ p_m of Π_j factors[j][p_j], split by the pattern of equal
    positions (:func:`patterns`): the indices of one block share a position (their factors
    multiply elementwise), successive blocks take strictly increasing positions. No symmetric
    index: the one empty pattern, counted once. ``ordered``: a block of ``g`` indices whose
    factors at a position are all ``s`` counts ``C(s + g - 1, g)`` there instead of ``s^g``, the
    non-decreasing tuples of its elements (:mod:`chainexec.planner.ordered`)."""
    if not factors:
        return {(): 1}
    out = {}
    for pattern in patterns(len(factors)):
        blocks = []
        for n, block in enumerate(pattern):
            if n and block == pattern[n - 1]:
                blocks[-1].append(factors[n])
            else:
                blocks.append([factors[n]])
        merged = [[_merged([f[p] for f in block], ordered) for p in range(len(block[0]))] for block in blocks]
        acc = merged[-1]
        for factor in reversed(merged[:-1]):
            running, nxt = 0, [0] * len(acc)
            for p in reversed(range(len(acc))):
                nxt[p] = factor[p] * running
                running += acc[p]
            acc = nxt
        out[pattern] = sum(acc)
    return out


def _merged(values: list[int], ordered: bool) -> int:
    """One position's factor of a block of indices sharing it (:func:`pattern_sums`)."""
    return ordered_count(values) if ordered and len(values) > 1 else math.prod(values)


def schedule(cs: list[Contraction], symmetric: list[str], free, extents: dict[str, int]):
    """For a run of terms (:func:`chainexec.planner.plan.term_run`) in a loop over ordered tile
    tuples of ``symmetric`` (loop order), per pattern of equal positions (:func:`patterns`): the
    terms to run there and the axis permutations the output is then summed over, ``(((position, scale), …),
    axes)``, or None where every term runs as it is. None for the whole run where no pattern
    runs fewer terms (or it is no run of contractions, or one that holds a term twice: an orbit
    counts its terms once, and such a run adds that term as often as it holds it). ``free``: the
    output's other indices that every tile sees whole. The planner, the cost model and the
    executor all ask this."""
    if len(cs) < 2 or cs[0].pointwise():
        return None
    run, out = terms(cs), tuple(cs[0].out_indices)
    if len(set(map(_key, run))) < len(run):
        return None
    group = invariances(run, out, tuple(symmetric), frozenset(free),
                        tuple(sorted((i, extents[i]) for c in cs for i in c.indices())))
    found = {}
    for pattern in patterns(len(symmetric)):
        H = stabilizer(group, tuple(symmetric), pattern)
        taken = orbit_terms(run, out, H, tuple((i, extents[i]) for i in out))
        found[pattern] = None if taken is None else (taken, axes(H, out))
    return found if any(found.values()) else None


def runs(body: list, loop: Loop | None, contractions: list[Contraction]) -> list[list[int]]:
    """The positions in ``body`` of each run of compute statements as the device adds them in
    one pass (:func:`chainexec.planner.plan.term_run`), in the order the executor meets them
    (:func:`chainexec.planner.plan.runs`)."""
    return plan_runs(body, loop, lambda view, n: term_run(view, n, contractions))


def free_indices(out: list[str], symmetric: list[str], loops, extents: dict[str, int]) -> set[str]:
    """The output indices besides ``symmetric`` that no loop of ``loops`` cuts into tiles."""
    return {i for i in out if i not in symmetric
            and all(loop.tiles.get(i, extents[i]) >= extents[i] for loop in loops)}


def fresh(body: list, start: int, contractions: list[Contraction]) -> bool:
    """Whether the run at ``body[start]`` adds into a buffer nothing has written yet: its
    output's device ``alloc`` comes before it in the same body, with no statement in between
    naming the tensor. The in-place symmetrization (``out = Σ`` of its permuted views) restores
    the run's sum only on such a buffer; the runtime writes it without a zero fill before
    (:meth:`chainexec.runtime.buffers.Buffers.alloc`)."""
    out = contractions[body[start].contraction].out
    for node in reversed(body[:start]):
        named = [node] if isinstance(node, Op) else [op for op, _ in ops(node.body)]
        for op in named:
            if op.op == "alloc" and op.level == "device" and op.tensor == out and op is node:
                return True
            if _names(op, contractions, out):
                return False
    return False


def _names(op: Op, contractions: list[Contraction], tensor: str) -> bool:
    """Whether a statement reads, writes or holds ``tensor``."""
    cs = [contractions[k] for k in (op.group or ([op.contraction] if op.contraction is not None else []))]
    return op.tensor == tensor or any(tensor in (c.out, c.a, c.b) for c in cs)


def mark(nests, contractions: list[Contraction], extents: dict[str, int]) -> None:
    """Set :attr:`Op.symmetrized` and :attr:`Op.schedule` (:func:`schedule`'s terms per pattern,
    as data) on the first statement of each run of terms (inside a loop over ordered tuples of
    symmetric indices, or not) for which :func:`schedule` runs fewer terms somewhere, where the
    run adds into a buffer allocated just before it (:func:`fresh`); in place."""

    def bodies(body, loops):
        yield body, loops
        for node in body:
            if isinstance(node, Loop):
                yield from bodies(node.body, loops + [node])

    for nest in nests:
        for body, loops in bodies(nest.body, []):
            sym = next((loop.symmetric for loop in loops if loop.symmetric), [])
            for run in runs(body, loops[-1] if loops else None, contractions):
                cs = [contractions[body[k].contraction] for k in run]
                taken = fresh(body, run[0], contractions) and schedule(
                    cs, sym, free_indices(cs[0].out_indices, sym, loops, extents), extents)
                if taken:
                    body[run[0]].symmetrized = True
                    body[run[0]].schedule = {pattern_key(p): None if t is None else [[list(x) for x in t[0]],
                                                                                    [list(a) for a in t[1]]]
                                             for p, t in taken.items()}
