"""The live buffers of the global and device levels, by key (:func:`chainexec.planner.plan.key`).

Global buffers are :class:`GlobalArray` s (allocated collectively), except an input's tile that
only its load fills where its file holds it as the array, on one rank or ranks of one host
(:func:`chainexec.runtime.comm.host_comm`): a :class:`MappedArray` of the file on each rank
(:mod:`chainexec.runtime.mapped`), locked for the device on a thread of its own
(:meth:`Buffers.lock`); device buffers belong to the :class:`Backend`. A double-buffered loop's
own buffers live in slots allocated at loop entry and freed at its exit (:meth:`Buffers.stage`
for a global loop's, :meth:`Buffers.lanes` for a device loop's), which its statements take
in turn. Every allocation and free adds its bytes to the level's live bytes
(:meth:`Counters.hold`); a statement names a buffer by tensor and indices, and finds the one
that holds its tile (:meth:`Buffers.find`)."""

from __future__ import annotations

import contextlib
import math
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from chainexec.errors import ChainexecError
from chainexec.planner.plan import DEPTH, Loop, Op, Plan, key, ops, statement_name
from chainexec.runtime import hostcopy
from chainexec.runtime.accounting import Counters
from chainexec.runtime.device import Backend
from chainexec.runtime.diskio import DiskWorker
from chainexec.runtime.frame import Frame
from chainexec.runtime.globalarray import GlobalArray, shares_memory
from chainexec.runtime.mapped import MappedArray
from chainexec.runtime.region import box_shape
from chainexec.runtime.store import Store


def maps_inputs(comm) -> bool:
    """Whether the ranks of ``comm`` map inputs' tiles from their files: one rank, or ranks of one
    host, whose page cache holds the file's pages once for all of them (collective the first
    time for a communicator: :func:`chainexec.runtime.globalarray.shares_memory`)."""
    return comm.size == 1 or shares_memory(comm)


class Buffers:
    """The buffers live now, with their regions (per index, (start, stop) in elements of the
    whole tensor), and the slots of the double-buffered loops being run."""

    def __init__(self, plan: Plan, comm, backend: Backend, store: Store, disk: DiskWorker, counters: Counters):
        self.plan = plan
        self.comm = comm
        self.backend = backend
        self.store = store
        self.disk = disk
        self.counters = counters
        self.arrays: dict[tuple, object] = {}
        self.regions: dict[tuple, tuple] = {}
        # double-buffered loops being run: their slots per buffer key (global arrays; flat device buffers)
        self.slots: dict[tuple, list] = {}
        # a double-buffered device loop's results copied back aside (Loop.back): per buffer key,
        # each slot's last copy to the host (a backend token; None before the first)
        self.returning: dict[tuple, list] = {}
        # global buffers of allocs without zero fill (Op.fill) in fresh memory (not mapped from a file), live now
        self.fresh: set[tuple] = set()
        # global buffers being locked for the device (inputs' mapped tiles read-only, global
        # arrays writable), on a thread of their own from their allocation on: the futures of
        # their backend.lock_host handles, and whether each is writable (unlocked before it is freed)
        self.locking: dict[tuple, tuple[Future, bool]] = {}
        self.locker: ThreadPoolExecutor | None = None
        # inputs' tiles are mapped from their files on one rank and on ranks of one host, whose
        # page cache holds the file's pages once for all of them (:meth:`alloc`); on several
        # hosts each rank reads its rows into a global array, so that each row is read once
        self.maps = maps_inputs(comm)

    def alloc(self, op: Op, frame: Frame) -> None:
        """Allocate ``op``'s buffer at its tile in ``frame``: a double-buffered loop's slot where
        it has one, else new memory (zeroed unless ``Op.fill`` is False), an input's tile mapped
        from its file where the ranks can map it. A global array the backend locks
        (:meth:`lock`) is zeroed all the same: the fill touches its pages over threads, where
        the lock would fault them in on one thread, holding the process's address space for
        seconds against every other thread's allocations."""
        k = key(op)
        region = frame.region(op.level, op.indices)
        shape = box_shape(region)
        dtype = self.plan.tensors[op.tensor].dtype
        slots = self.slots.get(k)
        zero = op.fill is not False
        if slots is not None and op.level == "device":
            # a result copied back aside (Loop.back): its slot, zeroed once the slot's last copy
            # to the host (two tiles ago) is done; the device's work from here on waits for it
            self.backend.wait_for(self.returning[k][frame.lane])
            buf = slots[frame.lane][:math.prod(shape)].reshape(shape)
            self.backend.clear(buf)
            self.arrays[k], self.regions[k] = buf, region
            return
        if slots is not None:  # a double-buffered global loop's own buffer: its slot, held since loop entry
            buf = slots[frame.turn].view(shape)
            if zero:
                hostcopy.fill(buf.local(), 0)
            self.arrays[k], self.regions[k] = buf, region
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
                self.lock(k, buf.whole(), named=op.tensor in self.plan.locked)
        if buf is None:
            locked = op.level == "global" and self.backend.locks_host(writable=True)
            with _naming(op):
                buf = (GlobalArray(self.comm, shape, dtype, zero=zero or locked) if op.level == "global"
                       else (self.backend.zeros if zero else self.backend.empty)(shape, dtype))
            if op.level == "global" and not (zero or locked):
                self.fresh.add(k)
            if locked:
                self.lock(k, buf.local(), writable=True)
        if op.level == "global":
            # Allocation is collective anyway: sum the windows' real sizes over ranks here, so the
            # peak is that of the whole global array at one moment, as planned.
            nbytes = self.comm.allreduce(buf.nbytes_local)
        else:
            nbytes = buf.nbytes
        self.arrays[k], self.regions[k] = buf, region
        self.counters.hold(op.level, nbytes)

    def free(self, op: Op) -> None:
        """Let ``op``'s buffer go (a slot stays with its loop)."""
        k = key(op)
        buf = self.arrays.pop(k)
        del self.regions[k]
        self.fresh.discard(k)
        if k in self.slots:
            return
        if op.level == "global":
            self.counters.hold("global", -self.comm.allreduce(buf.nbytes_local))
            self.free_global(k, buf)
        else:
            self.counters.hold("device", -buf.nbytes)

    def stage(self, own: list[Op], depth: int, frame: Frame) -> None:
        """Allocate ``depth`` slots of each buffer a double-buffered global loop holds (``own``,
        :func:`chainexec.planner.plan.staged`), at its tile in ``frame`` (the loop's first tile, a
        full one). :meth:`unstage` frees them after the loop; where a run stops inside it,
        :meth:`release` does."""
        for op in own:
            shape = box_shape(frame.region("global", op.indices))
            with _naming(op):
                slots = [GlobalArray(self.comm, shape, self.plan.tensors[op.tensor].dtype, zero=False)
                         for _ in range(depth)]
            self.slots[key(op)] = slots
            self.counters.hold("global", depth * self.comm.allreduce(slots[0].nbytes_local))

    def unstage(self, own: list[Op]) -> None:
        """Free the slots :meth:`stage` allocated."""
        for op in own:
            for ga in self.slots.pop(key(op)):
                self.counters.hold("global", -self.comm.allreduce(ga.nbytes_local))
                ga.free()

    @contextlib.contextmanager
    def lanes(self, ahead: list[Op], back: list[Op], names: list[str], first: tuple, frame: Frame):
        """The device slots of a double-buffered device loop's fetched tiles (``ahead``,
        :func:`chainexec.planner.plan.fetched`) and results copied back (``back``, their
        ``alloc`` statements: :func:`~chainexec.planner.plan.returned`): per buffer,
        :data:`DEPTH` flat buffers of its full tile (``first``, the loop's first tile over
        ``names``, is a full one), held from loop entry to exit as the plan counts them."""
        at = frame.inner()
        at.ranges["device"].update(zip(names, first))
        slots, held = {}, 0
        for op in ahead + back:
            if op.op == "alloc":
                size = math.prod(b - a for a, b in at.region("device", op.indices))
                with _naming(op):
                    slots[key(op)] = [self.backend.zeros((size,), self.plan.tensors[op.tensor].dtype)
                                      for _ in range(DEPTH)]
                held += DEPTH * size * self.plan.tensors[op.tensor].itemsize
        self.slots.update(slots)
        self.returning.update({key(op): [None] * DEPTH for op in back})
        self.counters.hold("device", held)
        try:
            yield slots
        finally:
            for k in slots:
                del self.slots[k]
                for token in self.returning.pop(k, ()):
                    # the slots' memory goes back to the pool: work queued from here on may reuse it
                    self.backend.wait_for(token)
                self.arrays.pop(k, None)
                self.regions.pop(k, None)
            self.counters.hold("device", -held)

    def steady(self, loop: Loop) -> list:
        """The device buffers that ``loop``'s body only reads (no statement in it names their
        tensor, as output or buffer), for :meth:`Backend.steady`."""
        named = set()
        for op, _ in ops(loop.body):
            named.add(op.tensor)
            if op.contraction is not None:
                named.add(self.plan.contractions[op.contraction].out)
        return [buf for (tensor, _, level), buf in self.arrays.items() if level == "device" and tensor not in named]

    def find(self, tensor: str, indices, level: str, frame: Frame) -> tuple:
        """The key of the live buffer holding ``tensor`` at ``level``: the one allocated under
        these index names, else the tensor's buffer under other names that covers this reference's
        device region in ``frame`` (a renamed reference such as Z[i,j,k,b,c,a] to Z allocated as
        Z[i,j,k,a,b,c], or one sharing the buffer of an equal region; positions, not names,
        address it)."""
        k = (tensor, tuple(indices), level)
        if k in self.arrays:
            return k
        need = frame.region("device", indices)
        return next(k for k in self.arrays if k[0] == tensor and k[2] == level
                    and all(o <= a and b <= e for (a, b), (o, e) in zip(need, self.regions[k])))

    def relative(self, op: Op, frame: Frame) -> tuple:
        """The global buffer of ``op``'s tensor and ``op``'s device region in ``frame`` as slices of it."""
        gkey = self.find(op.tensor, op.indices, "global", frame)
        outer = self.regions[gkey]
        inner = frame.region("device", op.indices)
        return self.arrays[gkey], tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))

    def view(self, tensor: str, indices, frame: Frame) -> object:
        """The device buffer of ``tensor[indices]``, cut to the device region in ``frame``: a fused
        intermediate's buffer spans more than the tile a contraction works on."""
        k = self.find(tensor, indices, "device", frame)
        buf, outer = self.arrays[k], self.regions[k]
        inner = frame.region("device", indices)
        if inner == outer:
            return buf
        return buf[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))]

    def stand_in(self, tensor: str, indices, frame: Frame, live: Frame) -> np.ndarray:
        """What :meth:`view` of ``tensor[indices]`` is at the device tile of ``frame``, a tile of
        the loop being run at ``live`` (maybe not run yet), as a read-only NumPy array of its
        shape, strides and dtype over no memory of its own (never read): for listing the kernels
        that tile's statements launch. The buffer is the one :meth:`find` takes there, each live
        buffer at the region it has at that tile: a buffer made per tile (its region is the live
        tile's) at that tile's, contiguous as :meth:`alloc` makes it; any other where it is. (Where
        none would cover the tile, :meth:`find` fails there too: the last is taken.)"""
        need = frame.region("device", indices)
        exact = (tensor, tuple(indices), "device")
        for k in [exact] if exact in self.arrays else [k for k in self.arrays if k[0] == tensor and k[2] == "device"]:
            per_tile = self.regions[k] == live.region("device", k[1])
            region = frame.region("device", k[1]) if per_tile else self.regions[k]
            if k == exact or all(o <= a and b <= e for (a, b), (o, e) in zip(need, region)):
                break
        buf = self.arrays[k]
        made = box_shape(region)
        strides = (tuple(buf.itemsize * math.prod(made[d + 1:]) for d in range(len(made))) if per_tile
                   else buf.strides)
        return np.lib.stride_tricks.as_strided(np.zeros(1, buf.dtype), box_shape(need), strides,
                                               writeable=False)

    def source(self, op: Op, frame: Frame) -> tuple:
        """``op``'s tile in its global buffer as :meth:`Backend.fetch` reads it: ``read(rows,
        out)`` copies rows of it into ``out``, ``view(rows)`` is them in host memory where they
        lie there whole (else None)."""
        ga, sl = self.relative(op, frame)

        def read(rows, out):
            ga.get(within(sl, rows), out=out)

        def view(rows):
            return ga.at_hand(within(sl, rows))

        return read, view

    def locked(self, op: Op, frame: Frame) -> bool:
        """Whether ``op``'s get copies its tile from host memory the backend holds locked in a
        pinned run (a global array's block, or a mapped input the plan names, :meth:`lock`): one
        DMA queued on the device, which the executor times there."""
        if not self.backend.locks_host(writable=True):  # (every get asks: nothing to look up in most runs)
            return False
        host = self.source(op, frame)[1](None)
        return (host is not None and self.arrays[key(op)].flags.c_contiguous
                and self.backend.holds_host(host, writable=False))

    def fill(self, ga, k: tuple, tensor: str, version: int, part, out: np.ndarray) -> int:
        """Queue on the disk worker the load of ``part`` of ``tensor`` (``version``; a region
        of the whole tensor) into ``out``, a view of the global buffer ``ga`` (key ``k``): for a
        tile mapped from its file, its pages made resident (:meth:`MappedArray.populate`); else an
        HDF5 read, into memory faulted in first where the buffer is fresh (:meth:`read_fresh`).
        The worker's job number (a small one run at once: :data:`chainexec.runtime.diskio.INLINE_BYTES`)."""
        if isinstance(ga, MappedArray):
            return self.disk.submit(statement_name("load", tensor), ga.populate, out, nbytes=out.nbytes)
        return self.disk.submit(statement_name("load", tensor), self.read_fresh if k in self.fresh else self.store.read, tensor,
                                version, part, out, nbytes=out.nbytes)

    def read_fresh(self, tensor: str, version: int, part, out: np.ndarray) -> None:
        """Read ``part`` of ``tensor`` into ``out``, memory not touched since its allocation: its
        pages are faulted in first over threads (:func:`hostcopy.fill`), where this process may
        run more than one; the read's copy would fault them in on the disk worker alone.
        Contiguous inputs on one host are mapped instead (:mod:`chainexec.runtime.mapped`); this
        path serves ranks on several hosts and datasets that cannot be mapped."""
        if hostcopy.threads() > 1:
            hostcopy.fill(out, 0)
        self.store.read(tensor, version, part, out)

    def lock(self, k: tuple, memory: np.ndarray, writable: bool = False, named: bool = False) -> None:
        """Begin locking the host ``memory`` of global buffer ``k`` for the device
        (:meth:`Backend.lock_host`) on a thread of its own, where the backend locks that kind of
        memory: a mapped tile's file pages (read-only; ``named``: an input the plan names in
        :attr:`Plan.locked`), so that its gets become DMAs from them, or this rank's block of a
        global array (``writable``), so that its gets and the results written into it are DMAs
        (:mod:`chainexec.runtime.landing`). Nothing waits for it: a copy before it is done takes
        the backend's other path."""
        if not self.backend.locks_host(writable, named):
            return
        if self.locker is None:
            self.locker = ThreadPoolExecutor(1, thread_name_prefix="chainexec-lock")
        self.locking[k] = (self.locker.submit(self.backend.lock_host, memory, writable, named), writable)

    def unlock(self, k: tuple) -> None:
        """Unlock the global buffer ``k`` where :meth:`lock` locked it, once the lock is done
        (the unlock waits for the copies queued from and to it): a mapped tile beside the run
        (the mapping outlives it), a global array's block before returning (its window is freed
        next). A lock that failed left the buffer unlocked: its copies took the other path, and
        nothing is undone."""
        locking, writable = self.locking.pop(k, (None, False))
        handle = None if locking is None or locking.exception() is not None else locking.result()
        if handle is not None:
            self.backend.unlock_host(handle, wait=writable)

    def free_global(self, k: tuple, ga) -> None:
        """Let the global buffer ``k`` go, unlocked first (:meth:`unlock`)."""
        self.unlock(k)
        ga.free()

    def release(self) -> None:
        """Free every global buffer, slots included (collective: every rank stops at the same
        checkpoint), so that a stopped run ends as cleanly as a finished one."""
        for k, ga in [(k, b) for k, b in self.arrays.items() if k[2] == "global" and k not in self.slots]:
            self.free_global(k, ga)
        for slots in self.slots.values():  # a global loop's (a device loop's are gone with its lanes)
            for ga in slots:
                ga.free()

    def close(self) -> None:
        """After the run, finished or failed: nothing stays locked behind it. An unlock that
        fails (a device left in error by a failed run) is a warning, so that the others are
        still tried and a failed run's own error is the one raised."""
        for k in list(self.locking):
            try:
                self.unlock(k)
            except Exception as err:
                warnings.warn(f"chainexec: the host memory of {k[0]} stays page-locked ({err})", RuntimeWarning)
        if self.locker is not None:
            self.locker.shutdown()


def own_rows(ga: GlobalArray | MappedArray, region) -> tuple | None:
    """This rank's rows of a global buffer, as a region of the whole tensor (None: it has none)."""
    if not region:
        return region if ga.rows[1] > ga.rows[0] else None
    lo, hi = ga.rows
    if hi <= lo:
        return None
    return ((region[0][0] + lo, region[0][0] + hi),) + region[1:]


def within(region: tuple[slice, ...], rows: slice | None) -> tuple[slice, ...]:
    """The part of ``region`` (step-1 slices with starts) at ``rows`` of its first axis, counted
    from the region's first row (None: all of it), as :meth:`Backend.fetch` names them."""
    if rows is None:
        return region
    return (slice(region[0].start + rows.start, region[0].start + rows.stop),) + region[1:]


@contextlib.contextmanager
def _naming(op: Op):
    """An allocation's one-line error (memory the host lacks) prefixed with the buffer it was for."""
    try:
        yield
    except ChainexecError as err:
        raise ChainexecError(f"{op.tensor}[{','.join(op.indices)}] at the {op.level} level: {err}") from None
