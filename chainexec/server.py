"""``chainexec serve``: one process that runs the ``run`` and ``plan`` commands clients hand it.

What it keeps between runs: the interpreter and every module a run imports, MPI (started once,
as the single rank of its own world), CuPy with the GPU's context, cuBLAS and the generated
kernels already loaded, so that a warm run spends its time on its work. What it does per run
(:func:`serve_one`): each request comes from :func:`chainexec.client.forward` over a Unix socket
only this user can reach (the folder is checked, and the peer's user id, ``SO_PEERCRED``); the
server takes the client's standard streams (its descriptors, put in place of 0, 1 and 2), its
folder, its umask and the per-run variables of its environment
(:func:`chainexec.client.per_run`), runs the command through :func:`chainexec.cli.main` on its
main thread, waits for the removals the run left (:func:`chainexec.safepaths.wait_removals`),
hands back what it took and answers with the exit status. The output, the exit status and the
files written are those of the same command run on its own.

What it refuses, so that the client runs the command itself: a request while a run is in
progress (one run at a time: a second would share the GPU and the memory limits the first
planned for), a client whose package files or Python differ (:func:`chainexec.client.code`:
edited since the server started), or whose environment differs in a variable read at a
library's start (:func:`chainexec.client.differences`).

How it ends: after ``idle`` seconds without a request; at ``chainexec serve --stop``; at
SIGTERM or SIGINT; and whenever a run does not end normally. A client stopped during its run
(Ctrl-C, a batch system's SIGTERM, which it names to the server) or gone (SIGKILL) interrupts the
run as that signal (Ctrl-C for a client gone) interrupts a run of its own: no output renamed into
place, the last checkpoint kept, and the process ends with it. An error the
command does not turn into an exit status (a defect) is printed to the client and ends the server
too: what it leaves in memory is not trusted for the next run. Memory between runs: CuPy's pools
are emptied after each run; the CUDA context and the loaded kernels stay.
"""

from __future__ import annotations

import fcntl
import os
import queue
import select
import signal
import socket
import stat
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from chainexec import client, stopsignals
from chainexec.errors import ChainexecError, say

IDLE = 900.0
"""Seconds without a request after which a server ends, by default."""


def serve(idle: float = IDLE, path: Path | None = None) -> None:
    """Serve runs at ``path`` (default :func:`chainexec.client.socket_path`, its folder made
    where missing) until ``idle`` seconds pass without a request, a stop request arrives or
    SIGTERM or SIGINT; returns then, the socket removed. Raises ChainexecError where ``idle`` is
    not a positive number of seconds below 1e9 (the queue's wait takes no more), the folder is
    missing or not this user's alone, something other than a socket is at ``path``, or a server
    already serves there (it holds ``<path>.lock`` for its life: two servers started at once
    cannot both bind)."""
    if not 0 < idle < 1e9:
        raise ChainexecError(f"--idle must be a positive number of seconds below 1e9 (about 32 years), not {idle:g}")
    path = path or _folder()
    held = _hold(path.with_name(path.name + ".lock"))
    try:
        _serve(idle, path)
    finally:
        os.close(held)


def _hold(lock: Path) -> int:
    """A descriptor of ``lock`` (made where missing) locked for this process (``flock``); a
    ChainexecError where another process holds it."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise ChainexecError(f"cannot open the server's lock ({err.strerror or err})", lock) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ChainexecError("a server already serves there (chainexec serve --stop ends it)", lock) from None
    return fd


def _serve(idle: float, path: Path) -> None:
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        found = None
    if found is not None and not stat.S_ISSOCK(found.st_mode):
        raise ChainexecError("something other than a socket is there", path)
    started = dict(os.environ)
    _warm()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if found is not None:
            path.unlink()  # a server that ended without removing it (none holds the lock)
        listener.bind(str(path))
        os.chmod(path, 0o600)
        bound = os.stat(path).st_ino
        listener.listen(8)
    except OSError as err:
        listener.close()
        raise ChainexecError(f"cannot listen on the socket ({err.strerror or err})", path) from None
    state = _State(started, client.code(), client.identity())
    acceptor = threading.Thread(target=_accept, args=(listener, state), name="chainexec-serve-accept", daemon=True)
    acceptor.start()
    # both interrupt (a shell starts a background job with SIGINT ignored; _watch sends it), a
    # run in progress as that signal interrupts a run of its own (stopsignals.served)
    previous = [signal.signal(n, _interrupt) for n in (signal.SIGINT, signal.SIGTERM)]
    say(f"chainexec: serving runs at {path} (pid {os.getpid()}); ends after {idle:g} s without one, "
        "or at `chainexec serve --stop`")
    try:
        while True:
            try:
                item = state.queue.get(timeout=idle)
            except queue.Empty:
                break
            if item is None:
                break
            if not serve_one(state, *item):
                break
    except KeyboardInterrupt:
        pass
    finally:
        for number, handler in zip((signal.SIGINT, signal.SIGTERM), previous):
            signal.signal(number, handler)
        listener.close()
        try:
            if os.stat(path).st_ino == bound:
                path.unlink()
        except OSError:
            pass
        try:
            state.log.close()
        except OSError:
            pass
    say("chainexec: the server ended")


def stop(path: Path | None = None) -> tuple[int, bool] | None:
    """Ask the server at ``path`` (default :func:`chainexec.client.socket_path`) to end once its
    run in progress, if any, has ended; its process id and whether a run was in progress, or
    None where no server answers."""
    sock = client.connect(path)
    if sock is None:
        return None
    with sock:
        client.send(sock, {"stop": True})
        answer, _ = client.receive(sock)
    return None if answer is None else (answer.get("pid"), bool(answer.get("busy")))


class _State:
    """What the accepting thread and the main thread share: the requests accepted (or None:
    end), whether a run is in progress, the start environment, code and identity
    (:func:`chainexec.client.identity`), and the server's own standard error."""

    def __init__(self, env: dict[str, str], code: str, identity: dict):
        self.queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.busy = False
        self.env = env
        self.code = code
        self.identity = identity
        self.log = os.fdopen(os.dup(2), "w", buffering=1)


def _folder() -> Path:
    """:func:`chainexec.client.default_path`, its folder made (mode 0700) where missing and not
    named by :data:`chainexec.client.SOCKET`; ChainexecError where the folder is not this user's
    alone (:func:`chainexec.client.private`)."""
    path = client.default_path()
    if not os.environ.get(client.SOCKET):
        try:
            path.parent.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as err:
            raise ChainexecError(f"cannot make the socket's folder ({err.strerror or err})", path.parent) from None
    if not path.parent.is_dir():
        raise ChainexecError("the socket's folder does not exist", path.parent)
    if not client.private(path.parent):
        raise ChainexecError("the socket's folder must be a folder of this user that no one else may write in",
                             path.parent)
    return path


def _warm() -> None:
    """Import what a run imports and start MPI, so that the first run does not pay for them; the
    GPU's warm-up is the first run's (it knows the job)."""
    from chainexec import api, cli, report  # noqa: F401
    from chainexec.runtime import executor  # noqa: F401 (api imports it at a run's start)
    from chainexec.runtime.comm import world

    world()
    try:
        import cupy  # noqa: F401
    except Exception:  # the NumPy backend serves as well
        pass


RECEIVE = 5.0
"""Seconds the server waits for a connection's request."""


def _accept(listener: socket.socket, state: _State) -> None:
    """Accept connections until the listener closes: a stop request ends the main loop once
    the run in progress has ended; a run request goes to the main thread where none is in
    progress, else is refused at once (the client runs it itself). A connection that sends no
    whole request within :data:`RECEIVE` seconds, or anything unexpected, is closed and logged,
    and the next one is accepted."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        try:
            _take(conn, state)
        except Exception as err:
            _log(state, f"dropped a connection: {type(err).__name__}: {err}")
            conn.close()


def _take(conn: socket.socket, state: _State) -> None:
    if client.peer_uid(conn) != os.getuid():
        conn.close()
        return
    conn.settimeout(RECEIVE)
    request, _ = client.receive(conn)
    conn.settimeout(None)
    if request is None:
        conn.close()
        return
    if request.get("stop"):
        with state.lock:
            busy = state.busy
        _answer(conn, {"pid": os.getpid(), "busy": busy})
        conn.close()
        _log(state, "asked to stop")
        state.queue.put(None)
        return
    with state.lock:
        taken = not state.busy
        state.busy = True
    if not taken:
        _answer(conn, {"refused": "busy with another run"})
        _log(state, f"refused {_label(request)}: busy with another run")
        conn.close()
        return
    state.queue.put((conn, request))


def _label(request: dict) -> str:
    """The command and client of a request, for the log, whatever the request holds."""
    argv = request.get("argv")
    words = " ".join(map(str, argv[:2])) if isinstance(argv, list) else "?"
    return f"{words[:200]} for pid {str(request.get('pid'))[:20]}"


def _interrupt(number, frame) -> None:
    """The server's handler of SIGINT and SIGTERM: a run in progress stops as that signal stops
    a run of its own (its line, 128 + its number); between runs the server ends."""
    stopsignals.served(number)
    raise KeyboardInterrupt


def serve_one(state: _State, conn: socket.socket, request: dict) -> bool:
    """Run one request on this (the main) thread, answer its status and close the connection;
    False where the server must end (a run that did not end normally, or a client refused
    because the package's files changed since the server started: no client of it can be
    served any more; a client of other code, another checkout or interpreter, leaves it be). The client's standard
    streams come once it has been told its request is accepted (:func:`_streams`): a client
    that gave up waiting for the answer holds its own, and a pipe it writes to ends with it."""
    go_on = True
    begun = time.perf_counter()
    what = _label(request)
    fds: list[int] = []
    try:
        reason = _refusal(state, request)
        if reason:
            _answer(conn, {"refused": reason})
            _log(state, f"refused {what}: {reason}")
            if request.get("code") != state.code and client.code() != state.code:
                _log(state, "this package changed since the server started, which it can no longer serve: it ends")
                return False
            return True
        _answer(conn, {"accepted": True, "pid": os.getpid()})
        fds = _streams(conn)
        if len(fds) != 3:
            _log(state, f"dropped {what}: its client sent no standard streams (it had gone)")
            return True
        _log(state, f"began {what} in {request['cwd']}")
        done, wake = os.pipe()
        def gone(number: int) -> None:
            _log(state, f"the client of {what} went away: the run is interrupted, as by "
                 f"{'Ctrl-C' if number == signal.SIGINT else signal.Signals(number).name}, and the server ends with it")
        watcher = threading.Thread(target=_watch, args=(conn, done, gone), name="chainexec-serve-watch", daemon=True)
        try:
            with _client(request, fds):
                watcher.start()
                status, go_on = _run(request["argv"], lambda: os.write(wake, b"!"))
            watcher.join()
        finally:
            os.close(done)
            os.close(wake)
        _answer(conn, {"status": status})
        _log(state, f"served {what} in {request['cwd']}: status {status}, {time.perf_counter() - begun:.2f} s")
    finally:
        for fd in fds:
            os.close(fd)
        conn.close()
        with state.lock:
            state.busy = False
    return go_on


def _streams(conn: socket.socket) -> list[int]:
    """The client's standard streams, the three descriptors of its message after the answer
    (within :data:`RECEIVE` seconds); fewer (none) where it sent no such message."""
    try:
        conn.settimeout(RECEIVE)
        message, fds = client.receive(conn, fds=3)
        conn.settimeout(None)
    except (OSError, ValueError):
        return []
    if message is None or not message.get("streams") or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return []
    return fds


def _refusal(state: _State, request: dict) -> str | None:
    """Why a request must run in its own process, or None."""
    argv, env = request.get("argv"), request.get("env")
    if not (isinstance(argv, list) and argv and argv[0] in client.SERVED and all(isinstance(a, str) for a in argv)):
        return "not a command a server runs"
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        return "no environment"
    if not isinstance(request.get("cwd"), str) or not isinstance(request.get("umask"), int):
        return "no folder or umask"
    if request.get("code") != state.code:
        return "the package or Python differs from the server's (edited or reinstalled since it started)"
    differ = client.differences(state.env, env)
    if differ:
        return f"the environment differs from the server's start in {', '.join(differ[:8])}"
    theirs = request.get("identity")
    if not isinstance(theirs, dict):
        return "no identity"
    other = sorted(k for k in state.identity.keys() | theirs.keys() if state.identity.get(k) != theirs.get(k))
    if other:
        return f"the process differs from the server in {', '.join(other)} (groups, CPUs, priority, limits)"
    if not os.path.isdir(request["cwd"]) or not os.access(request["cwd"], os.X_OK):
        return "the server cannot enter the client's folder"
    return None


@contextmanager
def _client(request: dict, fds: list[int]):
    """The client's standard streams on descriptors 0–2 (line-buffered where a terminal), its
    folder, umask and per-run variables, and its start as the run's process start, for the
    duration; everything handed back afterwards, even where the run raised."""
    from chainexec.runtime import accounting

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    env = {n: v for n, v in os.environ.items() if client.per_run(n)}
    here = os.getcwd()
    mask = os.umask(0o077)
    os.umask(mask)
    try:
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=stream.isatty() or stream is sys.stderr)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        _set_per_run({n: v for n, v in request["env"].items() if client.per_run(n)})
        if isinstance(request.get("started"), (int, float)):
            accounting.STARTED.append(float(request["started"]))
        yield
    finally:
        accounting.STARTED.clear()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, target in zip(saved, (0, 1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=stream.isatty() or stream is sys.stderr)
        os.umask(mask)
        os.chdir(here)
        _set_per_run(env)


def _set_per_run(values: dict[str, str]) -> None:
    """Make the :func:`chainexec.client.per_run` variables of this process ``values``, changing
    only those that differ (the environment is shared with threads that may read it)."""
    for name in [n for n in os.environ if client.per_run(n) and n not in values]:
        del os.environ[name]
    for name, value in values.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _run(argv: list[str], returned) -> tuple[int, bool]:
    """The command's exit status as its own process would end with it, and whether the server
    may go on: not after an error the command let through (a defect), whose traceback the client
    gets as it would from its own process. ``returned()`` is called as soon as the command has
    returned (its outputs in place): a client stopped later no longer interrupts it (:func:`_watch`)."""
    from chainexec import cli, safepaths

    go_on = True
    try:
        try:
            status = cli.main(argv)
        finally:
            returned()
    except SystemExit as leave:  # argparse: -h (0), a bad argument (2)
        status = leave.code if isinstance(leave.code, int) else (0 if leave.code is None else 1)
    except KeyboardInterrupt:  # outside the command's own handler, which ends the process as this does
        os._exit(stopsignals.STATUS[stopsignals.stopping()])
    except Exception:
        try:
            traceback.print_exc()
        except OSError:  # a client that went away
            pass
        status, go_on = 1, False
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away
            pass
    safepaths.wait_removals()
    _release()
    return status, go_on


def _release() -> None:
    """Hand CuPy's pooled device and page-locked host blocks back, so that a server between runs
    holds only its context and kernels."""
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


def _watch(conn: socket.socket, done: int, gone) -> None:
    """Interrupt the main thread's run where the client goes away before it ends, after
    ``gone(number)`` (the server's log line: the run's own line goes to the client's standard
    error, which no one reads any more): the client sends nothing after its request but, when
    a signal stops it, that signal's number (:func:`chainexec.client._interrupted`), so the
    connection turning readable means it was stopped or closed. The run is interrupted as
    that signal (SIGINT where none came: a client killed at once) would interrupt it in its own
    process: the signal is sent to the main thread (:func:`_interrupt`). Returns without a
    signal once the descriptor ``done`` turns readable (the command has returned)."""
    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLHUP | select.POLLERR)
    poller.register(done, select.POLLIN)
    ready = {fd for fd, _ in poller.poll()}
    if done in ready:
        return
    number = signal.SIGINT
    try:
        conn.settimeout(STOP_NOTE)
        note, _ = client.receive(conn)
        if isinstance(note, dict) and note.get("signal") in stopsignals.STATUS:
            number = note["signal"]
    except (OSError, ValueError):
        pass
    gone(number)
    signal.pthread_kill(threading.main_thread().ident, number)  # to _interrupt, as the server's own


STOP_NOTE = 5.0
"""Seconds the server waits for a stopped client's note of its signal once it has begun to send."""


def _log(state: _State, line: str) -> None:
    """One line on the server's own standard error (descriptor 2 is a client's during a run)."""
    try:
        print(f"chainexec serve: {line}", file=state.log, flush=True)
    except (OSError, ValueError):  # the server's own standard error went away
        pass


def _answer(conn: socket.socket, message: dict) -> None:
    try:
        client.send(conn, message)
    except OSError:  # a client that went away: nothing to tell
        pass
