"""The stall watch (``run --stall-timeout``): its thread ends the run only after the timeout
without a finished statement, names what it last saw finish, stops with the run, and a bad
timeout is a one-line error. The two-rank run a stopped rank stalls is in
``tests/runtime/test_checkpoint.py``."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from chainexec import api
from chainexec.errors import ChainexecError
from chainexec.runtime import watchdog
from chainexec.runtime.executor import Executor
from tests.conftest import fourindex_config, run_cli, write_config


class Recorded(watchdog.Watchdog):
    """A watch that records each time it would end the run, instead of ending it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fired: list[str] = []

    def stalled(self) -> None:
        self.fired.append(self.message())
        self.last = self.clock()  # one record per stall


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan"), float("inf")])
def test_a_timeout_that_is_not_a_positive_number_is_refused(seconds):
    with pytest.raises(ChainexecError, match="--stall-timeout must be a positive number of seconds"):
        watchdog.check_timeout(seconds)


def test_the_command_refuses_a_bad_timeout_in_one_line(tmp_path):
    config = write_config(tmp_path, fourindex_config())
    proc = run_cli("run", config, "--stall-timeout", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "--stall-timeout" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_message_names_the_rank_the_time_and_the_last_statement():
    now = [100.0]
    watch = watchdog.Watchdog(10, SimpleNamespace(rank=3), clock=lambda: now[0])
    watch.beat("get A")
    now[0] = 112.4
    line = watch.message()
    assert line.startswith("chainexec: rank 3 has finished no statement for 12 s (--stall-timeout 10; ")
    assert "the last one finished: get A)" in line and f"status {watchdog.STALLED}" in line
    assert "\n" not in line


def test_beats_keep_the_watch_quiet_and_a_stall_ends_it():
    watch = Recorded(0.2, SimpleNamespace(rank=0))
    watch.start()
    try:
        beating = time.monotonic() + 0.8
        while time.monotonic() < beating:
            watch.beat("#0")
            time.sleep(0.01)
        assert watch.fired == []
        deadline = time.monotonic() + 5
        while not watch.fired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.fired and "the last one finished: #0)" in watch.fired[0]
    finally:
        watch.stop()
    fired = len(watch.fired)
    time.sleep(0.5)
    assert len(watch.fired) == fired  # stopped: it watches no more
    assert not any(t.name == "chainexec-watchdog" for t in threading.enumerate())


def test_no_timeout_starts_no_thread():
    watch = watchdog.Watchdog(None, SimpleNamespace(rank=0))
    watch.start()
    assert not any(t.name == "chainexec-watchdog" for t in threading.enumerate())
    watch.stop()


def test_a_run_watches_its_statements(tmp_path, monkeypatch):
    """A run with a stall timeout of 0.3 s whose first statement other than a contraction takes
    1.5 s: its watch sees the stall while it runs, naming what finished before it; the same run with its
    statements at their own pace sees none, and neither leaves a watch running."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    made: list[Recorded] = []

    def recorded(seconds, comm):
        made.append(Recorded(seconds, comm))
        return made[-1]

    monkeypatch.setattr(api, "Watchdog", recorded)
    api.run(config, backend="numpy", stall_timeout=30)
    assert made[-1].fired == []

    statement, slowed = Executor._statement, []

    def slow(self, op):
        if not slowed:
            slowed.append(op)
            time.sleep(1.5)
        return statement(self, op)

    monkeypatch.setattr(Executor, "_statement", slow)
    api.run(config, backend="numpy", stall_timeout=0.3)
    assert slowed and made[-1].fired
    assert "(--stall-timeout 0.3; the last one finished: " in made[-1].fired[0]
    assert not any(t.name == "chainexec-watchdog" for t in threading.enumerate())
