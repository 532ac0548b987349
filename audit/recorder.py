"""What the instrumented calls mean: per-optimizer windows, step records and the order rules.

Vocabulary. A *window* of an optimizer is what happens between two of its step events: the
backward passes that accumulate into its gradients (the microbatches), then the step phase
(unscale, clipping, the step). A *step event* is ``scaler.step(optimizer)`` (applied or skipped)
or a direct ``optimizer.step()``; steps are numbered from 0 per optimizer, skipped ones
included, as the spec's ``StepRecord.step``. Calls after a step event and before the next
window's first backward (``scaler.update``, ``scheduler.step``, ``torch.save``) belong to that
step.

How each order rule is decided (the rule texts are in `audit.rules`):

- clip-before-unscale: a clipping call on an optimizer's parameters in a window whose backward
  started from a loss scaled by an enabled GradScaler, before that scaler's ``unscale_`` for the
  optimizer.
- clip-threshold-scaled: ``clip_grad_norm_`` after ``unscale_`` with a threshold that tracks the
  loss scale: a warning when it is at least the scale while the scale is at least 2**10 (rarely
  meant, but possible), an error once the threshold changed across steps by exactly the factor
  the scale changed by. The first step is the first step of that pattern; an infinite threshold
  (a norm measured, nothing clipped) is never a finding.
- unscale-twice: a second ``unscale_`` on the same optimizer before ``update`` (torch raises
  right after); or, from the numbers, gradients reaching the next stage equal to the unscaled
  gradients unscaled once more (by the inverse or by a division by the scale), after
  ``unscale_`` or before ``scaler.step`` unscales them, decided in `audit.boundaries`.
- step-without-update: ``scaler.step(optimizer)`` not followed by ``scaler.update()`` before the
  scaler scales the next loss or steps that optimizer again (torch raises at that second step),
  or by the end of the run.
- update-without-step: ``scaler.update()`` when no ``scaler.step`` ran since the last update;
  the message names the direct ``optimizer.step()`` when there was one.
- step-bypasses-scaler: a direct ``optimizer.step()`` on gradients of a scaled loss, with no
  ``scaler.update()`` before the next scaled loss.
- scheduler-on-skipped-step: ``scheduler.step()`` when the scheduler's optimizer applied no step
  since that scheduler's previous step (a skipped step, or no step yet). The constructor's own
  initial step is not counted.
- zero-grad-in-window: ``zero_grad`` (of the optimizer, or of a module holding its parameters)
  after a backward pass of the window and before its step.
- loss-not-divided: a window of k >= 2 backward passes whose every loss reached backward
  undivided, and which are microbatches of one loss (`audit.windows` says how several losses
  in one step are told apart; an error only when certain, else a warning). The factor by which a microbatch's gradient enters the accumulation is read from
  the autograd graph at backward: the chain of multiplications and divisions by constants (and
  dtype casts) between the tensor backward starts from and the loss that the last other
  operation produced, the GradScaler's own multiplication excluded. A factor of exactly 1 means
  nothing divided the loss. Any other factor passes (a loss divided by the batch size times k
  is as right as one divided by k). Gradient magnitudes alone cannot decide this: a window's
  undivided gradients are k times larger, which no gradient distinguishes from a k times
  larger loss.
- backward-in-autocast (a warning): a backward pass while autocast is enabled.
- checkpoint-without-scaler: the ``torch.save`` calls between two steps saved optimizer state
  (an optimizer, or a dict with ``state`` and ``param_groups``) and no scaler state (a GradScaler,
  or a dict with its five keys), while an enabled GradScaler has scaled a loss. Several files
  saved after one step count as one checkpoint (Accelerate saves the scaler in a file of its own).
  A warning instead of an error when ``scaler.state_dict()`` was called since the step: that
  state may be written by means the audit does not see.
- new-scaler-mid-run: an enabled GradScaler's first ``scale()`` after another enabled scaler
  completed an update, without ``load_state_dict`` on the new one first, decided when the new
  scaler first unscales or steps an optimizer: only when that optimizer holds parameters the
  earlier scaler drove (a second, independent training in one script is no finding).
- lr-changed-on-skipped-step (a warning): `audit.schedules`.
- gradients-modified-before/after-unscale (info), scale-twice and unscale-twice from the numbers:
  `audit.boundaries`, decided by the replay.
- optimizer-before-to: at a step, a parameter's dtype differs from when the optimizer received
  it, or its device does while the optimizer already holds state for it (or was built fused).
  A device move of a parameter with no state yet is not flagged: parameters keep their identity
  across ``Module.to``, and the optimizer creates their state on the new device (this is what
  Lightning Fabric's and Accelerate's ``setup``/``prepare`` do after the optimizer is built).

Where: this module keeps the windows, closes the steps and runs the end-of-run rules; the
handlers of each family of calls are its parts `audit.track_scaler`, `audit.track_optimizer`
and `audit.track_program`; what they record is in `audit.records`.

Only optimizers and scalers created under the audit have a construction site; one created
before an audit began (the context manager inside a running program) is first seen at its first
call, and optimizer-before-to is not checked for it.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from audit import _torch_compat  # noqa: F401  (checks the private torch names the audit uses)
from audit import windows
from audit.records import (Backward, OptTrack, ScalerTrack, Snapshots, StepData, StepLimitReached, StepRecord,
                           Window, _f32, _jsonish, _num, _step_call, _unwrap_optimizer, plain_tensor, s_where)
from audit.records import _classify, _loss_factor, call_site  # noqa: F401  (the tests read these here)
from audit.records import _signature
from audit.rules import WARNING, Finding
from audit.track_optimizer import OptimizerCalls
from audit.track_program import ProgramCalls
from audit.track_scaler import ScalerCalls

__all__ = ["Recorder", "StepRecord", "StepLimitReached"]


class Recorder(ScalerCalls, OptimizerCalls, ProgramCalls):
    """Receives the instrumented calls, keeps the windows and records, decides the order rules.

    ``replay``: a `audit.replay.Replayer` (None: order rules only, no numbers copied).
    ``steps``: stop the program at the first backward pass after this many steps of the first
    optimizer that steps (None: run to the end).
    """

    def __init__(self, replay: Any = None, steps: int | None = None) -> None:
        self.replayer = replay
        self.steps_limit = steps
        self.findings: list[Finding] = []
        self.records: list[StepRecord] = []
        self.scalers: dict[int, ScalerTrack] = {}
        self.optimizers: dict[int, OptTrack] = {}
        self.primary: OptTrack | None = None
        self.unassigned = Window()
        self.in_clip = False
        self._bw_depth = 0
        self._bw_signature: dict[int, list[tuple[Any, int]]] | None = None
        self._bw_pending: Backward | None = None
        self._bw_autocast: str | None = None
        self._sched_depth = 0
        self._in_scaler_step: tuple[ScalerTrack, OptTrack] | None = None
        self._scaled: dict[int, tuple[Any, ScalerTrack, Any]] = {}
        self._autocast: list[tuple[Any, str]] = []
        self._saves: list[tuple[str, bool, bool, int | None]] = []
        self._scaler_state_read: str | None = None
        self._names: dict[str, int] = {}
        self.stopped_at_limit = False
        self.snap = Snapshots(getattr(replay, "pool", None))

    # ------------------------------------------------------------------ helpers

    def _label(self, obj: Any) -> str:
        base = type(obj).__name__
        n = self._names.get(base, 0)
        self._names[base] = n + 1
        return f"{base}#{n}"

    def _scaler(self, obj: Any, where: str | None = None) -> ScalerTrack:
        t = self.scalers.get(id(obj))
        if t is None or t.obj is not obj:
            t = ScalerTrack(obj, self._label(obj), where)
            self.scalers[id(obj)] = t
        return t

    def _opt(self, obj: Any, where: str | None = None) -> OptTrack:
        obj = _unwrap_optimizer(obj)
        t = self.optimizers.get(id(obj))
        if t is None or t.obj is not obj:
            t = OptTrack(obj, self._label(obj), where)
            t.refresh_ids()
            if where is None:
                # First seen mid-program: it takes the backward passes no optimizer claimed.
                t.window, self.unassigned = self.unassigned, Window()
            self.optimizers[id(obj)] = t
        return t

    def _find(self, rule: str, step: int | None, where: str, message: str, expected: Any = None,
              got: Any = None, level: str | None = None) -> Finding:
        f = Finding(rule, step, where, message, expected, got, level)
        self.findings.append(f)
        return f

    def _current_step(self) -> int | None:
        return self.primary.steps if self.primary is not None else (0 if self.optimizers else None)

    def _owners(self, tensors: Iterable[Any]) -> list[OptTrack]:
        ids = {id(t) for t in tensors}
        return [o for o in self.optimizers.values() if o.param_ids & ids]

    def _new_data(self, o: OptTrack, stage: str) -> StepData:
        """A window's step data, its copies to come sized in the pool (or why none are taken)."""
        d = StepData(first_stage=stage)
        params = o.params()
        foreign = next((t for p in params for t in (p, p.grad) if t is not None and not plain_tensor(t)), None)
        if foreign is not None:
            # A DTensor (FSDP2's sharded parameters) holds one rank's shard; its numbers need the
            # other ranks' to be replayed, and it cannot be copied to NumPy as it is.
            d.unsupported = f"{type(foreign).__name__} parameters or gradients (sharded tensors)"
            return d
        if self.snap.pool is not None:
            # Gradients up to three times (scaled, clipped, stepped), parameters and state twice.
            state = [v for p in params for v in o.obj.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
            self.snap.pool.expect(sum(5 * p.numel() * p.element_size() for p in params)
                                  + sum(2 * v.numel() * v.element_size() for v in state))
        d.on_cpu = all(p.device.type == "cpu" for p in params)
        hooks = [*getattr(o.obj, "_optimizer_step_pre_hooks", {}).values(),
                 *getattr(o.obj, "_optimizer_step_post_hooks", {}).values()]
        if hooks:
            d.hooks = ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in hooks)
        return d

    def _backward_copy(self, o: OptTrack) -> None:
        """After a backward pass of a loss an enabled scaler scaled: its gradients (the conformance
        boundary), so that a change before the scaler sees them is measured, not taken as given."""
        w = o.window
        if w.data is not None and w.data.first_stage != "backward":
            return  # a backward after the step phase began (a second loss): the scaler saw the first
        d = self._new_data(o, "backward")
        if d.copying:
            d.backward = self.snap.grads(o.params(), d)
            d.versions = _signature(o)
        w.data = d  # a previous microbatch's copy is garbage now: its slabs go back to the pool

    def _start_data(self, o: OptTrack, stage: str, scaler: ScalerTrack | None) -> None:
        """The window's first step-phase call: copy the gradients as that call receives them."""
        w = o.window
        if self.replayer is None or (w.data is not None and w.data.first_stage != "backward"):
            return
        d = w.data if w.data is not None else self._new_data(o, stage)
        d.first_stage = stage
        if d.copying and d.backward is not None and _signature(o) == d.versions:
            # Untouched since backward, as far as torch's version counters tell: the same copy. An
            # edit they do not count (through ``.data``) shows at the next boundary instead.
            d.scaled, d.backward = d.backward, None
        elif d.copying:
            d.scaled = self.snap.grads(o.params(), d)
        if scaler is not None and scaler.enabled and scaler.used:
            d.scale = _f32(scaler.obj.get_scale())
        w.data = d

    # ------------------------------------------------------------------ steps

    def _close_step(self, o: OptTrack, applied: bool, scaler: ScalerTrack | None, found_inf: float | None) -> None:
        w = o.window
        if self.primary is None:
            self.primary = o
        if o is self.primary:
            self._check_saves()
        k = len(w.backwards)
        verdict = windows.undivided_verdict(w.backwards)
        if verdict is not None:
            level, seen = verdict
            msg = (f"the {k} losses of the window of step {o.steps} reached backward (first at "
                   f"{w.backwards[0].where}) undivided ({seen})")
            msg += (f": the accumulated gradient is {k} times the mean" if level == "error" else
                    f"; if they are microbatches of one loss, the accumulated gradient is {k} times the mean")
            self._find("loss-not-divided", o.steps, w.backwards[0].where, msg, expected=f"each loss divided by {k}",
                       got="each loss undivided", level=None if level == "error" else WARNING)
        groups = o.obj.param_groups
        rec = StepRecord(step=o.steps, optimizer=o.label, microbatches=k, calls=list(w.calls),
                         applied=bool(applied), lr=_num(groups[0].get("lr")) if groups else None,
                         hyperparameters=[{k2: _jsonish(v) for k2, v in g.items() if k2 != "params"} for g in groups])
        if scaler is not None and scaler.used:
            rec.scale_before = float(w.data.scale) if w.data is not None and w.data.scale is not None \
                else float(scaler.obj.get_scale())
        if found_inf is not None:
            rec.found_inf = bool(found_inf != 0.0)
        if w.clip_norms:
            rec.grad_norm, rec.max_norm = w.clip_norms[0]
        self.records.append(rec)
        o.schedule.on_step(o.last_record, rec, _step_call(rec))
        o.skipped += int(not applied)
        o.last_record = rec
        o.steps += 1
        o.applied_steps += int(bool(applied))
        data = w.data
        o.window = Window()
        if scaler is not None:
            scaler.pending.append((o, data, rec))
        elif self.replayer is not None:
            self.replayer.step(o, data, rec, self)

    # ------------------------------------------------------------------ the end

    def finish(self, completed: bool) -> None:
        """End of the audited program: flush what waits, and the end-of-run rules when it completed."""
        for s in self.scalers.values():
            if completed and s.enabled:
                for key, o in list(s.stepped.items()):
                    if key not in s.reported_no_update:
                        s.reported_no_update.add(key)
                        self._find("step-without-update", o.steps - 1, s_where(o),
                                   f"the run ended after scaler.step({o.label}) at {s_where(o)} without "
                                   "scaler.update()", expected="scaler.update() after scaler.step",
                                   got="no scaler.update()")
                for key, (o, bwhere) in list(s.bypass.items()):
                    self._find("step-bypasses-scaler", o.steps - 1, bwhere,
                               f"{o.label}.step() at {bwhere} applied gradients of a loss scaled by {s.label} "
                               "without scaler.step or scaler.update",
                               expected="scaler.step(optimizer); scaler.update()", got="optimizer.step()")
                s.bypass.clear()
            self._flush_pending(s)
        self._check_saves()
        for o in self.optimizers.values():
            found = o.schedule.finding(o.label, o.skipped)
            if found is not None:
                self._find("lr-changed-on-skipped-step", found[0], found[1], found[2],
                           expected="the hyperparameters of the skipped step kept", got="changed")
        if self.replayer is not None:
            self.replayer.finish(self)
