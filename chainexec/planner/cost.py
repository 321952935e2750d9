"""Predicted data movement, memory and flops of a plan, read off its loop nests.

Bytes moved by one statement, summed over every iteration of the loops around it, factor per index
because the tiles of different indices are independent: for a buffer over index set X,

    Σ_iterations Π_{i∈X} extent_i(iteration)  =  Π_{i∈X} S_i · Π_{i∉X} N_i

where, over the loops enclosing the statement that run over index i, N_i is the number of their
iterations and S_i the sum of the range of i that the buffer sees in each (the whole extent E_i when
every iteration sees its own tile, a multiple of it when deeper loops repeat a range). The runtime
counts the bytes it actually moves; the two must agree exactly.

A fused statement (:mod:`chainexec.planner.inline`) counts the flops and statements of the
contractions it stands for, and streams its output twice and every distinct reference it reads once.

A symmetric loop (``Loop.symmetric``) visits ordered tile tuples of its indices only; for those
indices the factors are summed jointly over the tuples it visits (:func:`points`), and flops are
counted the same way, statement by statement. A reduction marked :attr:`Op.ordered` counts its
flops at the ordered elements of tiles with equal positions (:mod:`chainexec.planner.ordered`).

Seconds on several ranks are the busiest rank's: a parallel loop's run hands its tiles to the
ranks and ends at a barrier, so the statements inside it are priced at :func:`busiest_share`
(⌈T/R⌉·R/T for T tiles a run on R ranks) times their share of the mean; bytes, flops and
statements stay exact.

Memory peaks: at the first iteration of every loop all tiles are full-size, so the peak per level
is the largest sum of live full-size buffers at any point of the nest (global: the whole global
array, all ranks together; device: one rank's device). A double-buffered loop's own buffers
(:func:`chainexec.planner.plan.staged`: a global loop's global buffers, a device loop's
fetched input tiles) are held as ``depth`` full-size slots from loop entry to exit.
"""

from __future__ import annotations

import math
from functools import lru_cache

from chainexec import expr
from chainexec.kernels import orbits
from chainexec.planner import symmetry
from chainexec.planner.machine import Machine
from chainexec.planner.plan import (CATEGORIES, CATEGORY, LEVELS, MOVE_LEVEL, Loop, Op, Plan, key, pattern_of_key, runs,
                                     staged, statement_name)

# The level whose ranges define the region an op moves: a transfer moves the smaller side's tile.
REGION_LEVEL = {"load": "global", "store": "global", "get": "device", "accumulate": "device",
                "alloc": None, "free": None, "compute": "device", "eval": "device", "fused": "device"}


_VISIBLE = {(a, b): LEVELS.index(a) <= LEVELS.index(b) for a in LEVELS for b in LEVELS}


def _visible(level: str, region_level: str) -> bool:
    """Whether a loop at ``level`` sets the range seen by a buffer at ``region_level``."""
    return _VISIBLE[level, region_level]


def _walk(loops: tuple[tuple[str, int], ...], k: int, length: int, seen: int, region_level: str) -> tuple[int, int]:
    """(S, N) of one index over ``loops[k:]`` within a range of ``length`` elements, ``seen`` being
    the range the buffer sees when no deeper loop sets it. A loop's tiles are all ``tile`` long
    but the last, and the sums within a tile depend on its length alone: one full tile's times
    their number plus the last's, so at most 2ᵏ calls for k loops, whatever the extent."""
    if k == len(loops):
        return seen, 1
    level, tile = loops[k]
    full, last = divmod(length, tile)
    s = n = 0
    for size, count in ((tile, full), (last, 1 if last else 0)):
        if count:
            ds, dn = _walk(loops, k + 1, size, size if _visible(level, region_level) else seen, region_level)
            s, n = s + count * ds, n + count * dn
    return s, n


@lru_cache(maxsize=1 << 16)
def _index_sums(loops: tuple[tuple[str, int], ...], extent: int, region_level: str) -> tuple[int, int]:
    """(S_i, N_i) for one index: its enclosing loops as (level, tile), outermost first. Cached:
    candidate schedules priced by the planner share most of their loops."""
    return _walk(loops, 0, extent, extent, region_level)


@lru_cache(maxsize=1 << 16)
def _index_pieces(loops: tuple[tuple[str, int], ...], extent: int, region_level: str) -> tuple[tuple[int, int], ...]:
    """(S, N) of one index within each tile of its outermost loop (``loops[0]``), in order."""
    level, tile = loops[0]
    return tuple(_walk(loops, 1, min(start + tile, extent) - start,
                       min(start + tile, extent) - start if _visible(level, region_level) else extent, region_level)
                 for start in range(0, extent, tile))


def _ordered_sum(factors: list[list[int]]) -> int:
    """Σ over tile positions p_0 ≤ p_1 ≤ … ≤ p_m of Π_j factors[j][p_j]: what a symmetric loop
    visits (its ordered tuples, :func:`chainexec.runtime.frame.tuples`), by suffix sums from
    the last index to the first."""
    acc = list(factors[-1])
    for factor in reversed(factors[:-1]):
        running, nxt = 0, [0] * len(acc)
        for p in reversed(range(len(acc))):
            running += acc[p]
            nxt[p] = factor[p] * running
        acc = nxt
    return sum(acc)


class Loops:
    """The loops around a statement (outermost first), read once for :func:`points`: for every
    looped index its (level, tile) per loop, the symmetric loop's indices, and the counts already
    asked for. Pricing a candidate asks for the same loops' counts for every statement and operand
    inside them, tens of thousands of times for a (T) plan, so they are read once. The counts
    are kept by (indices, level) alone: one object serves one plan's extents."""

    def __init__(self, loops: list[Loop]):
        self.sym = next((loop.symmetric for loop in loops if loop.symmetric), [])
        self.tiles: dict[str, tuple[tuple[str, int], ...]] = {}
        for loop in loops:
            for i, tile in loop.tiles.items():
                self.tiles[i] = self.tiles.get(i, ()) + ((loop.level, tile),)
        self.counts: dict[tuple, int] = {}

    def points(self, indices, extents: dict[str, int], region_level: str, grouped: bool = False) -> int:
        """:func:`points` of ``indices`` inside these loops; ``grouped``: once per group of the
        symmetric loop's tuples (those that differ only in its first index's position,
        :mod:`chainexec.planner.keep`) instead of once per tuple, for indices without that first
        index."""
        key = (tuple(indices), region_level, grouped)
        total = self.counts.get(key)
        if total is None:
            rest, factors = self._factors(indices, extents, region_level)
            if grouped:
                factors = factors[1:]
            total = self.counts[key] = rest * (_ordered_sum(factors) if factors else 1)
        return total

    def by_pattern(self, indices, extents: dict[str, int], region_level: str,
                   ordered: bool = False) -> dict[tuple[int, ...], int]:
        """:meth:`points` split by the pattern of equal positions of the symmetric loop's tile
        tuples (:func:`chainexec.planner.symmetry.pattern_sums`); ``ordered``: of the elements an
        ordered reduction sums (:mod:`chainexec.planner.ordered`)."""
        key = (tuple(indices), region_level, "patterns", ordered)
        found = self.counts.get(key)
        if found is not None:
            return found
        rest, factors = self._factors(indices, extents, region_level)
        found = {pattern: rest * total for pattern, total in symmetry.pattern_sums(factors, ordered).items()}
        self.counts[key] = found
        return found

    def _factors(self, indices, extents: dict[str, int], region_level: str) -> tuple[int, list[list[int]]]:
        """Π S_i or N_i over the indices outside the symmetric loop, and per symmetric index its
        S or N per tile position (:func:`points`)."""
        rest = 1
        for i in (self.tiles.keys() | set(indices)) - set(self.sym):
            s, n = _index_sums(self.tiles.get(i, ()), extents[i], region_level)
            rest *= s if i in indices else n
        factors = []
        for i in self.sym:
            pieces = _index_pieces(self.tiles.get(i, ()), extents[i], region_level)
            factors.append([s if i in indices else n for s, n in pieces])
        return rest, factors


def points(indices, loops: list[Loop], extents: dict[str, int], region_level: str) -> int:
    """Elements a statement over ``indices`` touches, summed over all iterations of ``loops``
    (outermost first): Π S_i over its indices times Π N_i over the other looped ones, except
    that the indices of a symmetric loop (the outermost loop over them) are summed jointly over
    its ordered tile tuples."""
    return Loops(loops).points(indices, extents, region_level)


def moved_bytes(node, loops: list[Loop], around: Loops, extents: dict[str, int], item: int, ranks: int) -> int:
    """Bytes the moving statement ``node`` (load, store, get, accumulate) inside ``loops`` (their
    :class:`Loops` ``around``) moves over all its iterations, ``item`` bytes an element: a
    transfer to the device outside every parallel loop made by each of the ``ranks``; a tile the
    innermost loop keeps across groups (``Loop.kept``) once per group."""
    every = ranks if node.level == "device" and not any(loop.parallel for loop in loops) else 1
    return every * item * around.points(node.indices, extents, REGION_LEVEL[node.op], _kept(node, loops))


def moved_calls(node, loops: list[Loop], around: Loops, extents: dict[str, int], ranks: int) -> int:
    """Calls the ranks make of the moving statement ``node`` over all its iterations, one per
    tile as :func:`moved_bytes` counts its bytes: outside every parallel loop each of the
    ``ranks`` makes it (a get for the whole tile, a load or a store for its own rows)."""
    every = 1 if any(loop.parallel for loop in loops) else ranks
    return every * around.points([], extents, REGION_LEVEL[node.op], _kept(node, loops))


def _kept(node, loops: list[Loop]) -> bool:
    """Whether the innermost of ``loops`` keeps ``node``'s tile across groups (``Loop.kept``)."""
    return bool(loops) and [node.tensor, list(node.indices)] in loops[-1].kept


def busiest_share(loop: Loop, loops: list[Loop], extents: dict[str, int], ranks: int) -> float:
    """The busiest rank's work in the parallel ``loop`` (inside ``loops``) over the ranks' mean:
    each run of the loop hands its tiles to the ``ranks`` and ends at a barrier,
    so a rank takes ⌈T/R⌉ of a run's T units where the mean is T/R; T is the tiles a run hands
    out on average (its edge runs' fewer are not told apart, nor a loop's groups of kept tiles
    from its tiles). 1 for one rank; R where a run has a single tile (the others wait)."""
    if ranks <= 1:
        return 1.0
    runs = Loops(loops).points([], extents, "device")
    handed = Loops(loops + [loop]).points([], extents, "device") / runs
    return math.ceil(handed / ranks) * ranks / handed if handed > 0 else 1.0


def units(loop: Loop, extents: dict[str, int]) -> int:
    """What ``loop`` hands out to ranks: its tiles (ordered tuples of a symmetric loop), or the
    groups of them where it keeps tiles across a group (``Loop.kept``,
    :func:`chainexec.runtime.frame.groups`)."""
    return Loops([loop]).points([], extents, "device", grouped=bool(loop.kept))


def buffer_elements(indices: list[str], loops: list[Loop], level: str, extents: dict[str, int]) -> int:
    """Elements of a full-size buffer at ``level`` inside ``loops``."""
    size = 1
    for i in indices:
        tile = extents[i]
        for loop in loops:
            if i in loop.tiles and _visible(loop.level, level):
                tile = min(tile, loop.tiles[i])
        size *= tile
    return size


def _narrowed(ranges: dict[str, dict[str, int]], loop: Loop, extents: dict[str, int]) -> dict[str, dict[str, int]]:
    """``ranges`` inside ``loop``: per buffer level, the tile of each index that a full-size buffer
    at that level sees (an index not listed spans its extent). :func:`buffer_elements`' rule one
    loop at a time, so that a walk reads each loop once, not every loop around every buffer."""
    if not loop.tiles:
        return ranges
    inner = {}
    for level, seen in ranges.items():
        if _visible(loop.level, level):
            seen = dict(seen)
            for i, tile in loop.tiles.items():
                seen[i] = min(seen.get(i, extents[i]), tile)
        inner[level] = seen
    return inner


def _elements(indices, seen: dict[str, int], extents: dict[str, int]) -> int:
    """Elements of a full-size buffer over ``indices`` that sees the tiles ``seen`` (:func:`_narrowed`)."""
    size = 1
    for i in indices:
        size *= seen.get(i, extents[i])
    return size


def predict(plan: Plan, machine: Machine, ranks: int = 1, cached: dict[str, float] | None = None) -> dict:
    """The ``predicted`` record of a plan: bytes per category (all ranks together), flops, memory
    peak per level, seconds per level for ``ranks`` ranks sharing the work, each at the machine
    file's per-rank rates (a perfectly balanced run), and the run's seconds (:func:`wall`).
    ``cached``: per input tensor, the share of its bytes that the page cache holds where its
    loads map them (:mod:`chainexec.runtime.mapped`), loads that move nothing. Transfers of a
    pinned plan's global arrays (:attr:`Plan.pinned`) move by DMA from page-locked memory."""
    record = predict_nests(plan.nests, plan.tensors, plan.extents, plan.contractions, machine, ranks, cached,
                           plan.pinned, frozenset(plan.locked))
    record["seconds"] = {level: t / ranks for level, t in record["seconds"].items()}
    del record["calls"]  # the record holds what the runtime measures: bytes, not calls
    return record


def whole_rows(indices, ranges: dict[str, dict[str, int]], extents: dict[str, int]) -> bool:
    """Whether a device tile over ``indices`` is whole rows of its global tile: every axis but
    the first as long as there (``ranges``: the tiles each level's buffers see,
    :func:`_narrowed`). Such a tile lies in one piece of host memory, from which the backend
    copies it in one DMA where that memory is locked; another is gathered through the staging
    buffers."""
    return all(ranges["device"].get(i, extents[i]) >= ranges["global"].get(i, extents[i]) for i in list(indices)[1:])


def dma_transfer(node: Op, loops: list[Loop], ranges: dict[str, dict[str, int]], extents: dict[str, int],
                 from_file: bool, locked: bool) -> bool:
    """Whether a run of page-locked global arrays (:func:`pinned`) moves the tile of ``node`` (a
    get or an accumulate inside ``loops``) by one DMA between the device and the locked host
    memory where it lies, as the GPU backend does only where that memory is one piece: the tile
    whole rows of its global buffer (:func:`whole_rows`; ``ranges["global"]`` the tiles the
    buffer was allocated with, :func:`as_allocated`), of a global array (an input read from its
    file only where its mapping is ``locked``, :attr:`Plan.locked`), and for an accumulate, the
    only value its patch gets (``Op.fresh``: written, not added), outside a symmetric loop
    (whose tuples' weights scale it on the host) and not copied back aside (``Loop.back``: into
    a buffer of its own). Any other goes through a staging copy on the host, at
    :attr:`Machine.global_to_device` / :attr:`Machine.device_to_global`
    (:mod:`chainexec.runtime.landing`, :meth:`chainexec.runtime.backends.cupy.CupyBackend.fetch`)."""
    if not whole_rows(node.indices, ranges, extents) or (from_file and not locked):
        return False
    if node.op == "get":
        return True
    aside = any((node.tensor, tuple(node.indices)) in {(t, tuple(ix)) for t, ix in loop.back} for loop in loops)
    return bool(node.fresh) and not aside and not any(loop.symmetric for loop in loops)


def as_allocated(node: Op, ranges: dict[str, dict[str, int]], allocated: dict[tuple, dict[str, int]]) -> dict:
    """``ranges`` at a get or accumulate of ``node``'s tile with the global level's replaced by the
    tiles its global buffer was allocated with (``allocated``, by buffer key): a buffer
    allocated outside a global loop is whole, however that loop tiles the statements in it."""
    return {"device": ranges["device"], "global": allocated.get((node.tensor, tuple(node.indices), "global"),
                                                                ranges["global"])}


def locked_inputs(plan: Plan, machine: Machine, ranks: int, cached: dict[str, float]) -> list[str]:
    """The inputs of a pinned plan whose loads map them (those in ``cached``,
    :mod:`chainexec.runtime.mapped`) that a run should lock where they lie, read-only, on every
    rank (:attr:`Plan.locked`): those whose gets of whole rows (:func:`whole_rows`), moved by DMA
    from the locked pages instead of through the staging copy
    (:attr:`Machine.mapped_locked_to_device`, else :attr:`Machine.host_to_device`, against
    :attr:`Machine.mapped_to_device`), save more seconds than locking the whole mapping takes
    (:attr:`Machine.host_lock`). A (T) job whose ``ovvv`` does not fit the device fetches its
    slabs of occupied rows tile by tile, several times its size: locked, they arrive at the
    DMA's rate. None where the machine lacks one of those rates (a machine file without them,
    the NumPy backend)."""
    rates = (machine.mapped_locked_to_device or machine.host_to_device, machine.mapped_to_device, machine.host_lock)
    if not (plan.pinned and all(rates)):
        return []
    fetched: dict[str, int] = {}
    held: dict[str, int] = {}
    allocated: dict[tuple, dict[str, int]] = {}

    def walk(body, loops, ranges):
        for node in body:
            if isinstance(node, Loop):
                walk(node.body, loops + [node], _narrowed(ranges, node, plan.extents))
            elif node.tensor in cached and node.op in ("get", "alloc"):
                around = Loops(loops)
                item = plan.tensors[node.tensor].itemsize
                if node.op == "alloc":
                    allocated[key(node)] = ranges[node.level]
                if node.op == "get" and dma_transfer(node, loops, as_allocated(node, ranges, allocated), plan.extents,
                                                     True, True):
                    fetched[node.tensor] = fetched.get(node.tensor, 0) + moved_bytes(
                        node, loops, around, plan.extents, item, ranks)
                elif node.level == "global":
                    held[node.tensor] = held.get(node.tensor, 0) + item * around.points(
                        node.indices, plan.extents, "global")

    for nest in plan.nests:
        walk(nest.body, [], {"global": {}, "device": {}})
    to_device, staged, lock = rates
    return sorted(t for t, nbytes in fetched.items()
                  if nbytes / ranks * (1 / staged - 1 / to_device) > held.get(t, 0) / lock)


def pinned(moved: dict[str, int], machine: Machine, ranks: int) -> bool:
    """Whether a run that moves ``moved`` bytes per category (all ranks together) uses page-locked
    host buffers: at least :attr:`Machine.pinned_from_bytes` between global and device memory
    per rank. Its global arrays are then locked where they lie, and their tiles move to and from
    the device by DMA (a GPU backend; the NumPy backend's device is host memory)."""
    return (moved["global->device"] + moved["device->global"]) // ranks >= machine.pinned_from_bytes


def wall(levels: dict[str, float], overlapped: int, prepare: float = 0.0) -> float:
    """Seconds of one nest whose levels take ``levels`` seconds each, over ``overlapped``
    iterations of its outermost double-buffered loop (1 where it has none), after ``prepare``
    seconds of global memory's preparation: a pipeline of that many stages,

        (Σ_levels t + (N − 1) · max_levels t) / N,

    since each level works on one iteration while the others work on the next (multi-level
    paper, section 4: each level's movement is costed separately; a double-buffered loop hides
    all but the slowest level's time from the second iteration on). A nest without such a loop
    runs its levels one after the other (N = 1: their sum); a long pipeline tends to the
    slowest level alone."""
    if not levels:
        return prepare
    return prepare + (sum(levels.values()) + (overlapped - 1) * max(levels.values())) / overlapped


def predict_nests(nests, tensors, extents, contractions, machine: Machine | None, ranks: int = 1,
                  cached: dict[str, float] | None = None, locks: bool = False, locked: frozenset = frozenset()) -> dict:
    """:func:`predict` for loose parts of a plan (used to price candidate schedules, for one rank).
    A transfer to the device outside every parallel loop (a fused group's inputs fetched once per
    global tile) is made by each of the ``ranks``. With no ``machine``, only the memory peaks
    (``{"memory_peak": …}``, :func:`memory_peaks`): what fitting tiles to the limits asks of
    each step (the statements' movement and flops are not counted). A computed source's loads
    are priced at the ``bytes_per_second`` its config states. ``total_seconds`` is the sum
    over the nests of :func:`wall` for one of ``ranks`` ranks, its compute level with the
    statements' host time (:meth:`Machine.busy_seconds`); ``calls``, per level, the transfer
    calls the ranks make (:func:`moved_calls`), each priced at the machine's per-call seconds
    (:attr:`Machine.transfer_call_seconds`, :attr:`Machine.disk_call_seconds`) in its level's
    seconds and its statement's. A global buffer's pages are
    touched once before its first use, by a zero fill (a buffer accumulated into, or one the
    backend page-locks) or by its first write: each allocation of one is priced at
    :attr:`Machine.global_fill`, but an input's tile read from its file (mapped where the file
    allows: :mod:`chainexec.runtime.mapped`). ``locks``: the run locks its global arrays
    (:func:`pinned`): each allocation of one is then page-locked, at :attr:`Machine.host_lock`,
    and its transfers are priced at the page-locked rates (:meth:`Machine.transfer_seconds`)
    where the backend moves them by one DMA (:func:`dma_transfer`: a tile in one piece of the
    locked memory), others at the rates through a staging copy;
    an input's tiles read from its file are not locked and go through a staging copy, those of
    an input whose loads map it (one in ``cached``) at :attr:`Machine.mapped_to_device`, but
    those of an input in ``locked`` (:attr:`Plan.locked`), whose mapping every rank locks where
    it lies (at :attr:`Machine.host_lock`, before its first get), by DMA from the locked pages
    (:attr:`Machine.mapped_locked_to_device`) where the tile is whole rows of the mapping
    (:func:`whole_rows`; others still through the staging copy)."""
    if machine is None:
        return {"memory_peak": memory_peaks(nests, tensors, extents)}
    cached = cached or {}
    moved = dict.fromkeys(CATEGORIES, 0)
    peak = {"global": 0, "device": 0}
    flops, statements, streamed, compute = [0], [0], [0], [0.0]
    busy = [0.0]  # the statements weighted by their parallel loops' busiest share (busiest_share)
    priced, filled, mapped, total = [0, 0.0], [0], [0], 0.0
    transfers = [0.0]  # seconds of the global<->device level, statement by statement
    calls = {"disk": 0, "global<->device": 0}  # the ranks' transfer calls per level (moved_calls)
    by_statement: dict[str, float] = {}
    stored: dict[str, int] = {}
    allocated: dict[tuple, dict[str, int]] = {}  # each buffer's tiles where it was last allocated (_narrowed)

    def spend(name: str, seconds: float) -> None:
        by_statement[name] = by_statement.get(name, 0.0) + seconds

    def count(work: int, bytes_: int, name: str, floor: float = 0.0, share: float = 1.0) -> None:
        """One compute statement's flops and streamed bytes over all its iterations; ``floor``:
        seconds it takes at least (an orbit kernel's,
        :func:`chainexec.kernels.orbits.fused_point_bytes`); ``share``: its parallel loops'
        :func:`busiest_share`, by which its seconds are the busiest rank's."""
        flops[0] += work
        streamed[0] += bytes_
        seconds = share * max(machine.compute_seconds(work, bytes_), floor)
        compute[0] += seconds
        spend(name, seconds)

    for nest in nests:
        live = {"global": 0, "device": 0}
        sizes: dict[tuple, int] = {}
        before = (dict(moved), compute[0], tuple(priced), filled[0], transfers[0], mapped[0], busy[0],
                  dict(calls))
        overlapped = [0]

        def tile_bytes(tensor: str, indices, where) -> int:
            """Bytes of ``tensor[indices]``'s device tiles over the iterations that ``where``
            (indices -> elements summed over them) counts."""
            return tensors[tensor].itemsize * where(indices)

        def by_dma(node, loops, ranges):
            return dma_transfer(node, loops, as_allocated(node, ranges, allocated), extents,
                                tensors[node.tensor].from_file(), node.tensor in locked)

        def walk(body, loops, ranges, slotted=frozenset(), share=1.0):
            tails, around = _run_tails(body, loops[-1] if loops else None, contractions), Loops(loops)
            symmetrized = _symmetrized_runs(body, loops[-1] if loops else None)
            names = _statement_names(body, loops[-1] if loops else None)

            def all_tiles(ix):
                return around.points(ix, extents, "device")
            for k, node in enumerate(body):
                if isinstance(node, Loop):
                    inner = _narrowed(ranges, node, extents)
                    within = share * busiest_share(node, loops, extents, ranks) if node.parallel else share
                    own = staged(node)
                    if own and not overlapped[0]:
                        runs_on = ranks if node.parallel or any(loop.parallel for loop in loops) else 1
                        overlapped[0] = max(1, points([], loops + [node], extents, "global") // runs_on)
                    if not own:
                        walk(node.body, loops + [node], inner, slotted, within)
                        continue
                    slots = _slot_bytes(node, own, inner, tensors, extents)
                    for level, nbytes in slots.items():
                        live[level] += nbytes
                        peak[level] = max(peak[level], live[level])
                    walk(node.body, loops + [node], inner, slotted | {key(op) for op in own}, within)
                    for level, nbytes in slots.items():
                        live[level] -= nbytes
                    continue
                if node.op in ("compute", "fused"):
                    where, passes = all_tiles, 0
                    if k in symmetrized:  # a symmetrized run: this term on the patterns it runs on
                        start, place, taken = symmetrized[k]
                        ran = [pattern_of_key(p) for p, t in taken.items()
                               if t is None or place in (n for n, _ in t[0])]

                        def where(ix, ran=ran):
                            return sum(around.by_pattern(ix, extents, "device")[p] for p in ran)

                        if k == start:  # then out = Σ of its permuted views, in place: read, and
                            # written (at the ordered elements alone where node.ordered)
                            c = contractions[node.contraction]
                            passes = sum(tile_bytes(c.out, c.out_indices, lambda ix, p=p, o=o: around.by_pattern(
                                ix, extents, "device", ordered=o)[pattern_of_key(p)]) for p, t in taken.items()
                                if t is not None for o in (False, bool(node.ordered)))
                    group = node.group or [node.contraction]
                    summed = where
                    if node.op == "fused" and node.ordered:  # flops at the ordered elements; reads priced whole

                        def summed(ix):
                            return sum(around.by_pattern(ix, extents, "device", ordered=True).values())
                    work = sum((2 if c.b is not None else 1) * summed(c.space())
                               for c in (contractions[j] for j in group))
                    statements[0] += len(group) * where([])
                    busy[0] += share * len(group) * where([])
                    if node.op == "fused":
                        reads = node.expression.leaves
                        bytes_ = 2 * tile_bytes(node.tensor, node.indices, where) + sum(
                            tile_bytes(r.tensor, r.indices, where) for r in reads)
                    else:
                        c = contractions[node.contraction]
                        # a point-wise run's output is read and written once
                        bytes_ = (0 if k in tails else 2 * tile_bytes(c.out, c.out_indices, where)) + sum(
                            tile_bytes(n, ix, where) for n, ix in c.operands())
                    floor = 0.0
                    if node.op == "fused" and node.expression.lets and machine.orbit_bandwidth:
                        f = node.expression
                        floor = summed(list(f.domain)) * orbits.fused_point_bytes(
                            f, {i: ranges["device"].get(i, extents[i]) for i in f.domain},
                            {t: info.dtype for t, info in tensors.items()}) / machine.orbit_bandwidth
                    count(work, bytes_ + passes, names[k], floor, share)
                    continue
                if node.op == "eval":
                    t = tensors[node.tensor]
                    rename = dict(zip(t.indices, node.indices))
                    count(0, tile_bytes(node.tensor, node.indices, all_tiles) + sum(
                        tile_bytes(r.tensor, [rename[i] for i in r.indices], all_tiles)
                        for r in expr.text_refs(t.source["expr"])), names[k], share=share)
                    continue
                item = tensors[node.tensor].itemsize
                if node.op == "alloc" and node.level == "global" and not tensors[node.tensor].from_file():
                    filled[0] += item * _elements(node.indices, ranges["global"], extents) * around.points(
                        [], extents, "global")
                if node.op == "alloc" and node.level == "global" and node.tensor in locked:
                    # every rank locks the whole mapped tile (its gets read any of its rows)
                    mapped[0] += ranks * item * _elements(node.indices, ranges["global"], extents) * around.points(
                        [], extents, "global")
                if node.op in ("alloc", "free"):
                    buffer = key(node)
                    if node.op == "alloc":
                        allocated[buffer] = ranges[node.level]
                    if buffer in slotted:
                        continue
                    if node.op == "alloc":
                        sizes[buffer] = item * _elements(node.indices, ranges[node.level], extents)
                        live[node.level] += sizes[buffer]
                        peak[node.level] = max(peak[node.level], live[node.level])
                    else:
                        live[node.level] -= sizes.pop(buffer)
                else:
                    nbytes = moved_bytes(node, loops, around, extents, item, ranks)
                    moved[CATEGORY[node.op]] += nbytes
                    level, made = MOVE_LEVEL[node.op], moved_calls(node, loops, around, extents, ranks)
                    calls[level] += made
                    spend(names[k], machine.call_seconds({level: made})[level])
                    if node.op == "load":
                        other, seconds = _priced_load(nbytes, tensors[node.tensor], cached.get(node.tensor, 0.0))
                        priced[0] += other
                        priced[1] += seconds
                        spend(names[k], seconds + (nbytes - other) / machine.disk_read)
                    elif node.op == "store":
                        stored[names[k]] = stored.get(names[k], 0) + nbytes
                    else:
                        seconds = share * machine.transfer_seconds(
                            node.op, nbytes, locks and by_dma(node, loops, ranges), locks and node.tensor in cached)
                        transfers[0] += seconds
                        spend(names[k], seconds)

        walk(nest.body, [], {level: {} for level in live})
        own = {k: moved[k] - before[0][k] for k in moved}
        levels = machine.seconds(own, compute[0] - before[1], transfers[0] - before[4], ranks,
                                 (priced[0] - before[2][0], priced[1] - before[2][1]))
        prepared = filled[0] - before[3]
        prepare = (prepared / machine.global_fill if machine.global_fill else 0.0) + (
            (prepared + mapped[0] - before[5]) / machine.host_lock if locks and machine.host_lock else 0.0)
        # the transfers' per-call seconds are the host thread's, with its statements' (not
        # hidden behind other levels by the pipeline)
        called = machine.call_seconds({level: n - before[7][level] for level, n in calls.items()})
        levels["compute"] = machine.busy_seconds(levels["compute"], busy[0] - before[6],
                                                 sum(called.values()))
        total += wall({level: t / ranks for level, t in levels.items()}, overlapped[0] or 1, prepare / ranks)

    seconds = machine.seconds(moved, compute[0], transfers[0], ranks, (priced[0], priced[1]))
    for level, called in machine.call_seconds(calls).items():
        seconds[level] += called
    writes = sum(stored.values())
    for name, nbytes in stored.items():  # the cached share of the writes spread over them by bytes
        spend(name, machine.write_seconds(writes, ranks) * nbytes / writes)
    return {"bytes": moved, "flops": flops[0], "statements": statements[0], "streamed": streamed[0],
            "calls": calls, "memory_peak": peak, "seconds": seconds, "total_seconds": total,
            "by_statement": dict(sorted(by_statement.items(), key=lambda kv: -kv[1]))}


def _slot_bytes(loop: Loop, own: list, inner: dict, tensors, extents: dict[str, int]) -> dict[str, int]:
    """Bytes per level a double-buffered ``loop`` holds for its own buffers ``own``
    (:func:`~chainexec.planner.plan.staged`) from its entry to its exit: ``depth`` full-size
    slots of each, as the buffers' level sees the tiles inside it (``inner``, :func:`_narrowed`)."""
    slots = {"global": 0, "device": 0}
    for op in own:
        slots[op.level] += loop.depth * tensors[op.tensor].itemsize * _elements(op.indices, inner[op.level], extents)
    return slots


def memory_peaks(nests, tensors, extents: dict[str, int]) -> dict[str, int]:
    """Memory peak per level of loose nests (bytes; module docstring): the largest sum of live
    full-size buffers, a double-buffered loop's own buffers held in ``depth`` slots from its entry
    to its exit. What :func:`predict_nests` records as ``memory_peak``, walked alone: fitting tiles
    asks for it after every halving (thousands of nests for a (T) plan), and it reads only the
    loops and the ``alloc`` and ``free`` statements."""
    peak = {"global": 0, "device": 0}
    for nest in nests:
        live = {"global": 0, "device": 0}
        sizes: dict[tuple, int] = {}

        def walk(body, ranges, slotted):
            for node in body:
                if isinstance(node, Loop):
                    inner = _narrowed(ranges, node, extents)
                    own = staged(node)
                    if not own:
                        walk(node.body, inner, slotted)
                        continue
                    slots = _slot_bytes(node, own, inner, tensors, extents)
                    for level, nbytes in slots.items():
                        live[level] += nbytes
                        peak[level] = max(peak[level], live[level])
                    walk(node.body, inner, slotted | {key(op) for op in own})
                    for level, nbytes in slots.items():
                        live[level] -= nbytes
                elif node.op == "alloc":
                    buffer = key(node)
                    if buffer not in slotted:
                        sizes[buffer] = tensors[node.tensor].itemsize * _elements(node.indices, ranges[node.level],
                                                                                   extents)
                        live[node.level] += sizes[buffer]
                        peak[node.level] = max(peak[node.level], live[node.level])
                elif node.op == "free":
                    buffer = key(node)
                    if buffer not in slotted:
                        live[node.level] -= sizes.pop(buffer)

        walk(nest.body, {"global": {}, "device": {}}, frozenset())
    return peak


def _priced_load(nbytes: int, tensor, cached: float) -> tuple[int, float]:
    """(bytes, seconds) of a load of ``nbytes`` of ``tensor`` that are not a disk read: a
    computed source's whole at the rate its config states, or the ``cached`` share of an input's
    bytes that the page cache holds, which its mapping moves in no time."""
    rate = (tensor.source or {}).get("bytes_per_second")  # only a computed source states one
    if rate:
        return nbytes, nbytes / rate
    return round(nbytes * cached), 0.0


def _statement_names(body: list, loop: Loop | None) -> dict[int, str]:
    """The name under which the runtime times each statement of ``body`` (positions -> names,
    :func:`chainexec.planner.plan.statement_name`): a contraction outside a run of terms under its
    own, every term of a run under the run's."""
    names = {k: statement_name(node.op, node.tensor, [node.contraction] if node.op == "compute" else node.group)
             for k, node in enumerate(body) if not isinstance(node, Loop)}
    for run in runs(body, loop):
        name = statement_name("compute", group=[body[k].contraction for k in run])
        names.update((k, name) for k in run)
    return names


def _symmetrized_runs(body: list, loop: Loop | None) -> dict[int, tuple]:
    """Positions in ``body`` of the statements of runs (:attr:`Op.run`) whose first statement has
    an :attr:`Op.schedule`: position -> (the run's first position, its place in the run, the
    schedule)."""
    found = {}
    for run in runs(body, loop):
        taken = body[run[0]].schedule
        if taken is not None:
            found.update((k, (run[0], run.index(k), taken)) for k in run)
    return found


def _run_tails(body: list, loop: Loop | None, contractions) -> set[int]:
    """Positions in ``body`` of compute statements that continue the point-wise run of an earlier
    one (:attr:`Op.run`). A run of contractions is priced term by term: on the GPU the runtime
    adds its terms in one sum kernel or one by one, whichever it measures faster, and priced as
    one pass a run would make the planner take larger tiles, whose skipped symmetric work a sum
    kernel does not win back."""
    tails = set()
    for run in runs(body, loop):
        if len(run) > 1 and contractions[body[run[0]].contraction].pointwise():
            tails.update(run[1:])
    return tails


def parallel_tiles(plan: Plan) -> int:
    """How many parallel-loop iterations (device tiles handed to ranks) the whole plan runs: the
    total a progress report counts toward."""
    total = 0

    def walk(body, loops):
        nonlocal total
        for node in body:
            if isinstance(node, Loop):
                inner = loops + [node]
                if node.parallel:
                    total += points([], inner, plan.extents, "device")
                walk(node.body, inner)

    for nest in plan.nests:
        walk(nest.body, [])
    return total
