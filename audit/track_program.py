"""The recorder's other calls: LR schedulers, autocast, backward and torch.save.

Runs the checks of backward-in-autocast and checkpoint-without-scaler (`audit.checks_program`)
at the calls they read, and those of scheduler-on-skipped-step and lr-changed-on-skipped-step
(`audit.checks_steps`) at each step's close and the run's end, from where the schedules stood
(`audit.schedules`); describes each backward pass for loss-not-divided (`audit.windows`).
"""

from __future__ import annotations

from typing import Any

import torch

from audit import windows
from audit.events import BackwardCall, CheckpointSaved, ScheduleAdvance, ScheduleAtEnd
from audit.records import (Backward, StepLimitReached, Window, OptTrack, _jsonish, _signature, _step_call, _touched,
                           call_site)
from audit.rules import dispatch
from audit.saved import classify
from audit.track_optimizer import state_signature
from audit.schedules import SCHEDULED


class ProgramCalls:
    """The scheduler, autocast, backward and torch.save handlers of `audit.recorder.Recorder`."""

    # ------------------------------------------------------------------ schedulers

    def on_scheduler_step_begin(self, sched: Any, initial: bool) -> None:
        self._sched_depth += 1
        opt = getattr(sched, "optimizer", None)
        if self._sched_depth > 1 or opt is None or initial:
            return  # a constructor's own first step is read at its end (the position built)
        o = self._opt(opt)
        o.schedule.on_call(sched, o.last_record is not None and o.last_record.applied)
        if o.last_record is not None:
            o.last_record.calls.append(f"scheduler.step@{call_site()}")

    def on_scheduler_step_end(self, sched: Any, initial: bool) -> None:
        self._sched_depth -= 1
        opt = getattr(sched, "optimizer", None)
        if self._sched_depth > 0 or opt is None:
            return
        o = self._opt(opt)
        if initial:
            o.schedule.on_built(sched)
            return
        groups = [{k: _jsonish(g[k]) for k in SCHEDULED if k in g} for g in o.obj.param_groups]
        o.schedule.on_call_end(sched, call_site(), groups)

    def _schedule_step(self, o: OptTrack, rec: Any) -> None:
        """At the close of step ``rec`` of ``o``: its schedulers' advances due to skipped steps."""
        for advance in o.schedule.on_step(o.last_record, rec, _step_call):
            self._report(dispatch(ScheduleAdvance(o.label, advance)))

    def _schedule_end(self, o: OptTrack) -> None:
        """At the end of the run: the advances since ``o``'s last step, and the hand-set schedule."""
        for advance in o.schedule.at_end():
            self._report(dispatch(ScheduleAdvance(o.label, advance)))
        self._report(dispatch(ScheduleAtEnd(o.label, o.skipped, o.schedule.changes)))

    # ------------------------------------------------------------------ autocast

    def on_autocast_enter(self, ac: Any) -> None:
        self._autocast.append((ac, call_site()))

    def on_autocast_exit(self, ac: Any) -> None:
        for i in range(len(self._autocast) - 1, -1, -1):
            if self._autocast[i][0] is ac:
                del self._autocast[i]
                break

    def _autocast_active(self) -> str | None:
        for ac, where in reversed(self._autocast):
            if getattr(ac, "_enabled", False):
                return where
        for dev in ("cpu", "cuda"):
            try:
                if torch.is_autocast_enabled(dev):
                    return "a region entered before the audit"
            except (RuntimeError, TypeError):
                continue
        return None

    # ------------------------------------------------------------------ backward

    def on_backward_begin(self, tensors: Any, gradient: Any = None, retain: Any = None) -> None:
        """``gradient``: the gradients backward was given (None for a scalar loss); ``retain``:
        its ``retain_graph`` (or ``create_graph``), which keeps the graph for another backward."""
        self._bw_depth += 1
        if self._bw_depth > 1:
            return
        if self.steps_limit is not None and self.primary is not None and self.primary.steps >= self.steps_limit:
            self._bw_depth -= 1
            self.stopped_at_limit = True
            raise StepLimitReached(f"{self.steps_limit} steps audited")
        for o in list(self.optimizers.values()):
            self.unseen_step(o)
        where = call_site()
        root = tensors if isinstance(tensors, torch.Tensor) else (
            tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) == 1 and
            isinstance(tensors[0], torch.Tensor) else None)
        scaler, factor, node = None, None, None
        explicit = gradient is not None and not (isinstance(gradient, (list, tuple)) and
                                                 all(g is None for g in gradient))
        if root is not None:
            entry = self._scaled.pop(id(root), None)
            start = root
            if entry is not None and entry[0]() is root:
                scaler = entry[1]
                start = entry[2]()
            if start is not None:
                factor, node = windows.describe(start, bool(retain), explicit)
                explicit = explicit or start.numel() != 1
        self._bw_pending = Backward(where, factor, scaler, node, bool(retain), explicit)
        self._bw_signature = {id(o): _signature(o) for o in self.optimizers.values()}
        self._bw_autocast = self._autocast_active()

    def on_backward_end(self, ok: bool) -> None:
        self._bw_depth -= 1
        if self._bw_depth > 0:
            return
        b, self._bw_pending = self._bw_pending, None
        if b is None or not ok:
            return
        sig = self._bw_signature or {}
        self._bw_signature = None
        touched = {id(o): _touched(o, sig.get(id(o))) for o in self.optimizers.values()}
        b.params = frozenset().union(*touched.values())
        if not self.optimizers:
            targets = [self.unassigned]
        elif len(self.optimizers) == 1:
            targets = [next(iter(self.optimizers.values())).window]
        else:
            targets = [o.window for o in self.optimizers.values() if touched[id(o)]]
        for w, o in ((w, self._owner_of(w)) for w in targets):
            w.backwards.append(b)
            w.hooked = False
            if o is not None:  # where the parameters were, for a zero_grad after they move (track_optimizer)
                w.versions = [p._version for p in o.params()]
                w.state = state_signature(o)
            w.calls.append(f"backward@{b.where}")
            if b.scaler is not None:
                w.scaler = b.scaler
                if self.replayer is not None and o is not None and b.scaler.enabled:
                    self._backward_copy(o)
            if o is not None:
                self.before_compiled_step(o)
            step = o.steps if o is not None else self._current_step()
            if not w.autocast_flagged and self._report(dispatch(BackwardCall(step, b.where, self._bw_autocast))):
                w.autocast_flagged = True

    def _owner_of(self, w: Window) -> OptTrack | None:
        for o in self.optimizers.values():
            if o.window is w:
                return o
        return None

    # ------------------------------------------------------------------ torch.save

    def on_save(self, obj: Any) -> None:
        holds_opt, holds_scaler = classify(obj)
        where = call_site()
        if self.primary is not None and self.primary.last_record is not None:
            self.primary.last_record.calls.append(f"torch.save@{where}")
        step = self.primary.steps - 1 if self.primary is not None else None
        self._saves.append((where, holds_opt, holds_scaler, step))

    def _check_saves(self) -> None:
        """The saves since the last step of the first optimizer, for checkpoint-without-scaler."""
        saves, self._saves = self._saves, []
        read, self._scaler_state_read = self._scaler_state_read, None
        if not saves:
            return  # no checkpoint after this step: nothing to describe (every step of most runs)
        scaler = next((s for s in self.scalers.values() if s.enabled and s.used), None)
        self._report(dispatch(CheckpointSaved(saves, scaler.label if scaler is not None else None, read)))
