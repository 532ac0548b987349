"""Precision health statistics computed with torch: what the doctor measures on each tensor.

Each function is the torch computation of the rule of the same name in the specification
(``reference/health.py``); the conformance suite checks them against it on the same tensors.
They are written from torch's own facts (``torch.finfo``, ``torch.frexp``), not by porting the
spec, so that a shared mistake cannot hide. Inputs are tensors on any device; results are
Python numbers (one host sync each).

1. ``amax``: max |x| over the non-NaN elements, 0.0 when none.
2. ``headroom_bits``: log2(max / amax), +inf for 0, -inf for inf.
3. fractions are integer counts over their denominator (0.0 for an empty denominator).
4. ``overflow_count``: finite x whose f32(x * scale) rounds past max: |y| above max plus half
   the spacing at max, or equal to that tie when max's last mantissa bit is odd (RNE rounds
   it up); the threshold, not a cast, so that torch's saturating float8_e4m3fn cast counts too.
5. ``underflow_count``: finite non-zero x whose f32(x * scale) casts to ±0.
6. ``flushed_count``: finite non-zero shadow entries that are ±0 in the mixed run.
7. ``nonfinite_fraction``, ``subnormal_fraction``.
8. ``sqnr_db``: float64 sums (torch's reduction order).
9. ``lost_update_count``: |update| < gap / 2, the gap from ``frexp``: 2^(e - 1 - mantissa bits)
   in the binade [2^(e-1), 2^e), half that downward at an exact power of two above the smallest
   normal, the smallest subnormal at and below the smallest normal's binade and at ±0.
12. ``applied_lost_count``: of the entries with a finite non-zero exact update, those whose
    stored bits did not change (compared as integers of the dtype's width, so -0.0 -> +0.0 is a
    change and an unchanged NaN is not).
10. ``scale_range``: exponents from ``frexp`` (exact): ``high`` largest k with amax 2^k <= max,
    ``low`` smallest k with the needed-th largest |g| times 2^k above half the smallest subnormal.
11. ``underflow_mass``: (sum of |x| over rule 5's elements, sum of |x| over the finite ones),
    float64 sums (the spec's rule 13; torch's reduction order, within its rule 15 bound).
12. ``flushed_mass``: rule 6's elements weighed by |reference| the same way (the spec's rule 14).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "ScaleRange",
    "amax",
    "applied_lost_count",
    "flushed_count",
    "flushed_mass",
    "headroom_bits",
    "lost_update_count",
    "nonfinite_fraction",
    "one_thread",
    "overflow_count",
    "scale_range",
    "sqnr_db",
    "subnormal_fraction",
    "underflow_count",
    "underflow_mass",
]


def _facts(dtype: torch.dtype) -> tuple[float, float, float, int]:
    """(max, smallest normal, smallest subnormal, mantissa bits) of a floating dtype."""
    fi = torch.finfo(dtype)
    mant = int(round(-math.log2(fi.eps)))
    return float(fi.max), float(fi.tiny), math.ldexp(float(fi.tiny), -mant), mant


def _fraction(count: int, total: int) -> float:
    return float(count) / float(total) if total else 0.0


def amax(x: torch.Tensor) -> float:
    """Rule 1."""
    if x.numel() == 0:
        return 0.0
    a = x.detach().abs()
    return float(torch.where(torch.isnan(a), torch.zeros_like(a), a).max())


def headroom_bits(value: float, dtype: torch.dtype) -> float:
    """Rule 2."""
    if math.isnan(value):
        return math.nan
    if value == 0:
        return math.inf
    if math.isinf(value):
        return -math.inf
    return math.log2(_facts(dtype)[0] / value)


def _overflow_threshold(dtype: torch.dtype) -> tuple[float, bool]:
    """(max + half the spacing at max, whether that tie itself overflows)."""
    top, _, _, mant = _facts(dtype)
    _, e = math.frexp(top)  # top in [2^(e-1), 2^e)
    spacing = math.ldexp(1.0, e - 1 - mant)
    odd = int(top / spacing) % 2 == 1
    return top + spacing / 2, odd


def _scaled(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """f32(f32(x) * f32(scale)); ``scale`` a number or a float32 tensor that broadcasts (row-wise scales)."""
    s = scale if isinstance(scale, torch.Tensor) else torch.tensor(scale, dtype=torch.float32, device=x.device)
    return x.detach().float() * s.float()


def overflow_count(x: torch.Tensor, dtype: torch.dtype, scale: float | torch.Tensor = 1.0) -> int:
    """Rule 4."""
    y = _scaled(x, scale).abs()
    threshold, tie_overflows = _overflow_threshold(dtype)
    past = (y >= threshold) if tie_overflows else (y > threshold)
    return int((torch.isfinite(x.detach()) & past).sum())


def underflow_count(x: torch.Tensor, dtype: torch.dtype, scale: float | torch.Tensor = 1.0) -> tuple[int, int]:
    """Rule 5."""
    xd = x.detach()
    live = torch.isfinite(xd) & (xd != 0)
    zero = _scaled(xd, scale).to(dtype) == 0
    return int((live & zero).sum()), int(live.sum())


def underflow_mass(x: torch.Tensor, dtype: torch.dtype, scale: float | torch.Tensor = 1.0) -> tuple[float, float]:
    """Rule 11."""
    xd = x.detach()
    finite = torch.isfinite(xd)
    lost = finite & (xd != 0) & (_scaled(xd, scale).to(dtype) == 0)
    a = xd.double().abs()
    zero = torch.zeros((), dtype=torch.float64, device=a.device)
    return float(torch.where(lost, a, zero).sum()), float(torch.where(finite, a, zero).sum())


def flushed_mass(reference: torch.Tensor, observed: torch.Tensor) -> tuple[float, float]:
    """Rule 12."""
    if reference.shape != observed.shape:
        raise ValueError(f"reference has shape {tuple(reference.shape)} but observed has {tuple(observed.shape)}")
    r, o = reference.detach(), observed.detach()
    finite = torch.isfinite(r)
    lost = finite & (r != 0) & (o == 0)
    a = r.double().abs()
    zero = torch.zeros((), dtype=torch.float64, device=a.device)
    return float(torch.where(lost, a, zero).sum()), float(torch.where(finite, a, zero).sum())


def flushed_count(reference: torch.Tensor, observed: torch.Tensor) -> tuple[int, int]:
    """Rule 6."""
    if reference.shape != observed.shape:
        raise ValueError(f"reference has shape {tuple(reference.shape)} but observed has {tuple(observed.shape)}")
    r, o = reference.detach(), observed.detach()
    live = torch.isfinite(r) & (r != 0)
    return int((live & (o == 0)).sum()), int(live.sum())


def nonfinite_fraction(y: torch.Tensor) -> float:
    """Rule 7."""
    return _fraction(int((~torch.isfinite(y.detach())).sum()), y.numel())


def subnormal_fraction(y: torch.Tensor, dtype: torch.dtype) -> float:
    """Rule 7."""
    a = y.detach().abs()
    return _fraction(int(((a > 0) & (a < _facts(dtype)[1])).sum()), y.numel())


def sqnr_db(reference: torch.Tensor, observed: torch.Tensor) -> float:
    """Rule 8."""
    r = reference.detach().double().reshape(-1)
    o = observed.detach().double().reshape(-1)
    if r.numel() != o.numel():
        raise ValueError(f"reference has {r.numel()} elements but observed has {o.numel()}")
    if not (bool(torch.isfinite(r).all()) and bool(torch.isfinite(o).all())):
        return math.nan
    signal = float((r * r).sum())
    noise = float(((r - o) * (r - o)).sum())
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def _gaps(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 9: the gap above and below |w| in w's dtype, float64."""
    _, tiny, sub, mant = _facts(w.dtype)
    a = w.detach().double().abs()
    f, e = torch.frexp(a)
    e = e.double()
    emin = math.log2(tiny)
    spacing = torch.exp2(e - 1 - mant)
    small = (a == 0) | (e - 1 < emin)
    up = torch.where(small, torch.full_like(a, sub), spacing)
    at_power = (f == 0.5) & (e - 1 > emin)
    down = torch.where(at_power, spacing / 2, up)
    return up, down


def lost_update_count(weight: torch.Tensor, update: torch.Tensor) -> tuple[int, int]:
    """Rule 9 for ``weight`` in its own dtype: (updates that round away, finite non-zero updates)."""
    if update.shape != weight.shape:
        raise ValueError(f"update has shape {tuple(update.shape)} but weight has {tuple(weight.shape)}")
    u = update.detach().double()
    w = weight.detach().double()
    live = torch.isfinite(u) & (u != 0) & torch.isfinite(w)
    up, down = _gaps(weight)
    outward = (w == 0) | (torch.sign(u) == torch.sign(w))
    gap = torch.where(outward, up, down)
    lost = live & (u.abs() < gap / 2)
    return int(lost.sum()), int(live.sum())


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def applied_lost_count(before: torch.Tensor, after: torch.Tensor, exact: torch.Tensor) -> tuple[int, int]:
    """Rule 12 for one parameter's stored values around a step: (lost, counted)."""
    if before.shape != after.shape or before.dtype != after.dtype or exact.shape != before.shape:
        raise ValueError(f"before {before.dtype}{list(before.shape)}, after {after.dtype}{list(after.shape)} and "
                         f"exact {list(exact.shape)} must be one parameter's: same dtype and shape")
    e = exact.detach()
    counted = (torch.isfinite(e) & (e != 0)).reshape(-1)
    width = _BITS[before.element_size()]
    same = before.detach().reshape(-1).view(width) == after.detach().reshape(-1).view(width)
    return int((counted & same).sum()), int(counted.sum())


@dataclass(frozen=True)
class ScaleRange:
    """Rule 10: loss scales 2^low ... 2^high keep the gradient representable (None: unbounded)."""

    low: int | None
    high: int | None

    @property
    def works(self) -> bool:
        return self.low is None or self.high is None or self.low <= self.high


def scale_range(grad: torch.Tensor, dtype: torch.dtype, keep: float = 0.999) -> ScaleRange:
    """Rule 10 for a gradient that will be held in ``dtype`` (unscaled fp32 values)."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be in (0, 1], got {keep!r}")
    top_value, _, sub, _ = _facts(dtype)
    g = grad.detach().double().abs().reshape(-1)
    g = g[torch.isfinite(g) & (g != 0)]
    if g.numel() == 0:
        return ScaleRange(None, None)
    # high: a 2^k <= M with a = f 2^e, f in [0.5, 1): M / a's exponent, checked exactly.
    f, e = math.frexp(float(g.max()))
    high = math.frexp(top_value)[1] - e
    while math.ldexp(f, e + high) > top_value:
        high -= 1
    needed = math.ceil(keep * g.numel())
    t = float(torch.kthvalue(g, g.numel() - needed + 1).values)  # the needed-th largest
    # low: t 2^k > 2^p (p = log2 of half the smallest subnormal); t = f 2^e.
    p = round(math.log2(sub)) - 1
    f, e = math.frexp(t)
    low = p - e + (2 if f == 0.5 else 1)
    return ScaleRange(low, high)


@contextlib.contextmanager
def one_thread(device: torch.device | str) -> Iterator[None]:
    """Compute statistics on one intra-op thread on a CPU: they are hundreds of small reductions
    a step, for which a thread pool's hand-offs cost more than they save (much more on a shared
    machine: ``bench/doctor_cost.py``). Elsewhere (CUDA) a no-op."""
    if torch.device(device).type != "cpu":
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
