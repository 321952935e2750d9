"""Chemistry groundwork for chainexec's CCSD(T) job.

- :mod:`chainexec.chem.bridge` writes the inputs of the closed-shell (T) energy (CCSD amplitudes,
  MO integral blocks, orbital energies) to one HDF5 file, from PySCF or from seeded random data,
  and the AO→MO transform's inputs; :mod:`chainexec.chem.layout` names their datasets.
- :mod:`chainexec.chem.job` is ``chainexec chem``: it checks a job's inputs, then writes them and
  the config that reads them.
- :mod:`chainexec.chem.triples` is an independent NumPy reference for the (T) energy on such a
  file, and documents the binary contractions the ``configs/ccsd_t.yaml`` chain performs.
- :func:`ccsd_t` (:mod:`chainexec.chem.energy`) takes a converged PySCF CCSD object and returns
  E(T) computed by chainexec, in place of ``mycc.ccsd_t()``.

PySCF is an optional dependency (extra ``chem``); it is imported only inside the functions of
:mod:`chainexec.chem.bridge` and :mod:`chainexec.chem.energy`.
"""

from chainexec.chem.energy import ccsd_t

__all__ = ["ccsd_t"]
