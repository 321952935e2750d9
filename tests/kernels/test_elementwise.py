"""Element-wise and reduction kernels (:mod:`chainexec.kernels.elementwise`), on any machine: the
reduced iteration space of :func:`~chainexec.kernels.elementwise.layout` visits exactly the
(output, input) element pairs of the original views (NumPy strides of permuted, cut and broadcast
views are the reference), the generated source compiles with nvcc for sm_90 (skipped without
nvcc) — the reduction kernels and the staged ones too — and code outside numbers, names and
operators never reaches it. The staged kernels (inputs read across the output's fastest index go
through shared memory) are run on the CPU, one ``std::thread`` per CUDA thread, against NumPy.
The kernels' numbers are checked on a GPU in tests/runtime/test_pointwise_gpu.py."""

from __future__ import annotations

import itertools
import shutil

import numpy as np
import pytest

from chainexec.kernels import elementwise
from tests.kernels.emulation import (CASES, compiles_with_nvcc, element_strides, emulated, offset_of, padded, stored,
                                     views)


def pairs(shape, strides) -> set[tuple[int, ...]]:
    """Every element's (output offset, input offsets…) over ``shape`` with per-array ``strides``."""
    return {tuple(sum(c * s for c, s in zip(coord, st)) for st in strides)
            for coord in itertools.product(*(range(n) for n in shape))}


@pytest.mark.parametrize("case", CASES)
def test_layout_visits_the_same_elements(case):
    out, inputs = views(case)
    strides = [element_strides(out)] + [element_strides(a) for a in inputs]
    shape, reduced = elementwise.layout(out.shape, strides)
    assert pairs(shape, reduced) == pairs(out.shape, strides)
    assert len(pairs(shape, reduced)) == out.size  # every output element once
    # The last dimension is the output's fastest-varying one: threads next to each other write
    # neighbouring elements.
    if shape:
        assert abs(reduced[0][-1]) == min(abs(s) for s in reduced[0])


def test_contiguous_views_merge_into_one_dimension():
    out, inputs = views("contiguous")
    strides = [element_strides(out)] + [element_strides(a) for a in inputs]
    assert elementwise.layout(out.shape, strides) == ((out.size,), [(1,), (1,), (1,)])


def test_code_outside_numbers_names_and_operators_is_refused():
    with pytest.raises(ValueError, match="characters"):
        elementwise.source("p0; } __global__ void x() {", (4,), [(1,), (1,)], ("float64", "float64"))


def test_a_reduction_cannot_read_an_output_value():
    with pytest.raises(ValueError, match="no output value"):
        elementwise.reduce_source("y + p0", (4,), [(1,), (1,)], ("float64", "float64"))


def test_index_width_follows_the_offsets():
    small = elementwise.source("y + p0", (8, 8), [(8, 1), (1, 8)], ("float64", "float64"))
    wide = elementwise.source("y + p0", (8, 8), [(8, 1), (2**29, 8)], ("float64", "float64"))
    assert "int rest" in small and "long long rest" in wide


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_sources_compile_with_nvcc(tmp_path, monkeypatch):
    out, inputs = views("broadcast")
    strides = [element_strides(out)] + [element_strides(a) for a in inputs]
    shape, reduced = elementwise.layout(out.shape, strides)
    sources = [elementwise.source("y + 2.0 * p0 * p1 + -0.5 * p2", shape, reduced, ("float64",) * 4),
               elementwise.source("(1.0 / ((p0 - p1) + p2))", shape, reduced, ("float32", "float64", "float32", "float32")),
               elementwise.source("y + p0", (8, 8), [(8, 1), (2**29, 8)], ("float64", "float64")),
               elementwise.reduce_source("2.0 * p0 * p1 + -0.5 * p2", shape, reduced, ("float64",) * 4),
               elementwise.reduce_source("p0", (8, 8), [(8, 1), (2**29, 8)], ("float32", "float64"))]
    # Staged: the (T) epilogue's reads at v=700 (64-bit offsets: 8·700³ elements), a 3-D and a 2-D box.
    v = 700
    box3 = ((8, v, v, v), [(v**3, v * v, v, 1), (v**3, v * v, v, 1), (v**3, 1, v * v, v), (v**3, v, 1, v * v)])
    box2 = ((8, v, 40, v), [(v * v * 40, v * 40, v, 1), (v * v * 40, 1, v * v, v), (0, 1, 0, v)])
    sources += [elementwise.reduce_source("p0 * (p1 + 2.0 * p2)", *box3, ("float64",) * 4),
                elementwise.source("y + p0 * p1", *box2, ("float64",) * 3)]
    assert all(elementwise.staging(*box, ("float64",) * len(box[1])) for box in (box3, box2))
    assert "long long rest" in sources[-2]
    # Unrolled (four elements a thread), with 32- and 64-bit offsets
    monkeypatch.setattr(elementwise, "UNROLL_MIN", 1)
    monkeypatch.setattr(elementwise, "STAGE_SHARE", 0)
    sources += [elementwise.source("y + p0", shape, reduced[:2], ("float64",) * 2),
                elementwise.source("p0 * p1", (8, 8), [(8, 1), (2**29, 8), (1, 8)], ("float64",) * 3),
                elementwise.reduce_source("p0 * p1", shape, reduced[:3], ("float64",) * 3)]
    assert all("ok3" in text for text in sources[-3:])
    compiles_with_nvcc(tmp_path, sources + [elementwise.total_source("float64"), elementwise.total_source("float32")])


def _epilogue_views(rng, x, a, b, c, dtype=np.float64):
    """The (T) epilogue's kinds of reads over out[x, a, b, c] (c fastest), each from a NaN-padded
    buffer: a tensor stored in another index order (Z[x, b, c, a]), small tensors across c running
    along a (s[c, a]), x (f[c, x]: x is no box dimension) and b (g[c, b]), one broadcast along c
    and a contiguous one."""
    shape = (x, a, b, c)

    def small(first, second, at):
        big, off, view = stored(rng, (first, second), [0, 1])
        return big, off, np.expand_dims(view.T if at[0] > at[1] else view, [d for d in range(4) if d not in at])

    return [stored(rng, shape, [0, 2, 3, 1], dtype), small(c, a, (3, 1)), small(x, b, (0, 2)),
            stored(rng, shape, [0, 1, 2, 3]), small(c, x, (3, 0)), small(c, b, (3, 2))]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("extents", [(2, 19, 3, 37), (2, 5, 3, 7)], ids=["edge-boxes", "one-box"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_staged_pointwise_kernel_equals_numpy(extents, dtype, tmp_path, monkeypatch):
    """Inputs read across out's fastest index go through shared memory (a box over a, b and c,
    overhanging the extents 19 and 37, or one box holding them all; f[c, x] runs along x, outside
    the box; small inputs staged too here); the emulated kernel writes
    y + 1.5·p0·p1 + p2·p3 - 0.5·p0 + p4·p5 exactly where numpy has it and nothing outside out's view."""
    monkeypatch.setattr(elementwise, "STAGE_SHARE", 10**9)
    rng = np.random.default_rng(sum(extents))
    inputs = _epilogue_views(rng, *extents, dtype=dtype)
    big, off, out = stored(rng, extents, [0, 1, 2, 3])
    code = "y + 1.5 * p0 * p1 + p2 * p3 + -0.5 * p0 + p4 * p5"
    strides = [element_strides(out)] + [element_strides(v) for _, _, v in inputs]
    shape, reduced = elementwise.layout(out.shape, strides)
    types = tuple(np.dtype(v.dtype).name for _, _, v in inputs) + ("float64",)
    plan = elementwise.staging(shape, reduced, types)
    assert plan is not None and plan.staged == (0, 1, 4, 5) and plan.cube == (1, 2, 3)
    got = emulated(tmp_path, elementwise.source(code, shape, reduced, types), "chainexec_pointwise",
                    [big] + [b for b, _, _ in inputs], [off] + [o for _, o, _ in inputs],
                    elementwise.blocks(shape, plan))
    p = [v.astype(np.float64) for _, _, v in inputs]
    ref = out + 1.5 * p[0] * p[1] + p[2] * p[3] - 0.5 * p[0] + p[4] * p[5]
    view = got[tuple(slice(1, 1 + n) for n in extents)]
    assert np.max(np.abs(view - ref)) <= 1e-14 * np.max(np.abs(ref))
    outside = np.ones(got.shape, bool)
    outside[tuple(slice(1, 1 + n) for n in extents)] = False
    assert np.isnan(got[outside]).all()


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("extents,code,value", [
    ((3, 7, 50), "1.5 * p0", lambda p: 1.5 * p[0]),
    ((4, 8, 64), "1.5 * p0 * p1 + -p1", lambda p: 1.5 * p[0] * p[1] - p[1]),
    ((3, 7, 50), "p0 + p1 * p2", lambda p: p[0] + p[1] * p[2]),
], ids=["one-input-last-block-short", "two-inputs-whole-blocks", "three-inputs"])
@pytest.mark.parametrize("kind", ["write", "reduce"])
def test_unrolled_kernel_equals_numpy(extents, code, value, kind, tmp_path, monkeypatch):
    """Unstaged kernels of one, two and three inputs take
    :data:`~chainexec.kernels.elementwise.UNROLL` (four) elements a thread, all read, then all written:
    ``y + code`` into a NaN-padded output view, from a view stored in another order, a contiguous
    one and a broadcast one, over 1050 elements (the last block's threads partly past the end)
    and 2048 (whole blocks): numpy's values (to rounding) where numpy has them and nothing outside
    the view; the reduction's partial sums add up to numpy's sum of ``code``."""
    monkeypatch.setattr(elementwise, "UNROLL_MIN", 1)
    monkeypatch.setattr(elementwise, "STAGE_SHARE", 0)  # the view read across out's fastest index unstaged
    rng = np.random.default_rng(sum(extents))
    inputs = [stored(rng, extents, [0, 2, 1]), stored(rng, extents, [0, 1, 2]), stored(rng, extents[:1], [0])]
    inputs[2] = inputs[2][:2] + (inputs[2][2][:, None, None],)
    inputs = inputs[:1 + ("p1" in code) + ("p2" in code)]
    big, off, out = stored(rng, extents, [0, 1, 2])
    strides = [element_strides(out)] + [element_strides(v) for _, _, v in inputs]
    shape, reduced = elementwise.layout(out.shape, strides)
    types = ("float64",) * (len(inputs) + 1)
    assert elementwise.staging(shape, reduced, types) is None
    grid = elementwise.blocks(shape, None)
    unroll = elementwise.UNROLL
    assert grid == -(-int(np.prod(extents)) // (elementwise.BLOCK * unroll))
    p = [v for _, _, v in inputs]
    ref = value(p)
    if kind == "write":
        text = elementwise.source("y + " + code, shape, reduced, types)
        assert f"ok{unroll - 1}" in text and f"ok{unroll}" not in text
        got = emulated(tmp_path, text, "chainexec_pointwise", [big] + [b for b, _, _ in inputs],
                       [off] + [o for _, o, _ in inputs], grid)
        inner = tuple(slice(1, 1 + n) for n in extents)
        assert np.max(np.abs(got[inner] - (out + ref))) <= 1e-14 * np.max(np.abs(out + ref))
        outside = np.ones(got.shape, bool)
        outside[inner] = False
        assert np.isnan(got[outside]).all()
    else:
        partial = np.full(grid, np.nan)
        got = emulated(tmp_path, elementwise.reduce_source(code, shape, reduced, types), "chainexec_reduce",
                       [partial] + [b for b, _, _ in inputs], [0] + [o for _, o, _ in inputs], grid)
        assert abs(got.sum() - np.sum(ref)) <= 1e-13 * np.sum(np.abs(ref) + sum(np.abs(v) for v in p))


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("extents", [(3, 9, 10, 11), (2, 8, 8, 8)], ids=["edge-boxes", "whole-boxes"])
@pytest.mark.parametrize("wide", [False, True], ids=["32-bit", "64-bit"])
def test_staged_reduction_equals_numpy(extents, wide, tmp_path, monkeypatch):
    """The (T) energy's reads: W and Z[x, a, b, c] in place, Z read as Z[x, b, c, a], Z[x, c, a, b]
    and Z[x, a, c, b] (three box dimensions, 8x8x8, overhanging 9, 10, 11), and a broadcast
    energy e[a]. The emulated kernel's per-block partial sums add up to numpy's sum, with 32-bit
    index arithmetic and forced to 64-bit."""
    if wide:
        monkeypatch.setattr(elementwise, "INDEX32", 1)
    rng = np.random.default_rng(sum(extents))
    x, a, b, c = extents
    w_big, w_off, w = stored(rng, extents, [0, 1, 2, 3])
    n = max(a, b, c)  # the permuted reads need one extent: unequal ones read a cube-shaped Z's corners
    z_big, z = padded(rng, (x, n, n, n), [0, 1, 2, 3])
    e_big, e_off, e = stored(rng, (a,), [0])
    reads = [z[:, :a, :b, :c], z.transpose(0, 3, 1, 2)[:, :a, :b, :c], z.transpose(0, 2, 3, 1)[:, :a, :b, :c],
             z.transpose(0, 1, 3, 2)[:, :a, :b, :c]]
    views_ = [w] + reads + [e[None, :, None, None]]
    offsets = [w_off] + [offset_of(z_big, r) for r in reads] + [e_off]
    code = "p0 * (4.0 * p1 + p2 + -2.0 * p3 * p4) / (1.0 + p5 * p5)"
    walk = tuple(int(np.prod(extents[d + 1:])) for d in range(4))
    shape, reduced = elementwise.layout(extents, [walk] + [element_strides(v) for v in views_])
    types = ("float64",) * 7
    plan = elementwise.staging(shape, reduced, types)
    assert plan is not None and set(plan.staged) == {2, 3, 4} and len(plan.cube) == 3
    assert ("long long rest" if wide else "int rest") in elementwise.reduce_source("p0", shape, reduced, types)
    grid = elementwise.blocks(shape, plan)
    partial = np.full(grid, np.nan)
    got = emulated(tmp_path, elementwise.reduce_source(code, shape, reduced, types), "chainexec_reduce",
                    [partial, w_big, z_big, z_big, z_big, z_big, e_big], [0] + offsets, grid)
    ref = np.sum(w * (4.0 * reads[0] + reads[1] + -2.0 * reads[2] * reads[3]) / (1.0 + e[None, :, None, None] ** 2))
    assert abs(got.sum() - ref) <= 1e-13 * np.sum(np.abs(w))


# Strides (elements) of a (T) run's two point-wise statements at o=24 v=180 (3x3x3 occupied tiles),
# recorded on the H100 on 2026-11-24: the output's (or the walk's) first, then each input's.
TILE = (3, 3, 3, 180, 180, 180)
Z_STATEMENT = [(52488000, 17496000, 5832000, 32400, 180, 1), (52488000, 17496000, 5832000, 32400, 180, 1),
               (1, 0, 0, 24, 0, 0), (0, 1, 0, 0, 24, 0), (0, 32400, 777600, 0, 1, 180), (32400, 0, 777600, 1, 0, 180),
               (0, 0, 1, 0, 0, 24), (0, 777600, 32400, 0, 180, 1), (32400, 777600, 0, 1, 180, 0),
               (777600, 0, 32400, 180, 0, 1), (180, 0, 0, 1, 0, 0), (777600, 32400, 0, 180, 1, 0), (0, 180, 0, 0, 1, 0),
               (0, 180, 777600, 0, 1, 4320), (180, 0, 777600, 1, 0, 4320), (0, 0, 180, 0, 0, 1),
               (0, 777600, 180, 0, 4320, 1), (180, 777600, 0, 1, 4320, 0), (777600, 180, 0, 4320, 1, 0),
               (777600, 0, 180, 4320, 0, 1)]
ENERGY = [(52488000, 17496000, 5832000, 32400, 180, 1), (52488000, 17496000, 5832000, 32400, 180, 1),
          (52488000, 17496000, 5832000, 1, 180, 32400), (0, 0, 0, 0, 0, 1), (52488000, 17496000, 5832000, 180, 32400, 1),
          (0, 0, 0, 0, 1, 0), (52488000, 17496000, 5832000, 32400, 1, 180), (0, 0, 0, 1, 0, 0),
          (52488000, 17496000, 5832000, 180, 1, 32400), (0, 0, 1, 0, 0, 0), (52488000, 17496000, 5832000, 32400, 180, 1),
          (52488000, 17496000, 5832000, 1, 32400, 180), (1, 0, 0, 0, 0, 0), (0, 1, 0, 0, 0, 0)]


def test_only_large_inputs_read_across_are_staged():
    """The energy's four reads of the tile-sized Z across c are staged (an 8x8x8 box over a, b,
    c); the Z statement's inputs across c are tiles of t2 and ovov 1/540 of its size, read from
    the caches, so it is not (staging them measured slower on the H100)."""
    plan = elementwise.staging(TILE, ENERGY, ("float64",) * 14)
    assert plan == elementwise.Staging((3, 4, 5), (8, 8, 8), (1, 5, 7, 10))
    assert elementwise.staging(TILE, Z_STATEMENT, ("float64",) * 20) is None
    assert elementwise.blocks(TILE, plan) == 27 * 23 ** 3


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("n", [1, 255, 4097])
def test_total_adds_partial_sums_in_a_fixed_order(n, dtype, tmp_path):
    """The reductions' last step (one block over ``n`` partial sums, fewer or more than its
    threads), run on the CPU: NumPy's sum added to the ``y[0]`` it finds, rounded to ``y``'s
    dtype (:func:`total_source`); nothing but ``y[0]`` is written."""
    rng = np.random.default_rng(n)
    partial = rng.standard_normal(n)
    y = np.array([rng.standard_normal(), np.nan], dtype=dtype)
    text = elementwise.total_source(dtype).replace(", const unsigned n)", ")").replace(
        "k < n;", f"k < {n}u;")  # the emulation passes buffers only
    got = emulated(tmp_path, text, "chainexec_total", [y, partial], [0, 0], 1)
    tol = 1e-13 if dtype == "float64" else 1e-6
    assert abs(got[0] - (y[0] + y.dtype.type(partial.sum()))) <= tol * (np.abs(partial).sum() + abs(y[0]))
    assert np.isnan(got[1])
