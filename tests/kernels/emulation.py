"""The CPU emulation of generated point-wise kernels, shared by the tests of every point-wise
family: views of one kind over NaN-padded buffers, every CUDA thread of a block a
``std::thread`` (g++), and the nvcc compile check."""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import numpy as np

from chainexec.kernels.elementwise import BLOCK


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


def padded(rng, shape, order, dtype=np.float64):
    """(buffer, view): a view of shape ``shape`` into a NaN-padded buffer stored in axis order ``order``."""
    stored = [shape[d] for d in order]
    big = np.full([n + 2 for n in stored], np.nan, dtype)
    inner = tuple(slice(1, 1 + n) for n in stored)
    big[inner] = rng.standard_normal(stored)
    return big, big[inner or ...].transpose(np.argsort(order))


def offset_of(big: np.ndarray, view: np.ndarray) -> int:
    """Where ``view`` starts in ``big`` (elements)."""
    return (view.__array_interface__["data"][0] - big.ctypes.data) // big.itemsize


STAGED_PRELUDE = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
struct Dim3 { unsigned x; };
thread_local Dim3 threadIdx, blockIdx;
static Dim3 gridDim;
static inline double __dmul_rn(double a, double b) { return a * b; }
static std::barrier<>* g_block;
static std::barrier<>* g_warp[8];
static double g_lane[256];
static unsigned char* g_dynamic;
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


GUARD = 4096
"""Bytes past an emulated kernel's dynamic shared memory that :func:`emulated` checks it never
writes."""


def emulated(tmp_path, text: str, name: str, buffers: list[np.ndarray], offsets: list[int], grid: int,
             scalars: tuple[str, ...] = (), shared: int = 0) -> np.ndarray:
    """Run a generated point-wise kernel on the CPU: every CUDA thread of a block a
    ``std::thread`` (``std::barrier`` for ``__syncthreads`` and per warp for the shuffles,
    ``__shared__`` function-static), blocks one after another; ``buffers[0]`` is the output's
    whole buffer, returned as the kernel left it; each array is passed at its ``offsets`` entry,
    then the C literals ``scalars``. The kernel's dynamic shared memory (``extern __shared__``)
    is ``shared`` bytes as its launch would give it, filled with NaN (all bits set) before each
    block: a read of a value no thread wrote gives NaN, and a write past the end (into the
    :data:`GUARD` bytes after it) fails the run."""
    ctype = {np.dtype(np.float64): "double", np.dtype(np.float32): "float", np.dtype(np.int32): "int",
             np.dtype(np.int64): "long long"}
    decl = "\n".join(f"  std::vector<{ctype[b.dtype]}> b{k}({b.size}); "
                     f"if (fread(b{k}.data(), sizeof({ctype[b.dtype]}), {b.size}, f) != {b.size}) return 2;"
                     for k, b in enumerate(buffers))
    args = ", ".join([f"b{k}.data() + {off}" for k, off in enumerate(offsets)] + list(scalars))
    main = f"""
int main(int argc, char** argv) {{
  FILE* f = fopen(argv[1], "rb");
{decl}
  fclose(f);
  gridDim.x = {grid}u;
  std::vector<unsigned char> dynamic({shared + GUARD});
  g_dynamic = dynamic.data();
  for (unsigned b = 0; b < {grid}u; ++b) {{
    std::fill(dynamic.begin(), dynamic.end(), 0xff);
    std::barrier<> block({BLOCK});
    std::barrier<> w0(32), w1(32), w2(32), w3(32), w4(32), w5(32), w6(32), w7(32);
    std::barrier<>* warps[8] = {{&w0, &w1, &w2, &w3, &w4, &w5, &w6, &w7}};
    for (int w = 0; w < 8; ++w) g_warp[w] = warps[w];
    g_block = &block;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < {BLOCK}u; ++t)
      ts.emplace_back([&, t, b] {{ threadIdx.x = t; blockIdx.x = b; {name}({args}); }});
    for (auto& th : ts) th.join();
    for (size_t i = {shared}; i < dynamic.size(); ++i) if (dynamic[i] != 0xff) return 3;
  }}
  f = fopen(argv[1], "wb");
  fwrite(b0.data(), sizeof({ctype[buffers[0].dtype]}), {buffers[0].size}, f);
  fclose(f);
  return 0;
}}
"""
    cpp, exe, data = tmp_path / f"{name}.cpp", tmp_path / name, tmp_path / f"{name}.bin"
    text = re.sub(r"extern __shared__ (\w+) (\w+)\[\];", r"\1* const \2 = (\1*)g_dynamic;", text)
    cpp.write_text(STAGED_PRELUDE + f"static const Dim3 blockDim{{{BLOCK}u}};\n" + text + main)
    compile_emulation(tmp_path, cpp, exe)
    data.write_bytes(b"".join(b.tobytes() for b in buffers))
    subprocess.run([str(exe), str(data)], check=True, timeout=300)  # a barrier some thread misses hangs
    return np.fromfile(data, dtype=buffers[0].dtype, count=buffers[0].size).reshape(buffers[0].shape)


GXX = ("g++", "-O1", "-std=c++20", "-pthread", "-w")
"""How every emulation is compiled (host C++20 with threads)."""


def compile_emulation(tmp_path: Path, cpp: Path, exe: Path) -> None:
    """Compile an emulation's C++ source ``cpp`` into ``exe`` (:data:`GXX`), the ``#include``
    lines at its top read from a precompiled header of exactly those lines: the header stands
    before the source, whose own lines then include nothing again, so the program is the same.
    Parsing the standard headers (``<thread>``, ``<barrier>``, …) is a third of a compilation,
    and every emulation of a test run includes one of a few such blocks; each block's header is
    compiled once per pytest worker, in the worker's base temporary folder (``tmp_path``'s
    parent)."""
    lines = cpp.read_text().lstrip("\n").splitlines()
    block = "".join(line + "\n" for line in _leading_includes(lines))
    before = ["-include", str(_precompiled(tmp_path.parent, block))] if block else []
    subprocess.run([*GXX, *before, str(cpp), "-o", str(exe)], check=True, timeout=300)


def _leading_includes(lines: list[str]) -> list[str]:
    """The ``#include <...>`` lines that begin ``lines``, up to the first other line."""
    taken = []
    for line in lines:
        if not line.startswith("#include <"):
            break
        taken.append(line)
    return taken


def _precompiled(folder: Path, block: str) -> Path:
    """A header of the ``#include`` lines ``block`` in ``folder``, compiled beside it
    (``NAME.h.gch``, which g++ reads in place of ``NAME.h``) the first time it is asked for."""
    header = folder / "emulation-headers" / f"{hashlib.sha256(block.encode()).hexdigest()[:16]}.h"
    compiled = header.with_name(header.name + ".gch")
    if not compiled.exists():
        header.parent.mkdir(exist_ok=True)
        header.write_text(block)
        partial = header.with_name(header.name + ".gch.part")
        subprocess.run([*GXX, "-x", "c++-header", str(header), "-o", str(partial)], check=True, timeout=300)
        partial.rename(compiled)
    return header


def stored(rng, shape, order, dtype=np.float64):
    """(buffer, element offset, view) of :func:`padded`: what the emulated kernels are passed."""
    big, view = padded(rng, shape, order, dtype)
    return big, offset_of(big, view), view


def compiles_with_nvcc(tmp_path, sources: list[str]) -> None:
    """Assert that each CUDA source compiles with nvcc to a CUBIN for sm_90."""
    for k, text in enumerate(sources):
        f = tmp_path / f"p{k}.cu"
        f.write_text(text)
        r = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / f"p{k}.cubin"), str(f)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def gathered_shape(a_shape: tuple, before, axis: int, positions: tuple, after) -> tuple:
    """The shape a gather (:meth:`chainexec.runtime.device.Backend.gather`) of an array of
    ``a_shape`` writes: the pair axis replaced by its members' block (unpack) or the two member
    axes by the block of pairs (pack), the axes in the orders ``before`` and ``after``."""
    taken = a_shape if before is None else tuple(a_shape[d] for d in before)
    if positions[0] == "unpack":
        shape = taken[:axis] + (positions[3] - positions[2], positions[5] - positions[4]) + taken[axis + 1:]
    else:
        shape = taken[:axis] + (positions[2] - positions[1],) + taken[axis + 2:]
    return shape if after is None else tuple(shape[t] for t in after)
