"""The cost model's predicted bytes against an oracle that shares no code with it or with the
executor: a plain walk of the plan's data (loops, their tiles, their statements) that visits
every tile of every loop and adds up the bytes of each moving statement's region.

The oracle reads only what the plan says: a loop at a level cuts each of its indices' current
range at that level into tiles (a device range starts as the global one); a symmetric loop
visits the tuples whose tile positions over its symmetric indices do not decrease; ``load`` and
``store`` move their global region, ``get`` and ``accumulate`` their device region; a device
transfer outside every parallel loop is made by each rank; a tile a loop keeps (``Loop.kept``)
is fetched once per distinct tuple of positions of the loop's indices other than its first
symmetric one.
"""

from __future__ import annotations

import itertools
import random

import pytest
import yaml

from chainexec import spec
from chainexec.planner.build import make_plan
from chainexec.planner.plan import Loop, Plan, ops
from tests.runtime.test_chains import random_chain

MOVES = {"load": ("global", "disk->global"), "store": ("global", "global->disk"),
         "get": ("device", "global->device"), "accumulate": ("device", "device->global")}


def oracle_bytes(plan: Plan, ranks: int = 1) -> dict[str, int]:
    """Bytes per category of every moving statement of ``plan``, over every iteration."""
    moved = {category: 0 for _, category in MOVES.values()}

    def span(ranges, level, index):
        if level == "device" and index in ranges["device"]:
            return ranges["device"][index]
        return ranges["global"].get(index, (0, plan.extents[index]))

    def walk(body, ranges, parallel, kept=frozenset(), first=True):
        for node in body:
            if isinstance(node, Loop):
                names = list(node.tiles)
                tiles = []
                for i in names:
                    lo, hi = span(ranges, node.level, i)
                    tiles.append([(s, min(s + node.tiles[i], hi)) for s in range(lo, hi, node.tiles[i])])
                held = {(tensor, tuple(indices)) for tensor, indices in node.kept}
                seen = set()
                for combo in itertools.product(*(range(len(t)) for t in tiles)):
                    positions = [combo[names.index(i)] for i in node.symmetric]
                    if positions != sorted(positions):
                        continue
                    rest = tuple(p for i, p in zip(names, combo) if not node.kept or i != node.symmetric[0])
                    inner = {"global": dict(ranges["global"]), "device": dict(ranges["device"])}
                    inner[node.level].update({i: tiles[n][p] for n, (i, p) in enumerate(zip(names, combo))})
                    walk(node.body, inner, parallel or node.parallel, held, rest not in seen)
                    seen.add(rest)
            elif node.op == "get" and (node.tensor, tuple(node.indices)) in kept and not first:
                continue
            elif node.op in MOVES:
                level, category = MOVES[node.op]
                elements = 1
                for i in node.indices:
                    lo, hi = span(ranges, level, i)
                    elements *= hi - lo
                every = ranks if level == "device" and not parallel else 1
                moved[category] += every * elements * plan.tensors[node.tensor].itemsize

    for nest in plan.nests:
        walk(nest.body, {"global": {}, "device": {}}, False)
    return moved


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("ranks", [1, 3])
def test_random_chains(seed, ranks, tmp_path):
    cfg = random_chain(seed, tmp_path)
    plan = make_plan(spec.loads(yaml.safe_dump(cfg), str(tmp_path / "chain.yaml")), ranks=ranks)
    assert oracle_bytes(plan, ranks) == plan.predicted["bytes"]


CONFIGS = ["fourindex.yaml", "expr_a.yaml", "expr_b.yaml", "expr_c.yaml", "expr_d.yaml", "expr_e.yaml"]


@pytest.mark.parametrize("name", CONFIGS)
def test_example_configs(name):
    from pathlib import Path

    plan = make_plan(spec.load(Path(__file__).resolve().parents[2] / "configs" / name))
    assert oracle_bytes(plan) == plan.predicted["bytes"]


@pytest.mark.parametrize("nocc, nvir, device, symmetric", [(6, 10, "200KiB", True), (5, 9, "100KiB", True),
                                                            (4, 13, "150KiB", True), (5, 9, "16KiB", False)])
def test_triples(nocc, nvir, device, symmetric, tmp_path):
    """The (T) job: a loop over ordered occupied tiles (symmetric) where the device holds their
    tiles, streamed inputs; split over many smaller loops where it does not."""
    from tests.conftest import triples_config

    plan = make_plan(spec.load(triples_config(tmp_path, device, nocc, nvir)))
    assert symmetric == any(loop.symmetric for nest in plan.nests for _, loops in ops(nest.body) for loop in loops)
    assert oracle_bytes(plan) == plan.predicted["bytes"]


def test_the_oracle_can_fail(tmp_path):
    """A plan whose loop tiles differently from what it was priced with is caught."""
    rng = random.Random(0)
    cfg = random_chain(3, tmp_path)
    plan = make_plan(spec.loads(yaml.safe_dump(cfg), str(tmp_path / "chain.yaml")))
    loops = [n for nest in plan.nests for n in nest.body if isinstance(n, Loop)]
    loop = rng.choice(loops)
    index = next(iter(loop.tiles))
    loop.tiles[index] = max(1, loop.tiles[index] - 1) if loop.tiles[index] > 1 else loop.tiles[index] + 1
    assert oracle_bytes(plan) != plan.predicted["bytes"]
