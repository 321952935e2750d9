"""Shapes of one class, which share the autotuner's decisions.

Which method runs a contraction fastest (or which strategy a run of terms into one buffer) depends
on its structure far more than on its extents: the index lists, which dimension of each operand is
contiguous, the dtype. A symmetric tile loop meets one full tile shape and a few cut ones (the (T)
tiles 6×6×6 and 6×6×3 of 21 occupied orbitals), and a second molecule meets the shapes of the
first a few percent larger or smaller. Timing the candidates of each such shape again costs a
first run the compiles of candidates that lose (the GETT kernels, sum kernels and relayout copies
of every term), for a choice the timing of the neighbouring shape already made.

Two shapes are of one class where their :func:`signature` is equal (the same index lists, the
same order of strides over each operand's dimensions longer than one, the same dimensions of
extent one, the same dtype and kind of decision) and every index's extent is within a factor
:data:`RATIO` of the other's (:func:`near`). The autotuner times only the first shape of a class
whose candidates the cost models cannot tell apart; a later shape whose close candidates include
the method decided for its nearest classmate takes that method untimed, at the configuration the
models rank best for its own extents (:meth:`chainexec.runtime.backends.tuning.Autotuner._alike`).
"""

from __future__ import annotations

import math

RATIO = 2.0
"""Largest ratio of an index's extents in two shapes of one class."""
KEPT = 32
"""Decided shapes kept per class (the latest), in the process and in the tuning cache."""


def _order(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """The dimensions longer than one, slowest stride first (ties in dimension order): the
    layout the memory-access pattern of every method follows."""
    return tuple(sorted((d for d, n in enumerate(shape) if n > 1), key=lambda d: (-abs(strides[d]), d)))


def signature(views, dtype: str, kind: str) -> list:
    """What a class shares: per view (``(indices, shape, strides)`` in elements) its indices,
    stride order (:func:`_order`) and dimensions of extent one; the dtype; ``kind`` (what is
    decided: one contraction, or a run's strategy with its timed kernels). Plain lists and
    strings, so that it keys the tuning cache's JSON."""
    return [kind, dtype, [[list(indices), list(_order(tuple(shape), tuple(strides))),
                           [d for d, n in enumerate(shape) if n == 1]] for indices, shape, strides in views]]


def extents(views) -> dict[str, int]:
    """Each index's extent over ``views`` (``(indices, shape, strides)``), the largest where a
    view broadcasts it (extent one)."""
    found: dict[str, int] = {}
    for indices, shape, _ in views:
        for i, n in zip(indices, shape):
            found[i] = max(found.get(i, 1), int(n))
    return found


def near(a: dict[str, int], b: dict[str, int], ratio: float = RATIO) -> bool:
    """Whether the extents ``a`` and ``b`` (index -> elements, the same indices) are within
    ``ratio`` of each other index by index."""
    return a.keys() == b.keys() and all(max(a[i], b[i]) <= ratio * min(a[i], b[i]) for i in a)


def nearest(decided: list[tuple[dict[str, int], str]], here: dict[str, int]) -> str | None:
    """The decision of the shape of ``decided`` ((extents, decision) pairs) nearest to ``here``
    (the least Σ |log ratio| over the indices) among those :func:`near` it; None where none is."""
    close = [(sum(abs(math.log(e[i] / here[i])) for i in here), n, d)
             for n, (e, d) in enumerate(decided) if near(e, here)]
    return min(close)[2] if close else None
