"""The statements that compute on device tiles, and what each counts.

A contraction or a run of terms into one buffer (:attr:`Op.run`), a fused statement
(:mod:`chainexec.planner.inline`) and a computed tensor's evaluation run on the device buffers of
the current tiles (:meth:`Buffers.view`) through the :class:`Backend`. Each counts its flops,
statements and streamed bytes (those it reads and writes in device memory) as the cost model
prices it (:func:`chainexec.planner.cost.predict_nests`), so measured equals predicted."""

from __future__ import annotations

from dataclasses import replace

from chainexec import expr, ordering
from chainexec.planner.plan import Op, Plan, pattern_key, pattern_of_key
from chainexec.runtime.accounting import Counters
from chainexec.runtime.buffers import Buffers
from chainexec.runtime.device import Backend
from chainexec.runtime.frame import Frame
from chainexec.runtime.region import box_shape


class Compute:
    """Runs compute statements on the device tiles of a frame and counts them."""

    def __init__(self, plan: Plan, backend: Backend, buffers: Buffers, counters: Counters):
        self.plan = plan
        self.backend = backend
        self.buffers = buffers
        self.counters = counters
        self.gathers: dict[tuple, tuple] = {}  # packs' and unpacks' gather positions per tile (_gather)
        self.prepared: set[tuple] = set()  # statements (and the tile shapes) whose kernels are ready (_prepare)

    def eval(self, op: Op, frame: Frame) -> None:
        """Fill a computed tensor's device tile from its expression's inputs (already on the device)."""
        t = self.plan.tensors[op.tensor]
        tree = expr.parse(t.source["expr"])
        rename = dict(zip(t.indices, op.indices))
        arrays = {r: self.buffers.view(r.tensor, [rename[i] for i in r.indices], frame) for r in expr.refs(tree)}
        out = self.buffers.view(op.tensor, op.indices, frame)
        self.backend.evaluate(tree, arrays, tuple(t.indices), out)
        self.counters.streamed += out.nbytes + sum(a.nbytes for a in arrays.values())

    def fused(self, op: Op, frame: Frame) -> None:
        """A fused statement (:mod:`chainexec.planner.inline`): its inlined intermediates are
        computed where they are read, from the buffers on the device; counted as the cost model
        does (the flops and statements of its contractions, its output twice and each distinct
        reference once)."""
        args = self._fused_args(op, frame, self.buffers.view)
        if frame.shapes:  # elsewhere a fused statement's one kernel compiles as it launches
            self._prepare(("fused", op.tensor, tuple(op.group)), frame, lambda at: self.backend.fused_kernels(
                *self._fused_args(op, at, lambda t, i, tile: self.buffers.stand_in(t, i, tile, frame))))
        self.backend.fused(*args)
        self.counters.watch()
        arrays, out = args[1], args[3]
        self._count([self.plan.contractions[k] for k in op.group], frame, self._within(op, frame))
        self.counters.streamed += 2 * out.nbytes + sum(a.nbytes for a in arrays.values())

    @staticmethod
    def _within(op: Op, frame: Frame) -> tuple[tuple[str, ...], ...]:
        """The groups of indices whose ordered elements alone a fused statement sums at ``frame``'s
        tile: every symmetric index in a group, those of one too, so that the weights span the same
        dimensions in every tile tuple of one tile shape, and so does the kernel that reads them."""
        return frame.equal_tiles(ones=True) if op.ordered else ()

    def _fused_args(self, op: Op, frame: Frame, view) -> tuple:
        """:meth:`Backend.fused`'s arguments for fused statement ``op`` at ``frame``'s tile, each
        array ``view(tensor, indices, frame)``: :meth:`Buffers.view`, or a stand-in
        (:meth:`Buffers.stand_in`)."""
        f = op.expression
        return (f, {r: view(r.tensor, r.indices, frame) for r in f.leaves},
                box_shape(frame.region("device", f.domain)), view(op.tensor, op.indices, frame),
                ordering.dims(self._within(op, frame), f.domain))

    def _prepare(self, statement: tuple, frame: Frame, kernels_at, shape: tuple = ()) -> None:
        """Make ready together (:meth:`Backend.precompile`) the kernels ``statement`` needs at
        one tile of each shape of the symmetric device loop being run (:attr:`Frame.shapes`), at
        the first tile it runs on: ``kernels_at(frame)`` lists them at a frame of such a tile.
        Elsewhere those of the current tile, once per tile ``shape``. Why: each tile shape's
        kernels would otherwise compile one after another as its first tile meets them."""
        key = (statement, frame.shapes or shape)
        if key in self.prepared:
            return
        self.prepared.add(key)
        at = [frame]
        if frame.shapes:
            at = []
            for ranges in frame.shapes:
                tile = frame.inner()
                tile.ranges["device"].update(ranges)
                at.append(tile)
        self.backend.precompile([k for tile in at for k in kernels_at(tile)])

    def run(self, run: list[Op], frame: Frame) -> None:
        """One contraction, or a run of terms into one buffer (:attr:`Op.run`): point-wise terms
        in one point-wise kernel, contractions in one sum kernel. A run with an
        :attr:`Op.schedule`, on a tile that permutations of its output's indices map onto
        themselves (:meth:`_orbits`): one term per orbit into ``out`` (zero: the planner marks
        only runs into a buffer allocated just before them), then ``out`` = Σ of its permuted
        views, in place; counted as the cost model prices it. A run that writes its buffer first
        (:attr:`Op.fresh`) is ``fresh`` to the backend."""
        cs = [self.plan.contractions[op.contraction] for op in run]
        out = self.buffers.view(cs[0].out, cs[0].out_indices, frame)
        operands = [(self.buffers.view(c.a, c.a_indices, frame),
                     self.buffers.view(c.b, c.b_indices, frame) if c.b is not None else None) for c in cs]
        orbits = self._orbits(run, frame) if run[0].schedule is not None else None
        if orbits is not None:
            terms, axes = orbits
            cs = [replace(cs[k], factor=cs[k].factor * scale) for k, scale in terms]
            operands = [operands[k] for k, _ in terms]
        fresh = bool(run[0].fresh)
        if cs[0].pairs:
            self.backend.gather(out, operands[0][0], *self._gather(cs[0], frame), cs[0].factor, fresh)
        elif len(cs) == 1:
            self.backend.contract(cs[0], out, *operands[0], fresh)
        elif cs[0].pointwise():
            self.backend.contract_terms(cs, out, operands, fresh)
        else:
            self.backend.contract_sum(cs, out, operands, fresh)
        # tile-sized reads and writes, the cost model's rule (cost._run_tails): the output read
        # and written once per term, once for a point-wise run
        moved = 2 * (1 if cs[0].pointwise() else len(cs)) * out.nbytes
        if orbits is not None:  # out read once more, and written where it is kept
            keep = frame.equal_tiles() if run[0].ordered else ()  # only ordered reductions read it
            self._prepare(("run", run[0].contraction), frame, lambda at: self.backend.symmetrize_kernels(
                self.buffers.stand_in(cs[0].out, cs[0].out_indices, at, frame),
                self._symmetrizations(run, at, cs[0].out_indices)), out.shape)
            self.backend.symmetrize(out, axes, ordering.dims(keep, cs[0].out_indices))
            moved += out.nbytes + out.itemsize * ordering.points(dict(zip(cs[0].out_indices, out.shape)), keep)
        self.counters.watch()
        self._count(cs, frame)
        self.counters.streamed += moved + sum(x.nbytes for pair in operands for x in pair if x is not None)

    def _count(self, cs, frame: Frame, within: tuple[tuple[str, ...], ...] = ()) -> None:
        """The statements and flops of contractions run on the device tiles of ``frame``;
        ``within``: the groups of indices whose ordered elements alone are summed
        (:func:`chainexec.ordering.points`)."""
        self.counters.statements += len(cs)
        for c in cs:
            sizes = {i: b - a for i, (a, b) in zip(c.space(), frame.region("device", c.space()))}
            self.counters.flops += (2 if c.b is not None else 1) * ordering.points(sizes, within)

    def _gather(self, c, frame: Frame) -> tuple:
        """How a pack or unpack (:attr:`Contraction.pairs`) gathers its output tile from its
        operand (:meth:`Backend.gather`'s arguments after the arrays): the order of the operand's
        axes that puts a pack's members side by side (None: as they are), the axis to take along,
        which positions to take (``("unpack", pair start, member ranges)``: each member pair's
        position in the pair index; ``("pack", pair range, member starts and extent)``: each
        pair's position in the two member axes merged), and the order of the result's axes that
        gives the output's (None: as they are). Made once per tile, from the device ranges of
        ``frame``."""
        (pair, members), = c.pairs.items()
        ranges = tuple(frame.range("device", i) for i in (pair, *members))
        k = (c.id, ranges)
        found = self.gathers.get(k)
        if found is None:
            (k0, k1), (r0, r1), (s0, s1) = ranges
            if pair in c.a_indices:  # unpack: the operand holds the pair whole
                axis = c.a_indices.index(pair)
                made = c.a_indices[:axis] + members + c.a_indices[axis + 1:]
                found = (None, axis, ("unpack", k0, r0, r1, s0, s1), _order(made, c.out_indices))
            else:  # pack: the operand holds the members whole
                axis = c.out_indices.index(pair)
                wanted = c.out_indices[:axis] + members + c.out_indices[axis + 1:]
                found = (_order(c.a_indices, wanted), axis, ("pack", k0, k1, r0, s0, s1), None)
            self.gathers[k] = found
        return found

    @staticmethod
    def _symmetrizations(run: list[Op], frame: Frame, indices: list[str]) -> list[tuple]:
        """(axes, keep) of the symmetrization of each pattern of equal tile positions in the run's
        :attr:`Op.schedule` that a tile of this one's extents can have (those sharing a tile are
        of one extent), ``keep`` over the output's ``indices``: what the run's tiles of this shape
        symmetrize by, made ready together (:meth:`_prepare`)."""
        sym = frame.symmetric or []
        extent = {i: b - a for i, (a, b) in zip(sym, frame.region("device", sym))}
        found = []
        for key, taken in run[0].schedule.items():
            groups = ordering.groups(sym, pattern_of_key(key))
            if taken is not None and all(len({extent[i] for i in g}) == 1 for g in groups):
                found.append((tuple(map(tuple, taken[1])), ordering.dims(groups, indices) if run[0].ordered else ()))
        return found

    def _orbits(self, run: list[Op], frame: Frame) -> tuple | None:
        """The terms a symmetrized run runs on this tile (position, factor scale) and the axis
        permutations its output is summed over (:attr:`Op.schedule` of its first statement, at
        this tile's pattern), or None where this tile runs every term."""
        taken = run[0].schedule[pattern_key(frame.pattern())]
        return None if taken is None else (taken[0], tuple(map(tuple, taken[1])))


def _order(have: list[str], want: list[str]) -> tuple[int, ...] | None:
    """The axes of an array over ``have`` in the order ``want`` (None where they are so)."""
    order = tuple(have.index(i) for i in want)
    return None if order == tuple(range(len(order))) else order
