"""``benchmarks/triples_order.py``: the (T) config's six-index tensors copied in another index
order compute the same energy, against the independent reference of ``chainexec.chem.triples``
(float64, relative 1e-12), from the committed pair order and back from another."""

import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import yaml

from chainexec.chem.triples import ccsd_t_energy
from tests.conftest import run_cli, triples_config

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "triples_order.py"


def _order(source: Path, out: Path, order: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(source), str(out), order], capture_output=True, text=True)


@pytest.mark.parametrize("orders", [("cbkjai",), ("ijkabc", "iajbkc")])
def test_every_order_gives_the_reference_energy(tmp_path, orders):
    config = triples_config(tmp_path, "1MiB", nocc=3, nvir=5, seed=4)
    for n, order in enumerate(orders):
        copy = tmp_path / f"order{n}.yaml"
        assert _order(config, copy, order).returncode == 0
        config = copy
    cfg = yaml.safe_load(config.read_text())
    assert "".join(cfg["tensors"]["Dinv"]["indices"]) == orders[-1]
    assert all(f"W[{','.join(orders[-1])}]" in s for s in cfg["statements"][:12])
    proc = run_cli("run", config, "--quiet")
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "energy.h5", "r") as f:
        got = float(f["E"][()])
    expected = ccsd_t_energy(tmp_path / "inputs.h5")
    assert abs(got - expected) <= 1e-12 * abs(expected)


def test_an_order_that_is_no_permutation_is_refused(tmp_path):
    proc = _order(Path(__file__).resolve().parents[1] / "configs" / "ccsd_t.yaml", tmp_path / "x.yaml", "ijkabd")
    assert proc.returncode == 2 and "not a permutation" in proc.stderr
    assert not (tmp_path / "x.yaml").exists()


def test_a_reference_the_script_cannot_read_is_refused(tmp_path):
    """A reference with a space in it would be left unpermuted while Dinv's declaration moves:
    a copy computing another energy. The script writes nothing and says which form it reads."""
    config = Path(__file__).resolve().parents[1] / "configs" / "ccsd_t.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["statements"][18] = cfg["statements"][18].replace("Z[i,a,j,b,k,c]", "Z[i, a, j, b, k, c]")
    spaced = tmp_path / "spaced.yaml"
    spaced.write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = _order(spaced, tmp_path / "x.yaml", "ijkabc")
    assert proc.returncode == 2 and "not of the form" in proc.stderr
    assert not (tmp_path / "x.yaml").exists()

