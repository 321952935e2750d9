"""Walks a Plan's loop nests on every rank, moves tiles between levels, and counts every byte.

The executor is the only interpreter of the plan (see :mod:`chainexec.planner.plan` for the region
rule and the statements). Global buffers are :class:`GlobalArray` s (allocated collectively),
except an input's tile that only its load fills where its file holds it as the array, on one
rank or ranks of one host (:func:`chainexec.runtime.comm.host_comm`): a :class:`MappedArray` of
the file on each rank (:mod:`chainexec.runtime.mapped`); device buffers belong to the :class:`Backend`. Statements
outside parallel loops run on all ranks, each on its own rows of the global buffer (loads read
exactly those rows from disk; stores write them); iterations of a parallel loop are dealt
round-robin to ranks, with a barrier before (loads visible) and after (accumulations complete).

Disk reads and writes run on a background worker (:mod:`chainexec.runtime.diskio`). In a
double-buffered loop (:mod:`chainexec.planner.pipeline`) the loop's own global buffers live in two
slots allocated at loop entry; iteration n+1's loads are queued before iteration n runs and
iteration n's stores are queued without waiting, so the disk works while the device does. In a
double-buffered device loop (of one rank's tiles), tile n+1's input tiles are copied to the device
on a second stream while tile n computes (:meth:`Executor._ahead`). Inputs
streamed into a symmetric tile loop (:meth:`Executor._stream`) are read while it runs, on several
ranks each rank its own rows, announced to the others on a :class:`Board`. Anywhere
else a load or store waits for its job, as a plain call would.

Counting: each transfer adds its payload bytes to its category on the rank that performs it; the
report sums the ranks. Memory: live bytes per level and their peak (global: all ranks' windows
together, summed at each collective allocation; device: per rank, the largest rank's in the report).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from chainexec import expr
from chainexec.errors import ChainexecError
from chainexec import ordering
from chainexec.planner.plan import (CATEGORIES, CATEGORY, DEPTH, LEVEL_TIMES, Loop, Op, Plan, executed, fetched,
                                    ops, pattern_key, prefetched, returned, staged, stores)
from chainexec.runtime.checkpoint import COUNTS, Checkpoint, Stopped
from chainexec.runtime.comm import hosts
from chainexec.runtime.device import Backend
from chainexec.runtime.diskio import DiskWorker
from chainexec.runtime import hostcopy
from chainexec.runtime.mapped import MappedArray
from chainexec.runtime.globalarray import Board, GlobalArray, TaskCounter, shares_memory
from chainexec.runtime.progress import Progress
from chainexec.runtime.store import Store


FENCE = 1 << 48
"""Added to the task counter to stop every rank at a checkpoint (:meth:`TaskCounter.fence`): no
loop has that many tiles."""

# The level whose busy time a statement counts toward (the keys of Machine.seconds); the disk
# level's time is the worker's own time in its jobs.
OP_LEVEL = {"get": "global<->device", "accumulate": "global<->device", "compute": "compute", "eval": "compute",
            "fused": "compute"}
# Statements the backend may still be running when it returns: timed between backend stamps
# (CUDA events on a GPU) and added up later (Executor._settle), so the host prepares the next
# statement while the device runs this one. A get's copy to the device is queued behind them too
# (its host time is what it counts); everything else the executor times waits for them.
QUEUED = ("compute", "eval", "fused")
PENDING = 1024
"""Queued statements' stamps held before the oldest half are read (waiting for them)."""
POLL_SECONDS = 0.0005
"""Pause between two reads of the board while a rank waits for another's streamed rows."""
LANDING_BYTES = 64 << 20
"""Host bytes of queued accumulates (:meth:`Executor._accumulate`) above which the executor waits
for the device before the next accumulate: page-locked host memory outside the plan's levels."""


class Counters:
    """Bytes per category, flops, compute statements run, and live/peak bytes per level, on one rank."""

    def __init__(self):
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.seconds = dict.fromkeys(LEVEL_TIMES, 0.0)
        self.flops = 0
        self.statements = 0
        self.streamed = 0  # bytes compute statements read and write in device memory (as cost.predict_nests counts them)
        # seconds per timed statement: "#k" (compute; "#k-#m" a point-wise run), "eval T", "get T", "accumulate T"
        self.by_statement: dict[str, float] = {}
        self.live = {"global": 0, "device": 0}
        self.peak = {"global": 0, "device": 0}

    def move(self, category: str, nbytes: int) -> None:
        self.bytes[category] += nbytes

    def hold(self, level: str, nbytes: int) -> None:
        self.live[level] += nbytes
        self.peak[level] = max(self.peak[level], self.live[level])


class Executor:
    def __init__(self, plan: Plan, comm, backend: Backend, balance: str = "dynamic", progress: bool = False,
                 checkpoint: Checkpoint | None = None):
        """``balance``: ``dynamic`` hands the iterations of each parallel loop out through a shared
        counter (NWChem's nxtval: a rank takes the next tile when it is free); ``static`` deals
        them round-robin. Either way every tile moves the same bytes, so the prediction holds.
        ``checkpoint``: save the progress of resumable loops and finished nests there, and resume
        from it (:meth:`_restore`, :meth:`_resumable`, :meth:`_iterations`, :meth:`_close`;
        needs dynamic balance)."""
        if balance not in ("dynamic", "static"):
            raise ValueError(f"balance must be dynamic or static, not {balance!r}")
        if checkpoint is not None and balance != "dynamic":
            raise ChainexecError("checkpoints need --balance dynamic")
        self.plan = plan
        self.comm = comm
        self.backend = backend
        self.balance = balance
        self.counter = None
        self.progress = Progress(plan.parallel_tiles, len(plan.nests)) if progress and comm.rank == 0 else None
        self.show_progress = progress
        self.store = Store(plan, comm)
        self.counters = Counters()
        self.ranges = {"global": {}, "device": {}}
        self.idle = 0.0
        self.high_water = 0  # bytes; stays 0 where the backend has no allocator to watch
        self.tiles_done = 0
        self.buffers: dict[tuple, object] = {}
        self.regions: dict[tuple, tuple] = {}
        self.disk = DiskWorker()
        # Double-buffered loops being run: their slots per buffer key (global arrays; flat device
        # buffers), and which slot of a global loop's, and of a device loop's, is in use.
        self.slots: dict[tuple, list] = {}
        self.turn = 0
        self.lane = 0
        # a double-buffered device loop's results copied back aside (Loop.back): per buffer key,
        # each slot's last copy to the host (a backend token; None before the first)
        self.returning: dict[tuple, list] = {}
        self.behind = False  # inside a double-buffered loop: stores of its slots complete later
        self.in_parallel = 0  # parallel loops around the statement being run
        self.unsynced = False  # loads since the last barrier (other ranks' rows may still be landing)
        self.weight = 1  # multiplicity of the symmetric loop's tile tuple being run (Loop.symmetric)
        self.symmetric: list[str] | None = None  # the indices of the symmetric loop being run (Loop.symmetric)
        self.pending: list[tuple[str, object, object]] = []  # queued statements: (name, start stamp, end stamp)
        self.gathers: dict[tuple, tuple] = {}  # packs' and unpacks' gather positions per tile (_gather)
        # accumulates whose device→host copies are queued: (global array, region, host, token,
        # weight, statement name)
        self.landing: collections.deque[tuple] = collections.deque()
        # streamed input rows on their way (:meth:`_stream`): (first row, end row, tensor, board
        # slot, global buffer key, device buffer key, the disk job of this rank's last piece of
        # them or None), in the order the tiles need them
        self.arriving: collections.deque[tuple] = collections.deque()
        # on several ranks: the board where ranks publish the rows of streamed inputs they have
        # read, and this rank's reads not yet published: (disk job, slot, end row, global key)
        self.board: Board | None = None
        self.reading: collections.deque[tuple] = collections.deque()
        # on several ranks, the streamed inputs whose global rows nothing reads after the loop:
        # a board where ranks publish how far they have copied each to their device, and per
        # such input [board slot, global key, first own row not yet given back]
        # (:meth:`_discard`), and the helper thread's jobs that give rows back
        self.copied: Board | None = None
        self.dropping: dict[str, list] = {}
        self.discarder: ThreadPoolExecutor | None = None
        self.discarding: list = []
        # global buffers of allocs without zero fill (Op.fill) in fresh memory (not mapped from a file), live now
        self.fresh: set[tuple] = set()
        # mapped global buffers (inputs' tiles) being locked for the device, on a thread of their
        # own from their allocation on: the futures of their backend.lock_host handles
        self.locking: dict[tuple, Future] = {}
        self.locker: ThreadPoolExecutor | None = None
        # the hosts the ranks are on (:func:`host_comm`; collective, and where a bad
        # CHAINEXEC_SIMULATE_HOSTS is refused on every rank before anything is read or written)
        self.hosts = hosts(comm)
        # inputs' tiles are mapped from their files on one rank and on ranks of one host, whose
        # page cache holds the file's pages once for all of them (:meth:`_alloc`); on several
        # hosts each rank reads its rows into a global array, so that each row is read once
        self.maps = comm.size == 1 or shares_memory(comm)
        self.checkpoint = checkpoint
        self.resumed = 0  # parallel tiles of the work a resumed run skips
        self.checkpoints = 0  # checkpoints written by this run
        # where a resumed run goes on: (nest, position of the loop, -1 at the nest's start)
        self.resume_at = (0, -1)
        # counts (all ranks: COUNTS of them) of the work a resumed run skips: the finished nests
        # and the finished store loops of the current one (:meth:`_close`, :meth:`_iterations`)
        self.bank = np.zeros(COUNTS, np.int64)
        # this rank's counts of the loads queued for a double-buffered loop's next iteration
        self.early = np.zeros(COUNTS, np.int64)
        moved = plan.predicted["bytes"]
        backend.expect_transfers((moved["global->device"] + moved["device->global"]) // comm.size)
        backend.limit_memory(plan.memory_limit["device"], plan.predicted["memory_peak"]["device"])

    def run(self) -> dict:
        """Execute every nest; return the measured record (summed over ranks) on every rank."""
        start = time.perf_counter()
        if self.balance == "dynamic":
            self.counter = TaskCounter(self.comm)
        try:
            for k in range(self._restore(), len(self.plan.nests)):
                try:
                    self._body(self.plan.nests[k].body, k)
                    self._settle()
                    self._close(k)
                except Stopped:
                    self.disk.close()  # no streamed read may still write into a window freed here
                    self._release()
                    raise
                if self.show_progress:
                    self._report(k + 1)
            self.store.drop_superseded()
        finally:
            self.disk.close()
            for key in list(self.locking):  # a failed run's: nothing stays locked behind it
                self._unlock(key)
            if self.locker is not None:
                self.locker.shutdown()
        if self.progress is not None:
            self.progress.close()
        self.store.finish()
        if self.counter is not None:
            self.counter.free()
        return self._measured(time.perf_counter() - start)

    def _release(self) -> None:
        """Free every global buffer and the task counter (collective: every rank stops at the
        same checkpoint), so that a stopped run ends as cleanly as a finished one."""
        self._streamed_done()  # no page given back after its window is freed
        for key, ga in [(k, b) for k, b in self.buffers.items() if k[2] == "global" and k not in self.slots]:
            self._free_global(key, ga)
        for slots in self.slots.values():  # a global loop's (a device loop's are gone with its _lanes)
            for ga in slots:
                ga.free()
        if self.counter is not None:
            self.counter.free()
            self.counter = None

    def _report(self, nest: int) -> None:
        """All ranks' tiles and bytes so far, summed (collective; after a nest, where all meet)."""
        resumed = self.resumed if self.comm.rank == 0 else 0  # tiles an earlier run did count as done
        local = [self.tiles_done + resumed] + [self.counters.bytes[k] for k in CATEGORIES]
        total = self.comm.reduce(np.array(local, dtype=np.int64), root=0)
        if self.progress is not None:
            self.progress.update(nest, int(total[0]), {k: int(v) for k, v in zip(CATEGORIES, total[1:])})

    def statement_seconds(self) -> dict[str, float]:
        """Seconds spent in each statement the executor times per level: compute (``#k``; a run of
        point-wise terms as ``#k-#m``), a computed tensor's evaluation (``eval T``) and transfers
        between global and device memory (``get T``, ``accumulate T``), summed over ranks, most
        first (collective). Compute statements are timed between backend stamps (CUDA events
        on a GPU) and transfers after waiting for them, so these are the device's times."""
        total: dict[str, float] = {}
        for mine in self.comm.allgather(self.counters.by_statement):
            for key, seconds in mine.items():
                total[key] = total.get(key, 0.0) + seconds
        return dict(sorted(total.items(), key=lambda kv: -kv[1]))

    def rank_times(self, total: float) -> list[dict]:
        """Per rank (gathered on every rank): seconds waiting at the parallel loops' barriers
        (idle), the rest (busy), and parallel tiles done."""
        mine = {"rank": self.comm.rank, "busy_seconds": total - self.idle, "idle_seconds": self.idle,
                "tiles": self.tiles_done}
        return self.comm.allgather(mine)

    def _measured(self, seconds: float) -> dict:
        """Same keys as the plan's ``predicted``: seconds per level are the busiest rank's time
        inside that level's statements; ``total_seconds`` is the wall time of the slowest rank."""
        total = self.comm.allreduce(np.array([self.counters.bytes[k] for k in CATEGORIES]
                                             + [self.counters.flops, self.counters.statements, self.counters.streamed],
                                             dtype=np.int64))
        mx = _max()
        high_water = self.comm.allreduce(self.high_water, op=mx)
        return {
            "bytes": {k: int(v) for k, v in zip(CATEGORIES, total[:-3])},
            "flops": int(total[-3]),
            "statements": int(total[-2]),
            "streamed": int(total[-1]),
            "memory_peak": {"global": int(self.counters.peak["global"]),
                            "device": int(self.comm.allreduce(self.counters.peak["device"], op=mx))},
            "seconds": {k: float(self.comm.allreduce(v, op=mx)) for k, v in self.counters.seconds.items()},
            "total_seconds": float(self.comm.allreduce(seconds, op=mx)),
        } | ({"memory_high_water": {"device": int(high_water)}} if high_water else {})

    # -- loop nest ---------------------------------------------------------------------------

    def _range(self, level: str, index: str) -> tuple[int, int]:
        if level == "device" and index in self.ranges["device"]:
            return self.ranges["device"][index]
        return self.ranges["global"].get(index, (0, self.plan.extents[index]))

    def _region(self, level: str, indices) -> tuple[tuple[int, int], ...]:
        return tuple(self._range(level, i) for i in indices)

    def _body(self, body, nest: int | None = None) -> None:
        """Run a loop body; ``nest`` is the nest's number where ``body`` is a whole nest."""
        k = 0
        if nest is not None:
            found = self.plan.nests[nest].streamed
            if found is not None:
                k = self._stream(body, found["loop"], found["rows"])
                self._loop(body[k], (nest, k))
                if self.board is not None:  # every rank is past the loop's closing barrier
                    self._discard(last=True)
                    self._streamed_done()
                k += 1
        while k < len(body):
            node = body[k]
            if isinstance(node, Loop):
                self._loop(node, None if nest is None else (nest, k))
                k += 1
                continue
            queued = node.op in QUEUED
            if self._waits_first(node):
                self._settle()
            t0, idle0 = time.perf_counter(), self.idle
            start = self.backend.stamp() if queued else None
            if node.op == "compute":
                run = body[k:k + node.run]
                self._compute(run)
                k += len(run)
                name = f"#{run[0].contraction}" + (f"-#{run[-1].contraction}" if len(run) > 1 else "")
            else:
                getattr(self, "_" + node.op)(node)
                k += 1
                name = f"{node.op} {node.tensor}" + (f" #{node.group[0]}-#{node.group[-1]}" if node.group else "")
            if queued:
                self.pending.append((name, start, self.backend.stamp()))
                if len(self.pending) >= PENDING:
                    self._settle(PENDING // 2)
            elif node.op in OP_LEVEL:  # a get's barrier is idle time
                self._spent(OP_LEVEL[node.op], name, time.perf_counter() - t0 - (self.idle - idle0))

    def _stream(self, body, at: int, rows: dict[str, int]) -> int:
        """Run a nest's opening statements (:func:`chainexec.planner.pipeline.streamed`), all but
        the streamed inputs' loads and gets, then queue those loads on the disk worker in rows of
        one tile, position by position, each input in turn; the loop copies each chunk to the
        device when a tile first needs it (:meth:`_arrive`), so that it starts after the first
        rows and disk reads and copies run beside its tiles. On several ranks each rank reads its
        share of each chunk (:meth:`_share`) and publishes on a :class:`Board` how far it got; a
        rank copies a chunk to its device once every rank with a share of it has read it
        (:meth:`_ready`). Until 2026-11-25 several ranks did not stream: every rank waited for
        all inputs, read by all ranks, before its first tile (at o=32 v=300 on two H100s, 2.2 s
        of each rank's 24.4 s). The position of the loop in ``body``."""
        skipped = [op for op in body[:at] if op.op in ("load", "get") and op.tensor in rows]
        self._body([op for op in body[:at] if not any(op is x for x in skipped)])
        loads = {op.tensor: op for op in skipped if op.op == "load"}
        gets = {op.tensor: op for op in skipped if op.op == "get"}
        extent = {t: self.plan.tensors[t].shape[0] for t in rows}
        slots = {t: n for n, t in enumerate(rows)}
        if self.comm.size > 1:
            self.board = Board(self.comm, len(rows))
            later = {}  # after the loop, the first statement naming each tensor (a device copy's free aside)
            for op, _ in ops(body[at + 1:]):
                if op.tensor is not None and not (op.op == "free" and op.level == "device"):
                    later.setdefault(op.tensor, op)
            self.dropping = {t: [slots[t], self._key(loads[t]), 0] for t in rows
                             if self.buffers[self._key(loads[t])].gives_back and t in later
                             and later[t].op == "free" and self._key(later[t]) == self._key(loads[t])}
            if self.dropping:  # the same on every rank: the same plan, one host for all or none
                self.copied = Board(self.comm, len(rows))
        for lo in range(0, max(extent.values()), min(rows.values())):
            for t, step in rows.items():
                if lo % step or lo >= extent[t]:
                    continue
                hi = min(lo + step, extent[t])
                gkey, dkey = self._key(loads[t]), self._key(gets[t])
                ga, region = self.buffers[gkey], self.regions[gkey]
                job = None
                # both counted here, before the loop, as the whole load and get they stand for
                # (a resumed loop's counts must not hold them: it streams them again); every
                # rank gets all rows, each loads its share
                for owner, first, end, cut in self._share(ga, lo, hi, self.comm.rank):
                    start = ga.rows_of(owner)[0]
                    out = ga.block(owner)[first - start:end - start]
                    part = ((region[0][0] + first, region[0][0] + end),) + region[1:]
                    if cut is not None:
                        out = out[:, cut[0]:cut[1]]
                        part = part[:1] + ((region[1][0] + cut[0], region[1][0] + cut[1]),) + part[2:]
                    job = self._fill(ga, gkey, t, loads[t].version, part, out)
                    self.counters.move(CATEGORY["load"], out.nbytes)
                if job is not None and self.board is not None:
                    self.reading.append((job, slots[t], hi, gkey))
                self.counters.move(CATEGORY["get"], self.buffers[dkey][lo:hi].nbytes)
                self.arriving.append((lo, hi, t, slots[t], gkey, dkey, job))
        return at

    def _fill(self, ga, key: tuple, tensor: str, version: int, part, out: np.ndarray) -> int:
        """Queue on the disk worker the load of ``part`` of ``tensor`` (``version``; a region
        of the whole tensor) into ``out``, a view of the global buffer ``ga`` (``key``): for a tile
        mapped from its file, its pages made resident (:meth:`MappedArray.populate`); else an
        HDF5 read, into memory faulted in first where the buffer is fresh (:meth:`_read_fresh`).
        The worker's job number."""
        if isinstance(ga, MappedArray):
            return self.disk.submit(ga.populate, out)
        return self.disk.submit(self._read_fresh if key in self.fresh else self.store.read, tensor, version, part, out)

    def _lock(self, key: tuple, ga: MappedArray) -> None:
        """Begin locking the mapped tile ``ga`` (buffer ``key``) for the device
        (:meth:`Backend.lock_host`) on a thread of its own, so that its gets become DMAs from the
        file's pages. Nothing waits for it: a get before it is done takes the backend's other
        path (benzene's 203 MB took 4-7 ms to lock on the H100 host, 2026-11-28)."""
        if not self.backend.locks_host():
            return
        if self.locker is None:
            self.locker = ThreadPoolExecutor(1, thread_name_prefix="chainexec-lock")
        self.locking[key] = self.locker.submit(self.backend.lock_host, ga.whole())

    def _unlock(self, key: tuple) -> None:
        """Unlock the global buffer ``key`` where :meth:`_lock` locked it, once the lock is done
        (the unlock waits for the copies queued from it; the mapping outlives it). A lock that
        failed left the buffer unlocked: its gets took the other path, and nothing is undone."""
        locking = self.locking.pop(key, None)
        handle = None if locking is None or locking.exception() is not None else locking.result()
        if handle is not None:
            self.backend.unlock_host(handle)

    def _free_global(self, key: tuple, ga) -> None:
        """Let the global buffer ``key`` go, unlocked first (:meth:`_unlock`)."""
        self._unlock(key)
        ga.free()

    def _read_fresh(self, tensor: str, version: int, part, out: np.ndarray) -> None:
        """Read ``part`` of ``tensor`` into ``out``, memory not touched since its allocation: its
        pages are faulted in first over threads (:func:`hostcopy.fill`), where this process may
        run more than one; the read's copy would fault them in on the disk worker alone. On the
        H100 machine (2026-11-27, ``.gpurun/s21/io.py``) reading benzene-size (T) inputs
        (194 MB) into a fresh MPI window took 0.165 s, 0.087 s with this; page faults scaled
        only 2.5x over 16 threads there, and in whole runs the disk seconds stayed near 0.15 s.
        Contiguous inputs on one host are mapped instead (:mod:`chainexec.runtime.mapped`); this
        path serves ranks on several hosts and datasets that cannot be mapped."""
        if hostcopy.threads() > 1:
            hostcopy.fill(out, 0)
        self.store.read(tensor, version, part, out)

    def _share(self, ga: GlobalArray | MappedArray, lo: int, hi: int, rank: int) -> list[tuple]:
        """The pieces of rows ``[lo, hi)`` of a streamed input that ``rank`` reads from disk:
        (owner of the rows, first row, end row, range along the second axis or None for all of
        it). In shared memory (ranks of one host) each row is cut along its second axis over all
        ranks, so that every rank (with a non-empty cut) reads a part of every chunk, in the
        order the tiles need them; otherwise a rank reads the rows it owns. (Each rank reading
        its own rows, on four H200s at o=40 v=400, the other ranks waited 3.7-4.1 s for rank 0's
        reads of the first rows, 2026-11-26.) Each piece is contiguous in ``ga``'s block."""
        size = self.comm.size
        if math.prod(ga.shape) == 0:
            return []
        if ga.shared and len(ga.shape) > 1:
            cut = (rank * ga.shape[1] // size, (rank + 1) * ga.shape[1] // size)
            if cut[0] == cut[1]:
                return []
            return [(next(r for r, _ in ga.owners((slice(row, row + 1),))), row, row + 1, cut)
                    for row in range(lo, hi)]
        return [(r, first, end, None) for r, (first, end) in ga.owners((slice(lo, hi),)) if r == rank]

    def _arrive(self, need: int | None = None) -> None:
        """Copy to the device every streamed chunk (:meth:`_stream`) that starts below row
        ``need`` (all, by default), once its rows are read (by the disk worker; on several ranks
        by every rank with a share of them, :meth:`_ready`): beside the work queued before
        (:meth:`Backend.fetch_aside`), the work queued after waiting for it."""
        if self.board is not None:
            self._publish()
        while self.arriving and (need is None or self.arriving[0][0] < need):
            lo, hi, tensor, slot, gkey, dkey, job = self.arriving.popleft()
            if job is not None:
                self.counters.seconds["disk"] += self.disk.wait(job)
            ga, dst = self.buffers[gkey], self.buffers[dkey][lo:hi]
            if self.board is not None:
                self._ready(ga, slot, lo, hi)
            chunk = (slice(lo, hi),) + tuple(slice(None) for _ in dst.shape[1:])
            t0 = time.perf_counter()
            self.backend.fetch_aside(dst, lambda rows, out: ga.get(_within(chunk, rows), out=out),
                                     view=lambda rows: ga.at_hand(_within(chunk, rows)))
            self._spent(OP_LEVEL["get"], f"get {tensor}", time.perf_counter() - t0)
            if self.copied is not None:  # the rows are in page-locked staging or on the device now
                self.copied.publish(slot, hi)

    def _discard(self, last: bool = False) -> None:
        """Give back, on a helper thread, the pages of this rank's rows of the streamed inputs
        that every rank has copied to its device and nothing reads after the loop
        (:meth:`GlobalArray.discard`), so that most pages go while the device computes instead
        of when the windows are freed after the loop. ``last``: after the loop, when every rank
        has copied every row: all of this rank's rows again, for the pages that straddled two
        earlier calls' rows. On four H200s at o=40 v=400 (23 GB of inputs in shared memory)
        4.9 s passed between the last tile queued and the end of the run, against 1.2 s on one
        GPU (2026-11-26); with the pages given back, 0.8 s (2026-11-27: 4 GPUs at 35.7-36.9 s
        against 39.1 s, 90-93 % of one GPU's 132.6 s)."""
        for state in self.dropping.values():
            slot, gkey, done = state
            ga = self.buffers[gkey]
            first = ga.rows[0] if last else max(done, ga.rows[0])
            if first >= ga.rows[1]:
                continue
            upto = ga.rows[1] if last else min(int(self.copied.read(slot).min()), ga.rows[1])
            if upto > first:
                if self.discarder is None:
                    self.discarder = ThreadPoolExecutor(1, thread_name_prefix="chainexec-discard")
                self.discarding.append(self.discarder.submit(ga.discard, (first, upto)))
                state[2] = upto

    def _streamed_done(self) -> None:
        """After a streamed loop (or a stop inside it): wait for the rows being given back, then
        free the boards."""
        for job in self.discarding:
            job.result()
        if self.discarder is not None:
            self.discarder.shutdown()
        self.discarding, self.dropping, self.discarder = [], {}, None
        for board in (self.board, self.copied):
            if board is not None:
                board.free()
        self.board = self.copied = None

    def _publish(self, everything: bool = False) -> None:
        """Publish on the board how far this rank has read its share of each streamed input
        (those the disk worker has finished, in order; ``everything``: after waiting for all of
        them, as a rank must before it meets the others, who may be waiting for its rows)."""
        latest = {}
        while self.reading and (everything or self.disk.finished(self.reading[0][0])):
            job, slot, hi, gkey = self.reading.popleft()
            if everything:
                self.counters.seconds["disk"] += self.disk.wait(job)
            latest[slot] = (hi, gkey)
        for slot, (hi, gkey) in latest.items():
            self.buffers[gkey].local()  # the worker's stores into the window, synced before they are announced
            self.board.publish(slot, hi)

    def _ready(self, ga: GlobalArray | MappedArray, slot: int, lo: int, hi: int) -> None:
        """Wait until every other rank with a share of rows ``[lo, hi)`` of a streamed input
        (:meth:`_share`) has published that it read them, publishing this rank's own meanwhile
        (two ranks may wait for each other's rows); the wait is idle time."""
        self._publish()
        need = [rank for rank in range(self.comm.size) if rank != self.comm.rank and self._share(ga, lo, hi, rank)]
        t0 = time.perf_counter()
        while need:
            seen = self.board.read(slot)
            need = [rank for rank in need if seen[rank] < hi]
            if need:
                time.sleep(POLL_SECONDS)
                self._publish()
        self.idle += time.perf_counter() - t0

    def _spent(self, level: str, name: str, seconds: float) -> None:
        self.counters.seconds[level] += seconds
        self.counters.by_statement[name] = self.counters.by_statement.get(name, 0.0) + seconds

    def _settle(self, count: int | None = None) -> None:
        """Wait for the queued statements (the first ``count`` of them, else all) and add their
        times; after it, host clocks measure the host's own work again. Waiting for all of them
        also lands every queued accumulate (:meth:`_accumulate`)."""
        if count is None:
            self.backend.wait()
            count = len(self.pending)
            while self.landing:
                t0 = time.perf_counter()
                name = self._land()
                self._spent(OP_LEVEL["accumulate"], name, time.perf_counter() - t0)
        done, self.pending = self.pending[:count], self.pending[count:]
        for name, start, end in done:
            self._spent("compute", name, self.backend.elapsed(start, end))

    def _loop(self, loop: Loop, where: tuple[int, int] | None = None) -> None:
        """``where``: (nest, position) of a loop at the top of a nest. A store loop before the place
        a resumed run goes on from is skipped: it finished, its blocks are sealed and its
        counts banked."""
        if loop.resume == "store" and where is not None and where < self.resume_at:
            return
        names = list(loop.tiles)
        spans = []
        for i in names:
            lo, hi = self._range(loop.level, i)
            spans.append([(s, min(s + loop.tiles[i], hi)) for s in range(lo, hi, loop.tiles[i])])
        saved = dict(self.ranges[loop.level])
        combos, weights = _tuples(names, spans, loop.symmetric)
        if loop.depth > 1 and loop.level == "global":
            self._double_buffered(loop, names, combos, weights, self._iterations(loop, where, len(combos)))
            self.ranges[loop.level] = saved
            return
        if loop.parallel:
            self._wait()
            if self._checkpointed(loop, where):
                mine = self._resumable(loop, where, len(combos))
            else:
                if self.counter is not None:
                    self.counter.reset()
                mine = self._claim(len(combos))
        else:
            mine = self._iterations(loop, where, len(combos))
        self.in_parallel += loop.parallel
        outer, symmetric = self.weight, self.symmetric
        if loop.symmetric:
            self.symmetric = loop.symmetric
        stop = [names.index(i) for i in loop.symmetric]
        ahead, back = fetched(loop), returned(loop)
        body = executed(loop)
        lane = self.lane
        with (self.backend.steady(self._steady(loop)),
              self._lanes(ahead, back, names, combos[0] if ahead or back else ()) as slots):
            for turn, n in enumerate(self._ahead(ahead, slots, names, combos, mine) if ahead else mine):
                self.lane = turn % DEPTH
                if self.arriving and stop:
                    self._arrive(max(combos[n][i][1] for i in stop))
                self.ranges[loop.level].update(zip(names, combos[n]))
                self.weight = outer * weights[n]
                self._body(body)
                self.tiles_done += loop.parallel
                if self.dropping:
                    self._discard()
        self.lane = lane
        if loop.parallel:
            self._arrive()  # chunks no tile of this rank needed (a resumed loop's)
        self.weight, self.symmetric = outer, symmetric
        self.in_parallel -= loop.parallel
        self.ranges[loop.level] = saved
        if loop.parallel:
            self._wait()

    @contextlib.contextmanager
    def _lanes(self, ahead: list[Op], back: list[Op], names: list[str], first: tuple):
        """The device slots of a double-buffered device loop's fetched tiles (``ahead``,
        :func:`chainexec.planner.plan.fetched`) and results copied back (``back``, their
        ``alloc`` statements: :func:`~chainexec.planner.plan.returned`): per buffer,
        :data:`DEPTH` flat buffers of its full tile (``first``, the loop's first tile, is a full
        one), held from loop entry to exit as the plan counts them."""
        saved = dict(self.ranges["device"])
        self.ranges["device"].update(zip(names, first))
        slots, held = {}, 0
        for op in ahead + back:
            if op.op == "alloc":
                size = math.prod(b - a for a, b in self._region("device", op.indices))
                with _naming(op):
                    slots[self._key(op)] = [self.backend.zeros((size,), self.plan.tensors[op.tensor].dtype)
                                            for _ in range(DEPTH)]
                held += DEPTH * size * self.plan.tensors[op.tensor].itemsize
        self.ranges["device"] = saved
        self.slots.update(slots)
        self.returning.update({self._key(op): [None] * DEPTH for op in back})
        self.counters.hold("device", held)
        try:
            yield slots
        finally:
            for key in slots:
                del self.slots[key]
                for token in self.returning.pop(key, ()):
                    # the slots' memory goes back to the pool: work queued from here on may reuse it
                    self.backend.wait_for(token)
                self.buffers.pop(key, None)
                self.regions.pop(key, None)
            self.counters.hold("device", -held)

    def _ahead(self, ahead: list[Op], slots: dict, names: list[str], combos: list[tuple], mine):
        """The tiles of ``mine``, each with its fetched input tiles (``ahead``) already on their way
        to its slots: tile n+1 is taken (from the shared counter, :meth:`_claim`), and its
        inputs' copies queued on a second stream (:meth:`Backend.fetch_aside`), once tile n's
        statements are queued, so the device copies them while it computes tile n. A slot's
        copies start once the tile before last, which read it, is done (the slots' zero fill
        for the first two); the device's work queued after the copies waits for them. Until
        2026-11-25 every tile's inputs were copied on the compute stream, between its statements."""
        done = [self.backend.stamp()] * DEPTH  # where each slot's last reader ends in the device's queue
        for turn, n in enumerate(mine):
            slot = turn % DEPTH
            self.ranges["device"].update(zip(names, combos[n]))
            for op in ahead:
                key = self._key(op)
                if op.op == "alloc":
                    region = self._region("device", op.indices)
                    shape = tuple(b - a for a, b in region)
                    self.buffers[key] = slots[key][slot][:math.prod(shape)].reshape(shape)
                    self.regions[key] = region
                    continue
                if self._waits_first(op, aside=True):
                    self._settle()
                if self._fetch_waits(op):
                    # a copy through staging buffers (or from plain memory) waits on the host for
                    # the slot's last reader too: waited for first, so the get's seconds are its own
                    self.backend.reach(done[slot])
                t0 = time.perf_counter()
                self._get(op, after=done[slot])
                self._spent(OP_LEVEL["get"], f"get {op.tensor}", time.perf_counter() - t0)
            yield n
            done[slot] = self.backend.stamp()

    def _steady(self, loop: Loop) -> list:
        """The device buffers that ``loop``'s body only reads (no statement in it names their
        tensor, as output or buffer), for :meth:`Backend.steady`."""
        named = set()
        for op, _ in ops(loop.body):
            named.add(op.tensor)
            if op.contraction is not None:
                named.add(self.plan.contractions[op.contraction].out)
        return [buf for (tensor, _, level), buf in self.buffers.items() if level == "device" and tensor not in named]

    def _double_buffered(self, loop: Loop, names: list[str], combos: list[tuple], weights: list[int], order) -> None:
        """A sequential global loop whose disk traffic overlaps its work (module docstring), over
        the iterations ``order`` gives (consecutive: :meth:`_iterations`). The loads counted for
        the next iteration while one runs are kept in :attr:`early`."""
        own, ahead = staged(loop), prefetched(loop)
        rest = [node for node in loop.body if not any(node is op for op in ahead)]
        self.ranges["global"].update(zip(names, combos[0]))  # the first tile is a full one
        for op in own:
            shape = tuple(b - a for a, b in self._region("global", op.indices))
            with _naming(op):
                slots = [GlobalArray(self.comm, shape, self.plan.tensors[op.tensor].dtype, zero=False)
                         for _ in range(loop.depth)]
            self.slots[self._key(op)] = slots
            self.counters.hold("global", loop.depth * self.comm.allreduce(slots[0].nbytes_local))
        behind = self.behind
        self.behind = True
        marks = {}
        outer = self.weight
        for n in order:
            if n not in marks:  # the first iteration's loads
                marks[n] = self._prefetch(ahead, names, combos, n, loop.depth)
            self.ranges["global"].update(zip(names, combos[n]))
            # Everything queued up to this tile's loads: also the stores that last used its slots.
            upto, filled = marks.pop(n)
            self.counters.seconds["disk"] += self.disk.wait(upto)
            for key, (buf, region) in filled.items():
                self.buffers[key], self.regions[key] = buf, region
                buf.local()  # synchronise the window with what the worker wrote
            if n + 1 < len(combos):
                before = self._counts()
                marks[n + 1] = self._prefetch(ahead, names, combos, n + 1, loop.depth)
                self.early = self._counts() - before
                self.ranges["global"].update(zip(names, combos[n]))
            self.turn = n % loop.depth
            self.weight = outer * weights[n]
            self._body(rest)
        self.weight = outer
        self.early = np.zeros(COUNTS, np.int64)
        self.counters.seconds["disk"] += self.disk.wait()
        self.behind = behind
        for op in own:
            for ga in self.slots.pop(self._key(op)):
                self.counters.hold("global", -self.comm.allreduce(ga.nbytes_local))
                ga.free()

    def _prefetch(self, ahead: list[Op], names: list[str], combos: list[tuple], n: int, depth: int) -> tuple:
        """Queue tile n's loads into its slots; (the worker's job count after them, the buffers)."""
        self.ranges["global"].update(zip(names, combos[n]))
        filled = {}
        for op in ahead:
            key = self._key(op)
            if op.op == "alloc":
                region = self._region("global", op.indices)
                filled[key] = (self.slots[key][n % depth].view(tuple(b - a for a, b in region)), region)
            else:
                self._read(op, *filled[key])
        return self.disk.submitted, filled

    def _claim(self, count: int):
        """This rank's iterations of a parallel loop of ``count``: from the shared counter as it
        frees up (dynamic), or every size-th one (static)."""
        if self.counter is None:
            yield from range(self.comm.rank, count, self.comm.size)
            return
        while (n := self.counter.next()) < count:
            yield n

    def _checkpointed(self, loop: Loop, where: tuple[int, int] | None) -> bool:
        """Whether ``loop`` (at ``where``) checkpoints: a resumable loop (``Loop.resume``), not
        before the place a resumed run goes on from (rerunning those must not replace a
        checkpoint that is further on)."""
        return self.checkpoint is not None and loop.resume is not None and where is not None and where >= self.resume_at

    def _saved(self, where: tuple[int, int], count: int) -> dict | None:
        """The manifest being resumed where it goes on inside the loop at ``where`` (of ``count``
        tiles), else None."""
        saved = self.checkpoint.saved
        if saved is None or (saved["nest"], saved["position"]) != tuple(where):
            return None
        if saved["tiles"] != count:
            raise ChainexecError(f"the checkpoint's loop has {saved['tiles']} tiles, this one {count}",
                                 str(self.checkpoint.folder))
        return saved

    def _resumable(self, loop: Loop, where: tuple[int, int], count: int):
        """This rank's iterations of an accumulate loop (:mod:`chainexec.planner.resume`), with
        checkpoints (:mod:`chainexec.runtime.checkpoint`).

        Resuming: the accumulation targets' rows come back from this rank's file and the counter
        starts after the tiles done (what they counted :meth:`_restore` added). Checkpointing:
        when one is due, rank 0 fences the counter (:meth:`TaskCounter.fence`) at the first tile
        not handed out instead of taking it; every other rank's next claim then returns the
        fence, so all ranks meet between tiles, with every earlier tile finished and
        accumulated. There they write their rows, rank 0 commits the manifest (:meth:`_commit`),
        and the counter goes back to the fence's position (or, with ``--stop-after`` due, every
        rank raises :class:`Stopped`)."""
        ck = self.checkpoint
        targets = list(dict.fromkeys(self._find(op.tensor, op.indices, "global")
                                     for op, _ in ops(loop.body) if op.op == "accumulate"))
        saved = self._saved(where, count)
        start, prior = 0, np.zeros(COUNTS, np.int64)
        if saved is not None:
            rows = [self.buffers[key].local() for key in targets]
            for mine, kept in zip(rows, ck.read_rank(self.comm.rank, saved["number"], rows)):
                mine[...] = kept
            start, prior = saved["done"], np.array(saved["counts"], np.int64)
        self.counter.reset(start)
        base = self._counts()
        taken = 0  # tiles rank 0 took since the last checkpoint: each checkpoint follows progress
        while True:
            fenced = None
            if self.comm.rank == 0 and taken and ck.due():
                fenced = self.counter.fence(count, FENCE)
                if fenced is None:
                    return  # every tile already handed out: the loop ends anyway
            else:
                n = self.counter.next()
                if n < FENCE:
                    if n >= count:
                        return
                    taken += 1
                    yield n
                    continue
            if self.board is not None:
                # a rank still in a tile may wait for this one's rows: all of them read first
                # (the loop's first checkpoints wait for this rank's whole share of the inputs)
                self._publish(everything=True)
            done = self.comm.bcast(fenced, root=0)
            self._settle()  # lands this rank's queued accumulates
            self.comm.Barrier()  # every tile before the fence has accumulated (and flushed)
            counts = prior + self.comm.allreduce(self._counts() - base)
            if self._commit(where, done, count, counts, [self.buffers[key].local() for key in targets]):
                raise Stopped(done, count, ck.folder)
            self.counter.reset(done)
            taken = 0

    def _iterations(self, loop: Loop, where: tuple[int, int] | None, count: int):
        """The iterations of a sequential loop of ``count``, in order. Of a store loop being
        checkpointed, those a resumed run has not finished, with a checkpoint between two where
        one is due (every rank meets there anyway: the iterations are collective): each rank's
        stores are durable (:meth:`_commit` seals them), and the loop's counts so far, less the
        loads already queued for the next iteration (:attr:`early`, counted again when a
        resumed run queues them), are committed with the iterations finished. At its end the
        loop's counts go to the bank: a resumed run skips it."""
        if not self._checkpointed(loop, where):
            yield from range(count)
            return
        saved = self._saved(where, count)
        start = saved["done"] if saved else 0
        prior = np.array(saved["counts"] if saved else [0] * COUNTS, np.int64)
        base = self._counts()
        for n in range(start, count):
            yield n
            if n + 1 < count and self._due():
                counts = prior + self.comm.allreduce(self._counts() - base - self.early)
                if self._commit(where, n + 1, count, counts):
                    raise Stopped(n + 1, count, self.checkpoint.folder)
        self.bank = self.bank + prior + self.comm.allreduce(self._counts() - base)

    def _close(self, k: int) -> None:
        """After nest ``k`` (collective): join the versions it stored. A run that checkpoints
        seals their blocks first and syncs the joins (:meth:`Store.close_version`); where the
        plan allows (``Nest.checkpoint_after``) a checkpoint follows, when one is due and always
        after the last nest (a crash in :meth:`Store.finish`, which removes scratch, then
        leaves a checkpoint that needs only the outputs' shards)."""
        nest, ck = self.plan.nests[k], self.checkpoint
        if ck is None:
            for tensor, version in stores(nest.body).items():
                self.store.close_version(tensor, version)
            return
        self.store.seal((ck.committed or 0) + 1)
        for tensor, version in stores(nest.body).items():
            self.store.close_version(tensor, version, durable=True)
        self.bank = self.comm.allreduce(self._counts())
        last = k + 1 == len(self.plan.nests)
        if nest.checkpoint_after and (last or self._due()):
            if self._commit((k + 1, None), 0, 0, np.zeros(COUNTS, np.int64)) and not last:
                raise Stopped(k + 1, len(self.plan.nests), ck.folder, "nests")

    def _due(self) -> bool:
        """Whether to checkpoint now: rank 0 decides (:meth:`Checkpoint.due`), every rank learns
        (collective)."""
        return self.comm.bcast(self.checkpoint.due() if self.comm.rank == 0 else None, root=0)

    def _commit(self, at: tuple[int, int | None], done: int, tiles: int, counts: np.ndarray,
                rows: list[np.ndarray] | None = None) -> bool:
        """Collective: checkpoint number ``committed + 1``. Every rank makes its part durable (its
        stores finished and sealed, :meth:`Store.seal`; ``rows``, an accumulate loop's targets'
        rows, written), then rank 0 commits the manifest: the run goes on at ``at`` (nest, and
        the position of the loop with ``done`` of its ``tiles`` finished, which counted
        ``counts``; None: at the nest's start), with the closed versions, each rank's sealed
        blocks of the nest's versions, the bank and the peaks. Afterwards the parts and
        versions it supersedes go. Whether every rank is to stop (``--stop-after``)."""
        ck = self.checkpoint
        number = (ck.committed or 0) + 1
        self._settle()
        self.counters.seconds["disk"] += self.disk.wait()
        if rows is not None:
            ck.write_rank(self.comm.rank, number, rows)
        self.store.seal(number)
        writing = list(stores(self.plan.nests[at[0]].body).items()) if at[0] < len(self.plan.nests) else []
        blocks = self.comm.gather(self.store.open_blocks(writing), root=0)
        peaks = {"global": int(self.counters.peak["global"]),
                 "device": int(self.comm.allreduce(self.counters.peak["device"], op=_max()))}
        stop = False
        if self.comm.rank == 0:
            joined = {t: b for t, b in self.store.joined.items() if self.plan.tensors[t].role == "output"}
            ck.commit({"nest": at[0], "position": at[1], "done": done, "tiles": tiles, "number": number,
                       "ranks": self.comm.size, "counts": counts.tolist(), "banked": self.bank.tolist(),
                       "peaks": peaks, "stored": self.store.last_version, "joined": joined,
                       "open": [[t, v, [mine[j] for mine in blocks]] for j, (t, v) in enumerate(writing)]})
            stop = ck.stopping()
        stop = self.comm.bcast(stop, root=0)
        ck.supersede(self.comm.rank, number)
        self.store.drop_superseded()
        self.checkpoints += 1
        return stop

    def _restore(self) -> int:
        """Take back what the checkpoint being resumed recorded (every rank, before anything
        runs): the closed versions and sealed blocks into the store (:meth:`Store.resume`), where
        it goes on, the bank, the counts of all the work it skips (rank 0 adds them to its own:
        the run's totals then equal the prediction) and the peaks reached (kept). The first nest
        to run: 0 without a checkpoint to resume."""
        saved = None if self.checkpoint is None else self.checkpoint.saved
        if saved is None:
            return 0
        self.store.resume(saved["stored"], saved["joined"], saved["open"])
        self.resume_at = (saved["nest"], -1 if saved["position"] is None else saved["position"])
        self.bank = np.array(saved["banked"], np.int64)
        skipped = self.bank + np.array(saved["counts"], np.int64)
        self.resumed = int(skipped[-1])
        if self.comm.rank == 0:
            self._add_counts(skipped)
        for level, peak in saved["peaks"].items():
            self.counters.peak[level] = max(self.counters.peak[level], peak)
        return saved["nest"]

    def _counts(self) -> np.ndarray:
        """This rank's bytes per category, flops, statements, streamed bytes and parallel tiles so
        far (rank 0's with the tiles of the work a resumed run skips: :meth:`_restore`)."""
        c = self.counters
        tiles = self.tiles_done + (self.resumed if self.comm.rank == 0 else 0)
        return np.array([c.bytes[k] for k in CATEGORIES] + [c.flops, c.statements, c.streamed, tiles], np.int64)

    def _add_counts(self, counts: np.ndarray) -> None:
        """Add bytes, flops, statements and streamed bytes of ``counts`` (as :meth:`_counts`) to this rank's."""
        c = self.counters
        for k, v in zip(CATEGORIES, counts):
            c.bytes[k] += int(v)
        flops, statements, streamed = (int(v) for v in counts[len(CATEGORIES):len(CATEGORIES) + 3])
        c.flops += flops
        c.statements += statements
        c.streamed += streamed

    def _wait(self) -> None:
        if self.board is not None and self.in_parallel:
            # a barrier inside the streamed loop (a nested parallel loop's): another rank may be
            # waiting in _ready for rows of this one (the loop's own closing barrier follows
            # _arrive(), which has published them all)
            self._publish(everything=True)
        self._settle()  # a rank's idle time at the barrier starts when its device is done
        t0 = time.perf_counter()
        self.unsynced = False
        self.comm.Barrier()
        self.idle += time.perf_counter() - t0

    # -- statements --------------------------------------------------------------------------

    def _key(self, op: Op) -> tuple:
        return (op.tensor, tuple(op.indices), op.level)

    def _alloc(self, op: Op) -> None:
        region = self._region(op.level, op.indices)
        shape = tuple(b - a for a, b in region)
        dtype = self.plan.tensors[op.tensor].dtype
        slots = self.slots.get(self._key(op))
        zero = op.fill is not False
        if slots is not None and op.level == "device":
            # a result copied back aside (Loop.back): its slot, zeroed once the slot's last copy
            # to the host (two tiles ago) is done; the device's work from here on waits for it
            self.backend.wait_for(self.returning[self._key(op)][self.lane])
            buf = slots[self.lane][:math.prod(shape)].reshape(shape)
            self.backend.clear(buf)
            self.buffers[self._key(op)] = buf
            self.regions[self._key(op)] = region
            return
        if slots is not None:  # a double-buffered global loop's own buffer: its slot, held since loop entry
            buf = slots[self.turn].view(shape)
            if zero:
                hostcopy.fill(buf.local(), 0)
            self.buffers[self._key(op)] = buf
            self.regions[self._key(op)] = region
            return
        buf = None
        if op.level == "global" and not zero and self.maps:
            # an input's tile that only its load fills: the file's own bytes, mapped (on every
            # rank or none: the others allocate a window collectively)
            buf = self.store.mapped(op.tensor, 0, region, self.comm.rank, self.comm.size)
            if self.comm.size > 1 and self.comm.allreduce(int(buf is None)) and buf is not None:
                buf.free()
                buf = None
            if buf is not None:
                self._lock(self._key(op), buf)
        if buf is None:
            with _naming(op):
                buf = (GlobalArray(self.comm, shape, dtype, zero=zero) if op.level == "global"
                       else (self.backend.zeros if zero else self.backend.empty)(shape, dtype))
            if op.level == "global" and not zero:
                self.fresh.add(self._key(op))
        if op.level == "global":
            # Allocation is collective anyway: sum the windows' real sizes over ranks here, so the
            # peak is that of the whole global array at one moment, as planned.
            nbytes = self.comm.allreduce(buf.nbytes_local)
        else:
            nbytes = buf.nbytes
        self.buffers[self._key(op)] = buf
        self.regions[self._key(op)] = region
        self.counters.hold(op.level, nbytes)

    def _free(self, op: Op) -> None:
        key = self._key(op)
        buf = self.buffers.pop(key)
        del self.regions[key]
        self.fresh.discard(key)
        if key in self.slots:
            return
        if op.level == "global":
            self.counters.hold("global", -self.comm.allreduce(buf.nbytes_local))
            self._free_global(key, buf)
        else:
            self.counters.hold("device", -buf.nbytes)

    def _own_rows(self, ga: GlobalArray | MappedArray, region) -> tuple:
        """This rank's rows of a global buffer, as a region of the whole tensor."""
        if not region:
            return region if ga.rows[1] > ga.rows[0] else None
        lo, hi = ga.rows
        if hi <= lo:
            return None
        return ((region[0][0] + lo, region[0][0] + hi),) + region[1:]

    def _read(self, op: Op, ga: GlobalArray | MappedArray, region) -> None:
        """Queue the read of this rank's rows of ``ga`` (the tile ``region`` of ``op``'s tensor)."""
        part = self._own_rows(ga, region)
        self.unsynced = True
        if part is not None:
            local = ga.local()
            self._fill(ga, self._key(op), op.tensor, op.version, part, local)
            self.counters.move(CATEGORY["load"], local.nbytes)

    def _load(self, op: Op) -> None:
        key = self._key(op)
        self._read(op, self.buffers[key], self.regions[key])
        self.counters.seconds["disk"] += self.disk.wait()
        self.buffers[key].local()

    def _store(self, op: Op) -> None:
        """Write this rank's rows; in a double-buffered loop without waiting (the slot is reused
        only after the job is done)."""
        key = self._key(op)
        ga = self.buffers[key]
        part = self._own_rows(ga, self.regions[key])
        if part is not None:
            local = ga.local()
            self.disk.submit(self.store.write, op.tensor, op.version, part, local)
            self.counters.move(CATEGORY["store"], local.nbytes)
        if not (self.behind and key in self.slots):
            self.counters.seconds["disk"] += self.disk.wait()

    def _find(self, tensor: str, indices, level: str) -> tuple:
        """The key of the live buffer holding ``tensor`` at ``level``: the one allocated under
        these index names, else the tensor's buffer under other names that covers this reference's
        device region (a renamed reference such as Z[i,j,k,b,c,a] to Z allocated as Z[i,j,k,a,b,c],
        or one sharing the buffer of an equal region; positions, not names, address it)."""
        key = (tensor, tuple(indices), level)
        if key in self.buffers:
            return key
        need = self._region("device", indices)
        return next(k for k in self.buffers if k[0] == tensor and k[2] == level
                    and all(o <= a and b <= e for (a, b), (o, e) in zip(need, self.regions[k])))

    def _relative(self, op: Op):
        """The device region of ``op`` as slices of the global buffer of the same tensor."""
        gkey = self._find(op.tensor, op.indices, "global")
        outer = self.regions[gkey]
        inner = self._region("device", op.indices)
        return self.buffers[gkey], tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))

    def _watch(self) -> None:
        """Record the device allocator's high-water mark (scratch included), where there is one."""
        held = self.backend.pool_bytes()
        if held is not None:
            self.high_water = max(self.high_water, held)

    def _waits_first(self, op: Op, aside: bool = False) -> bool:
        """Whether the executor waits for the device (:meth:`_settle`) before ``op``. Queued
        accumulates land before a get reads their global array, before any global-level
        statement (the planner puts accumulates in parallel loops, whose closing barrier lands
        them; this keeps other plans right too), and before one more would hold too much host
        memory. A get whose fetch would wait for the device anyway waits first, so that its
        seconds are its own (not one ``aside``: it waits at most for its slot's last reader,
        :meth:`_ahead`)."""
        if op.op == "get":
            if not aside and self._fetch_waits(op):
                return True
            ga = self.buffers[self._find(op.tensor, op.indices, "global")] if self.landing else None
            return any(x[0] is ga for x in self.landing)
        if op.op == "accumulate":
            return sum(x[2].nbytes for x in self.landing) > LANDING_BYTES
        return bool(self.landing) and op.level == "global"

    def _fetch_waits(self, op: Op) -> bool:
        """Whether the backend's fetch of ``op``'s tile waits for the work handed to it before
        (:meth:`Backend.fetch_waits`, asked with the rows the fetch reads)."""
        return self.backend.fetch_waits(self.buffers[self._key(op)], self._source(op)[1])

    def _get(self, op: Op, after=None) -> None:
        """Copy ``op``'s tile from its global buffer into its device buffer; with ``after`` (a
        backend stamp) on the second stream, once the work before it is done
        (:meth:`Backend.fetch_aside`)."""
        if not self.in_parallel and self.unsynced:
            # Every rank fetches the whole tile (a fused group's inputs, once per global tile):
            # all ranks' loads of its rows must have landed; one barrier serves all such gets.
            self._wait()
        buf = self.buffers[self._key(op)]
        read, view = self._source(op)
        if after is None:
            self.backend.fetch(buf, read, view)
        else:
            self.backend.fetch_aside(buf, read, after, view)
        self.counters.move(CATEGORY["get"], buf.nbytes)

    def _source(self, op: Op) -> tuple:
        """``op``'s tile in its global buffer as :meth:`Backend.fetch` reads it: ``read(rows,
        out)`` copies rows of it into ``out``, ``view(rows)`` is them in host memory where they
        lie there whole (else None)."""
        ga, sl = self._relative(op)

        def read(rows, out):
            ga.get(_within(sl, rows), out=out)

        def view(rows):
            return ga.at_hand(_within(sl, rows))

        return read, view

    def _accumulate(self, op: Op) -> None:
        """Queue the tile's copy to the host behind the statements that compute it, and add it
        to the global array once it has arrived: here if it already has (an earlier tile's), else
        when the executor next waits for the device (:meth:`_settle`), which it does before any
        global-level statement, barrier or checkpoint. Until 2026-11-24 every accumulate waited
        for the device: in (T) at o=40, v=400 that emptied its queue once per tile, 11,480 times.
        A result copied back aside (``Loop.back``) is copied on a stream of its own, so the
        device computes the next tile, into the other slot, during the copy."""
        ga, sl = self._relative(op)
        key = self._key(op)
        aside = key in self.returning
        host, token = self.backend.to_host_async(self.buffers[key], aside=aside)
        if aside:
            self.returning[key][self.lane] = token
        self.landing.append((ga, sl, host, token, self.weight, f"accumulate {op.tensor}", bool(op.fresh)))
        self.counters.move(CATEGORY["accumulate"], host.nbytes)
        while self.landing and self.backend.arrived(self.landing[0][3]):
            self._land()

    def _land(self) -> str:
        """Add the oldest queued accumulate's host copy (arrived) to its global array, or write
        it there where it is the only value that patch gets (``Op.fresh``: the planner found
        every tile accumulated once into a buffer nothing else writes); its statement's name."""
        ga, sl, host, _, weight, name, fresh = self.landing.popleft()
        if weight != 1:  # stands for the other permutations of a symmetric loop's tile tuple
            host = host * weight
        if not host.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d tile into 1-d)
            host = host.copy(order="C")
        (ga.put if fresh else ga.accumulate)(sl, host)
        return name

    def _view(self, tensor: str, indices) -> object:
        """The device buffer of ``tensor[indices]``, cut to the current device region: a fused
        intermediate's buffer spans more than the tile a contraction works on."""
        key = self._find(tensor, indices, "device")
        buf, outer = self.buffers[key], self.regions[key]
        inner = self._region("device", indices)
        if inner == outer:
            return buf
        return buf[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))]

    def _eval(self, op: Op) -> None:
        """Fill a computed tensor's device tile from its expression's inputs (already on the device)."""
        t = self.plan.tensors[op.tensor]
        tree = expr.parse(t.source["expr"])
        rename = dict(zip(t.indices, op.indices))
        arrays = {r: self._view(r.tensor, [rename[i] for i in r.indices]) for r in expr.refs(tree)}
        out = self._view(op.tensor, op.indices)
        self.backend.evaluate(tree, arrays, tuple(t.indices), out)
        self.counters.streamed += out.nbytes + sum(a.nbytes for a in arrays.values())

    def _fused(self, op: Op) -> None:
        """A fused statement (:mod:`chainexec.planner.inline`): its inlined intermediates are
        computed where they are read, from the buffers on the device; counted as the cost model
        does (the flops and statements of its contractions, its output twice and each distinct
        reference once)."""
        f = op.expression
        arrays = {r: self._view(r.tensor, r.indices) for r in f.leaves}
        out = self._view(op.tensor, op.indices)
        within = self._equal_tiles() if op.ordered else ()
        self.backend.fused(f, arrays, tuple(b - a for a, b in self._region("device", f.domain)), out,
                           ordering.dims(within, f.domain))
        self._watch()
        self._count([self.plan.contractions[k] for k in op.group], within)
        self.counters.streamed += 2 * out.nbytes + sum(a.nbytes for a in arrays.values())

    def _count(self, cs, within: tuple[tuple[str, ...], ...] = ()) -> None:
        """The statements and flops of contractions run on the current device tiles; ``within``:
        the groups of indices whose ordered elements alone are summed (:func:`chainexec.ordering.points`)."""
        self.counters.statements += len(cs)
        for c in cs:
            sizes = {i: b - a for i, (a, b) in zip(c.space(), self._region("device", c.space()))}
            self.counters.flops += (2 if c.b is not None else 1) * ordering.points(sizes, within)

    def _compute(self, run: list[Op]) -> None:
        """One contraction, or a run of terms into one buffer (:attr:`Op.run`): point-wise terms
        in one point-wise kernel, contractions in one sum kernel. A run with an
        :attr:`Op.schedule`, on a tile that permutations of its output's indices map onto
        themselves (:meth:`_orbits`): one term per orbit into ``out`` (zero: the planner marks
        only runs into a buffer allocated just before them), then ``out`` = Σ of its permuted
        views, in place; counted as the cost model prices it. A run that writes its buffer first
        (:attr:`Op.fresh`) is ``fresh`` to the backend."""
        cs = [self.plan.contractions[op.contraction] for op in run]
        out = self._view(cs[0].out, cs[0].out_indices)
        operands = [(self._view(c.a, c.a_indices), self._view(c.b, c.b_indices) if c.b is not None else None)
                    for c in cs]
        orbits = self._orbits(run) if run[0].schedule is not None else None
        if orbits is not None:
            terms, axes = orbits
            cs = [replace(cs[k], factor=cs[k].factor * scale) for k, scale in terms]
            operands = [operands[k] for k, _ in terms]
        fresh = bool(run[0].fresh)
        if cs[0].pairs:
            self.backend.gather(out, operands[0][0], *self._gather(cs[0]), cs[0].factor, fresh)
        elif len(cs) == 1:
            self.backend.contract(cs[0], out, *operands[0], fresh)
        elif cs[0].pointwise():
            self.backend.contract_terms(cs, out, operands, fresh)
        else:
            self.backend.contract_sum(cs, out, operands, fresh)
        # tile-sized reads and writes, the cost model's rule (cost._run_tails): the output read
        # and written once per term, once for a point-wise run
        moved = 2 * (1 if cs[0].pointwise() else len(cs)) * out.nbytes
        if orbits is not None:  # out read once more, and written where it is kept
            keep = self._equal_tiles() if run[0].ordered else ()  # only ordered reductions read it
            self.backend.symmetrize(out, axes, ordering.dims(keep, cs[0].out_indices))
            moved += out.nbytes + out.itemsize * ordering.points(dict(zip(cs[0].out_indices, out.shape)), keep)
        self._watch()
        self._count(cs)
        self.counters.streamed += moved + sum(x.nbytes for pair in operands for x in pair if x is not None)

    def _gather(self, c) -> tuple:
        """How a pack or unpack (:attr:`Contraction.pairs`) gathers its output tile from its
        operand (:meth:`Backend.gather`'s arguments after the arrays): the order of the operand's
        axes that puts a pack's members side by side (None: as they are), the axis to take along,
        which positions to take (``("unpack", pair start, member ranges)``: each member pair's
        position in the pair index; ``("pack", pair range, member starts and extent)``: each
        pair's position in the two member axes merged), and the order of the result's axes that
        gives the output's (None: as they are). Made once per tile, from the current device
        ranges."""
        (pair, members), = c.pairs.items()
        ranges = tuple(self._range("device", i) for i in (pair, *members))
        key = (c.id, ranges)
        found = self.gathers.get(key)
        if found is None:
            (k0, k1), (r0, r1), (s0, s1) = ranges
            if pair in c.a_indices:  # unpack: the operand holds the pair whole
                axis = c.a_indices.index(pair)
                made = c.a_indices[:axis] + members + c.a_indices[axis + 1:]
                found = (None, axis, ("unpack", k0, r0, r1, s0, s1), _order(made, c.out_indices))
            else:  # pack: the operand holds the members whole
                axis = c.out_indices.index(pair)
                wanted = c.out_indices[:axis] + members + c.out_indices[axis + 1:]
                found = (_order(c.a_indices, wanted), axis, ("pack", k0, k1, r0, s0, s1), None)
            self.gathers[key] = found
        return found

    def _orbits(self, run: list[Op]) -> tuple | None:
        """The terms a symmetrized run runs on this tile (position, factor scale) and the axis
        permutations its output is summed over (:attr:`Op.schedule` of its first statement, at
        this tile's pattern), or None where this tile runs every term."""
        taken = run[0].schedule[pattern_key(self._pattern())]
        return None if taken is None else (taken[0], tuple(map(tuple, taken[1])))

    def _pattern(self) -> tuple[int, ...]:
        """The pattern of equal positions of the symmetric loop's tile tuple being run
        (:func:`chainexec.ordering.pattern_of`; ``()`` outside such a loop)."""
        return ordering.pattern_of([self._range("device", i)[0] for i in self.symmetric or []])

    def _equal_tiles(self) -> tuple[tuple[str, ...], ...]:
        """The symmetric indices that share a tile in the tuple being run, groups of two or more
        (:func:`chainexec.ordering.groups`)."""
        return ordering.groups(self.symmetric or [], self._pattern())


def _within(region: tuple[slice, ...], rows: slice | None) -> tuple[slice, ...]:
    """The part of ``region`` (step-1 slices with starts) at ``rows`` of its first axis, counted
    from the region's first row (None: all of it), as :meth:`Backend.fetch` names them."""
    if rows is None:
        return region
    return (slice(region[0].start + rows.start, region[0].start + rows.stop),) + region[1:]


def _order(have: list[str], want: list[str]) -> tuple[int, ...] | None:
    """The axes of an array over ``have`` in the order ``want`` (None where they are so)."""
    order = tuple(have.index(i) for i in want)
    return None if order == tuple(range(len(order))) else order


def _tuples(names: list[str], spans: list[list[tuple[int, int]]], symmetric: list[str]) -> tuple[list, list[int]]:
    """A loop's tile tuples (one (start, stop) per index of ``names``) in order, and each one's
    weight. Over ``symmetric`` indices only ordered tuples are kept (tile position of the first ≤
    the second ≤ …), each weighted by the number of distinct permutations of its positions; they
    come with the symmetric indices slowest, last first, so the largest position changes least
    often: in (T) the slice ``ovvv[k]`` whose relayout copy the backend keeps
    (:meth:`Backend.steady`) changes 40 times at o=40, not 11,480 (first index slowest, as before
    2026-11-24), and the tiles up to position p read only the input slices up to p."""
    if not symmetric:
        combos = list(itertools.product(*spans))
        return combos, [1] * len(combos)
    at = [names.index(i) for i in symmetric]
    slowest = at[::-1] + [n for n in range(len(names)) if n not in at]
    kept, weights = [], []
    for ordered in itertools.product(*(range(len(spans[n])) for n in slowest)):
        where = [0] * len(names)
        for n, p in zip(slowest, ordered):
            where[n] = p
        positions = [where[k] for k in at]
        if all(p <= q for p, q in zip(positions, positions[1:])):
            kept.append(tuple(s[p] for s, p in zip(spans, where)))
            weights.append(math.factorial(len(at)) // math.prod(math.factorial(positions.count(p))
                                                                 for p in set(positions)))
    return kept, weights


@contextlib.contextmanager
def _naming(op: Op):
    """An allocation's one-line error (memory the host lacks) prefixed with the buffer it was for."""
    try:
        yield
    except ChainexecError as err:
        raise ChainexecError(f"{op.tensor}[{','.join(op.indices)}] at the {op.level} level: {err}") from None


def _max():
    from mpi4py import MPI

    return MPI.MAX
