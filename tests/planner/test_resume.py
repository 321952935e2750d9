"""Which loops a run can checkpoint: the (T) energy's loop over occupied tiles, not loops that
load or store, nor loops inside other loops."""

from __future__ import annotations

import pytest
import yaml

from chainexec import spec
from chainexec.planner.build import make_plan
from chainexec.planner.plan import Loop, Nest, Op
from chainexec.planner.resume import resumable
from tests.conftest import fourindex_config, run_cli, write_config


def _synthetic(tmp_path, machine):
    assert run_cli("chem", "synthetic", "--synthetic", 4, 6, 7, "--out", tmp_path).returncode == 0
    config = tmp_path / "ccsd_t.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["machine"] = machine
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return make_plan(spec.load(config))


def test_triples_loop_is_resumable(tmp_path):
    plan = _synthetic(tmp_path, {"global_memory": "1GiB", "device_memory": "48KiB"})
    (nest,) = plan.nests
    (pos,) = resumable(nest)
    assert nest.body[pos].parallel and nest.body[pos].symmetric == ["i", "j", "k"]


def test_triples_loop_inside_a_global_loop_is_not(tmp_path):
    """With 16 KiB of global memory the occupied tiles loop at the global level too (loads in
    it): the parallel loop inside reruns from its start."""
    plan = _synthetic(tmp_path, {"global_memory": "16KiB", "device_memory": "1MiB"})
    assert any(isinstance(node, Loop) and not node.parallel for node in plan.nests[0].body)
    assert resumable(plan.nests[0]) == []


def test_fourindex_loops_are_not(tmp_path):
    """The four-index transform's loops load and store tiles: nothing to resume."""
    plan = make_plan(spec.load(write_config(tmp_path, fourindex_config())))
    assert all(resumable(nest) == [] for nest in plan.nests)


@pytest.mark.parametrize("inner,expected", [
    ([Op("get", "device", "A", ["i"]), Op("accumulate", "device", "E", [])], [1]),
    ([Op("get", "device", "A", ["i"])], []),  # nothing accumulated: nothing to save
    ([Op("load", "global", "A", ["i"]), Op("accumulate", "device", "E", [])], []),
    ([Op("store", "global", "E", []), Op("accumulate", "device", "E", [])], []),
])
def test_rules(inner, expected):
    body = [Op("alloc", "global", "E", []), Loop("device", {"i": 2}, parallel=True, body=inner),
            Loop("device", {"i": 2}, parallel=False, body=inner)]
    assert resumable(Nest([0], body)) == expected
