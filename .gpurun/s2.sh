#!/usr/bin/env bash
# Session 7, call 2: where the warm (T) o=24 v=180 executor's non-compute seconds go (cProfile).
export PYTHONPATH=$PWD
M=benchmarks/results/machine_h100_2026-11-23.json
w=/tmp/w7; mkdir -p $w
[ -f $w/syn/inputs.h5 ] || python3 -m chainexec.cli chem x --synthetic 24 180 7 --out $w/syn > /dev/null
python3 benchmarks/set_machine.py $w/syn/ccsd_t.yaml 16GiB 40GiB
for p in cold warm; do
  t0=$(date +%s.%N)
  pre=""; [ $p = warm ] && pre="-m cProfile -o $OUT/prof_$p.out"
  timeout 200 python3 $pre -m chainexec.cli run $w/syn/ccsd_t.yaml --backend cupy --machine $M --quiet --report --report-json $OUT/syn_$p.json > $OUT/syn_$p.txt 2>&1
  echo "$p rc=$? wall $(python3 -c "import time;print(round(time.time()-$t0,2))")"
done
python3 - <<'PY'
import pstats, os
p = pstats.Stats(os.environ["OUT"] + "/prof_warm.out")
p.sort_stats("cumulative").print_stats(45)
p.sort_stats("tottime").print_stats(30)
PY
tail -40 $OUT/syn_warm.txt
