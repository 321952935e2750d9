"""A NumPy backend that behaves as CuPy's does with queued work (imported by the scripts that
tests/runtime/test_executor.py and test_checkpoint.py run in their own processes)."""

import numpy as np

from chainexec.runtime.backends.numpy import NumpyBackend


class Queued(NumpyBackend):
    """NumPy, as if every compute statement were still running when it returns: a stamp is a
    number, a statement takes 0.25 s between its two stamps, and every fetch records how many
    stamps nothing has waited for yet. A copy to the host is queued too: its host array is NaN
    until every stamp before it has been waited for or read, so landing it early poisons E."""

    def __init__(self):
        super().__init__()
        self.clock, self.open, self.seen, self.early = 0, set(), [], 0
        self.copies, self.queued_copies, self.unlanded = [], [], []

    def stamp(self):
        self.clock += 1
        self.open.add(self.clock)
        return self.clock

    def elapsed(self, start, end):
        self.early += bool(self.open - {start, end})  # read while later statements are still queued
        self.open -= {start, end}
        return 0.25 * (end - start)

    def wait(self):
        self.open.clear()
        for copy in self.copies:
            self.arrived(copy)

    def fetch(self, dst, read, view=None):
        self.seen.append(len(self.open))
        super().fetch(dst, read, view)

    def to_host_async(self, array, aside=False):
        self.queued_copies.append(len(self.open))
        self.unlanded.append(sum(not copy.get("arrived") for copy in self.copies))
        copy = {"after": self.clock, "host": np.full(array.shape, np.nan), "data": array.copy()}
        self.copies.append(copy)
        return copy["host"], copy

    def reach_copy(self, copy):
        self.open -= {s for s in self.open if s <= copy["after"]}
        self.arrived(copy)

    def arrived(self, copy):
        if any(s <= copy["after"] for s in self.open):
            return False
        copy["host"][...] = copy["data"]
        copy["arrived"] = True
        return True
