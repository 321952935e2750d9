"""AO two-electron integrals ``(pq|rs)`` (chemists' notation, Hartree) of a tile, computed on the
fly by PySCF's libcint, in the packed layouts of :mod:`chainexec.packing`.

libcint computes whole shells, so a tile is computed as the rows of the AO shells that cover
it and then cut. For the layouts whose rows are symmetric pairs (s2ij, s4), the rows of the AOs
``p`` of shells ``[sh0, sh1)`` — pairs ``(p, q)`` with ``q <= p``, the pair rows
``[pair(P0, 0), pair(P1, 0))`` for ``P0, P1 = ao_loc[sh0], ao_loc[sh1]`` — come from two calls of
``mol.intor("int2e", aosym=..., shls_slice=...)``:

- the triangle ``P0 <= q <= p < P1``: ``aosym`` s4 (s2ij) with ``shls_slice = (sh0, sh1, sh0,
  sh1, 0, nbas, 0, nbas)``, packed as ``lib.pack_tril`` of the local indices;
- the rectangle ``q < P0 <= p < P1``: ``aosym`` s2kl (s1) with ``shls_slice = (sh0, sh1, 0, sh0,
  0, nbas, 0, nbas)``;

interleaved row by row. Only shell quartets of the tile's rows are computed (plus the rows of
the partial shells at its two ends); the values are libcint's own, equal to the same rows of
``mol.intor("int2e", aosym="s4")``. Layouts whose rows are ``p`` (s1, s2kl) take one call over
the ``i`` shells; an s8 slice is cut from the s4 rows of the pair rows it touches (those rows in
full: up to about twice the integrals the slice holds).

Cost: a tile costs about the values it computes divided by libcint's rate, which depends on the
basis (angular momenta, contraction depth) and so is to be measured per molecule. Cutting the
s4 tensor into one tile per shell costs little more than one whole-tensor ``mol.intor`` call.
libcint runs on ``lib.num_threads()`` OpenMP threads.

PySCF is imported only where a molecule is built (:class:`Int2e`); the functions take a
``pyscf.gto.Mole``.
"""

from __future__ import annotations

import os

import numpy as np

from chainexec import packing
from chainexec.errors import ChainexecError
from chainexec.sources import register

_RECTANGLE = {"s4": "s2kl", "s2ij": "s1"}
"""Pair-row layout -> the ``aosym`` of its rows' rectangle ``q < P0`` (dense in ``p, q``)."""


def shells_of(mol, a0: int, a1: int) -> tuple[int, int]:
    """The shells ``[sh0, sh1)`` whose AOs cover the AOs ``[a0, a1)`` (``a0 < a1``)."""
    ao_loc = mol.ao_loc_nr()
    return (int(np.searchsorted(ao_loc, a0, side="right")) - 1,
            int(np.searchsorted(ao_loc, a1, side="left")))


def shell_rows(mol, sh0: int, sh1: int, kind: str = "s4") -> np.ndarray:
    """The rows of ``mol.intor("int2e", aosym=kind)`` (``kind`` s1, s2ij, s2kl or s4) that
    belong to the AOs ``p`` of shells ``[sh0, sh1)``: the leading-axis slice ``[P0, P1)`` for
    s1 and s2kl, ``[pair(P0, 0), pair(P1, 0))`` for s2ij and s4, where ``P0, P1 = ao_loc[sh0],
    ao_loc[sh1]``."""
    nbas = mol.nbas
    if kind not in ("s1", "s2kl", "s2ij", "s4"):
        raise ValueError(f"shell rows of layout {kind!r}: s1, s2ij, s2kl or s4")
    if kind in ("s1", "s2kl"):
        return mol.intor("int2e", aosym=kind, shls_slice=(sh0, sh1, 0, nbas, 0, nbas, 0, nbas))
    tri = mol.intor("int2e", aosym=kind, shls_slice=(sh0, sh1, sh0, sh1, 0, nbas, 0, nbas))
    rect = mol.intor("int2e", aosym=_RECTANGLE[kind], shls_slice=(sh0, sh1, 0, sh0, 0, nbas, 0, nbas))
    ao_loc = mol.ao_loc_nr()
    a0, a1 = int(ao_loc[sh0]), int(ao_loc[sh1])
    p, q = packing.pair_unindex(np.arange(packing.npair(a0), packing.npair(a1)))
    ni = a1 - a0
    rows = np.where(q < a0, (p - a0) * a0 + q, ni * a0 + packing.pair_index(p - a0, np.maximum(q - a0, 0)))
    return np.concatenate([rect.reshape((ni * a0,) + tri.shape[1:]), tri])[rows]


def rows(mol, start: int, stop: int, kind: str = "s4", out: np.ndarray | None = None) -> np.ndarray:
    """``mol.intor("int2e", aosym=kind)[start:stop]`` (any kind of :data:`chainexec.packing.KINDS`:
    rows ``p`` of s1 and s2kl, pair rows of s2ij and s4, positions of the s8 vector), computed
    from the shells that cover it (:func:`shell_rows`). The whole tensor is one ``intor`` call,
    into ``out`` where that is a C-contiguous float64 array of its shape (libcint writes there);
    other rows are a new array."""
    layout = packing.Layout(kind, mol.nao_nr())
    start, stop = packing.checked_range((start, stop), layout.shape[0])
    if start == stop:
        return np.zeros((0,) + layout.shape[1:])
    if (start, stop) == (0, layout.shape[0]):  # the whole tensor: one call, each unique integral once
        if out is not None and out.shape == tuple(layout.shape) and out.dtype == np.float64 and out.flags.c_contiguous:
            mol.intor("int2e", aosym=kind, out=out)  # a view of out's memory comes back
            return out
        return mol.intor("int2e", aosym=kind)
    if kind == "s8":
        r, c = packing.pair_unindex(np.arange(start, stop))
        return rows(mol, int(r[0]), int(r[-1]) + 1, "s4")[r - r[0], c]
    first, last = (start, stop - 1) if kind in ("s1", "s2kl") else packing.pair_unindex([start, stop - 1])[0]
    sh0, sh1 = shells_of(mol, int(first), int(last) + 1)
    a0 = int(mol.ao_loc_nr()[sh0])
    offset = a0 if kind in ("s1", "s2kl") else packing.npair(a0)
    return shell_rows(mol, sh0, sh1, kind)[start - offset:stop - offset]


def rate(mol, blocks: int = 4, target: int = 1 << 26) -> float:
    """Bytes per second libcint makes ``mol``'s integrals at on this host (its threads): ``blocks``
    raw ``intor`` calls, each over a block of consecutive ``i`` shells and one of ``k`` shells
    (all ``j`` and ``l``; about ``target`` bytes of s1 values, at most a 32nd of the s8 tensor's
    bytes each), the blocks spread over the molecule, timed together; the faster of two passes
    (the first call after a long computation in the same process, such as ``chem``'s SCF, runs
    slower than the next ones), written into one buffer whose pages are touched before. Each
    value costs libcint the same whatever the layout stores, so
    this is the rate of a whole-tensor call in bytes of its layout. Raw calls, not
    :func:`shell_rows`: its reordering of the rows is single-threaded NumPy work that takes
    longer than libcint's on many cores. Wide blocks: every call has ``i × j`` shell pairs for
    all threads. What a config states as a computed source's ``bytes_per_second``, which the
    planner prices its loads at."""
    import math
    import time

    nbas, nao, ao = mol.nbas, mol.nao_nr(), mol.ao_loc_nr()
    target = min(target, packing.Layout("s8", nao).shape[0] * 8 // 32)
    size = max(1, min(nbas, round(math.sqrt(target / (8 * nao * nao)) * nbas / nao)))
    slices = []
    for k in range(blocks):
        i0 = min(nbas - size, (2 * k + 1) * nbas // (2 * blocks))
        k0 = min(nbas - size, (2 * ((k + blocks // 2) % blocks) + 1) * nbas // (2 * blocks))
        slices.append((i0, i0 + size, 0, nbas, k0, k0 + size, 0, nbas))
    # One buffer for every call, its pages touched first: a run's libcint writes into global
    # memory already filled, where a fresh array's pages (np.zeros' too) would be first touched by
    # libcint.
    buffer = np.full(max((ao[s[1]] - ao[s[0]]) * (ao[s[5]] - ao[s[4]]) for s in slices) * nao * nao, 0.0)
    rates = []
    for _ in range(2):
        made, spent = 0, 0.0
        for shls in slices:
            start = time.perf_counter()
            made += mol.intor("int2e", aosym="s1", shls_slice=shls, out=buffer).nbytes
            spent += time.perf_counter() - start
        rates.append(made / spent)
    return max(rates)


def basis_read(basis: str) -> str | None:
    """Why PySCF would read ``basis`` from a file, or None: a file of the basis's name in the
    working folder, which PySCF reads in place of its own basis of that name."""
    if isinstance(basis, str) and os.path.isfile(basis):
        return (f"the basis {basis!r} is a file here, which PySCF would read in place of its own basis of that name: "
                "give a basis name PySCF knows, and run where no file has that name")
    return None


def files_read(atoms: str, basis: str) -> str | None:
    """Why PySCF would build the molecule of ``atoms`` in ``basis`` from a file where it starts,
    or None: a file read as the basis (:func:`basis_read`), or a geometry file given as the
    atoms. A run started elsewhere, or after the file changed, would compute the integrals of
    another molecule than its inputs' orbitals are, without a word."""
    if (reason := basis_read(basis)) is not None:
        return reason
    if isinstance(atoms, str) and os.path.isfile(atoms):
        return (f"the atoms {atoms!r} name a geometry file, which PySCF reads from where the run starts: give "
                "them as an atom string (chainexec chem writes a file's atoms so)")
    return None


@register("pyscf.int2e")
class Int2e:
    """Source of the AO two-electron integrals of a molecule, in a packed layout.

    Parameters: ``atoms``, a PySCF atom string in Angstrom (``"O 0 0 0.1173; H 0 0.7572
    -0.4692; …"``); ``basis``, a PySCF basis name; ``layout``, one of
    :data:`chainexec.packing.KINDS` (default s4). The stored array is
    ``mol.intor("int2e", aosym=layout)`` (float64, Hartree); ``values((start, stop))`` is its
    slice ``[start:stop]`` (:func:`rows`). Bad parameters raise :class:`ChainexecError`."""

    def __init__(self, atoms: str, basis: str, layout: str = "s4"):
        try:
            from pyscf import gto
        except ImportError:
            raise ChainexecError(f"source {self.name!r} needs PySCF: pip install 'chainexec[chem]'") from None
        if layout not in packing.KINDS:
            raise ChainexecError(f"source {self.name!r}: unknown layout {layout!r} ({', '.join(packing.KINDS)})")
        read = files_read(atoms, basis)
        if read is not None:
            raise ChainexecError(f"source {self.name!r}: {read}")
        try:
            self.mol = gto.M(atom=atoms, basis=basis, unit="Angstrom", spin=None, verbose=0)
        except (RuntimeError, ValueError, KeyError, TypeError) as err:
            reason = " ".join(str(err).split())
            raise ChainexecError(f"source {self.name!r}: PySCF cannot build {atoms!r} in {basis!r}: {reason}") from None
        self.layout = packing.Layout(layout, self.mol.nao_nr())
        self.shape = self.layout.shape
        self.dtype = np.dtype(np.float64)

    def values(self, region: tuple[int, int], out: np.ndarray | None = None) -> np.ndarray:
        return rows(self.mol, region[0], region[1], self.layout.kind, out)
