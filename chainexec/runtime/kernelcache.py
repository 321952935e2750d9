"""The one compile cache of generated kernels: NVRTC compiles a source to a CUBIN once per
machine, and each device loads it once per process.

Every generated kernel goes through :func:`function`: the contraction kernels
(:mod:`chainexec.runtime.launch`: COGENT, GETT, sum kernels) and the point-wise ones
(:mod:`chainexec.runtime.pointwise`). A CUBIN is kept on disk under
``$CHAINEXEC_KERNEL_CACHE`` (default ``~/.cache/chainexec/kernels``) in a file named by
:func:`cache_key`, the SHA-256 of its source, the architecture (``sm_<compute capability>``), the
compiler options and the NVRTC version, and written whole (temporary file, then rename), so
concurrent processes never read half a file. In the process, a per-device table holds each
loaded function by (key, device). CuPy is imported where a kernel is compiled or loaded: the
module imports on machines without it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from functools import lru_cache
from pathlib import Path

from chainexec import atomicfile
from chainexec.runtime import uselog

OPTIONS = ("--std=c++17",)
"""NVRTC options besides the architecture for the contraction kernels (part of the cache key)."""
POINTWISE_OPTIONS = ("--std=c++17", "-ftz=true")
"""NVRTC options for the point-wise kernels: single-precision denormals flushed to zero, as CuPy
compiles its own kernels (``cupy.RawKernel``), which the point-wise kernels were compiled as."""

_LOADED: dict = {}  # (cache key, device) -> function
_KEYS: dict = {}  # (source, architecture, options) -> cache key, so that a launch hashes no source
_LOCK = threading.Lock()


def cache_dir() -> Path:
    """Folder of the kernel cache (created on first use): CUBINs, the autotuner's decisions
    (``tuning/``) and the warm-up's use log (``uses.json``)."""
    return Path(os.environ.get("CHAINEXEC_KERNEL_CACHE",
                               Path.home() / ".cache" / "chainexec" / "kernels"))


@lru_cache(maxsize=1)
def compiler_version() -> str:
    """The NVRTC version CuPy binds, as ``major.minor``."""
    from cupy_backends.cuda.libs import nvrtc

    return ".".join(map(str, nvrtc.getVersion()))


def cache_key(source: str, compute_capability: str, options: tuple[str, ...] = OPTIONS) -> str:
    """SHA-256 hex digest of the source, the compute capability (e.g. ``"90"``), the options and
    the compiler's version: a CUBIN's file name."""
    text = "\0".join((source, compute_capability, *options, compiler_version()))
    return hashlib.sha256(text.encode()).hexdigest()


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
    """The disk cache's CUBIN of ``source``, compiled on a miss."""
    path = cache_dir() / f"{_key(source, compute_capability, options)}.cubin"
    if not path.exists():
        atomicfile.write(path, compile_cubin(source, name, compute_capability, options))
    return path


def precompile(kernels: list[tuple[str, str]], compute_capability: str, options: tuple[str, ...] = OPTIONS) -> None:
    """Put the CUBINs of ``kernels`` ((name, source) pairs) in the disk cache, compiling the
    missing ones (where there are two or more) at once in threads on this rank's share of the
    node's CPUs (NVRTC runs without the GIL), so that :func:`function` then only loads them. A
    source that fails to compile is left out here: it fails again where it is loaded, and the
    autotuner scores that candidate as it always does. Why: the autotuner times a run of terms'
    sum-kernel candidates one after another, and compiled one by one their NVRTC time would add
    up to most of a cold (T) run."""
    from concurrent.futures import ThreadPoolExecutor

    from chainexec.runtime.comm import local_size

    missing = list({_key(src, compute_capability, options): (name, src) for name, src in kernels
                    if not (cache_dir() / f"{_key(src, compute_capability, options)}.cubin").exists()}.values())
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
        fn = _LOADED.get((key, dev.id))
    return (fn if fn is not None else _kept(name, _cached_cubin(name, source, cc, options), key, dev.id)), key


def _kept(name: str, cubin: Path, key: str, device: int):
    """Function ``name`` of the CUBIN file ``cubin`` (cache key ``key``) on ``device``, kept in
    the per-device table (the one already there where another thread was first)."""
    import cupy

    fn = cupy.RawModule(path=str(cubin)).get_function(name)
    with _LOCK:
        return _LOADED.setdefault((key, device), fn)


def note(key: str, name: str) -> None:
    """A launch of kernel ``name`` of the CUBIN ``key`` (:mod:`chainexec.runtime.uselog`,
    ``modules``)."""
    import cupy

    uselog.note(uselog.device_name(cupy), "modules", (key, name))


def preload(name: str, key: str) -> None:
    """Load kernel ``name`` of the cached CUBIN ``key`` on the current device into the per-device
    table where the disk cache holds it: the function itself, not only its module. The warm-up's
    way to load a logged kernel before :func:`function` asks for it."""
    import cupy

    path = cache_dir() / f"{key}.cubin"
    dev = cupy.cuda.Device()
    if (key, dev.id) not in _LOADED and path.exists():
        _ = _kept(name, path, key, dev.id).num_regs  # reading an attribute makes lazy loading load it
