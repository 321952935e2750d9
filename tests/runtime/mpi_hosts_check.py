"""Hosts as :func:`chainexec.runtime.comm.host_comm` finds them, on however many ranks it is
launched with: under ``CHAINEXEC_SIMULATE_HOSTS=K`` world rank r of P is on host ``r * K // P``
(every rank on one host where K is unset; every rank a host of its own under ``--own``, MPICH's
``MPIR_CVAR_NOLOCAL=1``). Checks that each rank's host holds exactly the ranks expected, in
world order, that :func:`hosts` counts them and :func:`local_rank` is the position in them
(where the launcher's local rank does not say it), and
that a :class:`GlobalArray` over every subset of two or more ranks is in shared memory exactly
where the subset lies on one host (no other rank's block at hand otherwise). Exits 0 after rank
0 prints ``OK``; a failure prints its traceback and aborts all ranks.

Usage: ``mpiexec -n N python mpi_hosts_check.py [--own]`` (tests/runtime/test_hosts.py).
"""

import itertools
import os
import sys
import traceback

import numpy as np
from mpi4py import MPI

from chainexec.runtime import comm as hostcomm
from chainexec.runtime.globalarray import GlobalArray, shares_memory


def expected_host(rank: int, size: int) -> int:
    if "--own" in sys.argv:
        return rank
    k = int(os.environ.get("CHAINEXEC_SIMULATE_HOSTS") or 1)
    return rank * k // size


def main():
    world = MPI.COMM_WORLD
    mine = [r for r in range(world.size) if expected_host(r, world.size) == expected_host(world.rank, world.size)]
    host = hostcomm.host_comm(world)
    assert host is hostcomm.host_comm(world)  # cached on the communicator
    assert host.allgather(world.rank) == mine, (world.rank, host.allgather(world.rank), mine)
    assert hostcomm.hosts(world) == len({expected_host(r, world.size) for r in range(world.size)})
    # the position in the host, as the launcher says it where it can (not of simulated hosts, and
    # not of MPICH's NOLOCAL view: the launcher's is of the machine's ranks then)
    launcher = hostcomm.env_local_rank()
    assert launcher is None or not os.environ.get("CHAINEXEC_SIMULATE_HOSTS")
    assert hostcomm.local_rank(world) == (mine.index(world.rank) if launcher is None else launcher)
    assert shares_memory(world) == (world.size > 1 and len(mine) == world.size)
    for size in range(2, world.size + 1):
        for members in itertools.combinations(range(world.size), size):
            inside = world.rank in members
            sub = world.Split(0 if inside else MPI.UNDEFINED, world.rank)
            if not inside:
                continue
            one_host = len({expected_host(r, world.size) for r in members}) == 1
            ga = GlobalArray(sub, (2 * size, 3), np.float64)
            assert ga.shared == one_host and shares_memory(sub) == one_host, (members, ga.shared)
            others = [ga.block(r) for r in range(size) if r != sub.rank]
            assert all(b is not None for b in others) if one_host else all(b is None for b in others)
            ga.free()
            sub.Free()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(1)
        sys.exit(1)
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.rank == 0:
        print("OK")
