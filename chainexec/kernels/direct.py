"""Direct contraction kernels: any binary contraction with one thread per output element that
loops over the summed indices, reading both operands where they lie (pure CUDA C source
generation; :func:`chainexec.runtime.pointwise.contract` launches them).

No temporary and no workspace at all, at the FP64 CUDA cores' speed at best: the contraction
method that always fits (``direct``), for tiles cut so small by the device memory limit that no
other method's temporaries fit beside them.
"""

from __future__ import annotations

import math

from chainexec.kernels.elementwise import BLOCK, C_TYPES, coordinates, index_type, layout, offset_code

def contraction_source(shape: tuple[int, ...], summed: tuple[int, ...], strides: list[tuple[int, ...]],
                       inner: list[tuple[int, ...]], types: tuple[str, ...]) -> str:
    """CUDA C of ``chainexec_direct(y, a, b, factor)``: ``y[at] += factor · Σ a·b`` over the summed
    index space ``summed`` for every element of ``shape`` (both :func:`layout`-reduced);
    ``strides``: the output's, a's and b's along ``shape``; ``inner``: a's and b's along
    ``summed``; ``types``: a's, b's and the output's dtypes. Products are added in double."""
    index = index_type([math.prod(shape), math.prod(summed)], shape + summed,
                        [st + it for st, it in zip(strides, [(0,) * len(summed)] + inner)])
    out_type = C_TYPES[types[2]]
    lines = [f"extern \"C\" __global__ void chainexec_direct({out_type}* __restrict__ Y, "
             f"const {C_TYPES[types[0]]}* __restrict__ A, const {C_TYPES[types[1]]}* __restrict__ B, double factor) {{",
             f"  const long long flat = (long long)blockIdx.x * {BLOCK} + threadIdx.x;",
             f"  if (flat >= {math.prod(shape)}LL) return;",
             f"  unsigned {index} rest = (unsigned {index})flat;"]
    lines += ["  " + line for line in coordinates(shape, index)]
    lines += [f"  const {index} at = {offset_code(strides[0])};",
              f"  const {index} oa = {offset_code(strides[1])};",
              f"  const {index} ob = {offset_code(strides[2])};",
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

