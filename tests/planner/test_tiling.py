"""Single-contraction tiling (multi-level paper, section 4): each scheme respects the memory
limit with real element sizes, `fits` moves every array once, and eq. 4.9's rule."""

from __future__ import annotations

import json
import math

import pytest

from chainexec import spec
from chainexec.planner.build import contractions
from chainexec.planner.machine import Machine
from chainexec.planner.nest import DeviceGroup, DiskGroup, Schedule
from chainexec.planner.schedule import Context
from chainexec.planner.tiling import composites, equal_tiles_win, footprint, scheme_tiles, spread
from tests.conftest import TCCG

CASES = json.loads(TCCG.read_text())


def binary(case, dtype="float64"):
    text = f"""
indices: {json.dumps(case['sizes'])}
tensors:
  A: {{indices: [{', '.join(case['A'])}], dtype: {dtype}, source: {{random: 1}}}}
  B: {{indices: [{', '.join(case['B'])}], dtype: {dtype}, source: {{random: 2}}}}
statements:
  - C[{','.join(case['C'])}] = A[{','.join(case['A'])}] * B[{','.join(case['B'])}]
outputs:
  C: {{file: c.h5, dataset: C}}
machine: {{global_memory: 8MiB, device_memory: 512KiB}}
"""
    s = spec.loads(text, "/tmp/tccg.yaml")
    cs, tensors, _ = contractions(s)
    return s, cs[0], tensors


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['id']}-{c['name']}")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_schemes_fit_every_tccg_case(case, dtype):
    s, c, tensors = binary(case, dtype)
    item = tensors["C"].itemsize
    for budget in (8 << 20, 512 << 10, 64 << 10):
        for scheme in ("fits", "streaming", "equal", "greedy"):
            found = scheme_tiles(c, s.extents, item, budget, scheme)
            if found is None:
                assert scheme == "fits"
                continue
            tiles, resident = found
            whole = {role: math.prod(s.extents[i] for i in ix) for role, ix, name in
                     (("a", c.a_indices, c.a), ("b", c.b_indices, c.b)) if name in resident}
            assert footprint(c, tiles, item, whole) <= budget
            assert all(1 <= tiles[i] <= s.extents[i] for i in c.indices())


@pytest.mark.parametrize("case", CASES[:11], ids=lambda c: f"{c['id']}-{c['name']}")
def test_fits_moves_every_array_once(case):
    s, c, tensors = binary(case)
    ctx = Context([c], tensors, s.extents, {"global": 16 << 20, "device": 256 << 10}, Machine())
    found = scheme_tiles(c, s.extents, 8, 16 << 20, "fits")
    if found is None:
        pytest.skip("no array fits the global level")
    tiles, resident = found
    dev = scheme_tiles(c, tiles, 8, 256 << 10, "greedy")[0]
    moved = ctx.price(Schedule([DiskGroup([DeviceGroup([c.id], tiles, dev, resident)])]))["bytes"]
    sizes = {t: math.prod(tensors[t].shape) * 8 for t in ("A", "B", "C")}
    assert moved["disk->global"] == sizes["A"] + sizes["B"]
    assert moved["global->disk"] == sizes["C"]


def test_composites_and_spread():
    _, c, _ = binary({"sizes": {"a": 4, "b": 5, "c": 6, "d": 7}, "C": "abc", "A": "dca", "B": "bd"})
    assert composites(c) == {"i": ["a", "c"], "j": ["b"], "k": ["d"]}
    assert spread(["a", "c"], {"a": 4, "c": 6}, 12) == {"a": 4, "c": 3}
    assert spread(["a", "c"], {"a": 4, "c": 6}, 0.5) == {"a": 1, "c": 1}


@pytest.mark.parametrize("m, ratio, expected", [(100, 10, True), (81, 10, False), (9, 1, True), (4, 1, False)])
def test_equal_tiles_rule(m, ratio, expected):
    # √Mβ ≥ (√3 − 1)·Λαβ/Λβγ + √3: √Mβ ≥ 9.05 for Λαβ/Λβγ = 10, √Mβ ≥ 2.46 for a ratio of 1.
    assert equal_tiles_win(m, ratio * 1e-9, 1e-9) is expected
