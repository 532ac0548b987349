"""``torch.optim.NAdam`` as torch computes it on CPU (with ``decoupled_weight_decay``).

Rules (``f`` rounds to the parameter dtype; `reference.optim._common` states the operations;
``t`` is the new step as a Python float):

1. State: ``step`` (a float32 counter), ``mu_product`` (a float32 scalar, 1), ``exp_avg`` and
   ``exp_avg_sq`` (zeros).
2. ``d = -g if maximize else g``; weight decay: decoupled ``p = f(p * f(1 - lr * wd))``, else
   ``d = add(d, p, wd)``.
3. Momentum schedule in float64: ``mu = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))``,
   ``mu_next`` the same at ``t + 1``; ``mu_product = f32(mu_product * f32(mu))`` (a float32
   tensor times a Python float), then read back as a Python float.
4. ``exp_avg = lerp(exp_avg, d, 1 - beta1)``; ``exp_avg_sq = addcmul(f(exp_avg_sq * f(beta2)), d, d, 1 - beta2)``.
5. The denominator, ``bc2 = 1 - beta2 ** t``: the for-loop path takes
   ``f(sqrt(f(exp_avg_sq / f(bc2))) + f(eps))``; the foreach path divides after the root,
   ``f(f(sqrt(exp_avg_sq) / f(bc2 ** 0.5)) + f(eps))``. The two are the same formula rounded
   differently: torch's two paths differ in the last bits (a tested expectation).
6. ``p = addcdiv(p, d, denom, -lr * (1 - mu) / (1 - mu_product))``, then
   ``p = addcdiv(p, exp_avg, denom, -lr * mu_next / (1 - mu_product * mu_next))`` (float64 scalars).
7. A tensor lr (`reference.optim._lr`, ``L`` its dtype). Decoupled weight decay multiplies by
   the tensor factor of `_lr` rule 4 on both paths (a 0-d parameter meets it promoted). The
   for-loop path computes its two step sizes as tensors, ``L(L(-lr * L(1 - mu)) / L(1 - mu_product))``
   and ``L(L(-lr * L(mu_next)) / L(1 - mu_product * mu_next))`` (``mu_product`` read as a Python
   float), and hands them to ``addcdiv`` as the numbers they hold; the foreach path reads
   ``lr.item()`` for them and computes as with a Python float. torch has no fused NAdam.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from reference.optim import _lr
from reference.optim._common import (addcdiv, addcmul, check_inputs, check_lr, check_nonnegative, check_param,
                                     for_each_param, frozen, lerp, lr_value, require, step_counter,
                                     weight_decayed)

from reference.optim._registry import OptimizerSpec, register

__all__ = ["NAdamConfig", "NAdamState", "nadam_init_state", "nadam_magnitudes", "nadam_step"]


@dataclass(frozen=True)
class NAdamConfig:
    """``torch.optim.NAdam`` hyperparameters, torch's defaults and checks."""

    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum_decay: float = 4e-3
    decoupled_weight_decay: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        require(len(self.betas) == 2, f"betas must be a pair (beta1, beta2), got {self.betas!r}")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        for name, beta in zip(("betas[0]", "betas[1]"), self.betas):
            require(0.0 <= beta < 1.0, f"{name} must be in [0, 1), got {beta!r}")
        check_nonnegative(eps=self.eps, weight_decay=self.weight_decay, momentum_decay=self.momentum_decay)


@dataclass(frozen=True)
class NAdamState:
    """One parameter's state, named as torch's keys."""

    step: np.float32
    mu_product: np.float32
    exp_avg: np.ndarray
    exp_avg_sq: np.ndarray


def nadam_init_state(p: np.ndarray, config: NAdamConfig) -> NAdamState:
    """Rule 1."""
    a = check_param(p, 0)
    return NAdamState(step=np.float32(0.0), mu_product=np.float32(1.0), exp_avg=frozen(np.zeros_like(a)),
                      exp_avg_sq=frozen(np.zeros_like(a)))


def nadam_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[NAdamState],
    config: NAdamConfig,
    *,
    lr: float | None = None,
    sqrt: Callable[[np.ndarray], np.ndarray] | None = None,
    grad_scale: float | None = None,
    found_inf: float = 0.0,
    foreach: bool = False,
) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple[NAdamState, ...]]:
    """One step of the for-loop path, or with ``foreach`` the foreach path (rules 2-7)."""
    arrays = check_inputs(params, grads, state, config, NAdamConfig, NAdamState)
    require(grad_scale is None and found_inf == 0.0, "NAdam has no kernel that unscales (GradScaler does)")
    tensor = _lr.tensor_lr(lr)
    rate, root, c, (beta1, beta2) = lr_value(config, lr), np.sqrt if sqrt is None else sqrt, config, config.betas

    def update(p: np.ndarray, g: np.ndarray, s: NAdamState) -> tuple[np.ndarray, NAdamState, np.ndarray]:
        f = p.dtype.type
        step = step_counter(s.step)
        t = float(step)
        d = -g if c.maximize else g
        if tensor is not None and c.decoupled_weight_decay:
            p = _lr.decayed(p, tensor, c.weight_decay)  # rule 7
        else:
            p, d = weight_decayed(p, d, c.weight_decay, c.decoupled_weight_decay, rate)
        mu = beta1 * (1.0 - 0.5 * (0.96 ** (t * c.momentum_decay)))
        mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((t + 1) * c.momentum_decay)))
        mu_product = np.float32(s.mu_product * np.float32(mu))
        exp_avg = lerp(s.exp_avg, d, 1 - beta1)
        exp_avg_sq = addcmul(s.exp_avg_sq * f(beta2), d, d, 1 - beta2)
        bc2 = 1 - beta2**t
        if foreach:
            denom = root(exp_avg_sq) / f(bc2**0.5) + f(c.eps)
        else:
            denom = root(exp_avg_sq / f(bc2)) + f(c.eps)
        mp = float(mu_product)
        if tensor is None or foreach:
            size_grad, size_avg = -rate * (1.0 - mu) / (1.0 - mp), (-rate * mu_next) / (1.0 - mp * mu_next)
        else:  # rule 7
            size_grad = _lr.value(_lr.over(_lr.times(-tensor, 1.0 - mu), 1.0 - mp))
            size_avg = _lr.value(_lr.over(_lr.times(-tensor, mu_next), 1.0 - mp * mu_next))
        p = addcdiv(p, d, denom, size_grad)
        p = addcdiv(p, exp_avg, denom, size_avg)
        return p, NAdamState(step, mu_product, frozen(exp_avg), frozen(exp_avg_sq)), g

    return for_each_param(arrays, grads, state, update)


def nadam_magnitudes(config: NAdamConfig, p: np.ndarray, g: np.ndarray, old: NAdamState,
                     new: NAdamState) -> dict[str, np.ndarray]:
    """``x_abs`` of each field: rules 2-6 on magnitudes, float64 (the denominator is positive,
    taken from the spec's new second moment)."""
    c, a64, (beta1, beta2) = config, (lambda x: np.abs(np.asarray(x, np.float64))), config.betas
    p64 = a64(p)
    d = a64(g) + (0.0 if c.decoupled_weight_decay else c.weight_decay * p64)
    m = beta1 * a64(old.exp_avg) + (1 - beta1) * d
    v = beta2 * a64(old.exp_avg_sq) + (1 - beta2) * d * d
    t, mp = float(new.step), float(new.mu_product)
    mu = beta1 * (1.0 - 0.5 * (0.96 ** (t * c.momentum_decay)))
    mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((t + 1) * c.momentum_decay)))
    with np.errstate(divide="ignore", invalid="ignore"):
        denom = np.sqrt(np.asarray(new.exp_avg_sq, np.float64) / (1 - beta2**t)) + c.eps
        update = (c.lr * (1 - mu) / abs(1 - mp) * d + c.lr * mu_next / abs(1 - mp * mu_next) * m) / denom
        update = np.where(denom > 0, update, np.inf)
    decay = 1 - c.lr * c.weight_decay if c.decoupled_weight_decay else 1.0
    return {"exp_avg": m, "exp_avg_sq": v, "param": p64 * abs(decay) + update}


# --- the registry row (reference.optim._registry) --------------------------------------------

# Native-kernel bounds (rule 10 of reference.optim), in ULPs of x_abs, 2k for k roundings:
#   moments: as Adam's, k = 5. param: the denominator (v 5, / bc2 6, the root 5, + eps 6), each
#   term's scalar product (3 and 6) over it, + 1, and the two adds: 14, with decoupled decay 15.


def _nadam(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return nadam_step(params, grads, state, config, lr=lr, sqrt=sqrt)


def _foreach_nadam(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return nadam_step(params, grads, state, config, lr=lr, sqrt=sqrt, foreach=True)


register(OptimizerSpec("NAdam", NAdamConfig, NAdamConfig, nadam_init_state,
                       {"for-loop": _nadam, "foreach": _foreach_nadam}, magnitudes=nadam_magnitudes,
                       native_ulp={"exp_avg": 2 * 5, "exp_avg_sq": 2 * 5, "param": 2 * 15}, elementwise=True))
