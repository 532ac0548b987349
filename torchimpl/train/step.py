"""The step engine: one optimizer step by the contract of ``reference/step.py``.

Built once from the resolved plan (precision, loss scaling, optimizer kind, clipping, sync
mode) by :func:`build_step_engine`; then, for every optimizer step over ``k`` microbatches:

1. ``begin_window`` zeroes the gradients and the step's flags; ``run_window`` runs each
   microbatch: forward and loss under autocast, ``loss / k`` (``k`` the window's real size:
   a window cut short by the end of an epoch divides by its own length), scale, backward.
   Gradients accumulate at one constant scale; the window's float32 loss sum stays on the
   device.
2. ``finish_step`` unscales once and records ``found_inf``: set when a scaled gradient holds
   inf or NaN (torch's check), when an unscaled one does, or when the window's loss is not
   finite, so that a step never applies a non-finite value;
3. clips the unscaled gradients at the configured threshold, unchanged by the scale;
4. steps the optimizer unless ``found_inf``;
5. updates the scale, and stops the run when a backoff has collapsed it (its float32 inverse
   is not finite: no later step could unscale);
6. advances the learning-rate schedule and the applied-step counter only if the step applied,
   and keeps the step's record (see ``torchimpl.run.records``) on the device until a log point.

Two objects carry what differs between runs, each chosen once:

- the loss scaling (``torchimpl.train.loss_scaling``): :class:`DynamicScaling` around a
  ``DynamicLossScaler``, or :class:`UnitScaling` without one (scale 1, the inf/NaN check only:
  jmp's ``NoOpLossScale``);
- the skip decision: :class:`HostSkip` (the host reads the step's one flag and calls the
  optimizer only on a clean step: one host sync per step) or :class:`KernelSkip` (the
  sync-free mode: a fused optimizer is called on every step, reads ``found_inf`` and skips
  inside its kernel; the learning rate is looked up on the device in a table computed on the
  host, by a device counter of applied steps: no host sync at all).

Host syncs: none per microbatch; the step's found_inf flag and the window's loss sum are the
real and imaginary part of one complex64 device scalar, so one ``zero_`` resets both and
:class:`HostSkip`'s one read reads both.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn

from torchimpl._torch_compat import _set_grad_enabled as set_grad_enabled
from torchimpl.precision.batches import batch_size, to_device
from torchimpl.train.callback_checks import checked_hook, checked_step_hook, hook_name
from torchimpl.train.clipping import clip_grad_norm_, foreach_total_norm, group_by_device_and_dtype
from torchimpl.train.loss_scaling import DynamicScaling, UnitScaling, collapse_problem, scale_collapsed
from torchimpl.train.optim import kernel_skip_refusal
from torchimpl.run.records import PendingRecords, StepRecord
from torchimpl.train.scaler import DynamicLossScaler
from torchimpl.train.schedule import AppliedStepSchedule, lr_from_table, lr_table
from torchimpl.train.loss_protocol import bad_loss_message

__all__ = [
    "DynamicScaling",
    "HostSkip",
    "KernelSkip",
    "StepEngine",
    "StepHooks",
    "UnitScaling",
    "bind_hooks",
    "build_step_engine",
    "choose_sync_free",
]


_FLOAT32 = torch.float32


# ----------------------------------------------------------------------------- skip decision


class Decision(NamedTuple):
    """What rule 4 decided: the record's found_inf, loss sum and lr, device tensors or host
    numbers; ``applied`` (``None`` while only the device knows); ``problem`` to stop the run."""

    found: Any
    loss_sum: Any
    lr: Any
    applied: bool | None
    problem: str | None = None


class _Skip:
    """What both skip decisions share: the schedule's state for a checkpoint."""

    schedule: AppliedStepSchedule

    def schedule_state(self, applied_steps: int) -> dict[str, Any]:
        out = self.schedule.state_dict()
        out["applied_steps"] = applied_steps
        return out


class HostSkip(_Skip):
    """The host decides: one read of the step's flags, the optimizer called only on a clean
    step, the learning rate set on the host from the count of applied steps."""

    sync_free = False

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: AppliedStepSchedule, *, fused: bool,
                 stop_on_nonfinite: bool, unit_scaling: bool, stepper: Callable[[], Any] | None = None):
        self.optimizer, self.schedule, self._fused = optimizer, schedule, fused
        self._stop, self._unit = stop_on_nonfinite, unit_scaling
        # The applied step's call: the optimizer's, or a master-weight option's (train.true_precision).
        self._step = stepper or optimizer.step

    def step(self, flags: torch.Tensor, found: torch.Tensor, loss_acc: torch.Tensor) -> Decision:
        lr = float(self.optimizer.param_groups[0]["lr"])
        # The one host sync of the step reads both at once: found_inf, the real part, and the
        # loss sum (finite exactly when the mean is), the imaginary part.
        value = flags.item()
        found_value, loss_sum = value.real, value.imag
        is_found, loss_bad = found_value > 0, not math.isfinite(loss_sum)
        # Without a scaler nothing backs off, so non-finite gradients are a fault to stop on.
        if self._stop and (loss_bad or (is_found and self._unit)):
            return Decision(found_value, loss_sum, lr, None, "non-finite loss" if loss_bad else "non-finite gradients")
        if loss_bad and not is_found:  # a non-finite loss is skipped like non-finite gradients
            found.fill_(1.0)
            found_value, is_found = 1.0, True
        applied = not is_found
        if applied:
            if self._fused:
                self.optimizer.grad_scale = None
                self.optimizer.found_inf = found
            self._step()
        return Decision(found_value, loss_sum, lr, applied)

    def advance(self, decision: Decision, found: torch.Tensor, state: Any) -> None:
        applied = decision.applied
        self.schedule.step(applied)
        state.applied_steps += int(applied)
        state.skipped_steps += int(not applied)

    def count(self, records: list[StepRecord], losses: list[float], state: Any) -> str | None:
        """Counted at each step already (and a non-finite loss stopped the run there)."""
        return None

    def counters(self, state: Any) -> tuple[int, int]:
        return state.applied_steps, state.skipped_steps

    def load_schedule(self, state: dict[str, Any], total_steps: int) -> None:
        self.schedule.load_state_dict(state)

    def rebase(self, base_lrs: list[float], total_steps: int) -> None:
        """New base rates (a resume whose configuration changed ``optimizer.lr``)."""
        self.schedule.base_lrs = list(base_lrs)
        self.schedule.apply()


class KernelSkip(_Skip):
    """The sync-free mode: a fused optimizer called on every step skips inside its kernel on
    ``found_inf``; a float32 lr tensor per group, looked up in a host-computed table by a
    device counter of applied steps. The host learns what applied at the next log point."""

    sync_free = True

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: AppliedStepSchedule, *, device: torch.device,
                 config: Any, total_steps: int, stop_on_nonfinite: bool):
        self.optimizer, self.schedule, self._stop = optimizer, schedule, stop_on_nonfinite
        self._device, self._config, self._total = device, config, total_steps
        self._applied_t = torch.zeros((), dtype=torch.int64, device=device)
        for group in optimizer.param_groups:  # fused kernels read tensor lrs
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        self._build_tables(total_steps)

    def _build_tables(self, last: int) -> None:
        """Each group's rates for 0 .. ``last`` applied steps, on the device."""
        self._tables = [lr_table(base, self._config, self._total, self._device, last)
                        for base in self.schedule.base_lrs]

    def step(self, flags: torch.Tensor, found: torch.Tensor, loss_acc: torch.Tensor) -> Decision:
        # A non-finite loss is skipped like non-finite gradients, decided on the device.
        found.copy_(torch.where(torch.isfinite(loss_acc), found, 1.0))
        # Snapshots for the record: the next window zeroes both.
        found_value, loss_sum = found.clone(), loss_acc.clone()
        lr = self.optimizer.param_groups[0]["lr"].detach().clone()
        self.optimizer.grad_scale = None
        self.optimizer.found_inf = found
        self.optimizer.step()
        return Decision(found_value, loss_sum, lr, None)

    def advance(self, decision: Decision, found: torch.Tensor, state: Any) -> None:
        self._applied_t += (1.0 - found).to(torch.int64)
        for group, table in zip(self.optimizer.param_groups, self._tables):
            group["lr"].copy_(lr_from_table(table, self._applied_t))

    def count(self, records: list[StepRecord], losses: list[float], state: Any) -> str | None:
        """The flush counts every record once, when the host reads it; the problem to stop on
        when a loss was not finite (``train.on_nonfinite: stop``)."""
        applied = sum(r.applied for r in records)
        state.applied_steps += applied
        state.skipped_steps += len(records) - applied
        for r in records:  # the host learns of a collapse here: every step since has been skipped
            if scale_collapsed(r.scale_after):
                return collapse_problem(r.step, r.scale_after)
        if self._stop and any(not math.isfinite(x) for x in losses):
            return "non-finite loss (seen at a log point in the sync-free mode)"
        return None

    def counters(self, state: Any) -> tuple[int, int]:
        """Applied and skipped steps including those whose records are not read yet (a sync)."""
        applied = int(self._applied_t.item())
        return applied, state.step - applied

    def load_schedule(self, state: dict[str, Any], total_steps: int) -> None:
        self.schedule.base_lrs = [float(b) for b in state["base_lrs"]]
        applied = int(state["applied_steps"])
        self._applied_t.fill_(applied)
        # A run saved with more steps than this one's train.steps still finds its rate.
        self._set_rates(max(total_steps, applied))

    def rebase(self, base_lrs: list[float], total_steps: int) -> None:
        """New base rates (a resume whose configuration changed ``optimizer.lr``)."""
        self.schedule.base_lrs = list(base_lrs)
        self._set_rates(self._tables[0].numel() - 1 if self._tables else total_steps)

    def _set_rates(self, last: int) -> None:
        self._build_tables(last)
        for group, table in zip(self.optimizer.param_groups, self._tables):
            # A new tensor: load_state_dict put the saved group's lr (any type) there.
            group["lr"] = lr_from_table(table, self._applied_t)


def choose_sync_free(requested: bool, optimizer_kind: str, optimizer: torch.optim.Optimizer, *,
                     scheduler: Any = None) -> tuple[bool, str | None]:
    """Whether the sync-free mode runs, and why not when it was requested but cannot."""
    if not requested:
        return False, None
    fallback = "using one host sync per step"
    if optimizer_kind != "fused" or not getattr(optimizer, "_step_supports_amp_scaling", False):
        # Only torch's fused kernels read found_inf and skip on it.
        return False, (f"train.sync_free needs a fused optimizer, got {optimizer_kind} (set optimizer.fused=true, "
                       f"or build your torch.optim optimizer with fused=True); {fallback}")
    if scheduler is not None:
        return False, (f"train.sync_free cannot run your scheduler ({type(scheduler).__name__}): it steps on the host "
                       f"after each applied step, which only a host sync tells; {fallback}")
    refused = kernel_skip_refusal(optimizer)
    if refused:
        return False, f"train.sync_free is refused for {refused}; {fallback}"
    return True, None


# ----------------------------------------------------------------------------- the engine


class StepHooks(NamedTuple):
    """The callbacks' step hooks that do something, each bound to its trainer; called with
    the run's state (``log``: with the state, the records and their losses, at a log point)."""

    microbatch_end: list[Callable[[Any], None]]
    after_backward: list[Callable[[Any], None]]
    before_optimizer_step: list[Callable[[Any], None]]
    step_end: list[Callable[[Any], None]]
    log: list[Callable[[Any, list[StepRecord], list[float]], None]] = []


class StepEngine:
    """Runs windows and finishes steps; see the module docstring. Built by
    :func:`build_step_engine`.

    ``found_inf`` (this step's device flag, from ``before_optimizer_step`` until the next
    window) and ``grad_norm`` (the total norm before clipping, ``None`` without clipping) are
    what the step hooks may read.
    """

    def __init__(self, *, model: nn.Module, params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
                 scaling: UnitScaling | DynamicScaling, skip: HostSkip | KernelSkip,
                 clip: Callable[[torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]] | None,
                 dist: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor], autocast: Any, device: torch.device,
                 state: Any, hooks: StepHooks, stop_requested: Callable[[], Any], prepare: Callable = to_device):
        self.model, self.params, self.optimizer = model, params, optimizer
        self.prepare = prepare  # a batch to the device (and, under a *-true plan, to the parameters' dtype)
        self.scaling, self.skip, self.dist = scaling, skip, dist
        self.loss_fn, self.autocast, self.device, self.state = loss_fn, autocast, device, state
        self.hooks, self._stop_requested = hooks, stop_requested
        self._clip = clip
        self._accumulators = grad_accumulators(params)
        # Rules 2-3, chosen once: without a scaler the check runs at a scale of 1 and changes no
        # gradient, so the clip's multiply can carry it (one pass, the same found_inf and bits).
        if clip is None:
            self._unscale_and_clip = self._unscale_only
        elif scaling.is_unit:
            self._unscale_and_clip = clip
        else:
            self._unscale_and_clip = self._unscale_then_clip
        # Multi-process runs hold back DDP's gradient all-reduce until the window's last
        # backward, and agree on found_inf; a single process does neither.
        self._accumulate = dist.accumulate if dist.enabled else None
        self._agree = dist.agree if dist.enabled else None
        self._flags = torch.zeros((), dtype=torch.complex64, device=device)
        self._found, self.loss_acc = torch.view_as_real(self._flags).unbind()
        self.pending = PendingRecords()
        self.found_inf: torch.Tensor | None = None
        self.grad_norm: torch.Tensor | None = None
        self.window: list[Any] | None = None
        self.scale_before: Any = None
        self.save_refused: str | None = None  # why a checkpoint cannot be taken now

    # --- rule 1 ------------------------------------------------------------------------

    def begin_window(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._flags.zero_()  # found_inf and the loss sum

    def run_window(self, window: list[Any], k: int) -> bool:
        """Forward, ``loss / k``, scale and backward for each batch of ``window``; ``k`` is the
        whole window's size (``window`` is its rest after a resume inside it). False when a
        hook requested a stop before the window's end."""
        st, scaling, loss_acc, device = self.state, self.scaling, self.loss_acc, self.device
        self.window, self.scale_before = window, scaling.scale_before()
        model, loss_fn, autocast, hooks = self.model, self.loss_fn, self.autocast, self.hooks.microbatch_end
        accumulate, prepare = self._accumulate, self.prepare
        for batch in window:
            n = batch_size(batch)
            batch = prepare(batch, device)
            if accumulate is None:
                with autocast:
                    loss = loss_fn(model, batch)
            else:
                with accumulate(st.window_done + 1 == k), autocast:
                    loss = loss_fn(model, batch)
            if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
                raise ValueError(bad_loss_message(loss))
            # Outside autocast from here: the accumulation, the division, the scaling and backward.
            # The sum with grad mode off, so that it records no graph and needs no detached copy.
            set_grad_enabled(False)
            loss_acc.add_(loss if loss.dtype is _FLOAT32 else loss.float())  # float(): a no-op call on float32
            set_grad_enabled(True)
            scaled = loss / k
            scaled = scaling.scale(scaled)
            scaled.backward()
            st.window_done += 1
            st.batch_index += 1
            st.samples += n
            for hook in hooks:
                hook(st)
            if self._stop_requested():
                return False
        self.window = None
        return True

    def fail_window(self) -> list[Any]:
        """The batches of the current window from the one that failed (a guard hit) on."""
        st, window = self.state, self.window
        self.window = None
        return window[len(window) - (st.window_size - st.window_done):]

    def skip_window(self, rest: list[Any]) -> str | None:
        """Finish a window whose ``rest`` could not run as a step with every gradient NaN: the
        contract's path for non-finite gradients (found_inf, no update, the scale backs off,
        the schedule holds, a record)."""
        st = self.state
        for batch in rest:
            st.window_done += 1
            st.batch_index += 1
            st.samples += batch_size(batch)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.full_like(p, math.nan)
            else:
                p.grad.fill_(math.nan)
        self.loss_acc.fill_(math.nan)
        return self.finish_step(st.window_size)

    # --- rules 2-6 -----------------------------------------------------------------------

    def _unscale_only(self, found: torch.Tensor) -> tuple[None, None]:
        self.scaling.unscale_(self.optimizer, found)
        self.scaling.check_unscaled(found)
        return None, None

    def _unscale_then_clip(self, found: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.scaling.unscale_(self.optimizer, found)
        return self._clip(found)  # the clip's multiply checks the unscaled gradients

    def finish_step(self, k: int) -> str | None:
        """Rules 2-6 after the window's last backward; the problem when the run must stop on a
        non-finite loss or gradient (``train.on_nonfinite: stop``), before any update."""
        st, hooks = self.state, self.hooks
        for hook in hooks.after_backward:
            hook(st)
        found = self._found  # zeroed at the start of the window
        grad_norm, clip_coef = self._unscale_and_clip(found)
        if self._agree is not None:
            agreed = self._agree(found, self.scaling.scaler, self.loss_acc)
            if agreed is not found:  # several processes: the all-reduced flag
                found.copy_(agreed)
        self.found_inf, self.grad_norm = found, grad_norm
        self.save_refused = ("from on_before_optimizer_step: the gradients are unscaled and clipped but the step "
                             "is not taken, so a resume would unscale and clip them again; save from "
                             "on_after_backward or on_step_end")
        for hook in hooks.before_optimizer_step:
            hook(st)
        self.save_refused = None
        decision = self.skip.step(self._flags, found, self.loss_acc)
        if decision.problem is not None:
            return decision.problem
        scale_after, tracker = self.scaling.update(found)
        if decision.applied is False:  # only a backoff can collapse the scale
            collapsed = self.scaling.collapsed()
            if collapsed is not None:
                return collapse_problem(st.step, collapsed)
        self.skip.advance(decision, found, st)
        # The record's values stay as they are (device tensors or host numbers) until the next
        # log point, where the flush reads all pending ones in one transfer.
        self.pending.add(decision.loss_sum, step=st.step, microbatches=k, scale_before=self.scale_before,
                         found_inf=decision.found, applied=decision.applied, grad_norm=grad_norm,
                         clip_coef=clip_coef, scale_after=scale_after, growth_tracker=tracker, lr=decision.lr)
        st.step += 1
        st.window_size = st.window_done = 0
        for hook in hooks.step_end:
            hook(st)
        return None


def grad_accumulators(params: list[nn.Parameter]) -> list[Any]:
    """Each plain trainable parameter's ``AccumulateGrad`` node, held for the run as DDP holds
    them. Unheld, each step's graph frees it and the next forward builds it again, and every op
    that takes the parameter (each optimizer op) then round-trips through the interpreter: torch
    keeps a tensor's Python object alive from C++ while C++ holds a second reference. (A hand
    loop's ``loss`` variable holds them by accident.) It changes no number."""
    held = []
    with torch.enable_grad():
        for p in params:
            if type(p) is nn.Parameter and p.requires_grad and p.grad_fn is None:
                held.append(p.view_as(p).grad_fn.next_functions[0][0])
    return held


def build_step_engine(*, config: Any, sync_free: bool, model: nn.Module, forward_model: nn.Module,
                      optimizer: torch.optim.Optimizer, optimizer_kind: str, scaler: DynamicLossScaler | None,
                      dist: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor], autocast: Any,
                      device: torch.device, state: Any, hooks: StepHooks,
                      stop_requested: Callable[[], Any], schedule: Any = None, stepper: Callable[[], Any] | None = None,
                      prepare: Callable = to_device) -> StepEngine:
    """The engine for a resolved plan: ``config`` is the run's ``Config``; ``model`` the module
    whose parameters train, ``forward_model`` what the microbatches call (DDP's wrapper, a
    compiled module); ``schedule`` the learning-rate schedule when it is not the
    configuration's (a user's scheduler: ``torchimpl.train.schedule.UserSchedule``; the sync-free mode
    takes an ``AppliedStepSchedule`` only, whose rates it tabulates); ``stepper`` the applied step's
    call when it is not ``optimizer.step`` and ``prepare`` the batch's way to the model when it is
    not ``to_device`` (a ``*-true`` plan's: ``torchimpl.train.true_precision``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = group_by_device_and_dtype(params)
    one = torch.ones((), dtype=torch.float32, device=device)
    scaling = DynamicScaling(scaler, groups, one) if scaler is not None else UnitScaling(groups, one)
    if schedule is None:
        schedule = AppliedStepSchedule(optimizer, config.schedule, config.train.steps)
    stop = config.train.on_nonfinite == "stop"
    if sync_free:
        skip: HostSkip | KernelSkip = KernelSkip(optimizer, schedule, device=device, config=schedule.config,
                                                 total_steps=config.train.steps, stop_on_nonfinite=stop)
    else:
        skip = HostSkip(optimizer, schedule, fused=optimizer_kind == "fused", stop_on_nonfinite=stop,
                        unit_scaling=scaling.is_unit, stepper=stepper)
    clip = None
    if config.train.clip_norm is not None:
        # Plain gradients (a single process, DDP's all-reduced ones): torch's norm grouped once;
        # FSDP2's DTensor shards: the context's global norm.
        total_norm = (None if dist.sharded else foreach_total_norm(groups, params)) or dist.total_norm
        clip = functools.partial(clip_grad_norm_, groups, params, config.train.clip_norm, total_norm, one)
    return StepEngine(model=forward_model, params=params, optimizer=optimizer, scaling=scaling, skip=skip,
                      clip=clip, dist=dist, loss_fn=loss_fn, autocast=autocast, device=device, state=state,
                      hooks=hooks, stop_requested=stop_requested, prepare=prepare)


def bind_hooks(callbacks: Sequence[Any], owner: Any, base: type) -> StepHooks:
    """The callbacks' step and log hooks, leaving out those that are ``base``'s no-op, bound to
    ``owner``, each checked for what it leaves in the trainer's state (``torchimpl.train.callback_checks``)."""

    def overridden(name: str) -> list[Callable[..., None]]:
        default = getattr(base, name)
        hooks = [getattr(cb, name) for cb in callbacks]
        return [h for h in hooks if getattr(h, "__func__", None) is not default]

    def step(name: str) -> list[Callable[[Any], None]]:
        return [checked_step_hook(h, owner, hook_name(h)) for h in overridden(name)]

    log = [checked_hook(functools.partial(h, owner), lambda: owner.state, hook_name(h)) for h in overridden("on_log")]
    return StepHooks(step("on_microbatch_end"), step("on_after_backward"), step("on_before_optimizer_step"),
                     step("on_step_end"), log)
