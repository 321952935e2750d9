"""The AO→MO four-index transform of a molecule's integrals: `chainexec chem MOLECULE --job ao2mo`
writes PySCF's AO integrals (packed s8 or s4, or dense; or none: each tile computed by libcint
where it is loaded) and MO coefficients, `chainexec run`
transforms them over index pairs, and the result — in PySCF's compact s4 layout, or dense where
the config asks — equals PySCF's own `ao2mo.full` (integrals recomputed by PySCF) on 1, 2 and 4
ranks, with the bytes moved equal to the prediction."""

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from chainexec.packing import npair
from tests.conftest import assert_refused, read_report, run_cli

pytest.importorskip("pyscf")


def _reference(molecule: str, C: np.ndarray) -> np.ndarray:
    from pyscf import ao2mo, gto

    from chainexec.chem.job import MOLECULES

    mol = gto.M(atom=MOLECULES[molecule], basis="cc-pvdz", unit="Angstrom", verbose=0)
    return ao2mo.full(mol, C)  # s4: (npair, npair)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """``chainexec chem``'s folder (config and inputs, relative to each other) per molecule and
    layout, made once per module (and worker); a test copies it."""
    made = {}

    def folder(molecule: str, layout: str) -> Path:
        if (molecule, layout) not in made:
            out = tmp_path_factory.mktemp(f"{molecule}-{layout}")
            prep = run_cli("chem", molecule, "--basis", "cc-pvdz", "--job", "ao2mo", "--layout", layout, "--out", out)
            assert prep.returncode == 0, prep.stderr
            made[molecule, layout] = out
        return made[molecule, layout]

    return folder


@pytest.mark.parametrize("molecule, layout, output, ranks, memory", [
    ("h2o", "s8", "s4", 1, "small"), ("h2o", "s8", "s4", 2, "small"), ("h2o", "s4", "s4", 4, "small"),
    ("n2", "s8", "s4", 2, "small"), ("n2", "s4", "dense", 1, "small"), ("h2o", "dense", "s4", 1, "small"),
    ("h2o", "s8", "s4", 1, "ample"), ("n2", "s4", "s4", 2, "ample"),
    ("h2o", "computed", "s4", 2, "small"), ("n2", "computed", "s4", 4, "small"), ("n2", "computed", "s4", 1, "ample"),
])
def test_ao2mo_equals_pyscf(molecule, layout, output, ranks, memory, tmp_path, prepared):
    """``small``: limits that tile both levels; ``ample``: room for everything, where each packed
    input value is read from disk once and each output value written once."""
    from pyscf import ao2mo

    shutil.copytree(prepared(molecule, layout), tmp_path, dirs_exist_ok=True)
    config = tmp_path / "ao2mo.yaml"
    cfg = yaml.safe_load(config.read_text())
    # libcint's rate, measured by chem, states what the planner prices computed loads at
    assert (cfg["tensors"]["A"]["source"].get("bytes_per_second", 0) > 0) == (layout == "computed")
    cfg["tensors"]["B"]["layout"] = output
    cfg["machine"] = ({"global_memory": "2MiB", "device_memory": "1MiB"} if memory == "small"
                      else {"global_memory": "256MiB", "device_memory": "64MiB"})
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run = run_cli("run", config, "--quiet", "--report-json", tmp_path / "r.json", ranks=ranks)
    assert run.returncode == 0, run.stderr
    report = read_report(tmp_path / "r.json")
    assert report["measured"]["bytes"] == report["predicted"]["bytes"]
    with h5py.File(tmp_path / "inputs.h5") as f:
        C = f["C"][...]
        assert ("A" in f) == (layout != "computed")  # computed integrals never touch the disk
    nmo = C.shape[1]
    ref = _reference(molecule, C)
    with h5py.File(tmp_path / "output.h5") as f:
        B = f["B"][...]
    if output == "s4":
        assert B.shape == ref.shape
        assert np.abs(B - ref).max() <= 1e-12 * np.abs(ref).max()
        assert np.abs(ao2mo.restore(1, B, nmo) - ao2mo.restore(1, ref, nmo)).max() <= 1e-12 * np.abs(ref).max()
    else:
        dense = ao2mo.restore(1, ref, nmo)
        assert B.shape == dense.shape and np.abs(B - dense).max() <= 1e-12 * np.abs(dense).max()
    if memory == "ample":  # computed integrals: s8, each counted once where they are loaded
        with h5py.File(tmp_path / "inputs.h5") as f:
            packed_input = f["A"].size if "A" in f else npair(npair(C.shape[0]))
        assert report["measured"]["bytes"]["disk->global"] == 8 * (packed_input + C.size)
        assert report["measured"]["bytes"]["global->disk"] == 8 * B.size


def test_verify_reads_packed_layouts(tmp_path):
    """``chainexec verify`` unpacks the packed input and output independently and agrees."""
    assert run_cli("chem", "h2o", "--job", "ao2mo", "--out", tmp_path).returncode == 0
    assert run_cli("run", tmp_path / "ao2mo.yaml", "--quiet").returncode == 0
    check = run_cli("verify", tmp_path / "ao2mo.yaml")
    assert check.returncode == 0 and " ok" in check.stdout, check.stdout + check.stderr


def test_a_symmetry_the_data_lacks_is_caught_by_verify(tmp_path):
    """Integrals written dense but not symmetric (one element changed) and declared symmetric:
    verify checks the declaration against the data and fails."""
    assert run_cli("chem", "h2o", "--job", "ao2mo", "--layout", "dense", "--out", tmp_path).returncode == 0
    with h5py.File(tmp_path / "inputs.h5", "a") as f:
        f["A"][0, 1, 2, 3] += 1.0
    config = tmp_path / "ao2mo.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["tensors"]["B"]["layout"] = "dense"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert run_cli("run", config, "--quiet").returncode == 0
    check = run_cli("verify", config)
    assert check.returncode == 1, check.stdout + check.stderr
    assert [line.split(":")[0] for line in check.stdout.splitlines() if "FAILED" in line] == ["A (its declared symmetry)"]


def test_packed_integrals_lacking_the_exchange_they_declare_are_refused(tmp_path):
    """PySCF's integrals stored as s4 (two pairs) with the exchange declared: the layout stores
    (pq|rs) and (rs|pq) both and the run reads one for the other. PySCF's hold them equal and
    run to verify's ok; with one stored element changed the run refuses them in one line naming
    the two that differ (it ended with status 0 and a result that was neither). The run samples
    64 elements: a check for values made without the symmetry (here: every element moved by its
    own amount), not for one changed element (verify's full check finds that)."""
    assert run_cli("chem", "h2o", "--job", "ao2mo", "--layout", "s4", "--out", tmp_path).returncode == 0
    config = tmp_path / "ao2mo.yaml"
    assert run_cli("run", config, "--quiet").returncode == 0
    assert run_cli("verify", config).returncode == 0
    with h5py.File(tmp_path / "inputs.h5", "a") as f:
        a = f["A"][()]
        assert a.ndim == 2 and a.shape[0] == a.shape[1]
        f["A"][...] = a + np.random.default_rng(5).uniform(0.1, 0.2, a.shape)
    assert_refused(run_cli("run", config, "--quiet"), "inputs.h5", "tensor A is declared symmetric, but dataset 'A'")


BAD = {
    "packed dataset of the wrong length": (lambda f: (f.__delitem__("A"), f.create_dataset("A", data=np.ones(17))),
                                           ["inputs.h5", "shape (17,)"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_packed_input(case, tmp_path):
    edit, needles = BAD[case]
    assert run_cli("chem", "h2o", "--job", "ao2mo", "--out", tmp_path).returncode == 0
    with h5py.File(tmp_path / "inputs.h5", "a") as f:
        edit(f)
    assert_refused(run_cli("run", tmp_path / "ao2mo.yaml", "--quiet"), *needles)
    assert not (tmp_path / "output.h5").exists()


def test_ao2mo_refuses_synthetic(tmp_path):
    r = run_cli("chem", "h2o", "--job", "ao2mo", "--synthetic", 2, 3, 1, "--out", tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "ao2mo" in r.stderr


def test_an_ion_equals_pyscf(tmp_path):
    """``--charge``: H3O+ (10 electrons) transformed with its own RHF orbitals; its SCF energy equals
    PySCF's for the ion, built here, and the output its ``ao2mo.full``. ``--missing`` keeps inputs
    made for the same charge, refuses another, and takes inputs written without a charge as a
    neutral molecule's."""
    from pyscf import ao2mo, gto, scf

    atoms = "O 0 0 0.1; H 0 0.94 -0.22; H 0.81 -0.47 -0.22; H -0.81 -0.47 -0.22"
    prep = ("chem", atoms, "--job", "ao2mo", "--out", tmp_path, "--charge", 1)
    assert run_cli(*prep).returncode == 0
    assert run_cli("run", tmp_path / "ao2mo.yaml", "--quiet", ranks=2).returncode == 0
    mol = gto.M(atom=atoms, basis="cc-pvdz", charge=1, unit="Angstrom", verbose=0)
    mf = scf.RHF(mol)
    mf.conv_tol = 1e-10
    e_hf = mf.kernel()
    with h5py.File(tmp_path / "inputs.h5") as f:
        C, attrs = f["C"][...], dict(f.attrs)
    assert attrs["charge"] == 1 and abs(attrs["e_hf"] - e_hf) <= 1e-8
    ref = ao2mo.full(mol, C)
    with h5py.File(tmp_path / "output.h5") as f:
        assert np.abs(f["B"][...] - ref).max() <= 1e-12 * np.abs(ref).max()
    assert "nothing written" in run_cli(*prep, "--missing").stdout
    other = ("chem", atoms, "--job", "ao2mo", "--out", tmp_path, "--missing")
    assert_refused(run_cli(*other, "--charge", -1), "made for another job: charge 1 (here -1)")
    with h5py.File(tmp_path / "inputs.h5", "a") as f:
        del f.attrs["charge"]
    assert_refused(run_cli(*prep, "--missing"), "made for another job: charge 0 (here 1)")
