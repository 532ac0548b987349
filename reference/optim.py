"""SGD, Adam and AdamW as torch computes them on CPU, operation by operation.

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
   refuses a tensor lr.

Parameters and gradients are float32 or float64 arrays of any shape (same shape and dtype per
pair). Inputs are never modified; parameters come back as new arrays and states hold read-only
copies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "AdamConfig",
    "AdamParamState",
    "SGDConfig",
    "SGDParamState",
    "adam_step",
    "adamw_config",
    "fused_adam_step",
    "init_state",
    "sgd_step",
]

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_lr(lr: float) -> float:
    value = float(lr)
    _require(value >= 0.0, f"lr must be >= 0, got {lr!r}")
    return value


def _check_lr_or_tensor(lr: Any) -> float | np.ndarray:
    """A Python-float lr, or a tensor lr (rule 11): a 0-d float32/float64 array, kept as it is."""
    if isinstance(lr, np.ndarray):
        _require(lr.ndim == 0 and lr.dtype in _DTYPES, f"a tensor lr must be a 0-d float32/float64 array, got {lr!r}")
        _check_lr(lr[()])
        return lr
    return _check_lr(lr)


@dataclass(frozen=True)
class SGDConfig:
    """``torch.optim.SGD`` hyperparameters (validated as torch validates them).

    ``lr >= 0``, ``momentum >= 0``, ``weight_decay >= 0``; ``nesterov`` requires
    ``momentum > 0`` and ``dampening == 0``.
    """

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        _require(self.momentum >= 0.0, f"momentum must be >= 0, got {self.momentum!r}")
        _require(
            math.isfinite(self.dampening), f"dampening must be finite, got {self.dampening!r}"
        )
        _require(
            self.weight_decay >= 0.0, f"weight_decay must be >= 0, got {self.weight_decay!r}"
        )
        if self.nesterov:
            _require(
                self.momentum > 0.0 and self.dampening == 0.0,
                "nesterov requires momentum > 0 and dampening == 0, got "
                f"momentum={self.momentum!r}, dampening={self.dampening!r}",
            )


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
        _check_lr(self.lr)
        _require(
            len(self.betas) == 2, f"betas must be a pair (beta1, beta2), got {self.betas!r}"
        )
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        for name, beta in zip(("betas[0]", "betas[1]"), self.betas):
            _require(0.0 <= beta < 1.0, f"{name} must be in [0, 1), got {beta!r}")
        _require(self.eps >= 0.0, f"eps must be >= 0, got {self.eps!r}")
        _require(
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
class SGDParamState:
    """One parameter's SGD state: the momentum buffer, ``None`` until the first step with
    momentum (torch's ``state['momentum_buffer']``)."""

    momentum_buffer: np.ndarray | None = None


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


def _frozen(a: np.ndarray) -> np.ndarray:
    out = np.array(a, copy=True)
    out.setflags(write=False)
    return out


def _check_param(p: np.ndarray, i: int) -> np.ndarray:
    arr = np.asarray(p)
    _require(
        arr.dtype in _DTYPES, f"params[{i}] must be float32 or float64, got {arr.dtype}"
    )
    return arr


def init_state(
    params: Sequence[np.ndarray], config: SGDConfig | AdamConfig
) -> tuple[SGDParamState, ...] | tuple[AdamParamState, ...]:
    """The state torch creates for each parameter before its first step.

    SGD: no momentum buffer. Adam(W): ``step = 0`` and zero moments of the parameter's shape and
    dtype (plus ``max_exp_avg_sq`` with AMSGrad). Raises ``ValueError`` for a config of another
    type or a parameter that is not float32/float64.
    """
    arrays = [_check_param(p, i) for i, p in enumerate(params)]
    if isinstance(config, SGDConfig):
        return tuple(SGDParamState() for _ in arrays)
    if isinstance(config, AdamConfig):
        return tuple(
            AdamParamState(
                step=np.float32(0.0),
                exp_avg=_frozen(np.zeros_like(a)),
                exp_avg_sq=_frozen(np.zeros_like(a)),
                max_exp_avg_sq=_frozen(np.zeros_like(a)) if config.amsgrad else None,
            )
            for a in arrays
        )
    raise ValueError(f"config must be an SGDConfig or AdamConfig, got {type(config).__name__}")


def _check_inputs(params, grads, state, config, config_type, state_type) -> list[np.ndarray]:
    _require(
        isinstance(config, config_type),
        f"config must be a {config_type.__name__}, got {type(config).__name__}",
    )
    _require(
        len(params) == len(grads) == len(state),
        "params, grads and state must have the same length, got "
        f"{len(params)}, {len(grads)}, {len(state)}",
    )
    arrays = [_check_param(p, i) for i, p in enumerate(params)]
    for i, (p, g, s) in enumerate(zip(arrays, grads, state)):
        _require(
            isinstance(s, state_type),
            f"state[{i}] must be a {state_type.__name__}, got {type(s).__name__}",
        )
        if g is None:
            continue
        g = np.asarray(g)
        _require(
            g.dtype == p.dtype and g.shape == p.shape,
            f"grads[{i}] must match params[{i}] ({p.dtype}, shape {p.shape}), "
            f"got {g.dtype}, shape {g.shape}",
        )
    return arrays


def sgd_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[SGDParamState],
    config: SGDConfig,
    lr: float | None = None,
) -> tuple[list[np.ndarray], tuple[SGDParamState, ...]]:
    """One step of torch's for-loop SGD (rules 1, 2, 7).

    ``lr=None`` uses ``config.lr``; passing ``lr`` lets a schedule drive it (must be >= 0).
    Returns the new parameters and the new per-parameter states.
    """
    arrays = _check_inputs(params, grads, state, config, SGDConfig, SGDParamState)
    step_lr = config.lr if lr is None else float(_check_lr_or_tensor(lr))  # rule 11: its value

    def update(p: np.ndarray, g: np.ndarray, s: SGDParamState) -> tuple[np.ndarray, SGDParamState, np.ndarray]:
        f = p.dtype.type
        d = -g if config.maximize else g
        if config.weight_decay != 0:
            d = d + f(config.weight_decay) * p
        buf = s.momentum_buffer
        if config.momentum != 0:
            if buf is None:
                buf = np.array(d, copy=True)
            else:
                buf = buf * f(config.momentum)
                buf = buf + f(1 - config.dampening) * d
            d = d + f(config.momentum) * buf if config.nesterov else buf
            buf = _frozen(buf)
        return p + f(-step_lr) * d, SGDParamState(momentum_buffer=buf), g

    new_params, _, new_state = _for_each_param(arrays, grads, state, update)
    return new_params, new_state


def _for_each_param(
    arrays: list[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[Any],
    update: Callable[[np.ndarray, np.ndarray, Any], tuple[np.ndarray, Any, np.ndarray]],
) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple[Any, ...]]:
    """Rule 1 for every optimizer: a parameter without a gradient keeps its value (a copy) and
    its state; ``update(param, grad, state)`` gives ``(param, state, grad)`` for the others.
    Floating-point exceptions are IEEE results here, not errors."""
    new_params: list[np.ndarray] = []
    new_grads: list[np.ndarray | None] = []
    new_state: list[Any] = []
    with np.errstate(all="ignore"):
        for p, g, s in zip(arrays, grads, state):
            if g is None:
                new_p, new_s, new_g = np.array(p, copy=True), s, None
            else:
                new_p, new_s, new_g = update(p, np.asarray(g), s)
            new_params.append(new_p)
            new_grads.append(new_g)
            new_state.append(new_s)
    return new_params, new_grads, tuple(new_state)


def _adam_update(
    p: np.ndarray,
    d: np.ndarray,
    s: AdamParamState,
    step: np.float32,
    config: AdamConfig,
    lr: float,
    fused: bool,
    sqrt: Callable[[np.ndarray], np.ndarray] = np.sqrt,
) -> tuple[np.ndarray, AdamParamState]:
    """Rules 3-6 for one parameter, given the (maximize-applied) gradient and the new step."""
    f = p.dtype.type
    beta1, beta2 = config.betas
    tensor_lr = lr if isinstance(lr, np.ndarray) else None  # rule 11
    if tensor_lr is not None:
        lr = tensor_lr.dtype.type(tensor_lr[()])
    if config.weight_decay != 0:
        if config.decoupled_weight_decay and tensor_lr is not None:
            L = tensor_lr.dtype.type
            factor = L(L(1) - L(lr * L(config.weight_decay)))
            if p.ndim == 0 and np.dtype(L).itemsize > p.dtype.itemsize:
                p = np.asarray(p.astype(np.dtype(L)) * factor).astype(p.dtype)  # two 0-d tensors promote
            else:
                p = p * f(factor)
        elif config.decoupled_weight_decay:
            p = p * f(1 - lr * config.weight_decay)
        else:
            d = d + f(config.weight_decay) * p
    m = s.exp_avg
    w = f(1 - beta1)
    if abs(w) < 0.5:
        m = m + w * (d - m)
    else:
        m = d - (d - m) * (f(1) - w)
    v = s.exp_avg_sq * f(beta2)
    v = v + (f(1 - beta2) * d) * d
    t = float(step)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    # A tensor lr divides in its own dtype (rule 11); a Python float in float64.
    step_size = float(lr / type(lr)(bias_correction1)) if tensor_lr is not None else lr / bias_correction1
    # The for-loop path takes bc2 ** 0.5 (libm pow), the fused kernel std::sqrt.
    bias_correction2_sqrt = math.sqrt(bias_correction2) if fused else bias_correction2**0.5
    vmax = s.max_exp_avg_sq
    if config.amsgrad:
        vmax = np.maximum(vmax, v)
        root = sqrt(vmax)
    else:
        root = sqrt(v)
    denom = root / f(bias_correction2_sqrt) + f(config.eps)
    p = p + (f(-step_size) * m) / denom
    return p, AdamParamState(
        step=step,
        exp_avg=_frozen(m),
        exp_avg_sq=_frozen(v),
        max_exp_avg_sq=_frozen(vmax) if vmax is not None else None,
    )


def adam_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[AdamParamState],
    config: AdamConfig,
    lr: float | None = None,
    *,
    sqrt: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[list[np.ndarray], tuple[AdamParamState, ...]]:
    """One step of torch's for-loop Adam or AdamW (rules 1, 3-7, 9).

    ``lr=None`` uses ``config.lr``; passing ``lr`` lets a schedule drive it (must be >= 0); a 0-d
    float32/float64 array is a tensor lr (rule 11). ``sqrt``: the elementwise square root of rule 6, returning the input's dtype; ``None``
    means the correctly rounded ``np.sqrt`` (rule 9 says when torch differs).
    Returns the new parameters and the new per-parameter states.
    """
    arrays = _check_inputs(params, grads, state, config, AdamConfig, AdamParamState)
    step_lr = config.lr if lr is None else _check_lr_or_tensor(lr)
    root = np.sqrt if sqrt is None else sqrt

    def update(p: np.ndarray, g: np.ndarray, s: AdamParamState) -> tuple[np.ndarray, AdamParamState, np.ndarray]:
        step = np.float32(s.step + np.float32(1.0))
        new_p, new_s = _adam_update(p, -g if config.maximize else g, s, step, config, step_lr, fused=False, sqrt=root)
        return new_p, new_s, g

    new_params, _, new_state = _for_each_param(arrays, grads, state, update)
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
    arrays = _check_inputs(params, grads, state, config, AdamConfig, AdamParamState)
    step_lr = config.lr if lr is None else float(_check_lr_or_tensor(lr))  # rule 11: its value
    inf_flag = np.float32(found_inf)
    skip = float(found_inf) == 1.0

    def update(p: np.ndarray, g: np.ndarray, s: AdamParamState) -> tuple[np.ndarray, AdamParamState, np.ndarray]:
        f = p.dtype.type
        step = np.float32(s.step + np.float32(1.0))
        g = np.array(g, copy=True)
        if skip:
            new_p, new_s = np.array(p, copy=True), s
        else:
            if grad_scale is not None:
                g = g / f(np.float32(grad_scale))
            new_p, new_s = _adam_update(p, -g if config.maximize else g, s, step, config, step_lr, fused=True)
        # The kernel advances the step counter by 1 - found_inf, applied or not.
        return new_p, dataclasses.replace(new_s, step=np.float32(step - inf_flag)), g

    return _for_each_param(arrays, grads, state, update)
