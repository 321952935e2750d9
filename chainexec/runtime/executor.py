"""Walks a Plan's loop nests on every rank, moves tiles between levels, and counts every byte.

The executor is the only interpreter of the plan (see :mod:`chainexec.planner.plan` for the region
rule and the statements). Statements outside parallel loops run on all ranks, each on its own rows
of the global buffer (loads read exactly those rows from disk; stores write them); iterations of a
parallel loop are dealt to ranks (:mod:`chainexec.runtime.claims`), with a barrier before (loads
visible) and after (accumulations complete). Each loop runs its body in a :class:`Frame` of its
own (:mod:`chainexec.runtime.frame`): the tiles it has reached, its weight and its slots' turn.

Disk reads and writes run on a background worker (:mod:`chainexec.runtime.diskio`). In a
double-buffered loop (:mod:`chainexec.planner.pipeline`) the loop's own global buffers live in two
slots allocated at loop entry; iteration n+1's loads are queued before iteration n runs and
iteration n's stores are queued without waiting, so the disk works while the device does. In a
double-buffered device loop (of one rank's tiles), tile n+1's input tiles are copied to the device
on a second stream while tile n computes (:meth:`Executor._ahead`). Inputs streamed into a
symmetric tile loop are read while it runs (:mod:`chainexec.runtime.streaming`). Anywhere else a
load or store waits for its job, as a plain call would.

The rest of the run's state lies with the executor's collaborators: the live buffers
(:mod:`chainexec.runtime.buffers`), the results on their way back from the device
(:mod:`chainexec.runtime.landing`), the compute statements (:mod:`chainexec.runtime.compute`),
and the counters the executor notifies of every transfer, allocation and timed statement
(:mod:`chainexec.runtime.accounting`), whose record sums the ranks.
"""

from __future__ import annotations

import math
import time

import numpy as np

from chainexec.errors import ChainexecError
from chainexec.planner.plan import (CATEGORY, DEPTH, Loop, Op, Plan, executed, fetched, key, prefetched, returned,
                                    staged, statement_name)
from chainexec.runtime.accounting import OP_LEVEL, Counters, process_seconds
from chainexec.runtime.buffers import Buffers, own_rows
from chainexec.runtime.checkpoint import COUNTS, Checkpoint, Stopped
from chainexec.runtime.claims import Claims
from chainexec.runtime.comm import barrier, hosts
from chainexec.runtime.compute import Compute
from chainexec.runtime.device import Backend
from chainexec.runtime.diskio import DiskWorker
from chainexec.runtime.frame import Frame, groups, shapes, tuples
from chainexec.runtime.landing import Landing
from chainexec.runtime.progress import Progress
from chainexec.runtime.region import box_shape
from chainexec.runtime.store import Store
from chainexec.runtime.streaming import Streams
from chainexec.runtime.watchdog import Watchdog

# Statements the backend may still be running when it returns: timed between backend stamps
# (CUDA events on a GPU) and added up later (Executor._settle), so the host prepares the next
# statement while the device runs this one. A get's copy to the device is queued behind them too
# (its host time is what it counts), but for a get or accumulate that only queues copies on the
# device (Executor._queues_copies), timed between stamps as well. Everything else the executor
# times waits for them.
QUEUED = ("compute", "eval", "fused")
PENDING = 1024
"""Queued statements' stamps held before the oldest half are read (waiting for them)."""


class Executor:
    """The interpreter of one plan on one rank; every rank makes one and runs it (collective)."""

    def __init__(self, plan: Plan, comm, backend: Backend, balance: str = "dynamic", progress: bool = False,
                 checkpoint: Checkpoint | None = None, watch: Watchdog | None = None):
        """``balance``: ``dynamic`` hands the iterations of each parallel loop out through a shared
        counter (NWChem's nxtval: a rank takes the next tile when it is free); ``static`` deals
        them round-robin. Either way every tile moves the same bytes, so the prediction holds.
        ``checkpoint``: save the progress of resumable loops and finished nests there, and resume
        from it (:class:`Claims`; needs dynamic balance). ``watch``: the rank's
        :class:`~chainexec.runtime.watchdog.Watchdog`, told of every statement finished and
        stopped once the nests are done (or stopped at a checkpoint)."""
        if balance not in ("dynamic", "static"):
            raise ValueError(f"balance must be dynamic or static, not {balance!r}")
        if checkpoint is not None and balance != "dynamic":
            raise ChainexecError("checkpoints need --balance dynamic")
        self.plan = plan
        self.comm = comm
        self.backend = backend
        self.progress = Progress(plan.parallel_tiles, len(plan.nests)) if progress and comm.rank == 0 else None
        self.show_progress = progress
        self.store = Store(plan, comm)
        self.counters = Counters(comm, backend)
        self.disk = DiskWorker()
        # the hosts the ranks are on (:func:`host_comm`; collective, and where a bad
        # CHAINEXEC_SIMULATE_HOSTS is refused on every rank before anything is read or written)
        self.hosts = hosts(comm)
        self.buffers = Buffers(plan, comm, backend, self.store, self.disk, self.counters)
        self.landing = Landing(backend, self.buffers, self.counters)
        self.compute = Compute(plan, backend, self.buffers, self.counters)
        self.streams = Streams(plan, comm, backend, self.disk, self.buffers, self.counters)
        self.claims = Claims(plan, comm, balance, checkpoint, self.store, self.disk, self.counters, self.buffers,
                             self.streams, self._settle)
        self.frame = Frame(plan.extents)  # the innermost loop's being run
        self.watch = watch or Watchdog(None, comm)
        self.unsynced = False  # loads since the last barrier (other ranks' rows may still be landing)
        backend.expect_transfers(plan.pinned)
        backend.limit_memory(plan.memory_limit["device"], plan.predicted["memory_peak"]["device"])

    @property
    def resumed(self) -> int:
        """Parallel tiles of the work a resumed run skips."""
        return self.counters.resumed

    @property
    def checkpoints(self) -> int:
        """Checkpoints written by this run."""
        return self.claims.checkpoints

    def run(self) -> dict:
        """Execute every nest; return the measured record (summed over ranks) on every rank."""
        start = time.perf_counter()
        self.counters.started = process_seconds()
        self.claims.start()
        try:
            for k in range(self.claims.restore(), len(self.plan.nests)):
                try:
                    self._body(self.plan.nests[k].body, k)
                    self._settle()
                    self.claims.close(k)
                except Stopped:
                    self.watch.stop()  # every rank is at the checkpoint: what is left is cleaning up
                    self.disk.close()  # no streamed read may still write into a window freed here
                    self.release()
                    raise
                if self.show_progress:
                    self.counters.report(k + 1, self.progress)
            # the nests are done: removing older versions and scratch may take long on one rank
            # while the others wait, with no statement finished
            self.watch.stop()
            self.store.drop_superseded()
        finally:
            self.disk.close()
            self.buffers.close()  # a failed run's: nothing stays locked behind it
        if self.progress is not None:
            self.progress.close()
        self.store.finish()
        self.claims.free()
        return self.counters.measured(time.perf_counter() - start)

    def release(self) -> None:
        """Free every global buffer and the task counter (collective: every rank stops at the
        same checkpoint, or fails alike), so that a stopped or failed run ends as cleanly as a
        finished one: MPI's transport warns at the process's end of each window left."""
        self.streams.done()  # no page given back after its window is freed
        self.buffers.release()
        self.claims.free()

    def rank_times(self, total: float) -> list[dict]:
        """Busy and idle seconds and tiles per rank (:meth:`Counters.rank_times`; collective)."""
        return self.counters.rank_times(total)

    # -- loop nest ---------------------------------------------------------------------------

    def _body(self, body, nest: int | None = None) -> None:
        """Run a loop body; ``nest`` is the nest's number where ``body`` is a whole nest."""
        k = 0
        if nest is not None:
            found = self.plan.nests[nest].streamed
            if found is not None:
                k = self._stream(body, found["loop"], found["rows"])
                self._loop(body[k], (nest, k))
                if self.streams.active:  # every rank is past the loop's closing barrier
                    self.streams.discard(last=True)
                    self.streams.done()
                k += 1
        while k < len(body):
            node = body[k]
            if isinstance(node, Loop):
                self._loop(node, None if nest is None else (nest, k))
                k += 1
                continue
            if self._held(node):
                k += 1
                continue
            if self._waits_first(node, self.frame):
                self._settle()
            queued = node.op in QUEUED or self._queues_copies(node)
            t0, idle0 = time.perf_counter(), self.counters.idle
            start = self.backend.stamp() if queued else None
            if node.op == "compute":
                run = body[k:k + node.run]
                self.compute.run(run, self.frame)
                k += len(run)
                name = statement_name("compute", group=[op.contraction for op in run])
            else:
                self._statement(node)
                k += 1
                name = statement_name(node.op, node.tensor, node.group)
            self.watch.beat(name)
            if queued:
                self.counters.queue(name, start, self.backend.stamp(), OP_LEVEL[node.op])
                if len(self.counters.pending) >= PENDING:
                    self._settle(PENDING // 2)
            elif node.op in OP_LEVEL:  # a get's barrier is idle time
                self.counters.spend(OP_LEVEL[node.op], name, time.perf_counter() - t0 - (self.counters.idle - idle0))

    def _held(self, op: Op) -> bool:
        """Whether ``op`` is skipped because its tile stays on the device across the group being
        run (``Loop.kept``): a kept tile's ``alloc`` and ``get`` past the group's first tile, its
        ``free`` before the group's last."""
        frame = self.frame
        if not frame.kept or op.op not in ("alloc", "get", "free") or key(op) not in frame.kept:
            return False
        return not frame.first if op.op != "free" else not frame.last

    def _queues_copies(self, op: Op) -> bool:
        """Whether all ``op`` does is queue copies on the device, whose seconds the device's
        stamps then measure: a get from host memory locked for the device
        (:meth:`Buffers.locked`), an accumulate copied straight into its locked global array
        (:meth:`Landing.straight`)."""
        if op.op == "get":  # (not where it waits at a barrier first: that wait is idle time, not the copy's)
            return (self.frame.parallel or not self.unsynced) and self.buffers.locked(op, self.frame)
        return op.op == "accumulate" and self.landing.straight(op, self.frame)

    def _statement(self, op: Op) -> None:
        """Run one statement other than a contraction in the current frame."""
        match op.op:
            case "alloc":
                self.buffers.alloc(op, self.frame)
            case "free":
                self.buffers.free(op)
            case "load":
                self._load(op)
            case "store":
                self._store(op)
            case "get":
                self._get(op, self.frame)
            case "accumulate":
                self.landing.accumulate(op, self.frame)
            case "eval":
                self.compute.eval(op, self.frame)
            case "fused":
                self.compute.fused(op, self.frame)
            case _:
                raise ChainexecError(f"the plan has a statement {op.op!r} the executor does not know")

    def _stream(self, body, at: int, rows: dict[str, int]) -> int:
        """Run a nest's opening statements (:func:`chainexec.planner.pipeline.streamed`), all but
        the streamed inputs' loads and gets, then queue those loads (:meth:`Streams.start`); the
        loop at ``body[at]`` copies them to the device as its tiles need them. The position of
        the loop in ``body``."""
        skipped = [op for op in body[:at] if op.op in ("load", "get") and op.tensor in rows]
        self._body([op for op in body[:at] if not any(op is x for x in skipped)])
        self.streams.start(skipped, rows, body[at + 1:])
        return at

    def _settle(self, count: int | None = None) -> None:
        """Wait for the queued statements (the first ``count`` of them, else all) and add their
        times; after it, host clocks measure the host's own work again. Waiting for all of them
        also lands every queued accumulate (:class:`Landing`)."""
        if count is None:
            self.backend.wait()
            count = len(self.counters.pending)
            self.landing.land_all()
        self.counters.read(count)

    def _loop(self, loop: Loop, where: tuple[int, int] | None = None) -> None:
        """Run ``loop`` in a frame of its own. ``where``: (nest, position) of a loop at the top of
        a nest; a store loop a resumed run has finished is skipped (:meth:`Claims.skips`)."""
        if self.claims.skips(loop, where):
            return
        outer = self.frame
        names = list(loop.tiles)
        spans = []
        for i in names:
            lo, hi = outer.range(loop.level, i)
            spans.append([(s, min(s + loop.tiles[i], hi)) for s in range(lo, hi, loop.tiles[i])])
        combos, weights = tuples(names, spans, loop.symmetric)
        if loop.depth > 1 and loop.level == "global":
            self.frame = outer.inner()
            self._double_buffered(loop, names, combos, weights, self.claims.iterations(loop, where, len(combos)))
            self.frame = outer
            return
        # what the loop hands out: its tiles, or the groups of them across which it keeps tiles
        units = groups(names, combos, loop.symmetric) if loop.kept else None
        count = len(combos) if units is None else len(units)
        if loop.parallel:
            self._wait()
            mine = self.claims.parallel(loop, where, count, outer)
        else:
            mine = self.claims.iterations(loop, where, count)
        self.frame = frame = outer.inner()
        frame.parallel += loop.parallel
        frame.kept = frozenset((tensor, tuple(indices), "device") for tensor, indices in loop.kept)
        ends = {n: (k == 0, k == len(unit) - 1) for unit in units or () for k, n in enumerate(unit)}
        tiles = mine if units is None else (n for u in mine for n in units[u])
        frame.shapes = shapes(names, combos) if loop.symmetric and loop.level == "device" else None
        if loop.symmetric:
            frame.symmetric = loop.symmetric
        stop = [names.index(i) for i in loop.symmetric]
        ahead, back = fetched(loop), returned(loop)
        body = executed(loop)
        with (self.backend.steady(self.buffers.steady(loop)),
              self.buffers.lanes(ahead, back, names, combos[0] if ahead or back else (), frame) as slots):
            for turn, n in enumerate(self._ahead(ahead, slots, names, combos, tiles, frame) if ahead else tiles):
                frame.lane = turn % DEPTH
                frame.first, frame.last = ends.get(n, (True, True))
                if self.streams.arriving and stop:
                    self.streams.arrive(max(combos[n][i][1] for i in stop))
                frame.ranges[loop.level].update(zip(names, combos[n]))
                frame.weight = outer.weight * weights[n]
                self._body(body)
                self.counters.tiles += loop.parallel
                if self.streams.dropping:
                    self.streams.discard()
        self.frame = outer
        if loop.parallel:
            self.streams.arrive()  # chunks no tile of this rank needed (a resumed loop's)
            self._wait()

    def _ahead(self, ahead: list[Op], slots: dict, names: list[str], combos: list[tuple], mine, frame: Frame):
        """The tiles of ``mine``, each with its fetched input tiles (``ahead``) already on their way
        to its slots: tile n+1 is taken (from the shared counter, :meth:`Claims.claim`), and its
        inputs' copies queued on a second stream (:meth:`Backend.fetch_aside`), once tile n's
        statements are queued, so the device copies them while it computes tile n. A slot's
        copies start once the tile before last, which read it, is done (the slots' zero fill
        for the first two); the device's work queued after the copies waits for them."""
        done = [self.backend.stamp()] * DEPTH  # where each slot's last reader ends in the device's queue
        for turn, n in enumerate(mine):
            slot = turn % DEPTH
            frame.ranges["device"].update(zip(names, combos[n]))
            for op in ahead:
                k = key(op)
                if op.op == "alloc":
                    region = frame.region("device", op.indices)
                    shape = box_shape(region)
                    self.buffers.arrays[k] = slots[k][slot][:math.prod(shape)].reshape(shape)
                    self.buffers.regions[k] = region
                    continue
                if self._waits_first(op, frame, aside=True):
                    self._settle()
                if self._fetch_waits(op, frame):
                    # a copy through staging buffers (or from plain memory) waits on the host for
                    # the slot's last reader too: waited for first, so the get's seconds are its own
                    self.backend.reach(done[slot])
                t0 = time.perf_counter()
                self._get(op, frame, after=done[slot])
                self.counters.spend(OP_LEVEL["get"], statement_name("get", op.tensor), time.perf_counter() - t0)
            yield n
            done[slot] = self.backend.stamp()

    def _double_buffered(self, loop: Loop, names: list[str], combos: list[tuple], weights: list[int], order) -> None:
        """A sequential global loop whose disk traffic overlaps its work (module docstring), over
        the iterations ``order`` gives (consecutive: :meth:`Claims.iterations`), in the current
        frame (the loop's). The loads counted for the next iteration while one runs are kept in
        :attr:`Claims.early`."""
        frame = self.frame
        own, ahead = staged(loop), prefetched(loop)
        rest = [node for node in loop.body if not any(node is op for op in ahead)]
        frame.ranges["global"].update(zip(names, combos[0]))  # the first tile is a full one
        self.buffers.stage(own, loop.depth, frame)
        frame.behind = True
        marks = {}
        outer = frame.weight
        for n in order:
            if n not in marks:  # the first iteration's loads
                marks[n] = self._prefetch(ahead, frame, names, combos, n, loop.depth)
            frame.ranges["global"].update(zip(names, combos[n]))
            # Everything queued up to this tile's loads: also the stores that last used its slots.
            upto, filled = marks.pop(n)
            self.counters.spend_disk(self.disk.wait(upto))
            for k, (buf, region) in filled.items():
                self.buffers.arrays[k], self.buffers.regions[k] = buf, region
                buf.local()  # synchronise the window with what the worker wrote
            if filled:  # this rank's loads of the tile have landed, the other ranks' only after a barrier
                self.unsynced = True
            if n + 1 < len(combos):
                before = self.counters.counts()
                marks[n + 1] = self._prefetch(ahead, frame, names, combos, n + 1, loop.depth)
                self.claims.early = self.counters.counts() - before
                frame.ranges["global"].update(zip(names, combos[n]))
            frame.turn = n % loop.depth
            frame.weight = outer * weights[n]
            self._body(rest)
        self.claims.early = np.zeros(COUNTS, np.int64)
        self.counters.spend_disk(self.disk.wait())
        self.buffers.unstage(own)

    def _prefetch(self, ahead: list[Op], frame: Frame, names: list[str], combos: list[tuple], n: int,
                  depth: int) -> tuple:
        """Queue tile n's loads into its slots; (the worker's job count after them, the buffers)."""
        frame.ranges["global"].update(zip(names, combos[n]))
        filled = {}
        for op in ahead:
            k = key(op)
            if op.op == "alloc":
                region = frame.region("global", op.indices)
                filled[k] = (self.buffers.slots[k][n % depth].view(box_shape(region)), region)
            else:
                self._read(op, *filled[k])
        return self.disk.submitted, filled

    def _wait(self) -> None:
        """Meet the other ranks at a barrier, once the device is done; the wait is idle time."""
        if self.streams.active and self.frame.parallel:
            # a barrier inside the streamed loop (a nested parallel loop's): another rank may be
            # waiting in Streams.ready for rows of this one (the loop's own closing barrier
            # follows Streams.arrive(), which has published them all)
            self.streams.publish(everything=True)
        self._settle()  # a rank's idle time at the barrier starts when its device is done
        t0 = time.perf_counter()
        self.unsynced = False
        barrier(self.comm)
        self.counters.idle += time.perf_counter() - t0

    # -- transfers ---------------------------------------------------------------------------

    def _read(self, op: Op, ga, region) -> None:
        """Queue the read of this rank's rows of ``ga`` (the tile ``region`` of ``op``'s tensor)."""
        part = own_rows(ga, region)
        self.unsynced = True
        if part is not None:
            local = ga.local()
            self.buffers.fill(ga, key(op), op.tensor, op.version, part, local)
            self.counters.move(CATEGORY["load"], local.nbytes)

    def _load(self, op: Op) -> None:
        k = key(op)
        self._read(op, self.buffers.arrays[k], self.buffers.regions[k])
        self.counters.spend_disk(self.disk.wait())
        self.buffers.arrays[k].local()

    def _store(self, op: Op) -> None:
        """Write this rank's rows; in a double-buffered loop without waiting (the slot is reused
        only after the job is done)."""
        k = key(op)
        ga = self.buffers.arrays[k]
        part = own_rows(ga, self.buffers.regions[k])
        if part is not None:
            local = ga.local()
            self.disk.submit(statement_name("store", op.tensor), self.store.write, op.tensor, op.version, part, local,
                             nbytes=local.nbytes)
            self.counters.move(CATEGORY["store"], local.nbytes)
        if not (self.frame.behind and k in self.buffers.slots):
            self.counters.spend_disk(self.disk.wait())

    def _waits_first(self, op: Op, frame: Frame, aside: bool = False) -> bool:
        """Whether the executor waits for the device (:meth:`_settle`) before ``op``: where queued
        accumulates land first (:meth:`Landing.blocks`), and before a get whose fetch would
        wait for the device anyway, so that its seconds are its own (not one ``aside``: it
        waits at most for its slot's last reader, :meth:`_ahead`)."""
        if op.op == "get" and not aside and self._fetch_waits(op, frame):
            return True
        return self.landing.blocks(op, frame)

    def _fetch_waits(self, op: Op, frame: Frame) -> bool:
        """Whether the backend's fetch of ``op``'s tile waits for the work handed to it before
        (:meth:`Backend.fetch_waits`, asked with the rows the fetch reads)."""
        return self.backend.fetch_waits(self.buffers.arrays[key(op)], self.buffers.source(op, frame)[1])

    def _get(self, op: Op, frame: Frame, after=None) -> None:
        """Copy ``op``'s tile from its global buffer into its device buffer; with ``after`` (a
        backend stamp) on the second stream, once the work before it is done
        (:meth:`Backend.fetch_aside`)."""
        if not frame.parallel and self.unsynced:
            # Every rank fetches the whole tile (a fused group's inputs, once per global tile):
            # all ranks' loads of its rows must have landed; one barrier serves all such gets.
            self._wait()
        buf = self.buffers.arrays[key(op)]
        read, view = self.buffers.source(op, frame)
        if after is None:
            self.backend.fetch(buf, read, view)
        else:
            self.backend.fetch_aside(buf, read, after, view)
        self.counters.move(CATEGORY["get"], buf.nbytes)
