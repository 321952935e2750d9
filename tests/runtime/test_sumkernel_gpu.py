"""GPU tests of the generated sum-of-contractions kernels, register and tensor-core (skipped
without a GPU).

Every result is compared with ``numpy.einsum`` term by term on the host, on fresh random inputs:
operands are interior slices of larger device buffers filled with NaN outside them (a read past a
view poisons the result), extents do not divide into the tiles, and each of the model's top
candidates is run, not only the first.
"""

import math

import numpy as np
import pytest

from tests.conftest import require_gpu

cupy = require_gpu()

from chainexec.kernels import stacking, sumkernel, summma  # noqa: E402
from chainexec.kernels.gett import MMA_SHAPES, SM90_SHAPES  # noqa: E402
from chainexec.planner.plan import Contraction  # noqa: E402
from chainexec.runtime import kernelcache, launch  # noqa: E402
from chainexec.runtime.backends import termruns, tuning  # noqa: E402
from chainexec.runtime.backends.cupy import CupyBackend  # noqa: E402
from tests.kernels.test_sumkernel import CASES  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = {"float64": 1e-12, "float32": 1e-5}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path / "cache"))


def _on_device(x, pad):
    """``x`` as an interior view of a NaN-filled device buffer (``pad``: elements around it)."""
    if not pad:
        return cupy.asarray(x)
    big = cupy.full([n + 2 * pad for n in x.shape], cupy.nan, dtype=x.dtype)
    sl = tuple(slice(pad, pad + n) for n in x.shape)
    big[sl] = cupy.asarray(x)
    return big[sl]


def _case(out, terms, sizes, dtype, seed, pad):
    rng = np.random.default_rng(seed)
    host = [(rng.standard_normal([sizes[i] for i in a]).astype(dtype),
             rng.standard_normal([sizes[i] for i in b]).astype(dtype), f) for a, b, f in terms]
    c0 = rng.standard_normal([sizes[i] for i in out]).astype(dtype)
    ref = c0.astype(np.float64)
    for (a, b, _), (x, y, f) in zip(terms, host):
        ref = ref + f * np.einsum(f"{a},{b}->{out}", x.astype(np.float64), y.astype(np.float64))
    ops = [(_on_device(x, pad), _on_device(y, pad)) for x, y, _ in host]
    return c0, ref, ops


def _problem(out, terms, C, ops, dtype):
    def view(arr, idx):
        return sumkernel.View(tuple(idx), arr.shape, tuple(s // arr.itemsize for s in arr.strides))

    return sumkernel.problem(view(C, out), [sumkernel.Term(view(x, a), view(y, b), f)
                                            for (a, b, f), (x, y) in zip(terms, ops)], dtype)


@pytest.mark.parametrize("kind", sorted(launch.SUM_KINDS))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("pad", [0, 2])
@pytest.mark.parametrize("out,terms,sizes", CASES)
def test_top_candidates_match_einsum(out, terms, sizes, dtype, pad, kind):
    """Every top candidate of each sum kernel (the tensor-core one has none for float32 or a
    batch index, and says so)."""
    c0, ref, ops = _case(out, terms, sizes, dtype, seed=len(terms) + pad, pad=pad)
    C = _on_device(c0, pad)
    prob = _problem(out, terms, C, ops, dtype)
    gen = launch.SUM_KINDS[kind][0]
    cands = gen.candidates(prob, launch.device_model())
    batch = any(set(a) & set(b) for a, b in (sumkernel._sides(prob, t) for t in prob.terms))
    assert bool(cands) == (kind == "sum" or (dtype == "float64" and not batch))
    for cfg in cands:
        _check(kind, prob, cfg, C, c0, ops, ref, dtype)


def _check(kind, prob, cfg, C, c0, ops, ref, dtype):
    C[...] = cupy.asarray(c0)
    launch.launch_sum(kind, prob, cfg, C, ops, store=False)
    assert np.array_equal(cupy.asnumpy(C), c0), cfg.name()  # nothing written when timing
    launch.launch_sum(kind, prob, cfg, C, ops)
    got = cupy.asnumpy(C).astype(np.float64)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err <= TOL[dtype], (cfg.name(), err)


@pytest.mark.parametrize("shape", sorted(MMA_SHAPES))
def test_every_mma_shape_matches_einsum(shape):
    """The tensor-core kernel with each FP64 MMA shape the device has, on the W terms with a
    tile the extents do not divide, at sizes with several blocks."""
    if shape in SM90_SHAPES and int(launch.device_model().compute_capability) < 90:
        pytest.skip(f"{shape} needs sm_90")
    out, terms, _ = CASES[0]
    sizes = dict(i=5, j=4, k=3, a=19, b=17, c=21, f=23, m=7)
    c0, ref, ops = _case(out, terms, sizes, "float64", seed=11, pad=1)
    C = _on_device(c0, 1)
    prob = _problem(out, terms, C, ops, "float64")
    cfg = summma.MmaConfig((2, 2, 3, 4, 4, 8), 4, 16, shape)
    _check("summma", prob, cfg, C, c0, ops, ref, "float64")


@pytest.mark.parametrize("method,room", [("auto", None), ("auto", 1 << 10), ("sum", None), ("summma", None),
                                         ("split", None), ("ttgt", None)])
def test_backend_contract_sum(method, room):
    """The backend's run of contractions: tuned (the sum kernels, the terms one by one and, where
    terms stack, the stacks, timed on a scratch output, or, with no room for one, on the output
    itself), forced to a sum kernel, split (the six sums over m in the
    register kernel, the others one by one), or term by term."""
    out, terms, sizes = CASES[0]
    c0, ref, ops = _case(out, terms, sizes, "float64", seed=7, pad=2)
    C = _on_device(c0, 2)
    cs = [Contraction(k, "C", list(out), f"A{k}", list(a), f"B{k}", list(b), f, True, 0, k)
          for k, (a, b, f) in enumerate(terms)]
    be = CupyBackend(cupy, method, math.inf)  # auto: every candidate timed
    if room is not None:
        be.limit_memory(room, 0)
    for _ in range(2):  # the deciding call, then the decision
        C[...] = cupy.asarray(c0)
        be.contract_sum(cs, C, ops)
        err = np.linalg.norm(cupy.asnumpy(C) - ref) / np.linalg.norm(ref)
        assert err <= 1e-12
    choice = be.choices[next(k for k in be.choices if k[0] == "sum")] if method != "ttgt" else None
    prob = _problem(out, terms, C, ops, "float64")
    if method == "auto":
        parts = [prob] + [prob.part(p) for p in sumkernel.splits(prob)]
        timed = sum(len(launch.SUM_KINDS[k][0].candidates(p, launch.device_model()))
                    for k in termruns.TIMED_SUM_KINDS for p in parts)
        stacks = stacking.groups(tuple(out), [(tuple(a), tuple(b)) for a, b, _ in terms], [sizes] * len(terms))
        assert len(parts) == 2 and choice.method in termruns.TIMED_SUM_KINDS + ("terms", "split", "stack")
        # and the terms one by one, and the stacks where their operand copies have room
        assert len(choice.seconds) == timed + 1 + (bool(stacks) and room is None)
    elif method == "split":
        assert choice.method == "split" and choice.config["terms"] == list(range(6, 12))
    elif method in launch.SUM_KINDS:
        assert choice.method == method and not choice.seconds


def test_precompiled_candidates_load_without_compiling(monkeypatch):
    """The candidates compiled at once beforehand (:func:`kernelcache.precompile`, threads) are the
    ones launched later: no further NVRTC run, and each still matches ``numpy.einsum``."""
    out, terms, sizes = CASES[0]
    c0, ref, ops = _case(out, terms, sizes, "float64", seed=11, pad=1)
    C = _on_device(c0, 1)
    prob = _problem(out, terms, C, ops, "float64")
    dev = launch.device_model()
    jobs = [(prob, cfg) for cfg in sumkernel.candidates(prob, dev)]
    jobs += [(prob.part(p), cfg) for p in sumkernel.splits(prob) for cfg in sumkernel.candidates(prob.part(p), dev)]
    assert len(jobs) >= 4
    kernelcache.precompile([sumkernel.generate(p, cfg) for p, cfg in jobs], dev.compute_capability)
    calls = []
    real = kernelcache.compile_cubin
    monkeypatch.setattr(kernelcache, "compile_cubin", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(kernelcache, "_LOADED", {})
    monkeypatch.setattr(kernelcache, "_MODULES", {})
    monkeypatch.setattr(launch, "_SUM", {})
    for p, cfg in jobs:
        part = [k for k, t in enumerate(prob.terms) if t in p.terms]
        want = c0.astype(np.float64)
        for k in part:
            a, b, f = terms[k]
            want = want + f * np.einsum(f"{a},{b}->{out}", cupy.asnumpy(ops[k][0]), cupy.asnumpy(ops[k][1]))
        C[...] = cupy.asarray(c0)
        launch.launch_sum("sum", p, cfg, C, [ops[k] for k in part])
        assert np.linalg.norm(cupy.asnumpy(C) - want) / np.linalg.norm(want) <= 1e-12, cfg.name()
    assert calls == []


@pytest.mark.parametrize("method", ["stack", "auto"])
def test_backend_stacks_the_short_sums(method):
    """The W tile with occupied tiles of one (a=b=c=40, m=4): the six sums over m pair into three
    stacked GEMMs (forced, or timed by the autotuner beside the terms and the sum kernels), on
    NaN-padded views, against numpy.einsum; the third time into a fresh tile of NaN, which the
    first stack overwrites (cuBLAS's β = 0) and the rest add to."""
    out, terms, _ = CASES[0]
    sizes = dict(i=1, j=1, k=1, a=40, b=40, c=40, f=6, m=4)
    c0, ref, ops = _case(out, terms, sizes, "float64", seed=3, pad=1)
    C = _on_device(c0, 1)
    cs = [Contraction(k, "C", list(out), f"A{k}", list(a), f"B{k}", list(b), f, True, 0, k)
          for k, (a, b, f) in enumerate(terms)]
    be = CupyBackend(cupy, method, math.inf)  # auto: every candidate timed
    for _ in range(2):
        C[...] = cupy.asarray(c0)
        be.contract_sum(cs, C, ops)
        assert np.linalg.norm(cupy.asnumpy(C) - ref) / np.linalg.norm(ref) <= 1e-12
    C[...] = np.nan
    be.contract_sum(cs, C, ops, fresh=True)
    assert np.linalg.norm(cupy.asnumpy(C) - (ref - c0)) / np.linalg.norm(ref - c0) <= 1e-12
    choice = be.choices[next(k for k in be.choices if k[0] == "sum")]
    assert choice.method == "stack" if method == "stack" else "stack" in choice.seconds
    stacked = [k for k, ch in be.choices.items() if k[0] != "sum" and k[1][0].startswith("stacked")]
    assert len(stacked) == 3  # one contraction per pair, each tuned on its own


def _relayout_recorded(terms, monkeypatch):
    """W's ``terms`` as contractions, a backend forced to relayout, and the list of the memory
    addresses it copies from (every :meth:`_contiguous` call)."""
    cs = [Contraction(k, "W", list("ijkabc"), f"A{k}", list(a), f"B{k}", list(b), f, True, 0, k)
          for k, (a, b, f) in enumerate(terms)]
    be = CupyBackend(cupy, "relayout")
    copied = []
    contiguous = be._contiguous
    monkeypatch.setattr(be, "_contiguous", lambda x: copied.append(x.data.ptr) or contiguous(x))
    return cs, be, copied


def test_relayout_copy_kept_from_term_to_term(monkeypatch):
    """W's terms ``ovvv[k,c,f,a]·t2[j,i,b,f]`` and ``ovvv[k,c,f,b]·t2[i,j,a,f]`` read the same
    slice of one ``ovvv`` buffer, as in the executor: forced to relayout, a run copies that slice
    once for both (and the result equals numpy.einsum), while the autotuner's timings of one
    term copy it every time."""
    o, v = 5, 11
    rng = np.random.default_rng(9)
    full = {"ovvv": rng.standard_normal((o, v, v, v)), "t2": rng.standard_normal((o, o, v, v)),
            "ovoo": rng.standard_normal((o, v, o, o))}
    dev = {n: cupy.asarray(x) for n, x in full.items()}
    occ = {"i": slice(0, 1), "j": slice(1, 2), "k": slice(3, 4)}
    terms = [(a, b, f) for a, b, f in CASES[0][1]]

    def view(arrays, name, idx):
        return arrays[name][tuple(occ.get(i, slice(None)) for i in idx)]

    ops = [(view(dev, "ovvv" if "f" in a else "ovoo", a), view(dev, "t2", b)) for a, b, _ in terms]
    ref = sum(f * np.einsum(f"{a},{b}->ijkabc", view(full, "ovvv" if "f" in a else "ovoo", a), view(full, "t2", b))
              for a, b, f in terms)
    cs, be, copied = _relayout_recorded(terms, monkeypatch)
    slice_k = dev["ovvv"][3].data.ptr
    for n in range(2):
        copied.clear()
        W = cupy.zeros((1, 1, 1, v, v, v))
        be.contract_sum(cs, W, ops)
        assert np.linalg.norm(cupy.asnumpy(W) - ref) / np.linalg.norm(ref) <= 1e-12
        assert [be.choices[be._kept_key(cs[k], W, *ops[k])].method for k in (4, 5)] == ["relayout"] * 2
        assert copied.count(slice_k) == 1
    copied.clear()
    be._time(("relayout", None), cs[4], W, *ops[4])
    assert copied.count(slice_k) == 1 + tuning.TIMED_RUNS  # the warm-up and every timed run


def test_relayout_copy_held_while_steady(monkeypatch):
    """Inside :meth:`Backend.steady` (a loop that only reads ``ovvv``), the relayout copy of the
    slice ``ovvv[k]`` is held from tile to tile: tiles that share k copy it once, a new k copies
    its own slice, each tile equals numpy.einsum, and leaving drops it. The loop sets a quarter of
    the room the plan leaves aside for held copies (the rest is the autotuner's); where a copy
    does not fit there, it is only kept within a run. The run: W's two
    terms that read ``ovvv[k]``, which the relayout method copies in (T)."""
    o, v = 5, 11
    rng = np.random.default_rng(10)
    full = {"ovvv": rng.standard_normal((o, v, v, v)), "t2": rng.standard_normal((o, o, v, v))}
    dev = {n: cupy.asarray(x) for n, x in full.items()}
    terms = CASES[0][1][4:6]
    cs, be, copied = _relayout_recorded(terms, monkeypatch)
    slices = [dev["ovvv"][k].data.ptr for k in range(o)]

    def tiles(ijks):
        for i, j, k in ijks:
            occ = {"i": slice(i, i + 1), "j": slice(j, j + 1), "k": slice(k, k + 1)}

            def view(arrays, name, idx):
                return arrays[name][tuple(occ.get(x, slice(None)) for x in idx)]

            ops = [(view(dev, "ovvv", a), view(dev, "t2", b)) for a, b, _ in terms]
            ref = sum(f * np.einsum(f"{a},{b}->ijkabc", view(full, "ovvv", a), view(full, "t2", b))
                      for a, b, f in terms)
            W = cupy.zeros((1, 1, 1, v, v, v))
            be.contract_sum(cs, W, ops)
            assert np.linalg.norm(cupy.asnumpy(W) - ref) / np.linalg.norm(ref) <= 1e-12

    order = [(0, 1, 3), (1, 2, 3), (2, 2, 3), (0, 0, 4), (1, 2, 4)]  # i, j < k: only ovvv[k] is copied
    with be.steady(list(dev.values())):
        tiles(order)
        assert be._held
    assert not be._held
    assert [copied.count(s) for s in slices] == [0, 0, 0, 1, 1]
    copied.clear()
    tiles(order[:2])  # outside: once per run
    assert [copied.count(s) for s in slices] == [0, 0, 0, 2, 0]
    copied.clear()
    nbytes = full["ovvv"][0].nbytes
    be.workspace = 4 * nbytes - 4  # a quarter of the room set aside is one byte short of a copy
    with be.steady(list(dev.values())):
        assert be.workspace == 3 * nbytes - 3
        tiles(order)
    assert [copied.count(s) for s in slices] == [0, 0, 0, 3, 2]
    copied.clear()
    be.workspace = 4 * nbytes
    with be.steady(list(dev.values())):
        assert be.workspace == 3 * nbytes  # the autotuner and temporaries get the rest
        tiles(order)
    assert be.workspace == 4 * nbytes and not be._held
    assert [copied.count(s) for s in slices] == [0, 0, 0, 1, 1]
