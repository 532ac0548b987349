"""Hypothesis strategies of the float8 properties (conformance/test_fp8.py).

Values are drawn as bit patterns, never as floats cast down: an array's sign, exponent field and
mantissa bits are chosen, then viewed as the dtype, so torch and the spec get the same bits and
ties, subnormals, infinities and NaN payloads arrive as drawn. The bulk of an array comes from a
NumPy generator seeded by Hypothesis (drawing hundreds of elements one by one would make the
properties slow); the regime (which exponents, which special values) is drawn by Hypothesis.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from reference import fp8

BF16 = np.dtype(ml_dtypes.bfloat16)
# (total bits, mantissa bits, exponent field of 1.0) of the high-precision source dtypes.
_LAYOUT = {np.dtype(np.float32): (32, 23, 127), BF16: (16, 7, 127), np.dtype(np.float64): (64, 52, 1023)}


def patterns(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...],
             exponent_fields: tuple[int, int] | None = None) -> np.ndarray:
    """Random bit patterns of ``dtype``: any bits, or a random sign and mantissa with the
    exponent field drawn in ``exponent_fields`` (inclusive; 0 gives subnormals)."""
    dtype = np.dtype(dtype)
    width, mant, _ = _LAYOUT[dtype]
    uint = np.dtype(f"uint{width}")
    raw = rng.integers(0, 2**63, size=shape, dtype=np.uint64, endpoint=False)
    raw = raw ^ (rng.integers(0, 2**63, size=shape, dtype=np.uint64) << np.uint64(1))
    if exponent_fields is None:
        return (raw >> np.uint64(64 - width)).astype(uint).view(dtype) if width < 64 else raw.view(dtype)
    lo, hi = exponent_fields
    exp = rng.integers(lo, hi + 1, size=shape, dtype=np.uint64)
    sign = rng.integers(0, 2, size=shape, dtype=np.uint64)
    bits = (sign << np.uint64(width - 1)) | (exp << np.uint64(mant)) | (raw & np.uint64((1 << mant) - 1))
    return bits.astype(uint).view(dtype)


def _plant(rng: np.random.Generator, x: np.ndarray, values: list[float], count: int) -> np.ndarray:
    flat = x.reshape(-1).copy()
    where = rng.integers(0, flat.size, size=count)
    flat[where] = np.asarray(rng.choice(values, size=count), np.float64).astype(x.dtype)
    return flat.reshape(x.shape)


REGIMES = ("any bits", "normal window", "subnormals", "below 1e-12", "huge", "zeros", "near a power-of-two scale")


@st.composite
def quantize_input(draw, dtype: np.dtype, fmt: str) -> tuple[np.ndarray, str]:
    """A 2-d array to quantize, and the name of its regime (for Hypothesis' statistics).

    Regimes: any bit pattern (NaN and inf included); a window of exponents anywhere in the
    range; subnormals only; magnitudes below 1e-12 (amax clamped); huge magnitudes near the
    dtype's max; signed zeros; and an amax planted a few ULPs above fp8_max * 2^-k, where the
    scale lies just below a power of two and rule 4's float32 log2 decides; for float64, values
    beyond float32's max (inf once rounded, while the scale stays nonzero). Sometimes with
    planted zeros, infinities, NaN and subnormals.
    """
    dtype = np.dtype(dtype)
    _, mant, one = _LAYOUT[dtype]
    emax = 2 * one
    shape = (draw(st.integers(1, 8)), draw(st.integers(1, 16)))
    regime = draw(st.sampled_from(REGIMES + (("beyond float32",) if dtype == np.float64 else ())))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if regime == "any bits":
        x = patterns(rng, dtype, shape)
    elif regime == "normal window":
        lo = draw(st.integers(1, emax))
        x = patterns(rng, dtype, shape, (lo, min(lo + draw(st.integers(0, 8)), emax)))
    elif regime == "subnormals":
        x = patterns(rng, dtype, shape, (0, 0))
    elif regime == "below 1e-12":
        e12 = one - 40  # 2^-40 ~ 9.1e-13
        x = patterns(rng, dtype, shape, (max(e12 - 1 - draw(st.integers(0, 60)), 0), e12 - 1))
    elif regime == "huge":
        x = patterns(rng, dtype, shape, (emax - draw(st.integers(0, 4)), emax))
    elif regime == "beyond float32":
        # float64 amax above float32's max with a float32 scale that is still nonzero: the
        # elements become inf in float32 and only the saturating cast makes them fp8_max.
        x = patterns(rng, dtype, shape, (one + 120, one + 150))
    elif regime == "zeros":
        x = (np.where(rng.integers(0, 2, shape) == 1, -0.0, 0.0)).astype(dtype)
    else:
        x = patterns(rng, dtype, shape, (one - 12, one - 2))
        k = draw(st.integers(-20, 60))
        target = np.float64(fp8.fp8_max(fmt)) * 2.0**-k
        base = np.asarray(target, dtype).view(f"uint{dtype.itemsize * 8}")
        planted = (base + np.asarray(draw(st.integers(0, 6)), base.dtype)).view(dtype)
        x = (x.astype(np.float64) * (target / 8)).astype(dtype)
        x.reshape(-1)[draw(st.integers(0, x.size - 1))] = planted
    if draw(st.booleans()) and regime != "zeros":
        specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 2.0**-149, -(2.0**-130)]
        x = _plant(rng, x, specials, draw(st.integers(1, 3)))
    return x, regime


@st.composite
def mx_input(draw, dtype: np.dtype) -> np.ndarray:
    """A (rows, 32 * blocks) array for MX scaling: each block its own exponent window, so block
    amaxes cover zeros, subnormals and the whole exponent range; sometimes NaN or inf planted."""
    dtype = np.dtype(dtype)
    _, _, one = _LAYOUT[dtype]
    rows, blocks = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    parts = []
    for _ in range(blocks):
        lo = draw(st.integers(0, 2 * one))
        parts.append(patterns(rng, dtype, (rows, 32), (lo, min(lo + draw(st.integers(0, 6)), 2 * one))))
    x = np.concatenate(parts, axis=1)
    if draw(st.integers(0, 4)) == 0:
        x = _plant(rng, x, [0.0, float("inf"), float("-inf"), float("nan")], draw(st.integers(1, 2)))
    return x


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n // 2 + 1) if n % d == 0 and n // d >= 2]


@st.composite
def leading_axes(draw, min_dim: int = 1, max_rows: int = 24, row_multiple: int = 1) -> tuple[int, ...]:
    """The leading axes of an activation (everything but the features): (M,) for a 2-d input,
    (batch, sequence) for a 3-d one, (batch, heads, sequence) for a 4-d one.

    With ``row_multiple`` > 1 (MX: the flattened rows are blocked in grad_weight) the product
    of the axes, the flattened row count, is ``row_multiple`` or twice that, factored into
    axes of at least 2 each; otherwise each axis lies in [min_dim, a cap] (at most 36 rows).
    """
    rank = draw(st.integers(2, 4))
    if row_multiple == 1:
        caps = {2: (max_rows,), 3: (4, 8), 4: (3, 3, 4)}[rank]
        return tuple(draw(st.integers(min_dim, max(min_dim, cap))) for cap in caps)
    left = row_multiple * draw(st.integers(1, 2))
    axes: list[int] = []
    for _ in range(rank - 2):
        choices = _divisors(left)
        if not choices:
            break
        d = draw(st.sampled_from(choices))
        axes.append(d)
        left //= d
    return (*axes, left)


@st.composite
def linear_case(draw, dtype: np.dtype, max_dim: int = 24, specials: bool = True, min_dim: int = 1, *,
                feature_multiple: int = 1, row_multiple: int = 1) -> dict:
    """x (..., K) in ``dtype`` (2-d, 3-d or 4-d: ``leading_axes``), a float32 weight (N, K) and
    bias (N,), grad_output (..., N) in ``dtype``: each tensor's values from an exponent window
    of its own (its magnitude drawn between 2^-20 and 2^20), sometimes a zero row or a planted
    subnormal, zero or inf. ``feature_multiple`` > 1 draws K and N as one or two times it (the
    dimensions a converted layer takes); ``row_multiple`` constrains the flattened rows."""
    dtype = np.dtype(dtype)
    if feature_multiple > 1:
        k, n = (feature_multiple * draw(st.integers(1, 2)) for _ in range(2))
    else:
        k, n = (draw(st.integers(min_dim, max_dim)) for _ in range(2))
    lead = draw(leading_axes(min_dim, max_dim, row_multiple))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def tensor(dt: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        one = _LAYOUT[np.dtype(dt)][2]
        centre = one + draw(st.integers(-20, 20))
        width = draw(st.integers(0, 6))
        t = patterns(rng, dt, shape, (centre - width, centre + width))
        if specials and draw(st.integers(0, 5)) == 0:
            t = _plant(rng, t, [0.0, -0.0, 2.0**-140, float("inf")], 1)
        return t

    x, go = tensor(dtype, (*lead, k)), tensor(dtype, (*lead, n))
    if specials and draw(st.integers(0, 5)) == 0:
        x.reshape(-1, k)[draw(st.integers(0, int(np.prod(lead)) - 1))] = 0
    return {"x": x, "weight": tensor(np.dtype(np.float32), (n, k)), "bias": tensor(np.dtype(np.float32), (n,)),
            "grad_output": go}


SCALE_BYTE_REGIMES = ("any byte", "near 2^0", "edges of e8m0")


def _scale_bytes(draw, rng: np.random.Generator, shape: tuple[int, ...], regime: str) -> np.ndarray:
    if regime == "any byte":
        b = rng.integers(0, 256, shape)
    elif regime == "near 2^0":
        lo = 127 + draw(st.integers(-20, 16))
        b = rng.integers(lo, lo + draw(st.integers(0, 4)) + 1, shape)
    else:  # 2^-127 (a float32 subnormal), 2^-126, 2^126, 2^127 and the NaN byte
        b = rng.choice(np.array([0, 1, 2, 125, 126, 127, 253, 254, 255]), shape)
    return b.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def _elements(draw, rng: np.random.Generator, elem: str, shape: tuple[int, ...], any_bytes: bool) -> np.ndarray:
    dt = np.dtype(getattr(ml_dtypes, elem))
    if any_bytes and draw(st.booleans()):  # any byte: NaN encodings, subnormals, the largest values
        return rng.integers(0, 256, shape).astype(np.uint8).view(dt)
    exp_bits, man_bits = (4, 3) if elem == "float8_e4m3fn" else (5, 2)
    lo = draw(st.integers(0, 2**exp_bits - 2))
    exp = rng.integers(lo, min(lo + 3, 2**exp_bits - 2) + 1, shape).astype(np.uint8)
    bits = (rng.integers(0, 2, shape).astype(np.uint8) << np.uint8(7)) | (exp << np.uint8(man_bits)) | \
        rng.integers(0, 2**man_bits, shape).astype(np.uint8)
    return bits.astype(np.uint8).view(dt)


@st.composite
def mx_blocks(draw, elem: str, rows: int | None = None, blocks: int | None = None, *,
              finite: bool = False) -> fp8.MXBlocks:
    """An MX tensor as bytes, blocks of 32 along the last axis: element bytes of ``elem`` (any
    byte, NaN encodings included, or an exponent window) and e8m0 scale bytes from a regime
    (any byte, a window near 2^0, the range's edges and the NaN byte 0xff); sometimes whole
    blocks of zeros. ``finite``: element windows only and scales mostly near 2^0 (three cases
    in four), so that most matmuls have finite, nonzero sums to compare."""
    rows = draw(st.integers(1, 6)) if rows is None else rows
    blocks = draw(st.integers(1, 3)) if blocks is None else blocks
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    data = _elements(draw, rng, elem, (rows, 32 * blocks), any_bytes=not finite)
    regimes = ("near 2^0",) * 6 + SCALE_BYTE_REGIMES if finite else SCALE_BYTE_REGIMES
    scale = _scale_bytes(draw, rng, (rows, blocks), draw(st.sampled_from(regimes)))
    if draw(st.integers(0, 3)) == 0:
        zero = rng.random((rows, blocks)) < 0.5
        data = np.where(np.repeat(zero, 32, axis=1), np.zeros((), data.dtype), data).astype(data.dtype)
    return fp8.MXBlocks(data, scale, 32)


@st.composite
def mx_matmul_case(draw, elem: str) -> tuple[fp8.MXBlocks, fp8.MXBlocks]:
    """Two MX operands (M, K) and (N, K) blocked along K with the same K; M, N >= 2 (with a
    size-1 dimension torch's mm takes a vector kernel, another summation order)."""
    blocks = draw(st.integers(1, 3))
    return (draw(mx_blocks(elem, draw(st.integers(2, 8)), blocks, finite=True)),
            draw(mx_blocks(elem, draw(st.integers(2, 8)), blocks, finite=True)))


def _fp8_window(rng: np.random.Generator, shape: tuple[int, ...], lo: int, hi: int, zero_prob: float) -> np.ndarray:
    """e4m3fn bit patterns with the exponent field in [lo, hi] (no subnormals), some zeros."""
    sign = rng.integers(0, 2, shape).astype(np.uint8) << np.uint8(7)
    exp = rng.integers(lo, hi + 1, shape).astype(np.uint8) << np.uint8(3)
    man = rng.integers(0, 8, shape).astype(np.uint8)
    bits = sign | exp | man
    bits = np.where(bits & np.uint8(0x7F) == 0x7F, bits & np.uint8(0xFE), bits)  # 0x7f/0xff are NaN
    bits = np.where(rng.random(shape) < zero_prob, np.uint8(0), bits)
    return bits.astype(np.uint8).view(ml_dtypes.float8_e4m3fn)


@st.composite
def exact_matmul_case(draw, k_one: bool) -> dict:
    """Operands of a scaled matmul whose every summation order gives the exact sum.

    ``k_one``: K = 1 (one product, one rounding) with any e4m3 values. Otherwise K <= 64 and the
    fp8 values' exponent fields lie in windows of width 4 (each value 4 significant bits), so
    each product has 8 significant bits within 8 binades and every partial sum of up to 64 of
    them fits in 8 + 8 + 6 = 22 <= 24 bits; the scales are powers of two, so the pre-scaling is
    exact too (the windows keep everything normal in float32). Tensorwise or rowwise scales;
    ``fast_accum`` drawn too. A rowwise matmul without fast accumulation multiplies unit-scaled
    operands, so there its scales may be any float32 values and the sum stays exact: the
    bfloat16 post-scale (rule 9) then rounds twice, which a single rounding cannot imitate.
    """
    m, n = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    k = 1 if k_one else draw(st.integers(2, 64))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rowwise = draw(st.booleans())
    fast_accum = draw(st.booleans())
    any_scale = k_one or (rowwise and not fast_accum)
    if k_one:
        qa = rng.integers(0, 256, (m, k)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
        qb = rng.integers(0, 256, (k, n)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    else:
        la, lb = draw(st.integers(1, 11)), draw(st.integers(1, 11))
        qa = _fp8_window(rng, (m, k), la, la + 3, 0.1)
        qb = _fp8_window(rng, (k, n), lb, lb + 3, 0.1)

    def scales(shape: tuple[int, ...]) -> np.ndarray:
        if any_scale:
            return np.exp2(rng.uniform(-40, 40, shape)).astype(np.float32)  # any float32 scale
        return np.exp2(rng.integers(-30, 31, shape).astype(np.float64)).astype(np.float32)

    sa = scales((m, 1) if rowwise else ())
    sb = scales((1, n) if rowwise else ())
    return {"qa": qa, "qb": qb, "sa": sa, "sb": sb, "rowwise": rowwise, "fast_accum": fast_accum}
