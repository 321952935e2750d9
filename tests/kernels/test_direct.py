"""Direct contraction kernels (:mod:`chainexec.kernels.direct`), on any machine: the generated
source compiled as C++ and run thread by thread against ``numpy.einsum`` on six kinds of
contraction, and compiled with nvcc for sm_90 (skipped without nvcc)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from chainexec.kernels import direct
from tests.kernels.emulation import compiles_with_nvcc, offset_of, padded


DIRECT_CASES = {
    # (out, a, b) index strings, with extents from SIZES; views of NaN-padded buffers, permuted
    "matrix product": ("ij", "ik", "kj"),
    "two summed, permuted operands": ("ijl", "kjmi", "lmk"),
    "batch index": ("bij", "bik", "bkj"),
    "sum over one operand alone": ("i", "ik", "i"),
    "scalar result": ("", "ijk", "kji"),
    "outer product": ("ij", "i", "j"),
}
SIZES = {"i": 5, "j": 4, "k": 6, "l": 3, "m": 2, "b": 3}

DIRECT_MAIN = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>
struct Dim3 { unsigned x; };
Dim3 threadIdx, blockIdx;
#define __global__
#define __restrict__
#define T double
@SOURCE@
int main(int argc, char** argv) {
  long long n[3], at[3];
  for (int k = 0; k < 3; ++k) { n[k] = atoll(argv[2 + 2 * k]); at[k] = atoll(argv[3 + 2 * k]); }
  std::vector<T> buf[3];
  FILE* f = fopen(argv[1], "rb");
  for (int k = 0; k < 3; ++k) { buf[k].resize(n[k]); if (fread(buf[k].data(), sizeof(T), n[k], f) != (size_t)n[k]) return 2; }
  fclose(f);
  long long total = atoll(argv[8]);
  for (long long e = 0; e < (total + 255) / 256 * 256; ++e) {
    blockIdx.x = e / 256; threadIdx.x = e % 256;
    chainexec_direct(buf[0].data() + at[0], buf[1].data() + at[1], buf[2].data() + at[2], atof(argv[9]));
  }
  f = fopen(argv[1], "wb");
  fwrite(buf[0].data(), sizeof(T), n[0], f);
  fclose(f);
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("case", sorted(DIRECT_CASES))
def test_direct_contraction_kernel_equals_einsum(case, tmp_path):
    """The generated direct kernel, compiled as C++ and run thread by thread on the CPU, on
    permuted views of NaN-padded buffers: out += 0.75·Σ a·b as numpy.einsum has it, and nothing
    outside out's view written."""
    rng = np.random.default_rng(len(case))
    ix = DIRECT_CASES[case]
    arrays = []
    for k, idx in enumerate(ix):
        order = list(range(len(idx)))[::-1] if k % 2 else list(range(len(idx)))
        arrays.append(padded(rng, [SIZES[i] for i in idx], order))
    (big_out, out), (big_a, a), (big_b, b) = arrays
    ref = out + 0.75 * np.einsum(f"{ix[1]},{ix[2]}->{ix[0]}", a, b)
    text = direct.direct_source(out, a, b, tuple(list(x) for x in ix))
    cpp, exe, data = tmp_path / "d.cpp", tmp_path / "d", tmp_path / "d.bin"
    cpp.write_text(DIRECT_MAIN.replace("@SOURCE@", text))
    subprocess.run(["g++", "-O1", "-std=c++17", "-w", str(cpp), "-o", str(exe)], check=True)
    data.write_bytes(b"".join(x.tobytes() for x in (big_out, big_a, big_b)))
    args = []
    for big, view in ((big_out, out), (big_a, a), (big_b, b)):
        args += [str(big.size), str(offset_of(big, view))]
    subprocess.run([str(exe), str(data)] + args + [str(max(1, out.size)), "0.75"], check=True)
    got = np.fromfile(data, count=big_out.size).reshape(big_out.shape)
    inner = tuple(slice(1, n - 1) for n in big_out.shape)  # out is stored in its own axis order
    outside = np.ones(got.shape, bool)
    outside[inner or ...] = False
    assert np.isnan(got[outside]).all()
    assert np.max(np.abs(got[inner or ...] - ref)) <= 1e-13 * np.max(np.abs(ref))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_source_compiles_with_nvcc(tmp_path):
    compiles_with_nvcc(tmp_path, [direct.contraction_source((4, 6), (5, 3), [(6, 1), (1, 0), (0, 4)], [(3, 15), (1, 24)],
                                                            ("float32", "float64", "float32"))])
