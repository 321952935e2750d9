"""``python -m chainexec.cli ARGS`` of one process (no launcher) in a child forked from a warm
interpreter: each pytest worker starts one interpreter (the *zygote*) that imports the package's
modules once, and for each call forks a child that takes the call's environment, folder,
arguments and output files and runs the CLI module as ``python -m`` does. A call costs a fork
instead of an interpreter's start and the package's imports, which the suite's many one-process
calls would each pay.

The child is a process of its own, as ``python -m`` starts one: its exit status, stdout, stderr,
files and failures are its own. What it shares with the zygote is what the imports made before
any call: modules' code and constants (no module of the package reads the environment, opens a
file or starts a thread when imported), and the settings an interpreter takes at its start
(``PYTHONUNBUFFERED`` on, as :func:`tests.conftest.run_cli` sets it for every call). mpi4py's
``MPI``, whose import starts MPI, is not imported by the zygote (nor the modules that import it):
each child starts its own. PySCF, where installed, is (the chemistry jobs import it when they
run); its OpenMP threads start at its first parallel loop, in a child.
:func:`tests.conftest.run_cli` runs a call with an environment of its own (``env=``), whose
variables an interpreter or a library may read at its start, and a launcher's ranks as real
subprocesses; ``CHAINEXEC_TESTS_SUBPROCESS=1`` runs every call so."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

ZYGOTE = r"""
import importlib, os, pkgutil, select, signal, sys, json, runpy, warnings
import chainexec


class NoMPI:  # refuses mpi4py.MPI, whose import starts MPI: each child starts its own
    def find_spec(self, name, path=None, target=None):
        if name == "mpi4py.MPI":
            raise ImportError("not in the zygote")


# A warning an import shows (on stderr) would be shown once here and never in a child, where a
# fresh interpreter shows it in every call: the zygote then ends, and the calls run as subprocesses.
with warnings.catch_warnings(record=True) as shown:
    sys.meta_path.insert(0, NoMPI())
    for found in pkgutil.walk_packages(chainexec.__path__, "chainexec."):
        try:
            importlib.import_module(found.name)
        except ImportError:
            pass
    sys.meta_path.pop(0)
    try:  # the chemistry jobs' optional dependency, imported by the CLI when a job needs it
        import pyscf.cc, pyscf.gto, pyscf.scf
    except ImportError:
        pass
if shown:
    sys.exit(f"forkcli: an import warned ({shown[0].message}): the CLI's calls run as subprocesses")
del sys.modules["chainexec.cli"], sys.modules["chainexec"].cli  # run as __main__, as `python -m` runs it
assert "mpi4py.MPI" not in sys.modules
requests, replies = os.dup(0), os.dup(1)
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
os.dup2(null, 1)
os.close(null)
woken, wake = os.pipe()
for fd in (woken, wake):
    os.set_blocking(fd, False)
signal.set_wakeup_fd(wake)
signal.signal(signal.SIGCHLD, lambda *_: None)
os.write(replies, b"ready\n")


def child(call):
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in (requests, replies, woken, wake):
        os.close(fd)
    os.chdir(call["cwd"])
    os.environ.clear()
    os.environ.update(call["env"])
    for fd, path in ((1, call["stdout"]), (2, call["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    sys.argv = ["-m", *call["args"]]
    runpy.run_module("chainexec.cli", run_name="__main__", alter_sys=True)
    sys.exit(0)


pending = b""
while True:
    ready = select.select([requests, woken], [], [])[0]
    if woken in ready:
        while True:
            try:
                if not os.read(woken, 512):
                    break
            except BlockingIOError:
                break
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        os.write(replies, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
    if requests in ready:
        data = os.read(requests, 1 << 16)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                child(json.loads(line))
            os.write(replies, f"pid {pid}\n".encode())
"""


class Zygote:
    """One warm interpreter and the calls forked from it; calls from several threads at once
    run at once (each waits for its own child's exit)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.alive = self.proc.stdout.readline() == b"ready\n"
        self.sending = threading.Lock()
        self.changed = threading.Condition()
        self.started: list[int] = []
        self.exits: dict[int, int] = {}
        self.folder = tempfile.mkdtemp(prefix="forkcli")
        if self.alive:
            threading.Thread(target=self._read, daemon=True).start()

    def close(self) -> None:
        """Ends the zygote (it leaves when its requests' pipe closes) and removes its folder."""
        self.proc.stdin.close()
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _read(self) -> None:
        for line in self.proc.stdout:
            kind, pid, *code = line.split()
            with self.changed:
                if kind == b"pid":
                    self.started.append(int(pid))
                else:
                    self.exits[int(pid)] = int(code[0])
                self.changed.notify_all()
        with self.changed:
            self.alive = False
            self.changed.notify_all()

    def run(self, cmd: list[str], args: list[str], env: dict[str, str], cwd, timeout: float
            ) -> subprocess.CompletedProcess:
        """``cmd`` (for the result's ``args``) as ``python -m chainexec.cli ARGS`` with environment
        ``env`` in folder ``cwd`` (``None``: this process's), ended by SIGKILL after ``timeout``
        seconds (:class:`subprocess.TimeoutExpired`, as :func:`subprocess.run` raises)."""
        fd, out = tempfile.mkstemp(dir=self.folder)
        os.close(fd)
        fd, err = tempfile.mkstemp(dir=self.folder)
        os.close(fd)
        call = {"args": args, "env": env, "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd()),
                "stdout": out, "stderr": err}
        with self.sending:
            with self.changed:
                before = len(self.started)
            self.proc.stdin.write(json.dumps(call).encode() + b"\n")
            self.proc.stdin.flush()
            with self.changed:
                self.changed.wait_for(lambda: len(self.started) > before or not self.alive)
                if len(self.started) == before:
                    raise RuntimeError("the CLI's zygote process ended")
                pid = self.started[before]
        with self.changed:
            ended = self.changed.wait_for(lambda: pid in self.exits or not self.alive, timeout)
        if not ended:
            os.kill(pid, signal.SIGKILL)
            with self.changed:
                self.changed.wait_for(lambda: pid in self.exits or not self.alive)
        if pid not in self.exits:
            raise RuntimeError("the CLI's zygote process ended")
        code = self.exits.pop(pid)
        stdout, stderr = (_text(path) for path in (out, err))
        if not ended:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def _text(path: str) -> str:
    """A child's output file as :func:`subprocess.run` gives a pipe's text (universal newlines),
    removed."""
    with open(path, encoding=None, errors="strict", newline=None) as f:
        text = f.read()
    os.unlink(path)
    return text


_zygote: Zygote | None = None


def zygote() -> Zygote | None:
    """This process's zygote, started on first use; ``None`` where calls run as subprocesses:
    ``CHAINEXEC_TESTS_SUBPROCESS=1``, or a zygote that could not import the CLI (whose error a
    subprocess then shows) or has ended."""
    global _zygote
    if os.environ.get("CHAINEXEC_TESTS_SUBPROCESS") == "1":
        return None
    if _zygote is None:
        _zygote = Zygote()
        atexit.register(_zygote.close)
    return _zygote if _zygote.alive else None
