"""Host memory page-locked where it lies: an input's mapped tile DMA'd to the device directly.

What: ``cudaHostRegister`` (read-only, portable) of host memory that a run only reads, namely an
input's tile mapped from its file (:mod:`chainexec.runtime.mapped`), so that each copy of its rows
to the device is one asynchronous DMA with no staging copy on the host. The executor begins
locking a mapped tile on a thread of its own when it maps it
(:meth:`chainexec.runtime.buffers.Buffers.lock`), and nothing waits for that: a copy made
before the lock is done takes the backend's other path (the arena, or the driver's staging where
no warm-up made one). It unlocks the tile when the plan frees it, or when the run fails. The
unlock runs on another thread once the copies queued before it are done, and the mapping is let
go only after that; the run's caller waits for the unlocks after the executor
(:meth:`Locks.settle`, from :func:`chainexec.api.run`).

Why: the other path for such rows is the page-locked arena (:mod:`chainexec.runtime.arena`).
There the host copies them into page-locked memory over threads, which is the host's work on the
main thread, and the device waits for those copies and for the host work they delay in a run's
first tiles. A registered mapping needs no host copy: each copy of its rows is one DMA at the
link's rate, several times faster than through a ring like the arena's. Registering does not wait
for the device (unlike ``cudaHostAlloc``), so it may happen while work is queued there.
Unregistering takes time in proportion to the size (milliseconds per hundred MB), hence the
separate thread.

Only a run of plain host memory locks inputs' tiles (:attr:`chainexec.runtime.backends.cupy.CupyBackend.pinned`
false: under :attr:`~chainexec.planner.machine.Machine.pinned_from_bytes` moved). A larger run does not
hold tens of GB of page cache locked: it locks its global arrays instead, writable (each rank's
block, zero-filled at allocation so that the registration finds its pages touched: faulting them
in, the driver holds the process's address space for seconds against every other thread's
allocations), so that their rows go to the device and results come back into them by DMA, and
unlocks each before its window is freed, waiting (:meth:`Locks.unlock` with ``wait``). Where
registration fails (no support for read-only registration, no memory), the copies take the other
paths.
"""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

READ_ONLY = 8
"""``cudaHostRegisterReadOnly``: the pages are only read by the device. A read-only mapping
cannot be registered otherwise (``cudaErrorInvalidValue`` without it)."""
PORTABLE = 1
"""``cudaHostRegisterPortable``: page-locked for every CUDA context, whichever device the
registering thread had current."""
SMALLEST = 1 << 20
"""Bytes below which a tile is not locked: its copies are small, and a registration costs a call."""


class Locks:
    """The host ranges a backend has page-locked: start address → (bytes, the array, kept alive
    until unlocked so that its mapping outlives the registration, whether locked writable). Made on the thread that drives
    the backend's GPU, whose device the other threads' calls then use."""

    def __init__(self, cupy):
        self.xp = cupy
        self.device = cupy.cuda.Device().id
        self._spans: dict[int, tuple[int, np.ndarray, bool]] = {}
        self._guard = threading.Lock()
        self._unlocking: list[Future] = []
        self._pool: ThreadPoolExecutor | None = None

    def lock(self, array: np.ndarray, writable: bool = False) -> int | None:
        """Page-lock the C-contiguous host ``array`` in place (from any thread), read-only unless
        ``writable``; its address as the handle for :meth:`unlock`, or None where it was not
        locked (too small, not contiguous, or refused by the driver). A read-only ``array`` must
        not change until unlocked."""
        if array.nbytes < SMALLEST or not array.flags.c_contiguous:
            return None
        ptr = array.ctypes.data
        runtime = self.xp.cuda.runtime
        try:
            with self.xp.cuda.Device(self.device):
                runtime.hostRegister(ptr, array.nbytes, PORTABLE if writable else READ_ONLY | PORTABLE)
        except runtime.CUDARuntimeError:
            return None
        with self._guard:
            self._spans[ptr] = (array.nbytes, array, writable)
        return ptr

    def holds(self, host: np.ndarray, writable: bool = False) -> bool:
        """Whether all of ``host`` lies in memory locked here (``writable``: locked writable)."""
        lo = host.ctypes.data
        hi = lo + host.nbytes
        with self._guard:
            return any(p <= lo and hi <= p + n and (w or not writable) for p, (n, _, w) in self._spans.items())

    def unlock(self, handle: int, after: list, wait: bool = False) -> None:
        """Unregister the range :meth:`lock` returned ``handle`` for once the CUDA events
        ``after`` (marking the last copies that may use it) are reached: on a thread of its own,
        the array let go after that, or with ``wait`` here (the caller frees the memory next)."""
        if wait:
            self._unregister(handle, after, wait=True)
            return
        with self._guard:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="chainexec-unlock")
        self._unlocking.append(self._pool.submit(self._unregister, handle, after))

    def _unregister(self, handle: int, after: list, wait: bool = False) -> None:
        """Where the driver refuses, a warning says so (the run's results stand) and the range
        stays in the registry, its mapping kept rather than unmapped while locked; but for an
        unlock the caller waits for (``wait``), which frees the memory next: its range is
        forgotten, so that nothing finds memory locked there afterwards."""
        for event in after:
            event.synchronize()
        runtime = self.xp.cuda.runtime
        try:
            with self.xp.cuda.Device(self.device):
                runtime.hostUnregister(handle)
        except runtime.CUDARuntimeError as err:
            warnings.warn(f"chainexec: host memory at {handle:#x} stays page-locked ({err})", RuntimeWarning)
            if not wait:
                return
        with self._guard:
            del self._spans[handle]

    def settle(self) -> None:
        """Wait for the unlocks queued so far."""
        while self._unlocking:
            self._unlocking.pop(0).result()
