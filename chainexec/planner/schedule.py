"""Schedules made concrete: tile sizes that fit each level, and the exact cost of a schedule.

A candidate schedule (which sub-chains are fused at which level) is priced by emitting its loop
nests and reading the predicted movement and memory peaks off them (:mod:`chainexec.planner.cost`)
— the same numbers the runtime will measure, so candidates are compared on what will happen rather
than on an approximation.

Tiles of a single contraction come from the paper's schemes (:mod:`chainexec.planner.tiling`); a
fused group's tiles are fitted to the memory limits by halving its largest tile at a level that
overflows, checked against the emitted nest's exact peak after each step.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace

from chainexec.planner import record
from chainexec.planner.cost import predict_nests
from chainexec.planner.machine import Machine
from chainexec.planner.nest import DeviceGroup, DiskGroup, Emitter, Schedule
from chainexec.planner.plan import DEPTH
from chainexec.planner.plan import Contraction, TensorInfo
from chainexec.planner.tiling import choose_tiles, composites, equal_tiles_win, scheme_tiles, spread, tile_count

SCHEMES = ("fits", "streaming", "equal", "greedy")


@dataclass
class Context:
    """What every candidate is priced against: the contractions, tensors, extents, limits, machine,
    whether disk traffic overlaps work (double-buffered global loops,
    :mod:`chainexec.planner.pipeline`) and whether point-wise producers are inlined
    (:mod:`chainexec.planner.inline`)."""

    cs: list[Contraction]
    tensors: dict[str, TensorInfo]
    extents: dict[str, int]
    limits: dict[str, int]
    machine: Machine
    overlap: bool = True
    inline: bool = True
    # priced schedules by repr: the search prices the same one again and again (about half its
    # pricings repeat an earlier one)
    _prices: dict = field(default_factory=dict, repr=False, compare=False)
    _peaks: dict = field(default_factory=dict, repr=False, compare=False)
    # what its emitters share (Emitter._memo): fitting one group's tiles emits its nest after every
    # halving, thousands of times where the limits are small
    _emitted: dict = field(default_factory=dict, repr=False, compare=False)

    def itemsize(self, k: int) -> int:
        return self.tensors[self.cs[k].out].itemsize

    def emitter(self) -> Emitter:
        return Emitter(self.cs, self.extents, self.tensors, self.overlap, self.inline, self._emitted)

    def scheme_limit(self) -> int:
        """Global bytes the paper's tiling schemes may fill: with overlap the streamed buffers
        exist twice, so the schemes aim at a share of the limit (the emitted nest's exact peak
        then decides whether a candidate fits)."""
        return self.limits["global"] // (DEPTH if self.overlap else 1)

    def price(self, schedule: Schedule) -> dict:
        """Predicted record (bytes, memory peaks, seconds) of a schedule's nests (a copy: callers
        may change it). A schedule's repr names every field of every group, dictionaries in their
        order, so equal reprs emit equal nests."""
        at = repr(schedule)
        if at not in self._prices:
            nests = record.runs(self.emitter().schedule(schedule), self.cs)
            self._prices[at] = predict_nests(nests, self.tensors, self.extents, self.cs, self.machine)
        # a record holds numbers and dictionaries of numbers: copying one level deep copies it all
        return {k: dict(v) if isinstance(v, dict) else v for k, v in self._prices[at].items()}

    def peaks(self, schedule: Schedule) -> dict:
        """Memory peak per level of a schedule's nests (bytes): its priced record's where it has
        one, else counted alone (:func:`~chainexec.planner.cost.predict_nests` without a machine)
        and kept likewise."""
        at = repr(schedule)
        if at in self._prices:
            return dict(self._prices[at]["memory_peak"])
        if at not in self._peaks:
            nests = self.emitter().schedule(schedule)
            self._peaks[at] = predict_nests(nests, self.tensors, self.extents, self.cs, None)["memory_peak"]
        return dict(self._peaks[at])

    def fits(self, peak: dict) -> bool:
        """Whether memory peaks per level (bytes: :meth:`peaks`, or a price's ``memory_peak``) are
        within the limits."""
        return all(peak[lvl] <= self.limits[lvl] for lvl in ("global", "device"))


def movement_seconds(predicted: dict) -> float:
    """What the papers' rule minimises: time spent moving data (it takes compute as the same for
    every plan; :func:`work_seconds` adds it where tilings differ in flops)."""
    return predicted["seconds"]["disk"] + predicted["seconds"]["global<->device"]


def work_seconds(ctx: "Context", predicted: dict) -> float:
    """Movement, compute and per-statement time (:meth:`Machine.busy_seconds`): how :func:`fit`
    compares tilings of one group, whose flops differ where a symmetric loop visits fewer tiles
    the smaller they are."""
    return movement_seconds(predicted) + ctx.machine.busy_seconds(predicted["seconds"]["compute"],
                                                                  predicted["statements"])


def single_candidates(ctx: Context, k: int) -> list[tuple[str, DeviceGroup]]:
    """One contraction tiled by each applicable scheme at the global level, each with the device
    scheme that moves least between global and device; named ``global-scheme/device-scheme``."""
    c = ctx.cs[k]
    item = ctx.itemsize(k)
    found = []
    for gscheme in SCHEMES:
        glob = scheme_tiles(c, ctx.extents, item, ctx.scheme_limit(), gscheme)
        if glob is not None:
            best = _with_device(ctx, k, *glob)
            if best is not None:
                found.append((f"{gscheme}/{best[0]}", best[1]))
    return found


def iterations(ctx: Context, group: DeviceGroup) -> int:
    """Tiles a single contraction's nest visits at the device level: the tie-breaker between
    tilings that move the same bytes (fewer, larger tiles cost less per-tile overhead)."""
    count = 1
    for i in ctx.cs[group.contractions[0]].indices():
        glob = min(group.glob.get(i, ctx.extents[i]), ctx.extents[i])
        count *= tile_count(ctx.extents[i], glob) * tile_count(glob, min(group.dev.get(i, glob), glob))
    return count


def _with_device(ctx: Context, k: int, gtiles: dict[str, int], resident: list[str]):
    """(device scheme, group) of the device tiling that moves least under global tiles ``gtiles``
    (ties: fewer device tiles)."""
    c = ctx.cs[k]
    best = None
    for dscheme in SCHEMES[1:]:
        dev = scheme_tiles(c, gtiles, ctx.itemsize(k), ctx.limits["device"], dscheme)
        if dev is None:
            continue
        group = DeviceGroup([k], gtiles, dev[0], resident)
        pred = ctx.price(Schedule([DiskGroup([group])]))
        key = (movement_seconds(pred), iterations(ctx, group))
        if ctx.fits(pred["memory_peak"]) and (best is None or key < best[0]):
            best = (key, dscheme, group)
    return best[1:] if best else None


GRID = (0.25, 0.5, 1.0, 2.0)


def grid_candidates(ctx: Context, k: int) -> list[DeviceGroup]:
    """Beyond the paper's schemes: global tiles on a grid of composite sizes around them —
    Ti = Tj = s·√M and Tk = t·√(M/3) for s, t in GRID (and Tk = 1) — shrunk to fit, each with
    its best device scheme. For the exhaustive search."""
    c = ctx.cs[k]
    item = ctx.itemsize(k)
    m = ctx.scheme_limit() / item
    comp = composites(c)
    found = []
    for s in GRID:
        for t in (0.0,) + GRID:
            side = s * math.sqrt(m)
            start = spread(comp["i"], ctx.extents, side) | spread(comp["j"], ctx.extents, side)
            start |= spread(comp["k"], ctx.extents, t * math.sqrt(m / 3) if t else 1)
            tiles = choose_tiles(c, ctx.extents, item, ctx.scheme_limit(), start)
            if tiles is not None:
                best = _with_device(ctx, k, tiles, [])
                if best is not None:
                    found.append(best[1])
    return found


def prescribed_scheme(ctx: Context, k: int, names: list[str]) -> str | None:
    """The paper's own pick among the tilings found for contraction k: an array that fits stays
    (section 4, Fig. 1); otherwise equal tiles or streaming by the rule of eq. 4.9."""
    item = ctx.itemsize(k)
    lam_ab = item / ctx.machine.disk_read
    lam_bg = item / ctx.machine.global_to_device
    scheme = "equal" if equal_tiles_win(ctx.limits["global"] / item, lam_ab, lam_bg) else "streaming"
    for name in names:
        if name.startswith("fits/"):
            return name
    return next((n for n in names if n.startswith(scheme + "/")), None)


def fit(ctx: Context, disk: list[list[int]], singles: dict[int, DeviceGroup]) -> DiskGroup | None:
    """Tiles for one disk group made of the given device groups (lists of contraction ids), so
    that the emitted nest fits both levels; None when even unit tiles on the fused loops do not.

    Starts from whole extents on fused loops (and the scheme tiles of single contractions) and
    halves, at an overflowing level, the largest tile among the loops that level owns."""
    members = [k for g in disk for k in g]
    emitter = ctx.emitter()
    if not emitter.valid(members) or not all(emitter.valid(g) for g in disk):
        return None
    groups = []
    for g in disk:
        if len(g) == 1:
            groups.append(copy.deepcopy(singles[g[0]]))
        else:
            cs = [ctx.cs[k] for k in g]
            common = emitter.group_common(g)
            rest = dict.fromkeys(i for c in cs for i in c.indices())  # ordered: the plan must not depend on hashing
            groups.append(DeviceGroup(list(g), {i: ctx.extents[i] for i in common},
                                      {i: ctx.extents[i] for i in rest}, symmetric=_symmetric(ctx, emitter, g, common)))
    tiles = {i: ctx.extents[i] for i in emitter.group_common(members)} if len(members) > 1 else {}
    variants = [groups]
    # Also with every fused group's inputs fetched once per global tile rather than per device
    # tile: fewer bytes where device tiles re-read them, at the price of device memory.
    inputs = [t.name for t in ctx.tensors.values() if t.role == "input"]
    if any(len(g) > 1 for g in disk):
        variants.append([replace(copy.deepcopy(g), on_device=inputs if len(g.contractions) > 1 else [])
                         for g in groups])
    found = [g for g in (_shrunk(ctx, DiskGroup(v, dict(tiles))) for v in variants) if g is not None]
    found += [finer for g in found for finer in _finer(ctx, g)]
    return min(found, key=lambda g: work_seconds(ctx, ctx.price(Schedule([g])))) if found else None


def _finer(ctx: Context, group: DiskGroup) -> list[DiskGroup]:
    """``group`` with the device tiles of a symmetric group's indices halved again and again (while
    it fits): the loop visits only ordered tuples of them, so smaller tiles skip more of the
    computation (up to 1/k! of it for k indices) at the price of more statements.

    Priced before :func:`chainexec.planner.symmetry.mark` runs one term per orbit on the tuples
    whose positions coincide (:func:`chainexec.planner.build.make_plan` marks the chosen nests),
    so such tuples count their terms whole and larger tiles look dearer than the flops they run.
    Measured, they are dearer still: on the (T) job larger tiles run W's GEMMs slower per flop
    (``benchmarks/results/INDEX.md``), which pricing them as run would not see."""
    found = []
    for pos, g in enumerate(group.groups):
        sym = g.symmetric
        if len(sym) < 2 or not all(i in g.dev for i in sym) or len({g.dev[i] for i in sym}) != 1:
            continue
        tile = g.dev[sym[0]]
        while tile > 1:
            tile = tile_count(tile, 2)
            finer = copy.deepcopy(group)
            finer.groups[pos].dev.update(dict.fromkeys(sym, tile))
            # priced whole, not only its peaks: :func:`fit` prices every one that fits (from the
            # cache then), and one that fits is what finer tiles nearly always are
            if ctx.fits(ctx.price(Schedule([finer]))["memory_peak"]):
                found.append(finer)
    return found


def _symmetric(ctx: Context, emitter: Emitter, ids: list[int], common: list[str]) -> list[str]:
    """The fused indices every output of a device group is declared symmetric in (all of its
    exported tensors declare the same ones), in their declared order; else none."""
    exported = set(emitter.writers(ids)) & emitter.needed_after(ids[-1])
    declared = {tuple(ctx.tensors[t].symmetric) for t in exported}
    if len(declared) != 1:
        return []
    sym = list(declared.pop())
    return sym if set(sym) <= set(common) else []


def _halved(g: DeviceGroup, tiles: dict[str, int], index: str, tile: int) -> None:
    """Set ``tiles[index]`` to ``tile``, and every symmetric index of ``g`` with it (they stay alike)."""
    for i in g.symmetric if index in g.symmetric else [index]:
        if i in tiles:
            tiles[i] = tile


def _shrunk(ctx: Context, group: DiskGroup) -> DiskGroup | None:
    """``group`` with tiles halved until its nest fits both levels (in place); None if it cannot.
    At most ⌈log₂ E⌉ halvings per index of extent E (its tile halves down to 1), each priced once.

    One halving at a time, the nest priced after each: a peak does not fall by a fixed factor per
    halving (a loop that appears can drop more, a global halving can raise the device peak by
    splitting a shared buffer), so several halvings per pricing can end with other tiles than
    one at a time does (smaller than needed)."""
    while True:
        peak = ctx.peaks(Schedule([group]))
        over = [lvl for lvl in ("device", "global") if peak[lvl] > ctx.limits[lvl]]
        if not over:
            return group
        if not _halve(group, over[0], {i for k in group.contractions for i in ctx.cs[k].whole()}):
            return None


def _halve(group: DiskGroup, level: str, whole: set[str] = frozenset()) -> bool:
    """Halve the largest tile the given level owns in a group, never one of ``whole`` (indices a
    contraction of the group keeps whole); False when all are 1.

    On the device, the fused loops of a device group come first: they alone shrink the tensors
    the group keeps on the device, while cutting a contraction's other indices only multiplies
    small tiles (and per-tile overhead)."""
    candidates = []  # (fused loop?, tile, the dict holding it, index, its device group)
    if level == "global":
        candidates += [(True, t, group.tiles, i, None) for i, t in group.tiles.items()]
        candidates += [(True, t, g.glob, i, g) for g in group.groups for i, t in g.glob.items()]
    else:
        for g in group.groups:
            fused = set(g.glob) if len(g.contractions) > 1 else set(g.dev)
            candidates += [(i in fused, t, g.dev, i, g) for i, t in g.dev.items()]
    candidates = [c for c in candidates if c[1] > 1 and c[3] not in whole]
    if not candidates:
        return False
    _, tile, tiles, index, g = max(candidates, key=lambda c: (c[0], c[1]))
    if g is None:
        tiles[index] = tile_count(tile, 2)
    else:
        _halved(g, tiles, index, tile_count(tile, 2))
    return True


def split_for_ranks(ctx: Context, schedule: Schedule, ranks: int) -> None:
    """Cut the parallel loop of every device group until it has at least ``ranks`` iterations, so
    that every rank gets work in every parallel loop (in place), as far as the memory limits allow.

    Alternatives are priced for one rank; a schedule whose parallel loop has fewer iterations than
    there are ranks would leave ranks idle (a whole (T) job on one rank of four). Each step halves
    the largest tile of that loop — only the parallel loop's own indices (a fused group's common
    indices, a single contraction's output indices) — and is kept only if the emitted nest still
    fits: tiling an index can split a buffer that two references shared (``V[i,k]`` and
    ``V[j,k]`` once ``i`` is cut), which raises the peak. Movement grows with the number of tiles;
    the prediction follows it (the nest is emitted after this)."""
    if ranks <= 1:
        return
    emitter = ctx.emitter()
    for disk in schedule.groups:
        for g in disk.groups:
            if len(g.contractions) > 1:
                names = emitter.group_common(g.contractions)
            else:
                names = list(ctx.cs[g.contractions[0]].out_indices)
            span = {i: min(ctx.extents[i], disk.tiles.get(i, ctx.extents[i]), g.glob.get(i, ctx.extents[i]))
                    for i in names}

            def tile(i: str) -> int:
                return min(g.dev.get(i, span[i]), span[i])

            blocked = {i for k in g.contractions for i in ctx.cs[k].whole()}
            while _parallel_count(g, names, span, tile, ctx.extents) < ranks:
                cuts = [i for i in names if tile(i) > 1 and i not in blocked]
                if not cuts:
                    break
                widest = max(cuts, key=lambda i: (tile(i), -names.index(i)))
                before = dict(g.dev)
                g.dev.setdefault(widest, tile(widest))
                _halved(g, g.dev, widest, tile_count(tile(widest), 2))
                if not ctx.fits(ctx.peaks(schedule)):
                    g.dev.clear()
                    g.dev.update(before)
                    blocked.add(widest)


def _parallel_count(g: DeviceGroup, names: list[str], span: dict[str, int], tile, extents: dict[str, int]) -> int:
    """Iterations of a device group's parallel loop over ``names`` (ranges ``span``, tiles
    ``tile(i)``) per iteration of the loops around it: ordered tuples of the symmetric indices
    (:meth:`~chainexec.planner.nest.Emitter.symmetry`) where the loop is the one that tiles them."""
    counts = {i: tile_count(span[i], tile(i)) for i in names}
    sym = [i for i in g.symmetric if i in counts]
    if len(sym) >= 2 and len(sym) == len(g.symmetric) and all(span[i] == extents[i] for i in sym) \
            and len({tile(i) for i in sym}) == 1:
        ordered = math.comb(counts[sym[0]] + len(sym) - 1, len(sym))
        return ordered * math.prod(n for i, n in counts.items() if i not in sym)
    return math.prod(counts.values())
