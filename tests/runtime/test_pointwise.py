"""Generated point-wise kernels, on any machine: the reduced iteration space of
:func:`pointwise.layout` visits exactly the (output, input) element pairs of the original views
(NumPy strides of permuted, cut and broadcast views are the reference), the generated source
compiles with nvcc for sm_90 (skipped without nvcc) — the reduction kernels and the staged ones
too — and code outside numbers, names and operators never reaches it. The staged kernels (inputs
read across the output's fastest index go through shared memory) are run on the CPU, one
``std::thread`` per CUDA thread, against NumPy. The kernels' numbers are checked on a GPU in test_pointwise_gpu.py."""

from __future__ import annotations

import itertools
import math
import shutil
import subprocess

import numpy as np
import pytest

from chainexec import ordering
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
    # Staged: the (T) epilogue's reads at v=700 (64-bit offsets: 8·700³ elements), a 3-D and a 2-D box.
    v = 700
    box3 = ((8, v, v, v), [(v**3, v * v, v, 1), (v**3, v * v, v, 1), (v**3, 1, v * v, v), (v**3, v, 1, v * v)])
    box2 = ((8, v, 40, v), [(v * v * 40, v * 40, v, 1), (v * v * 40, 1, v * v, v), (0, 1, 0, v)])
    sources += [pointwise.reduce_source("p0 * (p1 + 2.0 * p2)", *box3, ("float64",) * 4),
                pointwise.source("y + p0 * p1", *box2, ("float64",) * 3)]
    # The (T) energy with Z reused, at o=40 v=400 (one occupied point per tile).
    shape = (1, 1, 1, 400, 400, 400)
    orbit = pointwise.orbits(shape, PERMS6, 1, 8)
    code = "p0 * (4.0 * q0 + q1 + q2 - 2.0 * q3 - 2.0 * q4 - 2.0 * q5) * p1"
    sources.append(pointwise.orbit_source(("p0 + 0.5 * p1",), code, (0,) * 6, shape,
                                          [(0, 0, 0, 160000, 400, 1), (0, 0, 0, 400, 1, 0)], ("float64",) * 3, orbit))
    assert orbit.count == 22100
    # In-place symmetrizations: benzene's diagonal (T) tile, one with two equal positions, and a
    # diagonal tile at o=40 v=400 (64-bit offsets).
    for shape, group in (((6, 6, 6, 93, 93, 93), PAIRS), ((6, 6, 6, 93, 93, 93), PAIRS[:2]),
                         ((8, 8, 8, 400, 400, 400), PAIRS)):
        strides = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
        plan = pointwise.symmetrize_plan(shape, strides, tuple(group), 8)
        sources.append(pointwise.symmetrize_source(shape, strides, tuple(group), "float64", plan))
    assert "const long long o" in sources[-1] and "const int o" in sources[-2]
    sources.append(pointwise.TOTAL_SOURCE)
    assert all(pointwise.staging(*box, ("float64",) * len(box[1])) for box in (box3, box2))
    assert "long long rest" in sources[-3]
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


def _padded(rng, shape, order, dtype=np.float64):
    """(buffer, view): a view of shape ``shape`` into a NaN-padded buffer stored in axis order ``order``."""
    stored = [shape[d] for d in order]
    big = np.full([n + 2 for n in stored], np.nan, dtype)
    inner = tuple(slice(1, 1 + n) for n in stored)
    big[inner] = rng.standard_normal(stored)
    return big, big[inner or ...].transpose(np.argsort(order))


def _offset_of(big: np.ndarray, view: np.ndarray) -> int:
    """Where ``view`` starts in ``big`` (elements)."""
    return (view.__array_interface__["data"][0] - big.ctypes.data) // big.itemsize


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
        args += [str(big.size), str(_offset_of(big, view))]
    subprocess.run([str(exe), str(data)] + args + [str(max(1, out.size)), "0.75"], check=True)
    got = np.fromfile(data, count=big_out.size).reshape(big_out.shape)
    inner = tuple(slice(1, n - 1) for n in big_out.shape)  # out is stored in its own axis order
    outside = np.ones(got.shape, bool)
    outside[inner or ...] = False
    assert np.isnan(got[outside]).all()
    assert np.max(np.abs(got[inner or ...] - ref)) <= 1e-13 * np.max(np.abs(ref))


STAGED_PRELUDE = r"""
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
struct Dim3 { unsigned x; };
thread_local Dim3 threadIdx, blockIdx;
static std::barrier<>* g_block;
static std::barrier<>* g_warp[8];
static double g_lane[256];
#define __global__
#define __restrict__
#define __shared__ static
static inline void __syncthreads() { g_block->arrive_and_wait(); }
static double __shfl_down_sync(unsigned, double v, int s) {
  const unsigned t = threadIdx.x;
  g_lane[t] = v;
  g_warp[t / 32]->arrive_and_wait();
  const double r = t % 32 + s < 32 ? g_lane[t + s] : v;
  g_warp[t / 32]->arrive_and_wait();
  return r;
}
"""


def _emulated(tmp_path, text: str, name: str, buffers: list[np.ndarray], offsets: list[int], grid: int) -> np.ndarray:
    """Run a generated point-wise kernel on the CPU: every CUDA thread of a block a
    ``std::thread`` (``std::barrier`` for ``__syncthreads`` and per warp for the shuffles,
    ``__shared__`` function-static), blocks one after another; ``buffers[0]`` is the output's
    whole buffer, returned as the kernel left it; each array is passed at its ``offsets`` entry."""
    ctype = {np.dtype(np.float64): "double", np.dtype(np.float32): "float", np.dtype(np.int32): "int"}
    decl = "\n".join(f"  std::vector<{ctype[b.dtype]}> b{k}({b.size}); "
                     f"if (fread(b{k}.data(), sizeof({ctype[b.dtype]}), {b.size}, f) != {b.size}) return 2;"
                     for k, b in enumerate(buffers))
    args = ", ".join(f"b{k}.data() + {off}" for k, off in enumerate(offsets))
    main = f"""
int main(int argc, char** argv) {{
  FILE* f = fopen(argv[1], "rb");
{decl}
  fclose(f);
  for (unsigned b = 0; b < {grid}u; ++b) {{
    std::barrier<> block({pointwise.BLOCK});
    std::barrier<> w0(32), w1(32), w2(32), w3(32), w4(32), w5(32), w6(32), w7(32);
    std::barrier<>* warps[8] = {{&w0, &w1, &w2, &w3, &w4, &w5, &w6, &w7}};
    for (int w = 0; w < 8; ++w) g_warp[w] = warps[w];
    g_block = &block;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < {pointwise.BLOCK}u; ++t)
      ts.emplace_back([&, t, b] {{ threadIdx.x = t; blockIdx.x = b; {name}({args}); }});
    for (auto& th : ts) th.join();
  }}
  f = fopen(argv[1], "wb");
  fwrite(b0.data(), sizeof({ctype[buffers[0].dtype]}), {buffers[0].size}, f);
  fclose(f);
  return 0;
}}
"""
    cpp, exe, data = tmp_path / f"{name}.cpp", tmp_path / name, tmp_path / f"{name}.bin"
    cpp.write_text(STAGED_PRELUDE + text + main)
    subprocess.run(["g++", "-O1", "-std=c++20", "-pthread", "-w", str(cpp), "-o", str(exe)], check=True, timeout=300)
    data.write_bytes(b"".join(b.tobytes() for b in buffers))
    subprocess.run([str(exe), str(data)], check=True, timeout=300)  # a barrier some thread misses hangs
    return np.fromfile(data, dtype=buffers[0].dtype, count=buffers[0].size).reshape(buffers[0].shape)


def _stored(rng, shape, order, dtype=np.float64):
    """(buffer, element offset, view) of :func:`_padded`: what the emulated kernels are passed."""
    big, view = _padded(rng, shape, order, dtype)
    return big, _offset_of(big, view), view


def _epilogue_views(rng, x, a, b, c, dtype=np.float64):
    """The (T) epilogue's kinds of reads over out[x, a, b, c] (c fastest), each from a NaN-padded
    buffer: a tensor stored in another index order (Z[x, b, c, a]), small tensors across c running
    along a (s[c, a]), x (f[c, x]: x is no box dimension) and b (g[c, b]), one broadcast along c
    and a contiguous one."""
    shape = (x, a, b, c)

    def small(first, second, at):
        big, off, view = _stored(rng, (first, second), [0, 1])
        return big, off, np.expand_dims(view.T if at[0] > at[1] else view, [d for d in range(4) if d not in at])

    return [_stored(rng, shape, [0, 2, 3, 1], dtype), small(c, a, (3, 1)), small(x, b, (0, 2)),
            _stored(rng, shape, [0, 1, 2, 3]), small(c, x, (3, 0)), small(c, b, (3, 2))]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("extents", [(2, 19, 3, 37), (2, 5, 3, 7)], ids=["edge-boxes", "one-box"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_staged_pointwise_kernel_equals_numpy(extents, dtype, tmp_path, monkeypatch):
    """Inputs read across out's fastest index go through shared memory (a box over a, b and c,
    overhanging the extents 19 and 37, or one box holding them all; f[c, x] runs along x, outside
    the box; small inputs staged too here); the emulated kernel writes
    y + 1.5·p0·p1 + p2·p3 - 0.5·p0 + p4·p5 exactly where numpy has it and nothing outside out's view."""
    monkeypatch.setattr(pointwise, "STAGE_SHARE", 10**9)
    rng = np.random.default_rng(sum(extents))
    inputs = _epilogue_views(rng, *extents, dtype=dtype)
    big, off, out = _stored(rng, extents, [0, 1, 2, 3])
    code = "y + 1.5 * p0 * p1 + p2 * p3 + -0.5 * p0 + p4 * p5"
    strides = [element_strides(out)] + [element_strides(v) for _, _, v in inputs]
    shape, reduced = pointwise.layout(out.shape, strides)
    types = tuple(np.dtype(v.dtype).name for _, _, v in inputs) + ("float64",)
    plan = pointwise.staging(shape, reduced, types)
    assert plan is not None and plan.staged == (0, 1, 4, 5) and plan.cube == (1, 2, 3)
    got = _emulated(tmp_path, pointwise.source(code, shape, reduced, types), "chainexec_pointwise",
                    [big] + [b for b, _, _ in inputs], [off] + [o for _, o, _ in inputs], pointwise.blocks(shape, plan))
    p = [v.astype(np.float64) for _, _, v in inputs]
    ref = out + 1.5 * p[0] * p[1] + p[2] * p[3] - 0.5 * p[0] + p[4] * p[5]
    view = got[tuple(slice(1, 1 + n) for n in extents)]
    assert np.max(np.abs(view - ref)) <= 1e-14 * np.max(np.abs(ref))
    outside = np.ones(got.shape, bool)
    outside[tuple(slice(1, 1 + n) for n in extents)] = False
    assert np.isnan(got[outside]).all()


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("extents", [(3, 9, 10, 11), (2, 8, 8, 8)], ids=["edge-boxes", "whole-boxes"])
@pytest.mark.parametrize("wide", [False, True], ids=["32-bit", "64-bit"])
def test_staged_reduction_equals_numpy(extents, wide, tmp_path, monkeypatch):
    """The (T) energy's reads: W and Z[x, a, b, c] in place, Z read as Z[x, b, c, a], Z[x, c, a, b]
    and Z[x, a, c, b] (three box dimensions, 8x8x8, overhanging 9, 10, 11), and a broadcast
    energy e[a]. The emulated kernel's per-block partial sums add up to numpy's sum, with 32-bit
    index arithmetic and forced to 64-bit."""
    if wide:
        monkeypatch.setattr(pointwise, "INDEX32", 1)
    rng = np.random.default_rng(sum(extents))
    x, a, b, c = extents
    w_big, w_off, w = _stored(rng, extents, [0, 1, 2, 3])
    n = max(a, b, c)  # the permuted reads need one extent: unequal ones read a cube-shaped Z's corners
    z_big, z = _padded(rng, (x, n, n, n), [0, 1, 2, 3])
    e_big, e_off, e = _stored(rng, (a,), [0])
    reads = [z[:, :a, :b, :c], z.transpose(0, 3, 1, 2)[:, :a, :b, :c], z.transpose(0, 2, 3, 1)[:, :a, :b, :c],
             z.transpose(0, 1, 3, 2)[:, :a, :b, :c]]
    views_ = [w] + reads + [e[None, :, None, None]]
    offsets = [w_off] + [_offset_of(z_big, r) for r in reads] + [e_off]
    code = "p0 * (4.0 * p1 + p2 + -2.0 * p3 * p4) / (1.0 + p5 * p5)"
    walk = tuple(int(np.prod(extents[d + 1:])) for d in range(4))
    shape, reduced = pointwise.layout(extents, [walk] + [element_strides(v) for v in views_])
    types = ("float64",) * 7
    plan = pointwise.staging(shape, reduced, types)
    assert plan is not None and set(plan.staged) == {2, 3, 4} and len(plan.cube) == 3
    assert ("long long rest" if wide else "int rest") in pointwise.reduce_source("p0", shape, reduced, types)
    grid = pointwise.blocks(shape, plan)
    partial = np.full(grid, np.nan)
    got = _emulated(tmp_path, pointwise.reduce_source(code, shape, reduced, types), "chainexec_reduce",
                    [partial, w_big, z_big, z_big, z_big, z_big, e_big], [0] + offsets, grid)
    ref = np.sum(w * (4.0 * reads[0] + reads[1] + -2.0 * reads[2] * reads[3]) / (1.0 + e[None, :, None, None] ** 2))
    assert abs(got.sum() - ref) <= 1e-13 * np.sum(np.abs(w))


# Strides (elements) of a (T) run's two point-wise statements at o=24 v=180 (3x3x3 occupied tiles),
# recorded on the H100 on 2026-11-24: the output's (or the walk's) first, then each input's.
TILE = (3, 3, 3, 180, 180, 180)
Z_STATEMENT = [(52488000, 17496000, 5832000, 32400, 180, 1), (52488000, 17496000, 5832000, 32400, 180, 1),
               (1, 0, 0, 24, 0, 0), (0, 1, 0, 0, 24, 0), (0, 32400, 777600, 0, 1, 180), (32400, 0, 777600, 1, 0, 180),
               (0, 0, 1, 0, 0, 24), (0, 777600, 32400, 0, 180, 1), (32400, 777600, 0, 1, 180, 0),
               (777600, 0, 32400, 180, 0, 1), (180, 0, 0, 1, 0, 0), (777600, 32400, 0, 180, 1, 0), (0, 180, 0, 0, 1, 0),
               (0, 180, 777600, 0, 1, 4320), (180, 0, 777600, 1, 0, 4320), (0, 0, 180, 0, 0, 1),
               (0, 777600, 180, 0, 4320, 1), (180, 777600, 0, 1, 4320, 0), (777600, 180, 0, 4320, 1, 0),
               (777600, 0, 180, 4320, 0, 1)]
ENERGY = [(52488000, 17496000, 5832000, 32400, 180, 1), (52488000, 17496000, 5832000, 32400, 180, 1),
          (52488000, 17496000, 5832000, 1, 180, 32400), (0, 0, 0, 0, 0, 1), (52488000, 17496000, 5832000, 180, 32400, 1),
          (0, 0, 0, 0, 1, 0), (52488000, 17496000, 5832000, 32400, 1, 180), (0, 0, 0, 1, 0, 0),
          (52488000, 17496000, 5832000, 180, 1, 32400), (0, 0, 1, 0, 0, 0), (52488000, 17496000, 5832000, 32400, 180, 1),
          (52488000, 17496000, 5832000, 1, 32400, 180), (1, 0, 0, 0, 0, 0), (0, 1, 0, 0, 0, 0)]


ENERGY_CODE = "p0 * (4.0 * q0 + q1 + 1.5 * q2 - 2.0 * q3 - 2.0 * q4 - 2.0 * q5) * p2"
"""The (T) energy's combination of its six reads, the two 3-cycles weighted apart (1 and 1.5): a
read taken in the inverse direction changes the sum."""


def permuted(z: np.ndarray, p: tuple[int, ...]) -> np.ndarray:
    """The array ``q`` with ``q[x] = z[x[p[0]], x[p[1]], …]``: a reused value read at ``p`` as
    :func:`pointwise.orbits` documents it, written with einsum's own index names."""
    names = "abcdefgh"[:z.ndim]
    return np.einsum(f"{''.join(names[p[d]] for d in range(z.ndim))}->{names}", z)


PERMS6 = [(0, 1, 2) + tuple(3 + d for d in p) for p in [(0, 1, 2), (1, 2, 0), (2, 0, 1), (0, 2, 1), (1, 0, 2), (2, 1, 0)]]
PERMS3 = [(0, 1, 2, 3), (0, 2, 3, 1), (0, 3, 1, 2), (0, 1, 3, 2), (0, 2, 1, 3), (0, 3, 2, 1)]
"""The (T) energy's six reads of Z[x, a, b, c] (x untouched): the value at (x, a, b, c) read at
(x, a, b, c), (x, b, c, a), (x, c, a, b), (x, a, c, b), (x, b, a, c) and (x, c, b, a)."""


@pytest.mark.parametrize("blocks, perms, order", [(3, [(1, 2, 0)], 3), (4, [(1, 0, 2), (0, 2, 1)], 6),
                                                  (5, [(1, 0)], 2), (2, [(0, 1, 2), (2, 0, 1), (1, 0, 2)], 6)])
def test_orbits_cover_every_block_once(blocks, perms, order):
    """The orbit table lists every block tuple in exactly one orbit, each orbit the images of its
    first block under the generated group (a 3-cycle makes 3 permutations, two transpositions 6),
    and each read's target slot holds the block that read maps to."""
    assert len(pointwise.group(tuple(perms))) == order
    table, count, members = pointwise.orbit_table(blocks, tuple(perms))
    s = len(perms[0])
    width = 1 + members * (s + len(perms))
    assert members == order and len(table) == count * width
    seen = []
    for row in (table[k * width:(k + 1) * width] for k in range(count)):
        n = row[0]
        tuples = [tuple(row[1 + t * s:1 + (t + 1) * s]) for t in range(n)]
        assert len(set(tuples)) == n
        group = {tuple(tuples[0][g[u]] for u in range(s)) for g in pointwise.group(tuple(perms))}
        assert set(tuples) == group
        for t, block in enumerate(tuples):
            for r, p in enumerate(perms):
                target = row[1 + members * s + t * len(perms) + r]
                assert tuples[target] == tuple(block[p[u]] for u in range(s))
        seen += tuples
    assert sorted(seen) == sorted(itertools.product(range(blocks), repeat=s))


def test_orbit_reads_must_permute_dimensions_of_one_extent():
    with pytest.raises(ValueError, match="unequal extents"):
        pointwise.orbits((3, 8, 9), [(0, 2, 1)], 1, 8)
    with pytest.raises(ValueError, match="not permutations"):
        pointwise.orbits((3, 8, 8), [(0, 1, 1)], 1, 8)
    plan = pointwise.orbits((3, 40, 40, 40), PERMS3, 1, 8)
    assert (plan.moved, plan.edge, plan.members, plan.count) == ((1, 2, 3), 8, 6, 35)
    assert pointwise.orbits((3, 40, 40), [(0, 2, 1)], 2, 8).edge == 16
    assert pointwise.orbits((3, 40, 40, 40), PERMS3, 3, 8).edge == 4  # three values' blocks fit in shared memory


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("wide", [False, True], ids=["32-bit", "64-bit"])
@pytest.mark.parametrize("case", ["energy", "weighted", "weighted along a", "two values", "float32"])
def test_orbit_reduction_equals_numpy(case, wide, tmp_path, monkeypatch):
    """The orbit kernel, run on the CPU, against NumPy. ``energy``: the (T) energy's shape, a
    reused value Z = W + 0.5·s[c, a]·e[b] (a small input read across c, a broadcast one) read at
    the six permutations of (a, b, c) over blocks of 8 overhanging the extent 19, with x = 2 one
    orbit grid per point. ``weighted``: the same at x = 3 times a weight over x of 2, 0 and 1
    that skips the blocks where it is zero (``skip``, :mod:`chainexec.planner.ordered`), W being
    NaN there: a block that computed anything would make the sum NaN. ``weighted along a``: a
    weight over a, a permuted dimension, zero for some a: no block is skipped (a block holds
    points of several weights), the weight only multiplied by. ``two values``: two reused
    values over (a, b) blocks of 16 overhanging 20, one read transposed; ``float32``: the same in
    single precision (values kept as float)."""
    if wide:
        monkeypatch.setattr(pointwise, "INDEX32", 1)
    rng = np.random.default_rng(7)
    dtype = np.float32 if case == "float32" else np.float64
    skip = None
    if case in ("energy", "weighted", "weighted along a"):
        x, n = (2, 19) if case == "energy" else (3, 19)
        shape = (x, n, n, n)
        w_big, w_off, w = _stored(rng, shape, [0, 1, 2, 3])
        s_big, s_off, s_ = _stored(rng, (n, n), [0, 1])
        e_big, e_off, e = _stored(rng, (n,), [0])
        views_ = [w, s_.T[None, :, None, :], e[None, None, :, None]]
        buffers, offsets = [w_big, s_big, e_big], [w_off, s_off, e_off]
        lets = ["p0 + 0.5 * p1 * p2"]
        code = ENERGY_CODE
        reads = [(0, p) for p in PERMS3]
        z = w + 0.5 * views_[1] * views_[2]
        q = [permuted(z, p) for p in PERMS3]
        terms = w * (4 * q[0] + q[1] + 1.5 * q[2] - 2 * q[3] - 2 * q[4] - 2 * q[5]) * views_[2]
        ref = np.sum(terms)
        if case == "weighted":
            weight = np.array([2.0, 0.0, 1.0])
            ref = np.sum(terms * weight[:, None, None, None], where=weight[:, None, None, None] != 0)
            w[1] = np.nan
            views_.append(weight[:, None, None, None])
            buffers.append(weight)
            offsets.append(0)
            code, skip = f"({code}) * p3", 3
        if case == "weighted along a":
            weight = rng.integers(0, 3, n).astype(np.float64)
            weight[2] = 0.0
            ref = np.sum(terms * weight[None, :, None, None])
            views_.append(weight[None, :, None, None])
            buffers.append(weight)
            offsets.append(0)
            code, skip = f"({code}) * p3", 3
    else:
        shape = (3, 20, 20)
        a_big, a_off, a = _stored(rng, shape, [2, 0, 1], dtype)
        b_big, b_off, b = _stored(rng, (20,), [0], dtype)
        views_ = [a, b[None, None, :]]
        buffers, offsets = [a_big, b_big], [a_off, b_off]
        lets = ["p0 * p1", "p0 + p1"]
        code = "q0 * q1 + p1"
        reads = [(0, (0, 1, 2)), (1, (0, 2, 1))]
        first, second = a * views_[1], a + views_[1]
        ref = np.sum(first.astype(np.float64) * second.transpose(0, 2, 1) + views_[1] * np.ones(shape))
    strides = [element_strides(v) for v in views_]
    types = tuple(np.dtype(v.dtype).name for v in views_) + (np.dtype(dtype).name,)
    plan = pointwise.orbits(shape, [p for _, p in reads], len(lets), np.dtype(dtype).itemsize)
    assert plan.edge == (16 if case in ("two values", "float32") else 8)
    text = pointwise.orbit_source(tuple(lets), code, tuple(j for j, _ in reads), shape, strides, types, plan, skip)
    assert ("long long" if wide else "const int c") in text
    assert ("== 0) {" in text) == (case == "weighted")  # along a permuted dimension nothing is skipped
    table = np.array(pointwise.orbit_table(-(-shape[plan.moved[0]] // plan.edge), plan.perms)[0], np.int32)
    grid = plan.count * int(np.prod([n for d, n in enumerate(shape) if d not in plan.moved]))
    partial = np.full(grid, np.nan)
    got = _emulated(tmp_path, text, "chainexec_orbits", [partial] + buffers + [table], [0] + offsets + [0], grid)
    tolerance = 1e-5 if case == "float32" else 1e-13
    assert abs(got.sum() - ref) <= tolerance * np.sum(np.abs(ref) + 1)


def test_only_large_inputs_read_across_are_staged():
    """The energy's four reads of the tile-sized Z across c are staged (an 8x8x8 box over a, b,
    c); the Z statement's inputs across c are tiles of t2 and ovov 1/540 of its size, read from
    the caches, so it is not (staging them measured slower on the H100)."""
    plan = pointwise.staging(TILE, ENERGY, ("float64",) * 14)
    assert plan == pointwise.Staging((3, 4, 5), (8, 8, 8), (1, 5, 7, 10))
    assert pointwise.staging(TILE, Z_STATEMENT, ("float64",) * 20) is None
    assert pointwise.blocks(TILE, plan) == 27 * 23 ** 3


class _Recording:
    """An array module whose ``RawKernel`` records launches instead of running them (NumPy for
    the rest): what :func:`pointwise.launch` and :func:`pointwise.reduce` hand to CuPy."""

    def __init__(self):
        self.launches = []
        self.empty, self.zeros, self.float64, self.uint32 = np.empty, np.zeros, np.float64, np.uint32

    def RawKernel(self, text, name):
        return lambda grid, block, args: self.launches.append((text, name, grid, block, len(args)))


@pytest.mark.parametrize("case", CASES)
def test_launches_use_the_source_and_grid_of_their_staging(case):
    """The kernel text and grid a launch and a reduction pass on are :func:`pointwise.source` /
    :func:`pointwise.reduce_source` and :func:`pointwise.blocks` of the reduced layout, staged or
    not, the same on a second call (made once per process); a reduction's partial sums are then
    added by :func:`pointwise.total`."""
    out, inputs = views(case)
    types = tuple(a.dtype.name for a in inputs) + (out.dtype.name,)
    shape, reduced = pointwise.layout(out.shape, [element_strides(out)] + [element_strides(a) for a in inputs])
    grid = pointwise.blocks(shape, pointwise.staging(shape, reduced, types))
    code = " + ".join(f"p{k}" for k in range(len(inputs)))
    xp = _Recording()
    for _ in range(2):
        pointwise.launch(xp, "y + " + code, inputs, out)
    text = pointwise.source("y + " + code, shape, reduced, types)
    assert xp.launches == [(text, "chainexec_pointwise", (grid,), (pointwise.BLOCK,), 1 + len(inputs))] * 2
    walk = tuple(int(np.prod(out.shape[d + 1:])) for d in range(out.ndim))
    shape, reduced = pointwise.layout(out.shape, [walk] + [element_strides(a) for a in inputs])
    pointwise.reduce(xp, code, inputs, out.shape)
    grid = pointwise.blocks(shape, pointwise.staging(shape, reduced, types[:-1] + ("float64",)))
    assert xp.launches[-2:] == [(pointwise.reduce_source(code, shape, reduced, types[:-1] + ("float64",)),
                                 "chainexec_reduce", (grid,), (pointwise.BLOCK,), 1 + len(inputs)),
                                (pointwise.TOTAL_SOURCE, "chainexec_total", (1,), (pointwise.BLOCK,), 3)]


PAIRS = [(0, 1, 2, 3, 4, 5), (1, 0, 2, 4, 3, 5), (2, 1, 0, 5, 4, 3), (0, 2, 1, 3, 5, 4), (1, 2, 0, 4, 5, 3),
         (2, 0, 1, 5, 3, 4)]
"""The (T) W tile's pair permutations of (i a)(j b)(k c) on [i, j, k, a, b, c]: a diagonal tile's group."""
SYMMETRIZE_CASES = {
    "pairs": ((2, 2, 2, 9, 9, 9), PAIRS, [0, 1, 2, 3, 4, 5], np.float64),
    "pairs float32": ((2, 2, 2, 9, 9, 9), PAIRS, [0, 1, 2, 3, 4, 5], np.float32),
    "two equal": ((2, 2, 3, 5, 5, 11), PAIRS[:2], [0, 1, 2, 3, 4, 5], np.float64),
    "transposed, fixed blocks": ((37, 37), [(0, 1), (1, 0)], [1, 0], np.float64),
    "pairs, ordered": ((3, 3, 3, 9, 9, 9), PAIRS, [0, 1, 2, 3, 4, 5], np.float64, ((0, 1, 2),)),
    "two equal, ordered": ((3, 3, 2, 5, 5, 11), PAIRS[:2], [0, 1, 2, 3, 4, 5], np.float64, ((0, 1),)),
    "transposed, ordered": ((37, 37), [(0, 1), (1, 0)], [1, 0], np.float64, ((0, 1),)),
}
"""Per case: shape, axes, the view's storage order, dtype, and the groups of dimensions whose
non-decreasing points alone are written (``keep``, :mod:`chainexec.planner.ordered`), if any."""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("case", sorted(SYMMETRIZE_CASES))
def test_symmetrize_in_place_equals_numpy(case, tmp_path):
    """The in-place symmetrization kernel, run on the CPU, against NumPy's out-of-place sum of the
    permuted views: ``pairs``, a diagonal (T) tile's six pair permutations over blocks of 8
    overhanging the extent 9; ``two equal``, a tile whose first two positions are equal; a
    square array stored transposed, whose diagonal blocks are their own images (each written
    once). With ``keep``, only the points whose coordinates are non-decreasing within its groups
    are written, the others keep their values. Nothing outside the view is written (NaN
    padding)."""
    shape, axes, order, dtype, *keep = SYMMETRIZE_CASES[case]
    keep = keep[0] if keep else ()
    rng = np.random.default_rng(len(case))
    big, view = _padded(rng, shape, order, dtype)
    want = sum(view.transpose(p) for p in axes)
    if keep:
        want = np.where(ordering.weights(shape, keep) > 0, want, view)
        assert not np.allclose(want, sum(view.transpose(p) for p in axes))
    strides = element_strides(view)
    plan = pointwise.symmetrize_plan(shape, strides, tuple(axes), np.dtype(dtype).itemsize)
    text = pointwise.symmetrize_source(shape, strides, tuple(axes), np.dtype(dtype).name, plan, keep)
    got = _emulated(tmp_path, text, "chainexec_symmetrize", [big], [_offset_of(big, view)], int(np.prod(plan.counts)))
    inner = tuple(slice(1, n - 1) for n in big.shape)
    outside = np.ones(got.shape, bool)
    outside[inner] = False
    assert np.isnan(got[outside]).all()
    result = got[inner].transpose(np.argsort(order))
    tolerance = 1e-6 if dtype == np.float32 else 1e-14
    assert np.max(np.abs(result - want)) <= tolerance * np.max(np.abs(want))


def test_symmetrize_blocks():
    """Blocks of 8 along the three exchanged virtual dimensions of a diagonal (T) tile (one along
    the occupied ones); with a pair exchanged, the fixed fastest dimension whole; axes that are
    not a group of shape-preserving permutations are refused."""
    shape, strides = (6, 6, 6, 93, 93, 93), (6 * 6 * 93**3, 6 * 93**3, 93**3, 93 * 93, 93, 1)
    plan = pointwise.symmetrize_plan(shape, strides, tuple(PAIRS), 8)
    assert plan.edges == (1, 1, 1, 8, 8, 8) and plan.counts == (6, 6, 6, 12, 12, 12)
    assert pointwise.symmetrize_plan(shape, strides, tuple(PAIRS[:2]), 8).edges == (1, 1, 1, 2, 2, 93)
    with pytest.raises(ValueError, match="closed"):
        pointwise.symmetrize_plan(shape, strides, tuple(PAIRS[:3]), 8)
    with pytest.raises(ValueError, match="identity"):
        pointwise.symmetrize_plan(shape, strides, tuple(PAIRS[1:2]), 8)
    with pytest.raises(ValueError, match="equal extent"):
        pointwise.symmetrize_plan((2, 3), (3, 1), ((0, 1), (1, 0)), 8)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("n", [1, 255, 4097])
def test_total_adds_partial_sums_in_a_fixed_order(n, tmp_path):
    """The reductions' last step (one block over ``n`` partial sums, fewer or more than its
    threads), run on the CPU, against NumPy's sum; nothing but ``y[0]`` is written."""
    partial = np.random.default_rng(n).standard_normal(n)
    y = np.full(2, np.nan)
    emulated = pointwise.TOTAL_SOURCE.replace(", const unsigned n)", ")").replace(
        "k < n;", f"k < {n}u;")  # the emulation passes buffers only
    got = _emulated(tmp_path, emulated, "chainexec_total", [y, partial], [0, 0], 1)
    assert abs(got[0] - partial.sum()) <= 1e-13 * np.abs(partial).sum() and np.isnan(got[1])


class _OnGpu(_Recording):
    """:class:`_Recording` as a GPU's array module (it has ``cuda``): its preparations are logged."""

    cuda = None

    def __init__(self):
        super().__init__()
        self.asarray, self.int32 = np.asarray, np.int32


def test_preparations_are_logged_once_and_made_again_from_the_log(tmp_path, monkeypatch):
    """A point-wise launch, a reduction, a symmetrization and an orbit reduction on a GPU log
    their preparations (:func:`pointwise._ready`) once per process, however often they run. A
    later process that makes them from the log (:func:`warmup.prepare`, as the backend's
    selection does while the warm-up loads) finds them made at its launches, which pass on the
    same kernels; entries it cannot make are skipped."""
    from chainexec.runtime import uselog, warmup

    monkeypatch.setattr(uselog, "_PENDING", {})
    monkeypatch.setattr(uselog, "_JOB", "/runs/t.yaml")
    monkeypatch.setattr(uselog, "device_name", lambda xp, device=None: "H100")
    monkeypatch.setattr(uselog, "path", lambda: tmp_path / "uses.json")
    rng = np.random.default_rng(5)
    z = rng.standard_normal((2, 9, 9, 9))
    e = rng.standard_normal(9)

    def run(xp):
        out = rng.standard_normal((2, 9, 9, 9))
        pointwise.launch(xp, "y + p0", [z], out)
        pointwise.reduce(xp, "p0 * p0", [z], z.shape)
        pointwise.symmetrize(xp, out, [(0, 1, 2, 3), (0, 2, 1, 3)])
        pointwise.orbit_reduce(xp, ["p0 + p1"], ENERGY_CODE.replace("p2", "p1"), [(0, p) for p in PERMS3],
                               [z, e[None, None, :, None]], z.shape, "float64")
        return [(text, name, grid) for text, name, grid, *_ in xp.launches]

    def clear():
        for make in pointwise.PREPARED.values():
            make.cache_clear()

    clear()
    first = run(_OnGpu())
    run(_OnGpu())
    uselog.flush()
    logged = uselog.uses("H100", "/runs/t.yaml")["prepared"]
    assert sorted(name for name, _ in logged) == ["_orbit_prepared", "_prepared", "_prepared", "_symmetrize_prepared"]
    clear()
    uselog.note("H100", "prepared", ("os.system", "[]"))
    uselog.note("H100", "prepared", ("_prepared", "not json"))
    uselog.note("H100", "prepared", ("_symmetrize_prepared", "[1, 2]"))
    uselog.flush()
    warmup.prepare("H100", "/runs/t.yaml")
    assert [make.cache_info().currsize for make in pointwise.PREPARED.values()] == [2, 1, 1]
    misses = [make.cache_info().misses for make in pointwise.PREPARED.values()]
    assert run(_OnGpu()) == first
    assert [make.cache_info().misses for make in pointwise.PREPARED.values()] == misses
    with pytest.raises(ValueError, match="no preparation"):
        pointwise.prepare("os.system", "[]")
