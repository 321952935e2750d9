"""Element-wise and reduction kernels over strided views: ``out = expression(inputs, out)``, or
its sum over an index space (pure CUDA C source generation; :mod:`chainexec.runtime.pointwise`
compiles and launches them).

Every device statement that sums over nothing runs as one such kernel: a permuted copy, a
Hadamard or outer product, a run of such terms added into one buffer (the (T) ``V``, ``Z`` and
``R`` tiles), a computed tensor's expression (the (T) denominator) and a fused statement
(``y + expression``). Its inputs are views that broadcast against ``out`` (stride 0 along the
indices they lack) and may be permuted or cut from larger buffers, so no temporary array is made.

The shape and every operand's strides are compile-time constants of the generated source, which
is why these are not CuPy ``ElementwiseKernel`` s (those recompute every operand's position from
the flat element number with one integer division per dimension per operand): the element number
is split into coordinates once (unsigned divisions by constants, which the compiler turns into
multiplications), each operand's offset is a sum of constant products, dimensions contiguous in
every operand are merged first (:func:`layout`), and 32-bit arithmetic is used where every offset
fits. One kernel exists per (expression, shape, strides, dtypes); a plan whose extents divide
into its tiles has one shape per statement, and uneven edge tiles add variants (up to 2^d for a
d-index tile).

Threads walk ``out`` in its memory order (its fastest-varying dimension innermost), so writes
are coalesced whatever the view.

An input that runs across ``out``'s fastest-varying dimension and is about as large as the
iteration space is *staged* (:func:`staging`): each block owns a small box of the dimensions
such inputs run along plus ``out``'s fastest (8x8x8 elements for three, 16x32 for two), copies
every staged input's part of it into shared memory walking that input's memory order, and reads
it from there in ``out``'s order. Otherwise the 32 threads of a warp read 32 elements a stride
apart, and each DRAM sector serves one of them. Small inputs stay in the caches and are not
staged (:data:`STAGE_SHARE`).

:func:`reduce_source` sums such an expression over a whole index space instead of writing it (a
fused statement into a scalar, :mod:`chainexec.planner.inline`: the (T) energy): one element per
thread as above, each block adds its threads' values in a fixed order and writes one partial
sum, and one more block adds the partial sums (:func:`total_source`). The grid depends on the
shape and strides only, so a reduction's result is the same bit for bit every time (no atomics).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

C_TYPES = {"float64": "double", "float32": "float"}
"""The dtypes a plan's tensors may have (see :mod:`chainexec.spec`), as C type names."""
BLOCK = 256
"""Threads per block (one element per thread)."""
INDEX32 = 2**31
"""Element counts and offset spans below this use 32-bit index arithmetic, the rest 64-bit."""
STAGE_SHARE = 8
"""Only an input with at least 1/8 as many distinct elements as the iteration space is staged: a
smaller one is read again and again from the caches, where a strided read costs L1 wavefronts but
no DRAM traffic: (T)'s ``Z`` statement, whose five inputs read across ``c`` are each 1/540 of the
tile, is slower staged; its energy, reading the tile-sized ``Z`` across ``c`` four times, faster
(:file:`benchmarks/results/INDEX.md`)."""
BOX = 512
"""Elements of a staged block's box (two per thread), where the extents allow."""
UNROLL = 4
"""Elements a thread of an unstaged kernel over at least :data:`UNROLL_MIN` elements, a block
apart (a warp's accesses stay coalesced), all read before any is written, whatever the number of
inputs: with one element a thread an SM keeps too few reads in flight to stream at DRAM's
bandwidth. Four a thread read the two or three tile-sized inputs of a reduction faster than one
or two a thread, and write no slower, also with several inputs, whose values it then holds in
registers four at a time (:file:`benchmarks/results/INDEX.md`)."""
UNROLL_MIN = 1 << 22
"""Elements from which an unstaged kernel is unrolled (:data:`UNROLL`); its grid still has
thousands of blocks."""
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
        return box_pitches(dims, [self.tile(d) for d in dims])


def box_pitches(dims: list[int], tiles: list[int]) -> tuple[dict[int, int], int]:
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


def check_code(code: str) -> None:
    """Raise ValueError unless ``code`` holds only numbers, names, operators and parentheses: no
    text from outside reaches a generated source."""
    if not re.fullmatch(r"[\sA-Za-z0-9_.+\-*/()e]*", code):
        raise ValueError(f"point-wise code {code!r} has characters outside numbers, names and operators")


def index_type(counts: list[int], shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> str:
    """``int`` where the element ``counts`` and every array's offset span fit in 32 bits."""
    extent = max([1] + [sum((n - 1) * abs(s) for n, s in zip(shape, st)) + 1 for st in strides])
    return "int" if max(counts + [extent]) < INDEX32 else "long long"


def coordinates(shape: tuple[int, ...], index: str) -> list[str]:
    """Lines that split ``rest`` (the element number) into the coordinates ``c0, c1, …``.
    Unsigned division by a constant is a multiply and a shift; the coordinates are then signed
    for the offsets (a view's strides may be any sign)."""
    return [f"const {index} c{d} = rest % {shape[d]}u; rest /= {shape[d]}u;" if d else f"const {index} c0 = rest;"
            for d in reversed(range(len(shape)))]


def _element(shape: tuple[int, ...], strides: list[tuple[int, ...]], types: tuple[str, ...], index: str) -> list[str]:
    """The lines that find an element's coordinates (of C type ``index``) and read every input's
    value ``p0, p1, …`` there, for :func:`source` and :func:`reduce_source` (arguments as there)."""
    loads = [f"const {C_TYPES[t]} p{k} = P{k}[{offset_code(strides[1 + k])}];" for k, t in enumerate(types[:-1])]
    return coordinates(shape, index) + loads


def offset_code(st: tuple[int, ...]) -> str:
    """C code of the offset (elements) of the element at ``c0, c1, …`` in an array of strides ``st``."""
    return " + ".join([f"c{d} * {s}" for d, s in enumerate(st) if s] or ["0"])


def _params(types: tuple[str, ...]) -> str:
    return ", ".join([f"{C_TYPES[types[-1]]}* __restrict__ Y"]
                     + [f"const {C_TYPES[t]}* __restrict__ P{k}" for k, t in enumerate(types[:-1])])


def _elements(shape: tuple[int, ...], strides: list[tuple[int, ...]], types: tuple[str, ...],
              plan: Staging | None, body: list[str], reads_y: bool = False) -> list[str]:
    """Kernel lines that run ``body`` once per element of ``shape`` with its coordinates
    ``c0, c1, …``, every input's value ``p0, p1, …`` and the element's offset ``at`` in the array
    of ``strides[0]`` defined (and its value there ``y``, of type ``types[-1]``, where
    ``reads_y``): one element per thread, :func:`unrolled` ones a thread where unstaged (all read
    first, then ``body`` run for each), or with ``plan`` a block's cube of them, staged inputs
    copied to shared memory first."""
    n = math.prod(shape)
    index = index_type([n], shape, strides)
    where = [f"const {index} at = {offset_code(strides[0])};"]
    where += [f"const {C_TYPES[types[-1]]} y = Y[at];"] if reads_y else []
    if plan is None:
        element = _element(shape, strides, types, index)
        unroll = unrolled(n)
        if unroll == 1:
            return ([f"const long long flat = (long long)blockIdx.x * {BLOCK} + threadIdx.x;",
                     f"if (flat < {n}LL) {{", f"  unsigned {index} rest = (unsigned {index})flat;"]
                    + ["  " + line for line in element + where + body] + ["}"])
        read = [(C_TYPES[t], f"p{k}") for k, t in enumerate(types[:-1])] + [(index, "at")]
        read += [(C_TYPES[types[-1]], "y")] if reads_y else []
        lines = [f"const long long first = (long long)blockIdx.x * {BLOCK * unroll} + threadIdx.x;"]
        for u in range(unroll):  # every element's reads (an element past the end reads element 0)
            lines += [f"const bool ok{u} = first + {u * BLOCK} < {n}LL;"] + [f"{t} {name}_{u};" for t, name in read]
            lines += ["{", f"  unsigned {index} rest = (unsigned {index})(ok{u} ? first + {u * BLOCK} : 0);"]
            lines += ["  " + line for line in element + where] + [f"  {name}_{u} = {name};" for _, name in read] + ["}"]
        for u in range(unroll):
            lines += [f"if (ok{u}) {{"] + [f"  const {t} {name} = {name}_{u};" for t, name in read]
            lines += ["  " + line for line in body] + ["}"]
        return lines
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
            read = f"P{k}[{offset_code(strides[1 + k])}]"
        lines.append(f"  const {C_TYPES[t]} p{k} = {read};")
    return lines + ["  " + line for line in where + body] + ["}"]


def unrolled(n: int) -> int:
    """Elements per thread of an unstaged kernel over ``n`` elements (:data:`UNROLL`)."""
    return UNROLL if n >= UNROLL_MIN else 1


def blocks(shape: tuple[int, ...], plan: Staging | None) -> int:
    """Thread blocks of :func:`source`'s and :func:`reduce_source`'s grid for ``shape``."""
    n = math.prod(shape)
    return plan.blocks(shape) if plan else -(-n // (BLOCK * unrolled(n)))


def source(code: str, shape: tuple[int, ...], strides: list[tuple[int, ...]], types: tuple[str, ...]) -> str:
    """CUDA C of ``chainexec_pointwise(y, p0, p1, …)``: ``y[at] = code`` for every element of
    ``shape`` (already :func:`layout`-reduced), on a grid of :func:`blocks` blocks of
    :data:`BLOCK` threads. ``strides[0]`` and ``types[-1]`` are the output's, ``strides[1 + k]``
    and ``types[k]`` input ``k``'s; ``code`` is a C expression over the values ``p0, p1, …`` and
    ``y`` (the output's current value), numbers and operators only (made by
    :func:`chainexec.expr.c_source` or from contraction factors): no user text reaches the source."""
    check_code(code)
    body = [f"Y[at] = ({C_TYPES[types[-1]]})({code});"]
    lines = [f"extern \"C\" __global__ void chainexec_pointwise({_params(types)}) {{"]
    lines += ["  " + line for line in _elements(shape, strides, types, staging(shape, strides, types), body,
                                                bool(re.search(r"\by\b", code)))]
    return "\n".join(lines + ["}"])


def reduce_source(code: str, shape: tuple[int, ...], strides: list[tuple[int, ...]], types: tuple[str, ...]) -> str:
    """CUDA C of ``chainexec_reduce(partial, p0, p1, …)``: block ``b`` writes to ``partial[b]`` the
    sum, in double precision, of ``code`` over its elements of ``shape`` (one or :func:`unrolled`
    ones per thread, or a staged cube of them per block, each thread's in a fixed order, then
    added by a warp-shuffle and shared-memory tree in a fixed order). Arguments as in
    :func:`source`, with ``strides[0]`` those of the index space read contiguously (the order the
    threads walk) and ``types[-1]`` float64 (the partial sums); ``code`` may not read ``y``."""
    check_code(code)
    if re.search(r"\by\b", code):
        raise ValueError("a reduction has no output value y to read")
    lines = [f"extern \"C\" __global__ void chainexec_reduce({_params(types)}) {{",
             "  __shared__ double part[32];",
             "  double acc = 0.0;"]
    lines += ["  " + line for line in _elements(shape, strides, types, staging(shape, strides, types),
                                                [f"acc += (double)({code});"])]
    return "\n".join(lines + block_sum())


def block_sum(last: str = "Y[blockIdx.x] = acc") -> list[str]:
    """A reduction kernel's last lines: the threads' ``acc`` added by a warp-shuffle and
    shared-memory (``part``) tree in a fixed order, the block's sum stored by thread 0's ``last``
    (C statement; by default written to ``Y[blockIdx.x]``)."""
    return ["  for (int s = 16; s > 0; s >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, s);",
            "  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;",
            "  __syncthreads();",
            "  if (threadIdx.x < 32) {",
            f"    acc = threadIdx.x < {BLOCK // 32} ? part[threadIdx.x] : 0.0;",
            "    for (int s = 16; s > 0; s >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, s);",
            f"    if (threadIdx.x == 0) {last};",
            "  }",
            "}"]


@lru_cache(maxsize=None)
def total_source(dtype: str) -> str:
    """CUDA C of ``chainexec_total(y, partial, n)``: one block adds the ``n`` partial sums of a
    reduction kernel (each thread a fixed stride of them in order, then :func:`block_sum`'s fixed
    tree) to ``y[0]``, a 0-d array of ``dtype`` (the sum rounded to it): the reductions' last
    step, adding to the fused statement's scalar output itself, with no kernel of CuPy's to add
    the sum (two more to compile on a first run, two more launches per tile). Not CuPy's ``sum``
    either: that is CUB's reduction, whose module loading holds up a fresh process's first
    kernels."""
    ctype = C_TYPES[dtype]
    return "\n".join([f"extern \"C\" __global__ void chainexec_total({ctype}* __restrict__ Y, "
                      "const double* __restrict__ P, const unsigned n) {",
                      "  __shared__ double part[32];",
                      "  double acc = 0.0;",
                      f"  for (unsigned k = threadIdx.x; k < n; k += {BLOCK}u) acc += P[k];"]
                     + block_sum(f"Y[0] += ({ctype})acc"))

