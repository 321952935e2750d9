"""Background disk I/O for one rank: one worker thread runs the disk level's reads and writes in
the order they were submitted, so that a double-buffered loop (:mod:`chainexec.planner.pipeline`)
reads the next tile and writes the last one while the main thread drives the device.

One worker, not several: HDF5 serialises its calls anyway (h5py holds one lock for the library),
and submission order is what makes the two slots of a double-buffered loop safe to reuse — a slot
is refilled only after every job submitted before it, among them the write of its previous
contents, has finished. h5py releases the GIL while HDF5 reads and writes, so the main thread runs
meanwhile. The worker makes no MPI calls: the executor hands it plain NumPy views of the windows.

A job of fewer than :data:`INLINE_BYTES` submitted while nothing is pending runs at once on the
calling thread: each h5py call of a job takes and gives back the GIL several times, and a worker
waits for it while the main thread runs Python (the executor's bookkeeping, statements of tiny
tiles), which makes a small job many times slower than its own work; overlapping it would save
less than that.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

#: Bytes below which a job submitted with nothing pending runs on the calling thread: a load or
#: store of a small-tile run (a few KiB to hundreds of KiB), whose fixed cost on the worker (its
#: h5py calls waiting for the GIL) is several times its own work; from about a MiB on, the
#: bytes' time is as long as that wait, and overlapping the job pays (measurements:
#: benchmarks/results/INDEX.md).
INLINE_BYTES = 1 << 20


def _timed(job, *args) -> float:
    t0 = time.perf_counter()
    job(*args)
    return time.perf_counter() - t0


class DiskWorker:
    """Jobs numbered 1, 2, … in submission order, each named for the statement it serves;
    :meth:`wait` returns their busy seconds by name."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chainexec-disk")
        self._pending: deque[tuple[str, Future]] = deque()
        self.submitted = 0
        self._done = 0

    def submit(self, name: str, job, *args, nbytes: int | None = None) -> int:
        """Queue ``job(*args)`` for the statement ``name`` (``load T``, ``store T``); its number.
        A job of ``nbytes`` under :data:`INLINE_BYTES` runs here and now where every job before it
        has finished (its seconds at :meth:`wait`); its error, or that of a job before it, is
        raised here: nothing runs after a failed job."""
        if nbytes is not None and nbytes < INLINE_BYTES and self.finished(self.submitted):
            future = Future()
            future.set_result(_timed(job, *args))
        else:
            future = self._pool.submit(_timed, job, *args)
        self._pending.append((name, future))
        self.submitted += 1
        return self.submitted

    def wait(self, upto: int | None = None) -> dict[str, float]:
        """Block until jobs 1..``upto`` (all submitted, by default) have finished; the seconds the
        worker spent on the ones finished here, by name. A job's exception is raised here."""
        upto = self.submitted if upto is None else upto
        seconds: dict[str, float] = {}
        while self._done < upto:
            name, future = self._pending.popleft()
            self._done += 1
            seconds[name] = seconds.get(name, 0.0) + future.result()
        return seconds

    def finished(self, upto: int) -> bool:
        """Whether jobs 1..``upto`` have all finished, without waiting for them (their seconds
        still count at :meth:`wait`). A finished job's exception is raised here."""
        for _, future in itertools.islice(self._pending, max(0, upto - self._done)):
            if not future.done():
                return False
            future.result()
        return True

    def close(self) -> None:
        """Stop the worker without running what is still queued (after an error elsewhere)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
