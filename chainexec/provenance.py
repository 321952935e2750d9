"""Where a benchmark figure comes from: commit, date, command, host and, when a GPU is in use,
the device and its software — recorded with every result in ``benchmarks/results/``."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def provenance(gpu: bool = False) -> dict:
    """Commit (``CHAINEXEC_COMMIT`` outside a git checkout), UTC date, command, CPU and library
    versions; with ``gpu``, the current CUDA device's name, SMs, compute capability and versions."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = os.environ.get("CHAINEXEC_COMMIT", "unknown")
    record = {"commit": commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.executable).name] + sys.argv),
              "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "python": platform.python_version(), "numpy": np.__version__}
    if gpu:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"]
        record |= {"device": name.decode() if isinstance(name, bytes) else name,
                   "sm_count": props["multiProcessorCount"],
                   "compute_capability": f"{props['major']}{props['minor']}",
                   "cupy": cupy.__version__, "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
                   "driver": cupy.cuda.runtime.driverGetVersion()}
    return record
