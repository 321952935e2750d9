"""The AO→MO four-index transform of a molecule's integrals: `chainexec chem MOLECULE --job ao2mo`
writes PySCF's AO integrals and MO coefficients, `chainexec run` transforms them, and the result
equals PySCF's own `ao2mo.full` (integrals recomputed by PySCF, unpacked) on 1 and 2 ranks."""

import h5py
import numpy as np
import pytest

from tests.conftest import run_cli

pytest.importorskip("pyscf")


@pytest.mark.parametrize("ranks", [1, 2])
def test_ao2mo_equals_pyscf(tmp_path, ranks):
    from pyscf import ao2mo, gto

    from chainexec.chem.job import MOLECULES

    prep = run_cli("chem", "h2o", "--basis", "cc-pvdz", "--job", "ao2mo", "--out", tmp_path)
    assert prep.returncode == 0, prep.stderr
    run = run_cli("run", tmp_path / "fourindex.yaml", "--report-json", tmp_path / "r.json", ranks=ranks)
    assert run.returncode == 0, run.stderr
    with h5py.File(tmp_path / "inputs.h5") as f:
        C = f["C"][...]
        nao, nmo = int(f.attrs["nao"]), int(f.attrs["nmo"])
    with h5py.File(tmp_path / "output.h5") as f:
        B = f["B"][...]
    mol = gto.M(atom=MOLECULES["h2o"], basis="cc-pvdz", unit="Angstrom", verbose=0)
    ref = ao2mo.restore(1, ao2mo.full(mol, C), nmo)
    assert (nao, nmo) == (24, 24) and B.shape == (nmo,) * 4
    assert np.linalg.norm(B - ref) <= 1e-12 * np.linalg.norm(ref)


def test_ao2mo_refuses_synthetic(tmp_path):
    r = run_cli("chem", "h2o", "--job", "ao2mo", "--synthetic", 2, 3, 1, "--out", tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "ao2mo" in r.stderr
