"""Shared helpers: run the real CLI in a process of its own (forked from a warm interpreter,
:mod:`tests.forkcli`; under mpiexec for several ranks), write configs into a temporary folder."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests import forkcli

BIN = Path(sys.executable).parent
# The 48 TCCG contractions, kept in the repository so that CI's clean clone checks them too.
TCCG = Path(__file__).resolve().parents[1] / "benchmarks" / "tccg.json"


@pytest.fixture(autouse=True)
def own_plan_cache(tmp_path_factory, monkeypatch):
    """Each test its own plan cache (``CHAINEXEC_PLAN_CACHE``, which the CLI's subprocesses
    inherit): a plan kept by one test is never read by another (some change the planner's
    behaviour), and none lands in the user's home."""
    monkeypatch.setenv("CHAINEXEC_PLAN_CACHE", str(tmp_path_factory.mktemp("plans")))


@pytest.fixture(autouse=True)
def default_rates(tmp_path_factory, monkeypatch):
    """Plans with the built-in rates (``CHAINEXEC_MACHINE=defaults``), as the tests' expectations
    of tile choices assume, and no calibration made on first use; a test of the calibration
    cache removes the variable. Calibrations go to a folder of the test's own
    (``CHAINEXEC_CACHE``), never the user's home, and a quick one is the tiny one
    (``CHAINEXEC_QUICK_CALIBRATION=tiny``)."""
    monkeypatch.setenv("CHAINEXEC_MACHINE", "defaults")
    monkeypatch.setenv("CHAINEXEC_CACHE", str(tmp_path_factory.mktemp("machines")))
    monkeypatch.setenv("CHAINEXEC_QUICK_CALIBRATION", "tiny")


def mpiexec() -> str | None:
    local = BIN / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


@functools.cache
def _unbound(launcher: str) -> tuple[str, ...]:
    from chainexec.calibrate import launch_options

    return tuple(launch_options(launcher, dict(os.environ)))


def launch(ranks: int) -> list[str]:
    """``mpiexec -n ranks`` as the project's scripts launch a run (Open MPI's ``--bind-to none``,
    without which it binds a rank of two or fewer to one core and the run says so on stderr);
    skips the test where there is no mpiexec."""
    launcher = mpiexec()
    if launcher is None:
        pytest.skip("no mpiexec")
    return [launcher, *_unbound(launcher), "-n", str(ranks)]


def ranks_of(launcher: int) -> list[int]:
    """The process ids of the ranks (``python -m chainexec.cli``) that a launcher started, at any
    depth below it (MPICH's hydra proxy starts each rank in a session of its own; Open MPI's
    launcher starts them itself)."""
    return [pid for pid, args in _below(launcher) if args[1:3] == [b"-m", b"chainexec.cli"]]


def _below(launcher: int) -> list[tuple[int, list[bytes]]]:
    """The processes at any depth below ``launcher``: (process id, command line's arguments)."""
    parents, found = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
        found[int(entry.name)] = args

    def below(pid: int) -> bool:
        for _ in range(16):
            pid = parents.get(pid, 0)
            if pid == launcher:
                return True
            if pid <= 1:
                return False
        return False

    return sorted((pid, args) for pid, args in found.items() if below(pid))


def kill_job(launcher: int) -> None:
    """SIGKILL to a launched job as a node failure or ``scancel --signal=KILL`` ends it: the
    launcher's process group (it was started in a session of its own) and every process below it,
    which Open MPI's launcher starts each in a process group of its own (a signal to the
    launcher's group alone leaves them running to the end of the run)."""
    processes = _below(launcher)
    os.killpg(launcher, signal.SIGKILL)
    for pid, _ in processes:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def open_mpi() -> bool:
    """Whether the tests' ``mpiexec`` is Open MPI's (the one launcher :func:`_unbound` gives
    options to)."""
    launcher = mpiexec()
    return launcher is not None and bool(_unbound(launcher))


ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""The environment of a ``chainexec chem`` that solves a molecule with PySCF (:func:`run_cli`'s
``env``): on one OpenMP thread, as the tests' own PySCF solves run (``lib.with_omp_threads(1)``),
since pytest's workers share the cores and OpenMP threads that outnumber them wait on each
other."""


def run_cli(*args, ranks: int | None = None, timeout: float = 300, cwd=None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``chainexec ARGS`` as a user runs it; ``ranks`` launches it under ``mpiexec -n ranks``;
    ``env`` adds to the environment. A call of one process without ``env`` runs in a child
    forked from a warm interpreter (:mod:`tests.forkcli`): the same process, without the
    interpreter's start and imports."""
    cmd = [sys.executable, "-m", "chainexec.cli", *map(str, args)]
    if ranks is not None:
        cmd = [*launch(ranks), *cmd]
    warm = forkcli.zygote() if ranks is None and env is None else None
    # Open MPI (the GPU machines' system MPI) refuses to start as root without these; MPICH ignores them.
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               **(env or {}))
    if warm is not None:
        return warm.run(cmd, cmd[3:], env, cwd, timeout)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def assert_refused(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """A CLI call refused as bad input: exit status 2, one line on stderr holding every needle,
    no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    # Open MPI's mpiexec adds its own note on a rank's exit status, below a line of dashes alone
    lines = proc.stderr.strip().splitlines()
    lines = lines[:next((k for k, line in enumerate(lines) if len(line) >= 40 and set(line) == {"-"}), len(lines))]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def write_config(folder: Path, config: dict, name: str = "chain.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def fourindex_config(n: int = 10, nmo: int = 8, global_memory="24KiB", device_memory="3KiB", seed=11) -> dict:
    """A small four-index transform with uneven AO/MO extents and HDF5 inputs."""
    return {
        "name": "fourindex",
        "indices": {**{i: n for i in "pqrs"}, **{i: nmo for i in "abcd"}},
        "tensors": {
            "A": {"indices": list("pqrs"), "source": {"file": "in.h5", "dataset": "A", "seed": seed}},
            "C": {"indices": ["p", "a"], "source": {"file": "in.h5", "dataset": "C", "seed": seed + 1}},
        },
        "statements": ["B[a,b,c,d] = C[p,a] * C[q,b] * C[r,c] * C[s,d] * A[p,q,r,s]"],
        "outputs": {"B": {"file": "out/result.h5", "dataset": "B"}},
        "machine": {"global_memory": global_memory, "device_memory": device_memory},
    }


def store_chunked(path: Path) -> None:
    """Store every dataset of the HDF5 file ``path`` again with the same values, chunked one row
    per chunk: its bytes no longer lie in the file as the array, so inputs are read through HDF5,
    not mapped (:mod:`chainexec.runtime.mapped`)."""
    import h5py

    with h5py.File(path, "a") as f:
        for name in list(f):
            values = f[name][()]
            del f[name]
            f.create_dataset(name, data=values, chunks=(1,) + values.shape[1:])


def triples_config(folder: Path, device_memory: str, nocc: int = 8, nvir: int = 10, seed: int = 3,
                   global_memory: str = "1GiB") -> Path:
    """Seeded synthetic (T) inputs in ``folder`` and their config, with ``global_memory`` and
    ``device_memory`` set: the files ``chainexec chem x --synthetic NOCC NVIR SEED --out FOLDER``
    writes, made by the function it calls in this process (the tests of the command run it)."""
    from chainexec.chem import job

    config = Path(job.prepare("x", folder, template=job.TEMPLATES["ccsd_t"], synthetic=(nocc, nvir, seed))["config"])
    cfg = yaml.safe_load(config.read_text())
    cfg["machine"] = {"global_memory": global_memory, "device_memory": device_memory}
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return config


def read_report(path: Path) -> dict:
    return json.loads(path.read_text())


def require_gpu():
    """CuPy, for GPU test modules; skips the whole module cleanly without CuPy or a CUDA device."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device", allow_module_level=True)
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device", allow_module_level=True)
    return cupy


def nvcc_reports(tmp_path: Path, sources: list[str]) -> list[str]:
    """ptxas's report (``-Xptxas -v``) of each CUDA source compiled for sm_90, as many compilers
    at once as there are CPUs (nvcc uses one: the compile tests took 100 s of CI one at a time);
    fails the test where one does not compile."""
    def one(k: int) -> subprocess.CompletedProcess:
        cu = tmp_path / f"nvcc{k}.cu"
        cu.write_text(sources[k])
        return subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(cu.with_suffix(".cubin")),
                               str(cu)], capture_output=True, text=True)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        results = list(pool.map(one, range(len(sources))))
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    assert all((tmp_path / f"nvcc{k}.cubin").stat().st_size > 0 for k in range(len(sources)))
    return [r.stdout + r.stderr for r in results]


def gett_spills(tmp_path: Path, cfgs: list) -> list[int]:
    """Bytes of spill stores ptxas reports for each GETT-family configuration's kernel
    (:func:`chainexec.kernels.gett.source`), in the order of ``cfgs`` (matched by kernel name:
    ptxas reports the kernels in an order of its own), compiled for sm_90 in two sources; fails
    the test where a kernel is missing from the report."""
    import re

    from chainexec.kernels import gett

    log = "".join(nvcc_reports(tmp_path, ["\n".join(gett.source(c) for c in cfgs[part::2]) for part in range(2)]))
    found = dict(re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores", log, re.S))
    names = [c.name() for c in cfgs]
    assert len(re.findall(r"Compiling entry function", log)) == len(cfgs) and set(found) == set(names)
    return [int(found[n]) for n in names]


@contextlib.contextmanager
def held_by_another(folder: Path, made_as: str = "test"):
    """``folder`` marked as made as ``made_as`` (where it is not yet) and locked by another
    process while the block runs (:func:`chainexec.safepaths.lock_owned`, as a running run holds
    its folders); yields its pid."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from chainexec import safepaths; "
         "f = Path(sys.argv[1]); safepaths.make_owned(f, sys.argv[2]); safepaths.lock_owned(f, 'test'); "
         "print('held', flush=True); sys.stdin.read()", str(folder), made_as],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.communicate("")


HDF5_LOCKING = {"HDF5_USE_FILE_LOCKING": "TRUE"}
"""HDF5's file locking on, as it is by default, whatever the environment the tests run in says:
the tests of files held by another program need it."""


@contextlib.contextmanager
def h5_held_for_writing(path: Path):
    """The HDF5 file at ``path`` open for writing in another process while the block runs (as a
    writer that has not finished; HDF5's file locking on), a dataset ``mine`` of 1000 values
    written into it; the file is closed, with ``mine`` in it, when the block ends."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, h5py, numpy as np; f = h5py.File(sys.argv[1], 'a'); "
         "f['mine'] = np.arange(1000.0); f.flush(); print('held', flush=True); sys.stdin.read(); f.close()",
         str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ, **HDF5_LOCKING))
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.communicate("")


def busiest_counted(nest_body, extents: dict[str, int], ranks: int) -> float:
    """The busiest rank's share of a nest's one parallel loop, counted by walking its runs: each
    run's device tiles (the outer loops' ranges, over whole extents, cut into the loop's tiles),
    ⌈T/R⌉·R/T at their mean T."""
    from chainexec.planner.plan import Loop

    def walk(body, runs):
        for node in body:
            if isinstance(node, Loop):
                if node.parallel:
                    counts = [math.prod(-(-(hi - lo) // node.tiles[i]) if i in node.tiles else 1
                                        for i, (lo, hi) in r.items()) * math.prod(
                        -(-extents[i] // t) for i, t in node.tiles.items() if i not in r) for r in runs]
                    return sum(counts) / len(counts)
                spans = {i: [(a, min(a + t, extents[i])) for a in range(0, extents[i], t)] for i, t in node.tiles.items()}
                inner = [dict(r) | dict(zip(spans, combo)) for r in runs for combo in itertools.product(*spans.values())]
                found = walk(node.body, inner)
                if found is not None:
                    return found
        return None

    handed = walk(nest_body, [{}])
    return math.ceil(handed / ranks) * ranks / handed
