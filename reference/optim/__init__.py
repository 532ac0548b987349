"""torch.optim's optimizers as torch computes them on CPU, operation by operation, and their registry.

One module per optimizer states its own rules (`reference.optim.sgd`, `reference.optim.adam`, ...);
rules 1-11 below are the ones every optimizer follows, with SGD and Adam(W) as their first instances;
`reference.optim._common` states the rounding of the elementwise operations they are made of.

Rules ("f(x)" rounds x to the parameter dtype, float32 or float64; hyperparameters are Python
floats, i.e. float64):

1. The for-loop path. ``sgd_step`` and ``adam_step`` reproduce torch's single-tensor (for-loop)
   implementation, the CPU default (``foreach=None, fused=None``). Every tensor operation rounds
   its result to the parameter dtype, and every Python-float hyperparameter that meets a tensor
   is first rounded to that dtype (``f(lr)``, ``f(beta2)``, ...). Arithmetic done on Python
   floats (``1 - beta1``, ``1 - lr * weight_decay``, bias corrections, ``lr / bias_correction1``)
   stays in float64 until it meets a tensor.
2. SGD, per parameter with a gradient: ``d = -g if maximize else g``; with weight decay
   ``d = f(d + f(f(wd) * p))``; with momentum, the buffer is a copy of ``d`` on its first step and
   afterwards ``buf = f(f(buf * f(momentum)) + f(f(1 - dampening) * d))``; then ``d = f(d +
   f(f(momentum) * buf))`` with Nesterov, else ``d = buf``; finally ``p = f(p + f(f(-lr) * d))``.
   Without momentum no buffer is ever created.
3. Adam, per parameter with a gradient: ``step = float32(step + 1)`` (the counter is a float32
   tensor); ``d = -g if maximize else g``. Weight decay: AdamW (decoupled) multiplies the
   parameter first, ``p = f(p * f(1 - lr * wd))``; Adam adds to the gradient,
   ``d = f(d + f(f(wd) * p))``.
4. First moment: ``exp_avg.lerp_(d, 1 - beta1)`` with ``w = f(1 - beta1)``: when ``|w| < 0.5``
   ``m = f(m + f(w * f(d - m)))``, otherwise ``m = f(d - f(f(d - m) * f(1 - w)))``.
5. Second moment: ``v = f(v * f(beta2))`` then ``v = f(v + f(f(f(1 - beta2) * d) * d))``
   (``addcmul``: the value multiplies the first factor first).
6. Update, with ``s = float(step)``: ``bc1 = 1 - beta1 ** s``, ``bc2 = 1 - beta2 ** s``,
   ``step_size = lr / bc1``, ``bc2_sqrt = bc2 ** 0.5`` (all float64); with AMSGrad
   ``vmax = maximum(vmax, v)`` (NaN propagates) and ``r = sqrt(vmax)``, else ``r = sqrt(v)``;
   ``denom = f(f(r / f(bc2_sqrt)) + f(eps))``; ``p = f(p + f(f(f(-step_size) * m) / denom))``
   (``addcdiv``: value times numerator, then the division, then the addition).
7. Gradients that are ``None`` mean "no gradient": that parameter and its state are left exactly
   as they are (its step counter does not move), as torch skips parameters whose ``.grad`` is
   None. Zero-size parameters still count their steps.
8. The fused variant under a GradScaler (``fused_adam_step``) models ``torch.optim.Adam(W)(...,
   fused=True)`` driven by ``GradScaler.step``, which always calls the optimizer and lets the
   kernel decide:
   a. the step counter is incremented: ``step' = float32(step + 1)``;
   b. if ``found_inf == 1.0`` EXACTLY, nothing else happens in the kernel: parameters and moments
      are unchanged and the gradients are returned still SCALED;
   c. otherwise, when ``grad_scale`` is given, every gradient is unscaled by a TRUE division,
      ``g = f(g / f32(grad_scale))`` (not a multiplication by the reciprocal, so for scales that
      are not powers of two it differs from ``GradScaler.unscale_``), and the unscaled gradient
      is stored back (returned); then the Adam(W) update of rules 3-6 runs with ``step'``, the
      only differences being that the kernel takes ``bc2_sqrt = sqrt(bc2)`` and that on native
      SIMD kernels some multiply-adds are fused (see ``fused_adam_step``);
   d. finally ``step = float32(step' - f32(found_inf))``. A skipped step therefore leaves the
      counter where it was; a found_inf of 2.0 would apply the update AND move the counter back
      by one, and 0.5 would apply it and advance the counter by 0.5. ``GradScaler`` only ever
      passes 0.0 or 1.0 on one device.
   torch creates the optimizer state lazily inside ``step()``; because the fused path always
   calls it, a skipped FIRST step leaves the state ``init_state`` returns (step 0, zero
   moments), where the for-loop path under a GradScaler (which skips the call) has none yet.
   The two are numerically the same starting point.
9. Square roots are correctly rounded (IEEE). torch's for-loop path computes
   ``exp_avg_sq.sqrt()`` with ``Tensor.sqrt``, which x86 builds linked with MKL hand to MKL's
   vector math library: faithful but NOT correctly rounded (measured on float32: errors up to
   0.75 ULP, about 17% of inputs 1 ULP away from the correct root; float64 too). The fused
   kernel uses the correctly rounded instruction. ``adam_step(..., sqrt=torch_sqrt)`` accepts
   the implementation's square root so that everything else can still be compared bit for bit.
10. Bit exactness. Under ``ATEN_CPU_CAPABILITY=default`` torch's CPU kernels round every
   operation separately: ``sgd_step`` and ``fused_adam_step`` then match torch bit for bit, and
   ``adam_step`` does too given torch's square root (rule 9); with the correctly rounded root
   its parameters differ by a few ULPs per step. Native AVX2/AVX512 kernels fuse some
   multiply-adds (``add`` with ``alpha``, ``lerp``, whatever the compiler contracts), so there
   results differ by a few ULPs per step (measured, relative to the operands' magnitude: up to
   10 for parameters, 3 for moments); compare with a tolerance, or generate goldens in the
   default mode.

11. A tensor learning rate (``lr`` passed as a 0-d float32 or float64 array, torch's 1-element
   ``lr`` tensor). SGD (every path) and fused Adam(W) read it as the number it holds: the same
   bits as a Python float of that value. The for-loop Adam(W) computes with it as a tensor, in
   its own dtype ``L``: ``step_size = L(lr / L(bc1))`` (so a float32 lr gives a float32
   step size where a Python float gives a float64 one), and AdamW's decay factor is
   ``L(1 - L(lr * L(wd)))``, which multiplies a parameter with dimensions after conversion to
   its dtype but a 0-d parameter (two 0-d tensors promote) in the wider of the two, rounded
   once: ``f(f64(p) * factor)`` for a float32 0-d parameter and a float64 lr. Python-float
   hyperparameters never promote a 0-d parameter (they are wrapped numbers). foreach Adam
   refuses a tensor lr, as torch does ("lr as a Tensor is not supported for capturable=False
   and foreach=True"). The other optimizers take one on every CPU path and state their own
   rule, built from `reference.optim._lr`.
12. The registry (`reference.optim._registry`): one `OptimizerSpec` row per torch class, by
   torch's class name (`SPECS`, `spec(name)`, `spec_for(config)`), with its hyperparameters and
   torch's defaults, ``init_state``, a step function per implementation, the bounds on native
   kernels (``native_ulp``), whether its magnitudes are element-wise, and ``native_exact``: the
   implementations whose float32 step on native AVX2/AVX512 kernels it computes bit for bit,
   with ``step(..., native=True)`` (`reference.optim._common` rule 7: ``add`` with an alpha,
   ``addcmul`` and ``lerp`` fuse their multiply-add; Adam and AdamW, for-loop and foreach). A
   native step of another implementation, or of float64 parameters, is a ValueError. Consumers
   call the row; adding an optimizer is one module of this package with its rules, its step functions
   and its row, registered at its end: this package imports every public module it holds.

Parameters and gradients are float32 or float64 arrays of any shape (same shape and dtype per
pair). Inputs are never modified; parameters come back as new arrays and states hold read-only
copies.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from typing import Any

import numpy as np

from reference.optim._common import check_param
from reference.optim._registry import IMPLEMENTATIONS, SPECS, OptimizerSpec, register, spec, spec_for

# The built-in rows register in this order (SPECS' order, the one messages list them in); a module
# added later registers after them (the loop at the end of this module).
from reference.optim import sgd, adam, adagrad, rmsprop, adamax, adadelta, nadam, radam, adafactor  # noqa: E402,F401,I001
from reference.optim.adafactor import AdafactorConfig, AdafactorState, adafactor_step
from reference.optim.adam import AdamConfig, AdamParamState, adam_step, adamw_config, fused_adam_step
from reference.optim.adagrad import AdagradConfig, AdagradState, adagrad_step
from reference.optim.adadelta import AdadeltaConfig, adadelta_step
from reference.optim.adamax import AdamaxConfig, adamax_step
from reference.optim.nadam import NAdamConfig, nadam_step
from reference.optim.radam import RAdamConfig, radam_step
from reference.optim.rmsprop import RMSpropConfig, RMSpropState, rmsprop_step
from reference.optim.sgd import SGDConfig, SGDParamState, fused_sgd_step, sgd_step

__all__ = [
    "AdafactorConfig",
    "AdafactorState",
    "adafactor_step",
    "AdagradConfig",
    "AdagradState",
    "adagrad_step",
    "IMPLEMENTATIONS",
    "NAdamConfig",
    "RAdamConfig",
    "nadam_step",
    "radam_step",
    "AdadeltaConfig",
    "AdamaxConfig",
    "adadelta_step",
    "adamax_step",
    "RMSpropConfig",
    "RMSpropState",
    "rmsprop_step",
    "SPECS",
    "AdamConfig",
    "AdamParamState",
    "OptimizerSpec",
    "SGDConfig",
    "SGDParamState",
    "adam_step",
    "adamw_config",
    "fused_adam_step",
    "fused_sgd_step",
    "import_optimizer_modules",
    "init_state",
    "register",
    "sgd_step",
    "spec",
    "spec_for",
]


def init_state(params: Sequence[np.ndarray], config: Any) -> tuple[Any, ...]:
    """The state torch creates for each parameter before its first step, by the registry row of
    ``config``. Raises ``ValueError`` for a configuration of no registered optimizer or a
    parameter that is not float32/float64."""
    row = spec_for(config)
    arrays = [check_param(p, i) for i, p in enumerate(params)]
    return tuple(row.init_state(a, config) for a in arrays)



def import_optimizer_modules() -> None:
    """Import every public module of this package: each states one optimizer (or a family) and
    registers its rows when imported, so a new optimizer is its module alone (CONTRIBUTING.md)."""
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


import_optimizer_modules()
