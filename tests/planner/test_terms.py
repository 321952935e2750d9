"""Terms of one kind into one buffer form one run (``plan.term_run``), which the runtime hands to
the backend together and the cost model streams once: in the (T) tile, the twelve contractions
that build W (a sum kernel), the twelve outer products that build V (in one or two calls), the
two terms of Z and the six permuted copies of R are one call each; the reduction to E, which
reads other buffers' products, stays alone, and point-wise terms never join contractions."""

from __future__ import annotations

from chainexec import spec
from chainexec.planner.build import make_plan
from chainexec.planner.plan import Loop, term_run
from tests.conftest import triples_config


def _bodies(body):
    for node in body:
        if isinstance(node, Loop):
            yield node.body
            yield from _bodies(node.body)


def test_triples_tile_groups_its_pointwise_terms(tmp_path):
    # Unfused (the runs as they are before point-wise producers are inlined, test_inline.py)
    plan = make_plan(spec.load(triples_config(tmp_path, "256MiB", 4, 9, 5)), inline=False)
    runs = []
    for nest in plan.nests:
        for body in _bodies(nest.body):
            k = 0
            while k < len(body):
                if getattr(body[k], "op", None) == "compute":
                    run = body[k:k + term_run(body, k, plan.contractions)]
                    runs.append([plan.contractions[op.contraction] for op in run])
                    k += len(run)
                else:
                    k += 1
    by_out: dict[str, list[int]] = {}
    for run in runs:
        by_out.setdefault(run[0].out, []).append(len(run))
        if len(run) > 1:
            assert {c.out for c in run} == {run[0].out} and len({c.pointwise() for c in run}) == 1
            assert all(run[0].out not in (c.a, c.b) for c in run)
    assert sum(len(run) for run in runs) == len(plan.contractions)
    # W: six sums over f and six over m, in at most two calls (a fetch may come between them)
    assert sum(by_out["W"]) == 12 and len(by_out["W"]) <= 2 and by_out["E"] == [1]
    assert by_out["Z"] == [2] and by_out["R"] == [6]
    # V: six outer products (the pair sums of ovov and of t2 times t1 and f_vo), each after its pair
    # sum is made (an eval statement between two of them)
    assert by_out["V"] == [1] * 6


def test_a_sum_over_one_operand_alone_is_not_a_run_term():
    """``X[i] += A[i,k]·B[i]`` sums k over A alone: no sum kernel term (it needs k in both)."""
    from chainexec.planner.plan import Contraction, Op

    cs = [Contraction(0, "X", ["i"], "A", ["i", "k"], "B", ["i"], 1.0, False, 8, 0),
          Contraction(1, "X", ["i"], "C", ["i", "k"], "D", ["k"], 1.0, True, 8, 1),
          Contraction(2, "X", ["i"], "C", ["i", "k"], "D", ["k"], 1.0, True, 8, 2),
          Contraction(3, "X", ["i"], "A", ["i"], "B", ["i"], 1.0, True, 8, 3)]
    body = [Op("compute", "device", contraction=n) for n in range(4)]
    assert [term_run(body, k, cs) for k in range(4)] == [1, 2, 1, 1]
