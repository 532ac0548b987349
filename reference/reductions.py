"""torch's CPU reductions of float32/float64 tensors, in torch's order of additions.

A floating-point sum depends on the order of its additions; torch's CPU kernels have a fixed
one (for a fixed thread count), and these functions follow it, so that a spec built on them
(`reference.optim.adafactor`) matches torch bit for bit. ``f`` rounds to the array's dtype;
every addition and product below is rounded separately, as under
``ATEN_CPU_CAPABILITY=default``.

Rules:

1. Vectors. ATen's kernels work on vectors of ``vector_bytes`` bytes, ``L = vector_bytes //
   itemsize`` lanes: 32 bytes under ``ATEN_CPU_CAPABILITY=default`` (8 float32 lanes, 4 float64
   ones) and AVX2, 64 under AVX512. The default here is 32, the exact mode.
2. Sequential sum ``seq(acc, x_0..x_{n-1})``: ``acc = f(acc + x_k)`` for k in order.
3. L2 norm over a contiguous run of ``n`` elements (``torch.linalg.vector_norm(x, 2)`` of a whole
   contiguous tensor, or over its last dimension of size > 1; the ``is_reduce_lastdim`` path of
   ReduceOpsKernel.cpp): lane ``j`` holds ``seq(0, f(x_i * x_i) for i = kL + j, k < n // L)``;
   the lanes fold left to right, ``b = seq(lane_0, lane_1..lane_{L-1})``; the ``n % L`` tail
   elements follow, ``b = seq(b, f(x_i * x_i))``; the norm is ``f(sqrt(b))``.
4. L2 norm over any other dimension (Reduce.h's ``binary_kernel_reduce``): per output,
   ``f(sqrt(seq(0, f(x_i * x_i))))`` over the reduced dimension in order. A dimension of size 1
   gives ``f(sqrt(f(x * x)))`` either way; an empty reduction gives 0.
5. Cascade sum (SumKernel.cpp's ``multi_row_sum``) of ``size`` rows of accumulators: the level
   step is ``s = 2 ** max(4, ceil_log2(size) // 4)``; four levels ``a_0..a_3`` start at 0; while
   ``s`` rows remain, ``a_0 = seq(a_0, next s rows)``, then for level ``j = 1, 2, 3``:
   ``a_j = f(a_j + a_{j-1})``, ``a_{j-1} = 0``, stopping after level j unless the rows consumed
   are a multiple of ``s ** (j + 1)`` (bits ``j*p .. (j+1)*p - 1`` of the count are zero);
   the remaining rows go into ``a_0``; the result is ``seq(a_0, a_1, a_2, a_3)``.
6. ``row_sum`` of ``n`` items (scalars or lane vectors): the first ``4 * (n // 4)`` items as rows
   of 4 accumulators, cascaded (rule 5); the last ``n % 4`` items are added to accumulator 0 in
   order; then ``seq(acc_0, acc_1, acc_2, acc_3)``.
7. ``torch.sum`` over the last dimension (length ``n``, contiguous), per output: with ``n >= L``
   the first ``L * (n // L)`` elements are ``n // L`` lane vectors summed by ``row_sum``
   (rule 6) into L lanes; a scalar accumulator starts at 0, takes the ``n % L`` tail elements
   in order, then the L lanes in order. With ``n < L``: ``row_sum`` of the scalars. The output
   is ``f(0 + acc)`` (the output starts at 0 and accumulates, so -0.0 becomes +0.0).
8. ``torch.sum`` over another dimension of length ``n`` with ``inner`` contiguous outputs after
   it (each outer slice on its own): with ``inner >= L``, outputs in whole groups of ``4L`` are
   each the plain cascade (rule 5) of their column; then outputs in whole groups of ``L`` and
   the last ``inner % L`` outputs are each the ``row_sum`` (rule 6) of their column. With
   ``inner < L``: whole groups of 4 outputs are plain cascades, the rest ``row_sum``.
9. ``torch.mean`` is ``f(sum / f(n))``.
10. Scope: one thread (torch splits a reduction of 32768 elements or more across threads,
   differently for each thread count; the conformance suite pins one thread), C-contiguous
   inputs, one reduced dimension (or all of a contiguous tensor for the norm).
11. L2 norm of a bfloat16 or float16 tensor (S; `norm2_16`): each square is exact in float32
   (8- or 11-bit significands), the sums are float32, the norm is ``S(sqrt(acc))``, one
   rounding. bfloat16 over a contiguous run (rule 3's case): 8 float32 lanes; each block of 16
   elements adds its first 8 squares lane by lane, then its last 8 (torch converts a 16-element
   bfloat16 vector into two float32 vectors); the lanes fold left to right and the ``n % 16``
   tail follows in order. float16 over any run, and bfloat16 over any other dimension: one
   float32 accumulator in order (torch's scalar ``NormTwoOps`` loop). Measured on torch 2.13
   with sums crafted to lie within a float32 rounding of an S rounding boundary (any other
   order misses some): the same on the scalar, AVX2 and AVX512 kernels (the blocks do not
   widen on AVX512; the products being exact, contracting them changes nothing).
12. ``torch.mean`` of an S tensor (`mean_16`): the input is read into float32, summed as rules
   7-8 sum float32, divided by ``f32(n)`` and rounded once to S (torch's CPU mean sums reduced
   precision in float32 and casts the quotient).
"""

from __future__ import annotations

import numpy as np

__all__ = ["EXACT_VECTOR_BYTES", "cascade", "lanes", "mean", "mean_16", "norm2", "norm2_16", "row_sum", "sum_along"]

EXACT_VECTOR_BYTES = 32


def lanes(dtype: np.dtype, vector_bytes: int = EXACT_VECTOR_BYTES) -> int:
    """Rule 1: the lanes of one vector of ``dtype``."""
    return vector_bytes // np.dtype(dtype).itemsize


def _seq(acc: np.ndarray, items: np.ndarray, axis: int) -> np.ndarray:
    """Rule 2 along ``axis`` of ``items`` (``acc`` has the shape of one item). ``accumulate`` is
    a strict left-to-right recurrence (``np.sum`` would add pairwise)."""
    items = np.moveaxis(items, axis, 0)
    if items.shape[0] == 0:
        return np.array(acc, copy=True)
    stacked = np.concatenate([np.asarray(acc, items.dtype)[None], items], axis=0)
    return np.add.accumulate(stacked, axis=0)[-1]


def _ceil_log2(x: int) -> int:
    return 1 if x <= 2 else (x - 1).bit_length()


def cascade(rows: np.ndarray) -> np.ndarray:
    """Rule 5: ``rows`` of shape ``(..., size, K)``, summed over ``size`` into ``(..., K)``."""
    size = rows.shape[-2]
    power = max(4, _ceil_log2(size) // 4)
    step, mask = 1 << power, (1 << power) - 1
    zero = np.zeros(rows.shape[:-2] + rows.shape[-1:], rows.dtype)
    acc = [zero.copy() for _ in range(4)]
    i = 0
    while i + step <= size:
        acc[0] = _seq(acc[0], rows[..., i:i + step, :], -2)
        i += step
        for j in range(1, 4):
            acc[j] = acc[j] + acc[j - 1]
            acc[j - 1] = zero.copy()
            if i & (mask << (j * power)):
                break
    acc[0] = _seq(acc[0], rows[..., i:, :], -2)
    return _seq(acc[0], np.stack(acc[1:], axis=-2), -2)


def row_sum(items: np.ndarray) -> np.ndarray:
    """Rule 6: ``items`` of shape ``(..., n, K)`` (K = 1 for scalars, L for lane vectors)."""
    n, k = items.shape[-2], items.shape[-1]
    whole = 4 * (n // 4)
    grouped = items[..., :whole, :].reshape(items.shape[:-2] + (n // 4, 4 * k))
    parts = cascade(grouped).reshape(items.shape[:-2] + (4, k))
    first = _seq(parts[..., 0, :], items[..., whole:, :], -2)
    return _seq(first, parts[..., 1:, :], -2)


def _inner_sum(x: np.ndarray, vector_bytes: int) -> np.ndarray:
    """Rule 7: ``x`` of shape ``(B, n)``, summed over ``n``."""
    b, n = x.shape
    width = lanes(x.dtype, vector_bytes)
    if n < width:
        acc = row_sum(x[:, :, None])[:, 0]
    else:
        count = n // width
        vec = row_sum(x[:, :count * width].reshape(b, count, width))
        acc = _seq(np.zeros(b, x.dtype), x[:, count * width:], -1)
        acc = _seq(acc, vec, -1)
    return np.zeros(b, x.dtype) + acc


def _outer_sum(x: np.ndarray, vector_bytes: int) -> np.ndarray:
    """Rule 8: ``x`` of shape ``(B, n, inner)``, summed over ``n``."""
    b, _, inner = x.shape
    width = lanes(x.dtype, vector_bytes)
    group = 4 * width if inner >= width else 4
    plain = group * (inner // group)
    cols = np.swapaxes(x, 1, 2)[..., None]  # (B, inner, n, 1): one column per output
    out = np.empty((b, inner), x.dtype)
    if plain:
        out[:, :plain] = cascade(cols[:, :plain])[..., 0]
    if plain < inner:
        out[:, plain:] = row_sum(cols[:, plain:])[..., 0]
    return np.zeros((b, inner), x.dtype) + out


def sum_along(x: np.ndarray, axis: int, vector_bytes: int = EXACT_VECTOR_BYTES) -> np.ndarray:
    """``torch.sum(x, dim=axis, keepdim=True)`` (rules 7, 8) of a C-contiguous array."""
    x = np.ascontiguousarray(x)
    axis = axis % x.ndim
    outer, n = int(np.prod(x.shape[:axis], dtype=np.int64)), x.shape[axis]
    inner = int(np.prod(x.shape[axis + 1:], dtype=np.int64))
    keep = x.shape[:axis] + (1,) + x.shape[axis + 1:]
    if n == 0:
        return np.zeros(keep, x.dtype)
    if inner == 1:
        return _inner_sum(x.reshape(outer, n), vector_bytes).reshape(keep)
    return _outer_sum(x.reshape(outer, n, inner), vector_bytes).reshape(keep)


def mean(x: np.ndarray, axis: int, vector_bytes: int = EXACT_VECTOR_BYTES) -> np.ndarray:
    """Rule 9: ``torch.mean(x, dim=axis, keepdim=True)``."""
    return sum_along(x, axis, vector_bytes) / x.dtype.type(x.shape[axis])


def _norm_lastdim(x: np.ndarray, vector_bytes: int) -> np.ndarray:
    """Rule 3: ``x`` of shape ``(B, n)``, the norm of each row."""
    b, n = x.shape
    width = lanes(x.dtype, vector_bytes)
    count = n // width
    squares = x * x
    # Each lane starts at +0 and every square is >= +0, so the lanes are plain sums of their
    # squares; NumPy reduces an axis that is not the innermost one in order (its pairwise
    # summation only runs along the innermost axis), and without the copies of ``_seq``.
    lane = np.add.reduce(squares[:, :count * width].reshape(b, count, width), axis=1)
    folded = _seq(lane[:, 0], lane[:, 1:], -1)
    return np.sqrt(_seq(folded, squares[:, count * width:], -1))


def norm2(x: np.ndarray, axis: int | None = None, vector_bytes: int = EXACT_VECTOR_BYTES) -> np.ndarray:
    """``torch.linalg.vector_norm(x, 2, dim=axis, keepdim=True)`` of a C-contiguous float32/float64
    array (rules 3, 4); ``axis=None``: over the whole array, a 0-d result."""
    x = np.ascontiguousarray(x)
    with np.errstate(all="ignore"):
        if axis is None:
            return _norm_lastdim(x.reshape(1, -1), vector_bytes).reshape(())
        axis = axis % x.ndim
        n = x.shape[axis]
        keep = x.shape[:axis] + (1,) + x.shape[axis + 1:]
        if x.size == 0:
            return np.zeros(keep, x.dtype)
        if all(d == 1 for d in x.shape[axis + 1:]):
            return _norm_lastdim(x.reshape(-1, n), vector_bytes).reshape(keep)
        moved = np.moveaxis(x, axis, -1)
        acc = _seq(np.zeros(moved.shape[:-1], x.dtype), moved * moved, -1)
        return np.expand_dims(np.sqrt(acc), axis)


# Rule 11: bfloat16's contiguous norm: 8 float32 lanes fed by blocks of 16 elements.
_BF16_LANES, _BF16_BLOCK = 8, 16


def _blocked_lanes(sq: np.ndarray, width: int, block: int) -> np.ndarray:
    """Rule 11: ``sq`` (float32 squares, shape ``(B, n)``) summed as ``width`` lanes over whole
    blocks of ``block`` elements (each block feeds the lanes ``block // width`` times in order),
    the lanes folded left to right, then the tail in order."""
    b, n = sq.shape
    head = n - n % block
    lane = np.add.reduce(sq[:, :head].reshape(b, head // width, width), axis=1)  # in order: not innermost
    folded = _seq(lane[:, 0], lane[:, 1:], -1)
    return _seq(folded, sq[:, head:], -1)


def norm2_16(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Rule 11: ``torch.linalg.vector_norm(x, 2, dim=axis, keepdim=True)`` of a C-contiguous
    bfloat16 or float16 array, in its dtype; ``axis=None``: over the whole array, a 0-d result."""
    x = np.ascontiguousarray(x)
    storage = x.dtype
    with np.errstate(all="ignore"):
        sq = x.astype(np.float32)
        sq = sq * sq  # exact: an S significand has at most 11 bits
        lanes_bf16 = storage.name == "bfloat16"
        if axis is None:
            rows, keep = sq.reshape(1, -1), ()
        else:
            axis = axis % x.ndim
            keep = x.shape[:axis] + (1,) + x.shape[axis + 1:]
            if x.size == 0:
                return np.zeros(keep, storage)
            if not all(d == 1 for d in x.shape[axis + 1:]):
                moved = np.moveaxis(sq, axis, -1)
                acc = _seq(np.zeros(moved.shape[:-1], np.float32), moved, -1)
                return np.expand_dims(np.sqrt(acc), axis).astype(storage)
            rows = sq.reshape(-1, x.shape[axis])
        if lanes_bf16:
            acc = _blocked_lanes(rows, _BF16_LANES, _BF16_BLOCK)
        else:
            acc = _seq(np.zeros(rows.shape[0], np.float32), rows, -1)
        return np.sqrt(acc).reshape(keep).astype(storage)


def mean_16(x: np.ndarray, axis: int) -> np.ndarray:
    """Rule 12: ``torch.mean(x, dim=axis, keepdim=True)`` of a bfloat16 or float16 array, in its dtype."""
    wide = np.ascontiguousarray(x).astype(np.float32)
    return (sum_along(wide, axis) / np.float32(x.shape[axis])).astype(x.dtype)
