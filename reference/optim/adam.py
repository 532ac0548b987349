"""``torch.optim.Adam`` and ``AdamW`` as torch computes them on CPU: `reference.optim` rules 3-11.

The for-loop and foreach paths round alike on CPU (the foreach ops fall back to the per-tensor
kernels, and the foreach path takes its bias corrections as Python floats too); they differ only
in the square root torch hands to MKL (rule 9), which ``sqrt=`` injects.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from reference.optim._common import (abs64, add, add_fused, addcmul_fused, check_inputs, check_lr, check_lr_or_tensor,
                                     check_param, for_each_param, freeze, frozen, lerp, lerp_fused, require)

from reference.optim._registry import OptimizerSpec, register

__all__ = ["AdamConfig", "AdamParamState", "adam_init_state", "adam_step", "adamw_config", "fused_adam_step"]


@dataclass(frozen=True)
class AdamConfig:
    """``torch.optim.Adam`` hyperparameters; ``decoupled_weight_decay=True`` is AdamW.

    ``lr >= 0``, ``0 <= beta < 1`` for both betas, ``eps >= 0``, ``weight_decay >= 0``.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False
    decoupled_weight_decay: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        require(
            len(self.betas) == 2, f"betas must be a pair (beta1, beta2), got {self.betas!r}"
        )
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        for name, beta in zip(("betas[0]", "betas[1]"), self.betas):
            require(0.0 <= beta < 1.0, f"{name} must be in [0, 1), got {beta!r}")
        require(self.eps >= 0.0, f"eps must be >= 0, got {self.eps!r}")
        require(
            self.weight_decay >= 0.0, f"weight_decay must be >= 0, got {self.weight_decay!r}"
        )


def adamw_config(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
) -> AdamConfig:
    """``torch.optim.AdamW``'s defaults: decoupled weight decay, ``weight_decay=1e-2``."""
    return AdamConfig(
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        decoupled_weight_decay=True,
    )



@dataclass(frozen=True)
class AdamParamState:
    """One parameter's Adam(W) state, as torch keeps it.

    ``step`` is a float32 scalar (torch's step counter is a float32 tensor, so it stops
    counting at 2**24); ``max_exp_avg_sq`` exists only with AMSGrad.
    """

    step: np.float32
    exp_avg: np.ndarray
    exp_avg_sq: np.ndarray
    max_exp_avg_sq: np.ndarray | None = None



def adam_init_state(p: np.ndarray, config: AdamConfig) -> AdamParamState:
    """``step = 0`` and zero moments of the parameter's shape and dtype (plus ``max_exp_avg_sq``
    with AMSGrad)."""
    a = check_param(p, 0)
    return AdamParamState(step=np.float32(0.0), exp_avg=frozen(np.zeros_like(a)), exp_avg_sq=frozen(np.zeros_like(a)),
                          max_exp_avg_sq=frozen(np.zeros_like(a)) if config.amsgrad else None)


def _decayed(p: np.ndarray, config: AdamConfig, lr: float, tensor_lr: np.ndarray | None,
             out: np.ndarray) -> np.ndarray:
    """Rule 3's decoupled decay (AdamW), ``p * f(1 - lr * wd)``, with rule 11's tensor lr."""
    f = p.dtype.type
    if tensor_lr is None:
        return np.multiply(p, f(1 - lr * config.weight_decay), out=out)
    L = tensor_lr.dtype.type
    factor = L(L(1) - L(lr * L(config.weight_decay)))
    if p.ndim == 0 and np.dtype(L).itemsize > p.dtype.itemsize:
        out[()] = np.asarray(p.astype(np.dtype(L)) * factor).astype(p.dtype)  # two 0-d tensors promote
        return out
    return np.multiply(p, f(factor), out=out)


def _adam_update(
    p: np.ndarray,
    d: np.ndarray,
    s: AdamParamState,
    step: np.float32,
    config: AdamConfig,
    lr: float,
    fused: bool,
    sqrt: Callable[[np.ndarray], np.ndarray] = np.sqrt,
    native: bool = False,
) -> tuple[np.ndarray, AdamParamState]:
    """Rules 3-6 for one parameter, given the (maximize-applied) gradient and the new step.
    ``native``: float32 on native kernels, the coupled decay, the first moment's ``lerp`` and the
    second moment's ``addcmul`` fused (`reference.optim._common` rule 7)."""
    f = p.dtype.type
    beta1, beta2 = config.betas
    tensor_lr = lr if isinstance(lr, np.ndarray) else None  # rule 11
    if tensor_lr is not None:
        lr = tensor_lr.dtype.type(tensor_lr[()])
    decoupled = config.weight_decay != 0 and config.decoupled_weight_decay
    if config.weight_decay != 0 and not decoupled:
        d = add_fused(d, p, config.weight_decay) if native else add(d, p, config.weight_decay, out=np.empty_like(p))
    # The new parameter; until the last lines it holds the temporaries of rules 5 and 6 (``_common``:
    # how the steps compute). The decoupled decay reads only p, so it is computed there last.
    new_p = np.empty_like(p)
    v = np.multiply(s.exp_avg_sq, f(beta2), out=np.empty_like(p))
    if native:
        m = lerp_fused(s.exp_avg, d, 1 - beta1)
        v = addcmul_fused(v, d, d, 1 - beta2)
    else:
        m = lerp(s.exp_avg, d, 1 - beta1, out=np.empty_like(p))
        v = np.add(v, np.multiply(np.multiply(d, f(1 - beta2), out=new_p), d, out=new_p), out=v)  # addcmul
    t = float(step)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    # A tensor lr divides in its own dtype (rule 11); a Python float in float64.
    step_size = float(lr / type(lr)(bias_correction1)) if tensor_lr is not None else lr / bias_correction1
    # The for-loop path takes bc2 ** 0.5 (libm pow), the fused kernel std::sqrt.
    bias_correction2_sqrt = math.sqrt(bias_correction2) if fused else bias_correction2**0.5
    vmax = s.max_exp_avg_sq
    if config.amsgrad:
        vmax = np.maximum(vmax, v, out=np.empty_like(p))
    root_of = vmax if config.amsgrad else v
    root = np.sqrt(root_of, out=new_p) if sqrt is np.sqrt else sqrt(root_of)
    denom = np.add(np.divide(root, f(bias_correction2_sqrt), out=new_p), f(config.eps), out=new_p)
    quotient = np.multiply(m, f(-step_size), out=np.empty_like(p))
    quotient = np.divide(quotient, denom, out=quotient)  # addcdiv: value times numerator, then the division
    start = _decayed(p, config, lr, tensor_lr, out=new_p) if decoupled else p
    return np.add(start, quotient, out=new_p), AdamParamState(
        step=step,
        exp_avg=freeze(m),
        exp_avg_sq=freeze(v),
        max_exp_avg_sq=freeze(vmax) if config.amsgrad else None if vmax is None else frozen(vmax),
    )


def adam_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[AdamParamState],
    config: AdamConfig,
    lr: float | None = None,
    *,
    sqrt: Callable[[np.ndarray], np.ndarray] | None = None,
    native: bool = False,
) -> tuple[list[np.ndarray], tuple[AdamParamState, ...]]:
    """One step of torch's for-loop Adam or AdamW (rules 1, 3-7, 9).

    ``lr=None`` uses ``config.lr``; passing ``lr`` lets a schedule drive it (must be >= 0); a 0-d
    float32/float64 array is a tensor lr (rule 11). ``sqrt``: the elementwise square root of rule 6, returning the input's dtype; ``None``
    means the correctly rounded ``np.sqrt`` (rule 9 says when torch differs). ``native``: torch's
    native AVX2/AVX512 kernels (`reference.optim._common` rule 7), float32 parameters only.
    Returns the new parameters and the new per-parameter states.
    """
    arrays = check_inputs(params, grads, state, config, AdamConfig, AdamParamState)
    if native:
        for i, p in enumerate(arrays):
            if p.dtype != np.float32:
                raise ValueError(f"params[{i}] is {p.dtype}: the native kernels' fusions are stated for float32 only")
    step_lr = config.lr if lr is None else check_lr_or_tensor(lr)
    root = np.sqrt if sqrt is None else sqrt

    def update(p: np.ndarray, g: np.ndarray, s: AdamParamState) -> tuple[np.ndarray, AdamParamState, np.ndarray]:
        step = np.float32(s.step + np.float32(1.0))
        new_p, new_s = _adam_update(p, -g if config.maximize else g, s, step, config, step_lr, fused=False, sqrt=root,
                                    native=native)
        return new_p, new_s, g

    new_params, _, new_state = for_each_param(arrays, grads, state, update)
    return new_params, new_state



def fused_adam_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[AdamParamState],
    config: AdamConfig,
    *,
    grad_scale: float | None = None,
    found_inf: float = 0.0,
    lr: float | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple[AdamParamState, ...]]:
    """One step of fused Adam/AdamW as ``GradScaler.step`` drives it (rule 8).

    ``grad_scale``: the loss scale the gradients still carry (float32 in torch), or ``None``
    when they were already unscaled by ``GradScaler.unscale_``. ``found_inf``: the scaler's
    flag (normally 0.0 or 1.0); the step is skipped only when it equals 1.0 exactly.
    Returns ``(params, grads, state)``: the grads are the ones the kernel leaves in ``.grad``,
    unscaled by true division on an applied step, still scaled on a skipped one.

    Bit exactness: under ``ATEN_CPU_CAPABILITY=default`` the fused CPU kernel rounds every
    operation separately (its square root is correctly rounded) and this matches it bit for
    bit. Its native AVX2/AVX512 build computes the first-moment lerp with a fused multiply-add
    and lets the compiler contract other multiply-adds, which no NumPy expression reproduces:
    there, one step from the same state differed by up to 7 ULPs on parameters and 2 ULPs on
    moments (measured relative to the operands' magnitude), compounding over steps like any
    rounding difference.
    """
    arrays = check_inputs(params, grads, state, config, AdamConfig, AdamParamState)
    step_lr = config.lr if lr is None else float(check_lr_or_tensor(lr))  # rule 11: its value
    inf_flag = np.float32(found_inf)
    skip = float(found_inf) == 1.0

    def update(p: np.ndarray, g: np.ndarray, s: AdamParamState) -> tuple[np.ndarray, AdamParamState, np.ndarray]:
        f = p.dtype.type
        step = np.float32(s.step + np.float32(1.0))
        if skip:
            new_p, new_s = np.array(p, copy=True), s
        else:
            if grad_scale is not None:
                g = np.divide(g, f(np.float32(grad_scale)), out=np.empty_like(g))
            new_p, new_s = _adam_update(p, -g if config.maximize else g, s, step, config, step_lr, fused=True)
        # The kernel advances the step counter by 1 - found_inf, applied or not.
        counter = np.float32(step - inf_flag)
        return new_p, AdamParamState(counter, new_s.exp_avg, new_s.exp_avg_sq, new_s.max_exp_avg_sq), g

    return for_each_param(arrays, grads, state, update)


def adam_magnitudes(config: AdamConfig, p: np.ndarray, g: np.ndarray, old: AdamParamState,
                    new: AdamParamState) -> dict[str, np.ndarray]:
    """``x_abs`` of each Adam field: rules 3-6 on magnitudes, float64 (the denominator is
    positive, taken from the spec's new second moment).

    ``d = |g| + wd |p|`` (Adam; ``|g|`` for AdamW); ``m = beta1 |m| + (1 - beta1) d``;
    ``v = beta2 v + (1 - beta2) d d``; ``vmax = max(vmax, v)``; ``denom = sqrt(new v or vmax) /
    sqrt(bc2) + eps``; ``param = |p| decay + step_size m / denom`` (inf where denom is not
    positive). Computed in place, float64 operations in this order: float64 arrays are large,
    their page faults dear."""
    f64 = np.float64
    beta1, beta2 = config.betas
    p_abs = abs64(p)
    d = abs64(g)
    scratch = np.empty_like(d)
    if not config.decoupled_weight_decay:
        d += np.multiply(p_abs, config.weight_decay, out=scratch)
    m = abs64(old.exp_avg)
    m *= beta1
    m += np.multiply(d, 1 - beta1, out=scratch)
    v = np.multiply(old.exp_avg_sq, beta2, dtype=f64, out=np.empty_like(d))
    v += np.multiply(np.multiply(d, 1 - beta2, out=scratch), d, out=scratch)
    out = {"exp_avg": m, "exp_avg_sq": v}
    root_of = new.exp_avg_sq
    if config.amsgrad:
        out["max_exp_avg_sq"] = np.maximum(old.max_exp_avg_sq, v, dtype=f64, out=np.empty_like(d))
        root_of = new.max_exp_avg_sq
    t = float(new.step)
    step_size = config.lr / (1 - beta1**t)
    denom = np.sqrt(root_of, dtype=f64, out=d)
    denom /= math.sqrt(1 - beta2**t)
    denom += config.eps
    with np.errstate(divide="ignore", invalid="ignore"):
        update = np.divide(np.multiply(m, step_size, out=scratch), denom, out=scratch)
    update[~(denom > 0)] = np.inf
    decay = 1 - config.lr * config.weight_decay if config.decoupled_weight_decay else 1.0
    p_abs *= decay
    out["param"] = np.add(p_abs, update, out=p_abs)
    return out


# --- the registry row (reference.optim._registry) --------------------------------------------

# Native-kernel bounds (rule 10), in ULPs of x_abs (`adam_magnitudes`; 2k for k roundings on the
# longest path, conformance/expectations.py states the analysis).
#   exp_avg: d (2), lerp = sub, mul, add (5): k = 5. exp_avg_sq: (1-b2)*d (3), *d (4), + beta2*v
#   (5): k = 5; max_exp_avg_sq is a max of exact copies: same bound.
#   param: sqrt of v (relative error halves: 2.5, + 2 faithful) 4.5, / bc2_sqrt 5.5, + eps 6.5;
#   -step_size*m: 5 + 1 = 6; the division adds both plus 1: 13.5; decoupled decay then the add: 15.
# Measured: <= 4 (moments), <= 5 (parameter).
_ADAM_ULP = {"exp_avg": 2 * 5, "exp_avg_sq": 2 * 5, "max_exp_avg_sq": 2 * 5, "param": 2 * 15}


def _position_free(config: AdamConfig) -> bool:
    """Rule 4's vectorized head (the lerp at weight 1, ``beta1`` 0) is the only rule of Adam's that
    reads an element's place in its tensor."""
    return np.float32(1 - config.betas[0]) != 1


def _adam(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0, native=False):
    new_params, new_state = adam_step(params, grads, state, config, lr=lr, sqrt=sqrt, native=native)
    return new_params, list(grads), new_state


def _fused_adam(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return fused_adam_step(params, grads, state, config, grad_scale=grad_scale, found_inf=found_inf, lr=lr)


def _foreach_adam(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0, native=False):
    # Rule 11: torch's foreach Adam(W) refuses a tensor lr (without capturable, which needs CUDA).
    if isinstance(lr, np.ndarray):
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")  # noqa: TRY004 (torch's type)
    return _adam(params, grads, state, config, lr=lr, sqrt=sqrt, native=native)


register(OptimizerSpec("Adam", AdamConfig, AdamConfig, adam_init_state,
                       {"for-loop": _adam, "foreach": _foreach_adam, "fused": _fused_adam}, frozenset({"fused"}),
                       magnitudes=adam_magnitudes, native_ulp=_ADAM_ULP, elementwise=True,
                       native_exact=frozenset({"for-loop", "foreach"}), position_free=_position_free))
register(OptimizerSpec("AdamW", adamw_config, AdamConfig, adam_init_state,
                       {"for-loop": _adam, "foreach": _foreach_adam, "fused": _fused_adam}, frozenset({"fused"}),
                       magnitudes=adam_magnitudes, native_ulp=_ADAM_ULP, elementwise=True,
                       native_exact=frozenset({"for-loop", "foreach"}), position_free=_position_free))
