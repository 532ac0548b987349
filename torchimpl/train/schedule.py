"""Learning-rate schedules as pure functions of the number of APPLIED optimizer steps.

A skipped step (non-finite gradients) does not count: the schedule stands still, so a run
with skips follows the same learning-rate curve as one without, only later. Two forms:

1. :func:`lr_at` on the host (Python floats, float64), used when the trainer knows on the
   host whether a step was applied;
2. :func:`lr_table` for the sync-free mode, where the count of applied steps is a device
   tensor: :func:`lr_at` for every count the run can reach, computed once on the host and
   rounded to float32 (the fused optimizers read a float32 lr tensor), then indexed on the
   device by the count. The device never evaluates the formula, so the rate is the host's on
   every device (a CUDA ``cos`` need not round as the host's does).

Rules, with ``n`` the applied steps so far, ``W`` the warmup steps, ``D`` the decay steps:
1. warmup (``n < W``): ``lr * (n + 1) / W``;
2. constant: ``lr`` afterwards;
3. cosine: ``p = clamp((n - W) / max(1, D - W), 0, 1)``,
   ``lr * (r + (1 - r) * (1 + cos(pi * p)) / 2)`` with ``r = min_lr_ratio``;
4. a user's own ``torch.optim.lr_scheduler.LRScheduler`` (:class:`UserSchedule`) obeys the same
   rule: its ``step()`` is called once after each applied step and never after a skipped one,
   so its count of steps is the count of applied steps. Without one, a user's optimizer keeps
   its learning rate. ``ReduceLROnPlateau`` is refused: it steps on a metric, not on steps.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from torchimpl.config.schema import ScheduleConfig
from torchimpl.train.optim import qualified_name

__all__ = ["AppliedStepSchedule", "UserSchedule", "adopt_scheduler", "lr_at", "lr_from_table", "lr_table"]


def lr_at(n: int, base_lr: float, config: ScheduleConfig, total_steps: int) -> float:
    """Learning rate for the step taken after ``n`` applied steps."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    warm = config.warmup_steps
    if n < warm:
        return base_lr * (n + 1) / warm
    if config.name == "constant":
        return base_lr
    decay = config.decay_steps if config.decay_steps is not None else total_steps
    p = min(max((n - warm) / max(1, decay - warm), 0.0), 1.0)
    r = config.min_lr_ratio
    return base_lr * (r + (1.0 - r) * (1.0 + math.cos(math.pi * p)) / 2.0)


def lr_table(base_lr: float, config: ScheduleConfig, total_steps: int, device: torch.device | str,
             last: int | None = None) -> torch.Tensor:
    """``float32(lr_at(n))`` for ``n = 0 .. last`` (default ``total_steps``), a tensor on ``device``."""
    last = total_steps if last is None else last
    if last < 0:
        raise ValueError(f"last must be >= 0, got {last}")
    values = [lr_at(n, base_lr, config, total_steps) for n in range(last + 1)]
    return torch.tensor(values, dtype=torch.float64).to(device=device, dtype=torch.float32)


def lr_from_table(table: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``table[n]`` for a 0-d integer device tensor ``n``, as a 0-d tensor, without a host sync
    (``table[n]`` would read ``n`` on the host)."""
    return table.index_select(0, n.reshape(1)).reshape(())


class AppliedStepSchedule:
    """Sets ``param_group["lr"]`` from the count of applied steps.

    ``step(applied)`` advances only when ``applied`` is true, the opposite of a torch
    ``LRScheduler`` whose ``step()`` counts calls. State is the applied count and the base
    learning rates (one per parameter group).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: ScheduleConfig, total_steps: int):
        self.optimizer = optimizer
        self.config = config
        self.total_steps = total_steps
        self.base_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        self.applied_steps = 0
        self.apply()

    def lrs(self) -> list[float]:
        return [lr_at(self.applied_steps, b, self.config, self.total_steps) for b in self.base_lrs]

    def apply(self) -> None:
        n, config, total = self.applied_steps, self.config, self.total_steps
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = lr_at(n, base, config, total)

    def step(self, applied: bool) -> None:
        if applied:
            self.applied_steps += 1
        self.apply()

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"applied_steps": self.applied_steps, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        base = [float(b) for b in state["base_lrs"]]
        if len(base) != len(self.base_lrs):
            raise ValueError(
                f"schedule state has {len(base)} parameter groups, the optimizer has {len(self.base_lrs)}"
            )
        self.base_lrs = base
        self.applied_steps = int(state["applied_steps"])
        self.apply()


def adopt_scheduler(optimizer: torch.optim.Optimizer, scheduler: Any) -> Any:
    """Rule 4: the user's scheduler (or ``scheduler(optimizer)``), checked to drive ``optimizer``."""
    if scheduler is None:
        return None
    if not isinstance(scheduler, (LRScheduler, ReduceLROnPlateau)):
        if not callable(scheduler):
            raise ValueError(f"scheduler must be a torch.optim.lr_scheduler.LRScheduler or a function optimizer -> "
                             f"LRScheduler, got {type(scheduler).__name__}")
        scheduler = scheduler(optimizer)
    if isinstance(scheduler, ReduceLROnPlateau):
        raise ValueError("scheduler: ReduceLROnPlateau steps on a validation metric, not once per applied step; "
                         "ampspec steps the scheduler after every applied optimizer step, so use a step-based "
                         "scheduler (StepLR, CosineAnnealingLR, LambdaLR, ...)")
    if not isinstance(scheduler, LRScheduler):
        raise ValueError(f"the scheduler function returned a {type(scheduler).__name__}, not an LRScheduler")
    if scheduler.optimizer is not optimizer:
        raise ValueError("scheduler drives another optimizer than the one given: build it on the optimizer you pass "
                         "(or pass a function optimizer -> LRScheduler)")
    return scheduler


class UserSchedule:
    """Rule 4: a user's scheduler stepped after applied steps only (``None``: the optimizer's
    rates are left alone). The same interface as :class:`AppliedStepSchedule`."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any):
        self.optimizer, self.scheduler = optimizer, scheduler

    @property
    def base_lrs(self) -> list[float]:
        if self.scheduler is not None:
            return [float(b) for b in self.scheduler.base_lrs]
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def apply(self) -> None:
        """Nothing to set: the scheduler (or the user) owns the rates."""

    def step(self, applied: bool) -> None:
        if applied and self.scheduler is not None:
            self.scheduler.step()

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        sched = self.scheduler
        return {"scheduler": None if sched is None else sched.state_dict(),
                "scheduler_class": None if sched is None else qualified_name(sched), "base_lrs": self.base_lrs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("scheduler_class")
        now = None if self.scheduler is None else qualified_name(self.scheduler)
        if saved != now:  # checked before (RunState), so this is the last line of defence
            raise ValueError(f"the checkpoint's scheduler is {saved}, this run's is {now}")
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
