"""AO→MO accuracy against a long-double reference: chainexec's output and PySCF's own routines.

The MO integrals ``(ij|kl) = Σ C_pi C_qj C_rk C_sl (pq|rs)`` lose accuracy in float64 through
cancellation: the rounding error of each sum grows with the products of coefficient magnitudes,
not with the result, so the rows of orbitals with large coefficients (high virtuals of a large
basis) carry the largest absolute errors whatever code computes them. This script picks the rows
``(ij|`` of the orbitals with the largest coefficient sums (and orbital 0), computes them in long
double (80-bit extended precision on x86: 64-bit significand) from the float64 AO integrals, and
reports the largest absolute error of each side on those rows: PySCF ``ao2mo.incore.general``
(from the same ``s8`` integrals), PySCF ``ao2mo.outcore.general`` (integrals computed on the fly)
and, where given, a chainexec output in PySCF's compact ``s4`` layout.

Usage (repository root, PySCF importable; INPUTS is what ``chainexec chem MOL --job ao2mo
--layout s8`` writes)::

    python3 benchmarks/ao2mo_accuracy.py INPUTS.h5 --molecule benzene --basis cc-pvtz \\
        [--ours OUTPUT.h5] [--rows 2] [--json FILE]

Cost: the long-double pass reads every AO integral once per row pair set, about
``nao⁴ / 2 · rows²`` extended-precision multiply-adds (minutes at nao 264 on two cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np


def reference_rows(eri_s4: np.ndarray, coeff: np.ndarray, cols: list[int], block: int = 800) -> np.ndarray:
    """``(ij|kl)`` for i, j in ``cols`` and every k, l, in long double, from AO integrals in the
    ``s4`` layout (pair-major, lower triangles ``p (p + 1) / 2 + q``): the first half-transform
    streams over blocks of ``block`` AO pairs."""
    nao = coeff.shape[0]
    c = coeff.astype(np.longdouble)
    sel = c[:, cols]
    p, q = np.tril_indices(nao)
    half = np.zeros((len(cols), len(cols), nao, nao), np.longdouble)
    for b0 in range(0, len(p), block):
        b1 = min(len(p), b0 + block)
        rows = eri_s4[b0:b1].astype(np.longdouble)
        full = np.zeros((b1 - b0, nao, nao), np.longdouble)
        full[:, p, q] = rows
        full[:, q, p] = rows
        pp, qq = p[b0:b1], q[b0:b1]
        weight = sel[pp][:, :, None] * sel[qq][:, None, :]
        weight += np.where((pp != qq)[:, None, None], sel[qq][:, :, None] * sel[pp][:, None, :], 0)
        half += np.einsum("xij,xrs->ijrs", weight, full)
    return np.einsum("ijks,sl->ijkl", np.einsum("ijrs,rk->ijks", half, c), c)


def ours_rows(path: Path, cols: list[int], nmo: int) -> np.ndarray:
    """The rows of a chainexec ``s4`` output (dataset ``B``) for i, j in ``cols``, unpacked."""
    out = np.empty((len(cols), len(cols), nmo, nmo))
    k, l = np.tril_indices(nmo)
    with h5py.File(path, "r") as f:
        for x, i in enumerate(cols):
            for y, j in enumerate(cols):
                row = f["B"][max(i, j) * (max(i, j) + 1) // 2 + min(i, j)]
                out[x, y][k, l] = row
                out[x, y][l, k] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", type=Path, help="inputs.h5 of `chainexec chem --job ao2mo --layout s8`")
    ap.add_argument("--molecule", required=True, help="the molecule the inputs were made for")
    ap.add_argument("--basis", required=True)
    ap.add_argument("--ours", type=Path, help="chainexec's output (s4 layout, dataset B)")
    ap.add_argument("--rows", type=int, default=2, help="orbitals with the largest coefficients (default 2)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from pyscf import ao2mo

    from chainexec.chem import bridge
    from chainexec.chem.job import MOLECULES

    with h5py.File(args.inputs, "r") as f:
        coeff = f["C"][()]
        eri_s8 = f["A"][()]
    nao, nmo = coeff.shape
    cols = [int(c) for c in np.argsort(np.abs(coeff).sum(0))[::-1][:args.rows]] + [0]
    sel = coeff[:, cols]
    shape = (len(cols), len(cols), nmo, nmo)
    sides = {}
    t0 = time.perf_counter()
    sides["pyscf incore"] = ao2mo.incore.general(eri_s8, (sel, sel, coeff, coeff), compact=False).reshape(shape)
    mol = bridge.molecule(MOLECULES.get(args.molecule.lower(), args.molecule), args.basis)
    with tempfile.TemporaryDirectory() as tmp:
        ao2mo.outcore.general(mol, (sel, sel, coeff, coeff), f"{tmp}/eri.h5", compact=False)
        with h5py.File(f"{tmp}/eri.h5", "r") as f:
            sides["pyscf outcore"] = f["eri_mo"][()].reshape(shape)
    if args.ours is not None:
        sides["chainexec"] = ours_rows(args.ours, cols, nmo)
    eri_s4 = ao2mo.restore(4, eri_s8, nao)
    del eri_s8
    ref = reference_rows(eri_s4, coeff, cols)
    names = list(sides)
    result = {
        "molecule": args.molecule, "basis": args.basis, "nao": nao, "nmo": nmo, "rows": cols,
        "max_abs_coefficient": float(np.abs(coeff).max()), "max_abs_value": float(np.abs(ref).max()),
        "max_abs_error": {n: float(np.max(np.abs(sides[n].astype(np.longdouble) - ref))) for n in names},
        "max_abs_difference": {f"{a} - {b}": float(np.max(np.abs(sides[a] - sides[b])))
                               for x, a in enumerate(names) for b in names[x + 1:]},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
