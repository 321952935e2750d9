"""Closed-shell CCSD(T) triples energy: an independent NumPy reference.

Written from the equations of PySCF's ``pyscf/cc/ccsd_t_slow.py`` (``kernel`` and ``r3``; PySCF
cites Rendell, Lee, Komornicki, JCP 94, 442 (1991)), real orbitals, chemists' integrals
``(pq|rs)``, all energies in Hartree. Indices: ``i j k m`` occupied (o), ``a b c f`` virtual (v).

Equations
---------
Unsymmetrized intermediates (ccsd_t_slow ``get_w`` / ``get_v``, with ``eris_vvov[a,b,i,f] =
(ia|fb)``, ``eris_vooo[a,i,j,m] = (ia|jm)``, ``eris_vvoo[a,b,i,j] = (ia|jb)``)::

    W0[ijkabc] = sum_f (ia|fb) t2[kjcf] - sum_m (ia|jm) t2[mkbc]
    V0[ijkabc] = (ia|jb) t1[kc] + t2[ijab] f_vo[ck]

Both are summed over the six simultaneous permutations s of the pairs (ia), (jb), (kc) -- the
six ``w...``/``z...`` terms per ``zabc`` in ``kernel``::

    W[ijkabc] = sum_s W0[s(ijk) s(abc)]        V[ijkabc] = sum_s V0[s(ijk) s(abc)]

With ``D[ijkabc] = e_i + e_j + e_k - e_a - e_b - e_c`` and ``r3`` acting on ``abc`` at fixed
``ijk`` (``r3`` of ccsd_t_slow acts on ``ijk`` at fixed ``abc``; on the pair-symmetric ``W + V/2``
the two are identical)::

    r3(Z)[abc] = 4 Z[abc] + Z[bca] + Z[cab] - 2 Z[acb] - 2 Z[bac] - 2 Z[cba]
    E(T) = 1/3 sum_{ijkabc} W[ijkabc] r3(W + V/2)[ijkabc] / D[ijkabc]

This equals ccsd_t_slow's ``2 * sum W r3(W0 + V0/2) / d3`` over ``a >= b >= c`` with its
degeneracy factors in ``d3``: sum over all ``abc``, then move the pair permutations from ``W`` onto
the second factor (``D`` and the class function ``r3`` commute with them), which gives 2/6 = 1/3.
The summand summed over ``abc`` is symmetric in ``ijk``, so :func:`ccsd_t_energy` streams over
occupied triples ``i >= j >= k`` only, weighted 6 (all distinct), 3 (two equal) or 1 (all equal);
per triple it holds a few v**3 blocks (6.2 MiB each for v = 93). Cost: o**3 v**4 multiply-adds
in the ``f`` sums, the same as PySCF's own (T).

Binary contractions (the chain for ``configs/ccsd_t.yaml``)
-----------------------------------------------------------
Over the full index range (no ``i >= j >= k`` restriction, no weights), ``W`` and ``V`` are each
accumulated from the twelve binary contractions below; ``perm`` is the occupied triple
``s(ijk)`` of the pair permutation (the virtual letters follow it: (i,a) (j,b) (k,c) move
together). The ``f`` and ``m`` sums are the contracted indices; ``V`` terms are outer products::

    #    out sign left         right      einsum                  perm
    W1   W  +  ovvv[iafb]   t2[kjcf]   iafb,kjcf->ijkabc   ijk
    W2   W  +  ovvv[iafc]   t2[jkbf]   iafc,jkbf->ijkabc   ikj
    W3   W  +  ovvv[jbfa]   t2[kicf]   jbfa,kicf->ijkabc   jik
    W4   W  +  ovvv[jbfc]   t2[ikaf]   jbfc,ikaf->ijkabc   jki
    W5   W  +  ovvv[kcfa]   t2[jibf]   kcfa,jibf->ijkabc   kij
    W6   W  +  ovvv[kcfb]   t2[ijaf]   kcfb,ijaf->ijkabc   kji
    W7   W  -  ovoo[iajm]   t2[mkbc]   iajm,mkbc->ijkabc   ijk
    W8   W  -  ovoo[iakm]   t2[mjcb]   iakm,mjcb->ijkabc   ikj
    W9   W  -  ovoo[jbim]   t2[mkac]   jbim,mkac->ijkabc   jik
    W10  W  -  ovoo[jbkm]   t2[mica]   jbkm,mica->ijkabc   jki
    W11  W  -  ovoo[kcim]   t2[mjab]   kcim,mjab->ijkabc   kij
    W12  W  -  ovoo[kcjm]   t2[miba]   kcjm,miba->ijkabc   kji
    V1   V  +  ovov[iajb]   t1[kc]     iajb,kc->ijkabc   ijk
    V2   V  +  ovov[iakc]   t1[jb]     iakc,jb->ijkabc   ikj
    V3   V  +  ovov[jbia]   t1[kc]     jbia,kc->ijkabc   jik
    V4   V  +  ovov[jbkc]   t1[ia]     jbkc,ia->ijkabc   jki
    V5   V  +  ovov[kcia]   t1[jb]     kcia,jb->ijkabc   kij
    V6   V  +  ovov[kcjb]   t1[ia]     kcjb,ia->ijkabc   kji
    V7   V  +  t2[ijab]     f_vo[ck]   ijab,ck->ijkabc   ijk
    V8   V  +  t2[ikac]     f_vo[bj]   ikac,bj->ijkabc   ikj
    V9   V  +  t2[jiba]     f_vo[ck]   jiba,ck->ijkabc   jik
    V10  V  +  t2[jkbc]     f_vo[ai]   jkbc,ai->ijkabc   jki
    V11  V  +  t2[kica]     f_vo[bj]   kica,bj->ijkabc   kij
    V12  V  +  t2[kjcb]     f_vo[ai]   kjcb,ai->ijkabc   kji

followed by the element-wise and reduction steps::

    Z[ijkabc] = W[ijkabc] + 0.5 V[ijkabc]
    R[ijkabc] = 4 Z[ijkabc] + Z[ijkbca] + Z[ijkcab] - 2 Z[ijkacb] - 2 Z[ijkbac] - 2 Z[ijkcba]
    Y[ijkabc] = W[ijkabc] / D[ijkabc],   D = e_occ[i] + e_occ[j] + e_occ[k]
                                               - e_vir[a] - e_vir[b] - e_vir[c]
    E(T)      = (1/3) * einsum("ijkabc,ijkabc->", Y, R)

``tests/chem/test_triples.py`` evaluates this table line by line against a brute-force reference.
``configs/ccsd_t.yaml`` adds the ``V`` rows in the pairs that share their one-index factor
(V1+V3, V2+V5, V4+V6, V7+V9, V8+V11, V10+V12) through the pair sums
``P[iajb] = ovov[iajb] + ovov[jbia]`` and ``Q[ijab] = t2[ijab] + t2[jiba]``: six outer products.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from itertools import permutations

import h5py
import numpy as np

#: Arrays the (T) energy reads; index letters as stored by :mod:`chainexec.chem.bridge`.
REQUIRED = ("t1", "t2", "ovvv", "ovoo", "ovov", "e_occ", "e_vir", "f_vo")

#: The six simultaneous permutations s of the pairs (i,a), (j,b), (k,c), as positions 0, 1, 2.
PAIR_PERMUTATIONS = tuple(permutations(range(3)))


def load_inputs(source) -> dict[str, np.ndarray]:
    """Read the (T) inputs from an HDF5 path, an open ``h5py`` file/group, or a mapping of arrays.

    Returns float64 arrays keyed by :data:`REQUIRED`; raises ``ValueError`` naming the first
    missing array or wrong shape (shapes are checked against ``t1``'s (o, v)).
    """
    if isinstance(source, (str, os.PathLike)):
        with h5py.File(source, "r") as f:
            return load_inputs(f)
    if not isinstance(source, (Mapping, h5py.Group)):
        raise TypeError(f"expected an HDF5 path, h5py group or mapping, got {type(source)}")
    missing = [name for name in REQUIRED if name not in source]
    if missing:
        raise ValueError(f"(T) inputs lack {missing}")
    x = {name: np.asarray(source[name], dtype=np.float64) for name in REQUIRED}
    o, v = x["t1"].shape
    shapes = {"t1": (o, v), "t2": (o, o, v, v), "ovvv": (o, v, v, v), "ovoo": (o, v, o, o),
              "ovov": (o, v, o, v), "e_occ": (o,), "e_vir": (v,), "f_vo": (v, o)}
    for name, shape in shapes.items():
        if x[name].shape != shape:
            raise ValueError(f"(T) input {name} has shape {x[name].shape}, expected {shape}")
    return x


def ccsd_t_energy(source) -> float:
    """Closed-shell (T) energy correction in Hartree from CCSD amplitudes and MO integrals.

    ``source`` is anything :func:`load_inputs` accepts. All inputs are loaded into memory; the
    6-index intermediates never are: the loop runs over occupied triples ``i >= j >= k`` and
    holds ``W[ijk,:,:,:]`` and friends (v**3 each) for one triple at a time.
    """
    x = load_inputs(source)
    t1, t2, ovoo, ovov, f_vo = x["t1"], x["t2"], x["ovoo"], x["ovov"], x["f_vo"]
    e_occ, e_vir = x["e_occ"], x["e_vir"]
    nocc = t1.shape[0]
    # Layouts that make each f- or m-sum one matrix product:
    # ovvf[i,a,b,f] = (ia|fb) and t2_rm[k,m,b,c] = t2[m,k,b,c].
    ovvf = np.ascontiguousarray(np.einsum("iafb->iabf", x["ovvv"]))
    t2_rm = np.ascontiguousarray(np.einsum("mkbc->kmbc", t2))
    e_abc = e_vir[:, None, None] + e_vir[None, :, None] + e_vir[None, None, :]

    def w0(p, q, r):
        """W0[p,q,r,:,:,:] = sum_f (pa|fb) t2[r,q,c,f] - sum_m (pa|qm) t2[m,r,b,c]."""
        w = np.einsum("abf,cf->abc", ovvf[p], t2[r, q], optimize=True)
        w -= np.einsum("am,mbc->abc", ovoo[p, :, q, :], t2_rm[r], optimize=True)
        return w

    def v0(p, q, r):
        """V0[p,q,r,:,:,:] = (pa|qb) t1[r,c] + t2[p,q,a,b] f_vo[c,r], both outer products at once."""
        pair = np.stack([ovov[p, :, q, :], t2[p, q]])
        single = np.stack([t1[r], f_vo[:, r]])
        return np.einsum("nab,nc->abc", pair, single, optimize=True)

    energy = 0.0
    for i in range(nocc):
        for j in range(i + 1):
            for k in range(j + 1):
                ijk = (i, j, k)
                w = _pair_symmetrize(w0, ijk)
                z = w + 0.5 * _pair_symmetrize(v0, ijk)
                y = _r3(z)
                y /= e_occ[i] + e_occ[j] + e_occ[k] - e_abc
                energy += _triple_weight(i, j, k) * np.vdot(w, y)
    return float(energy / 3.0)


def _pair_symmetrize(block, ijk) -> np.ndarray:
    """sum_s X0[s(ijk), s(abc)] as an (a, b, c) array, where ``block(p, q, r)`` = X0[p,q,r,:,:,:].

    For s = (1, 2, 0) the block at occupied (j, k, i) has virtual axes (b, c, a), hence the
    einsum "bca->abc" that puts it back in (a, b, c) order.
    """
    total = block(*ijk)  # s = identity
    for s in PAIR_PERMUTATIONS[1:]:
        letters = "".join("abc"[n] for n in s)
        total += np.einsum(f"{letters}->abc", block(*(ijk[n] for n in s)))
    return total


def _r3(z: np.ndarray) -> np.ndarray:
    """4 z[abc] + z[bca] + z[cab] - 2 z[acb] - 2 z[bac] - 2 z[cba] (ccsd_t_slow ``r3``, on abc)."""
    return (4.0 * z + np.einsum("bca->abc", z) + np.einsum("cab->abc", z)
            - 2.0 * (np.einsum("acb->abc", z) + np.einsum("bac->abc", z)
                     + np.einsum("cba->abc", z)))


def _triple_weight(i: int, j: int, k: int) -> int:
    """Number of ordered triples that i >= j >= k stands for: 6, 3 or 1."""
    return len(set(permutations((i, j, k))))
