"""``benchmarks/gpu_tests.sh``: the tests marked ``gpu`` dealt round-robin to parallel pytest
processes, each counted once in the summary, failures named; unmarked tests are not run."""

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_tests.sh"

TESTS = '''
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", range(5))
def test_passes(n):
    assert n < 5


def test_fails():
    assert 1 == 2


def test_skips():
    pytest.skip("no device")
'''


def test_shards_run_every_gpu_test_once_and_name_the_failures(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_device.py").write_text(TESTS)
    (tmp_path / "tests" / "test_host.py").write_text("def test_unmarked():\n    assert False\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), str(out), "3"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr  # a test failed
    summary = (out / "summary.txt").read_text()
    assert "all: 5 passed, 1 failed, 1 skipped" in summary
    assert "FAILED" in summary and "test_fails" in summary and "test_unmarked" not in summary
    ids = [(out / f"ids_{s}.txt").read_text().split() for s in range(3)]
    assert sorted(sum(ids, [])) == sorted((out / "ids.txt").read_text().split()) and all(len(i) >= 2 for i in ids)


ALONE = '''
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
LOG = Path(__file__).parent.parent / "spans"


def span(name, seconds):
    start = time.time()
    time.sleep(seconds)
    with open(LOG, "a") as f:
        f.write(f"{name} {start} {time.time()}\\n")


@pytest.mark.parametrize("n", range(4))
def test_shared(n):
    span("shared", 0.3)


@pytest.mark.alone
def test_timed():
    span("alone", 0.01)
'''


def test_alone_tests_run_after_every_shard_in_their_own_process(tmp_path):
    """Tests marked ``alone`` are dealt to no shard and start once every shard has ended."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_device.py").write_text(ALONE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n    alone: timings\n")
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), str(out), "2"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    assert "all: 5 passed, 0 failed, 0 skipped" in summary and "alone: 1 passed" in summary
    spans = [line.split() for line in (tmp_path / "spans").read_text().splitlines()]
    alone = [float(start) for name, start, _ in spans if name == "alone"]
    shared_end = max(float(end) for name, _, end in spans if name == "shared")
    assert len(alone) == 1 and alone[0] >= shared_end
    dealt = [(out / f"ids_{s}.txt").read_text().split() for s in range(2)]
    assert all(len(ids) == 2 and not any("test_timed" in i for i in ids) for ids in dealt)
    assert (out / "ids_2.txt").read_text().split() == ["tests/test_device.py::test_timed"]


def test_every_module_that_needs_a_gpu_is_marked():
    """A test module that skips without a GPU (``require_gpu()`` at module level) marks its tests
    ``gpu``, so that the script runs them."""
    root = Path(__file__).resolve().parent
    needing = [p for p in root.rglob("test_*.py") if "\ncupy = require_gpu()" in p.read_text()]
    assert len(needing) >= 9
    marked = re.compile(r"^pytestmark = .*\bpytest\.mark\.gpu\b", re.M)
    assert [p.name for p in needing if not marked.search(p.read_text())] == []


def test_a_module_that_fails_to_collect_stops_the_run(tmp_path):
    """A GPU module that cannot be imported is not dropped silently: exit 2, no shard runs."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_device.py").write_text(TESTS)
    (tmp_path / "tests" / "test_broken.py").write_text("import no_such_module_here\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), str(out), "2"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "collection failed" in proc.stderr and not list(out.glob("shard_*"))
