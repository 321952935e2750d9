"""The caches' common store (:mod:`chainexec.diskstore`): an entry read back as written; another
version's entries, and missing, damaged (also where they still parse) or foreign files, are
absent, never an error; writers of one key at once leave one whole file; a store with a limit
keeps the entries used last; each cache's folder is its variable's, else under the user's cache
folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from hashlib import sha256

import pytest

from chainexec import diskstore, machinecache, plancache
from chainexec.diskstore import Store, digest
from chainexec.runtime import kernelcache, uselog


def test_an_entry_round_trips(tmp_path):
    store = Store(tmp_path / "a" / "store", version=3)
    name = digest(store.key("contraction", [1, 2], {"dtype": "float64"}))
    assert len(name) == 64 and store.load(name, json.loads) is None
    assert store.save(name, json.dumps({"method": "gett"})) == store.path(name)
    assert store.load(name, json.loads) == {"method": "gett"}
    assert os.listdir(store.folder) == [f"{name}.json"]  # no temporary file left
    cubins = Store(tmp_path / "b", suffix=".cubin", plain=True)
    assert cubins.save(name, b"\x7fELF\x00").read_bytes() == b"\x7fELF\x00"  # the bytes alone, for CUDA
    assert cubins.path(name).name == f"{name}.cubin" and cubins.find(name) == b"\x7fELF\x00"
    assert sorted(os.listdir(cubins.folder)) == [f"{name}.cubin", f"{name}.cubin.sha256"]
    assert cubins.check(name).read_text() == sha256(b"\x7fELF\x00").hexdigest()


def test_a_key_begins_with_the_version():
    assert Store(".", version=7).key("GPU", "c1") == json.dumps([7, "GPU", "c1"])


def test_another_version_reads_none_of_the_entries(tmp_path):
    old, new = Store(tmp_path, version=1), Store(tmp_path, version=2)
    old.save(digest(old.key("c")), '"old"')
    assert new.load(digest(new.key("c")), json.loads) is None
    new.save(digest(new.key("c")), '"new"')
    assert old.load(digest(old.key("c")), json.loads) == "old"  # each version its own file
    assert new.load(digest(new.key("c")), json.loads) == "new"


def _entry(text: str) -> dict:
    entry = json.loads(text)
    return {"method": entry["choice"]["method"]}


@pytest.mark.parametrize("data", [b"", b'{"choice": {"meth', b"\xff\xfe not text", b"[1, 2]", b'{"other": 1}',
                                  b'{"choice": 3}'],
                         ids=["empty", "half", "binary", "list", "foreign", "wrong-type"])
def test_a_foreign_entry_is_absent(tmp_path, data):
    """An entry whose digest matches but that its reader refuses: not text, or not what it
    parses."""
    store = Store(tmp_path)
    store.save("e", b'{"choice": {"method": "ttgt"}}')
    assert store.load("e", _entry) == {"method": "ttgt"}
    store.save("e", data)
    assert store.find("e") == data and store.load("e", _entry) is None
    store.save("e", b'{"choice": {"method": "einsum"}}')  # replaced by the next save
    assert store.load("e", _entry) == {"method": "einsum"}


@pytest.mark.parametrize("plain", [False, True], ids=["digest-first", "digest-beside"])
@pytest.mark.parametrize("damage", ["edited", "truncated", "emptied", "digest-lost", "digest-edited"])
def test_an_entry_changed_after_it_was_written_is_absent(tmp_path, plain, damage):
    """An entry whose bytes are not those its digest was made of, even one edited so that it still
    parses as its reader wants, is absent, as is one without its digest (a file written by hand, or
    by a version that wrote none); the next save replaces it."""
    store = Store(tmp_path, plain=plain)
    store.save("e", b'{"choice": {"method": "ttgt"}}')
    path, check = store.path("e"), store.check("e") if plain else None
    data = path.read_bytes()
    if damage == "edited":
        path.write_bytes(data.replace(b"ttgt", b"gett"))  # still the JSON its reader takes
    elif damage == "truncated":
        path.write_bytes(data[:-1])
    elif damage == "emptied":
        path.write_bytes(b"")
    elif damage == "digest-lost":
        check.unlink() if plain else path.write_bytes(data.partition(b"\n")[2])
    else:
        (check or path).write_bytes(b"0" * 64 + (b"" if plain else data[64:]))
    assert store.find("e") is None and store.load("e", _entry) is None
    store.save("e", b'{"choice": {"method": "einsum"}}')
    assert store.load("e", _entry) == {"method": "einsum"}


def test_an_unreadable_entry_is_absent(tmp_path):
    store = Store(tmp_path)
    store.path("d").mkdir()  # a folder where the file would be
    assert store.load("d", json.loads) is None
    assert diskstore.read(tmp_path / "missing" / "x.json", json.loads) is None


WRITER = """
import sys
from pathlib import Path
from chainexec.diskstore import Store
store, mark = Store(Path(sys.argv[1])), sys.argv[2]
for n in range(int(sys.argv[3])):
    store.save("same", mark * (1 << 20))
"""


def test_writers_of_one_key_at_once_leave_one_whole_file(tmp_path):
    """Two processes save the same key over and over, each its own 1 MiB; a reader meanwhile and
    afterwards finds nothing or one writer's whole entry, never a mixture or a part."""
    store = Store(tmp_path)
    wholes = {mark * (1 << 20) for mark in "ab"}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), mark, "40"]) for mark in "ab"]
    while any(w.poll() is None for w in writers):
        found = store.load("same", str)
        if found is not None:
            assert found in wholes
    assert [w.wait() for w in writers] == [0, 0]
    assert store.load("same", str) in wholes
    assert os.listdir(tmp_path) == ["same.json"]  # no temporary file left behind


def test_a_limited_store_keeps_the_entries_used_last(tmp_path):
    """Beyond the limit, a save removes the entries read or written longest ago; files not named
    by a digest, and temporary files younger than a day, are left alone."""
    store = Store(tmp_path, limit=2)
    (tmp_path / "notes.json").write_text("{}")
    (tmp_path / "fresh.tmp").write_text("")
    (tmp_path / "stale.tmp").write_text("")
    os.utime(tmp_path / "stale.tmp", (1000, 1000))
    a, b, c = (digest(n) for n in "abc")
    for n, name in enumerate((a, b)):
        store.save(name, "1")
        os.utime(store.path(name), (1000 + n, 1000 + n))
    # within the limit: no entry removed; the day-old temporary file is
    assert sorted(os.listdir(tmp_path)) == sorted([f"{a}.json", f"{b}.json", "notes.json", "fresh.tmp"])
    assert store.load(a, json.loads) == 1 and store.path(a).stat().st_mtime > time.time() - 60  # marked as used
    store.save(c, "1")
    assert sorted(os.listdir(tmp_path)) == sorted([f"{a}.json", f"{c}.json", "notes.json", "fresh.tmp"])


def test_a_limited_plain_store_removes_an_entry_with_its_digest(tmp_path):
    store = Store(tmp_path, suffix=".cubin", limit=1, plain=True)
    a, b = digest("a"), digest("b")
    store.save(a, b"1")
    os.utime(store.path(a), (1000, 1000))
    store.save(b, b"2")
    assert sorted(os.listdir(tmp_path)) == [f"{b}.cubin", f"{b}.cubin.sha256"]


def test_a_store_without_a_limit_does_not_touch_what_it_reads(tmp_path):
    store = Store(tmp_path)
    store.save("e", "1")
    os.utime(store.path("e"), (1000, 1000))
    assert store.load("e", json.loads) == 1 and store.path("e").stat().st_mtime == 1000


def test_a_folder_is_its_variable_else_under_the_root(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = tmp_path / "home" / ".cache" / "chainexec"
    assert diskstore.root() == root
    monkeypatch.delenv("CHAINEXEC_SOME_CACHE", raising=False)
    assert diskstore.folder("some", "CHAINEXEC_SOME_CACHE") == root / "some"
    monkeypatch.setenv("CHAINEXEC_SOME_CACHE", "")  # set but empty: as if unset
    assert diskstore.folder("some", "CHAINEXEC_SOME_CACHE") == root / "some"
    monkeypatch.setenv("CHAINEXEC_SOME_CACHE", str(tmp_path / "elsewhere"))
    assert diskstore.folder("some", "CHAINEXEC_SOME_CACHE") == tmp_path / "elsewhere"


def test_each_cache_folder_is_its_variable_else_under_the_root(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = tmp_path / "home" / ".cache" / "chainexec"
    for cache_dir, env, name in [(plancache.cache_dir, "CHAINEXEC_PLAN_CACHE", "plans"),
                                 (kernelcache.cache_dir, "CHAINEXEC_KERNEL_CACHE", "kernels"),
                                 (machinecache.cache_dir, "CHAINEXEC_CACHE", "machines")]:
        monkeypatch.delenv(env, raising=False)
        assert cache_dir() == root / name
        monkeypatch.setenv(env, str(tmp_path / env))
        assert cache_dir() == tmp_path / env
    assert uselog.path() == tmp_path / "CHAINEXEC_KERNEL_CACHE" / "uses.json"
