"""The plan cache: a second run of the same config, machine, options and source reads the plan
the first one made, computes the same (against numpy.einsum), and anything planning reads
changes the key; a broken or unwritable cache only costs the planning."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from chainexec import api, plancache, spec
from chainexec.planner.build import make_plan
from chainexec.planner.machine import Machine
from chainexec.planner.plan import Plan
from chainexec.planner.plan import FORMAT
from tests.conftest import fourindex_config, run_cli, write_config


@pytest.fixture
def fourindex(tmp_path):
    config = write_config(tmp_path, fourindex_config())
    api.generate(config)
    return config


def _result(config):
    with h5py.File(config.parent / "out" / "result.h5") as f:
        return f["B"][()]


def _einsum(config):
    with h5py.File(config.parent / "in.h5") as f:
        a, c = f["A"][()], f["C"][()]
    return np.einsum("pa,qb,rc,sd,pqrs->abcd", c, c, c, c, a)


def _cached_files():
    return sorted(plancache.cache_dir().glob("*.json"))


def _entry(kept: Path) -> str:
    """The plan a cache file holds, where it matches the digest written with it."""
    return plancache._store().find(kept.stem).decode()


def test_second_run_reads_the_plan_the_first_made(fourindex):
    first = api.run(fourindex, backend="numpy")
    assert first["run"]["plan_cached"] is False
    out1 = _result(fourindex)
    [kept] = _cached_files()
    assert _entry(kept) == make_plan(spec.load(fourindex)).to_json()
    second = api.run(fourindex, backend="numpy")
    assert second["run"]["plan_cached"] is True
    assert second["predicted"] == first["predicted"]
    assert second["measured"]["bytes"] == second["predicted"]["bytes"]
    out2 = _result(fourindex)
    assert np.array_equal(out1, out2)
    ref = _einsum(fourindex)
    assert np.max(np.abs(out2 - ref)) <= 1e-12 * np.max(np.abs(ref))


def test_the_key_changes_with_each_planning_input(fourindex, tmp_path, monkeypatch):
    text = fourindex.read_text()
    limits = {"global": 24 << 10, "device": 3 << 10}
    base = (fourindex, text, limits, Machine(), None, 1, True)
    k = plancache.key(*base)
    assert plancache.key(*base) == k
    changed = [
        (fourindex, text.replace("24KiB", "32KiB"), limits, Machine(), None, 1, True),
        (tmp_path / "other.yaml", text, limits, Machine(), None, 1, True),
        # Limits detected on another machine, for a config that leaves them out.
        (fourindex, text, {"global": 24 << 10, "device": 4 << 10}, Machine(), None, 1, True),
        (fourindex, text, limits, Machine(flop_rate=1e12), None, 1, True),
        (fourindex, text, limits, Machine(), "unfused", 1, True),
        (fourindex, text, limits, Machine(), None, 2, True),
        (fourindex, text, limits, Machine(), None, 1, False),
    ]
    assert len({plancache.key(*c) for c in changed} | {k}) == len(changed) + 1
    monkeypatch.chdir(tmp_path.parent)  # a relative path names another file from elsewhere
    assert plancache.key(*base) != k
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plancache, "source_digest", lambda: "another chainexec")
    assert plancache.key(*base) != k


def test_the_working_folder_changes_a_plan_of_a_relative_config(tmp_path, monkeypatch):
    """Why the working folder is in the key: a config named by a relative path plans to other
    files from another folder, with the same text and the same path as given."""
    plans, keys = [], []
    for name in ("one", "two"):
        folder = tmp_path / name
        folder.mkdir()
        text = write_config(folder, fourindex_config()).read_text()
        monkeypatch.chdir(folder)
        plans.append(make_plan(spec.load("chain.yaml")))
        keys.append(plancache.key("chain.yaml", text, {"global": 24 << 10, "device": 3 << 10}, Machine(), None, 1, True))
    assert plans[0].tensors["B"].output != plans[1].tensors["B"].output
    assert keys[0] != keys[1]


def test_tree_digest_takes_single_files_of_a_folder(tmp_path):
    """A part may name one file of a folder (``kernels/orbits.py``): its changes change the
    digest, the folder's other files' do not."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "orbits.py").write_text("x = 1\n")
    (tmp_path / "kernels" / "gett.py").write_text("y = 1\n")
    first = plancache.tree_digest(tmp_path, ("kernels/orbits.py",))
    (tmp_path / "kernels" / "gett.py").write_text("y = 2\n")
    assert plancache.tree_digest(tmp_path, ("kernels/orbits.py",)) == first
    (tmp_path / "kernels" / "orbits.py").write_text("x = 2\n")
    assert plancache.tree_digest(tmp_path, ("kernels/orbits.py",)) != first


def _imports(path: Path, package: tuple[str, ...]) -> set[tuple[str, ...]]:
    """What the source file ``path`` of package ``package`` imports anywhere in it, absolutely or
    relatively: each module, and each name imported from one (a module or not), as dotted parts."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {tuple(alias.name.split(".")) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = base + tuple(node.module.split(".") if node.module else ())
            found |= {module} | {module + (alias.name,) for alias in node.names}
    return found


def test_planning_holds_every_module_the_planner_imports():
    """Every ``chainexec`` module that the spec's reading and the planner import, at any depth
    and wherever in a file (a function's own imports too), with the packages they lie in, is a
    part of :data:`~chainexec.plancache.PLANNING`, which the plan cache's key digests: a change to
    any of them can change a plan (the cost model prices fused plans by the orbit kernels' bytes),
    so a plan made before it must not be read back."""
    root = Path(plancache.__file__).resolve().parent
    planning = plancache.PLANNING

    def covered(name: Path) -> bool:
        return any(name.parts[:len(Path(part).parts)] == Path(part).parts for part in planning)

    todo = [root / "spec.py", *(root / "planner").glob("*.py")]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        name = path.relative_to(root)
        package = ("chainexec", *name.parent.parts)
        for module in _imports(path, package):
            if module[0] != "chainexec":
                continue
            folder = root.joinpath(*module[1:])
            todo += [p for p in (folder.with_suffix(".py"), folder / "__init__.py") if p.is_file()]
    assert root / "kernels" / "orbits.py" in seen  # the cost model's import (fused_point_bytes)
    assert sorted(str(p.relative_to(root)) for p in seen if not covered(p.relative_to(root))) == []


def test_tree_digest_changes_with_any_source_file(tmp_path):
    (tmp_path / "planner").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "planner" / "fusion.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not source")
    first = plancache.tree_digest(tmp_path)
    (tmp_path / "notes.txt").write_text("still not source")
    assert plancache.tree_digest(tmp_path) == first
    (tmp_path / "planner" / "fusion.py").write_text("y = 3\n")
    second = plancache.tree_digest(tmp_path)
    assert second != first
    (tmp_path / "planner" / "fusion.py").rename(tmp_path / "planner" / "tiling.py")
    assert plancache.tree_digest(tmp_path) not in (first, second)
    third = plancache.tree_digest(tmp_path, ("planner",))
    (tmp_path / "a.py").write_text("x = 2\n")  # outside the parts named: the same digest
    assert plancache.tree_digest(tmp_path, ("planner",)) == third
    assert plancache.source_digest() == f"{FORMAT}:" + plancache.tree_digest(
        os.path.dirname(plancache.__file__), plancache.PLANNING)


def test_a_broken_cache_file_is_planned_again_and_replaced(fourindex):
    api.run(fourindex, backend="numpy")
    [kept] = _cached_files()
    kept.write_text('{"name": "half a pl')
    again = api.run(fourindex, backend="numpy")
    assert again["run"]["plan_cached"] is False
    assert _entry(kept) == make_plan(spec.load(fourindex)).to_json()
    assert api.run(fourindex, backend="numpy")["run"]["plan_cached"] is True


@pytest.mark.parametrize("old, new", [('"dtype": "float64"', '"dtype": "float63"'),
                                      ('"itemsize": 8', '"itemsize": 4'),
                                      ('"name": "fourindex"', '"name": "fourindex", "colour": 1')])
def test_a_damaged_cache_file_that_still_parses_is_planned_again_and_replaced(fourindex, old, new):
    """A cache file changed after it was written, still valid JSON (a dtype no run knows, a wrong
    item size, a field no plan has), does not match its digest: a miss, planned again and
    replaced, where trusted it failed every later run; the CLI's run then exits 0 and verifies."""
    api.run(fourindex, backend="numpy")
    [kept] = _cached_files()
    text = kept.read_text()
    assert old in text
    kept.write_text(text.replace(old, new))
    proc = run_cli("run", fourindex, "--report")
    assert proc.returncode == 0, proc.stderr
    assert "plan read from the plan cache" not in proc.stdout
    assert _entry(kept) == make_plan(spec.load(fourindex)).to_json()
    assert run_cli("verify", fourindex).returncode == 0


@pytest.mark.parametrize("broken", [{"tensors": []}, {"nests": [{"body": 3}]}, {"extents": 5}])
def test_a_cached_plan_whose_reading_raises_anything_is_a_miss(fourindex, broken):
    """An entry that matches its digest but whose plan cannot be read back, whatever the reading
    raises (here AttributeError and the like, not only JSON's errors): a miss, planned again."""
    api.run(fourindex, backend="numpy")
    [kept] = _cached_files()
    plancache.store(kept.stem, json.dumps(json.loads(_entry(kept)) | broken))
    assert plancache.load(kept.stem) is None
    assert api.run(fourindex, backend="numpy")["run"]["plan_cached"] is False
    assert _entry(kept) == make_plan(spec.load(fourindex)).to_json()


def test_an_unwritable_cache_costs_only_the_planning(fourindex, tmp_path, monkeypatch):
    blocker = tmp_path / "not a folder"
    blocker.write_text("")
    monkeypatch.setenv("CHAINEXEC_PLAN_CACHE", str(blocker / "plans"))
    for _ in range(2):
        assert api.run(fourindex, backend="numpy")["run"]["plan_cached"] is False
    ref = _einsum(fourindex)
    assert np.max(np.abs(_result(fourindex) - ref)) <= 1e-12 * np.max(np.abs(ref))


def test_cli_no_plan_cache_plans_and_keeps_nothing(fourindex):
    report = fourindex.parent / "report.json"
    proc = run_cli("run", fourindex, "--no-plan-cache", "--report-json", report)
    assert proc.returncode == 0, proc.stderr
    assert _cached_files() == []
    proc = run_cli("run", fourindex, "--report")
    assert proc.returncode == 0, proc.stderr
    assert "plan read from the plan cache" not in proc.stdout
    proc = run_cli("run", fourindex, "--report")
    assert proc.returncode == 0, proc.stderr
    assert "plan read from the plan cache" in proc.stdout


def test_a_cached_run_does_not_import_the_planners_search(fourindex):
    """With the plan in the cache, a run's process never imports the fusion/tiling search (and
    what it imports): interpreter start-up is part of a user's wall time."""
    api.run(fourindex, backend="numpy")
    code = ("import sys\nfrom chainexec import api\n"
            f"r = api.run({str(fourindex)!r}, backend='numpy')\n"
            "print(r['run']['plan_cached'], sorted(m for m in ('chainexec.planner.build', 'chainexec.planner.fusion', "
            "'chainexec.planner.schedule') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "True []"


def test_the_cache_keeps_the_plans_used_last(fourindex, monkeypatch):
    """Beyond LIMIT plans, storing one removes those read or written longest ago; other files in
    the folder, and temporary files younger than a day, are left alone."""
    monkeypatch.setattr(plancache, "LIMIT", 3)
    text = make_plan(spec.load(fourindex)).to_json()
    folder = plancache.cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.json").write_text("{}")
    (folder / "fresh.tmp").write_text("")
    (folder / "stale.tmp").write_text("")
    os.utime(folder / "stale.tmp", (1000, 1000))
    a, b, c, d, e = (f"{n}" * 64 for n in "abcde")
    for n, name in enumerate((a, b, c)):
        plancache.store(name, text)
        os.utime(folder / f"{name}.json", (1000 + n, 1000 + n))
    assert plancache.load(a) is not None  # a read marks it as used now
    plancache.store(d, text)
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"{x}.json" for x in (a, c, d)]
                                                               + ["notes.json", "fresh.tmp"])
    plancache.store(e, text)
    assert sorted(p.stem for p in _cached_files()) == sorted([a, d, e, "notes"])


def test_a_cached_plan_must_match_its_config(fourindex, monkeypatch):
    """A plan in the cache, with its digest, that disagrees with the config on its outputs,
    inputs, extents, names or tensors' dtypes and item sizes (a cache folder someone else wrote
    to) is made again, not run."""
    api.run(fourindex, backend="numpy")
    [kept] = _cached_files()
    s = spec.load(fourindex)
    good = _entry(kept)
    assert plancache.fits(plancache.load(kept.stem)[0], s)
    single = json.loads(good)
    for t in single["tensors"].values():
        if t["role"] != "input":
            t.update(dtype="float32", itemsize=4)
    tampered = [good.replace(str(fourindex.parent / "out" / "result.h5"), "/tmp/elsewhere.h5"),
                good.replace(str(fourindex.parent / "in.h5"), "/tmp/other.h5"),
                good.replace('"a": 8', '"a": 7', 1),
                good.replace('"B"', '"B; system(0)"'),
                good.replace('"dtype": "float64"', '"dtype": "float63"', 1),
                good.replace('"itemsize": 8', '"itemsize": 4', 1),
                json.dumps(single, indent=1),  # every tensor but the inputs float32
                good.replace('"dtype": "float64"', '"dtype": "float32"', 1)]
    for text in tampered:
        assert text != good
        plancache.store(kept.stem, text)
        assert not plancache.fits(plancache.load(kept.stem)[0], s)
        assert api.run(fourindex, backend="numpy")["run"]["plan_cached"] is False
        assert _entry(kept) == good  # made again and kept in its place


def test_a_float32_chains_intermediates_fit_only_as_float32(tmp_path):
    """A planner's intermediate (``_s<statement>_…``) has its statement's result's dtype: a plan
    of a float32 chain fits with its intermediates float32, not float64."""
    s = spec.load(write_config(tmp_path, fourindex_config() | {"dtype": "float32"}))
    plan = make_plan(s)
    made = [t for name, t in plan.tensors.items() if name not in s.tensors]
    assert made and all(t.dtype == "float32" and t.itemsize == 4 for t in made)
    assert plancache.fits(plan, s)
    made[0].dtype, made[0].itemsize = "float64", 8
    assert not plancache.fits(plan, s)


@pytest.mark.parametrize("old, new", [
    ('"e_occ"', '"_e_occ"'),  # a leading underscore no config name has, not the planner's pattern
    ('"e_occ"', '"int"'),  # a C keyword
    ('["Z", ["i"', '["Z; x", ["i"'),  # a fused statement's reused producer
    ("W[i,a,j,b,k,c] * (1.0", "W[i,a,j,b,k,c] * (1.0 * _Bad[i,a]"),  # a reference in its text
    ('"domain": ["i"', '"domain": ["int"'),
])
def test_a_cached_plan_names_nothing_a_config_could_not(old, new):
    """Every name of a cached plan that reaches generated source, a fused expression's included
    (the (T) energy's), is one a config may hold or an intermediate the planner names; the
    planner's own plan passes."""
    s = spec.load(Path(__file__).resolve().parents[1] / "configs" / "ccsd_t.yaml")
    text = json.dumps(json.loads(make_plan(s).to_json()))
    assert plancache.fits(Plan.from_json(text), s)
    assert old in text
    assert not plancache.fits(Plan.from_json(text.replace(old, new, 1)), s)


@pytest.mark.mpi
def test_cli_plan_keeps_the_plan_a_run_of_as_many_ranks_reads(fourindex):
    """``chainexec plan --ranks 2`` keeps its plan in the cache, where a run of 2 ranks from the
    same folder finds it and does not plan again; read back, it prints what planning prints.
    ``--no-plan-cache`` plans and keeps nothing."""
    fresh = run_cli("plan", fourindex, "--ranks", "2", "--no-plan-cache")
    assert fresh.returncode == 0, fresh.stderr
    assert _cached_files() == []
    first = run_cli("plan", fourindex, "--ranks", "2")
    [kept] = _cached_files()
    again = run_cli("plan", fourindex, "--ranks", "2")
    assert first.stdout == fresh.stdout and again.stdout == fresh.stdout
    assert _cached_files() == [kept]
    report = fourindex.parent / "report.json"
    proc = run_cli("run", fourindex, "--report-json", report, ranks=2)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(report.read_text())["run"]["plan_cached"] is True
    assert _cached_files() == [kept]
    assert np.max(np.abs(_result(fourindex) - _einsum(fourindex))) <= 1e-12 * np.max(np.abs(_einsum(fourindex)))
