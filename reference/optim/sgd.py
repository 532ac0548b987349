"""``torch.optim.SGD`` as torch computes it on CPU (`reference.optim` rules 1, 2, 7, 11).

Rules (``f`` rounds to the parameter dtype):

1. Per parameter with a gradient: ``d = -g if maximize else g``; with weight decay
   ``d = f(d + f(f(wd) * p))``; with momentum, the buffer is a copy of ``d`` on its first step
   and afterwards ``buf = f(f(buf * f(momentum)) + f(f(1 - dampening) * d))``; then
   ``d = f(d + f(f(momentum) * buf))`` with Nesterov, else ``d = buf``; finally
   ``p = f(p + f(f(-lr) * d))``. Without momentum no buffer is ever created.
2. The for-loop, foreach and fused paths round alike on CPU (foreach ops fall back to the
   per-tensor kernels; the fused kernel does the same operations in the same order), so one
   function states all three.
3. The fused kernel under a GradScaler (``fused_sgd_step``): when ``found_inf == 1.0`` exactly
   nothing changes (the gradients stay scaled); otherwise, with ``grad_scale``, the gradients are
   unscaled by a true division ``g = f(g / f32(grad_scale))`` and stored back, then rule 1 runs.
   SGD has no step counter. torch also creates (uninitialised) momentum buffers on a skipped
   first step; the spec refuses that case (`reference.step` refuses the sync-free mode for SGD
   with momentum) rather than model undefined memory.
4. A tensor lr is read as the number it holds (rule 11 of `reference.optim`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reference.optim._common import (abs64, add, check_inputs, check_lr, check_param, for_each_param, freeze, lr_value,
                                     require)

from reference.optim._registry import OptimizerSpec, register

__all__ = ["SGDConfig", "SGDParamState", "fused_sgd_step", "sgd_init_state", "sgd_step"]


@dataclass(frozen=True)
class SGDConfig:
    """``torch.optim.SGD`` hyperparameters (validated as torch validates them).

    ``lr >= 0``, ``momentum >= 0``, ``weight_decay >= 0``; ``nesterov`` requires
    ``momentum > 0`` and ``dampening == 0``.
    """

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        require(self.momentum >= 0.0, f"momentum must be >= 0, got {self.momentum!r}")
        require(math.isfinite(self.dampening), f"dampening must be finite, got {self.dampening!r}")
        require(self.weight_decay >= 0.0, f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.nesterov:
            require(self.momentum > 0.0 and self.dampening == 0.0,
                    "nesterov requires momentum > 0 and dampening == 0, got "
                    f"momentum={self.momentum!r}, dampening={self.dampening!r}")


@dataclass(frozen=True)
class SGDParamState:
    """One parameter's SGD state: the momentum buffer, ``None`` until the first step with
    momentum (torch's ``state['momentum_buffer']``)."""

    momentum_buffer: np.ndarray | None = None


def sgd_init_state(p: np.ndarray, config: SGDConfig) -> SGDParamState:
    """No momentum buffer before the first step."""
    check_param(p, 0)
    return SGDParamState()


def _update(config: SGDConfig, lr: float):
    def update(p: np.ndarray, g: np.ndarray, s: SGDParamState) -> tuple[np.ndarray, SGDParamState, np.ndarray]:
        f = p.dtype.type
        # The new parameter; until the last line it also holds d when d is computed (``_common``:
        # how the steps compute). The momentum buffer is the only other array a step keeps.
        new_p = np.empty_like(p)
        d = np.negative(g, out=new_p) if config.maximize else g
        if config.weight_decay != 0:
            d = add(d, p, config.weight_decay, out=new_p)
        buf = s.momentum_buffer
        if config.momentum != 0:
            if buf is None:
                buf = np.array(d, copy=True)
            else:
                buf = np.multiply(buf, f(config.momentum), out=np.empty_like(p))
                buf = add(buf, d, 1 - config.dampening, out=buf)
            d = add(d, buf, config.momentum, out=new_p) if config.nesterov else buf
            buf = freeze(buf)
        return add(p, d, -lr, out=new_p), SGDParamState(momentum_buffer=buf), g
    return update


def sgd_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[SGDParamState],
    config: SGDConfig,
    lr: float | None = None,
) -> tuple[list[np.ndarray], tuple[SGDParamState, ...]]:
    """One step of torch's SGD, any path (rules 1, 2, 4).

    ``lr=None`` uses ``config.lr``; passing ``lr`` lets a schedule drive it (must be >= 0).
    Returns the new parameters and the new per-parameter states.
    """
    arrays = check_inputs(params, grads, state, config, SGDConfig, SGDParamState)
    new_params, _, new_state = for_each_param(arrays, grads, state, _update(config, lr_value(config, lr)))
    return new_params, new_state


def fused_sgd_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[SGDParamState],
    config: SGDConfig,
    *,
    grad_scale: float | None = None,
    found_inf: float = 0.0,
    lr: float | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple[SGDParamState, ...]]:
    """One step of fused SGD as ``GradScaler.step`` drives it (rule 3); returns
    ``(params, grads, state)`` with the gradients the kernel leaves in ``.grad``."""
    arrays = check_inputs(params, grads, state, config, SGDConfig, SGDParamState)
    if float(found_inf) == 1.0:
        return [np.array(p, copy=True) for p in arrays], list(grads), tuple(state)
    inner = _update(config, lr_value(config, lr))

    def update(p: np.ndarray, g: np.ndarray, s: SGDParamState) -> tuple[np.ndarray, SGDParamState, np.ndarray]:
        if grad_scale is not None:
            g = np.divide(g, p.dtype.type(np.float32(grad_scale)), out=np.empty_like(g))
        return inner(p, g, s)

    return for_each_param(arrays, grads, state, update)


def sgd_magnitudes(config: SGDConfig, p: np.ndarray, g: np.ndarray, old: SGDParamState,
                   new: SGDParamState) -> dict[str, np.ndarray]:
    """``x_abs`` of the momentum buffer and the parameter: rule 1 on magnitudes, float64.

    ``d = |g| + wd |p|``; ``buf = d`` on a first step, else ``momentum |buf| + |1 - dampening| d``;
    ``d = d + momentum buf`` with Nesterov, else ``buf``; ``param = |p| + lr d``. (Computed in
    place, float64 operations in this order: float64 arrays are large, their page faults dear.)"""
    p_abs = abs64(p)
    scratch = np.multiply(p_abs, config.weight_decay, out=np.empty_like(p_abs))
    d = abs64(g)
    d += scratch
    out: dict[str, np.ndarray] = {}
    if config.momentum != 0:
        old_buf = old.momentum_buffer
        if old_buf is None:
            buf = d
        else:
            buf = abs64(old_buf)
            buf *= config.momentum
            buf += np.multiply(d, abs(1 - config.dampening), out=scratch)
        out["momentum_buffer"] = buf
        if config.nesterov:
            d = np.add(d, np.multiply(buf, config.momentum, out=scratch), out=scratch)
        else:
            d = buf
    out["param"] = np.add(p_abs, np.multiply(d, config.lr, out=scratch), out=p_abs)
    return out


# --- the registry row (reference.optim._registry) --------------------------------------------

# Native-kernel bounds (rule 10), in ULPs of x_abs (`sgd_magnitudes`): two implementations that
# differ only in which multiply-adds are fused differ by at most 2k ULP of x_abs, k the roundings on
# the longest path from an input to the field (conformance/expectations.py states the analysis).
#   buffer: d = g + wd*p (2), (1 - dampening)*d (3), buf*momentum + that (4): k = 4.
#   param: Nesterov momentum*buf (5), d + that (6), -lr*d (7), p + that (8): k = 8.
# Measured (about 6,000 per-field comparisons, a 2,000-step sweep): <= 2 (buffer), <= 5 (parameter).


def _sgd(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    new_params, new_state = sgd_step(params, grads, state, config, lr=lr)
    return new_params, list(grads), new_state


def _fused_sgd(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return fused_sgd_step(params, grads, state, config, grad_scale=grad_scale, found_inf=found_inf, lr=lr)


def _sgd_kernel_skip_refused(config: SGDConfig) -> str | None:
    if config.momentum != 0:
        return ("SGD with momentum: torch's fused SGD creates its momentum buffers with empty_like before the kernel "
                "checks the flag, so a skipped first step leaves them uninitialised")
    return None


register(OptimizerSpec("SGD", SGDConfig, SGDConfig, sgd_init_state,
                       {"for-loop": _sgd, "foreach": _sgd, "fused": _fused_sgd}, frozenset({"fused"}),
                       _sgd_kernel_skip_refused, sgd_magnitudes,
                       native_ulp={"momentum_buffer": 2 * 4, "param": 2 * 8}, elementwise=True))
