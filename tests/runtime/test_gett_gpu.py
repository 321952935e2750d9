"""GPU tests of the GETT tensor-core kernels and the backend's method choice (skipped without a GPU).

Every result is compared with ``numpy.einsum`` on the host on fresh random inputs (outputs poisoned
with NaN where beta = 0, so an unwritten element fails); operands include strided views of larger
buffers, batch indices and extent-1 indices; every valid configuration is run at least once.
"""

from dataclasses import asdict, replace
from itertools import product

import numpy as np
import pytest

from tests.conftest import require_gpu  # noqa: E402

cupy = require_gpu()

from chainexec.kernels import gett  # noqa: E402
from chainexec.planner.plan import Contraction  # noqa: E402
from chainexec.runtime import device, launch  # noqa: E402
from chainexec.runtime.backends import methods, termruns, tuning  # noqa: E402
from chainexec.runtime.backends.cupy import CupyBackend  # noqa: E402
from tests.kernels.test_gett import CASES, _arrays, _strides  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path / "cache"))


def _relerr(out, ref):
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _device_views(host_arrays, view):
    """The arrays on the device; with ``view``, as interior slices of larger device buffers."""
    out = []
    for x in host_arrays:
        if view:
            big = cupy.full([n + 3 for n in x.shape], cupy.nan)
            sl = tuple(slice(2, 2 + n) for n in x.shape)
            big[sl] = cupy.asarray(x)
            out.append(big[sl])
        else:
            out.append(cupy.asarray(np.ascontiguousarray(x)))
    return out


def _run(cfg, c, a, b, sizes, C, A, B, alpha, beta, order="load", wide=False):
    """Launch ``cfg``; ``wide``: with 64-bit tables and offsets, as if an operand reached 2^31
    elements (the kernel's width follows the tables)."""
    strides = (_strides(C, c), _strides(A, a), _strides(B, b))
    p = gett.problem(tuple(c), tuple(a), tuple(b), sizes, strides, order)
    p = replace(p, wide=p.wide or wide)
    tables = launch.GettTables(p, strides)
    left, right = (B, A) if p.swap else (A, B)
    launch.launch_gett(cfg, tables, C, left, right, alpha, beta)
    return p


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("c,a,b,sizes", CASES)
def test_top_candidates_match_numpy(c, a, b, sizes, view, wide):
    hC, hA, hB = _arrays(c, a, b, sizes, seed=3 + len(a), view=False)
    ref = np.einsum(f"{a},{b}->{c}", hA, hB)
    C, A, B = _device_views((hC, hA, hB), view)
    strides = (_strides(C, c), _strides(A, a), _strides(B, b))
    probs = gett.variants(tuple(c), tuple(a), tuple(b), sizes, strides)
    for order, cfg in gett.candidates(probs, 132, top=4):
        C[...] = cupy.nan
        _run(cfg, c, a, b, sizes, C, A, B, 1.0, 0.0, order, wide)
        assert _relerr(C.get(), ref) <= 1e-12, cfg
        C[...] = cupy.asarray(hC)
        _run(cfg, c, a, b, sizes, C, A, B, 0.5, -1.25, order, wide)
        assert _relerr(C.get(), 0.5 * ref - 1.25 * hC) <= 1e-12, cfg


OFF_GRID = ((2, 1, 2, 3, 16), (1, 1, 2, 3, 16), (2, 2, 2, 2, 16), (2, 4, 4, 1, 16), (3, 2, 3, 4, 24))
"""Tile shapes outside :data:`~chainexec.kernels.gett.TILES` (three warps along m, warp tiles 8, 16
and 24 columns wide): whatever :meth:`GettConfig.valid` admits computes the contraction."""


@pytest.mark.parametrize("staged", [False, True])
def test_every_configuration_is_correct(staged):
    """All tile shapes (:data:`~chainexec.kernels.gett.TILES` and :data:`OFF_GRID`), every MMA
    shape, all four load directions, odd extents (partial tiles), each epilogue."""
    sizes = dict(a=70, b=45, k=37)
    layouts = {(True, True): ("ak", "kb"), (True, False): ("ak", "bk"), (False, True): ("ka", "kb"),
               (False, False): ("ka", "bk")}
    for (ak, bn), (a, b) in layouts.items():
        hC, hA, hB = _arrays("ab", a, b, sizes, seed=7)
        ref = np.einsum(f"{a},{b}->ab", hA, hB)
        C, A, B = _device_views((hC, hA, hB), False)
        for (wm, wn, mm, mn, bk), shape in product(gett.TILES + OFF_GRID, gett.MMA_SHAPES):
            rows = gett.MMA_SHAPES[shape][0]
            if mm * 8 % rows:
                continue
            cfg = gett.GettConfig(wm, wn, mm * 8 // rows, mn, bk, 3, shape, ak, bn, staged)
            if not cfg.valid():
                continue
            C[...] = cupy.nan
            p = _run(cfg, "ab", a, b, sizes, C, A, B, 1.0, 0.0)
            assert (p.a_k_fast, p.b_n_fast) == (ak, bn)
            assert _relerr(C.get(), ref) <= 1e-12, cfg


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("e,turn", [(29, gett.BLOCK), (9, gett.C_RUN)])
def test_turned_loads_are_correct(e, turn, view):
    """Every configuration of :data:`~chainexec.kernels.gett.TILES` and :data:`OFF_GRID` that loads
    B's lines turned (the ``store-line`` order of a tensor-times-matrix product whose output's
    stride-1 index d is not the tensor's, a): C's runs of 4 (a long sum) and of 8 (a short one),
    ragged blocks of both indices (a = 37: two lines and 5; d = 11), each epilogue, alpha/beta."""
    c, a, b, sizes = "abcd", "deca", "be", dict(a=37, b=20, c=3, d=11, e=e)
    hC, hA, hB = _arrays(c, a, b, sizes, seed=e)
    ref = np.einsum(f"{a},{b}->{c}", hA, hB)
    C, A, B = _device_views((hC, hA, hB), view)
    strides = (_strides(C, c), _strides(A, a), _strides(B, b))
    p = gett.problem(tuple(c), tuple(a), tuple(b), sizes, strides, "store-line")
    assert p.turn == turn and p.swap and p.b_n_fast
    ran = 0
    for (wm, wn, mm, mn, bk), shape, staged in product(gett.TILES + OFF_GRID, gett.MMA_SHAPES, (False, True)):
        rows = gett.MMA_SHAPES[shape][0]
        cfg = gett.GettConfig(wm, wn, mm * 8 // rows, mn, bk, 3, shape, p.a_k_fast, True, staged, turn=turn)
        if mm * 8 % rows or not cfg.valid():
            continue
        C[...] = cupy.nan
        _run(cfg, c, a, b, sizes, C, A, B, 1.0, 0.0, "store-line")
        assert _relerr(C.get(), ref) <= 1e-12, cfg
        C[...] = cupy.asarray(hC)
        _run(cfg, c, a, b, sizes, C, A, B, 0.5, -1.25, "store-line")
        assert _relerr(C.get(), 0.5 * ref - 1.25 * hC) <= 1e-12, cfg
        ran += 1
    assert ran >= 8


SHORT_GRID = tuple(product((2, 4, 8), (1, 2), (4, 8), (128, 256), (2, 3)))
SHORT_GRID += tuple(t for t in gett.SHORT_TILES if t not in SHORT_GRID)
"""(warps, m16 tiles a warp, n8 tiles a chunk, columns a block, stages) of the short-sum kernels
checked: chunk widths of 32 and 64 columns, spans that a block fills or leaves ragged, two and
three stages, blocks whose rows of threads divide a chunk's rows or not (8 warps over sums of 4
and 20), and every shape the autotuner times (:data:`~chainexec.kernels.gett.SHORT_TILES`)."""


@pytest.mark.parametrize("K", [1, 7, 19, 24, 45, 48])
def test_short_sum_kernels_are_correct(K):
    """Every short-sum shape of :data:`SHORT_GRID` that holds the sum, all four load directions,
    odd M and N (partial blocks and chunks), a batch index, strided views of larger buffers,
    alpha and beta, 32- and 64-bit offsets: against NumPy."""
    sizes = dict(l=2, a=75, b=301, k=K)
    layouts = {(True, True): ("lak", "lkb"), (True, False): ("lak", "lbk"), (False, True): ("lka", "lkb"),
               (False, False): ("lka", "lbk")}
    bk = -(-K // 4) * 4
    for n, ((ak, bn), (a, b)) in enumerate(layouts.items()):
        hC, hA, hB = _arrays("lab", a, b, sizes, seed=K + n)
        ref = np.einsum(f"{a},{b}->lab", hA, hB)
        C, A, B = _device_views((hC, hA, hB), True)
        ran = 0
        for warps, mma_m, mma_n, span, stages in SHORT_GRID:
            cfg = gett.GettConfig(warps, 1, mma_m, mma_n, bk, stages, "m16n8k4", ak, bn, span=span)
            if not cfg.valid():
                continue
            wide = ran % 2 == 1
            C[...] = cupy.nan
            p = _run(cfg, "lab", a, b, sizes, C, A, B, 1.0, 0.0, wide=wide)
            assert (p.a_k_fast, p.b_n_fast) == (ak, bn)
            assert _relerr(C.get(), ref) <= 1e-12, cfg
            C[...] = cupy.asarray(hC)
            _run(cfg, "lab", a, b, sizes, C, A, B, 0.5, -1.25, wide=wide)
            assert _relerr(C.get(), 0.5 * ref - 1.25 * hC) <= 1e-12, cfg
            ran += 1
        assert ran >= 8


def test_a_short_sum_kernel_refuses_a_longer_sum():
    sizes = dict(a=40, b=64, k=30)
    hC, hA, hB = _arrays("ab", "ak", "kb", sizes, seed=5)
    C, A, B = _device_views((hC, hA, hB), False)
    cfg = gett.GettConfig(4, 1, 2, 8, 28, 3, "m16n8k4", True, True, span=128)
    assert cfg.valid()
    with pytest.raises(ValueError, match="sums at most 28"):
        _run(cfg, "ab", "ak", "kb", sizes, C, A, B, 1.0, 0.0)


def _contraction(out, a, b, factor=1.0):
    return Contraction(id=0, out=out[0], out_indices=list(out[1]), a=a[0], a_indices=list(a[1]),
                       b=b[0], b_indices=list(b[1]), factor=factor, accumulate=True, flops=0, statement=0)


@pytest.mark.parametrize("method", tuning.METHODS)
def test_backend_methods_accumulate_into_views(method, monkeypatch):
    """out += factor * a*b through every method on views of larger buffers, against einsum."""
    monkeypatch.setenv("CHAINEXEC_GPU_METHOD", method)
    be = device.select("cupy")
    sizes = dict(i=5, j=6, k=4, a=9, b=8, c=9, f=11)  # batched GEMMs of 8x9 (its minimum side is 8)
    hW, hA, hB = _arrays("ijkabc", "iafb", "kjcf", sizes, seed=1, view=False)
    W, A, B = _device_views((hW, hA, hB), True)
    c = _contraction(("W", "ijkabc"), ("ovvv", "iafb"), ("t2", "kjcf"), factor=-0.75)
    be.contract(c, W, A, B)
    ref = hW - 0.75 * np.einsum("iafb,kjcf->ijkabc", hA, hB)
    assert _relerr(W.get(), ref) <= 1e-12
    forced = be.choices[next(iter(be.choices))].method
    # the kernel has no layout here, nor relayout on padded views (no mode merges in W), nor a
    # split a sum of 11; cuTENSOR may be absent; a strategy of runs of terms (termruns), forced,
    # tunes a lone contraction as auto does
    fallback = {"kernel", "relayout", "splitk"} | ({"cutensor"} if methods._cutensor(cupy) is None else set())
    assert (method in ("auto", *termruns.REGISTRY) or forced == method
            or (method in fallback and forced == "ttgt"))


def _triples_term(monkeypatch, method: str, seed: int, view: bool, fresh: bool):
    """A backend with ``method`` forced, the (T)-shaped term ``W[ijkabc] += ovvv[iafb]·t2[kjcf]``
    (W, ovvv, t2 on the device, views of larger buffers where ``view``; W NaN where ``fresh``),
    their host copies, and the list of outputs the backend clears (none cleared for real)."""
    monkeypatch.setenv("CHAINEXEC_GPU_METHOD", method)
    be = device.select("cupy")
    sizes = dict(i=5, j=6, k=4, a=9, b=8, c=7, f=11)
    host = _arrays("ijkabc", "iafb", "kjcf", sizes, seed=seed, view=False)
    W, A, B = _device_views(host, view)
    if fresh:
        W[...] = cupy.nan
    cleared = []
    monkeypatch.setattr(CupyBackend, "clear", lambda self, out: cleared.append(out.shape))
    term = _contraction(("W", "ijkabc"), ("ovvv", "iafb"), ("t2", "kjcf"), factor=1.5)
    return be, (W, A, B), host, term, cleared


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("fresh", [False, True])
def test_packed_gett_reads_copies_and_writes_the_output_in_place(fresh, view, monkeypatch):
    """Forced ``packed`` on (T)-shaped terms (operands far smaller than the output, as the runtime
    offers it), contiguous and as views of larger buffers: a fresh output (NaN in it) is written
    as if it held zeros, otherwise the product is added; the GETT kernel runs on C-contiguous
    copies in :func:`~chainexec.kernels.gett.packed_orders` (the copies the backend makes),
    against NumPy, with no clearing first; within a run of terms (:meth:`Methods._reusing`) a
    second term over the same operands reuses their copies."""
    be, (W, A, B), (hW, hA, hB), c, cleared = _triples_term(monkeypatch, "packed", 9, view, fresh)
    made, ran = [], []
    contiguous, call = CupyBackend._contiguous, CupyBackend._gett_call
    monkeypatch.setattr(CupyBackend, "_contiguous", lambda self, v: made.append(v.shape) or contiguous(self, v))
    monkeypatch.setattr(CupyBackend, "_gett_call",
                        lambda self, config, c, *args: ran.append((c.a_indices, c.b_indices)) or call(self, config, c, *args))
    with be._reusing():
        be.contract(replace(c, factor=-0.5), W, A, B, fresh)
        be.contract(replace(c, factor=2.0), W, A, B)
    ref = 1.5 * np.einsum("iafb,kjcf->ijkabc", hA, hB) + (0.0 if fresh else hW)
    assert _relerr(W.get(), ref) <= 1e-12
    assert {choice.method for choice in be.choices.values()} == {"packed"}
    assert made == [(11, 5, 9, 8), (11, 6, 4, 7)]  # f first, then i,a,b and j,k,c in W's order; once each
    assert ran == [(["f", "i", "a", "b"], ["f", "j", "k", "c"])] * 2 and not cleared


@pytest.mark.parametrize("fresh", [False, True])
def test_gett_writes_a_fresh_output_without_reading_it(fresh, monkeypatch):
    """Forced GETT on a (T)-shaped term: a fresh output (NaN in it) is written as if it held
    zeros, in one kernel with beta = 0 (no clearing first); otherwise the product is added."""
    be, (W, A, B), (hW, hA, hB), c, cleared = _triples_term(monkeypatch, "gett", 5, True, fresh)
    be.contract(c, W, A, B, fresh)
    ref = 1.5 * np.einsum("iafb,kjcf->ijkabc", hA, hB) + (0.0 if fresh else hW)
    assert _relerr(W.get(), ref) <= 1e-12
    assert be.choices[next(iter(be.choices))].method == "gett" and not cleared


SPLIT = [
    # (C, A, B, sizes): TCCG case 19's indices at prime extents (the sum of 1073 in 68 k-tiles),
    # case 13's (a sum of two indices, A's stride-1 index summed), a sum of 15 (one k-tile: with
    # 2 or 16 parts, every part but one empty), a batch index l (the batch tables per part) and
    # a tensor times a matrix whose output's stride-1 index d is not the tensor's a (the
    # store-line order's turned loads, split)
    ("abc", "adec", "ebd", dict(a=9, b=20, c=11, d=37, e=29)),
    ("ab", "acd", "dbc", dict(a=23, b=17, c=31, d=41)),
    ("abc", "adec", "ebd", dict(a=9, b=20, c=11, d=3, e=5)),
    ("lab", "lak", "lkb", dict(l=5, a=19, b=13, k=301)),
    ("abcd", "deca", "be", dict(a=37, b=20, c=2, d=11, e=1201)),
]


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("c,a,b,sizes", SPLIT)
def test_split_sums_are_correct(c, a, b, sizes, view, monkeypatch):
    """Every split candidate (:func:`gett.split_configs` on 132 SMs), and 2 and 16 parts of its
    first shape: the parts' partial products, written into a NaN-poisoned stack of outputs,
    add up to ``alpha·A·B`` against NumPy, each part its k-tiles z·T/Z up to (z+1)·T/Z (a part
    of none writes zeros). Operands contiguous, or views of larger buffers; a batch of 5 in
    launches of 2 batches at most (gridDim.y's limit lowered)."""
    monkeypatch.setattr(launch, "MAX_GRID_Y", 2)
    hA, hB = _arrays(c, a, b, sizes, seed=4, view=view)[1:]
    A, B = _device_views((hA, hB), view)
    ref = 0.5 * np.einsum(f"{a},{b}->{c}", hA, hB)
    shape = tuple(sizes[i] for i in c)
    strides = (_strides(np.empty(shape), c), _strides(A, a), _strides(B, b))
    K = int(np.prod([sizes[i] for i in a if i in b and i not in c]))
    ran = 0
    for order, p in gett.variants(tuple(c), tuple(a), tuple(b), sizes, strides).items():
        tables = launch.GettTables(p, strides)
        left, right = (B, A) if p.swap else (A, B)
        shapes = gett.split_shapes(p)
        for cfg, parts in gett.split_configs(p, 132) + [(shapes[0], 2), (shapes[0], 16)]:
            W = cupy.full((parts,) + shape, cupy.nan)
            launch.launch_gett(cfg, tables, W, left, right, 0.5, 0.0, parts)
            assert _relerr(W.sum(axis=0).get(), ref) <= 1e-12, (order, cfg.name(), parts)
            ktiles = -(-K // cfg.bk)
            empty = [z for z in range(parts) if ktiles * z // parts == ktiles * (z + 1) // parts]
            assert len(empty) == max(0, parts - ktiles) and not cupy.any(W[empty]), (order, cfg.name(), parts)
            ran += 1
    assert ran >= 2


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("fresh", [False, True])
def test_split_gett_writes_or_adds_the_parts_sum(fresh, view, monkeypatch):
    """Forced ``splitk`` on a case-19-shaped contraction, contiguous and as views of larger
    buffers: a fresh output (NaN in it) is written as the parts' sum, otherwise the sum is added;
    the same bits on a second run; against NumPy, with no clearing first."""
    monkeypatch.setenv("CHAINEXEC_GPU_METHOD", "splitk")
    be = device.select("cupy")
    sizes = dict(a=19, b=20, c=11, d=37, e=29)  # 4180 outputs: GETT_MIN_OUTPUT and more
    host = _arrays("abc", "adec", "ebd", sizes, seed=6, view=False)
    C, A, B = _device_views(host, view)
    if fresh:
        C[...] = cupy.nan
    before = C.copy()
    cleared = []
    monkeypatch.setattr(CupyBackend, "clear", lambda self, out: cleared.append(out.shape))
    term = _contraction(("C", "abc"), ("A", "adec"), ("B", "ebd"), factor=-1.25)
    be.contract(term, C, A, B, fresh)
    ref = -1.25 * np.einsum("adec,ebd->abc", host[1], host[2]) + (0.0 if fresh else host[0])
    assert _relerr(C.get(), ref) <= 1e-12
    assert {choice.method for choice in be.choices.values()} == {"splitk"} and not cleared
    again = C.copy()
    C[...] = before
    be.contract(term, C, A, B, fresh)
    assert cupy.array_equal(C, again)


def test_a_split_chosen_elsewhere_runs_the_first_split_here_and_another_beta_is_refused():
    """A split configuration decided for another load direction or an order this problem lacks
    (a classmate's, a probe's) runs the first split candidate of this problem, correctly; without
    any split here (an output too small for GETT) the method runs the direct kernel; ``beta``
    other than 0 or 1 is refused before anything runs."""
    be = device.select("cupy")
    sizes = dict(a=19, b=20, c=11, d=37, e=29)
    hC, hA, hB = _arrays("abc", "adec", "ebd", sizes, seed=8, view=False)
    C, A, B = _device_views((hC, hA, hB), False)
    c = _contraction(("C", "abc"), ("A", "adec"), ("B", "ebd"), factor=2.0)
    ref = 2.0 * np.einsum("adec,ebd->abc", hA, hB)
    order, cfg, parts = be._split(c, C, A, B)[0]
    for bad in ({"order": "elsewhere"}, {"a_k_fast": not cfg.a_k_fast, "parts": 16}):
        config = {"order": order, **asdict(cfg), "parts": parts} | bad
        C[...] = cupy.nan
        methods.REGISTRY["splitk"].run(be, config, c, C, A, B, True)
        assert _relerr(C.get(), ref) <= 1e-12
    with pytest.raises(ValueError, match="beta 0 or 1"):
        be._split_call({"order": order, **asdict(cfg), "parts": parts}, c, C, A, B, 1.0, 0.5)
    small = dict(a=3, b=4, c=5, d=37, e=29)
    hC, hA, hB = _arrays("abc", "adec", "ebd", small, seed=9, view=False)
    C, A, B = _device_views((hC, hA, hB), False)
    assert not be._split(c, C, A, B)
    methods.REGISTRY["splitk"].run(be, {"order": order, **asdict(cfg), "parts": parts}, c, C, A, B, False)
    assert _relerr(C.get(), hC + 2.0 * np.einsum("adec,ebd->abc", hA, hB)) <= 1e-12


def test_elementwise_statements_make_no_temporaries():
    import threading

    be = device.select("cupy")
    for thread in threading.enumerate():  # the warm-up the selection began: its stand-ins are not the statement's
        if thread.name == "chainexec-warm-up":
            thread.join()
    x = cupy.random.standard_normal((30, 40, 50))
    y = cupy.random.standard_normal((50, 30))
    out = cupy.random.standard_normal((30, 40, 50))
    ref = out.get() + 2.0 * x.get() * np.einsum("ca->ac", y.get())[:, None, :]
    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    be.contract(_contraction(("O", "abc"), ("X", "abc"), ("Y", "ca"), factor=2.0), out, x, y)
    assert pool.used_bytes() == before
    assert _relerr(out.get(), ref) <= 1e-14
    z = cupy.random.standard_normal((50, 40, 30))
    ref = out.get() - 3.0 * np.einsum("cba->abc", z.get())
    be.contract(Contraction(id=1, out="O", out_indices=list("abc"), a="Z", a_indices=list("cba"), b=None,
                            b_indices=None, factor=-3.0, accumulate=True, flops=0,
                            statement=1), out, z, None)
    assert _relerr(out.get(), ref) <= 1e-14


def test_tuning_cache_is_reused_across_processes(monkeypatch):
    monkeypatch.setenv("CHAINEXEC_GPU_METHOD", "auto")
    sizes = dict(a=64, b=96, k=80)
    hC, hA, hB = _arrays("ab", "ak", "kb", sizes, seed=2)
    c = _contraction(("C", "ab"), ("A", "ak"), ("B", "kb"))
    first = device.select("cupy")
    C, A, B = _device_views((hC, hA, hB), False)
    first.contract(c, C, A, B)
    choice = next(iter(first.choices.values()))
    assert choice.seconds and min(choice.seconds, key=choice.seconds.get).split(":")[0] == choice.method
    assert first.tuning.path.exists()
    second = device.select("cupy")  # a new process sees the file only
    monkeypatch.setattr(CupyBackend, "_time", lambda *a: pytest.fail("re-timed"))
    second.contract(c, C, A, B)
    assert next(iter(second.choices.values())) == choice
    assert _relerr(C.get(), hC + 2 * (hA @ hB)) <= 1e-12


def test_large_operands_are_tuned_on_a_probe(monkeypatch):
    """A tile above TUNE_BYTES is timed on views with its strides but fewer elements; the choice
    then runs on the whole tile, correctly."""
    monkeypatch.setenv("CHAINEXEC_GPU_METHOD", "auto")
    monkeypatch.setattr(tuning, "TUNE_BYTES", 1 << 20)
    be = device.select("cupy")
    sizes = dict(i=6, j=5, k=7, a=10, b=9, c=8, f=12)
    hW, hA, hB = _arrays("ijkabc", "iafb", "kjcf", sizes, seed=4)
    W, A, B = _device_views((hW, hA, hB), False)
    seen = []
    real = CupyBackend._time
    monkeypatch.setattr(CupyBackend, "_time", lambda self, how, c, o, a, b: seen.append(o.nbytes) or real(
        self, how, c, o, a, b))
    be.contract(_contraction(("W", "ijkabc"), ("ovvv", "iafb"), ("t2", "kjcf")), W, A, B)
    assert seen and max(seen) <= 1 << 20 < W.nbytes
    assert _relerr(W.get(), hW + np.einsum("iafb,kjcf->ijkabc", hA, hB)) <= 1e-12


def _bulk_views(host_arrays):
    """The arrays on the device as interior slices of buffers two elements wider on every axis,
    starting one element in (two on the last axis): B's rows stay 16-byte aligned where its
    extents are even."""
    out = []
    for x in host_arrays:
        big = cupy.full([n + 2 for n in x.shape], cupy.nan)
        sl = tuple(slice(1, 1 + n) for n in x.shape[:-1]) + (slice(2, 2 + x.shape[-1]),)
        big[sl] = cupy.asarray(x)
        out.append(big[sl])
    return out


BULK_LAYOUTS = [
    # (C, B, extents of B's n indices, the copies a row of a chunk takes by tile): B's n index
    # contiguous for 384 columns; runs of 72 (k between B's two n indices), two a chunk of 144;
    # runs of 32, four a chunk of 128 and two of 64
    ("lab", "lkb", dict(b=384), {(8, 2, 2): 1, (8, 1, 4): 1}),
    ("labd", "lbkd", dict(b=6, d=72), {(9, 2, 2): 2, (9, 1, 4): 1}),
    ("labd", "lbkd", dict(b=12, d=32), {(8, 2, 2): 4, (8, 1, 4): 2}),
]


@pytest.mark.parametrize("c, b, n, copies, M", [(*x, M) for x in BULK_LAYOUTS for M in (20, 75)]
                         + [(*BULK_LAYOUTS[0], 150), (*BULK_LAYOUTS[2], 150)])
@pytest.mark.parametrize("K", [1, 7, 19, 72])
def test_bulk_copy_kernels_are_correct(K, M, c, b, n, copies):
    """Every bulk-copy shape of :data:`gett.BULK_TILES` (M in one block row) or
    :data:`gett.BULK_TALL` (M of 150: two or three block rows, the last partial; B contiguous
    along n, or in runs of 32, two a chunk of 64) that B's runs along n admit (whole chunks in a
    run, or a chunk of several runs copied one by one) at spans of one and five chunks (a block's span past N's last chunk), both of A's load directions, a
    batch index, strided views of larger buffers, alpha and beta, 32- and 64-bit offsets, and the
    autotuner's own bulk candidates: against NumPy."""
    sizes = dict(l=2, a=M, k=K, **n)
    ran = 0
    for i, (a, view) in enumerate(product(("lak", "lka"), (False, True))):
        hC, hA, hB = _arrays(c, a, b, sizes, seed=K + M + i)
        ref = np.einsum(f"{a},{b}->{c}", hA, hB)
        C, A, B = _bulk_views((hC, hA, hB)) if view else _device_views((hC, hA, hB), False)
        strides = (_strides(C, c), _strides(A, a), _strides(B, b))
        p = gett.problem(tuple(c), tuple(a), tuple(b), sizes, strides)
        bk = max(4, -(-K // 4) * 4)
        one_row = M <= 16 * gett.BULK_ROWS
        shapes = ([(w, -(-M // 16), mn, st) for w, mn, st in gett.BULK_TILES] if one_row
                  else [(w, mm, mn, 2) for w, mm, mn in gett.BULK_TALL])
        tiles = {t: gett.bulk_copies(p.bulk_run, p.dims[1], 8 * t[0] * t[2]) for t in shapes}
        if (view or K > 1) and one_row:  # contiguous with K = 1, B's n indices merge into one run
            assert {(w, mn, st): x for (w, _, mn, st), x in tiles.items() if x} == copies
        cfgs = [gett.GettConfig(1, w, mm, mn, bk, st, "m16n8k4", p.a_k_fast, True, span=8 * mn * w * chunks,
                                bulk=True, copies=tiles[w, mm, mn, st])
                for (w, mm, mn, st), chunks in product(shapes, (1, 5)) if tiles[w, mm, mn, st]]
        cfgs += gett.bulk_configs(p, 132)
        assert cfgs
        for cfg in cfgs:
            assert cfg.valid(), cfg
            wide = ran % 2 == 1
            C[...] = cupy.nan
            _run(cfg, c, a, b, sizes, C, A, B, 1.0, 0.0, wide=wide)
            assert _relerr(C.get(), ref) <= 1e-12, cfg
            C[...] = cupy.asarray(hC)
            _run(cfg, c, a, b, sizes, C, A, B, 0.5, -1.25, wide=wide)
            assert _relerr(C.get(), 0.5 * ref - 1.25 * hC) <= 1e-12, cfg
            ran += 1
    assert ran >= 16


def test_a_bulk_copy_kernel_refuses_b_off_16_bytes_and_the_backend_falls_back():
    """B one element past a 16-byte boundary: the launch refuses the bulk-copy kernel; the
    backend, handed that configuration (as a tuning cache would), runs the model's best GETT
    kernel instead, and the result matches NumPy."""
    sizes = dict(a=40, b=256, k=24)
    hC, hA, hB = _arrays("ab", "ka", "kb", sizes, seed=9)
    C, A = _device_views((hC, hA), False)
    buf = cupy.empty(hB.size + 1)
    B = buf[1:].reshape(hB.shape)
    B[...] = cupy.asarray(hB)
    cfg = gett.GettConfig(1, 8, 3, 2, 24, 2, "m16n8k4", False, True, span=512, bulk=True)
    with pytest.raises(ValueError, match="16 bytes"):
        _run(cfg, "ab", "ka", "kb", sizes, C, A, B, 1.0, 0.0)
    be = device.select("cupy")
    c = _contraction(("C", "ab"), ("X", "ka"), ("Y", "kb"))
    C[...] = cupy.asarray(hC)
    be._gett_call({"order": "load", **asdict(cfg)}, c, C, A, B, 2.0, 1.0)
    assert _relerr(C.get(), hC + 2.0 * np.einsum("ka,kb->ab", hA, hB)) <= 1e-12
    # the autotuner is offered no bulk-copy candidate for this B, and some for an aligned one
    named = methods.REGISTRY["gett"].configurations(be, c, C, A, B)
    aligned = methods.REGISTRY["gett"].configurations(be, c, C, A, buf[:-1].reshape(hB.shape))
    assert named and not any(x["bulk"] for x in named.values()) and any(x["bulk"] for x in aligned.values())
