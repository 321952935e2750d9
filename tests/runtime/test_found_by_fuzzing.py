"""Small chains on which a random-chain fuzzer (2026-11-23) made the planner or runtime crash;
each now runs on 1 and 2 ranks, moves exactly the predicted bytes and peaks, and passes
`chainexec verify` (numpy.einsum over the whole chain, no code shared with the runtime)."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import read_report, run_cli, write_config

CASES = {
    # A computed tensor (W from D) and its own input D in one contraction: D was loaded twice
    # under one buffer name (resident and streamed), and the second free failed in pricing.
    "computed tensor beside its input": """
        indices: {k: 2, m: 2}
        tensors:
          D: {indices: [m], source: {random: 1}}
          W: {indices: [m, k], source: {expr: "2 * D[m]"}}
        statements: ["T[k] = W[m,k] * D[m]"]
        machine: {global_memory: 1GiB, device_memory: 40}
        """,
    # A linear chain reading its intermediate under other index names: the fused loop tiled m,
    # which T0[j,i] reads as a whole range (no device buffer matched: StopIteration).
    "permuted read in a linear chain": """
        indices: {i: 2, j: 2, m: 2}
        tensors:
          C: {indices: [i, m], source: {random: 103}}
        statements: ["T0[m,i] = C[i,m]", "T3[j,m] = C[i,m] * T0[j,i]"]
        machine: {global_memory: 1GiB, device_memory: 73}
        """,
    "permuted copy of an intermediate": """
        indices: {i: 2, k: 2, l: 2, n: 2}
        tensors:
          A: {indices: [k, i, l], source: {random: 147}}
        statements: ["T0[k,l,n,i] = A[n,i,l] * A[k,i,l]", "T1[i,n,k,l] = T0[k,l,i,n]"]
        machine: {global_memory: 433, device_memory: 71}
        """,
    # Contractions over no index at all (0-d operands): no tiling was offered for them.
    "scalar times scalar": """
        indices: {i: 3}
        tensors:
          A: {indices: [i], source: {random: 1}}
        statements: ["T[] = A[i] * A[i]", "U[] = 2 * T[]"]
        machine: {global_memory: 1GiB, device_memory: 1GiB}
        """,
    "scalar times a dot product": """
        indices: {i: 3}
        tensors:
          A: {indices: [i], source: {random: 1}}
          B: {indices: [i], source: {random: 2}}
        statements: ["T[] = A[i] * A[i]", "U[] = T[] * B[i] * B[i]"]
        machine: {global_memory: 1GiB, device_memory: 1GiB}
        """,
}


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_runs_and_verifies(tmp_path, name, ranks):
    cfg = {"name": "fuzzed", **yaml.safe_load(CASES[name])}
    out = cfg["statements"][-1].split("[")[0]
    cfg["outputs"] = {out: {"file": "out.h5", "dataset": out}}
    config = write_config(tmp_path, cfg)
    proc = run_cli("run", config, "--quiet", "--report-json", tmp_path / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = read_report(tmp_path / "r.json")
    for key in ("bytes", "flops", "memory_peak"):
        assert report["measured"][key] == report["predicted"][key], key
    proc = run_cli("verify", config)
    assert proc.returncode == 0 and " ok" in proc.stdout, proc.stdout + proc.stderr
