"""``benchmarks/ab_fresh.py`` on the NumPy backend: two copies of the package run a small (T) job
in fresh processes from their own folders, each importing its own copy; both energies equal the
independent reference, and every count equals the prediction."""

import importlib.util
import json
import shutil
from pathlib import Path

import h5py
import pytest

from chainexec.chem.triples import ccsd_t_energy
from tests.conftest import triples_config

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ab_fresh", ROOT / "benchmarks" / "ab_fresh.py")
ab_fresh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_fresh)


def test_decisions_count_the_tuning_files(tmp_path):
    assert ab_fresh.decisions(tmp_path) == 0
    (tmp_path / "tuning").mkdir()
    for n in range(3):
        (tmp_path / "tuning" / f"{n}.json").write_text("{}")
    (tmp_path / "tuning" / "x.tmp").write_text("")
    assert ab_fresh.decisions(tmp_path) == 3


def test_two_copies_alternate_and_agree(tmp_path, capsys):
    config = triples_config(tmp_path / "job", "1GiB", 3, 7)
    for name in ("a", "b"):
        shutil.copytree(ROOT / "chainexec", tmp_path / name / "chainexec")
    summary = ab_fresh.main([str(tmp_path / "ab"), str(config), "--side", f"a={tmp_path / 'a'}",
                             "--side", f"b={tmp_path / 'b'}", "--rounds", "2", "--skip", "1", "--backend", "numpy",
                             "--share-cache"])
    printed = capsys.readouterr().out
    for name in ("a", "b"):  # each side imports its own copy, made under the output folder
        assert f"{name} imports {tmp_path / 'ab' / name / 'code' / 'chainexec' / '__init__.py'}" in printed
    expected = ccsd_t_energy(tmp_path / "job" / "inputs.h5")
    for side in summary.values():
        assert len(side["executor_s"]) == 2 and side["rounds_kept"] == 1
        assert side["tuned"] == [0, 0]  # NumPy keeps no decisions
        assert side["median_s"] == side["executor_s"][1] and side["measured_equals_predicted"]
        # the process holds api.run, which holds the executor
        assert side["process_wall_median_s"] == side["process_wall_s"][1] > side["run_median_s"] > side["median_s"]
        assert abs(side["outputs"]["E"] - expected) <= 1e-12 * abs(expected)
    assert json.loads((tmp_path / "ab" / "summary.json").read_text()) == summary
    assert (tmp_path / "ab" / "reports" / "a_cold.json").exists()  # --share-cache: b starts from a's cache
    assert not (tmp_path / "ab" / "reports" / "b_cold.json").exists()
    with h5py.File(tmp_path / "job" / "inputs.h5", "a") as f:  # as `chainexec chem` records PySCF's (T)
        f.attrs["e_t"], f.attrs["e_t_seconds"] = expected + 1e-3, 10.0
    again = ab_fresh.main([str(tmp_path / "ab2"), str(config), "--side", f"a={tmp_path / 'a'}", "--rounds", "1",
                           "--backend", "numpy"])
    assert again["a"]["pyscf_t_s"] == 10.0 and abs(again["a"]["e_minus_pyscf_eh"] + 1e-3) < 1e-12
    assert again["a"]["ratio_to_pyscf"] == pytest.approx(10.0 / again["a"]["median_s"], rel=0.01)
