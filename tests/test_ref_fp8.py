"""reference.fp8: the rules of scaled float8 training, checked on values worked out by hand.

torch is not imported here; the conformance suite (conformance/test_fp8.py) compares the same
functions with torchao bit for bit.
"""

from __future__ import annotations

import io
import math
from contextlib import redirect_stdout

import ml_dtypes
import numpy as np
import pytest

from reference import __main__ as cli
from reference import formats, fp8

E4 = "float8_e4m3fn"
BF16 = np.dtype(ml_dtypes.bfloat16)
FLT_MAX = float(np.finfo(np.float32).max)


def f32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


# ----------------------------------------------------------------------------- rules 1-6


def test_fp8_max_per_format_and_a_clear_error_otherwise():
    assert [fp8.fp8_max(f) for f in fp8.FP8_FORMATS] == [448.0, 57344.0, 240.0, 57344.0]
    with pytest.raises(ValueError, match="fmt must be one of"):
        fp8.fp8_max("bfloat16")


def test_amax_tensorwise_axiswise_nan_and_empty():
    x = f32([[1.0, -3.0], [0.5, 2.0]])
    assert fp8.amax(x) == 3.0 and fp8.amax(x).shape == ()
    assert fp8.amax(x, axis=-1).tolist() == [[3.0], [2.0]]
    assert fp8.amax(x, axis=0).tolist() == [[1.0, 3.0]]
    assert np.isnan(fp8.amax(f32([1.0, np.nan, 2.0])))
    assert fp8.amax(f32([[1.0, np.nan], [2.0, 0.0]]), axis=-1)[1, 0] == 2.0  # only its own row
    bf = np.array([-1.0078125, 0.5], BF16)  # exact in bfloat16, and so in the amax
    assert fp8.amax(bf) == np.float32(1.0078125)
    with pytest.raises(ValueError, match="empty"):
        fp8.amax(np.zeros((0, 3), np.float32))
    with pytest.raises(ValueError, match="float32, bfloat16"):
        fp8.amax(np.zeros(3, np.int32))


def test_scale_divides_in_float64_after_a_float64_clamp():
    assert fp8.amax_to_scale(f32(3.0), E4) == np.float32(448 / 3)
    assert fp8.amax_to_scale(f32(2.0), "float8_e5m2") == np.float32(28672.0)
    # Zeros and anything below 1e-12 share one scale, fp8_max * 1e12.
    for tiny in (0.0, 2.0**-149, 1e-20):
        assert fp8.amax_to_scale(f32(tiny), E4) == np.float32(448 / 1e-12)
    # The clamp is the float64 1e-12: the next float32 above it is divided as it is.
    above = np.nextafter(np.float32(1e-12), np.float32(1))
    assert float(np.float32(1e-12)) < 1e-12 < float(above)
    assert fp8.amax_to_scale(f32(above), E4) == np.float32(448 / float(above)) < np.float32(448 / 1e-12)
    assert fp8.amax_to_scale(f32(np.inf), E4) == 0.0
    assert np.isnan(fp8.amax_to_scale(f32(np.nan), E4))
    assert fp8.amax_to_scale(f32([[1.0], [2.0]]), E4).shape == (2, 1)


def test_torchaos_power_of_two_is_not_an_exact_floor():
    a = f32(cli.FP8_POW2_AMAX)  # amax just above 448 / 256
    s = fp8.amax_to_scale(a, E4)
    assert 255.99 < s < 256  # two ULPs below 2^8
    assert fp8.round_scale_down_to_power_of_2(s) == 256.0  # float32 log2(s) rounds to 8
    assert fp8.exact_power_of_2_floor(s) == 128.0
    assert fp8.amax_to_scale(a, E4, power_of_2=True) == 256.0
    # So the largest element is pushed past 448 and saturates.
    q = fp8.cast_to_fp8(a, np.float32(256.0), E4)
    assert float(np.float32(a) * np.float32(256)) > 448 and q.astype(np.float32) == 448.0


def test_power_of_two_elsewhere_equals_the_exact_floor():
    s = f32([1.0, 3.0, 0.75, 2.0**-130, 2.0**100 * 1.5, 4.48e14, 0.0])
    assert fp8.round_scale_down_to_power_of_2(s).tolist() == fp8.exact_power_of_2_floor(s).tolist()
    assert fp8.exact_power_of_2_floor(s).tolist() == [1.0, 2.0, 0.5, 2.0**-130, 2.0**100, 2.0**48, 0.0]
    assert np.isnan(fp8.round_scale_down_to_power_of_2(f32(np.nan)))
    rng = np.random.default_rng(1)
    r = rng.integers(1, 0x7F800000, 100_000, dtype=np.int64).astype(np.uint32).view(np.float32)
    torchao, exact = fp8.round_scale_down_to_power_of_2(r), fp8.exact_power_of_2_floor(r)
    # Where they differ, torchao's is the next power of two up, never anything else.
    assert ((torchao == exact) | (torchao.astype(np.float64) == 2 * exact.astype(np.float64))).all()
    with pytest.raises(ValueError, match="float32"):
        fp8.round_scale_down_to_power_of_2(np.ones(2, np.float64))


def test_cast_saturates_rounds_to_even_and_keeps_nan():
    s = np.float32(1.0)
    x = f32([1000.0, -1e30, np.inf, 464.0, 17.0, 19.0, np.nan, -0.0])
    q = fp8.cast_to_fp8(x, s, E4).astype(np.float32)
    assert q[:6].tolist() == [448.0, -448.0, 448.0, 448.0, 16.0, 20.0]  # 17 and 19: ties to even
    assert np.isnan(q[6]) and np.signbit(q[7])
    e5 = fp8.cast_to_fp8(f32([1e6, -np.inf]), s, "float8_e5m2").astype(np.float32)
    assert e5.tolist() == [57344.0, -57344.0]  # saturated, not inf
    # A zero scale (amax inf): finite values to 0, infinities to NaN.
    z = fp8.cast_to_fp8(f32([5.0, np.inf]), np.float32(0.0), E4).astype(np.float32)
    assert z[0] == 0 and np.isnan(z[1])
    # The product is rounded to float32 before the cast: f32(x * s) then fp8.
    x1, s1 = np.float32(1.0 + 2.0**-23), np.float32(1.0 + 2.0**-23)
    assert fp8.cast_to_fp8(f32(x1), s1, E4).astype(np.float32) == 1.0


def test_quantize_and_prescale():
    x = f32([[3.0, -1.5], [0.25, 0.5]])
    q = fp8.quantize(x, E4)
    assert q.scale == np.float32(448 / 3) and q.data.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    rows = fp8.quantize(x, E4, "axiswise", axis=-1, power_of_2=True)
    assert rows.scale.tolist() == [[128.0], [512.0]]
    # A power-of-two scale makes the pre-scaled operand the fp8 value exactly divided.
    assert fp8.prescale(rows).tolist() == (rows.data.astype(np.float32) / rows.scale).tolist()
    assert fp8.prescale(rows).flags["C_CONTIGUOUS"] and fp8.prescale(rows.T).flags["C_CONTIGUOUS"]
    with pytest.raises(ValueError, match="granularity"):
        fp8.quantize(x, E4, "blockwise")


# ----------------------------------------------------------------------------- rule 7


def test_gemm_exact_rounds_the_exact_sum_once():
    # 1 + 2^-24 - 1 is 2^-24 exactly; a float32 left-to-right sum loses the 2^-24.
    a = f32([[1.0, 2.0**-24, -1.0]])
    b = f32([[1.0], [1.0], [1.0]])
    assert fp8.gemm_exact(a, b)[0, 0] == np.float32(2.0**-24)
    acc = np.float32(0)
    for t in (a[0] * b[:, 0]):
        acc = np.float32(acc + t)
    assert acc == 0.0
    assert np.isinf(fp8.gemm_exact(f32([[np.inf, 1.0]]), f32([[1.0], [1.0]])))[0, 0]
    with pytest.raises(ValueError, match=r"\(M, K\)"):
        fp8.gemm_exact(f32([[1.0, 2.0]]), f32([[1.0, 2.0]]))


def test_accumulation_bound_covers_every_summation_order_and_is_tight():
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(200):
        k = int(rng.integers(1, 64))
        a = (rng.standard_normal((1, k)) * 10.0 ** rng.uniform(-3, 3, (1, k))).astype(np.float32)
        b = rng.standard_normal((k, 1)).astype(np.float32)
        exact = math.fsum(float(x) * float(y) for x, y in zip(a[0], b[:, 0]))
        bound = fp8.accumulation_bound(a, b)[0, 0]
        for order in (rng.permutation(k) for _ in range(5)):
            acc = np.float32(0)
            for i in order:
                acc = np.float32(acc + np.float32(a[0, i] * b[i, 0]))
            err = abs(float(acc) - exact)
            assert err <= bound
            worst = max(worst, err / bound)
    # Not vacuous: recursive sums come within a fraction of it.
    assert 0.01 < worst < 1
    total = np.abs(f32([[1.0, 1.0]])) @ np.abs(f32([[1.0], [1.0]]))
    gamma = 2 * 2.0**-24 / (1 - 2 * 2.0**-24)
    assert fp8.accumulation_bound(f32([[1.0, 1.0]]), f32([[1.0], [1.0]]))[0, 0] == pytest.approx(
        (gamma + 2.0**-53) * float(total[0, 0]), rel=1e-12, abs=2 * 2.0**-149)


def test_scaled_mm_tensorwise_equals_the_matmul_of_prescaled_operands():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 3)).astype(np.float32)
    a, b = fp8.quantize(x, E4), fp8.quantize(w, E4)
    c = fp8.scaled_mm(a, b, np.float32)
    assert c.tolist() == fp8.gemm_exact(fp8.prescale(a), fp8.prescale(b)).tolist()
    # Not the matmul of the fp8 values scaled afterwards.
    after = (fp8.gemm_exact(a.data.astype(np.float32), b.data.astype(np.float32)) / (a.scale * b.scale)).astype(np.float32)
    assert c.tolist() != after.tolist()
    assert fp8.scaled_mm(a, b, BF16).dtype == BF16


def test_scaled_mm_rowwise_goes_through_bfloat16_and_the_post_scale():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    w = rng.standard_normal((16, 4)).astype(np.float32)
    a = fp8.quantize(x, E4, "axiswise", axis=-1, power_of_2=True)
    b = fp8.quantize(w, E4, "axiswise", axis=0, power_of_2=True)
    fast = fp8.scaled_mm(a, b, np.float32, fast_accum=True)
    assert fast.dtype == np.float32
    assert fast.tolist() == fp8.gemm_exact(fp8.prescale(a), fp8.prescale(b)).astype(BF16).astype(np.float32).tolist()
    slow = fp8.scaled_mm(a, b, np.float32, fast_accum=False)
    unit = fp8.gemm_exact(a.data.astype(np.float32), b.data.astype(np.float32)).astype(BF16)
    post = (np.float32(1) / a.scale) * (np.float32(1) / b.scale)
    assert slow.tolist() == (unit.astype(np.float32) * post).astype(np.float32).astype(BF16).astype(np.float32).tolist()
    # A tensorwise operand facing an axiswise one has its scale repeated: still rowwise.
    t = fp8.quantize(w, E4)
    mixed = fp8.scaled_mm(a, t, np.float32, fast_accum=False)
    repeated = fp8.Quantized(t.data, np.full((1, 4), t.scale, np.float32))
    assert mixed.tolist() == fp8.scaled_mm(a, repeated, np.float32, fast_accum=False).tolist()


# ----------------------------------------------------------------------------- rules 8-10


def test_recipes_cast_as_torchao_names_them():
    t, r, h = (fp8.RECIPES[n] for n in ("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    assert (t.input.fmt, t.weight.fmt, t.grad_output.fmt) == (E4, E4, "float8_e5m2")
    assert not t.power_of_2 and r.power_of_2 and h.power_of_2
    assert {c.granularity for c in (r.input, r.weight, r.grad_output)} == {"axiswise"} and r.grad_output.fmt == E4
    assert h.weight_for_grad_input.granularity == "tensorwise"
    assert h.input_for_grad_weight.granularity == h.grad_output_for_grad_weight.granularity == "disabled"
    with pytest.raises(ValueError, match="recipe must be one of"):
        fp8.linear_forward(f32([[1.0]]), f32([[1.0]]), None, "delayed")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_linear_shapes_and_dtypes(recipe, dtype):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 16)).astype(dtype)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    y = fp8.linear_forward(x, w, np.ones(8, np.float32), recipe)
    assert y.shape == (2, 3, 8) and y.dtype == np.dtype(dtype)
    g = fp8.linear_backward(x, w, rng.standard_normal((2, 3, 8)).astype(dtype), recipe)
    assert g.grad_input.shape == (2, 3, 16) and g.grad_input.dtype == np.dtype(dtype)
    assert g.grad_weight.shape == (8, 16) and g.grad_weight.dtype == np.dtype(dtype)
    # Close to the high-precision result: float8 keeps 3 or 2 mantissa bits.
    ref = x.astype(np.float32) @ w.T + 1
    assert np.abs(y.astype(np.float32) - ref).max() <= 0.15 * np.abs(ref).max()


def test_rowwise_with_gw_hp_keeps_grad_weight_in_high_precision():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    go = rng.standard_normal((4, 8)).astype(np.float32)
    g = fp8.linear_backward(x, w, go, "rowwise_with_gw_hp")
    assert g.grad_weight.tolist() == fp8.gemm_exact(go.T, x).tolist()
    assert fp8.linear_backward(x, w, go, "rowwise").grad_weight.tolist() != g.grad_weight.tolist()


# ----------------------------------------------------------------------------- rules 11-12


def _block(*values: float, fill: float = 0.0) -> np.ndarray:
    out = np.full((1, 32), fill, np.float32)
    out[0, : len(values)] = values
    return out


@pytest.mark.parametrize("mode, byte, first", [("floor", 127, 448.0), ("ceil", 128, 224.0), ("rceil", 128, 224.0)])
def test_mx_scale_modes_at_an_amax_just_above_448(mode, byte, first):
    t = fp8.to_mx(_block(449.0, 1.0), mode=mode)
    assert t.scale.view(np.uint8).ravel().tolist() == [byte]
    assert t.data.astype(np.float32)[0, 0] == first  # floor: 449 saturates to 448


def test_mx_scale_edge_cases():
    assert fp8.to_mx(_block(448.0), mode="ceil").scale.view(np.uint8).ravel().tolist() == [128]  # 1.75 * 2^8: rounded up
    assert fp8.to_mx(_block(256.0), mode="ceil").scale.view(np.uint8).ravel().tolist() == [127]  # zero mantissa
    zeros = fp8.to_mx(_block(), mode="floor")
    assert zeros.scale.view(np.uint8).ravel().tolist() == [0] and (zeros.data.astype(np.float32) == 0).all()
    nan = fp8.to_mx(_block(np.nan, 3.0))
    assert nan.scale.view(np.uint8).ravel().tolist() == [255] and nan.data.astype(np.float32)[0, 1] == 0  # 3 / inf
    inf_r = fp8.to_mx(_block(np.inf, 3.0), mode="rceil")
    assert inf_r.scale.view(np.uint8).ravel().tolist() == [254]
    inf_f = fp8.to_mx(_block(np.inf, 3.0), mode="floor")
    assert inf_f.scale.view(np.uint8).ravel().tolist() == [127 + 128 - 8]
    # e5m2 elements: emax 15.
    assert fp8.to_mx(_block(1.0), "float8_e5m2").scale.view(np.uint8).ravel().tolist() == [127 - 15]
    # rceil at the bottom of the e8m0 range multiplies by 1 (torchao's special case).
    tiny = fp8.to_mx(_block(2.0**-140), mode="rceil")
    assert tiny.scale.view(np.uint8).ravel().tolist() == [0] and tiny.data.astype(np.float32)[0, 0] == 0
    with pytest.raises(ValueError, match="multiple of block_size"):
        fp8.to_mx(np.zeros((2, 30), np.float32))
    with pytest.raises(ValueError, match="mode"):
        fp8.to_mx(np.zeros((1, 32), np.float32), mode="even")


def test_mx_dequantize_scales_back_exactly():
    x = _block(3.0, -0.75, 448.0 * 4, 2.0**-6)  # scale 4: 2^-6 / 4 is an e4m3 subnormal
    t = fp8.to_mx(x)
    back = fp8.mx_dequantize(t, np.float32)
    assert back.tolist() == x.tolist()  # each value fits e4m3 after its power-of-two scale
    assert fp8.mx_dequantize(t, BF16).dtype == BF16
    assert np.isnan(fp8.mx_dequantize(fp8.to_mx(_block(np.nan)), np.float32)).all()


def test_mx_dequantize_reads_the_e8m0_bias_as_127():
    t = fp8.MXBlocks(np.full((1, 32), 1.5, ml_dtypes.float8_e4m3fn),
                     np.array([[127 + 3]], np.uint8).view(ml_dtypes.float8_e8m0fnu), 32)
    assert (fp8.mx_dequantize(t, np.float32) == 12.0).all()  # 1.5 * 2^3
    low = fp8.MXBlocks(t.data, np.array([[0]], np.uint8).view(ml_dtypes.float8_e8m0fnu), 32)
    assert (fp8.mx_dequantize(low, np.float32) == np.float32(1.5 * 2.0**-127)).all()  # a float32 subnormal


def test_mx_mm_multiplies_the_dequantized_operands():
    a = fp8.to_mx(np.arange(64, dtype=np.float32).reshape(2, 32) / 8)
    b = fp8.to_mx(np.ones((3, 32), np.float32))
    c = fp8.mx_mm(a, b, np.float32)
    assert c.shape == (2, 3) and c.dtype == np.float32
    assert c[1, 2] == np.float32(fp8.mx_dequantize(a, np.float32)[1].astype(np.float64).sum())
    with pytest.raises(ValueError, match=r"\(M, K\) and \(N, K\)"):
        fp8.mx_mm(a, fp8.to_mx(np.ones((3, 64), np.float32)), np.float32)


def test_mx_linear_flattens_leading_axes_and_pairs_rows():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 32)).astype(np.float32)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    go = rng.standard_normal((2, 16, 64)).astype(np.float32)
    y = fp8.mx_linear_forward(x, w, None)
    flat = fp8.mx_linear_forward(x.reshape(32, 32), w, None)
    assert y.shape == (2, 16, 64) and np.array_equal(y.reshape(32, 64), flat)
    g = fp8.mx_linear_backward(x, w, go)
    g2 = fp8.mx_linear_backward(x.reshape(32, 32), w, go.reshape(32, 64))
    assert g.grad_input.shape == (2, 16, 32) and np.array_equal(g.grad_weight, g2.grad_weight)
    swapped = fp8.mx_linear_backward(x.swapaxes(0, 1).copy(), w, go)  # rows paired with other rows
    assert not np.array_equal(swapped.grad_weight, g.grad_weight)
    with pytest.raises(ValueError, match="one dtype"):
        fp8.mx_linear_forward(x.astype(BF16), w, None)
    assert fp8.MX_RECIPES["mxfp8"] == fp8.MXRecipe("mxfp8", "float8_e4m3fn", 32, "rceil")
    with pytest.raises(ValueError, match="mode"):
        fp8.MXRecipe("x", mode="even")


# ----------------------------------------------------------------------------- rules 13-14


def test_delayed_scaling_rolls_history_and_keeps_the_scale_on_bad_amax():
    cfg = fp8.DelayedScaling(amax_history_len=3)
    s = fp8.delayed_initial_state(cfg)
    assert s.amax_history == (0, 0, 0) and s.scale == 1 and s.scale_inv == 1
    q, s = fp8.delayed_cast(f32([2.0, -1.0]), s, E4)
    assert q.astype(np.float32).tolist() == [2.0, -1.0]  # quantized with the old scale, 1
    assert s.amax_history == (2, 0, 0)
    s = fp8.delayed_update(s, cfg, E4)
    assert s.amax_history == (0, 0, 2) and s.scale == 224 and s.scale_inv == np.float32(1 / 224)
    for bad in (0.0, np.inf, np.nan):
        _, t = fp8.delayed_cast(f32([bad]), fp8.DelayedScalingState((0, 0, 0), 224, 1 / 224), E4)
        assert fp8.delayed_update(t, cfg, E4).scale == 224  # kept: history max is 0, or inf
    # max ignores a NaN in the history; most_recent does not.
    nan_hist = fp8.DelayedScalingState((8.0, np.nan, 2.0), 1, 1)
    assert fp8.delayed_update(nan_hist, cfg, E4).scale == 56
    recent = fp8.DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent")
    assert fp8.delayed_update(fp8.DelayedScalingState((4.0, 100.0, 2.0), 1, 1), recent, E4).scale == 112
    assert fp8.delayed_update(fp8.DelayedScalingState((np.nan, 100.0, 2.0), 7, 1), recent, E4).scale == 7


def test_delayed_scaling_margin_and_tiny_amax():
    cfg = fp8.DelayedScaling(margin=2, amax_history_len=1)
    s = fp8.delayed_update(fp8.DelayedScalingState((4.0,), 1, 1), cfg, E4)
    assert s.scale == 28 and s.amax_history == (0,)
    huge = fp8.delayed_update(fp8.DelayedScalingState((2.0**-149,), 1, 1), fp8.DelayedScaling(amax_history_len=1), E4)
    assert huge.scale == np.float32(FLT_MAX)
    with pytest.raises(ValueError, match="amax_compute_algo"):
        fp8.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="margin"):
        fp8.DelayedScaling(margin=-1)


def test_current_scaling():
    assert fp8.current_scale(f32(3.0), E4) == np.float32(448) / np.float32(3)
    assert fp8.current_scale(f32([0.0, np.inf, np.nan]), E4).tolist() == [1.0, 1.0, 1.0]
    assert fp8.current_scale(f32(2.0**-149), E4) == np.float32(FLT_MAX)
    assert fp8.current_scale(f32(3.0), E4, power_of_2=True) == 128.0
    assert fp8.current_scale(f32(0.0), E4, epsilon=1.0) == 448.0  # amax lifted to epsilon
    # The exact floor: no log2 rounding, unlike torchao's rule 4.
    a = f32(cli.FP8_POW2_AMAX)
    assert fp8.current_scale(a, E4, power_of_2=True) == 128.0


# ----------------------------------------------------------------------------- rule 15


def test_deepseek_blocks_and_promotion():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    w = rng.standard_normal((128, 256)).astype(np.float32)
    a = fp8.blockwise_quantize(x, (1, 128))
    b = fp8.blockwise_quantize(w, (128, 128))
    assert a.scale.shape == (2, 2) and b.scale.shape == (1, 2)
    assert a.scale[0, 1] == np.float32(np.abs(x[0, 128:]).max() / np.float32(448))
    c = fp8.blockwise_gemm(a, b)
    assert c.shape == (2, 128) and c.dtype == np.float32
    # By hand for one element: two slices, each scaled, then added.
    parts = []
    for i in range(2):
        sl = slice(128 * i, 128 * (i + 1))
        p = np.float32(math.fsum(float(u) * float(v) for u, v in
                                 zip(a.data[0, sl].astype(np.float32), b.data[5, sl].astype(np.float32))))
        parts.append(np.float32(np.float32(p * a.scale[0, i]) * b.scale[0, i]))
    assert c[0, 5] == np.float32(np.float32(0) + parts[0]) + parts[1]
    ref = x @ w.T
    assert np.abs(c - ref).max() < 0.1 * np.abs(ref).max()
    zero = fp8.blockwise_quantize(np.zeros((1, 128), np.float32))
    assert zero.scale[0, 0] == 0 and np.isnan(zero.data.astype(np.float32)).all()  # no epsilon: 0 / 0
    with pytest.raises(ValueError, match="divisible"):
        fp8.blockwise_quantize(np.zeros((1, 100), np.float32))


# ----------------------------------------------------------------------------- the command


def test_every_rule_function_opens_with_its_rule_and_python_m_reference_fp8_prints_them():
    assert all((fn.__doc__ or "").startswith("Rule") for fn in fp8.RULES)
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["--fp8"]) == 0
    text = out.getvalue()
    for part in ("1. Formats.", "15. DeepSeek-V3", "torchao's power of two is 256, the exact floor 128",
                 "Rule 13: delayed scaling"):
        assert part in text, f"{part!r} missing from python -m reference --fp8"
    assert formats.get_format(E4).max == 448.0
