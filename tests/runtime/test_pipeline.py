"""Double-buffered loops at run time: a chain whose second statement adds into the stored
result (its loop reads X v1 one tile ahead, adds, writes X v2 behind) on 1–3 ranks with uneven
tiles equals numpy.einsum and measures exactly the predicted bytes and memory peaks; so does the
same chain with its device loops fetching input tiles one tile ahead, in that order."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from chainexec import spec
from chainexec.generator import block
from chainexec.planner.build import make_plan
from chainexec.planner.machine import Machine
from chainexec.planner.plan import ops, fetched, prefetched, returned
from tests.conftest import read_report, run_cli, write_config

EXTENTS = {"i": 13, "j": 11, "k": 9, "l": 7}
CHAIN = {
    "name": "acc",
    "indices": EXTENTS,
    "tensors": {
        "A": {"indices": ["i", "k"], "source": {"file": "in.h5", "dataset": "A", "seed": 1}},
        "B": {"indices": ["k", "j"], "source": {"file": "in.h5", "dataset": "B", "seed": 2}},
        "C": {"indices": ["i", "l"], "source": {"file": "in.h5", "dataset": "C", "seed": 3}},
        "D": {"indices": ["l", "j"], "source": {"random": 4}},
    },
    "statements": ["X[i,j] = A[i,k] * B[k,j]", "X[i,j] += -0.5 * C[i,l] * D[l,j]"],
    "outputs": {"X": {"file": "out.h5", "dataset": "X"}},
}


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("global_memory", ["2KiB", "3KiB"])
def test_adding_into_a_stored_result_one_tile_ahead(tmp_path, global_memory, ranks):
    config = write_config(tmp_path, CHAIN | {"machine": {"global_memory": global_memory, "device_memory": "512B"}})
    plan = make_plan(spec.load(config), schedule="unfused")
    ahead = [op for nest in plan.nests for _, loops in ops(nest.body) for loop in loops if loop.depth > 1
             for op in prefetched(loop)]
    assert any(op.op == "load" and op.tensor == "X" and op.version == 1 for op in ahead)
    assert run_cli("generate", config).returncode == 0
    proc = run_cli("run", config, "--schedule", "unfused", "--report-json", tmp_path / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = read_report(tmp_path / "r.json")
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    assert result["measured"]["memory_peak"] == result["predicted"]["memory_peak"]
    with h5py.File(tmp_path / "in.h5", "r") as f:
        a, b, c = f["A"][...], f["B"][...], f["C"][...]
    d = block(4, (EXTENTS["l"], EXTENTS["j"]), ((0, EXTENTS["l"]), (0, EXTENTS["j"])), "float64")
    expected = a @ b - 0.5 * (c @ d)
    with h5py.File(tmp_path / "out.h5", "r") as f:
        got = f["X"][...]
    assert np.max(np.abs(got - expected)) <= 1e-12 * np.max(np.abs(expected))


def _reference(folder):
    with h5py.File(folder / "in.h5", "r") as f:
        a, b, c = f["A"][...], f["B"][...], f["C"][...]
    d = block(4, (EXTENTS["l"], EXTENTS["j"]), ((0, EXTENTS["l"]), (0, EXTENTS["j"])), "float64")
    return a @ b - 0.5 * (c @ d)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_device_tiles_fetched_one_tile_ahead(tmp_path, ranks):
    """1 KiB of device memory: the loops over k and l inside each rank's tiles of i fetch their
    A/B (C/D) tiles one tile ahead, in two slots each; result, bytes and peaks as planned."""
    config = write_config(tmp_path, CHAIN | {"machine": {"global_memory": "64KiB", "device_memory": "1KiB"}})
    plan = make_plan(spec.load(config), ranks=ranks)
    loops = {id(loop): loop for nest in plan.nests for _, around in ops(nest.body) for loop in around}.values()
    ahead = [(loop.parallel, op.tensor) for loop in loops for op in fetched(loop) if op.op == "get"]
    assert sorted(ahead) == [(False, "A"), (False, "B"), (False, "C"), (False, "D")]
    assert run_cli("generate", config).returncode == 0
    proc = run_cli("run", config, "--report-json", tmp_path / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = read_report(tmp_path / "r.json")
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    assert result["measured"]["memory_peak"] == result["predicted"]["memory_peak"]
    expected = _reference(tmp_path)
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert np.max(np.abs(f["X"][...] - expected)) <= 1e-12 * np.max(np.abs(expected))


def test_tile_inputs_are_fetched_while_the_tile_before_computes(tmp_path, monkeypatch):
    """One rank, the same chain: tile n+1's inputs are fetched after tile n's compute is handed
    to the backend and before tile n+1's, into the other slot than tile n's, after the tile before
    last (the slot's last reader): they are on their way while tile n computes. Nothing is
    fetched on the compute stream in those loops."""
    from chainexec import api
    from chainexec.runtime.backends.numpy import NumpyBackend

    config = write_config(tmp_path, CHAIN | {"machine": {"global_memory": "64KiB", "device_memory": "1KiB"}})
    assert run_cli("generate", config).returncode == 0
    events = []

    class Recording(NumpyBackend):
        def stamp(self):
            mark = super().stamp()  # a clock reading, known by its identity below
            events.append(("stamp", mark))
            return mark

        def fetch(self, dst, read, view=None):
            events.append(("fetch", dst.base))
            super().fetch(dst, read, view)

        def fetch_aside(self, dst, read, after=None, view=None):
            events.append(("aside", dst.base, after))
            super().fetch(dst, read, view)

        def contract(self, c, out, a, b, fresh=False):
            events.append(("compute", None))
            super().contract(c, out, a, b, fresh)

    monkeypatch.setattr(api, "select", lambda name, comm: Recording())
    api.run(config, backend="numpy")
    assert not any(e[0] == "fetch" for e in events)
    computes = [k for k, e in enumerate(events) if e[0] == "compute"]
    asides = [k for k, e in enumerate(events) if e[0] == "aside"]
    assert len(asides) == 2 * len(computes)  # one compute per tile, after its two fetches
    stamps = {id(e[1]): k for k, e in enumerate(events) if e[0] == "stamp"}
    uses = {}  # slot pair -> [(tile, position of the mark its copies wait for)]
    for n, k in enumerate(computes):
        mine = asides[2 * n:2 * n + 2]
        assert mine[-1] < k and (n == 0 or computes[n - 1] < mine[0])  # between the computes before
        (mark,) = {stamps[id(events[j][2])] for j in mine}
        uses.setdefault(tuple(id(events[j][1]) for j in mine), []).append((n, mark))
    assert any(len(u) > 1 for u in uses.values())
    for u in uses.values():  # each slot every other tile, refilled once its last reader is done
        for (before, _), (n, mark) in zip(u, u[1:]):
            assert n == before + 2 and computes[before] < mark < computes[n - 1]


def test_fetches_ahead_never_overtake_a_reader(tmp_path, monkeypatch):
    """The (T) job at o=8, v=10 (six input tiles fetched ahead, its energy copied back aside) and
    the chain above, on a backend that runs its work as late as a GPU may, the second stream's
    copies as early as their marks allow and the copies to the host aside as late as anything
    waits for them (tests/runtime/deferred.py): the results equal a plain NumPy run's bit for
    bit. With the marks ignored, or the waits for a slot's last copy to the host, the (T) energy
    changes: this check sees the races they prevent. The (T) loop keeps no tile across groups
    here (:mod:`chainexec.planner.keep`, which would take the room first)."""
    from chainexec import api
    from chainexec.planner import build
    from tests.conftest import triples_config
    from tests.runtime.deferred import Deferred

    triples = triples_config(tmp_path / "t", "260KiB")
    aside = tmp_path / "aside.json"  # the energy's 8-byte tiles copied back aside too
    aside.write_text(Machine(aside_copy_bytes=0).to_json())
    (tmp_path / "c").mkdir()
    chain = write_config(tmp_path / "c", CHAIN | {"machine": {"global_memory": "64KiB", "device_memory": "1KiB"}})
    assert run_cli("generate", chain).returncode == 0
    outputs = {triples: (tmp_path / "t" / "energy.h5", "E"), chain: (tmp_path / "c" / "out.h5", "X")}

    def result(config, backend):
        if backend is not None:
            monkeypatch.setattr(api, "select", lambda name, comm: backend)
        run = api.run(config, backend="numpy", machine=str(aside))
        monkeypatch.undo()
        assert run["measured"]["bytes"] == run["predicted"]["bytes"]
        path, name = outputs[config]
        with h5py.File(path, "r") as f:
            return f[name][...]

    with pytest.MonkeyPatch.context() as kept:
        kept.setattr(build, "keep", lambda nests, *args: nests)
        for config in (triples, chain):
            assert any(ahead for nest in make_plan(spec.load(config)).nests for _, loops in ops(nest.body)
                       for ahead in map(fetched, loops))
            assert np.array_equal(result(config, Deferred()), result(config, None))
        assert any(returned(loop) for nest in make_plan(spec.load(triples), Machine(aside_copy_bytes=0)).nests
                   for _, loops in ops(nest.body) for loop in loops)
        assert not np.array_equal(result(triples, Deferred(honour_after=False)), result(triples, None))
        assert not np.array_equal(result(triples, Deferred(honour_wait=False)), result(triples, None))
