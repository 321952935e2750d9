"""The log of first uses a warm-up replays: what a run notes is kept in memory and merged into the
file by ``flush`` (per device, job and kind, in the order first noted, the newest ``KEPT`` uses
and ``JOBS`` jobs kept); the file is rewritten only where it changes; paused uses are not
logged; an unreadable or unwritable file is a log that is empty or not kept, never an error."""

from __future__ import annotations

import json
import threading

import pytest

from chainexec.runtime import uselog

GEMM = ("d", True, False, True, 93, 93, 21, 93, 93, 93, 441, 1)
MODULE = ("0" * 64, "chainexec_sum")
SOURCE = ("chainexec_orbits", 'extern "C" __global__ void chainexec_orbits() {}')
PREPARED = ("_symmetrize_prepared", "[[6, 6, 93], [558, 93, 1], [[1, 0, 2]], \"float64\"]")
JOB = "/runs/benzene/ccsd_t.yaml"


def gemm(n: int) -> tuple:
    return GEMM[:4] + (n,) + GEMM[5:]


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Each test is a new process to the log, running :data:`JOB`: nothing gathered yet."""
    monkeypatch.setattr(uselog, "_PENDING", {})
    monkeypatch.setattr(uselog, "_JOB", JOB)


def test_noted_uses_are_kept_per_device_job_and_kind(tmp_path):
    where = tmp_path / "uses.json"
    uselog.note("H100", "gemms", GEMM)
    uselog.note("H100", "modules", MODULE)
    uselog.note("H200", "sources", SOURCE)
    uselog.note("H200", "prepared", PREPARED)
    assert not where.exists()  # nothing written before the flush
    uselog.flush(where)
    assert uselog.uses("H100", JOB, where) == {"gemms": [GEMM], "modules": [MODULE], "sources": [], "prepared": []}
    assert uselog.uses("H200", JOB, where) == {"gemms": [], "modules": [], "sources": [SOURCE], "prepared": [PREPARED]}
    assert uselog.uses("H100", "/runs/other.yaml", where)["gemms"] == []
    assert uselog.uses("A100", JOB, where)["gemms"] == []


def test_the_newest_uses_are_kept_in_the_order_first_noted(tmp_path):
    where = tmp_path / "uses.json"
    calls = [gemm(n) for n in range(uselog.KEPT + 5)]
    for call in calls[:3] + calls[:2]:
        uselog.note("H100", "gemms", call)
    uselog.flush(where)
    assert uselog.uses("H100", JOB, where)["gemms"] == calls[:3]
    for call in [calls[0]] + calls[3:]:  # a later run meets the first call again, then more than KEPT new ones
        uselog.note("H100", "gemms", call)
    uselog.flush(where)
    assert uselog.uses("H100", JOB, where)["gemms"] == calls[5:]


def test_the_file_is_rewritten_only_where_it_changes(tmp_path):
    where = tmp_path / "uses.json"
    uselog.note("H100", "gemms", GEMM)
    uselog.flush(where)
    where.write_text(where.read_text())  # same content, a time of its own
    stamp = where.stat().st_mtime_ns
    for _ in range(3):  # a later run that meets nothing new
        uselog.note("H100", "gemms", GEMM)
    uselog.flush(where)
    uselog.flush(where)  # nothing gathered
    assert where.stat().st_mtime_ns == stamp
    uselog.note("H100", "modules", MODULE)
    uselog.flush(where)
    assert json.loads(where.read_text()) == {f"H100 | {JOB}": {"gemms": [list(GEMM)], "modules": [list(MODULE)],
                                                               "sources": [], "prepared": []}}


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]"] + [
    json.dumps({f"H100 | {JOB}": entry}) for entry in ([1], {"gemms": 3}, {"gemms": [[[1]], 2]})])
def test_an_unreadable_log_is_empty_and_replaced_by_the_next_flush(tmp_path, text):
    where = tmp_path / "uses.json"
    where.write_text(text)
    assert uselog.uses("H100", JOB, where)["gemms"] == []
    uselog.note("H100", "gemms", GEMM)
    uselog.flush(where)
    assert uselog.uses("H100", JOB, where)["gemms"] == [GEMM]


def test_an_unwritable_folder_keeps_nothing_and_raises_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    where = blocker / "uses.json"  # its folder is a file: nothing can be written there
    uselog.note("H100", "gemms", GEMM)
    uselog.flush(where)
    assert uselog.uses("H100", JOB, where)["gemms"] == []


def test_the_default_file_is_in_the_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path / "kc"))
    uselog.note("H100", "modules", MODULE)
    uselog.flush()
    assert uselog.uses("H100", JOB, tmp_path / "kc" / "uses.json")["modules"] == [MODULE]


def test_uses_another_process_flushed_meanwhile_are_kept_once(tmp_path):
    where = tmp_path / "uses.json"
    other = gemm(7)
    uselog.note("H100", "gemms", GEMM)
    uselog.note("H100", "gemms", other)
    where.write_text(json.dumps({f"H100 | {JOB}": {"gemms": [list(other)]}}))  # another process's flush
    uselog.flush(where)
    assert uselog.uses("H100", JOB, where)["gemms"] == [other, GEMM]


def test_uses_while_paused_are_not_logged_on_that_thread_only(tmp_path):
    where = tmp_path / "uses.json"
    other = gemm(7)
    with uselog.paused():
        with uselog.paused():
            uselog.note("H100", "gemms", GEMM)
        uselog.note("H100", "gemms", GEMM)
        beside = threading.Thread(target=uselog.note, args=("H100", "gemms", other))
        beside.start()
        beside.join()
    uselog.flush(where)
    assert uselog.uses("H100", JOB, where)["gemms"] == [other]
    uselog.note("H100", "gemms", GEMM)
    uselog.flush(where)
    assert uselog.uses("H100", JOB, where)["gemms"] == [other, GEMM]


def test_each_job_keeps_its_own_uses_and_the_newest_jobs_are_kept(tmp_path):
    where = tmp_path / "uses.json"
    jobs = [f"/runs/job{n}.yaml" for n in range(uselog.JOBS + 2)]
    for n, job in enumerate(jobs):
        uselog.set_job(job)
        uselog.note("H100", "gemms", gemm(n))
        uselog.note("H200", "gemms", GEMM)
        uselog.flush(where)
    assert uselog.uses("H100", jobs[-1], where)["gemms"] == [gemm(len(jobs) - 1)]
    assert uselog.uses("H100", jobs[2], where)["gemms"] == [gemm(2)]
    assert uselog.uses("H100", jobs[1], where)["gemms"] == []  # the oldest two dropped
    assert uselog.uses("H100", jobs[0], where)["gemms"] == []
    assert uselog.uses("H200", jobs[1], where)["gemms"] == []  # per device
    assert uselog.uses("H200", jobs[-1], where)["gemms"] == [GEMM]
    uselog.set_job(jobs[2])  # the oldest job kept gains a use: it becomes the newest
    uselog.note("H100", "modules", MODULE)
    uselog.flush(where)
    uselog.set_job("/runs/another.yaml")
    uselog.note("H100", "modules", MODULE)
    uselog.flush(where)
    assert uselog.uses("H100", jobs[2], where) == {"gemms": [gemm(2)], "modules": [MODULE], "sources": [],
                                                   "prepared": []}
    assert uselog.uses("H100", jobs[3], where)["gemms"] == []


def test_a_job_is_its_configs_resolved_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real.yaml").write_text("")
    (tmp_path / "link.yaml").symlink_to(tmp_path / "real.yaml")
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    expected = str(tmp_path / "real.yaml")
    assert uselog.job_of("real.yaml") == uselog.job_of(tmp_path / "." / "link.yaml") == expected
    assert uselog.job_of("loop.yaml").startswith(str(tmp_path))  # a link loop: a path, no error


def test_device_names_come_from_the_device_properties(monkeypatch):
    monkeypatch.setattr(uselog, "_NAMES", {})

    class FakeCupy:
        class cuda:
            class runtime:
                @staticmethod
                def getDeviceProperties(device):
                    return {"name": f"GPU {device}".encode()}

            @staticmethod
            def Device():
                class Current:
                    id = 3
                return Current

    assert uselog.device_name(FakeCupy, 1) == "GPU 1"
    assert uselog.device_name(FakeCupy) == "GPU 3"


def test_paused_as_a_decorator_pauses_each_call(tmp_path):
    """As the autotuner's timing method uses it: every call is paused, and only while it runs."""
    @uselog.paused()
    def timed(use):
        uselog.note("H100", "gemms", use)

    timed(GEMM)
    timed(gemm(7))
    uselog.note("H100", "gemms", gemm(8))
    uselog.flush(tmp_path / "uses.json")
    assert uselog.uses("H100", JOB, tmp_path / "uses.json")["gemms"] == [gemm(8)]
