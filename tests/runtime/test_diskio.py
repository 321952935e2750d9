"""The disk worker runs jobs in submission order, waits up to a job number, times its jobs by the
statement each serves and raises a job's error where it is waited for."""

from __future__ import annotations

import threading
import time

import pytest

from chainexec.runtime.diskio import DiskWorker


def test_jobs_run_in_order_off_the_calling_thread():
    worker = DiskWorker()
    seen, threads = [], set()

    def job(n, pause):
        time.sleep(pause)
        seen.append(n)
        threads.add(threading.get_ident())

    # Later jobs are quicker: only submission order can put them last.
    tickets = [worker.submit(f"job {n % 2}", job, n, 0.02 * (5 - n)) for n in range(5)]
    assert tickets == [1, 2, 3, 4, 5]
    busy = worker.wait(3)
    assert seen[:3] == [0, 1, 2] and set(busy) == {"job 0", "job 1"}
    assert busy["job 0"] >= 0.02 * (5 + 3) and busy["job 1"] >= 0.02 * 4
    rest = worker.wait()
    assert seen == [0, 1, 2, 3, 4] and threads and threading.get_ident() not in threads
    assert set(rest) == {"job 0", "job 1"} and rest["job 0"] >= 0.02 and rest["job 1"] >= 0.02 * 2
    assert worker.wait() == {}  # nothing left
    worker.close()


def test_errors_surface_at_wait():
    worker = DiskWorker()

    def fail():
        raise OSError("disk gone")

    worker.submit("store T", fail)
    with pytest.raises(OSError, match="disk gone"):
        worker.wait()
    worker.close()
