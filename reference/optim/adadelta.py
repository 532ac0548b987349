"""``torch.optim.Adadelta`` as torch computes it on CPU.

Rules (``f`` rounds to the parameter dtype; `reference.optim._common` states the operations):

1. State: ``step`` (a float32 counter), ``square_avg`` and ``acc_delta`` (zeros).
2. Per parameter with a gradient: ``step = step + 1``; ``d = -g if maximize else g``; with
   weight decay ``d = add(d, p, wd)``; ``square_avg = addcmul(f(square_avg * f(rho)), d, d, 1 - rho)``.
3. ``std = sqrt(f(square_avg + f(eps)))``; ``delta = sqrt(f(acc_delta + f(eps)))``, then
   ``delta = f(f(delta / std) * d)``.
4. ``acc_delta = addcmul(f(acc_delta * f(rho)), delta, delta, 1 - rho)``; ``p = add(p, delta, -lr)``.
5. The foreach path does the same operations in the same order; its square root is
   ``torch._foreach_sqrt`` (`reference.optim` rule 9). torch has no fused Adadelta.
6. A tensor lr is read as the number it holds (`reference.optim._lr` rule 1), on both paths:
   torch hands ``-lr`` to ``add``'s ``alpha``. (Only ``capturable`` foreach, which needs CUDA,
   multiplies by the tensor instead.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from reference.optim._common import (add, addcmul, check_inputs, check_lr, check_nonnegative, check_param,
                                     for_each_param, frozen, lr_value, require, step_counter)

from reference.optim._registry import OptimizerSpec, register

__all__ = ["AdadeltaConfig", "AdadeltaState", "adadelta_init_state", "adadelta_magnitudes", "adadelta_step"]


@dataclass(frozen=True)
class AdadeltaConfig:
    """``torch.optim.Adadelta`` hyperparameters, torch's defaults and checks (``0 <= rho <= 1``)."""

    lr: float = 1.0
    rho: float = 0.9
    eps: float = 1e-6
    weight_decay: float = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        require(0.0 <= self.rho <= 1.0, f"rho must be in [0, 1], got {self.rho!r}")
        check_nonnegative(eps=self.eps, weight_decay=self.weight_decay)


@dataclass(frozen=True)
class AdadeltaState:
    """One parameter's state, named as torch's keys."""

    step: np.float32
    square_avg: np.ndarray
    acc_delta: np.ndarray


def adadelta_init_state(p: np.ndarray, config: AdadeltaConfig) -> AdadeltaState:
    """Rule 1."""
    a = check_param(p, 0)
    return AdadeltaState(step=np.float32(0.0), square_avg=frozen(np.zeros_like(a)), acc_delta=frozen(np.zeros_like(a)))


def adadelta_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[AdadeltaState],
    config: AdadeltaConfig,
    *,
    lr: float | None = None,
    sqrt: Callable[[np.ndarray], np.ndarray] | None = None,
    grad_scale: float | None = None,
    found_inf: float = 0.0,
) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple[AdadeltaState, ...]]:
    """One step of the for-loop or foreach path (rules 2-6); ``sqrt``: torch's square root."""
    arrays = check_inputs(params, grads, state, config, AdadeltaConfig, AdadeltaState)
    require(grad_scale is None and found_inf == 0.0, "Adadelta has no kernel that unscales (GradScaler does)")
    rate, root, c = lr_value(config, lr), np.sqrt if sqrt is None else sqrt, config

    def update(p: np.ndarray, g: np.ndarray, s: AdadeltaState) -> tuple[np.ndarray, AdadeltaState, np.ndarray]:
        f = p.dtype.type
        d = -g if c.maximize else g
        if c.weight_decay != 0:
            d = add(d, p, c.weight_decay)
        square_avg = addcmul(s.square_avg * f(c.rho), d, d, 1 - c.rho)
        std = root(square_avg + f(c.eps))
        delta = (root(s.acc_delta + f(c.eps)) / std) * d
        acc_delta = addcmul(s.acc_delta * f(c.rho), delta, delta, 1 - c.rho)
        return add(p, delta, -rate), AdadeltaState(step_counter(s.step), frozen(square_avg), frozen(acc_delta)), g

    return for_each_param(arrays, grads, state, update)


def adadelta_magnitudes(config: AdadeltaConfig, p: np.ndarray, g: np.ndarray, old: AdadeltaState,
                        new: AdadeltaState) -> dict[str, np.ndarray]:
    """``x_abs`` of each field: rules 2-4 on magnitudes, float64 (every root's argument is a
    sum of magnitudes, so it does not cancel)."""
    c, a64 = config, (lambda x: np.abs(np.asarray(x, np.float64)))
    p64, d = a64(p), a64(g) + c.weight_decay * a64(p)
    square_avg = c.rho * a64(old.square_avg) + (1 - c.rho) * d * d
    with np.errstate(divide="ignore", invalid="ignore"):
        delta = np.sqrt(a64(old.acc_delta) + c.eps) / np.sqrt(np.asarray(new.square_avg, np.float64) + c.eps) * d
        delta = np.where(np.isfinite(delta), delta, np.inf)
        return {"square_avg": square_avg, "acc_delta": c.rho * a64(old.acc_delta) + (1 - c.rho) * delta * delta,
                "param": p64 + c.lr * delta}


# --- the registry row (reference.optim._registry) --------------------------------------------

# Native-kernel bounds (rule 10 of reference.optim), in ULPs of x_abs, 2k for k roundings:
#   square_avg: as RMSprop's, k = 5. delta: root of acc + eps (1, halved, + 2 faithful) 2.5 over
#   the root of square_avg + eps (6, halved, + 2) 5, the division 8.5, times d 11.5; acc_delta
#   squares it (2 * 11.5 + 1) and adds rho*acc (2 more): k = 26. param: delta, times lr, + p: k = 14.


def _adadelta(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return adadelta_step(params, grads, state, config, lr=lr, sqrt=sqrt)


register(OptimizerSpec("Adadelta", AdadeltaConfig, AdadeltaConfig, adadelta_init_state,
                       {"for-loop": _adadelta, "foreach": _adadelta}, magnitudes=adadelta_magnitudes,
                       native_ulp={"square_avg": 2 * 5, "acc_delta": 2 * 26, "param": 2 * 14}, elementwise=True))
