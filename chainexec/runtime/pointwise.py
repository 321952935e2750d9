"""Generated point-wise CUDA kernels over strided views: ``out = expression(inputs, out)``.

Every device statement that sums over nothing goes through :func:`launch`: a permuted copy, a
Hadamard or outer product, a run of such terms added into one buffer (the (T) ``V``, ``Z`` and
``R`` tiles) and a computed tensor's expression (the (T) denominator). Its inputs are views that
broadcast against ``out`` (stride 0 along the indices they lack) and may be permuted or cut from
larger buffers, so no temporary array is made.

Why not CuPy's ``ElementwiseKernel``: over non-contiguous views it recomputes every operand's
position from the flat element number with one integer division per dimension per operand, in
registers sized for any shape. On the H100, the twelve outer products of the (T) ``V`` tile (24
broadcast views of 6-D, o=24 v=180, 4x4x4 occupied tiles) took 22 ms per tile that way, for one
3 GB write. Here the shape and every operand's strides are compile-time constants of the
generated source: the element number is split into coordinates once (unsigned divisions by
constants, which the compiler turns into multiplications), each operand's offset is a sum of constant
products, dimensions contiguous in every operand are merged first, and 32-bit arithmetic is used
where every offset fits. One kernel is compiled per (expression, shape, strides, dtypes) and
kept by CuPy's on-disk cache. A plan whose extents divide into its tiles has one shape per
statement; uneven edge tiles add variants (up to 2^d for a d-index tile), each compiled once.

Threads walk ``out`` in its memory order (its fastest-varying dimension innermost), so writes
are coalesced whatever the view.

An input that runs across ``out``'s fastest-varying dimension and is about as large as the
iteration space is *staged* (:func:`staging`): each block then owns a small box of the
dimensions such inputs run along plus ``out``'s fastest (8x8x8 elements for three, 16x32 for two),
copies every staged input's part of it into shared memory walking that input's memory order, and
reads it from there in ``out``'s order. Otherwise the 32 threads of a warp read 32 elements a
stride apart, and each DRAM sector serves one of them. Measured on the H100 (2026-11-24, on
buffers of a (T) run's strides): the energy, which reads the tile-sized ``Z`` across ``c`` four
times, 3.8 ms staged against 5.7 ms per 3x3x3x180³ tile; the ``Z`` statement, whose five inputs
across ``c`` are small and stay in the caches, 3.6 ms staged against 3.3 ms, so small inputs are
not staged (:data:`STAGE_SHARE`).

:func:`reduce` sums such an expression over a whole index space instead of writing it (a fused
statement into a scalar, :mod:`chainexec.planner.inline`: the (T) energy): one element per thread
as above, each block adds its threads' values in a fixed order and writes one partial sum, and
one more block adds the partial sums (:func:`total`). The grid depends on the shape and strides
only, so a run's result is the same bit for bit every time (no atomics). A first version had 4,096 blocks loop
over the elements: on the H100 the (T) energy's expression (thirteen reads, six of them
permuted) then took 2.0 s of a run where the unfused statements took 1.3 s, too few loads in
flight to hide the permuted reads' latency.

:func:`orbit_reduce` is a reduction whose expression reads values computed once per point at
several permutations of some of its dimensions (the (T) energy reads ``Z = W + V/2`` at the six
permutations of a, b, c; :mod:`chainexec.planner.inline`, reused values). The permuted dimensions
are cut into blocks (8x8x8), and a thread block takes the blocks of one orbit under the group the
permutations generate (a block and its up to five images): it computes the values over them into
shared memory, then sums the expression over the same points reading them there. Each value is
computed once and never stored outside shared memory: in (T) the energy and ``Z`` took 1.68 +
1.28 ms per 400³ tile as two statements (``Z`` stored in between), 0.90 ms as one kernel on the
H100 (2026-11-24). A thread takes a run of points along the first permuted dimension, loading
the inputs that do not vary along it once: through the backend 1.10 ms against 2.22 ms one point
per thread.

:func:`contract` is the same idea for any binary contraction: one thread per output element
loops over the summed indices, reading both operands where they lie. No temporary and no
workspace at all, at the FP64 CUDA cores' speed at best: the contraction method that always
fits (``direct`` in :mod:`chainexec.runtime.device`), for tiles cut so small by the device
memory limit that no other method's temporaries fit beside them.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from chainexec.planner.inline import MOVED
from chainexec.runtime import uselog

C_TYPES = {"float64": "double", "float32": "float"}
"""The dtypes a plan's tensors may have (see :mod:`chainexec.spec`), as C type names."""
BLOCK = 256
"""Threads per block (one element per thread)."""
INDEX32 = 2**31
"""Element counts and offset spans below this use 32-bit index arithmetic, the rest 64-bit."""
STAGE_SHARE = 8
"""Only an input with at least 1/8 as many distinct elements as the iteration space is staged: a
smaller one is read again and again from the caches, where a strided read costs L1 wavefronts but
no DRAM traffic. On the H100 (T)'s ``Z`` statement, 19 inputs of which five run across ``c``, each
1/540 of the 3x3x3x180³ tile, took 3.6 ms staged against 3.3 ms as it was; its energy, reading
the tile-sized ``Z`` across ``c`` four times, 3.8 ms against 5.7 ms."""
BOX = 512
"""Elements of a staged block's box (two per thread), where the extents allow."""
RUN = 4
"""Points an orbit kernel's thread takes one after another along the first permuted dimension
(:func:`orbit_source`): inputs that do not vary along it are loaded once for the run. In the (T)
energy, 8 of the reused ``Z``'s 19 inputs are such (at a run of 4: 13 loads per point, not 19)."""
STAGE_BYTES = 40 * 1024
"""Shared memory (bytes) the staged inputs of one block may take; beyond it nothing is staged."""


def layout(shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """The iteration space of ``shape`` (``strides[0]``: the output's, then each input's, in
    elements) reduced to what the kernel needs: dimensions of extent 1 dropped, the rest ordered by
    the output's strides (largest first, so the last is the output's fastest-varying one), and
    neighbours merged where every array steps through them as through one dimension. Returns the
    reduced shape and strides (same order of arrays)."""
    dims = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -abs(strides[0][d]))
    merged_shape: list[int] = []
    merged: list[list[int]] = [[] for _ in strides]
    for d in dims:
        if merged_shape and all(m[-1] == s[d] * shape[d] for m, s in zip(merged, strides)):
            merged_shape[-1] *= shape[d]
            for m, s in zip(merged, strides):
                m[-1] = s[d]
            continue
        merged_shape.append(shape[d])
        for m, s in zip(merged, strides):
            m.append(s[d])
    return tuple(merged_shape), [tuple(m) for m in merged]


@dataclass(frozen=True)
class Staging:
    """How a block reads its inputs through shared memory (:func:`staging`). Dimensions are
    positions in the :func:`layout`-reduced shape."""

    cube: tuple[int, ...]  # the dimensions a block's box spans, ascending (the last is out's fastest)
    tiles: tuple[int, ...]  # elements of the box along each of them
    staged: tuple[int, ...]  # the inputs read through shared memory

    def tile(self, d: int) -> int:
        return self.tiles[self.cube.index(d)]

    def blocks(self, shape: tuple[int, ...]) -> int:
        """Blocks of the grid: one per box position and coordinate of every other dimension."""
        return math.prod(-(-n // self.tile(d)) if d in self.cube else n for d, n in enumerate(shape))

    def dims(self, st: tuple[int, ...]) -> list[int]:
        """The box dimensions an input with strides ``st`` runs along (not broadcast)."""
        return [d for d in self.cube if st[d]]

    def pitches(self, st: tuple[int, ...]) -> tuple[dict[int, int], int]:
        """Shared-memory strides (elements) of a staged input along its box dimensions, in box
        order (the last fastest), each made odd so that a warp walking any one of them meets
        every bank; and the elements the input takes."""
        dims = self.dims(st)
        return _pitches(dims, [self.tile(d) for d in dims])


def _pitches(dims: list[int], tiles: list[int]) -> tuple[dict[int, int], int]:
    """Shared-memory strides (elements) of a box over ``dims`` (the last fastest) with ``tiles``
    elements along each, each stride made odd so that a warp walking any one dimension meets
    every bank; and the elements the box takes."""
    pitch, size = {}, 1
    for d, n in zip(reversed(dims), reversed(tiles)):
        size += size > 1 and size % 2 == 0
        pitch[d] = size
        size *= n
    return pitch, size


def staging(shape: tuple[int, ...], strides: list[tuple[int, ...]], types: tuple[str, ...]) -> Staging | None:
    """The :class:`Staging` of a :func:`layout`-reduced iteration space, or None where no input
    needs it (or it does not apply). Input ``k`` is staged when it steps along ``out``'s fastest
    dimension (the last) by more than one element, its own fastest dimension is another, and it is
    not small (:data:`STAGE_SHARE`). The cube spans the last dimension and the (at most two) own
    fastest dimensions most of the staged inputs have; an input whose own fastest lies outside it
    is still read once per block. Not staged: inputs over :data:`STAGE_BYTES` of shared memory, or
    a grid of 2^31 blocks or more."""
    last = len(shape) - 1
    staged, fastest = [], Counter()
    for k, st in enumerate(strides[1:]):
        if last < 1 or abs(st[last]) <= 1 or STAGE_SHARE * math.prod(n for n, s in zip(shape, st) if s) < math.prod(shape):
            continue
        own = min((d for d in range(len(shape)) if st[d]), key=lambda d: (abs(st[d]), -d))
        if own != last:
            staged.append(k)
            fastest[own] += 1
    if not staged:
        return None
    cube = tuple(sorted({last, *sorted(fastest, key=lambda d: (-fastest[d], -shape[d], -d))[:2]}))
    plan = Staging(cube, _box(shape, cube), tuple(staged))
    smem = sum(plan.pitches(strides[1 + k])[1] * (8 if types[k] == "float64" else 4) for k in staged)
    return plan if smem <= STAGE_BYTES and plan.blocks(shape) < 2**31 else None


def _box(shape: tuple[int, ...], cube: tuple[int, ...]) -> tuple[int, ...]:
    """Elements of the box along each cube dimension: :data:`BOX` shared out, the smaller extents
    first (each takes its whole extent or an even share, a power of two; among equal extents the
    output's fastest dimension last), the last one taking what is left: 8x8x8 for three long
    dimensions, 16x32 for two, 2x16x16 where one extent is 2, 170x3 where the fastest is 3."""
    order = sorted(cube, key=lambda d: (shape[d], d == cube[-1]))
    tile = {}
    for n, d in enumerate(order[:-1]):
        share = (BOX // math.prod(tile.values())) ** (1 / (len(cube) - n))
        tile[d] = min(shape[d], 2 ** int(math.log2(share) + 1e-9))
    tile[order[-1]] = min(shape[order[-1]], BOX // math.prod(tile.values()))
    return tuple(tile[d] for d in cube)


def _code_check(code: str) -> None:
    if not re.fullmatch(r"[\sA-Za-z0-9_.+\-*/()e]*", code):
        raise ValueError(f"point-wise code {code!r} has characters outside numbers, names and operators")


def _index_type(counts: list[int], shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> str:
    """``int`` where the element ``counts`` and every array's offset span fit in 32 bits."""
    extent = max([1] + [sum((n - 1) * abs(s) for n, s in zip(shape, st)) + 1 for st in strides])
    return "int" if max(counts + [extent]) < INDEX32 else "long long"


def _coordinates(shape: tuple[int, ...], index: str) -> list[str]:
    """Lines that split ``rest`` (the element number) into the coordinates ``c0, c1, …``.
    Unsigned division by a constant is a multiply and a shift; the coordinates are then signed
    for the offsets (a view's strides may be any sign)."""
    return [f"const {index} c{d} = rest % {shape[d]}u; rest /= {shape[d]}u;" if d else f"const {index} c0 = rest;"
            for d in reversed(range(len(shape)))]


def _element(shape: tuple[int, ...], strides: list[tuple[int, ...]], types: tuple[str, ...]) -> tuple[str, list[str]]:
    """The index type and the lines that find an element's coordinates and read every input's
    value ``p0, p1, …`` there, for :func:`source` and :func:`reduce_source` (arguments as there)."""
    index = _index_type([math.prod(shape)], shape, strides)
    loads = [f"const {C_TYPES[t]} p{k} = P{k}[{_offset(strides[1 + k])}];" for k, t in enumerate(types[:-1])]
    return index, _coordinates(shape, index) + loads


def _offset(st: tuple[int, ...]) -> str:
    return " + ".join([f"c{d} * {s}" for d, s in enumerate(st) if s] or ["0"])


def _params(types: tuple[str, ...]) -> str:
    return ", ".join([f"{C_TYPES[types[-1]]}* __restrict__ Y"]
                     + [f"const {C_TYPES[t]}* __restrict__ P{k}" for k, t in enumerate(types[:-1])])


def _elements(shape: tuple[int, ...], strides: list[tuple[int, ...]], types: tuple[str, ...],
              plan: Staging | None, body: list[str]) -> list[str]:
    """Kernel lines that run ``body`` once per element of ``shape`` with its coordinates
    ``c0, c1, …`` and every input's value ``p0, p1, …`` defined: one element per thread, or with
    ``plan`` a block's cube of them, staged inputs copied to shared memory first."""
    if plan is None:
        index, element = _element(shape, strides, types)
        return ([f"const long long flat = (long long)blockIdx.x * {BLOCK} + threadIdx.x;",
                 f"if (flat < {math.prod(shape)}LL) {{", f"  unsigned {index} rest = (unsigned {index})flat;"]
                + ["  " + line for line in element + body] + ["}"])
    index = _index_type([math.prod(shape)], shape, strides)
    lines = []
    for k in plan.staged:
        lines.append(f"__shared__ {C_TYPES[types[k]]} S{k}[{plan.pitches(strides[1 + k])[1]}];")
    lines.append("unsigned long long block = blockIdx.x;")
    for d in reversed(range(len(shape))):  # the box positions innermost, then the other dimensions
        count = -(-shape[d] // plan.tile(d)) if d in plan.cube else shape[d]
        first = f"({index})(block % {count}ull)" + (f" * {plan.tile(d)}" if d in plan.cube else "")
        lines.append(f"const {index} {'o' if d in plan.cube else 'c'}{d} = {first}; block /= {count}ull;")

    def inside(names: str, dims: list[int]) -> str:
        return " && ".join([f"o{d} + {names}{d} < {shape[d]}" for d in dims if shape[d] % plan.tile(d)] or ["true"])

    def split(names: str, dims: list[int]) -> list[str]:
        return [f"const {index} {names}{d} = rest % {plan.tile(d)}u; rest /= {plan.tile(d)}u;" for d in dims]

    for k in plan.staged:
        st = strides[1 + k]
        dims = plan.dims(st)
        pitch, size = plan.pitches(st)
        walk = sorted(dims, key=lambda d: abs(st[d]))  # the input's memory order, fastest first
        at = " + ".join([f"(o{d} + m{d}) * {st[d]}" if d in plan.cube else f"c{d} * {st[d]}"
                         for d in range(len(shape)) if st[d]])
        lines += [f"for (unsigned e = threadIdx.x; e < {math.prod(plan.tile(d) for d in dims)}u; e += {BLOCK}u) {{",
                  f"  unsigned {index} rest = e;"]
        lines += ["  " + line for line in split("m", walk)]
        lines.append(f"  if ({inside('m', dims)}) S{k}[{' + '.join(f'm{d} * {pitch[d]}' for d in dims)}] = P{k}[{at}];")
        lines.append("}")
    lines += ["__syncthreads();",
              f"for (unsigned e = threadIdx.x; e < {math.prod(plan.tiles)}u; e += {BLOCK}u) {{",
              f"  unsigned {index} rest = e;"]
    lines += ["  " + line for line in split("l", list(reversed(plan.cube)))]
    lines.append(f"  if (!({inside('l', list(plan.cube))})) continue;")
    lines += [f"  const {index} c{d} = o{d} + l{d};" for d in plan.cube]
    for k, t in enumerate(types[:-1]):
        if k in plan.staged:
            pitch = plan.pitches(strides[1 + k])[0]
            read = f"S{k}[{' + '.join(f'l{d} * {pitch[d]}' for d in pitch)}]"
        else:
            read = f"P{k}[{_offset(strides[1 + k])}]"
        lines.append(f"  const {C_TYPES[t]} p{k} = {read};")
    return lines + ["  " + line for line in body] + ["}"]


def blocks(shape: tuple[int, ...], plan: Staging | None) -> int:
    """Thread blocks of :func:`source`'s and :func:`reduce_source`'s grid for ``shape``."""
    return plan.blocks(shape) if plan else -(-math.prod(shape) // BLOCK)


def source(code: str, shape: tuple[int, ...], strides: list[tuple[int, ...]], types: tuple[str, ...]) -> str:
    """CUDA C of ``chainexec_pointwise(y, p0, p1, …)``: ``y[at] = code`` for every element of
    ``shape`` (already :func:`layout`-reduced), on a grid of :func:`blocks` blocks of
    :data:`BLOCK` threads. ``strides[0]`` and ``types[-1]`` are the output's, ``strides[1 + k]``
    and ``types[k]`` input ``k``'s; ``code`` is a C expression over the values ``p0, p1, …`` and
    ``y`` (the output's current value), numbers and operators only (made by
    :func:`chainexec.expr.c_source` or from contraction factors): no user text reaches the source."""
    _code_check(code)
    index = _index_type([math.prod(shape)], shape, strides)
    out_type = C_TYPES[types[-1]]
    body = [f"const {index} at = {_offset(strides[0])};"]
    if re.search(r"\by\b", code):
        body.append(f"const {out_type} y = Y[at];")
    body.append(f"Y[at] = ({out_type})({code});")
    lines = [f"extern \"C\" __global__ void chainexec_pointwise({_params(types)}) {{"]
    lines += ["  " + line for line in _elements(shape, strides, types, staging(shape, strides, types), body)]
    return "\n".join(lines + ["}"])


def reduce_source(code: str, shape: tuple[int, ...], strides: list[tuple[int, ...]], types: tuple[str, ...]) -> str:
    """CUDA C of ``chainexec_reduce(partial, p0, p1, …)``: block ``b`` writes to ``partial[b]`` the
    sum, in double precision, of ``code`` over its elements of ``shape`` (one per thread, or a
    staged cube of them per block, each thread's in a fixed order, then added by a warp-shuffle
    and shared-memory tree in a fixed order). Arguments as in :func:`source`, with ``strides[0]``
    those of the index space read contiguously (the order the threads walk) and ``types[-1]``
    float64 (the partial sums); ``code`` may not read ``y``."""
    _code_check(code)
    if re.search(r"\by\b", code):
        raise ValueError("a reduction has no output value y to read")
    lines = [f"extern \"C\" __global__ void chainexec_reduce({_params(types)}) {{",
             "  __shared__ double part[32];",
             "  double acc = 0.0;"]
    lines += ["  " + line for line in _elements(shape, strides, types, staging(shape, strides, types),
                                                [f"acc += (double)({code});"])]
    return "\n".join(lines + _block_sum())


def _block_sum() -> list[str]:
    """A reduction kernel's last lines: the threads' ``acc`` added by a warp-shuffle and
    shared-memory (``part``) tree in a fixed order, the block's sum written to ``Y[blockIdx.x]``."""
    return ["  for (int s = 16; s > 0; s >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, s);",
            "  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;",
            "  __syncthreads();",
            "  if (threadIdx.x < 32) {",
            f"    acc = threadIdx.x < {BLOCK // 32} ? part[threadIdx.x] : 0.0;",
            "    for (int s = 16; s > 0; s >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, s);",
            "    if (threadIdx.x == 0) Y[blockIdx.x] = acc;",
            "  }",
            "}"]


TOTAL_SOURCE = "\n".join(["extern \"C\" __global__ void chainexec_total(double* __restrict__ Y, "
                          "const double* __restrict__ P, const unsigned n) {",
                          "  __shared__ double part[32];",
                          "  double acc = 0.0;",
                          f"  for (unsigned k = threadIdx.x; k < n; k += {BLOCK}u) acc += P[k];"] + _block_sum())
"""CUDA C of ``chainexec_total(y, partial, n)``: one block adds the ``n`` partial sums of a
reduction kernel (each thread a fixed stride of them in order, then :func:`_block_sum`'s fixed
tree) into ``y[0]``. Not CuPy's ``sum``: that is CUB's reduction, whose module loading took
34 ms of a fresh (T) run's first 0.1 s on an H200 (``torch.profiler``, 2026-11-27), and held
up the first GEMM behind it."""


def total(xp, partial):
    """Σ ``partial`` (float64, one dimension) as a 0-d float64 device array, in a fixed order
    (:data:`TOTAL_SOURCE`): the same bits every run."""
    out = xp.empty((), xp.float64)
    _kernel(xp, TOTAL_SOURCE, "chainexec_total")((1,), (BLOCK,), (out, partial, xp.uint32(partial.size)))
    return out


def _kernel(xp, text: str, name: str):
    """The kernel ``name`` of ``text`` (:func:`_made`), logged on a GPU
    (:mod:`chainexec.runtime.uselog`) for the next process's warm-up; an array module without
    CUDA (the tests' recording ones) logs nothing."""
    if hasattr(xp, "cuda"):
        uselog.note(uselog.device_name(xp), "sources", (name, text))
    return _made(xp, text, name)


@lru_cache(maxsize=1024)
def _made(xp, text: str, name: str):
    """The kernel ``name`` of ``text``, made once per process (CuPy compiles it or reads its own
    disk cache)."""
    return xp.RawKernel(text, name)


def preload(xp, text: str, name: str) -> None:
    """Make kernel ``name`` of ``text`` as :func:`_kernel` does and load it on the current device:
    the warm-up's way to load a logged kernel before a launch asks for it."""
    _ = _made(xp, text, name).num_regs  # reading an attribute makes CUDA's lazy loading load it


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
    total = math.prod(out.shape)
    if total == 0:
        return
    shape, strides = layout(tuple(out.shape), _strides(views, tuple(s // out.itemsize for s in out.strides)))
    types = tuple(v.dtype.name for v in views) + (out.dtype.name,)
    text, grid = _ready(xp, _prepared, "chainexec_pointwise", code, shape, tuple(strides), types)
    _kernel(xp, text, "chainexec_pointwise")((grid,), (BLOCK,), (out, *views))


def reduce(xp, code: str, views: list, shape: tuple[int, ...]):
    """Σ ``code`` over every element of ``shape`` (views as in :func:`launch`, each with extent
    ``shape``'s or 1 per dimension), as a 0-d float64 device array; threads walk ``shape`` in
    C order (its last dimension fastest)."""
    if math.prod(shape) == 0:
        return xp.zeros((), xp.float64)
    walk = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    merged, strides = layout(tuple(shape), _strides(views, walk))
    types = tuple(v.dtype.name for v in views) + ("float64",)
    text, grid = _ready(xp, _prepared, "chainexec_reduce", code, merged, tuple(strides), types)
    partial = xp.empty(grid, xp.float64)
    _kernel(xp, text, "chainexec_reduce")((grid,), (BLOCK,), (partial, *views))
    return total(xp, partial)


@dataclass(frozen=True)
class Orbits:
    """How :func:`orbit_source` covers an index space. ``moved``: the dimensions the reads of
    reused values permute (one extent), cut into blocks of ``edge`` elements along each; ``perms``:
    each read's permutation of them (position ``u`` of the value read is the point's position
    ``perms[r][u]``). The blocks of an orbit (a block and its images under the group the
    permutations generate) go to one thread block: ``count`` orbits of at most ``members``."""

    moved: tuple[int, ...]
    edge: int
    perms: tuple[tuple[int, ...], ...]
    count: int
    members: int

    def width(self) -> int:
        """Entries of one orbit's row in :func:`orbit_table`."""
        return 1 + self.members * (len(self.moved) + len(self.perms))

    def slot(self) -> tuple[dict[int, int], int]:
        """Shared-memory strides (elements) of one block of reused values and its size."""
        return _pitches(list(self.moved), [self.edge] * len(self.moved))


def group(perms: tuple[tuple[int, ...], ...]) -> list[tuple[int, ...]]:
    """Every permutation that ``perms`` generate, the identity first. Applying ``g`` then ``h`` to a
    tuple ``P`` (``(g·P)[u] = P[g[u]]``) is the permutation ``u -> g[h[u]]``."""
    found = [tuple(range(len(perms[0])))]
    for g in found:
        for h in perms:
            k = tuple(g[h[u]] for u in range(len(h)))
            if k not in found:
                found.append(k)
    return found


@lru_cache(maxsize=64)
def orbit_table(blocks: int, perms: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], int, int]:
    """The orbits of the block tuples ``[0, blocks)^s`` under :func:`group` of ``perms``, as one
    flat int table: per orbit, its number of distinct blocks, then each block's coordinates
    (``members`` slots of ``s``), then for each block and each read ``r`` the slot of the block
    that ``perms[r]`` maps it to. Returns (table, orbits, members)."""
    import numpy as np

    s, elements = len(perms[0]), group(perms)
    shape = (blocks,) * s
    coords = np.stack(np.unravel_index(np.arange(blocks ** s), shape), axis=1)

    def images(ps) -> np.ndarray:
        return np.stack([np.ravel_multi_index(tuple(coords[:, list(g)].T), shape) for g in ps], axis=1)

    under_group, under_read = images(elements), images(perms)
    members = len(elements)
    # whole arrays, one row per orbit (a loop over orbits took 6-7 ms of a fresh (T) process's
    # first tile at 12 blocks a side): an orbit is its first block's images under the group,
    # repeats dropped, in the group's order, padded with zeros to ``members`` blocks
    orbit = under_group[np.flatnonzero(under_group.min(axis=1) == np.arange(blocks ** s))]
    first = np.stack([~(orbit[:, :g] == orbit[:, g:g + 1]).any(axis=1) for g in range(members)], axis=1)
    order = np.argsort(~first, axis=1, kind="stable")
    blocks_of = np.take_along_axis(orbit, order, axis=1)
    valid = np.take_along_axis(first, order, axis=1)
    targets = under_read[blocks_of]  # (orbits, members, reads): the blocks each read maps to
    slots = (targets[..., None] == blocks_of[:, None, None, :]).argmax(axis=-1)
    rows = np.concatenate([first.sum(axis=1)[:, None],
                           (coords[blocks_of] * valid[..., None]).reshape(len(orbit), -1),
                           (slots * valid[..., None]).reshape(len(orbit), -1)], axis=1)
    return tuple(rows.ravel().tolist()), len(rows), members


def orbits(shape: tuple[int, ...], reads: list[tuple[int, ...]], lets: int, itemsize: int) -> Orbits:
    """The :class:`Orbits` of an index space ``shape`` whose reused values are read at ``reads``
    (each a permutation of its dimensions: the value at point ``x`` is read at the point ``y`` with
    ``y[d] = x[reads[r][d]]``): the blocks hold about :data:`BOX` points (8x8x8 for three moved
    dimensions, 16x16 for two), fewer where the reused values of ``lets`` tensors of ``itemsize``
    bytes would not fit in :data:`STAGE_BYTES` of shared memory."""
    moved = tuple(d for d in range(len(shape)) if any(p[d] != d for p in reads))
    if not moved or any(sorted(p) != list(range(len(shape))) for p in reads):
        raise ValueError(f"reads {reads} of reused values are not permutations that move a dimension")
    if len(moved) > MOVED:
        raise ValueError(f"reused values read across {len(moved)} permuted dimensions (at most {MOVED})")
    extent = shape[moved[0]]
    if any(shape[d] != extent for d in moved):
        raise ValueError(f"reused values read across dimensions of unequal extents {[shape[d] for d in moved]}")
    perms = tuple(tuple(moved.index(p[d]) for d in moved) for p in reads)
    members = len(group(perms))
    edge = min(extent, 2 ** int(math.log2(BOX) / len(moved) + 1e-9))

    def shared(edge: int) -> int:
        return lets * members * _pitches(list(moved), [edge] * len(moved))[1] * itemsize

    while edge > 1 and shared(edge) > STAGE_BYTES:
        edge //= 2
    if shared(edge) > STAGE_BYTES:
        raise ValueError(f"{lets} reused values over {members} blocks do not fit in {STAGE_BYTES} bytes of shared memory")
    count = orbit_table(-(-extent // edge), perms)[1]
    return Orbits(moved, edge, perms, count, members)


def orbit_source(lets: tuple[str, ...], code: str, reads: tuple[int, ...], shape: tuple[int, ...],
                 strides: list[tuple[int, ...]], types: tuple[str, ...], plan: Orbits, skip: int | None = None) -> str:
    """CUDA C of ``chainexec_orbits(partial, p0, p1, …, table)``: a full reduction Σ ``code`` over
    ``shape`` that reads values computed once per point (the reused values ``lets[j]``, C code over
    the inputs ``p0, p1, …`` at the point) at permuted points (``code`` reads ``q{r}``: the value of
    ``lets[reads[r]]`` at the point ``plan.perms[r]`` maps the point to). Thread block ``b`` takes
    orbit ``b % plan.count`` (:func:`orbit_table`, the ``table`` argument) at the point
    ``b / plan.count`` of the other dimensions: it computes the reused values over the orbit's
    blocks into shared memory, then sums ``code`` over the same points, reading them there, and
    writes ``partial[b]`` (threads' sums in a fixed order, as :func:`reduce_source`). Every point
    lies in one block of one orbit, and a permuted point in a block of the same orbit, so every
    reused value is computed once and never stored outside shared memory. ``strides``: each
    input's over ``shape``; ``types``: the inputs' dtypes, then the reused values'. ``skip``: an
    input ``code`` multiplies by (a weight); where it does not vary along the permuted dimensions,
    a block where it is zero writes 0 and computes nothing (:mod:`chainexec.planner.ordered`: 41 %
    of the (T) energy's blocks at benzene's tiles); where it does, it is only multiplied by."""
    for text in lets + (code,):
        _code_check(text)
    moved, edge, s = plan.moved, plan.edge, len(plan.moved)
    extent, index = shape[moved[0]], _index_type([math.prod(shape)], shape, strides)
    pitch, slot = plan.slot()
    value = C_TYPES[types[-1]]
    lines = ["extern \"C\" __global__ void chainexec_orbits(double* __restrict__ Y, "
             + ", ".join([f"const {C_TYPES[t]}* __restrict__ P{k}" for k, t in enumerate(types[:-1])]
                         + ["const int* __restrict__ T"]) + ") {",
             "  __shared__ double part[32];"]
    lines += [f"  __shared__ {value} L{j}[{plan.members * slot}];" for j in range(len(lets))]
    lines += [f"  const int* orbit = T + (blockIdx.x % {plan.count}u) * {plan.width()};",
              f"  unsigned long long rest = blockIdx.x / {plan.count}u;"]
    lines += [f"  const {index} c{d} = ({index})(rest % {shape[d]}ull); rest /= {shape[d]}ull;"
              for d in reversed(range(len(shape))) if d not in moved and shape[d] > 1]
    if skip is not None and not any(strides[skip][d] for d in moved):
        lines += [f"  if (P{skip}[{_offset(strides[skip])}] == 0) {{",
                  "    if (threadIdx.x == 0) Y[blockIdx.x] = 0.0;",
                  "    return;",
                  "  }"]
    lines += ["  double acc = 0.0;"]

    first, chunk = moved[0], min(edge, RUN)
    tasks = edge ** (s - 1) * -(-edge // chunk)  # per block: a point of the other moved dimensions, a run

    def points(codes: list[str], body: list[str]) -> list[str]:
        """``body`` once per point of the orbit's blocks (``t``: the block's slot, ``l{d}``: the
        point's place in it), with the inputs that ``codes`` read loaded as ``p{k}``. A thread takes
        a run of :data:`RUN` points along the first moved dimension, loading the inputs that do
        not vary along it once for the run; a warp spans the last moved dimensions, as the
        threads of the other kernels span the fastest dimension."""
        used = [k for k in range(len(types) - 1) if any(re.search(rf"\bp{k}\b", c) for c in codes)]
        loop = [f"for (unsigned task = threadIdx.x; task < orbit[0] * {tasks}u; task += {BLOCK}u) {{",
                f"  const int t = task / {tasks}u;",
                f"  unsigned r = task % {tasks}u;"]
        for u in reversed(range(1, s)):
            loop += [f"  const {index} l{moved[u]} = r % {edge}u; r /= {edge}u;",
                     f"  const {index} c{moved[u]} = orbit[1 + t * {s} + {u}] * {edge} + l{moved[u]};"]
        if extent % edge:
            loop.append(f"  if ({' || '.join(f'c{d} >= {extent}' for d in moved[1:])}) continue;")
        loop.append(f"  const {index} h = r * {chunk};")
        loop += [f"  const {C_TYPES[types[k]]} p{k} = P{k}[{_offset(strides[k])}];" for k in used if not strides[k][first]]
        stop = f"l{first} < h + {chunk}" + (f" && l{first} < {edge}" if edge % chunk else "")
        loop += [f"  for ({index} l{first} = h; {stop}; ++l{first}) {{",
                 f"    const {index} c{first} = orbit[1 + t * {s}] * {edge} + l{first};"]
        if extent % edge:
            loop.append(f"    if (c{first} >= {extent}) break;")
        loop += [f"    const {C_TYPES[types[k]]} p{k} = P{k}[{_offset(strides[k])}];" for k in used if strides[k][first]]
        return loop + ["    " + line for line in body] + ["  }", "}"]

    def at(mapping: dict[int, str]) -> str:
        return " + ".join(f"{mapping[d]} * {pitch[d]}" for d in moved)

    here = at({d: f"l{d}" for d in moved})
    lines += ["  " + line for line in points(list(lets), [f"L{j}[t * {slot} + {here}] = ({value})({c});"
                                                            for j, c in enumerate(lets)])]
    lines.append("  __syncthreads();")
    gets = []
    for r, (j, perm) in enumerate(zip(reads, plan.perms)):
        target = f"orbit[1 + {plan.members * s} + t * {len(plan.perms)} + {r}]"
        gets.append(f"const {value} q{r} = L{j}[{target} * {slot} + {at({d: f'l{moved[perm[u]]}' for u, d in enumerate(moved)})}];")
    lines += ["  " + line for line in points([code], gets + [f"acc += (double)({code});"])]
    return "\n".join(lines + _block_sum())


def _image(p: tuple[int, ...], x: tuple) -> tuple:
    """The point of ``x.transpose(p)``'s element ``x`` in the array itself: ``z[p[d]] = x[d]``."""
    z = [None] * len(p)
    for d, v in zip(p, x):
        z[d] = v
    return tuple(z)


@dataclass(frozen=True)
class Symmetrize:
    """How :func:`symmetrize_source` covers an array: ``edges`` (elements of a block along each
    dimension, equal along dimensions a permutation exchanges), ``counts`` (blocks along each) and
    ``compose[r][q]``: the slot of the block that permutation ``q`` maps slot ``r``'s block to
    (slot ``r`` holds the image of the thread block's own block under permutation ``r``)."""

    edges: tuple[int, ...]
    counts: tuple[int, ...]
    compose: tuple[tuple[int, ...], ...]


SYMMETRIZE_POINTS = 512
"""Points of one block of :func:`symmetrize_source` at most (8x8x8 over three exchanged
dimensions), fewer where the blocks of an orbit would not fit :data:`STAGE_BYTES`."""


def symmetrize_plan(shape: tuple[int, ...], strides: tuple[int, ...], axes: tuple[tuple[int, ...], ...],
                    itemsize: int) -> Symmetrize:
    """The :class:`Symmetrize` of an array of ``shape`` (element ``strides``) under the axis
    permutations ``axes``. Raises ValueError unless ``axes`` is a group (the identity among them,
    closed under composition) of permutations that map ``shape`` onto itself: the in-place sum
    needs every point's orbit to be the same set from each of its points. Blocks are edges of up
    to 8 along the dimensions exchanged with the fastest-varying one, then the next, while a
    block holds at most :data:`SYMMETRIZE_POINTS` points."""
    n = len(shape)
    labels = tuple(range(n))
    maps = [_image(p, labels) for p in axes]
    if any(sorted(p) != list(labels) for p in axes) or any(shape[p[d]] != shape[d] for p in axes for d in labels):
        raise ValueError(f"axes {axes} are not permutations of dimensions of equal extent in {shape}")
    if labels not in maps:
        raise ValueError(f"axes {axes} lack the identity")
    compose = []
    for p in maps:
        row = []
        for q in axes:
            image = _image(q, p)
            if image not in maps:
                raise ValueError(f"axes {axes} are not closed under composition")
            row.append(maps.index(image))
        compose.append(tuple(row))
    classes: list[list[int]] = []
    for d in sorted(labels, key=lambda d: (abs(strides[d]), -d)):
        if not any(d in c for c in classes):
            classes.append(sorted({p[d] for p in axes} | {d}))
    budget = SYMMETRIZE_POINTS
    while True:
        edges, points = [1] * n, 1
        for c in classes:
            e = 1
            while e < shape[c[0]] and points * min(2 * e, shape[c[0]]) ** len(c) <= budget:
                e = min(2 * e, shape[c[0]])
            for d in c:
                edges[d] = e
            points *= e ** len(c)
        if budget == 1 or len(axes) * _symmetrize_slot(strides, edges) * itemsize <= STAGE_BYTES:
            break
        budget //= 2
    counts = tuple(-(-shape[d] // edges[d]) for d in labels)
    return Symmetrize(tuple(edges), counts, tuple(compose))


def _symmetrize_dims(strides: tuple[int, ...], edges) -> list[int]:
    """The blocked dimensions, slowest first (the order :func:`_pitches` takes)."""
    return sorted((d for d in range(len(edges)) if edges[d] > 1), key=lambda d: (-abs(strides[d]), d))


def _symmetrize_slot(strides: tuple[int, ...], edges) -> int:
    """Shared-memory elements one block takes (:func:`_pitches`)."""
    dims = _symmetrize_dims(strides, edges)
    return _pitches(dims, [edges[d] for d in dims])[1]


def symmetrize_source(shape: tuple[int, ...], strides: tuple[int, ...], axes: tuple[tuple[int, ...], ...],
                      dtype: str, plan: Symmetrize, keep: tuple[tuple[int, ...], ...] = ()) -> str:
    """CUDA C of ``chainexec_symmetrize(y)``: ``y = Σ_p y.transpose(p)`` over ``axes`` in place
    (:meth:`chainexec.runtime.device.Backend.symmetrize`). The array is cut into blocks
    (:class:`Symmetrize`); thread block ``b`` takes block ``b`` (coordinates in C order) only where
    no permutation maps it to a block of lower number, so each orbit of blocks has one thread
    block. It copies the images of its block under every permutation into shared memory, then
    writes each distinct one's points as the sum of their images, read there. Every point of an
    orbit is read before any is written and no other thread block touches them, so no point is
    read after it changed; the terms are added in the order of ``axes``. One read and one write
    of the array, where out-of-place it reads the permuted views and the output, and writes a
    scratch tile before. ``keep``: groups of dimensions; a point is written only where its
    coordinates are non-decreasing within each (the others keep their values:
    :mod:`chainexec.planner.ordered`)."""
    n = len(shape)
    value = C_TYPES[dtype]
    index = _index_type([math.prod(shape)], shape, [strides])
    edges, counts, g = plan.edges, plan.counts, len(axes)
    dims = _symmetrize_dims(strides, edges)
    pitch, slot = _pitches(dims, [edges[d] for d in dims])
    points = math.prod(edges)
    radix = [math.prod(counts[d + 1:]) for d in range(n)]
    lines = [f"extern \"C\" __global__ void chainexec_symmetrize({value}* __restrict__ Y) {{",
             f"  __shared__ {value} S[{g * slot}];",
             "  unsigned long long rest = blockIdx.x;"]
    lines += [f"  const long long B{d} = rest % {counts[d]}ull; rest /= {counts[d]}ull;" for d in reversed(range(n))]
    for r, p in enumerate(axes):
        image = _image(p, tuple(f"B{d}" for d in range(n)))  # block coordinates of slot r
        lines.append(f"  const long long K{r} = " + " + ".join(f"{image[d]} * {radix[d]}ll" for d in range(n)) + ";")
        if r:
            lines.append(f"  if (K{r} < K0) return;")
    local = [f"const {index} l{d} = ({index})(u % {edges[d]}u); u /= {edges[d]}u;"
             for d in sorted(range(n), key=lambda d: (abs(strides[d]), -d)) if edges[d] > 1]

    def walk(r: int, body: list[str], write: bool) -> list[str]:
        """``body`` at each point of slot ``r``'s block that lies in the array (``o``: its offset),
        and is kept where it is written."""
        image = _image(axes[r], tuple(f"B{d}" for d in range(n)))
        coords = {d: f"({image[d]} * {edges[d]}" + (f" + l{d})" if edges[d] > 1 else ")") for d in range(n)}
        guard = [f"{coords[d]} < {shape[d]}" for d in range(n) if shape[d] % edges[d]]
        if write:
            guard += [f"{coords[g[m]]} <= {coords[g[m + 1]]}" for g in keep for m in range(len(g) - 1)]
        out = [f"  for (unsigned t = threadIdx.x; t < {points}u; t += {BLOCK}u) {{",
               "    unsigned u = t;"] + ["    " + x for x in local]
        out += [f"    const {index} o = " + (" + ".join(f"({index}){coords[d]} * {strides[d]}" for d in range(n)
                                                       if strides[d]) or "0") + ";"]
        if guard:
            out.append(f"    if (!({' && '.join(guard)})) continue;")
        return out + ["    " + x for x in body] + ["  }"]

    here = " + ".join([f"l{d} * {pitch[d]}" for d in dims] or ["0"])
    for r in range(g):  # a point's images lie in the array where it does: no fill needed
        lines += walk(r, [f"S[{r * slot} + {here}] = Y[o];"], False)
    lines.append("  __syncthreads();")
    for r in range(g):
        owner = [f"K{r} != K{s}" for s in range(r)]
        terms = []
        for q in range(g):
            moved = " + ".join([f"l{d} * {pitch[axes[q][d]]}" for d in dims] or ["0"])
            terms.append(f"S[{plan.compose[r][q] * slot} + {moved}]")
        body = [f"Y[o] = {' + '.join(terms)};"]
        if owner:
            lines.append(f"  if ({' && '.join(owner)}) {{")
        lines += walk(r, body, True)
        if owner:
            lines.append("  }")
    lines.append("}")
    return "\n".join(lines)


@lru_cache(maxsize=256)
def _symmetrize_prepared(shape: tuple[int, ...], strides: tuple[int, ...], axes: tuple[tuple[int, ...], ...],
                         dtype: str, keep: tuple[tuple[int, ...], ...] = ()) -> tuple[str, int]:
    """The source and grid of one in-place symmetrization, made once per process."""
    plan = symmetrize_plan(shape, strides, axes, 8 if dtype == "float64" else 4)
    return symmetrize_source(shape, strides, axes, dtype, plan, keep), math.prod(plan.counts)


def symmetrize(xp, out, axes, keep: tuple[tuple[int, ...], ...] = ()) -> None:
    """``out[...] = Σ out.transpose(p)`` over the axis permutations ``axes`` (a group mapping
    ``out``'s shape onto itself), in place, in one kernel (:func:`symmetrize_source`), at the
    points ``keep`` keeps."""
    if math.prod(out.shape) == 0:
        return
    strides = tuple(s // out.itemsize for s in out.strides)
    text, grid = _ready(xp, _symmetrize_prepared, tuple(out.shape), strides, tuple(map(tuple, axes)), out.dtype.name,
                        tuple(map(tuple, keep)))
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
    plan = orbits(shape, [p for _, p in reads], len(lets), 8 if types[-1] == "float64" else 4)
    grid = plan.count * math.prod(n for d, n in enumerate(shape) if d not in plan.moved)
    return plan, orbit_source(lets, code, tuple(j for j, _ in reads), shape, list(strides), types, plan, skip), grid


def orbit_reduce(xp, lets: list[str], code: str, reads: list[tuple[int, tuple[int, ...]]], views: list,
                 shape: tuple[int, ...], dtype: str, skip: int | None = None):
    """Σ ``code`` over every element of ``shape``, where ``code`` reads the inputs ``views[k]`` as
    ``pk`` (as :func:`reduce`: extent ``shape``'s or 1 per dimension) and values of ``dtype``
    computed once per point, ``lets[j]`` (C code over the inputs), as ``q{r}``: read ``r`` is
    ``(j, p)``, the value of ``lets[j]`` at the point ``y`` with ``y[d] = x[p[d]]``, ``p`` a
    permutation of dimensions of one extent (:func:`orbit_source`). ``skip``: an input ``code``
    multiplies by (a weight); where it does not vary along the permuted dimensions, the blocks
    where it is zero are skipped. A 0-d float64 device array."""
    if math.prod(shape) == 0:
        return xp.zeros((), xp.float64)
    strides = _strides(views, (0,) * len(shape))[1:]
    types = tuple(v.dtype.name for v in views) + (dtype,)
    plan, text, grid = _ready(xp, _orbit_prepared, tuple(lets), code, tuple((j, tuple(p)) for j, p in reads),
                              tuple(shape), tuple(strides), types, skip)
    partial = xp.empty(grid, xp.float64)
    table = _table(xp, -(-shape[plan.moved[0]] // plan.edge), plan.perms)
    _kernel(xp, text, "chainexec_orbits")((grid,), (BLOCK,), (partial, *views, table))
    return total(xp, partial)


PREPARED = {make.__name__: make for make in (_prepared, _symmetrize_prepared, _orbit_prepared)}
"""The preparations :func:`_ready` logs, by name."""


def prepare(name: str, text: str) -> None:
    """Make the preparation ``name`` of :data:`PREPARED` from the arguments :func:`_ready` logged
    (``text``, JSON), as a launch with them would: the launch then finds it made. Why: in a fresh
    (T) process at benzene's shapes the executor made 10 of them on its first tiles, 7.2-11.6 ms
    while the device waited (H100, 2026-11-27). Raises ValueError (or what the preparation
    raises) on anything else."""
    make = PREPARED.get(name)
    if make is None:
        raise ValueError(f"no preparation {name!r}")
    make(*_tuples(json.loads(text)))


def _tuples(value):
    """JSON's lists as the tuples the preparations take, at every depth."""
    return tuple(_tuples(x) for x in value) if isinstance(value, list) else value


def contraction_source(shape: tuple[int, ...], summed: tuple[int, ...], strides: list[tuple[int, ...]],
                       inner: list[tuple[int, ...]], types: tuple[str, ...]) -> str:
    """CUDA C of ``chainexec_direct(y, a, b, factor)``: ``y[at] += factor · Σ a·b`` over the summed
    index space ``summed`` for every element of ``shape`` (both :func:`layout`-reduced);
    ``strides``: the output's, a's and b's along ``shape``; ``inner``: a's and b's along
    ``summed``; ``types``: a's, b's and the output's dtypes. Products are added in double."""
    index = _index_type([math.prod(shape), math.prod(summed)], shape + summed,
                        [st + it for st, it in zip(strides, [(0,) * len(summed)] + inner)])
    out_type = C_TYPES[types[2]]
    lines = [f"extern \"C\" __global__ void chainexec_direct({out_type}* __restrict__ Y, "
             f"const {C_TYPES[types[0]]}* __restrict__ A, const {C_TYPES[types[1]]}* __restrict__ B, double factor) {{",
             f"  const long long flat = (long long)blockIdx.x * {BLOCK} + threadIdx.x;",
             f"  if (flat >= {math.prod(shape)}LL) return;",
             f"  unsigned {index} rest = (unsigned {index})flat;"]
    lines += ["  " + line for line in _coordinates(shape, index)]
    lines += [f"  const {index} at = {_offset(strides[0])};",
              f"  const {index} oa = {_offset(strides[1])};",
              f"  const {index} ob = {_offset(strides[2])};",
              "  double acc = 0.0;"]
    pad = "  "
    for d, n in enumerate(summed):
        lines.append(f"{pad}for ({index} s{d} = 0; s{d} < {n}; ++s{d}) {{")
        pad += "  "
    ia = " + ".join(["oa"] + [f"s{d} * {s}" for d, s in enumerate(inner[0]) if s])
    ib = " + ".join(["ob"] + [f"s{d} * {s}" for d, s in enumerate(inner[1]) if s])
    lines.append(f"{pad}acc += (double)A[{ia}] * (double)B[{ib}];")
    lines += ["  " * (d + 1) + "}" for d in reversed(range(len(summed)))]
    lines += [f"  Y[at] = ({out_type})(Y[at] + factor * acc);", "}"]
    return "\n".join(lines)


def direct_source(out, a, b, indices: tuple[list[str], list[str], list[str]]) -> str:
    """:func:`contraction_source` for arrays (NumPy or CuPy: only shapes, strides and dtypes are
    read) ``out``, ``a``, ``b`` over the index lists ``indices`` (out's, a's, b's)."""
    out_ix, a_ix, b_ix = indices
    size = dict(zip(a_ix, a.shape)) | dict(zip(b_ix, b.shape)) | dict(zip(out_ix, out.shape))
    rest = [i for i in dict.fromkeys(a_ix + b_ix) if i not in out_ix]

    def along(arr, ix, names):
        st = dict(zip(ix, (s // arr.itemsize for s in arr.strides)))
        return tuple(st.get(i, 0) if size[i] > 1 else 0 for i in names)

    shape, strides = layout(tuple(size[i] for i in out_ix), [along(out, out_ix, out_ix), along(a, a_ix, out_ix),
                                                             along(b, b_ix, out_ix)])
    summed, inner = layout(tuple(size[i] for i in rest), [along(a, a_ix, rest), along(b, b_ix, rest)])
    return contraction_source(shape, summed, strides, inner, (a.dtype.name, b.dtype.name, out.dtype.name))


def contract(xp, out, a, b, indices: tuple[list[str], list[str], list[str]], factor: float) -> None:
    """``out += factor · a·b`` for the binary contraction whose index lists (out, a, b) are
    ``indices``, over the views as they lie (:func:`direct_source`), on the current stream."""
    total = math.prod(out.shape)
    if total == 0:
        return
    kernel = _kernel(xp, direct_source(out, a, b, indices), "chainexec_direct")
    kernel(((total + BLOCK - 1) // BLOCK,), (BLOCK,), (out, a, b, xp.float64(factor)))
