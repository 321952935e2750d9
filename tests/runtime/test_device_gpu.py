"""The CuPy backend on a GPU: ``contract`` by each method (``ttgt``, ``kernel``, ``batched``, ``auto``) against
``numpy.einsum`` on random contractions and strided views, the generated-kernel and TTGT paths
against each other, pinned host round trips, ``select``, and whole runs (``chainexec run --backend
cupy`` of the four-index transform and the scaled Expressions A–E, on 1 and 2 ranks) checked
with ``chainexec verify`` / ``numpy.einsum`` and with measured bytes equal to the prediction.

Skipped without CuPy or a CUDA device. Inputs are fresh random normals; the reference is
``numpy.einsum`` in float64 on the host, which shares no code with either GPU path.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import require_gpu  # noqa: E402

cupy = require_gpu()

from chainexec.kernels import batchedgemm  # noqa: E402
from chainexec.planner.plan import Contraction  # noqa: E402
from chainexec.runtime import kernelcache, pointwise  # noqa: E402
from chainexec.runtime.backends import cupy as cupy_backend  # noqa: E402
from chainexec.runtime.backends import methods  # noqa: E402
from chainexec.runtime.backends.cupy import CupyBackend  # noqa: E402
from chainexec.runtime.backends.numpy import NumpyBackend  # noqa: E402
from chainexec.runtime.device import select  # noqa: E402
from tests.conftest import read_report, run_cli, triples_config, write_config  # noqa: E402
from tests.kernels.test_symmetrize import PAIRS  # noqa: E402
from tests.runtime.test_device import TOL, embedded, random_case, reference, relerr  # noqa: E402
from tests.runtime.test_fused import SMALL, check_fused_run  # noqa: E402
from tests.runtime.test_inline import CHAINS as INLINE_CHAINS, LIMITS as INLINE_LIMITS, run_chain  # noqa: E402

pytestmark = pytest.mark.gpu
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


HOLD = r"""
extern "C" __global__ void hold(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(100000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


def hold(seconds: float) -> None:
    """Queue on the current stream one kernel that keeps it busy for ``seconds`` of the device's
    clock, whatever the host does meanwhile: queued work that must outlast the host's calls
    (a run of large products did not when the host was slow, e.g. compiling a kernel between them)."""
    cupy.RawKernel(HOLD, "hold")((1,), (1,), (np.uint64(seconds * 1e9),))


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """One on-disk kernel cache for the whole session (also for the CLI runs, which inherit the
    environment), so that a kernel is compiled once; no method forced from outside."""
    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path_factory.getbasetemp() / "kernels"))
    monkeypatch.delenv("CHAINEXEC_GPU_METHOD", raising=False)


def _operands(rng, c, size, dtype, views: bool, step: bool):
    """Host copies and device arrays (views into larger device buffers when ``views``)."""
    shape = lambda idx: [size[i] for i in idx]  # noqa: E731
    tensors = [c.out_indices, c.a_indices] + ([c.b_indices] if c.b is not None else [])
    devs = []
    for idx in tensors:
        if views:
            devs.append(embedded(rng, shape(idx), dtype, xp=cupy, step=step))
        else:
            arr = cupy.asarray(rng.standard_normal(shape(idx)).astype(dtype))
            devs.append((arr, arr, ...))
    out, big, sl = devs[0]
    a = devs[1][0]
    b = devs[2][0] if c.b is not None else None
    return out, big, sl, a, b


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", ["plain", "batch", "unary", "scalar"])
@pytest.mark.parametrize("method", ["ttgt", "kernel", "batched", "relayout", "packed", "cutensor", "direct", "auto"])
def test_contract_matches_einsum(method, kind, dtype, monkeypatch, tmp_path):
    """Every method, random contractions, contiguous and strided operands; the padding around
    ``out``'s view stays untouched. Kernel-eligible cases (no batch index, non-scalar output) must
    really use the kernel when it is forced, and cuTENSOR (where installed) every case but a 0-d
    tensor. Tuned (``auto``, a tuning cache of its own), each decision is the fastest of every
    applicable method timed, or a timed one's reused for a classmate shape
    (:mod:`chainexec.runtime.backends.shapeclass`). Every third trial ``out`` is fresh
    (``Backend.contract``): NaN in its view, written as if it held zeros (cuBLAS's β = 0 for
    batched GEMM, TTGT's product copied in, else cleared first)."""
    if method == "cutensor" and methods._cutensor(cupy) is None:
        pytest.skip("libcutensor is not installed")
    if method == "auto":
        monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path))
    rng = np.random.default_rng({"plain": 1, "batch": 2, "unary": 3, "scalar": 4}[kind] * 10 + len(dtype))
    backend = CupyBackend(cupy, method, math.inf)  # auto: every candidate timed
    for trial in range(12):
        c, size = random_case(rng, batch=kind == "batch", unary=kind == "unary", scalar=kind == "scalar",
                              max_extent=9)
        views = trial % 2 == 1 and kind != "scalar"
        fresh = trial % 3 == 2
        out, big, sl, a, b = _operands(rng, c, size, dtype, views, step=trial % 4 == 3)
        if fresh:
            out[...] = 0
        before = cupy.asnumpy(big)
        ref = reference(c, cupy.asnumpy(out), cupy.asnumpy(a), None if b is None else cupy.asnumpy(b))
        if fresh:
            out[...] = np.nan
        backend.contract(c, out, a, b, fresh)
        got = cupy.asnumpy(big)
        assert relerr(got[sl], ref) <= TOL[dtype], (method, c, size)
        untouched = np.ones(got.shape, bool)
        untouched[sl] = False
        assert np.array_equal(got[untouched], before[untouched])
        if method in ("batched", "relayout", "packed") and b is not None and not c.pointwise():
            # forced: batched GEMM (on copies), or GETT on packed copies, wherever it is a
            # candidate, else TTGT
            offered = any(m.split(":")[0] == method for m in backend._candidates(c, out, a, b))
            assert backend.choices[backend._kept_key(c, out, a, b)].method == (method if offered else "ttgt")
    for (out_idx, a_idx, b_idx, *_), choice in backend.choices.items():
        eligible = kind == "plain" and all((out_idx, a_idx, b_idx))  # no batch index, no 0-d tensor
        if method == "kernel":
            assert choice.method == ("kernel" if eligible else "ttgt")
        if method == "cutensor":
            assert choice.method == ("cutensor" if all((out_idx, a_idx, b_idx)) else "ttgt")
        if method == "direct":
            assert choice.method == "direct"
        if method == "auto" and choice.seconds:
            # every applicable method was timed and the fastest taken
            assert {"ttgt", "einsum", "direct"} <= set(choice.seconds) and min(choice.seconds.values()) > 0
            assert "kernel" not in choice.seconds or eligible
            assert min(choice.seconds, key=choice.seconds.get).split(":")[0] == choice.method
        if method == "ttgt":
            assert choice.method == "ttgt"
    if method == "auto":  # the untimed ones reused a classmate's decision: a method that won a timing here
        won = {choice.method for choice in backend.choices.values() if choice.seconds}
        assert {choice.method for choice in backend.choices.values()} <= won


# Tile shapes as the executor meets them: the four-index transform's steps, a CCSD-like and a
# (T)-like contraction, with odd extents (partial kernel tiles).
AGREE = [
    (["a", "q", "r", "s"], ["p", "a"], ["p", "q", "r", "s"], dict(p=37, q=33, r=31, s=29, a=35)),
    (["a", "b", "r", "s"], ["q", "b"], ["a", "q", "r", "s"], dict(q=37, b=35, a=33, r=31, s=29)),
    (["a", "b", "c", "s"], ["r", "c"], ["a", "b", "r", "s"], dict(r=37, c=35, a=33, b=31, s=29)),
    (["a", "b", "c", "d"], ["s", "d"], ["a", "b", "c", "s"], dict(s=37, d=35, a=33, b=31, c=29)),
    (["i", "j", "a", "b"], ["i", "k", "a", "c"], ["k", "c", "j", "b"], dict(i=11, j=13, a=21, b=19, k=9, c=23)),
    (["h1", "h2", "h3", "h4", "h5", "h6"], ["h1", "h2", "h3", "h7"], ["h4", "h5", "h6", "h7"],
     {f"h{k}": 7 + k for k in range(1, 8)}),
]


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("views", [False, True])
@pytest.mark.parametrize("case", range(len(AGREE)))
def test_kernel_and_ttgt_agree(case, views, staged, monkeypatch):
    """float64: the generated kernel and TTGT give the same result to 1e-12 (relative), and both
    match numpy.einsum; with ``views`` every operand is a slice of a larger buffer. TTGT's
    copies (its operands' and its product's into ``out``) by the shape-generic kernel, or
    (``staged``) by the kernels compiled per shape that large copies take
    (:data:`~chainexec.runtime.pointwise.SHAPED_BYTES`)."""
    monkeypatch.setattr(pointwise, "SHAPED_BYTES", 0 if staged else math.inf)
    out_idx, a_idx, b_idx, size = AGREE[case]
    rng = np.random.default_rng(100 + case)
    c = Contraction(0, "X", out_idx, "A", a_idx, "B", b_idx, -1.5, True, 0, 0)
    out, big, sl, a, b = _operands(rng, c, size, "float64", views, step=False)
    ref = reference(c, cupy.asnumpy(out), cupy.asnumpy(a), cupy.asnumpy(b))
    results = {}
    for method in ("kernel", "ttgt", "batched"):
        backend = CupyBackend(cupy, method)
        work = big.copy()
        backend.contract(c, work[sl], a, b)
        (choice,) = backend.choices.values()
        assert choice.method == method
        results[method] = cupy.asnumpy(work)[sl]
        assert relerr(results[method], ref) <= 1e-12
    assert relerr(results["kernel"], np.asarray(results["ttgt"], np.float64)) <= 1e-12
    assert relerr(results["batched"], np.asarray(results["ttgt"], np.float64)) <= 1e-12


@pytest.mark.parametrize("chunks", [2, 3, 6])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_pipelined_ttgt_matches_einsum_on_its_streams(chunks, dtype):
    """TTGT pipelined in ``chunks`` on the device's streams: the tile shapes of :data:`AGREE` and
    random contractions (batch indices, factors, views into larger buffers, fresh outputs holding
    NaN), issued from a stream of the test's own, whose next kernel (a sum of ``out``) must see
    every chunk's product without the host waiting in between; the buffer around ``out``
    untouched. Cases whose contraction sums nothing have no pipelined form (plain TTGT runs)."""
    rng = np.random.default_rng(chunks + 10 * len(dtype))
    backend = CupyBackend(cupy, "ttgt")
    cases = [(Contraction(0, "X", o, "A", a, "B", b, -1.5, True, 0, 0), size) for o, a, b, size in AGREE]
    cases += [random_case(rng, batch=k % 2 == 1, max_extent=9) for k in range(10)]
    caller = cupy.cuda.Stream(non_blocking=True)
    for trial, (c, size) in enumerate(cases):
        fresh = trial % 3 == 2
        out, big, sl, a, b = _operands(rng, c, size, dtype, trial % 2 == 1, step=trial % 4 == 3)
        ref = reference(c, np.zeros(out.shape) if fresh else cupy.asnumpy(out), cupy.asnumpy(a), cupy.asnumpy(b))
        if fresh:
            out[...] = np.nan
        before = cupy.asnumpy(big)
        with caller:
            backend._run(("ttgt", {"chunks": chunks}), c, out, a, b, fresh)
            total = out.astype(cupy.float64).sum()
        caller.synchronize()
        got = cupy.asnumpy(big)
        assert relerr(got[sl], ref) <= TOL[dtype], (c, size)
        assert abs(float(total) - ref.sum()) <= TOL[dtype] * float(np.abs(ref).sum()) * 10
        untouched = np.ones(got.shape, bool)
        untouched[sl] = False
        assert np.array_equal(got[untouched], before[untouched])
    assert backend._pipes is not None


def test_pipelined_ttgt_gives_the_same_bits_each_run():
    """A pipelined TTGT run five times on the same operands (a CCSD contraction's shape at odd
    extents) gives the same bits each time, with ``CUBLAS_WORKSPACE_CONFIG`` unset: its GEMMs
    share one stream, for which cuBLAS promises run-to-run reproducibility."""
    import os

    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    rng = np.random.default_rng(5)
    backend = CupyBackend(cupy, "ttgt")
    c = Contraction(0, "X", list("abcd"), "A", list("aebf"), "B", list("dfce"), 0.5, True, 0, 0)
    size = dict(zip("abcdef", (47, 40, 33, 24, 25, 16)))
    a, b = (cupy.asarray(rng.standard_normal([size[i] for i in idx])) for idx in (c.a_indices, c.b_indices))
    start = cupy.asarray(rng.standard_normal([size[i] for i in c.out_indices]))
    runs = []
    for _ in range(5):
        out = start.copy()
        backend._run(("ttgt", {"chunks": 3}), c, out, a, b, False)
        runs.append(cupy.asnumpy(out))
    want = reference(c, cupy.asnumpy(start), cupy.asnumpy(a), cupy.asnumpy(b))
    assert relerr(runs[0], want) <= 1e-12
    assert all(np.array_equal(run, runs[0]) for run in runs[1:])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_relayout_on_the_triples_terms(dtype):
    """The twelve (T) W terms forced to ``relayout`` as the executor passes them (a whole W tile;
    the operands cut from whole arrays along the occupied indices): each equals numpy.einsum, and
    the terms whose copies make larger GEMMs (the ``ovvv`` ones holding two indices adjacent in
    W among them) really run that way."""
    from tests.kernels.test_sumkernel import W_TERMS

    rng = np.random.default_rng(17 + len(dtype))
    o, v, t = 7, 13, 2
    full = {name: rng.standard_normal(shape).astype(dtype) for name, shape in
            (("ovvv", (o, v, v, v)), ("t2", (o, o, v, v)), ("ovoo", (o, v, o, o)))}
    occ = {"i": slice(0, t), "j": slice(t, 2 * t), "k": slice(2 * t + 1, 3 * t + 1)}
    on_gpu = {name: cupy.asarray(x) for name, x in full.items()}
    backend = CupyBackend(cupy, "relayout")
    W = cupy.asarray(rng.standard_normal((t,) * 3 + (v,) * 3).astype(dtype))
    ref = cupy.asnumpy(W).astype(np.float64)
    used = []
    for n, (a_idx, b_idx, factor) in enumerate(W_TERMS):
        cut = [tuple(occ.get(i, slice(None)) for i in idx) for idx in (a_idx, b_idx)]
        name = "ovvv" if "f" in a_idx else "ovoo"
        a, b = on_gpu[name][cut[0]], on_gpu["t2"][cut[1]]
        c = Contraction(n, "W", list("ijkabc"), "A", list(a_idx), "B", list(b_idx), factor, True, 0, n)
        backend.contract(c, W, a, b)
        ref += factor * np.einsum(f"{a_idx},{b_idx}->ijkabc", full[name][cut[0]].astype(np.float64),
                                  full["t2"][cut[1]].astype(np.float64))
        if backend.choices[backend._kept_key(c, W, a, b)].method == "relayout":
            used.append(a_idx)
    assert relerr(cupy.asnumpy(W), ref) <= TOL[dtype]
    assert {"iafb", "jbfa", "jbfc", "kcfb"} <= set(used), used


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("out_idx,a_idx,b_idx,size,path", [
    ("abc", "ad", "bdc", dict(a=40, b=30, c=20, d=25), "strided"),
    ("ijkabc", "iafc", "jkbf", dict(i=3, j=3, k=3, a=12, b=11, c=13, f=10), "pointer-array"),
    ("ijkabc", "iajm", "mkbc", dict(i=2, j=1, k=3, a=17, b=15, c=16, m=9), "nested-strided"),
    ("ab", "alk", "klb", dict(a=40, b=50, k=3, l=4), "k-loop"),
    ("ab", "ak", "kb", dict(a=70, b=50, k=60), "transposed-out"),
])
def test_batched_gemm_paths(out_idx, a_idx, b_idx, size, path, dtype):
    """Each form of cuBLAS call the batched method makes — strided batches, one pointer-array
    call, strided calls nested in loops over output modes, a looped contracted mode, the output
    computed as its transpose — on views cut from larger buffers (padding untouched), against
    numpy.einsum."""
    rng = np.random.default_rng(len(path) + len(dtype))
    c = Contraction(0, "X", list(out_idx), "A", list(a_idx), "B", list(b_idx), -0.75, True, 0, 0)
    out, big, sl, a, b = _operands(rng, c, size, dtype, True, step=False)
    before = cupy.asnumpy(big)
    ref = reference(c, cupy.asnumpy(out), cupy.asnumpy(a), cupy.asnumpy(b))
    backend = CupyBackend(cupy, "batched")
    backend.contract(c, out, a, b)
    g, _, launches, _ = backend._batched(c, out, a, b)
    expect = {"strided": all(x.strided for x in launches), "pointer-array": not launches[0].strided,
              "nested-strided": len(launches) > 1 and all(x.strided and x.first for x in launches),
              "k-loop": len(launches) > 1 and not launches[1].first,
              "transposed-out": len(launches) == 1 and batchedgemm.blas(g).swap}
    assert expect[path], g
    got = cupy.asnumpy(big)
    assert relerr(got[sl], ref) <= TOL[dtype]
    untouched = np.ones(got.shape, bool)
    untouched[sl] = False
    assert np.array_equal(got[untouched], before[untouched])


@pytest.mark.parametrize("shape,cut,pinned", [
    ((300, 40, 7), (slice(3, 250, 2), slice(1, 39)), True), ((), (), True),
    ((30, 40, 7), (slice(3, 25, 2), slice(1, 39)), False), ((), (), False)],
    ids=["view-page-locked", "0d-page-locked", "small-view-plain", "0d-plain"])
def test_to_host_async_arrives_behind_queued_work(shape, cut, pinned):
    """An accumulate's copy to the host (:meth:`CupyBackend.to_host_async`) queued behind kernels
    that change the array: the call returns before they have run, and once arrived the host
    array holds what they computed and nothing queued after the call (views and 0-d arrays
    alike), in page-locked memory, or in plain memory in a run of plain host buffers (a small
    array: copied on the device first, DEFERRED_BYTES)."""
    rng = np.random.default_rng(4)
    backend = CupyBackend(cupy)
    backend.expect_transfers(pinned)
    assert backend.pinned == pinned
    start = rng.standard_normal(shape)
    dev = cupy.asarray(start)
    # a first call: CuPy's first page-locked allocation waits for the device, and its first copy
    # of a strided view loads a kernel
    backend.to_host_async(dev[cut])
    backend.wait()
    for _ in range(50):
        dev *= 1.001
    hold(0.5)  # queued work that outlasts the host's call
    host, token = backend.to_host_async(dev[cut])
    assert not backend.arrived(token)  # returned before the queued kernels ran
    later = dev[cut].copy()
    dev += 1.0  # queued after the copy: not in it
    backend.wait()
    assert backend.arrived(token)
    assert host.shape == start[cut].shape and np.array_equal(host, cupy.asnumpy(later))
    assert np.allclose(host, start[cut] * 1.001 ** 50, rtol=1e-12)
    locked = cupy.cuda.runtime.pointerGetAttributes(host.ctypes.data).type == cupy.cuda.runtime.memoryTypeHost
    assert locked == pinned


def test_small_copy_delivered_when_found_arrived():
    """In a run of plain host buffers, a small copy to the host is delivered by the
    :meth:`CupyBackend.arrived` that first finds it done, without :meth:`CupyBackend.wait`, while
    work queued after it still runs; the copies the executor has not asked about stay pending."""
    backend = CupyBackend(cupy)
    backend.expect_transfers(False)
    values = cupy.asarray(np.random.default_rng(8).standard_normal(5))
    values += 0.0  # the addition's kernel compiled now, not while the hold below runs
    before = cupy.asnumpy(values)
    copies = [backend.to_host_async(values[k]) for k in range(5)]
    hold(5.0)  # outlasts the host's polling, also on a host busy with other processes
    values += 1.0  # queued after the copies: not in them
    deadline = time.monotonic() + 30
    while not backend.arrived(copies[0][1]):
        assert time.monotonic() < deadline, "the first copy never arrived"
    assert not cupy.cuda.get_current_stream().done  # the products still run
    assert copies[0][0] == before[0]
    assert len(backend._deferred) == 4
    backend.wait()
    assert not backend._deferred
    assert [float(h) for h, _ in copies] == before.tolist()


def test_to_host_aside_waits_for_queued_work_and_is_waited_for():
    """A result's copy to the host aside (``Loop.back``): on a stream of its own, it starts after
    the work queued before it on the compute stream; work queued after :meth:`wait_for` its
    token starts after it, so a change of the array queued then is not in the copy."""
    rng = np.random.default_rng(5)
    backend = CupyBackend(cupy)
    start = rng.standard_normal((1024, 512))
    dev = cupy.asarray(start)
    backend.to_host_async(dev, aside=True)  # a first call: the first page-locked allocation waits
    backend.wait()
    hold(0.5)
    dev *= 2.0  # queued behind the held stream
    host, token = backend.to_host_async(dev, aside=True)
    assert not backend.arrived(token)
    backend.wait_for(token)
    dev += 1.0
    backend.wait()
    assert backend.arrived(token)
    assert np.array_equal(host, 2.0 * start) and np.array_equal(cupy.asnumpy(dev), 2.0 * start + 1.0)
    hold(0.5)  # once more behind long work, with no wait_for: wait() waits for the copy too
    dev *= 3.0
    host, token = backend.to_host_async(dev, aside=True)
    backend.wait()
    assert backend.arrived(token) and np.array_equal(host, cupy.asnumpy(dev))
    assert np.allclose(host, 6.0 * start + 3.0, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("pinned, aside", [(True, False), (True, True), (False, False)])
def test_reach_copy_returns_once_arrived(pinned, aside):
    """:meth:`CupyBackend.reach_copy` returns once a copy queued behind long work has arrived:
    into page-locked memory, aside, and a small copy into plain memory (delivered by it)."""
    backend = CupyBackend(cupy)
    backend.expect_transfers(pinned)
    dev = cupy.asarray(np.random.default_rng(6).standard_normal((64, 33) if pinned else (3,)))
    backend.to_host_async(dev, aside=aside)  # first uses: page-locked pool, kernels
    dev *= 2.0
    dev += 0.0  # the kernels below compiled now, not while the hold runs
    expected = cupy.asnumpy(dev)
    hold(1.0)
    dev *= 3.0
    host, token = backend.to_host_async(dev, aside=aside)
    if aside:  # an aside copy's array changes only after the work that follows waits for it
        backend.wait_for(token)
    dev += 1.0  # queued after the copy
    assert not backend.arrived(token)
    backend.reach_copy(token)
    assert backend.arrived(token)
    assert np.array_equal(host, 3.0 * expected)
    backend.wait()


def test_results_copied_back_aside_on_gpu(tmp_path):
    """The four-index transform on 3 ranks whose tile loops copy their results back aside:
    equal to numpy.einsum, movement and peaks as planned (tests/runtime/test_run.py)."""
    from tests.runtime.test_run import fourindex_copied_back

    fourindex_copied_back(tmp_path, 3, "cupy")


@pytest.mark.parametrize("aside, bound", [(True, None), (True, 256), (False, 512)],
                         ids=["aside", "aside-bound", "in-parts"])
def test_results_copied_back_into_page_locked_memory(tmp_path, monkeypatch, aside, bound):
    """One rank in this process, with page-locked host buffers forced (a run that moves little
    copies into plain memory, where every copy returns only once done, which would hide a race):
    the four-index transform whose first tile loop copies its result back aside (``aside``)
    equals numpy.einsum; movement and peaks as planned. With a landing bound below its result
    tiles (the aside ones 512 B, the others 1 KiB), every tile beyond it not copied back aside
    goes back in parts of at most 128 B, and those copied back aside go whole."""
    from chainexec import api, spec
    from chainexec.planner.build import make_plan
    from chainexec.planner.machine import Machine
    from chainexec.planner.plan import ops
    from chainexec.runtime import landing
    from tests.conftest import fourindex_config
    from tests.runtime.test_run import check_fourindex

    if bound:
        monkeypatch.setattr(landing, "LANDING_BYTES", bound)
        monkeypatch.setattr(landing, "PART_BYTES", 128)
    config = write_config(tmp_path, fourindex_config(global_memory="1MiB", device_memory="6KiB"))
    machine = Machine(aside_copy_bytes=0 if aside else 1 << 40, pinned_from_bytes=0)
    (tmp_path / "machine.json").write_text(machine.to_json())
    plan = make_plan(spec.load(config), machine)
    assert any(loop.back for nest in plan.nests for _, loops in ops(nest.body) for loop in loops) == aside
    assert run_cli("generate", config).returncode == 0
    sizes = {False: [], True: []}  # bytes of each copy to the host, by whether it was made aside
    copy = CupyBackend.to_host_async
    monkeypatch.setattr(CupyBackend, "to_host_async",
                        lambda self, array, aside=False: (sizes[aside].append(array.nbytes), copy(self, array, aside))[1])
    run = api.run(config, backend="cupy", machine=str(tmp_path / "machine.json"))
    assert bool(sizes[True]) == aside and max(sizes[False] + sizes[True]) <= 1024
    if bound:  # tiles beyond the bound in parts unless copied back aside
        assert max(sizes[False]) <= bound and max(sizes[True], default=1024) > bound
    assert run["measured"]["bytes"] == run["predicted"]["bytes"]
    assert run["measured"]["memory_peak"] == run["predicted"]["memory_peak"]
    check_fourindex(tmp_path)


def test_host_round_trip_pinned():
    rng = np.random.default_rng(5)
    backend = CupyBackend(cupy)
    host = rng.standard_normal((17, 9, 5))
    dev = backend.zeros(host.shape, host.dtype)
    backend.upload(dev, host)
    assert np.array_equal(cupy.asnumpy(dev), host)
    view = dev[2:11, 1:8]
    back, _ = backend.to_host_async(view)
    backend.wait()
    assert isinstance(back, np.ndarray) and back.flags.c_contiguous
    assert np.array_equal(back, host[2:11, 1:8])
    attrs = cupy.cuda.runtime.pointerGetAttributes(back.ctypes.data)
    assert attrs.type == cupy.cuda.runtime.memoryTypeHost  # page-locked (CuPy's pinned pool)
    again = backend.zeros(back.shape, back.dtype)
    backend.upload(again, back)  # pinned input: direct DMA path
    assert np.array_equal(cupy.asnumpy(again), host[2:11, 1:8])
    inner = cupy.zeros((20, 9, 6))[1:10, :, 2]  # strided destination and source
    backend.upload(inner, host[::2, :, 1])
    assert np.array_equal(cupy.asnumpy(inner), host[::2, :, 1])
    zero = backend.zeros((4, 3), np.float32)
    assert zero.dtype == np.float32 and not zero.any()


@pytest.mark.parametrize("text", ["1 / (e[i] + e[j] + e[k] - f[a] - f[b] - f[c])", "2 * x[a,i] - y[i] / x[a,i] + 1 / 2"])
def test_expressions_fill_strided_tiles_in_one_kernel(text):
    """The generated element-wise kernel equals the NumPy evaluation (which shares only the
    parser with it) on a strided view of a larger buffer, and leaves the rest of it alone."""
    from chainexec import expr

    rng = np.random.default_rng(11)
    tree = expr.parse(text)
    order = tuple(i for i in "ijkabc" if i in text)
    size = {i: n for i, n in zip("ijkabc", (3, 4, 2, 5, 3, 4))}
    base = {}
    for r in expr.refs(tree):
        base.setdefault(r.tensor, rng.standard_normal([6] * len(r.indices)) + 4)
    host = {r: base[r.tensor][tuple(slice(0, size[i]) for i in r.indices)] for r in expr.refs(tree)}
    expected = np.broadcast_to(expr.evaluate(tree, host, order, np), [size[i] for i in order])
    big = cupy.asarray(rng.standard_normal([size[i] + 2 for i in order]))
    before = cupy.asnumpy(big)
    inner = tuple(slice(1, 1 + size[i]) for i in order)
    CupyBackend(cupy).evaluate(tree, {r: cupy.asarray(a) for r, a in host.items()}, order, big[inner])
    got = cupy.asnumpy(big)
    assert relerr(got[inner], expected) <= 1e-14
    got[inner] = before[inner]
    assert np.array_equal(got, before)


def test_pointwise_terms_in_one_pass():
    """Outer products, a Hadamard product and permuted copies added into one strided tile by one
    generated kernel equal the sum of numpy.einsum terms."""
    rng = np.random.default_rng(3)
    size = {"i": 3, "j": 4, "k": 5, "a": 6}
    out_ix = ["i", "j", "k", "a"]
    specs = [(["i", "a"], ["k", "j"], 1.0), (["j", "i", "a", "k"], None, -2.0), (["i", "j"], ["i", "j", "k", "a"], 0.5),
             (["a", "k", "j", "i"], None, 4.0)]
    cs, operands, expected = [], [], np.zeros([size[i] for i in out_ix])
    for n, (ax, bx, f) in enumerate(specs):
        a = rng.standard_normal([size[i] for i in ax])
        b = rng.standard_normal([size[i] for i in bx]) if bx else None
        c = Contraction(n, "Y", out_ix, f"A{n}", ax, f"B{n}" if bx else None, bx, f, True, 0, n)
        assert c.pointwise()
        cs.append(c)
        operands.append((cupy.asarray(a), cupy.asarray(b) if bx else None))
        lhs = "".join(ax) + ("," + "".join(bx) if bx else "")
        expected += f * (np.einsum(f"{lhs}->ijka", a, b) if bx else np.einsum(f"{lhs}->ijka", a))
    start = rng.standard_normal([size[i] + 1 for i in out_ix])
    big = cupy.asarray(start)
    CupyBackend(cupy).contract_terms(cs, big[1:, 1:, 1:, 1:], operands)
    got = cupy.asnumpy(big)
    assert relerr(got[1:, 1:, 1:, 1:], start[1:, 1:, 1:, 1:] + expected) <= 1e-14
    assert np.array_equal(got[0], start[0]) and np.array_equal(got[:, :, :, 0], start[:, :, :, 0])
    big[1:, 1:, 1:, 1:] = np.nan  # fresh: written, not added to
    CupyBackend(cupy).contract_terms(cs, big[1:, 1:, 1:, 1:], operands, fresh=True)
    got = cupy.asnumpy(big)
    assert relerr(got[1:, 1:, 1:, 1:], expected) <= 1e-14
    assert np.array_equal(got[0], start[0]) and np.array_equal(got[:, :, :, 0], start[:, :, :, 0])


@pytest.mark.parametrize("stage", [64, 4096, 1 << 20], ids=["row-above-stage", "chunks", "one-piece"])
def test_fetch_through_staging_buffers(stage, monkeypatch):
    """``fetch`` fills a device tile from a host source chunk by chunk through two page-locked
    buffers used in turn (each refilled only after its copy finished; a row per chunk where a row
    is wider than a chunk), or in one piece when the tile fits one chunk: the tile equals the
    source whatever the chunk size, and every row is read once."""
    monkeypatch.setattr(cupy_backend, "STAGE_BYTES", stage)
    source = np.random.default_rng(8).standard_normal((37, 11, 6))
    reads = []

    def read(rows, out):
        reads.append((rows.start, rows.stop))
        out[...] = source[rows]

    backend = CupyBackend(cupy)
    dst = backend.zeros(source.shape, source.dtype)
    backend.fetch(dst, read)
    assert np.array_equal(cupy.asnumpy(dst), source)
    assert sorted(r for lo, hi in reads for r in range(lo, hi)) == list(range(37))
    row = 11 * 6 * 8
    assert len(reads) == (1 if stage >= source.nbytes else 37 if row > stage else -(-37 // (stage // row)))
    scalar = backend.zeros((), np.float64)
    backend.fetch(scalar, lambda rows, out: out.fill(2.5))
    assert float(scalar) == 2.5


def test_only_one_piece_page_locked_fetches_are_queued(monkeypatch):
    """``fetch_waits``: a tile fetched in one piece from page-locked memory is queued behind the
    work before it; one fetched chunk by chunk, or from plain memory, waits for that work (the
    executor then waits first, so the get's seconds are its own)."""
    monkeypatch.setattr(cupy_backend, "STAGE_BYTES", 4096)
    backend = CupyBackend(cupy)
    small, large = backend.zeros((4, 8), np.float64), backend.zeros((64, 64), np.float64)
    assert not backend.fetch_waits(small) and backend.fetch_waits(large)
    backend.pinned = False
    assert backend.fetch_waits(small)


@pytest.mark.parametrize("pinned", [False, True], ids=["small-run-plain-memory", "large-run-page-locked"])
def test_runs_page_lock_host_buffers_only_when_the_plan_says(pinned, monkeypatch):
    """A run the plan does not pin (``Plan.pinned``: it moves less than
    ``Machine.pinned_from_bytes`` per rank) stages through plain memory (the first page-lock of
    a process costs ~0.5 s); fetch and to_host_async are right either way."""
    monkeypatch.setattr(cupy_backend, "STAGE_BYTES", 4096)
    backend = CupyBackend(cupy)
    backend.expect_transfers(pinned)
    assert backend.pinned == pinned
    source = np.random.default_rng(12).standard_normal((29, 7, 5))
    dst = backend.zeros(source.shape, source.dtype)
    backend.fetch(dst, lambda rows, out: out.__setitem__(Ellipsis, source[rows]))
    assert np.array_equal(cupy.asnumpy(dst), source)
    back, _ = backend.to_host_async(dst[3:17, :, 1:4])
    backend.wait()
    assert np.array_equal(back, source[3:17, :, 1:4]) and back.flags.c_contiguous
    locked = cupy.cuda.runtime.pointerGetAttributes(back.ctypes.data).type == cupy.cuda.runtime.memoryTypeHost
    assert locked == backend.pinned


def test_upload_returns_before_queued_work_is_done():
    """``upload`` from page-locked memory is queued behind the work before it and returns at
    once; the tile holds the host data once the device gets there."""
    backend = CupyBackend(cupy)
    a = cupy.asarray(np.random.default_rng(3).standard_normal((4096, 4096)))
    for _ in range(20):
        a = a @ a * (1 / 64)
    host = backend.host_empty((1024, 1024), np.float64)
    host[...] = np.random.default_rng(4).standard_normal(host.shape)
    dst = backend.zeros(host.shape, host.dtype)
    backend.upload(dst, host)
    assert not cupy.cuda.get_current_stream().done
    backend.wait()
    assert np.array_equal(cupy.asnumpy(dst), host)


@pytest.mark.parametrize("stage", [4096, 1 << 26], ids=["chunked", "one-piece"])
def test_fetch_aside_runs_beside_queued_work(stage, monkeypatch):
    """``fetch_aside`` copies on its own stream while the work queued before it still runs (its
    staged chunks do not wait for that work), and work queued after it sees the data: a sum
    queued right after equals the source, also when a kernel queued before writes elsewhere."""
    monkeypatch.setattr(cupy_backend, "STAGE_BYTES", stage)
    backend = CupyBackend(cupy)
    backend.expect_transfers(5 << 30)
    source = np.random.default_rng(6).standard_normal((96, 33, 7))
    dst = backend.zeros(source.shape, source.dtype)
    backend.wait()  # as in the executor: nothing pending on dst itself (its zero fill)
    a = cupy.asarray(np.random.default_rng(5).standard_normal((4096, 4096)))
    for _ in range(20):
        a = a @ a * (1 / 64)
    backend.fetch_aside(dst, lambda rows, out: out.__setitem__(Ellipsis, source[rows]))
    assert not cupy.cuda.get_current_stream().done  # the matrix products are still running
    total = dst.sum()
    after = dst * 2
    backend.wait()
    assert np.array_equal(cupy.asnumpy(after), 2 * source)
    assert abs(float(total) - source.sum()) <= 1e-12 * np.abs(source).sum()


@pytest.mark.parametrize("stage", [4096, 1 << 26], ids=["chunked", "one-piece"])
def test_fetch_aside_after_waits_for_the_last_reader(stage, monkeypatch):
    """A slot refilled on the second stream while the compute stream still has a reader of its
    old contents queued: with ``after`` (a stamp after that reader) the reader sees the old
    tile and the work queued after the fetch the new one. Without it the copy overtakes the
    reader, queued behind matrix products: measured on the H100 with ``after`` ignored, the
    chunked case fails; the one-piece case still passed (something in its path waits; not
    found), so only the chunked case is known to see the race."""
    monkeypatch.setattr(cupy_backend, "STAGE_BYTES", stage)
    backend = CupyBackend(cupy)
    backend.expect_transfers(5 << 30)
    rng = np.random.default_rng(8)
    old, new = rng.standard_normal((96, 33, 7)), rng.standard_normal((96, 33, 7))
    dst = cupy.asarray(old)
    # twice before, so that a page-locked block of this size is free in CuPy's pool: a new one
    # (cudaHostAlloc) would wait for the device and hide the race
    for _ in range(2):
        backend.fetch_aside(dst, lambda rows, out: out.__setitem__(Ellipsis, old[rows]))
    backend.wait()
    a = cupy.asarray(rng.standard_normal((4096, 4096)))
    for _ in range(20):
        a = a @ a * (1 / 64)
    seen = dst.sum()  # the last reader of the old tile, queued behind the products
    mark = backend.stamp()
    backend.fetch_aside(dst, lambda rows, out: out.__setitem__(Ellipsis, new[rows]), after=mark)
    total = dst.sum()
    backend.wait()
    assert abs(float(seen) - old.sum()) <= 1e-12 * np.abs(old).sum()
    assert abs(float(total) - new.sum()) <= 1e-12 * np.abs(new).sum()
    assert np.array_equal(cupy.asnumpy(dst), new)


@pytest.mark.parametrize("moved", [0, 5 << 30], ids=["plain", "page-locked"])
@pytest.mark.parametrize("at_hand", [True, False])
@pytest.mark.parametrize("strided", [False, True])
def test_fetch_from_host_memory_at_hand(moved, at_hand, strided, monkeypatch):
    """Rows that ``view`` finds in host memory go to a contiguous device tile without ``read``:
    in a run of plain host memory in one copy from there, in a page-locked run through the
    staging buffers in pieces (the tile is larger than one); otherwise (no view, a strided tile)
    through ``read`` as before. Either way the tile equals the source, and overwriting the
    source once ``fetch_aside`` has returned does not reach the device, though the copy was
    queued behind matrix products."""
    monkeypatch.setattr(cupy_backend, "STAGE_BYTES", 4096)
    backend = CupyBackend(cupy)
    backend.expect_transfers(moved)
    rng = np.random.default_rng(12)
    source = rng.standard_normal((40, 21, 9))
    kept = source.copy()
    whole = backend.zeros((40, 21, 12), source.dtype)
    dst = whole[:, :, :9] if strided else backend.zeros(source.shape, source.dtype)
    backend.wait()
    reads = []

    def read(rows, out):
        reads.append(rows)
        out[...] = source[rows]

    a = cupy.asarray(rng.standard_normal((4096, 4096)))
    for _ in range(10):
        a = a @ a * (1 / 64)
    backend.fetch_aside(dst, read, view=(lambda rows: source[rows]) if at_hand else None)
    source[...] = np.nan
    backend.wait()
    assert np.array_equal(cupy.asnumpy(dst), kept)
    assert (not reads) == (at_hand and not strided)


@pytest.mark.parametrize("stage", [64, 1000, 4096], ids=["row-above-stage", "pieces-across-rows", "rows-per-piece"])
def test_rows_at_hand_reach_a_page_locked_run_in_pieces_of_a_stage(stage, monkeypatch):
    """In a page-locked run, rows that ``view`` finds in host memory reach a tile larger than a
    staging buffer in pieces of the buffer's size, cut anywhere in a row, without ``read``: the
    tile equals the source, and the staging buffers stay one piece long however long a row is
    (a (T) ``ovvv`` row is 512 MB at v = 400)."""
    monkeypatch.setattr(cupy_backend, "STAGE_BYTES", stage)
    source = np.random.default_rng(9).standard_normal((37, 11, 6))
    backend = CupyBackend(cupy)
    backend.expect_transfers(True)
    dst = backend.zeros(source.shape, source.dtype)
    reads = []
    backend.fetch(dst, lambda rows, out: reads.append(rows), view=lambda rows: source[rows])
    assert np.array_equal(cupy.asnumpy(dst), source) and not reads
    assert [s.nbytes for s in backend._stages] == [stage, stage]


def test_pinned_buffers_can_be_reused_at_once():
    """The executor fetches each tile into a pinned buffer from CuPy's pool and drops it right
    after ``upload``; the next fetch may get the same block, while the copy is still queued. The
    backend keeps the block until its copy is done (a regression: an asynchronous copy from
    reused pinned memory corrupted (T) tiles)."""
    backend = CupyBackend(cupy)
    copies = []
    for v in range(12):
        host = backend.host_empty((2048, 2048), np.float64)
        host[...] = v
        copies.append(backend.zeros(host.shape, host.dtype))
        backend.upload(copies[-1], host)
        del host  # back to the pinned pool: the next iteration reuses the block
    assert [float(c.min()) for c in copies] == list(range(12))
    assert [float(c.max()) for c in copies] == list(range(12))


@pytest.mark.parametrize("pinned", [False, True])
def test_landed_results_host_arrays_serve_the_next_results(pinned):
    """In a run of plain host memory, a result's host array given back
    (:meth:`CupyBackend.recycle_host`, as landing does once it is written into its global array)
    is the next result's of the same bytes and holds that result's values; one of other bytes
    gets an array of its own; arrays beyond ``SPARE_BYTES`` are not kept, and a new run keeps
    none of the last's. A pinned run keeps none (CuPy's page-locked pool serves them again)."""
    backend = CupyBackend(cupy)
    backend.expect_transfers(pinned)
    rng = np.random.default_rng(5)
    first = cupy.asarray(rng.standard_normal((128, 96)))  # past DEFERRED_BYTES: copied into an array of its own
    host, token = backend.to_host_async(first)
    backend.reach_copy(token)
    assert np.array_equal(host, cupy.asnumpy(first)) and backend._pinned(host) == pinned
    where = host.ctypes.data
    backend.recycle_host(host)
    assert backend._spare_bytes == (0 if pinned else 128 * 96 * 8)
    for shape in ((96, 128), (12288,)):  # the same bytes in another shape
        nxt = cupy.asarray(rng.standard_normal(shape))
        again, token = backend.to_host_async(nxt)
        backend.reach_copy(token)
        assert again.shape == shape and np.array_equal(again, cupy.asnumpy(nxt))
        assert pinned or again.ctypes.data == where
        backend.recycle_host(again)
    if pinned:
        assert backend._spare_bytes == 0 and not backend._spare
        return
    other, token = backend.to_host_async(cupy.ones((100, 100)))
    backend.reach_copy(token)
    assert other.ctypes.data != where and np.all(other == 1.0)
    big = backend.host_empty((cupy_backend.SPARE_BYTES // 8 + 1,), np.float64)
    backend.recycle_host(big)
    assert backend._spare_bytes == 128 * 96 * 8
    backend.expect_transfers(pinned)
    assert backend._spare_bytes == 0 and not backend._spare


def test_memory_limit_falls_back_to_gett():
    """When no device memory is left for TTGT's temporaries (here: a pool limit), a contraction
    forced to TTGT runs through GETT instead, correctly; the pool never exceeds the limit."""
    pool = cupy.get_default_memory_pool()
    rng = np.random.default_rng(9)
    backend = CupyBackend(cupy, "ttgt")
    hW = rng.standard_normal((40, 30, 50, 60))
    hA = rng.standard_normal((40, 70, 60))
    hB = rng.standard_normal((50, 30, 70))
    W, A, B = (cupy.asarray(x) for x in (hW, hA, hB))
    c = Contraction(id=0, out="W", out_indices=list("iajb"), a="A", a_indices=list("ikb"), b="B",
                    b_indices=list("jak"), factor=1.5, accumulate=True, flops=0, statement=0)
    # The contraction allocates from a pool of its own, limited to half of W (TTGT's product alone
    # is W-sized): free blocks that earlier tests left in the default pool's chunks still in use
    # would otherwise serve it or count against the limit.
    own = cupy.cuda.MemoryPool()
    own.set_limit(size=W.nbytes // 2)
    cupy.cuda.set_allocator(own.malloc)
    try:
        backend.contract(c, W, A, B)
        assert 0 < own.total_bytes() <= own.get_limit()
    finally:
        cupy.cuda.set_allocator(pool.malloc)
    assert next(iter(backend.choices.values())).method == "gett"
    assert relerr(cupy.asnumpy(W), hW + 1.5 * np.einsum("ikb,jak->iajb", hA, hB)) <= 1e-12


@pytest.mark.parametrize("room", ["none", "plenty"])
def test_workspace_limit_keeps_methods_without_temporaries(room, tmp_path, monkeypatch):
    """With no device memory left beyond the plan's buffers the autotuner keeps only the direct
    kernel (no temporaries; GETT's offset tables would not fit, batched GEMM's timing needs a
    scratch output), untimed as the only candidate, and
    does not take a choice cached under more memory; with room, TTGT and einsum are timed too.
    Either way the result is right."""
    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path))  # same key in both cases
    rng = np.random.default_rng(11)
    hW, hA, hB = (rng.standard_normal(shape) for shape in ((36, 28, 44, 52), (36, 60, 52), (44, 28, 60)))
    c = Contraction(id=0, out="W", out_indices=list("iajb"), a="A", a_indices=list("ikb"), b="B",
                    b_indices=list("jak"), factor=0.5, accumulate=True, flops=0, statement=0)
    for limit in ([1 << 40] if room == "plenty" else [1 << 40, 0]):
        backend = CupyBackend(cupy, "auto", math.inf)
        backend.limit_memory(limit, 0)
        W, A, B = (cupy.asarray(x) for x in (hW, hA, hB))
        backend.contract(c, W, A, B)
        (choice,) = backend.choices.values()
        assert relerr(cupy.asnumpy(W), hW + 0.5 * np.einsum("ikb,jak->iajb", hA, hB)) <= 1e-12
    timed = {m.split(":")[0] for m in choice.seconds}
    if room == "plenty":
        assert {"ttgt", "einsum"} <= timed
    else:
        assert choice.method == "direct" and timed == set()  # the only candidate: not timed


def test_select_binds_gpu(monkeypatch):
    assert select("cupy").name == "cupy"
    assert select("auto").name == "cupy"
    assert cupy.cuda.Device().id == 0
    monkeypatch.setenv("CHAINEXEC_GPU_METHOD", "ttgt")
    assert select("cupy").method == "ttgt"


def test_warm_up_runs_beside_the_backend():
    """``select`` starts the warm-up on a thread of its own; the backend computes right while it
    may still run, and the thread ends by itself."""
    backend = select("cupy")
    warm = [t for t in threading.enumerate() if t.name == "chainexec-warm-up"]
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((40, 30)), rng.standard_normal((30, 50))
    c = Contraction(0, "X", ["i", "j"], "A", ["i", "k"], "B", ["k", "j"], 0.5, True, 0, 0)
    out = cupy.zeros((40, 50))
    backend.contract(c, out, cupy.asarray(a), cupy.asarray(b))
    assert relerr(cupy.asnumpy(out), 0.5 * a @ b) <= 1e-12
    for t in warm:
        t.join(timeout=60)
        assert not t.is_alive()


@pytest.mark.parametrize("keep", [(), "ordered"])
@pytest.mark.parametrize("shape, group, cut", [((3, 3, 3, 7, 7, 7), PAIRS[:2], False),
                                               ((3, 3, 3, 13, 13, 13), PAIRS, True),
                                               ((2, 2, 2, 93, 93, 93), PAIRS, False),
                                               ((2, 2, 3, 93, 93, 93), PAIRS[:2], True)])
def test_symmetrize_equals_numpy(shape, group, cut, keep):
    """CuPy's in-place symmetrize (one kernel over orbits of blocks) against NumPy's sum of the
    transposes, made before anything changes, on (T)-shaped tiles under one pair permutation and
    under all six (blocks of 8 overhanging 13 and 93; benzene's virtual extent), on a whole
    buffer and on a view cut from a larger one (nothing outside the view written). ``ordered``:
    written only where the exchanged occupied coordinates are non-decreasing (the rest as it was:
    :mod:`chainexec.planner.ordered`)."""
    from chainexec import ordering

    keep = (((0, 1, 2),) if len(group) == 6 else ((0, 1),)) if keep else ()
    rng = np.random.default_rng(sum(shape))
    big = rng.standard_normal(tuple(n + 2 * cut for n in shape))
    inner = tuple(slice(1, n + 1) if cut else slice(None) for n in shape)
    want = big.copy()
    want[inner] = sum(big[inner].transpose(p) for p in group)
    if keep:
        want[inner] = np.where(ordering.weights(shape, keep) > 0, want[inner], big[inner])
    got = cupy.asarray(big)
    CupyBackend(cupy).symmetrize(got[inner], group, keep)
    host = cupy.asnumpy(got)
    assert relerr(host[inner], want[inner]) <= 1e-13
    outside = np.ones(big.shape, bool)
    outside[inner] = False
    assert np.array_equal(host[outside], big[outside])


def test_prepared_symmetrizations_compile_nothing_when_they_run(tmp_path, monkeypatch):
    """The symmetrizations of a (T) tile's three patterns with equal positions, prepared at once
    (:meth:`CupyBackend.symmetrize_kernels` listed at a stand-in of the tile, then
    :meth:`CupyBackend.precompile`, a kernel cache of the test's own), compile three kernels in
    threads; each then runs without compiling and equals NumPy's sum of the transposes at its kept
    elements."""
    from chainexec import ordering

    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path))
    shape = (3, 3, 3, 11, 11, 11)
    variants = [(PAIRS, ((0, 1, 2),)), (PAIRS[:2], ((0, 1),)), ([PAIRS[0], PAIRS[3]], ((1, 2),))]
    backend = CupyBackend(cupy)
    rng = np.random.default_rng(23)
    before = kernelcache.compiled()[1]
    stand_in = np.lib.stride_tricks.as_strided(np.zeros(1), shape, cupy.empty(shape).strides, writeable=False)
    backend.precompile(backend.symmetrize_kernels(stand_in, variants))
    assert kernelcache.compiled()[1] == before + 3
    for group, keep in variants:
        x = rng.standard_normal(shape)
        got = cupy.asarray(x)
        backend.symmetrize(got, group, keep)
        want = np.where(ordering.weights(shape, keep) > 0, sum(x.transpose(p) for p in group), x)
        assert relerr(cupy.asnumpy(got), want) <= 1e-13
    assert kernelcache.compiled()[1] == before + 3


def test_kernel_cache_reused():
    """The second backend finds the first one's kernel in the in-process table (no recompile)."""
    out_idx, a_idx, b_idx, size = AGREE[0]
    rng = np.random.default_rng(3)
    c = Contraction(0, "X", out_idx, "A", a_idx, "B", b_idx, 1.0, True, 0, 0)
    out, _, _, a, b = _operands(rng, c, size, "float64", False, False)
    CupyBackend(cupy, "kernel").contract(c, out, a, b)
    loaded = len(kernelcache._LOADED)
    CupyBackend(cupy, "kernel").contract(c, out, a, b)
    assert len(kernelcache._LOADED) == loaded


# -- whole runs ----------------------------------------------------------------------------------


def _fourindex(folder: Path) -> Path:
    """configs/fourindex.yaml with its files moved into ``folder``."""
    cfg = yaml.safe_load((CONFIGS / "fourindex.yaml").read_text())
    for t in cfg["tensors"].values():
        t["source"]["file"] = "input.h5"
    cfg["outputs"]["B"]["file"] = "output.h5"
    return write_config(folder, cfg)


@pytest.mark.parametrize("ranks", [None, 2])
def test_fourindex_runs_on_gpu(ranks, tmp_path):
    config = _fourindex(tmp_path)
    assert run_cli("generate", config).returncode == 0
    report = tmp_path / "r.json"
    proc = run_cli("run", config, "--backend", "cupy", "--report-json", report, ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = read_report(report)
    assert result["run"]["backend"] == "cupy"
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    assert result["measured"]["memory_peak"] == result["predicted"]["memory_peak"]
    check = run_cli("verify", config)
    assert check.returncode == 0 and " ok" in check.stdout, check.stdout + check.stderr


@pytest.mark.parametrize("ranks", [None, 2])
@pytest.mark.parametrize("schedule", ["paper: disk", "paper: disk+global"])
@pytest.mark.parametrize("name", sorted(SMALL))
def test_fused_runs_on_gpu(name, schedule, ranks, tmp_path):
    check_fused_run(name, schedule, ranks, tmp_path, backend="cupy")


@pytest.mark.parametrize("ranks", [None, 2])
@pytest.mark.parametrize("limits", INLINE_LIMITS, ids=["untiled", "tiled"])
@pytest.mark.parametrize("name", sorted(INLINE_CHAINS))
def test_fused_statements_on_gpu(name, limits, ranks, tmp_path):
    """Fused statements (point-wise kernels and reductions with inlined producers) vs NumPy."""
    run_chain(tmp_path, name, limits, ranks, backend="cupy")


@pytest.mark.parametrize("ranks", [None, 2])
def test_triples_fetching_tiles_ahead_on_gpu(ranks, tmp_path):
    """(T) at o=8, v=10 with 284 KiB of device memory: its tile loop keeps the tiles over j and k
    across each group of tiles (:mod:`chainexec.planner.keep`) and fetches the first of the
    others for the next tile on the second stream while a tile computes (two slots); the energy
    equals the NumPy reference of chainexec.chem.triples, bytes and peaks the plan."""
    from chainexec import spec
    from chainexec.chem.triples import ccsd_t_energy
    from chainexec.planner.build import make_plan
    from chainexec.planner.plan import Loop

    import h5py

    config = triples_config(tmp_path, "284KiB")
    plan = make_plan(spec.load(config), ranks=ranks or 1)
    assert [(n.depth, len(n.ahead), len(n.kept)) for n in plan.nests[0].body if isinstance(n, Loop)] == [(2, 1, 17)]
    report = tmp_path / "r.json"
    proc = run_cli("run", config, "--backend", "cupy", "--report-json", report, ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = read_report(report)
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    assert result["measured"]["memory_peak"] == result["predicted"]["memory_peak"]
    with h5py.File(tmp_path / "energy.h5") as f:
        got = float(f["E"][()])
    expected = ccsd_t_energy(tmp_path / "inputs.h5")
    assert abs(got - expected) <= 1e-12 * abs(expected)


@pytest.mark.parametrize("reused", [False, True], ids=["reduce", "orbit"])
@pytest.mark.parametrize("within", [((0, 1),), ((0, 1, 2),)])
def test_fused_reduction_over_ordered_elements(reused, within):
    """A fused full reduction summed over the ordered elements of a group of dimensions
    (``within``, :mod:`chainexec.planner.ordered`) on the GPU, by the plain reduction kernel and
    by the orbit kernel (a reused value read transposed), equals the NumPy backend's, and for
    values symmetric in the group the whole tile's sum (1e-12)."""
    from chainexec.planner.plan import Fused

    rng = np.random.default_rng(len(within[0]) + 2 * reused)
    n, v = 4, 5
    raw = rng.standard_normal((n, n, n, v, v))
    x = sum(raw.transpose(list(p) + [d for d in range(5) if d not in within[0]])
            for p in itertools.permutations(within[0]))  # symmetric in the group's dimensions
    y = rng.standard_normal(v)
    domain = ("i", "j", "k", "a", "b")
    if reused:
        f = Fused("E", (), domain, "X[i,j,k,a,b] * Z[i,j,k,b,a]", True,
                  (("Z", domain, "X[i,j,k,a,b] + Y[a]"),))
        whole = np.sum(x * (x + y[:, None]).swapaxes(3, 4))
    else:
        f = Fused("E", (), domain, "X[i,j,k,a,b] * Y[a]", True)
        whole = np.sum(x * y[:, None])
    host = {r: (x if r.tensor == "X" else y) for r in f.leaves}
    cpu, gpu = np.zeros(()), cupy.zeros(())
    NumpyBackend().fused(f, host, x.shape, cpu, within)
    CupyBackend(cupy).fused(f, {r: cupy.asarray(a) for r, a in host.items()}, x.shape, gpu, within)
    assert abs(float(gpu) - float(cpu)) <= 1e-12 * abs(float(cpu))
    assert abs(float(cpu) - whole) <= 1e-12 * abs(whole)
