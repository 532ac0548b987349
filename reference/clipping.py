"""Gradient clipping as torch's ``clip_grad_norm_`` and ``clip_grad_value_`` compute it on CPU.

Rules (L2 and max norms; ``g`` is one gradient, ``D`` its dtype; "f32(x)" rounds x to float32):

1. Per-tensor norm. Each gradient's norm has the gradient's own dtype. It is accumulated in
   float32 for float16, bfloat16 and float32 gradients and in float64 for float64 ones, then
   rounded once to ``D`` (``sqrt`` is correctly rounded in the accumulation dtype first).
   A gradient of exactly one element (any shape: ``()``, ``(1,)``, ``(1, 1)``...) has norm
   ``|x|``, for every norm type and order: torch returns ``abs`` there and never squares, so
   float32 ``[1e30]`` has norm 1e30 (not inf) and ``[1e-30]`` has 1e-30 (not 0); NaN stays NaN.
2. Total norm. The per-tensor norms are stacked and the norm of that vector is taken with the
   same rules (so the total of a single gradient is its own norm, by the one-element case). Stacking promotes like ``torch.stack``: one dtype stays as it is, any float64 makes
   float64, otherwise a mix (float16 with bfloat16 or float32) makes float32. The stacked order
   is parameter order within each dtype, and the dtype groups come in the iteration order of
   ATen's grouping hash map (a libstdc++ ``unordered_map`` with 13 buckets keyed by an FNV-1a
   hash of (device, dtype)), NOT in order of first appearance: taking dtypes in order of first
   appearance, each new one goes to the front, unless one sharing its bucket is already there,
   in which case it goes immediately before that one. On CPU float32 and bfloat16 share a
   bucket; float16 and float64 have their own. So ``[f32, f64]`` stacks f64 norms first, and
   ``[f32, f64, bf16]`` stacks f64, bf16, f32. Only mixed-dtype L2 totals depend on this.
3. No gradients: the total norm is ``float32(0.0)`` and nothing is multiplied.
4. Coefficient, in the total's dtype with its op math (float32 for 16-bit and float32 totals):
   ``coef = f(f(1 / f(total + 1e-6)) * max_norm)``, each ``f`` rounding to that dtype: a
   reciprocal then a multiply, not a division (the two differ in about a quarter of cases). The
   Python scalars meet the 0-d total differently: ``1e-6`` is first rounded to the total's own
   dtype (``f(total + f(1e-6))``: torch's CPU add converts a scalar to the tensor's dtype, so a
   bfloat16 or float16 total adds bfloat16(1e-6) / float16(1e-6), through float32), while
   ``max_norm`` enters in the op math (float32 for 16-bit and float32 totals, float64 for a
   float64 one: the multiply of a 16-bit tensor keeps its scalar operand in float32).
5. The coefficient is clamped to at most 1.0 and then ALWAYS multiplied in: a coefficient of
   exactly 1.0 leaves every bit unchanged, and NaN passes through the clamp. Each gradient is
   multiplied in its own op math (float32, or float64 for float64 grads) by the coefficient
   converted to that op math, and rounded back to ``D``. On CUDA (``coef_in_grad_dtype=True``)
   the coefficient is first rounded to ``D``: torch's CUDA ``mul_`` casts a 0-d device tensor to
   the other operand's dtype, so a float32 coefficient meets a bfloat16 gradient as bfloat16
   (different bits whenever a model mixes 16-bit and wider gradients).
6. Non-finite gradients are not special-cased. An inf makes the total inf and the coefficient 0:
   finite entries become zeros of the same sign and the inf becomes NaN. A NaN makes every
   gradient NaN. Finite float32 values whose squares overflow (``[3e38, 3e38]``) behave exactly
   like an inf: the gradient is silently zeroed. ``error_if_nonfinite=True`` raises
   ``RuntimeError`` instead, with torch's message.
7. ``norm_type`` is 2 or inf. The inf norm is ``max |g|`` per tensor and the max of those for
   the total (order does not matter; NaN propagates). Other orders raise ``ValueError``: their
   bit-level reduction order in torch is not pinned down.
8. Summation order of the L2 sum of squares (``order=``):

   * ``"exact"``: squares in float64 (exact for 16- and 32-bit inputs), summed exactly with one
     final rounding (``math.fsum``), square root in float64, rounded to ``D`` (through float32
     for 16-bit dtypes). The total is the norm of ALL squares, not of the rounded per-tensor
     norms, and squares never overflow. This is the mathematician's answer.
   * ``"torch_cpu"`` (the default): the order of ATen's CPU kernel with
     ``ATEN_CPU_CAPABILITY=default``, bit for bit. float32: 8 float32 lanes; element ``i`` of
     the body (``i < n - n % 8``) goes to lane ``i % 8``, ``acc[j] = f32(acc[j] + f32(x * x))``
     with no fused multiply-add; the lanes fold in order ``b = acc[0]; b = f32(b + acc[j])`` for
     j = 1..7; then the ``n % 8`` tail elements in order, ``b = f32(b + f32(x * x))``; finally
     ``f32(sqrt(b))``. float64: the same with 4 float64 lanes. bfloat16: widened to float32 and
     squared there; the body is made of 16-element blocks (``n - n % 16`` elements, still lane
     ``i % 8`` in index order) and the tail has up to 15 elements; the float32 root is rounded
     to bfloat16. float16 takes ATen's generic reduction instead: one float32 running sum from
     0 in index order, root in float32, rounded to float16. With ``num_threads > 1`` and at
     least 32768 elements that sum is split as ``at::parallel_for`` splits it (chunks of
     ``ceil(n / T)`` with ``T = min(num_threads, ceil(n / 32768))``, partial sums added in
     chunk order); pass torch's thread count to match it.
   With native AVX2/AVX512 kernels torch contracts part of the scalar tail into fused
   multiply-adds, so norms may differ from ``"torch_cpu"`` by about 1 ULP (clipped gradients
   by a few ULPs); generate golden data with ``ATEN_CPU_CAPABILITY=default`` to compare bits.
   The float32 ``"torch_cpu"`` norm is the less accurate one: its per-lane running sums drift
   with length (about 1e-5 relative at a million elements).
9. ``clip_grad_value`` clamps every element to ``[-v, v]`` in the gradient's dtype (``v`` is
   rounded to that dtype through float32, as torch converts its scalar). NaN stays NaN and
   ``+-inf`` becomes ``+-v``.
10. A 0-d gradient promotes. torch multiplies a 0-d gradient by the 0-d coefficient as two 0-d
   tensors, so the product is computed in the promoted dtype of the two and rounded once back
   to ``D`` (through float32 for 16-bit ``D``, as every float64 -> 16-bit conversion goes): a
   0-d float32, bfloat16 or float16 gradient clipped together with float64 gradients (a float64
   total, so a float64 coefficient) is ``f(f64(g) * coef)``, NOT ``f(g * f32(coef))``. The two
   differ by an ULP in about a quarter of cases, and by far more when the coefficient is
   subnormal in float32 (or below it) but normal in float64. A gradient with one or more
   dimensions does not promote (rule 5: the coefficient is converted to its op math first), and
   where the promoted dtype is the gradient's own op math (a float32 coefficient meeting a 0-d
   bfloat16 gradient) the two rules agree. Measured on CPU; the rule comes before rule 5's CUDA
   variant (type promotion does not depend on the device), which is not measured for 0-d.
11. ``clip_grads_with_norm`` is rules 4, 5 and 10 from a total the caller gives (torch's
   ``clip_grads_with_norm_``, the second half of ``clip_grad_norm_``): the coefficient is
   computed in the given total's dtype, whatever computed it.

Supported gradient dtypes: float16, bfloat16 (``ml_dtypes``), float32, float64. Gradients may
have any shape (a C-order flattening defines the element order) including zero size, whose
norm is 0. Inputs are never modified, results are new arrays, except in ``clip_grad_norm_``,
which clips the given arrays in place as torch does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = [
    "EPS",
    "ORDERS",
    "ClipResult",
    "clip_grad_norm",
    "clip_grad_norm_",
    "clip_grad_value",
    "clip_grads_with_norm",
    "tensor_norm",
    "total_norm",
]

EPS = 1e-6
"""The constant torch adds to the total norm before taking its reciprocal."""

ORDERS = ("torch_cpu", "exact")
"""Summation orders for the L2 sum of squares (rule 8)."""

_F16 = np.dtype(np.float16)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_SUPPORTED = (_F16, _BF16, _F32, _F64)

# ATen's parallel grain size: reductions below it always run on one thread.
_GRAIN_SIZE = 32768


@dataclass(frozen=True)
class ClipResult:
    """What ``clip_grad_norm`` returns.

    ``grads``: the clipped gradients (new arrays, same shapes and dtypes, input order).
    ``total_norm``: the total norm BEFORE clipping, as torch returns it (a NumPy scalar in the
    promoted dtype of rule 2; ``float32(0)`` with no gradients).
    ``clip_coef``: the coefficient after the clamp of rule 5, in the total's dtype. With no
    gradients it is still computed from the zero total although nothing is multiplied.
    """

    grads: tuple[np.ndarray, ...]
    total_norm: np.floating
    clip_coef: np.floating


def _check_grad(g: np.ndarray) -> np.ndarray:
    arr = np.asarray(g)
    if arr.dtype not in _SUPPORTED:
        raise ValueError(
            f"gradient dtype must be one of float16, bfloat16, float32, float64, got {arr.dtype}"
        )
    return arr


def _check_norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if p != 2.0 and p != math.inf:
        raise ValueError(f"norm_type must be 2.0 or inf, got {norm_type!r}")
    return p


def _check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def _check_threads(num_threads: int) -> None:
    if not isinstance(num_threads, (int, np.integer)) or num_threads < 1:
        raise ValueError(f"num_threads must be an integer >= 1, got {num_threads!r}")


def _opmath(dtype: np.dtype) -> np.dtype:
    """The dtype torch computes in for a tensor of ``dtype``."""
    return _F64 if dtype == _F64 else _F32


def _promote(dtypes: Sequence[np.dtype]) -> np.dtype:
    """``torch.stack``'s result dtype for floating dtypes (rule 2)."""
    kinds = set(dtypes)
    if len(kinds) == 1:
        return next(iter(kinds))
    return _F64 if _F64 in kinds else _F32


# ATen's c10::ScalarType codes, hashed with the CPU device (type 0, index -1) by FNV-1a.
_SCALAR_TYPE_CODE = {_F16: 5, _F32: 6, _F64: 7, _BF16: 15}
_HASH_BUCKETS = 13  # libstdc++'s first bucket count for a default-constructed unordered_map


def _cpu_bucket(dtype: np.dtype) -> int:
    value = 0x811C9DC5
    for byte in (0, 0xFF, _SCALAR_TYPE_CODE[dtype]):
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value % _HASH_BUCKETS


def _group_order(first_appearance: Sequence[np.dtype]) -> list[np.dtype]:
    """The order in which torch visits dtype groups on CPU (rule 2).

    libstdc++ inserts a key into an empty bucket at the front of its node list, and into an
    occupied bucket just before that bucket's first node; with fewer than 13 keys it never
    rehashes, so this reproduces the iteration order exactly.
    """
    order: list[np.dtype] = []
    for dtype in first_appearance:
        bucket = _cpu_bucket(dtype)
        mates = [i for i, d in enumerate(order) if _cpu_bucket(d) == bucket]
        order.insert(mates[0] if mates else 0, dtype)
    return order


# The (lanes, block) of rule 8's vectorised torch_cpu kernels, by gradient dtype.
_LANES = {_F32: (8, 8), _F64: (4, 4), _BF16: (8, 16)}

# _lane_sums works through its gradients in chunks of about this many elements (2 MiB of float32):
# few enough chunks that Python's per-call cost stays small, small enough to stay in cache.
# Measured on transformer-shaped float32 gradients (1M and 12M elements); any values give the
# same bits, only the speed changes.
_CHUNK_ELEMENTS = 2**19
_CHUNK_MIN_ROWS = 2048


def _lane_sums(bodies: Sequence[np.ndarray]) -> np.ndarray:
    """Rule 8's lane sums of squares for several gradient bodies at once, bit for bit.

    ``bodies``: C-ordered ``(rows, lanes)`` float32 or float64 arrays of one dtype. Returns a
    ``(len(bodies), lanes)`` array: entry ``[t, j]`` is ``acc[j]`` of body ``t``, the running sum
    ``acc = f(acc + f(x * x))`` from 0 down column ``j`` in row order.

    Why this is exactly the rule, body by body: row ``r`` of every body still that long is laid
    side by side in one wide row, squared there (``f(x * x)``, elementwise), and
    ``np.add.reduce(wide, axis=0)`` adds
    the wide rows one at a time into the accumulators, elementwise (NumPy sums pairwise only
    along a contiguous reduction axis; a test pins this), so every column is its own running sum
    in row order: one SIMD lane. Each chunk of rows starts from a row holding the accumulators
    so far (``acc + r0 + r1 + ...`` is the same chain continued); the first holds zeros, as
    torch starts (``0 + s`` is ``s`` exactly: a square is never -0). Laying bodies side by side
    only lets one NumPy call add many lanes at once (a row of 8 is mostly call overhead); no
    lane ever sees another lane's values.
    """
    lanes, dtype = bodies[0].shape[1], bodies[0].dtype
    by_length = sorted(range(len(bodies)), key=lambda t: -bodies[t].shape[0])
    rows_of = [bodies[t].shape[0] for t in by_length]
    acc = np.zeros((len(bodies), lanes), dtype)  # in by_length order
    active = sum(1 for r in rows_of if r > 0)  # the bodies still running: a prefix of by_length
    if active:
        # One row of lanes as one opaque item: laying rows side by side is then one strided
        # copy of whole rows per body (bits unchanged) instead of one small copy per row.
        row_item = np.dtype((np.void, lanes * dtype.itemsize))

        def chunk_rows(running: int) -> int:
            return max(_CHUNK_MIN_ROWS, _CHUNK_ELEMENTS // (running * lanes))

        # Sized for the largest chunk: (1 + chunk_rows(a)) * a * lanes is at most this for a <= active.
        wide_buf = np.empty(max(_CHUNK_MIN_ROWS * active * lanes, _CHUNK_ELEMENTS) + active * lanes, dtype)
        start = 0
        while active:
            rows = min(chunk_rows(active), rows_of[active - 1] - start)
            wide = wide_buf[: (1 + rows) * active * lanes].reshape(1 + rows, active, lanes)
            wide[0] = acc[:active]
            # Each part is (rows, 1) items: one body's rows as one column of the wide chunk.
            parts = [bodies[t][start : start + rows].view(row_item) for t in by_length[:active]]
            np.concatenate(parts, axis=1, out=wide.view(row_item)[1:, :, 0])
            np.multiply(wide[1:], wide[1:], out=wide[1:])
            acc[:active] = np.add.reduce(wide, axis=0)
            start += rows
            while active and rows_of[active - 1] <= start:
                active -= 1
    result = np.empty_like(acc)
    result[by_length] = acc
    return result


def _lane_order_sums(xs: Sequence[np.ndarray], lanes: int, block: int) -> np.ndarray:
    """Rule 8's vectorised torch_cpu sum of squares of each 1-D float32/float64 array: lane
    sums of the body, folded in lane order, then the tail added in index order. Returns one
    sum per array (the fold runs for all arrays at once: elementwise, the same roundings)."""
    bodies = [x[: x.size - x.size % block].reshape(-1, lanes) for x in xs]
    acc = _lane_sums(bodies)
    sums = acc[:, 0].copy()
    for j in range(1, lanes):
        sums = sums + acc[:, j]
    for t, (x, body) in enumerate(zip(xs, bodies)):
        if x.size > body.size:
            for v in x[body.size :]:
                sums[t] = sums[t] + v * v
    return sums


def _serial_sum(x: np.ndarray, num_threads: int) -> np.floating:
    """Sum of squares in ATen's generic reduction: running sums split like at::parallel_for."""
    n = x.size
    sq = x * x
    if n < _GRAIN_SIZE or num_threads == 1:
        chunks = [sq]
    else:
        used = min(num_threads, -(-n // _GRAIN_SIZE))
        size = -(-n // used)
        chunks = [sq[i : i + size] for i in range(0, n, size)]
    total = x.dtype.type(0.0)
    for chunk in chunks:
        # Each chunk starts from 0 and runs sequentially; partials are then added in order.
        total = total + np.add.accumulate(chunk)[-1]
    return total


def _round_to(value: np.floating | float, dtype: np.dtype) -> np.floating:
    """Round a float32/float64 scalar to ``dtype``: 16-bit targets go through float32."""
    if dtype in (_F16, _BF16):
        return np.asarray(np.float32(value)).astype(dtype)[()]
    return dtype.type(value)


def _exact_sum_squares(arrays: Sequence[np.ndarray]) -> float:
    """The sum of the float64 squares of all elements, with one rounding at the end."""
    if not arrays:
        return 0.0
    sq = np.concatenate([a.astype(_F64).ravel() for a in arrays])
    sq = sq * sq
    try:
        return math.fsum(sq.tolist())
    except OverflowError:
        # Finite float64 squares whose exact sum exceeds the float64 range.
        return math.inf


def _norms(flats: Sequence[np.ndarray], p: float, order: str, num_threads: int) -> list[np.floating]:
    """``tensor_norm`` of each 1-D gradient (rules 1, 7, 8), in input order.

    The torch_cpu L2 sums of one dtype are taken together (``_lane_sums``); each is still the
    sum of its own gradient alone.
    """
    norms: list[np.floating | None] = [None] * len(flats)
    lane_groups: dict[np.dtype, list[int]] = {}
    with np.errstate(over="ignore", invalid="ignore"):
        for i, x in enumerate(flats):
            dtype = x.dtype
            if x.size == 0:
                if p == math.inf:
                    # torch raises too: max has no identity element.
                    raise ValueError("the inf norm of a zero-size gradient is undefined (torch raises)")
                norms[i] = dtype.type(0.0)
            elif x.size == 1:
                # Rule 1: |x| itself, never squared (widening and narrowing back are exact).
                norms[i] = np.abs(x.astype(_opmath(dtype))).astype(dtype)[0]
            elif p == math.inf:
                norms[i] = np.max(np.abs(x.astype(_opmath(dtype)))).astype(dtype)[()]
            elif order == "exact":
                norms[i] = _round_to(math.sqrt(_exact_sum_squares([x])), dtype)
            elif dtype == _F16:
                norms[i] = np.asarray(np.sqrt(_serial_sum(x.astype(_F32), num_threads))).astype(dtype)[()]
            else:
                lane_groups.setdefault(dtype, []).append(i)
        for dtype, indices in lane_groups.items():
            # copy=False: float32/float64 gradients are read in place, bfloat16 ones widened.
            xs = [flats[i].astype(_opmath(dtype), copy=False) for i in indices]
            roots = np.sqrt(_lane_order_sums(xs, *_LANES[dtype])).astype(dtype)
            for i, root in zip(indices, roots):
                norms[i] = root
    return norms  # type: ignore[return-value]


def tensor_norm(
    g: np.ndarray, norm_type: float = 2.0, order: str = "torch_cpu", *, num_threads: int = 1
) -> np.floating:
    """The norm of one gradient, in the gradient's dtype (rules 1, 7, 8).

    ``g``: float16, bfloat16, float32 or float64 array of any shape; zero size gives 0, one
    element gives ``|x|``. ``norm_type``: 2.0 or ``math.inf`` (inf on a zero-size gradient
    raises ``ValueError``, as torch raises). ``order``: ``"torch_cpu"`` or ``"exact"``.
    ``num_threads``: torch's intra-op thread count; it only changes float16 L2 norms of at
    least 32768 elements. NaN propagates; squares that overflow float32 give inf (torch_cpu).
    """
    arr = _check_grad(g)
    p = _check_norm_type(norm_type)
    _check_order(order)
    _check_threads(num_threads)
    return _norms([arr.ravel()], p, order, num_threads)[0]


def _nonfinite_error(p: float) -> RuntimeError:
    return RuntimeError(
        f"The total norm of order {p} for gradients from `parameters` is non-finite, so it "
        "cannot be clipped. To disable this error and scale the gradients by the non-finite "
        "norm anyway, set `error_if_nonfinite=False`"
    )


def total_norm(
    grads: Sequence[np.ndarray],
    norm_type: float = 2.0,
    order: str = "torch_cpu",
    *,
    error_if_nonfinite: bool = False,
    num_threads: int = 1,
) -> np.floating:
    """The norm of the vector of per-tensor norms (rules 1-3, 6-8).

    Returns a NumPy scalar in the promoted dtype of rule 2, ``float32(0)`` for no gradients.
    With ``order="exact"`` the L2 total is the exact norm of all elements, rounded once to that
    dtype. ``error_if_nonfinite=True`` raises ``RuntimeError`` when the total is NaN or inf.
    """
    arrays = [_check_grad(g) for g in grads]
    p = _check_norm_type(norm_type)
    _check_order(order)
    _check_threads(num_threads)
    return _total_norm(arrays, p, order, error_if_nonfinite, num_threads)


def _total_norm(
    arrays: list[np.ndarray], p: float, order: str, error_if_nonfinite: bool, num_threads: int
) -> np.floating:
    """``total_norm`` of arguments already checked."""
    if not arrays:
        return np.float32(0.0)
    groups: dict[np.dtype, list[np.ndarray]] = {}
    for a in arrays:
        groups.setdefault(a.dtype, []).append(a)
    ordered = [a for dtype in _group_order(list(groups)) for a in groups[dtype]]
    out_dtype = _promote(list(groups))
    if p == 2.0 and order == "exact":
        with np.errstate(over="ignore", invalid="ignore"):
            result = _round_to(math.sqrt(_exact_sum_squares(ordered)), out_dtype)
    else:
        norms = _norms([a.ravel() for a in ordered], p, order, num_threads)
        # Widening to the promoted dtype is exact. A single gradient stacks one norm, whose
        # norm is itself (rule 1's one-element case).
        stacked = np.array(norms, dtype=out_dtype)
        result = _norms([stacked], p, order, num_threads)[0]
    if error_if_nonfinite and not np.isfinite(np.float64(result)):
        raise _nonfinite_error(p)
    return result


def _coefficient(total: np.floating, max_norm: float) -> np.floating:
    """Rule 4 and the clamp of rule 5, in the total's dtype."""
    dtype = np.asarray(total).dtype
    op = _opmath(dtype).type

    def rnd(x: np.floating) -> np.floating:
        return np.asarray(x).astype(dtype)[()]

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        shifted = rnd(op(total) + op(_round_to(EPS, dtype)))  # 1e-6 in the total's dtype first
        recip = rnd(op(1.0) / op(shifted))
        coef = rnd(op(recip) * op(max_norm))
        # np.minimum propagates NaN, as torch.clamp(max=1.0) does.
        return np.minimum(coef, dtype.type(1.0))


def _scale_into(g: np.ndarray, coef: np.floating, out: np.ndarray, coef_in_grad_dtype: bool = False) -> np.ndarray:
    """Rule 5's multiply of one gradient by the coefficient, written to ``out`` (may be ``g``);
    rule 10's promoted multiply for a 0-d gradient."""
    coef_dtype = np.asarray(coef).dtype
    if g.ndim == 0 and _opmath(_promote([g.dtype, coef_dtype])) != _opmath(g.dtype):
        wide = _opmath(_promote([g.dtype, coef_dtype]))
        out[...] = _round_to(wide.type(g.astype(wide)) * wide.type(coef), g.dtype)
        return out
    op = _opmath(g.dtype)
    if coef_in_grad_dtype:
        coef = np.asarray(coef).astype(g.dtype)[()]
    if g.dtype == op:
        np.multiply(g, op.type(coef), out=out)
    else:
        out[...] = (g.astype(op) * op.type(coef)).astype(g.dtype)
    return out


def _clip(
    arrays: list[np.ndarray],
    max_norm: float,
    norm_type: float,
    order: str,
    error_if_nonfinite: bool,
    num_threads: int,
    in_place: bool,
    coef_in_grad_dtype: bool,
) -> ClipResult:
    mx = _check_max_norm(max_norm)
    p = _check_norm_type(norm_type)
    _check_order(order)
    _check_threads(num_threads)
    total = _total_norm(arrays, p, order, error_if_nonfinite, num_threads)
    return _scale_by_total(arrays, mx, total, in_place, coef_in_grad_dtype)


def _check_max_norm(max_norm: float) -> float:
    mx = float(max_norm)
    if not mx >= 0.0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm!r}")
    return mx


def _scale_by_total(arrays: list[np.ndarray], max_norm: float, total: np.floating, in_place: bool,
                    coef_in_grad_dtype: bool) -> ClipResult:
    """Rules 4 and 5 (and 10) from the total."""
    coef = _coefficient(total, max_norm)
    with np.errstate(over="ignore", invalid="ignore"):
        clipped = tuple(_scale_into(a, coef, a if in_place else np.empty_like(a), coef_in_grad_dtype)
                        for a in arrays)
    return ClipResult(grads=clipped, total_norm=total, clip_coef=coef)


def clip_grad_norm(
    grads: Sequence[np.ndarray],
    max_norm: float,
    norm_type: float = 2.0,
    order: str = "torch_cpu",
    *,
    error_if_nonfinite: bool = False,
    num_threads: int = 1,
    coef_in_grad_dtype: bool = False,
) -> ClipResult:
    """Scale the gradients so that their total norm is at most ``max_norm`` (rules 1-8).

    ``max_norm`` must be >= 0 (inf allowed); torch does not check it and a negative one would
    flip every gradient's sign, so the spec refuses it. Clip the UNSCALED gradients: clipping
    loss-scaled gradients and unscaling afterwards divides the clipped norm by the scale.
    ``coef_in_grad_dtype=True`` is rule 5's CUDA multiply. Returns new arrays; the inputs are
    not modified.
    """
    arrays = [_check_grad(g) for g in grads]
    return _clip(arrays, max_norm, norm_type, order, error_if_nonfinite, num_threads, in_place=False,
                 coef_in_grad_dtype=coef_in_grad_dtype)


def clip_grad_norm_(
    grads: Sequence[np.ndarray],
    max_norm: float,
    norm_type: float = 2.0,
    order: str = "torch_cpu",
    *,
    error_if_nonfinite: bool = False,
    num_threads: int = 1,
    coef_in_grad_dtype: bool = False,
) -> ClipResult:
    """``clip_grad_norm`` in place, as torch's ``clip_grad_norm_``: the same rules and bits, but
    each gradient array is overwritten with its clipped values (no second set of arrays), and
    ``ClipResult.grads`` holds those same arrays. For gradients the caller owns, e.g. the new
    arrays ``reference.scaling.unscale_gradients`` returns. ``grads`` must be writeable NumPy
    arrays (anything else is a ``ValueError``: a converted copy would be clipped and lost).
    """
    arrays = []
    for i, g in enumerate(grads):
        if not isinstance(g, np.ndarray) or not g.flags.writeable:
            raise ValueError(
                f"grads[{i}] must be a writeable NumPy array to be clipped in place, got "
                f"{type(g).__name__}; use clip_grad_norm for a clipped copy"
            )
        arrays.append(_check_grad(g))
    return _clip(arrays, max_norm, norm_type, order, error_if_nonfinite, num_threads, in_place=True,
                 coef_in_grad_dtype=coef_in_grad_dtype)


def clip_grads_with_norm(
    grads: Sequence[np.ndarray],
    max_norm: float,
    total_norm: np.floating | np.ndarray,
    *,
    coef_in_grad_dtype: bool = False,
) -> ClipResult:
    """Scale the gradients by the coefficient of a given total norm (rule 11: rules 4, 5, 10).

    ``total_norm``: a float16, bfloat16, float32 or float64 scalar (a 0-d array is taken as
    its element), as torch's ``clip_grads_with_norm_`` takes a 0-d tensor. Returns new arrays
    and the total and coefficient used; the inputs are not modified.
    """
    mx = _check_max_norm(max_norm)
    total = np.asarray(total_norm)
    if total.size != 1 or total.dtype not in (np.float16, _BF16, np.float32, np.float64):
        raise ValueError(f"total_norm must be one float16, bfloat16, float32 or float64 value, got "
                         f"{total.dtype} of shape {total.shape}")
    arrays = [_check_grad(g) for g in grads]
    return _scale_by_total(arrays, mx, total.reshape(())[()], False, coef_in_grad_dtype)


def clip_grad_value(grads: Sequence[np.ndarray], clip_value: float) -> list[np.ndarray]:
    """Clamp every element to ``[-clip_value, clip_value]`` (rule 9).

    Per element: ``x < -v`` gives ``-v``, then ``x > v`` gives ``v``, otherwise ``x`` is kept
    as it is. So NaN stays NaN, ``+-inf`` becomes ``+-v``, and with ``v = 0`` a negative value
    becomes ``-0.0`` while zeros keep their sign. ``clip_value`` must be >= 0 (inf allowed) and
    must not exceed a gradient dtype's largest finite value (torch raises "value cannot be
    converted to type ... without overflow"). Returns new arrays in the input dtypes.
    """
    v = float(clip_value)
    if not v >= 0.0:
        raise ValueError(f"clip_value must be >= 0, got {clip_value!r}")
    arrays = [_check_grad(g) for g in grads]
    out = []
    for arr in arrays:
        limit = float(_finfo_max(arr.dtype))
        if math.isfinite(v) and v > limit:
            raise ValueError(
                f"clip_value must be at most {limit} (the largest finite {arr.dtype}), got {v}"
            )
        op = _opmath(arr.dtype)
        # torch converts the Python scalar to the tensor's dtype (16-bit types via float32).
        hi = op.type(_round_to(v, arr.dtype))
        lo = op.type(_round_to(-v, arr.dtype))
        x = arr.astype(op)
        x = np.where(x < lo, lo, x)
        x = np.where(x > hi, hi, x)
        out.append(x.astype(arr.dtype))
    return out


def _finfo_max(dtype: np.dtype) -> float:
    return float(ml_dtypes.finfo(dtype).max) if dtype == _BF16 else float(np.finfo(dtype).max)
