"""Memory limits read from the machine, for a config whose ``machine:`` section leaves them out.

Each rank reads its own figures (:func:`here`): its host's name, how many of the run's ranks share
that host, the host memory available, and, where the run's backend is CuPy, the model and the free
memory of its GPU. Rank 0 gathers every rank's figures (:func:`gather`) and plans for all ranks
with the limits :func:`limits` derives from them; ``chainexec plan`` (no MPI) assumes all its
``--ranks`` on this host (:func:`local`).

What is read, and where from:

- host memory: ``MemAvailable`` of ``/proc/meminfo`` (what the kernel can hand out without
  swapping), else the free pages ``os.sysconf`` counts; capped by the memory cgroups of the
  process (a batch job's or a container's limit, :func:`cgroup_room`). The environment variable
  ``CHAINEXEC_HOST_MEMORY`` (a size, ``8GiB``) replaces the reading: a share of a node that others
  use too, or a test's host;
- GPU memory: the free bytes CUDA reports for the rank's device (``cudaMemGetInfo`` through CuPy,
  imported only where the backend is CuPy or ``auto``); the device is the one the backend takes
  (local rank modulo the host's GPUs).

No reading costs more than a file read or two, except CuPy's import and the device's context,
which a CuPy run makes anyway.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, replace
from pathlib import Path

from chainexec.errors import ChainexecError
from chainexec.runtime import warmup
from chainexec.spec import format_size, parse_size

HOST_MEMORY = "CHAINEXEC_HOST_MEMORY"
"""The environment variable that replaces the host memory read from the system (a size)."""

# Device memory CUDA reports free that a run cannot plan its buffers into: the modules of
# generated kernels, cuBLAS's and cuTENSOR's workspaces (one per stream), and the memory pool's
# rounding of blocks and its fragmentation, which grows with the buffers. Kept aside: 1 GiB, or
# 1/16 of the free memory where that is more (8.7 GiB of 139 GiB free).
GPU_RESERVE = 1 << 30
GPU_RESERVE_SHARE = 1 / 16
# Host memory a run needs beside the global array (and, on NumPy, the device buffers): the
# interpreter and its imports, MPI's and HDF5's buffers, the page-locked upload buffers of a GPU
# run, the contractions' temporaries on NumPy, and the page cache that keeps inputs mapped.
# Kept aside: 1 GiB, or 1/8 of the available memory where that is more.
HOST_RESERVE = 1 << 30
HOST_RESERVE_SHARE = 1 / 8
# With the NumPy backend the device level is host memory too: the global array and the ranks'
# device buffers share what is left, half each.
NUMPY_DEVICE_SHARE = 1 / 2


@dataclass(frozen=True)
class Figures:
    """What one rank reads about its machine. ``host``: the host's name; ``host_ranks``: the
    run's ranks on that host; ``host_memory``: bytes of host memory available, as
    ``host_memory_from`` says it was read; with the CuPy backend ``gpu`` (the model),
    ``gpus`` (devices on the host), ``gpu_index`` (the rank's) and ``gpu_free`` (bytes free on it)."""

    host: str
    host_ranks: int
    host_memory: int
    host_memory_from: str
    gpu: str | None = None
    gpus: int = 0
    gpu_index: int | None = None
    gpu_free: int | None = None


@dataclass(frozen=True)
class Limit:
    """A memory limit in bytes and where it came from: ``origin`` ``config`` or ``detected``,
    ``detail`` the config's file and line or the figures and reserves it was derived from."""

    bytes: int
    origin: str
    detail: str


def host_memory(meminfo: Path = Path("/proc/meminfo"), cgroups: Path = Path("/sys/fs/cgroup"),
                own: Path = Path("/proc/self/cgroup")) -> tuple[int, str]:
    """Bytes of host memory available to this process and where the figure comes from
    (module docstring); a ``CHAINEXEC_HOST_MEMORY`` that is not a size is a :class:`ChainexecError`."""
    given = os.environ.get(HOST_MEMORY)
    if given is not None:
        try:
            return parse_size(given, f"${HOST_MEMORY}"), f"${HOST_MEMORY}"
        except ValueError as err:
            raise ChainexecError(str(err)) from None
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        available, where = int(fields["MemAvailable"].split()[0]) * 1024, f"{meminfo} MemAvailable"
    except (OSError, KeyError, ValueError, IndexError):
        available, where = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages (os.sysconf)"
    room = cgroup_room(cgroups, own)
    if room is not None and room < available:
        return max(room, 0), "the memory cgroup's limit less its use"
    return available, where


def write_cache(meminfo: Path = Path("/proc/meminfo"), vm: Path = Path("/proc/sys/vm")) -> tuple[int, str]:
    """Bytes of writes this host's page cache holds before the kernel makes writers wait for the
    disk, and where the figure comes from: ``vm.dirty_bytes`` where set, else ``vm.dirty_ratio``
    percent of the memory available (:func:`host_memory`: about what the kernel counts as
    dirtyable); 0 where neither can be read."""
    try:
        given = int((vm / "dirty_bytes").read_text())
        if given:
            return given, f"{vm}/dirty_bytes"
        ratio = int((vm / "dirty_ratio").read_text())
    except (OSError, ValueError):
        return 0, "no dirty-page limit readable"
    available, where = host_memory(meminfo)
    return available * ratio // 100, f"{vm}/dirty_ratio {ratio} % of {where}"


def cgroup_room(root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes the memory cgroups of this process leave it: for each limited cgroup (cgroup v2's
    ``memory.max``, v1's ``memory.limit_in_bytes``), from the process's own up to the hierarchy's
    root as mounted here, its limit less its use plus the page cache's file pages, which the
    kernel reclaims before it fails an allocation (``inactive_file`` and ``active_file``, as
    ``MemAvailable`` counts them outside a cgroup); the smallest of those, or None where no cgroup
    limits memory. Without the active pages the room would shrink by a run's inputs once they are
    read twice (pages read again move to the active list): the limits detected, and with them the
    plan cache's key, would change between a job's second and third runs."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0":
            base, names = root, ("memory.max", "memory.current", ("inactive_file", "active_file"))
        elif "memory" in controllers.split(","):
            base, names = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                            ("total_inactive_file", "total_active_file"))
        else:
            continue
        folder = base / path.strip("/")
        for level in (folder, *[p for p in folder.parents if p.is_relative_to(base)]):
            room = _room(level, *names)
            if room is not None:
                rooms.append(room)
    return min(rooms) if rooms else None


def _room(folder: Path, limit_file: str, usage_file: str, file_keys: tuple[str, ...]) -> int | None:
    """One cgroup's limit less its use plus its file pages (``memory.stat``'s ``file_keys``); None
    where it sets no limit (``max``, or v1's page-rounded 2^63 - 1) or its files cannot be read."""
    try:
        limit = (folder / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= 1 << 62:
            return None
        usage = int((folder / usage_file).read_text())
        stats = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
        return int(limit) - usage + sum(int(stats.get(key, 0)) for key in file_keys)
    except (OSError, ValueError):
        return None


def gpu_module(backend: str):
    """CuPy where the backend ``backend`` (``auto``, ``numpy``, ``cupy``) will run on a GPU, with
    the number of devices this process sees; None for NumPy. Mirrors
    :func:`chainexec.runtime.device.select`'s choice without taking a device."""
    if backend == "numpy":
        return None
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # no cupy, no driver, no device: all mean "no GPU here"
        if backend == "cupy":
            raise ChainexecError(f"backend cupy is not usable here: {err}") from None
        return None
    if count > 0:
        return cupy, count
    if backend == "cupy":
        raise ChainexecError("backend cupy is not usable here: no GPU")
    return None


def gpu_name(backend: str, local_rank: int = 0) -> str | None:
    """The model of the GPU a rank at ``local_rank`` takes with ``backend``; None for NumPy."""
    found = gpu_module(backend)
    if found is None:
        return None
    from chainexec.runtime.uselog import device_name

    cupy, count = found
    return device_name(cupy, local_rank % count)


def here(backend: str, local_rank: int, host_ranks: int, host: str | None = None) -> Figures:
    """This rank's :class:`Figures`: ``local_rank`` is its position among the ``host_ranks``
    ranks of its host, ``host`` the host's name (default: the node name). A GPU's free memory is
    the figure the run's warm-up read as it made the context (:func:`chainexec.runtime.warmup.free_memory`),
    where it did, else the device's answer now."""
    memory, where = host_memory()
    name = host or platform.node()
    model = gpu_name(backend, local_rank)
    if model is None:
        return Figures(name, host_ranks, memory, where)
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    index = local_rank % count
    free = warmup.free_memory(index)
    if free is None:
        with cupy.cuda.Device(index):
            free, _ = cupy.cuda.runtime.memGetInfo()
    return Figures(name, host_ranks, memory, where, model, count, index, free)


def local(backend: str, ranks: int) -> list[Figures]:
    """The figures of ``ranks`` ranks all on this host, for planning without MPI: this process's,
    each rank on the GPU its local rank takes (their free memory taken to be this one's)."""
    mine = here(backend, 0, ranks)
    alike = [mine] if mine.gpu is None else [replace(mine, gpu_index=g) for g in range(mine.gpus)]
    return [alike[r % len(alike)] for r in range(ranks)]


def gather(comm, backend: str) -> list[Figures | str] | None:
    """Every rank's :class:`Figures` on rank 0 (None on the others), read at once (collective):
    ranks per host from a split of ``comm`` by shared memory, the host's name from MPI. A rank
    that cannot read its figures sends its error's text instead."""
    from chainexec.runtime.comm import local_rank, mpi

    MPI = mpi()
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        mine = here(backend, local_rank(comm), shared.size, MPI.Get_processor_name())
    except Exception as err:  # sent to rank 0, which ends every rank with it
        mine = f"rank {comm.rank}: {err}" if isinstance(err, ChainexecError) else \
            f"rank {comm.rank} could not read its machine ({type(err).__name__}: {err})"
    finally:
        shared.Free()
    return comm.gather(mine, root=0)


def rounded(nbytes: int) -> int:
    """``nbytes`` rounded down to a multiple of 1/16 of the largest power of two not above it
    (at most 6.25 % less): free memory wanders a little from run to run, and a detected limit that
    stays the same keeps the plan cache's key (:mod:`chainexec.plancache`)."""
    step = 1 << max(nbytes.bit_length() - 5, 0)
    return nbytes - nbytes % step


def _reserve(nbytes: int, least: int, share: float) -> int:
    return max(least, int(nbytes * share))


def limits(figures: list[Figures], missing: tuple[str, ...] = ("global", "device")) -> dict[str, Limit]:
    """The ``missing`` limits (``global``, ``device``) of a run whose ranks read ``figures``.

    - device memory per rank: on a GPU, its free memory less :data:`GPU_RESERVE` (or
      :data:`GPU_RESERVE_SHARE`), shared by the ranks on that GPU; on NumPy,
      :data:`NUMPY_DEVICE_SHARE` of the host's usable memory (available less
      :data:`HOST_RESERVE`, or :data:`HOST_RESERVE_SHARE`) shared by the host's ranks; the
      least over all ranks, since the plan gives every rank the same limit;
    - global memory, all ranks together: the global array lies evenly over the ranks, so a host
      running ``r`` of ``P`` ranks holds ``r/P`` of it; the limit is the largest array every host
      holds its part of in its usable memory (less the device share on NumPy): the sum of the
      hosts' memory where the hosts and their rank counts are alike. Each host is counted once
      however many ranks it runs.

    Each limit is :func:`rounded`. Raises :class:`ChainexecError` where a host or GPU has no more
    memory than its reserve."""
    hosts = {f.host: f for f in figures}
    usable = {}
    for name, f in hosts.items():
        usable[name] = f.host_memory - _reserve(f.host_memory, HOST_RESERVE, HOST_RESERVE_SHARE)
        if usable[name] <= 0:
            raise ChainexecError(f"host {name} has {format_size(f.host_memory)} of memory available "
                                 f"({f.host_memory_from}), no more than the {format_size(HOST_RESERVE)} a run keeps "
                                 "aside: free memory or give machine.global_memory and machine.device_memory in the config")
    numpy_hosts = {f.host for f in figures if f.gpu is None}
    found = {}
    if "device" in missing:
        found["device"] = _device(figures, usable)
    if "global" in missing:
        ranks = len(figures)
        share = {name: usable[name] * (1 - NUMPY_DEVICE_SHARE if name in numpy_hosts else 1) for name in hosts}
        total, name = min((int(share[name] * ranks / hosts[name].host_ranks), name) for name in hosts)
        f = hosts[name]
        detail = (f"{format_size(f.host_memory)} host memory available ({f.host_memory_from}) on {name}, less a "
                  f"reserve of {format_size(f.host_memory - usable[name])}"
                  + (", half for the device level (NumPy)" if name in numpy_hosts else "")
                  + (f"; {f.host_ranks} of {ranks} ranks on it, {len(hosts)} hosts" if len(hosts) > 1 else ""))
        found["global"] = Limit(rounded(total), "detected", detail)
    return found


def _device(figures: list[Figures], usable: dict[str, int]) -> Limit:
    """The device limit of :func:`limits`: the least rank's share, and how it was derived."""
    sharing: dict[tuple, int] = {}
    for f in figures:
        if f.gpu is not None:
            sharing[f.host, f.gpu_index] = sharing.get((f.host, f.gpu_index), 0) + 1
    shares = []
    for f in dict.fromkeys(figures):  # ranks alike (a plan's for many on one host) have one share
        if f.gpu is None:
            share = int(usable[f.host] * NUMPY_DEVICE_SHARE) // f.host_ranks
            detail = (f"{format_size(f.host_memory)} host memory available ({f.host_memory_from}) on {f.host}, less "
                      f"a reserve of {format_size(f.host_memory - usable[f.host])}, half for the device level "
                      f"(NumPy), shared by {f.host_ranks} rank{'s' * (f.host_ranks > 1)}")
        else:
            reserve = _reserve(f.gpu_free, GPU_RESERVE, GPU_RESERVE_SHARE)
            if f.gpu_free <= reserve:
                raise ChainexecError(f"GPU {f.gpu_index} ({f.gpu}) of host {f.host} has {format_size(f.gpu_free)} free, "
                                     f"no more than the {format_size(reserve)} a run keeps aside: free it or give "
                                     "machine.device_memory in the config")
            ranks = sharing[f.host, f.gpu_index]
            share = (f.gpu_free - reserve) // ranks
            detail = (f"{format_size(f.gpu_free)} free on GPU {f.gpu_index} ({f.gpu}) of {f.host}, less a reserve of "
                      f"{format_size(reserve)}" + (f", shared by {ranks} ranks" if ranks > 1 else ""))
        shares.append((share, detail))
    share, detail = min(shares)
    if len({s for s, _ in shares}) > 1:
        detail += f" (the least of {len(figures)} ranks)"
    return Limit(rounded(share), "detected", detail)
