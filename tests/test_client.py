"""The ``chainexec`` program's hand-over to a server (:mod:`chainexec.client`): which variables a
server may take from a client, where its socket may be, the messages, and when a command runs in
its own process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from chainexec import client


@pytest.mark.parametrize("name, per_run", [
    ("CHAINEXEC_MACHINE", True), ("CHAINEXEC_CACHE", True), ("PWD", True), ("OLDPWD", True), ("_", True),
    ("TERM", True), ("TMUX_PANE", True), ("SSH_TTY", True), ("SSH_CONNECTION", True), ("DISPLAY", True),
    ("OMP_NUM_THREADS", False), ("CUDA_VISIBLE_DEVICES", False), ("PYTHONPATH", False), ("HOME", False),
    ("OMPI_MCA_btl", False), ("chainexec_machine", False), ("CHAINEXEC_SIMULATE_HOSTS", False),
])
def test_per_run_variables_are_the_packages_and_the_shells(name, per_run):
    assert client.per_run(name) is per_run


@pytest.mark.parametrize("served, env, differ", [
    ({"A": "1"}, {"A": "1"}, []),
    ({"A": "1", "PWD": "/x"}, {"A": "1", "PWD": "/y"}, []),
    ({"A": "1"}, {"A": "1", "CHAINEXEC_MACHINE": "defaults"}, []),
    ({"A": "1"}, {"A": "2"}, ["A"]),
    ({"A": "1", "B": "2"}, {"A": "1"}, ["B"]),
    ({}, {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "1"}, ["CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"]),
])
def test_differences_name_the_variables_read_at_a_start(served, env, differ):
    assert client.differences(served, env) == differ


def test_the_socket_is_under_the_runtime_folder_or_the_named_one(tmp_path, monkeypatch):
    monkeypatch.delenv(client.SOCKET, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert client.default_path() == tmp_path / "chainexec" / "serve.sock"
    assert client.socket_path() is None  # the folder does not exist yet
    (tmp_path / "chainexec").mkdir(mode=0o700)
    assert client.socket_path() == tmp_path / "chainexec" / "serve.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    assert client.default_path().parent.name == f"chainexec-{os.getuid()}"
    monkeypatch.setenv(client.SOCKET, str(tmp_path / "chainexec" / "other.sock"))
    assert client.socket_path() == tmp_path / "chainexec" / "other.sock"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_a_socket_folder_others_may_write_in_is_not_used(tmp_path, monkeypatch, mode):
    folder = tmp_path / "s"
    folder.mkdir()
    folder.chmod(mode)
    monkeypatch.setenv(client.SOCKET, str(folder / "serve.sock"))
    assert client.socket_path() is None
    folder.chmod(0o700)
    assert client.socket_path() == folder / "serve.sock"


def test_a_socket_folder_that_is_a_link_is_not_used(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv(client.SOCKET, str(tmp_path / "link" / "serve.sock"))
    assert client.socket_path() is None


def test_messages_carry_json_and_descriptors():
    left, right = socket.socketpair()
    with left, right:
        r, w = os.pipe()
        big = {"argv": ["run", "x.yaml"], "env": {f"V{i}": "x" * 100 for i in range(4000)}}  # over one read
        sender = threading.Thread(target=client.send, args=(left, big, [w]))  # more than the socket holds
        sender.start()
        message, fds = client.receive(right, fds=3)
        sender.join()
        os.close(w)
        assert message == big and len(fds) == 1
        os.write(fds[0], b"through")
        os.close(fds[0])
        assert os.read(r, 16) == b"through"
        os.close(r)
        client.send(left, {"status": 3})
        assert client.receive(right) == ({"status": 3}, [])


def test_two_messages_in_one_read_are_both_received():
    """A fast command's two answers (accepted, then its status) often arrive together."""
    left, right = socket.socketpair()
    with left, right:
        data = b""
        for message in ({"accepted": True}, {"status": 2}):
            body = json.dumps(message).encode()
            data += struct.pack("!I", len(body)) + body
        left.sendall(data)
        assert client.receive(right) == ({"accepted": True}, [])
        assert client.receive(right) == ({"status": 2}, [])


def test_descriptors_of_a_malformed_message_are_closed():
    left, right = socket.socketpair()
    with left, right:
        r, w = os.pipe()
        socket.send_fds(left, [struct.pack("!I", 2) + b"[]"], [w])
        os.close(w)
        with pytest.raises(ValueError):
            client.receive(right, fds=3)
        assert os.read(r, 1) == b""  # no copy of the write end is left open
        os.close(r)


def test_the_identity_is_what_the_process_inherits():
    ident = client.identity()
    assert ident["gid"] == os.getgid() and ident["groups"] == sorted(os.getgroups())
    assert ident["cpus"] == sorted(os.sched_getaffinity(0))
    assert "RLIMIT_NOFILE" in ident["limits"] and json.loads(json.dumps(ident)) == ident


def test_a_message_cut_short_or_malformed_is_not_taken():
    left, right = socket.socketpair()
    with right:
        left.sendall(struct.pack("!I", 100) + b'{"a": 1')
        left.close()
        assert client.receive(right) == (None, [])
    for frame in (struct.pack("!I", client.LARGEST + 1), struct.pack("!I", 2) + b"[]"):
        left, right = socket.socketpair()
        with left, right:
            left.sendall(frame)
            with pytest.raises(ValueError):
                client.receive(right)


@pytest.mark.parametrize("argv", [[], ["generate", "x.yaml"], ["verify", "x.yaml"], ["serve"], ["-h"]])
def test_other_commands_run_in_their_own_process(argv, tmp_path, monkeypatch):
    monkeypatch.setenv(client.SOCKET, str(tmp_path / "serve.sock"))
    tmp_path.chmod(0o700)
    with _listening(tmp_path / "serve.sock") as listener:
        assert client.forward(argv) is None
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):  # never even asked
            listener.accept()


@pytest.mark.parametrize("launcher", client.LAUNCHER)
def test_a_rank_under_a_launcher_runs_itself(launcher, tmp_path, monkeypatch):
    monkeypatch.setenv(client.SOCKET, str(tmp_path / "serve.sock"))
    monkeypatch.setenv(launcher, "2")
    tmp_path.chmod(0o700)
    with _listening(tmp_path / "serve.sock") as listener:
        assert client.forward(["run", "x.yaml"]) is None
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()


def test_without_a_server_the_command_runs_itself(tmp_path, monkeypatch):
    tmp_path.chmod(0o700)
    monkeypatch.setenv(client.SOCKET, str(tmp_path / "serve.sock"))
    assert client.forward(["run", "x.yaml"]) is None
    (tmp_path / "serve.sock").write_text("")  # a file where the socket would be: nothing answers
    assert client.forward(["run", "x.yaml"]) is None


def _forwarded(tmp_path, monkeypatch, then) -> tuple[int | None, dict]:
    """``client.forward`` of a run against a stand-in server that takes one connection, reads the
    request (``seen["request"]``) and counts the descriptors attached to it (``seen["fds"]``,
    closed), then does ``then(conn, seen)``: the forward's result and ``seen``."""
    tmp_path.chmod(0o700)
    monkeypatch.setenv(client.SOCKET, str(tmp_path / "serve.sock"))
    seen = {}
    with _listening(tmp_path / "serve.sock") as listener:
        def serve():
            conn, _ = listener.accept()
            with conn:
                seen["request"], fds = client.receive(conn, fds=3)
                seen["fds"] = len(fds)
                for fd in fds:
                    os.close(fd)
                then(conn, seen)

        thread = threading.Thread(target=serve)
        thread.start()
        status = client.forward(["run", "x.yaml", "--quiet"])
        thread.join()
    return status, seen


@pytest.mark.parametrize("attempt", range(5))
def test_a_refusal_leaves_the_command_to_run_itself(tmp_path, monkeypatch, attempt):
    """The client sends its request (without its standard streams, which go only to a server
    that accepts) and, refused, runs itself: it reads the refusal (the server's answer is sent
    whole, and the client's request was too, however soon the server closes after answering;
    five attempts, as the two race)."""
    answers = []
    receive = client.receive
    monkeypatch.setattr(client, "receive", lambda sock, fds=0: answers.append(receive(sock, fds)) or answers[-1])

    def refuse(conn, seen):
        client.send(conn, {"refused": "busy with another run"})
        seen["answered"] = True

    status, seen = _forwarded(tmp_path, monkeypatch, refuse)
    assert status is None
    assert seen["answered"] and answers[-1] == ({"refused": "busy with another run"}, [])
    request = seen["request"]
    assert seen["fds"] == 0
    assert request["argv"] == ["run", "x.yaml", "--quiet"] and request["cwd"] == os.getcwd()
    assert request["env"] == dict(os.environ) and request["pid"] == os.getpid()
    assert request["code"] == client.code() and request["identity"] == client.identity()


def test_a_server_that_never_answers_gets_no_standard_streams(tmp_path, monkeypatch):
    """A server that takes the connection and never answers (stopped, wedged): the client gives up
    after ``ANSWER`` seconds and runs itself, having sent none of its standard streams (it sent
    them with the request, and the server held them: a pipeline the command wrote to never ended)."""
    monkeypatch.setattr(client, "ANSWER", 0.5)

    def silent(conn, seen):
        conn.settimeout(5)
        seen["after"] = conn.recv(1)  # the client closes without sending its streams

    status, seen = _forwarded(tmp_path, monkeypatch, silent)
    assert status is None
    assert seen["request"]["argv"] == ["run", "x.yaml", "--quiet"] and seen["fds"] == 0 and seen["after"] == b""


def test_ctrl_c_while_waiting_for_the_answer_is_one_line(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the client waits for a server's first answer (up to ``ANSWER`` seconds): status
    130 and the one line a run interrupted before any output writes (a KeyboardInterrupt
    traceback)."""
    from chainexec import stopsignals

    tmp_path.chmod(0o700)
    monkeypatch.setenv(client.SOCKET, str(tmp_path / "serve.sock"))
    monkeypatch.setattr(stopsignals, "_LANDED", [])  # a client lands nothing: not this test process's runs

    def interrupted(sock, fds=0):
        raise KeyboardInterrupt

    monkeypatch.setattr(client, "receive", interrupted)
    with _listening(tmp_path / "serve.sock"):
        assert client.forward(["run", "x.yaml", "--quiet"]) == 130
    assert capsys.readouterr().err == "chainexec: interrupted; no output was completed (a run with --checkpoint " \
                                      "resumes from its last checkpoint)\n"


def test_the_code_changes_with_any_file_of_the_package(tmp_path, monkeypatch):
    copy = tmp_path / "chainexec"
    shutil.copytree(Path(client.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(client, "__file__", str(copy / "client.py"))
    before = client.code()
    assert client.code() == before
    target = copy / "planner" / "tiling.py"
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert client.code() != before
    monkeypatch.setattr(sys, "executable", sys.executable + "-other")
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert client.code() != before


def test_process_start_is_this_process_s_on_the_boot_clock():
    import time

    start = client.process_start()
    assert start is not None and 0 <= time.clock_gettime(time.CLOCK_BOOTTIME) - start < 3600


class _listening:
    """A Unix socket listening at a path for the duration of a ``with``."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)

    def __enter__(self):
        return self.sock

    def __exit__(self, *exc):
        self.sock.close()


def test_the_peer_of_a_socket_is_this_user():
    left, right = socket.socketpair()
    with left, right:
        assert client.peer_uid(left) == client.peer_uid(right) == os.getuid()


FORWARD = """
import signal, sys
from chainexec import client
before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
status = client.forward(["run", "x.yaml", "--quiet"])
print((signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before)
sys.exit(status)
"""


@pytest.mark.parametrize("case", ["served", "stopped by SIGTERM", "SIGTERM after the run returned"])
def test_a_served_client_names_its_signal_and_restores_its_handlers(tmp_path, case):
    """A served client (a process of its own) sent SIGTERM tells the server which signal came and
    ends with 143 once the server has stopped the run, or with the run's status where the server
    answers one (the command had returned, its outputs in place); its handlers of SIGINT and
    SIGTERM are the process's own again once ``forward`` returns."""
    tmp_path.chmod(0o700)
    seen = {}
    with _listening(tmp_path / "serve.sock") as listener:
        proc = subprocess.Popen([sys.executable, "-c", FORWARD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=dict(os.environ, **{client.SOCKET: str(tmp_path / "serve.sock")},
                                                    PYTHONPATH=os.getcwd()))
        try:
            listener.settimeout(60)
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(60)
                client.receive(conn, fds=3)
                client.send(conn, {"accepted": True, "pid": 1})
                _, fds = client.receive(conn, fds=3)
                for fd in fds:
                    os.close(fd)
                if case != "served":
                    proc.send_signal(signal.SIGTERM)
                    seen["note"], _ = client.receive(conn)
                if case != "stopped by SIGTERM":
                    client.send(conn, {"status": 0})
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == (143 if case == "stopped by SIGTERM" else 0), err
    assert seen.get("note") == (None if case == "served" else {"signal": signal.SIGTERM})
    assert out.strip() == "True", (out, err)
