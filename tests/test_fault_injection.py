"""Faults injected from outside a correct config: the process's file size limit, FIFOs and
devices where chainexec expects files, HDF5 links it cannot follow or that lead out of the copy
``generate`` writes, an input it may not read, PySCF's errors of its background threads. Each is
one line naming the file and the problem, exit status 2, no traceback, no hang, and nothing left
that looks complete."""

from __future__ import annotations

import errno
import hashlib
import os
import resource
import subprocess
import sys

import h5py
import numpy as np
import pytest

from tests.conftest import assert_refused, fourindex_config, run_cli, write_config

FSIZE_LIMIT = 10 << 20
"""The file size limit the first tests run under: above what MPI's start writes (UCX's shared
memory files, about 4 MiB), below the output and the inputs."""


def _limited(*args, cwd) -> subprocess.CompletedProcess:
    """``chainexec ARGS`` in a process whose files may grow to :data:`FSIZE_LIMIT` bytes at most
    (``ulimit -f``; Python ignores SIGXFSZ, so a write beyond it fails with EFBIG)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, resource.RLIM_INFINITY))

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "chainexec.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env, preexec_fn=limit)


def _large_config(tmp_path):
    """A four-index transform whose input file (20 MB) and output (13 MB) exceed :data:`FSIZE_LIMIT`."""
    return write_config(tmp_path, fourindex_config(n=40, nmo=36, global_memory="64MiB", device_memory="4MiB"))


def test_generate_beyond_the_file_size_limit_is_one_line(tmp_path):
    """``generate`` past the file size limit: h5py's close of the file whose write failed raises
    a RuntimeError of its own over the OSError (EFBIG); the line says the file is too large, status 2."""
    config = _large_config(tmp_path)
    proc = _limited("generate", config, cwd=tmp_path)
    assert_refused(proc, "in.h5", "cannot write the inputs", "File too large")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain.yaml"]  # no input, no temporary file


def test_a_run_beyond_the_file_size_limit_is_one_line(tmp_path):
    """A run past the file size limit: EFBIG is one of the machine's errors
    (:data:`chainexec.errors.MACHINE_ERRNOS`), one line and status 2."""
    config = _large_config(tmp_path)
    assert run_cli("generate", config).returncode == 0
    proc = _limited("run", config, "--quiet", cwd=tmp_path)
    assert_refused(proc, "out/result.h5.parts", "file size limit (ulimit -f)", f"errno {errno.EFBIG}")
    assert not (tmp_path / "out" / "result.h5").exists()


@pytest.fixture
def generated(tmp_path):
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    return config


def _no_wait(*args, cwd=None) -> subprocess.CompletedProcess:
    """``chainexec ARGS`` in a process of its own (not the warm fork), killed at its timeout: a
    process blocked opening a FIFO inside HDF5 holds the interpreter's lock, and SIGTERM does
    not end it."""
    return run_cli(*args, timeout=60, cwd=cwd, env={"CHAINEXEC_TEST_OWN_PROCESS": "1"})


@pytest.mark.parametrize("option", ["--report-json", "--plot"])
def test_a_report_file_that_is_a_fifo_is_refused_and_kept(option, generated, tmp_path):
    """A report file is renamed onto its name: a FIFO (or, for a user who may write ``/dev``, a
    device such as ``/dev/null``) there is refused before the run, not replaced by a file."""
    fifo = tmp_path / "report"
    os.mkfifo(fifo)
    assert_refused(_no_wait("run", generated, "--quiet", option, fifo), str(fifo), "is a FIFO, not a file", option)
    assert fifo.is_fifo()
    assert not (tmp_path / "out" / "result.h5").exists()


def test_calibrate_into_a_fifo_is_refused(tmp_path):
    fifo = tmp_path / "machine.json"
    os.mkfifo(fifo)
    assert_refused(_no_wait("calibrate", fifo), str(fifo), "is not a file")
    assert fifo.is_fifo()


def test_verify_refuses_an_output_that_is_a_fifo(generated, tmp_path):
    """``verify`` of an output that is a FIFO: refused before HDF5's open, which would wait for a
    writer for ever."""
    (tmp_path / "out").mkdir()
    os.mkfifo(tmp_path / "out" / "result.h5")
    assert_refused(_no_wait("verify", generated), "result.h5", "is a FIFO, not a file", "output of B")


def test_a_virtual_input_whose_source_is_a_fifo_is_refused(generated, tmp_path):
    """A virtual input whose source is a FIFO: refused before the check opens the source, an
    open that would wait for ever."""
    with h5py.File(tmp_path / "in.h5", "a") as f:
        a = f["A"][()]
        del f["A"]
        layout = h5py.VirtualLayout(shape=a.shape, dtype=a.dtype)
        layout[...] = h5py.VirtualSource("source.h5", "A", shape=a.shape)
        f.create_virtual_dataset("A", layout)
    os.mkfifo(tmp_path / "source.h5")
    assert_refused(_no_wait("run", generated, "--quiet"), "source.h5", "is a FIFO, not a file", "input of tensor A")


@pytest.mark.parametrize("command", ["plan", "run", "verify", "generate"])
def test_an_input_behind_an_external_link_to_a_fifo_is_refused(command, generated, tmp_path):
    """Every command follows an input's external link (:func:`chainexec.datafiles.of`): one to a
    FIFO is refused before it is followed, an open that would wait for a writer for ever, deaf to
    SIGTERM."""
    with h5py.File(tmp_path / "in.h5", "a") as f:
        del f["A"]
        f["A"] = h5py.ExternalLink("linked.h5", "A")
    os.mkfifo(tmp_path / "linked.h5")
    args = ["--quiet"] if command == "run" else []
    assert_refused(_no_wait(command, generated, *args), "linked.h5", "is a FIFO, not a file", "external link 'A'")


@pytest.mark.parametrize("link", ["soft", "external"])
def test_generate_refuses_a_link_it_cannot_follow(link, generated, tmp_path):
    """A dangling link where the dataset is to be written: one line naming it, no KeyError's
    traceback, the file as it was."""
    with h5py.File(tmp_path / "in.h5", "a") as f:
        del f["A"]
        f["A"] = h5py.SoftLink("/nowhere") if link == "soft" else h5py.ExternalLink("nowhere.h5", "A")
    before = (tmp_path / "in.h5").read_bytes()
    assert_refused(run_cli("generate", generated), "in.h5", "'A' (on the way to dataset 'A' of tensor A)")
    assert (tmp_path / "in.h5").read_bytes() == before


def test_generate_does_not_write_through_an_external_link(tmp_path):
    """``generate`` does not write a dataset behind an external link, whose values would go into
    the linked file in place, outside the copy it renames into place: a failure at a later file
    (here a group where a dataset is to be written) leaves every file as it was."""
    config = fourindex_config()
    config["tensors"]["C"]["source"]["file"] = "in2.h5"
    config = write_config(tmp_path, config)
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["A"] = np.zeros((10,) * 4)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["A"] = h5py.ExternalLink("other.h5", "A")
    with h5py.File(tmp_path / "in2.h5", "w") as f:
        f.create_group("C")
    digest = hashlib.sha256((tmp_path / "other.h5").read_bytes()).hexdigest()
    proc = run_cli("generate", config)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert hashlib.sha256((tmp_path / "other.h5").read_bytes()).hexdigest() == digest


def test_generate_opens_no_file_an_external_link_on_the_way_names(tmp_path):
    """A dataset ``e/A`` where ``e`` is an external link to a group of another file: refused at
    ``e``, and that file is not opened (a look past the link would open it read-write and change
    its modification time)."""
    config = fourindex_config()
    config["tensors"]["A"]["source"]["dataset"] = "e/A"
    config = write_config(tmp_path, config)
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f.create_group("g")
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["e"] = h5py.ExternalLink("other.h5", "g")
    os.utime(tmp_path / "other.h5", (1577836800, 1577836800))
    assert_refused(run_cli("generate", config), "in.h5",
                   "'e' (on the way to dataset 'e/A' of tensor A) is an external link")
    assert (tmp_path / "other.h5").stat().st_mtime == 1577836800


def test_generate_refuses_an_input_it_cannot_read_in_one_line(generated, monkeypatch):
    """An existing input file that cannot be read (its permissions; root reads any, so the
    refusal is simulated): ``h5py.is_hdf5``'s PermissionError is one line, no traceback."""
    from chainexec import safepaths, spec

    def unreadable(path):
        raise PermissionError(errno.EACCES, "Unable to determine if file is accessible as hdf5", str(path))

    monkeypatch.setattr(h5py, "is_hdf5", unreadable)
    with pytest.raises(safepaths.ChainexecError) as refused:
        safepaths.check_generate(spec.load(generated))
    assert "in.h5: cannot read it (Permission denied; input of tensor" in str(refused.value)


def test_pyscfs_error_of_a_background_thread_names_what_went_wrong():
    """PySCF's error of a background thread is ``Error on thread <...>:`` and, below it, the
    thread's error: the line shows the thread's error, which names the file and the problem."""
    from chainexec.chem import bridge

    err = RuntimeError("Error on thread <pyscf.lib.misc.call_in_background object at 0x7f>:\n"
                       "[Errno 27] Can't synchronously write data (file write failed: time = Mon Dec  7 2026\n"
                       ", filename = '/tmp/udyl3g16', errno = 27, error message = 'File too large')")
    line = bridge.first_line(err)
    assert "\n" not in line and "File too large" in line and "/tmp/udyl3g16" in line
    assert bridge.first_line(RuntimeError("one\ntwo")) == "one"


def test_generate_refuses_an_input_below_a_file(tmp_path):
    """An input named below a file (``chain.yaml/in.h5``): refused naming the file it would lie
    below, not with the folder's 'File exists'."""
    config = fourindex_config()
    for t in ("A", "C"):
        config["tensors"][t]["source"]["file"] = "chain.yaml/in.h5"
    config = write_config(tmp_path, config)
    assert_refused(run_cli("generate", config), "chain.yaml/in.h5", "lies below", "which is a file, not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain.yaml"]
