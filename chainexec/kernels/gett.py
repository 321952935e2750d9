"""GETT kernels on FP64 tensor cores: any binary contraction as one GEMM over index groups.

Beyond COGENT (Kim et al., "A Code Generator for High-Performance Tensor Contractions on GPUs",
CGO 2019), whose kernels use FP64 FMA
units only, this generator targets the FP64 tensor cores of sm_80 and newer (``mma.sync ...
m8n8k4 ... f64``; on sm_90 also ``m16n8k4``) with asynchronous global→shared copies
(``cp.async``) in a multi-stage pipeline.

The contraction ``C[c] (+)= alpha * sum A[a]*B[b]`` is the GEMM-like tensor-tensor product
(GETT) of Springer & Bientinesi, the idea the strided-batched-GEMM paper (Shi et al., "Tensor
Contractions with Extended BLAS Kernels on CPU and GPU", Section 2) generalizes: its indices fall
into four groups -- batch ``L`` (in all three tensors), ``M`` (A and C), ``N`` (B and C) and
``K`` (A and B, summed). Flattening each group turns every tensor access into a sum of two
offsets: ``A[m,k] = A[offAm[m] + offAk[k]]``, ``B[k,n] = B[offBk[k] + offBn[n]]``,
``C[m,n] = C[offCm[m] + offCn[n]]`` (plus ``off?l[l]`` per batch), where each table is the dot
product of a group's multi-index with the tensor's strides. The kernel is then an ordinary tiled
GEMM that gathers through the tables: no transposed copies of inputs or outputs, and any strided
view (a tile of a larger buffer) works as is. Only the tile shape and two coalescing choices are
compiled in (:class:`GettConfig`); the index structure lives in the tables, so one compiled
kernel serves every contraction.

Coalescing: the operand holding C's fastest-varying index (smallest stride) plays ``B``, so the
stores run along ``n``; each group is ordered so its last index is the stride-1 index of the
operand that loads it; a tile is loaded in whichever direction (along ``m``/``n`` or along ``k``)
holds the operand's stride-1 index (``a_k_fast``, ``b_n_fast``), and shared memory is laid out
in the same direction with a pitch of 4 mod 16 doubles, which makes both the cp.async stores and
the tensor-core fragment reads free of bank conflicts.

Pure Python (NumPy for the tables): the runtime compiles and launches
(:mod:`chainexec.runtime.launch`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

MMA_SHAPES = {"m8n8k4": (8, 4), "m16n8k4": (16, 4), "m16n8k8": (16, 8)}
"""FP64 MMA shapes -> (rows, k per instruction); the m16 shapes need sm_90."""
SM90_SHAPES = ("m16n8k4", "m16n8k8")
"""Shapes PTX offers from sm_90 on (m8n8k4 f64 exists from sm_80)."""
FRAGMENTS = {
    # (A elements as (row, k) offsets from (lane>>2, lane&3), B elements as k offsets from lane&3)
    "m8n8k4": (((0, 0),), (0,)),
    "m16n8k4": (((0, 0), (8, 0)), (0,)),
    "m16n8k8": (((0, 0), (8, 0), (0, 4), (8, 4)), (0, 4)),
}
"""Fragment layouts of the PTX ISA's FP64 ``mma`` shapes: lane ``l`` holds A at row
``l>>2 + r`` and column ``l&3 + k``, B at row ``l&3 + k`` and column ``l>>2``, and C at row
``l>>2`` (``+8`` for the second pair of the m16 shapes) and columns ``2(l&3) + {0, 1}``."""
SMEM_LIMIT = 227 * 1024
"""Dynamic shared memory one block may opt into on sm_90 (bytes)."""
SMEM_BY_ARCH = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
"""Dynamic shared memory one block may opt into (bytes), per compute capability."""


def smem_limit(arch: int) -> int:
    """Shared memory one block may use on compute capability ``arch`` (bytes); newer ones get
    sm_90's, unknown older ones the smallest listed."""
    return SMEM_BY_ARCH.get(arch, SMEM_LIMIT if arch >= 90 else min(SMEM_BY_ARCH.values()))


ELEM = 8
"""Bytes per float64 element (the only type of these kernels)."""
SECTOR = 32
"""Bytes of one DRAM/L2 sector: a run of fewer contiguous bytes still moves a whole sector."""


SHORT_SUM = 48
"""Longest summed range (elements, a multiple of 4) a short-sum kernel holds
(:attr:`GettConfig.span`): its warp's A fragments take ``mma_m · bk / 2`` doubles a lane."""
FRAGMENT_REGISTERS = 96
"""Registers a lane of a short-sum kernel may give to A's fragments (``mma_m · bk``): with a
chunk's accumulators, B's fragment and the offsets, 128-160 registers in all."""


BULK_SUM = 128
"""Longest summed range (elements) a bulk-copy kernel holds: A's tile and B's stages take
``bk`` rows of shared memory each."""
BULK_CHUNKS = 64
"""Most chunks a bulk-copy block walks: their runs' first columns' offsets sit in static shared
memory (:meth:`GettConfig.bulk_static_bytes`)."""
BULK_ACCUMULATORS = 40
"""Most accumulators (doubles, ``4·mma_m·mma_n``) a lane of a bulk-copy kernel holds: with its
copying warp a block of eight computing warps has 288 threads, for which ptxas gives a lane at
most 168 registers, and more accumulators spill."""


@dataclass(frozen=True)
class GettConfig:
    """Compiled-in shape of one kernel.

    ``warps_m × warps_n`` warps per block, each computing ``mma_m × mma_n`` MMA tiles of
    ``rows × 8`` (``mma`` one of :data:`MMA_SHAPES`), so the block tile is ``bm × bn`` with
    ``bk`` summed per stage;
    ``stages`` shared-memory buffers in flight (cp.async pipeline depth). ``a_k_fast``: A's tile
    is loaded along k (A's stride-1 index is summed), else along m; ``b_n_fast``: B's along n,
    else along k. ``staged``: the epilogue passes each warp's accumulators through shared memory
    and stores whole rows of its tile per instruction (:func:`source`), else every lane stores
    its own fragment elements. ``wide``: offsets and extents are 64-bit (:attr:`Problem.wide`),
    else 32-bit, which halves the instructions of every index computation and table read.

    ``span > 0``: the short-sum kernel (:mod:`chainexec.kernels.shortsum`, valid where
    :meth:`short_valid`): ``warps_m`` warps along m (``warps_n`` 1), each holding the A fragments
    of ``mma_m`` m16 tiles for the whole sum (``bk`` at least K), walk ``span`` columns (``bn``)
    in chunks of ``8·mma_n``, B streamed through ``stages`` shared-memory buffers.

    ``bulk`` (with ``span > 0``): the bulk-copy kernel (:mod:`chainexec.kernels.bulk`, valid
    where :meth:`bulk_valid`): one block row of ``16·mma_m`` rows of A held in shared memory for
    the whole sum (``bk`` at least K), ``warps_n`` warps side by side along n, each ``mma_m ×
    mma_n`` m16n8 tiles of a chunk of ``8·mma_n·warps_n`` columns, B's chunks copied row by row
    by the tensor memory accelerator into ``stages`` buffers by one more warp; for B whose rows of
    a chunk are contiguous (:attr:`Problem.bulk_run`), or made of ``copies`` contiguous runs of
    equal length, each its own bulk copy (:func:`bulk_copies`).

    ``turn > 0`` (B loaded along n): B's tile columns come in groups of ``LINE · turn`` table
    positions, ``turn`` of C's stride-1 index fastest by :data:`LINE` of B's (a problem of the
    ``store-line`` order, :attr:`Problem.turn`); each warp's lanes load them transposed, along
    B's stride-1 index, so that a copy instruction reads two whole 128-byte lines where in table
    order it would read a sector of each of eight. The copies land in shared memory at column
    ``p + p / LINE`` of position ``p`` (:meth:`column`), which keeps the transposed stores and the
    fragment reads free of bank conflicts."""

    warps_m: int
    warps_n: int
    mma_m: int
    mma_n: int
    bk: int
    stages: int
    mma: str
    a_k_fast: bool
    b_n_fast: bool
    staged: bool = False
    wide: bool = False
    span: int = 0
    bulk: bool = False
    copies: int = 1
    turn: int = 0

    @property
    def rows(self) -> int:
        return MMA_SHAPES[self.mma][0]

    @property
    def kstep(self) -> int:
        return MMA_SHAPES[self.mma][1]

    @property
    def threads(self) -> int:
        """Threads a block: its computing warps', and a bulk-copy kernel's copying warp."""
        return 32 * (self.warps_m * self.warps_n + self.bulk)

    @property
    def bm(self) -> int:
        return self.warps_m * self.mma_m * self.rows

    @property
    def bn(self) -> int:
        return self.span or self.warps_n * self.mma_n * 8

    def pitches(self) -> tuple[int, int]:
        """Shared-memory row pitch (elements) of the A and B tiles: the loaded direction's length
        plus 4, i.e. 4 mod 16 doubles, so 4 rows of a fragment read fall into distinct banks; B's
        turned columns (:meth:`column`) spread over ``bn + bn / LINE``, that rounded up to 4 mod 16."""
        a = (self.bk if self.a_k_fast else self.bm) + 4
        if self.turn:
            width = self.bn + self.bn // LINE
            return a, width + (4 - width) % 16
        return a, (self.bn if self.b_n_fast else self.bk) + 4

    def column(self, position: str) -> str:
        """C expression of the shared-memory column of B's tile position ``position`` (a C
        expression): the position itself, or with :attr:`turn` one column more per :data:`LINE`
        before it, so that a half-warp's transposed copies (positions ``turn`` apart) fall on all
        32 banks."""
        return f"({position}) + ({position}) / {LINE}" if self.turn else position

    def stage_elems(self) -> tuple[int, int]:
        """Elements of one stage of the A and B tiles in shared memory."""
        pa, pb = self.pitches()
        return (self.bm if self.a_k_fast else self.bk) * pa, (self.bk if self.b_n_fast else self.bn) * pb

    def stage_pitch(self) -> int:
        """Row pitch (elements) of a warp's tile in the staged epilogue: its width rounded to 3
        mod 16 doubles. The shared memory serves 8-byte stores a half-warp at a time; one
        fragment store puts a half-warp's 16 lanes on 4 rows × 4 even (or odd) columns, so at
        least two lanes share a bank pair whatever the pitch, and any pitch but 0 or 2 mod 16
        reaches that floor, where 0 or 2 mod 16 takes twice the cycles per store."""
        width = self.mma_n * 8
        return width + (3 - width) % 16

    def short_pitch(self) -> int:
        """Row pitch (elements) of the short-sum kernel's A tile (k fastest): ``bk + 4`` where A is
        gathered along k (a warp's copies run along a row), ``bk + 1`` where along m: an odd pitch
        puts a warp's copies into 32 rows of one column on all 16 eight-byte bank pairs twice,
        where ``bk + 4`` (a multiple of 4) puts them on at most four, eight or more a pair, and the
        shared-memory pipe the gather shares with every load and store of the kernel serves them
        one pair at a time. The fragment reads, made once a warp, are what the pitch costs."""
        return self.bk + (4 if self.a_k_fast else 1)

    def short_elems(self) -> tuple[int, int]:
        """Elements of the short-sum kernel's shared memory: A's tile (``bm`` rows at
        :meth:`short_pitch`, k fastest, read into fragments once) and one stage of B's chunk
        (along the direction B is loaded, with a pitch of 4 mod 16 doubles as :meth:`pitches`)."""
        chunk = 8 * self.mma_n
        return self.bm * self.short_pitch(), (self.bk * (chunk + 4) if self.b_n_fast else chunk * (self.bk + 4))

    def chunk(self) -> int:
        """Columns of C a short-sum or bulk-copy block computes per B chunk (a short-sum block has
        one warp along n)."""
        return 8 * self.mma_n * self.warps_n

    def bulk_pitches(self) -> tuple[int, int]:
        """Shared-memory row pitches (elements) of the bulk-copy kernel's A tile (k fastest) and
        B chunk (n fastest): 4 or 12 mod 16 doubles, so that the 8 rows × 4 columns of a
        fragment read fall on distinct banks twice over (two wavefronts); even, so that every
        row of B starts on 16 bytes as a bulk copy's destination must."""
        return tuple(x + 4 if x % 8 == 0 else x + 8 for x in (self.bk, self.chunk()))

    def bulk_elems(self) -> tuple[int, int]:
        """Elements of the bulk-copy kernel's shared memory: A's tile (``bm`` rows) and one stage of
        B's chunk (``bk`` rows), at :meth:`bulk_pitches`."""
        pa, pb = self.bulk_pitches()
        return self.bm * pa, self.bk * pb

    def smem_bytes(self) -> int:
        """Dynamic shared memory (bytes): the pipeline's stages, or the staged epilogue's tiles
        (one ``rows × stage_pitch`` tile per warp, in the same memory once the pipeline is done)
        if larger; a short-sum kernel's A tile and B stages (:meth:`short_elems`)."""
        if self.span:
            a, b = self.bulk_elems() if self.bulk else self.short_elems()
            return (a + self.stages * b) * ELEM
        pipeline = self.stages * sum(self.stage_elems()) * ELEM
        epilogue = self.warps_m * self.warps_n * self.rows * self.stage_pitch() * ELEM if self.staged else 0
        return max(pipeline, epilogue)

    def valid(self, arch: int = 90) -> bool:
        """Whether the cooperative loads divide evenly, a staged epilogue's lanes cover a warp's
        rows (its width, ``8·mma_n``, divides 32 or is a multiple of it), turned loads
        (:attr:`turn`) have B loaded along n in whole groups of ``LINE · turn`` columns, and the
        shape and shared memory exist on compute capability ``arch`` (e.g. 90 for sm_90; FP64 MMA
        needs 80 or newer)."""
        if self.span:
            return self.bulk_valid(arch) if self.bulk else self.short_valid(arch)
        if arch < 80 or (arch < 90 and self.mma in SM90_SHAPES):
            return False
        t = self.threads
        a_run = self.bk if self.a_k_fast else self.bm
        b_run = self.bn if self.b_n_fast else self.bk
        # 512 threads leave 128 registers each: too few for m16n8k8's larger fragments (spills);
        # so do 16 m16n8k8 tiles a warp (64 accumulators and 24 fragment doubles a lane) beside
        # the prefetched k offsets, with any number of threads
        heavy = self.kstep == 8 and (t > 256 or self.mma_m * self.mma_n >= 16)
        # the staged epilogue's lanes store whole rows of a warp's tile: 32 / width rows at once,
        # or width / 32 elements a lane
        width = self.mma_n * 8
        stageable = 32 % width == 0 or width % 32 == 0
        turned = not self.turn or (self.b_n_fast and self.bn % (LINE * self.turn) == 0)
        return (self.mma in MMA_SHAPES and not heavy and (stageable or not self.staged) and turned
                and t % a_run == 0 and t % b_run == 0
                and (self.bm * self.bk) % t == 0 and (self.bn * self.bk) % t == 0
                and self.bk % self.kstep == 0 and self.smem_bytes() <= smem_limit(arch))

    def short_valid(self, arch: int = 90) -> bool:
        """Whether a short-sum configuration exists on compute capability ``arch``: one warp
        along n, m16n8k4 MMAs (sm_90), no staged epilogue and no turned loads, a sum of at most :data:`SHORT_SUM` in
        whole MMA steps held in at most :data:`FRAGMENT_REGISTERS` registers a lane, a span of
        whole chunks, two or more stages, shared memory within the block's limit."""
        return (arch >= 90 and self.mma == "m16n8k4" and self.warps_n == 1 and not self.staged and not self.turn
                and 0 < self.bk <= SHORT_SUM and self.bk % 4 == 0 and self.mma_m * self.bk <= FRAGMENT_REGISTERS
                and self.span % (8 * self.mma_n) == 0 and self.stages >= 2 and self.smem_bytes() <= smem_limit(arch))

    def bulk_valid(self, arch: int = 90) -> bool:
        """Whether a bulk-copy configuration exists on compute capability ``arch``: the tensor
        memory accelerator's bulk copies and m16n8k4 MMAs (sm_90), one warp along m, B loaded
        along n, no staged epilogue and no turned loads, a sum in whole MMA steps up to :data:`BULK_SUM`, at most
        :data:`BULK_ACCUMULATORS` a lane, a chunk of ``copies`` (up to :data:`BULK_COPIES`) equal
        runs of an even number of columns (whole 16-byte copies), a span of whole chunks, at most
        :data:`BULK_CHUNKS`, two or more stages, its dynamic and static shared memory together
        within the block's limit."""
        return (arch >= 90 and self.mma == "m16n8k4" and self.warps_m == 1 and self.b_n_fast and not self.staged
                and not self.turn
                and 0 < self.bk <= BULK_SUM and self.bk % 4 == 0 and 4 * self.mma_m * self.mma_n <= BULK_ACCUMULATORS
                and 0 < self.copies <= BULK_COPIES and self.chunk() % (2 * self.copies) == 0
                and 0 < self.span <= BULK_CHUNKS * self.chunk() and self.span % self.chunk() == 0
                and self.stages >= 2 and self.smem_bytes() + self.bulk_static_bytes() <= smem_limit(arch))

    def bulk_static_bytes(self) -> int:
        """Static shared memory (bytes) of the bulk-copy kernel beside :meth:`smem_bytes`: B's row
        offsets (``bk``) and its runs' first columns' (``copies`` a chunk), in the index type, and
        two mbarriers a stage, each array rounded up to 16 bytes (an upper bound of what ptxas
        lays out; the block's limit holds dynamic and static shared memory together)."""
        whole = lambda n: -(-n // 16) * 16
        index = 8 if self.wide else 4
        return (whole(self.bk * index) + whole(self.span // self.chunk() * self.copies * index)
                + whole(2 * self.stages * 8))

    def name(self) -> str:
        if self.bulk:
            return (f"chainexec_bulk_w{self.warps_n}_t{self.mma_m}x{self.mma_n}_k{self.bk}_n{self.span}"
                    f"_s{self.stages}_{'ak' if self.a_k_fast else 'am'}bn" + (f"_c{self.copies}" if self.copies > 1 else "")
                    + ("_i64" if self.wide else ""))
        if self.span:
            return (f"chainexec_shortsum_w{self.warps_m}_t{self.mma_m}x{self.mma_n}_k{self.bk}_n{self.span}"
                    f"_s{self.stages}_{'ak' if self.a_k_fast else 'am'}{'bn' if self.b_n_fast else 'bk'}"
                    + ("_i64" if self.wide else ""))
        return (f"chainexec_gett_w{self.warps_m}x{self.warps_n}_t{self.mma_m}x{self.mma_n}_{self.mma}"
                f"_k{self.bk}_s{self.stages}_{'ak' if self.a_k_fast else 'am'}{'bn' if self.b_n_fast else 'bk'}"
                + (f"_l{self.turn}" if self.turn else "") + ("_st" if self.staged else "")
                + ("_i64" if self.wide else ""))


RASTER = 8
"""Block rows per raster group: consecutive blocks walk the block rows of a group of RASTER
(the last group fewer) fastest, then the block columns, so the blocks that read one column tile
of B run together and all but the first find it in L2 (and a group's RASTER row tiles of A stay
there while its columns pass); with M of one or two tiles, as in the AO→MO transforms (M = 72),
B is read from DRAM once, not once per block row (the grouped ordering of Triton's matmul
tutorial)."""


TILES = ((2, 2, 4, 4, 16), (2, 2, 4, 4, 8), (2, 4, 4, 4, 16), (4, 2, 4, 4, 16), (2, 2, 8, 4, 16),
         (2, 2, 2, 8, 16), (4, 4, 4, 4, 16), (2, 2, 4, 4, 32), (1, 2, 4, 4, 8), (2, 2, 2, 4, 8),
         (2, 2, 2, 4, 16), (2, 2, 2, 4, 32), (1, 4, 6, 4, 16))
"""Candidate (warps_m, warps_n, mma_m, mma_n, bk) in units of 8-row MMA tiles: 32×64 to 128×128
block tiles, and 48×128 (four warps of three m16 tiles, all of M = 48 in one block row, as TCCG's
ML cases at twice its extents); bk 8 for short sums, 32 for long ones. The 32×64 tiles (two or four warps) keep
more blocks resident per SM: the memory-bound contractions (short sums, or outputs too small to
fill the SMs with larger tiles) are bound by the latency of each block's loads and stores, not
by the DRAM rate the model assumes."""


@dataclass(frozen=True)
class Problem:
    """One contraction on concrete strided operands, flattened to GETT form.

    ``swap``: the caller's A and B were exchanged (B must hold C's stride-1 index). ``m, n, k, l``
    are the index names of each group in table order (last = fastest), ``sizes`` their extents.
    ``runs``: elements contiguous in memory along the direction C is stored and A and B are
    loaded (for the cost model). ``blocked``: (group, x, y, run, width) for each group whose
    table order interleaves two tensors' stride-1 indices (:func:`offsets`): ``x`` the
    group's last index, ``y`` the other tensor's stride-1 index, ``run`` the elements of ``x`` a
    block walks (:data:`BLOCK`, or :data:`C_RUN` for C's index where the sum is short),
    ``width`` those of ``y`` (:data:`BLOCK`, or :data:`LINE` in the ``store-line`` order's N,
    :attr:`turn`). ``wide``:
    some element offset or extent reaches :data:`NARROW` (2^31 less a margin), so the kernel
    indexes in 64 bits. ``bulk_run``: where B is loaded along an unblocked N, the elements of B
    contiguous along N in table order (the trailing indices of N whose strides chain from 1),
    and every other stride of B even, so that chunks of an even number of columns that divide it
    are contiguous and start on 16 bytes past B's base (the bulk-copy kernel,
    :mod:`chainexec.kernels.bulk`); else 0. Tables are
    element offsets (int64 where ``wide``, else int32), built by :func:`tables`."""

    m: tuple[str, ...]
    n: tuple[str, ...]
    k: tuple[str, ...]
    l: tuple[str, ...]
    sizes: dict
    swap: bool
    a_k_fast: bool
    b_n_fast: bool
    runs: tuple[int, int, int]
    blocked: tuple[tuple[str, str, str, int, int], ...] = ()
    wide: bool = False
    bulk_run: int = 0

    @property
    def turn(self) -> int:
        """C's run in N's blocks of a line of B's stride-1 index (:attr:`GettConfig.turn` of the
        configurations that load them transposed), or 0 where N has no such blocks."""
        return next((run for group, _, _, run, width in self.blocked if group == "n" and width == LINE), 0)

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """Flattened (M, N, K, L) extents."""
        return tuple(math.prod(self.sizes[i] for i in g) for g in (self.m, self.n, self.k, self.l))

    def flops(self) -> int:
        return 2 * math.prod(self.dims)


def _fastest(strides: dict, group) -> str | None:
    """The index of ``group`` with the smallest stride (extent-1 indices included last)."""
    return min(group, key=lambda i: strides[i]) if group else None


def _ordered(group, strides: dict) -> tuple[str, ...]:
    """``group`` by decreasing stride in one tensor: the last index is that tensor's fastest."""
    return tuple(sorted(group, key=lambda i: -strides[i]))


ORDERS = ("load", "store", "store-n", "store-line")
"""How a problem orders its M and N groups: ``load`` puts each operand's stride-1 index last
(coalesced loads), ``store`` follows C's strides (coalesced stores), ``store-n`` orders N by C
and M by A, ``store-line`` as ``store`` with N, where it interleaves C's and B's stride-1
indices, in blocks of a 128-byte line of B's (:data:`LINE`) that the kernel loads transposed
(:attr:`GettConfig.turn`; the same problem as ``store`` elsewhere). C is stored along N, so
``store-n`` keeps C's runs along N whole while A's tile is read along A's own stride-1 index;
where C interleaves A's and B's indices, as the (T) outputs do, ``store`` reads A in scattered
elements. (M by C with N by B stores C across its runs.) Which wins depends on how often the
operands are re-read against how much C is written, so the distinct ones are offered to the
autotuner (:func:`variants`)."""


def _run(strides: dict, group, sizes: dict) -> int:
    """Elements contiguous in memory along the last index of ``group`` (1 unless stride 1)."""
    if not group or strides[group[-1]] != 1:
        return 1
    return sizes[group[-1]]


def problem(c: tuple, a: tuple, b: tuple, sizes: dict, strides: tuple[dict, dict, dict],
            order: str = "load") -> Problem:
    """Flatten ``C[c] = sum A[a] B[b]`` for operands with ``strides`` (elements per index, one
    dict per tensor C, A, B), the M and N groups in ``order`` (:data:`ORDERS`). Each operand
    is loaded along whichever of its two groups has the smaller stride at its last index, B
    along the group holding its stride-1 index wherever that group is blocked with it
    (:attr:`Problem.blocked`). Raises ValueError for an index in one tensor only or repeated in
    one tensor."""
    for name, idx in (("C", c), ("A", a), ("B", b)):
        if len(set(idx)) != len(idx):
            raise ValueError(f"repeated index in {name}[{','.join(idx)}]")
    for i in set(c) | set(a) | set(b):
        if (i in c) + (i in a) + (i in b) < 2:
            raise ValueError(f"index {i!r} appears in one tensor only")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}")
    sc, sa, sb = strides
    ext = [i for i in c if sizes[i] > 1] or list(c)
    fvi = _fastest(sc, [i for i in ext if not (i in a and i in b)])
    swap = fvi is not None and fvi in a
    if swap:
        a, b, sa, sb = b, a, sb, sa
    lg = [i for i in c if i in a and i in b]
    mg = [i for i in c if i in a and i not in b]
    ng = [i for i in c if i in b and i not in a]
    kg = [i for i in a if i in b and i not in c]
    a_fast = _fastest(sa, [i for i in mg + kg if sizes[i] > 1] or mg + kg)
    k = _ordered(kg, sa if a_fast in kg else sb)
    m = _ordered(mg, sc if order in ("store", "store-line") or a_fast in kg else sa)
    b_fast = _fastest(sb, [i for i in ng + kg if sizes[i] > 1] or ng + kg)
    n = _ordered(ng, sb if order == "load" and b_fast not in kg else sc)

    def last(strides_, group):
        return strides_[group[-1]] if group else math.inf

    def reach(group, blockable):
        """B's smallest stride along ``group`` as loaded: 1 where B's stride-1 index is in it,
        last or interleaved with the group's last index (``blockable``), else its last's."""
        if b_fast in group and sb[b_fast] == 1 and (group[-1] == b_fast or blockable):
            return 1
        return last(sb, group)

    a_k_fast = last(sa, k) < last(sa, m)
    # the group B is loaded along may be blocked with the index A (K) or C (N) reads it along:
    # where that tensor's stride-1 index is the group's last
    blockable = {"k": a_k_fast and bool(k) and sa[k[-1]] == 1, "n": bool(n) and sc[n[-1]] == 1}
    b_n_fast = reach(n, blockable["n"]) <= reach(k, blockable["k"])
    runs = [_run(sc, n, sizes), _run(sa, k if a_k_fast else m, sizes), _run(sb, n if b_n_fast else k, sizes)]
    # A group read (or written) along itself by two tensors whose stride-1 indices differ is
    # enumerated in blocks of those two indices, so that both read whole sectors: BLOCK × BLOCK,
    # or C_RUN of C's index by BLOCK of B's where C is written at the rate of its runs (a
    # short sum: short-sum kernels, :data:`C_RUN`).
    blocked = []
    name, group = ("n", n) if b_n_fast else ("k", k)
    y = _fastest(sb, [i for i in group if sizes[i] > 1])
    if blockable[name] and y is not None and y != group[-1] and sb[y] == 1:
        run = C_RUN if name == "n" and math.prod(sizes[i] for i in k) <= SHORT_TUNED else BLOCK
        width = LINE if name == "n" and order == "store-line" else BLOCK
        blocked.append((name, group[-1], y, run, width))
        other = 0 if name == "n" else 1  # C's run along N, or A's along K
        runs[other], runs[2] = min(runs[other], run), min(sizes[y], width)
    farthest = max(sum((sizes[i] - 1) * abs(st[i]) for i in st) for st in (sc, sa, sb))
    wide = max(farthest, *(math.prod(sizes[i] for i in g) for g in (m, n, k, lg))) >= NARROW
    bulk_run = _contiguous_run(n, sb, sizes) if b_n_fast and not blocked else 0
    return Problem(m=m, n=n, k=k, l=tuple(lg), sizes=dict(sizes), swap=swap, a_k_fast=a_k_fast,
                   b_n_fast=b_n_fast, runs=tuple(runs), blocked=tuple(blocked), wide=wide, bulk_run=bulk_run)


def _contiguous_run(n: tuple, strides: dict, sizes: dict) -> int:
    """Elements of a tensor with ``strides`` contiguous along the trailing indices of ``n`` (in
    table order) whose strides chain from 1 (extent-1 indices skipped); 0 where one of its other
    strides is odd, so that a run's even-sized pieces start on 16 bytes."""
    run, merged = 1, set()
    for i in reversed(n):
        if sizes[i] == 1:
            merged.add(i)
        elif strides[i] == run:
            run *= sizes[i]
            merged.add(i)
        else:
            break
    odd = any(strides[i] % 2 for i in strides if i not in merged and sizes[i] > 1)
    return 0 if odd or run == 1 else run


def variants(c: tuple, a: tuple, b: tuple, sizes: dict, strides: tuple[dict, dict, dict]) -> dict[str, Problem]:
    """Order -> problem for the distinct problems of :data:`ORDERS` (one to four)."""
    out: dict[str, Problem] = {}
    for order in ORDERS:
        p = problem(c, a, b, sizes, strides, order)
        if p not in out.values():
            out[order] = p
    return out


def packed_orders(c: tuple, a: tuple, b: tuple) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Index orders of A and B for the packed GETT (copies made before the kernel runs): each
    operand's batch indices (those of all three tensors) first, in C's order, then its summed
    indices in the order A lists them, then its other free indices in C's order (stride-1 last).
    Each group of each copy is then one run of a single stride, its free group of stride 1, and
    the group's table order, whichever of :data:`ORDERS` a problem takes, follows C's own: the
    (T) outputs, whose A and B interleave their stride-1 indices with C's, are read in whole
    lines along every group."""
    batch = [i for i in c if i in a and i in b]
    summed = list(dict.fromkeys(i for i in (*a, *b) if i not in c))
    return tuple(tuple(batch + [i for i in summed if i in x] + [i for i in c if i in x and i not in batch])
                 for x in (a, b))


BLOCK = SECTOR // ELEM
"""Elements per side of an interleaved group's blocks (:func:`offsets`): one sector."""
LINE = 128 // ELEM
"""Elements of B's stride-1 index in the ``store-line`` order's blocks: one 128-byte cache line
(:attr:`GettConfig.turn`)."""
C_RUN = 2 * BLOCK
"""Elements of C's stride-1 index an interleaved N group walks before B's where the sum is
short (at most :data:`SHORT_TUNED`): two sectors, so that each row of a short-sum kernel's
store instruction (8 columns) is one 64-byte piece of a line, not two sectors of two lines:
C written in sector-sized pieces scattered over lines does not reach the write rate of whole
lines. B's reads along the group, from L2 for a short sum, stay a sector each. Elsewhere the
tiled kernels, whose tiles are read in BLOCK × BLOCK blocks, keep :data:`BLOCK`."""


def offsets(group, sizes: dict, strides: dict, blocked: tuple[str, str, int, int] | None = None,
            dtype=np.int64) -> np.ndarray:
    """The element offset, in a tensor with ``strides`` (elements per index), of every
    multi-index of ``group`` in table order, as an array of ``dtype`` (which must hold every
    partial sum of offsets: int32 only below :data:`NARROW`). Row-major over ``group``; with
    ``blocked = (x, y, run, width)``, the other indices stay outermost in their order, then come
    ``y // width``, ``x // run``, ``y % width``, ``x % run``: consecutive positions walk ``x`` in
    runs of up to ``run`` and, over ``width`` runs, ``y`` in runs of up to ``width``, so a tensor
    whose stride-1 index is ``x`` and one whose stride-1 index is ``y`` both read whole sectors
    of a tile (a sum is indifferent to the order of its terms; C's rows and columns are
    addressed through the tables). Each digit of that mixed-radix order adds its step times its
    value along one more axis of an outer sum, so a table of N offsets costs a few passes over N
    elements; where a block is ragged the padded positions are dropped."""
    axes = [(sizes[i], strides[i]) for i in group]
    valid = None
    if blocked is not None:
        x, y, run, width = blocked
        width, run = min(width, sizes[y]), min(run, sizes[x])  # the same order, less padding
        ys, xs = -(-sizes[y] // width), -(-sizes[x] // run)
        axes = [(sizes[i], strides[i]) for i in group if i not in (x, y)]
        axes += [(ys, strides[y] * width), (xs, strides[x] * run), (width, strides[y]), (run, strides[x])]
        if sizes[y] % width or sizes[x] % run:
            in_y = np.arange(ys)[:, None] * width + np.arange(width) < sizes[y]
            in_x = np.arange(xs)[:, None] * run + np.arange(run) < sizes[x]
            valid = (in_y[:, None, :, None] & in_x[None, :, None, :]).ravel()
    out = np.zeros(1, dtype=dtype)
    for radix, step in axes:
        # a digit of one value adds nothing (its step may exceed the dtype: an extent-1 index)
        out = (out[:, None] + (step if radix > 1 else 0) * np.arange(radix, dtype=dtype)).ravel()
    return out if valid is None else out.reshape(-1, valid.size)[:, valid].ravel()


def tables(p: Problem, strides: tuple[dict, dict, dict]) -> dict[str, np.ndarray]:
    """The nine offset tables of ``p`` for the caller's (C, A, B) ``strides``: keys
    ``am ak al bk bn bl cm cn cl`` (A and B as in the kernel, i.e. after ``p.swap``), each the
    element offset of every multi-index of its group in table order (:func:`offsets`)."""
    sc, sa, sb = strides
    if p.swap:
        sa, sb = sb, sa
    blocked = {g: tuple(rest) for g, *rest in p.blocked}
    groups = {"m": p.m, "n": p.n, "k": p.k, "l": p.l}
    tensors = {"a": sa, "b": sb, "c": sc}
    dtype = np.int64 if p.wide else np.int32
    return {key: offsets(groups[key[1]], p.sizes, tensors[key[0]], blocked.get(key[1]), dtype)
            if groups[key[1]] else np.zeros(1, dtype=dtype) for key in TABLE_ORDER}


TABLE_ORDER = ("am", "ak", "al", "bk", "bn", "bl", "cm", "cn", "cl")
"""Order of the table pointers in the kernel's signature."""
NARROW = 2**31 - 2**16
"""Offsets and extents below this fit the 32-bit index type (:attr:`Problem.wide`): the kernel
computes indices up to a few tiles past an extent (at most 2^16 elements), which must not wrap."""
INDEX = {False: "int", True: "long long"}
"""CUDA type of offsets and extents, by :attr:`GettConfig.wide`."""


def configs(p: Problem, stages: int = 3, arch: int = 90) -> list[GettConfig]:
    """Every configuration of :data:`TILES` × :data:`MMA_SHAPES` for ``p``'s load directions
    (and turned loads of B, :attr:`Problem.turn`) that is valid on compute capability ``arch``."""
    out = []
    for (wm, wn, mm, mn, bk), shape in itertools.product(TILES, MMA_SHAPES):
        rows = MMA_SHAPES[shape][0]
        if mm * 8 % rows == 0:
            cfg = GettConfig(wm, wn, mm * 8 // rows, mn, bk, stages, shape, p.a_k_fast, p.b_n_fast, wide=p.wide,
                             turn=p.turn)
            if cfg.valid(arch):
                out.append(cfg)
    return out


TIER = 1.03
"""Predictions within this factor of each other rank as equal (:func:`candidates`)."""


def _rank(p: Problem, cfg: GettConfig, sm_count: int) -> tuple[int, float]:
    """Ranking key of a configuration: its predicted time's :data:`TIER` (so that predictions
    the roofline cannot tell apart, as for every memory-bound configuration of one order, tie),
    then the summed range padded to whole k-tiles over the range (a k-tile of padding is a
    load round trip and MMAs for nothing)."""
    K = max(p.dims[2], 1)
    return (math.floor(math.log(predicted_seconds(p, cfg, sm_count)) / math.log(TIER)),
            -(-K // cfg.bk) * cfg.bk / K)


def candidates(problems: dict[str, Problem], sm_count: int, top: int = 3,
               arch: int = 90) -> list[tuple[str, GettConfig]]:
    """The (order, configuration) pairs the autotuner times for ``problems`` (:func:`variants`)
    on compute capability ``arch``: the ``top`` the model ranks best (:func:`_rank`), the best of
    every order among them; then the best-ranked of every k-tile depth (bk) and of every block
    shape (rows, columns, threads) not among those, no larger than the best's block tile, since
    which of the ties is fastest depends on latency and occupancy the roofline does not see
    (smaller tiles keep more blocks resident); where none of these holds all of M in one block
    row, the best-ranked one-row configuration (:func:`row_configs`) of each order whose best
    ranks in the first tier, since each block row loads B's tiles again, which the model's DRAM
    bytes do not count (a second row finds them in L2) but the loads' shared-memory traffic,
    the ML cases' bound, does; then, of each first-tier order, the :data:`TIE_PICKS` first-tier
    configurations of at most :data:`TIE_WARPS` warps that move the fewest bytes between L2 and
    the SMs (:func:`l2_bytes`), which the roofline's DRAM bytes do not see and which the
    times of ties with long sums follow (the AO→MO and ML cases at twice TCCG's extents, whose
    ties the names break towards two-warp 32×64 tiles); then the staged-epilogue twin of each
    (:attr:`GettConfig.staged`) where its shared memory fits. The model cannot tell the two
    epilogues apart (both store whole sectors; what differs is the number of store instructions
    and their order), the timing can. Last, for a short sum, the short-sum kernels of every order
    (:func:`short_configs`), bound by writing C, and where B's chunks are contiguous the
    bulk-copy kernels (:func:`bulk_configs`), neither of which the model ranks: the timing
    decides.
    Empty where the device has no FP64 MMA (before sm_80)."""
    ranked = sorted(((_rank(p, cfg, sm_count), order, cfg.name(), cfg)
                     for order, p in problems.items() for cfg in configs(p, arch=arch)), key=lambda x: x[:3])
    if not ranked:
        return []
    firsts = [next(x for x in ranked if x[1] == order) for order in problems]
    rest = [x for x in ranked if x not in firsts]
    best = sorted(firsts + rest[:max(0, top - len(firsts))], key=lambda x: x[:3])
    area = best[0][3].bm * best[0][3].bn
    for shape in (lambda c: c.bk, lambda c: (c.bm, c.bn, c.threads)):
        for x in ranked:
            if all(shape(x[3]) != shape(y[3]) for y in best) and x[3].bm * x[3].bn <= area:
                best.append(x)
    tier = ranked[0][0][0]
    M = next(iter(problems.values())).dims[0]
    if all(x[3].bm < M for x in best):
        for order, p in problems.items():
            if next(x for x in ranked if x[1] == order)[0][0] == tier:
                best += sorted(((_rank(p, cfg, sm_count), order, cfg.name(), cfg) for cfg in row_configs(p, arch)),
                               key=lambda x: x[:3])[:1]
    for order, p in problems.items():
        near = sorted((key, l2_bytes(p, cfg), name, cfg) for key, o, name, cfg in ranked
                      if o == order and key[0] == tier and cfg.warps_m * cfg.warps_n <= TIE_WARPS)
        taken = {(y[1], y[2]) for y in best}
        best += [(key, order, name, cfg) for key, _, name, cfg in near[:TIE_PICKS] if (order, name) not in taken]
    chosen = [(x[1], x[3]) for x in best]
    twins = [(order, replace(cfg, staged=True)) for order, cfg in chosen]
    return (chosen + [(order, cfg) for order, cfg in twins if cfg.valid(arch)]
            + [(order, cfg) for order, p in problems.items() for cfg in short_configs(p, arch)]
            + [(order, cfg) for order, p in problems.items() for cfg in bulk_configs(p, sm_count, arch)])


TIE_WARPS = 4
"""Most warps of a block among the configurations :func:`candidates` adds by their L2 bytes
(:func:`l2_bytes`): the fewest L2 bytes come with the largest tiles, whose blocks are too few
an SM to hide their latency; up to four warps, the ties' times follow the L2 bytes."""
TIE_PICKS = 2
"""Configurations of each first-tier order :func:`candidates` adds by their L2 bytes."""


def l2_bytes(p: Problem, cfg: GettConfig) -> float:
    """Bytes the blocks of ``cfg`` move between L2 and the SMs on ``p``: every block loads its
    ``bm × bk`` tile of A and ``bk × bn`` tile of B for each k-tile, from L2 whether the line is
    there or comes from DRAM (padding included, each stream inflated by the sectors its access
    pattern wastes, as :func:`predicted_seconds`' DRAM bytes), and C is written once. Smaller
    tiles read the operands more often: ``K·(M·tn + N·tm)`` elements against the DRAM bytes'
    ``M·K + K·N``."""
    M, N, K, L = p.dims
    (tm, tn, tk), (amp_c, amp_a, amp_b) = _tiles(p, cfg), _waste(p, cfg)
    return ELEM * L * (tm * tn * tk * cfg.bk * (cfg.bm * amp_a + cfg.bn * amp_b) + M * N * amp_c)


SHORT_TILES = ((4, 1, 4, 512, 2), (4, 1, 4, 128, 2), (8, 1, 4, 128, 2), (8, 1, 8, 256, 3), (4, 2, 16, 256, 2),
               (8, 1, 8, 768, 3), (8, 1, 8, 256, 2))
"""Short-sum shapes the autotuner times where the sum is short enough (:func:`short_configs`):
(warps, m16 tiles a warp, n8 tiles a chunk, columns a block, stages). One m16 tile and a chunk of
32 columns a warp hold the fewest registers a lane; the two spans suit outputs with many columns
(fewer re-reads of A's tile) and with few (more blocks); eight warps share each chunk of B among
twice the rows, which some index orders of the (T) outputs reward and others do not. Where B's
chunk rows are contiguous (packed operands, :func:`packed_orders`), its gathers cost little and
wider chunks win: 64 columns for eight warps of one m16 tile, or 128 for four warps of two,
over a span of 256 columns; a
span of 768 columns where C's rows lie apart and its columns run long (the (T) outputs whose
stride-1 index comes from A: rows 384 elements apart, columns 384 contiguous). The 64-column
chunks come in two stages and in three: at a sum of 48 a stage is twice as tall as at 24, and
two of them leave room for more blocks an SM."""

SHORT_TUNED = 24
"""Longest sum (elements) for which the autotuner times short-sum kernels on any problem, and
for which C's runs are blocked for them (:data:`C_RUN`). Past it the pipelined GETT kernels are
faster where B's chunk rows are gathered (``benchmarks/results/``): their k-loop amortizes its
loads over the sum, while a short-sum warp's unrolled sum grows its registers. Where each row of
B's chunks is one contiguous run (:attr:`Problem.bulk_run`, packed operands) the gathers cost
little and short-sum kernels are timed up to :data:`SHORT_SUM`."""


def short_configs(p: Problem, arch: int = 90) -> list[GettConfig]:
    """The short-sum configurations (:attr:`GettConfig.span`) of :data:`SHORT_TILES` valid for
    ``p`` on compute capability ``arch``: each holds ``p``'s whole sum, rounded up to whole MMA
    steps, at most :data:`SHORT_TUNED`, or :data:`SHORT_SUM` (:meth:`GettConfig.short_valid`)
    where each row of B's chunks is one contiguous run (:attr:`Problem.bulk_run` whole chunks: B
    contiguous along N, its other strides even). None where B's blocks are for turned loads
    (:attr:`Problem.turn`), which only the pipelined kernel makes."""
    if p.turn:
        return []
    K = p.dims[2]
    bk = max(4, -(-K // 4) * 4)
    out = [GettConfig(w, 1, mm, mn, bk, st, "m16n8k4", p.a_k_fast, p.b_n_fast, wide=p.wide, span=span)
           for w, mm, mn, span, st in SHORT_TILES
           if K <= SHORT_TUNED or (p.bulk_run and p.bulk_run % (8 * mn) == 0)]
    return [cfg for cfg in out if cfg.valid(arch)]


BULK_TILES = ((8, 2, 2), (8, 1, 4), (9, 2, 2), (9, 1, 4))
"""Bulk-copy shapes the autotuner times where they apply (:func:`bulk_configs`): (warps along n,
n8 tiles a warp, stages). Eight or nine warps a block, the only block of its SM (A's tile and
B's stages fill its shared memory): chunks of 128 or 64 columns, or of 144 or 72, whole runs of
the AO→MO transforms' extents of 72."""
BULK_COPIES = 4
"""Most bulk copies a row of a chunk takes (:attr:`GettConfig.copies`): each copy at least a
quarter of the chunk, so that the copying warp's issue keeps pace with the computing warps."""
BULK_WAVES = (1, 2)
"""Waves of blocks over the SMs a bulk-copy kernel's span is sized for (:func:`bulk_configs`):
one block an SM reads A's tile once and has no tail; two leave the SMs that finish first less
idle time at the end."""
BULK_ROWS = 6
"""Largest M (in m16 tiles: 96 rows) for which :func:`bulk_configs` offers the one-row shapes of
:data:`BULK_TILES`, a warp holding all of M; past it, the tall shapes of :data:`BULK_TALL`."""
BULK_TALL = ((8, 8, 1), (4, 4, 1))
"""Bulk-copy shapes the autotuner times where M is more than :data:`BULK_ROWS` m16 tiles (the
(T) outputs on packed operands, :func:`packed_orders`: many block rows): (warps along n, m16
tiles a warp, n8 tiles a warp), two stages, spans of :data:`BULK_TALL_CHUNKS` chunks. A warp
of 128 or 64 rows reads each of B's fragments for eight or four MMAs, where the short-sum kernel
reads it for one, and B's chunks arrive by bulk copies instead of one cp.async an element: at
sums of 48 (the (T) cases at twice TCCG's extents) these are the faster kernels,
at 24 the short-sum ones (``benchmarks/results/``)."""
BULK_TALL_CHUNKS = 8
"""Chunks a block of a tall bulk-copy shape (:data:`BULK_TALL`) walks: its A tile, loaded once,
serves that many chunks of B."""


def bulk_copies(bulk_run: int, n: int, chunk: int) -> int:
    """Bulk copies a row of a chunk of ``chunk`` columns of B takes, where B's elements are
    contiguous along N in runs of ``bulk_run`` (:attr:`Problem.bulk_run`) and N is ``n``: one where
    a run holds whole chunks; ``chunk // bulk_run`` (at most :data:`BULK_COPIES`) where a chunk is
    whole runs and N whole chunks, each run its own copy from where its first column lies; else 0,
    where no bulk-copy kernel of that chunk applies."""
    if bulk_run and bulk_run % chunk == 0:
        return 1
    if bulk_run and chunk % bulk_run == 0 and n % chunk == 0 and chunk // bulk_run <= BULK_COPIES:
        return chunk // bulk_run
    return 0


def bulk_configs(p: Problem, sm_count: int, arch: int = 90) -> list[GettConfig]:
    """The bulk-copy configurations (:attr:`GettConfig.bulk`) for ``p`` on compute capability
    ``arch``, where B's chunks are contiguous or whole runs (:func:`bulk_copies`), the sum fits
    and C's runs along n take a lane group's 8 columns whole (a kernel that reads B in whole rows
    and writes C in scattered elements is bound by the writes). Where one block row holds all of
    M (at most :data:`BULK_ROWS` m16 tiles: A is read once per block), the shapes of
    :data:`BULK_TILES`, each with a span of whole chunks that makes :data:`BULK_WAVES` waves of
    blocks over ``sm_count`` SMs, at most :data:`BULK_CHUNKS` chunks; elsewhere those of
    :data:`BULK_TALL`, over spans of :data:`BULK_TALL_CHUNKS` chunks (fewer where N is
    shorter), the block rows filling the waves."""
    M, N, K, L = p.dims
    if not p.bulk_run or p.runs[0] < 8:
        return []
    bk = max(4, -(-K // 4) * 4)
    tall = M > 16 * BULK_ROWS
    shapes = ([(w, mm, mn, 2, None) for w, mm, mn in BULK_TALL] if tall else
              [(w, -(-M // 16), mn, st, waves) for (w, mn, st), waves in itertools.product(BULK_TILES, BULK_WAVES)])
    out = []
    for w, mm, mn, st, waves in shapes:
        chunk = 8 * mn * w
        # tall: the block rows fill the waves; one row: a batch's columns spread over them
        chunks = (min(BULK_TALL_CHUNKS, -(-N // chunk)) if tall
                  else min(BULK_CHUNKS, max(1, -(-(-(-N // chunk) * L) // (sm_count * waves)))))
        copies = bulk_copies(p.bulk_run, N, chunk)
        cfg = GettConfig(1, w, mm, mn, bk, st, "m16n8k4", p.a_k_fast, p.b_n_fast, wide=p.wide, span=chunk * chunks,
                         bulk=True, copies=copies)
        if copies and cfg.valid(arch) and cfg not in out:
            out.append(cfg)
    return out


SPLIT_PARTS = (2, 3, 4, 6, 8, 12, 16)
"""Parts a split sum may have (:func:`split_configs`): the workspace holds that many outputs."""
SPLIT_MIN_TILES = 8
"""K-tiles a part sums at least: fewer leave a block's pipeline mostly filling and draining."""
SPLIT_TILES = ((2, 2, 4, 4, 16), (2, 2, 2, 8, 16))
"""Block shapes (as :data:`TILES`) a split sum is offered with beside the one-row shapes
(:func:`row_configs`): 64×64 and 32×128 tiles of four warps."""
ROW_ACCUMULATORS = 20
"""m16n8 tiles a warp of a one-row shape (:func:`row_configs`) holds at most (80 accumulators a
lane)."""
ROW_SHAPES = ((4, 2, 16), (4, 4, 16), (2, 4, 8))
"""One-row block shapes (:func:`row_configs`): (warps along n, n8 tiles a warp, bk). Four warps
of 64 or 128 columns and k-tiles of 16, and two warps of 64 columns and k-tiles of 8, as the
32×64 tiles that are fastest where all of M fits in one of them (TCCG's ML cases, M = 24)."""
ROW_PADDING = 1.5
"""Most rows a one-row tile may hold per row of M (:func:`row_configs`): where A is loaded along
m the rows must divide the threads, so M = 48 takes 64 rows, but M = 72 would take 128, nearly
twice the MMAs for nothing."""


def row_configs(p: Problem, arch: int = 90) -> list[GettConfig]:
    """The one-row configurations of ``p``: for each of :data:`ROW_SHAPES` and each m16 MMA, one
    warp along m of the fewest m16 tiles that hold all of M and whose loads divide evenly among
    the block's threads (at most :data:`ROW_ACCUMULATORS` m16n8 tiles a warp and
    :data:`ROW_PADDING` rows per row of M beyond the fewest), valid on compute capability ``arch``. A is then read
    once, and B, whose tiles every block row loads into shared memory again (from L2, where the
    rows of a raster group run together), passes through the loads once: where M is a little
    more than the model's tied best tiles hold (M = 48 on 32-row tiles, TCCG's ML cases at twice
    their extents) the others load B twice."""
    M = p.dims[0]
    fewest = -(-M // 16)
    out = []
    for (wn, mn, bk), shape in itertools.product(ROW_SHAPES, ("m16n8k4", "m16n8k8")):
        for rows in range(fewest, min(ROW_ACCUMULATORS // mn, max(fewest, int(ROW_PADDING * M) // 16)) + 1):
            cfg = GettConfig(1, wn, rows, mn, bk, 3, shape, p.a_k_fast, p.b_n_fast, wide=p.wide, turn=p.turn)
            if cfg.valid(arch):
                out.append(cfg)
                break
    return out


def split_shapes(p: Problem, arch: int = 90) -> list[GettConfig]:
    """The configurations a split sum of ``p`` is timed with: the one-row shapes
    (:func:`row_configs`: A's tile is read once and each B fragment feeds every m16 tile) and the
    shapes of :data:`SPLIT_TILES` with k-tiles of 16, m16 MMAs of each k-step valid on compute
    capability ``arch``."""
    out = row_configs(p, arch)
    for (wm, wn, mm, mn, bk), shape in itertools.product(SPLIT_TILES, ("m16n8k4", "m16n8k8")):
        cfg = GettConfig(wm, wn, mm // 2, mn, bk, 3, shape, p.a_k_fast, p.b_n_fast, wide=p.wide, turn=p.turn)
        if cfg.valid(arch) and cfg not in out:
            out.append(cfg)
    return out


def split_configs(p: Problem, sm_count: int, arch: int = 90) -> list[tuple[GettConfig, int]]:
    """(configuration, parts) pairs of a split sum of ``p`` (:func:`source`'s ``parts``): for each
    of :func:`split_shapes`, where its blocks leave SMs idle, the most parts of
    :data:`SPLIT_PARTS` that give every SM at most one block, and the most that fill the blocks
    resident at once (the model's count of them), each part summing at least
    :data:`SPLIT_MIN_TILES` k-tiles. A block count between one and two waves leaves the SMs of the
    second half-empty wave idle, so the parts fill a wave and stop there. Where the output's
    blocks fill the SMs already, none; nor more parts than offsets of the index type reach
    (``parts`` outputs in the workspace)."""
    M, N, K, L = p.dims
    out = []
    for cfg in split_shapes(p, arch):
        blocks = -(-M // cfg.bm) * -(-N // cfg.bn) * L
        most = min(-(-K // cfg.bk) // SPLIT_MIN_TILES, math.inf if p.wide else (NARROW - 1) // (M * N * L))
        for room in (sm_count, sm_count * resident(cfg)):
            parts = max((s for s in SPLIT_PARTS if blocks * s <= room and s <= most), default=0)
            if parts and (cfg, parts) not in out:
                out.append((cfg, parts))
    return out


def resident(cfg: GettConfig) -> int:
    """Blocks of ``cfg`` the model lets an SM hold at once: as its shared memory and threads allow."""
    return max(1, min(SMEM_LIMIT // cfg.smem_bytes(), 2048 // cfg.threads))


def _tiles(p: Problem, cfg: GettConfig) -> tuple[int, int, int]:
    """Tiles of ``cfg`` along M, N and K of ``p`` (the last ones padded)."""
    M, N, K, _ = p.dims
    return -(-M // cfg.bm), -(-N // cfg.bn), -(-K // cfg.bk)


def _waste(p: Problem, cfg: GettConfig) -> tuple[float, float, float]:
    """Sector amplification (:func:`_amplification`) of C's stores (8 consecutive n at a time) and
    of A's and B's tile loads in the directions ``cfg`` loads them."""
    run_c, run_a, run_b = p.runs
    return (_amplification(run_c, 8), _amplification(run_a, cfg.bk if cfg.a_k_fast else cfg.bm),
            _amplification(run_b, cfg.bn if cfg.b_n_fast else cfg.bk))


def _amplification(run: int, along: int) -> float:
    """Bytes moved per useful byte for accesses whose contiguous run is ``run`` elements, of which
    ``along`` consecutive ones are touched together."""
    return max(1.0, SECTOR / (ELEM * min(run, along)))


PEAK_FLOPS = 60e12
"""FP64 tensor-core rate the model assumes (flop/s; H100 SXM peak is 67 TFLOP/s)."""
DRAM_BYTES = 3.0e12
"""DRAM bandwidth the model assumes (bytes/s; a sustained rate, below the 3.35 TB/s peak of the H100
SXM's HBM3)."""


def predicted_seconds(p: Problem, cfg: GettConfig, sm_count: int, parts: int = 1) -> float:
    """Roofline estimate that ranks configurations (the model proposes, timing decides):
    padded flops over the peak, scaled by the wave quantization of blocks over SMs, against
    DRAM traffic, each stream inflated by the sectors its access pattern wastes (C is stored 8
    consecutive n at a time): C read and written once; each B tile read once per raster group
    (:data:`RASTER`: the group's blocks that read it run together); each A tile once where a
    group's row tiles (RASTER of them, or all of M's where fewer) fit in :data:`L2_SHARE` (they
    stay in L2 while the group's columns pass), else once per block column. A sum split into ``parts`` (:func:`split_configs`) has
    that many times the blocks, and writes and reads back ``parts`` outputs besides."""
    M, N, K, L = p.dims
    (tm, tn, tk), (amp_c, amp_a, amp_b) = _tiles(p, cfg), _waste(p, cfg)
    blocks = tm * tn * L * parts
    slots = sm_count * resident(cfg)
    waves = -(-blocks // slots)
    flops = 2.0 * tm * cfg.bm * tn * cfg.bn * -(-tk // parts) * parts * cfg.bk * L
    compute = flops / PEAK_FLOPS * (waves * slots / blocks)
    reads_a = 1 if min(RASTER, tm) * cfg.bm * K * ELEM <= L2_SHARE else tn
    reads_b = -(-tm // RASTER)
    traffic = ELEM * L * (M * K * reads_a * amp_a + K * N * reads_b * amp_b + 2 * M * N * amp_c)
    if parts > 1:
        traffic += 2 * parts * ELEM * L * M * N
    return max(compute, traffic / DRAM_BYTES)


L2_SHARE = 12 * 2**20
"""Bytes of L2 the model lets a raster group's A row tiles hold (a quarter of the H100's and
H200's 50 MB, the rest for B's column tiles, C's stores and other streams)."""


def cp_async(dst: str, src: str, ok: str) -> str:
    """An 8-byte cp.async of the C expression ``src`` into the shared-memory address ``dst``,
    zero-filled where ``ok`` is false."""
    return (f'asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\\n" :: '
            f'"r"((unsigned)__cvta_generic_to_shared({dst})), "l"({src}), "r"(({ok}) ? 8 : 0));')


def _shape(cfg: GettConfig, side: str) -> tuple[str, int, int, int]:
    """(loaded direction, threads per run, run step between a thread's rows, elements per
    thread) of one operand's cooperative tile load."""
    if side == "A":
        run, fast = (cfg.bk, "k") if cfg.a_k_fast else (cfg.bm, "m")
    else:
        run, fast = (cfg.bn, "n") if cfg.b_n_fast else (cfg.bk, "k")
    return fast, run, cfg.threads // run, (cfg.bm if side == "A" else cfg.bn) * cfg.bk // cfg.threads


def _k_reads(cfg: GettConfig, side: str) -> int:
    """k offsets a thread reads per tile of one operand: one where the tile is loaded along k
    (the thread's elements share a k), else one per element."""
    fast, _, _, count = _shape(cfg, side)
    return 1 if fast == "k" else count


def _offsets(cfg: GettConfig, side: str) -> list[str]:
    """Read the k offsets of the thread's elements of k-tile ``nt`` of one operand from its
    table into registers (``k<side>[r]``, valid where ``f<side>[r]``): one where the thread's
    elements share a k (the tile is loaded along k), else one per element. A read past the
    last tile reads nothing."""
    fast, _, step, count = _shape(cfg, side)
    lo = side.lower()
    if fast == "k":
        return [f"    {{ const idx kk = nt * {cfg.bk} + {lo}_fast; f{side}[0] = kk < K; "
                f"k{side}[0] = f{side}[0] ? off{lo}k[kk] : 0; }}"]
    return ["    #pragma unroll",
            f"    for (int r = 0; r < {count}; ++r) {{",
            f"      const idx kk = nt * {cfg.bk} + {lo}_slow + r * {step};",
            f"      f{side}[r] = kk < K;",
            f"      k{side}[r] = f{side}[r] ? off{lo}k[kk] : 0;",
            "    }"]


def _copies(cfg: GettConfig, side: str) -> list[str]:
    """Per-stage cooperative cp.async of one operand tile into stage ``st`` (zero-filled outside
    the tensor), from the k offsets :func:`_offsets` read. The thread's rows/columns along the
    non-loaded direction are fixed for the whole kernel, so their offsets sit in registers
    (``o<side>[r]``)."""
    fast, _, step, count = _shape(cfg, side)
    pitch = cfg.pitches()[0 if side == "A" else 1]
    lo = side.lower()
    column = cfg.column(f"{lo}_fast") if side == "B" else f"{lo}_fast"
    dst = f"&s{side}[st * {side}_STAGE + ({lo}_slow + r * {step}) * {pitch} + {column}]"
    if fast == "k":  # rows are the fixed direction; the k offset is shared by the thread's rows
        src, ok = f"{side} + (o{side}[r] + k{side}[0])", f"f{side}[0] && v{side}[r]"
    else:
        src, ok = f"{side} + (o{side}[0] + k{side}[r])", f"f{side}[r] && v{side}[0]"
    return [f"    // {side} tile: threads along {fast}", "    #pragma unroll",
            f"    for (int r = 0; r < {count}; ++r)", "      " + cp_async(dst, src, ok)]


def _issue(cfg: GettConfig, tile: str, stage: str, pad: str) -> list[str]:
    """Start the cp.async copies of k-tile ``tile`` into shared-memory stage ``stage`` (C
    expressions; the stage is the tile modulo the stage count) from the k offsets already in
    registers, then commit the group — an empty group past the last tile, so that group counts
    stay equal to tile numbers and ``wait_group stages-1`` always means "tile t has landed"."""
    lines = ["{", f"  const idx nt = {tile};", f"  const int st = {stage};", "  if (nt < tiles) {"]
    lines += ["  " + x for x in _copies(cfg, "A") + _copies(cfg, "B")]
    lines += ["  }", '  asm volatile("cp.async.commit_group;\\n" ::);', "}"]
    return [pad + x for x in lines]


def _fetch(cfg: GettConfig, tile: str, pad: str) -> list[str]:
    """Read the k offsets of k-tile ``tile`` (a C expression) for the next :func:`_issue`."""
    return [pad + x for x in ["{", f"  const idx nt = {tile};"] + _offsets(cfg, "A") + _offsets(cfg, "B") + ["}"]]


def _setup(cfg: GettConfig, side: str) -> list[str]:
    """The thread's fixed coordinates and register offsets for loading one operand."""
    fast, run, step, count = _shape(cfg, side)
    base, bound, table = ("bm", "M", "offam") if side == "A" else ("bn", "N", "offbn")
    lo = side.lower()
    position = f"tid % {run}"
    if side == "B" and cfg.turn:  # thread i of a group of LINE·turn loads position (i % LINE)·turn + i / LINE
        group = LINE * cfg.turn
        position = (f"tid % {run} % {LINE} * {cfg.turn} + tid % {run} / {LINE} % {cfg.turn}"
                    f" + tid % {run} / {group} * {group}")
    lines = [f"  const int {lo}_fast = {position};", f"  const int {lo}_slow = tid / {run};"]
    if fast == "k":  # rows (m or n) are the slow direction: one register offset per row loaded
        lines += [f"  idx o{side}[{count}]; bool v{side}[{count}];",
                  "  #pragma unroll",
                  f"  for (int r = 0; r < {count}; ++r) {{",
                  f"    const idx x = {base} + {lo}_slow + r * {step};",
                  f"    v{side}[r] = x < {bound};",
                  f"    o{side}[r] = {lo}l + (v{side}[r] ? {table}[x] : 0);",
                  "  }"]
    else:
        lines += [f"  idx o{side}[1]; bool v{side}[1];",
                  f"  v{side}[0] = {base} + {lo}_fast < {bound};",
                  f"  o{side}[0] = {lo}l + (v{side}[0] ? {table}[{base} + {lo}_fast] : 0);"]
    return lines


def signature(cfg: GettConfig) -> list[str]:
    """Source lines of a GETT-family kernel's index type and signature (:func:`source`): C, A
    and B, the nine offset tables in :data:`TABLE_ORDER`, the extents, ``part`` (elements between
    the outputs of consecutive parts of a split sum, :func:`split_configs`; the short-sum and
    bulk-copy kernels, never split, take and ignore it) and the scalars."""
    return [f"using idx = {INDEX[cfg.wide]};  // element offsets and extents",
            f'extern "C" __global__ void __launch_bounds__({cfg.threads}, 1)',
            f"{cfg.name()}(double* __restrict__ C, const double* __restrict__ A, const double* __restrict__ B,",
            "    " + ", ".join(f"const idx* __restrict__ off{t}" for t in TABLE_ORDER) + ",",
            "    const idx M, const idx N, idx K, const idx tilesN, const idx part,",
            "    const double alpha, const double beta)"]


def block_tile(cfg: GettConfig) -> list[str]:
    """Source lines that give a block its tile, ``bm`` and ``bn`` (first row and column of C),
    and its batch's offsets ``al``, ``bl``, ``cl``: groups of :data:`RASTER` block rows, rows
    fastest within a group (the short-sum and bulk-copy kernels' grids are the same)."""
    return [f"  // block -> tile: groups of {RASTER} block rows (the last fewer), rows fastest within a group",
            f"  const idx tilesM = (M + {cfg.bm - 1}) / {cfg.bm}, span = {RASTER} * tilesN;",
            f"  const idx first = ((idx)blockIdx.x / span) * {RASTER}, within = (idx)blockIdx.x % span;",
            f"  const idx rows = tilesM - first < {RASTER} ? tilesM - first : {RASTER};",
            f"  const idx bm = (first + within % rows) * {cfg.bm};",
            f"  const idx bn = (within / rows) * {cfg.bn};",
            "  // the batch's offsets, added to every row's (the sum is below the farthest element's offset)",
            "  const idx al = offal[blockIdx.y], bl = offbl[blockIdx.y], cl = offcl[blockIdx.y];"]


def source(cfg: GettConfig) -> str:
    """CUDA C source of the kernel for ``cfg``.

    Signature: ``(C, A, B, offam, offak, offal, offbk, offbn, offbl, offcm, offcn, offcl,
    M, N, K, tilesN, part, alpha, beta)``, tables and extents of type ``idx`` (``int``, or
    ``long long`` where ``cfg.wide``); grid ``(ceil(M/bm) * tilesN, L, parts)``, block
    ``cfg.threads``, dynamic shared memory ``cfg.smem_bytes()``. ``C = alpha·A·B + beta·C`` (C
    not read when ``beta == 0``). Every element of C is written by exactly one thread. With
    ``parts > 1`` (gridDim.z) the sum is split into parts of whole k-tiles, part ``z`` the
    k-tiles ``z·T/parts`` up to ``(z+1)·T/parts`` of T (rounded down: every part ``T/parts``
    k-tiles or one more, none empty while ``parts <= T``), and it writes its partial product
    to ``C + z·part`` (:func:`split_configs`: the caller adds the parts up). A block of a part
    shifts the k-tables past the parts before it and sums a shorter K, so that the main loop is
    the same as unsplit. A short-sum
    configuration (``cfg.span``) gets :func:`chainexec.kernels.shortsum.source`'s kernel, a
    bulk-copy one (``cfg.bulk``) :func:`chainexec.kernels.bulk.source`'s."""
    if cfg.bulk:
        from chainexec.kernels import bulk

        return bulk.source(cfg)
    if cfg.span:
        from chainexec.kernels import shortsum

        return shortsum.source(cfg)
    if not cfg.valid():
        raise ValueError(f"invalid GETT configuration {cfg}")
    pa, pb = cfg.pitches()
    sa, sb = cfg.stage_elems()
    r = cfg.rows
    wm, wn = cfg.mma_m * r, cfg.mma_n * 8
    acc = 2 if r == 8 else 4
    fa_offs, fb_offs = FRAGMENTS[cfg.mma]
    outs = ", ".join(f"%{q}" for q in range(acc))
    ins_a = ", ".join(f"%{acc + q}" for q in range(len(fa_offs)))
    ins_b = ", ".join(f"%{acc + len(fa_offs) + q}" for q in range(len(fb_offs)))
    mma = (f'asm volatile("mma.sync.aligned.{cfg.mma}.row.col.f64.f64.f64.f64 {{{outs}}}, {{{ins_a}}}, {{{ins_b}}}, '
           f'{{{outs}}};\\n" : ' + ", ".join(f'"+d"(acc[i][j][{q}])' for q in range(acc)) + " : "
           + ", ".join([f'"d"(fa[i][{q}])' for q in range(len(fa_offs))] + [f'"d"(fb[j][{q}])' for q in range(len(fb_offs))])
           + ");")

    def a_at(row: str, col: str) -> str:
        return f"sA[cur + ({row}) * {pa} + {col}]" if cfg.a_k_fast else f"sA[cur + ({col}) * {pa} + {row}]"

    def b_at(kk: str, col: str) -> str:
        return f"sB[curb + ({kk}) * {pb} + {col}]" if cfg.b_n_fast else f"sB[curb + ({col}) * {pb} + {kk}]"

    frag_a = [f"fa[i][{q}] = {a_at(f'wm + i * {r} + {dr} + (lane >> 2)', f'kk + {dk} + (lane & 3)')};"
              for q, (dr, dk) in enumerate(fa_offs)]
    # a fragment's 8 columns lie in one line's block (wn + j·8 is a multiple of 8): one skew for all
    column = f"{cfg.column('wn + j * 8')} + (lane >> 2)"
    frag_b = [f"fb[j][{q}] = {b_at(f'kk + {dk} + (lane & 3)', column)};" for q, dk in enumerate(fb_offs)]
    L = [f"// chainexec GETT kernel on FP64 tensor cores ({cfg.mma}), cp.async {cfg.stages}-stage pipeline",
         f"// block {cfg.bm}x{cfg.bn}x{cfg.bk}, {cfg.warps_m}x{cfg.warps_n} warps of {cfg.mma_m}x{cfg.mma_n} MMA tiles;"
         f" A along {'k' if cfg.a_k_fast else 'm'}, B along {'n' if cfg.b_n_fast else 'k'}",
         *signature(cfg),
         "{",
         f"  constexpr int A_STAGE = {sa}, B_STAGE = {sb};",
         "  extern __shared__ double smem[];",
         "  double* sA = smem;",
         f"  double* sB = smem + {cfg.stages} * A_STAGE;",
         "  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;",
         f"  const int wm = (warp / {cfg.warps_n}) * {wm}, wn = (warp % {cfg.warps_n}) * {wn};",
         *block_tile(cfg)]
    L += _setup(cfg, "A") + _setup(cfg, "B")
    L += [f"  double acc[{cfg.mma_m}][{cfg.mma_n}][{acc}];",
          "  #pragma unroll",
          f"  for (int i = 0; i < {cfg.mma_m}; ++i)",
          "    #pragma unroll",
          f"    for (int j = 0; j < {cfg.mma_n}; ++j)",
          "      #pragma unroll",
          f"      for (int q = 0; q < {acc}; ++q) acc[i][j][q] = 0.0;",
          "  {  // the block's part z of the sum: k-tiles z*T/Z up to (z+1)*T/Z of T, its product at C + z*part",
          f"    const idx ktiles = (K + {cfg.bk - 1}) / {cfg.bk};",
          f"    const idx first = ktiles * blockIdx.z / gridDim.z * {cfg.bk};",
          f"    const idx last = ktiles * (blockIdx.z + 1) / gridDim.z * {cfg.bk};",
          "    offak += first; offbk += first;",
          "    K = (last < K ? last : K) - first;",
          "    C += (idx)blockIdx.z * part;",
          "  }",
          f"  const idx tiles = (K + {cfg.bk - 1}) / {cfg.bk};",
          f"  idx kA[{_k_reads(cfg, 'A')}], kB[{_k_reads(cfg, 'B')}];",
          f"  bool fA[{_k_reads(cfg, 'A')}], fB[{_k_reads(cfg, 'B')}];",
          "  // prologue: the first stages-1 tiles in flight, and the next tile's k offsets read",
          f"  for (int s = 0; s < {cfg.stages - 1}; ++s) {{"]
    L += _fetch(cfg, "s", "    ") + _issue(cfg, "s", "s", "    ")
    L += ["  }"] + _fetch(cfg, f"{cfg.stages - 1}", "  ")
    L += ["  for (idx t = 0; t < tiles; ++t) {"]
    L += _issue(cfg, f"t + {cfg.stages - 1}", f"(int)(nt % {cfg.stages})", "    ")
    L += ["    // the next tile's k offsets: their reads complete while this tile is computed"]
    L += _fetch(cfg, f"t + {cfg.stages}", "    ")
    L += [f'    asm volatile("cp.async.wait_group {cfg.stages - 1};\\n" ::);',
          "    __syncthreads();",
          f"    const int cur = (int)(t % {cfg.stages}) * A_STAGE, curb = (int)(t % {cfg.stages}) * B_STAGE;",
          "    #pragma unroll",
          f"    for (int kk = 0; kk < {cfg.bk}; kk += {cfg.kstep}) {{",
          f"      double fa[{cfg.mma_m}][{len(fa_offs)}], fb[{cfg.mma_n}][{len(fb_offs)}];",
          "      #pragma unroll",
          f"      for (int i = 0; i < {cfg.mma_m}; ++i) {{ {' '.join(frag_a)} }}",
          "      #pragma unroll",
          f"      for (int j = 0; j < {cfg.mma_n}; ++j) {{ {' '.join(frag_b)} }}",
          "      #pragma unroll",
          f"      for (int i = 0; i < {cfg.mma_m}; ++i)",
          "        #pragma unroll",
          f"        for (int j = 0; j < {cfg.mma_n}; ++j)",
          f"          {mma}",
          "    }",
          "    __syncthreads();",
          "  }",
          '  asm volatile("cp.async.wait_group 0;\\n" ::);']
    L += _staged_epilogue(cfg) if cfg.staged else _direct_epilogue(cfg)
    L += ["}", ""]
    return "\n".join(L)


STORE_CHUNK = 8
"""Rows of a row-tile whose C elements a lane of the staged epilogue reads (``beta != 0``) before
it stores them: more keeps more reads in flight, and more registers live at once (half as many
rows with 64-bit offsets, which take two registers each: the largest tiles then fit 255
registers without spilling)."""


def _by_beta(body) -> list[str]:
    """``body(accumulate)`` (lines) twice, behind one test of ``beta``: the stores then neither
    test it per element nor read C where ``beta == 0``; where ``beta != 0`` each body reads all
    the C elements of a row group before it writes any, so that the reads are in flight
    together (every element of C has one writer, the thread that reads it)."""
    return (["  if (beta == 0.0) {"] + ["  " + x for x in body(False)] + ["  } else {"]
            + ["  " + x for x in body(True)] + ["  }"])


def _direct_epilogue(cfg: GettConfig) -> list[str]:
    """C = alpha·acc (+ beta·C) straight from the fragments: lanes 4q..4q+3 hold 8 consecutive n
    of one row, so each store instruction writes 8 rows of 8 elements (a sector each). A lane's
    ``2·mma_n`` column offsets and ``mma_m·rows/8`` row offsets are read from the tables before
    the first store, all at once, so that the stores wait for one table read, not one each."""
    r = cfg.rows

    def body(accumulate: bool) -> list[str]:
        old = [f"      double old[{cfg.mma_n}][2];",
               "      #pragma unroll",
               f"      for (int j = 0; j < {cfg.mma_n}; ++j)",
               "        #pragma unroll",
               "        for (int q = 0; q < 2; ++q)",
               "          old[j][q] = vcn[j][q] ? C[ocm[i][h] + ocn[j][q]] : 0.0;"] if accumulate else []
        return ["  #pragma unroll",
                f"  for (int i = 0; i < {cfg.mma_m}; ++i)",
                "    #pragma unroll",
                f"    for (int h = 0; h < {r // 8}; ++h) {{",
                "      if (!vcm[i][h]) continue;"] + old + [
                "      #pragma unroll",
                f"      for (int j = 0; j < {cfg.mma_n}; ++j)",
                "        #pragma unroll",
                "        for (int q = 0; q < 2; ++q)",
                "          if (vcn[j][q]) {",
                "            const double v = alpha * acc[i][j][2 * h + q];",
                "            C[ocm[i][h] + ocn[j][q]] = " + ("fma(beta, old[j][q], v);" if accumulate else "v;"),
                "          }",
                "    }"]
    return ["  // epilogue: C = alpha*acc (+ beta*C); lanes 4q..4q+3 hold 8 consecutive n of one row",
            f"  idx ocn[{cfg.mma_n}][2], ocm[{cfg.mma_m}][{r // 8}];",
            f"  bool vcn[{cfg.mma_n}][2], vcm[{cfg.mma_m}][{r // 8}];",
            "  #pragma unroll",
            f"  for (int j = 0; j < {cfg.mma_n}; ++j)",
            "    #pragma unroll",
            "    for (int q = 0; q < 2; ++q) {",
            "      const idx n = bn + wn + j * 8 + 2 * (lane & 3) + q;",
            "      vcn[j][q] = n < N;",
            "      ocn[j][q] = vcn[j][q] ? offcn[n] : 0;",
            "    }",
            "  #pragma unroll",
            f"  for (int i = 0; i < {cfg.mma_m}; ++i)",
            "    #pragma unroll",
            f"    for (int h = 0; h < {r // 8}; ++h) {{",
            f"      const idx m = bm + wm + i * {r} + h * 8 + (lane >> 2);",
            "      vcm[i][h] = m < M;",
            "      ocm[i][h] = cl + (vcm[i][h] ? offcm[m] : 0);",
            "    }"] + _by_beta(body)


def _staged_epilogue(cfg: GettConfig) -> list[str]:
    """C = alpha·acc (+ beta·C) through shared memory, one MMA row-tile at a time: each warp writes
    its ``rows × 8·mma_n`` accumulators to its own padded tile (the pipeline's memory, free once
    every copy has landed), then its lanes store the tile row by row along n, 32 consecutive
    elements per instruction (``32 / width`` rows of a narrower tile), so that the store-bound
    TCCG CCSD(T) outputs (302 MB, K = 24) are written in whole sectors. A lane's columns are the
    same in every row: their offsets are read from the table once. The row offsets of a row-tile
    are read in one instruction, lane ``k`` reading row ``k``'s, and handed to the lanes that
    store each row by a warp shuffle, so that no store waits for a table read of its own. Some
    other configurations run slower staged than storing fragments directly, so the autotuner
    times both (:func:`candidates`)."""
    r, width, pitch = cfg.rows, cfg.mma_n * 8, cfg.stage_pitch()
    lanes = min(width, 32)
    per_lane = max(1, width // 32)
    rows = r * lanes // 32  # rows each lane stores per row-tile
    chunk = min(rows, STORE_CHUNK // (2 if cfg.wide else 1))

    row = f"lane / {lanes} + (s0 + s) * {32 // lanes}"  # the s-th row of a chunk a lane stores

    def body(accumulate: bool) -> list[str]:
        return ["  #pragma unroll",
                f"  for (int i = 0; i < {cfg.mma_m}; ++i) {{",
                f"    const idx mine = bm + wm + i * {r} + lane % {r};",
                "    const idx om_mine = cl + (mine < M ? offcm[mine] : 0);",
                "    #pragma unroll",
                f"    for (int h = 0; h < {r // 8}; ++h)",
                "      #pragma unroll",
                f"      for (int j = 0; j < {cfg.mma_n}; ++j)",
                "        #pragma unroll",
                "        for (int q = 0; q < 2; ++q)",
                f"          stage[(h * 8 + (lane >> 2)) * {pitch} + j * 8 + 2 * (lane & 3) + q] = acc[i][j][2 * h + q];",
                "    __syncwarp();",
                "    #pragma unroll",
                f"    for (int s0 = 0; s0 < {rows}; s0 += {chunk}) {{",
                f"      idx om[{chunk}];",
                "      #pragma unroll",
                f"      for (int s = 0; s < {chunk}; ++s)",
                f"        om[s] = __shfl_sync(0xffffffffu, om_mine, {row});"] + ([
                f"      double old[{chunk}][{per_lane}];",
                "      #pragma unroll",
                f"      for (int s = 0; s < {chunk}; ++s)",
                "        #pragma unroll",
                f"        for (int q = 0; q < {per_lane}; ++q)",
                f"          old[s][q] = vcn[q] && bm + wm + i * {r} + {row} < M"
                " ? C[om[s] + ocn[q]] : 0.0;"] if accumulate else []) + [
                "      #pragma unroll",
                f"      for (int s = 0; s < {chunk}; ++s) {{",
                f"        const int row = {row};",
                f"        if (bm + wm + i * {r} + row >= M) continue;",
                "        #pragma unroll",
                f"        for (int q = 0; q < {per_lane}; ++q)",
                "          if (vcn[q]) {",
                f"            const double v = alpha * stage[row * {pitch} + col + 32 * q];",
                "            C[om[s] + ocn[q]] = " + ("fma(beta, old[s][q], v);" if accumulate else "v;"),
                "          }",
                "      }",
                "    }",
                "    __syncwarp();",
                "  }"]
    return ["  // epilogue staged through shared memory: whole rows of the warp's tile per store instruction",
            "  __syncthreads();",
            f"  double* stage = smem + warp * {r * pitch};",
            f"  const int col = lane % {lanes};",
            f"  idx ocn[{per_lane}]; bool vcn[{per_lane}];",
            "  #pragma unroll",
            f"  for (int q = 0; q < {per_lane}; ++q) {{",
            "    const idx n = bn + wn + col + 32 * q;",
            "    vcn[q] = n < N;",
            "    ocn[q] = vcn[q] ? offcn[n] : 0;",
            "  }"] + _by_beta(body)
