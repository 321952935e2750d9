"""``chainexec chem``: prepare a job from a molecule — its inputs (HDF5) and the config that reads them.

Two jobs (:data:`JOBS`): ``ccsd_t`` writes ``OUT/inputs.h5``, the (T) inputs of
:func:`chainexec.chem.bridge.write_ccsd_inputs` (or seeded random ones of any size,
:func:`chainexec.chem.bridge.synthetic_inputs`), and ``OUT/ccsd_t.yaml``; ``ao2mo`` writes
``OUT/inputs.h5``, AO integrals and MO coefficients, and ``OUT/ao2mo.yaml``. The config is a
copy of a template (``configs/ccsd_t.yaml``, ``configs/ao2mo.yaml``) with the molecule's
extents and its files in ``OUT``. Molecules are named (:data:`MOLECULES`) or given as a PySCF atom
string (Angstrom).

Every input is checked before PySCF computes anything, each problem a one-line
:class:`ChainexecError`: the options (:data:`OPTIONS`), the template (a valid config of the job's
shape: its ranges are the job's, and each tensor it reads from a file is a dataset the job writes,
of the shape the job writes it), the molecule and basis (built, not solved), ``frozen`` against the
occupied orbitals (half the molecule's electrons), and the size of the inputs (:func:`check_size`).
The inputs are written first, whole or not at all; then the configs in ``OUT`` (of an earlier job,
which described the inputs replaced) are removed and the job's config is written, whole or not at
all. A config in ``OUT`` thus always describes the inputs beside it. Only files an earlier
``chainexec chem`` wrote are replaced or removed (:func:`check_out`): a user's own ``inputs.h5``
or config of those names in ``OUT`` is refused before anything is computed.
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from chainexec import atomicfile, safepaths, spec, specyaml, stopsignals
from chainexec.chem.layout import AO2MO_INDICES, INDICES, SYNTHETIC_IN_MEMORY
from chainexec.pairs import npair
from chainexec.errors import ChainexecError

#: Equilibrium-like geometries in Angstrom (PySCF atom strings).
MOLECULES = {
    "h2o": "O 0 0 0.1173; H 0 0.7572 -0.4692; H 0 -0.7572 -0.4692",
    "n2": "N 0 0 0.5488; N 0 0 -0.5488",
    "benzene": "; ".join([
        "C 0.0000 1.3970 0", "C 1.2098 0.6985 0", "C 1.2098 -0.6985 0", "C 0.0000 -1.3970 0",
        "C -1.2098 -0.6985 0", "C -1.2098 0.6985 0", "H 0.0000 2.4810 0", "H 2.1486 1.2405 0",
        "H 2.1486 -1.2405 0", "H 0.0000 -2.4810 0", "H -2.1486 -1.2405 0", "H -2.1486 1.2405 0"]),
    "pyridine": "; ".join([
        "N 0.0 1.4029 0.0", "C 1.1408 0.7176 0.0", "C -1.1408 0.7176 0.0", "C 1.1970 -0.6754 0.0",
        "C -1.1970 -0.6754 0.0", "C 0.0 -1.3929 0.0", "H 2.0598 1.3004 0.0", "H -2.0598 1.3004 0.0",
        "H 2.1594 -1.1764 0.0", "H -2.1594 -1.1764 0.0", "H 0.0 -2.4777 0.0"]),
    # benzene's ring with a methoxy group in its plane (C-O 1.364, O-CH3 1.424 Angstrom, C-O-C
    # 117.7 degrees), the methyl's hydrogens tetrahedral: 352 functions in cc-pVTZ
    "anisole": "; ".join([
        "C 0.0000 1.3970 0", "C 1.2098 0.6985 0", "C 1.2098 -0.6985 0", "C 0.0000 -1.3970 0",
        "C -1.2098 -0.6985 0", "C -1.2098 0.6985 0", "O 0.0000 2.7610 0", "C 1.2608 3.4229 0",
        "H 2.1486 -1.2405 0", "H 0.0000 -2.4810 0", "H -2.1486 -1.2405 0", "H -2.1486 1.2405 0",
        "H 2.1486 1.2405 0", "H 1.1053 4.5018 0", "H 1.8218 3.1372 0.8898", "H 1.8218 3.1372 -0.8898"]),
}


@dataclass(frozen=True)
class Job:
    """One kind of job, ``name`` (a key of :data:`JOBS`): ``config``, the file name of its config in
    ``OUT``; ``output``, the file in ``OUT`` its outputs go to; ``datasets``, each input dataset's
    index letters; ``ranges``, the config range each letter runs over; ``sizes``, the key of the
    writer's summary that holds each range's extent; ``writer``, the :mod:`chainexec.chem.bridge`
    function that writes the inputs from a molecule; ``options``, the keywords of :data:`OPTIONS`
    that writer takes."""

    name: str
    config: str
    output: str
    datasets: dict[str, str]
    ranges: dict[str, str]
    sizes: dict[str, str]
    writer: str
    options: tuple[str, ...]


def _range_of(**letters: str) -> dict[str, str]:
    """Index letter -> range name, from ``range=letters``."""
    return {letter: name for name, all_letters in letters.items() for letter in all_letters}


JOBS = {
    "ccsd_t": Job("ccsd_t", "ccsd_t.yaml", "energy.h5", INDICES, _range_of(occ="ijkm", vir="abcf"),
                  {"occ": "nocc", "vir": "nvir"}, "write_ccsd_inputs",
                  ("charge", "frozen", "scf_conv_tol", "scf_max_cycle", "ccsd_conv_tol", "ccsd_max_cycle")),
    "ao2mo": Job("ao2mo", "ao2mo.yaml", "output.h5", AO2MO_INDICES, _range_of(ao="pqrs", mo="a"),
                 {"ao": "nao", "mo": "nmo"}, "write_ao2mo_inputs",
                 ("charge", "scf_conv_tol", "scf_max_cycle", "layout")),
}
"""What ``chainexec chem`` prepares."""

TEMPLATES = {name: Path(__file__).resolve().parents[2] / "configs" / kind.config for name, kind in JOBS.items()}
"""Each job's default template: ``configs/ccsd_t.yaml``, ``configs/ao2mo.yaml``."""


def _tolerance(value) -> bool:
    return math.isfinite(value) and value > 0


#: The PySCF options of :func:`prepare` (``chainexec chem --frozen``, ``--scf-conv-tol``, ...):
#: whether a value is valid, and what a valid one is.
OPTIONS = {
    "charge": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
               "a whole number of elementary charges"),
    "frozen": (lambda v: v >= 0, "0 or more orbitals"),
    "scf_conv_tol": (_tolerance, "a positive number of Hartree"),
    "scf_max_cycle": (lambda v: v >= 1, "at least 1 iteration"),
    "ccsd_conv_tol": (_tolerance, "a positive number of Hartree"),
    "ccsd_max_cycle": (lambda v: v >= 1, "at least 1 iteration"),
    "layout": (lambda v: v in ("s8", "s4", "dense", "computed"), "s8, s4, dense or computed"),
}


def flag(option: str) -> str:
    """The ``chainexec chem`` flag of a keyword of :data:`OPTIONS`."""
    return "--" + option.replace("_", "-")


def prepare(molecule: str, out: str | Path, *, template: str | Path, job: str = "ccsd_t", basis: str = "cc-pvdz",
            synthetic: tuple[int, int, int] | None = None, missing: bool = False, **options) -> dict:
    """Write the inputs and the config of ``job`` for ``molecule`` (a name or an atom string) in
    ``basis`` into folder ``out``, the config made from ``template``; with ``synthetic=(nocc,
    nvir, seed)`` seeded random (T) inputs instead of PySCF's. ``options``: keywords of
    :data:`OPTIONS`: ``charge`` the molecule's (0 where not given), the others for the job's PySCF
    writer (its defaults where not given). Returns the
    writer's summary with ``config``, the config's path. ``missing`` (a batch job submitted
    again): where the inputs and the config are both in ``out`` already, nothing is written once
    they are found made for this job (:func:`check_made`; the summary then says ``kept``), and
    where only one of them is, that is refused."""
    if job not in JOBS:
        raise ChainexecError(f"unknown chem job {job!r} ({', '.join(JOBS)})")
    kind = JOBS[job]
    _check_options(kind, options, synthetic)
    charge = int(options.pop("charge", 0))
    cfg, lines = _template(template, kind, detected=Path(template).resolve() == TEMPLATES[job])
    if synthetic is not None:
        extents, what, mol = _synthetic(kind, synthetic), "--synthetic " + " ".join(map(str, synthetic)), None
    else:
        mol = _molecule(molecule, basis, charge)
        what = f"{molecule!r}{f' of charge {charge:+d}' if charge else ''} in {basis}"
        extents = _extents(kind, mol, options.get("frozen", 0), what)
    layout = options.get("layout", "s8") if kind.name == "ao2mo" else None
    source = None if mol is None else {"atoms": mol.atom, "basis": basis}
    _config(cfg, kind, extents, template, lines, layout, source)
    if isinstance(out, str) and not out.strip():
        raise ChainexecError(f"--out {out!r}: an empty path; name the folder (. for this one)")
    out = Path(out)
    config = out / kind.config
    if missing and ((out / "inputs.h5").exists() or config.exists()):
        made_for = ({"synthetic": True, "nocc": synthetic[0], "nvir": synthetic[1], "seed": synthetic[2]}
                    if synthetic is not None else
                    {"atoms": source["atoms"], "basis": basis, "charge": charge}
                    | ({"layout": layout} if layout is not None else {"frozen": options.get("frozen", 0)}))
        check_made(out, kind, made_for, _config(cfg, kind, extents, template, lines, layout, source))
        return {"path": str(out / "inputs.h5"), "config": str(config), "kept": True}
    check_out(out)
    check_size(out, _shapes(kind, extents, layout), what, in_memory=SYNTHETIC_IN_MEMORY if synthetic is not None else ())
    made = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ChainexecError(f"cannot create folder ({err.strerror})", str(out)) from None
    inputs = out / "inputs.h5"
    before = {path: _identity(path) for path in (inputs, config)}

    def undo() -> None:
        """What a failed or stopped job leaves: nothing of its own, judged by the files in place,
        not by flags (a signal's undo runs beside the main thread, whose flags lag its renames):
        with its config in place the job is complete; else its inputs, where in place, go with
        every job config there (they described the inputs these replaced), then the folders it
        made, empty by then."""
        if _identity(config) not in (None, before[config]) and _identity(inputs) != before[inputs]:
            return
        if _identity(inputs) != before[inputs]:
            inputs.unlink(missing_ok=True)
            for other in JOBS.values():
                (out / other.config).unlink(missing_ok=True)
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()

    try:
        with stopsignals.undone_on_stop(undo):
            summary = _write_inputs(kind, inputs, mol, synthetic, options, what)
            if layout == "computed":
                from chainexec.chem import integrals

                source["bytes_per_second"] = float(f"{integrals.rate(mol):.3g}")
            for other in JOBS.values():
                (out / other.config).unlink(missing_ok=True)
            text = _config(cfg, kind, {r: summary[key] for r, key in kind.sizes.items()}, template, lines, layout,
                           source)
            try:
                atomicfile.write(config, text, atomicfile.USER_FILE)
            except OSError as err:
                raise ChainexecError(f"cannot write the config ({err.strerror})", str(config)) from None
    except BaseException:
        undo()
        raise
    return summary | {"config": str(config)}


def _identity(path: Path) -> tuple | None:
    """Which file is at ``path`` (device, inode, modification time, size); None where none is."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


HEADER = "# written by chainexec chem; the next chem run into this folder replaces it\n"
"""The first line of every config ``chainexec chem`` writes: the mark of a config it may replace."""


def check_made(out: Path, kind: Job, made_for: dict, text: str) -> None:
    """Refuse ``out``'s inputs and config unless both exist, the inputs carry ``made_for`` as their
    file attributes (the molecule's atom string and charge, the basis, ``frozen`` or the layout; a synthetic
    job's extents and seed) and the config is ``text`` (the template's copy for them; a computed
    source's measured rate aside): a job submitted again with another molecule, basis or
    template would otherwise run on the first one's inputs, and check the energy against theirs."""
    import h5py

    inputs, config = out / "inputs.h5", out / kind.config
    absent = [str(p) for p in (inputs, config) if not p.exists()]
    if absent:
        raise ChainexecError(f"{absent[0]} is missing beside the other: remove both for new ones, or name another "
                             "--out folder", str(out))
    try:
        with h5py.File(inputs, "r") as f:
            found = {name: f.attrs.get(name, ABSENT.get(name)) for name in made_for}
    except OSError as err:
        raise ChainexecError(f"the inputs cannot be read ({err})", str(inputs)) from None
    found = {name: value.item() if hasattr(value, "item") else value for name, value in found.items()}

    def named(name, value):  # PySCF's basis names ignore case
        return value.lower() if name == "basis" and isinstance(value, str) else value

    differ = [name for name, value in made_for.items() if named(name, found[name]) != named(name, value)]
    if differ:
        shown = ", ".join(f"{name} {found[name]!r} (here {made_for[name]!r})" for name in differ)
        raise ChainexecError(f"the inputs there were made for another job: {shown}; remove them and the config, or "
                             "name another --out folder", str(inputs))
    if _rateless(config.read_text(encoding="utf-8", errors="replace")) != _rateless(text):
        raise ChainexecError("is not the config the template gives for these inputs (the template changed?): remove "
                             "it for a new one, or name another --out folder", str(config))


ABSENT = {"charge": 0}
"""The value an attribute of :func:`check_made` has where the inputs lack it: inputs written
without their molecule's charge are a neutral molecule's."""


def _rateless(text: str):
    """A config's data without a computed source's ``bytes_per_second`` (measured each time); text
    that is not YAML as it is (then unequal to any config chem writes)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    for tensor in (data.get("tensors") or {}).values() if isinstance(data, dict) else ():
        if isinstance(tensor, dict) and isinstance(tensor.get("source"), dict):
            tensor["source"].pop("bytes_per_second", None)
    return data


def check_out(out: Path) -> None:
    """Refuse a folder ``out`` whose ``inputs.h5`` or job configs (:data:`JOBS`) exist and were
    not written by ``chainexec chem`` (the inputs' mark :data:`chainexec.chem.bridge.MADE`, the
    configs' first line :data:`HEADER`): the job replaces or removes those names. Refuse one that
    holds a job's output (``energy.h5``, ``output.h5``) too: a run's result on the inputs the job
    replaces, which would lie beside the new inputs marked complete."""
    import h5py

    from chainexec.chem.bridge import MADE

    if out.exists() and not out.is_dir():
        raise ChainexecError("--out is a file, not a folder", str(out))
    if not out.exists():  # its folders are made where nothing can be written: said as such, first
        try:
            atomicfile.probe(out, folders_made=True)
        except OSError as err:
            raise ChainexecError(f"cannot create folder ({err.strerror or err})", str(out)) from None

    def marked(path: Path) -> bool:
        with h5py.File(path, "r") as f:
            return bool(f.attrs.get(MADE, False))

    def headed(path: Path) -> bool:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline() == HEADER

    for path, ours in [(out / "inputs.h5", marked), *((out / kind.config, headed) for kind in JOBS.values())]:
        if path.exists():
            try:
                mine = ours(path)
            except OSError:
                mine = False
            if not mine:
                raise ChainexecError("exists and was not written by chainexec chem, which would remove or replace "
                                     "it: move it or name another --out folder", str(path))
    for kind in JOBS.values():
        if (out / kind.output).exists():
            raise ChainexecError(f"holds {kind.output}, a result of the inputs this job replaces, which would lie "
                                 "beside the new ones: move it (with its .parts folder) or name another --out folder",
                                 str(out))


def _check_options(kind: Job, options: dict, synthetic) -> None:
    for name, value in options.items():
        if synthetic is not None or name not in kind.options:
            raise ChainexecError(f"{flag(name)} does not apply to "
                                 + ("--synthetic inputs" if synthetic is not None else f"the {kind.name} job"))
        valid, what = OPTIONS[name]
        if not valid(value):
            raise ChainexecError(f"{flag(name)} must be {what}, not {value!r}")


def _template(template: str | Path, kind: Job, detected: bool = False) -> tuple[dict, dict]:
    """The template's config (a mapping) and its line map, once it is a valid config whose ranges
    are ``kind``'s; ``detected``: without the template's memory limits (``machine:``'s
    ``global_memory`` and ``device_memory``, and the section where nothing else is left), so that a
    run detects them (:mod:`chainexec.detect`). The shipped templates' limits are their own
    examples' (H2O), not a limit for the molecule a user prepares; a user's template keeps its own."""
    where = str(template)
    try:
        text = Path(template).read_text(encoding="utf-8")
    except OSError as err:
        raise ChainexecError(f"cannot read the config template: {err.strerror}", where) from None
    except UnicodeDecodeError:
        raise ChainexecError("the config template is not UTF-8 text", where) from None
    lines = spec.loads(text, where).lines
    cfg = specyaml.compose(text, where)[0]
    ranges, wanted = list(cfg.get("ranges", {})), sorted(set(kind.ranges.values()))
    if sorted(ranges) != wanted:
        raise ChainexecError(f"the template's ranges ({', '.join(ranges) or 'none'}) are not the {kind.name} job's "
                             f"({', '.join(wanted)})", where, lines.get(("ranges",)))
    if detected and isinstance(cfg.get("machine"), dict):
        for limit in ("global_memory", "device_memory"):
            cfg["machine"].pop(limit, None)
        if not cfg["machine"]:
            del cfg["machine"]
    return cfg, lines


def _synthetic(kind: Job, synthetic: tuple[int, int, int]) -> dict[str, int]:
    nocc, nvir, seed = synthetic
    if kind.name != "ccsd_t":
        raise ChainexecError(f"--synthetic makes (T) inputs; the {kind.name} job needs a molecule")
    if nocc < 1 or nvir < 1 or not 0 <= seed < 1 << 64:
        raise ChainexecError(f"--synthetic {nocc} {nvir} {seed}: NOCC and NVIR must be at least 1, SEED 0 or more "
                             "and below 2^64 (it is stored as an unsigned 64-bit integer)")
    extents = {"occ": nocc, "vir": nvir}
    largest = max(_shapes(kind, extents).items(), key=lambda item: math.prod(item[1]))
    if math.prod(largest[1]) > spec.MAX_SIZE:
        raise ChainexecError(f"--synthetic {nocc} {nvir} {seed}: dataset {largest[0]} would hold "
                             f"{math.prod(largest[1]):.3g} elements, more than 2^63 - 1")
    return extents


def _molecule(molecule: str, basis: str, charge: int = 0):
    """PySCF's molecule of ``charge`` (built, not solved; :func:`chainexec.chem.bridge.molecule`) of a
    name, an atom string or a geometry file (which PySCF reads); a file's atoms are made an atom string
    (:func:`chainexec.chem.bridge.atom_text`), the molecule's, config's and inputs'."""
    try:
        from chainexec.chem import bridge

        atoms = MOLECULES.get(molecule.lower(), molecule)
        mol = bridge.molecule(atoms, basis, charge)
        return bridge.molecule(bridge.atom_text(mol), basis, charge) if os.path.isfile(atoms) else mol
    except ImportError:
        raise ChainexecError("`chainexec chem` needs PySCF: pip install 'chainexec[chem]'") from None
    except ValueError as err:
        raise ChainexecError(f"{molecule!r}: {err}") from None


def _extents(kind: Job, mol, frozen: int, what: str) -> dict[str, int]:
    """The job's range extents for ``mol``, known before any SCF: a closed shell fills half its
    electrons' count of orbitals, and RHF makes as many orbitals as the basis has functions
    (refused where they are fewer than the occupied ones)."""
    occupied = mol.nelectron // 2
    if kind.name == "ao2mo":
        if occupied > mol.nao:
            raise ChainexecError(f"{what} has {occupied} occupied orbitals, more than its {mol.nao} orbitals")
        return {"ao": mol.nao, "mo": mol.nao}
    if frozen >= occupied:
        raise ChainexecError(f"--frozen {frozen} must be fewer than the {occupied} occupied orbitals of {what}")
    if mol.nao <= occupied:
        raise ChainexecError(f"{what} has no virtual orbital ({mol.nao} orbitals, {occupied} occupied)")
    return {"occ": occupied - frozen, "vir": mol.nao - occupied}


def _shapes(kind: Job, extents: dict[str, int], layout: str | None = None) -> dict[str, tuple[int, ...]]:
    """Each input dataset's shape for these range extents (dense; ``A`` in ``layout`` where it is
    packed: PySCF's ``mol.intor("int2e", aosym=layout)``)."""
    shapes = {name: tuple(extents[kind.ranges[letter]] for letter in letters) for name, letters in kind.datasets.items()}
    if layout in ("s4", "s8"):
        pairs = npair(shapes["A"][0])
        shapes["A"] = (pairs, pairs) if layout == "s4" else (npair(pairs),)
    if layout == "computed":
        del shapes["A"]
    return shapes


def check_size(out: Path, shapes: dict[str, tuple[int, ...]], what: str, in_memory: tuple[str, ...] = ()) -> None:
    """Refuse inputs of these float64 ``shapes`` that cannot be written: where the file would
    exceed the free space of ``out``'s file system (its nearest existing folder) or where the
    bytes held at once of the arrays named ``in_memory`` (synthetic inputs made whole in memory
    before they are written, :data:`chainexec.chem.layout.SYNTHETIC_IN_MEMORY`) — each of them,
    and one temporary the size of the largest while it is symmetrized, a count just above the
    process's actual peak — would exceed this machine's physical memory."""
    sizes = [spec.DTYPES["float64"] * math.prod(shape) for shape in shapes.values()]
    made = [spec.DTYPES["float64"] * math.prod(shapes[name]) for name in in_memory if name in shapes]
    free = shutil.disk_usage(safepaths.nearest_existing(out)).free
    if sum(sizes) > free:
        raise ChainexecError(f"{what}: the inputs would take {spec.format_size(sum(sizes))}, more than the "
                             f"{spec.format_size(free)} free here", str(out))
    held, memory = sum(made) + max(made, default=0), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if held > memory:
        raise ChainexecError(f"{what}: making the inputs would hold {spec.format_size(held)} in memory, more than "
                             f"this machine's {spec.format_size(memory)}")


def _config(cfg: dict, kind: Job, extents: dict[str, int], template, lines: dict, layout: str | None = None,
            molecule: dict | None = None) -> str:
    """The config (YAML text) of the template ``cfg`` with these extents, its inputs read from
    ``inputs.h5``, its outputs written to ``kind.output`` and its scratch in ``scratch``, all
    beside it; each tensor read from a file must be a dataset ``kind`` writes, of its shape.
    ``layout``: the layout of the tensors read from the integrals' dataset ``A`` (the ao2mo
    job's ``--layout``), where given; ``computed``: read from the registered source
    ``pyscf.int2e`` of ``molecule`` (its ``atoms`` and ``basis``) instead, in s8."""
    cfg = copy.deepcopy(cfg)
    cfg["ranges"] = {name: extents[name] for name in cfg["ranges"]}
    for t in cfg["tensors"].values():
        if "file" in t.get("source", {}):
            t["source"] = {"file": "inputs.h5", "dataset": t["source"]["dataset"]}
            if layout is not None and t["source"]["dataset"] == "A":
                t["layout"] = "s8" if layout == "computed" else layout
                if layout == "computed":  # the integrals of each tile computed where it is loaded
                    t["source"] = {"compute": "pyscf.int2e", **molecule}  # and bytes_per_second (prepare)
    for o in cfg["outputs"].values():
        o["file"] = kind.output
    cfg["scratch"] = "scratch"
    text = HEADER + yaml.safe_dump(cfg, sort_keys=False)
    config, shapes = spec.loads(text, str(template)), _shapes(kind, extents)
    for name, t in config.tensors.items():
        if t.source is None or t.source.file is None:
            continue
        line = lines.get(("tensors", name))
        if t.source.dataset not in shapes:
            raise ChainexecError(f"tensor {name!r} reads dataset {t.source.dataset!r}, which the {kind.name} job does "
                                 f"not write ({', '.join(shapes)})", str(template), line)
        if config.shape(name) != shapes[t.source.dataset]:
            raise ChainexecError(f"tensor {name!r} has the shape {config.shape(name)} where the {kind.name} job writes "
                                 f"{t.source.dataset!r} as {shapes[t.source.dataset]} (indices "
                                 f"{', '.join(kind.datasets[t.source.dataset])})", str(template), line)
    return text


def _write_inputs(kind: Job, path: Path, mol, synthetic, options: dict, what: str) -> dict:
    """Write the inputs (the bridge's writers, atomic) with their failures as one-line errors; a
    convergence failure names the options that would help."""
    from chainexec.chem import bridge

    try:
        if synthetic is not None:
            return bridge.synthetic_inputs(*synthetic, path)
        return getattr(bridge, kind.writer)(mol, path, **options)
    except bridge.NotConverged as err:
        raise ChainexecError(f"{what}: {err}: raise {flag(err.solver + '_max_cycle')} "
                             f"(or loosen {flag(err.solver + '_conv_tol')})") from None
    except (RuntimeError, ValueError) as err:
        raise ChainexecError(f"PySCF failed for {what}: {bridge.first_line(err)}") from None
    except OSError as err:
        raise ChainexecError(f"cannot write the inputs ({err})", str(path)) from None


def write_config(template: str | Path, path: Path, nocc: int, nvir: int, detected: bool = False) -> None:
    """The (T) config of ``template`` with these extents and its files beside ``path``;
    ``detected``: without the template's memory limits (:func:`_template`)."""
    kind = JOBS["ccsd_t"]
    cfg, lines = _template(template, kind, detected)
    atomicfile.write(path, _config(cfg, kind, {"occ": nocc, "vir": nvir}, template, lines), atomicfile.USER_FILE)
