"""What a run counts on one rank, and the record it reports summed over ranks.

The executor notifies the :class:`Counters` of each thing it does: each transfer adds its
payload bytes to its category on the rank that performs it (:meth:`Counters.move`), each
allocation and free its bytes to the level's live bytes and their peak (:meth:`Counters.hold`;
global: all ranks' windows together, summed at each collective allocation; device: per rank, the
largest rank's in the report), each timed statement its seconds to its level
(:meth:`Counters.spend`). Statements the backend may still be running when it returns are timed
between backend stamps (CUDA events on a GPU) and read later (:meth:`Counters.queue`,
:meth:`Counters.read`). The report sums bytes, flops and statements over the ranks and takes the
busiest rank's seconds (:meth:`Counters.measured`), with the same keys as the plan's
prediction."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from chainexec.client import process_start
from chainexec.planner.plan import CATEGORIES, LEVEL_TIMES, MOVE_LEVEL
from chainexec.runtime.device import Backend
from chainexec.runtime.progress import Progress

OP_LEVEL = {op: MOVE_LEVEL[op] for op in ("get", "accumulate")} | dict.fromkeys(("compute", "eval", "fused"), "compute")
"""The level whose busy time a statement counts toward (the keys of ``Machine.seconds``); the disk
level's time is the disk worker's own time in its jobs."""


@dataclass
class Stamped:
    """A statement the backend may still be running: its name (as :attr:`Counters.by_statement`
    keys it), the backend stamps taken before and after it was queued, and the level its
    seconds count toward (a contraction's compute; a copy queued on the device, global↔device)."""

    name: str
    start: object
    end: object
    level: str = "compute"


class Counters:
    """Bytes per category, flops, compute statements run, seconds per level, live/peak bytes per
    level and parallel tiles done, on one rank."""

    def __init__(self, comm, backend: Backend):
        self.comm = comm
        self.backend = backend
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.seconds = dict.fromkeys(LEVEL_TIMES, 0.0)
        self.flops = 0
        self.statements = 0
        # bytes compute statements read and write in device memory (as cost.predict_nests counts them)
        self.streamed = 0
        # seconds per timed statement: "#k" (compute; "#k-#m" a point-wise run), "eval T", "get T", "accumulate T"
        self.by_statement: dict[str, float] = {}
        self.live = {"global": 0, "device": 0}
        self.peak = {"global": 0, "device": 0}
        self.idle = 0.0  # seconds waiting at barriers and for other ranks' streamed rows
        self.high_water = 0  # bytes; stays 0 where the backend has no allocator to watch
        self.tiles = 0  # parallel tiles done
        self.started: float | None = None  # the process's age at the executor's start (process_seconds)
        self.resumed = 0  # parallel tiles of the work a resumed run skips
        self.pending: list[Stamped] = []  # queued statements, oldest first

    def move(self, category: str, nbytes: int) -> None:
        self.bytes[category] += nbytes

    def hold(self, level: str, nbytes: int) -> None:
        self.live[level] += nbytes
        self.peak[level] = max(self.peak[level], self.live[level])

    def spend(self, level: str, name: str, seconds: float) -> None:
        """Add ``seconds`` to ``level`` and to the statement ``name``."""
        self.seconds[level] += seconds
        self.by_statement[name] = self.by_statement.get(name, 0.0) + seconds

    def spend_disk(self, seconds: dict[str, float]) -> None:
        """Add the disk worker's busy seconds by statement (:meth:`DiskWorker.wait`) to the disk
        level and to each statement."""
        for name, s in seconds.items():
            self.spend("disk", name, s)

    def queue(self, name: str, start, end, level: str = "compute") -> None:
        """Note a statement queued between the backend stamps ``start`` and ``end``, whose
        seconds count toward ``level``."""
        self.pending.append(Stamped(name, start, end, level))

    def read(self, count: int) -> None:
        """Add the seconds of the oldest ``count`` queued statements to their levels (waiting for
        them)."""
        done, self.pending = self.pending[:count], self.pending[count:]
        for s in done:
            self.spend(s.level, s.name, self.backend.elapsed(s.start, s.end))

    def watch(self) -> None:
        """Record the device allocator's high-water mark (scratch included), where there is one."""
        held = self.backend.pool_bytes()
        if held is not None:
            self.high_water = max(self.high_water, held)

    def counts(self) -> np.ndarray:
        """This rank's bytes per category, flops, statements, streamed bytes and parallel tiles so
        far (rank 0's with the tiles of the work a resumed run skips: :attr:`resumed`)."""
        tiles = self.tiles + (self.resumed if self.comm.rank == 0 else 0)
        return np.array([self.bytes[k] for k in CATEGORIES] + [self.flops, self.statements, self.streamed, tiles],
                        np.int64)

    def add(self, counts: np.ndarray) -> None:
        """Add bytes, flops, statements and streamed bytes of ``counts`` (as :meth:`counts`) to this rank's."""
        for k, v in zip(CATEGORIES, counts):
            self.bytes[k] += int(v)
        flops, statements, streamed = (int(v) for v in counts[len(CATEGORIES):len(CATEGORIES) + 3])
        self.flops += flops
        self.statements += statements
        self.streamed += streamed

    def peaks(self) -> dict[str, int]:
        """The memory peaks of the run (collective): global as summed at each allocation, device
        the largest rank's."""
        return {"global": int(self.peak["global"]),
                "device": int(self.comm.allreduce(self.peak["device"], op=_max()))}

    def report(self, nest: int, progress: Progress | None) -> None:
        """All ranks' tiles and bytes so far, summed, to ``progress`` on rank 0 (collective;
        after nest ``nest``, 1-based, where all ranks meet)."""
        resumed = self.resumed if self.comm.rank == 0 else 0  # tiles an earlier run did count as done
        local = [self.tiles + resumed] + [self.bytes[k] for k in CATEGORIES]
        total = self.comm.reduce(np.array(local, dtype=np.int64), root=0)
        if progress is not None:
            progress.update(nest, int(total[0]), {k: int(v) for k, v in zip(CATEGORIES, total[1:])})

    def statement_seconds(self) -> dict[str, float]:
        """Seconds spent in each statement the executor times per level: compute (``#k``; a run of
        point-wise terms as ``#k-#m``), a computed tensor's evaluation (``eval T``), transfers
        between global and device memory (``get T``, ``accumulate T``) and the disk worker's
        reads and writes (``load T``, ``store T``: a computed input's values made where it is
        loaded included), summed over ranks, most first (collective). Compute statements are
        timed between backend stamps (CUDA events on a GPU), transfers after waiting for them
        and disk jobs on the worker's thread, so these are the device's and the worker's times,
        which overlap where a loop is double-buffered."""
        total: dict[str, float] = {}
        for mine in self.comm.allgather(self.by_statement):
            for key, seconds in mine.items():
                total[key] = total.get(key, 0.0) + seconds
        return dict(sorted(total.items(), key=lambda kv: -kv[1]))

    def rank_times(self, total: float) -> list[dict]:
        """Per rank (gathered on every rank): the seconds from the process's start to the
        executor's (``start_seconds``: the interpreter's start, imports, MPI's and the device's
        start, planning or waiting for rank 0's plan; None where the system does not say when
        the process started), seconds waiting at the parallel loops' barriers (idle), the rest
        of ``total`` seconds (busy), this rank's seconds in each level's statements
        (``level_seconds``; the report's ``seconds`` are the busiest rank's), and parallel
        tiles done."""
        mine = {"rank": self.comm.rank, "start_seconds": self.started, "busy_seconds": total - self.idle,
                "idle_seconds": self.idle, "level_seconds": dict(self.seconds), "tiles": self.tiles}
        return self.comm.allgather(mine)

    def measured(self, seconds: float) -> dict:
        """Same keys as the plan's ``predicted``: seconds per level are the busiest rank's time
        inside that level's statements; ``total_seconds`` is the wall time of the slowest rank
        (``seconds`` on this one); ``by_statement`` each statement's seconds summed over the
        ranks (:meth:`statement_seconds`). Collective."""
        total = self.comm.allreduce(np.array([self.bytes[k] for k in CATEGORIES]
                                             + [self.flops, self.statements, self.streamed], dtype=np.int64))
        mx = _max()
        high_water = self.comm.allreduce(self.high_water, op=mx)
        return {
            "bytes": {k: int(v) for k, v in zip(CATEGORIES, total[:-3])},
            "flops": int(total[-3]),
            "statements": int(total[-2]),
            "streamed": int(total[-1]),
            "memory_peak": self.peaks(),
            "seconds": {k: float(self.comm.allreduce(v, op=mx)) for k, v in self.seconds.items()},
            "total_seconds": float(self.comm.allreduce(seconds, op=mx)),
            "by_statement": self.statement_seconds(),
        } | ({"memory_high_water": {"device": int(high_water)}} if high_water else {})


STARTED: list[float] = []
"""Where a server runs a client's command (:mod:`chainexec.server`): the client's start, in
seconds of the boot-time clock, which :func:`process_seconds` counts from instead of this
process's own."""


def process_seconds() -> float | None:
    """Seconds since the process of this run started, as Linux counts them: its start
    (:func:`chainexec.client.process_start`; the client's, :data:`STARTED`, in a served run)
    against the boot-time clock now, to a clock tick (10 ms on most systems). None where ``/proc``
    does not say (not Linux)."""
    start = STARTED[-1] if STARTED else process_start()
    if start is None:
        return None
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start


def _max():
    from chainexec.runtime.comm import mpi

    return mpi().MAX
