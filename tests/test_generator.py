"""The element-wise generator: any tile equals the same region of the whole tensor."""

from __future__ import annotations

import numpy as np
import pytest

from chainexec.generator import block
from chainexec.spectypes import SEEDS


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
    # the seeds a config may give (below SEEDS) differ from each other; SEEDS apart they do not
    last = block(SEEDS - 1, (1000,), ((0, 1000),), np.float64)
    assert not np.array_equal(last, block(0, (1000,), ((0, 1000),), np.float64))
    assert np.array_equal(a, block(1 + SEEDS, (1000,), ((0, 1000),), np.float64))


SYMMETRIES = {  # (pairs, exchange) of a four-index tensor, and a two-index one
    "s2ij": ((0,), False), "s2kl": ((2,), False), "s4": ((0, 2), False), "s8": ((0, 2), True),
}


@pytest.mark.parametrize("kind", sorted(SYMMETRIES))
def test_values_declared_symmetric_have_the_symmetry_and_tiles_agree(kind):
    """Values made under a declared symmetry's permutations are equal at every element's images
    (numpy transposes, independently of the generator's flat positions), differ otherwise, and
    any tile equals the same region of the whole."""
    from chainexec.pairs import Symmetry

    shape = (5, 5, 5, 5)
    permutations = Symmetry(*SYMMETRIES[kind]).permutations(4)[1:]
    whole = block(7, shape, tuple((0, n) for n in shape), np.float64, permutations)
    for order in permutations:
        assert np.array_equal(whole, whole.transpose(order))
    assert len(np.unique(whole)) == len({min(tuple(ix[o] for o in order) for order in [(0, 1, 2, 3), *permutations])
                                          for ix in np.ndindex(*shape)})
    region = ((1, 4), (0, 2), (3, 5), (2, 3))
    assert np.array_equal(block(7, shape, region, np.float64, permutations), whole[1:4, 0:2, 3:5, 2:3])
    assert np.array_equal(block(7, shape, ((0, 1),) * 4, np.float64, ()), whole[:1, :1, :1, :1])
