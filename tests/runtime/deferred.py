"""A NumPy backend that runs its work as late as a GPU may, its second stream's copies as early
as their ``after`` mark allows, and its copies to the host aside as late as anything waits for
them (imported by tests/runtime/test_pipeline.py): a copy into a slot that overtook a statement
still reading the slot's old tile, or a tile computed into a slot before the slot's last copy to
the host, changes the result."""

import numpy as np

from chainexec.runtime.backends.numpy import NumpyBackend


class Mark:
    """A point in the compute queue: the number of items queued before it."""

    def __init__(self, position: int):
        self.position = position


class Copy(Mark):
    """A copy to the host aside, to run once the queue has passed ``position``."""

    def __init__(self, position: int, copy):
        super().__init__(position)
        self.copy, self.ran = copy, False


class Deferred(NumpyBackend):
    """Compute statements and compute-stream copies are queued and run only when something waits
    for a mark after them (``elapsed``, ``reach``, ``wait``, a landed accumulate); a
    ``fetch_aside`` copy runs as soon as the queue has passed its ``after`` mark (at once
    without one). A copy to the host aside runs only when something waits for it (``arrived``
    does not: a GPU's copy may still be running then). ``honour_after`` False ignores the marks,
    ``honour_wait`` False ignores ``wait_for``: the races they prevent."""

    def __init__(self, honour_after: bool = True, honour_wait: bool = True):
        super().__init__()
        self.queue, self.done, self.aside, self.back = [], 0, [], []
        self.honour_after, self.honour_wait = honour_after, honour_wait

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
        for copy in self.back:
            self._copy_back(copy)
        self.back = []

    def _copy_back(self, copy: Copy) -> None:
        if not copy.ran:
            self._run_to(copy.position)
            copy.copy()
            copy.ran = True

    def wait_for(self, token):
        if token is not None and self.honour_wait:
            self.queue.append(lambda: self._copy_back(token))

    def clear(self, array):
        self.queue.append(lambda: array.fill(0))

    def contract(self, c, out, a, b, fresh=False):
        if fresh:  # queued before the product (the base class's clear would queue it after)
            self.clear(out)
        self.queue.append(lambda: NumpyBackend.contract(self, c, out, a, b))

    def contract_terms(self, cs, out, operands, fresh=False):
        if fresh:
            self.clear(out)
        self.queue.append(lambda: [NumpyBackend.contract(self, c, out, a, b) for c, (a, b) in zip(cs, operands)])

    contract_sum = contract_terms  # (the base class's run term by term through self.contract, queued here)

    def symmetrize(self, out, axes, keep=()):
        self.queue.append(lambda: NumpyBackend.symmetrize(self, out, axes, keep))

    def evaluate(self, tree, arrays, order, out):
        self.queue.append(lambda: NumpyBackend.evaluate(self, tree, arrays, order, out))

    def fused(self, f, arrays, shape, out, within=()):
        self.queue.append(lambda: NumpyBackend.fused(self, f, arrays, shape, out, within))

    def _read(self, dst, read) -> np.ndarray:
        host = np.empty(dst.shape, dst.dtype)
        read(slice(0, dst.shape[0]) if dst.ndim else None, host)
        return host

    def fetch(self, dst, read, view=None):
        host = self._read(dst, read)
        self.queue.append(lambda: dst.__setitem__(Ellipsis, host))

    def fetch_aside(self, dst, read, after=None, view=None):
        host = self._read(dst, read)
        at = after.position if after is not None and self.honour_after else self.done
        self.aside.append((at, lambda: dst.__setitem__(Ellipsis, host)))
        self._run_to(self.done)  # copies whose mark is passed run now

    def to_host_async(self, array, aside=False):
        host = np.full(array.shape, np.nan)
        if aside:
            copy = Copy(len(self.queue), lambda: host.__setitem__(Ellipsis, array))
            self.back.append(copy)
            return host, copy
        self.queue.append(lambda: host.__setitem__(Ellipsis, array))
        return host, Mark(len(self.queue))

    def arrived(self, token):
        return token.ran if isinstance(token, Copy) else self.done >= token.position
