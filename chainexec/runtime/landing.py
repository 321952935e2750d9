"""Results on their way back from the device: accumulates whose copies to the host are queued.

An ``accumulate`` queues its tile's copy to the host behind the statements that compute it and
adds it to the global array once it has arrived (:meth:`Landing.land`): at once if it already has
(an earlier tile's), else when the executor next waits for the device, which it does before any
global-level statement, barrier or checkpoint. So the device's queue does not empty once per
tile. A result copied back aside (``Loop.back``) is copied on a stream of its own, so the device
computes the next tile, into the other slot, during the copy.

A tile larger than :data:`LANDING_BYTES` that is not copied back aside goes back in parts of at
most :data:`PART_BYTES`, each landed once it has arrived while the next ones are copied: a
page-locked host array of the whole tile would cost the host more than the copy itself
(``cudaHostAlloc`` pins page by page, on one thread, many times slower than the copy), and
would hold host memory outside the plan's levels. A tile copied back aside stays whole: its loop computes the next tile
during the copy, which waiting for parts on the host would stop, and the page-locked arrays of
its two lanes return to CuPy's pool for the loop's next tiles.

A part that is the only value its patch gets (``Op.fresh``, weight one), whose patch lies in
this rank's block of a global array locked for the device (:meth:`Backend.holds_host`), is
copied straight into the global array (:meth:`Backend.to_host_into`): one DMA at the link's
rate, with no page-locked part to copy from on the host; landing it is waiting for it."""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass

import numpy as np

from chainexec.planner.plan import CATEGORY, Op, key, statement_name
from chainexec.runtime.accounting import OP_LEVEL, Counters
from chainexec.runtime.buffers import Buffers
from chainexec.runtime.device import Backend
from chainexec.runtime.frame import Frame

LANDING_BYTES = 256 << 20
"""Host bytes of queued accumulates above which the executor waits for the device before the
next accumulate: page-locked host memory outside the plan's levels."""
PART_BYTES = 64 << 20
"""Bytes of each part a tile larger than :data:`LANDING_BYTES`, not copied back aside, is copied
back in (at least one row of its last axis): with the queue's bound, four parts are on their way
while one lands. Smaller parts land a large tile slower (a wait and a landing call per part,
each too short to keep the host's threads busy); larger ones keep fewer parts in flight, so the
copy and the landing overlap less."""


@dataclass
class Result:
    """An accumulate whose copy to the host is queued: the global array and the patch of it
    (slices) it goes to, the host array the copy lands in, the backend's token for the copy, the
    weight it is multiplied by (the symmetric tile tuple's, :attr:`Frame.weight`), the
    statement's name (``accumulate T``), whether it is the only value the patch gets
    (``Op.fresh``: written, not added) and whether the copy lands in the global array itself
    (nothing left to write)."""

    ga: object
    patch: tuple[slice, ...]
    host: np.ndarray
    token: object
    weight: int
    name: str
    fresh: bool
    direct: bool = False


class Landing:
    """The queue of accumulates on their way to their global arrays, oldest first."""

    def __init__(self, backend: Backend, buffers: Buffers, counters: Counters):
        self.backend = backend
        self.buffers = buffers
        self.counters = counters
        self.queue: collections.deque[Result] = collections.deque()

    def accumulate(self, op: Op, frame: Frame) -> None:
        """Queue the copy of ``op``'s device tile (in ``frame``) to the host, and land the queued
        results that have arrived. A tile larger than :data:`LANDING_BYTES` not copied back
        aside (the device done with the work before it: :meth:`blocks`) is queued part by part
        (:func:`parts`), each landed once it has arrived while the queue holds more than
        :data:`LANDING_BYTES`."""
        ga, patch = self.buffers.relative(op, frame)
        k = key(op)
        aside = k in self.buffers.returning
        tile = self.buffers.arrays[k]
        name = statement_name("accumulate", op.tensor)
        for part in self._parts(tile, aside):
            piece, target = tile[part] if part else tile, within(patch, part)
            into = self._into(op, frame, ga, target, aside)
            if into is not None:
                host, token = into, self.backend.to_host_into(piece, into)
            else:
                host, token = self.backend.to_host_async(piece, aside=aside)
            self.queue.append(Result(ga, target, host, token, frame.weight, name, bool(op.fresh), into is not None))
            self.counters.move(CATEGORY["accumulate"], host.nbytes)
            while self.queue and self.held() > LANDING_BYTES:
                self.backend.reach_copy(self.queue[0].token)
                self.land()
            while self.queue and self.backend.arrived(self.queue[0].token):
                self.land()
        if aside:
            self.buffers.returning[k][frame.lane] = token

    def straight(self, op: Op, frame: Frame) -> bool:
        """Whether :meth:`accumulate` copies every part of ``op``'s tile straight into its
        global array (:meth:`_into`), queuing nothing but those copies, with no earlier result
        queued that it would land on the host meanwhile."""
        k = key(op)
        if not op.fresh or frame.weight != 1 or k in self.buffers.returning or any(not r.direct for r in self.queue):
            return False  # (every accumulate asks: the (T) energy's, added per tile, answers here)
        ga, patch = self.buffers.relative(op, frame)
        tile = self.buffers.arrays[k]
        return all(self._into(op, frame, ga, within(patch, part), False) is not None for part in self._parts(tile, False))

    @staticmethod
    def _parts(tile, aside: bool) -> list[tuple[slice, ...]]:
        """The parts :meth:`accumulate` copies ``tile`` back in: whole where copied back aside or
        within :data:`LANDING_BYTES`, else :func:`parts` of :data:`PART_BYTES`."""
        if aside or tile.nbytes <= LANDING_BYTES:
            return [()]
        return parts(tile.shape, tile.dtype.itemsize, PART_BYTES)

    def _into(self, op: Op, frame: Frame, ga, target: tuple[slice, ...], aside: bool):
        """The patch ``target`` of global array ``ga`` as the host memory a part is copied
        straight into, or None: only for a part not copied back aside that is the only value
        of its patch (``Op.fresh``, weight one) and lies in memory locked for the device
        (:meth:`Backend.holds_host`)."""
        if aside or not op.fresh or frame.weight != 1:
            return None
        into = ga.at_hand(target)
        return into if into is not None and self.backend.holds_host(into) else None

    def held(self) -> int:
        """Bytes of host memory the queued results hold outside the global arrays (their
        page-locked copies; a copy into its global array holds none)."""
        return sum(r.host.nbytes for r in self.queue if not r.direct)

    def land(self) -> str:
        """Add the oldest queued result's host copy (arrived) to its global array, or write it
        there where it is the only value that patch gets (``Op.fresh``: the planner found every
        tile accumulated once into a buffer nothing else writes); its statement's name."""
        r = self.queue.popleft()
        if r.direct:
            return r.name
        host = r.host
        if r.weight != 1:  # stands for the other permutations of a symmetric loop's tile tuple
            host = host * r.weight
        if not host.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d tile into 1-d)
            host = host.copy(order="C")
        (r.ga.put if r.fresh else r.ga.accumulate)(r.patch, host)
        self.backend.recycle_host(r.host)  # (written into the global array: free for the next result)
        return r.name

    def land_all(self) -> None:
        """Land every queued result (the device is done with them all), each timed as its statement."""
        while self.queue:
            t0 = time.perf_counter()
            name = self.land()
            self.counters.spend(OP_LEVEL["accumulate"], name, time.perf_counter() - t0)

    def blocks(self, op: Op, frame: Frame) -> bool:
        """Whether the queued results land before ``op`` runs: before a get reads their global
        array, before any global-level statement (the planner puts accumulates in parallel loops,
        whose closing barrier lands them; this keeps other plans right too), before one more
        accumulate would hold more than :data:`LANDING_BYTES` of host memory, and before the
        accumulate of a tile larger than that neither copied back aside nor straight into its
        global array (:meth:`straight`; copied back in parts, whose waits for their copies are
        then the copies' own time)."""
        if op.op == "get":
            ga = self.buffers.arrays[self.buffers.find(op.tensor, op.indices, "global", frame)] if self.queue else None
            return any(r.ga is ga for r in self.queue)
        if op.op == "accumulate":
            k = key(op)
            tile = 0 if k in self.buffers.returning or self.straight(op, frame) else self.buffers.arrays[k].nbytes
            return max(self.held(), tile) > LANDING_BYTES
        return bool(self.queue) and op.level == "global"


def parts(shape: tuple[int, ...], itemsize: int, limit: int) -> list[tuple[slice, ...]]:
    """Index tuples (slices of the leading axes) that cut a C-contiguous array of ``shape`` into
    C-contiguous parts of at most ``limit`` bytes each, in order, or of one row of its last axis
    where that is larger; ``[()]`` (the whole array) where it fits in one."""
    if not shape or math.prod(shape) * itemsize <= limit:
        return [()]
    row = math.prod(shape[1:]) * itemsize
    if row <= limit or len(shape) == 1:
        step = max(1, limit // row)
        return [(slice(i, min(i + step, shape[0])),) for i in range(0, shape[0], step)]
    return [(slice(i, i + 1),) + inner for i in range(shape[0]) for inner in parts(shape[1:], itemsize, limit)]


def within(patch: tuple[slice, ...], part: tuple[slice, ...]) -> tuple[slice, ...]:
    """The slices of ``patch`` (of a global array) that a ``part`` of the tile it holds covers."""
    return tuple(slice(p.start + q.start, p.start + q.stop) for p, q in zip(patch, part)) + patch[len(part):]
