"""``benchmarks/scaling.sh`` on the NumPy backend under the PyPI MPI's ``mpiexec``: a small (T)
job on 1 and 2 ranks; the summary holds both rank counts with efficiencies computed from the
reports and the launcher's own seconds per count, no timed run planned (each count's plan was
made beforehand), every count as predicted, and the energy each run wrote equal to the
independent reference (and so across rank counts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chainexec.chem.triples import ccsd_t_energy
from tests.conftest import mpiexec, triples_config

ROOT = Path(__file__).resolve().parents[1]


def test_one_and_two_ranks_agree(tmp_path):
    launcher = mpiexec()
    if launcher is None:
        pytest.skip("no mpiexec")
    config = triples_config(tmp_path / "job", "1GiB", 4, 9)
    env = dict(os.environ, BACKEND="numpy", MPIRUN=launcher, MPIFLAGS="",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "scaling.sh"), str(config), str(tmp_path / "out"), "1 2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "scaling.json").read_text())
    rows = summary["rows"]
    assert [row["ranks"] for row in rows] == [1, 2]
    expected = ccsd_t_energy(tmp_path / "job" / "inputs.h5")
    for row in rows:
        report = json.loads((tmp_path / "out" / f"run_n{row['ranks']}.json").read_text())
        assert row["executor_seconds"] == report["measured"]["total_seconds"] and report["run"]["ranks"] == row["ranks"]
        assert report["run"]["plan_cached"]  # planned before the timed runs, for every rank count
        assert row["measured_equals_predicted"]
        assert abs(row["outputs"]["E"] - expected) <= 1e-12 * abs(expected)
        assert row["start_seconds_max"] == max(rank["start_seconds"] for rank in report["run"]["per_rank"])
        assert 0 < row["start_seconds_max"] < row["wall_seconds"]
        assert 0 < row["launcher_seconds"] < row["wall_seconds"]
    assert rows[0]["executor_efficiency"] == rows[0]["wall_efficiency"] == 1.0
    assert rows[1]["executor_efficiency"] == pytest.approx(rows[0]["executor_seconds"] / (2 * rows[1]["executor_seconds"]))
    assert rows[1]["wall_efficiency"] == pytest.approx(rows[0]["wall_seconds"] / (2 * rows[1]["wall_seconds"]))
    assert "2 ranks: wall" in done.stdout and "launcher alone" in done.stdout


def test_the_machine_file_reaches_the_runs(tmp_path):
    """``MACHINE`` is passed to every run as ``--machine``: a missing file stops the script at its
    first run with chainexec's message and no summary."""
    launcher = mpiexec()
    if launcher is None:
        pytest.skip("no mpiexec")
    config = triples_config(tmp_path / "job", "1GiB", 3, 7)
    env = dict(os.environ, BACKEND="numpy", MPIRUN=launcher, MPIFLAGS="", MACHINE=str(tmp_path / "absent.json"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "scaling.sh"), str(config), str(tmp_path / "out"), "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "absent.json" in done.stdout + done.stderr
    assert not (tmp_path / "out" / "scaling.json").exists()


def test_without_the_warm_up_run(tmp_path):
    """``WARMUP=0``: no warm-up run (a job too large for one rank, run on several only); the
    summary holds the one count asked for, its flop rate per rank the report's flops over its
    executor seconds and ranks, and its energy the reference."""
    launcher = mpiexec()
    if launcher is None:
        pytest.skip("no mpiexec")
    config = triples_config(tmp_path / "job", "1GiB", 4, 9)
    env = dict(os.environ, BACKEND="numpy", MPIRUN=launcher, MPIFLAGS="", WARMUP="0",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "scaling.sh"), str(config), str(tmp_path / "out"), "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / "out" / "warmup.json").exists()
    (row,) = json.loads((tmp_path / "out" / "scaling.json").read_text())["rows"]
    report = json.loads((tmp_path / "out" / "run_n2.json").read_text())
    m = report["measured"]
    assert row["ranks"] == 2 and row["flops_per_second_per_rank"] == m["flops"] / m["total_seconds"] / 2
    expected = ccsd_t_energy(tmp_path / "job" / "inputs.h5")
    assert abs(row["outputs"]["E"] - expected) <= 1e-12 * abs(expected)
