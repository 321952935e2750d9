"""The CLI's calls forked from a warm interpreter (:mod:`tests.forkcli`) give what a fresh
``python -m chainexec.cli`` gives: exit status, stdout and stderr, the call's folder and
environment, a timeout's and a signal's end."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from tests import forkcli
from tests.conftest import fourindex_config, write_config

CALLS = [
    ("--help",),
    ("plan", "chain.yaml"),
    ("plan", "missing.yaml"),
    ("run", "chain.yaml", "--frob"),
    ("generate", "chain.yaml"),
]


@pytest.fixture(scope="module")
def zygote():
    """A zygote of the tests' own (:func:`forkcli.zygote` is none where every call is a
    subprocess)."""
    started = forkcli.Zygote()
    assert started.alive
    yield started
    started.close()


def _both(zygote, tmp_path, args, env=None):
    """``args`` forked and as a subprocess, each in a fresh copy of the folder."""
    results = []
    for way in ("fork", "subprocess"):
        folder = tmp_path / way
        folder.mkdir()
        write_config(folder, fourindex_config())
        cmd = [sys.executable, "-m", "chainexec.cli", *args]
        full = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        if way == "fork":
            results.append(zygote.run(cmd, list(args), full, folder, 120))
        else:
            results.append(subprocess.run(cmd, capture_output=True, text=True, cwd=folder, env=full, timeout=120))
    return results


@pytest.mark.parametrize("args", CALLS, ids=lambda a: " ".join(a))
def test_a_forked_call_gives_what_a_fresh_interpreter_gives(zygote, tmp_path, args):
    forked, fresh = _both(zygote, tmp_path, args)
    here, there = str(tmp_path / "fork"), str(tmp_path / "subprocess")
    assert forked.returncode == fresh.returncode
    assert forked.stdout.replace(here, there) == fresh.stdout
    assert forked.stderr.replace(here, there) == fresh.stderr
    assert sorted(p.name for p in (tmp_path / "fork").rglob("*")) == sorted(
        p.name for p in (tmp_path / "subprocess").rglob("*"))


def test_a_forked_call_takes_the_calls_environment(zygote, tmp_path):
    """A variable the CLI reads when it runs (the plan cache's folder) is the call's, not the
    zygote's: both calls keep their plan there (one each: their configs lie in two folders)."""
    cache = tmp_path / "cache"
    forked, fresh = _both(zygote, tmp_path, ("plan", "chain.yaml"), {"CHAINEXEC_PLAN_CACHE": str(cache)})
    assert forked.returncode == fresh.returncode == 0
    assert len(list(cache.iterdir())) == 2


def test_a_forked_call_past_its_timeout_is_killed(zygote, tmp_path):
    write_config(tmp_path, fourindex_config())
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run(["x"], ["plan", "chain.yaml"], dict(os.environ), tmp_path, 0.001)


def test_calls_from_two_threads_at_once_each_get_their_own_end(zygote, tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_config(tmp_path / name, fourindex_config())
    results = {}

    def call(name, args):
        results[name] = zygote.run(["x"], args, dict(os.environ), tmp_path / name, 60)

    other = threading.Thread(target=call, args=("a", ["generate", "chain.yaml"]))
    other.start()
    call("b", ["plan", "missing.yaml"])
    other.join()
    assert results["a"].returncode == 0 and (tmp_path / "a" / "in.h5").is_file()
    assert results["b"].returncode == 2 and "missing.yaml" in results["b"].stderr
