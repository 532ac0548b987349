"""The log point: the step records read from the device, written to the trace and the metrics
files, shown.

At every ``train.log_interval``-th step, after every evaluation, before every checkpoint and
when the run ends, the records kept on the device since the last log point are read in one
transfer (``torchimpl.run.records.PendingRecords``); then the trace gets them with their losses (so
that a checkpoint at step ``S`` always follows the trace's records of steps ``0 .. S - 1``), so
do ``metrics.csv`` and TensorBoard (``torchimpl.run.metrics``), the loss and scale histories grow,
the progress shows and the callbacks' ``on_log`` runs.

Progress (``logging.progress``): ``auto`` is the tqdm bar when stderr is a terminal and plain
lines otherwise (CI, ``nohup``, a notebook), one per log point::

    step 20/200 loss 0.4132 lr 9.7e-04 scale 65536 skipped 0 (12.3 ms/step)

The lines go through the logger ``torchimpl.progress``, which has its own handler on stderr and
does not propagate, so that they show without any logging configuration; setting its level
above INFO (``ampspec -q``) silences the lines and the bar. Only rank 0 shows progress.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from torchimpl.run.metrics import CsvMetrics, MetricsSink, open_metrics, open_run_folder, rows_for
from torchimpl.run.records import StepRecord, TraceWriter

__all__ = ["PROGRESS_LOGGER", "Reporter", "open_reporter", "progress_mode"]

log = logging.getLogger("torchimpl.train.trainer")

PROGRESS_LOGGER = "torchimpl.progress"


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (a test's capture, a notebook's)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _progress_logger() -> logging.Logger:
    logger = logging.getLogger(PROGRESS_LOGGER)
    if not any(isinstance(h, _CurrentStderr) for h in logger.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    if logger.level == logging.NOTSET:  # a level set before (``-q``) stays
        logger.setLevel(logging.INFO)
    return logger


progress_log = _progress_logger()


def progress_mode(requested: str, *, is_main: bool) -> str:
    """``bar``, ``lines`` or ``off`` for a ``logging.progress`` value on this rank."""
    if not is_main or requested == "off" or not progress_log.isEnabledFor(logging.INFO):
        return "off"
    if requested == "auto":
        return "bar" if sys.stderr.isatty() else "lines"
    return requested


class Reporter:
    """One run's log points: :meth:`collect` reads the pending records, :meth:`flush` collects
    and then writes and shows what was collected. Both return the problem to stop on that the
    records show (a collapse or a non-finite loss seen only now, in the sync-free mode), else
    None."""

    def __init__(self, trainer: Any, writer: TraceWriter | None, *, metrics: Sequence[MetricsSink] = (),
                 progress: str = "off"):
        self.trainer, self.writer, self.metrics, self.progress = trainer, writer, list(metrics), progress
        self.loss_history: list[tuple[int, float]] = []
        self.scale_history: list[tuple[int, float]] = []
        self._held: tuple[list[StepRecord], list[float]] = ([], [])
        self._since = (time.perf_counter(), trainer.state.step)
        self.bar = _progress_bar(trainer.config.train.steps, trainer.state.step) if progress == "bar" else None

    def collect(self) -> str | None:
        trainer = self.trainer
        engine, st = trainer.engine, trainer.state
        if not engine.pending:
            return None
        records, losses = engine.pending.read()
        for record, loss in zip(records, losses):
            self.loss_history.append((record.step, loss))
            self.scale_history.append((record.step, record.scale_after))
        problem = engine.skip.count(records, losses, st)
        st.last_train_loss = losses[-1]
        self._held[0].extend(records)
        self._held[1].extend(losses)
        return problem

    def flush(self, val_loss: float | None = None) -> str | None:
        """Collect, then write the collected steps; ``val_loss`` (an evaluation just after the
        last of them) goes on the last one's trace line and row."""
        problem = self.collect()
        records, losses = self._held
        if not records:
            return problem
        self._held = ([], [])
        self._write(records, losses, val_loss)
        self._show(records[-1], losses[-1], val_loss)
        trainer = self.trainer
        # The callbacks' on_log that do something, bound and checked once (torchimpl.train.step.bind_hooks).
        for hook in trainer.engine.hooks.log:
            hook(trainer.state, records, losses)
        return problem

    def _write(self, records: list[StepRecord], losses: list[float], val_loss: float | None) -> None:
        if self.writer is not None:
            extras = [{"loss": loss} for loss in losses]
            if val_loss is not None:
                extras[-1]["val_loss"] = val_loss
            self.writer.write(records, extras)
        if self.metrics:
            rows = rows_for(records, losses, val_loss)
            for sink in self.metrics:
                sink.write(rows)

    def _show(self, last: StepRecord, loss: float, val_loss: float | None) -> None:
        st = self.trainer.state
        if self.progress == "lines":
            progress_log.info(self._line(last, loss, val_loss))
            return
        log.info("step %d loss %.5g scale %g lr %.3g skipped %d", last.step, loss, last.scale_after, last.lr,
                 st.skipped_steps)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4g}", scale=f"{last.scale_after:g}", skipped=st.skipped_steps,
                                 refresh=False)
            self.bar.update(last.step + 1 - self.bar.n)

    def _line(self, last: StepRecord, loss: float, val_loss: float | None) -> str:
        now, done = time.perf_counter(), last.step + 1
        t0, step0 = self._since
        self._since = (now, done)
        per_step = (now - t0) / max(done - step0, 1)
        val = f" val_loss {val_loss:.4g}" if val_loss is not None else ""
        return (f"step {done}/{self.trainer.config.train.steps} loss {loss:.4g}{val} lr {last.lr:.1e} "
                f"scale {last.scale_after:.8g} skipped {self.trainer.state.skipped_steps} "
                f"({per_step * 1e3:.1f} ms/step)")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        for sink in self.metrics:
            sink.close()
        if self.bar is not None:
            self.bar.close()


def open_reporter(trainer: Any, cfg: Any, *, is_main: bool, resume_at: int | None,
                  header: Callable[[], dict[str, Any]]) -> tuple[Reporter, Path | None, str | None]:
    """A run's reporter with its trace (``header()`` its first line) and, on the main rank, its
    run folder and metrics files; also the run folder and the ``metrics.csv`` path (or None).
    A resumed run (``resume_at``) continues files that hold fewer steps with a warning."""
    writer, sinks, log_dir = None, [], None
    if cfg.train.trace_file and is_main:
        writer = TraceWriter(cfg.train.trace_file, resume_at=resume_at, header=header())
        if resume_at is not None and writer.kept < resume_at:
            log.warning("trace %s holds %d of the %d steps before the resumed step %d (it was not written by "
                        "the runs before); it continues from step %d", cfg.train.trace_file, writer.kept,
                        resume_at, resume_at, resume_at)
    if is_main:
        log_dir = open_run_folder(cfg)
        sinks = open_metrics(cfg, log_dir, resume_at=resume_at)
        csv = next((s for s in sinks if isinstance(s, CsvMetrics)), None)
        if resume_at is not None and csv is not None and csv.kept < resume_at:
            log.warning("metrics file %s holds %d of the %d steps before the resumed step %d; it continues "
                        "from step %d", csv.path, csv.kept, resume_at, resume_at, resume_at)
    metrics_file = next((str(s.path) for s in sinks if isinstance(s, CsvMetrics)), None)
    reporter = Reporter(trainer, writer, metrics=sinks, progress=progress_mode(cfg.logging.progress, is_main=is_main))
    return reporter, log_dir, metrics_file


def _progress_bar(total: int, initial: int) -> Any:
    # optional dependency: the progress bar only where tqdm is installed
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
