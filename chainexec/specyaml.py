"""A config's YAML: its text read and composed into data, each item mapped to its line.

The text is read with a bound on its bytes (:func:`read`) and composed by a subclass of
``yaml.SafeLoader`` (:class:`_Loader`: ``yaml.safe_load`` semantics, with bounds on the nodes it
stands for and on nesting, and no repeated keys), so that reading any config, hostile ones
included, takes bounded work; the data is built from that node graph, whose marks give each
item's line (:func:`compose`).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from chainexec import userfiles
from chainexec.errors import ChainexecError

# Bytes in a config file, YAML nodes it stands for (each alias counted as the nodes it refers to)
# and nodes nested in one another: far above any chain's (the (T) job's config: 3.5 KiB, 199 nodes,
# 5 deep), and a bound on the work of reading any config, hostile ones included.
MAX_CONFIG_BYTES = userfiles.MAX_BYTES
MAX_NODES = 10_000
MAX_DEPTH = 32


class _Refused(yaml.MarkedYAMLError):
    """Well-formed YAML that a config may not be (:class:`_Loader`); ``problem`` says why."""


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses, while composing and so before any Python value is built:

    - a document of more than :data:`MAX_NODES` nodes, each alias counted as the nodes of what it
      refers to (a few lines of nested aliases stand for billions of nodes, which building the
      data or walking it would take for ever to visit); the count takes one step per node
      composed, aliased parts are not walked again;
    - an alias inside the collection it refers to (a recursive structure: no finite size);
    - nesting deeper than :data:`MAX_DEPTH` collections (composing is recursive);
    - a mapping that repeats a key (``yaml.safe_load`` keeps the last value silently), keys
      compared as the values they stand for (``1`` and ``0x1`` are one key); ``<<`` merge keys
      and the keys they merge in are YAML's overriding, not repeats.

    Booleans are YAML 1.2's: ``true`` and ``false`` alone. YAML 1.1's others (``yes``, ``no``,
    ``on``, ``off``) are text, so that names such as ``no`` (occupied orbitals) and ``on`` are
    names, not ``False`` and ``True``; a flag written ``yes`` is refused as not true or false.
    """

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def __init__(self, stream):
        super().__init__(stream)
        self.nodes = 0  # nodes composed so far, each alias counted as the nodes it refers to
        self.depth = 0  # collections open around the node being composed
        self.sizes: dict[str, int] = {}  # anchor -> the nodes of what it names (once composed)

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self.anchors and event.anchor not in self.sizes:
                raise _Refused(None, None, f"alias *{event.anchor} lies inside what it refers to", event.start_mark)
            self.nodes += self.sizes.get(event.anchor, 0)
            node = super().compose_node(parent, index)
        else:
            start = self.nodes
            self.nodes += 1
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise _Refused(None, None, f"nested deeper than {MAX_DEPTH} levels", event.start_mark)
            node = super().compose_node(parent, index)
            self.depth -= 1
            if event.anchor is not None:
                self.sizes[event.anchor] = self.nodes - start
        if self.nodes > MAX_NODES:
            raise _Refused(None, None, f"the config stands for more than {MAX_NODES} YAML nodes (aliases "
                           "counted as what they refer to)", event.start_mark)
        return node

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        first: dict = {}
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                value = self.construct_object(key)
                if value in first:
                    raise _Refused(None, None, f"key {key.value!r} repeats (first on line {first[value]})",
                                   key.start_mark)
                first[value] = key.start_mark.line + 1
        return node


_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def _compose(text: str):
    """The YAML document's node graph (for :func:`_line_map`) and the data built from it, by
    :class:`_Loader`; (None, None) for an empty document."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        return node, None if node is None else loader.construct_document(node)
    except (ValueError, OverflowError) as err:  # PyYAML's scanner: an escape beyond Unicode (chr())
        raise yaml.MarkedYAMLError(problem=f"a scalar's escape names no character ({err})",
                                   problem_mark=loader.get_mark()) from None
    finally:
        loader.dispose()


def _line_map(node, prefix=()) -> dict:
    """Map each item's path (tuple of keys / list positions) to its 1-based line in the YAML text."""
    lines = {prefix: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            sub = prefix + (key.value,)
            lines.update(_line_map(value, sub))
            lines[sub] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, value in enumerate(node.value):
            lines.update(_line_map(value, prefix + (i,)))
    return lines


def read(path: str | Path) -> str:
    """A config file's text (UTF-8, at most :data:`MAX_CONFIG_BYTES`, :func:`chainexec.userfiles.read`);
    raises :class:`ChainexecError` where it cannot be read, is longer or is not UTF-8."""
    return userfiles.read(path, "config")


def compose(text: str, path: str) -> tuple[object, dict]:
    """A config's data and the line of each item in it (:func:`_line_map`; empty for an empty
    document, whose data is None). Raises :class:`ChainexecError` naming ``path`` and the line
    where the text is not YAML or is YAML a config may not be (:class:`_Loader`)."""
    try:
        node, data = _compose(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        message = problem if isinstance(err, _Refused) else f"malformed YAML: {problem}"
        raise ChainexecError(message, path, mark.line + 1 if mark else None) from None
    return data, _line_map(node) if node is not None else {}
