"""Inputs streamed into a symmetric tile loop (:func:`chainexec.planner.pipeline.streamed`).

Their loads are queued on the disk worker before the loop, in rows of one tile, position by
position, each input in turn (:meth:`Streams.start`); the loop copies each chunk to the device
when a tile first needs it (:meth:`Streams.arrive`), so that it starts after the first rows and
disk reads and copies run beside its tiles. On several ranks each rank reads its share of each
chunk (:meth:`Streams.share`) and publishes on a :class:`Board` how far it got; a rank copies a
chunk to its device once every rank with a share of it has read it (:meth:`Streams.ready`), so
that no rank waits for all inputs, read by all ranks, before its first tile. Rows that every
rank has copied and nothing reads after the loop are given back to the system while the loop
runs (:meth:`Streams.discard`)."""

from __future__ import annotations

import collections
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from chainexec.planner.plan import CATEGORY, Op, Plan, key, ops, statement_name
from chainexec.runtime.accounting import OP_LEVEL, Counters
from chainexec.runtime.buffers import Buffers, within
from chainexec.runtime.device import Backend
from chainexec.runtime.diskio import DiskWorker
from chainexec.runtime.globalarray import Board, GlobalArray
from chainexec.runtime.mapped import MappedArray

POLL_SECONDS = 0.0005
"""Pause between two reads of the board while a rank waits for another's streamed rows."""


@dataclass
class Chunk:
    """Rows ``[lo, hi)`` of a streamed input on their way to the device: the input, its slot on
    the boards, its global and device buffers' keys, and the disk job of this rank's last piece
    of them (None where this rank reads none)."""

    lo: int
    hi: int
    tensor: str
    slot: int
    gkey: tuple
    dkey: tuple
    job: int | None


@dataclass
class Read:
    """This rank's read of a streamed input up to row ``hi`` (its last piece: disk job ``job``),
    to publish on the board at ``slot`` once done; the input's global buffer key."""

    job: int
    slot: int
    hi: int
    gkey: tuple


@dataclass
class Drop:
    """A streamed input whose global rows nothing reads after the loop: its slot on the boards,
    its global buffer key, and this rank's first row not yet given back."""

    slot: int
    gkey: tuple
    done: int


@dataclass
class Piece:
    """Rows ``[first, end)`` of a streamed input that a rank reads from disk, owned by rank
    ``owner``; ``cut``: the range along the second axis it reads (None: all of it)."""

    owner: int
    first: int
    end: int
    cut: tuple[int, int] | None


class Streams:
    """The streamed inputs of the loop being run: chunks on their way to the device, and on
    several ranks the boards where ranks announce the rows they have read and copied."""

    def __init__(self, plan: Plan, comm, backend: Backend, disk: DiskWorker, buffers: Buffers,
                 counters: Counters):
        self.plan = plan
        self.comm = comm
        self.backend = backend
        self.disk = disk
        self.buffers = buffers
        self.counters = counters
        self.arriving: collections.deque[Chunk] = collections.deque()  # in the order the tiles need them
        # on several ranks: the board where ranks publish the rows of streamed inputs they have
        # read, and this rank's reads not yet published
        self.board: Board | None = None
        self.reading: collections.deque[Read] = collections.deque()
        # on several ranks, the streamed inputs whose global rows nothing reads after the loop:
        # a board where ranks publish how far they have copied each to their device, the inputs
        # by tensor, and the helper thread's jobs that give rows back
        self.copied: Board | None = None
        self.dropping: dict[str, Drop] = {}
        self.discarder: ThreadPoolExecutor | None = None
        self.discarding: list = []

    @property
    def active(self) -> bool:
        """Whether ranks are streaming inputs through the boards (several ranks, inside a streamed loop)."""
        return self.board is not None

    def start(self, skipped: list[Op], rows: dict[str, int], after: list) -> None:
        """Queue the loads of the streamed inputs (``rows``: rows per chunk of each), whose loads
        and gets the nest's opening statements ``skipped``, in chunks; ``after``: the nest's
        statements after the loop. Both the loads and the gets are counted here, before the loop,
        as the whole load and get they stand for (a resumed loop's counts must not hold them: it
        streams them again); every rank gets all rows, each loads its share."""
        loads = {op.tensor: op for op in skipped if op.op == "load"}
        gets = {op.tensor: op for op in skipped if op.op == "get"}
        extent = {t: self.plan.tensors[t].shape[0] for t in rows}
        slots = {t: n for n, t in enumerate(rows)}
        if self.comm.size > 1:
            self.board = Board(self.comm, len(rows))
            later = {}  # after the loop, the first statement naming each tensor (a device copy's free aside)
            for op, _ in ops(after):
                if op.tensor is not None and not (op.op == "free" and op.level == "device"):
                    later.setdefault(op.tensor, op)
            self.dropping = {t: Drop(slots[t], key(loads[t]), 0) for t in rows
                             if self.buffers.arrays[key(loads[t])].gives_back and t in later
                             and later[t].op == "free" and key(later[t]) == key(loads[t])}
            if self.dropping:  # the same on every rank: the same plan, one host for all or none
                self.copied = Board(self.comm, len(rows))
        for lo in range(0, max(extent.values()), min(rows.values())):
            for t, step in rows.items():
                if lo % step or lo >= extent[t]:
                    continue
                hi = min(lo + step, extent[t])
                gkey, dkey = key(loads[t]), key(gets[t])
                ga, region = self.buffers.arrays[gkey], self.buffers.regions[gkey]
                job = None
                for p in self.share(ga, lo, hi, self.comm.rank):
                    start = ga.rows_of(p.owner)[0]
                    out = ga.block(p.owner)[p.first - start:p.end - start]
                    part = ((region[0][0] + p.first, region[0][0] + p.end),) + region[1:]
                    if p.cut is not None:
                        out = out[:, p.cut[0]:p.cut[1]]
                        part = part[:1] + ((region[1][0] + p.cut[0], region[1][0] + p.cut[1]),) + part[2:]
                    job = self.buffers.fill(ga, gkey, t, loads[t].version, part, out)
                    self.counters.move(CATEGORY["load"], out.nbytes)
                if job is not None and self.board is not None:
                    self.reading.append(Read(job, slots[t], hi, gkey))
                self.counters.move(CATEGORY["get"], self.buffers.arrays[dkey][lo:hi].nbytes)
                self.arriving.append(Chunk(lo, hi, t, slots[t], gkey, dkey, job))

    def share(self, ga: GlobalArray | MappedArray, lo: int, hi: int, rank: int) -> list[Piece]:
        """The pieces of rows ``[lo, hi)`` of a streamed input that ``rank`` reads from disk. In
        shared memory (ranks of one host) each row is cut along its second axis over all ranks,
        so that every rank (with a non-empty cut) reads a part of every chunk, in the order the
        tiles need them, and no rank waits long for another's reads of the first rows; otherwise
        a rank reads the rows it owns. Each piece is contiguous in ``ga``'s block."""
        size = self.comm.size
        if math.prod(ga.shape) == 0:
            return []
        if ga.shared and len(ga.shape) > 1:
            cut = (rank * ga.shape[1] // size, (rank + 1) * ga.shape[1] // size)
            if cut[0] == cut[1]:
                return []
            return [Piece(next(r for r, _ in ga.owners((slice(row, row + 1),))), row, row + 1, cut)
                    for row in range(lo, hi)]
        return [Piece(r, first, end, None) for r, (first, end) in ga.owners((slice(lo, hi),)) if r == rank]

    def arrive(self, need: int | None = None) -> None:
        """Copy to the device every streamed chunk that starts below row ``need`` (all, by
        default), once its rows are read (by the disk worker; on several ranks by every rank with
        a share of them, :meth:`ready`): beside the work queued before
        (:meth:`Backend.fetch_aside`), the work queued after waiting for it."""
        if self.board is not None:
            self.publish()
        while self.arriving and (need is None or self.arriving[0].lo < need):
            c = self.arriving.popleft()
            if c.job is not None:
                self.counters.spend_disk(self.disk.wait(c.job))
            ga, dst = self.buffers.arrays[c.gkey], self.buffers.arrays[c.dkey][c.lo:c.hi]
            if self.board is not None:
                self.ready(ga, c.slot, c.lo, c.hi)
            chunk = (slice(c.lo, c.hi),) + tuple(slice(None) for _ in dst.shape[1:])
            t0 = time.perf_counter()
            self.backend.fetch_aside(dst, lambda rows, out: ga.get(within(chunk, rows), out=out),
                                     view=lambda rows: ga.at_hand(within(chunk, rows)))
            self.counters.spend(OP_LEVEL["get"], statement_name("get", c.tensor), time.perf_counter() - t0)
            if self.copied is not None:  # the rows are in page-locked staging or on the device now
                self.copied.publish(c.slot, c.hi)

    def discard(self, last: bool = False) -> None:
        """Give back, on a helper thread, the pages of this rank's rows of the streamed inputs
        that every rank has copied to its device and nothing reads after the loop
        (:meth:`GlobalArray.discard`), so that most pages go while the device computes instead
        of when the windows are freed after the loop, where giving back a large window's pages
        would keep the ranks after their last tile. ``last``: after the loop, when every rank
        has copied every row: all of this rank's rows again, for the pages that straddled two
        earlier calls' rows."""
        for drop in self.dropping.values():
            ga = self.buffers.arrays[drop.gkey]
            first = ga.rows[0] if last else max(drop.done, ga.rows[0])
            if first >= ga.rows[1]:
                continue
            upto = ga.rows[1] if last else min(int(self.copied.read(drop.slot).min()), ga.rows[1])
            if upto > first:
                if self.discarder is None:
                    self.discarder = ThreadPoolExecutor(1, thread_name_prefix="chainexec-discard")
                self.discarding.append(self.discarder.submit(ga.discard, (first, upto)))
                drop.done = upto

    def done(self) -> None:
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

    def publish(self, everything: bool = False) -> None:
        """Publish on the board how far this rank has read its share of each streamed input
        (those the disk worker has finished, in order; ``everything``: after waiting for all of
        them, as a rank must before it meets the others, who may be waiting for its rows)."""
        latest = {}
        while self.reading and (everything or self.disk.finished(self.reading[0].job)):
            r = self.reading.popleft()
            if everything:
                self.counters.spend_disk(self.disk.wait(r.job))
            latest[r.slot] = (r.hi, r.gkey)
        for slot, (hi, gkey) in latest.items():
            self.buffers.arrays[gkey].local()  # the worker's stores into the window, synced before they are announced
            self.board.publish(slot, hi)

    def ready(self, ga: GlobalArray | MappedArray, slot: int, lo: int, hi: int) -> None:
        """Wait until every other rank with a share of rows ``[lo, hi)`` of a streamed input
        (:meth:`share`) has published that it read them, publishing this rank's own meanwhile
        (two ranks may wait for each other's rows); the wait is idle time."""
        self.publish()
        need = [rank for rank in range(self.comm.size) if rank != self.comm.rank and self.share(ga, lo, hi, rank)]
        t0 = time.perf_counter()
        while need:
            seen = self.board.read(slot)
            need = [rank for rank in need if seen[rank] < hi]
            if need:
                time.sleep(POLL_SECONDS)
                self.publish()
        self.counters.idle += time.perf_counter() - t0
