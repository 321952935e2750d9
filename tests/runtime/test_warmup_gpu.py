"""The warm-up on a GPU: a run's cuBLAS calls, generated contraction kernels and point-wise kernels
are logged; the replay of the log (as a new process's warm-up makes it) loads the same kernels
into the in-process tables and makes every logged cuBLAS call without error; results computed
afterwards still equal ``numpy.einsum``; a tuning run logs what later runs use and not its
candidates; the stand-ins are released; the backend's own warm-up replays nothing. Skipped
without CuPy or a CUDA device."""

from __future__ import annotations


import numpy as np
import pytest

from tests.conftest import require_gpu  # noqa: E402

cupy = require_gpu()

from chainexec.planner.plan import Contraction  # noqa: E402
from chainexec.runtime import kernelcache, launch, pointwise, uselog, warmup  # noqa: E402
from chainexec.runtime.backends.cupy import CupyBackend  # noqa: E402
from chainexec.runtime.device import select  # noqa: E402
from tests.runtime.test_device import reference, relerr  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [  # the batched method's two forms of cuBLAS call, and a generated kernel
    ("batched", "abc", "ad", "bdc", dict(a=40, b=30, c=20, d=25)),
    ("batched", "ijkabc", "iafc", "jkbf", dict(i=3, j=3, k=3, a=12, b=11, c=13, f=10)),
    ("kernel", "abcd", "aebf", "dfce", dict(a=6, b=7, c=8, d=5, e=9, f=4)),
]


def contract(method, out_idx, a_idx, b_idx, size, seed):
    rng = np.random.default_rng(seed)
    c = Contraction(0, "X", list(out_idx), "A", list(a_idx), "B", list(b_idx), 0.5, True, 0, 0)
    host = [rng.standard_normal([size[i] for i in idx]) for idx in (out_idx, a_idx, b_idx)]
    out, a, b = (cupy.asarray(x) for x in host)
    CupyBackend(cupy, method).contract(c, out, a, b)
    return relerr(cupy.asnumpy(out), reference(c, *host))


JOB = "/runs/test.yaml"


@pytest.fixture
def new_process(tmp_path, monkeypatch):
    """A kernel cache of the test's own, the job :data:`JOB`, nothing gathered, loaded or made;
    returns a function that makes the process new again (the disk caches kept)."""
    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(uselog, "_JOB", JOB)

    def fresh():
        monkeypatch.setattr(uselog, "_PENDING", {})
        monkeypatch.setattr(kernelcache, "_LOADED", {})
        monkeypatch.setattr(kernelcache, "_MODULES", {})
        for table in ("_SUM", "_GETT"):
            monkeypatch.setattr(launch, table, {})
        for make in pointwise.PREPARED.values():
            make.cache_clear()

    fresh()
    return fresh


def spied(monkeypatch) -> list:
    """Every use noted from now on, with whether it was paused."""
    met, note = [], uselog.note

    def spy(device, kind, use):
        met.append((kind, use, bool(getattr(uselog._PAUSED, "depth", 0))))
        note(device, kind, use)

    monkeypatch.setattr(uselog, "note", spy)
    return met


def test_logged_uses_are_loaded_again(new_process, monkeypatch):
    for seed, case in enumerate(CASES):
        assert contract(*case, seed) <= 1e-12
    y = cupy.zeros((5, 7))
    pointwise.launch(cupy, "y + 2.0 * p0", [cupy.ones((5, 7))], y)
    uselog.flush()
    name = uselog.device_name(cupy)
    gemms, modules, sources, prepared = (uselog.uses(name, JOB)[kind] for kind in uselog.KINDS)
    assert {call[1] for call in gemms} == {True, False}  # strided and pointer-array calls
    assert modules and sources and prepared
    assert all(name.startswith("chainexec_") for _, name in modules)

    # a new process: nothing loaded; the replay (outside warm_up's catch-all) loads what was logged
    new_process()
    with cupy.cuda.Stream(non_blocking=True) as stream:
        warmup.replay(cupy, name, JOB)
        stream.synchronize()
    warmup.prepare(name, JOB)  # as the backend's selection makes them while the warm-up loads
    cc = str(cupy.cuda.Device().compute_capability)

    def keys(texts) -> set:
        return {kernelcache.cache_key(text, cc, kernelcache.POINTWISE_OPTIONS) for text in texts}

    replayed = {key for key, *_ in kernelcache._LOADED}
    assert replayed == {key for key, _ in modules} | keys(text for _, text in sources)
    made = sum(make.cache_info().currsize for make in pointwise.PREPARED.values())
    assert made == len(prepared)
    met = spied(monkeypatch)
    for seed, case in enumerate(CASES):
        assert contract(*case, seed + 10) <= 1e-12
    launched = {use[0] for kind, use, _ in met if kind == "modules"}
    assert launched and launched <= replayed  # every kernel launched was loaded
    assert keys(use[1] for kind, use, _ in met if kind == "sources") <= replayed  # point-wise ones too
    y = cupy.zeros((5, 7))
    pointwise.launch(cupy, "y + 2.0 * p0", [cupy.ones((5, 7))], y)
    assert sum(make.cache_info().currsize for make in pointwise.PREPARED.values()) == made  # found made


@pytest.mark.parametrize("case", [("abcd", "aebf", "dfce", dict(a=6, b=7, c=8, d=5, e=9, f=4)),
                                  ("ijkabc", "iafc", "jkbf", dict(i=3, j=3, k=3, a=12, b=11, c=13, f=10))])
def test_a_tuning_run_logs_what_later_runs_use_and_not_its_candidates(case, new_process, monkeypatch):
    """The run that tunes a contraction times its candidates (GEMM layouts, generated kernels):
    the uses met only while timing are not logged, and the log holds every use a later process
    makes running the decision it kept."""
    met = spied(monkeypatch)
    assert contract("auto", *case, 3) <= 1e-12
    uselog.flush()
    timing = {(kind, use) for kind, use, paused in met if paused}
    used = {(kind, use) for kind, use, paused in met if not paused}
    assert timing - used  # candidates were met that the run did not use
    logged = uselog.uses(uselog.device_name(cupy), JOB)
    logged = {(kind, use) for kind in uselog.KINDS for use in logged[kind]}
    assert logged == used
    new_process()
    met.clear()
    assert contract("auto", *case, 4) <= 1e-12  # the decision read from the tuning cache: nothing timed
    assert not any(paused for *_, paused in met)
    assert {(kind, use) for kind, use, _ in met} <= logged


def test_the_warm_up_keeps_no_stand_ins(new_process, monkeypatch):
    """The stand-in matrices of the replayed calls go back to the device: CuPy's pool keeps freed
    blocks per stream, where the run's streams could not use them."""
    big = ("d", True, False, False, 2000, 2000, 2000, 2000, 2000, 2000, 3, 0)  # three 32 MB stand-ins
    uselog.note(uselog.device_name(cupy), "gemms", big)
    uselog.flush()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()  # no free block the stand-ins could reuse: they grow the pool
    before, during, gemm = pool.total_bytes(), [], warmup._gemm

    def spy(cupy, call):
        gemm(cupy, call)
        during.append(pool.total_bytes())

    monkeypatch.setattr(warmup, "_gemm", spy)
    warmup.warm_up(cupy, cupy.cuda.Device().id, JOB)
    assert during and during[0] - before >= 3 * 2000 * 2000 * 8  # the replay made the call
    assert pool.total_bytes() - before < 2**20


def test_the_backends_own_warm_up_replays_nothing(new_process, monkeypatch):
    """Where nothing began the warm-up (a run from Python), the backend's selection begins one
    that does not replay: it would run beside the run's statements and the autotuner's timings."""
    uselog.note(uselog.device_name(cupy), "gemms", ("d", True, False, False, 64, 64, 64, 64, 64, 64, 2, 0))
    uselog.flush()
    made = []
    monkeypatch.setattr(warmup, "_gemm", lambda cupy, call: made.append(call))
    monkeypatch.setattr(warmup, "_CLAIMED", set())
    monkeypatch.setattr(warmup, "_EARLY", [])
    monkeypatch.setattr(warmup, "_LATE", [])
    assert select("cupy").name == "cupy"
    assert len(warmup._LATE) == 1
    warmup.settle()
    assert made == []
