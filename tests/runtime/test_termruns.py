"""The strategies of a run of terms into one buffer (:mod:`chainexec.runtime.backends.termruns`),
driven by the CuPy backend's autotuner over NumPy arrays: the registry, the forced and tuned
choices within the room the plan leaves, and the sums they produce, against ``numpy.einsum`` over
the (T) ``W`` tile's twelve terms (independent of the backend's TTGT and stacking code). The
generated sum kernels need a GPU: ``tests/runtime/test_sumkernel_gpu.py`` runs them."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from chainexec.kernels import sumkernel
from chainexec.planner.plan import Contraction
from chainexec.runtime.backends import termruns, tuning
from chainexec.runtime.backends.common import element_strides
from tests.kernels.test_sumkernel import W_TERMS
from tests.runtime.hosttiles import HostTiles
from tests.runtime.test_device import _Pool

EXTENT = dict(i=3, j=4, k=2, a=7, b=5, c=6, f=4, m=3)


class _Event:
    """A CUDA event as the autotuner uses it on NumPy, where work is done when it returns."""

    def record(self):
        pass

    def synchronize(self):
        pass


class _OnNumpy(HostTiles):
    """The CuPy backend on NumPy arrays: its contraction methods that need no GPU (TTGT, einsum)
    run for real; a timing runs its candidate once and reports :attr:`clock` seconds (the same for
    every candidate, so a strategy that runs fewer timed parts costs less)."""

    clock = 1e-3

    def _candidates(self, c, out, a, b):
        return {"ttgt": None, "einsum": None}

    def _timed(self, run):
        run()
        return self.clock


@pytest.fixture
def on_numpy(monkeypatch, tmp_path):
    """A factory of :class:`_OnNumpy` backends (forced ``method``, room in bytes, the autotuner's
    margin: by default every candidate timed) sharing one tuning folder of the test's own, with no
    sum kernel among the timed candidates."""
    monkeypatch.setattr(tuning.TuningCache, "for_device", classmethod(lambda cls, xp: cls("GPU", tmp_path)))
    monkeypatch.setattr(termruns, "TIMED_SUM_KINDS", ())
    xp = types.SimpleNamespace(**{k: getattr(np, k) for k in dir(np) if not k.startswith("_")},
                               get_default_memory_pool=_Pool,
                               cuda=types.SimpleNamespace(memory=types.SimpleNamespace(OutOfMemoryError=MemoryError),
                                                          Event=_Event, get_elapsed_time=lambda start, end: 1.0))

    def make(method: str = "auto", room: int | None = None, margin: float = math.inf):
        backend = _OnNumpy(xp, method, margin)
        if room is not None:
            backend.limit_memory(room, 0)
        return backend

    return make


def _run(seed: int, extent: dict[str, int] = EXTENT):
    """The W tile's terms, random operands, a random starting ``W`` and the einsum reference."""
    rng = np.random.default_rng(seed)
    cs = [Contraction(n, "W", list("ijkabc"), f"A{n}", list(a), f"B{n}", list(b), f, n > 0, 0, n)
          for n, (a, b, f) in enumerate(W_TERMS)]
    operands = [(rng.standard_normal([extent[i] for i in c.a_indices]),
                 rng.standard_normal([extent[i] for i in c.b_indices])) for c in cs]
    start = rng.standard_normal([extent[i] for i in "ijkabc"])
    total = sum(c.factor * np.einsum(f"{''.join(c.a_indices)},{''.join(c.b_indices)}->ijkabc", a, b)
                for c, (a, b) in zip(cs, operands))
    return cs, operands, start, total


def _choice(backend) -> tuning.Choice:
    return next(choice for key, choice in backend.choices.items() if key[0] == "sum")


def test_every_strategy_is_registered_once_and_can_be_forced():
    """The registry lists the strategies in the order their candidates are timed; every one but
    the terms one by one is a value of ``CHAINEXEC_GPU_METHOD``; only the tensor-core kernel waits
    to be forced."""
    assert list(termruns.REGISTRY) == ["terms", "sum", "summma", "split", "stack"]
    assert all(name == s.name for name, s in termruns.REGISTRY.items())
    assert [name for name in tuning.METHODS if name in termruns.REGISTRY] == ["sum", "summma", "split", "stack"]
    assert [name for name, s in termruns.REGISTRY.items() if s.timed()] == ["terms", "sum", "split", "stack"]
    assert [name for name, s in termruns.REGISTRY.items() if s.clears_fresh] == ["sum", "summma", "split"]


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("method,room,chosen", [
    ("auto", None, "stack"),       # the stacks run fewer timed parts than the twelve terms
    ("auto", 4096, "terms"),       # no room for a scratch tile and the stacks' copies
    ("stack", None, "stack"),
    ("stack", 512, "terms"),       # forced, but one stack's copies do not fit
])
def test_a_run_adds_its_terms_by_the_strategy_that_fits(on_numpy, method, room, chosen, fresh):
    """Two tiles of one shape, the first deciding and the second reusing the decision: each adds
    (or, ``fresh``, writes over NaN) the twelve terms, equal to einsum's sum to 1e-12, by the
    strategy that the timings choose, or that is forced, among those whose workspace fits."""
    backend = on_numpy(method, room)
    for seed in (1, 2):
        cs, operands, start, total = _run(seed)
        out = np.full_like(start, np.nan) if fresh else start.copy()
        backend.contract_sum(cs, out, operands, fresh)
        want = total if fresh else start + total
        assert np.linalg.norm(out - want) <= 1e-12 * np.linalg.norm(want)
    choice = _choice(backend)
    assert choice.method == chosen
    assert set(choice.seconds) == ({"terms", "stack"} if method == "auto" and room is None
                                   else {"terms"} if method == "auto" else set())


def test_stack_workspace_is_one_stacks_copies(on_numpy):
    """The stack strategy holds the copies of one stack at a time: the largest stack's operands, in
    the output's bytes per element."""
    backend = on_numpy()
    cs, operands, start, _ = _run(3)

    def view(arr, indices):
        return sumkernel.View(tuple(indices), tuple(arr.shape), element_strides(arr))

    prob = sumkernel.problem(view(start, "ijkabc"), [sumkernel.Term(view(a, c.a_indices), view(b, c.b_indices),
                                                                    c.factor) for c, (a, b) in zip(cs, operands)],
                             "float64")
    run = termruns.Run(cs, start, operands, prob, ("sum",))
    stacks = backend._stacks(cs, start, operands)
    assert stacks and all(len(st.terms) >= 2 for st in stacks)
    want = max(8 * sum(operands[k][0].size + operands[k][1].size for k in st.terms) for st in stacks)
    assert termruns.REGISTRY["stack"].workspace(backend, run, None) == want
    assert all(termruns.REGISTRY[name].workspace(backend, run, None) == 0 for name in ("terms", "split"))


def test_a_forced_contraction_method_runs_the_terms_one_by_one(on_numpy):
    """Forced to one contraction method, a run adds its terms one by one through it and decides
    no strategy."""
    backend = on_numpy("einsum")
    cs, operands, start, total = _run(4)
    out = start.copy()
    backend.contract_sum(cs, out, operands)
    assert np.linalg.norm(out - start - total) <= 1e-12 * np.linalg.norm(start + total)
    assert not [key for key in backend.choices if key[0] == "sum"]
    assert {choice.method for choice in backend.choices.values()} == {"einsum"}


def test_every_terms_kernels_are_compiled_together_before_any_timing(on_numpy, monkeypatch):
    """Tuning a run, the generated kernels of every term's candidates (here the direct kernel of
    each term's probe, one source per term) go to one parallel compile, grouped by compiler options,
    before the first candidate is timed; the run still adds the terms exactly."""
    from chainexec.kernels.kernelconf import Device
    from chainexec.runtime import kernelcache, launch

    timed, compiled = [], []
    monkeypatch.setattr(launch, "device_model", Device.H100)
    monkeypatch.setattr(kernelcache, "precompile", lambda kernels, capability, options=kernelcache.OPTIONS:
                        compiled.append((len(timed), options, {source for _, source in kernels})))
    backend = on_numpy()
    backend._candidates = lambda c, out, a, b: {"direct": None, "ttgt": None}
    backend._time = lambda how, c, out, a, b: timed.append(how[0]) or {"ttgt": 1.0, "direct": 2.0}[how[0]]
    cs, operands, start, total = _run(5)
    out = start.copy()
    backend.contract_sum(cs, out, operands)
    assert np.linalg.norm(out - start - total) <= 1e-12 * np.linalg.norm(start + total)
    before, options, sources = compiled[0]
    assert before == 0 and options == kernelcache.POINTWISE_OPTIONS
    assert len(sources) == len(cs) and all("chainexec_direct" in s for s in sources)
    assert len(timed) >= 2 * len(cs)  # every term's two candidates timed afterwards


def test_a_candidate_the_models_put_far_ahead_runs_untimed_and_alone_compiled(on_numpy, monkeypatch):
    """At the cost models' margin, a 640³ GEMM whose candidates are the direct kernel and TTGT
    (the direct kernel predicted more than :data:`~costmodel.WIDE` times slower) takes TTGT
    without timing anything or compiling the direct kernel; the decision is kept with no seconds and the product is added
    exactly. At 2×2, where launches dominate, the direct kernel (one launch against TTGT's four)
    is the one left."""
    from chainexec.runtime import kernelcache
    from chainexec.runtime.backends import costmodel

    compiled, timed = [], []
    monkeypatch.setattr(kernelcache, "precompile", lambda kernels, capability, options=None: compiled.append(kernels))
    backend = on_numpy(margin=costmodel.MARGIN)
    backend._candidates = lambda c, out, a, b: {"direct": None, "ttgt": None}
    backend._time = lambda how, c, out, a, b: timed.append(how[0]) or 1.0
    rng = np.random.default_rng(6)
    c = Contraction(0, "C", ["i", "j"], "A", ["i", "f"], "B", ["f", "j"], 0.5, True, 0, 0)
    a, b, out = (rng.standard_normal((640, 640)) for _ in range(3))
    want = out + 0.5 * np.einsum("if,fj->ij", a, b)
    backend.contract(c, out, a, b)
    assert np.linalg.norm(out - want) <= 1e-12 * np.linalg.norm(want)
    assert timed == [] and compiled == []
    assert [(choice.method, choice.seconds) for choice in backend.choices.values()] == [("ttgt", {})]
    small = [x[:2, :2].copy() for x in (a, b, out)]
    assert set(backend._timed_candidates(c, small[2], *small[:2])[1]) == {"direct"}


def test_a_strategy_the_models_put_far_ahead_runs_untimed(on_numpy, monkeypatch):
    """Where the strategies' models leave one (the stacks, predicted far ahead here), the run
    takes it without timing a term or a strategy, keeps the decision with no seconds, and adds
    the terms exactly; a second tile reads the decision."""
    from chainexec.runtime.backends import costmodel

    monkeypatch.setattr(termruns.Stack, "predicted", lambda self, tuner, run, each: 1e-9)
    backend = on_numpy(margin=costmodel.MARGIN)
    timings = []
    backend._timed = lambda run: timings.append(run) or 1.0
    for seed in (7, 8):
        cs, operands, start, total = _run(seed)
        out = start.copy()
        backend.contract_sum(cs, out, operands)
        assert np.linalg.norm(out - start - total) <= 1e-12 * np.linalg.norm(start + total)
    assert timings == []
    assert (_choice(backend).method, _choice(backend).seconds) == ("stack", {})


def _timed_runs(backend) -> list:
    """The timings ``backend`` makes from now on (each still runs its candidate once)."""
    made = []

    def timed(run):
        made.append(run)
        run()
        return backend.clock

    backend._timed = timed
    return made


def test_a_run_of_a_classmate_shape_takes_the_decided_strategy_untimed(on_numpy):
    """Runs of one class (:mod:`chainexec.runtime.backends.shapeclass`): the first shape's
    strategy is timed; a shape whose extents are within a factor of two of it (a cut tile, a
    slightly larger molecule) takes that strategy without timing anything, in this process and in
    a later one that shares the tuning cache, and adds the terms (to 1e-12); a shape beyond the
    factor of the timed one and within that of a reused decision only (i = 7) is timed again."""
    def added(backend, seed, extent) -> tuning.Choice:
        cs, operands, start, total = _run(seed, extent)
        out = start.copy()
        backend.contract_sum(cs, out, operands)
        assert np.linalg.norm(out - start - total) <= 1e-12 * np.linalg.norm(start + total)
        shape = f"shape={tuple(extent[i] for i in 'ijkabc')}"
        return next(c for k, c in backend.choices.items() if k[0] == "sum" and shape in k[1])

    backend = on_numpy()
    timings = _timed_runs(backend)
    first = added(backend, 10, EXTENT)
    assert first.method == "stack" and first.seconds and timings
    timings.clear()
    cut = added(backend, 11, EXTENT | {"i": 2, "c": 9})
    assert (cut.method, cut.seconds, timings) == ("stack", {}, [])
    later = on_numpy()  # its stacks differ: their own contractions may be timed, the strategy is not
    assert added(later, 12, EXTENT | {"i": 5, "c": 9}) == tuning.Choice("stack")
    timings = _timed_runs(later)
    assert added(later, 13, EXTENT | {"i": 7, "a": 10}).seconds and timings  # i: 7 is beyond 2 × 3


def test_a_contraction_of_a_classmate_shape_takes_the_decided_method_untimed(on_numpy):
    """A contraction whose candidates the models cannot tell apart is timed once per class: a
    classmate shape takes the method its nearest timed classmate won, untimed, in this process
    and in a later one; a shape within the factor of that reused decision but beyond the timed
    one's, or of another layout, is timed."""
    timed = []

    def timing(backend):
        backend._time = lambda how, c, out, a, b: timed.append(how[0]) or {"ttgt": 2.0, "einsum": 1.0}[how[0]]
        return backend

    backend = timing(on_numpy())
    rng = np.random.default_rng(14)
    c = Contraction(0, "C", ["i", "j"], "A", ["i", "f"], "B", ["f", "j"], 0.5, True, 0, 0)

    def contracted(i: int, f: int, j: int, transposed: bool = False) -> tuning.Choice:
        a, b, out = rng.standard_normal((i, f)), rng.standard_normal((f, j)), rng.standard_normal((i, j))
        if transposed:
            a = np.asfortranarray(a)
        want = out + 0.5 * np.einsum("if,fj->ij", a, b)
        backend.contract(c, out, a, b)
        assert np.linalg.norm(out - want) <= 1e-12 * np.linalg.norm(want)
        return backend.choices[backend._kept_key(c, out, a, b)]

    assert contracted(8, 9, 10).seconds == {"ttgt": 2.0, "einsum": 1.0}
    timed.clear()
    assert (contracted(12, 9, 6), timed) == (tuning.Choice("einsum"), [])
    assert contracted(20, 9, 10).seconds and timed  # 20 is beyond 2 × 8; near the reused 12 only
    timed.clear()
    assert contracted(8, 9, 10, transposed=True).seconds and timed
    timed.clear()
    backend = timing(on_numpy())  # a later process, sharing the tuning cache
    assert (contracted(14, 9, 15), timed) == (tuning.Choice("einsum"), [])


def test_a_decision_the_room_made_is_not_one_for_classmates(on_numpy):
    """Where the room the plan leaves turns candidates away, the decision is not kept for the
    shape's class: a run with no room for a scratch tile or stacks runs its terms one by one, and
    a classmate with room is timed; a contraction whose faster method (einsum here) does not fit
    takes TTGT untimed, and a classmate with room times both and takes einsum."""
    from chainexec.runtime.backends.methods import REGISTRY

    tight = on_numpy("auto", 4096)
    cs, operands, start, _ = _run(15)
    tight.contract_sum(cs, start.copy(), operands)
    assert _choice(tight).method == "terms"
    roomy = on_numpy()
    timings = _timed_runs(roomy)
    cs, operands, start, _ = _run(16, EXTENT | {"i": 2, "c": 9})
    roomy.contract_sum(cs, start.copy(), operands)
    assert _choice(roomy).seconds and timings

    rng = np.random.default_rng(17)
    c = Contraction(0, "C", ["i", "j"], "A", ["i", "f"], "B", ["f", "j"], 1.0, True, 0, 0)
    a, b, out = rng.standard_normal((8, 9)), rng.standard_normal((9, 10)), rng.standard_normal((8, 10))
    need = {m: REGISTRY[m].workspace(out, a, b) + 2 * out.nbytes for m in ("ttgt", "einsum")}
    assert need["einsum"] > need["ttgt"]
    for backend, shape, want in ((on_numpy("auto", need["ttgt"]), (8, 9, 10), tuning.Choice("ttgt")),
                                 (on_numpy(), (10, 9, 12), None)):
        backend._time = lambda how, c, out, a, b: {"ttgt": 2.0, "einsum": 1.0}[how[0]]
        i, f, j = shape
        x, y, z = rng.standard_normal((i, f)), rng.standard_normal((f, j)), rng.standard_normal((i, j))
        backend.contract(c, z, x, y)
        got = backend.choices[backend._kept_key(c, z, x, y)]
        assert got == want if want else (got.method, set(got.seconds)) == ("einsum", {"ttgt", "einsum"})
