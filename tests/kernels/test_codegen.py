"""Generated CUDA source: validation, CPU emulation of its index mapping, nvcc compilation.

The emulation compiles the generated kernel as host C++20 (``g++``), runs each CUDA thread of a
block as a ``std::thread`` with ``std::barrier`` as ``__syncthreads`` and ``__shared__`` as a
function-static array (blocks run one after another), and compares with ``numpy.einsum``.
The nvcc test compiles the kernels of all 48 TCCG contractions for sm_90 in two batched calls.
Both skip when their compiler is absent.
"""

import json
import re
import shutil
import subprocess

import numpy as np
import pytest

from chainexec.kernels.codegen import generate, grid_size, kernel_name, kernel_params
from chainexec.kernels.kernelconf import Device, choose_config, enumerate_configs
from tests.conftest import TCCG, nvcc_reports
from tests.kernels.emulation import compile_emulation

CASES = json.loads(TCCG.read_text())
H100 = Device.H100()

EMU_PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
struct Dim3 { unsigned x; };
thread_local Dim3 threadIdx, blockIdx;
static std::barrier<>* g_bar;
#define __global__
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static
static inline void __syncthreads() { g_bar->arrive_and_wait(); }
"""


def _emu_main(name, ctype, nparams):
    ns = ", ".join(f"n[{i}]" for i in range(nparams))
    return f"""
int main(int argc, char** argv) {{
  int grid = atoi(argv[1]), threads = atoi(argv[2]);
  long long nc = atoll(argv[3]), na = atoll(argv[4]), nb = atoll(argv[5]);
  std::vector<{ctype}> C(nc), A(na), B(nb);
  FILE* f = fopen(argv[6], "rb");
  if (fread(C.data(), sizeof({ctype}), nc, f) != (size_t)nc) return 2;
  if (fread(A.data(), sizeof({ctype}), na, f) != (size_t)na) return 2;
  if (fread(B.data(), sizeof({ctype}), nb, f) != (size_t)nb) return 2;
  fclose(f);
  int n[{nparams}];
  for (int i = 0; i < {nparams}; ++i) n[i] = atoi(argv[8 + i]);
  {ctype} alpha = atof(argv[8 + {nparams}]), beta = atof(argv[9 + {nparams}]);
  for (int b = 0; b < grid; ++b) {{
    std::barrier<> bar(threads);
    g_bar = &bar;
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t, b] {{ threadIdx.x = t; blockIdx.x = b;
                                   {name}(C.data(), A.data(), B.data(), {ns}, alpha, beta); }});
    for (auto& th : ts) th.join();
  }}
  f = fopen(argv[7], "wb");
  fwrite(C.data(), sizeof({ctype}), nc, f);
  fclose(f);
  return 0;
}}
"""


def _emulate(tmp_path, c, a, b, sizes, dtype, cfg, alpha, beta, seed):
    """Relative error of the emulated kernel against numpy.einsum (output NaN-poisoned when
    beta == 0, so an element the kernel does not write fails)."""
    name, src = generate(c, a, b, sizes, dtype, cfg)
    ctype = "double" if dtype == "float64" else "float"
    params = kernel_params(c, a, b)
    cpp, exe = tmp_path / f"{name}.cpp", tmp_path / name
    cpp.write_text(EMU_PRELUDE + src + _emu_main(name, ctype, len(params)))
    compile_emulation(tmp_path, cpp, exe)
    rng = np.random.default_rng(seed)
    A = rng.standard_normal([sizes[i] for i in a]).astype(dtype)
    B = rng.standard_normal([sizes[i] for i in b]).astype(dtype)
    C0 = rng.standard_normal([sizes[i] for i in c]).astype(dtype)
    if beta == 0:
        C0[...] = np.nan
    inp, out = tmp_path / f"{name}.in", tmp_path / f"{name}.out"
    inp.write_bytes(C0.tobytes() + A.tobytes() + B.tobytes())
    subprocess.run([str(exe), str(grid_size(cfg, sizes)), str(cfg.threads), str(C0.size),
                    str(A.size), str(B.size), str(inp), str(out)]
                   + [str(sizes[i]) for i in params] + [repr(alpha), repr(beta)], check=True)
    C = np.fromfile(out, dtype=dtype).reshape(C0.shape)
    ref = alpha * np.einsum(f"{a},{b}->{c}", A.astype(np.float64), B.astype(np.float64))
    if beta:
        ref += beta * C0
    return np.linalg.norm(C - ref) / np.linalg.norm(ref)


def _have_gxx():
    return shutil.which("g++") is not None


# (c, a, b, representative sizes for the config, odd run-time extents, dtype, alpha, beta)
EMU_CASES = [
    ("ab", "ac", "cb", dict(a=512, b=512, c=512), dict(a=131, b=133, c=21), "float64", 1.0, 0.0),
    ("abc", "bda", "dc", dict(a=312, b=312, c=24, d=312), dict(a=19, b=11, c=35, d=11),
     "float64", 0.75, 2.0),
    ("ab", "acd", "dbc", dict(a=312, b=296, c=296, d=312), dict(a=51, b=19, c=5, d=11),
     "float32", 1.0, 0.0),
    ("abcd", "aebf", "dfce", {i: 72 for i in "abcdef"}, dict(a=19, b=11, c=11, d=19, e=7, f=7),
     "float64", -0.5, 1.5),
    ("abcdef", "dega", "gfbc", dict(a=24, b=16, c=16, d=24, e=16, f=16, g=24),
     dict(a=35, b=2, c=11, d=2, e=7, f=19, g=11), "float64", 1.0, 0.0),
    ("abcd", "ea", "ebcd", {i: 72 for i in "abcde"}, dict(a=83, b=11, c=2, d=19, e=11),
     "float32", 2.0, -1.0),
    ("abc", "ab", "c", dict(a=64, b=64, c=64), dict(a=9, b=7, c=37), "float64", 1.0, 0.0),
]


@pytest.mark.skipif(not _have_gxx(), reason="g++ not found")
@pytest.mark.parametrize("c,a,b,rep,run,dtype,alpha,beta", EMU_CASES,
                         ids=[f"{e[0]}-{e[1]}-{e[2]}-{e[5]}" for e in EMU_CASES])
def test_emulated_kernel_matches_einsum(tmp_path, c, a, b, rep, run, dtype, alpha, beta):
    """The config chosen for large representative sizes, run at small odd extents (partial tiles
    in every tiled dimension) on the CPU."""
    cfg = choose_config(c, a, b, rep, dtype, H100)
    err = _emulate(tmp_path, c, a, b, run, dtype, cfg, alpha, beta, seed=len(c) + len(a))
    assert err <= (1e-12 if dtype == "float64" else 1e-5)


@pytest.mark.skipif(not _have_gxx(), reason="g++ not found")
def test_emulated_alternative_configs(tmp_path):
    """Configs other than the chosen one (split indices, several TB entries) are right too."""
    c, a, b = "abcd", "dbea", "ec"
    rep, run = dict(a=72, b=72, c=24, d=72, e=72), dict(a=13, b=6, c=9, d=21, e=10)
    configs, _ = enumerate_configs(c, a, b, rep, "float64", H100)
    picks = [k for k in configs if len(k.tbx) + len(k.regx) + len(k.tby) + len(k.regy) > 3][:2]
    assert picks
    for cfg in picks:
        assert _emulate(tmp_path, c, a, b, run, "float64", cfg, 1.0, 0.0, seed=1) <= 1e-12


def test_source_and_signature():
    sizes = dict(a=40, b=50, c=60, d=70)
    cfg = choose_config("abc", "adc", "bd", sizes, "float64", H100)
    name, src = generate("abc", "adc", "bd", sizes, "float64", cfg)
    assert name == kernel_name(cfg) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)
    assert f'extern "C" __global__ void __launch_bounds__({cfg.threads}, 1)' in src
    assert kernel_params("abc", "adc", "bd") == ("a", "b", "c", "d")
    assert "const int n_a, const int n_b, const int n_c, const int n_d" in src
    assert generate("abc", "adc", "bd", sizes, "float64", cfg) == (name, src)
    assert grid_size(cfg, sizes) == cfg.num_blocks
    cfg32 = choose_config("abc", "adc", "bd", sizes, "float32", H100)
    _, src32 = generate("abc", "adc", "bd", sizes, "float32", cfg32)
    assert "double" not in src32 and "fmaf(" in src32


@pytest.mark.parametrize("c,a,b", [("ab", "a-c", "cb"), ("ab", "ac", "c b"), ("a", "ab", "bé")])
def test_invalid_names_raise(c, a, b):
    with pytest.raises(ValueError, match="not a plain identifier"):
        generate(c, a, b, {}, "float64", None)


def test_batch_dtype_and_mismatched_config_raise():
    cfg = choose_config("ab", "ac", "cb", dict(a=64, b=64, c=64), "float64", H100)
    with pytest.raises(ValueError, match="all three"):
        generate("abc", "acd", "bdc", dict(a=2, b=2, c=2, d=2), "float64", cfg)
    with pytest.raises(ValueError, match="dtype"):
        generate("ab", "ac", "cb", dict(a=64, b=64, c=64), "float16", cfg)
    with pytest.raises(ValueError, match="different contraction"):
        generate("ab", "ac", "cb", dict(a=64, b=64, c=64), "float32", cfg)
    with pytest.raises(ValueError, match="different contraction"):
        generate("ba", "ac", "cb", dict(a=64, b=64, c=64), "float64", cfg)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_all_tccg_kernels_compile_with_nvcc(tmp_path):
    """All 48 float64 kernels (plus 8 float32 ones) compile for sm_90 without register spills."""
    sources = {}
    for case in CASES:
        for dtype in ("float64",) + (("float32",) if case["id"] % 6 == 0 else ()):
            cfg = choose_config(case["C"], case["A"], case["B"], case["sizes"], dtype, H100)
            name, src = generate(case["C"], case["A"], case["B"], case["sizes"], dtype, cfg)
            sources[name] = src
    names = sorted(sources)
    log = "".join(nvcc_reports(tmp_path, ["\n".join(sources[n] for n in names[part::2]) for part in range(2)]))
    assert len(re.findall(r"Compiling entry function", log)) == len(sources)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    assert spills and all(s == "0" for s in spills)
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    print(f"\n{len(sources)} kernels: registers {min(regs)}..{max(regs)}, no spills")
