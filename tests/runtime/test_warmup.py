"""The GPU warm-up on the CPU: which device and job the process-start warm-up takes (the
launcher's local rank modulo the GPUs, GPU 0 for a process started alone, none where a launcher
does not say; the config's resolved path), that a device is warmed up once per process and that
``wait`` waits for it, that it is best effort, the CUDA context made through the driver, the
stand-in matrices of a logged cuBLAS call, and that the command line begins the warm-up before
importing the runtime and still reports a bad config in one line. The replay itself runs on a
GPU in ``test_warmup_gpu.py``."""

from __future__ import annotations

import importlib.abc
import importlib.util
import subprocess
import sys
import threading
import types

import pytest

from chainexec.runtime import comm, warmup
from tests.runtime.commandstart import seen_at


@pytest.fixture
def warmed(monkeypatch):
    """A stand-in ``cupy`` with 2 GPUs, no CUDA context made, and a warm-up that records the
    device and job it is asked for; no launcher variables, no device claimed, no warm-up begun."""
    for var in comm.LOCAL_RANK + comm.LAUNCHER:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(warmup, "_CLAIMED", set())
    monkeypatch.setattr(warmup, "_EARLY", [])
    monkeypatch.setattr(warmup, "_GO", threading.Event())
    monkeypatch.setattr(warmup, "context", lambda local: None)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 2)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    calls = []
    monkeypatch.setattr(warmup, "warm_up", lambda cupy, device, job=None: calls.append((device, job)))
    return calls


def started(backend: str, config: str = "ccsd_t.yaml") -> None:
    warmup.start(config, backend)
    warmup.wait()


@pytest.mark.parametrize("env, expected", [({}, [0]),
                                           ({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}, [1]),
                                           ({"SLURM_LOCALID": "2", "SLURM_NTASKS": "4"}, [0]),
                                           ({"MPI_LOCALRANKID": "1"}, [1]),
                                           ({"PMI_SIZE": "4", "PMI_RANK": "1"}, []),
                                           ({"OMPI_COMM_WORLD_LOCAL_RANK": "not a rank", "PMIX_RANK": "0"}, [])],
                         ids=["alone", "open-mpi", "srun", "hydra", "launcher-without-local-rank", "garbled"])
def test_the_process_start_warms_up_the_gpu_the_rank_will_use(warmed, monkeypatch, env, expected):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    started("auto")
    assert [device for device, _ in warmed] == expected


@pytest.mark.parametrize("backend", ["numpy", "cupy"])
def test_an_earlier_runs_free_memory_is_forgotten_at_each_start(warmed, monkeypatch, backend):
    """A server's next run never reads the free memory an earlier run's warm-up read, whether or
    not this run warms up a GPU (the stand-in warm-up here reads none)."""
    monkeypatch.setattr(warmup, "_FREE", {0: 5 << 30})
    warmup.start("job.yaml", backend)
    warmup.wait()
    assert warmup.free_memory(0) is None


def test_nothing_for_the_numpy_backend(warmed):
    started("numpy")
    assert warmed == []


def test_the_warm_up_replays_the_configs_job(warmed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    started("auto", "ccsd_t.yaml")
    assert warmed == [(0, str(tmp_path / "ccsd_t.yaml"))]


def test_wait_returns_once_the_warm_up_has_ended(warmed, monkeypatch):
    """The backend's selection waits for the warm-up the command's start began."""
    gate = threading.Event()
    monkeypatch.setattr(warmup, "warm_up", lambda cupy, device, job=None: gate.wait(30) and warmed.append(device))
    warmup.start("ccsd_t.yaml", "auto")
    threading.Timer(0.2, gate.set).start()
    warmup.wait()
    assert warmed == [0] and not any(t.is_alive() for t in warmup._EARLY)


@pytest.fixture
def importers(warmed, monkeypatch) -> list:
    """The names of the threads that import ``cupy`` (the stand-in of :func:`warmed`), recorded
    by a finder of its own (CuPy is not in ``sys.modules`` until one does)."""
    names = []
    fake = types.ModuleType("cupy")
    fake.cuda = sys.modules["cupy"].cuda

    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return fake

        def exec_module(self, module):
            names.append(threading.current_thread().name)

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            return importlib.util.spec_from_loader(name, Loader()) if name == "cupy" else None

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "cupy")
    return names


def test_cupy_is_imported_on_the_main_thread_after_its_imports(warmed, importers, monkeypatch):
    """Begun at the command's start, the warm-up makes the CUDA context and waits: CuPy is imported
    by :func:`warmup.proceed` on the calling (main) thread, and only then does the warm-up load.
    No two threads import at once."""
    reached = threading.Event()

    class Gate(threading.Event):
        def wait(self, timeout=None):
            reached.set()  # the warm-up waits here, before any import
            return super().wait(timeout)

    monkeypatch.setattr(warmup, "_GO", Gate())
    warmup.start("ccsd_t.yaml", "auto")
    assert reached.wait(30)
    assert importers == [] and warmed == [] and warmup.busy()
    warmup.proceed()
    warmup.wait()
    assert importers == [threading.current_thread().name] and [device for device, _ in warmed] == [0]


def test_a_warm_up_never_released_imports_nothing(warmed, importers, monkeypatch):
    """Where :func:`warmup.proceed` never comes (within :data:`warmup.WAIT`), the warm-up ends
    without importing or loading anything."""
    monkeypatch.setattr(warmup, "WAIT", 0.05)
    warmup.start("ccsd_t.yaml", "auto")
    for thread in warmup._EARLY:
        thread.join(30)
    assert importers == [] and warmed == [] and not warmup.busy()


def test_busy_while_the_warm_up_loads(warmed, monkeypatch):
    """:func:`warmup.busy`: the backend's selection makes the logged host preparations only while
    the warm-up it is about to wait for still loads."""
    gate = threading.Event()
    monkeypatch.setattr(warmup, "warm_up", lambda cupy, device, job=None: gate.wait(30))
    assert not warmup.busy()
    warmup.start("ccsd_t.yaml", "auto")
    assert warmup.busy()
    gate.set()
    warmup.wait()
    assert not warmup.busy()


def test_nothing_without_cupy(warmed, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import fails
    started("cupy")
    assert warmed == []


def test_a_device_is_warmed_up_once_per_process(warmed):
    started("auto")
    started("cupy")
    assert [device for device, _ in warmed] == [0]
    assert not warmup.claim(0)  # the backend's selection then starts none
    assert warmup.claim(1) and not warmup.claim(1)


def test_warm_up_is_best_effort():
    """Only loads libraries early: a device that fails there is reported by the run's own first
    use, not by the warm-up's thread."""
    class Failing:
        class cuda:
            @staticmethod
            def Device(number):
                raise RuntimeError(f"device {number} is not usable")

    assert warmup.warm_up(Failing, 0) is None


@pytest.mark.parametrize("call, elements", [
    (("d", True, False, False, 93, 20, 21, 93, 21, 93, 441, 0), (93 * 21, 21 * 20, 93 * 20)),
    (("d", False, True, True, 93, 20, 21, 21, 20, 100, 7, 1), (21 * 93, 20 * 21, 100 * 20)),
])
def test_stand_in_matrices_are_as_cublas_reads_them(call, elements):
    """Column-major: A is lda by k (m where transposed), B ldb by n (k where transposed), C ldc by n."""
    assert warmup.sizes(call) == elements


def test_the_command_line_begins_the_warm_up_before_importing_the_runtime(tmp_path):
    """``chainexec run`` begins the warm-up before the runtime, h5py and MPI are imported, so
    that it overlaps their imports."""
    done = seen_at("chainexec.runtime.warmup", "start", "sorted(m for m in ('chainexec.api', "
                   "'chainexec.runtime.executor', 'h5py', 'mpi4py.MPI') if m in sys.modules)", tmp_path)
    assert done.stdout.strip() == "[[]]", done.stderr


def test_a_config_that_cannot_be_resolved_is_one_line_and_status_2(tmp_path):
    """A config that is a link to itself: the run reports it (the warm-up only takes its path)."""
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    done = subprocess.run([sys.executable, "-m", "chainexec.cli", "run", "loop.yaml"], capture_output=True,
                          text=True, cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "loop.yaml" in done.stderr and done.stdout == ""


class FakeDriver:
    """``libcuda`` as ``ctypes`` sees it: ``count`` GPUs; records the calls made."""

    def __init__(self, count: int, fail: str = ""):
        self.count, self.fail, self.calls = count, fail, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name == self.fail:
                return 1
            if name == "cuDeviceGetCount":
                args[0]._obj.value = self.count
            elif name == "cuDeviceGet":
                args[0]._obj.value = args[1] + 100  # a handle, not the ordinal
                self.ordinal = args[1]
            elif name == "cuDevicePrimaryCtxRetain":
                self.retained = args[1]
            elif name == "cuMemGetInfo_v2":
                args[0]._obj.value, args[1]._obj.value = 7 << 30, 8 << 30
            return 0
        return call


@pytest.mark.parametrize("local, count, ordinal", [(0, 1, 0), (5, 4, 1), (3, 4, 3)])
def test_context_made_on_the_gpu_the_rank_will_use(monkeypatch, local, count, ordinal):
    """The context of the rank's GPU, and that GPU's free memory read in it (the context made
    current for the reading only)."""
    driver = FakeDriver(count)
    monkeypatch.setattr("ctypes.CDLL", lambda name: driver)
    monkeypatch.setattr(warmup, "_FREE", {})
    warmup.context(local)
    assert driver.ordinal == ordinal and driver.retained.value == ordinal + 100
    assert driver.calls == ["cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                            "cuCtxPushCurrent_v2", "cuMemGetInfo_v2", "cuCtxPopCurrent_v2"]
    assert warmup.free_memory(ordinal) == 7 << 30 and warmup.free_memory(ordinal + 1) is None


@pytest.mark.parametrize("fail", ["cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                                  "cuCtxPushCurrent_v2", "cuMemGetInfo_v2"])
def test_no_context_or_no_figure_where_the_driver_fails(monkeypatch, fail):
    """A failed call leaves what follows it undone and no free memory read; a context made
    current is popped again even where the reading failed."""
    driver = FakeDriver(2, fail)
    monkeypatch.setattr("ctypes.CDLL", lambda name: driver)
    monkeypatch.setattr(warmup, "_FREE", {})
    warmup.context(0)
    assert warmup.free_memory(0) is None
    assert driver.calls[-1] == ("cuCtxPopCurrent_v2" if fail == "cuMemGetInfo_v2" else fail)


def test_no_context_without_a_driver(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr("ctypes.CDLL", missing)
    assert warmup.context(0) is None


def test_no_gpus_no_context(monkeypatch):
    driver = FakeDriver(0)
    monkeypatch.setattr("ctypes.CDLL", lambda name: driver)
    warmup.context(0)
    assert driver.calls == ["cuInit", "cuDeviceGetCount"]
