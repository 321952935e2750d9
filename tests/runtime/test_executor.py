"""The executor's tile tuples: a symmetric loop keeps the ordered tuples of its indices' tile
positions, each weighted by its number of distinct permutations, so that the weights add up to
the full tuple count (every tuple of the full loop is stood for exactly once). And statements a
backend queues (CuPy's) are timed between its stamps and waited for before transfers."""

from __future__ import annotations

import itertools
import math

import pytest

from chainexec.runtime.executor import _tuples


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("symmetric", [["i", "j"], ["i", "j", "k"], ["k", "i", "j"]])
def test_ordered_tuples_and_weights(n, symmetric):
    names = ["i", "x", "j", "k"]
    spans = [[(3 * p, 3 * p + 3) for p in range(n)] if i != "x" else [(0, 2), (2, 4)] for i in names]
    combos, weights = _tuples(names, spans, symmetric)
    k = len(symmetric)
    assert len(combos) == math.comb(n + k - 1, k) * 2 * n ** (3 - k)
    assert sum(weights) == 2 * n ** 3
    seen = set()
    for combo, weight in zip(combos, weights):
        positions = [combo[names.index(i)][0] // 3 for i in symmetric]
        assert positions == sorted(positions, reverse=True)
        assert weight == len(set(itertools.permutations(positions)))
        seen.add(combo)
    assert len(seen) == len(combos)


def test_plain_loops_keep_every_tuple():
    spans = [[(0, 2), (2, 3)], [(0, 1), (1, 2), (2, 3)]]
    combos, weights = _tuples(["i", "j"], spans, [])
    assert combos == list(itertools.product(*spans)) and weights == [1] * 6


QUEUED_RUN = r'''
import json, sys
from chainexec import api
from chainexec.runtime import device


class Queued(device.Backend):
    """NumPy, as if every compute statement were still running when it returns: a stamp is a
    number, a statement takes 0.25 s between its two stamps, and every transfer records how many
    stamps nothing has waited for yet."""

    def __init__(self):
        super().__init__()
        self.clock, self.open, self.seen = 0, set(), []

    def stamp(self):
        self.clock += 1
        self.open.add(self.clock)
        return self.clock

    def elapsed(self, start, end):
        self.open -= {start, end}
        return 0.25 * (end - start)

    def wait(self):
        self.open.clear()

    def fetch(self, dst, read):
        self.seen.append(len(self.open))
        super().fetch(dst, read)

    def to_host(self, array):
        self.seen.append(len(self.open))
        return super().to_host(array)


backend = Queued()
api.select = lambda name, comm: backend
result = api.run(sys.argv[1], backend="numpy")
print(json.dumps({"seen": backend.seen, "stamps": backend.clock, "open": len(backend.open),
                  "measured": result["measured"], "predicted": result["predicted"],
                  "statements": result["run"]["statement_seconds"]}))
'''


def test_queued_statements_are_timed_by_stamps_and_waited_for(tmp_path):
    """A backend whose compute statements return before they are done (CuPy's): the executor
    times them between its stamps, waits for them before every transfer (so a transfer's host
    time is its own) and by the end, and counts their seconds per statement and as compute."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import fourindex_config, run_cli, write_config

    repo = Path(__file__).resolve().parents[2]

    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    script = tmp_path / "queued.py"
    script.write_text(QUEUED_RUN)
    proc = subprocess.run([sys.executable, str(script), str(config)], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["seen"] and set(got["seen"]) == {0}
    assert got["open"] == 0
    queued = got["stamps"] // 2
    assert queued > 10
    assert got["measured"]["seconds"]["compute"] == 0.25 * queued
    assert sum(s for name, s in got["statements"].items() if name.startswith("#")) == 0.25 * queued
    assert got["measured"]["bytes"] == got["predicted"]["bytes"]
