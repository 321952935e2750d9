"""SIGINT and SIGTERM end a process whose main thread waits inside MPI (chainexec.stopsignals):
a rank in a barrier its peer never reaches, signalled alone, writes its one line and ends with
128 + the signal's number, where Python's own handler would wait for the barrier forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from chainexec import api, stopsignals
from tests.conftest import fourindex_config, kill_job, launch, run_cli, write_config

@pytest.fixture(autouse=True)
def no_landed_outputs():
    """Each test begins with no output noted as landed (:func:`stopsignals.landed`): runs of other
    tests in this process may have noted theirs."""
    stopsignals.forget_landed()


RANK = """
import os, sys, time
from chainexec import stopsignals
from chainexec.runtime.comm import world
rank = world().rank
stopsignals.watch(speaks=rank == 0)
if rank == 0:
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    world().Barrier()
else:
    time.sleep(600)
"""


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_ends_a_rank_waiting_in_mpi(tmp_path, number):
    pid_file = tmp_path / "pid"
    cmd = [*launch(2), sys.executable, "-c", RANK, str(pid_file)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pid_file.exists(), proc.communicate(timeout=10)
        time.sleep(0.5)  # rank 0 is inside the barrier by now
        rank0 = int(pid_file.read_text())
        os.kill(rank0, number)
        deadline = time.monotonic() + 60
        while _alive(rank0) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(rank0), "rank 0 did not end"
        try:  # the launcher ends the other rank, or the test does
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            kill_job(proc.pid)
            _, err = proc.communicate()
    finally:
        if proc.poll() is None:
            kill_job(proc.pid)
            proc.wait()
    assert err.count(stopsignals.line(number).strip()) == 1, err
    assert "Traceback" not in err


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("number, word", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "stopped by SIGTERM")])
def test_line_names_the_signal(number, word):
    """A run's line says what it leaves; another command's (generate, verify) names the signal
    alone (it spoke of a run's checkpoint)."""
    line = stopsignals.line(number)
    assert line.startswith(f"chainexec: {word}; ") and line.endswith("\n") and line.count("\n") == 1
    assert stopsignals.line(number, run=False) == f"chainexec: {word}\n"
    assert stopsignals.STATUS[number] == 128 + number


LANDED = """
import os, signal, sys, time
from chainexec import api, stopsignals
stopsignals.watch()
api.run(sys.argv[1], backend="numpy")
os.kill(os.getpid(), signal.SIGINT)
time.sleep(60)
"""


def test_a_signal_after_a_run_landed_its_output_names_it(tmp_path):
    """A process whose run has renamed its output into place, then interrupted: status 130 and
    one line naming that output as completed (it said no output was completed)."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    proc = subprocess.run([sys.executable, "-c", LANDED, str(config)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == (f"chainexec: interrupted after it completed {tmp_path / 'out' / 'result.h5'} (any other "
                           "output of the run was not completed; a run with --checkpoint resumes from its last "
                           "checkpoint)\n")


def test_a_run_forgets_the_outputs_an_earlier_run_of_its_process_landed(tmp_path):
    """A process that runs several runs (a server's, a test's) names only the current run's."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    api.run(config, backend="numpy")
    assert str(tmp_path / "out" / "result.h5") in stopsignals.line(signal.SIGINT)
    stopsignals.forget_landed()
    assert stopsignals.line(signal.SIGINT) == f"chainexec: interrupted; {stopsignals.NOTE}\n"


REPLACING = """
import os, signal, sys, time
from chainexec import atomicfile, stopsignals
stopsignals.watch(run=False)
with atomicfile.replacing(sys.argv[1]) as tmp:
    with open(tmp, "wb") as f:
        f.write(os.urandom(1 << 20))
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(60)
"""


def test_a_signal_removes_the_temporary_file_of_a_file_being_replaced(tmp_path):
    """A signal while a file is written whole (``chainexec generate``'s inputs, the caches'
    files): status 130, one line, and neither the file nor its temporary one (named at random,
    which nothing later removes) is left; an older file of that name stays as it was."""
    target = tmp_path / "in.h5"
    for older in (None, b"older"):
        if older is not None:
            target.write_bytes(older)
        proc = subprocess.run([sys.executable, "-c", REPLACING, str(target)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 130 and proc.stderr == "chainexec: interrupted\n", proc.stderr
        assert [p.name for p in tmp_path.iterdir()] == ([] if older is None else ["in.h5"])
        assert older is None or target.read_bytes() == older


AT_IMPORT = """
import importlib.abc, os, runpy, signal, sys


class Signalled(importlib.abc.MetaPathFinder):
    '''Sends this process the signal as the module named goes to be imported, once.'''

    def find_spec(self, name, path=None, target=None):
        if name == module:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), number)


number, module, rank, entry = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
sys.argv = ["chainexec", *sys.argv[5:]]
if rank in ("any", os.environ.get("PMI_RANK"), os.environ.get("OMPI_COMM_WORLD_RANK")):
    sys.meta_path.insert(0, Signalled())
if entry == "client":
    from chainexec.client import command
    command()
else:
    runpy.run_module("chainexec.cli", run_name="__main__", alter_sys=True)
"""
"""The ``chainexec`` program through one of its entry points (``client``: the installed command's,
:func:`chainexec.client.command`; ``cli``: ``python -m chainexec.cli``), sent a signal as it goes to
import a module: argv is the signal's number, the module's name, the rank sent it (``any``: every
process), the entry point and the command line."""


def _program_env(tmp_path) -> dict[str, str]:
    """The environment of :data:`AT_IMPORT`: this checkout's package, no server to hand the
    command to, and none of a launcher's variables (a test run inside a SLURM allocation has
    some), which a launcher sets itself."""
    from chainexec.client import LAUNCHER

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    return dict(env, CHAINEXEC_SERVE_SOCKET=str(tmp_path / "none.sock"),
                PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))


@pytest.mark.parametrize("entry", ["cli", "client"])
@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command", ["run", "generate"])
def test_a_signal_during_the_imports_ends_the_program_with_its_line(tmp_path, entry, number, command):
    """A signal as the program imports the command line's modules (``chainexec.calibrate``, before
    the command line is parsed and :func:`stopsignals.watch` runs) ends it with the line and
    status a later one gives: no ``KeyboardInterrupt`` traceback (SIGINT), no silent end
    (SIGTERM)."""
    proc = subprocess.run([sys.executable, "-c", AT_IMPORT, str(int(number)), "chainexec.calibrate", "any", entry,
                           command, str(tmp_path / "chain.yaml")], capture_output=True, text=True, timeout=120,
                          env=_program_env(tmp_path), cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (stopsignals.STATUS[number], stopsignals.line(number, command == "run"))


@pytest.mark.mpi
@pytest.mark.parametrize("module", ["chainexec.calibrate", "mpi4py.MPI"], ids=["importing", "starting_MPI"])
@pytest.mark.parametrize("rank", ["0", "1", "any"], ids=["rank0", "rank1", "every_rank"])
def test_a_rank_signalled_as_a_run_starts_ends_the_job(tmp_path, rank, module):
    """SIGINT to one rank of a 2-rank run, or to each (Ctrl-C), as it imports the command line's
    modules (before :func:`stopsignals.watch`) or as it starts MPI (after it): the job ends, with
    a status not 0 and no traceback. Under MPICH, a rank that ends before its MPI has started
    leaves the other waiting inside MPI's start for ever: a signalled rank of a run ends once its
    MPI has started. What it says: rank 0's line where rank 0 alone was signalled; where rank 1
    was, nothing, or the line of the SIGTERM with which a launcher (Open MPI's) ends rank 0; where
    each was, rank 0's line, unless the launcher ended rank 0 for rank 1's end before it spoke."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    cmd = [*launch(2), sys.executable, "-c", AT_IMPORT, str(int(signal.SIGINT)), module, rank, "cli", "run",
           str(config), "--quiet"]
    # Three tries: MPICH's launcher now and then leaves the other ranks of a job running where one
    # ended with a status after its MPI's start, at any point of a run (not what this test is about).
    for _ in range(3):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=_program_env(tmp_path), cwd=tmp_path)
        try:
            _, err = proc.communicate(timeout=30)
            break
        except subprocess.TimeoutExpired:
            kill_job(proc.pid)
            _, err = proc.communicate()
    else:
        pytest.fail(f"the job did not end, three times: {err}")
    ours = [line for line in err.splitlines() if line.startswith("chainexec:")]
    assert proc.returncode != 0 and "Traceback" not in err, (proc.returncode, err)
    interrupted, terminated = (stopsignals.line(number).strip() for number in (signal.SIGINT, signal.SIGTERM))
    assert ours in {"0": [[interrupted]], "1": [[], [terminated]], "any": [[], [interrupted]]}[rank], err
    assert not (tmp_path / "out" / "result.h5").exists()


NO_MPI = """
import os, signal, sys, time
from chainexec import stopsignals
stopsignals.HOLD = 0.5
stopsignals.watch(run=sys.argv[1] == "run")
os.kill(os.getpid(), signal.SIGINT)
time.sleep(60)
"""


@pytest.mark.parametrize("command", ["run", "generate"])
def test_a_launched_rank_whose_mpi_does_not_start(tmp_path, command):
    """A rank a launcher started (here, its variables alone) whose MPI does not start, signalled:
    a run's writes its line and waits :data:`stopsignals.HOLD` seconds for that start, then ends
    by SIGALRM, which every launcher counts as a failed rank (to MPICH's, one that ends with a
    status before its MPI's start never took part); another command's, whose ranks never start
    MPI, ends at once with its status."""
    env = dict(_program_env(tmp_path), PMI_RANK="0", PMI_SIZE="1")
    proc = subprocess.run([sys.executable, "-c", NO_MPI, command], capture_output=True, text=True, timeout=120,
                          env=env)
    if command == "run":
        assert (proc.returncode, proc.stderr) == (-signal.SIGALRM, stopsignals.line(signal.SIGINT))
    else:
        assert (proc.returncode, proc.stderr) == (130, stopsignals.line(signal.SIGINT, run=False))


@pytest.mark.mpi
def test_a_signalled_rank_whose_mpi_start_waits_for_ever_ends(tmp_path):
    """Rank 0 of a run signalled as it imports the runtime, whose other rank ends before its MPI
    starts (a node that failed): rank 0's MPI start waits for ever, holding the interpreter's
    lock (mpi4py starts MPI holding it), so that no Python code of the rank runs again; it says
    its line and the kernel's timer ends it :data:`stopsignals.HOLD` seconds on, and the job with
    it (it waited for ever before the timer)."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    cmd = [*launch(1), sys.executable, "-c", AT_IMPORT, str(int(signal.SIGINT)), "chainexec.api", "0", "cli", "run",
           str(config), "--quiet", ":", "-n", "1", sys.executable, "-c", "import sys; sys.exit(1)"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=_program_env(tmp_path), cwd=tmp_path)
    try:
        _, err = proc.communicate(timeout=stopsignals.HOLD + 50)
    except subprocess.TimeoutExpired:
        kill_job(proc.pid)
        pytest.fail(f"the job did not end: {proc.communicate()[1]}")
    assert proc.returncode != 0 and "Traceback" not in err, (proc.returncode, err)
    assert stopsignals.line(signal.SIGINT).strip() in err.splitlines(), err
