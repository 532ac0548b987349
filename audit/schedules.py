"""lr-changed-on-skipped-step: a schedule the audit cannot see, advanced by a skipped step.

Most loops set ``param_group["lr"]`` themselves (a function of the iteration count) or use a
scheduler that is no torch ``LRScheduler`` (timm's, DINO's arrays of values per iteration). The
audit reads every group's hyperparameters at every optimizer step, whoever set them (the
step's record). When a hyperparameter a schedule moves (``lr``, ``weight_decay``, ``momentum``,
``betas``) differs between a skipped step and the next step, and no ``LRScheduler`` of that
optimizer stepped between them (that is ``scheduler-on-skipped-step``, an error), the schedule
advanced across the skipped step. A warning: a schedule may be meant to follow iterations
rather than applied updates. One finding per optimizer, at the first such step, saying how many
skipped steps advanced it and by how much.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ScheduleWatch"]

SCHEDULED = ("lr", "weight_decay", "momentum", "betas")


def _show(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_show(x) for x in v) + ")"
    try:
        return f"{float(v):.6g}"
    except (TypeError, ValueError):
        return repr(v)


class ScheduleWatch:
    """Per optimizer: the changes of scheduled hyperparameters across its skipped steps."""

    def __init__(self) -> None:
        self.scheduler_stepped = False  # an LRScheduler of this optimizer stepped since its last step
        self.changes: list[tuple[int, list[str]]] = []  # (skipped step, what changed)
        self.where: str | None = None

    def on_step(self, previous: Any, rec: Any, where: str) -> None:
        """At the close of ``rec``, the step after ``previous`` (its record, None at the first)."""
        stepped, self.scheduler_stepped = self.scheduler_stepped, False
        if previous is None or previous.applied or stepped:
            return
        moved = []
        for gi, (a, b) in enumerate(zip(previous.hyperparameters, rec.hyperparameters)):
            for key in SCHEDULED:
                if key in a and key in b and a[key] != b[key]:
                    moved.append(f"group {gi} {key} {_show(a[key])} -> {_show(b[key])}")
        if moved:
            self.changes.append((previous.step, moved))
            self.where = self.where or where

    def finding(self, label: str, skipped: int) -> tuple[int, str, str] | None:
        """(step, where, message) of the one finding for this optimizer, None without changes."""
        if not self.changes:
            return None
        steps = [s for s, _ in self.changes]
        first = "; ".join(self.changes[0][1][:4])
        return steps[0], self.where or "?", (
            f"the schedule of {label} advanced across {len(steps)} of its {skipped} skipped step(s) (steps "
            f"{', '.join(map(str, steps[:10]))}{', ...' if len(steps) > 10 else ''}) with no LRScheduler stepping; "
            f"after step {steps[0]}: {first}: the schedule runs {len(steps)} step(s) ahead of the applied updates")
