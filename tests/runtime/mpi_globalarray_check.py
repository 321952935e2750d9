"""Checks GlobalArray, TaskCounter and Board on however many ranks it is launched with (or none).

Run by tests/runtime/test_globalarray.py as ``mpiexec -n N python mpi_globalarray_check.py SEED``
(or without mpiexec; ``--self`` makes every rank check on its own MPI.COMM_SELF; ``--rma`` keeps
the arrays out of shared memory, so that gets between ranks are RMA calls). Every rank keeps a
replicated NumPy copy of each array, built from a random generator seeded identically on all ranks,
and compares what it reads one-sidedly with it. Exits 0 after rank 0 prints ``OK``; any failure
prints its traceback and aborts all ranks, so the launcher never hangs.
"""

import mmap
import sys
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

from chainexec.runtime import globalarray
from chainexec.runtime.globalarray import Board, GlobalArray, TaskCounter

DTYPES = (np.float64, np.float32, np.complex128)


def random_values(rng, shape, dtype):
    """Random normal values of ``dtype`` (never zeros: a zero-filled array would pass get checks)."""
    values = rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        values = values + 1j * rng.standard_normal(shape)
    return values.astype(dtype)


def random_shape(rng, nranks):
    """1 to 5 axes; axis 0 often shorter than the rank count, other axes uneven and small."""
    ndim = int(rng.integers(1, 6))
    first = int(rng.integers(1, 2 * nranks + 3))
    return (first, *(int(n) for n in rng.integers(1, 5, ndim - 1)))


def random_region(rng, shape):
    """Random non-empty step-1 box; sometimes with open-ended or negative slice bounds."""
    region = []
    for n in shape:
        a = int(rng.integers(0, n))
        b = int(rng.integers(a + 1, n + 1))
        region.append(slice(a - n if rng.random() < 0.2 else a, None if b == n else b))
    return tuple(region)


def check_patches(comm, rng, dtype):
    """Fill through local(); get random patches (with and without ``out``); put and get back."""
    shape = random_shape(rng, comm.size)
    ref = random_values(rng, shape, dtype)
    ga = GlobalArray(comm, shape, dtype, zero=False)
    lo, hi = ga.rows
    assert ga.local().shape == (hi - lo, *shape[1:]) and ga.nbytes_local == ref[lo:hi].nbytes
    ga.local()[...] = ref[lo:hi]
    comm.Barrier()

    mine = np.random.default_rng(rng.integers(1 << 32) + comm.rank)  # different patches per rank
    for _ in range(8):
        region = random_region(mine, shape)
        assert np.array_equal(ga.get(region), ref[region])
        out = np.empty(ref[region].shape, dtype)
        assert ga.get(region, out=out) is out and np.array_equal(out, ref[region])
        check_at_hand(ga, region, ref)
    for first in range(shape[0]):  # whole rows, within one block or across two
        check_at_hand(ga, (slice(first, first + int(mine.integers(1, 3))),), ref)
    assert np.array_equal(ga.get(()), ref)

    # Each rank in turn puts a patch; all update the replicated copy alike.
    for writer in range(comm.size):
        region = random_region(rng, shape)
        data = random_values(rng, ref[region].shape, dtype)
        ref[region] = data
        comm.Barrier()  # every rank has finished reading before the write (a get racing a put is undefined)
        if comm.rank == writer:
            ga.put(region, data)
        comm.Barrier()
        assert np.array_equal(ga.get(()), ref)
    # All ranks put at once into disjoint slabs of rows, each spanning owners as it happens to.
    cuts = np.sort(rng.integers(0, shape[0] + 1, comm.size - 1))
    edges = [0, *cuts.tolist(), shape[0]]
    box = random_region(rng, shape)[1:]
    slabs = [(slice(edges[r], edges[r + 1]), *box) for r in range(comm.size)]
    datas = [random_values(rng, ref[s].shape, dtype) for s in slabs]
    for s, d in zip(slabs, datas):
        ref[s] = d
    comm.Barrier()
    ga.put(slabs[comm.rank], datas[comm.rank])
    comm.Barrier()
    assert np.array_equal(ga.get(()), ref)
    assert np.array_equal(ga.local(), ref[lo:hi])
    comm.Barrier()  # no rank frees while another still reads
    ga.free()


def check_at_hand(ga, region, ref):
    """``at_hand`` gives a view of the window holding ``ref[region]`` exactly where the patch is
    whole rows (every other axis whole) of one block this rank reads with plain loads (its own,
    or any in shared memory), and None elsewhere."""
    rows = range(*region[0].indices(ref.shape[0]))
    whole = all(s.indices(n)[:2] == (0, n) for s, n in zip(region[1:], ref.shape[1:]))
    owners = {r for r in range(ga.comm.size) if any(ga.rows_of(r)[0] <= k < ga.rows_of(r)[1] for k in rows)}
    expect = whole and len(owners) == 1 and (owners == {ga.comm.rank} or ga.shared)
    view = ga.at_hand(region)
    assert (view is not None) == expect, (region, owners, ga.shared)
    if view is not None:
        assert view.flags.c_contiguous and np.array_equal(view, ref[region])
        assert np.shares_memory(view, ga.block(owners.pop()))


def check_accumulate(comm, rng, dtype):
    """All ranks accumulate into overlapping patches at once; the result is the sum."""
    shape = random_shape(rng, comm.size)
    ref = random_values(rng, shape, dtype)
    ga = GlobalArray(comm, shape, dtype)
    assert not ga.local().any()  # zero=True
    comm.Barrier()
    if comm.rank == 0:
        ga.put((), ref)
    comm.Barrier()
    for rank in range(comm.size):
        for _ in range(4):
            region = random_region(rng, shape)
            data = random_values(rng, ref[region].shape, dtype)
            ref[region] += data
            if rank == comm.rank:
                ga.accumulate(region, data)
    # A hot spot: every rank adds into the same patch many times, so lost updates would show.
    hot = random_region(rng, shape)
    datas = [random_values(rng, ref[hot].shape, dtype) for _ in range(comm.size)]
    for _ in range(20):
        ga.accumulate(hot, datas[comm.rank])
    ref[hot] += 20 * sum(datas)
    comm.Barrier()
    # Ranks' adds arrive in any order, so allow rounding: ~100 adds an element, far below one lost add.
    tol = 1000 * np.finfo(dtype).eps * np.abs(ref).max()
    assert np.abs(ga.get(()) - ref).max() <= tol
    comm.Barrier()
    ga.free()


def check_views(comm, rng, dtype):
    """Smaller arrays in one window (a double-buffered loop's slots): every view shape from the
    whole array down to one element per axis reads, writes and accumulates like its own array,
    and a view's local block fits the window on every rank."""
    shape = random_shape(rng, comm.size)
    ga = GlobalArray(comm, shape, dtype, zero=False)
    for _ in range(3):
        small = tuple(int(rng.integers(1, n + 1)) for n in shape)
        view = ga.view(small)
        lo, hi = view.rows
        assert view.shape == small and view.local().shape == (hi - lo, *small[1:])
        assert view.nbytes_local <= ga.nbytes_local
        ref = random_values(rng, small, dtype)
        view.local()[...] = ref[lo:hi]
        comm.Barrier()
        region = random_region(rng, small)
        assert np.array_equal(view.get(()), ref) and np.array_equal(view.get(region), ref[region])
        comm.Barrier()
        data = random_values(rng, ref[region].shape, dtype)
        view.accumulate(region, data)
        ref[region] += comm.size * data
        comm.Barrier()
        tol = 100 * np.finfo(dtype).eps * np.abs(ref).max()
        assert np.abs(view.get(()) - ref).max() <= tol
        view.free()  # a view's free leaves the window alone
        comm.Barrier()
    for bad in (tuple(n + 1 for n in shape), shape[:-1]):
        try:
            ga.view(bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"view {bad} of {shape} accepted")
    ga.free()


def check_degenerate(comm, rng):
    """0-d and empty arrays live on rank 0; bad regions and buffers are refused."""
    scalar = GlobalArray(comm, (), np.float64)
    value = random_values(rng, (), np.float64)
    assert scalar.rows == ((0, 1) if comm.rank == 0 else (1, 1))
    if comm.rank == comm.size - 1:
        scalar.accumulate((), value)
    comm.Barrier()
    assert scalar.get(()) == value and scalar.get(()).shape == ()
    if comm.rank == 0:
        assert scalar.local() == value
    comm.Barrier()
    scalar.free()

    empty = GlobalArray(comm, (3, 0, 2), np.float32)
    assert empty.rows == ((0, 3) if comm.rank == 0 else (3, 3)) and empty.nbytes_local == 0
    assert empty.get((slice(1, 3),)).shape == (2, 0, 2)
    empty.free()

    ga = GlobalArray(comm, (5, 3), np.float64)
    for bad, error in (((slice(0, 4, 2),), ValueError), ((0,), TypeError),
                       ((slice(None),) * 3, IndexError)):
        try:
            ga.get(bad)
        except error:
            pass
        else:
            raise AssertionError(f"region {bad} accepted")
    for out in (np.empty((5, 3), np.float32), np.empty((3, 5), np.float64).T, np.empty((5, 2))):
        try:
            ga.get((), out=out)
        except ValueError:
            pass
        else:
            raise AssertionError(f"out {out.shape} {out.dtype} accepted")
    assert ga.get((slice(2, 2),)).shape == (0, 3)  # empty patch, no transfer
    ga.free()


def check_counter(comm):
    """Every rank draws until it gets a value past the task count: all values appear exactly once."""
    ntasks = 100
    counter = TaskCounter(comm)
    for _ in range(2):  # the second round checks reset()
        drawn = []
        while not drawn or drawn[-1] < ntasks:
            drawn.append(counter.next())
        everything = sorted(v for values in comm.allgather(drawn) for v in values)
        assert everything == list(range(ntasks + comm.size)), everything
        counter.reset()
    # fence: rank 0 fences at the first value not handed out; every later draw is at least the
    # offset; reset(value) goes on from there; a counter past the tasks is not fenced
    big = 1 << 40
    while counter.next() < 3:
        pass
    comm.Barrier()
    fenced = counter.fence(ntasks, big) if comm.rank == 0 else None
    comm.Barrier()
    after = counter.next()
    fenced = comm.bcast(fenced, root=0)
    assert fenced is not None and 3 <= fenced < ntasks and after >= big, (fenced, after)
    counter.reset(fenced)
    assert counter.next() >= fenced
    counter.reset(ntasks)
    assert counter.fence(ntasks, big) is None if comm.rank == 0 else True  # nothing left to fence
    # racing: rank 0 fences while the others draw; every value below the fence is drawn exactly
    # once, every draw after it is past the offset, in sequence (no value lost or doubled)
    counter.reset(0)
    drawn, fenced = [], None
    for t in range(40):
        if comm.rank == 0 and t == 20:
            fenced = counter.fence(1 << 30, big)
        drawn.append(counter.next())
    fenced = comm.bcast(fenced, root=0)
    everything = [v for values in comm.allgather(drawn) for v in values]
    assert sorted(v for v in everything if v < big) == list(range(fenced)), fenced
    after = sorted(v - big for v in everything if v >= big)
    assert after == list(range(fenced, fenced + len(after))) and len(after) >= 20, (fenced, after[:5])
    counter.free()


def check_discard(comm):
    """Each rank gives back the pages of its rows: in shared memory the whole pages inside them
    read as zeros afterwards on every rank (at most one page at each end of a block keeps its
    values); out of it nothing changes."""
    page = mmap.PAGESIZE // 8  # float64 elements in a page
    ga = GlobalArray(comm, (4 * comm.size, 8 * page), np.float64, zero=False)
    ref = np.arange(1, ga.shape[0] * ga.shape[1] + 1, dtype=np.float64).reshape(ga.shape)
    lo, hi = ga.rows
    ga.local()[...] = ref[lo:hi]
    comm.Barrier()
    ga.discard((0, ga.shape[0]))  # only this rank's rows
    ga.local()
    comm.Barrier()
    got = ga.get(())
    assert np.all((got == ref) | (got == 0))
    for r in range(comm.size):
        a, b = ga.rows_of(r)
        zeros = int(np.sum(got[a:b] == 0))
        assert zeros >= (b - a) * ga.shape[1] - 2 * page if ga.shared else zeros == 0, (r, zeros)
    comm.Barrier()
    ga.free()


def vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def check_huge_pages(comm):
    """Each rank's block is advised for transparent huge pages before its first touch: the whole
    pages inside it carry the ``hg`` flag (``MADV_HUGEPAGE``) where the kernel has them."""
    if not Path("/sys/kernel/mm/transparent_hugepage").exists():
        return
    ga = GlobalArray(comm, (4 * comm.size, 1024 * mmap.PAGESIZE // 8), np.float64)
    block = ga.local()
    first = -(-block.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (block.ctypes.data + block.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE - 1  # in the last whole page
    assert "hg" in vm_flags(first) and "hg" in vm_flags(last)
    assert not block.any()
    comm.Barrier()
    ga.free()


def check_board(comm):
    """Every rank publishes a growing count in each of two slots while reading the others': what
    it reads of a rank never goes back and is always a value that rank published (3·step + rank
    in slot 0, 2^40 + step in slot 1: none torn, slots and ranks kept apart), its own entry is
    its latest at once, and every rank's last value is there once all are done."""
    board = Board(comm, 2)
    assert list(board.read(0)) == [0] * comm.size and list(board.read(1)) == [0] * comm.size
    comm.Barrier()  # before any rank publishes
    steps = 200
    last = np.zeros((2, comm.size), np.int64)
    for step in range(1, steps + 1):
        board.publish(0, 3 * step + comm.rank)
        board.publish(1, (1 << 40) + step)
        for slot in (0, 1):
            seen = board.read(slot)
            assert np.all(seen >= last[slot]), (slot, seen, last[slot])
            published = [(v - r) % 3 == 0 and v <= 3 * steps + r if slot == 0 else (v >> 40) == 1
                         for r, v in enumerate(seen) if v]
            assert all(published), (slot, seen)
            last[slot] = seen
        mine = board.read(0)[comm.rank]
        assert mine == 3 * step + comm.rank, mine
    comm.Barrier()
    assert list(board.read(0)) == [3 * steps + r for r in range(comm.size)]
    assert list(board.read(1)) == [(1 << 40) + steps] * comm.size
    comm.Barrier()
    board.free()


def main():
    seed = int(sys.argv[1])
    comm = MPI.COMM_SELF if "--self" in sys.argv else MPI.COMM_WORLD
    globalarray.SHARED_MEMORY = "--rma" not in sys.argv
    # Shapes and data are seeded alike on every rank of comm; under --self, ranks differ anyway.
    rng = np.random.default_rng([seed, comm.size, MPI.COMM_WORLD.rank if comm is MPI.COMM_SELF else 0])
    try:
        for dtype in DTYPES:
            for _ in range(4):
                check_patches(comm, rng, dtype)
                check_accumulate(comm, rng, dtype)
                check_views(comm, rng, dtype)
        check_degenerate(comm, rng)
        check_counter(comm)
        check_board(comm)
        check_discard(comm)
        check_huge_pages(comm)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(1)
        sys.exit(1)  # MPICH's Abort can return before the process manager kills the job
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.rank == 0:
        print("OK")


if __name__ == "__main__":
    main()
