"""Results copied back from the device: a tile larger than the landing queue's bound goes back
in parts (:func:`chainexec.runtime.landing.parts`), each landed once it has arrived."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from chainexec import spec
from chainexec.planner.build import make_plan
from chainexec.planner.machine import Machine
from chainexec.planner.plan import ops
from chainexec.runtime.backends.numpy import NumpyBackend
from chainexec.runtime.landing import parts, within
from tests.conftest import fourindex_config, mpiexec, run_cli, write_config
from tests.runtime.test_run import check_fourindex


@pytest.mark.parametrize("shape, limit", [
    ((7, 5, 3), 40),          # rows of 120 B: one row of the last axis (24 B) a part at least
    ((7, 5, 3), 8 * 105),     # 7 rows in 1 part of 105 elements... and the rest
    ((3, 11), 8),             # a part smaller than one row of the last axis: one row each
    ((13,), 24),              # 1-D: 3 elements a part
    ((2, 3, 5, 7), 8 * 14),   # two rows of the last axis a part, cut inside the leading axes
    ((1, 97), 64),
    ((), 8),                  # 0-d: whole
    ((4, 4), 8 * 16),         # fits: whole
])
def test_parts_cover_the_array_once_in_contiguous_pieces(shape, limit):
    a = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    seen = np.zeros(shape, int)
    cut = parts(shape, 8, limit)
    last = -1.0
    for part in cut:
        piece = a[part]
        assert piece.flags.c_contiguous
        assert piece.nbytes <= max(limit, 8 * (shape[-1] if shape else 1))
        assert piece.reshape(-1)[0] > last  # in order
        last = piece.reshape(-1)[-1]
        seen[part] += 1
    assert (seen == 1).all()
    assert (len(cut) == 1) == (a.nbytes <= limit)


def test_within_offsets_a_part_into_its_patch():
    patch = (slice(4, 10), slice(2, 9), slice(0, 3))
    g = np.arange(12 * 10 * 3).reshape(12, 10, 3)
    tile = g[patch]
    for part in parts(tile.shape, tile.itemsize, 3 * tile.itemsize * 2):
        assert np.array_equal(g[within(patch, part)], tile[part])
    assert within((), ()) == ()


PARTS_RUN = r'''
import json, sys
from chainexec import api
from chainexec.runtime import landing
from tests.runtime.queued import Queued

backend = Queued()
sizes, tiles = [], []
accumulate = landing.Landing.accumulate


def tile_then_parts(self, op, frame):
    tiles.append(self.buffers.arrays[landing.key(op)].nbytes)
    accumulate(self, op, frame)


landing.Landing.accumulate = tile_then_parts
copy = backend.to_host_async
backend.to_host_async = lambda array, aside=False: (sizes.append([array.nbytes, aside]), copy(array, aside))[1]
api.select = lambda name, comm: backend
landing.LANDING_BYTES = int(sys.argv[3])
landing.PART_BYTES = int(sys.argv[4])
result = api.run(sys.argv[1], backend="numpy", machine=sys.argv[2])
from mpi4py import MPI
with open(f"rank{MPI.COMM_WORLD.rank}.json", "w") as f:
    json.dump({"sizes": sizes, "tiles": tiles, "measured": result["measured"], "predicted": result["predicted"]}, f)
'''


@pytest.mark.parametrize("aside", [True, False])
def test_tiles_beyond_the_bound_land_in_parts(tmp_path, aside):
    """The small four-index transform on 3 ranks, whose result tiles (up to 1 KiB) exceed a
    landing bound of 512 B, on a backend whose copies to the host hold NaN until the statements
    before them are waited for: each tile beyond the bound goes back in parts of at most 128 B, but
    where its loop copies it back aside (``Loop.back``: whole, the next tile computed meanwhile); the result
    equals numpy.einsum's with the predicted movement."""
    config = write_config(tmp_path, fourindex_config(device_memory="24KiB"))
    machine = Machine(aside_copy_bytes=0 if aside else 1 << 40)
    (tmp_path / "machine.json").write_text(machine.to_json())
    plan = make_plan(spec.load(config), machine, ranks=3)
    assert any(loop.back for nest in plan.nests for _, loops in ops(nest.body) for loop in loops) == aside
    assert run_cli("generate", config).returncode == 0
    (tmp_path / "parts.py").write_text(PARTS_RUN)
    launcher = mpiexec()
    if launcher is None:
        pytest.skip("no mpiexec")
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([launcher, "-n", "3", sys.executable, "parts.py", str(config), "machine.json", "512", "128"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(repo), "OMPI_ALLOW_RUN_AS_ROOT": "1",
                               "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    assert proc.returncode == 0, proc.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    sizes = [n for r in ranks for n, _ in r["sizes"]]
    tiles = [n for r in ranks for n in r["tiles"]]
    assert {made_aside for r in ranks for _, made_aside in r["sizes"]} == {aside}
    assert ranks[0]["measured"]["bytes"] == ranks[0]["predicted"]["bytes"]
    assert sum(sizes) == sum(tiles) == ranks[0]["measured"]["bytes"]["device->global"]
    assert max(tiles) > 512
    if aside:  # whole tiles
        assert sorted(sizes) == sorted(tiles)
    else:  # tiles beyond the bound in parts of 128 B at most, the others whole
        assert max(sizes) <= 512 and len(sizes) > len(tiles)
        assert sorted(n for n in sizes if n > 128) == sorted(n for n in tiles if 128 < n <= 512)
    check_fourindex(tmp_path)


class _Now:
    """A stand-in for the executor's lock thread that runs each job at once, so that every global
    array is locked before its first copy."""

    def __init__(self, *args, **kwargs):
        pass

    def submit(self, job, *args):
        from concurrent.futures import Future

        done = Future()
        done.set_result(job(*args))
        return done

    def shutdown(self):
        pass


class _LockingGlobals(NumpyBackend):
    """The NumPy backend locking global arrays writable, as a GPU run of page-locked buffers does
    (:meth:`Backend.locks_host`): it records the locks, unlocks and the bytes copied straight into
    locked memory (:meth:`Backend.to_host_into`) or through its own host arrays. Its stamps tick
    a clock, a quarter second a tick, so that what is timed between stamps stands out from what
    the host's clock times (microseconds here)."""

    def __init__(self):
        super().__init__()
        self.clock = 0
        self.live: dict[int, np.ndarray] = {}
        self.locked, self.waited = [], []
        self.copied = {"into": 0, "own": 0}

    def locks_host(self, writable=False, named=False):
        return writable

    def stamp(self):
        self.clock += 1
        return self.clock

    def elapsed(self, start, end):
        return 0.25 * (end - start)

    def lock_host(self, array, writable=False, named=False):
        assert writable
        handle = len(self.locked)
        self.locked.append(array.nbytes)
        self.live[handle] = array
        return handle

    def unlock_host(self, handle, wait=False):
        self.waited.append(wait)
        del self.live[handle]

    def holds_host(self, host, writable=True):
        lo, hi = host.ctypes.data, host.ctypes.data + host.nbytes
        return host.nbytes > 0 and any(a.ctypes.data <= lo and hi <= a.ctypes.data + a.nbytes for a in self.live.values())

    def to_host_into(self, array, out):
        assert self.holds_host(out)
        self.copied["into"] += out.nbytes
        return super().to_host_into(array, out)

    def to_host_async(self, array, aside=False):
        self.copied["own"] += array.nbytes
        return super().to_host_async(array, aside)


@pytest.mark.parametrize("bound, part, direct", [(1 << 20, 1 << 18, True), (8192, 4096, True), (512, 128, False)])
def test_fresh_results_land_straight_into_locked_global_arrays(tmp_path, monkeypatch, bound, part, direct):
    """The small four-index transform in one tile on a backend that locks global arrays: each
    global array is locked once and unlocked before it is freed (waiting); results that are the
    only value of their patch are copied straight into the locked array, whole or in parts of
    whole rows (32 KiB of B: one 4 KiB row a part), and the rest through host arrays, parts cut
    inside a row too (128 B); an accumulate copied straight is timed between stamps, the others
    by the host's clock; the result equals numpy.einsum's and the bytes the plan's."""
    from chainexec import api
    from chainexec.runtime import buffers, landing

    config = write_config(tmp_path, fourindex_config(global_memory="1MiB", device_memory="1MiB"))
    assert run_cli("generate", config).returncode == 0
    backend = _LockingGlobals()
    monkeypatch.setattr(api, "select", lambda name, comm: backend)
    monkeypatch.setattr(buffers, "ThreadPoolExecutor", _Now)
    monkeypatch.setattr(landing, "LANDING_BYTES", bound)
    monkeypatch.setattr(landing, "PART_BYTES", part)
    result = api.run(config, backend="numpy")
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    assert (backend.copied["into"] > 0) == direct
    assert (result["measured"]["by_statement"]["accumulate B"] >= 0.25) == direct
    assert backend.copied["into"] + backend.copied["own"] == result["measured"]["bytes"]["device->global"]
    assert backend.locked and not backend.live and all(backend.waited) and len(backend.waited) == len(backend.locked)
    check_fourindex(tmp_path)
