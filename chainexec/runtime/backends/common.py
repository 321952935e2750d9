"""Helpers of both backends and their contraction methods, over any array module (NumPy or CuPy):
transpose-transpose-GEMM-transpose (TTGT), which contracts any pair of operands and is the NumPy
backend's method and the CuPy backend's fallback; views of an operand over another index order;
element strides; the rows a fetch fills."""

from __future__ import annotations

import math
from functools import lru_cache

from chainexec.planner.plan import Contraction


@lru_cache(maxsize=None)
def ttgt_layout(out: tuple, a: tuple, b: tuple):
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


def index_extents(c: Contraction, a, b) -> dict[str, int]:
    """Extent of every index of a binary contraction, read off the operands' shapes."""
    return dict(zip(c.a_indices, a.shape)) | dict(zip(c.b_indices, b.shape))


def ttgt_product(be, c: Contraction, a, b):
    """``factor · a·b`` as an array of backend ``be`` viewed in ``out``'s index order.

    Each operand's permutation becomes its matrices by :meth:`Backend.reshaped
    <chainexec.runtime.device.Backend.reshaped>` (a view where the backend's GEMM takes one);
    the factor scales the product in place (:meth:`Backend.assign
    <chainexec.runtime.device.Backend.assign>`). With no batch index the GEMM is 2-D (one plain
    GEMM call)."""
    xp = be.xp
    batch, lext, rext, ks, swap, pl, pr, pout = ttgt_layout(tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices))
    size = index_extents(c, a, b)
    left, right = (b, a) if swap else (a, b)
    if not ks:
        # Nothing summed (Hadamard or outer product): an element-wise broadcast, not a batch of
        # 1×1 GEMMs; an array also where both operands are scalars (NumPy's product of two 0-d
        # arrays is a scalar, which the factor cannot scale in place).
        product = xp.asarray(left.transpose(pl).reshape([size[i] for i in batch + lext] + [1] * len(rext))
                             * right.transpose(pr).reshape([size[i] for i in batch] + [1] * len(lext)
                                                           + [size[i] for i in rext]))
        if c.factor != 1.0:
            be.assign(product, product, c.factor)
        return product.transpose(pout)
    nb, nl, nr, nk = (math.prod(size[i] for i in g) for g in (batch, lext, rext, ks))
    lead = (nb,) if batch else ()
    product = xp.matmul(be.reshaped(left.transpose(pl), lead + (nl, nk)),
                        be.reshaped(right.transpose(pr), lead + (nk, nr)))
    product = product.reshape([size[i] for i in batch + lext + rext])
    if c.factor != 1.0:
        be.assign(product, product, c.factor)
    return product.transpose(pout)


def permuted(c: Contraction, a):
    """A unary statement's operand viewed in ``out``'s index order (a permuted copy)."""
    return a.transpose([c.a_indices.index(i) for i in c.out_indices])


def address(arr) -> int:
    """Address of ``arr``'s first element, a NumPy or a CuPy array alike (their array interfaces)."""
    return (getattr(arr, "__cuda_array_interface__", None) or arr.__array_interface__)["data"][0]


def span(arr) -> tuple[int, int]:
    """The memory a view reaches, NumPy or CuPy alike: the address of its lowest byte and one past
    its highest."""
    start = address(arr)
    low = sum(min(0, (n - 1) * s) for n, s in zip(arr.shape, arr.strides))
    high = sum(max(0, (n - 1) * s) for n, s in zip(arr.shape, arr.strides))
    return start + low, start + high + arr.itemsize


def overlaps(x, y) -> bool:
    """Whether two views' memory spans (:func:`span`) meet."""
    (a0, a1), (b0, b1) = span(x), span(y)
    return a0 < b1 and b0 < a1


def within(reaches: tuple[tuple[int, int], ...], spans) -> bool:
    """Whether each memory span of ``reaches`` (:func:`span`) lies within one of ``spans``."""
    return all(any(a <= low and high <= b for a, b in spans) for low, high in reaches)


def spread(arr, idx, order):
    """``arr`` (over index order ``idx``) as a view over ``order``: length 1 where it lacks an
    index of ``order``; its axes outside ``order`` (extent 1) dropped."""
    if any(i not in order for i in idx):  # (indexing a 0-d NumPy array would give a scalar)
        arr = arr[tuple(slice(None) if i in order else 0 for i in idx)]
    kept = [i for i in idx if i in order]
    view = arr.transpose([kept.index(i) for i in order if i in kept])
    return view[tuple(slice(None) if i in kept else None for i in order)]


def element_strides(arr) -> tuple[int, ...]:
    """An array's strides in elements."""
    return _in_elements(arr.strides, arr.itemsize)


@lru_cache(maxsize=4096)
def _in_elements(strides: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Byte strides in elements, kept: asked for every operand of every tile's contraction."""
    return tuple(s // itemsize for s in strides)


def all_rows(dst) -> slice | None:
    """All of the first axis of ``dst`` as :meth:`chainexec.runtime.device.Backend.fetch`'s ``read``
    and ``view`` take rows (None for a 0-d buffer)."""
    return slice(0, dst.shape[0]) if dst.ndim else None


def scratch_like(xp, out):
    """A zeroed scratch array shaped as ``out``, with ``out``'s strides where their span is at
    most twice ``out``'s size (else C-contiguous: a view cut from a much larger buffer)."""
    span = 1 + sum((n - 1) * s for n, s in zip(out.shape, out.strides)) // out.itemsize if out.size else 0
    if out.flags.c_contiguous or span > 2 * out.size or min(out.strides, default=0) < 0:
        return xp.zeros(out.shape, out.dtype)
    base = xp.zeros(span, out.dtype)
    return xp.ndarray(out.shape, out.dtype, base.data, strides=out.strides)
