"""reference.clipping: torch's clip_grad_norm_ / clip_grad_value_ rules, bit for bit."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from reference import clipping
from reference.clipping import (
    ClipResult,
    clip_grad_norm,
    clip_grad_value,
    tensor_norm,
    total_norm,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.float32


def u32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    width = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return a.dtype == b.dtype and np.array_equal(a.view(width), b.view(width))


def lane_model(x: np.ndarray, lanes: int, block: int) -> np.floating:
    """The documented torch_cpu order, written as a plain scalar loop (independent of NumPy's
    vectorised accumulate used by the module)."""
    acc = [x.dtype.type(0.0)] * lanes
    n = x.size
    body = n - n % block
    for i in range(body):
        acc[i % lanes] = acc[i % lanes] + x[i] * x[i]
    b = acc[0]
    for j in range(1, lanes):
        b = b + acc[j]
    for i in range(body, n):
        b = b + x[i] * x[i]
    return np.sqrt(b)


# --- the worked example -------------------------------------------------------------------


def test_three_four_clips_to_unit_norm_through_reciprocal_then_multiply():
    r = clip_grad_norm([np.array([3.0, 4.0], F32)], max_norm=1.0)
    assert isinstance(r, ClipResult)
    assert r.total_norm == F32(5.0) and r.total_norm.dtype == np.float32
    # coef = f32(f32(1 / f32(5 + 1e-6)) * 1): slightly below 0.2 because of the 1e-6.
    expected = F32(F32(1.0) / F32(F32(5.0) + F32(1e-6))) * F32(1.0)
    assert u32(r.clip_coef) == u32(expected) == 0x3E4CCCCA, hex(int(u32(r.clip_coef)))
    # The grads are not exactly 0.6 / 0.8: 0x3F199998 = 0.5999999, 0x3F4CCCCA = 0.79999983.
    assert [hex(int(v)) for v in u32(r.grads[0])] == ["0x3f199998", "0x3f4cccca"]
    np.testing.assert_allclose(r.grads[0], [0.6, 0.8], rtol=1e-6)


def test_clip_before_unscale_destroys_the_gradient():
    scale = F32(1024.0)
    grads = np.array([3.0, 4.0], F32)
    scaled = grads * scale
    # Wrong order: clip the scaled gradient with the unchanged threshold, then unscale.
    wrong = clip_grad_norm([scaled], max_norm=1.0).grads[0] / scale
    assert np.linalg.norm(wrong.astype(np.float64)) < 1e-3, wrong
    # Right order: unscale, then clip: the norm is max_norm.
    right = clip_grad_norm([scaled / scale], max_norm=1.0).grads[0]
    assert abs(np.linalg.norm(right.astype(np.float64)) - 1.0) < 1e-5, right


# --- always multiplied, coefficient 1 -----------------------------------------------------


def test_coefficient_one_leaves_every_bit_unchanged():
    g = np.array([0.1, -0.2, 1e-30, -0.0, 1e-45], F32)
    r = clip_grad_norm([g], max_norm=1.0)
    assert r.clip_coef == F32(1.0)
    assert same_bits(r.grads[0], g), "a coefficient of exactly 1 must not change any bit"


def test_clip_returns_new_arrays_and_keeps_inputs():
    g = np.array([30.0, 40.0], F32)
    before = g.copy()
    r = clip_grad_norm([g], max_norm=1.0)
    assert same_bits(g, before), "the input gradient was modified"
    assert r.grads[0] is not g


# --- non-finite ---------------------------------------------------------------------------


def test_inf_gradient_zeroes_finite_grads_and_makes_nan():
    r = clip_grad_norm([np.array([1.0, np.inf, -2.0], F32), np.array([3.0, -4.0], F32)], 1.0)
    assert np.isinf(r.total_norm) and r.clip_coef == F32(0.0)
    a, b = r.grads
    assert np.isnan(a[1])
    assert same_bits(a[[0, 2]], np.array([0.0, -0.0], F32)), a
    assert same_bits(b, np.array([0.0, -0.0], F32)), "finite grads become zeros, sign kept"


def test_nan_gradient_makes_every_gradient_nan():
    r = clip_grad_norm([np.array([1.0, np.nan], F32), np.array([3.0, 4.0], F32)], 1.0)
    assert np.isnan(r.total_norm) and np.isnan(r.clip_coef)
    assert all(np.isnan(g).all() for g in r.grads)


def test_squares_overflowing_float32_silently_zero_the_gradient():
    r = clip_grad_norm([np.array([3e38, 3e38], F32)], 1.0)
    assert np.isinf(r.total_norm)
    assert same_bits(r.grads[0], np.zeros(2, F32)), r.grads[0]
    # The exact order does not overflow: it clips to the threshold instead.
    exact = clip_grad_norm([np.array([1e38, 1e38], F32)], 1.0, order="exact")
    assert np.isfinite(exact.total_norm)
    np.testing.assert_allclose(np.linalg.norm(exact.grads[0].astype(np.float64)), 1.0, rtol=1e-6)


def test_error_if_nonfinite_raises_runtime_error_like_torch():
    with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped"):
        clip_grad_norm([np.array([1.0, np.inf], F32)], 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="order inf"):
        total_norm([np.array([np.nan], F32)], math.inf, error_if_nonfinite=True)
    # Finite totals do not raise.
    assert total_norm([np.array([3.0, 4.0], F32)], error_if_nonfinite=True) == F32(5.0)


# --- empty and zero-size ------------------------------------------------------------------


def test_no_gradients_give_float32_zero_and_nothing_to_multiply():
    r = clip_grad_norm([], 1.0)
    assert r.grads == ()
    assert r.total_norm == 0.0 and np.asarray(r.total_norm).dtype == np.float32
    assert total_norm([]).dtype == np.float32


def test_zero_size_gradients_have_norm_zero_and_survive():
    empty = np.zeros((0, 3), F32)
    assert tensor_norm(empty) == F32(0.0)
    assert tensor_norm(np.zeros(0, np.float16)).dtype == np.float16
    r = clip_grad_norm([empty, np.array([3.0, 4.0], F32)], 1.0)
    assert r.total_norm == F32(5.0)
    assert r.grads[0].shape == (0, 3) and r.grads[0].dtype == np.float32
    with pytest.raises(ValueError, match="zero-size"):
        tensor_norm(empty, math.inf)


# --- dtypes, promotion and group order ----------------------------------------------------


def test_mixed_fp16_fp32_promote_to_float32_and_keep_grad_dtypes():
    g16 = np.array([3.0, 4.0], np.float16)
    g32 = np.array([12.0], F32)
    r = clip_grad_norm([g16, g32], max_norm=1.0)
    assert np.asarray(r.total_norm).dtype == np.float32 and r.total_norm == F32(13.0)
    assert r.clip_coef.dtype == np.float32
    assert r.grads[0].dtype == np.float16 and r.grads[1].dtype == np.float32
    # The float16 grads are multiplied by the float32 coefficient, then rounded once.
    expected16 = (g16.astype(F32) * r.clip_coef).astype(np.float16)
    assert same_bits(r.grads[0], expected16)


def test_per_tensor_norm_has_the_gradient_dtype():
    for dtype in (np.float16, BF16, np.float32, np.float64):
        g = np.array([3.0, 4.0]).astype(F32).astype(dtype)
        n = tensor_norm(g)
        assert np.asarray(n).dtype == np.dtype(dtype) and float(n) == 5.0


def test_all_bfloat16_total_and_coefficient_stay_bfloat16():
    g = np.array([0.3, -7.0, 2.5], F32).astype(BF16)
    r = clip_grad_norm([g], max_norm=0.5)
    assert np.asarray(r.total_norm).dtype == BF16 and np.asarray(r.clip_coef).dtype == BF16
    total = F32(r.total_norm)

    def b(x):
        return F32(np.asarray(F32(x)).astype(BF16))

    coef = b(b(F32(1.0) / b(total + F32(1e-6))) * F32(0.5))
    assert F32(r.clip_coef) == coef


def test_dtype_groups_follow_torch_hash_order_not_first_appearance():
    a, c = F32(8.0), F32(9.2)
    b = 2.7
    grads = [np.array([a], F32), np.array([b], np.float64), np.array([c], F32)]
    total = total_norm(grads)
    # torch visits the float64 group before the float32 one here.
    torch_order = tensor_norm(np.array([b, a, c], np.float64))
    first_appearance = tensor_norm(np.array([a, c, b], np.float64))
    assert torch_order != first_appearance, "example no longer distinguishes the orders"
    assert same_bits(total, torch_order), (total, torch_order)


# --- summation orders ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 8, 9, 23, 64, 333])
def test_torch_cpu_float32_order_is_eight_lanes_then_fold_then_tail(n):
    x = np.random.default_rng(n).standard_normal(n).astype(F32) * F32(37.0)
    assert same_bits(tensor_norm(x), lane_model(x, 8, 8))


def test_torch_cpu_float64_uses_four_lanes():
    x = np.random.default_rng(1).standard_normal(103)
    assert same_bits(tensor_norm(x), lane_model(x, 4, 4))


@pytest.mark.parametrize("n", [15, 16, 17, 40, 95])
def test_torch_cpu_bfloat16_uses_sixteen_element_blocks_in_eight_float32_lanes(n):
    x = np.random.default_rng(n).standard_normal(n).astype(F32).astype(BF16)
    expected = np.asarray(lane_model(x.astype(F32), 8, 16)).astype(BF16)
    assert same_bits(tensor_norm(x), expected)


def test_torch_cpu_float16_running_sum_splits_by_thread_count():
    x = (np.random.default_rng(2).standard_normal(70001) * 3).astype(np.float16)
    sq = x.astype(F32) ** 2
    one = np.add.accumulate(sq)[-1]  # one thread: a single running sum
    # Two threads: ceil(70001 / 2) = 35001 elements per chunk, partial sums added in order.
    two = F32(0.0) + np.add.accumulate(sq[:35001])[-1]
    two = two + np.add.accumulate(sq[35001:])[-1]
    assert same_bits(tensor_norm(x), np.asarray(np.sqrt(one)).astype(np.float16))
    assert same_bits(tensor_norm(x, num_threads=2), np.asarray(np.sqrt(two)).astype(np.float16))


def test_exact_and_torch_cpu_differ_on_a_long_vector_and_exact_is_closer():
    x = (np.random.default_rng(3).random(1_000_000) + 0.5).astype(F32)
    truth = math.sqrt(math.fsum((x.astype(np.float64) ** 2).tolist()))
    fast = tensor_norm(x, order="torch_cpu")
    exact = tensor_norm(x, order="exact")
    assert fast != exact, "a million-term float32 running sum should drift"
    assert abs(float(exact) - truth) < abs(float(fast) - truth)
    assert abs(float(exact) - truth) <= np.spacing(F32(truth)) / 2


def test_exact_total_is_the_norm_of_all_elements():
    grads = [np.array([3.0], F32), np.array([4.0], np.float16)]
    assert total_norm(grads, order="exact") == F32(5.0)


# --- inf norm -----------------------------------------------------------------------------


def test_inf_norm_is_max_abs_per_tensor_and_max_overall():
    grads = [np.array([1.0, -7.5], F32), np.array([3.0, 6.0], np.float16)]
    assert tensor_norm(grads[0], math.inf) == F32(7.5)
    total = total_norm(grads, math.inf)
    assert total == F32(7.5) and np.asarray(total).dtype == np.float32
    r = clip_grad_norm(grads, 3.0, math.inf)
    assert abs(float(np.abs(r.grads[0]).max()) - 3.0) < 1e-5
    assert np.isnan(total_norm([np.array([np.nan, 1.0], F32)], math.inf))


# --- clip_grad_value ----------------------------------------------------------------------


def test_clip_grad_value_clamps_keeps_nan_and_bounds_inf():
    g = np.array([-3.0, -0.5, np.nan, 2.0, np.inf, -np.inf], F32)
    (out,) = clip_grad_value([g], 1.0)
    assert np.isnan(out[2])
    assert same_bits(out[[0, 1, 3, 4, 5]], np.array([-1.0, -0.5, 1.0, 1.0, -1.0], F32))


def test_clip_grad_value_zero_keeps_signs_of_zero():
    (out,) = clip_grad_value([np.array([-3.0, 2.0, 0.0, -0.0], F32)], 0.0)
    assert same_bits(out, np.array([-0.0, 0.0, 0.0, -0.0], F32)), out


def test_clip_grad_value_rounds_the_bound_to_the_gradient_dtype():
    (out,) = clip_grad_value([np.array([5.0, -5.0], F32).astype(BF16)], 0.1)
    bound = np.asarray(F32(0.1)).astype(BF16)
    assert out.dtype == BF16 and out[0] == bound and out[1] == -bound


# --- bad arguments ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: clip_grad_norm([np.ones(2, F32)], 1.0, norm_type=1.0), "norm_type"),
        (lambda: total_norm([np.ones(2, F32)], norm_type=3), "norm_type"),
        (lambda: clip_grad_norm([np.ones(2, F32)], 1.0, order="fast"), "order"),
        (lambda: clip_grad_norm([np.ones(2, F32)], -1.0), "max_norm"),
        (lambda: clip_grad_norm([np.ones(2, F32)], float("nan")), "max_norm"),
        (lambda: clip_grad_norm([np.ones(2, np.int32)], 1.0), "dtype"),
        (lambda: tensor_norm(np.ones(2, F32), num_threads=0), "num_threads"),
        (lambda: clip_grad_value([np.ones(2, F32)], -1.0), "clip_value"),
        (lambda: clip_grad_value([np.ones(2, np.float16)], 70000.0), "clip_value"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("n", [8, 24, 8 * 1000 + 5, 8 * 2**17])
def test_lane_sums_are_running_sums_in_index_order(n):
    # The torch_cpu order relies on NumPy reducing a (rows, 8) array row by row; pin it against
    # the strictly sequential running sum, on values whose sum depends on the order.
    x = (np.random.default_rng(n).standard_normal(n) * np.logspace(-3, 3, n)).astype(np.float32)
    body = n - n % 8
    sq = x[:body] * x[:body]
    expected = np.add.accumulate(sq.reshape(-1, 8), axis=0)[-1]
    actual = np.add.reduce(sq.reshape(-1, 8), axis=0)
    assert actual.tobytes() == expected.tobytes()


def test_wide_rows_are_still_reduced_one_row_at_a_time():
    # _lane_sums lays several gradients' rows side by side: a (rows, gradients, lanes) array
    # reduced over axis 0 must still give each column its running sum in row order.
    rng = np.random.default_rng(5)
    wide = (rng.standard_normal((3001, 7, 8)) * np.logspace(-3, 3, 8)).astype(np.float32) ** 2
    expected = np.add.accumulate(wide, axis=0)[-1]
    assert np.add.reduce(wide, axis=0).tobytes() == expected.tobytes()


# --- the side-by-side lane sums against the plain rule ------------------------------------

EDGE_VALUES = np.array([np.inf, -np.inf, np.nan, 3e38, -2e19, 1e-45, -1e-40, 1e-20, 0.0, -0.0, 1.0], np.float64)


def _edge_gradients(dtype, sizes, seed):
    """Gradients of ``sizes`` elements: random magnitudes, some with inf/NaN/overflowing squares/
    subnormals planted."""
    rng = np.random.default_rng(seed)
    grads = []
    for k, n in enumerate(sizes):
        x = rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30)
        if n and k % 3 == 1:
            x[rng.integers(0, n, 3)] = rng.choice(EDGE_VALUES, 3)
        with np.errstate(over="ignore", under="ignore"):
            grads.append(x.astype(F32).astype(dtype) if dtype != np.float64 else x)
    return grads


def plain_norm(g: np.ndarray) -> np.floating:
    """Rule 8 for one gradient, as a plain scalar loop (lane_model), with rule 1's one-element case."""
    dtype = g.dtype
    flat = g.ravel()
    if flat.size == 1:
        return np.abs(flat.astype(np.float64)).astype(dtype)[0]
    lanes, block = {np.dtype(F32): (8, 8), np.dtype(np.float64): (4, 4), BF16: (8, 16)}[dtype]
    with np.errstate(over="ignore", invalid="ignore"):
        root = lane_model(flat.astype(np.float64 if dtype == np.float64 else F32), lanes, block)
    return np.asarray(root).astype(dtype)[()]


@pytest.mark.parametrize("dtype", [np.dtype(F32), np.dtype(np.float64), BF16], ids=str)
def test_norms_taken_side_by_side_equal_each_gradient_alone(monkeypatch, dtype):
    # Tiny chunks so that a few hundred elements cross many chunk boundaries, with gradients
    # ending inside, at and between them.
    monkeypatch.setattr(clipping, "_CHUNK_ELEMENTS", 40)
    monkeypatch.setattr(clipping, "_CHUNK_MIN_ROWS", 3)
    sizes = [0, 1, 2, 7, 8, 9, 16, 17, 24, 40, 41, 95, 96, 200, 333, 517]
    grads = _edge_gradients(dtype, sizes, seed=len(sizes))
    with np.errstate(over="ignore", invalid="ignore"):
        together = clipping._norms([g.ravel() for g in grads], 2.0, "torch_cpu", 1)
    for g, n in zip(grads, together):
        alone = plain_norm(g) if g.size else dtype.type(0.0)
        assert same_bits(np.asarray(n), np.asarray(alone)) or (np.isnan(n) and np.isnan(alone)), (g.size, n, alone)


def test_total_norm_equals_the_norm_of_the_stacked_plain_norms(monkeypatch):
    monkeypatch.setattr(clipping, "_CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(clipping, "_CHUNK_MIN_ROWS", 2)
    for seed in range(6):
        grads = _edge_gradients(np.dtype(F32), [9, 64, 1, 130, 33, 8 * 40 + 3], seed)
        stacked = np.array([plain_norm(g) for g in grads], F32)
        assert same_bits(np.asarray(total_norm(grads)), np.asarray(plain_norm(stacked))) or np.isnan(total_norm(grads))


# --- one element: |x|, never squared (rule 1) ----------------------------------------------


@pytest.mark.parametrize("shape", [(1,), (), (1, 1, 1)])
def test_one_element_norm_is_its_absolute_value_never_squared(shape):
    for value in (1e30, -1e30, 3e38, -1e-30, 2.0**-149, 1e-20, -0.0):
        g = np.array(value, F32).reshape(shape)
        for p in (2.0, math.inf):
            for order in ("torch_cpu", "exact"):
                assert same_bits(np.asarray(tensor_norm(g, p, order)), np.abs(np.array(value, F32))), (value, p, order)
    assert tensor_norm(np.array([1e200]), 2.0) == 1e200
    assert tensor_norm(np.array([-1e-200]), 2.0) == 1e-200
    big = np.asarray(np.float32(3e38)).astype(BF16).reshape(1)
    assert same_bits(np.asarray(tensor_norm(big)), big[0])
    assert np.isnan(tensor_norm(np.array([np.nan], F32))) and tensor_norm(np.array([-np.inf], F32)) == np.inf
    # Two elements square: [1e30, 0] overflows, as in torch.
    assert np.isinf(tensor_norm(np.array([1e30, 0.0], F32)))


def test_a_single_one_element_gradient_clips_by_its_absolute_value():
    r = clip_grad_norm([np.array([1e30], F32)], max_norm=1.0)
    assert r.total_norm == F32(1e30), "the total of one gradient is its norm, not inf"
    assert r.grads[0][0] == F32(F32(F32(1.0) / F32(F32(1e30) + F32(1e-6))) * F32(1e30))
    tiny = clip_grad_norm([np.array([1e-30], F32)], max_norm=1.0)
    assert tiny.total_norm == F32(1e-30) and tiny.clip_coef == F32(1.0)
    # With a second gradient the stacked norms are squared again: 1e30 overflows there.
    assert np.isinf(total_norm([np.array([1e30], F32), np.array([1.0], F32)]))


# --- in place --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_clip_in_place_gives_the_bits_of_the_copying_clip(seed):
    grads = [g.copy() for dtype in (np.dtype(F32), BF16, np.dtype(np.float16), np.dtype(np.float64))
             for g in _edge_gradients(dtype, [3, 1, 40, 0, 17], seed)]
    grads.append(np.array([[1e-45, -3e38], [2.0, -0.0]], F32).T)  # not C-contiguous
    copies = [g.copy() for g in grads]
    with np.errstate(over="ignore"):
        expected = clip_grad_norm(copies, 0.5)
        actual = clipping.clip_grad_norm_(grads, 0.5)
    assert same_bits(np.asarray(actual.total_norm), np.asarray(expected.total_norm)) or np.isnan(expected.total_norm)
    for g, got, want in zip(grads, actual.grads, expected.grads):
        assert got is g, "clip_grad_norm_ must return the arrays it was given"
        nan = np.isnan(want.astype(np.float64))
        assert np.array_equal(nan, np.isnan(got.astype(np.float64)))
        assert same_bits(got[~nan], want[~nan])


def test_clip_in_place_refuses_what_it_cannot_overwrite():
    frozen = np.ones(3, F32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"grads\[0\] must be a writeable NumPy array"):
        clipping.clip_grad_norm_([frozen], 1.0)
    with pytest.raises(ValueError, match=r"grads\[1\] must be a writeable NumPy array"):
        clipping.clip_grad_norm_([np.ones(2, F32), [1.0, 2.0]], 1.0)


def test_cuda_rule_rounds_the_coefficient_to_a_16_bit_gradient_dtype():
    # Rule 5: a float32 total (bfloat16 mixed with float32) gives a float32 coefficient; the CUDA
    # multiply meets bfloat16 255 with 1/255 rounded to bfloat16 (2**-8), the CPU one in float32.
    bf = np.array([255.0], dtype=ml_dtypes.bfloat16)
    f32 = np.array([1.0, 2.0], np.float32)
    cpu = clipping.clip_grad_norm([bf, f32], 1.0)
    cuda = clipping.clip_grad_norm([bf, f32], 1.0, coef_in_grad_dtype=True)
    assert cpu.clip_coef == cuda.clip_coef and cpu.clip_coef.dtype == np.float32
    assert float(cpu.grads[0][0]) == 1.0 and float(cuda.grads[0][0]) == 255 / 256
    # float32 gradients see the same float32 coefficient either way.
    assert cpu.grads[1].tobytes() == cuda.grads[1].tobytes()
    inplace = [bf.copy(), f32.copy()]
    clipping.clip_grad_norm_(inplace, 1.0, coef_in_grad_dtype=True)
    assert inplace[0].tobytes() == cuda.grads[0].tobytes()


def test_rule_10_a_zero_d_gradient_promotes_with_a_float64_coefficient():
    # total ~ 1e60 (float64), coefficient ~ 1e-60: zero in float32, normal in float64, so the
    # promoted product 1e30 * 1e-60 = 1e-30 survives where f32(coef) would give 0.
    g0 = np.asarray(np.float32(1e30))
    g1 = np.array([1e60], np.float64)
    res = clipping.clip_grad_norm([g0, g1], 1.0)
    coef = res.clip_coef
    assert res.grads[0].dtype == np.float32 and res.grads[0].shape == ()
    assert res.grads[0] == np.float32(np.float64(g0) * coef) and res.grads[0] > 0
    # The same value with one dimension does not promote: the coefficient is rounded first.
    res1 = clipping.clip_grad_norm([g0.reshape(1), g1], 1.0)
    assert res1.grads[0][0] == np.float32(0.0)
    # Where the promoted dtype is the gradient's own op math, the rules agree.
    b = np.asarray(np.float32(3.0)).astype(ml_dtypes.bfloat16)
    r0 = clipping.clip_grad_norm([b, np.array([7.0], np.float32)], 1.0)
    r1 = clipping.clip_grad_norm([b.reshape(1), np.array([7.0], np.float32)], 1.0)
    assert r0.grads[0].tobytes() == r1.grads[0].tobytes()


def test_rule_4_a_16_bit_total_adds_1e_6_in_its_own_dtype():
    # bfloat16 total 3.4488e-09 and max_norm 1.7244e-09 (found by the thorough run): torch adds
    # bfloat16(1e-6), not float32(1e-6), before the reciprocal; max_norm stays float32.
    total = np.asarray(np.float32(3.4488e-09)).astype(ml_dtypes.bfloat16)
    coef = clipping._coefficient(total[()], 1.724401954561472e-09)
    r = lambda x: np.asarray(np.float32(x)).astype(ml_dtypes.bfloat16)
    f = np.float32
    expected = r(f(r(f(1) / f(r(f(total) + f(r(1e-6)))))) * f(1.724401954561472e-09))
    assert coef.dtype == ml_dtypes.bfloat16 and coef.tobytes() == expected.tobytes()
    assert np.asarray(coef).view(np.uint16) == 0x3AE3


def test_clip_grads_with_norm_of_the_computed_total_is_clip_grad_norm():
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(n).astype(d) for n, d in ((37, np.float32), (5, np.float64), (9, ml_dtypes.bfloat16))]
    whole = clipping.clip_grad_norm(grads, 0.5)
    halves = clipping.clip_grads_with_norm(grads, 0.5, whole.total_norm)
    assert whole.clip_coef.tobytes() == halves.clip_coef.tobytes()
    for a, b in zip(whole.grads, halves.grads):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_clip_grads_with_norm_takes_the_coefficient_in_the_given_totals_dtype():
    g = [np.array([1.0, -3.0], np.float32)]
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        res = clipping.clip_grads_with_norm(g, 1.0, np.asarray(7.0, dtype))
        assert np.asarray(res.clip_coef).dtype == np.dtype(dtype)
    assert clipping.clip_grads_with_norm(g, 1.0, np.float32(0.5)).grads[0].tobytes() == g[0].tobytes()  # clamp: 1.0


@pytest.mark.parametrize("total,match", [(np.array([1.0, 2.0], np.float32), "one float16"),
                                         (np.int32(3), "one float16"), (np.float32(1.0), None)])
def test_clip_grads_with_norm_refuses_what_is_not_one_float_total(total, match):
    if match is None:
        with pytest.raises(ValueError, match="max_norm must be >= 0"):
            clipping.clip_grads_with_norm([np.ones(2, np.float32)], -1.0, total)
        return
    with pytest.raises(ValueError, match=match):
        clipping.clip_grads_with_norm([np.ones(2, np.float32)], 1.0, total)
