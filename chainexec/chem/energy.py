"""The (T) energy as a PySCF user asks for it: ``chainexec.chem.ccsd_t(mycc)`` where PySCF has
``mycc.ccsd_t()``.

:func:`ccsd_t` writes the inputs the (T) config reads (:func:`chainexec.chem.bridge.ccsd_arrays`)
and the config (``configs/ccsd_t.yaml`` with the amplitudes' extents and no ``machine:``
section, so that the run detects its memory limits, :mod:`chainexec.detect`) to a temporary
folder, runs it in this process (:func:`chainexec.api.run`: CuPy where a GPU is seen, else NumPy),
reads the energy and removes the folder.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from chainexec.errors import ChainexecError


def ccsd_t(mycc, t1=None, t2=None, eris=None, *, backend: str = "auto", machine: str | None = None,
           folder: str | Path | None = None) -> float:
    """The closed-shell CCSD(T) triples correction E(T) in Hartree, computed by chainexec, as
    ``mycc.ccsd_t(t1, t2, eris)`` returns it.

    Args:
        mycc: a converged PySCF closed-shell CCSD (``pyscf.cc.CCSD`` or ``RCCSD`` of an RHF),
            live or restored from its checkpoint file. Frozen orbitals (``mycc.frozen``) are left
            out as PySCF leaves them out: the amplitudes and ``eris`` hold the active ones only.
        t1, t2: the amplitudes, (o, v) and (o, o, v, v); default ``mycc.t1``, ``mycc.t2``.
        eris: PySCF's MO integrals; default ``mycc.ao2mo(mycc.mo_coeff)``, as PySCF makes them.
        backend: ``auto``, ``numpy`` or ``cupy``, as for ``chainexec run``.
        machine: a machine file for the planner's rates (default: this machine's calibration,
            :mod:`chainexec.machinecache`).
        folder: where the temporary folder of inputs goes (default: the system's, ``tempfile``).

    Under an MPI launcher every rank calls it (collective): rank 0 writes the inputs from its
    ``mycc``, all ranks run the (T) job, and every rank returns the energy.

    Raises:
        ChainexecError: ``mycc`` is not a closed-shell CCSD with amplitudes, or the run fails.
    """
    from chainexec import api
    from chainexec.runtime.comm import barrier, world

    comm = world()
    made = Path(api.on_rank0(comm, lambda: _write(mycc, t1, t2, eris, folder)))
    try:
        api.run(made / "ccsd_t.yaml", backend=backend, machine=machine, plan_cache=False)
        barrier(comm)
        energy = api.on_rank0(comm, lambda: _energy(made / "energy.h5"))
    finally:
        if comm.rank == 0:
            shutil.rmtree(made, ignore_errors=True)
    return energy


def _write(mycc, t1, t2, eris, folder) -> str:
    """A new temporary folder (in ``folder``) holding ``inputs.h5`` and ``ccsd_t.yaml``."""
    import numpy as np
    from pyscf.cc.ccsd import CCSD

    from chainexec.chem import bridge, job

    if not isinstance(mycc, CCSD):
        raise ChainexecError(f"ccsd_t takes a closed-shell PySCF CCSD (pyscf.cc.CCSD or RCCSD of an RHF), "
                             f"not {type(mycc).__name__}")
    t1 = mycc.t1 if t1 is None else t1
    t2 = mycc.t2 if t2 is None else t2
    if not (isinstance(t1, np.ndarray) and t1.ndim == 2 and isinstance(t2, np.ndarray) and t2.ndim == 4):
        raise ChainexecError(f"ccsd_t needs the amplitudes t1 (o, v) and t2 (o, o, v, v), not t1 of shape "
                             f"{getattr(t1, 'shape', None)}: run mycc.kernel() first")
    made = Path(tempfile.mkdtemp(prefix="chainexec-ccsd_t-", dir=folder))
    try:
        nocc, nvir = t1.shape
        # Kept in a name until written: outcore integrals (a restored CCSD's) live in a file of
        # PySCF's that closes when the object goes.
        eris = mycc.ao2mo(mycc.mo_coeff) if eris is None else eris
        bridge.write_atomic(made / "inputs.h5", bridge.ccsd_arrays(t1, t2, eris),
                            {"nocc": nocc, "nvir": nvir, "units": "Hartree"})
        job.write_config(job.TEMPLATES["ccsd_t"], made / "ccsd_t.yaml", nocc, nvir, detected=True)
    except BaseException:
        shutil.rmtree(made, ignore_errors=True)
        raise
    return str(made)


def _energy(path: Path) -> float:
    """The energy the (T) job wrote to ``path`` (Hartree)."""
    import h5py

    with h5py.File(path, "r") as f:
        return float(f["E"][()])
