"""Threaded host copies and fills against NumPy's own, with pieces small enough that every case
is split over several threads."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from chainexec.runtime import hostcopy
from tests.conftest import fourindex_config, launch, run_cli, write_config


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(hostcopy, "PIECE_BYTES", 64)
    monkeypatch.setattr(hostcopy, "FILL_PIECE_BYTES", 64)
    monkeypatch.setattr(hostcopy, "threads", lambda: 5)
    monkeypatch.setattr(hostcopy, "_pool", None)  # a pool of 5 for these tests only


SHAPES = [(), (0, 3), (1,), (37,), (1, 1, 23, 3), (7, 5, 9), (2, 1, 61)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("view", ["whole", "transposed", "strided"])
def test_copy_equals_numpy(shape, view):
    rng = np.random.default_rng(len(shape) * 7 + sum(shape))
    src = rng.standard_normal(shape)
    dst = np.full(shape, np.nan)
    if view == "transposed" and len(shape) > 1:
        src = rng.standard_normal(shape[::-1]).T  # neither C-contiguous nor of dst's order
    if view == "strided" and shape and shape[0]:
        dst = np.full((shape[0] * 2,) + shape[1:], np.nan)[::2]
    hostcopy.copy(dst, src)
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("view", ["whole", "transposed", "strided"])
def test_add_equals_numpy(shape, view):
    rng = np.random.default_rng(len(shape) * 5 + sum(shape))
    src = rng.standard_normal(shape)
    if view == "transposed" and len(shape) > 1:
        src = rng.standard_normal(shape[::-1]).T
    base = rng.standard_normal((shape[0] * 2,) + shape[1:]) if view == "strided" and shape and shape[0] else None
    dst = base[::2] if base is not None else rng.standard_normal(shape)
    want = dst + src
    hostcopy.add(dst, src)
    assert np.array_equal(dst, want)
    if base is not None:
        assert np.array_equal(base[::2], want)  # added through the view


def test_add_rejects_other_shapes():
    with pytest.raises(ValueError, match="addition"):
        hostcopy.add(np.zeros((3, 2)), np.zeros((2, 3)))


@pytest.mark.parametrize("shape", SHAPES)
def test_fill_reaches_every_element(shape):
    base = np.random.default_rng(1).standard_normal((3,) + shape)
    dst = base[1:2].reshape(shape)  # a view, also where shape is ()
    hostcopy.fill(dst, 0)
    assert not np.any(dst)
    assert np.all(base[0] != 0) and np.all(base[2] != 0)  # nothing outside the view


@pytest.mark.parametrize("shape,count", [((10, 4), 3), ((1, 1, 7, 2), 4), ((3, 5), 8), ((1, 1), 4), ((2, 9), 1)])
def test_pieces_cover_the_array_once(shape, count):
    hits = np.zeros(shape, int)
    parts = hostcopy.pieces(shape, count)
    for p in parts:
        hits[p] += 1
    assert np.all(hits == 1)
    long_axis = next((n for n in shape if n > 1), 1)
    assert len(parts) == min(count, long_axis)


def test_large_copies_are_split_over_the_pool(monkeypatch):
    seen, original = [], np.copyto

    def copyto(dst, src):
        seen.append((threading.current_thread().name, dst.size))
        original(dst, src)

    monkeypatch.setattr(hostcopy.np, "copyto", copyto)
    src = np.arange(5000.0).reshape(50, 100)
    dst = np.empty_like(src)
    hostcopy.copy(dst, src)
    assert np.array_equal(dst, src)
    assert [n for _, n in seen] == [1000] * 5  # five even pieces (5 threads, 64-byte pieces)
    assert all(name.startswith("chainexec-hostcopy") for name, _ in seen)


def test_a_copy_given_its_piece_size(monkeypatch):
    """``piece`` overrides :data:`hostcopy.PIECE_BYTES` (the upload arena's copies use many
    threads at sizes the default gives to one)."""
    monkeypatch.setattr(hostcopy, "PIECE_BYTES", 1 << 20)
    seen, original = [], np.copyto

    def copyto(dst, src):
        seen.append(dst.size)
        original(dst, src)

    monkeypatch.setattr(hostcopy.np, "copyto", copyto)
    src = np.arange(5000.0).reshape(50, 100)
    dst = np.empty_like(src)
    hostcopy.copy(dst, src)
    assert seen == [5000]
    hostcopy.copy(dst, src, piece=8000)
    assert seen[1:] == [1000] * 5 and np.array_equal(dst, src)


def test_copy_rejects_other_shapes():
    with pytest.raises(ValueError):
        hostcopy.copy(np.empty((2, 3)), np.empty((3, 2)))


def test_a_failing_piece_raises_after_every_piece_ends(monkeypatch):
    """A copy whose piece fails raises only once no other thread still writes."""
    ends, original = [], np.copyto

    def copyto(dst, src):
        if dst.size and dst.flat[0] == -1:
            raise ValueError("this piece")
        original(dst, src)
        ends.append(dst.size)

    monkeypatch.setattr(hostcopy.np, "copyto", copyto)
    dst = np.zeros(5000)
    dst[0] = -1
    with pytest.raises(ValueError, match="this piece"):
        hostcopy.copy(dst, np.arange(5000.0))
    assert ends == [1000] * 4 and np.array_equal(dst[1000:], np.arange(1000.0, 5000.0))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float64, np.complex128, np.float32])
def test_nonfinite_counts_as_numpy(shape, dtype):
    rng = np.random.default_rng(len(shape) * 3 + sum(shape))
    a = rng.standard_normal(shape).astype(dtype)
    if a.size:
        flat = a.reshape(-1)
        for value in (np.nan, np.inf, -np.inf):
            flat[rng.integers(a.size, size=3)] = value
    assert hostcopy.nonfinite(a) == a.size - np.count_nonzero(np.isfinite(a))
    if a.ndim > 1:
        assert hostcopy.nonfinite(a.T) == a.size - np.count_nonzero(np.isfinite(a))


@pytest.mark.parametrize("shape", SHAPES)
def test_write_files_puts_each_arrays_bytes_at_its_offset(tmp_path, shape):
    """Each array at its offset in its own file (an empty array writes nothing), the bytes
    before the offset untouched."""
    import os

    rng = np.random.default_rng(sum(shape) + 1)
    arrays = [np.asarray(rng.standard_normal(shape)), np.flip(rng.standard_normal(shape)).copy(), np.empty(0)]
    offsets = [101, 7, 50]
    fds = []
    for k in range(3):
        (tmp_path / f"f{k}.bin").write_bytes(bytes([k + 1]) * 333)
        fds.append(os.open(tmp_path / f"f{k}.bin", os.O_WRONLY))
    try:
        hostcopy.write_files(list(zip(fds, offsets, arrays)))
    finally:
        for fd in fds:
            os.close(fd)
    for k, (offset, data) in enumerate(zip(offsets, arrays)):
        got = (tmp_path / f"f{k}.bin").read_bytes()
        assert got[:offset] == bytes([k + 1]) * offset
        assert got[offset:offset + data.nbytes] == data.tobytes()
        assert len(got) == max(333, offset + data.nbytes)


@pytest.mark.parametrize("cores, host_cores, local, narrow", [
    (1, 16, "1", True),     # mpirun -n 1 under Open MPI: one core of sixteen
    (1, 16, "2", True),
    (1, 16, "16", False),   # one core is this rank's whole share
    (1, 3, "2", False),     # a share of one core and a half
    (8, 16, "2", False),
    (1, 1, "1", False),     # a one-core machine
    (1, 16, None, False),   # not Open MPI's launcher: SLURM's --cpus-per-task, a container's CPU set
])
def test_a_rank_bound_to_one_core_of_its_share_is_found(monkeypatch, cores, host_cores, local, narrow):
    monkeypatch.setattr(hostcopy, "threads", lambda: cores)  # the cores this process may run on
    monkeypatch.setattr(hostcopy.os, "cpu_count", lambda: host_cores)
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    if local is not None:
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", local)
    assert hostcopy.bound_narrowly() is narrow


@pytest.mark.parametrize("cores, host_cores, local, want", [
    (16, 16, None, 16),    # one process: every core
    (16, 16, "2", 8),      # two unbound ranks: half each
    (2, 2, "2", 1),        # this machine's demo: one core each
    (16, 16, "32", 1),     # more ranks than cores: one each still
    (4, 16, "4", 4),       # bound (srun's --cpus-per-task): its own cores, not a share of them
    (2, 16, "4", 2),       # bound to fewer than its share
])
def test_a_rank_computes_on_its_share_of_the_host(monkeypatch, cores, host_cores, local, want):
    monkeypatch.setattr(hostcopy, "threads", lambda: cores)
    monkeypatch.setattr(hostcopy.os, "cpu_count", lambda: host_cores)
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    if local is not None:
        monkeypatch.setenv("MPI_LOCALNRANKS", local)
    assert hostcopy.share() == want


BLAS_THREADS = """
import json
from mpi4py import MPI
from threadpoolctl import threadpool_info
from chainexec.runtime import hostcopy
from chainexec.runtime.backends.numpy import NumpyBackend

NumpyBackend()
threads = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
print(json.dumps({"rank": MPI.COMM_WORLD.rank, "threads": threads, "share": hostcopy.share()}))
"""


@pytest.mark.mpi
def test_ranks_of_a_host_share_its_cores_among_their_blas_threads():
    """Under the launcher, each rank's NumPy backend runs its BLAS on its share of the host's
    cores, where each BLAS alone starts a thread per core."""
    proc = subprocess.run([*launch(2), sys.executable, "-c", BLAS_THREADS], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    # the launcher may forward one rank's line before the other's newline: records, not lines
    found = sorted((json.loads(record) for record in re.findall(r"\{[^{}]*\}", proc.stdout)), key=lambda r: r["rank"])
    assert [r["rank"] for r in found] == [0, 1]
    cores = len(os.sched_getaffinity(0))
    for r in found:
        assert r["share"] == max(1, cores // 2)
        assert r["threads"] and all(n == r["share"] for n in r["threads"])


@pytest.mark.parametrize("bound, ranks, start", [(1, 1, "the run's rank is bound"), (2, 4, "2 of the run's 4 ranks are")])
def test_the_note_names_the_ranks_and_the_remedy(bound, ranks, start):
    note = hostcopy.narrow_note(bound, ranks)
    assert note.startswith(start) and "--bind-to none" in note and "\n" not in note


@pytest.mark.skipif(shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2,
                    reason="needs taskset and two cores to run on")
def test_a_run_bound_to_one_core_says_so_once(tmp_path):
    """``chainexec run`` under ``taskset -c 0`` with Open MPI's variable of ranks per host (as
    ``mpirun -n 1`` binds and starts it) prints the note once and runs; unbound, none."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMPI_COMM_WORLD_LOCAL_SIZE="1")
    for bound in (True, False):
        cmd = (["taskset", "-c", "0"] if bound else []) + [sys.executable, "-m", "chainexec.cli", "run", str(config), "--quiet"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        notes = [line for line in proc.stderr.splitlines() if "bound to one core" in line]
        assert len(notes) == bound and (not bound or "--bind-to none" in notes[0]), proc.stderr
