"""The NumPy backend's fused statements (:mod:`chainexec.runtime.backends.blockwise`) against
numpy.einsum on fresh random inputs of odd extents: a (T)-shaped full reduction (a reused value
read at permutations, ordered-point weights) and an element-wise statement, with blocks of
every size, inputs left unchanged."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from chainexec.expr import Ref
from chainexec.planner.plan import Fused
from chainexec.runtime.backends import blockwise
from chainexec.runtime.backends.numpy import NumpyBackend

O, V = 3, 5
DOMAIN = ("i", "j", "k", "a", "b", "c")
LET = ("0.5 * W[i,j,k,a,b,c] + ovov[i,a,j,b] * t1[k,c] + ovov[j,b,i,a] * t1[k,c] - t2[i,j,a,b] * f_vo[c,k]"
       " + 2.0 * t2[k,j,c,b] * f_vo[a,i]")
TEXT = ("0.3333333333333333 * W[i,j,k,a,b,c] * (1 / (e_occ[i] + e_occ[j] + e_occ[k] - e_vir[a] - e_vir[b]"
        " - e_vir[c])) * (4.0 * Z[i,j,k,a,b,c] + Z[i,j,k,b,c,a] + Z[i,j,k,c,a,b] - 2.0 * Z[i,j,k,a,c,b]"
        " - 2.0 * Z[i,j,k,b,a,c] - 2.0 * Z[i,j,k,c,b,a])")
# Z read at each permutation of (a, b, c): the einsum subscripts that bring it to i,j,k,a,b,c order
READS = {"abc": 4.0, "bca": 1.0, "cab": 1.0, "acb": -2.0, "bac": -2.0, "cba": -2.0}


def inputs(rng) -> dict[str, np.ndarray]:
    return {"W": rng.standard_normal((O, O, O, V, V, V)), "ovov": rng.standard_normal((O, V, O, V)),
            "t1": rng.standard_normal((O, V)), "t2": rng.standard_normal((O, O, V, V)),
            "f_vo": rng.standard_normal((V, O)), "e_occ": -1 - rng.random(O), "e_vir": 1 + rng.random(V)}


def views(f: Fused, values: dict[str, np.ndarray]) -> dict[Ref, np.ndarray]:
    """Each leaf of ``f`` as the backend gets it: its tensor's array over the reference's order."""
    return {r: values[r.tensor] for r in f.leaves}


def ordered_weights(within: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """Per (i, j, k): the distinct permutations of its coordinates within each group where they
    do not decrease there, else 0."""
    w = np.zeros((O, O, O))
    for point in itertools.product(range(O), repeat=3):
        weight = 1
        for g in within:
            values = [point[d] for d in g]
            if values != sorted(values):
                weight = 0
                break
            weight *= math.factorial(len(g)) // math.prod(math.factorial(values.count(v)) for v in set(values))
        w[point] = weight
    return w


def reference_energy(x: dict[str, np.ndarray], within) -> float:
    z = (0.5 * x["W"] + np.einsum("iajb,kc->ijkabc", x["ovov"], x["t1"])
         + np.einsum("jbia,kc->ijkabc", x["ovov"], x["t1"]) - np.einsum("ijab,ck->ijkabc", x["t2"], x["f_vo"])
         + 2.0 * np.einsum("kjcb,ai->ijkabc", x["t2"], x["f_vo"]))
    r = sum(c * np.einsum(f"ijk{p}->ijkabc", z) for p, c in READS.items())
    e_o, e_v = x["e_occ"], x["e_vir"]
    d = 1 / ((e_o[:, None, None] + e_o[None, :, None] + e_o[None, None, :])[..., None, None, None]
             - (e_v[:, None, None] + e_v[None, :, None] + e_v[None, None, :]))
    return float(np.einsum("ijkabc,ijkabc,ijkabc,ijk->", x["W"], d, r, ordered_weights(within)) / 3)


@pytest.mark.parametrize("limit", [1 << 17, 2 * V ** 3, V ** 3, 7])
@pytest.mark.parametrize("within", [((0, 1, 2),), ((0, 1), (2,)), ((0,), (1, 2)), ((0,), (1,), (2,)), ()])
def test_reduction_with_reused_value_equals_einsum(limit, within, monkeypatch):
    monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", limit)
    rng = np.random.default_rng([limit, len(within)])
    x = inputs(rng)
    kept = {name: a.copy() for name, a in x.items()}
    f = Fused("E", (), DOMAIN, TEXT, True, (("Z", DOMAIN, LET),))
    out = np.array(0.25)
    NumpyBackend().fused(f, views(f, x), (O, O, O, V, V, V), out, within)
    expected = reference_energy(x, within if within else ((0,), (1,), (2,)))
    assert abs(float(out) - 0.25 - expected) <= 1e-12 * abs(expected)
    assert all(np.array_equal(x[name], kept[name]) for name in x)


@pytest.mark.parametrize("limit", [1 << 17, 15, 1])
def test_elementwise_statement_equals_einsum(limit, monkeypatch):
    monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", limit)
    rng = np.random.default_rng(limit)
    x = {"A": rng.standard_normal((3, 7)), "B": rng.standard_normal((5, 7)), "C": rng.standard_normal((3, 5)),
         "D": 1 + rng.random(7)}
    kept = {name: a.copy() for name, a in x.items()}
    f = Fused("Y", ("i", "j", "a"), ("i", "j", "a"),
              "A[i,a] * B[j,a] - 2 * C[i,j] / (D[a] + 3) + A[i,a] * C[i,j] - -1.5", False)
    out = rng.standard_normal((3, 5, 7))
    expected = out + (np.einsum("ia,ja->ija", x["A"], x["B"]) - 2 * x["C"][:, :, None] / (x["D"] + 3)
                      + np.einsum("ia,ij->ija", x["A"], x["C"]) + 1.5)
    NumpyBackend().fused(f, views(f, x), (3, 5, 7), out)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    assert all(np.array_equal(x[name], kept[name]) for name in x)
