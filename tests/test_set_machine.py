"""``benchmarks/set_machine.py``: the memory limits set, the rest of the config kept, and a
config ``chainexec chem`` wrote still known as its own (its first line kept), so that a later
``chem`` into the same folder replaces it instead of refusing the folder."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from chainexec.chem import job
from chainexec.errors import ChainexecError

ROOT = Path(__file__).resolve().parents[1]


def _set(config: Path, *sizes: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "set_machine.py"), str(config), *sizes], check=True)


def test_a_chem_config_keeps_its_header(tmp_path):
    cfg = {"tensors": {"t": {"indices": "ab", "source": "random"}}, "machine": {"global_memory": "1GiB"},
           "ranges": {"a": 7, "b": 11}}
    config = tmp_path / job.JOBS["ccsd_t"].config
    config.write_text(job.HEADER + "\n# after a blank line\n" + yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    _set(config, "16GiB", "40GiB")
    text = config.read_text(encoding="utf-8")
    assert text.startswith(job.HEADER + "\n# after a blank line\n")
    assert yaml.safe_load(text) == dict(cfg, machine={"global_memory": "16GiB", "device_memory": "40GiB"})
    job.check_out(tmp_path)


def test_a_config_without_header_gains_none(tmp_path):
    config = tmp_path / job.JOBS["ao2mo"].config
    config.write_text("ranges: {a: 3}\n", encoding="utf-8")
    _set(config, "2GiB", "3GiB")
    assert config.read_text(encoding="utf-8").startswith("ranges:")
    with pytest.raises(ChainexecError, match="not written by chainexec chem"):
        job.check_out(tmp_path)
