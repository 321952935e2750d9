"""Registered sources: tensors whose values are computed where a tile is loaded, not read from a
file. A config names a registered source and gives its parameters; it never names code.

A source is made by its registered factory, ``lookup(name)(**parameters)``, and then yields
the values of any range of rows of its tensor on its own, in any order, so that a runtime can
load tiles on whichever rank or thread needs them. Sources shipped with chainexec register
themselves when their module is imported; :func:`lookup` imports the module of a built-in
name (:data:`BUILTIN`) the first time that name is asked for, so a source's own dependencies
(PySCF for ``pyscf.int2e``) load only when a config uses it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from chainexec.errors import ChainexecError
from chainexec.packing import Layout

BUILTIN = {"pyscf.int2e": "chainexec.chem.integrals"}
"""Built-in source name -> the module that registers it."""

_FACTORIES: dict[str, Callable[..., Source]] = {}


@runtime_checkable
class Source(Protocol):
    """The values of one tensor, computed on request.

    ``shape`` and ``dtype`` are those of the stored array: the packed array where ``layout`` is
    a :class:`chainexec.packing.Layout` (its :attr:`~chainexec.packing.Layout.shape`), the dense
    tensor where ``layout`` is None. ``values((start, stop))`` returns
    ``array[start:stop]``, the slice of the leading axis, shape ``(stop - start,) + shape[1:]``
    — what reading the same rows of the stored array from a file gives (for a packed layout,
    :meth:`chainexec.packing.Layout.leading_tile` says which block they hold).
    ``values(region, out)`` may compute them into ``out`` (a C-contiguous array of that shape and
    the dtype) and return it, or return an array of its own, which the caller then copies: the
    whole tensor computed into its global array is neither a second copy of it in host memory
    nor a pass over it."""

    name: ClassVar[str]
    shape: tuple[int, ...]
    dtype: np.dtype
    layout: Layout | None

    def values(self, region: tuple[int, int], out: np.ndarray | None = None) -> np.ndarray: ...


def register(name: str):
    """Class decorator: register a source factory under ``name`` (and set its ``name``)."""
    def add(factory):
        if _FACTORIES.get(name, factory) is not factory:
            raise ValueError(f"source name {name!r} is registered twice")
        factory.name = name
        _FACTORIES[name] = factory
        return factory
    return add


def lookup(name: str) -> Callable[..., Source]:
    """The factory registered under ``name``. Raises :class:`ChainexecError` (one line naming
    the known sources) for any other name."""
    if isinstance(name, str) and name not in _FACTORIES and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    if not isinstance(name, str) or name not in _FACTORIES:
        known = ", ".join(sorted(set(_FACTORIES) | set(BUILTIN)))
        raise ChainexecError(f"unknown source {name!r} (registered: {known})")
    return _FACTORIES[name]
