"""The NumPy backend: device memory is host memory, and every statement is done when its call
returns. It declares no optional capability (:mod:`chainexec.runtime.device`)."""

from __future__ import annotations

import numpy as np

from chainexec import expr
from chainexec.ordering import weights
from chainexec.planner.plan import Fused
from chainexec.planner.plan import Contraction
from chainexec.runtime.backends import blockwise
from chainexec.runtime.backends.common import all_rows, permuted, ttgt_product
from chainexec.runtime import hostcopy
from chainexec.runtime.device import Backend


class NumpyBackend(Backend):
    """NumPy on the host: contractions by TTGT with ``numpy.matmul``, expressions with NumPy
    broadcasting. The BLAS behind ``matmul`` runs this rank's share of the host's cores in
    threads (:func:`chainexec.runtime.hostcopy.share`, set for the process by threadpoolctl),
    not a thread per core in every rank."""

    name = "numpy"

    def __init__(self):
        from threadpoolctl import threadpool_limits

        super().__init__(np)
        threadpool_limits(limits=hostcopy.share(), user_api="blas")

    def fetch(self, dst, read, view=None) -> None:
        """As :meth:`Backend.fetch`: the source is read straight into ``dst``."""
        read(all_rows(dst), dst)

    def to_host_async(self, array, aside: bool = False) -> tuple[np.ndarray, object]:
        """As :meth:`Backend.to_host_async`: the array itself, arrived at once."""
        return array, None

    def evaluate(self, tree, arrays: dict, order: tuple[str, ...], out) -> None:
        out[...] = expr.evaluate(tree, arrays, order, self.xp)

    def fused(self, f: Fused, arrays: dict, shape: tuple[int, ...], out, within: tuple = ()) -> None:
        """As :meth:`Backend.fused`, block by block over the leading indices, intermediates in
        cache (:mod:`chainexec.runtime.backends.blockwise`)."""
        blockwise.fused(f, arrays, shape, out, within)

    def symmetrize(self, out, axes, keep: tuple = ()) -> None:
        total = sum(out.transpose(p) for p in axes)
        if keep:
            total = self.xp.where(weights(out.shape, keep) > 0, total, out)
        out[...] = total

    def contract(self, c: Contraction, out, a, b, fresh: bool = False) -> None:
        """As :meth:`Backend.contract`, by TTGT (``numpy.matmul``); a ``fresh`` output is cleared
        first."""
        if fresh:
            self.clear(out)
        if b is None:
            out += c.factor * permuted(c, a)
        else:
            out += ttgt_product(self, c, a, b)
