"""Runs of terms computed once per orbit on the tiles of a symmetric loop that permutations map
onto themselves (:mod:`chainexec.planner.symmetry`): the (T) W run's invariances, the terms
taken per pattern of equal tile positions, a term that is its own image, the pattern sums
against brute force, and whole NumPy runs against the independent (T) reference
(:func:`chainexec.chem.triples.ccsd_t_energy`) with every measured count equal to the
prediction.
"""

from __future__ import annotations

import itertools
import math

import h5py
import numpy as np
import pytest

from chainexec import api, ordering
from chainexec.chem import triples
from chainexec.planner import build, symmetry
from chainexec.planner.plan import Contraction, Loop, Op, ops
from tests.conftest import read_report, run_cli, triples_config, write_config
from tests.runtime.test_chains import reference

TRIPLES = {}


def _w_run(tmp_path_factory) -> tuple[list[Contraction], dict[str, int]]:
    """The (T) config's twelve W terms and extents (o=5, v=6), planned once for the module."""
    if not TRIPLES:
        config = triples_config(tmp_path_factory.mktemp("t"), "1GiB", nocc=5, nvir=6)
        plan = api.plan(config)
        TRIPLES["run"] = [c for c in plan.contractions if c.out == "W"], plan.extents
    return TRIPLES["run"]


def test_the_triples_w_run_is_invariant_under_the_pair_permutations(tmp_path_factory):
    cs, extents = _w_run(tmp_path_factory)
    out = tuple(cs[0].out_indices)
    group = symmetry.invariances(symmetry.terms(cs), out, ("i", "j", "k"), frozenset("abc"),
                                 tuple(sorted(extents.items())))
    pairs = {"i": "a", "j": "b", "k": "c"}
    wanted = set()
    for image in itertools.permutations("ijk"):
        names = dict(zip("ijk", image)) | {pairs[s]: pairs[t] for s, t in zip("ijk", image)}
        wanted.add(tuple((i, names[i]) for i in out))
    assert set(group) == wanted and group[0] == tuple((i, i) for i in out)
    # the virtual indices cut into tiles: no permutation may move them, and none leaves the run
    assert symmetry.invariances(symmetry.terms(cs), out, ("i", "j", "k"), frozenset(),
                                tuple(sorted(extents.items()))) == (tuple((i, i) for i in out),)


@pytest.mark.parametrize("pattern,order,count", [((0, 0, 0), 6, 2), ((0, 0, 1), 2, 6), ((0, 1, 1), 2, 6),
                                                  ((0, 1, 2), 1, None)])
def test_terms_taken_per_pattern_sum_back_to_the_run(pattern, order, count, tmp_path_factory):
    """Per pattern of equal positions: the stabilizer's order, the terms taken (pairs that still
    share their split, so that they stack), and Σ over the stabilizer of their permuted sum
    equal to all twelve terms (``numpy.einsum`` on random operands, 1e-12)."""
    cs, extents = _w_run(tmp_path_factory)
    found = symmetry.schedule(cs, ["i", "j", "k"], {"a", "b", "c"}, extents)
    if count is None:
        assert found[pattern] is None
        return
    taken, axes = found[pattern]
    assert len(taken) == count and len(axes) == order and all(scale == 1.0 for _, scale in taken)
    split = {k: frozenset([frozenset(i for i in cs[k].a_indices if i in "ijkabc"),
                           frozenset(i for i in cs[k].b_indices if i in "ijkabc")]) for k, _ in taken}
    assert all(list(split.values()).count(s) == 2 for s in split.values())  # each term has a partner to stack with
    rng = np.random.default_rng(7)
    o, v = extents["i"], extents["a"]
    data = {"ovvv": rng.standard_normal((o, v, v, v)), "t2": rng.standard_normal((o, o, v, v)),
            "ovoo": rng.standard_normal((o, v, o, o))}
    tile = {"i": [0, 1], "j": [0, 1], "k": [0, 1]} if pattern == (0, 0, 0) else (
        {"i": [0, 1], "j": [0, 1], "k": [2, 3]} if pattern == (0, 0, 1) else {"i": [0, 1], "j": [2, 3], "k": [2, 3]})

    def term(c: Contraction, factor: float):
        views = [data[t][np.ix_(*[tile.get(i, range(extents[i])) for i in ix])] for t, ix in c.operands()]
        return factor * np.einsum(f"{''.join(c.a_indices)},{''.join(c.b_indices)}->{''.join(c.out_indices)}", *views)

    whole = sum(term(c, c.factor) for c in cs)
    scratch = sum(term(cs[k], cs[k].factor * scale) for k, scale in taken)
    rebuilt = sum(scratch.transpose(p) for p in axes)
    assert np.abs(rebuilt - whole).max() <= 1e-12 * np.abs(whole).max()


@pytest.mark.parametrize("split,elements", [
    (("jbc", "ika"), 88 * 88 * 21 * 88),  # (a|bc): (b,c) against (k,a)
    (("iab", "kjc"), 88 * 88 * 88),       # (ab|c): (a,b) against c
    (("iac", "jkb"), 88 * 21 * 21),       # (ac|b): c against (j,k)
])
def test_gemm_score_is_the_batched_gemm_of_the_split(split, elements):
    """:func:`symmetry.gemm_score` at (T)'s W in the order W[i,j,k,a,b,c], o=21, v=88, for each way a W term
    splits the virtual indices, counted by hand from the runs of consecutive output indices."""
    sizes = dict.fromkeys("ijk", 21) | dict.fromkeys("abc", 88)
    side, other = (frozenset(s) for s in split)
    assert symmetry.gemm_score(tuple("ijkabc"), side, other, sizes) == elements
    assert symmetry.gemm_score(tuple("ijkabc"), other, side, sizes) == elements


@pytest.mark.parametrize("pattern", [(0, 0, 0), (0, 0, 1), (0, 1, 1)])
def test_each_orbit_gives_its_largest_gemm(pattern, tmp_path_factory):
    """The term taken from each orbit has the largest :func:`symmetry.gemm_score` of its orbit.
    The config holds W as W[i,a,j,b,k,c], where the split of the output's indices into (j,b,c)
    and (i,a,k) (terms W4 and W8 of docs/chem.md, positions 3 and 7) makes the smallest GEMMs,
    v×(o·v): c's run is c alone, and the other side's longest run a pair. On each pattern with
    equal positions (those parametrized) the stabilizer maps that split onto a larger one, so it
    does not run there."""
    cs, extents = _w_run(tmp_path_factory)
    out = tuple(cs[0].out_indices)
    assert out == tuple("iajbkc")
    group = symmetry.invariances(symmetry.terms(cs), out, ("i", "j", "k"), frozenset("abc"),
                                 tuple(sorted(extents.items())))
    H = symmetry.stabilizer(group, ("i", "j", "k"), pattern)
    taken, _ = symmetry.schedule(cs, ["i", "j", "k"], {"a", "b", "c"}, extents)[pattern]

    def score(c: Contraction) -> int:
        return symmetry.gemm_score(out, frozenset(i for i in c.a_indices if i in out),
                                   frozenset(i for i in c.b_indices if i in out), extents)

    def image(c: Contraction, g) -> tuple:
        names = dict(g)
        return frozenset([(c.a, tuple(names[i] if i in names else i for i in c.a_indices)),
                          (c.b, tuple(names[i] if i in names else i for i in c.b_indices))])

    for k, _ in taken:
        orbit = {image(cs[k], g) for g in H}
        members = [c for c in cs if image(c, ()) in orbit and c.factor == cs[k].factor]
        assert len(members) >= 2 and score(cs[k]) == max(score(c) for c in members)
        sides = {frozenset(i for i in ix if i in out) for ix in (cs[k].a_indices, cs[k].b_indices)}
        assert sides != {frozenset("jbc"), frozenset("iak")}


def test_a_term_its_own_image_is_taken_at_its_share():
    """``X[i,j] = A[i,k]·A[j,k] + B[i,k]·C[j,k] + B[j,k]·C[i,k]`` on a tile with i and j equal:
    the first term is its own image under (i j), so it is taken at half its factor; two of three
    terms run, and their symmetrized sum is the whole run."""
    cs = [Contraction(0, "X", ["i", "j"], "A", ["i", "k"], "A", ["j", "k"], 1.0, False, 0, 0),
          Contraction(1, "X", ["i", "j"], "B", ["i", "k"], "C", ["j", "k"], 1.0, True, 0, 0),
          Contraction(2, "X", ["i", "j"], "B", ["j", "k"], "C", ["i", "k"], 1.0, True, 0, 0)]
    found = symmetry.schedule(cs, ["i", "j"], set(), {"i": 4, "j": 4, "k": 3})
    assert found[(0, 1)] is None
    taken, axes = found[(0, 0)]
    assert taken == ((0, 0.5), (1, 1.0)) and sorted(axes) == [(0, 1), (1, 0)]
    rng = np.random.default_rng(2)
    A, B, C = (rng.standard_normal((4, 3)) for _ in range(3))
    parts = [A @ A.T, B @ C.T, (B @ C.T).T]
    scratch = sum(scale * parts[k] for k, scale in taken)
    assert np.allclose(sum(scratch.transpose(p) for p in axes), sum(parts), rtol=1e-14, atol=0)


def test_runs_no_permutation_maps_onto_themselves_are_left_alone():
    cs = [Contraction(0, "X", ["i", "j"], "A", ["i", "k"], "B", ["j", "k"], 1.0, False, 0, 0),
          Contraction(1, "X", ["i", "j"], "C", ["i", "k"], "B", ["j", "k"], 1.0, True, 0, 0)]
    assert symmetry.schedule(cs, ["i", "j"], set(), {"i": 4, "j": 4, "k": 3}) is None


@pytest.mark.parametrize("m,positions", [(1, 4), (2, 3), (3, 4), (3, 1), (2, 6)])
def test_pattern_sums_split_the_ordered_sum(m, positions):
    rng = np.random.default_rng(m * 10 + positions)
    factors = [list(rng.integers(1, 9, positions)) for _ in range(m)]
    sums = symmetry.pattern_sums(factors)
    brute = {}
    for tup in itertools.product(range(positions), repeat=m):
        if all(p <= q for p, q in zip(tup, tup[1:])):
            key = ordering.pattern_of(list(tup))
            brute[key] = brute.get(key, 0) + math.prod(int(f[p]) for f, p in zip(factors, tup))
    assert {k: v for k, v in sums.items() if v} == brute
    assert set(sums) == set(symmetry.patterns(m))


@pytest.mark.parametrize("device_memory", ["128KiB", "512KiB", "4MiB"])
def test_symmetrized_triples_run_equals_the_reference(device_memory, tmp_path, monkeypatch):
    """(T) at o=7, v=6 on NumPy with W's run marked (tiles of 2 and 4, and one tile: no symmetric
    loop, every pair permutation maps it onto itself): E(T) equals the independent reference to
    1e-12; flops, statements, streamed bytes, bytes per level and memory peaks equal the
    prediction; fewer flops than the same plan unmarked, whose energy is the same, at the same
    device peak (the symmetrization is in place)."""
    config = triples_config(tmp_path, device_memory, nocc=7, nvir=6)
    marked = api.plan(config)
    assert _marked(marked)
    reports = marked_and_unmarked(config, lambda: monkeypatch.setattr(build, "mark", lambda *args: None))
    assert reports[0]["flops"] < reports[1]["flops"]
    assert reports[0]["memory_peak"]["device"] == reports[1]["memory_peak"]["device"]  # in place: no scratch tile


def marked_and_unmarked(config, unmark) -> list[dict]:
    """The measured records of two NumPy runs of a (T) config, the second after ``unmark()``
    (a planner step patched out): each run's E(T) equals the independent reference
    (:func:`chainexec.chem.triples.ccsd_t_energy` of the inputs beside the config) to 1e-12, and
    its flops, statements, streamed bytes, bytes per level and peaks equal the prediction."""
    reference = triples.ccsd_t_energy(config.parent / "inputs.h5")
    reports = []
    for mark in (True, False):
        if not mark:
            unmark()
        report = api.run(config, backend="numpy", plan_cache=False)
        with h5py.File(config.parent / "energy.h5") as f:
            energy = float(f["E"][()])
        assert abs(energy - reference) <= 1e-12 * abs(reference)
        m, p = report["measured"], report["predicted"]
        for key in ("flops", "statements", "streamed", "bytes", "memory_peak"):
            assert m[key] == p[key], key
        reports.append(m)
    return reports


def _marked(plan) -> bool:
    """Whether the plan has a symmetrized run."""
    return any(op.symmetrized for nest in plan.nests for op, _ in ops(nest.body))

@pytest.mark.parametrize("ranks", [None, 2])
def test_whole_run_with_a_term_its_own_image(ranks, tmp_path):
    """A chain outside any symmetric loop (pattern ``()``: the group moves free indices only):
    ``X[i,j] = B[i,k]·C[j,k] + B[j,k]·C[i,k] + C[i,k]·C[j,k]``, then ``Y = X·D + B·E`` (B read
    again, so that it stays on the device and X's three terms form one run into X's fresh
    buffer). The plan marks X's run; the run (1 and 2 ranks) equals ``numpy.einsum`` statement
    by statement to 1e-12, and flops, statements, streamed bytes, bytes and peaks equal the
    prediction."""
    cfg = {"name": "selfimage", "indices": {"i": 6, "j": 6, "k": 5, "l": 4},
           "tensors": {n: {"indices": ix, "source": {"random": seed}} for n, ix, seed in
                       [("B", ["i", "k"], 2), ("C", ["i", "k"], 3), ("D", ["j", "l"], 4), ("E", ["k", "l"], 5)]},
           "statements": ["X[i,j] = B[i,k] * C[j,k]", "X[i,j] += B[j,k] * C[i,k]", "X[i,j] += C[i,k] * C[j,k]",
                          "Y[i,l] = X[i,j] * D[j,l]", "Y[i,l] += B[i,k] * E[k,l]"],
           "outputs": {"Y": {"file": "out.h5", "dataset": "Y"}},
           "machine": {"global_memory": "1MiB", "device_memory": "64KiB"}}
    config = write_config(tmp_path, cfg)
    assert _marked(api.plan(config))
    proc = run_cli("run", config, "--report-json", tmp_path / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    m, p = (read_report(tmp_path / "r.json")[k] for k in ("measured", "predicted"))
    for key in ("flops", "statements", "streamed", "bytes", "memory_peak"):
        assert m[key] == p[key], key
    with h5py.File(tmp_path / "out.h5") as f:
        got = f["Y"][...]
    expected = reference(cfg, tmp_path)
    assert np.max(np.abs(got - expected)) <= 1e-12 * np.max(np.abs(expected))


def test_a_run_into_a_written_buffer_is_not_marked(tmp_path):
    """``X = A·A`` first, then the run ``X += B[i,k]·C[j,k] + B[j,k]·C[i,k]``, which (i j) maps
    onto itself: X already holds A·A when the run starts, so the in-place sum over the
    permutations would add A·A's image too; the run is left as it is (:func:`symmetry.fresh`),
    and the chain still equals ``numpy.einsum``."""
    cfg = {"name": "written", "indices": {"i": 6, "j": 6, "k": 5, "l": 4},
           "tensors": {n: {"indices": ix, "source": {"random": seed}} for n, ix, seed in
                       [("A", ["i", "k"], 1), ("B", ["i", "k"], 2), ("C", ["i", "k"], 3), ("D", ["j", "l"], 4)]},
           "statements": ["X[i,j] = A[i,k] * A[j,k]", "X[i,j] += B[i,k] * C[j,k]", "X[i,j] += B[j,k] * C[i,k]",
                          "Y[i,l] = X[i,j] * D[j,l]"],
           "outputs": {"Y": {"file": "out.h5", "dataset": "Y"}},
           "machine": {"global_memory": "1MiB", "device_memory": "64KiB"}}
    config = write_config(tmp_path, cfg)
    plan = api.plan(config)
    body = next(loop.body for nest in plan.nests for loop in nest.body if isinstance(loop, Loop))
    run = [k for k, op in enumerate(body) if isinstance(op, Op) and op.op == "compute" and op.contraction in (1, 2)]
    assert run == [run[0], run[0] + 1] and not symmetry.fresh(body, run[0], plan.contractions)
    assert not _marked(plan)
    api.run(config, backend="numpy", plan_cache=False)
    with h5py.File(tmp_path / "out.h5") as f:
        got = f["Y"][...]
    expected = reference(cfg, tmp_path)
    assert np.max(np.abs(got - expected)) <= 1e-12 * np.max(np.abs(expected))


@pytest.mark.parametrize("between, fresh", [([], True),
                                            ([Op("alloc", "device", "A", ["i", "k"]), Op("get", "device", "A", ["i", "k"])], True),
                                            ([Op("get", "device", "X", ["i", "j"])], False),
                                            ([Op("compute", "device", "Y", ["i", "j"], contraction=2)], False),
                                            ([Loop("device", {"k": 2}, body=[Op("compute", "device", "Y", ["i", "j"], contraction=2)])], False),
                                            ([Loop("device", {"k": 2}, body=[Op("alloc", "device", "A", ["i", "k"])])], True),
                                            (None, False)])
def test_fresh_means_allocated_just_before_with_nothing_naming_it(between, fresh):
    """A run into X is fresh where X's device alloc comes before it in the same body and no
    statement in between names X, also inside a loop (here a statement reading X into Y);
    without an alloc in the body X may hold anything."""
    cs = [Contraction(0, "X", ["i", "j"], "A", ["i", "k"], "B", ["j", "k"], 1.0, False, 0, 0),
          Contraction(1, "X", ["i", "j"], "B", ["i", "k"], "A", ["j", "k"], 1.0, True, 0, 0),
          Contraction(2, "Y", ["i", "j"], "X", ["i", "j"], None, None, 1.0, True, 0, 0)]
    head = [] if between is None else [Op("alloc", "device", "X", ["i", "j"])] + between
    body = head + [Op("compute", "device", "X", ["i", "j"], contraction=0),
                   Op("compute", "device", "X", ["i", "j"], contraction=1)]
    assert symmetry.fresh(body, len(head), cs) is fresh
