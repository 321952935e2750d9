"""Files replaced whole: the new content or the old one, never half of one and no temporary file
left, whatever fails; the permissions asked for (the shared caches' 0o644)."""

from __future__ import annotations

import os
import stat

import pytest

from chainexec import atomicfile


@pytest.mark.parametrize("data", [b"\x00cubin\xff", "{\"key\": 1}"], ids=["bytes", "text"])
def test_a_file_is_written_whole_in_a_new_folder(tmp_path, data):
    path = tmp_path / "a" / "b" / "f"
    atomicfile.write(path, data)
    assert (path.read_bytes() if isinstance(data, bytes) else path.read_text()) == data
    assert os.listdir(path.parent) == ["f"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # mkstemp's: private unless asked


def test_the_mode_asked_for(tmp_path):
    atomicfile.write(tmp_path / "f", "x", 0o644)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o644


@pytest.mark.parametrize("where", ["write", "replace"])
def test_a_failure_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch, where):
    path = tmp_path / "f"
    atomicfile.write(path, "old")

    def full(*args, **kwargs):
        raise OSError("No space left on device")

    if where == "replace":
        monkeypatch.setattr(atomicfile.os, "replace", full)
    else:
        monkeypatch.setattr(atomicfile.os, "fdopen", lambda fd, mode: os.close(fd) or full())
    with pytest.raises(OSError, match="No space"):
        atomicfile.write(path, "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f"]
