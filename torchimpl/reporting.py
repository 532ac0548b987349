"""The log point: the step records read from the device, written to the trace, logged, shown.

At every ``train.log_interval``-th step, before every checkpoint and when the run ends, the
records kept on the device since the last log point are read in one transfer
(``torchimpl.records.PendingRecords``); then the trace gets them (so that a checkpoint at step
``S`` always follows the trace's records of steps ``0 .. S - 1``), the loss and scale histories
grow, one log line is written, the progress bar moves (only when stderr is a terminal) and the
callbacks' ``on_log`` runs.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Sequence

from torchimpl.records import TraceWriter

__all__ = ["Reporter"]

log = logging.getLogger("torchimpl.trainer")


class Reporter:
    """One run's log points; ``flush`` returns the problem to stop on that the records show
    (a collapse or a non-finite loss seen only now, in the sync-free mode), else None."""

    def __init__(self, trainer: Any, writer: TraceWriter | None, *, show_bar: bool):
        self.trainer, self.writer = trainer, writer
        self.loss_history: list[tuple[int, float]] = []
        self.scale_history: list[tuple[int, float]] = []
        self.bar = _progress_bar(trainer.config.train.steps, trainer.state.step) if show_bar else None

    def flush(self) -> str | None:
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
        if self.writer is not None:
            self.writer.write(records)
        last = records[-1]
        log.info("step %d loss %.5g scale %g lr %.3g skipped %d", last.step, losses[-1], last.scale_after,
                 last.lr, st.skipped_steps)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{losses[-1]:.4g}", scale=f"{last.scale_after:g}", skipped=st.skipped_steps,
                                 refresh=False)
            self.bar.update(last.step + 1 - self.bar.n)
        callbacks: Sequence[Any] = trainer.callbacks
        for cb in callbacks:
            cb.on_log(trainer, st, records, losses)
        return problem

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.bar is not None:
            self.bar.close()


def _progress_bar(total: int, initial: int) -> Any:
    if not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
