"""Write the inputs of the closed-shell CCSD(T) triples energy to one HDF5 file.

The file holds exactly what the (T) formula of PySCF's ``pyscf/cc/ccsd_t_slow.py`` reads, with the
MO integrals in chemists' notation ``(pq|rs)`` (real orbitals) and every energy in Hartree:

=========  ==============  ===========  ====================================================
dataset    shape           ``indices``  meaning
=========  ==============  ===========  ====================================================
t1         (o, v)          ``ia``       CCSD singles amplitudes t_i^a (dimensionless)
t2         (o, o, v, v)    ``ijab``     CCSD doubles amplitudes t_ij^ab (dimensionless)
ovvv       (o, v, v, v)    ``iabc``     (ia|bc), PySCF ``eris.get_ovvv()`` (Hartree)
ovoo       (o, v, o, o)    ``iajk``     (ia|jk), PySCF ``eris.ovoo`` (Hartree)
ovov       (o, v, o, v)    ``iajb``     (ia|jb), PySCF ``eris.ovov`` (Hartree)
e_occ      (o,)            ``i``        occupied orbital energies = Fock diagonal (Hartree)
e_vir      (v,)            ``a``        virtual orbital energies = Fock diagonal (Hartree)
f_vo       (v, o)          ``ai``       virtual-occupied Fock block f_ai (Hartree; ~0 for
                                        converged canonical RHF, but it enters the formula)
=========  ==============  ===========  ====================================================

``o`` and ``v`` count *active* orbitals (frozen core removed). Each dataset carries the attribute
``indices`` (:data:`chainexec.chem.layout.INDICES`). File attributes: ``nocc``, ``nvir``, ``units`` ("Hartree") and either the PySCF
results (``e_hf`` total RHF energy, ``e_ccsd`` CCSD correlation energy, ``e_t`` PySCF's own
``mycc.ccsd_t()``, ``atoms``, ``basis``, ``charge``, ``frozen``) or, for random inputs, ``synthetic=True`` and
``seed``.

Files are written under a new temporary name beside ``path`` and renamed onto it only when
complete (:func:`chainexec.atomicfile.replacing`), so a file at ``path`` is never partial and no
other file is written over; on any failure the temporary file is removed.
"""

from __future__ import annotations

import collections
import os
import re
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np

from chainexec import atomicfile
from chainexec.chem.integrals import basis_read
from chainexec.chem.layout import AO2MO_INDICES, INDICES
from chainexec.runtime import hostcopy


class NotConverged(RuntimeError):
    """PySCF's ``solver`` (``"scf"`` or ``"ccsd"``) stopped at its iteration limit before its
    convergence threshold was met."""

    def __init__(self, solver: str, conv_tol: float, max_cycle: int):
        super().__init__(f"{solver.upper()} did not converge to {conv_tol:g} Hartree in {max_cycle} iterations")
        self.solver = solver


def molecule(atoms: str, basis: str, charge: int = 0):
    """The PySCF molecule (``gto.Mole``, built, nothing solved) of ``atoms``, a PySCF atom string in
    Angstrom (e.g. ``"O 0 0 0; H 0 0.757 0.587; ..."``), in ``basis``, a PySCF basis name, of
    ``charge`` (elementary charges: -1 holds one electron more than its nuclei's), with the
    basis's effective core potentials for the elements it defines them for (def2 bases beyond
    Kr, as quantum chemistry programs apply them: the basis describes the valence electrons
    alone). Its ``nelectron`` (the electrons the potentials leave) and ``nao`` give the orbital
    counts before any SCF runs. Raises ``ValueError`` naming the basis PySCF lacks (for these
    elements), the atom string it cannot read (PySCF's parser raises many kinds of error for
    those: a name, an index), an electron count that no closed shell has or one below two (the
    electrons the potentials and the charge leave), a coordinate that is not a finite number, or
    two atoms closer than :data:`MIN_DISTANCE` (PySCF reads all of these, and its SCF then fails
    on a singular overlap after warnings of its own)."""
    from pyscf import gto  # optional dependency: extra "chem"
    from pyscf.lib.exceptions import BasisNotFoundError

    if (reason := basis_read(basis)) is not None:
        raise ValueError(reason)
    if re.fullmatch(r"\S+\.(xyz|zmat)", atoms, re.IGNORECASE) and not os.path.isfile(atoms):
        raise ValueError("no such geometry file")

    def build(**options):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PySCF's advice to install basis-set-exchange
            return gto.M(atom=atoms, basis=basis, unit="Angstrom", verbose=0, **options)

    try:  # neutral and of either parity first: its electrons are counted here, not by PySCF's assertions
        mol = build(spin=None)
    except BasisNotFoundError as err:
        raise ValueError(f"PySCF has no basis {basis!r} for these atoms ({first_line(err)})") from None
    except Exception as err:  # what PySCF's parser raises on a malformed atom string varies
        raise ValueError(f"PySCF cannot read the atom string ({first_line(err)})") from None
    # the basis's effective core potentials where it defines them (def2 beyond Kr): its functions
    # are made for the valence electrons alone, and without them the core would be in the molecule
    ecp = {symbol: basis for symbol in sorted({mol.atom_pure_symbol(i) for i in range(mol.natm) if mol.atom_charge(i)})
           if isinstance(basis, str) and gto.basis.load_ecp(basis, symbol)}
    if ecp:
        mol = build(spin=None, ecp=ecp)
    electrons = mol.nelectron - charge
    if electrons < 2:
        raise ValueError(f"the molecule has {electrons} electrons{_of(charge, ecp)}: the jobs need an occupied orbital")
    if electrons % 2:
        raise ValueError(f"the molecule has {electrons} electrons{_of(charge, ecp)}: the jobs take closed-shell "
                         "molecules (restricted Hartree-Fock, CCSD), with an even number")
    if charge:
        mol = build(charge=charge, **({"ecp": ecp} if ecp else {}))
    where = mol.atom_coords(unit="Angstrom")
    if not np.isfinite(where).all():
        raise ValueError("an atom's coordinate is not a finite number")
    apart = np.linalg.norm(where[:, None, :] - where[None, :, :], axis=-1) + np.eye(len(where)) * MIN_DISTANCE
    if (apart < MIN_DISTANCE).any():
        i, j = sorted(np.argwhere(apart < MIN_DISTANCE)[0])
        raise ValueError(f"atoms {i + 1} ({mol.atom_symbol(i)}) and {j + 1} ({mol.atom_symbol(j)}) are "
                         f"{apart[i, j]:.3g} Angstrom apart, closer than {MIN_DISTANCE}")
    return mol


def _of(charge: int, ecp: dict) -> str:
    """What an electron count is of, where it is not plain: an ion's charge, the core electrons
    the effective core potentials of ``ecp`` (elements by symbol) leave out."""
    said = ([f"at charge {charge:+d}"] if charge else []) + (
        [f"beside the cores the potentials of {', '.join(ecp)} hold"] if ecp else [])
    return " " + " and ".join(said) if said else ""


MIN_DISTANCE = 0.1
"""Angstrom two atoms of a molecule must be apart at least (the shortest bond, H2's, is 0.74)."""


def atom_text(mol) -> str:
    """``mol``'s atoms as a PySCF atom string in Angstrom, each coordinate as Python writes a
    float exactly: what a geometry file gave, written into a job's config and inputs, so that
    a run does not read the file again (from where it starts, or after it changed)."""
    return "; ".join(f"{mol.atom_symbol(i)} " + " ".join(map(repr, map(float, xyz)))
                     for i, xyz in enumerate(mol.atom_coords(unit="Angstrom")))


def first_line(err: Exception) -> str:
    """The first line of an error's message (PySCF's run over several), or its type's name."""
    text = str(err).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Error on thread"):
        # PySCF's error of a background thread (lib.call_in_background): "Error on thread <...>:"
        # and, on the lines after it, the thread's own error (HDF5's spans two), which is what went wrong
        return " ".join(line.strip() for line in lines[1:])
    return lines[0] if lines else type(err).__name__


def _solve(solver: str, method, conv_tol: float, max_cycle: int, **kernel):
    """Run PySCF's ``method`` (an SCF or CCSD object) to ``conv_tol`` Hartree in ``max_cycle``
    iterations at most; :class:`NotConverged` where it stops short."""
    method.conv_tol = conv_tol
    method.max_cycle = max_cycle
    method.kernel(**kernel)
    if not method.converged:
        raise NotConverged(solver, conv_tol, max_cycle)
    return method


def write_ccsd_inputs(mol, path, *, frozen: int = 0, scf_conv_tol: float = 1e-12, scf_max_cycle: int = 50,
                      ccsd_conv_tol: float = 1e-12, ccsd_max_cycle: int = 50) -> dict:
    """Run RHF + closed-shell RCCSD + (T) with PySCF and write the (T) inputs to ``path``.

    ``mol`` is a PySCF molecule (:func:`molecule`), ``frozen`` the number of lowest orbitals kept
    frozen in CCSD. ``scf_conv_tol`` and ``ccsd_conv_tol`` (Hartree) are the energy convergence
    thresholds of RHF and CCSD, ``scf_max_cycle`` and ``ccsd_max_cycle`` their iteration limits
    (PySCF's own, 50); the CCSD amplitude-change threshold is ``sqrt(ccsd_conv_tol)``. Both
    thresholds are tight by default: the stored ``e_hf``, ``e_ccsd`` and ``e_t`` are reference
    energies, and the canonical orbitals of a converged RHF make ``f_vo`` vanish. The integrals
    and orbital energies are taken from the same ``eris`` object PySCF's ``ccsd_t()`` uses, so the
    stored ``e_t`` is the (T) energy of exactly the stored arrays. Raises :class:`NotConverged` if
    RHF or CCSD stops at its limit; nothing is written then.

    Returns a summary: ``path``, ``nocc``, ``nvir``, ``e_hf``, ``e_ccsd``, ``e_t`` (Hartree).
    """
    from pyscf import cc, scf  # optional dependency: extra "chem"

    mf = _solve("scf", scf.RHF(mol), scf_conv_tol, scf_max_cycle)
    mycc = cc.RCCSD(mf, frozen=frozen or None)
    mycc.conv_tol_normt = ccsd_conv_tol ** 0.5
    eris = mycc.ao2mo()
    _solve("ccsd", mycc, ccsd_conv_tol, ccsd_max_cycle, eris=eris)
    start = time.perf_counter()
    e_t = float(mycc.ccsd_t(eris=eris))
    e_t_seconds = time.perf_counter() - start  # PySCF's own (T) step, for benchmarks

    nocc, nvir = mycc.t1.shape
    arrays = ccsd_arrays(mycc.t1, mycc.t2, eris)
    summary = {"path": os.fspath(path), "nocc": nocc, "nvir": nvir,
               "e_hf": float(mf.e_tot), "e_ccsd": float(mycc.e_corr), "e_t": e_t}
    attrs = {"nocc": nocc, "nvir": nvir, "units": "Hartree", "e_hf": summary["e_hf"],
             "e_ccsd": summary["e_ccsd"], "e_t": e_t, "e_t_seconds": e_t_seconds, "atoms": mol.atom,
             "basis": mol.basis, "charge": mol.charge, "frozen": frozen}
    write_atomic(path, arrays, attrs)
    return summary


def ccsd_arrays(t1, t2, eris) -> dict:
    """The (T) inputs (the datasets of the module docstring) of PySCF's closed-shell amplitudes
    ``t1`` (o, v) and ``t2`` (o, o, v, v) and integrals ``eris`` (``mycc.ao2mo()``): the active
    orbitals only, as ``t1``'s shape counts them; energies in Hartree."""
    nocc = t1.shape[0]
    return {
        "t1": t1,
        "t2": t2,
        "ovvv": eris.get_ovvv(),
        "ovoo": eris.ovoo,
        "ovov": eris.ovov,
        "e_occ": eris.mo_energy[:nocc],
        "e_vir": eris.mo_energy[nocc:],
        "f_vo": eris.fock[nocc:, :nocc],
    }


SYNTHETIC_BLOCK_BYTES = 64 << 20
"""Bytes of ``ovvv`` a thread makes at once (whole rows (i, a), at least one): large enough
that handing one to a thread costs nothing measurable."""

SYNTHETIC_FLIGHT_BYTES = 1 << 30
"""Bytes of ``ovvv`` blocks made and not yet written, at most (and at least one block): what the
generator holds beside the arrays made in memory, whatever the number of cores."""


def synthetic_inputs(nocc: int, nvir: int, seed: int, path) -> dict:
    """Write seeded random (T) inputs of physically sensible shape and scale to ``path``.

    Same datasets as :func:`write_ccsd_inputs`, deterministic for a given ``seed``:
    amplitudes ~1e-2; integrals ~1e-1 Hartree with the permutational symmetries of real
    orbitals, (ia|jb) = (jb|ia), (ia|bc) = (ia|cb), (ia|jk) = (ia|kj), and t_ij^ab = t_ji^ba;
    occupied energies in [-1.5, -0.3] and virtual in [0.2, 2.0] Hartree (gap >= 0.5 Hartree, so
    every denominator is <= -1.5 Hartree); f_vo ~1e-3 Hartree, deliberately non-zero so that the
    f_vo term of the formula is exercised. The file gets ``synthetic=True`` and ``seed`` instead
    of PySCF energies. Returns ``{"path", "nocc", "nvir", "seed"}``.

    ``ovvv`` is not held whole: each of its rows (i, a), a v×v matrix, comes from a random stream
    of its own keyed by (seed, i, a), so its values do not depend on how the rows are grouped;
    threads make blocks of rows (:data:`SYNTHETIC_BLOCK_BYTES`), written in order as they come.
    Inputs whose ``ovvv`` exceeds this machine's memory (a (T) case larger than one GPU) then need
    only the disk; the rest (:data:`chainexec.chem.layout.SYNTHETIC_IN_MEMORY`) is made in memory from
    one stream.
    """
    rng = np.random.default_rng(seed)
    o, v = nocc, nvir

    def sym(x, axes):
        return 0.5 * (x + x.transpose(axes))

    arrays = {
        "t1": 1e-2 * rng.standard_normal((o, v)),
        "t2": sym(1e-2 * rng.standard_normal((o, o, v, v)), (1, 0, 3, 2)),
        "ovoo": sym(1e-1 * rng.standard_normal((o, v, o, o)), (0, 1, 3, 2)),
        "ovov": sym(1e-1 * rng.standard_normal((o, v, o, v)), (2, 3, 0, 1)),
        "e_occ": np.sort(rng.uniform(-1.5, -0.3, o)),
        "e_vir": np.sort(rng.uniform(0.2, 2.0, v)),
        "f_vo": 1e-3 * rng.standard_normal((v, o)),
    }
    attrs = {"nocc": o, "nvir": v, "units": "Hartree", "synthetic": True, "seed": seed}
    write_atomic(path, arrays, attrs, parts={"ovvv": ((o, v, v, v), _ovvv_blocks(o, v, seed))})
    return {"path": os.fspath(path), "nocc": o, "nvir": v, "seed": seed}


def _ovvv_blocks(o: int, v: int, seed: int):
    """The synthetic ``ovvv`` in blocks of rows, in order: ``((i, slice(a0, a1)), block)``, row
    (i, a) = 0.05·(x + xᵀ) for x the v×v standard normals of the stream keyed (seed, i, a)
    (exactly symmetric in its last two indices). Made over threads (NumPy's generators release
    the interpreter's lock while they fill), at most two blocks per thread and
    :data:`SYNTHETIC_FLIGHT_BYTES` ahead of the one taken."""
    rows = max(1, SYNTHETIC_BLOCK_BYTES // (8 * v * v))
    blocks = [(i, lo, min(lo + rows, v)) for i in range(o) for lo in range(0, v, rows)]

    def make(i: int, lo: int, hi: int):
        out = np.empty((hi - lo, v, v))
        for a in range(lo, hi):
            x = np.random.default_rng((seed, i, a)).standard_normal((v, v))
            np.add(x, x.T, out=out[a - lo])
        out *= 0.05
        return (i, slice(lo, hi)), out

    threads = hostcopy.threads()
    most = max(1, min(2 * threads, SYNTHETIC_FLIGHT_BYTES // (8 * rows * v * v)))
    with ThreadPoolExecutor(threads, thread_name_prefix="chainexec-synthetic") as pool:
        ahead = collections.deque()
        for block in blocks:
            ahead.append(pool.submit(make, *block))
            if len(ahead) >= most:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


def write_ao2mo_inputs(mol, path, *, layout: str = "s8", scf_conv_tol: float = 1e-10, scf_max_cycle: int = 50) -> dict:
    """Run RHF with PySCF on ``mol`` (:func:`molecule`) and write the AO→MO transform's inputs to
    ``path``: ``A``, the AO two-electron integrals ``(pq|rs)`` in chemists' notation (Hartree) as
    ``mol.intor("int2e", aosym=layout)`` gives them — ``s8`` packed by all eight permutations,
    ``s4`` by the two pairs, ``dense`` (n, n, n, n); none where ``computed`` (the run computes
    them, :mod:`chainexec.chem.integrals`) — and ``C`` (n, m), the RHF MO coefficients
    (``mf.mo_coeff``). ``configs/ao2mo.yaml`` then computes ``(ab|cd) = Σ C_pa C_qb C_rc C_sd
    (pq|rs)``, what ``pyscf.ao2mo.full(mol, C)`` returns. ``scf_conv_tol`` (Hartree) and
    ``scf_max_cycle``: as for :func:`write_ccsd_inputs`. File attributes: ``nao``, ``nmo``,
    ``atoms``, ``basis``, ``charge``, ``e_hf``, ``units``, ``layout``. Written atomically."""
    from pyscf import scf

    mf = _solve("scf", scf.RHF(mol), scf_conv_tol, scf_max_cycle)
    arrays = {"C": mf.mo_coeff}
    if layout != "computed":  # else the run computes them (the source pyscf.int2e)
        arrays["A"] = mol.intor("int2e", aosym="s1" if layout == "dense" else layout)
    nao, nmo = mf.mo_coeff.shape
    write_atomic(path, arrays,
                  {"nao": nao, "nmo": nmo, "atoms": mol.atom, "basis": mol.basis, "charge": mol.charge,
                   "e_hf": float(mf.e_tot),
                   "units": "Hartree", "layout": layout}, AO2MO_INDICES)
    return {"path": os.fspath(path), "nao": int(nao), "nmo": int(nmo), "e_hf": float(mf.e_tot)}


MADE = "chainexec_inputs"
"""The file attribute (true) that marks inputs chainexec wrote (:func:`write_atomic`): ``chainexec
chem`` replaces an ``inputs.h5`` only where it carries it."""


def write_atomic(path, arrays: dict, attrs: dict, indices: dict = INDICES, parts: dict | None = None) -> None:
    """Write ``arrays`` (named as in ``indices``) and file ``attrs`` to ``path`` atomically,
    marked as chainexec's (:data:`MADE`); ``parts``: datasets written piece by piece, by name
    ``(shape, pieces)`` where ``pieces`` yields ``(where, values)`` that together cover the shape
    (float64, contiguous layout)."""
    with atomicfile.replacing(path) as tmp, h5py.File(tmp, "w") as f:
        for name, array in arrays.items():
            dset = f.create_dataset(name, data=np.asarray(array, dtype=np.float64))
            dset.attrs["indices"] = indices[name]
        for name, (shape, pieces) in (parts or {}).items():
            dset = f.create_dataset(name, shape=shape, dtype=np.float64)
            for where, values in pieces:
                dset[where] = values
            dset.attrs["indices"] = indices[name]
        f.attrs.update(attrs)
        f.attrs[MADE] = True
