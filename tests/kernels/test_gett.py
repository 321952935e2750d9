"""GETT flattening (index groups, offset tables), configurations, and the generated source.

The tables are checked by evaluating the GEMM they describe with NumPy gathers and comparing with
``numpy.einsum`` on the original tensors (fresh random inputs, strided views included); the CUDA
source of every configuration, and of a staged-epilogue twin of every epilogue shape, compiles
with nvcc for sm_90 (spills bounded) when nvcc is present.
"""

import json
import math
import shutil
from dataclasses import replace
from itertools import product

import numpy as np
import pytest

from chainexec.kernels import gett
from tests.conftest import TCCG, gett_spills

CASES = [
    # (C, A, B, sizes): GEMM, TCCG-style 6-D (T) term, batch index, summed fastest index on both
    # sides, C's fastest index in A (swap), extent-1 index, 4-D CCSD-style.
    ("ab", "ak", "kb", dict(a=37, b=29, k=23)),
    ("abcdef", "dega", "gfbc", dict(a=5, b=4, c=3, d=6, e=2, f=7, g=9)),
    # the same with C's stride-1 index f in ragged runs of C_RUN (19) and B's c of BLOCK (5)
    ("abcdef", "dega", "gfbc", dict(a=3, b=2, c=5, d=4, e=3, f=19, g=13)),
    ("lab", "lak", "lkb", dict(l=3, a=11, b=13, k=5)),
    ("ab", "ak", "bk", dict(a=17, b=19, k=31)),
    ("ba", "ak", "kb", dict(a=21, b=9, k=14)),
    ("aib", "ak", "kib", dict(a=6, i=1, b=10, k=8)),
    ("abcd", "eafc", "bfde", dict(a=4, b=5, c=3, d=6, e=7, f=2)),
    # A's and B's stride-1 indices both summed (f, e): K enumerated in blocks, ragged at 6 and 7
    ("abcd", "aebf", "dfce", dict(a=3, b=4, c=5, d=2, e=6, f=7)),
    # TCCG's ML case 4 with M = 45 (one-row tiles of 48 offered beside the tied 32-row ones) and
    # N interleaving C's and B's stride-1 indices in ragged blocks (turned loads)
    ("abcd", "deca", "be", dict(a=17, b=45, c=3, d=19, e=40)),
    # an AO→MO step with M = 139, A loaded along m: no one-row tile within ROW_PADDING
    ("abcd", "ea", "ebcd", dict(a=139, b=5, c=7, d=9, e=37)),
]


def _arrays(c, a, b, sizes, seed, view=False):
    """Random A, B and C; with ``view``, each is a strided slice of a larger array."""
    rng = np.random.default_rng(seed)
    out = []
    for idx in (c, a, b):
        shape = [sizes[i] for i in idx]
        if view:
            big = rng.standard_normal([n + 2 for n in shape])
            out.append(big[tuple(slice(1, 1 + n) for n in shape)])
        else:
            out.append(rng.standard_normal(shape))
    return out


def _strides(arr, idx):
    return dict(zip(idx, (s // arr.itemsize for s in arr.strides)))


def _emulate(p, tabs, C, A, B, alpha, beta):
    """The kernel's arithmetic with NumPy gathers: C[cm+cn+cl] = alpha*A[..]@B[..] + beta*C[..]."""
    if p.swap:
        A, B = B, A
    fa, fb, fc = (np.lib.stride_tricks.as_strided(x, shape=(x.size + 10**6,), strides=(x.itemsize,))
                  for x in (A, B, C))
    base = [x.__array_interface__["data"][0] for x in (A, B, C)]
    del base
    for l, (al, bl, cl) in enumerate(zip(tabs["al"], tabs["bl"], tabs["cl"])):
        am = fa[al + tabs["am"][:, None] + tabs["ak"][None, :]]
        bm = fb[bl + tabs["bk"][:, None] + tabs["bn"][None, :]]
        idx = cl + tabs["cm"][:, None] + tabs["cn"][None, :]
        fc[idx] = alpha * (am @ bm) + beta * fc[idx]


@pytest.mark.parametrize("order", gett.ORDERS)
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("c,a,b,sizes", CASES)
def test_tables_describe_the_contraction(c, a, b, sizes, view, order):
    C, A, B = _arrays(c, a, b, sizes, seed=len(c) + 10 * len(a), view=view)
    ref = 0.5 * np.einsum(f"{a},{b}->{c}", A, B) - 1.5 * C
    strides = (_strides(C, c), _strides(A, a), _strides(B, b))
    p = gett.problem(tuple(c), tuple(a), tuple(b), sizes, strides, order)
    M, N, K, L = p.dims
    assert M * N * K * L == np.prod(list(sizes.values()))
    tabs = gett.tables(p, strides)
    assert [tabs[t].size for t in ("am", "ak", "bn", "cl")] == [M, K, N, L]
    _emulate(p, tabs, C, A, B, 0.5, -1.5)
    assert np.linalg.norm(C - ref) <= 1e-12 * np.linalg.norm(ref)


BATCHED = [{"id": 900, "C": "lab", "A": "lak", "B": "lkb", "sizes": dict(l=3, a=11, b=13, k=5)},
           {"id": 901, "C": "bmla", "A": "kalm", "B": "blk", "sizes": dict(a=3, b=4, k=5, l=2, m=3)}]
"""Contractions with batch indices (in all three tensors) for the packed orders: the TCCG set has none."""


@pytest.mark.parametrize("case", json.loads(TCCG.read_text()) + BATCHED, ids=lambda case: str(case["id"]))
def test_packed_operands_are_read_in_whole_runs_along_every_group(case):
    """GETT on packed copies (:func:`~chainexec.kernels.gett.packed_orders`): whichever order a
    problem takes, C's free indices are enumerated in one table order shared by all three
    tensors, nothing is blocked, A's and B's free groups are each one run of stride 1 in the
    copies and their summed and batch groups one run of a single stride, B's a bulk-copy run of
    all of N; the
    tables still describe the contraction (emulated against einsum on a case shrunk to small
    extents)."""
    c, a, b = case["C"], case["A"], case["B"]
    oa, ob = gett.packed_orders(tuple(c), tuple(a), tuple(b))
    batch = tuple(i for i in c if i in a and i in b)
    assert sorted(oa) == sorted(a) and sorted(ob) == sorted(b)
    assert oa[:len(batch)] == ob[:len(batch)] == batch
    assert [i for i in oa[len(batch):] if i in c] == [i for i in c if i in a and i not in batch]
    assert [i for i in ob[len(batch):] if i in c] == [i for i in c if i in b and i not in batch]
    assert [i for i in oa if i not in c] == [i for i in ob if i not in c] == [i for i in a if i not in c]
    sizes = {i: 2 + 2 * (n % 3) for n, i in enumerate(case["sizes"])}  # even: B's pieces on 16 bytes
    C, A, B = _arrays(c, "".join(oa), "".join(ob), sizes, seed=case["id"])
    strides = (_strides(C, c), _strides(A, oa), _strides(B, ob))
    probs = gett.variants(tuple(c), oa, ob, sizes, strides)
    for p in probs.values():
        M, N, K, L = p.dims
        tabs = gett.tables(p, strides)
        assert p.blocked == () and p.bulk_run == (N if p.b_n_fast else 0)
        assert all(np.all(np.diff(tabs[t]) == 1) for t in ("am", "bn"))
        assert all(np.all(np.diff(tabs[t]) == tabs[t][1:2] - tabs[t][:1]) for t in ("ak", "bk", "al", "bl"))
        _emulate(p, tabs, C, A, B, 1.0, 0.0)
        assert np.linalg.norm(C - np.einsum(f"{''.join(oa)},{''.join(ob)}->{c}", A, B)) <= 1e-12 * np.linalg.norm(C)


def test_groups_and_coalescing_choices():
    # W-term of (T): C's fastest index c comes from B; B's fastest (f) is summed.
    sizes = dict(i=3, j=4, k=5, a=6, b=7, c=8, f=9)
    C, A, B = _arrays("ijkabc", "iafb", "kjcf", sizes, 0)
    p = gett.problem(tuple("ijkabc"), tuple("iafb"), tuple("kjcf"), sizes,
                     (_strides(C, "ijkabc"), _strides(A, "iafb"), _strides(B, "kjcf")))
    assert not p.swap and p.k == ("f",) and p.l == ()
    assert set(p.m) == set("iab") and p.n == ("j", "k", "c")  # in C's order: stores along c
    assert not p.a_k_fast and p.m[-1] == "b"  # A's stride-1 index b is external: loads run along m
    assert not p.b_n_fast and p.runs == (8, 7, 9)  # stores along c, A loads along b, B along f
    # Stores ordered by C: m follows C's strides, so A's rows are no longer contiguous along m.
    q = gett.problem(tuple("ijkabc"), tuple("iafb"), tuple("kjcf"), sizes,
                     (_strides(C, "ijkabc"), _strides(A, "iafb"), _strides(B, "kjcf")), "store")
    assert q.m == ("i", "a", "b") and q.n == ("j", "k", "c")
    assert set(gett.variants(tuple("ijkabc"), tuple("iafb"), tuple("kjcf"), sizes,
                             (_strides(C, "ijkabc"), _strides(A, "iafb"), _strides(B, "kjcf")))) <= set(gett.ORDERS)
    # C's fastest index in A: the operands swap so stores run along n.
    sizes = dict(a=4, b=5, k=6)
    C, A, B = _arrays("ba", "ak", "kb", sizes, 0)
    p = gett.problem(("b", "a"), ("a", "k"), ("k", "b"), sizes,
                     (_strides(C, "ba"), _strides(A, "ak"), _strides(B, "kb")))
    assert p.swap and p.n == ("a",)


def test_groups_read_by_two_tensors_along_different_indices_are_enumerated_in_sector_blocks():
    # K = (e, f): A's stride-1 index f, B's e; both operands are loaded along K
    sizes = dict(a=3, b=4, c=5, d=2, e=6, f=7)
    C, A, B = _arrays("abcd", "aebf", "dfce", sizes, 0)
    p = gett.problem(tuple("abcd"), tuple("aebf"), tuple("dfce"), sizes,
                     (_strides(C, "abcd"), _strides(A, "aebf"), _strides(B, "dfce")))
    assert p.a_k_fast and not p.b_n_fast and p.runs[1:] == (4, 4)
    assert p.blocked == (("k", "f", "e", gett.BLOCK, gett.BLOCK),)
    # N = (b, c, f) in C's order (f stride-1 in C) and B's stride-1 index c: B loaded along N
    sizes = dict(a=5, b=4, c=3, d=6, e=2, f=7, g=9)
    C, A, B = _arrays("abcdef", "dega", "gfbc", sizes, 0)
    q = gett.problem(tuple("abcdef"), tuple("dega"), tuple("gfbc"), sizes,
                     (_strides(C, "abcdef"), _strides(A, "dega"), _strides(B, "gfbc")), "store-n")
    # the sum (g = 9) is short: C's f in runs of C_RUN (all 7 of them), B's c in runs of BLOCK
    assert q.b_n_fast and q.n == ("b", "c", "f") and q.runs == (7, 5, 3)
    assert q.blocked == (("n", "f", "c", gett.C_RUN, gett.BLOCK),)
    # a longer sum: f in runs of BLOCK
    sizes = dict(sizes, g=gett.SHORT_TUNED + 1)
    C, A, B = _arrays("abcdef", "dega", "gfbc", sizes, 0)
    q = gett.problem(tuple("abcdef"), tuple("dega"), tuple("gfbc"), sizes,
                     (_strides(C, "abcdef"), _strides(A, "dega"), _strides(B, "gfbc")), "store-n")
    assert q.blocked == (("n", "f", "c", gett.BLOCK, gett.BLOCK),) and q.runs == (4, 5, 3)


@pytest.mark.parametrize("g, turn", [(9, gett.C_RUN), (gett.SHORT_TUNED + 1, gett.BLOCK)])
def test_the_line_order_blocks_b_in_whole_lines_and_its_kernels_turn_them(g, turn):
    """``store-line``: N as in ``store``, B's stride-1 index c in blocks of a line (LINE), C's f in
    its runs; every configuration the model offers for it loads them turned, none of the
    short-sum kernels (which do not turn) is offered for it; where N interleaves nothing, it is
    the ``store`` problem."""
    sizes = dict(a=5, b=4, c=37, d=6, e=2, f=11, g=g)
    strides = tuple(_contiguous_strides(x, sizes) for x in ("abcdef", "dega", "gfbc"))
    probs = gett.variants(tuple("abcdef"), tuple("dega"), tuple("gfbc"), sizes, strides)
    p = probs["store-line"]
    assert p.blocked == (("n", "f", "c", turn, gett.LINE),) and p.turn == turn
    assert (p.runs[0], p.runs[2]) == (min(11, turn), 16) and (p.n, p.m) == (probs["store"].n, probs["store"].m)
    cfgs = gett.configs(p)
    assert cfgs and all(cfg.turn == turn and cfg.bn % (gett.LINE * turn) == 0 for cfg in cfgs)
    assert gett.short_configs(p) == [] and all(cfg.turn == turn for cfg, _ in gett.split_configs(p, 132))
    assert {o for o, cfg in gett.candidates(probs, 132) if cfg.turn} == {"store-line"}
    plain = dict(a=5, b=4, k=6)
    assert "store-line" not in gett.variants(("a", "b"), ("a", "k"), ("k", "b"), plain, tuple(
        _contiguous_strides(x, plain) for x in ("ab", "ak", "kb")))


def _turned_lanes(cfg):
    """Table position and shared-memory column each thread of ``cfg`` loads B's tile into, as
    :func:`gett.source` computes them (threads along n: ``tid % bn``)."""
    line, turn, group = gett.LINE, cfg.turn, gett.LINE * cfg.turn
    out = []
    for tid in range(cfg.bn):
        pos = tid % line * turn + tid // line % turn + tid // group * group
        out.append((pos, pos + pos // line))
    return out


@pytest.mark.parametrize("turn", [gett.BLOCK, gett.C_RUN])
def test_turned_lanes_read_whole_lines_into_distinct_banks(turn):
    """A turned tile: the threads load every position once; a warp's copies read two 128-byte
    lines of B (positions in blocks of LINE of B's index by ``turn`` of C's, as the line order
    enumerates them), where table order reads a sector of each of eight; each half-warp's 8-byte
    stores fall on all 32 banks; the fragment reads' columns (8 consecutive positions) stay
    consecutive; the pitch holds every column."""
    cfg = gett.GettConfig(2, turn // 2, 2, 4, 16, 3, "m16n8k4", True, True, turn=turn)
    assert cfg.valid() and cfg.bn % (gett.LINE * turn) == 0
    lanes = _turned_lanes(cfg)
    assert sorted(p for p, _ in lanes) == list(range(cfg.bn))
    assert max(col for _, col in lanes) < cfg.pitches()[1] and cfg.pitches()[1] % 16 == 4
    for w in range(0, cfg.bn, 32):
        positions = [p for p, _ in lanes[w:w + 32]]
        lines = {(p // (gett.LINE * turn), p % turn) for p in positions}  # (block, C's index): one line of B
        assert len(lines) == 2
        for half in (lanes[w:w + 16], lanes[w + 16:w + 32]):
            banks = [(2 * col + word) % 32 for _, col in half for word in (0, 1)]
            assert sorted(banks) == list(range(32))
    for first in range(0, cfg.bn, 8):
        cols = [p + p // gett.LINE for p in range(first, first + 8)]
        assert cols == list(range(cols[0], cols[0] + 8))


@pytest.mark.parametrize("run,width", [(gett.BLOCK, gett.BLOCK), (gett.C_RUN, gett.BLOCK),
                                       (gett.BLOCK, gett.LINE), (gett.C_RUN, gett.LINE)])
@pytest.mark.parametrize("group,sizes", [(("p", "x", "q", "y"), dict(p=2, x=9, q=3, y=6)),
                                         (("y", "x"), dict(x=4, y=8)), (("x", "y"), dict(x=3, y=2)),
                                         (("y", "x"), dict(x=19, y=11)), (("y", "x"), dict(x=11, y=37)),
                                         (("y", "p", "x"), dict(x=1, y=2, p=3))])
def test_blocked_enumeration_visits_every_multi_index_once(group, sizes, run, width):
    """The table order of a blocked group, read back as multi-indices from the offsets of a
    tensor whose strides number them (row-major over the group)."""
    shape = [sizes[i] for i in group]
    numbering = dict(zip(group, (int(s) for s in np.cumprod([1] + shape[:0:-1])[::-1])))

    def multi_indices(blocked):
        return np.array(np.unravel_index(gett.offsets(group, sizes, numbering, blocked), shape))

    plain = multi_indices(None)
    assert np.array_equal(plain, np.indices(shape).reshape(len(group), -1))
    idx = multi_indices(("x", "y", run, width))
    assert idx.shape == plain.shape
    assert sorted(map(tuple, idx.T)) == sorted(map(tuple, plain.T))  # a permutation of the plain order
    x, y = group.index("x"), group.index("y")
    B = width
    # the first positions: x fastest in a run of up to `run`, then y in runs of up to `width`,
    # within one block
    first = idx[:, :min(sizes["x"], run) * min(sizes["y"], B)]
    assert list(first[x][:min(sizes["x"], run)]) == list(range(min(sizes["x"], run)))
    assert set(first[y]) == set(range(min(sizes["y"], B))) and set(first[x]) == set(range(min(sizes["x"], run)))
    # the other indices stay outermost: they change only where a whole (x, y) plane is done
    others = [g for g in range(len(group)) if g not in (x, y)]
    plane = sizes["x"] * sizes["y"]
    for g in others:
        assert all(len(set(idx[g][s:s + plane])) == 1 for s in range(0, idx.shape[1], plane))
    # the whole order: (other indices, y's block, x's block, y in its block, x in its run) rises
    keys = [tuple(int(idx[g][p]) for g in others) + (int(idx[y][p]) // B, int(idx[x][p]) // run, int(idx[y][p]) % B,
                                                     int(idx[x][p]) % run) for p in range(idx.shape[1])]
    assert all(u < v for u, v in zip(keys, keys[1:]))


@pytest.mark.parametrize("bad", [(("a", "a"), ("a", "k"), ("k", "a")), (("a", "b"), ("a", "k"), ("k",))])
def test_invalid_contractions_raise(bad):
    c, a, b = bad
    sizes = dict(a=2, b=2, k=2)
    with pytest.raises(ValueError):
        gett.problem(c, a, b, sizes, tuple({i: 1 for i in x} for x in bad))


def _all_configs(turns=(0,)):
    """Every valid configuration of TILES, of every load direction, turned by each of ``turns``."""
    out = []
    for (wm, wn, mm, mn, bk), shape, ak, bn, turn in product(gett.TILES, gett.MMA_SHAPES, (True, False), (True, False),
                                                              turns):
        rows = gett.MMA_SHAPES[shape][0]
        if mm * 8 % rows == 0:
            cfg = gett.GettConfig(wm, wn, mm * 8 // rows, mn, bk, 3, shape, ak, bn, turn=turn)
            if cfg.valid():
                out.append(cfg)
    return out


@pytest.mark.parametrize("mma_n, stageable", [(1, True), (2, True), (3, False), (4, True), (5, False), (6, False),
                                               (8, True), (12, True)])
def test_a_staged_epilogue_needs_warp_rows_that_tile_a_warp(mma_n, stageable):
    """The staged epilogue stores 32 / width rows of a warp's tile per instruction, or width / 32
    elements a lane: a width (8·mma_n columns) that neither divides 32 nor is a multiple of it
    (24, 40, 48) would leave lanes storing into the wrong rows, or columns unstored, so such
    configurations are invalid staged and valid storing their fragments directly."""
    cfg = gett.GettConfig(2, 1, 1, mma_n, 16, 3, "m16n8k4", True, False)
    assert cfg.valid()
    assert replace(cfg, staged=True).valid() == stageable


def test_candidates_are_valid_and_ranked(monkeypatch):
    sizes = dict(a=24, b=16, c=16, d=24, e=16, f=16, g=24)
    C, A, B = _arrays("abcdef", "dega", "gfbc", sizes, 0)
    probs = gett.variants(tuple("abcdef"), tuple("dega"), tuple("gfbc"), sizes,
                          (_strides(C, "abcdef"), _strides(A, "dega"), _strides(B, "gfbc")))
    assert set(probs) == set(gett.ORDERS)  # C's stride-1 index f is not B's: the orders differ
    every_kind = gett.candidates(probs, sm_count=132, top=3)
    # the best of each order (more than the three asked for), then the best of each k-tile depth
    # and block shape no larger than the best's, then each first-tier order's first-tier
    # configurations of at most TIE_WARPS warps that move the fewest L2 bytes, then the
    # staged-epilogue twin of each (they fit: no shared-memory limit hit); last, K = 24 being
    # short, the short-sum kernels of each order
    ranked = [x for x in every_kind if not x[1].span]
    short = [(o, cfg) for o, p in probs.items() for cfg in gett.short_configs(p)]
    assert every_kind == ranked + short and short
    assert all(cfg.bk == 24 and cfg.valid() for _, cfg in short)
    plain = [x for x in ranked if not x[1].staged]
    every = [(gett._rank(p, cfg, 132), o, cfg) for o, p in probs.items() for cfg in gett.configs(p)]
    tier = min(k for k, _, _ in every)[0]
    ties = []
    for order in probs:
        near = sorted((k, gett.l2_bytes(probs[order], c), c.name(), c) for k, o, c in every
                      if o == order and k[0] == tier and c.warps_m * c.warps_n <= gett.TIE_WARPS)
        ties += [(order, c) for *_, c in near[:gett.TIE_PICKS]]
    with monkeypatch.context() as m:
        m.setattr(gett, "TIE_PICKS", 0)
        plain_before = [x for x in gett.candidates(probs, sm_count=132, top=3) if not x[1].span and not x[1].staged]
    picked = [x for x in ties if x not in plain_before]
    assert picked and plain == plain_before + picked
    cands, diverse = plain_before[:len(gett.ORDERS)], plain_before[len(gett.ORDERS):]
    assert ranked[len(plain):] == [(o, replace(cfg, staged=True)) for o, cfg in plain]
    assert {o for o, _ in cands} == set(gett.ORDERS)
    for order, cfg in ranked:
        p = probs[order]
        assert cfg.valid() and (cfg.a_k_fast, cfg.b_n_fast) == (p.a_k_fast, p.b_n_fast)
    keys = [gett._rank(probs[o], cfg, 132) for o, cfg in plain]
    assert keys[:len(cands)] == sorted(keys[:len(cands)])
    area = cands[0][1].bm * cands[0][1].bn
    shapes = (lambda c: c.bk, lambda c: (c.bm, c.bn, c.threads))
    for shape in shapes:
        assert {shape(cfg) for _, cfg in plain_before} == {shape(cfg) for _, _, cfg in every if cfg.bm * cfg.bn <= area} | {
            shape(cfg) for _, cfg in cands}
    for _, cfg in diverse:  # each the best-ranked of its k-tile depth or of its block shape
        assert any(min((k, o, c.name()) for k, o, c in every if shape(c) == shape(cfg) and c.bm * c.bn <= area)[2]
                   == cfg.name() for shape in shapes)
    # K = 24: k-tiles of 8 pad nothing, so among the ties a k-tile of 8 ranks first
    assert cands[0][1].bk == 8
    times = [gett.predicted_seconds(probs[o], cfg, 132) for o, cfg in cands]
    # Storing along f (C's stride-1 index) is predicted cheaper than storing along c, and of the
    # two orders that store along f, reading A along its stride-1 index a cheaper than across it.
    assert cands[0][0] == "store-n"
    assert [o for o, _ in cands].index("store") < [o for o, _ in cands].index("load")
    # The roofline never predicts faster than the flops at peak or the compulsory DRAM traffic.
    M, N, K, L = probs["load"].dims
    floor = max(2 * M * N * K * L / gett.PEAK_FLOPS, 8 * (M * K + K * N + 2 * M * N) * L / gett.DRAM_BYTES)
    assert min(times) >= floor * (1 - 1e-12)
    with pytest.raises(ValueError):
        gett.source(gett.GettConfig(2, 2, 4, 4, 6, 3, "m8n8k4", True, True))  # bk not a multiple of 4


def test_an_empty_summed_range_still_ranks_its_configurations():
    """K = 0 (a summed extent of 0) pads nothing: ranking the configurations does not divide by
    it."""
    sizes = dict(a=64, b=64, k=0)
    p = gett.problem(("a", "b"), ("a", "k"), ("k", "b"), sizes, ({"a": 64, "b": 1}, {"a": 1, "k": 1}, {"k": 64, "b": 1}))
    assert p.dims[2] == 0
    cands = gett.candidates({"load": p}, 132)
    assert cands and all(cfg.valid() for _, cfg in cands)


def test_shared_memory_pitches_avoid_bank_conflicts():
    """Fragment reads: lanes 0-15 touch rows 0-3 x columns 0-3; with a pitch of 4 (or 12) mod 16
    doubles the 16 addresses fall into 16 distinct 8-byte bank pairs. Unturned tiles take no more
    than that: the loaded length plus 4."""
    for cfg in _all_configs() + _all_configs((gett.BLOCK, gett.C_RUN)):
        for pitch in cfg.pitches():
            slots = {(r * pitch + col) % 16 for r in range(4) for col in range(4)}
            assert len(slots) == 16
        if not cfg.turn:
            assert cfg.pitches() == ((cfg.bk if cfg.a_k_fast else cfg.bm) + 4, (cfg.bn if cfg.b_n_fast else cfg.bk) + 4)


@pytest.mark.parametrize("rows, bm_warps, reads_b", [(72, 1, 1), (72, 2, 1), (72, 4, 1), (600, 1, 5)])
def test_model_reads_b_once_per_raster_group(rows, bm_warps, reads_b):
    """The AO→MO shape ``abcd-ea-ebcd`` (TCCG 9: M = a = 72, N = 72³, K = 72) is memory-bound:
    with block rows of 16, 32 or 64, all of M's 5, 3 or 2 block rows fit one raster group
    (:data:`~chainexec.kernels.gett.RASTER`) and the model moves A and B once and C twice; with
    a = 600 (38 block rows of 16, five groups) B five times. Counted here by hand from the
    tensors' sizes."""
    sizes = dict(a=rows, b=72, c=72, d=72, e=72)
    n = 72**3
    strides = ({"a": n, "b": 72**2, "c": 72, "d": 1}, {"e": rows, "a": 1}, {"e": n, "b": 72**2, "c": 72, "d": 1})
    p = gett.problem(tuple("abcd"), tuple("ea"), tuple("ebcd"), sizes, strides)
    cfg = gett.GettConfig(bm_warps, 2, 1, 4, 8, 2, "m16n8k4", p.a_k_fast, p.b_n_fast)
    tiles = -(-rows // cfg.bm)
    assert cfg.valid() and -(-tiles // gett.RASTER) == reads_b
    moved = 8 * (72 * rows + reads_b * 72 * n + 2 * rows * n)
    assert gett.predicted_seconds(p, cfg, 132) == pytest.approx(moved / gett.DRAM_BYTES)


def _staged_twins():
    """A staged-epilogue twin of one configuration per epilogue shape (warps, MMA tiles per warp,
    MMA shape: the staged epilogue's code depends on nothing else)."""
    seen = {}
    for cfg in _all_configs():
        seen.setdefault((cfg.warps_m, cfg.warps_n, cfg.mma_m, cfg.mma_n, cfg.mma), replace(cfg, staged=True))
    return list(seen.values())


def test_staged_epilogue_memory_and_banks():
    """The staged epilogue's tiles fit the shared memory the kernel asks for (the pipeline's, or
    more where they are larger), never change the direct twin's, and a fragment store into a
    tile puts each half-warp's lanes at most two to an 8-byte bank pair (the floor for its
    columns; four with a pitch of 0 or 2 mod 16)."""
    for cfg in _all_configs():
        twin = replace(cfg, staged=True)
        tiles = cfg.warps_m * cfg.warps_n * cfg.rows * twin.stage_pitch() * gett.ELEM
        assert twin.smem_bytes() == max(cfg.smem_bytes(), tiles) and twin.name() == cfg.name() + "_st"
        pitch = twin.stage_pitch()
        assert pitch >= cfg.mma_n * 8
        for q, half in product(range(2), range(2)):  # one store: lane -> row lane>>2, column 2(lane&3)+q
            pairs = [((lane >> 2) * pitch + 2 * (lane & 3) + q) % 16 for lane in range(16 * half, 16 * half + 16)]
            assert max(pairs.count(p) for p in set(pairs)) == 2


def _both_widths(cfgs):
    """Every second configuration with 64-bit offsets: the odd ones are one compilation unit."""
    return [replace(cfg, wide=i % 2 == 1) for i, cfg in enumerate(cfgs)]


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("tensor", [0, 1, 2])
def test_offsets_are_32_bit_unless_an_element_lies_near_2_31_away(wide, tensor):
    """A GEMM whose C, A or B (a view of a larger buffer, its rows far apart) has its farthest
    element just below ``NARROW`` (2^31 less a margin for indices a few tiles past an extent)
    elements from its first, or just beyond: 32-bit tables and kernels below, 64-bit beyond,
    with the same offsets."""
    sizes = dict(a=40, b=24, k=16)
    strides = [{"a": 24, "b": 1}, {"a": 16, "k": 1}, {"k": 24, "b": 1}]
    slow, fast = (("a", "b"), ("a", "k"), ("k", "b"))[tensor]
    below = (gett.NARROW - 1 - (sizes[fast] - 1)) // (sizes[slow] - 1)
    strides[tensor][slow] = below + wide
    reach = sum((sizes[i] - 1) * st for i, st in strides[tensor].items())
    assert (reach >= gett.NARROW) == wide and abs(reach - gett.NARROW) < sizes[slow]
    p = gett.problem(("a", "b"), ("a", "k"), ("k", "b"), sizes, tuple(strides))
    assert p.wide == wide
    tabs = gett.tables(p, tuple(strides))
    assert {t.dtype for t in tabs.values()} == {np.dtype(np.int64 if wide else np.int32)}
    wide_tabs = gett.tables(replace(p, wide=True), tuple(strides))
    assert all(np.array_equal(tabs[k], wide_tabs[k]) for k in tabs)
    cands = gett.candidates({"load": p}, 132)
    assert cands and all(cfg.wide == wide and cfg.name().endswith("_i64") == wide for _, cfg in cands)
    assert ("using idx = long long;" if wide else "using idx = int;") in gett.source(cands[0][1])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_staged_epilogues_compile_with_nvcc(tmp_path):
    cfgs = _both_widths(_staged_twins())
    assert all(cfg.valid() for cfg in cfgs)
    spills = gett_spills(tmp_path, cfgs)
    assert sum(s > 0 for s in spills) <= 2 and max(spills) <= 64


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_all_configurations_compile_with_nvcc(tmp_path):
    cfgs = _both_widths(_all_configs())
    # ptxas spills a few registers in at most two configurations (m16n8k8, A and B both loaded
    # along k); the autotuner times them like any other
    spills = gett_spills(tmp_path, cfgs)
    assert sum(s > 0 for s in spills) <= 2 and max(spills) <= 64


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_turned_configurations_compile_with_nvcc(tmp_path):
    """Every configuration that loads B's lines turned (:attr:`GettConfig.turn` 4 and 8, both
    index widths; the staged epilogue is the same code turned or not) compiles; ptxas spills a
    few registers in at most four of them (128-row tiles with A loaded along m, whose k offsets
    take a register each, and the 48×128 tiles turned by 8 with 64-bit offsets)."""
    cfgs = _both_widths(_all_configs((gett.BLOCK, gett.C_RUN)))
    assert len(cfgs) >= 60 and all(cfg.turn for cfg in cfgs)
    spills = gett_spills(tmp_path, cfgs)
    assert sum(s > 0 for s in spills) <= 4 and max(spills) <= 64


def _contiguous_strides(idx, sizes):
    strides, step = {}, 1
    for i in reversed(idx):
        strides[i], step = step, step * sizes[i]
    return strides


def _split_problems(c, a, b, sizes):
    return gett.variants(tuple(c), tuple(a), tuple(b), sizes, tuple(_contiguous_strides(x, sizes) for x in (c, a, b)))


SPLIT_CASES = [
    # (C, A, B, sizes, split offered): TCCG case 19 (a 72×5184 output summed over 5184) at scale
    # 1 and 2, case 13 (312×296 summed over 92352), case 19's indices at prime extents, a (T)
    # term (a sum of 24) and a 512×512 GEMM summed over 4096 (its 64×64 tiles fill 64 of 132 SMs)
    ("abc", "adec", "ebd", dict(a=72, b=72, c=72, d=72, e=72), True),
    ("abc", "adec", "ebd", dict(a=144, b=144, c=144, d=144, e=144), False),
    ("ab", "acd", "dbc", dict(a=312, b=296, c=296, d=312), True),
    ("abc", "adec", "ebd", dict(a=71, b=73, c=67, d=79, e=61), True),
    ("abcdef", "dega", "gfbc", dict(a=24, b=24, c=24, d=24, e=24, f=24, g=24), False),
    ("ab", "ak", "kb", dict(a=512, b=512, k=4096), True),
]


@pytest.mark.parametrize("c, a, b, sizes, offered", SPLIT_CASES)
def test_a_sum_is_split_where_its_blocks_leave_sms_idle(c, a, b, sizes, offered):
    """Split sums (:func:`gett.split_configs`) on 132 SMs: each a configuration of
    :func:`gett.split_shapes` with parts from SPLIT_PARTS whose blocks fit one block an SM, or the
    model's resident blocks, and one more step of SPLIT_PARTS would not (or would leave a part
    fewer than SPLIT_MIN_TILES k-tiles); none where the output's blocks fill the SMs or the sum is
    short."""
    found = []
    for p in _split_problems(c, a, b, sizes).values():
        M, N, K, L = p.dims
        shapes = gett.split_shapes(p)
        for cfg, parts in gett.split_configs(p, 132):
            blocks = -(-M // cfg.bm) * -(-N // cfg.bn) * L
            most = -(-K // cfg.bk) // gett.SPLIT_MIN_TILES
            rooms = [r for r in (132, 132 * gett.resident(cfg)) if blocks * parts <= r]
            assert cfg in shapes and parts in gett.SPLIT_PARTS and parts >= 2 and parts <= most and rooms
            after = [s for s in gett.SPLIT_PARTS if s > parts]
            assert not after or after[0] > most or blocks * after[0] > min(rooms)
            found.append((cfg.name(), parts))
    assert bool(found) == offered and len(set(found)) == len(found)


def test_case_19s_fastest_split_is_offered():
    """On TCCG case 19 the fastest split measured on an H200 (80×128 blocks of four warps of 5×4
    m16n8k4 tiles, six parts: 246 blocks, two resident an SM) is among the candidates, and so is
    the one-block-an-SM split of that shape (three parts)."""
    p = _split_problems(*SPLIT_CASES[0][:4])["load"]
    found = {(cfg.name(), parts) for cfg, parts in gett.split_configs(p, 132)}
    assert {("chainexec_gett_w1x4_t5x4_m16n8k4_k16_s3_akbn", n) for n in (3, 6)} <= found


def test_a_split_counts_its_blocks_and_its_parts_outputs(monkeypatch):
    """The model of a split sum on case 19: ``parts`` times the blocks over the resident slots
    (41 blocks of 80×128 fill 41 of 264; 6 parts fill 246), the same padded flops (324 k-tiles
    in parts of 54), and ``parts`` outputs written and read back besides the traffic."""
    p = _split_problems(*SPLIT_CASES[0][:4])["load"]
    cfg = gett.GettConfig(1, 4, 5, 4, 16, 3, "m16n8k4", p.a_k_fast, p.b_n_fast)
    M, N, K, L = p.dims
    assert (-(-M // cfg.bm) * -(-N // cfg.bn), gett.resident(cfg), -(-K // cfg.bk)) == (41, 2, 324)
    compute = 2.0 * cfg.bm * 41 * cfg.bn * 324 * cfg.bk / gett.PEAK_FLOPS
    monkeypatch.setattr(gett, "DRAM_BYTES", math.inf)
    assert gett.predicted_seconds(p, cfg, 132) == pytest.approx(compute * 264 / 41)
    assert gett.predicted_seconds(p, cfg, 132, 6) == pytest.approx(compute * 264 / 246)
    monkeypatch.setattr(gett, "DRAM_BYTES", 3.0e12)
    monkeypatch.setattr(gett, "PEAK_FLOPS", math.inf)
    whole, split = (gett.predicted_seconds(p, cfg, 132, n) for n in (1, 6))
    assert split - whole == pytest.approx(2 * 6 * gett.ELEM * M * N * L / 3.0e12)


def test_a_single_row_tile_of_a_is_read_once(monkeypatch):
    """Case 19's A (the 72×5184 operand) in one block row of 80: the group of row tiles in L2 is
    that one (3.3 MB), not RASTER of them, so A is read once however many block columns pass;
    doubling N adds only B's and C's bytes of the new columns."""
    monkeypatch.setattr(gett, "PEAK_FLOPS", math.inf)
    sizes = dict(SPLIT_CASES[0][3])
    cfg = None
    seconds = []
    for a in (72, 144):
        p = _split_problems("abc", "adec", "ebd", sizes | {"a": a})["load"]
        cfg = cfg or gett.GettConfig(1, 4, 5, 4, 16, 3, "m16n8k4", p.a_k_fast, p.b_n_fast)
        seconds.append(gett.predicted_seconds(p, cfg, 132))
    M, N, K, _ = _split_problems(*SPLIT_CASES[0][:4])["load"].dims
    assert -(-M // cfg.bm) == 1 and p.runs[0] > 8
    assert seconds[1] - seconds[0] == pytest.approx(gett.ELEM * (K * N + 2 * M * N) / gett.DRAM_BYTES)


ML = [case for case in json.loads(TCCG.read_text()) if case["group"] == "ml"]


def _scaled_problems(case, scale):
    sizes = {i: n * scale for i, n in case["sizes"].items()}
    return _split_problems(case["C"], case["A"], case["B"], sizes)


@pytest.mark.parametrize("scale", [1, 2])
@pytest.mark.parametrize("case", ML, ids=lambda case: str(case["id"]))
def test_one_row_tiles_are_offered_where_the_tied_best_split_m(case, scale, monkeypatch):
    """TCCG's ML cases: where none of the model's chosen tiles holds all of M in one block row
    (M = 48 at scale 2 on the tied 32-row tiles, each row loading B again), each first-tier
    order also offers its best-ranked one-row configuration and its staged twin: one warp along
    m of the fewest m16 tiles at or above M whose loads divide evenly. At scale 1 (M = 24) the
    chosen tiles hold M already and nothing is added; case 1's M is too large for one row. (The
    tie picks by L2 bytes, added after these, are left out.)"""
    monkeypatch.setattr(gett, "TIE_PICKS", 0)
    probs = _scaled_problems(case, scale)
    M = next(iter(probs.values())).dims[0]
    cands = gett.candidates(probs, 132)
    with monkeypatch.context() as m:
        m.setattr(gett, "row_configs", lambda p, arch=90: [])
        without = gett.candidates(probs, 132)
    added = [x for x in cands if x not in without]
    assert [x for x in cands if x in without] == without
    if scale == 1 or case["id"] == 1:
        assert added == []
        return
    ranked = [(gett._rank(probs[o], cfg, 132)[0], o) for o, cfg in without if not cfg.span]
    assert all(cfg.bm < M for o, cfg in without if not cfg.span)
    assert {o for o, _ in added} == {o for tier, o in ranked if tier == min(ranked)[0]}
    for order, cfg in added:
        assert cfg.warps_m == 1 and cfg.bm >= M and cfg.mma_m * cfg.mma_n <= gett.ROW_ACCUMULATORS
        fewer = replace(cfg, mma_m=cfg.mma_m - 1)
        assert fewer.bm < M or not fewer.valid()
        assert (order, replace(cfg, staged=not cfg.staged)) in added
    assert len(added) == 2 * len({o for o, _ in added})


@pytest.mark.parametrize("sizes", [dict(a=37, b=29, k=23), dict(a=64, b=130, k=48), dict(a=5, b=3, k=2)])
def test_l2_bytes_count_every_blocks_tile_loads(sizes):
    """:func:`gett.l2_bytes` is each block's A and B tile of each k-tile, padding included, and C
    once: counted here block by block and k-tile by k-tile (runs of at least a sector: no
    amplification where every extent is 4 or more; the 5×3×2 GEMM's runs of 3 and 2 waste
    sectors, which both counts inflate alike)."""
    probs = _split_problems("ab", "ak", "kb", sizes)
    for order, p in probs.items():
        for cfg in gett.configs(p)[:12]:
            M, N, K, L = p.dims
            amp = [gett._amplification(run, along) for run, along in
                   zip(p.runs, (8, cfg.bk if cfg.a_k_fast else cfg.bm, cfg.bn if cfg.b_n_fast else cfg.bk))]
            count = 0.0
            for _i, _j, _t in product(range(0, M, cfg.bm), range(0, N, cfg.bn), range(0, max(K, 1), cfg.bk)):
                count += cfg.bm * cfg.bk * amp[1] + cfg.bk * cfg.bn * amp[2]
            count = 8 * L * (count + M * N * amp[0])
            assert gett.l2_bytes(p, cfg) == pytest.approx(count, rel=1e-12)


TCCG_CASES = {case["id"]: case for case in json.loads(TCCG.read_text())}


@pytest.mark.parametrize("cid", [3, 5, 9, 10, 11])
def test_compute_bound_ties_offer_four_warp_tiles(cid):
    """At twice TCCG's extents the ML and AO→MO cases' first-tier ties are picked by name as
    two-warp 32×64 tiles, which each block row's loads of B make L2-bound; each first-tier order
    also offers the four-warp configurations that move the fewest L2 bytes (64×64, or 48×128
    where M = 48 is one block row): the fastest on the H100 (``benchmarks/results/``)."""
    probs = _scaled_problems(TCCG_CASES[cid], 2)
    cands = [(o, cfg) for o, cfg in gett.candidates(probs, 132) if not cfg.span]
    big = [(o, cfg) for o, cfg in cands if cfg.threads == 128 and cfg.bm * cfg.bn >= 4096]
    assert big
    for order, cfg in big:
        assert (order, replace(cfg, staged=True)) in cands


@pytest.mark.parametrize("M, a_k_fast, rows", [(48, True, {48}), (48, False, {64}), (17, True, {32}),
                                               (72, True, {80}), (72, False, set()), (139, False, set())])
def test_one_row_tiles_take_the_fewest_rows_within_the_padding(M, a_k_fast, rows):
    """One-row tiles hold all of M in the fewest m16 tiles whose loads divide evenly, at most
    ROW_PADDING rows per row of M beyond the fewest: A loaded along m needs rows that divide the
    threads, 64 for M = 48, but 128 for M = 72 would nearly double the MMAs, so none."""
    a = ("m", "k") if a_k_fast else ("k", "m")
    sizes = dict(m=M, n=256, k=64)
    p = gett.problem(("m", "n"), a, ("k", "n"), sizes, tuple(_contiguous_strides(x, sizes) for x in (("m", "n"), a,
                                                                                                     ("k", "n"))))
    assert p.a_k_fast == a_k_fast and p.dims[0] == M
    cfgs = gett.row_configs(p)
    assert {cfg.bm for cfg in cfgs} == rows and all(cfg.warps_m == 1 and cfg.valid() for cfg in cfgs)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_one_row_configurations_compile_with_nvcc(tmp_path):
    """Every one-row configuration of the ML cases at scale 2 (M = 48: 48- and 64-row tiles,
    turned and not) compiles for sm_90; with 32-bit offsets none spills, with 64-bit ones ptxas
    spills a few registers of some warps of 12 or more m16n8 tiles."""
    cfgs = []
    for case in ML[1:]:
        for p in _scaled_problems(case, 2).values():
            cfgs += [replace(cfg, wide=False) for cfg in gett.row_configs(p) if replace(cfg, wide=False) not in cfgs]
    assert len(cfgs) >= 12 and {cfg.bm for cfg in cfgs} == {48, 64} and any(cfg.turn for cfg in cfgs)
    (tmp_path / "narrow").mkdir()
    (tmp_path / "wide").mkdir()
    assert gett_spills(tmp_path / "narrow", cfgs) == [0] * len(cfgs)
    wide = gett_spills(tmp_path / "wide", [replace(cfg, wide=True) for cfg in cfgs])
    assert all(s <= 64 and (s == 0 or cfg.mma_m * cfg.mma_n >= 12) for cfg, s in zip(cfgs, wide))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_split_shapes_compile_with_nvcc(tmp_path):
    """Every split shape of the cases' problems (one-row shapes up to ROW_ACCUMULATORS tiles a
    warp) compiles for sm_90, with 32-bit offsets without spilling; with 64-bit ones (outputs
    or operands past 2^31 elements) ptxas spills some registers of the one-row shapes of 18 and
    20 m16n8 tiles a warp, as much as unsplit."""
    cfgs = []
    for c, a, b, sizes, _ in SPLIT_CASES:
        for p in _split_problems(c, a, b, sizes).values():
            cfgs += [cfg for cfg in gett.split_shapes(p) if cfg not in cfgs]
    (tmp_path / "narrow").mkdir()
    (tmp_path / "wide").mkdir()
    narrow = gett_spills(tmp_path / "narrow", cfgs)
    wide = gett_spills(tmp_path / "wide", [replace(cfg, wide=True) for cfg in cfgs])
    assert narrow == [0] * len(cfgs)
    assert all(s <= 128 and (s == 0 or cfg.mma_m * cfg.mma_n >= 18) for cfg, s in zip(cfgs, wide))


def test_configurations_follow_the_compute_capability():
    """sm_80 has FP64 MMA only as m8n8k4 and 163 KiB of shared memory per block; before sm_80
    there is none, so GETT offers nothing there."""
    sizes = dict(a=64, b=64, k=64)
    C, A, B = _arrays("ab", "ak", "kb", sizes, 0)
    probs = gett.variants(("a", "b"), ("a", "k"), ("k", "b"), sizes,
                          (_strides(C, "ab"), _strides(A, "ak"), _strides(B, "kb")))
    on90 = {cfg.mma for p in probs.values() for cfg in gett.configs(p, arch=90)}
    on80 = [cfg for p in probs.values() for cfg in gett.configs(p, arch=80)]
    assert on90 == set(gett.MMA_SHAPES)
    assert on80 and {cfg.mma for cfg in on80} == {"m8n8k4"}
    assert all(cfg.smem_bytes() <= 163 * 1024 for cfg in on80)
    assert gett.candidates(probs, 108, arch=80) and all(cfg.mma == "m8n8k4" for _, cfg in gett.candidates(probs, 108,
                                                                                                            arch=80))
    assert gett.candidates(probs, 80, arch=75) == []
