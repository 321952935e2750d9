"""A run under mpiexec in which the last rank's loads of one tensor land late: its disk worker
zeroes each tile of TENSOR it loads (as a freshly allocated window holds), waits SECONDS, then
reads it. A rank that copies a tile of TENSOR before every rank's loads of it have landed reads
zeros there.

Usage: ``mpiexec -n N python mpi_slow_loads.py CONFIG TENSOR SECONDS`` (tests/runtime/test_executor.py).
"""

import sys
import time

from mpi4py import MPI

from chainexec import api
from chainexec.runtime import store


def main():
    config, tensor, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    comm = MPI.COMM_WORLD
    read = store.Store.read

    def late(self, name, version, region, out):
        if name == tensor and comm.rank == comm.size - 1:
            out[...] = 0
            time.sleep(seconds)
        read(self, name, version, region, out)

    store.Store.read = late
    api.run(config, backend="numpy", plan_cache=False)
    if comm.rank == 0:
        print("OK")


if __name__ == "__main__":
    main()
