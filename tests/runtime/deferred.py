"""A NumPy backend that runs its work as late as a GPU may and its second stream's copies as early
as their ``after`` mark allows (imported by tests/runtime/test_pipeline.py): a copy into a slot
that overtook a statement still reading the slot's old tile changes the result."""

import numpy as np

from chainexec.runtime import device


class Mark:
    """A point in the compute queue: the number of items queued before it."""

    def __init__(self, position: int):
        self.position = position


class Deferred(device.Backend):
    """Compute statements and compute-stream copies are queued and run only when something waits
    for a mark after them (``elapsed``, ``reach``, ``wait``, a landed accumulate); a
    ``fetch_aside`` copy runs as soon as the queue has passed its ``after`` mark (at once
    without one). ``honour_after`` False ignores the marks: the race the marks prevent."""

    def __init__(self, honour_after: bool = True):
        super().__init__()
        self.queue, self.done, self.aside = [], 0, []
        self.honour_after = honour_after

    def _run_to(self, position: int) -> None:
        while True:
            ready = [copy for at, copy in self.aside if at <= self.done]
            self.aside = [(at, copy) for at, copy in self.aside if at > self.done]
            for copy in ready:
                copy()
            if self.done >= position:
                return
            self.queue[self.done]()
            self.done += 1

    def stamp(self):
        return Mark(len(self.queue))

    def elapsed(self, start, end):
        self._run_to(end.position)
        return 0.0

    def reach(self, mark):
        self._run_to(mark.position)

    def wait(self):
        self._run_to(len(self.queue))

    def contract(self, c, out, a, b):
        self.queue.append(lambda: device.Backend.contract(self, c, out, a, b))

    def contract_terms(self, cs, out, operands):
        self.queue.append(lambda: [device.Backend.contract(self, c, out, a, b) for c, (a, b) in zip(cs, operands)])

    contract_sum = contract_terms  # (the base class's run term by term through self.contract, queued here)

    def evaluate(self, tree, arrays, order, out):
        self.queue.append(lambda: device.Backend.evaluate(self, tree, arrays, order, out))

    def fused(self, f, arrays, shape, out):
        self.queue.append(lambda: device.Backend.fused(self, f, arrays, shape, out))

    def _read(self, dst, read) -> np.ndarray:
        host = np.empty(dst.shape, dst.dtype)
        read(slice(0, dst.shape[0]) if dst.ndim else None, host)
        return host

    def fetch(self, dst, read):
        host = self._read(dst, read)
        self.queue.append(lambda: dst.__setitem__(Ellipsis, host))

    def fetch_aside(self, dst, read, after=None):
        host = self._read(dst, read)
        at = after.position if after is not None and self.honour_after else self.done
        self.aside.append((at, lambda: dst.__setitem__(Ellipsis, host)))
        self._run_to(self.done)  # copies whose mark is passed run now

    def to_host_async(self, array):
        host = np.full(array.shape, np.nan)
        self.queue.append(lambda: host.__setitem__(Ellipsis, array))
        return host, Mark(len(self.queue))

    def arrived(self, token):
        return self.done >= token.position
