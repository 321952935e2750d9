"""In-place symmetrization kernels (:mod:`chainexec.kernels.symmetrize`), on any machine: the
generated kernel, run on the CPU, a ``std::thread`` per CUDA thread, against NumPy's out-of-place
sum (a transposed composition table fails it), with and without ``keep``; its blocks; and the
(T) tiles' kernels compile with nvcc for sm_90 (skipped without nvcc)."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from chainexec.kernels import symmetrize
from chainexec import ordering
from tests.kernels.emulation import compiles_with_nvcc, element_strides, emulated, offset_of, padded


PAIRS = [(0, 1, 2, 3, 4, 5), (1, 0, 2, 4, 3, 5), (2, 1, 0, 5, 4, 3), (0, 2, 1, 3, 5, 4), (1, 2, 0, 4, 5, 3),
         (2, 0, 1, 5, 3, 4)]
"""The (T) W tile's pair permutations of (i a)(j b)(k c) on [i, j, k, a, b, c]: a diagonal tile's group."""
SYMMETRIZE_CASES = {
    "pairs": ((2, 2, 2, 9, 9, 9), PAIRS, [0, 1, 2, 3, 4, 5], np.float64),
    "pairs float32": ((2, 2, 2, 9, 9, 9), PAIRS, [0, 1, 2, 3, 4, 5], np.float32),
    "two equal": ((2, 2, 3, 5, 5, 11), PAIRS[:2], [0, 1, 2, 3, 4, 5], np.float64),
    "transposed, fixed blocks": ((37, 37), [(0, 1), (1, 0)], [1, 0], np.float64),
    "pairs, ordered": ((3, 3, 3, 9, 9, 9), PAIRS, [0, 1, 2, 3, 4, 5], np.float64, ((0, 1, 2),)),
    "two equal, ordered": ((3, 3, 2, 5, 5, 11), PAIRS[:2], [0, 1, 2, 3, 4, 5], np.float64, ((0, 1),)),
    "transposed, ordered": ((37, 37), [(0, 1), (1, 0)], [1, 0], np.float64, ((0, 1),)),
}
"""Per case: shape, axes, the view's storage order, dtype, and the groups of dimensions whose
non-decreasing points alone are written (``keep``, :mod:`chainexec.planner.ordered`), if any."""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("case", sorted(SYMMETRIZE_CASES))
def test_symmetrize_in_place_equals_numpy(case, tmp_path):
    """The in-place symmetrization kernel, run on the CPU, against NumPy's out-of-place sum of the
    permuted views: ``pairs``, a diagonal (T) tile's six pair permutations over blocks of 8
    overhanging the extent 9; ``two equal``, a tile whose first two positions are equal; a
    square array stored transposed, whose diagonal blocks are their own images (each written
    once). With ``keep``, only the points whose coordinates are non-decreasing within its groups
    are written, the others keep their values. Nothing outside the view is written (NaN
    padding)."""
    shape, axes, order, dtype, *keep = SYMMETRIZE_CASES[case]
    keep = keep[0] if keep else ()
    rng = np.random.default_rng(len(case))
    big, view = padded(rng, shape, order, dtype)
    want = sum(view.transpose(p) for p in axes)
    if keep:
        want = np.where(ordering.weights(shape, keep) > 0, want, view)
        assert not np.allclose(want, sum(view.transpose(p) for p in axes))
    strides = element_strides(view)
    plan = symmetrize.symmetrize_plan(shape, strides, tuple(axes), np.dtype(dtype).itemsize)
    text = symmetrize.symmetrize_source(shape, strides, tuple(axes), np.dtype(dtype).name, plan, keep)
    got = emulated(tmp_path, text, "chainexec_symmetrize", [big], [offset_of(big, view)], int(np.prod(plan.counts)))
    inner = tuple(slice(1, n - 1) for n in big.shape)
    outside = np.ones(got.shape, bool)
    outside[inner] = False
    assert np.isnan(got[outside]).all()
    result = got[inner].transpose(np.argsort(order))
    tolerance = 1e-6 if dtype == np.float32 else 1e-14
    assert np.max(np.abs(result - want)) <= tolerance * np.max(np.abs(want))


def test_symmetrize_blocks():
    """Blocks of 8 along the three exchanged virtual dimensions of a diagonal (T) tile (one along
    the occupied ones); with a pair exchanged, the fixed fastest dimension whole; axes that are
    not a group of shape-preserving permutations are refused."""
    shape, strides = (6, 6, 6, 93, 93, 93), (6 * 6 * 93**3, 6 * 93**3, 93**3, 93 * 93, 93, 1)
    plan = symmetrize.symmetrize_plan(shape, strides, tuple(PAIRS), 8)
    assert plan.edges == (1, 1, 1, 8, 8, 8) and plan.counts == (6, 6, 6, 12, 12, 12)
    assert symmetrize.symmetrize_plan(shape, strides, tuple(PAIRS[:2]), 8).edges == (1, 1, 1, 2, 2, 93)
    with pytest.raises(ValueError, match="closed"):
        symmetrize.symmetrize_plan(shape, strides, tuple(PAIRS[:3]), 8)
    with pytest.raises(ValueError, match="identity"):
        symmetrize.symmetrize_plan(shape, strides, tuple(PAIRS[1:2]), 8)
    with pytest.raises(ValueError, match="equal extent"):
        symmetrize.symmetrize_plan((2, 3), (3, 1), ((0, 1), (1, 0)), 8)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_sources_compile_with_nvcc(tmp_path):
    """Benzene's diagonal (T) tile, one with two equal positions, and a diagonal tile at o=40
    v=400 (64-bit offsets)."""
    sources = []
    for shape, group in (((6, 6, 6, 93, 93, 93), PAIRS), ((6, 6, 6, 93, 93, 93), PAIRS[:2]),
                         ((8, 8, 8, 400, 400, 400), PAIRS)):
        strides = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
        plan = symmetrize.symmetrize_plan(shape, strides, tuple(group), 8)
        sources.append(symmetrize.symmetrize_source(shape, strides, tuple(group), "float64", plan))
    assert "const long long o" in sources[-1] and "const int o" in sources[-2]
    compiles_with_nvcc(tmp_path, sources)
