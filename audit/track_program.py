"""The recorder's other calls: LR schedulers, autocast, backward and torch.save.

Decides scheduler-on-skipped-step, backward-in-autocast and checkpoint-without-scaler, and
describes each backward pass for loss-not-divided (`audit.windows`).
"""

from __future__ import annotations

from typing import Any

import torch

from audit import windows
from audit.records import Backward, StepLimitReached, Window, OptTrack, _classify, _signature, _touched, call_site
from audit.rules import WARNING


class ProgramCalls:
    """The scheduler, autocast, backward and torch.save handlers of `audit.recorder.Recorder`."""

    # ------------------------------------------------------------------ schedulers

    def on_scheduler_step_begin(self, sched: Any, initial: bool) -> None:
        self._sched_depth += 1
        opt = getattr(sched, "optimizer", None)
        if self._sched_depth > 1 or opt is None:
            return
        o = self._opt(opt)
        key = id(sched)
        if initial:
            o.sched_mark[key] = o.applied_steps
            return
        where = call_site()
        o.schedule.scheduler_stepped = True
        if o.last_record is not None:
            o.last_record.calls.append(f"scheduler.step@{where}")
        # A scheduler built before the audit: its previous step is taken to be just before the last step.
        mark = o.sched_mark.get(key, o.applied_steps - int(o.last_record is not None and o.last_record.applied))
        if o.applied_steps == mark:
            name = type(sched).__name__
            if o.steps == 0:
                msg = f"{name}.step() at {where} before {o.label} took any step"
            elif o.last_record is not None and not o.last_record.applied:
                msg = f"{name}.step() at {where} after step {o.steps - 1} of {o.label}, which was skipped"
            else:
                msg = f"{name}.step() at {where}: {o.label} applied no step since this scheduler's previous step"
            self._find("scheduler-on-skipped-step", max(o.steps - 1, 0), where,
                       msg + ": the learning-rate schedule advanced without an applied optimizer step",
                       expected="no scheduler.step without an applied optimizer step", got="scheduler.step")
        o.sched_mark[key] = o.applied_steps

    def on_scheduler_step_end(self, sched: Any) -> None:
        self._sched_depth -= 1

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
        b.params = frozenset(pid for t in touched.values() for pid in t)
        if not self.optimizers:
            targets = [self.unassigned]
        elif len(self.optimizers) == 1:
            targets = [next(iter(self.optimizers.values())).window]
        else:
            targets = [o.window for o in self.optimizers.values() if touched[id(o)]]
        for w, o in ((w, self._owner_of(w)) for w in targets):
            w.backwards.append(b)
            w.calls.append(f"backward@{b.where}")
            if b.scaler is not None:
                w.scaler = b.scaler
                if self.replayer is not None and o is not None and b.scaler.enabled:
                    self._backward_copy(o)
            if self._bw_autocast is not None and not w.autocast_flagged:
                w.autocast_flagged = True
                self._find("backward-in-autocast", o.steps if o is not None else self._current_step(), b.where,
                           f"backward at {b.where} ran inside the autocast region entered at {self._bw_autocast}",
                           expected="backward outside autocast", got="backward inside autocast")

    def _owner_of(self, w: Window) -> OptTrack | None:
        for o in self.optimizers.values():
            if o.window is w:
                return o
        return None

    # ------------------------------------------------------------------ torch.save

    def on_save(self, obj: Any) -> None:
        holds_opt, holds_scaler = _classify(obj)
        where = call_site()
        if self.primary is not None and self.primary.last_record is not None:
            self.primary.last_record.calls.append(f"torch.save@{where}")
        step = self.primary.steps - 1 if self.primary is not None else None
        self._saves.append((where, holds_opt, holds_scaler, step))

    def _check_saves(self) -> None:
        """checkpoint-without-scaler: an error when nothing read the scaler's state since the step;
        a warning when ``scaler.state_dict()`` was called (it may be saved by other means)."""
        saves, self._saves = self._saves, []
        read, self._scaler_state_read = self._scaler_state_read, None
        if not saves or not any(s.enabled and s.used for s in self.scalers.values()):
            return
        if any(h for _, _, h, _ in saves):
            return
        for where, holds_opt, _, step in saves:
            if holds_opt:
                scaler = next(s for s in self.scalers.values() if s.enabled and s.used)
                msg = (f"torch.save at {where} saved optimizer state without {scaler.label}'s state (no file "
                       "saved after this step holds it): a resumed run restarts the loss scale at its initial "
                       "value and loses the growth tracker")
                if read is not None:
                    msg += (f"; scaler.state_dict() was called at {read}, so the scaler state may be written by "
                            "means the audit does not see (pickle, safetensors)")
                self._find("checkpoint-without-scaler", step, where, msg,
                           expected="scaler.state_dict() in the checkpoint", got="no scaler state",
                           level=WARNING if read is not None else None)
                return
