"""The TCCG bench's CPU-side helpers (the bench itself needs a GPU: ``docs/kernels.md``)."""

import math

import pytest

from chainexec.bench import worst


@pytest.mark.parametrize("errors,expected", [((1e-15, 3e-15, 2e-15), 3e-15), ((4e-16,), 4e-16)])
def test_worst_error_is_the_largest(errors, expected):
    assert worst(*errors) == expected


@pytest.mark.parametrize("errors", [(1e-15, math.nan), (math.nan, 1e-15), (2e-15, math.nan, 1e-15)])
def test_an_unwritten_element_is_never_hidden(errors):
    """A NaN-poisoned output that a method left partly unwritten gives a NaN error; combined with
    the other methods' finite errors, in any order, the case still fails (Python's ``max`` would
    keep a finite value met before the NaN)."""
    assert math.isnan(worst(*errors))
