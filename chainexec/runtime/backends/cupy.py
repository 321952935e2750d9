"""The CuPy backend: one GPU per rank (:class:`CupyBackend`).

Buffers come from CuPy's memory pool, kept within the configured device memory; host→device
fetches go through page-locked staging buffers, the upload arena (:mod:`chainexec.runtime.arena`)
or straight from host memory locked where it lies (:mod:`chainexec.runtime.hostlock`); copies
back to the host are queued behind the statements that compute them. Statements that sum over
nothing, fused statements and symmetrizations run as generated point-wise kernels
(:mod:`chainexec.runtime.pointwise`); contractions by the fastest of the contraction methods
(:mod:`chainexec.runtime.backends.methods`), chosen by the autotuner
(:mod:`chainexec.runtime.backends.tuning`). The backend declares every optional capability of
:mod:`chainexec.runtime.device`.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from chainexec import expr
from chainexec.errors import ChainexecError
from chainexec.kernels import orbits
from chainexec.ordering import weights
from chainexec.planner.plan import Fused
from chainexec.planner.plan import Contraction
from chainexec.runtime import arena, hostcopy, hostlock, kernelcache, pointwise
from chainexec.runtime.backends import costmodel
from chainexec.runtime.backends.common import all_rows, spread
from chainexec.runtime.backends.methods import Methods
from chainexec.runtime.backends.tuning import METHODS, Autotuner, Choice, TuningCache
from chainexec.runtime.device import HOST_LOCKS, QUEUED, SEPARATE_MEMORY, STEADY, TUNED, Backend

DEFERRED_BYTES = 64 << 10
"""Largest device array that :meth:`CupyBackend.to_host_async` copies back in two steps when the
run's host buffers are plain memory: a copy on the device queued behind the work before it,
then, once that is done, the copy to the host on a stream of its own
(:meth:`CupyBackend._deliver`). A copy into plain memory on the current stream makes the host
wait for all the work queued before it, and page-locking
a small buffer mid-run waits for the device too (``cudaHostAlloc``). (T) copies its 8-byte
energy back once per tile: copied on the current stream, each such copy would leave the host
waiting while the device drains its queue, with nothing queued behind it."""
UPLOAD_BYTES = 256 << 20
"""Page-locked host bytes of copies to the device kept in flight (:meth:`CupyBackend.upload`)."""
SPARE_BYTES = 256 << 20
"""Host bytes of landed results' arrays kept for the next results (:meth:`CupyBackend.recycle_host`):
as many as the results queued on their way back hold (``chainexec.runtime.landing.LANDING_BYTES``),
so that a loop's tiles land in the arrays of the tiles before them."""
STAGE_BYTES = 64 << 20
"""Bytes of each of the two staging buffers that tiles reach the device through (host memory,
outside the plan's levels, kept for the backend's life). Rows the source holds in host memory
(its ``view``) go through them in pieces of this size whatever the rows' length; rows read
through ``read`` go a whole number of rows at a time, so a buffer is one row of the tile instead
where a row (first axis) is larger. A chunk's read goes over the copy threads in pieces of a few
MiB (:data:`STAGE_PIECE`, :meth:`chainexec.runtime.mapped.MappedArray.get`,
:meth:`chainexec.runtime.globalarray.GlobalArray.get`): 64 MiB keep a host's threads busy, where
an 8 MiB chunk leaves its read to two or four of them and the tile arrives at that read's rate;
the DMA of one chunk runs while the next is read."""
STAGE_PIECE = 4 << 20
"""Bytes each copy thread is given of a staging buffer's fill from rows in host memory: sixteen
threads share a 64 MiB buffer (:data:`chainexec.runtime.mapped.PIECE` for the same reason)."""


def _one_piece(dst) -> bool:
    """Whether :meth:`CupyBackend.fetch` fills the device tile ``dst`` in one piece (a tile of
    at most one staging chunk or one row, a 0-d one, or a strided view) rather than chunk by chunk."""
    row = dst.nbytes // dst.shape[0] if dst.ndim and dst.shape[0] else 0
    return not row or dst.nbytes <= max(row, STAGE_BYTES) or not dst.flags.c_contiguous


@lru_cache(maxsize=256)
def _c_code(tree, refs: tuple) -> str:
    """An expression's C code over the buffers ``refs`` as ``p0, p1, …``, made once per statement
    and process (a (T) run evaluates the same expressions on every tile)."""
    return expr.c_source(tree, {r: f"p{k}" for k, r in enumerate(refs)})


_KERNEL_LISTS = {pointwise.launch: pointwise.launch_kernels, pointwise.reduce: pointwise.reduce_kernels,
                 pointwise.orbit_reduce: pointwise.orbit_kernels}
"""Per point-wise launcher of :meth:`CupyBackend.fused`, the function that lists the kernel it runs."""


@lru_cache(maxsize=64)
def _weights(xp, shape: tuple[int, ...], within: tuple[tuple[int, ...], ...]):
    """:func:`chainexec.ordering.weights` on the device, made once per process, shape and
    pattern (a few per (T) run: 216 values for a tile of 6x6x6)."""
    return xp.asarray(weights(shape, within))


@dataclass(eq=False)  # found by identity in the pending list (no comparing device arrays)
class _Deferred:
    """A small copy to the host in two steps (:meth:`CupyBackend.to_host_async`): ``source`` a
    copy of the device array made on the current stream, done when ``ready`` (an event) is;
    ``host`` the plain host array it lands in (``source`` None once it has)."""

    source: object
    ready: object
    host: np.ndarray


class CupyBackend(Autotuner, Methods, Backend):
    """CuPy on the rank's GPU: buffers from CuPy's memory pool, device→host copies into pinned
    (page-locked) memory from CuPy's pinned pool, host→device DMA straight from pinned inputs,
    contractions by the fastest of the candidate methods (see the module docstring).

    Everything runs on the current (default) stream, but for :meth:`fetch_aside`'s copies, which
    the current stream waits for (an event), and :meth:`to_host_async`'s copies aside, which it
    waits for (:meth:`wait_for`) before it writes their slot again. The compute methods return
    once their kernels are queued (the host prepares the next statement while the device runs this one);
    the executor times them with CUDA events (:meth:`stamp`), so its per-level seconds are the
    device's time, and waits (:meth:`wait`) before anything it times on the host."""

    name = "cupy"
    capabilities = frozenset({QUEUED, SEPARATE_MEMORY, HOST_LOCKS, STEADY, TUNED})

    def __init__(self, cupy, method: str = "auto", margin: float = costmodel.MARGIN):
        if method not in METHODS:
            raise ChainexecError(f"unknown GPU contraction method {method!r} ({', '.join(METHODS)})")
        super().__init__(cupy)
        self.method = method
        self.margin = margin  # candidates predicted within this factor of the best are timed
        self.choices: dict[tuple, Choice] = {}
        self._kernels: dict[tuple, object] = {}
        self._sources: dict[tuple, tuple | None] = {}  # COGENT (config, name, source) by contraction and extents
        self._gett: dict[tuple, tuple] = {}
        self._splits: dict[tuple, list] = {}  # split-sum candidates by contraction, shapes and strides
        self._batches: dict[tuple, tuple | None] = {}
        self.workspace: int | None = None  # bytes beyond the plan's buffers; None: no limit
        self.table_bytes = 0  # device bytes of the GETT offset tables made so far (kept)
        self.memory: int | None = None  # the configured device memory (bytes); None: no limit
        self.tuning = TuningCache.for_device(cupy)
        self.classes: dict[str, list] = {}  # decided shapes per class (Autotuner._classmates)
        self.tuned_seconds = 0.0  # wall seconds spent timing candidates (:meth:`_timed`, outermost calls)
        self._compiled_before = kernelcache.compiled()[0]  # NVRTC seconds of the process's earlier runs
        self._timing = 0  # depth of :meth:`_timed` calls (a stack's timing runs its terms' own)
        self._stages: list[np.ndarray] | None = None
        self._uploads: collections.deque = collections.deque()  # (page-locked host array, its copy's event)
        self._spare: dict[int, list[np.ndarray]] = {}  # landed results' host arrays by bytes (recycle_host)
        self._spare_bytes = 0
        # relayout copies kept from one term of a run to the next: operand position -> (key, copy)
        # while a run executes (:meth:`_reusing`), else None
        self._kept: dict | None = None
        # inside :meth:`steady`: the steady arrays' memory spans, the relayout copies of their
        # views kept across statements (operand position -> (key, copy, source span)), and the
        # bytes set aside for those (None: no limit)
        self._steady: list[tuple[int, int]] | None = None
        self._held: dict = {}
        self._hold_room: int | None = None
        self._aside = None  # the stream of :meth:`fetch_aside`, made on first use
        self._back = None  # the stream of :meth:`to_host_async`'s copies aside, made on first use
        # (device array, the contiguous array copied, its aside copy's event)
        self._returning: collections.deque = collections.deque()
        self._deferred: list[_Deferred] = []  # small copies to the host not yet delivered
        self._small = None  # the stream that delivers them, made on first use
        self._pipes = None  # the two streams of a pipelined TTGT, made on first use
        self._stack_runs: dict[tuple, tuple] = {}  # run key -> (stacks, the terms left alone)
        self.pinned = True  # page-locked host buffers (expect_transfers decides for a run)
        self._locks: hostlock.Locks | None = None  # host memory locked in place (made by expect_transfers)

    def startup_seconds(self) -> dict[str, float]:
        return {"compile": kernelcache.compiled()[0] - self._compiled_before, "tune": self.tuned_seconds}

    def clear(self, array) -> None:
        """As :meth:`Backend.clear`: a memset, or the fill kernel for a view with gaps
        (:func:`chainexec.runtime.pointwise.fill`)."""
        pointwise.fill(self.xp, array, 0.0)

    def assign(self, out, x, factor: float = 1.0, add: bool = False) -> None:
        """As :meth:`Backend.assign`, by the shape-generic kernels a warm-up loads
        (:func:`chainexec.runtime.pointwise.assign`), not CuPy's, which a process compiles
        one by one on their first use."""
        pointwise.assign(self.xp, out, x, factor, add)

    def copy(self, array):
        """As :meth:`Backend.copy` (:func:`chainexec.runtime.pointwise.copy`)."""
        return pointwise.copy(self.xp, array)

    def gather(self, out, a, before, axis: int, positions: tuple, after, factor: float, fresh: bool) -> None:
        """As :meth:`Backend.gather`, by a kernel that computes each element's pair position
        (:func:`chainexec.runtime.pointwise.gather`): a table of positions would take as much
        device memory as the tile, in int64."""
        pointwise.gather(self.xp, out, a if before is None else a.transpose(before), axis, positions, after,
                         factor, not fresh)

    def reshaped(self, view, shape):
        """As :meth:`Backend.reshaped`, from a C-contiguous copy (:meth:`contiguous`: the
        point-wise copy, by the kernel of the view's shape where it is large,
        :data:`~chainexec.runtime.pointwise.SHAPED_BYTES`) of a view that is not one: CuPy
        would make its copies (in ``reshape`` and in ``matmul``) with element-wise kernels it
        compiles on first use."""
        return self.contiguous(view).reshape(shape)

    @property
    def out_of_memory(self) -> type[BaseException]:
        return self.xp.cuda.memory.OutOfMemoryError

    def upload(self, dst, host: np.ndarray) -> None:
        """Copy ``host`` into the device buffer ``dst``: one DMA when both are contiguous (from
        page-locked memory at the link's rate, from pageable memory through the driver's slower
        staging), else through a contiguous temporary. A copy from page-locked
        memory is queued on the current stream behind the work before it, and returns at once:
        ``host`` is kept until the copy is done (the pinned pool would otherwise hand its memory
        to another copy in flight), at most :data:`UPLOAD_BYTES` of them, beyond which the
        oldest are waited for. Why: a copy that waited for the device would empty the device's
        queue each time a (T) tile's small inputs are fetched between its contractions, while the
        host prepares the next statements."""
        if not (dst.flags.c_contiguous and host.flags.c_contiguous and dst.shape == host.shape):
            self.assign(dst, self.xp.asarray(host.copy(order="C")))
            return
        stream = self.xp.cuda.get_current_stream()
        dst.set(host, stream=stream)
        if not self._pinned(host):
            return
        self._uploads.append((host, stream.record()))
        held = sum(h.nbytes for h, _ in self._uploads)
        while self._uploads and (self._uploads[0][1].done or held > UPLOAD_BYTES):
            host, event = self._uploads.popleft()
            event.synchronize()
            held -= host.nbytes

    def fetch(self, dst, read, view=None) -> None:
        """As :meth:`Backend.fetch`. In a run of plain host memory (not :attr:`pinned`), rows that
        ``view`` finds in host memory go to a contiguous ``dst`` in one copy from there: the
        driver stages pageable memory itself, so a staging buffer of ours would only add a copy
        on one thread before the driver's. Where the
        warm-up made the page-locked arena (:mod:`chainexec.runtime.arena`), such rows go through
        it instead: copied into it over threads, then DMA'd without the host waiting. Rows in
        memory locked where it lies (:meth:`lock_host`: an input's mapped tile) skip both: one
        DMA from there, queued at once. Otherwise through two staging buffers of :data:`STAGE_BYTES` each
        (:meth:`host_empty`: page-locked when :attr:`pinned`): rows that ``view`` finds in host
        memory in pieces of that size (:meth:`_fetch_pieces`), rows read through ``read`` a
        whole number of rows at a time, or one row each where a row is larger; the buffers are
        used in turn: while one chunk of rows is copied to the device
        (asynchronously from page-locked memory, on the current stream), the next is read into
        the other. A tile the size of one chunk or less, or of one row, is read and copied in one
        piece. Not a page-locked buffer the size of each tile: its allocation and the whole
        tile's read would come before any copy, where two small buffers overlap the reads with
        the copies."""
        stream = self.xp.cuda.get_current_stream()
        if dst.flags.c_contiguous:
            host, locked = self._at_hand(dst, view)
            if locked or (host is not None and not self.pinned):
                # one DMA where the rows lie in memory locked in place (:meth:`lock_host`), else
                # through the page-locked arena where the warm-up made one (queued once the host
                # rows are read into it), else from pageable memory, returning once the driver
                # has staged all of it
                if locked or not arena.upload(self.xp, dst, host, stream):
                    dst.set(host, stream=stream)
                return
            if host is not None and dst.nbytes > STAGE_BYTES:
                self._fetch_pieces(dst, host, stream)
                return
        if _one_piece(dst):
            host = self.host_empty(dst.shape, dst.dtype)
            read(all_rows(dst), host)
            self.upload(dst, host)
            return
        row = dst.nbytes // dst.shape[0]
        step = max(1, STAGE_BYTES // row)
        self._through_stages(stream, step * row, (
            (dst[lo:lo + step], lambda buf, lo=lo: read(slice(lo, lo + len(buf)), buf))
            for lo in range(0, dst.shape[0], step)))

    def _fetch_pieces(self, dst, host: np.ndarray, stream) -> None:
        """Fill the contiguous device tile ``dst`` from ``host``, the same rows C-contiguous in
        host memory, through the two staging buffers in pieces of :data:`STAGE_BYTES` whatever
        the rows' length, each piece copied into its buffer over the copy threads. A (T)
        ``ovvv`` row of v³ elements (512 MB at v = 400) read row by row would make each buffer
        a row long, page-locked when first needed and held for the backend's life, and would
        wait for each row's whole copy before reading the next but one."""
        src = host.reshape(-1).view(np.uint8)
        out = dst.reshape(-1).view(self.xp.uint8)
        self._through_stages(stream, min(STAGE_BYTES, src.nbytes), (
            (out[lo:lo + STAGE_BYTES], lambda buf, lo=lo: hostcopy.copy(buf, src[lo:lo + len(buf)], STAGE_PIECE))
            for lo in range(0, src.nbytes, STAGE_BYTES)))

    def _through_stages(self, stream, nbytes: int, parts) -> None:
        """Copy ``parts`` ((device array, fill) pairs, each array at most ``nbytes`` bytes) to the
        device through the two staging buffers (:meth:`_staging`) in turn: ``fill(buffer)`` writes
        a part into a host buffer of its array's shape and type, which is then copied to the
        device on ``stream`` (asynchronously from page-locked memory) while the next part is
        filled into the other buffer. Returns once the last copy is done."""
        stages = self._staging(nbytes)
        done = [None, None]
        for n, (target, fill) in enumerate(parts):
            if done[n % 2] is not None:
                done[n % 2].synchronize()  # the copy out of this staging buffer has finished
            buf = stages[n % 2][:target.nbytes].view(target.dtype).reshape(target.shape)
            fill(buf)
            target.set(buf, stream=stream)
            done[n % 2] = stream.record()
        stream.synchronize()

    def locks_host(self, writable: bool = False, named: bool = False) -> bool:
        """As :meth:`Backend.locks_host`: global arrays (``writable``) in a run of page-locked
        host buffers (:attr:`pinned`), whose transfers then skip the staging copies on the host;
        inputs' mapped tiles in a run of plain host memory, which does not hold tens of GB of
        page cache locked, and in a pinned run those the plan names (``named``: fetched so many
        times over that their gets' DMAs repay the lock, :attr:`Plan.locked`)."""
        return self._locks is not None and (writable == self.pinned or named and not writable)

    def lock_host(self, array: np.ndarray, writable: bool = False, named: bool = False) -> int | None:
        """As :meth:`Backend.lock_host`: registered with CUDA (:mod:`chainexec.runtime.hostlock`)
        where :meth:`locks_host` allows it."""
        return self._locks.lock(array, writable) if self.locks_host(writable, named) else None

    def unlock_host(self, handle: int, wait: bool = False) -> None:
        """As :meth:`Backend.unlock_host`: unregistered once the copies queued so far, on this
        stream and the two aside, are done; on a thread of its own (unregistering takes time in
        proportion to the size, which the run need not wait for) unless ``wait``."""
        after = [self.xp.cuda.get_current_stream().record()]
        after += [stream.record() for stream in (self._aside, self._back) if stream is not None]
        self._locks.unlock(handle, after, wait)

    def holds_host(self, host: np.ndarray, writable: bool = True) -> bool:
        return self._locks is not None and host.nbytes > 0 and self._locks.holds(host, writable=writable)

    def to_host_into(self, array, out: np.ndarray):
        """As :meth:`Backend.to_host_into`: one DMA queued on the current stream behind the work
        before it; the token is a CUDA event recorded after it."""
        main = self.xp.cuda.get_current_stream()
        self.contiguous(array).get(stream=main, out=out, blocking=False)
        return main.record()

    def settle_locks(self) -> None:
        if self._locks is not None:
            self._locks.settle()

    def fetch_aside(self, dst, read, after=None, view=None) -> None:
        """As :meth:`Backend.fetch_aside`: :meth:`fetch` on a second stream, which the current one
        then waits for (an event), so the copy engine fills ``dst`` while the kernels queued
        before run; the host waits at most for this copy itself (its staging buffers' turns, or
        :meth:`upload`'s limit on bytes in flight), not for those kernels, but where the
        second stream first waits for ``after`` (an event on the current stream) and the copy
        goes through the staging buffers. ``dst`` must have nothing pending on the device
        before ``after``, its allocation's zero fill included, or at all without ``after``: the
        executor fetches aside without it only inside a parallel loop, after waiting for the
        device at its start."""
        if self._aside is None:
            self._aside = self.xp.cuda.Stream(non_blocking=True)
        main = self.xp.cuda.get_current_stream()
        if after is not None:
            self._aside.wait_event(after)
        with self._aside:
            self.fetch(dst, read, view)
            done = self._aside.record()
        main.wait_event(done)

    def fetch_waits(self, dst, view=None) -> bool:
        """As :meth:`Backend.fetch_waits`: only a one-piece fetch from page-locked memory into a
        contiguous tile is queued, from the staging buffers of a run that page-locks them
        (:attr:`pinned`) or from host memory locked where it lies (:meth:`lock_host`, found
        through ``view``). One through the staging buffers refills each after its copy (queued
        behind everything before it), and a copy from plain memory returns once done or, through
        the page-locked arena, once read into it (its DMA queued; counted as waiting all the
        same: whether the arena takes a copy is known only at the copy)."""
        if not dst.flags.c_contiguous:
            return True
        if self._at_hand(dst, view)[1]:
            return False
        return not (self.pinned and _one_piece(dst))

    def _at_hand(self, dst, view) -> tuple[np.ndarray | None, bool]:
        """The host rows :meth:`fetch` copies into all of ``dst`` where ``view`` finds them in host
        memory (else None; ``view`` None: not looked for), and whether they lie in memory locked in
        place (:meth:`lock_host`), from where one DMA is queued without the host waiting."""
        host = None if view is None else view(all_rows(dst))
        return host, host is not None and self._locks is not None and self._locks.holds(host)

    def _staging(self, nbytes: int) -> list[np.ndarray]:
        """The two staging buffers of :meth:`fetch` (:meth:`host_empty`), at least ``nbytes`` (at
        most :data:`STAGE_BYTES` or one row of a tile) each, kept for the backend's life."""
        if self._stages is None or self._stages[0].nbytes < nbytes:
            self._stages = [self.host_empty(nbytes, np.uint8) for _ in range(2)]
        return self._stages

    def _pinned(self, host: np.ndarray) -> bool:
        """Whether ``host``'s memory is page-locked (allocated or registered through CUDA)."""
        if host.nbytes == 0:
            return False
        rt = self.xp.cuda.runtime
        return rt.pointerGetAttributes(host.ctypes.data).type == rt.memoryTypeHost

    def to_host_async(self, array, aside: bool = False) -> tuple[np.ndarray, object]:
        """As :meth:`Backend.to_host_async`: into a :meth:`host_empty` array on the current
        stream, or with ``aside`` on a third stream (the results' own: it waits for the work
        queued before on the current one, which goes on without waiting for it); the token is a
        CUDA event recorded after the copy. An aside copy's device array is kept until the copy
        is done or the current stream waits for it (:meth:`wait_for`): its memory returns to the
        pool only then. The call returns before the copy only into page-locked memory
        (:attr:`pinned`; a copy into plain memory waits for it), and a process's first call
        waits for the device (CuPy's first page-locked allocation does). A small array in a run
        of plain host memory is copied in two steps (:data:`DEFERRED_BYTES`); its token is a
        :class:`_Deferred`, whose host array is filled when :meth:`arrived` first finds its
        device copy done, or by :meth:`wait`."""
        main = self.xp.cuda.get_current_stream()
        if not aside and not self.pinned and array.nbytes <= DEFERRED_BYTES:
            copy = _Deferred(self.copy(array), main.record(), np.empty(array.shape, array.dtype))
            self._deferred.append(copy)
            return copy.host, copy
        host = self._result_host(array.shape, array.dtype)
        if not aside:
            self.contiguous(array).get(stream=main, out=host, blocking=False)
            return host, main.record()
        if self._back is None:
            self._back = self.xp.cuda.Stream(non_blocking=True)
        self._back.wait_event(main.record())
        with self._back:
            source = self.contiguous(array)
            source.get(stream=self._back, out=host, blocking=False)
            done = self._back.record()
        while self._returning and self._returning[0][-1].done:
            self._returning.popleft()
        self._returning.append((array, source, done))
        return host, done

    def wait_for(self, token) -> None:
        """As :meth:`Backend.wait_for`; the copied array is let go (work that reuses its memory
        is queued on the current stream, after the copy)."""
        if token is not None:
            self.xp.cuda.get_current_stream().wait_event(token)
            self._returning = collections.deque(x for x in self._returning if x[-1] is not token)

    def arrived(self, token) -> bool:
        if isinstance(token, _Deferred):
            if not token.ready.done:
                return False
            self._deliver(token)
            return True
        return token.done

    def reach_copy(self, token) -> None:
        if isinstance(token, _Deferred):
            token.ready.synchronize()
            self._deliver(token)
        else:
            token.synchronize()

    def _deliver(self, copy: _Deferred) -> None:
        """A deferred small copy's second step (:data:`DEFERRED_BYTES`), its device copy done:
        to the host on a stream of its own, which waits for nothing queued on the others."""
        if copy.source is None:
            return
        copy.ready.synchronize()  # done already where arrived() found it so; wait() may not have
        if self._small is None:
            self._small = self.xp.cuda.Stream(non_blocking=True)
        copy.source.get(stream=self._small, out=copy.host)
        copy.source = None
        self._deferred.remove(copy)

    def evaluate(self, tree, arrays: dict, order: tuple[str, ...], out) -> None:
        """As :meth:`Backend.evaluate`, in one element-wise kernel generated from the expression
        (:func:`chainexec.expr.c_source`) over broadcast views: no temporary arrays (evaluated
        operation by operation, a 6-D denominator made two more 6-D arrays than the plan has)."""
        code, views = self._expression(tree, arrays, order)
        pointwise.launch(self.xp, code, views, out)

    def fused(self, f: Fused, arrays: dict, shape: tuple[int, ...], out, within: tuple = ()) -> None:
        """As :meth:`Backend.fused`, in one generated kernel over broadcast views: a point-wise
        kernel adding to ``out``, or a reduction kernel (:func:`chainexec.runtime.pointwise.reduce`)
        whose last step adds its sum to the scalar ``out``. The inlined intermediates exist only in
        registers; reused ones (``f.lets``) in the shared memory of an orbit kernel
        (:func:`chainexec.runtime.pointwise.orbit_reduce`). ``within``'s weights are one more input
        the reduction multiplies by (made once per process and shape, outside the plan's device
        memory, as the orbit tables are); the orbit kernel skips the blocks where it is zero
        where it does not vary along the permuted dimensions."""
        launch, args = self._fused_call(f, arrays, shape, out, within, self.xp)
        launch(self.xp, *args)

    def fused_kernels(self, f: Fused, arrays: dict, shape: tuple[int, ...], out, within: tuple = ()) -> list:
        """As :meth:`Backend.fused_kernels`: the generated kernel :meth:`fused` launches, its
        views spread over NumPy's stand-ins."""
        launch, args = self._fused_call(f, arrays, shape, out, within, np)
        return _KERNEL_LISTS[launch](self.xp, *args)

    @staticmethod
    def _fused_call(f: Fused, arrays: dict, shape: tuple[int, ...], out, within: tuple, xp) -> tuple:
        """The point-wise function that runs fused statement ``f`` and its arguments after the
        array module, the views spread by ``xp`` (the device's, or NumPy over stand-ins)."""
        views = [expr.spread(arrays[r], r, f.domain, xp) for r in arrays]
        if f.lets:  # only full reductions reuse values (chainexec.planner.inline)
            codes, code, perms = orbits.orbit_codes(f, tuple(arrays))
        else:
            code = _c_code(f.tree, tuple(arrays))
        if not f.reduce:
            return pointwise.launch, (f"y + {code}", views, out)
        skip = None
        if within:
            code, skip = f"({code}) * p{len(views)}", len(views)
            views.append(_weights(xp, shape, within))
        if f.lets:
            return pointwise.orbit_reduce, (codes, code, perms, views, shape, out.dtype.name, out, skip)
        # no block structure: the weight is multiplied by, nothing skipped
        return pointwise.reduce, (code, views, shape, out)

    def _expression(self, tree, arrays: dict, order: tuple[str, ...]) -> tuple[str, list]:
        """An expression's C code over ``p0, p1, …`` and the matching views, broadcast over ``order``."""
        views = [expr.spread(arrays[r], r, order, self.xp) for r in arrays]
        return _c_code(tree, tuple(arrays)), views

    def pool_bytes(self) -> int:
        """Bytes CuPy's device memory pool holds now (live arrays and cached free blocks)."""
        return int(self.xp.get_default_memory_pool().total_bytes())

    def stamp(self):
        """A CUDA event recorded on the current stream: the point in its queue reached now."""
        event = self.xp.cuda.Event()
        event.record()
        return event

    def elapsed(self, start, end) -> float:
        end.synchronize()
        return self.xp.cuda.get_elapsed_time(start, end) / 1e3

    def reach(self, mark) -> None:
        mark.synchronize()

    def wait(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()
        if self._back is not None:
            self._back.synchronize()
        for copy in list(self._deferred):
            self._deliver(copy)
        self._uploads.clear()
        self._returning.clear()

    def _result_host(self, shape, dtype) -> np.ndarray:
        """A host array for :meth:`to_host_async`: one :meth:`recycle_host` kept, of the same
        bytes, else :meth:`host_empty`'s. Results land tile after tile in arrays of a few sizes,
        and a new plain array takes a page fault per page while the device copies into it, at a
        fraction of the link's rate."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        spare = self._spare.get(nbytes)
        if not spare:
            return self.host_empty(shape, dtype)
        self._spare_bytes -= nbytes
        return spare.pop().view(dtype).reshape(shape)

    def recycle_host(self, host: np.ndarray) -> None:
        """As :meth:`Backend.recycle_host`: in a run of plain host memory, kept for
        :meth:`_result_host` while the kept arrays hold at most :data:`SPARE_BYTES`. A pinned
        run's arrays go back to CuPy's pool of page-locked memory, which serves them again
        already paged in."""
        if (self.pinned or host.nbytes == 0 or not host.flags.c_contiguous
                or self._spare_bytes + host.nbytes > SPARE_BYTES):
            return
        self._spare.setdefault(host.nbytes, []).append(host.reshape(-1).view(np.uint8))
        self._spare_bytes += host.nbytes

    def host_empty(self, shape, dtype) -> np.ndarray:
        """A host array for copies to and from the device: page-locked from CuPy's pinned pool
        (DMA'd by :meth:`upload`) when :attr:`pinned`, else plain memory. Not through
        ``cupyx.empty_pinned``: a first run would wait for cupyx's import, which loads far more
        than this needs. ``shape`` is an extent or a tuple of extents, as for ``numpy.empty``."""
        if not self.pinned:
            return np.empty(shape, dtype)
        shape = tuple(shape) if np.iterable(shape) else (int(shape),)
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        return np.ndarray(shape, dtype, buffer=self.xp.cuda.alloc_pinned_memory(nbytes))

    def limit_memory(self, limit: int, planned: int) -> None:
        """As :meth:`Backend.limit_memory`: a method whose temporaries
        (:meth:`~chainexec.runtime.backends.methods.Method.workspace`) would not fit in the room left
        is not a candidate of the autotuner where one that needs none applies, probes are cut so
        that a probe's scratch output and temporaries fit too, and when the blocks CuPy's pool
        caches take it over ``limit`` after a contraction, they are given back: temporaries such as
        TTGT's would otherwise take the allocator's high-water mark over the limit."""
        self.workspace = max(0, limit - planned)
        self.memory = limit

    def make_room(self, nbytes: int) -> None:
        """Give CuPy's cached free blocks back before an allocation that could take the pool over
        the configured device memory: blocks freed by tiles of other shapes (edge tiles) do not
        fit the next buffer, and the pool would grow beside them past the plan's peak, though
        nearly every allocation is the plan's own buffers."""
        if self.memory is None:
            return
        pool = self.xp.get_default_memory_pool()
        if pool.total_bytes() + nbytes > self.memory and pool.free_bytes():
            pool.free_all_blocks()

    def expect_transfers(self, pinned: bool) -> None:
        """Use page-locked host buffers where the plan says so (:attr:`Plan.pinned`: the run moves
        at least :attr:`Machine.pinned_from_bytes` between host and device per rank), and then
        lock global arrays where they lie (:meth:`lock_host`); otherwise inputs' mapped tiles are
        locked instead. Locks are made from this thread's device."""
        self.pinned = pinned
        self._locks = hostlock.Locks(self.xp)
        self._spare, self._spare_bytes = {}, 0  # (another run's arrays may be the other kind of memory)

    def contract_terms(self, cs: list[Contraction], out, operands: list[tuple], fresh: bool = False) -> None:
        """As :meth:`Backend.contract_terms`, in one generated point-wise kernel
        (:mod:`chainexec.runtime.pointwise`) over broadcast views: ``out`` is read and written once
        for all the terms (twelve outer products accumulated into one (T) tile were twelve passes
        over it), only written where ``fresh``, and no temporary is made."""
        views, terms = [], []
        for c, (a, b) in zip(cs, operands):
            factors = [f"p{len(views) + k}" for k in range(1 if b is None else 2)]
            views += [spread(a, c.a_indices, c.out_indices)] + ([] if b is None else [spread(b, c.b_indices, c.out_indices)])
            terms.append(" * ".join([repr(float(c.factor))] + factors))
        pointwise.launch(self.xp, " + ".join(([] if fresh else ["y"]) + terms), views, out)

    def symmetrize(self, out, axes, keep: tuple = ()) -> None:
        """As :meth:`Backend.symmetrize`, in place in one generated kernel that takes each orbit
        of blocks through shared memory (:func:`chainexec.runtime.pointwise.symmetrize`): one
        read and one write of ``out`` (of its kept elements), where out of place (a scratch tile,
        then ``out += Σ`` its permuted views) it would read every permuted view and ``out`` and
        write ``out``: several times the memory traffic under six permutations."""
        pointwise.symmetrize(self.xp, out, axes, keep)

    def symmetrize_kernels(self, out, variants: list[tuple]) -> list:
        """As :meth:`Backend.symmetrize_kernels`: the generated kernel of each variant
        (:func:`chainexec.runtime.pointwise.symmetrize_kernels`)."""
        return [k for axes, keep in variants for k in pointwise.symmetrize_kernels(self.xp, out, axes, keep)]

    def precompile(self, kernels: list) -> None:
        """As :meth:`Backend.precompile`: compiled at once in threads
        (:func:`chainexec.runtime.pointwise.precompile`)."""
        pointwise.precompile(self.xp, kernels)
