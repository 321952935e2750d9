"""``benchmarks/device_timeline.py``'s trace analysis (the profiling itself needs a GPU and torch)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "device_timeline", Path(__file__).resolve().parents[1] / "benchmarks" / "device_timeline.py")
timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timeline)


@pytest.mark.parametrize("spans,expected", [
    ([(0, 10), (20, 30)], 20), ([(0, 10), (5, 15)], 15), ([(0, 10), (2, 3), (9, 12), (20, 21)], 13),
    ([(5, 6), (0, 10)], 10)], ids=["apart", "overlapping", "nested-and-chained", "unsorted"])
def test_busy_is_the_union_of_the_intervals(spans, expected):
    assert timeline.busy([(s, e, "k") for s, e in spans]) == expected


def test_gaps_are_the_idle_stretches_longer_than_the_least():
    spans = [(0, 10, "a"), (2, 30, "b"), (31, 40, "c"), (100, 110, "d"), (500, 501, "e")]
    assert timeline.gaps(spans, 5) == [(40, 100, "d"), (110, 500, "e")]


def test_summary_names_the_host_call_a_gap_waited_for():
    """Device work 0-1 ms and 5-6 ms; a 3 ms host copy between them is named beside the gap."""
    events = [{"cat": "kernel", "name": "gemm", "ts": 0, "dur": 1000},
              {"cat": "kernel", "name": "gemm", "ts": 5000, "dur": 1000},
              {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 1500, "dur": 3000},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 4900, "dur": 10}]
    text = timeline.summarize(events)
    assert text.splitlines()[0] == "device span 0.0060 s, busy 0.0020 s"
    assert "idle gaps over 0.5 ms: 1, 4.0 ms in all" in text
    assert "idle   4.00 ms before gemm; host: [('cudaMemcpyAsync', 3.0)]" in text
