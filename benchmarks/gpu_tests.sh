#!/usr/bin/env bash
# The GPU tests (marker `gpu`) in SHARDS pytest processes at once on one machine's GPUs, so that
# they fit a device call's time limit: the test ids are collected once and dealt round-robin,
# each shard writes its log and JUnit XML, and OUT/summary.txt gives each shard's passed,
# failed and skipped counts and the failures' ids. Extra arguments go to every pytest (-k, -x).
# Usage on the GPU machine: bash benchmarks/gpu_tests.sh OUT [SHARDS] [PYTEST ARGS...]
set -uo pipefail
out=${1:?output folder}
shards=${2:-4}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider "$@" tests 2>/dev/null \
    | grep '::' > "$out/ids.txt"
total=$(wc -l < "$out/ids.txt")
echo "$total GPU tests in $shards shards"
for s in $(seq 0 $((shards - 1))); do
  awk -v s="$s" -v n="$shards" '(NR - 1) % n == s' "$out/ids.txt" > "$out/ids_$s.txt"
  [ -s "$out/ids_$s.txt" ] || continue
  mapfile -t ids < "$out/ids_$s.txt"
  python3 -m pytest -q -p no:cacheprovider -rfE --junitxml="$out/shard_$s.xml" "$@" "${ids[@]}" \
      > "$out/shard_$s.log" 2>&1 &
done
wait
python3 - "$out" "$shards" <<'PY' | tee "$out/summary.txt"
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, shards = Path(sys.argv[1]), int(sys.argv[2])
totals = {"passed": 0, "failed": 0, "skipped": 0}
for s in range(shards):
    path = out / f"shard_{s}.xml"
    if not path.exists():
        print(f"shard {s}: no results (see shard_{s}.log)")
        continue
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    passed = int(suite.get("tests", 0)) - failed - skipped
    totals = {"passed": totals["passed"] + passed, "failed": totals["failed"] + failed,
              "skipped": totals["skipped"] + skipped}
    print(f"shard {s}: {passed} passed, {failed} failed, {skipped} skipped, {float(suite.get('time', 0)):.0f} s")
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            print(f"  FAILED {case.get('classname')}::{case.get('name')}")
print(f"all: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
PY
