"""What the on-disk caches share: where they live, how an entry is named, written and read.

The caches live in the user's cache folder, ``~/.cache/chainexec`` (:func:`root`), each in a
folder of its own that an environment variable of its own may name instead (:func:`folder`):

=========================  ==============================  ====================================
cache                      folder                          module
=========================  ==============================  ====================================
plans                      ``$CHAINEXEC_PLAN_CACHE``       :mod:`chainexec.plancache`
                           (default ``<root>/plans``)
CUBINs                     ``$CHAINEXEC_KERNEL_CACHE``     :mod:`chainexec.runtime.kernelcache`
                           (default ``<root>/kernels``)
autotuner's decisions      ``<kernel cache>/tuning``       :mod:`chainexec.runtime.backends.tuning`
warm-up's use log          ``<kernel cache>/uses.json``    :mod:`chainexec.runtime.uselog`
calibrations               ``$CHAINEXEC_CACHE``            :mod:`chainexec.machinecache`
                           (default ``<root>/machines``)
=========================  ==============================  ====================================

A :class:`Store` is a folder of entries, one file per key. A key is text that begins with the
store's format version (:meth:`Store.key`), and its SHA-256 names the file (:func:`digest`), so
that an entry of another version is another file, absent to this one. A file is written whole
(:func:`chainexec.atomicfile.write`): writers of one key at once leave one of their files, and a
reader never sees half of one. Each entry is written with the SHA-256 of its bytes, the file's
first line (:meth:`Store.save`), so that an entry changed after it was written (by hand, by
another program, by a failing disk) is told from one this code wrote even where it still parses:
trusted, it would fail every later run the same way. An entry that is missing, unreadable, does
not match its digest or is refused by its reader's parser is absent (:meth:`Store.load`), never
an error: a cache only saves work, and the next save replaces it. A store with a limit keeps the
entries used last and removes the temporary files of killed writers (:meth:`Store.prune`).

The plans, the CUBINs and the autotuner's decisions are stores (a CUBIN's key names the compiler
version instead of a store version, and keeps its own text; a CUBIN is read by CUDA from its path,
so its file holds the CUBIN alone and its digest is in a file beside it, :attr:`Store.plain`). Two
caches are not, and share only what fits them: the use log is one file that each process merges
its uses into (read, merge, replace whole), not an entry per key; the calibrations are machine
files named for people (host, GPU model and a digest), read with the machine file's own errors
(:func:`chainexec.machinecache.read`) and written by ``chainexec calibrate``, also to paths
outside the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from chainexec import atomicfile

T = TypeVar("T")

SHARED = 0o644
"""Permissions of the cache files other users of a node may read (the autotuner's decisions, the
use log and the calibrations); the other caches' files are private, as
:func:`chainexec.atomicfile.write` makes them."""
STALE = 86400
"""Age in seconds beyond which a temporary file in a store with a limit is a killed writer's, and
is removed."""
CHECK = ".sha256"
"""What the name of a :attr:`~Store.plain` entry's file adds for the file beside it that holds its
SHA-256."""
DIGEST = re.compile(r"[0-9a-f]{64}")
"""A file name made by :func:`digest` (less the store's suffix): only such entries are pruned, so
that other files in a cache's folder are left alone."""


def root() -> Path:
    """The folder of the caches: ``~/.cache/chainexec``."""
    return Path.home() / ".cache" / "chainexec"


def folder(name: str, env: str) -> Path:
    """The folder of cache ``name``: the one environment variable ``env`` names where it is set
    and not empty, else ``<root>/name`` (:func:`root`). Read at each call, so that a process (or a
    test) that sets the variable is followed at once."""
    return Path(os.environ.get(env) or root() / name)


def digest(text: str) -> str:
    """The SHA-256 of ``text`` in hex (64 characters): an entry's file name."""
    return hashlib.sha256(text.encode()).hexdigest()


def read(path: Path, parse: Callable[[str], T]) -> T | None:
    """``parse`` of the text of ``path``; None where the file is missing or unreadable, or
    :func:`parsed` refuses it."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return parsed(data, parse)


def parsed(data: bytes, parse: Callable[[str], T]) -> T | None:
    """``parse`` of ``data`` as UTF-8 text; None where it is not text or ``parse`` refuses it
    (:class:`ValueError`, as JSON's errors are, :class:`KeyError` or :class:`TypeError`: a damaged
    file, or one written by another version or program)."""
    try:
        return parse(data.decode())
    except (ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Store:
    """A cache of entries in ``folder``, one file per key: ``<name><suffix>``, the name the
    :func:`digest` of the key's text (:meth:`key`). ``version``: any JSON value, the first part
    of every key; a store made with another one reads none of this one's entries. ``mode``: the
    files' permissions (:data:`SHARED`, or None: private). ``limit``: the entries kept at most
    (files), or None for no limit. ``plain``: an entry's file holds its bytes alone and their
    SHA-256 is in the file beside it (:meth:`check`), for entries another program reads from
    their path (a CUBIN, which CUDA loads); else the digest is the file's first line. Two writers
    of one plain entry at once with different bytes may leave one's file and the other's digest:
    the entry is then absent until written again. The folder is made by the first :meth:`save`."""

    folder: Path
    version: object = None
    suffix: str = ".json"
    mode: int | None = None
    limit: int | None = None
    plain: bool = False

    def key(self, *parts) -> str:
        """The text of a key: the JSON array of the store's version and ``parts`` (JSON values)."""
        return json.dumps([self.version, *parts])

    def path(self, name: str) -> Path:
        """The file of entry ``name`` (whether it exists or not)."""
        return self.folder / f"{name}{self.suffix}"

    def check(self, name: str) -> Path:
        """The file beside a :attr:`plain` entry ``name``'s that holds its SHA-256."""
        return self.folder / f"{name}{self.suffix}{CHECK}"

    def find(self, name: str) -> bytes | None:
        """The bytes of entry ``name``, or None where its file (or a :attr:`plain` entry's
        :meth:`check` file) is missing or unreadable, or the SHA-256 written with it (:meth:`save`)
        is not that of its bytes: an entry changed since it was written, or written without one."""
        try:
            data = self.path(name).read_bytes()
            if self.plain:
                sealed = self.check(name).read_bytes()
            else:
                sealed, _, data = data.partition(b"\n")
        except OSError:
            return None
        return data if sealed == hashlib.sha256(data).hexdigest().encode() else None

    def load(self, name: str, parse: Callable[[str], T]) -> T | None:
        """Entry ``name`` as ``parse`` makes it from its text, or None where it is absent
        (:meth:`find`) or refused (:func:`parsed`). In a store with a limit, an entry found is
        marked as used now (its file's modification time), where the folder lets this process
        write."""
        data = self.find(name)
        found = None if data is None else parsed(data, parse)
        if found is not None and self.limit is not None:
            try:
                os.utime(self.path(name))
            except OSError:  # a cache this process may read but not write: the entry serves all the same
                pass
        return found

    def save(self, name: str, data: bytes | str) -> Path:
        """Write entry ``name`` whole (:func:`chainexec.atomicfile.write`) with the SHA-256 of its
        bytes (``data``, UTF-8 where text): the first line of its file, or a :attr:`plain`
        entry's :meth:`check` file, written after it (a reader between the two finds no entry).
        Returns its file; in a store with a limit, then :meth:`prune`. Raises :class:`OSError`
        where the folder cannot be written (a caller for whom the cache only saves work catches
        it)."""
        path = self.path(name)
        data = data.encode() if isinstance(data, str) else data
        sealed = hashlib.sha256(data).hexdigest().encode()
        if self.plain:
            atomicfile.write(path, data, self.mode)
            atomicfile.write(self.check(name), sealed, self.mode)
        else:
            atomicfile.write(path, sealed + b"\n" + data, self.mode)
        if self.limit is not None:
            self.prune()
        return path

    def prune(self) -> None:
        """Remove all but the :attr:`limit` entries used last (by modification time), and temporary
        files older than :data:`STALE` seconds (a process killed while writing). Only entries
        named by a digest (:data:`DIGEST`) are counted or removed (a :attr:`plain` one with its
        :meth:`check` file), and a file that cannot be removed (another user's, or gone meanwhile)
        is left."""
        used, now = [], time.time()
        try:
            files = list(self.folder.iterdir())
        except OSError:
            return
        for path in files:
            try:
                if path.name.endswith(self.suffix) and DIGEST.fullmatch(path.name[:-len(self.suffix)]):
                    used.append((path.stat().st_mtime, path))
                elif path.suffix == ".tmp" and now - path.stat().st_mtime > STALE:
                    path.unlink()
            except OSError:
                continue
        for _, path in sorted(used)[:max(0, len(used) - self.limit)]:
            try:
                path.unlink()
                if self.plain:
                    self.check(path.name[:-len(self.suffix)]).unlink()
            except OSError:
                continue
