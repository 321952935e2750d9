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


def _stalled(watch: Recorded, now: list[float]) -> list[str]:
    """The records of ``watch`` (a 1 s timeout) once its fake clock ``now`` has passed 1.5 s
    without a beat, no faster than real time, so that the watch looks (every 0.125 s of real
    time) at every stretch of it; waits up to 10 s for the first record."""
    for _ in range(150):
        now[0] += 0.01
        time.sleep(0.01)
    deadline = time.monotonic() + 10
    while not watch.fired and time.monotonic() < deadline:
        time.sleep(0.01)
    return watch.fired


@pytest.mark.parametrize("step", [0.01, 0.012])
def test_beats_keep_the_watch_quiet_and_a_stall_ends_it(step):
    """On the watch's own clock (a fake one, so that a loaded host's pauses do not count): beats
    0.1 s apart for 4 s keep a 1 s watch quiet; 1.5 s without one ends the run, once. The beats
    come every ``step`` seconds of real time, ten times faster than the fake clock's, so that the
    watch's looks lie more than two periods apart on it: the time between two looks with a beat
    between them is no time the watch could not look (at 12 ms a step, counting it would push
    the last beat past its time, and the stall that follows would go unseen)."""
    now = [0.0]
    watch = Recorded(1.0, SimpleNamespace(rank=0), clock=lambda: now[0])
    watch.start()
    try:
        for _ in range(40):
            now[0] += 0.1
            watch.beat("#0")
            time.sleep(step)
        assert watch.fired == []
        fired = _stalled(watch, now)
        assert fired and "s (--stall-timeout 1; the last one finished: #0)" in fired[0]
    finally:
        watch.stop()
    count = len(watch.fired)
    now[0] += 5
    time.sleep(0.5)
    assert len(watch.fired) == count == 1  # stopped: it watches no more
    assert not any(t.name == "chainexec-watchdog" for t in threading.enumerate())


def test_time_the_watch_could_not_look_is_no_stall():
    """A rank stopped (SIGSTOP) long past its timeout and then continued (as Open MPI continues a
    stopped rank before it ends it, or a job continued after Ctrl-Z) does not say it stalled: the
    100 s in which its watch could not look do not count. Time without a beat while the watch
    looks still does: 1.5 s more ends the run."""
    now = [0.0]
    watch = Recorded(1.0, SimpleNamespace(rank=1), clock=lambda: now[0])
    watch.start()
    try:
        watch.beat("#7")
        now[0] += 100.0  # between two looks
        time.sleep(0.5)  # four looks
        assert watch.fired == []
        fired = _stalled(watch, now)
        assert fired and "the last one finished: #7)" in fired[0]
    finally:
        watch.stop()


def test_no_timeout_starts_no_thread():
    watch = watchdog.Watchdog(None, SimpleNamespace(rank=0))
    watch.start()
    assert not any(t.name == "chainexec-watchdog" for t in threading.enumerate())
    watch.stop()


def test_a_run_watches_its_statements(tmp_path, monkeypatch):
    """A run with a stall timeout of 0.5 s whose first 40 statements other than contractions take
    0.05 s each longer (2 s in all) sees no stall: every statement beats. The same run whose fifth
    such statement takes 1.5 s sees one while it runs, naming the statement finished before it.
    Neither leaves a watch running."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    made: list[Recorded] = []

    def recorded(seconds, comm):
        made.append(Recorded(seconds, comm))
        return made[-1]

    monkeypatch.setattr(api, "Watchdog", recorded)
    statement, calls = Executor._statement, []

    def slowed(pause: float, which):
        def slow(self, op):
            calls.append(op)
            if which(len(calls)):
                time.sleep(pause)
            return statement(self, op)
        return slow

    monkeypatch.setattr(Executor, "_statement", slowed(0.05, lambda n: n <= 40))
    api.run(config, backend="numpy", stall_timeout=0.5)
    assert len(calls) > 40 and made[-1].fired == []

    calls.clear()
    monkeypatch.setattr(Executor, "_statement", slowed(1.5, lambda n: n == 5))
    api.run(config, backend="numpy", stall_timeout=0.5)
    assert made[-1].fired  # (a record per timeout passed: two fit in the pause)
    finished = made[-1].fired[0].split("the last one finished: ")[1].split(")")[0]
    assert finished not in ("none yet", "the backend's start", "the outputs' folders made"), finished
    assert not any(t.name == "chainexec-watchdog" for t in threading.enumerate())


def test_the_cleaning_up_after_the_nests_or_a_failure_is_not_watched(tmp_path, monkeypatch):
    """A rank's long removal of scratch after the last nest, or of a failed run's shards, waits
    for no stalled rank: with a 0.3 s stall timeout, a finish that takes 1 s more and a failed
    run's removal that takes 1 s more end as they would (the output complete; the failure's own
    error), the watch quiet."""
    from chainexec.runtime.store import Store

    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    made: list[Recorded] = []
    monkeypatch.setattr(api, "Watchdog", lambda seconds, comm: made.append(Recorded(seconds, comm)) or made[-1])
    finish, discard = Store.finish, api._discard

    def slow_finish(self):
        time.sleep(1.0)
        return finish(self)

    def slow_discard(*args):
        time.sleep(1.0)
        return discard(*args)

    monkeypatch.setattr(Store, "finish", slow_finish)
    api.run(config, backend="numpy", stall_timeout=0.3)
    assert made[-1].fired == []
    assert (tmp_path / "out" / "result.h5").exists()

    statement, calls = Executor._statement, []

    def failing(self, op):
        calls.append(op)
        if len(calls) == 5:
            raise ChainexecError("an input went away", collective=True)
        return statement(self, op)

    monkeypatch.setattr(Executor, "_statement", failing)
    monkeypatch.setattr(api, "_discard", slow_discard)
    with pytest.raises(ChainexecError, match="an input went away"):
        api.run(config, backend="numpy", stall_timeout=0.3)
    assert made[-1].fired == []
