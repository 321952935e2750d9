#!/usr/bin/env bash
# Session 7, call 7: the largest synthetic (T) here, o=32 v=300, with split sum runs: cold, warm.
export PYTHONPATH=$PWD
export CHAINEXEC_KERNEL_CACHE=/tmp/w10/cache
echo commit $(cat .gpurun/commit.txt)
M=benchmarks/results/machine_h100_2026-11-23.json
w=/tmp/w10; mkdir -p $w
t0=$(date +%s.%N)
[ -f $w/syn/inputs.h5 ] || python3 -m chainexec.cli chem x --synthetic 32 300 7 --out $w/syn > /dev/null
echo "inputs $(python3 -c "import time;print(round(time.time()-$t0,2))") s"
python3 benchmarks/set_machine.py $w/syn/ccsd_t.yaml 64GiB 40GiB
for p in cold warm; do
  t0=$(date +%s.%N)
  timeout 280 python3 -m chainexec.cli run $w/syn/ccsd_t.yaml --backend cupy --machine $M --quiet --report --report-json $OUT/syn32_$p.json > $OUT/syn32_$p.txt 2>&1
  echo "$p rc=$? wall $(python3 -c "import time;print(round(time.time()-$t0,2))")"
  grep -E "^(compute s|global<->device s|wall s|run s)|^#0|fused|get ovvv|^flops" $OUT/syn32_$p.txt
done
python3 -c "import h5py;print(repr(float(h5py.File('$w/syn/energy.h5')['E'][()])))"
