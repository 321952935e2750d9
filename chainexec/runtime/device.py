"""The device level (γ) behind one seam: the backend interface, its capabilities, and the choice
of a backend.

Everything the executor does with device buffers goes through a :class:`Backend`: allocation,
host→device fetches, device→host copies, marks of "now" in the order the backend computes in,
and the compute statements (``contract`` and its runs, ``evaluate``, ``fused``, ``symmetrize``).
:func:`select` chooses one, once per run: NumPy on the CPU
(:class:`chainexec.runtime.backends.numpy.NumpyBackend`, device memory is host memory) or CuPy
on a GPU (:class:`chainexec.runtime.backends.cupy.CupyBackend`).

The methods every backend implements are abstract here. The others belong to optional
*capabilities*, which a backend declares in :attr:`Backend.capabilities` (:data:`CAPABILITIES`
names each one's methods); without one, a backend keeps this class's methods of it, which do
what a backend without it needs (a clock for marks, nothing to wait for, no memory to limit, no
host memory to lock). Code outside the backends asks a backend for a capability, never for its
name.
"""

from __future__ import annotations

import abc
import contextlib
import math
import os
import time

import numpy as np

from chainexec import packing
from chainexec.errors import ChainexecError
from chainexec.spec import format_size

QUEUED = "queued"
"""The compute methods return once their work is queued: :meth:`Backend.stamp` marks a point in
the device's queue, and the executor waits (:meth:`Backend.wait`) before it times anything on the
host. Copies may run beside computation (:meth:`Backend.fetch_aside`, ``to_host_async(aside)``)."""
SEPARATE_MEMORY = "separate memory"
"""Device memory is not host memory: fetches and copies back move bytes, host buffers may be
page-locked for them (:meth:`Backend.host_empty`), and the device's allocator holds a limit and a
high-water mark of its own."""
HOST_LOCKS = "host locks"
"""Host memory can be locked where it lies (an input mapped from its file, a global array), so
that copies to and from the device are DMAs from and to it directly."""
STEADY = "steady copies"
"""Copies the backend derives from a loop's read-only inputs are kept from statement to statement
(:meth:`Backend.steady`)."""
TUNED = "tuned"
"""The backend chooses how to contract by timing its methods; its decisions are in ``choices``,
the seconds its first uses cost in :meth:`Backend.startup_seconds`."""

CAPABILITIES = {
    QUEUED: ("stamp", "elapsed", "reach", "wait", "arrived", "reach_copy", "wait_for", "fetch_aside", "fetch_waits"),
    SEPARATE_MEMORY: ("out_of_memory", "host_empty", "recycle_host", "expect_transfers", "limit_memory", "pool_bytes",
                      "make_room"),
    HOST_LOCKS: ("locks_host", "lock_host", "unlock_host", "settle_locks", "holds_host", "to_host_into"),
    STEADY: ("steady",),
    TUNED: ("choices", "startup_seconds"),
}
"""The members a backend with each capability has of its own (``choices``: a dict of its
decisions); without it, it keeps :class:`Backend`'s."""

BACKENDS = ("auto", "numpy", "cupy")
"""Values of ``--backend``."""


GATHER_BLOCK = 1 << 22
"""Elements :meth:`Backend.gather` takes at once (at least one position's worth): its table of
positions and the values taken stay within a few tens of MiB."""


def _positions(positions: tuple, first: int, last: int):
    """The positions :meth:`Backend.gather` takes for the block ``[first, last)`` of its first
    coordinate (the members' rows of an unpack, the pairs of a pack), by the pair formula of
    :mod:`chainexec.packing`: an unpack's ``(last - first, s1 - s0)`` pair numbers, a pack's
    (rows, columns) of each pair's members in the two member axes."""
    if positions[0] == "unpack":
        _, k0, r0, r1, s0, s1 = positions
        return packing.pair_index(np.arange(r0 + first, r0 + last)[:, None], np.arange(s0, s1)[None, :]) - k0
    _, k0, k1, r0, s0, s1 = positions
    row, column = packing.pair_unindex(np.arange(k0 + first, k0 + last))
    return row - r0, column - s0


class Backend(abc.ABC):
    """The seam: what the executor asks of the device level. ``name`` is the backend's name (for
    reports), ``xp`` its array module, ``capabilities`` the optional capabilities it has."""

    name: str
    capabilities: frozenset[str] = frozenset()

    def __init__(self, xp):
        self.xp = xp

    # -- required ------------------------------------------------------------------------------

    def clear(self, array) -> None:
        """Set a device array to zeros, in the order the backend computes in (queued on a GPU)."""
        array.fill(0)

    def assign(self, out, x, factor: float = 1.0, add: bool = False) -> None:
        """``out[...] = factor·x``, or ``out += factor·x`` where ``add`` (``factor·x`` rounded
        first): the tile operations between views (stacked operands, products added into an
        output), in the order the backend computes in. ``x`` has ``out``'s number of dimensions,
        with ``out``'s extent or 1 (broadcast) in each, and may be ``out`` itself."""
        if add:
            out += x if factor == 1.0 else factor * x
        else:
            self.xp.multiply(x, factor, out=out)

    def reshaped(self, view, shape):
        """``view`` reshaped to ``shape`` (its axes merged in groups) for a GEMM: a view where
        the axes merge, else a copy (NumPy's ``reshape``)."""
        return view.reshape(shape)

    def copy(self, array):
        """A new C-contiguous device array holding ``array``'s values (a 0-d one stays 0-d), in
        the order the backend computes in."""
        return self.xp.array(array, order="C", copy=True)

    def contiguous(self, array):
        """``array`` where it is C-contiguous, else :meth:`copy` of it."""
        return array if array.flags.c_contiguous else self.copy(array)

    def zeros(self, shape, dtype):
        """A zero-filled device buffer of ``shape`` (elements) and ``dtype``; one clear error
        when the memory is not there (the plan's limit is above what the device has)."""
        return self._allocate(shape, dtype, self.xp.zeros)

    def empty(self, shape, dtype):
        """As :meth:`zeros`, with its contents left as the allocator hands them over: for a buffer
        whose first writer is told so (``fresh``, :meth:`contract`)."""
        return self._allocate(shape, dtype, self.xp.empty)

    def _allocate(self, shape, dtype, make):
        self.make_room(math.prod(shape) * np.dtype(dtype).itemsize)
        try:
            return make(shape, dtype=dtype)
        except self.out_of_memory:
            size = format_size(math.prod(shape) * np.dtype(dtype).itemsize)
            raise ChainexecError(f"device memory: could not allocate {size} ({self.name}); the device has less "
                                 "free memory than machine.device_memory plans for: lower it") from None

    @abc.abstractmethod
    def fetch(self, dst, read, view=None) -> None:
        """Fill the device buffer ``dst`` from a host source: ``read(rows, out)`` writes rows
        ``rows`` (a slice of ``dst``'s first axis; None for a 0-d buffer: all of it) into the
        C-contiguous host array ``out``; ``view(rows)``, where given, returns those rows as a
        C-contiguous array in host memory if the source holds them so, else None (a backend
        may copy from there instead of reading them into a buffer of its own). Every read is
        done before it returns, except from memory locked by :meth:`lock_host`, which the device
        may read until :meth:`unlock_host`."""

    @abc.abstractmethod
    def to_host_async(self, array, aside: bool = False) -> tuple[np.ndarray, object]:
        """A host copy of a device array queued behind the statements before it, and a token
        for :meth:`arrived`; the host array holds the data once the token has arrived, until the
        device array next changes. ``aside``: the work handed to the backend afterwards need not
        wait for the copy (a copy engine makes it while the device computes); the caller changes
        ``array`` only after :meth:`wait_for` the token."""

    @abc.abstractmethod
    def contract(self, c, out, a, b, fresh: bool = False) -> None:
        """``out += c.factor · a·b`` over the contraction's indices (``b`` None: permuted copy).

        ``out``, ``a`` and ``b`` may be strided views of larger buffers; only ``out``'s view is
        written. ``fresh``: ``out`` holds whatever its allocation left (:meth:`empty`) and is
        written as if it held zeros."""

    def contract_terms(self, cs: list, out, operands: list[tuple], fresh: bool = False) -> None:
        """``out += Σ_k cs[k].factor · a_k·b_k`` for point-wise contractions into one output
        (``operands[k]`` = ``(a_k, b_k)``, ``b_k`` may be None), none of which reads ``out``;
        ``fresh`` as in :meth:`contract`. Here term by term."""
        self.term_by_term(cs, out, operands, fresh)

    def contract_sum(self, cs: list, out, operands: list[tuple], fresh: bool = False) -> None:
        """``out += Σ_k cs[k].factor · a_k·b_k`` for contractions into one output, each summing over
        indices of both its operands, none of which reads ``out`` (the (T) ``W`` terms); ``fresh``
        as in :meth:`contract`. Here term by term."""
        self.term_by_term(cs, out, operands, fresh)

    def term_by_term(self, cs: list, out, operands: list[tuple], fresh: bool = False) -> None:
        """Each term by :meth:`contract`, the first one ``fresh`` where ``out`` is."""
        for n, (c, (a, b)) in enumerate(zip(cs, operands)):
            self.contract(c, out, a, b, fresh and n == 0)

    def gather(self, out, a, before, axis: int, positions: tuple, after, factor: float, fresh: bool) -> None:
        """``out (+)= factor · a`` taken along ``axis`` at ``positions``: a pair index unpacked
        into its members, or members packed into their pair (:mod:`chainexec.planner.packed`).
        ``a``'s axes are first put in the order ``before`` (None: as they are), the result's
        then in the order ``after``. ``positions``: ``("unpack", k0, r0, r1, s0, s1)`` takes, for
        the members' block ``[r0, r1) × [s0, s1)``, each pair ``pair(max, min) - k0``;
        ``("pack", k0, k1, r0, s0, s1)`` merges the two member axes (``s1 - s0`` the second's
        extent) and takes, for each pair ``k`` in ``[k0, k1)``, its members' place in them.
        ``fresh``: ``out`` holds nothing yet (written, not added to).

        Here the array library's indexing (``take`` along the pair axis; the member axes indexed
        by rows and columns together, in place: no merged copy of a permuted operand), at
        positions made for :data:`GATHER_BLOCK` elements at a time along the first coordinate
        taken, each block then written into its slice of ``out``: a table of the whole tile would
        take as much memory as the tile, and more for its temporaries, beside the plan's buffers."""
        if before is not None:
            a = a.transpose(before)
        pack = positions[0] == "pack"
        count, width = (positions[2] - positions[1], 1) if pack else (positions[3] - positions[2],
                                                                       positions[5] - positions[4])
        dim = axis if after is None else list(after).index(axis)  # out's axis of the first coordinate
        per = math.prod(a.shape[:axis] + a.shape[axis + (2 if pack else 1):])  # elements per position
        step = max(1, GATHER_BLOCK // max(1, width * per))
        for first in range(0, count, step):
            last = min(count, first + step)
            where = _positions(positions, first, last)
            taken = a[(slice(None),) * axis + where] if pack else self.xp.take(a, where, axis=axis)
            if after is not None:
                taken = taken.transpose(after)
            part = tuple(slice(first, last) if d == dim else slice(None) for d in range(out.ndim))
            self.assign(out[part], taken, factor, not fresh)

    @abc.abstractmethod
    def evaluate(self, tree, arrays: dict, order: tuple[str, ...], out) -> None:
        """Fill ``out`` (a computed tensor's tile over index order ``order``) with the expression
        ``tree`` of :mod:`chainexec.expr`; ``arrays[ref]``: each reference's tile over its own order."""

    @abc.abstractmethod
    def fused(self, f, arrays: dict, shape: tuple[int, ...], out, within: tuple = ()) -> None:
        """A fused statement (:class:`chainexec.planner.plan.Fused`): ``out += f``'s expression,
        summed over the whole index space when ``f.reduce``; ``arrays[ref]``: each reference's
        tile over its own order; ``shape``: the extents of ``f.domain`` here. ``within``: groups
        of dimensions of ``f.domain`` (a reduction's) over which only the ordered elements are
        summed, each weighted by its multiplicity (:func:`chainexec.ordering.weights`); every
        symmetric index of the loop is in one, a group of one ordering nothing."""

    @abc.abstractmethod
    def symmetrize(self, out, axes, keep: tuple = ()) -> None:
        """``out[...] = Σ out.transpose(p)`` over the axis permutations ``axes`` (a group, each
        mapping ``out``'s shape onto itself), every term read before ``out`` changes: a
        symmetrized run's last step (:mod:`chainexec.planner.symmetry`). ``keep``: groups of
        dimensions; only the elements whose coordinates are non-decreasing within each are
        written (:mod:`chainexec.planner.ordered`), the others keep their values."""

    def symmetrize_kernels(self, out, variants: list[tuple]) -> list:
        """The kernels :meth:`symmetrize` of an array laid out as ``out`` runs by each ``(axes,
        keep)`` of ``variants``, for :meth:`precompile`; ``out`` may be a stand-in of a tile not
        allocated yet (:meth:`chainexec.runtime.buffers.Buffers.stand_in`). None here: this
        backend generates no kernels."""
        return []

    def fused_kernels(self, f, arrays: dict, shape: tuple[int, ...], out, within: tuple = ()) -> list:
        """The kernels :meth:`fused` with these arguments runs, for :meth:`precompile` (the arrays
        may be stand-ins, as in :meth:`symmetrize_kernels`). None here."""
        return []

    def precompile(self, kernels: list) -> None:
        """Make ``kernels`` (of :meth:`symmetrize_kernels` and :meth:`fused_kernels`) ready
        together: a backend that generates kernels compiles them at once, where the tiles that
        launch them would each wait for their own. Nothing here."""

    # -- QUEUED: without it, work is done when a call returns ------------------------------------

    def stamp(self):
        """A mark of "now" in the order the backend computes in, for :meth:`elapsed`. With
        :data:`QUEUED` the compute methods may return before their work is done, and marks taken
        around one measure its own time; here a clock reading."""
        return time.perf_counter()

    def elapsed(self, start, end) -> float:
        """Seconds between two :meth:`stamp` marks, once the later one is reached."""
        return end - start

    def reach(self, mark) -> None:
        """Return once the work handed to the backend before :meth:`stamp` returned ``mark`` is
        done (here: at once)."""

    def wait(self) -> None:
        """Return once all the work handed to the backend so far is done (here: at once)."""

    def arrived(self, token) -> bool:
        """Whether the copy :meth:`to_host_async` gave ``token`` for has reached the host."""
        return True

    def reach_copy(self, token) -> None:
        """Return once the copy :meth:`to_host_async` gave ``token`` for has reached the host
        (here: at once)."""

    def wait_for(self, token) -> None:
        """Let the work handed to the backend from now on start once the copy
        :meth:`to_host_async` gave ``token`` for (None: none) is done, without waiting on the
        host (here: done already)."""

    def fetch_aside(self, dst, read, after=None, view=None) -> None:
        """As :meth:`fetch`, beside the work handed to the backend before it, where the device
        can copy and compute at once; the work handed after it waits for it. ``after``: a
        :meth:`stamp` mark; the copy starts once the work handed to the backend before it is done
        (``dst``'s last reader). Every ``read`` is done before it returns, as in :meth:`fetch`:
        the host source may change or be given back afterwards, except memory locked by
        :meth:`lock_host`, which the device may read until :meth:`unlock_host`. Here:
        :meth:`fetch`."""
        self.fetch(dst, read, view)

    def fetch_waits(self, dst, view=None) -> bool:
        """Whether :meth:`fetch` into ``dst`` (from the host source ``view`` describes, as
        :meth:`fetch` takes it) waits for the work handed to the backend before it (then the
        executor waits first, so the fetch's seconds are its own; here nothing waits)."""
        return False

    # -- SEPARATE_MEMORY: without it, device memory is host memory --------------------------------

    @property
    def out_of_memory(self) -> type[BaseException]:
        """The exception this backend's allocator raises when memory runs out."""
        return MemoryError

    def host_empty(self, shape, dtype) -> np.ndarray:
        """A host array for copies to and from the device (here: plain memory)."""
        return np.empty(shape, dtype)

    def recycle_host(self, host: np.ndarray) -> None:
        """``host``, an array :meth:`to_host_async` returned, is no longer read: the backend may
        return it from a later :meth:`to_host_async` (here nothing: the result is the device
        array itself)."""

    def expect_transfers(self, pinned: bool) -> None:
        """Whether the run uses page-locked host buffers and locks its global arrays
        (:attr:`chainexec.planner.plan.Plan.pinned`, the plan's decision)."""

    def limit_memory(self, limit: int, planned: int) -> None:
        """The configured device memory and the plan's peak in it (bytes per rank): what is left
        is room for a contraction's temporaries (here host memory, whose temporaries the plan
        does not budget)."""

    def pool_bytes(self) -> int | None:
        """Bytes the device allocator holds now, scratch included (None: no separate device
        memory to watch)."""
        return None

    def make_room(self, nbytes: int) -> None:
        """Before a buffer of ``nbytes`` is allocated: whatever keeps the allocator within the
        configured memory (here nothing)."""

    # -- HOST_LOCKS: without it, nothing is locked ------------------------------------------------

    def locks_host(self, writable: bool = False, named: bool = False) -> bool:
        """Whether :meth:`lock_host` may lock anything of this kind in this run (``writable``:
        memory the device writes too, a global array; else memory it only reads, an input's
        mapped tile; ``named``: one the plan names, :attr:`Plan.locked`), so that a thread for
        it is worth starting."""
        return False

    def lock_host(self, array: np.ndarray, writable: bool = False, named: bool = False):
        """Page-lock the host ``array`` where it lies, so that :meth:`fetch` copies its rows to the
        device without staging them and, ``writable``, :meth:`to_host_into` copies results into
        it; callable from any thread (``named`` as in :meth:`locks_host`). A handle for
        :meth:`unlock_host`, or None where nothing was done. A read-only ``array`` must not
        change until it is unlocked."""
        return None

    def unlock_host(self, handle, wait: bool = False) -> None:
        """Undo :meth:`lock_host` (``handle``: what it returned, not None) once the copies handed
        to the backend so far are done: beside the run, the array let go at once, or with
        ``wait`` before returning, after which the caller may free the memory itself."""

    def holds_host(self, host: np.ndarray, writable: bool = True) -> bool:
        """Whether all of the host array ``host`` lies in memory :meth:`lock_host` locked
        (``writable``: locked writable, so that :meth:`to_host_into` may copy into it)."""
        return False

    def to_host_into(self, array, out: np.ndarray):
        """Copy the device ``array`` into ``out`` (host memory :meth:`holds_host` finds locked, of
        ``array``'s shape), as :meth:`to_host_async` does into its own host array: a token for
        :meth:`arrived` and :meth:`reach_copy`."""
        out[...] = array
        return None

    def settle_locks(self) -> None:
        """Return once every :meth:`unlock_host` handed over so far is done (after the executor:
        the unlocks run beside the end of a run)."""

    # -- STEADY: without it, nothing is derived ---------------------------------------------------

    @contextlib.contextmanager
    def steady(self, arrays):
        """Within it, what a statement reads of the device ``arrays`` does not change later (a
        loop's inputs that its body only reads; rows streamed in while it runs arrive before any
        tile reads them): a copy the backend derives from one of them may be kept for later
        statements."""
        yield

    # -- TUNED: without it, nothing is compiled or tuned -------------------------------------------

    def startup_seconds(self) -> dict[str, float]:
        """Seconds of this process's work that a run with warm caches does not repeat, by kind:
        ``compile`` (kernels compiled, summed over the threads that compile at once) and ``tune``
        (candidate methods timed, the compiles that timing triggers included); both are part of
        the executor's seconds."""
        return {}


TUNE_MARGIN = "CHAINEXEC_TUNE_MARGIN"
"""The environment variable that sets the autotuner's margin (:func:`tune_margin`)."""


def tune_margin() -> float:
    """The factor of the best predicted seconds within which the autotuner times candidates
    (:data:`chainexec.runtime.backends.costmodel.MARGIN` where ``CHAINEXEC_TUNE_MARGIN`` is unset;
    ``inf`` times every candidate); a value that is not a number of at least 1 is an error naming
    the variable."""
    from chainexec.runtime.backends.costmodel import MARGIN

    given = os.environ.get(TUNE_MARGIN, "")
    if not given:
        return MARGIN
    try:
        margin = float(given)
    except ValueError:
        margin = math.nan
    if not margin >= 1:
        raise ChainexecError(f"{TUNE_MARGIN}={given!r} is not a number of at least 1 (inf: time every candidate)")
    return margin


def select(name: str = "auto", comm=None) -> Backend:
    """``numpy``, ``cupy``, or ``auto`` (CuPy when it imports and sees a GPU, else NumPy).

    With CuPy, the rank takes GPU ``local rank mod GPUs on the node``: one rank per GPU (several
    ranks share a GPU when there are more ranks than GPUs). The contraction method comes from
    ``CHAINEXEC_GPU_METHOD`` (default ``auto``), the autotuner's margin from
    ``CHAINEXEC_TUNE_MARGIN`` (:func:`tune_margin`); an unknown value is an error on every
    backend."""
    from chainexec.runtime import uselog, warmup
    from chainexec.runtime.backends.cupy import CupyBackend
    from chainexec.runtime.backends.numpy import NumpyBackend
    from chainexec.runtime.backends.tuning import METHODS
    from chainexec.runtime.comm import local_rank

    if name not in BACKENDS:
        raise ChainexecError(f"unknown backend {name!r} (auto, numpy or cupy)")
    method = os.environ.get("CHAINEXEC_GPU_METHOD", "auto")
    if method not in METHODS:
        raise ChainexecError(f"CHAINEXEC_GPU_METHOD={method!r} is not one of {', '.join(METHODS)}")
    margin = tune_margin()
    if name in ("auto", "cupy"):
        try:
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
            if count > 0:
                device = local_rank(comm) % count if comm is not None else 0
                cupy.cuda.Device(device).use()
                if warmup.busy():  # its loads leave this thread idle: make the logged host preparations meanwhile
                    warmup.prepare(uselog.device_name(cupy, device), uselog.job())
                warmup.wait()
                warmup.begin(cupy, device)  # where the command's start did not warm this device up
                return CupyBackend(cupy, method, margin)
        except Exception as err:  # no cupy, no driver, no device: all mean "no GPU here"
            if name == "cupy":
                raise ChainexecError(f"backend cupy is not usable here: {err}") from None
        if name == "cupy":
            raise ChainexecError("backend cupy is not usable here: no GPU")
    return NumpyBackend()
