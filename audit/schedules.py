"""What lr-changed-on-skipped-step reads: a schedule the audit cannot see, advanced by a skipped step.

Most loops set ``param_group["lr"]`` themselves (a function of the iteration count) or use a
scheduler that is no torch ``LRScheduler`` (timm's, DINO's arrays of values per iteration). The
audit reads every group's hyperparameters at every optimizer step, whoever set them (the
step's record). When a hyperparameter a schedule moves (``lr``, ``weight_decay``, ``momentum``,
``betas``) differs between a skipped step and the next step, and no ``LRScheduler`` of that
optimizer stepped between them (that is ``scheduler-on-skipped-step``, an error), the schedule
advanced across the skipped step. A warning: a schedule may be meant to follow iterations
rather than applied updates. One finding per optimizer, at the first such step, saying how many
skipped steps advanced it and by how much. This module records the changes; the rule's check
(`audit.checks_steps.lr_changed_on_skipped_step`) decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ScheduleWatch", "Change"]

SCHEDULED = ("lr", "weight_decay", "momentum", "betas")


def _show(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_show(x) for x in v) + ")"
    try:
        return f"{float(v):.6g}"
    except (TypeError, ValueError):
        return repr(v)


@dataclass(frozen=True)
class Change:
    """The scheduled hyperparameters that moved between skipped step ``step`` and the next step,
    taken at ``where``, and whether an ``LRScheduler`` of the optimizer stepped between them."""

    step: int
    where: str
    moved: list[str]
    scheduler_stepped: bool


class ScheduleWatch:
    """Per optimizer: the changes of scheduled hyperparameters across its skipped steps (a record;
    `audit.checks_steps.lr_changed_on_skipped_step` decides)."""

    def __init__(self) -> None:
        self.scheduler_stepped = False  # an LRScheduler of this optimizer stepped since its last step
        self.changes: list[Change] = []

    def on_step(self, previous: Any, rec: Any, where: str) -> None:
        """At the close of ``rec``, the step after ``previous`` (its record, None at the first)."""
        stepped, self.scheduler_stepped = self.scheduler_stepped, False
        if previous is None or previous.applied:
            return
        moved = []
        for gi, (a, b) in enumerate(zip(previous.hyperparameters, rec.hyperparameters)):
            for key in SCHEDULED:
                if key in a and key in b and a[key] != b[key]:
                    moved.append(f"group {gi} {key} {_show(a[key])} -> {_show(b[key])}")
        if moved:
            self.changes.append(Change(previous.step, where, moved, stepped))
