"""Device milliseconds of one call, without the host's time to issue its work.

A call timed between two CUDA events on an idle device also counts the time the host takes to
issue its launches: the first event completes at once and the device then waits for the host.
For a kernel of a tenth of a millisecond, issued from Python through CuPy, that wait is a
large part of what the events measure, and it is not the kernel's: in a chain the host issues
ahead of the device, and a roofline bound is a bound on the device's time.

:class:`Stopwatch` holds the stream with a one-thread kernel that spins on a flag in
page-locked host memory, records the first event, issues the call, records the second event,
and only then sets the flag: the events bracket the device's work alone, as NVBench's blocking
kernel does. Every contender timed through it is timed the same way.

A call that waits for the device itself (a copy into pageable memory, a synchronize) would wait
for the spinning kernel forever; the spin gives up after :data:`HOLD_S` seconds, the time is
thrown away, and that call is timed without the hold from then on (:attr:`Stopwatch.unheld`).
"""

from __future__ import annotations

import numpy as np

HOLD_S = 0.5
"""Seconds the holding kernel spins before it gives up (longer than any call takes to issue its
work, far shorter than a run)."""

_SOURCE = r"""
extern "C" __global__ void chainexec_hold(unsigned long long release, unsigned long long gave_up,
                                          unsigned long long timeout_ns) {
    const volatile int* flag = reinterpret_cast<const volatile int*>(release);
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        if (*flag) return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < timeout_ns);
    *reinterpret_cast<volatile int*>(gave_up) = 1;
}
"""


class Stopwatch:
    """Times calls on the current device (:meth:`ms`); one per process and device is enough."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.kernel = cupy.RawKernel(_SOURCE, "chainexec_hold")
        # two int32 flags in page-locked host memory, read and written by the device in place
        self.flags = np.ndarray(2, np.int32, buffer=cupy.cuda.alloc_pinned_memory(8))
        self.start, self.stop = cupy.cuda.Event(), cupy.cuda.Event()
        self.unheld: set[int] = set()
        """``id`` of each call that waited for the device under the hold: timed without it."""

    def ms(self, fn) -> float:
        """Milliseconds between the device starting ``fn()``'s first work and ending its last."""
        if id(fn) in self.unheld:
            return self._events(fn)
        self.flags[:] = 0
        address = self.flags.ctypes.data
        self.kernel((1,), (1,), (np.uint64(address), np.uint64(address + 4), np.uint64(int(HOLD_S * 1e9))))
        ms = self._events(fn, release=True)
        if self.flags[1]:
            self.unheld.add(id(fn))
            return self._events(fn)
        return ms

    def _events(self, fn, release: bool = False) -> float:
        self.start.record()
        fn()
        self.stop.record()
        if release:
            self.flags[0] = 1
        self.stop.synchronize()
        return self.cupy.cuda.get_elapsed_time(self.start, self.stop)
