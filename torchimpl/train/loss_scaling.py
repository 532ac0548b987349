"""The step engine's loss scaling, chosen once per run (``torchimpl.train.step``):
:class:`DynamicScaling` around a ``DynamicLossScaler``, or :class:`UnitScaling` without one
(scale 1, the inf/NaN check only: jmp's ``NoOpLossScale``); and rule 5 of ``reference/step.py``,
the collapsed scale that stops a run."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from torchimpl.train.clipping import check_nonfinite_
from torchimpl.train.scaler import DynamicLossScaler

__all__ = ["DynamicScaling", "UnitScaling", "collapse_problem", "scale_collapsed"]


class UnitScaling:
    """No loss scaler (bf16, fp32, or ``scaler.enabled=false``): the scale is 1 and never
    changes; unscaling is the inf/NaN check at a factor of 1, which changes no bit."""

    scaler: DynamicLossScaler | None = None
    is_unit = True

    def __init__(self, groups: list, one: torch.Tensor):
        self._groups, self._one = groups, one

    def scale_before(self) -> float:
        return 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer, found: torch.Tensor) -> None:
        check_nonfinite_(self._groups, found, self._one)

    def check_unscaled(self, found: torch.Tensor) -> None:
        """The gradients were never scaled: ``unscale_`` checked them."""

    def update(self, found: torch.Tensor) -> tuple[float, int]:
        return 1.0, 0

    def collapsed(self) -> float | None:
        return None

    def materialise(self, device: torch.device) -> None: ...

    def final_scale(self) -> float | None:
        return None

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict[str, Any] | None, path: Path, plan_mode: str) -> None:
        if state is not None:
            warnings.warn(f"{path} holds a loss-scaler state (scale {state.get('scale')}) but this run's "
                          f"precision plan ({plan_mode}) uses no scaler; the state was ignored", stacklevel=3)


class DynamicScaling:
    """A ``DynamicLossScaler``: losses scaled, gradients unscaled once, the scale updated."""

    is_unit = False

    def __init__(self, scaler: DynamicLossScaler, groups: list, one: torch.Tensor):
        self.scaler, self._groups, self._one = scaler, groups, one
        # The last update's snapshot of the scale: (live tensor, its version then, the copy).
        self._after: tuple[torch.Tensor, int, torch.Tensor] | None = None

    def scale_before(self) -> torch.Tensor:
        """A copy of the live scale (``update()`` changes it in place): the last update's
        snapshot while the live tensor is the same one, unwritten since (its version counter
        moves with every in-place write: a loaded state, a hook's ``update(new_scale)``)."""
        live = self.scaler.state_tensors()[0]
        after = self._after
        if after is not None and after[0] is live and after[1] == live._version:
            return after[2]
        return live.clone()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer, found: torch.Tensor) -> None:
        self.scaler.unscale_(optimizer, found)

    def check_unscaled(self, found: torch.Tensor) -> None:
        """The check again, on the unscaled gradients: unscaling a finite gradient by the
        inverse of a scale below 1 can overflow, and a collapsed scale gives ``0 * inf``."""
        check_nonfinite_(self._groups, found, self._one)

    def update(self, found: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale's update from ``found`` (the step's whole check), then its snapshots."""
        for state in self.scaler._per_optimizer_states.values():
            for record in state["found_inf_per_device"].values():
                if record is not found:  # torch's own path kept a copy of the scaled check
                    record.copy_(found.to(record.device))
        self.scaler.update()
        scale, tracker = self.scaler.state_tensors()
        after = scale.clone()
        self._after = (scale, scale._version, after)
        return after, tracker.clone()

    def collapsed(self) -> float | None:
        """The scale when it has collapsed (rule 5 of ``reference/step.py``), else None; a sync."""
        scale = float(self.scaler.state_tensors()[0])
        return scale if scale_collapsed(scale) else None

    def materialise(self, device: torch.device) -> None:
        """Create the (possibly restored) scale on the device now, so that the step records
        read it without touching the scaler's lazy initialisation."""
        self.scaler.scale(torch.zeros((), device=device))

    def final_scale(self) -> float | None:
        return float(self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None, path: Path, plan_mode: str) -> None:
        if state is None:
            warnings.warn(f"{path} holds no loss-scaler state (saved by a run without a scaler); the scaler "
                          f"starts fresh at init_scale={self.scaler.policy.init_scale}", stacklevel=3)
            return
        self.scaler.load_state_dict(state)


_F32_MAX = float(torch.finfo(torch.float32).max)


def scale_collapsed(scale: float) -> bool:
    """A loss scale has collapsed when ``f32(1 / f64(scale))``, the factor that unscales, is
    not finite: 0, NaN, or a scale below about ``2**-128``."""
    if not scale > 0:
        return True
    inv = 1.0 / scale  # float64, as the unscale computes it
    # Rounded to float32, inv overflows from the midpoint between float32's max and 2**128 on.
    return not inv < _F32_MAX + 2.0**103


def collapse_problem(step: int, scale: float) -> str:
    return (f"loss scale collapsed to {scale!r} at step {step}: its float32 inverse is not finite, so no "
            "gradient can be unscaled any more (every recent step overflowed; see the diagnosis). Resume "
            "from the last checkpoint after fixing the overflow's cause, or with a larger scaler.init_scale")
