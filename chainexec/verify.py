"""Independent check of a finished output: NumPy einsum on the whole chain, or sampled explicit sums.

Shares no code with the planner or the runtime: it reads the config (spec) and the HDF5 files
directly and evaluates the statements as written. When everything fits in memory (``limit`` bytes)
each statement is one ``numpy.einsum`` call; otherwise ``samples`` random output elements are
computed from the inputs alone, every intermediate expanded into the products that define it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from dataclasses import dataclass

import h5py
import numpy as np

from chainexec import datafiles, expr, generator, safepaths
from chainexec.errors import ChainexecError
from chainexec.runtime.store import COMPLETE
from chainexec.spec import DTYPES, Ref, Spec

TOLERANCE = {"float64": 1e-12, "float32": 1e-5}
ROUNDING_ULPS = 64
"""Units of rounding (of the dtype, relative to the size of the terms an element sums) that an
output's error may reach whatever its value: what summing terms in another order costs."""


@dataclass
class Check:
    tensor: str
    method: str
    relative_error: float
    tolerance: float
    elements: int

    @property
    def ok(self) -> bool:
        return self.relative_error <= self.tolerance


def _input(spec: Spec, name: str, region=None) -> np.ndarray:
    t = spec.tensors[name]
    shape = spec.shape(name)
    region = region or tuple((0, n) for n in shape)
    if t.source.random is not None:
        return generator.block(t.source.random, shape, region, t.dtype, spec.dense_symmetry(name))
    if t.source.expr is not None:
        tree = expr.parse(t.source.expr)
        at = dict(zip(t.indices, region))
        arrays = {r: _input(spec, r.tensor, tuple(at[i] for i in r.indices)) for r in expr.refs(tree)}
        return np.broadcast_to(expr.evaluate(tree, arrays, t.indices, np), tuple(b - a for a, b in region))
    if t.source.compute is not None:  # the registered source's values, as the run's inputs are
        from chainexec import sources

        made = sources.lookup(t.source.compute)(**dict(t.source.parameters),
                                                layout="s1" if t.layout == "dense" else t.layout)
        values = made.values((0, made.shape[0]))
        full = values if t.layout == "dense" else dense(values, t.layout, shape)
        return full.reshape(shape)[tuple(slice(a, b) for a, b in region)]
    path = _input_path(spec, name)
    try:
        with h5py.File(path, "r") as f:
            ds = _input_dataset(spec, name, f, path)
            if t.layout != "dense":  # read whole, unpacked here
                return dense(ds[()], t.layout, shape, tuple(slice(a, b) for a, b in region))
            return ds[tuple(slice(a, b) for a, b in region)]
    except (OSError, KeyError, RuntimeError) as err:
        refusal = datafiles.lock_refusal(err) if isinstance(err, OSError) else None
        raise ChainexecError(refusal or f"cannot read dataset {t.source.dataset!r} ({err})", path) from None


def _input_path(spec: Spec, name: str) -> str:
    """The file of input ``name``, a regular file whose dataset's values all lie where it says."""
    t = spec.tensors[name]
    path = safepaths.checked(spec.resolve(t.source.file), f"the input of tensor {name}")
    datafiles.check_regular(path, f"input of tensor {name}")
    _sources_there(path, t.source.dataset, f"input of tensor {name}")
    return path


_CHECKED: set[tuple] = set()
"""The input datasets whose storage :func:`_input_dataset` has found written, each by its file's
path, dataset, and the file's device, inode, size and modification time (a file changed since
is checked again)."""


def _input_dataset(spec: Spec, name: str, f: h5py.File, path: str) -> h5py.Dataset:
    """Input ``name``'s dataset in its open file ``f`` (at ``path``): there, written, and of the
    tensor's dtype and stored shape, else a ChainexecError naming ``path``."""
    t = spec.tensors[name]
    ds = datafiles.find(f, t.source.dataset, path)
    if not isinstance(ds, h5py.Dataset):
        raise ChainexecError(f"no dataset {t.source.dataset!r} (input of tensor {name})", path)
    st = os.stat(path)
    checked = (path, t.source.dataset, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if checked not in _CHECKED:  # a sampled check reads an input region by region
        datafiles.check_written(ds, path, f"input of tensor {name}")
        if ds.is_virtual:
            datafiles.check_virtual(ds, path, f"input of tensor {name}")
        _CHECKED.add(checked)
    stored = _stored(t.layout, spec.shape(name))
    if ds.shape != stored or ds.dtype != np.dtype(t.dtype):
        raise ChainexecError(f"dataset {t.source.dataset!r} holds {ds.dtype} values of shape {ds.shape}, but "
                             f"tensor {name}[{','.join(t.indices)}] is {t.dtype} of shape {stored}"
                             + ("" if t.layout == "dense" else f" in layout {t.layout}"), path)
    return ds


def _sources_there(path: str, dataset: str, what: str) -> list[str]:
    """The files the values of ``dataset`` in ``path`` come from besides ``path``
    (:func:`chainexec.datafiles.of`: a virtual dataset's sources, an external link's file), each
    there: where one is not, HDF5 reads its fill value, and a comparison with it would blame the
    wrong file. None listed where the dataset itself cannot be read (the read says so)."""
    try:
        files = datafiles.of(path, dataset)[1:]
    except (OSError, KeyError, ValueError, RuntimeError):
        return []
    missing = next((f for f in files if not os.path.isfile(f)), None)
    if missing is not None:
        raise ChainexecError(f"the values of dataset {dataset!r} ({what}) lie in {missing}, which is not there", path)
    return files


def _stored(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a tensor of ``shape`` stored in ``layout`` (PySCF's names): each packed pair
    of indices of extent n one axis of n(n+1)/2, ``s8`` one axis over the pairs of pairs."""
    def pairs(n: int) -> int:
        return n * (n + 1) // 2

    if layout == "dense":
        return tuple(shape)
    if layout == "s2":
        return (pairs(shape[0]),)
    if layout == "s8":
        return (pairs(pairs(shape[0])),)
    return ((pairs(shape[0]),) if layout in ("s2ij", "s4") else tuple(shape[:2])) + (
        (pairs(shape[2]),) if layout in ("s2kl", "s4") else tuple(shape[2:]))


def _pair(p, q):
    """The position of the pair ``(p, q)`` (either order; NumPy integers or arrays, broadcast) in
    a row-major lower triangle, ``numpy.tril_indices``'s order: ``max·(max + 1)/2 + min``."""
    hi, lo = np.maximum(p, q), np.minimum(p, q)
    return hi * (hi + 1) // 2 + lo


def stored_at(layout: str, shape: tuple[int, ...], at: tuple) -> tuple:
    """Where the dense elements ``at`` (per dimension of ``shape`` an integer or a slice) of a
    tensor stored in ``layout`` (PySCF's names) lie in the stored array: one index per stored
    axis, integer arrays broadcast over the sliced dimensions in their order (an integer tuple
    where ``at`` holds only integers), independently of :mod:`chainexec.packing`."""
    sliced = [d for d, a in enumerate(at) if isinstance(a, slice)]
    dims = [np.int64(a) if not isinstance(a, slice) else
            np.arange(shape[d], dtype=np.int64)[a].reshape((-1,) + (1,) * (len(sliced) - 1 - sliced.index(d)))
            for d, a in enumerate(at)]
    if layout == "dense":
        coords = tuple(dims)
    elif layout == "s2":
        coords = (_pair(*dims),)
    elif layout == "s8":
        coords = (_pair(_pair(dims[0], dims[1]), _pair(dims[2], dims[3])),)
    else:
        coords = ((_pair(dims[0], dims[1]),) if layout in ("s2ij", "s4") else tuple(dims[:2])) + (
            (_pair(dims[2], dims[3]),) if layout in ("s2kl", "s4") else tuple(dims[2:]))
    return tuple(int(c) for c in coords) if not sliced else coords


def dense(values: np.ndarray, layout: str, shape: tuple[int, ...], at: tuple | None = None) -> np.ndarray:
    """The dense tensor of ``shape`` that a packed array in ``layout`` (PySCF's names) stands for,
    or its elements ``at`` (:func:`stored_at`): each pair's triangle read at both orders. More
    elements of an ``s8`` array than it has pairs of pairs go through ``s4`` (its pairs of pairs
    unpacked first): indexed at once, each element's position would be an array as large as
    the result, several times over."""
    at = at if at is not None else (slice(None),) * len(shape)
    pairs = shape[0] * (shape[0] + 1) // 2 if layout == "s8" else 0
    if pairs and math.prod(len(range(*a.indices(n))) for a, n in zip(at, shape) if isinstance(a, slice)) > pairs**2:
        every = np.arange(pairs, dtype=np.int64)
        values, layout = values[_pair(every[:, None], every[None, :])], "s4"
    return values[stored_at(layout, shape, at)]


def _output(f: h5py.File, spec: Spec, name: str, path: str) -> h5py.Dataset:
    """Output ``name``'s dataset in its open file ``f``: the file marked complete, the dataset
    there, of the tensor's dtype and stored shape (:func:`_stored`), its values where it says
    and written by the run that wrote it (:func:`chainexec.safepaths.landed_elsewhere`), else a
    ChainexecError naming ``path``: an array of another shape or dtype is another config's
    output, which would be compared by broadcasting, by its first values, or not at all, and a
    copy of an earlier output reads a later run's values."""
    out = next(o for o in spec.outputs if o.tensor == name)
    if not f.attrs.get(COMPLETE, False):
        raise ChainexecError("output is not marked complete", path)
    ds = datafiles.find(f, out.dataset, path)
    if not isinstance(ds, h5py.Dataset):
        raise ChainexecError(f"no dataset {out.dataset!r} (output {name})", path)
    t = spec.tensors[name]
    stored = _stored(t.layout, spec.shape(name))
    if ds.shape != stored or ds.dtype != np.dtype(t.dtype):
        raise ChainexecError(f"dataset {out.dataset!r} holds {ds.dtype} values of shape {ds.shape}, but output "
                             f"{name}[{','.join(t.indices)}] is {t.dtype} of shape {stored}"
                             + ("" if t.layout == "dense" else f" in layout {t.layout}") + ": not this config's output",
                             path)
    sources = _sources_there(path, out.dataset, f"output {name}; its parts folder moved or removed?")
    elsewhere = safepaths.landed_elsewhere(f.attrs.get(safepaths.LANDED), sources)
    if elsewhere is not None:
        raise ChainexecError(f"the values of output {name} lie in {elsewhere}, which a later run filled with its own: "
                             "this file is a copy of an earlier output, whose values are gone (copy an output with "
                             "its parts folder)", path)
    return ds


def _output_file(spec: Spec, name: str) -> str:
    """The file of output ``name``, refused where it is not one of a run's outputs
    (:func:`chainexec.safepaths.checked`) or not a regular file: a FIFO's open would wait for a
    writer."""
    out = next(o for o in spec.outputs if o.tensor == name)
    path = safepaths.checked(spec.resolve(out.file), f"the output of {name}")
    datafiles.check_regular(path, f"output of {name}")
    return path


def read_output(spec: Spec, name: str) -> np.ndarray:
    path = _output_file(spec, name)
    try:
        with h5py.File(path, "r") as f:
            ds = _output(f, spec, name, path)
            t = spec.tensors[name]
            if t.layout != "dense":
                return dense(ds[...], t.layout, spec.shape(name))
            return ds[...]
    except OSError as err:
        raise ChainexecError(f"cannot read output ({err})", path) from None


def scalar_outputs(spec: Spec) -> dict[str, float]:
    """The spec's scalar outputs (no indices: an energy) as written by a complete run, by name;
    what benchmarks compare across versions and rank counts (:func:`read_output`'s errors)."""
    return {o.tensor: float(read_output(spec, o.tensor)) for o in spec.outputs if not spec.tensors[o.tensor].indices}


def full_reference(spec: Spec, magnitude: bool = False) -> dict[str, np.ndarray]:
    """Every output by NumPy einsum, statement by statement; with ``magnitude``, of the absolute
    values of the inputs and factors instead: the size of the terms each element sums, the scale
    of its rounding error."""
    values = {n: _input(spec, n) for n, t in spec.tensors.items() if t.source is not None}
    if magnitude:
        values = {n: np.abs(v) for n, v in values.items()}
    for st in spec.statements:
        letters = _letters(spec)
        terms = ",".join("".join(letters[i] for i in r.indices) for r in st.operands)
        expr = f"{terms}->{''.join(letters[i] for i in st.lhs.indices)}"
        factor = abs(st.factor) if magnitude else st.factor
        result = factor * np.einsum(expr, *[values[r.tensor] for r in st.operands], optimize=True)
        values[st.lhs.tensor] = values[st.lhs.tensor] + result if st.accumulate else result
    return {o.tensor: values[o.tensor] for o in spec.outputs}


def _letters(spec: Spec) -> dict[str, str]:
    names = sorted(spec.extents)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    if len(names) > len(alphabet):
        raise ChainexecError(f"verify supports at most {len(alphabet)} distinct indices", spec.path)
    return dict(zip(names, alphabet))


def expand(spec: Spec, name: str, upto: int | None = None) -> list[tuple[float, list[Ref], tuple[str, ...]]]:
    """Tensor ``name`` as it stands before statement ``upto``: a sum of products of inputs, each
    ``(factor, operands, kept indices)``; contracted indices of substituted definitions get fresh
    names so that they never clash."""
    if spec.tensors[name].source is not None:
        return [(1.0, [Ref(name, spec.tensors[name].indices)], spec.tensors[name].indices)]
    upto = len(spec.statements) if upto is None else upto
    defining = [k for k in range(upto) if spec.statements[k].lhs.tensor == name]
    last_set = max(k for k in defining if not spec.statements[k].accumulate)
    counter = itertools.count()
    terms = []
    for k in (k for k in defining if k >= last_set):
        st = spec.statements[k]
        products = [(st.factor, [], st.lhs.indices)]
        for ref in st.operands:
            expanded = []
            for factor, ops, kept in expand(spec, ref.tensor, k):
                fresh = {}
                rename = dict(zip(kept, ref.indices))
                for op in ops:
                    for i in op.indices:
                        if i not in rename and i not in fresh:
                            fresh[i] = f"{i}__{next(counter)}"
                mapping = rename | fresh
                expanded.append((factor, [Ref(op.tensor, tuple(mapping[i] for i in op.indices)) for op in ops]))
            products = [(f1 * f2, o1 + o2, kept) for f1, o1, kept in products for f2, o2 in expanded]
        terms.extend(products)
    return terms


class _Reader:
    """Input ``name``'s values at one sample's elements (:meth:`at`): held whole where they fit
    the bytes ``room`` has left (a one-element list, shared by a check's readers and taken from
    as each holds its values: a sample that sums over a whole input then reads it once, not once
    per sample), else read where they lie: a dense file input's from its dataset, open for the
    whole check, a seeded or expression input's made for that region alone. A packed file input
    is held packed (its stored values, read once), a computed one whole. The sampled check
    exists for chains larger than memory: past ``room`` it holds no file or seeded input's dense
    values whole."""

    def __init__(self, spec: Spec, name: str, files: contextlib.ExitStack, room: list[int]):
        self.spec, self.name = spec, name
        t = spec.tensors[name]
        self.whole = self.ds = self.packed = None
        self.path = None
        size = math.prod(spec.shape(name)) * DTYPES[t.dtype]
        if t.source.compute is not None or size <= room[0]:
            room[0] -= size
            self.whole = _input(spec, name)
        elif t.source.file is not None and t.source.random is None:
            self.path = _input_path(spec, name)
            try:
                self.ds = _input_dataset(spec, name, files.enter_context(h5py.File(self.path, "r")), self.path)
                if t.layout != "dense":
                    self.packed = self.ds[()]
            except (OSError, KeyError) as err:
                raise ChainexecError(f"cannot read dataset {t.source.dataset!r} ({err})", self.path) from None

    def at(self, at: tuple) -> np.ndarray:
        """The elements ``at`` (per dimension an integer or ``slice(None)``), integer dimensions
        dropped."""
        t = self.spec.tensors[self.name]
        if self.packed is not None:
            return dense(self.packed, t.layout, self.spec.shape(self.name), at)
        if self.ds is not None:
            try:
                return np.asarray(self.ds[at])
            except (OSError, KeyError) as err:
                raise ChainexecError(f"cannot read dataset {t.source.dataset!r} ({err})", self.path) from None
        if self.whole is not None:
            return self.whole[at]
        region = tuple((a, a + 1) if not isinstance(a, slice) else (0, n)
                       for a, n in zip(at, self.spec.shape(self.name)))
        return np.asarray(_input(self.spec, self.name, region))[tuple(0 if not isinstance(a, slice) else a for a in at)]


def _sampled(spec: Spec, name: str, samples: int, rng: np.random.Generator,
             limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(output values, reference values, term magnitudes) at random elements of output ``name``
    (magnitude: the sum of the absolute values of the terms), each element computed from the
    inputs alone, held whole within ``limit`` bytes, else read where it needs them
    (:class:`_Reader`)."""
    path = _output_file(spec, name)
    shape, layout = spec.shape(name), spec.tensors[name].layout
    terms = expand(spec, name)
    refs, sizes, gots = [], [], []
    with contextlib.ExitStack() as files, np.errstate(all="ignore"):  # inf or NaN inputs (allow_nonfinite)
        room = [limit]
        values = {n: _Reader(spec, n, files, room) for n in sorted({r.tensor for _, ops, _ in terms for r in ops})}
        try:
            ds = _output(files.enter_context(h5py.File(path, "r")), spec, name, path)
        except OSError as err:
            raise ChainexecError(f"cannot read output ({err})", path) from None
        picks = (set(itertools.product(*map(range, shape))) if samples >= math.prod(shape)
                 else {tuple(int(rng.integers(n)) for n in shape) for _ in range(samples)})
        for point in sorted(picks):
            ref = mag = 0.0
            for factor, ops, kept in terms:
                at = dict(zip(kept, point))
                letters, arrays, free = {}, [], []
                for op in ops:
                    sl = tuple(at.get(i, slice(None)) for i in op.indices)
                    rest = [i for i in op.indices if i not in at]
                    for i in rest:
                        letters.setdefault(i, chr(ord("a") + len(letters)) if len(letters) < 26
                                           else chr(ord("A") + len(letters) - 26))
                    free.append("".join(letters[i] for i in rest))
                    arrays.append(values[op.tensor].at(sl))
                ref += factor * float(np.einsum(",".join(free) + "->", *arrays, optimize=True))
                mag += abs(factor) * float(np.einsum(",".join(free) + "->", *map(np.abs, arrays), optimize=True))
            refs.append(ref)
            sizes.append(mag)
            try:
                gots.append(float(ds[stored_at(layout, shape, point)]))
            except OSError as err:
                raise ChainexecError(f"cannot read output ({err})", path) from None
    return np.array(gots), np.array(refs), np.array(sizes)


def _check(tensor: str, method: str, dtype: str, got: np.ndarray, ref: np.ndarray, magnitude: np.ndarray) -> Check:
    """An output's values ``got`` against their ``ref``erence: each element's error relative to
    the largest reference value; an element above the tolerance that is still within
    :data:`ROUNDING_ULPS` units of rounding of its own terms' ``magnitude`` passes as rounding
    (an element whose terms cancel, X - X or a value far below its terms, cannot be exact to the
    tolerance relative to the output's values, and relative to zero any rounding would fail a
    correct result): where every element above the tolerance is such, the check reports the
    largest of their errors relative to their allowances (scaled to the tolerance) and is named
    so. Each element is held to its own terms: one element's large terms allow no other element
    more. Where the reference is not finite (an output allowed inf or NaN, ``allow_nonfinite``),
    the output must not be finite either (inf and NaN alike: another order of the same terms
    turns one into the other), else the error is inf."""
    tolerance = TOLERANCE[dtype]
    got, ref, magnitude = (np.asarray(x, dtype=np.float64).ravel() for x in (got, ref, magnitude))
    finite = np.isfinite(ref)
    if np.isfinite(got[~finite]).any():
        return Check(tensor, method, math.inf, tolerance, ref.size)
    if not finite.any():
        return Check(tensor, method, 0.0, tolerance, ref.size)
    with np.errstate(all="ignore"):
        error = np.abs(got[finite] - ref[finite])
        error = np.where(np.isnan(error), np.inf, error)
        relative = error / max(float(np.max(np.abs(ref[finite]))), np.finfo(float).tiny)
        allowance = ROUNDING_ULPS * float(np.finfo(dtype).eps) * magnitude[finite]
    rounding = (relative > tolerance) & (error <= allowance) & np.isfinite(allowance)
    worst = float(np.max(relative[~rounding], initial=0.0))
    if rounding.any() and worst <= tolerance:
        return Check(tensor, f"{method} (the output cancels: error within {ROUNDING_ULPS} units of rounding of its "
                     "terms' magnitude)", tolerance * float(np.max(error[rounding] / allowance[rounding])),
                     tolerance, ref.size)
    return Check(tensor, method, worst, tolerance, ref.size)


def _symmetric(spec: Spec, name: str) -> Check:
    """An input stored dense whose config declares a symmetry: the largest difference between it
    and its image under each permutation the symmetry allows, relative to its largest value (a
    packed run reads one triangle of it, so data that lacks the symmetry gives another result)."""
    t = spec.tensors[name]
    values = _input(spec, name)
    scale = float(np.max(np.abs(values))) or 1.0
    worst = max(float(np.max(np.abs(values - values.transpose(perm)))) for perm in t.symmetry.permutations(values.ndim))
    return Check(f"{name} (its declared symmetry)", "permuted", worst / scale, TOLERANCE[t.dtype], values.size)


def verify(spec: Spec, samples: int = 300, limit: int = 2 << 30, seed: int = 0) -> list[Check]:
    """Check every output against NumPy; ``limit`` bytes decide between full and sampled checks.
    ``samples`` below 1 or ``limit`` below 0 is a :class:`ChainexecError`: the sampled check of a
    chain larger than the limit would then look at no element and pass."""
    if samples < 1:
        raise ChainexecError(f"--samples must be at least 1 (output elements checked where the chain is larger "
                             f"than --full-limit), not {samples}: with none, verify would pass without checking")
    if limit < 0:
        raise ChainexecError(f"--full-limit must be 0 bytes or more, not {limit}")
    total = sum(math.prod(spec.shape(n)) * DTYPES[t.dtype] for n, t in spec.tensors.items())
    checks = [_symmetric(spec, n) for n, t in spec.tensors.items()
              if t.symmetry is not None and t.layout == "dense" and t.source is not None and t.source.file is not None
              and math.prod(spec.shape(n)) * DTYPES[t.dtype] <= limit]
    if total <= limit:
        with np.errstate(all="ignore"):  # inputs an output allows to be inf or NaN (allow_nonfinite)
            reference, magnitude = full_reference(spec), full_reference(spec, magnitude=True)
        for o in spec.outputs:
            checks.append(_check(o.tensor, "einsum", spec.tensors[o.tensor].dtype,
                                 read_output(spec, o.tensor), reference[o.tensor], magnitude[o.tensor]))
    else:
        rng = np.random.default_rng(seed)
        for o in spec.outputs:
            checks.append(_check(o.tensor, "sampled", spec.tensors[o.tensor].dtype,
                                 *_sampled(spec, o.tensor, samples, rng, limit)))
    return checks
