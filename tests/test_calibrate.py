"""``chainexec calibrate``: a quick calibration under mpiexec writes a machine file the planner reads,
with plausible rates; bad paths fail before anything is measured; the disk read methods read the
whole file."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from chainexec import calibrate_worker, machinecache, spec
from chainexec.calibrate import (FULL, QUICK, QUICK_VARIABLE, TINY, _check_writable, _launcher_reason, _remove_late,
                                 add_arguments, calibrate, settings, unbound)
from chainexec.calibrate_worker import DIRECT, FADVISE, read_method, read_seconds, write_seconds
from chainexec.errors import ChainexecError
from chainexec.planner.build import make_plan
from chainexec.planner.cost import predict, predict_nests
from chainexec.planner.machine import Machine
from tests.conftest import mpiexec

REPO = Path(__file__).resolve().parents[1]
RATES = ("disk_read", "disk_write", "global_to_device", "device_to_global", "flop_rate", "device_bandwidth",
         "disk_write_cached")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """One quick 2-rank calibration shared by the tests below: (machine file, returned Machine)."""
    if mpiexec() is None:
        pytest.skip("no mpiexec")
    path = tmp_path_factory.mktemp("calibrate") / "machine.json"
    machine, written = calibrate(path, quick=True, ranks=2)
    assert written == path
    return path, machine


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_file_round_trips_with_plausible_rates(calibrated):
    path, machine = calibrated
    loaded = machinecache.load(path)
    assert loaded == machine
    assert loaded.source.startswith("chainexec calibrate on ")
    for name in RATES:
        assert math.isfinite(getattr(loaded, name)) and getattr(loaded, name) > 0, name
    # Wide ranges for a CPU node or a GPU (FP64 GEMM up to ~70 TFLOP/s): outside is a units or timing bug.
    backend = json.loads(path.read_text())["details"]["backend"]
    assert 1e8 <= loaded.flop_rate <= (1e13 if backend == "numpy" else 1e15)
    assert 1e6 <= loaded.disk_read <= 1e11
    assert 1e6 <= loaded.disk_write <= 1e11
    assert 1e6 <= loaded.disk_write_cached <= 1e12
    assert isinstance(loaded.write_cache_bytes, int) and loaded.write_cache_bytes >= 0
    assert 1e7 <= loaded.global_to_device <= 1e12
    assert 1e6 <= loaded.device_to_global <= 1e12
    # Memory copies: from a slow CPU node's DRAM to HBM (H100 about 3e12 bytes/s read + written).
    assert 1e8 <= loaded.device_bandwidth <= 2e13
    # One tiny contraction, one transfer of a tiny tile: at least a microsecond of dispatch, far
    # below a second.
    assert 1e-7 <= loaded.statement_seconds <= 1e-2
    assert 1e-7 <= loaded.transfer_call_seconds <= 1e-2
    assert 1e-7 <= loaded.disk_call_seconds <= 1e-1
    assert not path.with_name(path.name + ".tmp").exists()


@pytest.mark.mpi
def test_details_record_how_and_what_was_measured(calibrated):
    path, machine = calibrated
    details = json.loads(path.read_text())["details"]
    assert details["ranks"] == 2 and details["quick"] is True and details["repetitions"] == 3
    # launched unbound: each rank may use the cores this process may (Open MPI would bind it to one)
    assert details["cores_per_rank"] == len(os.sched_getaffinity(0))
    assert details["disk"]["read_method"] in (DIRECT, FADVISE)
    assert details["disk"]["read"]["per_second"] == machine.disk_read
    assert details["disk"]["file_bytes_per_rank"] >= details["disk"]["bytes_per_rank"] > 0
    assert details["gemm"]["flops_per_call"] == 2 * details["gemm"]["n"] ** 3
    assert details["gemm"]["per_second"] == machine.flop_rate
    assert details["statement"]["seconds"] == machine.statement_seconds
    assert details["statement"]["transfer_call_seconds"] == machine.transfer_call_seconds
    assert details["load"]["disk_call_seconds"] == machine.disk_call_seconds
    # the statement chain's gets and accumulates, and the loads of its run in little global memory
    assert details["statement"]["calls_per_run"]["global<->device"] > details["statement"]["statements_per_run"]
    assert details["load"]["calls_per_run"]["disk"] > 100
    # the quick profile's product, 24³ in tiles of 2 KiB: 144 compute statements a run
    assert "24-cubed" in details["statement"]["what"] and details["statement"]["statements_per_run"] == 144
    assert details["device_copy"]["per_second"] == machine.device_bandwidth
    used = {p.size: p for p in (QUICK, TINY)}[details["disk"]["bytes_per_rank"]]  # the fixture's profile
    # a (T)-shaped tile of about copy_size bytes, read and written in each of six orders
    shape = details["device_copy"]["shape"]
    assert shape[:3] == [4, 4, 4] and shape[3] == shape[4] == shape[5]
    assert details["device_copy"]["bytes_per_call"] == 6 * 2 * 8 * math.prod(shape)
    assert 0.8 * used.copy_size < 8 * math.prod(shape) < 1.2 * used.copy_size
    # Medians of the per-repetition samples.
    assert details["disk"]["cached_write"]["per_second"] == machine.disk_write_cached
    # the profile's stripes per thread at least (one in the tests' tiny profile, four in the others)
    assert details["disk"]["cached_write"]["bytes_per_rank"] == max(
        used.size, used.stripes * details["cores_per_rank"] * (16 << 20))
    assert details["disk"]["write_cache"]["bytes_per_host"] // 2 == machine.write_cache_bytes
    for group, key in (("disk", "write"), ("disk", "cached_write"), ("global_array", "get"), ("global_array", "accumulate"),
                       ("global_array", "fill")):
        assert np.median(details[group][key]["samples_per_second"]) == details[group][key]["per_second"]
    assert details["global_array"]["fill"]["per_second"] == machine.global_fill > 0
    assert details["global_array"]["fill"]["bytes_per_rank"] >= used.copy_size // 8192 * 8192  # rows of 1024 float64
    if details["backend"] == "numpy":
        # On the CPU the device is host memory: global→device is the get, device→global the accumulate.
        assert details["host_device"] is None
        assert not machine.async_statements  # NumPy runs statements on the host, one after the other
        assert machine.global_to_device == details["global_array"]["get"]["per_second"]
        assert machine.device_to_global == details["global_array"]["accumulate"]["per_second"]
        assert details["orbit"] is None and machine.orbit_bandwidth is None  # no orbit kernels on the CPU
    else:
        assert machine.async_statements  # queued on a CUDA stream
        orbit = details["orbit"]
        assert orbit["per_second"] == machine.orbit_bandwidth
        assert orbit["points"] == calibrate_worker.ORBIT_CALLS * math.prod(
            calibrate_worker.ORBIT_TILE if i in "ijk" else calibrate_worker.ORBIT_EDGE for i in calibrate_worker.ORBIT_DOMAIN)
        assert orbit["bytes_per_point"] == pytest.approx(116.7104, rel=1e-12)


@pytest.mark.mpi
def test_planner_predicts_with_the_calibrated_rates(calibrated):
    path, _ = calibrated
    loaded = machinecache.load(path)
    config = spec.load(REPO / "configs" / "fourindex.yaml")
    plan = make_plan(config, loaded)
    measured = plan.predicted
    moved = measured["bytes"]
    calls = predict_nests(plan.nests, plan.tensors, plan.extents, plan.contractions, loaded)["calls"]
    assert calls["disk"] > 0 and calls["global<->device"] > 0
    cached = min(moved["global->disk"], loaded.write_cache_bytes)
    expected = {
        "disk": moved["disk->global"] / loaded.disk_read + cached / loaded.disk_write_cached
        + (moved["global->disk"] - cached) / loaded.disk_write + calls["disk"] * loaded.disk_call_seconds,
        "global<->device": moved["global->device"] / loaded.global_to_device
        + moved["device->global"] / loaded.device_to_global + calls["global<->device"] * loaded.transfer_call_seconds,
    }
    assert {k: measured["seconds"][k] for k in expected} == pytest.approx(expected, rel=1e-12)
    # compute: per statement the larger of its flops' and its streamed bytes' time
    flop_s, byte_s = measured["flops"] / loaded.flop_rate, measured["streamed"] / loaded.device_bandwidth
    assert max(flop_s, byte_s) * (1 - 1e-12) <= measured["seconds"]["compute"] <= (flop_s + byte_s) * (1 + 1e-12)
    # The same schedule priced with the defaults differs by the rates (the planner may choose
    # another schedule under other rates, so this plan is priced again).
    assert predict(plan, Machine())["seconds"] != measured["seconds"]


def test_unwritable_path_fails_before_measuring(tmp_path):
    missing = tmp_path / "no-such-folder" / "machine.json"
    with pytest.raises(ChainexecError, match="cannot write the machine file") as err:
        calibrate(missing, quick=True)
    assert str(missing) in str(err.value)
    with pytest.raises(ChainexecError, match="is a directory") as err:
        calibrate(tmp_path, quick=True)
    assert str(tmp_path) in str(err.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text", ["important notes\n", '{"disk_read": 1.0}', "\xff\xfe", '{"source": "mine"}'])
def test_a_file_that_is_not_a_machine_file_is_not_replaced(tmp_path, text):
    """An existing file calibrate would replace that is not a machine file (the user's notes,
    JSON that is no machine file): refused before measuring, left as it was."""
    path = tmp_path / "notes.txt"
    path.write_text(text, errors="surrogateescape")
    before = path.read_bytes()
    with pytest.raises(ChainexecError, match="not a machine file") as err:
        calibrate(path, quick=True)
    assert str(path) in str(err.value)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_a_machine_file_is_replaced_by_a_new_calibration(calibrated, tmp_path):
    """A machine file (here the shared calibration's) is what ``calibrate PATH`` replaces."""
    path = tmp_path / "machine.json"
    path.write_text(calibrated[0].read_text())
    _check_writable(path)


@pytest.mark.parametrize("ranks", [0, 1])
def test_the_files_beside_the_machine_file_are_left_as_they_were(tmp_path, ranks):
    """``m.json.tmp`` (the user's) and ``v.json.tmp`` (a link to another file) beside the machine
    files: the writability probe takes a fresh name (it emptied and removed the fixed name
    PATH.tmp, through the link too), and a bad argument is refused before the probe."""
    (tmp_path / "m.json.tmp").write_text("notes\n")
    (tmp_path / "victim.txt").write_text("precious\n")
    (tmp_path / "v.json.tmp").symlink_to(tmp_path / "victim.txt")
    if ranks < 1:
        with pytest.raises(ChainexecError, match="ranks must be at least 1"):
            calibrate(tmp_path / "m.json", quick=True, ranks=ranks)
    else:
        for name in ("m.json", "v.json"):
            _check_writable(tmp_path / name)
    assert (tmp_path / "m.json.tmp").read_text() == "notes\n" and (tmp_path / "victim.txt").read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json.tmp", "v.json.tmp", "victim.txt"]


def test_more_ranks_than_cores_are_refused_before_measuring(tmp_path):
    """A calibration's ranks stand for a run's on this node: more than the cores this process
    may use would only measure oversubscription (and, at hundreds, launch for minutes)."""
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ChainexecError, match=f"{cores + 1} is more than the {cores} cores"):
        calibrate(tmp_path / "machine.json", quick=True, ranks=cores + 1)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_scratch(tmp_path):
    scratch = tmp_path / "not-a-folder"
    scratch.write_text("")
    with pytest.raises(ChainexecError, match="scratch") as err:
        calibrate(tmp_path / "machine.json", scratch=scratch, quick=True)
    assert str(scratch) in str(err.value)
    assert not (tmp_path / "machine.json").exists()


def test_read_methods_read_the_whole_file(tmp_path):
    """Whatever the filesystem supports (O_DIRECT on most local disks, else fadvise), and the fadvise
    fallback always: the read returns every byte of the file that was written and fsynced."""
    path = tmp_path / "probe.h5"
    assert write_seconds(path, np.arange(300_000, dtype=np.float64)) > 0
    for method in {read_method(path), FADVISE}:
        seconds, nbytes = read_seconds(path, method)
        assert seconds > 0 and nbytes == path.stat().st_size, method


def test_arguments_match_calibrate():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = vars(parser.parse_args(["m.json", "--size", "8MiB", "--ranks", "3", "--quick"]))
    assert args == {"path": "m.json", "scratch": None, "size": 8 << 20, "backend": "auto", "ranks": 3, "quick": True}
    assert set(args) == set(inspect.signature(calibrate).parameters)
    with pytest.raises(SystemExit):
        parser.parse_args(["m.json", "--size", "lots"])


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_worker_failure_is_one_clear_error(tmp_path):
    """A rank's error (here: CuPy asked for where there is none) comes back as the error's own line,
    not as MPICH's abort message, and no machine file is written."""
    if mpiexec() is None:
        pytest.skip("no mpiexec")
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: the cupy backend may well work here")
    with pytest.raises(ChainexecError, match="backend cupy is not usable here"):
        calibrate(tmp_path / "machine.json", quick=True, backend="cupy")
    assert not (tmp_path / "machine.json").exists()


def test_the_error_folder_is_removed_while_a_late_rank_still_writes_into_it(tmp_path):
    """Ranks the launcher has not yet ended may write their reports into the error folder while
    it is being removed (``shutil.rmtree`` then fails on a folder not empty): here a stand-in
    writes reports for 0.3 s, then ends; the folder is removed all the same."""
    import threading
    import time

    folder = tmp_path / "errors"
    folder.mkdir()
    first = threading.Event()

    def late_ranks():
        n, until = 0, time.monotonic() + 0.3
        while time.monotonic() < until:
            try:
                (folder / f"rank{n % 64}").write_text("ChainexecError: late\n")
            except OSError:  # the folder is gone
                return
            first.set()
            n += 1

    writer = threading.Thread(target=late_ranks)
    writer.start()
    first.wait()
    try:
        _remove_late(folder)
    finally:
        writer.join()
    assert not folder.exists()


OPEN_MPI_ROOT = """--------------------------------------------------------------------------
mpiexec has detected an attempt to run as root.

Running as root is *strongly* discouraged as any mistake (e.g., in
defining TMPDIR) or bug can result in catastrophic damage to the OS
--------------------------------------------------------------------------
"""
OPEN_MPI_SLOTS = """--------------------------------------------------------------------------
There are not enough slots available in the system to satisfy the 4
slots that were requested by the application:

  python3

Either request fewer slots for your application, or make more slots
--------------------------------------------------------------------------
[h1:12345] 3 more processes have sent help message help-orte-rmaps-base.txt / orte-rmaps-base:alloc-error
[h1:12345] Set MCA parameter "orte_base_help_aggregate" to 0 to see all help / error messages
"""
SLOTS = "There are not enough slots available in the system to satisfy the 4 slots that were requested by the application:"


@pytest.mark.parametrize("stderr, reason", [
    (OPEN_MPI_ROOT, "mpiexec has detected an attempt to run as root."),
    ("warning: slow disk\n" + OPEN_MPI_ROOT, "mpiexec has detected an attempt to run as root."),
    (OPEN_MPI_SLOTS, SLOTS),
    (OPEN_MPI_ROOT + "Abort(1) on node 0\n", "Abort(1) on node 0"),
    ("first\n  last line  \n\n", "last line"),
    ("----------\n\n", "no output"),
    ("----------\n----------\n", "no output"),
    ("[mpiexec@h1] HYDU_create_process (lib/utils/launch.c:73): execvp error on file python3 (No such file)\n",
     "[mpiexec@h1] HYDU_create_process (lib/utils/launch.c:73): execvp error on file python3 (No such file)"),
    ("[h1:12345] *** An error occurred in MPI_Init\n[h1:12345] *** on a NULL communicator\n",
     "[h1:12345] *** on a NULL communicator"),
    ("", "no output"),
])
def test_launcher_failure_names_its_message_not_a_rule(stderr, reason):
    """Where no rank left a report, the error carries the launcher's message in one line: the
    first paragraph inside Open MPI's last box of dashes (its own lines after the box left out),
    else the last line with text."""
    assert _launcher_reason(stderr) == reason


@pytest.mark.parametrize("version, flags", [
    ("mpiexec (Open MPI) 4.1.5\n\nReport bugs to http://www.open-mpi.org/community/help/\n", ["--bind-to", "none"]),
    ("mpiexec (OpenRTE) 4.0.3\n", ["--bind-to", "none"]),
    ("HYDRA build details:\n    Version:                                 4.1.2\n", []),
    ("", []),
])
def test_launcher_starts_ranks_unbound(version, flags):
    """Open MPI binds a rank of two or fewer to one core: the calibration asks it not to, as a run
    started without a launcher is not; MPICH's Hydra binds nothing unless asked."""
    assert unbound(version) == flags


def test_a_launcher_that_cannot_say_its_version_gets_no_options(tmp_path):
    """One that is missing or fails says nothing: the calibration starts it as it is."""
    from chainexec.calibrate import _version

    assert _version(str(tmp_path / "no-mpiexec"), dict(os.environ)) == ""
    assert unbound(_version("false", dict(os.environ))) == []


def test_a_quick_calibration_copies_as_much_device_memory_as_a_full_one(tmp_path, monkeypatch):
    """The device copy is microseconds long at the disk's quick size: too short against the clock."""
    monkeypatch.delenv(QUICK_VARIABLE, raising=False)
    quick, full = (settings(tmp_path, q, "cupy") for q in (True, False))
    assert quick["copy_size"] == full["copy_size"] == FULL.copy_size >= 256 << 20
    assert quick["size"] < full["size"]
    assert settings(tmp_path, True, "cupy", size=1 << 30)["copy_size"] == 1 << 30
    assert quick["stripes"] == full["stripes"] == 4  # the cached writes: their fixed costs spread thin


def test_the_orbit_measurement_runs_the_t_shaped_reduction(monkeypatch):
    """The orbit-kernel measurement runs its (T)-shaped fused reduction through a backend's
    ``fused`` (here NumPy's, at a small edge) and reports the points of its calls, the bytes per point the
    model counts for it (more than a generic orbit's 112: at this small edge diagonal orbits and
    the once-per-thread loads weigh more) and one positive time per repetition."""
    from chainexec.runtime.device import select

    class Comm:
        def Barrier(self):
            pass

    monkeypatch.setattr(calibrate_worker, "ORBIT_EDGE", 12)
    got = calibrate_worker._orbit(select("numpy"), np.random.default_rng(1), Comm(), 3, calibrate_worker._wall)
    assert got["points"] == calibrate_worker.ORBIT_CALLS * calibrate_worker.ORBIT_TILE ** 3 * 12 ** 3
    assert got["bytes_per_point"] > 112
    assert len(got["s"]) == 3 and min(got["s"]) > 0
