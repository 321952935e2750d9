"""chainexec.api.run in this process (one rank, NumPy): what a failure leaves."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from chainexec import api
from chainexec.errors import ChainexecError
from chainexec.runtime import uselog
from tests.conftest import fourindex_config, run_cli, write_config


def test_a_failure_after_the_output_is_complete_keeps_its_values(tmp_path, monkeypatch):
    """An error raised once the executor has written the output complete (here by the run's
    last step, the warm-up log's flush) leaves that output whole: its values lie in its parts
    folder, which stays; the scratch folder goes as a finished run's does."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0

    def fail():
        raise ChainexecError("the warm-up log cannot be written")

    monkeypatch.setattr(uselog, "flush", fail)
    with pytest.raises(ChainexecError, match="warm-up log"):
        api.run(config, backend="numpy")
    with h5py.File(tmp_path / "out" / "result.h5", "r") as f:
        assert f.attrs["chainexec_complete"]
        values = f["B"][...]
    assert values.size and np.isfinite(values).all()
    assert not (tmp_path / "out" / ".fourindex.scratch").exists()
