"""The registry of host memory locked in place (:mod:`chainexec.runtime.hostlock`), against a
stand-in for CuPy's runtime that records the calls: what is registered (flags, range, device),
which views count as locked, that an unlock waits for its events and keeps the array until the
driver lets it go, and what happens where the driver refuses. The GPU's side:
tests/runtime/test_hostlock_gpu.py."""

import threading
import types

import numpy as np
import pytest

from chainexec.runtime import hostlock


class Refused(Exception):
    pass


class Event:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append(("event", threading.current_thread().name))


def fake_cupy(log, refuse=()):
    """A module with the parts of ``cupy.cuda`` that :class:`hostlock.Locks` uses; a call named in
    ``refuse`` raises the runtime's error."""
    current = [3]

    class Device:
        def __init__(self, n=None):
            self.id, self.n = current[0], n

        def __enter__(self):
            log.append(("device", self.n))

        def __exit__(self, *exc):
            return False

    def call(name):
        def run(*args):
            if name in refuse:
                raise Refused(name)
            log.append((name,) + args)
        return run

    runtime = types.SimpleNamespace(hostRegister=call("register"), hostUnregister=call("unregister"),
                                    CUDARuntimeError=Refused)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device, runtime=runtime))


def test_lock_registers_read_only_and_holds_views_inside():
    log = []
    locks = hostlock.Locks(fake_cupy(log))
    a = np.arange(300000.0)  # 2.4 MB
    handle = locks.lock(a)
    assert handle == a.ctypes.data
    assert log == [("device", 3), ("register", a.ctypes.data, a.nbytes, hostlock.READ_ONLY | hostlock.PORTABLE)]
    assert locks.holds(a[10:500]) and locks.holds(a) and not locks.holds(np.zeros(10))
    assert locks.lock(np.zeros(1000)) is None and locks.lock(np.zeros((3000, 200))[:, ::2]) is None
    assert len(log) == 2  # neither reached the driver


def test_unlock_waits_for_its_events_then_lets_the_array_go():
    log = []
    locks = hostlock.Locks(fake_cupy(log))
    a = np.arange(300000.0)
    handle = locks.lock(a)
    locks.unlock(handle, [Event(log), Event(log)])
    locks.settle()
    tail = log[2:]
    assert [x[0] for x in tail] == ["event", "event", "device", "unregister"]
    assert tail[0][1].startswith("chainexec-unlock") and tail[3] == ("unregister", handle)
    assert not locks.holds(a) and not locks._spans


def test_a_refused_lock_is_none_and_a_refused_unlock_keeps_the_range():
    log = []
    locks = hostlock.Locks(fake_cupy(log, refuse=("register",)))
    assert locks.lock(np.arange(300000.0)) is None
    log.clear()
    locks = hostlock.Locks(fake_cupy(log, refuse=("unregister",)))
    a = np.arange(300000.0)
    handle = locks.lock(a)
    with pytest.warns(RuntimeWarning, match="stays page-locked"):  # raised on the unlock thread
        locks.unlock(handle, [])
        locks.settle()
    assert locks.holds(a) and locks._spans[handle][1] is a  # the mapping is kept, not unmapped while locked


def test_a_writable_lock_is_registered_writable_and_held_as_such():
    """``writable``: registered without the read-only flag; :meth:`Locks.holds` with ``writable``
    finds views of it, and not of a read-only lock."""
    log = []
    locks = hostlock.Locks(fake_cupy(log))
    a, b = np.arange(300000.0), np.arange(300000.0)
    locks.lock(a, writable=True)
    locks.lock(b)
    assert log[1] == ("register", a.ctypes.data, a.nbytes, hostlock.PORTABLE)
    assert locks.holds(a[5:9], writable=True) and locks.holds(a[5:9])
    assert locks.holds(b[5:9]) and not locks.holds(b[5:9], writable=True)


def test_a_waiting_unlock_unregisters_on_the_callers_thread_before_returning():
    log = []
    locks = hostlock.Locks(fake_cupy(log))
    a = np.arange(300000.0)
    handle = locks.lock(a, writable=True)
    locks.unlock(handle, [Event(log)], wait=True)
    assert log[2:] == [("event", threading.current_thread().name), ("device", 3), ("unregister", handle)]
    assert not locks.holds(a) and not locks._spans and locks._pool is None


def test_a_refused_waiting_unlock_forgets_the_range_its_caller_frees():
    """Where the driver refuses an unlock the caller waits for (it frees the memory next), a
    warning says so and the range is forgotten: nothing finds memory locked there afterwards."""
    log = []
    locks = hostlock.Locks(fake_cupy(log, refuse=("unregister",)))
    a = np.arange(300000.0)
    handle = locks.lock(a, writable=True)
    with pytest.warns(RuntimeWarning, match="stays page-locked"):
        locks.unlock(handle, [], wait=True)
    assert not locks.holds(a, writable=True) and not locks._spans
