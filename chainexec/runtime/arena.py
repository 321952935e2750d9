"""A page-locked host arena through which a small run's inputs reach the device.

What: one block of page-locked host memory per GPU and process (:data:`ARENA_BYTES`), allocated
by the warm-up at the command's start (:func:`prepare`, from
:func:`chainexec.runtime.warmup.warm_up`) and used as a ring: rows of a tile at hand in plain host
memory are copied into it over threads (:func:`chainexec.runtime.hostcopy.copy`), then DMA'd to
the device asynchronously on the caller's stream; a part of the ring is written again only once
the copy out of it is done (a CUDA event per part).

Why: a run the plan does not pin (:attr:`chainexec.planner.plan.Plan.pinned`) copies its inputs
from plain host memory, which the driver stages through a page-locked buffer of its own on the
calling thread: at one thread's copy rate, with the host blocked for the whole copy, while the
compute stream idles waiting for the data (most of all before the first GEMM). Through the arena
the host copy runs over threads and the DMA runs asynchronously behind it, so a slice reaches the
device sooner and the host goes on meanwhile. Page-locked memory is not allocated mid-run:
``cudaHostAlloc`` waits for the device (see ``DEFERRED_BYTES``); where the warm-up did not make
the arena before the run (a run from Python), copies take the driver's path.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from chainexec.runtime import hostcopy

ARENA_BYTES = 32 << 20
"""Bytes of the arena. A copy's part is at most half of it, so one part can be filled while the
DMA of the one before runs (at 50 GB/s a 16 MiB part's DMA takes about 0.3 ms, its copy into the
arena over threads about 1 ms). No larger, since allocating page-locked memory
(``cudaHostAlloc``) takes time in proportion to its size, in the warm-up of every process."""
SMALLEST = 1 << 20
"""Bytes below which a copy takes the driver's path: handing it to threads costs more than it saves."""
PIECE = 2 << 20
"""Bytes each thread is given of a copy into the arena (smaller than
:data:`chainexec.runtime.hostcopy.PIECE_BYTES`: a 38.6 MB slice should use many threads)."""

_LOCK = threading.Lock()
_ARENAS: dict[int, "Arena"] = {}


class Arena:
    """The ring of page-locked ``memory`` (a NumPy ``uint8`` array) and the parts of it whose
    copies to the device may still run: ``(first byte, end byte, CUDA event)``."""

    def __init__(self, memory: np.ndarray):
        self.memory = memory
        self.at = 0
        self.busy: deque = deque()
        self.lock = threading.Lock()

    def _reserve(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of the ring after the last part handed out (from its start where they do
        not fit before its end), once every copy out of them is done."""
        if self.at + nbytes > self.memory.nbytes:
            self.at = 0
        start, end = self.at, self.at + nbytes
        for part in list(self.busy):
            if part[0] < end and start < part[1] or part[2].done:
                part[2].synchronize()
                self.busy.remove(part)
        self.at = end
        return self.memory[start:end]

    def upload(self, dst, host: np.ndarray, stream) -> bool:
        """Queue the copy of ``host`` (plain host memory) into the C-contiguous device array
        ``dst`` of its shape on ``stream``, through the ring in parts of whole rows; False (and
        nothing done) where a row is larger than half the ring. Returns once ``host`` has been
        read: the caller may change or free it."""
        if not host.ndim or not host.shape[0]:
            return False
        row = host.nbytes // host.shape[0]
        if row > self.memory.nbytes // 2:
            return False
        step = max(1, self.memory.nbytes // 2 // row)
        with self.lock:
            for lo in range(0, host.shape[0], step):
                part = host[lo:lo + step]
                staged = self._reserve(part.nbytes).view(part.dtype).reshape(part.shape)
                hostcopy.copy(staged, part, piece=PIECE)
                dst[lo:lo + len(part)].set(staged, stream=stream)
                self.busy.append((self.at - part.nbytes, self.at, stream.record()))
        return True


def prepare(cupy) -> Arena | None:
    """Allocate the current GPU's arena (once per process; None where page-locked memory cannot
    be had): only where nothing of the run is queued yet, since the allocation waits for the device."""
    device = cupy.cuda.Device().id
    with _LOCK:
        if device not in _ARENAS:
            # from CuPy's page-locked pool, not through cupyx.empty_pinned: importing cupyx would
            # hold the interpreter's lock for a large part of the warm-up
            try:
                memory = cupy.cuda.alloc_pinned_memory(ARENA_BYTES)
            except Exception:  # no page-locked memory to be had: the driver's path serves
                return None
            _ARENAS[device] = Arena(np.ndarray(ARENA_BYTES, np.uint8, buffer=memory))
        return _ARENAS[device]


def ready(cupy) -> Arena | None:
    """The current GPU's arena where :func:`prepare` made it, else None (never allocates)."""
    return _ARENAS.get(cupy.cuda.Device().id)


def upload(cupy, dst, host: np.ndarray, stream) -> bool:
    """Queue ``host``'s copy into ``dst`` through the current GPU's arena (:meth:`Arena.upload`)
    where there is one and the copy is at least :data:`SMALLEST` bytes; False where it was not
    done (the caller copies it itself)."""
    arena = ready(cupy)
    if arena is None or host.nbytes < SMALLEST:
        return False
    return arena.upload(dst, host, stream)
