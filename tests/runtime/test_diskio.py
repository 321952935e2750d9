"""The disk worker runs jobs in submission order (a small one with nothing pending at once, on the
calling thread), waits up to a job number, times its jobs by the
statement each serves and raises a job's error where it is waited for."""

from __future__ import annotations

import threading
import time

import pytest

from chainexec.runtime.diskio import INLINE_BYTES, DiskWorker


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


def test_a_small_job_with_nothing_pending_runs_on_the_calling_thread():
    """Under INLINE_BYTES and behind finished jobs only: run at once, here, its seconds counted
    at wait; its error raised at once, and nothing run after it."""
    worker = DiskWorker()
    threads = []

    def job():
        threads.append(threading.get_ident())

    def fail():
        raise OSError("disk gone")

    assert worker.submit("load A", job, nbytes=INLINE_BYTES - 1) == 1
    assert threads == [threading.get_ident()] and worker.finished(1)
    assert worker.submit("load A", job, nbytes=0) == 2
    assert set(worker.wait()) == {"load A"} and threads == [threading.get_ident()] * 2
    with pytest.raises(OSError, match="disk gone"):
        worker.submit("store T", fail, nbytes=8)
    worker.close()


def test_no_small_job_runs_after_a_failed_one():
    """A queued job failed: the next small job raises its error instead of running."""
    worker = DiskWorker()
    ran = []

    def fail():
        raise OSError("disk gone")

    worker.submit("store T", fail)
    with pytest.raises(OSError, match="disk gone"):
        while not worker.finished(1):
            time.sleep(0.001)
    with pytest.raises(OSError, match="disk gone"):
        worker.submit("store T", ran.append, 1, nbytes=8)
    assert ran == []
    worker.close()


@pytest.mark.parametrize("nbytes", [INLINE_BYTES, None])
def test_large_and_unsized_jobs_go_to_the_worker(nbytes):
    worker = DiskWorker()
    threads = []
    worker.submit("load A", lambda: threads.append(threading.get_ident()), nbytes=nbytes)
    worker.wait()
    assert threads and threads[0] != threading.get_ident()
    worker.close()


def test_a_small_job_behind_a_pending_one_keeps_its_place():
    """A small job submitted while a large one runs is queued behind it, not run ahead of it."""
    worker = DiskWorker()
    seen, release = [], threading.Event()

    def slow():
        release.wait(5)
        seen.append("large")

    def small():
        seen.append(("small", threading.get_ident()))

    worker.submit("load A", slow, nbytes=INLINE_BYTES * 4)
    worker.submit("store T", small, nbytes=16)
    assert seen == []
    release.set()
    worker.wait()
    assert seen[0] == "large" and seen[1][0] == "small" and seen[1][1] != threading.get_ident()
    worker.close()
