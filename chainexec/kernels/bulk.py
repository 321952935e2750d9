"""GETT kernels whose B chunks arrive by bulk copies of the tensor memory accelerator (sm_90).

The AO→MO transforms (``C[a,bcd] = Σ_e A[e,a] B[e,bcd]``: M = K = 72 against 373 248 columns)
are GEMMs with a small A and a long B whose rows are contiguous along n. A tiled GETT kernel
(:mod:`chainexec.kernels.gett`) reloads A's tile with every k-tile, synchronizes its block every
8 summed elements and copies B one 8-byte element per thread and instruction; at these shapes it
is bound by the latency of those small steps, not by DRAM or the tensor cores. Here a block
holds its ``bm = 16·mma_m`` rows of A in shared memory for the whole sum (``bk`` at least K,
loaded once) and walks ``span`` columns in chunks of ``8·mma_n·warps_n``: each row of a chunk of
B is one bulk copy (``cp.async.bulk``), or ``copies`` of them where the chunk is made of that many
contiguous runs (B's index of 72 along n in ``C[ab,c,d] = Σ_e A[e,c] B[ab,e,d]``), issued by the
lanes of a copying warp and completing on the stage's mbarrier; ``stages`` chunks in flight, each stage refilled once every computing warp
has arrived on its second mbarrier, so that the computing warps run free of one another (one
warp's stores beside another's MMAs) with no block barrier in the loop. A's tile is gathered by
cp.async while the first chunks are copied (:func:`chainexec.kernels.shortsum.a_tile`). Warps
lie side by side along n, each summing its ``mma_m × mma_n`` m16n8 tiles over the whole K from
shared memory and storing them from the fragments as GETT's short-sum kernel does
(:func:`chainexec.kernels.shortsum.tile_stores`), their column offsets read while they are
summed.

The bulk copies need each run of a chunk's row contiguous and 16-byte aligned: the problem's
:attr:`~chainexec.kernels.gett.Problem.bulk_run` (B's elements contiguous along n in table order,
every other stride of B even) a multiple of the chunk, or the chunk whole runs of it
(:func:`chainexec.kernels.gett.bulk_copies`, checked by
:meth:`chainexec.runtime.launch.GettTables.launches`), and B's base 16-byte aligned (checked by
:func:`chainexec.runtime.launch.launch_gett`). The configuration is a
:class:`~chainexec.kernels.gett.GettConfig` with ``bulk`` set (its limits:
:meth:`~chainexec.kernels.gett.GettConfig.bulk_valid`); the offset tables, the grid and the
kernel's signature are GETT's."""

from __future__ import annotations

from chainexec.kernels.gett import GettConfig, block_tile, signature
from chainexec.kernels.shortsum import a_tile, row_offsets, tile_stores

MMA = ('asm volatile("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5}, {%6}, '
       '{%0, %1, %2, %3};\\n" : "+d"(acc[i][j][0]), "+d"(acc[i][j][1]), "+d"(acc[i][j][2]), "+d"(acc[i][j][3]) : '
       '"d"(fa[i][0]), "d"(fa[i][1]), "d"(fb[j]));')


def source(cfg: GettConfig) -> str:
    """CUDA C source of the bulk-copy kernel ``cfg`` (:meth:`GettConfig.bulk_valid`), with GETT's
    signature and grid (:func:`chainexec.kernels.gett.source`): ``C = alpha·A·B + beta·C`` over
    the block's ``bm × span`` tile, C not read where ``beta == 0``. Every element of C is
    written by exactly one thread."""
    if not cfg.bulk or not cfg.bulk_valid():
        raise ValueError(f"invalid bulk-copy configuration {cfg}")
    a_elems, b_stage = cfg.bulk_elems()
    pa, pb = cfg.bulk_pitches()
    chunk, stages, steps, copies = cfg.chunk(), cfg.stages, cfg.bk // 4, cfg.copies
    head = "\n".join(signature(cfg))
    tile = "\n".join(block_tile(cfg))
    return f"""// chainexec bulk-copy GETT kernel: block {cfg.bm} rows x {cfg.span} columns; A's rows in shared memory for
// the whole sum (K <= {cfg.bk}); B in chunks of {chunk} columns, {copies} bulk copies a row, {stages} stages; {cfg.warps_n} warps
// along n, each {cfg.mma_m}x{cfg.mma_n} m16n8 tiles
{head}
{{
  constexpr int B_STAGE = {b_stage}, PA = {pa}, PB = {pb}, CHUNK = {chunk}, COPIES = {copies}, RUN = CHUNK / COPIES;
  extern __shared__ __align__(16) double smem[];
  double* sA = smem;
  double* sB = smem + {a_elems};
  // two mbarriers a stage: its chunk has landed (full), every computing warp has read it (empty)
  __shared__ __align__(8) unsigned long long full[{stages}], empty[{stages}];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
{tile}
  const idx left = (N - bn + CHUNK - 1) / CHUNK;
  const int chunks = left < {cfg.span // chunk} ? (int)left : {cfg.span // chunk};
  // B's offsets in shared memory, so that issuing a chunk's copies waits for no table read: each
  // row's (k) and the first column's of each run of the block's chunks (batch included)
  __shared__ idx koff[{cfg.bk}], coff[{cfg.span // chunk * copies}];
  for (int k = tid; k < {cfg.bk}; k += {cfg.threads}) koff[k] = k < K ? offbk[k] : 0;
  for (int r = tid; r < chunks * COPIES; r += {cfg.threads}) coff[r] = bl + offbn[bn + (idx)r * RUN];
  if (tid == 0) {{
    #pragma unroll
    for (int s = 0; s < {stages}; ++s) {{
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\\n" :: "r"((unsigned)__cvta_generic_to_shared(&full[s])));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], {cfg.warps_n};\\n"
                   :: "r"((unsigned)__cvta_generic_to_shared(&empty[s])));
    }}
    asm volatile("fence.mbarrier_init.release.cluster;\\n" ::: "memory");
  }}
  __syncthreads();  // the barriers are initialized, the offsets in place
  auto wait = [](unsigned bar, unsigned parity) {{  // until the barrier at shared address bar completes a phase
    unsigned done = 0;
    while (!done)
      asm volatile("{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }}\\n"
                   : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }};
  // chunk c into stage c % stages: lane 0 of the copying warp arms the stage's full barrier with
  // the chunk's bytes, its lanes copy one run of one row of K each
  auto issue = [&](int c) {{
    if (c < chunks) {{
      const int s = c % {stages};
      const unsigned bar = (unsigned)__cvta_generic_to_shared(&full[s]);
      if (lane == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\\n"
                     :: "r"(bar), "r"((unsigned)K * (unsigned)(CHUNK * 8)) : "memory");
      for (int e = lane; e < (int)K * COPIES; e += 32) {{
        const int k = e / COPIES, r = e % COPIES;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\\n"
                     :: "r"((unsigned)__cvta_generic_to_shared(&sB[s * B_STAGE + k * PB + r * RUN])),
                        "l"(B + coff[c * COPIES + r] + koff[k]), "r"(RUN * 8), "r"(bar) : "memory");
      }}
    }}
  }};
  const bool copier = warp == {cfg.warps_n};  // the last warp copies B; the others compute
  if (copier) {{
    #pragma unroll
    for (int c = 0; c < {stages}; ++c) issue(c);
  }}
  // while the first chunks are copied: B's rows past K in every stage zeroed (never copied), and
  // A's tile gathered
  for (int e = tid; e < {stages} * ({cfg.bk} - (int)K) * PB; e += {cfg.threads}) {{
    const int s = e / (({cfg.bk} - (int)K) * PB), r = e % (({cfg.bk} - (int)K) * PB);
    sB[s * B_STAGE + (int)K * PB + r] = 0.0;
  }}
{a_tile(cfg, pa)}
  if (copier) {{
    // each stage refilled once every computing warp has read its last chunk
    for (int c = {stages}; c < chunks; ++c) {{
      wait((unsigned)__cvta_generic_to_shared(&empty[c % {stages}]), (c / {stages} - 1) & 1);
      issue(c);
    }}
    return;
  }}
{row_offsets(cfg.mma_m)}
  const int wn = warp * {8 * cfg.mma_n};
  for (int c = 0; c < chunks; ++c) {{
    const int s = c % {stages};
    wait((unsigned)__cvta_generic_to_shared(&full[s]), (c / {stages}) & 1);
    const double* sb = sB + s * B_STAGE;
    // the chunk's C column offsets, read while the chunk is summed
    idx co0[{cfg.mma_n}], co1[{cfg.mma_n}];
    bool cv0[{cfg.mma_n}], cv1[{cfg.mma_n}];
    #pragma unroll
    for (int j = 0; j < {cfg.mma_n}; ++j) {{
      const idx n0 = bn + (idx)c * CHUNK + wn + j * 8 + 2 * (lane & 3);
      cv0[j] = n0 < N;
      cv1[j] = n0 + 1 < N;
      co0[j] = cv0[j] ? offcn[n0] : 0;
      co1[j] = cv1[j] ? offcn[n0 + 1] : 0;
    }}
    double acc[{cfg.mma_m}][{cfg.mma_n}][4];
    #pragma unroll
    for (int i = 0; i < {cfg.mma_m}; ++i)
      #pragma unroll
      for (int j = 0; j < {cfg.mma_n}; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0;
    #pragma unroll
    for (int ks = 0; ks < {steps}; ++ks) {{
      double fa[{cfg.mma_m}][2], fb[{cfg.mma_n}];
      #pragma unroll
      for (int i = 0; i < {cfg.mma_m}; ++i) {{
        fa[i][0] = sA[(i * 16 + (lane >> 2)) * PA + ks * 4 + (lane & 3)];
        fa[i][1] = sA[(i * 16 + 8 + (lane >> 2)) * PA + ks * 4 + (lane & 3)];
      }}
      #pragma unroll
      for (int j = 0; j < {cfg.mma_n}; ++j) fb[j] = sb[(ks * 4 + (lane & 3)) * PB + wn + j * 8 + (lane >> 2)];
      #pragma unroll
      for (int i = 0; i < {cfg.mma_m}; ++i)
        #pragma unroll
        for (int j = 0; j < {cfg.mma_n}; ++j)
          {MMA}
    }}
    #pragma unroll
    for (int j = 0; j < {cfg.mma_n}; ++j) {{
      // lanes 4q..4q+3 hold 8 consecutive columns of rows lane/4 and lane/4 + 8 of each m16 tile
      const idx o0 = co0[j], o1 = co1[j];
      const bool v0 = cv0[j], v1 = cv1[j], pair = v1 && o1 == o0 + 1;
{tile_stores("acc[i][j]", cfg.mma_m)}
    }}
    // this warp has read stage s (arriving after its stores keeps the accumulators' registers
    // free of the arrival's ordering)
    __syncwarp();
    if (lane == 0)
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\\n"
                   :: "r"((unsigned)__cvta_generic_to_shared(&empty[s])) : "memory");
  }}
}}
"""
