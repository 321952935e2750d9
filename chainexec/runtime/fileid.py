"""What identifies a file's content for a checkpoint: its stamp (cheap, from ``stat``) and a
digest of its bytes (read once). A file whose stamp is unchanged is taken as unchanged; one
whose stamp changed (a copy, a touch) is taken as unchanged where its digest is. Used for the
input files a checkpoint's partial sums came from and for the shard files it names
(:mod:`chainexec.runtime.checkpoint`)."""

from __future__ import annotations

import hashlib
import os


def stamp(path: str) -> list[int]:
    """What changes whenever a file's bytes do: size, modification and change times (the change
    time cannot be set back by a user) and inode. Not the device number: a shared file system's
    differs from one node's mount to another's, and a resumed job runs on other nodes."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


CHUNK = 16 << 20
"""Bytes of a file hashed as one piece (:func:`content_digest`)."""
THREADS = 4
"""Most threads that hash a file's pieces at once: each holds one piece in memory, beside the
run's own buffers on every rank that seals shard files."""


def content_digest(path: str) -> str:
    """SHA-256 over the SHA-256 of each :data:`CHUNK` bytes of the file, the chunks hashed on up to
    :data:`THREADS` of the CPUs this process may use (hashlib releases the GIL): a file's identity
    by content, read once at disk or page-cache speed."""
    from concurrent.futures import ThreadPoolExecutor

    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        def one(offset: int) -> bytes:
            return hashlib.sha256(os.pread(fd, CHUNK, offset)).digest()

        with ThreadPoolExecutor(min(THREADS, len(os.sched_getaffinity(0)))) as pool:
            parts = list(pool.map(one, range(0, size, CHUNK)))
    finally:
        os.close(fd)
    return hashlib.sha256(b"".join(parts) + str(size).encode()).hexdigest()


def identity(path: str) -> dict:
    """The record of a file: ``{"stamp": stamp(path), "sha256": content_digest(path)}``."""
    return {"stamp": stamp(path), "sha256": content_digest(path)}


def is_record(record) -> bool:
    """Whether ``record`` has the shape :func:`identity` gives (read from a JSON file)."""
    return (isinstance(record, dict) and set(record) == {"stamp", "sha256"} and isinstance(record["sha256"], str)
            and isinstance(record["stamp"], list) and len(record["stamp"]) == 4
            and all(type(x) is int for x in record["stamp"]))


def unchanged(path: str, record: dict) -> bool:
    """Whether the file at ``path`` holds what it held when ``record`` was made: its stamp
    unchanged, or else its digest; where the digest is, ``record`` takes the new stamp, so that
    the next look is by stamp again."""
    now = stamp(path)
    if now == record["stamp"]:
        return True
    if content_digest(path) != record["sha256"]:
        return False
    record["stamp"] = now
    return True
