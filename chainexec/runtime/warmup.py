"""Load on a thread of its own, as early as the process allows, what a GPU run loads on first use.

What: the CUDA context (:func:`context`), cuBLAS (its state and a handle), the kernels every run
may launch whatever its shapes (:func:`chainexec.runtime.pointwise.load_common`: the tile
operations and the like, compiled together in threads where the kernel cache lacks them), and
what earlier runs on this device used
(:mod:`chainexec.runtime.uselog`): their cuBLAS calls, made again on stand-in matrices so that the
kernels cuBLAS picks for those shapes load, and their generated kernels. :func:`start` begins it
when the ``run`` command starts: the context, made through the driver with the interpreter's lock
released, overlaps the command's imports of the runtime, h5py and MPI. The
thread then waits for :func:`proceed`, which the command calls once those imports have ended: it
imports CuPy on the calling thread and lets the warm-up go on. The backend's selection
(:func:`chainexec.runtime.device.select`) then waits for the loads (:func:`wait`). Where nothing
began it (a run from Python), the selection begins one without the replay and does not wait;
never two for one device.

Why: a fresh process's device would otherwise sit idle for most of the executor's first tiles
while these first uses load. Begun with the backend, just before the executor, a replay of the
cuBLAS calls would compete with the executor's own first calls (the loads of two threads wait for
each other) and slow it down; begun at the command's start it overlaps the run's reading,
detection and planning instead (a first run's calibration waits for it). CuPy is imported on the
main thread, after its other imports: imported on this thread beside them (NumPy with it) it
gains little (both hold the interpreter's lock) and risks the import system's deadlock detection
failing one of the two imports, which would leave the main thread a CuPy half imported. Nothing
here is needed for correctness: a failure only leaves the loading to the first real use, which
reports any real fault itself.
"""

from __future__ import annotations

import ctypes
import re
import threading

from chainexec.runtime import uselog
from chainexec.runtime.comm import env_local_rank, launched

STAND_IN_BYTES = 256 * 2**20
"""A logged cuBLAS call whose stand-in matrices would take more device memory than this is not
made again."""

KERNEL = r"chainexec_\w+"
"""The names the runtime's generated kernels have; a logged use of another name is not replayed
(the log is trusted as the kernel cache beside it is, and read as carefully)."""

WAIT = 60.0
"""Seconds the backend's selection waits at most for the warm-up begun at the process's start."""

_LOCK = threading.Lock()
_CLAIMED: set[int] = set()  # devices whose warm-up this process has begun
_EARLY: list[threading.Thread] = []  # the warm-up begun by :func:`start`
_LATE: list[threading.Thread] = []  # those begun by the backend's selection (:func:`begin`)
_GO = threading.Event()  # set by :func:`proceed`: the warm-up may import CuPy and load
_FREE: dict[int, int] = {}  # device -> its free bytes, read by :func:`context` as it made the context


def claim(device: int) -> bool:
    """True the first time this process asks for ``device``: the caller then warms it up."""
    with _LOCK:
        if device in _CLAIMED:
            return False
        _CLAIMED.add(device)
        return True


def start(config, backend: str = "auto") -> None:
    """Begin the warm-up of a run of ``config`` now, at a process's start, where the GPU this
    rank will use is already known: the launcher's local rank
    (:func:`chainexec.runtime.comm.env_local_rank`) or a process started without a launcher
    (GPU 0). Does nothing for the NumPy backend, under a launcher that does not say the local
    rank, or without CuPy or a GPU. A config that is missing or unreadable is the run's to report:
this only takes its path."""
    _FREE.clear()  # a server's earlier runs' figures (chainexec.server), whether or not this one warms up
    local = env_local_rank()
    if backend == "numpy" or (local is None and launched()):
        return
    thread = threading.Thread(target=_early, args=(local or 0, uselog.job_of(config)), name="chainexec-warm-up")
    _EARLY[:] = [t for t in _EARLY if t.is_alive()]  # a server's earlier runs' (chainexec.server)
    _EARLY.append(thread)
    thread.start()


def proceed() -> None:
    """Let the warm-up :func:`start` began go on past the CUDA context: import CuPy on the calling
    thread (the main thread, once its own imports have ended: never two threads importing at once),
    then release the warm-up, which uses that CuPy. Does nothing where none began or after the
    first call; a CuPy that does not import is left to the backend's selection to report."""
    if not _EARLY or _GO.is_set():
        return
    try:
        import cupy  # noqa: F401
    except Exception:  # no cupy: the warm-up finds none either and ends
        pass
    finally:
        _GO.set()


def busy() -> bool:
    """Whether the warm-up :func:`start` began is still loading."""
    return any(thread.is_alive() for thread in _EARLY)


def prepare(device: str, job: str) -> None:
    """Make on the calling thread the host-side preparations that the log holds for ``job`` on
    ``device`` (a name): :func:`chainexec.runtime.pointwise.prepare` each. The backend's
    selection calls it while the warm-up is still loading (:func:`busy`), a wait in which the
    main thread has nothing else to do and the loads mostly run outside the interpreter's
    lock. The preparations take longer here than in the executor (the warm-up's own Python
    shares the lock), but within a wait that is no longer for them. Best effort: a use that
    cannot be made is left to the run."""
    from chainexec.runtime import pointwise

    for name, text in uselog.uses(device, job)["prepared"]:
        try:
            pointwise.prepare(str(name), str(text))
        except Exception:  # a log written by other code: the run makes what it needs itself
            pass


def wait() -> None:
    """Wait (at most :data:`WAIT` seconds) for the warm-up :func:`start` began (releasing it first:
    :func:`proceed`), so that the run's first statements do not compete with its loads: in a
    fresh (T) process the executor's first cuBLAS call and the warm-up's replay of the same calls
    would wait for each other's kernel loads (the device's module loads are serialised), and a
    calibration's device timings would be skewed by the compiles and loads beside them. Returns
    at once where none was begun."""
    proceed()
    for thread in _EARLY:
        thread.join(WAIT)


def begin(cupy, device: int) -> None:
    """Begin a warm-up of ``device`` without the replay on a thread of its own, where nothing
    began one (:func:`claim`): the backend's selection's, for a run from Python, which does
    not wait for it (:func:`settle` does)."""
    if claim(device):
        thread = threading.Thread(target=warm_up, args=(cupy, device), name="chainexec-warm-up")
        _LATE.append(thread)
        thread.start()


def settle() -> None:
    """Wait for every warm-up this process began: a calibration's, before it times the device,
    which loads beside it would skew."""
    wait()
    for thread in _LATE:
        thread.join()


def context(local: int) -> None:
    """Create the CUDA context of GPU ``local mod GPUs`` (its primary context, the one CuPy then
    uses) through the driver library directly, and read the GPU's free memory in it
    (:func:`free_memory`). Why: CUDA's start (``cuInit``) and the context's creation take time the
    run would otherwise wait for, and a call through ``ctypes`` (imported with this module: the
    thread imports nothing) releases the interpreter's lock, so they overlap the imports of the
    main thread. Nothing happens where the driver library is missing or a call fails."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    count, device, ctx = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p()
    if (cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
            and cuda.cuDeviceGet(ctypes.byref(device), local % count.value) == 0
            and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) == 0):  # kept for the process's life
        free, total, popped = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_void_p()
        if cuda.cuCtxPushCurrent_v2(ctx) == 0:
            if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0:
                _FREE[local % count.value] = free.value
            cuda.cuCtxPopCurrent_v2(ctypes.byref(popped))


def free_memory(device: int) -> int | None:
    """Bytes free on GPU ``device`` when this run's start made its context (:func:`context`),
    before the warm-up allocated or loaded anything there; None where the start has not (yet)
    made it. The machine's detection (:func:`chainexec.detect.here`) reads it instead of asking
    the device: while the warm-up loads its kernels, a query of the device waits for those loads."""
    return _FREE.get(device)


def _early(local: int, job: str) -> None:
    try:
        context(local)
        if not _GO.wait(WAIT):  # :func:`proceed` never came: importing here could race the main thread's
            return
        import cupy  # imported by :func:`proceed` on the main thread: found in sys.modules

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no cupy, no driver, no device: the backend's selection says so itself
        return
    if count > 0 and claim(local % count):
        warm_up(cupy, local % count, job)


def warm_up(cupy, device: int, job: str | None = None) -> None:
    """Load, on a stream of its own (non-blocking: the run's streams never wait for it), the
    libraries and kernels every run uses, each by one call on a few elements, then, given a
    ``job``, what its earlier runs used on ``device`` (:func:`replay`) and the page-locked
    upload arena (:func:`chainexec.runtime.arena.prepare`): only where the run waits for the
    warm-up (:func:`wait`), since a replay beside the run's statements slows them and would skew
    the autotuner's timings, and a page-locked allocation waits for the device. The reductions'
    last step is :func:`chainexec.runtime.pointwise.total`, not CUB: loaded here, CUB's module
    load would hold up the executor's first GEMM."""
    try:
        from chainexec.runtime import arena, pointwise

        # its own loads are not the run's uses (uselog.paused is per thread)
        with uselog.paused(), cupy.cuda.Device(device), cupy.cuda.Stream(non_blocking=True) as stream:
            try:  # tile operations, batched GEMMs' addresses, reductions' last step
                pointwise.load_common(cupy)
            except Exception:  # compiled where a launch needs them; the rest still loads
                pass
            x = cupy.zeros((8, 8), cupy.float64)
            x @ x  # cuBLAS
            if job is not None:
                arena.prepare(cupy)  # its allocation waits for the device: before the run only
                replay(cupy, uselog.device_name(cupy, device), job)
            stream.synchronize()
            # the stand-ins' blocks are kept per stream in CuPy's pool: no use to the run's streams
            cupy.get_default_memory_pool().free_all_blocks(stream=stream)
    except Exception:  # best effort by design (see the module's docstring)
        pass


def replay(cupy, device: str, job: str) -> None:
    """Use again, on the current device and stream, what the log holds for ``job`` on ``device``
    (a name): each cuBLAS call once on stand-in matrices of zeros (every matrix of a batch the
    same one: stride 0, or one address repeated; calls over :data:`STAND_IN_BYTES` skipped), each
    generated kernel loaded into the kernel cache's per-device table
    (:func:`chainexec.runtime.kernelcache.preload`, :func:`chainexec.runtime.pointwise.preload`)."""
    from chainexec.runtime import kernelcache, pointwise

    logged = uselog.uses(device, job)
    for key, name in logged["modules"]:
        if re.fullmatch(r"[0-9a-f]{64}", str(key)) and re.fullmatch(KERNEL, str(name)):  # a file name
            kernelcache.preload(name, key)
    for name, text in logged["sources"]:
        if re.fullmatch(KERNEL, str(name)) and isinstance(text, str):
            pointwise.preload(text, name)
    for call in logged["gemms"]:
        _gemm(cupy, call)


def sizes(call: tuple) -> tuple[int, int, int]:
    """Elements of the stand-in A, B and C of a logged cuBLAS call (column-major, as cuBLAS reads
    them): A is ``lda`` by k (m where transposed), B ``ldb`` by n (k where transposed), C ``ldc``
    by n."""
    _, _, ta, tb, m, n, k, lda, ldb, ldc, _, _ = call
    return lda * (m if ta else k), ldb * (k if tb else n), ldc * n


def _gemm(cupy, call: tuple) -> None:
    from cupy_backends.cuda.libs import cublas

    from chainexec.kernels.batchedgemm import gemm_scalars

    precision, strided, ta, tb, m, n, k, lda, ldb, ldc, count, beta = call
    dtype = cupy.float64 if precision == "d" else cupy.float32
    if sum(sizes(call)) * dtype().itemsize > STAND_IN_BYTES:
        return
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    a, b, c = (cupy.zeros(size, dtype) for size in sizes(call))
    ops = tuple(cublas.CUBLAS_OP_T if t else cublas.CUBLAS_OP_N for t in (ta, tb))
    if strided:
        gemm = cublas.dgemmStridedBatched if precision == "d" else cublas.sgemmStridedBatched
        keep, one, two = gemm_scalars(gemm, 1.0, beta, dtype)
        gemm(handle, *ops, m, n, k, one, a.data.ptr, lda, 0, b.data.ptr, ldb, 0, two, c.data.ptr, ldc, 0, count)
    else:
        gemm = cublas.dgemmBatched if precision == "d" else cublas.sgemmBatched
        keep, one, two = gemm_scalars(gemm, 1.0, beta, dtype)
        table = cupy.asarray([[x.data.ptr] * count for x in (a, b, c)], dtype=cupy.uint64)
        gemm(handle, *ops, m, n, k, one, table[0].data.ptr, lda, table[1].data.ptr, ldb, two,
             table[2].data.ptr, ldc, count)
