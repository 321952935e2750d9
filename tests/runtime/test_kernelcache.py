"""The kernel cache's CPU side (:mod:`chainexec.runtime.kernelcache`): the key of a CUBIN, compiling
many candidates at once (:func:`kernelcache.precompile`), with NVRTC replaced by a stand-in that
records its calls (the GPU modules compile for real); and, with a stand-in CuPy, that every
family of kernels loads through the one per-device table, and that a kernel's launches are the
uses logged for the next process's warm-up (:mod:`chainexec.runtime.uselog`), not its loading."""

import threading

import numpy as np
import pytest

from chainexec.runtime import kernelcache, launch


@pytest.fixture
def nvrtc(monkeypatch, tmp_path):
    """A stand-in compiler: the CUBIN is the source's bytes; ``bad`` sources fail as NVRTC does."""
    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernelcache, "compiler_version", lambda: "12.4")
    monkeypatch.setattr(kernelcache, "_KEYS", {})
    calls, threads = [], set()

    def compile_cubin(source, name, cc, options):
        calls.append(source)
        threads.add(threading.get_ident())
        if source.startswith("bad"):
            raise RuntimeError(f"NVRTC failed for {name}")
        return f"{cc}:{source}".encode()

    monkeypatch.setattr(kernelcache, "compile_cubin", compile_cubin)
    return calls, threads


def _cubin(source, cc="90", options=kernelcache.OPTIONS):
    return kernelcache.cache_dir() / f"{kernelcache.cache_key(source, cc, options)}.cubin"


def test_precompile_fills_the_cache_once_per_source(nvrtc):
    calls, threads = nvrtc
    jobs = [(f"k{n}", f"src {n}") for n in range(8)] + [("k0", "src 0")]  # one source twice
    kernelcache.precompile(jobs, "90")
    assert sorted(calls) == sorted(f"src {n}" for n in range(8))
    assert all(_cubin(f"src {n}").read_bytes() == f"90:src {n}".encode() for n in range(8))
    assert len(threads) >= 1 and threading.get_ident() not in threads  # compiled in worker threads
    kernelcache.precompile(jobs + [("k9", "src 9"), ("k10", "src 10")], "90")  # only the new ones
    assert sorted(calls[8:]) == ["src 10", "src 9"]


def test_a_failing_source_is_left_for_its_loader(nvrtc):
    """One candidate that does not compile leaves the others compiled and raises nothing here;
    compiling it again (where it is loaded) raises NVRTC's error."""
    calls, _ = nvrtc
    kernelcache.precompile([("a", "src a"), ("bad", "bad source"), ("b", "src b")], "90")
    assert _cubin("src a").exists() and _cubin("src b").exists() and not _cubin("bad source").exists()
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        kernelcache._cached_cubin("bad", "bad source", "90", kernelcache.OPTIONS)
    assert calls.count("bad source") == 2


def test_compile_seconds_count_the_misses_only(nvrtc, monkeypatch):
    """:func:`kernelcache.compiled` adds each compile's seconds (here a stand-in taking 0.05 s),
    summed over the threads that compile at once; a CUBIN read from the disk cache adds nothing."""
    import time

    monkeypatch.setattr(kernelcache, "_COMPILED", [0.0, 0])
    inner = kernelcache.compile_cubin

    def slow(source, name, cc, options):
        time.sleep(0.05)
        return inner(source, name, cc, options)

    monkeypatch.setattr(kernelcache, "compile_cubin", slow)
    kernelcache.precompile([(f"k{n}", f"src {n}") for n in range(4)], "90")
    seconds, kernels = kernelcache.compiled()
    assert kernels == 4 and 4 * 0.05 <= seconds < 4 * 0.05 + 1.0
    kernelcache._cached_cubin("k0", "src 0", "90", kernelcache.OPTIONS)
    assert kernelcache.compiled() == (seconds, 4)
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        kernelcache._cached_cubin("bad", "bad source", "90", kernelcache.OPTIONS)
    assert kernelcache.compiled() == (seconds, 4)


def test_a_single_missing_source_is_left_to_load_function(nvrtc):
    calls, _ = nvrtc
    kernelcache.precompile([("a", "src a")], "90")
    assert calls == [] and not _cubin("src a").exists()


@pytest.mark.parametrize("damage", ["emptied", "edited", "digest-lost", "unsealed"])
def test_a_damaged_cubin_is_compiled_again_and_replaced(nvrtc, damage):
    """A cached CUBIN that does not match the digest written beside it (emptied, changed, its
    digest gone, or one kept without a digest) is a miss: compiled again and replaced, by a
    kernel's load and by :func:`kernelcache.precompile`, not handed to CUDA (which refused it
    with CUDA_ERROR_INVALID_IMAGE in every later run)."""
    calls, _ = nvrtc
    kernelcache.precompile([("a", "src a"), ("b", "src b")], "90")
    cubin = _cubin("src a")
    check = cubin.with_name(cubin.name + ".sha256")
    assert check.is_file() and sorted(calls) == ["src a", "src b"]
    if damage == "emptied":
        cubin.write_bytes(b"")
    elif damage == "edited":
        cubin.write_bytes(b"90:src A")
    elif damage == "digest-lost":
        check.unlink()
    else:
        check.write_text("0" * 64)
    assert kernelcache._cached_cubin("a", "src a", "90", kernelcache.OPTIONS) == cubin
    assert sorted(calls) == ["src a", "src a", "src b"] and cubin.read_bytes() == b"90:src a"
    assert kernelcache._cached_cubin("a", "src a", "90", kernelcache.OPTIONS) == cubin  # whole again: a hit
    assert len(calls) == 3
    cubin.write_bytes(b"")
    kernelcache.precompile([("a", "src a"), ("b", "src b"), ("c", "src c")], "90")
    assert sorted(calls[3:]) == ["src a", "src c"] and cubin.read_bytes() == b"90:src a"


def test_a_kernel_cache_that_is_a_file_is_one_line_naming_it(device, nvrtc, monkeypatch, tmp_path):
    """``$CHAINEXEC_KERNEL_CACHE`` naming a regular file (or a path under one): a
    :class:`ChainexecError` naming it and the variable, as the calibration cache's is, from
    compiling a kernel and from the autotuner's cache, not the file system's traceback."""
    import sys

    from chainexec.errors import ChainexecError
    from chainexec.runtime.backends import tuning

    blocker = tmp_path / "kernels"
    blocker.write_text("")
    for where in (blocker, blocker / "below"):
        monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(where))
        with pytest.raises(ChainexecError) as err:
            kernelcache._cached_cubin("a", "src a", "90", kernelcache.OPTIONS)
        assert err.value.path == str(where) and "\n" not in str(err.value)
        assert str(err.value).startswith(f"{where}: cannot make the kernel cache folder (")
        assert "set $CHAINEXEC_KERNEL_CACHE to a writable folder" in str(err.value)
        with pytest.raises(ChainexecError, match="cannot make the kernel cache folder"):
            tuning.TuningCache.for_device(sys.modules["cupy"])
    assert nvrtc[0] == [] and blocker.read_text() == ""
    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path / "new" / "kernels"))
    assert kernelcache.made() == tmp_path / "new" / "kernels" and kernelcache.made().is_dir()


def test_a_kernel_cache_that_cannot_be_written_is_one_line_naming_it(device, nvrtc, monkeypatch, tmp_path):
    """A kernel cache folder that exists but cannot be written (read-only, another user's): a
    kernel compiled on a miss cannot be kept, and CUDA loads a CUBIN from its file only, so it is
    a :class:`ChainexecError` naming the folder and the variable, not the file system's traceback;
    a kernel already kept there is read as before."""
    from chainexec.errors import ChainexecError

    folder = tmp_path / "kernels"
    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(folder))
    kept = kernelcache._cached_cubin("a", "src a", "90", kernelcache.OPTIONS)

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(kernelcache.diskstore.atomicfile, "write", refused)
    with pytest.raises(ChainexecError) as err:
        kernelcache._cached_cubin("b", "src b", "90", kernelcache.OPTIONS)
    assert err.value.path == str(folder) and "\n" not in str(err.value)
    assert "cannot keep a compiled kernel in the kernel cache (Permission denied)" in str(err.value)
    assert "set $CHAINEXEC_KERNEL_CACHE to a writable folder" in str(err.value)
    assert kernelcache._cached_cubin("a", "src a", "90", kernelcache.OPTIONS) == kept


def test_the_key_is_source_architecture_options_and_compiler(nvrtc, monkeypatch):
    """Two CUBINs share a file only where source, architecture, options and NVRTC version agree."""
    keys = {kernelcache.cache_key("src", "90"), kernelcache.cache_key("src k", "90"),
            kernelcache.cache_key("src", "80"), kernelcache.cache_key("src", "90", kernelcache.POINTWISE_OPTIONS)}
    monkeypatch.setattr(kernelcache, "compiler_version", lambda: "12.8")
    keys.add(kernelcache.cache_key("src", "90"))
    assert len(keys) == 5 and all(len(key) == 64 for key in keys)


def test_threads_share_the_node_among_its_ranks(nvrtc, monkeypatch):
    """More local ranks (Open MPI's variable) than CPUs: one thread each."""
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "100000")
    calls, threads = nvrtc
    kernelcache.precompile([(f"k{n}", f"src {n}") for n in range(4)], "90")
    assert len(calls) == 4 and len(threads) == 1


LOADS: list[str] = []  # the CUBIN files modules were loaded from, in order


class _Function:
    """A loaded kernel as CuPy returns it: its dynamic shared memory limit, and its launches
    (each one's grid and arguments kept)."""

    def __init__(self):
        self.max_dynamic_shared_size_bytes = 0
        self.launches = 0
        self.num_regs = 32
        self.calls = []

    def __call__(self, grid, block, args, **kwargs):
        self.launches += 1
        self.calls.append((grid, args))


@pytest.fixture
def device(nvrtc, monkeypatch):
    """CuPy as the loader sees it (GPU 0 of compute capability 90, modules that hand out
    :class:`_Function`), and the uses noted, paused or not."""
    import sys
    import types

    from chainexec.runtime import uselog

    class Device:
        id, compute_capability = 0, "90"

    class RawModule:
        def __init__(self, path):
            self.path = path
            LOADS.append(path)

        def get_function(self, name):
            fn = _Function()
            fn.name = name
            return fn

    cuda = types.SimpleNamespace(Device=Device, runtime=types.SimpleNamespace(
        getDeviceProperties=lambda device: {"name": b"GPU"}))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda, RawModule=RawModule, asarray=lambda x: x))
    monkeypatch.setattr(uselog, "_NAMES", {})
    monkeypatch.setattr(kernelcache, "_LOADED", {})
    monkeypatch.setattr(kernelcache, "_MODULES", {})
    LOADS.clear()
    for table in ("_GETT", "_SUM"):
        monkeypatch.setattr(launch, table, {})
    noted = []
    monkeypatch.setattr(uselog, "note", lambda device, kind, use: noted.append(
        (kind, use, bool(getattr(uselog._PAUSED, "depth", 0)))))
    return noted


def test_a_gett_kernel_is_noted_at_every_launch(device):
    """The run's uses are noted at every launch, also of the function kept for the tables (a
    tuning run first launches it while timing, paused); loading it is not a use."""
    from chainexec.kernels import gett
    from chainexec.runtime import uselog

    sizes = dict(a=40, b=24, k=16)
    strides = ({"a": 24, "b": 1}, {"a": 16, "k": 1}, {"k": 24, "b": 1})
    tables = launch.GettTables(gett.problem(("a", "b"), ("a", "k"), ("k", "b"), sizes, strides), strides)
    cfg = gett.GettConfig(2, 2, 2, 2, 16, 2, next(iter(gett.MMA_SHAPES)), True, True)
    fn, key = launch.gett_function(cfg)
    assert device == [] and fn.max_dynamic_shared_size_bytes == cfg.smem_bytes()
    with uselog.paused():
        launch.launch_gett(cfg, tables, None, None, None, 1.0, 0.0)
    for _ in range(2):
        launch.launch_gett(cfg, tables, None, None, None, 1.0, 0.0)
    assert launch.gett_function(cfg) == (fn, key) and fn.launches == 3
    assert device == [("modules", (key, cfg.name()), True)] + [("modules", (key, cfg.name()), False)] * 2


def test_a_gett_batch_beyond_the_grid_limit_goes_in_several_launches(device, monkeypatch):
    """A batch of more than gridDim.y's limit blocks (here the limit set to 3, a batch of 7) is
    launched in slices of the limit, each with its slice of the three batch tables and the same
    other tables, extents and scalars; the arguments are made once per configuration."""
    from chainexec.kernels import gett

    monkeypatch.setattr(launch, "MAX_GRID_Y", 3)
    sizes = dict(l=7, a=40, b=24, k=16)
    strides = ({"l": 960, "a": 24, "b": 1}, {"l": 640, "a": 16, "k": 1}, {"l": 384, "k": 24, "b": 1})
    p = gett.problem(("l", "a", "b"), ("l", "a", "k"), ("l", "k", "b"), sizes, strides)
    tables = launch.GettTables(p, strides)
    cfg = gett.GettConfig(2, 2, 2, 2, 16, 2, next(iter(gett.MMA_SHAPES)), p.a_k_fast, p.b_n_fast)
    fn, _, name, threads, smem, index, launches = tables.launches(cfg)
    assert tables.launches(cfg)[6] is launches and (name, threads, smem) == (cfg.name(), 128, cfg.smem_bytes())
    assert index is np.int32
    blocks = -(-40 // cfg.bm) * -(-24 // cfg.bn)
    assert [grid for grid, _ in launches] == [(blocks, 3, 1), (blocks, 3, 1), (blocks, 1, 1)]
    assert [grid for grid, _ in tables.launches(cfg, 4)[6]] == [(blocks, 3, 4), (blocks, 3, 4), (blocks, 1, 4)]
    am, ak, al, bk, bn, bl, cm, cn, cl = tables.views
    for n, (_, args) in enumerate(launches):
        assert all(x is y for x, y in zip(args[:2] + args[3:5] + args[6:8], (am, ak, bk, bn, cm, cn)))
        for got, table in zip(args[2::3][:3], (al, bl, cl)):
            assert list(got) == list(table[3 * n:3 * n + 3]) and len(table) == 7
        assert [int(x) for x in args[9:]] == [40, 24, 16, -(-24 // cfg.bn)]
    launch.launch_gett(cfg, tables, None, None, None, 1.0, 0.0)
    assert fn.launches == 3
    # the scalars last, after the parts' distance (0 unsplit): C, A, B, 9 tables, 4 extents, 3 more
    assert all(len(args) == 19 and [type(x) for x in args[-3:]] == [np.int32, np.float64, np.float64]
               and [float(x) for x in args[-3:]] == [0, 1.0, 0.0] for _, args in fn.calls)


def test_a_split_gett_launch_passes_the_parts_and_their_distance(device):
    """A sum split into 4 parts launches gridDim.z = 4 with the distance between the parts'
    outputs (the elements of one) before the scalars; a stack that is not C-contiguous, of
    another count, or of a short-sum configuration is refused."""
    from chainexec.kernels import gett

    sizes = dict(a=40, b=24, k=160)
    strides = ({"a": 24, "b": 1}, {"a": 160, "k": 1}, {"k": 24, "b": 1})
    tables = launch.GettTables(gett.problem(("a", "b"), ("a", "k"), ("k", "b"), sizes, strides), strides)
    cfg = gett.GettConfig(2, 2, 2, 2, 16, 2, "m16n8k4", True, True)
    W = np.zeros((4, 40, 24))
    launch.launch_gett(cfg, tables, W, None, None, 0.5, 0.0, parts=4)
    fn, _ = launch.gett_function(cfg)
    (grid, args), = fn.calls
    assert grid[2] == 4 and [float(x) for x in args[-3:]] == [40 * 24, 0.5, 0.0]
    for bad in (W[:, :, ::2], np.zeros((3, 40, 24))):
        with pytest.raises(ValueError, match="split into 4 parts"):
            launch.launch_gett(cfg, tables, bad, None, None, 0.5, 0.0, parts=4)
    sizes["k"] = 16
    strides[1]["a"] = 16
    tables = launch.GettTables(gett.problem(("a", "b"), ("a", "k"), ("k", "b"), sizes, strides), strides)
    short = gett.GettConfig(4, 1, 4, 4, 16, 2, "m16n8k4", True, True, span=128)
    assert short.valid()
    with pytest.raises(ValueError, match="split into 4 parts"):
        launch.launch_gett(short, tables, W, None, None, 0.5, 0.0, parts=4)


def test_loading_a_kernel_is_not_a_use(device):
    fn, key = kernelcache.function("chainexec_k", "src k")
    assert kernelcache.function("chainexec_k", "src k") == (fn, key) and device == []
    assert key == kernelcache.cache_key("src k", "90") and _cubin("src k").exists()


def test_point_wise_kernels_load_through_the_same_table(device, nvrtc):
    """A point-wise kernel is compiled once, with the point-wise options, into the same disk cache
    and per-device table as the contraction kernels; loading it again compiles nothing."""
    from chainexec.kernels.elementwise import total_source

    TOTAL = total_source("float64")
    from chainexec.runtime import pointwise

    calls, _ = nvrtc
    pointwise.preload(TOTAL, "chainexec_total")
    pointwise.preload(TOTAL, "chainexec_total")
    key = kernelcache.cache_key(TOTAL, "90", kernelcache.POINTWISE_OPTIONS)
    assert calls == [TOTAL] and list(kernelcache._LOADED) == [(key, "chainexec_total", 0)]
    assert _cubin(TOTAL, options=kernelcache.POINTWISE_OPTIONS).exists() and device == []


def test_a_contraction_kernel_is_noted_at_each_call_and_not_when_made(device, monkeypatch):
    """A COGENT kernel made to see that it can be (the autotuner's candidate check) is kept by
    the backend; its launches are the uses, each noted, paused while timing."""
    import sys

    import numpy as np

    from chainexec.kernels.kernelconf import Device
    from chainexec.runtime import uselog

    class ndarray:
        def __init__(self, shape):
            self.shape, self.ndim, self.size = shape, len(shape), int(np.prod(shape))
            self.dtype = np.dtype("float64")
            self.flags = type("Flags", (), {"c_contiguous": True})()

    monkeypatch.setattr(sys.modules["cupy"], "ndarray", ndarray, raising=False)
    kern = launch.get_kernel("ab", "ak", "kb", dict(a=8, b=8, k=8), "float64", device=Device.H100())
    assert device == []  # made, not used
    A, B, C = ndarray((8, 8)), ndarray((8, 8)), ndarray((8, 8))
    with uselog.paused():
        kern(A, B, C)
    kern(A, B, C, beta=1.0)
    kern(A, B, C)
    use = (kern.cubin, kern.name)
    assert kern.cubin == kernelcache.cache_key(kern.source, "90") and kern.function.launches == 3
    assert device == [("modules", use, True), ("modules", use, False), ("modules", use, False)]


def test_the_kernels_of_one_source_are_each_its_own_function_of_one_module(device, nvrtc):
    """A source holding several kernels (the tile operations' set, add and fill) compiles and
    loads once, and each name is that kernel, not the one loaded first."""
    from chainexec.kernels.strided import OPERATIONS, strided_source

    calls, _ = nvrtc
    text = strided_source(2, "float64", "int")
    found = {op: kernelcache.function(f"chainexec_strided_{op}", text) for op in OPERATIONS}
    assert {fn.name for fn, _ in found.values()} == {f"chainexec_strided_{op}" for op in OPERATIONS}
    assert len({key for _, key in found.values()}) == 1 and calls == [text] and len(LOADS) == 1
    assert kernelcache.function("chainexec_strided_add", text)[0] is found["add"][0]
