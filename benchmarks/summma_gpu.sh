#!/usr/bin/env bash
# First GPU run of the tensor-core sum kernel (chainexec/kernels/summma.py): the GPU tests of both
# sum kernels, one (T) W tile timed three ways (benchmarks/sum_tile.py: terms one by one, register
# kernel, tensor-core kernel), and the synthetic o=24 v=180 (T) run with the default choice and
# with the tensor-core kernel forced, twice each (the second with warm kernel and tuning caches).
# Usage on the GPU machine: bash benchmarks/summma_gpu.sh OUTDIR [WORKDIR]
set -euo pipefail
out=${1:?output folder}
work=${2:-$(mktemp -d)}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-}:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pytest -q tests/runtime/test_sumkernel_gpu.py > "$out/gpu_tests.txt" 2>&1 || true
tail -3 "$out/gpu_tests.txt"
python3 benchmarks/sum_tile.py "$out/sum_tile.json" > "$out/sum_tile.txt" 2>&1 || true
tail -5 "$out/sum_tile.txt"
[ -f "$work/o24/inputs.h5" ] || python3 -m chainexec.cli chem x --synthetic 24 180 7 --out "$work/o24" > /dev/null
python3 benchmarks/set_machine.py "$work/o24/ccsd_t.yaml" 16GiB 40GiB
for method in auto summma; do
  for pass in 1 2; do
    CHAINEXEC_GPU_METHOD=$method python3 -m chainexec.cli run "$work/o24/ccsd_t.yaml" --backend cupy --quiet \
      --report-json "$out/o24_${method}_$pass.json" > "$out/o24_${method}_$pass.txt" 2>&1 || true
    python3 - "$work/o24/energy.h5" "$out/o24_${method}_$pass.json" "$method" "$pass" <<'PY'
import json, sys, h5py
with h5py.File(sys.argv[1]) as f:
    e = float(f["E"][()])
r = json.load(open(sys.argv[2]))
print(sys.argv[3], sys.argv[4], "E", repr(e), "executor", round(r["measured"]["total_seconds"], 2),
      "compute", round(r["measured"]["seconds"]["compute"], 2))
PY
  done
done | tee "$out/o24.txt"
