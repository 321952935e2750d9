"""Element-wise expressions for computed tensors, e.g. an orbital-energy denominator::

    1 / (e_occ[i] + e_occ[j] + e_occ[k] - e_vir[a] - e_vir[b] - e_vir[c])

Parsed with :mod:`ast` (never evaluated as Python): only numbers, tensor references ``T[i,j]``,
``+ - * /`` and parentheses are accepted. Indices broadcast: the value at a point of the computed
tensor takes each reference at the same index values. Evaluation works on any array module
(NumPy or CuPy) and on tiles: each reference is given as an array over its own index order.
"""

from __future__ import annotations

import ast
import math
from functools import lru_cache
from dataclasses import dataclass

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@dataclass(frozen=True)
class Ref:
    tensor: str
    indices: tuple[str, ...]


@lru_cache(maxsize=256)
def parse(text: str) -> ast.expr:
    """The validated expression tree; ValueError naming the offending part otherwise. Cached: the
    runtime evaluates the same expression for every tile (callers never modify the tree)."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as err:
        raise ValueError(f"cannot parse expression {text!r}: {err.msg}") from None
    _check(tree, text)
    return tree


def _check(node: ast.AST, text: str) -> None:
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        _check(node.left, text)
        _check(node.right, text)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        _check(node.operand, text)
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not math.isfinite(float(node.value)):
            raise ValueError(f"expression {text!r}: the number {ast.unparse(node)} is not finite")
    elif isinstance(node, ast.Subscript):
        _ref(node, text)
    else:
        raise ValueError(f"expression {text!r}: only numbers, T[i,...] references, + - * / and parentheses "
                         f"are allowed, not {ast.unparse(node)!r}")


def _ref(node: ast.Subscript, text: str) -> Ref:
    if not isinstance(node.value, ast.Name):
        raise ValueError(f"expression {text!r}: {ast.unparse(node)!r} is not a tensor reference")
    items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    if not all(isinstance(i, ast.Name) for i in items):
        raise ValueError(f"expression {text!r}: indices of {ast.unparse(node)!r} must be index names")
    return Ref(node.value.id, tuple(i.id for i in items))


def refs(tree: ast.expr) -> list[Ref]:
    """Every tensor reference in the tree, in order, without repeats."""
    found: list[Ref] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            ref = _ref(node, "")
            if ref not in found:
                found.append(ref)
    return found


def spread(array, ref: Ref, order: tuple[str, ...], xp):
    """``array`` (``ref`` over its own index order) as a view over ``order``, with length-1 axes
    for the indices it lacks, so that it broadcasts against the computed tensor."""
    present = [i for i in order if i in ref.indices]
    array = xp.transpose(array, [ref.indices.index(i) for i in present])
    return xp.reshape(array, [array.shape[present.index(i)] if i in present else 1 for i in order])


def c_source(tree: ast.expr, params: dict[Ref, str]) -> str:
    """The expression as a C expression over the parameter names ``params`` (one per reference),
    numbers written as double literals (so ``1 / x`` never becomes integer division). Only the
    validated tree reaches the text: tensor and index names do not appear in it."""

    def text(node) -> str:
        if isinstance(node, ast.BinOp):
            return f"({text(node.left)} {_OPS[type(node.op)]} {text(node.right)})"
        if isinstance(node, ast.UnaryOp):
            return f"(-{text(node.operand)})" if isinstance(node.op, ast.USub) else text(node.operand)
        if isinstance(node, ast.Constant):
            return repr(float(node.value))
        return params[_ref(node, "")]

    return text(tree)


def evaluate(tree: ast.expr, arrays: dict[Ref, object], order: tuple[str, ...], xp):
    """The expression over index order ``order``; ``arrays[ref]`` holds ``ref`` over its own index
    order (the region being computed), and is broadcast along the indices it lacks."""

    def value(node):
        if isinstance(node, ast.BinOp):
            left, right = value(node.left), value(node.right)
            op = _OPS[type(node.op)]
            return left + right if op == "+" else left - right if op == "-" else left * right if op == "*" \
                else left / right
        if isinstance(node, ast.UnaryOp):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.Constant):
            return float(node.value)
        ref = _ref(node, "")
        return spread(arrays[ref], ref, order, xp)

    return value(tree)
