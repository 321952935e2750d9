"""Tests of chainexec.chem.job: a job folder is made whole or not at all."""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


STOPPED = """
import sys, time
from chainexec import stopsignals
from chainexec.chem import job
stopsignals.watch(run=False)
real, calls = job._config, []

def wait(*args):
    open(sys.argv[2], "w").close()
    time.sleep(600)

def config_once_written(*args):  # its first call checks the template, before anything is made
    calls.append(args)
    return real(*args) if len(calls) == 1 else wait()

if sys.argv[3] == "inputs written":
    job._config = config_once_written
else:
    job._write_inputs = wait
job.prepare("x", sys.argv[1], template=job.TEMPLATES["ccsd_t"], synthetic=(3, 5, 7))
"""


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("when", ["computing", "inputs written"])
def test_a_stopped_job_leaves_nothing(tmp_path, number, when):
    """Ctrl-C or a batch system's SIGTERM while a job computes its inputs, or once they are
    written and before the config is: the process ends with 128 + the signal's number and the
    folders it made (``out/job``) are gone with what it wrote in them, as after a failure."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", STOPPED, str(tmp_path / "out" / "job"), str(ready), when],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), proc.communicate(timeout=10)
        proc.send_signal(number)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + number, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ready"]


@pytest.mark.parametrize("where", ["below a file", "in /proc"])
def test_an_out_folder_that_cannot_be_made_is_named_as_such(tmp_path, where):
    """``--out`` below a file, or in a file system where nothing can be made (``/proc``, which
    reports 0 bytes free), is refused before any work as a folder that cannot be made, not as a
    disk without room."""
    (tmp_path / "afile").write_text("a file of the user's")
    out = tmp_path / "afile" / "job" if where == "below a file" else Path("/proc/chainexec-test/job")
    with pytest.raises(ChainexecError, match=r"cannot create folder \((Not a directory|No such file or directory)\)"):
        job.prepare("x", out, template=job.TEMPLATES["ccsd_t"], synthetic=(3, 5, 7))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
