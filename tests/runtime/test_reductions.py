"""Outputs summed over a tiled loop: chains whose result lacks indices that a fused loop tiles (a
scalar energy from a 3-index intermediate, a vector, two vectors from one matrix, a scalar that a
later statement reads back, an intermediate that adds one term three times) equal numpy.einsum at
memory limits that tile every level, on 1 and 3 ranks, and move exactly the predicted bytes. Before
the fixes, such an output was stored once per tile of the loop and only the last tile's partial sum
survived, and a term added several times into one tensor was added once."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from chainexec import spec
from chainexec.generator import block
from chainexec.planner.build import make_plan
from chainexec.planner.plan import ops
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
    "a term added three times": (
        [("T", "=", "ijk,kl", "ijl"), ("T", "+=", "ijk,kl", "ijl"), ("T", "+=", "kl,ijk", "ijl"),
         ("E", "=", "ijl,ijl", "")],
        ["A", "B", "A", "B", "B", "A", "T", "C"], ["E", "T"]),
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


def _symmetric_config(second: str, device_memory: str) -> dict:
    """E sums over i, j a function symmetric in them when ``second`` is symmetric in i, j."""
    return {
        "name": "symmetric",
        "indices": {"i": 9, "j": 9, "x": 5, "y": 4},
        "tensors": {"A": {"indices": ["i", "x"], "source": {"random": 1}},
                    "B": {"indices": ["i", "x", "y"], "source": {"random": 2}},
                    "C": {"indices": ["i", "j", "x"], "source": {"random": 3}}},
        "statements": ["P[i,j,x] = A[i,x] * A[j,x]", "P[i,j,x] += B[i,x,y] * B[j,x,y]", f"E[] = P[i,j,x] * {second}"],
        "outputs": {"E": {"file": "out.h5", "dataset": "E", "symmetric": ["i", "j"]}},
        "machine": {"global_memory": "1GiB", "device_memory": device_memory},
    }


def _symmetric_reference(second: str) -> float:
    a, b, c = (block(seed, shape, tuple((0, n) for n in shape), "float64")
               for seed, shape in ((1, (9, 5)), (2, (9, 5, 4)), (3, (9, 9, 5))))
    p = np.einsum("ix,jx->ijx", a, a) + np.einsum("ixy,jxy->ijx", b, b)
    return float(np.einsum("ijx,ijx->", p, p if second.startswith("P") else c))


@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("device_memory", ["2KiB", "4KiB"])
def test_a_declared_symmetric_sum_visits_ordered_tiles(tmp_path, device_memory, ranks):
    """A chain of its own (not (T)): E = sum over i, j, x of P^2 with P symmetric in i, j. The
    parallel loop over i, j visits tiles i >= j only; E equals numpy and the prediction holds."""
    config = write_config(tmp_path, _symmetric_config("P[i,j,x]", device_memory))
    proc = run_cli("run", config, "--report-json", tmp_path / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = read_report(tmp_path / "r.json")
    for key in ("bytes", "flops", "statements", "memory_peak"):
        assert report["measured"][key] == report["predicted"][key], key
    plan = make_plan(spec.load(config), ranks=ranks)
    assert any(loop.symmetric == ["i", "j"] for nest in plan.nests for _, loops in ops(nest.body) for loop in loops)
    with h5py.File(tmp_path / "out.h5", "r") as f:
        got = float(f["E"][()])
    expected = _symmetric_reference("P[i,j,x]")
    assert abs(got - expected) <= 1e-12 * abs(expected)


def test_a_wrong_symmetry_declaration_is_caught_by_verify(tmp_path):
    """E = sum P[i,j,x]·C[i,j,x] is not symmetric in i, j (C is random): declared so, the run sums
    ordered tiles only and is wrong, and `chainexec verify` (numpy, no symmetry) says so."""
    config = write_config(tmp_path, _symmetric_config("C[i,j,x]", "2KiB"))
    assert run_cli("run", config).returncode == 0
    with h5py.File(tmp_path / "out.h5", "r") as f:
        got = float(f["E"][()])
    expected = _symmetric_reference("C[i,j,x]")
    assert abs(got - expected) > 1e-6 * abs(expected)
    proc = run_cli("verify", config)
    assert proc.returncode != 0 and "FAILED" in proc.stdout, proc.stdout + proc.stderr
