"""The disk level refuses what would make a result that only looks right: outputs holding values
that are not finite, inputs whose virtual datasets lost their sources."""

from __future__ import annotations

import errno
import itertools
import math
import os
import shutil

import h5py
import numpy as np
import pytest

from tests.conftest import (HDF5_LOCKING, assert_refused, fourindex_config, h5_held_for_writing, held_by_another,
                            run_cli, write_config)


def _generated(tmp_path, cfg=None):
    config = write_config(tmp_path, cfg or fourindex_config())
    assert run_cli("generate", config).returncode == 0
    return config


def _poison(path, dataset: str, value: float) -> None:
    with h5py.File(path, "a") as f:
        f[dataset][(1,) * f[dataset].ndim] = value


@pytest.mark.parametrize("ranks", [None, 2])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_input_leaves_no_output(value, ranks, tmp_path):
    config = _generated(tmp_path)
    _poison(tmp_path / "in.h5", "A", value)
    proc = run_cli("run", config, "--quiet", ranks=ranks)
    assert_refused(proc, "result.h5", "output B holds", "not finite", "allow_nonfinite")
    assert not (tmp_path / "out" / "result.h5").exists()


def test_nonfinite_allowed(tmp_path):
    """With ``allow_nonfinite: true`` the same run completes, and its values equal NumPy's (NaN
    where NumPy's are)."""
    cfg = fourindex_config()
    cfg["outputs"]["B"]["allow_nonfinite"] = True
    config = _generated(tmp_path, cfg)
    _poison(tmp_path / "in.h5", "C", np.inf)
    proc = run_cli("run", config, "--quiet")
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "in.h5", "r") as f:
        a, c = f["A"][()], f["C"][()]
    expected = np.einsum("pa,qb,rc,sd,pqrs->abcd", c, c, c, c, a)
    with h5py.File(tmp_path / "out" / "result.h5", "r") as f:
        assert f.attrs["chainexec_complete"]
        got = f["B"][()]
    assert np.array_equal(np.isfinite(got), np.isfinite(expected)) and not np.isfinite(got).all()
    finite = np.isfinite(expected)
    assert np.abs(got[finite] - expected[finite]).max() <= 1e-12 * np.abs(expected[finite]).max()


def test_overflowing_statement(tmp_path):
    """Finite inputs and a finite factor whose product overflows float64."""
    cfg = fourindex_config()
    cfg["statements"] = [cfg["statements"][0].replace("= C[p,a]", "= 1e300 * C[p,a]")]
    config = _generated(tmp_path, cfg)
    _poison(tmp_path / "in.h5", "A", 1e300)
    assert_refused(run_cli("run", config, "--quiet"), "output B holds", "not finite")


def test_expression_dividing_by_zero(tmp_path):
    cfg = {
        "name": "denominator",
        "indices": {"i": 5, "a": 5},
        "tensors": {
            "e": {"indices": ["i"], "source": {"file": "in.h5", "dataset": "e", "seed": 3}},
            "f": {"indices": ["a"], "source": {"file": "in.h5", "dataset": "f", "seed": 3}},
            "D": {"indices": ["i", "a"], "source": {"expr": "1 / (e[i] - f[a])"}},
            "T": {"indices": ["i", "a"], "source": {"file": "in.h5", "dataset": "T", "seed": 4}},
        },
        "statements": ["R[i,a] = D[i,a] * T[i,a]"],
        "outputs": {"R": {"file": "out.h5", "dataset": "R"}},
        "machine": {"global_memory": "1MiB", "device_memory": "64KiB"},
    }
    config = _generated(tmp_path, cfg)
    with h5py.File(tmp_path / "in.h5", "r") as f:
        assert np.array_equal(f["e"][()], f["f"][()])  # one seed: e[i] - f[i] is 0 on the diagonal
    assert_refused(run_cli("run", config, "--quiet"), "output R holds 5 values", "not finite")
    assert not (tmp_path / "out.h5").exists()


def test_generate_that_fails_at_a_later_file_leaves_the_earlier_ones_unwritten(tmp_path):
    """Inputs in two files, the second refused as it is written (its dataset would lie below
    one of the user's): the first file, already written whole, is not put in place either (it
    was, and ``generate --missing`` then refused every later attempt, some of the inputs being
    there), and the second is as it was."""
    cfg = fourindex_config()
    cfg["tensors"]["A"]["source"]["file"] = "a.h5"
    cfg["tensors"]["C"]["source"].update(file="c.h5", dataset="X/C")
    config = write_config(tmp_path, cfg)
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f["X"] = np.arange(3.0)
    before = (tmp_path / "c.h5").read_bytes()
    assert_refused(run_cli("generate", config), "would lie below 'X'")
    assert not (tmp_path / "a.h5").exists() and (tmp_path / "c.h5").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.h5", "chain.yaml"]


def test_generate_writes_every_dataset_of_one_file_named_twice(tmp_path):
    """Two tensors' files are two names of one file (``link.h5`` a symbolic link to ``in.h5``):
    both datasets land in it (two copies of the file were written and the last renamed over the
    first, losing A while saying it was written); the run reads both."""
    cfg = fourindex_config()
    cfg["tensors"]["C"]["source"]["file"] = "link.h5"
    config = write_config(tmp_path, cfg)
    (tmp_path / "link.h5").symlink_to("in.h5")
    proc = run_cli("generate", config)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "in.h5", "r") as f:
        assert sorted(f) == ["A", "C"]
    assert (tmp_path / "link.h5").is_symlink()
    assert run_cli("run", config, "--quiet").returncode == 0


def test_output_copied_without_its_parts_is_refused_as_input(tmp_path):
    """An output read as the input of another config: fine with its parts folder beside it,
    refused (not read as NaN) where only the file was copied."""
    config = _generated(tmp_path)
    assert run_cli("run", config, "--quiet").returncode == 0
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(tmp_path / "out" / "result.h5", moved / "result.h5")
    cfg = {
        "name": "reread",
        "indices": {i: 8 for i in "abcd"},
        "tensors": {"B": {"indices": list("abcd"), "source": {"file": "result.h5", "dataset": "B"}}},
        "statements": ["S[a,b] = B[a,b,c,d] * B[a,b,c,d]"],
        "outputs": {"S": {"file": "s.h5", "dataset": "S"}},
        "machine": {"global_memory": "1MiB", "device_memory": "64KiB"},
    }
    reread = write_config(moved, cfg)
    assert_refused(run_cli("run", reread, "--quiet"), "result.h5", "virtual dataset", "missing")
    shutil.copytree(tmp_path / "out" / "result.h5.parts", moved / "result.h5.parts")
    proc = run_cli("run", reread, "--quiet")
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "out" / "result.h5", "r") as f:
        b = f["B"][()]
    with h5py.File(moved / "s.h5", "r") as f:
        assert np.allclose(f["S"][()], np.einsum("abcd,abcd->ab", b, b), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128, np.float32, np.dtype(">f8")])
@pytest.mark.parametrize("shape", [(), (0, 3), (37,), (7, 5, 9), (2, 1, 61)])
def test_blocks_written_into_their_dataset_read_back(tmp_path, monkeypatch, dtype, shape):
    """A block whose bytes are written straight into its contiguous dataset (``_dataset`` gives
    the offset, :func:`hostcopy.write_files` writes them) reads back through HDF5 as it was,
    beside datasets HDF5 wrote itself; data in the other byte order goes through HDF5."""
    import os

    from chainexec.runtime import hostcopy
    from chainexec.runtime.store import _dataset

    monkeypatch.setattr(hostcopy, "PIECE_BYTES", 64)
    data = (np.random.default_rng(len(shape)).standard_normal(shape) * 3).astype(dtype)
    blocks = {"b0": data, "b1": np.ascontiguousarray(data[::-1]) if data.ndim else data}
    with h5py.File(tmp_path / "shard.h5", "w") as f:
        f.create_dataset("before", data=np.arange(5))
        offsets = {name: _dataset(f, name, block) for name, block in blocks.items()}
        f.create_dataset("after", data=np.arange(7))
        direct = data.nbytes >= 64 and data.dtype.byteorder in "=|"
        assert all((offset is not None) == direct for offset in offsets.values())
        fd = os.open(f.filename, os.O_WRONLY)
        try:
            hostcopy.write_files([(fd, offsets[name], block) for name, block in blocks.items() if offsets[name] is not None])
        finally:
            os.close(fd)
    with h5py.File(tmp_path / "shard.h5", "r") as f:
        assert f["b0"].dtype == data.dtype and f["b0"].shape == data.shape
        for name, block in blocks.items():
            assert np.array_equal(f[name][()], block)
        assert np.array_equal(f["before"][()], np.arange(5)) and np.array_equal(f["after"][()], np.arange(7))


@pytest.mark.parametrize("shape, region", [((13, 5, 3), ((2, 15), (0, 5), (1, 4))), ((1, 29, 4), ((3, 4), (5, 34), (0, 4))),
                                           ((40,), ((0, 40),)), ((1, 1), ((0, 1), (0, 1))), ((), ())])
@pytest.mark.parametrize("threads", [1, 3, 4])
def test_stripes_cover_the_block_once_along_its_first_long_axis(monkeypatch, shape, region, threads):
    """``_stripes``: at most one stripe per thread, each C-contiguous and at least
    :data:`hostcopy.PIECE_BYTES`, their regions tiling the block's region, each holding the
    block's values there; non-contiguous data and the other byte order stay whole."""
    from chainexec.runtime import hostcopy
    from chainexec.runtime.store import _stripes

    monkeypatch.setattr(hostcopy, "PIECE_BYTES", 64)
    monkeypatch.setattr(hostcopy, "threads", lambda: threads)
    data = np.random.default_rng(len(shape) + threads).standard_normal(shape)
    stripes = _stripes(region, data)
    assert 1 <= len(stripes) <= max(1, min(threads, data.nbytes // 64))
    covered = np.zeros(shape, int)
    for within, part in stripes:
        assert part.flags.c_contiguous and (len(stripes) == 1 or part.nbytes >= 64)
        cut = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(within, region))
        assert np.array_equal(part, data[cut])
        covered[cut] += 1
    assert np.all(covered == 1)
    long = [d for d, n in enumerate(shape) if n > 1]
    assert all(w[d] == region[d] for w, _ in stripes for d in range(len(region)) if d != long[0]) if long else True
    if data.ndim > 1:
        assert len(_stripes(region, np.asfortranarray(data))) == 1
    assert len(_stripes(region, data.astype(">f8"))) == 1


class _OneRank:
    """The collectives :class:`Store` calls, for one rank."""

    rank, size = 0, 1

    def gather(self, value, root=0):
        return [value]

    def Barrier(self):
        pass


@pytest.mark.parametrize("small_read", [0, 1 << 30])
def test_striped_blocks_read_back_through_their_version_sealed_or_open(tmp_path, monkeypatch, small_read):
    """Blocks cut into stripes (four threads here), some sealed at a checkpoint between them, make
    one file per stripe, sealed under their checkpoint's number; the version's VDS and
    :meth:`Store.read` give back every value written, a small block beside them whole, and an
    input's tile its file's values: each part read straight into its destination or into a
    buffer first (``SMALL_READ`` 0), or through h5py's indexing (every part small)."""
    from chainexec import api
    from chainexec.runtime import hostcopy, store as stored
    from chainexec.runtime.store import Store

    monkeypatch.setattr(stored, "SMALL_READ", small_read)
    monkeypatch.setattr(hostcopy, "PIECE_BYTES", 256)
    monkeypatch.setattr(hostcopy, "threads", lambda: 4)
    plan = api.plan(write_config(tmp_path, fourindex_config()))
    t = plan.tensors["B"]
    store = Store(plan, _OneRank())
    values = np.random.default_rng(5).standard_normal(t.shape)
    half = t.shape[0] // 2
    cuts = [((0, half),) + tuple((0, n) for n in t.shape[1:]), ((half, t.shape[0] - 1),) + tuple((0, n) for n in t.shape[1:]),
            ((t.shape[0] - 1, t.shape[0]), (0, 1)) + tuple((0, n) for n in t.shape[2:]),
            ((t.shape[0] - 1, t.shape[0]), (1, t.shape[1])) + tuple((0, n) for n in t.shape[2:])]
    for k, region in enumerate(cuts):
        store.write("B", 1, region, values[tuple(slice(a, b) for a, b in region)].copy())
        if k == 0:
            store.seal(1)
    store.close_version("B", 1)
    base = tmp_path / "out" / "result.h5.parts" / "B.v1"
    assert sorted(p.name for p in base.iterdir()) == sorted(
        ["rank0-1.h5", "rank0s1-1.h5", "rank0s2-1.h5", "rank0s3-1.h5", "rank0.h5", "rank0s1.h5", "rank0s2.h5", "rank0s3.h5"])
    with h5py.File(str(base) + ".h5", "r") as f:
        assert np.array_equal(f["data"][()], values)
    out = np.full(t.shape, np.nan)
    store.read("B", 1, tuple((0, n) for n in t.shape), out)
    assert np.array_equal(out, values)
    part = np.full((3, 2) + tuple(t.shape[2:]), np.nan)
    store.read("B", 1, ((half - 1, half + 2), (2, 4)) + tuple((0, n) for n in t.shape[2:]), part)
    assert np.array_equal(part, values[half - 1:half + 2, 2:4])
    a = plan.tensors["A"]  # an input's tile, from its own file
    inputs = np.random.default_rng(6).standard_normal(a.shape)
    with h5py.File(a.source["file"], "w") as f:
        f.create_dataset(a.source["dataset"], data=inputs)
    tile = np.full((2, 3) + tuple(a.shape[2:]), np.nan)
    store.read("A", 0, ((1, 3), (4, 7)) + tuple((0, n) for n in a.shape[2:]), tile)
    assert np.array_equal(tile, inputs[1:3, 4:7])


class _Counting:
    """A computed tensor's source (arange values) that records the ``out`` it is given."""

    def __init__(self, shape):
        self.shape, self.given = shape, []
        self.stored = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)

    def values(self, rows, out=None):
        self.given.append(out)
        if out is not None:
            out[...] = self.stored[rows[0]:rows[1]]
            return out
        return self.stored[rows[0]:rows[1]].copy()


@pytest.mark.parametrize("region, into", [(((2, 5), (0, 4), (0, 3)), True), (((0, 6), (1, 3), (0, 3)), False),
                                          (((1, 2), (0, 4), (0, 3)), "strided")])
def test_a_computed_tensors_rows_are_computed_into_the_buffer_they_load(region, into):
    """:meth:`Store.read` of a computed tensor hands the destination to the source where the
    region is whole rows and the destination is C-contiguous (the values are made there, no
    copy), else none (the source's rows are then cut and copied); the values are the stored
    array's region either way."""
    import types

    from chainexec.runtime.store import Store

    shape = (6, 4, 3)
    source = _Counting(shape)
    store = Store.__new__(Store)
    store.plan = types.SimpleNamespace(tensors={"A": types.SimpleNamespace(source={"compute": "counting"}, shape=shape)})
    store.sources = {"A": source}
    box = tuple(b - a for a, b in region)
    out = np.full((box[0], box[1], 2 * box[2]), np.nan)[:, :, ::2] if into == "strided" else np.full(box, np.nan)
    store.read("A", 0, region, out)
    assert len(source.given) == 1 and source.given[0] is (out if into is True else None)
    assert np.array_equal(out, source.stored[tuple(slice(a, b) for a, b in region)])


def _linked_config(tmp_path):
    """C[i] = A[i,j] * B[j] with A behind an external link of ``in.h5`` to ``a_store.h5`` (its
    bytes lie there, at an offset that in ``in.h5`` holds other values)."""
    rng = np.random.default_rng(17)
    a, b = rng.standard_normal((13, 7)), rng.standard_normal(7)
    with h5py.File(tmp_path / "a_store.h5", "w") as f:
        f["A"] = a
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["pad"] = np.full(1000, 7.0)
        f["B"] = b
        f["A"] = h5py.ExternalLink("a_store.h5", "A")
    cfg = {
        "indices": {"i": 13, "j": 7},
        "tensors": {"A": {"indices": ["i", "j"], "source": {"file": "in.h5", "dataset": "A"}},
                    "B": {"indices": ["j"], "source": {"file": "in.h5", "dataset": "B"}}},
        "statements": ["C[i] = A[i,j] * B[j]"],
        "outputs": {"C": {"file": "out.h5", "dataset": "C"}},
        "machine": {"global_memory": "1MiB", "device_memory": "64KiB"},
    }
    return write_config(tmp_path, cfg), a @ b


@pytest.mark.parametrize("ranks", [None, 2])
def test_an_input_behind_an_external_link_reads_the_linked_values(tmp_path, ranks):
    config, expected = _linked_config(tmp_path)
    proc = run_cli("run", config, "--quiet", ranks=ranks, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert np.allclose(f["C"][()], expected, rtol=1e-12, atol=0)


def test_an_external_link_to_a_missing_file_is_refused(tmp_path):
    config, _ = _linked_config(tmp_path)
    (tmp_path / "a_store.h5").unlink()
    assert_refused(run_cli("run", config, "--quiet", cwd=tmp_path), "in.h5", "'A'")
    assert not (tmp_path / "out.h5").exists()


def test_an_empty_dataset_is_refused(tmp_path):
    config, _ = _linked_config(tmp_path)
    with h5py.File(tmp_path / "in.h5", "a") as f:
        del f["A"]
        f["A"] = h5py.Empty("f8")
    assert_refused(run_cli("run", config, "--quiet", cwd=tmp_path), "in.h5", "'A'", "no dataspace")
    assert not (tmp_path / "out.h5").exists()



def _unreadable(tmp_path, kind: str) -> None:
    """``in.h5``'s A (13×7) made unreadable as ``kind`` says, its metadata intact."""
    with h5py.File(tmp_path / "in.h5", "a") as f:
        del f["A"]
        if kind == "external file missing":
            f.create_dataset("A", shape=(13, 7), dtype="f8", external=[(str(tmp_path / "missing.bin"), 0, 728)])
        elif kind == "external file short":
            (tmp_path / "short.bin").write_bytes(b"\0" * 100)
            f.create_dataset("A", shape=(13, 7), dtype="f8", external=[(str(tmp_path / "short.bin"), 0, 728)])
        elif kind == "corrupt chunk":
            ds = f.create_dataset("A", shape=(13, 7), dtype="f8", chunks=(13, 7), compression="gzip")
            ds.id.write_direct_chunk((0, 0), b"not deflate data" * 4)
        else:  # a virtual dataset mapping more rows than its source has
            with h5py.File(tmp_path / "src.h5", "w") as s:
                s["X"] = np.ones((3, 7))
            layout = h5py.VirtualLayout((13, 7), "f8")
            layout[:, :] = h5py.VirtualSource("src.h5", "X", shape=(13, 7))
            f.create_virtual_dataset("A", layout)


@pytest.mark.parametrize("ranks", [None, 2])
@pytest.mark.parametrize("kind", ["external file missing", "external file short", "corrupt chunk",
                                  "virtual source short"])
def test_an_input_whose_values_cannot_be_read_is_refused(tmp_path, kind, ranks):
    """Raw storage missing or short (found before the run), a chunk that does not decompress,
    a virtual source smaller than its mapping (found by the read): one line naming the file and
    the dataset, exit status 2, no output."""
    config, _ = _linked_config(tmp_path)
    _unreadable(tmp_path, kind)
    proc = run_cli("run", config, "--quiet", ranks=ranks, cwd=tmp_path)
    if ranks is None:
        assert_refused(proc, "in.h5", "'A'")
    else:  # each rank that meets it says so, and the launcher adds its own note
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and "'A'" in proc.stderr, proc.stderr
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize("kind", ["folder", "FIFO"])
@pytest.mark.parametrize("command", ["run", "verify"])
def test_an_input_path_that_is_not_a_file_is_refused_in_one_line(tmp_path, kind, command):
    """HDF5's message for a folder spans lines, and it opens a FIFO by waiting for a writer (the
    command hung): one line naming what the path is, exit status 2; ``plan``, which does not
    read inputs, ends."""
    config, _ = _linked_config(tmp_path)
    (tmp_path / "in.h5").unlink()
    (tmp_path / "in.h5").mkdir() if kind == "folder" else os.mkfifo(tmp_path / "in.h5")
    assert_refused(run_cli(command, config, *(["--quiet"] if command == "run" else []), cwd=tmp_path, timeout=60),
                   "in.h5", f"is a {kind}, not a file (input of tensor A)")
    assert run_cli("plan", config, cwd=tmp_path, timeout=60).returncode == 0
    assert not (tmp_path / "out.h5").exists()


def _written_part_way(tmp_path, rows: int, chunks: bool) -> np.ndarray:
    """``in.h5``'s A (13×7) stored in the file, its first ``rows`` rows written, as a writer stopped
    there leaves it (chunked: one row a chunk; contiguous: written only where ``rows`` > 0)."""
    with h5py.File(tmp_path / "a_store.h5", "r") as f:
        a = f["A"][()]
    with h5py.File(tmp_path / "in.h5", "a") as f:
        del f["A"]
        ds = f.create_dataset("A", shape=a.shape, dtype="f8", chunks=(1, 7) if chunks else None)
        if rows:
            ds[:rows] = a[:rows]
    return a


@pytest.mark.parametrize("command", ["run", "verify"])
@pytest.mark.parametrize("rows, chunks, needle", [(0, False, "was never written"), (0, True, "13 of its 13 chunks"),
                                                  (5, True, "8 of its 13 chunks")],
                         ids=["contiguous, never written", "chunked, never written", "chunked, 5 of 13 rows"])
def test_an_input_not_wholly_written_is_refused(tmp_path, command, rows, chunks, needle):
    """HDF5 reads the fill value where a dataset's storage was never written: the run took those
    zeros for the input and ended with a result marked complete, and ``verify``, reading the same
    zeros, passed it. Both refuse such an input in one line; written whole, the same dataset runs
    to the right result."""
    config, expected = _linked_config(tmp_path)
    assert run_cli("run", config, "--quiet", cwd=tmp_path).returncode == 0
    a = _written_part_way(tmp_path, rows, chunks)
    assert_refused(run_cli(command, config, *(["--quiet"] if command == "run" else []), cwd=tmp_path),
                   "in.h5", "'A' (input of tensor A)", needle)
    with h5py.File(tmp_path / "in.h5", "a") as f:
        f["A"][rows:] = a[rows:]
    assert run_cli("run", config, "--quiet", cwd=tmp_path).returncode == 0
    assert run_cli("verify", config, cwd=tmp_path).returncode == 0
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert np.allclose(f["C"][()], expected, rtol=1e-12, atol=0)


def _virtual_part_way(tmp_path, kind: str) -> np.ndarray:
    """``in.h5``'s A (13×7) made a virtual dataset over ``src.h5`` that leaves elements to HDF5's
    fill value as ``kind`` says; returns A's values, which make it whole."""
    with h5py.File(tmp_path / "a_store.h5", "r") as f:
        a = f["A"][()]
    with h5py.File(tmp_path / "src.h5", "w") as s:
        ds = s.create_dataset("X", shape=a.shape, dtype="f8", chunks=(1, 7))
        ds[: 5 if kind == "a source written part way" else None] = a[: 5 if kind == "a source written part way" else None]
    layout = h5py.VirtualLayout(a.shape, "f8")
    if kind == "rows not mapped":
        layout[:5] = h5py.VirtualSource("src.h5", "X", shape=a.shape)[:5]
    elif kind == "mapped with overlaps and a gap":  # rows 0-7 and 5-11: as many elements as A holds, row 12 unmapped
        layout[:8] = h5py.VirtualSource("src.h5", "X", shape=a.shape)[:8]
        layout[5:12] = h5py.VirtualSource("src.h5", "X", shape=a.shape)[5:12]
    elif kind != "nothing mapped":
        layout[:, :] = h5py.VirtualSource("src.h5", "X", shape=a.shape)
    with h5py.File(tmp_path / "in.h5", "a") as f:
        del f["A"]
        f.create_virtual_dataset("A", layout, fillvalue=0.0)
    return a


@pytest.mark.parametrize("command", ["run", "verify"])
@pytest.mark.parametrize("kind, needle", [("rows not mapped", "map 35 of its 91 elements"),
                                          ("nothing mapped", "map 0 of its 91 elements"),
                                          ("mapped with overlaps and a gap", "map 84 of its 91 elements"),
                                          ("a source written part way", "8 of its 13 chunks")])
def test_a_virtual_input_hdf5_would_fill_is_refused(tmp_path, command, kind, needle):
    """A virtual dataset reads its fill value where no source is mapped (mappings that overlap
    may leave a gap while they select as many elements as it holds) or a source was never
    written there: the run took those zeros for the input and ended complete, and ``verify``,
    reading the same, passed it. Both refuse it in one line; mapped whole over a source written
    whole, it runs to the right result."""
    config, expected = _linked_config(tmp_path)
    assert run_cli("run", config, "--quiet", cwd=tmp_path).returncode == 0
    a = _virtual_part_way(tmp_path, kind)
    assert_refused(run_cli(command, config, *(["--quiet"] if command == "run" else []), cwd=tmp_path),
                   "'A' (input of tensor A)" if "mapped" in kind else "src.h5", needle)
    with h5py.File(tmp_path / "src.h5", "a") as s:
        s["X"][...] = a
    layout = h5py.VirtualLayout(a.shape, "f8")
    layout[:, :] = h5py.VirtualSource("src.h5", "X", shape=a.shape)
    with h5py.File(tmp_path / "in.h5", "a") as f:
        del f["A"]
        f.create_virtual_dataset("A", layout, fillvalue=0.0)
    assert run_cli("run", config, "--quiet", cwd=tmp_path).returncode == 0
    assert run_cli("verify", config, cwd=tmp_path).returncode == 0
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert np.allclose(f["C"][()], expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", ["unlimited", "mapped part of a source written part way", "blocks of one file",
                                  "strided past unwritten chunks", "overlapping"])
def test_a_virtual_input_hdf5_reads_whole_runs(tmp_path, kind):
    """Virtual inputs whose every element a source gives: a mapping of unlimited extent (HDF5
    cannot count what it selects: it was refused as a damaged file, and ``verify`` failed with a
    traceback); the written rows of a chunked source that is written no further (it was refused
    as not wholly written), and the rows of a strided mapping past chunks never written (it
    took the box around them); 91 blocks, each a dataset of one source file (opened once);
    mappings that overlap and together cover it. ``run``
    and ``verify`` take them, and the result equals numpy's within 1e-12."""
    config, expected = _linked_config(tmp_path)
    with h5py.File(tmp_path / "a_store.h5", "r") as f:
        a = f["A"][()]
    with h5py.File(tmp_path / "src.h5", "w") as s:
        if kind == "unlimited":
            s.create_dataset("X", data=a, maxshape=(None, 7), chunks=(1, 7))
            layout = h5py.VirtualLayout(a.shape, "f8", maxshape=(None, 7))
            layout[0:h5py.h5s.UNLIMITED, :] = h5py.VirtualSource("src.h5", "X", shape=a.shape,
                                                                 maxshape=(None, 7))[0:h5py.h5s.UNLIMITED, :]
        elif kind.startswith("mapped part"):
            s.create_dataset("X", shape=(40, 7), chunks=(1, 7), dtype="f8")[:13] = a
            layout = h5py.VirtualLayout(a.shape, "f8")
            layout[:, :] = h5py.VirtualSource("src.h5", "X", shape=(40, 7))[:13]
        elif kind == "overlapping":  # rows 0-7 and 5-12, the overlap mapped twice
            s["X"] = a
            layout = h5py.VirtualLayout(a.shape, "f8")
            layout[:8] = h5py.VirtualSource("src.h5", "X", shape=a.shape)[:8]
            layout[5:] = h5py.VirtualSource("src.h5", "X", shape=a.shape)[5:]
        elif kind.startswith("strided"):  # rows 0, 2, 4, ... of a source whose odd chunks were never written
            s.create_dataset("X", shape=(26, 7), chunks=(1, 7), dtype="f8")[::2] = a
            layout = h5py.VirtualLayout(a.shape, "f8")
            layout[:, :] = h5py.VirtualSource("src.h5", "X", shape=(26, 7))[0:26:2]
        else:
            layout = h5py.VirtualLayout(a.shape, "f8")
            for k, (i, j) in enumerate(itertools.product(range(13), range(7))):
                s[f"b{k}"] = a[i:i + 1, j:j + 1]
                layout[i:i + 1, j:j + 1] = h5py.VirtualSource("src.h5", f"b{k}", shape=(1, 1))
    with h5py.File(tmp_path / "in.h5", "a") as f:
        del f["A"]
        f.create_virtual_dataset("A", layout, fillvalue=np.nan)
    proc = run_cli("run", config, "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert run_cli("verify", config, cwd=tmp_path).returncode == 0
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert np.allclose(f["C"][()], expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("command", ["run", "verify"])
def test_an_input_file_with_damaged_metadata_is_one_line(tmp_path, command):
    """A file whose group metadata is damaged (h5py raises RuntimeError, not OSError): one line
    naming the file, exit status 2 (a traceback; ``verify`` said there was no such dataset)."""
    config, _ = _linked_config(tmp_path)
    path = tmp_path / "in.h5"
    with h5py.File(tmp_path / "a_store.h5", "r") as f, h5py.File(path, "w") as g:
        g["A"], g["B"] = f["A"][()], np.ones(7)
    assert path.read_bytes().count(b"SNOD") == 1  # the root group's symbol table node
    path.write_bytes(path.read_bytes().replace(b"SNOD", b"XXXX"))
    assert_refused(run_cli(command, config, *(["--quiet"] if command == "run" else []), cwd=tmp_path),
                   "in.h5", "damaged")
    assert not (tmp_path / "out.h5").exists()


def test_an_input_made_with_no_fill_value_runs(tmp_path):
    """A dataset made with its fill value undefined (``H5Pset_fill_value`` given NULL, which C
    writers do) and written whole: h5py cannot read its fill value, and the check for unwritten
    storage failed with a traceback; it runs to the right result."""
    import ctypes
    import glob

    found = [p for p in glob.glob(os.path.dirname(h5py.__file__) + ".libs/libhdf5-*") if "hl" not in os.path.basename(p)]
    if not found:
        pytest.skip("h5py's bundled libhdf5 not found (h5py not from its wheel): H5Pset_fill_value cannot be called")
    lib = ctypes.CDLL(found[0])
    config, expected = _linked_config(tmp_path)
    with h5py.File(tmp_path / "a_store.h5", "r") as f:
        a = f["A"][()]
    with h5py.File(tmp_path / "a_store.h5", "w") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        assert lib.H5Pset_fill_value(ctypes.c_int64(dcpl.id), ctypes.c_int64(h5py.h5t.NATIVE_DOUBLE.id), None) >= 0
        ds = h5py.Dataset(h5py.h5d.create(f.id, b"A", h5py.h5t.NATIVE_DOUBLE, h5py.h5s.create_simple(a.shape),
                                          dcpl=dcpl))
        ds[...] = a
    with h5py.File(tmp_path / "a_store.h5", "r") as f, pytest.raises(RuntimeError):
        f["A"].fillvalue
    proc = run_cli("run", config, "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert np.allclose(f["C"][()], expected, rtol=1e-12, atol=0)


def test_generate_refuses_a_file_another_program_is_writing(tmp_path):
    """``generate`` copies an input file, writes the copy and renames it over the file: a writer
    that had the file open kept writing into the old one, and its data was lost, with exit
    status 0. The file is refused while a writer holds it (HDF5's file lock); once it has
    finished, ``generate`` writes beside what it wrote."""
    config = write_config(tmp_path, {
        "indices": {"i": 5, "j": 6},
        "tensors": {"A": {"indices": ["i", "j"], "source": {"file": "in.h5", "dataset": "A", "seed": 1}},
                    "B": {"indices": ["j"], "source": {"file": "in.h5", "dataset": "B", "seed": 2}}},
        "statements": ["C[i] = A[i,j] * B[j]"], "outputs": {"C": {"file": "out.h5", "dataset": "C"}}})
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["keep"] = np.arange(3.0)
    with h5_held_for_writing(tmp_path / "in.h5"):
        assert_refused(run_cli("generate", config, cwd=tmp_path, env=HDF5_LOCKING), "in.h5",
                       "open for writing in another program")
    with h5py.File(tmp_path / "in.h5", "r") as f:
        assert sorted(f) == ["keep", "mine"] and f["mine"][999] == 999.0
    assert run_cli("generate", config, cwd=tmp_path).returncode == 0
    with h5py.File(tmp_path / "in.h5", "r") as f:
        assert sorted(f) == ["A", "B", "keep", "mine"] and f["mine"][999] == 999.0


def test_a_failed_runs_parts_folder_goes_where_none_can_be_made_beside_it(tmp_path, monkeypatch):
    """A run that failed on a full disk: no folder can be made beside its parts folder to move it
    aside, so it is removed where it lies, with its shards, and the scratch folder too."""
    from chainexec import safepaths
    from chainexec.runtime import store

    out, scratch = tmp_path / "o.h5", tmp_path / ".scratch"
    store.make_folders([out], scratch, fresh=True)
    (store.parts_dir(out) / "B.v1").mkdir()
    (store.parts_dir(out) / "B.v1" / "rank0.h5").write_bytes(os.urandom(4096))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safepaths.tempfile, "mkdtemp", full)
    store.discard_folders([out], scratch)
    assert list(tmp_path.iterdir()) == []


def test_a_run_whose_stored_tensors_cannot_fit_the_disk_is_refused_before_it_writes(tmp_path, monkeypatch):
    """The tensors a plan stores on disk, each once, against the free space where they go: more
    than is free is refused in one line before anything is written (the run filled the disk after
    computing until then); a rerun counts the older shards it replaces as room."""
    from chainexec import api
    from chainexec.errors import ChainexecError
    from chainexec.planner.plan import stores
    from chainexec.runtime import store
    from chainexec.spec import format_size

    config = _generated(tmp_path)
    plan = api.plan(config, backend="numpy")
    need = sum(math.prod(plan.tensors[t].shape) * plan.tensors[t].itemsize
               for t in {t for nest in plan.nests for t in stores(nest.body)})
    free = {"bytes": need - 1}
    real = shutil.disk_usage
    monkeypatch.setattr(store.shutil, "disk_usage", lambda path: real(path)._replace(free=free["bytes"]))
    with pytest.raises(ChainexecError, match=f"stores {format_size(need)} of tensors on this file system and "
                                             f"{format_size(need - 1)} are free"):
        api.run(config, backend="numpy")
    assert [p for p in (tmp_path / "out").rglob("*")] == []
    free["bytes"] = need
    api.run(config, backend="numpy")
    parts = tmp_path / "out" / "result.h5.parts"
    held = sum(f.stat().st_size for f in parts.rglob("*") if f.is_file())
    free["bytes"] = need - held
    api.run(config, backend="numpy")


def test_a_failed_runs_discard_leaves_a_parts_folder_another_process_holds(tmp_path):
    """Where the parts folder cannot be moved aside because another process holds it, the
    discard leaves it (its fallback removed it where it lay)."""
    from chainexec.runtime import store

    out = tmp_path / "o.h5"
    with held_by_another(store.parts_dir(out)):
        (store.parts_dir(out) / "rank0.h5").write_bytes(os.urandom(4096))
        store.discard_folders([out], tmp_path / ".scratch")
        assert (store.parts_dir(out) / "rank0.h5").stat().st_size == 4096
