"""The device level (γ) behind one seam: an array module (NumPy on the CPU, CuPy on a GPU).

Everything the executor does with device buffers goes through :class:`Backend`: allocate, copy in
from host, copy out to host, contract. The backend is chosen once (:func:`select`); no other module
asks whether it runs on a GPU.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from chainexec.errors import ChainexecError
from chainexec.planner.plan import Contraction
from chainexec.runtime.comm import local_rank


@lru_cache(maxsize=None)
def _ttgt(out: tuple, a: tuple, b: tuple):
    """Transpose-transpose-GEMM-transpose layout of ``out = a·b``: index groups batch (in all
    three), a-external, b-external and contracted (in a and b only), and the permutations that bring
    a to (batch, a-ext, k), b to (batch, k, b-ext) and the GEMM result to ``out``'s order."""
    batch = [i for i in out if i in a and i in b]
    aext = [i for i in out if i in a and i not in b]
    bext = [i for i in out if i in b and i not in a]
    ks = [i for i in a if i in b and i not in out]
    result = batch + aext + bext
    return (batch, aext, bext, ks, [a.index(i) for i in batch + aext + ks],
            [b.index(i) for i in batch + ks + bext], [result.index(i) for i in out])


class Backend:
    """Device buffers and contractions on one array module ``xp`` (numpy or cupy)."""

    def __init__(self, xp, name: str):
        self.xp = xp
        self.name = name

    def zeros(self, shape, dtype):
        return self.xp.zeros(shape, dtype=dtype)

    def from_host(self, host: np.ndarray):
        return self.xp.asarray(host)

    def to_host(self, array) -> np.ndarray:
        return array if self.xp is np else self.xp.asnumpy(array)

    def contract(self, c: Contraction, out, a, b) -> None:
        """``out += c.factor · a·b`` over the contraction's indices (``b`` None: permuted copy)."""
        if b is None:
            out += c.factor * a.transpose([c.a_indices.index(i) for i in c.out_indices])
            return
        batch, aext, bext, ks, pa, pb, pout = _ttgt(tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices))
        size = {i: n for i, n in zip(c.a_indices, a.shape)} | {i: n for i, n in zip(c.b_indices, b.shape)}
        nb, na, nbx, nk = (math.prod(size[i] for i in g) for g in (batch, aext, bext, ks))
        left = a.transpose(pa).reshape(nb, na, nk)
        right = b.transpose(pb).reshape(nb, nk, nbx)
        product = self.xp.matmul(left, right).reshape([size[i] for i in batch + aext + bext])
        if c.factor != 1.0:
            product *= c.factor
        out += product.transpose(pout)


def select(name: str = "auto", comm=None) -> Backend:
    """``numpy``, ``cupy``, or ``auto`` (CuPy when it imports and sees a GPU, else NumPy).

    With CuPy, the rank takes GPU ``local rank mod GPUs on the node``: one rank per GPU."""
    if name not in ("auto", "numpy", "cupy"):
        raise ChainexecError(f"unknown backend {name!r} (auto, numpy or cupy)")
    if name in ("auto", "cupy"):
        try:
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
            if count > 0:
                cupy.cuda.Device(local_rank(comm) % count if comm is not None else 0).use()
                return Backend(cupy, "cupy")
        except Exception as err:  # no cupy, no driver, no device: all mean "no GPU here"
            if name == "cupy":
                raise ChainexecError(f"backend cupy is not usable here: {err}") from None
        if name == "cupy":
            raise ChainexecError("backend cupy is not usable here: no GPU")
    return Backend(np, "numpy")
