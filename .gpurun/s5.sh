#!/usr/bin/env bash
# Session 7, call 5: where a cold (T) run's seconds go at benzene's sizes (synthetic o=21 v=93),
# empty kernel and tuning caches, under cProfile.
export PYTHONPATH=$PWD
export CHAINEXEC_KERNEL_CACHE=/tmp/w8/cache
M=benchmarks/results/machine_h100_2026-11-23.json
w=/tmp/w8; rm -rf $w; mkdir -p $w
python3 -m chainexec.cli chem x --synthetic 21 93 7 --out $w/syn > /dev/null
python3 benchmarks/set_machine.py $w/syn/ccsd_t.yaml 32GiB 40GiB
t0=$(date +%s.%N)
timeout 300 python3 -m cProfile -o $OUT/prof_cold.out -m chainexec.cli run $w/syn/ccsd_t.yaml --backend cupy --machine $M --quiet --report > $OUT/cold.txt 2>&1
echo "cold rc=$? wall $(python3 -c "import time;print(round(time.time()-$t0,2))")"
grep -E "^(compute s|wall s|run s)|^#0|fused" $OUT/cold.txt
python3 - <<'PY'
import pstats, os
p = pstats.Stats(os.environ["OUT"] + "/prof_cold.out")
p.sort_stats("cumulative").print_stats("chainexec/runtime", 40)
p.sort_stats("tottime").print_stats(25)
PY
ls $CHAINEXEC_KERNEL_CACHE | wc -l
