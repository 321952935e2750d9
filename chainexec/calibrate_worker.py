"""One rank of ``chainexec calibrate``: times disk, global-array, host↔device and GEMM work.

Launched by :func:`chainexec.calibrate.calibrate` as ``mpiexec -n P python -m
chainexec.calibrate_worker CONFIG_JSON ERROR_DIR``. Every rank runs every measurement at the same time as
the others (a Barrier before each repetition), because the machine file's rates are *per rank of a
P-rank job on this node*: ranks share the disk, memory bus and cores as they do in ``chainexec
run``. Each rank reports raw seconds per repetition; rank 0 gathers them and prints one JSON line
on stdout, and the caller reduces them to rates (it owns units and medians). Any exception prints
its traceback, writes its one-line message to ``ERROR_DIR/rank<N>`` and aborts every rank, so the
launcher never hangs. The message goes to a file because an abort may end the launcher before it
has forwarded the failing rank's stderr.

mpi4py (and so MPI) is imported only inside :func:`main`, so that the disk functions can be used and
tested in a process that must not initialise MPI.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import sys
import time
import traceback
from pathlib import Path

import h5py
import numpy as np

# A chain whose plan runs many tiny tiles: the per-statement measurement (``{n}``: each index's
# extent; ``{global_memory}``: the limit that decides how many loads and stores it makes).
STATEMENT_CHAIN = """\
name: statements
indices: {{i: {n}, j: {n}, k: {n}}}
tensors:
  A: {{indices: [i, k], source: {{random: 1}}}}
  B: {{indices: [k, j], source: {{random: 2}}}}
statements:
  - C[i,j] = A[i,k] * B[k,j]
outputs:
  C: {{file: out.h5, dataset: C}}
machine: {{global_memory: {global_memory}, device_memory: 2KiB}}
scratch: scratch
"""

# The orbit-kernel measurement (:func:`_orbit`): a reduction shaped as the (T) energy's, over
# tiles of ORBIT_TILE occupied by ORBIT_EDGE virtual elements along each pair index, reading one
# reused value (W plus six outer products) at the six permutations of a, b, c. The inputs lie in
# [1, 2), so the denominator's terms are all positive. A repetition times ORBIT_CALLS calls back
# to back: a run queues its calls behind other work, so the host's preparation of a call (on a GPU
# about as long as the kernel over a tile of 2) is not the kernel's time; queued, each call's
# preparation overlaps the kernel before it and only the first one's stays in the measurement.
ORBIT_DOMAIN = ("i", "a", "j", "b", "k", "c")
ORBIT_LET = ("W[i,a,j,b,k,c] + 0.5 * (t[i,a] * P[j,b,k,c] + t[j,b] * P[i,a,k,c] + t[k,c] * P[i,a,j,b]"
             " + g[a,i] * Q[j,k,b,c] + g[b,j] * Q[i,k,a,c] + g[c,k] * Q[i,j,a,b])")
ORBIT_SUM = ("W[i,a,j,b,k,c] * (4 * Z[i,a,j,b,k,c] + Z[i,b,j,c,k,a] + Z[i,c,j,a,k,b] - 2 * Z[i,a,j,c,k,b]"
             " - 2 * Z[i,c,j,b,k,a] - 2 * Z[i,b,j,a,k,c]) / (d[i] + d[j] + d[k] + e[a] + e[b] + e[c])")
ORBIT_TILE, ORBIT_EDGE, ORBIT_CALLS = 3, 200, 4

# Read methods, from best to worst at keeping the page cache out of a read measurement.
DIRECT = "O_DIRECT"
FADVISE = "posix_fadvise(POSIX_FADV_DONTNEED) after fsync"
CACHED = "plain read, page cache not defeated (neither O_DIRECT nor posix_fadvise available)"

# Bytes per read call: large enough that per-call overhead is negligible against disk time, and a
# multiple of every logical block size O_DIRECT may demand (512 B to 4 KiB).
READ_CHUNK = 8 << 20
# Columns of the global-array test matrix (float64): rows of 8 KiB, so a patch of a rank's block
# is a few large contiguous runs, as the executor's tiles of the first axis are.
GA_COLUMNS = 1024


def write_seconds(path: Path, data: np.ndarray) -> float:
    """Seconds to write ``data`` as one contiguous HDF5 dataset in a new file at ``path`` and make
    it durable: h5py create + write, flush, fsync of the file's descriptor, close. This is how the
    runtime's stores reach the disk, HDF5 overhead included; without the fsync the page cache would
    absorb the write and the rate would be memory bandwidth."""
    start = time.perf_counter()
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data)
        f.flush()
        os.fsync(f.id.get_vfd_handle())
    return time.perf_counter() - start


def cached_write_seconds(folder: Path, data: np.ndarray) -> float:
    """Seconds to write ``data`` as the runtime's store writes a block
    (:func:`chainexec.runtime.store.write_stripes`: stripes in files of their own, a thread
    each) and close the files, nothing synced: the rate at which the page cache takes a run's
    writes, up to the host's dirty-page limit. The files are removed afterwards."""
    from chainexec.runtime.store import write_stripes

    paths = []

    def shard(stripe: int) -> h5py.File:
        paths.append(folder / f".chainexec-calibrate-{os.getpid()}-s{stripe}.h5")
        files.append(h5py.File(paths[-1], "w"))
        return files[-1]

    files: list[h5py.File] = []
    try:
        start = time.perf_counter()
        write_stripes(shard, 0, ((0, len(data)),), data)
        for f in files:
            f.close()
        return time.perf_counter() - start
    finally:
        for f in files:
            f.close()
        for path in paths:
            path.unlink(missing_ok=True)


def read_method(path: Path) -> str:
    """The best way to read ``path`` past the page cache that its filesystem supports: O_DIRECT when
    opening with it and reading one aligned chunk works (tmpfs and some network filesystems refuse
    with EINVAL), else posix_fadvise, else plain reads (whose rate is then the page cache's, as the name says)."""
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                with mmap.mmap(-1, READ_CHUNK) as buf:  # anonymous mmap: page-aligned, as O_DIRECT needs
                    os.readv(fd, [buf])
                return DIRECT
            finally:
                os.close(fd)
        except OSError:
            pass
    return FADVISE if hasattr(os, "posix_fadvise") else CACHED


def read_seconds(path: Path, method: str) -> tuple[float, int]:
    """(seconds, bytes) to read the whole file ``path`` with ``method`` (see :func:`read_method`),
    in :data:`READ_CHUNK` pieces into one page-aligned buffer. The raw bytes of the HDF5 file are
    read, not the dataset through h5py: O_DIRECT needs aligned buffers and offsets that HDF5's
    default driver does not give, and the disk rate is what the planner needs."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if method == DIRECT else 0))
    try:
        if method == FADVISE:
            # Only clean pages can be dropped: fsync again in case closing the HDF5 file dirtied any.
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with mmap.mmap(-1, READ_CHUNK) as buf:
            total = 0
            start = time.perf_counter()
            while (n := os.readv(fd, [buf])) > 0:
                total += n
            return time.perf_counter() - start, total
    finally:
        os.close(fd)


def _wall(fn) -> float:
    """Wall-clock seconds of ``fn()``: right for work that is complete when it returns (NumPy, file
    I/O, global-array calls, which flush their targets before returning)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _stopwatch(xp):
    """``time(fn) -> seconds`` for work on array module ``xp``: the wall clock for NumPy, CUDA events
    around ``fn`` on the current stream for CuPy (its kernels and copies return before they finish,
    so the wall clock would time only their launch)."""
    if xp is np:
        return _wall

    def time_cuda(fn) -> float:
        start, end = xp.cuda.Event(), xp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return xp.cuda.get_elapsed_time(start, end) / 1e3  # milliseconds → seconds
    return time_cuda


def _repeat(comm, reps: int, clock, fn) -> list[float]:
    """Seconds of ``reps`` calls of ``fn`` by ``clock``, every call started together on all ranks,
    after one untimed warm-up call: first touch of pages, MPI's per-target and per-datatype setup,
    CUDA context and cuBLAS handle, BLAS thread start all fall there, not in a timed call."""
    fn()
    samples = []
    for _ in range(reps):
        comm.Barrier()
        samples.append(clock(fn))
    return samples


# The global memory of the statement chain's two measurements: its operands whole in global
# memory (each loaded once: the many gets and compute statements are measured), and a few rows of
# them at a time (the many loads are).
STATEMENT_GLOBAL, LOAD_GLOBAL = "1MiB", "2KiB"


def _statements(comm, dev, scratch: str, reps: int, n: int, global_memory: str) -> dict:
    """Run :data:`STATEMENT_CHAIN` of extent ``n`` and ``global_memory`` through the executor
    ``reps`` times (after one untimed run) in a folder under ``scratch``; returns the extent, the
    compute statements per run (all ranks), each run's wall seconds (slowest rank) and seconds
    per level (busiest rank), and the plan's transfer calls and bytes per level (all ranks,
    :func:`chainexec.planner.cost.predict_nests`)."""
    import shutil

    from chainexec import spec
    from chainexec.planner.build import make_plan
    from chainexec.planner.cost import predict_nests
    from chainexec.planner.machine import Machine
    from chainexec.planner.plan import Plan
    from chainexec.runtime import store
    from chainexec.runtime.executor import Executor

    folder = Path(scratch) / f".chainexec-calibrate-statements-{comm.bcast(os.getpid(), root=0)}"
    text = None
    if comm.rank == 0:
        folder.mkdir()
        chain = spec.loads(STATEMENT_CHAIN.format(n=n, global_memory=global_memory), str(folder / "chain.yaml"))
        store.make_folders([chain.resolve(o.file) for o in chain.outputs], chain.resolve(chain.scratch))
        plan = make_plan(chain, ranks=comm.size)
        text = plan.to_json()
    plan = Plan.from_json(comm.bcast(text, root=0))
    try:
        runs = [Executor(plan, comm, dev, "static").run() for _ in range(reps + 1)][1:]
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    counted = predict_nests(plan.nests, plan.tensors, plan.extents, plan.contractions, Machine(), comm.size)
    return {"n": n, "global_memory": global_memory, "statements": runs[0]["statements"],
            "s": [r["total_seconds"] for r in runs],
            "level_s": [r["seconds"] for r in runs], "calls": counted["calls"], "bytes": counted["bytes"]}


def _orbit(dev, rng, comm, reps: int, clock) -> dict:
    """Seconds of :data:`ORBIT_CALLS` calls of the backend's fused reduction :data:`ORBIT_SUM` (its
    reused value ``Z`` made by :data:`ORBIT_LET`) on random inputs, ``reps`` times, with the points
    of those calls and the bytes per point :func:`chainexec.kernels.orbits.fused_point_bytes`
    counts for it."""
    from chainexec.kernels.orbits import fused_point_bytes
    from chainexec.planner.plan import Fused

    f = Fused("E", (), ORBIT_DOMAIN, ORBIT_SUM, True, (("Z", ORBIT_DOMAIN, ORBIT_LET),))
    extents = {i: ORBIT_TILE if i in "ijk" else ORBIT_EDGE for i in ORBIT_DOMAIN}
    made = dev.xp.random.default_rng(int(rng.integers(1 << 31)))  # on the device: 1.7 GB at a tile of 3
    arrays = {r: made.random(tuple(extents[i] for i in r.indices)) + 1.0 for r in f.leaves}
    shape = tuple(extents[i] for i in ORBIT_DOMAIN)
    out = dev.xp.zeros((), np.float64)
    dtypes = dict.fromkeys([r.tensor for r in f.leaves] + [f.out], "float64")

    def calls():
        for _ in range(ORBIT_CALLS):
            dev.fused(f, arrays, shape, out)
    return {"points": ORBIT_CALLS * math.prod(shape), "bytes_per_point": fused_point_bytes(f, extents, dtypes),
            "s": _repeat(comm, reps, clock, calls)}


def measure(comm, scratch: str, size: int, reps: int, gemm_n: dict, backend: str, statement_n: int,
            copy_size: int, stripes: int) -> dict:
    """This rank's raw timings (seconds per repetition) and the bytes or flops each moved or did.

    ``size``: bytes per rank per repetition for the disk and global-array measurements;
    ``gemm_n``: GEMM matrix order per backend name (``numpy``/``cupy``); ``statement_n``: the
    extent of the statement measurement's product (:func:`_statements`); ``copy_size``: bytes of
    the device copy, and at least those of the global array's fill; ``stripes``: the cached
    writes' stripes per thread, at least."""
    from chainexec import detect
    from chainexec.runtime import hostcopy, warmup
    from chainexec.runtime.device import HOST_LOCKS, QUEUED, SEPARATE_MEMORY, select
    from chainexec.runtime.globalarray import GlobalArray
    from chainexec.runtime.mapped import MappedArray, contiguous_offset

    rng = np.random.default_rng(comm.rank)
    result: dict = {"cores": hostcopy.threads()}

    # Disk: each rank its own file, as each rank reads its rows and writes its shard in a run.
    # Measured before the backend is chosen: the disk needs no device, and a run's device warm-up
    # (:mod:`chainexec.runtime.warmup`), begun at its start and waited for by the choice, goes on
    # meanwhile.
    data = rng.random(max(1, size // 8))
    path = Path(scratch) / f".chainexec-calibrate-{os.getpid()}-{comm.rank}.h5"
    try:
        write_seconds(path, data)  # a file for the method probe, untimed
        method = read_method(path)
        writes, reads = [], []
        for _ in range(reps):
            comm.Barrier()
            writes.append(write_seconds(path, data))
            comm.Barrier()
            seconds, nread = read_seconds(path, method)
            reads.append(seconds)
        result["disk"] = {"write_bytes": data.nbytes, "write_s": writes, "read_bytes": nread,
                          "read_s": reads, "read_method": method}
    finally:
        path.unlink(missing_ok=True)
    del data
    # Writes the page cache takes, as a run's store makes them: ``stripes`` stripes per thread, as
    # each thread's file is made and closed once per write, fixed costs that a run's gigabytes
    # spread thin and one stripe per thread does not.
    data = np.ones(max(size, stripes * hostcopy.threads() * hostcopy.PIECE_BYTES) // 8)
    cached = []
    for _ in range(reps):
        comm.Barrier()
        cached.append(cached_write_seconds(Path(scratch), data))
    limit, where = detect.write_cache()
    result["disk"] |= {"cached_write_bytes": data.nbytes, "cached_write_s": cached, "write_cache_bytes": limit,
                       "write_cache_from": where}
    del data

    dev = select(backend, comm)
    warmup.settle()  # a warm-up the selection began (``chainexec calibrate``'s workers) beside no timing
    xp = dev.xp
    stopwatch = _stopwatch(xp)
    result |= {"backend": dev.name, "queued": QUEUED in dev.capabilities}

    # Global array: every rank moves the whole block of the next rank (another rank's memory
    # whenever P > 1), all at once, into the backend's host buffers for device copies (page-locked
    # on a GPU) so that they can feed the copy.
    rows = max(1, size // (8 * GA_COLUMNS))
    shape = (rows, GA_COLUMNS)
    host = dev.host_empty(shape, np.float64)
    host[...] = 1.0
    ga = GlobalArray(comm, (comm.size * rows, GA_COLUMNS), np.float64, zero=False)
    ga.local()[...] = 1.0
    peer = (comm.rank + 1) % comm.size
    region = (slice(peer * rows, (peer + 1) * rows),)
    # A fill of ``copy_size`` bytes or more: the window's creation costs as long as filling tens
    # of MiB, and a run's global buffers are large against it.
    fill_rows = max(rows, copy_size // (8 * GA_COLUMNS))
    result["global_array"] = {
        "bytes": host.nbytes, "peer": peer, "fill_bytes": fill_rows * GA_COLUMNS * 8,
        "fill_s": _repeat(comm, reps, _wall, lambda: GlobalArray(comm, (comm.size * fill_rows, GA_COLUMNS),
                                                                 np.float64).free()),
        "get_s": _repeat(comm, reps, _wall, lambda: ga.get(region, out=host)),
        "put_s": _repeat(comm, reps, _wall, lambda: ga.put(region, host)),
        "accumulate_s": _repeat(comm, reps, _wall, lambda: ga.accumulate(region, host)),
    }
    comm.Barrier()
    ga.free()

    # Host↔device: only where the device is not host memory (on NumPy the get already lands there).
    result["host_device"] = None
    if SEPARATE_MEMORY in dev.capabilities:
        device_buf = xp.empty(shape, np.float64)
        result["host_device"] = {
            "bytes": host.nbytes,
            "h2d_s": _repeat(comm, reps, stopwatch, lambda: device_buf.set(host)),
            "d2h_s": _repeat(comm, reps, stopwatch, lambda: device_buf.get(out=host)),
        }
        del device_buf

    # Page-locking: what a pinned run (``Plan.pinned``) does to each global array before its
    # first transfer and undoes before freeing it (a zero-filled array of the fill's size,
    # registered writable and unregistered, waiting, as the runtime does); and the rows of an
    # input's tile mapped from its file, whose pages the page cache holds, fetched to the device
    # through the staging buffers, each filled from the mapping (:meth:`MappedArray.at_hand`)
    # over threads, which is how such a run gets them (of the fill's size too: a run's inputs
    # are large against the fetch's fixed costs, threads started over the buffers).
    result["host_lock"] = result["mapped_fetch"] = result["mapped_locked_fetch"] = None
    if HOST_LOCKS in dev.capabilities:
        dev.expect_transfers(True)
        fill_shape = (fill_rows, GA_COLUMNS)
        ga = GlobalArray(comm, (comm.size * fill_rows, GA_COLUMNS), np.float64)
        block = ga.local()

        def lock_and_unlock():
            dev.unlock_host(dev.lock_host(block, writable=True), wait=True)

        result["host_lock"] = {"bytes": block.nbytes, "s": _repeat(comm, reps, _wall, lock_and_unlock)}
        comm.Barrier()
        ga.free()
        path = Path(scratch) / f".chainexec-calibrate-mapped-{os.getpid()}-{comm.rank}.h5"
        try:
            with h5py.File(path, "w") as f:
                f.create_dataset("x", data=np.full(fill_shape, 0.5))
            with h5py.File(path, "r") as f:
                offset = contiguous_offset(f["x"], np.dtype(np.float64), str(path))
            mapped = MappedArray(str(path), offset, fill_shape, np.float64)
            rows = mapped.whole()
            mapped.populate(rows)
            device_buf = xp.empty(fill_shape, np.float64)
            result["mapped_fetch"] = {"bytes": rows.nbytes, "s": _repeat(
                comm, reps, stopwatch, lambda: dev.fetch(device_buf, lambda r, out: mapped.get((r,), out),
                                                         lambda r: mapped.at_hand((r,))))}
            # the same rows with the mapping locked where it lies, read-only, as a pinned run
            # locks the inputs its plan names (Plan.locked): one DMA from the page cache's pages
            handle = dev.lock_host(rows, writable=False, named=True)
            if handle is not None:
                result["mapped_locked_fetch"] = {"bytes": rows.nbytes, "s": _repeat(
                    comm, reps, stopwatch, lambda: dev.fetch(device_buf, lambda r, out: mapped.get((r,), out),
                                                             lambda r: rows if r is None else rows[r]))}
                dev.unlock_host(handle, wait=True)
            del device_buf, rows, mapped
        finally:
            path.unlink(missing_ok=True)

    # Device memory: what streaming a statement's tiles costs. A statement reads its operands in
    # other orders than they lie (a (T) tile's terms each permute its three virtual indices), and
    # the backend's tile operation moves a permuted tile at a fraction of a contiguous copy's rate
    # (the lower where the innermost index changes). So one tile shaped like a (T) tile,
    # 4·4·4·n³ of ``copy_size`` bytes, is copied by that operation into each of the six orders of
    # its last three indices, contiguous among them, and the rate is their bytes over their
    # seconds together.
    edge = max(1, round((copy_size // (8 * 64)) ** (1 / 3)))
    src = xp.full((4, 4, 4, edge, edge, edge), 0.5)  # the values do not change a copy's rate
    views = [src.transpose(0, 1, 2, *(3 + p for p in order)) for order in itertools.permutations(range(3))]
    dst = xp.empty_like(src)

    def copy_in_every_order():
        for view in views:
            dev.assign(dst, view)

    result["device_copy"] = {"bytes": 2 * src.nbytes * len(views), "shape": list(src.shape),
                             "s": _repeat(comm, reps, stopwatch, copy_in_every_order)}

    # Orbit kernels: the rate at which a GPU's fused reductions with reused values move their
    # bytes through L1 and shared memory (:func:`chainexec.kernels.orbits.point_bytes`).
    result["orbit"] = _orbit(dev, rng, comm, reps, stopwatch) if SEPARATE_MEMORY in dev.capabilities else None

    # One statement: the executor's wall time per compute statement on tiny tiles, where its own
    # bookkeeping, tile copies and kernel launches are all there is.
    result["statement"] = _statements(comm, dev, scratch, reps, statement_n, STATEMENT_GLOBAL)
    # One load or store: the same product in tiles of global memory too small for its operands.
    result["load"] = _statements(comm, dev, scratch, reps, statement_n, LOAD_GLOBAL)

    # GEMM: float64 square matrices, the executor's contraction kernel on this backend.
    n = gemm_n[dev.name]
    a, b = (xp.asarray(rng.random((n, n))) for _ in range(2))
    c = xp.empty((n, n), np.float64)
    result["gemm"] = {"n": n, "s": _repeat(comm, reps, stopwatch, lambda: xp.matmul(a, b, out=c))}
    return result


def main(argv: list[str]) -> int:
    """Run :func:`measure` with the JSON keyword arguments in ``argv[1]``; rank 0 prints
    ``{"ranks": [result of rank 0, rank 1, …]}`` as one line. A failing rank writes
    ``"<exception type>: <message>"`` to ``<argv[2]>/rank<N>`` before aborting."""
    from chainexec.runtime.comm import abort, world

    comm = world()
    try:
        result = measure(comm, **json.loads(argv[1]))
    except BaseException as err:
        traceback.print_exc()
        (Path(argv[2]) / f"rank{comm.rank}").write_text(f"{type(err).__name__}: {err}\n")
        abort(comm, 1)
    results = comm.gather(result, root=0)
    if comm.rank == 0:
        print(json.dumps({"ranks": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
