"""A property-based fuzzer of the config parser and planner (hypothesis): any config text — a
valid config with fields replaced by hostile values, keys dropped or added, statements made of
random tokens, or its bytes damaged — is either planned or refused with one
:class:`ChainexecError` line, in bounded time; run through the CLI, it exits 0 or 2 with one
line, no traceback, and changes no file outside its own outputs."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from chainexec import spec as spec_mod  # noqa: E402
from chainexec.errors import ChainexecError  # noqa: E402
from chainexec.planner.build import make_plan  # noqa: E402
from chainexec.planner.machine import Machine  # noqa: E402
from tests.conftest import fourindex_config, run_cli  # noqa: E402

SECONDS = 10.0
"""What one config may take to parse and plan (a hang guard, far above any real config's)."""

HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40), st.lists(st.integers(-5, 5), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.sampled_from(["8GiB", "1e999", ".inf", "-1", "0", "p", "a", "float64", "float16", "", "../x", "/", ".",
                     "B[a,b,c,d]", "in.h5", "*", "=", "1/0"]),
)

TOKENS = st.sampled_from(["B", "C", "A", "X", "[", "]", ",", "p", "q", "r", "s", "a", "b", "c", "d", "z",
                          "=", "+=", "-=", "*", "-", "0.5", "1e999", "nan", " ", "()", "[]", "1e-400"])


def _paths(cfg) -> list[tuple]:
    """Every path of keys (and list positions) in a nested config."""
    out = []
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            out.append((k,))
            out += [(k,) + p for p in _paths(v)]
    elif isinstance(cfg, list):
        for i, v in enumerate(cfg):
            out.append((i,))
            out += [(i,) + p for p in _paths(v)]
    return out


@st.composite
def configs(draw) -> str:
    """A config text: the four-index config with edits (replace, drop, add), random statements,
    or damaged bytes."""
    cfg = copy.deepcopy(fourindex_config(n=6, nmo=5, global_memory="64KiB", device_memory="8KiB"))
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(cfg)
        if not paths:
            break
        where = draw(st.sampled_from(paths))
        parent = cfg
        for key in where[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "drop", "add"]))
        if action == "replace":
            parent[where[-1]] = draw(HOSTILE)
        elif action == "drop" and isinstance(parent, dict):
            del parent[where[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(HOSTILE)
    if draw(st.booleans()):
        cfg["statements"] = ["".join(draw(st.lists(TOKENS, min_size=1, max_size=25)))
                             for _ in range(draw(st.integers(1, 3)))]
    text = yaml.safe_dump(cfg, sort_keys=False)
    if draw(st.booleans()):
        data = bytearray(text.encode())
        for _ in range(draw(st.integers(1, 6))):
            at = draw(st.integers(0, len(data) - 1))
            data[at] = draw(st.integers(0, 255))
        return data.decode("latin-1")
    return text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_parse_and_plan_or_refuse(text):
    start = time.perf_counter()
    try:
        s = spec_mod.loads(text, "fuzz.yaml")
        if None in (s.machine.global_memory, s.machine.device_memory):
            s = dataclasses.replace(s, machine=spec_mod.Machine(64 << 10, 8 << 10))
        make_plan(s, Machine())
    except ChainexecError as err:
        message = str(err)
        assert message.startswith("fuzz.yaml") and "\n" not in message, message
    assert time.perf_counter() - start < SECONDS


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """A folder holding ``good.yaml`` (a small four-index transform) and its generated inputs,
    made once for all the examples."""
    folder = tmp_path_factory.mktemp("good")
    good = folder / "good.yaml"
    good.write_text(yaml.safe_dump(fourindex_config(n=6, nmo=5), sort_keys=False))
    assert run_cli("generate", good).returncode == 0
    return folder


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_run_exits_0_or_2_and_touches_only_its_outputs(generated, text):
    """The CLI's ``run`` on a fuzzed config beside the inputs of the valid one: exit 0 or 2 with
    one line, and every file that was there before (inputs, the config, a user's file) as it
    was."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        shutil.copytree(generated, folder, dirs_exist_ok=True)
        (folder / "user.txt").write_text("mine")
        config = folder / "chain.yaml"
        config.write_bytes(text.encode("latin-1", errors="replace"))
        before = _snapshot(folder)
        proc = run_cli("run", config, "--quiet", timeout=120)
        assert proc.returncode in (0, 2), (proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr
        if proc.returncode == 2:
            assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        after = _snapshot(folder)
        assert {k: after.get(k) for k in before} == before
