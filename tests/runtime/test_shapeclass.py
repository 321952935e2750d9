"""Shapes of one class (:mod:`chainexec.runtime.backends.shapeclass`): what a class shares, and
which decided shape is a shape's nearest classmate."""

from __future__ import annotations

import numpy as np
import pytest

from chainexec.runtime.backends import shapeclass


def _views(*arrays_and_indices):
    """(indices, shape, element strides) of each (array, indices)."""
    return [(list(ix), x.shape, tuple(s // x.itemsize for s in x.strides)) for x, ix in arrays_and_indices]


def _tile(*shape, order="C"):
    return np.empty(shape, order=order)


@pytest.mark.parametrize("other,same", [
    ((6, 6, 3, 93), True),      # a (T) tile cut at the occupied range's end
    ((3, 3, 3, 88), True),      # another molecule's
    ((6, 6, 1, 93), False),     # an extent of one: a dimension less to lay out
    ((6, 6, 6, 93, "F"), False),  # another stride order
])
def test_a_class_shares_indices_stride_order_and_unit_extents(other, same):
    """Two tiles' signatures agree where only their extents differ (above one); an extent of one
    or another stride order makes another class; so does another dtype or kind."""
    *shape, order = other if isinstance(other[-1], str) else (*other, "C")
    ours = shapeclass.signature(_views((_tile(6, 6, 6, 93), "ijka")), "float64", "one")
    theirs = shapeclass.signature(_views((_tile(*shape, order=order), "ijka")), "float64", "one")
    assert (ours == theirs) is same
    assert ours != shapeclass.signature(_views((_tile(6, 6, 6, 93), "ijka")), "float32", "one")
    assert ours != shapeclass.signature(_views((_tile(6, 6, 6, 93), "ijka")), "float64", "run sum")


def test_extents_take_the_broadcast_index_from_the_view_that_has_it():
    views = [(["i", "a"], (1, 7), (0, 1)), (["i", "j"], (4, 5), (5, 1))]
    assert shapeclass.extents(views) == {"i": 4, "a": 7, "j": 5}


@pytest.mark.parametrize("here,want", [
    ({"i": 6, "a": 93}, "gett"),       # the same shape
    ({"i": 3, "a": 93}, "gett"),       # ratio 2 on i: still near the first
    ({"i": 5, "a": 190}, "batched"),   # nearer the second (log distance)
    ({"i": 13, "a": 93}, None),        # beyond the ratio of both
    ({"i": 6}, None),                  # other indices
])
def test_the_nearest_decided_shape_within_the_ratio(here, want):
    decided = [({"i": 6, "a": 93}, "gett"), ({"i": 4, "a": 186}, "batched")]
    assert shapeclass.nearest(decided, here) == want
    assert shapeclass.near({"i": 6}, {"i": 12}) and not shapeclass.near({"i": 6}, {"i": 13})
