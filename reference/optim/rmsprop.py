"""``torch.optim.RMSprop`` as torch computes it on CPU (plain, centered, with momentum).

Rules (``f`` rounds to the parameter dtype; `reference.optim._common` states the operations):

1. State: ``step`` (a float32 counter), ``square_avg`` (zeros), ``momentum_buffer`` (zeros, only
   with ``momentum > 0``), ``grad_avg`` (zeros, only when ``centered``).
2. Per parameter with a gradient: ``step = step + 1``; ``d = -g if maximize else g``; with
   weight decay ``d = add(d, p, wd)``; ``square_avg = addcmul(f(square_avg * f(alpha)), d, d,
   1 - alpha)``.
3. Centered: ``grad_avg = lerp(grad_avg, d, 1 - alpha)`` and ``avg = sqrt(addcmul(square_avg,
   grad_avg, grad_avg, -1))``; otherwise ``avg = sqrt(square_avg)``; then ``avg = f(avg + f(eps))``.
4. With momentum: ``buf = addcdiv(f(buf * f(momentum)), d, avg, 1)`` and ``p = add(p, buf, -lr)``;
   without: ``p = addcdiv(p, d, avg, -lr)``.
5. The foreach path does the same operations in the same order; its square root is
   ``torch._foreach_sqrt`` (`reference.optim` rule 9). torch has no fused RMSprop.
6. A tensor lr is read as the number it holds (`reference.optim._lr` rule 1), on both paths:
   torch hands ``-lr`` to ``add``'s ``alpha`` and ``addcdiv``'s ``value``. (Only ``capturable``
   foreach, which needs CUDA, multiplies by the tensor instead.)
7. Native kernels (AVX2/AVX512) fuse ``addcmul``'s multiply-add: a centered difference that is
   exactly 0 here (``square_avg == grad_avg ** 2``, as with ``alpha = 0``) can come out as minus
   one rounding error there, whose root is NaN. ``rmsprop_magnitudes`` marks those elements
   ``undetermined``; under ``ATEN_CPU_CAPABILITY=default`` they match bit for bit like the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from reference.optim._common import (add, addcdiv, addcmul, check_inputs, check_lr, check_nonnegative, check_param,
                                     for_each_param, frozen, lerp, lr_value, require, step_counter)

from reference.optim._registry import OptimizerSpec, register

__all__ = ["RMSpropConfig", "RMSpropState", "rmsprop_init_state", "rmsprop_magnitudes", "rmsprop_step"]


@dataclass(frozen=True)
class RMSpropConfig:
    """``torch.optim.RMSprop`` hyperparameters, torch's defaults and checks."""

    lr: float = 1e-2
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        check_nonnegative(alpha=self.alpha, eps=self.eps, weight_decay=self.weight_decay, momentum=self.momentum)


@dataclass(frozen=True)
class RMSpropState:
    """One parameter's state, named as torch's keys."""

    step: np.float32
    square_avg: np.ndarray
    momentum_buffer: np.ndarray | None = None
    grad_avg: np.ndarray | None = None


def rmsprop_init_state(p: np.ndarray, config: RMSpropConfig) -> RMSpropState:
    """Rule 1."""
    a = check_param(p, 0)
    zeros = frozen(np.zeros_like(a))
    return RMSpropState(step=np.float32(0.0), square_avg=zeros, momentum_buffer=zeros if config.momentum > 0 else None,
                        grad_avg=zeros if config.centered else None)


def rmsprop_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[RMSpropState],
    config: RMSpropConfig,
    *,
    lr: float | None = None,
    sqrt: Callable[[np.ndarray], np.ndarray] | None = None,
    grad_scale: float | None = None,
    found_inf: float = 0.0,
) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple[RMSpropState, ...]]:
    """One step of the for-loop or foreach path (rules 2-6); ``sqrt``: torch's square root."""
    arrays = check_inputs(params, grads, state, config, RMSpropConfig, RMSpropState)
    require(grad_scale is None and found_inf == 0.0, "RMSprop has no kernel that unscales (GradScaler does)")
    rate, root = lr_value(config, lr), np.sqrt if sqrt is None else sqrt
    c = config

    def update(p: np.ndarray, g: np.ndarray, s: RMSpropState) -> tuple[np.ndarray, RMSpropState, np.ndarray]:
        f = p.dtype.type
        d = -g if c.maximize else g
        if c.weight_decay != 0:
            d = add(d, p, c.weight_decay)
        square_avg = addcmul(s.square_avg * f(c.alpha), d, d, 1 - c.alpha)
        grad_avg = None
        if c.centered:
            grad_avg = lerp(s.grad_avg, d, 1 - c.alpha)
            avg = root(addcmul(square_avg, grad_avg, grad_avg, -1))
        else:
            avg = root(square_avg)
        avg = avg + f(c.eps)
        buf = None
        if c.momentum > 0:
            buf = addcdiv(s.momentum_buffer * f(c.momentum), d, avg, 1)
            p = add(p, buf, -rate)
        else:
            p = addcdiv(p, d, avg, -rate)
        return p, RMSpropState(step_counter(s.step), frozen(square_avg), None if buf is None else frozen(buf),
                               None if grad_avg is None else frozen(grad_avg)), g

    return for_each_param(arrays, grads, state, update)


def quotient_magnitude(a: np.ndarray, a_abs: np.ndarray, b: np.ndarray, b_abs: np.ndarray) -> np.ndarray:
    """``x_abs`` of ``a / b`` from those of ``a`` and ``b`` (a relative error of b carries over)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = a_abs / np.abs(b) + np.abs(a) * b_abs / (b * b)
    return np.where(np.isfinite(out), out, np.inf)


def rmsprop_magnitudes(config: RMSpropConfig, p: np.ndarray, g: np.ndarray, old: RMSpropState,
                       new: RMSpropState) -> dict[str, np.ndarray]:
    """``x_abs`` of each field: rules 2-4 on magnitudes, float64. The denominator's own
    ``x_abs`` (a centered difference under a square root can cancel) carries into the quotient."""
    c, a64 = config, (lambda x: np.abs(np.asarray(x, np.float64)))
    p64, d = a64(p), a64(g) + c.weight_decay * a64(p)
    out = {"square_avg": c.alpha * a64(old.square_avg) + (1 - c.alpha) * d * d}
    if c.centered:
        out["grad_avg"] = c.alpha * a64(old.grad_avg) + (1 - c.alpha) * d
        under = np.asarray(new.square_avg, np.float64) - np.asarray(new.grad_avg, np.float64) ** 2
        under_abs = out["square_avg"] + out["grad_avg"] ** 2
    else:
        under = under_abs = np.asarray(new.square_avg, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        root = np.sqrt(np.maximum(under, 0.0))
        avg = root + c.eps
        avg_abs = np.where(root > 0, under_abs / (2 * root), np.inf) + root + c.eps
    step = quotient_magnitude(a64(g), d, avg, avg_abs)
    if c.momentum > 0:
        out["momentum_buffer"] = c.momentum * a64(old.momentum_buffer) + step
        step = out["momentum_buffer"]
    out["param"] = p64 + c.lr * step
    if c.centered:
        # Rule 7: where the centered difference is within its rounding error of 0, its sign is
        # not the spec's to decide on a kernel that fuses the multiply-add.
        dtype = np.asarray(p).dtype
        out["undetermined"] = np.abs(under) <= 8 * np.spacing(np.asarray(under_abs, dtype)).astype(np.float64)
    return out


# --- the registry row (reference.optim._registry) --------------------------------------------

# Native-kernel bounds (rule 10 of reference.optim), in ULPs of x_abs, 2k for k roundings:
#   square_avg: d (2), (1-alpha)*d (3), *d (4), + alpha*sa (5): k = 5. grad_avg: d, then the lerp's
#   sub, mul, add: k = 5. The denominator's own x_abs (under the root: 7 roundings of a centered
#   difference, halved by the root, + 2 faithful, + eps) enters the quotient's x_abs
#   (`rmsprop_magnitudes`); the quotient adds 1, the momentum buffer's mul and add 2, the
#   parameter's mul and add 2: k = 12 for the buffer, 14 for the parameter.


def _rmsprop(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return rmsprop_step(params, grads, state, config, lr=lr, sqrt=sqrt)


register(OptimizerSpec("RMSprop", RMSpropConfig, RMSpropConfig, rmsprop_init_state,
                       {"for-loop": _rmsprop, "foreach": _rmsprop}, magnitudes=rmsprop_magnitudes,
                       native_ulp={"square_avg": 2 * 5, "grad_avg": 2 * 5, "momentum_buffer": 2 * 12, "param": 2 * 14}, elementwise=True))
