"""Check and time chainexec's generated COGENT kernels on the 48 TCCG contractions (needs a GPU).

For each contraction and scale (1 = the sizes of ``shared/benchmarks/tccg.json``, 2 = every
extent doubled) it picks the model's configuration for the current GPU, compiles it, checks the
result against ``cupy.einsum`` on fresh random inputs (output poisoned with NaN first, so an
unwritten element fails; relative Frobenius error), and times the kernel, ``cupy.einsum`` and,
where importable, ``torch.einsum`` with CUDA events (median of repeats after a warm-up).

Layout: the index strings of tccg.json are used as given with **row-major** storage, i.e. the
last letter of each string is the stride-1 index (the original TCCG strings are column-major).

Usage: ``PYTHONPATH=. python3 benchmarks/tccg_kernels.py --out results.json [--scales 1 2]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np

from chainexec.provenance import provenance

REPO = Path(__file__).resolve().parents[1]


def rel_error(out, ref) -> float:
    """||out - ref||_F / ||ref||_F, accumulated slice by slice along axis 0 (bounded memory)."""
    import cupy

    num = den = 0.0
    for i in range(out.shape[0]):
        d = out[i] - ref[i]
        num += float(cupy.vdot(d, d).real)
        den += float(cupy.vdot(ref[i], ref[i]).real)
    return math.sqrt(num / den) if den else float("inf")


def time_gpu(fn, budget_s: float, min_reps: int = 3, max_reps: int = 50) -> tuple[float, int]:
    """Median milliseconds of ``fn()`` over repeats timed with CUDA events, after one warm-up;
    the number of repeats fits ``budget_s``."""
    import cupy

    fn()
    cupy.cuda.Device().synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    while True:
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
        if len(times) >= max_reps or (len(times) >= min_reps and
                                      sum(times) / 1e3 * (len(times) + 1) / len(times) > budget_s):
            break
    return float(np.median(times)), len(times)


def environment() -> dict:
    """Device, library versions, commit and date of this run."""
    env = provenance(gpu=True)
    env["cupy_accelerators"] = os.environ.get("CUPY_ACCELERATORS")
    try:
        import torch
        env["torch"] = torch.__version__
    except ImportError:
        env["torch"] = None
    return env


def run_case(case: dict, scale: int, kernel, budget_s: float, use_torch: bool) -> dict:
    """Check and time one contraction at one scale; returns a JSON-ready row."""
    import cupy

    c, a, b = case["C"], case["A"], case["B"]
    sizes = {i: n * scale for i, n in case["sizes"].items()}
    flops = 2 * math.prod(sizes.values())
    dtype = kernel.config.dtype
    nbytes = {t: math.prod(sizes[i] for i in s) * np.dtype(dtype).itemsize
              for t, s in (("A", a), ("B", b), ("C", c))}
    # our output, the einsum reference and einsum's transposed copies of an input and the output
    need = nbytes["A"] + nbytes["B"] + 3 * nbytes["C"] + max(nbytes["A"], nbytes["B"])
    free = cupy.cuda.runtime.memGetInfo()[0]
    if need > 0.9 * free:
        return {"id": case["id"], "name": case["name"], "scale": scale,
                "skipped": f"needs about {need / 2**30:.0f} GiB with the einsum reference, "
                           f"{free / 2**30:.0f} GiB free"}
    rng = cupy.random.default_rng(1000 * case["id"] + scale)
    A = rng.standard_normal([sizes[i] for i in a], dtype=dtype)
    B = rng.standard_normal([sizes[i] for i in b], dtype=dtype)
    C = cupy.full([sizes[i] for i in c], cupy.nan, dtype=dtype)
    kernel(A, B, C)
    ref = cupy.einsum(f"{a},{b}->{c}", A, B)
    err = rel_error(C, ref)
    # beta path: C <- 0.5 * A*B - 2 * C, compared with the same expression on the reference
    kernel(A, B, C, alpha=0.5, beta=-2.0)
    ref *= -1.5
    err_beta = rel_error(C, ref)
    del ref
    cfg = kernel.config
    row = {"id": case["id"], "name": case["name"], "group": case["group"], "scale": scale,
           "sizes": sizes, "gflop": flops / 1e9, "dtype": dtype,
           "rel_err": err, "rel_err_beta": err_beta,
           "config": {k: getattr(cfg, k) for k in ("x_operand", "tbx", "regx", "tby", "regy",
                                                  "tbk", "threads", "smem_bytes", "num_blocks",
                                                  "trans_total")}}
    t, n = time_gpu(lambda: kernel(A, B, C), budget_s)
    row["chainexec_ms"], row["chainexec_reps"] = t, n
    t, n = time_gpu(lambda: cupy.einsum(f"{a},{b}->{c}", A, B), budget_s)
    row["cupy_einsum_ms"], row["cupy_einsum_reps"] = t, n
    cupy.get_default_memory_pool().free_all_blocks()
    if use_torch:
        import torch

        tA, tB = torch.from_dlpack(A), torch.from_dlpack(B)
        t, n = time_gpu(lambda: torch.einsum(f"{a},{b}->{c}", tA, tB), budget_s)
        row["torch_einsum_ms"], row["torch_einsum_reps"] = t, n
        del tA, tB
        torch.cuda.empty_cache()
    for key in ("chainexec", "cupy_einsum", "torch_einsum"):
        if f"{key}_ms" in row:
            row[f"{key}_gflops"] = flops / (row[f"{key}_ms"] * 1e-3) / 1e9
    del A, B, C
    cupy.get_default_memory_pool().free_all_blocks()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tccg", default=str(REPO.parent / "shared" / "benchmarks" / "tccg.json"))
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    parser.add_argument("--ids", type=int, nargs="*", help="only these contraction ids")
    parser.add_argument("--budget", type=float, default=0.3,
                        help="seconds of timed repeats per method and case (at least 3 repeats)")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args(argv)

    from chainexec.planner.kernelconf import Device, choose_config
    from chainexec.runtime.kernels import get_kernel

    cases = json.load(open(args.tccg))
    if args.ids:
        cases = [c for c in cases if c["id"] in args.ids]
    use_torch = not args.no_torch
    if use_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            use_torch = False
    device = Device.from_cupy()
    result = {"environment": environment(), "device_model": asdict(device), "rows": [],
              "layout": "row-major: the last letter of each index string is stride-1"}
    jobs = [(case, s) for s in args.scales for case in cases]
    t0 = time.perf_counter()
    search_s = []

    def build(job):
        case, s = job
        sizes = {i: n * s for i, n in case["sizes"].items()}
        t = time.perf_counter()
        cfg = choose_config(case["C"], case["A"], case["B"], sizes, args.dtype, device)
        search_s.append(time.perf_counter() - t)
        return get_kernel(case["C"], case["A"], case["B"], sizes, args.dtype, config=cfg)

    with ThreadPoolExecutor(16) as pool:
        kernels = list(pool.map(build, jobs))
    result["compile_s"] = time.perf_counter() - t0
    result["max_search_s"] = max(search_s)
    print(f"configured and compiled {len(jobs)} kernels in {result['compile_s']:.1f} s",
          flush=True)
    for (case, s), kern in zip(jobs, kernels):
        try:
            row = run_case(case, s, kern, args.budget, use_torch)
        except Exception as exc:  # recorded, not hidden: one failing case must not lose the rest
            row = {"id": case["id"], "name": case["name"], "scale": s, "error": repr(exc)}
        result["rows"].append(row)
        if "error" in row or "skipped" in row:
            print(f"{case['id']:2d} x{s} {row.get('error') or 'SKIPPED ' + row['skipped']}",
                  flush=True)
        else:
            print(f"{row['id']:2d} x{s} {row['name']:18s} err={row['rel_err']:.1e}/"
                  f"{row['rel_err_beta']:.1e} ours={row['chainexec_gflops']:7.0f} "
                  f"cupy={row['cupy_einsum_gflops']:7.0f} "
                  f"torch={row.get('torch_einsum_gflops', float('nan')):7.0f} GFLOP/s", flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    tol = 1e-12 if args.dtype == "float64" else 1e-5
    bad = [r for r in result["rows"] if "skipped" not in r and (
        "error" in r or not r["rel_err"] <= tol or not r["rel_err_beta"] <= tol)]
    result["failures"] = [(r["id"], r["scale"]) for r in bad]
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"failures: {result['failures']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
