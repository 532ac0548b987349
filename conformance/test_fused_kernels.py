"""`reference.optim._common` rule 7: the fused multiply-add of torch's native float32 kernels.

``fma32(a, b, c)`` must be ``a * b + c`` computed exactly and rounded once to float32. Its fast
path rounds twice (the float64 sum, then float32), which is wrong exactly where the float64 sum
lands on a float32 rounding boundary; these tests hold it to an independent computation: the
exact value as a ``fractions.Fraction``, rounded to float32 (nearest, ties to even, subnormals,
overflow) by hand here. The cases are the ones the fast path can get wrong: the double-rounding
hazard (the exact sum a hair off a float32 midpoint, the float64 sum on it), exact midpoints,
float32-subnormal results, 0-d operands, broadcast scalars, inf and NaN. ``add_fused``,
``addcmul_fused`` and ``lerp_fused`` are held to their rule 7 formulas over that exact fma, and,
on this machine's kernels, torch's ``add``, ``addcmul`` and ``lerp`` to the spec: the fused
functions on native kernels, rules 1, 2 and 4 on the scalar ones.

Mutants killed (``conformance.mutations``): ``fma32`` without its fix-up (plain float64, then
float32), ``addcmul_fused`` and ``lerp_fused`` rounding their product.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.assertions import Where, assert_same
from conformance.bridge import to_numpy, to_torch
from reference.optim._common import (NATIVE_KERNELS, add, add_fused, addcmul, addcmul_fused, fma32, lerp,
                                     lerp_fused)

F32 = np.float32
U = 2.0**-23  # float32's epsilon: the spacing of [1, 2)
_MIN_EXP = -126  # float32's smallest normal exponent
_MANT = 23


def round_to_f32(q: Fraction) -> float:
    """The float32 nearest to the exact ``q`` (ties to even; subnormal spacing 2**-149 below
    2**-126; inf from the midpoint between the largest float32 and 2**128 up), as a float.
    ``q`` is nonzero."""
    sign, m = (-1 if q < 0 else 1), abs(q)
    e = m.numerator.bit_length() - m.denominator.bit_length()  # 2**e <= m < 2**(e+1) after the fix-up
    if Fraction(2) ** e > m:
        e -= 1
    quantum = Fraction(2) ** (max(e, _MIN_EXP) - _MANT)
    n = m / quantum
    whole = n.numerator // n.denominator
    rest = n - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2 == 1):
        whole += 1
    value = whole * quantum
    if value >= Fraction(2) ** 128:
        return sign * float("inf")
    return sign * float(value)


def exact_fma(a, b, c) -> np.ndarray:
    """``a * b + c`` elementwise, exact, rounded once to float32 by `round_to_f32`. Non-finite
    operands and exact zeros take float64's result, which is then exact (a float32 product is
    exact in float64, and so is a sum that is 0 or has an infinite or NaN operand)."""
    a, b, c = np.broadcast_arrays(*(np.asarray(v, F32) for v in (a, b, c)))
    out = np.empty(a.shape, F32)
    with np.errstate(all="ignore"):
        for i in np.ndindex(a.shape):
            x, y, z = float(a[i]), float(b[i]), float(c[i])
            if not (np.isfinite(x) and np.isfinite(y) and np.isfinite(z)):
                out[i] = F32(x * y + z)
                continue
            q = Fraction(x) * Fraction(y) + Fraction(z)
            out[i] = F32(x * y + z) if q == 0 else F32(round_to_f32(q))
    return out


def naive_fma(a, b, c) -> np.ndarray:
    """The fast path alone: the float64 sum rounded to float32 (two roundings)."""
    with np.errstate(all="ignore"):
        return (np.asarray(a, F32).astype(np.float64) * np.asarray(b, F32) + np.asarray(c, F32)).astype(F32)


def _check(a, b, c, what: str) -> np.ndarray:
    expected = exact_fma(a, b, c)
    assert_same(fma32(a, b, c), expected, Where("fma32", field=what))
    return expected


def test_round_to_f32_is_numpys_rounding_where_one_rounding_suffices():
    """The hand rounding itself, against NumPy's float64 -> float32 cast of values that are
    exactly float64 (one rounding then): normal, subnormal, midpoints and overflow."""
    values = [1 + 2**-24, 1 + 3 * 2**-24, 2**-149 * 1.5, 2**-149 * 2.5, 2**-149 * 0.5, 2**-150 * 1.0000001,
              2**-127 * 3, float(np.finfo(F32).max) * (1 + 2**-24), float(np.finfo(F32).max) * (1 + 2**-25),
              -1.7e-39, 3.4e38, -5.5]
    with np.errstate(over="ignore"):  # the cast's overflow to inf is the point
        for v in values:
            assert round_to_f32(Fraction(v)) == float(F32(v)), v


def test_the_double_rounding_hazard_is_rounded_once():
    """``a = (1 + 2**-23) * 2**-24``, ``b = ±(1 ± 2**-23)``: ``a * b`` is ``±2**-24 ± 2**-70``, so
    ``c + a * b`` for ``c`` in [1, 2) lies 2**-70 off a float32 midpoint and its float64 sum on
    it: rounded once, to the float32 on the exact value's side; twice, to the even neighbour."""
    a = F32((1 + U) * 2**-24)
    cs = np.asarray([1 + k * U for k in range(0, 64)] + [2 - k * U for k in range(1, 64)], F32)
    for b in (1 + U, 1 - U, -(1 + U), -(1 - U)):
        for sign in (1, -1):
            _check(a, F32(sign * b), sign * cs, f"c in [1, 2), b = {b!r}, sign {sign}")
    # The hazard is real: two roundings differ from one on these elements (the test has teeth).
    minus = exact_fma(a, F32(1 - U), cs)
    assert (naive_fma(a, F32(1 - U), cs) != minus).sum() >= 60
    plus = exact_fma(a, F32(-(1 - U)), cs)
    assert (naive_fma(a, F32(-(1 - U)), cs) != plus).sum() >= 60


def test_exact_midpoints_round_to_even():
    """An exact sum on a float32 midpoint (``c + 2**-24`` for ``c`` in [1, 2), and below 2**-126
    ``k * 2**-149 + 2**-150``) goes to the even neighbour: no fix-up may move it."""
    cs = np.asarray([1 + k * U for k in range(64)], F32)
    expected = _check(F32(2**-24), F32(1), cs, "c + 2**-24")
    assert np.array_equal(expected, np.where(np.arange(64) % 2 == 0, cs, np.nextafter(cs, F32(2))))
    tiny = np.asarray([k * 2**-149 for k in range(-20, 21)], F32)
    _check(F32(2**-75), F32(2**-75), tiny, "k * 2**-149 + 2**-150")


def test_float32_subnormal_results_are_rounded_once():
    """Results below 2**-126, where float32's boundaries lie above float64's 53 bits of the sum:
    constructed hazards (a product ``2**-150 ± 2**-196`` beside odd multiples of 2**-149) and
    random products of about 2**-150 to 2**-126 beside random subnormal and tiny normal ``c``."""
    a, b = F32((1 + U) * 2**-75), F32((1 - U) * 2**-75)
    odd = np.asarray([k * 2**-149 for k in range(-41, 42, 2)], F32)
    _check(a, b, odd, "2**-150 - 2**-196 beside odd multiples of 2**-149")
    _check(a, -b, odd, "-2**-150 + 2**-196 beside odd multiples of 2**-149")
    # Sums the float64 rounds: ``c`` an odd multiple of 2**-149 near 2**-126 (float64's spacing
    # there about 2**-179) and a product 2**-150 - 2**-190, whose float64 sum lands on the
    # midpoint above ``c`` (its low 29 bits not the normal boundary's pattern).
    a, b = F32((1 - 2.0**-20) * 2**-75), F32((1 + 2.0**-20) * 2**-75)
    high = np.asarray([k * 2**-149 for k in range(2**23 - 1, 2**23 - 200, -2)], F32)
    for sign in (1, -1):
        expected = _check(a, F32(sign) * b, sign * high,
                          f"{sign} * (2**-150 - 2**-190) beside odd multiples near 2**-126")
        # The hazard is real: two roundings are wrong on every element.
        assert (naive_fma(a, F32(sign) * b, sign * high) != expected).all()
    rng = np.random.default_rng(3)
    n = 4000
    x = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-80, -60, n) * rng.choice([-1, 1], n)).astype(F32)
    y = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-80, -60, n)).astype(F32)
    c = (rng.integers(-2**23, 2**23, n) * 2.0**-149 * rng.choice([1.0, 1e-3], n)).astype(F32)
    expected = _check(x, y, c, "random subnormal results")
    assert (np.abs(expected) < np.finfo(F32).tiny).sum() > n // 2  # mostly subnormal indeed


@given(st.integers(0, 2**32 - 1), st.sampled_from([(), (1,), (7,), (16,), (17,), (3, 5)]))
def test_random_operands_match_the_exact_fma(seed, shape):
    """Random float32 operands of every scale, with ``c`` near ``-a * b`` on some elements
    (cancellation), 0-d included."""
    rng = np.random.default_rng(seed)

    def draw() -> np.ndarray:
        return (rng.standard_normal(shape) * 2.0 ** rng.integers(-30, 30, shape)).astype(F32)

    a, b = draw(), draw()
    c = np.where(rng.random(shape) < 0.3, -(a.astype(np.float64) * b) * (1 + rng.integers(-3, 4, shape) * U),
                 draw()).astype(F32)
    out = fma32(a, b, c)
    assert out.shape == shape and out.dtype == F32
    assert_same(out, exact_fma(a, b, c), Where("fma32", field=f"random operands, shape {shape}"))


def test_zero_d_operands_and_broadcast_scalars():
    """0-d arrays and NumPy scalars give a 0-d float32 result; a scalar beside arrays broadcasts
    in any position, and so do shapes (3, 1) and (1, 4); signs of exact zeros are IEEE's."""
    a, b, c = F32((1 + U) * 2**-24), F32(1 - U), F32(1 + U)
    out = fma32(np.asarray(a), np.asarray(b), np.asarray(c))
    assert out.shape == () and out.dtype == F32 and out == F32(1 + U)  # two roundings give 1 + 2**-22
    assert fma32(a, b, c).shape == ()
    rng = np.random.default_rng(5)
    v = (rng.standard_normal(33) * 4).astype(F32)
    for args in ((a, v, v), (v, a, v), (v, v, c), (a, b, v), (a, v, c), (v, b, c)):
        out = _check(*args, "a scalar beside arrays")
        assert out.shape == (33,)
    out = _check(v[:3].reshape(3, 1), v[3:7].reshape(1, 4), v[7:19].reshape(3, 4), "(3, 1) by (1, 4)")
    assert out.shape == (3, 4)
    assert _check(v[:3].reshape(3, 1), v[3:7].reshape(1, 4), c, "(3, 1) by (1, 4) plus a scalar").shape == (3, 4)
    zeros = _check(np.asarray([0.0, -0.0, 0.0, -0.0, 2.0], F32), np.asarray([1.0, 1.0, -1.0, -1.0, 0.5], F32),
                   np.asarray([0.0, -0.0, -0.0, 0.0, -1.0], F32), "exact zeros")
    assert list(np.signbit(zeros)) == [False, True, True, False, False]


def test_inf_and_nan_are_ieees():
    """Infinite and NaN operands, ``inf * 0`` and ``inf - inf`` (NaN), and overflow: at or past
    the midpoint between the largest float32 and 2**128 the result is inf, below it the largest."""
    big, inf, nan = np.finfo(F32).max, F32(np.inf), F32(np.nan)
    a = np.asarray([inf, inf, 1.0, nan, 2.0, -inf, 2.0**64, 2.0**64, 1.0, 1.0], F32)
    b = np.asarray([1.0, 0.0, 1.0, 1.0, nan, 2.0, 2.0**64, -(2.0**64), 1.0, 2.0**103], F32)
    c = np.asarray([1.0, 1.0, -inf, 1.0, 1.0, inf, 0.0, 0.0, nan, big], F32)
    expected = _check(a, b, c, "inf and NaN operands")
    assert np.array_equal(np.isnan(expected), [False, True, False, True, True, True, False, False, True, False])
    assert list(expected[[0, 2, 6, 7, 9]]) == [inf, -inf, inf, -inf, inf]
    below = _check(F32(1), F32(2.0**103 * (1 - 2 * U)), big, "just below the overflow midpoint")
    assert below == big


def _operands(seed: int, n: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple((rng.standard_normal(n) * 2.0 ** rng.integers(-8, 8, n)).astype(F32) for _ in range(3))


@pytest.mark.parametrize("n", [1, 7, 16, 33, 100])
def test_add_addcmul_and_lerp_fused_are_their_formulas_over_one_rounding(n):
    """Rule 7's three operations over the exact fma: ``add(x, y, alpha)`` is ``fma(f(alpha), y,
    x)`` (``x + y`` at alpha 1); ``addcmul(x, a, b, v)`` is ``fma(f(f(v) * a), b, x)``;
    ``lerp(x, y, w)`` is ``fma(w, f(y - x), x)`` when ``|w| < 0.5``, ``fma(-f(y - x), f(1 - w),
    y)`` otherwise, and at ``w = 1`` ``fma(w - 1, f(y - x), y)`` on the 64-byte head (signs of
    zero). Each must also differ from its unfused rule somewhere (the operands are not trivial)."""
    x, y, z = _operands(n, n)
    with np.errstate(all="ignore"):
        for alpha in (0.1, -0.001, 3.0):
            assert_same(add_fused(x, y, alpha), exact_fma(F32(alpha), y, x), Where("add_fused", field=f"alpha {alpha}"))
        assert_same(add_fused(x, y, 1.0), x + y, Where("add_fused", field="alpha 1"))
        for v in (1.0, 1 - 0.999, -0.3):
            assert_same(addcmul_fused(x, y, z, v), exact_fma(F32(v) * y, z, x), Where("addcmul_fused", field=f"value {v}"))
        diff = y - x
        for w in (0.1, 1 - 0.9, -0.49, 0.5, 0.7, 1 - 0.3):
            f = F32(w)
            expected = exact_fma(f, diff, x) if abs(f) < 0.5 else exact_fma(-diff, F32(1) - f, y)
            assert_same(lerp_fused(x, y, w), expected, Where("lerp_fused", field=f"weight {w}"))
        head = n - n % 16
        at_one = exact_fma(-diff, F32(0), y)
        at_one[:head] = exact_fma(F32(0), diff[:head], y[:head])
        assert_same(lerp_fused(x, y, 1.0), at_one, Where("lerp_fused", field="weight 1"))
    if n >= 33:
        assert not np.array_equal(addcmul_fused(x, y, z, 0.3), addcmul(x, y, z, 0.3))
        assert not np.array_equal(lerp_fused(x, y, 0.1), lerp(x, y, 0.1))


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 100, 1000])
def test_torch_kernels_on_this_machine_round_as_the_spec_says(n, device):
    """On this machine's CPU kernels, torch's float32 ``add(alpha)``, ``addcmul`` and ``lerp``
    (Adam's three) against the spec: on native kernels (``NATIVE_KERNELS``) the fused functions
    of rule 7, on the scalar kernels (``DEFAULT``) rules 1, 2 and 4, bit for bit."""
    if device != "cpu":
        pytest.skip(f"rule 7 states the CPU's kernels, not {device}'s")
    native = torch.backends.cpu.get_cpu_capability() in NATIVE_KERNELS
    x, y, z = _operands(1000 + n, n)
    tx, ty, tz = (to_torch(v, "cpu") for v in (x, y, z))
    where = Where(f"torch on {torch.backends.cpu.get_cpu_capability()}, n={n}")
    with np.errstate(all="ignore"):
        for alpha in (0.05, -0.01):
            spec = add_fused(x, y, alpha) if native else add(x, y, alpha)
            assert_same(to_numpy(tx.add(ty, alpha=alpha)), spec, where.at(f"add alpha {alpha}"))
        for v in (1.0, 1 - 0.999):
            spec = addcmul_fused(x, y, z, v) if native else addcmul(x, y, z, v)
            assert_same(to_numpy(tx.addcmul(ty, tz, value=v)), spec, where.at(f"addcmul value {v}"))
        for w in (0.1, 0.7, 1.0):
            spec = lerp_fused(x, y, w) if native else lerp(x, y, w)
            assert_same(to_numpy(tx.lerp(ty, w)), spec, where.at(f"lerp weight {w}"))
