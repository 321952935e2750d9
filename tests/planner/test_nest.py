"""Loop-nest emission invariants. A stored version is written once, so no ``store`` may sit inside
a global loop that tiles an index its tensor lacks (each tile would overwrite the last tile's
partial sum); checked on every schedule alternative that fits, over the paper's expressions, the
four-index transform, the (T) chain and chains that end in reductions, at limits that tile."""

from __future__ import annotations

from pathlib import Path

import yaml

from chainexec import spec
from chainexec.planner.build import contractions, make_plan
from chainexec.planner.nest import Emitter
from chainexec.planner.plan import ops
from tests.conftest import fourindex_config, write_config
from tests.runtime.test_reductions import CHAINS, _config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SCHEDULES = ["unfused", "paper: disk", "paper: disk+global", None]


def _configs(folder: Path):
    for name in sorted(CHAINS):
        for limits in [("12KiB", "2KiB"), ("40KiB", "8KiB")]:
            yield write_config(folder, _config(CHAINS[name], *limits), f"{len(list(folder.iterdir()))}.yaml")
    for limits in [("24KiB", "3KiB"), ("64KiB", "8KiB")]:
        yield write_config(folder, fourindex_config(global_memory=limits[0], device_memory=limits[1]), "fourindex.yaml")
    cfg = yaml.safe_load((CONFIGS / "ccsd_t.yaml").read_text())
    cfg["ranges"] = {"occ": 3, "vir": 5}
    for limits in [("8KiB", "1MiB"), ("24KiB", "8KiB")]:
        cfg["machine"] = {"global_memory": limits[0], "device_memory": limits[1]}
        yield write_config(folder, cfg, "ccsd_t.yaml")
    for name in "abcde":
        cfg = yaml.safe_load((CONFIGS / f"expr_{name}.yaml").read_text())
        cfg["ranges"]["N"] = 4
        cfg["machine"] = {"global_memory": "16KiB", "device_memory": "2KiB"}
        yield write_config(folder, cfg, f"expr_{name}.yaml")


def test_no_store_inside_a_loop_over_an_index_its_tensor_lacks(tmp_path):
    planned = 0
    for config in _configs(tmp_path):
        s = spec.load(config)
        for schedule in SCHEDULES:
            try:
                plan = make_plan(s, schedule=schedule)
            except Exception as err:  # the named alternative does not fit these limits
                assert "no schedule named" in str(err), err
                continue
            planned += 1
            for nest in plan.nests:
                for op, loops in ops(nest.body):
                    if op.op == "store":
                        tiled = {i for loop in loops if loop.level == "global" for i in loop.tiles}
                        assert tiled <= set(op.indices), (config.name, schedule, op, tiled)
    assert planned >= 40


def _emitter(name: str, tmp_path) -> Emitter:
    s = spec.load(write_config(tmp_path, _config(CHAINS[name], "1GiB", "1GiB")))
    cs, tensors, _ = contractions(s)
    return Emitter(cs, s.extents, tensors)


def test_exported_sums_lack_every_fused_index(tmp_path):
    """x[i] and z[j] read one matrix M[i,j] that nothing exports: a loop over i or j would leave
    one of them partial, so the group has no fused loop."""
    emitter = _emitter("two vectors of one matrix", tmp_path)
    members = list(range(len(emitter.cs)))
    assert emitter.group_common(members) == []
    assert emitter.valid(members)


def test_a_partial_sum_is_not_read_inside_its_group(tmp_path):
    """E[] sums T over the fused loop; F = E·T inside the same group would read a partial E."""
    emitter = _emitter("a scalar read back in the chain", tmp_path)
    members = list(range(len(emitter.cs)))
    assert set(emitter.group_common(members)) == {"i", "j", "l"}
    assert not emitter.valid(members)
    e = next(k for k, c in enumerate(emitter.cs) if c.out == "E")
    assert emitter.valid(members[:e + 1])


def test_a_computed_operands_inputs_share_the_operands_device_buffers(tmp_path):
    """(T) at o=10, v=8 with its inputs fetched tile by tile (256 KiB of device memory): the pair
    sum ``Q[i,j,a,b] = t2[i,j,a,b] + t2[j,i,b,a]`` reads the slabs of ``t2`` that W's terms read
    (``t2[i,j,a,f]``, ``t2[j,i,b,f]``, …): each such slab is fetched once per tile and held from
    its W term to the pair sum, and the first two W terms, which hold their operands, stay one
    run of terms that is symmetrized."""
    from chainexec.planner.nest import same_region
    from chainexec.planner.symmetry import runs
    from tests.conftest import triples_config

    plan = make_plan(spec.load(triples_config(tmp_path, "256KiB", 10, 8)))
    loop = next(loops[-1] for nest in plan.nests for _, loops in ops(nest.body)
                if loops and loops[-1].level == "device" and loops[-1].symmetric)
    tiled = set(loop.tiles)
    gets = [op.indices for op in loop.body if getattr(op, "op", None) == "get" and op.tensor == "t2"]
    evals = [op for op in loop.body if getattr(op, "op", None) == "eval" and op.tensor == "Q"]
    assert len(evals) == 3 and gets
    assert not any(same_region(a, b, tiled) for n, a in enumerate(gets) for b in gets[:n])
    run = runs(loop.body, loop, plan.contractions)[0]
    assert len(run) == 2 and loop.body[run[0]].symmetrized
