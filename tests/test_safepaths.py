"""Paths that would destroy user files are refused before anything is written or removed: one
line naming the path, exit status 2, and every file of the user's as it was (compared by content
before and after)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

from chainexec import safepaths
from chainexec.errors import ChainexecError
from tests.conftest import (HDF5_LOCKING, assert_refused, fourindex_config, h5_held_for_writing, held_by_another,
                            run_cli, write_config)


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file below ``folder`` (outside chainexec's own output) with a digest of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """A config and the inputs ``chainexec generate`` wrote for it, made once per module (and
    worker): every test copies the folder."""
    work = tmp_path_factory.mktemp("generated")
    config = write_config(work, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    return work


@pytest.fixture(scope="module")
def finished(tmp_path_factory, generated):
    """The folder ``generated`` with the complete output of a run of its config, made once per
    module (and worker)."""
    work = tmp_path_factory.mktemp("finished")
    shutil.copytree(generated, work, dirs_exist_ok=True)
    assert run_cli("run", work / "chain.yaml", "--quiet", cwd=work).returncode == 0
    return work


def _beside_user_files(tmp_path, source: Path) -> Path:
    """A copy of the folder ``source`` (a config and its inputs) beside user files: a folder of
    data, a stray ``.tmp`` file, and a sibling folder of the config's folder; the copy's config."""
    work = tmp_path / "work"
    shutil.copytree(source, work)
    (tmp_path / "sibling").mkdir()
    (tmp_path / "sibling" / "thesis.txt").write_text("four years")
    (work / "mydata").mkdir()
    (work / "mydata" / "measured.h5").write_bytes(os.urandom(64))
    (work / "notes.tmp").write_text("keep me")
    return work / "chain.yaml"


@pytest.fixture
def user_folder(tmp_path, generated):
    """A generated config with its inputs beside user files (:func:`_beside_user_files`)."""
    return _beside_user_files(tmp_path, generated)


@pytest.fixture
def finished_user_folder(tmp_path, finished):
    """:func:`user_folder` where a run of the config has finished: its output is there."""
    return _beside_user_files(tmp_path, finished)


def _edit(config: Path, output: str | None = None, scratch: str | None = None) -> Path:
    import yaml

    cfg = yaml.safe_load(config.read_text())
    if output is not None:
        cfg["outputs"]["B"]["file"] = output
    if scratch is not None:
        cfg["scratch"] = scratch
    return write_config(config.parent, cfg, "edited.yaml")


DESTRUCTIVE = {
    "output: the input": ("output", "in.h5", "input of tensor A"),
    "output: the input through ..": ("output", "./sub/../in.h5", "input of tensor A"),
    "output: the config": ("output", "edited.yaml", "is also the config"),
    "output: a user file": ("output", "mydata/measured.h5", "not an output chainexec wrote"),
    "output: a folder": ("output", "mydata", "is a folder"),
    "output: a name too long": ("output", "x" * 250 + ".h5", "longer than"),
    "scratch: the config's folder": ("scratch", ".", "scratch folder"),
    "scratch: a user folder": ("scratch", "mydata", "scratch folder"),
    "scratch: the parent folder": ("scratch", "..", "scratch folder"),
    "scratch: a file": ("scratch", "in.h5", "must be a folder"),
    "scratch: inside the output's parts": ("scratch", "out/result.h5.parts/s", "would hold the scratch folder"),
}


@pytest.mark.parametrize("ranks", [None, 2])
@pytest.mark.parametrize("case", sorted(DESTRUCTIVE))
def test_path_that_would_destroy_user_files(case, ranks, user_folder):
    field, value, needle = DESTRUCTIVE[case]
    config = _edit(user_folder, **{field: value})
    before = _snapshot(user_folder.parent.parent)
    assert_refused(run_cli("run", config, "--quiet", ranks=ranks), needle)
    assert _snapshot(user_folder.parent.parent) == before


ANOTHER_RUNS = {
    # (what the second config changes, the refusal's words)
    "scratch: another output's parts": (dict(scratch="out/result.h5.parts"), "made as the shard files of result.h5"),
    "scratch: a checkpoint left": (dict(scratch="ck"), "made as a run's checkpoint"),
    "checkpoint: another output's parts": (dict(checkpoint="out/result.h5.parts"), "made as the shard files of"),
    "checkpoint: a scratch left": (dict(checkpoint="out/.left.scratch"), "made as scratch of a run"),
    "output: inside another output's parts": (dict(output="out/result.h5.parts/mine.h5"), "would lie inside"),
    "output: inside a checkpoint left": (dict(output="ck/mine.h5"), "would lie inside"),
    "scratch: inside another output's parts": (dict(scratch="out/result.h5.parts/s"), "would lie inside"),
    "report: inside another output's parts": (dict(report="out/result.h5.parts/r.json"), "would lie inside"),
}


@pytest.mark.parametrize("case", sorted(ANOTHER_RUNS))
def test_a_folder_another_run_made_is_neither_used_nor_written_into(case, finished_user_folder):
    """Folders chainexec made for another config (the finished run's parts folder, the checkpoint
    and scratch folders of stopped runs) given to a second config as its scratch or checkpoint
    folder, or as the folder of its output or report: the second run would remove them whole,
    or their owner's next run would remove its files with them. Refused, everything as it was,
    the finished output still whole."""
    work = finished_user_folder.parent
    for folder, made_as in ((work / "ck", safepaths.CHECKPOINT), (work / "out" / ".left.scratch", safepaths.SCRATCH)):
        safepaths.make_owned(folder, made_as)
        (folder / "rank0-1.npz").write_bytes(os.urandom(256))
    change, needle = ANOTHER_RUNS[case]
    config = _edit(finished_user_folder, output=change.get("output", "out/second.h5"), scratch=change.get("scratch"))
    options = (["--checkpoint", work / change["checkpoint"]] if "checkpoint" in change else []) + (
        ["--report-json", work / change["report"]] if "report" in change else [])
    before = _snapshot(work.parent)
    assert_refused(run_cli("run", config, "--quiet", *options), needle)
    assert _snapshot(work.parent) == before
    assert run_cli("verify", finished_user_folder).returncode == 0


def test_an_output_another_program_is_writing_is_named_so(finished_user_folder):
    """An earlier output that another program holds open for writing (HDF5's file lock): the
    run is refused as before, and the line says why, not that chainexec did not write the file;
    the file keeps what the other program wrote."""
    output = finished_user_folder.parent / "out" / "result.h5"
    with h5_held_for_writing(output):
        assert_refused(run_cli("run", finished_user_folder, "--quiet", env=HDF5_LOCKING), "result.h5",
                       "open for writing in another program")
    with h5py.File(output, "r") as f:
        assert f["mine"][999] == 999.0


def test_a_plot_inside_a_folder_chainexec_made_is_refused(finished_user_folder):
    """``chainexec plan --plot`` into another output's parts folder: refused, nothing written."""
    work = finished_user_folder.parent
    before = _snapshot(work)
    assert_refused(run_cli("plan", finished_user_folder, "--plot", work / "out" / "result.h5.parts" / "plan.png"),
                   "would lie inside", "result.h5.parts")
    assert _snapshot(work) == before


def test_generate_writes_no_input_inside_a_folder_chainexec_made(finished_user_folder):
    """An input file placed in another output's parts folder would go when that output is
    written again: ``chainexec generate`` refuses it."""
    work = finished_user_folder.parent
    import yaml

    cfg = yaml.safe_load(finished_user_folder.read_text())
    cfg["tensors"]["A"]["source"]["file"] = "out/result.h5.parts/in.h5"
    config = write_config(work, cfg, "inside.yaml")
    before = _snapshot(work)
    assert_refused(run_cli("generate", config), "would lie inside", "tensor A")
    assert _snapshot(work) == before


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_output_linked_to_the_input(kind, user_folder):
    work = user_folder.parent
    (os.symlink if kind == "symlink" else os.link)(work / "in.h5", work / "alias.h5")
    config = _edit(user_folder, output="alias.h5")
    before = _snapshot(work)
    assert_refused(run_cli("run", config, "--quiet"), "symbolic link" if kind == "symlink" else "input of tensor A")
    assert _snapshot(work) == before


def _reading_the_result(work: Path, file: str, dataset: str) -> Path:
    """A config that reads ``file``:``dataset`` (the first run's result, 8⁴) as its input and
    writes ``out/result.h5``, where that result lies."""
    cfg = {
        "name": "reread",
        "indices": {i: 8 for i in "abcd"},
        "tensors": {"X": {"indices": list("abcd"), "source": {"file": file, "dataset": dataset}}},
        "statements": ["S[a,b] = X[a,b,c,d] * X[a,b,c,d]"],
        "outputs": {"S": {"file": "out/result.h5", "dataset": "S"}},
        "machine": {"global_memory": "1MiB", "device_memory": "64KiB"},
    }
    return write_config(work, cfg, "reread.yaml")


@pytest.mark.parametrize("through", ["external link", "virtual copy"])
def test_an_output_an_input_reads_through_hdf5_is_refused(through, user_folder):
    """An input whose values lie in the output file (an external link to it) or in its parts
    folder (a copy of its virtual dataset): refused before the older output is removed."""
    import h5py

    work = user_folder.parent
    assert run_cli("run", user_folder, "--quiet").returncode == 0
    if through == "external link":
        with h5py.File(work / "link.h5", "w") as f:
            f["X"] = h5py.ExternalLink("out/result.h5", "B")
        config = _reading_the_result(work, "link.h5", "X")
    else:
        shutil.copy(work / "out" / "result.h5", work / "out" / "kept.h5")
        config = _reading_the_result(work, "out/kept.h5", "B")
    before = _snapshot(work)
    assert_refused(run_cli("run", config, "--quiet"), "input of tensor X")
    assert _snapshot(work) == before


def test_an_output_that_is_a_symbolic_link_is_refused(user_folder):
    """An output path linked to an older result elsewhere: removing "the older output" would
    remove the file it points to."""
    work = user_folder.parent
    config = _edit(user_folder, output="archive/result.h5")
    assert run_cli("run", config, "--quiet").returncode == 0
    (work / "out").mkdir()
    os.symlink("../archive/result.h5", work / "out" / "result.h5")
    before = _snapshot(work)
    assert_refused(run_cli("run", user_folder, "--quiet"), "symbolic link", "out/result.h5")
    assert _snapshot(work) == before and (work / "out" / "result.h5").is_symlink()


def test_a_file_named_like_the_temporary_output_stays(user_folder):
    """The output is written under a new temporary name: a user's ``result.h5.tmp`` beside it
    stays as it was."""
    work = user_folder.parent
    (work / "out").mkdir()
    (work / "out" / "result.h5.tmp").write_text("my notes")
    assert run_cli("run", user_folder, "--quiet").returncode == 0
    assert (work / "out" / "result.h5.tmp").read_text() == "my notes"
    assert sorted(p.name for p in (work / "out").iterdir()) == ["result.h5", "result.h5.parts", "result.h5.tmp"]


def test_a_killed_runs_temporary_output_goes_with_the_next_run(user_folder):
    """A run killed at once (SIGKILL) while writing its output leaves ``.result.h5.XXXXXXXX.tmp``
    (an HDF5 file, or an empty one); the next run of the output removes it, and leaves a user's
    file of such a name that is not HDF5."""
    import h5py

    work = user_folder.parent
    (work / "out").mkdir()
    with h5py.File(work / "out" / ".result.h5.0123abcd.tmp", "w") as f:
        f["B"] = [1.0]
    (work / "out" / ".result.h5.89abcdef.tmp").write_bytes(b"")
    (work / "out" / ".result.h5.deadbeef.tmp").write_text("my notes")
    (work / "out" / ".other.h5.0123abcd.tmp").write_bytes(b"")
    assert run_cli("run", user_folder, "--quiet", cwd=work).returncode == 0
    assert sorted(p.name for p in (work / "out").iterdir()) == [
        ".other.h5.0123abcd.tmp", ".result.h5.deadbeef.tmp", "result.h5", "result.h5.parts"]


def test_new_scratch_is_made_and_removed_and_only_it(user_folder):
    """A scratch folder chainexec makes is marked while the run lasts and removed at its end;
    the files beside it stay."""
    config = _edit(user_folder, scratch="mine/scratch")
    work = user_folder.parent
    before = _snapshot(work)
    proc = run_cli("run", config, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert not (work / "mine" / "scratch").exists() and (work / "mine").is_dir()
    after = _snapshot(work)
    assert {k: v for k, v in after.items() if k in before} == before
    assert run_cli("verify", config).returncode == 0


@pytest.mark.parametrize("folder", [".", "mydata", "out/result.h5.parts"])
def test_checkpoint_folder_with_user_files(folder, user_folder):
    work = user_folder.parent
    assert run_cli("run", user_folder, "--quiet").returncode == 0  # the parts folder exists
    before = _snapshot(work)
    assert_refused(run_cli("run", user_folder, "--quiet", "--checkpoint", work / folder), str(work))
    assert _snapshot(work) == before


@pytest.mark.parametrize("options", [("--checkpoint-every", "-1"), ("--checkpoint-every", "nan"),
                                     ("--stop-after", "inf"), ("--stop-after", "-5")])
def test_a_run_refused_for_its_checkpoint_options_makes_no_folder(options, user_folder):
    """Intervals that are not finite, or negative: refused in one line before the run makes its
    checkpoint, scratch or parts folders."""
    work = user_folder.parent
    before = _snapshot(work)
    folders = sorted(p for p in work.rglob("*") if p.is_dir())
    assert_refused(run_cli("run", user_folder, "--quiet", "--checkpoint", work / "ck", *options),
                   f"{options[0]} must be a finite number of seconds, not negative, not {float(options[1]):g}")
    assert _snapshot(work) == before and sorted(p for p in work.rglob("*") if p.is_dir()) == folders


def test_checkpoint_keeps_what_it_did_not_write(user_folder):
    """An empty folder of the user's serves as a checkpoint folder; a completed run removes its
    own files from it and nothing else (a file put there meanwhile stays)."""
    folder = user_folder.parent / "ck"
    folder.mkdir()
    proc = run_cli("run", user_folder, "--quiet", "--checkpoint", folder, "--checkpoint-every", 0)
    assert proc.returncode == 0, proc.stderr
    assert list(folder.iterdir()) == []
    safepaths.make_owned(folder, safepaths.CHECKPOINT)
    (folder / "later.tmp").write_text("mine")
    (folder / "rank0-1.npz.bak").write_text("mine too")
    proc = run_cli("run", user_folder, "--quiet", "--checkpoint", folder)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["later.tmp", "rank0-1.npz.bak"]


def test_a_users_empty_scratch_folder_is_emptied_not_removed(user_folder):
    """An empty folder of the user's named as scratch (one they made, a mount point, a job's
    $TMPDIR) serves the run and is left, empty, with its permissions: the run removes what it put
    there and its mark, not the folder; a second run uses it again. A scratch folder the run
    made itself is removed."""
    folder = user_folder.parent / "myscratch"
    folder.mkdir(mode=0o750)
    config = _edit(user_folder, scratch="myscratch")
    for _ in range(2):
        proc = run_cli("run", config, "--quiet")
        assert proc.returncode == 0, proc.stderr
        assert folder.is_dir() and list(folder.iterdir()) == []
        assert folder.stat().st_mode & 0o777 == 0o750
    assert run_cli("verify", config).returncode == 0
    folder.rmdir()
    assert run_cli("run", config, "--quiet").returncode == 0
    assert not folder.exists()


@pytest.mark.parametrize("target", ["empty", "missing"])
def test_a_scratch_folder_named_through_a_link_is_left_as_found(target, user_folder):
    """Scratch named as a symbolic link: the folder it names serves the run and is left as it
    was before, the link too. A user's empty folder is emptied, its mark with it (a mark left
    there would make the next run take the folder, and what the user puts in it, for
    chainexec's own); a folder the run made where the link pointed at nothing is removed."""
    work = user_folder.parent
    folder = work / "mytmp"
    if target == "empty":
        folder.mkdir()
    (work / "sc").symlink_to("mytmp")
    config = _edit(user_folder, scratch="sc")
    proc = run_cli("run", config, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert (work / "sc").is_symlink()
    assert (folder.is_dir() and list(folder.iterdir()) == []) if target == "empty" else not folder.exists()
    if target == "empty":
        (folder / "results.txt").write_text("precious")
        assert_refused(run_cli("run", _edit(user_folder, scratch="mytmp"), "--quiet"), "holds files chainexec did not make")
        assert (folder / "results.txt").read_text() == "precious"


def test_a_users_folder_left_marked_by_a_killed_run_is_emptied_in_place(tmp_path):
    """The mark a killed run left in a user's folder says to empty it: the next run's removal
    (here a parts folder moved aside) empties it where it is and leaves it."""
    folder = tmp_path / "given"
    folder.mkdir()
    safepaths.make_owned(folder, "a test's parts")
    assert safepaths.adopted(folder) and safepaths.owner(folder) == "a test's parts"
    (folder / "sub").mkdir()
    (folder / "sub" / "s0.h5").write_bytes(b"x")
    (folder / "rank0.h5").write_bytes(os.urandom(100))
    assert safepaths.remove_owned_aside(folder) is None
    assert folder.is_dir() and list(folder.iterdir()) == [] and list(tmp_path.iterdir()) == [folder]


@pytest.mark.parametrize("held", ["checkpoint", "scratch", "parts"])
def test_a_folder_a_running_run_holds_is_refused(held, user_folder):
    """A second run given a checkpoint folder that a running one holds, or whose scratch or
    parts folder a running one holds (a config of the same name and output folder), is refused
    and changes nothing; once the holder has gone it runs."""
    work = user_folder.parent
    folder = {"checkpoint": work / "ck", "scratch": work / "out" / ".fourindex.scratch",
              "parts": work / "out" / "result.h5.parts"}[held]
    option = ("--checkpoint", work / "ck") if held == "checkpoint" else ()
    made_as = {"checkpoint": safepaths.CHECKPOINT, "scratch": safepaths.SCRATCH,
               "parts": safepaths.parts_made(work / "out" / "result.h5")}[held]
    with held_by_another(folder, made_as) as pid:
        before = _snapshot(work)
        assert_refused(run_cli("run", user_folder, "--quiet", *option), "in use by another run",
                       f"pid {pid}", str(folder.name))
        assert _snapshot(work) == before
    proc = run_cli("run", user_folder, "--quiet", *option)
    assert proc.returncode == 0, proc.stderr




REPORTS = {
    "--report-json into a missing folder": (["--report-json", "nowhere/r.json"], "does not exist"),
    "--plot into a missing folder": (["--plot", "nowhere/r.png"], "does not exist"),
    "--report-json over the input": (["--report-json", "in.h5"], "input of tensor A"),
    "--plot over the input": (["--plot", "in.h5"], "input of tensor A"),
    "--plot over the config": (["--plot", "chain.yaml"], "the config"),
    "--plot over the output": (["--plot", "out/result.h5"], "output of B"),
    "--plot into a folder": (["--plot", "."], "is a folder"),
    "--plot with a name too long": (["--plot", "r" * 300 + ".png"], "longer than"),
    "--report-json over the output": (["--report-json", "out/result.h5"], "output of B"),
    "--report-json whose probe's name is too long": (["--report-json", "r" * 240 + ".json"], "longer than"),
    "--plot over --report-json": (["--report-json", "r.json", "--plot", "./r.json"], "--plot names the file --report-json"),
}


@pytest.mark.parametrize("command, case", [("run", case) for case in sorted(REPORTS)]
                         + [("plan", case) for case in sorted(REPORTS) if REPORTS[case][0][0] == "--plot"])
def test_report_paths(command, case, finished_user_folder):
    """A report file that would write over the config, an input, an output or a folder, or
    that no file system could name, is refused before anything is written: by ``run`` and by
    ``plan`` (whose ``--plot`` wrote its picture over any of them), the run's finished output
    left as it was."""
    options, needle = REPORTS[case]
    work = finished_user_folder.parent
    assert (work / "out" / "result.h5").exists()
    before = _snapshot(work)
    proc = run_cli(command, finished_user_folder, *(["--quiet"] if command == "run" else []), *options, cwd=work)
    assert_refused(proc, needle)
    assert _snapshot(work) == before


@pytest.mark.parametrize("command, option", [("run", "--report-json"), ("plan", "--plot")])
@pytest.mark.parametrize("named_by", ["--machine", "$CHAINEXEC_MACHINE"])
def test_a_report_over_the_machine_file_is_refused(command, option, named_by, finished_user_folder):
    """A report file that is the machine file the command reads its rates from (``--machine``
    or ``$CHAINEXEC_MACHINE``): refused before anything is written (the report replaced the
    machine file, and the next run with it failed on the report's fields)."""
    from chainexec.planner.machine import Machine

    work = finished_user_folder.parent
    (work / "m.json").write_text(Machine(statement_seconds=0).to_json())
    before = _snapshot(work)
    by = (["--machine", "m.json"], None) if named_by == "--machine" else ([], {"CHAINEXEC_MACHINE": "./m.json"})
    proc = run_cli(command, finished_user_folder, *(["--quiet"] if command == "run" else []), *by[0],
                   option, work / "m.json", cwd=work, env=by[1])
    assert_refused(proc, "the machine file", option)
    assert _snapshot(work) == before


def test_generate_refuses_two_tensors_written_into_one_dataset(tmp_path):
    """Two tensors naming one dataset with other extents or seeds: refused before anything is
    written (generate wrote the second over the first, exit 0); alike in all, the one dataset is
    written and the run reads it for both."""
    cfg = fourindex_config()
    cfg["tensors"]["C"]["source"] = {"file": "in.h5", "dataset": "A", "seed": 12}
    assert_refused(run_cli("generate", write_config(tmp_path, cfg)), "tensors A and C both name dataset 'A'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain.yaml"]
    cfg = fourindex_config()
    cfg["tensors"]["D"] = dict(cfg["tensors"]["C"])
    cfg["statements"] = ["B[a,b,c,d] = C[p,a] * D[q,b] * C[r,c] * C[s,d] * A[p,q,r,s]"]
    config = write_config(tmp_path, cfg)
    proc = run_cli("generate", config)
    assert proc.returncode == 0 and proc.stdout.count(":C") == 2, proc.stderr
    assert run_cli("run", config, "--quiet").returncode == 0
    assert "ok" in run_cli("verify", config).stdout


def test_generate_without_every_seed_writes_nothing(user_folder):
    import yaml

    cfg = yaml.safe_load(user_folder.read_text())
    del cfg["tensors"]["C"]["source"]["seed"]
    config = write_config(user_folder.parent, cfg, "edited.yaml")
    before = _snapshot(user_folder.parent)
    assert_refused(run_cli("generate", config), "tensor C has no seed")
    assert _snapshot(user_folder.parent) == before


@pytest.mark.parametrize("target", ["config", "output", "text file"])
def test_generate_refuses_to_write_over(target, user_folder):
    import yaml

    work = user_folder.parent
    assert run_cli("run", user_folder, "--quiet").returncode == 0
    cfg = yaml.safe_load(user_folder.read_text())
    file = {"config": "edited.yaml", "output": "out/result.h5", "text file": "notes.tmp"}[target]
    cfg["tensors"]["A"]["source"]["file"] = file
    config = write_config(work, cfg, "edited.yaml")
    before = _snapshot(work)
    assert_refused(run_cli("generate", config), file.split("/")[-1])
    assert _snapshot(work) == before


def test_generate_keeps_other_datasets(user_folder):
    """``generate`` writes a new file and renames it into place, keeping datasets the config does
    not name; nothing temporary is left beside it."""
    import h5py
    import numpy as np

    work = user_folder.parent
    with h5py.File(work / "in.h5", "a") as f:
        f["extra"] = np.arange(7.0)
    assert run_cli("generate", user_folder).returncode == 0
    with h5py.File(work / "in.h5", "r") as f:
        assert sorted(f) == ["A", "C", "extra"] and f["extra"][()].tolist() == list(range(7))
    assert not [p for p in work.iterdir() if p.name.endswith(".tmp") and p.name != "notes.tmp"]


def test_generate_missing_writes_only_where_no_input_exists(tmp_path):
    """``generate --missing`` (the batch job's step): inputs written where none exists; nothing
    where all do (a user's real data stays, even of another shape or with other values: ``run``
    checks them); refused, naming the missing file, where some exist; and a config it cannot
    read refused as ``generate`` refuses it, not taken for missing inputs."""
    import h5py
    import numpy as np

    cfg = fourindex_config()
    cfg["tensors"]["C"]["source"]["file"] = "coefficients.h5"
    config = write_config(tmp_path, cfg)
    proc = run_cli("generate", "--missing", config)
    assert proc.returncode == 0 and "wrote" in proc.stdout, proc.stderr
    with h5py.File(tmp_path / "in.h5", "a") as f:
        del f["A"]
        f["A"] = np.ones((3, 3))  # the user's own data, of another shape
    before = _snapshot(tmp_path)
    proc = run_cli("generate", "--missing", config)
    assert proc.returncode == 0 and proc.stdout == "the inputs exist: nothing written\n", proc.stderr
    assert _snapshot(tmp_path) == before
    assert_refused(run_cli("run", config, "--quiet"), "in.h5")
    (tmp_path / "coefficients.h5").unlink()
    before = _snapshot(tmp_path)
    assert_refused(run_cli("generate", "--missing", config), "coefficients.h5", "write over")
    assert _snapshot(tmp_path) == before
    (tmp_path / "bad.yaml").write_text(config.read_text().replace("statements:", "statement:"))
    before = _snapshot(tmp_path)
    assert_refused(run_cli("generate", "--missing", tmp_path / "bad.yaml"), "bad.yaml")
    assert _snapshot(tmp_path) == before


def test_generate_again_with_other_seeds_writes_over_the_values(user_folder):
    """Inputs generated again with new seeds: new values, the file no larger (HDF5 keeps a
    deleted dataset's space, so one made anew each time would grow by the inputs); an input of
    another shape is made anew, its values right."""
    import h5py
    import numpy as np
    import yaml

    work = user_folder.parent
    size = (work / "in.h5").stat().st_size
    with h5py.File(work / "in.h5", "r") as f:
        first = f["A"][()]
    cfg = yaml.safe_load(user_folder.read_text())
    cfg["tensors"]["A"]["source"]["seed"] += 1
    config = write_config(work, cfg, "reseeded.yaml")
    for _ in range(2):
        assert run_cli("generate", config).returncode == 0
    assert (work / "in.h5").stat().st_size == size
    with h5py.File(work / "in.h5", "r") as f:
        again = f["A"][()]
    assert again.shape == first.shape and not np.array_equal(again, first)
    assert run_cli("run", config, "--quiet").returncode == 0 and run_cli("verify", config).returncode == 0


@pytest.mark.parametrize("layout", ["group", "dataset above"])
def test_generate_writes_no_dataset_over_a_group_or_below_a_dataset(layout, user_folder):
    """The dataset ``g`` where ``g`` is a group of the user's datasets, or ``g/A`` where ``g`` is
    a dataset: refused, the file as it was."""
    import h5py
    import numpy as np
    import yaml

    work = user_folder.parent
    with h5py.File(work / "in.h5", "a") as f:
        if layout == "group":
            f["g/keep"] = np.arange(3.0)
        else:
            f["g"] = np.arange(3.0)
    cfg = yaml.safe_load(user_folder.read_text())
    cfg["tensors"]["C"]["source"]["dataset"] = "g" if layout == "group" else "g/A"
    config = write_config(work, cfg, "edited.yaml")
    before = _snapshot(work)
    assert_refused(run_cli("generate", config), "in.h5", "'g")
    assert _snapshot(work) == before


def test_generate_writes_where_a_linked_input_points(user_folder):
    """An input file that is a symbolic link: the file it points to is written, the link stays."""
    import h5py
    import yaml

    work = user_folder.parent
    (work / "store").mkdir()
    os.symlink("store/real.h5", work / "linked.h5")
    cfg = yaml.safe_load(user_folder.read_text())
    cfg["tensors"]["C"]["source"]["file"] = "linked.h5"
    assert run_cli("generate", write_config(work, cfg, "edited.yaml")).returncode == 0
    assert (work / "linked.h5").is_symlink()
    with h5py.File(work / "store" / "real.h5", "r") as f:
        assert f["C"].shape == (10, 8)


def _marked(folder: Path, files: int = 3) -> Path:
    safepaths.make_owned(folder, "a test's parts")
    (folder / "sub").mkdir()
    for k in range(files):
        (folder / f"rank{k}.h5").write_bytes(os.urandom(1000))
        (folder / "sub" / f"s{k}.h5").write_bytes(b"x")
    return folder


def test_owned_folder_is_moved_aside_then_removed(tmp_path):
    """The folder is gone from its name at once; its files go on a thread; nothing is left."""
    folder = _marked(tmp_path / "out.h5.parts")
    thread = safepaths.remove_owned_aside(folder)
    assert not folder.exists()
    thread.join()
    assert list(tmp_path.iterdir()) == []


def test_a_folder_another_process_holds_is_not_moved_aside(tmp_path):
    """A parts folder another running process holds (another config's run of the same output
    file, which made it after this run's checks) is refused, not moved from under that run."""
    folder = _marked(tmp_path / "out.h5.parts")
    before = _snapshot(tmp_path)
    with held_by_another(folder) as pid:
        with pytest.raises(ChainexecError, match=f"in use by another run .*pid {pid}"):
            safepaths.remove_owned_aside(folder, "the parts folder")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out.h5.parts"]
    assert {k: v for k, v in _snapshot(tmp_path).items() if not k.endswith(safepaths.MARK)} == {
        k: v for k, v in before.items() if not k.endswith(safepaths.MARK)}
    safepaths.remove_owned_aside(folder).join()
    assert list(tmp_path.iterdir()) == []


def test_a_folder_not_ours_stays(tmp_path):
    folder = tmp_path / "out.h5.parts"
    folder.mkdir()
    (folder / "mine.txt").write_text("user data")
    assert safepaths.remove_owned_aside(folder) is None
    assert (folder / "mine.txt").read_text() == "user data"


def _left(folder: Path) -> Path:
    """What a removal stopped before its end leaves: ``folder`` (``<name>.old-XXXXXXXX``),
    marked, holding the marked parts folder ``<name>`` with its files."""
    safepaths.make_owned(folder, "an older parts folder being removed")
    return _marked(folder / folder.name[:folder.name.index(safepaths.ASIDE)])


def test_what_a_stopped_removal_left_goes_with_the_next(tmp_path):
    """A folder a removal stopped before its end left goes too; one of the pattern without the
    mark (a user's copy), or of another output's name, stays."""
    left = _left(tmp_path / "out.h5.parts.old-abc12345")
    foreign = tmp_path / "out.h5.parts.old-zzzzzzzz"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not chainexec's")
    other = _left(tmp_path / "b.h5.parts.old-xxxxxxxx")
    safepaths.remove_owned_aside(_marked(tmp_path / "out.h5.parts")).join()
    assert not left.parent.exists() and (foreign / "keep.txt").exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.h5.parts.old-xxxxxxxx", "out.h5.parts.old-zzzzzzzz"]


def test_another_outputs_parts_whose_name_begins_alike_stay(tmp_path):
    """Outputs ``r.h5`` and ``r.h5.parts.old-abcdefgh.h5``: the second's parts folder begins
    with the first's pattern, is marked, and is live; moving the first's aside leaves it."""
    live = _marked(tmp_path / "r.h5.parts.old-abcdefgh.h5.parts")
    live8 = _marked(tmp_path / "r.h5.parts.old-abcdefgh")  # the pattern's length, a parts folder's contents
    safepaths.remove_owned_aside(_marked(tmp_path / "r.h5.parts")).join()
    assert len(list(live.iterdir())) == 5 and len(list(live8.iterdir())) == 5


def test_one_leftover_that_cannot_go_stops_no_other(tmp_path, monkeypatch):
    """A leftover the thread cannot remove stays, marked, for the next run; the folder moved
    aside now and every other leftover go."""
    stuck = _left(tmp_path / "out.h5.parts.old-aaaaaaaa").parent
    later = _left(tmp_path / "out.h5.parts.old-zzzzzzzz").parent
    rmtree = shutil.rmtree

    def refuse(path, *args, **kwargs):
        if Path(path).parent == stuck:
            raise PermissionError(13, "Permission denied", str(path))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(safepaths.shutil, "rmtree", refuse)
    safepaths.remove_owned_aside(_marked(tmp_path / "out.h5.parts")).join()
    assert [p.name for p in tmp_path.iterdir()] == [stuck.name] and safepaths.is_owned(stuck)
    assert not later.exists()


def test_wait_removals_waits_for_a_slow_one(tmp_path, monkeypatch):
    release = threading.Event()
    rmtree = shutil.rmtree

    def slow(path, *args, **kwargs):
        release.wait(10)
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(safepaths.shutil, "rmtree", slow)
    thread = safepaths.remove_owned_aside(_marked(tmp_path / "out.h5.parts"))
    assert thread.is_alive()
    threading.Timer(0.2, release.set).start()
    safepaths.wait_removals()
    assert not thread.is_alive() and list(tmp_path.iterdir()) == []


def test_a_process_ends_once_its_removal_is_done(tmp_path):
    """``chainexec.runtime.comm.end`` (which leaves without the interpreter's exit) waits for a
    removal that outlasts the rest of the process."""
    folder = _marked(tmp_path / "out.h5.parts")
    code = ("import shutil, sys, time\n"
            "from chainexec import safepaths\n"
            "from chainexec.runtime import comm\n"
            "rmtree = shutil.rmtree\n"
            "safepaths.shutil.rmtree = lambda path, *a, **k: (time.sleep(1), rmtree(path, *a, **k))\n"
            f"safepaths.remove_owned_aside({str(folder)!r})\n"
            "comm.end(0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_parts_folder_linked_to_the_scratch_folder_is_refused(user_folder):
    """The parts folder is checked where it leads: a link into the run's scratch folder (which
    the run removes at its end) is refused before anything is written."""
    work = user_folder.parent
    config = _edit(user_folder, scratch="scr")
    (work / "scr").mkdir()
    (work / "out").mkdir(exist_ok=True)
    (work / "out" / "result.h5.parts").symlink_to(work / "scr")
    before = _snapshot(work)
    assert_refused(run_cli("run", config, "--quiet"), "scr")
    assert _snapshot(work) == before


def test_a_linked_parts_folder_is_replaced_where_it_points(tmp_path):
    """A parts folder that is a symbolic link: the folder it names is moved aside beside itself
    and made again there, so the next shards land where the user pointed them."""
    target = _marked(tmp_path / "big" / "parts")
    link = tmp_path / "out.h5.parts"
    link.symlink_to(target)
    safepaths.remove_owned_aside(link).join()
    safepaths.make_owned(link, "parts")
    assert link.is_symlink() and target.is_dir() and [p.name for p in target.iterdir()] == [safepaths.MARK]
    assert sorted(p.name for p in (tmp_path / "big").iterdir()) == ["parts"]


def test_a_folder_that_cannot_move_is_one_error_and_leaves_nothing(tmp_path, monkeypatch):
    folder = _marked(tmp_path / "out.h5.parts")

    def busy(src, dst):
        raise OSError(16, "Device or resource busy")

    monkeypatch.setattr(safepaths.os, "rename", busy)
    with pytest.raises(ChainexecError, match="cannot move the parts folder aside.*busy"):
        safepaths.remove_owned_aside(folder)
    assert [p.name for p in tmp_path.iterdir()] == ["out.h5.parts"] and len(list(folder.iterdir())) == 5


def test_an_output_name_with_no_room_for_the_parts_moved_aside_is_refused(user_folder):
    """The longest name a run makes of an output's (its parts folder moved aside) must fit."""
    name = "x" * (safepaths.NAME_MAX - len(safepaths.PARTS_ASIDE) + 1)
    config = _edit(user_folder, output=name)
    assert_refused(run_cli("run", config, "--quiet"), "longer than", safepaths.PARTS_ASIDE)
    assert run_cli("run", _edit(user_folder, output=name[:-1]), "--quiet").returncode == 0


@pytest.mark.parametrize("ranks", [None, 2])
def test_a_run_again_replaces_the_older_parts_and_leaves_none(ranks, user_folder):
    """A second run of a config moves the first run's parts folder aside and removes it before
    its process ends: only the new output and its parts stay, and it verifies."""
    work = user_folder.parent
    for _ in range(2):
        proc = run_cli("run", user_folder, "--quiet", ranks=ranks)
        assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (work / "out").iterdir()) == ["result.h5", "result.h5.parts"]
    assert run_cli("verify", user_folder).returncode == 0


def test_a_folder_that_cannot_be_read_is_one_error(tmp_path, monkeypatch):
    """A parts folder whose entries cannot be listed (no permission: root is not stopped by
    mode bits, so the refusal is stood in for): one ChainexecError naming it."""
    folder = tmp_path / "out.h5.parts"
    folder.mkdir()

    def refused(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "iterdir", refused)
    with pytest.raises(ChainexecError, match="out.h5.parts: the parts folder cannot be read"):
        safepaths._check_owned_folder(folder, "the parts folder", safepaths.parts_made(tmp_path / "out.h5"))


@pytest.mark.parametrize("path, needle", [("in\0.h5", "NUL byte"), ("d/" + "x" * 256 + "/o.h5", "longer than"),
                                          ("/".join(["d" * 200] * 21), "longer than")],
                         ids=["NUL", "a name of 256 bytes", "a path of 4220 bytes"])
def test_a_path_no_file_system_can_hold_is_refused(path, needle):
    """Refused in one line naming what the path is (the CLI's cases above: where the operating
    system's error, or Python's for a NUL, came first as a traceback); a name of 255 bytes is
    not."""
    with pytest.raises(ChainexecError, match=f"the output of B: .*{needle}"):
        safepaths.checked(path, "the output of B")
    assert safepaths.checked("d/" + "x" * 255, "x") == "d/" + "x" * 255


@pytest.mark.parametrize("command", ["generate", "run", "plan", "verify"])
def test_a_config_naming_a_file_with_a_nul_byte_is_refused(command, tmp_path):
    cfg = fourindex_config()
    cfg["tensors"]["A"]["source"]["file"] = "in\0.h5"
    config = write_config(tmp_path, cfg)
    assert_refused(run_cli(command, config), "NUL byte", "input of tensor")
    assert sorted(p.name for p in tmp_path.iterdir()) == [config.name]


@pytest.mark.parametrize("added", ["dataset", "group", "file attribute", "dataset attribute"])
def test_an_output_a_user_added_to_is_not_replaced(finished_user_folder, added):
    """A finished output a user added a dataset, group or attribute to (their analysis beside the
    result): a new run of the config is refused instead of replacing the file with what it holds,
    and once the addition is moved away the run replaces it."""
    import h5py

    work = finished_user_folder.parent
    output = work / "out" / "result.h5"
    with h5py.File(output, "a") as f:
        if added == "dataset":
            f["mine"] = [0.0, 1.0, 2.0]
        elif added == "group":
            f.create_group("mine")
        elif added == "file attribute":
            f.attrs["mine"] = "notes"
        else:
            f["B"].attrs["mine"] = "units"
    held = output.read_bytes()
    assert_refused(run_cli("run", finished_user_folder, "--quiet", cwd=work), str(output), "'mine'",
                   "that chainexec did not write")
    assert output.read_bytes() == held
    with h5py.File(output, "a") as f:
        del (f["B"].attrs if added == "dataset attribute" else f.attrs if added == "file attribute" else f)["mine"]
    assert run_cli("run", finished_user_folder, "--quiet", cwd=work).returncode == 0
    assert run_cli("verify", finished_user_folder, cwd=work).returncode == 0


@pytest.mark.parametrize("shared", ["scratch", "parts folder"])
def test_a_stopped_runs_files_are_not_taken_by_another_config_sharing_their_folder(user_folder, shared):
    """Two configs of one ``name:`` share the default scratch folder, two writing one output file
    its parts folder. While a run of the first is stopped at a checkpoint, its stored versions
    (its output's sealed shards) lie there; a run of the second (without that checkpoint, or
    with another) is refused instead of removing them (the checkpoint would name missing files,
    and the finished nests would be lost), and the first resumes to its result."""
    import yaml

    work = user_folder.parent
    cfg = yaml.safe_load(user_folder.read_text())
    cfg["machine"]["global_memory"] = "48KiB"  # 8 tiles in the first nest, 4 in the second
    user_folder.write_text(yaml.safe_dump(cfg, sort_keys=False))
    checkpoint = work / "ck"
    if shared == "scratch":
        folder, held_as = work / "out" / ".fourindex.scratch", "stored versions"
        other = _edit(user_folder, output="out/other.h5")
    else:
        folder, held_as = work / "out" / "result.h5.parts", "output shards"
        other = _edit(user_folder, scratch="elsewhere")
    for _ in range(12):  # stopped at each checkpoint until the folder holds the run's first files
        stopped = run_cli("run", user_folder, "--quiet", "--checkpoint", checkpoint, "--checkpoint-every", 0,
                          "--stop-after", 0, cwd=work)
        assert stopped.returncode == 3, stopped.stderr
        if any(name.endswith(".h5") for name in _snapshot(folder)):
            break
    held = _snapshot(folder)
    assert any(name.endswith(".h5") for name in held), held
    for extra in ([], ["--checkpoint", work / "ck2"]):
        assert_refused(run_cli("run", other, "--quiet", *extra, cwd=work), str(folder),
                       f"{held_as} of the stopped run checkpointed in {checkpoint}")
        assert _snapshot(folder) == held
    resumed = run_cli("run", user_folder, "--quiet", "--checkpoint", checkpoint, cwd=work)
    assert resumed.returncode == 0, resumed.stderr
    assert run_cli("verify", user_folder, cwd=work).returncode == 0
    assert shared != "scratch" or not folder.exists()
    assert run_cli("run", other, "--quiet", cwd=work).returncode == 0


def _small(source_file: str, outputs: dict) -> dict:
    """A two-statement chain: input A read from ``source_file``, B random; ``outputs`` by tensor."""
    return {"name": "small", "indices": {"i": 6, "j": 7, "k": 5},
            "tensors": {"A": {"indices": ["i", "k"], "source": {"file": source_file, "dataset": "A", "seed": 1}},
                        "B": {"indices": ["k", "j"], "source": {"random": 2}}},
            "statements": ["C[i,j] = A[i,k] * B[k,j]", "D[i,j] = 2 * C[i,j]"],
            "outputs": outputs}


def test_two_outputs_one_dataset_through_a_linked_folder_are_refused(tmp_path):
    """``lnk/out.h5`` where ``lnk`` links to the config's own folder is ``out.h5``: two outputs
    naming one dataset that way are refused as ``./out.h5`` and ``out.h5`` are (one would be lost);
    two datasets of one file that way both land in it."""
    (tmp_path / "lnk").symlink_to(tmp_path)
    same = write_config(tmp_path, _small("in.h5", {"C": {"file": "out.h5", "dataset": "X"},
                                                   "D": {"file": "lnk/out.h5", "dataset": "X"}}))
    assert_refused(run_cli("plan", same), "output 'D' goes to the dataset lnk/out.h5:X, as output 'C' does")
    both = write_config(tmp_path, _small("in.h5", {"C": {"file": "out.h5", "dataset": "C"},
                                                   "D": {"file": "lnk/out.h5", "dataset": "D"}}), "both.yaml")
    assert run_cli("generate", both).returncode == 0
    proc = run_cli("run", both, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert run_cli("verify", both).returncode == 0
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert sorted(f) == ["C", "D"]
        np.testing.assert_array_equal(f["D"][()], 2 * f["C"][()])


def test_dotdot_after_a_linked_folder_is_where_the_file_system_puts_it(tmp_path):
    """A config reached through a linked folder (``L`` → ``real/sub``) names ``../in.h5``: that is
    ``real/in.h5``, as the shell, ``open`` and the config's own folder find it, not the file
    beside the link (a user's, whose dataset ``generate`` replaced when ``..`` was read as text)."""
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "L").symlink_to(tmp_path / "real" / "sub")
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["A"] = np.full((6, 5), 42.0)
    before = _snapshot(tmp_path)
    config = write_config(tmp_path / "real" / "sub", _small("../in.h5", {"D": {"file": "../out.h5", "dataset": "D"}}))
    proc = run_cli("generate", tmp_path / "L" / config.name)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {tmp_path / 'real' / 'in.h5'}" in proc.stdout
    proc = run_cli("run", tmp_path / "L" / config.name, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "real" / "out.h5").is_file() and not (tmp_path / "out.h5").exists()
    assert {k: v for k, v in _snapshot(tmp_path).items() if not k.startswith("real")} == before


def test_a_refused_run_makes_no_folder(tmp_path):
    """An output in folders not made yet (``sub/deeper/out.h5``): a run refused (its input is
    missing) leaves none of them; one under a file is refused as not writable; the run that
    passes makes them."""
    config = write_config(tmp_path, _small("in.h5", {"D": {"file": "sub/deeper/out.h5", "dataset": "D"}}))
    assert_refused(run_cli("run", config, "--quiet"), "in.h5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain.yaml"]
    (tmp_path / "sub").write_text("a file of the user's")
    assert_refused(run_cli("run", config, "--quiet"), "output path is not writable (Not a directory)")
    (tmp_path / "sub").unlink()
    assert run_cli("generate", config).returncode == 0
    proc = run_cli("run", config, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "sub" / "deeper" / "out.h5").is_file()


def test_a_config_named_through_dotdot_after_a_link_reads_beside_itself(tmp_path):
    """A config named ``L/../c.yaml`` (``L`` → ``real/sub``) is ``real/c.yaml``, as ``open``
    finds it: its paths are relative to ``real``, not to the folder beside the link."""
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "L").symlink_to(tmp_path / "real" / "sub")
    write_config(tmp_path / "real", _small("in.h5", {"D": {"file": "out.h5", "dataset": "D"}}), "c.yaml")
    proc = run_cli("generate", "L/../c.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {tmp_path / 'real' / 'in.h5'}" in proc.stdout
    proc = run_cli("run", "L/../c.yaml", "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "real" / "out.h5").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["L", "real"]
