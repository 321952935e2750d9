"""Inputs held at the global level as a read-only mapping of their file's bytes.

Why: a streamed (T) input read through HDF5 lands in fresh host memory: the kernel faults in and
zeroes every page, HDF5 copies the rows in, and the device copies them out again, while the
device waits for the first rows. Copied to the device straight from a mapping of the file (the
page cache's pages), the same bytes need no fault-and-zero and no host copy.

A dataset qualifies where its bytes lie in the file as the array they hold: contiguous layout
(no chunks, hence no filters), an offset HDF5 reports, and the tensor's own dtype with the
machine's byte order. The tile must be whole rows (cut along the first axis only): then it is one
contiguous range of the file. Anything else is read through HDF5.

The global level stays what the plan says: host memory holding the tile. The load (disk →
global) is :meth:`MappedArray.populate`, which makes the tile's pages resident
(``MADV_POPULATE_READ``: from the disk if the page cache lacks them), counted as the plan
predicts; the get (global → device) copies from the mapped rows. The mapping is read-only: the
executor maps only tiles a load fills and nothing but gets reads (an input's global tile).

Ranks of one host map the same tile each, and the page cache holds its pages once for all of
them: each rank loads its share of the pages (the executor cuts each streamed row over the
ranks, as it does a global array's in shared memory) and counts that share, and every rank's
gets read every row through its own mapping once the others have published their loads: no rank
spends its disk worker copying rows through HDF5 into a global array in shared memory, a cost that
does not shrink with the number of ranks and so lowers the parallel efficiency.
Ranks on several hosts (:func:`chainexec.runtime.comm.host_comm`, simulated hosts included) read
into a global array instead, each rank its own rows, so that each row comes from the file once in
all: mapped on every host, each host would read the other hosts' rows from the file again, bytes
the plan does not count. Where the backend page-locks host
memory for its copies (a run moving less than ``Machine.pinned_from_bytes`` per rank on a GPU), each
rank's lock thread pins, and so makes resident, the whole tile at its allocation
(:meth:`chainexec.runtime.buffers.Buffers.lock`), beside the loads that count it.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os

import h5py
import numpy as np

from chainexec.runtime import hostcopy
from chainexec.runtime.region import region_bounds, row_bounds, row_owners, whole_rows

MADV_POPULATE_READ = 22
"""Linux 5.14's ``madvise`` advice that faults a range's pages in for reading (reading the file
where they are not cached), synchronously."""

PIECE = 4 << 20
"""Bytes each thread is given of a copy out of a mapping (:meth:`MappedArray.get`), smaller than
:data:`chainexec.runtime.hostcopy.PIECE_BYTES`: a staging buffer holds one row of a tile where
a row is larger than its 64 MiB, and one row of a (T) ``t2`` is tens of MB (23 MB at o=32 v=300),
which 16 MiB pieces give to one or two threads. The copies out of the page cache that fill those
buffers are most of a whole tile's get before a loop (``t2`` and ``ovov`` of (T))."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def contiguous_offset(dataset: h5py.Dataset, dtype: np.dtype, path: str) -> int | None:
    """The offset (bytes) in the file at ``path`` of ``dataset``'s elements where they lie there
    as a C-ordered array of ``dtype`` in this machine's byte order, else None: also where the
    dataset, opened through ``path``, lies in another file (an external link: its offset is in
    the linked file)."""
    if dataset.chunks is not None or dataset.external or dataset.dtype != dtype or not dtype.isnative:
        return None
    if dataset.id.get_storage_size() != dataset.size * dtype.itemsize:
        return None  # not (wholly) written: HDF5 would read its fill value there
    try:
        handle = h5py.h5i.get_file_id(dataset.id).get_vfd_handle()
        if not os.path.samestat(os.fstat(handle), os.stat(path)):
            return None
    except (OSError, ValueError, TypeError):
        return None  # a driver without a descriptor of its own: not a file to map
    return dataset.id.get_offset()


_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def cached_share(path: str, dataset: str, dtype: np.dtype) -> float:
    """The share (0 to 1) of ``dataset``'s bytes in ``path`` that the page cache holds, where its
    loads map them (:func:`contiguous_offset`); 0 for a dataset they read through HDF5, an empty
    one, or a file that cannot be read or mapped. Asked of the kernel page by page (``mincore`` over a
    read-only mapping of the range: nothing is read)."""
    if not os.path.isfile(path):
        return 0.0  # nothing to map (a FIFO would block the open): the run's check of its inputs says what
    try:
        with h5py.File(path, "r") as f:
            ds = f[dataset]
            offset, nbytes = contiguous_offset(ds, np.dtype(dtype), path), ds.size * np.dtype(dtype).itemsize
    except (OSError, KeyError, TypeError):
        return 0.0
    if offset is None or nbytes == 0:
        return 0.0
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    length = offset + nbytes - start
    pages = -(-length // mmap.PAGESIZE)
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), length, prot=mmap.PROT_READ, offset=start) as mapping:
            view = np.frombuffer(mapping, np.uint8)
            vector = np.zeros(pages, np.uint8)
            failed = _libc.mincore(view.ctypes.data, length, vector.ctypes.data)
            del view
    except (OSError, ValueError):
        return 0.0
    return 0.0 if failed else float(np.count_nonzero(vector & 1)) / pages


class MappedArray:
    """An input's whole global tile, read-only, over the mapping of the file range that holds it
    (the tile's rows ``region[0]`` of the dataset, every other axis whole), as ``rank`` of
    ``size`` ranks of one host see it. Offers what the executor asks of a
    :class:`~chainexec.runtime.globalarray.GlobalArray` whose rows a load fills and gets read: the
    rows are split into blocks over the ranks as a global array's are (:func:`row_bounds`); a
    rank's load makes its share of the pages resident, and every rank reads every row through its
    own mapping of the same file, whose pages the host's page cache holds once. So each rank
    counts its own rows, and the tile is counted once, as the plan has it."""

    def __init__(self, path: str, offset: int, shape: tuple[int, ...], dtype: np.dtype, rank: int = 0,
                 size: int = 1):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._bounds = row_bounds(self.shape, size)
        self.rows = self.rows_of(rank)
        self.shared = size > 1  # every rank's rows at hand, as in a global array in shared memory
        self.gives_back = False  # the pages are the file's (:meth:`discard`)
        whole = math.prod(self.shape) * self.dtype.itemsize
        self.nbytes_local = whole // self.shape[0] * (self.rows[1] - self.rows[0]) if self.shape[0] else 0
        base = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        fd = os.open(path, os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, offset - base + whole, prot=mmap.PROT_READ, offset=base)
        finally:
            os.close(fd)
        self._whole = np.frombuffer(self._map, self.dtype, count=math.prod(self.shape),
                                    offset=offset - base).reshape(self.shape)

    def populate(self, rows: np.ndarray) -> None:
        """Make the pages of ``rows`` (a C-contiguous view of the tile) resident: the load, from
        the file where the page cache lacks them. A system without ``MADV_POPULATE_READ`` reads one
        element per page instead."""
        if not rows.flags.c_contiguous:
            raise ValueError("populate: rows must be a C-contiguous view of the mapped tile")
        if not rows.size:
            return
        page = mmap.PAGESIZE
        start = rows.ctypes.data // page * page
        if _libc.madvise(start, rows.ctypes.data + rows.nbytes - start, MADV_POPULATE_READ) != 0:
            rows.reshape(-1)[::max(1, page // self.dtype.itemsize)].sum()

    def whole(self) -> np.ndarray:
        """All rows of the tile (what a rank's gets read: the range to lock for the device)."""
        return self._whole

    def local(self) -> np.ndarray:
        """This rank's rows (its load's share)."""
        return self._whole[self.rows[0]:self.rows[1]]

    def block(self, rank: int) -> np.ndarray:
        """``rank``'s rows: every rank's are at hand."""
        lo, hi = self.rows_of(rank)
        return self._whole[lo:hi]

    def rows_of(self, rank: int) -> tuple[int, int]:
        return self._bounds[rank], self._bounds[rank + 1]

    def owners(self, region) -> list[tuple[int, tuple[int, int]]]:
        return row_owners(self._bounds, region_bounds(region, self.shape))

    def get(self, region, out: np.ndarray | None = None) -> np.ndarray:
        """A copy of the patch ``region`` (into ``out`` when given: over threads in pieces of
        :data:`PIECE` bytes)."""
        patch = self._whole[tuple(slice(a, b) for a, b in region_bounds(region, self.shape))]
        if out is None:
            return patch.copy()
        hostcopy.copy(out, patch, PIECE)
        return out

    def at_hand(self, region) -> np.ndarray | None:
        """As :meth:`GlobalArray.at_hand`: the patch as a view where it is whole rows."""
        box = region_bounds(region, self.shape)
        if not whole_rows(box, self.shape):
            return None
        return self._whole[box[0][0]:box[0][1]]

    def discard(self, rows: tuple[int, int]) -> None:
        """Nothing: the pages are the file's, shared with every reader of it."""

    def free(self) -> None:
        """Let the mapping go: it is unmapped once the last view of it is gone."""
        self._whole = self._map = None
