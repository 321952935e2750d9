"""Tests of chainexec.chem.bridge: file layout, determinism, symmetries, atomic writes."""

import h5py
import numpy as np
import pytest

from chainexec.chem import bridge
from chainexec.chem.bridge import molecule, synthetic_inputs, write_ccsd_inputs
from chainexec.chem.layout import SYNTHETIC_IN_MEMORY

H2O = "O 0 0 0.1173; H 0 0.7572 -0.4692; H 0 -0.7572 -0.4692"


def expected_shapes(o, v):
    return {"t1": (o, v), "t2": (o, o, v, v), "ovvv": (o, v, v, v), "ovoo": (o, v, o, o),
            "ovov": (o, v, o, v), "e_occ": (o,), "e_vir": (v,), "f_vo": (v, o)}


def check_layout(f, o, v):
    shapes = expected_shapes(o, v)
    assert set(f.keys()) == set(shapes)
    for name, shape in shapes.items():
        assert f[name].shape == shape, name
        assert f[name].dtype == np.float64, name
        assert len(f[name].attrs["indices"]) == len(shape), name
    assert f["ovvv"].attrs["indices"] == "iabc"
    assert f["t2"].attrs["indices"] == "ijab"
    assert f["f_vo"].attrs["indices"] == "ai"
    assert f.attrs["nocc"] == o and f.attrs["nvir"] == v
    assert f.attrs["units"] == "Hartree"


def test_synthetic_layout_scale_and_symmetries(tmp_path):
    o, v = 4, 7
    info = synthetic_inputs(o, v, 11, tmp_path / "s.h5")
    assert info == {"path": str(tmp_path / "s.h5"), "nocc": o, "nvir": v, "seed": 11}
    with h5py.File(tmp_path / "s.h5", "r") as f:
        check_layout(f, o, v)
        assert f.attrs["synthetic"] and f.attrs["seed"] == 11
        assert "e_t" not in f.attrs
        x = {name: f[name][()] for name in f}
    np.testing.assert_array_equal(x["ovov"], x["ovov"].transpose(2, 3, 0, 1))
    np.testing.assert_array_equal(x["ovvv"], x["ovvv"].transpose(0, 1, 3, 2))
    np.testing.assert_array_equal(x["ovoo"], x["ovoo"].transpose(0, 1, 3, 2))
    np.testing.assert_array_equal(x["t2"], x["t2"].transpose(1, 0, 3, 2))
    assert np.all(x["e_occ"] < -0.29) and np.all(x["e_vir"] > 0.19)
    assert 1e-3 < np.abs(x["t2"]).mean() < 1e-1
    assert 1e-2 < np.abs(x["ovov"]).mean() < 1.0
    assert np.abs(x["f_vo"]).max() > 0


def test_synthetic_is_deterministic_per_seed(tmp_path):
    paths = [tmp_path / name for name in ("a.h5", "b.h5", "c.h5")]
    for path, seed in zip(paths, (5, 5, 6)):
        synthetic_inputs(3, 5, seed, path)
    with h5py.File(paths[0], "r") as a, h5py.File(paths[1], "r") as b, \
            h5py.File(paths[2], "r") as c:
        for name in bridge.INDICES:
            np.testing.assert_array_equal(a[name][()], b[name][()])
            assert not np.array_equal(a[name][()], c[name][()]), name


@pytest.mark.parametrize("o, v", [(3, 5), (2, 13)])
def test_synthetic_ovvv_does_not_depend_on_its_blocks(tmp_path, monkeypatch, o, v):
    """``ovvv`` is made in blocks of rows over threads, each row from a stream of its own: blocks
    of one row and blocks of all rows give the same file, every array equal."""
    files = []
    for block in (8 * v * v, 8 * o * v**3):
        monkeypatch.setattr(bridge, "SYNTHETIC_BLOCK_BYTES", block)
        files.append(tmp_path / f"{block}.h5")
        synthetic_inputs(o, v, 7, files[-1])
    with h5py.File(files[0], "r") as a, h5py.File(files[1], "r") as b:
        assert set(a) == set(b) == set(bridge.INDICES)
        for name in a:
            np.testing.assert_array_equal(a[name][()], b[name][()])
        assert np.abs(a["ovvv"][()]).min() > 0 and len(np.unique(a["ovvv"][()])) > o * v * v * (v - 1) // 2


@pytest.mark.parametrize("flight_rows, threads", [(1, 8), (3, 8), (100, 2)])
def test_synthetic_ovvv_blocks_in_flight_are_bounded(tmp_path, monkeypatch, flight_rows, threads):
    """At most :data:`bridge.SYNTHETIC_FLIGHT_BYTES` of blocks (at least one) and two per thread
    are made and not yet written, whatever the number of cores; the file is the same."""
    from chainexec.runtime import hostcopy

    o, v = 3, 6
    monkeypatch.setattr(hostcopy, "threads", lambda: threads)
    monkeypatch.setattr(bridge, "SYNTHETIC_BLOCK_BYTES", 8 * v * v)  # one row per block
    monkeypatch.setattr(bridge, "SYNTHETIC_FLIGHT_BYTES", flight_rows * 8 * v * v)
    made, written = [], []
    real = np.random.default_rng

    def counting(seed):
        made.append(seed)
        return real(seed)

    monkeypatch.setattr(bridge.np.random, "default_rng", counting)
    blocks = bridge._ovvv_blocks(o, v, 3)
    for where, values in blocks:
        written.append(where)
        assert len(made) - len(written) < min(flight_rows, 2 * threads) + 1
    assert len(written) == o * v and len(made) == o * v


def test_synthetic_arrays_made_in_memory_are_all_but_ovvv():
    assert set(SYNTHETIC_IN_MEMORY) == set(bridge.INDICES) - {"ovvv"}


def test_failed_write_leaves_no_file_and_keeps_old_one(tmp_path, monkeypatch):
    path = tmp_path / "s.h5"
    real_create = h5py.Group.create_dataset
    calls = []

    def failing_create(self, name, *args, **kwargs):
        calls.append(name)
        if len(calls) == 3:
            raise OSError("simulated disk failure")
        return real_create(self, name, *args, **kwargs)

    monkeypatch.setattr(h5py.Group, "create_dataset", failing_create)
    with pytest.raises(OSError, match="simulated"):
        synthetic_inputs(3, 5, 1, path)
    assert list(tmp_path.iterdir()) == []  # no file, no temporary one

    monkeypatch.setattr(h5py.Group, "create_dataset", real_create)
    synthetic_inputs(3, 5, 1, path)
    old = path.read_bytes()
    calls.clear()
    monkeypatch.setattr(h5py.Group, "create_dataset", failing_create)
    with pytest.raises(OSError, match="simulated"):
        synthetic_inputs(3, 5, 2, path)
    assert path.read_bytes() == old
    assert list(tmp_path.iterdir()) == [path]


@pytest.fixture(scope="module")
def h2o_frozen(tmp_path_factory):
    """PySCF on one thread (:data:`tests.conftest.ONE_THREAD`)."""
    pytest.importorskip("pyscf")
    from pyscf import lib

    path = tmp_path_factory.mktemp("bridge") / "h2o.h5"
    with lib.with_omp_threads(1):
        return write_ccsd_inputs(molecule(H2O, "cc-pvdz"), path, frozen=1)


def test_pyscf_file_layout_and_attributes(h2o_frozen):
    # H2O/cc-pVDZ: 24 orbitals, 5 doubly occupied, 1 frozen core -> o = 4, v = 19.
    assert (h2o_frozen["nocc"], h2o_frozen["nvir"]) == (4, 19)
    with h5py.File(h2o_frozen["path"], "r") as f:
        check_layout(f, 4, 19)
        assert f.attrs["atoms"] == H2O and f.attrs["basis"] == "cc-pvdz"
        assert f.attrs["frozen"] == 1
        assert f.attrs["e_hf"] == pytest.approx(-76.0267720534, abs=1e-8)
        for key in ("e_hf", "e_ccsd", "e_t"):
            assert f.attrs[key] == h2o_frozen[key]
        assert -0.3 < f.attrs["e_ccsd"] < -0.1 and -0.01 < f.attrs["e_t"] < 0
        assert "synthetic" not in f.attrs
        e_occ, e_vir = f["e_occ"][()], f["e_vir"][()]
        ovov = f["ovov"][()]
        assert np.all(e_occ < 0) and e_occ.max() < e_vir.min()
        np.testing.assert_allclose(ovov, ovov.transpose(2, 3, 0, 1), atol=1e-12)
        assert np.abs(f["f_vo"][()]).max() < 1e-6  # converged canonical RHF


@pytest.mark.parametrize("solver, options", [("scf", {"scf_max_cycle": 1}), ("ccsd", {"ccsd_max_cycle": 1})])
def test_not_converged_leaves_no_file(tmp_path, solver, options):
    """An SCF or CCSD stopped at its iteration limit raises NotConverged naming the solver, and
    writes nothing."""
    pytest.importorskip("pyscf")
    path = tmp_path / "h2o.h5"
    with pytest.raises(bridge.NotConverged, match=f"{solver.upper()} did not converge") as caught:
        write_ccsd_inputs(molecule(H2O, "cc-pvdz"), path, **options)
    assert caught.value.solver == solver
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, basis, functions, electrons", [
    ("h2o", "cc-pvdz", 24, 10), ("n2", "cc-pvdz", 28, 14), ("benzene", "cc-pvdz", 114, 42),
    ("pyridine", "cc-pvdz", 109, 42), ("anisole", "cc-pvtz", 352, 58)])
def test_named_molecules_build_with_their_size_and_no_atoms_closer_than_a_bond(name, basis, functions, electrons):
    """Each named molecule (``chainexec chem NAME``) builds in PySCF with the functions and
    electrons its formula gives (cc-pVDZ: 14 per C, N, O and 5 per H; cc-pVTZ: 30 and 14), and
    no two atoms nearer than 0.95 Angstrom."""
    pytest.importorskip("pyscf")
    from chainexec.chem.job import MOLECULES

    mol = molecule(MOLECULES[name], basis)
    assert (mol.nao, mol.nelectron) == (functions, electrons)
    xyz = mol.atom_coords(unit="Angstrom")
    apart = np.linalg.norm(xyz[:, None] - xyz[None], axis=-1) + np.eye(len(xyz)) * 10
    assert apart.min() > 0.95


@pytest.mark.parametrize("atoms, basis, electrons, ecp", [
    ("I 0 0 0; H 0 0 1.61", "def2-svp", 26, ["I"]), ("I 0 0 0; H 0 0 1.61", "sto-3g", 54, []),
    ("Br 0 0 0; H 0 0 1.41", "def2-svp", 36, []), ("O 0 0 0; H 0 0.757 0.587; H 0 -0.757 0.587", "def2-svp", 10, [])])
def test_a_basis_with_core_potentials_applies_them(atoms, basis, electrons, ecp):
    """HI in def2-SVP: iodine's 28 core electrons are an ECP of the basis, applied (26 electrons
    left; it ran with all 54 in functions made for the valence); an all-electron basis (STO-3G),
    bromine (no ECP in def2) and water keep every electron."""
    pytest.importorskip("pyscf")
    mol = molecule(atoms, basis)
    assert mol.nelectron == electrons and sorted(mol._ecp) == ecp
