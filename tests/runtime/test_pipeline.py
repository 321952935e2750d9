"""Double-buffered global loops at run time: a chain whose second statement adds into the stored
result (its loop reads X v1 one tile ahead, adds, writes X v2 behind) on 1–3 ranks with uneven
tiles equals numpy.einsum and measures exactly the predicted bytes and memory peaks."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from chainexec import spec
from chainexec.generator import block
from chainexec.planner import pipeline
from chainexec.planner.build import make_plan
from chainexec.planner.plan import ops
from tests.conftest import read_report, run_cli, write_config

EXTENTS = {"i": 13, "j": 11, "k": 9, "l": 7}
CHAIN = {
    "name": "acc",
    "indices": EXTENTS,
    "tensors": {
        "A": {"indices": ["i", "k"], "source": {"file": "in.h5", "dataset": "A", "seed": 1}},
        "B": {"indices": ["k", "j"], "source": {"file": "in.h5", "dataset": "B", "seed": 2}},
        "C": {"indices": ["i", "l"], "source": {"file": "in.h5", "dataset": "C", "seed": 3}},
        "D": {"indices": ["l", "j"], "source": {"random": 4}},
    },
    "statements": ["X[i,j] = A[i,k] * B[k,j]", "X[i,j] += -0.5 * C[i,l] * D[l,j]"],
    "outputs": {"X": {"file": "out.h5", "dataset": "X"}},
}


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("global_memory", ["2KiB", "3KiB"])
def test_adding_into_a_stored_result_one_tile_ahead(tmp_path, global_memory, ranks):
    config = write_config(tmp_path, CHAIN | {"machine": {"global_memory": global_memory, "device_memory": "512B"}})
    plan = make_plan(spec.load(config), schedule="unfused")
    ahead = [op for nest in plan.nests for _, loops in ops(nest.body) for loop in loops if loop.depth > 1
             for op in pipeline.prefetched(loop)]
    assert any(op.op == "load" and op.tensor == "X" and op.version == 1 for op in ahead)
    assert run_cli("generate", config).returncode == 0
    proc = run_cli("run", config, "--schedule", "unfused", "--report-json", tmp_path / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = read_report(tmp_path / "r.json")
    assert result["measured"]["bytes"] == result["predicted"]["bytes"]
    assert result["measured"]["memory_peak"] == result["predicted"]["memory_peak"]
    with h5py.File(tmp_path / "in.h5", "r") as f:
        a, b, c = f["A"][...], f["B"][...], f["C"][...]
    d = block(4, (EXTENTS["l"], EXTENTS["j"]), ((0, EXTENTS["l"]), (0, EXTENTS["j"])), "float64")
    expected = a @ b - 0.5 * (c @ d)
    with h5py.File(tmp_path / "out.h5", "r") as f:
        got = f["X"][...]
    assert np.max(np.abs(got - expected)) <= 1e-12 * np.max(np.abs(expected))
