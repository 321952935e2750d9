"""The device level (γ) behind one seam: NumPy on the CPU, CuPy on a GPU.

Everything the executor does with device buffers goes through a :class:`Backend`: ``zeros``
(allocate), ``from_host`` (host → device), ``to_host`` (device → host) and ``contract``
(``out += factor · a·b``). The backend is chosen once (:func:`select`); no other module asks whether
it runs on a GPU.

Views. The executor passes slices of larger buffers (a fused intermediate's buffer spans more tiles
than one contraction works on), so ``out``, ``a`` and ``b`` may be non-contiguous. Both backends
accept any strided view; contiguous copies are made only where a method needs them (the TTGT
reshape of a permuted operand, the generated kernel's C-contiguous operands, a kernel result added
into a non-contiguous ``out``). Such copies are transient workspace that the plan's device budget
does not count.

Contraction methods on the GPU (:class:`CupyBackend`):

* ``ttgt`` — transpose–transpose–GEMM–transpose: permute ``a`` to (batch, a-external, contracted)
  and ``b`` to (batch, contracted, b-external), multiply with ``cupy.matmul`` (cuBLAS, FP64 tensor
  cores on Hopper), add the product permuted to ``out``'s order. Works for every contraction.
* ``kernel`` — the generated COGENT kernel (:mod:`chainexec.runtime.kernels`) for the tile's
  extents, launched with ``alpha = factor, beta = 1`` straight into ``out`` when ``out`` is
  C-contiguous. Only for contractions without batch indices, in float32/float64.

``auto`` (the default) times both once per (contraction, tile shape, dtype) on the real operands —
one untimed warm-up and the best of two CUDA-event-timed runs each, into scratch outputs — and
keeps the faster for the rest of the process (:attr:`CupyBackend.choices`). The environment
variable ``CHAINEXEC_GPU_METHOD`` (``auto``, ``kernel`` or ``ttgt``) forces a method for
benchmarks; ``kernel`` falls back to ``ttgt`` where no kernel applies.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from chainexec.errors import ChainexecError
from chainexec.planner.plan import Contraction
from chainexec.runtime.comm import local_rank

METHODS = ("auto", "kernel", "ttgt")
"""Values of ``CHAINEXEC_GPU_METHOD``: how :class:`CupyBackend` contracts."""
TIMED_RUNS = 2
"""CUDA-event-timed runs per method in the one-time comparison (the best one counts)."""


@lru_cache(maxsize=None)
def _ttgt(out: tuple, a: tuple, b: tuple):
    """Transpose-transpose-GEMM-transpose layout of ``out = a·b``: index groups batch (in all
    three), a-external, b-external and contracted (in a and b only), and the permutations that bring
    a to (batch, a-ext, k), b to (batch, k, b-ext) and the GEMM result to ``out``'s order."""
    batch = [i for i in out if i in a and i in b]
    aext = [i for i in out if i in a and i not in b]
    bext = [i for i in out if i in b and i not in a]
    ks = [i for i in a if i in b and i not in out]
    result = batch + aext + bext
    return (batch, aext, bext, ks, [a.index(i) for i in batch + aext + ks],
            [b.index(i) for i in batch + ks + bext], [result.index(i) for i in out])


def _sizes(c: Contraction, a, b) -> dict[str, int]:
    """Extent of every index of a binary contraction, read off the operands' shapes."""
    return dict(zip(c.a_indices, a.shape)) | dict(zip(c.b_indices, b.shape))


def _ttgt_product(xp, c: Contraction, a, b):
    """``factor · a·b`` as an array (module ``xp``) viewed in ``out``'s index order.

    The reshapes copy an operand only when its permutation is not a view-compatible layout; with
    no batch index the GEMM is 2-D (one plain GEMM call)."""
    batch, aext, bext, ks, pa, pb, pout = _ttgt(tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices))
    size = _sizes(c, a, b)
    if not ks:
        # Nothing summed (Hadamard or outer product): an element-wise broadcast, not a batch of
        # 1×1 GEMMs.
        product = (a.transpose(pa).reshape([size[i] for i in batch + aext] + [1] * len(bext))
                   * b.transpose(pb).reshape([size[i] for i in batch] + [1] * len(aext) + [size[i] for i in bext]))
        if c.factor != 1.0:
            product *= c.factor
        return product.transpose(pout)
    nb, na, nbx, nk = (math.prod(size[i] for i in g) for g in (batch, aext, bext, ks))
    lead = (nb,) if batch else ()
    left = a.transpose(pa).reshape(lead + (na, nk))
    right = b.transpose(pb).reshape(lead + (nk, nbx))
    product = xp.matmul(left, right).reshape([size[i] for i in batch + aext + bext])
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

    def zeros(self, shape, dtype):
        """A zero-filled device buffer of ``shape`` (elements) and ``dtype``."""
        return self.xp.zeros(shape, dtype=dtype)

    def from_host(self, host: np.ndarray):
        """``host`` as a device array (here: the same array; the executor copies it into place)."""
        return host

    def to_host(self, array) -> np.ndarray:
        """A device array as a host NumPy array (here: the same array)."""
        return array

    def contract(self, c: Contraction, out, a, b) -> None:
        """``out += c.factor · a·b`` over the contraction's indices (``b`` None: permuted copy).

        ``out``, ``a`` and ``b`` may be strided views of larger buffers; only ``out``'s view is
        written."""
        if b is None:
            out += c.factor * _permuted(c, a)
        else:
            out += _ttgt_product(np, c, a, b)


@dataclass
class Choice:
    """How :class:`CupyBackend` contracts one (contraction, tile shape, dtype): ``method`` is
    ``kernel`` or ``ttgt``; ``seconds`` the best timed run of each method compared (empty when
    the method was forced or only TTGT applies); ``config`` the kernel's COGENT configuration
    (tiles per index), when a kernel was built."""

    method: str
    seconds: dict = field(default_factory=dict)
    config: dict | None = None


class CupyBackend(Backend):
    """CuPy on the rank's GPU: buffers from CuPy's memory pool, device→host copies into pinned
    (page-locked) memory from CuPy's pinned pool, host→device DMA straight from pinned inputs,
    contractions by the faster of the generated
    kernel and TTGT (see the module docstring).

    Everything runs on the current (default) stream; ``contract`` synchronizes before it returns,
    so the executor's per-level seconds are the device's time, not just launch time. Transfers and
    compute therefore do not overlap yet."""

    name = "cupy"

    def __init__(self, cupy, method: str = "auto"):
        if method not in METHODS:
            raise ChainexecError(f"unknown GPU contraction method {method!r} ({', '.join(METHODS)})")
        super().__init__()
        self.xp = cupy
        self.method = method
        self.choices: dict[tuple, Choice] = {}
        self._kernels: dict[tuple, object] = {}

    def from_host(self, host: np.ndarray):
        """``host`` copied to a new device array. A page-locked (pinned) ``host`` is DMA'd
        directly (about 55 GB/s on the H100 machine); a pageable one goes through the driver's own
        staging (about 9 GB/s). Copying a pageable array into a pinned staging buffer first
        measured no faster (the host memcpy is the bottleneck; ``docs/gpu.md``), so the gain needs
        callers that receive their data into pinned memory."""
        if not host.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array into 1-d)
            host = host.copy(order="C")
        if not self._pinned(host):
            return self.xp.asarray(host)
        dev = self.xp.empty(host.shape, host.dtype)
        dev.set(host)  # synchronous from pinned memory
        return dev

    def _pinned(self, host: np.ndarray) -> bool:
        """Whether ``host``'s memory is page-locked (allocated or registered through CUDA)."""
        if host.nbytes == 0:
            return False
        rt = self.xp.cuda.runtime
        return rt.pointerGetAttributes(host.ctypes.data).type == rt.memoryTypeHost

    def to_host(self, array) -> np.ndarray:
        """Copy a device array (any view) into a new pinned host array (blocking); the pinned
        block goes back to CuPy's pinned pool when the caller drops the array."""
        import cupyx

        host = cupyx.empty_pinned(array.shape, array.dtype)
        # (copy() keeps a 0-d array 0-d; ascontiguousarray would make it 1-d)
        (array if array.flags.c_contiguous else array.copy()).get(out=host)
        return host

    def contract(self, c: Contraction, out, a, b) -> None:
        """``out += c.factor · a·b`` on the GPU by the chosen method; see :class:`Backend`."""
        if b is None:
            out += c.factor * _permuted(c, a)
        else:
            self._run(self._choose(c, out, a, b), c, out, a, b)
        self.xp.cuda.get_current_stream().synchronize()

    # -- method choice ---------------------------------------------------------------------

    def _kernel(self, c: Contraction, sizes: dict, dtype):
        """The generated kernel for this contraction and tile extents, or None where no kernel
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
                except ValueError:  # batch index or no configuration survives: TTGT only
                    kern = None
            self._kernels[key] = kern
        return self._kernels[key]

    def _choose(self, c: Contraction, out, a, b) -> str:
        """The method for this (contraction, shapes, dtype), decided once and cached."""
        key = (tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices), a.shape, b.shape, str(out.dtype))
        choice = self.choices.get(key)
        if choice is None:
            kern = None if self.method == "ttgt" else self._kernel(c, _sizes(c, a, b), out.dtype)
            config = None if kern is None else dict(kern.config.tiles)
            if kern is None:
                choice = Choice("ttgt")
            elif self.method == "kernel":
                choice = Choice("kernel", config=config)
            else:
                seconds = {m: self._time(m, c, out, a, b) for m in ("kernel", "ttgt")}
                choice = Choice(min(seconds, key=seconds.get), seconds, config)
            self.choices[key] = choice
        return choice.method

    def _time(self, method: str, c: Contraction, out, a, b) -> float:
        """Seconds of one contraction by ``method`` into a scratch output (best of
        :data:`TIMED_RUNS` after one warm-up), timed with CUDA events."""
        cp = self.xp
        scratch = cp.zeros(out.shape, out.dtype)
        self._run(method, c, scratch, a, b)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        best = math.inf
        for _ in range(TIMED_RUNS):
            start.record()
            self._run(method, c, scratch, a, b)
            end.record()
            end.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, end) / 1e3)
        return best

    def _run(self, method: str, c: Contraction, out, a, b) -> None:
        """``out += factor · a·b`` by ``method``. The kernel needs C-contiguous operands (copied
        when they are views); it accumulates in place (beta = 1) into a C-contiguous ``out``,
        otherwise into a temporary that is then added to the view."""
        cp = self.xp
        if method == "ttgt":
            out += _ttgt_product(cp, c, a, b)
            return
        kern = self._kernel(c, _sizes(c, a, b), out.dtype)
        left, right = cp.ascontiguousarray(a), cp.ascontiguousarray(b)
        if out.flags.c_contiguous:
            kern(left, right, out, alpha=c.factor, beta=1.0)
        else:
            out += kern(left, right, None, alpha=c.factor)


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
                cupy.cuda.Device(local_rank(comm) % count if comm is not None else 0).use()
                return CupyBackend(cupy, method)
        except Exception as err:  # no cupy, no driver, no device: all mean "no GPU here"
            if name == "cupy":
                raise ChainexecError(f"backend cupy is not usable here: {err}") from None
        if name == "cupy":
            raise ChainexecError("backend cupy is not usable here: no GPU")
    return Backend()
