"""The recorder's GradScaler calls: scale, unscale_, step, update, state_dict, load_state_dict.

Decides step-without-update, update-without-step, step-bypasses-scaler, unscale-twice (the
second call) and new-scaler-mid-run (criteria in `audit.recorder`'s docstring).
"""

from __future__ import annotations

import weakref
from typing import Any

from audit.records import OptTrack, ScalerTrack, _f32, _found_inf, _pairs, call_site, s_where


class ScalerCalls:
    """The GradScaler handlers of `audit.recorder.Recorder` (a part of it, not used alone)."""

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
            if previous and not s.loaded:
                s.mid_run = (previous, where)  # decided when it first drives an optimizer
        self._check_pending_update(s, where)
        for t_in, t_out in _pairs(inputs, out):
            self._scaled[id(t_out)] = (weakref.ref(t_out), s, weakref.ref(t_in))
        if len(self._scaled) > 64:  # drop entries of tensors that are gone
            self._scaled = {k: v for k, v in self._scaled.items() if v[0]() is not None}

    def _check_pending_update(self, s: ScalerTrack, where: str) -> None:
        """A new scaled loss while a direct optimizer.step on the last one awaits no update.

        (A ``scaler.step`` without update is reported when that optimizer is unscaled or
        stepped again, or at the end: scaling another loss first is legitimate, as a GAN's
        generator loss after the discriminator's step, with one update for both.)"""
        for key, (o, bwhere) in list(s.bypass.items()):
            self._find("step-bypasses-scaler", o.steps - 1, bwhere,
                       f"{o.label}.step() at {bwhere} applied gradients of a loss scaled by {s.label} without "
                       f"scaler.step (a step with inf or NaN gradients is not skipped), and the next loss was "
                       f"scaled at {where} with no scaler.update between",
                       expected="scaler.step(optimizer); scaler.update()", got="optimizer.step()")
            del s.bypass[key]
            self._flush_pending(s)

    def _drives(self, s: ScalerTrack, o: OptTrack) -> None:
        """new-scaler-mid-run: a new scaler's first optimizer holds parameters an earlier scaler
        drove (a second, independent training in the same script drives others: no finding)."""
        if id(o.obj) in s.driven:
            return
        s.driven.add(id(o.obj))
        params = o.params()
        for p in params:
            s.params[id(p)] = weakref.ref(p)
        if s.mid_run is None:
            return
        previous, began = s.mid_run
        s.mid_run = None
        shared = [t for t in previous if any((r := t.params.get(id(p))) is not None and r() is p for p in params)]
        if shared:
            t = shared[-1]
            self._find("new-scaler-mid-run", o.steps, s.where or began,
                       f"{s.label} (created at {s.where or 'before the audit'}) started scaling at {began} with its "
                       f"initial scale {s.obj.get_scale()!r}, for parameters that {t.label} drove through "
                       f"{t.updates} update(s) (its scale {t.obj.get_scale()!r}); the scale history and growth "
                       "tracker start over", expected=t.obj.get_scale(), got=s.obj.get_scale())

    def on_unscale_begin(self, scaler: Any, optimizer: Any) -> None:
        s = self._scaler(scaler)
        if not s.enabled:
            return
        o = self._opt(optimizer)
        self._drives(s, o)
        nested = self._in_scaler_step is not None
        where = call_site()
        stage = s.stage.get(id(o.obj))
        if stage == "unscaled" and not nested:
            self._find("unscale-twice", o.steps, where,
                       f"scaler.unscale_({o.label}) called a second time since the last update (torch raises "
                       "'unscale_() has already been called on this optimizer since the last update()')",
                       expected="one scaler.unscale_ per step", got="a second scaler.unscale_")
        elif stage == "stepped" and id(o.obj) not in s.reported_no_update:
            s.reported_no_update.add(id(o.obj))
            self._find("step-without-update", o.steps - 1, s_where(o),
                       f"scaler.step({o.label}) at {s_where(o)} was not followed by scaler.update(); torch "
                       f"raises at scaler.unscale_ at {where}", expected="scaler.update() after scaler.step",
                       got="no scaler.update()")
        if not nested:
            o.window.calls.append(f"scaler.unscale_@{where}")
        self._start_data(o, "scaler.unscale_", o.window.scaler or s)

    def on_unscale_end(self, scaler: Any, optimizer: Any, ok: bool) -> None:
        s = self._scaler(scaler)
        if not (ok and s.enabled):
            return
        o = self._opt(optimizer)
        s.stage[id(o.obj)] = "unscaled"
        if o.window.data is not None:
            o.window.data.unscaled = True
            o.window.data.torch_found_inf = _found_inf(scaler, o.obj)

    def on_scaler_step_begin(self, scaler: Any, optimizer: Any) -> None:
        s = self._scaler(scaler)
        o = self._opt(optimizer)
        where = call_site()
        o.window.calls.append(f"scaler.step@{where}")
        self._in_scaler_step = (s, o)
        o.hook_fired = False
        if not s.enabled:
            return
        self._drives(s, o)
        if s.stage.get(id(o.obj)) == "stepped" and id(o.obj) not in s.reported_no_update:
            s.reported_no_update.add(id(o.obj))
            self._find("step-without-update", o.steps - 1, s_where(o),
                       f"scaler.step({o.label}) at {s_where(o)} was not followed by scaler.update(); torch raises "
                       f"at the next scaler.step at {where}", expected="scaler.update() after scaler.step",
                       got="no scaler.update()")
        o.scaler_step_where = where
        self._start_data(o, "scaler.step", o.window.scaler or s)

    def on_scaler_step_end(self, scaler: Any, optimizer: Any, ok: bool) -> None:
        s = self._scaler(scaler)
        o = self._opt(optimizer)
        self._in_scaler_step = None
        if not ok:
            return
        if not s.enabled:
            self._close_step(o, applied=o.hook_fired, scaler=None, found_inf=None)
            return
        s.stage[id(o.obj)] = "stepped"
        s.stepped[id(o.obj)] = o
        found = _found_inf(scaler, o.obj)
        amp_aware = bool(getattr(o.obj, "_step_supports_amp_scaling", False))
        applied = o.hook_fired and not (amp_aware and found == 1.0)
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
        for o, bwhere in s.bypass.values():
            self._find("update-without-step", o.steps - 1, bwhere,
                       f"scaler.update() at {where} follows {o.label}.step() called directly at {bwhere}: the "
                       "step ran even if the gradients held inf or NaN (scaler.step would have skipped it)",
                       expected="scaler.step(optimizer)", got="optimizer.step()")
        if not s.stepped and not s.bypass:
            self._find("update-without-step", self._current_step(), where,
                       f"scaler.update() at {where} with no scaler.step since the previous update",
                       expected="scaler.step(optimizer) before scaler.update()", got="scaler.update() alone")
        s.update_before = (_f32(scaler.get_scale()), int(scaler._get_growth_tracker())) if s.used else None

    def on_update_end(self, scaler: Any, new_scale: Any, ok: bool) -> None:
        s = self._scaler(scaler)
        if not s.enabled or not ok:
            return
        s.updates += 1
        s.stage.clear()
        s.stepped.clear()
        s.bypass.clear()
        s.reported_no_update.clear()
        after = (_f32(scaler.get_scale()), int(scaler._get_growth_tracker()))
        for o, _, rec in s.pending:
            rec.scale_after = float(after[0])
            rec.growth_tracker = after[1]
        pending = list(s.pending)
        self._flush_pending(s)  # the steps first: a divergence is reported in the contract's order
        if self.replayer is not None and s.update_before is not None:
            self.replayer.update(s, pending, s.update_before, after, new_scale, self)

    def _flush_pending(self, s: ScalerTrack) -> None:
        pending, s.pending = s.pending, []
        if self.replayer is not None:
            for o, data, rec in pending:
                self.replayer.step(o, data, rec, self)

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
