"""Checkpoints: a (T) run or a four-index transform stopped at a checkpoint, or killed, goes on
from it and ends with the result of the independent NumPy reference (the four-index transform's
bit for bit that of an uninterrupted run), the predicted movement to the byte, and an empty
checkpoint folder; checkpoints of another plan, damaged ones and options that cannot work are
one-line errors (status 2)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from chainexec import safepaths
from chainexec.runtime import checkpoint
from chainexec.chem.triples import ccsd_t_energy
from chainexec.planner.plan import CATEGORIES, Loop
from tests.conftest import fourindex_config, kill_job, launch, ranks_of, read_report, run_cli, triples_config, write_config
from tests.runtime.test_reductions import CHAINS, _config, _reference

MACHINE = {"global_memory": "1GiB", "device_memory": "96KiB"}
"""Device tiles of one occupied index each: the (T) loop visits C(nocc + 2, 3) ordered tiles,
handed out in C(nocc + 1, 2) groups across which it keeps the tiles over j and k
(:mod:`chainexec.planner.keep`)."""


def _job(tmp_path, nocc=8, nvir=10, machine=MACHINE):
    return triples_config(tmp_path, machine["device_memory"], nocc, nvir, global_memory=machine["global_memory"])


def _done(folder) -> int:
    return json.loads((folder / "checkpoint.json").read_text())["done"]


def _check_energy(tmp_path):
    with h5py.File(tmp_path / "energy.h5", "r") as f:
        assert f.attrs["chainexec_complete"]
        got = float(f["E"][()])
    expected = ccsd_t_energy(tmp_path / "inputs.h5")
    assert abs(got - expected) <= 1e-12 * abs(expected)


def _check_report(path) -> dict:
    report = read_report(path)
    for key in ("bytes", "flops", "statements", "streamed"):
        assert report["measured"][key] == report["predicted"][key], key
    return report


STREAMED = {"global_memory": "1GiB", "device_memory": "300KiB"}
"""Whole inputs on the device and occupied tiles of 2: on one rank four inputs stream into the
loop (:func:`chainexec.planner.pipeline.streamed`), 20 ordered tiles."""


AHEAD = {"global_memory": "1GiB", "device_memory": "304KiB"}
"""At o=10: inputs fetched tile by tile, tiles of 2 (35 tuples in 15 groups), those over j and k
kept across each group (:mod:`chainexec.planner.keep`) and the first of the others one tile
ahead (:func:`chainexec.planner.pipeline.deepen`)."""


def _tiles_done(plan, done: int) -> int:
    """The tiles in the first ``done`` units the plan's loop hands out (its groups where it keeps
    tiles across them, :func:`chainexec.runtime.frame.groups`)."""
    from chainexec.runtime.frame import groups, tuples

    loop = next(node for node in plan.nests[0].body if isinstance(node, Loop))
    if not loop.kept:
        return done
    names = list(loop.tiles)
    spans = [[(s, min(s + t, plan.extents[i])) for s in range(0, plan.extents[i], t)] for i, t in loop.tiles.items()]
    combos, _ = tuples(names, spans, loop.symmetric)
    return sum(len(g) for g in groups(names, combos, loop.symmetric)[:done])


@pytest.mark.parametrize("ranks, machine, tiles, aside", [
    (1, MACHINE, 120, False), (3, MACHINE, 120, False), (1, STREAMED, 20, False), (2, STREAMED, 20, False),
    (2, AHEAD, 20, False), (2, AHEAD, 20, True)],
    ids=["1", "3", "1-streamed", "2-streamed", "2-ahead", "2-ahead-back"])
def test_stop_and_resume(tmp_path, ranks, machine, tiles, aside):
    """Two runs stop at their first checkpoint (status 3, no energy file), each going further;
    the third finishes from the second's checkpoint, moving the predicted bytes (streamed inputs
    come again in full, and are not also in the checkpoint's counts). ``aside``: a machine file
    lets the energy's tiles be copied back aside too (``Loop.back``)."""
    from chainexec import spec
    from chainexec.planner.build import make_plan
    from chainexec.planner.machine import Machine
    from chainexec.planner.pipeline import streamed
    from chainexec.planner.plan import fetched, returned

    config = _job(tmp_path, nocc=10 if machine is AHEAD else 8, machine=machine)
    model = Machine(aside_copy_bytes=0 if aside else Machine.aside_copy_bytes)
    (tmp_path / "machine.json").write_text(model.to_json())
    plan = make_plan(spec.load(config), model, ranks=ranks)
    assert (streamed(plan.nests[0].body, plan.contractions, plan.tensors) is not None) == (machine is STREAMED)
    assert bool([op for loop in plan.nests[0].body if isinstance(loop, Loop) for op in fetched(loop)]) == (machine is AHEAD)
    assert bool([op for loop in plan.nests[0].body if isinstance(loop, Loop) for op in returned(loop)]) == aside
    folder = tmp_path / "ck"
    done = [0]
    for _ in range(2):
        proc = run_cli("run", config, "--quiet", "--machine", tmp_path / "machine.json", "--checkpoint", folder,
                       "--checkpoint-every", 0, "--stop-after", 0, ranks=ranks)
        assert proc.returncode == 3, proc.stderr
        assert "stopped at a checkpoint after" in proc.stderr and "run the same command to resume" in proc.stderr
        assert not (tmp_path / "energy.h5").exists()
        done.append(_done(folder))
        assert done[-2] < done[-1] < tiles
    proc = run_cli("run", config, "--quiet", "--machine", tmp_path / "machine.json", "--checkpoint", folder,
                   "--report-json", tmp_path / "r.json", ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    assert _check_report(tmp_path / "r.json")["run"]["resumed_tiles"] == _tiles_done(plan, done[-1])
    _check_energy(tmp_path)
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("ranks", [1, 2])
def test_several_resumable_loops(tmp_path, ranks):
    """A chain whose plan has four resumable loops in two nests (a scalar computed, read back and
    reduced again), stopped at every checkpoint it can make: each run goes further (loops before
    the saved one rerun without checkpointing; the first nest is skipped once it is done), the
    folder holds just the manifest and one part per rank (at the second nest's start, the
    manifest alone), and the last run's outputs equal numpy.einsum's, its movement the
    prediction.

    Rank 0 fences a checkpoint between its own tiles only. With two ranks on a loaded machine it
    may find every tile of every loop handed out before it can (CI, 2026-11-27: rank 0 did 2 tiles,
    rank 1 27): a finished run without a checkpoint, correct but checking nothing here, so the
    sequence is run again from an empty folder, at most three times."""
    config = write_config(tmp_path, _config(CHAINS["a scalar read back in the chain"], "1GiB", "2KiB"))
    folder = tmp_path / "ck"
    for _ in range(3):
        seen = []
        for _ in range(40):
            proc = run_cli("run", config, "--quiet", "--checkpoint", folder, "--checkpoint-every", 0,
                           "--stop-after", 0, "--report-json", tmp_path / "r.json", ranks=ranks)
            if proc.returncode == 0:
                break
            assert proc.returncode == 3, proc.stderr
            manifest = json.loads((folder / "checkpoint.json").read_text())
            at_loop = manifest["position"] is not None  # else at a nest's start
            seen.append((manifest["nest"], manifest["position"] if at_loop else -1, manifest["done"]))
            assert seen == sorted(set(seen)), seen  # always further
            parts = [f"rank{r}-{manifest['number']}.npz" for r in range(ranks)] if at_loop else []
            assert sorted(p.name for p in folder.iterdir()) == sorted([safepaths.MARK, "checkpoint.json", checkpoint.INPUTS] + parts)
        if seen or ranks == 1:
            break
    assert proc.returncode == 0 and seen, seen
    if ranks == 1:  # one rank stops in every loop it can; with two, a fast rank may finish a loop first
        assert {n for n, p, _ in seen if p >= 0} == {0, 1} and (1, -1, 0) in seen, seen
    _check_report(tmp_path / "r.json")
    with h5py.File(tmp_path / "out.h5", "r") as f:
        for out, expected in _reference(CHAINS["a scalar read back in the chain"]).items():
            assert abs(float(f[out][()]) - expected) <= 1e-12 * abs(expected), out
    assert list(folder.iterdir()) == []


def test_resumed_at_the_last_edge_tile(tmp_path):
    """A run that resumes with only the smallest tile of the largest loop left still reports the
    predicted peaks: it keeps those the earlier run reached (on the H100 machine a 2-rank resumed
    run that happened to do only edge tiles measured a lower device peak, exit status 1)."""
    config = write_config(tmp_path, _config(CHAINS["a scalar read back in the chain"], "1GiB", "2KiB"))
    folder = tmp_path / "ck"
    for _ in range(20):
        proc = run_cli("run", config, "--quiet", "--checkpoint", folder, "--checkpoint-every", 0, "--stop-after", 0)
        assert proc.returncode == 3, proc.stderr
        manifest = json.loads((folder / "checkpoint.json").read_text())
        if manifest["done"] == manifest["tiles"] - 1:
            break
    assert (manifest["nest"], manifest["position"], manifest["tiles"]) == (0, 5, 16), manifest
    proc = run_cli("run", config, "--quiet", "--checkpoint", folder, "--report-json", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stderr
    report = _check_report(tmp_path / "r.json")
    assert report["measured"]["memory_peak"] == report["predicted"]["memory_peak"]


def test_killed_run_resumes(tmp_path):
    """SIGKILL to the whole job (as a node failure or scancel --signal=KILL) while it checkpoints
    after every tile; the next run resumes from the last committed checkpoint."""
    config = _job(tmp_path, nocc=10)  # 220 tiles
    folder = tmp_path / "ck"
    cmd = [*launch(2), sys.executable, "-m", "chainexec.cli", "run", str(config), "--quiet",
           "--checkpoint", str(folder), "--checkpoint-every", "0"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if _done(folder) >= 10:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    kill_job(proc.pid)
    proc.wait()
    assert proc.returncode != 0, "the run ended before it could be killed"
    killed_at = _done(folder)
    assert 10 <= killed_at < 220
    proc = run_cli("run", config, "--quiet", "--checkpoint", folder, "--report-json", tmp_path / "r.json", ranks=2)
    assert proc.returncode == 0, proc.stderr
    assert _check_report(tmp_path / "r.json")["run"]["resumed_tiles"] >= killed_at
    _check_energy(tmp_path)


def _transformed(folder) -> np.ndarray:
    """The complete output of a four-index run in ``folder``."""
    with h5py.File(folder / "out" / "result.h5", "r") as f:
        assert f.attrs["chainexec_complete"]
        return f["B"][()]


def _check_transformed(folder, expected: np.ndarray) -> None:
    """The output equals ``expected`` (an uninterrupted run's) bit for bit and numpy.einsum's
    within 1e-12 of its largest element."""
    got = _transformed(folder)
    assert np.array_equal(got, expected)
    with h5py.File(folder / "in.h5", "r") as f:
        a, c = f["A"][()], f["C"][()]
    reference = np.einsum("pa,qb,rc,sd,pqrs->abcd", c, c, c, c, a, optimize=True)
    assert np.max(np.abs(got - reference)) <= 1e-12 * np.max(np.abs(reference))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """An uninterrupted four-index run (:func:`fourindex_config` of ``sizes``, seeded inputs) on
    a number of ranks, run once per module, rank count and sizes: copies its config and inputs
    into a folder, returning the config there, the run's output and its predicted flops."""
    found = {}

    def copied(folder: Path, ranks: int, **sizes) -> tuple[Path, np.ndarray, int]:
        key = (ranks, *sorted(sizes.items()))
        if key not in found:
            source = tmp_path_factory.mktemp(f"uninterrupted{ranks}")
            config = write_config(source, fourindex_config(**sizes))
            assert run_cli("generate", config).returncode == 0
            proc = run_cli("run", config, "--quiet", "--report-json", source / "r.json", ranks=ranks)
            assert proc.returncode == 0, proc.stderr
            found[key] = (source, _transformed(source), read_report(source / "r.json")["predicted"]["flops"])
        source, output, flops = found[key]
        for name in ("chain.yaml", "in.h5"):
            shutil.copyfile(source / name, folder / name)
        return folder / "chain.yaml", output, flops

    return copied


def _progress(folder, flops: int) -> float:
    """The share of the plan's flops that the committed checkpoint in ``folder`` has finished
    (0 where it has none yet)."""
    try:
        manifest = json.loads((folder / "checkpoint.json").read_text())
    except (OSError, ValueError):
        return 0.0
    return (manifest["banked"][len(CATEGORIES)] + manifest["counts"][len(CATEGORIES)]) / flops


def _running_at(cmd: list[str], folder, flops: int, fraction: float, ranks: int, **popen):
    """``cmd`` (a launcher's run of ``ranks`` ranks checkpointing into ``folder``) started, and
    its ranks' process ids, once the checkpoint shows ``fraction`` of the plan's ``flops`` done
    while the run goes on. The ranks are found as they start, so that only a read of the
    manifest lies between the look that sees ``fraction`` and the signal the caller sends (on a
    fast host the rest of the run takes a tenth of a second, less than a look through /proc for
    the ranks). Where the run ends between two looks, it runs again, up to five times."""
    for _ in range(5):
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, **popen)
        deadline, victims = time.monotonic() + 120, []
        while time.monotonic() < deadline and proc.poll() is None:
            if len(victims) < ranks:
                victims = ranks_of(proc.pid)
            elif _progress(folder, flops) >= fraction:
                return proc, victims
            time.sleep(0.002)
        proc.communicate()
    pytest.fail(f"the run ended before it reached {fraction:.0%} of its flops with {ranks} ranks running, five times")


@pytest.mark.parametrize("fraction, ranks", [(0.3, 2), (0.6, 2), (0.6, 4), (0.9, 4)],
                         ids=["0.3-2", "0.6-2", "0.6-4", "0.9-4"])
def test_fourindex_killed_rank_resumes(tmp_path, ranks, fraction, uninterrupted):
    """A four-index transform (two nests of store loops, 20 and 8 iterations, device tiles
    inside; the first nest does 61 % of the flops, so 60 % falls about its end) checkpointing
    after every iteration: one rank gets SIGKILL once the manifest shows ``fraction`` of the flops
    done, the launcher ends the others, and the same command finishes from the last checkpoint:
    the output is the uninterrupted run's bit for bit, the resumed run's movement, flops,
    statements and peaks (its own plus the checkpoint's) the prediction. Each fraction on one
    rank count at least, the nest's end on both."""
    config, expected, flops = uninterrupted(tmp_path, ranks)
    folder = tmp_path / "ck"
    cmd = [*launch(ranks), sys.executable, "-m", "chainexec.cli", "run", str(config), "--quiet",
           "--checkpoint", str(folder), "--checkpoint-every", "0"]
    proc, victims = _running_at(cmd, folder, flops, fraction, ranks, stderr=subprocess.DEVNULL)
    os.kill(victims[-1], signal.SIGKILL)
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_job(proc.pid)
            proc.wait()
    assert proc.returncode != 0
    killed_at = _progress(folder, flops)
    assert fraction <= killed_at <= 1  # 1: killed after the checkpoint that follows the last nest
    proc = run_cli("run", config, "--quiet", "--checkpoint", folder, "--report-json", tmp_path / "r.json",
                   ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    report = _check_report(tmp_path / "r.json")
    assert report["measured"]["memory_peak"] == report["predicted"]["memory_peak"]
    assert report["run"]["resumed_tiles"] > 0
    _check_transformed(tmp_path, expected)
    assert list(folder.iterdir()) == []


def test_fourindex_stalled_rank_ends_the_run_and_it_resumes(tmp_path, uninterrupted):
    """The four-index transform of the killed-rank test on two ranks with ``--stall-timeout 5``:
    one rank stopped (SIGSTOP, as a rank that hangs in a device call or a read) once a third of
    the flops is checkpointed, the other finishes no statement while it waits for it, and within
    the timeout (and the watch's period) says so in one line and ends the run with status 4, the
    stopped rank ended by the launcher; the same command then finishes from the last checkpoint
    with the uninterrupted run's output bit for bit and the predicted movement."""
    config, expected, flops = uninterrupted(tmp_path, 2)
    folder = tmp_path / "ck"
    cmd = [*launch(2), sys.executable, "-m", "chainexec.cli", "run", str(config), "--quiet",
           "--checkpoint", str(folder), "--checkpoint-every", "0", "--stall-timeout", "5"]
    proc, victims = _running_at(cmd, folder, flops, 0.3, 2, stderr=subprocess.PIPE, text=True)
    os.kill(victims[-1], signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            kill_job(proc.pid)
            proc.wait()
    assert proc.returncode == 4, err
    assert time.monotonic() - stopped >= 5
    said = [line for line in err.splitlines() if "has finished no statement for" in line]
    assert len(said) == 1 and "--stall-timeout 5;" in said[0] and "status 4" in said[0], err
    assert not (tmp_path / "out" / "result.h5").exists()
    proc = run_cli("run", config, "--quiet", "--checkpoint", folder, "--report-json", tmp_path / "r.json", ranks=2)
    assert proc.returncode == 0, proc.stderr
    assert _check_report(tmp_path / "r.json")["run"]["resumed_tiles"] > 0
    _check_transformed(tmp_path, expected)


@pytest.mark.parametrize("ranks, sizes, stops", [
    (1, {"n": 8, "nmo": 5, "global_memory": "12KiB", "device_memory": "2KiB"}, 6),
    (2, {"global_memory": "80KiB", "device_memory": "8KiB"}, 3)], ids=["1-two-nests", "2-loop-before"])
def test_fourindex_stop_and_resume(tmp_path, ranks, sizes, stops, uninterrupted):
    """Runs of a four-index transform each stop at their first checkpoint (``--stop-after 0``),
    the next going on from it, until one completes: on one rank two nests of store loops (4 and 3
    iterations, two parallel loops in each of the first: a stop after every iteration but the
    last of each, and at the end of the first nest; a sealed shard file removed, damaged or cut
    short meanwhile is a one-line error naming it, and once put back resumes); on two ranks one nest whose store loop (4 iterations) follows a
    loop that fills a global intermediate, which every resumed run computes again. The output is
    an uninterrupted run's bit for bit, the movement and peaks the prediction."""
    config, expected, _ = uninterrupted(tmp_path, ranks, **sizes)
    folder = tmp_path / "ck"
    seen = []
    for _ in range(stops + 1):
        proc = run_cli("run", config, "--quiet", "--checkpoint", folder, "--stop-after", 0,
                       "--report-json", tmp_path / "r.json", ranks=ranks)
        if proc.returncode == 0:
            break
        assert proc.returncode == 3, proc.stderr
        assert not (tmp_path / "out" / "result.h5").exists()
        manifest = json.loads((folder / "checkpoint.json").read_text())
        seen.append((manifest["nest"], -1 if manifest["position"] is None else manifest["position"], manifest["done"]))
        assert seen == sorted(set(seen)), seen  # always further
        if ranks == 1 and len(seen) == 2:  # a sealed shard file gone: refused, naming it
            shard = next((tmp_path / "out").rglob("rank0-*.h5"))
            kept = shard.rename(shard.with_name("kept"))
            _one_line(run_cli("run", config, "--checkpoint", folder), str(shard), "missing")
            kept.rename(shard)
            good = shard.read_bytes()
            middle = len(good) // 2
            for damaged in (good[:middle] + bytes(b ^ 0x7F for b in good[middle:middle + 64]) + good[middle + 64:],
                            good[:1000]):  # bytes written over in the middle, of the same size; cut short
                shard.write_bytes(damaged)
                _one_line(run_cli("run", config, "--checkpoint", folder), str(shard), "has changed since")
            shard.write_bytes(good)  # put back: its stamp changed, not its content
    assert proc.returncode == 0 and len(seen) == stops, seen
    report = _check_report(tmp_path / "r.json")
    assert report["measured"]["memory_peak"] == report["predicted"]["memory_peak"]
    _check_transformed(tmp_path, expected)
    assert list(folder.iterdir()) == []


def test_striped_blocks_stop_and_resume(tmp_path, monkeypatch, uninterrupted):
    """The one-rank four-index transform of two nests of store loops, its blocks cut into three
    stripes (``PIECE_BYTES`` 64, three threads), stopped at every checkpoint and resumed in this
    process until it completes: the checkpoints name the sealed stripes' files
    (``rank0s<S>-<N>.h5``), a resumed run takes them back, and the output is an uninterrupted
    run's bit for bit."""
    from chainexec import api
    from chainexec.runtime import hostcopy

    config, expected, _ = uninterrupted(tmp_path, 1, n=8, nmo=5, global_memory="12KiB", device_memory="2KiB")
    monkeypatch.setattr(hostcopy, "PIECE_BYTES", 64)
    monkeypatch.setattr(hostcopy, "threads", lambda: 3)
    folder = tmp_path / "ck"
    named = set()
    for _ in range(20):
        try:
            api.run(config, checkpoint=str(folder), checkpoint_every=0, stop_after=0)  # the backend of `uninterrupted`
            break
        except checkpoint.Stopped:
            manifest = json.loads((folder / "checkpoint.json").read_text())
            named |= {b[0] for _, _, per_rank in manifest["open"] for blocks in per_rank for b in blocks}
    else:
        raise AssertionError("the run never completed")
    assert any(name.startswith("rank0s") for name in named), named
    _check_transformed(tmp_path, expected)


def _one_line(proc, *needles, launcher=False):
    """Status 2 and one line naming the problem; ``launcher``: under mpiexec, whose own report of
    a non-zero exit (Open MPI prints one) may follow chainexec's line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert (len(lines) == 1 or launcher) and lines[0].startswith("chainexec: "), proc.stderr
    assert "Traceback" not in proc.stderr
    assert all(n in lines[0] for n in needles), lines[0]


def test_errors(tmp_path):
    config = _job(tmp_path)
    folder = tmp_path / "ck"
    assert run_cli("run", config, "--quiet", "--checkpoint", folder, "--checkpoint-every", 0,
                   "--stop-after", 0).returncode == 3
    manifest = folder / "checkpoint.json"
    # the same job on more ranks, or with another machine, is another plan
    _one_line(run_cli("run", config, "--checkpoint", folder, ranks=2), str(manifest),
              "a checkpoint of a run on 1 rank; this one has 2: run it on 1 to go on", launcher=True)
    other = _job(tmp_path / "other", machine={"global_memory": "1GiB", "device_memory": "1MiB"})
    _one_line(run_cli("run", other, "--checkpoint", folder), str(manifest), "another plan")
    _one_line(run_cli("run", config, "--stop-after", 5), "--stop-after needs --checkpoint")
    # an interval without a checkpoint checkpoints nothing: a user who thinks it does loses the run
    for every in (600, "nan", -5):
        _one_line(run_cli("run", config, "--checkpoint-every", every), "--checkpoint-every needs --checkpoint")
    _one_line(run_cli("run", config, "--checkpoint", folder, "--balance", "static"), "--balance dynamic")
    _one_line(run_cli("run", config, "--checkpoint", folder, "--checkpoint-every", "nan"),
              "--checkpoint-every must be a finite number of seconds, not negative, not nan")
    _one_line(run_cli("run", config, "--checkpoint", folder, "--stop-after", "-5"),
              "--stop-after must be a finite number of seconds, not negative, not -5")
    data = json.loads(manifest.read_text())
    part = folder / f"rank0-{data['number']}.npz"
    good = part.read_bytes()
    part.write_bytes(good[: len(good) // 2])
    _one_line(run_cli("run", config, "--checkpoint", folder), str(part), "unreadable")
    part.write_bytes(good)
    for damage in ({"done": -1}, {"done": 120}, {"tiles": 7}, {"position": 0}, {"counts": [1, 2]},
                   {"counts": [2**63] * 8}, {"format": 99}, {"format": 3}, {"position": None},
                   {"stored": {"E": 1}}, {"ranks": 0}, {"open": [["E", 1, [[["../rank0-1.h5", "b0", []]]]]]},
                   {"files": []}, {"files": {"x.h5": {"stamp": [1], "sha256": "y"}}}, {"files": None}):
        manifest.write_text(json.dumps(data | damage))
        _one_line(run_cli("run", config, "--checkpoint", folder), str(manifest))
    manifest.write_text("{not json")
    _one_line(run_cli("run", config, "--checkpoint", folder), str(manifest))
    manifest.write_text(json.dumps(data))
    # Inputs written again with other values, of the same size and with the old times: partial
    # sums of the old ones must not be used.
    inputs = tmp_path / "inputs.h5"
    times = inputs.stat()
    with h5py.File(inputs, "a") as f:
        name = next(iter(f))
        f[name][(0,) * f[name].ndim] += 1.0
    os.utime(inputs, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert inputs.stat().st_size == times.st_size
    _one_line(run_cli("run", config, "--checkpoint", folder), "inputs.json", "inputs.h5 changed")
    assert not (tmp_path / "energy.h5").exists()


def test_inputs_out_of_the_page_cache_resume(tmp_path):
    """A run resumed after its inputs left the page cache (a reboot, other jobs) prices its loads
    again (:func:`chainexec.api._price_cached`), so its prediction differs from the stopped
    run's; it does the same work and resumes, and the energy equals an uninterrupted run's."""
    config = _job(tmp_path)
    folder = tmp_path / "ck"
    first = tmp_path / "first.json"
    assert run_cli("run", config, "--quiet", "--checkpoint", folder, "--checkpoint-every", 0,
                   "--stop-after", 0, "--report-json", first).returncode == 3
    inputs = tmp_path / "inputs.h5"
    fd = os.open(inputs, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped
    finally:
        os.close(fd)
    proc = run_cli("run", config, "--quiet", "--checkpoint", folder, "--report-json", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stderr
    report = read_report(tmp_path / "r.json")
    assert report["run"]["resumed_tiles"] > 0
    _check_energy(tmp_path)


def test_a_checkpoint_belongs_to_the_work_not_the_records(tmp_path):
    """The checkpoint's plan digest: the same for a plan priced again, with other records of
    where its limits and rates came from, other alternatives and other detected limits; another
    for another tile, another input file or another rank count."""
    import copy
    from dataclasses import replace

    from chainexec import spec
    from chainexec.planner.build import make_plan

    plan = make_plan(spec.load(_job(tmp_path)))
    digest = checkpoint.plan_digest(plan, 1)
    records = replace(plan, predicted={"total_seconds": 1.0}, alternatives=[], machine={"disk_read": {"from": "x"}},
                      memory_limit={"global": 1, "device": 2})
    assert checkpoint.plan_digest(records, 1) == digest
    assert checkpoint.plan_digest(plan, 2) != digest
    tiled = copy.deepcopy(plan)
    loop = next(node for nest in tiled.nests for node in nest.body if isinstance(node, Loop) and node.tiles)
    loop.tiles = {i: t + 1 for i, t in loop.tiles.items()}
    assert checkpoint.plan_digest(tiled, 1) != digest
    moved = copy.deepcopy(plan)
    name = next(n for n, t in moved.tensors.items() if t.from_file())
    moved.tensors[name].source = moved.tensors[name].source | {"file": str(tmp_path / "elsewhere.h5")}
    assert checkpoint.plan_digest(moved, 1) != digest


def test_inputs_touched_or_copied_resume(tmp_path):
    """Inputs whose bytes are unchanged — touched, or copied over themselves — resume: the
    checkpoint knows them by content, and the energy equals an uninterrupted run's."""
    config = _job(tmp_path)
    folder = tmp_path / "ck"
    assert run_cli("run", config, "--quiet", "--checkpoint", folder, "--checkpoint-every", 0,
                   "--stop-after", 0).returncode == 3
    inputs = tmp_path / "inputs.h5"
    copy = tmp_path / "copy.h5"
    copy.write_bytes(inputs.read_bytes())
    os.replace(copy, inputs)
    proc = run_cli("run", config, "--quiet", "--checkpoint", folder, "--report-json", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stderr
    assert read_report(tmp_path / "r.json")["run"]["resumed_tiles"] > 0
    _check_energy(tmp_path)


def test_plan_without_resumable_loop(tmp_path):
    """A scalar reduced from an intermediate in 4 KiB of global memory: the plan's one nest is a
    global loop whose tiles all add into the scalar, so nothing can be saved before its end. The
    run says so and completes."""
    chain = CHAINS["scalar of a two-term intermediate"]
    config = write_config(tmp_path, _config(chain, "4KiB", "1KiB"))
    proc = run_cli("run", config, "--quiet", "--checkpoint", tmp_path / "ck")
    assert proc.returncode == 0, proc.stderr
    assert "no resumable loop or nest end" in proc.stderr
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert abs(float(f["E"][()]) - _reference(chain)["E"]) <= 1e-12 * abs(_reference(chain)["E"])
    assert list((tmp_path / "ck").iterdir()) == []


QUEUED_STOP = r'''
import sys
from chainexec import api
from chainexec.runtime import executor
from chainexec.runtime.checkpoint import Stopped
from tests.runtime.queued import Queued

api.select = lambda name, comm: Queued()
executor.PENDING = 2
try:
    api.run(sys.argv[1], backend="numpy", checkpoint=sys.argv[2], checkpoint_every=0, stop_after=0)
except Stopped:
    sys.exit(3)
'''


SLOW_STOP = r'''
import json, sys, threading, time
from chainexec import api
from chainexec.runtime import globalarray, mapped, store
from chainexec.runtime.checkpoint import Stopped

events, lock = [], threading.Lock()
read, free = store.Store.read, globalarray.GlobalArray.free
populate, unmap = mapped.MappedArray.populate, mapped.MappedArray.free


def slow(job, name):
    def run(*args):
        with lock:
            events.append(("start", name, time.perf_counter()))
        time.sleep(0.05)
        job(*args)
        with lock:
            events.append(("end", name, time.perf_counter()))
    return run


def logged(job):
    def run(self):
        with lock:
            events.append(("free", "", time.perf_counter()))
        job(self)
    return run


store.Store.read = slow(read, "read")
mapped.MappedArray.populate = slow(populate, "populate")  # the load of a tile mapped from its file
globalarray.GlobalArray.free = logged(free)
mapped.MappedArray.free = logged(unmap)
try:
    api.run(sys.argv[1], backend="numpy", checkpoint=sys.argv[2], checkpoint_every=0, stop_after=0)
except Stopped:
    time.sleep(0.3)  # a read still running would log its end meanwhile
    print(json.dumps(events))
    sys.exit(3)
'''


def test_stop_waits_for_streamed_reads_before_freeing(tmp_path):
    """A run stopped at its first checkpoint while streamed inputs are still being loaded (each
    read or mapped tile's population slowed to 50 ms): the disk worker is stopped before the
    global arrays are freed, so no load starts or ends after the first free (a read into a freed
    MPI window)."""
    config = _job(tmp_path, machine=STREAMED)
    script = tmp_path / "slow_stop.py"
    script.write_text(SLOW_STOP)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(script), str(config), str(tmp_path / "ck")], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=300)
    assert proc.returncode == 3, proc.stderr
    events = json.loads(proc.stdout.splitlines()[-1])
    frees = [t for kind, _, t in events if kind == "free"]
    reads = [t for kind, _, t in events if kind != "free"]
    assert frees and reads
    assert max(reads) < min(frees)


def test_queued_accumulates_land_before_a_checkpoint(tmp_path):
    """With accumulates queued behind unfinished statements (a backend that behaves as CuPy's),
    two runs stop at checkpoints and a plain one finishes from the second: the energy is the
    reference's, so every tile before each checkpoint had landed in what it saved."""
    config = _job(tmp_path)
    folder = tmp_path / "ck"
    script = tmp_path / "queued_stop.py"
    script.write_text(QUEUED_STOP)
    repo = Path(__file__).resolve().parents[2]
    done = [0]
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script), str(config), str(folder)], capture_output=True, text=True,
                              cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=300)
        assert proc.returncode == 3, proc.stderr
        done.append(_done(folder))
        assert done[-2] < done[-1] < 120
    proc = run_cli("run", config, "--quiet", "--checkpoint", folder)
    assert proc.returncode == 0, proc.stderr
    _check_energy(tmp_path)


def test_a_checkpoint_records_every_input_file(tmp_path):
    """Inputs in two files: a new checkpoint records both (stamp and digest), the run stopped at
    its first checkpoint resumes and finishes, and its output equals the einsum of the inputs."""
    config = fourindex_config()
    config["tensors"]["C"]["source"]["file"] = "c.h5"
    path = write_config(tmp_path, config)
    assert run_cli("generate", path).returncode == 0
    stop = ("--checkpoint", tmp_path / "ck", "--checkpoint-every", 0)
    proc = run_cli("run", path, *stop, "--stop-after", 0)
    assert proc.returncode == 3, proc.stderr
    recorded = json.loads((tmp_path / "ck" / checkpoint.INPUTS).read_text())
    assert sorted(Path(f).name for f in recorded) == ["c.h5", "in.h5"]
    assert all({"stamp", "sha256"} <= set(r) for r in recorded.values())
    proc = run_cli("run", path, *stop)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "in.h5") as fa, h5py.File(tmp_path / "c.h5") as fc, \
            h5py.File(tmp_path / "out" / "result.h5") as fo:
        C = fc["C"][()]
        ref = np.einsum("pa,qb,rc,sd,pqrs->abcd", C, C, C, C, fa["A"][()])
        assert np.linalg.norm(fo["B"][()] - ref) <= 1e-12 * np.linalg.norm(ref)


def test_a_shard_gone_from_a_closed_version_is_found_before_the_resumed_run(tmp_path):
    """A scratch file system that purges files one by one removes a shard of an intermediate the
    first nest closed (its VDS stays): the resumed run says which file is missing in one line
    before it runs (the read of the version ended in a traceback mid-run); a shard cut short or a
    VDS written over, the same; and with the files back it finishes with the einsum of the inputs."""
    path = write_config(tmp_path, fourindex_config(global_memory="48KiB"))
    assert run_cli("generate", path).returncode == 0
    stop = ("--checkpoint", tmp_path / "ck", "--checkpoint-every", 0)
    scratch = tmp_path / "out" / ".fourindex.scratch"
    for _ in range(12):  # stopped at each checkpoint until the first nest has closed a version
        assert run_cli("run", path, *stop, "--stop-after", 0).returncode == 3
        closed = sorted(scratch.glob("*.v*.h5"))
        if closed:
            break
    shard = sorted(closed[0].with_suffix("").iterdir())[0]
    kept = shard.read_bytes()
    shard.unlink()
    _one_line(run_cli("run", path, *stop), str(shard), "is missing")
    # damaged rather than gone: the shard cut short, the VDS written over (tracebacks, status 1)
    shard.write_bytes(kept[:-100])
    _one_line(run_cli("run", path, *stop), str(shard), "has changed since")
    shard.write_bytes(kept)
    vds = closed[0].read_bytes()
    closed[0].write_text("x\n")
    _one_line(run_cli("run", path, *stop), str(closed[0]), "stored version this checkpoint names cannot be read")
    for data in ("dataset", None, "group"):  # another HDF5 file in its place
        with h5py.File(closed[0], "w") as f:
            if data == "group":
                f.create_group("data")
            elif data == "dataset":
                f["data"] = np.zeros(3)
        _one_line(run_cli("run", path, *stop), str(closed[0]), "not the virtual dataset chainexec writes")
    closed[0].write_bytes(vds)
    proc = run_cli("run", path, *stop)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "in.h5") as fi, h5py.File(tmp_path / "out" / "result.h5") as fo:
        C = fi["C"][()]
        ref = np.einsum("pa,qb,rc,sd,pqrs->abcd", C, C, C, C, fi["A"][()])
        assert np.linalg.norm(fo["B"][()] - ref) <= 1e-12 * np.linalg.norm(ref)


def test_a_checkpoint_knows_the_file_an_external_link_reads(tmp_path):
    """An input behind an external link: the checkpoint records the linked file too, a resumed
    run whose linked values changed (the linking file unchanged) is refused, and one whose
    values are as they were finishes with the einsum of the inputs."""
    path = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", path).returncode == 0
    with h5py.File(tmp_path / "in.h5", "a") as f:
        a = f["A"][()]
        del f["A"]
        f["A"] = h5py.ExternalLink("a_store.h5", "A")
    with h5py.File(tmp_path / "a_store.h5", "w") as f:
        f["A"] = a
    stop = ("--checkpoint", tmp_path / "ck", "--checkpoint-every", 0)
    assert run_cli("run", path, *stop, "--stop-after", 0).returncode == 3
    recorded = json.loads((tmp_path / "ck" / checkpoint.INPUTS).read_text())
    assert sorted(Path(f).name for f in recorded) == ["a_store.h5", "in.h5"]
    with h5py.File(tmp_path / "a_store.h5", "a") as f:
        f["A"][0, 0, 0, 0] += 1.0
    _one_line(run_cli("run", path, *stop), "inputs.json", "a_store.h5 changed")
    with h5py.File(tmp_path / "a_store.h5", "a") as f:
        f["A"][0, 0, 0, 0] = a[0, 0, 0, 0]
    proc = run_cli("run", path, *stop)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "in.h5") as fi, h5py.File(tmp_path / "out" / "result.h5") as fo:
        C = fi["C"][()]
        ref = np.einsum("pa,qb,rc,sd,pqrs->abcd", C, C, C, C, a)
        assert np.linalg.norm(fo["B"][()] - ref) <= 1e-12 * np.linalg.norm(ref)


def test_clearing_removes_what_a_crash_left_and_nothing_else(tmp_path):
    """A job killed while it wrote a rank's part or the manifest leaves their temporary files;
    the clearing after the outputs are complete removes those with the parts, and keeps a user's
    files, however alike their names."""
    ck = checkpoint.Checkpoint(tmp_path, "digest", every=0.0)
    ck.write_rank(0, 1, [np.arange(3.0)])
    ck.commit({"number": 1})
    crashed = [".rank1-2.npz.0123abcd.tmp", f".{checkpoint.MANIFEST}.89abcdef.tmp"]
    kept = ["rank1-2.npz.bak", ".notes.0123abcd.tmp", "rank0-1.tmp", "mine.json"]
    for name in crashed + kept + [safepaths.MARK]:
        (tmp_path / name).write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(crashed + kept + [safepaths.MARK, "rank0-1.npz",
                                                                                    checkpoint.MANIFEST])
    ck.clear()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


ACCUMULATED = {"name": "accumulated", "indices": {"i": 40, "j": 40, "k": 5},
               "tensors": {t: {"indices": ix, "source": {"file": "in.h5", "dataset": t, "seed": seed}}
                           for t, ix, seed in (("A", ["i", "k"], 1), ("B", ["k", "j"], 2))},
               "statements": ["X[i,j] = A[i,k] * B[k,j]"] + [f"X[i,j] += {r} * A[i,k] * B[k,j]" for r in (2, 3, 5, 7)]
                             + ["Y[j,i] = X[i,j] * X[i,j]"],
               "outputs": {"Y": {"file": "out.h5", "dataset": "Y"}},
               "machine": {"global_memory": "8KiB", "device_memory": "4KiB"}}
"""X accumulated over five statements, each its own nest where unfused (``--schedule unfused``):
five versions of X stored one after the other."""


def _check_accumulated(tmp_path) -> None:
    with h5py.File(tmp_path / "in.h5", "r") as f:
        x = 18 * f["A"][()] @ f["B"][()]
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert np.abs(f["Y"][()] - (x * x).T).max() <= 1e-12 * np.abs(x * x).max()


def test_versions_closed_between_checkpoints_are_not_kept(tmp_path, monkeypatch):
    """A run that checkpoints keeps a superseded version of a stored intermediate only where the
    last committed checkpoint names it. :data:`ACCUMULATED` with no checkpoint due for the whole
    run: after every close each tensor has its current version on disk and no other (every
    version was kept until the next checkpoint: a (T) run kept W.v1 … W.v12 and filled a disk
    that check_space had passed); Y equals NumPy's."""
    from chainexec import api
    from chainexec.runtime import store

    config = write_config(tmp_path, ACCUMULATED)
    assert run_cli("generate", config).returncode == 0
    on_disk = []
    close = store.Store.close_version

    def counted(self, tensor, version, durable=False):
        close(self, tensor, version, durable)
        folder = self._version_base(self.plan.tensors[tensor], version).parent
        on_disk.append((tensor, version, sorted(p.name for p in folder.glob(f"{tensor}.v*.h5"))))

    monkeypatch.setattr(store.Store, "close_version", counted)
    api.run(config, backend="numpy", schedule="unfused", checkpoint=tmp_path / "ck", checkpoint_every=1e6,
            plan_cache=False)
    assert [v for t, v, _ in on_disk if t == "X"] == [1, 2, 3, 4, 5]
    assert all(files == [f"{tensor}.v{version}.h5"] for tensor, version, files in on_disk), on_disk
    _check_accumulated(tmp_path)


CRASH_AFTER_A_CHECKPOINT_IN_A_VERSION = """
import os
from chainexec import api
from chainexec.runtime import checkpoint, store

closed, asked = [], [0]
close = store.Store.close_version


def close_version(self, tensor, version, durable=False):
    close(self, tensor, version, durable)
    closed.append((tensor, version))
    if (tensor, version) == ("X", 3):
        os._exit(9)  # the node fails


def due(self):
    asked[0] += closed == [("X", 1)]
    return closed == [("X", 1)] and asked[0] == 3  # one checkpoint, while X.v2 is being written


store.Store.close_version = close_version
checkpoint.Checkpoint.due = due
api.run("chain.yaml", backend="numpy", schedule="unfused", checkpoint="ck", checkpoint_every=1e6, plan_cache=False)
"""


def test_a_version_a_checkpoint_records_as_being_written_is_kept_until_the_next(tmp_path):
    """The one checkpoint is committed while X.v2 is being written (its sealed blocks recorded);
    X.v2 and X.v3 close after it and the process dies: the resumed run reads X.v2's blocks the
    checkpoint names, which must still be there (they were dropped as X.v3 closed, and the
    resume was refused as missing a shard); it finishes with NumPy's Y."""
    config = write_config(tmp_path, ACCUMULATED)
    assert run_cli("generate", config).returncode == 0
    (tmp_path / "crash.py").write_text(CRASH_AFTER_A_CHECKPOINT_IN_A_VERSION)
    crashed = subprocess.run([sys.executable, "crash.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert crashed.returncode == 9, crashed.stderr
    assert json.loads((tmp_path / "ck" / "checkpoint.json").read_text())["open"][0][:2] == ["X", 2]
    resumed = run_cli("run", config, "--quiet", "--schedule", "unfused", "--checkpoint", tmp_path / "ck")
    assert resumed.returncode == 0, resumed.stderr
    _check_accumulated(tmp_path)


def _detected_fourindex(tmp_path) -> Path:
    """configs/fourindex.yaml (64 AO, 60 MO) without its memory limits, its files here: limits
    detected from the host memory, whose tiles change with a few MiB of it."""
    import yaml

    cfg = yaml.safe_load((Path(__file__).parents[2] / "configs" / "fourindex.yaml").read_text())
    del cfg["machine"]
    for t in cfg["tensors"].values():
        t["source"]["file"] = "input.h5"
    cfg["outputs"]["B"]["file"] = "output.h5"
    config = write_config(tmp_path, cfg)
    assert run_cli("generate", config).returncode == 0
    return config


def test_a_run_resumed_where_more_memory_is_detected_plans_as_its_checkpoint(tmp_path):
    """Stopped where 1090 MiB of host memory were available and resumed where 1200 MiB are (a job
    submitted again lands on another node) with another machine file: the run plans with the
    limits and rates its checkpoint's plan was made with, so it does the same work and goes on
    (it planned larger tiles and refused the checkpoint as another plan's); the report says where
    they came from, and the output equals NumPy's."""
    from chainexec.planner.machine import Machine

    config = _detected_fourindex(tmp_path)
    folder = tmp_path / "ck"
    stop = run_cli("run", config, "--quiet", "--checkpoint", folder, "--stop-after", 0,
                   env={"CHAINEXEC_HOST_MEMORY": "1090MiB"})
    assert stop.returncode == 3, stop.stderr
    (tmp_path / "fast.json").write_text(Machine(flop_rate=7e13, statement_seconds=0).to_json())
    report = tmp_path / "r.json"
    resumed = run_cli("run", config, "--quiet", "--checkpoint", folder, "--machine", tmp_path / "fast.json",
                      "--report-json", report, env={"CHAINEXEC_HOST_MEMORY": "1200MiB"})
    assert resumed.returncode == 0, resumed.stderr
    run = _check_report(report)["run"]
    assert run["resumed_tiles"] > 0
    manifest = str(folder / "checkpoint.json")
    assert {name: (r["from"], r["detail"]) for name, r in run["machine"].items()} == dict.fromkeys(
        run["machine"], ("checkpoint", manifest))
    with h5py.File(tmp_path / "input.h5", "r") as f:
        a, c = f["A"][()], f["C"][()]
    expected = np.einsum("pa,qb,rc,sd,pqrs->abcd", c, c, c, c, a, optimize=True)
    with h5py.File(tmp_path / "output.h5", "r") as f:
        assert np.abs(f["B"][()] - expected).max() <= 1e-12 * np.abs(expected).max()


def test_a_run_resumed_where_its_checkpoints_plan_does_not_fit_is_refused(tmp_path):
    """Stopped where 1100 MiB were available, resumed where 1090 MiB are: the checkpoint's plan
    needs more global memory per rank than this node has; one line names both, nothing runs."""
    config = _detected_fourindex(tmp_path)
    folder = tmp_path / "ck"
    assert run_cli("run", config, "--quiet", "--checkpoint", folder, "--stop-after", 0,
                   env={"CHAINEXEC_HOST_MEMORY": "1100MiB"}).returncode == 3
    before = (folder / "checkpoint.json").read_bytes()
    proc = run_cli("run", config, "--quiet", "--checkpoint", folder, env={"CHAINEXEC_HOST_MEMORY": "1090MiB"})
    _one_line(proc, "ck/checkpoint.json: the checkpoint's plan needs", "of global memory per rank (planned with 38.00 MiB)",
              "this node has 32.00 MiB", "remove the checkpoint folder")
    assert (folder / "checkpoint.json").read_bytes() == before and not (tmp_path / "output.h5").exists()
