"""Where a plan's rates come from, and the calibrations kept per machine in the user's cache.

The rates (:class:`chainexec.planner.machine.Machine`) come from the first of:

1. ``--machine FILE`` (``plan``, ``run``);
2. ``$CHAINEXEC_MACHINE``: a machine file, or ``defaults`` for the built-in rates;
3. this machine's calibration in the cache folder ``$CHAINEXEC_CACHE`` (default
   ``~/.cache/chainexec/machines``): one machine file per machine, named by the host, the GPU model
   (``cpu`` for the NumPy backend) and a digest of those, the cores a rank may run on and the
   software versions (chainexec, NumPy, Python, and CuPy where it is used) and the rates a
   calibration fills (:data:`RATE_FIELDS`), so that a calibration serves only the machine, binding
   and software it measured, and one made before chainexec measured a new rate, or measured one another way, is made again. ``chainexec calibrate`` with no
   path refreshes it; where there is none (or it cannot be read), a quick calibration makes it
   on first use and says so in one line on stderr (:func:`announce`).

Each rate's origin is kept with the plan (:func:`record`).

The calibrations are not a :class:`chainexec.diskstore.Store`: their files are machine files
named for people (host and GPU model, then a digest), read with the machine file's own errors
(:func:`read`) and written by ``chainexec calibrate``, which
also writes them to paths outside the cache. They share the caches' folder
(:func:`chainexec.diskstore.folder`), the key's digest (:func:`chainexec.diskstore.digest`) and the
whole-file write (:mod:`chainexec.calibrate`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import re
from dataclasses import fields
from pathlib import Path

from chainexec import diskstore, userfiles
from chainexec.errors import ChainexecError, say
from chainexec.planner.machine import Machine

MACHINE = "CHAINEXEC_MACHINE"
"""The environment variable naming a machine file (or ``defaults``) where ``--machine`` is not given."""
CACHE = "CHAINEXEC_CACHE"
"""The environment variable naming the folder of calibrations."""
RATE_FIELDS = tuple(f.name for f in fields(Machine) if f.name != "source")
"""The fields of the machine model a plan records the origin of."""
MEASUREMENTS = 2
"""Version of what ``chainexec calibrate`` measures for those fields
(:mod:`chainexec.calibrate_worker`), raised when a measurement changes: a calibration made by
another version is made again. 2: the device bandwidth over a tile copied in six orders, the
mapped fetch over the fill's bytes, the cached writes over four stripes per thread."""


def cache_dir() -> Path:
    """The folder of calibrations (created by the first calibration kept there)."""
    return diskstore.folder("machines", CACHE)


def versions(gpu: bool) -> dict[str, str]:
    """The software a calibration's rates depend on: chainexec, NumPy, Python, and CuPy where
    ``gpu``, read from the modules: not from the package metadata, whose import would add to
    every run's start-up."""
    import numpy

    import chainexec

    found = {"chainexec": chainexec.__version__, "numpy": numpy.__version__, "python": platform.python_version()}
    if gpu:
        import cupy

        found["cupy"] = cupy.__version__
    return found


def identity(gpu: str | None) -> dict:
    """What a calibration is kept for: this host's name, the GPU model (``gpu``; None: the NumPy
    backend, ``cpu``), the cores this process may run on (a rank's host copies, fills and writes
    use a thread each: :func:`chainexec.runtime.hostcopy.threads`; a rank a launcher bound to
    fewer measures, and is kept, apart), :func:`versions`, the rates' names (:data:`RATE_FIELDS`:
    a calibration lacking a rate the model now prices is not used) and how they are measured
    (:data:`MEASUREMENTS`)."""
    from chainexec.runtime.hostcopy import threads

    return {"host": platform.node(), "gpu": gpu or "cpu", "cores": threads(), "versions": versions(gpu is not None),
            "rates": list(RATE_FIELDS), "measurements": MEASUREMENTS}


def path(ident: dict) -> Path:
    """The cache file of the calibration of ``ident`` (:func:`identity`): host and GPU model in
    the name for people, a digest of the whole identity for uniqueness."""
    digest = diskstore.digest(json.dumps(ident, sort_keys=True))[:16]
    readable = "_".join(re.sub(r"[^A-Za-z0-9.-]+", "-", ident[key])[:40] for key in ("host", "gpu"))
    return cache_dir() / f"{readable}_{digest}.json"


def record(machine: Machine, given: frozenset[str], origin: str, detail: str) -> dict[str, dict]:
    """Each rate of ``machine`` with where it came from: ``origin`` and ``detail`` for the fields
    in ``given``, the built-in defaults for the others."""
    return {name: {"value": getattr(machine, name), "from": origin if name in given else "defaults",
                   "detail": detail if name in given else "built-in"} for name in RATE_FIELDS}


def read(path: str | Path) -> tuple[Machine, frozenset[str]]:
    """The machine of the machine file ``path`` and the fields it gives
    (:meth:`~chainexec.planner.machine.Machine.parse`); a file that cannot be read or is not
    UTF-8 text is a :class:`ChainexecError` naming it."""
    return Machine.parse(userfiles.read(path, "machine file"), str(path))


def load(path: str | Path) -> Machine:
    """The machine of the machine file ``path`` (:func:`read`)."""
    return read(path)[0]


def named_file(machine: str | None) -> str | None:
    """The machine file :func:`named` reads: ``machine`` (``--machine``), else the one
    ``$CHAINEXEC_MACHINE`` names; None where neither names one."""
    chosen = machine if machine is not None else os.environ.get(MACHINE)
    return chosen if chosen and (machine is not None or chosen != "defaults") else None


def named(machine: str | None) -> tuple[Machine, dict] | None:
    """The rates of ``machine`` (``--machine``) or ``$CHAINEXEC_MACHINE`` with their :func:`record`;
    None where neither names them (the cache's calibration serves)."""
    if machine is not None:
        found, given = read(machine)
        return found, record(found, given, "machine file", machine)
    chosen = os.environ.get(MACHINE)
    if not chosen:
        return None
    if chosen == "defaults":
        return Machine(), record(Machine(), frozenset(RATE_FIELDS), "defaults", f"${MACHINE}=defaults")
    found, given = read(chosen)
    return found, record(found, given, "machine file", f"{chosen} (${MACHINE})")


def cached(ident: dict) -> tuple[Machine, dict] | None:
    """The calibration of ``ident`` in the cache with its :func:`record`; None where there is none
    or it cannot be read (a calibration then replaces it)."""
    where = path(ident)
    try:
        found, given = read(where)
    except ChainexecError:
        return None
    return found, record(found, given, "calibration cache", str(where))


@contextlib.contextmanager
def held(ident: dict):
    """Hold the first-use calibration of ``ident`` for this process (an exclusive lock on
    ``<file>.lock`` beside its file, the folder made): processes that meet no calibration at the
    same time (a job array's first runs on a fresh node) measure one after another, and the
    ones after the first find its calibration (:func:`cached`, asked again inside) instead of
    measuring while loading each other, each keeping other rates. Released when the process
    ends, however it ends. A lock that cannot be opened (a folder there, another user's lock in a
    shared cache) is a :class:`ChainexecError` naming it."""
    lock = path(ident).with_name(path(ident).name + ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:  # a folder there, another user's lock in a shared cache
        raise ChainexecError(f"cannot open the calibration lock ({err.strerror or err}): give a machine file "
                             f"(--machine) or set ${CACHE} to a folder of your own", str(lock)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def announce(ident: dict) -> None:
    """Say on stderr, in one line, that this machine has no calibration yet and a quick one is
    made now."""
    where = path(ident)
    say(f"chainexec: no calibration of {ident['host']} ({ident['gpu']}) for this software in {where.parent}: "
        f"measuring a quick one (up to 10 s) into {where.name}; `chainexec calibrate` refreshes it")
