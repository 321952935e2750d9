"""The one error type users see.

Every problem with a user's input (config, HDF5 files, memory limits, output paths) is raised as a
:class:`ChainexecError`; the CLI prints its one-line message and exits with status 2, without a
traceback. What the machine refuses a correct run (a full disk, a quota, a read-only file
system, too little memory) is one too (:func:`of_machine`). Anything else escaping is a bug in
chainexec and keeps its traceback.
"""

import argparse
import errno
import re
import sys

_LINE_BREAKS = re.compile(r"\s*[\r\n]+\s*")
"""Line breaks and the blanks around them, which a message quoting another library's (HDF5's
spans lines) would carry."""


def say(line: str) -> None:
    """``line`` on stderr, with its newline, in one write, flushed: the lines of several ranks
    that fail at once each stay whole where the launcher joins their streams, also where
    Python's streams are unbuffered (``PYTHONUNBUFFERED``, ``python -u``), under which ``print``
    writes a text and its newline apart."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class ChainexecError(Exception):
    """A user-facing error: ``str(err)`` is one line naming the file (and line) and the problem.
    ``collective``: every rank of a run raises it at the same point (the run can end normally,
    without aborting the other ranks)."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None, collective: bool = False):
        self.path = path
        self.line = line
        self.collective = collective
        where = ""
        if path is not None:
            shown = str(path).replace("\n", "\\n").replace("\r", "\\r")  # a name with a line break stays on the line
            where = f"{shown}:{line}: " if line is not None else f"{shown}: "
        super().__init__(f"{where}{_LINE_BREAKS.sub(' ', message)}")


MACHINE_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                  errno.EROFS: "the file system is read-only", errno.EIO: "the disk failed to read or write",
                  errno.ENAMETOOLONG: "a file name is too long for the file system",
                  errno.EFBIG: "the file is larger than the file system or the process's file size limit "
                               "(ulimit -f) allows"}
"""Errors of the operating system that say what the machine refused, not what chainexec did
wrong, with the words a user reads for each."""

_HDF5_FILE = re.compile(r"(?:filename|name) = '([^']*)'")
"""Where HDF5's message of a failed read or write names the file."""


def of_machine(err: BaseException) -> "ChainexecError | None":
    """``err`` as the one-line error a user reads, where it is the machine's refusal rather than
    a bug: an :class:`OSError` of :data:`MACHINE_ERRNOS` (naming the file: the error's own, or
    the one HDF5's message names), or a :class:`MemoryError` (NumPy's arrays too large for the
    host's free memory, with the size asked for). None for anything else."""
    if isinstance(err, MemoryError):
        return ChainexecError(f"out of host memory ({str(err) or 'an allocation failed'}; for a run: lower the config's "
                              "machine: global_memory, or run on more ranks or hosts)")
    if not isinstance(err, OSError) or err.errno not in MACHINE_ERRNOS:
        return None
    named = err.filename or next(iter(_HDF5_FILE.findall(str(err))), None)
    return ChainexecError(f"{MACHINE_ERRNOS[err.errno]} (errno {err.errno})", None if named is None else str(named))


class RankFailed(Exception):
    """Raised on the other ranks where one rank failed with a defect (not a user error): that
    rank prints the traceback; these end with the same status (1) and no message of their own,
    so that the launcher's status (MPICH's joins the ranks' statuses bit by bit) stays 1."""


def quoted(value, limit: int = 80) -> str:
    """``repr(value)`` for a message, cut to about ``limit`` characters (a hostile config's names
    and expressions can be megabytes long; the message stays one readable line)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its errors in one line (exit status 2), as every other bad input: the
    command line of ``chainexec`` and of the subcommands that parse their own options. The line
    begins with the program's name (``chainexec``, ``chainexec run``), as every error's does."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} -h)\n")
