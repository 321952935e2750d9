"""The log of first uses a warm-up replays: what a run notes is read back per device and kind,
in the order noted, the newest :data:`uselog.KEPT` kept, written only where something is new,
and an unreadable or unwritable file is a log that is empty or not kept, never an error."""

from __future__ import annotations

import json

import pytest

from chainexec.runtime import uselog

GEMM = ("d", True, False, True, 93, 93, 21, 93, 93, 93, 441, 1)
MODULE = ("0" * 64, "chainexec_sum")
SOURCE = ("chainexec_orbits", 'extern "C" __global__ void chainexec_orbits() {}')


JOB = "/runs/benzene/ccsd_t.yaml"


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Each test is a new process to the log, running :data:`JOB`: nothing seen yet."""
    new_process(monkeypatch)
    monkeypatch.setattr(uselog, "_JOB", [JOB])


def new_process(monkeypatch):
    monkeypatch.setattr(uselog, "_SEEN", {})


def test_noted_uses_are_read_back_per_device_and_kind(tmp_path, monkeypatch):
    where = tmp_path / "uses.json"
    uselog.note("H100", "gemms", GEMM, where)
    uselog.note("H100", "modules", MODULE, where)
    uselog.note("H200", "sources", SOURCE, where)
    new_process(monkeypatch)
    assert uselog.uses("H100", JOB, where)["gemms"] == [GEMM]
    assert uselog.uses("H100", JOB, where)["modules"] == [MODULE]
    assert uselog.uses("H100", JOB, where)["sources"] == []
    assert uselog.uses("H200", JOB, where)["sources"] == [SOURCE]
    assert uselog.uses("A100", JOB, where)["gemms"] == []


def test_the_newest_uses_are_kept_in_the_order_first_noted(tmp_path, monkeypatch):
    where = tmp_path / "uses.json"
    calls = [GEMM[:4] + (n,) + GEMM[5:] for n in range(uselog.KEPT + 5)]
    for call in calls[:3]:
        uselog.note("H100", "gemms", call, where)
    new_process(monkeypatch)  # a later run meets the first call again, then more than KEPT new ones
    for call in [calls[0]] + calls[3:]:
        uselog.note("H100", "gemms", call, where)
    kept = uselog.uses("H100", JOB, where)["gemms"]
    assert len(kept) == uselog.KEPT
    assert kept == calls[5:]
    new_process(monkeypatch)
    uselog.note("H100", "gemms", calls[10], where)
    assert uselog.uses("H100", JOB, where)["gemms"] == calls[5:]  # already there: not moved


def test_the_file_is_written_only_for_a_new_use(tmp_path, monkeypatch):
    where = tmp_path / "uses.json"
    uselog.note("H100", "gemms", GEMM, where)
    written = where.stat().st_mtime_ns
    where.write_text(where.read_text())  # same content, new time: a rewrite would change it again
    stamp = where.stat().st_mtime_ns
    new_process(monkeypatch)
    for _ in range(3):
        uselog.note("H100", "gemms", GEMM, where)
    assert where.stat().st_mtime_ns == stamp and stamp >= written
    uselog.note("H100", "modules", MODULE, where)
    assert json.loads(where.read_text())[f"H100 | {JOB}"] == {"gemms": [list(GEMM)], "modules": [list(MODULE)]}


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]"] + [
    json.dumps({f"H100 | {JOB}": entry}) for entry in ([1], {"gemms": 3}, {"gemms": [[[1]], 2]})])
def test_an_unreadable_log_is_empty_and_replaced_by_the_next_use(tmp_path, text):
    where = tmp_path / "uses.json"
    where.write_text(text)
    assert uselog.uses("H100", JOB, where)["gemms"] == []
    uselog.note("H100", "gemms", GEMM, where)
    assert uselog.uses("H100", JOB, where)["gemms"] == [GEMM]


def test_an_unwritable_folder_keeps_nothing_and_raises_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    where = blocker / "uses.json"  # its folder is a file: nothing can be written there
    uselog.note("H100", "gemms", GEMM, where)
    assert uselog.uses("H100", JOB, where)["gemms"] == []


def test_the_default_file_is_in_the_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path / "kc"))
    uselog.note("H100", "modules", MODULE)
    assert json.loads((tmp_path / "kc" / "uses.json").read_text()) == {f"H100 | {JOB}": {"modules": [list(MODULE)]}}


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


def test_a_use_another_process_added_meanwhile_is_kept_once(tmp_path, monkeypatch):
    where = tmp_path / "uses.json"
    uselog.note("H100", "gemms", GEMM, where)  # this process has read the file: GEMM only
    other = GEMM[:4] + (7,) + GEMM[5:]
    where.write_text(json.dumps({f"H100 | {JOB}": {"gemms": [list(GEMM), list(other)]}}))  # another process
    uselog.note("H100", "gemms", other, where)
    assert uselog.uses("H100", JOB, where)["gemms"] == [GEMM, other]


def test_uses_while_paused_are_not_logged_on_that_thread_only(tmp_path):
    import threading

    where = tmp_path / "uses.json"
    other = GEMM[:4] + (7,) + GEMM[5:]
    with uselog.paused():
        with uselog.paused():
            uselog.note("H100", "gemms", GEMM, where)
        uselog.note("H100", "gemms", GEMM, where)
        beside = threading.Thread(target=uselog.note, args=("H100", "gemms", other, where))
        beside.start()
        beside.join()
    assert uselog.uses("H100", JOB, where)["gemms"] == [other]
    uselog.note("H100", "gemms", GEMM, where)
    assert uselog.uses("H100", JOB, where)["gemms"] == [other, GEMM]


def test_each_job_replays_its_own_uses_and_the_newest_jobs_are_kept(tmp_path, monkeypatch):
    where = tmp_path / "uses.json"
    jobs = [f"/runs/job{n}.yaml" for n in range(uselog.JOBS + 2)]
    for n, job in enumerate(jobs):
        uselog.set_job(job)
        uselog.note("H100", "gemms", GEMM[:4] + (n,) + GEMM[5:], where)
        uselog.note("H200", "gemms", GEMM, where)
    assert uselog.uses("H100", jobs[-1], where)["gemms"] == [GEMM[:4] + (len(jobs) - 1,) + GEMM[5:]]
    assert uselog.uses("H100", jobs[2], where)["gemms"] == [GEMM[:4] + (2,) + GEMM[5:]]
    assert uselog.uses("H100", jobs[1], where)["gemms"] == []  # the oldest two dropped
    assert uselog.uses("H100", jobs[0], where)["gemms"] == []
    assert uselog.uses("H200", jobs[1], where)["gemms"] == []  # per device
    assert uselog.uses("H200", jobs[-1], where)["gemms"] == [GEMM]
    new_process(monkeypatch)
    uselog.set_job(jobs[2])  # the oldest kept job adds a use: it becomes the newest
    uselog.note("H100", "modules", MODULE, where)
    uselog.set_job("/runs/another.yaml")
    uselog.note("H100", "modules", MODULE, where)
    assert uselog.uses("H100", jobs[2], where) == {"gemms": [GEMM[:4] + (2,) + GEMM[5:]], "modules": [MODULE],
                                                   "sources": []}
    assert uselog.uses("H100", jobs[3], where)["gemms"] == []


def test_a_job_is_its_configs_resolved_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = str(tmp_path / "ccsd_t.yaml")
    assert uselog.job_of("ccsd_t.yaml") == uselog.job_of(tmp_path / "." / "ccsd_t.yaml") == expected
