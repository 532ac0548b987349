"""``torch.optim.RAdam`` as torch computes it on CPU (with ``decoupled_weight_decay``).

Rules (``f`` rounds to the parameter dtype; `reference.optim._common` states the operations;
``t`` is the new step as a Python float; every scalar is float64):

1. State: ``step`` (a float32 counter), ``exp_avg`` and ``exp_avg_sq`` (zeros).
2. ``d = -g if maximize else g``; weight decay: decoupled ``p = f(p * f(1 - lr * wd))``, else
   ``d = add(d, p, wd)``; ``exp_avg = lerp(exp_avg, d, 1 - beta1)``;
   ``exp_avg_sq = addcmul(f(exp_avg_sq * f(beta2)), d, d, 1 - beta2)``.
3. ``bc1 = 1 - beta1 ** t``, ``bc2 = 1 - beta2 ** t``, ``rho_inf = 2 / (1 - beta2) - 1``,
   ``rho_t = rho_inf - 2 * t * beta2 ** t / bc2``; when ``rho_t > 5`` the variance is
   rectified by ``rect = ((rho_t - 4) (rho_t - 2) rho_inf / ((rho_inf - 4) (rho_inf - 2) rho_t)) ** 0.5``.
4. The for-loop path: ``m_hat = f(exp_avg / f(bc1))``; rectified,
   ``a = f(f(1 / f(sqrt(exp_avg_sq) + f(eps))) * f(bc2 ** 0.5))`` (a Python float divided by a
   tensor is torch's reciprocal times the float) and ``p = f(p - f(f(f(m_hat * f(lr)) * a) * f(rect)))``;
   otherwise ``p = f(p - f(m_hat * f(lr)))``.
5. The foreach path computes another expression of the same update: ``s = -(bc2 ** 0.5) *
   (lr * rect / bc1)`` (``-0.0`` when not rectified) and ``u = -lr * (0 if rectified else 1) / bc1``;
   ``b = f(f(1 / f(f(sqrt(exp_avg_sq) + f(eps)) / f(s))) + f(u))`` (not rectified, the division
   by ``-0.0`` gives ``-inf``, its reciprocal ``-0.0``, so ``b = f(u)``) and ``p = f(p + f(exp_avg * b))``.
   So torch's two paths differ in the last bits, even unrectified (a tested expectation).
6. A tensor lr (`reference.optim._lr`, ``L`` its dtype, ``W`` the common dtype of `_lr` rule 3).
   Decoupled weight decay multiplies by the tensor factor of `_lr` rule 4 on both paths. The
   for-loop path multiplies ``m_hat * lr`` as tensors, so the product and every factor after it
   (``a``, ``rect``, then the subtraction from ``p``) are computed in ``W``: the float32 0-d
   parameter of a float64 rate is updated in float64 and rounded once; otherwise ``W`` is the
   parameter's dtype and the rate meets it as ``f(lr)``, as a Python float does. The foreach
   path computes ``s`` and ``u`` of rule 5 as tensors, ``u = L(L(L(lr * L(r)) / L(bc1)) * -1)``
   with ``r`` 0 or 1 and ``s = L(L(L(bc2 ** 0.5) * L(L(lr * L(rect)) / L(bc1))) * -1)``, and
   divides and adds them per parameter in place (in ``W``, rounded to ``f``). torch has no fused
   RAdam.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from reference.optim import _lr
from reference.optim._common import (addcmul, check_inputs, check_lr, check_nonnegative, check_param,
                                     for_each_param, frozen, lerp, lr_value, require, step_counter,
                                     weight_decayed)

from reference.optim._registry import OptimizerSpec, register

__all__ = ["RAdamConfig", "RAdamState", "radam_init_state", "radam_magnitudes", "radam_step"]


@dataclass(frozen=True)
class RAdamConfig:
    """``torch.optim.RAdam`` hyperparameters, torch's defaults and checks."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        require(len(self.betas) == 2, f"betas must be a pair (beta1, beta2), got {self.betas!r}")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        for name, beta in zip(("betas[0]", "betas[1]"), self.betas):
            require(0.0 <= beta < 1.0, f"{name} must be in [0, 1), got {beta!r}")
        check_nonnegative(eps=self.eps, weight_decay=self.weight_decay)


@dataclass(frozen=True)
class RAdamState:
    """One parameter's state, named as torch's keys."""

    step: np.float32
    exp_avg: np.ndarray
    exp_avg_sq: np.ndarray


def radam_init_state(p: np.ndarray, config: RAdamConfig) -> RAdamState:
    """Rule 1."""
    a = check_param(p, 0)
    return RAdamState(step=np.float32(0.0), exp_avg=frozen(np.zeros_like(a)), exp_avg_sq=frozen(np.zeros_like(a)))


def rectification(beta2: float, t: float) -> float:
    """Rule 3: ``rect`` at step ``t``, 0 when ``rho_t <= 5`` (not rectified)."""
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * t * (beta2**t) / (1 - beta2**t)
    if rho_t > 5.0:
        return ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
    return 0.0


def radam_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[RAdamState],
    config: RAdamConfig,
    *,
    lr: float | None = None,
    sqrt: Callable[[np.ndarray], np.ndarray] | None = None,
    grad_scale: float | None = None,
    found_inf: float = 0.0,
    foreach: bool = False,
) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple[RAdamState, ...]]:
    """One step of the for-loop path, or with ``foreach`` the foreach path (rules 2-6)."""
    arrays = check_inputs(params, grads, state, config, RAdamConfig, RAdamState)
    require(grad_scale is None and found_inf == 0.0, "RAdam has no kernel that unscales (GradScaler does)")
    tensor = _lr.tensor_lr(lr)
    rate, root, c, (beta1, beta2) = lr_value(config, lr), np.sqrt if sqrt is None else sqrt, config, config.betas

    def update(p: np.ndarray, g: np.ndarray, s: RAdamState) -> tuple[np.ndarray, RAdamState, np.ndarray]:
        f = p.dtype.type
        step = step_counter(s.step)
        t = float(step)
        d = -g if c.maximize else g
        if tensor is not None and c.decoupled_weight_decay:
            p = _lr.decayed(p, tensor, c.weight_decay)  # rule 6
        else:
            p, d = weight_decayed(p, d, c.weight_decay, c.decoupled_weight_decay, rate)
        exp_avg = lerp(s.exp_avg, d, 1 - beta1)
        exp_avg_sq = addcmul(s.exp_avg_sq * f(beta2), d, d, 1 - beta2)
        bc1, bc2 = 1 - beta1**t, 1 - beta2**t
        rect = rectification(beta2, t)
        if foreach and tensor is not None:
            p = addcmul(p, exp_avg, _foreach_buffer(root(exp_avg_sq) + f(c.eps), tensor, t, rect, beta1, beta2), 1.0)
        elif foreach:
            scale = ((1 - beta2**t) ** 0.5) * (rate * rect / bc1) * -1
            unrect = (rate * (0 if rect > 0 else 1.0) / bc1) * -1
            buffer = f(1) / ((root(exp_avg_sq) + f(c.eps)) / f(scale)) + f(unrect)
            p = addcmul(p, exp_avg, buffer, 1.0)
        else:
            m_hat = exp_avg / f(bc1)
            # A Python float meets m_hat as f(lr); a tensor lr by _lr rule 3, in W from here (rule 6).
            product = m_hat * f(rate) if tensor is None else _lr.binary("*", m_hat, tensor, inplace=False)
            w = np.asarray(product).dtype.type
            if rect > 0:
                adaptive = (f(1) / (root(exp_avg_sq) + f(c.eps))) * f(bc2**0.5)
                product = (product * adaptive.astype(w)) * w(rect)
            p = (p.astype(w) - product).astype(p.dtype)
        return p, RAdamState(step, frozen(exp_avg), frozen(exp_avg_sq)), g

    return for_each_param(arrays, grads, state, update)


def _foreach_buffer(denom: np.ndarray, tensor: np.ndarray, t: float, rect: float, beta1: float,
                    beta2: float) -> np.ndarray:
    """Rule 6, the foreach path: ``b`` of rule 5 from ``sqrt(exp_avg_sq) + eps`` and a tensor lr."""
    bc1 = 1 - beta1**t
    unrect = _lr.times(_lr.over(_lr.times(tensor, 0.0 if rect > 0 else 1.0), bc1), -1.0)
    scale = _lr.times(_lr.times(_lr.over(_lr.times(tensor, rect), bc1), (1 - beta2**t) ** 0.5), -1.0)
    buffer = _lr.binary("/", denom, scale, inplace=True)
    return _lr.binary("+", denom.dtype.type(1) / buffer, unrect, inplace=True)


def radam_magnitudes(config: RAdamConfig, p: np.ndarray, g: np.ndarray, old: RAdamState,
                     new: RAdamState) -> dict[str, np.ndarray]:
    """``x_abs`` of each field: rules 2-5 on magnitudes, float64 (the denominator is positive,
    taken from the spec's new second moment)."""
    c, a64, (beta1, beta2) = config, (lambda x: np.abs(np.asarray(x, np.float64))), config.betas
    p64 = a64(p)
    d = a64(g) + (0.0 if c.decoupled_weight_decay else c.weight_decay * p64)
    m = beta1 * a64(old.exp_avg) + (1 - beta1) * d
    v = beta2 * a64(old.exp_avg_sq) + (1 - beta2) * d * d
    t = float(new.step)
    rect, bc1 = rectification(beta2, t), 1 - beta1**t
    with np.errstate(divide="ignore", invalid="ignore"):
        if rect > 0:
            denom = np.sqrt(np.asarray(new.exp_avg_sq, np.float64)) + c.eps
            update = np.where(denom > 0, m / bc1 * c.lr * (1 - beta2**t) ** 0.5 * rect / denom, np.inf)
        else:
            update = m / bc1 * c.lr
    decay = 1 - c.lr * c.weight_decay if c.decoupled_weight_decay else 1.0
    return {"exp_avg": m, "exp_avg_sq": v, "param": p64 * abs(decay) + update}


# --- the registry row (reference.optim._registry) --------------------------------------------

# Native-kernel bounds (rule 10 of reference.optim), in ULPs of x_abs, 2k for k roundings:
#   moments: as Adam's, k = 5. param: m / bc1 6, * lr 7, the reciprocal of the root + eps (5 + 1)
#   times sqrt(bc2) 7, their product and * rect 16 / 2 ... bounded by Adam's 15 for both paths
#   (the foreach reciprocal of a quotient adds one rounding the for-loop's product has).


def _radam(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return radam_step(params, grads, state, config, lr=lr, sqrt=sqrt)


def _foreach_radam(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return radam_step(params, grads, state, config, lr=lr, sqrt=sqrt, foreach=True)


register(OptimizerSpec("RAdam", RAdamConfig, RAdamConfig, radam_init_state,
                       {"for-loop": _radam, "foreach": _foreach_radam}, magnitudes=radam_magnitudes,
                       native_ulp={"exp_avg": 2 * 5, "exp_avg_sq": 2 * 5, "param": 2 * 15}, elementwise=True))
