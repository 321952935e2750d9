"""The sum kernel on FP64 tensor cores: ``C += Σ_t f_t · A_t·B_t`` with every term's products on
``mma.sync … .f64`` and the terms summed in a shared-memory output tile.

Why: the register sum kernel (:mod:`chainexec.kernels.sumkernel`) moves the output once for all
terms but multiplies on the FP64 CUDA cores, whose peak is half the tensor cores', so on the (T)
W tile it is no faster than the terms one by one on tensor cores (which move the output once per
term). Here each block keeps its output tile in shared memory for the whole kernel (the
multi-level paper's producer tile kept in the fastest level, Section 3, one level lower than the
executor keeps it) and each term is a GEMM on the tensor cores, as in GETT
(:mod:`chainexec.kernels.gett`, the strided-batched GEMM paper's GETT formulation):

- A term splits the block's output tile (a box over the output indices) into rows, its
  A-side indices, and columns, its B-side ones, so ``M_t × N_t = Π tile`` whatever the split;
  the warps cover the ``M_t × N_t`` plane in MMA tiles, a layout chosen per term.
- The accumulator fragments of a term do not line up with those of another term (lane ``l``
  holds a different output element in each), so after its summed range every term adds its
  fragments into the shared tile (each element owned by one lane per term, barriers between
  terms), and the tile goes to global memory once at the end.
- Operand slices are staged as in the register kernel (copy tables, two-stage ``cp.async``;
  :func:`chainexec.kernels.sumkernel.pipeline`), one summed element per row of pitch ≡ 8 (mod
  16) doubles, so fragment reads (8 rows × 4 summed elements per instruction) take the minimum
  two shared-memory wavefronts.

Problems with a batch index (an output index in both operands of a term) or not in float64 are
not handled (:func:`applies`). Pure functions: no CUDA or CuPy here.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from dataclasses import asdict, dataclass

from .gett import FRAGMENTS, MMA_SHAPES, SM90_SHAPES, smem_limit
from .kernelconf import Device
from .sumkernel import (COPY_INSTRUCTIONS, ISSUE_PER_CLOCK, L2_BYTES_PER_CLOCK, SMEM_BYTES_PER_CLOCK,
                        STAGES, STEP_INSTRUCTIONS, SumProblem, Term, _index_type, _placement,
                        _sides, _split, copy_macros, pipeline)

MMA_FMA_PER_CLOCK = 128
"""Fused multiply-adds per clock per SM on the FP64 tensor cores (H100 SXM: 67 TFLOP/s over 132
SMs near 1.98 GHz is 128; an A100 SM does 64)."""
WARPS = (4, 8)
"""Warps per block the search tries."""
KC = (8, 16)
"""Summed elements staged per step the search tries (multiples of every MMA shape's k)."""
TILE_PRODUCT = (512, 8192)
"""Output elements per block tile the search tries (the tile lives in shared memory: 4–64 KiB)."""
MAX_ACC = 64
"""Accumulator doubles per lane at most (128 of a thread's 255 registers)."""
TOP = 3
"""Candidates the runtime times."""


@dataclass(frozen=True)
class MmaConfig:
    """``tile``: the block's output tile per output dimension (elements); ``warps`` per block;
    ``kc`` summed elements per step; ``mma`` the FP64 MMA shape (:data:`~chainexec.kernels.gett.MMA_SHAPES`)."""

    tile: tuple[int, ...]
    warps: int
    kc: int
    mma: str

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def name(self) -> str:
        return f"t{'x'.join(map(str, self.tile))}_w{self.warps}_k{self.kc}_{self.mma}"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "MmaConfig":
        return cls(tuple(d["tile"]), int(d["warps"]), int(d["kc"]), str(d["mma"]))


@dataclass(frozen=True)
class TermLayout:
    """How one term covers the block tile: ``m``/``n`` rows (A side) and columns (B side) in use,
    ``wm × wn`` warps each holding ``mt × nt`` MMA tiles, and the shared-memory pitch of one
    summed element's row of each operand slice (``pa``, ``pb`` doubles)."""

    m: int
    n: int
    wm: int
    wn: int
    mt: int
    nt: int
    pa: int
    pb: int


@dataclass(frozen=True)
class Facts:
    """What the model needs of a problem, computed once per search: each term's (A-side, B-side)
    output dimensions and summed length (elements), and the bytes of a copy-table offset."""

    sides: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    depths: tuple[int, ...]
    index_bytes: int
    batch: bool

    @classmethod
    def of(cls, p: SumProblem) -> "Facts":
        sides = tuple((tuple(a), tuple(b)) for a, b in (_sides(p, t) for t in p.terms))
        return cls(sides, tuple(p.depth(t) for t in p.terms), 4 if not p.cast else 8,
                   any(set(a) & set(b) for a, b in sides) or p.dtype != "float64")


def applies(p: SumProblem, arch: int) -> bool:
    """Whether the kernel handles ``p`` on compute capability ``arch``: float64, FP64 MMA
    (sm_80 and newer), no output index in both operands of a term."""
    return arch >= 80 and not Facts.of(p).batch


def _pitch(rows: int) -> int:
    """A row pitch of at least ``rows`` doubles (a multiple of 8) that is ≡ 8 (mod 16): the four
    summed elements a fragment read spans then fall in alternate halves of the 128-byte bank row."""
    return rows if rows % 16 == 8 else rows + 8


@functools.lru_cache(maxsize=1 << 16)
def _grid(m: int, n: int, warps: int, r: int) -> TermLayout:
    tm, tn = -(-m // r), -(-n // 8)
    _, _, wm = min((-(-tm // w) * -(-tn // (warps // w)), -(-tm // w) + -(-tn // (warps // w)), w)
                   for w in range(1, warps + 1) if warps % w == 0)
    wn = warps // wm
    mt, nt = -(-tm // wm), -(-tn // wn)
    return TermLayout(m, n, wm, wn, mt, nt, _pitch(wm * mt * r), _pitch(wn * nt * 8))


@functools.lru_cache(maxsize=1 << 16)
def _layouts(sides: tuple, cfg: MmaConfig) -> tuple[TermLayout, ...]:
    r = MMA_SHAPES[cfg.mma][0]
    return tuple(_grid(math.prod(cfg.tile[d] for d in a), math.prod(cfg.tile[d] for d in b), cfg.warps, r)
                 for a, b in sides)


def layouts(p: SumProblem, cfg: MmaConfig) -> tuple[TermLayout, ...]:
    """Every term's warp layout (:class:`TermLayout`): the fewest MMA tiles per warp, then the
    fewest fragment reads (``mt + nt``), then fewer warps along the rows."""
    return _layouts(Facts.of(p).sides, cfg)


def _areas(lays: tuple[TermLayout, ...], cfg: MmaConfig) -> dict[str, int]:
    """Elements of each shared-memory area: the output tile, one stage of each operand, and the
    copy tables of each operand (one entry per staged element)."""
    return {"C": math.prod(cfg.tile),
            "A": max(cfg.kc * x.pa for x in lays), "B": max(cfg.kc * x.pb for x in lays),
            "tA": max(cfg.kc * x.m for x in lays), "tB": max(cfg.kc * x.n for x in lays)}


def _smem(f: Facts, cfg: MmaConfig) -> int:
    s = _areas(_layouts(f.sides, cfg), cfg)
    return 8 * (s["C"] + STAGES * (s["A"] + s["B"])) + (f.index_bytes + 4) * (s["tA"] + s["tB"])


def smem_bytes(p: SumProblem, cfg: MmaConfig) -> int:
    """Dynamic shared memory of the kernel (bytes): output tile, :data:`STAGES` stages of both
    operands (8-byte elements), copy tables (an offset of 4 or 8 bytes and a 4-byte place)."""
    return _smem(Facts.of(p), cfg)


def _registers(f: Facts, cfg: MmaConfig) -> int:
    r = MMA_SHAPES[cfg.mma][0]
    fa, fb = len(FRAGMENTS[cfg.mma][0]), len(FRAGMENTS[cfg.mma][1])
    return max(2 * (x.mt * x.nt * 2 * r // 8 + x.mt * fa + x.nt * fb) for x in _layouts(f.sides, cfg)) + 40


def registers(p: SumProblem, cfg: MmaConfig) -> int:
    """Estimated 32-bit registers per thread: the largest term's accumulators and fragments,
    and 40 for addresses and loop state."""
    return _registers(Facts.of(p), cfg)


def blocks(p: SumProblem, cfg: MmaConfig) -> int:
    """Thread blocks of the grid: one per output tile."""
    return math.prod(-(-n // cfg.tile[d]) for d, n in enumerate(p.out.shape))


def launch_shape(p: SumProblem, cfg: MmaConfig) -> tuple[int, int, int]:
    """(blocks, threads per block, dynamic shared memory in bytes)."""
    return blocks(p, cfg), cfg.threads, smem_bytes(p, cfg)


def predict(p: SumProblem, cfg: MmaConfig, dev: Device) -> float:
    """Model seconds (at 1.7 GHz, as :func:`chainexec.kernels.sumkernel.predict`): the slowest of
    the tensor cores (padded MMA tiles), instruction issue (fragment reads, MMAs, copies,
    epilogues, per-step overhead), shared-memory wavefronts (fragment reads at two each; epilogue
    read-modify-writes counted at four, their bank pattern depends on the split) and L2 reads,
    with the last partial wave of blocks; ``inf`` where the config exceeds the device or
    :func:`applies` says no."""
    return _predict(Facts.of(p), blocks(p, cfg), cfg, dev)


def _predict(f: Facts, nblk: int, cfg: MmaConfig, dev: Device) -> float:
    arch = int(dev.compute_capability)
    if f.batch or arch < 80 or (arch < 90 and cfg.mma in SM90_SHAPES):
        return math.inf
    smem, regs = _smem(f, cfg), _registers(f, cfg)
    if smem > min(smem_limit(arch), dev.smem_optin or smem_limit(arch)) or regs > dev.regs_per_thread:
        return math.inf
    per_sm = min(dev.smem_per_sm // smem, dev.max_threads_per_sm // cfg.threads, dev.regs_per_sm // (regs * cfg.threads))
    if per_sm < 1:
        return math.inf
    r, ks = MMA_SHAPES[cfg.mma]
    fa, fb = len(FRAGMENTS[cfg.mma][0]), len(FRAGMENTS[cfg.mma][1])
    acc = 2 * r // 8
    mma = issue = wavefronts = load = 0.0
    for depth, x in zip(f.depths, _layouts(f.sides, cfg)):
        steps = -(-depth // cfg.kc)
        ksteps = steps * cfg.kc // ks
        tiles = x.mt * x.nt
        mma += cfg.warps * tiles * ksteps * r * 8 * ks
        issue += cfg.warps * (ksteps * (tiles + x.mt * fa + x.nt * fb + 4) + tiles * acc * 8)
        wavefronts += cfg.warps * (ksteps * 2 * (x.mt * fa + x.nt * fb) + 4 * tiles * acc)
        for elems in (x.m, x.n):
            copies = -(-elems * cfg.kc // cfg.threads)
            issue += cfg.warps * steps * (copies * COPY_INSTRUCTIONS + STEP_INSTRUCTIONS)
            wavefronts += steps * elems * cfg.kc * 8 / SMEM_BYTES_PER_CLOCK
            load += steps * elems * cfg.kc * 8
    load += 16 * math.prod(cfg.tile)  # the output tile read and written once
    per_block = max(mma / MMA_FMA_PER_CLOCK, issue / ISSUE_PER_CLOCK, wavefronts, load / L2_BYTES_PER_CLOCK)
    waves = -(-nblk // (per_sm * dev.sm_count))
    resident = min(per_sm, -(-nblk // dev.sm_count))
    latency = max(1.0, 8 / (resident * cfg.warps))
    return per_block * resident * waves * latency / 1.7e9


def _tile_options(n: int) -> list[int]:
    """Tile lengths tried along a dimension of extent ``n``: powers of two up to 32, and the
    whole extent where it is at most 32 (a short occupied range held whole)."""
    out = {v for v in (1, 2, 4, 8, 16, 32) if v < n}
    if n <= 32:
        out.add(n)
    return sorted(out)


def candidates(p: SumProblem, dev: Device, top: int = TOP) -> list[MmaConfig]:
    """The ``top`` configurations the model ranks fastest (:func:`predict`), best first, each
    with a different tile; empty where :func:`applies` says no. Search: block tiles from
    :func:`_tile_options` with ``Π tile`` in :data:`TILE_PRODUCT` (from half the output where that is
    smaller) whose every term fills at least half of its padded MMA tiles, × :data:`WARPS` ×
    :data:`KC` × the MMA shapes of the device, with at most :data:`MAX_ACC` accumulators."""
    arch = int(dev.compute_capability)
    f = Facts.of(p)
    if f.batch or arch < 80:
        return []
    shapes = [s for s in MMA_SHAPES if arch >= 90 or s not in SM90_SHAPES]
    lo, hi = min(TILE_PRODUCT[0], math.prod(p.out.shape) // 2), TILE_PRODUCT[1]
    best: dict[tuple, tuple] = {}
    for tile in itertools.product(*(_tile_options(n) for n in p.out.shape)):
        if not lo <= math.prod(tile) <= hi:
            continue
        nblk = math.prod(-(-n // t) for n, t in zip(p.out.shape, tile))
        mn = [(math.prod(tile[d] for d in a), math.prod(tile[d] for d in b)) for a, b in f.sides]
        for shape in shapes:
            r = MMA_SHAPES[shape][0]
            if min(m * n / (-(-m // r) * r * -(-n // 8) * 8) for m, n in mn) < 0.5:
                continue
            for warps, kc in itertools.product(WARPS, KC):
                cfg = MmaConfig(tile, warps, kc, shape)
                if max(x.mt * x.nt for x in _layouts(f.sides, cfg)) * 2 * r // 8 > MAX_ACC:
                    continue
                t = _predict(f, nblk, cfg, dev)
                if t < best.get(tile, (math.inf,))[0]:
                    best[tile] = (t, cfg.name(), cfg)
    # Equal predictions are mostly the mirror images of a symmetric problem's tile (the (T)
    # terms permute i, j, k): timing more than one of them teaches nothing.
    ranked = sorted(best.values(), key=lambda x: x[:2])
    distinct = [x for k, x in enumerate(ranked) if k == 0 or x[0] != ranked[k - 1][0]]
    return [cfg for *_, cfg in distinct[:top]]


def kernel_name(p: SumProblem, cfg: MmaConfig) -> str:
    """A C identifier unique to the problem and config."""
    return "chainexec_summma_" + hashlib.sha256(repr((p, cfg)).encode()).hexdigest()[:16]


def _mma_macro(shape: str) -> list[str]:
    """``CX_MMA(d, a, b)``: ``d += a·b`` on one MMA tile from the lane's fragments (arrays); on a
    CPU the tests' emulation supplies ``cx_emu_mma<rows, k>`` (the PTX ISA's fragment layouts)."""
    r, ks = MMA_SHAPES[shape]
    na, nb, nc = len(FRAGMENTS[shape][0]), len(FRAGMENTS[shape][1]), 2 * r // 8

    def regs(first, count):
        return ", ".join(f"%{first + q}" for q in range(count))

    operands = (", ".join(f'"+d"((d)[{q}])' for q in range(nc)) + " : "
                + ", ".join([f'"d"((a)[{q}])' for q in range(na)] + [f'"d"((b)[{q}])' for q in range(nb)]))
    return ["#if defined(__CUDA_ARCH__)",
            f'#define CX_MMA(d, a, b) asm volatile("mma.sync.aligned.{shape}.row.col.f64.f64.f64.f64 '
            f'{{{regs(0, nc)}}}, {{{regs(nc, na)}}}, {{{regs(nc + na, nb)}}}, {{{regs(0, nc)}}};\\n" : {operands})',
            "#else",
            f"#define CX_MMA(d, a, b) cx_emu_mma<{r}, {ks}>(d, a, b)",
            "#endif"]


def generate(p: SumProblem, cfg: MmaConfig) -> tuple[str, str]:
    """CUDA C source of ``C += Σ_t f_t · A_t·B_t`` for this problem and config.

    Returns ``(kernel name, source)``. Signature as the register kernel's: ``(C, A_0, B_0, …,
    int store)``; launch :func:`blocks` blocks of ``cfg.threads`` threads with
    :func:`smem_bytes` of dynamic shared memory. ``store == 0`` computes without writing."""
    n = len(p.out.shape)
    if len(cfg.tile) != n:
        raise ValueError("config made for another output rank")
    if not applies(p, 80):
        raise ValueError("the tensor-core sum kernel needs float64 and no batch index")
    name = kernel_name(p, cfg)
    order = p.order()
    shape, T = p.out.shape, list(cfg.tile)
    partial = [shape[d] % T[d] != 0 for d in range(n)]
    s = _areas(layouts(p, cfg), cfg)
    idx = _index_type(p)
    args = ", ".join(f"const double* __restrict__ A{k}, const double* __restrict__ B{k}" for k in range(len(p.terms)))
    L = [f"// chainexec generated kernel: C += sum of contractions on FP64 tensor cores ({cfg.mma})",
         f"// output {p.out.shape} strides {p.out.strides}, {len(p.terms)} terms, config {cfg.name()}",
         *copy_macros(p.dtype), *_mma_macro(cfg.mma),
         f'extern "C" __global__ void __launch_bounds__({cfg.threads}, 1)',
         f"{name}(double* __restrict__ C, {args}, const int store)",
         "{",
         "#if defined(__CUDA_ARCH__)",
         "  extern __shared__ __align__(16) double cx_smem[];",
         "#else",
         "  extern double cx_smem[];",
         "#endif",
         "  double* const sC = cx_smem;",
         f"  double* const sA = sC + {s['C']};",
         f"  double* const sB = sA + {STAGES * s['A']};",
         f"  {idx}* const tAoff = ({idx}*)(sB + {STAGES * s['B']});",
         f"  {idx}* const tBoff = tAoff + {s['tA']};",
         f"  int* const tApos = (int*)(tBoff + {s['tB']});",
         f"  int* const tBpos = tApos + {s['tA']};",
         "  const int tid = threadIdx.x, blk = blockIdx.x;",
         "  const int warp = tid >> 5, g = (tid & 31) >> 2, q4 = tid & 3;"]
    for d, e in zip(order, _split("blk", [-(-shape[d] // T[d]) for d in order])):
        L.append(f"  const int o{d} = ({e}) * {T[d]};")
    L.append(f"  for (int e = tid; e < {s['C']}; e += {cfg.threads}) sC[e] = 0.0;")
    cpitch, run = {}, 1
    for d in order:
        cpitch[d] = run
        run *= T[d]
    for k, (t, x) in enumerate(zip(p.terms, layouts(p, cfg))):
        before, inner, after = _term(p, cfg, t, x, cpitch)
        L += pipeline(p, cfg, k, t, T, partial, {"A": s["A"], "B": s["B"]}, {"A": x.pa, "B": x.pb},
                      before, inner, after)
    L += ["  __syncthreads();", "  if (!store) return;",
          f"  for (int e = tid; e < {s['C']}; e += {cfg.threads}) {{"]
    for d, e in zip(order, _split("e", [T[d] for d in order])):
        L.append(f"    const int l{d} = {e};")
    off = " + ".join(f"{p.cast}(o{d} + l{d}) * {p.out.strides[d]}" for d in range(n)) or "0"
    cond = " && ".join(f"o{d} + l{d} < {shape[d]}" for d in range(n) if partial[d])
    L.append(f"    if ({cond}) C[{off}] += sC[e];" if cond else f"    C[{off}] += sC[e];")
    L += ["  }", "}", ""]
    return name, "\n".join(L)


def _term(p: SumProblem, cfg: MmaConfig, t: Term, x: TermLayout, cpitch: dict[int, int]) -> tuple[list, list, list]:
    """A term's lines around, inside and after its pipelined loop: zeroed accumulators and the
    warp's place; the fragment reads and MMAs of a step; the fragments added into the output tile
    (``cpitch``: the tile's pitch per output dimension)."""
    r, ks = MMA_SHAPES[cfg.mma]
    fa_offs, fb_offs = FRAGMENTS[cfg.mma]
    nc = 2 * r // 8
    place = _placement(p, t, list(cfg.tile))
    s = _areas(layouts(p, cfg), cfg)
    before = [f"  double acc[{x.mt}][{x.nt}][{nc}];",
              "  #pragma unroll",
              f"  for (int i = 0; i < {x.mt}; ++i)",
              "    #pragma unroll",
              f"    for (int j = 0; j < {x.nt}; ++j)",
              "      #pragma unroll",
              f"      for (int q = 0; q < {nc}; ++q) acc[i][j][q] = 0.0;",
              f"  const int wr = (warp / {x.wn}) * {x.mt * r}, wc = (warp % {x.wn}) * {x.nt * 8};"]
    read_a = " ".join(f"fa[i][{q}] = sA[(s & 1) * {s['A']} + (kk + {dk} + q4) * {x.pa} + wr + i * {r} + {dr} + g];"
                      for q, (dr, dk) in enumerate(fa_offs))
    read_b = " ".join(f"fb[j][{q}] = sB[(s & 1) * {s['B']} + (kk + {dk} + q4) * {x.pb} + wc + j * 8 + g];"
                      for q, dk in enumerate(fb_offs))
    inner = ["    #pragma unroll",
             f"    for (int kk = 0; kk < {cfg.kc}; kk += {ks}) {{",
             f"      double fa[{x.mt}][{len(fa_offs)}], fb[{x.nt}][{len(fb_offs)}];",
             "      #pragma unroll",
             f"      for (int i = 0; i < {x.mt}; ++i) {{ {read_a} }}",
             "      #pragma unroll",
             f"      for (int j = 0; j < {x.nt}; ++j) {{ {read_b} }}",
             "      #pragma unroll",
             f"      for (int i = 0; i < {x.mt}; ++i)",
             "        #pragma unroll",
             f"        for (int j = 0; j < {x.nt}; ++j) CX_MMA(acc[i][j], fa[i], fb[j]);",
             "    }"]

    def tile_place(var: str, side: str) -> str:
        _, local, pitch, _ = place[side]
        digits = _split(var, [cfg.tile[d] for d in local])
        return " + ".join(f"({e}) * {cpitch[d]}" for d, e in zip(local, digits) if e != "0") or "0"

    add = {1.0: "+= v", -1.0: "-= v"}.get(t.factor, f"+= {t.factor!r} * v")
    after = ["  #pragma unroll",
             f"  for (int i = 0; i < {x.mt}; ++i)",
             "    #pragma unroll",
             f"    for (int h = 0; h < {r // 8}; ++h) {{",
             f"      const int row = wr + i * {r} + h * 8 + g;",
             f"      if (row < {x.m}) {{",
             f"        const int rp = {tile_place('row', 'A')};",
             "        #pragma unroll",
             f"        for (int j = 0; j < {x.nt}; ++j)",
             "          #pragma unroll",
             "          for (int e = 0; e < 2; ++e) {",
             "            const int col = wc + j * 8 + 2 * q4 + e;",
             f"            if (col < {x.n}) {{",
             "              const double v = acc[i][j][2 * h + e];",
             f"              sC[rp + {tile_place('col', 'B')}] {add};",
             "            }",
             "          }",
             "      }",
             "    }"]
    return before, inner, after
