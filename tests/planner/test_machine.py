"""The machine model's writes (:meth:`Machine.write_seconds`): the page cache takes each rank's
first ``write_cache_bytes`` bytes at ``disk_write_cached``, the rest goes at ``disk_write``; without a
cached rate every byte goes at ``disk_write``."""

from __future__ import annotations

import pytest

from chainexec.planner.machine import Machine

MB = 10**6


@pytest.mark.parametrize("nbytes, ranks, expected", [
    (0, 1, 0.0),
    (300 * MB, 1, 300 / 3000),                      # within one rank's cache
    (1500 * MB, 1, 1000 / 3000 + 500 / 200),       # past it: the rest at the disk's rate
    (1500 * MB, 2, 1500 / 3000),                   # two ranks' caches hold it all
    (4500 * MB, 3, 3000 / 3000 + 1500 / 200),
])
def test_writes_fill_each_ranks_cache_then_go_at_the_disks_rate(nbytes, ranks, expected):
    machine = Machine(disk_write=200 * MB, disk_write_cached=3000 * MB, write_cache_bytes=1000 * MB)
    assert machine.write_seconds(nbytes, ranks) == pytest.approx(expected, rel=1e-12)
    moved = {"disk->global": 700 * MB, "global->disk": nbytes, "global->device": 0, "device->global": 0}
    assert machine.seconds(moved, 0.0, 0.0, ranks)["disk"] == pytest.approx(700 / 1000 + expected, rel=1e-12)


@pytest.mark.parametrize("cache", [0, 1000 * MB])
def test_without_a_cached_rate_every_write_goes_at_the_disks_rate(cache):
    machine = Machine(disk_write=200 * MB, write_cache_bytes=cache)
    assert machine.write_seconds(1500 * MB, 2) == pytest.approx(1500 / 200, rel=1e-12)
    assert Machine(disk_write=200 * MB, disk_write_cached=3000 * MB).write_seconds(1500 * MB) == pytest.approx(1500 / 200)
