"""Scaled float8 training: how values are scaled into float8, multiplied and scaled back.

Rules 1-10 are torchao 0.18's float8 training (``torchao.float8``) as torch computes it on the
CPU; rules 11-12 are torchao's MX block scaling; rules 13-15 state, as pure state machines that
no production path here runs, Transformer Engine's delayed and current scaling and DeepSeek-V3's
block quantization. A scale ``s`` multiplies a high-precision value into float8 range
(``q = fp8(x * s)``); the matmul multiplies by its reciprocal.

1. Formats. e4m3 (float8_e4m3fn, max 448) holds inputs and weights, e5m2 (float8_e5m2, max
   57344) gradients in the tensorwise recipe; the rowwise recipes use e4m3 for all three. The
   fnuz variants have max 240 (e4m3fnuz) and 57344 (e5m2fnuz).
2. amax is max |x| over the whole tensor (tensorwise) or along one axis, kept as a size-1 axis
   (axiswise). It is exact in the input's dtype; a NaN anywhere in the reduced set makes it NaN.
3. The scale is s = f32(fp8_max / max(f64(amax), 1e-12)): the clamp and the division in float64,
   one rounding to float32. amax below 1e-12 (zeros, subnormals) gives fp8_max * 1e12
   (4.48e14 for e4m3fn); amax = inf gives 0; NaN gives NaN. For a float32 or bfloat16 amax the
   float64 quotient rounds to the float32 quotient (53 >= 2 * 24 + 2: double rounding is then
   innocuous, Figueroa 1995); it matters for float64 inputs, whose amax is not rounded first.
4. The power-of-two option (default of the rowwise recipes) is s = exp2(floor(log2(s))) with
   log2 taken in float32. That is not an exact floor: for s a few ULPs below 2^k, float32 log2
   rounds up to k and s becomes 2^k, twice the exact floor 2^(k-1); then amax * s can exceed
   fp8_max and the largest elements saturate.
5. The cast saturates: q = fp8(clamp(f32(f32(x) * s), -fp8_max, fp8_max)), round to nearest
   even. NaN stays NaN; with s = 0 finite values become 0 and infinities NaN (inf * 0).
6. Each matmul operand is pre-scaled: A' = f32(f32(q) * f32(1 / s)), a float32 reciprocal then
   a float32 multiply (exact when s is a power of two and nothing underflows).
7. The scaled matmul is C = out(sum_k A'[i,k] B'[k,j]), the sums in float32 in an order left
   unspecified, rounded once to the output dtype; the spec's own sums are exact, rounded once to
   float32. Any order is within gamma_K * sum_k |A'[i,k]| |B'[k,j]| + K * 2^-149 of the exact
   sum (gamma_K = K u / (1 - K u), u = 2^-24). A bias is added after, in the output dtype.
   MKL's summation order depends on the operands' memory layout, so the spec hands a GEMM the
   layouts torch's does: pre-scaled operands row-major, rule 10's high-precision grad_weight
   operands as torchao's matmul sees them (grad_output transposed, a strided view).
8. Tensorwise recipe: input and weight e4m3, grad_output e5m2, one scale per tensor, in all three
   matmuls (output, grad_input, grad_weight); each output in the dtype of the matmul's first
   operand before its cast (the input's for the output, grad_output's for both gradients).
9. Rowwise recipe: all e4m3 with power-of-two scales; input rows and weight rows (output
   features) for the output, grad_output rows and weight columns for grad_input, grad_output
   columns and input columns for grad_weight. A rowwise matmul whose output dtype is float32 or
   float16 runs in bfloat16 and is cast back. Without fast accumulation (the two backward
   matmuls) the matmul runs with unit scales and the bfloat16 result is then multiplied, in
   float32, by f32(f32(1 / s_a) * f32(1 / s_b)) and rounded to bfloat16 again.
10. rowwise_with_gw_hp: output as rowwise; grad_input from rowwise grad_output and a tensorwise
    weight (its one scale repeated along the rows); grad_weight in high precision (no float8).
11. MX block scaling: blocks of 32 along the last axis, one e8m0 scale 2^e each. floor:
    e = exponent(f32 amax) - emax_elem (8 for e4m3, 15 for e5m2), ceil adds 1 when amax's
    mantissa is nonzero; e is clamped to [-127, 128], a NaN amax gives the NaN scale byte 0xff,
    and the elements are fp8(clamp(x / max(2^e, 2^-126))). rceil: e = ceil(log2(amax / fp8_max))
    (float32), clamped to [-127, 127], inf amax gives byte 0xfe, the elements
    fp8(clamp(x * 2^-e)) with 2^-e taken as 1 at e = -127.
12. The MX matmul (emulated) dequantizes each operand in its original dtype: f(q) * f(2^(byte - 127))
    with both factors and the product in that dtype f (the byte 0xff gives NaN), then a GEMM of
    that dtype multiplies a @ b.T, both operands blocked along K. The ``mxfp8`` recipe (torchao's
    MXFP8Linear) casts all six operands to e4m3 in blocks of 32 with rceil scales: the input
    rows and the weight rows for the output, grad_output rows and the weight's columns for
    grad_input, grad_output's columns and the input's columns (blocks along the flattened rows)
    for grad_weight; each in its operand's dtype, the bias added after in the output's dtype.
13. Transformer Engine's delayed scaling quantizes with the scale computed from earlier steps
    and records this step's amax in slot 0 of an amax history. The update rolls the history by
    one (slot 0 goes to the end, then slot 0 is zeroed), takes the history's max (NaN ignored) or
    the most recent amax, and sets s = f32(fp8_max * 2^-margin) / amax when that amax is finite
    and > 0, else keeps the old scale; an infinite scale becomes FLT_MAX; scale_inv = 1 / s.
14. Transformer Engine's current scaling: s = fp8_max / max(amax, epsilon) in float32 (epsilon
    0 by default); amax 0, inf or NaN gives s = 1; an infinite s becomes FLT_MAX; the
    power-of-two option masks the mantissa away (an exact floor, unlike rule 4).
15. DeepSeek-V3: e4m3 everywhere, one float32 scale per 1x128 activation tile and per 128x128
    weight block, s = f32(amax / 448) with no epsilon (an all-zero block gives s = 0 and NaN
    elements, 0 / 0), q = fp8(x / s); the matmul sums each 128-long slice of K, multiplies the
    partial sum by s_a then s_b in float32 and adds it to a float32 accumulator (the promotion
    interval of 128); the tensor cores' narrower accumulation inside a slice is not modelled.

The float8 arithmetic of rules 2-6 and 11, and rule 12's dequantization, is exact and the
conformance suite compares it bit for bit; so are rules 8-10 and rule 12's matmuls when the spec
is handed the GEMM whose summation order torch uses. Inputs of any rank (..., K) are flattened
to rows, (M, K) with M the product of the leading axes in C order, and the result reshaped back;
grad_weight pairs row i of the flattened grad_output with row i of the flattened input.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import ml_dtypes
import numpy as np

from reference import formats

__all__ = [
    "AMAX_EPS",
    "Cast",
    "DeepSeekBlocks",
    "DelayedScaling",
    "DelayedScalingState",
    "FP8_FORMATS",
    "Float8Recipe",
    "Gemm",
    "LinearGrads",
    "MXBlocks",
    "MXRecipe",
    "MX_RECIPES",
    "Quantized",
    "RECIPES",
    "RULES",
    "accumulation_bound",
    "amax",
    "amax_to_scale",
    "blockwise_gemm",
    "blockwise_quantize",
    "cast_to_fp8",
    "current_scale",
    "delayed_cast",
    "delayed_initial_state",
    "delayed_update",
    "exact_power_of_2_floor",
    "exact_sums",
    "fp8_max",
    "gemm_exact",
    "linear_backward",
    "linear_forward",
    "linear_operands",
    "mx_dequantize",
    "mx_linear_backward",
    "mx_linear_forward",
    "mx_mm",
    "prescale",
    "quantize",
    "round_scale_down_to_power_of_2",
    "scaled_mm",
    "to_mx",
]

AMAX_EPS = 1e-12
"""torchao's lower bound on amax before the division (a float64 value, rule 3)."""

FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")

_F32 = np.dtype(np.float32)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_F16 = np.dtype(np.float16)
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
_FLT_MAX = np.float32(np.finfo(np.float32).max)
_U = 2.0**-24

Gemm = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""A GEMM: (M, K) and (K, N) arrays of one dtype to (M, N). The spec calls it with float32
pre-scaled operands, and with rule 10's high-precision operands in their own dtype (float32, or
bfloat16 under autocast); its result is then rounded to the matmul's output dtype."""


def _fp8_format(fmt: str | formats.Format) -> formats.Format:
    f = formats.get_format(fmt)
    if f.name not in FP8_FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FP8_FORMATS)} for scaled float8, got {f.name}")
    return f


def _float_array(x, name: str = "x") -> np.ndarray:
    a = np.asarray(x)
    if a.dtype not in (_F32, _BF16, _F16, np.dtype(np.float64)):
        raise ValueError(f"{name} must be float32, bfloat16, float16 or float64, got {a.dtype}")
    return a


# ----------------------------------------------------------------------------- rules 1-6


def fp8_max(fmt: str | formats.Format) -> float:
    """Rule 1: the largest finite value of a float8 format (448, 57344, 240, 57344)."""
    return _fp8_format(fmt).max


def amax(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Rule 2: max |x|, over everything (``axis=None``, a 0-d array) or along ``axis`` (kept).

    Exact in the input's dtype (returned as float32, which holds every float32, bfloat16 and
    float16 value exactly); NaN anywhere in the reduced set gives NaN. An empty reduction is a
    ValueError, as in torch.
    """
    a = _float_array(x)
    if a.size == 0 or (axis is not None and a.shape[axis] == 0):
        raise ValueError(f"amax of an empty reduction (shape {a.shape}, axis {axis})")
    wide = a.astype(np.float32) if a.dtype != np.float64 else a
    with np.errstate(invalid="ignore"):
        m = np.max(np.abs(wide), axis=axis, keepdims=axis is not None)
    return np.asarray(m, dtype=np.float32) if a.dtype != np.float64 else np.asarray(m)


def amax_to_scale(a: np.ndarray, fmt: str | formats.Format, power_of_2: bool = False) -> np.ndarray:
    """Rule 3: s = f32(fp8_max / max(f64(amax), 1e-12)); ``power_of_2`` then applies rule 4.

    amax 0 or below 1e-12 gives fp8_max * 1e12 rounded to float32; inf gives 0; NaN gives NaN
    (the clamp lets NaN through). Returns float32 of amax's shape.
    """
    with np.errstate(invalid="ignore"):  # a signalling NaN warns when widened
        m = np.asarray(a, dtype=np.float64)
        s = (np.float64(fp8_max(fmt)) / np.maximum(m, AMAX_EPS)).astype(np.float32)
    return round_scale_down_to_power_of_2(s) if power_of_2 else s


def _log2_f32(s: np.ndarray) -> np.ndarray:
    # float32 log2 as the float32 rounding of log2: torch's float32 log2 gave the same floor and
    # ceil on all 17.7M float32 values within 2^15 ULPs of a power of two (AVX512, AVX2 and the
    # scalar kernels); elsewhere floor and ceil do not depend on log2's last bit.
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log2(np.asarray(s, dtype=np.float64)).astype(np.float32)


def round_scale_down_to_power_of_2(s: np.ndarray) -> np.ndarray:
    """Rule 4: exp2(floor(log2(s))) with log2 in float32, torchao's power-of-two scale.

    Differs from ``exact_power_of_2_floor`` where float32 log2 rounds up to an integer k for s
    just below 2^k: it returns 2^k, twice the exact floor. 0 stays 0, NaN stays NaN; a subnormal
    s gives its power of two. ``s`` must be float32.
    """
    s = np.asarray(s)
    if s.dtype != _F32:
        raise ValueError(f"s must be float32, got {s.dtype}")
    with np.errstate(over="ignore"):
        return np.exp2(np.floor(_log2_f32(s)).astype(np.float64)).astype(np.float32)


def exact_power_of_2_floor(s: np.ndarray) -> np.ndarray:
    """The exact largest power of two <= s (float32); 0, inf and NaN pass through. Rule 4's
    reference point, and what Transformer Engine's mantissa mask computes (rule 14)."""
    s = np.asarray(s, dtype=np.float32)
    u = s.view(np.uint32)
    normal = (u & np.uint32(0x7F800000)) != 0
    masked = np.where(normal, u & np.uint32(0xFF800000), u).view(np.float32)
    # A subnormal's floor is its highest set bit: frexp finds it exactly.
    mant, exp = np.frexp(s.astype(np.float64))
    sub = np.ldexp(np.sign(mant), exp - 1).astype(np.float32)
    special = ~np.isfinite(s) | (s == 0)
    return np.where(special, s, np.where(normal, masked, sub)).astype(np.float32)


def cast_to_fp8(x: np.ndarray, s: np.ndarray, fmt: str | formats.Format) -> np.ndarray:
    """Rule 5: q = fp8(clamp(f32(f32(x) * s), -max, max)), RNE; the saturating cast.

    ``s`` (float32) broadcasts against ``x``. NaN stays NaN; with s = 0, finite values give 0
    and infinities NaN. Returns an array of the format's dtype.
    """
    f = _fp8_format(fmt)
    with np.errstate(over="ignore", invalid="ignore"):
        wide = _float_array(x).astype(np.float32)  # float64 overflows to inf, as in torch
        scaled = (wide * np.asarray(s, dtype=np.float32)).astype(np.float32)
    return formats.cast(scaled, f, saturate=True)


@dataclass(frozen=True)
class Quantized:
    """A float8 tensor and its float32 scale: ``data`` = fp8(x * scale); ``scale`` is 0-d
    (tensorwise) or has a size-1 axis (axiswise) and broadcasts against ``data``."""

    data: np.ndarray
    scale: np.ndarray

    @property
    def T(self) -> "Quantized":
        """The transpose of a 2-d operand, its scale transposed with it (``.T`` of a NumPy
        array, so that an operand of either kind transposes the same way)."""
        return Quantized(self.data.T, self.scale.T if self.scale.ndim == 2 else self.scale)


Granularity = Literal["tensorwise", "axiswise", "disabled"]


def quantize(x: np.ndarray, fmt: str | formats.Format, granularity: Granularity = "tensorwise",
             axis: int = -1, power_of_2: bool = False) -> Quantized:
    """Rules 2-5 together: amax (over the tensor, or along ``axis``), the scale, the cast."""
    if granularity not in ("tensorwise", "axiswise"):
        raise ValueError(f"granularity must be 'tensorwise' or 'axiswise', got {granularity!r}")
    a = amax(x, None if granularity == "tensorwise" else axis)
    s = amax_to_scale(a, fmt, power_of_2)
    return Quantized(cast_to_fp8(x, s, fmt), s)


def prescale(q: Quantized) -> np.ndarray:
    """Rule 6: A' = f32(f32(q) * f32(1 / s)), the operand a float32 GEMM multiplies."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = (np.float32(1.0) / np.asarray(q.scale, dtype=np.float32)).astype(np.float32)
        # Row-major, as torch's CPU emulation hands them to its GEMM (see rule 7 on layouts).
        return np.ascontiguousarray((q.data.astype(np.float32) * inv).astype(np.float32))


# ----------------------------------------------------------------------------- rule 7


def exact_sums(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The exact sums of a float32 GEMM's products, each rounded once to float64: (M, N) float64.

    Each product of two float32 values is exact in float64 and ``math.fsum`` rounds their exact
    sum once. Non-finite terms follow IEEE rules (inf + -inf is NaN).
    """
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a64.ndim != 2 or b64.ndim != 2 or a64.shape[1] != b64.shape[0]:
        raise ValueError(f"a GEMM takes (M, K) and (K, N), got {a64.shape} and {b64.shape}")
    with np.errstate(invalid="ignore", over="ignore"):
        prods = a64[:, :, None] * b64[None, :, :]  # (M, K, N), exact
        out = np.empty((a64.shape[0], b64.shape[1]), np.float64)
        for i in range(out.shape[0]):
            for j in range(out.shape[1]):
                terms = prods[i, :, j]
                out[i, j] = math.fsum(terms) if np.isfinite(terms).all() else terms.sum()
    return out


def gemm_exact(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The spec's float32 GEMM: each element the exact sum of its K products, rounded to float32
    (through float64: that step can differ from one correct rounding only when the float64 sum
    lands exactly on a float32 tie)."""
    with np.errstate(over="ignore"):
        return exact_sums(a, b).astype(np.float32)


def accumulation_bound(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rule 7's bound (float64, (M, N)): how far a float32 GEMM of ``a`` and ``b`` in any
    summation order may be from ``exact_sums(a, b)``.

    (gamma_K + 2^-53) * sum_k |a_ik| |b_kj| + K * 2^-149, gamma_K = K u / (1 - K u), u = 2^-24,
    widened by a relative 2^-48 for the float64 arithmetic of this check. Derivation: a float32
    dot product of K terms in any order (sequential, pairwise, blocked, with or without fused
    multiply-adds) has at most K roundings on the path from any product to the result, each a
    factor (1 + d) with |d| <= u, so it lies within gamma_K * sum |a_k b_k| of the exact sum S
    (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., sec. 3.1). A product that
    underflows adds an absolute error below 2^-150 instead (additions of subnormals are exact),
    at most K of them: the K * 2^-149 term. The reference point is S rounded to float64, within
    2^-53 |S| <= 2^-53 sum |a_k b_k| of S. The sum of magnitudes is computed in float64 (relative
    error below K * 2^-53, covered by the widening for K < 2^20).
    """
    a64, b64 = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
    k = a64.shape[1]
    if not 0 < k < 2**20:
        raise ValueError(f"the accumulation bound needs 0 < K < 2^20, got K = {k}")
    gamma = k * _U / (1 - k * _U)
    with np.errstate(invalid="ignore", over="ignore"):
        total = a64 @ b64
    return ((gamma + 2.0**-53) * total + k * 2.0**-149) * (1 + 2.0**-48)


def _out_cast(c: np.ndarray, dtype: np.dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == _F32:
        return np.asarray(c, np.float32)
    with np.errstate(over="ignore"):
        return np.asarray(c, np.float32).astype(dtype)


def _repeat_tensorwise(a: Quantized, b: Quantized) -> tuple[np.ndarray, np.ndarray]:
    # One operand axiswise and the other tensorwise: the tensorwise scale is repeated along the
    # axiswise operand's axis so that both are rowwise (torchao's preprocess_addmm).
    sa, sb = np.asarray(a.scale, np.float32), np.asarray(b.scale, np.float32)
    m, n = a.data.shape[0], b.data.shape[1]
    if sa.ndim < 2 and sb.ndim == 2:
        sa = np.full((m, 1), sa.reshape(()), np.float32)
    elif sa.ndim == 2 and sb.ndim < 2:
        sb = np.full((1, n), sb.reshape(()), np.float32)
    return sa, sb


def scaled_mm(a: Quantized, b: Quantized, out_dtype, *, fast_accum: bool = True,
              gemm: Gemm = gemm_exact) -> np.ndarray:
    """Rules 6, 7 and 9: the float8 matmul a @ b of torchao's recipes, in ``out_dtype``.

    Tensorwise (0-d scales) or rowwise (``a.scale`` (M, 1), ``b.scale`` (1, N)): the operands
    pre-scaled by rule 6, ``gemm`` over them, one rounding to the output dtype. A rowwise matmul
    into float32 or float16 runs into bfloat16 and is cast back; without ``fast_accum`` it runs
    with unit scales and multiplies the bfloat16 result by f32(1/s_a) * f32(1/s_b) (in float32,
    rounded to bfloat16). ``gemm`` is the float32 GEMM whose summation order rule 7 leaves open.
    """
    sa, sb = _repeat_tensorwise(a, b)
    m, n = a.data.shape[0], b.data.shape[1]
    rowwise = sa.shape == (m, 1) and sb.shape == (1, n)
    out_dtype = np.dtype(out_dtype)
    mm_dtype = _BF16 if rowwise and out_dtype in (_F32, _F16) else out_dtype
    post = None
    if rowwise and not fast_accum:
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            post = ((np.float32(1) / sa).astype(np.float32) * (np.float32(1) / sb).astype(np.float32)).astype(np.float32)
        sa, sb = np.ones((), np.float32), np.ones((), np.float32)
    c = _out_cast(gemm(prescale(Quantized(a.data, sa)), prescale(Quantized(b.data, sb))), mm_dtype)
    if post is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            c = _out_cast((c.astype(np.float32) * post).astype(np.float32), mm_dtype)
    return _out_cast(c.astype(np.float32), out_dtype) if mm_dtype != out_dtype else c


# ----------------------------------------------------------------------------- rules 8-10


@dataclass(frozen=True)
class Cast:
    """How one operand of one matmul is cast: granularity (``disabled`` keeps high precision)
    and the float8 format."""

    granularity: Granularity = "tensorwise"
    fmt: str = "float8_e4m3fn"

    def __post_init__(self) -> None:
        if self.granularity not in ("tensorwise", "axiswise", "disabled"):
            raise ValueError(f"granularity must be tensorwise, axiswise or disabled, got {self.granularity!r}")
        _fp8_format(self.fmt)


_E4, _E5 = Cast("tensorwise", "float8_e4m3fn"), Cast("tensorwise", "float8_e5m2")
_ROW = Cast("axiswise", "float8_e4m3fn")


@dataclass(frozen=True)
class Float8Recipe:
    """torchao's Float8LinearConfig, as far as the arithmetic goes: the six casts (each operand
    in each of its two matmuls), power-of-two scales, and fast accumulation per matmul."""

    name: str
    input: Cast = _E4
    weight: Cast = _E4
    grad_output: Cast = _E5
    input_for_grad_weight: Cast = _E4
    weight_for_grad_input: Cast = _E4
    grad_output_for_grad_weight: Cast = _E5
    power_of_2: bool = False
    fast_accum_output: bool = True
    fast_accum_grad_input: bool = False
    fast_accum_grad_weight: bool = False


RECIPES: Mapping[str, Float8Recipe] = types.MappingProxyType({
    # Rule 8.
    "tensorwise": Float8Recipe("tensorwise"),
    # Rule 9.
    "rowwise": Float8Recipe("rowwise", _ROW, _ROW, _ROW, _ROW, _ROW, _ROW, power_of_2=True),
    # Rule 10.
    "rowwise_with_gw_hp": Float8Recipe(
        "rowwise_with_gw_hp", _ROW, _ROW, _ROW, Cast("disabled"), _E4, Cast("disabled"), power_of_2=True),
})


def _operand(x: np.ndarray, cast: Cast, axis: int, power_of_2: bool) -> "Operand":
    if cast.granularity == "disabled":
        return x
    return quantize(x, cast.fmt, cast.granularity, axis, power_of_2)


def _matmul(a: "Operand", b: "Operand", out_dtype, fast_accum: bool, gemm: Gemm) -> np.ndarray:
    if isinstance(a, Quantized) != isinstance(b, Quantized):
        raise ValueError("a matmul takes two float8 operands or two high-precision ones")
    if isinstance(a, Quantized):
        return scaled_mm(a, b, out_dtype, fast_accum=fast_accum, gemm=gemm)
    # High precision (rule 10's grad_weight): the GEMM of the operands' own dtype.
    if a.dtype != b.dtype:
        raise ValueError(f"a high-precision matmul takes operands of one dtype, got {a.dtype} and {b.dtype}")
    return _out_cast(np.asarray(gemm(a, b)).astype(np.float32), out_dtype)


def _recipe(recipe: str | Float8Recipe) -> Float8Recipe:
    if isinstance(recipe, Float8Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    return RECIPES[recipe]


Operand = Quantized | np.ndarray
"""A matmul operand: float8 with its scale, or a high-precision array (a ``disabled`` cast)."""


def linear_operands(x: np.ndarray, weight: np.ndarray, grad_output: np.ndarray | None,
                    recipe: str | Float8Recipe) -> dict[str, tuple[Operand, Operand]]:
    """Rules 8-10: the two operands of each matmul of a Float8Linear, cast as the recipe says.

    ``output`` = x @ weight.T: the input cast along its last axis (one scale per row), the weight
    per output feature. ``grad_input`` = grad_output @ weight: grad_output per row, the weight
    per column (input feature). ``grad_weight`` = grad_output.T @ x: grad_output per column, the
    input per column. ``x`` is (..., K), ``weight`` (N, K), ``grad_output`` (..., N) or None
    (then only ``output``).
    """
    r = _recipe(recipe)
    x, w = _float_array(x), _float_array(weight, "weight")
    x2 = x.reshape(-1, x.shape[-1])
    out = {"output": (_operand(x2, r.input, -1, r.power_of_2), _operand(w.T, r.weight, 0, r.power_of_2))}
    if grad_output is None:
        return out
    go = _float_array(grad_output, "grad_output")
    go2 = go.reshape(-1, go.shape[-1])
    out["grad_input"] = (_operand(go2, r.grad_output, -1, r.power_of_2),
                         _operand(w.T, r.weight_for_grad_input, -1, r.power_of_2).T)
    out["grad_weight"] = (_operand(go2, r.grad_output_for_grad_weight, 0, r.power_of_2).T,
                          _operand(x2, r.input_for_grad_weight, 0, r.power_of_2))
    return out


def linear_forward(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, recipe: str | Float8Recipe, *,
                   gemm: Gemm = gemm_exact) -> np.ndarray:
    """Rules 8-10, forward: y = x @ weight.T (+ bias) of a Float8Linear, in x's dtype.

    The operands as ``linear_operands`` casts them; the bias is cast to the output dtype and
    added after the matmul, in that dtype.
    """
    r = _recipe(recipe)
    x = _float_array(x)
    a, b = linear_operands(x, weight, None, r)["output"]
    y = _matmul(a, b, x.dtype, r.fast_accum_output, gemm)
    if bias is not None:
        with np.errstate(over="ignore"):
            y = _out_cast(y.astype(np.float32) + _out_cast(bias, x.dtype).astype(np.float32), x.dtype)
    return y.reshape(*x.shape[:-1], np.asarray(weight).shape[0])


@dataclass(frozen=True)
class LinearGrads:
    """The two float8 backward matmuls of a Float8Linear: ``grad_input`` in grad_output's
    dtype, ``grad_weight`` (N, K) as that matmul computes it (autograd then casts it to the
    weight's dtype)."""

    grad_input: np.ndarray
    grad_weight: np.ndarray


def linear_backward(x: np.ndarray, weight: np.ndarray, grad_output: np.ndarray, recipe: str | Float8Recipe, *,
                    gemm: Gemm = gemm_exact) -> LinearGrads:
    """Rules 8-10, backward: grad_input = grad_output @ weight and grad_weight = grad_output.T @ x,
    both in grad_output's dtype without fast accumulation, the operands as ``linear_operands``
    casts them."""
    r = _recipe(recipe)
    go = _float_array(grad_output, "grad_output")
    ops = linear_operands(x, weight, go, r)
    grad_input = _matmul(*ops["grad_input"], go.dtype, r.fast_accum_grad_input, gemm)
    grad_weight = _matmul(*ops["grad_weight"], go.dtype, r.fast_accum_grad_weight, gemm)
    return LinearGrads(grad_input.reshape(*go.shape[:-1], np.asarray(weight).shape[1]), grad_weight)


# ----------------------------------------------------------------------------- rules 11-12

MXMode = Literal["floor", "ceil", "rceil"]
_MX_EMAX = {"float8_e4m3fn": 8, "float8_e5m2": 15}


@dataclass(frozen=True)
class MXBlocks:
    """An MX tensor: ``data`` (fp8, the input's shape) and ``scale`` (float8_e8m0fnu, one per
    block of ``block_size`` along the last axis: shape (..., K // block_size))."""

    data: np.ndarray
    scale: np.ndarray
    block_size: int


def _mx_exponent(m: np.ndarray, elem: formats.Format, mode: MXMode) -> np.ndarray:
    """Rule 11: the biased e8m0 byte of each block's scale from its float32 amax ``m``."""
    if mode == "rceil":
        with np.errstate(divide="ignore", invalid="ignore"):
            e = np.ceil(_log2_f32((m / np.float32(elem.max)).astype(np.float32)))
            biased = (np.clip(e, -127, 127) + 127).astype(np.int64)
        return np.where(np.isnan(m), 255, np.where(np.isinf(m), 254, biased))
    u = m.view(np.uint32).astype(np.int64)
    e = ((u >> 23) & 0xFF) - 127 - _MX_EMAX[elem.name]
    if mode == "ceil":
        e = e + ((u & 0x7FFFFF) > 0)
    biased = np.clip(e, -127, 128) + 127
    return np.where(np.isnan(m), 255, biased)


def to_mx(x: np.ndarray, elem_fmt: str = "float8_e4m3fn", block_size: int = 32, mode: MXMode = "floor") -> MXBlocks:
    """Rule 11: MX block scaling of float32 or bfloat16 ``x`` along its last axis.

    floor/ceil divide each element by max(2^e, 2^-126) (the NaN byte 0xff gives an infinite
    divisor); rceil multiplies by 2^(127 - byte), except 1 for the byte 0 (torchao's special
    case), 2^-127 for the inf byte 0xfe and NaN for 0xff. Then clamp to the element format's max
    and round (RNE). The last axis must be a multiple of ``block_size``.
    """
    a = np.asarray(x)
    if a.dtype not in (_F32, _BF16):
        raise ValueError(f"x must be float32 or bfloat16 for MX scaling, got {a.dtype}")
    elem = formats.get_format(elem_fmt)
    if elem.name not in _MX_EMAX:
        raise ValueError(f"elem_fmt must be float8_e4m3fn or float8_e5m2, got {elem.name}")
    if mode not in ("floor", "ceil", "rceil"):
        raise ValueError(f"mode must be floor, ceil or rceil, got {mode!r}")
    if a.ndim == 0 or a.shape[-1] % block_size:
        raise ValueError(f"the last axis of shape {a.shape} must be a multiple of block_size {block_size}")
    blocks = a.astype(np.float32).reshape(*a.shape[:-1], a.shape[-1] // block_size, block_size)
    with np.errstate(invalid="ignore"):
        m = np.max(np.abs(blocks), axis=-1, keepdims=True).astype(np.float32)
    biased = _mx_exponent(m, elem, mode)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if mode == "rceil":
            # ldexp, not exp2: NumPy's float32 exp2 is not exact at every integer (torch's is).
            pow2 = np.ldexp(np.float32(1), np.clip(127 - biased, -127, 127)).astype(np.float32)
            factor = np.where(biased == 255, m, np.where(biased == 254, np.float32(2.0**-127),
                              np.where(biased == 0, np.float32(1), pow2)))
            scaled = blocks * factor.astype(np.float32)
        else:
            pow2 = (biased.astype(np.uint32) << np.uint32(23)).view(np.float32)
            scaled = blocks / np.maximum(pow2, np.float32(2.0**-126))
    data = formats.cast(scaled.astype(np.float32).reshape(a.shape), elem, saturate=True)
    scale = biased[..., 0].astype(np.uint8).view(_E8M0)
    return MXBlocks(data, scale, block_size)


def mx_dequantize(t: MXBlocks, dtype) -> np.ndarray:
    """Rule 12: q * 2^(byte - 127) in ``dtype`` (float32 or bfloat16); the byte 0xff gives NaN."""
    dtype = np.dtype(dtype)
    byte = t.scale.view(np.uint8).astype(np.int64)
    s = np.where(byte == 255, np.float32(np.nan), np.ldexp(np.float32(1), np.minimum(byte, 254) - 127)).astype(np.float32)
    k = t.data.shape[-1]
    s_full = np.repeat(s.astype(np.float32), t.block_size, axis=-1).reshape(*t.data.shape[:-1], k)
    q = t.data.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype == _F32:
            return (q * s_full).astype(np.float32)
        return (q.astype(dtype).astype(np.float32) * s_full.astype(dtype).astype(np.float32)).astype(dtype)


@dataclass(frozen=True)
class MXRecipe:
    """An MX training recipe, as far as the arithmetic goes: the element format, the block size
    and the scale mode of every cast (rule 12)."""

    name: str
    elem_fmt: str = "float8_e4m3fn"
    block_size: int = 32
    mode: MXMode = "rceil"

    def __post_init__(self) -> None:
        if self.elem_fmt not in _MX_EMAX:
            raise ValueError(f"elem_fmt must be float8_e4m3fn or float8_e5m2, got {self.elem_fmt!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if self.mode not in ("floor", "ceil", "rceil"):
            raise ValueError(f"mode must be floor, ceil or rceil, got {self.mode!r}")


MX_RECIPES: Mapping[str, MXRecipe] = types.MappingProxyType({
    # Rule 12: torchao 0.18's MXFP8Linear with its defaults.
    "mxfp8": MXRecipe("mxfp8", "float8_e4m3fn", 32, "rceil"),
})


def mx_mm(a: MXBlocks, b: MXBlocks, dtype, *, gemm: Gemm = gemm_exact) -> np.ndarray:
    """Rule 12: the emulated MX matmul a @ b.T, ``a`` (M, K) and ``b`` (N, K) both blocked along
    K, each dequantized in ``dtype`` and multiplied by a GEMM of that dtype, rounded to it.

    ``gemm`` receives the dequantized ``a`` row-major and ``b`` transposed (a (K, N) view of a
    row-major (N, K) array), the layouts torchao's emulation hands torch's GEMM.
    """
    if a.data.ndim != 2 or b.data.ndim != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"mx_mm takes (M, K) and (N, K) blocks, got {a.data.shape} and {b.data.shape}")
    a_hp = np.ascontiguousarray(mx_dequantize(a, dtype))
    b_hp = np.ascontiguousarray(mx_dequantize(b, dtype))
    return _out_cast(np.asarray(gemm(a_hp, b_hp.T)).astype(np.float32), dtype)


def _mx_recipe(recipe: str | MXRecipe) -> MXRecipe:
    if isinstance(recipe, MXRecipe):
        return recipe
    if recipe not in MX_RECIPES:
        raise ValueError(f"MX recipe must be one of {', '.join(MX_RECIPES)}, got {recipe!r}")
    return MX_RECIPES[recipe]


def _mx_operand(x: np.ndarray, r: MXRecipe) -> MXBlocks:
    return to_mx(np.ascontiguousarray(x), r.elem_fmt, r.block_size, r.mode)


def _same_dtype(x: np.ndarray, weight: np.ndarray) -> None:
    if x.dtype != weight.dtype:
        raise ValueError(f"an MX linear layer multiplies in one dtype: x is {x.dtype}, weight {weight.dtype}")


def mx_linear_forward(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, recipe: str | MXRecipe = "mxfp8",
                      *, gemm: Gemm = gemm_exact) -> np.ndarray:
    """Rule 12, forward of an MX linear layer: y = x @ weight.T (+ bias) in x's dtype.

    ``x`` (..., K) is flattened to rows and cast in blocks along K, the weight (N, K) along K;
    the bias is cast to the output's dtype and added after the matmul, in that dtype.
    """
    r = _mx_recipe(recipe)
    x, w = _float_array(x), _float_array(weight, "weight")
    _same_dtype(x, w)
    y = mx_mm(_mx_operand(x.reshape(-1, x.shape[-1]), r), _mx_operand(w, r), x.dtype, gemm=gemm)
    if bias is not None:
        with np.errstate(over="ignore", invalid="ignore"):  # inf + -inf is NaN, as in torch
            y = _out_cast(y.astype(np.float32) + _out_cast(bias, x.dtype).astype(np.float32), x.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


def mx_linear_backward(x: np.ndarray, weight: np.ndarray, grad_output: np.ndarray, recipe: str | MXRecipe = "mxfp8",
                       *, gemm: Gemm = gemm_exact) -> LinearGrads:
    """Rule 12, backward of an MX linear layer: grad_input = grad_output @ weight (grad_output
    blocked along N, the weight's columns along N) and grad_weight = grad_output.T @ x (both
    blocked along the flattened rows M, row i of one paired with row i of the other); both in
    grad_output's dtype. The flattened row count must be a multiple of the block size."""
    r = _mx_recipe(recipe)
    x, w, go = _float_array(x), _float_array(weight, "weight"), _float_array(grad_output, "grad_output")
    _same_dtype(x, w)
    _same_dtype(go, w)
    x2, go2 = x.reshape(-1, x.shape[-1]), go.reshape(-1, go.shape[-1])
    grad_input = mx_mm(_mx_operand(go2, r), _mx_operand(w.T, r), go.dtype, gemm=gemm)
    grad_weight = mx_mm(_mx_operand(go2.T, r), _mx_operand(x2.T, r), go.dtype, gemm=gemm)
    return LinearGrads(grad_input.reshape(*go.shape[:-1], w.shape[1]), grad_weight)


# ----------------------------------------------------------------------------- rules 13-14


@dataclass(frozen=True)
class DelayedScaling:
    """Transformer Engine's DelayedScaling recipe, as far as the scale goes: ``margin`` (powers of
    two of headroom), ``amax_history_len`` and ``amax_compute_algo`` (``max`` or
    ``most_recent``). The defaults are TE's."""

    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"

    def __post_init__(self) -> None:
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {self.margin!r}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}")


@dataclass(frozen=True)
class DelayedScalingState:
    """One tensor's delayed-scaling state: the amax history (slot 0 is this step's), the scale
    this step quantizes with and its inverse; all float32."""

    amax_history: tuple[np.float32, ...]
    scale: np.float32
    scale_inv: np.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "amax_history", tuple(np.float32(a) for a in self.amax_history))
        object.__setattr__(self, "scale", np.float32(self.scale))
        object.__setattr__(self, "scale_inv", np.float32(self.scale_inv))


def delayed_initial_state(config: DelayedScaling) -> DelayedScalingState:
    """A zero history and scale 1, as Transformer Engine starts a tensor."""
    return DelayedScalingState((np.float32(0),) * config.amax_history_len, np.float32(1), np.float32(1))


def delayed_cast(x: np.ndarray, state: DelayedScalingState, fmt: str | formats.Format) -> tuple[np.ndarray, DelayedScalingState]:
    """Rule 13, the cast: q = fp8(x * scale) with the scale from earlier steps (saturating),
    and this step's amax written into slot 0 of the history."""
    q = cast_to_fp8(x, state.scale, fmt)
    history = (np.float32(amax(x)),) + state.amax_history[1:]
    return q, DelayedScalingState(history, state.scale, state.scale_inv)


def _fmax(a: np.float32, b: np.float32) -> np.float32:
    return np.float32(np.fmax(a, b))  # fmaxf: a NaN operand is ignored


def delayed_update(state: DelayedScalingState, config: DelayedScaling, fmt: str | formats.Format) -> DelayedScalingState:
    """Rule 13, the update after a step: roll the history, choose an amax, compute the scale.

    The new history is (h[1], ..., h[L-1], h[0]) with slot 0 then zeroed; the amax is the max of
    all L entries (NaN ignored, at least 0) or h[0] (``most_recent``, NaN kept). The scale is
    f32(fp8_max * 2^-margin) / amax in float32 when that amax is finite and > 0, else the old
    one; an infinite result becomes FLT_MAX; scale_inv = f32(1 / scale).
    """
    h = state.amax_history
    rolled = h[1:] + h[:1]
    new_history = (np.float32(0),) + rolled[1:]
    if config.amax_compute_algo == "most_recent":
        m = h[0]
    else:
        m = np.float32(0)
        for value in rolled:
            m = _fmax(m, value)
    scaled_max = np.float32(fp8_max(fmt) * 2.0**-config.margin)
    with np.errstate(over="ignore", divide="ignore"):
        scale = np.float32(scaled_max / m) if np.isfinite(m) and m > 0 else state.scale
        if np.isinf(scale):
            scale = _FLT_MAX
        scale_inv = np.float32(np.float32(1) / scale)
    return DelayedScalingState(new_history, scale, scale_inv)


def current_scale(a: np.ndarray, fmt: str | formats.Format, *, power_of_2: bool = False,
                  epsilon: float = 0.0) -> np.ndarray:
    """Rule 14: Transformer Engine's current scaling, s = fp8_max / max(amax, epsilon) in float32.

    amax 0, inf or NaN gives 1; an infinite quotient becomes FLT_MAX; ``power_of_2`` clears the
    mantissa (the exact floor). Returns float32 of amax's shape.
    """
    m = np.asarray(a, dtype=np.float32)
    m = np.where(m < np.float32(epsilon), np.float32(epsilon), m).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = (np.float32(fp8_max(fmt)) / m).astype(np.float32)
    s = np.where(np.isinf(s), _FLT_MAX, s)
    s = np.where(np.isinf(m) | (m == 0) | np.isnan(m), np.float32(1), s).astype(np.float32)
    return exact_power_of_2_floor(s) if power_of_2 else s


# ----------------------------------------------------------------------------- rule 15


@dataclass(frozen=True)
class DeepSeekBlocks:
    """A DeepSeek-V3 block-quantized matrix: e4m3 ``data`` and one float32 ``scale`` per block
    of ``block_shape`` (the dequantization factor: x ~ data * scale)."""

    data: np.ndarray
    scale: np.ndarray
    block_shape: tuple[int, int]


def blockwise_quantize(x: np.ndarray, block_shape: tuple[int, int] = (1, 128)) -> DeepSeekBlocks:
    """Rule 15, the cast: s = f32(amax / 448) per block (no epsilon), q = fp8(f32(x / s)),
    saturating RNE. (1, 128) tiles for activations, (128, 128) blocks for weights; a 2-d ``x``
    whose shape the blocks divide."""
    a = _float_array(x).astype(np.float32)
    br, bc = block_shape
    if a.ndim != 2 or a.shape[0] % br or a.shape[1] % bc:
        raise ValueError(f"x must be 2-d with a shape divisible by block_shape {block_shape}, got {a.shape}")
    tiles = a.reshape(a.shape[0] // br, br, a.shape[1] // bc, bc)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = (np.max(np.abs(tiles), axis=(1, 3), keepdims=True) / np.float32(448)).astype(np.float32)
        scaled = (tiles / s).astype(np.float32)
    q = formats.cast(scaled.reshape(a.shape), "float8_e4m3fn", saturate=True)
    return DeepSeekBlocks(q, s[:, 0, :, 0], block_shape)


def blockwise_gemm(a: DeepSeekBlocks, b: DeepSeekBlocks, *, interval: int = 128) -> np.ndarray:
    """Rule 15, the matmul a @ b.T of DeepSeek-V3's fp8_gemm: ``a`` (M, K) in (1, 128) tiles,
    ``b`` (N, K) in (128, 128) blocks; float32 out.

    For each ``interval``-long slice of K: the slice's exact dot product of the fp8 values,
    rounded to float32, times the tile's s_a, times the block's s_b (two float32 roundings),
    added to the float32 accumulator, slice after slice in order of K.
    """
    (m, k), (n, k2) = a.data.shape, b.data.shape
    if k != k2 or k % interval or a.block_shape[1] != interval or b.block_shape != (interval, interval):
        raise ValueError(f"blockwise_gemm needs (M, K) and (N, K) with K a multiple of {interval} in matching blocks, "
                         f"got {a.data.shape} {a.block_shape} and {b.data.shape} {b.block_shape}")
    acc = np.zeros((m, n), np.float32)
    qa, qb = a.data.astype(np.float32), b.data.astype(np.float32)
    rows_b = np.arange(n) // interval
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(k // interval):
            sl = slice(i * interval, (i + 1) * interval)
            part = gemm_exact(qa[:, sl], qb[:, sl].T)
            part = (part * a.scale[:, i][:, None]).astype(np.float32)
            part = (part * b.scale[rows_b, i][None, :]).astype(np.float32)
            acc = (acc + part).astype(np.float32)
    return acc


RULES = (
    fp8_max,
    amax,
    amax_to_scale,
    round_scale_down_to_power_of_2,
    cast_to_fp8,
    prescale,
    scaled_mm,
    linear_forward,
    linear_backward,
    to_mx,
    mx_dequantize,
    mx_mm,
    mx_linear_forward,
    mx_linear_backward,
    delayed_update,
    current_scale,
    blockwise_quantize,
    blockwise_gemm,
)
"""The rule functions, in the module docstring's order (each docstring opens with its rule)."""
