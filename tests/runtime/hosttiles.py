"""The CuPy backend's host-side logic on NumPy arrays, for CPU tests: :class:`HostTiles` keeps
the seam's own tile operations (NumPy's), since the backend's generated kernels need a GPU."""

from __future__ import annotations

from chainexec.runtime.backends.cupy import CupyBackend
from chainexec.runtime.device import Backend


class HostTiles(CupyBackend):
    """The CuPy backend with :class:`Backend`'s ``clear``, ``assign``, ``copy`` and ``gather``."""

    clear, assign, copy, gather = Backend.clear, Backend.assign, Backend.copy, Backend.gather
