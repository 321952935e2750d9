"""A rank's watch over its own progress (``run --stall-timeout SECONDS``).

A rank that hangs (a device that stopped answering, a file system that stopped serving a read)
does not fail: its peers wait for it at their next barrier, counter or one-sided operation, and
the job holds its nodes until the batch system's time limit. A launcher that ends the others
when one rank fails (``srun --kill-on-bad-exit``, ``mpiexec``) sees nothing fail.

Every rank of a run with a stall timeout watches itself from a thread of its own: where the
executor has finished no statement for that many seconds, the rank is stalled or waits for one
that is. It then says so in one line and ends the whole run (``MPI_Abort``) with status
:data:`STALLED`; the launcher ends the other ranks, the stalled one among them. A run with
``--checkpoint`` goes on from its last checkpoint when run again, as after any other failure.

The timeout must exceed the longest a rank of a healthy run goes without finishing a statement,
or the run ends: its own longest statement (one load of a large tile from a slow file system;
the first call of a kernel, which compiles and tunes it), a checkpoint's commit, and its waits
for the other ranks, at a parallel loop's end for their last tiles (with ``--balance static``
the loop's whole imbalance) or at a barrier for their long statements. The watch runs from the
plan's arrival on every rank (rank 0's planning, which the others wait for, is not watched)
through the backend's start, the outputs' folders and the executor's nests; the cleaning up
after the last nest, a checkpoint's stop or a failure is not watched. Time in which the watch
itself cannot run does not count: a rank stopped (SIGSTOP) and continued later, as Open MPI
continues a stopped rank before it ends it and as a job goes on after Ctrl-Z and ``fg``, does not
say it stalled. A run that ``chainexec serve`` runs ends the server with it (its client says the
server ended during the run, status 1).

``MPI_Abort`` is called from the watch's thread while the main thread may be inside MPI: where
the MPI library gives less than ``MPI_THREAD_MULTIPLE``, the rank ends alone (``os._exit``) and
the launcher ends the others (``srun --kill-on-bad-exit``, ``mpiexec``).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time

from chainexec.errors import ChainexecError, say

STALLED = 4
"""Exit status of a run ended because a rank finished no statement within its stall timeout."""


def check_timeout(seconds: float | None) -> None:
    """Refuse a stall timeout that is not a positive finite number of seconds (None: no watch)."""
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise ChainexecError(f"--stall-timeout must be a positive number of seconds, not {seconds:g}")


class Watchdog:
    """The watch of one rank: :meth:`beat` after every statement; between :meth:`start` and
    :meth:`stop` a daemon thread looks at the time since the last beat every ``seconds / 8``
    (within 10 ms and 10 s) and, past ``seconds``, ends the run (:meth:`stalled`). Where two looks
    are more than two periods apart, the thread itself did not run for the excess (its process was
    stopped), and the excess does not count as time without a beat (where no beat came between
    them). With ``seconds`` None nothing is watched and :meth:`beat` only notes the time."""

    def __init__(self, seconds: float | None, comm, clock=time.monotonic):
        check_timeout(seconds)
        self.seconds = seconds
        self.comm = comm
        self.clock = clock
        self.last = clock()
        self.done = "none yet"  # the name of the last statement finished
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, done: str) -> None:
        """A statement named ``done`` has finished on this rank."""
        self.last = self.clock()
        self.done = done

    def start(self) -> None:
        """Begin watching (from now: the time before counts as progress)."""
        self.last = self.clock()
        if self.seconds is not None and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="chainexec-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop watching; the thread has ended when this returns."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def idle(self) -> float:
        """Seconds since the last beat."""
        return self.clock() - self.last

    def _watch(self) -> None:
        period = min(max(self.seconds / 8, 0.01), 10.0)
        looked = self.clock()
        while not self._stop.wait(period):
            now = self.clock()
            # Time in which this thread could not look (the process stopped by SIGSTOP and
            # continued, as Open MPI continues a stopped rank before it ends it, or its host
            # suspended) is no stall of this rank's statements: it does not count, unless a beat
            # has come since the last look (then the time since that beat is all that counts).
            excess = now - looked - 2 * period
            if excess > 0 and self.last <= looked:
                self.last += excess
            looked = now
            if self.idle() > self.seconds:
                self.stalled()

    def message(self) -> str:
        """The line a stalled rank prints."""
        return (f"chainexec: rank {self.comm.rank} has finished no statement for {self.idle():.0f} s "
                f"(--stall-timeout {self.seconds:g}; the last one finished: {self.done}): a rank is stalled, or "
                f"this one waits for one that is; the run ends here with status {STALLED} instead of holding its "
                "nodes until the time limit (run again: with --checkpoint it goes on from its last checkpoint)")

    def stalled(self) -> None:
        """Say :meth:`message` and end every rank (``MPI_Abort``, where the MPI library allows
        calls from several threads at once); this process ends with :data:`STALLED` even where
        ``MPI_Abort`` returns (a single rank's) or is not called."""
        from chainexec.runtime import comm as comm_mod

        try:
            say(self.message())
            mpi = comm_mod.mpi()
            if mpi.Query_thread() == mpi.THREAD_MULTIPLE:
                comm_mod.abort(self.comm, STALLED)
            comm_mod.heard(sys.stderr, comm_mod.HEARD_SECONDS)
        finally:
            os._exit(STALLED)
