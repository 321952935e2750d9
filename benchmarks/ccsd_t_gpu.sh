#!/usr/bin/env bash
# (T) on the GPU machine: benzene/cc-pVDZ inputs from PySCF (its own (T) step timed on all CPU
# cores), then `chainexec run` with the CuPy backend (cold, then warm), energies compared.
# Usage on the device (PySCF carried as a wheel): bash benchmarks/ccsd_t_gpu.sh OUTDIR
set -euo pipefail
out=${1:?output folder}
work=${2:-$(mktemp -d)}   # reuse a folder whose bz/ already holds the PySCF inputs
export PYTHONPATH=${PYTHONPATH:-}:$PWD
export OMP_NUM_THREADS=$(nproc)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
[ -f "$work/bz/inputs.h5" ] || /usr/bin/time -f "%e" -o "$out/chem_seconds.txt" \
    python3 -m chainexec.cli chem benzene --basis cc-pvdz --out "$work/bz"
python3 benchmarks/set_machine.py "$work/bz/ccsd_t.yaml" 32GiB 40GiB
# The planner picks the occupied tile size (ordered i >= j >= k tiles skip work, small tiles cost
# statements) from the machine's rates: measure them here.
[ -f "$work/machine.json" ] || python3 -m chainexec.cli calibrate "$work/machine.json" --backend cupy --ranks 1
cp "$work/machine.json" "$out/machine.json"
python3 -m chainexec.cli plan "$work/bz/ccsd_t.yaml" --machine "$work/machine.json" > "$out/plan.txt"
for pass in cold warm; do
  start=$(date +%s.%N)
  python3 -m chainexec.cli run "$work/bz/ccsd_t.yaml" --backend cupy --machine "$work/machine.json" --report-json "$out/run_$pass.json" > "$out/run_$pass.txt"
  end=$(date +%s.%N)
  echo "$pass $start $end" >> "$out/wall_seconds.txt"
done
python3 - "$work/bz" "$out" <<'PY'
import json, sys, h5py
folder, out = sys.argv[1], sys.argv[2]
with h5py.File(f"{folder}/energy.h5") as f, h5py.File(f"{folder}/inputs.h5") as g:
    e = float(f["E"][()]); ref = float(g.attrs["e_t"]); t_pyscf = float(g.attrs["e_t_seconds"])
    o, v = int(g.attrs["nocc"]), int(g.attrs["nvir"])
runs = {p: json.load(open(f"{out}/run_{p}.json")) for p in ("cold", "warm")}
wall = {p: float(b) - float(a) for p, a, b in (line.split() for line in open(f"{out}/wall_seconds.txt"))}
res = {"nocc": o, "nvir": v, "e_t_chainexec": e, "e_t_pyscf": ref, "difference": e - ref,
       "pyscf_t_seconds": t_pyscf, "chainexec_wall_seconds": wall,
       "chainexec_measured": {p: r["measured"] for p, r in runs.items()},
       "bytes_match": all(r["measured"]["bytes"] == r["predicted"]["bytes"] for r in runs.values())}
json.dump(res, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(res, indent=1))
PY
