"""A learning rate given as a tensor, and how torch's optimizers compute with it on CPU.

torch accepts ``lr`` as a one-element tensor; the spec takes it as a 0-d float32 or float64
array, of dtype ``L``. Rules (``f`` rounds to the parameter dtype, ``L`` to the rate's):

1. Read as a number. Where torch hands the tensor to a ``Scalar`` argument (``alpha=-lr``,
   ``value=-lr``) or reads ``lr.item()``, the rate is the number it holds, exactly as a Python
   float of that value would be (`value`).
2. Arithmetic with Python floats stays a tensor of dtype ``L``, the float rounded to ``L``
   first: ``lr * c`` is ``L(lr * L(c))``, ``lr / c`` is ``L(lr / L(c))``, ``c - lr`` is
   ``L(L(c) - lr)``; ``-lr`` is exact (`times`, `over`, `minus_from`). A result handed on to a
   ``Scalar`` argument is then read as the number it holds (rule 1).
3. An operation between an array ``x`` and a 0-d tensor ``t`` computes in their common dtype:
   ``x``'s own when ``x`` has dimensions, the wider of the two when ``x`` is 0-d too (two 0-d
   tensors promote; a Python float never promotes). In place (``x.mul_(t)``) the result is
   rounded back to ``x``'s dtype; out of place it keeps the common dtype (`common`, `binary`).
4. Decoupled weight decay with a tensor rate, ``p.mul_(1 - lr * weight_decay)``: the factor is
   ``minus_from(1, times(lr, wd))`` and multiplies ``p`` in place by rule 3, so a float32 0-d
   parameter meets a float64 factor as ``f(f64(p) * factor)`` (`decayed`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from reference.optim._common import check_lr_or_tensor

__all__ = ["binary", "common", "decayed", "minus_from", "over", "tensor_lr", "times", "value"]


def tensor_lr(lr: Any) -> np.ndarray | None:
    """``lr`` when it is a tensor lr (a 0-d float32/float64 array, checked), else None."""
    checked = check_lr_or_tensor(lr) if lr is not None else None
    return checked if isinstance(checked, np.ndarray) else None


def value(lr: Any) -> float:
    """Rule 1: the number a tensor (or a float) holds."""
    return float(np.asarray(lr)[()])


def _l(t: np.ndarray) -> type:
    return np.asarray(t).dtype.type


def times(t: np.ndarray, c: float) -> np.ndarray:
    """Rule 2: ``t * c``, a 0-d tensor times a Python float."""
    L = _l(t)
    return np.asarray(L(np.asarray(t)[()] * L(c)))


def over(t: np.ndarray, c: float) -> np.ndarray:
    """Rule 2: ``t / c``, a 0-d tensor divided by a Python float."""
    L = _l(t)
    return np.asarray(L(np.asarray(t)[()] / L(c)))


def minus_from(c: float, t: np.ndarray) -> np.ndarray:
    """Rule 2: ``c - t``, a Python float minus a 0-d tensor."""
    L = _l(t)
    return np.asarray(L(L(c) - np.asarray(t)[()]))


def common(x: np.ndarray, t: np.ndarray) -> np.dtype:
    """Rule 3: the dtype torch computes ``x op t`` in, for a 0-d tensor ``t``."""
    x, t = np.asarray(x), np.asarray(t)
    return x.dtype if x.ndim > 0 else np.promote_types(x.dtype, t.dtype)


def binary(op: str, x: np.ndarray, t: np.ndarray, inplace: bool) -> np.ndarray:
    """Rule 3: ``x op t`` (``op`` one of ``+ * /``) with a 0-d tensor ``t``, in place or not."""
    x = np.asarray(x)
    w = common(x, t)
    a, b = x.astype(w), np.asarray(t).astype(w)[()]
    out = a + b if op == "+" else a * b if op == "*" else a / b
    return np.asarray(out).astype(x.dtype if inplace else w)


def decayed(p: np.ndarray, lr: np.ndarray, weight_decay: float) -> np.ndarray:
    """Rule 4: ``p.mul_(1 - lr * weight_decay)`` with a tensor lr (nothing when the decay is 0)."""
    if weight_decay == 0:
        return p
    return binary("*", p, minus_from(1.0, times(lr, weight_decay)), inplace=True)
