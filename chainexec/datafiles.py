"""The files an HDF5 dataset's values come from: the file that names it, and through HDF5's
links and layouts other files too (an external link's file, a virtual dataset's sources, external
raw storage). A run must not write or remove any of them (:mod:`chainexec.safepaths`), and a
checkpoint identifies its inputs by all of them (:mod:`chainexec.runtime.checkpoint`). Also what
makes an input file or dataset unfit to read before anything is computed from it: a path that is
not a regular file, a dataset whose values were never (wholly) written."""

from __future__ import annotations

import itertools
import math
import os
import resource
import stat

import h5py
import numpy as np

from chainexec.errors import ChainexecError


def check_regular(path: str, what: str) -> None:
    """Refuse ``path`` unless it is a regular file (or a link to one), naming what it is instead:
    HDF5 opens a FIFO by waiting for a writer that may never come (the run, plan or check would
    hang), and a folder, device or socket holds no HDF5 file. A path that is not there passes:
    the open that follows says so."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise ChainexecError(f"is {kind}, not a file ({what})", path)


LOCKED = ("is open for writing in another program (HDF5's file lock): let it finish or close the file, "
          "then run again")
"""What a file another process holds open for writing is told as (:func:`lock_refusal`)."""


def lock_refusal(err: OSError) -> str | None:
    """What to tell of HDF5's refusal to open a file for its file lock, None where ``err`` is
    not one: another process holds the file (its lock: a writer's, or a reader's where this
    open writes; errno 11), or the file system takes no locks (NFS without its lock daemon:
    errno 37 or 38), where HDF5 must be told not to lock."""
    text = str(err)
    if "unable to lock file" not in text:
        return None
    if "errno = 11," in text:
        return LOCKED
    return (f"the file system refuses HDF5's file lock ({text.partition('unable to lock file, ')[2].rstrip(')')}): "
            "where it takes no locks, set HDF5_USE_FILE_LOCKING=FALSE")


def _fill(ds: h5py.Dataset) -> str:
    """The fill value HDF5 reads where ``ds`` was never written, as shown in messages; a dataset
    made without one (``H5Pset_fill_value`` given NULL) reads undefined values there."""
    try:
        return repr(getattr(ds.fillvalue, "item", lambda: ds.fillvalue)())
    except (RuntimeError, OSError):
        return "(undefined)"


def find(f: h5py.Group, name: str, path: str):
    """The object ``name`` in the open file ``f`` (at ``path``), None where there is none; a
    ChainexecError where the file's metadata cannot be read (h5py's ``get`` reads damage as
    absence)."""
    try:
        return f[name] if name in f else None
    except (KeyError, RuntimeError) as err:
        raise ChainexecError(f"cannot open {name!r}: the file is damaged or holds what h5py cannot read "
                             f"({err.args[0] if err.args else err})", path) from None


def check_written(ds: h5py.Dataset, path: str, what: str, within=None, chunks: dict | None = None) -> None:
    """Refuse a dataset stored in its file (not virtual, not in external raw files) whose
    storage was never written, or, chunked, some of whose chunks were not: HDF5 returns its fill
    value there, and a run would take those for the input's values and finish with a result
    that looks complete (what a writer stopped part way, or a dataset made and never filled,
    leaves). Contiguous storage is allocated whole by the first write (or by the dataset's
    creation, where it asks for early allocation), compact storage with the dataset; a chunk
    when first written. A contiguous or compact dataset written in part cannot be told from
    one written whole: its storage holds the fill value where nothing was written.

    ``within``: only the chunks that this selection of the dataset (a virtual dataset's mapping
    of this source, an h5py dataspace) touches must be written (:func:`_touched`); ``chunks``:
    where the written chunks of partly written datasets are kept between calls
    (:func:`_written_chunks`)."""
    if ds.size == 0 or ds.is_virtual or ds.external:
        return
    name = ds.name.lstrip("/")
    if ds.chunks is None:
        if ds.id.get_storage_size() == 0:
            raise ChainexecError(f"dataset {name!r} ({what}) was never written: HDF5 would read its fill value "
                                 f"{_fill(ds)} for every element", path)
        return
    needed = math.prod(-(-n // c) for n, c in zip(ds.shape, ds.chunks))
    written = ds.id.get_num_chunks()
    if written == needed:
        return
    touched = None if within is None else _touched(within, ds.chunks, ds.shape)
    if touched is not None:
        needed = math.prod(map(len, touched))
        found = _written_chunks(ds, chunks if chunks is not None else {})
        written = (sum(index in found for index in itertools.product(*touched)) if needed <= len(found) else
                   sum(all(k in axis for k, axis in zip(index, touched)) for index in found))
    if written < needed:
        raise ChainexecError(f"dataset {name!r} ({what}) is not wholly written: {needed - written} of its "
                             f"{needed} chunks {'that a read takes ' if touched is not None else ''}never were, "
                             f"where HDF5 would read its fill value {_fill(ds)} (a writer stopped part way?)", path)


def _touched(space, chunks: tuple[int, ...], shape: tuple[int, ...]) -> list[set[int]] | None:
    """The chunk indices per axis that the selection ``space`` of a dataset of ``shape`` touches:
    exact for a regular hyperslab (a product of one selection per axis: blocks of ``block``
    every ``stride``; an unlimited count, HDF5's 2⁶⁴ - 1, as far as the dataset reaches), the
    bounding box's for others; None where it cannot be told."""
    try:
        if space.is_regular_hyperslab():
            start, stride, count, block = space.get_regular_hyperslab()
            touched = []
            for s, step, n, b, c, extent in zip(start, stride, count, block, chunks, shape):
                n = min(n, max(0, -(-(extent - s) // max(step, 1))))  # blocks that begin inside
                touched.append({i // c for k in range(n) for i in range(s + k * step, min(s + k * step + b, extent), c)}
                               | {(min(s + k * step + b, extent) - 1) // c for k in range(n)})
            return touched
        lo, hi = space.get_select_bounds()
    except (RuntimeError, ValueError, OverflowError):
        return None
    return [set(range(a // c, min(b, extent - 1) // c + 1)) for a, b, c, extent in zip(lo, hi, chunks, shape)]


def _written_chunks(ds: h5py.Dataset, kept: dict) -> set:
    """The chunks of ``ds`` written (each its index per axis), kept in ``kept`` under the
    dataset's file and name: a virtual dataset maps parts of one source many times."""
    key = (ds.file.filename, ds.name)
    if key not in kept:
        offsets = []
        try:
            ds.id.chunk_iter(lambda info: offsets.append(info.chunk_offset))
        except NotImplementedError:  # HDF5 before 1.14: one call a chunk
            offsets = [ds.id.get_chunk_info(k).chunk_offset for k in range(ds.id.get_num_chunks())]
        kept[key] = {tuple(o // c for o, c in zip(offset, ds.chunks)) for offset in offsets}
    return kept[key]


def check_mapped(ds: h5py.Dataset, path: str, what: str) -> None:
    """Refuse a virtual dataset whose mappings leave elements unmapped: HDF5 reads its fill value
    where no source is mapped (a layout made for a larger set of sources, or with none, or
    mappings that overlap and leave a gap): the elements the mappings cover together are counted
    (:func:`_covered`), else, where the union is too fine to count, the elements they select.
    Mappings of unlimited extent are taken as they are (HDF5 cannot count what they select)."""
    sources = ds.virtual_sources()
    try:
        mapped = sum(source.vspace.get_select_npoints() for source in sources)
    except (RuntimeError, ValueError):  # an unlimited selection
        return
    covered = _covered([source.vspace for source in sources], ds.shape)
    if covered is not None:
        mapped = covered
    if mapped < ds.size:
        raise ChainexecError(f"dataset {ds.name.lstrip('/')!r} ({what}) is a virtual dataset whose sources map "
                             f"{mapped} of its {ds.size} elements, where HDF5 would read its fill value {_fill(ds)}",
                             path)


COVER_BLOCKS = 1 << 16
"""Blocks and points at most whose union :func:`_covered` counts."""
COVER_CELLS = 1 << 22
"""Cells at most of the grid :func:`_covered` marks (a byte each)."""


def _covered(spaces: list, shape: tuple[int, ...]) -> int | None:
    """Elements of a dataset of ``shape`` that the union of the selections ``spaces`` (HDF5
    dataspaces: all, none, points or hyperslabs) covers, counted on the grid the blocks' edges
    cut each axis into (each cell inside or outside every block); None where the selections hold
    more than :data:`COVER_BLOCKS` blocks and points or the grid more than :data:`COVER_CELLS`
    cells."""
    blocks = []  # (first, last) corners, inclusive
    for space in spaces:
        kind = space.get_select_type()
        if kind == h5py.h5s.SEL_ALL:
            return math.prod(shape)
        if kind == h5py.h5s.SEL_POINTS:
            if len(blocks) + space.get_select_elem_npoints() > COVER_BLOCKS:
                return None
            blocks += [(p, p) for p in space.get_select_elem_pointlist()]
        elif kind == h5py.h5s.SEL_HYPERSLABS:
            if len(blocks) + space.get_select_hyper_nblocks() > COVER_BLOCKS:
                return None
            blocks += [(b[0], b[1]) for b in space.get_select_hyper_blocklist()]
    if not blocks:
        return 0
    edges = [np.unique(np.concatenate([[0, n], [b[0][a] for b in blocks], [b[1][a] + 1 for b in blocks]]))
             for a, n in enumerate(shape)]
    if math.prod(len(e) - 1 for e in edges) > COVER_CELLS:
        return None
    inside = np.zeros([len(e) - 1 for e in edges], dtype=np.uint8)
    for first, last in blocks:
        inside[tuple(slice(np.searchsorted(e, lo), np.searchsorted(e, hi + 1))
                     for e, lo, hi in zip(edges, first, last))] = 1
    for e in edges:  # each cell weighed by its elements, one axis at a time
        inside = np.tensordot(np.diff(e), inside, axes=(0, 0))
    return int(inside)


SPARE_FILES = 256
"""Open files a run keeps for its own beside a virtual input's sources (CUDA's, MPI's, its other
inputs and outputs)."""


def check_virtual(ds: h5py.Dataset, path: str, what: str, chunks: dict | None = None,
                  seen: set | None = None) -> None:
    """Refuse a virtual dataset where HDF5 would read its fill value for some elements: where
    they are not mapped (:func:`check_mapped`), where a source is missing (an output copied
    without its ``.parts/`` folder reads as NaN) or not written where it is mapped
    (:func:`check_written`: a source whose writer stopped part way reads as zeros); a virtual
    source's own sources likewise. Each source file is opened once, for all of its datasets
    that are mapped (an output's shard holds one dataset per block), and closed before the
    next: a dataset over thousands of files holds no more of them open than it nests.
    ``chunks``: as for :func:`check_written`; ``seen``: the virtual sources checked already."""
    top = seen is None
    chunks, seen = ({} if chunks is None else chunks), (set() if seen is None else seen)
    name = ds.name.lstrip("/")
    check_mapped(ds, path, what)
    holder = ds.file.filename  # the file an external link leads to, where one does
    by_file: dict[str, list] = {}
    for source in ds.virtual_sources():
        file = holder if source.file_name == "." else os.path.join(os.path.dirname(holder), source.file_name)
        by_file.setdefault(file, []).append(source)
    if top:
        from chainexec.runtime import fdtable

        limit = fdtable.raise_limit()
        if limit != resource.RLIM_INFINITY and len(by_file) + SPARE_FILES > limit:
            raise ChainexecError(f"dataset {name!r} ({what}) is a virtual dataset over {len(by_file)} source files, "
                                 f"which HDF5 holds open while it reads it, more than the {limit} files a process may "
                                 f"open here less {SPARE_FILES} for the run's own (ulimit -n): a source it cannot open "
                                 "reads as the fill value; raise the limit", path)
    source_of = f"a source of dataset {name!r}, {what}"

    def missing(source) -> ChainexecError:
        return ChainexecError(f"dataset {name!r} ({what}) is a virtual dataset whose source "
                              f"{source.file_name}:{source.dset_name} is missing (copied without its "
                              f"{os.path.basename(path)}.parts folder?)", path)

    for file, sources in by_file.items():
        check_regular(file, source_of)  # a FIFO's open would wait for a writer, holding h5py's lock
        try:
            opened = h5py.File(file, "r")
        except (OSError, RuntimeError) as err:
            refusal = lock_refusal(err) if isinstance(err, OSError) else None
            if refusal is not None:
                raise ChainexecError(refusal, file) from None
            raise missing(sources[0]) from None
        with opened:
            for source in sources:
                try:
                    found = opened[source.dset_name]
                except (KeyError, RuntimeError):
                    found = None
                if not isinstance(found, h5py.Dataset):
                    raise missing(source)
                check_written(found, file, source_of, source.src_space, chunks)
                if found.is_virtual and (os.path.realpath(file), found.name) not in seen:
                    seen.add((os.path.realpath(file), found.name))
                    check_virtual(found, file, source_of, chunks, seen)


def links_on_the_way(f: h5py.Group, name: str):
    """``(path, link)`` for each name on the way to ``name`` in the open file ``f``, outermost
    first: the path up to and including it, and the link that names it (``h5py.HardLink``,
    ``SoftLink`` or ``ExternalLink``; None where nothing of that name is there, also where a link
    before it leads nowhere). Where h5py raises instead (a link on the way it cannot resolve), the
    last pair carries its error in place of a link. The walk ends at an external link: a look
    past it would open the file it names (read-write, where ``f`` is), which nothing here
    follows."""
    parts = name.strip("/").split("/")
    for k in range(1, len(parts) + 1):
        at = "/".join(parts[:k])
        try:
            link = f.get(at, getlink=True)
        except (KeyError, RuntimeError, OSError) as err:
            yield at, err
            return
        yield at, link
        if isinstance(link, h5py.ExternalLink):
            return


def check_linked(f: h5py.Group, name: str, path: str) -> None:
    """Refuse an external link on the way to ``name`` in the open file ``f`` (at ``path``) that
    leads to a FIFO, device or socket (:func:`check_regular`), before anything follows it: HDF5
    opens the file a link names when the link is followed, and a FIFO's open waits for a writer
    that may never come, holding h5py's lock (and the interpreter's), so that not even SIGTERM
    ends the process. Links HDF5 cannot follow pass: the read that follows says so."""
    for at, link in links_on_the_way(f, name):  # the walk ends at the first external link: the
        if isinstance(link, h5py.ExternalLink):  # linked file's own links are checked when it is opened
            target = link.filename
            if not os.path.isabs(target):
                beside = os.path.join(os.path.dirname(os.path.abspath(path)), target)
                target = beside if os.path.lexists(beside) else target
            check_regular(target, f"the file external link {at!r} of {path} leads to")


def of(path: str, dataset: str) -> list[str]:
    """Every file whose bytes a read of ``dataset`` in the file at ``path`` returns: ``path``
    itself, the file an external link leads to, a virtual dataset's source files (and theirs, a
    source being virtual itself), a dataset's external raw files; the others as absolute paths,
    each file once (hard links and other spellings of one file found by device and inode). A
    changed source of a virtual dataset changes its values, not its file."""
    files: dict[tuple[int, int] | str, str] = {}  # (device, inode), or the path where none: the path

    def add(file: str) -> None:
        try:
            st = os.stat(file)
            files.setdefault((st.st_dev, st.st_ino), file)
        except OSError:
            files.setdefault(file, file)

    add(path)
    if not os.path.isfile(path):
        return list(files.values())  # nothing to open (a FIFO would block the open): the read says so
    todo = {path: {dataset}}  # file → its datasets whose files are still to be found
    seen = {(os.path.abspath(path), dataset)}
    while todo:
        file, names = todo.popitem()
        if file != path and not os.path.isfile(file):
            continue  # a virtual dataset's source not there: HDF5 reads its fill value
        with h5py.File(file, "r") as f:
            for name in names:
                check_linked(f, name, file)
                ds = f.get(name)
                if not isinstance(ds, h5py.Dataset):
                    continue  # not there, or a group: no values to come from anywhere
                holder = os.path.abspath(ds.file.filename)  # another file's where a link leads there
                add(holder)
                for raw in ds.external or ():
                    add(os.path.abspath(raw[0]))
                for source in ds.virtual_sources() if ds.is_virtual else ():
                    found = os.path.abspath(os.path.join(os.path.dirname(holder), source.file_name))
                    if source.file_name != "." and (found, source.dset_name) not in seen:
                        seen.add((found, source.dset_name))
                        add(found)
                        todo.setdefault(found, set()).add(source.dset_name)
    return list(files.values())
