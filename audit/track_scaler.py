"""The recorder's GradScaler calls: scale, unscale_, step, update, state_dict, load_state_dict.

Each enabled scaler's per-optimizer stage is the spec's (`audit.sequence`, driving
`reference.scaling`'s stage functions); at each call the recorder records the event (`audit.sequence.StageCall`,
`UpdateCall`) and hands it to `audit.rules.dispatch`, which runs every rule that reads it.
"""

from __future__ import annotations

import weakref
from typing import Any

from audit import sequence
from audit.events import DirectSteps, ScalerFirstDrive
from audit.records import OptTrack, ScalerTrack, _f32, _found_inf, _pairs, call_site, s_where
from audit.rules import dispatch
from reference.scaling import READY


class ScalerCalls:
    """The GradScaler handlers of `audit.recorder.Recorder` (a part of it, not used alone)."""

    # ------------------------------------------------------------------ the call sequence

    def _sequence_args(self, s: ScalerTrack, o: OptTrack, where: str, dtypes: bool = True) -> dict[str, Any]:
        """What the spec's stage functions take: whether scale() ran (torch checks its ``_scale``),
        the dtypes of the gradients present (``dtypes`` False: none read, where the stage
        function does not read them: a step after unscale_); and the event's labels."""
        dtypes = {g.dtype for p in o.params() if (g := p.grad) is not None} if dtypes else ()
        return {"optimizer": o.label, "step": o.steps, "where": where, "last_step_where": s_where(o),
                "scaled": getattr(s.obj, "_scale", None) is not None,
                "grad_dtypes": sequence.numpy_dtypes(dtypes)}

    def _stage(self, s: ScalerTrack, o: OptTrack) -> Any:
        return s.stage.get(id(o.obj), sequence.READY_STAGE)

    def _sequence_call(self, s: ScalerTrack, o: OptTrack, ev: sequence.StageCall) -> None:
        """A call of the scaler's sequence: the findings of every rule that reads it
        (`audit.rules.dispatch`), step-without-update once per optimizer between two updates
        (the recorder's flag, cleared at each update)."""
        for f in dispatch(ev):
            if f.rule == "step-without-update":
                if id(o.obj) in s.reported_no_update:
                    continue
                s.reported_no_update.add(id(o.obj))
            self.findings.append(f)

    # ------------------------------------------------------------------ GradScaler

    def on_scaler_created(self, scaler: Any) -> None:
        if self.scalers.get(id(scaler)) is not None and self.scalers[id(scaler)].obj is scaler:
            return  # a subclass's __init__ reached the base's
        self.scalers[id(scaler)] = ScalerTrack(scaler, self._label(scaler), call_site())

    def on_scale(self, scaler: Any, inputs: Any, out: Any) -> None:
        s = self._scaler(scaler)
        if not s.enabled:
            return
        where = call_site()
        if not s.used:
            s.used = True
            previous = [t for t in self.scalers.values() if t is not s and t.updates > 0 and t.enabled]
            if previous:
                s.mid_run = (previous, where, s.loaded)  # decided when it first drives an optimizer
        if s.bypass:
            # A direct optimizer.step on the last scaled loss, and no update before this one.
            self._report(dispatch(DirectSteps(s.label, self._bypasses(s), where)))
            s.bypass.clear()
            self._flush_pending(s)
        for t_in, t_out in _pairs(inputs, out):
            self._scaled[id(t_out)] = (weakref.ref(t_out), s, weakref.ref(t_in))
        if len(self._scaled) > 64:  # drop entries of tensors that are gone
            self._scaled = {k: v for k, v in self._scaled.items() if v[0]() is not None}

    def _bypasses(self, s: ScalerTrack) -> list[tuple[str, int, str]]:
        return [(o.label, o.steps - 1, where) for o, where in s.bypass.values()]

    def _drives(self, s: ScalerTrack, o: OptTrack) -> None:
        """The scaler unscales or steps ``o``: its parameters are the scaler's (new-scaler-mid-run
        reads them), decided at the scaler's first optimizer."""
        if id(o.obj) in s.driven:
            return
        s.driven[id(o.obj)] = o
        params = o.params()
        for p in params:
            s.params[id(p)] = weakref.ref(p)
        if s.mid_run is None:
            return
        previous, began, loaded = s.mid_run
        s.mid_run = None
        shared = [t for t in previous if any((r := t.params.get(id(p))) is not None and r() is p for p in params)]
        self._report(dispatch(ScalerFirstDrive(s, o, began, loaded, shared)))

    def on_unscale_begin(self, scaler: Any, optimizer: Any) -> None:
        s = self._scaler(scaler)
        if not s.enabled:
            return
        o = self._opt(optimizer)
        self._drives(s, o)
        if self._in_scaler_step is None:  # inside scaler.step the step's own event covers it
            where = call_site()
            ev = sequence.unscale_call(self._stage(s, o), **self._sequence_args(s, o, where))
            s.call[id(o.obj)] = ev
            self._sequence_call(s, o, ev)
            o.window.calls.append(f"scaler.unscale_@{where}")
        self._start_data(o, "scaler.unscale_", o.window.scaler or s)

    def on_unscale_end(self, scaler: Any, optimizer: Any, ok: bool) -> None:
        s = self._scaler(scaler)
        if not s.enabled:
            return
        o = self._opt(optimizer)
        if self._in_scaler_step is None:
            ev = s.call.pop(id(o.obj), None)
            if ev is not None:
                s.stage[id(o.obj)] = sequence.stage_after(ev, ok)
        elif ok and (ev := s.call.get(id(o.obj))) is not None and ev.left is not None:
            s.stage[id(o.obj)] = ev.left  # step's own unscale is done: what the step's optimizer sees
        if ok and o.window.data is not None:
            o.window.data.unscaled = True
            o.window.data.torch_found_inf = _found_inf(scaler, o.obj)

    def on_scaler_step_begin(self, scaler: Any, optimizer: Any, closure: bool = False) -> None:
        s = self._scaler(scaler)
        o = self._opt(optimizer)
        where = call_site()
        o.window.calls.append(f"scaler.step@{where}")
        self._in_scaler_step = (s, o)
        o.hook_fired = False
        if not s.enabled:
            return
        self._drives(s, o)
        amp_aware = bool(getattr(o.obj, "_step_supports_amp_scaling", False))
        before = self._stage(s, o)
        # step_stage reads the gradients' dtypes only for its own unscale, from READY.
        ev = sequence.step_call(before, closure=closure, amp_aware=amp_aware,
                                **self._sequence_args(s, o, where, dtypes=before.stage == READY))
        s.call[id(o.obj)] = ev
        self._sequence_call(s, o, ev)
        o.scaler_step_where = where
        self._start_data(o, "scaler.step", o.window.scaler or s)

    def on_scaler_step_end(self, scaler: Any, optimizer: Any, ok: bool) -> None:
        s = self._scaler(scaler)
        o = self._opt(optimizer)
        self._in_scaler_step = None
        ev = s.call.pop(id(o.obj), None)
        if ev is not None:
            s.stage[id(o.obj)] = sequence.stage_after(ev, ok)
        if not ok:
            return
        # A step that fired no hook may have run compiled (``opt.step = torch.compile(opt.step)``).
        ran = o.hook_fired or self.compiled_in_scaler_step(o)
        if not s.enabled:
            self._close_step(o, applied=ran, scaler=None, found_inf=None)
            return
        found = _found_inf(scaler, o.obj)
        amp_aware = bool(getattr(o.obj, "_step_supports_amp_scaling", False))
        applied = ran and not (amp_aware and found == 1.0)
        d = o.window.data
        if d is not None:
            d.torch_found_inf = found
            d.amp_aware = amp_aware
            d.kernel_unscale = amp_aware and not d.unscaled
        self._close_step(o, applied=applied, scaler=s, found_inf=found)

    def on_update_begin(self, scaler: Any, new_scale: Any) -> None:
        s = self._scaler(scaler)
        if not s.enabled:
            return
        where = call_site()
        for _, _, rec in s.pending:
            rec.calls.append(f"scaler.update@{where}")
        stages = {o.label: self._stage(s, o) for key, o in s.driven.items() if key in s.stage}
        ev = sequence.update_call(stages, scaler=s.label, step=self._current_step(), where=where,
                                  scaled=getattr(scaler, "_scale", None) is not None, new_scale=new_scale is not None,
                                  bypasses=self._bypasses(s))
        self._report(dispatch(ev))
        # Only the replay reads the state before the update (two reads, each a sync on a GPU).
        s.update_before = (_f32(s.scale()), int(scaler._get_growth_tracker())) \
            if s.used and self.replayer is not None else None

    def on_update_end(self, scaler: Any, new_scale: Any, ok: bool) -> None:
        s = self._scaler(scaler)
        if not s.enabled or not ok:
            return
        s.updates += 1
        s.stage.clear()  # update() sends every optimizer back to READY (reference.scaling rule 12)
        s.bypass.clear()
        s.reported_no_update.clear()
        scale, tracker = s.scale(), int(scaler._get_growth_tracker())
        for o, _, rec in s.pending:
            rec.scale_after = scale
            rec.growth_tracker = tracker
        pending = list(s.pending)
        self._flush_pending(s)  # the steps first: a divergence is reported in the contract's order
        if self.replayer is not None and s.update_before is not None:
            self.replayer.update(s, pending, s.update_before, (_f32(scale), tracker), new_scale, self)

    def _flush_pending(self, s: ScalerTrack) -> None:
        pending, s.pending = s.pending, []
        if self.replayer is not None:
            for o, data, rec in pending:
                self.replayer.step(o, data, rec, self)

    def _end_of_run(self, s: ScalerTrack) -> None:
        """The run completed: an optimizer still STEPPED had no update; a direct step, no update."""
        for key, o in s.driven.items():
            if key in s.stage and key not in s.reported_no_update:
                self._sequence_call(s, o, sequence.StageCall("end", o.label, o.steps, "", s.stage[key],
                                                         last_step_where=s_where(o)))
        self._report(dispatch(DirectSteps(s.label, self._bypasses(s), None)))
        s.bypass.clear()

    def on_scaler_state_dict(self, scaler: Any) -> None:
        # A saved scaler state is recognised by its keys in on_save; a state read here may also
        # be written by means the audit does not see (pickle, safetensors), which makes a
        # checkpoint without it uncertain.
        self._scaler_state_read = call_site()

    def on_scaler_loaded(self, scaler: Any) -> None:
        s = self._scaler(scaler)
        if not s.used:
            s.loaded = True
        if self.replayer is not None:
            self.replayer.resync(s)  # a restored scale: the history starts again from it
