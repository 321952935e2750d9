#!/usr/bin/env bash
# Strong scaling of one config on 1..N GPUs of one host (one rank per GPU, Open MPI's mpirun):
# a warm-up run on 1 rank fills the kernel and tuning caches, then one timed run per rank count;
# writes run_n<N>.json (chainexec's report) and scaling.json (executor and wall seconds,
# speed-up and parallel efficiency against 1 rank).
# Usage on the GPU machine: bash benchmarks/scaling.sh CONFIG OUTDIR "1 2 4"
set -euo pipefail
config=${1:?config} out=${2:?output folder} counts=${3:-"1 2"}
export PYTHONPATH=${PYTHONPATH:-}:$PWD OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir -p "$out"
python=$(command -v python3)  # mpirun's own PATH may find another interpreter
run() {  # ranks, report file
  local start end
  start=$(date +%s.%N)
  /usr/bin/mpirun -n "$1" --bind-to none "$python" -m chainexec.cli run "$config" --backend cupy --quiet \
      --report-json "$2" > "$2.txt" 2> "$2.err" || { tail -20 "$2.err"; exit 1; }
  end=$(date +%s.%N)
  python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$start" "$end" > "$2.wall"
}
run 1 "$out/warmup.json"
for n in $counts; do run "$n" "$out/run_n$n.json"; done
python3 - "$out" $counts <<'PY'
import json, sys
out, counts = sys.argv[1], [int(c) for c in sys.argv[2:]]
rows = []
for n in counts:
    r = json.load(open(f"{out}/run_n{n}.json"))
    rows.append({"ranks": n, "executor_seconds": r["measured"]["total_seconds"],
                 "wall_seconds": float(open(f"{out}/run_n{n}.json.wall").read()),
                 "bytes_match": r["measured"]["bytes"] == r["predicted"]["bytes"],
                 "per_rank": r["run"]["per_rank"]})
base = rows[0]
for row in rows:
    for key in ("executor_seconds", "wall_seconds"):
        row[key.replace("seconds", "efficiency")] = base[key] / (row["ranks"] / base["ranks"] * row[key])
json.dump({"config": sys.argv[1], "rows": rows}, open(f"{out}/scaling.json", "w"), indent=1)
for row in rows:
    print(f"{row['ranks']} ranks: executor {row['executor_seconds']:.2f} s ({row['executor_efficiency']:.0%}), "
          f"wall {row['wall_seconds']:.2f} s ({row['wall_efficiency']:.0%}), bytes match {row['bytes_match']}")
PY
