"""Packed layouts of permutationally symmetric four-index tensors, compatible with PySCF (pure
NumPy, no I/O).

A tensor ``A[p, q, r, s]`` with ``p, q < n`` and ``r, s < m`` may be symmetric in the pair
``(p, q)`` (``A[p, q, r, s] = A[q, p, r, s]``), in the pair ``(r, s)``, in both, and — real
two-electron integrals ``(pq|rs)`` — also under the exchange of the two pairs
(``A[p, q, r, s] = A[r, s, p, q]``, ``n = m``). A packed layout stores each value of an orbit
of these permutations once. A symmetric pair ``p >= q`` packs to

    pair(p, q) = p (p + 1) / 2 + q                       (0 <= pair < n (n + 1) / 2)

the lower triangle in row-major order, PySCF's ``lib.pack_tril`` order (``numpy.tril_indices``);
:func:`pair_index` takes either order of its two indices. With ``P = n (n + 1) / 2`` and
``Q = m (m + 1) / 2``, the five layouts (PySCF's ``aosym`` codes) are:

======  ====================  ================================================  ===============
kind    packed shape          position of ``(p, q, r, s)`` in the flat array    elements
======  ====================  ================================================  ===============
s1      ``(n, n, m, m)``      ``((p n + q) m + r) m + s``                       ``n² m²``
s2ij    ``(P, m, m)``         ``(pair(p, q) m + r) m + s``                      ``P m²``
s2kl    ``(n, n, Q)``         ``(p n + q) Q + pair(r, s)``                      ``n² Q``
s4      ``(P, Q)``            ``pair(p, q) Q + pair(r, s)``                     ``P Q``
s8      ``(P (P + 1) / 2,)``  ``pair(pair(p, q), pair(r, s))``   (``n = m``)    ``P (P + 1) / 2``
======  ====================  ================================================  ===============

These are the arrays of ``mol.intor("int2e", aosym=kind)`` and ``ao2mo.restore(kind, eri,
norb)``; s8 is the lower triangle of the s4 matrix packed again.

Every layout is also a *matrix*: row ``R`` is the first index pair (``pair(p, q)`` where that
pair is packed, ``p n + q`` where it is not), column ``C`` the second (``pair(r, s)`` or
``r m + s``). The matrix of s1 is ``(n², m²)`` and of s4 ``(P, Q)`` — the 2-D datasets that
``pyscf.ao2mo.outcore.full`` / ``general`` write with ``compact=False`` and ``compact=True``;
the s8 vector holds the matrix's lower triangle (``C <= R``) only.

A :class:`Tile` is a block of that tensor (rows of the matrix, a rectangle of it, or a box of
dense indices) together with the packed positions that hold it, as sorted ``[start, stop)``
ranges of the flat packed array: :attr:`Tile.ranges` and :attr:`Tile.size` (elements; bytes are
``size * itemsize``) are what a tile costs to move, :meth:`Tile.unpack` turns the values of
those ranges, concatenated, into the block, and :meth:`Tile.pack` turns a block back into them.
Both are one gather / scatter through :attr:`Tile.index`, so a tile moves packed and is
unpacked where it lands (a device applies the same index with its own array library).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from chainexec.pairs import npair

KINDS = ("s1", "s2ij", "s2kl", "s4", "s8")
"""The packed layouts, named by PySCF's ``aosym`` codes."""


def pair_index(p, q) -> np.ndarray:
    """Packed position ``max(p, q) (max(p, q) + 1) / 2 + min(p, q)`` of the pair ``(p, q)``
    (element-wise, int64; ``lib.pack_tril`` order)."""
    p = np.asarray(p, dtype=np.int64)
    q = np.asarray(q, dtype=np.int64)
    hi = np.maximum(p, q)
    return hi * (hi + 1) // 2 + np.minimum(p, q)


def pair_unindex(k) -> tuple[np.ndarray, np.ndarray]:
    """The pair ``(p, q)``, ``p >= q``, at packed position ``k`` (element-wise, int64): the
    inverse of :func:`pair_index`, exact for every ``k < 2**61``."""
    k = np.asarray(k, dtype=np.int64)
    p = ((np.sqrt(8.0 * k + 1.0) - 1.0) // 2).astype(np.int64)
    p -= (p * (p + 1) // 2 > k)
    p += ((p + 1) * (p + 2) // 2 <= k)
    return p, k - p * (p + 1) // 2


def _pair_extent(npairs: int) -> int:
    """The extent ``n`` with ``npair(n) == npairs``; ValueError if there is none."""
    n = int(pair_unindex(npairs)[0])
    if npair(n) != npairs:
        raise ValueError(f"{npairs} is not a number of symmetric pairs n(n+1)/2")
    return n


def unpack_pairs(x, axis: int = -1) -> np.ndarray:
    """Axis ``axis`` of ``x``, a packed symmetric pair (length ``n (n + 1) / 2``), unpacked into
    two axes of extent ``n`` at its place: ``out[..., p, q, ...] = x[..., pair(p, q), ...]``.
    With ``axis=-1`` this is PySCF's ``lib.unpack_tril`` (``filltriu=HERMITIAN``, real data)."""
    x = np.asarray(x)
    n = _pair_extent(x.shape[axis])
    grid = np.arange(n)
    return np.take(x, pair_index(grid[:, None], grid[None, :]), axis=axis)


def pack_pairs(x, axis: int = -2) -> np.ndarray:
    """Axes ``axis`` and ``axis + 1`` of ``x`` (both of extent ``n``, a symmetric pair) packed
    into one axis of length ``n (n + 1) / 2`` holding their lower triangle ``p >= q``. With
    ``axis=-2`` this is PySCF's ``lib.pack_tril``."""
    x = np.asarray(x)
    axis %= x.ndim
    n = x.shape[axis]
    if axis + 1 >= x.ndim or x.shape[axis + 1] != n:
        raise ValueError(f"axes {axis} and {axis + 1} of shape {x.shape} are not a square pair")
    return x[(slice(None),) * axis + np.tril_indices(n)]


@dataclass(frozen=True)
class Layout:
    """A packed layout ``kind`` (one of :data:`KINDS`) of a tensor ``A[p, q, r, s]``, ``p, q < n``
    and ``r, s < m`` (``m`` defaults to ``n``; s8 needs ``m == n``). Raises ValueError for an
    unknown kind or bad extents."""

    kind: str
    n: int
    m: int | None = None

    def __post_init__(self):
        if self.m is None:
            object.__setattr__(self, "m", self.n)
        if self.kind not in KINDS:
            raise ValueError(f"unknown packed layout {self.kind!r} ({', '.join(KINDS)})")
        if min(self.n, self.m) < 1:
            raise ValueError(f"layout {self.kind} needs positive extents, got n={self.n}, m={self.m}")
        if self.kind == "s8" and self.n != self.m:
            raise ValueError(f"layout s8 needs equal extents of both pairs, got n={self.n}, m={self.m}")

    @property
    def packs_rows(self) -> bool:
        """Whether ``(p, q)`` is stored as a symmetric pair."""
        return self.kind in ("s2ij", "s4", "s8")

    @property
    def packs_cols(self) -> bool:
        """Whether ``(r, s)`` is stored as a symmetric pair."""
        return self.kind in ("s2kl", "s4", "s8")

    @property
    def dense_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.n, self.m, self.m)

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """(rows, columns) of the matrix view (module docstring)."""
        return (npair(self.n) if self.packs_rows else self.n * self.n,
                npair(self.m) if self.packs_cols else self.m * self.m)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the packed array, as PySCF's ``mol.intor`` and ``ao2mo.restore`` return it."""
        rows, cols = self.matrix_shape
        return {"s1": self.dense_shape, "s2ij": (rows, self.m, self.m), "s2kl": (self.n, self.n, cols),
                "s4": (rows, cols), "s8": (npair(rows),)}[self.kind]

    @property
    def size(self) -> int:
        """Number of elements of the packed array."""
        return int(np.prod(self.shape))

    def row(self, p, q) -> np.ndarray:
        """Matrix row of the first index pair (element-wise)."""
        return pair_index(p, q) if self.packs_rows else np.asarray(p, np.int64) * self.n + np.asarray(q)

    def col(self, r, s) -> np.ndarray:
        """Matrix column of the second index pair (element-wise)."""
        return pair_index(r, s) if self.packs_cols else np.asarray(r, np.int64) * self.m + np.asarray(s)

    def position(self, row, col) -> np.ndarray:
        """Flat packed position of matrix element ``(row, col)`` (element-wise; s8 stores
        ``(row, col)`` and ``(col, row)`` once, at ``pair(row, col)``)."""
        if self.kind == "s8":
            return pair_index(row, col)
        return np.asarray(row, np.int64) * self.matrix_shape[1] + np.asarray(col)

    def matrix_tile(self, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> Tile:
        """The block ``M[r0:r1, c0:c1]`` of the matrix view (all columns by default); shape
        ``(r1 - r0, c1 - c0)``."""
        (r0, r1), (c0, c1) = checked_range(rows, self.matrix_shape[0]), checked_range(cols, self.matrix_shape[1])
        return Tile(self, np.arange(r0, r1)[:, None], np.arange(c0, c1)[None, :])

    def row_tile(self, r0: int, r1: int) -> Tile:
        """Matrix rows ``[r0, r1)`` with the second index pair dense: shape ``(r1 - r0, m, m)``,
        ``block[i, r, s] = M[r0 + i, col(r, s)]`` — what a transform of ``(r, s)`` consumes."""
        r0, r1 = checked_range((r0, r1), self.matrix_shape[0])
        grid = np.arange(self.m)
        return Tile(self, np.arange(r0, r1)[:, None, None], self.col(grid[:, None], grid[None, :])[None])

    def box_tile(self, box) -> Tile:
        """The dense block ``A[p0:p1, q0:q1, r0:r1, s0:s1]`` for ``box = ((p0, p1), (q0, q1),
        (r0, r1), (s0, s1))``: the packed ranges a tile of dense indices needs."""
        (p, q, r, s) = (np.arange(*checked_range(b, e)) for b, e in zip(box, self.dense_shape, strict=True))
        return Tile(self, self.row(p[:, None], q[None, :])[:, :, None, None],
                    self.col(r[:, None], s[None, :])[None, None])

    def leading_tile(self, start: int, stop: int) -> Tile:
        """The block that the slice ``packed[start:stop]`` of the packed array's leading axis
        holds (as an HDF5 hyperslab or :meth:`chainexec.sources.Source.values` reads it), with
        every index it covers in full unpacked: s1, s2kl: ``A[start:stop]``, shape
        ``(k, n, m, m)``; s2ij, s4: :meth:`row_tile` of pair rows ``[start, stop)``; s8: ``start``
        and ``stop`` must be triangle-row boundaries ``pair(R0, 0)`` and ``pair(R1, 0)``, whose
        slice holds exactly ``M[R0:R1, 0:R1]`` (:meth:`matrix_tile`)."""
        start, stop = checked_range((start, stop), self.shape[0])
        if self.kind in ("s1", "s2kl"):
            return self.box_tile(((start, stop), (0, self.n), (0, self.m), (0, self.m)))
        if self.kind != "s8":
            return self.row_tile(start, stop)
        (r0, r1), (c0, c1) = pair_unindex([start, stop])
        if c0 or c1:
            raise ValueError(f"s8 positions [{start}, {stop}) do not start and end on triangle rows "
                             f"(rows begin at R(R+1)/2: {npair(int(r0))}, {npair(int(r1))}, …)")
        return self.matrix_tile((int(r0), int(r1)), (0, int(r1)))


def checked_range(span, extent: int) -> tuple[int, int]:
    """``span`` (``(start, stop)``, or None for all of ``extent``) checked against ``extent``."""
    start, stop = (0, extent) if span is None else (int(span[0]), int(span[1]))
    if not 0 <= start <= stop <= extent:
        raise ValueError(f"range [{start}, {stop}) is not within [0, {extent})")
    return start, stop


@dataclass(frozen=True, eq=False)
class Tile:
    """A block of a packed tensor: ``block[...] = M[rows[...], cols[...]]`` for two integer
    grids of matrix rows and columns that broadcast to the block's shape (made by
    :class:`Layout`'s ``*_tile`` methods)."""

    layout: Layout
    rows: np.ndarray
    cols: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the unpacked block."""
        return np.broadcast_shapes(self.rows.shape, self.cols.shape)

    @cached_property
    def _rowset(self) -> np.ndarray:
        return np.unique(self.rows)

    @cached_property
    def _colset(self) -> np.ndarray:
        return np.unique(self.cols)

    @cached_property
    def size(self) -> int:
        """Packed elements the block needs (each stored value once): ``|rows| · |cols|`` distinct
        rows and columns, less, in s8, the ``(x² - x) / 2`` elements held twice where ``x`` rows
        are also columns."""
        total = len(self._rowset) * len(self._colset)
        if self.layout.kind == "s8":
            both = len(np.intersect1d(self._rowset, self._colset, assume_unique=True))
            total -= (both * both - both) // 2
        return int(total)

    @cached_property
    def ranges(self) -> np.ndarray:
        """The packed positions the block needs: sorted, disjoint, non-adjacent ``[start, stop)``
        ranges of the flat packed array, shape ``(k, 2)`` (int64)."""
        rowruns, colruns = _runs(self._rowset), _runs(self._colset)
        if self.layout.kind != "s8":
            ncols = self.layout.matrix_shape[1]
            return _merge(_segments(self._rowset * ncols, colruns, np.full(len(self._rowset), ncols)))
        # lower triangle (col <= row): row R's columns at pair(R, 0) + col;
        # upper (col > row): stored transposed, column C's rows at pair(C, 0) + row
        lower = _segments(pair_index(self._rowset, 0), colruns, self._rowset + 1)
        upper = _segments(pair_index(self._colset, 0), rowruns, self._colset)
        return _merge(np.concatenate([lower, upper]))

    @cached_property
    def index(self) -> np.ndarray:
        """For each element of the block, its offset in the values of :attr:`ranges`
        concatenated (shape :attr:`shape`, intp): ``block = values[index]``."""
        pos = self.layout.position(self.rows, self.cols)
        starts, stops = self.ranges[:, 0], self.ranges[:, 1]
        offsets = np.concatenate([[0], np.cumsum(stops - starts)[:-1]])
        k = np.searchsorted(starts, pos, side="right") - 1
        return (pos - starts[k] + offsets[k]).astype(np.intp)

    def unpack(self, values) -> np.ndarray:
        """The block from the packed values of :attr:`ranges`, concatenated in order (any dtype)."""
        values = np.asarray(values).reshape(-1)
        if values.size != self.size:
            raise ValueError(f"a packed tile of {self.size} values, got {values.size}")
        return values[self.index]

    def pack(self, block) -> np.ndarray:
        """The packed values of :attr:`ranges`, concatenated, from ``block`` (inverse of
        :meth:`unpack`; where the block holds one stored value twice, it must hold it equal)."""
        block = np.asarray(block)
        if block.shape != self.shape:
            raise ValueError(f"a tile block of shape {self.shape}, got {block.shape}")
        values = np.empty(self.size, dtype=block.dtype)
        values[self.index] = block
        return values


def _runs(sorted_unique: np.ndarray) -> np.ndarray:
    """Maximal runs of consecutive integers of a sorted array, as ``[lo, hi)`` rows (k, 2)."""
    if not sorted_unique.size:
        return np.zeros((0, 2), np.int64)
    breaks = np.flatnonzero(np.diff(sorted_unique) != 1) + 1
    lo = sorted_unique[np.concatenate([[0], breaks])]
    hi = sorted_unique[np.concatenate([breaks - 1, [sorted_unique.size - 1]])] + 1
    return np.stack([lo, hi], axis=1).astype(np.int64)


def _segments(base: np.ndarray, runs: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """Ranges ``[base_i + lo, base_i + min(hi, limit_i))`` for every ``base_i`` and run
    ``[lo, hi)`` (the empty ones dropped), shape (k, 2)."""
    lo = np.broadcast_to(runs[None, :, 0], (len(base), len(runs)))
    hi = np.minimum(runs[None, :, 1], np.asarray(limit)[:, None])
    keep = lo < hi
    return np.stack([(base[:, None] + lo)[keep], (base[:, None] + hi)[keep]], axis=1).astype(np.int64)


def _merge(ranges: np.ndarray) -> np.ndarray:
    """The union of ``[start, stop)`` ranges as sorted, disjoint, non-adjacent ranges."""
    if not len(ranges):
        return np.zeros((0, 2), np.int64)
    ranges = ranges[np.argsort(ranges[:, 0], kind="stable")]
    reach = np.maximum.accumulate(ranges[:, 1])
    first = np.concatenate([[True], ranges[1:, 0] > reach[:-1]])
    last = np.concatenate([np.flatnonzero(first)[1:] - 1, [len(ranges) - 1]])
    return np.stack([ranges[first, 0], reach[last]], axis=1)


def pack(dense, kind: str) -> np.ndarray:
    """The dense tensor ``A`` (shape ``(n, n, m, m)``, with the symmetry ``kind`` assumes)
    packed in layout ``kind``: the array :attr:`Layout.shape` whose element at the position of
    the module table is ``A[p, q, r, s]`` with ``p >= q``, ``r >= s`` (and ``pair(p, q) >=
    pair(r, s)`` in s8). Equals ``ao2mo.restore(kind, A, n)`` for s4 and s8. Keeps the dtype."""
    dense = np.asarray(dense)
    if dense.ndim != 4 or dense.shape[0] != dense.shape[1] or dense.shape[2] != dense.shape[3]:
        raise ValueError(f"a dense (n, n, m, m) tensor, got shape {dense.shape}")
    layout = Layout(kind, dense.shape[0], dense.shape[2])
    x = pack_pairs(dense, 2) if layout.packs_cols else dense
    x = pack_pairs(x, 0) if layout.packs_rows else x
    return np.ascontiguousarray(pack_pairs(x, 0) if kind == "s8" else x)


def unpack(packed, layout: Layout) -> np.ndarray:
    """The dense tensor ``(n, n, m, m)`` from ``packed``, an array of ``layout`` (its packed
    shape or any shape of as many elements, e.g. the matrix view). Keeps the dtype."""
    packed = np.asarray(packed)
    if packed.size != layout.size:
        raise ValueError(f"layout {layout.kind} of n={layout.n}, m={layout.m} holds {layout.size} "
                         f"elements, got {packed.size}")
    x = packed.reshape(layout.shape)
    x = unpack_pairs(x, 0) if layout.kind == "s8" else x
    x = unpack_pairs(x, 0) if layout.packs_rows else x
    return unpack_pairs(x, -1) if layout.packs_cols else x
