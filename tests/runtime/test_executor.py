"""The executor's tile tuples: a symmetric loop keeps the ordered tuples of its indices' tile
positions, each weighted by its number of distinct permutations, so that the weights add up to
the full tuple count (every tuple of the full loop is stood for exactly once). And statements a
backend queues (CuPy's) are timed between its stamps and waited for before transfers."""

from __future__ import annotations

import itertools
import math
import os

import pytest

from chainexec.errors import ChainexecError
from chainexec.runtime.backends.numpy import NumpyBackend
from chainexec.runtime.frame import tuples
from tests.conftest import store_chunked, triples_config


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("symmetric", [["i", "j"], ["i", "j", "k"], ["k", "i", "j"]])
def test_ordered_tuples_and_weights(n, symmetric):
    names = ["i", "x", "j", "k"]
    spans = [[(3 * p, 3 * p + 3) for p in range(n)] if i != "x" else [(0, 2), (2, 4)] for i in names]
    combos, weights = tuples(names, spans, symmetric)
    k = len(symmetric)
    assert len(combos) == math.comb(n + k - 1, k) * 2 * n ** (3 - k)
    assert sum(weights) == 2 * n ** 3
    seen = set()
    largest = 0
    for combo, weight in zip(combos, weights):
        positions = [combo[names.index(i)][0] // 3 for i in symmetric]
        assert positions == sorted(positions)
        assert positions[-1] >= largest  # the largest position never goes back
        largest = positions[-1]
        assert weight == len(set(itertools.permutations(positions)))
        seen.add(combo)
    assert len(seen) == len(combos)


def test_plain_loops_keep_every_tuple():
    spans = [[(0, 2), (2, 3)], [(0, 1), (1, 2), (2, 3)]]
    combos, weights = tuples(["i", "j"], spans, [])
    assert combos == list(itertools.product(*spans)) and weights == [1] * 6


def test_steady_buffers_are_those_the_loop_only_reads():
    """:meth:`Buffers.steady`: of the device buffers that exist when a loop starts, those no
    statement of its body names, as a buffer or a contraction's output (here only A: B is fetched
    in the loop, C computed); global buffers never."""
    from types import SimpleNamespace

    from chainexec.planner.plan import Loop, Op
    from chainexec.runtime.buffers import Buffers

    a, b, c, g = (object() for _ in range(4))
    body = [Op("get", "device", "B", ["k", "j"]), Op("compute", "device", "X", contraction=0),
            Loop("device", {"j": 1}, body=[Op("free", "device", "T", ["i"])])]
    fake = SimpleNamespace(plan=SimpleNamespace(contractions=[SimpleNamespace(out="C")]),
                           arrays={("A", ("i", "k"), "device"): a, ("B", ("k", "j"), "device"): b,
                                    ("C", ("i", "j"), "device"): c, ("A", ("i", "k"), "global"): g,
                                    ("T", ("i",), "device"): object()})
    assert Buffers.steady(fake, Loop("device", {"i": 1}, parallel=True, body=body)) == [a]


@pytest.mark.parametrize("memory, whole", [("224KiB", True), ("128KiB", False)])
def test_triples_loop_reads_its_inputs_steady(tmp_path, monkeypatch, memory, whole):
    """The (T) job (o=6, v=10; tiles of 2) with its inputs whole on the device: the tile loop's
    steady arrays are the eight inputs fetched before it (W, computed in it, is not); with
    less device memory the loop fetches them tile by tile and none is steady. The energy equals
    the one of a run with nothing steady."""
    import contextlib

    import h5py

    from chainexec import api

    o, v = 6, 10
    config = triples_config(tmp_path, memory, o, v)
    shapes = []

    class Recording(NumpyBackend):
        @contextlib.contextmanager
        def steady(self, arrays):
            shapes.append(sorted(x.shape for x in arrays))
            yield

    monkeypatch.setattr(api, "select", lambda name, comm: Recording())
    api.run(config, backend="numpy")
    with h5py.File(tmp_path / "energy.h5") as f:
        e = float(f["E"][()])
    inputs = [(o, v, v, v), (o, o, v, v), (o, v, o, o), (o, v, o, v), (o, v), (v, o), (v,), (o,)]
    assert shapes == [sorted(inputs) if whole else []]
    monkeypatch.undo()
    api.run(config, backend="numpy")
    with h5py.File(tmp_path / "energy.h5") as f:
        assert float(f["E"][()]) == e


@pytest.mark.parametrize("ranks, balance, nocc, nvir, memory, groups, tuples, slabs", [
    (1, "dynamic", 6, 10, "96KiB", 21, 56, 2), (2, "static", 6, 10, "96KiB", 21, 56, 2),
    (3, "dynamic", 6, 10, "96KiB", 21, 56, 2), (2, "dynamic", 7, 9, "120KiB", 10, 20, 1)])
def test_triples_keeps_tiles_across_groups(tmp_path, ranks, balance, nocc, nvir, memory, groups, tuples, slabs):
    """(T) whose inputs do not fit the device: at o=6, v=10 with 96 KiB, tiles of one occupied
    index, 56 ordered tuples in 21 groups, the tiles over j and k (both ``ovvv`` slabs among
    them) kept across each group (:mod:`chainexec.planner.keep`); at o=7, v=9 with 120 KiB,
    tiles of 2 with an edge tile of one, 20 tuples in 10 groups, one slab kept. On 1-3 ranks,
    handed out from the shared counter or round-robin, every count the runtime measures equals
    the prediction (the kept tiles' gets once per group, the others once per tuple), every
    tuple runs once, and the energy equals :func:`chainexec.chem.triples.ccsd_t_energy`'s (no
    code shared) within 1e-12."""
    import h5py

    from chainexec import spec
    from chainexec.chem.triples import ccsd_t_energy
    from chainexec.planner.build import make_plan
    from chainexec.planner.plan import Loop
    from tests.conftest import read_report, run_cli

    config = triples_config(tmp_path, memory, nocc, nvir)
    loop = next(n for n in make_plan(spec.load(config), ranks=ranks).nests[0].body if isinstance(n, Loop))
    assert loop.count == groups and [t for t, _ in loop.kept].count("ovvv") == slabs
    proc = run_cli("run", config, "--balance", balance, "--report-json", tmp_path / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = read_report(tmp_path / "r.json")
    for key in ("bytes", "flops", "statements", "memory_peak"):
        assert report["measured"][key] == report["predicted"][key], key
    assert sum(r["tiles"] for r in report["run"]["per_rank"]) == tuples
    with h5py.File(tmp_path / "energy.h5", "r") as f:
        got = float(f["E"][()])
    expected = ccsd_t_energy(tmp_path / "inputs.h5")
    assert abs(got - expected) <= 1e-12 * abs(expected)


def test_streamed_inputs_arrive_as_the_tiles_need_them(tmp_path, monkeypatch):
    """(T) at o=6, v=10 on one rank, tiles of 2 (three positions): the loop starts with only the
    first rows of ``ovvv``, ``ovoo`` and ``t1`` on the device (the rest of the device
    buffer still zero) and the others arrive, beside the work, as tiles first need them: one chunk
    per input and position. Bytes as predicted; the energy equals a run with whole gets."""
    import h5py
    import numpy as np

    from chainexec import api
    from chainexec.planner import record

    o, v = 6, 10
    config = triples_config(tmp_path, "224KiB", o, v)
    aside, first = [], []

    class Recording(NumpyBackend):
        def fetch_aside(self, dst, read, after=None, view=None):
            aside.append(dst.shape)
            super().fetch_aside(dst, read, after, view)

        def contract_sum(self, cs, out, operands, fresh=False):
            if not first:  # the first tile: ovvv's device buffer, its rows 0..1 in, 2..5 not yet
                ovvv = next(a for c, (a, _) in zip(cs, operands) if c.a == "ovvv").base
                first.append((len(aside), ovvv.shape, bool(np.all(ovvv[:2] != 0)), bool(np.all(ovvv[2:] == 0))))
            super().contract_sum(cs, out, operands, fresh)

    monkeypatch.setattr(api, "select", lambda name, comm: Recording())
    result = api.run(config, backend="numpy")
    with h5py.File(tmp_path / "energy.h5") as f:
        e = float(f["E"][()])
    assert first == [(3, (o, v, v, v), True, True)]
    assert sorted(aside) == sorted([(2, v, v, v), (2, v, o, o), (2, v)] * 3)
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    monkeypatch.setattr(record, "streamed", lambda *args: None)  # a plan that streams nothing
    aside.clear()
    api.run(config, backend="numpy", plan_cache=False)
    assert not aside
    with h5py.File(tmp_path / "energy.h5") as f:
        assert float(f["E"][()]) == e


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, memory, layout", [(2, "shared", "contiguous"), (3, "shared", "contiguous"),
                                                   (3, "shared", "chunked"), (3, "shared", "refused"),
                                                   (3, "rma", "contiguous")])
def test_streamed_inputs_on_several_ranks(tmp_path, monkeypatch, ranks, memory, layout):
    """(T) at o=6, v=10, tiles of 2, on several ranks of one host: each rank loads from disk a
    part of every row of each streamed input (its cut of the second axis, the cuts of all ranks
    tiling it; with the global arrays out of shared memory, ``rma``, the rows it owns), and every
    rank copies every chunk to its device, each only once all ranks have loaded their parts
    (:class:`~chainexec.runtime.globalarray.Board`). Inputs stored contiguously are mapped from
    their file on ranks of one host (:mod:`chainexec.runtime.mapped`): the loads make the pages
    of each rank's parts resident, no HDF5 read, nothing given back; an input loaded whole
    (``t2``) is made resident by each rank for its own rows. Chunked ones, and all of them where
    one rank cannot map a file (``refused``: the others do not map either), are read into
    shared memory, and each rank gives back (here: poisons with NaN) each of its rows of every
    streamed input once all ranks have copied it (during the loop or at its end: when is a
    matter of timing, not checked here). A rank's first tile finds in its copy of ``ovvv``
    exactly the rows that tile reads, the others still zero; bytes as predicted; the energy
    equals a run on one rank with whole gets, to 1e-12."""
    import json
    import subprocess
    import sys

    import h5py

    from pathlib import Path

    from chainexec import api
    from chainexec.planner import record
    from tests.conftest import mpiexec

    repo = Path(__file__).resolve().parents[2]
    launcher = mpiexec()
    if launcher is None:
        pytest.skip("no mpiexec")
    o, v = 6, 10
    config = triples_config(tmp_path, "224KiB", o, v)
    if layout == "chunked":
        store_chunked(tmp_path / "inputs.h5")
    mapping = layout == "contiguous" and memory == "shared"
    refuse = ["--refuse", "1"] if layout == "refused" else []
    monkeypatch.setattr(record, "streamed", lambda *args: None)  # a plan that streams nothing
    api.run(config, backend="numpy", plan_cache=False)
    with h5py.File(tmp_path / "energy.h5") as f:
        whole = float(f["E"][()])
    out = tmp_path / "ranks"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(repo))
    check = repo / "tests/runtime/mpi_streamed_check.py"
    proc = subprocess.run([launcher, "-n", str(ranks), sys.executable, str(check), str(config), str(out),
                           *(["--rma"] if memory == "rma" else []), *refuse],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    with h5py.File(tmp_path / "energy.h5") as f:
        assert float(f["E"][()]) == pytest.approx(whole, rel=1e-12)
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    assert records[0]["measured"] == records[0]["predicted"]
    assert records[0]["peaks"][0] == records[0]["peaks"][1]
    chunks = sorted([[2, v, v, v], [2, v, o, o], [2, v]] * 3)
    for rec in records:
        assert sorted(rec["aside"]) == chunks
        if rec["first"]:  # a rank may get no tile
            (first,) = rec["first"]
            need = first["need"]
            assert 0 < need <= o and first["rows"] == o
            assert all(first["filled"][:need]) and all(first["empty"][need:])
    assert sum(bool(rec["first"]) for rec in records) >= 2
    for r, rec in enumerate(records):  # every own row of each of the three inputs given back
        own = set(range(r * o // ranks, (r + 1) * o // ranks))
        given = [(lo, hi, tuple(shape)) for shape, lo, hi in rec["discarded"]]
        if memory == "rma" or mapping:
            assert not given
            continue
        shapes = {s for _, _, s in given}
        assert len(shapes) == (3 if own else 0)
        for shape in shapes:
            assert set().union(*(range(lo, hi) for lo, hi, s in given if s == shape)) == own
    second = {"ovvv": v, "ovoo": v, "t1": v}
    if mapping:
        assert not any(t in second for rec in records for t, _ in rec["reads"])
        rows = {"ovvv": [v, v, v], "ovoo": [v, o, o], "t1": [v]}
        for tensor, shape in rows.items():  # streamed: each row's cut over the ranks
            for row in range(o):
                cuts = sorted((a, b) for rec in records for s, r, n, a, b in rec["populated"]
                              if s == shape and r == row)
                assert len(cuts) == ranks and cuts[0][0] == 0 and cuts[-1][1] == v
                assert all(x[1] == y[0] for x, y in zip(cuts, cuts[1:]))
        for r, rec in enumerate(records):  # t2 (o, o, v, v), loaded whole: each rank its own rows
            t2 = [(first, n, a, b) for s, first, n, a, b in rec["populated"] if s == [o, v, v]]
            lo, hi = r * o // ranks, (r + 1) * o // ranks
            assert t2 == ([(lo, hi - lo, 0, o)] if hi > lo else [])
        return
    assert not any(rec["populated"] for rec in records)
    for tensor, n in second.items():
        for row in range(o):
            if memory == "rma":  # the owner's rows, whole, in one read per chunk
                owner = row * ranks // o
                assert [r for r, rec in enumerate(records) for t, region in rec["reads"]
                        if t == tensor and region[0][0] <= row < region[0][1]] == [owner]
                continue
            cuts = sorted(tuple(region[1]) for rec in records for t, region in rec["reads"]
                          if t == tensor and region[0] == [row, row + 1])
            assert len(cuts) == ranks and cuts[0][0] == 0 and cuts[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))


QUEUED_RUN = r'''
import json, sys
import h5py
from chainexec import api
from chainexec.runtime import executor, landing
from tests.runtime.queued import Queued


def energy(path):
    with h5py.File(path) as f:
        return float(f["E"][()])


plain = api.run(sys.argv[1], backend="numpy")
e_plain = energy(sys.argv[2])
backend = Queued()
backend.fetch_waits = lambda dst, view=None: sys.argv[4] == "waits"
api.select = lambda name, comm: backend
executor.PENDING = 2  # the oldest half read while the run goes on
landing.LANDING_BYTES = int(sys.argv[3])
result = api.run(sys.argv[1], backend="numpy")
print(json.dumps({"seen": backend.seen, "stamps": backend.clock, "open": len(backend.open), "early": backend.early,
                  "queued_copies": backend.queued_copies, "unlanded": backend.unlanded,
                  "E": energy(sys.argv[2]), "E_plain": e_plain,
                  "measured": result["measured"], "predicted": result["predicted"],
                  "statements": result["measured"]["by_statement"]}))
'''


@pytest.mark.parametrize("landing, fetch", [(1 << 30, "queued"), (0, "queued"), (1 << 30, "waits")])
def test_queued_statements_are_timed_by_stamps_and_waited_for(tmp_path, landing, fetch):
    """A backend whose compute statements return before they are done (CuPy's): the executor
    times them between its stamps, queues the tiles' gets behind them (a get's copy is ordered
    after them on the device; its host time is its own) and waits for them by the end, and counts
    their seconds per statement and as compute. The
    (T) job on small occupied tiles, its inputs fetched tile by tile between the statements
    (72 KiB of device memory: no room to fetch any input tile ahead); the oldest statements are also read while later ones are queued
    (``PENDING`` lowered to 2). The
    energy's accumulates are queued too; with no host bytes allowed for them
    (``LANDING_BYTES`` 0) none is queued while an earlier one is still on its way. A backend
    whose fetches would wait for the device anyway (``fetch_waits``) is waited for before each
    get instead, so that a get's seconds are its own."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from chainexec import spec
    from chainexec.planner.build import make_plan
    from chainexec.planner.plan import Loop

    repo = Path(__file__).resolve().parents[2]
    config = triples_config(tmp_path, "72KiB", 6, 8, seed=1)
    assert [n.depth for n in make_plan(spec.load(config)).nests[0].body if isinstance(n, Loop)] == [1]
    script = tmp_path / "queued.py"
    script.write_text(QUEUED_RUN)
    proc = subprocess.run([sys.executable, str(script), str(config), str(tmp_path / "energy.h5"), str(landing), fetch],
                          capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["open"] == 0
    if fetch == "queued":  # gets do not wait for the queued statements, read while later ones run
        assert got["seen"] and max(got["seen"]) > 0 and got["early"] > 0
    else:
        assert got["seen"] and set(got["seen"]) == {0}
    # the energy's tiles go to the host behind queued statements, and land only once there
    copies = got["queued_copies"]
    assert len(copies) >= 10
    if landing:  # copies queued behind statements, several on the way at once unless gets land them
        assert min(copies) > 0 and (max(got["unlanded"]) > 0) == (fetch == "queued")
    else:  # none queued while another is on the way
        assert max(got["unlanded"]) == 0
    assert got["E"] == got["E_plain"] and math.isfinite(got["E"])
    queued = got["stamps"] // 2
    assert queued > 10
    assert got["measured"]["seconds"]["compute"] == 0.25 * queued
    assert sum(s for name, s in got["statements"].items()
               if not name.startswith(("get ", "accumulate ", "load ", "store "))) == 0.25 * queued
    assert got["measured"]["bytes"] == got["predicted"]["bytes"]


@pytest.mark.parametrize("poison", ["unfilled", "every"])
def test_global_buffers_a_load_fills_are_not_zeroed(tmp_path, monkeypatch, poison):
    """(T) at o=6, v=10 with its inputs streamed: the inputs' global buffers, which loads fill,
    are allocated without a zero fill (``Op.fill`` False, :mod:`chainexec.planner.record`), the energy's
    accumulator with one. Poisoning every buffer allocated without a fill with NaN leaves the
    energy as it was; poisoning every global buffer (the accumulator too) makes it NaN, so the
    poison reaches the result where a fill is missing."""
    import h5py
    import numpy as np

    from chainexec import api, spec
    from chainexec.planner import build
    from chainexec.runtime import buffers

    config = triples_config(tmp_path, "224KiB", 6, 10)
    plan = build.make_plan(spec.load(config))
    allocs = [op for op in plan.nests[0].body if getattr(op, "op", None) == "alloc" and op.level == "global"]
    assert sorted(op.tensor for op in allocs if op.fill is False) == sorted(
        ["ovvv", "t2", "ovoo", "ovov", "t1", "f_vo", "e_vir", "e_occ"])
    assert [op.tensor for op in allocs if op.fill is not False] == ["E"]
    api.run(config, backend="numpy")
    with h5py.File(tmp_path / "energy.h5") as f:
        clean = float(f["E"][()])

    class Poisoned(buffers.GlobalArray):
        def __init__(self, comm, shape, dtype, zero=True):
            super().__init__(comm, shape, dtype, zero=zero)
            if not zero or poison == "every":
                self.local()[...] = np.nan

    monkeypatch.setattr(buffers, "GlobalArray", Poisoned)
    if poison == "every":  # the energy is NaN: the run refuses to mark it complete
        with pytest.raises(ChainexecError, match="output E holds 1 values that are not finite"):
            api.run(config, backend="numpy")
        return
    api.run(config, backend="numpy")
    with h5py.File(tmp_path / "energy.h5") as f:
        assert float(f["E"][()]) == clean


@pytest.mark.parametrize("poison", ["unset", "every"])
def test_device_buffers_a_run_writes_first_are_not_zeroed(tmp_path, monkeypatch, poison):
    """(T) at o=6, v=10: W's device tile, which the run of its terms writes first, is allocated
    without a zero fill (``Op.fill`` False) and that run is told so (``Op.fresh``,
:mod:`chainexec.planner.record`); the energy's device accumulator keeps its fill. Poisoning every buffer
    allocated without a fill with NaN leaves the energy as it was; poisoning the filled ones
    too makes it NaN (and the run refuses to mark it complete), so the poison reaches the result
    where a fill is missing."""
    import h5py
    import numpy as np

    from chainexec import api, spec
    from chainexec.planner import build
    from chainexec.planner.plan import ops

    config = triples_config(tmp_path, "224KiB", 6, 10)
    plan = build.make_plan(spec.load(config))
    marked = [(op.op, op.tensor if op.op == "alloc" else plan.contractions[op.contraction].id)
              for op, _ in ops(plan.nests[0].body) if op.fill is False and op.level == "device" or op.fresh]
    assert marked == [("alloc", "W"), ("compute", 0)]
    api.run(config, backend="numpy")
    with h5py.File(tmp_path / "energy.h5") as f:
        clean = float(f["E"][()])
    made = []

    class Poisoned(NumpyBackend):
        def empty(self, shape, dtype):
            made.append(shape)
            return np.full(shape, np.nan, dtype)

        def zeros(self, shape, dtype):
            return np.full(shape, np.nan, dtype) if poison == "every" else super().zeros(shape, dtype)

    monkeypatch.setattr(api, "select", lambda name, comm: Poisoned())
    if poison == "every":  # the energy is NaN: the run refuses to mark it complete
        with pytest.raises(ChainexecError, match="output E holds 1 values that are not finite"):
            api.run(config, backend="numpy")
    else:
        api.run(config, backend="numpy")
        with h5py.File(tmp_path / "energy.h5") as f:
            assert float(f["E"][()]) == clean
    assert made and all(len(shape) == 6 for shape in made)


def test_a_get_outside_the_parallel_loop_waits_for_every_ranks_loads_of_the_last_tile(tmp_path):
    """The four-index transform on 2 ranks whose second rank's loads of ``C`` land 0.2 s late
    (each slot zeroed first, as a fresh window is): its double-buffered store loop's last
    iteration queues no loads for a next one, yet its get of the whole ``C`` tile (outside the
    parallel loop: every rank reads every rank's rows) still waits at a barrier for them, so the
    result equals ``numpy.einsum``'s (rows of ``C`` read as zeros changed a quarter of the last
    iteration's tiles)."""
    import subprocess
    import sys
    from pathlib import Path

    import h5py
    import numpy as np

    from tests.conftest import fourindex_config, mpiexec, run_cli, write_config

    launcher = mpiexec()
    if launcher is None:
        pytest.skip("no mpiexec")
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run([launcher, "-n", "2", sys.executable, str(repo / "tests/runtime/mpi_slow_loads.py"),
                           str(config), "C", "0.2"], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    with h5py.File(tmp_path / "in.h5", "r") as f:
        a, c = f["A"][()], f["C"][()]
    with h5py.File(tmp_path / "out" / "result.h5", "r") as f:
        got = f["B"][()]
    reference = np.einsum("pa,qb,rc,sd,pqrs->abcd", c, c, c, c, a, optimize=True)
    assert np.max(np.abs(got - reference)) <= 1e-12 * np.max(np.abs(reference))


def test_many_parallel_loops_hand_out_every_tile_once_from_one_counter(tmp_path):
    """A plan of small tiles runs hundreds of parallel loops: the shared counter is not reset
    between them, and each rank knows where the next loop's tiles begin from the last's count
    and the ranks' one claim past its end. On 3 ranks every tile runs once (as many as
    round-robin deals), every count equals the prediction, and the result equals numpy.einsum's
    (no code shared) within 1e-12."""
    import h5py
    import numpy as np

    from chainexec import spec
    from chainexec.planner.build import make_plan
    from chainexec.planner.plan import Loop
    from tests.conftest import fourindex_config, read_report, run_cli, write_config

    config = write_config(tmp_path, fourindex_config(n=9, nmo=7, global_memory="4KiB", device_memory="1KiB"))
    plan = make_plan(spec.load(config), ranks=3)

    def parallel_runs(body, runs=1):  # enclosing loops each over whole extents, as here
        return sum(runs if n.parallel else parallel_runs(
            n.body, runs * math.prod(-(-plan.extents[i] // t) for i, t in n.tiles.items()))
            for n in body if isinstance(n, Loop))

    assert sum(parallel_runs(nest.body) for nest in plan.nests) > 100
    assert run_cli("generate", config).returncode == 0
    tiles = {}
    for balance in ("static", "dynamic"):
        proc = run_cli("run", config, "--balance", balance, "--report-json", tmp_path / f"{balance}.json", ranks=3)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = read_report(tmp_path / f"{balance}.json")
        for key in ("bytes", "flops", "statements", "memory_peak"):
            assert report["measured"][key] == report["predicted"][key], key
        tiles[balance] = sum(r["tiles"] for r in report["run"]["per_rank"])
        with h5py.File(tmp_path / "in.h5") as f, h5py.File(tmp_path / "out" / "result.h5") as g:
            c = f["C"][()]
            expected = np.einsum("pa,qb,rc,sd,pqrs->abcd", c, c, c, c, f["A"][()])
            assert np.max(np.abs(g["B"][()] - expected)) <= 1e-12 * np.max(np.abs(expected))
    assert tiles["dynamic"] == tiles["static"]

