"""The (T) energy's orbit kernel timed tile by tile: a synthetic (T) job run with CuPy, every fused
statement that reuses values (the energy, :func:`chainexec.runtime.pointwise.orbit_reduce`)
timed between two CUDA events and waited for, so that its time is the kernel's alone.

    python3 benchmarks/orbit_energy.py FOLDER NOCC NVIR [--rounds 2] [--tag NAME]

Writes the synthetic inputs to FOLDER once (``chainexec chem x --synthetic NOCC NVIR 1``, memory
limits 64 GiB global and 120 GiB on the device), runs the job ``--rounds`` times in this process
(the first compiles and tunes) and prints one JSON line a round: its wall seconds, E, and per tile
shape the launches, their total and median milliseconds (the first launch of the process left out
of the median) and points a second. Run it from different trees in turn (``cd TREE &&
PYTHONPATH=TREE python3 …``, one FOLDER) to compare versions of the kernel on one machine.
"""

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import cupy
import h5py

from chainexec import api
from chainexec.runtime.backends import cupy as backend

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("folder", type=Path)
parser.add_argument("nocc", type=int)
parser.add_argument("nvir", type=int)
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--tag", default="")
args = parser.parse_args()
config = args.folder / "ccsd_t.yaml"
if not (args.folder / "inputs.h5").exists():
    subprocess.run([sys.executable, "-m", "chainexec.cli", "chem", "x", "--synthetic", str(args.nocc),
                    str(args.nvir), "1", "--out", str(args.folder)], check=True)
    subprocess.run([sys.executable, str(Path(__file__).parent / "set_machine.py"), str(config), "64GiB", "120GiB"],
                   check=True)

times: dict[tuple[int, ...], list[float]] = {}
fused = backend.CupyBackend.fused


def timed(self, f, arrays, shape, out, within=()):
    if not f.lets:
        return fused(self, f, arrays, shape, out, within)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    fused(self, f, arrays, shape, out, within)
    end.record()
    end.synchronize()
    times.setdefault(tuple(shape), []).append(cupy.cuda.get_elapsed_time(start, end))


backend.CupyBackend.fused = timed
for round_ in range(args.rounds):
    times.clear()
    began = time.time()
    api.run(config, backend="cupy", plan_cache=False)
    wall = time.time() - began
    with h5py.File(args.folder / "energy.h5") as f:
        energy = float(f["E"][()])
    shapes = {}
    for shape, ms in times.items():
        timed_ms = sorted(ms[1:] if len(ms) > 1 else ms)
        median = timed_ms[len(timed_ms) // 2]
        shapes[str(shape)] = {"calls": len(ms), "total_ms": round(sum(ms), 2), "median_ms": round(median, 3),
                              "gpoints_per_s": round(math.prod(shape) / (median * 1e-3) / 1e9, 2)}
    print(json.dumps({"tag": args.tag, "round": round_, "wall_s": round(wall, 2),
                      "energy_ms_total": round(sum(sum(ms) for ms in times.values()), 1), "E": repr(energy),
                      "shapes": shapes}), flush=True)
