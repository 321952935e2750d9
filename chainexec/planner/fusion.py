"""Fusion over a chain of contractions: the multi-level paper, section 5.

- :func:`fusable_lists` — the producer/consumer links cut into runs of consecutive
  contractions that stay linked: each intermediate read by the next one (the paper's linear
  fusable list), or a tensor built by several ``+=`` terms and read several times kept together.
- :func:`link_ratio` / :func:`profitable` — eq. 5.1–5.3: fusing away intermediate I between
  producer p and consumer q pays at a level with per-element transfer time Λ when the flops each
  of them spends per element of I stay below 2Λ / (frac · Cflop); a link that fails is cut.
- :func:`first_last_profitable` — eq. 5.4: an end contraction with an operand too large for the
  level is still fused when the rest of the chain takes a fraction q of the memory with
  √(1−q)/(1−√(1−q)) ≥ |I0(c1)|/√M.
- :func:`memory_f` — the recurrence of section 5.1, f(i,j) = min_k |I_k|/|Common_{i,j}| +
  max(f(i,k−1), f(k+1,j)) (elements), and its section-5.2 form at the global level, where a
  sub-chain that fits the device costs only its first and last tensors; reported for explanation.
- :func:`split` — the dynamic program that cuts a fusable list into fused sub-chains, minimising
  the data movement of the cuts (2·|I_k| per cut, section 5.1), given which sub-chains fit.

Which sub-chains fit is decided by the exact peak memory of the emitted nest (see
:mod:`chainexec.planner.schedule`) rather than by f: our fused nests materialise each
intermediate over the tiles of the loops common to the fused outputs, which needs the producer's
and consumer's tensors at once, while f assumes the interleaved update of Algorithm 1. On the
paper's Expression D this exact check reproduces the paper's stated outcome (all five fuse at
the global level below N = 40 and not at 40), where f alone would still admit N = 40.
"""

from __future__ import annotations

import math
from functools import lru_cache

from chainexec.planner.machine import Machine
from chainexec.planner.plan import Contraction, TensorInfo


def links(cs: list[Contraction]) -> set[tuple[int, int]]:
    """The producer → consumer edges of the chain's graph, as pairs of contraction ids: the
    consumer reads (as an operand) the tensor the producer is the last to write before it. A set
    of pairs is all the search asks of the graph (whether an edge is there); a graph library's
    import alone would cost every planning process more than its whole search on most chains."""
    edges = set()
    last_writer: dict[str, int] = {}
    for c in cs:
        for name in [c.a] + ([c.b] if c.b is not None else []):
            if name in last_writer:
                edges.add((last_writer[name], c.id))
        last_writer[c.out] = c.id
    return edges


def fusable_lists(cs: list[Contraction]) -> list[list[int]]:
    """Maximal runs of consecutive contractions that stay linked: c_k+1 joins the run while some
    tensor written in the run is still to be read or accumulated into at c_k+1 or later. For a
    linear chain this is the paper's fusable list (each intermediate feeds the next contraction);
    it also keeps together a tensor built by several ``+=`` terms and read several times (the
    (T) chain's W, Z and R). Outputs may be written inside a run; they are stored from it."""
    edges = links(cs)
    runs: list[list[int]] = []
    for c in cs:
        if runs and _open(runs[-1], c.id, cs, edges):
            runs[-1].append(c.id)
        else:
            runs.append([c.id])
    return runs


def _open(run: list[int], k: int, cs: list[Contraction], edges: set[tuple[int, int]]) -> bool:
    """Whether a tensor written in ``run`` is read (an edge of :func:`links`) or accumulated into
    from k on."""
    written = {cs[j].out for j in run}
    for c in cs[k:]:
        if any((j, c.id) in edges for j in run) or (c.accumulate and c.out in written):
            return True
    return False


def size(tensor: TensorInfo) -> int:
    return math.prod(tensor.shape)


def link_ratio(c: Contraction, intermediate: TensorInfo) -> float:
    """Flops of ``c`` per element of the intermediate, halved (one multiply-add per pair): for the
    producer this is |I0(c1)| of eq. 5.1, for the consumer Π|B1(cj)|·|B1(d)| of eq. 5.2."""
    return c.flops / (2 * size(intermediate))


def threshold(level: str, itemsize: int, machine: Machine, frac: float) -> float:
    """2Λ / (frac · Cflop) of eq. 5.1 for fusion at ``level`` (``disk`` or ``global``)."""
    lam = itemsize / (machine.disk_read if level == "disk" else machine.global_to_device)
    return 2 * lam * machine.flop_rate / frac


def profitable(producer: Contraction, consumer: Contraction, intermediate: TensorInfo, level: str,
               machine: Machine, frac: float = 1.0) -> bool:
    """Eq. 5.3: both sides of the link spend few enough flops per element of the intermediate."""
    limit = threshold(level, intermediate.itemsize, machine, frac)
    return link_ratio(producer, intermediate) <= limit and link_ratio(consumer, intermediate) <= limit


def first_last_profitable(contracted: float, memory: float, q: float) -> bool:
    """Eq. 5.4: fuse an end contraction whose big operand must be re-read, when the rest of the
    chain takes the fraction ``q`` of the level's memory (``memory`` elements)."""
    if q >= 1:
        return False
    r = math.sqrt(1 - q)
    return r / (1 - r) >= contracted / math.sqrt(memory) if r < 1 else True


def memory_f(outs: list[list[str]], extents: dict[str, int], fits_below=None) -> float:
    """The fusion memory recurrence in elements over tensors with index lists ``outs``.

    ``fits_below(i, j)`` (section 5.2) says whether sub-chain i..j fits the level below; such a
    sub-chain costs (|I_i| + |I_j|)/|I_i ∩ I_j| at this level."""
    n = len(outs)

    def vol(idx) -> int:
        return math.prod(extents[i] for i in idx)

    @lru_cache(maxsize=None)
    def f(i: int, j: int) -> float:
        if j < i:
            return 0.0
        if fits_below is not None and fits_below(i, j):
            both = set(outs[i]) & set(outs[j])
            return (vol(outs[i]) + (vol(outs[j]) if j != i else 0)) / vol(both)
        common = set(outs[i])
        for k in range(i + 1, j + 1):
            common &= set(outs[k])
        return min(vol(outs[k]) / vol(common) + max(f(i, k - 1), f(k + 1, j)) for k in range(i, j + 1))

    return f(0, n - 1)


def split(n: int, fits, cut_cost, tiebreak=lambda pieces: 0.0) -> list[tuple[int, int]]:
    """Cut positions 0..n−1 into fused sub-chains [(i, j), …] minimising Σ cut_cost(k) over the
    cuts after position k; ``fits(i, j)`` says whether i..j can run fused (a single position always
    can). Dynamic programming as for matrix-chain multiplication (section 5.1). The paper leaves
    equal-cost splits open; ``tiebreak(pieces)`` (smaller wins) decides between them."""

    @lru_cache(maxsize=None)
    def best(i: int, j: int) -> tuple[float, float, tuple[tuple[int, int], ...]]:
        if i == j or fits(i, j):
            return 0.0, tiebreak(((i, j),)), ((i, j),)
        options = []
        for k in range(i, j):
            left, right = best(i, k), best(k + 1, j)
            pieces = left[2] + right[2]
            options.append((left[0] + right[0] + cut_cost(k), tiebreak(pieces), pieces))
        return min(options)

    return list(best(0, n - 1)[2])
