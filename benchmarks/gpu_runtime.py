"""Time the four-index transform end to end on the CuPy backend (and on NumPy for comparison).

Writes a copy of ``configs/fourindex.yaml`` at a GPU-sized scale into ``--workdir`` (AO extent
``--ao``, MO extent ``--mo``, ``--global`` and ``--device`` memory), generates its inputs, then
runs it in this process (one rank) once per variant and repetition:

* ``cupy:auto`` — the backend picks kernel or TTGT per (contraction, tile shape) by timing both once;
* ``cupy:kernel`` / ``cupy:ttgt`` — the method forced (``CHAINEXEC_GPU_METHOD``);
* ``numpy`` — the NumPy backend on the host's cores (``--numpy``).

For each run it records measured bytes (and whether they equal the prediction), seconds per level
(the executor's counters; on the GPU ``contract`` synchronizes, so ``compute`` is device time),
wall seconds, end-to-end and compute-only TFLOP/s (plan flops over those seconds), the CuPy
memory pool's bytes held after the run, and the backend's per-contraction choices with the timed
seconds of each method. The first run of each variant's output is checked with
:func:`chainexec.api.verify` (full ``numpy.einsum``, independent of the runtime). It also times
host↔device copies: pageable versus pinned, at two sizes.

Usage (from the repository root, on a machine with a GPU)::

    PYTHONPATH=. python3 benchmarks/gpu_runtime.py --workdir /tmp/gr --out gpu_runtime.json --numpy
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from chainexec.provenance import provenance
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chainexec import api  # noqa: E402
from chainexec.report import matches  # noqa: E402
from chainexec.runtime import device  # noqa: E402
from chainexec.runtime.backends.cupy import CupyBackend  # noqa: E402
from chainexec.runtime.device import TUNED  # noqa: E402


def environment() -> dict:
    """Device, host, library versions, commit and date of this run."""
    env = provenance(gpu=True)
    try:
        from threadpoolctl import threadpool_info

        env["blas"] = [{k: i.get(k) for k in ("internal_api", "num_threads", "version")} for i in threadpool_info()]
    except ImportError:
        env["blas"] = None
    return env


def write_config(workdir: Path, ao: int, mo: int, global_memory: str, device_memory: str) -> Path:
    """configs/fourindex.yaml at the given scale, its files inside ``workdir``."""
    cfg = yaml.safe_load((REPO / "configs" / "fourindex.yaml").read_text())
    cfg["ranges"] = {"ao": ao, "mo": mo}
    cfg["machine"] = {"global_memory": global_memory, "device_memory": device_memory}
    for t in cfg["tensors"].values():
        t["source"]["file"] = "input.h5"
    cfg["outputs"]["B"]["file"] = "output.h5"
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "fourindex.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def one_run(config: Path, backend: str, method: str | None) -> dict:
    """One ``api.run`` in this process, with the backend object captured for its choices."""
    import cupy

    captured = []

    def capture(name, comm):
        captured.append(device.select(name, comm))
        return captured[-1]

    os.environ["CHAINEXEC_GPU_METHOD"] = method or "auto"
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    api.select, saved = capture, api.select
    try:
        t0 = time.perf_counter()
        result = api.run(config, backend=backend)
        wall = time.perf_counter() - t0
    finally:
        api.select = saved
    measured, predicted = result["measured"], result["predicted"]
    flops = measured["flops"]
    chosen = captured[0]
    record = {"backend": chosen.name, "method": method, "wall_s": wall,
              "total_s": measured["total_seconds"], "seconds": measured["seconds"],
              "bytes_match": matches(predicted, measured), "bytes": measured["bytes"], "flops": flops,
              "tflops_end_to_end": flops / measured["total_seconds"] / 1e12,
              "tflops_compute": flops / measured["seconds"]["compute"] / 1e12,
              "memory_peak": measured["memory_peak"], "pool_bytes_held": int(pool.total_bytes())}
    if TUNED in chosen.capabilities:
        record["choices"] = [{"out": list(k[0]), "a": list(k[1]), "b": list(k[2]), "a_shape": list(k[3]),
                              "b_shape": list(k[4]), "dtype": k[5], **asdict(ch)}
                             for k, ch in chosen.choices.items()]
    return record


def copy_rates(sizes_mib=(16, 256), reps: int = 5) -> list[dict]:
    """GB/s of host→device and device→host copies: pageable NumPy arrays (``cupy.asarray`` /
    ``cupy.asnumpy``), a pageable array copied into a fresh pinned buffer and then DMA'd (the
    staging that ``upload`` does not do, measured to show why), the backend's ``upload`` of
    a pinned array and ``to_host_async`` (into fresh pinned memory, waited for), and copies from/to an already
    pinned array. Median of ``reps`` after one warm-up."""
    import cupy
    import cupyx

    backend = CupyBackend(cupy)
    out = []
    for mib in sizes_mib:
        host = np.random.default_rng(0).standard_normal(mib << 17)  # mib MiB of float64
        pinned = cupyx.empty_pinned(host.shape, host.dtype)
        pinned[...] = host
        dev = cupy.asarray(host)
        def staged():
            buf = cupyx.empty_pinned(host.shape, host.dtype)
            np.copyto(buf, host)
            dev.set(buf)

        cases = {"h2d_pageable": lambda: cupy.asarray(host), "h2d_staged_via_pinned": staged,
                 "h2d_upload_pinned": lambda: backend.upload(dev, pinned), "h2d_from_pinned": lambda: dev.set(pinned), "d2h_pageable": lambda: cupy.asnumpy(dev),
                 "d2h_to_host_async_pinned": lambda: backend.to_host_async(dev), "d2h_into_pinned": lambda: dev.get(out=pinned)}
        row = {"mib": mib}
        for name, fn in cases.items():
            fn()
            cupy.cuda.Device().synchronize()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                cupy.cuda.Device().synchronize()
                times.append(time.perf_counter() - t0)
            row[name + "_GBps"] = host.nbytes / statistics.median(times) / 1e9
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True, help="folder for the config, its inputs and output")
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--ao", type=int, default=128)
    ap.add_argument("--mo", type=int, default=120)
    ap.add_argument("--global", dest="global_memory", default="8GiB")
    ap.add_argument("--device", dest="device_memory", default="2GiB")
    ap.add_argument("--methods", nargs="+", default=["auto", "kernel", "ttgt"])
    ap.add_argument("--repeats", type=int, default=2, help="runs per variant (the first pays compile/setup)")
    ap.add_argument("--numpy", action="store_true", help="also run the NumPy backend")
    args = ap.parse_args(argv)

    record = {"benchmark": "gpu_runtime", **environment(),
              "config": {"ao": args.ao, "mo": args.mo, "global_memory": args.global_memory,
                         "device_memory": args.device_memory}}
    config = write_config(Path(args.workdir), args.ao, args.mo, args.global_memory, args.device_memory)
    plan = api.plan(config)
    record["predicted"] = plan.predicted
    record["contractions"] = [f"{c.out}[{','.join(c.out_indices)}] = {c.a}[{','.join(c.a_indices)}] * "
                              f"{c.b}[{','.join(c.b_indices)}]" for c in plan.contractions]
    t0 = time.perf_counter()
    api.generate(config)
    record["generate_s"] = time.perf_counter() - t0
    record["copy_rates"] = copy_rates()
    variants = [("cupy", m) for m in args.methods] + ([("numpy", None)] if args.numpy else [])
    record["runs"] = []
    for backend, method in variants:
        for rep in range(args.repeats):
            run = one_run(config, backend, method)
            run["repeat"] = rep
            if rep == 0:
                t0 = time.perf_counter()
                run["verify"] = [asdict(c) for c in api.verify(config, limit=64 << 30)]
                run["verify_s"] = time.perf_counter() - t0
            record["runs"].append(run)
            print(f"{backend}:{method} rep {rep}: total {run['total_s']:.2f} s, compute {run['seconds']['compute']:.3f} s "
                  f"({run['tflops_compute']:.2f} TFLOP/s compute, {run['tflops_end_to_end']:.3f} end to end), "
                  f"bytes match {run['bytes_match']}, verify {run.get('verify', '')}", flush=True)
            Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
