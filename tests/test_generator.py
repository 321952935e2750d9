"""The element-wise generator: any tile equals the same region of the whole tensor."""

from __future__ import annotations

import numpy as np
import pytest

from chainexec.generator import block


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 1, 6), (2, 3, 2, 5)])
def test_tiles_agree_with_whole(shape):
    rng = np.random.default_rng(0)
    whole = block(9, shape, tuple((0, n) for n in shape), np.float64)
    for _ in range(10):
        region = []
        for n in shape:
            lo = int(rng.integers(0, n))
            region.append((lo, int(rng.integers(lo + 1, n + 1))))
        assert np.array_equal(block(9, shape, tuple(region), np.float64),
                              whole[tuple(slice(a, b) for a, b in region)])


def test_values_spread_and_seeds_differ():
    a = block(1, (1000,), ((0, 1000),), np.float64)
    b = block(2, (1000,), ((0, 1000),), np.float64)
    assert -1 <= a.min() < -0.9 and 0.9 < a.max() < 1
    assert abs(a.mean()) < 0.1 and not np.array_equal(a, b)
    assert len(np.unique(a)) == 1000
