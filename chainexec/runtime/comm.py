"""The MPI world: one rank per GPU, or a single process when started without mpirun.

mpi4py initialises MPI on import; a process started without a launcher is a world of one rank
(MPI singleton init), so the same code path serves both.
"""

from __future__ import annotations

import os


def world():
    """COMM_WORLD (imported lazily so that planning never initialises MPI)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


LOCAL_RANK = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "PMI_LOCAL_RANK")
"""Where launchers (Open MPI, MPICH's Hydra, srun, PMI) say a rank's position on its node."""

LAUNCHER = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "SLURM_NTASKS", "MPI_LOCALNRANKS")
"""Variables a launcher sets in the processes it starts; a process without any is an MPI singleton."""


def launched() -> bool:
    """Whether a launcher started this process (one of :data:`LAUNCHER` is set), read without
    initialising MPI."""
    return any(var in os.environ for var in LAUNCHER)


def env_local_rank() -> int | None:
    """This rank's position on its node as the first of :data:`LOCAL_RANK` set to a number says,
    read without initialising MPI; None where none does."""
    for var in LOCAL_RANK:
        value = os.environ.get(var, "")
        if value.isascii() and value.isdigit():
            return int(value)
    return None


def local_rank(comm) -> int:
    """This rank's position among the ranks of its node (for binding a GPU): as the launcher says
    (:func:`env_local_rank`), else found through MPI."""
    local = env_local_rank()
    if local is not None:
        return local
    from mpi4py import MPI

    return comm.Split_type(MPI.COMM_TYPE_SHARED).rank


def local_size() -> int:
    """Ranks on this node as the launcher says (Open MPI, MPICH's Hydra, PMI), else 1: for sharing
    the node's CPUs among them where each sees all of them (srun binds each task to its own)."""
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return max(1, int(os.environ[var]))
    return 1
