"""What the schedule rules read: where each schedule stood at each optimizer step.

Two records per optimizer, kept at the close of each of its steps:

- the position of every torch ``LRScheduler`` of the optimizer (``last_epoch``; a count of its
  calls where it has none) when the step ran: the learning rate a step used comes from that
  position. An *advance* is a position higher at a step than at the step before. An advance is
  due to skipped steps when every optimizer step since the scheduler's previous advance was
  skipped (at least one): the schedule moved without an update to pay for it. A schedule
  stepped per iteration is then ahead by one at each skipped step it followed; one stepped per
  epoch (or every k iterations) is due to skipped steps only when its whole interval was
  skipped: an epoch that applied updates earned its advance, whether or not its last step was
  skipped. Advances before the first optimizer step (a resumed scheduler stepped at the start of
  the first epoch, or returned to its built position) follow no skipped step. Only schedulers the
  program moved forward itself with ``step()`` are judged (the children of ``SequentialLR`` move
  with their parent; ``load_state_dict`` moves a scheduler to where a checkpoint left it).
  This module records every advance; `audit.checks_steps.scheduler_on_skipped_step` decides;
- the scheduled hyperparameters (``lr``, ``weight_decay``, ``momentum``, ``betas``) of every
  group, read at every step whoever set them. When they differ between a skipped step and the
  next, and they are not exactly what an ``LRScheduler`` of the optimizer set since (its moves
  are judged by position, above), a schedule the audit cannot see advanced across that skipped
  step. `audit.checks_steps.lr_changed_on_skipped_step` decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ScheduleWatch", "Change", "Advance", "SCHEDULED"]

SCHEDULED = ("lr", "weight_decay", "momentum", "betas")


def _show(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_show(x) for x in v) + ")"
    try:
        return f"{float(v):.6g}"
    except (TypeError, ValueError):
        return repr(v)


def scheduled(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The scheduled hyperparameters of each group (of a step record's ``hyperparameters``)."""
    return [{k: g[k] for k in SCHEDULED if k in g} for g in groups]


@dataclass(frozen=True)
class Change:
    """The scheduled hyperparameters that moved between skipped step ``step`` and the next step,
    taken at ``where``, and whether they are what an ``LRScheduler`` of the optimizer set between
    them (``by_scheduler``: that move is judged by the scheduler's position)."""

    step: int
    where: str
    moved: list[str]
    by_scheduler: bool


@dataclass(frozen=True)
class Advance:
    """Scheduler ``scheduler`` stood at ``after`` at the step after ``step``, and at ``before`` at
    ``step``; ``by_call``: a ``step()`` of the program (at ``where``) moved it forward; ``since``:
    the optimizer's steps since the scheduler's previous advance, ``applied`` of them applied."""

    scheduler: str
    where: str
    step: int
    before: int
    after: int
    by_call: bool
    since: int
    applied: int


class _Tracked:
    """One LRScheduler of the optimizer: its position at the last step, and the optimizer's step
    and applied-step counts when it last advanced (the anchor)."""

    def __init__(self, obj: Any, pos: int, steps: int, applied: int) -> None:
        self.obj = obj
        self.name = type(obj).__name__
        self.calls = 0  # its calls: the position of a scheduler with no last_epoch
        self.pos = pos
        self.anchor = (steps, applied)
        self.moved = False  # a step() of the program moved it forward since the last optimizer step
        self.where = "?"  # that call
        self.before: int | None = None

    def position(self) -> int:
        pos = getattr(self.obj, "last_epoch", None)
        return pos if isinstance(pos, int) and not isinstance(pos, bool) else self.calls

    def advance(self, steps: int, applied: int) -> Advance | None:
        """At a step, before the optimizer's ``steps`` (``applied`` of them applied): the advance
        since the last step (None: none); any move, back or forward, moves the anchor."""
        now, moved, self.moved = self.position(), self.moved, False
        if now == self.pos:
            return None
        before, self.pos = self.pos, now
        since, earned = steps - self.anchor[0], applied - self.anchor[1]
        self.anchor = (steps, applied)
        return Advance(self.name, self.where, steps - 1, before, now, moved, since, earned) if now > before else None


class ScheduleWatch:
    """Per optimizer: its schedulers' positions and the scheduled hyperparameters at each step (a
    record; the checks of `audit.checks_steps` decide)."""

    def __init__(self) -> None:
        self.steps = 0
        self.applied = 0
        self.scheduler_set: list[dict[str, Any]] | None = None  # what an LRScheduler set since the last step
        self.changes: list[Change] = []
        self._tracked: dict[int, _Tracked] = {}

    def _track(self, sched: Any, first_seen: bool, last_applied: bool) -> _Tracked:
        t = self._tracked.get(id(sched))
        if t is None or t.obj is not sched:
            steps, applied = self.steps, self.applied
            if first_seen and steps:
                # Built before the audit: its previous advance is taken to be just before the last step.
                steps, applied = steps - 1, applied - int(last_applied)
            t = _Tracked(sched, 0, steps, applied)
            t.pos = t.position()
            self._tracked[id(sched)] = t
        return t

    def on_built(self, sched: Any) -> None:
        """The constructor's own first step ended: the position the scheduler was built at."""
        t = self._track(sched, False, False)
        t.pos, t.anchor = t.position(), (self.steps, self.applied)

    def on_call(self, sched: Any, last_applied: bool) -> None:
        """The program calls ``sched.step()`` (``last_applied``: whether the optimizer's last step
        was applied, for a scheduler first seen now)."""
        t = self._track(sched, True, last_applied)
        t.before = t.position()

    def on_call_end(self, sched: Any, where: str, groups: list[dict[str, Any]]) -> None:
        """That call returned; ``groups``: the scheduled hyperparameters it left."""
        t = self._tracked.get(id(sched))
        if t is None or t.before is None:
            return
        t.calls += 1
        if t.position() > t.before:
            t.where, t.moved = where, True
        t.before = None
        self.scheduler_set = groups

    def on_step(self, previous: Any, rec: Any, where: Callable[[Any], str]) -> list[Advance]:
        """At the close of ``rec``, the step after ``previous`` (its record, None at the first):
        the schedulers' advances since the last step. ``where(rec)``: where the step was taken,
        looked up only for a change to record (after a skipped step), not at every step."""
        found = [a for t in self._tracked.values() if (a := t.advance(self.steps, self.applied)) is not None]
        set_by, self.scheduler_set = self.scheduler_set, None
        self.steps += 1
        self.applied += int(rec.applied)
        if previous is None or previous.applied:
            return found
        a_groups, b_groups = scheduled(previous.hyperparameters), scheduled(rec.hyperparameters)
        moved = [f"group {gi} {key} {_show(a[key])} -> {_show(b[key])}"
                 for gi, (a, b) in enumerate(zip(a_groups, b_groups)) for key in SCHEDULED
                 if key in a and key in b and a[key] != b[key]]
        if moved:
            self.changes.append(Change(previous.step, where(rec), moved, set_by is not None and set_by == b_groups))
        return found

    def at_end(self) -> list[Advance]:
        """At the end of the run: the schedulers' advances since the last step."""
        return [a for t in self._tracked.values() if (a := t.advance(self.steps, self.applied)) is not None]
