"""Predicted seconds of each contraction method on the GPU: the autotuner's first opinion, so that
only the candidates the models cannot tell apart are compiled and timed, and a first run on a
fresh machine does not pay for compiling and timing every candidate.

Every model is a roofline over the method's own work (a pure function of the operands' indices,
shapes and element strides; no device is touched, so the choices can be checked against timings
recorded on any machine, ``benchmarks/tuning_model.py``):

- ``batched`` — cuBLAS batched GEMMs over the operands as they lie
  (:func:`chainexec.kernels.batchedgemm.plan`): the GEMMs' flops at the FP64 tensor-core rate
  times the GEMM shape's efficiency (:func:`gemm_efficiency`), against each operand read once and
  the output read and written once; one launch per BLAS call.
- ``relayout`` — the same on C-contiguous copies in :func:`~chainexec.kernels.batchedgemm.operand_orders`,
  plus the copies (each operand read and written).
- ``ttgt`` — one GEMM over the merged free and summed extents (``ttgt_layout``), plus both
  operands transposed, the product written, and the permuted add (product and output read, output
  written); pipelined, the left operand's copy and the output's passes beside the GEMM but for
  one chunk's; ``einsum`` as plain TTGT with one more output pass (its product is a separate
  array).
- ``cutensor`` — the GEMM bound and the minimum traffic of the contraction, over
  :data:`CUTENSOR_SHARE`.
- ``gett`` — the GETT kernel's own model (:func:`chainexec.kernels.gett.predicted_seconds`), the
  one that ranks its configurations, over :data:`GETT_SHARE`; ``packed`` the same on C-contiguous
  copies in :func:`~chainexec.kernels.gett.packed_orders`, plus the copies; ``splitk`` the same
  with its parts' blocks and workspace, plus the launch of the parts' sum.
- ``kernel`` (COGENT) and ``direct`` — the flops on the CUDA cores (half the tensor-core rate)
  at :data:`CORE_SHARE` and :data:`DIRECT_SHARE` of it, against the minimum traffic.

A run of terms into one buffer (:mod:`chainexec.runtime.backends.termruns`) is predicted per
strategy: the terms one by one at their best library method (:func:`library`), a sum kernel
(:func:`sum_kernel`), the stacks (:func:`stacked`).

The shares are set from the candidates' timings of a (T) job on an H200
(``benchmarks/results/tuning_h200_benzene.json``; ``benchmarks/tuning_model.py`` prints each
method's measured over predicted seconds and what model-first tuning would lose at each margin),
cuTENSOR's from the TCCG cases (``benchmarks/results/tccg_h200_cutensor.json``).

A candidate is timed where its prediction is within :data:`MARGIN` of the best prediction, or
within the margin of its own method's best where that is within :data:`WIDE` of the best
(:func:`ambiguous`): where one candidate is predicted faster than every other by more than
these it is chosen without timing, and the others' kernels are never compiled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chainexec.kernels import batchedgemm, gett
from chainexec.runtime.backends.common import ttgt_layout

FLOPS = gett.PEAK_FLOPS
"""FP64 tensor-core GEMM rate the models assume (flop/s), the GETT model's."""
BANDWIDTH = gett.DRAM_BYTES
"""Device-memory bandwidth the models assume (bytes/s), the GETT model's."""
LAUNCH = 5e-6
"""Seconds per kernel launch or library call (the floor of a small contraction)."""
EINSUM_OVERHEAD = 30e-6
"""Seconds of ``cupy.einsum``'s planning in Python per call."""
HALF = (32, 32, 16)
"""GEMM extents (m, n, k) at which cuBLAS's FP64 tensor-core GEMM runs at half its rate along that
dimension (:func:`gemm_efficiency`)."""
GETT_SHARE = 0.5
"""Share of its own roofline model that the generated GETT kernel reaches."""
CUTENSOR_SHARE = 0.8
"""Share of its roofline (the GEMM bound and the least traffic) that cuTENSOR reaches."""
CORE_SHARE = 0.15
"""Share of the CUDA cores' FP64 rate that the generated COGENT kernel reaches."""
DIRECT_SHARE = 0.08
"""Share of the CUDA cores' FP64 rate that the direct kernel (a thread per output element, its
operands read from the caches) reaches."""
SUM_SHARE = 0.4
"""Share of its units' FP64 rate that a sum kernel (:mod:`chainexec.kernels.sumkernel`) reaches at
its best configuration."""
MARGIN = 1.25
"""Candidates predicted within this factor of the best prediction are timed; the others are not
(where only the best is left, it is chosen untimed)."""
WIDE = 1.75
"""A method whose best prediction is within this factor of the best of all has its candidates
within :data:`MARGIN` of its own best timed too (:func:`ambiguous`, single contractions): one
method's candidates share one model, but how one method's model compares with another's varies
across shapes by up to 2× (on the recorded TCCG timings, GETT's is pessimistic on large
memory-bound contractions, cuTENSOR's optimistic)."""


@dataclass(frozen=True)
class Operand:
    """One tensor of a contraction as the models see it: its index names, extents and element
    strides."""

    indices: tuple[str, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def stride_of(self) -> dict[str, int]:
        return dict(zip(self.indices, self.strides))


def operand(indices, arr) -> Operand:
    """An array's (anything with ``shape``, ``strides`` in bytes and ``itemsize``) model view."""
    return Operand(tuple(indices), tuple(arr.shape), tuple(s // arr.itemsize for s in arr.strides))


def gemm_efficiency(m: int, n: int, k: int) -> float:
    """Share of the GEMM rate at extents m×n×k: m/(m+m½)·n/(n+n½)·k/(k+k½), :data:`HALF` — a thin
    GEMM is bound by its operand traffic and its few output tiles, not by the tensor cores."""
    return math.prod(x / (x + h) for x, h in zip((m, n, k), HALF))


def _extents(out: Operand, a: Operand, b: Operand) -> dict[str, int]:
    return dict(zip(a.indices, a.shape)) | dict(zip(b.indices, b.shape)) | dict(zip(out.indices, out.shape))


def flops(out: Operand, a: Operand, b: Operand) -> float:
    """2 · output elements · summed elements."""
    size = _extents(out, a, b)
    return 2.0 * out.size * math.prod(size[i] for i in set(a.indices) & set(b.indices) - set(out.indices))


def _traffic(out: Operand, a: Operand, b: Operand, itemsize: int) -> float:
    """Bytes of the least traffic: each operand read once, the output read and written once."""
    return itemsize * (a.size + b.size + 2 * out.size)


def _batched(out: Operand, a: Operand, b: Operand, itemsize: int) -> float:
    g = batchedgemm.plan(out.indices, a.indices, b.indices, _extents(out, a, b),
                         (out.stride_of(), a.stride_of(), b.stride_of()))
    if g is None:
        return math.inf
    bl, launches = batchedgemm.blas(g), g.launches()
    matrices = sum(g.batch[0] if launch.strided else len(launch.offsets) for launch in launches)
    compute = 2.0 * bl.m * bl.n * bl.k * matrices / (FLOPS * gemm_efficiency(bl.m, bl.n, bl.k))
    return compute + _traffic(out, a, b, itemsize) / BANDWIDTH + LAUNCH * len(launches)


def _contiguous(x: Operand, order: list[str]) -> Operand:
    """A C-contiguous copy of ``x`` with its indices in ``order``."""
    shape = tuple(dict(zip(x.indices, x.shape))[i] for i in order)
    return Operand(tuple(order), shape, tuple(math.prod(shape[d + 1:]) for d in range(len(shape))))


def _copies(a: Operand, b: Operand, itemsize: int) -> float:
    """Both operands copied: each read and written once, one launch each."""
    return 2.0 * itemsize * (a.size + b.size) / BANDWIDTH + 2 * LAUNCH


def _relayout(out: Operand, a: Operand, b: Operand, itemsize: int) -> float:
    oa, ob = batchedgemm.operand_orders(out.indices, a.indices, b.indices)
    return _copies(a, b, itemsize) + _batched(out, _contiguous(a, oa), _contiguous(b, ob), itemsize)


def _ttgt_extents(out: Operand, a: Operand, b: Operand) -> tuple[int, int, int, int]:
    """(batch, m, n, k) elements of TTGT's GEMM."""
    batch, lext, rext, ks, *_ = ttgt_layout(out.indices, a.indices, b.indices)
    size = _extents(out, a, b)
    return tuple(math.prod(size[i] for i in g) for g in (batch, lext, rext, ks))


def _ttgt(out: Operand, a: Operand, b: Operand, itemsize: int, passes: int = 3, chunks: int = 1) -> float:
    """TTGT's GEMM, its operands' copies and ``passes`` over the output beside the product's
    write. Pipelined in ``chunks`` (more than one): the right operand's copy first, then the
    chunks' GEMMs beside the other chunks' copies and passes (the longer of the two), of which one
    chunk's run alone."""
    nb, m, n, k = _ttgt_extents(out, a, b)
    swap = ttgt_layout(out.indices, a.indices, b.indices)[4]
    left, right = (b, a) if swap else (a, b)
    compute = 2.0 * nb * m * n * k / (FLOPS * gemm_efficiency(max(1, m // chunks), n, k))
    right_copy = 2.0 * itemsize * right.size / BANDWIDTH
    rest = itemsize * (2 * left.size + (1 + passes) * out.size) / BANDWIDTH
    if chunks == 1:
        return compute + right_copy + rest + 4 * LAUNCH
    return right_copy + max(compute, rest) + rest / chunks + (1 + 3 * chunks) * LAUNCH


def _least(out: Operand, a: Operand, b: Operand, itemsize: int, rate: float) -> float:
    return max(flops(out, a, b) / rate, _traffic(out, a, b, itemsize) / BANDWIDTH) + LAUNCH


def _gett(config: dict, out: Operand, a: Operand, b: Operand, sm_count: int) -> float:
    """GETT's model over :data:`GETT_SHARE`; a split sum's (``parts``) on a C-contiguous output,
    plus the launch of the parts' sum."""
    fields = {k: v for k, v in config.items() if k not in ("order", "parts")}
    parts = config.get("parts", 1)
    strides = _contiguous(out, out.indices).stride_of() if parts > 1 else out.stride_of()
    problems = gett.variants(out.indices, a.indices, b.indices, _extents(out, a, b),
                             (strides, a.stride_of(), b.stride_of()))
    problem = problems.get(config["order"]) or next(iter(problems.values()))
    return (gett.predicted_seconds(problem, gett.GettConfig(**fields), sm_count, parts) / GETT_SHARE
            + LAUNCH * (1 + (parts > 1)))


def _packed(config: dict, out: Operand, a: Operand, b: Operand, itemsize: int, sm_count: int) -> float:
    oa, ob = gett.packed_orders(out.indices, a.indices, b.indices)
    return _copies(a, b, itemsize) + _gett(config, out, _contiguous(a, oa), _contiguous(b, ob), sm_count)


def predict(method: str, config, out: Operand, a: Operand, b: Operand, itemsize: int, sm_count: int) -> float:
    """Predicted seconds of ``method`` (a name of
    :data:`~chainexec.runtime.backends.methods.REGISTRY`) with ``config`` (GETT's order and
    configuration, a pipelined TTGT's chunks, else None) for ``out += a·b``; ``inf`` where the
    method has no model."""
    if method == "batched":
        return _batched(out, a, b, itemsize)
    if method == "relayout":
        return _relayout(out, a, b, itemsize)
    if method == "ttgt":
        return _ttgt(out, a, b, itemsize, 3, config["chunks"] if config else 1)
    if method == "einsum":
        return _ttgt(out, a, b, itemsize, 4) + EINSUM_OVERHEAD
    if method == "cutensor":
        return _least(out, a, b, itemsize, FLOPS * gemm_efficiency(*_ttgt_extents(out, a, b)[1:])) / CUTENSOR_SHARE
    if method in ("gett", "splitk"):
        return _gett(config, out, a, b, sm_count)
    if method == "packed":
        return _packed(config, out, a, b, itemsize, sm_count)
    if method == "kernel":
        return _least(out, a, b, itemsize, FLOPS / 2 * CORE_SHARE)
    if method == "direct":
        return _least(out, a, b, itemsize, FLOPS / 2 * DIRECT_SHARE)
    return math.inf


def library(out: Operand, a: Operand, b: Operand, itemsize: int) -> float:
    """The best prediction of the library methods (batched GEMM, relayout, TTGT): what a term of a
    run costs on its own in the strategies' models
    (:meth:`chainexec.runtime.backends.termruns.Strategy.predicted`), without GETT's tables."""
    return min(_batched(out, a, b, itemsize), _relayout(out, a, b, itemsize), _ttgt(out, a, b, itemsize))


def sum_kernel(out: Operand, terms: list[tuple[Operand, Operand]], itemsize: int, tensor_cores: bool) -> float:
    """One sum kernel over ``terms`` at its best configuration: their flops at :data:`SUM_SHARE`
    of the FP64 rate of the units it runs on (the CUDA cores', half the tensor cores', unless
    ``tensor_cores``) plus the output read and written once. Where it is beyond the margin, the
    kernel's configuration search and compile are skipped."""
    rate = (FLOPS if tensor_cores else FLOPS / 2) * SUM_SHARE
    work = sum(flops(out, a, b) for a, b in terms)
    return work / rate + 2 * itemsize * out.size / BANDWIDTH + LAUNCH


def stacked(out: Operand, terms: list[tuple[Operand, Operand]], left: tuple[str, ...], right: tuple[str, ...],
            itemsize: int) -> float:
    """One stack of ``terms`` (:mod:`chainexec.kernels.stacking`): their operands copied into two
    contiguous stacks along a new summed index (each operand read, each copy written), then one
    contraction of the stacks by the best library method; ``left`` and ``right`` are the output
    indices of the two stacks."""
    size = {}
    depth = 0
    for a, b in terms:
        size |= _extents(out, a, b)
        depth += math.prod(size[i] for i in set(a.indices) & set(b.indices) - set(out.indices))
    copies = 2.0 * itemsize * sum(a.size + b.size for a, b in terms) / BANDWIDTH + 2 * LAUNCH * len(terms)
    one = [_contiguous(Operand(("_stacked", *side), (depth, *(size[i] for i in side)), ()), ["_stacked", *side])
           for side in (left, right)]
    return copies + library(out, *one, itemsize)


def ambiguous(predicted: dict[str, float], margin: float = MARGIN, wide: float = 1.0) -> list[str]:
    """The candidates worth timing, best first: of candidate -> predicted seconds (a method's
    candidates named ``method`` or ``method:configuration``), those within ``margin`` of the best
    prediction, and those within ``margin`` of their own method's best where that is within
    ``wide`` of the best of all (:data:`WIDE`). All of them where no prediction is finite."""
    best = min(predicted.values(), default=math.inf)
    if not math.isfinite(best):
        return list(predicted)
    method = {name: name.split(":")[0] for name in predicted}
    own: dict[str, float] = {}
    for name, t in predicted.items():
        own[method[name]] = min(own.get(method[name], math.inf), t)
    return sorted((m for m, t in predicted.items()
                   if t <= margin * best or own[method[m]] <= wide * best and t <= margin * own[method[m]]),
                  key=predicted.get)
