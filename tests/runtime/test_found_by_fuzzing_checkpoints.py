"""Checkpointed runs that a checkpoint/resume fuzzer stopped and resumed: each ends
as the same run uninterrupted ends (an uninterrupted run of the same config is the reference)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import yaml

from tests.conftest import run_cli, write_config

NONFINITE = """
    name: nonfinite
    indices: {i: 7, j: 5}
    tensors:
      A: {indices: [i, j], source: {file: in.h5, dataset: A, seed: 1}}
    statements: ["B[j,i] = 2 * A[i,j]"]
    outputs:
      B: {file: out.h5, dataset: B}
    machine: {global_memory: 200, device_memory: 64}
    """
"""A store loop of 14 iterations ([j:3, i:1]); A[0, 0], and so B[0, 0], in its first."""


def _refused_as_nonfinite(proc, count: int) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert f"output B holds {count} values that are not finite (inf or NaN) of 35" in proc.stderr.splitlines()[0]


@pytest.mark.parametrize("ranks", [1, 2])
def test_values_not_finite_written_before_a_checkpoint(tmp_path, ranks):
    """An output whose one NaN was written before the checkpoint a run stopped at: the resumed
    run, which writes only finite values itself, counted none and renamed the output into place
    marked complete, NaN and all, with status 0 (the uninterrupted run refuses it, status 2).
    The checkpoint now carries the count; the resumed run refuses the output as the
    uninterrupted one does, naming the same count."""
    config = write_config(tmp_path, yaml.safe_load(NONFINITE))
    assert run_cli("generate", config).returncode == 0
    with h5py.File(tmp_path / "in.h5", "a") as f:
        f["A"][0, 0] = np.nan
    _refused_as_nonfinite(run_cli("run", config, "--quiet", ranks=ranks), 1)
    assert not (tmp_path / "out.h5").exists()
    folder = tmp_path / "ck"
    stopped = run_cli("run", config, "--quiet", "--checkpoint", folder, "--stop-after", 0, ranks=ranks)
    assert stopped.returncode == 3, stopped.stderr
    manifest = json.loads((folder / "checkpoint.json").read_text())
    assert (manifest["position"], manifest["done"]) == (0, 1), manifest  # B[0, 0] is written
    _refused_as_nonfinite(run_cli("run", config, "--quiet", "--checkpoint", folder, ranks=ranks), 1)
    assert not (tmp_path / "out.h5").exists()
