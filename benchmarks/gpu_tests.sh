#!/usr/bin/env bash
# The GPU tests (marker `gpu`) in SHARDS pytest processes at once on one machine's GPUs, so that
# they fit a device call's time limit: the test ids are collected and dealt round-robin,
# each shard writes its log and JUnit XML; the tests also marked `alone` (they assert on device
# timings, which other processes' kernels on the same GPU would stretch) run after the shards, in
# one more process with the device to itself; OUT/summary.txt gives each shard's passed,
# failed and skipped counts and the failures' ids (a shard's tests that did not report count as
# failed); it exits 1 where any failed, 2 where collection fails. Extra arguments are pytest
# options for every process (-k, -x), not paths.
# Usage on the GPU machine: bash benchmarks/gpu_tests.sh OUT [SHARDS] [PYTEST ARGS...]
set -uo pipefail
out=${1:?output folder}
shards=${2:-4}
shift $(( $# < 2 ? $# : 2 ))
[[ $shards =~ ^[1-9][0-9]*$ ]] || { echo "SHARDS must be a positive whole number, not '$shards'" >&2; exit 2; }
mkdir -p "$out"
rm -f "$out"/ids*.txt "$out"/shard_*.log "$out"/shard_*.xml "$out/summary.txt"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider -p no:warnings "$@" tests > "$out/collect.log" 2>&1
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then
  echo "collection failed (exit $rc): see $out/collect.log" >&2
  tail -5 "$out/collect.log" >&2
  exit 2
fi
grep -E '^tests/[^ ]*::' "$out/collect.log" > "$out/ids.txt"
python3 -m pytest -q --collect-only -m "gpu and alone" -p no:cacheprovider -p no:warnings "$@" tests \
    | grep -E '^tests/[^ ]*::' > "$out/ids_$shards.txt"
total=$(wc -l < "$out/ids.txt")
echo "$total GPU tests in $shards shards, then $(wc -l < "$out/ids_$shards.txt") alone"
run_shard() {  # SHARD [PYTEST ARGS...]: its ids, log and JUnit XML
  local s=$1
  shift
  mapfile -t ids < "$out/ids_$s.txt"
  python3 -m pytest -q -p no:cacheprovider -rfE --junitxml="$out/shard_$s.xml" "$@" "${ids[@]}" \
      > "$out/shard_$s.log" 2>&1
}
grep -vxF -f "$out/ids_$shards.txt" "$out/ids.txt" > "$out/ids_shared.txt"
for s in $(seq 0 $((shards - 1))); do
  awk -v s="$s" -v n="$shards" '(NR - 1) % n == s' "$out/ids_shared.txt" > "$out/ids_$s.txt"
  [ -s "$out/ids_$s.txt" ] || continue
  run_shard "$s" "$@" &
done
wait
[ -s "$out/ids_$shards.txt" ] && run_shard "$shards" "$@"
python3 - "$out" "$((shards + 1))" <<'PY' | tee "$out/summary.txt"
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, shards = Path(sys.argv[1]), int(sys.argv[2])
totals = {"passed": 0, "failed": 0, "skipped": 0}
for s in range(shards):
    name = "alone" if s == shards - 1 else f"shard {s}"  # the last: the `alone` tests
    path, ids = out / f"shard_{s}.xml", out / f"ids_{s}.txt"
    given = len(ids.read_text().split("\n")) - 1 if ids.exists() else 0
    if not path.exists():
        if given:
            print(f"{name}: no results for its {given} tests (see shard_{s}.log): counted failed")
            totals["failed"] += given
        continue
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    passed = int(suite.get("tests", 0)) - failed - skipped
    missing = max(0, given - int(suite.get("tests", 0)))
    if missing:
        print(f"{name}: {missing} of its tests did not report (see shard_{s}.log): counted failed")
    failed += missing
    totals = {"passed": totals["passed"] + passed, "failed": totals["failed"] + failed,
              "skipped": totals["skipped"] + skipped}
    print(f"{name}: {passed} passed, {failed} failed, {skipped} skipped, {float(suite.get('time', 0)):.0f} s")
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            print(f"  FAILED {case.get('classname')}::{case.get('name')}")
print(f"all: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
sys.exit(1 if totals["failed"] else 0)
PY
