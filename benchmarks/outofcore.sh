#!/usr/bin/env bash
# Four-index transform out of core at both levels on one GPU: calibrate the machine, write a
# configs/fourindex.yaml copy at AO/MO extents with small global and device limits, generate its
# inputs, run it three times (below), verify, and time how
# HDF5 reads one global tile of the input (strided: the tiled index is the file's fastest one)
# against a contiguous slab of the same size. Writes OUT/summary.json and the runs' reports.
# Usage (repository root, GPU machine): bash benchmarks/outofcore.sh OUT WORK [AO] [MO] [LIMIT] [BACKEND]
set -euo pipefail
out=${1:?output folder} work=${2:?work folder} ao=${3:-160} mo=${4:-150} limit=${5:-1GiB} backend=${6:-cupy}
export PYTHONPATH=${PYTHONPATH:-}:$PWD
mkdir -p "$out" "$work"
python3 -m chainexec.cli calibrate "$work/machine.json" --backend "$backend" --ranks 1 --scratch "$work" \
    > "$out/calibrate.txt"
python3 - "$work" "$ao" "$mo" "$limit" <<'PY'
import sys, yaml
work, ao, mo, limit = sys.argv[1:]
cfg = yaml.safe_load(open("configs/fourindex.yaml"))
cfg["ranges"] = {"ao": int(ao), "mo": int(mo)}
for t in cfg["tensors"].values():
    t["source"]["file"] = f"{work}/input.h5"
cfg["outputs"]["B"]["file"] = f"{work}/output.h5"
cfg["machine"] = {"global_memory": limit, "device_memory": limit}
yaml.safe_dump(cfg, open(f"{work}/fi.yaml", "w"), sort_keys=False)
PY
cfg="$work/fi.yaml"
python3 -m chainexec.cli plan "$cfg" --machine "$work/machine.json" > "$out/plan.txt"
python3 -m chainexec.cli generate "$cfg" > /dev/null
# cold: first process (kernel compiles, tuning); warm: caches filled; uncached: warm, with the input
# evicted from the page cache first (it was just written, and this machine's RAM holds it).
for pass in cold warm uncached; do
    if [ "$pass" = uncached ]; then
        python3 -c "import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); os.fsync(fd); \
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)" "$work/input.h5"
    fi
    start=$(date +%s.%N)
    python3 -m chainexec.cli run "$cfg" --backend "$backend" --machine "$work/machine.json" --quiet --report \
        --report-json "$out/$pass.json" > "$out/$pass.txt"
    end=$(date +%s.%N)
    echo "$pass wall $(python3 -c "print($end - $start)") s" >> "$out/walls.txt"
done
python3 -m chainexec.cli verify "$cfg" --samples 12 > "$out/verify.txt"
python3 - "$work" "$out" <<'PY'
import json, sys, time
import h5py, numpy as np
work, out = sys.argv[1:]
with h5py.File(f"{work}/input.h5") as f:
    a = f["A"]
    n = a.shape[0]
    tile = max(1, n // 32)
    buf = np.empty((n, n, n, tile))
    t0 = time.perf_counter(); a.read_direct(buf, np.s_[:, :, :, :tile]); strided = time.perf_counter() - t0
    buf = np.empty((tile, n, n, n))
    t0 = time.perf_counter(); a.read_direct(buf, np.s_[:tile]); contiguous = time.perf_counter() - t0
runs = {p: json.load(open(f"{out}/{p}.json")) for p in ("cold", "warm", "uncached")}
summary = {"tile_read_seconds": {"strided_last_axis": strided, "contiguous_first_axis": contiguous,
                                 "bytes": buf.nbytes},
           "walls": open(f"{out}/walls.txt").read().split("\n"),
           "verify": open(f"{out}/verify.txt").read().strip()}
for p, r in runs.items():
    summary[p] = {"measured": r["measured"], "predicted_seconds": r["predicted"]["seconds"],
                  "bound": r["predicted"]["total_seconds"],
                  "measured_over_bound": r["measured"]["total_seconds"] / r["predicted"]["total_seconds"],
                  "bytes_match": r["measured"]["bytes"] == r["predicted"]["bytes"],
                  "peaks_match": r["measured"]["memory_peak"] == r["predicted"]["memory_peak"]}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps({k: summary[k] for k in ("tile_read_seconds", "walls", "verify")}, indent=1))
for p in runs:
    print(p, {k: summary[p][k] for k in ("bound", "measured_over_bound", "bytes_match", "peaks_match")},
          summary[p]["measured"]["seconds"], summary[p]["measured"]["total_seconds"])
PY
