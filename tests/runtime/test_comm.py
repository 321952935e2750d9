"""The MPI entry point (:func:`chainexec.runtime.comm.mpi`): a process no launcher started takes
the singleton settings its environment leaves unset, a launched one takes none, and no module
of the package imports mpi4py around it; the program ends with its status and all its output,
leaving at once where MPI's finalize waits for every rank (:func:`chainexec.runtime.comm.end`)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from chainexec.runtime import comm
from tests.conftest import launch

PACKAGE = Path(comm.__file__).resolve().parents[1]


@pytest.fixture
def unset(monkeypatch):
    """No launcher variable and none of the singleton settings in the environment."""
    for var in (*comm.LAUNCHER, *comm.SINGLETON):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _started(monkeypatch) -> dict:
    """:func:`comm.mpi` with an mpi4py whose ``MPI`` records the singleton settings in the
    environment when imported (MPI's start); returns those, and checks what ``mpi()`` returned."""
    seen = {}

    def attribute(name):
        seen.update({var: os.environ.get(var) for var in comm.SINGLETON})
        return "the MPI module"

    fake = types.ModuleType("mpi4py")
    fake.__getattr__ = attribute
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)  # MPI not started yet
    assert comm.mpi() == "the MPI module"
    return seen


def test_a_singleton_starts_with_the_settings(unset):
    assert _started(unset) == comm.SINGLETON
    assert not any(var in os.environ for var in comm.SINGLETON)  # not inherited by what it starts


def test_the_users_settings_win(unset):
    for var in comm.SINGLETON:
        unset.setenv(var, "user's")
    assert set(_started(unset).values()) == {"user's"}
    assert all(os.environ[var] == "user's" for var in comm.SINGLETON)


def test_a_launched_process_takes_none(unset):
    unset.setattr(comm, "launched", lambda: True)
    assert set(_started(unset).values()) == {None}
    assert not any(var in os.environ for var in comm.SINGLETON)


def test_the_world_of_a_singleton(unset):
    MPI = comm.mpi()
    assert comm.world() is MPI.COMM_WORLD and MPI.COMM_WORLD.size == 1


def test_once_started_the_environment_is_left_alone(unset):
    """After MPI's start, a call neither sets nor removes the settings (another thread may be
    reading the environment)."""
    comm.mpi()
    unset.setattr(comm, "launched", lambda: pytest.fail("the settings were weighed again after MPI's start"))
    assert comm.mpi() is sys.modules["mpi4py.MPI"]
    assert not any(var in os.environ for var in comm.SINGLETON)


def _imports_mpi4py(path: Path) -> list[int]:
    """Lines of ``path`` that import mpi4py or a module of it."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        lines += [node.lineno for name in names if name.split(".")[0] == "mpi4py"]
    return lines


def test_every_use_of_mpi_goes_through_the_entry_point():
    """Only comm.py imports mpi4py itself; globalarray.py imports mpi4py.util after calling
    :func:`~chainexec.runtime.comm.mpi` (that module imports MPI)."""
    found = {str(p.relative_to(PACKAGE)): _imports_mpi4py(p) for p in sorted(PACKAGE.rglob("*.py"))}
    found = {name: lines for name, lines in found.items() if lines}
    assert set(found) == {"runtime/comm.py", "runtime/globalarray.py"}, found
    text = (PACKAGE / "runtime/globalarray.py").read_text().splitlines()
    first = next(n for n, line in enumerate(text, 1) if line.startswith("MPI = mpi()"))
    assert all(line > first for line in found["runtime/globalarray.py"])


QUIET = """
import sys, time
from chainexec.runtime import comm
world = comm.world()
if world.rank == 1:
    time.sleep(float(sys.argv[1]))  # rank 0 waits this long at the barrier
start, cpu = time.perf_counter(), time.process_time()
comm.barrier(world)
waited, busy = time.perf_counter() - start, time.process_time() - cpu
with open(f"{sys.argv[2]}/rank{world.rank}", "w") as f:  # files: the ranks' stdout may interleave
    f.write(f"{waited} {busy}")
"""


def test_a_rank_waits_at_a_barrier_without_keeping_a_core_busy(tmp_path):
    """:func:`comm.barrier` on 2 ranks, one of which arrives 1.5 s late: the other waits the
    whole time, yet uses a small part of a core meanwhile (a blocking ``Barrier`` polls at full
    speed: its CPU time would equal the wait)."""
    script = tmp_path / "quiet.py"
    script.write_text(QUIET)
    proc = subprocess.run([*launch(2), sys.executable, str(script), "1.5", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    waited, busy = map(float, (tmp_path / "rank0").read_text().split())
    assert waited >= 1.4 and busy < 0.25 * waited, (waited, busy)


TOGETHER = """
import sys, time
from chainexec.runtime import comm
world = comm.world()
naps = []
sleep = time.sleep
time.sleep = lambda s: (naps.append(s), sleep(s))[1]
comm.barrier(world)
for _ in range(int(sys.argv[1])):
    comm.barrier(world)
with open(f"{sys.argv[2]}/rank{world.rank}", "w") as f:
    f.write(str(len(naps)))
"""


def test_ranks_that_arrive_together_pass_a_barrier_without_a_nap(tmp_path):
    """500 barriers of 2 ranks that arrive together: a rank sleeps at hardly any of them (a nap
    delays the other rank's progress too: with naps after 20 µs of tests every barrier slept)."""
    script = tmp_path / "together.py"
    script.write_text(TOGETHER)
    proc = subprocess.run([*launch(2), sys.executable, str(script), "500", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    naps = [int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]
    assert max(naps) < 50, naps


@pytest.mark.parametrize("ranks", [0, 1, 3], ids=["plain", "mpi-started", "three-ranks"])
def test_the_program_ends_with_its_status_and_all_its_output(ranks, tmp_path):
    """:func:`chainexec.runtime.comm.end`: output still in the buffers (a pipe is block-buffered) is
    written, MPI is finalized where the process started it (by the process itself when it is the
    only rank or its MPI's finalize waits for every rank, else by the interpreter's exit), and the
    status is the program's. Three ranks end together, five times over: none leaves its peers
    failing in their finalize."""
    fenced = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; from chainexec.runtime import comm; "
                             "print(comm.fenced_finalize(MPI))"], capture_output=True, text=True, check=True)
    start = ("from mpi4py import MPI; f = MPI.Finalize; "
             "MPI.Finalize = lambda: (print('finalized', file=sys.stderr), f())[1]; ") if ranks else ""
    code = f"import sys; {start}from chainexec.runtime import comm; print('x' * 100000, end=''); comm.end(3)"
    command = [sys.executable, "-c", code]
    if ranks > 1:
        command = [*launch(ranks), *command]
    for _ in range(5 if ranks > 1 else 1):
        done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 3 and done.stdout == "x" * 100000 * max(ranks, 1), done.stderr
        assert ("finalized" in done.stderr) == (ranks == 1 or (ranks > 1 and fenced.stdout.strip() == "True")), \
            done.stderr


@pytest.mark.parametrize("library, flag, fenced", [
    ("Open MPI v5.0.3, package: Open MPI", None, True), ("Open MPI v4.1.5", "0", True),
    ("Open MPI v4.1.5", "1", False), ("Open MPI v4.1.5", "true", False),
    ("MPICH Version:      4.2.0", None, False), ("Intel(R) MPI Library 2021.11", None, False)])
def test_ranks_leave_at_once_where_finalize_waits_for_every_rank(library, flag, fenced, monkeypatch):
    """:func:`chainexec.runtime.comm.fenced_finalize`: Open MPI's finalize opens with a fence unless its
    ``async_mpi_finalize`` parameter is set; other MPIs' are not taken to wait."""
    if flag is None:
        monkeypatch.delenv("OMPI_MCA_async_mpi_finalize", raising=False)
    else:
        monkeypatch.setenv("OMPI_MCA_async_mpi_finalize", flag)
    mpi = types.SimpleNamespace(Get_library_version=lambda: library)
    assert comm.fenced_finalize(mpi) is fenced


def test_a_profiled_program_keeps_its_profile(tmp_path):
    """Under a profiler the program ends through the interpreter's exit, where cProfile writes
    its data."""
    script = tmp_path / "end.py"
    script.write_text("from chainexec.runtime import comm\ncomm.end(0)\n")
    done = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(tmp_path / "p.prof"), str(script)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and (tmp_path / "p.prof").stat().st_size > 0, done.stderr


def test_heard_waits_until_the_reader_has_taken_what_was_written():
    """:func:`chainexec.runtime.comm.heard` returns once a pipe's reader has read every byte
    written to it (what :func:`chainexec.runtime.comm.abort` waits for, so that a launcher that
    ends its ranks on an abort has the rank's error line), and after ``seconds`` where nothing
    reads; a file has no reader to wait for."""
    import threading
    import time

    r, w = os.pipe()
    with os.fdopen(w, "w") as writer, os.fdopen(r, "rb") as reader:
        writer.write("x" * 50000)
        taken = []
        late = threading.Timer(0.3, lambda: taken.append(len(reader.read(50000))))
        started = time.monotonic()
        late.start()
        comm.heard(writer, 30)
        late.join()
        assert 0.3 <= time.monotonic() - started < 30 and taken == [50000]
        writer.write("y" * 1000)
        started = time.monotonic()
        comm.heard(writer, 0.2)
        assert time.monotonic() - started >= 0.2
    with open(os.devnull, "w") as devnull:
        started = time.monotonic()
        comm.heard(devnull, 30)
        assert time.monotonic() - started < 1
