"""Full reductions summed over the ordered elements of a symmetric loop's diagonal tiles
(:mod:`chainexec.planner.ordered`): the weights against sums of symmetric random arrays over the
whole tile, the counts against brute force, which statements the planner marks, and whole NumPy
(T) runs against the independent reference (:func:`chainexec.chem.triples.ccsd_t_energy`) with
every measured count equal to the prediction.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from chainexec import api
from chainexec import ordering
from chainexec.planner import ordered, symmetry
from chainexec.planner.plan import Contraction, Loop, Op, TensorInfo, ops
from tests.conftest import triples_config
from tests.planner.test_symmetry import marked_and_unmarked


def _symmetric(rng, shape, within) -> np.ndarray:
    """A random array symmetric under the permutations of each group of axes (equal extents)."""
    x = rng.standard_normal(shape)
    for g in within:
        perms = []
        for image in itertools.permutations(g):
            axes = list(range(len(shape)))
            for d, e in zip(g, image):
                axes[d] = e
            perms.append(axes)
        x = sum(x.transpose(p) for p in perms)
    return x


@pytest.mark.parametrize("shape,within", [((5, 5, 5, 3), ((0, 1, 2),)), ((4, 4, 6, 2), ((0, 1),)),
                                          ((3, 6, 6), ((1, 2),)), ((4, 4, 3, 3), ((0, 1), (2, 3))),
                                          ((1, 1, 7), ((0, 1),)), ((6, 2), ()), ((4, 4, 4, 4, 2), ((0, 1, 2, 3),))])
def test_weighted_ordered_sum_equals_the_whole_tile(shape, within):
    """Σ weights·x over the tile equals Σ x for arrays symmetric within the groups (1e-13); the
    weights are zero exactly where a group's coordinates decrease, elsewhere the number of
    distinct orders of each group's coordinates (6, 3, 1 for three; 2, 1 for two), and they add
    up to the group's whole cube."""
    rng = np.random.default_rng(len(shape) * 7 + sum(shape))
    x = _symmetric(rng, shape, within)
    w = ordering.weights(shape, within)
    assert np.isclose((w * x).sum(), x.sum(), rtol=1e-13, atol=0)
    full = np.broadcast_to(w, shape)
    for point in itertools.product(*map(range, shape)):
        rising = all(point[g[n]] <= point[g[n + 1]] for g in within for n in range(len(g) - 1))
        # its multiplicity: the distinct orders of each group's coordinates, counted one by one
        orders = math.prod(len(set(itertools.permutations([point[d] for d in g]))) for g in within)
        assert full[point] == (orders if rising else 0)
    grouped = {d for g in within for d in g}
    assert w.sum() == math.prod(shape[d] for d in grouped)


@pytest.mark.parametrize("positions", [(0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 1, 2)])
def test_groups_of_one_give_every_pattern_of_a_tile_shape_one_weights_layout(positions):
    """With the groups of one kept (what the executor hands the backend for an ordered
    reduction), every symmetric index is in a group, so the weights of a 6×6×6 tile span the
    same dimensions whatever positions are equal (one generated kernel per tile shape reads
    them); their values are those of the groups of two or more, broadcast, and the points they
    count are the same."""
    pattern = ordering.pattern_of(list(positions))
    kept = ordering.groups(["i", "j", "k"], pattern, ones=True)
    equal = ordering.groups(["i", "j", "k"], pattern)
    assert sorted(i for g in kept for i in g) == ["i", "j", "k"] and set(equal) <= set(kept)
    shape = (6, 6, 6, 4)
    weights = ordering.weights(shape, ordering.dims(kept, "ijka"))
    assert weights.shape == (6, 6, 6, 1)
    assert np.array_equal(weights, np.broadcast_to(ordering.weights(shape, ordering.dims(equal, "ijka")),
                                                   weights.shape))
    sizes = dict(zip("ijka", shape))
    assert ordering.points(sizes, kept) == ordering.points(sizes, equal)


@pytest.mark.parametrize("sizes,within", [({"i": 6, "j": 6, "k": 6, "a": 4}, (("i", "j", "k"),)),
                                          ({"i": 6, "j": 6, "k": 3, "a": 4}, (("i", "j"),)),
                                          ({"i": 2, "j": 5, "k": 5}, (("j", "k"),)),
                                          ({"i": 3, "j": 3}, ())])
def test_points_count_the_nonzero_weights(sizes, within):
    names = list(sizes)
    w = ordering.weights(tuple(sizes.values()), tuple(tuple(names.index(i) for i in g) for g in within))
    assert ordering.points(sizes, within) == np.count_nonzero(np.broadcast_to(w, tuple(sizes.values())))


def test_unequal_extents_sharing_a_tile_are_refused():
    with pytest.raises(ValueError, match="unequal"):
        ordering.points({"i": 3, "j": 4}, (("i", "j"),))


@pytest.mark.parametrize("m,positions", [(2, 3), (3, 4), (3, 1)])
def test_ordered_pattern_sums_count_the_ordered_elements(m, positions):
    """``pattern_sums(ordered=True)`` over tile sizes per position equals, per pattern, the
    elements of the visited tile tuples whose coordinates are non-decreasing within the indices
    sharing a tile (brute force over every element)."""
    rng = np.random.default_rng(m * 10 + positions)
    sizes = [int(s) for s in rng.integers(1, 5, positions)]
    starts = [sum(sizes[:p]) for p in range(positions)]
    sums = symmetry.pattern_sums([sizes] * m, ordered=True)
    brute = {}
    for tup in itertools.product(range(positions), repeat=m):
        if all(p <= q for p, q in zip(tup, tup[1:])):
            key = ordering.pattern_of(list(tup))
            ranges = [range(starts[p], starts[p] + sizes[p]) for p in tup]
            count = sum(all(x[n] <= x[n + 1] for n in range(m - 1) if tup[n] == tup[n + 1])
                        for x in itertools.product(*ranges))
            brute[key] = brute.get(key, 0) + count
    assert {k: v for k, v in sums.items() if v} == brute


def _op(group, indices=()):
    return Op("fused", "device", "E", list(indices), group=list(group))


CS = [Contraction(0, "E", [], "W", ["i", "j", "k", "a"], "R", ["i", "j", "k", "a"], 1.0, False, 0, 0),
      Contraction(1, "R", ["i", "j", "k", "a"], "X", ["i", "j", "a"], "Y", ["k", "a"], 1.0, False, 0, 0),
      Contraction(2, "R", ["j", "a"], "X", ["j", "a"], None, None, 1.0, True, 0, 0)]
SYM = {"E": TensorInfo("E", [], [], "float64", 8, "output", symmetric=["i", "j", "k"])}
PLAIN = {"E": TensorInfo("E", [], [], "float64", 8, "output")}


@pytest.mark.parametrize("op,loops,tensors,wanted", [
    (_op([1, 0]), [Loop("device", {"i": 2, "j": 2, "k": 2}, True, symmetric=["i", "j", "k"])], SYM, True),
    # a contraction over a part of the symmetric indices only
    (_op([2, 0]), [Loop("device", {"i": 2, "j": 2, "k": 2}, True, symmetric=["i", "j", "k"])], SYM, False),
    # no symmetric loop
    (_op([1, 0]), [Loop("device", {"i": 2, "j": 2, "k": 2}, True)], SYM, False),
    # a loop inside the symmetric one cuts a symmetric index
    (_op([1, 0]), [Loop("device", {"i": 4, "j": 4, "k": 4}, True, symmetric=["i", "j", "k"]),
                   Loop("device", {"j": 2})], SYM, False),
    # no contraction at all
    (_op([]), [Loop("device", {"i": 2, "j": 2, "k": 2}, True, symmetric=["i", "j", "k"])], SYM, False),
    # an output that is not a scalar, or not declared symmetric in the loop's indices
    (_op([1, 0], ["a"]), [Loop("device", {"i": 2, "j": 2, "k": 2}, True, symmetric=["i", "j", "k"])], SYM, False),
    (_op([1, 0]), [Loop("device", {"i": 2, "j": 2, "k": 2}, True, symmetric=["i", "j", "k"])],
     PLAIN, False),
])
def test_applies_only_to_full_symmetric_reductions_on_whole_tiles(op, loops, tensors, wanted):
    assert ordered.applies(op, loops, CS, tensors) is wanted


def test_the_triples_energy_and_w_run_are_marked(tmp_path):
    """The energy sums ordered elements; W's symmetrized run keeps them, as long as nothing but
    an ordered reduction reads W (:func:`ordered.keeps`: not once the energy is unmarked, nor
    with W also read by a contraction or accumulated)."""
    plan = api.plan(triples_config(tmp_path, "128KiB", nocc=7, nvir=6))
    marked = [op for nest in plan.nests for op, _ in ops(nest.body) if op.ordered]
    assert [(op.op, op.tensor or plan.contractions[op.contraction].out, op.symmetrized) for op in marked] == [
        ("compute", "W", True), ("fused", "E", None)]
    body = next(loops[-1].body for nest in plan.nests for op, loops in ops(nest.body) if op.symmetrized)
    start = next(k for k, op in enumerate(body) if isinstance(op, Op) and op.symmetrized)
    sym = ["i", "j", "k"]
    assert ordered.keeps(body, start, sym, plan.contractions)
    energy = next(op for op in body if isinstance(op, Op) and op.op == "fused")
    energy.ordered = None
    assert not ordered.keeps(body, start, sym, plan.contractions)
    energy.ordered = True
    reader = Contraction(len(plan.contractions), "X", list("ijk"), "W", list("ijkabc"), None, None, 1.0, False, 0, 0)
    body.append(Op("compute", "device", contraction=reader.id))
    assert not ordered.keeps(body, start, sym, plan.contractions + [reader])
    body[-1] = Op("accumulate", "device", "W", list("ijkabc"))
    assert not ordered.keeps(body, start, sym, plan.contractions)


@pytest.mark.parametrize("unmark", ["both", "kept symmetrization"])
@pytest.mark.parametrize("device_memory", ["128KiB", "512KiB"])
def test_ordered_triples_run_equals_the_reference(device_memory, unmark, tmp_path, monkeypatch):
    """(T) at o=7, v=6 on NumPy (tiles of 2 and 4): marked, E(T) equals the independent reference
    to 1e-12, and flops, statements, streamed bytes, bytes per level and peaks equal the
    prediction; then with every mark patched out (more flops, the same energy and statements),
    or only the kept symmetrization's (the same flops, more bytes streamed: the symmetrization
    writes every element). ``tests/planner/test_plan.py`` counts the flops element by element."""
    config = triples_config(tmp_path, device_memory, nocc=7, nvir=6)
    if unmark == "both":
        reports = marked_and_unmarked(config, lambda: monkeypatch.setattr(ordered, "mark", lambda *args: None))
        assert reports[0]["flops"] < reports[1]["flops"]
    else:
        reports = marked_and_unmarked(config, lambda: monkeypatch.setattr(ordered, "keeps", lambda *args: False))
        assert reports[0]["flops"] == reports[1]["flops"]
        assert reports[0]["streamed"] < reports[1]["streamed"]
    assert reports[0]["statements"] == reports[1]["statements"]
