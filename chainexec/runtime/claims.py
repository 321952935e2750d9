"""Which iterations of each loop this rank runs, and the checkpoints between them.

Iterations of a parallel loop are dealt to the ranks: through a shared counter (``dynamic``
balance, NWChem's nxtval: a rank takes the next tile when it is free) or round-robin
(``static``); a sequential loop's run on every rank in order. Where the plan allows
(:mod:`chainexec.planner.resume`) and the run keeps checkpoints
(:mod:`chainexec.runtime.checkpoint`), the ranks meet between two tiles of a resumable loop or
after a nest and commit one (:meth:`Claims.commit`); a resumed run takes back what the
checkpoint recorded (:meth:`Claims.restore`) and goes on from there."""

from __future__ import annotations

from typing import Callable

import numpy as np

from chainexec.errors import ChainexecError
from chainexec.planner.plan import Loop, Plan, ops, stores
from chainexec.runtime.accounting import Counters
from chainexec.runtime.buffers import Buffers
from chainexec.runtime.checkpoint import COUNTS, Checkpoint, Stopped, planned_with
from chainexec.runtime.comm import barrier
from chainexec.runtime.diskio import DiskWorker
from chainexec.runtime.frame import Frame
from chainexec.runtime.globalarray import TaskCounter
from chainexec.runtime.store import Store
from chainexec.runtime.streaming import Streams

FENCE = 1 << 48
"""Added to the task counter to stop every rank at a checkpoint (:meth:`TaskCounter.fence`): no
loop has that many tiles."""


class Claims:
    """The task counter of parallel loops (dynamic balance), where a resumed run goes on, and
    the checkpoints this run writes. ``settle`` waits for the device and lands the queued
    results (the executor's), as every rank must before it meets the others at a checkpoint."""

    def __init__(self, plan: Plan, comm, balance: str, checkpoint: Checkpoint | None, store: Store,
                 disk: DiskWorker, counters: Counters, buffers: Buffers, streams: Streams,
                 settle: Callable[[], None]):
        self.plan = plan
        self.comm = comm
        self.balance = balance
        self.checkpoint = checkpoint
        self.store = store
        self.disk = disk
        self.counters = counters
        self.buffers = buffers
        self.streams = streams
        self.settle = settle
        self.counter: TaskCounter | None = None
        # the counter's value where the next parallel loop's tiles begin, the same on every rank;
        # None after a resumable loop, whose fences leave it unknown (the next loop resets it)
        self.base: int | None = 0
        self.checkpoints = 0  # checkpoints written by this run
        # where a resumed run goes on: (nest, position of the loop, -1 at the nest's start)
        self.resume_at = (0, -1)
        # counts (all ranks: COUNTS of them) of the work a resumed run skips: the finished nests
        # and the finished store loops of the current one (:meth:`close`, :meth:`iterations`)
        self.bank = np.zeros(COUNTS, np.int64)
        # this rank's counts of the loads queued for a double-buffered loop's next iteration
        self.early = np.zeros(COUNTS, np.int64)

    def start(self) -> None:
        """Make the task counter (collective), with dynamic balance: it starts at 0."""
        if self.balance == "dynamic":
            self.counter = TaskCounter(self.comm)
            self.base = 0

    def free(self) -> None:
        """Free the task counter (collective)."""
        if self.counter is not None:
            self.counter.free()
            self.counter = None

    def skips(self, loop: Loop, where: tuple[int, int] | None) -> bool:
        """Whether a resumed run skips ``loop`` (at ``where``, the (nest, position) of a loop at
        the top of a nest): a store loop before the place it goes on from finished, its blocks
        are sealed and its counts banked."""
        return loop.resume == "store" and where is not None and where < self.resume_at

    def parallel(self, loop: Loop, where: tuple[int, int] | None, count: int, frame: Frame):
        """This rank's iterations of the parallel ``loop`` of ``count`` (at ``where``; entered
        in ``frame``), with checkpoints where it checkpoints (:meth:`resumable`)."""
        if self.checkpointed(loop, where):
            return self.resumable(loop, where, count, frame)
        if self.counter is not None and self.base is None:
            self.counter.reset()
            self.base = 0
        return self.claim(count)

    def claim(self, count: int):
        """This rank's iterations of a parallel loop of ``count``: from the shared counter as it
        frees up (dynamic), or every size-th one (static).

        The counter is not reset between loops (a reset is two barriers, thousands of them in a
        plan of small tiles): every rank takes tiles until its claim returns one past the last,
        so a loop moves the counter by its ``count`` plus one claim per rank, and every rank
        knows where the next loop's tiles begin. The barrier before each parallel loop
        (:meth:`chainexec.runtime.executor.Executor._wait`) keeps one loop's claims from
        mixing with the next's."""
        if self.counter is None:
            yield from range(self.comm.rank, count, self.comm.size)
            return
        base = self.base
        while (n := self.counter.next() - base) < count:
            yield n
        self.base = base + count + self.comm.size

    def checkpointed(self, loop: Loop, where: tuple[int, int] | None) -> bool:
        """Whether ``loop`` (at ``where``) checkpoints: a resumable loop (``Loop.resume``), not
        before the place a resumed run goes on from (rerunning those must not replace a
        checkpoint that is further on)."""
        return self.checkpoint is not None and loop.resume is not None and where is not None and where >= self.resume_at

    def saved(self, where: tuple[int, int], count: int) -> dict | None:
        """The manifest being resumed where it goes on inside the loop at ``where`` (of ``count``
        tiles), else None."""
        saved = self.checkpoint.saved
        if saved is None or (saved["nest"], saved["position"]) != tuple(where):
            return None
        if saved["tiles"] != count:
            raise ChainexecError(f"the checkpoint's loop has {saved['tiles']} tiles, this one {count}",
                                 str(self.checkpoint.folder))
        return saved

    def resumable(self, loop: Loop, where: tuple[int, int], count: int, frame: Frame):
        """This rank's iterations of an accumulate loop (:mod:`chainexec.planner.resume`), with
        checkpoints (:mod:`chainexec.runtime.checkpoint`).

        Resuming: the accumulation targets' rows come back from this rank's file and the counter
        starts after the tiles done (what they counted :meth:`restore` added). Checkpointing:
        when one is due, rank 0 fences the counter (:meth:`TaskCounter.fence`) at the first tile
        not handed out instead of taking it; every other rank's next claim then returns the
        fence, so all ranks meet between tiles, with every earlier tile finished and
        accumulated. There they write their rows, rank 0 commits the manifest (:meth:`commit`),
        and the counter goes back to the fence's position (or, with ``--stop-after`` due, every
        rank raises :class:`Stopped`)."""
        ck = self.checkpoint
        targets = list(dict.fromkeys(self.buffers.find(op.tensor, op.indices, "global", frame)
                                     for op, _ in ops(loop.body) if op.op == "accumulate"))
        saved = self.saved(where, count)
        start, prior = 0, np.zeros(COUNTS, np.int64)
        if saved is not None:
            rows = [self.buffers.arrays[k].local() for k in targets]
            for mine, kept in zip(rows, ck.read_rank(self.comm.rank, saved["number"], rows)):
                mine[...] = kept
            start, prior = saved["done"], np.array(saved["counts"], np.int64)
        self.counter.reset(start)
        self.base = None  # its fences leave the counter where no rank can tell
        base = self.counters.counts()
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
            if self.streams.active:
                # a rank still in a tile may wait for this one's rows: all of them read first
                # (the loop's first checkpoints wait for this rank's whole share of the inputs)
                self.streams.publish(everything=True)
            done = self.comm.bcast(fenced, root=0)
            self.settle()  # lands this rank's queued accumulates
            barrier(self.comm)  # every tile before the fence has accumulated (and flushed)
            counts = prior + self.comm.allreduce(self.counters.counts() - base)
            if self.commit(where, done, count, counts, [self.buffers.arrays[k].local() for k in targets]):
                raise Stopped(done, count, ck.folder)
            self.counter.reset(done)
            taken = 0

    def iterations(self, loop: Loop, where: tuple[int, int] | None, count: int):
        """The iterations of a sequential loop of ``count``, in order. Of a store loop being
        checkpointed, those a resumed run has not finished, with a checkpoint between two where
        one is due (every rank meets there anyway: the iterations are collective): each rank's
        stores are durable (:meth:`commit` seals them), and the loop's counts so far, less the
        loads already queued for the next iteration (:attr:`early`, counted again when a
        resumed run queues them), are committed with the iterations finished. At its end the
        loop's counts go to the bank: a resumed run skips it."""
        if not self.checkpointed(loop, where):
            yield from range(count)
            return
        saved = self.saved(where, count)
        start = saved["done"] if saved else 0
        prior = np.array(saved["counts"] if saved else [0] * COUNTS, np.int64)
        base = self.counters.counts()
        for n in range(start, count):
            yield n
            if n + 1 < count and self.due():
                counts = prior + self.comm.allreduce(self.counters.counts() - base - self.early)
                if self.commit(where, n + 1, count, counts):
                    raise Stopped(n + 1, count, self.checkpoint.folder)
        self.bank = self.bank + prior + self.comm.allreduce(self.counters.counts() - base)

    def close(self, k: int) -> None:
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
        self.bank = self.comm.allreduce(self.counters.counts())
        last = k + 1 == len(self.plan.nests)
        if nest.checkpoint_after and (last or self.due()):
            if self.commit((k + 1, None), 0, 0, np.zeros(COUNTS, np.int64)) and not last:
                raise Stopped(k + 1, len(self.plan.nests), ck.folder, "nests")

    def due(self) -> bool:
        """Whether to checkpoint now: rank 0 decides (:meth:`Checkpoint.due`), every rank learns
        (collective)."""
        return self.comm.bcast(self.checkpoint.due() if self.comm.rank == 0 else None, root=0)

    def commit(self, at: tuple[int, int | None], done: int, tiles: int, counts: np.ndarray,
               rows: list[np.ndarray] | None = None) -> bool:
        """Collective: checkpoint number ``committed + 1``. Every rank makes its part durable (its
        stores finished and sealed, :meth:`Store.seal`; ``rows``, an accumulate loop's targets'
        rows, written), then rank 0 commits the manifest: the run goes on at ``at`` (nest, and
        the position of the loop with ``done`` of its ``tiles`` finished, which counted
        ``counts``; None: at the nest's start), with the closed versions, each rank's sealed
        blocks of the nest's versions, the identities of the shard files sealed (checked when
        the run resumes), the bank and the peaks. Afterwards the parts and
        versions it supersedes go. Whether every rank is to stop (``--stop-after``)."""
        ck = self.checkpoint
        number = (ck.committed or 0) + 1
        self.settle()
        self.counters.spend_disk(self.disk.wait())
        if rows is not None:
            ck.write_rank(self.comm.rank, number, rows)
        self.store.seal(number)
        writing = list(stores(self.plan.nests[at[0]].body).items()) if at[0] < len(self.plan.nests) else []
        blocks = self.comm.gather(self.store.open_blocks(writing), root=0)
        sealed = self.comm.gather(self.store.sealed_files, root=0)
        # the values that are not finite in every block the checkpoint names (rank 0's counts
        # hold those of the checkpoint it resumed, :meth:`restore`): the blocks' writers are gone
        # when a resumed run lands the outputs (Store.finish)
        outputs = sorted(self.store.nonfinite)
        nonfinite = self.comm.allreduce(np.array([self.store.nonfinite[t] for t in outputs], np.int64))
        self.store.sealed_files = {}
        peaks = self.counters.peaks()
        stop = False
        if self.comm.rank == 0:
            joined = {t: b for t, b in self.store.joined.items() if self.plan.tensors[t].role == "output"}
            ck.record_files(sealed)
            ck.commit({"nest": at[0], "position": at[1], "done": done, "tiles": tiles, "number": number,
                       "ranks": self.comm.size, "counts": counts.tolist(), "banked": self.bank.tolist(),
                       "peaks": peaks, "stored": self.store.last_version, "joined": joined,
                       "open": [[t, v, [mine[j] for mine in blocks]] for j, (t, v) in enumerate(writing)],
                       "files": ck.files, "planned_with": planned_with(self.plan),
                       "nonfinite": dict(zip(outputs, nonfinite.tolist()))})
            stop = ck.stopping()
        stop = self.comm.bcast(stop, root=0)
        ck.supersede(self.comm.rank, number)
        self.store.drop_superseded(writing)
        self.checkpoints += 1
        return stop

    def restore(self) -> int:
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
        self.counters.resumed = int(skipped[-1])
        if self.comm.rank == 0:
            self.counters.add(skipped)
            for tensor, count in saved.get("nonfinite", {}).items():
                self.store.nonfinite[tensor] += count  # written before the checkpoint: summed in Store.finish
        for level, peak in saved["peaks"].items():
            self.counters.peak[level] = max(self.counters.peak[level], peak)
        return saved["nest"]
