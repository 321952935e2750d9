"""The schedule choice: the exhaustive search equals a brute-force enumeration, is never worse
than the paper's prescriptive choice, and the planner uses the cheapest fitting alternative.
Prints how far the paper's choice is from the search on each config (run with -s to see)."""

from __future__ import annotations

from pathlib import Path

import pytest

from chainexec import machinecache, spec
from chainexec.planner.build import contractions, make_plan
from chainexec.planner.choose import Chooser, compositions
from chainexec.planner.machine import Machine
from chainexec.planner.nest import Schedule
from chainexec.planner.schedule import Context, fit, movement_seconds
from tests.conftest import fourindex_config, write_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PAPER = machinecache.load(CONFIGS / "machines" / "paper2010.json")
NAMES = ["expr_a", "expr_b", "expr_c", "expr_d", "expr_e", "fourindex"]


def _get(plan, name):
    return next(a for a in plan.alternatives if a["name"] == name)


@pytest.mark.parametrize("machine", [Machine(), PAPER], ids=["default", "paper2010"])
@pytest.mark.parametrize("name", NAMES)
def test_search_never_worse_than_paper(name, machine):
    plan = make_plan(spec.load(CONFIGS / f"{name}.yaml"), machine)
    search = _get(plan, "search")
    paper = _get(plan, "paper: disk+global")
    gap = paper["movement_seconds"] / search["movement_seconds"]
    print(f"{name}: paper {paper['groups']} {paper['movement_seconds']:.4g} s, "
          f"search {search['groups']} {search['movement_seconds']:.4g} s, paper/search = {gap:.3f}")
    assert search["movement_seconds"] <= paper["movement_seconds"] * (1 + 1e-12)
    chosen = [a for a in plan.alternatives if a["chosen"] and a["kind"] == "schedule"]
    assert len(chosen) == 1 and chosen[0]["movement_seconds"] == min(
        a["movement_seconds"] for a in plan.alternatives if a["kind"] == "schedule" and a["fits"])
    assert plan.predicted["bytes"] == chosen[0]["bytes"]


@pytest.mark.parametrize("config", ["fourindex", "expr_d_small"])
def test_search_equals_brute_force(config, tmp_path):
    if config == "fourindex":
        s = spec.load(write_config(tmp_path, fourindex_config(n=12, nmo=10, global_memory="96KiB",
                                                             device_memory="8KiB")))
    else:
        text = (CONFIGS / "expr_d.yaml").read_text().replace("N: 40", "N: 5").replace("32GiB", "64KiB")
        s = spec.loads(text.replace("1GiB", "6KiB"), str(CONFIGS / "expr_d.yaml"))
    cs, tensors, _ = contractions(s)
    ctx = Context(cs, tensors, s.extents, {"global": s.machine.global_memory, "device": s.machine.device_memory},
                  Machine())
    chooser = Chooser(ctx)
    searched = movement_seconds(ctx.price(chooser.search()))
    (run,) = chooser.lists
    best = None
    for disk_cut in compositions(run):
        for device_cuts in _products([compositions(seg) for seg in disk_cut]):
            groups = [fit(ctx, parts, chooser.singles) for parts in device_cuts]
            if any(g is None for g in groups):
                continue
            cost = movement_seconds(ctx.price(Schedule(groups)))
            best = cost if best is None else min(best, cost)
    assert searched <= best * (1 + 1e-12)


def _products(options):
    if not options:
        yield []
        return
    for head in options[0]:
        for tail in _products(options[1:]):
            yield [head] + tail


EXPRESSIONS = {
    "indices": {"i": 7, "j": 7, "a": 5, "b": 5},
    "tensors": {"e": {"indices": ["i"], "source": {"random": 1}}, "f": {"indices": ["a"], "source": {"random": 2}},
                "D": {"indices": ["i", "a"], "source": {"expr": "1 / (3 + e[i] - f[a])"}},
                "W": {"indices": ["i", "j", "a", "b"], "source": {"expr": "e[i] * f[b] - e[j] + f[a] * 0.25"}}},
    "statements": ["T[i,j] = D[i,a] * D[j,a]", "U[i,j] = W[i,j,a,b] * D[i,a] * D[j,b]", "V[a,b] = W[j,i,b,a] * T[i,j]"],
    "outputs": {t: {"file": "o.h5", "dataset": t} for t in "TUV"},
}


@pytest.mark.parametrize("limits, needle, fits", [
    ({"global_memory": "47B", "device_memory": "512B"}, "raise machine.global_memory to 48 B",
     {"global_memory": "48B", "device_memory": "512B"}),
    ({"global_memory": "1MiB", "device_memory": "40B"}, "and 1 more fits the memory limits (global 1,048,576 B, "
     "device 40 B): raise machine.device_memory to 48 B", {"global_memory": "1MiB", "device_memory": "48B"}),
    # neither level alone is enough: both named (it said "raise both", with no sizes)
    ({"global_memory": "40B", "device_memory": "40B"}, "raise machine.device_memory to 48 B and "
     "machine.global_memory to 48 B", {"global_memory": "48B", "device_memory": "48B"}),
])
def test_a_limit_no_tiling_fits_is_refused_with_the_limit_that_would(limits, needle, fits, tmp_path):
    """Limits above every contraction's smallest tiling but below what the tiling schemes can
    place (expression inputs): the refusal names the least limit at which every contraction has a
    tiling (it named none: "raise them"), and that limit plans."""
    from chainexec.errors import ChainexecError

    with pytest.raises(ChainexecError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        make_plan(spec.load(write_config(tmp_path, dict(EXPRESSIONS, machine=limits))))
    assert make_plan(spec.load(write_config(tmp_path, dict(EXPRESSIONS, machine=fits)))).predicted["flops"] > 0
