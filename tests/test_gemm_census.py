"""``benchmarks/gemm_census.py``'s bookkeeping (the census and the timings need a GPU)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "gemm_census", Path(__file__).resolve().parents[1] / "benchmarks" / "gemm_census.py")
census = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(census)


def test_summarize_counts_calls_per_shape_longest_first():
    big = ("strided", 0, 1, 800, 400, 424, 1600, 0, 320000, 400, 800, 640000, 800)
    small = ("pointers", 1, 0, 64, 64, 16, 16, 0, 16, 0, 64, 0, 3)
    rows = census.summarize([(small, 0.5), (big, 2.0), (big, 3.0)])
    assert [r["kind"] for r in rows] == ["strided", "pointers"]
    assert rows[0]["calls"] == 2 and rows[0]["ms"] == 5.0
    assert rows[0]["tflops"] == round(2.0 * 800 * 400 * 424 * 800 * 2 / 5.0 / 1e9, 2)
    assert rows[1] == dict(zip(census.FIELDS, small)) | {"calls": 1, "ms": 0.5, "tflops": round(
        2.0 * 64 * 64 * 16 * 3 / 0.5 / 1e9, 2)}


@pytest.mark.parametrize("ta,tb", [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("interleaved", [False, True], ids=["end-to-end", "batch-inside-columns"])
def test_spans_reach_every_element_a_batched_gemm_reads_and_writes(ta, tb, interleaved):
    """A batched GEMM over column-major views of flat arrays of :func:`spans`' lengths, done with
    NumPy element by element of its strides, touches the last element of each and nothing past:
    the lengths are exact. Interleaved: the batch index lies inside the operands' columns (A's
    matrices overlapping, as a broadcast operand's may) and inside C's rows (its matrices side by
    side in each column), as a W stack's tile gives."""
    m, n, k, count = 5, 3, 4, 3
    a_rows, a_cols = (m, k) if ta == 0 else (k, m)
    b_rows, b_cols = (k, n) if tb == 0 else (n, k)
    lda, ldb = a_rows + 1, b_rows + 2
    ldc = m * count if interleaved else m
    strides = (lda * 2, ldb, m) if interleaved else (0, 0, 0)
    row = dict(zip(census.FIELDS, ("strided", ta, tb, m, n, k, lda, strides[0], ldb, strides[1], ldc, strides[2],
                                   count)))
    sa, sb, sc, span_a, span_b, span_c = census.spans(row)
    assert (sa, sb, sc) == ((lda * 2, ldb, m) if interleaved else (lda * a_cols, ldb * b_cols, ldc * n))
    for span, stride, ld, rows_, cols in ((span_a, sa, lda, a_rows, a_cols), (span_b, sb, ldb, b_rows, b_cols),
                                          (span_c, sc, ldc, m, n)):
        touched = np.zeros(span + 1, bool)
        for g in range(count):
            for j in range(cols):
                touched[g * stride + j * ld: g * stride + j * ld + rows_] = True
        assert touched[span - 1] and not touched[span]


def test_errors_compare_what_each_call_adds_with_the_first_and_restore_the_output():
    """Three ways of adding a product to ``out``: the same product summed in another order is
    within rounding, a transposed one is not; ``out`` holds its values again afterwards."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((7, 5)), rng.standard_normal((5, 6))
    out = rng.standard_normal((7, 6))
    kept = out.copy()

    def product():
        out[...] += a @ b

    def reordered():
        out[...] += np.einsum("ik,kj->ij", a[:, ::-1], b[::-1])

    def wrong():
        out[...] += (b.T @ a.T).T[:, ::-1]

    errors = census._errors([product, reordered, wrong], out)
    assert errors[0] <= 1e-14 and errors[1] > 0.1
    assert np.array_equal(out, kept)
