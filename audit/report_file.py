"""Where the audit's JSON report may go, and how it is written there without harming any file.

1. **Checked before the script runs** (:func:`check_report_path`, the path made absolute at
   launch so that a script's ``os.chdir`` cannot move it): refused with ``ValueError`` naming
   the path and the fix are the audited script itself, a Python source file, a symbolic link
   (a dangling one too: it would be written through to its target), a folder or anything not a
   regular file, an existing file that is not an ampspec audit report (overwritten only with
   ``force``), and a folder that cannot be written.
2. **Written atomically** (:func:`write_report_file`): to a new temporary file in the same
   folder (created exclusively, never through a link), synced, then renamed over the path; a
   failed write (a full disk) removes the temporary file, leaves the old report as it was and
   raises :class:`ReportWriteError` naming the path, the reason and the fix. The path is checked
   again just before: the script may have put something there while it ran.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from pathlib import Path

__all__ = ["REPORT_KEYS", "ReportWriteError", "check_report_path", "is_audit_report", "write_report_file"]

REPORT_KEYS = frozenset({"target", "argv", "status", "counts", "exit_status", "findings", "steps"})
"""Top-level keys every audit report has (`audit.report.AuditReport.to_dict`): how an existing
file is recognised as one, which may be replaced."""

_SOURCE_SUFFIXES = (".py", ".pyw", ".pyi", ".pyx", ".pxd", ".ipynb")
_READ_LIMIT = 1 << 30  # a larger file is no report of ours: it is not read whole to find out


class ReportWriteError(OSError):
    """The report could not be written (a full disk, a folder made read-only while the script ran)."""

    def __str__(self) -> str:
        return self.strerror or ""


def is_audit_report(path: Path) -> bool:
    """Whether the regular file at ``path`` holds an audit report: a JSON object with `REPORT_KEYS`."""
    try:
        if path.stat().st_size > _READ_LIMIT:
            return False
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and REPORT_KEYS <= data.keys()


def _same_file(a: Path, b: Path) -> bool:
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return False


def check_report_path(path: Path, *, script: Path | None = None, force: bool = False, given: str | None = None) -> None:
    """Rule 1: ``ValueError`` when the report may not be written at ``path`` (absolute); the
    message names it as ``given`` on the command line."""
    shown = f"--report {given or path}"
    if path.is_symlink():
        raise ValueError(f"{shown} is a symbolic link (to {os.readlink(path)}); the audit never writes through a "
                         "link: remove the link or choose another path")
    if script is not None and (path == script.absolute() or _same_file(path, script)):
        raise ValueError(f"{shown} is the script being audited; choose a path such as "
                         f"{path.with_name(path.stem + '-audit.json')}")
    if path.is_dir():
        raise ValueError(f"{shown} is a folder; give a file path such as {path / 'audit.json'}")
    if path.exists():
        if not path.is_file():
            raise ValueError(f"{shown} exists and is not a regular file; choose another path")
        if path.suffix.lower() in _SOURCE_SUFFIXES:
            raise ValueError(f"{shown} is a source file ({path.suffix}); the report never replaces one, even with "
                             f"--force: choose a path such as {path.with_suffix('.audit.json')}")
        if not force and not is_audit_report(path):
            raise ValueError(f"{shown} exists and is not an ampspec audit report; the audit replaces only its own "
                             "reports: choose another path, or pass --force to overwrite it")
    folder = next((p for p in path.parents if p.exists()), Path(path.anchor))
    if not folder.is_dir():
        raise ValueError(f"{shown}: {folder} is a file, not a folder; choose a path in a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{shown}: cannot write in {folder}; choose a writable folder")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_report_file(path: Path, text: str, *, script: Path | None = None, force: bool = False) -> Path:
    """Rule 2: ``text`` at ``path``, renamed into place whole; ``path`` is returned."""
    path = Path(os.path.abspath(path))
    check_report_path(path, script=script, force=force)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # O_EXCL, O_NOFOLLOW
    except OSError as exc:
        raise _write_error(path, exc) from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # as a plainly created file, not mkstemp's 0600
        os.replace(tmp, path)  # replaces a name, never writes through it
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise _write_error(path, exc) from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _write_error(path: Path, exc: OSError) -> ReportWriteError:
    """The failed write named: the file, the reason, the fix, and that no old report was touched."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", None)):
        fix = "free space on that disk or give --report a path on another one"
    else:
        fix = "make that folder writable or give --report another path"
    kept = "; the report already there is unchanged" if path.is_file() else ""
    return ReportWriteError(exc.errno, f"cannot write the report {path}: {reason}{kept}; {fix}", str(path))
