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
7. foreach path (torch's ``_multi_tensor_*`` functions; on the CPU every ``_foreach_*`` kernel
   rounds as the per-tensor one, rules 1-5) but the in-place ``_foreach_mul_`` with a scalar or
   a list of scalars, which rounds the scalar to S first: ``S(x * f32(S(s)))`` (measured on
   torch 2.13, default and AVX512 kernels alike; the out-of-place ``_foreach_mul`` and
   ``_foreach_div_`` keep ``f32(s)``, ``_foreach_add_``/``_foreach_sub_`` round it to S as rule 1
   does, ``_foreach_addcdiv_``/``_foreach_addcmul_`` take a float32 value, as rule 3). So SGD's ``buf * momentum`` takes
   ``S(momentum)`` when every parameter with a gradient has a buffer (else torch falls back to the
   per-tensor ``buf.mul_``, rule 1), and Adam(W)'s ``exp_avg_sq * beta2`` and AdamW's
   ``p * (1 - lr * wd)`` take ``S(beta2)`` and ``S(1 - lr * wd)``; everything else is rule 6.
   ``_foreach_addcdiv_`` with a list of scalars takes each as a float32 value, as rule 3.
8. fused path, Adam and AdamW (``fused=True``): the kernel loads each S operand into float32,
   computes the whole update as the float32 fused kernel does (``reference.optim`` rule 8) and
   stores each result rounded once to S: the weight and each state array are ``S(x)`` of the
   float32 fused step from ``f32(p)``, ``f32(g)``, ``f32(state)``; the step counter is float32.
9. RMSprop (``reference.optim.rmsprop`` rules 2-4) and Adagrad (``reference.optim.adagrad``),
   for-loop and foreach paths, with rules 1-7: ``square_avg * alpha`` and the momentum buffer's
   ``* momentum`` are rule 1 (for-loop) or rule 7 (foreach); Adagrad's foreach path scales the
   gradient by ``-clr`` before ``addcdiv`` with value 1, in place (rule 7) when it holds a copy of
   the gradient (weight decay or maximize), else out of place (rule 1).
10. Coverage: ``COVERED``. Any other optimizer or implementation raises ``NotImplementedError``
    naming it: the specification does not claim torch's bits there; so does a configuration
    `refused` names (fused SGD with momentum, rule 15). Adafactor: rule 16 (torch has no fused
    Adafactor). The native (AVX2/AVX512) kernels: rule 13.
11. Adamax and Adadelta (``reference.optim.adamax``, ``reference.optim.adadelta``), for-loop path:
    their rules with rules 1-5 (``|d| + eps`` and ``v + eps`` are ``add_scalar``); an elementwise
    product or quotient of two S tensors (Adadelta's ``delta / std * d``) rounds once per operation.
    Their foreach paths compute the same operations but for rule 7: Adamax's ``exp_inf * beta2``
    and Adadelta's ``square_avg * rho`` and ``acc_delta * rho`` take ``S(beta2)``, ``S(rho)``.
12. NAdam and RAdam (``reference.optim.nadam``, ``reference.optim.radam``), for-loop path: their
    rules with rules 1-5 and 11 and the weight decay of ``reference.optim._common`` rule 6
    (``p * (1 - lr * wd)`` is rule 1); NAdam's ``mu_product`` is a float32 counter and its
    denominator ``sqrt(v / bc2) + eps``; RAdam's ``m / bc1 * lr``, then (rectified)
    ``* (bc2**0.5 / (sqrt(v) + eps)) * rect``, where ``scalar / x`` is torch's
    ``x.reciprocal() * scalar`` (two roundings), and ``p - product``.
13. Native kernels (``KERNELS``: the capability ``torch.backends.cpu.get_cpu_capability()``
    names, keyed to the bytes one pass of its vectorized loop takes, which splits each operation
    into a head of whole blocks and a scalar tail; ``DEFAULT`` is the scalar kernels of rules
    1-12 and 14-16). AVX2 and AVX512 alike take 64-byte blocks (32 elements of S): the loop
    steps two 32-byte vectors a pass, and on AVX512 torch runs these kernels' AVX2 build
    (``REGISTER_DISPATCH`` registers no AVX512 kernel; measured: torch's bits are the same on
    both capabilities, every covered pair, the fused paths included). Four operations differ,
    every other rounds as above (measured on torch 2.13, bit for bit, bfloat16 and float16, the
    for-loop and foreach paths of every covered optimizer, sizes 0-d, 0, 1, 7, 8, 15, 16, 31, 32,
    33, 64, 100, 1000: on AVX512 four steps each, nine for the foreach paths of Adamax, Adadelta,
    NAdam and RAdam; on AVX2 and AVX512 two to four configurations, three seeds, six steps each,
    ``bench/lowprec_native.py``):
    ``x.add(y, alpha=a)`` computes its leading whole blocks as ``S(x + S(a) * y)`` (one rounding:
    the product of two S values is exact in float32) and its tail as rule 2 (a block of one
    32-byte vector, 16 elements, would put sizes 16 to 31 in the head: wrong there);
    ``x.addcmul(a, b, value=v)`` is ``S(fma(f32(v) * a, b, x))`` and ``x.lerp(y, w)`` rule 4
    with its multiply-add fused (``fma32``), on every element: the kernel's vector code calls ``fmadd`` and the
    compiler contracts its scalar tail. ``x.rsqrt()`` (rule 16) computes its leading whole
    blocks as ``S(1 / sqrt(x))`` in float32, rounded once to S (the vector converts to float32
    and back once), and its tail as the scalar kernel's two roundings (measured: on 1013
    elements the first 992 round once, 7 of the last 21 would differ if they did). The fused path (rule 8) runs the float32 fused kernel,
    whose multiply-adds the compiler contracts where it chooses: it is not modelled bit for bit;
    each stored result is within ``FUSED_NATIVE_ULPS`` ULPs of S at ``x_abs`` (the spec row's
    magnitudes) of the spec's. Derivation: the float32 values differ by at most the row's native
    bound (``reference.optim`` rule 10: 2 * 15 float32 ULPs of ``x_abs`` for the weight, less for
    each state), which is 30 * 2**-16 (bfloat16) or 30 * 2**-13 (float16) of one ULP of S at
    ``x_abs``; two values that close round to S values equal or adjacent, one ULP of S at the
    larger, and ``|result| <= x_abs (1 + 2**-18)`` makes that at most two ULPs of S at
    ``x_abs`` (one where no binade is crossed). Measured: 0 or 1.
    The same bound and derivation hold on AVX2 (the same fused kernel; measured: 0 or 1).
    Any other capability is refused by name.
14. NAdam and RAdam, foreach path (rule 7 for ``exp_avg_sq * beta2`` and the decoupled
    ``p * (1 - lr * wd)``): NAdam's denominator is ``S(S(sqrt(v)) / f32(sqrt(bc2))) + S(eps)``
    (the root first, ``reference.optim.nadam`` rule 3's foreach order), its two ``addcdiv`` take
    the for-loop's step sizes as float32 values; RAdam's update is ``reference.optim.radam`` rule
    5, ``b = S(S(1 / S(S(sqrt(v) + S(eps)) / f32(s))) + S(u))`` (``_foreach_div_`` keeps its
    float32 scalar, the reciprocal rounds on its own, ``_foreach_add_`` rounds ``u`` to S as rule
    1) and ``p = addcmul(p, m, b, 1)``; unrectified, ``b = S(u)``. Measured bit for bit on the
    scalar, AVX2 and AVX512 kernels (rule 13's operations), bfloat16 and float16, with the Adamax and
    Adadelta foreach paths of rule 11.
15. fused path, SGD and Adagrad (torch's ``_fused_sgd_`` and ``_fused_adagrad_`` CPU kernels): a
    16-bit loop of its own, not rule 8's. Each parameter's leading whole vectors of
    ``FUSED_VECTOR_BYTES`` (the body: ``n - n % 16`` elements) and the rest (the tail) are read
    into float32 and each stored result rounded once to S. On every stated capability the vectors
    are 32 bytes: the scalar build's generic vectors are, and on AVX512 machines torch dispatches
    these kernels to their AVX2 build (``REGISTER_DISPATCH`` registers no AVX512 kernel). A
    multiply-add ``a * b + c`` below is fused (``fma32``) on native kernels, every one, body and
    tail (the compiler contracts them), and rounded twice in float32 on the scalar kernels.
    SGD (momentum 0): the body keeps its weights (torch 2.13's vector loop never writes the
    parameter); the tail is ``S(p - d * f32(lr))`` with ``d = p * f32(wd) + g`` (``g`` negated
    when maximize). Adagrad: ``d = p * w + g`` (``g`` negated when maximize),
    ``sum' = d * d + sum`` (stored as ``S(sum')``; the float32 value goes on) and
    ``p' = S(p - (c * d) / (sqrt(sum') + e))``, where the body takes ``w, e, c = S(wd), S(eps),
    S(clr)`` and the tail their float32 values (``clr`` is ``reference.optim.adagrad``'s, in
    float64 from the float32 counter). Fused SGD with momentum is refused (`refused`): its body
    reads the 16-bit momentum buffer as float32 words, two elements a word and 16 bytes past each
    vector, beyond the buffer's end where fewer than 8 elements follow (and into another
    thread's block under parallel chunks), so torch's buffer there depends on memory outside the
    tensors (measured: four runs of the same three steps of 16 bfloat16 elements, one buffer
    holding 1.0e29 where the others hold 0.914). Measured bit for bit (``bench/lowprec_fused.py``;
    ``bench/lowprec_native.py`` for AVX2), scalar, AVX2 and AVX512 kernels, bfloat16 and float16,
    sizes 0-d, 0, 1, 7, 8, 15, 16, 31, 32, 33, 64, 100, 1000.
16. Adafactor (``reference.optim.adafactor`` rules 1-10), for-loop and foreach paths, each
    operation rounded once to S as above: ``x.rsqrt()`` is ``S(1 / S(sqrt(x)))`` on the scalar
    kernels (the root rounded to S, then the quotient; rule 13 for the native head); the norms
    and ``row_var``'s mean are ``reference.reductions`` rules 11-12 (float32 accumulators in
    torch's order, one rounding; ``param.norm(2).item()`` is the Python float of the S norm);
    ``norm ** 2`` (``square_``) and ``g * g`` are ``S(x * x)``; the division by the row length
    is rule 1's (``f32(N)``); ``row_var @ col_var`` (an inner dimension of 1) is ``S(r * c)``,
    one exact product rounded once; ``clamp(min=e)`` clamps at ``S(f32(e))`` (``eps1`` and
    ``eps1 * eps1``) and keeps NaN; the division by the clamped mean is ``S(v / m)``; the
    decoupled weight decay ``p * (1 - lr * wd)`` is rule 1 (for-loop) or rule 7 (foreach); the
    lerps are rule 4 (13). The for-loop update is ``p.add(u, alpha=-alpha / denom)`` (rule 2 or
    13); the foreach path multiplies ``u`` in place by ``S(-alpha / denom)`` (rule 7) and adds
    ``S(p + u)``. ``eps1 = None`` resolves as ``reference.optim.adafactor`` rule 2 (S's
    epsilon), and a zero-size parameter with a gradient is refused as its rule 10 (torch raises
    ZeroDivisionError). Measured bit for bit on torch 2.13, scalar, AVX2 and AVX512 kernels alike
    (so `bound` is 0): bfloat16 and float16, 0-d, vector, matrix (rows or columns of 1 among
    them) and 3-d parameters, three configurations, three seeds, six steps, 1,620 parameter
    steps per path and kernel level, no bit differing (``bench/lowprec_native.py --optimizer
    Adafactor``; with 32-byte blocks 154 and 115 differ on the native kernels).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from reference import reductions
from reference.optim import AdamParamState, SGDParamState
from reference.optim.adafactor import AdafactorState, check_sizes, factored, resolve_eps1
from reference.optim.adadelta import AdadeltaState
from reference.optim.adagrad import AdagradState
from reference.optim.adamax import AdamaxState
from reference.optim.nadam import NAdamState
from reference.optim.radam import RAdamState, rectification
from reference.optim.rmsprop import RMSpropState
from reference.optim._common import addcmul_fused, fma32, lerp_fused, vector_head
from reference.optim._registry import OptimizerSpec

__all__ = ["COVERED", "FUSED_NATIVE_ULPS", "FUSED_VECTOR_BYTES", "KERNELS", "bound", "covered", "fma32", "refused",
           "rsqrt", "state_to", "step", "to_storage"]

COVERED: dict[str, tuple[str, ...]] = {"SGD": ("for-loop", "foreach", "fused"),
                                       "Adam": ("for-loop", "foreach", "fused"),
                                       "AdamW": ("for-loop", "foreach", "fused"), "RMSprop": ("for-loop", "foreach"),
                                       "Adagrad": ("for-loop", "foreach", "fused"), "Adamax": ("for-loop", "foreach"),
                                       "Adadelta": ("for-loop", "foreach"), "NAdam": ("for-loop", "foreach"),
                                       "RAdam": ("for-loop", "foreach"), "Adafactor": ("for-loop", "foreach")}
_F32 = np.float32
KERNELS: dict[str, int | None] = {"DEFAULT": None, "AVX2": 64, "AVX512": 64}
"""Rule 13: each CPU capability the specification states, with the bytes one pass of its
vectorized loop takes (two 32-byte vectors: AVX512 runs the AVX2 build of these kernels; None:
the scalar kernels)."""
FUSED_NATIVE_ULPS = 2
"""Rule 13: the fused path's bound on native kernels (Adam, AdamW), in ULPs of S at the row's magnitudes."""
FUSED_VECTOR_BYTES = 32
"""Rule 15: the vectors of torch's fused SGD and Adagrad kernels on every stated capability."""


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
        with np.errstate(invalid="ignore", over="ignore"):  # IEEE results, as the rest of the step
            out.flat[:head] = ys + (w32 - _F32(1)) * (ys - xs)
    return _r(out, x.dtype)


def sqrt(x: np.ndarray) -> np.ndarray:
    """Rule 5."""
    return _r(np.sqrt(_f(x)), x.dtype)


def rsqrt(x: np.ndarray) -> np.ndarray:
    """Rule 16: ``x.rsqrt()`` on the scalar kernels: ``S(1 / S(sqrt(x)))``, two roundings to S."""
    return _r(_F32(1) / _f(sqrt(x)), x.dtype)


def to_storage(value: float, storage: np.dtype) -> np.ndarray:
    """Rule 16: a Python float as a clamp's bound on S: ``S(f32(value))``."""
    return np.asarray(_F32(value)).astype(storage)


def mul_scalar_foreach(x: np.ndarray, s: float) -> np.ndarray:
    """Rule 7: the in-place ``_foreach_mul_`` by a scalar rounds the scalar to S first."""
    return _r(_f(x) * _f(np.asarray(_F32(s)).astype(x.dtype)), x.dtype)


def _head(n: int, itemsize: int, block: int) -> int:
    """Rule 13: how many leading elements of ``n`` the vectorized loop takes (whole blocks of
    ``block`` bytes); the scalar tail takes the rest."""
    return n - n % (block // itemsize)


def add_native(x: np.ndarray, y: np.ndarray, alpha: float = 1.0, *, block: int) -> np.ndarray:
    """Rule 13: ``x.add(y, alpha=a)`` on native kernels: the leading whole blocks of ``block``
    bytes ``S(x + S(a) * y)`` (the product of two S values is exact in float32), the tail as the
    scalar kernel (rule 2)."""
    scalar = add(x, y, alpha)
    if alpha == 1 or np.ndim(scalar) == 0:
        return scalar
    a = _f(np.asarray(_F32(alpha)).astype(x.dtype))
    head = _head(np.size(scalar), x.dtype.itemsize, block)
    out = np.array(scalar, copy=True)
    out.reshape(-1)[:head] = _r(_f(x).reshape(-1)[:head] + a * _f(y).reshape(-1)[:head], x.dtype)
    return out


def addcmul_native(x: np.ndarray, a: np.ndarray, b: np.ndarray, value: float, *, block: int) -> np.ndarray:
    """Rule 13: ``S(fma(f32(v) * a, b, x))``, every element, head and tail alike (``block`` unused)."""
    return _r(addcmul_fused(_f(x), _f(a), _f(b), value), x.dtype)


def lerp_native(x: np.ndarray, y: np.ndarray, w: float, *, block: int) -> np.ndarray:
    """Rule 13: rule 4 with its multiply-add fused, every element: ``S(fma(w, y - x, x))`` when
    ``|w| < 0.5``, else ``S(fma(-(y - x), 1 - w, y))``; at ``w = 1`` the leading whole blocks
    ``S(fma(w - 1, y - x, y))`` (``reference.optim._common`` rule 7 in float32)."""
    return _r(lerp_fused(_f(x), _f(y), w, head=_head(np.size(x), x.dtype.itemsize, block)), x.dtype)


def rsqrt_native(x: np.ndarray, *, block: int) -> np.ndarray:
    """Rule 13: ``x.rsqrt()`` on native kernels: the leading whole blocks of ``block`` bytes
    ``S(1 / sqrt(x))`` in float32, one rounding to S; the tail as the scalar kernel (rule 16)."""
    out = np.array(rsqrt(x), copy=True)
    if out.ndim == 0:
        return out
    head = _head(out.size, x.dtype.itemsize, block)
    with np.errstate(all="ignore"):
        out.reshape(-1)[:head] = _r(_F32(1) / np.sqrt(_f(x).reshape(-1)[:head]), x.dtype)
    return out


@dataclass(frozen=True)
class _Path:
    """How one implementation on one kind of kernel rounds (rules 1-4, 7 and 13)."""

    name: str
    mul_buffer: Callable[[np.ndarray, float], np.ndarray]
    mul_state: Callable[[np.ndarray, float], np.ndarray]
    add: Callable[..., np.ndarray] = add
    lerp: Callable[..., np.ndarray] = lerp
    addcmul: Callable[..., np.ndarray] = addcmul
    rsqrt: Callable[..., np.ndarray] = rsqrt


_FOR_LOOP = _Path("for-loop", mul_scalar, mul_scalar)
_FOREACH = _Path("foreach", mul_scalar_foreach, mul_scalar_foreach)
# foreach SGD when some parameter has no momentum buffer yet: torch's per-tensor fallback (rule 7)
_FOREACH_FIRST = _Path("foreach", mul_scalar, mul_scalar_foreach)


def _on_kernels(path: _Path, kernels: str) -> _Path:
    """Rule 13: ``path`` with the native kernels' operations of capability ``kernels``."""
    block = KERNELS[kernels]
    if block is None:
        return path
    return dataclasses.replace(path, add=functools.partial(add_native, block=block),
                               lerp=functools.partial(lerp_native, block=block),
                               addcmul=functools.partial(addcmul_native, block=block),
                               rsqrt=functools.partial(rsqrt_native, block=block))


def _sgd(p: np.ndarray, g: np.ndarray, s: SGDParamState, c: Any, lr: float,
         path: _Path = _FOR_LOOP) -> tuple[np.ndarray, SGDParamState]:
    d = -g if c.maximize else g
    if c.weight_decay != 0:
        d = path.add(d, p, c.weight_decay)
    buf = s.momentum_buffer
    if c.momentum != 0:
        buf = np.array(d, copy=True) if buf is None else path.add(path.mul_buffer(buf, c.momentum), d, 1 - c.dampening)
        d = path.add(d, buf, c.momentum) if c.nesterov else buf
    return path.add(p, d, -lr), SGDParamState(momentum_buffer=buf)


def _adam(p: np.ndarray, g: np.ndarray, s: AdamParamState, c: Any, lr: float,
          path: _Path = _FOR_LOOP) -> tuple[np.ndarray, AdamParamState]:
    beta1, beta2 = c.betas
    counter = _F32(s.step + _F32(1.0))
    d = -g if c.maximize else g
    if c.weight_decay != 0:
        if c.decoupled_weight_decay:
            p = path.mul_state(p, 1 - lr * c.weight_decay)
        else:
            d = path.add(d, p, c.weight_decay)
    m = path.lerp(s.exp_avg, d, 1 - beta1)
    v = path.addcmul(path.mul_state(s.exp_avg_sq, beta2), d, d, 1 - beta2)
    t = float(counter)
    step_size = lr / (1 - beta1**t)
    bias_correction2_sqrt = (1 - beta2**t) ** 0.5
    vmax = s.max_exp_avg_sq
    if c.amsgrad:
        vmax = np.maximum(vmax, v)
    denom = add_scalar(div_scalar(sqrt(vmax if c.amsgrad else v), bias_correction2_sqrt), c.eps)
    return addcdiv(p, m, denom, -step_size), AdamParamState(counter, m, v, vmax)


def _rmsprop(p: np.ndarray, g: np.ndarray, s: RMSpropState, c: Any, lr: float,
             path: _Path = _FOR_LOOP) -> tuple[np.ndarray, RMSpropState]:
    """Rule 9: ``reference.optim.rmsprop`` rules 2-4 with these operations."""
    d = -g if c.maximize else g
    if c.weight_decay != 0:
        d = path.add(d, p, c.weight_decay)
    square_avg = path.addcmul(path.mul_state(s.square_avg, c.alpha), d, d, 1 - c.alpha)
    grad_avg = None
    if c.centered:
        grad_avg = path.lerp(s.grad_avg, d, 1 - c.alpha)
        avg = sqrt(path.addcmul(square_avg, grad_avg, grad_avg, -1))
    else:
        avg = sqrt(square_avg)
    avg = add_scalar(avg, c.eps)
    buf = None
    if c.momentum > 0:
        buf = addcdiv(path.mul_state(s.momentum_buffer, c.momentum), d, avg, 1)
        p = path.add(p, buf, -lr)
    else:
        p = addcdiv(p, d, avg, -lr)
    return p, RMSpropState(_F32(s.step + _F32(1.0)), square_avg, buf, grad_avg)


def _adagrad(p: np.ndarray, g: np.ndarray, s: AdagradState, c: Any, lr: float,
             path: _Path = _FOR_LOOP) -> tuple[np.ndarray, AdagradState]:
    """Rule 9: ``reference.optim.adagrad``'s step with these operations; the foreach path
    multiplies the gradient by ``-clr`` first (in place, rule 7, when it holds a copy: with
    weight decay or maximize) and adds the quotient with value 1."""
    counter = _F32(s.step + _F32(1.0))
    d = -g if c.maximize else g
    if c.weight_decay != 0:
        d = path.add(d, p, c.weight_decay)
    clr = lr / (1 + (float(counter) - 1) * c.lr_decay)
    total = path.addcmul(s.sum, d, d, 1.0)
    std = add_scalar(sqrt(total), c.eps)
    if path.name == "for-loop":
        return addcdiv(p, d, std, -clr), AdagradState(counter, total)
    scale = mul_scalar_foreach if (c.weight_decay != 0 or c.maximize) else mul_scalar
    return addcdiv(p, scale(d, -clr), std, 1.0), AdagradState(counter, total)


def mul(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Rule 11: elementwise ``x * y`` of two S tensors, one rounding."""
    return _r(_f(x) * _f(y), x.dtype)


def div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Rule 11: elementwise ``x / y`` of two S tensors, one rounding."""
    return _r(_f(x) / _f(y), x.dtype)


def _adamax(p: np.ndarray, g: np.ndarray, s: AdamaxState, c: Any, lr: float,
            path: _Path = _FOR_LOOP) -> tuple[np.ndarray, AdamaxState]:
    """Rule 11: ``reference.optim.adamax``'s step with these operations; the foreach path multiplies
    ``exp_inf`` by ``S(beta2)`` (rule 7)."""
    beta1, beta2 = c.betas
    counter = _F32(s.step + _F32(1.0))
    d = -g if c.maximize else g
    if c.weight_decay != 0:
        d = path.add(d, p, c.weight_decay)
    exp_avg = path.lerp(s.exp_avg, d, 1 - beta1)
    exp_inf = np.maximum(path.mul_state(s.exp_inf, beta2), add_scalar(np.abs(d), c.eps))
    clr = lr / (1 - beta1 ** float(counter))
    return addcdiv(p, exp_avg, exp_inf, -clr), AdamaxState(counter, exp_avg, exp_inf)


def _adadelta(p: np.ndarray, g: np.ndarray, s: AdadeltaState, c: Any, lr: float,
              path: _Path = _FOR_LOOP) -> tuple[np.ndarray, AdadeltaState]:
    """Rule 11: ``reference.optim.adadelta``'s step with these operations; the foreach path
    multiplies both averages by ``S(rho)`` (rule 7)."""
    d = -g if c.maximize else g
    if c.weight_decay != 0:
        d = path.add(d, p, c.weight_decay)
    square_avg = path.addcmul(path.mul_state(s.square_avg, c.rho), d, d, 1 - c.rho)
    std = sqrt(add_scalar(square_avg, c.eps))
    delta = mul(div(sqrt(add_scalar(s.acc_delta, c.eps)), std), d)
    acc_delta = path.addcmul(path.mul_state(s.acc_delta, c.rho), delta, delta, 1 - c.rho)
    return path.add(p, delta, -lr), AdadeltaState(_F32(s.step + _F32(1.0)), square_avg, acc_delta)


def _decayed(p: np.ndarray, d: np.ndarray, c: Any, lr: float, path: _Path) -> tuple[np.ndarray, np.ndarray]:
    """``reference.optim._common`` rule 6 with rules 1-2 and 7: decoupled ``p * (1 - lr * wd)``
    (the foreach path's in-place multiply by ``S(1 - lr * wd)``), else ``d + wd * p``."""
    if c.weight_decay == 0:
        return p, d
    if c.decoupled_weight_decay:
        return path.mul_state(p, 1 - lr * c.weight_decay), d
    return p, path.add(d, p, c.weight_decay)


def _nadam(p: np.ndarray, g: np.ndarray, s: NAdamState, c: Any, lr: float,
           path: _Path = _FOR_LOOP) -> tuple[np.ndarray, NAdamState]:
    """Rules 12 and 14: ``reference.optim.nadam``'s step with these operations; ``mu_product`` is
    a float32 counter, ``exp_avg_sq / bc2`` a division by a float32 scalar (rule 1), the foreach
    path's ``sqrt(exp_avg_sq) / sqrt(bc2)`` likewise."""
    beta1, beta2 = c.betas
    counter = _F32(s.step + _F32(1.0))
    t = float(counter)
    d = -g if c.maximize else g
    p, d = _decayed(p, d, c, lr, path)
    mu = beta1 * (1.0 - 0.5 * (0.96 ** (t * c.momentum_decay)))
    mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((t + 1) * c.momentum_decay)))
    mu_product = _F32(s.mu_product * _F32(mu))
    m = path.lerp(s.exp_avg, d, 1 - beta1)
    v = path.addcmul(path.mul_state(s.exp_avg_sq, beta2), d, d, 1 - beta2)
    if path.name == "foreach":  # rule 14: the root first, then the division by sqrt(bc2)
        denom = add_scalar(div_scalar(sqrt(v), (1 - beta2**t) ** 0.5), c.eps)
    else:
        denom = add_scalar(sqrt(div_scalar(v, 1 - beta2**t)), c.eps)
    mp = float(mu_product)
    p = addcdiv(p, d, denom, -lr * (1.0 - mu) / (1.0 - mp))
    p = addcdiv(p, m, denom, (-lr * mu_next) / (1.0 - mp * mu_next))
    return p, NAdamState(counter, mu_product, m, v)


def _radam(p: np.ndarray, g: np.ndarray, s: RAdamState, c: Any, lr: float,
           path: _Path = _FOR_LOOP) -> tuple[np.ndarray, RAdamState]:
    """Rules 12 and 14: ``reference.optim.radam``'s step with these operations; ``scalar / x``
    is torch's ``x.reciprocal() * scalar`` (two roundings); the foreach path's update is rule 14."""
    beta1, beta2 = c.betas
    counter = _F32(s.step + _F32(1.0))
    t = float(counter)
    d = -g if c.maximize else g
    p, d = _decayed(p, d, c, lr, path)
    m = path.lerp(s.exp_avg, d, 1 - beta1)
    v = path.addcmul(path.mul_state(s.exp_avg_sq, beta2), d, d, 1 - beta2)
    rect = rectification(beta2, t)
    if path.name == "foreach":
        return _radam_foreach(p, m, v, c, lr, t, rect, path), RAdamState(counter, m, v)
    product = mul_scalar(div_scalar(m, 1 - beta1**t), lr)
    if rect > 0:
        adaptive = mul_scalar(div(np.ones_like(v), add_scalar(sqrt(v), c.eps)), (1 - beta2**t) ** 0.5)
        product = mul_scalar(mul(product, adaptive), rect)
    return path.add(p, product, -1.0), RAdamState(counter, m, v)


def _radam_foreach(p: np.ndarray, m: np.ndarray, v: np.ndarray, c: Any, lr: float, t: float, rect: float,
                   path: _Path) -> np.ndarray:
    """Rule 14: RAdam's foreach update, ``reference.optim.radam`` rule 5 with these operations:
    ``b = S(S(1 / S(S(sqrt(v) + S(eps)) / f32(s))) + S(u))`` and ``p = addcmul(p, m, b, 1)``."""
    beta1, beta2 = c.betas
    bc1 = 1 - beta1**t
    scale = ((1 - beta2**t) ** 0.5) * (lr * rect / bc1) * -1
    unrect = (lr * (0 if rect > 0 else 1.0) / bc1) * -1
    buffer = add_scalar(div(np.ones_like(v), div_scalar(add_scalar(sqrt(v), c.eps), scale)), unrect)
    return path.addcmul(p, m, buffer, 1.0)


def _mean_square(d: np.ndarray, axis: int) -> np.ndarray:
    """Rule 16: Adafactor's row (``axis=-1``) or column statistic ``S(S(n * n) / f32(N))``, ``n``
    the S norm over ``axis`` (``reference.reductions`` rule 11), ``N`` that dimension's length."""
    n = reductions.norm2_16(d, axis)
    return div_scalar(mul(n, n), d.shape[axis])


def _adafactor(p: np.ndarray, g: np.ndarray, s: AdafactorState, c: Any, lr: float,
               path: _Path = _FOR_LOOP) -> tuple[np.ndarray, AdafactorState]:
    """Rule 16: ``reference.optim.adafactor``'s step (rules 3-8) with these operations; ``c.eps[0]``
    is resolved (`step` does it for the whole call)."""
    counter = _F32(s.step + _F32(1.0))
    t = float(counter)
    d = -g if c.maximize else g
    w = t ** c.beta2_decay
    rho = min(lr, 1 / (t ** 0.5))
    alpha = max(c.eps[1], float(reductions.norm2_16(p)) / (p.size ** 0.5)) * rho
    if c.weight_decay != 0:
        p = path.mul_state(p, 1 - lr * c.weight_decay)
    eps1 = c.eps[0]
    if factored(p):
        row_var = path.lerp(s.row_var, _mean_square(d, -1), w)
        col_var = path.lerp(s.col_var, _mean_square(d, -2), w)
        clamped = np.maximum(reductions.mean_16(row_var, -2), to_storage(eps1, p.dtype))  # NaN propagates
        v = div(mul(row_var, col_var), clamped)
        new = AdafactorState(counter, row_var=row_var, col_var=col_var)
    else:
        v = path.lerp(s.variance, mul(d, d), w)
        new = AdafactorState(counter, variance=v)
    u = mul(path.rsqrt(np.maximum(v, to_storage(eps1 * eps1, p.dtype))), d)
    denom = max(1.0, float(reductions.norm2_16(u)) / ((u.size ** 0.5) * c.d))
    if path.name == "foreach":
        return add(p, mul_scalar_foreach(u, -alpha / denom)), new
    return path.add(p, u, -alpha / denom), new


def _madd(a: Any, b: Any, c: Any, native: bool) -> np.ndarray:
    """Rule 15: float32 ``a * b + c``, fused on native kernels, two roundings on the scalar ones."""
    if native:
        return np.asarray(fma32(a, b, c))
    return np.asarray(np.asarray(a, _F32) * np.asarray(b, _F32) + np.asarray(c, _F32))


def _body(x: np.ndarray) -> int:
    """Rule 15: how many leading elements the fused kernel's vector loop takes (whole 32-byte vectors)."""
    return x.size - x.size % (FUSED_VECTOR_BYTES // x.dtype.itemsize)


def _fused_sgd(p: np.ndarray, g: np.ndarray, s: SGDParamState, c: Any, lr: float,
               native: bool) -> tuple[np.ndarray, SGDParamState]:
    """Rule 15: torch's fused SGD on S (momentum 0): the body keeps its weights, the tail is
    ``S(p - d * f32(lr))``, ``d = p * f32(wd) + g``."""
    n, body = p.size, _body(p)
    pf, d = _f(p).reshape(-1)[body:], _f(g).reshape(-1)[body:]
    d = -d if c.maximize else d
    if c.weight_decay != 0:
        d = _madd(pf, _F32(c.weight_decay), d, native)
    out = np.array(p, copy=True).reshape(n)
    out[body:] = _r(_madd(-d, _F32(lr), pf, native), p.dtype)
    return out.reshape(p.shape), s


def _fused_scalar(x: np.ndarray, value: float) -> np.ndarray:
    """Rule 15: a hyperparameter per element: ``S(value)`` in the body, ``f32(value)`` in the tail."""
    out = np.full(x.size, _F32(value), _F32)
    out[:_body(x)] = _f(np.asarray(_F32(value)).astype(x.dtype))
    return out


def _fused_adagrad(p: np.ndarray, g: np.ndarray, s: AdagradState, c: Any, lr: float,
                   native: bool) -> tuple[np.ndarray, AdagradState]:
    """Rule 15: torch's fused Adagrad on S: ``d = p * w + g``, ``sum' = d * d + sum`` and
    ``S(p - (c * d) / (sqrt(sum') + e))``, the body's ``w, e, c`` rounded to S."""
    counter = _F32(s.step + _F32(1.0))
    clr = lr / (1 + (float(counter) - 1) * c.lr_decay)
    pf, d = _f(p).reshape(-1), _f(g).reshape(-1)
    d = -d if c.maximize else d
    if c.weight_decay != 0:
        d = _madd(pf, _fused_scalar(p, c.weight_decay), d, native)
    total = _madd(d, d, _f(s.sum).reshape(-1), native)
    new = pf - (_fused_scalar(p, clr) * d) / (np.sqrt(total) + _fused_scalar(p, c.eps))
    return _r(new, p.dtype).reshape(p.shape), AdagradState(counter, _r(total, p.dtype).reshape(p.shape))


_FUSED_16 = {"SGD": _fused_sgd, "Adagrad": _fused_adagrad}


def refused(name: str, implementation: str, config: Any) -> str | None:
    """Rule 15: the setting, and why, for which the specification does not claim torch's bits in
    a covered pair (None: it does)."""
    if name == "SGD" and implementation == "fused" and config.momentum != 0:
        return (f"momentum {config.momentum}: the kernel's vector loop reads the 16-bit momentum buffer as float32 "
                "words, 16 bytes past each vector (beyond the buffer's end where fewer than 8 elements follow), so "
                "torch's buffer depends on memory outside the tensors; use momentum=0, foreach=True or float32 "
                "parameters")
    return None


def state_to(opt: Any, dtype: np.dtype | None) -> Any:
    """Every array field of ``opt`` in ``dtype`` (float32 when None, exact from S; RNE to S)."""
    changes = {f.name: np.asarray(getattr(opt, f.name)).astype(dtype or _F32)
               for f in dataclasses.fields(opt) if isinstance(getattr(opt, f.name), np.ndarray)}
    return dataclasses.replace(opt, **changes)


def _fused(row: OptimizerSpec, weights: list[np.ndarray], grads: list[np.ndarray | None], opts: list[Any],
           config: Any, rate: float) -> tuple[list[np.ndarray], tuple[Any, ...]]:
    """Rule 8: the float32 fused step on upcast operands, each stored result rounded once to S."""
    storage = np.asarray(weights[0]).dtype
    q, _, new = row.step("fused", [_f(w) for w in weights], [None if g is None else _f(g) for g in grads],
                         tuple(state_to(o, None) for o in opts), config, lr=rate)
    out_w = [w if g is None else _r(a, storage) for w, a, g in zip(weights, q, grads)]
    out_s = tuple(o if g is None else state_to(n, storage) for o, n, g in zip(opts, new, grads))
    return out_w, out_s


_STEPS = {"SGD": _sgd, "Adam": _adam, "AdamW": _adam, "RMSprop": _rmsprop, "Adagrad": _adagrad,
          "Adamax": _adamax, "Adadelta": _adadelta, "NAdam": _nadam, "RAdam": _radam, "Adafactor": _adafactor}


def _path(row: OptimizerSpec, implementation: str, grads: Sequence[np.ndarray | None], opts: Sequence[Any],
          kernels: str) -> _Path:
    """Rules 6-7 and 13: the roundings of the implementation at hand on ``kernels``."""
    if implementation == "for-loop":
        return _on_kernels(_FOR_LOOP, kernels)
    if row.name == "SGD" and any(o.momentum_buffer is None for o, g in zip(opts, grads) if g is not None):
        return _on_kernels(_FOREACH_FIRST, kernels)
    return _on_kernels(_FOREACH, kernels)


def _adafactor_config(config: Any, weights: Sequence[np.ndarray], grads: Sequence[np.ndarray | None],
                      implementation: str) -> Any:
    """Rule 16: ``config`` with ``eps1`` resolved for the whole call (``reference.optim.adafactor``
    rule 2), after refusing a zero-size parameter with a gradient (its rule 10)."""
    check_sizes(weights, grads)
    eps1 = resolve_eps1(config, [np.asarray(w) for w in weights], grads, implementation == "foreach")
    return config if eps1 is None else dataclasses.replace(config, eps=(eps1, config.eps[1]))


def _check_kernels(kernels: str) -> None:
    """Rule 13: a capability the specification knows, else NotImplementedError naming it."""
    if kernels not in KERNELS:
        raise NotImplementedError(f"kernels={kernels!r}: the specification states torch's low-precision steps on "
                                  f"{', '.join(KERNELS)} CPU kernels only")


def bound(name: str, implementation: str, kernels: str = "DEFAULT") -> int:
    """Rules 13 and 15: how far (ULPs of S at the row's magnitudes) torch's ``name``
    (``implementation``) may lie from `step`'s: 0 (bit for bit) but for fused Adam and AdamW on
    native kernels."""
    _check_kernels(kernels)
    native_fused = implementation == "fused" and name not in _FUSED_16 and KERNELS[kernels] is not None
    return FUSED_NATIVE_ULPS if native_fused else 0


def covered(name: str, implementation: str) -> bool:
    """Rule 10: does the specification model torch's ``name`` (``implementation``) on S tensors?"""
    return implementation in COVERED.get(name, ())


def _covered() -> str:
    return "; ".join(name + " (" + ", ".join(impls) + ")" for name, impls in COVERED.items())


def step(row: OptimizerSpec, implementation: str, weights: Sequence[np.ndarray], grads: Sequence[np.ndarray | None],
         opts: Sequence[Any], config: Any, *, lr: float | None = None, kernels: str = "DEFAULT"
         ) -> tuple[list[np.ndarray], tuple[Any, ...]]:
    """One step of ``row``'s ``implementation`` on S arrays (rules 6-9, 11-12, 14-16) on the CPU capability
    ``kernels`` (rule 13; `bound` says how close torch is there): the new weights and states; a
    parameter without a gradient keeps both."""
    _check_kernels(kernels)
    if not covered(row.name, implementation):
        raise NotImplementedError(
            f"the specification does not model torch's {row.name} ({implementation}) on low-precision parameters; "
            f"covered: {_covered()}")
    why = refused(row.name, implementation, config)
    if why is not None:
        raise NotImplementedError(f"the specification does not model torch's {row.name} ({implementation}) on "
                                  f"low-precision parameters with {why}")
    if lr is not None and not isinstance(lr, (int, float)):
        raise NotImplementedError("a tensor lr on low-precision parameters is not modelled")
    rate = float(config.lr if lr is None else lr)
    if row.name == "Adafactor":
        config = _adafactor_config(config, weights, grads, implementation)
    if implementation == "fused" and row.name not in _FUSED_16:
        return _fused(row, list(weights), list(grads), list(opts), config, rate) if weights else ([], ())
    if implementation == "fused":
        update = functools.partial(_FUSED_16[row.name], native=KERNELS[kernels] is not None)
    else:
        update = functools.partial(_STEPS[row.name], path=_path(row, implementation, grads, opts, kernels))
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
