"""Shape-generic kernels of the tile operations between strided views: ``out = f·x`` (``set``),
``out += f·x`` (``add``) and ``out = f`` (``fill``) (pure CUDA C source generation;
:mod:`chainexec.runtime.pointwise` launches them).

The CuPy backend copies and adds tiles between views of every shape it meets: a stacked
contraction's operands copied with their factors (:mod:`chainexec.kernels.stacking`), a product
added into its output, an operand made contiguous for a GEMM or for the host, an output cleared.
:func:`chainexec.kernels.elementwise.source` compiles one kernel per shape and strides; these take
the extents and strides as arguments and compile in only the number of dimensions (after
:func:`~chainexec.kernels.elementwise.layout` has merged what it can), the dtype (one for both
arrays, as the planner's statements have) and the index width, so that one CUBIN serves every
tile of a dimension count, and a process's warm-up compiles the usual ones at once, in threads,
before its first statement (:func:`common`). CuPy's own
element-wise kernels are generic in the same way, but CuPy compiles each one on its first use, one
after another, holding the interpreter's lock, while the run's first tiles wait.

The element number is split into coordinates by divisions by the extents (one per dimension per
element, as in CuPy's kernels; :mod:`~chainexec.kernels.elementwise` divides by constants
instead). Threads walk ``out`` in its memory order, so its writes are coalesced. The product
``f·x`` (``f`` of the dtype) is made in double precision and rounded to the dtype before it is
added (``__dmul_rn``: no fused multiply-add), which is ``out += f * x`` as NumPy and CuPy round
it (for float32 the double product of two floats is exact, so its rounding is the float
product's); with ``f = 1`` a copy or sum is exact.
"""

from __future__ import annotations

from functools import lru_cache

from chainexec.kernels.elementwise import BLOCK, C_TYPES

OPERATIONS = ("set", "add", "fill")
"""The kernels of one module: ``chainexec_strided_<operation>``."""
GRID = 4096
"""Blocks at most per launch: a few per SM of any current GPU; each thread walks the rest of
the elements a grid apart."""
COMMON_DIMS = 6
"""A warm-up compiles the float64 modules of 0 to this many dimensions (32-bit indices): the
(T) run's tile operations reach five after merging."""


def grid(n: int) -> int:
    """Blocks of :data:`BLOCK` threads for ``n`` elements."""
    return max(1, min(GRID, -(-n // BLOCK)))


@lru_cache(maxsize=None)
def strided_source(dims: int, dtype: str, index: str) -> str:
    """CUDA C of the three kernels for views of ``dims`` dimensions (after merging), ``out`` and
    ``x`` of ``dtype`` (a name of :data:`C_TYPES`), index arithmetic in ``index`` (``int`` or
    ``long long``: :func:`chainexec.kernels.elementwise.index_type` of the element count plus one
    grid's threads and of every offset span):

    - ``chainexec_strided_set(Y, P, f, n, e1, …, y0, …, s0, …)``: ``Y[at] = f·P[from]``;
    - ``chainexec_strided_add(…)`` (the same arguments): ``Y[at] += f·P[from]``;
    - ``chainexec_strided_fill(Y, f, n, e1, …, y0, …)``: ``Y[at] = f``;

    over the ``n`` elements of extents ``e0, e1, …`` (``e0`` is ``n / Π e1…``, so not an
    argument), ``y`` and ``s`` the strides (elements) of ``Y`` and ``P``. ``P`` may be ``Y``
    itself (no ``__restrict__``)."""
    t = C_TYPES[dtype]
    extents = [f"const {index} e{d}" for d in range(1, dims)]
    ys = [f"const {index} y{d}" for d in range(dims)]
    ss = [f"const {index} s{d}" for d in range(dims)]
    split = [f"const {index} c{d} = rest % e{d}; rest /= e{d};" for d in reversed(range(1, dims))]
    split = [f"{index} rest = i;", *split, f"const {index} c0 = rest;"] if dims else []
    at = " + ".join(f"c{d} * y{d}" for d in range(dims)) or "0"
    src = " + ".join(f"c{d} * s{d}" for d in range(dims)) or "0"
    lines = []
    for op in OPERATIONS:
        reads = op != "fill"
        params = [f"{t}* Y"] + ([f"const {t}* P"] if reads else []) + [f"const {t} f", f"const {index} n"]
        params += extents + ys + (ss if reads else [])
        value = f"({t})__dmul_rn((double)f, (double)P[{src}])" if reads else "f"
        store = f"Y[{at}] += {value};" if op == "add" else f"Y[{at}] = {value};"
        lines += [f"extern \"C\" __global__ void chainexec_strided_{op}({', '.join(params)}) {{",
                  f"  for ({index} i = ({index})blockIdx.x * blockDim.x + threadIdx.x; i < n; "
                  f"i += ({index})gridDim.x * blockDim.x) {{"]
        lines += ["    " + line for line in split] + [f"    {store}", "  }", "}"]
    return "\n".join(lines)


def common() -> list[tuple[str, str]]:
    """The modules a warm-up compiles and loads, as (kernel name, source) pairs: float64 views of
    0 to :data:`COMMON_DIMS` dimensions, 32-bit indices."""
    return [(f"chainexec_strided_{op}", strided_source(d, "float64", "int"))
            for d in range(COMMON_DIMS + 1) for op in OPERATIONS]
