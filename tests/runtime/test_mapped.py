"""Input tiles mapped from their file (:mod:`chainexec.runtime.mapped`) against h5py's own reads
of the same datasets; datasets whose bytes do not lie in the file as the array are not mapped."""

import threading

import h5py
import numpy as np
import pytest

from chainexec import api
from chainexec.chem.triples import ccsd_t_energy
from chainexec.planner.machine import Machine
from chainexec.runtime.checkpoint import Stopped
from chainexec.runtime.backends.numpy import NumpyBackend
from chainexec.runtime.mapped import MappedArray, cached_share, contiguous_offset
from chainexec.runtime.store import Store
from tests.conftest import store_chunked, triples_config

SHAPE = (7, 5, 3)


@pytest.fixture
def data(tmp_path):
    """A file with the same random array stored in several ways."""
    values = np.random.default_rng(4).standard_normal(SHAPE)
    path = tmp_path / "in.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("pad", data=np.arange(1000.0))  # the datasets start at odd offsets
        f["contiguous"] = values
        f.create_dataset("chunked", data=values, chunks=(2, 5, 3))
        f.create_dataset("compressed", data=values, compression="gzip")
        f.create_dataset("big_endian", data=values.astype(">f8"))
        f.create_dataset("unwritten", shape=SHAPE, dtype="f8")
        f.create_dataset("single", data=values.astype(np.float32))
        f["soft"] = h5py.SoftLink("/contiguous")
        f["linked"] = h5py.ExternalLink("other.h5", "contiguous")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["contiguous"] = values
    return path, values


@pytest.mark.parametrize("name, mappable", [("contiguous", True), ("chunked", False), ("compressed", False),
                                            ("big_endian", False), ("unwritten", False), ("single", False),
                                            ("soft", True), ("linked", False)])
def test_only_datasets_laid_out_as_the_array_are_mapped(data, name, mappable):
    """An external link's dataset lies in another file: its offset is not one in this file."""
    path, _ = data
    with h5py.File(path, "r") as f:
        assert (contiguous_offset(f[name], np.dtype(np.float64), str(path)) is not None) == mappable


@pytest.mark.parametrize("rows", [(0, 7), (0, 1), (2, 5), (6, 7)])
def test_mapped_rows_equal_the_dataset(data, rows):
    """Every access the executor makes of a mapped tile reads the dataset's values; the tile is
    read-only."""
    path, values = data
    with h5py.File(path, "r") as f:
        offset = contiguous_offset(f["contiguous"], np.dtype(np.float64), str(path))
    row = 5 * 3 * 8
    tile = MappedArray(str(path), offset + rows[0] * row, (rows[1] - rows[0],) + SHAPE[1:], np.float64)
    expected = values[rows[0]:rows[1]]
    tile.populate(tile.local()[: tile.shape[0] // 2 + 1])
    assert np.array_equal(tile.local(), expected) and np.array_equal(tile.block(0), expected)
    n = tile.shape[0]
    assert tile.owners((slice(0, n),)) == [(0, (0, n))] and tile.rows_of(0) == (0, n)
    out = np.full((n, 2, 3), np.nan)
    assert tile.get((slice(None), slice(1, 3)), out=out) is out and np.array_equal(out, expected[:, 1:3])
    assert np.array_equal(tile.get((slice(n - 1, n),)), expected[n - 1:])
    view = tile.at_hand((slice(0, n),))
    assert view.flags.c_contiguous and np.array_equal(view, expected)
    assert tile.at_hand((slice(0, n), slice(0, 4))) is None
    with pytest.raises(ValueError):
        tile.local()[...] = 0
    with pytest.raises(ValueError):
        tile.populate(tile.local()[:, :, 1:])
    tile.free()


def test_a_get_out_of_a_mapping_goes_over_threads_in_small_pieces(tmp_path, monkeypatch):
    """A copy out of a mapping of one (T) t2 row's size (23 MB at o=32 v=300) is cut into
    :data:`chainexec.runtime.mapped.PIECE` pieces over the threads, not the one or two pieces of
    :data:`hostcopy.PIECE_BYTES`."""
    from chainexec.runtime import hostcopy, mapped

    monkeypatch.setattr(hostcopy, "threads", lambda: 8)
    values = np.random.default_rng(5).standard_normal((4, 300, 2400))  # rows of 5.8 MB, 23 MB in all
    path = tmp_path / "t2.h5"
    with h5py.File(path, "w") as f:
        f["t2"] = values
        offset = contiguous_offset(f["t2"], np.dtype(np.float64), str(path))
    tile = MappedArray(str(path), offset, values.shape, np.float64)
    parts = []
    real = hostcopy._run
    monkeypatch.setattr(hostcopy, "_run", lambda work, pieces: (parts.append(len(pieces)), real(work, pieces))[1])
    out = np.empty_like(values)
    tile.get((slice(None),), out=out)
    assert np.array_equal(out, values) and parts == [min(8, values.nbytes // mapped.PIECE)] and parts[0] > 2
    tile.free()


@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_ranks_of_one_host_share_the_rows_of_one_mapping(data, size):
    """A tile mapped by each of ``size`` ranks of one host: every rank holds every row at hand,
    the rows are split into blocks over the ranks as a global array's are, each rank's load
    (:meth:`MappedArray.local`) is its block, and each counts only its block's bytes, so that
    over the ranks the tile counts once (8 ranks over 7 rows: one rank holds none)."""
    path, values = data
    with h5py.File(path, "r") as f:
        offset = contiguous_offset(f["contiguous"], np.dtype(np.float64), str(path))
    tiles = [MappedArray(str(path), offset, SHAPE, np.float64, rank, size) for rank in range(size)]
    bounds = [r * SHAPE[0] // size for r in range(size + 1)]
    assert sum(t.nbytes_local for t in tiles) == values.nbytes
    for rank, tile in enumerate(tiles):
        assert tile.shared == (size > 1) and not tile.gives_back
        assert tile.rows == (bounds[rank], bounds[rank + 1])
        assert np.array_equal(tile.local(), values[bounds[rank]:bounds[rank + 1]])
        assert tile.nbytes_local == tile.local().nbytes
        assert np.array_equal(tile.whole(), values)
        for other in range(size):
            assert tile.rows_of(other) == (bounds[other], bounds[other + 1])
            assert np.array_equal(tile.block(other), values[bounds[other]:bounds[other + 1]])
        assert tile.owners((slice(2, 6),)) == [(r, (max(2, bounds[r]), min(6, bounds[r + 1]))) for r in range(size)
                                               if max(2, bounds[r]) < min(6, bounds[r + 1])]
        assert np.array_equal(tile.get((slice(1, 6), slice(2, 4))), values[1:6, 2:4])
        tile.free()


def test_store_maps_whole_rows_of_a_file_source_only(tmp_path):
    """``Store.mapped``: whole-row tiles of a contiguous input's first version; a tile cut along
    another axis, a later version or an empty tile are read instead."""
    config = triples_config(tmp_path, "1MiB", 4, 6)
    plan = api.plan(config)
    store = Store(plan, comm=None)
    t = plan.tensors["ovvv"]
    region = ((1, 3),) + tuple((0, n) for n in t.shape[1:])
    tile = store.mapped("ovvv", 0, region)
    with h5py.File(tmp_path / "inputs.h5", "r") as f:
        assert np.array_equal(tile.local(), f[t.source["dataset"]][1:3])
    assert store.mapped("ovvv", 1, region) is None
    assert store.mapped("ovvv", 0, ((1, 3), (0, 1)) + region[2:]) is None
    assert store.mapped("ovvv", 0, ((2, 2),) + region[1:]) is None
    tile.free()


@pytest.mark.parametrize("layout", ["contiguous", "chunked"])
def test_triples_with_inputs_mapped_or_read(tmp_path, monkeypatch, layout):
    """(T) on one rank with its streamed inputs mapped from their file (contiguous datasets) or
    read through HDF5 (the same values stored chunked): E(T) equals the independent reference
    within 1e-12 and every count equals the prediction either way."""
    config = triples_config(tmp_path, "224KiB", 6, 10)
    if layout == "chunked":
        store_chunked(tmp_path / "inputs.h5")
    loaded = []
    populate = MappedArray.populate
    monkeypatch.setattr(MappedArray, "populate", lambda self, rows: loaded.append(rows.nbytes) or populate(self, rows))
    _run_equals_reference(config)
    assert bool(loaded) == (layout == "contiguous")
    if loaded:  # every 4-index input's bytes loaded through the mapping
        assert sum(loaded) >= sum(_four_index_inputs(config))


def _run_equals_reference(config) -> None:
    """A NumPy run of the (T) ``config``: E(T) equals the independent reference (chainexec.chem.
    triples) within 1e-12, and every count equals the prediction."""
    result = api.run(config, backend="numpy")
    with h5py.File(config.parent / "energy.h5", "r") as f:
        got = float(f["E"][()])
    expected = ccsd_t_energy(config.parent / "inputs.h5")
    assert abs(got - expected) <= 1e-12 * abs(expected)
    for key in ("bytes", "flops", "statements", "streamed", "memory_peak"):
        assert result["measured"][key] == result["predicted"][key], key


def _four_index_inputs(config) -> list[int]:
    """Bytes of each stored 4-index input of ``config`` (the (T) tiles a mapping holds; not the
    pair sums made from them)."""
    plan = api.plan(config)
    return [t.itemsize * int(np.prod(t.shape)) for t in plan.tensors.values()
            if t.role == "input" and len(t.shape) == 4 and not t.computed()]


class Locking(NumpyBackend):
    """The NumPy backend, recording :meth:`Backend.lock_host` and :meth:`Backend.unlock_host` as a
    GPU backend would see them, counting the fetches whose rows lie in a locked tile, and
    recording where the rows of each fetch and of each :meth:`Backend.fetch_waits` question lie
    (the executor asks about the rows it then fetches: a backend answers by whether they are
    locked)."""

    def __init__(self):
        super().__init__()
        self.locks: list[tuple[int, str]] = []  # (bytes, thread name) per lock
        self.unlocked: list[int] = []
        self.live: dict[int, np.ndarray] = {}
        self.guard = threading.Lock()  # lock_host runs on the executor's lock thread
        self.fetched = {"locked": 0, "unlocked": 0}
        self.rows: list[tuple[str, tuple | None]] = []  # ("asked" | "fetched", (address, bytes) or None: not at hand)
        self.spans: list[tuple[int, int]] = []  # (address, bytes) of every array locked

    @staticmethod
    def _at(dst, view):
        host = None if view is None else view(slice(0, dst.shape[0]) if dst.ndim else None)
        return None if host is None else (host.ctypes.data, host.nbytes)

    def fetch_waits(self, dst, view=None):
        self.rows.append(("asked", self._at(dst, view)))
        return super().fetch_waits(dst, view)

    def locks_host(self, writable=False, named=False):
        return not writable  # as a GPU run of plain host memory: mapped tiles only

    def lock_host(self, array, writable=False, named=False):
        with self.guard:
            handle = len(self.locks)
            self.locks.append((array.nbytes, threading.current_thread().name))
            self.live[handle] = array
            self.spans.append((array.ctypes.data, array.nbytes))
        return handle

    def unlock_host(self, handle, wait=False):
        with self.guard:
            self.unlocked.append(handle)
            del self.live[handle]

    def fetch(self, dst, read, view=None):
        self.rows.append(("fetched", self._at(dst, view)))
        host = None if view is None else view(slice(0, dst.shape[0]) if dst.ndim else None)
        if host is not None:
            lo, hi = host.ctypes.data, host.ctypes.data + host.nbytes
            with self.guard:
                inside = any(a.ctypes.data <= lo and hi <= a.ctypes.data + a.nbytes for a in self.live.values())
            self.fetched["locked" if inside else "unlocked"] += 1
        super().fetch(dst, read, view)


@pytest.mark.parametrize("end", ["finished", "stopped", "failed"])
def test_mapped_tiles_locked_on_a_thread_until_freed(tmp_path, monkeypatch, end):
    """(T) on one rank with its inputs mapped: each mapped tile is locked for the device once, on
    the executor's lock thread, and unlocked once: when freed, where the run stops at a
    checkpoint (:meth:`Executor._release`), and where it fails (the executor's end). A finished
    run's E(T) equals the independent reference within 1e-12, and every count equals the
    prediction, and the executor asked whether a fetch waits about the rows it then fetched,
    mapped rows among them. (Whether a fetch finds its tile locked yet depends on the lock
    thread's timing: both paths are counted, neither required.)"""
    config = triples_config(tmp_path, "200KiB", 6, 10)
    backend = Locking()
    monkeypatch.setattr(api, "select", lambda name, comm: backend)
    if end == "stopped":
        with pytest.raises(Stopped):
            api.run(config, backend="numpy", checkpoint=str(tmp_path / "ck"), checkpoint_every=0, stop_after=0)
    elif end == "failed":
        def broken(*args, **kwargs):
            raise RuntimeError("a statement failed")
        monkeypatch.setattr(backend, "fused", broken)
        with pytest.raises(RuntimeError, match="a statement failed"):
            api.run(config, backend="numpy")
    else:
        _run_equals_reference(config)
        assert sum(backend.fetched.values()) > 0
        rows = backend.rows
        asked = [n for n, (what, at) in enumerate(rows) if what == "asked" and at is not None]
        for n in asked:  # the next fetch copies the rows asked about
            assert next(at for what, at in rows[n + 1:] if what == "fetched") == rows[n][1]
        assert any(p <= rows[n][1][0] and sum(rows[n][1]) <= p + size for n in asked for p, size in backend.spans)
    assert set(_four_index_inputs(config)) <= {n for n, _ in backend.locks}  # every 4-index input's whole tile
    assert all(name.startswith("chainexec-lock") for _, name in backend.locks)
    assert sorted(backend.unlocked) == list(range(len(backend.locks))) and not backend.live


class PinnedLocking(Locking):
    """:class:`Locking` as a GPU backend of a pinned run sees it: global arrays locked writable,
    inputs' mapped tiles only where the plan names them (:attr:`Plan.locked`); each lock recorded
    with whether it was writable and named."""

    def __init__(self):
        super().__init__()
        self.kinds: list[tuple[int, bool, bool]] = []  # (bytes, writable, named) per lock

    def locks_host(self, writable=False, named=False):
        return writable or named

    def lock_host(self, array, writable=False, named=False):
        self.kinds.append((array.nbytes, writable, named))
        return super().lock_host(array, writable, named)


def test_inputs_the_plan_names_are_locked_in_a_pinned_run(tmp_path, monkeypatch):
    """A pinned run (a machine file with page-locked rates and ``pinned_from_bytes`` 0) of (T) at
    o=6, v=10 fetching its tiles tuple by tuple (96 KiB): the plan names the mapped inputs
    whose gets repay a lock (``ovvv`` among them, :func:`chainexec.planner.cost.locked_inputs`);
    the run locks exactly those mappings, read-only and whole, and no other input's; its
    fetches of them find their rows locked; every count equals the prediction and E(T) the
    reference."""
    config = triples_config(tmp_path, "96KiB", 6, 10)
    machine = tmp_path / "machine.json"
    machine.write_text(Machine(global_to_device=1.0e10, mapped_to_device=2.0e10, host_to_device=5.0e10,
                               host_lock=2.0e10, pinned_from_bytes=0).to_json())
    backend = PinnedLocking()
    monkeypatch.setattr(api, "select", lambda name, comm: backend)
    result = api.run(config, backend="numpy", machine=str(machine))
    plan = api.plan(config, machine=str(machine))
    assert "ovvv" in plan.locked
    sizes = {t.itemsize * int(np.prod(t.shape)) for name, t in plan.tensors.items() if name in plan.locked}
    others = {t.itemsize * int(np.prod(t.shape)) for name, t in plan.tensors.items()
              if t.from_file() and name not in plan.locked}
    named = {n for n, writable, flag in backend.kinds if flag}
    assert named == sizes and not any(writable for _, writable, flag in backend.kinds if flag)
    assert not others & {n for n, writable, flag in backend.kinds if not writable and not flag}
    assert backend.fetched["locked"] > 0
    for key in ("bytes", "flops", "statements"):
        assert result["measured"][key] == result["predicted"][key], key
    with h5py.File(tmp_path / "energy.h5", "r") as f:
        got = float(f["E"][()])
    expected = ccsd_t_energy(tmp_path / "inputs.h5")
    assert abs(got - expected) <= 1e-12 * abs(expected)


def test_no_lock_thread_where_the_backend_locks_nothing(tmp_path, monkeypatch):
    """The NumPy backend locks nothing (:meth:`Backend.locks_host`): no thread is started for it
    and it is never asked."""
    config = triples_config(tmp_path, "200KiB", 4, 6)
    asked = []
    monkeypatch.setattr(NumpyBackend, "lock_host", lambda self, array, writable=False, named=False: asked.append(array))
    before = {t.name for t in threading.enumerate()}
    api.run(config, backend="numpy")
    assert not asked and not any(t.name.startswith("chainexec-lock") for t in threading.enumerate() if t.name not in before)


def _evicted(path) -> None:
    """The file's pages written to the disk and dropped from the page cache."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_cached_share_counts_the_pages_the_page_cache_holds(tmp_path):
    """A dataset of 64 pages and more: all cached once read, few once dropped (the file system
    may keep some); a dataset read through HDF5, or one that is not there, counts none."""
    path = tmp_path / "big.h5"
    values = np.random.default_rng(5).standard_normal(64 * 4096 // 8 + 123)
    with h5py.File(path, "w") as f:
        f["A"] = values
        f.create_dataset("chunked", data=values, chunks=(512,))
    _evicted(path)
    assert cached_share(str(path), "A", np.dtype(np.float64)) < 0.5
    with h5py.File(path, "r") as f:
        assert np.array_equal(f["A"][()], values)  # read: now in the page cache
    assert cached_share(str(path), "A", np.dtype(np.float64)) == 1.0
    assert cached_share(str(path), "chunked", np.dtype(np.float64)) == 0.0
    assert cached_share(str(path), "missing", np.dtype(np.float64)) == 0.0
    assert cached_share(str(tmp_path / "none.h5"), "A", np.dtype(np.float64)) == 0.0
