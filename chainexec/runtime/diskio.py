"""Background disk I/O for one rank: one worker thread runs the disk level's reads and writes in
the order they were submitted, so that a double-buffered loop (:mod:`chainexec.planner.pipeline`)
reads the next tile and writes the last one while the main thread drives the device.

One worker, not several: HDF5 serialises its calls anyway (h5py holds one lock for the library),
and submission order is what makes the two slots of a double-buffered loop safe to reuse — a slot
is refilled only after every job submitted before it, among them the write of its previous
contents, has finished. h5py releases the GIL while HDF5 reads and writes, so the main thread runs
meanwhile. The worker makes no MPI calls: the executor hands it plain NumPy views of the windows.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor


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

    def submit(self, name: str, job, *args) -> int:
        """Queue ``job(*args)`` for the statement ``name`` (``load T``, ``store T``); its number."""
        self._pending.append((name, self._pool.submit(_timed, job, *args)))
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
