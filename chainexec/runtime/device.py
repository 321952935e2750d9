"""The device level (γ) behind one seam: NumPy on the CPU, CuPy on a GPU.

Everything the executor does with device buffers goes through a :class:`Backend`: ``zeros``
(allocate), ``fetch`` (host → device buffer), ``to_host_async`` (device → host, queued) and ``contract``
(``out += factor · a·b``). The backend is chosen once (:func:`select`); no other module asks whether
it runs on a GPU.

Views. The executor passes slices of larger buffers (a fused intermediate's buffer spans more tiles
than one contraction works on), so ``out``, ``a`` and ``b`` may be non-contiguous. Both backends
accept any strided view. On the GPU, GETT, batched GEMM and the point-wise kernels work on the
views directly and make no temporary arrays; ``ttgt``, ``einsum`` and the COGENT kernel make
contiguous copies and product temporaries, workspace outside the plan's buffers. The executor
tells the backend the configured device memory and the plan's peak (:meth:`Backend.limit_memory`):
methods with temporaries are tuned only where these fit in the room left, and blocks CuPy's pool
caches are given back when they take it over the limit; a contraction whose workspace still does
not fit runs through GETT (:meth:`Backend.pool_bytes` lets the executor report the allocator's
high-water mark; capping CuPy's pool at the limit instead made planned buffer allocations fail,
the pool's own fragmentation included).

Contraction methods on the GPU (:class:`CupyBackend`):

* point-wise — statements that sum over nothing (permuted copies, Hadamard and outer
  products), alone or as a run of terms into one buffer: one generated kernel
  (:mod:`chainexec.runtime.pointwise`) ``y += Σ f·x(·z)`` over broadcast views. (A full
  reduction to a scalar through a CuPy ``ReductionKernel`` over a permuted view was tried and
  removed: without CUB, CuPy reduces to one output element in a single thread block, 60 s
  instead of 4 s for the (T) energy at o=21, v=93 on the H100.)
* ``gett`` — the generated GETT kernel on FP64 tensor cores (:mod:`chainexec.planner.gett`):
  gathers through offset tables, so any strided operands and batch indices; float64.
* ``batched`` — batched GEMMs over the operands as they lie (:mod:`chainexec.planner.batchedgemm`,
  the strided-batched GEMM paper): cuBLAS strided-batched calls, or one pointer-array batched
  call, adding straight into ``out`` with no copy and no workspace; float32/float64.
* ``relayout`` — batched GEMM as above on copies of ``a`` and ``b`` permuted so that the modes
  each shares with ``out`` in runs merge into large GEMM dimensions
  (:func:`chainexec.planner.batchedgemm.operand_orders`), still adding straight into ``out``: the
  copies cost a pass over the operands, which in (T) are tiny beside the output, and no
  product temporary or permuted add as TTGT has. Offered where it makes larger GEMMs than
  ``batched``; workspace: the two copies.
* ``kernel`` — the generated COGENT kernel (:mod:`chainexec.runtime.kernels`) for the tile's
  extents, launched with ``alpha = factor, beta = 1`` straight into ``out`` when ``out`` is
  C-contiguous. Only for contractions without batch indices, in float32/float64.
* ``ttgt`` — transpose–transpose–GEMM–transpose: permute one operand to (batch, its external,
  contracted) and the other to (batch, contracted, its external) — the one holding ``out``'s
  fastest index on the right, so the product ends in that index — multiply with ``cupy.matmul``
  (cuBLAS, FP64 tensor cores on Hopper), add the product permuted to ``out``'s order. Works for
  every contraction.
* ``einsum`` — ``cupy.einsum`` itself, so the choice is never slower than it.
* ``direct`` — one generated kernel over the views as they lie, a thread per output element
  summing the products (:func:`chainexec.runtime.pointwise.contract`): slow, but it applies to
  every contraction and needs no memory at all, so a plan that fills the device limit (the
  4 MiB demo) has a method that keeps within it when GETT does not apply.
* ``cutensor`` — NVIDIA's cuTENSOR through ``cupyx.cutensor``, adding into ``out`` (β = 1) on
  any strided views, where libcutensor is installed (:func:`_cutensor`); so the choice is never
  slower than it either. Its workspace, chosen by the library, is counted as one output-sized
  array.

``auto`` (the default) is the autotuner: the GETT cost model ranks its configurations and the top
:data:`TUNE_TOP` (each with its staged-epilogue twin, :func:`~chainexec.planner.gett.candidates`)
are timed beside the other methods once per (contraction, shapes, strides,
dtype) on the real operands — one untimed warm-up and the best of two CUDA-event-timed runs each —
and the fastest is kept for the process (:attr:`CupyBackend.choices`) and across processes
(:class:`TuningCache`). The environment variable ``CHAINEXEC_GPU_METHOD`` (one of
:data:`METHODS`) forces a method for benchmarks; a method that does not apply falls back to
``ttgt``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from chainexec import atomicfile, expr
from chainexec.errors import ChainexecError
from chainexec.ordering import weights
from chainexec.planner import batchedgemm, stacking
from chainexec.planner.plan import Contraction, Fused
from chainexec.runtime import arena, hostlock, pointwise, uselog, warmup
from chainexec.runtime.comm import local_rank
from chainexec.spec import format_size

METHODS = ("auto", "gett", "batched", "relayout", "kernel", "ttgt", "einsum", "cutensor", "direct", "sum", "summma", "split",
           "stack")
"""Values of ``CHAINEXEC_GPU_METHOD``: how :class:`CupyBackend` contracts (``sum`` / ``summma``:
a run of contractions into one buffer through the generated register / tensor-core sum kernel
without timing candidates; ``split``: its short-range terms through the register kernel, the
others one by one, each by the method the autotuner picks; ``stack``: the terms that stack
(:mod:`chainexec.planner.stacking`) as one contraction per stack, where their copies fit, the
others one by one, each tuned; any other forced method runs such a run term by term)."""
TIMED_SUM_KINDS = ("sum",)
"""The sum kernels (:data:`chainexec.runtime.kernels.SUM_KINDS`) whose candidates the autotuner
times against the terms one by one. The tensor-core kernel (``summma``) joins them once it has
run on a GPU: until then it runs only where forced."""
IN_PLACE = ("gett", "direct")
"""Methods the autotuner times on the output itself, adding zero: no scratch output needed."""
TIMED_RUNS = 2
"""CUDA-event-timed runs per method in the one-time comparison (the best one counts)."""


@lru_cache(maxsize=None)
def _ttgt(out: tuple, a: tuple, b: tuple):
    """Transpose-transpose-GEMM-transpose layout of ``out = a·b``: index groups batch (in all
    three), the left and the right GEMM operand's external ones and contracted (in a and b only),
    whether the GEMM takes b as its left operand, and the permutations that bring the left operand to (batch, left-ext, k),
    the right one to (batch, k, right-ext) and the GEMM result to ``out``'s order.

    The operand holding ``out``'s fastest index goes right, so that the product's fastest index is
    ``out``'s: the final ``out += product`` then reads the product in runs along that index
    instead of one element per run (the (T) term ``ovvv[i,a,f,c]·t2[j,k,b,f]`` into
    ``W[i,j,k,a,b,c]``: the product ends in ``c``, not ``b``). Within each group the indices keep
    ``out``'s order."""
    batch = [i for i in out if i in a and i in b]
    aext = [i for i in out if i in a and i not in b]
    bext = [i for i in out if i in b and i not in a]
    ks = [i for i in a if i in b and i not in out]
    swap = bool(out) and out[-1] in aext
    (left, lext), (right, rext) = ((b, bext), (a, aext)) if swap else ((a, aext), (b, bext))
    result = batch + lext + rext
    return (batch, lext, rext, ks, swap, [left.index(i) for i in batch + lext + ks],
            [right.index(i) for i in batch + ks + rext], [result.index(i) for i in out])


def _sizes(c: Contraction, a, b) -> dict[str, int]:
    """Extent of every index of a binary contraction, read off the operands' shapes."""
    return dict(zip(c.a_indices, a.shape)) | dict(zip(c.b_indices, b.shape))


def _ttgt_product(xp, c: Contraction, a, b):
    """``factor · a·b`` as an array (module ``xp``) viewed in ``out``'s index order.

    The reshapes copy an operand only when its permutation is not a view-compatible layout; with
    no batch index the GEMM is 2-D (one plain GEMM call)."""
    batch, lext, rext, ks, swap, pl, pr, pout = _ttgt(tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices))
    size = _sizes(c, a, b)
    left, right = (b, a) if swap else (a, b)
    if not ks:
        # Nothing summed (Hadamard or outer product): an element-wise broadcast, not a batch of
        # 1×1 GEMMs.
        product = (left.transpose(pl).reshape([size[i] for i in batch + lext] + [1] * len(rext))
                   * right.transpose(pr).reshape([size[i] for i in batch] + [1] * len(lext) + [size[i] for i in rext]))
        if c.factor != 1.0:
            product *= c.factor
        return product.transpose(pout)
    nb, nl, nr, nk = (math.prod(size[i] for i in g) for g in (batch, lext, rext, ks))
    lead = (nb,) if batch else ()
    product = xp.matmul(left.transpose(pl).reshape(lead + (nl, nk)), right.transpose(pr).reshape(lead + (nk, nr)))
    product = product.reshape([size[i] for i in batch + lext + rext])
    if c.factor != 1.0:
        product *= c.factor
    return product.transpose(pout)


def _permuted(c: Contraction, a):
    """A unary statement's operand viewed in ``out``'s index order (a permuted copy)."""
    return a.transpose([c.a_indices.index(i) for i in c.out_indices])


class Backend:
    """The seam, and its NumPy implementation (device memory is host memory).

    ``xp`` is the array module, ``name`` the backend's name (``numpy`` or ``cupy``)."""

    name = "numpy"

    def __init__(self):
        self.xp = np
        self.indexes: dict[tuple, object] = {}  # gather positions where the arrays are, per tile shape (gather)

    def clear(self, array) -> None:
        """Set a device array to zeros, in the order the backend computes in (queued on a GPU)."""
        array.fill(0)

    def zeros(self, shape, dtype):
        """A zero-filled device buffer of ``shape`` (elements) and ``dtype``; one clear error
        when the memory is not there (the plan's limit is above what the device has)."""
        return self._allocate(shape, dtype, self.xp.zeros)

    def empty(self, shape, dtype):
        """As :meth:`zeros`, with its contents left as the allocator hands them over: for a buffer
        whose first writer is told so (``fresh``, :meth:`contract`)."""
        return self._allocate(shape, dtype, self.xp.empty)

    def _allocate(self, shape, dtype, make):
        self._make_room(math.prod(shape) * np.dtype(dtype).itemsize)
        try:
            return make(shape, dtype=dtype)
        except self.out_of_memory:
            size = format_size(math.prod(shape) * np.dtype(dtype).itemsize)
            raise ChainexecError(f"device memory: could not allocate {size} ({self.name}); the device has less "
                                 "free memory than machine.device_memory plans for: lower it") from None

    @property
    def out_of_memory(self) -> type[BaseException]:
        """The exception this backend's allocator raises when memory runs out."""
        return MemoryError

    def expect_transfers(self, nbytes: int) -> None:
        """Bytes this rank will move between host and device memory in the run (a hint for the
        kind of host buffers to use; here device memory is host memory)."""

    def limit_memory(self, limit: int, planned: int) -> None:
        """The configured device memory and the plan's peak in it (bytes per rank): what is left
        is room for a contraction's temporaries. Here device memory is host memory, whose
        temporaries the plan does not budget."""

    def locks_host(self) -> bool:
        """Whether :meth:`lock_host` may lock anything in this run (here: no, device memory is
        host memory), so that a thread for it is worth starting."""
        return False

    def lock_host(self, array: np.ndarray):
        """Page-lock the host ``array`` where it lies (an input's tile that the run only reads), so
        that :meth:`fetch` copies its rows to the device without staging them; callable from any
        thread. A handle for :meth:`unlock_host`, or None where nothing was done. ``array`` must
        not change until it is unlocked."""
        return None

    def unlock_host(self, handle) -> None:
        """Undo :meth:`lock_host` (``handle``: what it returned, not None) once the copies handed
        to the backend so far are done; the array may be let go at once."""

    def settle_locks(self) -> None:
        """Return once every :meth:`unlock_host` handed over so far is done (after the executor:
        the unlocks run beside the end of a run)."""

    def fetch(self, dst, read, view=None) -> None:
        """Fill the device buffer ``dst`` from a host source: ``read(rows, out)`` writes rows
        ``rows`` (a slice of ``dst``'s first axis; None for a 0-d buffer: all of it) into the
        C-contiguous host array ``out``; ``view(rows)``, where given, returns those rows as a
        C-contiguous array in host memory if the source holds them so, else None (a backend
        may copy from there instead of reading them into a buffer of its own). Every read is
        done before it returns, except from memory locked by :meth:`lock_host`, which the device
        may read until :meth:`unlock_host`. Here the source is read straight into ``dst``."""
        read(_rows(dst), dst)

    def fetch_aside(self, dst, read, after=None, view=None) -> None:
        """As :meth:`fetch`, beside the work handed to the backend before it, where the device
        can copy and compute at once; the work handed after it waits for it. ``after``: a
        :meth:`stamp` mark; the copy starts once the work handed to the backend before it is done
        (``dst``'s last reader). Every ``read`` is done before it returns, as in :meth:`fetch`:
        the host source may change or be given back afterwards (the executor gives streamed
        rows back once every rank has copied them, :meth:`Executor._discard`), except memory
        locked by :meth:`lock_host`, which the device may read until :meth:`unlock_host`. Here:
        :meth:`fetch`."""
        self.fetch(dst, read, view)

    def fetch_waits(self, dst, view=None) -> bool:
        """Whether :meth:`fetch` into ``dst`` (from the host source ``view`` describes, as
        :meth:`fetch` takes it) waits for the work handed to the backend before it (then the
        executor waits first, so the fetch's seconds are its own; here nothing waits)."""
        return False

    @contextlib.contextmanager
    def steady(self, arrays):
        """Within it, what a statement reads of the device ``arrays`` does not change later (a
        loop's inputs that its body only reads; rows streamed in while it runs arrive before any
        tile reads them): a copy the backend derives from one of them may be kept for later statements
        (the CuPy backend's relayout copies, :meth:`CupyBackend._relaid_copy`). Here nothing is
        derived."""
        yield

    def to_host_async(self, array, aside: bool = False) -> tuple[np.ndarray, object]:
        """A host copy of a device array queued behind the statements before it, and a token
        for :meth:`arrived`; the host array holds the data once the token has arrived, until the
        device array next changes (here: the array itself, arrived at once). ``aside``: the
        work handed to the backend afterwards need not wait for the copy (a copy engine makes
        it while the device computes); the caller changes ``array`` only after
        :meth:`wait_for` the token."""
        return array, None

    def arrived(self, token) -> bool:
        """Whether the copy :meth:`to_host_async` gave ``token`` for has reached the host."""
        return True

    def wait_for(self, token) -> None:
        """Let the work handed to the backend from now on start once the copy
        :meth:`to_host_async` gave ``token`` for (None: none) is done, without waiting on the
        host (NumPy: done already)."""

    def pool_bytes(self) -> int | None:
        """Bytes the device allocator holds now, scratch included (None: no separate device
        memory to watch, as with NumPy)."""
        return None

    def stamp(self):
        """A mark of "now" in the order the backend computes in, for :meth:`elapsed`. The compute
        methods (``contract*``, ``evaluate``, ``fused``) may return before their work is done;
        marks taken around one measure its own time. NumPy computes when called: a clock reading."""
        return time.perf_counter()

    def elapsed(self, start, end) -> float:
        """Seconds between two :meth:`stamp` marks, once the later one is reached."""
        return end - start

    def reach(self, mark) -> None:
        """Return once the work handed to the backend before :meth:`stamp` returned ``mark`` is
        done (NumPy: at once)."""

    def wait(self) -> None:
        """Return once all the work handed to the backend so far is done (NumPy: at once)."""

    def _make_room(self, nbytes: int) -> None:
        """Before a buffer of ``nbytes`` is allocated: nothing to do for host memory."""

    def evaluate(self, tree, arrays: dict, order: tuple[str, ...], out) -> None:
        """Fill ``out`` (a computed tensor's tile over index order ``order``) with the expression
        ``tree`` of :mod:`chainexec.expr`; ``arrays[ref]``: each reference's tile over its own order."""
        out[...] = expr.evaluate(tree, arrays, order, self.xp)

    def fused(self, f: Fused, arrays: dict, shape: tuple[int, ...], out, within: tuple = ()) -> None:
        """A fused statement (:class:`chainexec.planner.plan.Fused`): ``out += f``'s expression,
        summed over the whole index space when ``f.reduce``; ``arrays[ref]``: each reference's
        tile over its own order; ``shape``: the extents of ``f.domain`` here. ``within``: groups
        of dimensions of ``f.domain`` (a reduction's) over which only the ordered elements are
        summed, each weighted by its multiplicity (:func:`chainexec.ordering.weights`)."""
        arrays = dict(arrays)
        extent = dict(zip(f.domain, shape))
        for name, own, text in f.lets:  # computed once, read at each of its permutations
            value = self.xp.broadcast_to(expr.evaluate(expr.parse(text), arrays, own, self.xp), [extent[i] for i in own])
            arrays |= {r: value for r in expr.refs(f.tree) if r.tensor == name}
        value = expr.evaluate(f.tree, arrays, f.domain, self.xp)
        if within:
            value = value * weights(shape, within)
        out[...] += self.xp.broadcast_to(value, shape).sum() if f.reduce else value

    def symmetrize(self, out, axes, keep: tuple = ()) -> None:
        """``out[...] = Σ out.transpose(p)`` over the axis permutations ``axes`` (a group, each
        mapping ``out``'s shape onto itself), every term read before ``out`` changes: a
        symmetrized run's last step (:mod:`chainexec.planner.symmetry`). ``keep``: groups of
        dimensions; only the elements whose coordinates are non-decreasing within each are
        written (:mod:`chainexec.planner.ordered`), the others keep their values."""
        total = sum(out.transpose(p) for p in axes)
        if keep:
            total = self.xp.where(weights(out.shape, keep) > 0, total, out)
        out[...] = total

    def contract_terms(self, cs: list[Contraction], out, operands: list[tuple], fresh: bool = False) -> None:
        """``out += Σ_k cs[k].factor · a_k·b_k`` for point-wise contractions into one output
        (``operands[k]`` = ``(a_k, b_k)``, ``b_k`` may be None), none of which reads ``out``;
        ``fresh`` as in :meth:`contract`."""
        self._term_by_term(cs, out, operands, fresh)

    def contract_sum(self, cs: list[Contraction], out, operands: list[tuple], fresh: bool = False) -> None:
        """``out += Σ_k cs[k].factor · a_k·b_k`` for contractions into one output, each summing over
        indices of both its operands, none of which reads ``out`` (the (T) ``W`` terms); here
        term by term. ``fresh`` as in :meth:`contract`."""
        self._term_by_term(cs, out, operands, fresh)

    def _term_by_term(self, cs: list[Contraction], out, operands: list[tuple], fresh: bool) -> None:
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
        ``fresh``: ``out`` holds nothing yet (written, not added to)."""
        if before is not None:
            a = a.transpose(before)
        if positions[0] == "pack":
            a = a.reshape(a.shape[:axis] + (-1,) + a.shape[axis + 2:])
        taken = self.xp.take(a, self._positions(positions), axis=axis)
        if after is not None:
            taken = taken.transpose(after)
        if factor != 1.0:
            taken *= factor
        if fresh:
            out[...] = taken
        else:
            out += taken

    def _positions(self, positions: tuple):
        """The gather positions of :meth:`gather`, computed where the arrays are (the pair
        formula of :mod:`chainexec.packing`, element-wise in ``xp``) once per tile shape."""
        found = self.indexes.get(positions)
        if found is None:
            xp = self.xp
            if positions[0] == "unpack":
                _, k0, r0, r1, s0, s1 = positions
                r, s = xp.arange(r0, r1)[:, None], xp.arange(s0, s1)[None, :]
                high, low = xp.maximum(r, s), xp.minimum(r, s)
                found = high * (high + 1) // 2 + low - k0
            else:
                _, k0, k1, r0, s0, s1 = positions
                k = xp.arange(k0, k1)
                row = ((xp.sqrt(8.0 * k + 1) - 1) // 2).astype(xp.int64)
                row -= row * (row + 1) // 2 > k  # rounding of the square root, corrected
                row += (row + 1) * (row + 2) // 2 <= k
                found = (row - r0) * (s1 - s0) + (k - row * (row + 1) // 2) - s0
            self.indexes[positions] = found
        return found

    def contract(self, c: Contraction, out, a, b, fresh: bool = False) -> None:
        """``out += c.factor · a·b`` over the contraction's indices (``b`` None: permuted copy).

        ``out``, ``a`` and ``b`` may be strided views of larger buffers; only ``out``'s view is
        written. ``fresh``: ``out`` holds whatever its allocation left (:meth:`empty`) and is
        written as if it held zeros; here it is cleared first."""
        if fresh:
            self.clear(out)
        if b is None:
            out += c.factor * _permuted(c, a)
        else:
            out += _ttgt_product(np, c, a, b)


TUNE_TOP = 3
"""GETT configurations the model ranks best that the one-time autotune times."""
GETT_MIN_OUTPUT = 4096
"""Output elements below which GETT is not tried: a GEMM-shaped kernel needs output tiles to
spread over the SMs (a dot product or a tiny output is a reduction, better left to cuBLAS)."""


def _spread(arr, idx, order):
    """``arr`` (over index order ``idx``) as a view over ``order``: length 1 where it lacks an
    index of ``order``; its axes outside ``order`` (extent 1) dropped."""
    if any(i not in order for i in idx):  # (indexing a 0-d NumPy array would give a scalar)
        arr = arr[tuple(slice(None) if i in order else 0 for i in idx)]
    kept = [i for i in idx if i in order]
    view = arr.transpose([kept.index(i) for i in order if i in kept])
    return view[tuple(slice(None) if i in kept else None for i in order)]


PINNED_FROM_BYTES = 4 << 30
"""Host↔device bytes per rank from which a run uses page-locked host buffers. The first
page-locked allocation of a run's process cost 0.35–0.55 s on the H100 machine (7 ms in a bare
process); page-locked copies save about 0.09 s per GB over plain memory (about 55 against 9 GB/s),
so they repay that from about 5 GB on."""
DEFERRED_BYTES = 64 << 10
"""Largest device array that :meth:`CupyBackend.to_host_async` copies back in two steps when the
run's host buffers are plain memory: a copy on the device queued behind the work before it,
then, once that is done, the copy to the host on a stream of its own
(:meth:`CupyBackend._deliver`). A copy into plain memory on the current stream makes the host
wait for all the work queued before it, and page-locking
a small buffer mid-run waits for the device too (cudaHostAlloc: 0.29-0.45 s at benzene's sizes
on the H100, 2026-11-27). (T) at benzene's sizes copies its 8-byte energy back once per tile;
the host waited 0.14-0.16 s of its 0.51-0.64 s executor there, while the device drained its
queue. Measured on an H200 (2026-11-27, fresh processes alternating, synthetic o=21 v=93): the
executor's median 0.503 s without it, 0.485 s with it (means 0.518 and 0.483 s); on benzene,
with the tuning file read once as well, 0.43-0.48 s against 0.59-0.67 s before both."""
UPLOAD_BYTES = 256 << 20
"""Page-locked host bytes of copies to the device kept in flight (:meth:`CupyBackend.upload`)."""
STAGE_BYTES = 8 << 20
"""Bytes of each of the two staging buffers that tiles reach the device through (host memory,
outside the plan's levels, kept for the backend's life); a buffer is one row of the tile instead
where a row (first axis) is larger. On the H100 machine 8 MiB chunks were faster than 64 MiB ones: the
(T) inputs at o=24, v=180 (1.4 GB) reached the device in 0.65 s instead of 0.94 s."""
HOLD_SHARE = 4
"""A loop with steady inputs (:meth:`CupyBackend.steady`) sets 1/HOLD_SHARE of the room the plan
leaves aside for relayout copies held from tile to tile."""
PROBE_FLOOR = 1 << 20
"""Output bytes below which probes are not cut even when the plan leaves less room (only the
methods timed in place, :data:`IN_PLACE`, are then timed within the room)."""
TUNE_BYTES = 512 << 20
"""Output bytes above which the autotuner times a probe instead of the whole contraction. A probe
cut too far changes the methods' shapes, not just their sizes: at 64 MiB the (T) W tiles of
o=24, v=180 were cut along a virtual index, the batched GEMMs shrank to a few rows and lost to GETT
on the probe, while forced on the real tiles they took 6.0 s of compute against auto's 6.5 s (H100).
At 512 MiB only the occupied indices are cut (to 2)."""


def _probe(c: Contraction, out, a, b, limit: int = TUNE_BYTES) -> tuple:
    """Views of ``out``, ``a`` and ``b`` cut along ``out``'s slowest indices (the same index in
    the inputs) until the output is at most ``limit`` bytes (:data:`TUNE_BYTES`): the strides, and
    so the memory-access pattern every method sees, stay those of the real operands, at a fraction
    of the cost of timing six methods on a multi-GiB tile. A cut index keeps at least 2 elements."""
    order = sorted(range(out.ndim), key=lambda d: -out.strides[d])
    views = [out, a, b]
    for d in order:
        if views[0].nbytes <= limit:
            break
        name, n = c.out_indices[d], views[0].shape[d]
        keep = max(2, n * limit // views[0].nbytes)
        for v, idx in enumerate((c.out_indices, c.a_indices, c.b_indices)):
            if name in idx and keep < n:
                cut = [slice(None)] * views[v].ndim
                cut[idx.index(name)] = slice(0, keep)
                views[v] = views[v][tuple(cut)]
    return tuple(views)


def stacked_bytes(stacks: list, operands: list[tuple], itemsize: int) -> int:
    """Device bytes of the copies :meth:`CupyBackend._stacked` holds at once (one stack's, in the
    output's dtype of ``itemsize`` bytes)."""
    return itemsize * max((sum(a.size + b.size for k in st.terms for a, b in [operands[k]]) for st in stacks),
                          default=0)


def _span(arr) -> tuple[int, int]:
    """A device array's memory span: the address of its view's first byte and one past its last."""
    lo = arr.data.ptr + sum(min(0, (n - 1) * s) for n, s in zip(arr.shape, arr.strides))
    return lo, arr.data.ptr + sum(max(0, (n - 1) * s) for n, s in zip(arr.shape, arr.strides)) + arr.itemsize


def _inside(span: tuple[int, int], spans) -> bool:
    """Whether a memory span (:func:`_span`) lies within one of ``spans``."""
    return any(a <= span[0] and span[1] <= b for a, b in spans)


def _overlaps(x, y) -> bool:
    """Whether two device arrays' memory spans (:func:`_span`) meet."""
    (a0, a1), (b0, b1) = _span(x), _span(y)
    return a0 < b1 and b0 < a1


def _like(xp, out):
    """A zeroed scratch array shaped as ``out``, with ``out``'s strides where their span is at
    most twice ``out``'s size (else C-contiguous: a view cut from a much larger buffer)."""
    span = 1 + sum((n - 1) * s for n, s in zip(out.shape, out.strides)) // out.itemsize if out.size else 0
    if out.flags.c_contiguous or span > 2 * out.size or min(out.strides, default=0) < 0:
        return xp.zeros(out.shape, out.dtype)
    base = xp.zeros(span, out.dtype)
    return xp.ndarray(out.shape, out.dtype, base.data, strides=out.strides)


def _workspace(method: str, out, a, b) -> int:
    """Upper bound (bytes) of the device temporaries a contraction method makes: TTGT and the
    COGENT kernel may copy both operands and make an output-sized product (or temporary output),
    ``cupy.einsum`` one more output-sized array; GETT, batched GEMM, the direct kernel and the
    point-wise kernels make none (GETT's offset tables, kept for the process, are checked
    against the room by :meth:`CupyBackend._problem`; batched GEMM's pointer tables, 24 bytes
    per GEMM of a pointer-array call, are not counted); ``relayout`` copies both operands;
    cuTENSOR's is counted as one output. (Where batched GEMM or relayout was chosen on a probe
    and the tile has no layout, the fallback's TTGT temporaries are not in this bound: a failed
    allocation then falls back to GETT, :meth:`CupyBackend.contract`.)"""
    if method in ("gett", "batched", "direct"):
        return 0
    if method == "relayout":
        return a.nbytes + b.nbytes
    if method == "cutensor":
        return out.nbytes
    copies = a.nbytes + b.nbytes + out.nbytes
    return copies + out.nbytes if method == "einsum" else copies


@lru_cache(maxsize=None)
def _cutensor(cupy):
    """``cupyx.cutensor`` where libcutensor loads and contracts (checked once on a small case), else
    None: CuPy imports the module without the library and fails only at the first call."""
    try:
        from cupyx import cutensor

        x = cupy.ones((2, 3))
        y = cupy.ones((3, 4))
        z = cupy.zeros((2, 4))
        cutensor.contraction(1.0, x, ("a", "k"), y, ("k", "b"), 0.0, z, ("a", "b"))
        return cutensor if float(z[0, 0]) == 3.0 else None
    except Exception:
        return None


def _strides(arr) -> tuple[int, ...]:
    return tuple(s // arr.itemsize for s in arr.strides)


@dataclass(frozen=True)
class _Contiguous:
    """A C-contiguous array's shape, dtype, item size and strides (bytes), without the array:
    what :meth:`CupyBackend._batched` reads of an operand."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(math.prod(self.shape[d + 1:]) * self.itemsize for d in range(len(self.shape)))


@lru_cache(maxsize=None)
def _relaid_orders(out: tuple, a: tuple, b: tuple) -> tuple:
    """:func:`~chainexec.planner.batchedgemm.operand_orders` and the permutations to them, per
    index triple (asked again for every tile of a run)."""
    oa, ob = batchedgemm.operand_orders(out, a, b)
    return tuple(oa), tuple(ob), tuple(a.index(i) for i in oa), tuple(b.index(i) for i in ob)


def _relaid(c: Contraction) -> tuple[Contraction, tuple, tuple]:
    """``c`` over copies of its operands in :func:`~chainexec.planner.batchedgemm.operand_orders`'
    index orders, and the permutations that make those copies from ``a`` and ``b``."""
    oa, ob, pa, pb = _relaid_orders(tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices))
    return replace(c, a_indices=list(oa), b_indices=list(ob)), pa, pb


def _gemm_size(g) -> int:
    """Elements of one GEMM's output in a batched-GEMM layout: what a larger layout gains."""
    return g.out.rows * g.out.cols


@dataclass
class Choice:
    """How :class:`CupyBackend` contracts one (contraction, shapes, strides, dtype): ``method``
    is ``gett``, ``batched``, ``relayout``, ``kernel``, ``ttgt``, ``einsum``, ``cutensor`` or
    ``direct``; for a run of contractions into
    one buffer ``sum`` or ``summma`` (a sum kernel), ``terms`` (one by one), ``split`` (some terms in
    a sum kernel, the others one by one) or ``stack`` (the terms that stack as one contraction per
    stack, :mod:`chainexec.planner.stacking`, the others one by one); ``seconds`` the best timed run of every candidate
    compared (empty when the method was forced or only one applies); ``config`` the GETT order
    and configuration (:class:`~chainexec.planner.gett.GettConfig` fields) or the sum kernel's
    (:class:`~chainexec.planner.sumkernel.SumConfig`, :class:`~chainexec.planner.summma.MmaConfig`),
    for ``split`` ``{"kind", "config", "terms"}`` (the kernel, its configuration, the positions of
    its terms), else None."""

    method: str
    seconds: dict = field(default_factory=dict)
    config: dict | None = None


def _rows(dst) -> slice | None:
    """All of the first axis of ``dst`` as :meth:`Backend.fetch`'s ``read`` and ``view`` take rows
    (None for a 0-d buffer)."""
    return slice(0, dst.shape[0]) if dst.ndim else None


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


@lru_cache(maxsize=256)
def _orbit_codes(f: Fused, refs: tuple) -> tuple[tuple[str, ...], str, tuple[tuple[int, tuple[int, ...]], ...]]:
    """A reduction with reused values over the buffers ``refs`` (``p0, p1, …``): each value's C
    code, the statement's (reading the values as ``q0, q1, …``), and each read as (value, the
    permutation of ``f.domain`` that takes a point to where the value is read). Made once per
    statement and process: building them takes 0.36 ms on the host for the (T) energy."""
    names = [name for name, _, _ in f.lets]
    params = {r: f"p{k}" for k, r in enumerate(refs)}
    reads = [r for r in expr.refs(f.tree) if r.tensor in names]
    codes = [expr.c_source(expr.parse(text), params) for _, _, text in f.lets]
    code = expr.c_source(f.tree, params | {r: f"q{k}" for k, r in enumerate(reads)})
    perms = []
    for r in reads:
        j = names.index(r.tensor)
        source = dict(zip(f.lets[j][1], r.indices))  # the value at y is read where x[source[i]] = y[i]
        perms.append((j, tuple(f.domain.index(source[i]) for i in f.domain)))
    return tuple(codes), code, tuple(perms)


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


class CupyBackend(Backend):
    """CuPy on the rank's GPU: buffers from CuPy's memory pool, device→host copies into pinned
    (page-locked) memory from CuPy's pinned pool, host→device DMA straight from pinned inputs,
    contractions by the fastest of the candidate methods (see the module docstring).

    Everything runs on the current (default) stream, but for :meth:`fetch_aside`'s copies, which
    the current stream waits for (an event), and :meth:`to_host_async`'s copies aside, which it
    waits for (:meth:`wait_for`) before it writes their slot again. The compute methods return
    once their kernels are queued (the host prepares the next statement while the device runs this one);
    the executor times them with CUDA events (:meth:`stamp`), so its per-level seconds are the
    device's time, and waits (:meth:`wait`) before anything it times on the host. Until
    2026-11-24 every compute statement synchronized before it returned."""

    name = "cupy"

    def __init__(self, cupy, method: str = "auto"):
        if method not in METHODS:
            raise ChainexecError(f"unknown GPU contraction method {method!r} ({', '.join(METHODS)})")
        super().__init__()
        self.xp = cupy
        self.method = method
        self.choices: dict[tuple, Choice] = {}
        self._kernels: dict[tuple, object] = {}
        self._gett: dict[tuple, tuple] = {}
        self._batches: dict[tuple, tuple | None] = {}
        self.workspace: int | None = None  # bytes beyond the plan's buffers; None: no limit
        self.table_bytes = 0  # device bytes of the GETT offset tables made so far (kept)
        self.memory: int | None = None  # the configured device memory (bytes); None: no limit
        self.tuning = TuningCache.for_device(cupy)
        self._stages: list[np.ndarray] | None = None
        self._uploads: collections.deque = collections.deque()  # (page-locked host array, its copy's event)
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
        self._stack_runs: dict[tuple, tuple] = {}  # run key -> (stacks, the terms left alone)
        self.pinned = True  # page-locked host buffers (expect_transfers decides for a run)
        self._locks: hostlock.Locks | None = None  # host memory locked in place (a run of plain memory)

    @property
    def out_of_memory(self) -> type[BaseException]:
        return self.xp.cuda.memory.OutOfMemoryError

    def upload(self, dst, host: np.ndarray) -> None:
        """Copy ``host`` into the device buffer ``dst``: one DMA when both are contiguous (about
        55 GB/s from page-locked memory on the H100 machine, 9 GB/s through the driver's staging
        from pageable memory), else through a contiguous temporary. A copy from page-locked
        memory is queued on the current stream behind the work before it, and returns at once:
        ``host`` is kept until the copy is done (the pinned pool would otherwise hand its memory
        to another copy in flight), at most :data:`UPLOAD_BYTES` of them, beyond which the
        oldest are waited for. Until 2026-11-24 every such copy waited for the device, so a (T)
        tile's small inputs, fetched between its contractions, emptied the device's queue three
        times per tile while the host prepared the next statements."""
        if not (dst.flags.c_contiguous and host.flags.c_contiguous and dst.shape == host.shape):
            dst[...] = self.xp.asarray(host.copy(order="C"))
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
        driver stages pageable memory itself, so a staging buffer of ours only added a copy on
        one thread (4-5 GB/s, then the driver's 9 GB/s). At benzene's sizes (194 MB of inputs, H100,
        2026-11-27) a run's global→device seconds fell from 0.068-0.089 to 0.033-0.039. Where the
        warm-up made the page-locked arena (:mod:`chainexec.runtime.arena`), such rows go through
        it instead: copied into it over threads, then DMA'd without the host waiting. Rows in
        memory locked where it lies (:meth:`lock_host`: an input's mapped tile) skip both: one
        DMA from there, queued at once. Otherwise through two staging buffers of :data:`STAGE_BYTES` each, or
        one row (first axis) each where a row is larger (:meth:`host_empty`: page-locked when
        :attr:`pinned`), used in turn: while one chunk of rows is copied to the device
        (asynchronously from page-locked memory, on the current stream), the next is read into
        the other. A tile the size of one chunk or less, or of one row, is read and copied in one
        piece. A page-locked buffer the size of each tile instead made the (T) inputs at o=24,
        v=180 take 1.73 s on the H100 machine, against 0.65 s through these buffers; until 2026-11-23 a tile
        whose rows were larger than a chunk still took that path (``ovvv``, 46.7 MB rows at o=24,
        v=180: 0.43-0.51 s for 1.1 GB; 216 MB rows at o=32, v=300: 5.6 s for 6.9 GB)."""
        stream = self.xp.cuda.get_current_stream()
        if not self.pinned and dst.flags.c_contiguous:
            host, locked = self._at_hand(dst, view)
            if host is not None:
                # one DMA where the rows lie in memory locked in place (:meth:`lock_host`), else
                # through the page-locked arena where the warm-up made one (queued once the host
                # rows are read into it), else from pageable memory, returning once the driver
                # has staged all of it
                if locked or not arena.upload(self.xp, dst, host, stream):
                    dst.set(host, stream=stream)
                return
        if _one_piece(dst):
            host = self.host_empty(dst.shape, dst.dtype)
            read(_rows(dst), host)
            self.upload(dst, host)
            return
        row = dst.nbytes // dst.shape[0]
        step = max(1, STAGE_BYTES // row)
        stages = self._staging(step * row)
        done = [None, None]
        for n, lo in enumerate(range(0, dst.shape[0], step)):
            hi = min(lo + step, dst.shape[0])
            if done[n % 2] is not None:
                done[n % 2].synchronize()  # the copy out of this staging buffer has finished
            host = stages[n % 2][:(hi - lo) * row].view(dst.dtype).reshape((hi - lo,) + dst.shape[1:])
            read(slice(lo, hi), host)
            dst[lo:hi].set(host, stream=stream)
            done[n % 2] = stream.record()
        stream.synchronize()

    def locks_host(self) -> bool:
        """As :meth:`Backend.locks_host`: in a run of plain host memory (not :attr:`pinned`)."""
        return self._locks is not None

    def lock_host(self, array: np.ndarray) -> int | None:
        """As :meth:`Backend.lock_host`: registered with CUDA (:mod:`chainexec.runtime.hostlock`),
        in a run of plain host memory only (not :attr:`pinned`)."""
        return None if self._locks is None else self._locks.lock(array)

    def unlock_host(self, handle: int) -> None:
        """As :meth:`Backend.unlock_host`: unregistered on a thread of its own once the copies
        queued so far, on this stream and the one aside, are done (about 11 ms per 203 MB on the
        H100 host, 2026-11-28)."""
        after = [self.xp.cuda.get_current_stream().record()]
        if self._aside is not None:
            after.append(self._aside.record())
        self._locks.unlock(handle, after)

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
        if self.pinned:
            return not _one_piece(dst)
        return not self._at_hand(dst, view)[1]

    def _at_hand(self, dst, view) -> tuple[np.ndarray | None, bool]:
        """The host rows :meth:`fetch` copies into all of ``dst`` where ``view`` finds them in host
        memory (else None; ``view`` None: not looked for), and whether they lie in memory locked in
        place (:meth:`lock_host`), from where one DMA is queued without the host waiting."""
        host = None if view is None else view(_rows(dst))
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
            copy = _Deferred(array.copy(), main.record(), np.empty(array.shape, array.dtype))
            self._deferred.append(copy)
            return copy.host, copy
        host = self.host_empty(array.shape, array.dtype)
        if not aside:
            # (copy() keeps a 0-d array 0-d; ascontiguousarray would make it 1-d)
            (array if array.flags.c_contiguous else array.copy()).get(stream=main, out=host, blocking=False)
            return host, main.record()
        if self._back is None:
            self._back = self.xp.cuda.Stream(non_blocking=True)
        self._back.wait_event(main.record())
        with self._back:
            source = array if array.flags.c_contiguous else array.copy()
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
        whose sum is added to the scalar ``out``. The inlined intermediates exist only in
        registers; reused ones (``f.lets``) in the shared memory of an orbit kernel
        (:func:`chainexec.runtime.pointwise.orbit_reduce`). ``within``'s weights are one more input
        the reduction multiplies by (made once per process and shape, outside the plan's device
        memory, as the orbit tables are); the orbit kernel skips the blocks where it is zero
        where it does not vary along the permuted dimensions."""
        views = [expr.spread(arrays[r], r, f.domain, self.xp) for r in arrays]
        if f.lets:  # only full reductions reuse values (chainexec.planner.inline)
            codes, code, perms = _orbit_codes(f, tuple(arrays))
        else:
            code = _c_code(f.tree, tuple(arrays))
        if not f.reduce:
            pointwise.launch(self.xp, f"y + {code}", views, out)
            return
        skip = None
        if within:
            code, skip = f"({code}) * p{len(views)}", len(views)
            views.append(_weights(self.xp, shape, within))
        if f.lets:
            total = pointwise.orbit_reduce(self.xp, codes, code, perms, views, shape, out.dtype.name, skip)
        else:  # no block structure: the weight is multiplied by, nothing skipped
            total = pointwise.reduce(self.xp, code, views, shape)
        out += total.astype(out.dtype)

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

    def host_empty(self, shape, dtype) -> np.ndarray:
        """A host array for copies to and from the device: page-locked from CuPy's pinned pool
        (DMA'd by :meth:`upload`) when :attr:`pinned`, else plain memory."""
        if not self.pinned:
            return np.empty(shape, dtype)
        import cupyx

        return cupyx.empty_pinned(shape, dtype)

    def limit_memory(self, limit: int, planned: int) -> None:
        """As :meth:`Backend.limit_memory`: a method whose temporaries (:func:`_workspace`) would
        not fit in the room left is not a candidate of the autotuner where one that needs none
        applies, probes are cut so that a probe's scratch output and temporaries fit too, and
        when the blocks CuPy's pool caches take it over ``limit`` after a contraction, they are
        given back. (The allocator's high-water mark went 0.4 GiB over a 1 GiB limit in the
        out-of-core four-index run of 2026-11-22 through TTGT's temporaries.)"""
        self.workspace = max(0, limit - planned)
        self.memory = limit

    def _make_room(self, nbytes: int) -> None:
        """Give CuPy's cached free blocks back before an allocation that could take the pool over
        the configured device memory: blocks freed by tiles of other shapes (edge tiles) do not
        fit the next buffer, and the pool grew beside them. In the 4 MiB demo (planned peak
        3.9 MiB) it held 6.0 MiB at its high-water mark on the H100 that way, every allocation
        but 350 KB being the plan's own buffers (CuPy's LineProfileHook)."""
        if self.memory is None:
            return
        pool = self.xp.get_default_memory_pool()
        if pool.total_bytes() + nbytes > self.memory and pool.free_bytes():
            pool.free_all_blocks()

    def expect_transfers(self, nbytes: int) -> None:
        """Use page-locked host buffers only if this rank will move at least
        :data:`PINNED_FROM_BYTES` between host and device in the run; otherwise inputs may be
        locked where they lie (:meth:`lock_host`), from this thread's device."""
        self.pinned = nbytes >= PINNED_FROM_BYTES
        self._locks = None if self.pinned else hostlock.Locks(self.xp)

    def contract_terms(self, cs: list[Contraction], out, operands: list[tuple], fresh: bool = False) -> None:
        """As :meth:`Backend.contract_terms`, in one generated point-wise kernel
        (:mod:`chainexec.runtime.pointwise`) over broadcast views: ``out`` is read and written once
        for all the terms (twelve outer products accumulated into one (T) tile were twelve passes
        over it), only written where ``fresh``, and no temporary is made."""
        views, terms = [], []
        for c, (a, b) in zip(cs, operands):
            factors = [f"p{len(views) + k}" for k in range(1 if b is None else 2)]
            views += [_spread(a, c.a_indices, c.out_indices)] + ([] if b is None else [_spread(b, c.b_indices, c.out_indices)])
            terms.append(" * ".join([repr(float(c.factor))] + factors))
        pointwise.launch(self.xp, " + ".join(([] if fresh else ["y"]) + terms), views, out)

    def symmetrize(self, out, axes, keep: tuple = ()) -> None:
        """As :meth:`Backend.symmetrize`, in place in one generated kernel that takes each orbit
        of blocks through shared memory (:func:`chainexec.runtime.pointwise.symmetrize`): one
        read and one write of ``out`` (of its kept elements). Out of place (a scratch tile, then
        ``out += Σ`` its permuted views, until 2026-11-27) it read six views and ``out`` and
        wrote ``out``: on an H200, 4.2 ms for a 1.39 GB (T) tile under six permutations, 1.3 ms
        under two."""
        pointwise.symmetrize(self.xp, out, axes, keep)

    def contract_sum(self, cs: list[Contraction], out, operands: list[tuple], fresh: bool = False) -> None:
        """As :meth:`Backend.contract_sum`: in one generated kernel that accumulates every term and
        adds to ``out`` once (:data:`chainexec.runtime.kernels.SUM_KINDS`: in registers,
        :mod:`chainexec.planner.sumkernel`, or on tensor cores into a shared-memory tile,
        :mod:`chainexec.planner.summma`), term by term, or *split*: the terms with short summed
        ranges in one kernel and the others one by one (:func:`~chainexec.planner.sumkernel.splits`),
        or *stacked*: terms that split the output alike as one contraction over their summed
        ranges concatenated, on copies of their small operands (:mod:`chainexec.planner.stacking`),
        whichever is fastest. Decided once per (terms, shapes, strides, dtype) and kept
        (:class:`TuningCache`): the model's best configurations of each kernel in
        :data:`TIMED_SUM_KINDS`, for all the terms and for each split's part, are timed computing
        without storing, and each term on its own (by its own tuned method) on a scratch output
        where the plan leaves room for one, else once for real on ``out``; a split costs its
        kernel plus the other terms' seconds; the stacks are timed on a scratch output plus the
        other terms' seconds, where the room holds the scratch and their copies. A kernel timed without storing skips one pass over
        the output that the terms' times include (on the o=24, v=180 (T) tile the split was
        timed at 19.8 ms and ran in 23.2 ms), so close decisions lean towards the kernels.
        ``CHAINEXEC_GPU_METHOD=sum`` or ``summma`` forces that kernel's first configuration,
        ``split`` the first split with the register kernel's first configuration and the other
        terms tuned (the terms one by one where either has none), ``stack`` the stacks where their
        copies fit (else the terms one by one); any other forced method runs
        the terms one by one.

        Measured on the H100 (``benchmarks/sum_tile.py``, 2026-11-23): on the (T) tile of o=24,
        v=180 the register kernel and the terms one by one (batched GEMM on tensor cores) take
        25–30 ms each; the register kernel wins where the terms sum over short ranges."""
        from chainexec.planner import sumkernel
        from chainexec.planner.kernelconf import Device
        from chainexec.runtime import kernels

        if self.method not in ("auto", "split", "stack", *kernels.SUM_KINDS):
            with self._reusing():
                super().contract_sum(cs, out, operands, fresh)
            return

        def view(arr, indices):
            return sumkernel.View(tuple(indices), tuple(arr.shape), _strides(arr))

        prob = sumkernel.problem(view(out, cs[0].out_indices),
                                 [sumkernel.Term(view(a, c.a_indices), view(b, c.b_indices), float(c.factor))
                                  for c, (a, b) in zip(cs, operands)], str(out.dtype))
        # the kernels timed are part of the key: a decision made without one is not reused once it joins
        key = ("sum", repr(prob), TIMED_SUM_KINDS, "stack") + (() if self.workspace is None else (self.workspace,))
        choice = self.choices.get(key) or (self.tuning.get(key) if self.method == "auto" else None)
        done = False
        if choice is None:
            dev = Device.from_cupy()

            def candidates(kind, p):
                try:
                    return kernels.SUM_KINDS[kind][0].candidates(p, dev)
                except ValueError:  # no configuration fits the device
                    return []

            if self.method == "stack":
                stacks = self._stacks(cs, out, operands)
                fits = self.workspace is None or stacked_bytes(stacks, operands, out.itemsize) <= self.workspace
                choice = Choice("stack" if stacks and fits else "terms")
            elif self.method == "split":
                parts = sumkernel.splits(prob)
                cands = candidates("sum", prob.part(parts[0])) if parts else []
                choice = (Choice("split", config={"kind": "sum", "config": cands[0].to_json(), "terms": list(parts[0])})
                          if cands else Choice("terms"))
            elif self.method != "auto":
                cands = candidates(self.method, prob)
                choice = Choice(self.method, config=cands[0].to_json()) if cands else Choice("terms")
            else:
                if fresh:  # timing a term may add it to ``out`` for real
                    self.clear(out)
                    fresh = False
                seconds, configs = {}, {}
                each, done = self._time_terms(cs, out, operands)
                seconds["terms"] = sum(each)
                jobs = [(part, kind, cfg) for part in [tuple(range(len(cs)))] + sumkernel.splits(prob)
                        for kind in TIMED_SUM_KINDS for cfg in candidates(kind, prob.part(part))]
                kernels.precompile([kernels.SUM_KINDS[kind][0].generate(prob.part(part), cfg) for part, kind, cfg in jobs],
                                   dev.compute_capability)
                for part, kind, cfg in jobs:
                    sub, ops = prob.part(part), [operands[k] for k in part]
                    rest = sum(s for k, s in enumerate(each) if k not in part)
                    name = f"{kind} {cfg.name()}"
                    if len(part) < len(cs):
                        name = f"split {name} terms {','.join(map(str, part))}"
                        configs[name] = ("split", {"kind": kind, "config": cfg.to_json(), "terms": list(part)})
                    else:
                        configs[name] = (kind, cfg.to_json())
                    seconds[name] = rest + self._timed(lambda: kernels.launch_sum(kind, sub, cfg, out, ops, False))
                stacks = self._stacks(cs, out, operands)
                room = self.workspace
                if stacks and (room is None or 2 * out.nbytes + stacked_bytes(stacks, operands, out.itemsize) <= room):
                    scratch = _like(self.xp, out)
                    rest = sum(s for k, s in enumerate(each) if not any(k in st.terms for st in stacks))
                    # the stacked contractions are first tuned inside this timing, beside the scratch
                    self.workspace = None if room is None else room - scratch.nbytes
                    try:
                        seconds["stack"] = rest + self._timed(lambda: self._stacked(stacks, cs, scratch, operands))
                    finally:
                        self.workspace = room
                    del scratch
                best = min(seconds, key=seconds.get)
                kind, config = configs.get(best, (best if best == "stack" else "terms", None))
                choice = Choice(kind, seconds, config)
                self.tuning.put(key, choice)
        self.choices[key] = choice
        with self._reusing():
            self._sum(key, choice, done, prob, cs, out, operands, fresh)

    def _sum(self, key: tuple, choice: Choice, done: bool, prob, cs: list[Contraction], out,
             operands: list[tuple], fresh: bool) -> None:
        """Run :meth:`contract_sum`'s decision (nothing where timing the terms on ``out`` added
        them already); ``key`` the run's tuning key, under which a stacked run's stacks are kept
        (finding them took 0.13 ms per (T) tile). A ``fresh`` output is written first by the
        first stack, or the first term, as :meth:`contract` writes a fresh one; a generated
        kernel adds, so before one it is cleared."""
        from chainexec.runtime import kernels

        if done:
            return
        if fresh and (choice.method in kernels.SUM_KINDS or choice.method == "split"):
            self.clear(out)
            fresh = False
        if choice.method in kernels.SUM_KINDS:
            kind_config = kernels.SUM_KINDS[choice.method][1].from_json(choice.config)
            kernels.launch_sum(choice.method, prob, kind_config, out, operands)
        elif choice.method == "stack":
            if key not in self._stack_runs:
                stacks = self._stacks(cs, out, operands)
                self._stack_runs[key] = stacks, [k for k in range(len(cs)) if not any(k in st.terms for st in stacks)]
            stacks, alone = self._stack_runs[key]
            self._stacked(stacks, cs, out, operands, fresh)
            super().contract_sum([cs[k] for k in alone], out, [operands[k] for k in alone], fresh and not stacks)
        elif choice.method == "split":
            part, kind = choice.config["terms"], choice.config["kind"]
            kernels.launch_sum(kind, prob.part(tuple(part)), kernels.SUM_KINDS[kind][1].from_json(choice.config["config"]),
                               out, [operands[k] for k in part])
            super().contract_sum([c for k, c in enumerate(cs) if k not in part], out,
                                 [x for k, x in enumerate(operands) if k not in part])
        else:
            super().contract_sum(cs, out, operands, fresh)

    @staticmethod
    def _stacks(cs: list[Contraction], out, operands: list[tuple]) -> list:
        """:func:`chainexec.planner.stacking.groups` of a run's terms at these extents."""
        extents = [dict(zip(c.out_indices, out.shape)) | _sizes(c, a, b) for c, (a, b) in zip(cs, operands)]
        return stacking.groups(tuple(cs[0].out_indices), [(tuple(c.a_indices), tuple(c.b_indices)) for c in cs],
                               extents)

    def _stacked(self, stacks: list, cs: list[Contraction], out, operands: list[tuple], fresh: bool = False) -> None:
        """Add each stack's terms to ``out`` as one contraction (:mod:`chainexec.planner.stacking`)
        on copies of their operands concatenated along a new summed index, each term's factor
        in its ``L`` rows; that contraction is tuned as any other (:meth:`contract`), the first
        ``fresh`` where ``out`` is. While it runs the copies count against :attr:`workspace`."""
        xp = self.xp
        extent = dict(zip(cs[0].out_indices, out.shape))
        for st in stacks:
            self._drop_kept()  # no earlier term's relayout copy held beside this stack's
            parts = []
            for n, side in zip(st.terms, st.sides):
                c, (a, b) = cs[n], operands[n]
                (x, xi), (y, yi) = ((a, c.a_indices), (b, c.b_indices))[::1 if side else -1]
                ks = [i for i in xi if i in yi and i not in c.out_indices]
                parts.append((c.factor, _spread(x, xi, ks + list(st.left)), _spread(y, yi, ks + list(st.right)),
                              len(ks)))
            depth = sum(math.prod(x.shape[:nk]) for _, x, _, nk in parts)
            left = xp.empty((depth,) + tuple(extent[i] for i in st.left), out.dtype)
            right = xp.empty((depth,) + tuple(extent[i] for i in st.right), out.dtype)
            at = 0
            for factor, x, y, nk in parts:
                k = math.prod(x.shape[:nk])
                xp.multiply(x, factor, out=left[at:at + k].reshape(x.shape))
                right[at:at + k].reshape(y.shape)[...] = y
                at += k
            name = next(f"stacked{n}" for n in range(len(cs[0].out_indices) + 1)
                        if f"stacked{n}" not in cs[0].out_indices)
            merged = replace(cs[st.terms[0]], a="stacked", a_indices=[name, *st.left], b="stacked",
                             b_indices=[name, *st.right], factor=1.0)
            room = self.workspace
            if room is not None:
                self.workspace = room - left.nbytes - right.nbytes
            try:
                self.contract(merged, out, left, right, fresh and st is stacks[0])
            finally:
                self.workspace = room
            del left, right, parts  # freed before the next stack's copies

    @contextlib.contextmanager
    def _reusing(self):
        """Within a run of terms into one output, a relayout copy is kept for the next term
        (:meth:`_relaid_copy`): in (T), W's terms ``ovvv[k,c,f,a]·t2`` and ``ovvv[k,c,f,b]·t2``
        copy the same slice to the same order, 0.39 ms each per tile at v=400 on the H100."""
        self._kept = {}
        try:
            yield
        finally:
            self._kept = None

    def _drop_kept(self) -> None:
        """Free the relayout copies kept so far in this run (:meth:`_reusing`), if any."""
        if self._kept:
            self._kept.clear()

    @contextlib.contextmanager
    def steady(self, arrays):
        """As :meth:`Backend.steady`: a relayout copy of a view of a steady array is kept from
        statement to statement and tile to tile (:meth:`_relaid_copy`), and dropped on leaving
        (an inner loop's: those of arrays not steady in the outer one). In (T) the terms
        ``ovvv[k,c,f,a]·t2`` and ``ovvv[k,c,f,b]·t2`` copy the slice ``ovvv[k]`` (0.39 ms at
        v=400 on the H100) once per k instead of once per tile. The outermost one sets
        1/:data:`HOLD_SHARE` of the room the plan leaves aside for the held copies: the rest is
        what the autotuner and the methods' temporaries may use meanwhile (:attr:`workspace`, also
        in the tuning keys), so that held copies and temporaries together stay within it."""
        outer, room, spans = self._steady, self.workspace, [_span(x) for x in arrays]
        reserve = outer is None and spans and room is not None
        if reserve:
            self._hold_room = room // HOLD_SHARE
            self.workspace = room - self._hold_room
        self._steady = (outer or []) + spans
        try:
            yield
        finally:
            self._steady = outer
            if reserve:
                self.workspace, self._hold_room = room, None
            for slot, (_, _, span) in list(self._held.items()):
                if not _inside(span, outer or []):
                    del self._held[slot]

    def _relaid_copy(self, slot: int, x, perm: tuple, out):
        """``x`` permuted by ``perm``, C-contiguous (:meth:`_contiguous`). Inside
        :meth:`_reusing` the copy last made for operand position ``slot`` when it is of the same
        memory, shape, strides and permutation. Only one copy per position is kept (the previous
        one is dropped before a new one is made), and none across other methods (:meth:`_run`),
        so a run holds no more than one term's relayout temporaries, as the autotuner's room
        assumes. Not where ``x`` overlaps ``out``, which the run changes. A view of a
        :meth:`steady` array has its copy held across runs instead, one per position, where the
        held copies fit in the room :meth:`steady` sets aside for them."""
        if _overlaps(x, out):
            return self._contiguous(x.transpose(perm))
        key = (x.data.ptr, x.shape, x.strides, tuple(perm), x.dtype.str)
        span = _span(x)
        others = sum(copy.nbytes for s, (_, copy, _) in self._held.items() if s != slot)
        if self._steady and _inside(span, self._steady) and (
                self._hold_room is None or others + x.nbytes <= self._hold_room):
            kept = self._held
        elif self._kept is not None:
            kept = self._kept
        else:
            return self._contiguous(x.transpose(perm))
        if kept.get(slot, (None,))[0] != key:
            kept.pop(slot, None)
            kept[slot] = (key, self._contiguous(x.transpose(perm)), span)
        return kept[slot][1]

    def _time_terms(self, cs: list[Contraction], out, operands: list[tuple]) -> tuple[list[float], bool]:
        """Seconds of each term on its own, and whether ``out`` got them: timed on a scratch
        output (:func:`_like`) after a warm-up where the plan leaves room for two outputs, else
        run once on ``out`` itself (their first run, a little slower than later ones)."""
        hows = [self._choose(c, out, a, b) for c, (a, b) in zip(cs, operands)]  # tuned on probes
        if self.workspace is None or 2 * out.nbytes <= self.workspace:
            scratch = _like(self.xp, out)
            return [self._timed(lambda: self._run(how, c, scratch, a, b))
                    for how, c, (a, b) in zip(hows, cs, operands)], False
        events = [self.xp.cuda.Event() for _ in range(len(cs) + 1)]
        events[0].record()
        for how, c, (a, b), end in zip(hows, cs, operands, events[1:]):
            self._run(how, c, out, a, b)
            end.record()
        events[-1].synchronize()
        return [self.xp.cuda.get_elapsed_time(s, e) / 1e3 for s, e in zip(events, events[1:])], True

    def gather(self, out, a, axis: int, index: np.ndarray, merge: bool, factor: float, fresh: bool) -> None:
        """``out (+)= factor · a`` taken at ``index`` along ``axis`` (``a``'s axes ``axis`` and
        ``axis + 1`` merged first where ``merge``): a pair index unpacked into its members or
        members packed into their pair (:mod:`chainexec.planner.packed`). ``fresh``: ``out`` holds
        nothing yet (written, not added to). ``index`` is a host array the caller keeps; its
        copy on the device is made once."""
        if merge:
            a = a.reshape(a.shape[:axis] + (-1,) + a.shape[axis + 2:])
        device = self.indexes.get(id(index))
        if device is None or device[0] is not index:
            device = self.indexes[id(index)] = (index, self.xp.asarray(index))
        taken = self.xp.take(a, device[1], axis=axis)
        if factor != 1.0:
            taken *= factor
        if fresh:
            out[...] = taken
        else:
            out += taken

    def contract(self, c: Contraction, out, a, b, fresh: bool = False) -> None:
        """``out += c.factor · a·b`` on the GPU by the chosen method; see :class:`Backend`. A
        ``fresh`` output is written by cuBLAS with β = 0 where batched GEMM runs it (no zero fill
        and no read of ``out``: the (T) W tile's 20 fills took 5.9 ms of 0.155 s of device time
        at benzene's shapes on an H100, 2026-11-27), else cleared first (:meth:`_run`).

        When the chosen method's workspace does not fit in the device memory left (CuPy's
        OutOfMemoryError, also under a pool limit), the contraction runs through GETT where it
        applies, else the direct kernel: neither needs any (``out`` is untouched by the failed
        attempt: every method adds its product only once it is complete)."""
        if b is None or c.pointwise():
            self.contract_terms([c], out, [(a, b)], fresh)
        else:
            how = self._choose(c, out, a, b)
            try:
                self._run(how, c, out, a, b, fresh)
            except self.xp.cuda.memory.OutOfMemoryError:
                if how[0] in IN_PLACE:
                    raise ChainexecError(f"device memory: none left for {c.out}[{','.join(c.out_indices)}] += "
                                         f"{c.a}·{c.b} ({how[0]}, tile {'x'.join(map(str, out.shape))}); "
                                         f"lower machine.device_memory") from None
                gp = self._problem(c, out, a, b)
                fallback = ("direct", None) if gp is None else ("gett", {"order": gp[1][0][0], **asdict(gp[1][0][1])})
                self._run(fallback, c, out, a, b, fresh)
                self.choices[self._kept_key(c, out, a, b)] = Choice(fallback[0], config=fallback[1])
        pool = self.xp.get_default_memory_pool()
        if self.memory is not None and pool.total_bytes() > self.memory and pool.free_bytes():
            # temporaries of differently shaped tiles, cached: 1.12 GB held against 1 GiB in the
            # out-of-core four-index run with every choice within the room
            pool.free_all_blocks()

    # -- method choice ---------------------------------------------------------------------

    def _kernel(self, c: Contraction, sizes: dict, dtype):
        """The generated COGENT kernel for this contraction and tile extents, or None where none
        applies (batch index, a 0-d tensor, dtype, extents, no surviving configuration)."""
        key = (tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices), tuple(sorted(sizes.items())),
               str(dtype))
        if key not in self._kernels:
            from chainexec.runtime import kernels

            kern = None
            if (str(dtype) in ("float32", "float64") and max(sizes.values()) < 2**31
                    and all((c.out_indices, c.a_indices, c.b_indices))):  # no 0-d tensor
                try:
                    kern = kernels.get_kernel(c.out_indices, c.a_indices, c.b_indices, sizes, str(dtype))
                except ValueError:  # batch index or no configuration survives
                    kern = None
            self._kernels[key] = kern
        return self._kernels[key]

    def _problem(self, c: Contraction, out, a, b):
        """GETT problems by order with their device tables, and the model's ranked
        (order, configuration) candidates for these operands (float64 only), cached by shapes
        and strides; None where GETT does not apply, or where its tables (kept for the process)
        would not fit in the room the plan leaves: in the 4 MiB demo on the H100 they held the
        allocator 2 % above the limit."""
        if out.dtype != np.float64 or out.size < GETT_MIN_OUTPUT:
            return None
        key = self._key(c, out, a, b)
        if key not in self._gett:
            from chainexec.planner import gett
            from chainexec.runtime import kernels

            strides = tuple(dict(zip(idx, _strides(x))) for idx, x in
                            ((c.out_indices, out), (c.a_indices, a), (c.b_indices, b)))
            probs = gett.variants(tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices),
                                  _sizes(c, a, b), strides)
            dev = self.xp.cuda.Device()
            cands = gett.candidates(probs, dev.attributes["MultiProcessorCount"], TUNE_TOP,
                                    int(dev.compute_capability))
            host = {o: gett.tables(p, strides) for o, p in probs.items()} if cands else {}
            need = sum(t.nbytes for h in host.values() for t in h.values())
            fits = self.workspace is None or self.table_bytes + need <= self.workspace
            self._gett[key] = None
            if cands and fits:
                self._gett[key] = ({o: (p, kernels.GettTables(p, strides, host[o])) for o, p in probs.items()}, cands)
                self.table_bytes += need
        return self._gett[key]

    def _batched(self, c: Contraction, out, a, b):
        """The batched-GEMM layout of these operands (cached by shapes and strides), its BLAS form,
        its launches and each pointer-array launch's byte offsets as a (3, matrices) device array,
        or None where none applies (dtype, a mode in one tensor only, BLAS's 32-bit dimensions
        exceeded)."""
        key = self._key(c, out, a, b)
        if key not in self._batches:
            g = None
            if out.dtype in (np.float32, np.float64) and a.dtype == b.dtype == out.dtype:
                strides = tuple(dict(zip(idx, _strides(x))) for idx, x in
                                ((c.out_indices, out), (c.a_indices, a), (c.b_indices, b)))
                g = batchedgemm.plan(c.out_indices, c.a_indices, c.b_indices, _sizes(c, a, b) | dict(
                    zip(c.out_indices, out.shape)), strides)
            self._batches[key] = None
            if g is not None:
                bl, launches = batchedgemm.blas(g), g.launches()
                if max([bl.m, bl.n, bl.k, bl.lda, bl.ldb, bl.ldc, g.batch[0]]
                       + [len(launch.offsets) for launch in launches]) < 2**31:
                    self._batches[key] = (g, bl, launches, [
                        None if launch.strided else self.xp.asarray(
                            np.ascontiguousarray(launch.offsets.T) * out.itemsize)
                        for launch in launches])
        return self._batches[key]

    def batched_gemm(self, c: Contraction, out, a, b, alpha: float, beta: float = 1.0) -> bool:
        """``out = alpha·a·b + beta·out`` by :meth:`_batched`'s cuBLAS calls on the current
        stream; False (nothing done) where no layout applies."""
        found = self._batched(c, out, a, b)
        if found is None:
            return False
        from cupy_backends.cuda.libs import cublas

        g, bl, launches, offsets = found
        handle = self.xp.cuda.device.get_cublas_handle()
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        double = out.dtype == np.float64
        strided = cublas.dgemmStridedBatched if double else cublas.sgemmStridedBatched
        pointers = cublas.dgemmBatched if double else cublas.sgemmBatched
        ops = tuple(cublas.CUBLAS_OP_T if t else cublas.CUBLAS_OP_N for t in (bl.trans_a, bl.trans_b))
        lhs, rhs = (1, 0) if bl.swap else (0, 1)
        base = (a.data.ptr, b.data.ptr, out.data.ptr)
        count, *steps = g.batch
        size = out.itemsize
        # every launch's matrix addresses before the first call: a failed allocation then leaves
        # ``out`` untouched for the caller's fallback. Each base address is a kernel argument: a
        # host array copied to the device here would wait for all the work queued before it.
        ats = [None if table is None else self._addresses(table, base) for table in offsets]
        for launch, at in zip(launches, ats):
            second = beta if launch.first else 1.0
            keep, one, two = gemm_scalars(strided if launch.strided else pointers, alpha, second, out.dtype)
            uselog.note(self.tuning.device, "gemms",  # for the next process's warm-up
                        ("d" if double else "s", bool(launch.strided), bool(bl.trans_a), bool(bl.trans_b),
                         *map(int, (bl.m, bl.n, bl.k, bl.lda, bl.ldb, bl.ldc)),
                         int(count if launch.strided else len(launch.offsets)), int(second != 0)))
            if launch.strided:
                at = [p + int(o) * size for p, o in zip(base, launch.offsets[0])]
                strided(handle, *ops, bl.m, bl.n, bl.k, one, at[lhs], bl.lda, steps[lhs], at[rhs], bl.ldb,
                        steps[rhs], two, at[2], bl.ldc, steps[2], count)
            else:
                # addresses made on the device from the byte offsets kept there; CuPy's pool
                # reuses their block only for work queued later on the same stream
                pointers(handle, *ops, bl.m, bl.n, bl.k, one, at[lhs].data.ptr, bl.lda, at[rhs].data.ptr,
                         bl.ldb, two, at[2].data.ptr, bl.ldc, at.shape[1])
        return True

    def _addresses(self, table, base: tuple[int, int, int]):
        """The (3, matrices) device addresses of a pointer-array launch: row r of ``table`` (byte
        offsets) plus ``base[r]``, added on the device with the address as a kernel argument."""
        at = self.xp.empty_like(table)
        for row, address in enumerate(base):
            self.xp.add(table[row], address, out=at[row])
        return at

    def _relayout(self, c: Contraction, out, a, b):
        """:meth:`_batched`'s layout for C-contiguous copies of ``a`` and ``b`` in the orders of
        :func:`_relaid`, or None (the copies are described by shape, not made)."""
        moved, pa, pb = _relaid(c)
        copies = [_Contiguous(tuple(x.shape[p] for p in perm), x.dtype) for x, perm in ((a, pa), (b, pb))]
        return self._batched(moved, out, *copies)

    def _contiguous(self, view):
        """A C-contiguous copy of a permuted view, by a generated point-wise kernel, which reads
        a view stepping across the copy's fastest index through shared memory
        (:func:`chainexec.runtime.pointwise.staging`): on the H100, 0.39 ms against 0.63 ms for
        ``cupy.ascontiguousarray`` to copy (T)'s ``ovvv[k,c,f,a]`` to ``[f,a,c]`` at v=400."""
        if view.flags.c_contiguous:
            return view
        copy = self.xp.empty(view.shape, view.dtype)
        pointwise.launch(self.xp, "p0", [view], copy)
        return copy

    def _candidates(self, c: Contraction, out, a, b) -> dict:
        """Method name -> configuration (plain data, or None), for every method that applies:
        ``gett:<order>:<config>`` for the model's top GETT candidates, ``batched`` (batched GEMM in
        place), ``relayout`` (batched GEMM on permuted copies, where they make larger GEMMs),
        ``kernel`` (COGENT), ``ttgt``, ``einsum``, ``direct`` and, where installed, ``cutensor``."""
        cands = {}
        gp = self._problem(c, out, a, b)
        if gp is not None:
            for order, cfg in gp[1]:
                cands[f"gett:{order}:{cfg.name()}"] = {"order": order, **asdict(cfg)}
        in_place = self._batched(c, out, a, b)
        if in_place is not None:
            cands["batched"] = None
        copied = self._relayout(c, out, a, b)
        if copied is not None and (in_place is None or _gemm_size(copied[0]) > _gemm_size(in_place[0])):
            cands["relayout"] = None
        if self._kernel(c, _sizes(c, a, b), out.dtype) is not None:  # made, not used: not logged
            cands["kernel"] = None
        cands["ttgt"] = None
        cands["einsum"] = None
        cands["direct"] = None
        if (_cutensor(self.xp) is not None and str(out.dtype) in ("float32", "float64")
                and all((c.out_indices, c.a_indices, c.b_indices))):  # no 0-d tensor
            cands["cutensor"] = None
        return cands

    @staticmethod
    def _key(c: Contraction, out, a, b) -> tuple:
        """What a method choice depends on: the contraction, shapes, strides and dtype."""
        return (tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices), a.shape, b.shape, out.shape,
                _strides(out), _strides(a), _strides(b), str(out.dtype))

    def _choose(self, c: Contraction, out, a, b) -> tuple:
        """(method, GETT config or None) for these operands, decided once: forced by
        ``CHAINEXEC_GPU_METHOD``, else read from the tuning cache, else timed (the model
        proposes the GETT configurations; the fastest candidate wins) and recorded. Large
        operands are timed on a probe (:func:`_probe`): the same strides over fewer elements."""
        kept = self._kept_key(c, out, a, b)
        choice = self.choices.get(kept)
        if choice is None:
            if self.method not in ("auto", "split", "stack"):  # a forced split or stack tunes the terms as auto
                cands = self._candidates(c, out, a, b)
                forced = [m for m in cands if m.split(":")[0] == self.method] or ["ttgt"]
                choice = Choice(forced[0].split(":")[0], config=cands[forced[0]])
            else:
                choice = self.tuning.get(kept)
                if choice is None:
                    self._drop_kept()  # no relayout copy of an earlier term held while tuning this one
                    # a probe of at least PROBE_FLOOR: smaller ones change every method's shape
                    limit = TUNE_BYTES if self.workspace is None else min(TUNE_BYTES, max(
                        PROBE_FLOOR, self.workspace // 4))
                    po, pa, pb = _probe(c, out, a, b, limit)
                    every = self._candidates(c, po, pa, pb)
                    cands = ({m: cfg for m, cfg in every.items()
                              if self._fits(m.split(":")[0], (out, a, b), (po, pa, pb))}
                             or {m: cfg for m, cfg in every.items() if not _workspace(m.split(":")[0], out, a, b)}
                             or every)
                    seconds = {m: self._time((m.split(":")[0], cfg), c, po, pa, pb) for m, cfg in cands.items()}
                    best = min(seconds, key=seconds.get)
                    choice = Choice(best.split(":")[0], seconds, cands[best])
                    self.tuning.put(kept, choice)
                    # the candidates' temporaries and scratch outputs, cached by CuPy's pool, are
                    # not needed again: left there they held the pool 1 GB above the plan's
                    # buffers in the first out-of-core four-index run
                    self.xp.get_default_memory_pool().free_all_blocks()
            self.choices[kept] = choice
        return choice.method, choice.config

    def _kept_key(self, c: Contraction, out, a, b) -> tuple:
        """The key a method choice is kept under, in this process and in the tuning cache alike:
        :meth:`_key` and the room the plan leaves now (:attr:`workspace`). A choice made within
        less room is not read where a run leaves more: it tunes again. Until 2026-11-28 the
        process kept its choices without the room. The (T) W stacks' contractions, tuned first
        while the stack itself was timed (the room less a scratch tile), were then run from
        that in-process choice, never under the room they run in. So the next process tuned
        them again: 1.5-1.8 s of executor in the run after a cold one, against 0.16-0.20 s in
        later runs (H100, benzene-size (T), 2026-11-28)."""
        key = self._key(c, out, a, b)
        return key if self.workspace is None else key + (self.workspace,)

    def _fits(self, method: str, tile: tuple, probe: tuple) -> bool:
        """Whether ``method``'s temporaries for the ``tile`` operands (out, a, b) — and, timing
        it on ``probe``, the probe's temporaries plus its scratch output (at most twice the
        probe's output, :func:`_like`; GETT times in place) —
        fit in the memory the plan leaves (:meth:`limit_memory`; always, without a limit)."""
        if self.workspace is None:
            return True
        scratch = 0 if method in IN_PLACE else 2 * probe[0].nbytes
        return max(_workspace(method, *tile), _workspace(method, *probe) + scratch) <= self.workspace

    def _time(self, how: tuple, c: Contraction, out, a, b) -> float:
        """Seconds of one contraction by ``how = (method, config)`` (best of :data:`TIMED_RUNS`
        after one warm-up, CUDA events). GETT and the direct kernel (:data:`IN_PLACE`) run in place
        with a factor of 0 (their cost does not depend on it, and ``out`` keeps its strides, which
        their speed depends on; a finite result is unchanged); the others write a scratch output with ``out``'s strides
        where its span is at most twice its size (:func:`_like`), so that layouts that depend on
        strides, as batched GEMM's do, are timed as they will run."""
        cp = self.xp
        if how[0] == "gett":
            def run():
                self._gett_call(how[1], c, out, a, b, alpha=0.0)
        elif how[0] == "direct":
            def run():
                pointwise.contract(cp, out, a, b, (c.out_indices, c.a_indices, c.b_indices), 0.0)
        else:
            scratch = []

            def run():
                if not scratch:
                    scratch.append(_like(cp, out))
                self._run(how, c, scratch[0], a, b)
        return self._timed(run)

    @uselog.paused()  # a candidate's kernels and calls are no use to a later warm-up
    def _timed(self, run) -> float:
        """Seconds of ``run()`` on the device: one untimed warm-up, then the best of
        :data:`TIMED_RUNS` CUDA-event-timed runs; ``inf`` if it cannot launch here (resources).
        No relayout copy is kept between the runs (:meth:`_reusing`, :meth:`steady`): each pays
        for its own."""
        cp = self.xp
        kept, self._kept = self._kept, None
        steady, self._steady = self._steady, None
        if kept:
            kept.clear()
        self._held.clear()
        try:
            try:
                run()
            except Exception:  # a candidate that cannot launch here is not chosen
                return math.inf
            start, end = cp.cuda.Event(), cp.cuda.Event()
            best = math.inf
            for _ in range(TIMED_RUNS):
                start.record()
                run()
                end.record()
                end.synchronize()
                best = min(best, cp.cuda.get_elapsed_time(start, end) / 1e3)
            return best
        finally:
            self._kept = kept
            self._steady = steady

    def _gett_call(self, config: dict, c: Contraction, out, a, b, alpha: float) -> None:
        """The GETT kernel of ``config`` (its ``order`` and :class:`GettConfig` fields)."""
        from chainexec.planner.gett import GettConfig
        from chainexec.runtime import kernels

        fields = dict(config)
        order = fields.pop("order")
        probs, cands = self._problem(c, out, a, b)
        order = order if order in probs else next(iter(probs))
        prob, tables = probs[order]
        cfg = GettConfig(**fields)
        if (cfg.a_k_fast, cfg.b_n_fast) != (prob.a_k_fast, prob.b_n_fast):
            # chosen on a probe whose cut made another load direction win: the model's best here
            cfg = next(x for o, x in cands if o == order)
        left, right = (b, a) if prob.swap else (a, b)
        kernels.launch_gett(cfg, tables, out, left, right, alpha, 1.0)

    def _run(self, how: tuple, c: Contraction, out, a, b, fresh: bool = False) -> None:
        """``out += factor · a·b`` by ``how = (method, config)``. The COGENT kernel needs
        C-contiguous operands (copied when they are views) and accumulates in place into a
        C-contiguous ``out``, otherwise into a temporary then added; GETT and the direct kernel
        take any views (the direct kernel also stands in for GETT where its tables do not fit).
        ``fresh`` (:meth:`contract`): batched GEMM writes ``out`` with β = 0 and TTGT copies its
        product into it (on the (T) diagonal tiles, 2026-11-27, an H200 trace showed that add
        reading the 1.39 GB tile, 1.13 ms each); the other methods add, and ``out`` is cleared
        before them."""
        cp = self.xp
        method, config = how
        if method != "relayout":
            self._drop_kept()
        if fresh and method not in ("batched", "relayout", "ttgt"):
            self.clear(out)
            fresh = False
        beta = 0.0 if fresh else 1.0
        if method == "gett" and self._problem(c, out, a, b) is not None:
            self._gett_call(config, c, out, a, b, c.factor)
        elif method in ("gett", "direct"):  # GETT chosen elsewhere (a probe, a cached choice) but no room here
            pointwise.contract(cp, out, a, b, (c.out_indices, c.a_indices, c.b_indices), c.factor)
        elif method == "batched":
            if not self.batched_gemm(c, out, a, b, c.factor, beta):  # chosen on a probe; no layout here
                self._add(out, _ttgt_product(cp, c, a, b), fresh)
        elif method == "relayout":
            if self._relayout(c, out, a, b) is None:  # chosen on a probe; no layout here
                self._add(out, _ttgt_product(cp, c, a, b), fresh)
            else:
                moved, pa, pb = _relaid(c)
                if not self.batched_gemm(moved, out, self._relaid_copy(0, a, pa, out),
                                         self._relaid_copy(1, b, pb, out), c.factor, beta):
                    # the copies' strides differ from their description (extent-1 or empty axes)
                    self._add(out, _ttgt_product(cp, c, a, b), fresh)
        elif method == "ttgt":
            self._add(out, _ttgt_product(cp, c, a, b), fresh)
        elif method in ("einsum", "cutensor"):
            sub = {i: chr(ord("a") + n) for n, i in enumerate(dict.fromkeys(c.a_indices + c.b_indices))}
            modes = ["".join(sub[i] for i in idx) for idx in (c.a_indices, c.b_indices, c.out_indices)]
            if method == "cutensor":
                _cutensor(cp).contraction(c.factor, a, tuple(modes[0]), b, tuple(modes[1]), 1.0, out,
                                          tuple(modes[2]))
                return
            product = cp.einsum("{},{}->{}".format(*modes), a, b)
            out += product if c.factor == 1.0 else c.factor * product
        else:
            kern = self._kernel(c, _sizes(c, a, b), out.dtype)
            if kern is None:  # chosen on a probe; no configuration survives at these extents
                out += _ttgt_product(cp, c, a, b)
                return
            left, right = cp.ascontiguousarray(a), cp.ascontiguousarray(b)
            if out.flags.c_contiguous:
                kern(left, right, out, alpha=c.factor, beta=1.0)
            else:
                out += kern(left, right, None, alpha=c.factor)

    @staticmethod
    def _add(out, product, fresh: bool) -> None:
        """``out += product``, or ``out[...] = product`` where ``out`` is fresh."""
        if fresh:
            out[...] = product
        else:
            out += product


def gemm_scalars(gemm, alpha: float, beta: float, dtype) -> tuple:
    """``(array, alpha, beta)`` as ``gemm`` (a CuPy cuBLAS binding) takes them in pointer mode
    host: recent CuPy by address (into the array, which must stay alive until the call
    returns), old versions by value. Only a signature that says so (its docstring) selects by
    value, since a value read as an address crashes cuBLAS."""
    values = np.array([alpha, beta], dtype)
    if _takes_values(gemm):
        return values, *values.tolist()
    return values, values.ctypes.data, values.ctypes.data + values.itemsize


@lru_cache(maxsize=None)
def _takes_values(gemm) -> bool:
    """Whether ``gemm``'s signature takes the scalars by value (read once per binding, not per
    launch)."""
    return any(f"{t} alpha" in (gemm.__doc__ or "") for t in ("double", "float"))


TUNING_VERSION = 7
"""Part of every tuning-cache key: raise it when methods or GETT configurations change meaning,
so that decisions recorded by older code are not read back."""


class TuningCache:
    """The autotuner's decisions, kept across processes in ``<kernel cache>/tuning/``: one file
    per decision, named by the SHA-256 of its key (device name and contraction, shapes, strides,
    dtype) and holding the key and the :class:`Choice`, written atomically (temporary file, then
    rename). A lookup reads one small file, so another process's decision is seen at once and
    a process reads only the decisions it needs.

    Why: until 2026-11-27 every decision lived in one ``tuning.json``, read whole by each new
    backend before its first statement and rewritten whole by each new decision. At the GPU
    hosts' 391 decisions (450 kB) one read took 8 ms on the 2-core VM, the cost grows with every
    shape a user's runs meet; the first tile of a (T) process waited 6.8 ms for host work before
    its first kernel (H200 trace, 2026-11-27), this read likely among it (not timed apart on the
    GPU host). A decision found only in an
    older ``tuning.json`` beside the folder (read once, on the first miss) is moved to a file of
    its own."""

    def __init__(self, device: str, path: Path):
        self.device = device
        self.path = path  # the folder
        self._legacy: dict | None = None  # the older tuning.json, once read

    @classmethod
    def for_device(cls, cupy) -> "TuningCache":
        """The cache of the current CuPy device, in the kernel cache's folder."""
        from chainexec.runtime.kernels import cache_dir

        return cls(uselog.device_name(cupy), cache_dir() / "tuning")

    def _key(self, key: tuple) -> str:
        return json.dumps([TUNING_VERSION, self.device, *key])

    def _file(self, text: str) -> Path:
        return self.path / f"{hashlib.sha256(text.encode()).hexdigest()}.json"

    def get(self, key: tuple) -> Choice | None:
        text = self._key(key)
        try:
            entry = json.loads(self._file(text).read_text())
            if isinstance(entry, dict) and entry.get("key") == text:
                return Choice(**entry["choice"])
        except (OSError, ValueError, TypeError, KeyError):
            pass
        if self._legacy is None:
            try:
                self._legacy = json.loads((self.path.parent / "tuning.json").read_text())
            except (OSError, ValueError):
                self._legacy = {}
        entry = self._legacy.get(text) if isinstance(self._legacy, dict) else None
        try:
            choice = Choice(**entry)
        except TypeError:  # not there, or not a decision
            return None
        self.put(key, choice)
        return choice

    def put(self, key: tuple, choice: Choice) -> None:
        text = self._key(key)
        atomicfile.write(self._file(text), json.dumps({"key": text, "choice": asdict(choice)}), 0o644)


def select(name: str = "auto", comm=None) -> Backend:
    """``numpy``, ``cupy``, or ``auto`` (CuPy when it imports and sees a GPU, else NumPy).

    With CuPy, the rank takes GPU ``local rank mod GPUs on the node``: one rank per GPU (several
    ranks share a GPU when there are more ranks than GPUs). The contraction method comes from
    ``CHAINEXEC_GPU_METHOD`` (default ``auto``); an unknown value is an error on every backend."""
    if name not in ("auto", "numpy", "cupy"):
        raise ChainexecError(f"unknown backend {name!r} (auto, numpy or cupy)")
    method = os.environ.get("CHAINEXEC_GPU_METHOD", "auto")
    if method not in METHODS:
        raise ChainexecError(f"CHAINEXEC_GPU_METHOD={method!r} is not one of {', '.join(METHODS)}")
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
                if warmup.claim(device):  # where the command's start did not warm this device up
                    threading.Thread(target=warmup.warm_up, args=(cupy, device), name="chainexec-warm-up").start()
                return CupyBackend(cupy, method)
        except Exception as err:  # no cupy, no driver, no device: all mean "no GPU here"
            if name == "cupy":
                raise ChainexecError(f"backend cupy is not usable here: {err}") from None
        if name == "cupy":
            raise ChainexecError("backend cupy is not usable here: no GPU")
    return Backend()
