"""GPU tests of the generated COGENT kernels: NVRTC compile, disk cache, launch, results.

Every result is compared with ``numpy.einsum`` on the host (an independent implementation) on
fresh random inputs; outputs are poisoned with NaN first so an unwritten element fails.  The
module is skipped when CuPy or a CUDA device is missing.
"""

import numpy as np
import pytest

from tests.conftest import require_gpu  # noqa: E402

cupy = require_gpu()

from chainexec.kernels.kernelconf import Device, choose_config, enumerate_configs  # noqa: E402
from chainexec.runtime import kernelcache, launch  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [
    ("ab", "ac", "cb", dict(a=131, b=67, c=45)),
    ("abc", "bda", "dc", dict(a=33, b=17, c=29, d=41)),
    ("ab", "acd", "dbc", dict(a=37, b=23, c=7, d=19)),
    ("abcd", "aebf", "dfce", dict(a=9, b=11, c=13, d=7, e=6, f=5)),
    ("abcdef", "dega", "gfbc", dict(a=7, b=5, c=9, d=6, e=3, f=11, g=13)),
    ("abcd", "ea", "ebcd", dict(a=21, b=8, c=9, d=30, e=17)),
    ("abc", "ab", "c", dict(a=19, b=23, c=37)),  # outer product: no internal index
]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernelcache, "_LOADED", {})
    monkeypatch.setattr(kernelcache, "_MODULES", {})


def _inputs(a, b, c, sizes, dtype, seed):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal([sizes[i] for i in a]).astype(dtype)
    B = rng.standard_normal([sizes[i] for i in b]).astype(dtype)
    C0 = rng.standard_normal([sizes[i] for i in c]).astype(dtype)
    return A, B, C0


def _relerr(out, ref):
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float32", 1e-5)])
@pytest.mark.parametrize("c,a,b,sizes", CASES)
def test_kernel_matches_numpy(c, a, b, sizes, dtype, tol):
    """Model-chosen config, odd extents (partial tiles), beta = 0 then alpha/beta accumulate."""
    A, B, C0 = _inputs(a, b, c, sizes, dtype, seed=len(a) * 7 + len(b))
    kern = launch.get_kernel(c, a, b, sizes, dtype)
    ref = np.einsum(f"{a},{b}->{c}", A.astype(np.float64), B.astype(np.float64))
    C = cupy.full(C0.shape, cupy.nan, dtype=dtype)
    kern(cupy.asarray(A), cupy.asarray(B), C)
    assert _relerr(C.get(), ref) <= tol
    C = cupy.asarray(C0)
    kern(cupy.asarray(A), cupy.asarray(B), C, alpha=0.5, beta=-1.25)
    assert _relerr(C.get(), 0.5 * ref - 1.25 * C0.astype(np.float64)) <= tol


def test_large_tile_config_on_small_odd_extents():
    """The config chosen for TCCG-sized problems (128x128 tiles) run on extents that leave
    partial tiles in every dimension."""
    cfg = choose_config("abcd", "aebf", "dfce", {i: 72 for i in "abcdef"}, "float64",
                        Device.H100())
    sizes = {i: cfg.tile(i) + 3 if cfg.tile(i) > 1 else 3 for i in "abcdef"}
    A, B, _ = _inputs("aebf", "dfce", "abcd", sizes, "float64", seed=5)
    kern = launch.get_kernel("abcd", "aebf", "dfce", sizes, "float64", config=cfg)
    C = kern(cupy.asarray(A), cupy.asarray(B))
    assert _relerr(C.get(), np.einsum("aebf,dfce->abcd", A, B)) <= 1e-12


def test_every_surviving_config_of_a_small_case_is_correct():
    """Not only the chosen config: all survivors of one enumeration compute the same result."""
    c, a, b, sizes = "abc", "adc", "bd", dict(a=20, b=18, c=22, d=13)
    A, B, _ = _inputs(a, b, c, sizes, "float64", seed=11)
    ref = np.einsum(f"{a},{b}->{c}", A, B)
    configs, _ = enumerate_configs(c, a, b, sizes, "float64", Device.H100())
    dA, dB = cupy.asarray(A), cupy.asarray(B)
    for cfg in configs[:: max(1, len(configs) // 12)]:
        out = launch.get_kernel(c, a, b, sizes, "float64", config=cfg)(dA, dB)
        assert _relerr(out.get(), ref) <= 1e-12, cfg


def test_disk_cache_compiles_once(monkeypatch, tmp_path):
    calls = []
    real = kernelcache.compile_cubin
    monkeypatch.setattr(kernelcache, "compile_cubin", lambda *a: calls.append(a) or real(*a))
    sizes = dict(a=10, b=12, c=14)
    launch.get_kernel("ab", "ac", "cb", sizes, "float64")
    assert len(calls) == 1
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 1
    monkeypatch.setattr(kernelcache, "_LOADED", {})  # a new process: only the disk cache is left
    monkeypatch.setattr(kernelcache, "_MODULES", {})
    kern = launch.get_kernel("ab", "ac", "cb", sizes, "float64")
    assert len(calls) == 1
    A, B, _ = _inputs("ac", "cb", "ab", sizes, "float64", seed=3)
    assert _relerr(kern(cupy.asarray(A), cupy.asarray(B)).get(), A @ B) <= 1e-12


def test_launch_validates_arrays():
    kern = launch.get_kernel("ab", "ac", "cb", dict(a=4, b=5, c=6), "float64")
    A, B = cupy.ones((4, 6)), cupy.ones((6, 5))
    with pytest.raises(ValueError):
        kern(A, cupy.ones((7, 5)))
    with pytest.raises(ValueError):
        kern(A.astype(cupy.float32), B)
    with pytest.raises(ValueError):
        kern(cupy.ones((6, 4)).T, B)
    with pytest.raises(ValueError):
        kern(A, B, beta=1.0)


def test_device_model():
    dev = launch.device_model()
    assert dev.sm_count > 0 and dev.smem_per_block >= 48 * 1024
    assert dev.compute_capability == str(cupy.cuda.Device().compute_capability)
