"""GlobalArray and TaskCounter under real MPI: mpi_globalarray_check.py launched on 1-4 ranks.

Each launch is a subprocess, so no MPI state leaks into the pytest process. Four ranks on a
two-core machine oversubscribe it; MPICH's busy-polling then only slows the run (seconds).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")

CHECK = Path(__file__).with_name("mpi_globalarray_check.py")
REPO = Path(__file__).resolve().parents[2]
MPIEXEC = next((str(p) for p in (Path(sys.executable).parent / "mpiexec", shutil.which("mpiexec"))
                if p and Path(p).exists()), None)
TIMEOUT_S = 60


def launch(launcher: list[str], seed: int, *flags: str, env: dict[str, str] | None = None) -> None:
    """Run the check script under ``launcher`` (mpiexec and its options, or nothing) with ``seed``,
    ``flags`` and extra ``env``; fail with its output unless it exits 0 and prints OK."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    proc = subprocess.run([*launcher, sys.executable, str(CHECK), str(seed), *flags], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_singleton_without_mpiexec():
    """COMM_WORLD of size 1 when started as a plain Python process."""
    launch([], 11)


needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec found")


@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("nranks, memory", [(1, "shared"), (2, "shared"), (3, "shared"), (4, "shared"),
                                            (2, "rma"), (3, "rma")])
def test_ranks(nranks, memory):
    """Patches over uneven blocks, rows fewer than ranks, patches spanning several owners; other
    ranks' rows read from shared memory (ranks of one host) or by RMA gets (``--rma``)."""
    launch([MPIEXEC, "-n", str(nranks)], 100 + nranks, *(["--rma"] if memory == "rma" else []))


@pytest.mark.mpi
@needs_mpiexec
def test_comm_self():
    """Every rank of a 2-rank job uses its own GlobalArray on MPI.COMM_SELF."""
    launch([MPIEXEC, "-n", "2"], 7, "--self")


@pytest.mark.mpi
@needs_mpiexec
def test_ranks_without_shared_memory():
    """MPICH's network path, as between nodes: RMA goes through the netmod (active messages), where a
    missing flush shows; on shared memory, operations complete at once and would hide it."""
    launch([MPIEXEC, "-n", "3"], 23, env={"MPIR_CVAR_NOLOCAL": "1"})
