"""What every optimizer of the specification shares: input checks, the parameter loop, and the
rounding of torch's elementwise operations on CPU.

Rules (``f(x)`` rounds x to the parameter dtype; a Python-float hyperparameter that meets a
tensor is first rounded to that dtype):

1. ``add(x, y, alpha)`` is ``x.add(y, alpha=alpha)``: ``f(x + f(f(alpha) * y))``.
2. ``addcmul(x, a, b, value)`` is ``x.addcmul(a, b, value=value)``: the value multiplies the
   first factor first, ``f(x + f(f(f(value) * a) * b))``.
3. ``addcdiv(x, a, b, value)`` is ``x.addcdiv(a, b, value=value)``: ``f(x + f(f(f(value) * a) / b))``.
4. ``lerp(x, y, w)`` is ``x.lerp(y, w)`` with a scalar weight ``w = f(w)``: when ``|w| < 0.5``
   ``f(x + f(w * f(y - x)))``, otherwise ``f(y - f(f(y - x) * f(1 - w)))``. At ``w = 1`` exactly
   the vectorized kernel's ``f(y + f((w - 1) * f(y - x)))`` differs from that in the sign of a
   zero (``1 - w`` and ``w - 1`` are both +0, so ``y = -0.0`` over ``y - x < 0`` stays -0.0 there,
   +0.0 in the scalar kernel): it computes the first ``n - n % B`` elements in memory order, ``B``
   the elements of 64 bytes (16 float32, 8 float64, 32 bfloat16/float16: two 32-byte vectors), and
   the scalar kernel the rest; a 0-d array is scalar. Measured on torch 2.13, sizes 0-69, 100,
   1000, 4099, under ``ATEN_CPU_CAPABILITY=default`` and on an AVX512 build alike.
5. A value of 1 in rules 1-3 multiplies exactly, so ``x.add(y)`` is ``f(x + y)``.
6. Weight decay as NAdam and RAdam take it (``decoupled_weight_decay``): decoupled, the parameter
   shrinks first, ``p = f(p * f(1 - lr * weight_decay))``, and the gradient is unchanged; coupled,
   ``d = add(d, p, weight_decay)`` (rule 1) and the parameter is unchanged. Nothing when 0.

Under ``ATEN_CPU_CAPABILITY=default`` torch rounds each of these operations separately, as
written here; native AVX2/AVX512 kernels fuse some of the multiply-adds:

7. Native kernels (``NATIVE_KERNELS``), float32: three operations fuse their multiply-add
   (``fma32``: the exact ``a * b + c`` rounded once), on every element, the vectorized head and
   the scalar tail alike (the vector code calls ``fmadd`` and the compiler contracts the tail):
   ``x.add(y, alpha=a)`` with ``a != 1`` is ``fma(f(a), y, x)``; ``x.addcmul(a, b, value=v)`` is
   ``fma(f(f(v) * a), b, x)``; ``x.lerp(y, w)`` is rule 4 fused, ``fma(w, f(y - x), x)`` when
   ``|w| < 0.5``, else ``fma(-f(y - x), f(1 - w), y)``, and at ``w = 1`` its vectorized head
   ``fma(w - 1, f(y - x), y)``. ``addcdiv`` (a division last), ``mul``, ``div``, ``sqrt`` and
   ``x.add(y)`` round as rules 1-5. Measured on torch 2.13 against random float32 operands, sizes
   1-70, 100, 1000, 4099, 65536, on AVX512 and under ``ATEN_CPU_CAPABILITY=avx2``: no bit differs.
   ``reference.lowprec`` rule 13 states the same fusions for 16-bit storage.

How the steps compute (speed, not semantics): a chain of these operations may write into a
preallocated array (NumPy's ``out=``) instead of a new array per operation. A ufunc writes
into an ``out`` of its result's dtype the value it would return in a new array, operands keep
torch's order, and nothing is fused, so the bits are those of the rules; what changes is that a step
allocates (and the operating system zeroes) little more than the arrays it returns, which on
large parameters costs more than the arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
NATIVE_KERNELS = ("AVX2", "AVX512")
"""Rule 7: the CPU capabilities (``torch.backends.cpu.get_cpu_capability()``) whose float32
fusions the specification states."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_lr(lr: float) -> float:
    value = float(lr)
    require(value >= 0.0, f"lr must be >= 0, got {lr!r}")
    return value


def check_lr_or_tensor(lr: Any) -> float | np.ndarray:
    """A Python-float lr, or a tensor lr (rule 11): a 0-d float32/float64 array, kept as it is."""
    if isinstance(lr, np.ndarray):
        require(lr.ndim == 0 and lr.dtype in DTYPES, f"a tensor lr must be a 0-d float32/float64 array, got {lr!r}")
        check_lr(lr[()])
        return lr
    return check_lr(lr)


def lr_value(config: Any, lr: Any) -> float:
    """The step's rate as a Python float: ``config.lr`` when ``lr`` is None, else its value
    (a tensor lr read as the number it holds, rule 11)."""
    return float(config.lr) if lr is None else float(check_lr_or_tensor(lr))


def check_nonnegative(**values: float) -> None:
    for name, value in values.items():
        require(value >= 0.0, f"{name} must be >= 0, got {value!r}")


def frozen(a: np.ndarray) -> np.ndarray:
    """A read-only copy (of an array that may be a caller's)."""
    out = np.array(a, copy=True)
    out.setflags(write=False)
    return out


def freeze(a: np.ndarray) -> np.ndarray:
    """An array the step itself created, made read-only where it is: the state keeps it without
    a copy (`frozen` copies, for arrays that may be a caller's)."""
    out = np.asarray(a)
    out.setflags(write=False)
    return out



def abs64(a: np.ndarray) -> np.ndarray:
    """``|a|`` in float64, as a new array also for 0-d input (for the ``magnitudes`` of the
    native-kernel bounds, which then work in place on it)."""
    return np.abs(a, dtype=np.float64, out=np.empty(np.shape(a), np.float64))


def check_param(p: np.ndarray, i: int) -> np.ndarray:
    arr = np.asarray(p)
    if arr.dtype not in DTYPES:  # the message is formatted only when raised: str(dtype) is slow
        raise ValueError(f"params[{i}] must be float32 or float64, got {arr.dtype}")
    return arr


def check_inputs(params, grads, state, config, config_type, state_type) -> list[np.ndarray]:
    require(isinstance(config, config_type), f"config must be a {config_type.__name__}, got {type(config).__name__}")
    require(len(params) == len(grads) == len(state),
            f"params, grads and state must have the same length, got {len(params)}, {len(grads)}, {len(state)}")
    arrays = [check_param(p, i) for i, p in enumerate(params)]
    for i, (p, g, s) in enumerate(zip(arrays, grads, state)):
        require(isinstance(s, state_type), f"state[{i}] must be a {state_type.__name__}, got {type(s).__name__}")
        if g is None:
            continue
        g = np.asarray(g)
        if g.dtype != p.dtype or g.shape != p.shape:
            raise ValueError(f"grads[{i}] must match params[{i}] ({p.dtype}, shape {p.shape}), "
                             f"got {g.dtype}, shape {g.shape}")
    return arrays


def for_each_param(
    arrays: list[np.ndarray],
    grads: Sequence[np.ndarray | None],
    state: Sequence[Any],
    update: Callable[[np.ndarray, np.ndarray, Any], tuple[np.ndarray, Any, np.ndarray]],
) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple[Any, ...]]:
    """Rule 7 of `reference.optim` for every optimizer: a parameter without a gradient keeps its
    value (a copy) and its state; ``update(param, grad, state)`` gives ``(param, state, grad)``
    for the others. Floating-point exceptions are IEEE results here, not errors."""
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


def add(x: np.ndarray, y: np.ndarray, alpha: float = 1.0, *, out: np.ndarray | None = None) -> np.ndarray:
    """Rule 1: ``x.add(y, alpha=alpha)``. ``out``: an array to write the result to (a fresh one,
    or ``y``, or ``x`` itself, for which the scaled ``y`` takes a temporary)."""
    f = np.asarray(x).dtype.type
    if out is None:
        return x + y if alpha == 1 else x + f(alpha) * y
    if alpha == 1:
        return np.add(x, y, out=out)
    scaled = np.multiply(y, f(alpha), out=None if out is x else out)
    return np.add(x, scaled, out=out)


def addcmul(x: np.ndarray, a: np.ndarray, b: np.ndarray, value: float = 1.0) -> np.ndarray:
    """Rule 2: ``x.addcmul(a, b, value=value)``."""
    f = np.asarray(x).dtype.type
    return x + (f(value) * a) * b


def addcdiv(x: np.ndarray, a: np.ndarray, b: np.ndarray, value: float = 1.0) -> np.ndarray:
    """Rule 3: ``x.addcdiv(a, b, value=value)``."""
    f = np.asarray(x).dtype.type
    return x + (f(value) * a) / b


def vector_head(n: int, itemsize: int) -> int:
    """Rule 4: how many leading elements of ``n`` torch's vectorized elementwise loop computes
    (whole 64-byte blocks); the scalar loop computes the rest."""
    block = 64 // itemsize
    return n - n % block


def lerp(x: np.ndarray, y: np.ndarray, weight: float, *, out: np.ndarray | None = None) -> np.ndarray:
    """Rule 4: ``x.lerp(y, weight)`` with a Python-float weight. ``out``: a fresh array to write
    the result to (neither ``x`` nor ``y``)."""
    f = np.asarray(x).dtype.type
    w = f(weight)
    if out is None:
        if abs(w) < 0.5:
            return x + w * (y - x)
        result = y - (y - x) * (f(1) - w)
    else:
        diff = np.subtract(y, x, out=out)
        if abs(w) < 0.5:
            return np.add(x, np.multiply(diff, w, out=out), out=out)
        result = np.subtract(y, np.multiply(diff, f(1) - w, out=out), out=out)
    return _vector_head_at_one(result, x, y, w)


def _vector_head_at_one(result: np.ndarray, x: np.ndarray, y: np.ndarray, w: np.floating) -> np.ndarray:
    """Rule 4 at ``w = 1``: the vectorized elements are ``y + (w - 1) * (y - x)`` (signs of zero)."""
    head = vector_head(np.size(result), np.asarray(result).dtype.itemsize) if w == 1 else 0
    if head == 0 or np.ndim(result) == 0:
        return result
    xs, ys = np.ravel(x)[:head], np.ravel(y)[:head]
    with np.errstate(invalid="ignore", over="ignore"):  # IEEE results, as for_each_param's
        result.flat[:head] = ys + (w - w.dtype.type(1)) * (ys - xs)  # C order: torch's, for contiguous tensors
    return result


def weight_decayed(p: np.ndarray, d: np.ndarray, weight_decay: float, decoupled: bool,
                   lr: float) -> tuple[np.ndarray, np.ndarray]:
    """Rule 6: the parameter and the gradient after weight decay, decoupled or coupled."""
    if weight_decay == 0:
        return p, d
    if decoupled:
        return p * p.dtype.type(1 - lr * weight_decay), d
    return p, add(d, p, weight_decay)


def step_counter(step: np.float32) -> np.float32:
    """torch's step counter: a float32 tensor incremented by one (it stops counting at 2**24)."""
    return np.float32(step + np.float32(1.0))


_F32 = np.float32
_BELOW_F32 = np.int64(64 - 29)  # float64 has 29 significand bits below float32's 24
_ON_BOUNDARY = np.int64(-1 << 63)  # those 29 bits 1000...0, shifted to the top
_F32_TINY = float(np.finfo(np.float32).tiny)


def fma32(a: Any, b: Any, c: Any) -> np.ndarray:
    """Rule 7: float32 ``fma(a, b, c)``, rounded once. The product of two float32 values is exact
    in float64 and their sum with ``c`` rounds once to float64; rounding that to float32 gives the
    exactly rounded result unless the float64 sum sits on a float32 rounding boundary (its low
    29 significand bits ``1000...0``, or a result of magnitude up to 2**-126, where the
    subnormals' boundaries lie higher): a second rounding can only cross a boundary it lands
    on. Those few elements are made round-to-odd from the sum's exact error (TwoSum); a
    round-to-odd value with 53 bits rounds to float32's 24 as the exact sum would."""
    a32, b32, c32 = (np.asarray(v, _F32) for v in (a, b, c))
    with np.errstate(all="ignore"):
        # Each operand cast to float64 once: numpy's mixed-dtype loops cast in small buffers, twice
        # as slow. The product and the sum go into the cast's own memory where the shapes allow.
        total = b32.astype(np.float64)
        total = _into(np.multiply, total, a32)  # exact
        total = _into(np.add, total, c32)
        out = total.astype(_F32)
        shape = out.shape
        bits = total.reshape(-1).view(np.int64)
        # The low 29 bits shifted to the top, in the sum's own memory (the few suspects' sums are
        # computed again below, by the same two operations, to the same bits): a boundary's
        # pattern, 1 then zeros, becomes int64's least value, which a reduction finds.
        np.left_shift(bits, _BELOW_F32, out=bits)
        suspect = None
        if bits.size and bits.min() == _ON_BOUNDARY:
            suspect = bits == _ON_BOUNDARY
        magnitude = np.abs(out)
        # Up to 2**-126 itself: a sum just below it, where the boundaries are the subnormals',
        # can round up to it.
        if magnitude.size and magnitude.min() <= _F32_TINY:
            tiny = ((magnitude <= _F32_TINY) & (out != 0)).reshape(-1)
            suspect = tiny if suspect is None else suspect | tiny
        if suspect is None or not suspect.any():
            return out
        k = np.flatnonzero(suspect)
        p = _at(a32, shape, k).astype(np.float64) * _at(b32, shape, k).astype(np.float64)
        c = _at(c32, shape, k).astype(np.float64)
        t = p + c
        back = t - p
        err = (p - (t - back)) + (c - back)
        if not err.any():  # exact sums (ties among them): one rounding from float64 is the result
            return out
        odd = np.where((err != 0) & ((t.view(np.int64) & 1) == 0) & np.isfinite(t),
                       np.nextafter(t, np.where(err > 0, np.inf, -np.inf)), t)
        out.reshape(-1)[k] = odd.astype(_F32)
        return out


def _into(op: np.ufunc, total: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``op(total, x)`` in float64, into ``total``'s memory when the result has its shape."""
    x64 = x.astype(np.float64)
    if total.ndim and (x.ndim == 0 or x.shape == total.shape):
        return op(total, x64, out=total)
    return np.asarray(op(total, x64))


def _at(x: np.ndarray, shape: tuple[int, ...], k: np.ndarray) -> np.ndarray:
    """The elements at flat indices ``k`` of ``x`` broadcast to ``shape``."""
    if x.ndim == 0:
        return np.full(k.shape, x)
    return (x if x.shape == shape else np.broadcast_to(x, shape)).reshape(-1)[k]


def add_fused(x: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
    """Rule 7: float32 ``x.add(y, alpha=alpha)`` on native kernels (rule 1 where ``alpha`` is 1)."""
    if alpha == 1:
        return np.add(x, y)
    return fma32(_F32(alpha), y, x)


def addcmul_fused(x: np.ndarray, a: np.ndarray, b: np.ndarray, value: float) -> np.ndarray:
    """Rule 7: float32 ``x.addcmul(a, b, value=value)`` on native kernels."""
    return fma32(_F32(value) * np.asarray(a, _F32), b, x)


def lerp_fused(x: np.ndarray, y: np.ndarray, weight: float, *, head: int | None = None) -> np.ndarray:
    """Rule 7: float32 ``x.lerp(y, weight)`` on native kernels. ``head``: the leading elements the
    vectorized loop takes at ``weight = 1`` (None: rule 4's whole 64-byte blocks)."""
    w = _F32(weight)
    x32, y32 = np.asarray(x, _F32), np.asarray(y, _F32)
    with np.errstate(all="ignore"):
        diff = y32 - x32
        if abs(w) < 0.5:
            return fma32(w, diff, x32)
        out = np.asarray(fma32(-diff, _F32(1) - w, y32))
        if w == 1 and out.ndim:
            n = vector_head(out.size, 4) if head is None else head
            out.reshape(-1)[:n] = fma32(w - _F32(1), diff.reshape(-1)[:n], y32.reshape(-1)[:n])
    return out

