"""Bulk-copy GETT configurations (:attr:`GettConfig.bulk`), where they apply, and their source.

Which configurations exist (:meth:`GettConfig.bulk_valid`), what they occupy, which problems have
B's chunks contiguous (:attr:`Problem.bulk_run`), which candidates the autotuner gets
(:func:`gett.bulk_configs`), and that every candidate shape compiles with nvcc for sm_90 without
spilling (when nvcc is present). Their results are checked against ``numpy.einsum`` on the GPU
(``tests/runtime/test_gett_gpu.py``).
"""

import shutil
from dataclasses import replace
from itertools import product

import pytest

from chainexec.kernels import gett
from tests.conftest import gett_spills, nvcc_reports


def _bulk(warps=8, mma_m=5, mma_n=2, bk=72, stages=2, span=1024, a_k_fast=False, **kw):
    return gett.GettConfig(1, warps, mma_m, mma_n, bk, stages, "m16n8k4", a_k_fast, True, span=span, bulk=True, **kw)


def _strides(idx: str, sizes: dict) -> dict:
    """Row-major element strides of a tensor with indices ``idx``."""
    out, step = {}, 1
    for i in reversed(idx):
        out[i] = step
        step *= sizes[i]
    return out


def test_a_bulk_block_holds_all_its_rows_with_its_warps_along_n_and_one_warp_copying():
    cfg = _bulk()
    assert cfg.valid() and cfg.bm == 80 and cfg.bn == 1024 and cfg.threads == 288 and cfg.chunk() == 128
    assert cfg.bulk_pitches() == (76, 132)  # 12 and 4 mod 16 doubles
    assert cfg.bulk_elems() == (80 * 76, 72 * 132)
    assert cfg.smem_bytes() == (80 * 76 + 2 * 72 * 132) * gett.ELEM
    assert _bulk(bk=68).bulk_pitches()[0] == 76  # 68 + 4 is 8 mod 16: two rows a bank group apart
    assert cfg.name().startswith("chainexec_bulk_") and cfg.name() != _bulk(span=512).name()
    assert replace(cfg, wide=True).name() == cfg.name() + "_i64"
    assert _bulk(a_k_fast=True).name() != cfg.name()
    assert _bulk(copies=2).name() == cfg.name() + "_c2"


@pytest.mark.parametrize("change, valid", [
    ({}, True),
    ({"bk": gett.BULK_SUM, "warps_n": 4, "mma_n": 1, "mma_m": 1}, True),
    ({"bk": gett.BULK_SUM + 4}, False),  # longer than the sum a block holds
    ({"bk": 70}, False),  # not whole MMA steps
    ({"span": 1000}, False),  # not whole chunks of 128
    ({"stages": 1}, False),
    ({"stages": 3}, False),  # beyond shared memory
    ({"staged": True}, False),
    ({"mma": "m8n8k4"}, False),
    ({"warps_m": 2}, False),
    ({"b_n_fast": False}, False),  # B's rows are copied along n
    ({"mma_m": 6}, False),  # 48 accumulators a lane: more than 168 registers
    ({"mma_m": 6, "mma_n": 1}, True),
    ({"span": 0}, False),
    ({"span": 128 * gett.BULK_CHUNKS}, True),
    ({"span": 128 * (gett.BULK_CHUNKS + 1)}, False),  # more chunk offsets than static shared memory holds
    ({"copies": 2}, True),  # two runs of 64 a row of a chunk
    ({"copies": gett.BULK_COPIES}, True),
    ({"copies": 3}, False),  # 128 is not three equal runs
    ({"copies": 2 * gett.BULK_COPIES}, False),  # runs of 16: more copies than the warp issues in time
    ({"copies": 0}, False),
    # dynamic shared memory exactly the block's limit: the offsets and mbarriers do not fit beside
    ({"warps_n": 9, "mma_m": 4, "bk": 80, "span": 144 * 3}, False),
    ({"warps_n": 9, "mma_n": 1, "stages": 4, "span": 72 * 8}, True),  # a chunk of 72
    ({"warps_n": 9, "mma_n": 1, "stages": 4, "span": 72 * 8, "copies": 2}, True),  # two runs of 36
    ({"warps_n": 9, "mma_n": 1, "stages": 4, "span": 72 * 8, "copies": 4}, True),  # runs of 18: 144 bytes
    ({"warps_n": 9, "mma_n": 1, "stages": 4, "span": 72 * 8, "copies": 8}, False),
])
def test_bulk_limits(change, valid):
    cfg = replace(_bulk(), **change)
    assert cfg.valid() == valid
    if not valid:
        with pytest.raises(ValueError):
            gett.source(cfg)


def test_bulk_copies_need_sm_90():
    assert _bulk().valid(90) and not _bulk().valid(80)


@pytest.mark.parametrize("c, a, b, sizes, run", [
    # the AO→MO transforms of the TCCG set: B's n indices contiguous, merged into one run
    ("abcd", "ea", "ebcd", dict(a=72, b=72, c=72, d=72, e=72), 72 ** 3),
    ("abcd", "eb", "aecd", dict(a=72, b=72, c=72, d=72, e=72), 72 ** 2),
    ("abcd", "ec", "abed", dict(a=72, b=72, c=72, d=72, e=72), 72),
    ("abcd", "ea", "ebcd", dict(a=5, b=3, c=1, d=8, e=9), 24),  # an extent-1 index inside the run
    ("abcd", "ea", "ebcd", dict(a=5, b=3, c=4, d=7, e=9), 84),  # B's row stride 3·4·7 = 84 even
    ("abcd", "ea", "ebcd", dict(a=5, b=3, c=5, d=7, e=9), 0),  # 105, odd: rows not on 16 bytes
    ("ab", "ak", "kb", dict(a=8, b=96, k=5), 96),
    ("ab", "ak", "bk", dict(a=8, b=96, k=5), 0),  # B loaded along k
])
def test_bulk_run_is_the_contiguous_stretch_of_b_along_n(c, a, b, sizes, run):
    strides = tuple(_strides(x, sizes) for x in (c, a, b))
    p = gett.problem(tuple(c), tuple(a), tuple(b), sizes, strides)
    assert p.bulk_run == run
    if not run:
        assert gett.bulk_configs(p, 132) == []


def test_bulk_run_is_zero_where_n_is_blocked_or_a_stride_is_odd():
    """The (T) contractions' N groups walk C's and B's stride-1 indices in blocks: not one run."""
    sizes = dict(a=24, b=16, c=16, d=24, e=16, f=16, g=24)
    strides = tuple(_strides(x, sizes) for x in ("abcdef", "dega", "gfbc"))
    store = gett.problem(tuple("abcdef"), tuple("dega"), tuple("gfbc"), sizes, strides, "store")
    assert store.blocked and store.bulk_run == 0
    odd = gett.problem(("a", "b"), ("a", "k"), ("k", "b"), dict(a=8, b=64, k=5),
                       ({"a": 64, "b": 1}, {"a": 5, "k": 1}, {"k": 65, "b": 1}))
    assert odd.bulk_run == 0


def test_bulk_configs_hold_all_of_m_and_size_their_spans_for_whole_waves():
    sizes = dict(a=72, b=72, c=72, d=72, e=72)
    strides = tuple(_strides(x, sizes) for x in ("abcd", "ea", "ebcd"))
    p = gett.problem(tuple("abcd"), tuple("ea"), tuple("ebcd"), sizes, strides)
    found = gett.bulk_configs(p, 132)
    assert {(c.warps_n, c.mma_n, c.stages) for c in found} == set(gett.BULK_TILES)
    chunks = {c.chunk() for c in found}
    assert chunks == {128, 64, 144, 72} and {c.copies for c in found} == {1}
    for cfg in found:
        assert cfg.valid() and cfg.bm == 80 and cfg.bk == 72 and cfg.span % cfg.chunk() == 0
        blocks = -(-72 ** 3 // cfg.span)
        assert any(blocks <= 132 * w and blocks > 132 * w - 132 for w in gett.BULK_WAVES), cfg
    assert {c.span for c in found if c.chunk() == 128} == {23 * 128, 12 * 128}
    assert gett.bulk_configs(p, 132, arch=80) == []
    wide = dict(sizes, b=72 * 64)  # 64 times the columns: one wave would take 1470 chunks a block
    huge = gett.problem(tuple("abcd"), tuple("ea"), tuple("ebcd"), wide,
                        tuple(_strides(x, wide) for x in ("abcd", "ea", "ebcd")))
    assert {c.span // c.chunk() for c in gett.bulk_configs(huge, 132)} == {gett.BULK_CHUNKS}


@pytest.mark.parametrize("run, n, chunk, copies", [
    (72 ** 3, 72 ** 3, 128, 1),  # a run holds whole chunks
    (72, 72 ** 3, 144, 2),  # a chunk is two runs
    (72, 72 ** 3, 72, 1),
    (72, 72 ** 3, 128, 0),  # neither divides the other
    (72, 72 * 3, 288, 0),  # N not whole chunks: the last one's copies would pass B's end
    (16, 16 * 64, 128, 0),  # eight runs a chunk: more copies than BULK_COPIES
    (32, 32 * 64, 128, 4),
    (0, 128, 128, 0),
])
def test_bulk_copies_a_row_of_a_chunk_takes(run, n, chunk, copies):
    assert gett.bulk_copies(run, n, chunk) == copies


def test_bulk_configs_copy_a_chunk_of_runs_where_b_holds_runs_of_72():
    """AO→MO's third transform: B's index d (72) is its only one contiguous along n; the
    nine-warp chunks of 144 and 72 are two runs and one, the eight-warp ones none."""
    sizes = dict(a=72, b=72, c=72, d=72, e=72)
    strides = tuple(_strides(x, sizes) for x in ("abcd", "ec", "abed"))
    p = gett.problem(tuple("abcd"), tuple("ec"), tuple("abed"), sizes, strides)
    assert p.bulk_run == 72
    found = gett.bulk_configs(p, 132)
    assert {(c.chunk(), c.copies) for c in found} == {(144, 2), (72, 1)}
    assert all(c.valid() and c.warps_n == 9 and c.threads == 320 for c in found)


@pytest.mark.parametrize("sizes, order, why", [
    (dict(a=100, b=72, c=72, d=72, e=72), "load", "M of 100, more than BULK_ROWS m16 tiles: the tall shapes, kept"),
    (dict(a=72, b=72, c=72, d=72, e=132), "load", "a sum longer than a block holds"),
    (dict(a=72, b=72, c=72, d=36, e=72), "load", "runs of 72·72·36 = 186624: whole chunks of 128 and 64, kept"),
])
def test_bulk_configs_only_where_a_block_holds_the_sum(sizes, order, why):
    strides = tuple(_strides(x, sizes) for x in ("abcd", "ea", "ebcd"))
    p = gett.problem(tuple("abcd"), tuple("ea"), tuple("ebcd"), sizes, strides, order)
    found = gett.bulk_configs(p, 132)
    assert bool(found) == ("kept" in why), why


@pytest.mark.parametrize("b, c, d, chunks", [(72, 8, 72, {64: gett.BULK_TALL_CHUNKS, 32: gett.BULK_TALL_CHUNKS}),
                                              (1, 2, 96, {64: 3, 32: 6})])
def test_bulk_configs_where_m_takes_several_block_rows_are_the_tall_shapes(b, c, d, chunks):
    """M of 9·72 rows (more than BULK_ROWS m16 tiles): the shapes of BULK_TALL, two
    stages, spans of BULK_TALL_CHUNKS chunks, fewer where N (b·c·d columns) holds fewer."""
    sizes = dict(a=72, b=b, c=c, d=d, e=48, f=9)
    strides = tuple(_strides(x, sizes) for x in ("afbcd", "efa", "ebcd"))
    p = gett.problem(tuple("afbcd"), tuple("efa"), tuple("ebcd"), sizes, strides)
    assert p.dims[0] == 9 * 72 and p.bulk_run == b * c * d
    found = gett.bulk_configs(p, 132)
    assert {(x.warps_n, x.mma_m, x.mma_n) for x in found} == set(gett.BULK_TALL)
    assert all(x.valid() and x.stages == 2 and x.bk == 48 and x.span == x.chunk() * chunks[x.chunk()] for x in found)


def test_bulk_configs_are_offered_last_among_the_candidates():
    sizes = dict(a=72, b=72, c=72, d=72, e=72)
    strides = tuple(_strides(x, sizes) for x in ("abcd", "ea", "ebcd"))
    probs = gett.variants(tuple("abcd"), tuple("ea"), tuple("ebcd"), sizes, strides)
    cands = gett.candidates(probs, 132)
    bulk = [i for i, (_, cfg) in enumerate(cands) if cfg.bulk]
    assert bulk and bulk == list(range(len(cands) - len(bulk), len(cands)))
    assert not cands[0][1].bulk and not cands[0][1].span


def _grid():
    """Every bulk shape the autotuner may time: those of :data:`~chainexec.kernels.gett.BULK_TILES`
    with one m16 tile a warp and with the most it may hold (up to
    :data:`~chainexec.kernels.gett.BULK_ROWS`, within the accumulators a lane holds), and the tall
    ones (:data:`~chainexec.kernels.gett.BULK_TALL`); each at the shortest sum and the longest
    valid one (a lane's registers grow with the tiles and the sum), both of A's load directions,
    the index widths alternating."""
    def cfg(shape, ak, bk, copies):
        warps, mma_m, mma_n, stages = shape
        return _bulk(warps, mma_m, mma_n, bk, stages, 8 * mma_n * warps * 3, ak, copies=copies)

    tiles = []
    for w, mn, st in gett.BULK_TILES:
        held = [mm for mm in range(1, gett.BULK_ROWS + 1) if cfg((w, mm, mn, st), False, 4, 1).valid()]
        tiles += [(w, mm, mn, st) for mm in sorted({min(held), max(held)})]
    out = []
    for shape, ak in product(tiles + [(w, mm, mn, 2) for w, mm, mn in gett.BULK_TALL], (False, True)):
        copies = 1 + len(out) % 3 % 2
        valid = [bk for bk in range(4, gett.BULK_SUM + 1, 4) if cfg(shape, ak, bk, copies).valid()]
        out += [replace(cfg(shape, ak, bk, copies), wide=len(out) % 2 == 1) for bk in sorted({min(valid), max(valid)})]
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_bulk_kernels_compile_with_nvcc_without_spills(tmp_path):
    cfgs = _grid()
    assert len(cfgs) >= 32
    assert max(gett_spills(tmp_path, cfgs)) == 0
    assert all(f"{c.name()}(" in gett.source(c) and "cp.async.bulk" in gett.source(c) for c in cfgs)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_static_shared_memory_is_counted_within_the_block_limit(tmp_path):
    """ptxas's static shared memory of each bulk-copy kernel is at most
    :meth:`GettConfig.bulk_static_bytes`, so a valid configuration's dynamic and static shared
    memory together fit the block (the largest spans, both index widths, up to four copies)."""
    import re

    cfgs = []
    for (warps, mma_n, stages), mma_m, bk in product(gett.BULK_TILES, (1, 5), (72, gett.BULK_SUM)):
        for copies, wide in ((1, False), (2, True), (4, False)):
            cfg = _bulk(warps, mma_m, mma_n, bk, stages, 8 * mma_n * warps * gett.BULK_CHUNKS, copies=copies, wide=wide)
            if cfg.valid():
                cfgs.append(cfg)
    assert len(cfgs) >= 12
    # one source per index width (each declares its index type)
    log = "".join(nvcc_reports(tmp_path, ["\n".join(gett.source(c) for c in cfgs if c.wide == wide)
                                          for wide in (False, True)]))
    # ptxas reports each entry function's properties after the line that names it
    static = {name: int(smem) for name, smem in
              re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes smem", log, flags=re.S)}
    assert set(static) == {c.name() for c in cfgs}
    for cfg in cfgs:
        assert static[cfg.name()] <= cfg.bulk_static_bytes(), cfg.name()
        assert cfg.smem_bytes() + static[cfg.name()] <= gett.smem_limit(90)


@pytest.mark.parametrize("c, a, b, sizes, pad", [
    ("abcd", "ea", "ebcd", dict(a=5, b=3, c=1, d=8, e=9), 0),
    ("abcd", "eb", "aecd", dict(a=4, b=6, c=6, d=4, e=5), 0),
    ("lab", "lak", "lkb", dict(l=3, a=7, b=48, k=5), 2),  # B a view of a buffer 2 wider on every axis
    ("lab", "lkb", "lak", dict(l=2, a=32, b=10, k=4), 0),  # C's stride-1 index in the first operand: swapped
    ("abc", "bk", "bkac", dict(a=6, b=5, c=3, k=4), 0),  # two N indices merged, a batch index
])
def test_every_run_of_a_chunk_is_contiguous_and_starts_on_16_bytes(c, a, b, sizes, pad):
    """The property the bulk-copy kernel relies on, read off the tables themselves: for every even
    chunk that :func:`gett.bulk_copies` admits, each of its runs in B's N table is consecutive
    offsets from an even one, and B's K and batch offsets are even."""
    strides = [_strides(x, sizes) for x in (c, a, b)]
    if pad:
        padded = {i: sizes[i] + pad for i in b}
        strides[2] = _strides(b, padded)
    p = gett.problem(tuple(c), tuple(a), tuple(b), sizes, tuple(strides))
    assert p.bulk_run >= 2
    t = gett.tables(p, tuple(strides))
    assert all(t[key].size and (t[key] % 2 == 0).all() for key in ("bk", "bl"))
    N = p.dims[1]
    admitted = 0
    for chunk in range(2, gett.BULK_COPIES * p.bulk_run + 1, 2):
        copies = gett.bulk_copies(p.bulk_run, N, chunk)
        if copies and chunk % (2 * copies) == 0:
            run = chunk // copies
            rows = t["bn"].reshape(-1, run)
            assert (rows[:, 0] % 2 == 0).all() and (rows - rows[:, :1] == range(run)).all(), chunk
            admitted += copies > 1
    assert admitted or N == p.bulk_run
