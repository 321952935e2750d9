"""COGENT configuration space, pruning and DRAM-transaction model (no GPU needed).

The 48 TCCG contractions come from ``benchmarks/tccg.json``; their index strings are used as
row-major (last letter stride-1).
"""

import json
import math
import time
from dataclasses import asdict, replace

import pytest

from chainexec.kernels.codegen import generate
from chainexec.kernels.kernelconf import (Device, KernelConfig, choose_config, config_rank,
                                          enumerate_configs, parse_contraction)
from tests.conftest import TCCG

CASES = json.loads(TCCG.read_text())
H100 = Device.H100()


def _ceil(n, t):
    return -(-n // t)


def _transactions(order, tiles, sizes, ebytes, tbytes):
    """Independent scalar re-statement of Algorithm 3 for one tile: contiguous run from the
    last index while tiles cover whole extents, one or more transactions per run."""
    elems = math.prod(min(tiles.get(i, 1), sizes[i]) for i in order)
    cont = 1
    for i in reversed(order):
        t = min(tiles.get(i, 1), sizes[i])
        cont *= t
        if t < sizes[i]:
            break
    return elems // cont * _ceil(cont * ebytes, tbytes)


def _check_invariants(cfg: KernelConfig, device: Device, relaxed: bool):
    c, a, b = cfg.c, cfg.a, cfg.b
    sizes = dict(cfg.sizes)
    xs, ys = (a, b) if cfg.x_operand == "A" else (b, a)
    ext_x = {i for i in xs if i in c}
    ext_y = {i for i in ys if i in c}
    internal = set(a) & set(b)
    tiles = dict(cfg.tiles)
    # each index mapped only to its own role
    assert {i for i, _ in cfg.tbx + cfg.regx} <= ext_x
    assert {i for i, _ in cfg.tby + cfg.regy} <= ext_y
    assert {i for i, _ in cfg.tbk} <= internal
    assert c[-1] in xs
    for i in ext_x | ext_y | internal:
        f = dict(cfg.tbx + cfg.tby + cfg.tbk).get(i, 1) * dict(cfg.regx + cfg.regy).get(i, 1)
        assert tiles[i] == f
    # sizes of the dimensions
    assert cfg.size_tbx == math.prod(f for _, f in cfg.tbx)
    assert cfg.size_regx == math.prod(f for _, f in cfg.regx)
    assert cfg.size_tby == math.prod(f for _, f in cfg.tby)
    assert cfg.size_regy == math.prod(f for _, f in cfg.regy)
    assert cfg.size_tbk == math.prod(f for _, f in cfg.tbk)
    assert cfg.threads == cfg.size_tbx * cfg.size_tby
    # hardware constraints (Section IV-A-1)
    ebytes = 8 if cfg.dtype == "float64" else 4
    x_tile, y_tile = cfg.size_tbx * cfg.size_regx, cfg.size_tby * cfg.size_regy
    pad_x, pad_y = int(xs[-1] in internal), int(ys[-1] in internal)
    assert cfg.smem_bytes == (x_tile + pad_x + y_tile + pad_y) * cfg.size_tbk * ebytes
    assert cfg.smem_bytes <= device.smem_per_block
    assert cfg.threads <= device.max_threads_per_block
    assert cfg.regs_per_thread >= (ebytes // 4) * cfg.size_regx * cfg.size_regy
    assert cfg.regs_per_thread <= device.regs_per_thread
    assert cfg.regs_per_thread * cfg.threads <= device.regs_per_sm
    # performance constraints (Section IV-A-2): coalescing, enough blocks
    assert cfg.tbx[0][0] == c[-1] or sizes[c[-1]] == 1
    for t in (a, b):
        assert tiles[t[-1]] > 1 or sizes[t[-1]] == 1
    blocks = math.prod(_ceil(sizes[i], tiles[i]) for i in c)
    assert cfg.num_blocks == blocks
    assert cfg.num_steps == math.prod(_ceil(sizes[i], tiles[i]) for i in internal)
    if not relaxed:
        assert blocks >= device.sm_count
    # cost model (Algorithm 3), recomputed independently
    tb = device.dram_transaction_bytes
    per_step_x = _transactions(xs, tiles, sizes, ebytes, tb)
    per_step_y = _transactions(ys, tiles, sizes, ebytes, tb)
    assert cfg.trans_x == blocks * cfg.num_steps * per_step_x
    assert cfg.trans_y == blocks * cfg.num_steps * per_step_y
    assert cfg.trans_total == cfg.trans_x + cfg.trans_y + cfg.trans_c


@pytest.mark.parametrize("case", CASES, ids=[f"{c['id']}-{c['name']}" for c in CASES])
def test_tccg_enumeration_pruning_and_choice(case):
    c, a, b, sizes = case["C"], case["A"], case["B"], case["sizes"]
    t0 = time.perf_counter()
    best = choose_config(c, a, b, sizes, "float64", H100)
    generate(c, a, b, sizes, "float64", best)
    elapsed = time.perf_counter() - t0
    print(f"\n{case['id']:2d} {case['name']}: search+generation {elapsed * 1e3:.1f} ms")
    configs, stats = enumerate_configs(c, a, b, sizes, "float64", H100)
    assert configs and stats["survivors"] == len(configs)
    assert stats["total"] == len(configs) + sum(stats["removed"].values())
    assert len({(k.tbx, k.regx, k.tby, k.regy, k.tbk) for k in configs}) == len(configs)
    for cfg in configs:
        _check_invariants(cfg, H100, stats["relaxed_thread_blocks"])
    assert best == min(configs, key=config_rank)
    assert best.trans_total == min(k.trans_total for k in configs)


def test_tccg_pruning_statistics_summary():
    """Print how much each constraint pruned over all 48 (the paper reports ~97% pruned)."""
    total, removed = 0, {}
    for case in CASES:
        _, stats = enumerate_configs(case["C"], case["A"], case["B"], case["sizes"], "float64",
                                     H100)
        total += stats["total"]
        for k, v in stats["removed"].items():
            removed[k] = removed.get(k, 0) + v
    print(f"\n{total} configurations, removed {removed} "
          f"({sum(removed.values()) / total:.0%} pruned)")
    assert removed["coalescing"] > 0 and sum(removed.values()) < total


def test_hardware_constraints_prune_on_a_small_device():
    small = replace(H100, smem_per_block=8 * 1024, regs_per_thread=96, max_threads_per_block=128)
    sizes = dict(a=512, b=512, c=512)
    configs, stats = enumerate_configs("ab", "ac", "cb", sizes, "float64", small)
    assert stats["removed"]["shared_memory"] > 0
    assert stats["removed"]["registers"] > 0
    assert stats["removed"]["threads"] > 0
    assert configs
    for cfg in configs:
        _check_invariants(cfg, small, stats["relaxed_thread_blocks"])
    full, _ = enumerate_configs("ab", "ac", "cb", sizes, "float64", H100)
    assert len(configs) < len(full)


def test_thread_block_constraint_relaxes_when_nothing_survives():
    sizes = dict(a=8, b=8, c=8)
    configs, stats = enumerate_configs("ab", "ac", "cb", sizes, "float64", H100)
    assert stats["relaxed_thread_blocks"]
    assert configs
    assert len({k.num_blocks for k in configs}) == 1
    all_blocks = [k.num_blocks for k in enumerate_configs(
        "ab", "ac", "cb", sizes, "float64", replace(H100, sm_count=1))[0]]
    assert configs[0].num_blocks == max(all_blocks)


def test_gemm_transactions_by_hand():
    """C[a,b] = A[a,c] B[c,b], 256^3, one SM so no block constraint.  The chosen 128x128x16
    tile: B tile c16 x b128 is 16 runs of 1 KiB = 128 transactions per step, A tile a128 x c16
    is 128 runs of 128 B = 128 per step; 4 blocks x 16 steps.  The store writes 16 contiguous
    doubles per thread row: 128*128/16 = 1024 transactions per block."""
    cfg = choose_config("ab", "ac", "cb", dict(a=256, b=256, c=256), "float64",
                        replace(H100, sm_count=1))
    assert (cfg.tile("a"), cfg.tile("b"), cfg.tile("c")) == (128, 128, 16)
    assert cfg.x_operand == "B" and cfg.tbx[0] == ("b", 16)
    assert (cfg.trans_x, cfg.trans_y, cfg.trans_c) == (4 * 16 * 128, 4 * 16 * 128, 4 * 1024)


def test_model_charges_short_contiguous_runs():
    """GEMM C[a,b] = A[a,c] B[c,b]: A's FVI c is internal, so TBk sets A's contiguous run.
    With TBk = 4 each 32-byte run of A still costs a whole 128-byte transaction, so A costs 4x
    the transactions of TBk = 16 (4x the steps at the same per-step count), while B's loads
    (runs along b) cost the same."""
    configs, _ = enumerate_configs("ab", "ac", "cb", dict(a=512, b=512, c=512), "float64", H100)
    by_map = {}
    for cfg in configs:
        by_map.setdefault((cfg.tbx, cfg.regx, cfg.tby, cfg.regy), {})[cfg.tbk] = cfg
    pairs = [(m[(("c", 4),)], m[(("c", 16),)]) for m in by_map.values()
             if (("c", 4),) in m and (("c", 16),) in m]
    assert pairs
    for short, long_ in pairs:
        assert short.trans_y == 4 * long_.trans_y
        assert short.trans_x == long_.trans_x
        assert short.trans_total > long_.trans_total


def test_float32_allows_larger_or_equal_tiles_and_halves_registers():
    sizes = dict(a=1024, b=1024, c=1024)
    c64 = choose_config("ab", "ac", "cb", sizes, "float64", H100)
    c32 = choose_config("ab", "ac", "cb", sizes, "float32", H100)
    assert c32.smem_bytes <= H100.smem_per_block
    assert c32.regs_per_thread < c64.regs_per_thread


def test_config_json_round_trip():
    cfg = choose_config("abcd", "aebf", "dfce", {i: 72 for i in "abcdef"}, "float64", H100)
    back = KernelConfig.from_dict(json.loads(json.dumps(asdict(cfg))))
    assert back == cfg


@pytest.mark.parametrize("c,a,b,sizes,msg", [
    ("abc", "acd", "bdc", dict(a=2, b=2, c=2, d=2), "all three"),       # batch index c
    ("ab", "ac", "cd", dict(a=2, b=2, c=2, d=2), "exactly two"),          # b only in C
    ("ab", "a1", "1b", dict(a=2, b=2), "not a plain identifier"),
    ("ab", "aac", "cb", dict(a=2, b=2, c=2), "repeated"),
    ("ab", "ac", "cb", dict(a=2, b=2), "extent"),
    ("ab", "ac", "cb", dict(a=2, b=0, c=2), "extent"),
    ("", "ac", "ca", dict(a=2, c=2), "at least one"),
    ("ab", "", "ab", dict(a=2, b=2), "scalar factor"),                    # was an IndexError
    ("ab", "ab", "", dict(a=2, b=2), "scalar factor"),
])
def test_invalid_contractions_raise(c, a, b, sizes, msg):
    with pytest.raises(ValueError, match=msg):
        enumerate_configs(c, a, b, sizes, "float64", H100)


def test_sequences_of_names_and_dtype_checks():
    con = parse_contraction(["i1", "j_2"], ["i1", "k"], ["k", "j_2"], {"i1": 3, "j_2": 4, "k": 5})
    assert con.x_operand == "B" and con.internal == ("k",)
    with pytest.raises(ValueError, match="not a plain identifier"):
        parse_contraction(["1i"], ["1i", "k"], ["k"], {"1i": 2, "k": 2})
    with pytest.raises(ValueError, match="not a plain identifier"):
        parse_contraction(["int"], ["int", "k"], ["k"], {"int": 2, "k": 2})  # a C keyword
    with pytest.raises(ValueError, match="dtype"):
        enumerate_configs("ab", "ac", "cb", dict(a=2, b=2, c=2), "complex128", H100)
