#!/usr/bin/env bash
# Session 7, call 4: benzene/cc-pVDZ (T) with the split sum run: PySCF inputs and its (T) time,
# chainexec cold then warm twice; energies against PySCF.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export CHAINEXEC_KERNEL_CACHE=/tmp/w7/cache OMP_NUM_THREADS=$(nproc)
[ -d /tmp/py/pyscf ] || pip install -q --no-deps --target /tmp/py .whl/pyscf-*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/py
echo commit $(cat .gpurun/commit.txt)
M=benchmarks/results/machine_h100_2026-11-23.json
w=/tmp/w7; mkdir -p $w
t0=$(date +%s.%N)
[ -f $w/bz/inputs.h5 ] || python3 -m chainexec.cli chem benzene --basis cc-pvdz --out $w/bz > $OUT/chem.txt 2>&1
echo "chem rc=$? $(python3 -c "import time;print(round(time.time()-$t0,2))") s"
python3 benchmarks/set_machine.py $w/bz/ccsd_t.yaml 32GiB 40GiB
for p in cold warm warm2 warm3; do
  t0=$(date +%s.%N)
  timeout 200 python3 -m chainexec.cli run $w/bz/ccsd_t.yaml --backend cupy --machine $M --quiet --report --report-json $OUT/bz_$p.json > $OUT/bz_$p.txt 2>&1
  rc=$?
  echo "$p rc=$rc wall $(python3 -c "import time;print(round(time.time()-$t0,2))")"
  grep -E "^(compute s|global<->device s|wall s|run s)|^#0|fused|get ovvv" $OUT/bz_$p.txt
done
python3 - <<'PY'
import h5py, json
with h5py.File("/tmp/w7/bz/energy.h5") as f, h5py.File("/tmp/w7/bz/inputs.h5") as g:
    e = float(f["E"][()]); ref = float(g.attrs["e_t"])
    print("E", repr(e), "pyscf", repr(ref), "diff", e - ref, "pyscf (T) s", float(g.attrs["e_t_seconds"]))
d = json.load(open("/tmp/w7/cache/tuning.json"))
from collections import Counter
print(Counter(v["method"] for k, v in d.items() if '"sum"' in k[:40]))
PY
