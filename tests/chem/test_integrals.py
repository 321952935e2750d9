"""AO integrals of a tile computed by libcint (chainexec.chem.integrals) equal the same rows of
PySCF's whole-tensor ``mol.intor("int2e", aosym=...)``; the registered source ``pyscf.int2e``;
registry lookups."""

import numpy as np
import pytest

from chainexec import packing, sources
from chainexec.errors import ChainexecError

pytest.importorskip("pyscf")

from chainexec.chem import integrals  # noqa: E402  (after the PySCF check)
from chainexec.chem.job import MOLECULES  # noqa: E402


@pytest.fixture(scope="module", params=["h2o", "n2"])
def molecule(request):
    from pyscf import gto

    mol = gto.M(atom=MOLECULES[request.param], basis="cc-pvdz", unit="Angstrom", verbose=0)
    return request.param, mol, mol.intor("int2e", aosym="s4")


def test_random_row_ranges_equal_the_s4_rows(molecule):
    name, mol, s4 = molecule
    rng = np.random.default_rng(len(name))
    for _ in range(25):
        r0, r1 = sorted(rng.integers(0, s4.shape[0] + 1, 2))
        tile = integrals.rows(mol, r0, r1)
        assert tile.shape == (r1 - r0, s4.shape[1])
        assert np.abs(tile - s4[r0:r1]).max(initial=0.0) <= 1e-14


def test_concatenated_tiles_equal_the_whole(molecule):
    name, mol, s4 = molecule
    rng = np.random.default_rng(7)
    cuts = np.unique(np.concatenate([[0, s4.shape[0]], rng.integers(0, s4.shape[0], 9)]))
    whole = np.concatenate([integrals.rows(mol, a, b) for a, b in zip(cuts[:-1], cuts[1:])])
    assert np.abs(whole - s4).max() <= 1e-14
    ao_loc = mol.ao_loc_nr()
    by_shell = np.concatenate([integrals.shell_rows(mol, sh, sh + 1) for sh in range(mol.nbas)])
    assert np.abs(by_shell - s4).max() <= 1e-14
    for sh0, sh1 in [(0, 1), (2, 5), (mol.nbas - 3, mol.nbas)]:
        first, last = packing.npair(ao_loc[sh0]), packing.npair(ao_loc[sh1])
        assert np.abs(integrals.shell_rows(mol, sh0, sh1) - s4[first:last]).max() <= 1e-14
        assert integrals.shells_of(mol, ao_loc[sh0], ao_loc[sh1]) == (sh0, sh1)


@pytest.mark.parametrize("kind", ["s1", "s2ij", "s2kl", "s8"])
def test_other_layouts_equal_intor(molecule, kind):
    name, mol, _ = molecule
    ref = mol.intor("int2e", aosym=kind)
    rng = np.random.default_rng(3)
    for _ in range(6):
        a, b = sorted(rng.integers(0, ref.shape[0] + 1, 2))
        assert np.abs(integrals.rows(mol, a, b, kind) - ref[a:b]).max(initial=0.0) <= 1e-14


def test_registered_source(molecule):
    name, mol, s4 = molecule
    source = sources.lookup("pyscf.int2e")(atoms=MOLECULES[name], basis="cc-pvdz")
    assert isinstance(source, sources.Source) and source.name == "pyscf.int2e"
    assert source.shape == s4.shape and source.dtype == np.float64
    assert source.layout == packing.Layout("s4", mol.nao_nr())
    assert np.abs(source.values((40, 97)) - s4[40:97]).max() <= 1e-14
    s8 = sources.lookup("pyscf.int2e")(atoms=MOLECULES[name], basis="cc-pvdz", layout="s8")
    start, stop = packing.npair(40), packing.npair(97)
    block = s8.layout.leading_tile(start, stop).unpack(s8.values((start, stop)))
    assert np.abs(block - s4[40:97, :97]).max() <= 1e-14


@pytest.mark.parametrize("kind", ["s8", "s4"])
def test_the_whole_tensor_is_computed_into_the_array_given(molecule, kind):
    """``values`` of every row with ``out`` (C-contiguous, float64, the stored shape) has libcint
    write ``out`` itself, NaN-filled before, with intor's values; an ``out`` of another shape or
    layout, or rows other than all, leave it untouched and return an array of their own."""
    name, mol, _ = molecule
    source = sources.lookup("pyscf.int2e")(atoms=MOLECULES[name], basis="cc-pvdz", layout=kind)
    ref = mol.intor("int2e", aosym=kind)
    out = np.full(source.shape, np.nan)
    assert source.values((0, source.shape[0]), out) is out
    assert np.array_equal(out, ref)
    strided = np.full(source.shape, np.nan, order="F") if out.ndim > 1 else np.full(2 * out.size, np.nan)[::2]
    for other, rows in [(strided, (0, source.shape[0])), (np.full((3,) + source.shape[1:], np.nan), (5, 8))]:
        got = source.values(rows, other)
        assert got is not other and np.isnan(other).all()
        assert np.abs(got - ref[rows[0]:rows[1]]).max() <= 1e-14


@pytest.mark.filterwarnings("ignore:Basis may be available")
def test_bad_names_and_parameters_are_one_line():
    for name in ("pyscf.int3e", ["pyscf.int2e"]):
        with pytest.raises(ChainexecError) as err:
            sources.lookup(name)
        assert "\n" not in str(err.value) and "unknown source" in str(err.value) and "pyscf.int2e" in str(err.value)
    factory = sources.lookup("pyscf.int2e")
    for params, words in [(dict(layout="s16"), "unknown layout"), (dict(basis="no-such-basis"), "cannot build")]:
        with pytest.raises(ChainexecError) as err:
            factory(**{"atoms": MOLECULES["h2o"], "basis": "cc-pvdz", **params})
        assert "\n" not in str(err.value) and words in str(err.value)
    with pytest.raises(ValueError, match="registered twice"):
        sources.register("pyscf.int2e")(type("Other", (), {}))


def test_rate_times_blocks_of_shells_spread_over_the_molecule(monkeypatch):
    """libcint's rate for a config's ``bytes_per_second``: the bytes of raw ``intor`` calls over
    blocks of ``i`` and ``k`` shells (all ``j``, ``l``), one block in each quarter of the
    molecule, over the seconds they took (the faster of two passes over the same blocks); each
    block about the target's bytes."""
    from pyscf import gto

    from chainexec.chem import integrals

    mol = sources.lookup("pyscf.int2e")(atoms=MOLECULES["h2o"], basis="cc-pvdz").mol
    asked = []
    intor = gto.Mole.intor

    buffers = []

    def spy(self, name, aosym="s1", shls_slice=None, **kw):
        asked.append(shls_slice)
        buffers.append(kw.get("out"))
        return intor(self, name, aosym=aosym, shls_slice=shls_slice, **kw)

    monkeypatch.setattr(gto.Mole, "intor", spy)
    nao, target = mol.nao_nr(), 1 << 16
    rate = integrals.rate(mol, blocks=4, target=target)
    assert len(asked) == 8 and asked[:4] == asked[4:] and np.isfinite(rate) and rate > 0
    asked = asked[:4]
    sizes = {(i1 - i0, k1 - k0) for i0, i1, j0, j1, k0, k1, l0, l1 in asked}
    assert len(sizes) == 1 and all((j0, j1, l0, l1) == (0, mol.nbas, 0, mol.nbas) for _, _, j0, j1, _, _, l0, l1 in asked)
    assert [s[0] * 4 // mol.nbas for s in asked] == [0, 1, 2, 3] and sorted(s[4] * 4 // mol.nbas for s in asked) == [0, 1, 2, 3]
    made = [8 * nao * nao * (ao[s[1]] - ao[s[0]]) * (ao[s[5]] - ao[s[4]]) for ao in [mol.ao_loc_nr()] for s in asked]
    assert target / 8 < sum(made) / 4 < 8 * target
    # every call writes into one buffer (made and filled before the first, as a run writes into
    # filled global memory), as large as the largest block
    assert buffers[0] is not None and all(b is buffers[0] for b in buffers)
    assert buffers[0].nbytes == max(made)
