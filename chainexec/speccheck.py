"""A config's data checked section by section into a :class:`~chainexec.spectypes.Spec`.

Names (plain identifiers that reach file names and generated CUDA source), statements (parsed
from their text), tensors and their sources, symmetries and layouts, outputs and memory limits:
each check raises :class:`ChainexecError` naming the config, the line and the offending item
(:class:`_Parser`), before anything of the chain is planned or run.
"""

from __future__ import annotations

import keyword
import math
import re
from pathlib import Path

from chainexec import expr, pairs
from chainexec.errors import ChainexecError, quoted
from chainexec.spectypes import (DTYPES, MAX_SIZE, SEEDS, Machine, Output, Ref, Source, Spec, Statement, Tensor,
                                 config_relative, parse_size)

# The largest finite value of each dtype: a statement's factor must be one (it scales every term).
_LARGEST = {"float64": (2 - 2.0**-52) * 2.0**1023, "float32": (2 - 2.0**-23) * 2.0**127}
_SMALLEST = {"float64": 2.0**-1074, "float32": 2.0**-149}  # the least positive (subnormal) values

_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# Characters in a name: names reach file names (``<tensor>.v<k>`` folders) and generated CUDA source.
MAX_NAME = 64

# Names reach generated CUDA C source: C/C++/CUDA keywords would break it or change its meaning.
_C_KEYWORDS = frozenset(
    """auto break case char const continue default do double else enum extern float for goto if
    inline int long register restrict return short signed sizeof static struct switch typedef union
    unsigned void volatile while bool true false class namespace template typename this new delete
    private public protected virtual operator friend using try catch throw half dim3 threadIdx
    blockIdx blockDim gridDim warpSize""".split()
)


def check_identifier(name, what: str) -> str:
    """``name`` where it is a plain identifier of at most :data:`MAX_NAME` characters that is no
    Python or C/CUDA keyword; ValueError otherwise."""
    shown = quoted(name)
    if not isinstance(name, str) or not _IDENT.fullmatch(name) or name in _C_KEYWORDS or keyword.iskeyword(name):
        raise ValueError(
            f"{what} {shown} is not a plain identifier (letters, digits and _, starting with a letter; no keyword)"
        )
    if len(name) > MAX_NAME:
        raise ValueError(f"{what} {shown} has {len(name)} characters; names have at most {MAX_NAME} "
                         "(they reach file names and generated CUDA source)")
    return name


_REF = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\[([^\[\]]*)\]\s*$")
_NUMBER = re.compile(r"^\s*[-+]?\s*(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$", re.ASCII)


def _parse_ref(text: str) -> Ref:
    m = _REF.match(text)
    if not m:
        raise ValueError(f"cannot read {text.strip()!r} as a tensor reference such as A[i,j]")
    name = check_identifier(m.group(1), "tensor name")
    inner = m.group(2).strip()
    idx = tuple(s.strip() for s in inner.split(",")) if inner else ()
    for i in idx:
        check_identifier(i, "index name")
    if len(set(idx)) != len(idx):
        raise ValueError(f"{text.strip()}: an index repeats within one tensor (diagonals are not supported)")
    return Ref(name, idx)


def parse_statement(text: str, line: int | None = None) -> Statement:
    """Parse ``B[a,b] = 0.5 * A[a,k] * C[k,b]`` (``=``, ``+=`` or ``-=``)."""
    if not isinstance(text, str):
        raise ValueError(f"a statement must be a string such as 'C[i,j] = A[i,k] * B[k,j]', got {text!r}")
    m = re.match(r"^(.*?)(\+=|-=|=)(.*)$", text)
    if not m:
        raise ValueError(f"statement {text!r} has no '=', '+=' or '-='")
    lhs = _parse_ref(m.group(1))
    op = m.group(2)
    factor = -1.0 if op == "-=" else 1.0
    rhs = m.group(3).strip()
    if rhs.startswith("-"):
        factor, rhs = -factor, rhs[1:]
    operands = []
    zero = False  # a factor written as zero
    for term in rhs.split("*"):
        number = _NUMBER.match(term)
        if number:
            factor *= float("".join(term.split()))
            zero = zero or not re.search(r"[1-9]", number.group(1))
        elif "[" not in term and term.strip():
            raise ValueError(f"statement {text!r}: cannot read the factor {term.strip()!r}: a product holds tensor "
                             "references such as A[i,j] and decimal numbers such as 0.5 or -2e-3 (write a fraction "
                             "by its decimal value)")
        elif term.strip():
            operands.append(_parse_ref(term))
        else:
            raise ValueError(f"statement {text!r}: empty factor in the product")
    if not operands:
        raise ValueError(f"statement {text!r} has no tensor on its right-hand side")
    if factor == 0 and not zero:
        raise ValueError(f"statement {text!r}: its factors' product is below the smallest float64 and "
                         "would be 0 (every value of the result 0)")
    return Statement(lhs, op != "=", factor, tuple(operands), text.strip(), line)


_TOP_KEYS = {"name", "dtype", "ranges", "indices", "tensors", "statements", "outputs", "machine", "scratch"}
_TENSOR_KEYS = {"indices", "dtype", "source", "symmetry", "layout"}
_SOURCE_KEYS = {"file", "dataset", "seed", "random", "expr"}
_OUTPUT_KEYS = {"file", "dataset", "symmetric", "allow_nonfinite"}
_MACHINE_KEYS = {"global_memory", "device_memory"}


class _Parser:
    def __init__(self, path: str, lines: dict):
        self.path = path
        self.lines = lines

    def fail(self, message: str, where=()) -> ChainexecError:
        while where not in self.lines and where:
            where = where[:-1]
        return ChainexecError(message, self.path, self.lines.get(where))

    def mapping(self, value, where, keys: set | None = None, what: str = "") -> dict:
        if not isinstance(value, dict):
            raise self.fail(f"{what or '/'.join(map(str, where))} must be a mapping", where)
        if keys is not None:
            for k in value:
                if k not in keys:
                    raise self.fail(
                        f"unknown key {k!r} in {what or 'the config'} (expected one of {', '.join(sorted(keys))})",
                        where + (k,),
                    )
        return value

    def ident(self, name, what, where):
        try:
            return check_identifier(name, what)
        except ValueError as err:
            raise self.fail(str(err), where) from None


def build(data, lines: dict, path: str) -> Spec:
    """The :class:`~chainexec.spectypes.Spec` of a config's data, every section checked:
    ``data`` and ``lines`` (each item's path to its line) as :func:`chainexec.specyaml.compose`
    gives them, ``path`` the config's name in errors. Raises :class:`ChainexecError` at the first
    problem, naming its line where the config has one for it."""
    p = _Parser(path, lines)
    data = p.mapping(data, (), _TOP_KEYS, "the config")
    for key in ("indices", "tensors", "statements", "outputs"):
        if key not in data:
            raise p.fail(f"missing required section {key!r}")

    if "name" in data:
        name = p.ident(data["name"], "config name", ("name",))
    else:  # the file's name stands for it: no line of the config gave it
        try:
            name = check_identifier(Path(path).stem, "the config has no `name:`, and its file name")
        except ValueError as err:
            raise ChainexecError(f"{err}: add one", path) from None
    default_dtype = _dtype(p, data.get("dtype", "float64"), "", ("dtype",))

    ranges = p.mapping(data.get("ranges", {}), ("ranges",), None, "ranges")
    for rname, rext in ranges.items():
        p.ident(rname, "range name", ("ranges", rname))
        if not _extent(rext):
            raise p.fail(f"range {rname!r} must have a positive integer extent (at most 2^63 - 1), got "
                         f"{quoted(rext)}", ("ranges", rname))

    extents: dict[str, int] = {}
    for iname, ext in p.mapping(data["indices"], ("indices",), None, "indices").items():
        p.ident(iname, "index name", ("indices", iname))
        if isinstance(ext, str) and ext in ranges:
            ext = ranges[ext]
        if not _extent(ext):
            raise p.fail(
                f"index {iname!r} must have a positive integer extent (at most 2^63 - 1) or a range name, got "
                f"{quoted(ext)}",
                ("indices", iname),
            )
        extents[iname] = ext

    tensors: dict[str, Tensor] = {}
    for tname, tdef in p.mapping(data["tensors"], ("tensors",), None, "tensors").items():
        where = ("tensors", tname)
        p.ident(tname, "tensor name", where)
        tdef = p.mapping(tdef, where, _TENSOR_KEYS, f"tensor {tname!r}")
        idx = tdef.get("indices")
        if not isinstance(idx, list):
            raise p.fail(f"tensor {tname!r} needs a list of indices", where)
        for i in idx:
            p.ident(i, "index name", where + ("indices",))
            if i not in extents:
                raise p.fail(f"tensor {tname!r} uses unknown index {i!r}", where + ("indices",))
        if len(set(idx)) != len(idx):
            raise p.fail(f"tensor {tname!r} repeats an index", where + ("indices",))
        _check_elements(p, tname, idx, extents, where + ("indices",))
        dtype = _dtype(p, tdef.get("dtype", default_dtype), f"tensor {tname!r}: ", where + ("dtype",))
        source = None
        if "source" in tdef:
            source = _parse_source(p, tdef["source"], where + ("source",), tname)
        symmetry, layout = _symmetry(p, tdef, tname, tuple(idx), extents, where, source)
        tensors[tname] = Tensor(tname, tuple(idx), dtype, source, symmetry, layout)

    for t in tensors.values():
        if t.source is not None and t.source.expr is not None:
            _check_expr(p, t, tensors, extents)

    raw_statements = data["statements"]
    if not isinstance(raw_statements, list) or not raw_statements:
        raise p.fail("statements must be a non-empty list", ("statements",))
    statements = []
    for k, text_k in enumerate(raw_statements):
        line = p.lines.get(("statements", k))
        try:
            st = parse_statement(text_k, line)
        except ValueError as err:
            raise p.fail(str(err), ("statements", k)) from None
        statements.append(st)
    _check_statements(p, statements, extents, tensors)
    _check_symmetry_kept(p, statements, extents, tensors)

    outputs = []
    written: dict[tuple[str, str], str] = {}  # (file resolved, dataset) -> the output written there
    for oname, odef in p.mapping(data["outputs"], ("outputs",), None, "outputs").items():
        where = ("outputs", oname)
        p.ident(oname, "output tensor name", where)
        odef = p.mapping(odef, where, _OUTPUT_KEYS, f"output {oname!r}")
        if oname not in tensors or not any(s.lhs.tensor == oname for s in statements):
            raise p.fail(f"output {oname!r} is not assigned by any statement", where)
        if tensors[oname].source is not None:
            raise p.fail(f"output {oname!r} is an input (it has a source)", where)
        if not isinstance(odef.get("file"), str) or not odef["file"] or not isinstance(odef.get("dataset"), str):
            raise p.fail(f"output {oname!r} needs 'file' and 'dataset'", where)
        if odef["file"].endswith(("/", "/.", "/..")) or odef["file"] in (".", ".."):
            raise p.fail(f"output {oname!r}: file {odef['file']!r} names a folder; name the HDF5 file in it",
                         where + ("file",))
        _dataset(p, odef["dataset"], f"output {oname!r}", where + ("dataset",), nested=False)
        place = (config_relative(path, odef["file"]), odef["dataset"])
        if place in written:
            raise p.fail(f"output {oname!r} goes to the dataset {odef['file']}:{odef['dataset']}, as output "
                         f"{written[place]!r} does", where)
        written[place] = oname
        symmetric = _symmetric(p, odef.get("symmetric", []), oname, tensors[oname], statements, extents, where)
        allow = odef.get("allow_nonfinite", False)
        if not isinstance(allow, bool):
            raise p.fail(f"output {oname!r}: allow_nonfinite is true or false, not {allow!r}", where + ("allow_nonfinite",))
        outputs.append(Output(oname, odef["file"], odef["dataset"], symmetric, allow))
    if not outputs:
        raise p.fail("outputs must name at least one tensor", ("outputs",))
    _check_used(p, statements, {o.tensor for o in outputs})

    mdef = p.mapping(data.get("machine", {}), ("machine",), _MACHINE_KEYS, "machine")
    sizes = {}
    for key, value in mdef.items():  # keys the mapping check let through: those of _MACHINE_KEYS
        try:
            sizes[key] = parse_size(value, key)
        except ValueError as err:
            raise p.fail(str(err), ("machine", key)) from None
    scratch = data.get("scratch", str(Path(outputs[0].file).parent / f".{name}.scratch"))
    if not isinstance(scratch, str):
        raise p.fail("scratch must be a folder path", ("scratch",))
    return Spec(path, name, extents, tensors, tuple(statements), tuple(outputs), Machine(**sizes), scratch, p.lines)


def _symmetry(p: _Parser, tdef: dict, tname: str, indices: tuple[str, ...], extents: dict[str, int], where,
              source: Source | None) -> tuple[pairs.Symmetry | None, str]:
    """A tensor's ``symmetry`` and ``layout``: packed needs a symmetry, and a file to be read from
    or an output to be written to (a random or computed source has no layout)."""
    symmetry = None
    if "symmetry" in tdef:
        try:
            symmetry = pairs.parse(tdef["symmetry"], indices, extents)
        except ValueError as err:
            raise p.fail(f"tensor {tname!r}: {err}", where + ("symmetry",)) from None
    layout = tdef.get("layout", "dense")
    if layout not in ("dense", "packed") + pairs.LAYOUTS:
        raise p.fail(f"tensor {tname!r}: layout is dense, packed or one of {', '.join(pairs.LAYOUTS)}, not "
                     f"{quoted(layout)}", where + ("layout",))
    if layout == "dense":
        return symmetry, layout
    if symmetry is None:
        raise p.fail(f"tensor {tname!r}: a packed layout needs a symmetry to pack", where + ("layout",))
    if source is not None and source.file is None and source.compute is None:
        raise p.fail(f"tensor {tname!r}: only a tensor read from a file or computed by a source (or written as an "
                     "output) has a packed layout",
                     where + ("layout",))
    kind = symmetry.kind(len(indices)) if layout == "packed" else layout
    if kind not in symmetry.layouts(len(indices)):
        raise p.fail(f"tensor {tname!r}: layout {kind} packs what its symmetry does not declare (it allows "
                     f"{', '.join(symmetry.layouts(len(indices)))})", where + ("layout",))
    whole = symmetry.kind(len(indices))
    if source is not None and source.seed is not None and kind != whole:
        # `generate` makes each stored value on its own: values the symmetry equates but the
        # layout stores twice would differ, and a run that takes one for the other is wrong
        raise p.fail(f"tensor {tname!r}: seeded values stored as {kind} would lack the symmetry it declares "
                     f"beyond {kind} (generate makes each stored value on its own): store it as {whole}, or declare "
                     f"only what {kind} packs", where + ("layout",))
    return symmetry, kind


def _parse_source(p: _Parser, sdef, where, tname) -> Source:
    if isinstance(sdef, dict) and "compute" in sdef:
        return _computed(p, sdef, where, tname)
    sdef = p.mapping(sdef, where, _SOURCE_KEYS, f"source of {tname!r}")
    for key in ("seed", "random"):
        if key in sdef and (not isinstance(sdef[key], int) or isinstance(sdef[key], bool) or sdef[key] < 0):
            raise p.fail(f"{key} of {tname!r} must be a non-negative integer", where + (key,))
        if key in sdef and sdef[key] >= SEEDS:
            raise p.fail(f"{key} of {tname!r} must be below {SEEDS} (2**24): the generator makes seed "
                         f"{sdef[key] % SEEDS}'s values for it", where + (key,))
    if "random" in sdef:
        if set(sdef) != {"random"}:
            raise p.fail(f"source of {tname!r}: 'random' stands alone (no file, dataset or seed)", where)
        return Source(random=sdef["random"])
    if "expr" in sdef:
        if set(sdef) != {"expr"} or not isinstance(sdef["expr"], str):
            raise p.fail(f"source of {tname!r}: 'expr' stands alone and is a string", where)
        try:
            expr.parse(sdef["expr"])
        except ValueError as err:
            raise p.fail(f"tensor {tname!r}: {err}", where + ("expr",)) from None
        return Source(expr=sdef["expr"])
    if not isinstance(sdef.get("file"), str) or not sdef["file"] or not isinstance(sdef.get("dataset"), str):
        raise p.fail(f"source of {tname!r} needs 'file' and 'dataset' (or 'random: SEED')", where)
    _dataset(p, sdef["dataset"], f"source of {tname!r}", where + ("dataset",), nested=True)
    return Source(file=sdef["file"], dataset=sdef["dataset"], seed=sdef.get("seed"))


def _computed(p: _Parser, sdef: dict, where, tname: str) -> Source:
    """A registered source: its name (one :func:`chainexec.sources.lookup` knows), its
    parameters, each a string or a number, and optionally ``bytes_per_second``, a positive
    number: the rate it makes values at."""
    from chainexec import sources

    try:
        sources.lookup(sdef["compute"])
    except ChainexecError as err:
        raise p.fail(f"source of {tname!r}: {err}", where + ("compute",)) from None
    rate = sdef.get("bytes_per_second")
    if "bytes_per_second" in sdef and not (isinstance(rate, (int, float)) and not isinstance(rate, bool)
                                           and math.isfinite(rate) and rate > 0):
        raise p.fail(f"source of {tname!r}: bytes_per_second must be a positive number, not {quoted(rate)}",
                     where + ("bytes_per_second",))
    parameters = {k: v for k, v in sdef.items() if k not in ("compute", "bytes_per_second")}
    for key, value in parameters.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise p.fail(f"source of {tname!r}: parameter {quoted(key)} must be a string or a number, not "
                         f"{quoted(value)}", where + (key,))
    return Source(compute=sdef["compute"], parameters=tuple(sorted(parameters.items())),
                  bytes_per_second=None if rate is None else float(rate))


def _extent(value) -> bool:
    """Whether ``value`` is an extent: an integer from 1 to :data:`MAX_SIZE`."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_SIZE


def _check_elements(p: _Parser, name: str, indices, extents: dict[str, int], where) -> None:
    """A tensor holds at most :data:`MAX_SIZE` elements."""
    if math.prod(extents[i] for i in indices) > MAX_SIZE:
        raise p.fail(f"tensor {name!r} would hold more than 2^63 - 1 elements (the product of its extents)", where)


def _dtype(p: _Parser, value, what: str, where) -> str:
    """``value`` where it names a dtype; ``what`` prefixes the error."""
    if not isinstance(value, str) or value not in DTYPES:
        raise p.fail(f"{what}dtype {quoted(value)} is not supported (float64 or float32)", where)
    return value


def _dataset(p: _Parser, name: str, what: str, where, nested: bool) -> str:
    """``name`` where it names an HDF5 dataset plainly: printable, and made of parts none of which
    is empty, ``.`` or ``..`` (HDF5 reads those as paths). ``nested`` (an input, which may lie in
    a group): parts joined by single ``/``; else (an output: one dataset at the top of its file,
    so that no two outputs overlap) one part, without ``/``."""
    parts = name.split("/") if nested else [name]
    if not name.isprintable() or any(part in ("", ".", "..") or (not nested and "/" in part) for part in parts):
        rule = ("names of groups and the dataset joined by single '/', none of them empty, '.' or '..'" if nested
                else "a name without '/', not empty, '.' or '..'")
        raise p.fail(f"{what}: dataset {quoted(name)} is not a plain HDF5 dataset name ({rule})", where)
    return name


def _check_expr(p: _Parser, t: Tensor, tensors: dict, extents) -> None:
    """A computed tensor reads dense inputs with a file or random source, over its own indices,
    each index once per reference."""
    where = ("tensors", t.name, "source", "expr")
    for ref in expr.text_refs(t.source.expr):
        other = tensors.get(ref.tensor)
        if other is None or other.source is None or other.source.expr is not None:
            raise p.fail(f"tensor {t.name!r}: {ref.tensor!r} in its expression is not an input with a file "
                         "or random source", where)
        if len(ref.indices) != len(other.indices):
            raise p.fail(f"tensor {t.name!r}: {ref.tensor} has {len(other.indices)} indices, the expression "
                         f"gives {len(ref.indices)}", where)
        if len(set(ref.indices)) != len(ref.indices):
            raise p.fail(f"tensor {t.name!r}: {ref.tensor}[{','.join(ref.indices)}] in its expression repeats an "
                         "index (diagonals are not supported)", where)
        if other.layout != "dense":
            raise p.fail(f"tensor {t.name!r}: {ref.tensor} in its expression is stored packed (layout "
                         f"{other.layout}); an expression reads dense inputs: store {ref.tensor} dense, or use it "
                         "in a statement", where)
        for mine, theirs in zip(ref.indices, other.indices):
            if mine not in t.indices:
                raise p.fail(f"tensor {t.name!r}: index {mine!r} in its expression is not one of its indices", where)
            if extents[mine] != extents[theirs]:
                raise p.fail(f"tensor {t.name!r}: index {mine!r} has extent {extents[mine]} but {other.name}'s "
                             f"dimension {theirs!r} has {extents[theirs]}", where)
        if other.dtype != t.dtype:
            raise p.fail(f"dtype mismatch in tensor {t.name!r}: {other.name} is {other.dtype}", where)


def _symmetric(p, value, oname: str, tensor: Tensor, statements, extents, where) -> tuple[str, ...]:
    """An output's ``symmetric`` indices: two or more distinct indices of one extent that the
    output is summed over (none of its own indices) and that occur in its statements."""
    where = where + ("symmetric",)
    if value == []:
        return ()
    if not isinstance(value, list) or len(value) < 2 or not all(isinstance(i, str) for i in value):
        raise p.fail(f"output {oname!r}: symmetric must list two or more index names, got {value!r}", where)
    if len(set(value)) != len(value):
        raise p.fail(f"output {oname!r}: symmetric lists an index twice: {value}", where)
    used = {i for st in statements if st.lhs.tensor == oname for r in st.operands for i in r.indices}
    for i in value:
        if i not in extents:
            raise p.fail(f"output {oname!r}: symmetric index {i!r} is not declared", where)
        if i in tensor.indices:
            raise p.fail(f"output {oname!r}: symmetric index {i!r} is one of its own indices "
                         "(only indices it is summed over can be symmetric)", where)
        if i not in used:
            raise p.fail(f"output {oname!r}: symmetric index {i!r} does not occur in the statements "
                         "that assign it", where)
    if len({extents[i] for i in value}) > 1:
        raise p.fail(f"output {oname!r}: symmetric indices must have one extent, got "
                     + ", ".join(f"{i}={extents[i]}" for i in value), where)
    return tuple(value)


def _check_symmetry_kept(p: _Parser, statements: list[Statement], extents, tensors: dict) -> None:
    """Every statement into a tensor declared symmetric keeps that symmetry (:func:`pairs.preserved`)."""
    declared = {t.name: t.symmetry for t in tensors.values() if t.symmetry is not None}
    for k, st in enumerate(statements):
        symmetry = declared.get(st.lhs.tensor)
        if symmetry is None:
            continue
        why = pairs.preserved(st.lhs.indices, symmetry, [(r.tensor, r.indices) for r in st.operands], declared,
                              extents)
        if why is not None:
            raise p.fail(f"'{st.text}' assigns {st.lhs.tensor!r}, declared symmetric, but {why}", ("statements", k))


def _check_statements(p: _Parser, statements: list[Statement], extents, tensors: dict) -> None:
    """Indices known and consistent, every index in at least two places, tensors declared or assigned."""
    assigned: set[str] = set()
    for k, st in enumerate(statements):
        where = ("statements", k)
        refs = (st.lhs,) + st.operands
        for ref in refs:
            for i in ref.indices:
                if i not in extents:
                    raise p.fail(f"unknown index {i!r} in statement '{st.text}'", where)
        for ref in st.operands:
            t = tensors.get(ref.tensor)
            if t is None:
                raise p.fail(f"unknown tensor {ref.tensor!r} in statement '{st.text}'", where)
            if t.source is None and ref.tensor not in assigned:
                raise p.fail(f"tensor {ref.tensor!r} is read in '{st.text}' before any statement assigns it", where)
            _check_shape(p, ref, t, extents, st, where)
        lhs = tensors.get(st.lhs.tensor)
        if lhs is None:
            dtypes = {tensors[r.tensor].dtype for r in st.operands}
            lhs = Tensor(st.lhs.tensor, st.lhs.indices, dtypes.pop() if len(dtypes) == 1 else "float64")
            _check_elements(p, lhs.name, lhs.indices, extents, where)
            tensors[st.lhs.tensor] = lhs
        elif lhs.source is not None:
            raise p.fail(f"statement '{st.text}' assigns {st.lhs.tensor!r}, which is an input", where)
        _check_shape(p, st.lhs, lhs, extents, st, where)
        if not abs(st.factor) <= _LARGEST[lhs.dtype]:  # false for NaN too
            raise p.fail(f"'{st.text}': its factor {st.factor!r} is not a finite {lhs.dtype}", where)
        if 0 < abs(st.factor) < _SMALLEST[lhs.dtype]:
            raise p.fail(f"'{st.text}': its factor {st.factor!r} is below the smallest {lhs.dtype} and would be 0 "
                         "(every value of the result 0)", where)
        if st.accumulate and st.lhs.tensor not in assigned:
            raise p.fail(f"'{st.text}' accumulates into {st.lhs.tensor!r} before any '=' assigns it", where)
        # Each tensor has one value (the planner fuses and stores by name): a second '=' would
        # silently mix two of them, and a term reading what it adds to has no defined tile order.
        if not st.accumulate and st.lhs.tensor in assigned:
            raise p.fail(f"'{st.text}' assigns {st.lhs.tensor!r} a second time; give the new value its own name", where)
        if any(ref.tensor == st.lhs.tensor for ref in st.operands):
            raise p.fail(f"'{st.text}' reads {st.lhs.tensor!r}, the tensor it assigns; write the result to a new name",
                         where)
        for ref in st.operands:
            if tensors[ref.tensor].dtype != lhs.dtype:
                raise p.fail(
                    f"dtype mismatch in '{st.text}': {ref.tensor} is {tensors[ref.tensor].dtype}, "
                    f"{lhs.name} is {lhs.dtype}",
                    where,
                )
        places: dict[str, int] = {}
        for ref in refs:
            for i in ref.indices:
                places[i] = places.get(i, 0) + 1
        for i, n in places.items():
            if n < 2:
                role = "kept" if i in st.lhs.indices else "contracted"
                raise p.fail(
                    f"index {i!r} appears only once in '{st.text}': it must appear in two places to be {role}",
                    where,
                )
        assigned.add(st.lhs.tensor)


def _check_used(p: _Parser, statements: list[Statement], outputs: set[str]) -> None:
    """Every statement's result is an output or read by a later statement: a result nothing
    reads (a forgotten output, a misspelt name) would be computed and thrown away."""
    read: set[str] = set()
    for k in reversed(range(len(statements))):
        st = statements[k]
        if st.lhs.tensor not in outputs and st.lhs.tensor not in read:
            raise p.fail(f"'{st.text}' computes {st.lhs.tensor!r}, which no output names and no later statement "
                         f"reads: add {st.lhs.tensor} to outputs or remove the statement", ("statements", k))
        read.update(ref.tensor for ref in st.operands)


def _check_shape(p, ref: Ref, t: Tensor, extents, st: Statement, where) -> None:
    if len(ref.indices) != len(t.indices):
        raise p.fail(f"{ref} in '{st.text}' has {len(ref.indices)} indices, {t.name} has {len(t.indices)}", where)
    for mine, theirs in zip(ref.indices, t.indices):
        if extents[mine] != extents[theirs]:
            raise p.fail(
                f"{ref} in '{st.text}': index {mine!r} has extent {extents[mine]} but {t.name}'s "
                f"dimension {theirs!r} has {extents[theirs]}",
                where,
            )

