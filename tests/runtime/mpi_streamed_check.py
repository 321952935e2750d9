"""Streamed inputs on several ranks: the (T) job of CONFIG run under mpiexec with a NumPy backend
that records, on each rank, the chunks copied beside the work and what the device copy of
``ovvv`` holds when the rank's first tile starts, the parts of the streamed inputs it reads
from disk through HDF5, the inputs' pages it loads through their file's mapping (as (shape of a
row, first row, rows, first and end element of the rows' second axis)), the rows of the
streamed inputs it gives back (poisoned with NaN instead, so that a row given back too early
spoils the energy), and each tile's contribution it adds to the energy (``float.hex``). Writes
OUT/rank<R>.json per rank (and the run's measured and predicted bytes and peaks and its number
of hosts on rank 0).

Usage: ``mpiexec -n N python mpi_streamed_check.py CONFIG OUT [--rma] [--refuse R]`` (``--rma``:
global arrays out of shared memory; ``--refuse R``: rank R cannot map any file, as where it ran out
of descriptors) (tests/runtime/test_executor.py).
"""

import json
import sys
import traceback

import numpy as np
from mpi4py import MPI

from chainexec import api
from chainexec.runtime import globalarray, mapped, store
from chainexec.runtime.backends.numpy import NumpyBackend

STREAMED = ("ovvv", "ovoo", "t1")


def main():
    config, out = sys.argv[1:3]
    globalarray.SHARED_MEMORY = "--rma" not in sys.argv
    comm = MPI.COMM_WORLD
    aside, first = [], []

    class Recording(NumpyBackend):
        def fetch_aside(self, dst, read, after=None, view=None):
            aside.append(list(dst.shape))
            super().fetch_aside(dst, read, after, view)

        def contract_sum(self, cs, out_, operands, fresh=False):
            if not first:
                views = [a for c, (a, _) in zip(cs, operands) if c.a == "ovvv"]
                buf = views[0].base
                row = buf[0].nbytes
                need = max((v.ctypes.data - buf.ctypes.data) // row + v.shape[0] for v in views)
                filled = [bool(np.all(r != 0)) for r in buf]
                empty = [bool(np.all(r == 0)) for r in buf]
                first.append({"need": int(need), "rows": len(buf), "filled": filled, "empty": empty})
            super().contract_sum(cs, out_, operands, fresh)

    reads = []
    plain_read = store.Store.read

    def recording_read(self, tensor, version, region, out_):
        if tensor in STREAMED:
            reads.append([tensor, [list(r) for r in region]])
        plain_read(self, tensor, version, region, out_)

    store.Store.read = recording_read
    populated = []
    plain_populate = mapped.MappedArray.populate

    def recording_populate(self, rows):
        whole = self.whole()
        at, row = rows.ctypes.data - whole.ctypes.data, whole[0].nbytes
        first = at % row // (row // whole.shape[1]) if whole.ndim > 1 else 0
        width = rows.shape[1] if whole.ndim > 1 else 1
        populated.append([list(whole.shape[1:]), at // row, rows.shape[0], first, first + width])
        plain_populate(self, rows)

    mapped.MappedArray.populate = recording_populate
    if "--refuse" in sys.argv and comm.rank == int(sys.argv[sys.argv.index("--refuse") + 1]):
        def refused(*args):
            raise OSError("no file descriptors left")

        mapped.MappedArray.__init__ = refused
    discarded = []

    def poisoning_discard(self, rows):  # as if the pages were gone: NaN, so a later read shows
        lo, hi = max(rows[0], self.rows[0]), min(rows[1], self.rows[1])
        if self.shared and hi > lo:
            discarded.append([self.shape[1:], lo, hi])
            self.block(comm.rank)[lo - self.rows[0]:hi - self.rows[0]] = np.nan

    globalarray.GlobalArray.discard = poisoning_discard
    added = []
    plain_accumulate = globalarray.GlobalArray.accumulate

    def recording_accumulate(self, region, data):
        if not self.shape:
            added.append(float(data).hex())
        plain_accumulate(self, region, data)

    globalarray.GlobalArray.accumulate = recording_accumulate
    api.select = lambda name, comm: Recording()
    try:
        result = api.run(config, backend="numpy")
        mine = {"aside": aside, "first": first, "reads": reads, "populated": populated, "discarded": discarded,
                "added": added}
        if comm.rank == 0:
            mine |= {"measured": result["measured"]["bytes"], "predicted": result["predicted"]["bytes"],
                     "peaks": [result["measured"]["memory_peak"], result["predicted"]["memory_peak"]],
                     "hosts": result["run"]["hosts"]}
        with open(f"{out}/rank{comm.rank}.json", "w") as f:
            json.dump(mine, f)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        comm.Abort(1)
        sys.exit(1)
    comm.Barrier()
    if comm.rank == 0:
        print("OK")


if __name__ == "__main__":
    main()
