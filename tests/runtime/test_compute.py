"""The compute statements (:mod:`chainexec.runtime.compute`) as the backend sees them: at the
first tile of a symmetric device loop, a symmetrized run and a fused statement each make ready
together (:meth:`Backend.precompile`) the kernels of every tile shape of the loop, listed at
stand-ins of tiles not run yet (:meth:`Buffers.stand_in`), on (T) runs whose tiles have several
shapes and patterns of equal positions: every kernel a tile runs was made ready before, in one
batch per statement; the energy equals the independent reference."""

from __future__ import annotations

import h5py
import pytest

from chainexec import api
from chainexec.chem import triples
from chainexec.runtime.backends.numpy import NumpyBackend
from tests.conftest import triples_config


def layout(array) -> tuple:
    """What a generated kernel of ``array`` depends on: its shape, its strides along the
    dimensions longer than one (``pointwise`` reads 0 along the others) and its dtype."""
    return array.shape, tuple(0 if n == 1 else s for n, s in zip(array.shape, array.strides)), array.dtype.name


class Recording(NumpyBackend):
    """NumPy, with the kernels a generating backend would compile described by the layouts of
    their arrays: each batch made ready is recorded, and each launch checks that its kernel was
    in an earlier one."""

    def __init__(self):
        super().__init__()
        self.batches, self.ran = [], []

    def symmetrize_kernels(self, out, variants):
        return [("symmetrize", layout(out), tuple(map(tuple, axes)), tuple(map(tuple, keep)))
                for axes, keep in variants]

    def fused_kernels(self, f, arrays, shape, out, within=()):
        return [("fused", shape, tuple(layout(a) for a in arrays.values()), tuple(d for g in within for d in g))]

    def precompile(self, kernels):
        self.batches.append(list(kernels))

    def ready(self, kernel) -> bool:
        return any(kernel in batch for batch in self.batches)

    def symmetrize(self, out, axes, keep=()):
        kernel, = self.symmetrize_kernels(out, [(axes, keep)])
        assert self.ready(kernel), kernel
        self.ran.append(kernel)
        super().symmetrize(out, axes, keep)

    def fused(self, f, arrays, shape, out, within=()):
        kernel, = self.fused_kernels(f, arrays, shape, out, within)
        assert self.ready(kernel), kernel
        self.ran.append(kernel)
        super().fused(f, arrays, shape, out, within)


CASES = [(7, 6, "128KiB"), (7, 6, "512KiB"), (10, 8, "256KiB")]
"""(T) at (o, v, device memory) whose symmetric loop has a cut last tile, so several tile shapes:
inputs whole on the device (tiles of 2 or 4), or fetched per tile into double-buffered lanes with
renamed references to one input (tiles of 3)."""


@pytest.mark.parametrize("nocc, nvir, device_memory", CASES)
def test_each_statement_makes_every_tile_shapes_kernels_ready_at_once(nocc, nvir, device_memory, tmp_path,
                                                                      monkeypatch):
    """Every kernel a tile runs (the W run's symmetrizations, the energy's fused reduction) was
    made ready before it ran, and those of one statement in one loop in one batch that holds
    every tile shape the statement meets there; E(T) equals the reference to 1e-12."""
    backend = Recording()
    config = triples_config(tmp_path, device_memory, nocc=nocc, nvir=nvir)
    monkeypatch.setattr(api, "select", lambda name, comm: backend)
    api.run(config, backend="numpy", plan_cache=False)
    with h5py.File(tmp_path / "energy.h5") as f:
        energy = float(f["E"][()])
    reference = triples.ccsd_t_energy(tmp_path / "inputs.h5")
    assert abs(energy - reference) <= 1e-12 * abs(reference)
    for kind in ("symmetrize", "fused"):
        ran = [k for k in backend.ran if k[0] == kind]
        shapes = {k[1][0] if kind == "symmetrize" else k[1] for k in ran}
        assert len(shapes) >= 2, (kind, shapes)  # several tile shapes ran
        batch = next(b for b in backend.batches if any(k[0] == kind for k in b))
        assert set(ran) <= set(batch)  # all of them made ready in the statement's first batch
    assert all(backend.batches)


@pytest.mark.parametrize("nocc, nvir, device_memory", CASES)
def test_stand_ins_have_the_layout_of_the_views_they_stand_for(nocc, nvir, device_memory, tmp_path, monkeypatch):
    """The fused statement's arrays listed at the first tile for every tile shape (stand-ins:
    read-only, over no memory of their own) have the shapes, strides and dtypes of the views
    its tiles of that shape then launch with: the inputs' cuts and W, allocated per tile."""
    listed, launched = {}, {}

    class Checking(NumpyBackend):
        def fused_kernels(self, f, arrays, shape, out, within=()):
            assert not any(a.flags.writeable for a in arrays.values())
            listed.setdefault(shape, ([layout(a) for a in arrays.values()], layout(out)))
            return []

        def fused(self, f, arrays, shape, out, within=()):
            launched.setdefault(shape, ([layout(a) for a in arrays.values()], layout(out)))
            super().fused(f, arrays, shape, out, within)

    config = triples_config(tmp_path, device_memory, nocc=nocc, nvir=nvir)
    monkeypatch.setattr(api, "select", lambda name, comm: Checking())
    api.run(config, backend="numpy", plan_cache=False)
    assert len(launched) >= 2
    assert {shape: listed[shape] for shape in launched} == launched
