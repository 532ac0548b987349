"""Parameters held in 16 bits (``precision.mode: bf16-true`` or ``fp16-true``) in the trainer.

1. The model is cast with ``module.to(dtype)`` once it is on its device, and every floating
   tensor of a batch is cast to the same dtype before the model sees it (what Lightning's
   ``HalfPrecision`` does: integer tensors, such as token ids and labels, are left alone).
2. The optimizer is built as for any run, over the model's 16-bit parameters; a
   :class:`~torchimpl.train.master_weights.MasterWeights` of ``precision.master_weights`` wraps
   it, and the step engine calls :class:`MasterStep` in place of ``optimizer.step()`` on an
   applied step, after the unscale, the inf/NaN check and the clip of the 16-bit gradients.
3. Lost updates (``reference.health`` rule 12: the exact update finite and non-zero, the stored
   bits unchanged) are counted on every applied step for ``fp32``, ``kahan`` and ``stochastic``
   (the exact update is at hand), and for ``none`` on the applied steps whose index is a
   multiple of ``train.log_interval`` (a second, float32 evaluation of the step gives the exact
   update). The sync-free mode (``none`` only) counts none. The stored value is the one that
   holds the weight: the 16-bit parameter, but under ``fp32`` the float32 master, which every
   update of the float32 step reaches (``lost`` is 0 there); how often the 16-bit copy alone
   did not change is ``storage_unchanged`` for every option.
4. With ``master_weights: none``, once the fraction of the updates counted so far that were lost
   passes :data:`LOST_UPDATE_WARNING` (a tenth), the trainer warns once (``LostUpdateWarning``),
   naming the other options and ``precision.master_weights``. The other options report their
   fraction without a warning: ``fp32`` counts on its master copy, where nothing but a float32
   rounding is lost; under ``kahan`` an unchanged bf16 weight keeps the update in its
   compensation buffer, and under ``stochastic`` it is kept in expectation.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from torchimpl.precision.batches import to_device
from torchimpl.train.master_weights import MasterWeights

__all__ = ["LOST_UPDATE_WARNING", "LostUpdateWarning", "MasterStep", "batch_preparer", "cast_batch", "cast_model",
           "master_step"]

LOST_UPDATE_WARNING = 0.1
"""Rule 4: the fraction of lost updates past which the trainer warns."""

_OTHERS = ("fp32 (a float32 master copy and float32 optimizer state), kahan (a 16-bit compensation buffer) or "
           "stochastic (stochastic rounding to bf16)")


class LostUpdateWarning(UserWarning):
    """More than :data:`LOST_UPDATE_WARNING` of a run's counted updates were lost to rounding."""


def cast_model(model: nn.Module, plan: Any) -> nn.Module:
    """Rule 1: the model in the plan's parameter dtype (unchanged for float32 parameters)."""
    return model if plan.param_dtype == torch.float32 else model.to(plan.param_dtype)


def cast_batch(batch: Any, dtype: torch.dtype) -> Any:
    """Rule 1: ``batch`` with its floating tensors in ``dtype`` (containers as ``to_device`` walks them)."""
    if isinstance(batch, (tuple, list)):
        return type(batch)([cast_batch(b, dtype) for b in batch])
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: cast_batch(v, dtype) for k, v in batch.items()}
    return batch


def batch_preparer(plan: Any) -> Callable[[Any, torch.device], Any]:
    """Rule 1: a batch's way to the model, ``(batch, device) -> batch``: ``to_device``, then the
    cast of its floating tensors to the parameters' dtype under a ``*-true`` plan."""
    dtype = plan.param_dtype
    if dtype == torch.float32:
        return to_device
    return lambda batch, device: cast_batch(to_device(batch, device), dtype)


class MasterStep:
    """Rules 2-4: the applied step through the master-weight option, and its lost-update counts."""

    def __init__(self, master: MasterWeights, *, state: Any, measure_every: int, storage: str):
        self.master, self.state, self.every, self.storage = master, state, measure_every, storage
        self.lost = self.counted = self.measured_steps = self.unchanged = 0
        self.warned = False

    def __call__(self) -> None:
        option = self.master.option
        measure = option != "none" or self.state.step % self.every == 0
        self.master.step(measure_lost=measure)
        if measure:
            counts = [c for c in self.master.lost_counts() if c is not None]
            unchanged = sum(c[0] for c in counts)
            self.unchanged += unchanged
            self.lost += 0 if option == "fp32" else unchanged  # rule 3: the master holds the weight
            self.counted += sum(c[1] for c in counts)
            self.measured_steps += 1
            self._warn()

    @property
    def fraction(self) -> float | None:
        """Lost over counted updates so far; None before any was counted."""
        return self.lost / self.counted if self.counted else None

    def _warn(self) -> None:
        fraction = self.fraction
        if self.warned or self.master.option != "none" or fraction is None or fraction <= LOST_UPDATE_WARNING:
            return
        self.warned = True
        warnings.warn(f"precision: {fraction:.1%} of the parameter updates counted up to step {self.state.step} "
                      f"were lost (the stored {self.storage} value did not change although the exact update was "
                      f"non-zero) with precision.master_weights='none', more than {LOST_UPDATE_WARNING:.0%}; set "
                      f"precision.master_weights to {_OTHERS}", LostUpdateWarning, stacklevel=2)

    def to_dict(self) -> dict[str, Any]:
        """For the run summary's ``lost_updates``."""
        return {"master_weights": self.master.option, "lost": self.lost, "counted": self.counted,
                "measured_steps": self.measured_steps, "fraction": self.fraction,
                "storage_unchanged": self.unchanged, "warning_threshold": LOST_UPDATE_WARNING,
                "bytes_per_parameter": self.master.bytes_per_parameter()}

    def summary(self) -> dict[str, Any]:
        """The run summary's fields (``master_weights``, ``lost_update_fraction``, ``lost_updates``)."""
        return {"master_weights": self.master.option, "lost_update_fraction": self.fraction,
                "lost_updates": self.to_dict()}

    def state_dict(self) -> dict[str, Any]:
        return {"lost": self.lost, "counted": self.counted, "measured_steps": self.measured_steps,
                "unchanged": self.unchanged, "warned": self.warned}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.lost, self.counted = int(state["lost"]), int(state["counted"])
            self.measured_steps, self.warned = int(state["measured_steps"]), bool(state["warned"])
            self.unchanged = int(state["unchanged"])


def master_step(optimizer: torch.optim.Optimizer, plan: Any, *, seed: int, state: Any,
                measure_every: int) -> MasterStep | None:
    """Rule 2: the step for a ``*-true`` plan (None for float32 parameters). The stochastic
    option's generator is seeded from ``train.seed``, on the parameters' device."""
    if plan.param_dtype == torch.float32:
        return None
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    generator = None
    if plan.master_weights == "stochastic":
        generator = torch.Generator(device)
        generator.manual_seed(seed)
    master = MasterWeights(optimizer, plan.master_weights, generator=generator)
    return MasterStep(master, state=state, measure_every=measure_every,
                      storage=str(plan.param_dtype).replace("torch.", ""))
