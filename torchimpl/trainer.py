"""The training loop: the step contract, host-sync budget, callbacks, records and resume.

One optimizer step over ``k`` microbatches, in this order and no other:

1. zero the gradients; for each microbatch: forward and loss under autocast, ``loss / k``
   (``k`` is the window's real size: a window cut short by the end of an epoch divides by
   its own length), scale, backward; gradients accumulate at one constant scale;
2. unscale once and record ``found_inf`` (checked on the scaled gradients);
3. clip the unscaled gradients at the configured threshold, unchanged by the scale;
4. step the optimizer unless ``found_inf``;
5. update the scale;
6. advance the learning-rate schedule and the applied-step counter only if the step applied.

Host syncs: none per microbatch (losses accumulate on the device); one per optimizer step
(the skip decision, together with the loss's finiteness); none at all with a fused
optimizer in the sync-free mode, where the optimizer's kernel skips on ``found_inf`` and the
learning rate is looked up on the device, by a device counter of applied steps, in a table
computed on the host. Metrics (the step records and the loss curve) stay on the device until a
log point, where they are read in one transfer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import struct
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

import torchimpl
from torchimpl.checkpoint import (
    CheckpointError,
    capture_rng_state,
    checkpoint_name,
    latest_checkpoint,
    prune_checkpoints,
    restore_rng_state,
)
from torchimpl.config import Config
from torchimpl.device import resolve_device
from torchimpl.diagnostics import NonFiniteError
from torchimpl.distributed import init_distributed
from torchimpl.optim import build_optimizer
from torchimpl.precision import autocast_context, resolve_precision
from torchimpl.records import StepRecord, TraceWriter
from torchimpl.scaler import make_grad_scaler
from torchimpl.schedule import AppliedStepSchedule, lr_from_table, lr_table

__all__ = ["Callback", "RunSummary", "StopTraining", "Trainer", "TrainState", "default_loss_fn"]

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1


def default_loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss protocol: a batch ``(inputs, targets)``; ``model(inputs, targets)`` is the loss."""
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if isinstance(batch, dict):
        return model(**batch)
    return model(batch)


class StopTraining(Exception):
    """Raise from a callback to end ``fit`` cleanly after the current hook."""


class Callback:
    """Hooks called by :class:`Trainer`; override the ones you need.

    Gradients seen by the hooks: ``on_after_backward`` gets the **scaled** gradients of the
    whole window (before unscale); ``on_before_optimizer_step`` the unscaled, clipped ones.
    """

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_microbatch_end(self, trainer: Trainer, state: TrainState) -> None: ...

    def on_after_backward(self, trainer: Trainer, state: TrainState) -> None: ...

    def on_before_optimizer_step(self, trainer: Trainer, state: TrainState) -> None: ...

    def on_step_end(self, trainer: Trainer, state: TrainState) -> None: ...

    def on_log(self, trainer: Trainer, state: TrainState, records: list[StepRecord],
               losses: list[float]) -> None: ...

    def on_fit_end(self, trainer: Trainer, summary: RunSummary) -> None: ...


@dataclass
class TrainState:
    """Counters of a run; everything here is saved in a checkpoint."""

    step: int = 0
    """Optimizer steps attempted (applied or skipped)."""
    applied_steps: int = 0
    """Optimizer steps applied; drives the learning-rate schedule (read at log points in
    the sync-free mode)."""
    skipped_steps: int = 0
    epoch: int = 0
    batch_index: int = 0
    """Batches of the current epoch consumed by finished microbatches."""
    samples: int = 0
    window_size: int = 0
    """Microbatches in the current accumulation window (0 between steps)."""
    window_done: int = 0
    """Microbatches of the current window already backpropagated."""
    best_val_loss: float | None = None
    last_val_loss: float | None = None
    last_train_loss: float | None = None


@dataclass
class RunSummary:
    """What a ``fit`` did, for people and for ``report.json``."""

    device: str
    precision_mode: str
    autocast_dtype: str | None
    use_scaler: bool
    downgrades: list[str]
    optimizer_kind: str
    optimizer_reason: str | None
    sync_free: bool
    compiled: bool
    steps: int
    steps_applied: int
    steps_skipped: int
    final_scale: float | None
    time_per_step_s: float
    samples_per_s: float
    peak_memory_bytes: int | None
    final_train_loss: float | None
    final_val_loss: float | None
    best_val_loss: float | None
    stopped: str | None = None
    last_checkpoint: str | None = None
    diagnosis_report: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or a tuple, list or dict of them) with its tensors on ``device``."""
    if isinstance(batch, torch.Tensor):
        if batch.is_cpu and device.type == "cpu":
            return batch  # what batch.to(device) returns, without its argument parsing
        if device.type == "cuda":
            # Pinned source, asynchronous copy. The pinned block stays referenced by the window
            # until the step ends, and the caching host allocator keeps it from reuse until the
            # copy's stream event has completed.
            src = batch if batch.is_pinned() else batch.pin_memory()
            return src.to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        if device.type == "cpu":
            for b in batch:
                if not (isinstance(b, torch.Tensor) and b.is_cpu):
                    break
            else:
                return batch  # the common case on a CPU: nothing to move, no new container
        return type(batch)([_to_device(b, device) for b in batch])
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _batch_size(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor (1 for a scalar or none)."""
    while True:
        if isinstance(batch, torch.Tensor):
            return batch.shape[0] if batch.ndim else 1
        if isinstance(batch, (tuple, list)) and batch:
            batch = batch[0]
        elif isinstance(batch, dict) and batch:
            batch = next(iter(batch.values()))
        else:
            return 1


# Device types whose gradients torch's clipping multiplies with one _foreach_mul_ per group.
_FOREACH_DEVICE_TYPES = ("cpu", "cuda")
# Gradient dtypes that _amp_foreach_non_finite_check_and_unscale_ multiplies in float32.
_CHECK_AND_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _group_by_device_and_dtype(params: list[nn.Parameter]) -> list[tuple[torch.device, list[nn.Parameter], bool]]:
    """Parameters grouped by (device, dtype), a gradient's too, in first-seen order, each with
    whether its gradients are plain tensors on a device with foreach kernels (torch also counts
    DTensors; their per-tensor ``mul_`` gives the same bits)."""
    groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    plain = (torch.Tensor, nn.Parameter)  # a Parameter's gradient is a plain tensor
    return [(device, ps, device.type in _FOREACH_DEVICE_TYPES and all(type(p) in plain for p in ps))
            for (device, _), ps in groups.items()]


def _read_all(rows: list[tuple[Any, ...]]) -> list[list[Any]]:
    """``rows`` with every tensor replaced by its value as a Python number, in one transfer.

    Every tensor in ``rows`` is a 0-d record value on the run's device. They are stacked by
    dtype; several stacks are widened to float64 (exact for every dtype a record holds) and
    concatenated, so that one ``tolist`` reads them all. Other values pass through.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for row in rows:
        for v in row:
            if isinstance(v, torch.Tensor):
                by_dtype.setdefault(v.dtype, []).append(v)
    if not by_dtype:
        return [list(row) for row in rows]
    stacks = [torch.stack(ts) for ts in by_dtype.values()]
    flat = (stacks[0] if len(stacks) == 1 else torch.cat([t.to(torch.float64) for t in stacks])).tolist()
    read, start = {}, 0
    for dtype, ts in by_dtype.items():
        read[dtype] = iter(flat[start:start + len(ts)])
        start += len(ts)
    return [[next(read[v.dtype]) if isinstance(v, torch.Tensor) else v for v in row] for row in rows]


_F32 = struct.Struct("f")


def _mean_f32(total: float, k: int) -> float:
    """``total / k`` as one float32 division, for a float32 ``total`` and an int ``k < 2**24``.

    Both are exact in float64, so the float64 quotient rounded to float32 is the correctly
    rounded float32 quotient: double rounding is innocuous for a division when the wider
    format has at least 2 * 24 + 2 significand bits (Figueroa, 1995), and float64 has 53.
    ``struct``'s "f" rounds to nearest even; inf and NaN pass through.
    """
    return _F32.unpack(_F32.pack(total / k))[0]


_STEP_HOOKS = ("on_microbatch_end", "on_after_backward", "on_before_optimizer_step", "on_step_end")


def _active_hooks(callbacks: Sequence[Callback], name: str) -> list[Callable[..., None]]:
    """The callbacks' bound ``name`` hooks, leaving out those that are Callback's no-op."""
    base = getattr(Callback, name)
    hooks = [getattr(cb, name) for cb in callbacks]
    return [h for h in hooks if getattr(h, "__func__", None) is not base]


class Trainer:
    """Trains a model by the step contract; see the module docstring.

    Attributes available to callbacks during ``fit``: ``model`` (the module being trained,
    uncompiled), ``optimizer``, ``scaler`` (``None`` without loss scaling), ``plan``,
    ``device``, ``state``, ``schedule`` (host mode), ``found_inf`` (this step's device flag, from
    ``on_before_optimizer_step`` until the next window starts) and
    ``grad_norm`` (this step's total gradient norm before clipping, a device tensor; ``None``
    without clipping).
    """

    def __init__(self, config: Config, callbacks: Sequence[Callback] = ()):
        if not isinstance(config, Config):
            raise ValueError(f"config must be a torchimpl.config.Config, got {type(config).__name__}")
        self.config = config
        self.callbacks = list(callbacks)
        self.loss_history: list[tuple[int, float]] = []
        self.scale_history: list[tuple[int, float]] = []
        self._stop_requested: str | None = None

    # ------------------------------------------------------------------ public helpers

    def request_stop(self, reason: str = "requested") -> None:
        """End ``fit`` after the current hook returns (callable from any callback)."""
        self._stop_requested = reason

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Save now (between steps or inside an accumulation window, e.g. from a callback)."""
        if path is None:
            folder = self.config.checkpoint.folder
            if folder is None:
                raise ValueError("no path given and checkpoint.folder is not set")
            path = Path(folder) / checkpoint_name(self.state.step, self.state.window_done)
        written = self._dist.save_checkpoint(self._checkpoint_contents(), Path(path))
        self._last_checkpoint = str(written)
        log.info("saved checkpoint %s", written)
        if (self.config.checkpoint.folder is not None and Path(written).parent == Path(self.config.checkpoint.folder)
                and self._dist.is_main):
            prune_checkpoints(self.config.checkpoint.folder, self.config.checkpoint.keep_last)
        return written

    @torch.no_grad()
    def evaluate(self, val_data: Iterable[Any]) -> float:
        """Mean loss over ``val_data`` under the run's autocast; one host read at the end."""
        model = self._forward_model
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for batch in val_data:
            with autocast_context(self.plan, self.device):
                loss = self.loss_fn(model, _to_device(batch, self.device))
            total += loss.detach().to(torch.float64)
            count += 1
        self.model.train(was_training)
        if count == 0:
            raise ValueError("val_data yielded no batches")
        return float(total.item()) / count

    # ------------------------------------------------------------------ fit

    def fit(
        self,
        model: nn.Module,
        train_data: Iterable[Any],
        val_data: Iterable[Any] | None = None,
        *,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        resume: str | Path | None = None,
    ) -> RunSummary:
        """Train for ``train.steps`` optimizer steps (counting skipped ones) and summarise.

        ``resume``: a checkpoint path, or ``"latest"`` for the newest good checkpoint in
        ``checkpoint.folder`` (starting fresh when there is none).
        """
        cfg = self.config
        self._stop_requested = None
        self._last_checkpoint: str | None = None
        self._diagnosis: str | None = None
        self.loss_fn = loss_fn or default_loss_fn
        self.device = resolve_device(cfg.device)
        # Multi-process hooks (torchimpl.distributed); identities with train.distributed=none.
        self._dist = init_distributed(cfg.train.distributed, device=self.device,
                                      timeout_s=cfg.train.distributed_timeout_s)
        try:
            return self._fit(model, train_data, val_data, resume)
        finally:
            self._dist.close()

    def _fit(self, model: nn.Module, train_data: Iterable[Any], val_data: Iterable[Any] | None,
             resume: str | Path | None) -> RunSummary:
        cfg = self.config
        self._dist.check_config(cfg.to_dict())
        self.device = self._dist.place(self.device)
        self.train_data = self._dist.shard_data(train_data, cfg.train.seed)
        self.plan = resolve_precision(cfg.precision, self.device)
        downgrades = []
        if self.plan.reason:
            downgrades.append(self.plan.reason)
            warnings.warn(f"precision: {self.plan.reason}", stacklevel=2)

        self.model, forward_model = self._dist.wrap_model(model.to(self.device), self.plan)
        self.model.train()
        # The optimizer is built after the move so the fused probe sees the real parameters.
        built = build_optimizer(self.model, cfg.optimizer, self.device)
        self.optimizer = built.optimizer
        self.optimizer_kind, optimizer_reason = built.kind, built.reason
        if optimizer_reason:
            log.info("optimizer: %s (%s)", built.kind, optimizer_reason)
        # torch's fused SGD creates its momentum buffers with empty_like before the kernel reads
        # found_inf: a first step skipped inside the kernel would leave them uninitialised.
        momentum_sgd = cfg.optimizer.name == "sgd" and cfg.optimizer.momentum > 0
        self.sync_free = cfg.train.sync_free and built.kind == "fused" and not momentum_sgd
        if cfg.train.sync_free and not self.sync_free:
            why = (f"train.sync_free needs a fused optimizer, got {built.kind}" if built.kind != "fused" else
                   "train.sync_free is refused for fused SGD with momentum (torch leaves its momentum buffers "
                   "uninitialised when the kernel skips the first step)")
            msg = f"{why}; using one host sync per step"
            downgrades.append(msg)
            warnings.warn(msg, stacklevel=2)
        self.scaler = make_grad_scaler(self.plan, cfg.scaler, force=cfg.train.force_scaler)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._param_groups = _group_by_device_and_dtype(self.params)
        self._one = torch.ones((), dtype=torch.float32, device=self.device)
        self._autocast = autocast_context(self.plan, self.device)

        self.schedule = AppliedStepSchedule(self.optimizer, cfg.schedule, cfg.train.steps)
        self.state = TrainState()
        if self.sync_free:
            # The schedule lives on the device: a float32 lr tensor per group, looked up in a
            # table computed on the host by a device counter of applied steps (fused kernels
            # read tensor lrs).
            self._applied_t = torch.zeros((), dtype=torch.int64, device=self.device)
            for group in self.optimizer.param_groups:
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.device)
            self._build_lr_tables(cfg.train.steps)

        self._dist.attach(self.model, self.optimizer)
        self._forward_model = torch.compile(forward_model) if cfg.train.compile else forward_model
        self._it: Iterator[Any] | None = None
        self._epoch_rng: torch.Tensor | None = None
        # The step's found_inf flag and the window's float32 loss sum are the real and the
        # imaginary part of one complex64 device scalar: one zero_() resets both at the start of
        # a window, and the step's one host read reads both.
        self._flags = torch.zeros((), dtype=torch.complex64, device=self.device)
        self._found, self._loss_acc = torch.view_as_real(self._flags).unbind()
        self._pending: list[tuple[Any, ...]] = []
        self.found_inf: torch.Tensor | None = None  # set for each step before on_before_optimizer_step
        self.grad_norm: torch.Tensor | None = None
        self.loss_history, self.scale_history = [], []

        # Seed every generator from train.seed (a resume overwrites them with the saved states).
        random.seed(cfg.train.seed)
        np.random.seed(cfg.train.seed)
        torch.manual_seed(cfg.train.seed)
        self._dist.seed(cfg.train.seed)
        resume_contents = None
        if resume is not None:
            path = resume
            if str(resume) == "latest":
                if cfg.checkpoint.folder is None:
                    raise ValueError("resume='latest' needs checkpoint.folder")
                path = latest_checkpoint(cfg.checkpoint.folder)
                if path is None:
                    log.info("no checkpoint in %s; starting fresh", cfg.checkpoint.folder)
            if path is not None:
                resume_contents = self._dist.load_checkpoint(Path(path))
                self._restore(resume_contents, Path(path))
                log.info("resumed from %s at step %d", path, self.state.step)

        if self.scaler is not None:
            # Materialise the (possibly restored) scale on the device now, so that the step
            # records can read it without touching the scaler's lazy initialisation.
            self.scaler.scale(torch.zeros((), device=self.device))

        guard = None
        if cfg.train.guard:
            from torchimpl.diagnostics import NonFiniteGuard

            guard = NonFiniteGuard(self.model)

        writer = None
        if cfg.train.trace_file and self._dist.is_main:
            writer = TraceWriter(cfg.train.trace_file, append=resume_contents is not None)
        for cb in self.callbacks:
            cb.on_fit_start(self)
        # The per-step hooks that do something, bound once (Callback's own are no-ops).
        self._hooks = {name: _active_hooks(self.callbacks, name) for name in _STEP_HOOKS}

        if resume_contents is not None:
            # RNG last, so nothing in the set-up above consumes the restored streams.
            restore_rng_state(resume_contents["rng"])
            self._reopen_data(resume_contents["data"])

        bar = self._progress_bar() if self._dist.is_main else None
        start_step = self.state.step
        start_samples = self.state.samples
        t0 = time.perf_counter()
        excluded = 0.0  # evaluation and checkpoint time, not part of step time
        stopped = None
        if torch.cuda.is_available() and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        steps, log_interval = cfg.train.steps, cfg.train.log_interval
        ei = cfg.train.eval_interval if val_data is not None else None
        ci = cfg.checkpoint.interval if cfg.checkpoint.folder is not None else None
        try:
            while self.state.step < steps:
                try:
                    self._one_step()
                except NonFiniteError as err:  # raised by the guard's hooks (train.guard)
                    self._guard_hit(err)
                step = self.state.step
                last = step >= steps
                if step % log_interval == 0 or last or self._stop_requested:
                    self._flush(writer, bar)
                # ei/ci: None without val_data/checkpoint.folder, 0 for "at the end only".
                eval_due = ei is not None and ((ei and step % ei == 0) or last)
                save_due = ci is not None and ((ci and step % ci == 0) or last)
                if eval_due or save_due:
                    te = time.perf_counter()
                    if eval_due:
                        # The guard watches training steps; a non-finite validation loss is recorded as is.
                        if guard is not None:
                            guard.remove()
                        try:
                            self._record_val(self.evaluate(val_data))
                        finally:
                            if guard is not None:
                                guard.install()
                    if save_due:
                        self.save_checkpoint()
                    excluded += time.perf_counter() - te
                if self._stop_requested:
                    stopped = self._stop_requested
                    break
        except StopTraining as exc:
            stopped = str(exc) or "StopTraining"
        finally:
            self._flush(writer, bar)
            if writer is not None:
                writer.close()
            if guard is not None:
                guard.remove()
            if bar is not None:
                bar.close()
        elapsed = time.perf_counter() - t0 - excluded
        steps_run = max(self.state.step - start_step, 1)
        self._sync_counters()
        summary = RunSummary(
            device=str(self.device),
            precision_mode=self.plan.mode,
            autocast_dtype=str(self.plan.dtype).replace("torch.", "") if self.plan.autocast_enabled else None,
            use_scaler=self.scaler is not None,
            downgrades=downgrades,
            optimizer_kind=self.optimizer_kind,
            optimizer_reason=optimizer_reason,
            sync_free=self.sync_free,
            compiled=cfg.train.compile,
            steps=self.state.step,
            steps_applied=self.state.applied_steps,
            steps_skipped=self.state.skipped_steps,
            final_scale=float(self.scaler.get_scale()) if self.scaler is not None else None,
            time_per_step_s=elapsed / steps_run,
            samples_per_s=(self.state.samples - start_samples) / elapsed if elapsed > 0 else 0.0,
            peak_memory_bytes=(
                int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else None
            ),
            final_train_loss=self.state.last_train_loss,
            final_val_loss=self.state.last_val_loss,
            best_val_loss=self.state.best_val_loss,
            stopped=stopped,
            last_checkpoint=self._last_checkpoint,
            diagnosis_report=self._diagnosis,
        )
        for cb in self.callbacks:
            cb.on_fit_end(self, summary)
        return summary

    # ------------------------------------------------------------------ one optimizer step

    def _one_step(self) -> None:
        cfg, st = self.config, self.state
        if st.window_size == 0:
            window = self._fetch(cfg.train.microbatches)
            st.window_size, st.window_done = len(window), 0
            self.optimizer.zero_grad(set_to_none=True)
            self._flags.zero_()  # found_inf and the loss sum
        else:  # resumed inside a window: the rest of it
            window = self._fetch(st.window_size - st.window_done)
        k = st.window_size
        scaler, loss_acc, device = self.scaler, self._loss_acc, self.device
        scale_before = scaler.state_tensors()[0].clone() if scaler is not None else None
        self._window, self._scale_before = window, scale_before  # for _guard_hit, while in the window
        model, loss_fn, autocast = self._forward_model, self.loss_fn, self._autocast
        # Multi-process runs hold back DDP's gradient all-reduce until the window's last backward.
        accumulate = self._dist.accumulate if self._dist.enabled else None
        hooks = self._hooks["on_microbatch_end"]
        for batch in window:
            batch_size = _batch_size(batch)
            batch = _to_device(batch, device)
            if accumulate is None:
                with autocast:
                    loss = loss_fn(model, batch)
            else:
                with accumulate(st.window_done + 1 == k), autocast:
                    loss = loss_fn(model, batch)
            # Outside autocast from here: the accumulation, the division, the scaling and backward.
            loss_acc.add_(loss.detach().float())
            scaled = loss / k
            if scaler is not None:
                scaled = scaler.scale(scaled)
            scaled.backward()
            st.window_done += 1
            st.batch_index += 1
            st.samples += batch_size
            for hook in hooks:
                hook(self, st)
            if self._stop_requested:
                return
        self._window = None
        self._finish_step(window, k, scale_before)

    def _finish_step(self, window: list[Any], k: int, scale_before: torch.Tensor | None) -> None:
        """Rules 2-6 of the step contract, after the window's last backward."""
        cfg, st = self.config, self.state
        for hook in self._hooks["on_after_backward"]:
            hook(self, st)

        clip_norm = cfg.train.clip_norm
        grad_norm = clip_coef = None
        found_inf = self._found  # zeroed at the start of the window
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer, found_inf)
            if clip_norm is not None:
                grad_norm, clip_coef = self._clip_grads(clip_norm)
        elif clip_norm is not None:
            # Without a scaler the check runs at a scale of 1 and changes no gradient, so the
            # clip's multiply can carry it: one pass, the same found_inf, the same clipped bits.
            grad_norm, clip_coef = self._clip_grads(clip_norm, found_inf)
        else:
            self._check_nonfinite(found_inf)
        agreed = self._dist.agree(found_inf, self.scaler, self._loss_acc)
        if agreed is not found_inf:  # several processes: the all-reduced flag
            found_inf.copy_(agreed)
        self.found_inf, self.grad_norm = found_inf, grad_norm
        for hook in self._hooks["on_before_optimizer_step"]:
            hook(self, st)

        # found_inf and the window's loss sum: device tensors, or host numbers once read (host
        # mode). The mean loss is taken on the host at the log point.
        found_value, loss_sum = found_inf, self._loss_acc
        if self.sync_free:
            # Snapshots for the record: the next window zeroes both.
            found_value, loss_sum = found_inf.clone(), loss_sum.clone()
            lr_used = self.optimizer.param_groups[0]["lr"].detach().clone()
            self.optimizer.grad_scale = None
            self.optimizer.found_inf = found_inf
            self.optimizer.step()
            applied = None
        else:
            lr_used = float(self.optimizer.param_groups[0]["lr"])
            # The one host sync of the step reads both at once: found_inf, the real part, and
            # the loss sum (finite exactly when the mean is), the imaginary part.
            flags = self._flags.item()
            found_value, loss_sum = flags.real, flags.imag
            found, loss_bad = found_value > 0, not math.isfinite(loss_sum)
            if (loss_bad or (found and self.scaler is None)) and cfg.train.on_nonfinite == "stop":
                self._stop_on_nonfinite(window, "non-finite loss" if loss_bad else "non-finite gradients")
                return
            applied = not found
            if applied:
                if self.optimizer_kind == "fused":
                    self.optimizer.grad_scale = None
                    self.optimizer.found_inf = found_inf
                self.optimizer.step()
        scale_after = tracker = None
        if self.scaler is not None:
            self.scaler.update()
            # Snapshots: update() changes the live tensors in place.
            scale, tracker = self.scaler.state_tensors()
            scale_after, tracker = scale.clone(), tracker.clone()

        if self.sync_free:
            self._applied_t += (1.0 - found_inf).to(torch.int64)
            for group, table in zip(self.optimizer.param_groups, self._lr_tables):
                group["lr"].copy_(lr_from_table(table, self._applied_t))
        else:
            self.schedule.step(applied)
            st.applied_steps += int(applied)
            st.skipped_steps += int(not applied)

        # The record's values stay as they are (device tensors or host numbers) until the next
        # log point, where _flush reads all pending ones in one transfer.
        self._pending.append((st.step, k, applied, scale_before, found_value, grad_norm, clip_coef,
                              scale_after, tracker, lr_used, loss_sum))
        st.step += 1
        st.window_size = st.window_done = 0
        for hook in self._hooks["on_step_end"]:
            hook(self, st)

    def _guard_hit(self, err: NonFiniteError) -> None:
        """The guard stopped a microbatch at a non-finite value: follow ``train.on_nonfinite``.

        ``stop`` writes the diagnosis and ends ``fit`` cleanly. ``skip`` counts the window's
        remaining batches as consumed and takes the step with every gradient set to NaN, which
        is the contract's path for non-finite gradients: ``found_inf``, no update, the scale
        backs off, the schedule holds, a record is written (on every rank, through ``agree``).
        """
        st, window = self.state, self._window
        if window is None:  # not from a microbatch's forward or backward (e.g. a callback's)
            raise err
        self._window = None
        log.warning("step %d: %s", st.step, err)
        rest = window[len(window) - (st.window_size - st.window_done):]  # rest[0] hit the guard
        if self.config.train.on_nonfinite == "stop":
            self._stop_on_nonfinite(rest, f"non-finite value ({err})")
            return
        for batch in rest:
            st.window_done += 1
            st.batch_index += 1
            st.samples += _batch_size(batch)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.full_like(p, math.nan)
            else:
                p.grad.fill_(math.nan)
        self._loss_acc.fill_(math.nan)
        self._finish_step(window, st.window_size, self._scale_before)

    def _check_nonfinite(self, found: torch.Tensor, groups: list | None = None) -> None:
        """The non-finite check without a scaler: ``found`` becomes 1.0 when a gradient holds
        inf or NaN; the gradients are multiplied by 1, which leaves every bit unchanged."""
        for _, params, _ in self._param_groups if groups is None else groups:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, self._one)

    def _clip_grads(self, max_norm: float, found: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip the gradients to ``max_norm`` as ``torch.nn.utils.clip_grad_norm_`` does; return
        the total norm and the coefficient multiplied in (computed once, so the recorded one is
        the applied one). With ``found``, also run the non-finite check (scale 1) on the
        gradients before the multiply.

        torch's expression and order, so the gradients get the same bits: the norm from
        ``get_total_norm``; ``max_norm / (total_norm + 1e-6)`` (a float over a tensor: a
        reciprocal, then a multiply), clamped at 1.0 and always multiplied in (no branch, so no
        sync), one ``_foreach_mul_`` per (device, dtype) group of plain tensors, ``mul_`` per
        tensor otherwise (e.g. DTensor gradients, which torch multiplies with ``_foreach_mul_``:
        the same bits). A group of float32/bfloat16/float16 plain tensors on the check's device
        with a float32 coefficient gets the check and the multiply in one
        ``_amp_foreach_non_finite_check_and_unscale_`` with the coefficient as its factor: that
        kernel tests each value before multiplying and computes ``x * coef`` in float32, as
        ``mul_`` does on the CPU (and leaves ``x`` as it is for a factor of 1.0); on CUDA only
        when the gradients are float32 too.
        """
        all_grads = [p.grad for p in self.params if p.grad is not None]
        total_norm = self._dist.total_norm(all_grads)
        coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
        single = len(self._param_groups) == 1
        for group in self._param_groups:
            device, params, foreach = group
            grads = all_grads if single else [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            coef_here = coef.to(device)
            # Off the CPU, torch's mul_ of a 16-bit gradient by a 0-d float32 device tensor first
            # rounds the factor to the gradient's dtype, which the check kernel does not: fused
            # there only when the dtypes match.
            if found is not None and foreach and coef.dtype == torch.float32 and device == found.device \
                    and params[0].dtype in _CHECK_AND_SCALE_DTYPES \
                    and (device.type == "cpu" or params[0].dtype == coef.dtype):
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, coef_here)
                continue
            if found is not None:
                self._check_nonfinite(found, [group])
            if foreach:
                torch._foreach_mul_(grads, coef_here)
            else:
                for g in grads:
                    g.mul_(coef_here)
        return total_norm, coef

    def _flush(self, writer: TraceWriter | None, bar: Any) -> None:
        """Read pending records from the device in one transfer; log, write, call ``on_log``."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        values = _read_all([entry[3:] for entry in pending])
        records, losses = [], []
        for (step, k, applied, *_), row in zip(pending, values):
            before, found, norm, coef, after, tracker, lr, loss_sum = row
            # The mean loss of the window: its float32 sum over its size, one float32 division.
            loss = _mean_f32(loss_sum, k)
            found_b = bool(found)
            records.append(StepRecord(
                step=step, microbatches=k, scale_before=1.0 if before is None else before, found_inf=found_b,
                applied=(not found_b) if applied is None else applied, grad_norm=norm, clip_coef=coef,
                scale_after=1.0 if after is None else after, growth_tracker=0 if tracker is None else int(tracker),
                lr=lr,
            ))
            losses.append(loss)
            self.loss_history.append((step, loss))
            self.scale_history.append((step, records[-1].scale_after))
        if self.sync_free:
            applied_n = sum(r.applied for r in records)
            self.state.applied_steps += applied_n
            self.state.skipped_steps += len(records) - applied_n
            if self.config.train.on_nonfinite == "stop" and any(not math.isfinite(x) for x in losses):
                self.request_stop("non-finite loss (seen at a log point in the sync-free mode)")
        self.state.last_train_loss = losses[-1]
        if writer is not None:
            writer.write(records)
        last = records[-1]
        log.info("step %d loss %.5g scale %g lr %.3g skipped %d", last.step, losses[-1], last.scale_after,
                 last.lr, self.state.skipped_steps)
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.4g}", scale=f"{last.scale_after:g}",
                            skipped=self.state.skipped_steps, refresh=False)
            bar.update(last.step + 1 - bar.n)
        for cb in self.callbacks:
            cb.on_log(self, self.state, records, losses)

    def _sync_counters(self) -> None:
        if self.sync_free:
            self.state.applied_steps = int(self._applied_t.item())
            self.state.skipped_steps = self.state.step - self.state.applied_steps

    def _record_val(self, value: float) -> None:
        self.state.last_val_loss = value
        if math.isfinite(value) and (self.state.best_val_loss is None or value < self.state.best_val_loss):
            self.state.best_val_loss = value

    def _progress_bar(self) -> Any:
        if not sys.stderr.isatty():
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.config.train.steps, initial=self.state.step, unit="step", dynamic_ncols=True)

    def _stop_on_nonfinite(self, window: list[Any], what: str) -> None:
        """Write the diagnosis report for ``window``'s first batch and request a stop.

        Every rank diagnoses its own batch (the fault may be in any rank's data); rank 0 alone
        writes the one file, with the other ranks' diagnoses under ``other_ranks``. Under FSDP2
        the file says why there is no diagnosis.
        """
        from torchimpl.diagnostics import diagnose_nonfinite

        folder = Path(self.config.checkpoint.folder or (
            Path(self.config.train.trace_file).parent if self.config.train.trace_file else "."))
        path = folder / f"nonfinite-step{self.state.step:08d}.json"
        try:
            if self._dist.sharded:  # the diagnosis reruns the step on a copy of the whole model
                raise ValueError("FSDP2 shards the parameters; rerun from the last checkpoint with "
                                 "train.distributed=ddp or none to diagnose")
            report = diagnose_nonfinite(self.model, _to_device(window[0], self.device), self.loss_fn, self.plan,
                                        self.optimizer, self.scaler)
            data = report.to_dict() if hasattr(report, "to_dict") else dataclasses.asdict(report)
        except Exception as exc:  # the diagnosis must not hide the original problem
            data = {"error": f"diagnosis failed: {exc!r}"}
        data = {"step": self.state.step, "problem": what, "diagnosis": json.loads(json.dumps(data, default=str))}
        by_rank = self._dist.gather(data["diagnosis"], "gathering the non-finite diagnoses")
        if by_rank is not None:
            if len(by_rank) > 1:
                data["other_ranks"] = {str(r): d for r, d in enumerate(by_rank) if r}
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data, indent=2))
        self._diagnosis = str(path)
        log.error("%s at step %d; diagnosis %s %s", what, self.state.step,
                  "written to" if by_rank is not None else "of this rank written by rank 0 to", path)
        self.state.window_size = self.state.window_done = 0
        self.request_stop(f"{what} at step {self.state.step}")

    # ------------------------------------------------------------------ data position

    def _open_epoch(self, index: int = 0) -> None:
        data = self.train_data
        if hasattr(data, "iter_from"):
            self._epoch_rng = None
            self._it = iter(data.iter_from(self.state.epoch, index))
            return
        # A DataLoader draws its shuffle seed from the global generator when iterated: keep the
        # state it started from, so that a resume can rebuild the same order.
        self._epoch_rng = torch.get_rng_state()
        for target in (data, getattr(data, "sampler", None), getattr(data, "batch_sampler", None)):
            if hasattr(target, "set_epoch"):
                target.set_epoch(self.state.epoch)
        self._it = iter(data)
        for _ in range(index):
            next(self._it)

    def _fetch(self, n: int) -> list[Any]:
        """Up to ``n`` batches; fewer at the end of an epoch (windows never cross epochs)."""
        batches: list[Any] = []
        while len(batches) < n:
            if self._it is None:
                self._open_epoch()
            try:
                batches.append(next(self._it))
            except StopIteration:
                if batches:
                    break
                if self.state.batch_index == 0:
                    raise ValueError(
                        f"train_data yielded no batches in epoch {self.state.epoch}; pass a re-iterable "
                        "source (a list, a DataLoader), not a one-shot generator"
                    ) from None
                self._it = None
                self.state.epoch += 1
                self.state.batch_index = 0
        return batches

    def _reopen_data(self, data_state: dict[str, Any]) -> None:
        self.state.epoch = int(data_state["epoch"])
        index = int(data_state["index"])
        if not data_state.get("started", True):
            self._it = None
            return
        if hasattr(self.train_data, "iter_from"):
            self._open_epoch(index)
            return
        saved = data_state.get("epoch_rng")
        current = torch.get_rng_state()
        if saved is not None:
            torch.set_rng_state(saved)
        self._open_epoch(index)
        torch.set_rng_state(current)

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_contents(self) -> dict[str, Any]:
        st = self.state
        if self.sync_free:
            # The device count includes steps whose records are not flushed yet: save it, but
            # leave self.state to the flushes, which count every record once.
            applied = int(self._applied_t.item())
            st = dataclasses.replace(st, applied_steps=applied, skipped_steps=st.step - applied)
        schedule_state = self.schedule.state_dict()
        schedule_state["applied_steps"] = st.applied_steps
        mid_window = st.window_size > 0
        return {
            "format": CHECKPOINT_FORMAT,
            "versions": {"torch": str(torch.__version__), "ampspec": _ampspec_version()},
            "config": self.config.to_dict(),
            "model": self.model.state_dict(),
            "model_signature": {k: list(v.shape) for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "optimizer_kind": self.optimizer_kind,
            "schedule": schedule_state,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "trainer": dataclasses.asdict(st),
            "accumulation": {
                "grads": [p.grad.detach().clone() if p.grad is not None else None for p in self.params],
                "loss": self._loss_acc.detach().clone(),
            } if mid_window else None,
            "rng": capture_rng_state(),
            "data": {"epoch": st.epoch, "index": st.batch_index, "epoch_rng": self._epoch_rng,
                     "started": self._it is not None},
        }

    def _restore(self, ckpt: dict[str, Any], path: Path) -> None:
        if ckpt.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path}: checkpoint format {ckpt.get('format')!r}, expected {CHECKPOINT_FORMAT}")
        mine = {k: list(v.shape) for k, v in self.model.state_dict().items()}
        theirs = ckpt["model_signature"]
        if mine != theirs:
            missing = sorted(set(mine) - set(theirs))
            extra = sorted(set(theirs) - set(mine))
            shapes = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
            parts = [f"missing {missing[:5]}" if missing else "", f"unexpected {extra[:5]}" if extra else "",
                     f"different shapes for {shapes[:5]}" if shapes else ""]
            raise CheckpointError(
                f"{path} was saved from a different model: " + "; ".join(p for p in parts if p)
            )
        self.model.load_state_dict(ckpt["model"])
        try:
            self.optimizer.load_state_dict(ckpt["optimizer"])
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{path}: optimizer state does not fit this optimizer: {exc}") from None
        if ckpt.get("optimizer_kind") != self.optimizer_kind:
            log.warning("%s was saved with a %s optimizer, resuming with %s: updates may differ in the last bits",
                        path, ckpt.get("optimizer_kind"), self.optimizer_kind)
        sched = ckpt["schedule"]
        if self.sync_free:
            self.schedule.base_lrs = [float(b) for b in sched["base_lrs"]]
            applied = int(sched["applied_steps"])
            self._applied_t.fill_(applied)
            # A run saved with more steps than this one's train.steps still finds its rate.
            self._build_lr_tables(max(self.config.train.steps, applied))
            for group, table in zip(self.optimizer.param_groups, self._lr_tables):
                # A new tensor: load_state_dict above put the saved group's lr (any type) there.
                group["lr"] = lr_from_table(table, self._applied_t)
        else:
            self.schedule.load_state_dict(sched)
        self._restore_scaler(ckpt.get("scaler"), path)
        fields = {f.name for f in dataclasses.fields(TrainState)}
        self.state = TrainState(**{k: v for k, v in ckpt["trainer"].items() if k in fields})
        acc = ckpt.get("accumulation")
        if acc is not None:
            for p, g in zip(self.params, acc["grads"]):
                p.grad = None if g is None else g.to(self.device)
            self._loss_acc.copy_(acc["loss"])

    def _build_lr_tables(self, last: int) -> None:
        """Sync-free mode: each group's rates for 0 .. ``last`` applied steps, on the device."""
        self._lr_tables = [lr_table(base, self.config.schedule, self.config.train.steps, self.device, last)
                           for base in self.schedule.base_lrs]

    def _restore_scaler(self, state: dict[str, Any] | None, path: Path) -> None:
        if self.scaler is not None and state is None:
            warnings.warn(
                f"{path} holds no loss-scaler state (saved by a run without a scaler); the scaler "
                f"starts fresh at init_scale={getattr(self.scaler, 'policy', self.config.scaler).init_scale}",
                stacklevel=3,
            )
        elif self.scaler is None and state is not None:
            warnings.warn(
                f"{path} holds a loss-scaler state (scale {state.get('scale')}) but this run's "
                f"precision plan ({self.plan.mode}) uses no scaler; the state was ignored",
                stacklevel=3,
            )
        elif self.scaler is not None:
            self.scaler.load_state_dict(state)


def _ampspec_version() -> str:
    try:
        from importlib.metadata import version

        return version("ampspec")
    except Exception:  # not installed (running from a checkout)
        return getattr(torchimpl, "__version__", "unknown")
