"""Computed-tensor expressions: parsing rejects anything but numbers, references and + - * /;
evaluation broadcasts references over the computed tensor's indices; the C form the GPU backend
compiles computes the same values (checked here by evaluating that text with NumPy arrays)."""

from __future__ import annotations

import numpy as np
import pytest

from chainexec import expr

DENOMINATOR = "1 / (e_occ[i] + e_occ[j] + e_occ[k] - e_vir[a] - e_vir[b] - e_vir[c])"


def _arrays(tree, extents, rng):
    """One random array per tensor (every extent is 3), shared by its references."""
    base = {}
    for r in expr.refs(tree):
        base.setdefault(r.tensor, rng.standard_normal([3] * len(r.indices)) + 3.0)
    return {r: base[r.tensor] for r in expr.refs(tree)}


def _reference(text, arrays, order, extents):
    """Element by element with Python arithmetic: no broadcasting code shared with expr."""
    out = np.empty([extents[i] for i in order])
    for point in np.ndindex(*out.shape):
        at = dict(zip(order, point))
        code = text
        for r, a in arrays.items():
            code = code.replace(f"{r.tensor}[{','.join(r.indices)}]", repr(float(a[tuple(at[i] for i in r.indices)])))
        out[point] = eval(code)  # test-only: the text is this file's own constant
    return out


@pytest.mark.parametrize("text, order", [
    (DENOMINATOR, ("i", "j", "k", "a", "b", "c")),
    ("2 * x[a,i] - -0.5 * y[i] / x[a,i]", ("i", "a")),
    ("1 / 2 + x[i]", ("i",)),
])
def test_evaluate_and_c_source_agree_with_pointwise_arithmetic(text, order):
    rng = np.random.default_rng(7)
    extents = dict.fromkeys(order, 3)
    tree = expr.parse(text)
    arrays = _arrays(tree, extents, rng)
    expected = _reference(text, arrays, order, extents)
    got = np.broadcast_to(expr.evaluate(tree, arrays, order, np), expected.shape)
    assert np.allclose(got, expected, rtol=1e-14, atol=0)
    names = {r: f"p{k}" for k, r in enumerate(arrays)}
    code = expr.c_source(tree, names)
    assert not any(r.tensor in code for r in arrays)
    views = {name: expr.spread(arrays[r], r, order, np) for r, name in names.items()}
    assert np.allclose(np.broadcast_to(eval(code, {}, views), expected.shape), expected, rtol=1e-14, atol=0)


def test_numbers_become_double_literals():
    """In C, 1 / 2 is 0: every number is written as a double."""
    assert expr.c_source(expr.parse("1 / 2"), {}) == "(1.0 / 2.0)"


@pytest.mark.parametrize("bad", ["1e400 * x[i]", "x[i] ** 2", "f(x[i])", "x[0]", "x[i] if 1 else 2", "__import__('os')",
                                 "1" + "0" * 400 + " * x[i]", "x[i] $ 2", "x.real[i]", "not x[i]"])
def test_only_arithmetic_is_accepted(bad):
    with pytest.raises(ValueError):
        expr.parse(bad)


@pytest.mark.parametrize("text, expected", [
    ("(" * 5000 + "x[i]" + ")" * 5000, None), ("-" * 5000 + "x[i]", None), (" + ".join(["x[i]"] * 5000), None),
    ("x[i]" + "[i]" * 5000, None), ("not " * 5000 + "x[i]", None), ("x[i] if x[i] else " * 3000 + "x[i]", None),
    # 256 characters that nest (the documented limit): parsed, and evaluated as plain arithmetic says.
    (" + ".join(["x[i]"] * 128), 128.0), ("-(" * 127 + "x[i]" + ")" * 127 + " * 2", -2.0),
])
def test_nesting_is_bounded(text, expected):
    """Deeply nested expressions are refused with a ValueError (not Python's RecursionError); at
    the limit they parse and evaluate."""
    if expected is None:
        with pytest.raises(ValueError):
            expr.parse(text)
        return
    tree = expr.parse(text)
    x = np.array([1.0, 3.0])
    assert np.array_equal(expr.evaluate(tree, {expr.Ref("x", ("i",)): x}, ("i",), np), expected * x)
    assert np.array_equal(eval(expr.c_source(tree, {expr.Ref("x", ("i",)): "x"}), {}, {"x": x}), expected * x)
