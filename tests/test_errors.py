"""What the machine refuses a correct run (a full disk, a quota, too little memory) reaches the
user as one line naming the file (:func:`chainexec.errors.of_machine`); anything else stays a
defect with its traceback."""

from __future__ import annotations

import errno

import h5py
import numpy as np
import pytest

from chainexec.errors import MACHINE_ERRNOS, ChainexecError, of_machine, say


@pytest.mark.parametrize("code", sorted(MACHINE_ERRNOS))
def test_an_os_error_of_the_machine_is_one_line_naming_its_file(code):
    err = of_machine(OSError(code, "refused", "/scratch/out.h5.parts/B.v1/rank0.h5"))
    assert isinstance(err, ChainexecError) and "\n" not in str(err)
    assert str(err) == f"/scratch/out.h5.parts/B.v1/rank0.h5: {MACHINE_ERRNOS[code]} (errno {code})"


def test_the_file_hdf5s_message_names_is_the_one_named(tmp_path):
    """HDF5's error of a failed write gives no ``filename`` but names the file in its message,
    over several lines."""
    message = ("Unable to synchronously create file (file write failed: time = Sat Dec  5 21:37:28 2026\n"
               f", filename = '{tmp_path}/o.h5.parts/B.v1.h5.tmp', file descriptor = 23, errno = 28, "
               "error message = 'No space left on device', buf = 0x7f, total write size = 96)")
    err = of_machine(OSError(errno.ENOSPC, message))
    assert str(err) == f"{tmp_path}/o.h5.parts/B.v1.h5.tmp: the disk is full (errno {errno.ENOSPC})"


def test_numpys_allocation_failure_is_one_line():
    with pytest.raises(MemoryError) as failed:
        np.empty((2**20, 2**20, 2**20), dtype=np.uint8)
    err = of_machine(failed.value)
    assert isinstance(err, ChainexecError) and "out of host memory" in str(err) and "\n" not in str(err)


def test_a_memory_error_without_words_says_an_allocation_failed():
    assert "out of host memory (an allocation failed; for a run" in str(of_machine(MemoryError()))


@pytest.mark.parametrize("err", [OSError(errno.ENOENT, "No such file", "x.h5"), OSError("no errno"),
                                 ValueError("a defect"), KeyError("B")], ids=repr)
def test_anything_else_is_not_the_machines(err):
    assert of_machine(err) is None


def test_hdf5_errors_on_a_file_keep_their_errno(tmp_path):
    """The errno :func:`of_machine` reads is set on HDF5's errors of the operating system."""
    (tmp_path / "sub").mkdir()
    with pytest.raises(OSError) as failed:
        h5py.File(tmp_path / "sub" / ("x" * 300 + ".h5"), "w")
    assert failed.value.errno == errno.ENAMETOOLONG and of_machine(failed.value) is not None


def test_a_line_said_is_one_write_where_the_stream_is_unbuffered(monkeypatch):
    """Under PYTHONUNBUFFERED (or ``python -u``, as batch scripts often run Python) ``print``
    writes a line's text and its newline in two writes, and the lines of ranks that fail at
    once ran together where the launcher joins their streams; a line said is one write."""
    import io
    import sys

    class Raw(io.RawIOBase):
        def __init__(self):
            self.writes = []

        def writable(self):
            return True

        def write(self, b):
            self.writes.append(bytes(b))
            return len(b)

    raw = Raw()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))
    print("chainexec: rank 1: printed", file=sys.stderr, flush=True)
    assert len(raw.writes) == 2  # what an unbuffered stream does with print
    raw.writes.clear()
    say("chainexec: rank 1: said")
    assert raw.writes == [b"chainexec: rank 1: said\n"]

