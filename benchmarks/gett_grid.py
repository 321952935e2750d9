"""Time every GETT configuration of a grid on TCCG cases, beyond the autotuner's few candidates.

    python3 benchmarks/gett_grid.py 31,44,20 OUT.json

For each case: fresh random operands, each configuration of :data:`TILES` (m16n8k4, two stages,
direct and staged epilogues) for every order :func:`chainexec.kernels.gett.variants` offers,
checked against ``cupy.einsum`` (relative error) and timed (median of up to 20 CUDA-event runs);
one line per case with the roofline bound and the best configuration, every row in OUT.json.
Needs a GPU with FP64 MMA (sm_90 configurations)."""

import itertools
import json
import math
import sys
import time

import cupy

from chainexec.bench import bound_ms, copy_gbs, dgemm_gflops, load_cases, rel_error, time_gpu
from chainexec.kernels import gett
from chainexec.runtime import kernelcache
from chainexec.runtime.launch import GettTables, gett_function, launch_gett

TILES = gett.TILES + ((2, 2, 2, 4, 8), (2, 2, 2, 4, 16), (1, 4, 4, 4, 16), (4, 1, 4, 4, 16), (2, 4, 2, 4, 16),
                      (4, 2, 4, 2, 16))
"""(warps_m, warps_n, mma_m, mma_n, bk) as in :data:`chainexec.kernels.gett.TILES`, and smaller tiles."""


def grid(p: gett.Problem) -> list[gett.GettConfig]:
    out = []
    for (wm, wn, mm, mn, bk), staged in itertools.product(TILES, (False, True)):
        cfg = gett.GettConfig(wm, wn, mm * 8 // 16, mn, bk, 2, "m16n8k4", p.a_k_fast, p.b_n_fast, staged)
        if mm * 8 % 16 == 0 and cfg.valid():
            out.append(cfg)
    return out


def main(ids: list[int], out: str) -> None:
    cases = {c["id"]: c for c in load_cases("benchmarks/tccg.json")}
    roof = (dgemm_gflops(), copy_gbs())
    rows = []
    for cid in ids:
        case = cases[cid]
        c, a, b, sizes = case["C"], case["A"], case["B"], case["sizes"]
        A = cupy.random.standard_normal([sizes[i] for i in a])
        B = cupy.random.standard_normal([sizes[i] for i in b])
        C = cupy.full([sizes[i] for i in c], cupy.nan)
        ref = cupy.einsum(f"{a},{b}->{c}", A, B)
        strides = tuple(dict(zip(idx, (s // 8 for s in x.strides))) for idx, x in ((c, C), (a, A), (b, B)))
        probs = gett.variants(tuple(c), tuple(a), tuple(b), sizes, strides)
        jobs = [(o, cfg) for o, p in probs.items() for cfg in grid(p)]
        start = time.perf_counter()
        kernelcache.precompile([(cfg.name(), gett.source(cfg)) for _, cfg in jobs], "90")
        compile_s = time.perf_counter() - start
        flops = 2 * math.prod(sizes.values())
        nbytes = sum(math.prod(sizes[i] for i in s) * 8 for s in (a, b, c))
        results = []
        for order, cfg in jobs:
            p = probs[order]
            tables = GettTables(p, strides)
            left, right = (B, A) if p.swap else (A, B)
            fn = gett_function(cfg)
            C[...] = cupy.nan
            launch_gett(cfg, tables, C, left, right, 1.0, 0.0)
            err = rel_error(C, ref)
            ms, _ = time_gpu(lambda: launch_gett(cfg, tables, C, left, right, 1.0, 0.0), 0.01, max_reps=20)
            results.append({"order": order, "config": cfg.name(), "ms": ms, "err": err, "regs": fn.num_regs,
                            "local": fn.local_size_bytes, "blocked": p.blocked})
        results.sort(key=lambda r: r["ms"])
        bound = bound_ms(flops, nbytes, *roof)
        print(f"case {cid} {case['name']} bound {bound:.4f} ms best {results[0]['ms']:.4f} ms "
              f"({results[0]['config']} {results[0]['order']}) of {len(results)}, compile {compile_s:.1f} s, "
              f"max error {max(r['err'] for r in results):.1e}", flush=True)
        rows.append({"id": cid, "name": case["name"], "bound_ms": bound, "results": results})
        del A, B, C, ref
        cupy.get_default_memory_pool().free_all_blocks()
    with open(out, "w") as f:
        json.dump({"roof": roof, "rows": rows}, f)


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1].split(",")], sys.argv[2])
