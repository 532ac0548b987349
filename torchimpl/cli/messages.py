"""The command line's one message format: ``ampspec: warning: ...``, ``ampspec COMMAND: error: ...``.

Every line the ``ampspec`` command writes to stderr about a problem has the form
``[rank R] ampspec[ COMMAND]: LEVEL: message`` (``[rank R]`` only under ``torchrun``):

- ``warning``: Python warnings raised by ampspec's own code (a downgraded precision, a
  refused fused optimizer) and log records at WARNING from any ``torchimpl`` logger;
- ``error``: a user mistake or a fault that ends the command (the CLI prints these itself);
- INFO records (``ampspec -v``) read ``ampspec: message``.

Warnings raised outside ampspec (torch's, the user's task's) keep Python's own format, so that
their file and line still point at the code that raised them. While ``ampspec audit`` runs a
user's script, only ampspec's own loggers use this format (:func:`own_loggers_only`): the
script's logging prints as it would under ``python``. This module imports no torch:
``ampspec --help`` must answer without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["CliFormatter", "configure_logging", "launch_rank", "line", "own_loggers_only", "plain_warnings",
           "rank_prefix"]

_PACKAGE = str(Path(__file__).resolve().parent.parent)  # torchimpl/, above this cli/ folder


def launch_rank() -> int:
    """This process's rank as ``torchrun`` sets it (``RANK``); 0 when not launched by torchrun."""
    return int(os.environ.get("RANK", "0"))


def rank_prefix() -> str:
    """``[rank R] `` under torchrun, else empty."""
    return f"[rank {launch_rank()}] " if "RANK" in os.environ else ""


def line(level: str | None, message: str, command: str | None = None) -> str:
    """One message line: ``ampspec[ COMMAND]: [LEVEL: ]message``, with the rank under torchrun."""
    who = f"ampspec {command}" if command else "ampspec"
    return f"{rank_prefix()}{who}: {level + ': ' if level else ''}{message}"


class CliFormatter(logging.Formatter):
    """Log records in the command line's format (INFO and DEBUG without a level word)."""

    def format(self, record: logging.LogRecord) -> str:
        level = record.levelname.lower() if record.levelno >= logging.WARNING else None
        if level == "critical":
            level = "error"
        text = line(level, record.getMessage())
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (a test's capture too)."""

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def configure_logging(level: int) -> None:
    """Send log records at ``level`` and above to stderr in the command line's format.

    As ``logging.basicConfig`` does, it leaves a process whose root logger already has a
    handler of someone else's (a program calling ``main()``, pytest) to that handler."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if isinstance(h.formatter, CliFormatter)]
    if len(ours) < len(root.handlers):
        return
    for old in ours:  # a second main() in one process must not print twice
        root.removeHandler(old)
    handler = _CurrentStderr()
    handler.setFormatter(CliFormatter())
    root.addHandler(handler)
    root.setLevel(level)


@contextlib.contextmanager
def own_loggers_only(names: tuple[str, ...] = ("torchimpl", "audit")) -> Iterator[None]:
    """While another program runs in this process (``ampspec audit``): the command's handler
    moves from the root logger to ampspec's own loggers ``names``, and the root logger is as
    Python starts it (no handler, level WARNING). The program's ``logging.basicConfig``, its own
    handlers and a library's log records then print as under ``python SCRIPT.py``: once, in
    their own format, never relabelled ``ampspec: warning:``. Everything comes back after (the
    program's root handlers go: the command's lines must not print twice)."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if isinstance(h.formatter, CliFormatter)]
    if not ours:  # someone else's root logger (pytest, a program calling main()): theirs to keep
        yield
        return
    handlers, level = list(root.handlers), root.level
    own = [logging.getLogger(name) for name in names]
    saved = [(lg, lg.level, lg.propagate, list(lg.handlers)) for lg in own]
    for h in ours:
        root.removeHandler(h)
    root.setLevel(logging.WARNING)
    for lg in own:
        if lg.level == logging.NOTSET:
            lg.setLevel(level)
        lg.propagate = False  # a root handler of the program's must not print ampspec's lines again
        for h in ours:
            lg.addHandler(h)
    try:
        yield
    finally:
        for lg, lg_level, propagate, lg_handlers in saved:
            lg.handlers[:] = lg_handlers
            lg.setLevel(lg_level)
            lg.propagate = propagate
        root.handlers[:] = handlers
        root.setLevel(level)


def plain_warnings() -> None:
    """Show this package's warnings as one line, ``ampspec: warning: <message>``.

    Their ``file.py:123: Category:`` prefix points into ampspec's own code, which tells a
    command-line user nothing; warnings raised elsewhere (torch, the user's task) keep theirs.
    """
    default = warnings.showwarning
    if getattr(default, "_ampspec", False):
        return

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, text: Any = None) -> None:
        if not str(Path(filename).resolve()).startswith(_PACKAGE):
            return default(message, category, filename, lineno, file, text)
        print(line("warning", str(message)), file=file or sys.stderr)

    show._ampspec = True  # type: ignore[attr-defined]
    warnings.showwarning = show
