"""Files a user hands chainexec (configs, machine files, ``bench tccg`` case files): read whole up
to a size no such file needs to pass, JSON parsed with every object key given once, and every way
they can be wrong one :class:`~chainexec.errors.ChainexecError` naming the file."""

from __future__ import annotations

import json
from pathlib import Path

from chainexec.errors import ChainexecError

MAX_BYTES = 1 << 20
"""Bytes such a file may hold: far more than a config, a machine file or the 48 TCCG cases need,
and a bound on what a wrong path (``/dev/zero``, a data file) makes the process read."""


def read(path: str | Path, what: str) -> str:
    """The text of ``path`` (UTF-8, at most :data:`MAX_BYTES`); ``what``: the file's kind, the
    first words of each refusal."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as err:
        raise ChainexecError(f"cannot read {what}: {err.strerror or err}", str(path)) from None
    if len(data) > MAX_BYTES:
        raise ChainexecError(f"{what} is longer than {MAX_BYTES} bytes", str(path))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ChainexecError(f"{what} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})",
                             str(path), data.count(b"\n", 0, err.start) + 1) from None


def loads(text: str, what: str, path: str):
    """The JSON value of ``text`` (read from ``path``); a key given twice in one object (the first
    value would be lost) and nesting deeper than the parser's recursion are refused."""
    try:
        return json.loads(text, object_pairs_hook=_once)
    except json.JSONDecodeError as err:
        raise ChainexecError(f"{what} is not JSON: {err.msg}", str(path), err.lineno) from None
    except RecursionError:
        raise ChainexecError(f"{what} nests its lists or objects deeper than a JSON file of its kind can",
                             str(path)) from None
    except ValueError as err:
        if "integer string conversion" in str(err):
            raise ChainexecError(f"{what} holds a whole number of more digits than any field takes",
                                 str(path)) from None
        raise ChainexecError(f"{what}: {err}", str(path)) from None


def _once(pairs: list) -> dict:
    """A JSON object's pairs as a dict, each key given once."""
    data = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"field {key!r} is given twice")
        data[key] = value
    return data
