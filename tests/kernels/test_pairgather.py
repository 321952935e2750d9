"""The pair gather kernels (:mod:`chainexec.kernels.pairgather`): their sources compile with
nvcc, and emulated on the CPU (:mod:`tests.kernels.emulation`) they write exactly what NumPy's
``take`` at positions found by brute force (every pair enumerated) writes, for pairs of tiles
away from the origin, pair positions past 2^31, members in either order, and permuted, padded
views; nothing outside the output's view changes. Launched through the runtime in
test_pointwise.py (arguments) and test_pointwise_gpu.py (a GPU)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from chainexec.kernels import pairgather
from tests.kernels.emulation import compiles_with_nvcc, emulated, stored

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")


def pair_table(p_stop: int) -> dict[int, tuple[int, int]]:
    """Every pair number ``k`` with its members ``(p, q)``, ``q <= p < p_stop``, by counting."""
    table, k = {}, 0
    for p in range(p_stop):
        for q in range(p + 1):
            table[k] = (p, q)
            k += 1
    return table


def test_a_module_holds_set_and_add_with_their_arguments():
    text = pairgather.gather_source("unpack", 3, "float64", (2, 0))
    for op in pairgather.OPERATIONS:
        assert f"void chainexec_unpack_{op}(double* Y, const double* P, const double f, const long long n, " \
               "const long long e1, const long long e2, const long long y0, const long long y1, const long long y2, " \
               "const long long s1, const long long k0, const long long r0, const long long m0, const long long sp)" in text
    assert "const long long r = c2 + r0, m = c0 + m0;" in text
    pack = pairgather.gather_source("pack", 2, "float32", (1,))
    assert "chainexec_pack_add(float* Y, const float* P, const float f" in pack
    assert "const long long sr, const long long sm)" in pack
    assert pairgather.gather_source("pack", 2, "float32", (1,)) is pack  # made once


@pytest.mark.parametrize("kind, dims, special", [("unpack", 3, (1,)), ("unpack", 2, (1, 1)), ("pack", 2, (2,)),
                                                 ("pack", 1, (0, 0))])
def test_pair_dimensions_must_fit_the_kind(kind, dims, special):
    with pytest.raises(ValueError, match="distinct pair dimensions"):
        pairgather.gather_source(kind, dims, "float64", special)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_sources_compile_with_nvcc(tmp_path):
    compiles_with_nvcc(tmp_path, [pairgather.gather_source("unpack", 4, "float64", (3, 1)),
                                  pairgather.gather_source("unpack", 2, "float32", (0, 1)),
                                  pairgather.gather_source("pack", 3, "float64", (1,)),
                                  pairgather.gather_source("pack", 1, "float32", (0,))])


def _untouched_outside(got, big) -> bool:
    outside = np.ones(got.shape, bool)
    outside[tuple(slice(1, n - 1) for n in big.shape)] = False
    return bool(np.isnan(got[outside]).all())


def _inside(got, big, order):
    return got[tuple(slice(1, n - 1) for n in big.shape)].transpose(np.argsort(order))


def _strides(view) -> list[int]:
    return [s // view.itemsize for s in view.strides]


@needs_gxx
@pytest.mark.parametrize("op", pairgather.OPERATIONS)
@pytest.mark.parametrize("r0, m0, rows, cols", [(0, 0, 5, 5), (4, 1, 3, 6), (1, 5, 4, 3)],
                         ids=["diagonal", "below", "across"])
def test_unpack_reads_each_members_pair_in_either_order(op, r0, m0, rows, cols, tmp_path):
    """out[m, x, r] (+)= f · a[x, pair(max(r, m), min(r, m)) - k0] over a members' block
    ``[r0, r0+rows) × [m0, m0+cols)``: the pair axis in the middle of a permuted, padded input,
    the output's member dimensions in the order (m, ·, r)."""
    rng = np.random.default_rng(r0 + 7 * m0)
    table = pair_table(r0 + rows + m0 + cols)
    k0 = min(k for k, (p, q) in table.items() if r0 <= p or m0 <= p) if r0 + m0 else 0
    k1 = max(k for k, (p, q) in table.items() if p < max(r0 + rows, m0 + cols)) + 1
    abig, aoff, a = stored(rng, (3, k1 - k0), [1, 0])
    big, off, out = stored(rng, (cols, 3, rows), [2, 0, 1])
    where = {pq: k for k, pq in table.items()}
    expected = out.copy() if op == "add" else np.zeros_like(out)
    for r in range(rows):
        for m in range(cols):
            p, q = max(r0 + r, m0 + m), min(r0 + r, m0 + m)
            expected[m, :, r] += -0.3 * a[:, where[p, q] - k0]
    text = pairgather.gather_source("unpack", 3, "float64", (2, 0))
    ys, ss = _strides(out), _strides(a)
    numbers = [out.size, 3, rows, *ys, ss[0], k0, r0, m0, ss[1]]
    got = emulated(tmp_path, text, f"chainexec_unpack_{op}", [big, abig], [off, aoff], 2,
                   (float(-0.3).hex(), *map(str, numbers)))
    assert np.array_equal(_inside(got, big, [2, 0, 1]), expected)
    assert _untouched_outside(got, big)


@needs_gxx
@pytest.mark.parametrize("op", pairgather.OPERATIONS)
def test_pack_takes_each_pairs_members_from_the_block(op, tmp_path):
    """out[k, x] (+)= f · a[p - r0, x, q - m0] for the pairs ``k`` of ``[k0, k1)``, members found
    by counting: a tile of pairs starting mid-row, the input's member axes apart and permuted."""
    rng = np.random.default_rng(3)
    r0, rows, m0, cols = 4, 4, 0, 8
    table = pair_table(r0 + rows)
    k0, k1 = 12, max(table) + 1  # pair 12 is (4, 2): the tile starts inside row 4
    abig, aoff, a = stored(rng, (rows, 2, cols), [2, 0, 1])
    big, off, out = stored(rng, (k1 - k0, 2), [0, 1])
    expected = out.copy() if op == "add" else np.zeros_like(out)
    for k in range(k0, k1):
        p, q = table[k]
        expected[k - k0] += 1.7 * a[p - r0, :, q - m0]
    text = pairgather.gather_source("pack", 2, "float64", (0,))
    ys, ss = _strides(out), _strides(a)
    numbers = [out.size, 2, *ys, ss[1], k0, r0, m0, ss[0], ss[2]]
    got = emulated(tmp_path, text, f"chainexec_pack_{op}", [big, abig], [off, aoff], 1,
                   (float(1.7).hex(), *map(str, numbers)))
    assert np.array_equal(_inside(got, big, [0, 1]), expected)
    assert _untouched_outside(got, big)


@needs_gxx
def test_pair_positions_past_two_to_the_31_unpack_and_pack_back(tmp_path):
    """Members 70000… (pairs near 2.45e9, past 32-bit positions): a packed row unpacked into its
    members' block and packed back give the row again: every pair of those rows finds its
    members."""
    rng = np.random.default_rng(5)
    r0, rows, cols = 70000, 2, 70002
    k0 = r0 * (r0 + 1) // 2
    k1 = (r0 + rows) * (r0 + rows + 1) // 2
    packed = rng.standard_normal(k1 - k0)
    block = np.full((rows, cols), np.nan)
    unpack = pairgather.gather_source("unpack", 2, "float64", (0, 1))
    block = emulated(tmp_path, unpack, "chainexec_unpack_set", [block, packed], [0, 0], 4,
                     ("0x1.0p+0", str(block.size), str(cols), str(cols), "1", str(k0), str(r0), "0", "1"))
    for r in range(rows):
        p = r0 + r
        assert np.array_equal(block[r, :p + 1], packed[p * (p + 1) // 2 - k0 + np.arange(p + 1)])
    back = np.zeros(k1 - k0)
    pack = pairgather.gather_source("pack", 1, "float64", (0,))
    back = emulated(tmp_path, pack, "chainexec_pack_set", [back, block], [0, 0], 4,
                    ("0x1.0p+0", str(back.size), "1", str(k0), str(r0), "0", str(cols), "1"))
    assert np.array_equal(back, packed)
