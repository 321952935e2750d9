"""The MPI world (one rank per GPU, or a single process when started without mpirun) and its hosts.

mpi4py initialises MPI on import, and every use of MPI in the package goes through :func:`mpi`. A
process started without a launcher is a world of one rank (MPI singleton init), so the same code
path serves both; such a process starts MPI with :data:`SINGLETON`'s settings, where its
environment does not set them, so that Open MPI starts no daemon for it.

Hosts
-----
A host is the set of ranks that share memory (``MPI_COMM_TYPE_SHARED``): :func:`host_comm`. Every
path that relies on ranks sharing a host asks it, and nothing else: global arrays in shared memory
(:func:`chainexec.runtime.globalarray.shares_memory`), inputs mapped from their file and read
through one page cache (:mod:`chainexec.runtime.mapped`, where the executor maps), the GPU a rank
binds (:func:`local_rank`). With ``CHAINEXEC_SIMULATE_HOSTS=K`` (:data:`SIMULATE_HOSTS`) the ranks
of one machine act as ranks of K hosts: world rank r of P is on simulated host ``r * K // P``
(blocks of consecutive ranks, as srun and mpiexec place them by default), so none of those paths
crosses from one simulated host to another. The MPI library's own transport between them stays
shared memory; MPICH's ``MPIR_CVAR_NOLOCAL=1`` makes it the network's, and every rank a host of
its own (docs/gpu.md, "Several ranks").

Waiting
-------
MPI's blocking calls poll at full speed until they complete (MPICH and Open MPI alike): a rank
that waits seconds in a collective (for rank 0's plan, for the slowest rank at the end of a loop)
keeps a core busy that the ranks still working on the same host could use, its own I/O threads
among them, and on a host with fewer cores than ranks it slows them. The long waits go through
:func:`barrier` instead, which tests a non-blocking barrier and sleeps between tests: the
planning broadcast, the executor's barriers and those of the global arrays and the store.
"""

from __future__ import annotations

import fcntl
import os
import stat
import sys
import termios
import threading
import time
from typing import NoReturn

from chainexec.client import LAUNCHER
from chainexec.errors import ChainexecError


SINGLETON = {"OMPI_MCA_ess_singleton_isolated": "1"}
"""Open MPI's settings for the start of a process no launcher started (:func:`launched`): with no
launcher, its singleton start forks a daemon (``orted``) that a rank never uses unless it spawns
processes, which chainexec never does; that fork and the daemon's wire-up are a third of the MPI
start of a one-rank run. Other MPI libraries ignore these variables."""

STARTED = threading.Event()
"""Set once :func:`mpi` has started MPI in this process (:mod:`chainexec.stopsignals` waits for
it before a launched rank ends)."""


def mpi():
    """mpi4py's ``MPI`` module, MPI initialised by its first import. A process no launcher
    started takes the settings of :data:`SINGLETON` that its environment leaves unset (the
    user's own values win) for MPI's start only: they are removed once MPI has started, so the
    processes it starts later (a launcher among them) do not inherit them. Every module of the
    package imports MPI through this, never before it is needed: planning never initialises MPI.
    Once MPI has started (:data:`STARTED`), the module is returned as it is (the environment is
    left alone)."""
    started = sys.modules.get("mpi4py.MPI")
    if started is not None:
        return started
    added = [] if launched() else [name for name in SINGLETON if name not in os.environ]
    os.environ.update({name: SINGLETON[name] for name in added})
    try:
        from mpi4py import MPI
    finally:
        for name in added:
            os.environ.pop(name, None)
    STARTED.set()
    return MPI


def world():
    """COMM_WORLD (:func:`mpi`)."""
    return mpi().COMM_WORLD


WORLD_RANK = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
"""Where launchers (Open MPI, MPICH's Hydra and PMI, PMIx, srun) say a rank's number in the world."""

LOCAL_RANK = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "PMI_LOCAL_RANK")
"""Where launchers (Open MPI, MPICH's Hydra, srun, PMI) say a rank's position on its node."""


SIMULATE_HOSTS = "CHAINEXEC_SIMULATE_HOSTS"
"""The variable that splits one machine's ranks into simulated hosts (:func:`host_comm`)."""

_HOST: int | None = None  # attribute key of host_comm's answer on a communicator


def launched() -> bool:
    """Whether a launcher started this process (one of :data:`LAUNCHER` is set), read without
    initialising MPI."""
    return any(var in os.environ for var in LAUNCHER)


def env_rank() -> int | None:
    """This rank's number in the world as the first of :data:`WORLD_RANK` set to a number says,
    read without initialising MPI (from any thread); None where none does."""
    return _first_number(WORLD_RANK)


def _first_number(names) -> int | None:
    """The value of the first of the variables ``names`` set to a whole number; None if none is."""
    for var in names:
        value = os.environ.get(var, "")
        if value.isascii() and value.isdigit():
            return int(value)
    return None


def env_local_rank() -> int | None:
    """This rank's position on its node as the first of :data:`LOCAL_RANK` set to a number says,
    read without initialising MPI; None where none does, and under simulated hosts
    (:data:`SIMULATE_HOSTS` set), where the launcher's position counts the whole machine's ranks."""
    if os.environ.get(SIMULATE_HOSTS, ""):
        return None
    return _first_number(LOCAL_RANK)


def simulated_hosts() -> int:
    """The number of hosts :data:`SIMULATE_HOSTS` makes of one machine's ranks: 1 where it is
    unset or empty; a :class:`ChainexecError` (raised alike on every rank) unless it is a
    positive whole number."""
    value = os.environ.get(SIMULATE_HOSTS, "")
    if not value:
        return 1
    if not (value.isascii() and value.isdigit() and int(value) > 0):
        raise ChainexecError(f"{SIMULATE_HOSTS}={value[:20]!r} is not a positive whole number of hosts",
                             collective=True)
    return int(value)


def host_comm(comm):
    """The ranks of ``comm`` on this rank's host, in ``comm``'s order: those sharing memory with
    it, and of those, under :data:`SIMULATE_HOSTS` = K, the ones on its simulated host (world
    rank r of P on host ``r * K // P``). Collective over ``comm`` the first time; the answer is
    cached on ``comm`` as an MPI attribute and must not be freed."""
    MPI = mpi()
    global _HOST
    if _HOST is None:
        _HOST = MPI.Comm.Create_keyval()
    host = comm.Get_attr(_HOST)
    if host is None:
        hosts = simulated_hosts()
        host = comm.Split_type(MPI.COMM_TYPE_SHARED)
        if hosts > 1:
            everyone = MPI.COMM_WORLD
            node, host = host, host.Split(everyone.rank * hosts // everyone.size)
            node.Free()
        comm.Set_attr(_HOST, host)
    return host


def hosts(comm) -> int:
    """How many hosts (:func:`host_comm`) the ranks of ``comm`` are on (collective)."""
    return comm.allreduce(int(host_comm(comm).rank == 0))


SPIN_SECONDS = 1e-2
"""How long :func:`wait` tests a request back to back, yielding the core between tests, before it
starts to sleep between them (seconds). A barrier completes only once every rank has tested it
several times (its messages progress inside MPI calls alone): with naps that begin at once, ranks
that arrive within microseconds of each other leapfrog each other's naps, and each barrier costs
a sum of naps, a hundred times a blocking one's latency; a plan of a thousand small parallel loops
then spends seconds at barriers. Spinning this long keeps that latency near the blocking one and
costs a long wait 10 ms of a core; the yield lets a rank that shares the core with the waiter run
(more ranks than cores). ``benchmarks/results/INDEX.md`` has the measured latencies."""
NAP_SECONDS = (5e-5, 1e-3)
"""The first and the longest sleep between two tests of a request in :func:`wait` (seconds; each
nap twice the last): a long wait ends within a few naps of the last rank's arrival (a barrier of
P ranks progresses in about log2 P steps, each where its ranks test it)."""


def wait(request) -> None:
    """Complete the MPI ``request`` without keeping a core busy for long: tested back to back, the
    core yielded between tests, for :data:`SPIN_SECONDS`, then with sleeps of growing length
    (:data:`NAP_SECONDS`) between tests, each of which also lets MPI progress. Where ranks
    outnumber cores, the spin takes a share of them (a wait shorter than the spin costs its
    whole length of a core, given up to any process that is ready to run)."""
    start = time.perf_counter()
    while not request.Test():
        if time.perf_counter() - start > SPIN_SECONDS:
            break
        os.sched_yield()
    else:
        return
    nap = NAP_SECONDS[0]
    while not request.Test():
        time.sleep(nap)
        nap = min(2 * nap, NAP_SECONDS[1])


def barrier(comm) -> None:
    """``comm.Barrier()`` waiting as :func:`wait` does (a non-blocking barrier, tested)."""
    if comm.size > 1:
        wait(comm.Ibarrier())


def local_rank(comm) -> int:
    """This rank's position among the ranks of its host (for binding a GPU): as the launcher says
    (:func:`env_local_rank`), else its rank in :func:`host_comm` (collective then)."""
    local = env_local_rank()
    return local if local is not None else host_comm(comm).rank


def local_size() -> int:
    """Ranks on this node as the launcher says (Open MPI, MPICH's Hydra, PMI), else 1: for sharing
    the node's CPUs among them where each sees all of them (srun binds each task to its own)."""
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return max(1, int(os.environ[var]))
    return 1


def end(status: int) -> NoReturn:
    """End the process with ``status`` once its output is flushed and MPI, where this process
    started it, is finalized, without the interpreter's own exit: that frees CuPy's memory pools
    block by block, tears the CUDA context down and collects every module, work a GPU run that
    has nothing left to do waits for. By then a run has closed what it wrote and
    renamed its outputs into place, and its threads have ended or hold nothing that must finish
    (a kernel cache file is written whole or not at all). Through the interpreter's exit instead
    (mpi4py finalizes MPI there): a rank of several under an MPI whose finalize does not wait for
    every rank (:func:`fenced_finalize`), since one that leaves at once after its own finalize can
    fail peers still finalizing (under MPICH over UCX the launcher reports the run killed, status
    9); and a process under a profiler or coverage tracer, which writes its data at that exit.
    Ranks of several under Open MPI finalize and leave at once: the launcher waits for the
    slowest rank's exit, and the interpreter's is the longer by its teardown of CuPy and CUDA.
    Older outputs' folders that a run moved aside are removed before it ends, once the output is
    flushed (:func:`chainexec.safepaths.wait_removals`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a reader that went away, a stream already closed
            pass
    from chainexec import safepaths  # here: the program imports this module before it handles signals

    safepaths.wait_removals()
    mpi = sys.modules.get("mpi4py.MPI")
    started = mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()
    if (started and mpi.COMM_WORLD.Get_size() > 1 and not fenced_finalize(mpi)) or observed():
        sys.exit(status)
    if started:
        mpi.Finalize()
    os._exit(status)


HEARD_SECONDS = 2.0
"""How long :func:`abort` waits at most for the launcher to read this rank's stderr (seconds)."""


def abort(comm, status: int) -> NoReturn:
    """End every rank of ``comm``'s job with ``status`` (``MPI_Abort``) once the launcher has
    read what this rank wrote to stderr (:func:`heard`): its error line is the only account the
    user gets, and MPICH's Hydra, ending its proxies on an abort, drops what they have not yet
    read from the ranks' pipes (a 2-rank run whose ranks both refused an input then printed
    nothing at all)."""
    heard(sys.stderr, HEARD_SECONDS)
    comm.Abort(status)
    raise SystemExit(status) from None  # Abort may return before the launcher ends this process


def heard(stream, seconds: float) -> None:
    """Wait until the reader of ``stream`` (flushed first) has taken every byte this process
    wrote to it, for up to ``seconds``. Only a pipe tells (Linux's ``FIONREAD`` counts the bytes
    a pipe holds, from either end); a file or terminal holds nothing for a reader to take."""
    try:
        stream.flush()
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
        deadline = time.monotonic() + seconds
        while int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, bytes(4)), sys.byteorder) and time.monotonic() < deadline:
            time.sleep(1e-3)
    except (OSError, ValueError, AttributeError):  # a closed stream, one without a descriptor
        return


def fenced_finalize(mpi) -> bool:
    """Whether ``mpi`` (the module ``mpi4py.MPI``) is an MPI whose ``MPI_Finalize`` returns only
    once every rank has entered it, so that a rank may leave at once after it: Open MPI's, which
    opens its finalize with a PMIx fence, unless its parameter ``async_mpi_finalize`` is set in
    the environment (``OMPI_MCA_async_mpi_finalize``)."""
    flag = os.environ.get("OMPI_MCA_async_mpi_finalize", "0").strip().lower()
    return mpi.Get_library_version().startswith("Open MPI") and flag in ("0", "false", "no", "")


def observed() -> bool:
    """Whether a tracer or profiler watches this process: ``sys.settrace``/``setprofile``'s, or
    a tool registered with ``sys.monitoring`` (Python 3.12 on: cProfile and coverage use it)."""
    monitoring = getattr(sys, "monitoring", None)
    tools = [] if monitoring is None else [monitoring.get_tool(n) for n in range(6)]
    return sys.gettrace() is not None or sys.getprofile() is not None or any(t is not None for t in tools)
