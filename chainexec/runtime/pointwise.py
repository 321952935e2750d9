"""Generated point-wise CUDA kernels over strided views: ``out = expression(inputs, out)``.

Every device statement that sums over nothing goes through :func:`launch`: a permuted copy, a
Hadamard or outer product, a run of such terms added into one buffer (the (T) ``V``, ``Z`` and
``R`` tiles) and a computed tensor's expression (the (T) denominator). Its inputs are views that
broadcast against ``out`` (stride 0 along the indices they lack) and may be permuted or cut from
larger buffers, so no temporary array is made.

Why not CuPy's ``ElementwiseKernel``: over non-contiguous views it recomputes every operand's
position from the flat element number with one integer division per dimension per operand, in
registers sized for any shape. On the H100, the twelve outer products of the (T) ``V`` tile (24
broadcast views of 6-D, o=24 v=180, 4x4x4 occupied tiles) took 22 ms per tile that way, for one
3 GB write. Here the shape and every operand's strides are compile-time constants of the
generated source: the element number is split into coordinates once (unsigned divisions by
constants, which the compiler turns into multiplications), each operand's offset is a sum of constant
products, dimensions contiguous in every operand are merged first, and 32-bit arithmetic is used
where every offset fits. One kernel is compiled per (expression, shape, strides, dtypes) and
kept by CuPy's on-disk cache. A plan whose extents divide into its tiles has one shape per
statement; uneven edge tiles add variants (up to 2^d for a d-index tile), each compiled once.

Threads walk ``out`` in its memory order (its fastest-varying dimension innermost), so writes
are coalesced whatever the view.

:func:`reduce` sums such an expression over a whole index space instead of writing it (a fused
statement into a scalar, :mod:`chainexec.planner.inline`: the (T) energy): one element per thread
as above, each block adds its threads' values in a fixed order and writes one partial sum, and
the partial sums are added by CuPy. The grid depends on the element count only, so a run's
result is the same bit for bit every time (no atomics). A first version had 4,096 blocks loop
over the elements: on the H100 the (T) energy's expression (thirteen reads, six of them
permuted) then took 2.0 s of a run where the unfused statements took 1.3 s, too few loads in
flight to hide the permuted reads' latency.

:func:`contract` is the same idea for any binary contraction: one thread per output element
loops over the summed indices, reading both operands where they lie. No temporary and no
workspace at all, at the FP64 CUDA cores' speed at best: the contraction method that always
fits (``direct`` in :mod:`chainexec.runtime.device`), for tiles cut so small by the device
memory limit that no other method's temporaries fit beside them.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

C_TYPES = {"float64": "double", "float32": "float"}
"""The dtypes a plan's tensors may have (see :mod:`chainexec.spec`), as C type names."""
BLOCK = 256
"""Threads per block (one element per thread)."""
INDEX32 = 2**31
"""Element counts and offset spans below this use 32-bit index arithmetic, the rest 64-bit."""


def layout(shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """The iteration space of ``shape`` (``strides[0]``: the output's, then each input's, in
    elements) reduced to what the kernel needs: dimensions of extent 1 dropped, the rest ordered by
    the output's strides (largest first, so the last is the output's fastest-varying one), and
    neighbours merged where every array steps through them as through one dimension. Returns the
    reduced shape and strides (same order of arrays)."""
    dims = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -abs(strides[0][d]))
    merged_shape: list[int] = []
    merged: list[list[int]] = [[] for _ in strides]
    for d in dims:
        if merged_shape and all(m[-1] == s[d] * shape[d] for m, s in zip(merged, strides)):
            merged_shape[-1] *= shape[d]
            for m, s in zip(merged, strides):
                m[-1] = s[d]
            continue
        merged_shape.append(shape[d])
        for m, s in zip(merged, strides):
            m.append(s[d])
    return tuple(merged_shape), [tuple(m) for m in merged]


def _code_check(code: str) -> None:
    if not re.fullmatch(r"[\sA-Za-z0-9_.+\-*/()e]*", code):
        raise ValueError(f"point-wise code {code!r} has characters outside numbers, names and operators")


def _index_type(counts: list[int], shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> str:
    """``int`` where the element ``counts`` and every array's offset span fit in 32 bits."""
    extent = max([1] + [sum((n - 1) * abs(s) for n, s in zip(shape, st)) + 1 for st in strides])
    return "int" if max(counts + [extent]) < INDEX32 else "long long"


def _coordinates(shape: tuple[int, ...], index: str) -> list[str]:
    """Lines that split ``rest`` (the element number) into the coordinates ``c0, c1, …``.
    Unsigned division by a constant is a multiply and a shift; the coordinates are then signed
    for the offsets (a view's strides may be any sign)."""
    return [f"const {index} c{d} = rest % {shape[d]}u; rest /= {shape[d]}u;" if d else f"const {index} c0 = rest;"
            for d in reversed(range(len(shape)))]


def _element(shape: tuple[int, ...], strides: list[tuple[int, ...]], types: tuple[str, ...]) -> tuple[str, list[str]]:
    """The index type and the lines that find an element's coordinates and read every input's
    value ``p0, p1, …`` there, for :func:`source` and :func:`reduce_source` (arguments as there)."""
    index = _index_type([math.prod(shape)], shape, strides)
    loads = [f"const {C_TYPES[t]} p{k} = P{k}[{_offset(strides[1 + k])}];" for k, t in enumerate(types[:-1])]
    return index, _coordinates(shape, index) + loads


def _offset(st: tuple[int, ...]) -> str:
    return " + ".join([f"c{d} * {s}" for d, s in enumerate(st) if s] or ["0"])


def _params(types: tuple[str, ...]) -> str:
    return ", ".join([f"{C_TYPES[types[-1]]}* __restrict__ Y"]
                     + [f"const {C_TYPES[t]}* __restrict__ P{k}" for k, t in enumerate(types[:-1])])


def source(code: str, shape: tuple[int, ...], strides: list[tuple[int, ...]], types: tuple[str, ...]) -> str:
    """CUDA C of ``chainexec_pointwise(y, p0, p1, …)``: ``y[at] = code`` for every element of
    ``shape`` (already :func:`layout`-reduced). ``strides[0]`` and ``types[-1]`` are the output's,
    ``strides[1 + k]`` and ``types[k]`` input ``k``'s; ``code`` is a C expression over the values
    ``p0, p1, …`` and ``y`` (the output's current value), numbers and operators only (made by
    :func:`chainexec.expr.c_source` or from contraction factors): no user text reaches the source."""
    _code_check(code)
    index, element = _element(shape, strides, types)
    out_type = C_TYPES[types[-1]]
    lines = [f"extern \"C\" __global__ void chainexec_pointwise({_params(types)}) {{",
             f"  const long long flat = (long long)blockIdx.x * {BLOCK} + threadIdx.x;",
             f"  if (flat >= {math.prod(shape)}LL) return;",
             f"  unsigned {index} rest = (unsigned {index})flat;"]
    lines += ["  " + line for line in element]
    lines.append(f"  const {index} at = {_offset(strides[0])};")
    if re.search(r"\by\b", code):
        lines.append(f"  const {out_type} y = Y[at];")
    lines += [f"  Y[at] = ({out_type})({code});", "}"]
    return "\n".join(lines)


def reduce_source(code: str, shape: tuple[int, ...], strides: list[tuple[int, ...]], types: tuple[str, ...]) -> str:
    """CUDA C of ``chainexec_reduce(partial, p0, p1, …)``: block ``b`` writes to ``partial[b]`` the
    sum, in double precision, of ``code`` over its elements of ``shape`` (one per thread, added by
    a warp-shuffle and shared-memory tree in a fixed order). Arguments as in
    :func:`source`, with ``strides[0]`` those of the index space read contiguously (the order the
    threads walk) and ``types[-1]`` float64 (the partial sums); ``code`` may not read ``y``."""
    _code_check(code)
    if re.search(r"\by\b", code):
        raise ValueError("a reduction has no output value y to read")
    index, element = _element(shape, strides, types)
    lines = [f"extern \"C\" __global__ void chainexec_reduce({_params(types)}) {{",
             "  __shared__ double part[32];",
             "  double acc = 0.0;",
             f"  const long long flat = (long long)blockIdx.x * {BLOCK} + threadIdx.x;",
             f"  if (flat < {math.prod(shape)}LL) {{",
             f"    unsigned {index} rest = (unsigned {index})flat;"]
    lines += ["    " + line for line in element]
    lines += [f"    acc = (double)({code});",
              "  }",
              "  for (int s = 16; s > 0; s >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, s);",
              "  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;",
              "  __syncthreads();",
              "  if (threadIdx.x < 32) {",
              f"    acc = threadIdx.x < {BLOCK // 32} ? part[threadIdx.x] : 0.0;",
              "    for (int s = 16; s > 0; s >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, s);",
              "    if (threadIdx.x == 0) Y[blockIdx.x] = acc;",
              "  }",
              "}"]
    return "\n".join(lines)


@lru_cache(maxsize=1024)
def _kernel(xp, text: str, name: str):
    return xp.RawKernel(text, name)


def _strides(views: list, walk: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Element strides: ``walk`` (the output's, or the order a reduction visits), then each
    view's (0 along its broadcast axes)."""
    return [walk] + [tuple(0 if n == 1 else s // v.itemsize for n, s in zip(v.shape, v.strides))
                                for v in views]


def launch(xp, code: str, views: list, out) -> None:
    """``out[...] = code`` element by element on the current stream, ``views[k]`` read as ``pk``
    and ``out``'s current value as ``y``; every view has ``out``'s number of dimensions, with
    extent ``out``'s or 1 (broadcast) in each. Nothing here writes anything but ``out``'s view."""
    total = math.prod(out.shape)
    if total == 0:
        return
    shape, strides = layout(tuple(out.shape), _strides(views, tuple(s // out.itemsize for s in out.strides)))
    text = source(code, shape, strides, tuple(v.dtype.name for v in views) + (out.dtype.name,))
    _kernel(xp, text, "chainexec_pointwise")(((total + BLOCK - 1) // BLOCK,), (BLOCK,), (out, *views))


def reduce(xp, code: str, views: list, shape: tuple[int, ...]):
    """Σ ``code`` over every element of ``shape`` (views as in :func:`launch`, each with extent
    ``shape``'s or 1 per dimension), as a 0-d float64 device array; threads walk ``shape`` in
    C order (its last dimension fastest)."""
    total = math.prod(shape)
    if total == 0:
        return xp.zeros((), xp.float64)
    walk = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    merged, strides = layout(tuple(shape), _strides(views, walk))
    text = reduce_source(code, merged, strides, tuple(v.dtype.name for v in views) + ("float64",))
    blocks = -(-total // BLOCK)
    partial = xp.empty(blocks, xp.float64)
    _kernel(xp, text, "chainexec_reduce")((blocks,), (BLOCK,), (partial, *views))
    return partial.sum()


def contraction_source(shape: tuple[int, ...], summed: tuple[int, ...], strides: list[tuple[int, ...]],
                       inner: list[tuple[int, ...]], types: tuple[str, ...]) -> str:
    """CUDA C of ``chainexec_direct(y, a, b, factor)``: ``y[at] += factor · Σ a·b`` over the summed
    index space ``summed`` for every element of ``shape`` (both :func:`layout`-reduced);
    ``strides``: the output's, a's and b's along ``shape``; ``inner``: a's and b's along
    ``summed``; ``types``: a's, b's and the output's dtypes. Products are added in double."""
    index = _index_type([math.prod(shape), math.prod(summed)], shape + summed,
                        [st + it for st, it in zip(strides, [(0,) * len(summed)] + inner)])
    out_type = C_TYPES[types[2]]
    lines = [f"extern \"C\" __global__ void chainexec_direct({out_type}* __restrict__ Y, "
             f"const {C_TYPES[types[0]]}* __restrict__ A, const {C_TYPES[types[1]]}* __restrict__ B, double factor) {{",
             f"  const long long flat = (long long)blockIdx.x * {BLOCK} + threadIdx.x;",
             f"  if (flat >= {math.prod(shape)}LL) return;",
             f"  unsigned {index} rest = (unsigned {index})flat;"]
    lines += ["  " + line for line in _coordinates(shape, index)]
    lines += [f"  const {index} at = {_offset(strides[0])};",
              f"  const {index} oa = {_offset(strides[1])};",
              f"  const {index} ob = {_offset(strides[2])};",
              "  double acc = 0.0;"]
    pad = "  "
    for d, n in enumerate(summed):
        lines.append(f"{pad}for ({index} s{d} = 0; s{d} < {n}; ++s{d}) {{")
        pad += "  "
    ia = " + ".join(["oa"] + [f"s{d} * {s}" for d, s in enumerate(inner[0]) if s])
    ib = " + ".join(["ob"] + [f"s{d} * {s}" for d, s in enumerate(inner[1]) if s])
    lines.append(f"{pad}acc += (double)A[{ia}] * (double)B[{ib}];")
    lines += ["  " * (d + 1) + "}" for d in reversed(range(len(summed)))]
    lines += [f"  Y[at] = ({out_type})(Y[at] + factor * acc);", "}"]
    return "\n".join(lines)


def direct_source(out, a, b, indices: tuple[list[str], list[str], list[str]]) -> str:
    """:func:`contraction_source` for arrays (NumPy or CuPy: only shapes, strides and dtypes are
    read) ``out``, ``a``, ``b`` over the index lists ``indices`` (out's, a's, b's)."""
    out_ix, a_ix, b_ix = indices
    size = dict(zip(a_ix, a.shape)) | dict(zip(b_ix, b.shape)) | dict(zip(out_ix, out.shape))
    rest = [i for i in dict.fromkeys(a_ix + b_ix) if i not in out_ix]

    def along(arr, ix, names):
        st = dict(zip(ix, (s // arr.itemsize for s in arr.strides)))
        return tuple(st.get(i, 0) if size[i] > 1 else 0 for i in names)

    shape, strides = layout(tuple(size[i] for i in out_ix), [along(out, out_ix, out_ix), along(a, a_ix, out_ix),
                                                             along(b, b_ix, out_ix)])
    summed, inner = layout(tuple(size[i] for i in rest), [along(a, a_ix, rest), along(b, b_ix, rest)])
    return contraction_source(shape, summed, strides, inner, (a.dtype.name, b.dtype.name, out.dtype.name))


def contract(xp, out, a, b, indices: tuple[list[str], list[str], list[str]], factor: float) -> None:
    """``out += factor · a·b`` for the binary contraction whose index lists (out, a, b) are
    ``indices``, over the views as they lie (:func:`direct_source`), on the current stream."""
    total = math.prod(out.shape)
    if total == 0:
        return
    kernel = _kernel(xp, direct_source(out, a, b, indices), "chainexec_direct")
    kernel(((total + BLOCK - 1) // BLOCK,), (BLOCK,), (out, a, b, xp.float64(factor)))
