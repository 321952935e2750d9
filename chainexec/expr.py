"""Element-wise expressions for computed tensors, e.g. an orbital-energy denominator::

    1 / (e_occ[i] + e_occ[j] + e_occ[k] - e_vir[a] - e_vir[b] - e_vir[c])

Parsed with :mod:`ast` (never evaluated as Python): only numbers, tensor references ``T[i,j]``,
``+ - * /`` and parentheses are accepted, and at most :data:`MAX_NESTING` of the characters that
nest (see :func:`_lexicon`). Indices broadcast: the value at a point of the computed
tensor takes each reference at the same index values. Evaluation works on any array module
(NumPy or CuPy) and on tiles: each reference is given as an array over its own index order.
"""

from __future__ import annotations

import ast
import keyword
import re
import sys
from functools import lru_cache
from dataclasses import dataclass

from chainexec.errors import quoted

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
# Characters that can open a level of the expression's tree: operators and signs (+ - * /),
# parentheses and brackets (calls and subscripts) and points (attributes; decimal points count
# too). An expression holds at most this many: the tree is then at most that deep, which Python's
# parser and this module's recursive walks follow well within the interpreter's recursion limit.
MAX_NESTING = 256
_NESTING = "+-*/([."
_ALLOWED = "only numbers, T[i,...] references, + - * / and parentheses are allowed"
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OTHER = re.compile(r"[^\sA-Za-z0-9_.+\-*/()\[\],]")


@dataclass(frozen=True)
class Ref:
    tensor: str
    indices: tuple[str, ...]


@lru_cache(maxsize=256)
def parse(text: str) -> ast.expr:
    """The validated expression tree; ValueError naming the offending part otherwise. Cached: the
    runtime evaluates the same expression for every tile (callers never modify the tree)."""
    _lexicon(text)
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as err:
        raise ValueError(f"cannot parse expression {quoted(text)}: {err.msg}") from None
    _check(tree, text)
    return tree


def _lexicon(text: str) -> None:
    """ValueError unless ``text`` is written with names, numbers, ``+ - * / ( ) [ ] ,`` and
    blanks alone, has no Python keyword (``not`` and ``if``/``else`` nest without any character
    of their own) and at most :data:`MAX_NESTING` characters that nest: what Python's parser
    may then be given."""
    other = _OTHER.search(text)
    word = next((w for w in _WORD.findall(text) if keyword.iskeyword(w)), None)
    if other is not None or word is not None:
        raise ValueError(f"expression {quoted(text)}: {_ALLOWED}, not {other.group() if other else word!r}")
    nesting = sum(map(text.count, _NESTING))
    if nesting > MAX_NESTING:
        raise ValueError(f"expression {quoted(text)} has {nesting} operators, signs, parentheses, brackets and "
                         f"points; at most {MAX_NESTING}, which bound how deeply it nests")


def _check(node: ast.AST, text: str) -> None:
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        _check(node.left, text)
        _check(node.right, text)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        _check(node.operand, text)
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
        # Exact for ints of any size (float() of one past float64's range raises); false for NaN.
        if not abs(node.value) <= sys.float_info.max:
            raise ValueError(f"expression {quoted(text)}: the number {quoted(node.value, 40)} is not a finite float64")
    elif isinstance(node, ast.Subscript):
        _ref(node, text)
    else:
        raise ValueError(f"expression {quoted(text)}: {_ALLOWED}, not {ast.unparse(node)!r}")


def _ref(node: ast.Subscript, text: str) -> Ref:
    if not isinstance(node.value, ast.Name):
        raise ValueError(f"expression {quoted(text)}: {ast.unparse(node)!r} is not a tensor reference")
    items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    if not all(isinstance(i, ast.Name) for i in items):
        raise ValueError(f"expression {quoted(text)}: indices of {ast.unparse(node)!r} must be index names")
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


@lru_cache(maxsize=1024)
def text_refs(text: str) -> tuple[Ref, ...]:
    """:func:`refs` of the expression ``text`` (:func:`parse`), cached: planning asks for those of
    the same few expressions tens of thousands of times (each fused alternative it weighs)."""
    return tuple(refs(parse(text)))


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
