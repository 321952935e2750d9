"""A fused statement (:class:`chainexec.planner.plan.Fused`) evaluated with NumPy block by block.

NumPy evaluates an expression one operation at a time, each over whole arrays: over a (T) tile's
six dimensions every intermediate is tens of megabytes, and each operation streams its operands
through main memory. Here the statement runs over blocks of its domain (the leading indices
fixed, about :data:`BLOCK_ELEMENTS` points in each), so that a block's intermediates stay in
the core's cache and are written into arrays kept from the block before (:class:`Scratch`), with
as few operations as the expression allows:

- the expression is rewritten once per statement as sums of products (:func:`program`):
  constants gather into one coefficient per product, products of one factor with a sum spread
  over its terms, and a factor that several terms of a sum share is taken out of them
  (``a·x + b·x`` becomes ``x·(a + b)``, ``x`` multiplied once at the size of the sum);
- a product multiplies its factors smallest first, its coefficient into the smallest, and a sum
  adds its terms smallest first, so that broadcasting widens an operand as late as it can; a
  product that broadcasts both its operands is an outer product, by ``numpy.einsum``;
- a full reduction multiplies in the weights of ordered points
  (:func:`chainexec.ordering.weights`) as one more factor (a number in blocks where the weighted
  indices are fixed), skips blocks whose weights are all zero, narrows the others to their
  weighted points, and ends each block with dot products (``numpy.einsum``): of its largest
  factor with the product of the others, or, where a factor sums references (the reused
  value's permutations), of each of those with the product of the others, that sum never formed.

Reused values (``Fused.lets``) are computed once per block and read at each of their
permutations: only indices that every such read keeps in place are fixed or narrowed.
Rounding differs from one whole-array evaluation only by the order of the additions.
"""

from __future__ import annotations

import ast
import itertools
import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from chainexec import expr
from chainexec.ordering import weights

BLOCK_ELEMENTS = 1 << 17
"""Points of the domain a block holds about, where fixing leading indices can keep it so: the
few float64 arrays of a block's operations stay in one core's cache."""


@dataclass(frozen=True)
class Leaf:
    """A reference to a buffer, or to a reused value (``let``) of the statement."""

    ref: expr.Ref
    let: bool


@dataclass(frozen=True)
class Product:
    """``coef`` × the product of ``factors`` (leaves, quotients and sums)."""

    coef: float
    factors: tuple


@dataclass(frozen=True)
class Sum:
    """The sum of ``terms`` (products)."""

    terms: tuple[Product, ...]


@dataclass(frozen=True)
class Quotient:
    """``num / den``."""

    num: Sum
    den: Sum


def _one(factor) -> Sum:
    return Sum((Product(1.0, (factor,)),))


def _terms(s: Sum) -> list[Product]:
    """``s``'s terms, those that are a number times one sum replaced by that sum's terms."""
    out = []
    for t in s.terms:
        if len(t.factors) == 1 and isinstance(t.factors[0], Sum):
            out += [Product(t.coef * u.coef, u.factors) for u in _terms(t.factors[0])]
        else:
            out.append(t)
    return out


def _product(a: Sum, b: Sum) -> Sum:
    """``a × b``, as one product of their factors (a sum of several terms a factor itself)."""
    (ca, fa), (cb, fb) = [(s.terms[0].coef, s.terms[0].factors) if len(s.terms) == 1 else (1.0, (s,))
                          for s in (a, b)]
    return Sum((Product(ca * cb, fa + fb),))


def _factored(terms: list[Product]) -> Sum:
    """The sum of ``terms`` with every factor that two or more of them share taken out of those
    (the most shared first): ``Σ c_t·x·g_t`` becomes ``x·Σ c_t·g_t``."""
    terms = list(terms)
    while True:
        shared = Counter(f for t in terms for f in set(t.factors)).most_common(1)
        if not shared or shared[0][1] < 2:
            return Sum(tuple(terms))
        x = shared[0][0]
        inner = [Product(t.coef, _without(t.factors, x)) for t in terms if x in t.factors]
        terms = [t for t in terms if x not in t.factors] + [Product(1.0, (x, _factored(inner)))]


def _without(factors: tuple, x) -> tuple:
    k = factors.index(x)
    return factors[:k] + factors[k + 1:]


def normal(node: ast.expr, lets: frozenset[str]) -> Sum:
    """The :mod:`chainexec.expr` tree ``node`` as a sum of products; references to the names in
    ``lets`` are reused values."""
    if isinstance(node, ast.Constant):
        return Sum((Product(float(node.value), ()),))
    if isinstance(node, ast.Subscript):
        ref = expr.refs(node)[0]
        return _one(Leaf(ref, ref.tensor in lets))
    if isinstance(node, ast.UnaryOp):
        inner = normal(node.operand, lets)
        sign = -1.0 if isinstance(node.op, ast.USub) else 1.0
        return Sum(tuple(Product(sign * t.coef, t.factors) for t in inner.terms))
    left, right = normal(node.left, lets), normal(node.right, lets)
    if isinstance(node.op, ast.Mult):
        return _product(left, right)
    if isinstance(node.op, ast.Div):
        return _one(Quotient(left, right))
    sign = -1.0 if isinstance(node.op, ast.Sub) else 1.0
    return _factored(_terms(left) + [Product(sign * t.coef, t.factors) for t in _terms(right)])


@dataclass(frozen=True)
class Program:
    """A fused statement ready to run by blocks: its lets ``(name, indices, sum)`` and its value,
    and ``fixed``: the leading domain dimensions that every read of a let keeps in place (those a
    block may fix or narrow)."""

    lets: tuple[tuple[str, tuple[str, ...], Sum], ...]
    value: Sum
    fixed: int


@lru_cache(maxsize=64)
def program(f) -> Program:
    """:class:`Program` of fused statement ``f`` (made once per statement)."""
    names = frozenset(name for name, _, _ in f.lets)
    lets = tuple((name, tuple(own), normal(expr.parse(text), frozenset())) for name, own, text in f.lets)
    reads = [(r, own) for name, own, _ in f.lets for r in expr.refs(f.tree) if r.tensor == name]
    fixed = 0
    for d in f.domain:
        if not all((o == d) == (i == d) for r, own in reads for o, i in zip(own, r.indices)):
            break
        fixed += 1
    return Program(lets, normal(f.tree, names), fixed)


@lru_cache(maxsize=256)
def blocks(shape: tuple[int, ...], within: tuple[tuple[int, ...], ...], fixed: int, limit: int) -> tuple:
    """The blocks of a domain of ``shape``: each ``(slices, weight)``, ``slices`` one per
    dimension, ``weight`` the block's weights (:func:`chainexec.ordering.weights` over
    ``within``; a number where they are one, None without ``within``). Leading dimensions
    (``fixed`` of them at most) are fixed, the last of them in runs of consecutive values, so
    that a block holds about ``limit`` points; blocks without a weighted point are
    left out, the others narrowed to their weighted points along the first ``fixed``
    dimensions."""
    lead = 0
    while lead < fixed and math.prod(shape[lead:]) > limit:
        lead += 1
    run = max(1, limit // math.prod(shape[lead:])) if lead else 1
    w = weights(shape, within) if within else None
    grouped = {d for g in within for d in g}
    out = []
    ranges = []
    if lead:
        ranges = [[(p, p + 1) for p in range(n)] for n in shape[:lead - 1]]
        ranges.append([(p, min(p + run, shape[lead - 1])) for p in range(0, shape[lead - 1], run)])
    for point in itertools.product(*ranges):
        slices = [slice(*r) for r in point] + [slice(0, n) for n in shape[lead:]]
        weight = None
        if w is not None:
            where = np.nonzero(w[_grouped(slices, grouped)])
            if not where[0].size:
                continue
            for d in range(max(0, lead - 1), fixed):
                if d in grouped:
                    start = slices[d].start
                    slices[d] = slice(start + int(where[d].min()), start + int(where[d].max()) + 1)
            part = w[_grouped(slices, grouped)]
            weight = float(part.flat[0]) if np.all(part == part.flat[0]) else part
        out.append((tuple(slices), weight))
    return tuple(out)


def _grouped(slices: list[slice], grouped: set[int]) -> tuple:
    """``slices`` as an index of the weights, whose dimensions outside ``grouped`` have one element."""
    return tuple(s if d in grouped else slice(None) for d, s in enumerate(slices))


class Scratch:
    """Arrays of a block's intermediates, kept for the next operation of the same size: a new
    NumPy array of a block's size costs more in fresh pages than the operation that fills it."""

    def __init__(self):
        self.free: dict[tuple, list[np.ndarray]] = {}

    def take(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        size = math.prod(shape)
        kept = self.free.get((size, np.dtype(dtype)))
        return (kept.pop() if kept else np.empty(size, dtype)).reshape(shape)

    def give(self, value) -> None:
        """Keep ``value``'s array, which nothing reads any more."""
        array, owned = value
        if owned:
            self.free.setdefault((array.size, array.dtype), []).append(array.reshape(-1))


class Block:
    """One block's evaluation: ``arrays[ref]`` each reference's tile over its own order,
    ``slices`` the block's range of each domain index (by name). Values are pairs ``(array,
    owned)``: an array (or a number) and whether it is a temporary of this block, which the
    next operation may overwrite."""

    def __init__(self, arrays: dict, slices: dict[str, slice], scratch: Scratch):
        self.arrays = arrays
        self.slices = slices
        self.scratch = scratch
        self.lets: dict[str, tuple] = {}

    def binary(self, ufunc, x, y):
        """``ufunc(x, y)`` into an owned operand of the result's shape, or a scratch array."""
        (a, a_owned), (b, b_owned) = x, y
        if not isinstance(a, np.ndarray) and not isinstance(b, np.ndarray):
            return float(ufunc(a, b)), False
        shape = _broadcast(a, b)
        if a_owned and a.shape == shape:
            out, spent = a, y
        elif b_owned and b.shape == shape:
            out, spent = b, x
        else:
            dtype = _dtype(a, b)
            out, spent = self.scratch.take(shape, dtype), None
        if spent is None and ufunc is np.multiply and isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
            _outer(a, b, out)
        else:
            ufunc(a, b, out=out)
        for value in (x, y) if spent is None else (spent,):
            self.scratch.give(value)
        return out, True

    def leaf(self, leaf: Leaf, order: tuple[str, ...]):
        if leaf.let:
            return expr.spread(self.lets[leaf.ref.tensor][0], leaf.ref, order, np), False
        array = self.arrays[leaf.ref]
        return expr.spread(array[tuple(self.slices[i] for i in leaf.ref.indices)], leaf.ref, order, np), False

    def let(self, name: str, own: tuple[str, ...], value: Sum) -> None:
        extents = [self.slices[i].stop - self.slices[i].start for i in own]
        array, owned = self.sum(value, own)
        self.lets[name] = (np.broadcast_to(array, extents), array if owned else None)

    def release(self) -> None:
        """Give the lets' arrays back to the scratch."""
        for _, array in self.lets.values():
            if array is not None:
                self.scratch.give((array, True))

    def factor(self, node, order):
        if isinstance(node, Leaf):
            return self.leaf(node, order)
        if isinstance(node, Sum):
            return self.sum(node, order)
        return self.binary(np.divide, self.sum(node.num, order), self.sum(node.den, order))

    def factors(self, p: Product, order, extra=()) -> list:
        """``p``'s factors' values (and ``extra`` ones), smallest first."""
        return sorted([self.factor(f, order) for f in p.factors] + list(extra), key=lambda v: np.size(v[0]))

    def product(self, p: Product, order):
        """``p``: its factors multiplied smallest first, its coefficient into the smallest."""
        values = self.factors(p, order)
        if not values:
            return p.coef, False
        if p.coef != 1.0:
            values[0] = self.binary(np.multiply, (p.coef, False), values[0])
        return self.multiplied(values)

    def multiplied(self, values: list):
        total = values[0]
        for value in values[1:]:
            total = self.binary(np.multiply, total, value)
        return total

    def sum(self, s: Sum, order):
        """``s`` over index order ``order``: its terms added smallest first (a term of negative
        coefficient subtracted)."""
        values = sorted(((self.product(Product(abs(t.coef), t.factors), order), t.coef < 0) for t in s.terms),
                        key=lambda v: np.size(v[0][0]))
        total, negative = values[0]
        if negative:
            total = self.binary(np.subtract, (0.0, False), total)
        for value, negative in values[1:]:
            total = self.binary(np.subtract if negative else np.add, total, value)
        return total

    def reduced(self, s: Sum, order, weight) -> float:
        """Σ over the block of ``s`` times ``weight``. A product's largest factor is dotted with
        the product of the others; a factor that sums references (``4·Z[…] + Z[…] - 2·Z[…]``) is
        left unevaluated, and each of its terms dotted instead."""
        p = s.terms[0] if len(s.terms) == 1 else Product(1.0, (s,))
        coef = p.coef * (weight if isinstance(weight, float) else 1.0)
        spread = next((f for f in p.factors if isinstance(f, Sum)
                       and all(len(t.factors) == 1 and isinstance(t.factors[0], Leaf) for t in f.terms)), None)
        rest = Product(1.0, _without(p.factors, spread)) if spread is not None else p
        extra = () if weight is None or isinstance(weight, float) else ((weight, False),)
        values = self.factors(rest, order, extra)
        shape = tuple(sl.stop - sl.start for sl in (self.slices[i] for i in order))
        if spread is not None:
            other = self.multiplied(values) if values else (1.0, False)
            total = sum(t.coef * self.dot(other, self.leaf(t.factors[0], order), shape) for t in spread.terms)
        elif not values:
            return coef * math.prod(shape)
        else:
            last = values.pop()
            other = self.multiplied(values) if values else (1.0, False)
            total = self.dot(other, last, shape)
            self.scratch.give(last)
        self.scratch.give(other)
        return coef * total

    def dot(self, x, y, shape: tuple[int, ...]) -> float:
        """Σ x·y over a block of ``shape`` (either may broadcast along some of its dimensions);
        neither is given back to the scratch."""
        a, b = x[0], y[0]
        if np.shape(a) == np.shape(b) == shape:
            letters = "".join(chr(ord("a") + d) for d in range(len(shape)))
            return float(np.einsum(f"{letters},{letters}->", a, b))
        product = np.multiply(a, b)
        return float(np.sum(product)) * math.prod(shape) / np.size(product)


def _broadcast(a, b) -> tuple[int, ...]:
    """The shape ``a`` and ``b`` broadcast to: arrays of one number of dimensions (every value
    of a block spans the block's), or a number and an array."""
    if not isinstance(a, np.ndarray):
        return b.shape
    if not isinstance(b, np.ndarray):
        return a.shape
    return tuple(n if m == 1 else m for m, n in zip(a.shape, b.shape))


def _dtype(a, b):
    """The dtype of ``ufunc(a, b)``: a number takes the array's (NumPy's rule for Python numbers)."""
    if not isinstance(a, np.ndarray):
        return b.dtype
    if not isinstance(b, np.ndarray) or a.dtype == b.dtype:
        return a.dtype
    return np.result_type(a, b)


def _outer(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a·b``, ``out`` C-contiguous in the shape they broadcast to: by ``numpy.einsum``
    over the dimensions longer than one where they broadcast (its loops outrun a ufunc's over a
    broadcast operand's short rows), else by ``numpy.multiply``."""
    if a.shape == out.shape == b.shape:
        np.multiply(a, b, out=out)
        return
    long = [d for d, n in enumerate(out.shape) if n > 1]
    letters = {d: chr(ord("a") + k) for k, d in enumerate(long)}
    subscripts = ["".join(letters[d] for d in long if x.shape[d] > 1) for x in (a, b)]
    np.einsum(f"{subscripts[0]},{subscripts[1]}->{''.join(letters.values())}",
              a.reshape([n for n in a.shape if n > 1]), b.reshape([n for n in b.shape if n > 1]),
              out=out.reshape([out.shape[d] for d in long]))


def fused(f, arrays: dict, shape: tuple[int, ...], out, within: tuple = ()) -> None:
    """:meth:`chainexec.runtime.device.Backend.fused` on the host, by blocks (see the module's
    docstring)."""
    within = tuple(g for g in within if len(g) > 1)
    prog = program(f)
    scratch = Scratch()
    total = 0.0
    for slices, weight in blocks(tuple(shape), within, prog.fixed, BLOCK_ELEMENTS):
        block = Block(arrays, dict(zip(f.domain, slices)), scratch)
        for name, own, value in prog.lets:
            block.let(name, own, value)
        if f.reduce:
            total += block.reduced(prog.value, f.domain, weight)
        else:
            value = block.sum(prog.value, f.domain)[0]
            out[slices] += value if weight is None else value * weight
        block.release()
    if f.reduce:
        out[...] += total
