"""What ``chainexec run`` has done by the time one of its start-up calls is made, for the tests of
what the command does before anything else (``test_warmup.py``, ``test_fdtable.py``)."""

import subprocess
import sys


def seen_at(module: str, name: str, probe: str, cwd) -> subprocess.CompletedProcess:
    """Run ``chainexec run missing.yaml --backend numpy`` in a fresh interpreter (in ``cwd``), as
    the program runs it (in a process of its own: its signals watched by a thread), with
    ``module.name`` wrapped so that each call first records ``probe`` (a Python expression; ``os``
    and ``sys`` are imported) and then goes on; the records are printed as a list."""
    code = (f"import importlib, os, sys; from chainexec import cli; m = importlib.import_module({module!r}); "
            f"seen = []; f = getattr(m, {name!r}); "
            f"setattr(m, {name!r}, lambda *a, **k: (seen.append({probe}), f(*a, **k))[1]); "
            "cli.main(['run', 'missing.yaml', '--backend', 'numpy'], own=True); print(seen)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd)
