"""A file's identity for a checkpoint (:mod:`chainexec.runtime.fileid`): its stamp, and its
digest where the stamp changed."""

from __future__ import annotations

import hashlib
import os

from chainexec.runtime import fileid


def test_the_digest_is_of_the_pieces_hashed_in_order(tmp_path, monkeypatch):
    """Independently: SHA-256 over each piece's SHA-256 and the size, whatever the threads."""
    monkeypatch.setattr(fileid, "CHUNK", 1000)
    data = os.urandom(4321)
    (tmp_path / "f").write_bytes(data)
    pieces = b"".join(hashlib.sha256(data[k:k + 1000]).digest() for k in range(0, len(data), 1000))
    assert fileid.content_digest(str(tmp_path / "f")) == hashlib.sha256(pieces + b"4321").hexdigest()


def test_a_copy_back_is_unchanged_and_takes_the_new_stamp(tmp_path):
    """A file copied back whole (its stamp new, its bytes the same) is unchanged, and its record
    takes the new stamp; a byte changed is not. The stamp holds no device number (a shared file
    system's differs between the nodes that mount it)."""
    path = tmp_path / "shard.h5"
    data = os.urandom(100_000)
    path.write_bytes(data)
    record, st = fileid.identity(str(path)), os.stat(path)
    assert fileid.is_record(record) and record["stamp"] == [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    path.unlink()
    path.write_bytes(data)
    old = list(record["stamp"])
    assert fileid.unchanged(str(path), record) and record["stamp"] == fileid.stamp(str(path)) != old
    path.write_bytes(data[:50_000] + bytes([data[50_000] ^ 1]) + data[50_001:])
    assert not fileid.unchanged(str(path), record)
