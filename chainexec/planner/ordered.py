"""Full reductions in a symmetric loop summed over ordered elements of its diagonal tiles (pure).

A symmetric loop (:attr:`chainexec.planner.plan.Loop.symmetric`) visits the tile tuples
``p_i ≤ p_j ≤ p_k`` of its indices only, each weighted by the number of distinct permutations of
its positions (6, 3 or 1), because the outputs accumulated in its body are sums of a summand
``e(i, j, k)`` (summed over every other index) that is symmetric in them (the outputs'
``symmetric`` declarations, :meth:`chainexec.planner.nest.Emitter.symmetry`). That is exact, but
on a tile whose positions are equal (``p_i = p_j``, or all three) it still sums every element of
the tile: on the diagonal tile ``T × T × T`` each value of ``e`` is added up to six times where
once, weighted, would do. Within such a tile, for a group of ``g`` indices sharing one tile,

    Σ_{x ∈ T^g} e(x) = Σ_{x_1 ≤ … ≤ x_g} m(x) · e(x),   m(x) = g! / Π (multiplicities of x's values)!

(``m`` is the number of distinct permutations of ``x``; elementwise the same argument as the
loop's, one level down). So on a tile with a pattern of equal positions
(:func:`chainexec.planner.symmetry.patterns`), a full reduction sums only the points whose values
are non-decreasing within each group of equal positions, weighted by the product of the groups'
``m``: :func:`weights`. At benzene's (T) sizes (o = 21, tiles of 6) the energy's points fall from
Σ over ordered tile tuples of the tile's volume, 2,997 occupied triples (times v³), to 1,771, the
``i ≤ j ≤ k`` triples PySCF's loop visits (``C(o + 2, 3)``). Done with weights, not a different
loop: the weights are an input the reduction multiplies by, and the GPU's orbit kernel skips the
thread blocks whose weight is zero (:func:`chainexec.runtime.pointwise.orbit_source`).

The planner marks such a statement (:attr:`chainexec.planner.plan.Op.ordered`, :func:`mark`):
a ``fused`` statement into a scalar output declared symmetric in the loop's indices, every
contraction it stands for ranging over all of them, with no loop between the symmetric loop and
the statement cutting them (the statement's ranges of the symmetric indices are the loop's
tiles). The cost model counts its flops at the ordered points (:func:`points`), the executor
counts the same and hands the groups to the backend (:func:`groups`); the bytes it reads are
priced whole, as the executor counts them. The counted flops are the work the GPU's orbit kernel
does (it skips the other points); the NumPy backend and the plain reduction kernel evaluate every
point and multiply by the weight, so for them the count is the work the plan asks for, not the
work done.

Its input then matters at the ordered elements only. A symmetrized run
(:mod:`chainexec.planner.symmetry`) whose output only such reductions read, each at the element
it sums (the symmetric indices in the buffer's own positions), is marked too (:func:`keeps`): on
a tile with equal positions its in-place symmetrization reads the whole tile but writes only the
ordered elements, which leaves the others holding the run's partial sums. On a (T) diagonal tile
``i = j = k`` that writes 56 of 216 occupied triples (at tiles of 6), on one with two equal
positions 21 of 36 pairs.
"""

from __future__ import annotations



from chainexec import expr
from chainexec.planner.plan import Contraction, Loop, TensorInfo, ops


def applies(op, loops: list[Loop], contractions: list[Contraction], tensors: dict[str, TensorInfo]) -> bool:
    """Whether ``op`` (with ``loops`` around it, outermost first) may sum ordered elements only:
    a fused full reduction in a symmetric loop, into an output declared symmetric in the loop's
    indices, every contraction of it over all of them, no loop inside the symmetric one tiling
    them."""
    at = next((n for n, loop in enumerate(loops) if loop.symmetric), None)
    if op.op != "fused" or at is None or op.indices or not op.group:
        return False
    sym = set(loops[at].symmetric)
    if set(tensors[op.tensor].symmetric) != sym:
        return False
    if any(sym & set(loop.tiles) for loop in loops[at + 1:]):
        return False
    return all(sym <= set(contractions[k].indices()) for k in op.group)


def keeps(body: list, start: int, symmetric: list[str], contractions: list[Contraction]) -> bool:
    """Whether the symmetrized run starting at ``body[start]`` (in a loop over ordered tiles of
    ``symmetric``) may symmetrize its output at the ordered elements only: every other statement
    of ``body`` naming the output (loops inside included) is its allocation or release, a term
    writing it without reading it, or a reduction marked ordered (:func:`applies`) that reads it
    with the symmetric indices where the buffer has them, also through its reused values (read
    with the symmetric indices in place); at least one such reduction."""
    c = contractions[body[start].contraction]
    out, held = c.out, c.out_indices
    readers = 0
    for op, _ in ops(body):
        if op.op in ("alloc", "free") and op.tensor == out:
            continue
        if op.op == "compute":
            t = contractions[op.contraction]
            if out in (t.a, t.b) or (t.out == out and [i for i in t.out_indices if i in symmetric]
                                     != [i for i in held if i in symmetric]):
                return False
            continue
        if op.op == "fused":
            f = op.expression
            refs = [r for r in f.leaves if r.tensor == out]
            if op.tensor == out or (refs and not op.ordered):
                return False
            if any(r.indices[n] != i for r in refs for n, i in enumerate(held) if i in symmetric):
                return False
            lets = {name: own for name, own, _ in f.lets}
            if any(r.indices[n] != i for r in expr.refs(f.tree) if r.tensor in lets
                   for n, i in enumerate(lets[r.tensor]) if i in symmetric):
                return False  # a reused value read at other symmetric positions than its own
            readers += bool(refs)
            continue
        if op.tensor == out:
            return False
    return readers > 0


def mark(nests, contractions: list[Contraction], tensors: dict[str, TensorInfo]) -> None:
    """Set :attr:`chainexec.planner.plan.Op.ordered` on every statement :func:`applies` to, then
    on the first statement of every symmetrized run that :func:`keeps` the ordered elements, in
    place."""

    def walk(body, loops):
        for node in body:
            if isinstance(node, Loop):
                walk(node.body, loops + [node])
            elif applies(node, loops, contractions, tensors):
                node.ordered = True

    def runs(body, loops):
        sym = next((loop.symmetric for loop in loops if loop.symmetric), [])
        for k, node in enumerate(body):
            if isinstance(node, Loop):
                runs(node.body, loops + [node])
            elif sym and node.op == "compute" and node.symmetrized and keeps(body, k, sym, contractions):
                node.ordered = True

    for nest in nests:
        walk(nest.body, [])
        runs(nest.body, [])
