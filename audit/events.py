"""The events the recorder and the replay hand to the rules (`audit.rules.dispatch`).

An event is what the audit saw at one point of the loop, frozen: the recorder builds it where the
call happened and hands it to ``dispatch``, which runs every rule whose row names the event's type
(``events``); no part of the audit calls a rule's check by name. The scaler's call sequence has
its own events (`audit.sequence.StageCall`, `audit.sequence.UpdateCall`), the replay's stage
boundaries theirs (`audit.boundaries.Boundary`); these are the rest, one per point of the loop.

Each field holds a value the recorder already had (a label, a call site, a step, a list it
keeps): an event copies nothing and reads nothing from torch. An event is a named tuple, frozen
as a frozen dataclass is but built in one step (the recorder builds about ten a step; a frozen
dataclass sets each field through ``object.__setattr__``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "BackwardCall",
    "CheckpointSaved",
    "ClipCall",
    "ClipThreshold",
    "DirectSteps",
    "Divergences",
    "OptimizerStepBegin",
    "ScalerFirstDrive",
    "ScheduleAdvance",
    "ScheduleAtEnd",
    "StepClosed",
    "StepReapplied",
    "ZeroGradCall",
]


class OptimizerStepBegin(NamedTuple):
    """``optimizer.step()`` began (torch's step pre-hook): ``track`` is the optimizer's track
    (`audit.records.OptTrack`: its parameters' device and dtype when it received them)."""

    track: Any
    where: str


class ZeroGradCall(NamedTuple):
    """``zero_grad`` (``name``: whose) at ``where`` of ``optimizer``'s parameters, with the backward
    passes of its open window (``backwards``, `audit.records.Backward`)."""

    name: str
    where: str
    optimizer: str
    step: int
    backwards: list[Any]


class ClipCall(NamedTuple):
    """A clipping call (``kind``) on ``optimizer``'s parameters in a window whose backward started
    from a loss an enabled GradScaler (``scaler``) scaled; ``stage``: the spec's stage of the
    optimizer in that scaler's call sequence (None: no enabled scaler scaled the window)."""

    kind: str
    optimizer: str
    step: int
    where: str
    stage: Any
    scaler: Any
    max_norm: float | None


class ClipThreshold(NamedTuple):
    """``clip_grad_norm_`` on unscaled gradients: its ``max_norm``, the scale then, ``held`` (the
    ratio max_norm / scale the earlier calls kept, the scale and the first step; None before the
    first) and ``earlier`` (this rule's warning for the optimizer, if any)."""

    optimizer: str
    step: int
    where: str
    max_norm: float
    scale: float
    held: tuple[float, float, int] | None
    earlier: Any


class StepClosed(NamedTuple):
    """The close of step ``step`` of ``optimizer``, with its window's backward passes."""

    optimizer: str
    step: int
    backwards: list[Any]


class BackwardCall(NamedTuple):
    """A backward pass at ``where`` during step ``step`` (None: before any optimizer), inside the
    autocast region entered at ``autocast`` (None: outside any)."""

    step: int | None
    where: str
    autocast: Any


class ScheduleAdvance(NamedTuple):
    """An LR scheduler's position moved at a step of ``optimizer`` (`audit.schedules.Advance`)."""

    optimizer: str
    advance: Any


class ScheduleAtEnd(NamedTuple):
    """The end of the run for ``optimizer``: its ``skipped`` steps and the changes of its scheduled
    hyperparameters across them (`audit.schedules.ScheduleWatch.changes`)."""

    optimizer: str
    skipped: int
    changes: list[Any]


class CheckpointSaved(NamedTuple):
    """The ``torch.save`` calls after one step (``saves``: where, holds optimizer state, holds
    scaler state (None: not read whole), the step), the enabled scaler in use (``scaler``; None:
    none) and where ``scaler.state_dict()`` was called since the step (``state_read``)."""

    saves: list[tuple[str, bool, bool | None, int | None]]
    scaler: str | None
    state_read: str | None


class DirectSteps(NamedTuple):
    """Direct ``optimizer.step()`` calls (optimizer, step, where) on gradients of a loss ``scaler``
    scaled, still without ``scaler.update()`` when the next loss is scaled at ``next_scale`` (None:
    the run ended)."""

    scaler: str
    bypasses: list[tuple[str, int, str]]
    next_scale: str | None


class StepReapplied(NamedTuple):
    """A direct ``optimizer.step()`` of ``optimizer`` at ``where`` (step ``step``) that applies the
    gradients its last ``scaler.step`` (step ``last``, ``applied`` or skipped) used, with no
    backward and no ``zero_grad`` between (`audit.restep`)."""

    scaler: str
    optimizer: str
    step: int
    where: str
    last: int
    applied: bool


class ScalerFirstDrive(NamedTuple):
    """A scaler's first optimizer: ``scaler`` and ``optimizer`` are their tracks; the scaler's first
    ``scale()`` came at ``began``, after a ``load_state_dict`` or not (``loaded``); ``earlier``: the
    scalers that completed updates before and drove parameters of this optimizer."""

    scaler: Any
    optimizer: Any
    began: str
    loaded: bool
    earlier: list[Any]


class Divergences(NamedTuple):
    """The replay's divergences that no order finding of their step explains (`audit.replay`)."""

    divergences: list[Any]
