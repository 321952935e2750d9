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

def write_then_wait(path, data, mode=None):
    written(path, data, mode)
    wait()

def inputs_then_wait(*args):  # the inputs renamed into place, the call not yet returned
    made_inputs(*args)
    wait()

written, made_inputs = job.atomicfile.write, job._write_inputs
if sys.argv[3] == "inputs renamed":
    job._write_inputs = inputs_then_wait
elif sys.argv[3] == "inputs written":
    job._config = config_once_written
elif sys.argv[3] == "config written":
    job.atomicfile.write = write_then_wait
else:
    job._write_inputs = wait
job.prepare("x", sys.argv[1], template=job.TEMPLATES["ccsd_t"], synthetic=(3, 5, 7))
"""


def _stopped(out: Path, ready: Path, when: str, number: int) -> subprocess.CompletedProcess:
    """The job :data:`STOPPED` into ``out``, sent signal ``number`` once it waits at ``when``
    (it makes the file ``ready`` then)."""
    proc = subprocess.Popen([sys.executable, "-c", STOPPED, str(out), str(ready), when],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), proc.communicate(timeout=10)
        proc.send_signal(number)
        out_text, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    ready.unlink()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out_text, err)


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("when", ["computing", "inputs written", "config written"])
def test_a_stopped_job_leaves_nothing(tmp_path, number, when):
    """Ctrl-C or a batch system's SIGTERM while a job computes its inputs, or once they are
    written and before the config is: the process ends with 128 + the signal's number and the
    folders it made (``out/job``) are gone with what it wrote in them, as after a failure. Once
    its config is written the job is complete, and a signal takes nothing of it."""
    out = tmp_path / "out" / "job"
    proc = _stopped(out, tmp_path / "ready", when, number)
    assert proc.returncode == 128 + number, proc.stderr
    if when == "config written":
        assert sorted(p.name for p in out.iterdir()) == ["ccsd_t.yaml", "inputs.h5"]
        assert job.prepare("x", out, template=job.TEMPLATES["ccsd_t"], synthetic=(3, 5, 7), missing=True).get("kept")
    else:
        assert list(tmp_path.iterdir()) == []


def test_a_stopped_job_leaves_no_stale_config(tmp_path):
    """A job run again into a folder of an earlier one, stopped once its new inputs replaced the
    earlier ones: neither the new inputs nor the earlier config (which described the inputs they
    replaced) stay, so the next ``chem --missing`` makes the job afresh instead of refusing half
    a job."""
    out = tmp_path / "job"
    job.prepare("x", out, template=job.TEMPLATES["ccsd_t"], synthetic=(3, 5, 7))
    assert _stopped(out, tmp_path / "ready", "inputs renamed", signal.SIGTERM).returncode == 143
    assert list(out.iterdir()) == []
    made = job.prepare("x", out, template=job.TEMPLATES["ccsd_t"], synthetic=(3, 5, 7), missing=True)
    assert not made.get("kept") and sorted(p.name for p in out.iterdir()) == ["ccsd_t.yaml", "inputs.h5"]


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


GEOMETRY = "3\nwater\nO 0 0 0.1173\nH 0 0.7572 -0.4692\nH 0 -0.7572 -0.4692\n"
"""An XYZ file of water, as a user gives the molecule to `chainexec chem`."""


def test_a_geometry_file_is_written_into_the_job_as_atoms(tmp_path, monkeypatch):
    """PySCF reads a geometry file; the job kept its path, which the computed layout's run read
    again from where it started (another file there: integrals of another molecule, exit 0),
    and ``--missing`` compared paths (an edited file: the old inputs kept). The file's atoms are
    the config's and the inputs'; run from another folder, the transform equals PySCF's of the
    file's molecule within 1e-12; the file edited, ``--missing`` refuses the old inputs."""
    h5py = pytest.importorskip("h5py")
    pytest.importorskip("pyscf")
    import numpy as np
    from pyscf import ao2mo, gto

    from tests.conftest import run_cli

    (tmp_path / "geo").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "geo" / "w.xyz").write_text(GEOMETRY)
    (tmp_path / "elsewhere" / "w.xyz").write_text(GEOMETRY.replace("0.7572 -0.4692", "0.9 -0.5"))
    monkeypatch.chdir(tmp_path / "geo")
    out = tmp_path / "job"
    job.prepare("w.xyz", out, template=job.TEMPLATES["ao2mo"], job="ao2mo", basis="sto-3g", layout="computed")
    assert "w.xyz" not in (out / "ao2mo.yaml").read_text()
    proc = run_cli("run", out / "ao2mo.yaml", "--quiet", cwd=tmp_path / "elsewhere")
    assert proc.returncode == 0, proc.stderr
    mol = gto.M(atom=GEOMETRY.split("\n", 2)[2].replace("\n", "; ").strip("; "), basis="sto-3g", unit="Angstrom")
    with h5py.File(out / "inputs.h5") as f, h5py.File(out / "output.h5") as g:
        expected = ao2mo.full(mol, f["C"][()], compact=True)
        assert np.max(np.abs(g["B"][()] - expected)) <= 1e-12 * np.max(np.abs(expected))
    (tmp_path / "elsewhere" / "sto-3g").write_text("O    S\n      3.9   1.0\n")  # PySCF would read it as the basis
    from tests.conftest import assert_refused

    assert_refused(run_cli("run", out / "ao2mo.yaml", "--quiet", cwd=tmp_path / "elsewhere"), "'sto-3g' is a file here")
    (tmp_path / "geo" / "w.xyz").write_text((tmp_path / "elsewhere" / "w.xyz").read_text())
    with pytest.raises(ChainexecError, match="made for another job: atoms"):
        job.prepare("w.xyz", out, template=job.TEMPLATES["ao2mo"], job="ao2mo", basis="sto-3g", layout="computed",
                    missing=True)


@pytest.mark.parametrize("given, needle", [("basis", "is a file here"), ("geometry", "no such geometry file")])
def test_a_basis_file_or_a_missing_geometry_file_is_one_line(tmp_path, monkeypatch, given, needle):
    """A basis given as a file (read again by a run from where it starts, and in place of
    PySCF's own basis of that name) is refused; a geometry file that is not there is named as
    such (PySCF read its name as an atom symbol)."""
    pytest.importorskip("pyscf")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sto-3g").write_text("O    S\n      1.0   1.0\n")
    molecule, basis = ("h2o", "sto-3g") if given == "basis" else ("gone.xyz", "sto-3g")
    if given == "geometry":
        (tmp_path / "sto-3g").unlink()
    with pytest.raises(ChainexecError, match=needle):
        job.prepare(molecule, tmp_path / "out", template=job.TEMPLATES["ao2mo"], job="ao2mo", basis=basis)
    assert not (tmp_path / "out").exists()
    if given == "basis":  # a folder of that name PySCF does not read: the job is made
        (tmp_path / "sto-3g").unlink()
        (tmp_path / "sto-3g").mkdir()
        job.prepare(molecule, tmp_path / "out", template=job.TEMPLATES["ao2mo"], job="ao2mo", basis=basis)
        assert (tmp_path / "out" / "ao2mo.yaml").is_file()
