"""The compute statements (:mod:`chainexec.runtime.compute`) as the backend sees them: a
symmetrized run makes ready, at the first tile of each shape, every symmetrization the tiles of
that shape run (:meth:`Backend.prepare_symmetrize`), on (T) runs whose tiles have several
shapes and patterns of equal positions; the energy equals the independent reference."""

from __future__ import annotations

import h5py
import pytest

from chainexec import api
from chainexec.chem import triples
from chainexec.runtime.backends.numpy import NumpyBackend
from tests.conftest import triples_config


@pytest.mark.parametrize("device_memory", ["128KiB", "512KiB"])
def test_each_tile_shape_prepares_the_symmetrizations_its_tiles_run(device_memory, tmp_path, monkeypatch):
    """(T) at o=7, v=6 (tiles of 2 or 4: a cut last tile, so several shapes): every
    symmetrization a tile runs was prepared for its shape, once per shape, before the first of
    them; with three full tile positions (tiles of 2) the full shape's tiles run every one
    prepared for it; E(T) equals the reference to 1e-12."""
    prepared, ran = {}, []

    def variant(axes, keep):
        return tuple(map(tuple, axes)), tuple(map(tuple, keep))

    class Recording(NumpyBackend):
        def prepare_symmetrize(self, out, variants):
            assert out.shape not in prepared
            prepared[out.shape] = {variant(*v) for v in variants}

        def symmetrize(self, out, axes, keep=()):
            assert variant(axes, keep) in prepared[out.shape]
            ran.append((out.shape, variant(axes, keep)))
            super().symmetrize(out, axes, keep)

    config = triples_config(tmp_path, device_memory, nocc=7, nvir=6)
    monkeypatch.setattr(api, "select", lambda name, comm: Recording())
    api.run(config, backend="numpy", plan_cache=False)
    with h5py.File(tmp_path / "energy.h5") as f:
        energy = float(f["E"][()])
    reference = triples.ccsd_t_energy(tmp_path / "inputs.h5")
    assert abs(energy - reference) <= 1e-12 * abs(reference)
    assert ran and len({shape for shape, _ in ran}) >= 2
    if device_memory == "128KiB":
        full = max(prepared, key=lambda shape: shape[:3])
        assert {v for shape, v in ran if shape == full} == prepared[full]
