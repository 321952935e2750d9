"""The ``chainexec`` program's first step: hand a ``run`` or ``plan`` to a running ``chainexec serve``.

Why: a fresh process starts the interpreter, NumPy and h5py, MPI, CuPy and the CUDA context
before a warm run's work begins, and tears them down after it; for a small job that takes
several times the work itself. ``chainexec serve`` (:mod:`chainexec.server`) is a process that has all of
that loaded and keeps it between runs; this module, which imports only the standard library,
is what the ``chainexec`` command runs first. Where a server of the same user answers on this
host, runs the same code with the same Python, and was started in the same environment (:func:`differences`),
the command hands it its arguments, its folder, its umask and its standard streams
themselves (the descriptors, passed over a Unix socket: the run writes to the terminal, pipe or
file the command was given, as it would itself) and ends with the run's exit status. Otherwise it
runs the command itself (:func:`chainexec.cli.command`), with the same result: serving only
saves the start. A command under a launcher (one of several ranks) is never handed over.

The protocol (:func:`send`, :func:`receive`): one request, a JSON object; the server's
answer, ``accepted`` or ``refused`` with a reason; where accepted, the client's standard streams'
descriptors attached to a second message (never to a server that has not answered: a stopped
one would hold them, and a pipeline would not end); then, once the run has ended, its
``status``. A client that goes away during the run (Ctrl-C,
a batch system's kill) stops the run as an interrupt stops a run of its own, and the server
with it (:mod:`chainexec.server`).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import stat
import struct
import sys
import tempfile
from pathlib import Path

SERVED = ("run", "plan")
"""The commands a server runs; the others (generate, verify, chem, calibrate, bench) run in their
own process."""

SOCKET = "CHAINEXEC_SERVE_SOCKET"
"""The environment variable naming the server's socket where the default (:func:`socket_path`)
will not do."""

LAUNCHER = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "SLURM_NTASKS", "MPI_LOCALNRANKS")
"""Variables a launcher sets in the processes it starts; a process without any is an MPI
singleton (:func:`chainexec.runtime.comm.launched`)."""

SHELL = frozenset({
    "PWD", "OLDPWD", "SHLVL", "_", "COLUMNS", "LINES", "PS1", "PS2", "PROMPT_COMMAND", "HISTFILE", "HISTSIZE",
    "HISTCONTROL", "MAIL", "TERM", "COLORTERM", "TERM_PROGRAM", "TERM_PROGRAM_VERSION", "VTE_VERSION", "WINDOWID",
    "TMUX", "TMUX_PANE", "STY", "WINDOW", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK", "GPG_TTY",
    "DISPLAY", "XAUTHORITY", "DBUS_SESSION_BUS_ADDRESS", "XDG_SESSION_ID", "XDG_SESSION_TYPE", "XDG_VTNR",
    "LS_COLORS", "LESS", "LESSOPEN", "LESSCLOSE", "PAGER", "EDITOR", "VISUAL",
})
"""Variables of the shell, the terminal and the login (another terminal, tmux pane or
ssh login has its own): they may differ between the server's start and a client, and the
client's apply to its run."""

HEADER = struct.Struct("!I")
"""A message's length in bytes, before its JSON text."""

LARGEST = 16 << 20
"""Bytes of one message at most (a request holds the client's environment)."""


ONCE = frozenset({"CHAINEXEC_SIMULATE_HOSTS"})
"""The package's variables a process reads once (:func:`chainexec.runtime.comm.host_comm` keeps
its answer on the world communicator)."""


def per_run(name: str) -> bool:
    """Whether the variable ``name`` is read when a run needs it, so that a server applies the
    client's value to the run it hands over: the package's own (``CHAINEXEC_*``, read at each
    use, but :data:`ONCE`) and the login's (:data:`SHELL`). Every other variable may
    be read once when a library starts (CUDA's, Open MPI's, OpenMP's thread count, Python's
    paths): a client whose value differs from the server's start runs itself."""
    return name in SHELL or (name.startswith("CHAINEXEC_") and name not in ONCE)


def differences(served: dict[str, str], env: dict[str, str]) -> list[str]:
    """Names of the variables that are not :func:`per_run` and differ between the server's start
    environment ``served`` and a client's ``env`` (set in one only, or to different values),
    sorted."""
    return sorted(k for k in served.keys() | env.keys() if not per_run(k) and served.get(k) != env.get(k))


def default_path() -> Path:
    """Where the server's socket is: :data:`SOCKET` where set, else ``chainexec/serve.sock``
    under ``$XDG_RUNTIME_DIR`` (a per-user folder on systemd hosts), else under
    ``<temp>/chainexec-<uid>``."""
    given = os.environ.get(SOCKET)
    if given:
        return Path(given)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "chainexec" / "serve.sock"
    return Path(tempfile.gettempdir()) / f"chainexec-{os.getuid()}" / "serve.sock"


def socket_path() -> Path | None:
    """:func:`default_path`, or None where its folder is not this user's alone (:func:`private`):
    there another user could have put a socket."""
    path = default_path()
    return path if private(path.parent) else None


def private(folder: Path) -> bool:
    """Whether ``folder`` is a real folder (not a symbolic link) of this user that no one else
    may write in."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def code() -> str:
    """What a server and its client must share: the interpreter, its version and every Python
    file of this package as it is now on disk (path, size and modification time), as a
    SHA-256 hex digest. A package edited or reinstalled since the server started differs."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256(f"{sys.executable}\0{sys.version}\0{root}".encode())
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            st = os.stat(path)
            digest.update(f"\0{path}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return digest.hexdigest()


def identity() -> dict:
    """What a process inherits besides its environment and shapes how a run reads, writes and
    runs, which a server must share with its client: the group ids (files' group owner, folders
    a run may enter), the CPUs it may run on (a calibration is kept per count of them), its
    priority and its resource limits."""
    import resource

    limits = {name: list(resource.getrlimit(getattr(resource, name)))
              for name in sorted(dir(resource)) if name.startswith("RLIMIT_")}
    return {"gid": os.getgid(), "egid": os.getegid(), "groups": sorted(os.getgroups()),
            "cpus": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0), "limits": limits}


def process_start() -> float | None:
    """When this process started, in seconds of the boot-time clock (``CLOCK_BOOTTIME``), as
    Linux counts it: field 22 of ``/proc/self/stat`` (clock ticks since boot), to a clock tick.
    None where ``/proc`` does not say (not Linux)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # from field 3 on
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    """Send ``message`` as JSON after its length (:data:`HEADER`), with the descriptors ``fds``
    attached to its first bytes."""
    data = json.dumps(message).encode()
    frame = HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else sock.send(frame)
    if sent < len(frame):  # (sending nothing more to a peer that has answered and closed fails)
        sock.sendall(frame[sent:])


def receive(sock: socket.socket, fds: int = 0) -> tuple[dict | None, list[int]]:
    """The next message of :func:`send` and the descriptors attached to it (at most ``fds``),
    read to its last byte and no further (the next message stays for the next call); (None, [])
    where the peer closed the connection before a whole message. A message that is not a JSON
    object within :data:`LARGEST` bytes raises ``ValueError``; the descriptors received are
    closed whenever no message is returned."""
    received: list[int] = []
    try:
        head = b""
        while len(head) < HEADER.size:
            if fds and not received:
                data, received, _, _ = socket.recv_fds(sock, HEADER.size - len(head), fds)
            else:
                data = sock.recv(HEADER.size - len(head))
            if not data:
                raise EOFError
            head += data
        (size,) = HEADER.unpack(head)
        if size > LARGEST:
            raise ValueError(f"a message of {size} bytes")
        body = bytearray()
        while len(body) < size:
            more = sock.recv(min(1 << 20, size - len(body)))
            if not more:
                raise EOFError
            body += more
        message = json.loads(bytes(body))
        if not isinstance(message, dict):
            raise ValueError("a message that is not a JSON object")
        return message, received
    except EOFError:
        _close(received)
        return None, []
    except BaseException:  # ValueError (JSON's too), OSError, a timeout
        _close(received)
        raise


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def connect(path: Path | None = None) -> socket.socket | None:
    """A connection to the server at ``path`` (default :func:`socket_path`), or None where none
    answers there or the process that answers is another user's."""
    path = path or socket_path()
    if path is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        if peer_uid(sock) == os.getuid():
            return sock
    except OSError:
        pass
    sock.close()
    return None


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


ANSWER = 30.0
"""Seconds a client waits for a server's first answer (accepted or refused) before it runs the
command itself."""

STOPPING = 60.0
"""Seconds a client interrupted during a served run waits for the server to stop the run."""


def forward(argv: list[str]) -> int | None:
    """Hand the command ``argv`` (without the program's name) to a server and return the run's
    exit status; None where it runs here instead: not a :data:`SERVED` command, under a
    launcher, a standard stream closed, no server answering within :data:`ANSWER` seconds, or a
    server that refuses it (busy with another run, other code, another environment or
    :func:`identity`)."""
    from chainexec.runtime.comm import launched

    if not argv or argv[0] not in SERVED or launched():
        return None
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
    except OSError:
        return None
    path = socket_path()
    if path is None or not os.path.exists(path):
        return None
    request = {"argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ), "umask": _umask(),
               "code": code(), "identity": identity(), "started": process_start(), "pid": os.getpid()}
    sock = connect(path)
    if sock is None:
        return None
    # SIGINT and SIGTERM stop the command as they stop a run in its own process (which watches
    # them, :func:`chainexec.stopsignals.watch`), also where this process began with SIGINT
    # ignored (a non-interactive shell's background job), where Python would leave it ignored;
    # a served run's server is told which came
    stopped = [signal.SIGINT]

    def terminated(number, frame):
        stopped[0] = number
        raise KeyboardInterrupt

    previous = [signal.signal(signal.SIGINT, signal.default_int_handler), signal.signal(signal.SIGTERM, terminated)]
    handed = False  # the streams sent: the run is the server's to stop from then on
    try:
        with sock:
            try:
                sock.settimeout(ANSWER)
                send(sock, request)
                answer, _ = receive(sock)
                if not answer or not answer.get("accepted"):
                    return None
                # the streams only to a server that has accepted: one that never answers (stopped,
                # wedged) would otherwise hold them, and a pipe this command writes to, after it
                # gave up; a signal waits until ``handed`` says whether they went
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
                try:
                    send(sock, {"streams": True}, [0, 1, 2])
                    handed = True
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                sock.settimeout(None)
            except (OSError, ValueError):
                return None
            except KeyboardInterrupt:
                if handed:
                    return _interrupted(sock, stopped[0])
                from chainexec import stopsignals  # before the server had the streams: nothing began

                print(stopsignals.line(stopped[0], argv[0] == "run"), end="", file=sys.stderr, flush=True)
                return stopsignals.STATUS[stopped[0]]
            try:
                done, _ = receive(sock)
            except KeyboardInterrupt:
                return _interrupted(sock, stopped[0])
            except (OSError, ValueError):
                done = None
    finally:
        for number, handler in zip((signal.SIGINT, signal.SIGTERM), previous):
            signal.signal(number, handler)
    if done is None or not isinstance(done.get("status"), int):
        print(f"chainexec: the server (pid {answer.get('pid')}) ended during the run; no output was "
              "completed (its own output says why)", file=sys.stderr)
        return 1
    return done["status"]


def _interrupted(sock: socket.socket, number: int) -> int:
    """128 + the signal's ``number`` (130 for SIGINT, 143 for SIGTERM) once the server has
    stopped the run (it reads the signal, sees this end close for writing and interrupts the
    run as that signal would, then ends; at most :data:`STOPPING` seconds), so that the next
    command does not begin beside the run; the run's own status where the server answers one
    (the command had returned, its outputs in place, when the signal came)."""
    from chainexec import stopsignals

    try:
        send(sock, {"signal": int(number)})
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(STOPPING)
        done, _ = receive(sock)
        if isinstance(done, dict) and isinstance(done.get("status"), int):
            return done["status"]
        while sock.recv(1 << 12):
            pass
    except (OSError, ValueError, KeyboardInterrupt):
        pass
    return stopsignals.STATUS[number]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def command() -> None:
    """The ``chainexec`` program: the command handed to a server (:func:`forward`), else run here
    (:func:`chainexec.cli.command`); a signal from its start on ends it as one later does
    (:func:`chainexec.stopsignals.starting`)."""
    from chainexec import stopsignals

    stopsignals.starting(sys.argv[1:])
    status = forward(sys.argv[1:])
    if status is None:
        from chainexec.cli import command as here

        here()
    sys.exit(status)


if __name__ == "__main__":
    command()
