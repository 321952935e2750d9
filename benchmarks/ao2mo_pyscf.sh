#!/usr/bin/env bash
# AO->MO four-index transform: PySCF's out-of-core ao2mo (integrals computed on the fly, output
# packed by symmetry) beside chainexec reading the same molecule's AO integrals from HDF5.
# Writes OUTDIR/summary.json: both times, the bytes each moved, and a sampled check of chainexec's
# result against PySCF's. Usage (from the repository root; PySCF installed):
#   bash benchmarks/ao2mo_pyscf.sh OUTDIR [MOLECULE] [BASIS] [GLOBAL] [DEVICE] [BACKEND]
# The issue's case: benzene cc-pvtz (264 functions; A is 39 GB) with limits 8GiB / 8GiB on a GPU.
set -euo pipefail
out=${1:?output folder} molecule=${2:-benzene} basis=${3:-cc-pvtz}
global=${4:-8GiB} device=${5:-8GiB} backend=${6:-auto}
export PYTHONPATH=${PYTHONPATH:-}:$PWD OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
mkdir -p "$out"
work=$(mktemp -d)
# CHEM_MAX_MEMORY (MB): PySCF's memory for the inputs' RHF (incore integrals); PYSCF_THREADS: the
# threads of PySCF's timed transform (default: all)
env ${CHEM_MAX_MEMORY:+PYSCF_MAX_MEMORY=$CHEM_MAX_MEMORY} \
    python3 -m chainexec.cli chem "$molecule" --basis "$basis" --job ao2mo --out "$work" > "$out/chem.txt"
python3 - "$work/fourindex.yaml" "$global" "$device" <<'PY'
import sys, yaml
path, g, d = sys.argv[1:]
cfg = yaml.safe_load(open(path))
cfg["machine"] = {"global_memory": g, "device_memory": d}
open(path, "w").write(yaml.safe_dump(cfg, sort_keys=False))
PY
python3 -m chainexec.cli plan "$work/fourindex.yaml" > "$out/plan.txt"
start=$(date +%s.%N)
python3 -m chainexec.cli run "$work/fourindex.yaml" --backend "$backend" --quiet --report \
    --report-json "$out/run.json" > "$out/run.txt"
end=$(date +%s.%N)
python3 - "$work" "$out" "$molecule" "$basis" "$start" "$end" <<'PY'
import json, os, sys, time
import h5py
import numpy as np
from pyscf import ao2mo, gto, lib
from chainexec.chem.job import MOLECULES

work, out, molecule, basis, start, end = sys.argv[1:]
if os.environ.get("PYSCF_THREADS"):
    lib.num_threads(int(os.environ["PYSCF_THREADS"]))
with h5py.File(f"{work}/inputs.h5") as f:
    C = f["C"][...]
    nao, nmo = int(f.attrs["nao"]), int(f.attrs["nmo"])
rng = np.random.default_rng(0)
idx = rng.integers(0, nmo, size=(200, 4))
with h5py.File(f"{work}/output.h5") as g:
    ours = np.array([g["B"][tuple(i)] for i in idx])
# chainexec's files go before PySCF writes its own: the disk then holds one side's at a time
# (benzene/cc-pVTZ: A and B are 39 GB each)
for name in os.listdir(work):
    if name.endswith(".h5"):
        os.remove(os.path.join(work, name))
mol = gto.M(atom=MOLECULES.get(molecule.lower(), molecule), basis=basis, unit="Angstrom", verbose=0)
erifile = f"{work}/pyscf_eri.h5"
t0 = time.perf_counter()
ao2mo.outcore.full(mol, C, erifile, dataname="eri_mo")
pyscf_s = time.perf_counter() - t0
with h5py.File(erifile) as f:
    packed = f["eri_mo"]                                   # (ab|cd) with a>=b, c>=d packed
    pyscf_bytes = packed.size * packed.dtype.itemsize
    def pair(p, q):
        p, q = max(p, q), min(p, q)
        return p * (p + 1) // 2 + q
    ref = np.array([packed[pair(a, b), pair(c, d)] for a, b, c, d in idx])
run = json.load(open(f"{out}/run.json"))
summary = {"molecule": molecule, "basis": basis, "nao": nao, "nmo": nmo, "threads": lib.num_threads(),
           "pyscf_outcore_seconds": pyscf_s, "pyscf_output_bytes": int(pyscf_bytes),
           "chainexec_wall_seconds": float(end) - float(start), "chainexec_measured": run["measured"],
           "chainexec_predicted": run["predicted"], "input_A_bytes": nao**4 * 8,
           "sampled_max_abs_difference": float(np.max(np.abs(ours - ref))),
           "sampled_max_abs_value": float(np.max(np.abs(ref)))}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps({k: v for k, v in summary.items() if not k.startswith("chainexec_")}, indent=1))
print("chainexec wall", summary["chainexec_wall_seconds"], "s; measured bytes", run["measured"]["bytes"])
PY
rm -rf "$work"
