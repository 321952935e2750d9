"""The Plan: JSON round trip, memory limits respected, predicted bytes equal to a tile-by-tile
enumeration of the loop nest."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import yaml

from chainexec import ordering, spec
from chainexec.errors import ChainexecError
from chainexec.planner.build import make_plan
from chainexec.planner import symmetry
from chainexec.planner.plan import CATEGORY, Loop, Plan, ops, term_run, to_dict
from tests.conftest import fourindex_config, write_config
from tests.runtime.test_chains import random_chain

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _configs(tmp_path):
    yield write_config(tmp_path, fourindex_config(), "four.yaml")
    for seed in range(6):
        yield write_config(tmp_path, random_chain(seed, tmp_path), f"chain{seed}.yaml")
    # (T) with E symmetric in i, j, k: its parallel loop visits ordered tiles only.
    cfg = yaml.safe_load((CONFIGS / "ccsd_t.yaml").read_text())
    cfg["ranges"] = {"occ": 5, "vir": 4}
    cfg["machine"] = {"global_memory": "1GiB", "device_memory": "48KiB"}
    yield write_config(tmp_path, cfg, "ccsd_t.yaml")


def enumerate_bytes(plan: Plan) -> dict:
    """Bytes per category and flops by walking every iteration of every loop (slow, independent
    of cost.py); a symmetric loop's iterations are its ordered tile tuples, a symmetrized
    run counts the terms :func:`chainexec.planner.symmetry.schedule` takes on each tile, and an
    ordered reduction the elements whose symmetric indices sharing a range are non-decreasing."""
    moved = dict.fromkeys(CATEGORY.values(), 0)
    moved["flops"] = 0

    def walk(body, ranges, sym=()):
        skip = set()
        for k, node in enumerate(body):
            if isinstance(node, Loop):
                names = list(node.tiles)
                spans = []
                for i in names:
                    lo, hi = ranges[node.level].get(i, ranges["global"].get(i, (0, plan.extents[i])))
                    spans.append([(s, min(s + node.tiles[i], hi)) for s in range(lo, hi, node.tiles[i])])
                for combo in itertools.product(*spans):
                    positions = [spans[names.index(i)].index(combo[names.index(i)]) for i in node.symmetric]
                    if positions != sorted(positions):
                        continue
                    inner = {lvl: dict(r) for lvl, r in ranges.items()}
                    for lvl in (("global", "device") if node.level == "global" else ("device",)):
                        inner[lvl].update(zip(names, combo))
                    walk(node.body, inner, node.symmetric or sym)
            elif node.op in ("compute", "fused"):
                group = node.group or [node.contraction]
                if node.symmetrized:  # a symmetrized run: the terms the tile's pattern runs
                    n = term_run(body, k, plan.contractions)
                    cs = [plan.contractions[op.contraction] for op in body[k:k + n]]
                    where = {i: ranges["device"].get(i, ranges["global"].get(i, (0, plan.extents[i])))
                             for i in plan.extents}
                    free = {i for i in cs[0].out_indices if i not in sym and where[i] == (0, plan.extents[i])}
                    taken = symmetry.schedule(cs, list(sym), free, plan.extents)[
                        ordering.pattern_of([where[i][0] for i in sym])]
                    group = [c.id for c in cs] if taken is None else [cs[m].id for m, _ in taken[0]]
                    skip.update(range(k + 1, k + n))
                elif k in skip:
                    continue
                for m in group:  # a fused statement: every contraction in it
                    c = plan.contractions[m]
                    span = {i: ranges["device"].get(i, ranges["global"].get(i, (0, plan.extents[i]))) for i in c.indices()}
                    size = math.prod(b - a for a, b in span.values())
                    if node.op == "fused" and node.ordered:
                        size //= math.prod(b - a for i, (a, b) in span.items() if i in sym)
                        size *= sum(all(x[n] <= x[n + 1] for n in range(len(sym) - 1) if span[sym[n]] == span[sym[n + 1]])
                                    for x in itertools.product(*(range(*span[i]) for i in sym)))
                    moved["flops"] += (2 if c.b is not None else 1) * size
            elif node.op in CATEGORY:
                level = "global" if node.op in ("load", "store") else "device"
                size = math.prod(b - a for a, b in (ranges[level].get(i, (0, plan.extents[i])) for i in node.indices))
                moved[CATEGORY[node.op]] += size * plan.tensors[node.tensor].itemsize

    for nest in plan.nests:
        walk(nest.body, {"global": {}, "device": {}})
    return moved


@pytest.mark.parametrize("factors", [[[5, 4], [1, 1]], [[3, 1, 2], [2, 5, 7], [1, 4, 6]]])
def test_ordered_sum_is_over_the_executors_tuples(factors):
    """The cost model's sum over a symmetric loop's tile positions (``cost._ordered_sum``) is over
    the tuples the executor visits (``frame.tuples``: first ≤ second ≤ …), also with factors
    that differ by position and index (edge tiles, indices a statement does not read)."""
    from chainexec.planner.cost import _ordered_sum
    from chainexec.runtime.frame import tuples

    names = [f"x{n}" for n in range(len(factors))]
    spans = [[(p, p + 1) for p in range(len(factors[0]))] for _ in names]
    combos, _ = tuples(names, spans, names)
    assert _ordered_sum(factors) == sum(math.prod(f[c[j][0]] for j, f in enumerate(factors)) for c in combos)


def test_json_round_trip(tmp_path):
    for config in _configs(tmp_path):
        plan = make_plan(spec.load(config))
        again = Plan.from_json(plan.to_json())
        assert to_dict(again) == to_dict(plan)


def test_predicted_bytes_equal_enumeration(tmp_path):
    for config in _configs(tmp_path):
        plan = make_plan(spec.load(config))
        assert enumerate_bytes(plan) == plan.predicted["bytes"] | {"flops": plan.predicted["flops"]}
        if config.name == "ccsd_t.yaml":
            assert any(loop.symmetric for nest in plan.nests for _, loops in ops(nest.body) for loop in loops)
            assert plan.predicted["flops"] < sum(c.flops for c in plan.contractions)


@pytest.mark.parametrize("device", ["1KiB", "3KiB", "100KiB"])
@pytest.mark.parametrize("glob", ["8KiB", "40KiB", "10MiB"])
def test_memory_limits_respected(tmp_path, glob, device):
    plan = make_plan(spec.load(write_config(tmp_path, fourindex_config(global_memory=glob, device_memory=device))))
    for level in ("global", "device"):
        assert 0 < plan.predicted["memory_peak"][level] <= plan.memory_limit[level]


@pytest.mark.parametrize("missing", ["global_memory", "device_memory"])
def test_a_limit_left_to_detection_is_refused_by_the_pure_planner(tmp_path, missing):
    cfg = fourindex_config()
    del cfg["machine"][missing]
    config = write_config(tmp_path, cfg)
    with pytest.raises(ChainexecError, match=f"machine.{missing} not set") as err:
        make_plan(spec.load(config))
    assert str(err.value).startswith(str(config)) and "\n" not in str(err.value)


PACKED_CHAIN = {
    "indices": {"p": 13, "a": 7, "b": 7, "c": 7, "d": 7},
    "tensors": {"C": {"indices": ["p", "a"], "source": {"random": 3}},
                "B": {"indices": ["a", "b"], "symmetry": {"pairs": [["a", "b"]]}, "layout": "s2"},
                "G": {"indices": ["a", "b", "c", "d"], "symmetry": {"pairs": [["a", "b"], ["c", "d"]], "exchange": True},
                      "layout": "packed"}},
    "statements": ["B[a,b] = C[p,a] * C[p,b]", "G[a,b,c,d] = B[a,b] * B[c,d]", "H[a,d] = B[b,c] * G[a,b,c,d]"],
    "outputs": {"B": {"file": "o.h5", "dataset": "B"}, "G": {"file": "o.h5", "dataset": "G"},
                "H": {"file": "o.h5", "dataset": "H"}},
}


def test_a_limit_too_small_for_any_plan_names_what_the_plan_needs(tmp_path):
    """A device limit below the smallest tiling of a chain's contractions: the refusal names
    the largest of their needs, in bytes where the two sizes round alike, and that limit plans
    (it named the first contraction's need, 24 B, then the next's, 400 B, before 6,280 B)."""
    def plan(device):
        return make_plan(spec.load(write_config(tmp_path, dict(PACKED_CHAIN, machine={
            "global_memory": "64KiB", "device_memory": device}))))

    with pytest.raises(ChainexecError, match=r"device_memory = 24 B is too small for any plan: .* needs at least "
                                             r"6\.13 KiB \(6,280 B\)"):  # 6.13 KiB itself (6,277 B) would not plan
        plan("24B")
    with pytest.raises(ChainexecError, match="device_memory = 6,279 B is too small .* needs at least 6,280 B"):
        plan("6279B")
    assert plan("6280B").predicted["memory_peak"]["device"] <= 6280


@pytest.mark.parametrize("level", ["device", "global"])
def test_a_limit_too_small_names_what_a_computed_operands_inputs_need_too(tmp_path, level):
    """A computed operand's own inputs take buffers beside the contraction's three: the refusal
    named the three's need (24 B), and that limit was refused again (32 B); it names the limit
    that plans."""
    def plan(size):
        return make_plan(spec.load(write_config(tmp_path, {
            "indices": {"m": 2, "p": 7, "b": 2},
            "tensors": {"I0": {"indices": ["m", "b"], "source": {"random": 20}},
                        "I2": {"indices": ["m"], "source": {"random": 52}},
                        "X": {"indices": ["m", "p"], "source": {"expr": "-1 * I2[m]"}}},
            "statements": ["T0[p,b] = I0[m,b] * X[m,p]"], "outputs": {"T0": {"file": "out.h5", "dataset": "T0"}},
            "machine": {"global_memory": "1GiB", "device_memory": "1GiB", f"{level}_memory": size}})))

    with pytest.raises(ChainexecError, match=rf"{level}_memory = 1 B is too small for any plan: .* needs at least "
                                             r"(\d+) B") as refused:
        plan("1B")
    need = int(refused.value.args[0].rpartition("at least ")[2].split()[0])
    assert plan(f"{need}B").predicted["memory_peak"][level] <= need
    with pytest.raises(ChainexecError, match=f"(raise machine.{level}_memory to|needs at least) {need} B"):
        plan(f"{need - 1}B")


def test_flops_and_contractions(tmp_path):
    plan = make_plan(spec.load(write_config(tmp_path, fourindex_config(n=10, nmo=8))))
    assert len(plan.contractions) == 4
    assert plan.predicted["flops"] == sum(c.flops for c in plan.contractions)
    assert plan.contractions[-1].out == "B"
