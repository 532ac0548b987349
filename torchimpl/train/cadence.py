"""The run's periodic work, each part deciding itself when it is due, and the step clock.

After every optimizer step the trainer asks each part whether it is due at that step:

1. the log point (:class:`LogPoints`): every ``train.log_interval``-th step, at the last step,
   and when the run is about to stop (a request or a signal), so that no record is left on the
   device;
2. the evaluation (:class:`Evaluator`): every ``train.eval_interval``-th step and at the last
   one, when there is validation data; an interval of 0 means at the end only;
3. the checkpoint (:class:`Checkpointer`): every ``checkpoint.interval``-th step, at the last
   one and on an interrupt, when ``checkpoint.folder`` is set; 0 means at the end only. Older
   checkpoints in the folder beyond ``checkpoint.keep_last`` are deleted after each save. The
   checkpointer also finds the checkpoint a resume starts from.

Most steps have none of them due: :func:`quiet_steps` answers that for a step, decided once
per run from the parts' intervals. The :class:`StepClock` times the steps with evaluation and
saving left out.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from torchimpl.run.checkpoint import CheckpointError, checkpoint_name, list_checkpoints, prune_checkpoints
from torchimpl.config.schema import CheckpointConfig
from torchimpl.run.state import TrainState, check_contents
from torchimpl.safe_files import RunFileWriteError

__all__ = ["Checkpointer", "Evaluator", "LogPoints", "StepClock", "quiet_steps"]

log = logging.getLogger("torchimpl.train.trainer")


def _every(interval: int, step: int) -> bool:
    return interval > 0 and step % interval == 0


class LogPoints:
    """Rule 1: when the records kept on the device are read and written."""

    def __init__(self, interval: int):
        self.interval = interval

    def due(self, step: int, *, last: bool, stopping: bool) -> bool:
        return step % self.interval == 0 or last or stopping


class Evaluator:
    """Rule 2: the validation loss at its interval; the last and the best go into the state."""

    def __init__(self, val_data: Iterable[Any] | None, interval: int, guard: Any = None):
        self.val_data, self.interval, self.guard = val_data, interval, guard

    def due(self, step: int, *, last: bool) -> bool:
        return self.val_data is not None and (_every(self.interval, step) or last)

    def run(self, evaluate: Callable[[Iterable[Any]], float], state: TrainState) -> float:
        """``evaluate(val_data)`` with the non-finite guard off: it watches training steps, and
        a non-finite validation loss is recorded as it is."""
        if self.guard is not None:
            self.guard.remove()
        try:
            value = evaluate(self.val_data)
        finally:
            if self.guard is not None:
                self.guard.install()
        state.last_val_loss = value
        if math.isfinite(value) and (state.best_val_loss is None or value < state.best_val_loss):
            state.best_val_loss = value
        return value


class Checkpointer:
    """Rule 3: when to save, where, and which older checkpoints go."""

    def __init__(self, config: CheckpointConfig, dist: Any):
        self.folder, self.interval, self.keep_last = config.folder, config.interval, config.keep_last
        self.dist = dist
        self.last: str | None = None
        """The path of the newest checkpoint this run wrote."""
        self._folder_seen = self.folder is not None and Path(self.folder).is_dir()

    def due(self, step: int, *, last: bool, interrupted: bool) -> bool:
        return self.folder is not None and (_every(self.interval, step) or last or interrupted)

    def find(self, resume: str | Path, restore: Callable[[dict[str, Any], Path], None]) -> \
            tuple[dict[str, Any], Path] | None:
        """The contents a resume starts from, restored with ``restore``, and their path (rule 10
        of ``torchimpl.run.state``): ``resume`` itself, or for ``"latest"`` the newest checkpoint
        in the folder that loads, holds every field and restores, passing over the others with a
        warning; None for an empty folder."""
        if str(resume) != "latest":
            paths = [Path(resume)]
        elif self.folder is None:
            raise ValueError("resume='latest' needs checkpoint.folder")
        else:
            paths = list_checkpoints(self.folder)[::-1]
            if not paths:
                log.warning("no checkpoint in %s to resume from; starting a fresh run", self.folder)
                return None
        rejected = []
        for path in paths:
            try:
                contents = self.dist.load_checkpoint(path)
                check_contents(contents, path)
                # Inside the try: a checkpoint that fails to restore is passed over like a damaged one
                # (the next one's restore overwrites all that this one set).
                restore(contents, path)
            except CheckpointError as exc:
                if len(paths) == 1 and str(resume) != "latest":
                    raise
                rejected.append(str(exc))
                log.warning("cannot resume from %s: %s", path.name, exc)
                continue
            return contents, path
        raise CheckpointError(f"none of the {len(paths)} checkpoints in {self.folder} can be resumed from, so the run "
                              f"is refused and nothing in the folder was changed: {'; '.join(rejected)}. Move the "
                              "damaged files away to start afresh, or resume from a good copy")

    def save(self, contents: dict[str, Any], state: TrainState, path: str | Path | None = None) -> Path:
        """Write ``contents`` to ``path`` (default: the folder, named by the step and, inside a
        window, the microbatch), then prune the folder to ``keep_last``."""
        if path is None:
            if self.folder is None:
                raise ValueError("no path given and checkpoint.folder is not set")
            path = Path(self.folder) / checkpoint_name(state.step, state.window_done)
            self._check_folder_there()
        written = self.dist.save_checkpoint(contents, Path(path))
        self._folder_seen = self.folder is not None and Path(written).parent == Path(self.folder)
        self.last = str(written)
        log.info("saved checkpoint %s", written)
        if self.folder is not None and Path(written).parent == Path(self.folder) and self.dist.is_main:
            prune_checkpoints(self.folder, self.keep_last)
        return written


    def _check_folder_there(self) -> None:
        """A checkpoint folder that vanished during the run (deleted or moved) stops it: made
        again, it would hold a run without its earlier checkpoints, metrics or lock."""
        if self._folder_seen and not Path(self.folder).is_dir():
            raise RunFileWriteError(f"checkpoint.folder {self.folder}: it no longer exists (deleted or moved while "
                                    "the run wrote to it), so the run stopped; put the folder back (or a copy of "
                                    "it) and resume from its last checkpoint, or start afresh in another folder",
                                    errno.ENOENT, str(self.folder))


def quiet_steps(logs: LogPoints, evaluator: Evaluator, checkpointer: Checkpointer) -> Callable[[int], bool]:
    """Whether no part is due after ``step`` when it is neither the last step nor a stop: the
    step is a multiple of none of the intervals of the parts that run (an evaluation only with
    validation data, a checkpoint only with a folder; an interval of 0 means never)."""
    intervals = [logs.interval]
    if evaluator.val_data is not None:
        intervals.append(evaluator.interval)
    if checkpointer.folder is not None:
        intervals.append(checkpointer.interval)
    every = tuple(sorted({i for i in intervals if i > 0}))
    if len(every) == 1:  # the common case: the log interval alone, one modulo a step
        (only,) = every
        return lambda step: step % only != 0
    return lambda step: all(step % i for i in every)


class StepClock:
    """Wall time of the steps from :meth:`start`, less what ran inside :meth:`paused`."""

    def __init__(self, device: torch.device):
        self.device = device
        self._t0, self._excluded, self._start = 0.0, 0.0, (0, 0)

    def start(self, state: TrainState) -> None:
        self._start = (state.step, state.samples)
        self._t0, self._excluded = time.perf_counter(), 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self._excluded += time.perf_counter() - t

    def stop(self) -> None:
        self.elapsed = time.perf_counter() - self._t0 - self._excluded

    def rates(self, state: TrainState) -> dict[str, Any]:
        """``time_per_step_s``, ``samples_per_s`` and ``peak_memory_bytes`` of the steps since
        :meth:`start`, up to :meth:`stop`."""
        step0, samples0 = self._start
        return {"time_per_step_s": self.elapsed / max(state.step - step0, 1),
                "samples_per_s": (state.samples - samples0) / self.elapsed if self.elapsed > 0 else 0.0,
                "peak_memory_bytes": int(torch.cuda.max_memory_allocated(self.device))
                if self.device.type == "cuda" else None}
