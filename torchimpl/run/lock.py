"""One process at a time in a run folder: an exclusive ``flock`` on a lock file.

1. :func:`hold` takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<folder>/.ampspec.lock`` (or on
   ``.<name>.lock`` beside a single file such as a trace) and writes the holder's pid in it. A
   second process is refused at once (:class:`RunLockedError`, naming the folder and the
   holder's pid), never made to wait.
2. The kernel releases the lock when its process ends, however it ends: a killed run leaves no
   stale lock (the file may remain; it locks nothing). A clean release removes the file, and a
   folder the lock created stays only if the run wrote something in it.
3. Taking the lock checks that the file it locked is still the one under that name (its last
   holder may have removed it between the open and the lock), so two processes never both
   believe they hold it.
4. Within a process the lock is the thread's: the same thread taking it again (the command
   line around ``Trainer.fit``, which takes it too) holds it once more; another thread is
   refused as another process would be.
5. :func:`run_locks` holds every lock of a run: its checkpoint folder, its fixed run folder
   (``logging.dir``) and its trace file.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are not guarded there
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "RunLockedError", "hold", "lock_path", "run_locks"]

LOCK_NAME = ".ampspec.lock"

# Rule 4: lock file (real path) -> (holding thread, depth), for the locks this process holds.
_HELD: dict[str, tuple[int, int]] = {}
_HELD_GUARD = threading.Lock()


class RunLockedError(RuntimeError):
    """Another live process holds the lock (rule 1)."""


def lock_path(target: Path, *, is_file: bool = False) -> Path:
    """The lock file guarding ``target``: a folder's ``.ampspec.lock``, or ``.<name>.lock`` beside a file."""
    return target.with_name(f".{target.name}.lock") if is_file else target / LOCK_NAME


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "a process that has not written its pid yet"


def _take(path: Path, what: str) -> int:
    """Rules 1 and 3: the locked file's descriptor."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        fd = os.open(path, flags, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunLockedError(f"{what} is in use by another ampspec process ({holder}, lock file {path}); "
                                 "wait for it to end, or use another folder") from None
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)  # rule 3: locked a file its holder had just removed; take the new one


@contextlib.contextmanager
def hold(target: str | Path, what: str, *, is_file: bool = False) -> Iterator[None]:
    """Hold the lock guarding ``target`` (a folder, made if missing, or a file) while the block runs."""
    target = Path(target)
    if fcntl is None:
        yield
        return
    folder = target.parent if is_file else target
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{what}: {folder} exists and is not a folder; choose another path")
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = lock_path(target, is_file=is_file)
    key, me = os.path.realpath(path), threading.get_ident()
    with _HELD_GUARD:
        holder = _HELD.get(key)
        if holder is not None and holder[0] != me:
            raise RunLockedError(f"{what} is in use by another run in this process (thread {holder[0]}, lock file "
                                 f"{path}); wait for it to end, or use another folder")
        if holder is not None:  # rule 4: this thread holds it already
            _HELD[key] = (me, holder[1] + 1)
    if holder is not None:
        try:
            yield
        finally:
            with _HELD_GUARD:
                _HELD[key] = (me, _HELD[key][1] - 1)
        return
    fd = _take(path, what)
    with _HELD_GUARD:
        _HELD[key] = (me, 1)
    try:
        yield
    finally:
        with _HELD_GUARD:
            del _HELD[key]
        # A folder made read-only (or removed) during the run keeps its lock file: it is unlocked
        # once closed (rule 3), and the error that stopped the run is the one to report.
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        os.close(fd)
        if made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: the run wrote nothing there (rule 2)


def fixed_log_folder(config: Any) -> Path | None:
    """The run folder of the metrics files when it is a fixed one (not a fresh ``version_N``)."""
    d = config.logging.dir
    if d is None or (d == "auto" and config.checkpoint.folder is None):
        return None
    return Path(config.checkpoint.folder if d == "auto" else d)


def run_locks(config: Any) -> contextlib.ExitStack:
    """Rule 5: an ``ExitStack`` holding the locks on ``config``'s run folders and trace file."""
    stack = contextlib.ExitStack()
    folders = {Path(f).resolve(): field for f, field in ((fixed_log_folder(config), "logging.dir"),
                                                       (config.checkpoint.folder, "checkpoint.folder")) if f is not None}
    try:
        for folder, field in folders.items():
            stack.enter_context(hold(folder, f"{field} {folder}"))
        if config.train.trace_file is not None:
            stack.enter_context(hold(Path(config.train.trace_file), f"train.trace_file {config.train.trace_file}",
                                     is_file=True))
    except BaseException:
        stack.close()  # the locks taken before the refused one
        raise
    return stack
