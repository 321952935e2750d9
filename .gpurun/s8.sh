#!/usr/bin/env bash
# Session 7, call 8: final checks on the GPU machine: global arrays under the system Open MPI
# (local get), the sum-kernel GPU tests, and the (T) o=24 v=180 job (input fetch time).
export PYTHONPATH=$PWD OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo commit $(cat .gpurun/commit.txt)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_globalarray.py 2>&1 | tail -2
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_sumkernel_gpu.py 2>&1 | tail -3
export CHAINEXEC_KERNEL_CACHE=/tmp/w11/cache
M=benchmarks/results/machine_h100_2026-11-23.json
w=/tmp/w11; mkdir -p $w
[ -f $w/syn/inputs.h5 ] || python3 -m chainexec.cli chem x --synthetic 24 180 7 --out $w/syn > /dev/null
python3 benchmarks/set_machine.py $w/syn/ccsd_t.yaml 16GiB 40GiB
for p in cold warm warm2; do
  t0=$(date +%s.%N)
  timeout 150 python3 -m chainexec.cli run $w/syn/ccsd_t.yaml --backend cupy --machine $M --quiet --report --report-json $OUT/syn_$p.json > $OUT/syn_$p.txt 2>&1
  rc=$?
  e=$(python3 -c "import h5py;f=h5py.File('$w/syn/energy.h5');print(repr(float(f['E'][()])))")
  echo "$p rc=$rc wall $(python3 -c "import time;print(round(time.time()-$t0,2))") E=$e"
  grep -E "^(compute s|global<->device s|wall s|run s)|^#0|fused|get " $OUT/syn_$p.txt
done
