"""In-place symmetrization kernels: ``y = Σ_p y.transpose(p)`` over a group of axis permutations
(pure CUDA C source generation; :func:`chainexec.runtime.pointwise.symmetrize` launches them).

A symmetrized run of terms ends with this sum (:mod:`chainexec.planner.symmetry`). The array is
cut into blocks (8x8x8 over the three virtual indices a diagonal (T) tile exchanges); a thread
block takes one orbit of blocks, copies them into shared memory and writes each point as the sum
of its images, so every point is read before any of it is written: one read and one write of the
array, where out of place the sum reads every permuted view and the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chainexec.kernels.elementwise import BLOCK, C_TYPES, STAGE_BYTES, box_pitches, index_type

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
    """The blocked dimensions, slowest first (the order :func:`box_pitches` takes)."""
    return sorted((d for d in range(len(edges)) if edges[d] > 1), key=lambda d: (-abs(strides[d]), d))


def _symmetrize_slot(strides: tuple[int, ...], edges) -> int:
    """Shared-memory elements one block takes (:func:`box_pitches`)."""
    dims = _symmetrize_dims(strides, edges)
    return box_pitches(dims, [edges[d] for d in dims])[1]


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
    index = index_type([math.prod(shape)], shape, [strides])
    edges, counts, g = plan.edges, plan.counts, len(axes)
    dims = _symmetrize_dims(strides, edges)
    pitch, slot = box_pitches(dims, [edges[d] for d in dims])
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

