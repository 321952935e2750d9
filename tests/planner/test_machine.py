"""The machine model's writes (:meth:`Machine.write_seconds`): the page cache takes each rank's
first ``write_cache_bytes`` bytes at ``disk_write_cached``, the rest goes at ``disk_write``; without a
cached rate every byte goes at ``disk_write``. A machine file's byte counts (:meth:`Machine.parse`)."""

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


@pytest.mark.parametrize("written, expected", [("1e9", 10**9), ("1073741824.0", 1 << 30), ("4096", 4096),
                                               ("9.2e18", 9_200_000_000_000_000_000), ("1e19", None), ("1" + "0" * 400, None)])
def test_a_machine_files_byte_counts_may_be_written_as_floats_with_no_fraction(written, expected):
    """``1e9`` bytes is a whole number: it reads as the integer (a byte count the planner divides
    into tiles stays an ``int``); past 2^63 - 1 it is refused as any other size out of range, an
    integer too large for a float too (it ended in a traceback)."""
    import json

    from chainexec.errors import ChainexecError

    text = json.dumps(json.loads(Machine().to_json()) | {"write_cache_bytes": 0}).replace(
        '"write_cache_bytes": 0', f'"write_cache_bytes": {written}')
    if expected is None:
        with pytest.raises(ChainexecError, match="'write_cache_bytes'.*at most 2\\^63 - 1"):
            Machine.parse(text, "m.json")
        return
    machine, given = Machine.parse(text, "m.json")
    assert machine.write_cache_bytes == expected and type(machine.write_cache_bytes) is int
    assert "write_cache_bytes" in given
