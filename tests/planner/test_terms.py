"""Point-wise terms into one buffer form one run (``plan.pointwise_run``), which the runtime hands to
the backend together and the cost model streams once: in the (T) tile, the
twelve outer products that build V (in one or two calls), the two terms of Z and the six permuted
copies of R are one call each; every contraction that sums over an index, or writes elsewhere, stays alone."""

from __future__ import annotations

from chainexec import spec
from chainexec.planner.build import make_plan
from chainexec.planner.plan import Loop, pointwise_run
from tests.conftest import run_cli


def _bodies(body):
    for node in body:
        if isinstance(node, Loop):
            yield node.body
            yield from _bodies(node.body)


def test_triples_tile_groups_its_pointwise_terms(tmp_path):
    assert run_cli("chem", "synthetic", "--synthetic", 4, 9, 5, "--out", tmp_path).returncode == 0
    plan = make_plan(spec.load(tmp_path / "ccsd_t.yaml"))
    runs = []
    for nest in plan.nests:
        for body in _bodies(nest.body):
            k = 0
            while k < len(body):
                if getattr(body[k], "op", None) == "compute":
                    run = body[k:k + pointwise_run(body, k, plan.contractions)]
                    runs.append([plan.contractions[op.contraction] for op in run])
                    k += len(run)
                else:
                    k += 1
    by_out: dict[str, list[int]] = {}
    for run in runs:
        by_out.setdefault(run[0].out, []).append(len(run))
        if len(run) > 1:
            assert {c.out for c in run} == {run[0].out} and all(c.pointwise() for c in run)
            assert all(run[0].out not in (c.a, c.b) for c in run)
    assert sum(len(run) for run in runs) == len(plan.contractions)
    assert by_out["W"] == [1] * 12 and by_out["E"] == [1]  # sums over f, m; the reduction
    assert by_out["Z"] == [2] and by_out["R"] == [6]
    # V: twelve outer products, in at most two calls (a fetch of f_vo may come between them)
    assert sum(by_out["V"]) == 12 and len(by_out["V"]) <= 2
