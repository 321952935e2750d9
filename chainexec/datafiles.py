"""The files an HDF5 dataset's values come from: the file that names it, and through HDF5's
links and layouts other files too (an external link's file, a virtual dataset's sources, external
raw storage). A run must not write or remove any of them (:mod:`chainexec.safepaths`), and a
checkpoint identifies its inputs by all of them (:mod:`chainexec.runtime.checkpoint`)."""

from __future__ import annotations

import os

import h5py


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
    todo = {path: {dataset}}  # file → its datasets whose files are still to be found
    seen = {(os.path.abspath(path), dataset)}
    while todo:
        file, names = todo.popitem()
        if file != path and not os.path.isfile(file):
            continue  # a virtual dataset's source not there: HDF5 reads its fill value
        with h5py.File(file, "r") as f:
            for name in names:
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
