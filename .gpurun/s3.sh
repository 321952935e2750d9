#!/usr/bin/env bash
# Session 7, call 3: the split sum run: GPU tests, the W tile timed, the (T) o=24 v=180 job.
export PYTHONPATH=$PWD OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export CHAINEXEC_KERNEL_CACHE=/tmp/w7/cache
echo commit $(cat .gpurun/commit.txt)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_sumkernel_gpu.py -k backend_contract_sum 2>&1 | tail -5
timeout 200 python3 benchmarks/sum_tile.py $OUT/sum_tile.json 24 180 3 0 2>&1 | tail -60
M=benchmarks/results/machine_h100_2026-11-23.json
w=/tmp/w7; mkdir -p $w
[ -f $w/syn/inputs.h5 ] || python3 -m chainexec.cli chem x --synthetic 24 180 7 --out $w/syn > /dev/null
python3 benchmarks/set_machine.py $w/syn/ccsd_t.yaml 16GiB 40GiB
for p in cold warm warm2; do
  t0=$(date +%s.%N)
  timeout 150 python3 -m chainexec.cli run $w/syn/ccsd_t.yaml --backend cupy --machine $M --quiet --report --report-json $OUT/syn_$p.json > $OUT/syn_$p.txt 2>&1
  rc=$?
  e=$(python3 -c "import h5py;f=h5py.File('$w/syn/energy.h5');print(repr(float(f['E'][()])))")
  echo "$p rc=$rc wall $(python3 -c "import time;print(round(time.time()-$t0,2))") E=$e"
  grep -E "^(compute s|global<->device s|wall s|run s)|^#0|fused|get ovvv" $OUT/syn_$p.txt
done
python3 - <<'PY'
import json
d = json.load(open("/tmp/w7/cache/tuning.json"))
for k, v in d.items():
    if '"sum"' in k[:40]:
        print(k[:160], v["method"], v.get("config"), {m: round(s * 1e3, 2) for m, s in sorted(v["seconds"].items(), key=lambda x: x[1])[:6]})
PY
