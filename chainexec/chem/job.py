"""``chainexec chem``: prepare a CCSD(T) job — PySCF inputs and the config that reads them.

Writes ``OUT/inputs.h5`` (see :mod:`chainexec.chem.bridge`) and ``OUT/ccsd_t.yaml``: a copy of
the (T) chain config (default ``configs/ccsd_t.yaml``) with the occupied and virtual extents of
this molecule and its paths pointing at ``OUT``. Molecules are named (:data:`MOLECULES`) or given
as a PySCF atom string.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from chainexec.errors import ChainexecError

#: Equilibrium-like geometries in Angstrom (PySCF atom strings).
MOLECULES = {
    "h2o": "O 0 0 0.1173; H 0 0.7572 -0.4692; H 0 -0.7572 -0.4692",
    "n2": "N 0 0 0.5488; N 0 0 -0.5488",
    "benzene": "; ".join([
        "C 0.0000 1.3970 0", "C 1.2098 0.6985 0", "C 1.2098 -0.6985 0", "C 0.0000 -1.3970 0",
        "C -1.2098 -0.6985 0", "C -1.2098 0.6985 0", "H 0.0000 2.4810 0", "H 2.1486 1.2405 0",
        "H 2.1486 -1.2405 0", "H 0.0000 -2.4810 0", "H -2.1486 -1.2405 0", "H -2.1486 1.2405 0"]),
}


def prepare(molecule: str, out: str | Path, *, basis: str = "cc-pvdz", frozen: int = 0,
            template: str | Path, synthetic: tuple[int, int, int] | None = None, job: str = "ccsd_t") -> dict:
    """Write inputs and a config for ``molecule`` (a name or an atom string) into folder ``out``;
    with ``synthetic=(nocc, nvir, seed)`` write seeded random inputs instead of running PySCF.
    ``job``: ``ccsd_t`` (the (T) energy, ``OUT/ccsd_t.yaml``) or ``ao2mo`` (the AO→MO four-index
    transform of the molecule's integrals, ``OUT/fourindex.yaml``, from a four-index template)."""
    from chainexec.chem import bridge

    if job not in JOBS:
        raise ChainexecError(f"unknown chem job {job!r} ({', '.join(JOBS)})")
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ChainexecError(f"cannot create folder ({err.strerror})", str(out)) from None
    inputs = out / "inputs.h5"
    if job == "ao2mo":
        if synthetic is not None:
            raise ChainexecError("--synthetic makes (T) inputs; the ao2mo job needs a molecule")
        summary = _pyscf(bridge.write_ao2mo_inputs, molecule, basis, inputs)
        write_ao2mo_config(template, out / "fourindex.yaml", summary["nao"], summary["nmo"])
        return summary
    if synthetic is not None:
        summary = bridge.synthetic_inputs(*synthetic, inputs)
    else:
        summary = _pyscf(bridge.write_ccsd_inputs, molecule, basis, inputs, frozen=frozen)
    write_config(template, out / "ccsd_t.yaml", summary["nocc"], summary["nvir"])
    return summary


def _pyscf(write, molecule: str, basis: str, path: Path, **options) -> dict:
    """``write(atoms, basis, path, **options)`` (a PySCF bridge writer) with its failures turned
    into one-line user errors."""
    try:
        return write(MOLECULES.get(molecule.lower(), molecule), basis, path, **options)
    except ImportError:
        raise ChainexecError("`chainexec chem` needs PySCF: pip install 'chainexec[chem]'") from None
    except (RuntimeError, ValueError, KeyError) as err:
        raise ChainexecError(f"PySCF failed for {molecule!r} in {basis}: {err}") from None


JOBS = ("ccsd_t", "ao2mo")
"""What ``chainexec chem`` prepares."""


def write_ao2mo_config(template: str | Path, path: Path, nao: int, nmo: int) -> None:
    """The four-index template with these extents, reading ``A`` and ``C`` from ``inputs.h5`` and
    writing ``B`` to ``output.h5`` beside ``path``."""
    cfg = _read_template(template)
    cfg["ranges"] = {"ao": int(nao), "mo": int(nmo)}
    for name in ("A", "C"):
        cfg["tensors"][name]["source"] = {"file": "inputs.h5", "dataset": name}
    for o in cfg["outputs"].values():
        o["file"] = "output.h5"
    _write_yaml(cfg, path)


def _read_template(template: str | Path) -> dict:
    try:
        return yaml.safe_load(Path(template).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ChainexecError(f"cannot read the config template ({err})", str(template)) from None


def _write_yaml(cfg: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
    os.replace(tmp, path)


def write_config(template: str | Path, path: Path, nocc: int, nvir: int) -> None:
    """The template config with these extents and its files inside ``path``'s folder."""
    cfg = _read_template(template)
    cfg["ranges"] = {"occ": int(nocc), "vir": int(nvir)}
    for t in cfg["tensors"].values():
        if "file" in t.get("source", {}):
            t["source"]["file"] = "inputs.h5"
    for o in cfg["outputs"].values():
        o["file"] = "energy.h5"
    cfg["scratch"] = "scratch"
    _write_yaml(cfg, path)
