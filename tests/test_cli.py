"""Bad input: one line naming the file and the problem, exit status 2, no traceback, and no output
that looks complete."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from tests.conftest import assert_refused, fourindex_config, launch, open_mpi, run_cli, write_config


def _no_complete_output(folder):
    out = folder / "out" / "result.h5"
    if out.exists():
        with h5py.File(out, "r") as f:
            assert not f.attrs.get("chainexec_complete", False)


SPEC_ERRORS = {
    "malformed_yaml": (lambda text: text.replace("statements:", "statements: [oops"), ["chain.yaml:", "malformed YAML"]),
    "unknown_index": (lambda text: text.replace("C[s,d] * A", "C[z,d] * A"), ["chain.yaml:", "unknown index 'z'"]),
    "index_once": (lambda text: text.replace("C[s,d] * A[p,q,r,s]", "A[p,q,r,s]"),
                   ["chain.yaml:", "appears only once"]),
    "bad_tensor_name": (lambda text: text.replace("B[a,b,c,d] =", "B-1[a,b,c,d] ="), ["chain.yaml:", "tensor reference"]),
    "bad_index_name": (lambda text: text.replace("  p: 10", "  p$: 10"), ["chain.yaml:", "not a plain identifier"]),
    "keyword_name": (lambda text: text.replace("B[a,b,c,d] =", "int[a,b,c,d] =").replace("\n  B:", "\n  int:"),
                     ["chain.yaml:", "not a plain identifier"]),
    "tiny_device": (lambda text: text.replace("device_memory: 3KiB", "device_memory: 16"),
                    ["chain.yaml:", "too small for any plan", "needs at least 24 B"]),
    "unknown_key": (lambda text: text.replace("machine:", "machin:"), ["chain.yaml:", "unknown key 'machin'"]),
}


@pytest.mark.parametrize("case", sorted(SPEC_ERRORS))
@pytest.mark.parametrize("command", ["plan", "run"])
def test_spec_errors(case, command, tmp_path):
    edit, needles = SPEC_ERRORS[case]
    config = write_config(tmp_path, fourindex_config(n=10, nmo=8))
    config.write_text(edit(config.read_text()))
    proc = run_cli(command, config)
    assert_refused(proc, *needles)
    _no_complete_output(tmp_path)


def test_yaml_error_names_the_line(tmp_path):
    config = write_config(tmp_path, fourindex_config())
    lines = config.read_text().splitlines()
    at = next(k for k, line in enumerate(lines) if "C[p,a]" in line)
    lines[at] = lines[at].replace("C[p,a]", "C[p,a,zz]")
    config.write_text("\n".join(lines) + "\n")
    proc = run_cli("plan", config)
    assert_refused(proc, f"chain.yaml:{at + 1}:", "unknown index 'zz'")


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """A config, the inputs ``chainexec generate`` wrote for it and the complete output of a run
    of it, made once per module (and worker): :func:`_with_inputs` copies the folder."""
    work = tmp_path_factory.mktemp("ran")
    config = write_config(work, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    assert run_cli("run", config).returncode == 0
    assert (work / "out" / "result.h5").exists()
    return work


def _with_inputs(ran, tmp_path, mutate=None):
    """A copy of the folder ``ran`` in ``tmp_path``: a generated config whose input file is then
    changed by ``mutate(h5file)``; the older complete output is there to check that a refused run
    leaves it as it was (:func:`_output_bytes`) and that a run that fails once it has begun leaves
    it no more."""
    shutil.copytree(ran, tmp_path, dirs_exist_ok=True)
    config = tmp_path / "chain.yaml"
    if mutate:
        with h5py.File(tmp_path / "in.h5", "a") as f:
            mutate(f)
    return config


def _output_bytes(tmp_path) -> bytes:
    """The older output's bytes, to compare before and after a refused run."""
    return (tmp_path / "out" / "result.h5").read_bytes()


def _replace(name, data):
    def mutate(f):
        del f[name]
        f[name] = data
    return mutate


INPUT_ERRORS = {
    "shape": (_replace("C", np.random.default_rng(1).random((10, 9))), ["in.h5", "shape (10, 9)", "(10, 8)"]),
    "dtype": (_replace("C", np.random.default_rng(2).random((10, 8)).astype(np.float32)), ["in.h5", "dtype float32"]),
    "byte_order": (_replace("C", np.random.default_rng(3).random((10, 8)).astype(">f8")),
                   ["in.h5", "holds float64 of the other byte order (>f8)", "in this machine's order"]),
    "missing_dataset": (lambda f: f.__delitem__("A"), ["in.h5", "no dataset 'A'"]),
}


@pytest.mark.parametrize("case", sorted(INPUT_ERRORS))
def test_input_errors(case, tmp_path, ran):
    mutate, needles = INPUT_ERRORS[case]
    config = _with_inputs(ran, tmp_path, mutate)
    older = _output_bytes(tmp_path)
    proc = run_cli("run", config, ranks=2)
    assert_refused(proc, *needles)
    assert _output_bytes(tmp_path) == older


@pytest.mark.parametrize("case, needle", [("shape", "shape (10, 9)"), ("dtype", "float32")])
def test_verify_refuses_an_input_unlike_its_tensor(case, needle, tmp_path, ran):
    """``verify`` reads the inputs itself (sharing no code with the run): an input dataset of
    another shape or dtype is one line naming the file, exit 2, as for ``run``."""
    config = _with_inputs(ran, tmp_path, INPUT_ERRORS[case][0])
    assert_refused(run_cli("verify", config), "in.h5", "dataset 'C'", needle, "tensor C[p,a]")


def test_missing_input_file(tmp_path, ran):
    config = _with_inputs(ran, tmp_path)
    older = _output_bytes(tmp_path)
    (tmp_path / "in.h5").unlink()
    proc = run_cli("run", config)
    assert_refused(proc, "in.h5", "not found")
    assert _output_bytes(tmp_path) == older


def test_statement_dtype_mismatch(tmp_path):
    cfg = fourindex_config()
    cfg["tensors"]["C"]["dtype"] = "float32"
    proc = run_cli("plan", write_config(tmp_path, cfg))
    assert_refused(proc, "chain.yaml:", "dtype mismatch")


def test_output_not_writable(tmp_path):
    cfg = fourindex_config()
    (tmp_path / "blocker").write_text("a file where a folder should be")
    cfg["outputs"]["B"]["file"] = "blocker/result.h5"
    config = write_config(tmp_path, cfg)
    assert run_cli("generate", config).returncode == 0
    proc = run_cli("run", config)
    assert_refused(proc, "result.h5", "not writable")


def test_float32_chain_runs(tmp_path):
    cfg = copy.deepcopy(fourindex_config())
    cfg["dtype"] = "float32"
    config = write_config(tmp_path, cfg)
    assert run_cli("generate", config).returncode == 0
    proc = run_cli("run", config)
    assert proc.returncode == 0, proc.stderr
    check = run_cli("verify", config)
    assert check.returncode == 0, check.stdout
    with h5py.File(tmp_path / "out" / "result.h5", "r") as f:
        assert f["B"].dtype == np.float32


def test_plan_json_names(tmp_path):
    import json

    proc = run_cli("plan", write_config(tmp_path, fourindex_config()), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data["predicted"]["bytes"]) == {"disk->global", "global->disk", "global->device", "device->global"}
    assert set(data["predicted"]["memory_peak"]) == {"global", "device"}
    # n = 10 AO, 8 MO: each step replaces one AO index by an MO index, 2·(8^k·10^(5-k)) flops.
    assert data["predicted"]["flops"] == sum(2 * 8**k * 10 ** (5 - k) for k in range(1, 5))
    assert [c["output"] for c in data["contractions"]][-1] == "B[a,b,c,d]"
    assert all({"output", "inputs", "flops"} <= set(c) for c in data["contractions"])


def test_report_keys_identical(tmp_path):
    import json

    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    proc = run_cli("run", config, "--report-json", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    # a GPU run also measures its allocator's high-water mark, which nothing predicts
    assert set(data["predicted"]) <= set(data["measured"]) <= set(data["predicted"]) | {"memory_high_water"}
    for key in ("bytes", "memory_peak", "seconds"):
        assert set(data["predicted"][key]) == set(data["measured"][key])


def test_run_report_and_plot(tmp_path):
    import json

    from chainexec.spec import format_size

    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    png = tmp_path / "out.png"
    proc = run_cli("run", config, "--quiet", "--report", "--plot", png, "--report-json", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stderr
    measured = json.loads((tmp_path / "r.json").read_text())["measured"]
    table = proc.stdout[proc.stdout.index("\nlevel "):]  # after the predicted/measured comparison
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.strip()}
    for level, categories in (("disk", ("disk->global", "global->disk")),
                              ("global<->device", ("global->device", "device->global"))):
        moved = sum(measured["bytes"][k] for k in categories)
        assert " ".join(rows[level][3:5]) == format_size(moved)
        if measured["seconds"][level] > 0:
            assert float(rows[level][6]) == pytest.approx(moved / measured["seconds"][level] / 1e9, abs=6e-4)
    assert int(rows["compute"][2].replace(",", "")) == measured["flops"]
    assert {"wall", "peak"} <= set(rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_tccg_needs_a_gpu_and_its_cases(tmp_path):
    """`chainexec bench tccg` documents its options; without CuPy (or without the case file) it
    fails with one line and exit status 2, writing nothing."""
    r = run_cli("bench", "tccg", "-h")
    assert r.returncode == 0 and "--scales" in r.stdout
    out = tmp_path / "bench.json"
    r = run_cli("bench", "tccg", "--out", out, "--tccg", tmp_path / "missing.json")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert ("CuPy" in r.stderr) or ("missing.json" in r.stderr)
    assert not out.exists()
    for bad, needle in ((("--out", out, "--bogus"), "--bogus"), (("--out", out, "--scales", "abc"), "'abc'"),
                        ((), "--out")):
        assert_refused(run_cli("bench", "tccg", *bad), "chainexec bench tccg", needle)


def test_plan_for_several_ranks(tmp_path):
    """`plan --ranks N` plans what an N-rank run executes and says so; N < 1 is refused."""
    import json

    config = write_config(tmp_path, fourindex_config())
    r = run_cli("plan", config, "--ranks", 3)
    assert r.returncode == 0 and "3 ranks: disk" in r.stdout
    plan = json.loads(run_cli("plan", config, "--ranks", 3, "--json").stdout)["plan"]
    assert plan["ranks"] == 3
    bad = run_cli("plan", config, "--ranks", 0)
    assert bad.returncode == 2 and "--ranks" in bad.stderr and "Traceback" not in bad.stderr


def test_plan_for_a_million_ranks_detects_limits_once_per_kind_of_rank(tmp_path):
    """Memory detected for ``plan --ranks N``: the ranks alike are one figure, not N (a
    hundred million ranks took the host's memory); more than MAX_RANKS is refused in one line."""
    from chainexec import cli

    cfg = fourindex_config()
    del cfg["machine"]
    config = write_config(tmp_path, cfg)
    r = run_cli("plan", config, "--ranks", cli.MAX_RANKS, "--no-plan-cache", timeout=120)
    assert r.returncode == 0 and f"{cli.MAX_RANKS} ranks: disk" in r.stdout, r.stderr
    assert_refused(run_cli("plan", config, "--ranks", cli.MAX_RANKS + 1), "--ranks", "at most 1,048,576")


REFUSED_RUNS = {
    "no_plan": (lambda config, tmp: config.write_text(config.read_text().replace("device_memory: 3KiB",
                                                                                 "device_memory: 8")),
                (), ["device_memory", "too small"]),
    "schedule": (None, ("--schedule", "bogus"), ["no schedule named 'bogus'"]),
    "machine_file": (None, ("--machine", "none.json"), ["none.json", "cannot read machine file"]),
    "checkpoint_every": (None, ("--checkpoint", "ck", "--checkpoint-every", "-5"),
                         ["--checkpoint-every must be a finite number of seconds"]),
    "plot_not_writable": (None, ("--plot", "/sys/chainexec.png"), ["/sys/chainexec.png", "not writable"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED_RUNS))
def test_a_refused_run_leaves_the_older_output_as_it_was(case, tmp_path, ran):
    """A run refused before it computes anything (limits that allow no plan, a bad option, a
    machine file not there, a report it could not write) exits 2 with one line and leaves the
    output of an earlier run of the config as it was: a mistyped option does not cost a result."""
    edit, options, needles = REFUSED_RUNS[case]
    config = _with_inputs(ran, tmp_path)  # ran once: its output is there
    older = _output_bytes(tmp_path)
    if edit:
        edit(config, tmp_path)
    proc = run_cli("run", config, "--quiet", *options, cwd=tmp_path)
    assert_refused(proc, *needles)
    assert _output_bytes(tmp_path) == older


def test_a_rank_whose_backend_cannot_start_refuses_the_run_on_every_rank(tmp_path, ran):
    """Rank 1 of 2 cannot start its backend (here an unknown CHAINEXEC_GPU_METHOD in its
    environment alone; on a cluster, a node without a GPU): every rank ends, exit 2, one line
    naming the rank, and the older output stays as it was (rank 0 removes it only once every
    rank's backend has started)."""
    config = _with_inputs(ran, tmp_path)
    older = _output_bytes(tmp_path)
    script = ('[ "${PMI_RANK:-$OMPI_COMM_WORLD_RANK}" = 1 ] && export CHAINEXEC_GPU_METHOD=bogus; '
              f'exec {sys.executable} -m chainexec.cli run {config} --quiet')
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run([*launch(2), "sh", "-c", script], capture_output=True, text=True, timeout=120, env=env)
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if " UCX " not in line)
    assert_refused(proc, "rank 1", "CHAINEXEC_GPU_METHOD='bogus'")
    assert _output_bytes(tmp_path) == older


def _poison(f):
    f["A"][0, 0] = np.nan


@pytest.mark.parametrize("ranks", [None, 2])
def test_a_run_that_fails_once_begun_leaves_no_older_output(tmp_path, ranks, ran):
    """A run that has begun (every check passed) removes the older output first: one whose
    result holds NaN (from an input that does) exits 2 and leaves nothing that looks like its
    result, neither its own nor the older one, nor the older run's reports (a report that is a
    link: the link, not the file it leads to), and none of its shards (every rank raises the
    error alike): no parts or scratch folder, none moved aside."""
    config = _with_inputs(ran, tmp_path, _poison)
    out = tmp_path / "out"
    assert [p.name for p in out.iterdir() if p.name.endswith(".parts")]  # the older run's
    (tmp_path / "r.json").write_text('{"older": "report"}')
    (tmp_path / "kept.json").write_text('{"kept": "report"}')
    (tmp_path / "latest.json").symlink_to("kept.json")  # a link's target is the user's: the write replaces the link
    proc = run_cli("run", config, "--quiet", "--report-json", tmp_path / "r.json", "--plot",
                   tmp_path / "latest.json", ranks=ranks)
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if " UCX " not in line)
    assert_refused(proc, "result.h5", "not finite")
    assert not (out / "result.h5").exists() and not (tmp_path / "r.json").exists()
    assert not (tmp_path / "latest.json").is_symlink() and (tmp_path / "kept.json").read_text() == '{"kept": "report"}'
    assert not [p.name for p in out.iterdir() if ".parts" in p.name or ".scratch" in p.name], list(out.iterdir())


def test_a_run_that_fails_with_a_checkpoint_keeps_its_shards(tmp_path, ran):
    """The same failure under ``--checkpoint``: the parts folder, whose shards the checkpoint
    resumes from, stays with them."""
    config = _with_inputs(ran, tmp_path, _poison)
    proc = run_cli("run", config, "--quiet", "--checkpoint", str(tmp_path / "ck"))
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if " UCX " not in line)
    assert_refused(proc, "result.h5", "not finite")
    assert [p for p in (tmp_path / "out" / "result.h5.parts").rglob("*.h5")]


def test_memory_the_host_lacks_is_one_clear_error(tmp_path):
    """A plan whose limits exceed the host's memory (here a 128 TiB intermediate under 1 PiB
    limits; its output, 32 MiB, fits the disk, which a larger one would not: refused before, see
    test_store) stops at the allocation with one line naming the config, the tensor and the
    level, exit 2, and no output file."""
    config = write_config(tmp_path, {
        "name": "too_big", "indices": {"i": 2**22, "j": 2**22},
        "tensors": {"A": {"indices": ["i"], "source": {"file": "in.h5", "dataset": "A", "seed": 1}},
                    "B": {"indices": ["j"], "source": {"file": "in.h5", "dataset": "B", "seed": 2}}},
        "statements": ["C[i,j] = A[i] * B[j]", "D[i] = C[i,j] * B[j]"],
        "outputs": {"D": {"file": "out.h5", "dataset": "D"}},
        "machine": {"global_memory": "1048576GiB", "device_memory": "1048576GiB"}})
    assert run_cli("generate", config).returncode == 0
    proc = run_cli("run", config, "--quiet")
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if " UCX " not in line)  # MPICH's transport chatter
    assert_refused(proc, str(config), "C[i,j] at the device level", "could not allocate 128.00 TiB")
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize("ranks", [None, 2])
def test_interrupt_prints_one_line(ranks, tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) during a run: status 130, one
    line from chainexec and no traceback, no output file; the same command then completes. Open
    MPI's launcher, interrupted, sends its ranks SIGTERM and SIGKILL and ends with a status of its
    own (1), its ranks' last lines unforwarded, and its SIGTERM may reach them after the run has
    finished: there, a failed status, at most one line, and an output only if it is complete."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cfg = fourindex_config(n=48, nmo=44, global_memory="8MiB", device_memory="1MiB")
    cfg["tensors"]["A"]["source"] = {"random": 1}
    cfg["tensors"]["C"]["source"] = {"random": 2}
    config = write_config(tmp_path, cfg)
    cmd = [sys.executable, "-m", "chainexec.cli", "run", str(config), "--quiet"]
    if ranks:
        cmd = [*launch(ranks), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    parts = tmp_path / "out" / "result.h5.parts"
    deadline = time.monotonic() + 60
    while not any(parts.glob("B.*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    ours = [line for line in err.splitlines() if line.startswith("chainexec:")]
    assert "Traceback" not in err, err
    assert proc.returncode == 130 if not (ranks and open_mpi()) else proc.returncode != 0, (proc.returncode, err)
    # MPICH's launcher, interrupted itself, may end before it forwards the ranks' last line.
    assert len(ours) == 1 and "interrupted" in ours[0] if not ranks else len(ours) <= 1, err
    output = tmp_path / "out" / "result.h5"
    if ranks and open_mpi() and output.exists():
        with h5py.File(output, "r") as f:
            assert f.attrs["chainexec_complete"]
    else:
        assert not output.exists()
    assert run_cli("run", config, "--quiet", ranks=ranks).returncode == 0


def _machine_text(**changes) -> str:
    """A valid machine file's JSON with ``changes`` (a value of ``...`` removes the field)."""
    import json

    from chainexec.planner.machine import Machine

    data = json.loads(Machine(statement_seconds=0).to_json()) | {"details": {"units": "as calibrate writes them"}}
    data.update(changes)
    return json.dumps({k: v for k, v in data.items() if v is not ...})


MACHINE_ERRORS = {
    "zero_rate": (_machine_text(flop_rate=0), ["'flop_rate'", "from 1 to 1e+18", "not 0"]),
    "negative_rate": (_machine_text(disk_read=-1.0e9), ["'disk_read'", "from 1 to 1e+18", "-1"]),
    "tiny_rate": (_machine_text(disk_read=5e-324), ["'disk_read'", "from 1 to 1e+18", "5e-324"]),
    "huge_rate": (_machine_text(global_fill=1e300), ["'global_fill'", "from 1 to 1e+18", "1e+300"]),
    "huge_statement_seconds": (_machine_text(statement_seconds=1e308), ["'statement_seconds'", "at most 10000"]),
    "huge_bytes": (_machine_text(aside_copy_bytes=10**30), ["'aside_copy_bytes'", "at most 2^63 - 1"]),
    "many_digits": ('{"aside_copy_bytes": ' + "9" * 5000 + "}", ["more digits than any field takes"]),
    "nan_rate": (_machine_text(disk_write=float("nan")), ["'disk_write'", "not NaN"]),
    "infinite_rate": (_machine_text(global_to_device=float("inf")), ["'global_to_device'", "not Infinity"]),
    "text_rate": (_machine_text(device_to_global="fast"), ["'device_to_global'", '"fast"']),
    "boolean_rate": (_machine_text(flop_rate=True), ["'flop_rate'", "not true"]),
    "zero_device_bandwidth": (_machine_text(device_bandwidth=0), ["'device_bandwidth'", "or null"]),
    "zero_orbit_bandwidth": (_machine_text(orbit_bandwidth=0), ["'orbit_bandwidth'", "or null"]),
    "negative_statement_seconds": (_machine_text(statement_seconds=-1e-4), ["'statement_seconds'", "0 or more"]),
    "negative_call_seconds": (_machine_text(transfer_call_seconds=-1e-5), ["'transfer_call_seconds'", "0 or more"]),
    "text_call_seconds": (_machine_text(disk_call_seconds="slow"), ["'disk_call_seconds'", '"slow"']),
    "fractional_bytes": (_machine_text(aside_copy_bytes=1.5), ["'aside_copy_bytes'", "whole number"]),
    "zero_cached_write": (_machine_text(disk_write_cached=0), ["'disk_write_cached'", "or null"]),
    "negative_write_cache": (_machine_text(write_cache_bytes=-1), ["'write_cache_bytes'", "0 or more"]),
    "zero_global_fill": (_machine_text(global_fill=0), ["'global_fill'", "or null"]),
    "async_as_number": (_machine_text(async_statements=1), ["'async_statements'", "true or false"]),
    "missing_rate": (_machine_text(flop_rate=...), ["missing field 'flop_rate'"]),
    "missing_rates": (_machine_text(disk_read=..., disk_write=...), ["missing fields 'disk_read', 'disk_write'"]),
    "unknown_field": (_machine_text(flop_rat=1e9), ["unknown field 'flop_rat'"]),
    "repeated_field": ('{"flop_rate": 1e9, "flop_rate": 2e9}', ["'flop_rate' is given twice"]),
    "list": ("[1e9, 1e9]", ["JSON object", "not an array"]),
    "number": ("1e9", ["JSON object", "not a number"]),
    "string": ('"fast"', ["JSON object", "not a string"]),
    "not_json": ('{"flop_rate": 1e9,\n "disk_read": }', ["machine.json:2:", "not JSON"]),
    "not_utf8": (b'{"source": "\xff"}', ["not UTF-8"]),
    "deep": ("[" * 100000 + "]" * 100000, ["nests its lists or objects deeper"]),
    "long": ("{" + " " * (1 << 20) + "}", ["longer than 1048576 bytes"]),
    "folder": (None, ["cannot read machine file", "directory"]),
    "missing_file": ("", ["cannot read machine file", "No such file"]),
}


@pytest.mark.parametrize("case", sorted(MACHINE_ERRORS))
def test_machine_file_errors(case, tmp_path):
    """Every bad machine file is one line naming the file (and the field), exit 2."""
    content, needles = MACHINE_ERRORS[case]
    machine = tmp_path / "machine.json"
    if content is None:
        machine.mkdir()
    elif isinstance(content, bytes):
        machine.write_bytes(content)
    elif content:
        machine.write_text(content)
    proc = run_cli("plan", write_config(tmp_path, fourindex_config()), "--machine", machine)
    assert_refused(proc, str(machine), *needles)


@pytest.mark.parametrize("optional", [{}, {"device_bandwidth": ..., "statement_seconds": ..., "source": ...,
                                          "aside_copy_bytes": ..., "async_statements": ..., "details": ...,
                                          "disk_write_cached": ..., "write_cache_bytes": ...}])
def test_machine_file_rates_are_used(optional, tmp_path):
    """A valid machine file (with or without its optional fields and calibrate's ``details``) is
    read: the predicted compute seconds are the plan's flops over the file's flop rate."""
    import json

    machine = tmp_path / "machine.json"
    machine.write_text(_machine_text(flop_rate=3.0e7, **optional))
    proc = run_cli("plan", write_config(tmp_path, fourindex_config()), "--machine", machine, "--json")
    assert proc.returncode == 0, proc.stderr
    predicted = json.loads(proc.stdout)["predicted"]
    assert predicted["seconds"]["compute"] == pytest.approx(predicted["flops"] / 3.0e7, rel=1e-12)


# An SCF of benzene in cc-pV5Z (876 orbitals) takes far longer than the CHEM_TIMEOUT seconds a
# failing `chainexec chem` may take here: an error found only after PySCF's SCF fails its test.
BEFORE_SCF = ("benzene", "--basis", "cc-pv5z")
CHEM_TIMEOUT = 60
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _template(tmp_path, edit) -> Path:
    """configs/ccsd_t.yaml changed by ``edit(text)`` (str -> str or bytes) as a file in
    ``tmp_path``; ``edit`` None: a file that does not exist, "folder": a folder."""
    path = tmp_path / "template.yaml"
    if edit == "folder":
        path.mkdir()
    elif edit is not None:
        text = edit((CONFIGS / "ccsd_t.yaml").read_text())
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _synthetic_bytes(o: int, v: int) -> int:
    """The (T) inputs' bytes, from the shapes of docs/chem.md's table."""
    return 8 * (o * v + o * o * v * v + o * v**3 + o**3 * v + o * o * v * v + o + v + v * o)


CHEM_ERRORS = {
    # --synthetic: sizes, seed, and inputs larger than any disk here
    "synthetic_zero_nocc": (("x", "--synthetic", 0, 7, 1), ["--synthetic 0 7 1", "at least 1"]),
    "synthetic_negative_nvir": (("x", "--synthetic", 3, -7, 1), ["--synthetic 3 -7 1", "at least 1"]),
    "synthetic_negative_seed": (("x", "--synthetic", 3, 7, -1), ["--synthetic 3 7 -1", "SEED 0 or more"]),
    "synthetic_seed_of_65_bits": (("x", "--synthetic", 3, 7, 1 << 64), [f"--synthetic 3 7 {1 << 64}", "below 2^64"]),
    "synthetic_absurd": (("x", "--synthetic", 1000, 1000, 1),
                         ["--synthetic 1000 1000 1", "the inputs would take",
                          f"{_synthetic_bytes(1000, 1000) / 1024**4:.2f} TiB", "free here"]),
    "synthetic_too_many_elements": (("x", "--synthetic", 100000, 100000, 1),
                                    ["--synthetic 100000 100000 1", "would hold 1e+20 elements, more than 2^63 - 1"]),
    "synthetic_with_frozen": (("x", "--synthetic", 3, 7, 1, "--frozen", 1), ["--frozen does not apply to --synthetic"]),
    "synthetic_with_scf_option": (("x", "--synthetic", 3, 7, 1, "--scf-max-cycle", 9),
                                  ["--scf-max-cycle does not apply to --synthetic"]),
    "synthetic_ao2mo": (("x", "--synthetic", 3, 7, 1, "--job", "ao2mo"), ["ao2mo job needs a molecule"]),
    # the molecule and basis
    "unknown_basis": (("h2o", "--basis", "no-such-basis"), ["'h2o'", "no basis 'no-such-basis'"]),
    "missing_coordinate": (("O 0 0; H 0 0.757 0.587; H 0 -0.757 0.587",), ["'O 0 0; H", "cannot read the atom string"]),
    "coordinate_not_a_number": (("O 0 0 x",), ["'O 0 0 x'", "cannot read the atom string"]),
    "unknown_element": (("Qq 0 0 0",), ["'Qq 0 0 0'", "cannot read the atom string"]),
    "no_atoms": (("",), ["''", "cannot read the atom string"]),
    "odd_electrons": (("O 0 0 0; H 0 0 0.96",), ["has 9 electrons", "closed-shell molecules"]),
    "no_virtual_orbital": (("He 0 0 0", "--basis", "sto-3g"), ["no virtual orbital", "1 occupied"]),
    # --charge: an ion's electrons, closed-shell and at least one pair
    "charge_odd_electrons": (("h2o", "--charge", 1), ["'h2o'", "has 9 electrons at charge +1",
                                                       "closed-shell molecules"]),
    "charge_no_electrons": (("H 0 0 0; H 0 0 0.74", "--charge", 2, "--basis", "sto-3g"),
                            ["has 0 electrons at charge +2", "need an occupied orbital"]),
    "charge_not_whole": (("h2o", "--charge", "0.5"), ["--charge", "invalid int value"]),
    "charge_past_the_electrons": (("H 0 0 0; H 0 0 0.74", "--charge", 3, "--basis", "sto-3g"),
                                  ["has -1 electrons at charge +3", "need an occupied orbital"]),
    "charge_past_the_valence_electrons": (("I 0 0 0; I 0 0 2.7", "--charge", 50, "--basis", "def2-svp"),
                                          ["has 0 electrons at charge +50 and beside the cores the potentials of I hold"]),
    "ecp_odd_valence_electrons": (("I 0 0 0", "--basis", "def2-svp"), ["has 25 electrons beside the cores"]),
    "ao2mo_more_occupied_than_orbitals": (("H 0 0 0; H 0 0 0.74", "--basis", "sto-3g", "--charge", -4, "--job",
                                           "ao2mo"), ["3 occupied orbitals, more than its 2 orbitals"]),
    "synthetic_with_charge": (("x", "--synthetic", 3, 7, 1, "--charge", -2), ["--charge does not apply to --synthetic"]),
    "atoms_in_one_place": (("H 0 0 0; H 0 0 0", "--basis", "sto-3g"), ["atoms 1 (H) and 2 (H) are 0 Angstrom apart"]),
    "atoms_too_close": (("O 0 0 0; H 0 0 0.05; H 0 0.757 0.587",), ["atoms 1 (O) and 2 (H) are 0.05 Angstrom"]),
    "coordinate_nan": (("H 0 0 0; H 0 0 nan", "--basis", "sto-3g"), ["coordinate is not a finite number"]),
    "coordinate_inf": (("H 0 0 0; H 0 inf 0", "--basis", "sto-3g"), ["coordinate is not a finite number"]),
    # --frozen against the occupied orbitals (benzene: 42 electrons, 21 occupied)
    "frozen_negative": ((*BEFORE_SCF, "--frozen", -1), ["--frozen must be 0 or more", "not -1"]),
    "frozen_all_occupied": ((*BEFORE_SCF, "--frozen", 21), ["--frozen 21", "fewer than the 21 occupied"]),
    "frozen_more_than_occupied": ((*BEFORE_SCF, "--frozen", 40), ["--frozen 40", "fewer than the 21 occupied"]),
    "frozen_ao2mo": (("h2o", "--job", "ao2mo", "--frozen", 1), ["--frozen does not apply to the ao2mo job"]),
    # convergence options
    "scf_conv_tol_zero": ((*BEFORE_SCF, "--scf-conv-tol", 0), ["--scf-conv-tol", "positive", "not 0.0"]),
    "scf_conv_tol_negative": ((*BEFORE_SCF, "--scf-conv-tol=-1e-9"), ["--scf-conv-tol", "not -1e-09"]),
    "ccsd_conv_tol_nan": ((*BEFORE_SCF, "--ccsd-conv-tol", "nan"), ["--ccsd-conv-tol", "not nan"]),
    "ccsd_conv_tol_inf": ((*BEFORE_SCF, "--ccsd-conv-tol", "inf"), ["--ccsd-conv-tol", "not inf"]),
    "scf_max_cycle_zero": ((*BEFORE_SCF, "--scf-max-cycle", 0), ["--scf-max-cycle must be at least 1"]),
    "ccsd_max_cycle_negative": ((*BEFORE_SCF, "--ccsd-max-cycle", -5), ["--ccsd-max-cycle must be at least 1"]),
    "ccsd_option_ao2mo": (("h2o", "--job", "ao2mo", "--ccsd-max-cycle", 90),
                          ["--ccsd-max-cycle does not apply to the ao2mo job"]),
    # convergence failures name the option that helps
    "scf_not_converged": (("h2o", "--scf-max-cycle", 1), ["'h2o' in cc-pvdz", "SCF did not converge", "--scf-max-cycle"]),
    "ccsd_not_converged": (("h2o", "--ccsd-max-cycle", 1), ["CCSD did not converge", "--ccsd-max-cycle"]),
    "ao2mo_scf_not_converged": (("h2o", "--job", "ao2mo", "--scf-max-cycle", 1), ["SCF did not converge", "--scf-max-cycle"]),
}

TEMPLATE_ERRORS = {
    "missing": (None, ["cannot read the config template", "No such file"]),
    "folder": ("folder", ["cannot read the config template", "Is a directory"]),
    "not_utf8": (lambda text: text.encode("utf-16"), ["not UTF-8"]),
    "malformed_yaml": (lambda text: text.replace("statements:", "statements: [oops"), ["malformed YAML"]),
    "not_a_config": (lambda text: text.replace("machine:", "machin:"), ["unknown key 'machin'"]),
    "other_ranges": (lambda text: (CONFIGS / "fourindex.yaml").read_text(), [":6:", "ranges (ao, mo)", "(occ, vir)"]),
    "unknown_dataset": (lambda text: text.replace("dataset: t1}", "dataset: t9}"), [":22:", "'t9'", "does not write"]),
    "wrong_shape": (lambda text: text.replace("t1: {indices: [i, a]", "t1: {indices: [a, i]")
                    .replace("t1[k,c]", "t1[c,k]").replace("t1[j,b]", "t1[b,j]").replace("t1[i,a]", "t1[a,i]"),
                    [":22:", "tensor 't1' has the shape (855, 21)", "'t1' as (21, 855)"]),
}


@pytest.mark.parametrize("case", sorted(CHEM_ERRORS) + [f"template_{case}" for case in sorted(TEMPLATE_ERRORS)])
def test_chem_errors(case, tmp_path):
    """Bad `chainexec chem` input is one line, exit 2, found before PySCF's SCF where it does not
    need one (BEFORE_SCF), and leaves no --out folder where there was none."""
    if case.startswith("template_"):
        edit, needles = TEMPLATE_ERRORS[case.removeprefix("template_")]
        template = _template(tmp_path, edit)
        args, needles = (*BEFORE_SCF, "--template", template), [str(template), *needles]
    else:
        args, needles = CHEM_ERRORS[case]
    if "--synthetic" not in args:
        pytest.importorskip("pyscf")
    out = tmp_path / "out"
    proc = run_cli("chem", *args, "--out", out, timeout=CHEM_TIMEOUT)
    assert_refused(proc, *needles)
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_chem_refuses_an_empty_out(tmp_path):
    """``--out ''`` is no folder (it would write into the current one): refused, nothing written."""
    proc = run_cli("chem", "x", "--synthetic", 3, 7, 1, "--out", "", cwd=tmp_path, timeout=CHEM_TIMEOUT)
    assert_refused(proc, "--out ''", "empty path")
    assert list(tmp_path.iterdir()) == []


def test_chem_config_describes_the_inputs_beside_it(tmp_path):
    """A failed `chainexec chem` leaves an earlier job in --out whole (its inputs and config, byte
    for byte); new inputs replace the configs that described the old ones."""
    pytest.importorskip("pyscf")
    out = tmp_path / "out"
    assert run_cli("chem", "x", "--synthetic", 2, 3, 1, "--out", out).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"inputs.h5", "ccsd_t.yaml"}
    assert_refused(run_cli("chem", "h2o", "--scf-max-cycle", 1, "--out", out), "--scf-max-cycle")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    proc = run_cli("chem", "h2o", "--job", "ao2mo", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["ao2mo.yaml", "inputs.h5"]
    assert proc.stdout.splitlines()[-1] == f"wrote {out / 'inputs.h5'} and {out / 'ao2mo.yaml'}"
    with h5py.File(out / "inputs.h5", "r") as f:
        assert set(f) == {"A", "C"}


def test_chem_refuses_a_folder_holding_a_result_of_the_inputs_it_would_replace(tmp_path):
    """A finished (T) run's energy.h5 in --out stays, and stays beside the inputs it was computed
    from: chem refuses to write new inputs there until the result is moved."""
    out = tmp_path / "out"
    assert run_cli("chem", "x", "--synthetic", 2, 3, 1, "--out", out).returncode == 0
    assert run_cli("run", out / "ccsd_t.yaml", "--quiet").returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert "energy.h5" in before
    assert_refused(run_cli("chem", "x", "--synthetic", 2, 3, 2, "--out", out), str(out), "holds energy.h5")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert run_cli("verify", out / "ccsd_t.yaml").returncode == 0


def test_chem_missing_keeps_inputs_made_for_the_job_and_refuses_others(tmp_path):
    """``chem --missing`` (a batch job submitted again) writes where --out holds neither file,
    keeps both byte for byte where they were made for the same job, and refuses, one line each,
    inputs made for another job, a config another template gives, or one file without the other."""
    out = tmp_path / "out"
    synthetic = ("chem", "x", "--synthetic", 2, 3, 1, "--out", out, "--missing")
    assert run_cli(*synthetic).stdout.splitlines()[-1].startswith("wrote ")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    kept = run_cli(*synthetic)
    assert kept.returncode == 0 and "nothing written" in kept.stdout, kept.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert_refused(run_cli("chem", "x", "--synthetic", 2, 3, 2, "--out", out, "--missing"), "seed 1 (here 2)")
    assert_refused(run_cli("chem", "x", "--synthetic", 3, 3, 1, "--out", out, "--missing"), "nocc 2 (here 3)")
    template = tmp_path / "mine.yaml"
    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "ccsd_t.yaml").read_text())
    cfg["machine"] = {"global_memory": "3MiB", "device_memory": "1MiB"}
    template.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert_refused(run_cli(*synthetic, "--template", template), "not the config the template gives")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (out / "ccsd_t.yaml").unlink()
    assert_refused(run_cli(*synthetic), "ccsd_t.yaml is missing beside the other")


@pytest.mark.parametrize("mine", ["ao2mo.yaml", "ccsd_t.yaml", "inputs.h5"])
def test_chem_leaves_a_users_files_in_out_as_they_are(mine, tmp_path):
    """A file of the name of a job's config or inputs in --out that chainexec chem did not write
    (a user's notes, their own inputs) is refused before anything is computed, byte for byte as
    it was (chem removed or replaced it, exit 0); one an earlier chem wrote is replaced."""
    out = tmp_path / "out"
    out.mkdir()
    if mine.endswith(".h5"):
        with h5py.File(out / mine, "w") as f:
            f["mine"] = np.arange(5.0)
    else:
        (out / mine).write_text("name: my own\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert_refused(run_cli("chem", "x", "--synthetic", 2, 3, 1, "--out", out), str(out / mine),
                   "not written by chainexec chem")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (out / mine).unlink()
    for seed in (1, 2):
        assert run_cli("chem", "x", "--synthetic", 2, 3, seed, "--out", out).returncode == 0
    with h5py.File(out / "inputs.h5", "r") as f:
        assert f.attrs["seed"] == 2


def test_chem_configs_leave_the_memory_limits_to_the_machine(tmp_path):
    """A config `chainexec chem` writes from its shipped template carries no memory limit (the
    template's are its H2O example's), so that `plan` takes both from the machine and says so; a
    user's own template keeps the limits it sets."""
    out = tmp_path / "out"
    assert run_cli("chem", "x", "--synthetic", 2, 3, 1, "--out", out).returncode == 0
    assert "machine" not in yaml.safe_load((out / "ccsd_t.yaml").read_text())
    proc = run_cli("plan", out / "ccsd_t.yaml")
    assert proc.returncode == 0, proc.stderr
    limits = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    for level in ("global_memory", "device_memory"):
        assert "  detected: " in limits[level], proc.stdout
    template = tmp_path / "mine.yaml"
    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "ccsd_t.yaml").read_text())
    cfg["machine"] = {"global_memory": "3MiB", "device_memory": "1MiB"}
    template.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert run_cli("chem", "x", "--synthetic", 2, 3, 1, "--out", out, "--template", template).returncode == 0
    assert yaml.safe_load((out / "ccsd_t.yaml").read_text())["machine"] == cfg["machine"]


@pytest.mark.parametrize("per_vir", [4, 8])
def test_chem_synthetic_larger_than_memory(tmp_path, per_vir):
    """Synthetic inputs that fit the disk but whose arrays made whole in memory (all but ``ovvv``,
    made in blocks: :data:`chainexec.chem.layout.SYNTHETIC_IN_MEMORY`), with one temporary the
    size of the largest, would not fit this machine's memory are refused before anything is made:
    cases with ``per_vir`` occupied orbitals per virtual one, whose o³v and o²v² arrays outweigh
    ovvv."""
    import os
    import shutil

    from chainexec.chem.layout import SYNTHETIC_IN_MEMORY
    from chainexec.spec import format_size

    def held(o, v):
        shapes = {"t1": o * v, "t2": o * o * v * v, "ovoo": o**3 * v, "ovov": o * o * v * v, "e_occ": o,
                  "e_vir": v, "f_vo": v * o}
        assert set(shapes) == set(SYNTHETIC_IN_MEMORY)
        return 8 * (sum(shapes.values()) + max(shapes.values()))

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    nvir = next(v for v in range(1, 1 << 20) if held(per_vir * v, v) > memory)
    nocc = per_vir * nvir
    size = _synthetic_bytes(nocc, nvir)
    if size > 0.9 * shutil.disk_usage(tmp_path).free:
        pytest.skip(f"{format_size(size)} of inputs need more disk than is free here")
    out = tmp_path / "out"
    proc = run_cli("chem", "x", "--synthetic", nocc, nvir, 1, "--out", out, timeout=CHEM_TIMEOUT)
    assert_refused(proc, f"--synthetic {nocc} {nvir} 1", "would hold",
                   f"{format_size(held(nocc, nvir))} in memory", f"this machine's {format_size(memory)}")
    assert not out.exists()


@pytest.mark.parametrize("args", [["bogus"], ["run"], ["chem", "h2o", "--synthetic", "a", "b", "c", "--out", "x"],
                                  ["run", "c.yaml", "--checkpoint-every", "soon"], ["plan", "c.yaml", "--ranks", "two"]])
def test_usage_errors_are_one_line(args, tmp_path):
    assert_refused(run_cli(*args, cwd=tmp_path), "chainexec", "-h")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("source", [{"file": "in.h5", "dataset": "A", "seed": 3}, {"random": 3}])
def test_a_dense_input_declared_symmetric_is_generated_so_and_checked(tmp_path, source):
    """A dense input declared symmetric gets seeded values with that symmetry (``generate``, or a
    ``random`` source), so the run's result, packed as s4, is verify's; a file whose values lack it
    is refused before the run (the run reads part of it and takes the rest as its images)."""
    cfg = fourindex_config(n=7, nmo=5)
    cfg["tensors"]["A"] |= {"symmetry": {"pairs": [["p", "q"], ["r", "s"]], "exchange": True}, "source": source}
    cfg["tensors"]["B"] = {"indices": list("abcd"), "symmetry": {"pairs": [["a", "b"], ["c", "d"]], "exchange": True},
                           "layout": "s4"}
    config = write_config(tmp_path, cfg)
    assert run_cli("generate", config).returncode == 0
    assert run_cli("run", config, "--quiet").returncode == 0
    check = run_cli("verify", config)
    assert check.returncode == 0 and "FAILED" not in check.stdout, check.stdout
    if "file" in source:
        with h5py.File(tmp_path / "in.h5", "a") as f:
            f["A"][...] = np.random.default_rng(1).standard_normal(f["A"].shape)
        assert_refused(run_cli("run", config, "--quiet"), str(tmp_path / "in.h5"), "tensor A is declared symmetric")
        # symmetric up to rounding far below the largest value (PySCF's MO integrals' 1e-13): accepted
        with h5py.File(tmp_path / "in.h5", "a") as f:
            values = 1e-3 * np.random.default_rng(2).standard_normal(f["A"].shape)
            for order in ((1, 0, 2, 3), (0, 1, 3, 2), (2, 3, 0, 1)):
                values = values + values.transpose(order)
            values[0, 0, 0, 0] = 5.0
            f["A"][...] = values + 1e-13 * np.random.default_rng(3).standard_normal(values.shape)
        assert run_cli("run", config, "--quiet").returncode == 0


def test_generate_refuses_one_dataset_seeded_with_and_without_a_symmetry(tmp_path):
    """Two tensors of one dataset and seed, one declared symmetric (its seeded values symmetric)
    and one not, would get other values: refused, as other seeds are."""
    cfg = fourindex_config(n=4)
    cfg["tensors"]["A"]["symmetry"] = {"pairs": [["p", "q"], ["r", "s"]], "exchange": True}
    cfg["tensors"]["A2"] = {k: v for k, v in cfg["tensors"]["A"].items() if k != "symmetry"}
    cfg["statements"] = ["D[p,q,r,s] = A[p,q,r,s] * A2[p,q,r,s]"]
    cfg["outputs"] = {"D": {"file": "out.h5", "dataset": "D"}}
    config = write_config(tmp_path, cfg)
    assert_refused(run_cli("generate", config), "both name dataset 'A'", "declared symmetry")


@pytest.mark.parametrize("args, line", [
    (("run", "--frob", "x.yaml"), "chainexec run: unrecognized arguments: --frob (see chainexec run -h)"),
    (("--frob", "run", "x.yaml"), "chainexec: unrecognized arguments: --frob (see chainexec -h)"),
    (("run",), "chainexec run: the following arguments are required: config (see chainexec run -h)"),
    (("frob",), "chainexec: argument command: invalid choice: 'frob'"),
])
def test_a_bad_command_line_is_named_once_with_its_help(args, line):
    """A command line argparse refuses: one line, status 2, the program named once (not
    ``chainexec: chainexec run:``) with the help of the subcommand the option belongs to."""
    proc = run_cli(*args)
    assert_refused(proc, line)
    assert proc.stderr.startswith(line.split(":")[0] + ":") and "chainexec: chainexec" not in proc.stderr
