"""Point-wise producers inlined into the one statement that reads them (pure).

In a fused group's device body (:meth:`chainexec.planner.nest.Emitter.fused`) every intermediate
has a device buffer, and every statement is one pass over its tile. The (T) epilogue is a chain of
such passes over 6-D tiles: ``V`` (twelve outer products), ``Z = W + V/2``, ``R`` (six permuted
reads of ``Z``), the denominator ``Dinv``, ``Dinv·R`` and ``E = Σ W·(Dinv·R)/3``. Each written once
and read once, ``V``, ``R``, ``Dinv·R`` and ``Dinv`` need not exist at all: their values can be
computed where they are read. This is the producer–consumer fusion of array compilers (XLA's
"loop fusion", TVM's injective operators inlined into their consumer), applied only where it
repeats no work:

- an intermediate is inlined when every statement writing it is a point-wise term (it sums over
  nothing) at this body's top level, nothing else touches it (one buffer; no transfer, no inner
  loop), and exactly one reference reads it, after its last writer, in a term over its own
  indices (read broadcast along others, it would be made again for each); a computed tensor
  (``source: {expr}``) evaluated here and read once likewise;
- where the reference renames the producer's indices (``Z[i,j,k,b,c,a]``), the renamed positions
  are tiled by no loop around the body, so the renamed reads stay inside the tiles already on
  the device (as the unfused statement's permuted read did);
- the statement reading it becomes one ``fused`` statement when it is a run of point-wise terms
  (its output written once per element) or a single contraction to a scalar (a full reduction,
  summed in the kernel), no statement involved reads a scalar (``E[]``) and the statement does
  not read its own output (at another position it would race with its own writes); producers
  inlined into an inlined producer come along;
- buffers it reads that were freed between the first statement it replaces and itself are freed
  after it (after the last such fused statement, when several read one buffer); nothing in
  between may write them or allocate one of them again.

``Z`` is read six times, at six permutations: inlined into each read it would be computed six
times per element. A full reduction may still take it, as a *reused* value (``Op.lets``,
:attr:`Fused.lets`): an intermediate made by point-wise terms (as above) that one run reads at
several permutations of its own indices, renaming untiled ones only, is computed once per element
and read at each permutation. On the GPU the reduction's blocks of the permuted indices go to
thread blocks by orbit under those permutations, each computing the reused values of its blocks
into shared memory first (:func:`chainexec.runtime.pointwise.orbit_reduce`); on the CPU the value is
one temporary array. Runs are visited last to first so that a reduction takes its reused producer
before the producer's own run could become a fused statement; one level of reuse only (a reused
value's producer reads none). In (T) the epilogue becomes one statement over ``W``: ``Z``'s buffer
and its two passes (made, then read six times) are gone. The multi-level paper (Section 3; cited
in ``docs/architecture.md``) keeps a fused producer's
tile in the fastest memory level; here a producer of the device level moves one level further
down, into the registers of the statement that uses it.

The fused statement's value is a :mod:`chainexec.expr` expression over the buffers it reads
(:class:`Fused`): both backends and the cost model read it from there. Its flops and statements
are those of the contractions it stands for, so rates stay comparable with the unfused plan; the
bytes it streams are those of its output and of each distinct reference it reads.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from chainexec import expr

from .plan import Contraction, Fused, Loop, Op, TensorInfo, ops, term_run

MOVED = 3
"""Most indices a reused value's reads may permute: the orbit kernel
(:func:`chainexec.runtime.pointwise.orbit_reduce`) lists every tuple of blocks, ``blocks**MOVED``
of them (125,000 at v=400 in blocks of 8); for four the list alone takes seconds and gigabytes at
an extent of 100."""


def _renamed(text: str, rename: dict[str, str]) -> str:
    """A computed tensor's expression with its index names replaced (all at once)."""
    tree = expr.parse(text)

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.Name:
            return ast.Name(rename.get(node.id, node.id), node.ctx)

        def visit_Subscript(self, node: ast.Subscript) -> ast.Subscript:
            return ast.Subscript(node.value, self.visit(node.slice), node.ctx)

    return ast.unparse(Rename().visit(ast.parse(ast.unparse(tree), mode="eval")).body)


def expression(op: Op, cs: list[Contraction], tensors: dict[str, TensorInfo]) -> Fused:
    """The :class:`Fused` form of a ``fused`` statement (its ``group`` and ``inlined``)."""
    group = [cs[k] for k in op.group]
    writers = {name: [c for c in group if c.out == name] for name in op.inlined}
    lets = op.lets or []
    inlined = set(op.inlined) - set(lets)

    def operand(name: str, ix: list[str]) -> str:
        if name not in inlined:
            return f"{name}[{','.join(ix)}]"
        t = tensors[name]
        if t.computed():
            return f"({_renamed(t.source['expr'], dict(zip(t.indices, ix)))})"
        terms = writers[name]
        rename = dict(zip(terms[0].out_indices, ix))
        return f"({' + '.join(term(c, rename) for c in terms)})"

    def term(c: Contraction, rename: dict[str, str]) -> str:
        parts = [repr(float(c.factor))] + [operand(n, [rename.get(i, i) for i in ix]) for n, ix in c.operands()]
        return " * ".join(parts)

    roots = [c for c in group if c.out == op.tensor]
    reduce = not roots[0].out_indices and not roots[0].pointwise()
    domain = tuple(roots[0].indices()) if reduce else tuple(roots[0].out_indices)
    text = " + ".join(term(c, {}) for c in roots)
    defs = tuple((name, tuple(writers[name][0].out_indices), " + ".join(term(c, {}) for c in writers[name]))
                 for name in lets)
    return Fused(op.tensor, tuple(roots[0].out_indices), domain, text, reduce, defs)


@dataclass
class _Run:
    """A run of top-level compute statements into one buffer: body positions and contractions."""

    positions: list[int]
    terms: list[Contraction]

    @property
    def out(self) -> str:
        return self.terms[0].out


def fuse(body: list, cs: list[Contraction], tensors: dict[str, TensorInfo], tiled: set[str]) -> list:
    """``body`` (a device loop body) with its single-use point-wise producers inlined (module
    docstring); ``tiled``: the indices that loops around the body tile. Returns ``body`` itself
    when nothing qualifies."""
    runs: list[_Run] = []
    deep: set[str] = set()
    touched: dict[str, list[Op]] = {}
    k = 0
    while k < len(body):
        node = body[k]
        if isinstance(node, Loop):
            for inner, _ in ops(node.body):
                deep.update(_names(inner, cs))
            k += 1
            continue
        if node.op == "compute":
            n = term_run(body, k, cs)
            runs.append(_Run(list(range(k, k + n)), [cs[body[j].contraction] for j in range(k, k + n)]))
            k += n
            continue
        touched.setdefault(node.tensor, []).append(node)
        k += 1
    reads: dict[str, list[tuple[int, list[str], Contraction]]] = {}
    for r, run in enumerate(runs):
        for c in run.terms:
            for name, ix in c.operands():
                reads.setdefault(name, []).append((r, ix, c))
    writer = {}
    for r, run in enumerate(runs):
        writer.setdefault(run.out, []).append(r)
    evals = {name: [k for k, node in enumerate(body) if isinstance(node, Op) and node.op == "eval"
                    and node.tensor == name] for name in reads}

    def made(name: str) -> list[Contraction] | None:
        """The point-wise terms making ``name``, an intermediate only they and its reads touch."""
        if tensors[name].role == "output" or name not in writer:
            return None
        terms = [c for r in writer[name] for c in runs[r].terms]
        ops_on = sorted(node.op for node in touched.get(name, []))
        return terms if ops_on == ["alloc", "free"] and all(c.pointwise() for c in terms) else None

    def candidate(name: str) -> bool:
        if name in deep or len(reads.get(name, [])) != 1 or not tensors[name].indices:
            return False
        reader, ix, c = reads[name][0]
        if set(ix) != set(c.indices()):
            return False  # read broadcast along other indices: inlined, it would be made again for each
        t = tensors[name]
        if t.computed():
            own = next((body[k].indices for k in evals[name]), None)
            return (len(evals[name]) == 1 and name not in writer and own is not None
                    and all(r.indices for r in expr.text_refs(t.source["expr"]))
                    and _renames_untiled(own, ix, tiled))
        terms = made(name)
        return terms is not None and max(writer[name]) < reader and _renames_untiled(terms[0].out_indices, ix, tiled)

    def reused(name: str) -> bool:
        """Read by one run at several permutations of its own indices, untiled ones of one extent
        and at most :data:`MOVED` of them (the orbit kernel's bounds), one read at least permuted."""
        found = reads.get(name, [])
        if name in deep or len(found) < 2 or tensors[name].computed() or (terms := made(name)) is None:
            return False
        own = terms[0].out_indices
        return (_orbit_bounded({name: own}, [(name, ix) for _, ix, _ in found], tensors)
                and all(r == found[0][0] > max(writer[name]) and set(ix) == set(own) == set(c.indices())
                        and _renames_untiled(own, ix, tiled) for r, ix, c in found))

    inlinable = {name for name in reads if candidate(name)}
    reusable = {name for name in reads if reused(name)}

    def fusion(run: _Run, allowed: set[str]) -> tuple | None:
        """The fused statement replacing ``run`` and the producers of ``allowed`` tensors it reads:
        (position, statement, positions it replaces, first of them, tensors it reads), or None."""
        first = run.terms[0]
        closure = _closure(run, allowed, runs, writer, tensors)
        if not closure:
            return None
        if len({tensors[n].dtype for n in closure} | {tensors[run.out].dtype}) > 1:
            return None
        lets = [n for n in tensors if n in closure and n in reusable]
        inner = [runs[r] for n in closure for r in writer.get(n, [])]
        if any(not ix for x in [run] + inner for c in x.terms for _, ix in c.operands()):
            return None  # a scalar operand has no reference in the expression language
        group = sorted(c.id for x in [run] + inner for c in x.terms)
        op = Op("fused", "device", tensor=run.out, indices=list(first.out_indices), group=group,
                inlined=[n for n in tensors if n in closure], lets=lets or None)
        f = op.expression = expression(op, cs, tensors)
        if any(set(own) != set(f.domain) or any(r.tensor in lets for r in expr.text_refs(text))
               for _, own, text in f.lets):
            # a reused value read where another is made (one level of them only), or its indices
            # renamed on the way to the reduction (its value is made over its own names)
            return None
        if lets and not _orbit_bounded({n: own for n, own, _ in f.lets},
                                       [(r.tensor, r.indices) for r in expr.refs(f.tree) if r.tensor in lets], tensors):
            return None  # each value within the orbit kernel's bounds, all of them together not
        leaves = {x.tensor for x in f.leaves}
        if run.out in leaves:
            return None  # it would read its own output, elsewhere than where it writes: a race in one kernel
        own = {p for x in inner for p in x.positions}
        own |= {k for n in closure for k, node in enumerate(body) if isinstance(node, Op)
                and node.tensor == n and node.op in ("alloc", "free", "eval") and node.level == "device"}
        start, stop = min(own), run.positions[0]
        moved = [k for k in range(start, stop) if k not in own and _frees(body[k], leaves)]
        if not _undisturbed(body, start, stop, own, moved, leaves, cs):
            return None
        return stop, op, own | set(run.positions[1:]), start, leaves

    fusions = []
    taken: set[str] = set()  # reused producers a later reduction computes: their runs are in it
    for run in reversed(runs):
        first = run.terms[0]
        pointwise_run = all(c.pointwise() for c in run.terms)
        scalar = len(run.terms) == 1 and not first.out_indices
        if run.out in inlinable or run.out in taken or not (pointwise_run or scalar):
            continue
        found = (scalar and reusable and fusion(run, inlinable | reusable)) or fusion(run, inlinable)
        if found:
            fusions.append(found)
            taken.update(found[1].lets or [])
    if not fusions:
        return body
    removed = set().union(*(f[2] for f in fusions))
    placed = {f[0]: [f[1]] for f in fusions}
    # A buffer freed between a fused statement's first replaced statement and the statement itself
    # is freed after the last fused statement that reads it (two of them may read one buffer).
    for k, node in enumerate(body):
        after = [root for root, _, _, start, leaves in fusions if start <= k < root and _frees(node, leaves)]
        if after and k not in removed:
            removed.add(k)
            placed[max(after)].append(node)
    out: list = []
    for k, node in enumerate(body):
        if k in placed:
            out += placed[k]
        elif k not in removed:
            out.append(node)
    return out


def _orbit_bounded(own: dict[str, tuple[str, ...]], reads: list[tuple[str, tuple[str, ...]]],
                   tensors: dict[str, TensorInfo]) -> bool:
    """Whether reads of reused values (value, indices read), each value over its ``own``
    indices, permute at least one and at most :data:`MOVED` of them altogether, all of one extent:
    the bounds of the one orbit kernel that computes them all."""
    moved = {(name, d) for name, ix in reads for d, (a, b) in enumerate(zip(own[name], ix)) if a != b}
    names = {own[name][d] for name, d in moved}
    extents = {tensors[name].shape[d] for name, d in moved}
    return 0 < len(names) <= MOVED and len(extents) == 1


def _frees(node, tensors: set[str]) -> bool:
    """Whether ``node`` frees a device buffer of one of ``tensors``."""
    return isinstance(node, Op) and node.op == "free" and node.level == "device" and node.tensor in tensors


def _closure(run: _Run, inlinable: set[str], runs: list[_Run], writer: dict, tensors) -> list[str]:
    """The inlinable tensors a run reads, and those their producers read, transitively."""
    found: list[str] = []
    todo = [run]
    while todo:
        for c in todo.pop().terms:
            for name, _ in c.operands():
                if name in inlinable and name not in found:
                    found.append(name)
                    if not tensors[name].computed():
                        todo += [runs[r] for r in writer[name]]
    return found


def _renames_untiled(own, ix, tiled: set[str]) -> bool:
    """Whether reading a buffer made over ``own`` as ``ix`` renames only positions that no loop
    tiles (both names): the renamed read then covers the whole extent, as the buffer does."""
    return len(own) == len(ix) and all(a == b or (a not in tiled and b not in tiled) for a, b in zip(own, ix))


def _undisturbed(body: list, start: int, stop: int, own: set[int], moved: list[int], leaves: set[str],
                 cs: list[Contraction]) -> bool:
    """Whether the buffers a fused statement reads keep, from the first statement it replaces
    (``start``) to where it runs (``stop``), the contents the replaced statements read: nothing
    else there writes them, and no buffer whose ``free`` moves past ``stop`` is allocated again
    before it."""
    freed: set[tuple] = set()
    for k in range(start, stop):
        node = body[k]
        if k in own:
            continue
        if isinstance(node, Loop):
            if any(name in leaves for inner, _ in ops(node.body) for name in _writes(inner, cs)):
                return False
        elif node.op == "compute" and cs[node.contraction].out in leaves:
            return False
        elif node.op == "alloc" and (node.tensor, tuple(node.indices)) in freed:
            return False
        if k in moved:
            freed.add((node.tensor, tuple(node.indices)))
    return True


def _names(op: Op, cs: list[Contraction]) -> set[str]:
    """Tensors a statement touches."""
    if op.op == "compute":
        c = cs[op.contraction]
        return {c.out} | {n for n, _ in c.operands()}
    return {op.tensor}


def _writes(op: Op, cs: list[Contraction]) -> set[str]:
    """Tensors a statement changes."""
    if op.op == "compute":
        return {cs[op.contraction].out}
    return {op.tensor} if op.op in ("alloc", "get", "eval", "load") else set()
