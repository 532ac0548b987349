"""torch's optimizers stepping parameters stored in bfloat16 or float16 (the ``none`` option of
``reference.master_weights``), operation by operation as torch's scalar CPU kernels round them
(``ATEN_CPU_CAPABILITY=default``, the exact mode).

S is the storage format; ``S(x)`` rounds a float32 value to S (RNE); every operand is read as
float32 (exact). A reduced-precision kernel computes in float32 ("opmath") and rounds its result
once to S, except where a rule says otherwise. Python-float hyperparameters are float64 until
they meet a tensor.

Rules:

1. ``x.mul(s)`` and ``x.div(s)`` with a Python scalar: ``S(x * f32(s))``, ``S(x / f32(s))``: the
   scalar is rounded to float32, not to S; but ``x.add(s)``: ``S(x + S(s))``, the scalar rounded
   to S first (measured on every capability: Adam's ``eps``).
2. ``x.add(y, alpha=a)``: ``S(x + S(S(a) * y))`` in the scalar kernel: the scalar is rounded to
   S and the product is rounded to S before the sum (the vectorized kernels compute
   ``S(x + S(a) * y)``, one rounding, in float32). With ``a = 1``: ``S(x + y)``.
3. ``x.addcmul(a, b, value=v)``: ``S(x + (f32(v) * a) * b)``; ``x.addcdiv(a, b, value=v)``:
   ``S(x + (f32(v) * a) / b)``: float32 throughout, one rounding to S.
4. ``x.lerp(y, w)``: ``S(x + f32(w) * (y - x))`` when ``|w| < 0.5``, else
   ``S(y - (y - x) * (1 - f32(w)))``, float32 inside; at ``w = 1`` exactly the first
   ``n - n % 32`` elements take the vectorized kernel's ``S(y + (w - 1) * (y - x))``, which
   differs in the sign of a zero (rule 4 of ``reference.optim._common``, 64-byte blocks).
5. ``x.sqrt()``: ``S(sqrt(x))`` with float32's correctly rounded root (no MKL for S).
6. SGD (``reference.optim.sgd`` rule 2) and Adam/AdamW (``reference.optim`` rules 3-6), for-loop
   path: these operations in torch's order (measured bit for bit in the exact mode, bfloat16 and
   float16). The step counter is float32.
7. Coverage: ``COVERED``. Any other optimizer or implementation raises ``NotImplementedError``
   naming it: the specification does not claim torch's bits there. Not modelled: the foreach
   paths (on S tensors torch's ``_foreach_*`` kernels round differently from the per-tensor ones:
   measured differences with SGD's Nesterov momentum and weight decay, with AdamW's maximize, and
   in float16 with Adam(W) too), the fused kernels (a whole update in float32, one rounding per
   stored tensor), and the other optimizers of the registry (not measured yet). The native
   (AVX2/AVX512) kernels differ as rule 2 says and by fused multiply-adds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from reference.optim import AdamParamState, SGDParamState
from reference.optim._common import vector_head
from reference.optim._registry import OptimizerSpec

__all__ = ["COVERED", "step"]

COVERED: dict[str, tuple[str, ...]] = {"SGD": ("for-loop",), "Adam": ("for-loop",), "AdamW": ("for-loop",)}
_F32 = np.float32


def _r(x: np.ndarray, storage: np.dtype) -> np.ndarray:
    """Round a float32 result to S."""
    return np.asarray(x, dtype=_F32).astype(storage)


def _f(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(_F32)


def mul_scalar(x: np.ndarray, s: float) -> np.ndarray:
    """Rule 1."""
    return _r(_f(x) * _F32(s), x.dtype)


def div_scalar(x: np.ndarray, s: float) -> np.ndarray:
    """Rule 1."""
    return _r(_f(x) / _F32(s), x.dtype)


def add_scalar(x: np.ndarray, s: float) -> np.ndarray:
    """Rule 1: the scalar is rounded to S before the sum."""
    return _r(_f(x) + _f(np.asarray(_F32(s)).astype(x.dtype)), x.dtype)


def add(x: np.ndarray, y: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    """Rule 2."""
    if alpha == 1:
        return _r(_f(x) + _f(y), x.dtype)
    a = _f(np.asarray(_F32(alpha)).astype(x.dtype))
    return _r(_f(x) + _f(_r(a * _f(y), x.dtype)), x.dtype)


def addcmul(x: np.ndarray, a: np.ndarray, b: np.ndarray, value: float) -> np.ndarray:
    """Rule 3."""
    return _r(_f(x) + (_F32(value) * _f(a)) * _f(b), x.dtype)


def addcdiv(x: np.ndarray, a: np.ndarray, b: np.ndarray, value: float) -> np.ndarray:
    """Rule 3."""
    return _r(_f(x) + (_F32(value) * _f(a)) / _f(b), x.dtype)


def lerp(x: np.ndarray, y: np.ndarray, w: float) -> np.ndarray:
    """Rule 4."""
    w32, x32, y32 = _F32(w), _f(x), _f(y)
    if abs(w32) < 0.5:
        return _r(x32 + w32 * (y32 - x32), x.dtype)
    out = np.asarray(y32 - (y32 - x32) * (_F32(1) - w32))
    head = vector_head(out.size, x.dtype.itemsize) if w32 == 1 and out.ndim else 0
    if head:
        ys, xs = y32.ravel()[:head], x32.ravel()[:head]
        out.flat[:head] = ys + (w32 - _F32(1)) * (ys - xs)
    return _r(out, x.dtype)


def sqrt(x: np.ndarray) -> np.ndarray:
    """Rule 5."""
    return _r(np.sqrt(_f(x)), x.dtype)


def _sgd(p: np.ndarray, g: np.ndarray, s: SGDParamState, c: Any, lr: float) -> tuple[np.ndarray, SGDParamState]:
    d = -g if c.maximize else g
    if c.weight_decay != 0:
        d = add(d, p, c.weight_decay)
    buf = s.momentum_buffer
    if c.momentum != 0:
        buf = np.array(d, copy=True) if buf is None else add(mul_scalar(buf, c.momentum), d, 1 - c.dampening)
        d = add(d, buf, c.momentum) if c.nesterov else buf
    return add(p, d, -lr), SGDParamState(momentum_buffer=buf)


def _adam(p: np.ndarray, g: np.ndarray, s: AdamParamState, c: Any, lr: float) -> tuple[np.ndarray, AdamParamState]:
    beta1, beta2 = c.betas
    counter = _F32(s.step + _F32(1.0))
    d = -g if c.maximize else g
    if c.weight_decay != 0:
        if c.decoupled_weight_decay:
            p = mul_scalar(p, 1 - lr * c.weight_decay)
        else:
            d = add(d, p, c.weight_decay)
    m = lerp(s.exp_avg, d, 1 - beta1)
    v = addcmul(mul_scalar(s.exp_avg_sq, beta2), d, d, 1 - beta2)
    t = float(counter)
    step_size = lr / (1 - beta1**t)
    bias_correction2_sqrt = (1 - beta2**t) ** 0.5
    vmax = s.max_exp_avg_sq
    if c.amsgrad:
        vmax = np.maximum(vmax, v)
    denom = add_scalar(div_scalar(sqrt(vmax if c.amsgrad else v), bias_correction2_sqrt), c.eps)
    return addcdiv(p, m, denom, -step_size), AdamParamState(counter, m, v, vmax)


_STEPS = {"SGD": _sgd, "Adam": _adam, "AdamW": _adam}


def _covered() -> str:
    return "; ".join(name + " (" + ", ".join(impls) + ")" for name, impls in COVERED.items())


def step(row: OptimizerSpec, implementation: str, weights: Sequence[np.ndarray], grads: Sequence[np.ndarray | None],
         opts: Sequence[Any], config: Any, *, lr: float | None = None) -> tuple[list[np.ndarray], tuple[Any, ...]]:
    """One step of ``row``'s ``implementation`` on S arrays (rule 6): the new weights and states;
    a parameter without a gradient keeps both."""
    if implementation not in COVERED.get(row.name, ()):
        raise NotImplementedError(
            f"the specification does not model torch's {row.name} ({implementation}) on low-precision parameters; "
            f"covered: {_covered()}")
    if lr is not None and not isinstance(lr, (int, float)):
        raise NotImplementedError("a tensor lr on low-precision parameters is not modelled")
    rate = float(config.lr if lr is None else lr)
    update = _STEPS[row.name]
    new_w, new_s = [], []
    with np.errstate(all="ignore"):
        for w, g, s in zip(weights, grads, opts):
            if g is None:
                new_w.append(w)
                new_s.append(s)
                continue
            a, b = update(np.asarray(w), np.asarray(g), s, config, rate)
            new_w.append(a)
            new_s.append(b)
    return new_w, tuple(new_s)
