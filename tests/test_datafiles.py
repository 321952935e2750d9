"""The files a dataset's values come from (:func:`chainexec.datafiles.of`), against the layouts
that put them in other files, built here with h5py."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from chainexec import datafiles
from tests.conftest import fourindex_config, run_cli, write_config


def test_a_plain_dataset_and_a_soft_link_lie_in_their_file(tmp_path):
    path = tmp_path / "in.h5"
    with h5py.File(path, "w") as f:
        f["A"] = np.random.default_rng(1).standard_normal(5)
        f["S"] = h5py.SoftLink("/A")
    assert datafiles.of(str(path), "A") == datafiles.of(str(path), "S") == [str(path)]


def test_links_virtual_sources_and_raw_storage_lead_to_their_files(tmp_path):
    """An external link to a virtual dataset whose sources are a plain dataset in a third file
    and a dataset with external raw storage in a fourth: every file, each once."""
    values = np.random.default_rng(2).standard_normal((2, 3))
    with h5py.File(tmp_path / "plain.h5", "w") as f:
        f["P"] = values[0]
    raw = tmp_path / "raw.bin"
    values[1].tofile(raw)
    with h5py.File(tmp_path / "ext.h5", "w") as f:
        f.create_dataset("E", shape=(3,), dtype="f8", external=[(str(raw), 0, 24)])
    layout = h5py.VirtualLayout(shape=(2, 3), dtype="f8")
    layout[0] = h5py.VirtualSource("plain.h5", "P", shape=(3,))
    layout[1] = h5py.VirtualSource("ext.h5", "E", shape=(3,))
    with h5py.File(tmp_path / "vds.h5", "w") as f:
        f.create_virtual_dataset("V", layout)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["L"] = h5py.ExternalLink("vds.h5", "V")
    with h5py.File(tmp_path / "in.h5", "r") as f:
        assert np.array_equal(f["L"][()], values)  # the layouts as built read the values
    found = datafiles.of(str(tmp_path / "in.h5"), "L")
    assert found[0] == str(tmp_path / "in.h5")
    assert sorted(os.path.basename(x) for x in found) == ["ext.h5", "in.h5", "plain.h5", "raw.bin", "vds.h5"]
    os.link(tmp_path / "plain.h5", tmp_path / "hard.h5")
    assert sorted(os.path.basename(x) for x in datafiles.of(str(tmp_path / "hard.h5"), "P")) == ["hard.h5"]


def test_the_data_files_of_an_output_are_its_shards(tmp_path):
    """A chainexec output read as an input: its file and the shard files its virtual dataset
    joins."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    assert run_cli("run", config, "--quiet").returncode == 0
    result = tmp_path / "out" / "result.h5"
    with h5py.File(result, "r") as f:
        sources = {os.path.realpath(result.parent / s.file_name) for s in f["B"].virtual_sources()}
    files = datafiles.of(str(result), "B")
    assert files[0] == str(result) and len(sources) > 0
    assert {os.path.realpath(x) for x in files[1:]} == sources


@pytest.mark.parametrize("text, said", [
    ("Unable to synchronously open file (unable to lock file, errno = 11, error message = 'Resource temporarily "
     "unavailable')", "open for writing in another program"),
    ("Unable to synchronously open file (unable to lock file, errno = 37, error message = 'No locks available')",
     "errno = 37, error message = 'No locks available'): where it takes no locks, set HDF5_USE_FILE_LOCKING=FALSE"),
    ("Unable to synchronously open file (file signature not found)", None)])
def test_a_refused_lock_is_told_by_its_errno(text, said):
    """HDF5 refuses a file for its lock where another program holds it (errno 11), and where the
    file system takes no locks (NFS without its lock daemon, errno 37 or 38), which no waiting
    mends: each is told as what it is, and any other error is left to its own message."""
    got = datafiles.lock_refusal(OSError(text))
    assert got is None if said is None else said in got


@pytest.mark.parametrize("files, refused", [(400, True), (1024, False)])
def test_a_virtual_dataset_over_more_files_than_a_process_may_open_is_refused(tmp_path, files, refused):
    """HDF5 holds a virtual dataset's source files open while it reads it and reads a source it
    cannot open as the fill value: over 300 files, a process that may open 200 reads NaN for a
    third of them. The check raises the soft limit to the hard one and refuses a dataset over
    more files than that leaves beside the run's own; under a limit that holds them, it passes,
    and the values read are the sources'."""
    import subprocess
    import sys

    layout = h5py.VirtualLayout((300, 4), "f8")
    for k in range(300):
        with h5py.File(tmp_path / f"p{k}.h5", "w") as f:
            f["a"] = np.full((1, 4), float(k))
        layout[k:k + 1] = h5py.VirtualSource(f"p{k}.h5", "a", shape=(1, 4))
    with h5py.File(tmp_path / "many.h5", "w") as f:
        f.create_virtual_dataset("A", layout, fillvalue=np.nan)
    check = ("import resource, sys, h5py; from chainexec import datafiles, errors; "
             "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2]))); "
             "f = h5py.File(sys.argv[1], 'r')\n"
             "try:\n    datafiles.check_virtual(f['A'], sys.argv[1], 'a test')\n"
             "except errors.ChainexecError as err:\n    print(err); sys.exit(2)\n"
             "print(f['A'][()].sum())")
    proc = subprocess.run([sys.executable, "-c", check, str(tmp_path / "many.h5"), str(files)], capture_output=True,
                          text=True, timeout=120)
    if refused:
        assert proc.returncode == 2 and "over 300 source files" in proc.stdout and "(ulimit -n)" in proc.stdout
    else:
        assert proc.returncode == 0 and float(proc.stdout) == 4 * sum(range(300)), proc.stdout + proc.stderr


@pytest.mark.parametrize("count, expected", [(h5py.h5s.UNLIMITED, [{0}, {0, 2, 4, 6, 8}]), (3, [{0}, {0, 2, 4}]),
                                             (1, [{0}, {0}])])
def test_the_chunks_a_strided_mapping_touches(count, expected):
    """A regular hyperslab's chunks, axis by axis: blocks of 2 columns every 4 over chunks of
    2 touch every other chunk; an unlimited count (HDF5's 2⁶⁴ - 1) reaches as far as the
    dataset's 20 columns (it was taken as that many blocks: the check never ended)."""
    space = h5py.h5s.create_simple((4, 20), (4, h5py.h5s.UNLIMITED))
    space.select_hyperslab((0, 0), (1, count), (1, 4), (4, 2))
    assert datafiles._touched(space, (4, 2), (4, 20)) == expected
