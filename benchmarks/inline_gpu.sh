#!/usr/bin/env bash
# Fused statements (chainexec/planner/inline.py) on the GPU: the synthetic o=24 v=180 (T) job
# planned and run with single-use point-wise producers inlined (the default) and with
# --no-inline, each cold (empty kernel and tuning caches in a fresh machine: first) and warm
# twice, alternating; energies, measured = predicted and the statement table per run.
# Usage on the GPU machine: bash benchmarks/inline_gpu.sh OUTDIR [WORKDIR]
set -uo pipefail
out=${1:?output folder}
work=${2:-$(mktemp -d)}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-}:$PWD
M=benchmarks/results/machine_h100_2026-11-23.json
[ -f "$work/syn/inputs.h5" ] || python3 -m chainexec.cli chem x --synthetic 24 180 7 --out "$work/syn" > /dev/null
python3 benchmarks/set_machine.py "$work/syn/ccsd_t.yaml" 16GiB 40GiB
python3 -m chainexec.cli plan "$work/syn/ccsd_t.yaml" --machine $M > "$out/plan_inline.txt" 2>&1
python3 -m chainexec.cli plan "$work/syn/ccsd_t.yaml" --machine $M --no-inline > "$out/plan_noinline.txt" 2>&1
grep -E "parallel for|^device|flops|time \(model" "$out/plan_inline.txt" "$out/plan_noinline.txt"
for p in inline_cold inline_warm noinline_cold noinline_warm inline_warm2 noinline_warm2; do
  flag=""; case $p in noinline*) flag="--no-inline";; esac
  t0=$(date +%s.%N)
  timeout 150 python3 -m chainexec.cli run "$work/syn/ccsd_t.yaml" --backend cupy --machine $M $flag --quiet \
      --report --report-json "$out/syn_$p.json" > "$out/syn_$p.txt" 2>&1
  rc=$?
  e=$(python3 -c "import h5py;f=h5py.File('$work/syn/energy.h5');print(repr(float(f['E'][()])))")
  echo "$p rc=$rc wall $(python3 -c "import time;print(round(time.time()-$t0,2))") E=$e" | tee -a "$out/syn_walls.txt"
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
for p in ["inline_warm", "noinline_warm", "inline_warm2", "noinline_warm2"]:
    d = json.load(open(f"{out}/syn_{p}.json"))
    m, pr = d["measured"], d["predicted"]
    st = sorted(d["measured"]["by_statement"].items(), key=lambda kv: -kv[1])[:8]
    print(p, "total", round(m["total_seconds"], 3), "compute", round(m["seconds"]["compute"], 3),
          "flops", m["flops"], "TF/s", round(m["flops"] / m["seconds"]["compute"] / 1e12, 2),
          "equal", all(m[k] == pr[k] for k in ("bytes", "flops", "statements", "streamed", "memory_peak")),
          "peak", m["memory_peak"]["device"], "hw", m.get("memory_high_water"))
    print("   ", [(k, round(v, 3)) for k, v in st])
PY
