"""The hooks a run calls (:class:`Callback`) and the way a hook ends the run (:class:`StopTraining`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the trainer imports this module
    from torchimpl.run.records import StepRecord
    from torchimpl.run.state import TrainState
    from torchimpl.train.trainer import RunSummary, Trainer

__all__ = ["Callback", "StopTraining"]


class StopTraining(Exception):
    """Raise from a callback to end ``fit`` cleanly after the current hook."""


class Callback:
    """Hooks called by :class:`Trainer`; override the ones you need.

    Gradients seen by the hooks: ``on_after_backward`` gets the **scaled** gradients of the
    whole window (before unscale); ``on_before_optimizer_step`` the unscaled, clipped ones.
    """

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_microbatch_end(self, trainer: Trainer, state: TrainState) -> None: ...

    def on_after_backward(self, trainer: Trainer, state: TrainState) -> None: ...

    def on_before_optimizer_step(self, trainer: Trainer, state: TrainState) -> None: ...

    def on_step_end(self, trainer: Trainer, state: TrainState) -> None: ...

    def on_log(self, trainer: Trainer, state: TrainState, records: list[StepRecord],
               losses: list[float]) -> None: ...

    def on_fit_end(self, trainer: Trainer, summary: RunSummary) -> None: ...
