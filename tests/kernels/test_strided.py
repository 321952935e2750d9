"""The shape-generic tile-operation kernels (:mod:`chainexec.kernels.strided`): their sources
compile with nvcc, and emulated on the CPU (:mod:`tests.kernels.emulation`) they write exactly
what NumPy writes, at any extents and strides given as arguments, in 32- and 64-bit index
arithmetic, whatever the grid. Launched through the runtime in test_pointwise.py (arguments)
and test_pointwise_gpu.py (a GPU)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from chainexec.kernels import strided
from tests.kernels.emulation import compiles_with_nvcc, emulated, stored

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")


def test_a_module_holds_the_three_operations_with_their_arguments():
    """One source per (dimensions, dtypes, index type), holding set, add and fill; the extents
    but the first and both arrays' strides are arguments (fill reads no input), 0 dimensions
    take none; the product is made in double precision and rounded once."""
    text = strided.strided_source(3, "float32", "long long")
    for op in strided.OPERATIONS:
        assert f"void chainexec_strided_{op}(" in text
    assert "float* Y, const float* P, const float f, const long long n, const long long e1, " \
           "const long long e2, const long long y0" in text
    assert "chainexec_strided_fill(float* Y, const float f, const long long n, const long long e1, " \
           "const long long e2, const long long y0, const long long y1, const long long y2)" in text
    assert "Y[c0 * y0 + c1 * y1 + c2 * y2] += (float)__dmul_rn((double)f, (double)P[c0 * s0 + c1 * s1 + c2 * s2]);" in text
    scalar = strided.strided_source(0, "float64", "int")
    assert "chainexec_strided_set(double* Y, const double* P, const double f, const int n)" in scalar
    assert "Y[0] = (double)__dmul_rn((double)f, (double)P[0]);" in scalar
    assert strided.strided_source(3, "float32", "long long") is text  # made once


def test_the_warm_ups_modules_cover_every_dimension_count_up_to_the_common_one():
    common = strided.common()
    assert len(common) == 3 * (strided.COMMON_DIMS + 1)
    assert len({text for _, text in common}) == strided.COMMON_DIMS + 1
    assert {name for name, _ in common} == {f"chainexec_strided_{op}" for op in strided.OPERATIONS}


def test_grid_is_one_block_per_block_of_elements_up_to_the_cap():
    assert strided.grid(0) == strided.grid(1) == 1
    assert strided.grid(257) == 2
    assert strided.grid(10**9) == strided.GRID


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_sources_compile_with_nvcc(tmp_path):
    compiles_with_nvcc(tmp_path, [strided.strided_source(d, t, i) for d in (0, 1, 4, 7)
                                  for t in ("float64", "float32") for i in ("int", "long long")])


def _run(tmp_path, op, out_view, x_view, factor, index, grid):
    """The kernel ``op`` on the padded views (:func:`stored`), extents and strides passed as
    they lie (no merging), on ``grid`` blocks; the output's whole buffer as it is left."""
    big, off, out = out_view
    shape = out.shape
    ys = [s // out.itemsize for s in out.strides]
    buffers, offsets, strides = [big], [off], ys
    if x_view is not None:
        xbig, xoff, x = x_view
        buffers, offsets = [big, xbig], [off, xoff]
        strides = ys + [0 if m == 1 else s // x.itemsize for m, s in zip(x.shape, x.strides)]
    scalars = (float(factor).hex(), str(int(np.prod(shape))), *map(str, shape[1:]), *map(str, strides))
    text = strided.strided_source(len(shape), out.dtype.name, index)
    return emulated(tmp_path, text, f"chainexec_strided_{op}", buffers, offsets, grid, scalars)


def _inside(got, big, order):
    """The view of ``got`` (a padded buffer as :func:`stored` made ``big``) in index order."""
    return got[tuple(slice(1, n - 1) for n in big.shape)].transpose(np.argsort(order))


def _untouched_outside(got, big) -> bool:
    outside = np.ones(got.shape, bool)
    outside[tuple(slice(1, n - 1) for n in big.shape)] = False
    return bool(np.isnan(got[outside]).all())


@needs_gxx
@pytest.mark.parametrize("op", ["set", "add"])
@pytest.mark.parametrize("index", ["int", "long long"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_set_and_add_write_exactly_numpys_values_and_nothing_else(op, index, dtype, tmp_path):
    """``out = f·x`` and ``out += f·x`` over a permuted, padded output from a permuted input
    broadcast along one dimension, in float64 and float32 (a factor float32 does not hold
    exactly), by one block of 256 threads for 420 elements (each thread walks on a grid apart):
    the values NumPy gives for ``out += f * x``, bit for bit, inside out's view, and its NaN
    padding untouched outside it."""
    rng = np.random.default_rng(5)
    order = [2, 0, 3, 1]
    big, off, out = stored(rng, (3, 5, 4, 7), order, dtype)
    xbig, xoff, x = stored(rng, (3, 1, 4, 7), [3, 1, 0, 2], dtype)
    factor = -0.1
    got = _run(tmp_path, op, (big, off, out), (xbig, xoff, x), factor, index, 1)
    ref = out.copy()
    if op == "add":
        ref += factor * x
    else:
        np.multiply(x, factor, out=ref)
    assert np.array_equal(_inside(got, big, order), ref)
    assert _untouched_outside(got, big)


@needs_gxx
def test_fill_writes_the_value_inside_the_view_only(tmp_path):
    rng = np.random.default_rng(6)
    order = [1, 2, 0]
    big, off, out = stored(rng, (4, 3, 5), order)
    got = _run(tmp_path, "fill", (big, off, out), None, 2.5, "int", 2)
    assert (_inside(got, big, order) == 2.5).all()
    assert _untouched_outside(got, big)
