"""The parsed chain: frozen dataclasses of a config's tensors, statements, outputs and memory
limits (:class:`Spec` and its parts), the dtypes a tensor may have, and memory sizes read and
written in bytes (:func:`parse_size`, :func:`format_size`).

What a config says is checked before any of these is made (:mod:`chainexec.speccheck`); paths in
them are relative to the config file's folder (:func:`config_relative`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from fractions import Fraction

from chainexec import pairs
from chainexec.errors import quoted

SEEDS = 1 << 24
"""Seeds the generator tells apart (:mod:`chainexec.generator`: ``s·2⁴⁰`` wraps at 2⁶⁴, so seed
``s + SEEDS`` makes ``s``'s values); a config's seed is below it. Here, not in the generator, so
that reading a config imports no NumPy (a process's first thread count matters to
:func:`chainexec.runtime.fdtable.reserve`)."""

DTYPES = {"float64": 8, "float32": 4}
# Bytes in a memory limit, elements along an index and elements of a tensor: a signed 64-bit
# count (what NumPy and HDF5 index with; the planner's float arithmetic stays finite).
MAX_SIZE = 2**63 - 1


@dataclass(frozen=True)
class Source:
    """Where an input tensor's values come from.

    ``file``/``dataset``: an HDF5 dataset (``seed``, when given, lets ``chainexec generate`` write it).
    ``random``: values made on the fly by the seeded element-wise generator (no file at all).
    ``expr``: computed element-wise from other inputs (:mod:`chainexec.expr`), e.g. a denominator.
    ``compute``: a registered source (:mod:`chainexec.sources`) that computes the values of the
    rows being loaded, made with ``parameters`` (name, value pairs: strings and numbers);
    ``bytes_per_second``, where the config states it, the rate it makes them at, which the
    planner prices its loads at (else at the disk's read rate).
    """

    file: str | None = None
    dataset: str | None = None
    seed: int | None = None
    random: int | None = None
    expr: str | None = None
    compute: str | None = None
    parameters: tuple[tuple[str, object], ...] | None = None
    bytes_per_second: float | None = None


@dataclass(frozen=True)
class Tensor:
    """A tensor of the chain. ``symmetry``: its declared symmetric pairs of indices (and their
    exchange, :mod:`chainexec.pairs`); ``layout``: how its values lie in its HDF5 dataset —
    ``dense``, or the PySCF name of a packed layout its symmetry allows (``s2``, ``s2ij``,
    ``s2kl``, ``s4``, ``s8``; ``packed`` in the config names the layout of its whole symmetry)."""

    name: str
    indices: tuple[str, ...]
    dtype: str
    source: Source | None = None
    symmetry: pairs.Symmetry | None = None
    layout: str = "dense"


@dataclass(frozen=True)
class Ref:
    """A tensor reference in a statement, e.g. ``C[p,a]``."""

    tensor: str
    indices: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.tensor}[{','.join(self.indices)}]"


@dataclass(frozen=True)
class Statement:
    """``lhs (=|+=) factor * operands[0] * operands[1] * ...`` (``-=`` is ``+=`` with factor -1)."""

    lhs: Ref
    accumulate: bool
    factor: float
    operands: tuple[Ref, ...]
    text: str
    line: int | None = None


@dataclass(frozen=True)
class Output:
    """Where an output is written. ``symmetric``: indices the output is summed over whose
    permutations leave the summand, summed over everything else, unchanged (the (T) energy over
    i, j, k): the planner may visit only ordered tiles of them, each weighted by its multiplicity.
    ``allow_nonfinite``: values that are not finite (inf, NaN) are expected; without it a run whose
    output holds one does not mark it complete."""

    tensor: str
    file: str
    dataset: str
    symmetric: tuple[str, ...] = ()
    allow_nonfinite: bool = False


@dataclass(frozen=True)
class Machine:
    """Memory per level in bytes: ``global_memory`` is the whole distributed global array (all ranks
    together); ``device_memory`` is per rank (one GPU each). None where the config leaves it out:
    the run detects it from the machine (:mod:`chainexec.detect`)."""

    global_memory: int | None = None
    device_memory: int | None = None


@dataclass(frozen=True)
class Spec:
    path: str
    name: str
    extents: dict[str, int]
    tensors: dict[str, Tensor]
    statements: tuple[Statement, ...]
    outputs: tuple[Output, ...]
    machine: Machine
    scratch: str
    lines: dict = field(default_factory=dict, compare=False, repr=False)

    def itemsize(self, tensor: str) -> int:
        return DTYPES[self.tensors[tensor].dtype]

    def shape(self, tensor: str) -> tuple[int, ...]:
        return tuple(self.extents[i] for i in self.tensors[tensor].indices)

    def resolve(self, relpath: str) -> str:
        """A path from the config, made absolute against the config file's folder."""
        return config_relative(self.path, relpath)

    def source_record(self, tensor: str) -> dict | None:
        """How a plan records ``tensor``'s source (:class:`chainexec.planner.plan.TensorInfo`):
        its set fields, the file resolved; None for a tensor the chain computes."""
        source = self.tensors[tensor].source
        if source is None:
            return None
        record = {k: dict(v) if k == "parameters" else v for k, v in vars(source).items() if v is not None}
        if "file" in record:
            record["file"] = self.resolve(record["file"])
        permutations = self.dense_symmetry(tensor) or self.stored_symmetry(tensor)
        if permutations:
            record["permutations"] = [list(p) for p in permutations]
        return record

    def dense_symmetry(self, tensor: str) -> list[tuple[int, ...]]:
        """The index orders (:meth:`chainexec.pairs.Symmetry.permutations`, the identity left out)
        a dense input ``tensor`` read from a file or made by a ``random`` source is declared
        symmetric under: its seeded values are made so (:func:`chainexec.generator.block`), and a
        run checks a file's values at sampled elements (the run exploits the symmetry and would
        be wrong without it). None (``[]``) where it is packed (its values are the stored ones
        alone), computed or declares none."""
        t = self.tensors[tensor]
        if t.symmetry is None or t.layout != "dense" or t.source is None or (t.source.file is None
                                                                           and t.source.random is None):
            return []
        return t.symmetry.permutations(len(t.indices))[1:]

    def stored_symmetry(self, tensor: str) -> list[tuple[int, ...]]:
        """The orders of the stored axes of a file input in a packed layout narrower than its
        declared symmetry that the rest of the symmetry maps it onto itself by, where they are
        orders of axes: ``s4`` with the exchange, the two pair axes; ``s2ij`` with both pairs, the
        last two; ``s2kl``, the first two. The layout stores such values twice and the run takes
        one for the other, so a run checks them at sampled elements as a dense input's
        (PySCF's integrals hold them equal; other data may not). None (``[]``) elsewhere (a
        seeded input in such a layout is refused, :mod:`chainexec.speccheck`)."""
        t = self.tensors[tensor]
        if t.symmetry is None or t.layout == "dense" or t.source is None or t.source.file is None:
            return []
        leftover = {("s4", "s8"): [(1, 0)], ("s2ij", "s4"): [(0, 2, 1)], ("s2kl", "s4"): [(1, 0, 2)]}
        return leftover.get((t.layout, t.symmetry.kind(len(t.indices))), [])

    def output_records(self) -> dict[str, dict]:
        """How a plan records the outputs: tensor -> ``{file (resolved), dataset}``."""
        return {o.tensor: {"file": self.resolve(o.file), "dataset": o.dataset,
                           **({"allow_nonfinite": True} if o.allow_nonfinite else {})} for o in self.outputs}


def config_relative(config: str, relpath: str) -> str:
    """``relpath`` made absolute against the folder of the config file ``config``, its folders
    resolved as the file system resolves them: a symbolic link before the ``..`` that follows it
    (a ``..`` after a linked folder, in ``relpath`` or in the config's own name, climbs from the
    folder the link names, as the shell and ``open`` do; a text-only ``normpath`` or ``abspath``
    would name another file), so that two paths to one file are one path.
    The last component stays as written (an input or output that is itself a link is the link:
    :func:`chainexec.safepaths.check_run` and the input checks judge it)."""
    path = os.path.join(os.path.dirname(os.path.join(os.getcwd(), config)), relpath)  # no ``..`` read as text
    path = path.rstrip("/") or "/"  # ``link/`` is the link, as ``link``
    head, last = os.path.split(path)
    if last in ("", ".", ".."):  # a folder named by where it lies: resolved whole
        return os.path.realpath(path)
    return os.path.join(os.path.realpath(head), last)


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(value, what: str) -> int:
    """``8GiB``, ``512 MiB``, ``1e9``, ``1e-3GiB``, ``1000000`` → bytes, a whole number from 1 to
    :data:`MAX_SIZE` (fractions of a byte are dropped); ValueError for anything else, infinities
    and NaN among it."""
    given = value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{what}: expected a size such as 8GiB or 512MiB, got {quoted(value)}")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if 1 <= value <= 2 * MAX_SIZE:  # exact where in range (2^63 - 1 stays itself); a float first,
            value = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]  # so 1e999999999 costs nothing
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what}: expected a size such as 8GiB, got {quoted(value)}")
    # Comparisons with NaN are false: NaN fails this as the infinities do.
    if not 1 <= value <= MAX_SIZE:
        raise ValueError(f"{what}: size must be a finite number of bytes from 1 to 2^63 - 1, got {quoted(given)}")
    return int(value)


def format_size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
