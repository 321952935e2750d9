"""Stored intermediates are laid out for the nests that read them: the indices the consumer's
global loops cut lead, then the producer's; outputs keep their configured order; every reference
is permuted alike (the runs in tests/runtime check the numbers)."""

from __future__ import annotations

import pytest

from chainexec import spec
from chainexec.planner.build import make_plan
from chainexec.planner.plan import ops
from tests.conftest import fourindex_config, write_config


def _cut(op, loops) -> list[str]:
    return [i for loop in loops if loop.level == "global" for i in loop.tiles if i in op.indices]


@pytest.mark.parametrize("n, nmo, limit", [(10, 8, "24KiB"), (12, 12, "40KiB"), (9, 7, "16KiB"), (16, 15, "64KiB")])
def test_stored_intermediates_lead_with_the_indices_their_loops_cut(tmp_path, n, nmo, limit):
    plan = make_plan(spec.load(write_config(tmp_path, fourindex_config(n, nmo, limit, "3KiB"))))
    stored = {op.tensor for nest in plan.nests for op, _ in ops(nest.body) if op.op == "store"}
    assert plan.tensors["B"].indices == list("abcd")
    checked = 0
    for name in stored - {"B"}:
        moves = [(op, loops) for nest in plan.nests for op, loops in ops(nest.body)
                 if op.tensor == name and op.op in ("load", "store")]
        loads = [_cut(op, loops) for op, loops in moves if op.op == "load"]
        stores = [_cut(op, loops) for op, loops in moves if op.op == "store"]
        lead = list(dict.fromkeys(i for cut in loads + stores for i in cut))
        for op, _ in moves:
            assert op.indices[:len(lead)] == lead
        writer = next(c for c in plan.contractions if c.out == name)
        assert sorted(writer.out_indices) == sorted(plan.tensors[name].indices)
        assert [plan.extents[i] for i in writer.out_indices] == plan.tensors[name].shape
        checked += 1
    assert checked
