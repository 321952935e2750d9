"""CUDA C source for one binary tensor contraction from a COGENT configuration.

The kernel follows Algorithm 1 of the COGENT paper (Kim et al., "A Code Generator for
High-Performance Tensor Contractions on GPUs", CGO 2019, Section III): each thread block owns
one output tile held in registers (``REGx x REGy`` per thread, Section III-A/B) and loops over
the internal indices in steps of
``TBk``; each step (1) loads the two input slices from global into shared memory, (2) reads a
column of the x-tile and a row of the y-tile into registers, (3) accumulates their outer product,
and finally (4) stores the output tile, ``C = alpha * A*B + beta * C``.

Layout: row-major (C order) for all three tensors -- the last index of each string is stride-1.
Extents are kernel arguments, so one compiled kernel serves every problem size; tiles that run
past an extent are loaded as zeros and not stored (partial tiles).  Global offsets are 64-bit.

Loads are cooperative: the threads of a block walk the input tile in the input's own storage
order, so consecutive threads read consecutive addresses along the input's FVI (the coalescing
of Section III-C, independent of the TB/REG mapping).  Each element lands in shared memory at
``s[k][reg * TB + tb]``, the position the compute loop reads without bank conflicts.
"""

from __future__ import annotations

import hashlib
import json
import math

from .kernelconf import ELEM_BYTES, Contraction, KernelConfig, parse_contraction, smem_pitches

_CTYPE = {"float64": "double", "float32": "float"}
_FMA = {"float64": "fma", "float32": "fmaf"}
LOAD_UNROLL = 4
"""Unroll factor of the cooperative load loop: full unrolling of up to 32 loads per thread
(64-thread blocks) made ptxas spill; 4 keeps loads in flight without spills."""


def kernel_params(c, a, b) -> tuple[str, ...]:
    """Index names in the order their extents are passed to the kernel (after C, A, B):
    the output's indices, then the internal ones in the order of ``a``."""
    con = parse_contraction(c, a, b, {i: 1 for i in set(c) | set(a) | set(b)})
    return con.c + tuple(i for i in con.a if i not in con.c)


def grid_size(config: KernelConfig, extents: dict) -> int:
    """Number of thread blocks for actual ``extents``: ``prod ceil(N_i / T_i)`` over the output
    indices (Section III-A)."""
    return math.prod(-(-extents[i] // config.tile(i)) for i in config.c)


def _strides(names: tuple[str, ...], tensor: str) -> list[str]:
    """Declarations of the row-major strides ``s<T>_<i>`` (64-bit) of a tensor."""
    lines, prev = [], None
    for name in reversed(names):
        expr = "1LL" if prev is None else f"s{tensor}_{prev} * (long long)n_{prev}"
        lines.append(f"  const long long s{tensor}_{name} = {expr};")
        prev = name
    return lines


def _digits(mapping):
    """Mixed-radix positions ``(index, factor, stride)`` of a mapping (first entry fastest)."""
    out, stride = [], 1
    for name, f in mapping:
        out.append((name, f, stride))
        stride *= f
    return out


def _load_block(con: Contraction, cfg: KernelConfig, side: str, ctype: str) -> list[str]:
    """Code that loads one step's tile of the x- or y-input into shared memory (step (1))."""
    tensor = con.xs if side == "X" else con.ys
    ptr = cfg.x_operand if side == "X" else ("B" if cfg.x_operand == "A" else "A")
    tb, reg = (cfg.tbx, cfg.regx) if side == "X" else (cfg.tby, cfg.regy)
    size_tb = cfg.size_tbx if side == "X" else cfg.size_tby
    ext_tile = (cfg.size_tbx * cfg.size_regx) if side == "X" else (cfg.size_tby * cfg.size_regy)
    pitch = smem_pitches(con, cfg.size_tbx * cfg.size_regx, cfg.size_tby * cfg.size_regy)
    pitch = pitch[0] if side == "X" else pitch[1]
    total = ext_tile * cfg.size_tbk
    iters = -(-total // cfg.threads)
    tbd, regd = dict(tb), dict(reg)
    tbpos = {n: s for n, _, s in _digits(tb)}
    regpos = {n: s for n, _, s in _digits(reg)}
    kpos = {n: s for n, _, s in _digits(cfg.tbk)}
    lines = [f"    // (1) {side}-input {''.join(tensor)} -> s{side}[k][reg*{size_tb} + tb], "
             f"{total} elements in storage order",
             f"    #pragma unroll {min(iters, LOAD_UNROLL)}",
             f"    for (int j = 0; j < {iters}; ++j) {{",
             f"      const int e = tid + j * {cfg.threads};"]
    body = []
    if total % cfg.threads:
        lines.append(f"      if (e < {total}) {{")
    ok, off, kl, xl_tb, xl_reg = [], [], [], [], []
    inner = 1
    for name in reversed(tensor):
        t = cfg.tile(name)
        is_int = name in con.internal
        base = f"k_{name}" if is_int else f"o_{name}"
        if t == 1:
            off.append(f"(long long){base} * s{ptr}_{name}")
            continue
        expr = f"e / {inner}" if inner > 1 else "e"
        if inner * t < total:
            expr = f"({expr}) % {t}"
        body.append(f"        const int l_{name} = {expr};")
        body.append(f"        const int g_{name} = {base} + l_{name};")
        ok.append(f"g_{name} < n_{name}")
        off.append(f"(long long)g_{name} * s{ptr}_{name}")
        if is_int:
            kl.append(f"l_{name} * {kpos[name]}")
        else:
            f_tb, f_reg = tbd.get(name, 1), regd.get(name, 1)
            if f_tb > 1 and f_reg > 1:
                xl_tb.append(f"(l_{name} % {f_tb}) * {tbpos[name]}")
                xl_reg.append(f"(l_{name} / {f_tb}) * {regpos[name]}")
            elif f_tb > 1:
                xl_tb.append(f"l_{name} * {tbpos[name]}")
            else:
                xl_reg.append(f"l_{name} * {regpos[name]}")
        inner *= t
    klin = " + ".join(kl) or "0"
    pos_tb = " + ".join(xl_tb) or "0"
    pos_reg = " + ".join(xl_reg) or "0"
    cond = " && ".join(ok) or "true"
    body += [f"        const bool ok = {cond};",
             f"        s{side}[({klin}) * {pitch} + ({pos_reg}) * {size_tb} + {pos_tb}] = "
             f"ok ? {ptr}[{' + '.join(off)}] : ({ctype})0;"]
    lines += body
    if total % cfg.threads:
        lines.append("      }")
    lines.append("    }")
    return lines


def _store_offsets(con: Contraction, cfg: KernelConfig, side: str) -> list[str]:
    """Per-thread output offsets and validity of the register rows (x) or columns (y), step (4)."""
    tb, reg = (cfg.tbx, cfg.regx) if side == "X" else (cfg.tby, cfg.regy)
    ext = con.x_ext if side == "X" else con.y_ext
    nreg = cfg.size_regx if side == "X" else cfg.size_regy
    t = "tx" if side == "X" else "ty"
    s = side.lower()
    tbd, regd = dict(tb), dict(reg)
    lines = [f"  long long off{s}[{nreg}];", f"  bool ok{s}[{nreg}];"]
    for name, f, stride in _digits(tb):
        expr = f"{t} / {stride}" if stride > 1 else t
        if stride * f < math.prod(ff for _, ff in tb):
            expr = f"({expr}) % {f}"
        lines.append(f"  const int p_{name} = {expr};")
    lines += ["  #pragma unroll", f"  for (int r = 0; r < {nreg}; ++r) {{"]
    ok, off = [], []
    for name in ext:
        f_tb, f_reg = tbd.get(name, 1), regd.get(name, 1)
        if f_tb * f_reg == 1:
            off.append(f"(long long)o_{name} * sC_{name}")
            continue
        terms = []
        if f_reg > 1:
            rstride = dict((n, st) for n, _, st in _digits(reg))[name]
            rexpr = f"r / {rstride}" if rstride > 1 else "r"
            if rstride * f_reg < nreg:
                rexpr = f"({rexpr}) % {f_reg}"
            terms.append(f"({rexpr}) * {f_tb}" if f_tb > 1 else f"({rexpr})")
        if f_tb > 1:
            terms.append(f"p_{name}")
        lines.append(f"    const int g_{name} = o_{name} + {' + '.join(terms)};")
        ok.append(f"g_{name} < n_{name}")
        off.append(f"(long long)g_{name} * sC_{name}")
    lines += [f"    ok{s}[r] = {' && '.join(ok) or 'true'};",
              f"    off{s}[r] = {' + '.join(off) or '0'};", "  }"]
    return lines


def kernel_name(config: KernelConfig) -> str:
    """A C identifier unique to the contraction, dtype and mapping of ``config``."""
    key = json.dumps([config.c, config.a, config.b, config.dtype, config.tbx, config.regx,
                      config.tby, config.regy, config.tbk])
    return "chainexec_tc_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def generate(c, a, b, sizes: dict, dtype: str, config: KernelConfig) -> tuple[str, str]:
    """CUDA C source of the kernel for ``C[c] = alpha * sum A[a]*B[b] + beta * C[c]``.

    Returns ``(kernel name, source)``.  The kernel's signature is
    ``(C, A, B, n_<i> for i in kernel_params(c, a, b), alpha, beta)`` with int extents and
    ``alpha``/``beta`` of the element type; launch ``grid_size(config, extents)`` blocks of
    ``config.threads`` threads.  With ``beta == 0`` C is not read (NaNs in it do not propagate).
    ``sizes`` are validated against the contraction; the kernel itself takes extents at run
    time.  Raises ValueError for invalid index names, batch indices, a dtype other than
    float64/float32, or a config made for another contraction or dtype.
    """
    if dtype not in _CTYPE:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_CTYPE)}")
    con = parse_contraction(c, a, b, sizes)
    if (con.c, con.a, con.b, dtype) != (tuple(config.c), tuple(config.a), tuple(config.b),
                                        config.dtype):
        raise ValueError("config was made for a different contraction or dtype")
    ctype, fma = _CTYPE[dtype], _FMA[dtype]
    name = kernel_name(config)
    params = kernel_params(c, a, b)
    xt = config.size_tbx * config.size_regx
    yt = config.size_tby * config.size_regy
    px, py = smem_pitches(con, xt, yt)
    tk = config.size_tbk
    smem = (px + py) * tk * ELEM_BYTES[dtype]
    rx, ry, tbx = config.size_regx, config.size_regy, config.size_tbx
    L = ["// chainexec generated kernel (COGENT, Algorithm 1), row-major tensors",
         f"// C[{''.join(con.c)}] = alpha * sum A[{''.join(con.a)}] * B[{''.join(con.b)}] "
         f"+ beta * C   ({dtype})",
         f"// x-input {config.x_operand}: TBx={list(config.tbx)} REGx={list(config.regx)}",
         f"// y-input: TBy={list(config.tby)} REGy={list(config.regy)} TBk={list(config.tbk)}",
         f"// threads={config.threads} shared={smem} bytes",
         # min 1 block per SM: ptxas may use up to 255 registers, so large register tiles do
         # not spill
         f'extern "C" __global__ void __launch_bounds__({config.threads}, 1)',
         f"{name}({ctype}* __restrict__ C, const {ctype}* __restrict__ A, "
         f"const {ctype}* __restrict__ B,",
         "    " + ", ".join(f"const int n_{i}" for i in params) + f", const {ctype} alpha, "
         f"const {ctype} beta)",
         "{"]
    L += _strides(con.c, "C") + _strides(con.a, "A") + _strides(con.b, "B")
    L += [f"  __shared__ {ctype} sX[{tk * px}];",
          f"  __shared__ {ctype} sY[{tk * py}];",
          "  const int tid = threadIdx.x;",
          f"  const int tx = tid % {tbx};",
          f"  const int ty = tid / {tbx};",
          "  int blk = blockIdx.x;"]
    for i in reversed(con.c):
        t = config.tile(i)
        L.append(f"  const int nb_{i} = (n_{i} + {t - 1}) / {t};")
        L.append(f"  const int o_{i} = (blk % nb_{i}) * {t};")
        L.append(f"  blk /= nb_{i};")
    steps = [i for i, _ in config.tbk]
    steps += [i for i in con.internal if i not in steps]
    for i in steps:
        t = config.tile(i)
        L.append(f"  const int ns_{i} = (n_{i} + {t - 1}) / {t};")
    L.append(f"  const int nsteps = {' * '.join(f'ns_{i}' for i in steps) or '1'};")
    L += [f"  {ctype} acc[{rx}][{ry}];",
          "  #pragma unroll",
          f"  for (int r = 0; r < {rx}; ++r)",
          "    #pragma unroll",
          f"    for (int q = 0; q < {ry}; ++q) acc[r][q] = ({ctype})0;",
          "  for (int step = 0; step < nsteps; ++step) {"]
    if steps:
        L.append("    int st = step;")
    for i in steps:
        L.append(f"    const int k_{i} = (st % ns_{i}) * {config.tile(i)};")
        L.append(f"    st /= ns_{i};")
    L += _load_block(con, config, "X", ctype)
    L += _load_block(con, config, "Y", ctype)
    L += ["    __syncthreads();",
          "    // (2) shared -> registers, (3) outer product",
          "    #pragma unroll",
          f"    for (int k = 0; k < {tk}; ++k) {{",
          f"      {ctype} ra[{rx}], rb[{ry}];",
          "      #pragma unroll",
          f"      for (int r = 0; r < {rx}; ++r) ra[r] = sX[k * {px} + r * {tbx} + tx];",
          "      #pragma unroll",
          f"      for (int q = 0; q < {ry}; ++q) rb[q] = sY[k * {py} + q * {config.size_tby} + ty];",
          "      #pragma unroll",
          f"      for (int r = 0; r < {rx}; ++r)",
          "        #pragma unroll",
          f"        for (int q = 0; q < {ry}; ++q) acc[r][q] = {fma}(ra[r], rb[q], acc[r][q]);",
          "    }",
          "    __syncthreads();",
          "  }",
          "  // (4) registers -> global"]
    L += _store_offsets(con, config, "X") + _store_offsets(con, config, "Y")
    L += ["  #pragma unroll",
          f"  for (int r = 0; r < {rx}; ++r)",
          "    #pragma unroll",
          f"    for (int q = 0; q < {ry}; ++q)",
          "      if (okx[r] && oky[q]) {",
          "        const long long o = offx[r] + offy[q];",
          f"        C[o] = beta == ({ctype})0 ? alpha * acc[r][q] "
          f": {fma}(alpha, acc[r][q], beta * C[o]);",
          "      }",
          "}", ""]
    return name, "\n".join(L)
