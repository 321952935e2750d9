"""Generated point-wise kernels, on any machine: the reduced iteration space of
:func:`pointwise.layout` visits exactly the (output, input) element pairs of the original views
(NumPy strides of permuted, cut and broadcast views are the reference), the generated source
compiles with nvcc for sm_90 (skipped without nvcc) — the reduction kernels too — and code
outside numbers, names and operators never reaches it. The kernels' numbers are checked on a GPU in test_pointwise_gpu.py."""

from __future__ import annotations

import itertools
import shutil
import subprocess

import numpy as np
import pytest

from chainexec.runtime import pointwise


def views(case: str, xp=np):
    """(out, inputs) views of one kind (NumPy, or CuPy with ``xp=cupy``: the same values and
    strides), with out's index order the inputs broadcast over. ``cut``'s out is a window of a
    larger buffer."""
    rng = np.random.default_rng(11)

    def normal(*shape):
        return xp.asarray(rng.standard_normal(shape))

    base = normal(5, 4, 6, 3, 7)
    if case == "contiguous":
        return base, [base.copy(), base.copy()]
    if case == "permuted":
        # stored in another index order, read through a transposed view (R's Z[i,j,k,b,c,a])
        return base, [xp.ascontiguousarray(base.transpose(2, 0, 4, 1, 3)).transpose(1, 3, 0, 4, 2),
                      xp.ascontiguousarray(base.transpose(4, 3, 2, 1, 0)).transpose(4, 3, 2, 1, 0)]
    if case == "cut":
        big = normal(9, 6, 8, 5, 11)
        return big[2:7, 1:5, 1:7, :3, 3:10], [big[:5, :4, :6, 2:5, :7].copy(), normal(9, 6, 8, 5, 11)[1:6, :4, 2:8, 1:4, :7]]
    if case == "broadcast":
        return base, [normal(5, 1, 6, 1, 1), normal(1, 4, 1, 3, 7), normal(1, 1, 1, 1, 1)]
    if case == "extent-one":
        return normal(1, 4, 1, 3, 1), [normal(3, 1, 4, 1, 1).transpose(1, 2, 3, 0, 4)]
    raise ValueError(case)


CASES = ["contiguous", "permuted", "cut", "broadcast", "extent-one"]


def element_strides(a: np.ndarray) -> tuple[int, ...]:
    return tuple(0 if n == 1 else s // a.itemsize for n, s in zip(a.shape, a.strides))


def pairs(shape, strides) -> set[tuple[int, ...]]:
    """Every element's (output offset, input offsets…) over ``shape`` with per-array ``strides``."""
    return {tuple(sum(c * s for c, s in zip(coord, st)) for st in strides)
            for coord in itertools.product(*(range(n) for n in shape))}


@pytest.mark.parametrize("case", CASES)
def test_layout_visits_the_same_elements(case):
    out, inputs = views(case)
    strides = [element_strides(out)] + [element_strides(a) for a in inputs]
    shape, reduced = pointwise.layout(out.shape, strides)
    assert pairs(shape, reduced) == pairs(out.shape, strides)
    assert len(pairs(shape, reduced)) == out.size  # every output element once
    # The last dimension is the output's fastest-varying one: threads next to each other write
    # neighbouring elements.
    if shape:
        assert abs(reduced[0][-1]) == min(abs(s) for s in reduced[0])


def test_contiguous_views_merge_into_one_dimension():
    out, inputs = views("contiguous")
    strides = [element_strides(out)] + [element_strides(a) for a in inputs]
    assert pointwise.layout(out.shape, strides) == ((out.size,), [(1,), (1,), (1,)])


def test_code_outside_numbers_names_and_operators_is_refused():
    with pytest.raises(ValueError, match="characters"):
        pointwise.source("p0; } __global__ void x() {", (4,), [(1,), (1,)], ("float64", "float64"))


def test_a_reduction_cannot_read_an_output_value():
    with pytest.raises(ValueError, match="no output value"):
        pointwise.reduce_source("y + p0", (4,), [(1,), (1,)], ("float64", "float64"))


def test_index_width_follows_the_offsets():
    small = pointwise.source("y + p0", (8, 8), [(8, 1), (1, 8)], ("float64", "float64"))
    wide = pointwise.source("y + p0", (8, 8), [(8, 1), (2**29, 8)], ("float64", "float64"))
    assert "int rest" in small and "long long rest" in wide


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_sources_compile_with_nvcc(tmp_path):
    out, inputs = views("broadcast")
    strides = [element_strides(out)] + [element_strides(a) for a in inputs]
    shape, reduced = pointwise.layout(out.shape, strides)
    sources = [pointwise.source("y + 2.0 * p0 * p1 + -0.5 * p2", shape, reduced, ("float64",) * 4),
               pointwise.source("(1.0 / ((p0 - p1) + p2))", shape, reduced, ("float32", "float64", "float32", "float32")),
               pointwise.source("y + p0", (8, 8), [(8, 1), (2**29, 8)], ("float64", "float64")),
               pointwise.reduce_source("2.0 * p0 * p1 + -0.5 * p2", shape, reduced, ("float64",) * 4),
               pointwise.reduce_source("p0", (8, 8), [(8, 1), (2**29, 8)], ("float32", "float64")),
               pointwise.contraction_source((4, 6), (5, 3), [(6, 1), (1, 0), (0, 4)], [(3, 15), (1, 24)],
                                            ("float32", "float64", "float32"))]
    for k, text in enumerate(sources):
        f = tmp_path / f"p{k}.cu"
        f.write_text(text)
        r = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / f"p{k}.cubin"), str(f)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


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


def _padded(rng, shape, order):
    """(buffer, view): a view of shape ``shape`` into a NaN-padded buffer stored in axis order ``order``."""
    stored = [shape[d] for d in order]
    big = np.full([n + 2 for n in stored], np.nan)
    inner = tuple(slice(1, 1 + n) for n in stored)
    big[inner] = rng.standard_normal(stored)
    return big, big[inner or ...].transpose(np.argsort(order))


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
        arrays.append(_padded(rng, [SIZES[i] for i in idx], order))
    (big_out, out), (big_a, a), (big_b, b) = arrays
    ref = out + 0.75 * np.einsum(f"{ix[1]},{ix[2]}->{ix[0]}", a, b)
    text = pointwise.direct_source(out, a, b, tuple(list(x) for x in ix))
    cpp, exe, data = tmp_path / "d.cpp", tmp_path / "d", tmp_path / "d.bin"
    cpp.write_text(DIRECT_MAIN.replace("@SOURCE@", text))
    subprocess.run(["g++", "-O1", "-std=c++17", "-w", str(cpp), "-o", str(exe)], check=True)
    data.write_bytes(b"".join(x.tobytes() for x in (big_out, big_a, big_b)))
    args = []
    for big, view in ((big_out, out), (big_a, a), (big_b, b)):
        args += [str(big.size), str((view.__array_interface__["data"][0] - big.ctypes.data) // 8)]
    subprocess.run([str(exe), str(data)] + args + [str(max(1, out.size)), "0.75"], check=True)
    got = np.fromfile(data, count=big_out.size).reshape(big_out.shape)
    inner = tuple(slice(1, n - 1) for n in big_out.shape)  # out is stored in its own axis order
    outside = np.ones(got.shape, bool)
    outside[inner or ...] = False
    assert np.isnan(got[outside]).all()
    assert np.max(np.abs(got[inner or ...] - ref)) <= 1e-13 * np.max(np.abs(ref))
