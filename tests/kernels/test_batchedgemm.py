"""Batched-GEMM layouts (Shi et al., the strided-batched GEMM paper): the calls a plan describes,
carried out by a column-major BLAS emulator written here from the BLAS definitions (bounds
checked), equal ``numpy.einsum`` on fresh random operands, contiguous, permuted and cut from larger
buffers; the paper's case studies run as one call."""

import math
import shutil

import numpy as np
import pytest

from chainexec.kernels import batchedgemm
from tests.kernels.emulation import compiles_with_nvcc, emulated
from tests.kernels.test_sumkernel import W_TERMS

CASES = [
    # (out, a, b, sizes): GEMM, both operands transposed, the paper's case studies 1 and 2 (in
    # row-major letters), a (T) vvov and vooo term, a batch mode in all three, a contracted mode
    # that cannot join the others (looped), extent-1 modes, a matrix-vector product, TCCG 31.
    ("ab", "ak", "kb", dict(a=7, b=5, k=6)),
    ("ab", "ka", "bk", dict(a=7, b=5, k=6)),
    ("pnm", "km", "pnk", dict(m=5, n=4, p=3, k=6)),
    ("pnm", "mk", "nkp", dict(m=5, n=4, p=3, k=6)),
    ("ijkabc", "iafc", "jkbf", dict(i=2, j=3, k=2, a=4, b=3, c=5, f=4)),
    ("ijkabc", "iajm", "mkbc", dict(i=2, j=2, k=3, a=4, b=3, c=5, m=3)),
    ("lab", "lak", "lkb", dict(l=3, a=5, b=4, k=6)),
    ("ab", "akl", "lbk", dict(a=4, b=5, k=3, l=4)),
    ("aib", "ak", "kib", dict(a=6, i=1, b=5, k=4)),
    ("a", "ak", "k", dict(a=6, k=5)),
    ("abcdef", "dega", "gfbc", dict(a=3, b=2, c=2, d=3, e=2, f=2, g=3)),
]


def _emulate_gemm(bl, flats, offsets, alpha, beta):
    """C = α·op(A)·op(B) + β·C, column-major, on flat float64 buffers at element offsets."""
    def mat(flat, off, rows, cols, ld, trans):
        shape = (cols, rows) if trans else (rows, cols)
        last = off + (shape[0] - 1) + (shape[1] - 1) * ld
        assert 0 <= off and last < flat.size, "BLAS would read or write outside the buffer"
        m = np.lib.stride_tricks.as_strided(flat[off:], shape, (flat.itemsize, ld * flat.itemsize))
        return m.T if trans else m

    a, b, c = flats
    assert bl.lda >= max(1, bl.k if bl.trans_a else bl.m) and bl.ldb >= max(1, bl.n if bl.trans_b else bl.k)
    assert bl.ldc >= max(1, bl.m)
    opa = mat(a, offsets[0], bl.m, bl.k, bl.lda, bl.trans_a)
    opb = mat(b, offsets[1], bl.k, bl.n, bl.ldb, bl.trans_b)
    cm = mat(c, offsets[2], bl.m, bl.n, bl.ldc, False)
    cm[...] = alpha * (opa @ opb) + beta * cm


def run(g, out, a, b, alpha=1.0, beta=1.0):
    """``g``'s launches on views of flat buffers, as cuBLAS would carry them out."""
    bl = batchedgemm.blas(g)
    flats, base = [], []
    for x in (a, b, out):
        flat = x.base.reshape(-1) if x.base is not None else x.reshape(-1)
        flats.append(flat)
        base.append((x.__array_interface__["data"][0] - flat.__array_interface__["data"][0]) // x.itemsize)
    first, second = (1, 0) if bl.swap else (0, 1)
    for launch in g.launches():
        every = launch.offsets
        if launch.strided:
            count, *steps = g.batch
            every = [tuple(o + p * s for o, s in zip(launch.offsets[0], steps)) for p in range(count)]
        for off in every:
            pos = [base[t] + off[t] for t in range(3)]
            _emulate_gemm(bl, (flats[first], flats[second], flats[2]), (pos[first], pos[second], pos[2]),
                          alpha, beta if launch.first else 1.0)


def _operands(c, a, b, sizes, rng, how):
    """Random operands over index strings: contiguous, stored in another index order and
    transposed back (``permuted``), or cut from a larger zero-padded buffer (``cut``)."""
    arrays = []
    for idx in (c, a, b):
        shape = [sizes[i] for i in idx]
        if how == "permuted":
            order = rng.permutation(len(idx))
            stored = rng.standard_normal([shape[d] for d in order])
            arrays.append(stored.transpose(np.argsort(order)))
        elif how == "cut":
            big = rng.standard_normal([n + 2 for n in shape[:-1]] + [shape[-1] + 3])
            arrays.append(big[tuple(slice(1, 1 + n) for n in shape)])
        else:
            arrays.append(rng.standard_normal(shape))
    return arrays


def _strides(x, idx):
    return {i: s // x.itemsize for i, s in zip(idx, x.strides)}


@pytest.mark.parametrize("how", ["contiguous", "permuted", "cut"])
@pytest.mark.parametrize("c,a,b,sizes", CASES)
def test_launches_equal_einsum(c, a, b, sizes, how):
    rng = np.random.default_rng(sum(map(ord, c + a + b + how)))
    out, x, y = _operands(c, a, b, sizes, rng, how)
    g = batchedgemm.plan(c, a, b, sizes, (_strides(out, c), _strides(x, a), _strides(y, b)), min_side=1)
    if g is None:
        assert how != "contiguous", "every contraction of contiguous operands has a batched-GEMM form"
        return
    expect = 0.5 * np.einsum(f"{a},{b}->{c}", x, y) - 2.0 * out
    run(g, out, x, y, alpha=0.5, beta=-2.0)
    assert np.max(np.abs(out - expect)) <= 1e-12 * np.max(np.abs(expect))


def _fortran(idx, sizes):
    """Element strides of a column-major (first mode fastest) tensor, as the paper writes them."""
    strides, step = {}, 1
    for i in idx:
        strides[i] = step
        step *= sizes[i]
    return strides


@pytest.mark.parametrize("c,a,b,gemm,batch", [
    # Sec. III-A case study 1: C_mnp = A_mk B_nkp, one STRIDEDBATCHEDGEMM over p.
    ("mnp", "mk", "nkp", "mn", "p"),
    # Case study 2: C_mnp = A_km B_pkn (BTAS: four transpositions), one call. The paper batches
    # p; here p > n, so the larger GEMM (m by p, batched over n) is chosen (priority 2).
    ("mnp", "km", "pkn", "mp", "n"),
    # Table II case 1.1: C_mnp = A_mk B_knp flattens to one GEMM over (n, p).
    ("mnp", "mk", "knp", "mnp", ""),
])
def test_paper_case_studies_run_as_one_call(c, a, b, gemm, batch):
    sizes = dict(m=5, n=7, p=9, k=6)
    g = batchedgemm.plan(c, a, b, sizes, tuple(_fortran(idx, sizes) for idx in (c, a, b)), min_side=1)
    assert len(g.launches()) == 1 and g.launches()[0].strided
    assert g.out.rows * g.out.cols == np.prod([sizes[i] for i in gemm])
    assert g.batch[0] == np.prod([sizes[i] for i in batch])


def test_largest_gemm_and_largest_batch_mode_are_chosen():
    # (T) vvov term W[ijkabc] += ovvv[iafc]·t2[jkbf] over a W tile: c (unit in W and ovvv) by b,
    # summed over f; the batch is a (the largest mode left); j and k step as one mode in W and
    # t2 (ovvv lacks both), i does not: loops of 2 and 4 iterations, few enough for a
    # strided-batched call each.
    sizes = dict(i=2, j=2, k=2, a=30, b=30, c=30, f=30)
    strides = tuple(_strides(np.empty([sizes[i] for i in idx]), idx) for idx in ("ijkabc", "iafc", "jkbf"))
    g = batchedgemm.plan("ijkabc", "iafc", "jkbf", sizes, strides)
    assert (g.out.rows, g.out.cols, g.a.cols) == (30, 30, 30)
    assert g.batch[0] == 30 and sorted(n for n, *_ in g.loops) == [2, 4]
    launches = g.launches()
    assert len(launches) == 8 and all(launch.strided and launch.first for launch in launches)
    assert len({launch.offsets[0, 2] for launch in launches}) == 8


def test_modes_that_step_as_one_in_every_tensor_are_one_batch():
    # The (T) W term as the stacks copy it, W[ijkabc] += L[fiab]·R[fjkc]: (a, b) rows, c columns,
    # f summed; (j, k) one batch mode of 4 (stride 0 in L), i a loop of 2: two strided calls, not
    # a pointer-array call over 8 matrices.
    sizes = dict(i=2, j=2, k=2, a=9, b=10, c=11, f=12)
    strides = tuple(_strides(np.empty([sizes[i] for i in idx]), idx) for idx in ("ijkabc", "fiab", "fjkc"))
    g = batchedgemm.plan("ijkabc", "fiab", "fjkc", sizes, strides)
    assert (g.out.rows * g.out.cols, g.a.cols) == (990, 12)
    assert g.batch[0] == 4 and [n for n, *_ in g.loops] == [2]
    assert [launch.strided for launch in g.launches()] == [True, True]


@pytest.mark.parametrize("extent,calls", [(2, 8), (3, 1)])
def test_nested_iterations_beyond_the_limit_become_one_pointer_array_call(extent, calls):
    # i, j, k of ``extent``: j and k merge, i is left; 2·4 = 8 iterations are strided calls,
    # 3·9 = 27 (more than STRIDED_CALLS) one pointer-array call over every matrix.
    sizes = dict(i=extent, j=extent, k=extent, a=12, b=12, c=12, f=12)
    strides = tuple(_strides(np.empty([sizes[i] for i in idx]), idx) for idx in ("ijkabc", "iafc", "jkbf"))
    g = batchedgemm.plan("ijkabc", "iafc", "jkbf", sizes, strides)
    assert 8 <= batchedgemm.STRIDED_CALLS < 27
    launches = g.launches()
    assert len(launches) == calls
    if calls == 1:
        (launch,) = launches
        assert not launch.strided and len(launch.offsets) == extent ** 3 * 12
        assert len(set(o[2] for o in launch.offsets)) == extent ** 3 * 12, "no two matrices of one call share an output"


@pytest.mark.parametrize("c,a,b", [("ab", "a", "b"), ("ab", "abk", "b"), ("a", "ab", "a")])
def test_no_plan_without_a_contracted_mode_or_with_a_mode_in_one_tensor(c, a, b):
    sizes = dict(a=3, b=4, k=5)
    strides = tuple(_strides(np.empty([sizes[i] for i in idx]), idx) for idx in (c, a, b))
    assert batchedgemm.plan(c, a, b, sizes, strides) is None


def test_thin_batched_gemms_are_not_proposed():
    # TCCG 2 (abc-dca-bd): the only in-place form is a batch of 1-row GEMMs (matrix-vector).
    sizes = dict(a=31, b=24, c=29, d=31)
    strides = tuple(_strides(np.empty([sizes[i] for i in idx]), idx) for idx in ("abc", "dca", "bd"))
    thin = batchedgemm.plan("abc", "dca", "bd", sizes, strides, min_side=1).out
    assert min(thin.rows, thin.cols) == 1
    assert batchedgemm.plan("abc", "dca", "bd", sizes, strides) is None
    # nor one matrix-vector or dot product
    sizes = dict(a=30, k=20)
    assert batchedgemm.plan("a", "ak", "k", sizes, ({"a": 1}, {"a": 20, "k": 1}, {"k": 1})) is None
    assert batchedgemm.plan("", "ak", "ak", sizes, ({}, {"a": 20, "k": 1}, {"a": 20, "k": 1})) is None


def test_contracted_loop_adds_after_the_first_call():
    # k and l in opposite orders in a and b cannot merge: one is looped, its later calls add.
    sizes = dict(a=4, b=5, k=3, l=4)
    strides = tuple(_strides(np.empty([sizes[i] for i in idx]), idx) for idx in ("ab", "akl", "lbk"))
    g = batchedgemm.plan("ab", "akl", "lbk", sizes, strides, min_side=1)
    assert [launch.first for launch in g.launches()] == [True] + [False] * (len(g.launches()) - 1)
    assert len(g.launches()) in (3, 4)


def test_every_iteration_is_covered_once():
    sizes = dict(i=2, j=3, k=2, a=4, b=3, c=5, f=4)
    strides = tuple(_strides(np.empty([sizes[i] for i in idx]), idx) for idx in ("ijkabc", "iafc", "jkbf"))
    g = batchedgemm.plan("ijkabc", "iafc", "jkbf", sizes, strides, min_side=1)
    outs = []
    for launch in g.launches():
        for off in launch.offsets:
            steps = range(g.batch[0]) if launch.strided else [0]
            outs += [off[2] + p * g.batch[3] for p in steps]
    assert len(outs) == len(set(outs)) == np.prod([sizes[i] for i in "ijkabc"]) // (g.out.rows * g.out.cols)


W_SIZES = dict(i=2, j=3, k=2, a=5, b=4, c=6, f=3, m=3)


@pytest.mark.parametrize("c,a,b,sizes", CASES + [("ijkabc", a, b, W_SIZES) for a, b, _ in W_TERMS])
def test_copies_in_operand_orders(c, a, b, sizes):
    """Copies of the operands in ``operand_orders`` give a layout whose launches equal
    ``numpy.einsum``. For the (T) terms whose ovvv holds two virtual indices adjacent in W (in
    either order) one GEMM dimension is that pair, v² where the operands as stored give v at most."""
    rng = np.random.default_rng(sum(map(ord, c + a + b)))
    out, x, y = _operands(c, a, b, sizes, rng, "contiguous")
    oa, ob = batchedgemm.operand_orders(c, a, b)
    assert sorted(oa) == sorted(a) and sorted(ob) == sorted(b)
    x2 = np.ascontiguousarray(x.transpose([a.index(i) for i in oa]))
    y2 = np.ascontiguousarray(y.transpose([b.index(i) for i in ob]))
    copied = batchedgemm.plan(c, oa, ob, sizes, (_strides(out, c), _strides(x2, oa), _strides(y2, ob)), min_side=1)
    assert copied is not None
    pair = {x for x in a if x in "abc"}
    if "f" in a and "".join(sorted(pair)) in ("ab", "bc"):
        assert math.prod(sizes[x] for x in pair) in (copied.out.rows, copied.out.cols)
        stored = batchedgemm.plan(c, a, b, sizes, (_strides(out, c), _strides(x, a), _strides(y, b)), min_side=1)
        assert stored is None or stored.out.rows * stored.out.cols < copied.out.rows * copied.out.cols
    expect = np.einsum(f"{a},{b}->{c}", x, y) + out
    run(copied, out, x2, y2)
    assert np.max(np.abs(out - expect)) <= 1e-12 * np.max(np.abs(expect))


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_the_addresses_kernel_adds_each_rows_base(tmp_path):
    """:data:`batchedgemm.ADDRESSES` emulated (two blocks for 3·300 addresses, each thread walking
    on a grid apart): row r of the byte offsets plus base r, for addresses above 2^32."""
    rng = np.random.default_rng(2)
    table = rng.integers(0, 2**40, (3, 300), dtype=np.int64)
    base = (2**45 + 8, 3 * 2**45, 5 * 2**45 + 16)
    at = np.zeros_like(table)
    got = emulated(tmp_path, batchedgemm.ADDRESSES, "chainexec_addresses", [at, table], [0, 0], 2,
                   ("300", *map(str, base)))
    assert np.array_equal(got, table + np.array(base, np.int64)[:, None])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_the_addresses_kernel_compiles_with_nvcc(tmp_path):
    compiles_with_nvcc(tmp_path, [batchedgemm.ADDRESSES])
