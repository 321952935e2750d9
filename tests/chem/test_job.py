"""Tests of chainexec.chem.job: a job folder is made whole or not at all."""

import errno

import pytest

from chainexec.chem import job
from chainexec.errors import ChainexecError


def test_a_config_that_cannot_be_written_leaves_no_inputs(tmp_path, monkeypatch):
    """The inputs written, the config refused by a full disk: neither is left (inputs without
    their config made every later ``chem --missing`` into the folder refuse it), nor the folder
    the call made; the same call with room makes both."""
    def full(path, data, mode=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "job"
    with monkeypatch.context() as patch:
        patch.setattr(job.atomicfile, "write", full)
        with pytest.raises(ChainexecError, match="cannot write the config"):
            job.prepare("x", out, template=job.TEMPLATES["ccsd_t"], synthetic=(3, 5, 7))
    assert list(tmp_path.iterdir()) == []
    made = job.prepare("x", out, template=job.TEMPLATES["ccsd_t"], synthetic=(3, 5, 7), missing=True)
    assert sorted(p.name for p in out.iterdir()) == ["ccsd_t.yaml", "inputs.h5"] and not made.get("kept")
