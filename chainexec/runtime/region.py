"""Patches of arrays named by slices: their bounds per axis, and whether they are whole rows.

Shared by the global arrays (:mod:`chainexec.runtime.globalarray`), the tiles mapped from their
file (:mod:`chainexec.runtime.mapped`) and the disk store, which need nothing of MPI.
"""

from __future__ import annotations

Region = tuple[slice, ...]
"""A patch: one step-1 slice per leading axis (missing trailing axes whole)."""


def region_bounds(region: Region, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``[start, stop)`` per axis of ``region`` in an array of ``shape``: a tuple of step-1
    slices, missing trailing axes whole."""
    if len(region) > len(shape):
        raise IndexError(f"region {region} has more axes than shape {shape}")
    found = []
    for s, n in zip(tuple(region) + (slice(None),) * (len(shape) - len(region)), shape):
        if not isinstance(s, slice):
            raise TypeError(f"region entries must be slices, got {s!r}")
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"region slices must have step 1, got {s}")
        found.append((start, max(start, stop)))
    return tuple(found)


def whole_rows(box: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> bool:
    """Whether the box (``[start, stop)`` per axis) spans every axis of ``shape`` but the first:
    rows of a C-ordered array, one contiguous range of it."""
    return all((a, b) == (0, n) for (a, b), n in zip(box[1:], shape[1:]))
