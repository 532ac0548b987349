"""The recorder's optimizer and clipping calls: add_param_group, step (through torch's hooks),
zero_grad, clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_.

Decides optimizer-before-to, zero-grad-in-window, clip-before-unscale and clip-threshold-scaled
(criteria in `audit.recorder`'s docstring).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from audit.records import ClipStage, OptTrack, ScalerTrack, call_site, plain_tensor, to_numpy
from audit.rules import WARNING


class OptimizerCalls:
    """The optimizer and clipping handlers of `audit.recorder.Recorder` (a part of it)."""

    # ------------------------------------------------------------------ optimizers

    def on_params_added(self, opt: Any) -> None:
        where = call_site()
        o = self.optimizers.get(id(opt))
        if o is None or o.obj is not opt:
            o = OptTrack(opt, self._label(opt), where)
            self.optimizers[id(opt)] = o
        for p in o.params():
            if id(p) not in o.meta and isinstance(p, torch.Tensor):
                o.meta[id(p)] = (p, p.device, p.dtype)
        o.refresh_ids()

    def on_optimizer_step_begin(self, opt: Any) -> None:
        o = self._opt(opt)
        o.hook_fired = True
        inside = self._in_scaler_step is not None and self._in_scaler_step[1] is o
        if not o.moved_flagged and o.meta:
            self._check_moved(o)
        w = o.window
        if not inside:
            where = call_site()
            w.calls.append(f"optimizer.step@{where}")
            s = w.scaler
            if s is not None and s.enabled and s.stage.get(id(o.obj)) != "stepped":
                s.bypass[id(o.obj)] = (o, where)
            self._start_data(o, "optimizer.step", s if s is not None and s.stage.get(id(o.obj)) != "unscaled" else None)
        d = w.data
        if d is not None and d.copying:
            params = o.params()
            d.step_grads = self.snap.grads(params, d)
            if d.on_cpu:  # elsewhere the optimizer stage is not replayed: its numbers are not copied
                d.params_before = self.snap.many(params, d)
                d.state_before = self.snap.state(o.obj, params, d)
            d.groups = [{k: v for k, v in g.items() if k != "params"} for g in o.obj.param_groups]
            d.group_of = [gi for gi, g in enumerate(o.obj.param_groups) for _ in g["params"]]

    def on_optimizer_step_end(self, opt: Any) -> None:
        o = self._opt(opt)
        d = o.window.data
        if d is not None and d.copying and d.on_cpu:
            params = o.params()
            d.params_after = self.snap.many(params, d)
            d.state_after = self.snap.state(o.obj, params, d)
        inside = self._in_scaler_step is not None and self._in_scaler_step[1] is o
        if not inside:
            s = o.window.scaler
            bypassing = s is not None and s.enabled and id(o.obj) in s.bypass
            self._close_step(o, applied=True, scaler=s if bypassing else None, found_inf=None)

    def _check_moved(self, o: OptTrack) -> None:
        fused = any(g.get("fused") for g in o.obj.param_groups)
        for pid, (p, device, dtype) in o.meta.items():
            if p.dtype != dtype or (p.device != device and (fused or bool(o.obj.state.get(p)))):
                o.moved_flagged = True
                self._find("optimizer-before-to", o.steps, o.where or call_site(),
                           f"a parameter of {o.label} (built at {o.where}) is now {p.device} {p.dtype} but was "
                           f"{device} {dtype} when the optimizer received it: the model moved after the "
                           "optimizer was built" + (" (with optimizer state already on the old device)"
                                                    if p.device != device else ""),
                           expected=f"{device} {dtype}", got=f"{p.device} {p.dtype}")
                return

    def on_zero_grad(self, target: Any) -> None:
        if isinstance(target, torch.nn.Module):
            ids = {id(p) for p in target.parameters()}
            owners = [o for o in self.optimizers.values() if o.param_ids & ids]
            name = f"{type(target).__name__}.zero_grad"
        else:
            owners = [self._opt(target)]
            name = f"{owners[0].label}.zero_grad"
        where = call_site()
        for o in owners:
            w = o.window
            w.calls.append(f"{name}@{where}")
            if w.backwards and not w.zero_flagged:
                w.zero_flagged = True
                k = len(w.backwards)
                self._find("zero-grad-in-window", o.steps, where,
                           f"{name}() at {where} discarded the gradients of {k} backward pass(es) "
                           f"(the first at {w.backwards[0].where}) before {o.label} stepped",
                           expected="zero_grad after the optimizer step", got=f"zero_grad after {k} backward pass(es)")

    # ------------------------------------------------------------------ clipping

    def on_clip_begin(self, kind: str, tensors: list[Any], arguments: dict[str, Any]) -> None:
        self.in_clip = True
        where = call_site()
        self._clip_current = []
        for o in self._owners(tensors):
            w = o.window
            w.calls.append(f"{kind}@{where}")
            s = w.scaler
            unscaled = s is not None and s.stage.get(id(o.obj)) == "unscaled"
            if s is not None and s.enabled and not unscaled and not w.clip_flagged:
                w.clip_flagged = True
                scale = s.obj.get_scale()
                extra = ""
                if kind == "clip_grad_norm_" and float(arguments["max_norm"]) >= scale > 1:
                    extra = (f"; its threshold {float(arguments['max_norm'])!r} was multiplied by the scale too, which "
                             "only approximately compensates")
                self._find("clip-before-unscale", o.steps, where,
                           f"{kind} at {where} clipped {o.label}'s gradients while they were still multiplied "
                           f"by the loss scale {scale!r} (scaler.unscale_ had not run this step){extra}",
                           expected="scaler.unscale_(optimizer) before clipping", got=f"{kind} before scaler.unscale_")
            elif unscaled and kind == "clip_grad_norm_" and not o.threshold_flagged:
                self._check_threshold(o, s, float(arguments["max_norm"]), where)
            self._start_data(o, kind, s if not unscaled else None)
            if w.data is not None and w.data.copying:
                pos = {id(p): i for i, p in enumerate(o.params())}
                idx = [pos[id(t)] for t in tensors if id(t) in pos]
                # A tensor argument (clip_grads_with_norm_'s total_norm) is copied: the replay reads it later.
                d = w.data
                stage = ClipStage(kind, idx, {k: (self.snap(v, d) if isinstance(v, torch.Tensor) else v)
                                              for k, v in arguments.items() if k != "parameters"}, where,
                                  threads=torch.get_num_threads(),
                                  before_unscale=s is not None and s.enabled and s.used and not unscaled)
                params = o.params()
                stage.grads_in = self.snap.grads([params[i] for i in idx], d)
                w.data.clips.append(stage)
                self._clip_current.append(stage)
            if kind == "clip_grad_norm_":
                w.clip_norms.append((float("nan"), float(arguments["max_norm"])))

    def _check_threshold(self, o: OptTrack, s: ScalerTrack, max_norm: float, where: str) -> None:
        """clip-threshold-scaled: a warning when the threshold is at least a scale of 2**10 or more
        (a deliberately large threshold cannot be told apart yet); an error once the threshold
        changed across steps by exactly the factor the scale changed by. An infinite threshold
        measures the norm without clipping: never a finding."""
        if not math.isfinite(max_norm):
            return
        scale = s.obj.get_scale()
        ratio = max_norm / scale if scale else math.nan
        if o.threshold is None or o.threshold[0] != ratio:
            o.threshold = (ratio, scale, o.steps)
            if o.threshold_finding is None and scale >= 2.0**10 and max_norm >= scale:
                o.threshold_finding = self._find(
                    "clip-threshold-scaled", o.steps, where,
                    f"clip_grad_norm_ at {where} clipped {o.label}'s unscaled gradients at {max_norm!r}, at least the "
                    f"loss scale {scale!r}: probably multiplied by the scale, so the clip does nothing (the intended "
                    f"threshold would be {ratio!r}); the audit cannot tell this from a deliberately large threshold "
                    "until the scale changes", expected=ratio, got=max_norm, level=WARNING)
        elif scale != o.threshold[1]:
            o.threshold_flagged = True
            msg = (f"clip_grad_norm_ at {where}: the threshold changed with the loss scale (max_norm / scale "
                   f"= {ratio!r} at every step since step {o.threshold[2]}): it was multiplied by the scale, "
                   "although the gradients were unscaled")
            f = o.threshold_finding
            if f is None:
                self._find("clip-threshold-scaled", o.threshold[2], where, msg, expected=ratio, got=max_norm)
            else:  # the warning's suspicion confirmed: the same finding, now certain
                f.level, f.message = None, msg + f"; first seen at step {f.step}, {f.where}"

    def on_clip_end(self, kind: str, result: Any, ok: bool) -> None:
        self.in_clip = False
        stages, self._clip_current = getattr(self, "_clip_current", []), []
        if ok and isinstance(result, torch.Tensor):
            if not plain_tensor(result):  # a DTensor norm: its value needs a collective; not read
                for o in self.optimizers.values():
                    if o.window.clip_norms and math.isnan(o.window.clip_norms[-1][0]):
                        o.window.clip_norms[-1] = (None, o.window.clip_norms[-1][1])
                return
            value = to_numpy(result)  # a fresh 0-d tensor: no cache
            for stage in stages:
                stage.total_norm = value
            for o in self.optimizers.values():
                if o.window.clip_norms and math.isnan(o.window.clip_norms[-1][0]):
                    o.window.clip_norms[-1] = (float(value), o.window.clip_norms[-1][1])
