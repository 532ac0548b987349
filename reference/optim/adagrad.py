"""``torch.optim.Adagrad`` as torch computes it on CPU (dense gradients).

Rules (``f`` rounds to the parameter dtype; `reference.optim._common` states the operations):

1. State: ``step`` (a float32 counter) and ``sum``, filled with ``f(initial_accumulator_value)``.
2. Per parameter with a gradient: ``step = step + 1``; ``d = -g if maximize else g``; with weight
   decay ``d = add(d, p, wd)``; the step's rate ``clr = lr / (1 + (step - 1) * lr_decay)`` in
   float64 (``step`` read as a Python float).
3. ``sum = addcmul(sum, d, d, 1)``; ``std = f(sqrt(sum) + f(eps))``; ``p = addcdiv(p, d, std, -clr)``.
4. The foreach path does the same operations: it scales the gradient by ``f(-clr)`` first and
   adds ``numerator / std``, and a product commutes, so it rounds as the for-loop does.
5. The fused kernel (``fused=True``, CPU only) under a GradScaler: ``step`` advances by one;
   when ``found_inf == 1.0`` exactly nothing else happens (the gradients stay scaled); otherwise,
   with ``grad_scale``, ``g = f(g / f32(grad_scale))`` (a true division) is stored back and rules
   2-3 run with a correctly rounded square root; then ``step = f32(step - f32(found_inf))``.
   torch creates the state inside ``step()``, so the kernel's skipped first step leaves the
   state of rule 1, where the for-loop path under a GradScaler has none yet.
6. A tensor lr (`reference.optim._lr`; ``L`` its dtype). The for-loop path divides it as a
   tensor, ``clr = L(lr / L(1 + (step - 1) * lr_decay))`` (so a float32 rate differs from a
   Python float only with ``lr_decay != 0``), and hands ``-clr`` to ``addcdiv`` as the number it
   holds. The foreach path makes the same ``-clr`` tensors and multiplies the gradients by them
   (`_lr` rule 3): in place when ``maximize`` or weight decay made the gradients its own copies,
   giving ``f(W(d) * W(-clr))``, otherwise out of place, keeping ``W``, the common dtype; then
   ``p = f(W(p) + W(numerator / W(std)))``. So a float32 0-d parameter with a float64 rate is
   updated in float64, rounded once, where the for-loop path rounds ``-clr`` to float32 first.
   The fused kernel reads the tensor as the number it holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from reference.optim import _lr
from reference.optim._common import (add, addcdiv, addcmul, check_inputs, check_lr, check_nonnegative, check_param,
                                     for_each_param, freeze, frozen, lr_value, require, step_counter)

from reference.optim._registry import OptimizerSpec, register

__all__ = ["AdagradConfig", "AdagradState", "adagrad_init_state", "adagrad_magnitudes", "adagrad_step"]


@dataclass(frozen=True)
class AdagradConfig:
    """``torch.optim.Adagrad`` hyperparameters, torch's defaults and checks."""

    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    maximize: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        check_nonnegative(lr_decay=self.lr_decay, weight_decay=self.weight_decay,
                          initial_accumulator_value=self.initial_accumulator_value, eps=self.eps)


@dataclass(frozen=True)
class AdagradState:
    """One parameter's state, named as torch's keys."""

    step: np.float32
    sum: np.ndarray


def adagrad_init_state(p: np.ndarray, config: AdagradConfig) -> AdagradState:
    """Rule 1."""
    a = check_param(p, 0)
    return AdagradState(step=np.float32(0.0), sum=frozen(np.full_like(a, a.dtype.type(config.initial_accumulator_value))))


def _update(config: AdagradConfig, lr: float, sqrt: Callable[[np.ndarray], np.ndarray], grad_scale,
            tensor: np.ndarray | None = None, foreach: bool = False):
    """Rules 2-3; ``tensor``: the tensor lr of rule 6 (the for-loop and foreach paths only)."""
    def update(p: np.ndarray, g: np.ndarray, s: AdagradState) -> tuple[np.ndarray, AdagradState, np.ndarray]:
        f = p.dtype.type
        step = step_counter(s.step)
        if grad_scale is not None:
            g = g / f(np.float32(grad_scale))
        d = -g if config.maximize else g
        if config.weight_decay != 0:
            d = add(d, p, config.weight_decay)
        denominator = 1 + (float(step) - 1) * config.lr_decay
        total = addcmul(s.sum, d, d, 1.0)
        std = sqrt(total) + f(config.eps)
        new_state = AdagradState(step=step, sum=freeze(total))  # total is the step's own array
        if tensor is None:
            return addcdiv(p, d, std, -(lr / denominator)), new_state, g
        minus_clr = _lr.over(-tensor, denominator)  # rule 6
        if not foreach:
            return addcdiv(p, d, std, _lr.value(minus_clr)), new_state, g
        owned = config.maximize or config.weight_decay != 0  # _foreach_mul_ on its own copies
        numerator = _lr.binary("*", d, minus_clr, inplace=owned)
        w = numerator.dtype
        return (p.astype(w) + numerator / std.astype(w)).astype(p.dtype), new_state, g
    return update


def adagrad_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[AdagradState],
    config: AdagradConfig,
    *,
    lr: float | None = None,
    sqrt: Callable[[np.ndarray], np.ndarray] | None = None,
    grad_scale: float | None = None,
    found_inf: float = 0.0,
    fused: bool = False,
    foreach: bool = False,
) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple[AdagradState, ...]]:
    """One step (rules 2-4; with ``fused``, rule 5; a tensor ``lr``, rule 6, where ``foreach``
    tells the foreach path from the for-loop one). ``sqrt``: torch's square root for the
    for-loop and foreach paths (`reference.optim` rule 9); the fused kernel's is ``np.sqrt``."""
    arrays = check_inputs(params, grads, state, config, AdagradConfig, AdagradState)
    require(fused or (grad_scale is None and found_inf == 0.0), "only the fused kernel takes grad_scale/found_inf")
    rate, tensor = lr_value(config, lr), None if fused else _lr.tensor_lr(lr)
    root = np.sqrt if (fused or sqrt is None) else sqrt
    if fused and float(found_inf) == 1.0:
        return ([np.array(p, copy=True) for p in arrays], [None if g is None else np.array(g, copy=True) for g in grads],
                tuple(s if g is None else dataclasses.replace(s, step=np.float32(step_counter(s.step) - np.float32(1)))
                      for g, s in zip(grads, state)))
    update = _update(config, rate, root, grad_scale, tensor, foreach)
    new_params, new_grads, new_state = for_each_param(arrays, grads, state, update)
    if fused and found_inf != 0.0:
        new_state = tuple(s if g is None else dataclasses.replace(s, step=np.float32(s.step - np.float32(found_inf)))
                          for g, s in zip(grads, new_state))
    return new_params, new_grads, new_state


def adagrad_magnitudes(config: AdagradConfig, p: np.ndarray, g: np.ndarray, old: AdagradState,
                       new: AdagradState) -> dict[str, np.ndarray]:
    """``x_abs`` of ``sum`` and the parameter: rules 2-3 on magnitudes, float64."""
    p64 = np.abs(np.asarray(p, np.float64))
    d = np.abs(np.asarray(g, np.float64)) + config.weight_decay * p64
    total = np.abs(np.asarray(old.sum, np.float64)) + d * d
    clr = config.lr / (1 + (float(new.step) - 1) * config.lr_decay)
    with np.errstate(divide="ignore", invalid="ignore"):
        update = np.where(np.sqrt(total) + config.eps > 0, clr * d / (np.sqrt(total) + config.eps), np.inf)
    return {"sum": total, "param": p64 + update}


# --- the registry row (reference.optim._registry) --------------------------------------------

# Native-kernel bounds (rule 10 of reference.optim), in ULPs of x_abs, 2k for k roundings:
#   sum: d = g + wd*p (2), d*d (3), + sum (4): k = 4. param: sqrt of sum (4 / 2 + 2 faithful) 4,
#   + eps 5; -clr*d 3; the division 9; + p 10.


def _adagrad(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return adagrad_step(params, grads, state, config, lr=lr, sqrt=sqrt)


def _foreach_adagrad(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return adagrad_step(params, grads, state, config, lr=lr, sqrt=sqrt, foreach=True)


def _fused_adagrad(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return adagrad_step(params, grads, state, config, lr=lr, grad_scale=grad_scale, found_inf=found_inf, fused=True)


register(OptimizerSpec("Adagrad", AdagradConfig, AdagradConfig, adagrad_init_state,
                       {"for-loop": _adagrad, "foreach": _foreach_adagrad, "fused": _fused_adagrad}, frozenset({"fused"}),
                       magnitudes=adagrad_magnitudes,
                       native_ulp={"sum": 2 * 4, "param": 2 * 10}, elementwise=True))
