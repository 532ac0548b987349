"""Comparing torch's arrays with the specification's: bit for bit, or within a bound in ULPs.

NaN compares as a class; a bound is in ULPs of the value, or of ``x_abs`` (the formula evaluated
on magnitudes) where an update cancels to near zero. Pure NumPy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Comparison", "compare", "ulp_distance"]

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_SINT = {2: np.int16, 4: np.int32, 8: np.int64}


def _bits_hex(x: Any) -> str:
    a = np.asarray(x)
    view = _UINT.get(a.dtype.itemsize)
    return f"{int(a.view(view)):#0{2 + 2 * a.dtype.itemsize}x}" if view is not None else "?"


def _ordinals(x: np.ndarray) -> np.ndarray:
    """Each float's position on the number line (adjacent floats 1 apart, +0 and -0 both 0), as float64."""
    s = x.view(_SINT[x.dtype.itemsize]).astype(np.int64)
    mag = s & np.int64((1 << (8 * x.dtype.itemsize - 1)) - 1)
    return np.where(s < 0, -mag, mag).astype(np.float64)


@dataclass
class Comparison:
    """``problem`` None when the arrays agree at the bound; else the first mismatch described, with
    its two values. ``worst``: the largest distance among the elements that agree (ULPs)."""

    problem: str | None
    worst: float = 0.0
    expected: Any = None
    got: Any = None


def _screen(g: np.ndarray, e: np.ndarray, gi: np.ndarray, ei: np.ndarray, bound: int) -> tuple[np.ndarray, float, bool]:
    """Whole-array passes over flat ``g`` and ``e`` (``gi``, ``ei``: their bits as signed integers):
    the flat indices the element-wise check must look at, the largest ULP distance among the
    others, which agree, and whether every value was seen to be finite.

    At ``bound`` 0 the pairs whose bits differ. Otherwise none where every pair has the same bits;
    else the pairs not plainly within ``bound // 2``
    ULPs: the difference of the bit patterns, wrapping in their integer type, has a magnitude of
    at most ``bound // 2``, and both values are finite. For two finite values that magnitude is
    their ULP distance: exactly so for one sign; for opposite signs the true difference lies
    between 1 and 2**bits - 1, and a wrapped magnitude within ``bound // 2`` needs a pattern within
    ``bound // 2`` below the sign bit (a NaN) or below all ones (a negative NaN).
    """
    if bound == 0:
        return (_NO_INDEX, 0.0, False) if np.array_equal(gi, ei) else (np.flatnonzero(gi != ei), 0.0, False)
    half = bound // 2
    d = np.subtract(gi, ei)
    np.abs(d, out=d)  # the most negative difference stays negative: the unsigned view makes it huge
    du = d.view(_UINT[g.dtype.itemsize])
    worst = int(du.max(initial=0))
    if worst == 0:  # the same bits (about half the arrays of a step): nothing more to look at
        return _NO_INDEX, 0.0, False
    if _all_finite(g, e):
        if worst <= half:
            return _NO_INDEX, float(worst), True
        idx = np.flatnonzero(du > half)
        finite = True
    else:
        near = du <= half
        near &= np.isfinite(g)
        near &= np.isfinite(e)
        idx = np.flatnonzero(~near)
        finite = False
    du[idx] = 0  # our own scratch: the largest distance left is that of the pairs that agree
    return idx, float(du.max(initial=0)), finite


_NO_INDEX = np.zeros(0, np.intp)


def _all_finite(g: np.ndarray, e: np.ndarray) -> bool:
    """Whether every value of flat ``g`` and ``e`` (one dtype) is finite, as one pass with no array
    made: for float32 and float64 their dot product (an inf or a NaN in either makes its term inf
    or NaN, inf times 0 included, and no sum with such a term is finite); finite arrays whose
    dot product overflows are answered False, which only sends the caller down the path that
    checks each element. Other dtypes: ``isfinite``. Inside an ``errstate``: entering it costs
    about what a dot product of a small parameter's elements does, and the replay compares a
    hundred arrays a step."""
    with np.errstate(over="ignore", invalid="ignore"):
        if g.dtype == np.float32 or g.dtype == np.float64:
            return math.isfinite(float(np.dot(g, e)))
        return bool(np.isfinite(g).all() and np.isfinite(e).all())


def _distances(g: np.ndarray, e: np.ndarray, idx: np.ndarray, bound: int, x_abs: Any, finite: Any) -> np.ndarray:
    """The distances of the pairs at flat indices ``idx`` (values ``g``, ``e``): in ULPs of the values,
    and in ULPs of ``x_abs`` for those more than ``bound // 2`` apart where ``x_abs`` is given;
    0 where ``finite`` (a mask; None: all are) is False."""
    dist = np.abs(_ordinals(g) - _ordinals(e))
    if finite is not None:
        dist = np.where(finite, dist, 0.0)
    if x_abs is None:
        return dist
    far = dist > bound // 2
    if finite is not None:
        far &= finite
    if far.any():
        sub = idx[far]
        xa = np.abs(x_abs(sub) if callable(x_abs) else np.asarray(x_abs, np.float64).reshape(-1)[sub])
        unit = np.maximum(np.spacing(xa.astype(g.dtype)).astype(np.float64), float(np.finfo(g.dtype).smallest_subnormal))
        dist[far] = np.abs(g[far].astype(np.float64) - e[far].astype(np.float64)) / unit
    return dist


def compare(got: np.ndarray, expected: np.ndarray, bound: int, x_abs: Any = None, at: Any = None) -> Comparison:
    """``got`` against ``expected``: bit for bit (``bound`` 0), else within ``bound`` ULPs of the
    value, or of ``x_abs`` when given (an array, or a function of flat indices returning the
    magnitudes there). NaN compares as a class. ``at``: for arrays of sampled elements
    (`audit.sampling`), ``(flat indices, shape)`` of the tensor they were taken from, so that a
    mismatch is named at its index there.

    Work goes only where it is needed: the bits first; then the ULP distance of the values that
    differ; ``x_abs`` only for those more than ``bound // 2`` ULPs apart. That is safe because
    ``x_abs`` is at least the result's magnitude (the triangle inequality: the formula on
    magnitudes bounds the formula's value), so one ULP of ``x_abs`` is at least half an ULP of
    either value, and ``bound // 2`` ULPs of the values are within ``bound`` ULPs of ``x_abs``.
    """
    got = np.asarray(got)
    expected = np.asarray(expected)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return Comparison(f"shape/dtype {got.shape} {got.dtype} against the spec's {expected.shape} "
                          f"{expected.dtype}", math.inf)
    gflat, eflat = got.reshape(-1), expected.reshape(-1)
    gi, ei = gflat.view(_SINT[got.dtype.itemsize]), eflat.view(_SINT[got.dtype.itemsize])
    idx, fast_worst, all_finite = _screen(gflat, eflat, gi, ei, bound)
    if idx.size == 0:
        return Comparison(None, fast_worst)
    g, e = gflat[idx], eflat[idx]
    with np.errstate(invalid="ignore", over="ignore"):
        if all_finite and bound:  # every value finite (the screen saw it): the distances alone decide
            dist = _distances(g, e, idx, bound, x_abs, None)
            bad = dist > bound
        else:
            g_nan, e_nan = np.isnan(g), np.isnan(e)
            finite = np.isfinite(g) & np.isfinite(e)
            dist = np.where(g_nan & e_nan, 0.0, math.inf) if bound == 0 else _distances(g, e, idx, bound, x_abs,
                                                                                        finite)
            bad = np.where(g_nan | e_nan, g_nan != e_nan, np.where(finite, dist > bound, g != e))
    good = dist[~bad]
    worst = max(fast_worst, float(good.max()) if good.size else 0.0)
    if not bad.any():
        return Comparison(None, worst)
    k = int(np.argmax(bad))
    flat, shape = (idx[k], got.shape) if at is None else (at[0][idx[k]], at[1])
    i = [int(v) for v in np.unravel_index(flat, shape)] if len(shape) else []
    unit_text = "" if bound == 0 else (f", {dist[k]:.1f} ULP{' of x_abs' if x_abs is not None else ''} apart "
                                       f"(bound {bound})")
    of = f"{got.size} elements" if at is None else f"{got.size} sampled elements (of {math.prod(at[1])})"
    return Comparison(f"{int(bad.sum())} of {of} differ; first at index {i}: torch {float(g[k])!r} "
                      f"({_bits_hex(g[k])}), spec {float(e[k])!r} ({_bits_hex(e[k])}){unit_text}",
                      math.inf, float(e[k]), float(g[k]))




_compare = compare


def ulp_distance(got: np.ndarray, expected: np.ndarray) -> float:
    """The largest ULP distance between two finite arrays of one float dtype (inf where a value
    is not finite in one and finite in the other, or the NaN classes differ)."""
    g, e = np.asarray(got).reshape(-1), np.asarray(expected).reshape(-1)
    if g.shape != e.shape or g.dtype != e.dtype or g.dtype.kind != "f":
        return math.inf
    gn, en = np.isnan(g), np.isnan(e)
    if (gn != en).any():
        return math.inf
    fin = np.isfinite(g) & np.isfinite(e)
    if ((g != e) & ~fin & ~gn).any():
        return math.inf
    if not fin.any():
        return 0.0
    return float(np.abs(_ordinals(g[fin]) - _ordinals(e[fin])).max())
