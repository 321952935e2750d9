"""Generated point-wise kernels on a GPU against NumPy: permuted, cut and broadcast views, sums of
terms that read the output, float32 output from float64 inputs, 64-bit index arithmetic, and
nothing outside the output's view written; reductions of such expressions over a whole index
space (a partial block included) equal NumPy's sum and repeat bit for bit. Skipped without
CuPy or a CUDA device.

The reference is NumPy's own broadcasting arithmetic on the host copies of the same views."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import require_gpu  # noqa: E402

cupy = require_gpu()

from chainexec.kernels import elementwise  # noqa: E402
from chainexec.runtime import pointwise  # noqa: E402
from tests.kernels.emulation import CASES, gathered_shape, views  # noqa: E402

pytestmark = pytest.mark.gpu


def terms(inputs) -> str:
    """``y + 1.5·p0 + 2.5·p1 + …``: every input, each with its own factor."""
    return "y + " + " + ".join(f"{k + 1.5} * p{k}" for k in range(len(inputs)))


def expected(out, inputs):
    total = out
    for k, a in enumerate(inputs):
        total = total + (k + 1.5) * a
    return total


def relerr(got, ref) -> float:
    """Norm-wise: the kernel's fused multiply-adds round differently from NumPy's separate
    products and sums, so single elements near cancellation differ relatively more."""
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@pytest.fixture(params=[False, True], ids=["32-bit", "64-bit"])
def wide(request, monkeypatch):
    """Each kernel with 32-bit index arithmetic where it fits, and forced to 64-bit; the sources
    made once per process are made afresh, before and after, so that none made under the forced
    limit outlives the test (a later test in this worker would launch 64-bit kernels)."""
    def forget():
        for make in (*pointwise.PREPARED.values(), pointwise._strided_made):
            make.cache_clear()

    if request.param:
        forget()
        monkeypatch.setattr(elementwise, "INDEX32", 1)
    yield request.param
    if request.param:
        forget()


@pytest.mark.parametrize("case", CASES)
def test_sum_of_terms_equals_numpy(case, wide):
    out, inputs = views(case, cupy)
    host_out, host_inputs = out.get(), [a.get() for a in inputs]
    whole = out if out.base is None else out.base
    before = whole.get()
    pointwise.launch(cupy, terms(inputs), inputs, out)
    assert relerr(out.get(), expected(host_out, host_inputs)) <= 1e-15
    # Nothing outside out's view changed: mark the view's elements in a buffer like its base.
    flag = cupy.zeros(whole.shape, out.dtype)
    cupy.ndarray(out.shape, out.dtype, flag.data + (out.data.ptr - whole.data.ptr), strides=out.strides)[...] = 1
    outside = flag.get() == 0
    np.testing.assert_array_equal(whole.get()[outside], before[outside])
    assert case != "cut" or outside.any()


def test_expression_with_division_into_float32():
    out32 = cupy.zeros((4, 6, 5), np.float32)
    e_occ = cupy.asarray(np.random.default_rng(3).standard_normal(4) - 3)
    e_vir = cupy.asarray(np.random.default_rng(4).standard_normal(5) + 3)
    views_ = [e_occ[:, None, None], e_vir[None, None, :], cupy.asarray(np.random.default_rng(5).standard_normal((1, 6, 1)))]
    pointwise.launch(cupy, "(1.0 / ((p0 - p1) + p2))", views_, out32)
    host = [v.get() for v in views_]
    assert relerr(out32.get(), (1.0 / ((host[0] - host[1]) + host[2])).astype(np.float32)) <= 1e-7


@pytest.mark.parametrize("case", CASES)
def test_reduction_equals_numpy(case, wide):
    out, inputs = views(case, cupy)
    code = " + ".join(f"{k + 1.5} * p{k} * p{k}" if k % 2 else f"{k - 0.5} * p{k}" for k in range(len(inputs)))
    got = cupy.zeros(())
    pointwise.reduce(cupy, code, inputs, out.shape, got)
    host = [np.broadcast_to(a.get(), out.shape) for a in inputs]
    terms = [(k + 1.5) * a * a if k % 2 else (k - 0.5) * a for k, a in enumerate(host)]
    assert abs(float(got) - float(np.sum(sum(terms)))) <= 1e-13 * float(np.sum(sum(np.abs(t) for t in terms)))
    for dtype in (cupy.float64, cupy.float32):  # a fused statement's scalar output: the sum added to it
        into = cupy.full((), 2.5, dtype)
        pointwise.reduce(cupy, code, inputs, out.shape, into)
        assert float(into) == float(dtype(2.5) + dtype(float(got)))  # the same bits every run


@pytest.mark.parametrize("extents", [(2, 19), (1, 40), (3, 8)], ids=["edge-blocks", "whole-blocks", "one-block"])
def test_orbit_reduction_equals_numpy(extents, wide):
    """The (T) energy's shape through the orbit kernel: Z = W + 0.5·s[c, a]·e[b] computed once per
    element and read at the six permutations of (a, b, c); W stored in another index order. The
    sum equals NumPy's and repeats bit for bit."""
    from tests.kernels.test_orbits import ENERGY_CODE, PERMS3, permuted

    x, n = extents
    rng = np.random.default_rng(n)
    w = cupy.asarray(rng.standard_normal((x, n, n, n))).transpose(0, 2, 3, 1)
    s = cupy.asarray(rng.standard_normal((n, n)))
    e = cupy.asarray(rng.standard_normal(n))
    views_ = [w, s.T[None, :, None, :], e[None, None, :, None]]
    code = ENERGY_CODE
    reads = [(0, p) for p in PERMS3]
    got = cupy.zeros(())
    pointwise.orbit_reduce(cupy, ["p0 + 0.5 * p1 * p2"], code, reads, views_, w.shape, "float64", got)
    hw, hs, he = w.get(), s.get().T[None, :, None, :], e.get()[None, None, :, None]
    z = hw + 0.5 * hs * he
    q = [permuted(z, p) for p in PERMS3]
    terms = hw * (4 * q[0] + q[1] + 1.5 * q[2] - 2 * q[3] - 2 * q[4] - 2 * q[5]) * he
    assert abs(float(got) - float(np.sum(terms))) <= 1e-13 * float(np.sum(np.abs(terms)))
    into = cupy.full((), -1.25)  # the sum added to what the output holds, the same bits every run
    pointwise.orbit_reduce(cupy, ["p0 + 0.5 * p1 * p2"], code, reads, views_, w.shape, "float64", into)
    assert float(into) == -1.25 + float(got)


@pytest.mark.parametrize("along", ["occupied", "permuted"])
def test_weighted_orbit_reduction_skips_zero_weights(along, wide):
    """The energy's orbit kernel times a weight (:mod:`chainexec.planner.ordered`). Along the
    other dimension (2, 0, 1 over x = 3, W NaN where it is 0): those blocks are skipped, the sum
    equals NumPy's. Along a permuted dimension (a weight over a): no block can be skipped, the
    weight is multiplied in and the sum equals NumPy's."""
    from tests.kernels.test_orbits import ENERGY_CODE, PERMS3, permuted

    x, n = 3, 19
    rng = np.random.default_rng(5)
    hw = rng.standard_normal((x, n, n, n))
    s, e = rng.standard_normal((n, n)), rng.standard_normal(n)
    weight = (np.array([2.0, 0.0, 1.0])[:, None, None, None] if along == "occupied"
              else rng.integers(0, 3, n).astype(np.float64)[None, :, None, None])
    z = hw + 0.5 * s.T[None, :, None, :] * e[None, None, :, None]
    q = [permuted(z, p) for p in PERMS3]
    terms = hw * (4 * q[0] + q[1] + 1.5 * q[2] - 2 * q[3] - 2 * q[4] - 2 * q[5]) * e[None, None, :, None]
    ref = float(np.sum(terms * weight))
    if along == "occupied":
        hw[1] = np.nan
    views_ = [cupy.asarray(hw), cupy.asarray(s).T[None, :, None, :], cupy.asarray(e)[None, None, :, None],
              cupy.asarray(weight)]
    got = cupy.zeros(())
    pointwise.orbit_reduce(cupy, ["p0 + 0.5 * p1 * p2"], f"({ENERGY_CODE}) * p3", [(0, p) for p in PERMS3],
                           views_, hw.shape, "float64", got, 3)
    assert abs(float(got) - ref) <= 1e-13 * float(np.sum(np.abs(terms * weight)))


def test_orbit_kernels_listed_at_stand_ins_are_those_the_launches_run(tmp_path, monkeypatch):
    """The orbit kernels of two tile shapes, listed at NumPy stand-ins of their views
    (:func:`pointwise.orbit_kernels`) and compiled together (:func:`pointwise.precompile`, a
    kernel cache of the test's own), are the ones the launches then run: nothing more compiles,
    and each sum equals NumPy's."""
    from chainexec.runtime import kernelcache
    from tests.kernels.test_orbits import ENERGY_CODE, PERMS3, permuted

    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path))
    n, rng = 13, np.random.default_rng(29)
    lets, reads = ["p0 + 0.5 * p1 * p2"], [(0, p) for p in PERMS3]
    cases = []
    for x in (3, 2):
        hw, hs, he = rng.standard_normal((x, n, n, n)), rng.standard_normal((n, n)), rng.standard_normal(n)
        views_ = [cupy.asarray(hw).transpose(0, 2, 3, 1), cupy.asarray(hs).T[None, :, None, :],
                  cupy.asarray(he)[None, None, :, None]]
        stand_ins = [np.lib.stride_tricks.as_strided(np.zeros(1), v.shape, v.strides, writeable=False) for v in views_]
        cases.append((views_, stand_ins, [v.get() for v in views_]))
    listed = [k for _, stand_ins, _ in cases
              for k in pointwise.orbit_kernels(cupy, lets, ENERGY_CODE, reads, stand_ins, stand_ins[0].shape,
                                               "float64", None)]
    before = kernelcache.compiled()[1]
    pointwise.precompile(cupy, listed)
    assert kernelcache.compiled()[1] == before + 2
    for views_, _, (hw, hs, he) in cases:
        got = cupy.zeros(())
        pointwise.orbit_reduce(cupy, lets, ENERGY_CODE, reads, views_, views_[0].shape, "float64", got)
        z = hw + 0.5 * hs * he
        q = [permuted(z, p) for p in PERMS3]
        terms = hw * (4 * q[0] + q[1] + 1.5 * q[2] - 2 * q[3] - 2 * q[4] - 2 * q[5]) * he
        assert abs(float(got) - float(np.sum(terms))) <= 1e-13 * float(np.sum(np.abs(terms)))
    assert kernelcache.compiled()[1] == before + 2


@pytest.mark.parametrize("case", CASES)
def test_tile_operations_equal_numpy(case, wide):
    """The backend's tile operations on each kind of view (:func:`pointwise.assign`, ``fill``,
    ``copy``): ``out += f·x``, ``out = f·x`` and a fill write what NumPy writes, bit for bit, and
    nothing outside out's view; a copy is C-contiguous and equal."""
    out, inputs = views(case, cupy)
    x = inputs[0]
    whole = out if out.base is None else out.base
    host, hx, before = out.get(), x.get(), whole.get()
    pointwise.assign(cupy, out, x, -0.75, add=True)
    assert np.array_equal(out.get(), host + -0.75 * hx)
    pointwise.assign(cupy, out, x, 0.5)
    assert np.array_equal(out.get(), np.broadcast_to(0.5 * hx, host.shape))
    pointwise.fill(cupy, out, 0.0)
    assert not out.get().any()
    inside = np.zeros(whole.shape, bool)  # out's elements in its buffer: elsewhere it is as it was
    np.ndarray(out.shape, bool, inside, (out.data.ptr - whole.data.ptr) // out.itemsize,
               tuple(st // out.itemsize for st in out.strides))[...] = True
    assert np.array_equal(whole.get()[~inside], before[~inside])
    copied = pointwise.copy(cupy, x)
    assert copied.flags.c_contiguous and np.array_equal(copied.get(), hx)


def test_tile_operations_in_place_in_float32_and_on_scalars():
    """A product scaled in place (``x`` is ``out``), a float32 product added with a factor float32
    rounds (as NumPy's float32 arithmetic has it), a float64 view into float32 refused (one dtype
    per operation), a 0-d copy that stays 0-d, and a clear of a view with gaps by the fill kernel."""
    rng = np.random.default_rng(4)
    a = cupy.asarray(rng.standard_normal((6, 7, 5)))
    host = a.get()
    pointwise.assign(cupy, a, a, 3.0)
    assert np.array_equal(a.get(), 3.0 * host)
    low = cupy.asarray(rng.standard_normal((7, 6)), cupy.float32)
    x = cupy.asarray(rng.standard_normal((6, 7, 5)), cupy.float32)
    before, hx = low.get(), x.get()
    pointwise.assign(cupy, low, x[:, :, 2].T, 0.1, add=True)
    assert np.array_equal(low.get(), before + np.float32(0.1) * hx[:, :, 2].T)
    with pytest.raises(ValueError, match="one dtype"):
        pointwise.assign(cupy, low, a[:, :, 2].T, -1.5, add=True)
    scalar = pointwise.copy(cupy, a[2, 3, 4])
    assert scalar.shape == () and float(scalar) == 3.0 * host[2, 3, 4]
    pointwise.fill(cupy, a[:, 1:4, ::2], 0.0)
    expect = 3.0 * host
    expect[:, 1:4, ::2] = 0.0
    assert np.array_equal(a.get(), expect)


def test_after_the_warm_ups_load_no_common_kernel_compiles(tmp_path, monkeypatch):
    """:func:`pointwise.load_common` compiles the common kernels together; tile operations of 0
    to :data:`strided.COMMON_DIMS` merged dimensions, a batched GEMM's addresses and a
    reduction's total then compile nothing, and each computes what NumPy does."""
    from chainexec.kernels import strided
    from chainexec.runtime import kernelcache

    monkeypatch.setenv("CHAINEXEC_KERNEL_CACHE", str(tmp_path))
    pointwise.load_common(cupy)
    before = kernelcache.compiled()[1]
    rng = np.random.default_rng(9)
    for dims in range(strided.COMMON_DIMS + 1):
        # every other element of each axis of a 4^dims buffer: no two axes merge
        base = cupy.asarray(rng.standard_normal((4,) * dims))
        view = base[(slice(None, None, 2),) * dims]
        expect = 3.0 * view.get()
        out = cupy.empty_like(view)
        pointwise.assign(cupy, out, view)
        pointwise.assign(cupy, out, view, 2.0, add=True)
        pointwise.fill(cupy, view, 1.0)
        assert np.array_equal(out.get(), expect) and (view.get() == 1.0).all()
    table = rng.integers(0, 2**40, (3, 700), dtype=np.int64)
    base = (2**45, 3 * 2**45, 5 * 2**45)
    at = pointwise.addresses(cupy, cupy.asarray(table), base)
    assert np.array_equal(at.get(), table + np.array(base, np.int64)[:, None])
    partial = rng.standard_normal(1000)
    into = cupy.zeros((), cupy.float64)
    pointwise.total(cupy, cupy.asarray(partial), into)
    assert abs(float(into) - partial.sum()) <= 1e-12 * np.abs(partial).sum()
    assert kernelcache.compiled()[1] == before


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "added"])
@pytest.mark.parametrize("positions, a_shape, before, axis, after", [
    (("unpack", 0, 0, 40, 0, 40), (820, 820), None, 0, None),
    (("unpack", 55, 10, 23, 3, 19), (7, 221), None, 1, (1, 2, 0)),
    (("pack", 0, 820, 0, 0, 40), (40, 40, 9), None, 0, (1, 0)),
    (("pack", 100, 230, 13, 0, 21), (9, 8, 21), (1, 0, 2), 1, None)],
    ids=["s8-to-s4", "unpack-permuted", "pack", "pack-permuted"])
def test_gather_by_the_pair_kernel_equals_numpys_take(positions, a_shape, before, axis, after, fresh):
    """:meth:`CupyBackend.gather` (positions computed in the kernel) writes what the NumPy
    backend's ``take`` at its table of positions writes, bit for bit (each value moved and
    scaled once), on blocks of pairs and members away from the origin."""
    from chainexec.runtime.backends.cupy import CupyBackend
    from chainexec.runtime.backends.numpy import NumpyBackend

    rng = np.random.default_rng(sum(a_shape))
    a = rng.standard_normal(a_shape)
    shape = gathered_shape(a.shape, before, axis, positions, after)
    out = rng.standard_normal(shape)
    expected = out.copy()
    NumpyBackend().gather(expected, a, before, axis, positions, after, 0.3, fresh)
    got = cupy.asarray(out)
    CupyBackend(cupy).gather(got, cupy.asarray(a), before, axis, positions, after, 0.3, fresh)
    assert np.array_equal(got.get(), expected)
