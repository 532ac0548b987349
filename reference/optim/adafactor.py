"""``torch.optim.Adafactor`` as torch 2.13 computes it on CPU (for-loop and foreach paths).

Rules (``f`` rounds to the parameter dtype; `reference.optim._common` states the elementwise
operations, `reference.reductions` the reductions; ``t`` is the new step as a Python float;
Python floats are float64):

1. State: ``step`` (a float32 counter); a parameter with two or more dimensions keeps the
   factored second moment ``row_var`` (its shape with the last dimension 1) and ``col_var``
   (the second-to-last dimension 1), zeros; one with fewer (a vector, a 0-d tensor) keeps the
   full ``variance``, zeros.
2. ``eps = (eps1, eps2)``: ``eps1 = None`` means the machine epsilon of the dtype of the FIRST
   parameter with a gradient in the call (torch resolves it once and keeps it for the rest; in
   one dtype that is simply the dtype's epsilon).
3. Per parameter with a gradient, in order: ``step = step + 1``; ``d = -g if maximize else g``;
   ``w = t ** beta2_decay`` (the paper's ``1 - beta2_t``, float64; 1 at the first step);
   ``rho = min(lr, 1 / t ** 0.5)``; ``alpha = max(eps2, rms_p) * rho`` with
   ``rms_p = float(norm2(p)) / numel ** 0.5`` (the parameter before weight decay; Python's
   ``max`` keeps ``eps2`` when ``rms_p`` is NaN).
4. Weight decay (decoupled, scaled by lr as AdamW): ``p = f(p * f(1 - lr * weight_decay))``.
5. Factored (two or more dimensions, over the last two): ``row_mean = f(f(n_r * n_r) / f(N))``
   with ``n_r = norm2(d, dim=-1)`` and ``N`` the last dimension's size, ``row_var =
   lerp(row_var, row_mean, w)``; the same over dim -2 for ``col_var``; then ``v = f(row_var *
   col_var)`` (the outer product, ``row_var @ col_var`` with an inner dimension of 1) and
   ``v = f(v / max(mean(row_var, dim=-2), f(eps1)))`` (NaN propagates through the clamp).
6. Unfactored: ``variance = lerp(variance, f(d * d), w)`` and ``v = variance``.
7. ``u = f(d * f(1 / f(sqrt(max(v, f(eps1 * eps1))))))`` (torch's ``rsqrt`` is one over a
   correctly rounded root, two roundings); ``denom = max(1.0, float(norm2(u)) / (numel ** 0.5
   * d))``; ``p = add(p, u, -alpha / denom)``.
8. The foreach path does the same operations, rounded the same way (its update multiplies
   ``u`` by ``f(-alpha / denom)`` and adds, which is ``add`` rounded separately); it resolves
   ``eps1 = None`` by the dtype of the first group torch forms, which is not the first
   parameter's (measured: with a float64 then a float32 parameter, float32's epsilon), so the
   spec refuses ``eps1 = None`` with parameters of two dtypes there. torch has no fused Adafactor.
9. The learning rate is read as a Python float. A tensor lr is not modelled: torch keeps it a
   0-d tensor, so ``rho``, ``alpha`` and the decay factor become tensors in the lr's dtype
   (and promote a 0-d parameter), rounded where the Python floats are not.
10. A zero-size parameter with a gradient: torch's ``rms_p`` divides 0.0 by 0.0 in Python and
   raises ``ZeroDivisionError`` (after counting the step); the spec refuses it with a
   ValueError naming the parameter.
11. Exactness: with ``ATEN_CPU_CAPABILITY=default`` and one thread every operation here,
   reductions included, matches torch bit for bit. Native AVX2/AVX512 kernels keep the sums'
   order (32-byte vectors, measured) but contract the norms' multiply-adds (and the lerp's),
   so the norms differ in the last bits; ``adafactor_magnitudes`` derives the bound from the
   reductions' lengths. Parameters stored in bfloat16 or float16 (float32 arithmetic inside
   each kernel, float32 accumulators in the reductions): ``reference.lowprec`` rule 16, bit for
   bit on native kernels too.

Where torch differs from the published algorithm (Shazeer & Stern 2018; each a tested
expectation in conformance/test_optim_adafactor.py): ``lr`` caps the relative step size (the
paper fixes the cap at 0.01) and scales the decoupled weight decay (the paper has neither);
``eps1`` clamps the mean of ``row_var`` and the variance estimate under the root instead of being
added to the squared gradient, so a zero row keeps a zero factor; the row and column statistics
are ``norm ** 2 / n`` (a rounded root squared), not sums of squares; ``eps1 = None`` is resolved
once per call (rules 2 and 8). There is no first moment (the paper's optional beta1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from reference import reductions
from reference.optim._common import (
    add,
    check_inputs,
    check_lr,
    check_param,
    for_each_param,
    frozen,
    lerp,
    lr_value,
    require,
    step_counter,
)

from reference.optim._registry import OptimizerSpec, register

__all__ = ["AdafactorConfig", "AdafactorState", "adafactor_init_state", "adafactor_magnitudes", "adafactor_step",
           "check_sizes", "resolve_eps1"]


@dataclass(frozen=True)
class AdafactorConfig:
    """``torch.optim.Adafactor`` hyperparameters, torch's defaults and checks."""

    lr: float = 1e-2
    beta2_decay: float = -0.8
    eps: tuple[float | None, float] = (None, 1e-3)
    d: float = 1.0
    weight_decay: float = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        require(float(self.beta2_decay) <= 0.0, f"beta2_decay must be <= 0, got {self.beta2_decay!r}")
        require(len(self.eps) == 2, f"eps must be a pair (eps1 or None, eps2), got {self.eps!r}")
        eps1, eps2 = self.eps
        require(eps1 is None or float(eps1) >= 0.0, f"eps[0] (eps1) must be None or >= 0, got {eps1!r}")
        require(float(eps2) >= 0.0, f"eps[1] (eps2) must be >= 0, got {eps2!r}")
        object.__setattr__(self, "eps", (None if eps1 is None else float(eps1), float(eps2)))
        require(float(self.d) >= 1.0, f"d (the clipping threshold) must be >= 1, got {self.d!r}")
        require(float(self.weight_decay) >= 0.0, f"weight_decay must be >= 0, got {self.weight_decay!r}")


@dataclass(frozen=True)
class AdafactorState:
    """One parameter's state, named as torch's keys (rule 1)."""

    step: np.float32
    row_var: np.ndarray | None = None
    col_var: np.ndarray | None = None
    variance: np.ndarray | None = None


def factored(p: np.ndarray) -> bool:
    """Rule 1: whether the second moment is factored (two or more dimensions)."""
    return np.ndim(p) > 1


def adafactor_init_state(p: np.ndarray, config: AdafactorConfig) -> AdafactorState:
    """Rule 1."""
    a = check_param(p, 0)
    if factored(a):
        return AdafactorState(step=np.float32(0.0), row_var=frozen(np.zeros(a.shape[:-1] + (1,), a.dtype)),
                              col_var=frozen(np.zeros(a.shape[:-2] + (1,) + a.shape[-1:], a.dtype)))
    return AdafactorState(step=np.float32(0.0), variance=frozen(np.zeros_like(a)))


def resolve_eps1(config: AdafactorConfig, arrays: Sequence[np.ndarray], grads: Sequence,
                 foreach: bool) -> float | None:
    """Rule 2 (and rule 8's refusal): ``eps1``, or the epsilon of the first parameter's dtype with a gradient."""
    if config.eps[0] is not None:
        return config.eps[0]
    dtypes = [p.dtype for p, g in zip(arrays, grads) if g is not None]
    if not dtypes:
        return None
    require(not foreach or len(set(dtypes)) == 1,
            "foreach Adafactor with eps1=None and parameters of two dtypes is not modelled (torch resolves eps1 by "
            "the first dtype group it forms): give eps1 explicitly or one dtype")
    return float(np.finfo(dtypes[0]).eps)


def check_sizes(params: Sequence[np.ndarray], grads: Sequence) -> None:
    """Rule 10: a zero-size parameter with a gradient is refused, naming it."""
    for i, (p, g) in enumerate(zip(params, grads)):
        require(g is None or np.size(p) > 0,
                f"params[{i}] is empty (shape {np.shape(p)}): torch's Adafactor divides 0.0 by 0.0 for its RMS and "
                "raises ZeroDivisionError (rule 10); leave it out")


def _second_moment(d: np.ndarray, s: AdafactorState, w: float, eps1: float) -> tuple[np.ndarray, AdafactorState]:
    """Rules 5 and 6: the variance estimate and the new moments (the counter is set by the caller)."""
    f = d.dtype.type
    if factored(d):
        n_r, n_c = reductions.norm2(d, -1), reductions.norm2(d, -2)
        row_var = lerp(s.row_var, (n_r * n_r) / f(d.shape[-1]), w)
        col_var = lerp(s.col_var, (n_c * n_c) / f(d.shape[-2]), w)
        v = (row_var * col_var) / np.maximum(reductions.mean(row_var, -2), f(eps1))
        return v, AdafactorState(s.step, row_var=frozen(row_var), col_var=frozen(col_var))
    variance = lerp(s.variance, d * d, w)
    return variance, AdafactorState(s.step, variance=frozen(variance))


def adafactor_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[AdafactorState],
    config: AdafactorConfig,
    *,
    lr: float | None = None,
    sqrt: Callable[[np.ndarray], np.ndarray] | None = None,
    grad_scale: float | None = None,
    found_inf: float = 0.0,
    foreach: bool = False,
) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple[AdafactorState, ...]]:
    """One step of the for-loop (or, ``foreach=True``, the foreach) path, rules 2-10. torch's
    ``rsqrt`` takes the correctly rounded root, so ``sqrt`` must be None."""
    arrays = check_inputs(params, grads, state, config, AdafactorConfig, AdafactorState)
    require(grad_scale is None and found_inf == 0.0, "Adafactor has no kernel that unscales (GradScaler does)")
    require(sqrt is None, "Adafactor's rsqrt uses the correctly rounded root: pass sqrt=None")
    require(not isinstance(lr, np.ndarray), "a tensor lr is not modelled for Adafactor (rule 9)")
    check_sizes(arrays, grads)
    for i, (p, g) in enumerate(zip(arrays, grads)):
        require(g is None or factored(p) == (state[i].row_var is not None),
                f"state[{i}] does not fit params[{i}] of shape {p.shape} (rule 1)")
    rate, c = lr_value(config, lr), config
    eps1 = resolve_eps1(config, arrays, grads, foreach)
    eps2 = c.eps[1]

    def update(p: np.ndarray, g: np.ndarray, s: AdafactorState) -> tuple[np.ndarray, AdafactorState, np.ndarray]:
        f = p.dtype.type
        step = step_counter(s.step)
        t = float(step)
        d = -g if c.maximize else g
        w = t ** c.beta2_decay
        rho = min(rate, 1 / (t ** 0.5))
        alpha = max(eps2, float(reductions.norm2(p)) / (p.size ** 0.5)) * rho
        if c.weight_decay != 0:
            p = p * f(1 - rate * c.weight_decay)
        v, moments = _second_moment(d, s, w, eps1)
        u = d * (f(1) / np.sqrt(np.maximum(v, f(eps1 * eps1))))
        denom = max(1.0, float(reductions.norm2(u)) / ((u.size ** 0.5) * c.d))
        new = AdafactorState(step, moments.row_var, moments.col_var, moments.variance)
        return add(p, u, -alpha / denom), new, g

    return for_each_param(arrays, grads, state, update)


def _e_norm(n: int) -> float:
    """Roundings (relative, per implementation) of a norm of ``n`` elements in any order: the
    recursive-sum bound of ``n`` nonnegative squares (the products included), halved by the
    root, and the root's own."""
    return n / 2 + 1


# The lerp of two nonnegative values with a weight in [0, 1]: its subtraction, product and
# addition, each bounded by twice the result's magnitude, and the weight's rounding.
_E_LERP = 7


def adafactor_magnitudes(config: AdafactorConfig, p: np.ndarray, g: np.ndarray, old: AdafactorState,
                         new: AdafactorState) -> dict[str, np.ndarray]:
    """``x_abs`` of each field for the native-kernel bounds (rule 11), float64.

    Native kernels order or fuse the norms' additions differently, so each field is compared in
    ULPs of ``x_abs = e * M``: ``M`` the field's magnitude, ``e`` its count of roundings
    relative to ``M`` (per implementation, first order), which grows with the reductions'
    lengths: a norm of ``n`` elements ``n / 2 + 1``; ``row_mean = norm ** 2 / N`` ``n + 4``;
    ``row_var`` (lerp, 7) ``n + 11``, ``col_var`` ``m + 11``; their mean over ``m`` adds ``m``;
    ``v = row * col / mean`` ``2n + 2m + 35`` (unfactored: ``d * d`` and the lerp, 8); ``u``
    ``e_v / 2 + 3``; alpha ``N / 2 + 1``, the clipping ``e_u + N / 2 + 1``, the step
    ``N + 2 e_u + 4`` (``N``: the parameter's size); the parameter ``2 |p'| + (e_s + 1) |s|``.
    Each side is within ``e * u * M`` of the exact value (u the unit roundoff) and an ULP of
    ``e * M`` exceeds ``e * u * M``, so the two sides part by under 2 ULPs of ``x_abs``."""
    a64 = (lambda x: np.abs(np.asarray(x, np.float64)))
    c, arr = config, np.asarray(p)
    t = float(new.step)
    w = t ** c.beta2_decay
    g64, size = a64(g), max(int(arr.size), 1)
    eps1 = c.eps[0] if c.eps[0] is not None else float(np.finfo(arr.dtype).eps)
    out: dict[str, np.ndarray] = {}
    with np.errstate(all="ignore"):
        if factored(arr):
            n, m = g64.shape[-1], g64.shape[-2]
            e_row, e_col = n + 4 + _E_LERP, m + 4 + _E_LERP
            out["row_var"] = ((1 - w) * a64(old.row_var) + w * np.mean(g64 ** 2, axis=-1, keepdims=True)) * e_row
            out["col_var"] = ((1 - w) * a64(old.col_var) + w * np.mean(g64 ** 2, axis=-2, keepdims=True)) * e_col
            row, col = a64(new.row_var), a64(new.col_var)
            v = row * col / np.maximum(np.mean(row, axis=-2, keepdims=True), eps1)
            e_v = e_row + e_col + (e_row + m) + 2
        else:
            e_v = 1 + _E_LERP
            out["variance"] = ((1 - w) * a64(old.variance) + w * g64 ** 2) * e_v
            v = a64(new.variance)
        u = g64 / np.sqrt(np.maximum(v, eps1 * eps1))
        e_u = e_v / 2 + 3
        rms_u = float(np.sqrt(np.mean(u ** 2))) if arr.size else 0.0
        rms_p = float(np.sqrt(np.mean(a64(p) ** 2))) if arr.size else 0.0
        alpha = max(c.eps[1], rms_p) * min(c.lr, 1 / t ** 0.5)
        step = alpha / max(1.0, rms_u / c.d) * u
        e_s = size + 2 * e_u + 4
        out["param"] = 2 * a64(p) * abs(1 - c.lr * c.weight_decay) + (e_s + 1) * step
    return out


# --- the registry row (reference.optim._registry) --------------------------------------------

# Native-kernel bounds, in ULPs of x_abs: x_abs already carries each field's rounding count,
# reductions' lengths included (`adafactor_magnitudes` derives it); each side is within that count
# of the exact value, and an ULP of x_abs is at least half that count of the magnitude's.
# Not element-wise: row and column means and the parameter's RMS read whole tensors.


def _adafactor(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return adafactor_step(params, grads, state, config, lr=lr)


def _foreach_adafactor(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0):
    return adafactor_step(params, grads, state, config, lr=lr, foreach=True)


# torch has no fused Adafactor; its rsqrt takes the correctly rounded root, so torch's sqrt is not taken.
register(OptimizerSpec("Adafactor", AdafactorConfig, AdafactorConfig, adafactor_init_state,
                       {"for-loop": _adafactor, "foreach": _foreach_adafactor}, magnitudes=adafactor_magnitudes,
                       native_ulp={"row_var": 2 * 2, "col_var": 2 * 2, "variance": 2 * 2, "param": 2 * 2}, elementwise=False))
