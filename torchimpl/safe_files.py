"""Writing a run's own files without writing anywhere else.

1. A run file (``metrics.csv``, the trace, ``report.json``) is opened with ``O_NOFOLLOW``: a
   symbolic link planted under its name is refused (``ValueError`` naming the file), never
   written through to its target.
2. A file rewritten whole (a trace or ``metrics.csv`` cut back on a resume, a report) is
   written to a fresh temporary file in the same folder (``mkstemp``: a new name, opened
   exclusively) and renamed over the old one, so a kill leaves the old file or the new one.
3. A write that fails (a full disk, a read-only or vanished folder, an I/O error) raises
   :class:`RunFileWriteError`, an ``OSError`` naming the file, what it is, the reason and the
   fix, instead of a bare ``[Errno 28] No space left on device``; a checkpoint's temporary file
   is removed, so the checkpoints written before stay the run's last good ones.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["RunFileWriteError", "open_run_file", "refuse_link", "replace_text", "write_report", "writing"]


class RunFileWriteError(OSError):
    """A run file that could not be written (rule 3); ``errno`` and ``filename`` are the failed write's."""

    def __str__(self) -> str:
        return self.message

    def __init__(self, message: str, err: int | None, filename: str):
        super().__init__(err, message, filename)
        self.message = message


@contextlib.contextmanager
def writing(path: str | Path, what: str) -> Iterator[None]:
    """Rule 3 around a write of ``what`` (``"checkpoint"``, ``"trace file"``) at ``path``."""
    try:
        yield
    except RunFileWriteError:
        raise
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        if exc.errno == errno.ENOSPC or exc.errno == getattr(errno, "EDQUOT", None):
            fix = "free space on that disk (or train into a folder on another one)"
        else:
            fix = "make that folder writable (permissions, a read-only mount) or train into another one"
        raise RunFileWriteError(f"{what} {path}: cannot write: {reason}; {fix}, then resume from the run's last "
                                "checkpoint (the ones already written are intact)", exc.errno, str(path)) from exc

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND}


def refuse_link(path: str | Path, what: str = "run file") -> None:
    """Rule 1 for a path about to be written: ``ValueError`` when it is a symbolic link."""
    if Path(path).is_symlink():
        raise ValueError(f"{what} {path} is a symbolic link (to {os.readlink(path)}); ampspec writes a run's "
                         "files only in place and never through a link: remove the link or choose another path")


def open_run_file(path: str | Path, mode: str, *, what: str = "run file") -> IO[str]:
    """Rule 1: ``path`` opened for text writing (``mode`` ``"w"`` or ``"a"``), UTF-8."""
    try:
        fd = os.open(path, _FLAGS[mode] | _NOFOLLOW, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP or Path(path).is_symlink():
            refuse_link(path, what)
        raise
    return os.fdopen(fd, mode, encoding="utf-8", newline="")


def replace_text(path: str | Path, text: str, *, what: str = "run file") -> None:
    """Rule 2: ``path`` holds ``text``, written whole and renamed into place."""
    path = Path(path)
    refuse_link(path, what)
    with writing(path, what):
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def write_report(path: str | Path, report: Any) -> None:
    """A JSON report written by rule 2 (a signal while it is written leaves no torn report)."""
    replace_text(path, json.dumps(report, indent=1), what="report")
