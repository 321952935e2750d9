"""Paths checked before anything is written or removed, and the folders chainexec owns.

A run reads its config and its input files; it replaces its output files (written as
``<file>.tmp``, renamed into place) and their ``<file>.parts/`` folders, creates and at its end
removes its scratch folder, fills and at its end empties a checkpoint folder, and writes report
files (``--report-json``, ``--plot``). :func:`check_run` resolves every one of these paths
(symbolic links, ``..``, hard links of existing files) before anything is touched and refuses,
with one :class:`ChainexecError`, any overlap that would write over or remove an input, the
config, another output or a folder chainexec did not create.

A folder chainexec creates to remove later carries the mark file :data:`MARK`
(:func:`make_owned`); :func:`remove_owned` removes a folder only where the mark is. A folder that
exists without the mark is used only where it is empty.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from chainexec import atomicfile
from chainexec.errors import ChainexecError

MARK = ".chainexec-owned"
"""The file that marks a folder chainexec made (scratch, an output's parts, a checkpoint)."""

NAME_MAX = 255
"""Bytes in one path component on the file systems chainexec runs on (ext4, XFS, Lustre, GPFS)."""

WRITE_SUFFIXES = (".parts",)
"""What an output's file name gets for its parts folder (its temporary file's name is new:
:func:`chainexec.atomicfile.replacing`)."""

ASIDE = ".old-"
"""What an older parts folder's name gets, with eight random characters, for the folder it is
moved into to be removed (:func:`remove_owned_aside`)."""

PARTS_ASIDE = ".parts" + ASIDE + "XXXXXXXX"
"""The longest an output's file name gets in a run: its parts folder moved aside."""

REPORT_TEMPORARY = "..XXXXXXXX.probe"
"""The most a report file's name gets in a run: the probe that its folder is writable
(``.<name>.XXXXXXXX.probe``, :func:`chainexec.runtime.store.check_writable`); its temporary file
(``<name>.XXXXXXXX.tmp``) gets less."""


def resolved(path: str | os.PathLike) -> Path:
    """``path`` made absolute with every symbolic link and ``..`` resolved (missing parts kept),
    each ``..`` after the link before it (``realpath`` of the path as given: ``abspath`` first
    would read ``link/..`` as text)."""
    return Path(os.path.realpath(path))


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` made absolute, or its nearest parent that exists: where a file or folder not yet
    made will lie (whose file system's free space counts)."""
    path = Path(path).absolute()
    return next(p for p in (path, *path.parents) if p.exists())


def _within(inner: Path, outer: Path) -> bool:
    """Whether ``inner`` is ``outer`` or lies below it."""
    return inner == outer or outer in inner.parents


def same_file(a: Path, b: Path) -> bool:
    """Whether two resolved paths name one file: equal, or hard links of one existing file."""
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


SCRATCH = "scratch of a run"
"""What a run's scratch folder is made as (:func:`make_owned`)."""
CHECKPOINT = "a run's checkpoint"
"""What a checkpoint folder is made as."""

CHECKPOINTED = ".chainexec-checkpoint"
"""The file in a scratch or parts folder that names the checkpoint folder of the run that made it
(:func:`note_checkpoint`): a stopped run's stored versions lie in its scratch and the sealed
shards of its outputs in their parts folders, and its checkpoint names them there."""


LANDED = "chainexec_landed"
"""The attribute of an output file that holds the token its parts folder's :data:`LANDED_FILE`
holds (:meth:`chainexec.runtime.store.Store.finish`, a fresh one per finished run): a copy of
the output file alone still reads the parts folder its datasets name, which a later run fills
with its own values; :func:`landed_elsewhere` tells them apart."""

LANDED_FILE = ".chainexec-landed"
"""The file in an output's parts folder holding the token of the run that filled it (:data:`LANDED`)."""


def landed_elsewhere(token, sources: list[str]) -> Path | None:
    """The parts folder among the folders above ``sources`` (the files an output's datasets
    read) whose :data:`LANDED_FILE` holds another token than ``token`` (the output file's
    :data:`LANDED` attribute): a run after the one that wrote the file put its values there.
    None where they match, or where either holds no token."""
    if token is None:
        return None
    for source in sources:
        for folder in list(Path(source).parents)[:3]:
            try:
                found = (folder / LANDED_FILE).read_text().strip()
            except (OSError, UnicodeDecodeError):
                continue
            if found != str(token):
                return folder
            break
    return None


def note_checkpoint(folder: Path, checkpoint: Path) -> None:
    """Record in ``folder`` (the scratch or an output's parts folder) that the run checkpointed in
    ``checkpoint`` keeps files there (rank 0, once the folder is made): another config's run
    given the same folder (one of the same ``name:``, or writing the same output) would remove
    them, and the checkpoint would name missing files."""
    atomicfile.write(Path(folder) / CHECKPOINTED, str(resolved(checkpoint)) + "\n")


def _check_folders_free(paths: "RunPaths") -> None:
    """Refuse a scratch or parts folder that holds the files of a stopped run other than this
    one's (:func:`note_checkpoint`), while that run's checkpoint folder is there to resume from."""
    for folder, what, made in paths.removed():
        try:
            noted = Path((folder / CHECKPOINTED).read_text().strip())
        except (OSError, UnicodeDecodeError):
            continue
        if made != CHECKPOINT and noted != paths.checkpoint and is_owned(noted) and owner(noted) == CHECKPOINT:
            held, instead = (("stored versions", "give this config another name: or scratch:") if made == SCRATCH
                             else ("output shards", "name another output file"))
            raise ChainexecError(f"{what} holds the {held} of the stopped run checkpointed in {noted}, which this run "
                                 f"would remove: resume that run (--checkpoint {noted}), remove that checkpoint "
                                 f"folder, or {instead}", str(folder))


def parts_made(output_file: Path) -> str:
    """What the parts folder of ``output_file`` is made as."""
    return f"the shard files of {Path(output_file).name}"


def is_owned(folder: Path) -> bool:
    return (Path(folder) / MARK).is_file()


def owner(folder: Path) -> str | None:
    """What chainexec made the marked ``folder`` as (``what`` of :func:`make_owned`: :data:`SCRATCH`,
    :data:`CHECKPOINT`, :func:`parts_made`), from its mark's first line; None where the mark is
    missing, cannot be read or is not one :func:`make_owned` wrote."""
    first = _mark_line(folder)
    if first is None:
        return None
    for ending in (_REMOVED, _EMPTIED):
        head, ended, _ = first.partition(ending)
        if ended and head.startswith("made by chainexec: "):
            return head.removeprefix("made by chainexec: ")
    return None


_REMOVED = "; removed by chainexec when done"
"""How a mark ends on a folder chainexec created: :func:`remove_owned` removes the folder."""
_EMPTIED = "; emptied by chainexec when done"
"""How a mark ends on a user's empty folder that chainexec was given (a scratch folder the user
made, a mount point, a job's ``$TMPDIR``): :func:`remove_owned` empties it and leaves it."""


def adopted(folder: Path) -> bool:
    """Whether the marked ``folder`` is a user's, given empty (:data:`_EMPTIED`)."""
    return (_mark_line(folder) or "").endswith(_EMPTIED)


def _mark_line(folder: Path) -> str | None:
    """The first line of ``folder``'s mark; None where it cannot be read."""
    try:
        return (Path(folder) / MARK).read_text(errors="replace").partition("\n")[0]
    except OSError:
        return None


def make_owned(folder: Path, what: str) -> None:
    """Create ``folder`` (and its parents; where it is a symbolic link, the folder it names) and
    mark it as chainexec's, made as ``what`` (:func:`owner`); an existing folder must carry the
    mark already or be empty (:func:`check_run` has checked this): an empty one is the user's,
    marked to be emptied, not removed, when done."""
    folder = resolved(folder)
    existed = folder.is_dir()
    folder.mkdir(parents=True, exist_ok=True)
    if not is_owned(folder):
        _mark(folder, what, _EMPTIED if existed else _REMOVED)


def _mark(folder: Path, what: str, ending: str) -> None:
    """Write ``folder``'s mark: made as ``what``, removed or emptied when done (``ending``)."""
    (folder / MARK).write_text(f"made by chainexec: {what}{ending}\n")


_held: dict[Path, int] = {}
"""Marked folders this process has locked (:func:`lock_owned`), with their mark's descriptor."""


def lock_owned(folder: Path, what: str) -> None:
    """Lock the marked ``folder`` for this process until it exits or calls :func:`unlock`
    (a POSIX record lock on its mark file, which NFS and Lustre honour, and which goes with the
    process also when it is killed): a second run given the same folder (a checkpoint, the
    scratch or parts folder of a run whose config has the same name or output) is refused
    instead of mixing its files with this run's. A folder made again since it was locked (moved
    aside and marked anew) is locked again. Raises ChainexecError naming the folder and the
    process that holds it."""
    folder = resolved(folder)
    mark = folder / MARK
    held = _held.get(folder)
    if held is not None:
        if os.path.exists(mark) and os.fstat(held).st_ino == os.stat(mark).st_ino:
            return
        os.close(_held.pop(folder))
    fd = os.open(mark, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").partition("held by ")[2].strip()
        os.close(fd)
        raise ChainexecError(f"{what} in use by another run{f' ({holder})' if holder else ''}", str(folder)) from None
    os.pwrite(fd, f"\nheld by pid {os.getpid()} on {socket.gethostname()}\n".encode(), os.fstat(fd).st_size)
    _held[folder] = fd


def unlock(folder: Path) -> None:
    """Let the lock on ``folder`` go (a folder about to be removed)."""
    fd = _held.pop(resolved(folder), None)
    if fd is not None:
        os.close(fd)


def remove_owned(folder: Path) -> None:
    """Remove ``folder`` with everything in it, only where it carries chainexec's mark (its
    lock let go first: a file held open on NFS would stay as a ``.nfs`` file and keep it); a
    user's folder given empty (:func:`adopted`) is emptied, its mark last, and stays. A
    symbolic link is followed, as :func:`make_owned` follows it to mark the folder it names:
    that folder is removed or emptied, and the link stays."""
    folder = resolved(folder)
    if not is_owned(folder):
        return
    unlock(folder)
    if not adopted(folder):
        shutil.rmtree(folder, ignore_errors=True)
        return
    for entry in folder.iterdir():
        if entry.name == MARK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
    with contextlib.suppress(OSError):
        (folder / MARK).unlink()


_REMOVING: list[threading.Thread] = []
"""The threads of :func:`remove_owned_aside` calls (:func:`wait_removals` waits for them)."""


def wait_removals() -> None:
    """Wait until every folder :func:`remove_owned_aside` moved aside is removed: a process that
    ends without the interpreter's exit (:func:`chainexec.runtime.comm.end`) calls it first."""
    while _REMOVING:
        _REMOVING.pop().join()


def remove_owned_aside(folder: Path, what: str = "the parts folder") -> threading.Thread | None:
    """:func:`remove_owned` without waiting for it: the marked ``folder`` (followed where it is
    a symbolic link) is renamed at once into a new marked folder beside it,
    ``<name>.old-XXXXXXXX``, and removed there by a thread that the process waits for before it
    exits (:func:`wait_removals`). Removing tens of GB of files whose pages the kernel is still
    writing back waits for that writeback, and the run that replaces them goes on meanwhile.
    The thread removes this folder first, then what a process stopped during its removal left
    of earlier ones (folders of that pattern that still carry the mark, which goes last); one
    it cannot remove stays for the next. The folder is locked for this process until it is
    moved (:func:`lock_owned`), so that a folder another running process holds (another
    config's run writing the same output file, begun at the same moment) is refused, not moved
    from under it (``what`` names it in the error). A user's folder given empty
    (:func:`adopted`) is emptied where it is instead. Returns the thread, None where ``folder``
    is not chainexec's or was emptied in place.

    Raises:
        ChainexecError: another run holds the folder; or it cannot be moved (a mount point, a
            full disk); nothing is left beside it.
    """
    folder = resolved(folder)
    if not is_owned(folder):
        return None
    lock_owned(folder, what)
    if adopted(folder):
        remove_owned(folder)
        return None
    try:
        aside = Path(tempfile.mkdtemp(prefix=folder.name + ASIDE, dir=folder.parent))
        try:
            _mark(aside, f"an older {folder.name} being removed", _REMOVED)  # made by mkdtemp: removed whole
            os.rename(folder, aside / folder.name)
        except OSError:
            shutil.rmtree(aside, ignore_errors=True)
            raise
    except OSError as err:
        raise ChainexecError(f"cannot move the parts folder aside to remove it ({err.strerror or err})",
                             str(folder)) from None
    finally:
        unlock(folder)
    found = [aside] + [p for p in folder.parent.glob(glob.escape(folder.name + ASIDE) + "*")
                       if p != aside and _left_aside(p, folder.name)]

    def remove() -> None:
        for old in found:  # each holds its mark and at most the parts folder (_left_aside)
            try:
                if (old / folder.name).is_dir():
                    shutil.rmtree(old / folder.name)
                shutil.rmtree(old)
            except OSError:
                continue

    thread = threading.Thread(target=remove, name=f"chainexec-remove-{folder.name}")
    thread.start()
    _REMOVING[:] = [t for t in _REMOVING if t.is_alive()] + [thread]  # a long process runs many
    return thread


def _left_aside(path: Path, name: str) -> bool:
    """Whether ``path`` is a folder :func:`remove_owned_aside` made for a parts folder ``name``
    and did not finish removing: named ``<name>.old-`` and the eight characters ``mkdtemp``
    adds, not a link, marked, and holding nothing but its mark and ``<name>`` (another output's
    parts folder may begin with the same name, as ``<name>.old-x.h5.parts``)."""
    if not re.fullmatch(re.escape(name + ASIDE) + r"[a-z0-9_]{8}", path.name) or path.is_symlink():
        return False
    try:
        return is_owned(path) and {entry.name for entry in path.iterdir()} <= {MARK, name}
    except OSError:
        return False


def _check_owned_folder(folder: Path, what: str, made_as: str) -> None:
    """A folder chainexec will fill and remove or empty: absent, or a folder that is empty or
    that chainexec marked as made for this use (``made_as``, :func:`owner`): not another run's
    folder of another kind (a checkpoint given as scratch, an output's parts folder as another's
    checkpoint), which the run would remove with what it holds."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ChainexecError(f"{what} must be a folder, and this is a file", str(folder))
    try:
        owned, empty = is_owned(folder), not any(folder.iterdir())
    except OSError as err:
        raise ChainexecError(f"{what} cannot be read ({err.strerror or err}): chainexec must see what it holds "
                             "before it removes or fills it", str(folder)) from None
    if not owned and not empty:
        raise ChainexecError(f"{what} exists and holds files chainexec did not make, which a run could remove "
                             "or write over: name a new or empty folder", str(folder))
    made = owner(folder) if owned else made_as
    if made != made_as:
        raise ChainexecError(f"{what} is a folder chainexec made "
                             + (f"as {made}" if made else "for another use (its mark cannot be read)")
                             + ", which this run would remove or write over: name a new or empty folder", str(folder))


def _inside_owned(path: Path) -> Path | None:
    """The nearest folder above ``path`` that chainexec marked as its own (:func:`is_owned`), which
    the run or config that made it removes with everything in it; None where there is none."""
    return next((p for p in path.parents if is_owned(p)), None)


PATH_MAX = 4096
"""Bytes in a whole path the operating system accepts (Linux's ``PATH_MAX``)."""


def checked(path: str | os.PathLike, what: str) -> str | os.PathLike:
    """``path`` as given, refused (naming ``what`` it is) where no file system could hold it: a
    NUL byte, a component longer than :data:`NAME_MAX` bytes or the whole longer than
    :data:`PATH_MAX`. Checked before anything looks the path up, where the operating system's
    error would otherwise be the first word on it."""
    text = os.fsencode(path)
    shown = os.fsdecode(text).replace("\0", "\\0")
    if b"\0" in text:
        raise ChainexecError(f"{what}: the path holds a NUL byte, which no file name can", shown)
    if len(text) > PATH_MAX or any(len(part) > NAME_MAX for part in text.split(b"/")):
        raise ChainexecError(f"{what}: a file name in this path is longer than the file system's {NAME_MAX} bytes, "
                             f"or the path longer than {PATH_MAX}", shown[:200] + ("..." if len(shown) > 200 else ""))
    return path


def _check_name_lengths(path: Path, suffixes: tuple[str, ...] = ()) -> None:
    """Every component of ``path``, and its last one with the longest of ``suffixes`` added, fits
    in :data:`NAME_MAX` bytes (found now, not when the run writes its first file)."""
    extra = max(map(len, suffixes), default=0)
    if any(len(os.fsencode(part)) > NAME_MAX for part in path.parts) or len(os.fsencode(path.name)) + extra > NAME_MAX:
        raise ChainexecError(f"a file name in this path is longer than the file system's {NAME_MAX} bytes"
                             + (f" (with the {' or '.join(suffixes)} chainexec adds)" if suffixes else ""), str(path))


@dataclass
class RunPaths:
    """Every path a run reads, writes or removes, resolved (:func:`resolved`)."""

    config: Path
    inputs: dict[Path, str] = field(default_factory=dict)  # file -> tensor that reads it
    outputs: dict[Path, str] = field(default_factory=dict)  # file -> tensor(s) written to it
    scratch: Path = Path()
    checkpoint: Path | None = None
    reports: dict[Path, str] = field(default_factory=dict)  # file -> the option that names it
    machine: Path | None = None  # the machine file read for its rates

    @classmethod
    def of(cls, spec, checkpoint=None, reports: dict[str, str | None] | None = None,
           machine: str | None = None) -> "RunPaths":
        """The paths of ``spec``'s run (and of the machine file it reads, ``machine``), each
        refused first where no file system could hold it (:func:`checked`)."""
        paths = cls(resolved(spec.path), scratch=resolved(checked(spec.resolve(spec.scratch), "scratch")))
        if machine is not None:
            paths.machine = resolved(checked(machine, "the machine file"))
        for t in spec.tensors.values():
            if t.source is not None and t.source.file is not None:
                file = checked(spec.resolve(t.source.file), f"the input of tensor {t.name}")
                paths.inputs.setdefault(resolved(file), t.name)
                for other in _linked(file, t.source.dataset)[1:]:
                    paths.inputs.setdefault(resolved(other), f"{t.name} (through {Path(file).name})")
        for o in spec.outputs:
            file = resolved(checked(spec.resolve(o.file), f"the output of {o.tensor}"))
            paths.outputs[file] = ", ".join(filter(None, (paths.outputs.get(file), o.tensor)))
        if checkpoint is not None:
            paths.checkpoint = resolved(checked(checkpoint, "--checkpoint"))
        for option, path in (reports or {}).items():
            if path is not None:
                file = resolved(checked(path, option))
                if file in paths.reports:
                    raise ChainexecError(f"{option} names the file {paths.reports[file]} names: one would replace "
                                         "the other", str(file))
                paths.reports[file] = option
        return paths

    def removed(self) -> list[tuple[Path, str, str]]:
        """Folders the run removes whole (each output's parts folder, scratch) or fills and
        empties (the checkpoint), each with what it is and what chainexec makes it as
        (:func:`make_owned`)."""
        folders = [(resolved(parts_of(f)), f"the parts folder of output {t}", parts_made(f))
                   for f, t in self.outputs.items()]
        folders.append((self.scratch, "the scratch folder", SCRATCH))
        if self.checkpoint is not None:
            folders.append((self.checkpoint, "the checkpoint folder", CHECKPOINT))
        return folders

    def lock(self) -> None:
        """Lock each of :meth:`removed`'s folders that exists and is chainexec's
        (:func:`lock_owned`), before anything is removed: a run whose folders another running
        one holds is refused, and removes none of its files."""
        for folder, what, _ in self.removed():
            if is_owned(folder):
                lock_owned(folder, what)

    def unlock(self) -> None:
        """Let go the locks :meth:`lock` and the run took on :meth:`removed`'s folders."""
        for folder, _, _ in self.removed():
            unlock(folder)

    def read(self) -> list[tuple[Path, str]]:
        """Files the run must leave as they are (config, inputs, machine file), each with what
        it is."""
        return ([(self.config, "the config")]
                + [(f, f"the input of tensor {t}") for f, t in self.inputs.items()]
                + [(self.machine, "the machine file")] * (self.machine is not None))

    def written(self) -> list[tuple[Path, str]]:
        """Files the run writes (outputs, then reports), each with what it is."""
        return ([(f, f"the output of {t}") for f, t in self.outputs.items()]
                + [(f, f"the file of {o}") for f, o in self.reports.items()])

    def kept(self) -> list[tuple[Path, str]]:
        """:meth:`read` then :meth:`written` (one file may stand in several roles: that is what is
        checked)."""
        return self.read() + self.written()


def _linked(file, dataset: str | None) -> list[str]:
    """The files the values of ``dataset`` in ``file`` come from (:func:`chainexec.datafiles.of`);
    only ``file`` where they cannot be read yet (what is wrong with them is found and said when
    the inputs are checked)."""
    from chainexec import datafiles

    try:
        return datafiles.of(str(file), dataset) if dataset is not None and os.path.isfile(file) else [str(file)]
    except (OSError, KeyError, ValueError, TypeError, RuntimeError):
        return [str(file)]


def parts_of(output_file: Path) -> Path:
    """The folder of an output's shard files, beside it."""
    return output_file.with_name(output_file.name + ".parts")


def check_run(spec, checkpoint=None, reports: dict[str, str | None] | None = None,
              machine: str | None = None) -> RunPaths:
    """Refuse, before anything is written, every path of a run that would destroy what it must
    not (a :class:`ChainexecError` naming the path): an output that is a symbolic link (the older
    output removed would be the file it points to, the new one written in its place); an output
    or its parts folder equal to an input or a file an input's values come from
    (:func:`chainexec.datafiles.of`), the config, the machine file ``machine``, a report file or
    another output's; an existing
    output that is not a file chainexec wrote; scratch, parts or checkpoint folders that exist with
    files chainexec did not make or that chainexec made for another use, that hold or lie inside
    one another, or that hold the config, an input, an output or a report file; an output, a
    report file or one of those folders inside a folder chainexec made (another run's parts,
    scratch or checkpoint folder, removed with what it holds); a report file in a folder that
    does not exist; a file name too long for the file system. Returns the resolved paths."""
    paths = RunPaths.of(spec, checkpoint, reports, machine)
    for o in spec.outputs:
        if os.path.islink(spec.resolve(o.file)):
            raise ChainexecError(f"the output of {o.tensor} is a symbolic link (to {os.readlink(spec.resolve(o.file))}); "
                                 "chainexec replaces an output whole: name the file itself or another",
                                 str(spec.resolve(o.file)))
    kept = paths.kept()
    _check_written(paths.written(), paths.read(), paths.outputs)
    for f, what in paths.outputs.items():
        if f.exists() and not _is_chainexec_output(f):
            raise ChainexecError(f"the output of {what} exists and is not an output chainexec wrote; "
                                 "chainexec replaces only its own: move it or name another file", str(f))
        added = _added(f) if f.exists() else None
        if added is not None:
            raise ChainexecError(f"the output of {what} is one chainexec wrote, and holds {added} that chainexec did "
                                 "not write, which replacing the file would lose: move it or name another file", str(f))
    _check_report_folders(paths)
    folders = paths.removed()
    for k, (folder, what, made_as) in enumerate(folders):
        _check_owned_folder(folder, what, made_as)
        _check_name_lengths(folder)
        for g, other in kept:
            if _within(g, folder) or _within(folder, g):
                raise ChainexecError(f"{what} would hold {other} ({g}); chainexec empties it", str(folder))
        for j, (other_folder, other, _) in enumerate(folders):
            if j != k and (_within(other_folder, folder) or (j < k and other_folder == folder)):
                raise ChainexecError(f"{what} would hold {other}", str(folder))
    written = paths.written() + [(folder, what) for folder, what, _ in folders]
    _check_not_inside_owned(written)
    _check_folders_free(paths)
    return paths


def _check_not_inside_owned(written: list[tuple[Path, str]]) -> None:
    """Each file or folder of ``written`` (with what it is) lies in no folder chainexec marked as
    its own (:func:`_inside_owned`): the run or config that made that folder removes it whole,
    and this one's file with it."""
    for path, what in written:
        folder = _inside_owned(path)
        if folder is not None:
            made = owner(folder)
            raise ChainexecError(f"{what} would lie inside {folder}, a folder chainexec made"
                                 + (f" as {made}" if made else "")
                                 + " and removes with everything in it: name a path outside it", str(path))


def check_reports(spec, reports: dict[str, str | None], machine: str | None = None) -> RunPaths:
    """Refuse report files a command writes beside a config it does not run (``chainexec plan
    --plot``) that would write over the config, an input, an output, the machine file
    ``machine`` or one another, or that lie in a folder that does not exist or in one chainexec
    made (as :func:`check_run` refuses a run's). Returns the resolved paths."""
    paths = RunPaths.of(spec, None, reports, machine)
    written = paths.written()
    reports_written = written[len(paths.outputs):]
    _check_written(reports_written, paths.read() + written[:len(paths.outputs)], {})
    _check_report_folders(paths)
    _check_not_inside_owned(reports_written)
    return paths


def _check_written(written: list[tuple[Path, str]], read: list[tuple[Path, str]], outputs: dict) -> None:
    """Each file of ``written`` (with what it is) is none of ``read``'s or of those before it,
    its parts folder (an output's, of ``outputs``) none of ``read``'s, not a folder, and its
    name within the file system's limit with what chainexec adds to it."""
    for k, (f, what) in enumerate(written):
        for g, other in read + written[:k]:
            if same_file(f, g):
                raise ChainexecError(f"{what} is also {other}, which writing it would destroy", str(f))
        for g, other in read:
            for suffix in WRITE_SUFFIXES:
                if same_file(f.with_name(f.name + suffix), g):
                    raise ChainexecError(f"{what} would write {f.name + suffix}, which is {other}", str(g))
        if f.is_dir():
            raise ChainexecError(f"{what} is a folder, not a file", str(f))
        if f.exists() and not f.is_file():
            # a FIFO, device or socket: renaming the written file onto its name would replace it
            # (/dev/null itself, for a user allowed to write /dev), and a FIFO's check would block
            from chainexec import datafiles

            datafiles.check_regular(str(f), what)
        _check_name_lengths(f, (*WRITE_SUFFIXES, PARTS_ASIDE, "." + atomicfile.TEMPORARY) if f in outputs
                            else (REPORT_TEMPORARY,))


def _check_report_folders(paths: RunPaths) -> None:
    for f, option in paths.reports.items():
        if not f.parent.is_dir():
            raise ChainexecError(f"{option}: the folder does not exist", str(f.parent))


OUTPUT_ATTRIBUTES = {"indices", "extents"}
"""The attributes chainexec writes on each dataset of an output file (besides the file's
``chainexec_complete``): the output's index letters and extents."""


def _added(path: Path) -> str | None:
    """What an output file chainexec wrote holds that it did not write, where a user added to it
    (a dataset, group, link or attribute; chainexec writes its outputs as virtual datasets with
    :data:`OUTPUT_ATTRIBUTES`, and the file's ``chainexec_complete`` and :data:`LANDED`); None
    where nothing is."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            extra = [k for k in f.attrs if k not in ("chainexec_complete", LANDED)]
            if extra:
                return f"the attribute {extra[0]!r}"
            for name in f:
                if not isinstance(f.get(name, getlink=True), h5py.HardLink):
                    return f"the link {name!r}"
                item = f[name]
                if not isinstance(item, h5py.Dataset):
                    return f"the group {name!r}"
                if not item.is_virtual:
                    return f"the dataset {name!r}"
                extra = sorted(set(item.attrs) - OUTPUT_ATTRIBUTES)
                if extra:
                    return f"the attribute {extra[0]!r} of dataset {name!r}"
    except (OSError, KeyError):
        return None
    return None


def _is_chainexec_output(path: Path) -> bool:
    """Whether ``path`` is an HDF5 file chainexec wrote complete (its ``chainexec_complete``
    attribute set); one another program holds open for writing is refused."""
    import h5py

    from chainexec import datafiles

    try:
        if not h5py.is_hdf5(path):
            return False
        with h5py.File(path, "r") as f:
            return bool(f.attrs.get("chainexec_complete", False))
    except OSError as err:
        refusal = datafiles.lock_refusal(err)
        if refusal is not None:
            raise ChainexecError(f"the output: {refusal}", str(path)) from None
        return False


def check_generate(spec) -> list[Path]:
    """The files ``chainexec generate`` writes (the inputs with a file), refused where one of
    them is the config, an output, or an existing file that is not HDF5, or lies below a file or
    in a folder chainexec made (which its run removes with everything in it), or where two tensors
    name one dataset of one file with other extents, type, layout, seed or symmetry of their
    seeded values (:meth:`chainexec.spec.Spec.dense_symmetry`; one tensor's values would be written
    over the other's)."""
    import h5py

    paths = RunPaths.of(spec)
    written: dict[tuple[Path, str], tuple[str, tuple]] = {}
    for t in spec.tensors.values():
        if t.source is not None and t.source.file is not None:
            where = (resolved(spec.resolve(t.source.file)), t.source.dataset)
            made = (spec.shape(t.name), t.dtype, t.layout, t.source.seed, spec.dense_symmetry(t.name))
            first, theirs = written.setdefault(where, (t.name, made))
            if theirs != made:
                raise ChainexecError(f"tensors {first} and {t.name} both name dataset {t.source.dataset!r} with other "
                                     "extents, type, layout, seed or declared symmetry: generating one would write "
                                     "over the other",
                                     str(where[0]))
    for f, tensor in paths.inputs.items():
        if same_file(f, paths.config):
            raise ChainexecError(f"the input of tensor {tensor} is the config itself", str(f))
        for g, what in paths.outputs.items():
            if same_file(f, g):
                raise ChainexecError(f"the input of tensor {tensor} is also the output of {what}", str(f))
        if f.is_dir():
            raise ChainexecError(f"the input of tensor {tensor} is a folder, not a file", str(f))
        above = nearest_existing(f.parent)
        if not above.is_dir():
            raise ChainexecError(f"the input of tensor {tensor} lies below {above}, which is a file, not a folder",
                                 str(f))
        try:
            foreign = f.exists() and not h5py.is_hdf5(f)
        except OSError as err:  # a file that cannot be read (its permissions), whose copy would fail
            raise ChainexecError(f"cannot read it ({os.strerror(err.errno) if err.errno else err}; input of tensor "
                                 f"{tensor}), and `chainexec generate` keeps the datasets the config does not name "
                                 "in a copy of it", str(f)) from None
        if foreign:
            raise ChainexecError(f"exists and is not HDF5; `chainexec generate` writes only into HDF5 files "
                                 f"(input of tensor {tensor})", str(f))
        _check_name_lengths(f, (".tmp",))
    _check_not_inside_owned([(f, f"the input of tensor {tensor}") for f, tensor in paths.inputs.items()])
    return list(paths.inputs)
