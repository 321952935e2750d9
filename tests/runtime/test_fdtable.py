"""The descriptor table grown at a process's start (``chainexec/runtime/fdtable.py``), checked in
fresh interpreters against what Linux reports (``FDSize`` in ``/proc/self/status``: the table's
slots)."""

import json
import subprocess
import sys

import pytest

from tests.runtime.commandstart import seen_at

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc")

PRELUDE = """
import json, os, resource
from chainexec.runtime import fdtable
def fdsize():
    with open('/proc/self/status') as f:
        return int(next(l for l in f if l.startswith('FDSize:')).split()[1])
def fds():
    return {int(n): os.readlink('/proc/self/fd/' + n) for n in os.listdir('/proc/self/fd')
            if os.path.exists('/proc/self/fd/' + n)}
"""


FRESH = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"]
"""Started through a process with few descriptors open: a forked child's table is as large as its
parent's open descriptors need, so this test process's own (pytest's) would be inherited."""


def _run(code: str) -> dict:
    done = subprocess.run(FRESH + [sys.executable, "-c", PRELUDE + code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("limit, slots, table", [(None, 1024, 1024), (200, 200, 200), (64, 0, 64), (40, 0, 64)])
def test_the_table_grows_to_the_slots_the_limit_allows(limit, slots, table):
    """A fresh interpreter's table has 64 slots; after :func:`reserve` it holds at least
    ``table``, and the same descriptors are open as before."""
    out = _run(f"""
if {limit} is not None:
    resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
before, open_before = fdsize(), fds()
got = fdtable.reserve()
print(json.dumps({{"before": before, "after": fdsize(), "got": got, "same": fds() == open_before,
                  "soft": None if soft == resource.RLIM_INFINITY else soft}}))
""")
    if limit is None and out["soft"] is not None and out["soft"] < slots:  # this machine's own limit is lower
        slots = table = out["soft"] if out["soft"] > 64 else 0
    assert out["before"] == 64
    assert out["got"] == slots
    assert out["after"] >= table and (slots or out["after"] == 64)
    assert out["same"]


def test_an_open_descriptor_at_the_top_is_left_open():
    """Where the number it would take is open, it takes the next free one and leaves that open."""
    out = _run("""
keep = os.open('/proc/self/status', os.O_RDONLY)
os.dup2(keep, 1023)
fdtable.reserve()
print(json.dumps({"open": os.readlink('/proc/self/fd/1023'), "size": fdsize(), "same": 1024 not in fds()}))
""")
    assert out["open"] == "/proc/self/status" or out["open"].endswith("/status")
    assert out["size"] >= 1024 and out["same"]


def test_nothing_where_no_descriptor_can_be_opened():
    """A process that cannot open ``/dev/null`` (here: its descriptor limit already reached) gets 0
    and no error: the table then grows when the run needs it."""
    out = _run("""
resource.setrlimit(resource.RLIMIT_NOFILE, (200, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
got = fdtable.reserve()
print(json.dumps({"got": got, "held": len(held)}))
""")
    assert out["got"] == 0 and out["held"] > 150


def test_the_run_command_grows_it_while_the_process_has_one_thread(tmp_path):
    """``chainexec run`` grows the table before anything starts a thread (NumPy's BLAS, the
    warm-up, MPI), where growing it needs no RCU grace period."""
    done = seen_at("chainexec.runtime.fdtable", "reserve", "len(os.listdir('/proc/self/task'))", tmp_path)
    assert done.stdout.strip() == "[1]", done.stderr
