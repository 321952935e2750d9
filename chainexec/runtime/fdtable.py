"""The process's file-descriptor table, grown once at its start.

Why: Linux keeps a process's open files in a table of 64 slots at first and grows it when a new
descriptor does not fit (``expand_files``). Where the table is shared by several threads, growing it
waits for an RCU grace period (``synchronize_rcu``) so that no thread still reads the old table.
A (T) run's process passes 64 open descriptors in its first tiles (CUDA's device files, MPI's,
the inputs' files; Python's ``mmap`` duplicates each mapped file's descriptor), and the growth
then blocks the executor for a grace period (``synchronize_rcu`` < ``expand_files`` <
``alloc_fd`` < ``fcntl(F_DUPFD_CLOEXEC)``), milliseconds of waiting with no CPU time spent. The
table never shrinks, and growing it while the process still has one thread needs no grace period
at all; so the ``run`` command grows it first thing (:func:`reserve`), before NumPy's BLAS
threads, the warm-up or MPI start theirs. A run from Python (:func:`chainexec.api.run`) is left
as it is: there the process has threads already, and growing the table costs the same grace
period wherever it happens.
"""

from __future__ import annotations

import fcntl
import os
import resource

SLOTS = 1024
"""Descriptors the table is grown to hold (8 bytes each): more than a run opens on one rank,
CUDA's, MPI's and its inputs' together."""


def raise_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit and return the soft limit
    now (its largest count of open files; RLIM_INFINITY as it is): HDF5 holds a virtual
    dataset's source files open while it reads it, and a source it cannot open reads as the
    fill value, so an input over more files than the soft limit (often 1024) would read wrong
    (:func:`chainexec.datafiles.check_virtual` refuses one over more than this)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def reserve(slots: int = SLOTS) -> int:
    """Grow this process's descriptor table to at least ``slots`` entries (at most the soft
    ``RLIMIT_NOFILE``), by duplicating a descriptor onto the lowest free number at or above
    ``slots - 1`` and closing it again; no open descriptor is touched. Returns the table's size
    asked for (0 where the limit leaves nothing to grow). Cheap while the process has one thread:
    call it before any starts."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        slots = min(slots, soft)
    if slots <= 64:
        return 0
    try:
        source = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no /dev/null here: the table grows when the run needs it, as it would have
        return 0
    try:
        os.close(fcntl.fcntl(source, fcntl.F_DUPFD_CLOEXEC, slots - 1))
    except OSError:  # every number from slots - 1 up to the limit is open: the table is that large
        pass
    finally:
        os.close(source)
    return slots
