"""SIGINT and SIGTERM end a chainexec process at once, from a thread that watches for them.

Why a thread: Python runs a signal's handler on the main thread between two bytecodes, so a
process whose main thread waits inside a call into C (an MPI collective whose peer has gone, a
device synchronisation, libcint) sees neither Ctrl-C nor a batch system's SIGTERM until that call
returns, if it ever does. The C handler Python installs for a signal with a handler writes the
signal's number to the wake-up descriptor (``signal.set_wakeup_fd``) at once, whatever the main
thread is doing; the watching thread reads it, writes one line and ends the process.

Which signals: SIGINT is Ctrl-C (MPICH's launcher forwards it to every rank). SIGTERM is what Open
MPI's launcher sends every rank when it is interrupted itself, what SLURM sends at a job's time
limit (SIGKILL follows after its ``KillWait``) and what ``scancel`` sends by default: without a
handler, each of these ended a rank silently.

When: from the ``chainexec`` program's first step on (:func:`starting`, before it imports its
modules), by a handler on the main thread; from :func:`watch` on, by the thread. A rank of a run
that a launcher started ends only once its MPI has started (:func:`_waits`): MPICH's launcher
takes a rank that ends with a status before its MPI's start for one that never takes part in the
job, and leaves the others waiting for it inside their own start, for ever (pmodels/mpich#6124);
a rank that ends after it with a status other than 0, or one ended by a signal other than SIGKILL
(which it takes for its own), ends the job. The other commands never start MPI: their ranks end
at once.

What the process leaves is what a killed one leaves: no output renamed into place, and the last
checkpoint of a run with ``--checkpoint``, from which the same command resumes; or, for a signal
that comes while a run lands its outputs, those renamed into place before it (:func:`landed`),
which the line names. The temporary files of files being replaced whole
(:func:`chainexec.atomicfile.replacing`: ``generate``'s inputs, the caches' files) are removed
first: their names hold a random part, and nothing else would remove them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
from collections.abc import Callable

from chainexec import atomicfile
from chainexec.runtime import comm

STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}
"""Exit status per signal: 128 + its number, as a shell reports a process it ended."""

NOTE = "no output was completed (a run with --checkpoint resumes from its last checkpoint)"

HOLD = 10.0
"""Seconds a signalled rank waits at most for its MPI's start before it ends (:func:`_waits`)."""

_LANDED: list[str] = []
"""The output files this process renamed into place complete (:func:`landed`)."""


_UNDO: list[Callable[[], None]] = []
"""What a signal undoes before the process ends (:func:`undone_on_stop`), innermost last."""


@contextlib.contextmanager
def undone_on_stop(undo: Callable[[], None]):
    """While the block runs, a watched signal calls ``undo`` (after the pending temporary files
    are removed) before it ends the process: what a command made that a failure would remove
    (``chem``'s folders and its inputs without their config) goes as it goes on an error."""
    _UNDO.append(undo)
    try:
        yield
    finally:
        _UNDO.remove(undo)


_SERVED: list[int] = []
"""The signal that stopped the client of the run this server process serves (:func:`served`)."""


def served(number: int) -> None:
    """Note that the client of the run this process serves was stopped by signal ``number``: the
    run is interrupted as that signal would interrupt it in its own process (:func:`stopping`)."""
    _SERVED[:] = [number]


def stopping() -> int:
    """The signal an interrupted run stops as: its served client's (:func:`served`), else SIGINT
    (Ctrl-C, the one signal Python turns into ``KeyboardInterrupt``)."""
    return _SERVED[0] if _SERVED else signal.SIGINT


def landed(path: str) -> None:
    """Note that output file ``path`` is in place, complete: a signal from now on says so."""
    _LANDED.append(str(path))


def forget_landed() -> None:
    """Forget the outputs noted so far (a process that runs several runs, a server's, at the
    start of each)."""
    _LANDED.clear()


def line(number: int, run: bool = True) -> str:
    """The one line a process ended by signal ``number`` writes to stderr: for a ``run``, what it
    completed before (no output, or the output files it had renamed into place); another command
    (``generate``, ``verify``, ``plan``: each file it writes appears whole or not at all) names
    the signal alone."""
    what = "interrupted" if number == signal.SIGINT else f"stopped by {signal.Signals(number).name}"
    if not run:
        return f"chainexec: {what}\n"
    if not _LANDED:
        return f"chainexec: {what}; {NOTE}\n"
    return (f"chainexec: {what} after it completed {', '.join(_LANDED)} (any other output of the run was not "
            "completed; a run with --checkpoint resumes from its last checkpoint)\n")


def speaks(command: str) -> bool:
    """Whether a process of ``command`` writes :func:`line`: all but the ranks other than 0 of a
    ``run``, so that a launcher's many ranks, each signalled, say it once."""
    return command != "run" or not comm.env_rank()


def starting(argv: list[str]) -> None:
    """The first step of the ``chainexec`` program (:func:`chainexec.client.command`, ``python -m
    chainexec.cli``), before it imports the rest: from here on SIGINT and SIGTERM end the process
    for the command ``argv`` names (its first word) with the line and status they give once
    :func:`watch` runs (``serve``, which is not watched: until it handles them itself). Why:
    until then Python's own handling applies, which ends a process during its imports and the
    parsing of its command line with a ``KeyboardInterrupt``'s traceback (SIGINT) or without a
    word (SIGTERM). The handler runs on the main thread, between two bytecodes: until
    :func:`watch`, the process makes no long call into C that would hold it back."""
    command = argv[0] if argv else ""
    handler = functools.partial(_started, speaks=speaks(command), run=command == "run")
    for number in STATUS:
        signal.signal(number, handler)


def _started(number, frame, speaks: bool, run: bool) -> None:
    """The handler :func:`starting` installs: :func:`_end`; where it :func:`_waits`, on a thread
    of its own, which waits for MPI's start while the main thread goes on to it."""
    if _waits(run):
        threading.Thread(target=_end, args=(number, speaks, run), name="chainexec-signals", daemon=True).start()
    else:
        _end(number, speaks, run)


def watch(speaks: bool = True, run: bool = True) -> None:
    """From now on, SIGINT and SIGTERM end this process at once with :data:`STATUS`, after
    :func:`line` (of a ``run`` or of another command) on stderr where ``speaks`` (rank 0 of a
    run, so that a launcher's many ranks say it once). Call from the main thread
    (``set_wakeup_fd`` is its alone), once per process."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    # the wake-up first: a signal between the two steps meets the handler before (starting's, or
    # Python's own), never _noted without a wake-up, which would lose it
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    for number in STATUS:
        signal.signal(number, _noted)
    threading.Thread(target=_watch, args=(read, speaks, run), name="chainexec-signals", daemon=True).start()


def _noted(number, frame) -> None:
    """The Python handler of a watched signal: nothing (its C handler has woken :func:`_watch`)."""


def _watch(descriptor: int, speaks: bool, run: bool) -> None:
    """Wait for a watched signal's number on ``descriptor``; then :func:`_end`."""
    while True:
        for number in os.read(descriptor, 64):
            if number in STATUS:
                _end(number, speaks, run)


_ENDING = threading.Lock()
"""Held by the :func:`_end` that ends the process: one line, whichever signals come."""


def _end(number: int, speaks: bool, run: bool) -> None:
    """End the process for signal ``number``, unless another call is ending it: :func:`line`
    where ``speaks``, the pending temporary files removed, what :func:`undone_on_stop` holds
    undone, then :data:`STATUS`. Written with ``os.write`` and ended with ``os._exit``: the main
    thread may hold ``sys.stderr``'s lock, and the interpreter's exit would wait for the run's
    threads. Where the process :func:`_waits`, it ends once its MPI has started, its line said
    before it waits (the other ranks, signalled too, may end as soon as theirs has started, and
    the launcher then ends this one); a rank whose MPI has not started within :data:`HOLD`
    seconds is ended by SIGALRM from a timer of the kernel's, which needs no interpreter lock:
    mpi4py starts MPI holding it, and a start that waits for a rank that never starts waits for
    ever (where SIGALRM is blocked, the rank ends by the signal itself a second later)."""
    if not _ENDING.acquire(blocking=False):
        return
    if speaks:
        os.write(2, line(number, run).encode())
    started = True
    if _waits(run):
        _default(signal.SIGALRM)
        signal.setitimer(signal.ITIMER_REAL, HOLD)
        started = comm.STARTED.wait(HOLD + 1.0)
        signal.setitimer(signal.ITIMER_REAL, 0)
    atomicfile.remove_pending()
    for undo in reversed(_UNDO):
        with contextlib.suppress(Exception):
            undo()
    if not started:
        _default(number)
        os.kill(os.getpid(), number)
    os._exit(STATUS[number])


def _default(number: int) -> None:
    """Put signal ``number``'s default action back (it ends the process), through the C library:
    ``signal.signal`` is the main thread's alone, and this runs on another. A rank a signal
    ended is a failed one to every launcher, also before its MPI has started; to MPICH's, one
    ended by SIGKILL is not (it takes it for one it killed itself)."""
    import ctypes

    ctypes.CDLL(None).signal(number, None)  # None: SIG_DFL


def _waits(run: bool) -> bool:
    """Whether this process, signalled, waits for its MPI's start before it ends: a rank of a
    ``run`` that a launcher started (:func:`chainexec.runtime.comm.launched`), whose MPI has not
    started yet (:data:`chainexec.runtime.comm.STARTED`); see the module's text for why."""
    return run and comm.launched() and not comm.STARTED.is_set()
