"""Precision health: the statistics the doctor reports, each a pure function of arrays.

Every statistic of ``ampspec doctor`` is defined here; torchimpl computes the same ones with
torch on the same tensors and the conformance suite compares the two (exact for counts,
maxima and fractions; a stated bound for SQNR). Formats are ``reference.formats`` names.

Rules:

1. ``amax(x)``: the largest |x| over the elements that are not NaN, as a Python float; ±inf
   gives inf; an empty array or one of NaN only gives 0. Exact: every value of a format of 32
   bits or fewer is a float64.
2. ``headroom_bits(amax, fmt)``: log2(max / amax) in float64, the doublings the largest value
   can take before it passes the format's largest finite value. +inf for amax 0, -inf for an
   infinite amax, negative when amax is beyond max, NaN for a NaN amax.
3. Fractions are counts over a stated denominator, 0.0 when the denominator is 0; they are
   computed as ``count / denominator`` in float64 from integer counts, so they are exact
   functions of the counts (``*_count`` functions return the counts).
4. ``overflow_fraction(x, fmt, scale=1)``: of all elements, those that are finite in ``x``
   and whose scaled value ``f32(f32(x) * f32(scale))`` rounds past the format's max (RNE,
   rule 4 of ``reference.formats``: inf, or NaN in a format without inf). A saturating cast
   (float8_e4m3fn in torch) turns exactly these into ±max, so the same count is the saturated
   fraction (``saturation_fraction``).
5. ``underflow_fraction(x, fmt, scale=1)``: of the finite non-zero elements of ``x``, those
   whose scaled value (as in rule 4) rounds to ±0 in the format (flushed by the cast).
6. ``flushed_fraction(reference, observed)``: of the elements that are finite and non-zero
   in ``reference`` (the fp32 shadow's), those that are ±0 in ``observed`` (the mixed run's
   same tensor): values lost to underflow somewhere upstream. Shapes must match.
7. ``nonfinite_fraction(y)``: of all elements of a stored tensor, those that are ±inf or NaN
   (an overflow that happened); ``subnormal_fraction(y, fmt)``: of all elements, those with
   0 < |y| < the format's smallest normal (values that kept fewer significant bits).
8. ``sqnr_db(reference, observed)``: the signal-to-quantization-noise ratio in decibels,
   10 log10(S / E), S = sum of reference², E = sum of (reference - observed)², every term in
   float64 (exact for float32 inputs: a float32 square fits in float64), each sum correctly
   rounded (``math.fsum``). +inf when E is 0 (identical), -inf when S is 0 < E, NaN when either
   array holds a non-finite value. A torch float64 sum of n non-negative terms is within a
   relative (n - 1) 2^-53 of the correctly rounded one, so two implementations agree to
   (10 / ln 10) 2 (n - 1) 2^-53 dB plus the rounding of the log (``sqnr_bound_db``).
9. ``lost_update_fraction(weight, update, fmt)``: the half-ULP rule. ``weight`` holds the
   stored weights (of the format's dtype), ``update`` the intended change (float32 or float64).
   Of the entries with a finite non-zero update, the fraction with |update| < gap / 2, where
   gap is the distance from the weight to its neighbour in the format in the update's
   direction (toward larger magnitude when the signs agree or the weight is ±0; at ±max
   outward, the spacing below max). Such an update always rounds back to the stored weight
   when ``weight + update`` is rounded once into the format; an update of exactly gap / 2 is a
   tie that RNE may keep or take and is not counted. Note the direction: just below a power of
   two the gap is half the one above, so a downward update there needs only half as much.
10. ``scale_range(grad, fmt, keep=0.999)``: the power-of-two loss scales 2^k under which the
    gradient ``grad`` (unscaled values, as the fp32 shadow has them) is representable in the
    format: ``high`` is the largest k with amax * 2^k <= max, amax over the finite elements (no
    element overflows), ``low`` the smallest k with at least ``ceil(keep * n)`` of the n
    finite non-zero elements rounding to non-zero, i.e. |g| 2^k > smallest_subnormal / 2 (the
    exact half is a tie that RNE takes to 0); both None when n is 0. A scale works when
    low <= high; ``works`` is False when both are known and low > high (no scale works).
11. ``combine_scale_ranges(ranges)``: the range that works for every tensor at once: the
    largest ``low`` and the smallest ``high`` of those known.
12. ``applied_lost_count(before, after, exact)``: the observed lost update. ``before`` and
    ``after`` hold one parameter's stored values around a step (any dtype, same shape and
    dtype), ``exact`` the update the optimizer computed before it was stored (float32 or
    float64: ``after_exact - before`` in the master precision). An element's update was lost
    when its exact update is finite and non-zero and the stored value did not change: the bits
    of ``after`` equal those of ``before`` (bit equality, so -0.0 -> +0.0 is a change and a
    NaN that stays the same NaN is not). The count is over the entries with a finite non-zero
    exact update; ``applied_lost_fraction`` divides by that number (0.0 when it is 0). Rule 9
    predicts this count from the weight and the update alone; rule 12 observes it, and the two
    agree wherever the store is one rounding of ``weight + update`` (``none``) away from the
    tie of exactly half a gap.
13. ``underflow_mass(x, fmt, scale=1)``: what rule 5's flushed elements weigh. ``(lost,
    total)``: ``total`` the sum of |x| over the finite elements of ``x``, ``lost`` the sum of
    |x| over the elements rule 5 counts (finite, non-zero, scaled value rounding to ±0); every
    term exact in float64, each sum correctly rounded (``math.fsum``).
    ``underflow_mass_fraction`` is lost / total (0.0 when total is 0): the share of the
    tensor's L1 mass the cast loses. A count says how many values flush; this says whether they
    mattered (a million gradients of 1e-20 beside one of 1 carry 1e-14 of the mass).
14. ``flushed_mass(reference, observed)``: rule 6's flushed elements weighed the same way:
    ``total`` the sum of |reference| over its finite elements, ``lost`` the sum over the
    elements rule 6 counts; ``flushed_mass_fraction`` lost / total (0.0 when total is 0).
15. ``mass_fraction_bound(n, value)``: how far another float64 implementation of a rule 13 or
    14 fraction over ``n`` elements may be from this one's: each of the two sums is within a
    relative (n - 1) 2^-53 of the correctly rounded one (non-negative terms), so the ratio is
    within value * (2 (n - 1) 2^-53 + 2^-52) (the division's rounding and the product of the
    two errors). A fraction is 0.0 exactly when nothing flushed, in every implementation
    (a sum of positive terms is positive).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from reference import formats
from reference.formats import Format, get_format

__all__ = [
    "ScaleRange",
    "amax",
    "applied_lost_count",
    "applied_lost_fraction",
    "flushed_mass",
    "flushed_mass_fraction",
    "mass_fraction_bound",
    "underflow_mass",
    "underflow_mass_fraction",
    "combine_scale_ranges",
    "flushed_count",
    "flushed_fraction",
    "headroom_bits",
    "lost_update_count",
    "lost_update_fraction",
    "nonfinite_fraction",
    "overflow_count",
    "overflow_fraction",
    "saturation_fraction",
    "scale_range",
    "sqnr_bound_db",
    "sqnr_db",
    "subnormal_fraction",
    "underflow_count",
    "underflow_fraction",
]


def _f64(x) -> np.ndarray:
    """Values as float64 (exact for every format of 32 bits or fewer)."""
    arr = np.asarray(x)
    if arr.dtype == np.float64:
        return arr
    with np.errstate(invalid="ignore"):  # a float8 NaN pattern becomes a float32 NaN, as intended
        return arr.astype(np.float32).astype(np.float64)


def _fraction(count: int, total: int) -> float:
    """Rule 3."""
    return float(count) / float(total) if total else 0.0


def amax(x) -> float:
    """Rule 1: the largest |x| over the non-NaN elements (0.0 when there is none)."""
    v = np.abs(_f64(x)).ravel()
    v = v[~np.isnan(v)]
    return float(v.max()) if v.size else 0.0


def headroom_bits(value: float, fmt: str | Format) -> float:
    """Rule 2: log2(format max / amax) in float64."""
    f = get_format(fmt)
    if math.isnan(value):
        return math.nan
    if value == 0:
        return math.inf
    if math.isinf(value):
        return -math.inf
    return math.log2(f.max / value)


def _scaled(x, scale: float) -> np.ndarray:
    """f32(f32(x) * f32(scale)), the value a scaled cast rounds (rules 4 and 5)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x).astype(np.float32) * np.float32(scale)


def overflow_count(x, fmt: str | Format, scale: float = 1.0) -> int:
    """Rule 4: finite elements whose scaled value rounds past the format's max."""
    x32 = np.asarray(x).astype(np.float32)
    cast = formats.cast(_scaled(x, scale), fmt).astype(np.float32)
    return int(np.count_nonzero(np.isfinite(x32) & ~np.isfinite(cast)))


def overflow_fraction(x, fmt: str | Format, scale: float = 1.0) -> float:
    """Rule 4, over all elements."""
    return _fraction(overflow_count(x, fmt, scale), np.asarray(x).size)


saturation_fraction = overflow_fraction
"""Rule 4: under a saturating cast the overflowing elements are the saturated ones."""


def underflow_count(x, fmt: str | Format, scale: float = 1.0) -> tuple[int, int]:
    """Rule 5: (finite non-zero elements whose scaled value rounds to ±0, finite non-zero elements)."""
    x32 = np.asarray(x).astype(np.float32)
    live = np.isfinite(x32) & (x32 != 0)
    cast = formats.cast(_scaled(x, scale), fmt).astype(np.float32)
    return int(np.count_nonzero(live & (cast == 0))), int(np.count_nonzero(live))


def underflow_fraction(x, fmt: str | Format, scale: float = 1.0) -> float:
    """Rule 5."""
    return _fraction(*underflow_count(x, fmt, scale))


def flushed_count(reference, observed) -> tuple[int, int]:
    """Rule 6: (non-zero finite reference elements that are ±0 observed, non-zero finite reference elements)."""
    r, o = _f64(reference), _f64(observed)
    if r.shape != o.shape:
        raise ValueError(f"reference has shape {r.shape} but observed has {o.shape}; pass the same tensor of both runs")
    live = np.isfinite(r) & (r != 0)
    return int(np.count_nonzero(live & (o == 0))), int(np.count_nonzero(live))


def flushed_fraction(reference, observed) -> float:
    """Rule 6."""
    return _fraction(*flushed_count(reference, observed))


def nonfinite_fraction(y) -> float:
    """Rule 7: ±inf or NaN elements over all elements."""
    v = _f64(y)
    return _fraction(int(np.count_nonzero(~np.isfinite(v))), v.size)


def subnormal_fraction(y, fmt: str | Format) -> float:
    """Rule 7: elements with 0 < |y| < smallest normal, over all elements."""
    f = get_format(fmt)
    v = np.abs(_f64(y))
    return _fraction(int(np.count_nonzero((v > 0) & (v < f.smallest_normal))), v.size)


def sqnr_db(reference, observed) -> float:
    """Rule 8: 10 log10(sum r^2 / sum (r - o)^2), float64 terms, correctly rounded sums."""
    r, o = _f64(reference).ravel(), _f64(observed).ravel()
    if r.shape != o.shape:
        raise ValueError(f"reference has {r.size} elements but observed has {o.size}")
    if not (np.all(np.isfinite(r)) and np.all(np.isfinite(o))):
        return math.nan
    signal = math.fsum((r * r).tolist())
    noise = math.fsum(((r - o) * (r - o)).tolist())
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def sqnr_bound_db(n: int, value: float) -> float:
    """Rule 8: how far another float64 implementation's SQNR of ``n`` elements may be from
    ``sqnr_db``'s: the two sums' relative errors (n - 1) 2^-53 each, times 10 / ln 10, plus 4
    ULPs of the result (the division, the log and the multiply by 10)."""
    return (10.0 / math.log(10.0)) * 2.0 * max(n - 1, 1) * 2.0**-53 + 4.0 * math.ulp(abs(value))


def _magnitude_neighbours(w: np.ndarray, f: Format) -> tuple[np.ndarray, np.ndarray]:
    """Rule 9's gaps from |w| to the next larger and the next smaller magnitude, float64."""
    width = 8 * f.dtype.itemsize
    pattern = formats.bits(w).astype(np.int64)
    magnitude = pattern & ((1 << (width - 1)) - 1)
    utype = np.dtype(f"uint{width}")

    def decode(m: np.ndarray) -> np.ndarray:
        return _f64(np.clip(m, 0, (1 << (width - 1)) - 1).astype(utype).view(f.dtype))

    here = decode(magnitude)
    below = decode(magnitude - 1)
    above = decode(magnitude + 1)
    gap_up = above - here
    gap_down = here - below
    gap_up = np.where(np.isfinite(gap_up), gap_up, gap_down)  # ±max outward: the spacing below max
    zero = magnitude == 0
    gap_up = np.where(zero, f.smallest_subnormal, gap_up)
    gap_down = np.where(zero, f.smallest_subnormal, gap_down)
    return gap_up, gap_down


def lost_update_count(weight, update, fmt: str | Format) -> tuple[int, int]:
    """Rule 9: (entries whose update rounds away, entries with a finite non-zero update)."""
    f = get_format(fmt)
    w = np.asarray(weight)
    if w.dtype != f.dtype:
        raise ValueError(f"weight must have dtype {f.dtype} for {f.name}, got {w.dtype}")
    u = _f64(update)
    if u.shape != w.shape:
        raise ValueError(f"update has shape {u.shape} but weight has {w.shape}")
    w64 = _f64(w)
    live = np.isfinite(u) & (u != 0) & np.isfinite(w64)
    gap_up, gap_down = _magnitude_neighbours(w, f)
    outward = (w64 == 0) | (np.sign(u) == np.sign(w64))
    gap = np.where(outward, gap_up, gap_down)
    lost = live & (np.abs(u) < gap / 2)
    return int(np.count_nonzero(lost)), int(np.count_nonzero(live))


def lost_update_fraction(weight, update, fmt: str | Format) -> float:
    """Rule 9."""
    return _fraction(*lost_update_count(weight, update, fmt))


@dataclass(frozen=True)
class ScaleRange:
    """Rule 10: loss scales 2^low ... 2^high keep the gradient representable (None: unbounded)."""

    low: int | None
    high: int | None

    @property
    def works(self) -> bool:
        return self.low is None or self.high is None or self.low <= self.high


def applied_lost_count(before, after, exact) -> tuple[int, int]:
    """Rule 12: (lost, counted): entries whose exact update is finite and non-zero, and of
    them those whose stored bits did not change."""
    b, a = np.asarray(before), np.asarray(after)
    if b.shape != a.shape or b.dtype != a.dtype:
        raise ValueError(
            f"before {b.dtype}{list(b.shape)} and after {a.dtype}{list(a.shape)} must be one "
            "parameter's stored values: same dtype and shape"
        )
    e = _f64(exact)
    if e.shape != b.shape:
        raise ValueError(f"exact update shape {list(e.shape)} differs from the parameter's {list(b.shape)}")
    counted = np.isfinite(e) & (e != 0)
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[b.dtype.itemsize]
    same = b.reshape(-1).view(width) == a.reshape(-1).view(width)
    lost = counted.reshape(-1) & same
    return int(lost.sum()), int(counted.sum())


def applied_lost_fraction(before, after, exact) -> float:
    """Rule 12: the fraction of counted entries whose update was lost."""
    return _fraction(*applied_lost_count(before, after, exact))


def scale_range(grad, fmt: str | Format, keep: float = 0.999) -> ScaleRange:
    """Rule 10."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be in (0, 1], got {keep!r}")
    f = get_format(fmt)
    g = np.abs(_f64(grad)).ravel()
    g = g[np.isfinite(g) & (g != 0)]
    if g.size == 0:
        return ScaleRange(None, None)
    top = float(g.max())
    high = math.floor(math.log2(f.max / top))
    while math.ldexp(top, high + 1) <= f.max:
        high += 1
    while math.ldexp(top, high) > f.max:
        high -= 1
    needed = math.ceil(keep * g.size)
    t = float(np.sort(g)[::-1][needed - 1])  # the needed-th largest magnitude must survive
    half = f.smallest_subnormal / 2
    low = math.ceil(math.log2(half / t))
    while math.ldexp(t, low - 1) > half:
        low -= 1
    while math.ldexp(t, low) <= half:
        low += 1
    return ScaleRange(low, high)


def combine_scale_ranges(ranges: Iterable[ScaleRange]) -> ScaleRange:
    """Rule 11: the largest low and the smallest high of those known."""
    ranges = list(ranges)
    lows = [r.low for r in ranges if r.low is not None]
    highs = [r.high for r in ranges if r.high is not None]
    return ScaleRange(max(lows) if lows else None, min(highs) if highs else None)


def _abs_sum(values: np.ndarray) -> float:
    """Rules 13 and 14: the correctly rounded float64 sum of |values| (each term exact)."""
    return math.fsum(np.abs(values).tolist())


def underflow_mass(x, fmt: str | Format, scale: float = 1.0) -> tuple[float, float]:
    """Rule 13: (sum of |x| over rule 5's flushed elements, sum of |x| over the finite elements)."""
    x32 = np.asarray(x).astype(np.float32)
    finite = np.isfinite(x32)
    live = finite & (x32 != 0)
    cast = formats.cast(_scaled(x, scale), fmt).astype(np.float32)
    x64 = x32.astype(np.float64)
    return _abs_sum(x64[live & (cast == 0)]), _abs_sum(x64[finite])


def underflow_mass_fraction(x, fmt: str | Format, scale: float = 1.0) -> float:
    """Rule 13: the share of the finite L1 mass that the scaled cast flushes to ±0."""
    lost, total = underflow_mass(x, fmt, scale)
    return lost / total if total else 0.0


def flushed_mass(reference, observed) -> tuple[float, float]:
    """Rule 14: (sum of |reference| over rule 6's flushed elements, sum over its finite elements)."""
    r, o = _f64(reference), _f64(observed)
    if r.shape != o.shape:
        raise ValueError(f"reference has shape {r.shape} but observed has {o.shape}; pass the same tensor of both runs")
    finite = np.isfinite(r)
    live = finite & (r != 0)
    return _abs_sum(r[live & (o == 0)]), _abs_sum(r[finite])


def flushed_mass_fraction(reference, observed) -> float:
    """Rule 14: the share of the reference's finite L1 mass that is ±0 in the observed run."""
    lost, total = flushed_mass(reference, observed)
    return lost / total if total else 0.0


def mass_fraction_bound(n: int, value: float) -> float:
    """Rule 15: the distance another float64 implementation's rule 13/14 fraction may have."""
    return value * (2.0 * max(n - 1, 1) * 2.0**-53 + 2.0**-52)
