"""The page-locked upload arena's ring, with a stand-in stream whose copies to the "device" run only
when an event after them is waited for (as a DMA may run any time after it is queued): every
upload arrives whole, whatever the rows, parts and wraps; a part of the ring is written again
only after the copy out of it is done; the host's rows may change once ``upload`` returns; what
the arena does not take (no arena, small copies, rows over half the ring) is left to the caller."""

from __future__ import annotations

import types

import numpy as np
import pytest

from chainexec.runtime import arena


class Stream:
    """Copies queued in order, run when an event recorded after them is synchronized."""

    def __init__(self):
        self.queued: list[tuple[np.ndarray, np.ndarray]] = []
        self.ran = 0
        self.waits = 0

    def record(self):
        stream, upto = self, len(self.queued)

        class Event:
            @property
            def done(self):
                return stream.ran >= upto

            def synchronize(self):
                stream.waits += 1
                stream.run(upto)

        return Event()

    def run(self, upto: int) -> None:
        while self.ran < upto:
            dst, src = self.queued[self.ran]
            dst[...] = src  # the ring's bytes as they are now: a reuse too early shows here
            self.ran += 1


class Device:
    """A device array standing in for CuPy's: ``set`` queues the copy on the stream."""

    def __init__(self, data: np.ndarray):
        self.data = data

    @property
    def shape(self):
        return self.data.shape

    def __getitem__(self, key):
        return Device(self.data[key])

    def set(self, host, stream):
        assert host.shape == self.data.shape and host.flags.c_contiguous
        stream.queued.append((self.data, host))


@pytest.fixture
def ring(monkeypatch):
    """A 64 KiB arena for GPU 0 of a stand-in CuPy."""
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0)))
    made = arena.Arena(np.empty(64 << 10, np.uint8))
    monkeypatch.setattr(arena, "_ARENAS", {0: made})
    monkeypatch.setattr(arena, "SMALLEST", 1 << 10)
    return fake, made


@pytest.mark.parametrize("shape", [(40, 100), (7, 3, 50), (500, 8), (64, 64), (3, 4000)])
def test_uploads_arrive_whole_through_the_ring(ring, shape):
    """Several uploads in a row (each in parts of at most half the ring, wrapping around it) all
    arrive, each byte from its own host array; the host arrays are overwritten as soon as
    ``upload`` returns."""
    fake, made = ring
    rng = np.random.default_rng(sum(shape))
    stream = Stream()
    hosts = [rng.standard_normal(shape) for _ in range(5)]
    expected = [h.copy() for h in hosts]
    targets = [np.zeros(shape) for _ in hosts]
    for host, target in zip(hosts, targets):
        assert arena.upload(fake, Device(target), host, stream)
        host[...] = -1.0  # read already: changing it changes nothing on the device
    stream.run(len(stream.queued))
    for target, want in zip(targets, expected):
        np.testing.assert_array_equal(target, want)
    assert all(a < b for a, b, _ in made.busy) and made.at <= made.memory.nbytes


def test_a_part_is_reused_only_after_its_copy():
    """Filling the ring again waits for exactly the copies out of the bytes it overwrites: the
    first part's, not the second's (the stream runs nothing by itself)."""
    made = arena.Arena(np.empty(1 << 12, np.uint8))
    stream = Stream()
    rows = [np.full((1, 256), float(k)) for k in range(3)]  # 2 KiB each: half the ring
    targets = [np.zeros((1, 256)) for _ in rows]
    made.upload(Device(targets[0]), rows[0], stream)
    made.upload(Device(targets[1]), rows[1], stream)
    assert stream.ran == 0 and stream.waits == 0
    made.upload(Device(targets[2]), rows[2], stream)  # over the first part's bytes
    assert stream.ran == 1 and stream.waits == 1
    stream.run(len(stream.queued))
    for k, target in enumerate(targets):
        assert (target == k).all()


def test_what_the_arena_does_not_take(ring, monkeypatch):
    """No arena made (a run from Python), a copy under :data:`arena.SMALLEST`, a 0-d array and a
    row over half the ring: False, nothing queued."""
    fake, made = ring
    stream = Stream()
    small = np.ones((4, 4))
    assert not arena.upload(fake, Device(np.zeros((4, 4))), small, stream)
    wide = np.ones((2, 5000))  # 40 KB rows, the ring's half is 32 KiB
    assert not arena.upload(fake, Device(np.zeros((2, 5000))), wide, stream)
    assert not made.upload(Device(np.zeros(())), np.ones(()), stream)
    monkeypatch.setattr(arena, "_ARENAS", {})
    assert not arena.upload(fake, Device(np.zeros((40, 100))), np.ones((40, 100)), stream)
    assert not stream.queued
