"""Short-sum GETT configurations (:attr:`GettConfig.span`) and their generated source.

Which configurations exist (the limits of :meth:`GettConfig.short_valid`), what they occupy, that
every one compiles with nvcc for sm_90 without spilling (when nvcc is present), and that the
launch refuses a sum longer than the kernel holds. Their results are checked against
``numpy.einsum`` on the GPU (``tests/runtime/test_gett_gpu.py``).
"""

import shutil
from dataclasses import replace
from itertools import product

import pytest

from chainexec.kernels import gett
from tests.conftest import gett_spills


def _short(warps=4, mma_m=2, mma_n=8, bk=24, stages=3, span=256, a_k_fast=False, b_n_fast=True, **kw):
    return gett.GettConfig(warps, 1, mma_m, mma_n, bk, stages, "m16n8k4", a_k_fast, b_n_fast, span=span, **kw)


def test_a_short_sum_block_spans_its_columns_with_one_warp_along_n():
    cfg = _short()
    assert cfg.valid() and cfg.bm == 4 * 2 * 16 and cfg.bn == 256 and cfg.threads == 128
    a, b = cfg.short_elems()
    assert (a, b) == (128 * 25, 24 * 68)  # A's rows of bk + 1 (gathered along m); B's chunk of 64 columns, pitch 68
    assert _short(a_k_fast=True).short_elems()[0] == 128 * 28  # gathered along k: bk + 4
    assert cfg.smem_bytes() == (a + 3 * b) * gett.ELEM
    along_k = _short(b_n_fast=False)
    assert along_k.short_elems()[1] == 64 * 28 and along_k.smem_bytes() == cfg.smem_bytes() - 3 * 24 * 68 * 8 + 3 * 64 * 28 * 8
    assert cfg.name().startswith("chainexec_shortsum_") and cfg.name() != _short(span=512).name()
    assert replace(cfg, wide=True).name() == cfg.name() + "_i64"


@pytest.mark.parametrize("bk", range(4, gett.SHORT_SUM + 1, 4))
def test_a_warp_gathering_a_along_m_writes_every_bank_pair_twice(bk):
    """32 lanes copy one column of 32 consecutive rows of A's tile: with the pitch of A gathered
    along m, no eight-byte bank pair (16 of them) takes more than two of the copies."""
    pitch = _short(bk=bk, mma_m=1).short_pitch()
    pairs = [(m * pitch) % 16 for m in range(32)]
    assert max(pairs.count(p) for p in range(16)) == 2


@pytest.mark.parametrize("change, valid", [
    ({}, True),
    ({"bk": gett.SHORT_SUM}, True),  # two m16 tiles of 48: 96 fragment registers a lane
    ({"bk": gett.SHORT_SUM + 4, "mma_m": 1}, False),  # longer than a short sum
    ({"bk": 26}, False),  # not whole MMA steps
    ({"span": 200}, False),  # not whole chunks of 64
    ({"stages": 1}, False),
    ({"staged": True}, False),
    ({"mma": "m8n8k4"}, False),
    ({"warps_n": 2}, False),
    ({"mma_m": 4, "bk": 28}, False),  # 4 × 28 fragment registers: too many
    ({"warps_m": 16, "mma_m": 2, "bk": 48, "mma_n": 16, "stages": 8}, False),  # beyond shared memory
])
def test_short_sum_limits(change, valid):
    cfg = replace(_short(), **change)
    assert cfg.valid() == valid
    if not valid:
        with pytest.raises(ValueError):
            gett.source(cfg)


def test_short_sums_need_sm_90():
    assert _short().valid(90) and not _short().valid(80)


def _grid():
    """Every short-sum shape the autotuner may time (:data:`~chainexec.kernels.gett.SHORT_TILES`),
    at the shortest sum and at the longest its fragments hold (the registers a lane gives them
    grow with the sum), with each load direction of A and of B, the index widths alternating."""
    out = []
    for (warps, mma_m, mma_n, span, stages), (ak, bn) in product(gett.SHORT_TILES, product((False, True), repeat=2)):
        for bk in (4, min(gett.SHORT_SUM, gett.FRAGMENT_REGISTERS // mma_m)):
            cfg = _short(warps, mma_m, mma_n, bk, stages, span, ak, bn)
            if cfg.valid():
                out.append(replace(cfg, wide=len(out) % 2 == 1))
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_short_sum_kernels_compile_with_nvcc_without_spills(tmp_path):
    cfgs = _grid()
    assert max(gett_spills(tmp_path, cfgs)) == 0
    assert all(f"{c.name()}(" in gett.source(c) for c in cfgs)


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("K, bk", [(0, 4), (1, 4), (21, 24), (23, 24), (24, 24), (25, 28), (45, 48), (48, 48),
                                   (49, None)])
def test_short_configs_hold_the_whole_sum(K, bk, contiguous):
    """Each short-sum candidate sums ``K`` rounded up to whole MMA steps, and only the shapes whose
    fragments fit; none past :data:`~chainexec.kernels.gett.SHORT_TUNED` where B's chunk rows are
    gathered (B's columns interleaved with the summed index), none past
    :data:`~chainexec.kernels.gett.SHORT_SUM` where each is one contiguous run."""
    sizes = dict(a=40, b=64, c=2, k=K)
    b = {"k": 128, "b": 2, "c": 1} if contiguous else {"b": 2 * max(K, 1), "k": 2, "c": 1}
    p = gett.problem(("a", "b", "c"), ("a", "k"), ("k", "b", "c"), sizes,
                     ({"a": 128, "b": 2, "c": 1}, {"a": max(K, 1), "k": 1}, b))
    assert p.b_n_fast and (p.bulk_run == 128 if contiguous or K <= 1 else p.bulk_run < 32)
    found = gett.short_configs(p)
    if bk is None or (bk > gett.SHORT_TUNED and not contiguous):
        assert found == []
        return
    assert found and all(cfg.bk == bk and cfg.span and cfg.valid() for cfg in found)
    assert {(c.warps_m, c.mma_m, c.mma_n, c.span, c.stages) for c in found} == {
        t for t in gett.SHORT_TILES if t[1] * bk <= gett.FRAGMENT_REGISTERS}


def test_short_configs_past_short_tuned_take_the_chunks_a_run_holds_whole():
    """B contiguous along N in runs of 64 columns (its index of 64 inside an index of 2 lying
    farther apart): past :data:`~chainexec.kernels.gett.SHORT_TUNED` only the shapes whose
    chunks (32 or 64 columns) a run holds whole, not those of 128."""
    sizes = dict(a=40, b=64, c=2, k=32)
    p = gett.problem(("a", "c", "b"), ("a", "k"), ("c", "k", "b"), sizes,
                     ({"a": 128, "c": 64, "b": 1}, {"a": 32, "k": 1}, {"c": 64 * 32, "k": 64, "b": 1}))
    assert p.bulk_run == 64 and p.dims[2] == 32
    found = gett.short_configs(p)
    assert found and {8 * c.mma_n for c in found} == {32, 64}
    assert {(c.warps_m, c.mma_m, c.mma_n, c.span, c.stages) for c in found} == {
        t for t in gett.SHORT_TILES if 64 % (8 * t[2]) == 0}
    assert gett.short_configs(p, arch=80) == []
