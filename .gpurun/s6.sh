#!/usr/bin/env bash
# Session 7, call 6: precompiled sum-kernel candidates: GPU tests, then the cold (T) run at
# benzene's sizes (synthetic o=21 v=93, empty caches) again, then warm.
export PYTHONPATH=$PWD OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo commit $(cat .gpurun/commit.txt)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_sumkernel_gpu.py -k "backend_contract_sum or precompiled" 2>&1 | tail -4
export CHAINEXEC_KERNEL_CACHE=/tmp/w9/cache
M=benchmarks/results/machine_h100_2026-11-23.json
w=/tmp/w9; rm -rf $w; mkdir -p $w
python3 -m chainexec.cli chem x --synthetic 21 93 7 --out $w/syn > /dev/null
python3 benchmarks/set_machine.py $w/syn/ccsd_t.yaml 32GiB 40GiB
for p in cold warm; do
  t0=$(date +%s.%N)
  timeout 200 python3 -m chainexec.cli run $w/syn/ccsd_t.yaml --backend cupy --machine $M --quiet --report --report-json $OUT/syn21_$p.json > $OUT/syn21_$p.txt 2>&1
  echo "$p rc=$? wall $(python3 -c "import time;print(round(time.time()-$t0,2))")"
  grep -E "^(compute s|wall s|run s)|^#0|fused" $OUT/syn21_$p.txt
done
python3 -c "import h5py;print(repr(float(h5py.File('$w/syn/energy.h5')['E'][()])))"
