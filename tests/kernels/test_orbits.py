"""Orbit kernels (:mod:`chainexec.kernels.orbits`), on any machine: the orbit table covers every
block tuple once, names the group's images of each orbit's first block and marks the first
element mapping to each; inputs are copied into shared memory as far as they fit; the generated
kernel, run on the CPU, a ``std::thread`` per CUDA thread, against a reference that reads each
permutation in the documented direction (the inverse direction fails it), with and without a
weight, in other groups, dtypes and dimensions; and the (T) energy's kernel compiles with nvcc
for sm_90 (skipped without nvcc)."""

from __future__ import annotations

import itertools
import re
import shutil
from collections import Counter

import numpy as np
import pytest

from chainexec.kernels import elementwise, orbits
from tests.kernels.emulation import compiles_with_nvcc, element_strides, emulated, stored


ENERGY_CODE = "p0 * (4.0 * q0 + q1 + 1.5 * q2 - 2.0 * q3 - 2.0 * q4 - 2.0 * q5) * p2"
"""The (T) energy's combination of its six reads, the two 3-cycles weighted apart (1 and 1.5): a
read taken in the inverse direction changes the sum."""


def permuted(z: np.ndarray, p: tuple[int, ...]) -> np.ndarray:
    """The array ``q`` with ``q[x] = z[x[p[0]], x[p[1]], …]``: a reused value read at ``p`` as
    :func:`orbits.orbits` documents it, written with einsum's own index names."""
    names = "abcdefgh"[:z.ndim]
    return np.einsum(f"{''.join(names[p[d]] for d in range(z.ndim))}->{names}", z)


PERMS6 = [(0, 1, 2) + tuple(3 + d for d in p) for p in [(0, 1, 2), (1, 2, 0), (2, 0, 1), (0, 2, 1), (1, 0, 2), (2, 1, 0)]]
PERMS3 = [(0, 1, 2, 3), (0, 2, 3, 1), (0, 3, 1, 2), (0, 1, 3, 2), (0, 2, 1, 3), (0, 3, 2, 1)]
"""The (T) energy's six reads of Z[x, a, b, c] (x untouched): the value at (x, a, b, c) read at
(x, a, b, c), (x, b, c, a), (x, c, a, b), (x, a, c, b), (x, b, a, c) and (x, c, b, a)."""


@pytest.mark.parametrize("blocks, perms, order", [(3, [(1, 2, 0)], 3), (4, [(1, 0, 2), (0, 2, 1)], 6),
                                                  (5, [(1, 0)], 2), (2, [(0, 1, 2), (2, 0, 1), (1, 0, 2)], 6)])
def test_orbits_cover_every_block_once(blocks, perms, order):
    """The orbit table lists every block tuple in exactly one orbit, each orbit the images of its
    first block B under the generated group (a 3-cycle makes 3 permutations, two transpositions
    6); for each group element g the slot it names holds g·B, and the mask marks the first g of
    the group's order that maps B to each block of the orbit."""
    group = orbits.group(tuple(perms))
    assert len(group) == order
    table, count, members = orbits.orbit_table(blocks, tuple(perms))
    s = len(perms[0])
    width = 2 + members * (s + 1)
    assert members == order and len(table) == count * width
    seen = []
    for row in (table[k * width:(k + 1) * width] for k in range(count)):
        n = row[0]
        tuples = [tuple(row[1 + t * s:1 + (t + 1) * s]) for t in range(n)]
        assert len(set(tuples)) == n
        images = [tuple(tuples[0][g[u]] for u in range(s)) for g in group]
        assert set(tuples) == set(images)
        slots, mask = row[1 + members * s:1 + members * s + members], row[-1]
        assert [tuples[slots[e]] for e in range(members)] == images
        assert [e for e in range(members) if mask >> e & 1] == [images.index(b) for b in tuples]
        seen += tuples
    assert sorted(seen) == sorted(itertools.product(range(blocks), repeat=s))


W4 = (64000, 1600, 40, 1)
"""Strides of a W over (x, a, b, c) of 40 each, stored in that order."""


def test_orbit_reads_must_permute_dimensions_of_one_extent():
    with pytest.raises(ValueError, match="unequal extents"):
        orbits.orbits((3, 8, 9), [(0, 2, 1)], "q0", [], ("float64",), 1)
    with pytest.raises(ValueError, match="not permutations"):
        orbits.orbits((3, 8, 8), [(0, 1, 1)], "q0", [], ("float64",), 1)
    plan = orbits.orbits((3, 40, 40, 40), PERMS3, "q0", [], ("float64",), 1)
    assert (plan.moved, plan.edge, plan.members, plan.count, plan.copied) == ((1, 2, 3), 8, 6, 35, ())
    assert plan.shared == 6 * 512 * 8  # six blocks of 8x8x8, swizzled
    assert orbits.orbits((3, 40, 40), [(0, 2, 1)], "q0", [], ("float64",), 2).edge == 16
    assert orbits.orbits((3, 40, 40, 40), PERMS3, "q0", [], ("float64",), 3).edge == 4  # three values' blocks fit


def _places(plan: orbits.Orbits) -> dict:
    """Each point of a block of values -> its element, by evaluating :meth:`Orbits.place`'s C
    expression in Python (the same operators, on coordinates below 2^31)."""
    s, edge = len(plan.moved), plan.edge
    return {x: eval(plan.place([str(v) for v in x])) for x in itertools.product(range(edge), repeat=s)}


def _passes(places: dict, walk) -> int:
    """Shared-memory passes of a warp's 64-bit accesses at the points ``walk`` (32 of them): per
    half-warp, the most of its distinct elements that share one of the 16 bank pairs."""
    total = 0
    for half in (walk[:16], walk[16:]):
        pairs = Counter(e % 16 for e in {places[x] for x in half})
        total += max(pairs.values())
    return total


@pytest.mark.parametrize("shape, edge", [((3, 40, 40, 40), 8), ((3, 40, 40), 16), ((3, 40, 40, 40), 4)])
def test_blocks_of_values_take_distinct_elements_and_one_pass_per_half_warp(shape, edge):
    """:meth:`Orbits.place` over a block: every point its own element below the block's size; and
    every warp's accesses of stage two (32 points of the block, the last dimension fastest, read at
    each permutation of the point; the identity is also stage one's writes) take one pass per
    half-warp, two a warp, where a warp walks one block: three dimensions at 8 (swizzled) and two
    at 16 (odd pitches, a half-warp along one dimension). At 8 the odd pitches of
    :func:`elementwise.box_pitches` take four a warp at every permutation: why blocks of 8 are
    swizzled. Blocks of 4 (three values beside each other) keep odd pitches; their points take
    distinct elements."""
    moved = len(shape) - 1
    perms = PERMS3 if moved == 3 else [(0, 2, 1)]
    plan = orbits.orbits(shape, perms, "q0", [], ("float64",), 1 if edge != 4 else 3)
    assert plan.edge == edge
    places = _places(plan)
    assert len(set(places.values())) == edge ** moved and max(places.values()) < plan.slot()
    warps = [[tuple(int(i) for i in np.unravel_index(e, (edge,) * moved)) for e in range(w, w + 32)]
             for w in range(0, edge ** moved, 32)]

    def passes(layout: dict, g: tuple) -> list[int]:
        return [_passes(layout, [tuple(x[g[u]] for u in range(moved)) for x in warp]) for warp in warps]

    if edge >= 8:
        for g in orbits.group(plan.perms):
            assert passes(places, g) == [2] * len(warps)
    if moved == 3 and edge == 8:
        pitch = elementwise.box_pitches(list(range(3)), [8] * 3)[0]
        pitched = {x: sum(x[d] * pitch[d] for d in range(3)) for x in places}
        assert all(passes(pitched, g) == [4] * len(warps) for g in orbits.group(plan.perms))


def test_inputs_read_across_two_permuted_dimensions_are_staged_as_far_as_they_fit():
    """W (all three permuted dimensions) and a matrix over two are copied into shared memory, W
    first; a vector along one, an input over none and one the code does not read are not. The
    (T) energy's Z and W take 49,152 bytes at blocks of 8; a float64 matrix beside them would not
    fit, so it is left out rather than the blocks cut; beside float32 values a float32 one fits."""
    strides = [(0, 20, 1, 0), W4, (0, 0, 0, 1), (1, 0, 0, 0), (0, 20, 1, 0)]
    code = "p0 * p1 + p2 * p3 + q0"
    assert orbits.staged(code, strides, (1, 2, 3)) == (1, 0)
    energy = orbits.orbits((3, 40, 40, 40), PERMS3, "p1 * q0", strides, ("float64",) * 6, 1)
    assert (energy.edge, energy.copied, energy.shared) == (8, (1,), 2 * 6 * 512 * 8)
    both = orbits.orbits((3, 40, 40, 40), PERMS3, code, strides, ("float64",) * 6, 1)
    assert (both.edge, both.copied, both.shared) == (8, (1,), energy.shared)
    small = orbits.orbits((3, 40, 40, 40), PERMS3, code, strides, ("float32",) + ("float64",) * 4 + ("float32",), 1)
    assert (small.edge, small.copied, small.shared) == (8, (1, 0), 6 * 512 * (4 + 8 + 4))


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("wide", [False, True], ids=["32-bit", "64-bit"])
@pytest.mark.parametrize("case", ["energy", "weighted", "weighted along a", "two values", "float32"])
def test_orbit_reduction_equals_numpy(case, wide, tmp_path, monkeypatch):
    """The orbit kernel, run on the CPU, against NumPy. ``energy``: the (T) energy's shape, a
    reused value Z = W + 0.5·s[c, a]·e[b] (a small input read across c, a broadcast one) read at
    the six permutations of (a, b, c) over blocks of 8 overhanging the extent 19, with x = 2 one
    orbit grid per point. ``weighted``: the same at x = 3 times a weight over x of 2, 0 and 1
    that skips the blocks where it is zero (``skip``, :mod:`chainexec.planner.ordered`), W being
    NaN there: a block that computed anything would make the sum NaN. ``weighted along a``: a
    weight over a, a permuted dimension, zero for some a: no block is skipped (a block holds
    points of several weights), the weight only multiplied by. ``two values``: two reused
    values over (a, b) blocks of 16 overhanging 20, one read transposed; ``float32``: the same in
    single precision (values kept as float)."""
    if wide:
        monkeypatch.setattr(elementwise, "INDEX32", 1)
    rng = np.random.default_rng(7)
    dtype = np.float32 if case == "float32" else np.float64
    skip = None
    if case in ("energy", "weighted", "weighted along a"):
        x, n = (2, 19) if case == "energy" else (3, 19)
        shape = (x, n, n, n)
        w_big, w_off, w = stored(rng, shape, [0, 1, 2, 3])
        s_big, s_off, s_ = stored(rng, (n, n), [0, 1])
        e_big, e_off, e = stored(rng, (n,), [0])
        views_ = [w, s_.T[None, :, None, :], e[None, None, :, None]]
        buffers, offsets = [w_big, s_big, e_big], [w_off, s_off, e_off]
        lets = ["p0 + 0.5 * p1 * p2"]
        code = ENERGY_CODE
        reads = [(0, p) for p in PERMS3]
        z = w + 0.5 * views_[1] * views_[2]
        q = [permuted(z, p) for p in PERMS3]
        terms = w * (4 * q[0] + q[1] + 1.5 * q[2] - 2 * q[3] - 2 * q[4] - 2 * q[5]) * views_[2]
        ref = np.sum(terms)
        if case == "weighted":
            weight = np.array([2.0, 0.0, 1.0])
            ref = np.sum(terms * weight[:, None, None, None], where=weight[:, None, None, None] != 0)
            w[1] = np.nan
            views_.append(weight[:, None, None, None])
            buffers.append(weight)
            offsets.append(0)
            code, skip = f"({code}) * p3", 3
        if case == "weighted along a":
            weight = rng.integers(0, 3, n).astype(np.float64)
            weight[2] = 0.0
            ref = np.sum(terms * weight[None, :, None, None])
            views_.append(weight[None, :, None, None])
            buffers.append(weight)
            offsets.append(0)
            code, skip = f"({code}) * p3", 3
    else:
        shape = (3, 20, 20)
        a_big, a_off, a = stored(rng, shape, [2, 0, 1], dtype)
        b_big, b_off, b = stored(rng, (20,), [0], dtype)
        views_ = [a, b[None, None, :]]
        buffers, offsets = [a_big, b_big], [a_off, b_off]
        lets = ["p0 * p1", "p0 + p1"]
        code = "q0 * q1 + p1"
        reads = [(0, (0, 1, 2)), (1, (0, 2, 1))]
        first, second = a * views_[1], a + views_[1]
        ref = np.sum(first.astype(np.float64) * second.transpose(0, 2, 1) + views_[1] * np.ones(shape))
    strides = [element_strides(v) for v in views_]
    types = tuple(np.dtype(v.dtype).name for v in views_) + (np.dtype(dtype).name,)
    plan = orbits.orbits(shape, [p for _, p in reads], code, strides, types, len(lets))
    assert plan.copied == ((0,) if case in ("energy", "weighted", "weighted along a") else ())
    assert plan.edge == (16 if case in ("two values", "float32") else 8)
    text = orbits.orbit_source(tuple(lets), code, tuple(j for j, _ in reads), shape, strides, types, plan, skip)
    assert ("long long" if wide else "const int c") in text
    assert ("== 0) {" in text) == (case == "weighted")  # along a permuted dimension nothing is skipped
    table = np.array(orbits.orbit_table(-(-shape[plan.moved[0]] // plan.edge), plan.perms)[0], np.int32)
    grid = plan.count * int(np.prod([n for d, n in enumerate(shape) if d not in plan.moved]))
    partial = np.full(grid, np.nan)
    got = emulated(tmp_path, text, "chainexec_orbits", [partial] + buffers + [table], [0] + offsets + [0], grid,
                   shared=plan.shared)
    tolerance = 1e-5 if case == "float32" else 1e-13
    assert abs(got.sum() - ref) <= tolerance * np.sum(np.abs(ref) + 1)


C3 = PERMS3[:3]
"""Reads of a value over (x, a, b, c) at the 3-cycles of (a, b, c) alone."""

OTHER_CASES = {
    # name: (shape, inputs as (dimensions, storage order, dtype), values, code, reads, values' dtype)
    "energy float32": ((2, 11, 11, 11), [((0, 1, 2, 3), [3, 1, 0, 2], "float32"), ((1, 3), [1, 0], "float32"),
                                         ((2,), [0], "float32")],
                       ["p0 + 0.5 * p1 * p2"], ENERGY_CODE, [(0, p) for p in PERMS3], "float32"),
    "W float32, values float64": ((2, 11, 11, 11), [((0, 1, 2, 3), [0, 1, 2, 3], "float32"),
                                                    ((1, 3), [1, 0], "float64"), ((2,), [0], "float64")],
                                  ["p0 + 0.5 * p1 * p2"], ENERGY_CODE, [(0, p) for p in PERMS3], "float64"),
    "3-cycles": ((2, 10, 10, 10), [((0, 1, 2, 3), [0, 1, 2, 3], "float64"), ((2,), [0], "float64")],
                 ["p0 * p0 + p1"], "p0 * (q0 + 2.0 * q1 - 3.0 * q2) * p1", [(0, p) for p in C3], "float64"),
    "two dimensions apart, a matrix copied": ((9, 3, 9), [((0, 2), [1, 0], "float64"), ((0, 1, 2), [2, 0, 1], "float64")],
                                              ["p1 * 2.0"], "p0 * (q0 - 3.0 * q1)", [(0, (0, 1, 2)), (0, (2, 1, 0))],
                                              "float64"),
}
"""Orbit reductions beyond the (T) energy: its shape in single precision (W copied as float), W
in another dtype than the values, a group of three elements (the 3-cycles: orbits of three
blocks and of one), two permuted dimensions with another between them and a matrix over them
copied into shared memory."""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("case", list(OTHER_CASES))
def test_other_orbit_reductions_equal_numpy(case, tmp_path):
    """Each of :data:`OTHER_CASES`, emulated on the CPU with its exact dynamic shared memory
    (NaN where no thread wrote, a write past its end failing the run), against NumPy."""
    shape, inputs, lets, code, reads, dtype = OTHER_CASES[case]
    rng = np.random.default_rng(13)
    views_, buffers, offsets = [], [], []
    for dims, order, kind in inputs:
        big, off, view = stored(rng, tuple(shape[d] for d in dims), order, np.dtype(kind))
        views_.append(view[tuple(slice(None) if d in dims else None for d in range(len(shape)))])
        buffers.append(big)
        offsets.append(off)
    strides = [element_strides(v) for v in views_]
    types = tuple(v.dtype.name for v in views_) + (dtype,)
    plan = orbits.orbits(shape, [p for _, p in reads], code, strides, types, len(lets))
    assert plan.copied == (0,)
    text = orbits.orbit_source(tuple(lets), code, tuple(j for j, _ in reads), shape, strides, types, plan)
    table = np.array(orbits.orbit_table(-(-shape[plan.moved[0]] // plan.edge), plan.perms)[0], np.int32)
    grid = plan.count * int(np.prod([n for d, n in enumerate(shape) if d not in plan.moved]))
    got = emulated(tmp_path, text, "chainexec_orbits", [np.full(grid, np.nan)] + buffers + [table],
                   [0] + offsets + [0], grid, shared=plan.shared).sum()
    inputs_ = {f"p{k}": np.broadcast_to(v, shape).astype(np.float64) for k, v in enumerate(views_)}
    values = [eval(text_, {}, inputs_).astype(dtype) for text_ in lets]
    reads_ = {f"q{r}": permuted(values[j], p).astype(np.float64) for r, (j, p) in enumerate(reads)}
    terms = eval(code, {}, inputs_ | reads_)
    tolerance = 1e-5 if "float32" in types else 1e-13
    assert abs(got - np.sum(terms)) <= tolerance * np.sum(np.abs(terms))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_energy_source_compiles_with_nvcc(tmp_path):
    """The (T) energy with Z reused, at o=40 v=400 (one occupied point per tile)."""
    shape = (1, 1, 1, 400, 400, 400)
    code = "p0 * (4.0 * q0 + q1 + q2 - 2.0 * q3 - 2.0 * q4 - 2.0 * q5) * p1"
    strides = [(0, 0, 0, 160000, 400, 1), (0, 0, 0, 400, 1, 0)]
    orbit = orbits.orbits(shape, PERMS6, code, strides, ("float64",) * 3, 1)
    assert (orbit.count, orbit.copied) == (22100, (0,))
    compiles_with_nvcc(tmp_path, [orbits.orbit_source(("p0 + 0.5 * p1",), code, (0,) * 6, shape, strides,
                                                      ("float64",) * 3, orbit)])


def _counted_bytes(source: str, plan: orbits.Orbits, extent: int) -> float:
    """Bytes per point the generated float64 kernel ``source`` loads and stores, its loads and
    stores read off its text and each counted as often as its loop runs it, orbit by orbit
    (:func:`orbits.orbit_table`): stage one's loads before its run loop once per run of
    :data:`orbits.RUN` points (the last run of a block past the extent too), those inside and its
    stores once per point within the extent; stage two's loads before the orbit loop once per
    thread, those before the group elements' blocks once per point ``x`` of the orbit's first
    block, and each element's block's once where its bit is set."""
    load, store = r"= [PLS]\d+\[", r"^\s*[LS]\d+\[.*\] = "
    one, two = source.split("__syncthreads();", 1)
    one = one[one.index("for (unsigned task"):]
    outer, inner = one.split("for (int", 1)
    outer, inner = len(re.findall(load, outer)), len(re.findall(load, inner)) + len(re.findall(store, inner, re.M))
    fixed = len(re.findall(load, two[:two.index("const int firsts")]))
    per_x = len(re.findall(load, two[two.index("for (unsigned e"):two.index("if (firsts")]))
    marks = [m.start() for m in re.finditer(r"if \(firsts & ", two)] + [len(two)]
    element = [len(re.findall(load, two[a:b])) for a, b in zip(marks, marks[1:])]
    s, edge, chunk = len(plan.moved), plan.edge, min(plan.edge, orbits.RUN)
    table, count, _ = orbits.orbit_table(-(-extent // edge), plan.perms)
    width, total = plan.width(), 0
    for row in (table[k * width:(k + 1) * width] for k in range(count)):
        blocks = [row[1 + b * s:1 + (b + 1) * s] for b in range(row[0])]
        total += elementwise.BLOCK * fixed
        for block in blocks:
            for rest in itertools.product(range(edge), repeat=s - 1):
                if all(block[u + 1] * edge + rest[u] < extent for u in range(s - 1)):
                    total += -(-edge // chunk) * outer + min(edge, extent - block[0] * edge) * inner
        for x in itertools.product(range(edge), repeat=s):
            if all(blocks[0][u] * edge + x[u] < extent for u in range(s)):
                total += per_x + sum(n for h, n in enumerate(element) if row[-1] >> h & 1)
    return 8 * total / extent ** s


@pytest.mark.parametrize("extent, extra", [(40, ""), (41, ""), (19, ""), (12, ""), (19, " * M[b,c]")])
def test_point_bytes_are_the_loads_and_stores_the_kernel_makes(extent, extra):
    """:func:`orbits.fused_point_bytes` of the calibration's (T)-shaped reduction
    (:data:`chainexec.calibrate_worker.ORBIT_SUM`) equals the loads and stores its generated
    kernel makes per point, counted in the source and weighted by its loops' trip counts: at
    extents that blocks of 8 divide and that they overhang, where diagonal orbits of fewer blocks
    load a point orbit's values for fewer points, and with a matrix over b, c that does not fit
    in shared memory beside Z and W (one more load per point, from device memory). Towards large
    extents the count tends to 112 bytes (115.3 at 400): 8.5 loads of Z's inputs, Z and W
    stored, Z and W read once per point in shared memory, the three orbital energies along a, b,
    c once per coordinate (half a load a point)."""
    from chainexec import calibrate_worker as cw
    from chainexec.planner.plan import Fused

    f = Fused("E", (), cw.ORBIT_DOMAIN, cw.ORBIT_SUM + extra, True, (("Z", cw.ORBIT_DOMAIN, cw.ORBIT_LET),))
    extents = {i: 2 if i in "ijk" else extent for i in f.domain}
    shape = tuple(extents[i] for i in f.domain)
    refs = f.leaves
    codes, code, perms = orbits.orbit_codes(f, refs)
    strides = [tuple(int(np.prod([extents[j] for j in r.indices[r.indices.index(i) + 1:]])) if i in r.indices else 0
                     for i in f.domain) for r in refs]
    types = ("float64",) * (len(refs) + 1)
    plan = orbits.orbits(shape, [p for _, p in perms], code, strides, types, 1)
    assert plan.edge == 8 and [refs[k].tensor for k in plan.copied] == ["W"] and plan.members == 6
    source = orbits.orbit_source(codes, code, tuple(j for j, _ in perms), shape, strides, types, plan)
    got = orbits.fused_point_bytes(f, extents, dict.fromkeys([r.tensor for r in refs] + ["E"], "float64"))
    assert got == pytest.approx(_counted_bytes(source, plan, extent), rel=1e-12)
    assert got > 112 + 8 * bool(extra)
    if extent == 40:  # at the (T) job's v = 400: diagonal orbits and the once-per-thread loads add 3 %
        large = orbits.fused_point_bytes(f, extents | dict.fromkeys("abc", 400), dict.fromkeys([r.tensor for r in refs] + ["E"], "float64"))
        assert 112 < large < got and large == pytest.approx(115.3376, rel=1e-12)
