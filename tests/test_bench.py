"""The TCCG bench's CPU-side helpers (the bench itself needs a GPU: ``docs/kernels.md``)."""

import math

import numpy as np
import pytest

from chainexec.bench import _contiguous, _in_layout, summary, worst


@pytest.mark.parametrize("errors,expected", [((1e-15, 3e-15, 2e-15), 3e-15), ((4e-16,), 4e-16)])
def test_worst_error_is_the_largest(errors, expected):
    assert worst(*errors) == expected


@pytest.mark.parametrize("errors", [(1e-15, math.nan), (math.nan, 1e-15), (2e-15, math.nan, 1e-15)])
def test_an_unwritten_element_is_never_hidden(errors):
    """A NaN-poisoned output that a method left partly unwritten gives a NaN error; combined with
    the other methods' finite errors, in any order, the case still fails (Python's ``max`` would
    keep a finite value met before the NaN)."""
    assert math.isnan(worst(*errors))


def test_results_are_timed_in_the_output_layout():
    """A product handed back as a permuted view is copied into its index order (the values kept);
    one already in that order is used as is, with no copy."""
    rng = np.random.default_rng(5)
    product = rng.standard_normal((3, 4, 5))
    view = product.transpose(2, 0, 1)
    assert not _contiguous(view)
    laid = _in_layout(view)
    assert _contiguous(laid) and laid.shape == view.shape and np.array_equal(laid, view)
    assert _in_layout(product) is product


def test_summary_geomean_per_scale_and_group():
    rows = [{"id": 1, "scale": 1, "group": "ml", "ratio_vs_best_library": 2.0},
            {"id": 2, "scale": 1, "group": "ml", "ratio_vs_best_library": 0.5},
            {"id": 3, "scale": 1, "group": "ccsd_t", "ratio_vs_best_library": 1.5},
            {"id": 3, "scale": 2, "group": "ccsd_t", "ratio_vs_best_library": 3.0},
            {"id": 4, "scale": 1, "group": "ccsd", "skipped": "too large"}]
    s = summary(rows)
    assert set(s) == {"1", "2"}
    assert s["1"]["ml"] == {"cases": 2, "geomean": pytest.approx(1.0), "min": 0.5, "below_1": [2]}
    assert s["1"]["all"]["geomean"] == pytest.approx(1.5 ** (1 / 3))
    assert s["1"]["all"]["below_1"] == [2] and "ccsd" not in s["1"]
    assert s["2"]["all"] == {"cases": 1, "geomean": pytest.approx(3.0), "min": 3.0, "below_1": []}
