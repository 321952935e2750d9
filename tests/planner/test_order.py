"""Binarization: the DP's flop count equals a brute-force minimum over every pairwise contraction
sequence, and the four-index transform becomes four O(N⁵) steps; products of more operands than
the DP takes get a greedy order whose steps compute what numpy.einsum computes."""

from __future__ import annotations

import math
import random
import string
from functools import lru_cache

import numpy as np
import pytest

from chainexec.planner.order import binarize


def brute_force(operands, keep, extents) -> int:
    """Minimum flops over all ways of repeatedly contracting two of the remaining tensors."""
    keep = frozenset(keep)

    @lru_cache(maxsize=None)
    def best(tensors: frozenset) -> int:
        if len(tensors) == 1:
            return 0
        items = sorted(tensors, key=sorted)
        result = None
        for x in range(len(items)):
            for y in range(x + 1, len(items)):
                rest = [t for k, t in enumerate(items) if k not in (x, y)]
                needed = keep.union(*[set(t[0]) for t in rest]) if rest else keep
                joint = set(items[x][0]) | set(items[y][0])
                merged = (frozenset(joint & needed), items[x][1] | items[y][1])
                cost = 2 * math.prod(extents[i] for i in joint) + best(frozenset(rest + [merged]))
                result = cost if result is None else min(result, cost)
        return result

    # Each tensor carries the set of operand positions it holds, so equal index sets stay distinct.
    return best(frozenset((frozenset(ix), frozenset([k])) for k, ix in enumerate(operands)))


def random_product(seed: int):
    rng = random.Random(seed)
    names = "abcdefgh"
    extents = {i: rng.randint(2, 9) for i in names}
    n = rng.randint(2, 6)
    operands = [tuple(rng.sample(names, rng.randint(1, 4))) for _ in range(n)]
    count = {}
    for ix in operands:
        for i in ix:
            count[i] = count.get(i, 0) + 1
    keep = tuple(i for i in count if count[i] == 1 or rng.random() < 0.2)
    return operands, keep, extents


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force(seed):
    operands, keep, extents = random_product(seed)
    steps = binarize(operands, keep, extents)
    assert len(steps) == len(operands) - 1
    assert sum(s.flops for s in steps) == brute_force(operands, keep, extents)
    assert steps[-1].indices == keep


def test_fourindex_is_four_n5_steps():
    n = 20
    extents = {i: n for i in "pqrsabcd"}
    operands = [("p", "a"), ("q", "b"), ("r", "c"), ("s", "d"), ("p", "q", "r", "s")]
    steps = binarize(operands, ("a", "b", "c", "d"), extents)
    assert [s.flops for s in steps] == [2 * n**5] * 4
    assert all(len(s.indices) == 4 for s in steps)


@pytest.mark.parametrize("ao, mo", [(20, 20), (160, 150)])
def test_fourindex_contracts_the_files_last_index_first(ao, mo):
    """Every order costs the same; the layout tie-break contracts s, r, q, p of the row-major
    A[p,q,r,s], so the intermediates keep p leading and the fused loops cut A into contiguous slabs."""
    extents = {**{i: ao for i in "pqrs"}, **{i: mo for i in "abcd"}}
    operands = [("p", "a"), ("q", "b"), ("r", "c"), ("s", "d"), ("p", "q", "r", "s")]
    steps = binarize(operands, ("a", "b", "c", "d"), extents)
    assert [s.indices for s in steps[:3]] == [("p", "q", "r", "d"), ("p", "q", "c", "d"), ("p", "b", "c", "d")]
    assert (steps[0].left, steps[0].right) in ((3, 4), (4, 3))
    assert sum(s.flops for s in steps) == brute_force(operands, ("a", "b", "c", "d"), extents)


def _by_steps(steps, operands, keep, arrays):
    """The product computed pair by pair as ``steps`` say, each step one numpy.einsum."""
    letters = {i: string.ascii_letters[k] for k, i in enumerate(sorted({i for ix in operands for i in ix}))}
    values = list(zip(operands, arrays))
    used = []
    for step in steps:
        (a_ix, a), (b_ix, b) = values[step.left], values[step.right]
        others = {i for k, (ix, _) in enumerate(values) if k not in used + [step.left, step.right] for i in ix}
        # a step keeps exactly the indices of its pair still needed: held by a tensor left or kept
        assert set(step.indices) == {i for i in a_ix + b_ix if i in others or i in keep}, step
        used += [step.left, step.right]
        a_s, b_s, out = ("".join(map(letters.get, ix)) for ix in (a_ix, b_ix, step.indices))
        values.append((step.indices, np.einsum(f"{a_s},{b_s}->{out}", a, b)))
    assert sorted(used) == list(range(len(operands) + len(steps) - 1))  # every tensor but the last used once
    assert steps[-1].indices == keep
    return values[-1][1], letters


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n, seed", [(11, 0), (16, 1), (20, 2), (30, 3), (40, 4)])
def test_many_operands_get_a_greedy_order_that_computes_the_product(n, seed):
    """A chain of n matrices with a few extra shared (batch) indices: beyond the exhaustive search's
    reach, the order comes at once and its steps give numpy.einsum's value of the whole product."""
    rng = np.random.default_rng(seed)
    extents = {f"i{k}": int(rng.integers(2, 4)) for k in range(n + 1)} | {"x": 2, "y": 3}
    operands = [(f"i{k}", f"i{k + 1}") + (("x",) if k % 5 == 0 else ()) + (("y",) if k % 7 == 3 else ())
                for k in range(n)]
    keep = ("i0", f"i{n}", "x")
    operands.insert(1, ("i1",))  # a vector on the chain: i1 held by three operands
    arrays = [rng.standard_normal([extents[i] for i in ix]) for ix in operands]
    steps = binarize(operands, keep, extents)
    got, letters = _by_steps(steps, operands, keep, arrays)
    whole = ",".join("".join(map(letters.get, ix)) for ix in operands) + "->" + "".join(map(letters.get, keep))
    assert np.allclose(got, np.einsum(whole, *arrays, optimize=True), rtol=1e-10, atol=0)
