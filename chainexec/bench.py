"""Check and time chainexec's generated kernels on the 48 TCCG contractions (needs a GPU).

For each contraction and scale (1 = the sizes of ``benchmarks/tccg.json``, 2 = every extent
doubled): the COGENT kernel of the model's
configuration and the GETT tensor-core kernels of the GETT model's top three configurations are
each checked against ``cupy.einsum`` on fresh
random inputs (output poisoned with NaN first, so an unwritten element fails; relative Frobenius
error; then the alpha/beta path), as are the batched-GEMM layouts (cuBLAS in place, and on
permuted copies of the operands as the runtime's ``relayout`` makes them), GETT on packed
copies (the runtime's ``packed``, its copies timed with it) and GETT with its sum split into
parts (the runtime's ``splitk``, its parts' sum timed with it), and timed
beside TTGT, ``cupy.einsum`` and, where importable,
``torch.einsum`` and cuTENSOR (``cupyx.cutensor``), with CUDA events around the device's work
alone, the host's time to issue it left out for every method alike
(:class:`~chainexec.runtime.devicetime.Stopwatch`; median of repeats after a warm-up;
:data:`HOPELESS`). ``chainexec`` is what the runtime's selector takes (the fastest of
GETT on the operands, on packed copies or split, batched GEMM in place or relaid, COGENT, TTGT plain or
pipelined, cupy.einsum and cuTENSOR); its ratio to the best library is read from the two sides'
near-fastest methods timed
again together in rounds (:func:`contenders`, :func:`time_together`). The measured cuBLAS DGEMM
rate is recorded for scale.

Each case also gets the least time any method could take on this device (:func:`bound_ms`, a
roofline: its flops at the measured DGEMM rate, or each operand read once and the output
written once at the measured copy bandwidth, whichever is longer), and from it the largest
ratio to the best library that any method could reach (``ceiling_vs_best_library``). On the
CCSD(T) cases the output alone (302 MB at scale 1) bounds the rate, below what a DGEMM reaches.

Every method is timed until C is in its layout. GETT, COGENT, batched GEMM, cuTENSOR and TTGT
(as the runtime runs it) write into C; ``cupy.einsum`` and ``torch.einsum`` return the GEMM's
product *viewed* in C's index order, which a consumer of C's layout (the next contraction's
kernel, an HDF5 write) must still copy: they are timed with that copy, by their own library
(timed without it, they would leave out a pass over the output, 302 MB on the CCSD(T) cases).
Their times as returned are recorded beside (``cupy_einsum_view_ms``, ``torch_einsum_view_ms``;
``ttgt_view_ms`` for TTGT's product alone), with ``views`` saying which results were views.

Layout: the index strings of tccg.json are used as given with **row-major** storage, i.e. the
last letter of each string is the stride-1 index (the original TCCG strings are column-major).

Usage: ``chainexec bench tccg --out results.json [--scales 1 2] [--cases FILE]`` (or ``main([...])``
from Python); ``--cases`` takes any list of contractions in ``benchmarks/tccg.json``'s format
(:func:`load_cases`), and each case's line and row say its share of the bound (``of_bound``).
``--resume`` continues a run stopped part way (a call's time limit, a lost machine) from the
rows its ``OUT.partial`` holds (:func:`resume`), so that one result of every case can be made
over several calls.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from statistics import geometric_mean

import numpy as np

from chainexec import atomicfile, safepaths, userfiles
from chainexec.errors import ArgumentParser, ChainexecError, say
from chainexec.plancache import tree_digest
from chainexec.planner.plan import Contraction
from chainexec.provenance import provenance
from chainexec.runtime.backends.common import ttgt_product
from chainexec.runtime.backends.cupy import CupyBackend
from chainexec.runtime.backends.methods import REGISTRY, _relaid

REPO = Path(__file__).resolve().parents[1]

#: Methods within this factor of their side's fastest alone are timed again head to head: alone,
#: one method's medians of a few calls differ by several percent from one timing to the next.
CONTENDERS = 1.10
#: A method (or GETT configuration) whose first timed call takes more than this factor of the
#: fastest median timed before it in the case is timed once: it can be neither the best nor a
#: contender, and at scale 2 the repeats of such methods would take most of a case's time. A
#: method whose first call alone takes longer than the whole ``--budget`` is timed once too.
HOPELESS = 2.0
#: A GETT (or packed, or split) configuration after the model's first whose first timed call
#: takes more than this factor of the fastest configuration's median before it, or of the fastest
#: method timed before the configurations in the case, is timed once: it can be neither the
#: case's fastest method nor a contender (:data:`CONTENDERS`), and only the fastest
#: configuration of the method could be (the model ranks them, so the fastest comes early). At
#: scale 2 a CCSD case's configurations take up to seconds a call, and repeating every one would
#: take most of the case's time.
GETT_CUT = 1.25


def rel_error(out, ref) -> float:
    """||out - ref||_F / ||ref||_F, accumulated slice by slice along axis 0 (bounded memory)."""
    import cupy

    num = den = 0.0
    for i in range(out.shape[0]):
        d = out[i] - ref[i]
        num += float(cupy.vdot(d, d).real)
        den += float(cupy.vdot(ref[i], ref[i]).real)
    return math.sqrt(num / den) if den else float("inf")


def worst(*errors: float) -> float:
    """The largest of relative errors, NaN if any is NaN (an unwritten element of a NaN-poisoned
    output): Python's ``max`` keeps a finite value it meets first and drops a later NaN."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def rounds(fns: dict, measure, budget_s: float, min_reps: int = 3, max_reps: int = 50,
           hopeless_ms: float = math.inf) -> dict:
    """Median milliseconds and repeats of every callable in ``fns``, timed in rounds that call each
    once in turn (``measure(fn)`` gives one call's milliseconds): methods compared with each other
    run under the same clocks and power state. A device that throttles under a long DGEMM drifts
    by 10 % or more between runs of the same kernel; methods timed one after another would carry
    that drift into their ratio. Each round starts one callable further on (round r calls them
    from the (r mod n)-th of the n in turn) and rounds end only after whole cycles of n, in which
    each callable has been at each place once: a drift within rounds, or a device rested between
    them, favours no place in the order. Rounds stop at ``max_reps``, or once every callable has
    ``min_reps`` and the next cycle would pass ``budget_s`` per callable (both rounded up to
    whole cycles), or after the first round where every call took longer than ``hopeless_ms``."""
    times = {key: [] for key in fns}
    keys = list(fns)
    n = len(keys)
    while True:
        turn = len(times[keys[0]]) % n
        for key in keys[turn:] + keys[:turn]:
            times[key].append(measure(fns[key]))
        done = len(times[keys[0]])
        spent = sum(map(sum, times.values())) / 1e3
        if ((done % n == 0 and (done >= max_reps or (done >= min_reps and spent * (done + n) / done > budget_s * n)))
                or (done == 1 and min(t[0] for t in times.values()) > hopeless_ms)):
            return {key: (float(np.median(t)), len(t)) for key, t in times.items()}


def time_together(fns: dict, budget_s: float, min_reps: int = 3, max_reps: int = 50,
                  hopeless_ms: float = math.inf, warm: bool = False) -> dict:
    """:func:`rounds` on the device: each call's device time
    (:meth:`~chainexec.runtime.devicetime.Stopwatch.ms`: between CUDA events, the host's time to
    issue the call's work left out), after one warm-up call of each unless they are ``warm`` (run
    already: kernels loaded, memory pools filled)."""
    import cupy

    from chainexec.runtime.devicetime import HOLD_S, Stopwatch

    for fn in () if warm else fns.values():
        fn()
    cupy.cuda.Device().synchronize()
    watch = Stopwatch(cupy)
    times = rounds(fns, watch.ms, budget_s, min_reps, max_reps, hopeless_ms)
    for key, fn in fns.items():
        if id(fn) in watch.unheld:
            say(f"{key}: timed with the host's time to issue it (its work was not queued within "
                f"{HOLD_S} s: it waits for the device)")
    return times


def time_gpu(fn, budget_s: float, min_reps: int = 3, max_reps: int = 50,
             hopeless_ms: float = math.inf, warm: bool = False) -> tuple[float, int]:
    """Median milliseconds and repeats of ``fn()`` alone (:func:`time_together`)."""
    return time_together({0: fn}, budget_s, min_reps, max_reps, hopeless_ms, warm)[0]


def environment() -> dict:
    """Device, library versions, commit and date of this run."""
    env = provenance(gpu=True)
    env["cupy_accelerators"] = os.environ.get("CUPY_ACCELERATORS")
    try:
        import torch
        env["torch"] = torch.__version__
    except ImportError:
        env["torch"] = None
    return env


def _cut_ms(before_ms: float, rows: list[dict]) -> float:
    """Milliseconds beyond which the next configuration's first call has it timed once
    (:data:`GETT_CUT`): none for the model's first; then the fastest of ``rows`` so far and of
    ``before_ms`` (the fastest method timed before the configurations)."""
    return GETT_CUT * min([before_ms, *(r["ms"] for r in rows)]) if rows else math.inf


def gett_rows(c, a, b, sizes, A, B, C, ref, budget_s: float, choose=None,
              before_ms: float = math.inf) -> tuple[list[dict], list]:
    """The GETT model's top configurations for this case (``choose(problems, sm_count)``'s
    (order, configuration) pairs where given): each checked against ``ref`` (beta = 0 into a
    NaN-poisoned C, then alpha/beta) and timed with beta = 0; a row per configuration and, in the
    same order, each one's timed launch as a callable; the first (the model's best) is timed in
    full, and a later one whose first timed call takes more than :data:`GETT_CUT` times the
    fastest so far or ``before_ms`` (the fastest method timed before them) is timed once
    (:func:`_cut_ms`): that call is the check's beta = 0 launch, timed (GETT writes C and
    allocates nothing, and its module is loaded before it), so that a configuration cut takes two
    launches, not three (a large case's configurations take up to a second a launch).
    Their kernels are compiled first, together in threads; a configuration timed in full has
    its checks' two launches as its warm-up."""
    import cupy

    from chainexec.kernels import gett
    from chainexec.runtime import kernelcache
    from chainexec.runtime.devicetime import Stopwatch
    from chainexec.runtime.launch import GettTables, launch_gett

    strides = tuple(dict(zip(idx, (s // x.itemsize for s in x.strides))) for idx, x in ((c, C), (a, A), (b, B)))
    t = time.perf_counter()
    probs = gett.variants(tuple(c), tuple(a), tuple(b), sizes, strides)
    dev = cupy.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    cands = (choose or (lambda problems, sm_count: gett.candidates(problems, sm_count, top=3)))(probs, sms)
    model_s = time.perf_counter() - t
    kernelcache.precompile([(cfg.name(), gett.source(cfg)) for _, cfg in cands], str(dev.compute_capability))
    tables = {o: GettTables(p, strides) for o, p in probs.items()}
    watch = Stopwatch(cupy)
    rows, calls = [], []
    for order, cfg in cands:
        prob = probs[order]
        left, right = (B, A) if prob.swap else (A, B)
        calls.append(lambda cfg=cfg, order=order, left=left, right=right:
                     launch_gett(cfg, tables[order], C, left, right, 1.0, 0.0))
        tables[order].launches(cfg)  # its module loaded: the checked launch is timed as the later ones are
        C[...] = cupy.nan
        first_ms = watch.ms(calls[-1])
        err = rel_error(C, ref)
        launch_gett(cfg, tables[order], C, left, right, 0.5, -2.0)
        err_beta = rel_error(C, -1.5 * ref)
        cut = _cut_ms(before_ms, rows)
        ms, reps = (first_ms, 1) if first_ms > cut else time_gpu(calls[-1], budget_s, warm=True, hopeless_ms=cut)
        rows.append({"config": cfg.name(), "order": order, "predicted_ms": gett.predicted_seconds(prob, cfg, sms) * 1e3,
                     "rel_err": err, "rel_err_beta": err_beta, "ms": ms, "reps": reps, "model_s": model_s})
    return rows, calls


def method_rows(backend, name: str, con: Contraction, A, B, C, ref, budget_s: float,
                before_ms: float = math.inf) -> tuple[list[dict], list]:
    """The runtime's method ``name`` on this case, packed GETT
    (:class:`~chainexec.runtime.backends.methods.Packed`) or split GETT
    (:class:`~chainexec.runtime.backends.methods.SplitK`): each of its candidates run as the
    runtime runs it (the operands' copies or the parts' sum in every call, a fresh C written),
    checked against ``ref`` in a NaN-poisoned C, then adding half the product to it (against
    ``1.5 · ref``), and timed fresh; a row per candidate and, in the same order, each one's call;
    none where it is not offered; cut as :func:`gett_rows` cuts. Their kernels are compiled
    first, together; the checks are each one's warm-up."""
    import cupy

    method = REGISTRY[name]
    if not method.applies(backend, con, C, A, B):
        return [], []
    cands = method.configurations(backend, con, C, A, B)
    backend._compile([k for cfg in cands.values() for k in method.kernels(backend, cfg, con, C, A, B)])
    rows, calls = [], []
    for key, cfg in cands.items():
        calls.append(lambda cfg=cfg: method.run(backend, cfg, con, C, A, B, True))
        C[...] = cupy.nan
        calls[-1]()
        err = rel_error(C, ref)
        method.run(backend, cfg, replace(con, factor=0.5), C, A, B, False)
        err_beta = rel_error(C, 1.5 * ref)
        ms, reps = time_gpu(calls[-1], budget_s, warm=True,
                            hopeless_ms=_cut_ms(before_ms, rows))
        rows.append({"config": key.split(":", 2)[2], "order": cfg["order"], "rel_err": err, "rel_err_beta": err_beta,
                     "ms": ms, "reps": reps})
    return rows, calls


def _contiguous(x) -> bool:
    """Whether a CuPy or torch array is stored in its own index order (row-major)."""
    return x.is_contiguous() if hasattr(x, "is_contiguous") else x.flags.c_contiguous


def _in_layout(x):
    """``x`` stored in its index order: itself if it already is, else a contiguous copy made by
    its own library (``torch.Tensor.contiguous``; ``ndarray.copy(order="C")`` for CuPy and
    NumPy)."""
    if _contiguous(x):
        return x
    return x.contiguous() if hasattr(x, "contiguous") else x.copy(order="C")


def summary(rows: list[dict]) -> dict:
    """Per scale, per group and over all cases with a result: the geometric mean of chainexec's
    ratio to the best library, the smallest ratio and the cases below 1.0; where the rows have
    :func:`bound_ms`, the geometric mean of the largest ratio any method could reach
    (``ceiling_geomean``) and of chainexec's share of the bound (``of_bound_geomean``)."""
    out = {}
    for scale in sorted({r["scale"] for r in rows}):
        done = [r for r in rows if r["scale"] == scale and "ratio_vs_best_library" in r]
        groups = {"all": done} | {g: [r for r in done if r["group"] == g]
                                  for g in dict.fromkeys(r["group"] for r in done)}
        out[str(scale)] = {}
        for g, rs in groups.items():
            if not rs:
                continue
            ratios = [r["ratio_vs_best_library"] for r in rs]
            out[str(scale)][g] = {"cases": len(rs), "geomean": geometric_mean(ratios), "min": min(ratios),
                                  "below_1": [r["id"] for r in rs if r["ratio_vs_best_library"] < 1.0]}
            if all("bound_ms" in r for r in rs):
                out[str(scale)][g] |= {"ceiling_geomean": geometric_mean([r["ceiling_vs_best_library"] for r in rs]),
                                       "of_bound_geomean": geometric_mean([r["of_bound"] for r in rs])}
    return out


def cutensor_call(a, b, c, A, B, C):
    """``C = A·B`` through cuTENSOR (``cupyx.cutensor``) as a callable, or None where libcutensor
    is not installed."""
    try:
        from cupyx import cutensor

        def call():
            cutensor.contraction(1.0, A, tuple(a), B, tuple(b), 0.0, C, tuple(c))
        call()
        return call
    except Exception:
        return None


def copy_gbs(nbytes: int = 1 << 30) -> float:
    """Measured device memory bandwidth, GB/s: the bytes a device-to-device copy of ``nbytes``
    reads and writes, per second."""
    import cupy

    x = cupy.ones(nbytes // 8)
    y = cupy.empty_like(x)
    ms, _ = time_gpu(lambda: cupy.copyto(y, x), 1.0)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def bound_ms(flops: float, nbytes: int, gflops: float, gbs: float) -> float:
    """Least milliseconds any method can take for a contraction of ``flops`` whose operands and
    output hold ``nbytes`` together: the flops at ``gflops`` (GFLOP/s) or every operand read once
    and the output written once at ``gbs`` (GB/s), whichever takes longer."""
    return max(flops / (gflops * 1e9), nbytes / (gbs * 1e9)) * 1e3


def dgemm_gflops(n: int = 8192) -> float:
    """Measured float64 GEMM rate of cuBLAS (``cupy.matmul``, n×n×n), GFLOP/s."""
    import cupy

    x = cupy.random.standard_normal((n, n))
    y = cupy.random.standard_normal((n, n))
    ms, _ = time_gpu(lambda: cupy.matmul(x, y), 2.0)
    return 2 * n**3 / (ms * 1e-3) / 1e9


def contenders(*sides: dict) -> list:
    """The methods of every side (name -> milliseconds alone) within :data:`CONTENDERS` of their
    side's fastest, each once, in the sides' order."""
    return list(dict.fromkeys(k for side in sides for k in side if side[k] <= CONTENDERS * min(side.values())))


def run_case(case: dict, scale: int, kernel, budget_s: float, use_torch: bool,
             roof: tuple[float, float]) -> dict:
    """Check and time one contraction at one scale; returns a JSON-ready row. ``roof``: the
    device's measured DGEMM rate (GFLOP/s) and copy bandwidth (GB/s), for :func:`bound_ms`."""
    import cupy

    c, a, b = case["C"], case["A"], case["B"]
    sizes = {i: n * scale for i, n in case["sizes"].items()}
    flops = 2 * math.prod(sizes.values())
    dtype = kernel.config.dtype
    nbytes = {t: math.prod(sizes[i] for i in s) * np.dtype(dtype).itemsize
              for t, s in (("A", a), ("B", b), ("C", c))}
    # our output, the einsum reference and einsum's transposed copies of an input and the output;
    # relayout's copies of both inputs beside the reference
    need = 2 * (nbytes["A"] + nbytes["B"]) + 3 * nbytes["C"] + max(nbytes["A"], nbytes["B"])
    free = cupy.cuda.runtime.memGetInfo()[0]
    if need > 0.9 * free:
        return {"id": case["id"], "name": case["name"], "scale": scale,
                "skipped": f"needs about {need / 2**30:.0f} GiB with the einsum reference, "
                           f"{free / 2**30:.0f} GiB free"}
    rng = cupy.random.default_rng(1000 * case["id"] + scale)
    A = rng.standard_normal([sizes[i] for i in a], dtype=dtype)
    B = rng.standard_normal([sizes[i] for i in b], dtype=dtype)
    C = cupy.full([sizes[i] for i in c], cupy.nan, dtype=dtype)
    ref = cupy.einsum(f"{a},{b}->{c}", A, B)
    kernel(A, B, C)
    err = rel_error(C, ref)
    # beta path: C <- 0.5 * A*B - 2 * C, compared with the same expression on the reference
    kernel(A, B, C, alpha=0.5, beta=-2.0)
    err_beta = rel_error(C, -1.5 * ref)
    cfg = kernel.config
    row = {"id": case["id"], "name": case["name"], "group": case["group"], "scale": scale,
           "sizes": sizes, "gflop": flops / 1e9, "dtype": dtype,
           "rel_err": err, "rel_err_beta": err_beta,
           "config": {k: getattr(cfg, k) for k in ("x_operand", "tbx", "regx", "tby", "regy",
                                                  "tbk", "threads", "smem_bytes", "num_blocks",
                                                  "trans_total")}}
    # every method's timed call, timed alone first (pools emptied after each, so that a case
    # that fits once fits every method), then the fastest of chainexec's against the fastest
    # library head to head (:func:`time_together`). The library-backed methods are checked and
    # timed first: a GETT configuration far slower than the fastest of them is timed once.
    fns = {"cogent": lambda: kernel(A, B, C)}
    times = {}
    if use_torch:
        import torch

    def release():
        cupy.get_default_memory_pool().free_all_blocks()
        if use_torch:
            torch.cuda.empty_cache()

    def time_alone(key, warm=False):
        # against whole methods only: a product left as a view (``*_view``) skips a pass. A call
        # longer than the whole budget is timed once: alone, a time only screens contenders
        # (within CONTENDERS, timed again together) and cuts configurations, and a call that long
        # varies by far less than that margin
        fastest = min((ms for k, (ms, _) in times.items() if not k.endswith("_view")), default=math.inf)
        times[key] = time_gpu(fns[key], budget_s, hopeless_ms=min(HOPELESS * fastest, budget_s * 1e3), warm=warm)
        release()

    con = Contraction(id=0, out="C", out_indices=list(c), a="A", a_indices=list(a), b="B", b_indices=list(b),
                      factor=1.0, accumulate=False, flops=flops, statement=0)
    backend = CupyBackend(cupy)
    C[...] = cupy.nan
    if backend.batched_gemm(con, C, A, B, 1.0, beta=0.0):
        row["rel_err"] = worst(row["rel_err"], rel_error(C, ref))
        fns["batched"] = lambda: backend.batched_gemm(con, C, A, B, 1.0, beta=0.0)
    if "relayout" in backend._candidates(con, C, A, B):  # where the runtime's autotuner offers it
        moved, pa, pb = _relaid(con)

        def relayout():
            """The runtime's ``relayout`` method: batched GEMM on permuted copies, copies timed."""
            if not backend.batched_gemm(moved, C, backend._contiguous(A.transpose(pa)),
                                        backend._contiguous(B.transpose(pb)), 1.0, beta=0.0):
                raise RuntimeError("relayout: no batched-GEMM layout on the copies")

        C[...] = cupy.nan
        relayout()
        row["relayout_rel_err"] = rel_error(C, ref)
        row["rel_err"] = worst(row["rel_err"], row["relayout_rel_err"])
        fns["relayout"] = relayout
    # the runtime's TTGT method, its product copied into C by the runtime's own kernel, plain and
    # pipelined (``ttgt:<chunks>``) where the autotuner offers it
    for key, config in REGISTRY["ttgt"].configurations(backend, con, C, A, B).items():
        C[...] = cupy.nan
        backend._run(("ttgt", config), con, C, A, B, fresh=True)
        row["rel_err"] = worst(row["rel_err"], rel_error(C, ref))
        fns[key] = lambda config=config: backend._run(("ttgt", config), con, C, A, B, fresh=True)
    for key in list(fns):
        if key != "cogent":
            time_alone(key)
    # GETT on the operands as they lie, packed and split: each its configurations' rows, cut
    # against the fastest method timed before them, and its fastest configuration as the method
    for name in ("gett", "packed", "splitk") if dtype == "float64" else ():
        before = min((ms for ms, _ in times.values()), default=math.inf)
        row[name], calls = (gett_rows(c, a, b, sizes, A, B, C, ref, budget_s, before_ms=before) if name == "gett"
                            else method_rows(backend, name, con, A, B, C, ref, budget_s, before_ms=before))
        if calls:
            best = min(range(len(calls)), key=lambda i: row[name][i]["ms"])
            times[name] = (row[name][best]["ms"], row[name][best]["reps"])
            fns[name] = calls[best]
            row["rel_err"] = worst(row["rel_err"], *(r["rel_err"] for r in row[name]))
            row["rel_err_beta"] = worst(row["rel_err_beta"], *(r["rel_err_beta"] for r in row[name]))
    del ref
    # TTGT and the einsums hand back the GEMM's product viewed in C's index order; C's layout
    # costs them one more pass (the view made contiguous), which is what the einsums are timed
    # with, by their own library's copy. Their times as returned are kept beside (``*_view_ms``)
    # with whether the result was a view.
    returned = {"ttgt": lambda: ttgt_product(backend, con, A, B),
                "cupy_einsum": lambda: cupy.einsum(f"{a},{b}->{c}", A, B)}
    if use_torch:
        tA, tB = torch.from_dlpack(A), torch.from_dlpack(B)
        returned["torch_einsum"] = lambda: torch.einsum(f"{a},{b}->{c}", tA, tB)

    row["views"] = {}
    for key, fn in returned.items():
        row["views"][key] = not _contiguous(fn())
        release()  # one library's cached product must not leave the next too little memory
        fns.setdefault(key, lambda fn=fn: _in_layout(fn()))
        fns[f"{key}_view"] = fn
    cutensor = cutensor_call(a, b, c, A, B, C)
    if cutensor is not None:
        fns["cutensor"] = cutensor

    for key in sorted(fns, key=lambda k: k == "cogent"):  # COGENT, the slowest almost everywhere, last
        if key not in times:
            time_alone(key, warm=key == "cogent")  # COGENT writes C, allocates nothing, and its checks loaded it
    for key, (ms, reps) in times.items():
        row[f"{key}_ms"], row[f"{key}_reps"] = ms, reps
    # The runtime's selector (CupyBackend) picks the fastest of its methods: GETT on the operands
    # as they lie, on packed copies or split, batched GEMM in place or on permuted copies, COGENT, TTGT (plain or
    # pipelined), cupy.einsum and
    # cuTENSOR where installed;
    # the libraries it is compared with are the others (where it picks a library, its ratio to the
    # best library is at most 1). Each side's methods within CONTENDERS of its fastest alone are
    # timed again together (:func:`time_together`, five times the budget) and each side's
    # fastest there gives the ratio: alone, each is the least of several noisy medians.
    ours = {k: times[k][0] for k in times
            if k.split(":")[0] in ("gett", "packed", "splitk", "batched", "relayout", "cogent", "ttgt", "cupy_einsum",
                                   "cutensor")}
    libs = {k: times[k][0] for k in ("cupy_einsum", "torch_einsum", "cutensor") if k in times}
    row["generated_ms"] = min(times[k][0] for k in ("gett", "packed", "splitk", "cogent") if k in times)
    row["generated_ratio_vs_best_library"] = min(libs.values()) / row["generated_ms"]
    close = contenders(ours, libs)
    try:
        final = time_together({k: fns[k] for k in close}, 5 * budget_s, min_reps=5)
        row["head_to_head"] = {k: {"ms": ms, "reps": reps} for k, (ms, reps) in final.items()}
    except (cupy.cuda.memory.OutOfMemoryError, *([torch.cuda.OutOfMemoryError] if use_torch else [])):
        # the contenders' temporaries together exceed the device memory: each alone's times
        final = times
        row["head_to_head"] = "not timed: the contenders' temporaries together exceed the device memory"
    release()
    row["selector"] = min((k for k in ours if k in close), key=lambda k: final[k][0])
    row["best_library"] = min((k for k in libs if k in close), key=lambda k: final[k][0])
    row["chainexec_ms"] = final[row["selector"]][0]
    row["library_ms"] = final[row["best_library"]][0]
    row["ratio_vs_best_library"] = row["library_ms"] / row["chainexec_ms"]
    row["bound_ms"] = bound_ms(flops, sum(nbytes.values()), *roof)
    row["ceiling_vs_best_library"] = row["library_ms"] / row["bound_ms"]
    row["of_bound"] = row["bound_ms"] / row["chainexec_ms"]
    for key in ("bound", "chainexec", "library", "generated", "gett", "packed", "splitk", "batched", "relayout",
                "cogent", *(
            k for k in times if k.split(":")[0] == "ttgt"), "cupy_einsum", "torch_einsum", "cutensor", "ttgt_view",
                "cupy_einsum_view", "torch_einsum_view"):
        if f"{key}_ms" in row:
            row[f"{key}_gflops"] = flops / (row[f"{key}_ms"] * 1e-3) / 1e9
    return row


def cases_digest(cases: list[dict]) -> str:
    """SHA-256 of a case file's contractions (ids, names, groups, index strings and extents, in
    canonical JSON): the rows of one resumed run measure the same contractions."""
    return hashlib.sha256(json.dumps(cases, sort_keys=True).encode()).hexdigest()


def load_cases(path: str | Path) -> list[dict]:
    """The contractions of a case file in ``benchmarks/tccg.json``'s format: a JSON list of
    objects with ``id`` (a whole number, each once), ``name`` and ``group`` (strings), ``C``,
    ``A`` and ``B`` (index strings, one lower-case ASCII letter per index: they name variables of
    the generated CUDA source) and ``sizes`` (each index's extent, a positive whole number).
    Every index of ``C`` is in ``A`` or ``B`` (not both: no batch index), and an index not in
    ``C`` is summed, so in both. Anything else is a ChainexecError naming the file and the case."""
    cases = userfiles.loads(userfiles.read(path, "case file"), "case file", str(path))
    if not isinstance(cases, list) or not cases:
        raise ChainexecError("the cases must be a non-empty JSON list of contractions", str(path))
    seen = set()
    for k, case in enumerate(cases):
        problem = _case_problem(case, seen)
        if problem:
            ident = case.get("id", f"#{k}") if isinstance(case, dict) else f"#{k}"
            raise ChainexecError(f"case {ident}: {problem}", str(path))
    return cases


def _case_problem(case, seen: set) -> str | None:
    if not isinstance(case, dict):
        return "not a JSON object"
    missing = [key for key in ("id", "name", "group", "C", "A", "B", "sizes") if key not in case]
    if missing:
        return f"missing {', '.join(missing)}"
    if not isinstance(case["id"], int) or isinstance(case["id"], bool) or case["id"] in seen:
        return "id must be a whole number given once"
    seen.add(case["id"])
    if not all(isinstance(case[key], str) for key in ("name", "group")):
        return "name and group must be strings"
    for key in ("C", "A", "B"):
        text = case[key]
        if not (isinstance(text, str) and text and all("a" <= ch <= "z" for ch in text) and len(set(text)) == len(text)):
            return f"{key} must be distinct lower-case letters, one per index"
    sizes = case["sizes"]
    names = set(case["A"]) | set(case["B"]) | set(case["C"])
    if not isinstance(sizes, dict) or set(sizes) != names:
        return f"sizes must give exactly the indices {''.join(sorted(names))}"
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes.values()):
        return "each size must be a positive whole number"
    if not set(case["C"]) <= set(case["A"]) | set(case["B"]):
        return "an index of C is in neither A nor B"
    if set(case["A"]) & set(case["B"]) & set(case["C"]):
        return "an index in all of C, A and B (a batch index) is not a contraction the kernels generate"
    summed = (set(case["A"]) | set(case["B"])) - set(case["C"])
    if not summed <= set(case["A"]) & set(case["B"]):
        return "a summed index (not in C) must be in both A and B"
    return None


RESULT_KEYS = {"environment", "source", "cases", "rows"}
"""Keys every result file of the bench holds: an existing ``--out`` without them is not one, and
is not written over."""


def check_options(args, cases: list[dict]) -> None:
    """Refuse, before anything needs a GPU, options that would fail or lose a file later: a scale
    or budget that is not a positive number, an ``--ids`` no case has, and an ``--out`` in a folder
    that does not exist or that is a file other than a result of the bench (the case file, a
    folder, a user's own file), which the finished run would replace, or whose ``OUT.partial``
    is such a file (written after each case, removed at the end)."""
    if any(s < 1 for s in args.scales):
        raise ChainexecError(f"--scales must be positive whole numbers, not {' '.join(map(str, args.scales))}")
    if not (math.isfinite(args.budget) and args.budget > 0):
        raise ChainexecError(f"--budget must be a positive number of seconds, not {args.budget}")
    missing = sorted(set(args.ids or ()) - {case["id"] for case in cases})
    if missing:
        raise ChainexecError(f"--ids: no case has the id {', '.join(map(str, missing))}", args.cases)
    out = Path(safepaths.checked(args.out, "--out"))
    if not out.parent.is_dir():
        raise ChainexecError("--out: the folder to write the results in does not exist", str(out))
    if out.is_dir():
        raise ChainexecError("--out names a folder; give the results' file", str(out))
    if out.exists() and safepaths.same_file(out.resolve(), Path(args.cases).resolve()):
        raise ChainexecError("--out is the case file, which the results would replace", str(out))
    if out.exists() and not _is_result(out):
        raise ChainexecError("--out exists and is not a result of `chainexec bench tccg`: it is not written over; "
                             "give another name or remove it", str(out))
    partial = out.with_name(out.name + ".partial")
    if partial.exists() and (safepaths.same_file(partial.resolve(), Path(args.cases).resolve())
                             or not _is_result(partial)):
        raise ChainexecError("exists and is not a bench run's rows, which the run writes there after each case and "
                             "removes at its end: give another --out or move it", str(partial))


def _is_result(path: Path) -> bool:
    """Whether ``path`` holds a result of the bench (:data:`RESULT_KEYS`), read whole (a result
    of every case at two scales is about a megabyte; a file 64 times that is not one)."""
    try:
        if path.stat().st_size > 64 * userfiles.MAX_BYTES:
            return False
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and RESULT_KEYS <= set(data)


def resume(partial: Path, result: dict, jobs: list) -> list:
    """Continue the run that left ``partial`` (``OUT.partial``) in ``result``: its rows (every
    (id, scale) it finished, whichever ``--ids`` it ran; a row with an error only where this run
    does not run its case again), its measured DGEMM rate and copy bandwidth (so that every row's
    bound comes from one measurement) and the environments of the calls before go into
    ``result``; returns the ``(case, scale)`` jobs it has no row without an error for. Raises
    ChainexecError where ``partial`` is not a bench's JSON or was written by other sources
    (:func:`~chainexec.plancache.tree_digest` of the package), from another case file (its
    contractions' digest), on another device or for another dtype: rows of two versions in one
    summary would measure neither."""
    try:
        earlier = json.loads(partial.read_text())
        rows, gflops, gbs, env = earlier["rows"], earlier["dgemm_gflops"], earlier["copy_gbs"], earlier["environment"]
        if not (isinstance(env, dict) and isinstance(rows, list) and all(isinstance(r, dict) for r in rows)
                and all(isinstance(x, (int, float)) and x > 0 for x in (gflops, gbs))):
            raise TypeError("its environment, rows or rates are not what a bench writes")
        done = {(r["id"], r["scale"]): r for r in rows if "error" not in r}
        again = {(case["id"], s) for case, s in jobs}
        kept = [r for r in rows if "error" not in r or (r["id"], r["scale"]) not in again]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ChainexecError(f"{partial}: not a bench run's rows to resume ({exc.__class__.__name__}: {exc})") from None
    for what, then, now in (("sources", earlier.get("source"), result["source"]),
                            ("cases", earlier.get("cases"), result["cases"]),
                            ("device", env.get("device"), result["environment"].get("device")),
                            ("dtype", earlier.get("dtype"), result["dtype"])):
        if then != now:
            raise ChainexecError(f"{partial}: written with other {what} ({then} against {now} here); remove it or run "
                                 f"without --resume")
    result |= {"rows": kept, "dgemm_gflops": gflops, "copy_gbs": gbs,
               "earlier": earlier.get("earlier", []) + [env], "max_search_s": earlier.get("max_search_s", 0.0)}
    return [(case, s) for case, s in jobs if (case["id"], s) not in done]


def main(argv=None) -> int:
    parser = ArgumentParser(prog="chainexec bench tccg", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", "--tccg", dest="cases", default=str(REPO / "benchmarks" / "tccg.json"),
                        help="contractions to check and time, in benchmarks/tccg.json's format (default: the 48 TCCG "
                             "cases)")
    parser.add_argument("--out", required=True,
                        help="JSON file for the results, written once every case has run (OUT.partial holds the rows "
                             "of the cases run so far)")
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    parser.add_argument("--ids", type=int, nargs="*", help="only these contraction ids")
    parser.add_argument("--budget", type=float, default=0.3,
                        help="seconds of timed repeats per method and case (at least 3 repeats; alone, a "
                             "method whose call is longer is timed once, and the contenders again together)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--resume", action="store_true",
                        help="keep the finished rows of OUT.partial (a run stopped part way, on the same sources, "
                             "device and dtype) and its DGEMM rate and copy bandwidth, and run only the cases it lacks")
    args = parser.parse_args(argv)
    cases = load_cases(args.cases)
    check_options(args, cases)
    if importlib.util.find_spec("cupy") is None:
        raise ChainexecError("bench tccg needs CuPy and a GPU (cupy is not installed here)")

    from chainexec.kernels.kernelconf import choose_config
    from chainexec.runtime.launch import device_model, get_kernel

    use_torch = not args.no_torch and importlib.util.find_spec("torch") is not None
    device = device_model()
    result = {"environment": environment(), "device_model": asdict(device), "dtype": args.dtype,
              "source": tree_digest(Path(__file__).resolve().parent), "cases": cases_digest(cases), "rows": [],
              "layout": "row-major: the last letter of each index string is stride-1"}
    jobs = [(case, s) for s in args.scales for case in cases if not args.ids or case["id"] in args.ids]
    # the rows so far go to OUT.partial after each case (a run stopped part way keeps them),
    # OUT itself only once every case has run and the summary is made
    out = Path(args.out)
    partial = out.with_name(out.name + ".partial")
    if args.resume and partial.exists():
        jobs = resume(partial, result, jobs)
        print(f"resuming {partial}: {len(result['rows'])} rows kept, {len(jobs)} cases to run", flush=True)
    else:
        if args.resume:
            print(f"no {partial} to resume: running every case", flush=True)
        result |= {"dgemm_gflops": dgemm_gflops(), "copy_gbs": copy_gbs()}
    t0 = time.perf_counter()
    search_s = []

    def search(job):
        case, s = job
        sizes = {i: n * s for i, n in case["sizes"].items()}
        t = time.perf_counter()
        try:
            cfg = choose_config(case["C"], case["A"], case["B"], sizes, args.dtype, device)
        except Exception as exc:  # the case's row records it: one case must not lose the rest
            return exc
        search_s.append(time.perf_counter() - t)
        return sizes, cfg

    def build(job, found):
        case, _ = job
        if isinstance(found, Exception):
            return found
        sizes, cfg = found
        try:
            return get_kernel(case["C"], case["A"], case["B"], sizes, args.dtype, config=cfg)
        except Exception as exc:  # likewise
            return exc

    # the searches one after another, so that each one's seconds are its own (searches in threads
    # would count each other's turns of the interpreter), then the compiles in threads
    found = [search(job) for job in jobs]
    with ThreadPoolExecutor(16) as pool:
        kernels = list(pool.map(build, jobs, found))
    result["compile_s"] = time.perf_counter() - t0
    result["max_search_s"] = max([*search_s, result.get("max_search_s", 0.0)], default=0.0)
    print(f"configured and compiled {len(jobs)} kernels in {result['compile_s']:.1f} s",
          flush=True)
    for (case, s), kern in zip(jobs, kernels):
        t = time.perf_counter()
        try:
            if isinstance(kern, Exception):  # its search or its compile failed
                raise kern
            row = run_case(case, s, kern, args.budget, use_torch, (result["dgemm_gflops"], result["copy_gbs"]))
        except Exception as exc:  # recorded, not hidden: one failing case must not lose the rest
            row = {"id": case["id"], "name": case["name"], "scale": s, "error": repr(exc)}
        row["case_s"] = time.perf_counter() - t  # every check and timing of the case: what a device call spends
        # The case's arrays are gone with run_case's frame: hand their blocks back to the device
        # (without this, cases 32-48 at scale 2 find too little free memory and are skipped).
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
        result["rows"].append(row)
        if "error" in row or "skipped" in row:
            print(f"{case['id']:2d} x{s} {row.get('error') or 'SKIPPED ' + row['skipped']}",
                  flush=True)
        else:
            print(f"{row['id']:2d} x{s} {row['name']:18s} err={row['rel_err']:.1e}/"
                  f"{row['rel_err_beta']:.1e} gett={row.get('gett_gflops', float('nan')):6.0f} "
                  f"packed={row.get('packed_gflops', float('nan')):6.0f} "
                  f"splitk={row.get('splitk_gflops', float('nan')):6.0f} "
                  f"cogent={row['cogent_gflops']:6.0f} batched={row.get('batched_gflops', float('nan')):6.0f} "
                  f"relayout={row.get('relayout_gflops', float('nan')):6.0f} "
                  f"chainexec={row['chainexec_gflops']:6.0f} "
                  f"({row['selector']}) cupy={row['cupy_einsum_gflops']:6.0f} "
                  f"torch={row.get('torch_einsum_gflops', float('nan')):6.0f} "
                  f"cutensor={row.get('cutensor_gflops', float('nan')):6.0f} GFLOP/s "
                  f"x{row['ratio_vs_best_library']:.2f} (at most x{row['ceiling_vs_best_library']:.2f}: "
                  f"bound {row['bound_gflops']:6.0f} GFLOP/s, {row['of_bound']:.0%} of it) {row['case_s']:.0f} s",
                  flush=True)
        atomicfile.write(partial, json.dumps(result, indent=1), atomicfile.USER_FILE)
    result["rows"].sort(key=lambda r: (r["scale"], r["id"]))
    tol = 1e-12 if args.dtype == "float64" else 1e-5
    bad = [r for r in result["rows"] if "skipped" not in r and (
        "error" in r or not r["rel_err"] <= tol or not r["rel_err_beta"] <= tol)]
    result["failures"] = [(r["id"], r["scale"]) for r in bad]
    result["summary"] = summary(result["rows"])
    atomicfile.write(out, json.dumps(result, indent=1), atomicfile.USER_FILE)
    partial.unlink(missing_ok=True)
    for scale, groups in result["summary"].items():
        print(f"scale {scale}: " + "; ".join(f"{g} geomean {v['geomean']:.2f} (at most {v['ceiling_geomean']:.2f}) "
                                             f"min {v['min']:.2f} ({len(v['below_1'])} below 1 of {v['cases']}), "
                                             f"{v['of_bound_geomean']:.0%} of the bound"
                                             for g, v in groups.items()))
    print(f"failures: {result['failures']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
