"""The recorder's optimizer and clipping calls: add_param_group, step (through torch's hooks),
zero_grad, clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_.

Runs the checks of optimizer-before-to and zero-grad-in-window (`audit.checks_steps`), and of
clip-before-unscale and clip-threshold-scaled (`audit.checks_clipping`), at the calls they read.

A step that ``torch.compile`` traced (``torch.compile(opt.step)``, a compiled train step) runs
inside a compiled graph: torch's step hooks are traced, not called, so the audit sees it by its
effects at the next call it sees (a backward, a zero_grad, the end of the program): since the
window's last backward the optimizer's parameters moved and its state changed (a loop's own
edit of the parameters, a two-pass step's ascent, leaves the state alone). It is recorded as an
applied step. Its numbers are copied around it: the parameters and state at the end of each
backward of an optimizer whose steps may run compiled (`before_compiled_step`: no eager step of
it seen yet, or a compiled one seen), the gradients, parameters and state when the step is
seen; the replay recomputes it through the spec's compile rules (`reference.compile`). A
compiled step with nothing copied before it is not replayed (`COMPILED_STEP`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from audit import closures
from audit.events import ClipCall, ClipThreshold, OptimizerStepBegin, ZeroGradCall
from audit.records import ClipStage, OptTrack, ScalerTrack, call_site, plain_tensor, to_numpy
from audit.restep import check_restep
from audit.rules import dispatch
from reference.scaling import STEPPED, UNSCALED


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

    def on_optimizer_step_begin(self, opt: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """torch's step pre-hook. A step given a closure gets it wrapped (the returned arguments,
        `audit.closures`): its step phase begins when the closure has returned."""
        o = self._opt(opt)
        o.hook_fired = o.eager_seen = True
        for outer in self.optimizers.values():
            if outer.stepping and outer is not o and outer.param_ids & o.param_ids:
                outer.runs = o.label  # a wrapper's step (SAM's, Lookahead's) running this one's
        o.stepping, o.runs = True, None
        for q in self.optimizers.values():
            if q is o or q.param_ids & o.param_ids:
                # An eager step of these parameters (a wrapper's base, SAM's two passes): what moved
                # them was seen, so no step of theirs since the last backward went unseen.
                q.window.hooked = True
        inside = self._in_scaler_step is not None and self._in_scaler_step[1] is o
        if not o.moved_flagged and o.meta and self._report(dispatch(OptimizerStepBegin(o, o.where or call_site()))):
            o.moved_flagged = True
        # Inside a disabled scaler's step the optimizer's is a direct one (torch passes the call on).
        phase_inside = inside and self._in_scaler_step[0].enabled
        closure = closures.closure_of(args, kwargs or {})
        # Inside an enabled scaler's step with no closure nothing below reads the call site: not
        # looked up (the hook runs under a dozen frames of torch's and the audit's).
        where = "" if phase_inside and closure is None else call_site()
        if not inside:
            o.window.calls.append(f"optimizer.step@{where}")
        if closure is None:
            o.closure = None
            self._step_phase(o, phase_inside, where)
            return None
        o.closure = closures.ClosureStep(where, phase_inside)
        wrapped = closures.wrap(closure, lambda: self.on_closure_end(o))
        return closures.with_closure(args, kwargs or {}, wrapped)

    def on_closure_end(self, o: OptTrack) -> None:
        """The closure returned: the gradients the update reads are there. The step phase begins
        after the first evaluation (a second one, counted, makes the step not replayable)."""
        c = o.closure
        if c is None:
            return
        c.returned += 1
        if c.returned == 1:
            self._step_phase(o, c.inside, c.where)

    def _step_phase(self, o: OptTrack, inside: bool, where: str) -> None:
        """The step's own checks and copies, as the update receives the gradients."""
        w = o.window
        if not inside:
            s = w.scaler
            stage = self._stage(s, o).stage if s is not None else None
            if s is not None and s.enabled and stage != STEPPED:
                s.bypass[id(o.obj)] = (o, where)  # a direct step on gradients of a loss it scaled
            elif s is None:
                check_restep(self, o, where)
            self._start_data(o, "optimizer.step", s if s is not None and stage != UNSCALED else None)
        d = w.data
        own = closures.own_evaluations(type(o.obj)) if o.closure is not None else None
        if own is not None and d is not None and d.copying:
            d.unsupported = own  # its update is not one set of gradients' (audit.closures)
        if d is not None and d.copying:
            params = o.params()
            d.step_grads = self.snap.grads(params, d, d.sample)  # d.sample: audit.sampling's, None: whole
            if d.on_cpu:  # elsewhere the optimizer stage is not replayed: its numbers are not copied
                d.params_before = self.snap.many(params, d, d.sample)
                d.state_before = self.snap.state(o.obj, params, d, d.sample)
            # A tensor hyperparameter (a tensor lr) is copied: a schedule may change it in place later.
            d.groups = [{k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in g.items()
                         if k != "params"} for g in o.obj.param_groups]
            d.group_of = [gi for gi, g in enumerate(o.obj.param_groups) for _ in g["params"]]

    def on_optimizer_step_end(self, opt: Any) -> None:
        o = self._opt(opt)
        d = o.window.data
        c, o.closure, o.stepping = o.closure, None, False
        if d is not None and d.copying and o.runs is not None:
            d.unsupported = closures.RUNS_ANOTHER.format(inner=o.runs)
        elif c is not None and c.returned != 1 and d is not None and d.copying:
            d.unsupported = (closures.REEVALUATED.format(n=c.returned) if c.returned else
                             "the optimizer did not call the closure it was given")
        if d is not None and d.copying and d.on_cpu:
            params = o.params()
            d.params_after = self.snap.many(params, d, d.sample)
            d.state_after = self.snap.state(o.obj, params, d, d.sample)
        inside = self._in_scaler_step is not None and self._in_scaler_step[1] is o
        if not inside:
            s = o.window.scaler
            bypassing = s is not None and s.enabled and id(o.obj) in s.bypass
            self._close_step(o, applied=True, scaler=s if bypassing else None, found_inf=None)

    def unseen_step(self, o: OptTrack) -> None:
        """A compiled step of ``o`` since its window's last backward (see the module docstring),
        recorded as an applied step; replayed from the copies around it."""
        w = o.window
        if not w.backwards or o.stepping or w.hooked or w.versions is None or w.versions == _versions(o) \
                or w.state == state_signature(o):
            return
        if not any(c.__module__.startswith("torch.optim.") for c in type(o.obj).__mro__[:-2]):
            # Not one of torch's optimizers (or a subclass): a wrapper such as SAM, deriving from
            # Optimizer itself, keeps its ascent's state and moves the parameters by hand, with no
            # step, and has no compiled step of its own. (By class, not by the spec's rows: the
            # order rules load nothing of the spec's arithmetic.)
            return
        self._copy_compiled(o)
        self._close_step(o, applied=True, scaler=None, found_inf=None)

    def compiled_in_scaler_step(self, o: OptTrack) -> bool:
        """At the end of ``scaler.step(opt)`` whose optimizer step fired no hook: whether it ran
        compiled (``opt.step = torch.compile(opt.step)``): its parameters moved and its state
        changed since the window's last backward. If so its numbers are copied (`_copy_compiled`)."""
        w = o.window
        if w.versions is None or w.versions == _versions(o) or w.state == state_signature(o) or \
                not any(c.__module__.startswith("torch.optim.") for c in type(o.obj).__mro__[:-2]):
            return False
        self._copy_compiled(o)
        return True

    def _copy_compiled(self, o: OptTrack) -> None:
        """A compiled step of ``o`` just seen: its gradients, parameters and state copied (the
        parameters and state before it were copied at the backward before, `before_compiled_step`);
        with no copy before it, the reason it is not replayed."""
        w = o.window
        o.compiled_steps += 1
        w.calls.append(f"optimizer.step (compiled)@{call_site()}")
        before = w.data.params_before if w.data is not None else None
        self._start_data(o, "optimizer.step", None)
        d = w.data
        params = o.params()
        if d is not None and d.copying and all(p.grad is None for p in params):
            d.unsupported = GRADIENTS_GONE
        elif d is not None and d.copying and d.on_cpu and before is not None:
            d.compiled = True
            d.step_grads = self.snap.grads(params, d, d.sample)  # a step leaves its gradients as they were
            d.groups = [{k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in g.items()
                         if k != "params"} for g in o.obj.param_groups]
            d.group_of = [gi for gi, g in enumerate(o.obj.param_groups) for _ in g["params"]]
            d.params_after = self.snap.many(params, d, d.sample)
            d.state_after = self.snap.state(o.obj, params, d, d.sample)
        elif d is not None and d.copying:
            d.unsupported = COMPILED_STEP

    def before_compiled_step(self, o: OptTrack) -> None:
        """After a backward of ``o``'s gradients: where its step may run compiled (no eager step
        of it seen yet, or a compiled one seen since), its parameters and state as the step will
        find them, once a window (an accumulation's later backwards leave them as they were). A
        compiled step runs no hook to copy them at; an eager one copies them again at its own."""
        w = o.window
        if self.replayer is None or (o.eager_seen and not o.compiled_steps) or o.stepping:
            return
        if w.data is not None and (w.data.first_stage != "backward" or w.data.params_before is not None):
            return
        d = w.data if w.data is not None else self._new_data(o, "backward")
        w.data = d
        if d.copying and d.on_cpu:
            params = o.params()
            d.params_before = self.snap.many(params, d, d.sample)
            d.state_before = self.snap.state(o.obj, params, d, d.sample)

    def on_zero_grad(self, target: Any) -> None:
        if isinstance(target, torch.nn.Module):
            ids = {id(p) for p in target.parameters()}
            owners = [o for o in self.optimizers.values() if o.param_ids & ids]
            name = f"{type(target).__name__}.zero_grad"
        else:
            first = self._opt(target)
            # It zeroes its parameters' gradients, whichever optimizers also hold them (a wrapper's base).
            owners = [first, *(o for o in self.optimizers.values()
                               if o is not first and o.param_ids & first.param_ids)]
            name = f"{first.label}.zero_grad"
        where = call_site()
        for o in owners:
            self.unseen_step(o)
            w = o.window
            w.calls.append(f"{name}@{where}")
            if w.backwards and w.versions is not None and w.versions != _versions(o):
                # The parameters moved since the window's last backward, with no step of this
                # optimizer: those gradients were used (a two-pass step's ascent, a line search's
                # move) and the next backward evaluates anew. The window's passes start again.
                w.backwards = []
            if not w.zero_flagged and self._report(dispatch(ZeroGradCall(name, where, o.label, o.steps, w.backwards))):
                w.zero_flagged = True

    # ------------------------------------------------------------------ clipping

    def on_clip_begin(self, kind: str, tensors: list[Any], arguments: dict[str, Any]) -> None:
        self.in_clip = True
        where = call_site()
        self._clip_current = []
        for o in self._owners(tensors):
            w = o.window
            w.calls.append(f"{kind}@{where}")
            s = w.scaler
            seq = self._stage(s, o) if s is not None and s.enabled else None  # the spec's call sequence
            unscaled = seq is not None and seq.stage == UNSCALED
            max_norm = float(arguments["max_norm"]) if kind == "clip_grad_norm_" else None
            if not w.clip_flagged and seq is not None and self._report(
                    dispatch(ClipCall(kind, o.label, o.steps, where, seq, s.obj, max_norm))):
                w.clip_flagged = True
            elif unscaled and max_norm is not None and not o.threshold_flagged:
                self._threshold(o, s, max_norm, where)
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

    def _threshold(self, o: OptTrack, s: ScalerTrack, max_norm: float, where: str) -> None:
        """clip-threshold-scaled: the check reads the ratio the earlier calls held; the ratio is
        recorded after it (a certain finding replaces this rule's earlier warning)."""
        scale = s.scale()
        for f in dispatch(ClipThreshold(o.label, o.steps, where, max_norm, scale, o.threshold, o.threshold_finding)):
            if f.level is None:
                o.threshold_flagged = True
                self._replace(o.threshold_finding, f)
            else:
                o.threshold_finding = f
                self.findings.append(f)
        ratio = max_norm / scale if scale else math.nan
        if math.isfinite(max_norm) and (o.threshold is None or o.threshold[0] != ratio):
            o.threshold = (ratio, scale, o.steps)

    def on_clip_end(self, kind: str, result: Any, ok: bool) -> None:
        self.in_clip = False
        stages, self._clip_current = getattr(self, "_clip_current", []), []
        if ok and isinstance(result, torch.Tensor):
            if not plain_tensor(result):  # a DTensor norm: its value needs a collective; not read
                for o in self.optimizers.values():
                    if o.window.clip_norms and math.isnan(o.window.clip_norms[-1][0]):
                        o.window.clip_norms[-1] = (None, o.window.clip_norms[-1][1])
                return
            # A fresh 0-d tensor: no cache. Copied for the replay's stages only; the record's norm is
            # its value either way (one read, a sync on a GPU).
            value = to_numpy(result) if stages else None
            norm = float(value) if value is not None else float(result)
            for stage in stages:
                stage.total_norm = value
            for o in self.optimizers.values():
                if o.window.clip_norms and math.isnan(o.window.clip_norms[-1][0]):
                    o.window.clip_norms[-1] = (norm, o.window.clip_norms[-1][1])


COMPILED_STEP = ("compiled optimizer step with no copy before it: it ran inside a torch.compile graph, which the "
                 "audit cannot copy from, and no backward the audit saw preceded it")


GRADIENTS_GONE = ("compiled optimizer step whose gradients were gone when the audit saw it (set to None inside "
                  "the compiled function, by a zero_grad the audit does not see there: Module.zero_grad)")


def state_signature(o: OptTrack) -> list[int]:
    """The version counters of the optimizer state's tensors, in the state's order: a step that
    updates state advances one, a step that creates state lengthens the list (state is only
    added, never re-keyed, by torch's steps). Read from the state's values, not looked up per
    parameter: a tensor key's hash is a Python call; no ids or keys kept, since the list is only
    compared with itself across one window (taken at every backward)."""
    return [v._version for st in o.obj.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _versions(o: OptTrack) -> list[int]:
    """The version counters of ``o``'s parameters (an in-place update of one advances it)."""
    return [p._version for p in o.params()]
