"""Outputs summed over a tiled loop: chains whose result lacks indices that a fused loop tiles (a
scalar energy from a 3-index intermediate, a vector, two vectors from one matrix, a scalar that a
later statement reads back) equal numpy.einsum at memory limits that tile every level, on 1 and 3
ranks, and move exactly the predicted bytes. Before the fix, such an output was stored once per tile
of the loop and only the last tile's partial sum survived."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from chainexec.generator import block
from tests.conftest import read_report, run_cli, write_config

N = {"i": 11, "j": 11, "k": 7, "l": 9}
INPUTS = {"A": "ijk", "B": "kl", "C": "ijl", "D": "j"}

# Statements as (output, operator, operands, output indices): the reference below evaluates these
# with numpy.einsum; the config gets them as text.
CHAINS = {
    "scalar of a two-term intermediate": (
        [("T", "=", "ijk,kl", "ijl"), ("T", "+=", "jik,kl", "ijl"), ("E", "=", "ijl,ijl", "")],
        ["A", "B", "A", "B", "T", "C"], ["E"]),
    "vector of a two-term intermediate": (
        [("T", "=", "ijk,kl", "ijl"), ("T", "+=", "jik,kl", "ijl"), ("y", "=", "ijl,ijl", "l")],
        ["A", "B", "A", "B", "T", "C"], ["y"]),
    "two vectors of one matrix": (
        [("M", "=", "ijk,ijk", "ij"), ("M", "+=", "jik,ijk", "ij"), ("x", "=", "ij,j", "i"), ("z", "=", "ij,i", "j")],
        ["A", "A", "A", "A", "M", "D", "M", "D"], ["x", "z"]),
    "a scalar read back in the chain": (
        [("T", "=", "ijk,kl", "ijl"), ("T", "+=", "jik,kl", "ijl"), ("E", "=", "ijl,ijl", ""),
         ("F", "=", ",ijl", "ijl"), ("G", "=", "ijl,ijl", "")],
        ["A", "B", "A", "B", "T", "C", "E", "T", "F", "C"], ["E", "G"]),
}


def _config(chain, global_memory: str, device_memory: str) -> dict:
    statements, names, outputs = chain
    texts, used = [], iter(names)
    for out, op, operands, out_ix in statements:
        refs = [f"{next(used)}[{','.join(ix)}]" for ix in operands.split(",")]
        texts.append(f"{out}[{','.join(out_ix)}] {op} {' * '.join(refs)}")
    return {
        "name": "reduction",
        "indices": N,
        "tensors": {name: {"indices": list(ix), "source": {"random": seed}}
                    for seed, (name, ix) in enumerate(INPUTS.items(), start=1)},
        "statements": texts,
        "outputs": {name: {"file": "out.h5", "dataset": name} for name in outputs},
        "machine": {"global_memory": global_memory, "device_memory": device_memory},
    }


def _reference(chain) -> dict[str, np.ndarray]:
    statements, names, outputs = chain
    values = {name: block(seed, tuple(N[i] for i in ix), tuple((0, N[i]) for i in ix), "float64")
              for seed, (name, ix) in enumerate(INPUTS.items(), start=1)}
    used = iter(names)
    for out, op, operands, out_ix in statements:
        term = np.einsum(f"{operands}->{out_ix}", *[values[next(used)] for _ in operands.split(",")])
        values[out] = values[out] + term if op == "+=" else term
    return {name: values[name] for name in outputs}


@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("global_memory, device_memory", [("12KiB", "2KiB"), ("40KiB", "8KiB"), ("1GiB", "1GiB")])
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_sums_over_tiled_loops(tmp_path, name, global_memory, device_memory, ranks):
    config = write_config(tmp_path, _config(CHAINS[name], global_memory, device_memory))
    proc = run_cli("run", config, "--report-json", tmp_path / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = read_report(tmp_path / "r.json")
    assert report["measured"]["bytes"] == report["predicted"]["bytes"]
    assert report["measured"]["memory_peak"] == report["predicted"]["memory_peak"]
    with h5py.File(tmp_path / "out.h5", "r") as f:
        for out, expected in _reference(CHAINS[name]).items():
            got = f[out][()]
            assert np.max(np.abs(got - expected)) <= 1e-12 * np.max(np.abs(expected)), out
