"""Patches of arrays named by slices: their bounds per axis, and whether they are whole rows.

Shared by the global arrays (:mod:`chainexec.runtime.globalarray`), the tiles mapped from their
file (:mod:`chainexec.runtime.mapped`) and the disk store, which need nothing of MPI.
"""

from __future__ import annotations

import math

Region = tuple[slice, ...]
"""A patch: one step-1 slice per leading axis (missing trailing axes whole)."""


def region_bounds(region: Region, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``[start, stop)`` per axis of ``region`` in an array of ``shape``: a tuple of step-1
    slices, missing trailing axes whole."""
    if len(region) > len(shape):
        raise IndexError(f"region {region} has more axes than shape {shape}")
    found = []
    for s, n in zip(region, shape):
        if not isinstance(s, slice):
            raise TypeError(f"region entries must be slices, got {s!r}")
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"region slices must have step 1, got {s}")
        found.append((start, max(start, stop)))
    found += [(0, n) for n in shape[len(region):]]
    return tuple(found)


def box_shape(box: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """Extent per axis of a box (``[start, stop)`` per axis, :func:`region_bounds`)."""
    return tuple(b - a for a, b in box)


def whole_rows(box: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> bool:
    """Whether the box (``[start, stop)`` per axis) spans every axis of ``shape`` but the first:
    rows of a C-ordered array, one contiguous range of it."""
    return all((a, b) == (0, n) for (a, b), n in zip(box[1:], shape[1:]))


def row_bounds(shape: tuple[int, ...], parts: int) -> list[int]:
    """First row of each of ``parts`` blocks of the first axis of an array of ``shape``, as even
    as possible (block r: rows ``[r·n // parts, (r+1)·n // parts)``), plus the row count at the
    end (length ``parts + 1``). A 0-d array counts as one row; one with no elements is wholly
    the first block's."""
    n = shape[0] if shape else 1
    if not shape or math.prod(shape) == 0:
        return [0] + [n] * parts
    return [r * n // parts for r in range(parts + 1)]


def row_owners(bounds: list[int], box: tuple[tuple[int, int], ...]) -> list[tuple[int, tuple[int, int]]]:
    """The blocks (:func:`row_bounds`) holding part of ``box`` (``[start, stop)`` per axis; empty
    for a 0-d array: its one row), each with the ``[lo, hi)`` rows of it that block holds;
    empty for an empty box."""
    if any(b == a for a, b in box):
        return []
    a, b = box[0] if box else (0, 1)
    return [(r, (max(a, bounds[r]), min(b, bounds[r + 1]))) for r in range(len(bounds) - 1)
            if max(a, bounds[r]) < min(b, bounds[r + 1])]
