"""Kernels that move a tile between a packed pair index and its two members, computing each
element's pair position as they go (pure CUDA C source generation;
:func:`chainexec.runtime.pointwise.gather` launches them).

A packed tensor's pair index is ``k = pair(p, q) = p(p+1)/2 + q`` for ``p >= q``
(:mod:`chainexec.packing`). Unpacking reads the value of members ``(r, m)`` (either order) at
``pair(max(r, m), min(r, m))``; packing reads pair ``k``'s value at its members' place, row
``p = floor((sqrt(8k + 1) - 1) / 2)`` (corrected by one where the square root's rounding put it
off) and column ``q = k - p(p+1)/2``. :meth:`chainexec.runtime.device.Backend.gather` states the
operation; on the host NumPy's indexing does it at tables of positions, a block of the tile at a
time. On a GPU a table of the whole tile is as large as the tile itself in int64 (the whole s8 → s4
unpack of 352 functions: 3.9e9 positions, 31 GB); these kernels compute the position of each
element instead, so that the device reads the packed tile and writes the unpacked one once, and
nothing else.

Threads walk ``out`` in C order of its dimensions (an output tile is C-contiguous, so its writes
are coalesced); an element's coordinates come from divisions by the extents, which are
arguments, as are all strides; index arithmetic is 64-bit (pair positions of large tiles pass
2^31). The product ``f·x`` is rounded as in :mod:`chainexec.kernels.strided`: ``out += f * x``
as NumPy has it.
"""

from __future__ import annotations

from functools import lru_cache

from chainexec.kernels.elementwise import C_TYPES

KINDS = {"unpack": 2, "pack": 1}
"""Each kind of gather and how many of the output's dimensions hold the pair's coordinates:
unpack's two members, pack's one pair."""
OPERATIONS = ("set", "add")
"""The kernels of one module: ``chainexec_<kind>_<operation>`` (``out = f·x`` and ``out += f·x``)."""


@lru_cache(maxsize=None)
def gather_source(kind: str, dims: int, dtype: str, special: tuple[int, ...]) -> str:
    """CUDA C of ``chainexec_<kind>_set`` and ``chainexec_<kind>_add`` for an output of ``dims``
    dimensions of ``dtype`` (a name of :data:`C_TYPES`), whose dimensions ``special`` hold the
    pair's coordinates (:data:`KINDS`: the members ``r, m`` in that order, or the pair). The
    arguments, all 64-bit integers but the arrays and the factor:

    - ``Y, P, f, n``: the output, the input (at the first element of its view), the factor and
      the output's element count;
    - ``e1, …``: the output's extents but the first; ``y0, …``: its strides (elements);
    - ``s<d>`` for each other dimension ``d``: the input's stride along it;
    - unpack: ``k0, r0, m0, sp``: the input's first pair, the members' first values (the output's
      coordinate 0 along ``r`` is member ``r0``) and the input's stride along its pair axis; the
      element at members ``(r, m)`` reads pair ``pair(max, min) - k0``;
    - pack: ``k0, r0, m0, sr, sm``: the output's first pair (coordinate 0 is pair ``k0``), the
      first member values of the input's two member axes and its strides along them."""
    if len(special) != KINDS[kind] or len(set(special)) != len(special) or not all(0 <= d < dims for d in special):
        raise ValueError(f"a {kind} over {dims} dimensions takes {KINDS[kind]} distinct pair dimensions, not {special}")
    t = C_TYPES[dtype]
    ordinary = [d for d in range(dims) if d not in special]
    params = ([f"{t}* Y", f"const {t}* P", f"const {t} f", "const long long n"]
              + [f"const long long e{d}" for d in range(1, dims)] + [f"const long long y{d}" for d in range(dims)]
              + [f"const long long s{d}" for d in ordinary])
    split = ["long long rest = i;", *[f"const long long c{d} = rest % e{d}; rest /= e{d};" for d in reversed(range(1, dims))],
             "const long long c0 = rest;"]
    at = " + ".join(f"c{d} * y{d}" for d in range(dims))
    base = " + ".join([f"c{d} * s{d}" for d in ordinary] or ["0"])
    if kind == "unpack":
        r, m = special
        params += ["const long long k0", "const long long r0", "const long long m0", "const long long sp"]
        find = [f"const long long r = c{r} + r0, m = c{m} + m0;",
                "const long long hi = r > m ? r : m, lo = r > m ? m : r;",
                f"const long long from = {base} + (hi * (hi + 1) / 2 + lo - k0) * sp;"]
    else:
        (k,) = special
        params += ["const long long k0", "const long long r0", "const long long m0", "const long long sr",
                   "const long long sm"]
        find = [f"const long long k = c{k} + k0;",
                "long long p = (long long)((sqrt(8.0 * (double)k + 1.0) - 1.0) / 2.0);",
                "if (p * (p + 1) / 2 > k) p -= 1;",
                "if ((p + 1) * (p + 2) / 2 <= k) p += 1;",
                f"const long long from = {base} + (p - r0) * sr + (k - p * (p + 1) / 2 - m0) * sm;"]
    value = f"({t})__dmul_rn((double)f, (double)P[from])"
    lines = []
    for op in OPERATIONS:
        store = f"Y[{at}] += {value};" if op == "add" else f"Y[{at}] = {value};"
        lines += [f"extern \"C\" __global__ void chainexec_{kind}_{op}({', '.join(params)}) {{",
                  "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; "
                  "i += (long long)gridDim.x * blockDim.x) {"]
        lines += ["    " + line for line in split + find] + [f"    {store}", "  }", "}"]
    return "\n".join(lines)
