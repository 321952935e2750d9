"""A binary contraction as batched GEMMs over the operands as they lie: no copy, no transpose.

Shi, Niranjan, Anandkumar and Cecka, "Tensor contractions with extended BLAS kernels on CPU and
GPU": a contraction whose modes
can be split into *GEMM modes* (each group one stride in every tensor it appears in) and *batch
modes* runs as STRIDEDBATCHEDGEMM calls (Sec. III-D, Listing 1) nested in loops over the other
batch modes (Listing 2), reading the operands and writing the output in place. This module is the
pure part: which modes go where (Sec. IV-D's priorities, Algorithm 2), as plain numbers the
runtime hands to cuBLAS (:meth:`chainexec.runtime.backends.methods.Methods.batched_gemm`).

The choice, for ``out[...] (+)= α Σ a[...]·b[...]`` over strided views (strides in elements):

1. *Flatten* (priority 1): the contracted modes K, the a-side modes M (in ``a`` and ``out``) and
   the b-side modes N (in ``b`` and ``out``) each form one GEMM dimension from a subset whose
   modes merge — stride of the outer = stride × extent of the inner — in every tensor holding them.
2. Each matrix needs one unit-stride dimension (BLAS's leading-dimension form): ``out`` in M or N,
   ``a`` in M or K, ``b`` in K or N (either may be transposed, ``out`` by computing ``outᵀ = bᵀaᵀ``).
3. Of the valid (M', N', K') subsets the largest GEMM wins (|M'|·|N'|, then |K'|), so the
   heaviest part of the work runs in one call.
4. The remaining output modes are batched. Modes that step as one in all three tensors merge
   into one batch mode; the largest is one STRIDEDBATCHEDGEMM call (priority 2). Where others
   remain, the paper nests the calls in loops over them (Listing 2): that form is kept where the
   loops have at most :data:`STRIDED_CALLS` iterations, and beyond that all of them are one
   pointer-array batched call. cuBLAS runs a pointer-array call with small tiles whatever the
   GEMMs' size (the (T) W term of o=32, v=300 at occupied tiles of two: 300×90000×332 GEMMs at
   a 64×64 tile), while a call costs microseconds of Python and launch: with a call per
   iteration of many, batched GEMM's launch overhead on the autotuner's probe would make it lose
   to GETT on small (T) terms. Contracted modes left out of K' are looped, each iteration's call
   adding into the same output.

Beyond the paper: multi-mode and arbitrary-order contractions (it treats single-mode ones), views
cut from larger buffers (any strides), modes of extent 1 ignored, and batch modes shared by all
three tensors (true batch indices).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

MIN_SIDE = 8
"""Fewest GEMM rows or columns worth a BLAS call: thinner GEMMs are matrix-vector products or dot
products, which run at a small fraction of the other methods' rate (TCCG cases 2-8 and 20-30
would fall to batches of them, and the (T) energy's full reduction to one 1x1 GEMM over 1.4e8
summed elements). The autotuner need not time them."""

STRIDED_CALLS = 16
"""Most strided-batched calls nested in loops over the output modes left beside the batch mode;
more nested iterations are one pointer-array call (module docstring, item 4)."""


@dataclass(frozen=True)
class Matrix:
    """One operand's GEMM view: ``rows``×``cols`` with element strides ``row_stride`` and
    ``col_stride`` (see :func:`blas` for the BLAS form)."""

    rows: int
    cols: int
    row_stride: int
    col_stride: int


@dataclass(frozen=True)
class BatchedGemm:
    """``out[m, n] (+)= α Σ_k a[m, k] b[k, n]`` for every batch and loop iteration.

    ``a``, ``b`` and ``out`` are the GEMM views (m×k, k×n, m×n). ``batch`` is the strided batch:
    (count, a stride, b stride, out stride) in elements. ``loops`` are the nested output-mode loops
    and ``k_loops`` the contracted modes outside the GEMM, each as (extent, a stride, b stride,
    out stride); a k-loop's iterations add into the same output, so only its first may overwrite.
    ``dims``: the modes that make m, n and k, each innermost first."""

    a: Matrix
    b: Matrix
    out: Matrix
    batch: tuple[int, int, int, int]
    loops: tuple[tuple[int, int, int, int], ...]
    k_loops: tuple[tuple[int, int, int, int], ...]
    dims: tuple[tuple[str, ...], ...] = ()

    def launches(self) -> list[Launch]:
        """The BLAS calls that compute it, in order, for each k-loop iteration (the first's may
        overwrite, the others' add): a strided-batched call per nested-loop iteration where there
        are at most :data:`STRIDED_CALLS`, else one pointer-array call over every nested-loop and
        batch iteration."""
        k_offsets = _offsets(self.k_loops)
        nested = _offsets(self.loops)
        if len(nested) <= STRIDED_CALLS:
            return [Launch((k_off + row)[None, :], True, n == 0) for n, k_off in enumerate(k_offsets) for row in nested]
        count, *strides = self.batch
        every = (nested[:, None, :] + np.arange(count)[:, None] * np.array(strides)).reshape(-1, 3)
        return [Launch(k_off + every, False, n == 0) for n, k_off in enumerate(k_offsets)]


@dataclass(frozen=True, eq=False)
class Launch:
    """One BLAS call: the element offsets (a, b, out) of its matrices, an int64 array of one row
    per matrix — with ``strided`` one row, the first of ``batch[0]`` matrices ``batch[1:]`` apart
    (STRIDEDBATCHEDGEMM), else every matrix's own (pointer-array batched GEMM). ``first``: the call
    may overwrite ``out`` (β applies); later calls of a contracted-mode loop add to it."""

    offsets: np.ndarray
    strided: bool
    first: bool


def _offsets(loops) -> np.ndarray:
    """Element offsets (a, b, out) of every iteration of ``loops`` (each (extent, a stride,
    b stride, out stride); the last varies fastest), one row per iteration. Built as arrays: a
    (T) W tile of o=21, v=93 has 20,088 GEMMs a call, and tuples of Python ints would cost a
    tenth of a second a layout, most of a short run."""
    every = np.zeros((1, 3), np.int64)
    for n, sa, sb, so in loops:
        step = np.arange(n, dtype=np.int64)[:, None] * np.array([sa, sb, so], np.int64)
        every = (every[:, None, :] + step[None, :, :]).reshape(-1, 3)
    return every


def _merge(group: list[str], sizes: dict[str, int], strides: list[dict[str, int]]) -> bool:
    """Whether ``group`` (ordered innermost first) steps as one dimension in every tensor of
    ``strides``: each mode's stride is the inner one's times the inner one's extent."""
    return all(st[outer] == st[inner] * sizes[inner] for st in strides for inner, outer in zip(group, group[1:]))


def _groups(modes: list[str], sizes: dict[str, int], strides: list[dict[str, int]]):
    """Every subset of ``modes`` that merges into one dimension in each of ``strides`` (ordered by
    the first tensor's strides), as (extent, modes innermost first, its stride in each tensor);
    the empty subset is extent 1, stride 0."""
    found = [(1, (), tuple(0 for _ in strides))]
    for r in range(1, len(modes) + 1):
        for sub in itertools.combinations(modes, r):
            group = sorted(sub, key=lambda i: strides[0][i])
            if not _merge(group, sizes, strides):
                continue
            found.append((math.prod(sizes[i] for i in group), tuple(group),
                          tuple(st[group[0]] for st in strides)))
    return found


def _merged(loops: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Output-mode loops (extent, a stride, b stride, out stride) with each pair that steps as one
    in all three tensors (the outer's strides the inner's times the inner's extent; a stride of 0
    where a tensor lacks the mode) made one loop."""
    found = list(loops)
    joined = True
    while joined:
        joined = False
        for inner, outer in itertools.permutations(found, 2):
            if all(so == si * inner[0] for si, so in zip(inner[1:], outer[1:])):
                found.remove(inner)
                found[found.index(outer)] = (inner[0] * outer[0], *inner[1:])
                joined = True
                break
    return found


def _unit(extent_1: int, stride_1: int, extent_2: int, stride_2: int) -> bool:
    """Whether a matrix with dimensions (extent, stride) 1 and 2 is a BLAS matrix: one dimension
    of unit stride (or extent 1) and the other's stride at least that one's extent (or extent 1)."""
    for (n1, s1), (n2, s2) in (((extent_1, stride_1), (extent_2, stride_2)), ((extent_2, stride_2), (extent_1, stride_1))):
        if (n1 == 1 or s1 == 1) and (n2 == 1 or s2 >= n1):
            return True
    return False


def plan(out_indices, a_indices, b_indices, sizes: dict[str, int],
         strides: tuple[dict[str, int], dict[str, int], dict[str, int]],
         min_side: int = MIN_SIDE) -> BatchedGemm | None:
    """The batched GEMM that computes ``out (+)= a·b`` in place (module docstring), or None where
    none does: nothing contracted, a mode in one tensor only, a negative stride or a zero output
    stride, or only GEMMs
    with fewer than ``min_side`` rows or columns (:data:`MIN_SIDE`).

    ``sizes`` maps every mode to its extent; ``strides`` are ``out``'s, ``a``'s and ``b``'s element
    strides by mode."""
    so, sa, sb = (dict(s) for s in strides)
    every = dict.fromkeys(list(out_indices) + list(a_indices) + list(b_indices))
    modes = [i for i in every if sizes[i] > 1]
    if any(s < 0 for st in (so, sa, sb) for s in st.values()) or any(so.get(i) == 0 for i in modes):
        return None  # a zero output stride: one call's matrices would write the same elements
    inside = {i: (i in so, i in sa, i in sb) for i in modes}
    if any(sum(w) < 2 for w in inside.values()):
        return None
    ks = [i for i in modes if inside[i] == (False, True, True)]
    ms = [i for i in modes if inside[i] == (True, True, False)]
    ns = [i for i in modes if inside[i] == (True, False, True)]
    if not ks:
        return None
    best = None
    for k_ext, k_grp, (ka, kb) in _groups(ks, sizes, [sa, sb])[1:]:
        for m_ext, m_grp, (mo, ma) in _groups(ms, sizes, [so, sa]):
            for n_ext, n_grp, (no, nb) in _groups(ns, sizes, [so, sb]):
                if not (_unit(m_ext, mo, n_ext, no) and _unit(m_ext, ma, k_ext, ka) and _unit(k_ext, kb, n_ext, nb)):
                    continue
                score = (m_ext * n_ext, k_ext)
                if best is None or score > best[0]:
                    best = (score, (m_ext, mo, ma), (n_ext, no, nb), (k_ext, ka, kb), (m_grp, n_grp, k_grp))
    if best is None:
        return None
    _, (m, mo, ma), (n, no, nb), (k, ka, kb), dims = best
    used = set(sum(dims, ()))
    if min(m, n) < min_side:
        return None
    left = [i for i in modes if i not in used]
    entry = {i: (sizes[i], sa.get(i, 0), sb.get(i, 0), so.get(i, 0)) for i in left}
    loops = sorted(_merged([entry[i] for i in left if i in so]), key=lambda x: -x[0])
    k_loops = tuple(entry[i] for i in left if i not in so)
    batch = loops[0] if loops else (1, 0, 0, 0)
    return BatchedGemm(Matrix(m, k, ma, ka), Matrix(k, n, kb, nb), Matrix(m, n, mo, no), batch,
                       tuple(loops[1:]), k_loops, dims)


def operand_orders(out_indices, a_indices, b_indices) -> tuple[list[str], list[str]]:
    """Index orders for copies of ``a`` and ``b`` under which :func:`plan` merges the most modes:
    the batch modes (in all three) and each operand's own modes in ``out``'s order, the contracted
    modes in ``a``'s order in both, between them. A run of an operand's modes adjacent in ``out``
    is then adjacent in its copy too, so it becomes one GEMM dimension wherever ``out`` allows:
    for the (T) term ``W[i,j,k,a,b,c] += ovvv[i,a,f,b]·t2[k,j,c,f]`` the copy ``ovvv[i,f,a,b]``
    makes (a, b) one GEMM dimension, GEMMs of v²×v×v over the occupied triples instead of v×v×v
    over the triples and a."""
    batch = [i for i in out_indices if i in a_indices and i in b_indices]
    ks = [i for i in a_indices if i in b_indices and i not in out_indices]
    own = [[i for i in out_indices if i in x and i not in batch] for x in (a_indices, b_indices)]
    rest = [[i for i in x if i not in out_indices and i not in ks] for x in (a_indices, b_indices)]
    return batch + ks + own[0] + rest[0], batch + ks + own[1] + rest[1]


def _column_major(x: Matrix) -> tuple[bool, int]:
    """A GEMM view as a column-major BLAS operand: (transposed, leading dimension). Column-major
    ``rows``×``cols`` needs unit row stride and ld = the column stride ≥ rows; with unit column
    stride it is the transpose of a column-major ``cols``×``rows`` matrix (ld = row stride ≥
    cols). A dimension of extent 1 has no stride that matters; BLAS still wants ld ≥ the other."""
    if (x.rows == 1 or x.row_stride == 1) and (x.cols == 1 or x.col_stride >= x.rows):
        return False, x.col_stride if x.cols > 1 else max(x.rows, 1)
    return True, x.row_stride if x.rows > 1 else max(x.cols, 1)


@dataclass(frozen=True)
class Blas:
    """The column-major BLAS call of a :class:`BatchedGemm`: ``C = op(A)·op(B)`` with C m×n.
    ``swap``: C is the transpose of ``out`` (``outᵀ = bᵀ·aᵀ``), so A is ``b`` and B is ``a``."""

    trans_a: bool
    trans_b: bool
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    swap: bool


def blas(g: BatchedGemm) -> Blas:
    """How cuBLAS (column-major) computes ``g``: ``out`` itself where it is column-major, else its
    transpose (then ``a`` and ``b`` trade places and are transposed)."""
    trans_c, ldc = _column_major(g.out)
    if not trans_c:
        first, second, swap = g.a, g.b, False
    else:
        first = Matrix(g.b.cols, g.b.rows, g.b.col_stride, g.b.row_stride)
        second = Matrix(g.a.cols, g.a.rows, g.a.col_stride, g.a.row_stride)
        swap = True
    trans_a, lda = _column_major(first)
    trans_b, ldb = _column_major(second)
    return Blas(trans_a, trans_b, first.rows, second.cols, first.cols, lda, ldb, ldc, swap)


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


ADDRESSES = "\n".join([
    'extern "C" __global__ void chainexec_addresses(long long* at, const long long* table, const long long n,',
    "                                               const long long a, const long long b, const long long c) {",
    "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < 3 * n;",
    "       i += (long long)gridDim.x * blockDim.x)",
    "    at[i] = table[i] + (i < n ? a : i < 2 * n ? b : c);",
    "}"])
"""CUDA C of ``chainexec_addresses(at, table, n, a, b, c)``: the device addresses of a pointer-array
launch's matrices, row r of the (3, ``n``) byte offsets ``table`` plus the base address ``a``,
``b`` or ``c`` of its operand (the addresses are kernel arguments, so nothing is copied from the
host, which would wait for the work queued before it), in one launch. The source is the same for
every launch: a warm-up compiles and loads it (:func:`chainexec.runtime.pointwise.load_common`)."""
