"""One generated CUDA kernel for a sum of contractions into one output: ``C += Σ_t f_t · A_t·B_t``.

Why: a statement list such as the (T) triples' twelve ``W += vvov·t2`` / ``W -= vooo·t2`` terms
run one contraction at a time reads and writes the whole output per term (16 bytes per element
for ``2·K`` flops): at K = o = 24 that is 3 flop/byte, far below an H100's balance of about 20,
and at K = v = 180 it is at the balance. Accumulating every term in registers before the single
store moves the output once for all of them. This is the loop fusion of the multi-level paper
(Section 3: a producer's tile kept in the fastest level while every contribution to it is made)
taken to the register level, on COGENT's kernel structure (Kim et al., CGO 2019, Algorithm 1: a
block's output tile in registers, operand slices staged through shared memory); both papers are
cited in ``docs/architecture.md``.

What COGENT's single-term mapping cannot do here: its register tile is an outer product of
x-input rows and y-input columns, a split of the output indices that differs per term (in (T)
every term splits ``ijkabc`` differently between its two operands). So the register tile is
described over the output indices alone (``reg`` elements per thread and ``tb`` threads along
each), and for each term a thread reads from shared memory only the distinct operand values its
register elements need: ``Π reg`` over the term's A-side indices plus the same over its B-side
indices, for ``Π reg`` fused multiply-adds. With registers over (a, b, c) = 4x4x4 every (T) term
reads 20 values for 64 FMAs, whatever its split.

Layouts are strided views (element strides); extents and strides are compile-time constants of
the source, so guards exist only along dimensions that do not divide into their tile, and every
offset is a sum of constant products. Index names never reach the source (dimensions are
numbered). Pure functions: no CUDA or CuPy here; :mod:`chainexec.runtime.launch` compiles and
launches.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import asdict, dataclass
from functools import cached_property

from .kernelconf import Device

ELEM = {"float64": 8, "float32": 4}
"""Bytes per element of the dtypes the kernel supports."""
_CTYPE = {"float64": "double", "float32": "float"}
_FMA = {"float64": "fma", "float32": "fmaf"}
FMA_PER_CLOCK = {"float64": 64, "float32": 128}
"""Fused multiply-adds per clock per SM without tensor cores (H100 / A100-class SMs; an A100 SM
does 32 in float64, so absolute times there are twice the model's, the ranking unchanged)."""
SMEM_BYTES_PER_CLOCK = 128
"""Shared-memory bytes one SM delivers per clock (one 128-byte wavefront)."""
ISSUE_PER_CLOCK = 4
"""Warp instructions one SM issues per clock (four schedulers)."""
COPY_INSTRUCTIONS = 8
"""Instructions per thread per copied element per step (table reads, address, guard, cp.async);
building a term's table costs about 6 plus 3 per index digit, once."""
STEP_INSTRUCTIONS = 40
"""Instructions per thread per step besides FMAs, reads and copies: loop, waits, two barriers."""
L2_BYTES_PER_CLOCK = 64
"""L2-to-SM bytes per clock per SM the model assumes for the cooperative loads."""
MAX_ACC = {"float64": 64, "float32": 128}
"""Register elements per thread at most (64 doubles: 128 of the 255 registers a thread may use)."""
KC = (4, 8, 16)
"""Contracted elements staged per step that the search tries."""
THREADS = (64, 128, 256)
"""Block sizes the search tries."""
STAGES = 2
"""Shared-memory buffers per operand: step s+1's slices are copied (``cp.async``) while step s's
are multiplied, so global-memory latency hides behind the FMAs instead of every step waiting for
its loads."""
TOP = 3
"""Candidates the runtime times (the model ranks; measurements decide, as for GETT): the best
thread mapping of each of the model's three best register tiles."""
REG_TILES = 8
"""Register tiles (the most FMAs per shared-memory read, among those a block of threads can
cover) whose thread mappings are searched."""


@dataclass(frozen=True)
class View:
    """A tensor operand: index names, extents (elements) and strides (elements)."""

    indices: tuple[str, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    def stride(self, name: str) -> int:
        return self.strides[self.indices.index(name)]


@dataclass(frozen=True)
class Term:
    """``factor · A·B`` summed over the indices of A and B that the output lacks."""

    a: View
    b: View
    factor: float


@dataclass(frozen=True)
class SumProblem:
    """``out += Σ terms`` in ``dtype``; built and checked by :func:`problem`."""

    out: View
    terms: tuple[Term, ...]
    dtype: str

    def contracted(self, t: Term) -> tuple[str, ...]:
        """The term's summed indices, slowest first in A (the last varies fastest in a step)."""
        inner = [i for i in t.a.indices if i not in self.out.indices]
        return tuple(sorted(inner, key=lambda i: -t.a.stride(i)))

    def depth(self, t: Term) -> int:
        """Length of the term's summed range (elements; 1 for an outer product)."""
        return math.prod(t.a.shape[t.a.indices.index(i)] for i in self.contracted(t))

    def part(self, terms: tuple[int, ...]) -> "SumProblem":
        """The same output with only the terms at positions ``terms``."""
        return SumProblem(self.out, tuple(self.terms[k] for k in terms), self.dtype)

    def order(self) -> list[int]:
        """Output dimensions, fastest in memory first: threads and blocks walk them this way, so
        neighbouring threads store to neighbouring addresses."""
        return sorted(range(len(self.out.indices)), key=lambda d: (self.out.strides[d], -d))

    @cached_property
    def cast(self) -> str:
        """The cast of offset terms: none (32-bit arithmetic, fewer instructions per copy) where
        every view's elements lie within 2^31 of its start, else to 64 bits. Found once per
        problem: the generators ask for it per offset they write, hundreds of times for one (T)
        kernel."""
        span = max(sum((n - 1) * s for n, s in zip(v.shape, v.strides))
                   for v in [self.out] + [x for t in self.terms for x in (t.a, t.b)])
        return "" if span < 2**31 else "(long long)"


@dataclass(frozen=True)
class SumConfig:
    """Per output dimension (in the output's index order): ``tb`` threads and ``reg`` register
    elements per thread (tile ``tb·reg``); ``kc`` summed elements staged per step."""

    tb: tuple[int, ...]
    reg: tuple[int, ...]
    kc: int

    @property
    def threads(self) -> int:
        return math.prod(self.tb)

    def tile(self, d: int) -> int:
        return self.tb[d] * self.reg[d]

    def name(self) -> str:
        return f"tb{'x'.join(map(str, self.tb))}_reg{'x'.join(map(str, self.reg))}_k{self.kc}"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "SumConfig":
        return cls(tuple(d["tb"]), tuple(d["reg"]), int(d["kc"]))


def problem(out: View, terms: list[Term], dtype: str) -> SumProblem:
    """Check a sum of contractions and return it as a :class:`SumProblem`.

    Raises ValueError when: the dtype is not float64/float32; an index repeats within a view; an
    output index is in neither operand of a term; a summed index is not in both operands; extents
    disagree; the output has a zero stride along an extent above 1 (two elements in one place)."""
    if dtype not in ELEM:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(ELEM)}")
    if not terms:
        raise ValueError("a sum needs at least one term")
    size = {}
    for v in [out] + [x for t in terms for x in (t.a, t.b)]:
        if len(set(v.indices)) != len(v.indices) or not len(v.indices) == len(v.shape) == len(v.strides):
            raise ValueError(f"malformed view {v}")
        for i, n in zip(v.indices, v.shape):
            if size.setdefault(i, n) != n:
                raise ValueError(f"index {i} has extents {size[i]} and {n}")
    if any(s == 0 and n > 1 for s, n in zip(out.strides, out.shape)):
        raise ValueError("the output has a zero stride")
    for t in terms:
        if any(i not in t.a.indices and i not in t.b.indices for i in out.indices):
            raise ValueError("every output index must be in one operand of every term")
        summed = (set(t.a.indices) | set(t.b.indices)) - set(out.indices)
        if not summed <= set(t.a.indices) & set(t.b.indices):
            raise ValueError("a summed index must be in both operands")
    return SumProblem(out, tuple(terms), dtype)


# -- the model -------------------------------------------------------------------------------


def _sides(p: SumProblem, t: Term) -> tuple[list[int], list[int]]:
    """Output dimensions held by A and by B (a batch dimension is in both)."""
    return ([d for d, i in enumerate(p.out.indices) if i in t.a.indices],
            [d for d, i in enumerate(p.out.indices) if i in t.b.indices])


def _warp_spread(p: SumProblem, cfg: SumConfig) -> dict[int, int]:
    """Distinct thread positions along each dimension within one warp of 32 threads."""
    spread, left = {}, 32
    for d in p.order():
        spread[d] = max(1, min(cfg.tb[d], left))
        left = max(1, left // cfg.tb[d])
    return spread


def registers(p: SumProblem, cfg: SumConfig) -> int:
    """Estimated 32-bit registers per thread: accumulators, one term's operand values, addresses."""
    words = ELEM[p.dtype] // 4
    values = max(math.prod(cfg.reg[d] for d in a) + math.prod(cfg.reg[d] for d in b)
                 for a, b in map(lambda t: _sides(p, t), p.terms))
    return words * (math.prod(cfg.reg) + values) + 32


def smem_bytes(p: SumProblem, cfg: SumConfig) -> int:
    """Static shared memory of the kernel (bytes): :data:`STAGES` times the largest A slice plus
    the largest B slice of a step, and their copy tables (an offset and a place per element)."""
    sa = max(math.prod(cfg.tile(d) for d in _sides(p, t)[0]) for t in p.terms)
    sb = max(math.prod(cfg.tile(d) for d in _sides(p, t)[1]) for t in p.terms)
    index = 4 if not p.cast else 8
    return (STAGES * ELEM[p.dtype] + index + 4) * (sa + sb) * cfg.kc


def blocks(p: SumProblem, cfg: SumConfig) -> int:
    """Thread blocks of the grid: one per output tile."""
    return math.prod(-(-n // cfg.tile(d)) for d, n in enumerate(p.out.shape))


def predict(p: SumProblem, cfg: SumConfig, dev: Device) -> float:
    """Model seconds (at 1.7 GHz) of the kernel: the slowest of the FMA pipe, instruction issue
    (FMAs, shared-memory reads, the copies' address arithmetic, per-step overhead), shared-memory
    wavefronts and L2 reads over all SMs, with padded tiles and the last partial wave of blocks
    counted; ``inf`` where the config exceeds the device (registers, shared memory, threads).

    The issue term is there because instruction issue, not the FMA pipe, can bound the kernel:
    copies that decompose their element number in every step take twice the instructions of the
    FMAs (see :func:`_table`)."""
    regs, smem = registers(p, cfg), smem_bytes(p, cfg)
    if regs > dev.regs_per_thread or smem > dev.smem_per_block or cfg.threads > dev.max_threads_per_block:
        return math.inf
    per_sm = min(dev.regs_per_sm // (regs * cfg.threads), dev.smem_per_sm // max(smem, 1),
                 dev.max_threads_per_sm // cfg.threads)
    if per_sm < 1:
        return math.inf
    nblk = blocks(p, cfg)
    waves = -(-nblk // (per_sm * dev.sm_count))  # rounds of resident blocks on the busiest SM
    spread = _warp_spread(p, cfg)
    elem = ELEM[p.dtype]
    warps = cfg.threads / 32
    fma = issue = smem_clk = load = 0.0
    for t in p.terms:
        steps = -(-p.depth(t) // cfg.kc)
        fma += warps * math.prod(cfg.reg) * steps * cfg.kc
        issue += warps * steps * (STEP_INSTRUCTIONS + math.prod(cfg.reg) * cfg.kc)
        for side in _sides(p, t):
            values = math.prod(cfg.reg[d] for d in side)
            distinct = math.prod(spread[d] for d in side)
            smem_clk += warps * values * math.ceil(distinct * elem / SMEM_BYTES_PER_CLOCK) * steps * cfg.kc
            tile = math.prod(cfg.tile(d) for d in side)
            digits = 1 + sum(cfg.tile(d) > 1 for d in side)
            copies = -(-tile * cfg.kc // cfg.threads)  # per thread per step
            issue += warps * (steps * (values * cfg.kc + copies * COPY_INSTRUCTIONS) + copies * (6 + 3 * digits))
            load += tile * steps * cfg.kc * elem
    per_block = max(fma / (FMA_PER_CLOCK[p.dtype] / 32), issue / ISSUE_PER_CLOCK, smem_clk,
                    load / L2_BYTES_PER_CLOCK)
    resident = min(per_sm, -(-nblk // dev.sm_count))
    # fewer than 8 resident warps per SM leave FMA and shared-memory latency exposed
    latency = max(1.0, 8 / (resident * warps))
    return per_block * resident * waves * latency / 1.7e9


def launch_shape(p: SumProblem, cfg: SumConfig) -> tuple[int, int, int]:
    """(blocks, threads per block, dynamic shared memory in bytes: none, it is all static)."""
    return blocks(p, cfg), cfg.threads, 0


def _pow2_upto(n: int) -> list[int]:
    out, x = [1], 2
    while x <= 32 and x < 2 * n:
        out.append(x)
        x *= 2
    return out


def splits(p: SumProblem) -> list[tuple[int, ...]]:
    """Positions of terms worth one sum kernel while the others run one by one: for each summed
    range length below the longest, the terms whose range is at most that long, where they are
    at least two.

    Why: a term run on its own reads and writes the whole output, 2·itemsize bytes an element
    for 2·depth flops. Where the range is long the pass is paid for (the (T) ``vvov`` terms,
    depth v, run as batched GEMM on the tensor cores); where it is short the passes are the cost
    (the six ``ooov`` terms, depth o: on the o=24, v=180 tile, six passes at the device's
    bandwidth take as long as half the GEMM work). One kernel for the short terms reads and writes
    the output once."""
    depths = [p.depth(t) for t in p.terms]
    parts = [tuple(k for k, d in enumerate(depths) if d <= limit) for limit in sorted(set(depths))[:-1]]
    return [part for part in parts if len(part) >= 2]


def candidates(p: SumProblem, dev: Device, top: int = TOP) -> list[SumConfig]:
    """The ``top`` configurations the model ranks fastest (:func:`predict`), best first, each
    with a different register tile.

    Search: register tiles (1–6 elements along each of at most three dimensions, ``Π reg`` between
    8 and :data:`MAX_ACC`), those holding more short dimensions whole first (every operand slice
    along such a dimension is then read once per block: on the (T) tile, holding the three
    occupied extents of 3 whole measured fastest), then by FMAs per shared-memory read (ties:
    least padding); for the first :data:`REG_TILES` that a block can cover, every thread mapping (powers of two,
    :data:`THREADS` per block, the fastest output dimension at least 4 threads wide where it is
    that long, for coalesced stores) and :data:`KC`. Raises ValueError if nothing fits the device."""
    n = len(p.out.shape)
    shape = p.out.shape
    sides = [_sides(p, t) for t in p.terms]
    regs = []
    dims = [d for d in range(n) if shape[d] > 1]
    for chosen in itertools.chain.from_iterable(itertools.combinations(dims, r) for r in range(0, 4)):
        for values in itertools.product(*(range(2, min(6, shape[d]) + 1) for d in chosen)):
            reg = [1] * n
            for d, v in zip(chosen, values):
                reg[d] = v
            acc = math.prod(reg)
            if not (min(8, math.prod(shape)) <= acc <= MAX_ACC[p.dtype]):
                continue
            reads = sum(math.prod(reg[d] for d in a) + math.prod(reg[d] for d in b) for a, b in sides)
            pad = math.prod(-(-shape[d] // reg[d]) * reg[d] for d in range(n)) / math.prod(shape)
            whole = sum(reg[d] == shape[d] for d in chosen)
            regs.append((-whole, -acc * len(sides) / reads, pad, tuple(reg)))
    fastest = p.order()[0]
    best = {}
    for reg in [r for *_, r in sorted(regs)] + [tuple([1] * n)]:
        if len(best) == REG_TILES:
            break
        options = [_pow2_upto(-(-shape[d] // reg[d])) for d in range(n)]
        for tb in _products(options, max(THREADS)):
            if math.prod(tb) not in THREADS or tb[fastest] < min(4, -(-shape[fastest] // reg[fastest])):
                continue
            for kc in KC:
                cfg = SumConfig(tb, reg, kc)
                t = predict(p, cfg, dev)
                if t < best.get(reg, (math.inf,))[0]:
                    best[reg] = (t, cfg.name(), cfg)
    if not best:
        raise ValueError("no configuration of the sum kernel fits the device")
    return [cfg for *_, cfg in sorted(best.values(), key=lambda x: x[:2])[:top]]


def _products(options: list[list[int]], limit: int) -> list[tuple[int, ...]]:
    """Tuples with one value from each of ``options`` whose product is at most ``limit``."""
    out = [()]
    for opts in options:
        out = [t + (x,) for t in out for x in opts if math.prod(t) * x <= limit]
    return out


# -- the source -------------------------------------------------------------------------------


def _split(var: str, radices: list[int]) -> list[str]:
    """Expressions of the mixed-radix digits of ``var`` (first radix fastest)."""
    out, below = [], 1
    total = math.prod(radices)
    for r in radices:
        e = f"{var} / {below}" if below > 1 else var
        if below * r < total:
            e = f"({e}) % {r}"
        out.append(e if r > 1 else "0")
        below *= r
    return out


def _index_type(p: SumProblem) -> str:
    return "int" if not p.cast else "long long"


def kernel_name(p: SumProblem, cfg: SumConfig) -> str:
    """A C identifier unique to the problem (shapes, strides, factors, dtype) and config."""
    key = repr((p, cfg))
    return "chainexec_sum_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def copy_macros(dtype: str) -> list[str]:
    """``CX_COPY(dst, src, ok)`` (one element global→shared, zero where not ``ok``),
    ``CX_COMMIT()`` and ``CX_WAIT(n)``: asynchronous copies (``cp.async``) on the GPU, a plain
    copy with the same zero fill where the source is compiled for a CPU (the tests' emulation)."""
    size = ELEM[dtype]
    return ["#if defined(__CUDA_ARCH__)",
            '#define CX_COPY(dst, src, ok) asm volatile("cp.async.ca.shared.global [%0], [%1], '
            f'{size}, %2;\\n" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), '
            f'"r"((ok) ? {size} : 0))',
            '#define CX_COMMIT() asm volatile("cp.async.commit_group;\\n" ::)',
            '#define CX_WAIT(n) asm volatile("cp.async.wait_group " #n ";\\n" ::)',
            "#else",
            f"#define CX_COPY(dst, src, ok) (*(dst) = (ok) ? *(src) : ({_CTYPE[dtype]})0)",
            "#define CX_COMMIT()",
            "#define CX_WAIT(n)",
            "#endif"]


def generate(p: SumProblem, cfg: SumConfig) -> tuple[str, str]:
    """CUDA C source of ``C += Σ_t f_t · A_t·B_t`` for this problem and config.

    Returns ``(kernel name, source)``. Signature: ``(C, A_0, B_0, A_1, B_1, …, int store)``;
    launch :func:`blocks` blocks of ``cfg.threads`` threads. With ``store == 0`` everything is
    computed but nothing is written (the autotuner times candidates on live data that way)."""
    n = len(p.out.shape)
    if len(cfg.tb) != n or len(cfg.reg) != n:
        raise ValueError("config made for another output rank")
    ctype, fma = _CTYPE[p.dtype], _FMA[p.dtype]
    name = kernel_name(p, cfg)
    order = p.order()
    shape = p.out.shape
    T = [cfg.tile(d) for d in range(n)]
    partial = [shape[d] % T[d] != 0 for d in range(n)]
    sa = max(math.prod(T[d] for d in _sides(p, t)[0]) for t in p.terms) * cfg.kc
    sb = max(math.prod(T[d] for d in _sides(p, t)[1]) for t in p.terms) * cfg.kc
    args = ", ".join(f"const {ctype}* __restrict__ A{k}, const {ctype}* __restrict__ B{k}"
                     for k in range(len(p.terms)))
    L = ["// chainexec generated kernel: C += sum of contractions, accumulated in registers",
         f"// output {p.out.shape} strides {p.out.strides}, {len(p.terms)} terms, {p.dtype}, "
         f"config {cfg.name()}",
         *copy_macros(p.dtype),
         f'extern "C" __global__ void __launch_bounds__({cfg.threads}, 1)',
         f"{name}({ctype}* __restrict__ C, {args}, const int store)",
         "{",
         f"  __shared__ {ctype} sA[{STAGES * sa}];",
         f"  __shared__ {ctype} sB[{STAGES * sb}];",
         f"  __shared__ {_index_type(p)} tAoff[{sa}], tBoff[{sb}];",
         f"  __shared__ int tApos[{sa}], tBpos[{sb}];",
         "  const int tid = threadIdx.x;",
         "  const int blk = blockIdx.x;"]
    for d, e in zip(order, _split("tid", [cfg.tb[d] for d in order])):
        L.append(f"  const int t{d} = {e};")
    for d, e in zip(order, _split("blk", [-(-shape[d] // T[d]) for d in order])):
        L.append(f"  const int o{d} = ({e}) * {T[d]};")
    R = list(itertools.product(*(range(cfg.reg[d]) for d in range(n))))
    L.append(f"  {ctype} " + ", ".join(f"c{e} = 0" for e in range(len(R))) + ";")
    for k, t in enumerate(p.terms):
        L += _term(p, cfg, k, t, T, partial, ctype, fma, R, (sa, sb))
    # stores: one per register element, guarded along the dimensions with a partial tile
    L.append("  if (!store) return;")
    for e, r in enumerate(R):
        g = [f"(o{d} + {r[d] * cfg.tb[d]} + t{d})" for d in range(n)]
        off = " + ".join(f"{p.cast}{g[d]} * {p.out.strides[d]}" for d in range(n)) or "0"
        cond = " && ".join(f"{g[d]} < {shape[d]}" for d in range(n) if partial[d])
        stmt = f"C[{off}] += c{e};"
        L.append(f"  if ({cond}) {stmt}" if cond else f"  {stmt}")
    L += ["}", ""]
    return name, "\n".join(L)


def _placement(p: SumProblem, t: Term, T: list[int]) -> dict[str, tuple]:
    """Per operand side of a term: (view, its output dimensions in thread order, the place
    pitch of each in a step's slice, the slice's elements per summed element): the thread-fastest
    dimension at pitch 1, so that a slice row is contiguous along it."""
    out = {}
    for side, view, dims in zip("AB", (t.a, t.b), _sides(p, t)):
        local = [d for d in p.order() if d in dims]
        pitch, run = {}, 1
        for d in local:
            pitch[d] = run
            run *= T[d]
        out[side] = (view, local, pitch, run)
    return out


def pipeline(p: SumProblem, cfg, k: int, t: Term, T: list[int], partial: list[bool],
             stage: dict[str, int], kpitch: dict[str, int], before: list[str], inner: list[str],
             after: list[str]) -> list[str]:
    """One term's loop over its summed range, shared by the register kernel and the tensor-core
    one (:mod:`chainexec.kernels.summma`): the copy tables (:func:`_table`), then step s+1's A
    and B slices copied into one shared-memory stage (``stage[side]`` elements, element ``kl`` of
    the step at ``kl * kpitch[side]``) while the ``inner`` lines use step s's in the other
    (``(s & 1) * stage[side]``); ``before`` and ``after`` run around the loop. ``cfg`` needs
    ``kc`` and ``threads``."""
    inner_idx = p.contracted(t)
    ext = {i: t.a.shape[t.a.indices.index(i)] for i in inner_idx}
    depth = p.depth(t)
    steps = -(-depth // cfg.kc)
    place = _placement(p, t, T)

    def issue(step: str) -> list[str]:
        lines = []
        for side in "AB":
            view, _, _, run = place[side]
            lines += _issue(p, cfg, side, k, view, run, kpitch[side], stage[side], step, inner_idx, ext, depth)
        return lines + ["    CX_COMMIT();"]

    L = [f"  // term {k}: factor {t.factor!r}, summed range {depth} in {steps} steps of {cfg.kc}", "  {"]
    for side in "AB":
        view, local, pitch, run = place[side]
        L += _table(p, cfg, side, view, local, pitch, kpitch[side], inner_idx, T, partial)
    L += before
    L.append("  __syncthreads();")
    L += issue("0")
    L += [f"  for (int s = 0; s < {steps}; ++s) {{",
          f"    if (s + 1 < {steps}) {{"]
    L += issue("s + 1")
    L += ["      CX_WAIT(1);", "    } else {", "      CX_WAIT(0);", "    }"]
    L.append("    __syncthreads();")
    L += inner
    L += ["    __syncthreads();", "  }"]
    return L + after + ["  }"]


def _term(p: SumProblem, cfg: SumConfig, k: int, t: Term, T: list[int], partial: list[bool],
          ctype: str, fma: str, R: list[tuple], stage: tuple[int, int]) -> list[str]:
    """One term: every thread's register elements get their products from step s's slices."""
    a_dims, b_dims = _sides(p, t)
    place = _placement(p, t, T)
    L = ["    #pragma unroll", f"    for (int kk = 0; kk < {cfg.kc}; ++kk) {{"]
    values = {}
    for side, dims, size in (("A", a_dims, stage[0]), ("B", b_dims, stage[1])):
        _, _, pitch, run = place[side]
        base = " + ".join([f"(s & 1) * {size}"] + [f"t{d} * {pitch[d]}" for d in dims])
        combos = list(itertools.product(*(range(cfg.reg[d]) for d in dims)))
        for j, combo in enumerate(combos):
            off = sum(r * cfg.tb[d] * pitch[d] for d, r in zip(dims, combo))
            scale = "" if side == "B" or t.factor in (1.0, -1.0) else f"({ctype}){t.factor!r} * "
            L.append(f"      const {ctype} {side.lower()}{j} = {scale}s{side}[kk * {run} + {base} + {off}];")
            values[side, combo] = f"{side.lower()}{j}"
    neg = "-" if t.factor == -1.0 else ""
    for e, r in enumerate(R):
        av = values["A", tuple(r[d] for d in a_dims)]
        bv = values["B", tuple(r[d] for d in b_dims)]
        L.append(f"      c{e} = {fma}({neg}{av}, {bv}, c{e});")
    L.append("    }")
    return pipeline(p, cfg, k, t, T, partial, dict(zip("AB", stage)),
                    {side: place[side][3] for side in "AB"}, [], L, [])


def _table(p, cfg, side, view, local, pitch, kpitch, inner, T, partial) -> list[str]:
    """The copy table of one operand of a term, built once per term: for each element of a
    step's slice, in the operand's memory order (fastest stride innermost, so that neighbouring
    threads read neighbouring addresses), its offset in the operand at step 0 (-1 past an edge of
    the output's tile) and its place in a shared-memory stage. Copies then cost a table read and
    an add per step instead of a mixed-radix decomposition: with the decomposition in every step,
    the copies' integer arithmetic takes twice the instructions of the FMAs and leaves the FP64
    pipe idle most of the time."""
    kc = cfg.kc
    run = math.prod(T[d] for d in local)
    fast_inner = min((view.stride(i) for i in inner), default=0)
    digits = [("d", d, T[d], view.stride(p.out.indices[d])) for d in local] + [("k", None, kc, fast_inner)]
    digits.sort(key=lambda x: (x[3], x[0] == "d"))
    single = len(inner) == 1
    L = [f"  for (int e = tid; e < {run * kc}; e += {cfg.threads}) {{"]
    ok, off, spos = [], [], []
    for (kind, d, radix, _), expr in zip(digits, _split("e", [x[2] for x in digits])):
        if kind == "k":
            L.append(f"    const int kl = {expr};")
            spos.append(f"kl * {kpitch}")
            if single:  # the offset at step 0; steps add kc times the stride
                off.append(f"{p.cast}kl * {view.stride(inner[0])}")
        else:
            L.append(f"    const int l{d} = {expr};")
            spos.append(f"l{d} * {pitch[d]}")
            off.append(f"{p.cast}(o{d} + l{d}) * {view.stride(p.out.indices[d])}")
            if partial[d]:
                ok.append(f"o{d} + l{d} < {p.out.shape[d]}")
    value = " + ".join(off) or "0"
    if ok:
        value = f"({' && '.join(ok)}) ? {value} : -1"
    L += [f"    t{side}off[e] = {value};",
          f"    t{side}pos[e] = {' + '.join(spos)};", "  }"]
    return L


def _issue(p, cfg, side, k, view, run, kpitch, size, step, inner, ext, depth) -> list[str]:
    """The copies of step ``step``'s slice of an operand into its shared-memory stage ``step & 1``
    (``size`` elements per stage) from the copy table (:func:`_table`); zeros past an edge."""
    kc = cfg.kc
    total = run * kc
    L = ["    #pragma unroll 4", f"    for (int j = 0; j < {-(-total // cfg.threads)}; ++j) {{",
         f"      const int e = tid + j * {cfg.threads};"]
    if total % cfg.threads:
        L.append(f"      if (e < {total}) {{")
    L += [f"      const {_index_type(p)} o = t{side}off[e];", f"      const int q = t{side}pos[e];"]
    ok = ["o >= 0"]
    if depth % kc:  # q = kl * kpitch + place: kl < depth left (in 64 bits where the product needs them)
        wide = "(long long)" if depth * kpitch >= 2**31 else ""
        ok.append(f"{wide}q < {wide}({depth} - ({step}) * {kc}) * {kpitch}")
    if len(inner) == 1:
        src = f"o + ({step}) * {kc * view.stride(inner[0])}"
    else:
        L.append(f"      const int kg = ({step}) * {kc} + q / {kpitch};")
        terms, below = ["o"], 1
        for i in reversed(inner):  # inner[-1] varies fastest
            terms.append(f"{p.cast}((kg / {below}) % {ext[i]}) * {view.stride(i)}")
            below *= ext[i]
        src = " + ".join(terms)
    L.append(f"      CX_COPY(&s{side}[(({step}) & 1) * {size} + q], {side}{k} + {src}, {' && '.join(ok)});")
    if total % cfg.threads:
        L.append("      }")
    L.append("    }")
    return L
