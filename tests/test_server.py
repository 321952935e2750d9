"""``chainexec serve`` (:mod:`chainexec.server`) with real processes: a served run writes what
the same command writes on its own, bad input still ends in one line and status 2, and what the
server must not run (busy, other code, another environment) runs in the client's own process.
NumPy backend: every path here is the same on a GPU host."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from chainexec import stopsignals
from chainexec.planner.machine import Machine
from tests.conftest import assert_refused

ROOT = Path(__file__).resolve().parents[1]


def fourindex(folder: Path, name: str = "fourindex", ao: int = 24, mo: int = 21) -> Path:
    """The demo's four-index config with its files in ``folder``, extents ``ao`` and ``mo``."""
    text = (ROOT / "configs" / "fourindex.yaml").read_text()
    text = text.replace("ao: 64", f"ao: {ao}").replace("mo: 60", f"mo: {mo}")
    text = text.replace("../runs/fourindex/", f"{name}-files/")
    config = folder / f"{name}.yaml"
    config.write_text(text)
    return config


class Server:
    """A ``chainexec serve`` process with a socket folder of its own (a short path: a Unix
    socket's is at most 107 bytes), and the environment its clients share."""

    def __init__(self, env: dict | None = None, idle: float = 120, python_path: str | None = None):
        self.folder = Path(tempfile.mkdtemp(prefix="cx"))
        self.env = dict(env or os.environ, XDG_RUNTIME_DIR=str(self.folder), PYTHONUNBUFFERED="1")
        self.env.pop("CHAINEXEC_SERVE_SOCKET", None)
        if python_path:
            self.env["PYTHONPATH"] = python_path
        self.log = self.folder / "server.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "chainexec.cli", "serve", "--idle", str(idle)],
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.folder)
        try:
            self.wait_for(lambda text: "serving runs at" in text, 120)
        except BaseException:
            self.proc.kill()
            raise

    def wait_for(self, seen, seconds: float = 30) -> str:
        """The log once ``seen(log text)`` holds (the server writes a request's line after it
        answers the client); fails after ``seconds``."""
        deadline = time.monotonic() + seconds
        while not seen(text := self.text()):
            assert time.monotonic() < deadline, text
            time.sleep(0.02)
        return text

    def text(self) -> str:
        return self.log.read_text()

    def command(self, *args, cwd: Path, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
        """``chainexec ARGS`` through the client, as the ``chainexec`` program runs it."""
        return subprocess.run([sys.executable, "-m", "chainexec.client", *map(str, args)], cwd=cwd,
                              env=env or self.env, capture_output=True, text=True, timeout=300, **kw)

    def close(self):
        try:
            if self.proc.poll() is None:
                subprocess.run([sys.executable, "-m", "chainexec.cli", "serve", "--stop"], env=self.env, timeout=60)
                self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def server():
    srv = Server()
    yield srv
    srv.close()


def served(srv: Server, count: int | None = None) -> int:
    """Runs the server has served, once ``count`` of them are logged where given."""
    if count is not None:
        srv.wait_for(lambda text: text.count("chainexec serve: served run") >= count)
    return srv.text().count("chainexec serve: served run")


@pytest.mark.parametrize("ao, mo", [(24, 21), (17, 13)])
def test_a_served_run_writes_what_its_own_process_writes(server, tmp_path, ao, mo):
    config = fourindex(tmp_path, ao=ao, mo=mo)
    assert server.command("generate", config, cwd=tmp_path).returncode == 0
    here = subprocess.run([sys.executable, "-m", "chainexec.cli", "run", config, "--quiet"], cwd=tmp_path,
                          env=server.env, capture_output=True, text=True, timeout=300)
    assert here.returncode == 0, here.stderr
    alone = h5py.File(tmp_path / "fourindex-files" / "output.h5")["B"][...]
    for k in range(2):  # the second is served warm
        proc = server.command("run", config, "--quiet", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert served(server, k + 1) == k + 1, server.text()
        with h5py.File(tmp_path / "fourindex-files" / "output.h5") as f:
            assert np.array_equal(f["B"][...], alone)
        assert proc.stdout.splitlines()[:6] == here.stdout.splitlines()[:6]  # the byte counts
    A = h5py.File(tmp_path / "fourindex-files" / "input.h5")["A"][...]
    C = h5py.File(tmp_path / "fourindex-files" / "input.h5")["C"][...]
    ref = np.einsum("pa,qb,rc,sd,pqrs->abcd", C, C, C, C, A, optimize=True)
    assert np.linalg.norm(alone - ref) <= 1e-12 * np.linalg.norm(ref)


def test_bad_input_through_a_server_is_one_line_and_status_2(server, tmp_path):
    assert_refused(server.command("run", "missing.yaml", cwd=tmp_path), "missing.yaml")
    assert_refused(server.command("plan", "missing.yaml", "--ranks", "0", cwd=tmp_path), "--ranks")
    assert_refused(server.command("run", "x.yaml", "--bogus", cwd=tmp_path), "--bogus")
    help_text = server.command("run", "-h", cwd=tmp_path)
    assert help_text.returncode == 0 and "--checkpoint" in help_text.stdout
    server.wait_for(lambda text: text.count("chainexec serve: served") == 4)
    assert server.proc.poll() is None
    config = fourindex(tmp_path)
    assert server.command("generate", config, cwd=tmp_path).returncode == 0
    assert server.command("run", config, "--quiet", cwd=tmp_path).returncode == 0  # still serving


def test_the_run_takes_the_clients_folder_and_per_run_variables(server, tmp_path):
    """``CHAINEXEC_*`` variables apply to the served run alone (set, changed or removed); its
    relative paths are the client's folder's."""
    config = fourindex(tmp_path)
    machine = tmp_path / "rates.json"
    machine.write_text(json.dumps(dataclasses.asdict(Machine(flop_rate=3e10, source="the client's file"))))
    with_file = dict(server.env, CHAINEXEC_MACHINE=str(machine))
    plan = server.command("plan", config.name, cwd=tmp_path, env=with_file)
    assert plan.returncode == 0, plan.stderr
    assert str(machine) in plan.stdout
    again = server.command("plan", config.name, cwd=tmp_path)
    assert again.returncode == 0 and str(machine) not in again.stdout
    assert "$CHAINEXEC_MACHINE=defaults" in again.stdout  # the server's own value, restored
    without = {k: v for k, v in server.env.items() if k != "CHAINEXEC_MACHINE"}
    third = server.command("plan", config.name, cwd=tmp_path, env=without)
    assert third.returncode == 0, third.stderr
    assert "$CHAINEXEC_MACHINE" not in third.stdout and "calibration" in third.stdout
    server.wait_for(lambda text: text.count("chainexec serve: served plan") == 3)


def test_a_served_runs_checkpoint_folder_is_free_once_it_ends(server, tmp_path):
    """A checkpoint folder's lock lasts for a run's process: a server lets it go after the run, so
    that the run resumes in a process of its own."""
    config = fourindex(tmp_path, ao=30, mo=27)
    assert server.command("generate", config, cwd=tmp_path).returncode == 0
    stopped = server.command("run", config, "--quiet", "--checkpoint", "ck", "--stop-after", "0", cwd=tmp_path)
    assert stopped.returncode == 3, stopped.stderr
    served(server, 1)
    resumed = subprocess.run([sys.executable, "-m", "chainexec.cli", "run", config, "--quiet", "--checkpoint", "ck"],
                             cwd=tmp_path, env=server.env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr


def test_a_connection_that_sends_nothing_or_garbage_stops_no_one(server, tmp_path):
    path = server.folder / "chainexec" / "serve.sock"
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(str(path))
    garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    garbage.connect(str(path))
    garbage.sendall(struct.pack("!I", 9) + b'{"argv": ')
    garbage.close()
    r, w = os.pipe()
    odd = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    odd.connect(str(path))
    socket.send_fds(odd, [struct.pack("!I", 12) + b'{"argv": 5}'], [r, w, w])
    os.close(r)
    os.close(w)
    odd.close()
    config = fourindex(tmp_path)
    assert server.command("generate", config, cwd=tmp_path).returncode == 0
    proc = server.command("run", config, "--quiet", cwd=tmp_path)  # served once the silent one times out
    assert proc.returncode == 0, proc.stderr
    assert served(server, 1) == 1 and "dropped a connection" in server.text()
    silent.close()
    fds = len(os.listdir(f"/proc/{server.proc.pid}/fd"))
    for _ in range(3):
        assert server.command("run", "missing.yaml", cwd=tmp_path).returncode == 2
    server.wait_for(lambda text: text.count("chainexec serve: served run") == 4)
    assert len(os.listdir(f"/proc/{server.proc.pid}/fd")) == fds  # nothing kept per request


def test_a_client_in_another_environment_runs_itself(server, tmp_path):
    config = fourindex(tmp_path)
    assert server.command("generate", config, cwd=tmp_path).returncode == 0
    other_terminal = dict(server.env, TERM="screen-256color", TMUX_PANE="%3", SSH_TTY="/dev/pts/9")
    proc = server.command("run", config, "--quiet", cwd=tmp_path, env=other_terminal)
    assert proc.returncode == 0, proc.stderr
    assert served(server, 1) == 1  # another terminal of the same session is served
    env = dict(server.env, OMP_NUM_THREADS="1")
    proc = server.command("run", config, "--quiet", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    text = server.wait_for(lambda text: "refused run" in text)
    assert "OMP_NUM_THREADS" in text and served(server) == 1
    assert h5py.File(tmp_path / "fourindex-files" / "output.h5")["B"].shape == (21,) * 4


def test_other_code_runs_itself(tmp_path):
    """A server started from a copy of the package refuses a client once a file of it changes,
    and ends."""
    copy = tmp_path / "pkg"
    shutil.copytree(ROOT / "chainexec", copy / "chainexec", ignore=shutil.ignore_patterns("__pycache__"))
    srv = Server(python_path=str(copy))
    try:
        config = fourindex(tmp_path)
        assert srv.command("generate", config, cwd=tmp_path).returncode == 0
        assert srv.command("run", config, "--quiet", cwd=tmp_path).returncode == 0
        assert served(srv, 1) == 1
        edited = copy / "chainexec" / "report.py"
        edited.write_text(edited.read_text() + "\n")
        proc = srv.command("run", config, "--quiet", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "the package or Python differs" in srv.wait_for(lambda text: "refused" in text)
        assert served(srv) == 1
        # the server can serve no client of this package any more: it ends (it refused every one)
        assert srv.proc.wait(60) == 0 and "this package changed since the server started" in srv.text()
    finally:
        srv.close()


def test_a_client_of_another_interpreter_leaves_the_server_serving(server, tmp_path):
    """A client that runs the same package through another path to the interpreter (a venv's
    python3 beside its python) is refused, as other code is, and runs itself; the server, whose
    package has not changed, goes on serving (it ended, logging that its package changed)."""
    here = Path(sys.executable)
    other = next((here.parent / name for name in ("python3", "python", f"python{sys.version_info[0]}.{sys.version_info[1]}")
                  if name != here.name and (here.parent / name).exists()), None)
    if other is None:
        pytest.skip(f"no other name of this interpreter beside {here}")
    config = fourindex(tmp_path)
    assert server.command("generate", config, cwd=tmp_path).returncode == 0
    proc = subprocess.run([str(other), "-m", "chainexec.client", "plan", str(config)], cwd=tmp_path, env=server.env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "the package or Python differs" in server.wait_for(lambda text: "refused" in text)
    assert server.proc.poll() is None and "package changed" not in server.text()
    before = served(server)
    assert server.command("run", config, "--quiet", cwd=tmp_path).returncode == 0
    assert served(server, before + 1) == before + 1


def began(srv: Server, proc: subprocess.Popen) -> None:
    """Wait until the server has begun ``proc``'s run."""
    deadline = time.monotonic() + 60
    while not any(line.startswith("chainexec serve: began run") and f" for pid {proc.pid} " in line
                  for line in srv.text().splitlines()):
        assert proc.poll() is None and time.monotonic() < deadline, (srv.text(), proc.communicate())
        time.sleep(0.02)


def client(srv: Server, config: Path, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "chainexec.client", "run", str(config), "--quiet"], cwd=cwd,
                            env=srv.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_second_client_runs_itself_while_one_is_served_and_a_client_that_goes_stops_its_run(server, tmp_path):
    slow = fourindex(tmp_path, "slow", ao=80, mo=77)
    quick = fourindex(tmp_path)
    for config in (slow, quick):
        assert server.command("generate", config, cwd=tmp_path).returncode == 0
    first = client(server, slow, tmp_path)
    began(server, first)
    second = server.command("run", quick, "--quiet", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "busy with another run" in server.wait_for(lambda text: "refused run" in text)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert served(server, 1) == 1  # the slow one
    result = tmp_path / "slow-files" / "output.h5"
    result.unlink()
    third = client(server, slow, tmp_path)
    began(server, third)
    time.sleep(0.3)
    third.send_signal(signal.SIGKILL)  # a batch system's kill: the client is gone at once
    third.wait()
    assert server.proc.wait(60) == 130, server.text()  # the run interrupted as by Ctrl-C, the server with it
    assert "went away: the run is interrupted" in server.text()
    assert not result.exists() and served(server) == 1


@pytest.mark.parametrize("number, ignored", [(signal.SIGINT, False), (signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["SIGINT handled", "SIGINT ignored at start", "SIGTERM"])
def test_a_signal_stops_a_served_run_as_it_stops_its_own(server, tmp_path, number, ignored, monkeypatch):
    """A client sent SIGINT or SIGTERM ends with 128 + the signal's number and its run stopped
    (no output) with the line a run in its own process writes for that signal, also where it
    began with SIGINT ignored, as a non-interactive shell starts its background jobs (the served
    run went on to its end, status 0)."""
    slow = fourindex(tmp_path, "slow", ao=80, mo=77)
    assert server.command("generate", slow, cwd=tmp_path).returncode == 0
    start = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None
    proc = subprocess.Popen([sys.executable, "-m", "chainexec.client", "run", str(slow), "--quiet"], cwd=tmp_path,
                            env=server.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=start)
    began(server, proc)
    time.sleep(0.3)
    proc.send_signal(number)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + number, (proc.returncode, err)
    monkeypatch.setattr(stopsignals, "_LANDED", [])  # the served run landed nothing: not this process's runs
    assert err.strip() == stopsignals.line(number).strip(), err
    assert server.proc.wait(60) == 128 + number, server.text()
    assert not (tmp_path / "slow-files" / "output.h5").exists() and served(server) == 0


@pytest.mark.parametrize("stopped", ["the server", "a client whose reader has gone"])
def test_sigterm_stops_a_served_run_as_sigterm(server, tmp_path, stopped, monkeypatch):
    """SIGTERM to the server during a run (a batch system ending the job that holds it), or to a
    client whose standard error's reader has gone with it (``chainexec run … | cat`` ended as a
    process group): the run stops as SIGTERM stops a run of its own, and the server ends with
    143, not as Ctrl-C and not with a status of a run that went on (its line to the gone reader
    failed)."""
    slow = fourindex(tmp_path, "slow", ao=80, mo=77)
    assert server.command("generate", slow, cwd=tmp_path).returncode == 0
    read, write = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "chainexec.client", "run", str(slow), "--quiet"], cwd=tmp_path,
                            env=server.env, stdout=subprocess.DEVNULL, stderr=write, text=True)
    os.close(write)
    began(server, proc)
    time.sleep(0.3)
    if stopped == "the server":
        server.proc.send_signal(signal.SIGTERM)
    else:
        os.close(read)
        proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    assert server.proc.wait(60) == 143, server.text()
    monkeypatch.setattr(stopsignals, "_LANDED", [])  # the served run landed nothing: not this process's runs
    if stopped == "the server":
        with os.fdopen(read) as f:
            err = f.read()
        assert err.startswith(stopsignals.line(signal.SIGTERM)), err
        assert "the server (pid" in err and proc.returncode == 1, (proc.returncode, err)
    else:
        assert proc.returncode == 143 and "went away: the run is interrupted, as by SIGTERM" in server.text()
    assert not (tmp_path / "slow-files" / "output.h5").exists() and served(server) == 0


def test_one_server_per_socket_and_stop_without_one(server, tmp_path):
    again = subprocess.run([sys.executable, "-m", "chainexec.cli", "serve"], env=server.env, capture_output=True,
                           text=True, timeout=120)
    assert_refused(again, "already serves")
    idle = subprocess.run([sys.executable, "-m", "chainexec.cli", "serve", "--stop"], env=server.env,
                          capture_output=True, text=True, timeout=60)
    assert idle.returncode == 0 and f"the server (pid {server.proc.pid}) ends now" in idle.stdout, idle.stdout
    assert server.proc.wait(60) == 0
    server.close()
    stop = subprocess.run([sys.executable, "-m", "chainexec.cli", "serve", "--stop"], env=server.env,
                          capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0 and "no server answers" in stop.stdout


def test_a_server_ends_when_idle_and_removes_its_socket():
    srv = Server(idle=1)
    try:
        assert srv.proc.wait(60) == 0
        assert "the server ended" in srv.text()
        assert not (srv.folder / "chainexec" / "serve.sock").exists()
    finally:
        srv.close()


def test_a_socket_folder_others_may_write_in_is_refused(tmp_path):
    folder = Path(tempfile.mkdtemp(prefix="cx"))
    try:
        folder.chmod(0o777)
        env = dict(os.environ, CHAINEXEC_SERVE_SOCKET=str(folder / "serve.sock"))
        proc = subprocess.run([sys.executable, "-m", "chainexec.cli", "serve"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert_refused(proc, "no one else may write", str(folder))
        env = dict(os.environ, CHAINEXEC_SERVE_SOCKET=str(folder / "none" / "serve.sock"))
        proc = subprocess.run([sys.executable, "-m", "chainexec.cli", "serve"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert_refused(proc, "the socket's folder does not exist", str(folder / "none"))
    finally:
        shutil.rmtree(folder)


def test_a_file_that_is_not_a_socket_is_left_alone(tmp_path):
    folder = Path(tempfile.mkdtemp(prefix="cx"))
    try:
        folder.chmod(0o700)
        notes = folder / "notes.txt"
        notes.write_text("precious")
        env = dict(os.environ, CHAINEXEC_SERVE_SOCKET=str(notes))
        proc = subprocess.run([sys.executable, "-m", "chainexec.cli", "serve", "--idle", "1"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert_refused(proc, "other than a socket", str(notes))
        assert notes.read_text() == "precious"
        for idle in ("nan", "inf", "1e9"):
            proc = subprocess.run([sys.executable, "-m", "chainexec.cli", "serve", "--idle", idle], env=env,
                                  capture_output=True, text=True, timeout=120)
            assert_refused(proc, "--idle must be a positive number of seconds below 1e9")
    finally:
        shutil.rmtree(folder)
