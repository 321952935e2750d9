"""Orbit kernels: a full reduction whose expression reads values computed once per point at
several permutations of some of its dimensions (pure CUDA C source generation;
:func:`chainexec.runtime.pointwise.orbit_reduce` launches them).

The (T) energy sums ``W·D·R`` where ``R`` reads ``Z = W + V/2`` at the six permutations of a, b, c
(reused values, :mod:`chainexec.planner.inline`). The permuted dimensions are cut into blocks
(8x8x8), and a thread block takes the blocks of one orbit under the group ``G`` the permutations
generate (a block ``B`` and its up to five images). Stage one computes the reused values over
those blocks into shared memory, and copies there the inputs the summed expression reads that
vary along two or more permuted dimensions (W: :func:`staged`). Stage two takes each point ``x``
of ``B`` and sums the expression at the points ``g·x`` of the orbit's blocks, one ``g`` per
block: every value they read at permuted points is a value at a point ``h·x`` of ``x``'s own point
orbit, so a thread loads each once (six loads for the six points of a generic orbit, where a
thread per point loads 36), and reads W at ``g·x`` in shared memory, where in device memory its
address would step across W's storage from one thread of a warp to the next. Each value is
computed once and never stored outside shared memory, where as two statements ``Z`` is written
to device memory and read back. In stage one a thread takes a run of points along the first
permuted dimension (:data:`RUN`), loading the inputs that do not vary along it once. In stage
two an input along one permuted dimension (the (T) energy's orbital energies, in ``D``) takes at
every ``g·x`` its value at one of ``x``'s coordinates: a thread loads it once per coordinate
(three loads where it would load six, one per group element).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache

from chainexec import expr
from chainexec.kernels.elementwise import (BLOCK, BOX, C_TYPES, block_sum, box_pitches, check_code, index_type,
                                           offset_code)
from chainexec.planner.inline import MOVED

RUN = 4
"""Points an orbit kernel's thread takes one after another along the first permuted dimension in
stage one (:func:`orbit_source`): inputs that do not vary along it are loaded once for the run. In
the (T) energy, 8 of the reused ``Z``'s 19 inputs are such (at a run of 4: 13 loads per point,
not 19)."""

SHARED_BYTES = 64 * 1024
"""Shared memory (bytes) one orbit's blocks of values may take; beyond CUDA's 48 KiB of static
shared memory, so the kernel takes it as dynamic shared memory its launch opts into. The (T)
energy's ``Z`` and W over six blocks of 8x8x8 take 49,152 bytes."""

_SIZES = {"double": 8, "float": 4}
"""Bytes of an element of each C type of :data:`C_TYPES`."""


@dataclass(frozen=True)
class Orbits:
    """How :func:`orbit_source` covers an index space. ``moved``: the dimensions the reads of
    reused values permute (one extent), cut into blocks of ``edge`` elements along each; ``perms``:
    each read's permutation of them (position ``u`` of the value read is the point's position
    ``perms[r][u]``). The blocks of an orbit (a block and its images under the group the
    permutations generate, whose order ``members`` is the most blocks an orbit has) go to one
    thread block: ``count`` orbits. ``copied``: the inputs stage one copies into shared memory
    (:func:`staged`, as many as fit); ``shared``: bytes of dynamic shared memory a thread block
    takes for its blocks of values and copies (:func:`shared_arrays`)."""

    moved: tuple[int, ...]
    edge: int
    perms: tuple[tuple[int, ...], ...]
    count: int
    members: int
    copied: tuple[int, ...]
    shared: int

    def width(self) -> int:
        """Entries of one orbit's row in :func:`orbit_table`."""
        return 2 + self.members * (len(self.moved) + 1)

    def slot(self) -> int:
        """Shared-memory elements of one block of values (:func:`slot_size`)."""
        return slot_size(len(self.moved), self.edge)

    def place(self, coords: list[str]) -> str:
        """C expression of the element a point takes in its block of values, its coordinate along
        ``moved[u]`` being ``coords[u]``: :func:`swizzled`'s where that layout applies, else at the
        odd pitches of :func:`~chainexec.kernels.elementwise.box_pitches`."""
        if swizzled(len(self.moved), self.edge):
            a, b, c = (f"({x})" for x in coords)
            return (f"((({b} >> 1) * 8 + {c}) * 16 + ((({a} ^ {b} ^ {c}) & 6) | (({a} ^ {c}) & 1) "
                    f"| ((({b} ^ {c}) & 1) << 3)))")
        pitch = box_pitches(list(self.moved), [self.edge] * len(self.moved))[0]
        return " + ".join(f"{x} * {pitch[d]}" for x, d in zip(coords, self.moved))


def swizzled(dims: int, edge: int) -> bool:
    """Whether blocks of ``dims`` permuted dimensions of ``edge`` elements are laid out by an XOR
    swizzle (:meth:`Orbits.place`): three dimensions at blocks of 8, the (T) energy's.

    Shared memory serves a warp's 64-bit accesses a half-warp at a time, over 16 bank pairs: a
    half-warp's 16 elements take one pass where their bank pairs differ. In stage two a half-warp
    takes 8 points along one permuted dimension by 2 along another, and reads each value at the
    six permutations of the point, so that the two dimensions it walks are any ordered pair of
    the three; stage one writes along the last two. No pitches serve every pair: beside an odd
    pitch of the dimension walked 8-wide the one walked 2-wide needs a pitch of 8 mod 16, beside
    one of 2 mod 4 an odd one, and each dimension is walked both ways; at the odd pitches of
    :func:`~chainexec.kernels.elementwise.box_pitches` every such access takes two passes per
    half-warp. The swizzle puts a point ``(a, b, c)`` at row ``(b >> 1, c)`` of 16 elements and
    in that row at bits 1-2 of ``a ^ b ^ c``, bit 0 of ``a ^ c`` and bit 3 of ``b ^ c``: for
    every ordered pair of dimensions the 16 points of such a walk land in 16 distinct bank pairs,
    and the 512 points in 512 distinct elements."""
    return dims == 3 and edge == 8


def slot_size(dims: int, edge: int) -> int:
    """Shared-memory elements of one block of values of ``dims`` permuted dimensions of ``edge``
    elements: ``edge³`` swizzled (:func:`swizzled`), else padded to odd pitches."""
    if swizzled(dims, edge):
        return edge ** dims
    return box_pitches(list(range(dims)), [edge] * dims)[1]


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
    """The orbits of the block tuples ``[0, blocks)^s`` under :func:`group` ``G`` of ``perms``, as
    one flat int table: per orbit, its number of distinct blocks, then each block's coordinates
    (``members`` slots of ``s``, the first block ``B`` first), then for each ``g`` of ``G`` the slot
    of the block ``g·B``, then a mask whose bit ``g`` is set where ``g`` is the first element of
    ``G`` to map ``B`` to that block. Returns (table, orbits, members)."""
    import numpy as np

    s, elements = len(perms[0]), group(perms)
    shape = (blocks,) * s
    coords = np.stack(np.unravel_index(np.arange(blocks ** s), shape), axis=1)
    under_group = np.stack([np.ravel_multi_index(tuple(coords[:, list(g)].T), shape) for g in elements], axis=1)
    members = len(elements)
    # whole arrays, one row per orbit (a Python loop over orbits costs milliseconds of a (T)
    # tile's host time at 12 blocks a side): an orbit is its first block's images under the group,
    # repeats dropped, in the group's order, padded with zeros to ``members`` blocks
    orbit = under_group[np.flatnonzero(under_group.min(axis=1) == np.arange(blocks ** s))]
    first = np.stack([~(orbit[:, :g] == orbit[:, g:g + 1]).any(axis=1) for g in range(members)], axis=1)
    order = np.argsort(~first, axis=1, kind="stable")
    blocks_of = np.take_along_axis(orbit, order, axis=1)
    valid = np.take_along_axis(first, order, axis=1)
    slots = (orbit[..., None] == blocks_of[:, None, :]).argmax(axis=-1)  # (orbits, members): the slot of g·B
    rows = np.concatenate([first.sum(axis=1)[:, None],
                           (coords[blocks_of] * valid[..., None]).reshape(len(orbit), -1),
                           slots, (first << np.arange(members)).sum(axis=1)[:, None]], axis=1)
    return tuple(rows.ravel().tolist()), len(rows), members


@lru_cache(maxsize=256)
def orbit_codes(f, refs: tuple) -> tuple[tuple[str, ...], str, tuple[tuple[int, tuple[int, ...]], ...]]:
    """A fused reduction with reused values (``f``, a :class:`chainexec.planner.plan.Fused` with
    ``lets``) over the buffers ``refs`` (``p0, p1, …``): each value's C code, the statement's
    (reading the values as ``q0, q1, …``), and each read as (value, the permutation of
    ``f.domain`` that takes a point to where the value is read), as :func:`orbit_source` takes
    them. Made once per statement and process: building them per tile would add host time to
    every (T) tile."""
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


def _reads(text: str, k: int) -> bool:
    """Whether C code ``text`` reads input ``p{k}``."""
    return bool(re.search(rf"\bp{k}\b", text))


def staged(code: str, strides: list[tuple[int, ...]], moved: tuple[int, ...]) -> tuple[int, ...]:
    """The inputs ``code`` reads (``p{k}``) that vary along two or more of the ``moved``
    dimensions, those along more first: :func:`orbit_source` copies them into shared memory in
    stage one, as many as fit (:func:`orbits`), and reads them there at permuted points. An input
    along one moved dimension is read in device memory: the threads of a warp read consecutive
    elements of it (or one)."""
    spans = {k: sum(1 for d in moved if st[d]) for k, st in enumerate(strides) if _reads(code, k)}
    return tuple(sorted((k for k, n in spans.items() if n >= 2), key=lambda k: (-spans[k], k)))


def shared_arrays(lets: int, copied: tuple[int, ...], types: tuple[str, ...], members: int,
                  slot: int) -> tuple[list[tuple[str, str, int]], int]:
    """The arrays of an orbit kernel's dynamic shared memory: (name, C type, byte offset) of each
    reused value's blocks ``L{j}`` (of ``types[-1]``), then each copied input's ``S{k}`` (of
    ``types[k]``), ``members`` blocks of ``slot`` elements each, every array 16-byte aligned; and
    the bytes they take."""
    arrays, start = [], 0
    for name, ctype in ([(f"L{j}", C_TYPES[types[-1]]) for j in range(lets)]
                        + [(f"S{k}", C_TYPES[types[k]]) for k in copied]):
        arrays.append((name, ctype, start))
        start += -(-members * slot * _SIZES[ctype] // 16) * 16
    return arrays, start


def orbits(shape: tuple[int, ...], reads: list[tuple[int, ...]], code: str, strides: list[tuple[int, ...]],
           types: tuple[str, ...], lets: int) -> Orbits:
    """The :class:`Orbits` of an index space ``shape`` whose ``lets`` reused values are read at
    ``reads`` (each a permutation of its dimensions: the value at point ``x`` is read at the point
    ``y`` with ``y[d] = x[reads[r][d]]``) by ``code`` over inputs of ``strides`` (``types``: the
    inputs' dtypes, then the values'), as :func:`orbit_source` takes them. The blocks hold about
    :data:`BOX` points (8x8x8 for three moved dimensions, 16x16 for two). The :func:`staged`
    inputs are copied into shared memory as long as they fit in :data:`SHARED_BYTES` beside the
    values at that edge, those along fewer moved dimensions left out first (they never cut the
    blocks: at an edge of 4 stage two would leave three threads in four idle); the edge is cut
    where the values alone do not fit."""
    moved = tuple(d for d in range(len(shape)) if any(p[d] != d for p in reads))
    if not moved or any(sorted(p) != list(range(len(shape))) for p in reads):
        raise ValueError(f"reads {reads} of reused values are not permutations that move a dimension")
    if len(moved) > MOVED:
        raise ValueError(f"reused values read across {len(moved)} permuted dimensions (at most {MOVED})")
    if any(shape[d] != shape[moved[0]] for d in moved):
        raise ValueError(f"reused values read across dimensions of unequal extents {[shape[d] for d in moved]}")
    perms = tuple(tuple(moved.index(p[d]) for d in moved) for p in reads)
    members = len(group(perms))
    edge = min(shape[moved[0]], 2 ** int(math.log2(BOX) / len(moved) + 1e-9))

    def shared(edge: int, copied: tuple[int, ...]) -> int:
        return shared_arrays(lets, copied, types, members, slot_size(len(moved), edge))[1]

    copied = staged(code, strides, moved)
    while copied and shared(edge, copied) > SHARED_BYTES:
        copied = copied[:-1]
    while edge > 1 and shared(edge, copied) > SHARED_BYTES:
        edge //= 2
    if shared(edge, copied) > SHARED_BYTES:
        raise ValueError(f"{lets} reused values over {members} blocks do not fit in {SHARED_BYTES} bytes of "
                         f"shared memory")
    count = orbit_table(-(-shape[moved[0]] // edge), perms)[1]
    return Orbits(moved, edge, perms, count, members, copied, shared(edge, copied))


def orbit_source(lets: tuple[str, ...], code: str, reads: tuple[int, ...], shape: tuple[int, ...],
                 strides: list[tuple[int, ...]], types: tuple[str, ...], plan: Orbits, skip: int | None = None) -> str:
    """CUDA C of ``chainexec_orbits(partial, p0, p1, …, table)``: a full reduction Σ ``code`` over
    ``shape`` that reads values computed once per point (the reused values ``lets[j]``, C code over
    the inputs ``p0, p1, …`` at the point) at permuted points (``code`` reads ``q{r}``: the value of
    ``lets[reads[r]]`` at the point ``plan.perms[r]`` maps the point to). Thread block ``b`` takes
    orbit ``b % plan.count`` (:func:`orbit_table`, the ``table`` argument) at the point
    ``b / plan.count`` of the other dimensions. Stage one computes the reused values over the
    orbit's blocks into shared memory and copies ``plan.copied`` there; stage two takes
    the points ``x`` of the orbit's first block ``B`` and, for each ``g`` of the group that maps
    ``B`` to a block first, adds ``code`` at ``g·x``, its reused values loaded once per ``x`` from
    the point orbit of ``x``. The threads' sums are added in a fixed order, as
    :func:`reduce_source`, into ``partial[b]``. Every point lies in one block of one orbit, and a
    permuted point in a block of the same orbit, so every reused value is computed once and never
    stored outside shared memory (``plan.shared`` bytes of dynamic shared memory). ``strides``:
    each input's over ``shape``; ``types``: the inputs' dtypes, then the reused values'. ``skip``: an
    input ``code`` multiplies by (a weight); where it does not vary along the permuted dimensions,
    a block where it is zero writes 0 and computes nothing (:mod:`chainexec.planner.ordered`: 41 %
    of the (T) energy's blocks at benzene's tiles); where it does, it is only multiplied by."""
    for text in lets + (code,):
        check_code(text)
    moved, edge, s = plan.moved, plan.edge, len(plan.moved)
    extent, index = shape[moved[0]], index_type([math.prod(shape)], shape, strides)
    slot = plan.slot()
    value = C_TYPES[types[-1]]
    copied = plan.copied
    elements = group(plan.perms)
    arrays, size = shared_arrays(len(lets), copied, types, plan.members, slot)
    if size != plan.shared:
        raise ValueError(f"an orbit kernel's shared arrays take {size} bytes where its plan has {plan.shared}")
    lines = ["extern \"C\" __global__ void chainexec_orbits(double* __restrict__ Y, "
             + ", ".join([f"const {C_TYPES[t]}* __restrict__ P{k}" for k, t in enumerate(types[:-1])]
                         + ["const int* __restrict__ T"]) + ") {",
             "  __shared__ double part[32];",
             "  extern __shared__ double chainexec_shared[];"]
    lines += [f"  {ctype}* const {name} = ({ctype}*)((char*)chainexec_shared + {start});"
              for name, ctype, start in arrays]
    lines += [f"  const int* orbit = T + (blockIdx.x % {plan.count}u) * {plan.width()};",
              f"  unsigned long long rest = blockIdx.x / {plan.count}u;"]
    lines += [f"  const {index} c{d} = ({index})(rest % {shape[d]}ull); rest /= {shape[d]}ull;"
              for d in reversed(range(len(shape))) if d not in moved and shape[d] > 1]
    if skip is not None and not any(strides[skip][d] for d in moved):
        lines += [f"  if (P{skip}[{offset_code(strides[skip])}] == 0) {{",
                  "    if (threadIdx.x == 0) Y[blockIdx.x] = 0.0;",
                  "    return;",
                  "  }"]
    lines += ["  double acc = 0.0;"]
    lines += ["  " + line for line in _stage_one(lets, copied, shape, strides, types, plan, index)]
    lines.append("  __syncthreads();")
    fixed, varying, single = _summed_inputs(code, strides, plan)
    lines += [f"  const {C_TYPES[types[k]]} p{k} = P{k}[{offset_code(strides[k])}];" for k in fixed]
    base = 1 + plan.members * s  # an orbit's row: where the slots of the blocks g·B start

    def at(g: tuple[int, ...], element: int) -> str:
        """The element of the block of values that holds the point ``g·x``."""
        return f"orbit[{base + element}] * {slot} + " + plan.place([f"x{g[u]}" for u in range(s)])

    lines += [f"  const int firsts = orbit[{base + plan.members}];",
              f"  for (unsigned e = threadIdx.x; e < {edge ** s}u; e += {BLOCK}u) {{",
              "    unsigned r = e;"]
    for u in reversed(range(s)):
        lines += [f"    const {index} x{u} = r % {edge}u;" + (f" r /= {edge}u;" if u else ""),
                  f"    const {index} g{u} = orbit[{1 + u}] * {edge} + x{u};"]
    if extent % edge:  # x past the extent: so is every point of its point orbit
        lines.append(f"    if ({' || '.join(f'g{u} >= {extent}' for u in range(s))}) continue;")
    for j in sorted(set(reads)):
        lines += [f"    const {value} z{j}_{h} = L{j}[{at(g, h)}];" for h, g in enumerate(elements)]
    for k, u in single.items():
        for v in range(s):
            offset = " + ".join(f"{f'g{v}' if d == moved[u] else f'c{d}'} * {st}"
                                for d, st in enumerate(strides[k]) if st)
            lines.append(f"    const {C_TYPES[types[k]]} p{k}_{v} = P{k}[{offset}];")
    for h, g in enumerate(elements):
        body = [f"const {index} c{moved[u]} = g{g[u]};" for u in range(s)]
        body += [f"const {C_TYPES[types[k]]} p{k} = " + (f"p{k}_{g[single[k]]};" if k in single else
                                                      f"P{k}[{offset_code(strides[k])}];") for k in varying]
        body += [f"const {C_TYPES[types[k]]} p{k} = S{k}[{at(g, h)}];" for k in copied]
        body += [f"const {value} q{r} = z{j}_{elements.index(tuple(g[p[u]] for u in range(s)))};"
                 for r, (j, p) in enumerate(zip(reads, plan.perms))]
        body.append(f"acc += (double)({code});")
        lines += [f"    if (firsts & {1 << h}) {{"] + ["      " + line for line in body] + ["    }"]
    lines.append("  }")
    return "\n".join(lines + block_sum())


def _stage_one(lets: tuple[str, ...], copied: tuple[int, ...], shape: tuple[int, ...],
               strides: list[tuple[int, ...]], types: tuple[str, ...], plan: Orbits, index: str) -> list[str]:
    """Stage one of :func:`orbit_source`: each point of the orbit's blocks (``t``: the block's slot,
    ``l{d}``: the point's place in it) writes the reused values ``L{j}`` and the copied inputs
    ``S{k}`` there. A thread takes a run of :data:`RUN` points along the first moved dimension,
    loading the inputs that do not vary along it once for the run; a warp spans the last moved
    dimensions, as the threads of the other kernels span the fastest dimension."""
    moved, edge, s = plan.moved, plan.edge, len(plan.moved)
    extent, slot = shape[moved[0]], plan.slot()
    first, chunk = moved[0], min(edge, RUN)
    tasks = edge ** (s - 1) * -(-edge // chunk)  # per block: a point of the other moved dimensions, a run
    used = _stage_one_inputs(lets, copied, len(types) - 1)
    loop = [f"for (unsigned task = threadIdx.x; task < orbit[0] * {tasks}u; task += {BLOCK}u) {{",
            f"  const int t = task / {tasks}u;",
            f"  unsigned r = task % {tasks}u;"]
    for u in reversed(range(1, s)):
        loop += [f"  const {index} l{moved[u]} = r % {edge}u; r /= {edge}u;",
                 f"  const {index} c{moved[u]} = orbit[1 + t * {s} + {u}] * {edge} + l{moved[u]};"]
    if extent % edge:
        loop.append(f"  if ({' || '.join(f'c{d} >= {extent}' for d in moved[1:])}) continue;")
    loop.append(f"  const {index} h = r * {chunk};")
    loop += [f"  const {C_TYPES[types[k]]} p{k} = P{k}[{offset_code(strides[k])}];" for k in used if not strides[k][first]]
    stop = f"l{first} < h + {chunk}" + (f" && l{first} < {edge}" if edge % chunk else "")
    loop += [f"  for ({index} l{first} = h; {stop}; ++l{first}) {{",
             f"    const {index} c{first} = orbit[1 + t * {s}] * {edge} + l{first};"]
    if extent % edge:
        loop.append(f"    if (c{first} >= {extent}) break;")
    loop += [f"    const {C_TYPES[types[k]]} p{k} = P{k}[{offset_code(strides[k])}];" for k in used if strides[k][first]]
    here = plan.place([f"l{d}" for d in moved])
    loop += [f"    L{j}[t * {slot} + {here}] = ({C_TYPES[types[-1]]})({c});" for j, c in enumerate(lets)]
    loop += [f"    S{k}[t * {slot} + {here}] = p{k};" for k in copied]
    return loop + ["  }", "}"]


def _summed_inputs(code: str, strides: list[tuple[int, ...]], plan: Orbits) -> tuple[list[int], list[int], dict]:
    """The inputs stage two of :func:`orbit_source` reads in device memory: those that vary along
    no permuted dimension (``fixed``, loaded once per thread), the others not copied into shared
    memory (``varying``), and of these each one along a single permuted dimension with its
    position in ``plan.moved`` (``single``): at every ``g·x`` it takes its value at one of
    ``x``'s coordinates, so it is loaded once per coordinate, not once per group element."""
    fixed = [k for k in range(len(strides)) if _reads(code, k) and not any(strides[k][d] for d in plan.moved)]
    varying = [k for k in range(len(strides)) if _reads(code, k) and k not in fixed and k not in plan.copied]
    single = {k: along[0] for k in varying
              if len(along := [u for u in range(len(plan.moved)) if strides[k][plan.moved[u]]]) == 1}
    return fixed, varying, single


def _stage_one_inputs(lets: tuple[str, ...], copied: tuple[int, ...], inputs: int) -> list[int]:
    """The inputs stage one of :func:`orbit_source` loads: those the reused values read, and the
    ones it copies into shared memory."""
    codes = list(lets) + [f"p{k}" for k in copied]
    return [k for k in range(inputs) if any(_reads(c, k) for c in codes)]


def point_bytes(lets: tuple[str, ...], code: str, reads: tuple[int, ...], shape: tuple[int, ...],
                strides: list[tuple[int, ...]], types: tuple[str, ...], plan: Orbits) -> float:
    """Bytes the kernel of :func:`orbit_source` loads and stores per point of its index space
    ``shape`` through the SM's L1 and shared memory, the path that bounds it (its device-memory
    traffic is each input's tile once, W's included), averaged over the points as the kernel's
    loops visit them. Stage one loads each input its reused values read once per point where it
    varies along the first permuted dimension, else once per run of :data:`RUN` (runs cover
    every block whole, past the extent too), and stores each value and copied input once. Stage
    two, per point ``x`` of an orbit's first block, loads every value at each group element and
    each input along one permuted dimension once per coordinate; per point it evaluates (every
    point once: an orbit of fewer blocks evaluates fewer per ``x``), each copied input in shared
    memory and each other input in device memory; each thread loads the inputs along no permuted
    dimension once (:func:`_summed_inputs`). The time model
    (:func:`chainexec.planner.cost.predict_nests`) divides these bytes by the rate ``chainexec
    calibrate`` measures on one such kernel (``Machine.orbit_bandwidth``), the hierarchical
    roofline's L1 ceiling (Yang, Kurth and Williams, Concurrency Computat. Pract. Exper. 32(20),
    2020)."""
    size = [_SIZES[C_TYPES[t]] for t in types]
    s, edge, first = len(plan.moved), plan.edge, plan.moved[0]
    extent, chunk, blocks = shape[first], min(edge, RUN), -(-shape[first] // edge)
    members = len(group(plan.perms))
    xs = _first_points(extent, edge, plan.perms) / extent ** s
    runs = blocks * -(-edge // chunk) / extent
    one = sum(size[k] * (1 if strides[k][first] else runs) for k in _stage_one_inputs(lets, plan.copied, len(types) - 1))
    one += len(lets) * size[-1] + sum(size[k] for k in plan.copied)
    fixed, varying, single = _summed_inputs(code, strides, plan)
    two = xs * (len(set(reads)) * members * size[-1] + sum(s * size[k] for k in single))
    two += sum(size[k] for k in plan.copied) + sum(size[k] for k in varying if k not in single)
    two += BLOCK * plan.count / extent ** s * sum(size[k] for k in fixed)
    return one + two


@lru_cache(maxsize=64)
def _first_points(extent: int, edge: int, perms: tuple[tuple[int, ...], ...]) -> int:
    """Points within ``extent`` of the first blocks of every orbit (:func:`orbit_table`) of
    blocks of ``edge`` under ``perms``: the points ``x`` stage two of :func:`orbit_source` visits.
    Counted once per extent and group (a (T) plan prices its energy once per candidate tiling)."""
    import numpy as np

    s = len(perms[0])
    table, count, members = orbit_table(-(-extent // edge), perms)
    starts = np.asarray(table).reshape(count, 2 + members * (s + 1))[:, 1:1 + s]
    return int(np.minimum(edge, extent - starts * edge).prod(axis=1).sum())


def fused_point_bytes(f, extents: dict[str, int], dtypes: dict[str, str]) -> float:
    """:func:`point_bytes` of the orbit kernel that runs the fused reduction ``f`` (a
    :class:`chainexec.planner.plan.Fused` with ``lets``) over a tile of ``extents`` (per index of
    its domain): its inputs are ``f``'s references in the order the runtime passes them
    (:attr:`~chainexec.planner.plan.Fused.leaves`), each varying along the indices it names, of
    their tensors' ``dtypes``; its values of the output's."""
    refs = f.leaves
    codes, code, perms = orbit_codes(f, refs)
    strides = [tuple(int(i in r.indices) for i in f.domain) for r in refs]
    types = tuple(dtypes[r.tensor] for r in refs) + (dtypes[f.out],)
    shape = tuple(extents[i] for i in f.domain)
    plan = orbits(shape, [p for _, p in perms], code, strides, types, len(codes))
    return point_bytes(codes, code, tuple(j for j, _ in perms), shape, strides, types, plan)
