"""Launches of the generated point-wise kernels (:mod:`chainexec.runtime.pointwise`), on any
machine: with a stand-in for the kernel cache whose kernels record their launches, each launch
passes on the source and grid of its family's generator (:mod:`chainexec.kernels`), made once
per process, compiled with the point-wise options;
on a GPU the preparations are logged and a later process makes them from the log. The kernels'
numbers are checked on a GPU in test_pointwise_gpu.py."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from chainexec.kernels import elementwise, strided
from chainexec.runtime import kernelcache, pointwise
from tests.kernels.emulation import CASES, element_strides, emulated, gathered_shape, views
from tests.kernels.test_orbits import ENERGY_CODE, PERMS3


@pytest.fixture
def launches(monkeypatch) -> list:
    """The launches of kernels from the kernel cache, recorded instead of run: (source, name,
    grid, block, arguments, compiler options) each, and the dynamic shared memory (bytes) where a
    launch passes some, which the function must have been opted into first."""
    made = []

    class Function:
        def __init__(self, name, source, options):
            self.name, self.source, self.options = name, source, options
            self.max_dynamic_shared_size_bytes = 48 * 1024

        def __call__(self, grid, block, args, shared_mem=None):
            launch = (self.source, self.name, grid, block, len(args), self.options)
            if shared_mem is not None:
                assert shared_mem <= self.max_dynamic_shared_size_bytes
                launch += (shared_mem,)
            made.append(launch)

    def function(name, source, options):
        return Function(name, source, options), "key"

    monkeypatch.setattr(kernelcache, "function", function)
    return made


class _Recording:
    """An array module without CUDA (NumPy's allocations): what :func:`pointwise.launch` and
    :func:`pointwise.reduce` allocate their partial sums with."""

    def __init__(self):
        self.empty, self.zeros, self.float64, self.uint32 = np.empty, np.zeros, np.float64, np.uint32


@pytest.mark.parametrize("case", CASES)
def test_launches_use_the_source_and_grid_of_their_staging(case, launches):
    """The kernel text and grid a launch and a reduction pass on are :func:`elementwise.source` /
    :func:`elementwise.reduce_source` and :func:`elementwise.blocks` of the reduced layout, staged or
    not, the same on a second call (made once per process); a reduction's partial sums are then
    added by :func:`pointwise.total`."""
    out, inputs = views(case)
    types = tuple(a.dtype.name for a in inputs) + (out.dtype.name,)
    shape, reduced = elementwise.layout(out.shape, [element_strides(out)] + [element_strides(a) for a in inputs])
    grid = elementwise.blocks(shape, elementwise.staging(shape, reduced, types))
    code = " + ".join(f"p{k}" for k in range(len(inputs)))
    xp = _Recording()
    for _ in range(2):
        pointwise.launch(xp, "y + " + code, inputs, out)
    text = elementwise.source("y + " + code, shape, reduced, types)
    options = kernelcache.POINTWISE_OPTIONS
    assert launches == [(text, "chainexec_pointwise", (grid,), (elementwise.BLOCK,), 1 + len(inputs), options)] * 2
    walk = tuple(int(np.prod(out.shape[d + 1:])) for d in range(out.ndim))
    shape, reduced = elementwise.layout(out.shape, [walk] + [element_strides(a) for a in inputs])
    scalar = np.zeros((), np.float32)  # a fused statement's scalar output: the total adds to it
    pointwise.reduce(xp, code, inputs, out.shape, scalar)
    grid = elementwise.blocks(shape, elementwise.staging(shape, reduced, types[:-1] + ("float64",)))
    assert launches[-2:] == [(elementwise.reduce_source(code, shape, reduced, types[:-1] + ("float64",)),
                              "chainexec_reduce", (grid,), (elementwise.BLOCK,), 1 + len(inputs), options),
                             (elementwise.total_source("float32"), "chainexec_total", (1,), (elementwise.BLOCK,), 3,
                              options)]


class _OnGpu(_Recording):
    """:class:`_Recording` as a GPU's array module (it has ``cuda``): its preparations are logged."""

    cuda = None

    def __init__(self):
        super().__init__()
        self.asarray, self.int32 = np.asarray, np.int32


def test_preparations_are_logged_once_and_made_again_from_the_log(tmp_path, monkeypatch, launches):
    """A point-wise launch, a reduction, a symmetrization and an orbit reduction on a GPU log
    their preparations (:func:`pointwise._ready`) once per process, however often they run. A
    later process that makes them from the log (:func:`warmup.prepare`, as the backend's
    selection does while the warm-up loads) finds them made at its launches, which pass on the
    same kernels; entries it cannot make are skipped."""
    from chainexec.runtime import uselog, warmup

    monkeypatch.setattr(uselog, "_PENDING", {})
    monkeypatch.setattr(uselog, "_JOB", "/runs/t.yaml")
    monkeypatch.setattr(uselog, "device_name", lambda xp, device=None: "H100")
    monkeypatch.setattr(uselog, "path", lambda: tmp_path / "uses.json")
    rng = np.random.default_rng(5)
    z = rng.standard_normal((2, 9, 9, 9))
    e = rng.standard_normal(9)

    def run(xp):
        launches.clear()
        out = rng.standard_normal((2, 9, 9, 9))
        pointwise.launch(xp, "y + p0", [z], out)
        pointwise.reduce(xp, "p0 * p0", [z], z.shape, np.zeros(()))
        pointwise.symmetrize(xp, out, [(0, 1, 2, 3), (0, 2, 1, 3)])
        pointwise.orbit_reduce(xp, ["p0 + p1"], ENERGY_CODE.replace("p2", "p1"), [(0, p) for p in PERMS3],
                               [z, e[None, None, :, None]], z.shape, "float64", np.zeros(()))
        return [(text, name, grid) for text, name, grid, *_ in launches]

    def clear():
        for make in pointwise.PREPARED.values():
            make.cache_clear()

    clear()
    first = run(_OnGpu())
    run(_OnGpu())
    uselog.flush()
    logged = uselog.uses("H100", "/runs/t.yaml")["prepared"]
    assert sorted(name for name, _ in logged) == ["_orbit_prepared", "_prepared", "_prepared", "_symmetrize_prepared"]
    clear()
    uselog.note("H100", "prepared", ("os.system", "[]"))
    uselog.note("H100", "prepared", ("_prepared", "not json"))
    uselog.note("H100", "prepared", ("_symmetrize_prepared", "[1, 2]"))
    uselog.flush()
    warmup.prepare("H100", "/runs/t.yaml")
    assert [make.cache_info().currsize for make in pointwise.PREPARED.values()] == [2, 1, 1]
    misses = [make.cache_info().misses for make in pointwise.PREPARED.values()]
    assert run(_OnGpu()) == first
    assert [make.cache_info().misses for make in pointwise.PREPARED.values()] == misses
    with pytest.raises(ValueError, match="no preparation"):
        pointwise.prepare("os.system", "[]")


def test_an_ordered_reduction_is_one_orbit_kernel_per_tile_shape(launches, tmp_path):
    """The (T) energy's fused statement on the CuPy backend, on a 2×2×2 occupied tile, with the
    groups the executor hands it for each pattern of equal tile positions (every symmetric index
    in a group, :meth:`Frame.equal_tiles`): one orbit kernel for all four patterns (the weights
    span the same dimensions), each launch followed by the last step adding the sum to the
    statement's scalar output (:func:`elementwise.total_source` of its dtype)."""
    import types

    from chainexec import api, ordering
    from chainexec.planner.plan import ops
    from chainexec.runtime.backends.cupy import CupyBackend
    from tests.conftest import triples_config

    plan = api.plan(triples_config(tmp_path, "128KiB", nocc=7, nvir=6))
    f = next(op.expression for nest in plan.nests for op, _ in ops(nest.body) if op.ordered and op.expression)
    xp = types.ModuleType("numpy_without_cuda")  # hashable, as CuPy is, and without ``cuda``: nothing logged
    xp.__dict__.update({k: getattr(np, k) for k in dir(np) if not k.startswith("_")})
    rng = np.random.default_rng(18)
    tile = {i: 2 if i in "ijk" else n for i, n in plan.extents.items()}
    arrays = {r: rng.standard_normal([tile[i] for i in r.indices]) for r in f.leaves}
    out = np.zeros(())
    shared = set()
    for positions in [(0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 1, 2)]:
        within = ordering.dims(ordering.groups(list("ijk"), ordering.pattern_of(list(positions)), ones=True), f.domain)
        shape = tuple(tile[i] for i in f.domain)
        CupyBackend.fused(types.SimpleNamespace(xp=xp, _fused_call=CupyBackend._fused_call), f, arrays, shape, out,
                          within)
        lets, code, reads, views, *_, skip = CupyBackend._fused_call(f, arrays, shape, out, within, xp)[1]
        shared.add(pointwise._orbit_made(xp, lets, code, reads, views, shape, "float64", skip)[0].shared)
    assert [name for _, name, *_ in launches] == ["chainexec_orbits", "chainexec_total"] * 4
    assert {launch[-1] for launch in launches[::2]} == shared  # each orbit launch passes its plan's shared memory
    assert len({text for text, name, *_ in launches if name == "chainexec_orbits"}) == 1
    assert {text for text, name, *_ in launches if name == "chainexec_total"} == {elementwise.total_source("float64")}


@pytest.fixture
def calls(monkeypatch) -> list:
    """Kernel launches recorded with their arguments instead of run: (source, name, blocks, arguments)."""
    made = []

    def function(name, source, options):
        return (lambda grid, block, args: made.append((source, name, grid[0], args))), "key"

    monkeypatch.setattr(kernelcache, "function", function)
    return made


def _root(a: np.ndarray) -> np.ndarray:
    while a.base is not None:
        a = a.base
    return a


def _within(buffer: np.ndarray, view: np.ndarray) -> np.ndarray:
    """``view``'s place in a copy ``buffer`` of its whole buffer."""
    offset = view.__array_interface__["data"][0] - _root(view).ctypes.data
    return np.ndarray(view.shape, view.dtype, buffer, offset, view.strides)


def _emulated_call(tmp_path, call) -> np.ndarray:
    """A recorded launch of a tile operation run on the CPU (:func:`emulated`): its arrays passed
    as their whole buffers at their offsets, its numbers as C literals; the output's whole buffer
    as the kernel left it."""
    text, name, grid, args = call
    arrays = [a for a in args if isinstance(a, np.ndarray)]
    numbers = args[len(arrays):]
    roots = [_root(a) for a in arrays]
    offsets = [(a.__array_interface__["data"][0] - r.ctypes.data) // a.itemsize for a, r in zip(arrays, roots)]
    literals = [float(v).hex() if isinstance(v, np.floating) else str(int(v)) for v in numbers]
    return emulated(tmp_path, text, name, [r.copy() for r in roots], offsets, grid, tuple(literals))


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")


@needs_gxx
@pytest.mark.parametrize("case", CASES)
def test_a_tile_addition_launches_the_generic_kernel_numpy_agrees_with(case, calls, tmp_path):
    """``out += f·x`` (:func:`pointwise.assign`) over each kind of view (a window of a larger
    buffer, permuted, broadcast, extent one): one launch of the add kernel of the merged
    dimensions' module, whose emulation writes ``out + f·x`` exactly where NumPy has it and leaves
    the rest of out's buffer as it was."""
    out, inputs = views(case)
    x = inputs[-1] if case == "cut" else inputs[0]
    pointwise.assign(_Recording(), out, x, -0.75, add=True)
    [(text, name, grid, args)] = calls
    dims = len(elementwise.layout(out.shape, [element_strides(out), element_strides(x)])[0])
    assert name == "chainexec_strided_add" and text == strided.strided_source(dims, "float64", "int")
    assert grid == strided.grid(out.size) and args[2] == np.float64(-0.75) and len(args) == 3 + 3 * dims
    got = _emulated_call(tmp_path, calls[0])
    expected = _root(out).copy()
    _within(expected, out)[...] += -0.75 * x
    assert np.array_equal(got, expected)


@needs_gxx
@pytest.mark.parametrize("case,factor,add,code", [("permuted", 1.0, True, "y + p0"), ("cut", -1.0, False, "-p0"),
                                                  ("broadcast", 1.0, False, "p0")])
def test_a_large_copy_or_addition_by_one_launches_the_kernel_of_its_shape(case, factor, add, code, calls, tmp_path,
                                                                          monkeypatch):
    """From :data:`pointwise.SHAPED_BYTES` (here every size), ``out (+)= ±x`` runs on the
    point-wise kernel of its shape (:func:`elementwise.source`), whose emulation writes what NumPy
    has exactly where it has it."""
    monkeypatch.setattr(pointwise, "SHAPED_BYTES", 0)
    out, inputs = views(case)
    x = inputs[-1] if case == "cut" else inputs[0]
    pointwise.assign(_Recording(), out, x, factor, add)
    [(text, name, grid, args)] = calls
    shape, reduced = elementwise.layout(out.shape, [element_strides(out), element_strides(x)])
    assert name == "chainexec_pointwise" and text == elementwise.source(code, shape, reduced, ("float64",) * 2)
    expected = _root(out).copy()
    _within(expected, out)[...] = (out if add else 0.0) + factor * x
    assert np.array_equal(_emulated_call(tmp_path, calls[0]), expected)


def test_a_large_scaled_or_overlapping_assignment_keeps_the_generic_kernel(calls, monkeypatch):
    """A factor other than ±1 (its rounding is the generic kernel's) and an input sharing memory
    with the output (read while written) keep the shape-generic kernels at any size."""
    monkeypatch.setattr(pointwise, "SHAPED_BYTES", 0)
    out, inputs = views("permuted")
    pointwise.assign(_Recording(), out, inputs[0], 0.5)
    pointwise.assign(_Recording(), out, out, 1.0, add=True)
    pointwise.assign(_Recording(), out[:, :2], out[:, 1:3], -1.0)
    assert [name for _, name, _, _ in calls] == ["chainexec_strided_set", "chainexec_strided_add", "chainexec_strided_set"]


@needs_gxx
def test_a_scaled_copy_a_fill_and_a_scalar_launch_the_generic_kernels_numpy_agrees_with(calls, tmp_path):
    """A stacked operand's scaled copy from a permuted view (set), a clear of a window with gaps
    by a value other than zero (fill), and a 0-d copy: each the kernel of its operation, emulated
    equal to NumPy."""
    out, inputs = views("permuted")
    pointwise.assign(_Recording(), out, inputs[0], 0.5)
    assert np.array_equal(_emulated_call(tmp_path, calls[-1]), 0.5 * inputs[0])
    window, _ = views("cut")
    pointwise.fill(_Recording(), window, 3.0)
    expected = _root(window).copy()
    _within(expected, window)[...] = 3.0
    assert calls[-1][1] == "chainexec_strided_fill" and np.array_equal(_emulated_call(tmp_path, calls[-1]), expected)
    scalar = np.zeros(())
    pointwise.assign(_Recording(), scalar, np.array(2.25), 2.0)
    assert calls[-1][0] == strided.strided_source(0, "float64", "int")
    assert _emulated_call(tmp_path, calls[-1]) == 4.5


@pytest.mark.parametrize("shaped", [1 << 60, 0], ids=["small", "large"])
def test_an_input_that_does_not_broadcast_dimension_by_dimension_or_of_another_dtype_is_refused(calls, shaped,
                                                                                                 monkeypatch):
    """Refused before any launch, also where a copy of that size would take the kernel of its shape
    (:data:`pointwise.SHAPED_BYTES`)."""
    monkeypatch.setattr(pointwise, "SHAPED_BYTES", shaped)
    with pytest.raises(ValueError, match="do not broadcast"):
        pointwise.assign(_Recording(), np.zeros((3, 4)), np.zeros(4), 1.0)
    with pytest.raises(ValueError, match="do not broadcast"):
        pointwise.assign(_Recording(), np.zeros((3, 4)), np.zeros((3, 2)), 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        pointwise.assign(_Recording(), np.zeros((3, 4), np.float32), np.zeros((3, 4)), 1.0)
    pointwise.assign(_Recording(), np.zeros((0, 4)), np.zeros((0, 4)), 1.0)  # nothing to do
    assert calls == []


@needs_gxx
def test_a_tile_operation_reads_a_view_with_negative_strides(calls, tmp_path):
    source = np.random.default_rng(3).standard_normal((6, 5, 4))
    x = source[::-1, :, ::-2]
    out = np.ones((6, 5, 2))
    pointwise.assign(_Recording(), out, x, 2.0, add=True)
    assert any(v < 0 for v in calls[-1][3][3:]) and np.array_equal(_emulated_call(tmp_path, calls[-1]), 1.0 + 2.0 * x)


@needs_gxx
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "added"])
@pytest.mark.parametrize("positions, a_shape, before, axis, after", [
    (("unpack", 10, 4, 7, 1, 6), (18, 3), (1, 0), 1, (2, 0, 1)),
    (("unpack", 0, 0, 5, 0, 5), (15, 2, 3), None, 0, None),
    (("pack", 12, 36, 4, 0, 8), (4, 8, 2), None, 0, (1, 0)),
    (("pack", 3, 10, 2, 0, 4), (3, 2, 4), (1, 0, 2), 1, None)],
    ids=["unpack-permuted", "unpack-diagonal", "pack-permuted", "pack-member-axes-last"])
def test_the_cupy_backends_gather_launches_what_numpy_takes(positions, a_shape, before, axis, after, fresh, calls,
                                                            tmp_path):
    """The CuPy backend's gather (:func:`pointwise.gather`: one launch of the pair kernel, no
    table of positions) writes, emulated, what the NumPy backend's ``take`` at its table of
    positions writes: the axes put in order before and after, the factor, added or fresh."""
    from chainexec.runtime.backends.numpy import NumpyBackend

    rng = np.random.default_rng(len(calls) + sum(a_shape))
    a = rng.standard_normal(a_shape)
    ref = NumpyBackend()
    shape = gathered_shape(a.shape, before, axis, positions, after)
    out = rng.standard_normal(shape)
    expected = out.copy()
    ref.gather(expected, a, before, axis, positions, after, -0.5, fresh)
    pointwise.gather(_Recording(), out, a if before is None else a.transpose(before), axis, positions, after, -0.5,
                     not fresh)
    [(text, name, grid, args)] = calls
    assert name == f"chainexec_{positions[0]}_{'set' if fresh else 'add'}"
    assert np.array_equal(_emulated_call(tmp_path, calls[0]), expected)


@pytest.mark.parametrize("positions, a_shape, out_shape", [
    (("unpack", 0, 0, 4, 0, 4), (5, 3), (4, 4, 3)),  # pairs 0..9 asked of 5
    (("unpack", 3, 1, 4, 0, 4), (7, 3), (3, 4, 3)),  # pair (1, 0) = 1 lies before the first, 3
    (("pack", 3, 10, 3, 0, 4), (1, 4, 2), (7, 2)),  # pairs of row 2 asked of rows from 3
    (("pack", 0, 10, 0, 0, 3), (4, 3, 2), (10, 2))])  # member column 3 asked of 3 columns
def test_a_gather_that_would_read_past_its_operand_is_refused_before_a_launch(positions, a_shape, out_shape, calls):
    """The pair kernels read unchecked: :func:`pointwise.gather` refuses positions that lie
    outside the operand (a ValueError, nothing launched), where NumPy's ``take`` would raise."""
    with pytest.raises(ValueError, match="reads past"):
        pointwise.gather(_Recording(), np.zeros(out_shape), np.zeros(a_shape), 0, positions, None, 1.0, False)
    assert calls == []
