"""Choosing a schedule: the paper's prescriptive choice, an exhaustive search, and the record of
every alternative weighed (for ``chainexec plan`` to explain).

Candidates:

- ``unfused`` — every contraction alone, each tiled by its cheapest scheme (section 4.1);
- ``paper: disk`` — fusion at the disk level only (intermediates kept in the global array);
- ``paper: disk+global`` — the paper's procedure at both levels (section 5.2): cut links that are
  not profitable at a level (eq. 5.1–5.3), then split each fusable list by dynamic programming
  (section 5.1) into sub-chains that fit — first at the device level, then at the global level;
- ``fused`` — each fusable list whole as one disk group of one device group (its inputs fetched
  per device tile where they do not fit the device whole), where every list fits so: the
  profitability cuts of eq. 5.1–5.3 judge one link at a time, and for a long chain whose inputs
  outgrow the device (the (T) job's 34 contractions with ``ovvv`` larger than a GPU) they cut
  it into groups that exchange six-index intermediates through the global array, while the
  whole chain on the device moves only input tiles;
- ``search`` — beyond the paper: every way of cutting each fusable list into disk groups and
  each disk group into device groups, with every tiling scheme of each unfused contraction and a
  grid of global tile sizes around them (:func:`grid_candidates`), priced exactly. Costs of disk groups add up, so the best cut is found by dynamic programming over
  positions, which is exhaustive. Run when every fusable list has at most ``SEARCH_LIMIT``
  contractions.

The rule: the plan uses the candidate with the least predicted movement time (disk plus
global↔device seconds; compute is the same for all) among those that fit; ties go to the earlier
candidate in the list above, so the paper's choice is kept unless the fused or the searched one
is strictly better.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from itertools import combinations

from chainexec.planner import fusion
from chainexec.planner.nest import DeviceGroup, DiskGroup, Schedule
from chainexec.planner.schedule import (Context, fit, grid_candidates, iterations, movement_seconds,
                                        prescribed_scheme, single_candidates)
from chainexec.spectypes import MAX_SIZE, format_size

SEARCH_LIMIT = 5


def least_limit(ctx: Context, k: int, level: str) -> int | None:
    """The least ``level`` limit (bytes) at which contraction ``k`` has a tiling
    (:func:`single_candidates`), the other level's kept; None where none has one below
    :data:`~chainexec.spectypes.MAX_SIZE`. Doubled from the limit until one fits, then halved
    back by bisection: a refusal names what would plan (one single-contraction search per step,
    about twice the bits of the ratio, on the error path only)."""
    def fits(limit: int) -> bool:
        return bool(single_candidates(replace(ctx, limits={**ctx.limits, level: limit}), k))

    low, high = ctx.limits[level], max(1, ctx.limits[level])
    while not fits(high):
        if high >= MAX_SIZE:
            return None
        low, high = high, min(2 * high, MAX_SIZE)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def _raised(ctx: Context, failed: list, levels: set[str]) -> str | None:
    """What to raise ``levels`` to (the config's settings, sizes) for every contraction of
    ``failed`` to have a tiling (:func:`least_limit`): one level with the other kept; both, the
    device's least with global memory unbounded, then global memory's least with that. None
    where no limit below :data:`~chainexec.spectypes.MAX_SIZE` does."""
    least = {}
    for level in sorted(levels, reverse=True):  # device first
        other = {"global": "device", "device": "global"}[level]
        kept = ctx.limits[other] if other not in levels else least.get(other, MAX_SIZE)
        sizes = [least_limit(replace(ctx, limits={level: ctx.limits[level], other: kept}), c.id, level) for c in failed]
        if None in sizes:
            return None
        least[level] = max(sizes)
    return " and ".join(f"machine.{level}_memory to {format_size(size)}" + (f" ({size:,} B)" if size >= 1024 else "")
                        for level, size in sorted(least.items()))


def compositions(items: list[int]) -> list[list[list[int]]]:
    """Every way to cut a list into consecutive non-empty parts."""
    n = len(items)
    result = []
    for k in range(n):
        for cuts in combinations(range(1, n), k):
            bounds = [0, *cuts, n]
            result.append([items[a:b] for a, b in zip(bounds, bounds[1:])])
    return result


class Chooser:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.tilings = {c.id: single_candidates(ctx, c.id) for c in ctx.cs}
        failed = [c for c in ctx.cs if not self.tilings[c.id]]
        if failed:
            needs = [need for level in ("global", "device") for need in [_raised(ctx, failed, {level})] if need]
            c = failed[0]
            raise ValueError(f"no tiling of contraction #{c.id} ({c.out} = {c.einsum()})"
                             + (f" and {len(failed) - 1} more" if len(failed) > 1 else "")
                             + f" fits the memory limits (global {ctx.limits['global']:,} B, device "
                             f"{ctx.limits['device']:,} B): raise "
                             + (" or ".join(needs) or _raised(ctx, failed, {"global", "device"}) or "both"))
        self.singles = {k: min(options, key=lambda o: (self._alone(o[1]), iterations(ctx, o[1])))[1]
                        for k, options in self.tilings.items()}
        self.lists = fusion.fusable_lists(ctx.cs)
        self._fit = lru_cache(maxsize=None)(self._fit_uncached)

    def _alone(self, group: DeviceGroup) -> float:
        return movement_seconds(self.ctx.price(Schedule([DiskGroup([group])])))

    def _fit_uncached(self, disk: tuple[tuple[int, ...], ...]) -> DiskGroup | None:
        return fit(self.ctx, [list(g) for g in disk], self.singles)

    def tiling_record(self) -> list[dict]:
        """Every scheme tried for each contraction run alone (section 4.1), the cheapest marked
        chosen and the paper's own pick (Fig. 1 / eq. 4.9) marked prescribed."""
        rows = []
        for k, options in self.tilings.items():
            prescribed = prescribed_scheme(self.ctx, k, [n for n, _ in options])
            for name, group in options:
                pred = self.ctx.price(Schedule([DiskGroup([group])]))
                rows.append({"name": f"#{k} {name}", "kind": "tiling", "groups": f"[{k}]", "fits": True,
                             "movement_seconds": movement_seconds(pred), "bytes": pred["bytes"],
                             "seconds": pred["seconds"], "memory_peak": pred["memory_peak"],
                             "chosen": group is self.singles[k], "prescribed": name == prescribed})
        return rows

    def unfused(self) -> Schedule:
        return Schedule([DiskGroup([self.singles[c.id]]) for c in self.ctx.cs])

    def _profitable_runs(self, run: list[int], level: str) -> list[list[int]]:
        """Cut a fusable list where a link fails eq. 5.1–5.3 at ``level``, then detach an end
        contraction whose large array must be re-read when eq. 5.4 says that does not pay."""
        parts = [[run[0]]]
        for p, q in zip(run, run[1:]):
            c_p, c_q = self.ctx.cs[p], self.ctx.cs[q]
            feeds = c_p.out in (c_q.a, c_q.b)
            if not feeds or fusion.profitable(c_p, c_q, self.ctx.tensors[c_p.out], level, self.ctx.machine):
                parts[-1].append(q)
            else:
                parts.append([q])
        result = []
        for part in parts:
            if len(part) > 2 and not self._end_pays(part[0], part[1:], level):
                result.append(part[:1])
                part = part[1:]
            if len(part) > 2 and not self._end_pays(part[-1], part[:-1], level):
                result += [part[:-1], part[-1:]]
            else:
                result.append(part)
        return result

    def _end_pays(self, end: int, rest: list[int], level: str) -> bool:
        """Eq. 5.4 for the end contraction ``end`` of a run whose other contractions ``rest`` take
        the fraction q of the level's memory (their fused nest's exact peak). The arrays that
        fusion makes re-read are the first contraction's inputs from outside the run and the last
        contraction's output; when they fit the level, fusing the end costs nothing extra."""
        c = self.ctx.cs[end]
        memory_level = "global" if level == "disk" else "device"
        limit = self.ctx.limits[memory_level] / self.ctx.itemsize(end)
        written = {self.ctx.cs[k].out for k in rest}
        if end < rest[0]:
            arrays = [n for n in (c.a, c.b) if n is not None and n not in written]
        else:
            arrays = [c.out]
        if max((fusion.size(self.ctx.tensors[t]) for t in arrays), default=0) <= limit:
            return True
        group = self._fit(((*rest,),) if level == "global" else tuple((k,) for k in rest))
        if group is None:
            return False
        q = self.ctx.price(Schedule([group]))["memory_peak"][memory_level] / self.ctx.limits[memory_level]
        return fusion.first_last_profitable(fusion.link_ratio(c, self.ctx.tensors[c.out]), limit, q)

    def _split(self, run: list[int], fits, price) -> list[list[int]]:
        """Section 5.1's DP on one run: a cut after position k moves 2·|I| elements for every
        tensor I written up to k and still needed after it (the intermediate I_k of a linear
        chain); among equal-cost splits, the one whose pieces ``price`` lowest."""
        emitter = self.ctx.emitter()
        cut = []
        for pos in range(len(run)):
            open_ = set(emitter.writers(run[:pos + 1])) & emitter.needed_after(run[pos])
            cut.append(2 * sum(fusion.size(self.ctx.tensors[t]) for t in open_))
        pieces = fusion.split(len(run), lambda i, j: fits(run[i:j + 1]), lambda k: cut[k],
                              lambda ps: sum(price(run[i:j + 1]) for i, j in ps))
        return [run[i:j + 1] for i, j in pieces]

    def _seconds(self, disk: tuple[tuple[int, ...], ...]) -> float:
        group = self._fit(disk)
        return float("inf") if group is None else movement_seconds(self.ctx.price(Schedule([group])))

    def recurrence(self) -> list[dict]:
        """Section 5's memory recurrence for each fusable list, in bytes: f(1,n) at the device
        level and its section-5.2 form at the global level, beside the limits (for explanation;
        feasibility itself is decided on the emitted nests, see :mod:`chainexec.planner.fusion`)."""
        rows = []
        for run in self.lists:
            cs = [self.ctx.cs[k] for k in run]
            first = cs[0]
            operands = [first.a_indices] + ([first.b_indices] if first.b is not None else [])
            outs = [max(operands, key=len)] + [c.out_indices for c in cs]
            item = self.ctx.itemsize(run[0])
            ext = self.ctx.extents

            def fits_device(i, j):
                return fusion.memory_f(outs[i:j + 1], ext) * item <= self.ctx.limits["device"]

            rows.append({"contractions": run, "device_bytes": fusion.memory_f(outs, ext) * item,
                         "global_bytes": fusion.memory_f(outs, ext, fits_device) * item,
                         "limits": dict(self.ctx.limits)})
        return rows

    def paper(self, device_level: bool) -> Schedule:
        groups = []
        for run in self.lists:
            device_parts: list[list[int]] = []
            for part in self._profitable_runs(run, "global") if device_level else [[k] for k in run]:
                device_parts += self._split(part, lambda seg: self._fit(((*seg,),)) is not None,
                                            lambda seg: self._seconds(((*seg,),)))
            for part in self._profitable_runs(run, "disk"):
                def within(seg, parts=device_parts):
                    return tuple(tuple(p) for p in ([k for k in q if k in seg] for q in parts) if p)
                for seg in self._split(part, lambda s: self._fit(within(s)) is not None,
                                       lambda s: self._seconds(within(s))):
                    groups.append(self._fit(within(seg)))
        return Schedule(groups)

    def fused(self) -> Schedule | None:
        """Every fusable list as one device group (module docstring); None where one does not fit."""
        groups = [self._fit((tuple(run),)) for run in self.lists]
        return None if any(g is None for g in groups) else Schedule(groups)

    def search(self) -> Schedule | None:
        """Exhaustive over cuts at both levels and single-contraction schemes (module docstring)."""
        if any(len(run) > SEARCH_LIMIT for run in self.lists):
            return None
        options = {k: [g for _, g in tilings] + grid_candidates(self.ctx, k) for k, tilings in self.tilings.items()}
        groups: list[DiskGroup] = []
        for run in self.lists:
            best_at: dict[int, tuple[float, list[DiskGroup]]] = {0: (0.0, [])}
            for end in range(1, len(run) + 1):
                for start in range(end):
                    seg = run[start:end]
                    group = self._best_disk_group(seg, options)
                    if group is None or start not in best_at:
                        continue
                    cost = best_at[start][0] + group[0]
                    if end not in best_at or cost < best_at[end][0]:
                        best_at[end] = (cost, best_at[start][1] + [group[1]])
            groups += best_at[len(run)][1]
        return Schedule(groups)

    def _best_disk_group(self, seg: list[int], options) -> tuple[float, DiskGroup] | None:
        """The cheapest way to run ``seg`` as one disk group: every cut into device groups; an
        unfused contraction also tries every scheme tiling."""
        trials = [(parts, self.singles) for parts in compositions(seg)]
        if len(seg) == 1:
            trials += [([seg], self.singles | {seg[0]: option}) for option in options[seg[0]]]
        best = None
        for parts, singles in trials:
            group = fit(self.ctx, parts, singles)
            if group is None:
                continue
            cost = movement_seconds(self.ctx.price(Schedule([group])))
            if best is None or cost < best[0]:
                best = (cost, group)
        return best


def choose(ctx: Context, prefer: str | None = None) -> tuple[Schedule, list[dict]]:
    """The schedule to use and every alternative weighed: name, predicted record, chosen flag.
    ``prefer`` names a schedule alternative to use instead of the cheapest (it must fit)."""
    chooser = Chooser(ctx)
    candidates = [("unfused", chooser.unfused()), ("paper: disk", chooser.paper(device_level=False)),
                  ("paper: disk+global", chooser.paper(device_level=True))]
    candidates += [(name, found) for name, found in (("fused", chooser.fused()), ("search", chooser.search()))
                   if found is not None]
    priced = []
    for name, schedule in candidates:
        pred = ctx.price(schedule)
        priced.append({"name": name, "kind": "schedule", "fits": ctx.fits(pred["memory_peak"]),
                       **({"recurrence": chooser.recurrence()} if name == "paper: disk+global" else {}), "movement_seconds": movement_seconds(pred),
                       "bytes": pred["bytes"], "seconds": pred["seconds"], "memory_peak": pred["memory_peak"],
                       "groups": describe(schedule), "schedule": schedule})
    usable = [p for p in priced if p["fits"] and (prefer is None or p["name"] == prefer)]
    if not usable:
        names = ", ".join(p["name"] for p in priced if p["fits"])
        raise ValueError(f"no schedule named {prefer!r} fits (available: {names})")
    winner = min(usable, key=lambda p: p["movement_seconds"])
    for p in priced:
        p["chosen"] = p is winner
    schedule = winner["schedule"]
    for p in priced:
        del p["schedule"]
    return schedule, priced + chooser.tiling_record()


def describe(schedule: Schedule) -> str:
    """``[0 1 | 2] [3]``: disk groups in brackets, device groups separated by ``|`` … fused
    contractions inside one device group joined by spaces."""
    return " ".join("[" + " | ".join(" ".join(map(str, g.contractions)) for g in d.groups) + "]"
                    for d in schedule.groups)
