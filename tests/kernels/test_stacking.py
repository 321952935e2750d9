"""Which terms of a run stack into one contraction (chainexec.kernels.stacking), and the
backend's stacked operands (CupyBackend._stacked run on NumPy) against numpy.einsum."""

import contextlib

import numpy as np
import pytest

from chainexec.kernels import stacking
from chainexec.planner.plan import Contraction
from chainexec.runtime.backends.common import span
from tests.kernels.test_sumkernel import W_TERMS
from tests.runtime.hosttiles import HostTiles


def _extents(terms, sizes):
    return [{i: sizes[i] for i in "ijkabc" + a + b} for a, b, _ in terms]


def _groups(out, terms, sizes, share=stacking.STACK_SHARE):
    return stacking.groups(tuple(out), [(tuple(a), tuple(b)) for a, b, _ in terms], _extents(terms, sizes), share)


def test_triples_tile_of_one_stacks_the_sums_over_m_in_pairs():
    """At #6's size (o=40, v=400) with occupied tiles of one: the six sums over m pair up by
    the virtual index their ovoo operand holds; the sums over f hold operands as large as W."""
    got = _groups("ijkabc", W_TERMS, dict(i=1, j=1, k=1, a=400, b=400, c=400, f=400, m=40))
    assert got == [stacking.Stack((6, 7), tuple("ijka"), tuple("bc"), (True, True)),
                   stacking.Stack((8, 9), tuple("ijkac"), ("b",), (False, False)),
                   stacking.Stack((10, 11), tuple("ijkab"), ("c",), (False, False))]


def test_occupied_tiles_of_two_stack_each_sum_over_f_with_the_sum_over_m_of_its_split():
    """At o=40, v=400 with occupied tiles of two, an ovvv·t2 term's operands hold a quarter of W:
    its copy moves less than the pass over W that the ovoo·t2 term of the same split saves."""
    got = _groups("ijkabc", W_TERMS, dict(i=2, j=2, k=2, a=400, b=400, c=400, f=400, m=40))
    assert [(s.terms, "".join(s.left), "".join(s.right)) for s in got] == [
        ((0, 11), "iab", "jkc"), ((1, 9), "iac", "jkb"), ((2, 10), "ikc", "jab"),
        ((3, 7), "ika", "jbc"), ((4, 8), "ijb", "kac"), ((5, 6), "ija", "kbc")]


@pytest.mark.parametrize("terms,sizes,expect", [
    ([("ak", "kb", 1.0), ("bl", "la", 1.0)], dict(a=50, b=60, k=3, l=2), [(0, 1)]),  # b's side swapped
    ([("ak", "kb", 1.0), ("akb", "kb", 1.0)], dict(a=50, b=60, k=3), []),            # b: a batch index
    ([("ak", "kb", 1.0), ("akl", "kb", 1.0)], dict(a=50, b=60, k=3, l=2), []),       # l summed on one side
    ([("ak", "kb", 1.0), ("al", "lb", 1.0)], dict(a=50, b=60, k=3, l=40), []),       # l: operands too large
    ([("ak", "kb", 1.0), ("al", "lb", 1.0), ("am", "mb", 1.0)], dict(a=50, b=60, k=3, l=40, m=2), [(0, 2)]),
])
def test_stacking_rules(terms, sizes, expect):
    ext = [{i: sizes[i] for i in "ab" + a + b} for a, b, _ in terms]
    got = stacking.groups(("a", "b"), [(tuple(a), tuple(b)) for a, b, _ in terms], ext)
    assert [s.terms for s in got] == expect


class _NumpyStacker(HostTiles):
    """The backend's stacking on NumPy arrays, each stacked contraction by numpy.einsum (an
    independent reference for the copies' orders, offsets and factors)."""

    def __init__(self):
        self.xp, self.workspace, self._kept, self.seen = np, None, None, []
        self._held, self._steady, self._hold_room = {}, None, None

    def contract(self, c, out, a, b, fresh=False):
        """As the backend's, with ``fresh`` as cuBLAS's β = 0: ``out`` overwritten, not added to."""
        self.seen.append((c.a_indices, c.b_indices, a.shape, b.shape))
        names = {i: chr(ord("a") + n) for n, i in enumerate(dict.fromkeys(c.out_indices + c.a_indices + c.b_indices))}
        spec = ",".join("".join(names[i] for i in x) for x in (c.a_indices, c.b_indices))
        product = c.factor * np.einsum(f"{spec}->{''.join(names[i] for i in c.out_indices)}", a, b)
        if fresh:
            out[...] = product
        else:
            out += product


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("occupied", [(1, 1, 1), (2, 1, 1)])
def test_stacked_terms_equal_einsum(occupied, fresh):
    """The W tile's twelve terms, those that stack as stacks (the rest added one by one here), on
    permuted views of larger arrays, against numpy.einsum term by term; ``fresh``: into a tile
    of NaN that the first stack overwrites and the others add to."""
    sizes = dict(zip("ijk", occupied)) | dict(a=40, b=33, c=45, f=41, m=4)
    rng = np.random.default_rng(11)
    ops = []
    for a, b, _ in W_TERMS:
        x, y = (rng.standard_normal([sizes[i] + 1 for i in idx]) for idx in (a, b))
        ops.append((x[tuple(slice(1, None) for _ in a)], y[tuple(slice(0, -1) for _ in b)]))
    cs = _w_contractions()
    W0 = rng.standard_normal([sizes[i] for i in "ijkabc"])
    ref = W0 + sum(f * np.einsum(f"{a},{b}->ijkabc", x, y) for (a, b, f), (x, y) in zip(W_TERMS, ops))
    be = _NumpyStacker()
    stacks = be._stacks(cs, W0, ops)
    assert [s.terms for s in stacks] == ([(0, 2, 10, 11), (6, 7), (8, 9)] if occupied == (1, 1, 1)
                                         else [(2, 10), (3, 5, 6, 7), (4, 8)])
    W = np.full_like(W0, np.nan) if fresh else W0.copy()
    if fresh:
        ref -= W0
    be._stacked(stacks, cs, W, ops, fresh)
    for k in range(12):
        if not any(k in s.terms for s in stacks):
            be.contract(cs[k], W, *ops[k])
    assert np.linalg.norm(W - ref) / np.linalg.norm(ref) <= 1e-13
    depths = [sum(sizes["f" if k < 6 else "m"] for k in st.terms) for st in stacks]
    assert [(a[0], b[0]) for *_, a, b in be.seen[:len(stacks)]] == [(d, d) for d in depths]  # one GEMM per stack


def test_a_copy_the_next_stack_makes_again_is_kept_for_it():
    """The W tile (occupied tiles of two at o=6, v=10) on views of whole ``ovvv``, ``ovoo`` and
    ``t2`` arrays, as the executor passes them: the six stacks' twelve copies are ten, since
    ``ovvv[i,a,f,b] ⊕ -t2[m,i,b,a]`` is also the next stack's ``ovvv[i,a,f,c] ⊕ -t2[m,i,c,a]``
    (and likewise for ``ovvv[k]``; ``ovvv[j]`` is read transposed by the next stack); W equals
    numpy.einsum term by term."""
    o, v = 6, 10
    rng = np.random.default_rng(5)
    whole = {"ovvv": rng.standard_normal((o, v, v, v)), "ovoo": rng.standard_normal((o, v, o, o)),
             "t2": rng.standard_normal((o, o, v, v))}
    tile = {"i": slice(0, 2), "j": slice(2, 4), "k": slice(4, 6)}
    names = {"ovvv": "ovvv", "ovoo": "ovoo", "oovv": "t2"}

    def operand(idx):
        kind = "".join("o" if i in "ijkm" else "v" for i in idx)
        return whole[names[kind]][tuple(tile.get(i, slice(None)) for i in idx)]

    ops = [(operand(a), operand(b)) for a, b, _ in W_TERMS]
    cs = _w_contractions()
    ref = sum(f * np.einsum(f"{a},{b}->ijkabc", x, y) for (a, b, f), (x, y) in zip(W_TERMS, ops))

    class Counting(_NumpyStacker):
        def __init__(self):
            super().__init__()
            self.copies = []

        def contract(self, c, out, a, b, fresh=False):
            self.copies += [x for x in (a, b) if not any(x is y for y in self.copies)]
            super().contract(c, out, a, b, fresh)

    be = Counting()
    stacks = be._stacks(cs, np.empty((2, 2, 2, v, v, v)), ops)
    assert len(stacks) == 6 and sorted(n for s in stacks for n in s.terms) == list(range(12))
    W = np.full((2, 2, 2, v, v, v), np.nan)
    be._stacked(stacks, cs, W, ops, fresh=True)
    assert len(be.copies) == 10
    assert np.linalg.norm(W - ref) / np.linalg.norm(ref) <= 1e-13


def _whole_triples(o: int, v: int, rng):
    """Whole ``ovvv``, ``ovoo`` and ``t2`` arrays and, for an occupied tile (slices of i, j, k),
    the W terms' operands as views of them, as the executor passes them."""
    whole = {"ovvv": rng.standard_normal((o, v, v, v)), "ovoo": rng.standard_normal((o, v, o, o)),
             "oovv": rng.standard_normal((o, o, v, v))}

    def operands(tile):
        def operand(idx):
            kind = "".join("o" if i in "ijkm" else "v" for i in idx)
            return whole[kind][tuple(tile.get(i, slice(None)) for i in idx)]
        return [(operand(a), operand(b)) for a, b, _ in W_TERMS]
    return whole, operands


class _Counting(_NumpyStacker):
    """The NumPy stacker counting the stack sides it makes."""

    made = 0

    def _stack_copy(self, parts, shape, dtype):
        self.made += 1
        return super()._stack_copy(parts, shape, dtype)


def _made_for_tile(be: _Counting, stacks, cs, ops, v: int) -> int:
    """Run a W tile's stacks (occupied tiles of two) on ``ops`` into a tile of NaN, check it
    against numpy.einsum term by term, and return how many stack sides it made."""
    ref = sum(f * np.einsum(f"{x},{y}->ijkabc", p, q) for (x, y, f), (p, q) in zip(W_TERMS, ops))
    W = np.full((2, 2, 2, v, v, v), np.nan)
    before = be.made
    be._stacked(stacks, cs, W, ops, fresh=True)
    assert np.linalg.norm(W - ref) / np.linalg.norm(ref) <= 1e-13
    return be.made - before


def _w_contractions() -> list[Contraction]:
    """W's twelve terms as the contractions of one run into ``W[i,j,k,a,b,c]``."""
    return [Contraction(k, "W", list("ijkabc"), f"A{k}", list(a), f"B{k}", list(b), f, True, 0, k)
            for k, (a, b, f) in enumerate(W_TERMS)]


ROOMS = ["unlimited", "one copy", "one copy, nested", "shared with a relayout copy", "part steady", "none"]
"""How :func:`test_stack_copies_of_steady_arrays_are_held_for_the_next_tile` runs its tiles:
inside ``steady`` over the whole inputs with no room set; with room for one copy, also inside
an outer ``steady`` over nothing; with room for two copies of which a held relayout copy takes
one and a byte; inside ``steady`` over ``ovvv`` and ``ovoo`` only (every side holds a ``t2``
part); outside ``steady``."""


@pytest.mark.parametrize("room", ROOMS)
def test_stack_copies_of_steady_arrays_are_held_for_the_next_tile(room):
    """Three W tiles at o=8, v=10, the first two sharing i and j, the third the first again
    (:data:`ROOMS`): where the room :meth:`steady` sets aside holds every copy, the second makes
    only the stack sides the first did not (those over its new k slice) and the third none;
    with room for one copy one is held and the others made again, nested or not; held relayout
    and stack copies together stay within the room, and the relayout copy stays held; a side
    with a part outside the steady arrays is never held; outside ``steady`` every side is made
    again. Each tile equals numpy.einsum term by term; every held side is one a tile so far
    read, and leaving ``steady`` drops them all."""
    o, v = 8, 10
    whole, operands = _whole_triples(o, v, np.random.default_rng(9))
    tiles = [{"i": slice(0, 2), "j": slice(2, 4), "k": slice(4, 6)}, {"i": slice(0, 2), "j": slice(2, 4), "k": slice(6, 8)}]
    tiles.append(tiles[0])
    cs = _w_contractions()

    be, alone = _Counting(), _Counting()
    stacks = be._stacks(cs, np.empty((2, 2, 2, v, v, v)), operands(tiles[0]))
    biggest = int(max(np.prod(shape) * 8 for tile in tiles for side in [be._stack_sides(st, cs, operands(tile),
                      dict(zip("ijkabc", (2, 2, 2, v, v, v)))) for st in stacks] for _, _, shape in side))
    if room.startswith("one copy"):
        be.workspace = 4 * biggest  # steady sets a quarter aside: one copy of the largest side
    if room.startswith("shared"):
        be.workspace = 8 * biggest
    steady = {"none": [], "part steady": [whole["ovvv"], whole["ovoo"]]}.get(room, list(whole.values()))
    keys = []
    with contextlib.ExitStack() as scopes:
        if room.endswith("nested"):
            scopes.enter_context(be.steady([]))
        scopes.enter_context(be.steady(steady))
        if room.startswith("shared"):
            be._held[0] = (("relayout",), np.empty(biggest // 8 + 1), (span(whole["oovv"]),))
        for n, tile in enumerate(tiles):
            ops = operands(tile)
            made, alone_made = (_made_for_tile(x, stacks, cs, ops, v) for x in (be, alone))
            extent = dict(zip("ijkabc", (2, 2, 2, v, v, v)))
            sides = {key for st in stacks for key, _, _ in be._stack_sides(st, cs, ops, extent)}
            held = {slot[2] for slot in be._held if isinstance(slot, tuple)}
            keys.append(sides)
            assert held <= set().union(*keys)
            if be._hold_room is not None:
                assert sum(x.nbytes for _, x, _ in be._held.values()) <= be._hold_room
            if room.startswith("one copy"):
                assert be._hold_room == biggest and len(held) == 1
            if room.startswith("shared"):
                assert 0 in be._held and held
            if n == 0 or room in ("none", "part steady"):
                assert made == alone_made == 10
                assert held or room in ("none", "part steady")
            elif room == "unlimited":
                assert made == (0 if n == 2 else len(keys[1] - keys[0])) < alone_made
            elif room.startswith("one copy"):
                assert made == alone_made - len(kept & sides) == 9
            kept = held
    assert not be._held


def test_held_sides_give_way_to_the_newest_where_the_room_holds_one():
    """With room for one held copy (the largest side), a tile whose sides share nothing with the
    held one drops it for the first of its own, which the next run of that tile reads: three W
    tiles at o=8, v=10, the second's occupied slices apart from the first's, the third the
    second again, make every side, every side, and all but one. Each tile equals numpy.einsum
    term by term."""
    o, v = 8, 10
    whole, operands = _whole_triples(o, v, np.random.default_rng(11))
    first = {"i": slice(0, 2), "j": slice(2, 4), "k": slice(4, 6)}
    apart = {"i": slice(6, 8), "j": slice(6, 8), "k": slice(6, 8)}
    cs = _w_contractions()

    be, alone = _Counting(), _Counting()
    extent = dict(zip("ijkabc", (2, 2, 2, v, v, v)))
    stacks = be._stacks(cs, np.empty((2, 2, 2, v, v, v)), operands(first))
    be.workspace = 4 * int(max(np.prod(shape) * 8 for tile in (first, apart) for st in stacks
                               for _, _, shape in be._stack_sides(st, cs, operands(tile), extent)))
    made = []
    with be.steady(list(whole.values())):
        for tile in (first, apart, apart):
            made.append(tuple(_made_for_tile(x, stacks, cs, operands(tile), v) for x in (be, alone)))
            assert len([s for s in be._held if isinstance(s, tuple)]) == 1
    assert made[0][0] == made[0][1] and made[1][0] == made[1][1] and made[2][0] == made[2][1] - 1


def test_held_sides_least_recently_read_give_way_first():
    """Three W tiles at o=18, v=10 whose occupied slices share nothing, A, B and C, run as A, B,
    A, C, A with room for the sides of two tiles: A's second run reads all its sides held; C
    drops B's, read less recently than A's, so A's third run again makes none (a room that
    drops the first held, or every spare side, makes A's sides again). Each tile equals
    numpy.einsum term by term."""
    o, v = 18, 10
    whole, operands = _whole_triples(o, v, np.random.default_rng(12))
    a, b, c = ({d: slice(6 * n + 2 * m, 6 * n + 2 * m + 2) for m, d in enumerate("ijk")} for n in range(3))
    cs = _w_contractions()
    be = _Counting()
    extent = dict(zip("ijkabc", (2, 2, 2, v, v, v)))
    stacks = be._stacks(cs, np.empty((2, 2, 2, v, v, v)), operands(a))
    sides = {key: np.prod(shape) * 8 for st in stacks for key, _, shape in be._stack_sides(st, cs, operands(a), extent)}
    be.workspace = 4 * 2 * int(sum(sides.values()))
    with be.steady(list(whole.values())):
        made = [_made_for_tile(be, stacks, cs, operands(tile), v) for tile in (a, b, a, c, a)]
    assert made == [len(sides), len(sides), 0, len(sides), 0]


def test_room_for_a_held_copy_drops_stack_sides_only_where_that_makes_room():
    """:meth:`Methods._room_for` with room for 100 bytes beside a held stack side and a held
    relayout copy of 40 each: 61 bytes do not fit even without the stack side, which stays; 60
    do once it is dropped; a side the run reads is never dropped; the relayout copy a new one
    replaces is not counted."""
    be = _Counting()
    be._hold_room = 100
    side, relaid = ("stack", (0,), "key"), 0
    be._held = {side: ("key", np.empty(5), ()), relaid: ("r", np.empty(5), ())}
    assert not be._room_for(61, set()) and side in be._held
    assert not be._room_for(60, {side}) and side in be._held
    assert be._room_for(60, set()) and list(be._held) == [relaid]
    assert be._room_for(100, set(), relaid) and not be._room_for(100, set())


def test_two_runs_of_stacks_in_a_tile_keep_their_own_held_sides():
    """Two runs of W's terms in each tile (their own contractions, into their own outputs, over
    inputs of their own), inside ``steady`` over all the inputs: each run's second tile makes
    only its sides over the new k slice, though the other run ran in between; each output
    equals numpy.einsum term by term."""
    o, v = 8, 10
    tiles = [{"i": slice(0, 2), "j": slice(2, 4), "k": slice(4, 6)}, {"i": slice(0, 2), "j": slice(2, 4), "k": slice(6, 8)}]
    runs = []
    for n, seed in enumerate((9, 10)):
        whole, operands = _whole_triples(o, v, np.random.default_rng(seed))
        cs = [Contraction(100 * n + k, f"W{n}", list("ijkabc"), f"A{k}", list(a), f"B{k}", list(b), f, True, 0, k)
              for k, (a, b, f) in enumerate(W_TERMS)]
        runs.append((whole, operands, cs))

    be = _Counting()
    stacks = be._stacks(runs[0][2], np.empty((2, 2, 2, v, v, v)), runs[0][1](tiles[0]))
    extent = dict(zip("ijkabc", (2, 2, 2, v, v, v)))
    with be.steady([x for whole, _, _ in runs for x in whole.values()]):
        made = [_made_for_tile(be, stacks, cs, operands(tile), v) for tile in tiles for _, operands, cs in runs]
    keys = [[{key for st in stacks for key, _, _ in be._stack_sides(st, cs, operands(tile), extent)}
             for _, operands, cs in runs] for tile in tiles]
    assert made == [10, 10, len(keys[1][0] - keys[0][0]), len(keys[1][1] - keys[0][1])]
    assert made[2] < 10 and made[3] < 10
