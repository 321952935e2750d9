"""Time every GETT configuration of a grid on TCCG cases, beyond the autotuner's few candidates.

    python3 benchmarks/gett_grid.py 31,44,20 OUT.json [SCALE]

For each case at ``SCALE`` (1, the default, is ``benchmarks/tccg.json``'s sizes; 2 doubles every
extent, as ``chainexec bench tccg --scales 2``): fresh random operands, each configuration of
:data:`TILES` (every MMA shape of :data:`chainexec.kernels.gett.MMA_SHAPES`, :data:`STAGES`,
direct and staged epilogues) for every order :func:`chainexec.kernels.gett.variants` offers,
checked against ``cupy.einsum`` and timed by :func:`chainexec.bench.gett_rows`; one line per case
with the roofline bound and the best configuration, every row in OUT.json. Needs a GPU with FP64
MMA (sm_90 configurations)."""

import itertools
import json
import math
import sys

import cupy

from chainexec.bench import bound_ms, copy_gbs, dgemm_gflops, gett_rows, load_cases, worst
from chainexec.kernels import gett

TILES = gett.TILES + ((2, 2, 2, 4, 8), (2, 2, 2, 4, 16), (1, 4, 4, 4, 16), (4, 1, 4, 4, 16), (2, 4, 2, 4, 16),
                      (4, 2, 4, 2, 16), (3, 2, 6, 4, 16), (3, 2, 6, 4, 8), (3, 4, 6, 4, 16), (3, 4, 6, 2, 16),
                      (3, 2, 6, 8, 16), (3, 1, 6, 8, 16), (1, 4, 6, 4, 16), (1, 2, 6, 4, 16), (1, 4, 6, 8, 8),
                      (3, 2, 2, 4, 16), (3, 4, 2, 4, 16), (3, 4, 2, 8, 16), (3, 2, 6, 4, 32))
"""(warps_m, warps_n, mma_m, mma_n, bk) as in :data:`chainexec.kernels.gett.TILES`, smaller tiles,
and tiles of 48 and 144 rows (TCCG's M at scale 2 in the ML and AO→MO cases)."""
STAGES = (2, 3)
"""Pipeline depths timed."""


def grid(problems: dict, sm_count: int) -> list[tuple[str, gett.GettConfig]]:
    """Every valid configuration of :data:`TILES` for each order's problem (``sm_count`` unused:
    :func:`chainexec.bench.gett_rows`' chooser signature)."""
    out = []
    for (order, p), (wm, wn, mm, mn, bk), shape, stages, staged in itertools.product(
            problems.items(), TILES, gett.MMA_SHAPES, STAGES, (False, True)):
        rows = gett.MMA_SHAPES[shape][0]
        cfg = gett.GettConfig(wm, wn, mm * 8 // rows, mn, bk, stages, shape, p.a_k_fast, p.b_n_fast, staged, p.wide,
                              turn=p.turn)
        if mm * 8 % rows == 0 and cfg.valid():
            out.append((order, cfg))
    return out


def main(ids: list[int], out: str, scale: int = 1) -> None:
    cases = {c["id"]: c for c in load_cases("benchmarks/tccg.json")}
    roof = (dgemm_gflops(), copy_gbs())
    rows = []
    for cid in ids:
        case = cases[cid]
        c, a, b = case["C"], case["A"], case["B"]
        sizes = {i: n * scale for i, n in case["sizes"].items()}
        A = cupy.random.standard_normal([sizes[i] for i in a])
        B = cupy.random.standard_normal([sizes[i] for i in b])
        C = cupy.empty([sizes[i] for i in c])
        ref = cupy.einsum(f"{a},{b}->{c}", A, B)
        results = sorted(gett_rows(c, a, b, sizes, A, B, C, ref, 0.01, choose=grid)[0], key=lambda r: r["ms"])
        nbytes = sum(math.prod(sizes[i] for i in s) * 8 for s in (a, b, c))
        bound = bound_ms(2 * math.prod(sizes.values()), nbytes, *roof)
        error = worst(*(r["rel_err"] for r in results), *(r["rel_err_beta"] for r in results))
        print(f"case {cid} {case['name']} scale {scale} bound {bound:.4f} ms best {results[0]['ms']:.4f} ms "
              f"({results[0]['config']} {results[0]['order']}) of {len(results)}, max error {error:.1e}", flush=True)
        rows.append({"id": cid, "name": case["name"], "scale": scale, "bound_ms": bound, "results": results})
        del A, B, C, ref
        cupy.get_default_memory_pool().free_all_blocks()
    with open(out, "w") as f:
        json.dump({"roof": roof, "rows": rows}, f)


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1].split(",")], sys.argv[2], *(int(x) for x in sys.argv[3:4]))
