"""The (T) energy as a chainexec job: `chainexec chem` + `chainexec run configs/ccsd_t.yaml`
equals PySCF's own `ccsd_t()` (H2O, N2 in cc-pVDZ) within 1e-10 Eh on 1 and 4 ranks, with the
NumPy backend and on a GPU, and the independent NumPy reference on seeded synthetic amplitudes."""

from __future__ import annotations

import h5py
import pytest

from chainexec.chem.triples import ccsd_t_energy
from tests.conftest import ONE_THREAD, read_report, require_gpu, run_cli


def _energy(folder) -> float:
    with h5py.File(folder / "energy.h5", "r") as f:
        assert f.attrs["chainexec_complete"]
        return float(f["E"][()])


@pytest.fixture(scope="module", params=["h2o", "n2"])
def molecule(request, tmp_path_factory):
    pytest.importorskip("pyscf")
    folder = tmp_path_factory.mktemp(request.param)
    proc = run_cli("chem", request.param, "--out", folder, timeout=600, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(folder / "inputs.h5", "r") as f:
        return folder, float(f.attrs["e_t"])


@pytest.mark.parametrize("backend", ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("ranks", [1, 4])
def test_energy_equals_pyscf(molecule, ranks, backend):
    """On the NumPy backend (CI) and on the GPU (CuPy; skipped without one: 4 ranks share it)."""
    if backend == "cupy":
        require_gpu()
    folder, e_pyscf = molecule
    report_file = folder / f"r{ranks}_{backend}.json"
    proc = run_cli("run", folder / "ccsd_t.yaml", "--backend", backend, "--report-json", report_file, ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    report = read_report(report_file)
    assert report["run"]["backend"] == backend and report["run"]["ranks"] == ranks
    assert report["measured"]["bytes"] == report["predicted"]["bytes"]
    assert abs(_energy(folder) - e_pyscf) <= 1e-10
    assert e_pyscf < -1e-4  # a real correction, not a vacuous comparison


def test_an_ion_equals_pyscf(tmp_path):
    """``chem --charge -1``: OH- (10 electrons, 5 occupied orbitals) on 2 ranks equals the (T) energy
    PySCF computes for the ion, built here."""
    pytest.importorskip("pyscf")
    from pyscf import cc, gto, scf

    atoms = "O 0 0 0; H 0 0 0.97"
    assert run_cli("chem", atoms, "--charge", -1, "--out", tmp_path, timeout=600, env=ONE_THREAD).returncode == 0
    mol = gto.M(atom=atoms, basis="cc-pvdz", charge=-1, unit="Angstrom", verbose=0)
    mf = scf.RHF(mol)
    mf.conv_tol = 1e-12
    mf.kernel()
    mycc = cc.RCCSD(mf)
    mycc.conv_tol, mycc.conv_tol_normt = 1e-12, 1e-6
    mycc.kernel()
    e_t = mycc.ccsd_t()
    proc = run_cli("run", tmp_path / "ccsd_t.yaml", ranks=2)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "inputs.h5", "r") as f:
        assert f.attrs["charge"] == -1 and (f.attrs["nocc"], f.attrs["nvir"]) == (5, 19 - 5)
    assert abs(_energy(tmp_path) - e_t) <= 1e-10 and e_t < -1e-4


@pytest.mark.parametrize("nocc, nvir, seed, ranks, global_memory", [
    (3, 7, 11, 1, None), (4, 9, 12, 2, None),
    # Out of core: a global memory smaller than the inputs, which stream from disk tile by tile
    # and are read many times over (over a thousand parallel tiles), and E summed over the tiles.
    (3, 7, 11, 2, "16KiB")])
def test_synthetic_equals_numpy_reference(tmp_path, nocc, nvir, seed, ranks, global_memory):
    import yaml

    proc = run_cli("chem", "synthetic", "--synthetic", nocc, nvir, seed, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    if global_memory is not None:
        config = tmp_path / "ccsd_t.yaml"
        cfg = yaml.safe_load(config.read_text())
        cfg["machine"] = {"global_memory": global_memory, "device_memory": "1MiB"}
        config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = run_cli("run", tmp_path / "ccsd_t.yaml", ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    expected = ccsd_t_energy(tmp_path / "inputs.h5")
    assert abs(_energy(tmp_path) - expected) <= 1e-12 * abs(expected)


def _moved(plan) -> dict[str, set[str]]:
    """Statements that move each tensor between levels, over the whole plan."""
    from chainexec.planner.plan import ops

    seen: dict[str, set[str]] = {}
    for nest in plan.nests:
        for op, _ in ops(nest.body):
            if op.op in ("load", "store", "get", "accumulate"):
                seen.setdefault(op.tensor, set()).add(op.op)
    return seen


@pytest.mark.parametrize("device_memory", ["2MiB", "256KiB"])
def test_six_index_intermediates_stay_on_the_device(tmp_path, device_memory):
    """W, V, Z, R and W·Dinv live only as device tiles fused with the energy reduction; with a
    small device the fused loop over i, j, k tiles and 4 ranks share the tiles."""
    import yaml

    from chainexec import spec
    from chainexec.planner.build import make_plan

    assert run_cli("chem", "synthetic", "--synthetic", 4, 9, 5, "--out", tmp_path).returncode == 0
    config = tmp_path / "ccsd_t.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["machine"] = {"global_memory": "1GiB", "device_memory": device_memory}
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    plan = make_plan(spec.load(config))
    moved = _moved(plan)
    six = [t for t, info in plan.tensors.items() if len(info.indices) == 6]
    assert {"W", "V", "Z", "R", "Dinv"} <= set(six)
    assert not any(t in moved for t in six), {t: moved[t] for t in six if t in moved}
    assert moved["E"] == {"accumulate", "store"}
    proc = run_cli("run", config, "--report-json", tmp_path / "r.json", ranks=4)
    assert proc.returncode == 0, proc.stderr
    assert abs(_energy(tmp_path) - ccsd_t_energy(tmp_path / "inputs.h5")) <= 1e-12 * abs(_energy(tmp_path))


@pytest.mark.parametrize("device_memory, ranks", [("40KiB", 2), ("48KiB", 3)])
def test_inputs_larger_than_the_device_stream_into_the_fused_loop(tmp_path, device_memory, ranks):
    """ovvv (o·v³ = 4·12³ values, 54 KiB) does not fit the device: the whole chain still runs as
    one fused loop over i, j, k tiles that gets the input tiles each iteration needs (the
    ``fused`` alternative; the paper's cuts would move W through the global array). The energy
    equals the NumPy reference on several ranks, and the bytes equal the prediction."""
    import yaml

    from chainexec import spec
    from chainexec.planner.build import make_plan
    from chainexec.planner.plan import ops
    from chainexec.spec import parse_size

    assert run_cli("chem", "synthetic", "--synthetic", 4, 12, 7, "--out", tmp_path).returncode == 0
    config = tmp_path / "ccsd_t.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["machine"] = {"global_memory": "64MiB", "device_memory": device_memory}
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    plan = make_plan(spec.load(config))
    assert 4 * 12 ** 3 * 8 > parse_size(device_memory, "device_memory")
    assert [a["name"] for a in plan.alternatives if a["kind"] == "schedule" and a["chosen"]] == ["fused"]
    fetched = {op.tensor for nest in plan.nests for op, loops in ops(nest.body)
               if op.op == "get" and any(loop.parallel for loop in loops)}
    assert "ovvv" in fetched
    six = [t for t, info in plan.tensors.items() if len(info.indices) == 6]
    assert not set(six) & set(_moved(plan))
    report_file = tmp_path / "r.json"
    proc = run_cli("run", config, "--report-json", report_file, ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    report = read_report(report_file)
    assert report["measured"]["bytes"] == report["predicted"]["bytes"]
    expected = ccsd_t_energy(tmp_path / "inputs.h5")
    assert abs(_energy(tmp_path) - expected) <= 1e-12 * abs(expected)


@pytest.mark.parametrize("ranks", [1, 3])
def test_ordered_occupied_tiles_equal_the_full_sum(tmp_path, ranks):
    """E declared symmetric in i, j, k: with device tiles of one occupied index each, the parallel
    loop visits the C(6, 3) = 20 ordered tiles i >= j >= k of 64, weighted 6, 3 or 1; the energy
    equals the NumPy reference, and bytes, flops and peaks equal the prediction (which counts
    the ordered tiles only)."""
    import yaml

    from chainexec import spec
    from chainexec.planner.build import make_plan
    from chainexec.planner.plan import ops

    assert run_cli("chem", "synthetic", "--synthetic", 4, 6, 7, "--out", tmp_path).returncode == 0
    config = tmp_path / "ccsd_t.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["machine"] = {"global_memory": "1GiB", "device_memory": "24KiB"}
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    plan = make_plan(spec.load(config), ranks=ranks)
    (par,) = {id(loop): loop for nest in plan.nests for _, loops in ops(nest.body) for loop in loops
              if loop.parallel}.values()
    assert par.symmetric == ["i", "j", "k"] and all(par.tiles[i] == 1 for i in "ijk")
    assert plan.predicted["flops"] < 0.35 * sum(c.flops for c in plan.contractions)
    proc = run_cli("run", config, "--report-json", tmp_path / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    report = read_report(tmp_path / "r.json")
    for key in ("bytes", "flops", "statements", "memory_peak"):
        assert report["measured"][key] == report["predicted"][key], key
    assert sum(rank["tiles"] for rank in report["run"]["per_rank"]) == 20
    expected = ccsd_t_energy(tmp_path / "inputs.h5")
    assert abs(_energy(tmp_path) - expected) <= 1e-12 * abs(expected)
