"""Host memory page-locked where it lies (:mod:`chainexec.runtime.hostlock`) on a GPU: a read-only
mapping of an HDF5 dataset is registered, the backend copies rows of it to the device by DMA,
and they equal h5py's reads of the dataset; unlocking waits for the copies and forgets the range.
A (T) run whose mapped inputs are locked gives the independent reference's energy with the bytes
the plan predicts and leaves nothing locked. Skipped without CuPy or a CUDA device."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from tests.conftest import require_gpu, triples_config  # noqa: E402

cupy = require_gpu()

from chainexec.runtime import hostlock  # noqa: E402
from chainexec.runtime.device import CupyBackend  # noqa: E402
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
        offset = contiguous_offset(f["x"], np.dtype(np.float64))
    mapped = MappedArray(str(path), offset, values.shape, np.float64)
    yield mapped, values
    mapped.free()


def test_locked_rows_reach_the_device(tile):
    """Locked on a run of plain host memory only; rows of the locked tile go to the device as
    DMAs from the mapping (the arena is not used) and equal the dataset; after the unlock the
    range is forgotten. A small or non-contiguous array is not locked."""
    mapped, values = tile
    backend = CupyBackend(cupy)
    assert backend.lock_host(mapped.local()) is None  # pinned: a large run's own staging serves
    backend.expect_transfers(1 << 20)
    handle = backend.lock_host(mapped.local())
    assert handle is not None and backend._locks.count() == 1
    assert backend.lock_host(np.zeros(1000)) is None
    assert backend.lock_host(np.zeros((3000, 200))[:, ::2]) is None
    for lo, hi in ((0, 40), (7, 19), (39, 40)):
        rows = mapped.at_hand((slice(lo, hi),))
        assert backend._locks.holds(rows)
        dst = cupy.full((hi - lo,) + values.shape[1:], np.nan)
        cupy.cuda.get_current_stream().synchronize()  # nothing pending on dst (fetch_aside's terms)
        backend.fetch_aside(dst, lambda r, out: None, view=lambda r, rows=rows: rows)
        np.testing.assert_array_equal(cupy.asnumpy(dst), values[lo:hi])
    assert not backend._locks.holds(np.zeros(10))
    backend.unlock_host(handle)
    backend._locks.settle()
    assert backend._locks.count() == 0 and not backend._locks.holds(mapped.at_hand((slice(0, 40),)))


def test_a_run_with_its_inputs_locked(tmp_path, monkeypatch):
    """(T) at o=8, v=48 on the CuPy backend: its 4-index inputs (1.2-7.1 MB) are locked where
    they are mapped (the gets after that copy from there); the energy equals the NumPy reference
    of chainexec.chem.triples within 1e-12, the bytes moved equal the plan's, and nothing stays
    locked once the unlocks are done."""
    from chainexec import api
    from chainexec.chem.triples import ccsd_t_energy

    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path / "cache"))
    made, handles = [], []
    init, lock = hostlock.Locks.__init__, hostlock.Locks.lock
    monkeypatch.setattr(hostlock.Locks, "__init__", lambda self, xp: made.append(self) or init(self, xp))
    monkeypatch.setattr(hostlock.Locks, "lock", lambda self, array: handles.append(lock(self, array)) or handles[-1])
    config = triples_config(tmp_path, "4GiB", nocc=8, nvir=48)
    result = api.run(config, backend="cupy")
    assert sum(h is not None for h in handles) >= 3  # t2, ovov and ovvv at least
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    with h5py.File(tmp_path / "energy.h5") as f:
        got = float(f["E"][()])
    expected = ccsd_t_energy(tmp_path / "inputs.h5")
    assert abs(got - expected) <= 1e-12 * abs(expected)
    made[0].settle()
    assert made[0].count() == 0
