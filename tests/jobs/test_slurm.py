"""The SLURM batch scripts in jobs/: shape checks that run anywhere, and a real submission of
jobs/fourindex.sbatch with 2 ranks when a SLURM controller with an idle node answers (CI sets
one up with .ci/slurm-setup.sh; elsewhere that test skips)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from chainexec.calibrate import QUICK_VARIABLE
from tests.conftest import fourindex_config, write_config

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "jobs").glob("*.sbatch"))
JOB_TIMEOUT = 300  # seconds from submission to a finished job; the job itself takes ~5 s here


def test_both_job_scripts_exist():
    assert {p.name for p in SCRIPTS} >= {"fourindex.sbatch", "ccsd_t.sbatch"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_job_script_shape(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    lines = text.splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    # sbatch stops reading #SBATCH lines at the first command, so they must all come before it.
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    directives = [line.split()[1] for line in lines[:first_command] if line.startswith("#SBATCH")]
    assert not [line for line in lines[first_command:] if line.startswith("#SBATCH")]
    options = {d.split("=")[0] for d in directives}
    assert {"--job-name", "--nodes", "--ntasks-per-node", "--gpus-per-task", "--time", "--output"} <= options
    assert "--gpus-per-task=1" in directives  # one rank per GPU
    assert lines[first_command] == "set -euo pipefail"
    # one world's ranks, all ended where one fails (a rank left waiting on it held the job to its limit)
    assert re.search(r'^srun --mpi="\$SRUN_MPI" --kill-on-bad-exit=1 "\$CHAINEXEC" run "\$CONFIG"', text, re.M)
    assert re.search(r"^SRUN_MPI=\$\{SRUN_MPI:-pmi2\}", text, re.M)
    # several nodes: every node's view of the folders is checked before anything runs or is written
    assert re.search(r'^\. "\$CHAINEXEC_HOME/jobs/steps\.sh"$', text, re.M)
    checked = re.search(r'^check_nodes "\$(VENV/bin/python|PYTHON)" .*\|\| exit 2$', text, re.M)
    assert checked
    steps = ("\ncheck_world ", '"$CHAINEXEC" generate', '"$CHAINEXEC" chem')
    later = [text.index(step) for step in steps if step in text]
    assert len(later) == 2 and checked.start() < min(later)


FAKE_SRUN = """#!/usr/bin/env bash
# srun's stand-in: options dropped, the command run here as the other node; with HIDE set that
# node sees another folder of that name (this node's marks are not there)
while [[ $1 == --* ]]; do shift; done
[ -z "${HIDE:-}" ] || rm -f "$HIDE"/.chainexec-shared-*
exec "$@"
"""


@pytest.mark.parametrize("nodes, hide, python, status, said", [
    ("2", "", sys.executable, 0, "chainexec-job: all 2 nodes run"),
    ("2", "b", sys.executable, 2, "does not see {b} (not on a shared file system)"),
    ("2", "", "/nonexistent/python", 2, "cannot run /nonexistent/python"),
    ("1", "b", "/nonexistent/python", 0, ""),
    ("2", "", sys.executable, 2, "chainexec-job: cannot write in {b} (the job writes there)"),
], ids=["shared", "not shared", "no venv", "one node", "second folder not writable"])
def test_check_nodes(tmp_path, nodes, hide, python, status, said):
    """jobs/steps.sh's ``check_nodes`` with a stand-in srun whose "node" sees both folders, or
    another folder in place of the second, or cannot run the venv's Python, or where the second
    folder cannot be written (a file in its place: root writes in a read-only folder): status 0
    with a line naming what every node sees, else 2 naming what a node lacks or the folder; no
    mark left behind. On one node it does nothing (no srun)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(FAKE_SRUN if nodes != "1" else "#!/bin/sh\nexit 9\n")
    (fake / "srun").chmod(0o755)
    folders = {name: tmp_path / name for name in "ab"}
    for folder in folders.values():
        folder.mkdir()
    if "cannot write" in said:
        folders["b"].rmdir()
        folders["b"].write_text("")
        folders = {"a": folders["a"], "b": folders["b"]}
    env = {"PATH": f"{fake}:/usr/bin:/bin", "SLURM_JOB_NUM_NODES": nodes, "HIDE": str(folders[hide]) if hide else ""}
    proc = subprocess.run(["bash", "-c", f'set -euo pipefail; . {REPO}/jobs/steps.sh; check_nodes "$@" || exit $?',
                           "job", python, *map(str, folders.values())], capture_output=True, text=True, env=env)
    assert proc.returncode == status, proc.stdout + proc.stderr
    assert said.format(**folders) in proc.stdout + proc.stderr
    assert not [p for folder in folders.values() if folder.is_dir() for p in folder.iterdir()]


def _sinfo_states() -> list[str]:
    """Node states, or [] when no controller answers (sinfo retries a dead one for a long time)."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return []
    return out.stdout.split() if out.returncode == 0 else []


def _job_fields(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30)
    return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)


def _run_job(script: str, variables: str, folder: Path) -> tuple[str, str]:
    """Submit ``jobs/SCRIPT`` on 2 ranks with extra ``--export`` variables and wait for it:
    (job id, its log). Skips when no SLURM controller with an idle node answers."""
    if not (shutil.which("sbatch") and shutil.which("sinfo") and shutil.which("scontrol")):
        pytest.skip("no SLURM client commands (sbatch, sinfo, scontrol)")
    states = _sinfo_states()
    if not {"idle", "mix"} & set(states):
        pytest.skip(f"no idle SLURM node (sinfo: {states or 'no answer'})")
    options = ["--nodes=1", "--ntasks-per-node=2", f"--output={folder}/job-%j.out"]
    gres = subprocess.run(["sinfo", "-h", "-o", "%G"], capture_output=True, text=True, timeout=30).stdout
    if "gpu" not in gres:
        # The CI node has no GPUs; SLURM rejects --gpus-per-task=1 there, so ask for none.
        options.append("--gpus-per-task=0")
    venv = Path(sys.executable).parent.parent
    export = f"--export=ALL,CHAINEXEC_HOME={REPO},VENV={venv},BACKEND=numpy,{variables}"
    submit = subprocess.run(["sbatch", "--parsable", *options, export, str(REPO / "jobs" / script)],
                            capture_output=True, text=True, timeout=60, cwd=folder)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT
    while (fields := _job_fields(job)).get("JobState") in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], timeout=30)
            pytest.fail(f"SLURM job {job} not finished after {JOB_TIMEOUT} s (state {fields.get('JobState')})")
        time.sleep(1)
    log = (folder / f"job-{job}.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert "srun --mpi=pmi2 gives MPI world size(s): 2\n" in log
    return job, log


def test_fourindex_job_on_slurm(tmp_path):
    config = write_config(tmp_path, fourindex_config())
    job, log = _run_job("fourindex.sbatch", f"CONFIG={config}", tmp_path)
    assert re.search(r"^wrote \S*in\.h5:A$", log, re.M), log  # generate --missing: no input existed
    assert re.search(r"^B: einsum over 4096 elements, relative error \S+ \(tolerance 1e-12\) ok$", log, re.M), log
    assert log.rstrip().endswith("chainexec-job: verify passed")
    with h5py.File(tmp_path / "out" / "result.h5", "r") as f:
        assert f.attrs["chainexec_complete"]
    report = json.loads((tmp_path / f"chainexec-fourindex-{job}.json").read_text())
    # (`run` exits 1 when measured movement differs from the prediction, so COMPLETED covers that.)
    assert report["run"]["ranks"] == 2 and report["run"]["backend"] == "numpy"


def test_ccsd_t_job_on_slurm(tmp_path):
    """The flagship job: H2O/cc-pVDZ (T) on 2 ranks under SLURM, energy equal to PySCF's."""
    pytest.importorskip("pyscf")
    job, log = _run_job("ccsd_t.sbatch", f"MOLECULE=h2o,WORKDIR={tmp_path / 'h2o'}", tmp_path)
    assert log.rstrip().endswith("chainexec-job: energy check passed"), log
    with h5py.File(tmp_path / "h2o" / "energy.h5", "r") as f, h5py.File(tmp_path / "h2o" / "inputs.h5", "r") as g:
        assert f.attrs["chainexec_complete"]
        assert abs(float(f["E"][()]) - float(g.attrs["e_t"])) <= 1e-10


def _stand_in_job(script: str, tmp_path: Path, srun: str, **variables) -> subprocess.CompletedProcess:
    """``jobs/SCRIPT`` run as SLURM would on one node of 2 tasks, with ``srun`` a stand-in script
    (its text) and the NumPy backend; no SLURM needed. Its environment is its own (a fresh HOME),
    so the job's first run calibrates the machine into HOME's cache, as on a fresh cluster: the
    tiny calibration (``CHAINEXEC_QUICK_CALIBRATION=tiny``), as everywhere in the tests."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "srun").write_text(srun)
    (fake / "srun").chmod(0o755)
    venv = Path(sys.executable).parent.parent
    env = {"PATH": f"{fake}:{venv / 'bin'}:/usr/bin:/bin", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(tmp_path), "CHAINEXEC_HOME": str(REPO), "VENV": str(venv),
           "BACKEND": "numpy", "HOME": str(tmp_path), QUICK_VARIABLE: "tiny"} | variables
    return subprocess.run(["bash", str(REPO / "jobs" / script)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)


FAILING_SRUN = """#!/usr/bin/env bash
echo "srun: error: Couldn't find the specified plugin name for mpi/pmix looking at all files" >&2
exit 1
"""


@pytest.mark.parametrize("script", ["fourindex.sbatch", "ccsd_t.sbatch"])
def test_a_job_whose_srun_fails_says_so_and_exits_2(tmp_path, script):
    """An srun that cannot start the ranks (a PMI plugin the cluster lacks) ends the job with the
    status and the hint the world-size check promises, not with the shell's own exit: 2, a
    setting to change (3 is a run stopped at a checkpoint, which a wrapper submits again)."""
    if script == "ccsd_t.sbatch":
        pytest.importorskip("pyscf")
    variables = ({"CONFIG": str(write_config(tmp_path, fourindex_config()))} if script == "fourindex.sbatch"
                 else {"MOLECULE": "h2o", "BASIS": "sto-3g", "WORKDIR": str(tmp_path / "w")})
    proc = _stand_in_job(script, tmp_path, FAILING_SRUN, SRUN_MPI="pmix", **variables)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gives MPI world size(s): none (srun failed)" in proc.stdout
    assert "set SRUN_MPI" in proc.stderr


def test_a_ccsd_t_job_submitted_again_for_another_molecule_is_refused(tmp_path):
    """Submitted again for the same molecule once finished, the job checks the energy it made
    without running again; for another molecule into the same WORKDIR, whose inputs are not
    that molecule's, it stops before running anything on them, where it would compute the
    first molecule's energy and check it against that molecule's PySCF energy. FROZEN reaches
    ``chainexec chem --frozen`` (the job had no way to freeze the core), CHARGE ``--charge``."""
    pytest.importorskip("pyscf")
    import h5py

    srun = "#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\nexec mpiexec -n \"$SLURM_NTASKS\" \"$@\"\n"
    work = tmp_path / "w"
    first = _stand_in_job("ccsd_t.sbatch", tmp_path, srun, MOLECULE="h2o", BASIS="sto-3g", FROZEN="1",
                          WORKDIR=str(work))
    assert first.returncode == 0 and "energy check passed" in first.stdout, first.stdout + first.stderr
    with h5py.File(work / "inputs.h5") as f:  # FROZEN reached chem --frozen: the core left out
        assert int(f.attrs["frozen"]) == 1
    energy = (work / "energy.h5").read_bytes()
    # submitted again once finished: the energy is checked, not made again (a run would first
    # remove it and redo the whole (T))
    again = _stand_in_job("ccsd_t.sbatch", tmp_path, srun, MOLECULE="h2o", BASIS="sto-3g", FROZEN="1",
                          WORKDIR=str(work))
    assert again.returncode == 0 and "kept" in again.stdout and "energy check passed" in again.stdout, again.stderr
    assert "energy.h5 is complete and newer than its inputs and config: checking it" in again.stdout
    assert "gives MPI world size" not in again.stdout and (work / "energy.h5").read_bytes() == energy
    other = _stand_in_job("ccsd_t.sbatch", tmp_path, srun, MOLECULE="n2", BASIS="sto-3g", FROZEN="1",
                          WORKDIR=str(work))
    assert other.returncode == 2, other.stdout + other.stderr
    assert "made for another job: atoms" in other.stderr and "energy check" not in other.stdout
    ion = _stand_in_job("ccsd_t.sbatch", tmp_path, srun, MOLECULE="h2o", BASIS="sto-3g", FROZEN="1", CHARGE="2",
                        WORKDIR=str(work))
    assert ion.returncode == 2, ion.stdout + ion.stderr
    assert "made for another job: charge 0 (here 2)" in ion.stderr and "energy check" not in ion.stdout
    assert (work / "energy.h5").read_bytes() == energy


@pytest.mark.parametrize("variable, value, said", [
    ("STOP_AFTER", "1h", "STOP_AFTER=1h is not a whole number of seconds"),
    ("STOP_AFTER", "1.5e3", "STOP_AFTER=1.5e3 is not a whole number of seconds"),
    ("CHECKPOINT_EVERY", "10m", "CHECKPOINT_EVERY=10m is not a number of seconds"),
    ("STALL_TIMEOUT", "1h", "STALL_TIMEOUT=1h is not a positive number of seconds"),
    ("STALL_TIMEOUT", "0.0", "STALL_TIMEOUT=0.0 is not a positive number of seconds"),
    ("TOLERANCE", "1e-10Eh", "TOLERANCE=1e-10Eh is not a number of Hartree"),
    ("CHAINEXEC_HOME", "/nonexistent", "/nonexistent/jobs/steps.sh not found (set CHAINEXEC_HOME"),
    ("CHARGE", "1.0", "CHARGE=1.0 is not a whole number"),
    ("FROZEN", "x", "FROZEN=x is not a whole number"),
])
def test_a_ccsd_t_job_with_a_setting_it_cannot_read_stops_before_it_runs(tmp_path, variable, value, said):
    """A STOP_AFTER with a unit was dropped by bash's arithmetic without a word (the job then ran
    into its time limit and never requeued), a TOLERANCE Python cannot read failed as a traceback
    with status 1 after the whole run, a CHAINEXEC_HOME without the job's helper failed with the
    shell's status 1, a CHARGE chem could not read left the folder it names: each ends the job
    with one line and status 2 before PySCF or srun runs, and before any folder is made."""
    srun = "#!/bin/sh\necho srun ran >&2\nexit 9\n"
    template = {"TEMPLATE": str(REPO / "configs" / "ccsd_t.yaml")} if variable == "CHAINEXEC_HOME" else {}
    proc = _stand_in_job("ccsd_t.sbatch", tmp_path, srun, MOLECULE="h2o", BASIS="sto-3g",
                         WORKDIR=str(tmp_path / "w"), **template, **{variable: value})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"chainexec-job: {said}" in proc.stderr and "srun ran" not in proc.stderr
    assert not (tmp_path / "w" / "inputs.h5").exists()
    if variable in ("CHARGE", "FROZEN"):
        assert not (tmp_path / "w").exists()


MPIEXEC_SRUN = "#!/usr/bin/env bash\nwhile [[ $1 == -* ]]; do shift; done\nexec mpiexec -n \"$SLURM_NTASKS\" \"$@\"\n"
"""srun's stand-in that starts one world of ``SLURM_NTASKS`` ranks through the venv's mpiexec."""


@pytest.mark.mpi
@pytest.mark.parametrize("scontrol_status", [0, 1])
def test_a_fourindex_job_stopped_at_a_checkpoint_goes_on_when_submitted_again(tmp_path, scontrol_status):
    """``STOP_AFTER=0``: the run stops at its first checkpoint and the job ends with status 3
    (not finished), requeued with ``REQUEUE=1`` or, where the cluster refuses (``scontrol``
    fails), saying so with the same status (it ended with the shell's 1, which the docs give to
    measured ≠ predicted); submitted again it goes on from the checkpoint, its output verified
    (the job had no checkpoint and began again from nothing)."""
    config = write_config(tmp_path, fourindex_config())
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(f"#!/bin/sh\necho \"scontrol $*\" >> {tmp_path}/scontrol.log\nexit {scontrol_status}\n")
    (fake / "scontrol").chmod(0o755)
    first = _stand_in_job("fourindex.sbatch", tmp_path, MPIEXEC_SRUN, CONFIG=str(config), STOP_AFTER="0", REQUEUE="1")
    assert first.returncode == 3, first.stdout + first.stderr
    checkpoint = tmp_path / "chain.checkpoint"
    assert f"stopped at a checkpoint in {checkpoint}; requeueing job 7" in first.stdout
    assert (tmp_path / "scontrol.log").read_text() == "scontrol requeue 7\n"
    assert ("scontrol requeue 7 failed" in first.stderr) == bool(scontrol_status), first.stderr
    assert checkpoint.is_dir() and not (tmp_path / "out" / "result.h5").exists()
    again = _stand_in_job("fourindex.sbatch", tmp_path, MPIEXEC_SRUN, CONFIG=str(config))
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.rstrip().endswith("verify passed")
    assert json.loads((tmp_path / "chainexec-fourindex-7.json").read_text())["run"]["resumed_tiles"] > 0
