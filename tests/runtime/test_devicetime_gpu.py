"""The stopwatch on a GPU: a call whose host side sleeps before it issues a kernel of known
device duration is timed at the kernel's duration, where plain events count the sleep too; a
call that waits for the device itself is timed (without the hold) instead of hanging.

Skipped without CuPy or a CUDA device; marked ``alone``: another process's kernels on the same
GPU would stretch the timed spans. The reference durations are the device's own global
timer read inside a spinning kernel, which shares no code with the stopwatch.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.conftest import require_gpu

cupy = require_gpu()

from chainexec.runtime.devicetime import HOLD_S, Stopwatch  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.alone]  # timings: the device to itself

SPIN = cupy.RawKernel(r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}
""", "spin")

KERNEL_MS = 2.0


def slow_host(sleep_s: float, waits: bool = False):
    """A call that sleeps ``sleep_s`` on the host, then spins the device for KERNEL_MS, and
    (``waits``) then waits for the device."""
    def call():
        time.sleep(sleep_s)
        SPIN((1,), (1,), (np.uint64(int(KERNEL_MS * 1e6)),))
        if waits:
            cupy.cuda.Device().synchronize()
    return call


def plain_ms(fn) -> float:
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop)


@pytest.mark.parametrize("sleep_s", [0.005, 0.02])
def test_host_time_is_left_out(sleep_s):
    fn = slow_host(sleep_s)
    fn()
    watch = Stopwatch(cupy)
    held = [watch.ms(fn) for _ in range(3)]
    assert plain_ms(fn) >= 1e3 * sleep_s + KERNEL_MS
    assert all(KERNEL_MS <= ms < KERNEL_MS + 0.5 for ms in held), held
    assert not watch.unheld


def test_a_call_that_waits_for_the_device_is_timed_unheld():
    fn = slow_host(0.001, waits=True)
    fn()
    watch = Stopwatch(cupy)
    began = time.perf_counter()
    first = watch.ms(fn)
    assert time.perf_counter() - began < 2 * HOLD_S + 1.0
    assert id(fn) in watch.unheld
    assert KERNEL_MS <= first < KERNEL_MS + 5.0
    began = time.perf_counter()
    assert KERNEL_MS <= watch.ms(fn) < KERNEL_MS + 5.0
    assert time.perf_counter() - began < HOLD_S
