"""The device seam on the CPU: the NumPy backend's ``contract`` against ``numpy.einsum`` on random
contractions (batch indices, unary copies, factors, strided views of larger buffers, float32 and
float64), host round trips, and ``select``'s errors.

``random_case`` and ``embedded`` are shared with ``test_device_gpu.py``. The reference is
``numpy.einsum`` in float64 on upcast inputs; it shares no code with the backend's TTGT path.
"""

from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest

from chainexec.errors import ChainexecError
from chainexec.kernels import batchedgemm
from chainexec.planner.plan import Contraction
from chainexec.runtime import device
from chainexec.runtime.backends import common, methods, termruns, tuning
from chainexec.runtime.backends.cupy import CupyBackend
from chainexec.runtime.backends.numpy import NumpyBackend
from chainexec.runtime.device import select
from tests.runtime.hosttiles import HostTiles

TOL = {"float64": 1e-12, "float32": 1e-5}


def random_case(rng: np.random.Generator, batch: bool, unary: bool = False, scalar: bool = False,
                max_extent: int = 6):
    """A random binary contraction (or unary permuted copy, or a full reduction to a scalar when
    ``scalar``) with random index orders, extents in 1..max_extent and a random factor; one side
    may have no external index. Index names are multi-character (``i0``, ``i1``, …), as in
    configs. Returns ``(Contraction, extents)``."""
    names = iter(f"i{k}" for k in range(20))
    size = {}

    def group(lo, hi):
        out = [next(names) for _ in range(rng.integers(lo, hi + 1))]
        size.update({i: int(rng.integers(1, max_extent + 1)) for i in out})
        return out

    factor = float(rng.choice([1.0, -0.5, 2.25]))
    if unary:
        idx = group(1, 4)
        perm = [idx[k] for k in rng.permutation(len(idx))]
        return Contraction(0, "X", perm, "A", idx, None, None, factor, True, 0, 0), size
    bt = group(1, 2) if batch else []
    if scalar:
        ae, be, ks = [], [], group(1, 3)
    else:
        ae, be, ks = group(1, 2), group(0, 2), group(0, 2)
    out, a, b = bt + ae + be, bt + ae + ks, bt + ks + be
    out, a, b = ([t[k] for k in rng.permutation(len(t))] for t in (out, a, b))
    return Contraction(0, "X", out, "A", a, "B", b, factor, True, 0, 0), size


def embedded(rng: np.random.Generator, shape, dtype, xp=np, step: bool = False):
    """A random array of ``shape`` as a strided view into a larger buffer (offsets on every axis,
    and a step of 2 on the first axis when ``step``); returns ``(view, buffer, slices)``."""
    pad = [int(rng.integers(1, 3)) for _ in shape]
    strides = [2 if step and k == 0 else 1 for k in range(len(shape))]
    big_shape = [p + s * n + 1 for p, s, n in zip(pad, strides, shape)]
    big = xp.asarray(rng.standard_normal(big_shape).astype(dtype))
    sl = tuple(slice(p, p + s * n, s) for p, s, n in zip(pad, strides, shape))
    return big[sl], big, sl


def reference(c: Contraction, out0, a, b) -> np.ndarray:
    """``out0 + factor · einsum`` in float64 (numpy.einsum, single-letter subscripts)."""
    letters = {i: chr(ord("a") + k) for k, i in enumerate(c.indices())}
    sub = lambda idx: "".join(letters[i] for i in idx)  # noqa: E731
    ops = [np.asarray(a, np.float64)] + ([np.asarray(b, np.float64)] if b is not None else [])
    spec = ",".join(sub(t) for t in [c.a_indices] + ([c.b_indices] if b is not None else []))
    return np.asarray(out0, np.float64) + c.factor * np.einsum(f"{spec}->{sub(c.out_indices)}", *ops)


def relerr(got, ref) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - ref) / max(np.linalg.norm(ref), 1e-300))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", ["plain", "batch", "unary", "scalar"])
def test_numpy_contract_matches_einsum(kind, dtype):
    """Contiguous operands and strided views (offsets, steps); the padding around ``out``'s view
    must stay untouched."""
    rng = np.random.default_rng({"plain": 1, "batch": 2, "unary": 3, "scalar": 4}[kind] * 10 + len(dtype))
    backend = NumpyBackend()
    for trial in range(40):
        c, size = random_case(rng, batch=kind == "batch", unary=kind == "unary", scalar=kind == "scalar")
        shape = lambda idx: [size[i] for i in idx]  # noqa: E731
        views = trial % 2 == 1 and kind != "scalar"  # a 0-d output has no view to cut
        step = trial % 4 == 3
        if views:
            a, _, _ = embedded(rng, shape(c.a_indices), dtype, step=step)
            b = embedded(rng, shape(c.b_indices), dtype, step=step)[0] if c.b is not None else None
            out, big, sl = embedded(rng, shape(c.out_indices), dtype, step=step)
        else:
            a = rng.standard_normal(shape(c.a_indices)).astype(dtype)
            b = rng.standard_normal(shape(c.b_indices)).astype(dtype) if c.b is not None else None
            out = big = rng.standard_normal(shape(c.out_indices)).astype(dtype)
            sl = ...
        before = big.copy()
        ref = reference(c, out, a, b)
        backend.contract(c, out, a, b)
        assert out.dtype == np.dtype(dtype)
        assert relerr(big[sl], ref) <= TOL[dtype], (c, size)
        untouched = np.ones(big.shape, bool)
        untouched[sl] = False
        assert np.array_equal(big[untouched], before[untouched])


def test_numpy_host_round_trip():
    rng = np.random.default_rng(7)
    backend = select("numpy")
    host = rng.standard_normal((3, 4, 5))
    buf = backend.zeros(host.shape, host.dtype)
    backend.fetch(buf, lambda rows, out: out.__setitem__(Ellipsis, host[rows]))
    back, token = backend.to_host_async(buf)
    assert backend.arrived(token) and np.array_equal(back, host)
    assert backend.zeros((2, 3), np.float32).dtype == np.float32
    assert not backend.zeros((2, 3), np.float64).any()


def test_numpy_fetch_reads_into_the_buffer():
    source = np.random.default_rng(8).standard_normal((5, 4))
    backend = select("numpy")
    buf = backend.zeros(source.shape, source.dtype)
    backend.fetch(buf, lambda rows, out: out.__setitem__(Ellipsis, source[rows]))
    assert np.array_equal(buf, source)
    scalar = backend.zeros((), np.float64)
    backend.fetch(scalar, lambda rows, out: out.fill(3.0))
    assert scalar.shape == () and float(scalar) == 3.0


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def test_select_numpy_and_errors(monkeypatch):
    monkeypatch.delenv("CHAINEXEC_GPU_METHOD", raising=False)
    backend = select("numpy")
    assert backend.name == "numpy" and backend.xp is np
    with pytest.raises(ChainexecError, match="unknown backend"):
        select("torch")
    monkeypatch.setenv("CHAINEXEC_GPU_METHOD", "fastest")
    with pytest.raises(ChainexecError, match="CHAINEXEC_GPU_METHOD"):
        select("numpy")


@pytest.mark.skipif(_has_gpu(), reason="a GPU is present: see test_device_gpu.py")
def test_select_without_gpu(monkeypatch):
    """Without a GPU, ``cupy`` is a clean ChainexecError and ``auto`` falls back to NumPy."""
    monkeypatch.delenv("CHAINEXEC_GPU_METHOD", raising=False)
    with pytest.raises(ChainexecError, match="backend cupy is not usable here"):
        select("cupy")
    assert select("auto").name == "numpy"


def test_cupy_backend_rejects_unknown_method():
    with pytest.raises(ChainexecError, match="unknown GPU contraction method"):
        CupyBackend(np, "fastest")


def test_device_memory_the_host_lacks_is_one_clear_error():
    with pytest.raises(ChainexecError, match="device memory: could not allocate 128.00 TiB"):
        select("numpy").zeros((2**22, 2**22), np.float64)


def test_ttgt_product_ends_in_the_outputs_fastest_index():
    """TTGT's GEMM takes the operand holding ``out``'s fastest index on the right, so the final
    add reads the product in runs along it: for every (T) W term (six of the twelve hold ``c`` in
    the left operand as written: four ``ovvv``, two ``ovoo``), and for random contractions, which
    must still equal ``numpy.einsum`` (``test_numpy_contract_matches_einsum``)."""
    from tests.kernels.test_sumkernel import W_TERMS

    swaps = 0
    for a, b, _ in W_TERMS:
        batch, lext, rext, ks, swap, *_ = common.ttgt_layout(tuple("ijkabc"), tuple(a), tuple(b))
        assert (batch + lext + rext)[-1] == "c"
        swaps += swap
    assert swaps == 6
    rng = np.random.default_rng(7)
    for _ in range(50):
        c, _ = random_case(rng, batch=bool(rng.integers(2)))
        batch, lext, rext, *_ = common.ttgt_layout(tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices))
        if c.out_indices[-1] in lext + rext:
            assert (batch + lext + rext)[-1] == c.out_indices[-1]


def test_tuning_cache_keeps_a_file_per_decision_and_reads_only_those_looked_up(tmp_path):
    """Each decision is a file of its own: a lookup sees another process's decision at once, and
    decisions are per device."""
    folder = tmp_path / "tuning"
    writer, reader = tuning.TuningCache("GPU A", folder), tuning.TuningCache("GPU A", folder)
    assert reader.get(("c1",), methods.REGISTRY) is None
    writer.put(("c1",), tuning.Choice("batched", {"batched": 1.0}))
    writer.put(("c2",), tuning.Choice("gett", {}, {"order": [1]}))
    assert [reader.get(k, methods.REGISTRY) for k in [("c1",), ("c2",), ("c1",)]] == [
        tuning.Choice("batched", {"batched": 1.0}), tuning.Choice("gett", {}, {"order": [1]}),
        tuning.Choice("batched", {"batched": 1.0})]
    writer.put(("c1",), tuning.Choice("ttgt"))  # decided again
    assert reader.get(("c1",), methods.REGISTRY) == tuning.Choice("ttgt")
    assert tuning.TuningCache("GPU B", folder).get(("c1",), methods.REGISTRY) is None
    assert sorted(p.suffix for p in folder.iterdir()) == [".json", ".json"]  # no temporary file left


@pytest.mark.parametrize("text", ["", "not json", "[1]", '{"key": "other", "choice": {"method": "ttgt"}}',
                                  '{"choice": {"method": "ttgt"}}', '{"key": "%s", "choice": {"nonsense": 1}}',
                                  '{"key": "%s", "choice": {"method": "bogus"}}',
                                  '{"key": "%s", "choice": {"method": "sum"}}',
                                  '{"key": "%s", "choice": {"method": ["gett"]}}',
                                  '{"key": "%s", "choice": {"method": "gett", "config": 3}}',
                                  '{"key": "%s", "choice": {"method": "gett", "seconds": []}}',
                                  '{"key": "%s", "choice": "gett"}'])
def test_a_foreign_decision_is_none_and_decided_again(tmp_path, text):
    """A decision file with its digest whose decision is not one of this contraction's methods
    (an unknown one, a run's strategy) or does not fit a :class:`~tuning.Choice` is none: the
    contraction is tuned again, where trusted it failed every later run."""
    cache = tuning.TuningCache("GPU", tmp_path / "tuning")
    cache.put(("c",), tuning.Choice("batched"))
    (file,) = (tmp_path / "tuning").iterdir()
    cache.store.save(file.stem, text.replace("%s", cache._key(("c",)).replace('"', '\\"')))
    assert tuning.TuningCache("GPU", tmp_path / "tuning").get(("c",), methods.REGISTRY) is None
    cache.put(("c",), tuning.Choice("einsum"))
    assert tuning.TuningCache("GPU", tmp_path / "tuning").get(("c",), methods.REGISTRY) == tuning.Choice("einsum")


def test_a_decision_changed_after_it_was_written_is_none(tmp_path):
    """A decision file edited so that it still parses (``bogus``, a method no backend has) does
    not match its digest: none, and tuned again; a run's strategy is found among the strategies,
    not the contraction methods."""
    cache = tuning.TuningCache("GPU", tmp_path / "tuning")
    cache.put(("c",), tuning.Choice("batched"))
    cache.put(("run",), tuning.Choice("sum", config={"kind": "sum"}))
    assert cache.get(("run",), termruns.REGISTRY) == tuning.Choice("sum", config={"kind": "sum"})
    assert cache.get(("run",), methods.REGISTRY) is None
    file = cache.store.path(tuning.diskstore.digest(cache._key(("c",))))
    file.write_text(file.read_text().replace('"batched"', '"bogus"'))
    assert cache.get(("c",), methods.REGISTRY) is None


def test_a_class_file_keeps_what_every_process_adds(tmp_path):
    """Two processes (caches) adding decided shapes to one class: each addition reads the file
    again, so none is lost; a shape decided again replaces its entry; the latest ``KEPT`` stay;
    another class, or a file whose extents are not numbers, holds none."""
    from chainexec.runtime.backends import shapeclass

    first, second = (tuning.TuningCache("GPU", tmp_path / "tuning") for _ in range(2))
    sig = ["one", "float64", [[["i", "j"], [0, 1], []]]]
    first.classify(sig, {"i": 4, "j": 4}, "gett")
    second.classify(sig, {"i": 40, "j": 40}, "batched")
    assert first.classify(sig, {"i": 11, "j": 11}, "ttgt") == [
        ({"i": 4, "j": 4}, "gett"), ({"i": 40, "j": 40}, "batched"), ({"i": 11, "j": 11}, "ttgt")]
    second.classify(sig, {"i": 4, "j": 4}, "relayout")
    assert tuning.TuningCache("GPU", tmp_path / "tuning").classmates(sig)[-1] == ({"i": 4, "j": 4}, "relayout")
    for n in range(shapeclass.KEPT + 3):
        first.classify(sig, {"i": 100 + n, "j": 4}, "gett")
    kept = first.classmates(sig)
    assert len(kept) == shapeclass.KEPT and kept[-1] == ({"i": 100 + shapeclass.KEPT + 2, "j": 4}, "gett")
    assert first.classmates(sig[:2] + [[[["j", "i"], [0, 1], []]]]) == []
    (file,) = [f for f in (tmp_path / "tuning").iterdir() if "shapes" in f.read_text()]
    file.write_text(file.read_text().replace('"j": 4}', '"j": "four"}', 1))
    assert first.classmates(sig) == []


def test_a_decision_of_the_older_single_file_is_moved_to_its_own(tmp_path, monkeypatch):
    old = tuning.TuningCache("GPU", tmp_path / "tuning")
    (tmp_path / "tuning.json").write_text(json.dumps({
        old._key(("c1",)): {"method": "gett", "seconds": {}, "config": {"order": [0]}},
        old._key(("c2",)): {"method": "nonsense-field-set", "colour": "red"},
        old._key(("c4",)): {"method": "bogus", "seconds": {}, "config": None}}))
    assert old.get(("c1",), methods.REGISTRY) == tuning.Choice("gett", {}, {"order": [0]})
    assert all(old.get((k,), methods.REGISTRY) is None for k in ("c2", "c3", "c4"))
    reads = []
    real = json.loads
    monkeypatch.setattr(tuning.json, "loads", lambda text: reads.append(len(text)) or real(text))
    fresh = tuning.TuningCache("GPU", tmp_path / "tuning")
    assert fresh.get(("c1",), methods.REGISTRY) == tuning.Choice("gett", {}, {"order": [0]})
    assert len(reads) == 1  # its own file only: the older one is not read again


def test_gemm_scalars_by_address_unless_the_binding_takes_values():
    def by_address():
        """gemm(intptr_t handle, int transa, int transb, int m, int n, int k, size_t alpha, ...)"""

    def by_value():
        """gemm(intptr_t handle, int transa, int transb, int m, int n, int k, double alpha, ...)"""

    keep, one, two = batchedgemm.gemm_scalars(by_address, 1.5, 0.0, np.float64)
    assert (one, two) == (keep.ctypes.data, keep.ctypes.data + 8) and keep.tolist() == [1.5, 0.0]
    assert batchedgemm.gemm_scalars(by_value, 1.5, 1.0, np.float32)[1:] == (1.5, 1.0)


class _Pool:
    """CuPy's memory pool as the autotuner asks it, holding nothing."""

    def total_bytes(self):
        return 0

    def free_bytes(self):
        return 0

    def free_all_blocks(self):
        pass


class _Timed(HostTiles):
    """The CuPy backend's autotuner on NumPy arrays with its GPU parts stood in for: every
    contraction runs as nothing, TTGT times faster than einsum, and a run of terms takes a
    millisecond whichever way (so stacking them wins: fewer of them)."""

    def _candidates(self, c, out, a, b):
        return {"ttgt": None, "einsum": None}

    def _time(self, how, c, out, a, b):
        return {"ttgt": 1.0, "einsum": 2.0}[how[0]]

    def _timed(self, run):
        run()
        return 0.001

    def _run(self, how, c, out, a, b, fresh=False):
        pass


def test_a_cold_run_keeps_every_choice_the_next_run_looks_up(tmp_path, monkeypatch):
    """Three processes in turn, each adding the (T) W tile's twelve terms (stacked in pairs) into
    two tiles of one shape within the plan's room: the first tunes and keeps every choice under
    the key the next looks up, so the second and the third tune nothing — the stacks'
    contractions too, which are timed within less room (a scratch tile) than they run in. Every
    candidate is timed (margin ``inf``)."""
    from chainexec.kernels.kernelconf import Device
    from chainexec.runtime import kernelcache, launch
    from tests.kernels.test_sumkernel import W_TERMS

    folder = tmp_path / "tuning"
    monkeypatch.setattr(tuning.TuningCache, "for_device", classmethod(lambda cls, xp: cls("GPU", folder)))
    monkeypatch.setattr(launch, "device_model", Device.H100)
    monkeypatch.setattr(kernelcache, "precompile", lambda *args, **kw: None)
    monkeypatch.setattr(termruns, "TIMED_SUM_KINDS", ())  # no generated kernel: terms or stacks
    xp = types.SimpleNamespace(zeros=np.zeros, empty=np.empty, ndarray=np.ndarray, multiply=np.multiply,
                               get_default_memory_pool=_Pool,
                               cuda=types.SimpleNamespace(memory=types.SimpleNamespace(OutOfMemoryError=MemoryError)))
    extent = dict(i=4, j=4, k=4, a=10, b=10, c=10, f=10, m=8)
    cs = [Contraction(n, "W", list("ijkabc"), "ovvv" if n < 6 else "ovoo", list(a), "t2", list(b), f, n > 0, 0, n)
          for n, (a, b, f) in enumerate(W_TERMS)]
    rng = np.random.default_rng(3)
    operands = [(rng.random([extent[i] for i in c.a_indices]), rng.random([extent[i] for i in c.b_indices])) for c in cs]
    tuned = []
    for process in range(3):
        backend = _Timed(xp, "auto", math.inf)
        backend.limit_memory(40 << 30, 1 << 30)
        put = backend.tuning.put
        monkeypatch.setattr(backend.tuning, "put", lambda key, choice, put=put, n=process: tuned.append(n) or put(key, choice))
        for _ in range(2):
            backend.contract_sum(cs, np.zeros([extent[i] for i in "ijkabc"]), operands, fresh=True)
        assert [ch.method for key, ch in backend.choices.items() if key[0] == "sum"] == ["stack"]
    assert tuned.count(0) > 12 and tuned.count(1) == tuned.count(2) == 0


@pytest.fixture
def numpy_gpu(monkeypatch, tmp_path):
    """A CuPy backend over NumPy arrays (its tuning cache in a folder of the test's own, its tile
    operations NumPy's): what its contraction methods that need no GPU (TTGT, einsum) do, run on
    the CPU."""
    monkeypatch.setattr(tuning.TuningCache, "for_device", classmethod(lambda cls, xp: cls("GPU", tmp_path)))
    return HostTiles(np)


def test_tune_seconds_count_each_outermost_timing_once(numpy_gpu):
    """:meth:`startup_seconds`' ``tune``: the wall seconds of the autotuner's timing calls, a
    timing nested in another (a stack timed through its terms) counted once with its outer one;
    candidates that cannot launch (here: each raises after a pause) are timed too. The NumPy
    backend compiles and tunes nothing."""
    import math
    import time

    def inner():
        time.sleep(0.2)
        raise RuntimeError("cannot launch here")

    def outer():
        numpy_gpu._timed(inner)
        time.sleep(0.05)
        raise RuntimeError("cannot launch here")

    assert numpy_gpu.startup_seconds()["tune"] == 0.0
    assert numpy_gpu._timed(outer) == math.inf
    tune = numpy_gpu.startup_seconds()["tune"]
    assert 0.25 <= tune < 0.45  # counted twice, the nested 0.2 s would make it at least 0.45
    assert set(numpy_gpu.startup_seconds()) == {"compile", "tune"}
    assert NumpyBackend().startup_seconds() == {}


def test_backends_declare_the_capabilities_whose_members_they_have(numpy_gpu):
    """A backend declares an optional capability exactly where it has that capability's members
    of its own; without it, it keeps the seam's."""
    def own(backend, name: str) -> bool:
        if hasattr(device.Backend, name):
            return getattr(type(backend), name) is not getattr(device.Backend, name)
        return hasattr(backend, name)

    for backend in (NumpyBackend(), numpy_gpu):
        for capability, members in device.CAPABILITIES.items():
            has = [name for name in members if own(backend, name)]
            assert has == (list(members) if capability in backend.capabilities else []), (backend.name, capability)
    assert NumpyBackend().capabilities == frozenset()
    assert numpy_gpu.capabilities == frozenset(device.CAPABILITIES)


def test_no_module_outside_the_backends_asks_which_backend_it_runs_on():
    """Code outside :mod:`chainexec.runtime.backends` and the seam asks a backend for a capability
    (:data:`chainexec.runtime.device.CAPABILITIES`), not for its name or class."""
    import re
    from pathlib import Path

    import chainexec

    asking = re.compile(r"\.name\s*[!=]=\s*[\"'](cupy|numpy)[\"']|isinstance\([^)]*(Cupy|Numpy)Backend")
    root = Path(chainexec.__file__).parent
    found = [str(path.relative_to(root)) for path in root.rglob("*.py")
             if "backends" not in path.parts and asking.search(path.read_text())]
    assert found == []


def test_every_method_is_registered_once_with_its_workspace():
    """The registry lists the methods in the order the autotuner names its candidates, and each
    bounds its temporaries as documented (bytes)."""
    assert list(methods.REGISTRY) == ["gett", "packed", "splitk", "batched", "relayout", "kernel", "ttgt", "einsum",
                                      "direct", "cutensor"]
    assert all(name == m.name for name, m in methods.REGISTRY.items())
    out, a, b = np.zeros(10), np.zeros(3), np.zeros(5)
    assert {name: m.workspace(out, a, b) for name, m in methods.REGISTRY.items()} == {
        "gett": 0, "packed": 64, "splitk": 16 * 80, "batched": 0, "relayout": 64, "kernel": 144, "ttgt": 144,
        "einsum": 224, "direct": 0, "cutensor": 80}
    assert [name for name, m in methods.REGISTRY.items() if m.in_place] == ["gett", "packed", "splitk", "direct"]
    assert [name for name, m in methods.REGISTRY.items() if m.writes_fresh] == ["gett", "packed", "splitk", "batched",
                                                                               "relayout", "ttgt"]


@pytest.mark.parametrize("method", ["ttgt", "einsum"])
@pytest.mark.parametrize("fresh", [False, True])
def test_methods_that_need_no_gpu_add_the_product(numpy_gpu, method, fresh):
    """TTGT and einsum through the backend's dispatch (:meth:`Methods._run`), on NumPy: ``out +=
    factor·a·b``, or, on a ``fresh`` output holding NaN, ``out = factor·a·b`` (TTGT writes its
    product in; einsum adds to the output cleared first)."""
    rng = np.random.default_rng(5)
    for _ in range(10):
        c, size = random_case(rng, batch=True)
        a, b, out = (rng.standard_normal([size[i] for i in idx]) for idx in (c.a_indices, c.b_indices, c.out_indices))
        want = reference(c, np.zeros_like(out) if fresh else out, a, b)
        if fresh:
            out[...] = np.nan
        numpy_gpu._run((method, None), c, out, a, b, fresh)
        assert relerr(out, want) <= 1e-12


def _numpy_with_streams():
    """NumPy with stand-in CUDA streams (``xp.cuda``) that queue work: ``xp.matmul`` and the
    callables passed to ``queued`` run later, on the stream current when they were called; a
    stream's wait and record are queued likewise (an event is (stream, its queue's length when
    recorded), reached once the stream has run that many entries). ``xp.empty`` returns arrays
    of NaN, so that work run before what it reads is visible, and logs the stream current at
    each allocation in ``xp.allocated``. Returns (xp, the current stream
    outside every ``with``, every stream made, ``queued``, ``drain``): ``queued(kind, fn)``
    wraps ``fn`` to queue its calls under ``kind``; ``drain(pick)`` runs the queues to their end
    in an order the waits allow, ``pick`` choosing among the streams that can run their next
    entry, and returns the (kind, stream) of each call in the order run."""
    current, made = [], []

    class Stream:
        def __init__(self, non_blocking: bool = False):
            self.queue, self.done = [], 0
            made.append(self)

        def __enter__(self):
            current.append(self)
            return self

        def __exit__(self, *exc):
            current.pop()
            return False

        def record(self):
            return (self, len(self.queue))

        def wait_event(self, event):
            self.queue.append(("wait", event))

    main = Stream()
    now = lambda: current[-1] if current else main  # noqa: E731

    def queued(kind, fn):
        def call(*args, **kwargs):
            now().queue.append((kind, lambda: fn(*args, **kwargs)))
        return call

    def matmul(x, y, out):
        queued("gemm", np.matmul)(x, y, out=out)
        return out

    def drain(pick) -> list:
        ran = []
        while any(s.done < len(s.queue) for s in made):
            can = [s for s in made if s.done < len(s.queue)
                   and (s.queue[s.done][0] != "wait" or s.queue[s.done][1][0].done >= s.queue[s.done][1][1])]
            assert can, "the streams wait for each other"
            stream = pick(can)
            kind, what = stream.queue[stream.done]
            if kind != "wait":
                what()
                ran.append((kind, stream))
            stream.done += 1
        return ran

    allocated = []

    def empty(shape, dtype=float):
        allocated.append(now())
        return np.full(shape, np.nan, dtype)

    class OutOfMemoryError(MemoryError):
        pass

    cuda = types.SimpleNamespace(Stream=Stream, get_current_stream=now,
                                 memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError))
    names = {k: getattr(np, k) for k in dir(np) if not k.startswith("__")} | {
        "matmul": matmul, "cuda": cuda, "empty": empty, "allocated": allocated}
    return types.SimpleNamespace(**names), main, made, queued, drain


@pytest.mark.parametrize("chunks", [2, 3, 7])
@pytest.mark.parametrize("fresh", [False, True])
def test_pipelined_ttgt_adds_the_product_chunk_by_chunk(chunks, fresh, monkeypatch, tmp_path):
    """A pipelined TTGT (``ttgt`` with ``{"chunks": n}``) on NumPy with stand-in streams that
    queue its work and run it in five orders the waits allow (each stream's first, and at
    random): random contractions (batch indices, factors, either operand on the GEMM's left,
    extents below the chunk count) into a strided view of a larger buffer equal
    ``numpy.einsum`` in every order (a ``fresh`` output holding NaN is written as if it held
    zeros; temporaries start as NaN, so a GEMM before its chunk's copy or an add before its
    GEMM shows; so does the right operand's copy, queued on the current stream, read before the
    side streams wait for it), the buffer around the view untouched. Every temporary is
    allocated on the current stream; every GEMM runs on one side stream, every copy and add on
    the other (the current stream only the right operand's copy); the current stream's last entries wait for all the work given to both; and
    where the GEMMs' stream goes first, GEMM k + 1 runs before chunk k's add (the chunks
    overlap)."""
    monkeypatch.setattr(tuning.TuningCache, "for_device", classmethod(lambda cls, xp: cls("GPU", tmp_path)))
    xp, main, made, queued, drain = _numpy_with_streams()
    backend = HostTiles(xp)
    into = []  # the buffer whose view is the output: an assign into it is an add

    def assign(target, *args, _op=backend.assign, **kwargs):
        queued("add" if np.shares_memory(target, into[-1]) else "assign", _op)(target, *args, **kwargs)

    def reshaped(view, shape):
        copy = xp.empty(shape, view.dtype)
        queued("assign", copy.__setitem__)(Ellipsis, view.reshape(shape))
        return copy
    monkeypatch.setattr(backend, "assign", assign)
    monkeypatch.setattr(backend, "reshaped", reshaped)
    rng = np.random.default_rng(10 * chunks + fresh)
    runs = swapped = 0
    while runs < 6:
        c, size = random_case(rng, batch=runs % 2 == 1, max_extent=8)
        split = methods._pipeline_index(c)
        if split is None:
            continue
        a, b = (rng.standard_normal([size[i] for i in idx]) for idx in (c.a_indices, c.b_indices))
        start, big, sl = embedded(rng, [size[i] for i in c.out_indices], "float64")
        into.append(big)
        want = reference(c, np.zeros(start.shape) if fresh else start, a, b)
        before = big.copy()
        if fresh:
            big[sl] = np.nan
        first = big.copy()
        n = min(chunks, size[split])
        order = np.random.default_rng(runs)
        for prefer in ((1, 2, 0), (2, 1, 0), (0, 2, 1), None, None):  # streams by their place in made
            def pick(can):
                return (can[order.integers(len(can))] if prefer is None
                        else min(can, key=lambda s: prefer.index(made.index(s))))
            big[...] = first
            out = big[sl]
            xp.allocated.clear()
            backend._run(("ttgt", {"chunks": chunks}), c, out, a, b, fresh)
            gemms, copies = backend._pipes
            assert xp.allocated and all(s is main for s in xp.allocated)
            assert made[1:] == [gemms, copies]
            assert main.queue[-2:] == [("wait", (s, len(s.queue))) for s in (gemms, copies)]
            ran = drain(pick)
            assert relerr(out, want) <= 1e-12, (c, size)
            outside = np.ones(big.shape, bool)
            outside[sl] = False
            assert np.array_equal(big[outside], before[outside])
            assert [s for kind, s in ran if kind == "gemm"] == [gemms] * n
            assert [s for kind, s in ran if kind == "add"] == [copies] * n
            assert [(kind, s) for kind, s in ran if s is main] == [("assign", main)]  # the right copy
            if prefer == (1, 2, 0):
                at = {kind: [k for k, (x, _) in enumerate(ran) if x == kind] for kind in ("gemm", "add")}
                assert all(g < add for g, add in zip(at["gemm"][1:], at["add"]))
        runs += 1
        swapped += common.ttgt_layout(tuple(c.out_indices), tuple(c.a_indices), tuple(c.b_indices))[4]
    assert 0 < swapped < runs


@pytest.mark.parametrize("fails, error", [(2, "runtime"), (1, "memory"), (2, "memory"), (3, "memory")])
def test_pipelined_ttgt_joins_its_streams_when_a_chunk_fails(fails, error, monkeypatch, tmp_path):
    """A GEMM call that raises while a pipelined TTGT in three chunks issues its work (the
    ``fails``-th; the third is issued after the first chunk's add): the current stream's last
    entries still wait for all the work given to both side streams (the temporaries' memory
    returns to the pool only after it), which runs to its end. Any error but a lack of memory
    reaches the caller as it is; a lack of memory does where nothing has been added to ``out``
    yet (another method may run), and becomes a ChainexecError naming the output once a chunk's
    add is issued (another method would add that chunk again)."""
    monkeypatch.setattr(tuning.TuningCache, "for_device", classmethod(lambda cls, xp: cls("GPU", tmp_path)))
    xp, main, made, queued, drain = _numpy_with_streams()
    raised = xp.cuda.memory.OutOfMemoryError if error == "memory" else RuntimeError
    issued = []

    def failing(x, y, out):
        issued.append(out)
        if len(issued) == fails:
            raise raised("GEMM failed")
        queued("gemm", np.matmul)(x, y, out=out)
        return out
    xp.matmul = failing
    backend = HostTiles(xp)
    monkeypatch.setattr(backend, "assign", queued("assign", backend.assign))
    rng = np.random.default_rng(4)
    c = Contraction(0, "X", list("abcd"), "A", list("aebf"), "B", list("dfce"), 1.0, True, 0, 0)
    size = dict(zip("abcdef", (6, 5, 4, 3, 5, 4)))
    a, b, out = (rng.standard_normal([size[i] for i in idx]) for idx in (c.a_indices, c.b_indices, c.out_indices))
    if fails == 3 and error == "memory":
        expect = (ChainexecError, r"X\[a,b,c,d\] \+= A·B .*lower machine.device_memory")
    else:
        expect = (raised, "GEMM failed")
    with pytest.raises(expect[0], match=expect[1]):
        backend._run(("ttgt", {"chunks": 3}), c, out, a, b, False)
    gemms, copies = backend._pipes
    assert main.queue[-2:] == [("wait", (s, len(s.queue))) for s in (gemms, copies)]
    drain(lambda can: can[0])


def test_ttgt_is_offered_pipelined_on_large_outputs_apart_from_the_operands(numpy_gpu):
    """TTGT's candidates: plain always; pipelined in each of :data:`~methods.PIPELINE_CHUNKS`
    chunks no more than the cut index's extent and no smaller than
    :data:`~chainexec.runtime.pointwise.SHAPED_BYTES` of output each, where the output shares no
    memory with an operand; not where nothing is summed."""
    from chainexec.runtime import pointwise

    c = Contraction(0, "C", list("abcd"), "A", list("aecf"), "B", list("fbed"), 1.0, True, 0, 0)
    assert methods._pipeline_index(c) == "a"
    every = {"ttgt": None, **{f"ttgt:{n}": {"chunks": n} for n in methods.PIPELINE_CHUNKS}}
    most = max(methods.PIPELINE_CHUNKS)

    def side(chunks: int) -> int:  # a cube's edge whose output just holds chunks × SHAPED_BYTES
        return round((chunks * pointwise.SHAPED_BYTES // 8) ** 0.25) + 1

    ttgt = methods.REGISTRY["ttgt"]
    for n, offered in [(most, every), (3, {"ttgt": None, "ttgt:3": {"chunks": 3}}), (1, {"ttgt": None})]:
        e = side(n)
        assert ttgt.configurations(numpy_gpu, c, np.empty((e,) * 4), np.empty((e, 3, e, 3)),
                                   np.empty((3, e, 3, e))) == offered
    e = round((most * pointwise.SHAPED_BYTES // 32) ** (1 / 3)) + 1  # the cut index 4 long
    assert ttgt.configurations(numpy_gpu, c, np.empty((4, e, e, e)), np.empty((4, 3, e, 3)),
                               np.empty((3, e, 3, e))) == {"ttgt": None, "ttgt:3": {"chunks": 3}}
    e = side(most)
    shape = (e,) * 4
    into_a = np.empty(2 * e ** 4)
    b = np.empty((3, e, 3, e))
    assert ttgt.configurations(numpy_gpu, c, into_a[:e ** 4].reshape(shape),
                               into_a[e ** 4:e ** 4 + 9 * e ** 2].reshape(e, 3, e, 3), b) == every
    assert ttgt.configurations(numpy_gpu, c, into_a[:e ** 4].reshape(shape),
                               into_a[:9 * e ** 2].reshape(e, 3, e, 3), b) == {"ttgt": None}
    outer = Contraction(0, "C", list("ab"), "A", list("a"), "B", list("b"), 1.0, True, 0, 0)
    assert methods._pipeline_index(outer) is None


@pytest.mark.parametrize("n, tile", [(1, (0, 1)), (7, (0, 28)), (13, (5, 60)), (13, (90, 91)), (64, (1000, 2080))])
def test_gather_packs_and_unpacks_pairs(n, tile):
    """Backend.gather against explicit loops over the triangle ``p >= q``: a tile ``[k0, k1)`` of
    pair positions packed from a symmetric block, and a member block unpacked from pairs."""
    rng = np.random.default_rng(n)
    pairs = [(p, q) for p in range(n) for q in range(p + 1)]  # row-major lower triangle
    k0, k1 = tile
    x = rng.standard_normal((3, n, n))
    x = x + x.transpose(0, 2, 1)
    packed = np.empty((3, k1 - k0))
    NumpyBackend().gather(packed, x, None, 1, ("pack", k0, k1, 0, 0, n), None, 1.0, True)
    assert np.array_equal(packed, np.array([[x[b, p, q] for p, q in pairs[k0:k1]] for b in range(3)]))
    values = rng.standard_normal((len(pairs), 2))
    r0, r1, s0, s1 = 0, n, n // 3, n
    out = np.zeros((r1 - r0, s1 - s0, 2))
    NumpyBackend().gather(out, values, None, 0, ("unpack", 0, r0, r1, s0, s1), None, 2.0, False)
    want = np.array([[values[pairs.index((max(r, s), min(r, s)))] for s in range(s0, s1)] for r in range(r0, r1)])
    assert np.array_equal(out, 2.0 * want)


def test_the_tuning_margin_comes_from_its_variable(monkeypatch):
    """``CHAINEXEC_TUNE_MARGIN``: unset, the cost models' margin; a number of at least 1 (``inf``:
    every candidate timed) as given; anything else refused naming the variable."""
    import math

    from chainexec.errors import ChainexecError
    from chainexec.runtime.backends import costmodel

    monkeypatch.delenv(device.TUNE_MARGIN, raising=False)
    assert device.tune_margin() == costmodel.MARGIN
    for given, want in (("1", 1.0), ("2.5", 2.5), ("inf", math.inf)):
        monkeypatch.setenv(device.TUNE_MARGIN, given)
        assert device.tune_margin() == want
    for bad in ("0.5", "-1", "nan", "wide"):
        monkeypatch.setenv(device.TUNE_MARGIN, bad)
        with pytest.raises(ChainexecError, match=device.TUNE_MARGIN):
            device.tune_margin()


@pytest.mark.parametrize("shape, dtype", [(3024, np.uint8), ((4, 5), np.float64), ((), np.float32)])
def test_page_locked_host_arrays_take_an_extent_or_a_shape(numpy_gpu, shape, dtype):
    """:meth:`CupyBackend.host_empty` takes what ``numpy.empty`` takes (the staging buffers ask for
    a byte count), sized from CuPy's pinned pool (here a stand-in that records the bytes asked)."""
    asked = []
    numpy_gpu.xp = types.SimpleNamespace(cuda=types.SimpleNamespace(
        alloc_pinned_memory=lambda nbytes: asked.append(nbytes) or bytearray(nbytes)))
    host = numpy_gpu.host_empty(shape, dtype)
    assert host.shape == np.empty(shape).shape and host.dtype == dtype
    assert asked == [host.nbytes]
    host[...] = 7
    assert (host == 7).all()


def _lying(shape, dtype=np.float64):
    """An array of ``shape`` with C strides over one element's memory: a tile too large to
    allocate, for code that reads shapes and strides only (reading an element is out of bounds)."""
    from numpy.lib.stride_tricks import as_strided

    item = np.dtype(dtype).itemsize
    return as_strided(np.zeros(1, dtype), shape, [item * math.prod(shape[k + 1:]) for k in range(len(shape))])


@pytest.mark.parametrize("out_indices, a_indices, b_indices, sizes, probe", [
    # AO→MO's last quarter-transform, 352 functions: the GEMM keeps 44 of its 352 columns, not 3
    ("abx", "pbx", "pa", dict(a=352, b=352, x=62128, p=352), (44, 44, 34663)),
    # a (T) tile: cut along its slow occupied indices only
    ("ijkabc", "iafb", "kjcf", dict(i=21, j=21, k=21, a=93, b=93, c=93, f=93), (2, 2, 20, 93, 93, 93)),
    # (T) tiles' stacked terms: GEMMs of (bc)x(ka) cut along b, not along a under k; GEMMs of c×b
    # batched over a cut along a
    ("ijkabc", "fika", "fjbc", dict(i=2, j=2, k=2, a=300, b=300, c=300, f=332), (2, 2, 2, 300, 93, 300)),
    ("ijkabc", "fkac", "fijb", dict(i=2, j=2, k=2, a=300, b=300, c=300, f=332), (2, 2, 2, 93, 300, 300)),
    # a short last index: the second pass cuts the first one further
    ("ab", "ak", "kb", dict(a=10**9, b=2, k=3), (33554432, 2))])
def test_a_probe_cuts_several_indices_before_one_to_a_few_elements(out_indices, a_indices, b_indices, sizes, probe):
    """:func:`tuning._probe`: the slowest index is cut to no fewer than ``extent // PROBE_CUT``
    elements before the next is cut, then (where that was not enough) as far as needed, the
    in-place GEMM's batch modes first and the inner modes of its dimensions last; the operands are
    cut along the same indices, and the output is at most the limit."""
    c = Contraction(id=0, out="o", out_indices=list(out_indices), a="x", a_indices=list(a_indices), b="y",
                    b_indices=list(b_indices), factor=1.0, accumulate=False, flops=0, statement=0)
    tiles = [_lying(tuple(sizes[i] for i in idx)) for idx in (out_indices, a_indices, b_indices)]
    views = tuning._probe(c, *tiles, 512 << 20)
    # shapes and strides only: the arrays lie about their memory, and a failing assertion's report would read it
    shapes, strides, nbytes = [v.shape for v in views], [v.strides for v in views], views[0].nbytes
    before = [t.strides for t in tiles]
    del views, tiles
    assert shapes[0] == probe and nbytes <= 512 << 20
    cut = dict(zip(out_indices, probe))
    assert shapes[1:] == [tuple(cut.get(i, sizes[i]) for i in idx) for idx in (a_indices, b_indices)]
    assert strides == before


@pytest.mark.parametrize("positions, a_shape, before, axis, after", [
    (("unpack", 10, 4, 7, 1, 6), (18, 3), (1, 0), 1, (2, 0, 1)),
    (("unpack", 0, 0, 9, 0, 9), (45, 2, 3), None, 0, None),
    (("pack", 12, 36, 4, 0, 8), (4, 8, 2), None, 0, (1, 0)),
    (("pack", 3, 10, 2, 0, 4), (3, 2, 4), (1, 0, 2), 1, None)])
@pytest.mark.parametrize("fresh", [True, False])
def test_a_gather_takes_its_positions_a_block_at_a_time(positions, a_shape, before, axis, after, fresh, monkeypatch):
    """The NumPy backend's gather makes tables for at most :data:`device.GATHER_BLOCK` elements
    taken (here 6; at least one member row) and writes what one table of the whole tile gives."""
    from tests.kernels.emulation import gathered_shape

    rng = np.random.default_rng(sum(a_shape))
    a = rng.standard_normal(a_shape)
    out = rng.standard_normal(gathered_shape(a_shape, before, axis, positions, after))
    whole, blocks = out.copy(), out.copy()
    monkeypatch.setattr(device, "GATHER_BLOCK", 1 << 40)
    NumpyBackend().gather(whole, a, before, axis, positions, after, 0.7, fresh)
    tables = []
    real = device._positions
    monkeypatch.setattr(device, "_positions", lambda p, first, last: tables.append(real(p, first, last)) or tables[-1])
    monkeypatch.setattr(device, "GATHER_BLOCK", 6)
    NumpyBackend().gather(blocks, a, before, axis, positions, after, 0.7, fresh)
    taken = a.shape if before is None else tuple(a.shape[d] for d in before)
    per_position = a.size // math.prod(taken[axis:axis + (2 if positions[0] == "pack" else 1)])
    firsts = [t[0] if isinstance(t, tuple) else t for t in tables]  # a pack's rows (its columns alike)
    assert len(tables) > 1 and all(t.size * per_position <= 6 or len(t) == 1 for t in firsts)
    assert np.array_equal(blocks, whole)
