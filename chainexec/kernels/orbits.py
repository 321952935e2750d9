"""Orbit kernels: a full reduction whose expression reads values computed once per point at
several permutations of some of its dimensions (pure CUDA C source generation;
:func:`chainexec.runtime.pointwise.orbit_reduce` launches them).

The (T) energy reads ``Z = W + V/2`` at the six permutations of a, b, c (reused values,
:mod:`chainexec.planner.inline`). The permuted dimensions are cut into blocks (8x8x8), and a
thread block takes the blocks of one orbit under the group the permutations generate (a block and
its up to five images): it computes the values over them into shared memory, then sums the
expression over the same points reading them there. Each value is computed once and never stored
outside shared memory, where as two statements ``Z`` is written to device memory and read back.
A thread takes a run of points along the first permuted dimension (:data:`RUN`), loading the
inputs that do not vary along it once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache

from chainexec.kernels.elementwise import (BLOCK, BOX, C_TYPES, STAGE_BYTES, block_sum, box_pitches, check_code,
                                           index_type, offset_code)
from chainexec.planner.inline import MOVED

RUN = 4
"""Points an orbit kernel's thread takes one after another along the first permuted dimension
(:func:`orbit_source`): inputs that do not vary along it are loaded once for the run. In the (T)
energy, 8 of the reused ``Z``'s 19 inputs are such (at a run of 4: 13 loads per point, not 19)."""


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
        return box_pitches(list(self.moved), [self.edge] * len(self.moved))


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
    # whole arrays, one row per orbit (a Python loop over orbits costs milliseconds of a (T)
    # tile's host time at 12 blocks a side): an orbit is its first block's images under the group,
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
        return lets * members * box_pitches(list(moved), [edge] * len(moved))[1] * itemsize

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
        check_code(text)
    moved, edge, s = plan.moved, plan.edge, len(plan.moved)
    extent, index = shape[moved[0]], index_type([math.prod(shape)], shape, strides)
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
        lines += [f"  if (P{skip}[{offset_code(strides[skip])}] == 0) {{",
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
        loop += [f"  const {C_TYPES[types[k]]} p{k} = P{k}[{offset_code(strides[k])}];" for k in used if not strides[k][first]]
        stop = f"l{first} < h + {chunk}" + (f" && l{first} < {edge}" if edge % chunk else "")
        loop += [f"  for ({index} l{first} = h; {stop}; ++l{first}) {{",
                 f"    const {index} c{first} = orbit[1 + t * {s}] * {edge} + l{first};"]
        if extent % edge:
            loop.append(f"    if (c{first} >= {extent}) break;")
        loop += [f"    const {C_TYPES[types[k]]} p{k} = P{k}[{offset_code(strides[k])}];" for k in used if strides[k][first]]
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
    return "\n".join(lines + block_sum())

