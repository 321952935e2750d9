"""Seeded random chains (2–5 contractions, 2–6 indices per tensor, uneven extents, `=`, `+=`,
factors, on-the-fly and HDF5 inputs) run by the real CLI and compared with numpy.einsum."""

from __future__ import annotations

import random

import h5py
import numpy as np
import pytest

from chainexec import spec
from chainexec.generator import block
from chainexec.planner.build import make_plan
from tests.conftest import read_report, run_cli, write_config

POOL = "ijklmnopuvwx"


def _statement(rng: random.Random, first: tuple[str, list[str]] | None, n_operands: int):
    """Random operand index sets; the result keeps every index seen once (and some seen twice)."""
    while True:
        operands = [first[1]] if first else []
        while len(operands) < n_operands:
            operands.append(rng.sample(POOL, rng.randint(2, 4)))
        count = {}
        for ops in operands:
            for i in ops:
                count[i] = count.get(i, 0) + 1
        lhs = [i for i in count if count[i] == 1] + [i for i in count if count[i] > 1 and rng.random() < 0.3]
        if 2 <= len(lhs) <= 6:
            rng.shuffle(lhs)
            return operands, lhs


def random_chain(seed: int, folder, contractions: tuple[int, int] = (2, 5),
                 device: tuple[str, ...] = ("1KiB", "2KiB")) -> dict:
    """A seeded chain of ``contractions`` (least, most) binary contractions, planned within one of
    the ``device`` memory limits."""
    rng = random.Random(seed)
    extents = {i: rng.randint(2, 5) for i in POOL}
    tensors, statements = {}, []
    budget = rng.randint(*contractions)  # binary contractions
    prev = None
    k = 0
    while budget > 0:
        n_ops = min(rng.choice([2, 2, 3]), budget + 1)
        operands, lhs = _statement(rng, prev, n_ops)
        refs = []
        for n, ops in enumerate(operands):
            if n == 0 and prev:
                refs.append(f"{prev[0]}[{','.join(ops)}]")
                continue
            name = f"X{k}_{n}"
            source = {"random": rng.randint(0, 1000)} if rng.random() < 0.5 else \
                {"file": "inputs.h5", "dataset": name, "seed": rng.randint(0, 1000)}
            tensors[name] = {"indices": list(ops), "source": source}
            refs.append(f"{name}[{','.join(ops)}]")
        out = f"R{k}"
        factor = rng.choice(["", "0.5 * ", "-2 * "])
        statements.append(f"{out}[{','.join(lhs)}] = {factor}{' * '.join(refs)}")
        if rng.random() < 0.4:
            name = f"Y{k}"
            tensors[name] = {"indices": list(lhs), "source": {"random": rng.randint(0, 1000)}}
            statements.append(f"{out}[{','.join(lhs)}] += {name}[{','.join(lhs)}]")
        budget -= n_ops - 1
        prev = (out, lhs)
        k += 1
    return {
        "name": f"chain{seed}",
        "indices": extents,
        "tensors": tensors,
        "statements": statements,
        "outputs": {prev[0]: {"file": "out.h5", "dataset": prev[0]}},
        "machine": {"global_memory": rng.choice(["6KiB", "16KiB", "64KiB"]), "device_memory": rng.choice(device)},
    }


def reference(cfg: dict, folder) -> np.ndarray:
    """The chain by numpy.einsum, statement by statement, inputs read or generated directly."""
    values = {}
    for name, t in cfg["tensors"].items():
        shape = tuple(cfg["indices"][i] for i in t["indices"])
        if "random" in t["source"]:
            values[name] = block(t["source"]["random"], shape, tuple((0, n) for n in shape), "float64")
        else:
            with h5py.File(folder / "inputs.h5", "r") as f:
                values[name] = f[name][...]
    for st in cfg["statements"]:
        parsed = spec.parse_statement(st)
        expr = ",".join("".join(r.indices) for r in parsed.operands) + "->" + "".join(parsed.lhs.indices)
        result = parsed.factor * np.einsum(expr, *[values[r.tensor] for r in parsed.operands])
        values[parsed.lhs.tensor] = values[parsed.lhs.tensor] + result if parsed.accumulate else result
    return values[next(iter(cfg["outputs"]))]


def _run_equals_reference(cfg: dict, config, tmp_path, ranks) -> None:
    """The chain run by the CLI on ``ranks``: bytes and peaks as predicted, output equal to the
    einsum reference within 1e-12 relative."""
    if any("file" in t["source"] for t in cfg["tensors"].values()):
        assert run_cli("generate", config).returncode == 0
    proc = run_cli("run", config, "--report-json", tmp_path / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    result = read_report(tmp_path / "r.json")
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    assert result["measured"]["memory_peak"] == result["predicted"]["memory_peak"]
    expected = reference(cfg, tmp_path)
    name = next(iter(cfg["outputs"]))
    with h5py.File(tmp_path / "out.h5", "r") as f:
        got = f[name][...]
    assert got.shape == expected.shape
    assert np.max(np.abs(got - expected)) <= 1e-12 * np.max(np.abs(expected))


@pytest.mark.parametrize("seed", range(12))
def test_random_chain(seed, tmp_path):
    cfg = random_chain(seed, tmp_path)
    config = write_config(tmp_path, cfg)
    plan = make_plan(spec.load(config))
    assert 2 <= len(plan.contractions) - sum("+=" in s for s in cfg["statements"]) <= 5
    assert all(2 <= len(t.indices) <= 6 for t in plan.tensors.values())
    _run_equals_reference(cfg, config, tmp_path, [None, 2, 3][seed % 3])


@pytest.mark.parametrize("seed, ranks", [(17, 3), (25, 2), (50, 1)])
def test_long_random_chain_fused_whole(seed, tmp_path, ranks):
    """Chains of 6–9 contractions (past the exhaustive search) whose whole run fits one device
    group: the ``fused`` alternative, checked like the short chains."""
    cfg = random_chain(seed, tmp_path, contractions=(6, 9), device=("4KiB", "16KiB", "64KiB"))
    config = write_config(tmp_path, cfg)
    plan = make_plan(spec.load(config))
    assert [a["name"] for a in plan.alternatives if a["kind"] == "schedule" and a["chosen"]] == ["fused"]
    _run_equals_reference(cfg, config, tmp_path, ranks)


@pytest.mark.parametrize("statement, expected", [("T[] = 2 * A[] * B[]", lambda a, b: 2 * a * b),
                                                 ("T[] = -0.5 * A[] * A[]", lambda a, b: -0.5 * a * a),
                                                 ("T[] = A[] * B[]", lambda a, b: a * b)])
def test_a_product_of_scalars_with_a_factor(statement, expected, tmp_path):
    """Two 0-d operands and a factor (NumPy's product of two 0-d arrays is a scalar, which the
    factor could not scale in place: a traceback, status 1): the product of the stored values."""
    a, b = np.random.default_rng(3).uniform(-2, 2, 2)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["A"], f["B"] = a, b
    config = write_config(tmp_path, {
        "indices": {}, "statements": [statement], "outputs": {"T": {"file": "out.h5", "dataset": "T"}},
        "tensors": {name: {"indices": [], "source": {"file": "in.h5", "dataset": name}} for name in "AB"}})
    proc = run_cli("run", config, "--quiet", "--report-json", tmp_path / "r.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert abs(float(f["T"][()]) - expected(a, b)) <= 1e-15 * abs(expected(a, b))
    report = read_report(tmp_path / "r.json")
    assert report["measured"]["bytes"] == report["predicted"]["bytes"]
