"""Tests of chainexec.chem.triples against PySCF and against a brute-force reference.

The brute-force reference below is written from PySCF's ccsd_t_slow.py in its own form (full
6-index arrays, r3 on the occupied axes, the unsymmetrized second factor, factor 2) and shares no
code with chainexec.chem.triples, whose streamed form (triples i >= j >= k, r3 on the virtual
axes, factor 1/3) it checks.
"""

import re
from itertools import permutations

import h5py
import numpy as np
import pytest

from chainexec.chem import triples
from chainexec.chem.bridge import molecule, synthetic_inputs, write_ccsd_inputs
from chainexec.chem.triples import ccsd_t_energy

H2O = "O 0 0 0.1173; H 0 0.7572 -0.4692; H 0 -0.7572 -0.4692"
N2 = "N 0 0 0; N 0 0 1.0977"


def read_all(path):
    with h5py.File(path, "r") as f:
        return {name: f[name][()] for name in f}


def brute_force_t(x):
    """E(T) = 2 sum W r3_occ(W0 + V0/2) / D over all ijkabc, all arrays 6-index, at once."""
    w0 = (np.einsum("iafb,kjcf->ijkabc", x["ovvv"], x["t2"])
          - np.einsum("iajm,mkbc->ijkabc", x["ovoo"], x["t2"]))
    v0 = (np.einsum("iajb,kc->ijkabc", x["ovov"], x["t1"])
          + np.einsum("ijab,ck->ijkabc", x["t2"], x["f_vo"]))
    w = sum(w0.transpose(p + tuple(3 + n for n in p)) for p in permutations(range(3)))
    eo, ev = x["e_occ"], x["e_vir"]
    d = (eo[:, None, None, None, None, None] + eo[None, :, None, None, None, None]
         + eo[None, None, :, None, None, None] - ev[None, None, None, :, None, None]
         - ev[None, None, None, None, :, None] - ev[None, None, None, None, None, :])
    z = w0 + 0.5 * v0

    def occ(axes):
        return z.transpose(axes + (3, 4, 5))

    r3 = (4 * z + occ((1, 2, 0)) + occ((2, 0, 1))
          - 2 * occ((2, 1, 0)) - 2 * occ((0, 2, 1)) - 2 * occ((1, 0, 2)))
    return 2 * np.sum(w * r3 / d), w


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("triples") / "tiny.h5"
    synthetic_inputs(3, 5, 20240611, path)
    return path


def test_synthetic_matches_brute_force(tiny):
    e_ref, _ = brute_force_t(read_all(tiny))
    assert abs(e_ref) > 1e-6
    assert ccsd_t_energy(tiny) == pytest.approx(e_ref, rel=1e-12, abs=0)


@pytest.mark.parametrize("o,v,seed", [(2, 4, 3), (4, 2, 4), (5, 6, 5)])
def test_other_synthetic_sizes_match_brute_force(tmp_path, o, v, seed):
    synthetic_inputs(o, v, seed, tmp_path / "s.h5")
    e_ref, _ = brute_force_t(read_all(tmp_path / "s.h5"))
    assert ccsd_t_energy(tmp_path / "s.h5") == pytest.approx(e_ref, rel=1e-12, abs=0)


def test_accepts_path_open_file_and_mapping(tiny):
    e = ccsd_t_energy(str(tiny))
    with h5py.File(tiny, "r") as f:
        assert ccsd_t_energy(f) == e
    assert ccsd_t_energy(read_all(tiny)) == e


def test_rejects_missing_and_misshapen_inputs(tiny):
    x = read_all(tiny)
    del x["f_vo"]
    with pytest.raises(ValueError, match="f_vo"):
        ccsd_t_energy(x)
    x = read_all(tiny)
    x["ovoo"] = x["ovoo"][:, :, :, :2]
    with pytest.raises(ValueError, match="ovoo"):
        ccsd_t_energy(x)


ROW = re.compile(r"^\s*([WV])(\d+)\s+([WV])\s+([+-])\s+(\w+)\[(\w+)\]\s+(\w+)\[(\w+)\]"
                 r"\s+(\S+)\s+([ijk]{3})\s*$")


def docstring_table():
    return [m.groups() for m in map(ROW.match, triples.__doc__.splitlines()) if m]


def test_docstring_contraction_table_reproduces_energy(tiny):
    """Evaluate the table handed to the YAML author, line by line, and its final steps."""
    rows = docstring_table()
    assert [(r[0], int(r[1])) for r in rows] == (
        [("W", n) for n in range(1, 13)] + [("V", n) for n in range(1, 13)])
    assert {r[9] for r in rows[:6]} == {"".join(p) for p in permutations("ijk")}
    x = read_all(tiny)
    o, v = x["t1"].shape
    acc = {"W": np.zeros((o,) * 3 + (v,) * 3), "V": np.zeros((o,) * 3 + (v,) * 3)}
    for name, _, out, sign, left, lidx, right, ridx, spec, _ in rows:
        assert out == name and spec == f"{lidx},{ridx}->ijkabc"
        term = np.einsum(spec, x[left], x[right])
        acc[out] += term if sign == "+" else -term
    e_ref, w_ref = brute_force_t(x)
    np.testing.assert_allclose(acc["W"], w_ref, rtol=0, atol=1e-15)

    z = acc["W"] + 0.5 * acc["V"]

    def zp(letters):
        return np.einsum(f"ijk{letters}->ijkabc", z)

    r = 4 * z + zp("bca") + zp("cab") - 2 * zp("acb") - 2 * zp("bac") - 2 * zp("cba")
    eo, ev = x["e_occ"], x["e_vir"]
    d = (np.add.outer(np.add.outer(eo, eo), eo)[:, :, :, None, None, None]
         - np.add.outer(np.add.outer(ev, ev), ev)[None, None, None])
    e_table = np.einsum("ijkabc,ijkabc->", acc["W"] / d, r) / 3
    assert e_table == pytest.approx(e_ref, rel=1e-12, abs=0)


def test_synthetic_matches_pyscf_ccsd_t_slow(tiny):
    """Same arrays through PySCF's own reference kernel: checks the layout conventions too."""
    pytest.importorskip("pyscf")
    from pyscf import cc, gto, lib, scf
    from pyscf.cc import ccsd_t_slow

    x = read_all(tiny)
    o, v = x["t1"].shape
    eris = cc.ccsd._ChemistsERIs()
    eris.ovvv = lib.pack_tril(x["ovvv"].reshape(o * v, v, v)).reshape(o, v, -1)
    eris.ovoo = x["ovoo"]
    eris.ovov = x["ovov"]
    eris.mo_energy = np.concatenate([x["e_occ"], x["e_vir"]])
    eris.fock = np.diag(eris.mo_energy)
    eris.fock[o:, :o] = x["f_vo"]
    eris.fock[:o, o:] = x["f_vo"].T
    mycc = cc.CCSD(scf.RHF(gto.M(verbose=0)))
    e_pyscf = ccsd_t_slow.kernel(mycc, eris, x["t1"], x["t2"])
    assert ccsd_t_energy(tiny) == pytest.approx(e_pyscf, rel=1e-12, abs=0)


@pytest.mark.parametrize("name,atoms,frozen", [("h2o", H2O, 0), ("n2", N2, 2)])
def test_real_molecule_matches_pyscf_ccsd_t(tmp_path, name, atoms, frozen):
    """PySCF on one thread (:data:`tests.conftest.ONE_THREAD`)."""
    pytest.importorskip("pyscf")
    from pyscf import lib

    with lib.with_omp_threads(1):
        info = write_ccsd_inputs(molecule(atoms, "cc-pvdz"), tmp_path / f"{name}.h5", frozen=frozen)
    with h5py.File(info["path"], "r") as f:
        e_pyscf = f.attrs["e_t"]
        assert ccsd_t_energy(f) == pytest.approx(e_pyscf, abs=1e-10, rel=0)
    assert e_pyscf == info["e_t"] and e_pyscf < 0
