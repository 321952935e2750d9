"""Planning time of every config in configs/ (issue: each plans in under 1 s on a 2-core box).

Usage: python benchmarks/plan_time.py [--machine FILE] [--out benchmarks/results/plan_time_DATE.json]
Times ``make_plan`` only (config already parsed), median of 5 runs, and records the chosen
schedule and the paper/search gap.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from chainexec import machinecache, spec
from chainexec.planner.build import make_plan
from chainexec.planner.machine import Machine
from chainexec.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--machine")
    ap.add_argument("--out")
    args = ap.parse_args()
    machine = machinecache.load(args.machine) if args.machine else Machine()
    rows = []
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        s = spec.load(config)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            plan = make_plan(s, machine)
            times.append(time.perf_counter() - t0)
        alts = {a["name"]: a for a in plan.alternatives if a["kind"] == "schedule"}
        chosen = next(a for a in alts.values() if a["chosen"])
        rows.append({"config": config.name, "contractions": len(plan.contractions),
                     "plan_seconds_median": statistics.median(times), "plan_seconds_max": max(times),
                     "chosen": f"{chosen['name']} {chosen['groups']}",
                     "paper_over_search": alts["paper: disk+global"]["movement_seconds"]
                     / alts["search"]["movement_seconds"] if "search" in alts else None})
        print(f"{config.name:<16} {rows[-1]['plan_seconds_median'] * 1e3:8.1f} ms   {rows[-1]['chosen']}")
    record = {"benchmark": "plan_time", **provenance(), "machine_model": machine.source, "results": rows}
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"plan_time_{record['date'][:10]}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
