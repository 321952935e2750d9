"""Chain spec: the YAML config parsed and validated into frozen dataclasses.

The format is documented with a complete example in ``docs/config.md``. :func:`load` reads a
config file and :func:`loads` its text in three steps, each a module of its own:

- :mod:`chainexec.specyaml`: the text read and composed by a bounded ``yaml.SafeLoader`` (no
  repeated keys, bounds on size and nesting), each item mapped to its line;
- :mod:`chainexec.speccheck`: the data checked section by section, so that every error names the
  file, the line and the offending item;
- :mod:`chainexec.spectypes`: the frozen dataclasses it becomes (:class:`Spec` and its parts),
  the dtypes, and memory sizes in bytes.

Their public names are imported here, the ones the rest of chainexec uses as ``spec.NAME``.
Paths inside a config (HDF5 inputs and outputs, scratch) are relative to the config file's folder.
"""

from __future__ import annotations

from pathlib import Path

from chainexec.speccheck import MAX_NAME, build, check_identifier, parse_statement
from chainexec.specyaml import MAX_CONFIG_BYTES, MAX_DEPTH, MAX_NODES, compose, read
from chainexec.spectypes import (DTYPES, MAX_SIZE, Machine, Output, Ref, Source, Spec, Statement, Tensor,
                                 format_size, parse_size)

__all__ = ["DTYPES", "MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_NAME", "MAX_NODES", "MAX_SIZE", "Machine", "Output",
           "Ref", "Source", "Spec", "Statement", "Tensor", "check_identifier", "format_size", "load", "loads",
           "parse_size", "parse_statement", "read"]


def load(path: str | Path) -> Spec:
    """Read, parse and validate a config file; raises :class:`ChainexecError` on any problem."""
    return loads(read(path), str(path))


def loads(text: str, path: str = "<config>") -> Spec:
    """Parse and validate a config's text (``path`` names it in errors)."""
    data, lines = compose(text, path)
    return build(data, lines, path)
