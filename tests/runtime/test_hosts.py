"""Ranks on several hosts, simulated on one machine (``CHAINEXEC_SIMULATE_HOSTS``,
:mod:`chainexec.runtime.comm`): the hosts :func:`host_comm` finds and the windows in shared memory
it allows (``mpi_hosts_check.py``), and the four-index transform and (T) on 4 ranks as 2 hosts of
2 ranks against 4 ranks of one host and 1 rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from chainexec.errors import ChainexecError
from chainexec.runtime import comm
from tests.conftest import assert_refused, fourindex_config, mpiexec, read_report, run_cli, triples_config, write_config

REPO = Path(__file__).resolve().parents[2]
SIMULATE = comm.SIMULATE_HOSTS
NOLOCAL = "MPIR_CVAR_NOLOCAL"  # MPICH: every rank a node of its own, its transport the network's


def launch(script: str, *args, env: dict[str, str]) -> None:
    """``mpiexec -n 4 python tests/runtime/SCRIPT ARGS`` with ``env`` added (and neither
    :data:`SIMULATE` nor :data:`NOLOCAL` unless given there); fails unless it prints OK."""
    launcher = mpiexec()
    if launcher is None:
        pytest.skip("no mpiexec")
    full = {k: v for k, v in os.environ.items() if k not in (SIMULATE, NOLOCAL)} | {"PYTHONPATH": str(REPO), **env}
    proc = subprocess.run([launcher, "-n", "4", sys.executable, str(REPO / "tests/runtime" / script), *map(str, args)],
                          capture_output=True, text=True, timeout=240, env=full)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_simulated_hosts_setting(monkeypatch):
    """``CHAINEXEC_SIMULATE_HOSTS``: unset is one host per machine, a positive whole number K is
    K hosts, anything else is refused naming the variable; set, the launcher's local rank (of the
    machine's ranks) is not taken for the position in a simulated host."""
    for var in comm.LOCAL_RANK:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv(SIMULATE, raising=False)
    monkeypatch.setenv("MPI_LOCALRANKID", "3")
    assert comm.simulated_hosts() == 1 and comm.env_local_rank() == 3
    monkeypatch.setenv(SIMULATE, "2")
    assert comm.simulated_hosts() == 2 and comm.env_local_rank() is None
    for bad in ("0", "-1", "two", "1.5", "\u00b2"):
        monkeypatch.setenv(SIMULATE, bad)
        with pytest.raises(ChainexecError, match=SIMULATE):
            comm.simulated_hosts()


@pytest.mark.mpi
@pytest.mark.parametrize("env, flags", [({}, []), ({SIMULATE: "2"}, []), ({SIMULATE: "3"}, []),
                                        ({NOLOCAL: "1"}, ["--own"])],
                         ids=["one host", "2 hosts", "3 hosts, uneven", "MPICH nolocal"])
def test_host_comm(env, flags):
    """On 4 ranks: each rank's host is the ranks expected (world rank r on host r·K // 4, or
    each its own host where MPICH keeps every rank apart), counted by ``hosts`` and giving the
    local rank; a global array over any 2-4 ranks is in shared memory exactly where they are on
    one host."""
    launch("mpi_hosts_check.py", *flags, env=env)


@pytest.mark.mpi
def test_bad_setting_refused(tmp_path, monkeypatch):
    """A run under a bad ``CHAINEXEC_SIMULATE_HOSTS`` ends on every rank with one error line."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    monkeypatch.setenv(SIMULATE, "0")
    assert_refused(run_cli("run", config, "--backend", "numpy", ranks=2), SIMULATE)
    assert not (tmp_path / "out" / "result.h5").exists()


@pytest.mark.mpi
def test_fourindex_on_simulated_hosts(tmp_path, monkeypatch):
    """The four-index transform (tiled at both levels) on 4 ranks as 2 hosts of 2 ranks, and as
    4 hosts of one rank under MPICH's network transport, writes B bit for bit as on 4 ranks of
    one host and on 1 rank (each element is one tile's contractions, added once to zeros, so
    no order of sums depends on the ranks); the report counts the hosts and every byte and peak
    equals the prediction."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    report = tmp_path / "report.json"

    def result(ranks: int | None, hosts: int, env: dict[str, str]) -> bytes:
        for var in (SIMULATE, NOLOCAL):
            monkeypatch.delenv(var, raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        proc = run_cli("run", config, "--backend", "numpy", "--quiet", "--report-json", report, ranks=ranks)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        run = read_report(report)
        assert run["run"]["hosts"] == hosts and run["run"]["ranks"] == (ranks or 1)
        for key in ("bytes", "memory_peak"):
            assert run["measured"][key] == run["predicted"][key], key
        with h5py.File(tmp_path / "out" / "result.h5") as f:
            return f["B"][()].tobytes()

    one_host = result(4, 1, {})
    assert result(4, 2, {SIMULATE: "2"}) == one_host
    assert result(4, 4, {NOLOCAL: "1"}) == one_host
    assert result(None, 1, {}) == one_host


@pytest.mark.mpi
def test_triples_on_simulated_hosts(tmp_path, monkeypatch):
    """(T) at o=6, v=10, its inputs streamed into the tile loop (``mpi_streamed_check.py``), on
    4 ranks as 2 hosts of 2 ranks, as 4 hosts of one rank under MPICH's network transport and as
    4 ranks of one host: every tile adds the same contribution to E, bit for bit (compared as the
    sorted contributions of all ranks: which rank runs a tile, and the order in which the ranks'
    contributions reach E, differ between any two runs of several ranks, on one host too, so E
    itself agrees with the other runs and with 1 rank to 1e-12 relative); bytes and peaks as
    predicted. On one host the inputs are mapped from their file and each rank makes its cut of
    every row resident; on several hosts nothing is mapped or given back, and each element of
    every streamed input is read from the file once in all, by the rank that owns its row, not
    once per host or rank."""
    from chainexec import api

    monkeypatch.delenv(SIMULATE, raising=False)
    o, v = 6, 10
    config = triples_config(tmp_path, "224KiB", o, v)

    def energy() -> float:
        with h5py.File(tmp_path / "energy.h5") as f:
            return float(f["E"][()])

    api.run(config, backend="numpy", plan_cache=False)
    single = energy()
    runs = {}
    for hosts, env in ((1, {}), (2, {SIMULATE: "2"}), (4, {NOLOCAL: "1"})):
        out = tmp_path / f"hosts{hosts}"
        out.mkdir()
        launch("mpi_streamed_check.py", config, out, env=env)
        assert energy() == pytest.approx(single, rel=1e-12)
        runs[hosts] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
        first = runs[hosts][0]
        assert first["hosts"] == hosts and first["measured"] == first["predicted"]
        assert first["peaks"][0] == first["peaks"][1]
    added = {hosts: sorted(x for rec in records for x in rec["added"]) for hosts, records in runs.items()}
    assert added[1] and added[1] == added[2] == added[4]
    assert all(rec["populated"] for rec in runs[1]) and not any(rec["reads"] for rec in runs[1])
    shapes = {"ovvv": (o, v, v, v), "ovoo": (o, v, o, o), "t1": (o, v)}
    for hosts in (2, 4):
        assert not any(rec["populated"] or rec["discarded"] for rec in runs[hosts])
        for tensor, shape in shapes.items():
            times = np.zeros(shape, np.int64)
            for r, rec in enumerate(runs[hosts]):
                for name, region in rec["reads"]:
                    if name == tensor:
                        assert r * o // 4 <= region[0][0] and region[0][1] <= (r + 1) * o // 4, (tensor, r, region)
                        times[tuple(slice(a, b) for a, b in region)] += 1
            assert np.all(times == 1), (hosts, tensor)
