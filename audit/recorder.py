"""The call tracker: what the instrumented calls mean (per-optimizer windows, step records).

Vocabulary. A *window* of an optimizer is what happens between two of its step events: the
backward passes that accumulate into its gradients (the microbatches), then the step phase
(unscale, clipping, the step). A *step event* is ``scaler.step(optimizer)`` (applied or skipped)
or a direct ``optimizer.step()``; steps are numbered from 0 per optimizer, skipped ones
included, as the spec's ``StepRecord.step``. Calls after a step event and before the next
window's first backward (``scaler.update``, ``scheduler.step``, ``torch.save``) belong to that
step.

Closure steps (`audit.closures`). ``optimizer.step(closure)`` runs the closure, and so the
step's backward passes, inside the step: after torch's step pre-hook, before the update. The
pre-hook hands the step a wrapped closure; the backward passes it runs belong to the step's own
window (the step closes at the post-hook), and the step phase (the copies of the gradients,
parameters and state the update reads, the order checks of a direct step) begins when the
closure has returned, with whatever clipping it did (Lightning's ``gradient_clip_val``) as the
window's first step-phase call. The Lightning ``Trainer`` in automatic optimization steps so
under ``32-true`` and ``bf16-mixed``; under ``16-mixed`` its plugin runs the closure before
``scaler.step``, an ordinary window. A step whose optimizer evaluates the closure several times
(LBFGS) or whose step runs another optimizer's step on the same parameters (a SAM-style wrapper:
that base step is recorded and replayed as its own) is recorded and checked by the order rules
and is not replayed, with the reason. A ``zero_grad`` after the parameters moved since the
window's last backward, without a step of that optimizer (SAM's ascent, a line search's move),
starts the window's passes again: the earlier gradients were used, not accumulated. A
``zero_grad`` of an optimizer zeroes the gradients of every optimizer holding its parameters.

The recorder records; the rules decide. Each rule is declared on its check (`audit.rules` lists
them by family), a function that reads what the recorder recorded and yields findings, and the
recorder runs it at the event it reads (`_report`), so that a finding names the call site:

- the GradScaler's calls (`audit.track_scaler`) advance each optimizer's stage in the scaler's
  call sequence through the specification's own stage functions (`audit.sequence`, driving
  `reference.scaling.unscale_stage`, `step_stage` and `check_update`); each call is an event
  (the stage before, the spec's stage after, the spec's refusal, which is the exception torch
  raises), read by `audit.checks_scaler`; the clipping calls read the same stage
  (`audit.checks_clipping`: "unscaled" is the spec's UNSCALED);
- the optimizer, scheduler, backward, autocast and ``torch.save`` calls
  (`audit.track_optimizer`, `audit.track_program`) are read by `audit.checks_steps` and
  `audit.checks_program`; a window's backward passes are described for loss-not-divided when
  they start (`audit.windows`) and judged when its step closes;
- the replay's boundaries and divergences are read by `audit.checks_numbers` (in the replay).

A check that would repeat itself (one finding per window, per optimizer, per update) is run until
it finds; the flag that says so is the recorder's (``zero_flagged``, ``reported_no_update``).
What the recorder keeps is in `audit.records`.

Only optimizers and scalers created under the audit have a construction site; one created
before an audit began (the context manager inside a running program) is first seen at its first
call, and optimizer-before-to is not checked for it.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from audit import _torch_compat  # noqa: F401  (checks the private torch names the audit uses)
from audit.reductions import find_reductions
from audit.records import (Backward, OptTrack, ScalerTrack, Snapshots, StepData, StepLimitReached, StepRecord,
                           Window, _f32, _num, _settings, _unwrap_optimizer, parameter_names, plain_tensor)
from audit.records import _classify, _loss_factor, call_site  # noqa: F401  (the tests read these here)
from audit.records import _signature
from audit.events import StepClosed
from audit.rules import Finding, dispatch
from audit.track_optimizer import OptimizerCalls
from audit.track_program import ProgramCalls
from audit.track_scaler import ScalerCalls

__all__ = ["Recorder", "StepRecord", "StepLimitReached"]


class Recorder(ScalerCalls, OptimizerCalls, ProgramCalls):
    """Receives the instrumented calls, keeps the windows and records, runs each rule's check.

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
        self.reductions: list[dict[str, Any]] = []  # audit.reductions: the DDP/FSDP2 settings
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
        if getattr(obj, "optimizer", None) is not None:  # a framework's wrapper (no call for a torch optimizer)
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

    def _report(self, found: Iterable[Finding]) -> list[Finding]:
        """The findings of one check (a generator), kept; returns them (empty: the check found nothing)."""
        if type(found) is not list:
            found = list(found)
        if found:
            self.findings.extend(found)
        return found

    def _replace(self, old: Finding | None, new: Finding) -> None:
        """A check's finding that supersedes an earlier one of its own (a warning made certain)."""
        for i, f in enumerate(self.findings):
            if f is old:
                self.findings[i] = new
                return
        self.findings.append(new)

    def _current_step(self) -> int | None:
        return self.primary.steps if self.primary is not None else (0 if self.optimizers else None)

    def _owners(self, tensors: Iterable[Any]) -> list[OptTrack]:
        ids = set(map(id, tensors))
        return [o for o in self.optimizers.values() if not o.param_ids.isdisjoint(ids)]

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
        if o.names is None and any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
            o.names = parameter_names(o.obj, params)  # update-lost-to-rounding names them in the report
        d.unsampled, d.sample = self.replayer.sample_for(o, params)  # audit.sampling: what the replay takes
        if d.unsampled:
            return d
        if self.snap.pool is not None:
            # Gradients up to three times (scaled, clipped, stepped), parameters and state twice
            # (of a sample: the share it takes).
            state = [v for p in params for v in o.obj.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
            share = 1.0 if d.sample is None else d.sample.elements / max(sum(d.sample.sizes), 1)
            self.snap.pool.expect(int(sum(3 * p.numel() * p.element_size() for p in params)
                                      + share * sum(2 * p.numel() * p.element_size() for p in params)
                                      + share * sum(2 * v.numel() * v.element_size() for v in state)))
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
            d.scale = _f32(scaler.scale())
        w.data = d

    # ------------------------------------------------------------------ steps

    def _close_step(self, o: OptTrack, applied: bool, scaler: ScalerTrack | None, found_inf: float | None) -> None:
        w = o.window
        if self.primary is None:
            self.primary = o
            self.reductions = find_reductions()  # the wrappers exist by the first step
        if o is self.primary:
            self._check_saves()
        k = len(w.backwards)
        self._report(dispatch(StepClosed(o.label, o.steps, w.backwards)))
        groups = o.obj.param_groups
        rec = StepRecord(step=o.steps, optimizer=o.label, microbatches=k, calls=list(w.calls),
                         applied=bool(applied), lr=_num(groups[0].get("lr")) if groups else None,
                         hyperparameters=[_settings(g) for g in groups])
        if scaler is not None and scaler.used:
            rec.scale_before = float(w.data.scale) if w.data is not None and w.data.scale is not None \
                else float(scaler.scale())
        if found_inf is not None:
            rec.found_inf = bool(found_inf != 0.0)
        if w.clip_norms:
            rec.grad_norm, rec.max_norm = w.clip_norms[0]
        self.records.append(rec)
        self._schedule_step(o, rec)
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
        for o in list(self.optimizers.values()):
            self.unseen_step(o)
        for s in self.scalers.values():
            if completed and s.enabled:
                self._end_of_run(s)
            self._flush_pending(s)
        self._check_saves()
        for o in self.optimizers.values():
            self._schedule_end(o)
        if self.replayer is not None:
            self.replayer.finish(self)
