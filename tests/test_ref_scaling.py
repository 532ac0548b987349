"""reference.scaling: torch.amp.GradScaler's rules bit for bit, and the Megatron/DeepSpeed presets.

Expected values are computed by hand (or are torch 2.13 CPU measurements quoted in the test).
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import ml_dtypes
import numpy as np
import pytest

from reference import __main__ as cli
from reference import scaling
from reference.scaling import (
    PRESETS,
    RULES,
    ScaleAtMinimumError,
    ScalerConfig,
    ScalerState,
    back_off,
    grow,
    has_inf_or_nan,
    initial_state,
    inverse_scale,
    scale_loss,
    should_grow,
    unscale_gradients,
    unscale_gradients_,
    update_scale,
    update_scale_multi,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
FLT_MAX = np.finfo(np.float32).max


def st(scale, tracker=0, left=1) -> ScalerState:
    return ScalerState(np.float32(scale), np.int32(tracker), left)


def run(config: ScalerConfig, pattern, state: ScalerState | None = None) -> list[tuple[float, int]]:
    state = initial_state(config) if state is None else state
    out = []
    for flag in pattern:
        state = update_scale(state, flag, config)
        out.append((float(state.scale), int(state.growth_tracker)))
    return out


def u32(a) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


def u16(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


# ----------------------------------------------------------------------------- state and config


def test_defaults_are_torch_and_initial_state():
    c = ScalerConfig()
    assert (c.init_scale, c.growth_factor, c.backoff_factor, c.growth_interval) == (65536.0, 2.0, 0.5, 2000)
    assert ScalerConfig.preset("torch") == c
    s = initial_state(ScalerConfig(init_scale=0.1))
    assert type(s.scale) is np.float32 and type(s.growth_tracker) is np.int32
    # torch rounds init_scale to float32 at its lazy init: 0.1 becomes 0.10000000149011612.
    assert float(s.scale) == 0.10000000149011612
    assert int(s.growth_tracker) == 0 and s.hysteresis_left == 1


def test_state_fields_are_converted_to_float32_and_int32():
    s = ScalerState(0.1, 3, 2)
    assert type(s.scale) is np.float32 and s.scale == np.float32(0.1)
    assert type(s.growth_tracker) is np.int32 and s.growth_tracker == 3


def test_presets_hold_the_peer_defaults():
    m = ScalerConfig.preset("megatron")
    assert (m.init_scale, m.growth_interval, m.hysteresis, m.min_scale, m.raise_at_min_scale) == (2.0**32, 1000, 2, 1.0, False)
    d = ScalerConfig.preset("deepspeed")
    assert (d.init_scale, d.growth_interval, d.hysteresis, d.min_scale) == (2.0**16, 1000, 2, 1.0)
    assert d.raise_at_min_scale and d.growth_since_overflow and not d.consecutive_hysteresis
    assert d.max_scale is None and m.max_scale is None
    assert set(PRESETS) == {"torch", "megatron", "deepspeed", "deepspeed_fp16", "apex", "jmp", "static"}
    assert ScalerConfig.preset("megatron", growth_interval=5).growth_interval == 5
    f = ScalerConfig.preset("deepspeed_fp16")
    assert (f.init_scale, f.growth_interval, f.hysteresis, f.min_scale, f.raise_at_min_scale) == (2.0**16, 1000, 1, 1.0, False)
    assert f.growth_since_overflow
    a = ScalerConfig.preset("apex")
    assert (a.init_scale, a.growth_interval, a.min_scale, a.max_scale) == (2.0**16, 2000, None, 2.0**24)
    j = ScalerConfig.preset("jmp")
    assert (j.init_scale, j.growth_interval, j.min_scale, j.max_scale) == (2.0**15, 2000, 1.0, None)
    s = ScalerConfig.preset("static")
    assert not s.dynamic and s.skip_on_overflow


# ----------------------------------------------------------------------------- torch's update rule


def test_scale_halves_after_an_overflow_and_doubles_after_2000_clean_steps():
    c = ScalerConfig()
    s = update_scale(initial_state(c), True, c)
    assert float(s.scale) == 32768.0 and int(s.growth_tracker) == 0, f"after one overflow: {s}"
    for i in range(1999):
        s = update_scale(s, False, c)
        assert float(s.scale) == 32768.0, f"grew early at clean step {i + 1}"
    assert int(s.growth_tracker) == 1999
    s = update_scale(s, False, c)
    assert float(s.scale) == 65536.0 and int(s.growth_tracker) == 0, f"after 2000 clean steps: {s}"


def test_torch_e1_history():
    c = ScalerConfig(init_scale=1024.0, growth_interval=3)
    pattern = [0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0]
    expected = [
        (1024, 1), (1024, 2), (2048, 0), (2048, 1), (1024, 0), (1024, 1), (1024, 2), (2048, 0), (2048, 1),
        (2048, 2), (4096, 0), (2048, 0), (1024, 0), (1024, 1), (1024, 2), (2048, 0), (2048, 1), (2048, 2),
    ]
    got = run(c, pattern)
    for step, (g, e) in enumerate(zip(got, expected), 1):
        assert g == e, f"step {step}: (scale, tracker) {g}, torch measured {e}"


def test_sgd_by_hand_step_then_skip():
    # loss r**2 with r = 1, scale 8: d(8 r^2)/dr = 16; unscaled 2; SGD lr 0.1 gives r = 0.8.
    c = ScalerConfig(init_scale=8.0)
    s = initial_state(c)
    r = np.float32(1.0)
    lr = np.float32(0.1)

    def grad(r, state):
        return np.array([np.float32(2) * r * state.scale], dtype=np.float32)

    assert float(scale_loss(r * r, s)) == 8.0
    (g,), found = unscale_gradients([grad(r, s)], s)
    assert not found and g[0] == np.float32(2.0)
    r = np.float32(r - lr * g[0])
    s = update_scale(s, found, c)
    assert r == np.float32(0.8), f"r after one step: {r!r}"
    assert float(s.scale) == 8.0 and int(s.growth_tracker) == 1

    bad = grad(r, s)
    bad[0] = np.inf
    (g,), found = unscale_gradients([bad], s)
    assert found
    if not found:
        r = np.float32(r - lr * g[0])
    s = update_scale(s, found, c)
    assert r == np.float32(0.8), "an inf gradient must leave r unchanged"
    assert float(s.scale) == 4.0 and int(s.growth_tracker) == 0


def test_growth_is_refused_when_it_would_overflow_to_inf():
    c = ScalerConfig(growth_interval=1)
    s = update_scale(st(3e38), False, c)
    assert float(s.scale) == 3.0000000054977558e38, f"scale grew to {float(s.scale)!r}"
    assert int(s.growth_tracker) == 0, "the tracker restarts even when growth is refused"


def test_growth_landing_exactly_on_flt_max_is_accepted():
    c = ScalerConfig(growth_interval=1)
    s = update_scale(st(FLT_MAX / np.float32(2)), False, c)
    assert s.scale == FLT_MAX, f"got {float(s.scale)!r}"
    # A float64 product just above FLT_MAX that rounds down to it is accepted too.
    c2 = ScalerConfig(growth_interval=1, growth_factor=2.0 * (1 + 2.0**-26))
    s2 = update_scale(st(FLT_MAX / np.float32(2)), False, c2)
    assert s2.scale == FLT_MAX, f"got {float(s2.scale)!r}"


def test_200_backoffs_from_one_reach_exactly_zero():
    c = ScalerConfig()
    s = st(1.0)
    history = []
    for _ in range(200):
        s = update_scale(s, True, c)
        history.append(s.scale)
    assert history[148] == np.float32(2.0**-149), "149 halvings give the smallest subnormal"
    assert history[149] == 0.0, "2**-150 is a tie and rounds to even: 0"
    assert s.scale == 0.0 and not np.signbit(s.scale)


def test_zero_scale_is_a_fixed_point_and_unscales_to_non_finite_values():
    c = ScalerConfig(growth_interval=1)
    assert update_scale(st(0.0), True, c).scale == 0.0
    assert update_scale(st(0.0), False, c).scale == 0.0
    s = st(0.0)
    assert inverse_scale(s) == np.inf
    (g,), found = unscale_gradients([np.array([1.0, 0.0, -2.0], dtype=np.float32)], s)
    assert not found, "found_inf looks at the scaled inputs, which were finite"
    assert g[0] == np.inf and np.isnan(g[1]) and g[2] == -np.inf


def test_growth_factor_is_applied_in_float64_and_rounded_once():
    c = ScalerConfig(growth_factor=1.1, growth_interval=1)
    s = update_scale(st(3.0), False, c)
    assert float(s.scale) == 3.299999952316284, f"got {float(s.scale)!r}"
    assert float(np.float32(3.0) * np.float32(1.1)) == 3.3000001907348633  # the formula not used


def test_backoff_factor_is_applied_in_float64_and_rounded_once():
    c = ScalerConfig(backoff_factor=0.3)
    s = update_scale(st(3.0), True, c)
    assert float(s.scale) == 0.8999999761581421, f"got {float(s.scale)!r}"
    assert float(np.float32(3.0) * np.float32(0.3)) == 0.9000000357627869  # the formula not used


def test_growth_interval_one_grows_every_clean_step():
    c = ScalerConfig(init_scale=1.0, growth_interval=1)
    assert run(c, [0, 0, 0, 1, 0]) == [(2.0, 0), (4.0, 0), (8.0, 0), (4.0, 0), (8.0, 0)]


def test_tracker_past_the_interval_never_grows():
    # Equality, not >=, as torch: a tracker loaded past the interval keeps counting.
    c = ScalerConfig(growth_interval=3)
    s = update_scale(st(2.0, tracker=5), False, c)
    assert (float(s.scale), int(s.growth_tracker)) == (2.0, 6)


def test_found_inf_as_number_nan_counts():
    c = ScalerConfig()
    for flag in (1.0, 2.0, np.float32(1.0), float("nan"), np.float32("nan"), True):
        assert float(update_scale(st(8.0), flag, c).scale) == 4.0, f"found_inf={flag!r} must back off"
    for flag in (0.0, -0.0, np.float32(0), False, 0):
        assert float(update_scale(st(8.0), flag, c).scale) == 8.0, f"found_inf={flag!r} must count as clean"


def test_several_optimizers_back_off_once():
    c = ScalerConfig()
    assert float(update_scale_multi(st(1024.0), [1.0, 1.0], c).scale) == 512.0
    assert float(update_scale_multi(st(1024.0), [0.0, 1.0, 0.0], c).scale) == 512.0
    s = update_scale_multi(st(1024.0, tracker=4), [0.0, False], c)
    assert (float(s.scale), int(s.growth_tracker)) == (1024.0, 5)


def test_inverse_scale_is_the_rounded_float32_reciprocal():
    assert inverse_scale(st(3.0)) == np.float32(1.0 / 3.0)
    assert type(inverse_scale(st(3.0))) is np.float32
    assert inverse_scale(st(np.inf)) == 0.0


# ----------------------------------------------------------------------------- scale_loss


def test_scale_loss_dtype_table():
    s = st(1.00048828125)
    # float16 ndim >= 1: f16(f32(x) * S), S not first rounded to float16 (torch measurement).
    x16 = np.array([1.0009765625], dtype=np.float16)
    out = scale_loss(x16, s)
    assert out.dtype == np.float16 and out[0] == np.float16(1.001953125)
    # 0-d low precision promotes to float32.
    out0 = scale_loss(np.array(1.0009765625, dtype=np.float16), s)
    assert out0.dtype == np.float32 and out0.shape == ()
    assert out0 == np.float32(1.0009765625) * np.float32(1.00048828125)
    assert scale_loss(np.ones(2, dtype=BF16), st(3.0)).dtype == BF16
    # float64 stays float64: x * f64(S).
    out64 = scale_loss(np.array(0.1), st(3.0))
    assert out64.dtype == np.float64 and out64 == 0.1 * 3.0
    # float32 and Python numbers: float32.
    assert scale_loss(np.float32(0.1), st(3.0)).dtype == np.float32
    assert scale_loss(0.1, st(3.0)) == np.float32(0.1) * np.float32(3.0)
    assert scale_loss(np.array([3e38], dtype=np.float32), st(2.0))[0] == np.inf


def test_scale_loss_rejects_non_float():
    with pytest.raises(ValueError, match="loss"):
        scale_loss(np.array([1, 2]), st(2.0))
    with pytest.raises(ValueError, match="loss"):
        scale_loss("1.0", st(2.0))


# ----------------------------------------------------------------------------- inf check and unscale


def test_has_inf_or_nan():
    assert has_inf_or_nan([np.array([np.inf], dtype=np.float32)])
    assert has_inf_or_nan([np.zeros(3), np.array([-np.inf], dtype=np.float16)])
    assert has_inf_or_nan([np.array([np.nan], dtype=BF16)])
    sub = np.array([1e-45, -1e-45, 0.0, -0.0], dtype=np.float32)
    assert not has_inf_or_nan([sub, np.array([2.0**-24], dtype=np.float16), np.array([5e-324])]), (
        "subnormals and signed zeros are finite"
    )
    assert not has_inf_or_nan([])
    assert not has_inf_or_nan([np.zeros((0, 3), dtype=np.float32), np.zeros(0, dtype=BF16)])


def test_unscale_multiplies_by_the_inverse_never_divides():
    s = st(1000.0)
    inv = np.float32(1) / np.float32(1000)
    g = np.array([1.6369616985321045], dtype=np.float32)
    (out,), found = unscale_gradients([g], s)
    assert not found
    assert u32(out) == u32(g * inv), f"got {float(out[0])!r}, spec g*inv = {float(g[0] * inv)!r}"
    assert float(out[0]) == 0.001636961824260652
    assert float((g / np.float32(1000))[0]) == 0.0016369617078453302, "g/S must differ for this example"


def test_unscale_bits_for_each_dtype():
    s = st(1000.0)
    inv = np.float32(1) / np.float32(1000)
    rng = np.random.default_rng(0)
    g32 = np.concatenate([rng.uniform(-5, 5, 64), [0.0, -0.0, 1e-45, -3e38, 7e-39]]).astype(np.float32)
    g64 = rng.uniform(-5, 5, 64)
    outs, found = unscale_gradients([g32, g64], s)
    assert not found
    assert (u32(outs[0]) == u32(g32 * inv)).all(), "float32: f32(g * inv)"
    assert outs[1].dtype == np.float64 and (outs[1] == g64 * np.float64(inv)).all(), "float64: g * f64(inv)"
    # 16-bit: low(f32(g) * inv). Both cases measured on torch 2.13; dividing in float64 gives 0x0006 / 0x0001.
    (h,), _ = unscale_gradients([np.array([0x0E59], dtype=np.uint16).view(np.float16)], st(1000.0))
    assert h.dtype == np.float16 and u16(h)[0] == 0x0007, f"float16 got {hex(u16(h)[0])}"
    (b,), _ = unscale_gradients([np.array([0x0480], dtype=np.uint16).view(BF16)], st(65535.0))
    assert b.dtype == BF16 and u16(b)[0] == 0x0000, f"bfloat16 got {hex(u16(b)[0])}"


def test_unscale_with_inverse_one_keeps_bits_and_nan_payloads():
    g32 = np.array([0x7FC00123, 0xFFC00001, 0x00000001], dtype=np.uint32).view(np.float32)
    g16 = np.array([0x7E01, 0x0001], dtype=np.uint16).view(np.float16)
    gb = np.array([0x7FC1, 0x8001], dtype=np.uint16).view(BF16)
    (o32, o16, ob), found = unscale_gradients([g32, g16, gb], st(1.0))
    assert found
    assert (u32(o32) == u32(g32)).all(), f"float32 bits changed: {[hex(v) for v in u32(o32)]}"
    assert (u16(o16) == u16(g16)).all() and (u16(ob) == u16(gb)).all()


def test_all_grads_are_unscaled_even_when_an_overflow_is_found():
    g = np.array([np.inf, np.nan, 8.0], dtype=np.float32)
    (out, other), found = unscale_gradients([g, np.array([4.0])], st(4.0))
    assert found
    assert out[0] == np.inf and np.isnan(out[1]) and out[2] == 2.0, f"got {out}"
    assert other[0] == 1.0, "a clean gradient beside the overflow is unscaled too"


def test_overflow_caused_by_unscaling_is_not_detected():
    (out,), found = unscale_gradients([np.array([3e38], dtype=np.float32)], st(0.25))
    assert out[0] == np.inf, "4 * 3e38 overflows float32"
    assert not found, "found_inf is decided on the scaled values, before the multiply"


def test_unscale_is_pure_and_handles_empty_inputs():
    g = np.array([2.0, 4.0], dtype=np.float32)
    before = g.copy()
    outs, _ = unscale_gradients([g], st(2.0))
    assert (g == before).all() and outs[0] is not g
    assert unscale_gradients([], st(2.0)) == ([], False)
    outs, found = unscale_gradients([np.zeros((0, 2), dtype=np.float16)], st(2.0))
    assert not found and outs[0].shape == (0, 2) and outs[0].dtype == np.float16


def test_non_float_grads_are_rejected_naming_the_index():
    with pytest.raises(ValueError, match=r"grads\[1\]"):
        unscale_gradients([np.zeros(2, dtype=np.float32), np.zeros(2, dtype=np.int32)], st(2.0))
    with pytest.raises(ValueError, match=r"grads\[0\]"):
        has_inf_or_nan([np.zeros(2, dtype=ml_dtypes.float8_e4m3fn)])
    with pytest.raises(ValueError, match="grads"):
        has_inf_or_nan(np.zeros(2, dtype=np.float32))


# ----------------------------------------------------------------------------- extended policy


def test_megatron_hysteresis_two():
    c = ScalerConfig.preset("megatron", init_scale=1024.0, growth_interval=3)
    s = update_scale(initial_state(c), True, c)
    assert float(s.scale) == 1024.0 and s.hysteresis_left == 1, "first overflow is absorbed"
    s = update_scale(s, True, c)
    assert float(s.scale) == 512.0 and s.hysteresis_left == 0, "second overflow backs off"
    # Refilled only at growth: a clean step in between does not help.
    s = update_scale(update_scale(s, False, c), True, c)
    assert float(s.scale) == 256.0
    assert run(c, [0, 0, 0, 1, 0, 1, 1], s) == [
        (256.0, 1), (256.0, 2), (512.0, 0), (512.0, 0), (512.0, 1), (256.0, 0), (128.0, 0),
    ]


def test_megatron_floor_clamps_and_keeps_clamping():
    c = ScalerConfig.preset("megatron", init_scale=4.0, hysteresis=1)
    assert [sc for sc, _ in run(c, [1, 1, 1, 1])] == [2.0, 1.0, 1.0, 1.0]
    c2 = ScalerConfig(init_scale=1.5, min_scale=1.0)
    assert float(update_scale(initial_state(c2), True, c2).scale) == 1.0, "0.75 clamps up to the floor"


def test_deepspeed_growth_waits_one_extra_clean_step_after_an_overflow():
    # DeepSpeed grows when (cur_iter - last_overflow_iter - 1) is a positive multiple of the window.
    c = ScalerConfig.preset("deepspeed", init_scale=8.0, growth_interval=3)
    assert run(c, [0, 0, 0, 0, 0, 0, 0]) == [
        (8.0, 1), (8.0, 2), (8.0, 3), (16.0, 1), (16.0, 2), (16.0, 3), (32.0, 1),
    ]
    got = run(c, [1, 0, 0, 0, 0])
    assert [sc for sc, _ in got] == [8.0, 8.0, 8.0, 8.0, 16.0], f"absorbed overflow, then growth at the 4th clean step: {got}"


def test_deepspeed_consecutive_hysteresis_refills_on_every_clean_step():
    pattern = [1, 0, 1, 0, 1]
    plain = ScalerConfig.preset("deepspeed", init_scale=8.0, growth_interval=100)
    consec = ScalerConfig.preset("deepspeed", init_scale=8.0, growth_interval=100, consecutive_hysteresis=True)
    assert [sc for sc, _ in run(plain, pattern)] == [8.0, 8.0, 4.0, 4.0, 2.0]
    assert [sc for sc, _ in run(consec, pattern)] == [8.0, 8.0, 8.0, 8.0, 8.0]
    assert [sc for sc, _ in run(consec, [1, 1, 0, 1, 1])] == [8.0, 4.0, 4.0, 4.0, 2.0]


def test_deepspeed_raises_at_the_floor():
    c = ScalerConfig.preset("deepspeed", init_scale=2.0, hysteresis=1)
    s = update_scale(initial_state(c), True, c)
    assert float(s.scale) == 1.0
    with pytest.raises(ScaleAtMinimumError, match="min_scale"):
        update_scale(s, True, c)
    assert issubclass(ScaleAtMinimumError, RuntimeError)
    # With hysteresis left, an overflow at the floor is absorbed without raising.
    c2 = ScalerConfig.preset("deepspeed", init_scale=1.0)
    assert float(update_scale(initial_state(c2), True, c2).scale) == 1.0


def test_max_scale_clamps_growth():
    c = ScalerConfig(init_scale=3.0, growth_interval=1, max_scale=5.0)
    assert float(grow(np.float32(3.0), c)) == 5.0
    assert run(c, [0, 0]) == [(5.0, 0), (5.0, 0)]
    apex = ScalerConfig(init_scale=2.0**24, growth_interval=1, max_scale=2.0**24)
    assert float(update_scale(initial_state(apex), False, apex).scale) == 2.0**24


def test_small_rule_functions():
    c = ScalerConfig(growth_interval=3)
    assert [should_grow(n, c) for n in (2, 3, 4)] == [False, True, False]
    ds = ScalerConfig(growth_interval=3, growth_since_overflow=True)
    assert [should_grow(n, ds) for n in (3, 4)] == [False, True]
    assert back_off(np.float32(1e-20), ScalerConfig(backoff_factor=1e-30)) == 0.0
    assert np.isnan(back_off(np.float32("nan"), ScalerConfig(min_scale=1.0, init_scale=1.0)))
    assert back_off(np.float32(np.inf), ScalerConfig()) == np.inf
    assert all(fn.__doc__ and fn.__doc__.strip() for fn in RULES)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": -1.0}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"init_scale": float("nan")}, "init_scale"),
        ({"init_scale": 1e39}, "init_scale"),
        ({"init_scale": 1e-46}, "init_scale"),
        ({"init_scale": True}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"growth_factor": float("inf")}, "growth_factor"),
        ({"growth_factor": float("nan")}, "growth_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": float("nan")}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": -1}, "growth_interval"),
        ({"growth_interval": 2.0}, "growth_interval"),
        ({"growth_interval": True}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"hysteresis": True}, "hysteresis"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"min_scale": -1.0}, "min_scale"),
        ({"max_scale": float("inf")}, "max_scale"),
        ({"max_scale": 1e39}, "max_scale"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, "min_scale"),
        ({"min_scale": 2.0, "init_scale": 1.0}, "init_scale"),
        ({"max_scale": 2.0, "init_scale": 4.0}, "init_scale"),
        ({"raise_at_min_scale": 1}, "raise_at_min_scale"),
        ({"raise_at_min_scale": True}, "raise_at_min_scale"),
        ({"consecutive_hysteresis": "yes"}, "consecutive_hysteresis"),
        ({"growth_since_overflow": None}, "growth_since_overflow"),
    ],
)
def test_bad_config_raises_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ScalerConfig(**kwargs)


def test_numpy_numbers_are_accepted():
    c = ScalerConfig(init_scale=np.float32(8), growth_interval=np.int64(3), hysteresis=np.int32(2))
    assert float(initial_state(c).scale) == 8.0 and initial_state(c).hysteresis_left == 2


def test_unknown_preset_and_override_and_bad_flags():
    with pytest.raises(ValueError, match="preset.*apex.*deepspeed.*megatron.*torch"):
        ScalerConfig.preset("fairseq")
    with pytest.raises(ValueError, match="growth_intervall"):
        ScalerConfig.preset("torch", growth_intervall=3)
    with pytest.raises(ValueError, match="found_inf"):
        update_scale(st(2.0), "yes", ScalerConfig())
    with pytest.raises(ValueError, match="found_infs"):
        update_scale_multi(st(2.0), [], ScalerConfig())


# ----------------------------------------------------------------------------- python -m reference


def test_cli_prints_rules_and_the_e1_table():
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli.main([]) == 0
    text = buf.getvalue()
    assert "f32(f64(S) * growth_factor)" in text
    rows = [line.split() for line in text.splitlines() if line.split()[1:2] in (["True"], ["False"])]
    assert len(rows) == len(cli.EXAMPLE_PATTERN)
    assert [(float(r[2]), int(r[3])) for r in rows][:5] == [(1024, 1), (1024, 2), (2048, 0), (2048, 1), (1024, 0)]
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli.main(["--preset", "deepspeed"]) == 0
    assert "hysteresis_left" in buf.getvalue()


# --- unscaling in place ----------------------------------------------------------------------


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("scale", [2.0**16, 3.0, 1.0, 0.25, 2.0**-140, 0.0, float("inf")])
def test_unscale_in_place_gives_the_bits_and_flag_of_unscale(scale):
    values = [1.0, -3e38, 3e38, 1e-45, -1e-40, 65504.0, 6e-8, 0.0, -0.0, 7.5]
    with np.errstate(over="ignore"):  # 3e38 overflows float16 on purpose
        grads = [np.array(values, np.float32), np.array(values, np.float64),
                 np.array(values, np.float32).astype(np.float16), np.array(values, np.float32).astype(BF16),
                 np.array(values[:4], np.float32).reshape(2, 2).T, np.array(2.5, np.float32)]
    for planted in (None, np.inf, np.nan):
        arrays = [g.copy() for g in grads]
        if planted is not None:
            arrays[1][3] = planted
        state = ScalerState(np.float32(scale), np.int32(0), 1)
        with np.errstate(over="ignore"):
            expected, expected_found = unscale_gradients([a.copy() for a in arrays], state)
        given = list(arrays)
        actual, found = unscale_gradients_(given, state)
        assert found == expected_found
        for a, g, e in zip(actual, given, expected):
            assert a is g, "unscale_gradients_ must return the arrays it was given"
            nan = np.isnan(e.astype(np.float64))
            assert np.array_equal(nan, np.isnan(a.astype(np.float64)))
            assert _bits(a[~nan]) == _bits(e[~nan]), (scale, planted, a, e)


def test_unscale_in_place_refuses_what_it_cannot_overwrite():
    frozen = np.ones(2, np.float32)
    frozen.flags.writeable = False
    state = ScalerState(np.float32(2.0), np.int32(0), 1)
    with pytest.raises(ValueError, match=r"grads\[0\] must be a writeable NumPy array"):
        unscale_gradients_([frozen], state)
    with pytest.raises(ValueError, match=r"grads\[0\] must be a writeable NumPy array"):
        unscale_gradients_([[1.0, 2.0]], state)


# --- rule 11: static scales and skipping ----------------------------------------------------


def test_a_static_scale_never_moves_and_skips_as_configured():
    c = ScalerConfig.preset("static", init_scale=3.0, growth_interval=1)
    s = initial_state(c)
    for found in (True, False, False, True, float("nan")):
        assert update_scale(s, found, c) == s
    assert not scaling.step_applies(1.0, c) and scaling.step_applies(0.0, c)
    apex_static = ScalerConfig.preset("static", skip_on_overflow=False)
    assert scaling.step_applies(1.0, apex_static) and scaling.step_applies(float("nan"), apex_static)
    assert not scaling.step_applies(2.0, ScalerConfig())
    with pytest.raises(ValueError, match="dynamic must be a bool"):
        ScalerConfig(dynamic=1)


def test_peer_presets_follow_their_rules():
    # apex: the ceiling stops the growth at 2**24; no floor.
    a = ScalerConfig.preset("apex", init_scale=2.0**23, growth_interval=1)
    s = update_scale(update_scale(initial_state(a), False, a), False, a)
    assert float(s.scale) == 2.0**24
    s = initial_state(ScalerConfig.preset("apex", init_scale=2.0**-140))
    assert float(update_scale(s, True, ScalerConfig.preset("apex")).scale) == 2.0**-141
    # jmp: floor 1.0, clamped, never raising.
    j = ScalerConfig.preset("jmp", init_scale=1.5)
    assert float(update_scale(initial_state(j), True, j).scale) == 1.0
    # deepspeed_fp16: no hysteresis, growth on the (interval + 1)-th clean step, no raise at 1.
    f = ScalerConfig.preset("deepspeed_fp16", init_scale=1.0, growth_interval=2)
    s = initial_state(f)
    assert float(update_scale(s, True, f).scale) == 1.0
    for _ in range(2):
        s = update_scale(s, False, f)
    assert float(s.scale) == 1.0
    assert float(update_scale(s, False, f).scale) == 2.0


# --- rule 12: the call sequence ---------------------------------------------------------------


def test_the_call_sequence_raises_as_torch_does():
    ready = scaling.OptimizerStage()
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    with pytest.raises(AssertionError, match="Attempted unscale_ but _scale is None"):
        scaling.unscale_stage(ready, scaled=False, grad_dtypes=[f32])
    unscaled = scaling.unscale_stage(ready, scaled=True, grad_dtypes=[f32])
    assert unscaled == scaling.OptimizerStage(scaling.UNSCALED, True)
    with pytest.raises(RuntimeError, match="already been called"):
        scaling.unscale_stage(unscaled, scaled=True, grad_dtypes=[f32])
    with pytest.raises(ValueError, match="FP16"):
        scaling.unscale_stage(ready, scaled=True, grad_dtypes=[f32, f16])
    after_unscale, stepped = scaling.step_stage(unscaled, scaled=True, grad_dtypes=[f32])
    assert after_unscale == unscaled and stepped.stage == scaling.STEPPED
    with pytest.raises(RuntimeError, match="after step"):
        scaling.unscale_stage(stepped, scaled=True, grad_dtypes=[f32])
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaling.step_stage(stepped, scaled=True, grad_dtypes=[f32])
    with pytest.raises(RuntimeError, match="Closure"):
        scaling.step_stage(stepped, scaled=False, grad_dtypes=[f32], closure=True)
    with pytest.raises(scaling.NoInfChecksError) as no_grads:
        scaling.step_stage(ready, scaled=True, grad_dtypes=[])
    assert no_grads.value.stage == scaling.OptimizerStage(scaling.UNSCALED, False)
    with pytest.raises(AssertionError, match="prior to update"):
        scaling.check_update([no_grads.value.stage], scaled=True)
    scaling.check_update([no_grads.value.stage], scaled=True, new_scale=True)
    with pytest.raises(AssertionError, match="Attempted update"):
        scaling.check_update([unscaled], scaled=False)


# --- rules 13, 14: saving, loading, new_scale -------------------------------------------------


def test_state_dict_round_trip_and_pending_scale():
    c = ScalerConfig(init_scale=0.1, growth_factor=3.0, growth_interval=4)
    s = initial_state(c)
    assert scaling.state_dict(s, c, pending_scale=0.1)["scale"] == 0.1
    saved = scaling.state_dict(s, c)
    assert saved == {"scale": float(np.float32(0.1)), "growth_factor": 3.0, "backoff_factor": 0.5,
                     "growth_interval": 4, "_growth_tracker": 0}
    loaded, state, pending = scaling.load_state_dict({**saved, "_growth_tracker": 9, "scale": 0.3}, ScalerConfig())
    assert (loaded.growth_factor, loaded.growth_interval, int(state.growth_tracker)) == (3.0, 4, 9)
    assert state.scale == np.float32(0.3) and pending == 0.3
    # A tracker past the interval never grows again and keeps counting (rule 7's equality).
    assert update_scale(state, False, loaded) == ScalerState(state.scale, 10, 1)
    with pytest.raises(KeyError, match="_growth_tracker"):
        scaling.load_state_dict({"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1},
                                ScalerConfig())


def test_set_scale_rounds_to_float32_and_keeps_the_counters():
    s = ScalerState(np.float32(8.0), 3, 2)
    assert scaling.set_scale(s, 0.1) == ScalerState(np.float32(0.1), 3, 2)
    assert float(scaling.set_scale(s, 1e39).scale) == float("inf")
