"""The iterations of a loop and the state it fixes for its body.

A loop runs its body once per tile tuple (:func:`tuples`); each loop the executor enters gets a
:class:`Frame` of its own, a copy of the enclosing one that the loop changes per tile and drops
at its end, so that nothing a loop sets outlives it. Statements read the tiles they work on from
the current frame (:meth:`Frame.region`)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from chainexec import ordering
from chainexec.runtime.region import box_shape


@dataclass
class Frame:
    """What the loops around the statement being run have fixed.

    ``ranges``: per level (``global``, ``device``), the tile of each index that a loop at that
    level tiles, as (start, stop) in elements of the whole tensor; ``extents``: each index's
    extent (the plan's). ``weight``: the multiplicity of the symmetric loop's tile tuple being
    run (``Loop.symmetric``), times those of the loops around it; ``symmetric``: the indices of
    the symmetric loop being run, None outside one. ``parallel``: the number of parallel loops
    around. ``lane``: the slot of a double-buffered device loop's buffers in use (the tile's turn
    modulo :data:`~chainexec.planner.plan.DEPTH`); ``turn``: that of a double-buffered global
    loop. ``behind``: inside a double-buffered global loop, whose slots' stores complete later.
    ``shapes``: in the body of a symmetric device loop, the device ranges of its first tile of
    each shape (:func:`shapes`), whose kernels its statements make ready at its first tile; None
    elsewhere (a loop nested in it too). ``kept``: in the body of a loop that keeps tiles across a
    group (``Loop.kept``), their buffers' keys; ``first``, ``last``: whether the tile being run is
    its group's first, its last."""

    extents: dict[str, int]
    ranges: dict[str, dict[str, tuple[int, int]]] = field(default_factory=lambda: {"global": {}, "device": {}})
    weight: int = 1
    symmetric: list[str] | None = None
    parallel: int = 0
    lane: int = 0
    turn: int = 0
    behind: bool = False
    shapes: tuple[tuple[tuple[str, tuple[int, int]], ...], ...] | None = None
    kept: frozenset = frozenset()
    first: bool = True
    last: bool = True

    def inner(self) -> Frame:
        """A copy for a loop entered here: the same state, ranges of its own."""
        return replace(self, ranges={level: dict(r) for level, r in self.ranges.items()})

    def range(self, level: str, index: str) -> tuple[int, int]:
        """The tile of ``index`` at ``level``: a device tile where a device loop tiles the index,
        else the global one, else the whole extent."""
        if level == "device" and index in self.ranges["device"]:
            return self.ranges["device"][index]
        return self.ranges["global"].get(index, (0, self.extents[index]))

    def region(self, level: str, indices) -> tuple[tuple[int, int], ...]:
        """The tile of ``indices`` at ``level`` (:meth:`range` of each)."""
        return tuple(self.range(level, i) for i in indices)

    def pattern(self) -> tuple[int, ...]:
        """The pattern of equal positions of the symmetric loop's tile tuple being run
        (:func:`chainexec.ordering.pattern_of`; ``()`` outside such a loop)."""
        return ordering.pattern_of([self.range("device", i)[0] for i in self.symmetric or []])

    def equal_tiles(self, ones: bool = False) -> tuple[tuple[str, ...], ...]:
        """The symmetric indices that share a tile in the tuple being run, groups of two or more,
        and with ``ones`` each other symmetric index in a group of its own
        (:func:`chainexec.ordering.groups`)."""
        return ordering.groups(self.symmetric or [], self.pattern(), ones)


def tuples(names: list[str], spans: list[list[tuple[int, int]]], symmetric: list[str]) -> tuple[list, list[int]]:
    """A loop's tile tuples (one (start, stop) per index of ``names``) in order, and each one's
    weight. Over ``symmetric`` indices only ordered tuples are kept (tile position of the first ≤
    the second ≤ …), each weighted by the number of distinct permutations of its positions; they
    come with the symmetric indices slowest, last first, so the largest position changes least
    often: in (T) the slice ``ovvv[k]`` whose relayout copy the backend keeps
    (:meth:`Backend.steady`) changes once per position of ``k`` instead of once per tuple, and
    the tiles up to position p read only the input slices up to p."""
    if not symmetric:
        combos = list(itertools.product(*spans))
        return combos, [1] * len(combos)
    at = [names.index(i) for i in symmetric]
    slowest = at[::-1] + [n for n in range(len(names)) if n not in at]
    kept, weights = [], []
    for ordered in itertools.product(*(range(len(spans[n])) for n in slowest)):
        where = [0] * len(names)
        for n, p in zip(slowest, ordered):
            where[n] = p
        positions = [where[k] for k in at]
        if all(p <= q for p, q in zip(positions, positions[1:])):
            kept.append(tuple(s[p] for s, p in zip(spans, where)))
            weights.append(math.factorial(len(at)) // math.prod(math.factorial(positions.count(p))
                                                                 for p in set(positions)))
    return kept, weights


def groups(names: list[str], combos: list[tuple], symmetric: list[str]) -> list[list[int]]:
    """A loop's tile tuples ``combos`` (:func:`tuples`' order) as groups of consecutive ones that
    differ only in the first symmetric index's tile (the fastest of them): per group, the
    tuples' positions in ``combos``, the groups largest first (stable), so that ranks taking
    them from the shared counter finish together (groups of the (T) loop hold 1 to p + 1
    tuples at largest position p, the largest last in tuple order). A loop that keeps tiles
    across a group's tiles (``Loop.kept``) hands out these groups; their number is the cost
    model's (:func:`chainexec.planner.cost.units`)."""
    fastest = names.index(symmetric[0])
    found: list[list[int]] = []
    last = None
    for n, combo in enumerate(combos):
        rest = combo[:fastest] + combo[fastest + 1:]
        if rest != last:
            found.append([])
            last = rest
        found[-1].append(n)
    return sorted(found, key=len, reverse=True)


def shapes(names: list[str], combos: list[tuple]) -> tuple[tuple[tuple[str, tuple[int, int]], ...], ...]:
    """The first of a loop's tile tuples ``combos`` (one range per index of ``names``) of each
    shape (extent per index), in order, each as (index, range) pairs."""
    first: dict[tuple, tuple] = {}
    for combo in combos:
        first.setdefault(box_shape(combo), tuple(zip(names, combo)))
    return tuple(first.values())
