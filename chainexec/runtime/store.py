"""The disk level (α): HDF5 reads by hyperslab, shard writes joined by virtual datasets, outputs that
are complete or absent.

h5py from PyPI is serial, so no two processes ever write one file. Each rank writes the blocks it
owns into its own shard file, one dataset per block (contiguous, no chunk read-modify-write); after
a contraction rank 0 joins the blocks of that tensor version into a virtual dataset (VDS), through
which any rank reads it back. A large block is cut into stripes along its first long axis, each
its own dataset in its own file of the rank's shard (``rank<R>.h5``, ``rank<R>s<S>.h5``), written
on a thread each: buffered writes to one file take its inode's lock, so only separate files
take a block at the page cache's rate over threads. Outputs are VDS files beside a ``<file>.parts/`` folder of shards,
written under a temporary name and renamed into place only after the last contraction, with the
attribute ``chainexec_complete`` — a killed run leaves no output file at all.

A run that checkpoints (:mod:`chainexec.runtime.checkpoint`) seals its shards at each checkpoint
(:meth:`Store.seal`): each rank closes, syncs and renames its shard file ``rank<R>.h5`` of every
version being written to ``rank<R>-<N>.h5`` (N: the checkpoint's number), which is never written
again (an HDF5 file a process dies writing may be unreadable whole), and its next blocks go to a
new ``rank<R>.h5``. Each block is known by its file, its dataset and its region; a resumed run
takes the sealed blocks and the closed versions back (:meth:`Store.resume`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import shutil
from pathlib import Path

import h5py
import numpy as np

from chainexec import atomicfile, datafiles, generator, safepaths, stopsignals
from chainexec.errors import ChainexecError
from chainexec.planner.plan import Plan, TensorInfo, stores
from chainexec.spectypes import format_size
from chainexec.runtime import fileid, hostcopy
from chainexec.runtime.comm import barrier
from chainexec.runtime.mapped import MappedArray, cached_share, contiguous_offset
from chainexec.runtime.region import box_shape, whole_rows

COMPLETE = "chainexec_complete"


def computed(t: TensorInfo):
    """The registered source (:mod:`chainexec.sources`) of an input computed where it is loaded,
    made with the config's parameters and the tensor's layout (:attr:`TensorInfo.layout`)."""
    from chainexec import sources

    factory = sources.lookup(t.source["compute"])
    try:
        return factory(**t.source.get("parameters", {}), layout=t.layout or "s1")
    except TypeError as err:
        raise ChainexecError(f"source {t.source['compute']!r} of tensor {t.name}: {err}") from None


def cached_inputs(plan: Plan) -> dict[str, float]:
    """Per input tensor read from a file, the share of its dataset's bytes that the page cache
    holds where its loads map them (:func:`chainexec.runtime.mapped.cached_share`): what
    :func:`chainexec.planner.cost.predict` prices as loads that move nothing."""
    return {t.name: cached_share(t.source["file"], t.source["dataset"], np.dtype(t.dtype))
            for t in plan.tensors.values() if t.from_file()}


def check_inputs(plan: Plan) -> None:
    """Every HDF5 source exists and matches its tensor's shape and dtype, and every computed one
    makes values of that shape and dtype; raises ChainexecError."""
    for t in plan.tensors.values():
        if t.role == "input" and "compute" in t.source:
            source = computed(t)
            if tuple(source.shape) != tuple(t.shape) or np.dtype(source.dtype) != np.dtype(t.dtype):
                raise ChainexecError(f"source {t.source['compute']!r} makes {source.dtype} values of shape "
                                     f"{tuple(source.shape)}, but tensor {t.name} is {t.dtype} of {tuple(t.shape)}")
        if t.role != "input" or "file" not in t.source:
            continue
        path = t.source["file"]
        if not os.path.exists(path):
            raise ChainexecError(f"HDF5 file not found (input of tensor {t.name}; `chainexec generate` writes it)", path)
        datafiles.check_regular(path, f"input of tensor {t.name}")
        try:
            with h5py.File(path, "r") as f:
                try:
                    ds = f[t.source["dataset"]] if t.source["dataset"] in f else None
                except KeyError as err:
                    raise ChainexecError(f"dataset {t.source['dataset']!r} (input of tensor {t.name}) cannot be "
                                         f"opened ({err.args[0]}; an external link to a file not there?)", path) from None
                if not isinstance(ds, h5py.Dataset):
                    raise ChainexecError(f"no dataset {t.source['dataset']!r} (input of tensor {t.name})", path)
                if ds.shape is None:
                    raise ChainexecError(f"dataset {t.source['dataset']!r} has no dataspace (an empty dataset) but "
                                         f"tensor {t.name} has extents {tuple(t.shape)}", path)
                if tuple(ds.shape) != tuple(t.shape):
                    raise ChainexecError(
                        f"dataset {t.source['dataset']!r} has shape {tuple(ds.shape)} but tensor {t.name}"
                        f"[{','.join(t.indices)}] has extents {tuple(t.shape)}", path)
                if ds.dtype != np.dtype(t.dtype):
                    swapped = ds.dtype.newbyteorder() == np.dtype(t.dtype)
                    raise ChainexecError(
                        f"dataset {t.source['dataset']!r} holds {t.dtype} of the other byte order ({ds.dtype}), which "
                        "chainexec reads as it lies: store it in this machine's order (h5py: "
                        "f.create_dataset(name, data=values.astype(values.dtype.newbyteorder('=')))"
                        if swapped else
                        f"dataset {t.source['dataset']!r} has dtype {ds.dtype} but tensor {t.name} is {t.dtype}", path)
                if ds.is_virtual:
                    datafiles.check_virtual(ds, path, f"input of tensor {t.name}")
                datafiles.check_written(ds, path, f"input of tensor {t.name}")
                remaining = ds.nbytes  # the bytes the external files' segments hold, in order
                for raw, offset, size in ds.external or ():
                    needed, remaining = min(size, remaining), remaining - min(size, remaining)
                    if not os.path.isfile(raw) or os.path.getsize(raw) < offset + needed:
                        raise ChainexecError(f"dataset {t.source['dataset']!r} (input of tensor {t.name}) keeps its "
                                             f"values in the external file {os.fsdecode(raw)}, which is "
                                             f"{'shorter than they are' if os.path.isfile(raw) else 'not there'}", path)
                if t.source.get("permutations"):
                    _check_symmetric(ds, t, path)
        except OSError as err:
            raise ChainexecError(datafiles.lock_refusal(err) or f"cannot read as HDF5 ({err})", path) from None
        except RuntimeError as err:  # h5py's word for damaged metadata, or an undefined value it reads
            raise ChainexecError(f"cannot read as HDF5: the file is damaged or holds what h5py cannot read ({err})",
                                 path) from None


SYMMETRY_SAMPLES = 64
"""Elements of a dense input declared symmetric that a run compares with their images
(:func:`_check_symmetric`): a few hundred single-element reads, against a run's hours."""

SYMMETRY_TOLERANCE = {"float64": 1e-6, "float32": 1e-3}
"""How far (relative) an element of a dense input declared symmetric may lie from its images."""


def _check_symmetric(ds: h5py.Dataset, t: TensorInfo, path: str) -> None:
    """Refuse a dense input, or a packed one in a layout narrower than its symmetry, whose stored
    values lack its declared symmetry (``source["permutations"]``, orders of its stored axes:
    :meth:`chainexec.spec.Spec.dense_symmetry`, :meth:`~chainexec.spec.Spec.stored_symmetry`) at
    :data:`SYMMETRY_SAMPLES` elements drawn with
    a fixed seed: the run reads only part of such a tensor and takes the rest as its images, so
    values that differ would give a result that is neither. A check for values made without the
    symmetry, not for rounding (PySCF's MO integrals keep theirs to about 1e-13): an element and
    its image differ by at most :data:`SYMMETRY_TOLERANCE` of the larger of the two or of the
    largest value sampled."""
    rng = np.random.default_rng(0)
    tolerance = SYMMETRY_TOLERANCE[np.dtype(t.dtype).name]
    points = {tuple(int(rng.integers(n)) for n in t.shape) for _ in range(SYMMETRY_SAMPLES)}
    pairs = [(point, tuple(point[order[d]] for d in range(len(point))))
             for point in sorted(points) for order in t.source["permutations"]]
    values = {p: float(ds[p]) for p in {p for pair in pairs for p in pair}}
    largest = max(abs(v) for v in values.values())
    for point, image in pairs:
        a, b = values[point], values[image]
        if abs(a - b) > tolerance * max(largest, abs(a), abs(b)):
            raise ChainexecError(
                f"tensor {t.name} is declared symmetric, but dataset {t.source['dataset']!r} is not: "
                f"{t.name}{list(point)} = {a!r} and {t.name}{list(image)} = {b!r}; the run would take one for the "
                "other: fix the values (seeded ones: `chainexec generate` again) or the declaration", path)


def check_writable(files, what: str = "output path") -> None:
    """Check that a file can be made at each of these paths (rank 0, once
    :func:`chainexec.safepaths.check_run` has passed): a probe file made and removed at once in
    its folder or, where that does not exist yet, in the nearest folder that does, where the
    run will make it (:func:`make_folders`, once every check has passed: a run refused before
    leaves no folder behind). A run whose files cannot be written is refused before it computes
    anything. ``what`` names the path in the error (``output path``, ``--report-json file``)."""
    for path in map(Path, files):
        try:
            atomicfile.probe(path, folders_made=True)
        except OSError as err:
            raise ChainexecError(f"{what} is not writable ({err.strerror or err})", str(path)) from None


def check_space(plan: Plan) -> None:
    """Refuse a run whose stored tensors cannot fit the free space of the file systems they go to
    (rank 0, once the plan is made, before anything is written): each tensor the plan stores on
    disk, once (an output in its parts folder, an intermediate in scratch), against what is free
    there and what this config's parts and scratch folders hold already (an older run's, which
    this one replaces, or a checkpoint's, which it goes on from). A lower bound of what the run
    writes, so a run it refuses would fill its disk for certain, after computing until then."""
    need: dict[int, list] = {}  # device -> [bytes, a folder on it]
    counted = set()
    for name in sorted({name for nest in plan.nests for name in stores(nest.body)}):
        t = plan.tensors[name]
        folder = parts_dir(Path(t.output["file"])) if t.role == "output" else Path(plan.scratch)
        there = safepaths.nearest_existing(folder)
        held = need.setdefault(os.stat(there).st_dev, [0, there])
        held[0] += math.prod(t.shape) * t.itemsize
        if folder not in counted and safepaths.is_owned(folder):
            counted.add(folder)
            held[0] -= sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
    for wanted, there in need.values():
        free = shutil.disk_usage(there).free
        if wanted > free:
            raise ChainexecError(f"the run stores {format_size(wanted)} of tensors on this file system and "
                                 f"{format_size(free)} are free: it would fill the disk before it ends", str(there))


def remove_outputs(files) -> None:
    """Remove the older outputs and report files of these names (rank 0, once every check of the
    run has passed and its backend has started, just before it makes its folders). A run refused
    before then (a bad option, input or plan) leaves them as they were; a run that fails or stops
    after leaves no older result or report that looks like its own. Every file removed is one
    the run writes when it completes, and none the run reads (:func:`chainexec.safepaths.check_run`);
    the outputs' parts folders go in :func:`make_folders`."""
    for path in map(Path, files):
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            raise ChainexecError(f"cannot remove the older file ({err.strerror or err})", str(path)) from None


def make_folders(files, scratch: Path, fresh: bool = False) -> None:
    """Make each output's parts folder and the scratch folder, marked as chainexec's and locked
    for this process (:func:`chainexec.safepaths.make_owned`, :func:`~chainexec.safepaths.lock_owned`;
    rank 0, once every check of the run has passed).
    ``fresh`` (a run that resumes no checkpoint): first move the parts folders an older run left
    aside, removed there while this run goes on (:func:`chainexec.safepaths.remove_owned_aside`),
    so that their shards do not stay beside this run's."""
    for folder, what in [(parts_dir(Path(f)), safepaths.parts_made(Path(f))) for f in files] + [
            (Path(scratch), safepaths.SCRATCH)]:
        try:
            if fresh and folder != Path(scratch):
                safepaths.remove_owned_aside(folder, what)
            safepaths.make_owned(folder, what)
            safepaths.lock_owned(folder, what)
        except OSError as err:
            raise ChainexecError(f"cannot make this folder ({err.strerror or err})", str(folder)) from None
    for f in map(Path, files):
        remove_stale_temporaries(f)


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
"""The bytes every HDF5 file begins with."""


def remove_stale_temporaries(output_file: Path) -> None:
    """Remove the temporary files an earlier run killed at once (SIGKILL, a node's loss) left
    beside ``output_file`` while writing it (``.NAME.XXXXXXXX.tmp``,
    :func:`chainexec.atomicfile.replacing`), which nothing else removes: called once this run
    holds the output's parts folder, so no other run is writing it. Only HDF5 files of that
    name go (or empty ones, killed before their first byte): a user's file is neither."""
    try:
        entries = list(os.scandir(output_file.parent))
    except OSError:
        return
    for entry in entries:
        if atomicfile.replaced(entry.name) != output_file.name or not entry.is_file(follow_symlinks=False):
            continue
        try:
            with open(entry.path, "rb") as f:
                if f.read(len(HDF5_SIGNATURE)) in (HDF5_SIGNATURE, b""):
                    os.unlink(entry.path)
        except OSError:
            continue


def discard_folders(files, scratch: Path) -> None:
    """What a run that failed once it had begun leaves that nothing can use (rank 0, once every
    rank is past the failure; a run given no checkpoint): the parts folder of each output file
    not written, moved aside and removed there
    (:func:`chainexec.safepaths.remove_owned_aside`), and the scratch folder, removed (or
    emptied) as a finished run removes it (:func:`chainexec.safepaths.remove_owned`). An output
    file that exists is this run's, complete (the older ones went before it began), and its
    parts folder holds its values. A parts folder that cannot be moved aside (a
    full disk, where no folder can be made beside it; a mount point) is removed where it lies,
    if this process holds it still (:func:`chainexec.safepaths.lock_owned`)."""
    for path in map(Path, files):
        if not path.exists():
            folder = parts_dir(path)
            try:
                safepaths.remove_owned_aside(folder)
            except ChainexecError:
                with contextlib.suppress(ChainexecError, OSError):
                    safepaths.lock_owned(folder, "the parts folder")
                    safepaths.remove_owned(folder)
    safepaths.remove_owned(Path(scratch))


def parts_dir(output_file: Path) -> Path:
    return safepaths.parts_of(Path(output_file))


def version_base(plan: Plan, t: TensorInfo, version: int) -> Path:
    """Where version ``version`` of tensor ``t`` lies: its folder of shards and, with ``.h5``
    added, its VDS (an output's in its parts folder, anything else's in scratch)."""
    folder = parts_dir(Path(t.output["file"])) if t.role == "output" else Path(plan.scratch)
    return folder / f"{t.name}.v{version}"


def write_random_inputs(plan: Plan, rows_per_block: int = 1 << 16) -> list[str]:
    """``chainexec generate``: write every input that has a file and a seed, block by block.
    Every seed is checked first; each file is then written as a copy under a temporary name
    (keeping the datasets the config does not write), and once every file is written they are
    renamed into place, so that a failure (a full disk at the last file, a bad dataset name)
    leaves every file as it was: no config's inputs half there, which ``generate --missing``
    refuses to complete. An existing file is held open for reading from before its copy until
    its copy has replaced it: HDF5's file lock then refuses a writer meanwhile (whose writes the
    copy would not hold), and a file a writer holds already is refused."""
    inputs = [t for t in plan.tensors.values() if t.from_file()]
    for t in inputs:
        if "seed" not in t.source:
            raise ChainexecError(f"tensor {t.name} has no seed, so `chainexec generate` cannot write it",
                                 t.source["file"])
    by_file: dict[Path, list[TensorInfo]] = {}  # a link to the inputs: they are written where it points
    for t in inputs:
        by_file.setdefault(Path(os.path.realpath(t.source["file"])), []).append(t)
    written = []
    file = None
    try:
        with contextlib.ExitStack() as renamed:  # every file renamed into place once all are written
            for path, group in by_file.items():
                file = group[0].source["file"]
                path.parent.mkdir(parents=True, exist_ok=True)
                held = renamed.enter_context(h5py.File(path, "r")) if path.exists() else None
                tmp = renamed.enter_context(atomicfile.replacing(path))
                if held is not None:
                    shutil.copyfile(path, tmp)
                    shutil.copymode(path, tmp)
                with h5py.File(tmp, "a") as f:
                    for t in group:
                        _write_random(f, t, rows_per_block)
                written += [f"{t.source['file']}:{t.source['dataset']}" for t in group]
    except (OSError, RuntimeError) as failed:
        # h5py's close of a file whose write failed (a full disk, the file size limit) can raise a
        # RuntimeError of its own ("unable to extend file properly") over the OSError that says why
        err = failed if isinstance(failed, OSError) else failed.__context__
        if not isinstance(err, OSError):
            raise
        refusal = datafiles.lock_refusal(err)
        if refusal is not None:
            raise ChainexecError(refusal, file) from None
        raise ChainexecError(f"cannot write the inputs ({err.strerror or err})", file) from None
    return written


def _write_random(f: h5py.File, t: TensorInfo, rows_per_block: int) -> None:
    """Tensor ``t``'s seeded values into dataset ``t.source["dataset"]`` of the open file ``f``:
    over the values of a dataset of that name and of ``t``'s shape and type (HDF5 does not reuse
    a deleted dataset's space, and a file generated again with new seeds would grow by its inputs
    each time), else in place of it; refused where the name is a group's (its datasets are the
    user's) or lies below a dataset's."""
    name = t.source["dataset"]
    on_the_way = []
    for at, link in datafiles.links_on_the_way(f, name):  # each checked before the walk goes on
        on_the_way.append(at)
        # a link HDF5 cannot follow (to a file or object not there) reads as a KeyError; one to
        # another file would have the values written there in place, outside the copy renamed
        # into place (a failure later would leave that file half written)
        where = f"{at!r} (on the way to dataset {name!r} of tensor {t.name})"
        if isinstance(link, h5py.SoftLink):
            try:
                f[at]  # followed here, where it leads nowhere
            except (KeyError, RuntimeError, OSError) as err:
                link = err
        if isinstance(link, Exception):
            raise ChainexecError(f"{where} is a link HDF5 cannot follow ({link.args[0] if link.args else link}); "
                                 "`chainexec generate` writes only over datasets: remove the link or name another "
                                 "dataset", t.source["file"]) from None
        if isinstance(link, h5py.ExternalLink):
            raise ChainexecError(f"{where} is an external link to {link.filename}:{link.path}, whose file `chainexec "
                                 "generate` would write in place, not as a copy renamed into place: name that file "
                                 "as the source", t.source["file"])
    for at in on_the_way[:-1]:
        above = f.get(at)
        if above is not None and not isinstance(above, h5py.Group):
            raise ChainexecError(f"dataset {name!r} of tensor {t.name} would lie below {at!r}, which is a dataset",
                                 t.source["file"])
    if name in f:
        if not isinstance(f[name], h5py.Dataset):
            raise ChainexecError(f"{name!r} (dataset of tensor {t.name}) is a group of this file; `chainexec "
                                 "generate` writes only over datasets: name another", t.source["file"])
    ds = f.get(name)
    if ds is not None and (ds.shape, ds.dtype) != (tuple(t.shape), np.dtype(t.dtype)):
        del f[name]
        ds = None
    if ds is None:
        ds = f.create_dataset(name, shape=tuple(t.shape), dtype=t.dtype)
    if ds.attrs.get("indices") != ",".join(t.indices):  # (an attribute set again takes new space too)
        ds.attrs["indices"] = ",".join(t.indices)
    rows = max(1, rows_per_block // max(1, int(np.prod(t.shape[1:], dtype=np.int64))))
    first = t.shape[0] if t.shape else 1
    for lo in range(0, first, rows):
        region = ((lo, min(lo + rows, first)),) + tuple((0, n) for n in t.shape[1:])
        data = generator.block(t.source["seed"], tuple(t.shape), region[: len(t.shape)], t.dtype,
                               t.source.get("permutations", ()))
        ds[tuple(slice(a, b) for a, b in region[: len(t.shape)])] = data


SMALL_READ = 1 << 20
"""Bytes up to which :func:`_read` reads through h5py's indexing (its selection made in C, several
times faster a call) and copies, rather than through ``read_direct`` (its selection made in
Python, but straight into the destination: no temporary, which beyond this size costs more)."""


def _read(dataset: h5py.Dataset, source, out: np.ndarray, target) -> None:
    """``out[target] = dataset[source]`` (``source`` and ``target`` slices of equal shape, or
    ``np.s_[()]`` and ``...`` for a 0-d dataset)."""
    into = out[target]
    if into.nbytes <= SMALL_READ:
        out[target] = dataset[source]
    elif into.flags.c_contiguous:
        dataset.read_direct(out, source_sel=source, **({} if target is ... else {"dest_sel": target}))
    else:
        part = np.empty(into.shape, out.dtype)
        dataset.read_direct(part, source_sel=source)
        out[target] = part


class Store:
    """One rank's view of the disk level during a run.

    ``read`` fills a buffer from an input or a stored version; ``write`` adds a block to this rank's
    shard of a version; ``seal`` makes the blocks written so far durable (checkpoints);
    ``close_version`` (collective) joins a version's blocks into a VDS; ``finish`` (collective)
    renames complete outputs into place and removes scratch.
    """

    def __init__(self, plan: Plan, comm):
        self.plan = plan
        self.comm = comm
        self.readers: dict[str, h5py.File] = {}
        self.datasets: dict[tuple[str, str], h5py.Dataset] = {}  # (path, name): opened once (_dataset)
        self.sources: dict[str, object] = {}  # computed inputs' sources, made on first read (computed)
        # Open shard files by stripe, and blocks written so far as (stripe, dataset, region), per
        # (tensor, version) being written.
        self.shards: dict[tuple[str, int], dict[int, h5py.File]] = {}
        self.blocks: dict[tuple[str, int], list[tuple[int, str, tuple[tuple[int, int], ...]]]] = {}
        # Blocks in sealed shard files, [file, dataset, region] each, per (tensor, version) being written.
        self.sealed: dict[tuple[str, int], list[list]] = {}
        # The shard files this rank sealed since the last checkpoint took them, path -> record
        # (fileid.identity): what a resumed run checks them against.
        self.sealed_files: dict[str, dict] = {}
        self.last_version: dict[str, int] = {}
        self.joined: dict[str, list] = {}  # rank 0: each tensor's latest blocks, per rank, [file, dataset, region] each
        self.maps: dict[str, tuple] = {}  # a version's VDS file: its blocks' bounds, files and datasets
        # Elements of each output that this rank wrote and that are not finite (inf, NaN).
        self.nonfinite: dict[str, int] = {t: 0 for t, info in plan.tensors.items() if info.role == "output"}
        self.superseded: list[tuple[str, int]] = []  # closed durably, dropped after the next checkpoint
        # The versions the last committed checkpoint names: each tensor's latest closed one, and
        # those it records as being written (their sealed blocks).
        self.committed: set[tuple[str, int]] = set()

    def _version_base(self, t: TensorInfo, version: int) -> Path:
        return version_base(self.plan, t, version)

    def read(self, tensor: str, version: int, region: tuple[tuple[int, int], ...], out: np.ndarray) -> None:
        t = self.plan.tensors[tensor]
        if version == 0 and "random" in t.source:
            out[...] = generator.block(t.source["random"], tuple(t.shape), region, t.dtype,
                                       t.source.get("permutations", ()))
            return
        if version == 0 and "compute" in t.source:
            source = self.sources.get(tensor)
            if source is None:
                source = self.sources[tensor] = computed(t)
            rows = region[0] if region else (0, 1)
            into = out if whole_rows(region, tuple(t.shape)) and out.flags.c_contiguous else None
            got = source.values(rows, into)
            if got is not out:
                out[...] = got[(slice(None),) + tuple(slice(a, b) for a, b in region[1:])]
            return
        if version == 0:
            path, name = t.source["file"], t.source["dataset"]
        else:
            path, name = str(self._version_base(t, version)) + ".h5", "data"
        sel = tuple(slice(a, b) for a, b in region)
        if not out.size:
            return
        if version and region:
            self._read_blocks(path, self._dataset(path, name), region, out)
            return
        try:
            _read(self._dataset(path, name), sel if sel else np.s_[()], out, ...)
        except OSError as err:
            if version:
                raise
            raise ChainexecError(f"cannot read dataset {name!r} (input of tensor {tensor}): {err}", path) from None

    def _dataset(self, path: str, name: str) -> h5py.Dataset:
        """Dataset ``name`` of the file at ``path``, opened once: an open costs about as much as a
        small read, and a version read back in thousands of tiles reads each of its blocks many
        times."""
        found = self.datasets.get((path, name))
        if found is None:
            f = self.readers.get(path)
            if f is None:
                f = self.readers[path] = h5py.File(path, "r")
            found = self.datasets[(path, name)] = f[name]
        return found

    def mapped(self, tensor: str, version: int, region: tuple[tuple[int, int], ...], rank: int = 0,
               size: int = 1) -> MappedArray | None:
        """The tile ``region`` of an input's source as a read-only mapping of its file
        (:mod:`chainexec.runtime.mapped`) where its bytes lie there as the tile (version 0 from
        a file, a contiguous dataset of the tensor's dtype, whole rows), as ``rank`` of ``size``
        ranks of one host holds it; else None, also where the file cannot be mapped (the tile is
        then read; on several ranks every rank's is, :meth:`chainexec.runtime.buffers.Buffers.alloc`)."""
        t = self.plan.tensors[tensor]
        if version != 0 or not t.source or "file" not in t.source or not region:
            return None
        if not whole_rows(region, t.shape) or region[0][1] <= region[0][0]:
            return None
        path = t.source["file"]
        dtype = np.dtype(t.dtype)
        offset = contiguous_offset(self._dataset(path, t.source["dataset"]), dtype, path)
        if offset is None:
            return None
        row = math.prod(t.shape[1:]) * dtype.itemsize
        if offset + region[0][1] * row > os.path.getsize(path):
            return None  # a file shorter than its dataset: HDF5's read reports it (a mapping would fault)
        try:
            return MappedArray(path, offset + region[0][0] * row, box_shape(region), dtype, rank, size)
        except (OSError, ValueError):  # no mapping to be had (descriptors, address space): read instead
            return None

    def _read_blocks(self, path: str, vds: h5py.Dataset, region, out: np.ndarray) -> None:
        """Read ``region`` of a stored version from the blocks behind its VDS, one block at a time.

        Through the VDS, HDF5 scatters each block into ``out`` run by run: when the reader's tile
        and the writer's blocks cut different indices, those runs can be a few elements long (a
        tile of a hundred MB then takes seconds). Here each block's part lands in a contiguous
        buffer first (one read of contiguous rows when the block's leading index is the one cut)
        and NumPy places it; where that part of ``out`` is contiguous itself and large, the read
        goes straight into it (:func:`_read`). A version written in thousands of tiles and read
        back in as many meets tens of blocks per read: the blocks the region meets are found in
        one array comparison over all their bounds, and each block's dataset is opened once
        (:meth:`_dataset`)."""
        found = self.maps.get(path)
        if found is None:
            folder = os.path.dirname(path)
            sources = vds.virtual_sources()
            bounds = np.array([np.stack(m.vspace.get_select_bounds(), axis=1) for m in sources],
                              dtype=np.int64).reshape(len(sources), len(region), 2)
            bounds[..., 1] += 1
            found = self.maps[path] = (bounds, [(os.path.join(folder, m.file_name), m.dset_name) for m in sources])
        bounds, files = found
        wanted = np.array(region, dtype=np.int64).reshape(len(region), 2)
        meets = ((bounds[..., 0] < wanted[:, 1]) & (bounds[..., 1] > wanted[:, 0])).all(axis=1)
        for n in np.flatnonzero(meets):
            (file, name), block = files[n], bounds[n].tolist()
            cut = [(max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(block, region)]
            source = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(cut, block))
            target = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(cut, region))
            _read(self._dataset(file, name), source, out, target)

    def write(self, tensor: str, version: int, region: tuple[tuple[int, int], ...], data: np.ndarray) -> None:
        if data.size == 0:
            return
        key = (tensor, version)
        if key not in self.shards:
            self._version_base(self.plan.tensors[tensor], version).mkdir(parents=True, exist_ok=True)
            self.shards[key] = {}
            self.blocks[key] = []
        if tensor in self.nonfinite:
            self.nonfinite[tensor] += hostcopy.nonfinite(data)
        self.blocks[key] += write_stripes(lambda stripe: self._shard(key, stripe), len(self.blocks[key]), region, data)

    def _shard(self, key: tuple[str, int], stripe: int) -> h5py.File:
        """This rank's open shard file of stripe ``stripe`` of a version being written."""
        f = self.shards[key].get(stripe)
        if f is None:
            base = self._version_base(self.plan.tensors[key[0]], key[1])
            f = self.shards[key][stripe] = h5py.File(base / _shard_name(self.comm.rank, stripe), "w")
        return f

    def seal(self, number: int) -> None:
        """Make this rank's blocks written so far durable, for checkpoint ``number``: close each
        open shard file, sync it and rename it to ``rank<R>[s<S>]-<number>.h5`` (synced in its
        folder), and record its identity (:func:`chainexec.runtime.fileid.identity`, its bytes
        read back once, from the page cache where they still are) in :attr:`sealed_files`; the
        version's next block starts new shard files (:meth:`write`)."""
        for key in list(self.shards):
            base = self._version_base(self.plan.tensors[key[0]], key[1])
            names = {}
            for stripe, f in self.shards.pop(key).items():
                f.close()
                path = base / _shard_name(self.comm.rank, stripe)
                names[stripe] = _shard_name(self.comm.rank, stripe, number)
                sealed = str(base / names[stripe])
                atomicfile.sync(path)
                os.replace(path, sealed)
                self.sealed_files[sealed] = fileid.identity(sealed)
            atomicfile.sync(base)
            self.sealed.setdefault(key, []).extend([names[stripe], name, region]
                                                   for stripe, name, region in self.blocks.pop(key))

    def close_version(self, tensor: str, version: int, durable: bool = False) -> None:
        """Collective: join every rank's blocks of this version into ``<version>.h5`` (a VDS).
        ``durable`` (a run that checkpoints, its blocks sealed): the VDS is synced, and the
        version it supersedes is kept until :meth:`drop_superseded` where the last committed
        checkpoint names it (a run resumed from it reads that version); one no checkpoint names
        is dropped at once, as without checkpoints: a run that closes many versions between two
        checkpoints holds two of each tensor on disk, not every one."""
        key = (tensor, version)
        for shard in self.shards.pop(key, {}).values():
            shard.close()
        current = [[_shard_name(self.comm.rank, stripe), name, region] for stripe, name, region in self.blocks.pop(key, [])]
        gathered = self.comm.gather(self.sealed.pop(key, []) + current, root=0)
        t = self.plan.tensors[tensor]
        base = self._version_base(t, version)
        if self.comm.rank == 0:
            self.joined[tensor] = gathered
            tmp = base.with_name(base.name + ".h5.tmp")
            with h5py.File(tmp, "w") as f:
                f.create_virtual_dataset("data", _layout(t, gathered, base.name), fillvalue=np.nan)
            if durable:
                atomicfile.sync(tmp)
            os.replace(tmp, str(base) + ".h5")
            if durable:
                atomicfile.sync(base.parent)
        barrier(self.comm)
        old = self.last_version.get(tensor)
        self.last_version[tensor] = version
        if old is not None and durable and (tensor, old) in self.committed:
            self.superseded.append((tensor, old))
        elif old is not None:
            self._drop(t, old)

    def drop_superseded(self, writing: list[tuple[str, int]] = ()) -> None:
        """Collective, after a checkpoint is committed (naming the versions now closed and those
        being written, ``writing``): drop the versions :meth:`close_version` kept, which it no
        longer names."""
        for tensor, version in self.superseded:
            self._drop(self.plan.tensors[tensor], version)
        self.superseded = []
        self.committed = set(self.last_version.items()) | set(writing)

    def open_blocks(self, stored: list[tuple[str, int]]) -> list[list]:
        """This rank's sealed blocks of each version in ``stored`` (the versions being written), in
        that order: what a checkpoint records of them."""
        return [self.sealed.get(key, []) for key in stored]

    def resume(self, last_version: dict[str, int], joined: dict[str, list], opened: list[list]) -> None:
        """Collective, before anything runs: take back what a checkpoint recorded — the latest
        closed version of each tensor, rank 0 the block lists of the outputs' ones (for
        :meth:`finish`), and each rank its sealed blocks of every version being written
        (``opened``: [tensor, version, blocks per rank] each). Rank 0 then removes each version
        file the checkpoint does not name (written after it, or superseded before it), so that
        the folders hold only what the resumed run joins."""
        self.last_version = dict(last_version)
        self.committed = set(last_version.items()) | {(tensor, version) for tensor, version, _ in opened}
        for tensor, version, blocks in opened:
            self.sealed[(tensor, version)] = [list(b) for b in blocks[self.comm.rank]]
        if self.comm.rank == 0:
            self.joined = dict(joined)
            named = {(tensor, version): {b[0] for rank in blocks for b in rank} for tensor, version, blocks in opened}
            named |= {(t, v): None for t, v in last_version.items()}
            for t in self.plan.tensors.values():
                if t.role != "input":
                    _prune(self._version_base(t, 1).parent, t.name, named)
        barrier(self.comm)

    def _drop(self, t: TensorInfo, version: int, keep_shards: bool = False) -> None:
        """A superseded version: close readers on it; rank 0 deletes its files once all have."""
        base = self._version_base(t, version)
        self.maps.pop(str(base) + ".h5", None)
        for path in [p for p in self.readers if p == str(base) + ".h5" or p.startswith(str(base) + os.sep)]:
            self.datasets = {k: d for k, d in self.datasets.items() if k[0] != path}
            self.readers.pop(path).close()
        barrier(self.comm)
        if self.comm.rank == 0:
            if not keep_shards:
                shutil.rmtree(base, ignore_errors=True)
            Path(str(base) + ".h5").unlink(missing_ok=True)

    def close(self) -> None:
        """Close every file this rank reads or writes (at the run's end, or a failed run's
        before its folders are removed: a file held open on NFS stays as a ``.nfs`` file and
        keeps its folder); one that fails to close is let go."""
        self.datasets = {}
        self.maps = {}
        files = [*self.readers.values(), *(f for shards in self.shards.values() for f in shards.values())]
        self.readers, self.shards = {}, {}
        for f in files:
            with contextlib.suppress(Exception):
                f.close()

    def finish(self) -> None:
        """Collective, after the last contraction: write each output file complete, then clean up.
        An output holding values that are not finite (inf, NaN: an input holds them, or a
        statement overflows) is not marked complete unless its config allows them
        (``allow_nonfinite``): every rank raises the same :class:`ChainexecError`."""
        outputs = [t for t in self.plan.tensors.values() if t.role == "output"]
        counts = self.comm.allreduce(np.array([self.nonfinite[t.name] for t in outputs], dtype=np.int64))
        bad = [(t, int(n)) for t, n in zip(outputs, counts) if n and not t.output.get("allow_nonfinite")]
        if bad:
            t, n = bad[0]
            raise ChainexecError(
                f"output {t.name} holds {n} values that are not finite (inf or NaN) of {math.prod(t.shape)}, so it "
                f"is not marked complete: an input holds such values or a statement overflows (set allow_nonfinite: "
                f"true on the output where they are expected)", t.output["file"], collective=True)
        for t in outputs:
            self._drop(t, self.last_version[t.name], keep_shards=True)
        self.close()
        if self.comm.rank == 0:
            by_file: dict[str, list[TensorInfo]] = {}
            for t in outputs:
                by_file.setdefault(t.output["file"], []).append(t)
            for path, group in by_file.items():
                # the token in the parts folder before the file that names it appears
                token, parts = secrets.token_hex(16), parts_dir(Path(path))
                if parts.is_dir():
                    atomicfile.write(parts / safepaths.LANDED_FILE, token + "\n")
                with atomicfile.replacing(path) as tmp, h5py.File(tmp, "w") as f:
                    f.attrs[safepaths.LANDED] = token
                    for t in group:
                        base = self._version_base(t, self.last_version[t.name])
                        layout = _layout(t, self.joined[t.name], f"{base.parent.name}/{base.name}")
                        ds = f.create_virtual_dataset(t.output["dataset"], layout, fillvalue=np.nan)
                        ds.attrs["indices"] = ",".join(t.indices)
                        ds.attrs["extents"] = np.array(t.shape, dtype=np.int64)
                    f.attrs[COMPLETE] = True
                stopsignals.landed(path)
            safepaths.remove_owned(Path(self.plan.scratch))
        barrier(self.comm)


def write_stripes(shard, first: int, region: tuple[tuple[int, int], ...], data: np.ndarray) -> list[tuple]:
    """Write the block ``data`` (at ``region`` of its tensor) as :meth:`Store.write` does: cut
    into stripes (:func:`_stripes`), stripe S a dataset of the open HDF5 file ``shard(S)``,
    named ``b<first + S>``, the stripes' bytes written over threads (a thread a file). Each
    stripe's (S, dataset, region)."""
    jobs, written = [], []
    try:
        for stripe, (within, part) in enumerate(_stripes(region, data)):
            f = shard(stripe)
            name = f"b{first + stripe}"
            offset = _dataset(f, name, part)
            if offset is not None:
                jobs.append((os.open(f.filename, os.O_WRONLY), offset, part))
            written.append((stripe, name, within))
        hostcopy.write_files(jobs)
    finally:
        for fd, _, _ in jobs:
            os.close(fd)
    return written


def _shard_name(rank: int, stripe: int, sealed: int | None = None) -> str:
    """The file of ``rank``'s shard holding stripe ``stripe`` of a version's blocks:
    ``rank<R>.h5`` (stripe 0) or ``rank<R>s<S>.h5``; ``rank<R>[s<S>]-<N>.h5`` once sealed at
    checkpoint N (:meth:`Store.seal`)."""
    return f"rank{rank}" + (f"s{stripe}" if stripe else "") + (f"-{sealed}" if sealed is not None else "") + ".h5"


def _stripes(region: tuple[tuple[int, int], ...], data: np.ndarray) -> list[tuple[tuple[tuple[int, int], ...], np.ndarray]]:
    """The block ``data`` at ``region`` as the stripes :meth:`Store.write` puts in files of their
    own, each (its region, its data): cut along the first axis longer than one into at most one
    stripe per thread (:func:`hostcopy.threads`) of at least :data:`hostcopy.PIECE_BYTES`. Data
    that is not C-contiguous in the machine's byte order stays whole (HDF5 writes it)."""
    count = min(hostcopy.threads(), data.nbytes // hostcopy.PIECE_BYTES)
    if count <= 1 or not _raw(data):
        return [(region, data)]
    stripes = []
    for piece in hostcopy.pieces(data.shape, count):
        piece += (slice(None),) * (data.ndim - len(piece))
        bounds = (cut.indices(n)[:2] for cut, n in zip(piece, data.shape))
        stripes.append((tuple((lo + a, lo + b) for (lo, _), (a, b) in zip(region, bounds)), data[piece]))
    return stripes


def _raw(data: np.ndarray) -> bool:
    """Whether ``data``'s bytes, as they lie, are its dataset's in the file: C-contiguous, in the
    machine's byte order."""
    return data.flags.c_contiguous and data.dtype.byteorder in "=|"


def _dataset(f: h5py.File, name: str, data: np.ndarray) -> int | None:
    """Make dataset ``name`` of the open file ``f`` for ``data``: the byte offset in the file
    where the caller writes ``data``'s bytes, or None where HDF5 wrote them. C-contiguous data in
    the machine's byte order goes into a contiguous dataset allocated at once and left unfilled,
    its bytes written straight into the file (:func:`hostcopy.write_files`): HDF5 writes a
    dataset on one thread, through copies of its own. Other data, and data under
    :data:`hostcopy.PIECE_BYTES`, goes through HDF5."""
    if data.nbytes < hostcopy.PIECE_BYTES or not _raw(data):
        f.create_dataset(name, data=data)
        return None
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    ds = f.create_dataset(name, shape=data.shape, dtype=data.dtype, dcpl=dcpl)
    offset = ds.id.get_offset()
    if offset is None:  # no contiguous storage in the file (HDF5 chose another layout)
        ds[...] = data
    return offset


def _layout(t: TensorInfo, gathered: list, prefix: str) -> h5py.VirtualLayout:
    """A VDS layout of tensor ``t`` from each rank's blocks; shard paths relative to the VDS file."""
    layout = h5py.VirtualLayout(shape=tuple(t.shape), dtype=t.dtype)
    for blocks in gathered:
        for file, name, region in blocks:
            shape = box_shape(region)
            src = h5py.VirtualSource(f"{prefix}/{file}", name, shape=shape)
            layout[tuple(slice(a, b) for a, b in region)] = src
    return layout


def _prune(folder: Path, tensor: str, named: dict) -> None:
    """Remove from ``folder`` the version files of ``tensor`` that ``named`` does not keep:
    ``named[(tensor, version)]`` is None for a closed version (kept whole), the shard files to
    keep for a version being written (its VDS, written after the checkpoint, goes too)."""
    found = re.compile(re.escape(tensor) + r"\.v([0-9]+)(\.h5(\.tmp)?)?")
    for path in folder.iterdir() if folder.is_dir() else ():
        match = found.fullmatch(path.name)
        if match is None:
            continue
        key = (tensor, int(match.group(1)))
        if key in named and named[key] is None:
            continue
        if key in named and path.is_dir():
            for shard in path.iterdir():
                if shard.name not in named[key]:
                    shard.unlink()
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
