"""The run around its steps: what is checked before step 1, interrupts, and how a run ends.

1. **Before step 1** (:func:`preflight`): everything that would otherwise fail only after
   training: the checkpoint folder is created and written to, the trace file opened, the run
   folder of the metrics files (``torchimpl.run.metrics``) written to, TensorBoard found when
   ``logging.tensorboard`` asks for it, the training (:func:`check_train_data`) and validation
   data checked for batches. A problem raises ``ValueError`` naming the field and the fix,
   before any work.
2. **Interrupts** (:class:`Interrupts`): the first SIGINT (Ctrl-C) or SIGTERM asks the run to
   stop at the next step boundary; the trainer then flushes the records, saves a checkpoint
   when ``checkpoint.folder`` is set and returns its summary. A second signal aborts at once
   (:class:`Interrupted`, a ``KeyboardInterrupt``). Installed only in the main thread; the
   previous handlers come back when the run ends. Outside a run (the command's start-up, between
   the runs of ``compare``) :func:`command_interrupts` makes the first signal raise
   :class:`Interrupted` at once: nothing is under way that a step boundary would protect.
3. **How a run ends** (:func:`outcome`): ``completed``, ``stopped`` (a callback asked),
   ``interrupted`` (a signal), ``failed`` (a fault: a non-finite loss or gradient with
   ``on_nonfinite: stop``, a collapsed loss scale), or ``no_progress`` (it trained to the end
   but applied no step, or its last loss is not finite). The command line's exit status
   follows it (:data:`EXIT_CODES`).
"""

from __future__ import annotations

import math
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Iterable

__all__ = ["EXIT_CODES", "Interrupted", "Interrupts", "check_train_data", "command_interrupts", "outcome", "preflight"]

EXIT_CODES = {"completed": 0, "stopped": 0, "failed": 1, "no_progress": 3,
              "interrupted:SIGINT": 130, "interrupted:SIGTERM": 143}
"""Exit status of ``ampspec train`` by outcome (2 is a usage error: a bad configuration, a file
that cannot be read, a refused resume)."""


def check_train_data(train_data: Any) -> None:
    """Rule 1 for ``fit``'s ``train_data``: iterable batches, a sequence's first holding a tensor."""
    # imported when called: the command line imports this module before torch
    from torchimpl.task.checks import holds_tensor

    if isinstance(train_data, (str, bytes)) or not hasattr(train_data, "__iter__"):
        raise ValueError(f"train_data is of type {type(train_data).__name__}, not batches: pass a re-iterable source of "
                         "batches (a list of batches, a DataLoader)")
    if isinstance(train_data, Sequence):
        if len(train_data) == 0:
            raise ValueError("train_data holds no batches; pass at least one batch")
        if not holds_tensor(train_data[0]):
            raise ValueError(f"train_data[0] is a {type(train_data[0]).__name__} holding no tensor; a batch is a "
                             "tensor, or a tuple, list or dict of tensors")


def preflight(config: Any, val_data: Iterable[Any] | None, *, is_main: bool) -> None:
    """Rule 1."""
    folder = config.checkpoint.folder
    if folder is not None and is_main:
        _check_writable_folder(Path(folder), "checkpoint.folder")
    trace = config.train.trace_file
    if trace is not None and is_main:
        # imported when called: the command line imports this module before torch
        from torchimpl.run.folder import check_trace_target

        check_trace_target(config)
        path = Path(trace)
        if path.is_dir():
            raise ValueError(f"train.trace_file: {trace} is a folder; give a file path such as {path / 'trace.jsonl'}")
        _check_writable_folder(path.parent if str(path.parent) else Path("."), "train.trace_file's folder")
    if is_main:
        _check_logging(config)
    if val_data is not None:
        if isinstance(val_data, Iterator):
            raise ValueError("val_data is a one-shot iterator (it would be empty at the second evaluation); "
                             "pass a re-iterable source such as a list or a DataLoader")
        if hasattr(val_data, "__len__") and len(val_data) == 0:
            raise ValueError("val_data holds no batches; pass validation batches or None to skip evaluation")


def _check_logging(config: Any) -> None:
    # imported when called: the command line imports this module before torch
    from torchimpl.run.metrics import check_tensorboard, planned_folder, wants_files

    check_tensorboard(config)
    folder, field = planned_folder(config)
    if folder is not None and wants_files(config):
        _check_writable_folder(folder, field)


def _check_writable_folder(folder: Path, field: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{field}: cannot create {folder}: {exc.strerror or exc}; choose a writable folder") from None
    if not folder.is_dir():
        raise ValueError(f"{field}: {folder} exists and is not a folder; choose another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{field}: cannot write in {folder}: {exc.strerror or exc}; choose a writable folder") from None


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM that stops the command now; ``signal`` is its name and
    ``exit_code`` the command's status (130 or 143)."""

    def __init__(self, signal_name: str, message: str):
        super().__init__(message)
        self.signal = signal_name
        self.exit_code = EXIT_CODES.get(f"interrupted:{signal_name}", 130)


def command_interrupts() -> dict[int, Any]:
    """Rule 2 outside a run: SIGINT and SIGTERM raise :class:`Interrupted` (main thread only);
    returns the previous handlers, for :func:`restore_handlers` when the command ends."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handle(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        raise Interrupted(name, f"interrupted by {name}")

    previous = {}
    for name in Interrupts._SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            previous[sig] = signal.signal(sig, handle)
    return previous


def restore_handlers(previous: dict[int, Any]) -> None:
    """Put back the handlers :func:`command_interrupts` replaced (a caller of ``main`` keeps its own)."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


class Interrupts:
    """Rule 2, as a context manager; ``received`` is the first signal's name, or None."""

    _SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for name in self._SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # the second one: abort now
            self._restore()
            name = signal.Signals(signum).name
            raise Interrupted(name, f"{name} received twice: aborted at once, without a checkpoint")
        self.received = signal.Signals(signum).name

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __exit__(self, *exc: object) -> None:
        self._restore()


def outcome(*, stopped: str | None, fault: bool, interrupted: str | None, steps_applied: int,
            final_loss: float | None) -> str:
    """Rule 3."""
    if interrupted is not None:
        return f"interrupted:{interrupted}"
    if fault:
        return "failed"
    if stopped is not None:
        return "stopped"
    if steps_applied == 0 or (final_loss is not None and not math.isfinite(final_loss)):
        return "no_progress"
    return "completed"
