"""The executor's tile tuples: a symmetric loop keeps the ordered tuples of its indices' tile
positions, each weighted by its number of distinct permutations, so that the weights add up to
the full tuple count (every tuple of the full loop is stood for exactly once)."""

from __future__ import annotations

import itertools
import math

import pytest

from chainexec.runtime.executor import _tuples


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("symmetric", [["i", "j"], ["i", "j", "k"], ["k", "i", "j"]])
def test_ordered_tuples_and_weights(n, symmetric):
    names = ["i", "x", "j", "k"]
    spans = [[(3 * p, 3 * p + 3) for p in range(n)] if i != "x" else [(0, 2), (2, 4)] for i in names]
    combos, weights = _tuples(names, spans, symmetric)
    k = len(symmetric)
    assert len(combos) == math.comb(n + k - 1, k) * 2 * n ** (3 - k)
    assert sum(weights) == 2 * n ** 3
    seen = set()
    for combo, weight in zip(combos, weights):
        positions = [combo[names.index(i)][0] // 3 for i in symmetric]
        assert positions == sorted(positions, reverse=True)
        assert weight == len(set(itertools.permutations(positions)))
        seen.add(combo)
    assert len(seen) == len(combos)


def test_plain_loops_keep_every_tuple():
    spans = [[(0, 2), (2, 3)], [(0, 1), (1, 2), (2, 3)]]
    combos, weights = _tuples(["i", "j"], spans, [])
    assert combos == list(itertools.product(*spans)) and weights == [1] * 6
