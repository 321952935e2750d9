"""The page-locked upload arena on a GPU: rows copied through it (in parts, around the ring) equal
the host's, which may change once the upload returns; a (T) run whose inputs reach the device
through it (their mapped tiles not locked in place, :mod:`chainexec.runtime.hostlock`) gives
NumPy's energy with the bytes the plan predicts. Skipped without CuPy or a CUDA
device."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import require_gpu, triples_config  # noqa: E402

cupy = require_gpu()

from chainexec.runtime import arena  # noqa: E402
from chainexec.runtime.backends.cupy import CupyBackend  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(300, 40000), (5, 3, 70001), (2, 1 << 20)])
def test_upload_equals_the_host_rows(shape):
    """96-168 MB in parts of whole rows (half the ring at most, so the ring wraps), on a stream
    of its own: the device holds the host's values, though the host array was overwritten as
    soon as the upload returned."""
    assert arena.prepare(cupy) is not None
    host = np.random.default_rng(len(shape)).standard_normal(shape)
    want = host.copy()
    dst = cupy.empty(shape)
    stream = cupy.cuda.Stream(non_blocking=True)
    assert arena.upload(cupy, dst, host, stream)
    host[...] = 0.0
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(dst), want)


def test_a_run_through_the_arena(tmp_path, monkeypatch):
    """(T) at o=8, v=48 on the CuPy backend with the arena made (as the command's warm-up makes
    it): its inputs go through the arena, the energy equals the NumPy reference of
    chainexec.chem.triples within 1e-12, and the bytes moved equal the plan's."""
    import h5py

    from chainexec import api
    from chainexec.chem.triples import ccsd_t_energy

    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path / "cache"))
    assert arena.prepare(cupy) is not None
    taken = []
    upload = arena.Arena.upload

    def spy(self, dst, host, stream):
        taken.append(upload(self, dst, host, stream))
        return taken[-1]

    monkeypatch.setattr(arena.Arena, "upload", spy)
    # inputs mapped from their file are locked where they lie and skip the arena (hostlock.py)
    monkeypatch.setattr(CupyBackend, "lock_host", lambda self, array, writable=False: None)
    config = triples_config(tmp_path, "4GiB", nocc=8, nvir=48)
    result = api.run(config, backend="cupy")
    assert any(taken)
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    with h5py.File(tmp_path / "energy.h5") as f:
        got = float(f["E"][()])
    expected = ccsd_t_energy(tmp_path / "inputs.h5")
    assert abs(got - expected) <= 1e-12 * abs(expected)
