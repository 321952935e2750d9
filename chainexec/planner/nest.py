"""Loop-nest emission: a Schedule (which contractions are fused at which level, and the tile sizes)
becomes the plan's statement trees.

Levels follow the multi-level paper (section 5.2): a *disk group* is a sub-chain fused at the disk
level — its intermediates live in the global array and never reach disk; inside it, a *device
group* is a sub-chain fused at the global level — its intermediates live on the device and never
reach the global array. A group of one contraction is unfused.

Allocation placement follows Algorithm 1 of the paper: the buffer of an intermediate is allocated
before the nest that produces it and freed after the nest that consumes it, so producer and
consumer both run inside the loops common to them (the group's fused loop) and the intermediate is
only ever a slab over those loops' tiles.

Shapes of the emitted nests (G: global level, D: device level)::

    single contraction (output-stationary, section 4 / Fig. 1 (d)):
        [alloc+load resident operands @G]
        for G tiles of out indices:  alloc out@G [load if +=]
            for G tiles of contracted indices:  alloc+load streamed operands @G
                parallel for D tiles of out indices:  alloc out@D
                    for D tiles of contracted indices:  alloc+get operands @D; compute; free
                    accumulate out@D; free
                free streamed operands @G
            store out@G; free

    device group c_1..c_m (intermediates on the device):
        for G tiles of the indices common to all outputs:
            alloc out_m@G; alloc+load every other operand @G
            parallel for D tiles of the common indices:
                for k = 1..m: alloc I_k@D
                    for D tiles of c_k's other indices: alloc+get operands @D; compute c_k; free
                    free I_{k-1}@D
                accumulate I_m@D; free
            free operands @G; store out_m@G; free

A disk group wraps its device groups in a G loop over the indices common to its outputs and keeps
its intermediates' G buffers alive between producer and consumer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from chainexec import expr
from chainexec.planner.plan import Contraction, Loop, Nest, Op, TensorInfo


@dataclass
class DeviceGroup:
    """Contractions fused at the global level (device-resident intermediates), with their tiles.

    ``glob``/``dev``: tile size per index at the global / device level (an index not listed, or
    with a tile ≥ its range, is not tiled). ``resident``: operands of a single contraction loaded
    once, outside its loops (Fig. 1: the array that fits stays)."""

    contractions: list[int]
    glob: dict[str, int]
    dev: dict[str, int]
    resident: list[str] = field(default_factory=list)


@dataclass
class DiskGroup:
    """Contractions fused at the disk level (global-resident intermediates): a G loop with tiles
    ``tiles`` over the indices common to their outputs, around their device groups."""

    groups: list[DeviceGroup]
    tiles: dict[str, int] = field(default_factory=dict)

    @property
    def contractions(self) -> list[int]:
        return [k for g in self.groups for k in g.contractions]


@dataclass
class Schedule:
    groups: list[DiskGroup]


def common_indices(cs: list[Contraction], extents: dict[str, int]) -> list[str]:
    """The fused loops of a sub-chain: Common of section 5.1 over its fusable list I_0 … I_n —
    every output and the chain's input I_0 (the larger operand of the first contraction), so that
    no fused loop runs over an index I_0 lacks (which would re-read it); in the last output's order."""
    first = cs[0]
    operands = [first.a_indices] + ([first.b_indices] if first.b is not None else [])
    common = set(max(operands, key=lambda ix: math.prod(extents[i] for i in ix)))
    for c in cs:
        common &= set(c.out_indices)
    return [i for i in cs[-1].out_indices if i in common]


def _ref(op: str, level: str, tensor: str, indices, version=None) -> Op:
    return Op(op, level, tensor=tensor, indices=list(indices), version=version)


def _loop(level: str, tiles: dict[str, int], body: list, parallel: bool = False) -> list:
    """A loop over the listed tiles around ``body``; none when nothing is tiled, except that a
    parallel loop always exists (one iteration) so that exactly one rank runs its body."""
    if tiles or parallel:
        return [Loop(level, dict(tiles), parallel, body)]
    return body


def _operands(c: Contraction) -> list[tuple[str, list[str]]]:
    return [(c.a, c.a_indices)] + ([(c.b, c.b_indices)] if c.b is not None else [])


class Emitter:
    """Emits the nests of a schedule, numbering stored versions of each tensor as it goes."""

    def __init__(self, contractions: list[Contraction], extents: dict[str, int], tensors: dict[str, TensorInfo]):
        self.cs = contractions
        self.extents = extents
        self.tensors = tensors
        self.versions: dict[str, int] = {}

    def _tiled(self, tiles: dict[str, int], names) -> dict[str, int]:
        return {i: tiles[i] for i in names if i in tiles and tiles[i] < self.extents[i]}

    def _inputs_of(self, name, ix) -> list[tuple[str, list[str]]]:
        """What a computed tensor (``source: {expr}``) used as ``name[ix]`` reads, renamed to ``ix``."""
        t = self.tensors[name]
        rename = dict(zip(t.indices, ix))
        return [(r.tensor, [rename[i] for i in r.indices]) for r in expr.refs(expr.parse(t.source["expr"]))]

    def _computed(self, name) -> bool:
        source = self.tensors[name].source
        return source is not None and "expr" in source

    def _load(self, name, ix) -> list[Op]:
        """Bring ``name[ix]`` to the global level: read it, or, for a computed tensor, read what
        its expression needs (it is made on the device, where it is used)."""
        if self._computed(name):
            return [op for n, i in self._inputs_of(name, ix) for op in self._load(n, i)]
        return [_ref("alloc", "global", name, ix), _ref("load", "global", name, ix, self.versions.get(name, 0))]

    def _unload(self, name, ix) -> list[Op]:
        if self._computed(name):
            return [op for n, i in self._inputs_of(name, ix) for op in self._unload(n, i)]
        return [_ref("free", "global", name, ix)]

    def _fetch(self, name, ix) -> list[Op]:
        """Bring ``name[ix]`` to the device: get it, or get its expression's inputs and evaluate."""
        if self._computed(name):
            inputs = self._inputs_of(name, ix)
            ops = [op for n, i in inputs for op in self._fetch(n, i)]
            ops += [_ref("alloc", "device", name, ix), _ref("eval", "device", name, ix)]
            return ops + [_ref("free", "device", n, i) for n, i in inputs]
        return [_ref("alloc", "device", name, ix), _ref("get", "device", name, ix)]

    def _store(self, c: Contraction) -> list[Op]:
        self.versions[c.out] = self.versions.get(c.out, 0) + 1
        return [_ref("store", "global", c.out, c.out_indices, self.versions[c.out]),
                _ref("free", "global", c.out, c.out_indices)]

    def _out_alloc(self, c: Contraction) -> list[Op]:
        ops = [_ref("alloc", "global", c.out, c.out_indices)]
        if c.accumulate:
            ops.append(_ref("load", "global", c.out, c.out_indices, self.versions.get(c.out, 0)))
        return ops

    def schedule(self, schedule: Schedule) -> list[Nest]:
        return [Nest(g.contractions, self.disk_group(g)) for g in schedule.groups]

    def needed_after(self, k: int) -> set[str]:
        """Tensors some contraction after position k reads or accumulates into, and outputs."""
        needed = {t.name for t in self.tensors.values() if t.role == "output"}
        for c in self.cs[k + 1:]:
            needed.update(n for n, _ in _operands(c))
            if c.accumulate:
                needed.add(c.out)
        return needed

    def writers(self, ids: list[int]) -> dict[str, list[str]]:
        """Tensors written in a sub-chain, with the index names of their first writer there."""
        found: dict[str, list[str]] = {}
        for k in ids:
            found.setdefault(self.cs[k].out, self.cs[k].out_indices)
        return found

    def valid(self, ids: list[int]) -> bool:
        """Whether a sub-chain can run fused with its written tensors kept at a faster level: no
        tensor is read in it before it is written there; a ``+=`` onto a tensor made before the
        sub-chain is not also read in it; and an exported tensor that lacks a fused index is only
        written by contractions that sum over that index (its tiles' partial sums then add up)."""
        written: set[str] = set()
        for k in ids:
            c = self.cs[k]
            reads = {n for n, _ in _operands(c)}
            later = {self.cs[j].out for j in ids if j > k}
            if reads & later - written:
                return False
            if c.accumulate and c.out not in written and any(c.out in {n for n, _ in _operands(self.cs[j])}
                                                              for j in ids):
                return False
            written.add(c.out)
        common = set(self.group_common(ids))
        exported = set(self.writers(ids)) & self.needed_after(ids[-1])
        return all(common - set(self.cs[k].out_indices) <= set(self.cs[k].indices())
                   for k in ids if self.cs[k].out in exported)

    def group_common(self, ids: list[int]) -> list[str]:
        """The fused loops of a sub-chain. A linear chain (each contraction reads the previous
        one's output) uses the paper's Common (:func:`common_indices`). Otherwise: the indices of
        every tensor written there — or, when that is empty (the chain ends in a reduction), of
        every tensor kept inside it — minus any index that a reference renames (a permuted read
        needs the whole range of the positions it permutes)."""
        cs = [self.cs[k] for k in ids]
        if all(p.out in {n for n, _ in _operands(q)} for p, q in zip(cs, cs[1:])) and \
                len({c.out for c in cs}) == len(cs):
            return common_indices(cs, self.extents)
        writers = self.writers(ids)
        sets = [set(ix) for ix in writers.values()]
        common = set.intersection(*sets)
        if not common:
            inner = [set(ix) for t, ix in writers.items() if t not in self.needed_after(ids[-1])]
            common = set.intersection(*inner) if inner else set()
        for c in cs:
            for name, ix in _operands(c) + [(c.out, c.out_indices)]:
                if name in writers:
                    common -= {i for pair in zip(ix, writers[name]) if pair[0] != pair[1] for i in pair}
        first = next(iter(writers.values()))
        return [i for i in first if i in common]

    def disk_group(self, group: DiskGroup) -> list:
        """Device groups in order. A tensor that one device group writes and a later one uses
        stays in the global array between them (allocated before its first writer, stored after
        its last use if it is needed after the group, then freed); nothing else moves to disk."""
        members = group.contractions
        written = self.writers(members)
        after = self.needed_after(members[-1])
        first, last = {}, {}
        for pos, dg in enumerate(group.groups):
            for k in dg.contractions:
                c = self.cs[k]
                for name in [n for n, _ in _operands(c)] + [c.out]:
                    if name in written:
                        first.setdefault(name, pos)
                        last[name] = pos
        kept = {name for name in written if last[name] > first[name]}
        body: list = []
        for pos, dg in enumerate(group.groups):
            body += [op for name in sorted(kept) if first[name] == pos
                     for op in self._out_alloc(self._first_writer(members, name))]
            body += self.device_group(dg, kept)
            for name in sorted(kept):
                if last[name] == pos:
                    body += (self._store(self._first_writer(members, name)) if name in after
                             else [_ref("free", "global", name, written[name])])
        return _loop("global", self._tiled(group.tiles, self.group_common(members)), body)

    def _first_writer(self, ids: list[int], name: str) -> Contraction:
        return next(self.cs[k] for k in ids if self.cs[k].out == name)

    def device_group(self, group: DeviceGroup, kept: set[str]) -> list:
        if len(group.contractions) == 1:
            return self.single(self.cs[group.contractions[0]], group, kept)
        return self.fused(group, kept)

    def single(self, c: Contraction, g: DeviceGroup, kept: set[str]) -> list:
        """One contraction, output-stationary at both levels (module docstring)."""
        outs = c.out_indices
        ks = [i for i in c.indices() if i not in outs]
        resident = [(n, ix) for n, ix in _operands(c) if n in g.resident and n not in kept]
        streamed = [(n, ix) for n, ix in _operands(c) if n not in g.resident and n not in kept]
        inner = [op for n, ix in _operands(c) for op in self._fetch(n, ix)]
        inner.append(Op("compute", "device", contraction=c.id))
        inner += [_ref("free", "device", n, ix) for n, ix in _operands(c)]
        dev_body = [_ref("alloc", "device", c.out, outs), *_loop("device", self._tiled(g.dev, ks), inner),
                    _ref("accumulate", "device", c.out, outs), _ref("free", "device", c.out, outs)]
        k_body = [op for n, ix in streamed for op in self._load(n, ix)]
        k_body += _loop("device", self._tiled(g.dev, outs), dev_body, parallel=True)
        k_body += [op for n, ix in streamed for op in self._unload(n, ix)]
        stored = c.out not in kept
        out_body = self._out_alloc(c) if stored else []
        out_body += _loop("global", self._tiled(g.glob, ks), k_body)
        if stored:
            out_body += self._store(c)
        body = [op for n, ix in resident for op in self._load(n, ix)]
        body += _loop("global", self._tiled(g.glob, outs), out_body)
        body += [op for n, ix in resident for op in self._unload(n, ix)]
        return body

    def fused(self, g: DeviceGroup, kept: set[str]) -> list:
        """Contractions whose written tensors stay on the device (module docstring): each is
        allocated on the device at its first writer, freed after its last use in the group, and
        only the ones needed later are accumulated to the global level (and stored unless the
        enclosing disk group keeps them)."""
        ids = g.contractions
        cs = [self.cs[k] for k in ids]
        common = self.group_common(ids)
        writers = self.writers(ids)
        exported = [t for t in writers if t in self.needed_after(ids[-1])]
        last_use = {}
        for pos, c in enumerate(cs):
            for name in [n for n, _ in _operands(c)] + [c.out]:
                last_use[name] = pos
        loaded = []
        for c in cs:
            for n, ix in _operands(c):
                if n not in writers and n not in kept and (n, ix) not in loaded:
                    loaded.append((n, ix))
        dev_body: list = []
        live: set[str] = set()
        for pos, c in enumerate(cs):
            if c.out not in live:
                dev_body.append(_ref("alloc", "device", c.out, writers[c.out]))
                live.add(c.out)
            work = [(n, ix) for n, ix in _operands(c) if n not in writers]
            step = [op for n, ix in work for op in self._fetch(n, ix)]
            step.append(Op("compute", "device", contraction=c.id))
            step += [_ref("free", "device", n, ix) for n, ix in work]
            rest = [i for i in c.indices() if i not in common]
            dev_body += _loop("device", self._tiled(g.dev, rest), step)
            for name in sorted(live):
                if last_use[name] == pos and name not in exported:
                    dev_body.append(_ref("free", "device", name, writers[name]))
                    live.discard(name)
        for name in exported:
            dev_body += [_ref("accumulate", "device", name, writers[name]), _ref("free", "device", name, writers[name])]
        stored = [name for name in exported if name not in kept]
        body: list = []
        for name in stored:
            first = next(c for c in cs if c.out == name)
            body += self._out_alloc(first)
        body += [op for n, ix in loaded for op in self._load(n, ix)]
        body += _loop("device", self._tiled(g.dev, common), dev_body, parallel=True)
        body += [op for n, ix in loaded for op in self._unload(n, ix)]
        for name in stored:
            body += self._store(next(c for c in cs if c.out == name))
        return _loop("global", self._tiled(g.glob, common), body)
