"""GETT kernels for short sums: each warp holds its rows of A for the whole sum in registers.

A contraction whose summed range is short (the TCCG CCSD(T) outputs: K = 24 against a 302 MB
output) is bound by writing C, not by flops. The tiled GETT kernel (:mod:`chainexec.kernels.gett`)
reads every operand element of a block tile from shared memory once per warp tile that uses it
and passes each output element through shared memory in its staged epilogue; at K = 24 that is
some 48 bytes through each SM's L1/shared-memory pipe per 8-byte element of C, and the pipe, not
DRAM, sets the pace. Here a block of ``warps_m`` warps loads its ``bm × K`` rows of A once, each
warp keeps its ``16·mma_m`` rows as MMA fragments for the whole sum, and the block walks ``span``
columns of C in chunks of ``8·mma_n``, each chunk of B streamed into shared memory by cp.async
(``stages`` chunks in flight) and read from there once per warp; each ``16·mma_m × 8`` piece of C
is stored from the fragments as soon as it is summed, two consecutive columns a lane in one
16-byte store where C holds them side by side. What passes through the pipe per element of C is
then B's fragments (``8·K / (16·mma_m)`` bytes), B's chunk (``8·K / bm``) and the store itself.

The configuration is a :class:`~chainexec.kernels.gett.GettConfig` whose ``span`` is positive
(its limits: :data:`~chainexec.kernels.gett.SHORT_SUM`, :meth:`~chainexec.kernels.gett.GettConfig.short_valid`);
the problem, its offset tables, the launch and the kernel's signature are GETT's, so a block
computes the ``bm × span`` tile GETT's grid gives it."""

from __future__ import annotations

from chainexec.kernels.gett import GettConfig, block_tile, cp_async, signature


def _chunk_loader(cfg: GettConfig) -> str:
    """The lambda that starts the cp.async copies of chunk ``c`` of B into its stage (zero-filled
    past K or N) and commits them as one group; an empty group past the last chunk, so that
    ``wait_group stages-2`` always means "chunk c has landed". Threads walk the direction B is
    loaded along; loaded along n by a block of whole chunk rows, a thread's column is the same
    in every row it loads, so its offset is read once a chunk (a read per element would be held
    in registers, one per element)."""
    chunk = 8 * cfg.mma_n
    pitch = cfg.short_elems()[1] // (cfg.bk if cfg.b_n_fast else chunk)
    elems = cfg.bk * chunk
    head = f"""  auto issue = [&](int c) {{
    if (c < chunks) {{
      const int s = c % {cfg.stages};"""
    tail = """
    }
    asm volatile("cp.async.commit_group;\\n" ::);
  };"""
    copy = ('asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\\n" :: '
            '"r"((unsigned)__cvta_generic_to_shared(&sB[s * B_STAGE + {dst}])), "l"(src), "r"(ok ? 8 : 0));')
    if cfg.b_n_fast and cfg.threads % chunk == 0:
        rows = cfg.threads // chunk
        # the block's rows of threads take the chunk's bk rows in turns; where bk is not a
        # multiple of them, the last turn's rows past bk load nothing
        past = "" if cfg.bk % rows == 0 else f"if (k >= {cfg.bk}) break;\n        "
        return head + f"""
      const int n = tid % {chunk};
      const idx nn = bn + (idx)c * {chunk} + n;
      const bool inside = nn < N;
      const idx on = inside ? offbn[nn] : 0;
      #pragma unroll
      for (int r = 0; r < {-(-cfg.bk // rows)}; ++r) {{
        const int k = tid / {chunk} + r * {rows};
        {past}const bool ok = inside && k < K;
        const double* src = B + (ok ? bl + koff[k] + on : 0);
        {copy.format(dst=f"k * {pitch} + n")}
      }}""" + tail
    if cfg.b_n_fast:
        coords, dst = f"const int n = e % {chunk}, k = e / {chunk};", f"k * {pitch} + n"
    else:
        coords, dst = f"const int k = e % {cfg.bk}, n = e / {cfg.bk};", f"n * {pitch} + k"
    inside = "true" if elems % cfg.threads == 0 else f"e < {elems}"
    return head + f"""
      #pragma unroll
      for (int r = 0; r < {-(-elems // cfg.threads)}; ++r) {{
        const int e = tid + r * {cfg.threads};
        if ({inside}) {{
          {coords}
          const idx nn = bn + (idx)c * {chunk} + n;
          const bool ok = k < K && nn < N;
          const double* src = B + (ok ? bl + koff[k] + offbn[nn] : 0);
          {copy.format(dst=dst)}
        }}
      }}""" + tail


def _store(accumulate: bool, acc: str) -> str:
    """Store a lane's two columns of one row of C: one 16-byte store where C holds them side by
    side and the address is aligned, else one store per column; with ``accumulate``, ``beta``
    times the old values added (each element has one writer, the lane that reads it)."""
    old = ("          if (v0) x0 = fma(beta, p[0], x0);\n"
           "          if (v1) x1 = fma(beta, C[ocm[i][h] + o1], x1);\n") if accumulate else ""
    return (f"""          double* p = C + (ocm[i][h] + o0);
          double x0 = alpha * {acc}[2 * h], x1 = alpha * {acc}[2 * h + 1];
{old}          if (pair && (((unsigned long long)p) & 15) == 0) {{
            *(double2*)p = make_double2(x0, x1);
          }} else {{
            if (v0) *p = x0;
            if (v1) C[ocm[i][h] + o1] = x1;
          }}""")


def column_offsets(n0: str) -> str:
    """Source lines that read the C column offsets of a lane's two columns of one n8 column tile
    (``o0``, ``o1``; valid where ``v0``, ``v1``; side by side in C where ``pair``): lanes
    4q..4q+3 hold 8 consecutive columns, the first a lane's at the C expression ``n0``."""
    return f"""      // lanes 4q..4q+3 hold 8 consecutive columns of rows lane/4 and lane/4 + 8 of each m16 tile
      const idx n0 = {n0};
      const bool v0 = n0 < N, v1 = n0 + 1 < N;
      const idx o0 = v0 ? offcn[n0] : 0, o1 = v1 ? offcn[n0 + 1] : 0;
      const bool pair = v1 && o1 == o0 + 1;"""


def tile_stores(acc: str, mma_m: int) -> str:
    """Source lines that store a lane's two columns (:func:`column_offsets`) of a warp's ``mma_m``
    m16 tiles from the MMA fragments (``acc`` indexed by ``i``, the m16 tile, gives a tile's
    four accumulators), rows lane/4 and lane/4 + 8 of each tile, whose row offsets and validity
    are ``ocm[i][h]`` and ``vcm[i][h]``. C = alpha·acc, plus beta·C where ``beta != 0``."""
    return f"""      #pragma unroll
      for (int i = 0; i < {mma_m}; ++i)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {{
          if (!vcm[i][h] || !v0) continue;
          if (beta == 0.0) {{
{_store(False, acc)}
          }} else {{
{_store(True, acc)}
          }}
        }}"""


def a_tile(cfg: GettConfig, pitch: int) -> str:
    """Source lines that gather a block's ``bm × bk`` tile of A into shared memory (``sA``, k
    fastest at a row pitch of ``pitch`` elements, zero past M and K) by cp.async, every
    element's copy in flight at once, and wait for all of the thread's copies before a block
    barrier: a synchronous gather would wait a memory round trip per element a thread loads."""
    coords = (f"const int k = e % {cfg.bk}, m = e / {cfg.bk};" if cfg.a_k_fast
              else f"const int m = e % {cfg.bm}, k = e / {cfg.bm};")
    copy = cp_async(f"&sA[m * {pitch} + k]", "A + (ok ? al + offam[mm] + offak[k] : 0)", "ok")
    return f"""  // A's tile, once: zero past M and K
  for (int e = tid; e < {cfg.bm * cfg.bk}; e += {cfg.threads}) {{
    {coords}
    const idx mm = bm + m;
    const bool ok = k < K && mm < M;
    {copy}
  }}
  asm volatile("cp.async.commit_group;\\n" ::);
  asm volatile("cp.async.wait_group 0;\\n" ::);
  __syncthreads();"""


def row_offsets(mma_m: int, wm: str = "") -> str:
    """Source lines that read the C row offsets and validity (``ocm``, ``vcm``) of a lane's rows
    of ``mma_m`` m16 tiles starting at row ``bm`` (plus the C expression ``wm``)."""
    first = f"bm + {wm} + " if wm else "bm + "
    return f"""  idx ocm[{mma_m}][2];
  bool vcm[{mma_m}][2];
  #pragma unroll
  for (int i = 0; i < {mma_m}; ++i)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {{
      const idx m = {first}i * 16 + h * 8 + (lane >> 2);
      vcm[i][h] = m < M;
      ocm[i][h] = cl + (vcm[i][h] ? offcm[m] : 0);
    }}"""


def source(cfg: GettConfig) -> str:
    """CUDA C source of the short-sum kernel ``cfg`` (:meth:`GettConfig.short_valid`), with GETT's signature and
    grid (:func:`chainexec.kernels.gett.source`): ``C = alpha·A·B + beta·C`` over the block's
    ``bm × span`` tile, C not read where ``beta == 0``. Every element of C is written by exactly
    one thread."""
    if not cfg.short_valid():
        raise ValueError(f"invalid short-sum configuration {cfg}")
    a_elems, b_stage = cfg.short_elems()
    pa, steps, chunk = cfg.short_pitch(), cfg.bk // 4, 8 * cfg.mma_n
    pb = b_stage // (cfg.bk if cfg.b_n_fast else chunk)
    fb = (f"sB[cur + (ks * 4 + (lane & 3)) * {pb} + j * 8 + (lane >> 2)]" if cfg.b_n_fast
          else f"sB[cur + (j * 8 + (lane >> 2)) * {pb} + ks * 4 + (lane & 3)]")
    mma = ('asm volatile("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5}, {%6}, '
           '{%0, %1, %2, %3};\\n" : "+d"(acc[i][0]), "+d"(acc[i][1]), "+d"(acc[i][2]), "+d"(acc[i][3]) : '
           '"d"(fa[i][ks][0]), "d"(fa[i][ks][1]), "d"(b));')
    head = "\n".join(signature(cfg))
    tile = "\n".join(block_tile(cfg))
    return f"""// chainexec short-sum GETT kernel: block {cfg.bm} rows x {cfg.span} columns, {cfg.warps_m} warps of {cfg.mma_m} m16
// tiles holding A's fragments for the whole sum (K <= {cfg.bk}); B in chunks of {chunk} columns, {cfg.stages} stages
{head}
{{
  constexpr int B_STAGE = {b_stage};
  extern __shared__ double smem[];
  double* sA = smem;
  double* sB = smem + {a_elems};
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
{tile}
  const idx left = (N - bn + {chunk - 1}) / {chunk};
  const int chunks = left < {cfg.span // chunk} ? (int)left : {cfg.span // chunk};
  // B's k offsets in shared memory: read for every element of every chunk, they would otherwise
  // be held in registers, one per element a thread loads
  __shared__ idx koff[{cfg.bk}];
  for (int k = tid; k < {cfg.bk}; k += {cfg.threads}) koff[k] = k < K ? offbk[k] : 0;
  __syncthreads();
{_chunk_loader(cfg)}
  #pragma unroll
  for (int c = 0; c < {cfg.stages - 1}; ++c) issue(c);
{a_tile(cfg, pa)}
  const int wm = warp * {16 * cfg.mma_m};
  double fa[{cfg.mma_m}][{steps}][2];
  #pragma unroll
  for (int i = 0; i < {cfg.mma_m}; ++i)
    #pragma unroll
    for (int ks = 0; ks < {steps}; ++ks) {{
      fa[i][ks][0] = sA[(wm + i * 16 + (lane >> 2)) * {pa} + ks * 4 + (lane & 3)];
      fa[i][ks][1] = sA[(wm + i * 16 + 8 + (lane >> 2)) * {pa} + ks * 4 + (lane & 3)];
    }}
{row_offsets(cfg.mma_m, "wm")}
  for (int c = 0; c < chunks; ++c) {{
    asm volatile("cp.async.wait_group {cfg.stages - 2};\\n" ::);
    __syncthreads();  // chunk c has landed for every thread; chunk c-1's stage is free
    issue(c + {cfg.stages - 1});
    const int cur = (c % {cfg.stages}) * B_STAGE;
    #pragma unroll 2
    for (int j = 0; j < {cfg.mma_n}; ++j) {{
      double acc[{cfg.mma_m}][4];
      #pragma unroll
      for (int i = 0; i < {cfg.mma_m}; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0;
      #pragma unroll
      for (int ks = 0; ks < {steps}; ++ks) {{
        const double b = {fb};
        #pragma unroll
        for (int i = 0; i < {cfg.mma_m}; ++i)
          {mma}
      }}
{column_offsets(f"bn + (idx)c * {chunk} + j * 8 + 2 * (lane & 3)")}
{tile_stores("acc[i]", cfg.mma_m)}
    }}
  }}
  asm volatile("cp.async.wait_group 0;\\n" ::);
}}
"""
