"""Launches of the generated contraction kernels: COGENT (:mod:`chainexec.kernels.codegen`),
GETT (:mod:`chainexec.kernels.gett`) and the sum kernels (:mod:`chainexec.kernels.sumkernel`,
:mod:`chainexec.kernels.summma`), compiled and loaded through the kernel cache
(:mod:`chainexec.runtime.kernelcache`). CuPy is imported where a kernel is launched: this module
imports on machines without it.

Arrays are row-major (C order) CuPy arrays; the last index of each index string is stride-1.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from chainexec.kernels import gett, sumkernel, summma
from chainexec.kernels.codegen import generate, grid_size, kernel_params
from chainexec.kernels.kernelconf import Device, KernelConfig, choose_config, parse_contraction
from chainexec.runtime import kernelcache

_GETT: dict = {}  # (GETT configuration, device) -> (function, CUBIN key)
_SUM: dict = {}  # (sum problem, configuration, device) -> (function, blocks, threads, shared memory, CUBIN key, name)
_LOCK = threading.Lock()


@dataclass(frozen=True)
class ContractionKernel:
    """A compiled kernel for ``C[c] = alpha * sum A[a]*B[b] + beta * C[c]`` (any extents)."""

    config: KernelConfig
    name: str
    source: str
    params: tuple[str, ...]
    function: object
    cubin: str  # the CUBIN's cache key: each call is a use of it (:func:`chainexec.runtime.kernelcache.note`)

    def extents(self, A, B, C=None) -> dict:
        """Extents of every index read off the array shapes; ValueError if they disagree."""
        out: dict = {}
        for arr, idx, label in ((A, self.config.a, "A"), (B, self.config.b, "B"),
                                (C, self.config.c, "C")):
            if arr is None:
                continue
            if arr.ndim != len(idx):
                raise ValueError(f"{label} has {arr.ndim} dims, expected {len(idx)} ({idx})")
            for i, n in zip(idx, arr.shape):
                if out.setdefault(i, int(n)) != n:
                    raise ValueError(f"extent of {i!r} is {out[i]} elsewhere but {n} in {label}")
        return out

    def __call__(self, A, B, C=None, alpha: float = 1.0, beta: float = 0.0, stream=None):
        """Compute into ``C`` (allocated when None, then ``beta`` must be 0) and return it.

        All arrays must be C-contiguous CuPy arrays of the kernel's dtype; ``C`` must not
        overlap ``A`` or ``B``.  With ``beta == 0`` the old contents of C are not read."""
        import cupy
        import numpy as np

        dtype = np.dtype(self.config.dtype)
        ext = self.extents(A, B, C)
        if C is None:
            if beta != 0:
                raise ValueError("beta != 0 needs an existing C")
            C = cupy.empty(tuple(ext[i] for i in self.config.c), dtype=dtype)
        for label, arr in (("A", A), ("B", B), ("C", C)):
            if not isinstance(arr, cupy.ndarray) or arr.dtype != dtype:
                raise ValueError(f"{label} must be a cupy array of {dtype}")
            if not arr.flags.c_contiguous:
                raise ValueError(f"{label} must be C-contiguous (row-major)")
        if max(ext.values()) >= 2**31:
            raise ValueError("extents must be below 2**31")
        if min(ext.values()) == 0 or A.size == 0 or B.size == 0:
            raise ValueError("zero-sized extents are not supported")
        kernelcache.note(self.cubin, self.name)  # each call: a kernel made to be timed or checked is no use
        args = (C, A, B, *(np.int32(ext[i]) for i in self.params), dtype.type(alpha),
                dtype.type(beta))
        launch = (grid_size(self.config, ext),), (self.config.threads,), args
        if stream is None:
            self.function(*launch)
        else:
            with stream:
                self.function(*launch)
        return C


def device_model(device_id: int | None = None) -> Device:
    """The :class:`~chainexec.kernels.kernelconf.Device` limits of a GPU (default: the current one),
    read through CuPy."""
    import cupy

    dev = cupy.cuda.Device(device_id)
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    return Device(name=name.decode() if isinstance(name, bytes) else str(name),
                  compute_capability=f"{props['major']}{props['minor']}",
                  sm_count=int(props["multiProcessorCount"]),
                  smem_per_block=int(props["sharedMemPerBlock"]),
                  smem_per_sm=int(props["sharedMemPerMultiprocessor"]),
                  regs_per_thread=255, regs_per_sm=int(props["regsPerMultiprocessor"]),
                  max_threads_per_block=int(props["maxThreadsPerBlock"]),
                  max_threads_per_sm=int(props["maxThreadsPerMultiProcessor"]),
                  smem_optin=int(props["sharedMemPerBlockOptin"]) if "sharedMemPerBlockOptin" in props else None)


def kernel_source(c, a, b, sizes: dict, dtype: str, config: KernelConfig | None = None,
                  device: Device | None = None) -> tuple[KernelConfig, str, str]:
    """(configuration, name, CUDA source) of a contraction's COGENT kernel: the model's choice for
    the representative ``sizes`` on ``device`` (default: the current GPU, :func:`device_model`)
    unless ``config`` is given. Raises ValueError where none applies."""
    parse_contraction(c, a, b, sizes)
    if config is None:
        config = choose_config(c, a, b, sizes, dtype, device or device_model())
    return (config, *generate(c, a, b, sizes, dtype, config))


def get_kernel(c, a, b, sizes: dict, dtype: str, config: KernelConfig | None = None,
               device: Device | None = None) -> ContractionKernel:
    """Compiled kernel for a contraction (:func:`kernel_source`)."""
    config, name, source = kernel_source(c, a, b, sizes, dtype, config, device)
    function, cubin = kernelcache.function(name, source)
    return ContractionKernel(config=config, name=name, source=source, params=kernel_params(c, a, b),
                             function=function, cubin=cubin)


def gett_function(cfg) -> tuple:
    """(compiled GETT kernel, CUBIN key) of ``cfg`` (:mod:`chainexec.kernels.gett`) on the
    current device, opted into the dynamic shared memory it needs (beyond the 48 KiB default).
    Kept per (configuration, device): a launch per tile must not regenerate and hash the source.
    Loading is not a use; :func:`launch_gett` notes each launch."""
    import cupy

    key = (cfg, cupy.cuda.Device().id)
    with _LOCK:
        kept = _GETT.get(key)
    if kept is None:
        fn, cubin = kernelcache.function(cfg.name(), gett.source(cfg))
        if fn.max_dynamic_shared_size_bytes < cfg.smem_bytes():
            fn.max_dynamic_shared_size_bytes = cfg.smem_bytes()
        kept = (fn, cubin)
        with _LOCK:
            _GETT[key] = kept
    return kept


class GettTables:
    """The offset tables of one (contraction, shapes, strides) on the device, in one buffer.

    Built once and reused for every tile of the same shape; ``views`` are the nine table
    pointers in the kernel's argument order."""

    def __init__(self, problem, strides, host: dict | None = None):
        """``host``: the tables already made by :func:`chainexec.kernels.gett.tables`, if they were."""
        import cupy
        import numpy as np

        host = host or gett.tables(problem, strides)
        flat = np.concatenate([host[t] for t in gett.TABLE_ORDER])
        self.buffer = cupy.asarray(flat)
        cuts = np.cumsum([0] + [host[t].size for t in gett.TABLE_ORDER])
        self.views = tuple(self.buffer[a:b] for a, b in zip(cuts[:-1], cuts[1:]))
        self.dims = problem.dims
        self.wide = problem.wide
        self.bulk_run = problem.bulk_run
        self._launches: dict = {}

    def launches(self, cfg, parts: int = 1) -> tuple:
        """(function, CUBIN key, name, threads, shared memory bytes, index type, [(grid, table
        and extent arguments)] per launch) of ``cfg`` with its sum split into ``parts``
        (gridDim.z, :func:`chainexec.kernels.gett.split_configs`) at the tables' index width,
        made at the first call and kept per (configuration, parts, device): a launch per tile
        then only adds the operands, the parts' distance and the scalars. Batches beyond
        gridDim.y's limit go in several launches, each with its slice of the batch tables.
        Raises ValueError for a short-sum or bulk-copy configuration whose sum is shorter than the
        tables' (:attr:`~chainexec.kernels.gett.GettConfig.span`), and for a bulk-copy one whose
        copies do not fit B's runs along n (:func:`~chainexec.kernels.gett.bulk_copies`)."""
        import cupy

        key = (cfg, parts, cupy.cuda.Device().id)
        kept = self._launches.get(key)
        if kept is None:
            import numpy as np

            run = cfg if cfg.wide == self.wide else replace(cfg, wide=self.wide)
            M, N, K, L = self.dims
            if run.span and K > run.bk:
                raise ValueError(f"{run.name()} sums at most {run.bk} elements, not {K}")
            if run.bulk and gett.bulk_copies(self.bulk_run, N, run.chunk()) != run.copies:
                raise ValueError(f"{run.name()} copies chunks of {run.chunk()} columns of B in {run.copies} "
                                 f"runs, which B does not hold here (runs of {self.bulk_run}, N = {N})")
            fn, cubin = gett_function(run)
            index = np.int64 if run.wide else np.int32
            tiles_n = -(-N // run.bn)
            blocks = -(-M // run.bm) * tiles_n
            am, ak, al, bk, bn, bl, cm, cn, cl = self.views
            extents = (index(M), index(N), index(K), index(tiles_n))
            kept = self._launches[key] = (fn, cubin, run.name(), run.threads, run.smem_bytes(), index, [
                ((blocks, min(L, l0 + MAX_GRID_Y) - l0, parts),
                 (am, ak, al[l0:l0 + MAX_GRID_Y], bk, bn, bl[l0:l0 + MAX_GRID_Y], cm, cn, cl[l0:l0 + MAX_GRID_Y],
                  *extents))
                for l0 in range(0, L, MAX_GRID_Y)])
        return kept


SUM_KINDS = {"sum": (sumkernel, sumkernel.SumConfig), "summma": (summma, summma.MmaConfig)}
"""The generated kernels for a run of contractions into one buffer, by method name: the register
kernel (FP64/FP32 CUDA cores) and the FP64 tensor-core one; (generator module, config class)."""


def launch_sum(kind: str, problem, cfg, C, operands, store: bool = True) -> None:
    """``C += Σ_t f_t · A_t·B_t`` by the generated sum kernel ``kind`` (:data:`SUM_KINDS`) of
    ``problem`` (its views' shapes and strides are those of ``C`` and ``operands``, a list of
    (A_t, B_t) CuPy arrays or views) and ``cfg``; ``store=False`` computes without writing (for
    timing). The compiled function is kept per (problem, config, device), opted into the dynamic
    shared memory it needs: generating and hashing the source of a twelve-term kernel costs
    milliseconds a tile."""
    import cupy
    import numpy as np

    key = (problem, cfg, cupy.cuda.Device().id)
    with _LOCK:
        kept = _SUM.get(key)
    if kept is None:
        gen = SUM_KINDS[kind][0]
        name, source = gen.generate(problem, cfg)
        fn, cubin = kernelcache.function(name, source)
        shape = gen.launch_shape(problem, cfg)
        if fn.max_dynamic_shared_size_bytes < shape[2]:
            fn.max_dynamic_shared_size_bytes = shape[2]
        kept = (fn, *shape, cubin, name)
        with _LOCK:
            _SUM[key] = kept
    fn, nblocks, threads, smem, cubin, name = kept
    kernelcache.note(cubin, name)  # each launch: the autotuner's first one is paused
    args = [C] + [x for pair in operands for x in pair] + [np.int32(1 if store else 0)]
    fn((nblocks,), (threads,), tuple(args), shared_mem=smem)


BULK_ALIGN = 16
"""Bytes a bulk copy's source address must be aligned to (the bulk-copy kernel's B base)."""


def bulk_fits(cfg, problem, B) -> bool:
    """Whether the bulk-copy configuration ``cfg`` can copy the CuPy array or view ``B`` (the
    operand playing B) of ``problem`` (a :class:`~chainexec.kernels.gett.Problem`): its copies
    those B's runs along n take (:func:`~chainexec.kernels.gett.bulk_copies`), its base on
    :data:`BULK_ALIGN` bytes."""
    return (gett.bulk_copies(problem.bulk_run, problem.dims[1], cfg.chunk()) == cfg.copies
            and B.data.ptr % BULK_ALIGN == 0)
MAX_GRID_Y = 65535
"""CUDA's limit on gridDim.y (the batch dimension of a GETT launch)."""


def launch_gett(cfg, tables: GettTables, C, A, B, alpha: float, beta: float, parts: int = 1) -> None:
    """``C = alpha·A·B + beta·C`` over the tables' index groups, for CuPy float64 arrays or
    views (the tables already hold their strides; A and B as the tables were built, i.e.
    swapped by the caller when the problem says so). With ``parts > 1`` the sum is split
    (:func:`chainexec.kernels.gett.split_configs`): ``C`` is then a C-contiguous stack of
    ``parts`` outputs, the tables built on the strides of one, and part ``z`` writes its partial
    product into ``C[z]``. The kernel's index width is the tables' (``cfg.wide`` is set from them;
    :meth:`GettTables.launches`). Raises ValueError for a bulk-copy configuration where B's base
    is not on :data:`BULK_ALIGN` bytes, and for a split one that is not a GETT configuration
    (the short-sum and bulk-copy kernels do not split), whose ``C`` is not such a stack, or
    whose stack 32-bit offsets do not reach (:data:`~chainexec.kernels.gett.NARROW`)."""
    import numpy as np

    fn, cubin, name, threads, smem, index, launches = tables.launches(cfg, parts)
    if cfg.bulk and B.data.ptr % BULK_ALIGN:
        raise ValueError(f"{name} copies B by bulk copies, which need its base on {BULK_ALIGN} bytes")
    if parts > 1 and (cfg.span or C.shape[0] != parts or not C.flags.c_contiguous
                      or (index is np.int32 and C.size >= gett.NARROW)):
        raise ValueError(f"{name} split into {parts} parts needs a GETT configuration and a C-contiguous stack of "
                         f"{parts} outputs within its offsets' reach, not shape {C.shape}")
    kernelcache.note(cubin, name)  # each call: the autotuner's first one is paused
    tail = (index(C.size // parts if parts > 1 else 0), np.float64(alpha), np.float64(beta))
    for grid, args in launches:
        fn(grid, (threads,), (C, A, B, *args, *tail), shared_mem=smem)
