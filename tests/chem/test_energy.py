"""``chainexec.chem.ccsd_t(mycc)`` in place of ``mycc.ccsd_t()``: the same E(T) within 1e-10 Eh
on H2O and N2 in cc-pVDZ, all electrons and frozen core, from a live CCSD and from one restored
from its checkpoint file; its temporary files are removed; anything but a closed-shell CCSD with
amplitudes is one error. (The amplitudes need not be tightly converged: both energies are of
the same ones.)"""

from __future__ import annotations

import pytest

from chainexec.chem import ccsd_t
from chainexec.chem.job import MOLECULES
from chainexec.errors import ChainexecError

pytest.importorskip("pyscf")


@pytest.fixture(scope="module", params=[("h2o", 1), ("n2", 2)], ids=["h2o", "n2"])
def solved(request, tmp_path_factory):
    """One RHF, and on it a converged RCCSD of all electrons and one with the core frozen (its
    checkpoint file written): each with PySCF's own E(T) of it. PySCF on one thread: pytest's
    workers share the cores (on two cores two workers of two OpenMP threads each took 4-8 times
    as long)."""
    from pyscf import cc, gto, lib, scf

    name, core = request.param
    chk = tmp_path_factory.mktemp(name) / "ccsd.chk"
    found = []
    with lib.with_omp_threads(1):
        mf = scf.RHF(gto.M(atom=MOLECULES[name], basis="cc-pvdz", verbose=0))
        mf.chkfile = str(chk)
        mf.kernel()
        for frozen in (None, core):
            mycc = cc.RCCSD(mf, frozen=frozen)
            mycc.kernel()
            assert mycc.converged
            found.append((mycc, mycc.ccsd_t()))
    mycc.dump_chk()  # the frozen-core one, into mf.chkfile, which mycc took over
    return found, chk


def test_equals_pyscf(solved, tmp_path):
    for mycc, expected in solved[0]:
        energy = ccsd_t(mycc, folder=tmp_path)
        assert isinstance(energy, float)
        assert abs(energy - expected) <= 1e-10
        assert expected < -1e-4  # a real correction, not a vacuous comparison
        assert list(tmp_path.iterdir()) == []  # the temporary inputs are gone
    assert solved[0][1][0].frozen and solved[0][1][1] != solved[0][0][1]


def test_equals_pyscf_with_its_arguments(solved):
    """PySCF's order, ``ccsd_t(t1, t2, eris)``: the integrals made once serve both."""
    mycc, _ = solved[0][1]
    eris = mycc.ao2mo()
    assert abs(ccsd_t(mycc, mycc.t1, mycc.t2, eris, backend="numpy") - mycc.ccsd_t(mycc.t1, mycc.t2, eris)) <= 1e-10


def test_equals_pyscf_from_the_checkpoint_file(solved):
    """A CCSD restored from its checkpoint file (``mycc.dump_chk()``) as a PySCF user restores it:
    the integrals are made anew (out of core: the restored RHF holds none)."""
    from pyscf import cc, lib, scf

    chk = str(solved[1])
    mf = scf.RHF(lib.chkfile.load_mol(chk))
    mf.__dict__.update(scf.chkfile.load(chk, "scf"))
    saved = lib.chkfile.load(chk, "ccsd")
    restored = cc.RCCSD(mf, frozen=int(saved["frozen"]))
    restored.__dict__.update(saved)
    assert abs(ccsd_t(restored) - solved[0][1][1]) <= 1e-10


def test_anything_but_a_closed_shell_ccsd_is_refused(solved):
    mycc, _ = solved[0][0]
    with pytest.raises(ChainexecError, match="closed-shell PySCF CCSD .*, not RHF"):
        ccsd_t(mycc._scf)
    with pytest.raises(ChainexecError, match="run mycc.kernel"):
        ccsd_t(mycc, t1=mycc.t1[0])
