"""``chainexec calibrate``: measure this machine's bandwidths and flop rate into a machine file.

The planner turns predicted bytes and flops into seconds with a :class:`Machine` (bytes/s per rank
for disk reads and writes and for global↔device movement, flop/s per rank for compute). Its
defaults are guesses; this module measures them, under the conditions of a run: ``ranks`` MPI
ranks (``mpiexec -n ranks``, see :mod:`chainexec.calibrate_worker`) on this node, all measuring at
once, so that each rate is one rank's share while the others work too.

- disk write: h5py writes a contiguous float64 dataset and fsyncs it (each rank its own file);
  and as a run's store writes a block (stripes in files of their own, over threads), nothing
  synced: the rate at which the page cache takes writes, up to the host's dirty-page limit
  (``vm.dirty_bytes``, else ``vm.dirty_ratio`` of the memory available), shared by the ranks;
- disk read: the file's bytes past the page cache (O_DIRECT, else posix_fadvise DONTNEED);
- global→device: a GlobalArray ``get`` of a block owned by another rank; on a GPU then a copy from
  pinned host memory to the device, the two combined as consecutive steps (seconds per byte add);
- device→global: device→pinned host copy (GPU only), then a GlobalArray ``accumulate``, which is
  how the executor returns device tiles;
- compute: the backend's float64 GEMM (numpy.matmul or cupy.matmul), 2·n³ flops per call;
- device bandwidth: one device buffer copied into another (bytes read + written), the rate at
  which a compute statement streams its tiles;
- seconds per statement and per transfer call: the executor on a product in tiny tiles, its
  wall seconds outside the transfer levels per compute statement (its fixed cost per statement),
  and each transfer level's seconds beyond its bytes' per call (per get or accumulate, per load
  or store).

Every rate is the median over repetitions of (bytes or flops of one rank) / (seconds of the
slowest rank in that repetition). The file holds the :class:`Machine` fields plus a ``details``
object (raw samples, methods, sizes, units) that :meth:`Machine.parse` ignores.

How much is measured is a :class:`Profile`: :data:`FULL`, or :data:`QUICK` (seconds), what a plan
or run measures on first use into the cache of calibrations (:mod:`chainexec.machinecache`): a
plan through :func:`calibrate`, a run on its own ranks (:func:`in_process`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chainexec import atomicfile, detect, diskstore, machinecache
from chainexec.errors import ChainexecError
from chainexec.planner.machine import Machine
from chainexec.spec import parse_size

@dataclasses.dataclass(frozen=True)
class Profile:
    """How much a calibration measures: ``size`` bytes per rank per repetition for the disk and
    global-array measurements, ``repetitions`` timed calls of each, the GEMM
    matrix order per backend (``gemm_n``), the extent of each index of the matrix product
    whose tiny tiles measure the seconds per statement (``statement_n``: n³/128 statements),
    the bytes of the device copy (``copy_size``: a GPU copies 32 MiB in about as long as the
    clock takes to start and stop; a copy of 256 MiB is long against them), and the 16 MiB
    stripes per thread of the cached writes (``stripes``: each thread's file is made and closed
    once per write, fixed costs that one stripe each does not spread thin)."""

    size: int
    repetitions: int
    gemm_n: dict
    statement_n: int = 48
    copy_size: int = 256 << 20
    stripes: int = 4


# 256 MiB is far past disk and RDMA latencies and the caches, yet quick on a node. GEMM orders are
# large enough for the BLAS to reach its full rate, small enough for well under a second per call
# (three 32 MiB matrices at n = 2048, three 8 MiB at 1024).
FULL = Profile(256 << 20, 5, {"cupy": 2048, "numpy": 1024})
# The quick calibration a plan or run makes on first use (and `--quick`): at most 10 s with the
# launch (most of it the launch, imports and fixed costs, which TINY pays too), with the full GEMM
# order, since a small GEMM misses the BLAS's rate (order 256 reaches a small fraction of it).
# Its statements are an eighth of the full profile's (144 a run): the
# seconds per statement are a mean over many alike, and the executor runs are most of a quick
# calibration's own time.
QUICK = Profile(32 << 20, 3, FULL.gemm_n, 24)
# What QUICK becomes where $CHAINEXEC_QUICK_CALIBRATION is "tiny" (tests): little more than the
# launch and imports, rates not to plan with.
TINY = Profile(4 << 20, 3, {"cupy": 256, "numpy": 256}, 24, 4 << 20, 1)
QUICK_VARIABLE = "CHAINEXEC_QUICK_CALIBRATION"


def profile(quick: bool) -> Profile:
    """:data:`FULL`, or where ``quick`` :data:`QUICK` (:data:`TINY` where ``$CHAINEXEC_QUICK_CALIBRATION``
    is ``tiny``)."""
    if not quick:
        return FULL
    return TINY if os.environ.get(QUICK_VARIABLE) == "tiny" else QUICK


def calibrate(path: str | Path | None = None, *, scratch: str | Path | None = None, size: int | None = None,
              backend: str = "auto", ranks: int = 2, quick: bool = False) -> tuple[Machine, Path]:
    """Measure this machine, write the machine file ``path`` (JSON, atomically) and return it
    with the file written.

    Args:
        path: machine file to write; its folder must exist and be writable (checked before any
            measurement, so a typo costs no time). None: this machine's calibration in the cache
            (:func:`cache_file`), which plans and runs without ``--machine`` read; it is made
            holding the cache's lock (:func:`chainexec.machinecache.held`), so a run's first-use
            calibration and this one measure one after the other, not at once, each loading
            the other's measurement.
        scratch: folder for the disk test files, default ``path``'s folder. Put it on the
            filesystem that holds the HDF5 inputs and outputs: that is the disk being modelled.
        size: bytes per rank per repetition for the disk and global-array measurements
            (default: the profile's, 256 MiB, quick 32 MiB); each rank needs about 2 × size of
            host memory.
        backend: ``auto``, ``numpy`` or ``cupy``, as for ``chainexec run``.
        ranks: MPI ranks to launch, as many as a run will use on this node (one per GPU).
        quick: the :data:`QUICK` profile (seconds) instead of :data:`FULL`.

    Raises:
        ChainexecError: ``path`` or ``scratch`` not writable, bad arguments, no mpiexec, or the
            measurement failing (the message carries the failing rank's error).
    """
    if backend not in ("auto", "numpy", "cupy"):
        raise ChainexecError(f"unknown backend {backend!r} (auto, numpy or cupy)")
    if ranks < 1:
        raise ChainexecError(f"ranks must be at least 1, got {ranks}")
    cores = len(os.sched_getaffinity(0))
    if ranks > cores:
        raise ChainexecError(f"ranks: {ranks} is more than the {cores} cores this process may run on; a run's "
                             "ranks on this node are at most as many (one per GPU)")
    if size is not None and size < 1:
        raise ChainexecError(f"size must be a positive number of bytes, got {size}")
    if path is not None:
        path = Path(path)
        return _measured(path, None, scratch, size, backend, ranks, quick), path
    path, ident = cache_file(backend)
    with machinecache.held(ident):
        return _measured(path, ident, scratch, size, backend, ranks, quick), path


def first_use(ident: dict, backend: str, ranks: int) -> Machine:
    """A quick calibration of this machine on ``ranks`` ranks into the cache for ``ident``, made
    by a plan that found none there; the caller holds the cache's lock."""
    return _measured(writable(ident), ident, None, None, backend, ranks, True)


def _measured(path: Path, ident: dict | None, scratch: str | Path | None, size: int | None, backend: str,
              ranks: int, quick: bool) -> Machine:
    """:func:`calibrate`'s measurement into ``path``, kept for ``ident`` where in the cache."""
    _check_writable(path, own=ident is not None)
    scratch = Path(scratch) if scratch is not None else path.parent
    if not (scratch.is_dir() and os.access(scratch, os.W_OK)):
        raise ChainexecError("scratch folder for the disk measurement is not a writable directory", str(scratch))
    return keep(path, _launch(settings(scratch, quick, backend, size), ranks), quick, ident)


def cache_file(backend: str) -> tuple[Path, dict]:
    """This machine's calibration file in the cache for ``backend`` (:func:`writable`) and the
    identity it is kept for (:mod:`chainexec.machinecache`)."""
    ident = machinecache.identity(detect.gpu_name(backend))
    return writable(ident), ident


def writable(ident: dict) -> Path:
    """The cache file of the calibration of ``ident``, its folder made; a
    :class:`ChainexecError` naming the folder or file where it cannot be written."""
    where = machinecache.path(ident)
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ChainexecError(f"cannot make the calibration cache folder ({err.strerror or err}): set "
                             f"${machinecache.CACHE} to a writable folder, or give --machine", str(where.parent)) from None
    _check_writable(where, own=True)
    return where


def settings(scratch: Path, quick: bool, backend: str, size: int | None = None) -> dict:
    """The keyword arguments of :func:`chainexec.calibrate_worker.measure` (but ``comm``)."""
    chosen = profile(quick)
    return {"scratch": str(scratch.resolve()), "size": size or chosen.size, "reps": chosen.repetitions,
            "gemm_n": chosen.gemm_n, "statement_n": chosen.statement_n, "backend": backend,
            "copy_size": size or chosen.copy_size, "stripes": chosen.stripes}


def in_process(comm, path: Path, backend: str, ident: dict) -> Machine | None:
    """A quick calibration by the ranks of ``comm`` themselves (a run's, under its launcher:
    collective), kept in ``path`` (in the cache, for ``ident``) by rank 0, which returns it;
    None on the other ranks. The disk is measured in ``path``'s folder."""
    from chainexec.calibrate_worker import measure

    path.parent.mkdir(parents=True, exist_ok=True)  # on each host (rank 0's checked it: writable)
    raw = comm.gather(measure(comm, **settings(path.parent, True, backend)), root=0)
    return keep(path, raw, True, ident) if comm.rank == 0 else None


def keep(path: Path, raw: list[dict], quick: bool, ident: dict | None) -> Machine:
    """The machine of every rank's raw timings, written to ``path`` with its details (and the
    identity it is kept for in the cache, ``ident``)."""
    machine, details = _summarise(raw, quick)
    if ident is not None:
        details["kept_for"] = ident
    _write_atomically(path, {**dataclasses.asdict(machine), "details": details})
    return machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``chainexec calibrate`` options; their destinations are :func:`calibrate`'s parameters."""
    parser.add_argument("path", nargs="?", help="machine file (JSON) to write, for plan/run --machine (default: "
                        "this machine's calibration in $CHAINEXEC_CACHE, which plan and run read without --machine)")
    parser.add_argument("--scratch", help="folder for the disk test files (default: the machine file's "
                        "folder); use the filesystem that holds the HDF5 data")
    parser.add_argument("--size", type=_size_argument, help="bytes per rank per repetition for the disk, "
                        f"global-array and device-copy tests, e.g. 1GiB (default {FULL.size >> 20}MiB, quick {QUICK.size >> 20}MiB)")
    parser.add_argument("--backend", default="auto", choices=("auto", "numpy", "cupy"))
    parser.add_argument("--ranks", type=int, default=2, help="MPI ranks to launch: as many as a run uses "
                        "on this node (default 2)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.size >> 20}MiB, {QUICK.repetitions} "
                        "repetitions: seconds (what a first plan or run on a machine measures)")


def _size_argument(text: str) -> int:
    try:
        return parse_size(text, "--size")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _check_writable(path: Path, own: bool = False) -> None:
    """Raise :class:`ChainexecError` naming ``path`` unless the atomic write can succeed there: a
    file of a fresh name beside it can be created (and is removed: no file of the user's is
    touched) and ``path`` is not a directory, nor a file other than a machine file
    (:meth:`Machine.parse` reads it), which the calibration would replace; but the cache's
    ``own`` file, which a broken one is made again in place of."""
    if path.is_dir():
        raise ChainexecError("cannot write the machine file: it is a directory", str(path))
    if path.exists() and not own:
        if not path.is_file():  # a FIFO (whose read would wait for a writer), a device, a socket
            raise ChainexecError("exists and is not a file; calibrate replaces only a machine file: "
                                 "move it or name another file", str(path))
        try:
            Machine.parse(path.read_text(), str(path))
        except (ChainexecError, OSError, UnicodeDecodeError):
            raise ChainexecError("exists and is not a machine file; calibrate replaces only a machine file: "
                                 "move it or name another file", str(path)) from None
    try:
        atomicfile.probe(path)
    except OSError as err:
        raise ChainexecError(f"cannot write the machine file ({err.strerror or err})", str(path)) from None


def _write_atomically(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` whole (:func:`chainexec.atomicfile.write`), readable by
    the node's other users as the shared caches are: a reader sees the old file or the whole new
    one, never a torn one."""
    try:
        atomicfile.write(path, json.dumps(data, indent=1) + "\n", diskstore.SHARED)
    except OSError as err:
        raise ChainexecError(f"cannot write the machine file ({err.strerror or err})", str(path)) from None


def _mpiexec() -> str:
    """The mpiexec of this Python's environment (the one its mpi4py was built with), else PATH's."""
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        raise ChainexecError(f"no mpiexec next to {sys.executable} or on PATH: calibrate launches "
                             "ranks with it to measure global-array bandwidth between them")
    return found


def unbound(version: str) -> list[str]:
    """The options that start a launcher's ranks unbound, from its ``--version`` text: Open MPI
    binds each rank to one core where it starts two or fewer (and to a package above that), so
    a rank's host copies, fills and writes, threaded over the cores it may use
    (:func:`chainexec.runtime.hostcopy.threads`), would be measured on one thread, and a run
    started without a launcher, or as the project's scripts launch it, uses every core. MPICH's
    Hydra binds nothing unless asked; Intel MPI pins each rank to its share of the cores."""
    return ["--bind-to", "none"] if "Open MPI" in version or "OpenRTE" in version else []


def _version(launcher: str, env: dict) -> str:
    """What ``launcher --version`` prints (empty where it fails or takes over 30 s)."""
    try:
        proc = subprocess.run([launcher, "--version"], capture_output=True, text=True, env=env, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout + proc.stderr


def launch_options(launcher: str, env: dict) -> list[str]:
    """:func:`unbound`'s options for ``launcher`` as it says it is (``--version`` run with
    ``env``)."""
    return unbound(_version(launcher, env))


def _launch(config: dict, ranks: int) -> list[dict]:
    """Run the worker on ``ranks`` ranks, unbound (:func:`unbound`); return each rank's raw
    timings. A failure reports the lowest failing rank's own message (from the error folder),
    else the launcher's message (:func:`_launcher_reason`)."""
    # The worker imports this package: make that work from a source checkout that is not installed.
    package_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    error_dir = tempfile.mkdtemp(prefix="chainexec-calibrate-")
    try:
        launcher = _mpiexec()
        cmd = [launcher, "-n", str(ranks), *launch_options(launcher, env), sys.executable, "-m",
               "chainexec.calibrate_worker", json.dumps(config), error_dir]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            # A rank killed while writing leaves an empty report: take the first complete one.
            files = sorted(Path(error_dir).glob("rank*"), key=lambda f: int(f.name[4:]))
            reports = [text for text in (f.read_text().strip() for f in files) if text]
            reason = reports[0] if reports else _launcher_reason(proc.stderr)
            raise ChainexecError(f"measurement failed under {cmd[0]} -n {ranks} (exit {proc.returncode}): {reason}")
    finally:
        _remove_late(Path(error_dir))
    return json.loads(lines[-1])["ranks"]


def _remove_late(folder: Path, seconds: float = 5.0) -> None:
    """Remove ``folder`` and what it holds, into which ranks of a failed launch may still write
    their reports after the launcher has returned (MPICH's Hydra ends the other ranks of an
    aborted job without waiting for them): tried again every 0.1 s for ``seconds``, then left
    to the temporary folder's cleaner, since the run's own error is what is reported."""
    deadline = time.monotonic() + seconds
    while True:
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists() or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _launcher_reason(stderr: str) -> str:
    """The launcher's own message in one line: the first paragraph of the last box of its output
    (Open MPI frames each message between rules of dashes, and may add lines of its own after the
    box, each beginning ``[host:pid]``), else its last line with text."""
    lines = [line.strip() for line in stderr.splitlines()]
    rules = [k for k, line in enumerate(lines) if len(line) >= 10 and set(line) == {"-"}]
    after = lines[rules[-1] + 1:] if rules else []
    if len(rules) >= 2 and all(not line or re.match(r"\[[^\]]+:\d+\] ", line) for line in after):
        box = lines[rules[-2] + 1:rules[-1]]
        start = next((k for k, line in enumerate(box) if line), len(box))
        stop = next((k for k in range(start, len(box)) if not box[k]), len(box))
        if start < stop:
            return " ".join(box[start:stop])
    text = [line for line in lines if any(c.isalnum() for c in line)]
    return text[-1] if text else "no output"


def _rate(amount: float, samples_per_rank: list[list[float]]) -> dict:
    """``amount`` (bytes or flops, one rank's) per second: per repetition over the slowest rank,
    then the median over repetitions. Returns the rate and the per-repetition rates."""
    per_rep = [amount / max(seconds) for seconds in zip(*samples_per_rank)]
    return {"per_second": statistics.median(per_rep), "samples_per_second": per_rep}


def _per_call(statement: dict, ranks: int, bytes_seconds: dict[str, float]) -> dict[str, float]:
    """Seconds per transfer call of each level and per compute statement, from the statement
    chain's runs (:func:`chainexec.calibrate_worker._statements`: each run's wall and per-level
    seconds, the same on every rank, and the plan's calls and bytes of all ranks). A level's
    seconds beyond its bytes' (``bytes_seconds``, all ranks' bytes at the measured rates) over its
    calls; the wall's seconds outside both transfer levels over the compute statements, each of
    ``ranks`` ranks making its share. Medians over the runs, none below 0."""
    share = {level: n / ranks for level, n in statement["calls"].items()}
    samples = {"statement": [], "disk": [], "global<->device": []}
    for wall, levels in zip(statement["s"], statement["level_s"]):
        for level in share:
            extra = max(levels[level] - bytes_seconds[level] / ranks, 0.0)
            samples[level].append(extra / share[level] if share[level] else 0.0)
        outside = wall - levels["disk"] - levels["global<->device"]
        samples["statement"].append(max(outside, 0.0) / (statement["statements"] / ranks))
    return {name: statistics.median(values) for name, values in samples.items()}


def _summarise(raw: list[dict], quick: bool) -> tuple[Machine, dict]:
    """The :class:`Machine` and the ``details`` record from every rank's raw timings."""
    first = raw[0]
    disk, ga, gemm = first["disk"], first["global_array"], first["gemm"]

    def over_ranks(group: str, key: str) -> list[list[float]]:
        return [r[group][key] for r in raw]

    write = _rate(disk["write_bytes"], over_ranks("disk", "write_s"))
    cached = _rate(disk["cached_write_bytes"], over_ranks("disk", "cached_write_s"))
    read = _rate(disk["read_bytes"], over_ranks("disk", "read_s"))
    get = _rate(ga["bytes"], over_ranks("global_array", "get_s"))
    put = _rate(ga["bytes"], over_ranks("global_array", "put_s"))
    acc = _rate(ga["bytes"], over_ranks("global_array", "accumulate_s"))
    fill = _rate(ga["fill_bytes"], over_ranks("global_array", "fill_s"))
    flops = 2 * gemm["n"] ** 3
    gemm_rate = _rate(flops, over_ranks("gemm", "s"))
    copy = _rate(first["device_copy"]["bytes"], over_ranks("device_copy", "s"))
    orbit = first.get("orbit") and _rate(first["orbit"]["points"] * first["orbit"]["bytes_per_point"],
                                         over_ranks("orbit", "s"))
    statement = first["statement"]

    if first["host_device"] is not None:
        nbytes = first["host_device"]["bytes"]
        h2d = _rate(nbytes, over_ranks("host_device", "h2d_s"))
        d2h = _rate(nbytes, over_ranks("host_device", "d2h_s"))
        # A tile goes global → pinned host → device one step after the other: seconds per byte add.
        to_device = 1 / (1 / get["per_second"] + 1 / h2d["per_second"])
        to_global = 1 / (1 / acc["per_second"] + 1 / d2h["per_second"])
        host_device = {"buffers": "pinned host (CuPy's page-locked pool), timed with CUDA events",
                       "bytes_per_rank": nbytes, "host_to_device": h2d, "device_to_host": d2h}
    else:
        # NumPy's "device" is host memory: the get's destination is the device buffer already.
        to_device, to_global = get["per_second"], acc["per_second"]
        host_device = None
    def bytes_seconds(run: dict) -> dict[str, float]:
        """Seconds of a statement-chain run's bytes per transfer level, all ranks', at the rates above."""
        moved = run["bytes"]
        return {"disk": moved["disk->global"] / read["per_second"] + moved["global->disk"] / cached["per_second"],
                "global<->device": moved["global->device"] / to_device + moved["device->global"] / to_global}

    per_call = _per_call(statement, len(raw), bytes_seconds(statement))
    per_call["disk"] = _per_call(first["load"], len(raw), bytes_seconds(first["load"]))["disk"]
    locking = first["host_lock"] and _rate(first["host_lock"]["bytes"], over_ranks("host_lock", "s"))
    mapped = first["mapped_fetch"] and _rate(first["mapped_fetch"]["bytes"], over_ranks("mapped_fetch", "s"))
    direct = first.get("mapped_locked_fetch") and _rate(first["mapped_locked_fetch"]["bytes"],
                                                        over_ranks("mapped_locked_fetch", "s"))

    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    host = platform.node()
    machine = Machine(disk_read=read["per_second"], disk_write=write["per_second"],
                      global_to_device=to_device, device_to_global=to_global, flop_rate=gemm_rate["per_second"],
                      statement_seconds=per_call["statement"], transfer_call_seconds=per_call["global<->device"],
                      disk_call_seconds=per_call["disk"], device_bandwidth=copy["per_second"],
                      orbit_bandwidth=orbit and orbit["per_second"],
                      async_statements=first["queued"], disk_write_cached=cached["per_second"],
                      write_cache_bytes=disk["write_cache_bytes"] // len(raw), global_fill=fill["per_second"],
                      host_to_device=host_device and host_device["host_to_device"]["per_second"],
                      device_to_host=host_device and host_device["device_to_host"]["per_second"],
                      host_lock=locking and locking["per_second"], mapped_to_device=mapped and mapped["per_second"],
                      mapped_locked_to_device=direct and direct["per_second"],
                      source=f"chainexec calibrate on {host}, {date}, {len(raw)} rank{'s' * (len(raw) != 1)}, {first['backend']}"
                             + (", quick" if quick else ""))
    details = {
        "units": {"bandwidths": "bytes/s per rank, all ranks measuring at once",
                  "flop_rate": "flop/s per rank, all ranks computing at once",
                  "rates": "median over repetitions of one rank's amount / the slowest rank's seconds"},
        "date": date, "host": host, "cpu_count": os.cpu_count(), "ranks": len(raw),
        "cores_per_rank": min(r["cores"] for r in raw),
        "backend": first["backend"], "quick": quick, "repetitions": len(gemm["s"]),
        "disk": {"bytes_per_rank": disk["write_bytes"], "file_bytes_per_rank": disk["read_bytes"],
                 "write_method": "h5py contiguous float64 dataset, flush + fsync, one file per rank",
                 "read_method": disk["read_method"], "write": write, "read": read,
                 "cached_write": {"bytes_per_rank": disk["cached_write_bytes"],
                                  "method": "the store's stripes, a file per thread, closed, nothing synced", **cached},
                 "write_cache": {"bytes_per_host": disk["write_cache_bytes"], "from": disk["write_cache_from"],
                                 "per_rank": "shared evenly by the ranks measuring on the host"}},
        "global_array": {"bytes_per_rank": ga["bytes"],
                         "patch": "whole block of rank (r + 1) mod P" + ("" if len(raw) > 1 else " (its own: 1 rank)"),
                         "get": get, "put": put, "accumulate": acc,
                         "fill": {"what": "a zero-filled global array allocated and freed", "bytes_per_rank": ga["fill_bytes"],
                                  **fill}},
        "host_device": host_device,
        "host_lock": locking and {"what": "a zero-filled global array of the fill's size registered with the device "
                                  "(writable) and unregistered, waiting", "bytes_per_rank": first["host_lock"]["bytes"],
                                  **locking},
        "mapped_to_device": mapped and {"what": "a file's rows in the page cache, mapped, fetched to the device "
                                        "through the staging buffers", "bytes_per_rank": first["mapped_fetch"]["bytes"],
                                        **mapped},
        "mapped_locked_to_device": direct and {"what": "the same rows with the mapping locked where it lies "
                                               "(read-only), fetched by DMA from the page cache's pages",
                                               "bytes_per_rank": first["mapped_locked_fetch"]["bytes"], **direct},
        "global_to_device": "get" + (" then host_to_device, 1/(1/get + 1/h2d)" if host_device else ""),
        "device_to_global": ("device_to_host then accumulate, 1/(1/acc + 1/d2h)" if host_device else "accumulate"),
        "gemm": {"n": gemm["n"], "dtype": "float64", "flops_per_call": flops, **gemm_rate},
        "device_copy": {"what": "a tile copied by the backend's tile operation into each of the six orders of its last "
                                "three indices (bytes read + written, all six)",
                        "shape": first["device_copy"]["shape"], "bytes_per_call": first["device_copy"]["bytes"], **copy},
        "orbit": orbit and {"what": "the backend's fused reduction over a (T)-shaped tile reading a reused value at six "
                                    "permutations, its points times the L1 and shared-memory bytes per point "
                                    "chainexec.kernels.orbits.point_bytes counts, over its seconds",
                            "points": first["orbit"]["points"], "bytes_per_point": first["orbit"]["bytes_per_point"],
                            **orbit},
        "statement": {"what": f"a {statement['n']}-cubed matrix product run by the executor in tiny device tiles: "
                      "per compute statement, the run's wall seconds outside its transfers' (bookkeeping, kernel "
                      "launches; flops negligible); per get or accumulate and per load or store, the seconds of "
                      "that level's statements beyond their bytes' time at the rates above",
                      "statements_per_run": statement["statements"], "calls_per_run": statement["calls"],
                      "seconds": per_call["statement"], "transfer_call_seconds": per_call["global<->device"]},
        "load": {"what": f"the same product with global memory of {first['load']['global_memory']}: per load or store, "
                 "the disk level's seconds beyond its bytes' time",
                 "calls_per_run": first["load"]["calls"], "disk_call_seconds": per_call["disk"]},
    }
    return machine, details
