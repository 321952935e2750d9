"""The run report (achieved vs the machine model per level, wall vs bound, memory vs limits) and its
plot, on hand-made predicted/measured records whose rates are worked out here by hand."""

from __future__ import annotations

import sys

import pytest

from chainexec import report
from chainexec.errors import ChainexecError
from chainexec.spec import format_size

MiB = 1 << 20
LIMITS = {"global": 64 * MiB, "device": 4 * MiB}


def _record(disk_in, disk_out, get, acc, flops, seconds, total, peaks) -> dict:
    return {"bytes": {"disk->global": disk_in, "global->disk": disk_out, "global->device": get, "device->global": acc},
            "flops": flops, "memory_peak": dict(zip(("global", "device"), peaks)),
            "seconds": dict(zip(("disk", "global<->device", "compute"), seconds)), "total_seconds": total}


# disk: 3e9 + 1e9 bytes; predicted in 8 s (bound 0.5 GB/s), measured 4 s (1 GB/s, 200 %).
# global<->device: 1.5e9 + 0.5e9 bytes; predicted 0.2 s (10 GB/s), measured 0.5 s (4 GB/s, 40 %).
# compute: 6e10 flops; predicted 3 s (20 GFLOP/s), measured 12 s (5 GFLOP/s, 25 %).
# wall: measured 20 s against the bound 8 s: 2.5 times.
PREDICTED = _record(3 * 10**9, 10**9, 15 * 10**8, 5 * 10**8, 6 * 10**10, (8.0, 0.2, 3.0), 8.0, (32 * MiB, 3 * MiB))
MEASURED = _record(3 * 10**9, 10**9, 15 * 10**8, 5 * 10**8, 6 * 10**10, (4.0, 0.5, 12.0), 20.0, (32 * MiB, 3 * MiB))


def _row(text: str, label: str) -> list[str]:
    """The whitespace-separated fields of the one line that starts with ``label``."""
    found = [line.split() for line in text.splitlines() if line.startswith(label + " ")]
    assert len(found) == 1, text
    return found[0]


def test_rates_per_level():
    rates = {r["level"]: r for r in report.level_rates(PREDICTED, MEASURED)}
    assert list(rates) == ["disk", "global<->device", "compute"]
    expected = {"disk": (4e9, 1e9, 0.5e9), "global<->device": (2e9, 4e9, 10e9), "compute": (6e10, 5e9, 20e9)}
    for level, (amount, achieved, bound) in expected.items():
        assert rates[level]["measured"] == rates[level]["predicted"] == amount
        assert rates[level]["achieved"] == pytest.approx(achieved)
        assert rates[level]["bound"] == pytest.approx(bound)
        assert rates[level]["fraction"] == pytest.approx(achieved / bound)


def test_table():
    text = report.run_report(PREDICTED, MEASURED, LIMITS)
    disk = format_size(4 * 10**9).split()
    assert _row(text, "disk") == ["disk", *disk, *disk, "4.000", "1.000", "GB/s", "0.500", "GB/s", "200.0%"]
    dev = format_size(2 * 10**9).split()
    assert _row(text, "global<->device") == ["global<->device", *dev, *dev, "0.500", "4.000", "GB/s", "10.000", "GB/s",
                                             "40.0%"]
    assert _row(text, "compute") == ["compute", "60,000,000,000", "60,000,000,000", "12.000", "5.000", "GFLOP/s",
                                     "20.000", "GFLOP/s", "25.0%"]
    assert "measured 20.000, predicted 8.000, measured/predicted 2.50x" in text
    assert _row(text, "peak global") == ["peak", "global", "32.00", "MiB", "64.00", "MiB", "50.0%"]
    assert _row(text, "peak device") == ["peak", "device", "3.00", "MiB", "4.00", "MiB", "75.0%"]
    assert "high-water" not in text and "ABOVE LIMIT" not in text


def test_large_amounts_and_rates_stay_apart():
    """(T) at o=40 v=400 on the H100 (2026-11-24): 3.9e15 flops in 204 s against a 157 s bound,
    printed before as one run-together field."""
    flops = 3_905_771_520_000_000
    predicted = _record(0, 0, 10**9, 0, flops, (0.0, 0.1, 157.4539), 157.4539, (0, MiB))
    measured = _record(0, 0, 10**9, 0, flops, (0.0, 0.2, 204.2144), 231.3, (0, MiB))
    text = report.run_report(predicted, measured, LIMITS)
    assert _row(text, "compute") == ["compute", "3,905,771,520,000,000", "3,905,771,520,000,000", "204.214",
                                     f"{flops / 204.2144 / 1e9:.3f}", "GFLOP/s", f"{flops / 157.4539 / 1e9:.3f}",
                                     "GFLOP/s", f"{100 * 157.4539 / 204.2144:.1f}%"]


def test_zero_seconds_and_bytes_print_a_dash():
    predicted = _record(0, 0, 10**9, 0, 10**9, (0.0, 0.1, 0.05), 0.0, (0, MiB))
    measured = _record(0, 0, 10**9, 0, 10**9, (0.0, 0.2, 0.0), 0.3, (0, MiB))
    text = report.run_report(predicted, measured, LIMITS)
    # No disk movement, no time: no rate. Compute measured in no time: no achieved rate, no ratio.
    assert _row(text, "disk")[-3:] == ["-", "-", "-"]
    assert _row(text, "global<->device")[-5:] == ["5.000", "GB/s", "10.000", "GB/s", "50.0%"]
    assert _row(text, "compute")[-4:] == ["-", "20.000", "GFLOP/s", "-"]
    assert "measured/predicted -" in text
    assert _row(text, "peak global")[-1] == "-"


def test_high_water_rows_marked_above_limit():
    measured = dict(MEASURED, memory_high_water={"global": 40 * MiB, "device": 5 * MiB})
    text = report.run_report(PREDICTED, measured, LIMITS)
    assert _row(text, "high-water global") == ["high-water", "global", "40.00", "MiB", "64.00", "MiB", "62.5%"]
    assert _row(text, "high-water device") == ["high-water", "device", "5.00", "MiB", "4.00", "MiB", "125.0%",
                                               "ABOVE", "LIMIT"]
    assert text.count("ABOVE LIMIT") == 1


def test_plot_writes_a_png_and_nothing_else(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run.png"
    report.plot_run(PREDICTED, MEASURED, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["run.png"]


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ChainexecError, match="needs matplotlib"):
        report.plot_run(PREDICTED, MEASURED, str(tmp_path / "run.png"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["run", "plan"])
def test_plot_without_matplotlib_is_refused_before_the_run(command, tmp_path):
    """``--plot`` where matplotlib cannot be imported: refused before planning or running (the
    run went to its end, its output marked complete, and the plan was printed, then the command
    exited 2): nothing printed, no file written."""
    import os

    from tests.conftest import assert_refused, fourindex_config, run_cli, write_config

    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    blocked = tmp_path / "blocked" / "matplotlib"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('matplotlib blocked by the test')\n")
    before = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    path = os.pathsep.join(filter(None, [str(blocked.parent), os.environ.get("PYTHONPATH")]))
    proc = run_cli(command, config, "--plot", tmp_path / "p.png", env={"PYTHONPATH": path})
    assert_refused(proc, "--plot needs matplotlib")
    assert proc.stdout == "" and sorted(p for p in tmp_path.rglob("*") if p.is_file()) == before


def test_failed_plot_write_leaves_no_file(tmp_path):
    class HalfWritten:
        def savefig(self, path, format):
            with open(path, "wb") as f:
                f.write(b"\x89PNG")
            raise OSError("disk full")

    with pytest.raises(ChainexecError, match="run.png: cannot write the plot \\(disk full\\)"):
        report._save(HalfWritten(), str(tmp_path / "run.png"))
    assert list(tmp_path.iterdir()) == []


def test_comparison_marks_every_exact_row_that_differs_and_keeps_wide_numbers_apart():
    predicted = dict(PREDICTED, streamed=6_921_928_234_560_000, flops=46_936_869_120_000_000)
    measured = dict(MEASURED, streamed=6_921_928_234_560_008, flops=46_936_869_120_000_000)
    text = report.comparison(predicted, measured)
    assert _row(text, "streamed (device)")[2:] == ["6,921,928,234,560,000", "6,921,928,234,560,008", "MISMATCH"]
    assert _row(text, "flops")[1:] == ["46,936,869,120,000,000"] * 2
    assert text.count("MISMATCH") == 1
    assert not report.matches(predicted, measured)
    assert report.matches(predicted, dict(measured, streamed=predicted["streamed"]))


def test_ranks_table_has_a_row_per_rank_with_its_start_and_transfer_seconds():
    per_rank = [{"rank": 0, "start_seconds": 1.25, "busy_seconds": 3.5, "idle_seconds": 0.125,
                 "level_seconds": {"disk": 0.0, "global<->device": 0.75, "compute": 2.0}, "tiles": 7},
                {"rank": 1, "start_seconds": None, "busy_seconds": 3.0, "idle_seconds": 0.5,
                 "level_seconds": {"disk": 0.0, "global<->device": 0.25, "compute": 2.5}, "tiles": 6}]
    text = report.ranks(per_rank)
    assert text.splitlines()[0].split() == ["rank", "start", "s", "busy", "s", "idle", "s", "g<->d", "s", "tiles"]
    assert _row(text, "0") == ["0", "1.250", "3.500", "0.125", "0.750", "7"]
    assert _row(text, "1") == ["1", "-", "3.000", "0.500", "0.250", "6"]


def test_alternatives_end_with_the_finished_plans_prediction():
    """The (T) chain's chosen schedule as the search weighed it differs from the finished plan
    (its tiles evaluated per orbit afterwards): the table's last row is the prediction the run is
    measured against, bytes per level and movement seconds."""
    from pathlib import Path

    from chainexec import spec
    from chainexec.planner.build import make_plan
    from chainexec.planner.machine import Machine

    plan = make_plan(spec.load(Path(__file__).parents[1] / "configs" / "ccsd_t.yaml"), Machine())
    rows = report.alternatives(plan).splitlines()
    [finished] = [row for row in rows if row.startswith("finished plan")]
    p = plan.predicted
    moving = p["seconds"]["disk"] + p["seconds"]["global<->device"]
    assert finished.split()[2:] == [*format_size(report.level_amount(p, "disk")).split(),
                                    *format_size(report.level_amount(p, "global<->device")).split(),
                                    f"{moving:.3g}", "the", "prediction"]
    [chosen] = [a for a in plan.alternatives if a["chosen"] and a["kind"] == "schedule"]
    assert chosen["seconds"]["compute"] != p["seconds"]["compute"]
