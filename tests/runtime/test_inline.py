"""Fused statements (``planner/inline.py``) executed: chains whose point-wise intermediates are
computed where they are read — a (T)-like epilogue reduced to a scalar through a computed tensor
and permuted reads of a reused value (Z, computed once per element), a point-wise output reading
a permuted producer, and one reading an intermediate whose file layout the planner reordered —
equal a NumPy evaluation written out by hand, with and without inlining, on 1 and 2 ranks, at
memory limits that tile and that do not; every counted quantity equals the prediction."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from chainexec import spec
from chainexec.generator import block
from chainexec.planner.build import make_plan
from chainexec.planner.plan import ops
from tests.conftest import read_report, run_cli, write_config

N = {"i": 6, "j": 6, "k": 5, "l": 7}
INPUTS = {"A": "ijk", "B": "kl", "C": "ijl", "D": "j", "G": "l"}
DENOMINATOR = "1 / (4 + D[i] * D[j] + G[l] * G[l])"

# (statements, outputs, the fused statements expected: output -> inlined tensors)
CHAINS = {
    "epilogue": (["W[i,j,l] = A[i,j,k] * B[k,l]",
                  "V[i,j,l] = C[i,j,l] * D[j]",
                  "V[i,j,l] += C[j,i,l] * D[i]",
                  "Z[i,j,l] = W[i,j,l]",
                  "Z[i,j,l] += 0.5 * V[i,j,l]",
                  "R[i,j,l] = 2 * Z[i,j,l]",
                  "R[i,j,l] -= Z[j,i,l]",
                  "E[] = W[i,j,l] * P[i,j,l] * R[i,j,l]"], ["E"], {"E": {"P", "R", "V", "Z", "_s7_0"}}),
    # Y is reused by X's run, X by the energy: one level of reused values only, so nothing fuses
    "nested reuse": (["Y[i,j,l] = C[i,j,l] * D[j]",
                      "X[i,j,l] = Y[i,j,l]",
                      "X[i,j,l] += Y[j,i,l]",
                      "E[] = X[i,j,l] * X[j,i,l]"], ["E"], {}),
    # Y is read by Q's run and by the energy: no one run reads it at all its permutations
    "read by two runs": (["Y[i,j,l] = C[i,j,l] * D[j]",
                          "Q[i,j,l] = Y[i,j,l] * G[l]",
                          "E[] = Q[i,j,l] * Y[j,i,l]"], ["E"], {"E": {"Q"}}),
    "point-wise output": (["X[i,j,l] = C[i,j,l] * D[j]",
                           "O[i,j,l] = 3 * X[j,i,l] * C[i,j,l]"], ["O"], {"O": {"X"}}),
    # C is read by both producers: its buffer lives until the second fused statement
    "two fused statements read one input": (["Y[i,j,l] = C[i,j,l] * G[l]",
                                             "X[i,j,l] = C[i,j,l] * D[j]",
                                             "F[i,j,l] = 2 * X[i,j,l] * G[l]",
                                             "H[i,j,l] = Y[j,i,l] * D[j]"], ["F", "H"], {"F": {"X"}, "H": {"Y"}}),
}


def _inputs() -> dict[str, np.ndarray]:
    return {name: block(seed, tuple(N[i] for i in ix), tuple((0, N[i]) for i in ix), "float64")
            for seed, (name, ix) in enumerate(INPUTS.items(), start=1)}


def _reference(name: str) -> dict[str, np.ndarray]:
    """Each chain by hand in NumPy (no chainexec code)."""
    x = _inputs()
    a, b, c, d, g = x["A"], x["B"], x["C"], x["D"], x["G"]
    if name == "epilogue":
        w = np.einsum("ijk,kl->ijl", a, b)
        v = c * d[None, :, None] + c.transpose(1, 0, 2) * d[:, None, None]
        z = w + 0.5 * v
        r = 2 * z - z.transpose(1, 0, 2)
        p = 1 / (4 + d[:, None, None] * d[None, :, None] + g[None, None, :] ** 2)
        return {"E": np.sum(w * p * r)}
    if name == "nested reuse":
        y = c * d[None, :, None]
        x = y + y.transpose(1, 0, 2)
        return {"E": np.sum(x * x.transpose(1, 0, 2))}
    if name == "read by two runs":
        y = c * d[None, :, None]
        return {"E": np.sum(y * g[None, None, :] * y.transpose(1, 0, 2))}
    if name == "point-wise output":
        return {"O": 3 * (c * d[None, :, None]).transpose(1, 0, 2) * c}
    y = c * g[None, None, :]
    return {"F": 2 * c * d[None, :, None] * g[None, None, :], "H": y.transpose(1, 0, 2) * d[None, :, None]}


def _config(name: str, global_memory: str, device_memory: str) -> dict:
    statements, outputs, _ = CHAINS[name]
    texts = statements + ([DENOMINATOR] if name == "epilogue" else [])
    tensors = {n: {"indices": list(ix), "source": {"random": seed}}
               for seed, (n, ix) in enumerate(INPUTS.items(), start=1) if any(f"{n}[" in t for t in texts)}
    if name == "epilogue":
        tensors["P"] = {"indices": ["i", "j", "l"], "source": {"expr": DENOMINATOR}}
    return {
        "name": "fusedchain",
        "indices": N,
        "tensors": tensors,
        "statements": statements,
        "outputs": {n: {"file": "out.h5", "dataset": n} for n in outputs},
        "machine": {"global_memory": global_memory, "device_memory": device_memory},
    }


LIMITS = [("1GiB", "1GiB"), ("16KiB", "3KiB")]


def run_chain(folder, name: str, limits: tuple[str, str], ranks: int | None = None, backend: str = "numpy",
              inline: bool = True) -> None:
    """Plan (checking which statements are fused), run and check one chain."""
    config = write_config(folder, _config(name, *limits))
    plan = make_plan(spec.load(config), ranks=ranks or 1, inline=inline)
    fused = {op.tensor: set(op.inlined) for nest in plan.nests for op, _ in ops(nest.body) if op.op == "fused"}
    assert fused == (CHAINS[name][2] if inline else {})
    flags = [] if inline else ["--no-inline"]
    proc = run_cli("run", config, "--backend", backend, *flags, "--report-json", folder / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = read_report(folder / "r.json")
    assert report["run"]["backend"] == backend
    for key in ("bytes", "flops", "statements", "streamed", "memory_peak"):
        assert report["measured"][key] == report["predicted"][key], key
    with h5py.File(folder / "out.h5", "r") as f:
        for out, expected in _reference(name).items():
            got = f[out][()]
            assert np.max(np.abs(got - expected)) <= 1e-12 * np.max(np.abs(expected)), out


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("limits", LIMITS, ids=["untiled", "tiled"])
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_fused_statements_equal_numpy(tmp_path, name, limits, ranks):
    run_chain(tmp_path, name, limits, ranks)


@pytest.mark.parametrize("limits", LIMITS, ids=["untiled", "tiled"])
def test_unfused_run_of_the_same_chain_agrees(tmp_path, limits):
    run_chain(tmp_path, "epilogue", limits, inline=False)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_fused_statement_reads_an_intermediate_whose_file_layout_was_reordered(tmp_path, ranks):
    """T0 is stored between nests (a statement in between, the global memory one tile of
    elements), so its indices are reordered for its file (:mod:`chainexec.planner.layout`); the
    fused statement that reads it twice reads it under the new order (it named the old one, and
    found no buffer)."""
    sizes = {"i": 2, "j": 3, "k": 2}
    config = write_config(tmp_path, {
        "indices": sizes,
        "tensors": {"A": {"indices": ["i"], "source": {"random": 1}},
                    "B": {"indices": ["k", "j"], "source": {"random": 2}}},
        "statements": ["T0[k,i,j] = A[i] * B[k,j]", "T1[i] = 2 * A[i]", "T2[j,i,k] = T0[k,i,j] * B[k,j] * T0[k,i,j]"],
        "outputs": {"T1": {"file": "out.h5", "dataset": "T1"}, "T2": {"file": "out.h5", "dataset": "T2"}},
        "machine": {"global_memory": 64, "device_memory": "1GiB"},
    })
    plan = make_plan(spec.load(config), ranks=ranks)
    assert [op.inlined for nest in plan.nests for op, _ in ops(nest.body) if op.op == "fused"] == [["_s2_0"]]
    proc = run_cli("run", config, "--report-json", tmp_path / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = read_report(tmp_path / "r.json")
    for key in ("bytes", "flops", "statements", "streamed", "memory_peak"):
        assert report["measured"][key] == report["predicted"][key], key
    a = block(1, (2,), ((0, 2),), "float64")
    b = block(2, (2, 3), ((0, 2), (0, 3)), "float64")
    t0 = a[None, :, None] * b[:, None, :]
    expected = (t0 * b[:, None, :] * t0).transpose(2, 1, 0)
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert np.max(np.abs(f["T2"][()] - expected)) <= 1e-12 * np.max(np.abs(expected))
        assert np.max(np.abs(f["T1"][()] - 2 * a)) <= 1e-12 * np.max(np.abs(a))
