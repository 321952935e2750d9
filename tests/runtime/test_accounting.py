"""What the counters measure beside bytes: the process's age (:func:`process_seconds`), which the
per-rank report gives at the executor's start."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from chainexec.runtime.accounting import process_seconds

REPO = Path(__file__).resolve().parents[2]


def test_process_seconds_is_the_age_of_the_process():
    """A child that sleeps 0.5 s first is at least that old when it asks, and no older than the
    parent's wall time around it (plus a clock tick of the start time's resolution)."""
    began = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5); "
                            "from chainexec.runtime.accounting import process_seconds; print(process_seconds())"],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    wall = time.perf_counter() - began
    assert child.returncode == 0, child.stderr
    age = float(child.stdout)
    assert 0.5 <= age <= wall + 0.02


def test_process_seconds_of_this_process_grows():
    first = process_seconds()
    time.sleep(0.05)
    assert first > 0 and process_seconds() >= first + 0.04
