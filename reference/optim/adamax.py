"""``torch.optim.Adamax`` as torch computes it on CPU.

Rules (``f`` rounds to the parameter dtype; `reference.optim._common` states the operations):

1. State: ``step`` (a float32 counter), ``exp_avg`` and ``exp_inf`` (zeros).
2. Per parameter with a gradient: ``step = step + 1``; ``d = -g if maximize else g``; with
   weight decay ``d = add(d, p, wd)``; ``exp_avg = lerp(exp_avg, d, 1 - beta1)``.
3. ``exp_inf = maximum(f(exp_inf * f(beta2)), f(|d| + f(eps)))`` (NaN propagates).
4. ``clr = lr / (1 - beta1 ** step)`` in float64; ``p = addcdiv(p, exp_avg, exp_inf, -clr)``.
5. The foreach path does the same operations in the same order (its step size is
   ``(lr / bc) * -1``, the same float64). torch has no fused Adamax.
6. A tensor lr (`reference.optim._lr`, ``L`` its dtype): the for-loop path divides it as a
   tensor, ``clr = L(lr / L(1 - beta1 ** step))``, and hands ``-clr`` to ``addcdiv`` as the number
   it holds (a float32 rate is rounded to float32 there, where a Python float stays float64);
   the foreach path reads ``lr.item()`` and computes as with a Python float.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from reference.optim import _lr
from reference.optim._common import (add, addcdiv, check_inputs, check_lr, check_nonnegative, check_param,
                                     for_each_param, frozen, lerp, lr_value, require, step_counter)
from reference.optim.rmsprop import quotient_magnitude

from reference.optim._registry import OptimizerSpec, register

__all__ = ["AdamaxConfig", "AdamaxState", "adamax_init_state", "adamax_magnitudes", "adamax_step"]


@dataclass(frozen=True)
class AdamaxConfig:
    """``torch.optim.Adamax`` hyperparameters, torch's defaults and checks."""

    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        require(len(self.betas) == 2, f"betas must be a pair (beta1, beta2), got {self.betas!r}")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        for name, beta in zip(("betas[0]", "betas[1]"), self.betas):
            require(0.0 <= beta < 1.0, f"{name} must be in [0, 1), got {beta!r}")
        check_nonnegative(eps=self.eps, weight_decay=self.weight_decay)


@dataclass(frozen=True)
class AdamaxState:
    """One parameter's state, named as torch's keys."""

    step: np.float32
    exp_avg: np.ndarray
    exp_inf: np.ndarray


def adamax_init_state(p: np.ndarray, config: AdamaxConfig) -> AdamaxState:
    """Rule 1."""
    a = check_param(p, 0)
    return AdamaxState(step=np.float32(0.0), exp_avg=frozen(np.zeros_like(a)), exp_inf=frozen(np.zeros_like(a)))


def adamax_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[AdamaxState],
    config: AdamaxConfig,
    *,
    lr: float | None = None,
    sqrt: Callable[[np.ndarray], np.ndarray] | None = None,
    grad_scale: float | None = None,
    found_inf: float = 0.0,
    foreach: bool = False,
) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple[AdamaxState, ...]]:
    """One step of the for-loop path, or with ``foreach`` the foreach path (rules 2-6); Adamax
    takes no square root."""
    arrays = check_inputs(params, grads, state, config, AdamaxConfig, AdamaxState)
    require(grad_scale is None and found_inf == 0.0, "Adamax has no kernel that unscales (GradScaler does)")
    rate, (beta1, beta2), c = lr_value(config, lr), config.betas, config
    tensor = None if foreach else _lr.tensor_lr(lr)  # rule 6

    def update(p: np.ndarray, g: np.ndarray, s: AdamaxState) -> tuple[np.ndarray, AdamaxState, np.ndarray]:
        f = p.dtype.type
        step = step_counter(s.step)
        d = -g if c.maximize else g
        if c.weight_decay != 0:
            d = add(d, p, c.weight_decay)
        exp_avg = lerp(s.exp_avg, d, 1 - beta1)
        exp_inf = np.maximum(s.exp_inf * f(beta2), np.abs(d) + f(c.eps))
        bc = 1 - beta1 ** float(step)
        clr = rate / bc if tensor is None else _lr.value(_lr.over(tensor, bc))
        return addcdiv(p, exp_avg, exp_inf, -clr), AdamaxState(step, frozen(exp_avg), frozen(exp_inf)), g

    return for_each_param(arrays, grads, state, update)


def adamax_magnitudes(config: AdamaxConfig, p: np.ndarray, g: np.ndarray, old: AdamaxState,
                      new: AdamaxState) -> dict[str, np.ndarray]:
    """``x_abs`` of each field: rules 2-4 on magnitudes, float64."""
    (beta1, beta2), a64 = config.betas, (lambda x: np.abs(np.asarray(x, np.float64)))
    p64, d = a64(p), a64(g) + config.weight_decay * a64(p)
    m = beta1 * a64(old.exp_avg) + (1 - beta1) * d
    u = np.maximum(beta2 * a64(old.exp_inf), d + config.eps)
    clr = config.lr / (1 - beta1 ** float(new.step))
    return {"exp_avg": m, "exp_inf": u,
            "param": p64 + clr * quotient_magnitude(np.asarray(new.exp_avg, np.float64), m,
                                                    np.asarray(new.exp_inf, np.float64), u)}


# --- the registry row (reference.optim._registry) --------------------------------------------

# Native-kernel bounds (rule 10 of reference.optim), in ULPs of x_abs, 2k for k roundings:
#   exp_avg: d (2) and the lerp (5): k = 5. exp_inf: beta2*u (1) against |d| + eps (3), a max of
#   the two: k = 3. param: the quotient of both (5 + 3 + 1), times clr, + p: k = 11.


def _adamax(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return adamax_step(params, grads, state, config, lr=lr, sqrt=sqrt)


def _foreach_adamax(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return adamax_step(params, grads, state, config, lr=lr, sqrt=sqrt, foreach=True)


register(OptimizerSpec("Adamax", AdamaxConfig, AdamaxConfig, adamax_init_state,
                       {"for-loop": _adamax, "foreach": _foreach_adamax}, magnitudes=adamax_magnitudes,
                       native_ulp={"exp_avg": 2 * 5, "exp_inf": 2 * 3, "param": 2 * 11}, elementwise=True))
