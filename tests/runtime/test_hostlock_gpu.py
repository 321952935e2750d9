"""Host memory page-locked where it lies (:mod:`chainexec.runtime.hostlock`) on a GPU: a read-only
mapping of an HDF5 dataset is registered, the backend copies rows of it to the device by DMA,
and they equal h5py's reads of the dataset; unlocking waits for the copies and forgets the range.
A (T) run whose mapped inputs are locked gives the independent reference's energy with the bytes
the plan predicts and leaves nothing locked. In a run of page-locked buffers, global arrays are
locked writable instead: rows are fetched from them and results copied into them by DMA, and a
four-index transform so run equals numpy.einsum's. Skipped without CuPy or a CUDA device."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from tests.conftest import fourindex_config, require_gpu, run_cli, triples_config, write_config  # noqa: E402

cupy = require_gpu()

from chainexec.runtime import arena, hostlock  # noqa: E402
from chainexec.runtime.backends.cupy import CupyBackend  # noqa: E402
from chainexec.runtime.mapped import MappedArray, contiguous_offset  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def tile(tmp_path):
    """A 24 MB dataset at an odd offset of its file, mapped read-only, and its values."""
    values = np.random.default_rng(5).standard_normal((40, 300, 250))
    path = tmp_path / "in.h5"
    with h5py.File(path, "w") as f:
        f["pad"] = np.arange(333.0)
        f["x"] = values
    with h5py.File(path, "r") as f:
        offset = contiguous_offset(f["x"], np.dtype(np.float64), str(path))
    mapped = MappedArray(str(path), offset, values.shape, np.float64)
    yield mapped, values
    mapped.free()


def test_locked_rows_reach_the_device(tile, monkeypatch):
    """Locked on a run of plain host memory only; rows of the locked tile go to the device as
    DMAs from the mapping (the arena is never asked) and equal the dataset, queued without the
    executor waiting for the device first (``fetch_waits``: before the lock and after the unlock
    it does wait); after the unlock the range is forgotten. A small or non-contiguous array is
    not locked."""
    mapped, values = tile
    backend = CupyBackend(cupy)
    assert not backend.locks_host() and backend.lock_host(mapped.local()) is None  # not yet told: pinned
    backend.expect_transfers(False)
    assert backend.locks_host()
    whole = cupy.empty((40,) + values.shape[1:])
    assert backend.fetch_waits(whole, lambda r: mapped.at_hand((r,)))
    handle = backend.lock_host(mapped.local())
    assert handle is not None
    assert backend.lock_host(np.zeros(1000)) is None
    assert backend.lock_host(np.zeros((3000, 200))[:, ::2]) is None

    def unused(*args):
        raise AssertionError("rows in locked memory went to the arena")

    monkeypatch.setattr(arena, "upload", unused)
    for lo, hi in ((0, 40), (7, 19), (39, 40)):
        rows = mapped.at_hand((slice(lo, hi),))
        assert backend._locks.holds(rows)
        dst = cupy.full((hi - lo,) + values.shape[1:], np.nan)
        cupy.cuda.get_current_stream().synchronize()  # nothing pending on dst (fetch_aside's terms)
        assert not backend.fetch_waits(dst, lambda r, rows=rows: rows)
        backend.fetch_aside(dst, lambda r, out: None, view=lambda r, rows=rows: rows)
        np.testing.assert_array_equal(cupy.asnumpy(dst), values[lo:hi])
    assert not backend._locks.holds(np.zeros(10))
    assert backend.fetch_waits(whole, lambda r: None) and backend.fetch_waits(whole[:, ::2], lambda r: mapped.at_hand((r,)))
    backend.unlock_host(handle)
    backend.settle_locks()
    assert not backend._locks.holds(mapped.at_hand((slice(0, 40),)))
    assert backend.fetch_waits(whole, lambda r: mapped.at_hand((r,)))


def test_a_run_with_its_inputs_locked(tmp_path, monkeypatch):
    """(T) at o=8, v=48 on the CuPy backend: its 4-index inputs (1.2-7.1 MB) are locked where
    they are mapped and the gets after that copy from there (9 of 20 fetches in four runs on an
    H200, 2026-11-28: the lock thread finishes during the first tiles); the energy equals the
    NumPy reference of chainexec.chem.triples within 1e-12, the bytes moved equal the plan's, and
    nothing stays locked once the run has returned (it waits for the unlocks)."""
    from chainexec import api
    from chainexec.chem.triples import ccsd_t_energy

    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path / "cache"))
    made, locked, held = [], [], []
    init, lock, holds = hostlock.Locks.__init__, hostlock.Locks.lock, hostlock.Locks.holds
    monkeypatch.setattr(hostlock.Locks, "__init__", lambda self, xp: made.append(self) or init(self, xp))

    def spy(self, array, writable=False):
        handle = lock(self, array, writable)
        if handle is not None:
            locked.append(array)
        return handle

    monkeypatch.setattr(hostlock.Locks, "lock", spy)
    monkeypatch.setattr(hostlock.Locks, "holds", lambda self, host, writable=False: held.append(holds(self, host, writable)) or held[-1])
    config = triples_config(tmp_path, "4GiB", nocc=8, nvir=48)
    result = api.run(config, backend="cupy")
    assert len(locked) >= 3 and any(held)  # t2, ovov and ovvv at least; some get from locked rows
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    with h5py.File(tmp_path / "energy.h5") as f:
        got = float(f["E"][()])
    expected = ccsd_t_energy(tmp_path / "inputs.h5")
    assert abs(got - expected) <= 1e-12 * abs(expected)
    assert len(made) == 1 and not any(holds(made[0], a) for a in locked)


def test_a_global_arrays_block_locked_writable_in_a_run_of_page_locked_buffers():
    """In a run of page-locked buffers (``Plan.pinned``) only writable locks are
    made: a block of host memory locked so takes a device tile's values by DMA
    (:meth:`CupyBackend.to_host_into`) and gives rows to the device without the executor
    waiting (``fetch_waits``); the unlock that waits forgets the range before it returns."""
    backend = CupyBackend(cupy)
    backend.expect_transfers(True)
    block = np.zeros((64, 300, 25))  # 3.8 MB
    assert not backend.locks_host() and backend.lock_host(block) is None
    assert backend.locks_host(writable=True)
    handle = backend.lock_host(block, writable=True)
    assert handle is not None and backend.holds_host(block[3:9]) and not backend.holds_host(np.zeros(10))
    values = cupy.random.default_rng(3).standard_normal(block.shape)
    token = backend.to_host_into(values[5:40], block[5:40])
    backend.reach_copy(token)
    np.testing.assert_array_equal(block[5:40], cupy.asnumpy(values[5:40]))
    assert not block[:5].any() and not block[40:].any()
    dst = cupy.full((30,) + block.shape[1:], np.nan)
    cupy.cuda.get_current_stream().synchronize()
    rows = block[8:38]
    assert not backend.fetch_waits(dst, lambda r: rows)
    backend.fetch(dst, lambda r, out: None, view=lambda r: rows)
    np.testing.assert_array_equal(cupy.asnumpy(dst), rows)
    backend.unlock_host(handle, wait=True)
    assert not backend.holds_host(block[3:9]) and not backend._locks._spans


def test_a_four_index_transform_through_locked_global_arrays(tmp_path, monkeypatch):
    """The small four-index transform in one tile on the CuPy backend with page-locked buffers
    (a machine that pins from 0 bytes: ``Plan.pinned``) and every global array locked however small (``SMALLEST`` 0): its
    result is copied straight into its global array; the output equals numpy.einsum's within
    1e-12, the bytes the plan's, and nothing stays locked."""
    from chainexec import api
    from chainexec.runtime import buffers
    from chainexec.planner.machine import Machine
    from tests.runtime.test_landing import _Now
    from tests.runtime.test_run import check_fourindex

    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hostlock, "SMALLEST", 0)
    monkeypatch.setattr(buffers, "ThreadPoolExecutor", _Now)
    into, made = [], []
    original = CupyBackend.to_host_into
    monkeypatch.setattr(CupyBackend, "to_host_into", lambda self, array, out: into.append(out.nbytes) or original(self, array, out))
    init = hostlock.Locks.__init__
    monkeypatch.setattr(hostlock.Locks, "__init__", lambda self, xp: made.append(self) or init(self, xp))
    config = write_config(tmp_path, fourindex_config(global_memory="1MiB", device_memory="1MiB"))
    assert run_cli("generate", config).returncode == 0
    (tmp_path / "machine.json").write_text(Machine(pinned_from_bytes=0).to_json())
    result = api.run(config, backend="cupy", machine=str(tmp_path / "machine.json"))
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    assert sum(into) == 8 ** 4 * 8
    assert made and not any(locks._spans for locks in made)
    check_fourindex(tmp_path)
