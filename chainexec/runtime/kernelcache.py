"""The one compile cache of generated kernels: NVRTC compiles a source to a CUBIN once per
machine, and each device loads it once per process.

Every generated kernel goes through :func:`function`: the contraction kernels
(:mod:`chainexec.runtime.launch`: COGENT, GETT, sum kernels) and the point-wise ones
(:mod:`chainexec.runtime.pointwise`). A CUBIN is kept on disk in a
:class:`chainexec.diskstore.Store` in ``$CHAINEXEC_KERNEL_CACHE`` (default
``~/.cache/chainexec/kernels``), in a file named by :func:`cache_key`, the SHA-256 of its source,
the architecture (``sm_<compute capability>``), the compiler options and the NVRTC version: the
compiler's version in the key does what a store's format version does, so the store has none of
its own. Files are written whole, so concurrent processes never read half of one, each with its
SHA-256 in a file beside it (a :attr:`~chainexec.diskstore.Store.plain` store: CUDA loads a CUBIN
from its path): a CUBIN that does not match it (emptied, damaged) is compiled again and replaced,
not loaded (CUDA would refuse it in every later run). In the process,
each device loads a CUBIN's module once, and a per-device table holds each function loaded from
it by (key, name, device): a source may hold several kernels. CuPy is imported where a kernel
is compiled or loaded: the module imports on machines without it.
"""

from __future__ import annotations

import os
import threading
import time
from functools import lru_cache
from pathlib import Path

from chainexec import diskstore
from chainexec.errors import ChainexecError
from chainexec.runtime import uselog

OPTIONS = ("--std=c++17",)
"""NVRTC options besides the architecture for the contraction kernels (part of the cache key)."""
POINTWISE_OPTIONS = ("--std=c++17", "-ftz=true")
"""NVRTC options for the point-wise kernels: single-precision denormals flushed to zero, as CuPy
compiles its own kernels (``cupy.RawKernel``)."""

_LOADED: dict = {}  # (cache key, kernel name, device) -> function
_MODULES: dict = {}  # (cache key, device) -> its loaded module
_KEYS: dict = {}  # (source, architecture, options) -> cache key, so that a launch hashes no source
_LOCK = threading.Lock()
_COMPILED = [0.0, 0]  # NVRTC seconds in this process (summed over compiling threads), kernels compiled


def compiled() -> tuple[float, int]:
    """Seconds NVRTC has spent compiling in this process, summed over the threads that compile at
    once (:func:`precompile`), and the number of kernels it compiled: the compile part of a
    first run's time, which a run with every CUBIN in the disk cache does not pay."""
    with _LOCK:
        return _COMPILED[0], _COMPILED[1]


CACHE = "CHAINEXEC_KERNEL_CACHE"
"""The environment variable naming the kernel cache's folder."""


def cache_dir() -> Path:
    """Folder of the kernel cache (created on first use, :func:`made`): CUBINs, the autotuner's
    decisions (``tuning/``) and the warm-up's use log (``uses.json``)."""
    return diskstore.folder("kernels", CACHE)


def made() -> Path:
    """:func:`cache_dir`, made where missing; a :class:`ChainexecError` naming it where it cannot
    be (a file there, or a folder above it that cannot be written)."""
    where = cache_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ChainexecError(f"cannot make the kernel cache folder ({err.strerror or err}): set ${CACHE} to a "
                             "writable folder", str(where)) from None
    return where


def _store() -> diskstore.Store:
    """The CUBINs' store: ``<key>.cubin`` files in :func:`cache_dir` (:func:`made`), each with its
    digest beside it, private to the user."""
    return diskstore.Store(made(), suffix=".cubin", plain=True)


@lru_cache(maxsize=1)
def compiler_version() -> str:
    """The NVRTC version CuPy binds, as ``major.minor``."""
    from cupy_backends.cuda.libs import nvrtc

    return ".".join(map(str, nvrtc.getVersion()))


def cache_key(source: str, compute_capability: str, options: tuple[str, ...] = OPTIONS) -> str:
    """SHA-256 hex digest of the source, the compute capability (e.g. ``"90"``), the options and
    the compiler's version: a CUBIN's file name."""
    return diskstore.digest("\0".join((source, compute_capability, *options, compiler_version())))


def compile_cubin(source: str, name: str, compute_capability: str, options: tuple[str, ...] = OPTIONS) -> bytes:
    """Compile ``source`` to a CUBIN for ``sm_<compute_capability>`` with NVRTC.

    Raises RuntimeError with NVRTC's log when compilation fails."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture=sm_{compute_capability}", *options])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed for {name}:\n{nvrtc.getProgramLog(prog)}") from exc
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _key(source: str, compute_capability: str, options: tuple[str, ...]) -> str:
    """:func:`cache_key`, computed once per process and source."""
    found = _KEYS.get((source, compute_capability, options))
    if found is None:
        found = _KEYS.setdefault((source, compute_capability, options), cache_key(source, compute_capability, options))
    return found


def _cached_cubin(name: str, source: str, compute_capability: str, options: tuple[str, ...]) -> Path:
    """The disk cache's CUBIN of ``source``, compiled on a miss (none, or one that does not match
    its digest, :meth:`~chainexec.diskstore.Store.find`)."""
    store, key = _store(), _key(source, compute_capability, options)
    if store.find(key) is not None:
        return store.path(key)
    start = time.perf_counter()
    cubin = compile_cubin(source, name, compute_capability, options)
    with _LOCK:
        _COMPILED[0] += time.perf_counter() - start
        _COMPILED[1] += 1
    try:
        return store.save(key, cubin)
    except OSError as err:  # CUDA loads a CUBIN from its file: without one the kernel cannot run
        raise ChainexecError(f"cannot keep a compiled kernel in the kernel cache ({err.strerror or err}): set "
                             f"${CACHE} to a writable folder", str(store.path(key).parent)) from None


def precompile(kernels: list[tuple[str, str]], compute_capability: str, options: tuple[str, ...] = OPTIONS) -> None:
    """Put the CUBINs of ``kernels`` ((name, source) pairs) in the disk cache, compiling the
    missing ones (where there are two or more) at once in threads on this rank's share of the
    node's CPUs (NVRTC runs without the GIL), so that :func:`function` then only loads them. A
    source that fails to compile is left out here: it fails again where it is loaded, and the
    autotuner scores that candidate as it always does. The autotuner times a run of terms'
    sum-kernel candidates one after another: compiled one by one, their NVRTC time would add up
    to most of a first run's time."""
    from concurrent.futures import ThreadPoolExecutor

    from chainexec.runtime.comm import local_size

    store = _store()
    missing = list({_key(src, compute_capability, options): (name, src) for name, src in kernels
                    if store.find(_key(src, compute_capability, options)) is None}.values())
    if len(missing) < 2:
        return

    def build(job):
        try:
            _cached_cubin(*job, compute_capability, options)
        except RuntimeError:  # NVRTC's error: raised again, with its log, where the kernel is loaded
            pass

    with ThreadPoolExecutor(min(len(missing), max(1, len(os.sched_getaffinity(0)) // local_size()))) as pool:
        list(pool.map(build, missing))


def function(name: str, source: str, options: tuple[str, ...] = OPTIONS) -> tuple:
    """The CuPy kernel function ``name`` of ``source`` on the current device, and its CUBIN's
    cache key: from the per-device table, else from the disk cache, compiled only on a miss. A
    launch is a use for the next process's warm-up only where its caller notes it (:func:`note`,
    :mod:`chainexec.runtime.uselog`): a kernel loaded to be timed or to see that it can be made
    is not logged."""
    import cupy

    dev = cupy.cuda.Device()
    cc = str(dev.compute_capability)
    key = _key(source, cc, options)
    with _LOCK:
        fn = _LOADED.get((key, name, dev.id))
    return (fn if fn is not None else _kept(name, _cached_cubin(name, source, cc, options), key, dev.id)), key


def _kept(name: str, cubin: Path, key: str, device: int):
    """Function ``name`` of the CUBIN file ``cubin`` (cache key ``key``) on ``device``, kept in
    the per-device table (the one already there where another thread was first), from the
    module loaded once per device."""
    import cupy

    with _LOCK:
        module = _MODULES.get((key, device))
    if module is None:
        module = cupy.RawModule(path=str(cubin))
        with _LOCK:
            module = _MODULES.setdefault((key, device), module)
    fn = module.get_function(name)
    with _LOCK:
        return _LOADED.setdefault((key, name, device), fn)


def note(key: str, name: str) -> None:
    """A launch of kernel ``name`` of the CUBIN ``key`` (:mod:`chainexec.runtime.uselog`,
    ``modules``)."""
    import cupy

    uselog.note(uselog.device_name(cupy), "modules", (key, name))


def preload(name: str, key: str) -> None:
    """Load kernel ``name`` of the cached CUBIN ``key`` on the current device into the per-device
    table where the disk cache holds it intact (:meth:`~chainexec.diskstore.Store.find`): the
    function itself, not only its module. The warm-up's way to load a logged kernel before
    :func:`function` asks for it."""
    import cupy

    store = _store()
    dev = cupy.cuda.Device()
    if (key, name, dev.id) not in _LOADED and store.find(key) is not None:
        _ = _kept(name, store.path(key), key, dev.id).num_regs  # reading an attribute makes lazy loading load it
