"""Memory limits detected on the machine for a config without ``machine:``: derived from the host
(mocked through ``CHAINEXEC_HOST_MEMORY``, and the real one) on 1 and 3 ranks, overridden by the
config's own limits, printed and recorded with where each came from, and part of the plan
cache's key; the pure derivation over ranks, hosts and GPUs; the cgroup and meminfo readings."""

from __future__ import annotations

import json
import sys
import types

import pytest

from chainexec import detect
from chainexec.detect import Figures
from chainexec.errors import ChainexecError
from chainexec.runtime import uselog, warmup
from tests.conftest import assert_refused, fourindex_config, read_report, run_cli, write_config

GiB = 1 << 30


def _config(tmp_path, **machine):
    """The small four-index transform with the ``machine:`` keys given (none: no section)."""
    cfg = fourindex_config()
    del cfg["machine"]
    if machine:
        cfg["machine"] = machine
    config = write_config(tmp_path, cfg)
    assert run_cli("generate", config).returncode == 0
    return config


def _host(memory: int, ranks: int, host: str = "node1") -> Figures:
    return Figures(host, ranks, memory, "test")


def _numpy_limits(memory: int, ranks: int) -> tuple[int, int]:
    """(global, device) bytes for ``ranks`` NumPy ranks on one host with ``memory`` available,
    by the rule detect documents: a reserve of 1 GiB or 1/8, then half each."""
    usable = memory - max(GiB, memory // 8)
    return detect.rounded(usable // 2), detect.rounded(usable // 2 // ranks)


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_config_without_machine_runs_within_the_mocked_host(tmp_path, monkeypatch, ranks):
    monkeypatch.setenv("CHAINEXEC_HOST_MEMORY", "8GiB")
    config = _config(tmp_path)
    proc = run_cli("run", config, "--backend", "numpy", "--report-json", tmp_path / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    report = read_report(tmp_path / "r.json")
    expected = dict(zip(("global", "device"), _numpy_limits(8 * GiB, ranks)))
    assert report["run"]["memory_limit"] == expected
    assert report["measured"]["bytes"] == report["predicted"]["bytes"]
    machine = report["run"]["machine"]
    for level in ("global", "device"):
        assert machine[f"{level}_memory"]["value"] == expected[level]
        assert machine[f"{level}_memory"]["from"] == "detected"
        assert "8.00 GiB host memory available ($CHAINEXEC_HOST_MEMORY)" in machine[f"{level}_memory"]["detail"]
    assert f"shared by {ranks} rank" in machine["device_memory"]["detail"]
    # Printed: where each limit and rate came from.
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert "detected: 8.00 GiB host memory available" in lines["global_memory"]
    assert "detected:" in lines["device_memory"]
    for rate in ("disk_read", "flop_rate", "statement_seconds"):
        assert "defaults: $CHAINEXEC_MACHINE=defaults" in lines[rate], lines[rate]


def test_a_config_without_machine_plans_and_runs_on_the_real_host(tmp_path, monkeypatch):
    monkeypatch.delenv("CHAINEXEC_HOST_MEMORY", raising=False)
    config = _config(tmp_path)
    proc = run_cli("plan", config, "--backend", "numpy", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    record = data["machine"]["global_memory"]
    assert record["from"] == "detected"
    assert "MemAvailable" in record["detail"] or "cgroup" in record["detail"]
    assert 0 < data["machine"]["device_memory"]["value"] <= record["value"] < total
    assert data["plan"]["memory_limit"] == {level: data["machine"][f"{level}_memory"]["value"]
                                            for level in ("global", "device")}
    assert data["plan"]["machine"] == data["machine"]
    proc = run_cli("run", config, "--backend", "numpy", "--report-json", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stderr
    report = read_report(tmp_path / "r.json")
    assert {r["from"] for k, r in report["run"]["machine"].items() if k.endswith("_memory")} == {"detected"}
    assert report["measured"]["bytes"] == report["predicted"]["bytes"]


def test_the_config_s_limits_win_one_by_one(tmp_path, monkeypatch):
    monkeypatch.setenv("CHAINEXEC_HOST_MEMORY", "8GiB")
    config = _config(tmp_path, device_memory="3KiB")
    proc = run_cli("plan", config, "--backend", "numpy")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    line = config.read_text().splitlines().index("  device_memory: 3KiB") + 1
    assert "3.00 KiB" in lines["device_memory"] and f"config: {config}:{line}" in lines["device_memory"]
    assert "detected: 8.00 GiB host memory available" in lines["global_memory"]
    both = _config(tmp_path, global_memory="24KiB", device_memory="3KiB")
    data = json.loads(run_cli("plan", both, "--json").stdout)
    assert {r["from"] for k, r in data["machine"].items() if k.endswith("_memory")} == {"config"}
    assert data["plan"]["memory_limit"] == {"global": 24 << 10, "device": 3 << 10}


def test_a_host_without_room_for_the_reserve_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CHAINEXEC_HOST_MEMORY", "1GiB")
    assert_refused(run_cli("plan", _config(tmp_path)), "1.00 GiB of memory available ($CHAINEXEC_HOST_MEMORY)",
                   "machine.global_memory")
    monkeypatch.setenv("CHAINEXEC_HOST_MEMORY", "lots")
    assert_refused(run_cli("plan", _config(tmp_path)), "$CHAINEXEC_HOST_MEMORY", "'lots'")


def test_detected_limits_are_part_of_the_plan_cache_key(tmp_path, monkeypatch):
    config = _config(tmp_path)
    runs = []
    for memory in ("8GiB", "8GiB", "16GiB"):
        monkeypatch.setenv("CHAINEXEC_HOST_MEMORY", memory)
        proc = run_cli("run", config, "--backend", "numpy", "--report-json", tmp_path / "r.json")
        assert proc.returncode == 0, proc.stderr
        runs.append(read_report(tmp_path / "r.json")["run"]["plan_cached"])
    assert runs == [False, True, False]


def test_limits_over_ranks_hosts_and_gpus():
    # NumPy, 3 ranks on one host: half of the usable memory each for the two levels.
    f = _host(16 * GiB, 3)
    found = detect.limits([f] * 3)
    assert (found["global"].bytes, found["device"].bytes) == _numpy_limits(16 * GiB, 3)
    # Two hosts, one with twice the ranks: the global array lies evenly over the 6 ranks, so the
    # host of 4 holds 4/6 of it.
    figures = [_host(16 * GiB, 4, "a")] * 4 + [_host(16 * GiB, 2, "b")] * 2
    usable = 14 * GiB
    assert detect.limits(figures, ("global",))["global"].bytes == detect.rounded(usable // 2 * 6 // 4)
    assert "device" not in detect.limits(figures, ("global",))
    assert detect.limits(figures)["device"].bytes == detect.rounded(usable // 2 // 4)
    # GPUs: free memory less the reserve, shared by the ranks on one GPU; the host's memory all global.
    gpu = [Figures("g", 3, 64 * GiB, "test", "NVIDIA H200", 2, r % 2, 128 * GiB) for r in range(3)]
    found = detect.limits(gpu)
    assert found["device"].bytes == detect.rounded((128 * GiB - 8 * GiB) // 2)
    assert "shared by 2 ranks" in found["device"].detail and "NVIDIA H200" in found["device"].detail
    assert found["global"].bytes == detect.rounded(56 * GiB)
    with pytest.raises(ChainexecError, match="GPU 0 .* has 512.00 MiB free"):
        detect.limits([Figures("g", 1, 64 * GiB, "test", "small", 1, 0, 512 << 20)])


@pytest.mark.parametrize("early", [None, 5 << 30])
def test_a_gpus_free_memory_is_the_warm_ups_reading_where_it_made_one(monkeypatch, early):
    """:func:`detect.here` takes the free memory the run's warm-up read as it made the rank's
    context (:func:`warmup.free_memory`) without asking the device, else asks the device."""
    asked = []

    class Device:
        def __init__(self, index):
            asked.append(index)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    runtime = types.SimpleNamespace(getDeviceCount=lambda: 4, memGetInfo=lambda: (9 << 30, 10 << 30),
                                    getDeviceProperties=lambda index: {"name": b"GPU"})
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Device=Device)))
    monkeypatch.setattr(warmup, "_FREE", {} if early is None else {2: early})
    monkeypatch.setattr(uselog, "_NAMES", {})
    figures = detect.here("cupy", 6, 4, "host")
    assert (figures.gpu_index, figures.gpu_free) == (2, 9 << 30 if early is None else early)
    assert asked == ([2] if early is None else [])


def test_rounded_keeps_sixteen_steps_per_power_of_two():
    assert detect.rounded(15) == 15
    assert detect.rounded((1 << 34) + (1 << 30) + 12345) == (1 << 34) + (1 << 30)
    for n in (10**6, 7 * 10**9, 139 * GiB):
        assert 0.9375 * n < detect.rounded(n) <= n


def test_host_memory_from_meminfo_and_cgroups(tmp_path, monkeypatch):
    monkeypatch.delenv("CHAINEXEC_HOST_MEMORY", raising=False)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    own = tmp_path / "cgroup"
    own.write_text("0::/job/step\n")
    root = tmp_path / "fs"
    (root / "job" / "step").mkdir(parents=True)
    assert detect.host_memory(meminfo, root, own) == (20000000 * 1024, f"{meminfo} MemAvailable")
    # cgroup v2: the job's limit, less its use, plus the page cache's file pages, active ones
    # (inputs read twice) as well as inactive ones.
    (root / "job" / "memory.max").write_text(f"{8 * GiB}\n")
    (root / "job" / "memory.current").write_text(f"{5 * GiB}\n")
    (root / "job" / "memory.stat").write_text(f"anon {3 * GiB}\nactive_file {GiB}\ninactive_file {GiB}\nshmem 0\n")
    (root / "job" / "step" / "memory.max").write_text("max\n")
    assert detect.host_memory(meminfo, root, own) == (5 * GiB, "the memory cgroup's limit less its use")
    # cgroup v1, in a container that mounts its own cgroup as the root of the hierarchy.
    own.write_text("4:memory:/host/side/path\n1:cpu:/\n")
    (root / "memory").mkdir()
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{4 * GiB}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{2 * GiB}\n")
    (root / "memory" / "memory.stat").write_text(f"total_active_file {GiB}\ntotal_inactive_file 0\n")
    assert detect.cgroup_room(root, own) == 3 * GiB
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert detect.cgroup_room(root, own) is None


def test_write_cache_from_the_dirty_limits(tmp_path, monkeypatch):
    """vm.dirty_bytes where set, else vm.dirty_ratio percent of the host memory available; 0
    where the limits cannot be read."""
    monkeypatch.setenv("CHAINEXEC_HOST_MEMORY", "10GiB")
    vm = tmp_path / "vm"
    vm.mkdir()
    (vm / "dirty_bytes").write_text("0\n")
    (vm / "dirty_ratio").write_text("20\n")
    assert detect.write_cache(tmp_path / "meminfo", vm) == (2 * GiB, f"{vm}/dirty_ratio 20 % of $CHAINEXEC_HOST_MEMORY")
    (vm / "dirty_bytes").write_text("123456789\n")
    assert detect.write_cache(tmp_path / "meminfo", vm) == (123456789, f"{vm}/dirty_bytes")
    (vm / "dirty_bytes").unlink()
    assert detect.write_cache(tmp_path / "meminfo", vm) == (0, "no dirty-page limit readable")
