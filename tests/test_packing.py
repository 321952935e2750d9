"""Packed layouts (chainexec.packing) against an independent construction — position tables built
here by enumerating the pairs ``p >= q`` in explicit loops — and against PySCF's own packing
(``lib.pack_tril``/``unpack_tril``, ``ao2mo.restore``, ``mol.intor(aosym=...)`` and the file
``ao2mo.outcore.full`` writes); tiles on random ranges, odd and prime extents, float64 and
float32."""

import itertools
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chainexec import packing
from chainexec.packing import KINDS, Layout

EXTENTS = [(1, 1), (2, 2), (7, 7), (13, 13), (7, 5), (2, 13)]
CASES = [(kind, n, m) for kind in KINDS for n, m in EXTENTS if kind != "s8" or n == m]


def pair_list(n):
    """The pairs p >= q in packed order, by loops."""
    return [(p, q) for p in range(n) for q in range(p + 1)]


def pairs(n):
    """{(p, q): position in pair_list(n)}, for both orders of each pair."""
    table = {}
    for k, (p, q) in enumerate(pair_list(n)):
        table[p, q] = table[q, p] = k
    return table


def tables(kind, n, m):
    """Matrix row of every (p, q) and column of every (r, s), as (n, n) and (m, m) arrays."""
    rows, cols = pairs(n), pairs(m)
    row = [[rows[p, q] if kind in ("s2ij", "s4", "s8") else p * n + q for q in range(n)] for p in range(n)]
    col = [[cols[r, s] if kind in ("s2kl", "s4", "s8") else r * m + s for s in range(m)] for r in range(m)]
    return np.array(row), np.array(col)


@lru_cache(maxsize=None)
def matrix_positions(kind, n, m):
    """Flat packed position of every element of the matrix view (nrows, ncols)."""
    row, col = tables(kind, n, m)
    nrows, ncols = row.max() + 1, col.max() + 1
    if kind != "s8":
        return np.arange(nrows * ncols).reshape(nrows, ncols)
    tri = pairs(nrows)
    return np.array([[tri[r, c] for c in range(ncols)] for r in range(nrows)])


@lru_cache(maxsize=None)
def positions(kind, n, m):
    """Flat packed position of every dense element (n, n, m, m)."""
    row, col = tables(kind, n, m)
    return matrix_positions(kind, n, m)[row[:, :, None, None], col[None, None]]


def symmetric(kind, n, m, dtype=np.float64, seed=0):
    """Random dense (n, n, m, m) tensor with the symmetry ``kind`` assumes."""
    x = np.random.default_rng(seed).standard_normal((n, n, m, m))
    if kind in ("s2ij", "s4", "s8"):
        x = x + x.transpose(1, 0, 2, 3)
    if kind in ("s2kl", "s4", "s8"):
        x = x + x.transpose(0, 1, 3, 2)
    if kind == "s8":
        x = x + x.transpose(2, 3, 0, 1)
    return x.astype(dtype)


def reference_pack(dense, kind):
    n, m = dense.shape[0], dense.shape[2]
    pos = positions(kind, n, m)
    out = np.full(pos.max() + 1, np.nan, dtype=dense.dtype)
    out[pos] = dense
    return out


def values_of(flat, ranges):
    """The packed values of ``ranges`` concatenated (what a runtime reads from disk)."""
    return np.concatenate([flat[a:b] for a, b in ranges] + [flat[:0]])


def runs(sorted_unique):
    """[start, stop) runs of a sorted array, by a loop."""
    out = []
    for v in sorted_unique.tolist():
        if out and out[-1][1] == v:
            out[-1][1] = v + 1
        else:
            out.append([v, v + 1])
    return out


def test_pair_index_and_inverse():
    table = pairs(40)
    p, q = np.array(list(table)).T
    assert np.array_equal(packing.pair_index(p, q), [table[k] for k in table])
    k = np.arange(packing.npair(40))
    hi, lo = packing.pair_unindex(k)
    assert np.all(hi >= lo) and np.array_equal(packing.pair_index(hi, lo), k)
    big = np.array([2**61 - 1, 10**15, 10**15 + 7, packing.npair(3 * 10**7) - 1, packing.npair(3 * 10**7)])
    hi, lo = packing.pair_unindex(big)
    assert np.all((lo >= 0) & (lo <= hi)) and np.array_equal(packing.pair_index(hi, lo), big)
    assert [packing.npair(n) for n in (1, 2, 7, 13)] == [1, 3, 28, 91]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind, n, m", CASES)
def test_layouts_equal_the_enumerated_construction(kind, n, m, dtype):
    dense = symmetric(kind, n, m, dtype)
    layout = Layout(kind, n, m)
    ref = reference_pack(dense, kind)
    big, small = n * (n + 1) // 2, m * (m + 1) // 2
    size = {"s1": n * n * m * m, "s2ij": big * m * m, "s2kl": n * n * small, "s4": big * small,
            "s8": big * (big + 1) // 2}[kind]
    assert layout.size == ref.size == size
    packed = packing.pack(dense, kind)
    assert packed.shape == layout.shape and packed.dtype == dtype
    assert np.array_equal(packed.ravel(), ref)
    assert np.array_equal(packing.unpack(ref, layout), dense)
    p, q, r, s = np.indices(layout.dense_shape)
    assert np.array_equal(layout.position(layout.row(p, q), layout.col(r, s)), positions(kind, n, m))


@pytest.mark.parametrize("kind, n, m", CASES)
def test_tiles_on_random_ranges(kind, n, m):
    """Matrix tiles, row tiles and dense boxes: the ranges are the runs of the positions the
    block holds, their values unpack to the block and the block packs back to them."""
    rng = np.random.default_rng(n * 100 + m)
    dense = symmetric(kind, n, m)
    layout = Layout(kind, n, m)
    flat = reference_pack(dense, kind)
    mpos, pos = matrix_positions(kind, n, m), positions(kind, n, m)
    col = tables(kind, n, m)[1]
    nrows, ncols = mpos.shape
    assert layout.matrix_shape == mpos.shape
    for _ in range(12):
        r0, r1 = sorted(rng.integers(0, nrows + 1, 2))
        c0, c1 = sorted(rng.integers(0, ncols + 1, 2))
        box = tuple(slice(*sorted(rng.integers(0, e + 1, 2))) for e in layout.dense_shape)
        cases = [(layout.matrix_tile((r0, r1), (c0, c1)), mpos[r0:r1, c0:c1]),
                 (layout.row_tile(r0, r1), mpos[r0:r1][:, col]),
                 (layout.box_tile([(b.start, b.stop) for b in box]), pos[box])]
        for tile, held in cases:
            assert tile.ranges.tolist() == runs(np.unique(held))
            values = values_of(flat, tile.ranges)
            assert tile.size == values.size == np.unique(held).size
            assert np.array_equal(tile.unpack(values), flat[held])
            assert np.array_equal(tile.pack(flat[held]), values)
        assert np.array_equal(cases[2][0].unpack(values), dense[box])


@pytest.mark.parametrize("kind, n, m", CASES)
def test_leading_tiles_are_slices_of_the_packed_array(kind, n, m):
    """The block a slice packed[start:stop] holds: dense rows p (s1, s2kl), pair rows with (r, s)
    dense (s2ij, s4), the s4 matrix block [R0:R1, :R1] of triangle rows R0..R1 (s8)."""
    dense = symmetric(kind, n, m, np.float32)
    layout = Layout(kind, n, m)
    packed = packing.pack(dense, kind)
    s4 = reference_pack(dense, "s4").reshape(len(pair_list(n)), -1) if kind == "s8" else None
    lead = s4.shape[0] if kind == "s8" else layout.shape[0]
    tri = [r * (r + 1) // 2 for r in range(lead + 1)]
    for a, b in itertools.combinations_with_replacement(sorted({0, 1, lead // 2, lead - 1, lead}), 2):
        start, stop = (tri[a], tri[b]) if kind == "s8" else (a, b)
        tile = layout.leading_tile(start, stop)
        values = packed[start:stop].ravel()
        block = tile.unpack(values)
        assert np.array_equal(tile.pack(block), values)
        if kind in ("s1", "s2kl"):
            expected = dense[a:b]
        elif kind == "s8":
            expected = s4[a:b, :b]
        else:
            rows = pair_list(n)[a:b]
            expected = dense[[p for p, _ in rows], [q for _, q in rows]]
        assert np.array_equal(block, expected)
    if kind == "s8" and n > 1:
        with pytest.raises(ValueError, match="triangle rows"):
            layout.leading_tile(2, layout.size)


def test_bad_layouts_and_values():
    for kind, n, m in [("s16", 3, 3), ("s8", 3, 4), ("s4", 0, 2)]:
        with pytest.raises(ValueError):
            Layout(kind, n, m)
    layout = Layout("s4", 5)
    with pytest.raises(ValueError, match="holds 225 elements"):
        packing.unpack(np.zeros(224), layout)
    tile = layout.row_tile(2, 4)
    with pytest.raises(ValueError, match="30 values, got 29"):
        tile.unpack(np.zeros(29))
    with pytest.raises(ValueError, match="not within"):
        layout.row_tile(3, 16)
    with pytest.raises(ValueError, match="number of symmetric pairs"):
        packing.unpack_pairs(np.zeros(5))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(KINDS), st.integers(1, 6), st.integers(1, 6), st.data())
def test_tile_ranges_hold_exactly_the_block(kind, n, m, data):
    m = n if kind == "s8" else m
    layout = Layout(kind, n, m)
    box = tuple(tuple(sorted(data.draw(st.lists(st.integers(0, e), min_size=2, max_size=2))))
                for e in layout.dense_shape)
    tile = layout.box_tile(box)
    held = np.unique(positions(kind, n, m)[tuple(slice(*b) for b in box)])
    ranges = tile.ranges
    assert ranges.tolist() == runs(held)
    assert np.all(ranges[1:, 0] > ranges[:-1, 1]) and np.all(ranges[:, 1] > ranges[:, 0])
    assert tile.size == held.size
    dense = symmetric(kind, n, m, seed=len(held))
    block = dense[tuple(slice(*b) for b in box)]
    assert np.array_equal(tile.unpack(tile.pack(block)), block)


# ---- PySCF's own packing ---------------------------------------------------------------------

pyscf = pytest.importorskip("pyscf")


@pytest.fixture(scope="module")
def h2o():
    from pyscf import gto

    from chainexec.chem.job import MOLECULES

    return gto.M(atom=MOLECULES["h2o"], basis="cc-pvdz", unit="Angstrom", verbose=0)


@pytest.mark.parametrize("n", [1, 2, 7, 13])
def test_pairs_equal_pack_tril(n):
    from pyscf import lib

    x = np.random.default_rng(n).standard_normal((3, n, n))
    x = x + x.transpose(0, 2, 1)
    assert np.array_equal(packing.pack_pairs(x[0]), lib.pack_tril(x[0]))
    assert np.array_equal(packing.pack_pairs(x), lib.pack_tril(x))
    tril = lib.pack_tril(x)
    assert np.array_equal(packing.unpack_pairs(tril[0]), lib.unpack_tril(tril[0]))
    assert np.array_equal(packing.unpack_pairs(tril), lib.unpack_tril(tril))
    assert np.array_equal(packing.unpack_pairs(tril.T, axis=0), lib.unpack_tril(tril.T, axis=0))


def test_layouts_equal_pyscf_integrals(h2o):
    from pyscf import ao2mo

    n = h2o.nao_nr()
    eri = h2o.intor("int2e")
    for kind in KINDS:
        layout = Layout(kind, n)
        ours = packing.pack(eri, kind)
        assert np.abs(ours - h2o.intor("int2e", aosym=kind)).max() <= 1e-14
        assert np.abs(packing.unpack(ours, layout) - eri).max() <= 1e-14  # libcint: symmetric to rounding
    for kind, code in [("s4", 4), ("s8", 8), ("s2ij", "s2ij"), ("s2kl", "s2kl")]:
        assert np.array_equal(packing.pack(eri, kind), ao2mo.restore(code, eri, n))
    eri8 = h2o.intor("int2e", aosym="s8")
    assert np.array_equal(packing.unpack(eri8, Layout("s8", n)), ao2mo.restore(1, eri8, n))
    assert np.array_equal(packing.pack(packing.unpack(eri8, Layout("s8", n)), "s4"), ao2mo.restore(4, eri8, n))


def test_outcore_file_is_the_s4_matrix(h2o, tmp_path):
    """ao2mo.outcore.full (compact) writes the s4 matrix of the MO integrals; its row slices are
    leading tiles."""
    import h5py
    from pyscf import ao2mo

    n, nmo = h2o.nao_nr(), 11
    c = np.linalg.qr(np.random.default_rng(0).standard_normal((n, n)))[0][:, :nmo]
    ao2mo.outcore.full(h2o, c, str(tmp_path / "eri.h5"), dataname="eri_mo")
    layout = Layout("s4", nmo)
    with h5py.File(tmp_path / "eri.h5") as f:
        assert f["eri_mo"].shape == layout.matrix_shape == layout.shape
        whole, rows = f["eri_mo"][...], f["eri_mo"][17:40]
    dense = ao2mo.restore(1, whole, nmo)
    assert np.array_equal(packing.unpack(whole, layout), dense)
    p, q = np.array(pair_list(nmo)[17:40]).T
    assert np.array_equal(layout.leading_tile(17, 40).unpack(rows), dense[p, q])
    assert np.abs(dense - ao2mo.restore(1, ao2mo.full(h2o, c), nmo)).max() < 1e-12
