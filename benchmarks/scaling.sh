#!/usr/bin/env bash
# Strong scaling of one config on 1..N GPUs of one host (one rank per GPU): each rank count's plan
# made first (`chainexec plan --ranks N`, kept in the plan cache the runs read: no timed run plans),
# a warm-up run on 1 rank fills the kernel and tuning caches, then one timed run per rank count.
# Writes plan_n<N>.txt, run_n<N>.json (chainexec's report), its .wall (JSON: the launcher's wall
# seconds and the scalar outputs the run wrote) and scaling.json: per rank count the launcher's
# wall and the executor's seconds with their parallel efficiency against the first count (wall
# first: what a user waits for), the launcher's own seconds for that many ranks (`true` launched
# alone: its start and end of the processes, part of every run's wall), the slowest rank's start
# (process start to executor start),
# whether every count the runtime measures equals the plan's prediction, the config's scalar
# outputs as written by that run (they must agree across rank counts) and each rank's breakdown
# (start, busy, idle, seconds per level, tiles), and the flop rate per rank (the plan's flops over
# the executor's seconds and the ranks: against the DGEMM rate for the larger-than-one-GPU target).
# WARMUP=0 skips the warm-up run: for a job one rank would take too long on (the (T) case larger
# than one GPU, run on 4 ranks only: `WARMUP=0 bash benchmarks/scaling.sh CONFIG OUTDIR "4"`).
# Usage on the GPU machine: bash benchmarks/scaling.sh CONFIG OUTDIR "1 2 4"
# Environment: MACHINE (a machine file for --machine, e.g. benchmarks/results/machine_h100_2026-11-23.json),
# BACKEND (default cupy), MPIRUN (default /usr/bin/mpirun where it exists, else mpiexec on PATH),
# MPIFLAGS (default "--bind-to none", Open MPI's; empty for MPICH). NVLink multicast stays off
# (NCCL_NVLS_ENABLE=0: see the device notes).
set -euo pipefail
config=${1:?config} out=${2:?output folder} counts=${3:-"1 2"}
export PYTHONPATH=${PYTHONPATH:-}:$PWD OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
backend=${BACKEND:-cupy}
if [ -z "${MPIRUN:-}" ]; then
  if [ -x /usr/bin/mpirun ]; then MPIRUN=/usr/bin/mpirun
  else MPIRUN=$(command -v mpiexec) || { echo "scaling.sh: no /usr/bin/mpirun and no mpiexec on PATH (set MPIRUN)" >&2; exit 2; }; fi
fi
read -r -a flags <<< "${MPIFLAGS---bind-to none}"
machine=()
[ -n "${MACHINE:-}" ] && machine=(--machine "$MACHINE")
mkdir -p "$out"
python=$(command -v python3)  # mpirun's own PATH may find another interpreter
run() {  # ranks, report file
  local start end
  start=$(date +%s.%N)
  "$MPIRUN" -n "$1" "${flags[@]}" "$python" -m chainexec.cli run "$config" --backend "$backend" "${machine[@]}" \
      --quiet --report-json "$2" > "$2.txt" 2> "$2.err" || { tail -20 "$2.err"; exit 1; }
  end=$(date +%s.%N)
  python3 - "$config" "$2" "$start" "$end" <<'PY'
import json, sys
from pathlib import Path
from chainexec import spec, verify
config, report, start, end = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
values = verify.scalar_outputs(spec.load(config))
Path(report + ".wall").write_text(json.dumps({"wall_seconds": end - start, "outputs": values}))
PY
}
for n in $counts; do
  python3 -m chainexec.cli plan "$config" --ranks "$n" "${machine[@]}" > "$out/plan_n$n.txt" 2>&1 || { tail -5 "$out/plan_n$n.txt"; exit 1; }
done
for n in $counts; do  # the launcher alone: N processes that start and end at once
  python3 - "$out/launcher_n$n.txt" "$MPIRUN" -n "$n" "${flags[@]}" true <<'PY'
import subprocess, sys, time
start = time.perf_counter()
subprocess.run(sys.argv[2:], check=True, stdout=subprocess.DEVNULL)
open(sys.argv[1], "w").write(f"{time.perf_counter() - start}\n")
PY
done
[ "${WARMUP:-1}" = 0 ] || run 1 "$out/warmup.json"
for n in $counts; do run "$n" "$out/run_n$n.json"; done
python3 - "$out" "$config" $counts <<'PY'
import json, sys
out, config, counts = sys.argv[1], sys.argv[2], [int(c) for c in sys.argv[3:]]
rows = []
for n in counts:
    r = json.load(open(f"{out}/run_n{n}.json"))
    after = json.load(open(f"{out}/run_n{n}.json.wall"))
    m, p = r["measured"], r["predicted"]
    rows.append({"ranks": n, "wall_seconds": after["wall_seconds"], "executor_seconds": m["total_seconds"],
                 "launcher_seconds": float(open(f"{out}/launcher_n{n}.txt").read()),
                 "start_seconds_max": max((k["start_seconds"] for k in r["run"]["per_rank"] if k["start_seconds"] is not None),
                                          default=None),
                 "measured_equals_predicted": all(m[k] == p[k] for k in ("flops", "statements", "streamed", "bytes",
                                                                       "memory_peak")),
                 "flops_per_second_per_rank": m["flops"] / m["total_seconds"] / n,
                 "outputs": after["outputs"], "per_rank": r["run"]["per_rank"]})
base = rows[0]
for row in rows:
    for key in ("wall_seconds", "executor_seconds"):
        row[key.replace("seconds", "efficiency")] = base[key] / (row["ranks"] / base["ranks"] * row[key])
json.dump({"config": config, "rows": rows}, open(f"{out}/scaling.json", "w"), indent=1)
for row in rows:
    print(f"{row['ranks']} ranks: wall {row['wall_seconds']:.2f} s ({row['wall_efficiency']:.1%}), "
          f"executor {row['executor_seconds']:.2f} s ({row['executor_efficiency']:.1%}), "
          f"launcher alone {row['launcher_seconds']:.2f} s, slowest start "
          f"{'-' if row['start_seconds_max'] is None else format(row['start_seconds_max'], '.2f')} s, counts as predicted {row['measured_equals_predicted']}, outputs {row['outputs']}")
PY
