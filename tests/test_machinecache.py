"""The calibration kept per machine: made once on first use (saying so in one stderr line), then
reused; made again for other software versions; never shared between machines (host or GPU
model); refreshed by ``chainexec calibrate`` with no path; ``--machine`` and
``$CHAINEXEC_MACHINE`` win over it. Quick calibrations are the tiny ones here (conftest)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chainexec import api, machinecache
from chainexec.runtime import hostcopy
from tests.conftest import assert_refused, fourindex_config, read_report, run_cli, write_config

FIRST_USE = "chainexec: no calibration of "


@pytest.fixture
def calibrating(monkeypatch):
    """Rates from the cache (no ``$CHAINEXEC_MACHINE``); the cache folder is the test's own."""
    monkeypatch.delenv("CHAINEXEC_MACHINE")
    return machinecache.cache_dir()


def _kept(folder) -> list:
    return sorted(folder.glob("*.json"))


@pytest.mark.mpi
def test_made_once_on_first_use_then_reused(tmp_path, calibrating):
    config = write_config(tmp_path, fourindex_config())
    first = run_cli("plan", config, "--ranks", 2)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count(FIRST_USE) == 1 and len(first.stderr.strip().splitlines()) == 1, first.stderr
    [kept] = _kept(calibrating)
    made = kept.stat().st_mtime_ns
    assert json.loads(kept.read_text())["details"]["kept_for"] == machinecache.identity(None)
    assert "calibration cache: " + str(kept) in first.stdout
    # The run, on other ranks, reads the same calibration: no second one.
    assert run_cli("generate", config).returncode == 0
    second = run_cli("run", config, "--report-json", tmp_path / "r.json", ranks=3)
    assert second.returncode == 0, second.stderr
    assert FIRST_USE not in second.stderr
    assert _kept(calibrating) == [kept] and kept.stat().st_mtime_ns == made
    record = read_report(tmp_path / "r.json")["run"]["machine"]
    assert record["flop_rate"] == {"value": machinecache.load(kept).flop_rate, "from": "calibration cache",
                                   "detail": str(kept)}


def test_first_uses_at_once_make_one_calibration(tmp_path, calibrating):
    """Three plans and a run started together on a machine with no calibration (a job array's
    first runs on a fresh node): one measures, the others wait for it and read what it made
    (each measured while loading the others and the last one kept its rates); all plan with
    the same rates."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    command = [sys.executable, "-m", "chainexec.cli"]
    procs = [subprocess.Popen([*command, "plan", config, "--json"], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    procs.append(subprocess.Popen([*command, "run", config, "--quiet", "--report-json", tmp_path / "r.json"],
                                  cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    ended = [(p.wait(300), *p.communicate()) for p in procs]
    assert all(status == 0 for status, _, _ in ended), ended
    assert sum(err.count(FIRST_USE) for _, _, err in ended) == 1, [err for _, _, err in ended]
    [kept] = _kept(calibrating)
    rate = machinecache.load(kept).flop_rate
    assert all(json.loads(out)["machine"]["flop_rate"]["value"] == rate for _, out, _ in ended[:3])
    assert read_report(tmp_path / "r.json")["run"]["machine"]["flop_rate"]["value"] == rate


@pytest.mark.mpi
def test_a_run_calibrates_on_its_own_ranks(tmp_path, calibrating):
    """Under a launcher the run's ranks measure together, in the process (no nested launch)."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    proc = run_cli("run", config, "--report-json", tmp_path / "r.json", ranks=3)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(FIRST_USE) == 1, proc.stderr
    [kept] = _kept(calibrating)
    details = json.loads(kept.read_text())["details"]
    assert details["ranks"] == 3 and details["quick"] is True
    report = read_report(tmp_path / "r.json")
    assert "calibrate" in report["run"]["phases"]
    assert report["measured"]["bytes"] == report["predicted"]["bytes"]


@pytest.mark.mpi
def test_other_versions_and_machines_get_their_own(tmp_path, calibrating, monkeypatch, capsys):
    config = write_config(tmp_path, fourindex_config())
    api.plan(config)
    [first] = _kept(calibrating)
    assert capsys.readouterr().err.count(FIRST_USE) == 1
    api.plan(config)
    assert FIRST_USE not in capsys.readouterr().err
    # Another NumPy: calibrated anew, the first calibration left for the software it measured.
    versions = machinecache.versions
    monkeypatch.setattr(machinecache, "versions", lambda gpu: versions(gpu) | {"numpy": "0.0"})
    plan = api.plan(config)
    assert capsys.readouterr().err.count(FIRST_USE) == 1
    [second] = set(_kept(calibrating)) - {first}
    assert plan.machine["disk_read"]["detail"] == str(second)
    # Another host of the same model and software: its own file too.
    monkeypatch.setattr(machinecache.platform, "node", lambda: "another-host")
    api.plan(config)
    assert capsys.readouterr().err.count(FIRST_USE) == 1
    assert len(_kept(calibrating)) == 3
    assert any(path.name.startswith("another-host_cpu_") for path in _kept(calibrating))
    # A process a launcher bound to fewer cores measures one thread's host copies: its own file.
    monkeypatch.setattr(hostcopy, "threads", lambda: 1)
    api.plan(config)
    assert capsys.readouterr().err.count(FIRST_USE) == 1
    assert len(_kept(calibrating)) == 4
    # A version of chainexec whose model prices a rate fewer (as one before a rate was added):
    # its own file, so a calibration that lacks a rate is not used by the code that prices it.
    monkeypatch.setattr(machinecache, "RATE_FIELDS", machinecache.RATE_FIELDS[:-1])
    api.plan(config)
    assert capsys.readouterr().err.count(FIRST_USE) == 1
    assert len(_kept(calibrating)) == 5
    # One that measures a rate another way: its own file too.
    monkeypatch.setattr(machinecache, "MEASUREMENTS", machinecache.MEASUREMENTS + 1)
    api.plan(config)
    assert capsys.readouterr().err.count(FIRST_USE) == 1
    assert len(_kept(calibrating)) == 6


def test_identities_name_distinct_files():
    base = {"host": "node1", "gpu": "cpu", "cores": 16,
            "versions": {"chainexec": "0.1.0", "numpy": "2.0", "python": "3.11"}, "rates": ["disk_read"]}
    others = [base | {"host": "node2"}, base | {"gpu": "NVIDIA H200"}, base | {"gpu": "NVIDIA H100 80GB HBM3"},
              base | {"versions": base["versions"] | {"cupy": "13.0"}}, base | {"host": "a/../b"}, base | {"cores": 1},
              base | {"rates": ["disk_read", "host_lock"]}, base | {"measurements": 1}]
    paths = [machinecache.path(i) for i in [base, *others]]
    assert len(set(paths)) == len(paths)
    assert all(p.parent == machinecache.cache_dir() for p in paths)
    assert paths[2].name.startswith("node1_NVIDIA-H200_")


@pytest.mark.mpi
def test_calibrate_without_a_path_refreshes_the_cache(tmp_path, calibrating):
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("plan", config).returncode == 0
    [kept] = _kept(calibrating)
    made = kept.stat().st_mtime_ns
    proc = run_cli("calibrate", "--quick", "--ranks", 1, "--backend", "numpy")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"wrote {kept}"
    assert kept.stat().st_mtime_ns > made
    assert json.loads(kept.read_text())["details"]["ranks"] == 1
    again = run_cli("plan", config)
    assert again.returncode == 0 and FIRST_USE not in again.stderr


def test_calibrate_without_a_path_waits_for_a_first_use_calibration(tmp_path, calibrating):
    """``chainexec calibrate`` refreshing the cache while a run's first-use calibration holds it
    (its lock, :func:`chainexec.machinecache.held`) measures after it, not at once: until the
    lock is let go it has measured nothing and written nothing; then it writes the cache."""
    import time

    from chainexec import calibrate

    ident = machinecache.identity(None)
    where = calibrate.writable(ident)
    command = [sys.executable, "-m", "chainexec.cli", "calibrate", "--quick", "--ranks", "1", "--backend", "numpy"]
    with machinecache.held(ident):
        proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not _waits_for_a_lock(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "calibrate did not wait for the lock"
            time.sleep(0.05)
        assert not where.exists() and not list(tmp_path.iterdir())
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert out.strip().splitlines()[-1] == f"wrote {where}"
    assert machinecache.load(where).flop_rate > 0


def _waits_for_a_lock(pid: int) -> bool:
    """Whether process ``pid`` is blocked on a file lock (a ``->`` line of ``/proc/locks``)."""
    with open("/proc/locks") as locks:
        return any(line.split()[1] == "->" and line.split()[5] == str(pid) for line in locks)


@pytest.mark.mpi
def test_a_broken_calibration_is_made_again(tmp_path, calibrating):
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("plan", config).returncode == 0
    [kept] = _kept(calibrating)
    kept.write_text('{"disk_read": ')
    proc = run_cli("plan", config)
    assert proc.returncode == 0 and proc.stderr.count(FIRST_USE) == 1, proc.stderr
    assert machinecache.load(kept).flop_rate > 0


def test_machine_files_win_over_the_cache(tmp_path, calibrating, monkeypatch):
    config = write_config(tmp_path, fourindex_config())
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps({"disk_read": 1e9, "disk_write": 1e9, "global_to_device": 1e10,
                                   "device_to_global": 1e10, "flop_rate": 3e7}))
    data = json.loads(run_cli("plan", config, "--machine", machine, "--json").stdout)["machine"]
    assert data["flop_rate"] == {"value": 3e7, "from": "machine file", "detail": str(machine)}
    assert data["statement_seconds"]["from"] == "defaults"
    monkeypatch.setenv("CHAINEXEC_MACHINE", str(machine))
    data = json.loads(run_cli("plan", config, "--json").stdout)["machine"]
    assert data["flop_rate"]["detail"] == f"{machine} ($CHAINEXEC_MACHINE)"
    monkeypatch.setenv("CHAINEXEC_MACHINE", str(tmp_path / "missing.json"))
    assert_refused(run_cli("plan", config), "missing.json", "cannot read machine file")
    assert _kept(calibrating) == []


@pytest.mark.mpi
def test_a_cache_that_cannot_be_written_is_one_line(tmp_path, calibrating, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("CHAINEXEC_CACHE", str(blocker / "machines"))
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    for proc in (run_cli("plan", config), run_cli("run", config, ranks=3)):
        assert_refused(proc, str(blocker / "machines"), "cannot make the calibration cache folder", "--machine")


def test_a_lock_that_cannot_be_opened_is_one_line(tmp_path, calibrating):
    """The first-use calibration's lock a folder (or, in a cache shared between users, another
    user's file): one line naming it, exit 2 (an IsADirectoryError traceback)."""
    ident = machinecache.identity(None)
    lock = machinecache.path(ident).with_name(machinecache.path(ident).name + ".lock")
    lock.mkdir(parents=True)
    config = write_config(tmp_path, fourindex_config())
    assert_refused(run_cli("plan", config), str(lock), "cannot open the calibration lock", "--machine")


def test_a_first_use_under_fewer_cores_than_ranks_calibrates_on_the_cores_it_may_use(tmp_path, calibrating):
    """``plan --ranks 2`` in a process allowed one core (a SLURM job given part of a node) and no
    calibration yet: the quick calibration runs on one rank and the plan is made (refused: 2 is
    more than the 1 cores, the cap being the machine's core count)."""
    config = write_config(tmp_path, fourindex_config())
    code = ("import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from chainexec.cli import command; sys.argv = ['chainexec', 'plan', sys.argv[1], '--ranks', '2']; "
            "command()")
    proc = subprocess.run([sys.executable, "-c", code, str(config)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stderr.count(FIRST_USE) == 1, proc.stderr
    [kept] = _kept(calibrating)
    assert json.loads(kept.read_text())["details"]["ranks"] == 1
