"""Launches of the generated point-wise kernels (:mod:`chainexec.kernels.elementwise`,
:mod:`~chainexec.kernels.orbits`, :mod:`~chainexec.kernels.symmetrize`,
:mod:`~chainexec.kernels.direct`) over strided views, on the current stream.

Every device statement that sums over nothing goes through :func:`launch` (a permuted copy, a
Hadamard or outer product, a run of such terms into one buffer, a computed tensor's expression,
a fused statement), a fused statement into a scalar through :func:`reduce` or, where it reads
reused values, :func:`orbit_reduce`; a symmetrized run ends with :func:`symmetrize`, and the
``direct`` contraction method is :func:`contract`. The tile operations between views of any
shape (:func:`assign`, :func:`fill`, :func:`copy`) run the shape-generic kernels of
:mod:`chainexec.kernels.strided`, which a warm-up compiles at once with the other kernels of
every run (:func:`load_common`), and the moves between packed pairs and their members
(:func:`gather`) those of :mod:`chainexec.kernels.pairgather`. Each other kernel's source and grid (its *preparation*) is made
once per process and shape, and its arguments are logged for the next process's warm-up
(:func:`prepare`); each kernel is compiled through the kernel cache
(:mod:`chainexec.runtime.kernelcache`), once per machine, and loaded once per device.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

import numpy as np

from chainexec import packing
from chainexec.kernels import pairgather, strided
from chainexec.kernels.batchedgemm import ADDRESSES
from chainexec.kernels.direct import direct_source
from chainexec.kernels.elementwise import (BLOCK, blocks, index_type, layout, reduce_source, source, staging,
                                           total_source)
from chainexec.kernels.orbits import orbit_source, orbit_table, orbits
from chainexec.kernels.symmetrize import symmetrize_plan, symmetrize_source
from chainexec.runtime import kernelcache, uselog
from chainexec.runtime.backends.common import overlaps


def total(xp, partial, into) -> None:
    """Add Σ ``partial`` (float64, one dimension), summed in a fixed order (:func:`total_source`:
    the same bits every run), to the 0-d array ``into`` (float64 or float32)."""
    args = (into, partial, xp.uint32(partial.size))
    _kernel(xp, total_source(into.dtype.name), "chainexec_total")((1,), (BLOCK,), args)


def _kernel(xp, text: str, name: str):
    """The kernel ``name`` of ``text`` from the kernel cache (:mod:`chainexec.runtime.kernelcache`),
    logged on a GPU (:mod:`chainexec.runtime.uselog`, ``sources``) for the next process's warm-up;
    an array module without CUDA (the tests' recording ones) logs nothing."""
    if hasattr(xp, "cuda"):
        uselog.note(uselog.device_name(xp), "sources", (name, text))
    return kernelcache.function(name, text, kernelcache.POINTWISE_OPTIONS)[0]


def preload(text: str, name: str) -> None:
    """Load kernel ``name`` of ``text`` as :func:`_kernel` does, on the current device: the
    warm-up's way to load a logged kernel before a launch asks for it."""
    function = kernelcache.function(name, text, kernelcache.POINTWISE_OPTIONS)[0]
    _ = function.num_regs  # reading an attribute makes CUDA's lazy loading load it


def _ready(xp, make, *args):
    """``make(*args)``: one of the preparations of :data:`PREPARED`, each made once per process
    (a kernel's source and grid; an orbit kernel's tables). The first time, on a GPU, its
    arguments are logged (:mod:`chainexec.runtime.uselog`, ``prepared``), so that the next
    process of the job makes it before its executor, while its warm-up loads (:func:`prepare`)."""
    before = make.cache_info().misses
    made = make(*args)
    if make.cache_info().misses != before and hasattr(xp, "cuda"):
        uselog.note(uselog.device_name(xp), "prepared", (make.__name__, json.dumps(args, default=int)))
    return made


def _strides(views: list, walk: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Element strides: ``walk`` (the output's, or the order a reduction visits), then each
    view's (0 along its broadcast axes)."""
    return [walk] + [tuple(0 if n == 1 else s // v.itemsize for n, s in zip(v.shape, v.strides))
                                for v in views]


@lru_cache(maxsize=1024)
def _prepared(kind: str, code: str, shape: tuple[int, ...], strides: tuple[tuple[int, ...], ...],
              types: tuple[str, ...]) -> tuple[str, int]:
    """The source (:func:`source` or :func:`reduce_source`, by ``kind``) and grid of one kernel,
    made once per process: a (T) run launches the same few kernels on every tile."""
    make = source if kind == "chainexec_pointwise" else reduce_source
    return make(code, shape, list(strides), types), blocks(shape, staging(shape, list(strides), types))


def launch(xp, code: str, views: list, out) -> None:
    """``out[...] = code`` element by element on the current stream, ``views[k]`` read as ``pk``
    and ``out``'s current value as ``y``; every view has ``out``'s number of dimensions, with
    extent ``out``'s or 1 (broadcast) in each. Nothing here writes anything but ``out``'s view."""
    if math.prod(out.shape) == 0:
        return
    text, grid = _launch_made(xp, code, views, out)
    _kernel(xp, text, "chainexec_pointwise")((grid,), (BLOCK,), (out, *views))


def launch_kernels(xp, code: str, views: list, out) -> list[tuple[str, str]]:
    """The kernel :func:`launch` with these arguments runs, as (name, source) pairs for
    :func:`precompile` (none where ``out`` is empty), its preparation made (and logged) here. Here and
    in the other ``*_kernels`` functions the arrays may be stand-ins of the shapes, strides and
    dtypes of the real ones (:meth:`chainexec.runtime.buffers.Buffers.stand_in`)."""
    if math.prod(out.shape) == 0:
        return []
    return [("chainexec_pointwise", _launch_made(xp, code, views, out)[0])]


def _launch_made(xp, code: str, views: list, out) -> tuple[str, int]:
    """The source and grid of :func:`launch`'s kernel for these arguments (:func:`_ready`)."""
    shape, strides = layout(tuple(out.shape), _strides(views, tuple(s // out.itemsize for s in out.strides)))
    types = tuple(v.dtype.name for v in views) + (out.dtype.name,)
    return _ready(xp, _prepared, "chainexec_pointwise", code, shape, tuple(strides), types)


def reduce(xp, code: str, views: list, shape: tuple[int, ...], into) -> None:
    """Add Σ ``code`` over every element of ``shape`` (views as in :func:`launch`, each with
    extent ``shape``'s or 1 per dimension) to the 0-d array ``into`` (:func:`total`); threads walk
    ``shape`` in C order (its last dimension fastest)."""
    if math.prod(shape) == 0:
        return
    text, grid = _reduce_made(xp, code, views, shape)
    partial = xp.empty(grid, xp.float64)
    _kernel(xp, text, "chainexec_reduce")((grid,), (BLOCK,), (partial, *views))
    total(xp, partial, into)


def reduce_kernels(xp, code: str, views: list, shape: tuple[int, ...], into) -> list[tuple[str, str]]:
    """The kernel :func:`reduce` with these arguments runs (as :func:`launch_kernels`)."""
    if math.prod(shape) == 0:
        return []
    return [("chainexec_reduce", _reduce_made(xp, code, views, shape)[0])]


def _reduce_made(xp, code: str, views: list, shape: tuple[int, ...]) -> tuple[str, int]:
    """The source and grid of :func:`reduce`'s kernel for these arguments (:func:`_ready`)."""
    walk = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    merged, strides = layout(tuple(shape), _strides(views, walk))
    types = tuple(v.dtype.name for v in views) + ("float64",)
    return _ready(xp, _prepared, "chainexec_reduce", code, merged, tuple(strides), types)


@lru_cache(maxsize=256)
def _symmetrize_prepared(shape: tuple[int, ...], strides: tuple[int, ...], axes: tuple[tuple[int, ...], ...],
                         dtype: str, keep: tuple[tuple[int, ...], ...] = ()) -> tuple[str, int]:
    """The source and grid of one in-place symmetrization, made once per process."""
    plan = symmetrize_plan(shape, strides, axes, 8 if dtype == "float64" else 4)
    return symmetrize_source(shape, strides, axes, dtype, plan, keep), math.prod(plan.counts)


def symmetrize_kernels(xp, out, axes, keep: tuple[tuple[int, ...], ...] = ()) -> list[tuple[str, str]]:
    """The kernel :func:`symmetrize` with these arguments runs (as :func:`launch_kernels`)."""
    if math.prod(out.shape) == 0:
        return []
    return [("chainexec_symmetrize", _ready(xp, _symmetrize_prepared, *_symmetrized(out, axes, keep))[0])]


def precompile(xp, kernels: list[tuple[str, str]]) -> None:
    """Compile ``kernels`` ((name, source) pairs of the ``*_kernels`` functions) together, in
    threads, those the disk cache lacks (:func:`chainexec.runtime.kernelcache.precompile`): their
    launches then only load them, where each would otherwise wait for its own compile."""
    kernelcache.precompile(kernels, str(xp.cuda.Device().compute_capability), kernelcache.POINTWISE_OPTIONS)


def _symmetrized(out, axes, keep) -> tuple:
    """The arguments of :func:`_symmetrize_prepared` for ``out`` by ``axes`` at ``keep``."""
    return (tuple(out.shape), tuple(s // out.itemsize for s in out.strides), tuple(map(tuple, axes)),
            out.dtype.name, tuple(map(tuple, keep)))


def symmetrize(xp, out, axes, keep: tuple[tuple[int, ...], ...] = ()) -> None:
    """``out[...] = Σ out.transpose(p)`` over the axis permutations ``axes`` (a group mapping
    ``out``'s shape onto itself), in place, in one kernel (:func:`symmetrize_source`), at the
    points ``keep`` keeps."""
    if math.prod(out.shape) == 0:
        return
    text, grid = _ready(xp, _symmetrize_prepared, *_symmetrized(out, axes, keep))
    _kernel(xp, text, "chainexec_symmetrize")((grid,), (BLOCK,), (out,))


@lru_cache(maxsize=64)
def _table(xp, blocks: int, perms: tuple[tuple[int, ...], ...]):
    """:func:`orbit_table` on the device, made once per process and shape: kept outside the plan's
    device memory, as the reductions' partial sums are (4.9 MB for the (T) energy at v=400)."""
    return xp.asarray(orbit_table(blocks, perms)[0], dtype=xp.int32)


@lru_cache(maxsize=1024)
def _orbit_prepared(lets: tuple[str, ...], code: str, reads: tuple[tuple[int, tuple[int, ...]], ...],
                    shape: tuple[int, ...], strides: tuple[tuple[int, ...], ...], types: tuple[str, ...],
                    skip: int | None = None):
    """The :class:`Orbits`, source and grid of one orbit kernel, made once per process."""
    plan = orbits(shape, [p for _, p in reads], code, list(strides), types, len(lets))
    grid = plan.count * math.prod(n for d, n in enumerate(shape) if d not in plan.moved)
    return plan, orbit_source(lets, code, tuple(j for j, _ in reads), shape, list(strides), types, plan, skip), grid


def orbit_reduce(xp, lets: list[str], code: str, reads: list[tuple[int, tuple[int, ...]]], views: list,
                 shape: tuple[int, ...], dtype: str, into, skip: int | None = None) -> None:
    """Add to the 0-d array ``into`` (:func:`total`) Σ ``code`` over every element of ``shape``,
    where ``code`` reads the inputs ``views[k]`` as
    ``pk`` (as :func:`reduce`: extent ``shape``'s or 1 per dimension) and values of ``dtype``
    computed once per point, ``lets[j]`` (C code over the inputs), as ``q{r}``: read ``r`` is
    ``(j, p)``, the value of ``lets[j]`` at the point ``y`` with ``y[d] = x[p[d]]``, ``p`` a
    permutation of dimensions of one extent (:func:`orbit_source`). ``skip``: an input ``code``
    multiplies by (a weight); where it does not vary along the permuted dimensions, the blocks
    where it is zero are skipped."""
    if math.prod(shape) == 0:
        return
    plan, text, grid = _orbit_made(xp, lets, code, reads, views, shape, dtype, skip)
    partial = xp.empty(grid, xp.float64)
    table = _table(xp, -(-shape[plan.moved[0]] // plan.edge), plan.perms)
    function = _kernel(xp, text, "chainexec_orbits")
    if function.max_dynamic_shared_size_bytes < plan.shared:
        function.max_dynamic_shared_size_bytes = plan.shared
    function((grid,), (BLOCK,), (partial, *views, table), shared_mem=plan.shared)
    total(xp, partial, into)


def orbit_kernels(xp, lets: list[str], code: str, reads: list[tuple[int, tuple[int, ...]]], views: list,
                  shape: tuple[int, ...], dtype: str, into, skip: int | None = None) -> list[tuple[str, str]]:
    """The kernel :func:`orbit_reduce` with these arguments runs (as :func:`launch_kernels`)."""
    if math.prod(shape) == 0:
        return []
    return [("chainexec_orbits", _orbit_made(xp, lets, code, reads, views, shape, dtype, skip)[1])]


def _orbit_made(xp, lets, code, reads, views, shape, dtype, skip) -> tuple:
    """The :class:`Orbits`, source and grid of :func:`orbit_reduce`'s kernel for these arguments
    (:func:`_ready`)."""
    strides = _strides(views, (0,) * len(shape))[1:]
    types = tuple(v.dtype.name for v in views) + (dtype,)
    return _ready(xp, _orbit_prepared, tuple(lets), code, tuple((j, tuple(p)) for j, p in reads),
                  tuple(shape), tuple(strides), types, skip)


PREPARED = {make.__name__: make for make in (_prepared, _symmetrize_prepared, _orbit_prepared)}
"""The preparations :func:`_ready` logs, by name."""


def prepare(name: str, text: str) -> None:
    """Make the preparation ``name`` of :data:`PREPARED` from the arguments :func:`_ready` logged
    (``text``, JSON), as a launch with them would: the launch then finds it made. Why: otherwise a
    fresh process's executor makes them on its first tiles, host work the device waits for. Raises
    ValueError (or what the preparation raises) on anything else."""
    make = PREPARED.get(name)
    if make is None:
        raise ValueError(f"no preparation {name!r}")
    make(*_tuples(json.loads(text)))


def _tuples(value):
    """JSON's lists as the tuples the preparations take, at every depth."""
    return tuple(_tuples(x) for x in value) if isinstance(value, list) else value


def contract(xp, out, a, b, indices: tuple[list[str], list[str], list[str]], factor: float) -> None:
    """``out += factor · a·b`` for the binary contraction whose index lists (out, a, b) are
    ``indices``, over the views as they lie (:func:`direct_source`), on the current stream."""
    total = math.prod(out.shape)
    if total == 0:
        return
    kernel = _kernel(xp, direct_source(out, a, b, indices), "chainexec_direct")
    kernel(((total + BLOCK - 1) // BLOCK,), (BLOCK,), (out, a, b, xp.float64(factor)))


def _ints(index: str, values) -> tuple:
    """``values`` as the kernel arguments of C type ``index`` (``int`` or ``long long``)."""
    make = np.int32 if index == "int" else np.int64
    return tuple(make(v) for v in values)


def _scalar(out, value: float):
    """``value`` as a kernel argument of ``out``'s dtype."""
    return np.dtype(out.dtype).type(value)


def _strided(xp, op: str, out, views: list):
    """The kernel of :func:`chainexec.kernels.strided.strided_source` doing ``op`` on ``out``
    (and reading ``views``, none or one), its grid and its integer arguments (:func:`_strided_made`)."""
    text, name, grid, numbers = _strided_made(op, tuple(out.shape), tuple(out.strides), out.dtype.name,
                                              tuple((tuple(v.shape), tuple(v.strides), v.dtype.name) for v in views))
    return _kernel(xp, text, name), grid, numbers


@lru_cache(maxsize=4096)
def _strided_made(op: str, shape: tuple[int, ...], strides: tuple[int, ...], dtype: str, views: tuple) -> tuple:
    """The source, kernel name, grid and integer arguments (the element count, the merged extents
    but the first, then every array's strides) of ``op`` on an output of ``shape``, byte
    ``strides`` and ``dtype``, reading ``views`` ((shape, byte strides, dtype) each), made once per
    process and layout: the executor's tile operations repeat a few layouts on every tile.
    ValueError where a view does not broadcast to ``shape`` dimension by dimension or has another
    dtype."""
    if any(len(vs) != len(shape) or any(m not in (1, n) for m, n in zip(vs, shape)) for vs, _, _ in views):
        raise ValueError(f"{[vs for vs, _, _ in views]} do not broadcast to {shape} dimension by dimension")
    if any(t != dtype for _, _, t in views):
        raise ValueError(f"a tile operation takes one dtype: {[t for _, _, t in views]} into {dtype}")
    walk = tuple(s // np.dtype(dtype).itemsize for s in strides)
    reads = [tuple(0 if m == 1 else s // np.dtype(t).itemsize for m, s in zip(vs, st)) for vs, st, t in views]
    merged, merged_strides = layout(shape, [walk] + reads)
    n = math.prod(merged)
    grid = strided.grid(n)
    index = index_type([n + grid * BLOCK], merged, merged_strides)
    text = strided.strided_source(len(merged), dtype, index)
    numbers = _ints(index, (n, *merged[1:], *(s for st in merged_strides for s in st)))
    return text, f"chainexec_strided_{op}", grid, numbers


SHAPED_BYTES = 16 << 20
"""Smallest output (bytes) that :func:`assign` copies or adds into, by a factor of ±1, with the
kernel compiled for its shape (:func:`launch`: divisions by constants, unrolled, staged where a
view steps across ``out``'s fastest index) instead of the shape-generic one, whose divisions by
run-time extents and one element a thread hold it well below the copy bandwidth, and whose reads
of a view stepping across ``out``'s fastest index are strided. A compile (a tenth of a second,
once per shape and machine: the kernel cache keeps it) is repaid only by large copies; other
factors keep the generic kernel's rounding (no fused multiply-add)."""


def assign(xp, out, x, factor: float = 1.0, add: bool = False) -> None:
    """``out[...] = factor·x`` (``out += factor·x`` where ``add``) on the current stream, ``x``
    of ``out``'s dtype with ``out``'s number of dimensions and ``out``'s extent or 1 (broadcast)
    in each; ``x`` may be ``out`` itself. ValueError otherwise (the shape-generic kernel's checks).
    From :data:`SHAPED_BYTES` by the kernel of ``out``'s shape where the factor is ±1 and ``x``
    lies apart from ``out``."""
    if math.prod(out.shape) == 0:
        return
    if (out.nbytes >= SHAPED_BYTES and factor in (1.0, -1.0) and x.dtype == out.dtype and x.ndim == out.ndim
            and all(m in (1, n) for m, n in zip(x.shape, out.shape))):
        if not overlaps(out, x):
            value = "p0" if factor == 1.0 else "-p0"
            launch(xp, f"y + {value}" if add else value, [x], out)
            return
    kernel, grid, numbers = _strided(xp, "add" if add else "set", out, [x])
    kernel((grid,), (BLOCK,), (out, x, _scalar(out, factor), *numbers))


def fill(xp, out, value: float) -> None:
    """``out[...] = value`` on the current stream: a memset where ``value`` is 0 and ``out``
    is contiguous, else the fill kernel."""
    if math.prod(out.shape) == 0:
        return
    if value == 0 and out.flags.c_contiguous:
        out.data.memset_async(0, out.nbytes)
        return
    kernel, grid, numbers = _strided(xp, "fill", out, [])
    kernel((grid,), (BLOCK,), (out, _scalar(out, value), *numbers))


def copy(xp, x):
    """A new C-contiguous array holding ``x``'s values (0-d stays 0-d), on the current stream: a
    device-to-device copy where ``x`` is contiguous, else :func:`assign`."""
    out = xp.empty(x.shape, x.dtype)
    if x.flags.c_contiguous:
        if x.nbytes:
            out.data.copy_from_device_async(x.data, x.nbytes)
    else:
        assign(xp, out, x)
    return out


def gather(xp, out, a, axis: int, positions: tuple, after, factor: float, add: bool) -> None:
    """``out[...] = factor·a`` taken along ``axis`` at the pair ``positions`` of
    :meth:`chainexec.runtime.device.Backend.gather` (``a``'s axes already in the order
    ``before``), its axes then in the order ``after`` (None: as taken), ``out += …`` where
    ``add``; on the current stream, by the kernel of
    :func:`chainexec.kernels.pairgather.gather_source`, which computes each element's position
    (no table of positions). ValueError where the shapes or dtypes disagree."""
    if math.prod(out.shape) == 0:
        return
    if a.dtype != out.dtype:
        raise ValueError(f"a gather takes one dtype: {a.dtype} into {out.dtype}")
    step = [s // a.itemsize for s in a.strides]
    kind = positions[0]
    if kind == "unpack":
        _, k0, r0, r1, m0, m1 = positions
        shape = a.shape[:axis] + (r1 - r0, m1 - m0) + a.shape[axis + 1:]
        reads = step[:axis] + [None, None] + step[axis + 1:]
        members = (k0, r0, m0, step[axis])
    else:
        _, k0, k1, r0, m0, m1 = positions
        shape = a.shape[:axis] + (k1 - k0,) + a.shape[axis + 2:]
        reads = step[:axis] + [None] + step[axis + 2:]
        members = (k0, r0, m0, step[axis], step[axis + 1])
    if not _reads_within(a, axis, positions):
        raise ValueError(f"a {kind} at {positions} reads past {a.shape} along axis {axis}")
    order = tuple(range(len(shape))) if after is None else tuple(after)
    if tuple(shape[t] for t in order) != tuple(out.shape):
        raise ValueError(f"a {kind} of {a.shape} along axis {axis} at {positions} gives "
                         f"{tuple(shape[t] for t in order)}, not {out.shape}")
    special = tuple(order.index(axis + j) for j in range(pairgather.KINDS[kind]))
    text = pairgather.gather_source(kind, out.ndim, out.dtype.name, special)
    n = math.prod(out.shape)
    numbers = (n, *out.shape[1:], *(s // out.itemsize for s in out.strides),
               *(reads[t] for t in order if reads[t] is not None), *members)
    kernel = _kernel(xp, text, f"chainexec_{kind}_{'add' if add else 'set'}")
    kernel((strided.grid(n),), (BLOCK,), (out, a, _scalar(out, factor), *map(np.int64, numbers)))


def _reads_within(a, axis: int, positions: tuple) -> bool:
    """Whether every element :func:`gather` reads lies in ``a``: an unpack's first and last pair
    (its block's corners) on the pair axis, each of a pack's pairs' members (one row and column
    per pair, on the host) on the two member axes. The kernel itself reads unchecked."""
    if positions[0] == "unpack":
        _, k0, r0, r1, m0, m1 = positions
        if r1 <= r0 or m1 <= m0:
            return True
        return 0 <= packing.pair_index(r0, m0) - k0 and packing.pair_index(r1 - 1, m1 - 1) - k0 < a.shape[axis]
    _, k0, k1, r0, m0, m1 = positions
    rows, cols = packing.pair_unindex(np.arange(k0, k1))
    return k1 <= k0 or (0 <= rows.min() - r0 and rows.max() - r0 < a.shape[axis]
                        and 0 <= cols.min() - m0 and cols.max() - m0 < min(m1 - m0, a.shape[axis + 1]))


def addresses(xp, table, base: tuple[int, int, int]):
    """The device addresses of a pointer-array batched GEMM's matrices: a new (3, n) int64 array,
    row r the byte offsets ``table[r]`` (C-contiguous int64) plus ``base[r]``
    (:data:`chainexec.kernels.batchedgemm.ADDRESSES`), on the current stream."""
    at = xp.empty_like(table)
    n = table.shape[1]
    _kernel(xp, ADDRESSES, "chainexec_addresses")((strided.grid(3 * n),), (BLOCK,),
                                                  (at, table, np.int64(n), *map(np.int64, base)))
    return at


def common_kernels() -> list[tuple[str, str]]:
    """(name, source) of the kernels any run may launch whatever its shapes: the tile operations'
    usual modules (:func:`chainexec.kernels.strided.common`), the batched GEMMs' addresses and the
    reductions' last step into a float64 scalar."""
    return [*strided.common(), ("chainexec_addresses", ADDRESSES), ("chainexec_total", total_source("float64"))]


def load_common(xp) -> None:
    """Compile together (:func:`precompile`, in threads) and load on the current device
    :func:`common_kernels`: a warm-up's, so that none of the run's launches waits for them."""
    kernels = common_kernels()
    precompile(xp, kernels)
    for name, text in kernels:
        preload(text, name)
