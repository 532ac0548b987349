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
  loss scale: either at least the scale while the scale is at least 2**10 (no norm of unscaled
  gradients is meant to be clipped at 1024 or more), or a threshold that changed across steps by
  exactly the factor the scale changed by. The first step is the first step of that pattern.
- unscale-twice: a second ``unscale_`` on the same optimizer before ``update`` (torch raises
  right after); or, from the numbers, gradients reaching the next stage equal to the unscaled
  gradients unscaled once more (by the inverse or by a division by the scale), decided in
  `audit.replay`.
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
  undivided. The factor by which a microbatch's gradient enters the accumulation is read from
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
- new-scaler-mid-run: an enabled GradScaler's first ``scale()`` after another enabled scaler
  completed an update, without ``load_state_dict`` on the new one first.
- optimizer-before-to: at a step, a parameter's dtype differs from when the optimizer received
  it, or its device does while the optimizer already holds state for it (or was built fused).
  A device move of a parameter with no state yet is not flagged: parameters keep their identity
  across ``Module.to``, and the optimizer creates their state on the new device (this is what
  Lightning Fabric's and Accelerate's ``setup``/``prepare`` do after the optimizer is built).

Only optimizers and scalers created under the audit have a construction site; one created
before an audit began (the context manager inside a running program) is first seen at its first
call, and optimizer-before-to is not checked for it.
"""

from __future__ import annotations

import math
import os
import sys
import sysconfig
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from audit import _torch_compat  # noqa: F401  (checks the private torch names the audit uses)
from audit.rules import Finding

__all__ = ["Recorder", "StepRecord", "StepLimitReached"]


class StepLimitReached(BaseException):
    """Raised into the audited program when the step limit is reached.

    A BaseException, so that a loop's ``except Exception`` does not swallow it.
    """


# ---------------------------------------------------------------------------------- call sites

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_AUDIT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY_DIRS = tuple(sorted({p + os.sep for p in (sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")) if p}))
_site_cache: dict[str, int] = {}


def _frame_class(filename: str) -> int:
    """0: the user's code; 1: a library (stdlib, site-packages); 2: torch or this package."""
    c = _site_cache.get(filename)
    if c is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if path.startswith(_TORCH_DIR) or path.startswith(_AUDIT_DIR):
            c = 2
        elif path.startswith("<frozen") or any(path.startswith(d) for d in _LIBRARY_DIRS):
            c = 1
        else:
            c = 0
        _site_cache[filename] = c
    return c


def call_site() -> str:
    """``file:line`` of the innermost frame of the user's code; else of the innermost library frame
    outside torch and this package (a loop driven by an installed framework)."""
    f = sys._getframe(1)
    fallback = None
    while f is not None:
        c = _frame_class(f.f_code.co_filename)
        if c == 0:
            return _fmt(f)
        if c == 1 and fallback is None:
            fallback = _fmt(f)
        f = f.f_back
    return fallback or "<unknown>"


_shown: dict[str, str] = {}


def _fmt(f: Any) -> str:
    name = f.f_code.co_filename
    shown = _shown.get(name)
    if shown is None:
        try:
            rel = os.path.relpath(name)
            shown = rel if not rel.startswith("..") else name
        except ValueError:
            shown = name
        _shown[name] = shown
    return f"{shown}:{f.f_lineno}"


# ---------------------------------------------------------------------------------- records


@dataclass
class StepRecord:
    """One optimizer step as the audit saw it (the JSON report's ``steps``).

    The spec's ``StepRecord`` fields (``step, microbatches, scale_before, found_inf, applied,
    grad_norm, clip_coef, scale_after, growth_tracker, lr``) where the loop makes them known, plus
    the optimizer, the order of calls and each group's hyperparameters. ``scale_before`` is the
    scale the window's losses were scaled by, None without a scaler; ``found_inf`` is the
    scaler's flag, None when no scaler checked; ``grad_norm`` the first ``clip_grad_norm_``'s
    returned norm (``clip_coef`` is not returned by torch: the replay computes it).
    """

    step: int
    optimizer: str
    microbatches: int
    calls: list[str]
    scale_before: float | None = None
    found_inf: bool | None = None
    applied: bool = True
    grad_norm: float | None = None
    max_norm: float | None = None
    clip_coef: float | None = None
    scale_after: float | None = None
    growth_tracker: int | None = None
    lr: float | None = None
    hyperparameters: list[dict[str, Any]] = field(default_factory=list)
    replay: str = "off"

    def to_dict(self) -> dict[str, Any]:
        from audit.rules import _jsonable

        return {k: _jsonable(v) for k, v in self.__dict__.items()}


@dataclass
class Backward:
    where: str
    factor: float | None
    scaler: "ScalerTrack | None"


@dataclass
class ClipStage:
    """One clipping call on an optimizer's parameters: the replay's clip stage."""

    kind: str
    indices: list[int]
    arguments: dict[str, Any]
    where: str
    grads_in: list[Any] | None = None
    total_norm: Any = None
    threads: int = 1  # torch's intra-op threads at the call: its CPU norm's summation split follows them


@dataclass
class StepData:
    """The numbers of one step for the replay (NumPy copies, bit for bit)."""

    scaled: list[Any] | None = None  # gradients at the window's first step-phase call
    scale: Any = None  # the float32 scale then, None without an enabled scaler
    first_stage: str = ""  # which call that was
    unscaled: bool = False  # whether scaler.unscale_ ran (explicitly or inside scaler.step)
    clips: list[ClipStage] = field(default_factory=list)
    step_grads: list[Any] | None = None
    params_before: list[Any] | None = None
    state_before: list[dict[str, Any]] | None = None
    groups: list[dict[str, Any]] | None = None
    group_of: list[int] | None = None
    params_after: list[Any] | None = None
    state_after: list[dict[str, Any]] | None = None
    torch_found_inf: float | None = None
    kernel_unscale: bool = False  # an amp-aware (fused) optimizer received scaled gradients
    amp_aware: bool = False
    on_cpu: bool = True
    unsupported: str | None = None  # why nothing of this step is copied (the replay names it)

    @property
    def copying(self) -> bool:
        return self.unsupported is None


@dataclass
class Window:
    backwards: list[Backward] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    data: StepData | None = None
    scaler: "ScalerTrack | None" = None  # the enabled scaler that scaled this window's losses
    zero_flagged: bool = False
    clip_flagged: bool = False
    autocast_flagged: bool = False
    clip_norms: list[tuple[float, float | None]] = field(default_factory=list)  # (total_norm, max_norm)


class ScalerTrack:
    def __init__(self, obj: Any, label: str, where: str | None) -> None:
        self.obj = obj
        self.label = label
        self.where = where
        self.used = False
        self.loaded = False
        self.updates = 0
        self.stage: dict[int, str] = {}  # id(optimizer) -> "unscaled" | "stepped"
        self.stepped: dict[int, "OptTrack"] = {}
        self.bypass: dict[int, tuple["OptTrack", str]] = {}
        self.reported_no_update: set[int] = set()
        self.pending: list[tuple["OptTrack", StepData | None, StepRecord]] = []
        self.update_before: tuple[Any, int] | None = None
        self.expected_after: Any = None  # the spec's scale after this scaler's last checked update

    @property
    def enabled(self) -> bool:
        return bool(self.obj.is_enabled())


class OptTrack:
    def __init__(self, obj: Any, label: str, where: str | None) -> None:
        self.obj = obj
        self.label = label
        self.where = where
        self.meta: dict[int, tuple[Any, Any, Any]] = {}  # id(p) -> (p, device, dtype) when received
        self.param_ids: frozenset[int] = frozenset()
        self.steps = 0
        self.window = Window()
        self.last_record: StepRecord | None = None
        self.applied_steps = 0
        self.sched_mark: dict[int, int] = {}  # id(scheduler) -> applied_steps at its last step
        self.moved_flagged = False
        self.threshold: tuple[float, float, int] | None = None  # (max_norm / scale, scale, first step)
        self.threshold_flagged = False
        self.hook_fired = False
        self.scaler_step_where: str | None = None

    def params(self) -> list[Any]:
        return [p for g in self.obj.param_groups for p in g["params"]]

    def refresh_ids(self) -> None:
        self.param_ids = frozenset(id(p) for p in self.params())


# ---------------------------------------------------------------------------------- snapshots


def plain_tensor(t: torch.Tensor) -> bool:
    """A tensor NumPy can copy: not a subclass such as DTensor (a Parameter is plain)."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def to_numpy(t: torch.Tensor) -> Any:
    """A NumPy (ml_dtypes for bfloat16) copy of ``t`` with exactly its bits."""
    import ml_dtypes

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.cpu().contiguous().view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return t.cpu().numpy().copy()


class Snapshots:
    """Bit-exact NumPy copies of tensors, taken when the recorder needs them, for the step data
    ``owner`` they belong to.

    Every copy is a new one: torch's in-place version counter cannot tell whether a tensor
    changed since an earlier copy (the scaler's unscale kernel, for one, leaves it as it was).
    ``pool``: where the copies go (the replay process's shared memory, `audit.worker`), None
    for ordinary arrays.
    """

    def __init__(self, pool: Any = None) -> None:
        self.pool = pool

    def __call__(self, t: torch.Tensor, owner: Any) -> Any:
        return self.many([t], owner)[0]

    def many(self, tensors: list[torch.Tensor], owner: Any) -> list[Any]:
        if self.pool is not None and tensors:
            out = self.pool.copy(tensors, owner)
            if out is not None:
                return out
        return [to_numpy(t) for t in tensors]

    def grads(self, params: list[Any], owner: Any) -> list[Any]:
        present = [p.grad for p in params if p.grad is not None]
        copies = iter(self.many(present, owner))
        return [None if p.grad is None else next(copies) for p in params]

    def state(self, opt: Any, params: list[Any], owner: Any) -> list[dict[str, Any]]:
        states = [opt.state.get(p, {}) for p in params]
        tensors = [v for s in states for v in s.values() if isinstance(v, torch.Tensor)]
        copies = iter(self.many(tensors, owner))
        return [{k: (next(copies) if isinstance(v, torch.Tensor) else v) for k, v in s.items()} for s in states]


# ---------------------------------------------------------------------------------- the recorder


class Recorder:
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
              got: Any = None) -> Finding:
        f = Finding(rule, step, where, message, expected, got)
        self.findings.append(f)
        return f

    def _current_step(self) -> int | None:
        return self.primary.steps if self.primary is not None else (0 if self.optimizers else None)

    def _owners(self, tensors: Iterable[Any]) -> list[OptTrack]:
        ids = {id(t) for t in tensors}
        return [o for o in self.optimizers.values() if o.param_ids & ids]

    def _start_data(self, o: OptTrack, stage: str, scaler: ScalerTrack | None) -> None:
        """The window's first step-phase call: copy the gradients as backward left them."""
        w = o.window
        if self.replayer is None or w.data is not None:
            return
        d = StepData(first_stage=stage)
        params = o.params()
        foreign = next((t for p in params for t in (p, p.grad) if t is not None and not plain_tensor(t)), None)
        if foreign is not None:
            # A DTensor (FSDP2's sharded parameters) holds one rank's shard; its numbers need the
            # other ranks' to be replayed, and it cannot be copied to NumPy as it is.
            d.unsupported = f"{type(foreign).__name__} parameters or gradients (sharded tensors)"
            w.data = d
            return
        if self.snap.pool is not None:
            # Gradients up to three times (scaled, clipped, stepped), parameters and state twice.
            state = [v for p in params for v in o.obj.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
            self.snap.pool.expect(sum(5 * p.numel() * p.element_size() for p in params)
                                  + sum(2 * v.numel() * v.element_size() for v in state))
        d.on_cpu = all(p.device.type == "cpu" for p in params)
        d.scaled = self.snap.grads(params, d)
        if scaler is not None and scaler.enabled and scaler.used:
            d.scale = _f32(scaler.obj.get_scale())
        w.data = d

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
                self._find("new-scaler-mid-run", self._current_step(), s.where or where,
                           f"{s.label} (created at {s.where or 'before the audit'}) started scaling at {where} "
                           f"with its initial scale {scaler.get_scale()!r} while {previous[-1].label} had already "
                           f"run {previous[-1].updates} update(s) (its scale {previous[-1].obj.get_scale()!r}); "
                           "the scale history and growth tracker start over",
                           expected=previous[-1].obj.get_scale(), got=scaler.get_scale())
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

    def on_unscale_begin(self, scaler: Any, optimizer: Any) -> None:
        s = self._scaler(scaler)
        if not s.enabled:
            return
        o = self._opt(optimizer)
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
        pass  # a saved scaler state is recognised by its keys in on_save

    def on_scaler_loaded(self, scaler: Any) -> None:
        s = self._scaler(scaler)
        if not s.used:
            s.loaded = True
        if self.replayer is not None:
            self.replayer.resync(s)  # a restored scale: the history starts again from it

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
                                  threads=torch.get_num_threads())
                params = o.params()
                stage.grads_in = [None if params[i].grad is None else self.snap(params[i].grad, d) for i in idx]
                w.data.clips.append(stage)
                self._clip_current.append(stage)
            if kind == "clip_grad_norm_":
                w.clip_norms.append((float("nan"), float(arguments["max_norm"])))

    def _check_threshold(self, o: OptTrack, s: ScalerTrack, max_norm: float, where: str) -> None:
        scale = s.obj.get_scale()
        if scale >= 2.0**10 and max_norm >= scale:
            o.threshold_flagged = True
            self._find("clip-threshold-scaled", o.steps, where,
                       f"clip_grad_norm_ at {where} clipped {o.label}'s unscaled gradients at {max_norm!r}, at least "
                       f"the loss scale {scale!r}: the threshold was multiplied by the scale, so the clip does "
                       f"nothing (the intended threshold is probably {max_norm / scale!r})",
                       expected=max_norm / scale, got=max_norm)
            return
        ratio = max_norm / scale if scale else math.nan
        if o.threshold is None or o.threshold[0] != ratio:
            o.threshold = (ratio, scale, o.steps)
        elif scale != o.threshold[1]:
            o.threshold_flagged = True
            self._find("clip-threshold-scaled", o.threshold[2], where,
                       f"clip_grad_norm_ at {where}: the threshold changed with the loss scale (max_norm / scale "
                       f"= {ratio!r} at every step since step {o.threshold[2]}): it was multiplied by the scale, "
                       "although the gradients were unscaled", expected=ratio, got=max_norm)

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

    def on_backward_begin(self, tensors: Any) -> None:
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
        scaler, factor = None, None
        if root is not None:
            entry = self._scaled.pop(id(root), None)
            start = root
            if entry is not None and entry[0]() is root:
                scaler = entry[1]
                start = entry[2]()
            factor = _loss_factor(start) if start is not None else None
        self._bw_pending = Backward(where, factor, scaler)
        if len(self.optimizers) > 1:
            self._bw_signature = {id(o): _signature(o) for o in self.optimizers.values()}
        self._bw_autocast = self._autocast_active()

    def on_backward_end(self, ok: bool) -> None:
        self._bw_depth -= 1
        if self._bw_depth > 0:
            return
        b, self._bw_pending = self._bw_pending, None
        if b is None or not ok:
            return
        if not self.optimizers:
            targets = [self.unassigned]
        elif len(self.optimizers) == 1:
            targets = [next(iter(self.optimizers.values())).window]
        else:
            sig = self._bw_signature or {}
            targets = [o.window for o in self.optimizers.values() if _signature(o) != sig.get(id(o))]
        self._bw_signature = None
        for w, o in ((w, self._owner_of(w)) for w in targets):
            w.backwards.append(b)
            w.calls.append(f"backward@{b.where}")
            if b.scaler is not None:
                w.scaler = b.scaler
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
        saves, self._saves = self._saves, []
        if not saves or not any(s.enabled and s.used for s in self.scalers.values()):
            return
        if any(h for _, _, h, _ in saves):
            return
        for where, holds_opt, _, step in saves:
            if holds_opt:
                scaler = next(s for s in self.scalers.values() if s.enabled and s.used)
                self._find("checkpoint-without-scaler", step, where,
                           f"torch.save at {where} saved optimizer state without {scaler.label}'s state (no file "
                           "saved after this step holds it): a resumed run restarts the loss scale at its initial "
                           "value and loses the growth tracker",
                           expected="scaler.state_dict() in the checkpoint", got="no scaler state")
                return

    # ------------------------------------------------------------------ steps

    def _close_step(self, o: OptTrack, applied: bool, scaler: ScalerTrack | None, found_inf: float | None) -> None:
        w = o.window
        if self.primary is None:
            self.primary = o
        if o is self.primary:
            self._check_saves()
        k = len(w.backwards)
        if k >= 2 and all(b.factor == 1.0 for b in w.backwards):
            self._find("loss-not-divided", o.steps, w.backwards[0].where,
                       f"the {k} losses of the window of step {o.steps} reached backward (first at "
                       f"{w.backwards[0].where}) undivided: the accumulated gradient is {k} times the mean",
                       expected=f"each loss divided by {k}", got="each loss undivided")
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
        if self.replayer is not None:
            self.replayer.finish(self)


def s_where(o: OptTrack) -> str:
    """Where the optimizer's latest scaler.step was called."""
    return o.scaler_step_where or "?"


def _unwrap_optimizer(obj: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Accelerate's and Lightning's keep it in
    ``.optimizer``), else ``obj``."""
    for _ in range(4):
        inner = getattr(obj, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is obj:
            return obj
        obj = inner
    return obj


def _pairs(inputs: Any, out: Any) -> list[tuple[Any, Any]]:
    if isinstance(inputs, torch.Tensor) and isinstance(out, torch.Tensor):
        return [(inputs, out)]
    if isinstance(inputs, (list, tuple)) and isinstance(out, (list, tuple)) and len(inputs) == len(out):
        return [p for a, b in zip(inputs, out) for p in _pairs(a, b)]
    return []


_CONST_OPS = {"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1"}
_CAST_OPS = {"ToCopyBackward0"}


def _loss_factor(t: Any) -> float | None:
    """The product of the constant multiplications and divisions between ``t`` and the loss
    (rule loss-not-divided in the module docstring); None when it cannot be read."""
    factor = 1.0
    node = getattr(t, "grad_fn", None)
    for _ in range(16):
        if node is None:
            return factor
        name = node.name()
        nxt = node.next_functions
        if name in _CAST_OPS:
            node = nxt[0][0] if nxt else None
            continue
        if name not in _CONST_OPS or len(nxt) == 0:
            return factor
        if len(nxt) == 1:  # a Scalar overload: one tensor input, the constant saved
            const = getattr(node, "_saved_other", None)
            follow = nxt[0][0]
            on_self = False
        elif nxt[1][0] is None and nxt[0][0] is not None:
            const, follow, on_self = getattr(node, "_saved_other", None), nxt[0][0], False
        elif nxt[0][0] is None and nxt[1][0] is not None and name.startswith("Mul"):
            const, follow, on_self = getattr(node, "_saved_self", None), nxt[1][0], True
        else:
            return factor
        if const is None:
            return None
        try:
            c = float(const) if not isinstance(const, torch.Tensor) else (float(const) if const.numel() == 1 else None)
        except (TypeError, ValueError, RuntimeError):
            return None
        if c is None:
            return factor
        factor = factor * c if name.startswith("Mul") else factor / c
        node = follow
    return None


def _signature(o: OptTrack) -> list[tuple[Any, int]]:
    return [(None, -1) if p.grad is None else (id(p.grad), p.grad._version) for p in o.params()]


def _classify(obj: Any) -> tuple[bool, bool]:
    """(holds optimizer state, holds scaler state) for an object given to torch.save."""
    holds_opt = holds_scaler = False
    stack, seen, budget = [(obj, 0)], set(), 10000
    scaler_keys = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    while stack and budget > 0:
        x, depth = stack.pop()
        budget -= 1
        if id(x) in seen or depth > 8:
            continue
        seen.add(id(x))
        if isinstance(x, torch.optim.Optimizer):
            holds_opt = True
        elif isinstance(x, torch.amp.GradScaler):
            holds_scaler = True
        elif isinstance(x, dict):
            keys = set(k for k in x.keys() if isinstance(k, str))
            if {"state", "param_groups"} <= keys:
                holds_opt = True
                continue
            if scaler_keys <= keys:
                holds_scaler = True
                continue
            stack.extend((v, depth + 1) for v in x.values() if not isinstance(v, torch.Tensor))
        elif isinstance(x, (list, tuple)):
            stack.extend((v, depth + 1) for v in x if not isinstance(v, torch.Tensor))
    return holds_opt, holds_scaler


def _found_inf(scaler: Any, opt: Any) -> float | None:
    state = scaler._per_optimizer_states.get(id(opt)) if hasattr(scaler, "_per_optimizer_states") else None
    if not state or not state.get("found_inf_per_device"):
        return None
    return float(sum(float(v.item()) for v in state["found_inf_per_device"].values()))


def _f32(x: Any) -> Any:
    import numpy as np

    return np.float32(x)


def _num(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError, RuntimeError):
        return None


def _jsonish(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return float(v) if v.numel() == 1 else str(v)
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonish(x) for x in v]
    return str(v)
