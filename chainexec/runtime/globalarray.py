"""Distributed arrays in host memory, and a shared task counter, on MPI one-sided communication.

A :class:`GlobalArray` is a dense array split by contiguous blocks of its first axis over all ranks
of a communicator, held in one MPI RMA window (``MPI.Win.Allocate``; ``Allocate_shared`` on one
host, below). Any rank reads, writes or adds
to any hyper-rectangular patch without the owners taking part (passive-target RMA), as Global Arrays
does for NWChem. A :class:`TaskCounter` is NWChem's ``nxtval``: a shared integer on rank 0 that
hands out task numbers by fetch-and-add, for dynamic load balancing. A :class:`Board` holds one
integer per rank and slot, for ranks to tell each other how far they got.

Memory model
------------
Each object holds one ``MPI_Win_lock_all`` epoch from creation to :meth:`free`; every ``get``,
``put`` and ``accumulate`` flushes its targets before returning, so when it returns the patch's
data are in the owners' memory (``put``/``accumulate``) or in the caller's buffer (``get``). A
``get`` reads the caller's own rows with plain loads after ``MPI_Win_sync`` (as ``local()`` does)
instead of an RMA call to itself.

- A ``put`` or ``accumulate`` is visible to every rank's ``get`` and ``local()`` once the writer
  has returned from it and then passed a barrier that the reader also passed (``comm.Barrier()``
  or :func:`chainexec.runtime.comm.barrier`, which this module and the runtime use: a
  non-blocking barrier waited for without keeping a core busy, the same synchronization).
- Writes through ``local()`` are visible to other ranks' ``get`` after a barrier too.
  ``local()`` calls ``MPI_Win_sync`` each time, so call it after the Barrier instead of keeping one
  view across Barriers (MPI-4 §12.7: the unified model, which MPICH gives ``Win.Allocate`` windows
  and the constructor checks, needs that sync between RMA and plain loads and stores; strictly also
  between an owner's stores and the Barrier, which MPICH's Barrier provides by fencing memory).
- Concurrent ``accumulate`` calls into overlapping patches are safe: MPI makes accumulates of one
  op on one predefined datatype atomic per element. Concurrent ``put`` into overlapping patches,
  or ``put``/``local()`` writes concurrent with a ``get`` or ``accumulate`` of the same elements,
  give undefined results; separate such phases by a Barrier.

Progress
--------
Between ranks of one node MPICH does RMA through shared memory: an operation completes while its
target computes without calling MPI. Between nodes (or with ``MPIR_CVAR_NOLOCAL=1``) MPICH may
serve operations with active messages that the target handles only inside MPI calls (with the
UCX netmod, get, put, accumulate and the counter's fetch-and-add all wait for a busy target);
run with ``MPIR_CVAR_ASYNC_PROGRESS=1`` (a progress thread per rank) when ranks compute long
without calling MPI.

Ranks of one host
-----------------
Where every rank of ``comm`` is on one host (:func:`chainexec.runtime.comm.host_comm`, simulated
hosts included) and :data:`SHARED_MEMORY` is on, the window is allocated in shared memory
(``MPI.Win.Allocate_shared``) and a ``get`` copies other ranks' rows with plain loads over threads
(:mod:`chainexec.runtime.hostcopy`), as it does its own rows; puts and accumulates stay RMA calls.
Where the ranks span hosts the window is one ``MPI.Win.Allocate`` over all of them, and a get of
another rank's rows is an RMA call, also between ranks of one host: no window is in shared memory
across hosts. The memory model above is unchanged: a rank's stores become
visible to plain loads of others through the same ``MPI_Win_sync`` and Barrier (MPI-4 §12.7.1).
Other ranks' rows are read with plain loads over threads because that copies them faster than
RMA ``get`` calls through the MPI library do between ranks of one host.

Nothing here counts bytes: the caller (the executor) counts them; a patch moves exactly
``region size × itemsize`` bytes, split over owners as :meth:`GlobalArray.owners` tells.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import numpy as np

from chainexec.errors import ChainexecError
from chainexec.runtime import hostcopy
from chainexec.runtime.comm import barrier, host_comm, mpi
from chainexec.runtime.region import (
    Region,
    box_shape,
    region_bounds,
    row_bounds,
    row_owners,
    whole_rows,
)
from chainexec.spec import format_size

MPI = mpi()
from mpi4py.util.dtlib import from_numpy_dtype  # noqa: E402 (it imports MPI: after mpi())

SHARED_MEMORY = True
"""Whether arrays over ranks of one host live in shared memory (module docstring); the tests turn
it off to exercise RMA gets between ranks."""

_madvise = ctypes.CDLL(None).madvise  # the C library's, for _advise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def shares_memory(comm: MPI.Comm) -> bool:
    """Whether ``comm`` has several ranks, all of one host (:func:`host_comm`), and arrays over
    them live in shared memory (:data:`SHARED_MEMORY`): then every rank reads every rank's rows
    where they lie (collective the first time for a communicator)."""
    return comm.Get_size() > 1 and SHARED_MEMORY and host_comm(comm).Get_size() == comm.Get_size()


class GlobalArray:
    """Block-distributed dense array over all ranks' host memory, on one MPI RMA window.

    Distribution: contiguous blocks of the first axis, as even as possible (rank r owns rows
    ``[r·n // P, (r+1)·n // P)`` of n rows on P ranks, so ranks may own no rows when n < P); other
    axes whole. A 0-d array or an array with no elements is owned wholly by rank 0. Created and
    freed collectively over ``comm``.

    Attributes:
        shape, dtype: of the whole array.
        rows: this rank's ``[lo, hi)`` rows of axis 0 (for a 0-d array: ``(0, 1)`` on rank 0 and
            ``(1, 1)`` elsewhere, as if it had shape ``(1,)``).
        nbytes_local: bytes of this rank's block (the window's size on this rank).
    """

    def __init__(self, comm: MPI.Comm, shape: tuple[int, ...], dtype, zero: bool = True):
        """Allocate the window collectively; fill it with zeros if ``zero``, else leave it undefined."""
        self.comm = comm
        self.dtype = np.dtype(dtype)
        self._mpi_type = from_numpy_dtype(self.dtype)
        shape = tuple(int(n) for n in shape)
        self._layout(shape, row_bounds(shape, comm.size))
        shared = shares_memory(comm)
        barrier(comm)  # the ranks meet first without keeping a core busy: the allocation polls
        try:
            allocate = MPI.Win.Allocate_shared if shared else MPI.Win.Allocate
            self._win = allocate(self.nbytes_local, self.dtype.itemsize, comm=comm)
        except MPI.Exception as err:
            reason = (err.Get_error_string().strip().splitlines() or ["no reason given"])[-1].strip()
            raise ChainexecError(f"global memory: MPI could not allocate {format_size(self.nbytes_local)} on rank "
                                 f"{comm.rank} ({reason}); this host has less memory than machine.global_memory "
                                 "plans for: lower it or run on more ranks") from None
        if self._win.Get_attr(MPI.WIN_MODEL) != MPI.WIN_UNIFIED:
            raise RuntimeError("GlobalArray needs an MPI library with the unified RMA memory model")
        self._owner = True
        # every rank's part of a window in shared memory, for plain loads (None: RMA only)
        self._peers = [self._win.Shared_query(r)[0] for r in range(comm.size)] if shared else None
        self._block = self._view_block()
        _advise(self._block, mmap.MADV_HUGEPAGE)
        if zero:
            hostcopy.fill(self._block, 0)
        # One shared epoch on all targets for the array's life: operations then need only a flush,
        # not a lock round trip each; NOCHECK because no rank ever takes an exclusive lock.
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._win.Sync()
        barrier(comm)

    def _layout(self, shape: tuple[int, ...], bounds: list[int]) -> None:
        self.shape = shape
        # A 0-d array is stored as shape (1,) so that one code path serves every rank count.
        self._shape1 = self.shape or (1,)
        self._bounds = bounds
        self.rows = (self._bounds[self.comm.rank], self._bounds[self.comm.rank + 1])
        self._local_shape = (self.rows[1] - self.rows[0], *self._shape1[1:])
        self.nbytes_local = math.prod(self._local_shape) * self.dtype.itemsize

    def _view_block(self, rank: int | None = None) -> np.ndarray:
        """This rank's block, or ``rank``'s in a window in shared memory."""
        if rank is None:
            memory, shape = self._win.tomemory(), self._local_shape
        else:
            memory, shape = self._peers[rank], (self._bounds[rank + 1] - self._bounds[rank], *self._shape1[1:])
        return np.frombuffer(memory, self.dtype, count=math.prod(shape)).reshape(shape)

    def view(self, shape: tuple[int, ...]) -> "GlobalArray":
        """This array's window as an array of ``shape`` (no extent larger than this array's, same
        number of axes): the slot of a double-buffered loop holding a partial tile. Rows are cut at
        this array's row bounds (clipped to the new row count), so every rank's block fits in its
        part of the window. Not collective, allocates nothing; the contents are undefined;
        :meth:`free` of a view does nothing (free the array it came from)."""
        shape = tuple(int(n) for n in shape)
        if len(shape) != len(self.shape) or any(n > m for n, m in zip(shape, self.shape)):
            raise ValueError(f"view {shape} does not fit in array {self.shape}")
        out = object.__new__(GlobalArray)
        out.comm, out.dtype, out._mpi_type, out._win, out._owner = self.comm, self.dtype, self._mpi_type, self._win, False
        out._peers = self._peers
        if shape and math.prod(shape) == 0:
            bounds = row_bounds(shape, self.comm.size)
        else:
            bounds = [min(b, shape[0] if shape else 1) for b in self._bounds]
        out._layout(shape, bounds)
        out._block = out._view_block()
        return out

    def local(self) -> np.ndarray:
        """Writable view of this rank's block, shape ``(hi - lo, *shape[1:])`` (``()`` for a 0-d
        array on rank 0). Synchronises the window with memory first (see the module's memory model)."""
        self._win.Sync()
        return self._block.reshape(()) if not self.shape and self.comm.rank == 0 else self._block

    @property
    def shared(self) -> bool:
        """Whether the window is in shared memory (every rank's :meth:`block` is at hand)."""
        return self._peers is not None

    @property
    def gives_back(self) -> bool:
        """Whether :meth:`discard` gives pages back (in shared memory only)."""
        return self.shared

    def rows_of(self, rank: int) -> tuple[int, int]:
        """``rank``'s ``[lo, hi)`` rows of axis 0."""
        return self._bounds[rank], self._bounds[rank + 1]

    def discard(self, rows: tuple[int, int]) -> None:
        """Give the pages of this rank's rows ``[lo, hi)`` (within its block) back to the system,
        where the window is in shared memory (``MADV_REMOVE`` on the whole pages inside them):
        their contents are lost for every rank, so only for rows no rank reads again. Nothing
        where the window is not in shared memory or the system declines. Freeing a window's
        touched pages is otherwise paid at :meth:`free`, all at once while every rank waits;
        discarding rows as they are done spreads that cost over the run. Makes no MPI call: a
        helper thread may run it."""
        if self._peers is None:
            return
        lo, hi = max(rows[0], self.rows[0]), min(rows[1], self.rows[1])
        if hi <= lo:
            return
        _advise(self._block[lo - self.rows[0]:hi - self.rows[0]], mmap.MADV_REMOVE)

    def block(self, rank: int) -> np.ndarray | None:
        """``rank``'s block (its rows, shaped as :meth:`local`'s but 0-d arrays as one row) where
        the window is in shared memory, or this rank's own; None for another rank's otherwise.
        Plain stores into it follow :meth:`local`'s rules: visible to other ranks after the
        writer's ``MPI_Win_sync`` (any :meth:`local` call) and a synchronisation with them."""
        if rank == self.comm.rank:
            return self._block
        return None if self._peers is None else self._view_block(rank)

    def _normalise(self, region: Region) -> tuple[tuple[int, int], ...]:
        return region_bounds(region, self.shape)

    def owners(self, region: Region) -> list[tuple[int, tuple[int, int]]]:
        """Ranks holding part of ``region``, each with the ``[lo, hi)`` rows of axis 0 it holds;
        empty for an empty region. Lets a caller count bytes per owner (local versus remote)."""
        return row_owners(self._bounds, self._normalise(region))

    def _transfers(self, box: tuple[tuple[int, int], ...]):
        """Yield ``(owner, origin row slice, starts, sizes)`` per owner of the patch ``box``
        (:meth:`_normalise`'s bounds): the rows of the contiguous patch buffer that owner holds,
        and where they lie in the owner's block (first element and extents per axis)."""
        bounds = box or ((0, 1),)
        patch_lo = bounds[0][0]
        for rank, (lo, hi) in row_owners(self._bounds, box):
            sizes = (hi - lo, *(b - a for a, b in bounds[1:]))
            starts = (lo - self._bounds[rank], *(a for a, _ in bounds[1:]))
            yield rank, slice(lo - patch_lo, hi - patch_lo), starts, sizes

    def _check(self, box: tuple[tuple[int, int], ...], data: np.ndarray) -> None:
        """Raise unless ``data`` has the shape of the patch ``box`` (:meth:`_normalise`'s bounds)
        and the array's dtype."""
        shape = box_shape(box)
        if data.shape != shape or data.dtype != self.dtype:
            raise ValueError(f"data {data.shape} {data.dtype} does not match patch {shape} {self.dtype}")

    def _run(self, box: tuple[tuple[int, int], ...], buf: np.ndarray, issue, own=None) -> None:
        """Issue one RMA call per owner on the rows of ``buf`` it holds, with a subarray type that
        selects them in the owner's block (only the patch ``box``'s bytes travel), then flush
        those owners. ``own(chunk, block_patch)``, where given, handles this rank's rows instead,
        in its own memory, and other ranks' rows in a window in shared memory."""
        rows = buf.reshape(box_shape(box) or (1,))  # a 0-d patch as one row
        issued = []
        for rank, sl, starts, sizes in self._transfers(box):
            chunk = rows[sl]
            if own is not None and (rank == self.comm.rank or self._peers is not None):
                self._win.Sync()
                own(chunk, self.block(rank)[tuple(slice(a, a + n) for a, n in zip(starts, sizes))])
                continue
            block_shape = (self._bounds[rank + 1] - self._bounds[rank], *self._shape1[1:])
            dtype = self._mpi_type.Create_subarray(block_shape, sizes, starts).Commit()
            issue([chunk, chunk.size, self._mpi_type], rank, (0, 1, dtype))
            issued.append((rank, dtype))
        for rank, dtype in issued:
            self._win.Flush(rank)
            dtype.Free()

    def get(self, region: Region, out: np.ndarray | None = None) -> np.ndarray:
        """Copy of the patch ``region`` (a C-contiguous array of the patch's shape), fetched
        one-sidedly from however many owners it spans; written into ``out`` when given."""
        box = self._normalise(region)
        if out is None:
            out = np.empty(box_shape(box), self.dtype)
        self._check(box, out)
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        # This rank's own rows (and others' in shared memory) are copied straight from their
        # block: no RMA call and no packing through a subarray datatype, over threads (one
        # thread's copy runs below the device's fetch rate and would bound the device fetches).
        self._run(box, out, self._win.Get, own=_read)
        return out

    def at_hand(self, region: Region) -> np.ndarray | None:
        """The patch ``region`` as a view of the window's memory, where this rank reads it with
        plain loads (its own block, or any block of a window in shared memory) and it is
        C-contiguous there (rows of one block, whole along every other axis); else None. A
        reader may copy from the view instead of :meth:`get`'s copy into a buffer of its own;
        :meth:`get`'s rules on visibility hold for it (the window is synchronised here)."""
        box = self._normalise(region)
        owners = self.owners(region)
        if not box or len(owners) != 1 or not whole_rows(box, self.shape):
            return None
        rank, (lo, hi) = owners[0]
        block = self.block(rank)
        if block is None:
            return None
        self._win.Sync()
        return block[lo - self._bounds[rank]:hi - self._bounds[rank]]

    def put(self, region: Region, data: np.ndarray) -> None:
        """Overwrite the patch ``region`` with ``data`` (the patch's shape and the array's dtype).
        This rank's own rows (and others' in shared memory) are written straight into their block
        over threads, as :meth:`get` reads them."""
        box = self._normalise(region)
        self._check(box, data)
        self._run(box, np.ascontiguousarray(data), self._win.Put, own=_written)
        self._win.Sync()

    def accumulate(self, region: Region, data: np.ndarray) -> None:
        """Add ``data`` element-wise into the patch ``region``, atomically per element (MPI.SUM),
        so several ranks may accumulate into overlapping patches at once. On a communicator of
        one rank no other writer exists: the patch is added in place over threads
        (:func:`chainexec.runtime.hostcopy.add`): MPI's accumulate applies its operation element
        by element inside the library, several times slower than NumPy's vectorized addition."""
        box = self._normalise(region)
        self._check(box, data)
        self._run(box, np.ascontiguousarray(data),
                  lambda origin, rank, target: self._win.Accumulate(origin, rank, target, MPI.SUM),
                  own=_added if self.comm.size == 1 else None)

    def free(self) -> None:
        """Release the window (collective); the array, its views and arrays from ``local()`` are
        then invalid."""
        if not self._owner:
            return
        self._win.Unlock_all()
        self._win.Free()
        self._block = None


def _advise(part: np.ndarray, advice: int) -> None:
    """``madvise`` the whole pages inside ``part``'s memory; a refusal is ignored (the advice is
    a hint, or the memory is not of the kind it applies to).

    ``MADV_HUGEPAGE`` on a block before its first touch: where the window is private memory (a
    rank alone on its host) and the system's transparent huge pages are ``madvise`` or
    ``always``, the block is faulted, zeroed, page-locked for the device and freed in 2 MiB pages
    instead of 4 KiB ones, a 512th of the page faults, page-table entries and pages to pin. A
    window in shared memory takes huge pages only where ``shmem_enabled`` allows them."""
    page = mmap.PAGESIZE
    start = -(-part.ctypes.data // page) * page
    end = (part.ctypes.data + part.nbytes) // page * page
    if end > start:
        _madvise(start, end - start, advice)


def _read(chunk: np.ndarray, block: np.ndarray) -> None:
    """Read a patch's rows from the block that holds them (:meth:`GlobalArray.get`), split over
    threads in pieces of :data:`hostcopy.FILL_PIECE_BYTES`: the device's fetches read a tile
    through staging buffers of tens of MB each (:data:`chainexec.runtime.backends.cupy.STAGE_BYTES`),
    which pieces of the default size would leave to a few threads."""
    hostcopy.copy(chunk, block, hostcopy.FILL_PIECE_BYTES)


def _written(chunk: np.ndarray, block: np.ndarray) -> None:
    """Write a patch's rows into the block that holds them (:meth:`GlobalArray.put`), split over
    threads as fills are (:data:`hostcopy.FILL_PIECE_BYTES`): a put is mostly the first touch of
    a buffer the plan does not zero (an output tile written once)."""
    hostcopy.copy(block, chunk, hostcopy.FILL_PIECE_BYTES)


def _added(chunk: np.ndarray, block: np.ndarray) -> None:
    """Add a patch's rows into the block that holds them (:meth:`GlobalArray.accumulate`, one rank)."""
    hostcopy.add(block, chunk)


class _Integers:
    """``count`` int64 on rank 0, zero at first, in one window held in a shared passive epoch
    for its life (as :class:`GlobalArray`'s): the shared state of :class:`TaskCounter` and
    :class:`Board`. In shared memory where the ranks share it (:func:`shares_memory`): MPICH
    then does the atomics in that memory itself rather than by messages rank 0 serves, which on
    a host with fewer cores than ranks wait for rank 0 to be scheduled. Created and freed
    collectively over ``comm``."""

    def __init__(self, comm: MPI.Comm, count: int):
        self.comm = comm
        allocate = MPI.Win.Allocate_shared if shares_memory(comm) else MPI.Win.Allocate
        barrier(comm)  # as GlobalArray's: the ranks meet before the allocation, which polls
        self._win = allocate(8 * count if comm.rank == 0 else 0, 8, comm=comm)
        self._values = np.frombuffer(self._win.tomemory(), np.int64)  # rank 0's; empty elsewhere
        self._values[...] = 0
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._win.Sync()
        barrier(comm)

    def free(self) -> None:
        """Release the window (collective)."""
        self._win.Unlock_all()
        self._win.Free()


class TaskCounter(_Integers):
    """Shared counter on rank 0 for dynamic load balancing, as NWChem's ``nxtval``: every rank calls
    :meth:`next` when it wants work and gets the next unclaimed task number. Created, reset and freed
    collectively over ``comm``."""

    def __init__(self, comm: MPI.Comm):
        """Allocate the counter (one int64 on rank 0) collectively, starting at 0."""
        super().__init__(comm, 1)
        self._one = np.ones(1, np.int64)

    def next(self) -> int:
        """Next task number: 0, 1, 2, … across all ranks, each value handed out exactly once.
        One atomic fetch-and-add on rank 0 (see the module's note on progress)."""
        result = np.empty(1, np.int64)
        self._win.Fetch_and_op(self._one, result, 0, 0, MPI.SUM)
        self._win.Flush(0)
        return int(result[0])

    def fence(self, below: int, offset: int) -> int | None:
        """Add ``offset`` to the counter if it is below ``below`` (compare-and-swap, so no task
        number is handed out in between) and return its value before; None where it had reached
        ``below`` (every task already handed out). A checkpoint's way to stop all ranks at one
        point of the task sequence: their next :meth:`next` returns ``offset`` or more."""
        seen, result = np.empty(1, np.int64), np.empty(1, np.int64)
        self._win.Fetch_and_op(self._one, seen, 0, 0, MPI.NO_OP)
        self._win.Flush(0)
        while seen[0] < below:
            self._win.Compare_and_swap(seen + offset, seen, result, 0, 0)
            self._win.Flush(0)
            if result[0] == seen[0]:
                return int(seen[0])
            seen[...] = result
        return None

    def reset(self, value: int = 0) -> None:
        """Set the counter to ``value`` (collective; no rank may be inside ``next`` meanwhile)."""
        barrier(self.comm)
        self._win.Sync()
        if self.comm.rank == 0:
            self._values[...] = value
        self._win.Sync()
        barrier(self.comm)


class Board(_Integers):
    """One int64 per (slot, rank) on rank 0: each rank publishes how far it got in each slot (a
    number that only grows) and reads the others' without their taking part. The executor's
    streamed inputs on several ranks: each rank reads its share of an input from disk and
    publishes how far it got, and a rank that needs rows waits until every rank with a share of
    them has published them (:meth:`chainexec.runtime.streaming.Streams.ready`); a second board
    holds how far each rank has copied them to its device
    (:meth:`chainexec.runtime.streaming.Streams.discard`). Element-wise atomic (``MPI.REPLACE``
    accumulates, ``MPI.NO_OP`` reads), so reads never see a torn value. Created and freed
    collectively over ``comm``."""

    def __init__(self, comm: MPI.Comm, slots: int):
        super().__init__(comm, slots * comm.size)
        self._n = comm.size
        self._type = from_numpy_dtype(np.dtype(np.int64))

    def publish(self, slot: int, value: int) -> None:
        """Set this rank's entry of ``slot`` to ``value``; visible to every later :meth:`read`."""
        self._win.Accumulate([np.array([value], np.int64), self._type], 0,
                             (slot * self._n + self.comm.rank, 1, self._type), MPI.REPLACE)
        self._win.Flush(0)

    def read(self, slot: int) -> np.ndarray:
        """Every rank's entry of ``slot``, by rank."""
        out = np.empty(self._n, np.int64)
        self._win.Get_accumulate([np.empty(self._n, np.int64), self._type], [out, self._type], 0,
                                 (slot * self._n, self._n, self._type), MPI.NO_OP)
        self._win.Flush(0)
        return out
