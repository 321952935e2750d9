"""The CuPy backend's contraction methods: each a registered strategy (:class:`Method`, one class
per method, in :data:`REGISTRY`) that says where it applies, which configurations the autotuner
times, the device temporaries it makes, and how it runs; and the state they share on the backend
(:class:`Methods`: GETT's offset tables, batched-GEMM layouts, COGENT kernels, relayout copies).

``gett`` (the generated GETT kernel on FP64 tensor cores), ``packed`` (the same on copies of the
operands packed in the output's order), ``splitk`` (the same with its sum split into parts
added up after it, where the output's blocks leave SMs idle), ``batched`` (cuBLAS batched GEMMs over
the operands as they lie, the strided-batched GEMM paper), ``relayout`` (the same on permuted
copies of the operands), ``kernel`` (the generated COGENT kernel), ``ttgt``
(transpose-transpose-GEMM-transpose), ``einsum`` (``cupy.einsum``, so the choice is never slower
than it), ``direct`` (a thread per output element: slow, but it applies to every contraction and
needs no memory, so a plan that fills the device limit has a method that keeps within it) and
``cutensor`` (NVIDIA's cuTENSOR, where libcutensor is installed).

Views: GETT, split GETT, batched GEMM, cuTENSOR and the direct kernel work on the views as they
lie (split GETT writes its parts into a workspace); packed GETT and relayout copy the operands;
TTGT, ``cupy.einsum`` and the COGENT kernel make contiguous copies and product temporaries,
workspace outside the plan's buffers.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

import numpy as np

from chainexec.errors import ChainexecError
from chainexec.kernels import batchedgemm, gett
from chainexec.planner.plan import Contraction
from chainexec.runtime import pointwise, uselog
from chainexec.runtime.backends.common import (element_strides, index_extents, overlaps, span, ttgt_layout, ttgt_product,
                                               within)

TUNE_TOP = 3
"""GETT configurations the model ranks best that the one-time autotune times."""
GETT_MIN_OUTPUT = 4096
"""Output elements below which GETT is not tried: a GEMM-shaped kernel needs output tiles to
spread over the SMs (a dot product or a tiny output is a reduction, better left to cuBLAS)."""
PIPELINE_CHUNKS = (3, 6)
"""Chunks of a pipelined TTGT (``ttgt:<chunks>``, :meth:`Methods._ttgt_pipelined`) the autotuner
times beside the plain one: fewer leave more of the first chunk's copy and the last chunk's add
alone, more make smaller GEMMs. On the CCSD contractions of the TCCG set (a 5184³ GEMM between
three 215 MB copies) three chunks on two streams hide most of the copies
(:file:`benchmarks/results/INDEX.md`)."""
PACK_LIMIT = 1.0
"""Largest ratio of the operands' bytes to the output's at which ``packed`` (GETT on packed
copies, :class:`Packed`) is offered: beyond it the copies' pass over the operands costs more than
the gathers they spare a kernel whose time is the output's."""
HOLD_SHARE = 4
"""A loop with steady inputs (:meth:`Methods.steady`) sets 1/HOLD_SHARE of the room the plan
leaves aside for the relayout copies and stacked terms' operand copies held from tile to tile."""


@lru_cache(maxsize=None)
def _cutensor(cupy):
    """``cupyx.cutensor`` where libcutensor loads and contracts (checked once on a small case), else
    None: CuPy imports the module without the library and fails only at the first call."""
    try:
        from cupyx import cutensor

        x = cupy.ones((2, 3))
        y = cupy.ones((3, 4))
        z = cupy.zeros((2, 4))
        cutensor.contraction(1.0, x, ("a", "k"), y, ("k", "b"), 0.0, z, ("a", "b"))
        return cutensor if float(z[0, 0]) == 3.0 else None
    except Exception:
        return None


@lru_cache(maxsize=None)
def _dtype_name(dtype) -> str:
    """``str(dtype)``, kept per dtype: NumPy builds the text anew at every call, and a method
    choice's key (:meth:`Methods._key`) needs it at every contraction."""
    return str(dtype)


@dataclass(frozen=True)
class _Contiguous:
    """A C-contiguous array's shape, dtype, item size and strides (bytes), without the array:
    what :meth:`Methods._batched` reads of an operand."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(math.prod(self.shape[d + 1:]) * self.itemsize for d in range(len(self.shape)))

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@lru_cache(maxsize=None)
def _copy_orders(orders, out: tuple, a: tuple, b: tuple) -> tuple:
    """``orders(out, a, b)`` (the index orders of the two operands' copies) and the permutations
    to them, per function and index triple (asked again for every tile of a run)."""
    oa, ob = orders(out, a, b)
    return tuple(oa), tuple(ob), tuple(a.index(i) for i in oa), tuple(b.index(i) for i in ob)


def _moved(c: Contraction, orders) -> tuple[Contraction, tuple, tuple]:
    """``c`` over copies of its operands in the index orders ``orders`` gives, and the
    permutations that make those copies from ``a`` and ``b``."""
    oa, ob, pa, pb = _copy_orders(orders, tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices))
    return replace(c, a_indices=list(oa), b_indices=list(ob)), pa, pb


def _relaid(c: Contraction) -> tuple[Contraction, tuple, tuple]:
    """:func:`_moved` to :func:`~chainexec.kernels.batchedgemm.operand_orders`: relayout's copies."""
    return _moved(c, batchedgemm.operand_orders)


def _packed(c: Contraction) -> tuple[Contraction, tuple, tuple]:
    """:func:`_moved` to :func:`~chainexec.kernels.gett.packed_orders`: packed GETT's copies."""
    return _moved(c, gett.packed_orders)


def _described(a, b, pa: tuple, pb: tuple) -> list:
    """C-contiguous copies of ``a`` and ``b`` permuted by ``pa`` and ``pb``, described by shape
    (:class:`_Contiguous`), not made."""
    return [_Contiguous(tuple(x.shape[p] for p in perm), x.dtype) for x, perm in ((a, pa), (b, pb))]


def _copyable(found, a, b) -> list:
    """The (order, configuration) candidates of ``found`` (:meth:`Methods._problem`'s problems
    and candidates), less the bulk-copy ones that cannot copy the operand playing B
    (:func:`~chainexec.runtime.launch.bulk_fits`); an operand given as None is a fresh copy, on
    16 bytes."""
    from chainexec.runtime.launch import bulk_fits

    probs, cands = found

    def fits(order, cfg) -> bool:
        prob = probs[order][0]
        right = a if prob.swap else b
        return not cfg.bulk or right is None or bulk_fits(cfg, prob, right)

    return [(order, cfg) for order, cfg in cands if fits(order, cfg)]


def _variants(c: Contraction, out, a, b) -> tuple[dict, tuple]:
    """GETT's problems by order (:func:`~chainexec.kernels.gett.variants`) for these operands
    (arrays, or shapes and strides described without them), and their element strides by tensor
    (C, A, B)."""
    strides = tuple(dict(zip(idx, element_strides(x))) for idx, x in
                    ((c.out_indices, out), (c.a_indices, a), (c.b_indices, b)))
    return gett.variants(tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices), index_extents(c, a, b),
                         strides), strides


def _along(indices, index: str, lo: int, hi: int) -> tuple:
    """The key that takes elements ``lo:hi`` of ``index`` from an array over ``indices``."""
    return tuple(slice(lo, hi) if i == index else slice(None) for i in indices)


def _gemm_size(g) -> int:
    """Elements of one GEMM's output in a batched-GEMM layout: what a larger layout gains."""
    return g.out.rows * g.out.cols


class Method:
    """A way to add one contraction ``c.factor · a·b`` into ``out`` on the GPU: one of the
    autotuner's candidates. ``be`` is the :class:`~chainexec.runtime.backends.cupy.CupyBackend`,
    whose tables the methods share (:class:`Methods`)."""

    name: str
    in_place = False
    """Timed on the output itself with a factor of 0 (:meth:`add`): no scratch output needed."""
    writes_fresh = False
    """Writes a ``fresh`` output as if it held zeros; before the others it is cleared."""
    keeps_copies = False
    """Reads the relayout copies kept from an earlier term of the run (the others drop them)."""

    def applies(self, be, c: Contraction, out, a, b) -> bool:
        """Whether the method can contract these operands."""
        return True

    def configurations(self, be, c: Contraction, out, a, b) -> dict:
        """Candidate name -> configuration (plain data, or None) to time, where it applies."""
        return {self.name: None}

    def workspace(self, out, a, b) -> int:
        """Upper bound (bytes) of the device temporaries it makes beside the operands."""
        return 0

    def kernels(self, be, config, c: Contraction, out, a, b) -> list[tuple[str, str, tuple]]:
        """The generated kernels (name, CUDA source, compiler options) that running ``config``
        loads: compiled together, in threads, before the autotuner times any candidate
        (:meth:`~chainexec.runtime.backends.tuning.Autotuner._precompile`); none for a library."""
        return []

    def run(self, be, config, c: Contraction, out, a, b, fresh: bool) -> None:
        """``out += c.factor · a·b`` (``out = …`` where ``fresh`` and :attr:`writes_fresh`)."""
        raise NotImplementedError


class Gett(Method):
    """The GETT kernel (:meth:`Methods._gett_call`); where its tables do not fit here (chosen on a
    probe, or a cached choice), the direct kernel instead. A fresh output is written with
    ``beta = 0``: neither cleared first nor read."""

    name = "gett"
    in_place = True
    writes_fresh = True

    def applies(self, be, c, out, a, b) -> bool:
        return be._problem(c, out, a, b) is not None

    def configurations(self, be, c, out, a, b) -> dict:
        """The model's candidates, less the bulk-copy ones that cannot copy the operand playing B
        (:func:`~chainexec.runtime.launch.bulk_fits`: its base off 16 bytes): those would run the
        fallback (:meth:`Methods._gett_call`) and time it under their name."""
        return self.named(_copyable(be._problem(c, out, a, b), a, b))

    @staticmethod
    def named(candidates, method: str = "gett") -> dict:
        """Candidate name (``<method>:<order>:<config>``) -> configuration (the order and the
        :class:`~chainexec.kernels.gett.GettConfig` fields) of the GETT model's ranked
        (order, configuration) ``candidates``."""
        return {f"{method}:{order}:{cfg.name()}": {"order": order, **asdict(cfg)} for order, cfg in candidates}

    def kernels(self, be, config, c, out, a, b) -> list:
        from chainexec.runtime.kernelcache import OPTIONS

        cfg = gett.GettConfig(**{k: v for k, v in config.items() if k != "order"})
        return [(cfg.name(), gett.source(cfg), OPTIONS)]

    def add(self, be, config, c, out, a, b, factor: float, beta: float = 1.0) -> None:
        """``out = factor · a·b + beta · out`` by the GETT kernel of ``config``."""
        be._gett_call(config, c, out, a, b, factor, beta)

    def run(self, be, config, c, out, a, b, fresh) -> None:
        _gett_or_direct(be, config, c, out, a, b, c.factor, 0.0 if fresh else 1.0)


def _gett_or_direct(be, config, c: Contraction, out, a, b, factor: float, beta: float) -> None:
    """``out = factor · a·b + beta · out`` by the GETT kernel of ``config`` on the operands as they
    lie where GETT applies to them, else by the direct kernel (``beta`` 0 or 1 there: ``out``
    cleared first where 0)."""
    if be._problem(c, out, a, b) is not None:
        be._gett_call(config, c, out, a, b, factor, beta)
        return
    if beta == 0.0:
        be.clear(out)
    REGISTRY["direct"].add(be, None, c, out, a, b, factor)


class Packed(Method):
    """The GETT kernel on C-contiguous copies of both operands in
    :func:`~chainexec.kernels.gett.packed_orders` (:func:`_packed`): batch indices first, then
    summed ones, then free ones in ``out``'s order. Where the operands interleave their stride-1
    indices with ``out``'s, as the (T) terms do, GETT gathers them in scattered sectors, and its
    loads, not its stores, set its pace; the copies cost a pass over each operand, small beside
    the output. Offered where the operands are no larger than ``out`` (:data:`PACK_LIMIT`; on a
    probe, judged on the probe) and a copy differs from its operand. The copies are kept within
    a run of terms and held for steady inputs as relayout's are (:meth:`Methods._relaid_copy`).
    Timed in place, as GETT is, on the output's own strides; where making the copies runs out of
    memory the contraction falls back to GETT on the operands. A fresh output is written with
    ``beta = 0``."""

    name = "packed"
    in_place = True
    writes_fresh = True
    keeps_copies = True

    def applies(self, be, c, out, a, b) -> bool:
        return be._packed(c, out, a, b) is not None

    def configurations(self, be, c, out, a, b) -> dict:
        """GETT's candidates on the copies, less the bulk-copy ones that cannot copy an operand
        already C-contiguous in its packed order (no copy is made of it, and its base may lie off
        16 bytes; a fresh copy's never does)."""
        _, pa, pb = _packed(c)
        return Gett.named(_copyable(be._packed(c, out, a, b), *(
            x if x.transpose(perm).flags.c_contiguous else None for x, perm in ((a, pa), (b, pb)))),
            self.name)

    def workspace(self, out, a, b) -> int:
        return a.nbytes + b.nbytes

    def kernels(self, be, config, c, out, a, b) -> list:
        return REGISTRY["gett"].kernels(be, config, c, out, a, b)

    def add(self, be, config, c, out, a, b, factor: float, beta: float = 1.0) -> None:
        """``out = factor · a·b + beta · out`` by the GETT kernel of ``config`` on the copies;
        where they are not offered here (chosen on a probe or for a classmate) or their tables do
        not fit the room, by GETT on the operands as they lie, else the direct kernel (``beta``
        0 or 1 there)."""
        if be._packed(c, out, a, b) is not None:
            moved, pa, pb = _packed(c)
            ca, cb = be._relaid_copy(0, a, pa, out), be._relaid_copy(1, b, pb, out)
            if be._problem(moved, out, ca, cb) is not None:
                be._gett_call(config, moved, out, ca, cb, factor, beta)
                return
        _gett_or_direct(be, config, c, out, a, b, factor, beta)

    def run(self, be, config, c, out, a, b, fresh) -> None:
        self.add(be, config, c, out, a, b, c.factor, 0.0 if fresh else 1.0)


class SplitK(Method):
    """The GETT kernel with its sum split into parts (:func:`~chainexec.kernels.gett.split_configs`),
    where the output has too few tiles to fill the SMs and the sum is long (TCCG case 19: a
    72×5184 output summed over 5184): each part's blocks write their partial products into a
    workspace of ``parts`` C-contiguous outputs, then one point-wise kernel adds the parts, in
    the same order every run, into ``out`` (so the same bits every run; the rounding differs from
    GETT's by the split). Timed in place as GETT is (a factor of 0 adds zeros to ``out``); a
    fresh output is written, not cleared first."""

    name = "splitk"
    in_place = True
    writes_fresh = True

    def applies(self, be, c, out, a, b) -> bool:
        return bool(be._split(c, out, a, b))

    def configurations(self, be, c, out, a, b) -> dict:
        return self.named(be._split(c, out, a, b))

    @staticmethod
    def named(candidates) -> dict:
        """Candidate name (``splitk:<order>:<config>:<parts>``) -> configuration (the order, the
        :class:`~chainexec.kernels.gett.GettConfig` fields and the parts) of (order,
        configuration, parts) ``candidates``."""
        return {f"splitk:{order}:{cfg.name()}:{parts}": {"order": order, **asdict(cfg), "parts": parts}
                for order, cfg, parts in candidates}

    def workspace(self, out, a, b) -> int:
        return max(gett.SPLIT_PARTS) * out.nbytes

    def kernels(self, be, config, c, out, a, b) -> list:
        from chainexec.runtime.kernelcache import OPTIONS, POINTWISE_OPTIONS

        cfg = gett.GettConfig(**{k: v for k, v in config.items() if k not in ("order", "parts")})
        parts = [_Contiguous(tuple(out.shape), out.dtype)] * config["parts"]
        return [(cfg.name(), gett.source(cfg), OPTIONS)] + [
            (name, text, POINTWISE_OPTIONS) for fresh in (True, False)
            for name, text in pointwise.launch_kernels(be.xp, _parts_sum(config["parts"], fresh), parts, out)]

    def add(self, be, config, c, out, a, b, factor: float, beta: float = 1.0) -> None:
        """``out = factor · a·b + beta · out`` (``beta`` 0 or 1) by the split GETT of ``config``;
        where no split is offered here (chosen on a probe or for a classmate), by GETT on the
        whole sum, else the direct kernel."""
        if be._split(c, out, a, b):
            be._split_call(config, c, out, a, b, factor, beta)
        else:
            _gett_or_direct(be, {k: v for k, v in config.items() if k != "parts"}, c, out, a, b, factor, beta)

    def run(self, be, config, c, out, a, b, fresh) -> None:
        self.add(be, config, c, out, a, b, c.factor, 0.0 if fresh else 1.0)


def _parts_sum(parts: int, fresh: bool) -> str:
    """Point-wise code that adds ``parts`` partial products (``p0``…) in order, onto ``out``'s
    value (``y``) unless ``fresh``."""
    terms = " + ".join(f"p{z}" for z in range(parts))
    return terms if fresh else f"y + ({terms})"


class Batched(Method):
    """cuBLAS batched GEMMs over the operands as they lie (:meth:`Methods.batched_gemm`); TTGT
    where the tile has no layout (chosen on a probe)."""

    name = "batched"
    writes_fresh = True

    def applies(self, be, c, out, a, b) -> bool:
        return be._batched(c, out, a, b) is not None

    def run(self, be, config, c, out, a, b, fresh) -> None:
        if not be.batched_gemm(c, out, a, b, c.factor, 0.0 if fresh else 1.0):
            be._add(out, ttgt_product(be, c, a, b), fresh)


class Relayout(Method):
    """Batched GEMMs on copies of the operands permuted so that the modes each shares with ``out``
    in runs merge into large GEMM dimensions (:func:`_relaid`,
    :func:`chainexec.kernels.batchedgemm.operand_orders`), still adding straight into ``out``: the
    copies cost a pass over the operands, which in (T) are tiny beside the output, and no product
    temporary or permuted add as TTGT has. Offered where it makes larger GEMMs than the operands
    as they lie; TTGT where the tile has no layout."""

    name = "relayout"
    writes_fresh = True
    keeps_copies = True

    def applies(self, be, c, out, a, b) -> bool:
        copied, in_place = be._relayout(c, out, a, b), be._batched(c, out, a, b)
        return copied is not None and (in_place is None or _gemm_size(copied[0]) > _gemm_size(in_place[0]))

    def workspace(self, out, a, b) -> int:
        return a.nbytes + b.nbytes

    def run(self, be, config, c, out, a, b, fresh) -> None:
        if be._relayout(c, out, a, b) is None:  # chosen on a probe; no layout here
            be._add(out, ttgt_product(be, c, a, b), fresh)
            return
        moved, pa, pb = _relaid(c)
        if not be.batched_gemm(moved, out, be._relaid_copy(0, a, pa, out), be._relaid_copy(1, b, pb, out), c.factor,
                               0.0 if fresh else 1.0):
            # the copies' strides differ from their description (extent-1 or empty axes)
            be._add(out, ttgt_product(be, c, a, b), fresh)


class Kernel(Method):
    """The generated COGENT kernel on C-contiguous copies of the operands, into ``out`` where it is
    C-contiguous, else into a temporary then added; TTGT where no configuration survives at these
    extents (chosen on a probe)."""

    name = "kernel"

    def applies(self, be, c, out, a, b) -> bool:
        return be._kernel_source(c, index_extents(c, a, b), out.dtype) is not None

    def kernels(self, be, config, c, out, a, b) -> list:
        from chainexec.runtime.kernelcache import OPTIONS

        _, name, source = be._kernel_source(c, index_extents(c, a, b), out.dtype)
        return [(name, source, OPTIONS)]

    def workspace(self, out, a, b) -> int:
        return a.nbytes + b.nbytes + out.nbytes

    def run(self, be, config, c, out, a, b, fresh) -> None:
        kern = be._kernel(c, index_extents(c, a, b), out.dtype)
        if kern is None:
            be._add(out, ttgt_product(be, c, a, b), False)
            return
        left, right = be.contiguous(a), be.contiguous(b)
        if out.flags.c_contiguous:
            kern(left, right, out, alpha=c.factor, beta=1.0)
        else:
            be._add(out, kern(left, right, None, alpha=c.factor), False)


class Ttgt(Method):
    """Transpose-transpose-GEMM-transpose with ``cupy.matmul``; a fresh output gets the product
    copied in. Pipelined (configuration ``{"chunks": n}``, :meth:`Methods._ttgt_pipelined`):
    the GEMM's left operand, its product and ``out`` cut into ``n`` chunks along one index, the
    chunks' GEMMs on one stream and their copies and adds on another, so that a chunk's copies
    run while another chunk's GEMM does; offered where each chunk of ``out`` has at least
    :data:`~chainexec.runtime.pointwise.SHAPED_BYTES` (its copies then run on the point-wise
    kernels of their shape, and take longer than a second stream's launches and waits cost) and
    ``out`` lies apart from both operands. No two GEMMs run at once: cuBLAS promises the same
    bits from run to run for one active stream (its "results reproducibility")."""

    name = "ttgt"
    writes_fresh = True

    def configurations(self, be, c, out, a, b) -> dict:
        named = {self.name: None}
        split = _pipelined(c, out, a, b)
        if split is not None:
            extent = index_extents(c, a, b)[split]
            named |= {f"ttgt:{n}": {"chunks": n} for n in PIPELINE_CHUNKS
                      if n <= extent and out.nbytes // n >= pointwise.SHAPED_BYTES}
        return named

    def workspace(self, out, a, b) -> int:
        return a.nbytes + b.nbytes + out.nbytes

    def run(self, be, config, c, out, a, b, fresh) -> None:
        if config and _pipelined(c, out, a, b) is not None:
            be._ttgt_pipelined(c, out, a, b, fresh, config["chunks"])
        else:  # plain, or chosen on a probe for a tile whose output meets an operand
            be._add(out, ttgt_product(be, c, a, b), fresh)


@lru_cache(maxsize=None)
def _pipeline_layout(out: tuple, a: tuple, b: tuple) -> str | None:
    """The index a pipelined TTGT cuts into chunks: the outermost of the GEMM's left operand's
    free indices (:func:`~chainexec.runtime.backends.common.ttgt_layout`, in ``out``'s order), so
    that a chunk of the left operand makes a block of the GEMM's rows; None where the contraction
    sums over nothing or the left operand has no free index."""
    _, lext, _, ks, *_ = ttgt_layout(out, a, b)
    return lext[0] if lext and ks else None


def _pipeline_index(c: Contraction) -> str | None:
    """:func:`_pipeline_layout` of a contraction."""
    return _pipeline_layout(tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices))


def _pipelined(c: Contraction, out, a, b) -> str | None:
    """:func:`_pipeline_index` where ``out`` lies apart from both operands (a chunk of ``out`` is
    written while later chunks still read them), else None."""
    return None if overlaps(out, a) or overlaps(out, b) else _pipeline_index(c)


def _modes(c: Contraction) -> list[str]:
    """The index strings of ``a``, ``b`` and ``out``, one letter per index, for einsum and cuTENSOR."""
    sub = {i: chr(ord("a") + n) for n, i in enumerate(dict.fromkeys(c.a_indices + c.b_indices))}
    return ["".join(sub[i] for i in idx) for idx in (c.a_indices, c.b_indices, c.out_indices)]


class Einsum(Method):
    """``cupy.einsum``, its product added."""

    name = "einsum"

    def workspace(self, out, a, b) -> int:
        return a.nbytes + b.nbytes + 2 * out.nbytes

    def run(self, be, config, c, out, a, b, fresh) -> None:
        be._add(out, be.xp.einsum("{},{}->{}".format(*_modes(c)), a, b), False, c.factor)


class Direct(Method):
    """The direct kernel (:func:`chainexec.runtime.pointwise.contract`) over the views as they lie."""

    name = "direct"
    in_place = True

    def kernels(self, be, config, c, out, a, b) -> list:
        from chainexec.kernels.direct import direct_source
        from chainexec.runtime.kernelcache import POINTWISE_OPTIONS

        return [("chainexec_direct", direct_source(out, a, b, (c.out_indices, c.a_indices, c.b_indices)),
                 POINTWISE_OPTIONS)]

    def add(self, be, config, c, out, a, b, factor: float) -> None:
        """``out += factor · a·b``."""
        pointwise.contract(be.xp, out, a, b, (c.out_indices, c.a_indices, c.b_indices), factor)

    def run(self, be, config, c, out, a, b, fresh) -> None:
        self.add(be, config, c, out, a, b, c.factor)


class Cutensor(Method):
    """cuTENSOR's contraction into ``out`` (β = 1), where libcutensor is installed."""

    name = "cutensor"

    def applies(self, be, c, out, a, b) -> bool:
        return (_cutensor(be.xp) is not None and str(out.dtype) in ("float32", "float64")
                and all((c.out_indices, c.a_indices, c.b_indices)))  # no 0-d tensor

    def workspace(self, out, a, b) -> int:
        return out.nbytes

    def run(self, be, config, c, out, a, b, fresh) -> None:
        modes = _modes(c)
        _cutensor(be.xp).contraction(c.factor, a, tuple(modes[0]), b, tuple(modes[1]), 1.0, out, tuple(modes[2]))


REGISTRY = {m.name: m for m in (Gett(), Packed(), SplitK(), Batched(), Relayout(), Kernel(), Ttgt(), Einsum(),
                                Direct(), Cutensor())}
"""The contraction methods by name, in the order the autotuner lists its candidates. Workspaces:
TTGT and the COGENT kernel may copy both operands and make an output-sized product (or temporary
output), ``cupy.einsum`` one more output-sized array; GETT, batched GEMM and the direct kernel
make none (GETT's offset tables, kept for the process, are checked against the room by
:meth:`Methods._problem`; batched GEMM's pointer tables, 24 bytes per GEMM of a pointer-array
call, are not counted); ``packed`` and ``relayout`` copy both operands; ``splitk`` makes up to
``max(SPLIT_PARTS)`` outputs (and keeps the offset tables of a C-contiguous output, as GETT's);
cuTENSOR's is counted as one output.
(Where batched GEMM or relayout was chosen on a probe and the tile has no layout, the fallback's
TTGT temporaries are not in this bound: a failed allocation then falls back to GETT,
:meth:`chainexec.runtime.backends.tuning.Autotuner.contract`.)"""


class Methods:
    """The contraction methods' part of :class:`~chainexec.runtime.backends.cupy.CupyBackend`: the
    tables they share, kept per (contraction, shapes, strides, dtype), and the relayout copies
    kept within a run of terms and across the tiles of a loop with steady inputs. Its state is
    made in the backend's ``__init__``."""

    @contextlib.contextmanager
    def _reusing(self):
        """Within a run of terms into one output, a relayout copy is kept for the next term
        (:meth:`_relaid_copy`): in (T), W's terms ``ovvv[k,c,f,a]·t2`` and ``ovvv[k,c,f,b]·t2``
        copy the same slice to the same order, so the second term reuses the first's copy."""
        self._kept = {}
        try:
            yield
        finally:
            self._kept = None

    def _drop_kept(self) -> None:
        """Free the relayout copies kept so far in this run (:meth:`_reusing`), if any."""
        if self._kept:
            self._kept.clear()

    @contextlib.contextmanager
    def steady(self, arrays):
        """As :meth:`Backend.steady`: a relayout copy of a view of a steady array is kept from
        statement to statement and tile to tile (:meth:`_relaid_copy`), and dropped on leaving
        (an inner loop's: those of arrays not steady in the outer one). In (T) the terms
        ``ovvv[k,c,f,a]·t2`` and ``ovvv[k,c,f,b]·t2`` copy the slice ``ovvv[k]`` once per k
        instead of once per tile. The outermost one with arrays sets
        1/:data:`HOLD_SHARE` of the room the plan leaves aside for the held copies: the rest is
        what the autotuner and the methods' temporaries may use meanwhile (:attr:`workspace`, also
        in the tuning keys), so that held copies and temporaries together stay within it."""
        outer, room, spans = self._steady, self.workspace, [span(x) for x in arrays]
        reserve = self._hold_room is None and spans and room is not None
        if reserve:
            self._hold_room = room // HOLD_SHARE
            self.workspace = room - self._hold_room
        self._steady = (outer or []) + spans
        try:
            yield
        finally:
            self._steady = outer
            if reserve:
                self.workspace, self._hold_room = room, None
            for slot, (_, _, reach) in list(self._held.items()):
                if not within(reach, outer or []):
                    del self._held[slot]

    def _relaid_copy(self, slot: int, x, perm: tuple, out):
        """``x`` permuted by ``perm``, C-contiguous (:meth:`_contiguous`). Inside
        :meth:`_reusing` the copy last made for operand position ``slot`` when it is of the same
        memory, shape, strides and permutation. Only one copy per position is kept (the previous
        one is dropped before a new one is made), and none across other methods (:meth:`_run`),
        so a run holds no more than one term's relayout temporaries, as the autotuner's room
        assumes. Not where ``x`` overlaps ``out``, which the run changes. A view of a
        :meth:`steady` array has its copy held across runs instead, one per position, where it
        fits in the room :meth:`steady` sets aside for held copies once held stack sides give
        way (:meth:`_room_for`)."""
        if overlaps(x, out):
            return self._contiguous(x.transpose(perm))
        key = (x.data.ptr, x.shape, x.strides, tuple(perm), x.dtype.str)
        reach = (span(x),)
        if self._held.get(slot, (None,))[0] == key:
            return self._held[slot][1]
        if self._steady and within(reach, self._steady) and self._room_for(x.nbytes, set(), slot):
            kept = self._held
        elif self._kept is not None:
            kept = self._kept
        else:
            return self._contiguous(x.transpose(perm))
        if kept.get(slot, (None,))[0] != key:
            kept.pop(slot, None)
            kept[slot] = (key, self._contiguous(x.transpose(perm)), reach)
        return kept[slot][1]

    def _room_for(self, nbytes: int, read: set, replaced=None) -> bool:
        """Whether a copy of ``nbytes`` can be held beside the held copies, in the room
        :meth:`steady` sets aside (any where none is set), dropping for it, least recently read
        first, as many held stack sides (:meth:`~chainexec.runtime.backends.tuning.Autotuner._stack_side`)
        outside ``read`` as it takes; none are dropped where even all of them would not make room.
        Relayout copies stay, but the one at ``replaced``, which the new copy takes the place of,
        is not counted."""
        if self._hold_room is None:
            return True
        held = sum(x.nbytes for slot, (_, x, _) in self._held.items() if slot != replaced)
        spare = [slot for slot in self._held if isinstance(slot, tuple) and slot not in read]
        if held - sum(self._held[slot][1].nbytes for slot in spare) + nbytes > self._hold_room:
            return False
        for slot in spare:
            if held + nbytes <= self._hold_room:
                break
            held -= self._held.pop(slot)[1].nbytes
        return True

    @staticmethod
    def _kernel_key(c: Contraction, sizes: dict, dtype) -> tuple:
        """What a COGENT kernel depends on: the contraction's index lists, the extents and dtype."""
        return (tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices), tuple(sorted(sizes.items())),
                str(dtype))

    def _kernel_source(self, c: Contraction, sizes: dict, dtype) -> tuple | None:
        """(configuration, name, CUDA source) of the generated COGENT kernel for this contraction
        and tile extents (:func:`chainexec.runtime.launch.kernel_source`, nothing compiled), or None
        where none applies (batch index, a 0-d tensor, dtype, extents, no surviving configuration)."""
        key = self._kernel_key(c, sizes, dtype)
        if key not in self._sources:
            from chainexec.runtime import launch

            made = None
            if (str(dtype) in ("float32", "float64") and max(sizes.values()) < 2**31
                    and all((c.out_indices, c.a_indices, c.b_indices))):  # no 0-d tensor
                try:
                    made = launch.kernel_source(c.out_indices, c.a_indices, c.b_indices, sizes, str(dtype))
                except ValueError:  # batch index or no configuration survives
                    made = None
            self._sources[key] = made
        return self._sources[key]

    def _kernel(self, c: Contraction, sizes: dict, dtype):
        """The compiled COGENT kernel of :meth:`_kernel_source`, or None where none applies."""
        key = self._kernel_key(c, sizes, dtype)
        if key not in self._kernels:
            from chainexec.runtime import launch

            made = self._kernel_source(c, sizes, dtype)
            self._kernels[key] = None if made is None else launch.get_kernel(
                c.out_indices, c.a_indices, c.b_indices, sizes, str(dtype), made[0])
        return self._kernels[key]

    def _problem(self, c: Contraction, out, a, b):
        """GETT problems by order with their device tables, and the model's ranked
        (order, configuration) candidates for these operands (float64 only), cached by shapes
        and strides; None where GETT does not apply, or where its tables (kept for the process)
        would not fit in the room the plan leaves: there they would hold the allocator above the
        configured device memory."""
        if out.dtype != np.float64 or out.size < GETT_MIN_OUTPUT:
            return None
        key = self._key(c, out, a, b)
        if key not in self._gett:
            from chainexec.runtime import launch

            probs, strides = _variants(c, out, a, b)
            dev = self.xp.cuda.Device()
            cands = gett.candidates(probs, dev.attributes["MultiProcessorCount"], TUNE_TOP,
                                    int(dev.compute_capability))
            host = {o: gett.tables(p, strides) for o, p in probs.items()} if cands else {}
            need = sum(t.nbytes for h in host.values() for t in h.values())
            fits = self.workspace is None or self.table_bytes + need <= self.workspace
            self._gett[key] = None
            if cands and fits:
                self._gett[key] = ({o: (p, launch.GettTables(p, strides, host[o])) for o, p in probs.items()}, cands)
                self.table_bytes += need
        return self._gett[key]

    def _batched(self, c: Contraction, out, a, b):
        """The batched-GEMM layout of these operands (cached by shapes and strides), its BLAS form,
        its launches and each pointer-array launch's byte offsets as a (3, matrices) device array,
        or None where none applies (dtype, a mode in one tensor only, BLAS's 32-bit dimensions
        exceeded)."""
        key = self._key(c, out, a, b)
        if key not in self._batches:
            g = None
            if out.dtype in (np.float32, np.float64) and a.dtype == b.dtype == out.dtype:
                strides = tuple(dict(zip(idx, element_strides(x))) for idx, x in
                                ((c.out_indices, out), (c.a_indices, a), (c.b_indices, b)))
                g = batchedgemm.plan(c.out_indices, c.a_indices, c.b_indices, index_extents(c, a, b) | dict(
                    zip(c.out_indices, out.shape)), strides)
            self._batches[key] = None
            if g is not None:
                bl, launches = batchedgemm.blas(g), g.launches()
                if max([bl.m, bl.n, bl.k, bl.lda, bl.ldb, bl.ldc, g.batch[0]]
                       + [len(launch.offsets) for launch in launches]) < 2**31:
                    self._batches[key] = (g, bl, launches, [
                        None if launch.strided else self.xp.asarray(
                            np.ascontiguousarray(launch.offsets.T) * out.itemsize)
                        for launch in launches])
        return self._batches[key]

    def batched_gemm(self, c: Contraction, out, a, b, alpha: float, beta: float = 1.0) -> bool:
        """``out = alpha·a·b + beta·out`` by :meth:`_batched`'s cuBLAS calls on the current
        stream; False (nothing done) where no layout applies."""
        found = self._batched(c, out, a, b)
        if found is None:
            return False
        from cupy_backends.cuda.libs import cublas

        g, bl, launches, offsets = found
        handle = self.xp.cuda.device.get_cublas_handle()
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        double = out.dtype == np.float64
        strided = cublas.dgemmStridedBatched if double else cublas.sgemmStridedBatched
        pointers = cublas.dgemmBatched if double else cublas.sgemmBatched
        ops = tuple(cublas.CUBLAS_OP_T if t else cublas.CUBLAS_OP_N for t in (bl.trans_a, bl.trans_b))
        lhs, rhs = (1, 0) if bl.swap else (0, 1)
        base = (a.data.ptr, b.data.ptr, out.data.ptr)
        count, *steps = g.batch
        size = out.itemsize
        # every launch's matrix addresses before the first call: a failed allocation then leaves
        # ``out`` untouched for the caller's fallback. Each base address is a kernel argument: a
        # host array copied to the device here would wait for all the work queued before it.
        ats = [None if table is None else self._addresses(table, base) for table in offsets]
        for launch, at in zip(launches, ats):
            second = beta if launch.first else 1.0
            keep, one, two = batchedgemm.gemm_scalars(strided if launch.strided else pointers, alpha, second,
                                                      out.dtype)
            uselog.note(self.tuning.device, "gemms",  # for the next process's warm-up
                        ("d" if double else "s", bool(launch.strided), bool(bl.trans_a), bool(bl.trans_b),
                         *map(int, (bl.m, bl.n, bl.k, bl.lda, bl.ldb, bl.ldc)),
                         int(count if launch.strided else len(launch.offsets)), int(second != 0)))
            if launch.strided:
                at = [p + int(o) * size for p, o in zip(base, launch.offsets[0])]
                strided(handle, *ops, bl.m, bl.n, bl.k, one, at[lhs], bl.lda, steps[lhs], at[rhs], bl.ldb,
                        steps[rhs], two, at[2], bl.ldc, steps[2], count)
            else:
                # addresses made on the device from the byte offsets kept there; CuPy's pool
                # reuses their block only for work queued later on the same stream
                pointers(handle, *ops, bl.m, bl.n, bl.k, one, at[lhs].data.ptr, bl.lda, at[rhs].data.ptr,
                         bl.ldb, two, at[2].data.ptr, bl.ldc, at.shape[1])
        return True

    def _addresses(self, table, base: tuple[int, int, int]):
        """The (3, matrices) device addresses of a pointer-array launch: row r of ``table`` (byte
        offsets) plus ``base[r]``, made on the device (:func:`chainexec.runtime.pointwise.addresses`)."""
        return pointwise.addresses(self.xp, table, base)

    def _relayout(self, c: Contraction, out, a, b):
        """:meth:`_batched`'s layout for C-contiguous copies of ``a`` and ``b`` in the orders of
        :func:`_relaid`, or None (the copies are described by shape, not made)."""
        moved, pa, pb = _relaid(c)
        return self._batched(moved, out, *_described(a, b, pa, pb))

    def _packed(self, c: Contraction, out, a, b):
        """:meth:`_problem` for C-contiguous copies of ``a`` and ``b`` in the orders of
        :func:`_packed` (described by shape, not made), or None where they are not offered: the
        operands larger than :data:`PACK_LIMIT` times ``out``, or both already C-contiguous in
        those orders."""
        moved, pa, pb = _packed(c)
        if (a.nbytes + b.nbytes > PACK_LIMIT * out.nbytes
                or all(x.transpose(perm).flags.c_contiguous for x, perm in ((a, pa), (b, pb)))):
            return None
        return self._problem(moved, out, *_described(a, b, pa, pb))

    def _split(self, c: Contraction, out, a, b) -> list:
        """The (order, configuration, parts) candidates of a split sum for these operands
        (:func:`~chainexec.kernels.gett.split_configs` on the problems of a C-contiguous output
        of ``out``'s shape, the parts' workspace), cached by shapes and strides; empty where
        GETT does not apply, no split fills idle SMs, or the split problems' tables (made here,
        only where a split is offered) would not fit the room (:meth:`_problem`)."""
        if out.dtype != np.float64 or out.size < GETT_MIN_OUTPUT:
            return []
        key = self._key(c, out, a, b)
        if key not in self._splits:
            whole = _Contiguous(tuple(out.shape), out.dtype)
            probs, _ = _variants(c, whole, a, b)
            dev = self.xp.cuda.Device()
            sms, arch = dev.attributes["MultiProcessorCount"], int(dev.compute_capability)
            found = [(order, cfg, parts) for order, p in probs.items()
                     for cfg, parts in gett.split_configs(p, sms, arch)]
            self._splits[key] = found if found and self._problem(c, whole, a, b) is not None else []
        return self._splits[key]

    def _split_call(self, config: dict, c: Contraction, out, a, b, alpha: float, beta: float) -> None:
        """``out = alpha · a·b + beta · out`` (``beta`` 0 or 1) by the split GETT of ``config``:
        the parts' partial products into a workspace of ``parts`` C-contiguous outputs
        (:func:`~chainexec.runtime.launch.launch_gett`), then added up into ``out``
        (:func:`_parts_sum`). Raises ValueError for another ``beta``."""
        from chainexec.runtime import launch

        if beta not in (0.0, 1.0):
            raise ValueError(f"a split sum adds into its output with beta 0 or 1, not {beta}")
        fields = dict(config)
        order, parts = fields.pop("order"), fields.pop("parts")
        cfg = gett.GettConfig(**fields)
        probs, _ = self._problem(c, _Contiguous(tuple(out.shape), out.dtype), a, b)
        if order not in probs or (cfg.a_k_fast, cfg.b_n_fast) != (probs[order][0].a_k_fast, probs[order][0].b_n_fast):
            # chosen on a probe whose cut made another order or load direction win: the first
            # split here of that order, else the first
            cands = self._split(c, out, a, b)
            order, cfg, parts = next((x for x in cands if x[0] == order), cands[0])
        prob, tables = probs[order]
        left, right = (b, a) if prob.swap else (a, b)
        work = self.xp.empty((parts,) + tuple(out.shape), out.dtype)
        launch.launch_gett(cfg, tables, work, left, right, alpha, 0.0, parts)
        pointwise.launch(self.xp, _parts_sum(parts, beta == 0.0), list(work), out)

    def _contiguous(self, view):
        """A C-contiguous copy of a permuted view, by a generated point-wise kernel, which reads
        a view stepping across the copy's fastest index through shared memory
        (:func:`chainexec.kernels.elementwise.staging`), so that both its reads and its writes are
        coalesced, where :meth:`Backend.contiguous <chainexec.runtime.device.Backend.contiguous>`'s
        shape-generic copy reads such a view with strided loads (this one is compiled per shape)."""
        if view.flags.c_contiguous:
            return view
        copy = self.xp.empty(view.shape, view.dtype)
        pointwise.launch(self.xp, "p0", [view], copy)
        return copy

    def _candidates(self, c: Contraction, out, a, b) -> dict:
        """Candidate name -> configuration (plain data, or None), for every method of
        :data:`REGISTRY` that applies: ``gett:<order>:<config>`` and ``packed:<order>:<config>``
        for the model's top GETT candidates on the operands and on their packed copies,
        ``splitk:<order>:<config>:<parts>`` for the split sums, else the method's name."""
        cands = {}
        for method in REGISTRY.values():
            if method.applies(self, c, out, a, b):
                cands |= method.configurations(self, c, out, a, b)
        return cands

    @staticmethod
    def _key(c: Contraction, out, a, b) -> tuple:
        """What a method choice depends on: the contraction, shapes, strides and dtype."""
        return (tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices), a.shape, b.shape, out.shape,
                element_strides(out), element_strides(a), element_strides(b), _dtype_name(out.dtype))

    def _gett_call(self, config: dict, c: Contraction, out, a, b, alpha: float, beta: float = 1.0) -> None:
        """``out = alpha · a·b + beta · out`` by the GETT kernel of ``config`` (its ``order`` and
        :class:`GettConfig` fields)."""
        from chainexec.kernels.gett import GettConfig
        from chainexec.runtime import launch

        fields = dict(config)
        order = fields.pop("order")
        probs, cands = self._problem(c, out, a, b)
        order = order if order in probs else next(iter(probs))
        prob, tables = probs[order]
        cfg = GettConfig(**fields)
        left, right = (b, a) if prob.swap else (a, b)
        if ((cfg.a_k_fast, cfg.b_n_fast) != (prob.a_k_fast, prob.b_n_fast) or (cfg.span and prob.dims[2] > cfg.bk)
                or (cfg.bulk and not launch.bulk_fits(cfg, prob, right))):
            # chosen on a probe whose cut made another load direction win, or taken from a
            # classmate whose sum a short-sum kernel held and this one's it does not, or whose B
            # a bulk-copy kernel copied in whole aligned chunks and this one's it cannot: the
            # model's best here
            cfg = next(x for o, x in cands if o == order)
        launch.launch_gett(cfg, tables, out, left, right, alpha, beta)

    def _run(self, how: tuple, c: Contraction, out, a, b, fresh: bool = False) -> None:
        """``out += factor · a·b`` by ``how = (method, config)`` (:data:`REGISTRY`). ``fresh``
        (:meth:`contract`): the methods that write a fresh output as if it held zeros do (batched
        GEMM with β = 0, TTGT copying its product in), and before the others ``out`` is cleared.
        A method that reads no relayout copy kept from an earlier term drops them first."""
        method, config = how
        strategy = REGISTRY[method]
        if not strategy.keeps_copies:
            self._drop_kept()
        if fresh and not strategy.writes_fresh:
            self.clear(out)
            fresh = False
        strategy.run(self, config, c, out, a, b, fresh)

    def _add(self, out, product, fresh: bool, factor: float = 1.0) -> None:
        """``out += factor·product``, or ``out[...] = factor·product`` where ``out`` is fresh
        (:meth:`chainexec.runtime.device.Backend.assign`)."""
        self.assign(out, product, factor, not fresh)

    def _ttgt_pipelined(self, c: Contraction, out, a, b, fresh: bool, chunks: int) -> None:
        """``out += factor · a·b`` (``out = …`` where ``fresh``) by TTGT in ``chunks`` chunks of
        the left operand's outermost free index (:func:`_pipeline_layout`): the right operand
        copied on the current stream, then the chunks' GEMMs (each the left operand's chunk
        against the whole right copy: a block of the product's rows) one after another on the
        first stream of :meth:`_pipeline_streams`, and their copies and adds on the second, which
        copies chunk k + 1 before it waits for GEMM k and adds its product (scaled by the factor
        first) into the same chunk of ``out``: each GEMM runs beside the next chunk's copy and the
        last chunk's add. The GEMMs share one stream so that no two run at once (cuBLAS's
        run-to-run bitwise promise holds for one active stream). The current stream waits for
        both at the end. The chunks' copies (none where a chunk is C-contiguous already) and
        products are allocated on the current stream before any chunk runs, so that CuPy's pool
        returns their memory to the current stream's share, not to a share of the other streams
        kept from the plan's buffers, and so that a lack of memory fails before anything is added
        to ``out``; they are let go only after the current stream waits for both streams, which
        it does also where a chunk raises. A lack of memory after a chunk's add is issued raises
        :class:`ChainexecError`, not CuPy's error, since a method run after it would add those
        chunks again. A chunk's GEMM has fewer rows than the whole: its rounding may differ from
        plain TTGT's in the last bits."""
        xp = self.xp
        batch, lext, rext, ks, swap, pl, pr, pout = ttgt_layout(tuple(c.out_indices), tuple(c.a_indices),
                                                                tuple(c.b_indices))
        size = index_extents(c, a, b)
        (left, left_idx), right = ((b, c.b_indices), a) if swap else ((a, c.a_indices), b)
        split = lext[0]
        chunks = max(1, min(chunks, size[split]))  # a choice made on a larger tile
        bounds = [k * size[split] // chunks for k in range(chunks + 1)]
        nb, nr, nk = (math.prod(size[i] for i in g) for g in (batch, rext, ks))
        inner = math.prod(size[i] for i in lext[1:])
        lead = (nb,) if batch else ()
        main = xp.cuda.get_current_stream()
        rmat = self.reshaped(right.transpose(pr), lead + (nk, nr))
        made, dtype = [], xp.result_type(left.dtype, right.dtype)  # the product's, as matmul's
        for lo, hi in zip(bounds, bounds[1:]):
            part = left[_along(left_idx, split, lo, hi)].transpose(pl)
            copy = part if part.flags.c_contiguous else xp.empty(part.shape, left.dtype)
            made.append((part, copy, xp.empty(lead + ((hi - lo) * inner, nr), dtype)))
        ready = main.record()
        gemms, copies = self._pipeline_streams()

        def gemm(k: int):
            """Chunk k's copy on ``copies``, its GEMM on ``gemms``; the event of the GEMM's end."""
            part, lcopy, product = made[k]
            if lcopy is not part:
                with copies:
                    self.assign(lcopy, part)
                gemms.wait_event(copies.record())
            with gemms:
                xp.matmul(lcopy.reshape(lead + (product.shape[-2], nk)), rmat, out=product)
                return gemms.record()

        added = False
        try:
            gemms.wait_event(ready)
            copies.wait_event(ready)
            done = gemm(0)
            for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                after = gemm(k + 1) if k + 1 < chunks else None
                copies.wait_event(done)
                product = made[k][2]
                view = product.reshape([hi - lo if i == split else size[i] for i in batch + lext + rext])
                with copies:
                    if c.factor != 1.0:  # scaled in place, then added: plain TTGT's rounding and copies
                        self.assign(product, product, c.factor)
                    self._add(out[_along(c.out_indices, split, lo, hi)], view.transpose(pout), fresh)
                added = True
                done = after
        except xp.cuda.memory.OutOfMemoryError:
            if not added:  # out untouched: the caller may run another method
                raise
            raise ChainexecError(f"device memory: none left for {c.out}[{','.join(c.out_indices)}] += {c.a}·{c.b} "
                                 f"(ttgt in {chunks} chunks, tile {'x'.join(map(str, out.shape))}) after part of it "
                                 f"was added; lower machine.device_memory") from None
        finally:  # also after an error, before the temporaries' memory returns to the pool
            for stream in (gemms, copies):
                main.wait_event(stream.record())

    def _pipeline_streams(self) -> list:
        """The two streams of :meth:`_ttgt_pipelined` (its GEMMs', its copies' and adds'), made
        on first use."""
        if self._pipes is None:
            self._pipes = [self.xp.cuda.Stream(non_blocking=True) for _ in range(2)]
        return self._pipes

