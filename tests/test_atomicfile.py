"""Files replaced whole: the new content or the old one, never half of one and no temporary file
left, whatever fails; the permissions asked for (the shared caches' 0o644, a user's files the
umask's)."""

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
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # private unless asked


def test_the_mode_asked_for(tmp_path):
    atomicfile.write(tmp_path / "f", "x", 0o644)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o644


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_users_file_gets_the_umasks_permissions(tmp_path, umask):
    """A report or config a user asked for is readable by others as the umask allows, no more
    (a report was 0o644 under umask 077) and no less."""
    old = os.umask(umask)
    try:
        atomicfile.write(tmp_path / "r.json", "{}", atomicfile.USER_FILE)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("where", ["write", "replace"])
def test_a_failure_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch, where):
    path = tmp_path / "f"
    atomicfile.write(path, "old")

    def full(*args, **kwargs):
        raise OSError("No space left on device")

    if where == "replace":
        monkeypatch.setattr(atomicfile.os, "replace", full)
    else:
        monkeypatch.setattr(atomicfile, "open", full, raising=False)  # the write itself fails
    with pytest.raises(OSError, match="No space"):
        atomicfile.write(path, "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f"]


def test_replacing_writes_a_new_file_and_renames_it_or_removes_it(tmp_path):
    """The temporary file is new (a user's ``out.h5.tmp`` stays), gets the umask's permissions,
    replaces the target when the block ends and is removed where it raises."""
    target = tmp_path / "out.h5"
    target.write_text("old")
    (tmp_path / "out.h5.tmp").write_text("the user's")
    old = os.umask(0o027)
    try:
        with atomicfile.replacing(target) as tmp:
            assert tmp.exists() and tmp.parent == tmp_path and tmp.name.startswith(".out.h5.")
            assert tmp.stat().st_mode & 0o777 == 0o640
            tmp.write_text("new")
    finally:
        os.umask(old)
    assert target.read_text() == "new" and (tmp_path / "out.h5.tmp").read_text() == "the user's"
    with pytest.raises(RuntimeError), atomicfile.replacing(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("stopped")
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out.h5", "out.h5.tmp"]


def test_durable_replacing_syncs_the_file_then_the_rename(tmp_path, monkeypatch):
    """With ``durable``, the new file's contents are flushed before the rename and the folder
    after it; the temporary file's name tells which file it was to replace."""
    synced = []
    monkeypatch.setattr(atomicfile, "sync", lambda path: synced.append((path, (tmp_path / "f").exists())))
    with atomicfile.replacing(tmp_path / "f", durable=True) as tmp:
        tmp.write_text("new")
        assert atomicfile.replaced(tmp.name) == "f"
    assert synced == [(tmp, False), (tmp_path, True)]
    with atomicfile.replacing(tmp_path / "g") as tmp:
        tmp.write_text("new")
    assert len(synced) == 2


@pytest.mark.parametrize("name", ["f", "f.tmp", ".f.tmp", ".f.1234567.tmp", ".f.12345678.tmpx", ".f.ABCDEF12.tmp"])
def test_other_names_are_no_temporary_files(name):
    assert atomicfile.replaced(name) is None
