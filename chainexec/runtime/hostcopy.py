"""Host-memory copies, additions, fills, counts and file writes split over threads.

One thread copies host memory at a few GB/s and touches fresh pages at less, far below the
host's memory bandwidth and the device's fetch rate: zero-filling new global arrays and the
device's fetches from global memory (``GlobalArray.get`` copies a rank's own rows into a
page-locked staging buffer before the DMA) would otherwise bound a (T) run. NumPy releases the
GIL inside such copies, so Python threads run them in parallel. The pool has one thread per core
this process may run on (``os.sched_getaffinity``: under ``mpirun``/``srun`` binding, the rank's
own cores), so bound ranks sharing a host do not oversubscribe it. Unbound ranks (``--bind-to
none``) each see every core; that costs nothing measurable, since the host's memory bandwidth,
not the number of threads, bounds ranks that copy at once.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from chainexec.runtime.comm import local_size

PIECE_BYTES = 16 << 20
"""Smallest piece (bytes) a thread is given a copy of: below it, starting threads costs more than
it saves."""
FILL_PIECE_BYTES = 2 << 20
"""Smallest piece (bytes) a thread is given a fill of. Fills are mostly first touches of fresh
pages, slow per thread beside the cost of handing a piece to the pool, so smaller pieces than a
copy's pay; with 16 MiB pieces the rows of one (T) tile of tens of MB per input would go to one
or two threads."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def threads() -> int:
    """Threads a copy may use: the cores this process may run on."""
    return len(os.sched_getaffinity(0))


def share() -> int:
    """Cores this rank may keep busy computing: those it may run on (:func:`threads`), or its
    share of the host's where the launcher's ranks on the host may each run on all of them
    (unbound, ``mpirun --bind-to none``). Ranks that each start a BLAS thread per core run more
    threads than there are cores, and BLAS threads that wait for each other at the end of every
    small GEMM then wait for a core too."""
    cores = threads()
    return max(1, min(cores, (os.cpu_count() or cores) // local_size()))


def bound_narrowly() -> bool:
    """Whether Open MPI's launcher (which sets ``OMPI_COMM_WORLD_LOCAL_SIZE``) bound this process
    to one core where its share of the host (:func:`os.cpu_count` over the ranks it started
    there) is two or more: its copies, fills and writes then run on one thread. ``mpirun`` binds
    a rank to a core by default where it starts two or fewer. Other launchers and limits (SLURM's
    ``--cpus-per-task``, a container's CPU set) are the user's choice, and their share of the host
    is not known here."""
    return ("OMPI_COMM_WORLD_LOCAL_SIZE" in os.environ and threads() == 1
            and (os.cpu_count() or 1) // local_size() >= 2)


def narrow_note(bound: int, ranks: int) -> str:
    """The line ``chainexec run`` prints where ``bound`` of its ``ranks`` are bound narrowly
    (:func:`bound_narrowly`)."""
    which = "the run's rank is" if ranks == 1 else f"{bound} of the run's {ranks} ranks are"
    return (f"{which} bound to one core of a host with more for it: host copies, fills and writes run on one "
            "thread there (launch with `mpirun --bind-to none`)")


def pieces(shape: tuple[int, ...], count: int) -> list[tuple[slice, ...]]:
    """At most ``count`` disjoint regions covering an array of ``shape`` (each an index tuple of
    slices): the first axis with more than one element split as evenly as possible. An array
    whose only long axis is short gives fewer pieces."""
    axis = next((d for d, n in enumerate(shape) if n > 1), None)
    if axis is None or count <= 1:
        return [tuple(slice(None) for _ in shape)]
    n = shape[axis]
    count = min(count, n)
    head = tuple(slice(None) for _ in range(axis))
    return [head + (slice(k * n // count, (k + 1) * n // count),) for k in range(count)]


def _split(arrays: tuple[np.ndarray, ...], piece: int) -> list[tuple[np.ndarray, ...]]:
    """The arrays (all of one shape) cut into the same pieces of at least ``piece`` bytes (one
    per thread at most): flat ranges where all are C-contiguous (even pieces whatever the
    shape), else by :func:`pieces`."""
    nbytes = arrays[0].nbytes
    count = min(threads(), nbytes // piece)
    if count <= 1:
        return [arrays]
    if all(a.flags.c_contiguous for a in arrays):
        flat = [a.reshape(-1) for a in arrays]
        size = flat[0].size
        return [tuple(f[k * size // count:(k + 1) * size // count] for f in flat) for k in range(count)]
    return [tuple(a[p] for a in arrays) for p in pieces(arrays[0].shape, count)]


def _run(work, parts: list[tuple[np.ndarray, ...]]) -> list:
    """``work`` on every part, over the pool; every part has finished when it returns (its
    results, in the parts' order) or raises."""
    global _pool
    if len(parts) == 1:
        return [work(*parts[0])]
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(threads(), thread_name_prefix="chainexec-hostcopy")
    futures = [_pool.submit(work, *p) for p in parts]
    wait(futures)
    return [done.result() for done in futures]


def copy(dst: np.ndarray, src: np.ndarray, piece: int | None = None) -> None:
    """``numpy.copyto(dst, src)`` (same shape), over threads when large: each given at least
    ``piece`` bytes (:data:`PIECE_BYTES` by default)."""
    if dst.shape != src.shape:
        raise ValueError(f"copy of {src.shape} into {dst.shape}")
    if math.prod(dst.shape) == 0:
        return
    _run(np.copyto, _split((dst, src), piece or PIECE_BYTES))


def add(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst += src`` (same shape), over threads when large (:data:`PIECE_BYTES` a thread at least)."""
    if dst.shape != src.shape:
        raise ValueError(f"addition of {src.shape} into {dst.shape}")
    if math.prod(dst.shape) == 0:
        return
    _run(lambda d, s: np.add(d, s, out=d), _split((dst, src), PIECE_BYTES))


def fill(dst: np.ndarray, value) -> None:
    """``dst[...] = value``, over threads when large (first touch of fresh pages included)."""
    if math.prod(dst.shape) == 0:
        return
    _run(lambda part: part.fill(value), _split((dst,), FILL_PIECE_BYTES))


def nonfinite(a: np.ndarray) -> int:
    """How many elements of ``a`` are not finite (inf, NaN), counted over threads when large: an
    output's check before it is stored reads every byte of it."""
    if a.size == 0:
        return 0
    return sum(_run(lambda part: part.size - int(np.count_nonzero(np.isfinite(part))), _split((a,), PIECE_BYTES)))


def write_files(jobs: list[tuple[int, int, np.ndarray]]) -> None:
    """Write each job's C-contiguous array into its open file from its byte offset on: ``jobs``
    holds (file descriptor, offset, array), one thread each (``os.pwrite``). Why one thread a
    file: buffered writes to one file take its inode's lock, so threads writing one file add
    nothing whatever their number, while threads writing separate files scale with them."""
    def written(fd: int, offset: int, data: np.ndarray) -> None:
        view, at = memoryview(data.reshape(-1).view(np.uint8)), offset
        while view.nbytes:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n

    _run(written, [job for job in jobs if job[2].size])
