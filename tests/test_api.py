"""chainexec.api.run with NumPy: what a failure leaves (its output, folders, open files and MPI
windows), and ranks started differently."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from chainexec import api
from chainexec.errors import ChainexecError
from chainexec.runtime import uselog
from tests.conftest import fourindex_config, run_cli, write_config


def test_a_failure_after_the_output_is_complete_keeps_its_values(tmp_path, monkeypatch):
    """An error raised once the executor has written the output complete (here by the run's
    last step, the warm-up log's flush) leaves that output whole: its values lie in its parts
    folder, which stays."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0

    def fail():
        raise ChainexecError("the warm-up log cannot be written")

    monkeypatch.setattr(uselog, "flush", fail)
    with pytest.raises(ChainexecError, match="warm-up log"):
        api.run(config, backend="numpy")
    with h5py.File(tmp_path / "out" / "result.h5", "r") as f:
        assert f.attrs["chainexec_complete"]
        values = f["B"][...]
    assert values.size and np.isfinite(values).all()


FULL_AT_THIRD_WRITE = """
import errno, json, os, sys
from pathlib import Path
from chainexec import cli, safepaths
from chainexec.runtime import store
write, done = store.Store.write, []
def full(self, *args):
    done.append(1)
    if len(done) == 3:
        raise OSError(errno.ENOSPC, "No space left on device", "block-3.h5")
    return write(self, *args)
store.Store.write = full
status = cli.main(["run", sys.argv[1], "--backend", "numpy", "--quiet"])
out = Path(sys.argv[1]).parent / "out"
safepaths.wait_removals()  # the parts folder moved aside is removed on a thread
held = []
for fd in os.listdir("/proc/self/fd"):
    try:
        held.append(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:  # the listing's own descriptor, closed by now
        pass
print(json.dumps({"status": status, "writes": len(done), "left": sorted(p.name for p in out.iterdir()),
                  "open": [h for h in held if h.startswith(str(out))]}))
"""


def test_a_failure_in_the_executor_leaves_no_shards_no_open_file_and_no_window(tmp_path):
    """A write that fails part way through the run (the disk full at its third block), in a
    process of its own that then ends through MPI's finalize: the run ends with that error, one
    line naming the file and status 2 (the machine's refusal, not a defect); its shards go with their folders, every file it wrote or read closed first (none left open
    under the output folder); and its windows are freed as it fails, so that MPI's transport
    (UCX under MPICH) has none left to warn of, where it printed a line for each (on stdout)
    beside the run's own error."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    script = tmp_path / "full.py"
    script.write_text(FULL_AT_THIRD_WRITE)
    proc = subprocess.run([sys.executable, str(script), str(config)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "UCX" not in proc.stdout + proc.stderr, (proc.stdout, proc.stderr)
    assert proc.stderr.splitlines() == [f"chainexec: block-3.h5: the disk is full (errno {errno.ENOSPC})"]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["status"] == 2 and found["writes"] == 3
    assert found["left"] == [] and found["open"] == [], found


@pytest.mark.parametrize("ranks", [0, -2, 1.5, True, "2"])
def test_plan_refuses_a_rank_count_that_is_not_a_whole_number_at_least_one(tmp_path, ranks):
    """A Python caller's rank count is checked where the CLI's is: before the config is read."""
    config = write_config(tmp_path, fourindex_config())
    with pytest.raises(ChainexecError, match="ranks must be a whole number, at least 1"):
        api.plan(config, ranks=ranks)


def _mpmd(tmp_path, *ranks: tuple[dict, list]) -> subprocess.CompletedProcess:
    """One job of several ranks, each started with its own environment additions and ``run``
    arguments (``mpiexec -n 1 … : -n 1 …``), as a batch script's per-node mistake starts them."""
    import os

    from tests.conftest import launch

    base, command = launch(1), []
    for k, (env, args) in enumerate(ranks):
        command += (base if k == 0 else [":", *base[1:]]) + ["env", *(f"{n}={v}" for n, v in env.items()),
                                                             sys.executable, "-m", "chainexec.cli", "run", *map(str, args)]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["--balance", "$CHAINEXEC_SIMULATE_HOSTS", "chainexec"])
def test_ranks_started_differently_are_refused_at_once(tmp_path, case):
    """A rank given other options, another simulated host count or another chainexec than rank 0
    (the job waited in mismatched collectives until its time limit, saying nothing): every rank
    refuses it in one line naming the rank and what differs, status 2, within the call's time,
    before any output or folder is made; started alike, the same job runs."""
    import shutil

    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    first, second = ({}, [config, "--quiet"]), ({}, [config, "--quiet"])
    if case == "--balance":
        second = ({}, [config, "--quiet", "--balance", "static"])
    elif case == "$CHAINEXEC_SIMULATE_HOSTS":
        second = ({"CHAINEXEC_SIMULATE_HOSTS": "2"}, [config, "--quiet"])
    else:  # a copy of the package with one file changed, first on rank 1's path
        copy = tmp_path / "other"
        shutil.copytree(Path(api.__file__).parent, copy / "chainexec")
        with open(copy / "chainexec" / "errors.py", "a") as f:
            f.write("\n# another version\n")
        second = ({"PYTHONPATH": copy}, [config, "--quiet"])
    proc = _mpmd(tmp_path, first, second)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("chainexec: ")]
    assert lines and f"rank 1 was started with {case}" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
    assert _mpmd(tmp_path, first, first).returncode == 0


NO_MPI = """
import sys
from chainexec import cli
try:
    cli.main(sys.argv[1:])
except SystemExit as end:
    assert not end.code, end.code
print("mpi4py.MPI" in sys.modules)
"""


@pytest.mark.parametrize("command", ["generate", "plan", "verify"])
def test_commands_that_run_nothing_do_not_start_mpi(tmp_path, command):
    """``generate``, ``plan`` and ``verify`` never import mpi4py's MPI (which starts MPI as it is
    imported: a singleton start on every such command, the global arrays' import in ``plan``'s
    path); ``run`` does."""
    config = write_config(tmp_path, fourindex_config())
    for step in {"verify": (("generate",), ("run", "--quiet"))}.get(command, ()):
        assert run_cli(step[0], config, *step[1:], cwd=tmp_path).returncode == 0
    done = subprocess.run([sys.executable, "-c", NO_MPI, command, str(config)], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False", done.stdout
