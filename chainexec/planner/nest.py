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
            [alloc+get the group's inputs @D, once per G tile, when ``on_device`` (every rank)]
            parallel for D tiles of the common indices:
                for k = 1..m: alloc I_k@D
                    for D tiles of c_k's other indices: alloc+get operands @D; compute c_k; free
                    free I_{k-1}@D
                accumulate I_m@D; free
            free operands @G; store out_m@G; free

A disk group wraps its device groups in a G loop over the indices common to its outputs and keeps
its intermediates' G buffers alive between producer and consumer.

An output summed over a G loop's tiles (it lacks an index the loop tiles: the (T) energy) is
allocated before that loop and stored once after it, so that every tile's partial sum adds up in
it. Where every output of a device group is declared symmetric in some of its fused indices, its
parallel loop visits ordered tiles of them only, weighted (:meth:`Emitter.symmetry`).

References to one tensor under different index names (``ovvv[i,a,f,b]``, ``ovvv[i,a,f,c]``) share a
buffer at a level where their regions are identical in every iteration (:func:`same_region`): one
alloc+load per region at G; in a device group one alloc+get per region, kept on the device from
its first user to its last. Such a reference has no buffer of its own; the executor finds the
live buffer of the tensor that covers its region.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from chainexec import expr
from chainexec.planner import inline, pipeline
from chainexec.planner.plan import Contraction, Loop, Nest, Op, TensorInfo


@dataclass
class DeviceGroup:
    """Contractions fused at the global level (device-resident intermediates), with their tiles.

    ``glob``/``dev``: tile size per index at the global / device level (an index not listed, or
    with a tile ≥ its range, is not tiled). ``resident``: operands of a single contraction loaded
    once, outside its loops (Fig. 1: the array that fits stays). ``on_device``: inputs of a fused
    group fetched to the device once per global tile, before its parallel loop, instead of a
    slice per device tile (every rank fetches them; worth it when device tiles re-read them).
    ``symmetric``: fused indices that every output of the group is symmetric in (see
    :meth:`Emitter.symmetry`); the tiles of these indices are kept equal at each level."""

    contractions: list[int]
    glob: dict[str, int]
    dev: dict[str, int]
    resident: list[str] = field(default_factory=list)
    on_device: list[str] = field(default_factory=list)
    symmetric: list[str] = field(default_factory=list)


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


def _loop(level: str, tiles: dict[str, int], body: list, parallel: bool = False, symmetric=()) -> list:
    """A loop over the listed tiles around ``body``; none when nothing is tiled, except that a
    parallel loop always exists (one iteration) so that exactly one rank runs its body."""
    if tiles or parallel:
        return [Loop(level, dict(tiles), parallel, body, symmetric=list(symmetric))]
    return body


def same_region(ix, iy, tiled) -> bool:
    """Whether two references to one tensor cover the same region in every iteration of loops that
    tile the indices ``tiled``: position by position the same index, or two indices neither of
    which is tiled (both span the whole extent). Positions, not names, decide."""
    if len(ix) != len(iy):
        return False
    for x, y in zip(ix, iy):
        if x != y and (x in tiled or y in tiled):
            return False
    return True


def _covered(refs, name: str, ix, tiled) -> bool:
    for n, i in refs:
        if n == name and same_region(i, ix, tiled):
            return True
    return False


class Emitter:
    """Emits the nests of a schedule, numbering stored versions of each tensor as it goes."""

    def __init__(self, contractions: list[Contraction], extents: dict[str, int], tensors: dict[str, TensorInfo],
                 overlap: bool = True, inline: bool = True, memo: dict | None = None):
        """``overlap``: double-buffer the global loops that qualify (:mod:`chainexec.planner.pipeline`);
        ``inline``: compute single-use point-wise intermediates where they are read
        (:mod:`chainexec.planner.inline`). ``memo``: what emitters of the same chain, tensors and
        options share (:meth:`_memo`); the planner passes one per
        :class:`~chainexec.planner.schedule.Context`."""
        self.cs = contractions
        self.extents = extents
        self.tensors = tensors
        self.overlap = overlap
        self.inline = inline
        self.memo = {} if memo is None else memo
        self.versions: dict[str, int] = {}

    def _memo(self, key: tuple, make):
        """``make()``, made once per ``key`` for every emitter sharing :attr:`memo`. Fitting tiles
        emits a group's nest after every halving (thousands of times for one group); most of it
        depends on which contractions are fused, not on the tile sizes, or on tiles that halving
        the other level leaves alone. What it returns is shared: callers must not change it."""
        found = self.memo.get(key)
        if found is None:
            found = self.memo[key] = make()
        return found

    def _tiled(self, tiles: dict[str, int], names) -> dict[str, int]:
        return {i: tiles[i] for i in names if i in tiles and tiles[i] < self.extents[i]}

    def _inputs_of(self, name, ix) -> list[tuple[str, list[str]]]:
        """What a computed tensor (``source: {expr}``) used as ``name[ix]`` reads, renamed to ``ix``."""
        t = self.tensors[name]
        rename = dict(zip(t.indices, ix))
        return [(r.tensor, [rename[i] for i in r.indices]) for r in expr.text_refs(t.source["expr"])]

    def _leaves(self, name, ix) -> list[tuple[str, list[str]]]:
        """The stored tensors ``name[ix]`` needs at the global level: itself, or, for a computed
        tensor, what its expression reads (it is made on the device, where it is used; read from
        :meth:`_memo`, the expression parsed once per reference). Callers must not change it."""
        if self.tensors[name].computed():
            return self._memo(("leaves", name, tuple(ix)), lambda: [
                leaf for n, i in self._inputs_of(name, ix) for leaf in self._leaves(n, i)])
        return [(name, list(ix))]

    def _loads(self, refs, tiled: set[str], alone=(), present=()) -> tuple[list[Op], list[Op]]:
        """(alloc+load ops, free ops) bringing ``refs`` to the global level inside loops that tile
        ``tiled``: one buffer per tensor and region — a reference whose region equals that of one
        loaded before it (:func:`same_region`) shares its buffer (every reference here reads the
        same stored version). Tensors in ``alone`` never share (one the nest also writes); leaves
        in ``present`` are whole in the global array already (a single contraction's resident
        operands, which a computed operand may also read)."""
        at = ("loads", tuple((n, tuple(ix)) for n, ix in refs), tuple(sorted(tiled)), tuple(sorted(alone)),
              tuple((n, tuple(ix)) for n, ix in present))
        kept = self._memo(at, lambda: self._load_leaves(refs, tiled, alone, present))
        loads = [op for n, ix in kept
                 for op in (_ref("alloc", "global", n, ix), _ref("load", "global", n, ix, self.versions.get(n, 0)))]
        return loads, [_ref("free", "global", n, ix) for n, ix in kept]

    def _load_leaves(self, refs, tiled: set[str], alone, present) -> list[tuple[str, list[str]]]:
        """The buffers :meth:`_loads` brings: (tensor, indices) of each leaf whose region no
        buffer loaded before it covers."""
        kept: list[tuple[str, list[str]]] = []
        for name, ix in refs:
            for leaf in self._leaves(name, ix):
                shared = leaf in kept or leaf in present or leaf[0] not in alone and _covered(kept, *leaf, tiled)
                if not shared:
                    kept.append(leaf)
        return kept

    def _fetches(self, refs, tiled: set[str], live=(), alone=(), held=frozenset()) -> tuple[list[Op], list[Op]]:
        """(fetch ops, free ops) bringing ``refs`` to the device inside loops that tile ``tiled``:
        get each, or get a computed tensor's expression inputs, evaluate it and free them. A
        reference whose region equals that of a live device buffer of the same tensor — one in
        ``live`` or fetched before it here — reuses that buffer. Tensors in ``alone`` never share;
        tensors in ``held`` are on the device already over a region containing any of theirs.

        Which buffers those are is shared between emitters (:meth:`_memo`): a fused group's
        fetches are worked out again for every halving of its tiles, nearly always alike."""
        at = ("fetches", tuple((n, tuple(ix)) for n, ix in refs), tuple(sorted(tiled)),
              tuple((n, tuple(ix)) for n, ix in live), tuple(sorted(alone)), tuple(sorted(held)))
        fetch, free = self._memo(at, lambda: tuple(map(tuple, self._fetched(refs, tiled, live, alone, held))))
        return [_ref(op, "device", n, ix) for op, n, ix in fetch], [_ref("free", "device", n, ix) for n, ix in free]

    def _fetched(self, refs, tiled: set[str], live, alone, held) -> tuple[list[tuple], list[tuple]]:
        """:meth:`_fetches` as (statement, tensor, indices) of each fetch and (tensor, indices)
        of each free, all tuples (kept in the memo, they hold nothing the garbage collector
        walks)."""
        live = list(live)
        fetch: list[tuple] = []
        free: list[tuple] = []
        for name, ix in refs:
            if name in held or (name, list(ix)) in live or (name not in alone and _covered(live, name, ix, tiled)):
                continue
            if self.tensors[name].computed():
                inputs, done = self._fetched(self._inputs_of(name, ix), tiled, live, alone, held)
                fetch += inputs + [("alloc", name, tuple(ix)), ("eval", name, tuple(ix))] + [
                    ("free", n, i) for n, i in done]
            else:
                fetch += [("alloc", name, tuple(ix)), ("get", name, tuple(ix))]
            live.append((name, list(ix)))
            free.append((name, tuple(ix)))
        return fetch, free

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
        return [Nest(g.contractions, pipeline.arrange(self.disk_group(g), self.extents, self.overlap))
                for g in schedule.groups]

    def needed_after(self, k: int) -> set[str]:
        """Tensors some contraction after position k reads or accumulates into, and outputs."""
        return self._memo(("needed_after", k), lambda: self._needed_after(k))

    def _needed_after(self, k: int) -> set[str]:
        needed = {t.name for t in self.tensors.values() if t.role == "output"}
        for c in self.cs[k + 1:]:
            needed.update(n for n, _ in c.operands())
            if c.accumulate:
                needed.add(c.out)
        return needed

    def writers(self, ids: list[int]) -> dict[str, list[str]]:
        """Tensors written in a sub-chain, with the index names of their first writer there."""
        return self._memo(("writers", tuple(ids)), lambda: self._writers(ids))

    def _writers(self, ids: list[int]) -> dict[str, list[str]]:
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
            reads = {n for n, _ in c.operands()}
            later = {self.cs[j].out for j in ids if j > k}
            if reads & later - written:
                return False
            if c.accumulate and c.out not in written and any(c.out in {n for n, _ in self.cs[j].operands()}
                                                              for j in ids):
                return False
            written.add(c.out)
        common = set(self.group_common(ids))
        exported = set(self.writers(ids)) & self.needed_after(ids[-1])
        if not all(common - set(self.cs[k].out_indices) <= set(self.cs[k].indices())
                   for k in ids if self.cs[k].out in exported):
            return False
        # A tensor summed over a fused index holds a partial sum until the fused loop ends: nothing
        # in the sub-chain may read it.
        partial = {self.cs[k].out for k in ids if (common - set(self.cs[k].out_indices)) & set(self.cs[k].indices())}
        return not any(partial & {n for n, _ in self.cs[k].operands()} for k in ids)

    def group_common(self, ids: list[int]) -> list[str]:
        """The fused loops of a sub-chain. A linear chain (each contraction reads the previous
        one's output) uses the paper's Common (:func:`common_indices`). Otherwise: the indices of
        every tensor written there — or, when that is empty (the chain ends in a reduction), of
        every tensor kept inside it, less the indices of the tensors it exports (each of those then
        lacks every fused index, and is summed over the fused loop as a whole). Either way minus
        any index that a reference to a tensor written there renames (a permuted read needs the
        whole range of the positions it permutes)."""
        return self._memo(("group_common", tuple(ids)), lambda: self._group_common(ids))

    def _group_common(self, ids: list[int]) -> list[str]:
        cs = [self.cs[k] for k in ids]
        writers = self.writers(ids)
        if all(p.out in {n for n, _ in q.operands()} for p, q in zip(cs, cs[1:])) and \
                len({c.out for c in cs}) == len(cs):
            order = common_indices(cs, self.extents)
        else:
            common = set.intersection(*[set(ix) for ix in writers.values()])
            if not common:
                after = self.needed_after(ids[-1])
                inner = [set(ix) for t, ix in writers.items() if t not in after]
                common = set.intersection(*inner) if inner else set()
                common -= {i for t, ix in writers.items() if t in after for i in ix}
            order = [i for i in next(iter(writers.values())) if i in common]
        renamed = {i for c in cs for name, ix in c.operands() + [(c.out, c.out_indices)] if name in writers
                   for pair in zip(ix, writers[name]) if pair[0] != pair[1] for i in pair}
        return [i for i in order if i not in renamed]

    def disk_group(self, group: DiskGroup) -> list:
        """Device groups in order. A tensor that one device group writes and a later one uses
        stays in the global array between them (allocated before its first writer, stored after
        its last use if it is needed after the group, then freed); nothing else moves to disk.
        A tensor needed after the group that lacks an index the group's loop tiles is a sum over
        that loop's tiles (:meth:`valid`): it stays in the global array across the whole loop."""
        members = group.contractions
        written = self.writers(members)
        after = self.needed_after(members[-1])
        first, last = {}, {}
        for pos, dg in enumerate(group.groups):
            for k in dg.contractions:
                c = self.cs[k]
                for name in [n for n, _ in c.operands()] + [c.out]:
                    if name in written:
                        first.setdefault(name, pos)
                        last[name] = pos
        tiles = self._tiled(group.tiles, self.group_common(members))
        spanning = self._spanning([n for n in written if n in after], written, tiles)
        kept = {name for name in written if last[name] > first[name] and name not in spanning}
        body: list = []
        for pos, dg in enumerate(group.groups):
            body += [op for name in sorted(kept) if first[name] == pos
                     for op in self._out_alloc(self._first_writer(members, name))]
            body += self.device_group(dg, kept | set(spanning), set(tiles))
            for name in sorted(kept):
                if last[name] == pos:
                    body += (self._store(self._first_writer(members, name)) if name in after
                             else [_ref("free", "global", name, written[name])])
        return self._around(spanning, members, _loop("global", tiles, body))

    def _spanning(self, names, indices: dict[str, list[str]], tiles: dict[str, int]) -> list[str]:
        """The tensors among ``names`` (indices from ``indices``) lacking an index that ``tiles``
        tiles: each is a sum over all tiles of that loop, held in the global array around it."""
        return [n for n in names if set(tiles) - set(indices[n])]

    def _around(self, names, ids: list[int], loop: list) -> list:
        """``loop`` with the global buffers of ``names`` (written in ``ids``) allocated before it
        and stored after it."""
        writers = [self._first_writer(ids, n) for n in names]
        return ([op for c in writers for op in self._out_alloc(c)] + loop
                + [op for c in writers for op in self._store(c)])

    def _first_writer(self, ids: list[int], name: str) -> Contraction:
        return next(self.cs[k] for k in ids if self.cs[k].out == name)

    def device_group(self, group: DeviceGroup, kept: set[str], outer: set[str] = frozenset()) -> list:
        """``outer``: the indices the enclosing disk group's loop tiles."""
        if len(group.contractions) == 1:
            return self.single(self.cs[group.contractions[0]], group, kept, outer)
        return self.fused(group, kept, outer)

    def single(self, c: Contraction, g: DeviceGroup, kept: set[str], outer: set[str] = frozenset()) -> list:
        """One contraction, output-stationary at both levels (module docstring). Operands that are
        the same tensor over the same region share one buffer at each level.

        Shared between emitters (:meth:`_memo`): fitting a disk group's tiles emits all of its
        single contractions after every halving of one of its groups (thousands of times for a
        (T) plan), nearly always as before. The nest depends on the tiles, the
        resident and kept operands, the enclosing loop's indices and the stored versions it loads
        or stores, which are all in the key; storing the output moves its version on, which a
        found nest must do too."""
        stored_before = self.versions.get(c.out, 0)
        named = self._named(c)
        at = ("single", c.id, tuple(g.glob.items()), tuple(g.dev.items()), tuple(g.resident),
              tuple(n in kept for n in named), tuple(sorted(outer)), tuple(self.versions.get(n, 0) for n in named))
        body = self._memo(at, lambda: self._single(c, g, kept, outer))
        if c.out not in kept:
            self.versions[c.out] = stored_before + 1  # as _single's own _store did when it made the nest
        return body

    def _named(self, c: Contraction) -> tuple[str, ...]:
        """The tensors a single contraction's nest names: its output, its operands and what a
        computed operand reads (whose stored versions it loads)."""
        return self._memo(("named", c.id), lambda: tuple(dict.fromkeys(
            [c.out] + [n for n, _ in c.operands()] + [leaf[0] for n, ix in c.operands() for leaf in self._leaves(n, ix)])))

    def _single(self, c: Contraction, g: DeviceGroup, kept: set[str], outer: set[str]) -> list:
        """:meth:`single`, emitted."""
        outs = c.out_indices
        ks = [i for i in c.indices() if i not in outs]
        resident = [(n, ix) for n, ix in c.operands() if n in g.resident and n not in kept]
        streamed = [(n, ix) for n, ix in c.operands() if n not in g.resident and n not in kept]
        alone = {c.out}
        streamed_tiled = set(outer) | set(self._tiled(g.glob, outs)) | set(self._tiled(g.glob, ks))
        device_tiled = streamed_tiled | set(self._tiled(g.dev, outs)) | set(self._tiled(g.dev, ks))
        fetch, done = self._fetches(c.operands(), device_tiled, alone=alone)
        inner = fetch + [Op("compute", "device", contraction=c.id)] + done
        dev_body = [_ref("alloc", "device", c.out, outs), *_loop("device", self._tiled(g.dev, ks), inner),
                    _ref("accumulate", "device", c.out, outs), _ref("free", "device", c.out, outs)]
        held = [leaf for n, ix in resident for leaf in self._leaves(n, ix)]
        loads, unloads = self._loads(streamed, streamed_tiled, alone, held)
        k_body = loads + _loop("device", self._tiled(g.dev, outs), dev_body, parallel=True) + unloads
        stored = c.out not in kept
        out_body = self._out_alloc(c) if stored else []
        out_body += _loop("global", self._tiled(g.glob, ks), k_body)
        if stored:
            out_body += self._store(c)
        loads, unloads = self._loads(resident, set(outer), alone)
        return loads + _loop("global", self._tiled(g.glob, outs), out_body) + unloads

    def fused(self, g: DeviceGroup, kept: set[str], outer: set[str] = frozenset()) -> list:
        """Contractions whose written tensors stay on the device (module docstring): each is
        allocated on the device at its first writer, freed after its last use in the group, and
        only the ones needed later are accumulated to the global level (and stored unless the
        enclosing disk group keeps them).

        Shared buffers: at the global level every reference to one tensor over the same region
        (:func:`same_region` under the global tiles) uses one buffer and one load. On the device,
        references of different contractions whose region is fixed by the fused loops alone (none
        of their indices is tiled by a contraction's own device loop) and equal are fetched once,
        before the first one's loop, and freed after the last one's."""
        ids = g.contractions
        common = self.group_common(ids)
        writers = self.writers(ids)
        exported = self._exported(ids)
        loaded = []
        for c in (self.cs[k] for k in ids):
            for n, ix in c.operands():
                if n not in writers and n not in kept and (n, ix) not in loaded:
                    loaded.append((n, ix))
        global_tiled = set(outer) | set(self._tiled(g.glob, common))
        fused_tiled = global_tiled | set(self._tiled(g.dev, common))
        own = [self._tiled(g.dev, [i for i in self.cs[k].indices() if i not in common]) for k in ids]
        on_device = {leaf[0] for n, ix in loaded for leaf in self._leaves(n, ix) if leaf[0] in g.on_device}
        # Halving a global tile leaves this body alone unless an index becomes tiled.
        at = ("device_body", tuple(ids), tuple(sorted(on_device)), tuple(sorted(fused_tiled)),
              tuple(tuple(t.items()) for t in own))
        dev_body = self._memo(at, lambda: self._device_body(ids, on_device, fused_tiled, own))
        tiles = self._tiled(g.glob, common)
        symmetric = g.symmetric if self.symmetry(g, common, exported, outer) else ()
        spanning = self._spanning([n for n in exported if n not in kept], writers, tiles)
        stored = [name for name in exported if name not in kept and name not in spanning]
        body: list = []
        for name in stored:
            body += self._out_alloc(self._first_writer(ids, name))
        loads, unloads = self._loads(loaded, global_tiled)
        body += loads
        leaves = [leaf for n, ix in loaded for leaf in self._leaves(n, ix) if leaf[0] in on_device]
        ahead, behind = self._fetches(leaves, global_tiled)
        body += ahead
        body += _loop("device", self._tiled(g.dev, common), dev_body, parallel=True, symmetric=symmetric)
        body += behind + unloads
        for name in stored:
            body += self._store(self._first_writer(ids, name))
        return self._around(spanning, ids, _loop("global", tiles, body))

    def _exported(self, ids: list[int]) -> list[str]:
        """The tensors a sub-chain writes that are needed after it, in the order it writes them."""
        return [t for t in self.writers(ids) if t in self.needed_after(ids[-1])]

    def _device_body(self, ids: list[int], on_device: set[str], fused_tiled: set[str],
                     own_tiles: list[dict[str, int]]) -> list:
        """The body of a fused group's parallel loop (:meth:`fused`): ``on_device``, the inputs
        fetched before that loop; ``fused_tiled``, the indices the loops around the body tile;
        ``own_tiles[pos]``, the tiles of the device loop of the group's contraction ``pos``
        over its other indices."""
        cs = [self.cs[k] for k in ids]
        writers = self.writers(ids)
        exported = self._exported(ids)
        last_use = {}
        for pos, c in enumerate(cs):
            for name in [n for n, _ in c.operands()] + [c.out]:
                last_use[name] = pos
        own = [set(tiles) for tiles in own_tiles]
        work = [[(n, ix) for n, ix in c.operands() if n not in writers and n not in on_device] for c in cs]
        # a computed operand's inputs are fetched where it is made: they share buffers across
        # contractions as the operands do (t2's tiles that W's terms and V's pair sums read)
        leaves = [[leaf for n, ix in refs for leaf in self._leaves(n, ix) if leaf[0] not in on_device] for refs in work]
        held = self._held(leaves, own, fused_tiled)
        dev_body: list = []
        live: set[str] = set()
        holding: list[tuple[str, list[str]]] = []
        for pos, c in enumerate(cs):
            if c.out not in live:
                dev_body.append(_ref("alloc", "device", c.out, writers[c.out]))
                live.add(c.out)
            for ref, first, _ in held:
                if first == pos:
                    dev_body += self._fetches([ref], fused_tiled, holding, held=on_device)[0]
                    holding.append(ref)
            fetch, done = self._fetches(work[pos], fused_tiled | own[pos], holding, held=on_device)
            step = fetch + [Op("compute", "device", contraction=c.id)] + done
            dev_body += _loop("device", own_tiles[pos], step)
            for ref, _, last in held:
                if last == pos:
                    dev_body.append(_ref("free", "device", *ref))
                    holding.remove(ref)
            for name in sorted(live):
                if last_use[name] == pos and name not in exported:
                    dev_body.append(_ref("free", "device", name, writers[name]))
                    live.discard(name)
        for name in exported:
            dev_body += [_ref("accumulate", "device", name, writers[name]), _ref("free", "device", name, writers[name])]
        if self.inline:
            dev_body = inline.fuse(dev_body, self.cs, self.tensors, fused_tiled)
        return dev_body

    def symmetry(self, g: DeviceGroup, common: list[str], exported: list[str], outer: set[str] = frozenset()) -> bool:
        """Whether the group's parallel loop visits only ordered tile tuples of ``g.symmetric``.

        Exact when every tensor the group exports is an output summed over those indices and
        declared symmetric in them: its summand summed over the rest is then equal on every
        permutation of a tile tuple, so one ordered tuple weighted by its multiplicity stands for
        all of them (the i ≥ j ≥ k restriction of (T), as in PySCF's and the reference's loops).
        Needs the device tiles of those indices equal and no enclosing loop tiling them (the
        group's global loop, a disk group's loop), so that they all range over the whole extent."""
        sym = set(g.symmetric)
        if not sym or not sym <= set(common) or sym & (set(outer) | set(self._tiled(g.glob, common))) or not exported:
            return False
        if not all(set(self.tensors[t].symmetric) == sym and not sym & set(self.tensors[t].indices)
                   for t in exported):
            return False
        tiles = self._tiled(g.dev, common)
        return sym <= set(tiles) and len({tiles[i] for i in sym}) == 1

    @staticmethod
    def _held(work, own, tiled: set[str]) -> list[tuple[tuple[str, list[str]], int, int]]:
        """Device references of a fused group kept on the device across contractions: (the first
        reference of a class, first and last position using it) for every class of references
        whose region is set by the fused loops alone (no index in their contraction's own tiled
        set ``own[pos]``) and equal (:func:`same_region` under ``tiled``), used at two positions
        or more."""
        classes: list[list] = []
        for pos, refs in enumerate(work):
            for name, ix in refs:
                if set(ix) & own[pos]:
                    continue
                found = next((k for k in classes if k[0][0] == name and same_region(k[0][1], ix, tiled)), None)
                if found is None:
                    classes.append([(name, list(ix)), pos, pos])
                else:
                    found[2] = pos
        return [(ref, first, last) for ref, first, last in classes if last > first]
