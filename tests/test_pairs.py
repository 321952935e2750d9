"""Symmetry declarations (``chainexec/pairs.py``): parsing, PySCF layout names, and the check that
a statement keeps its result's symmetry — against a numerical check of the result itself."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from chainexec import pairs

EXTENTS = {"p": 4, "q": 4, "r": 4, "s": 4, "a": 3, "b": 3, "c": 3, "d": 3, "x": 2}


@pytest.mark.parametrize("value, indices, kind, count", [
    ({"pairs": [["p", "q"], ["r", "s"]], "exchange": True}, "pqrs", "s8", 8),
    ({"pairs": [["p", "q"], ["r", "s"]]}, "pqrs", "s4", 4),
    ({"pairs": [["p", "q"]]}, "pqrs", "s2ij", 2),
    ({"pairs": [["r", "s"]]}, "pqrs", "s2kl", 2),
    ({"pairs": [["p", "q"]]}, "pq", "s2", 2),
])
def test_kinds_and_permutations(value, indices, kind, count):
    sym = pairs.parse(value, tuple(indices), EXTENTS)
    assert sym.kind(len(indices)) == kind
    perms = sym.permutations(len(indices))
    assert len(perms) == len(set(perms)) == count and perms[0] == tuple(range(len(indices)))


@pytest.mark.parametrize("value, indices, problem", [
    ({"pairs": [["p", "r"]]}, "pqrs", "not two adjacent indices"),
    ({"pairs": [["q", "p"]]}, "pqrs", "not two adjacent indices"),
    ({"pairs": [["p", "a"]]}, "pars", "one extent"),
    ({"pairs": [["p", "q"], ["a", "b"]], "exchange": True}, "pqab", "exchange needs two pairs of one extent"),
    ({"pairs": [["p", "q"]], "exchange": True}, "pqrs", "exchange needs two pairs"),
    ({"pairs": [["p", "z"]]}, "pqrs", "names an index the tensor does not have"),
    ({"pairs": [["p", "q"], ["q", "r"]]}, "pqrs", "in two pairs"),
    ({"pairs": [["p", "q"]]}, "pqx", "2 or 4 indices"),
    ({"pairs": "pq"}, "pqrs", "list of index pairs"),
    ({"pairs": [["p", "q"]], "exchange": "yes"}, "pqrs", "true or false"),
    ([["p", "q"]], "pqrs", "is a mapping"),
    ({"pairs": [["p", "q"]], "swap": True}, "pqrs", "is a mapping"),
])
def test_bad_declarations(value, indices, problem):
    with pytest.raises(ValueError, match=problem):
        pairs.parse(value, tuple(indices), EXTENTS)


def _symmetric_tensor(rng, n: int, sym: pairs.Symmetry) -> np.ndarray:
    """A random 4-index tensor made symmetric by averaging over the symmetry's permutations."""
    x = rng.standard_normal((n,) * 4)
    return sum(np.transpose(x, perm) for perm in sym.permutations(4)) / len(sym.permutations(4))


MATRICES = {
    "one matrix": ("C", "C", "C", "C"),
    "two matrices, one per pair": ("C", "C", "D", "D"),
    "two matrices, one per position": ("C", "D", "C", "D"),
    "a matrix per index": ("C", "D", "E", "F"),
}


@pytest.mark.parametrize("source", ["s8", "s4"])
@pytest.mark.parametrize("result", ["s8", "s4", "s2ij", "s2kl"])
@pytest.mark.parametrize("case", sorted(MATRICES))
def test_preserved_agrees_with_the_numbers(case, result, source):
    """The four-index transform with its matrices assigned in several ways: ``preserved`` says it
    keeps a symmetry exactly when the result computed with NumPy has it."""
    rng = np.random.default_rng(7)
    declarations = {"s8": {"pairs": [["a", "b"], ["c", "d"]], "exchange": True},
                    "s4": {"pairs": [["a", "b"], ["c", "d"]]}, "s2ij": {"pairs": [["a", "b"]]},
                    "s2kl": {"pairs": [["c", "d"]]}}
    a_sym = pairs.parse(declarations[source] | {"pairs": [["p", "q"], ["r", "s"]]}, tuple("pqrs"), EXTENTS)
    b_sym = pairs.parse(declarations[result], tuple("abcd"), {i: 4 for i in "abcd"})
    names = MATRICES[case]
    mats = {m: rng.standard_normal((4, 4)) for m in set(names)}
    A = _symmetric_tensor(rng, 4, a_sym)
    B = np.einsum("pa,qb,rc,sd,pqrs->abcd", *(mats[m] for m in names), A)
    numeric = all(np.allclose(B, np.transpose(B, perm)) for perm in b_sym.permutations(4))
    refs = [(m, (i, o)) for m, i, o in zip(names, "pqrs", "abcd")] + [("A", tuple("pqrs"))]
    said = pairs.preserved(tuple("abcd"), b_sym, refs, {"A": a_sym}, {i: 4 for i in "pqrsabcd"})
    assert (said is None) == numeric, said


def test_too_many_summed_indices():
    refs = [("T", tuple("abcdefghi")), ("U", tuple("abcdefghi") + ("x", "y"))]
    sym = pairs.Symmetry((0,))
    said = pairs.preserved(("x", "y"), sym, refs, {}, dict.fromkeys("abcdefghixy", 2))
    assert "at most 8" in said


def test_permutations_are_a_group():
    sym = pairs.Symmetry((0, 2), True)
    perms = set(sym.permutations(4))
    for f, g in itertools.product(perms, repeat=2):
        assert tuple(f[i] for i in g) in perms
