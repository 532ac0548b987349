"""reference.health: the doctor's statistics on values whose answers are known by hand."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from reference import formats, health


def f32(*v) -> np.ndarray:
    return np.array(v, dtype=np.float32)


def test_amax_ignores_nan_keeps_inf_and_is_zero_when_empty():
    assert health.amax(f32(1, -3, np.nan)) == 3.0
    assert health.amax(f32(1, -np.inf)) == math.inf
    assert health.amax(f32()) == 0.0
    assert health.amax(f32(np.nan)) == 0.0
    assert health.amax(np.array([-448], dtype=ml_dtypes.float8_e4m3fn)) == 448.0


def test_headroom_bits_is_log2_of_max_over_amax():
    assert health.headroom_bits(65504.0, "fp16") == 0.0
    assert health.headroom_bits(65504.0 / 8, "fp16") == 3.0
    assert health.headroom_bits(7.1e4, "fp16") < 0
    assert health.headroom_bits(0.0, "fp16") == math.inf
    assert health.headroom_bits(math.inf, "bf16") == -math.inf
    assert math.isnan(health.headroom_bits(math.nan, "bf16"))


def test_overflow_follows_rne_at_the_threshold():
    # float16: max 65504 has an odd mantissa, so the tie 65520 rounds up to inf
    assert health.overflow_count(f32(65519, 65520, -70000, np.inf, np.nan), "fp16") == 2
    # float8_e4m3fn: 464 is a tie that goes to the even 448; just above it overflows
    assert health.overflow_count(f32(464, np.nextafter(np.float32(464), np.float32(500))), "e4m3fn") == 1
    # bf16 has float32's range
    assert health.overflow_count(f32(7e4, 3e38), "bf16") == 0
    # a scale multiplies first, in float32
    assert health.overflow_fraction(f32(1000, 1), "fp16", scale=64) == 0.0
    assert health.overflow_fraction(f32(1000, 1), "fp16", scale=128) == 0.5
    assert health.saturation_fraction is health.overflow_fraction


def test_underflow_counts_nonzero_values_that_round_to_zero():
    tie = 2.0**-25  # half the smallest fp16 subnormal: RNE takes it to 0
    assert health.underflow_count(f32(tie, tie * 1.0001, 1e-8, 0, 1), "fp16") == (2, 4)
    assert health.underflow_fraction(f32(1e-8), "fp16", scale=2.0**10) == 0.0
    assert health.underflow_fraction(f32(1e-8), "bf16") == 0.0
    assert health.underflow_fraction(f32(), "fp16") == 0.0


def test_flushed_fraction_is_over_the_references_nonzero_entries():
    assert health.flushed_count(f32(1, 2, 0, 3), f32(1, 0, 0, -0.0)) == (2, 3)
    assert health.flushed_fraction(f32(0, 0), f32(0, 0)) == 0.0
    with pytest.raises(ValueError, match="shape"):
        health.flushed_fraction(f32(1, 2), f32(1))


def test_nonfinite_and_subnormal_fractions():
    assert health.nonfinite_fraction(np.array([1, np.inf, np.nan, 0], dtype=np.float16)) == 0.5
    y = np.array([2.0**-15, 2.0**-14, 0, 1], dtype=np.float16)
    assert health.subnormal_fraction(y, "fp16") == 0.25


def test_sqnr_db():
    assert health.sqnr_db(f32(1, 2), f32(1, 2)) == math.inf
    assert health.sqnr_db(f32(3, 4), f32(3, 3)) == pytest.approx(10 * math.log10(25.0), abs=0)
    assert health.sqnr_db(f32(0, 0), f32(0, 1)) == -math.inf
    assert math.isnan(health.sqnr_db(f32(1, np.inf), f32(1, 1)))
    assert health.sqnr_bound_db(1000, 40.0) < 1e-9


def test_lost_updates_by_the_half_ulp_rule_in_the_updates_direction():
    one = np.array([1.0, 1.0, 1.0, 1.0], dtype=ml_dtypes.bfloat16)
    # above 1 the bf16 gap is 2^-7, below it 2^-8
    u = f32(2.0**-9, -(2.0**-9), -(2.0**-10), 2.0**-7)
    assert health.lost_update_count(one, u, "bf16") == (2, 4)  # +2^-9 and -2^-10; -2^-9 is a tie
    assert health.lost_update_count(np.ones(3, np.float32), f32(1e-8, 1e-7, 0), "fp32") == (1, 2)
    assert health.lost_update_count(np.zeros(1, np.float16), f32(2.0**-26), "fp16") == (1, 1)
    big = np.array([65504.0], dtype=np.float16)  # outward at max: the spacing below max (32)
    assert health.lost_update_count(big, f32(15), "fp16") == (1, 1)
    with pytest.raises(ValueError, match="dtype"):
        health.lost_update_count(np.ones(1, np.float32), f32(1), "bf16")


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"])
def test_a_lost_update_rounds_back_to_the_weight(fmt):
    f = formats.get_format(fmt)
    rng = np.random.default_rng(3)
    w = formats.cast(rng.standard_normal(4000).astype(np.float32) * 4, fmt)
    w64 = w.astype(np.float32).astype(np.float64)
    spacing = np.abs(w64) * f.eps + f.smallest_subnormal
    u = (rng.uniform(-1, 1, w.size) * spacing).astype(np.float32)
    gap_up, gap_down = health._magnitude_neighbours(w, f)
    lost, live = health.lost_update_count(w, u, fmt)
    assert 0 < lost < live
    moved_back = formats.cast(w64 + u.astype(np.float64), fmt, saturate=fmt == "float8_e4m3fn")
    same = formats.bits(moved_back) == formats.bits(w)
    flagged = np.abs(u.astype(np.float64)) < np.where((w64 == 0) | (np.sign(u) == np.sign(w64)), gap_up, gap_down) / 2
    flagged &= u != 0
    assert np.all(same[flagged]), "an update the rule calls lost moved the weight"
    assert np.count_nonzero(flagged) == lost


def test_scale_range():
    r = health.scale_range(f32(1.0), "fp16")
    assert (r.low, r.high, r.works) == (-24, 15, True)
    r = health.scale_range(f32(1.0, 2.0**-30), "fp16", keep=1.0)
    assert (r.low, r.high) == (6, 15)
    r = health.scale_range(f32(2.0**10, 2.0**-40), "fp16", keep=1.0)
    assert (r.low, r.high, r.works) == (16, 5, False)
    # keep 0.5 of two values: only the larger must survive
    assert health.scale_range(f32(2.0**10, 2.0**-40), "fp16", keep=0.5).low == -34
    assert health.scale_range(f32(0, np.nan), "fp16") == health.ScaleRange(None, None)
    both = health.combine_scale_ranges([health.ScaleRange(-3, 10), health.ScaleRange(2, 12), health.ScaleRange(None, None)])
    assert both == health.ScaleRange(2, 10)
    with pytest.raises(ValueError, match="keep"):
        health.scale_range(f32(1), "fp16", keep=0)


def test_applied_lost_counts_unchanged_bits_where_the_exact_update_was_nonzero():
    bf = ml_dtypes.bfloat16
    before = np.array([1.0, 1.0, 0.0, 2.0, -0.0, 3.0, 256.0], dtype=bf)
    exact = np.array([1e-5, 0.25, 1e-3, 0.0, 1e-30, np.nan, -0.5])
    after = (before.astype(np.float64) + exact).astype(bf)
    # 1 + 1e-5 rounds back to 1 (lost); 1 + 0.25 and 0 + 1e-3 move; -0 + 1e-30 moves (bf16
    # has float32's range); 256 - 0.5 = 255.5 is the tie between 255 and 256 (bf16's spacing
    # in [128, 256) is 1), which RNE takes to the even 256: lost; a zero and a NaN update are
    # not counted
    assert after[6] == before[6]
    assert health.applied_lost_count(before, after, exact) == (2, 5)
    assert health.applied_lost_fraction(before, after, exact) == 2 / 5


def test_applied_lost_sees_sign_of_zero_and_refuses_mismatched_arrays():
    before = np.array([-0.0], dtype=np.float32)
    after = np.array([0.0], dtype=np.float32)
    assert health.applied_lost_count(before, after, np.array([1e-50])) == (0, 1)
    assert health.applied_lost_count(before, before.copy(), np.array([1e-50])) == (1, 1)
    assert health.applied_lost_fraction(before[:0], after[:0], np.zeros(0)) == 0.0
    with pytest.raises(ValueError, match="same dtype and shape"):
        health.applied_lost_count(before, after.astype(np.float64), np.array([1.0]))
    with pytest.raises(ValueError, match="exact update shape"):
        health.applied_lost_count(before, after, np.zeros(2))


def test_underflow_mass_weighs_what_flushes():
    # float16's smallest subnormal is 2^-24: 2^-26 flushes (below half of it), 2^-24 and 1 stay
    x = f32(1.0, -(2.0**-26), 2.0**-24, 0.0, np.inf, np.nan)
    lost, total = health.underflow_mass(x, "fp16")
    assert (lost, total) == (2.0**-26, 1.0 + 2.0**-26 + 2.0**-24)
    assert health.underflow_mass_fraction(x, "fp16") == 2.0**-26 / (1.0 + 2.0**-26 + 2.0**-24)
    # the scale rescues it: at 2^4 nothing flushes
    assert health.underflow_mass(x, "fp16", 16.0) == (0.0, total)
    # a million tiny values beside one of 1: most elements flush, almost no mass does
    many = np.concatenate([f32(1.0), np.full(10**6, 1e-20, dtype=np.float32)])
    assert health.underflow_fraction(many, "fp16") > 0.99
    assert health.underflow_mass_fraction(many, "fp16") == pytest.approx(1e-14, rel=1e-6)
    assert health.underflow_mass_fraction(f32(), "fp16") == 0.0
    assert health.underflow_mass_fraction(f32(0.0, np.inf), "fp16") == 0.0


def test_flushed_mass_is_rule_6_weighed_by_the_reference():
    ref = f32(3.0, -1.0, 2.0**-30, 0.0, np.inf)
    obs = f32(3.0, 0.0, 0.0, 0.0, np.inf)
    assert health.flushed_mass(ref, obs) == (1.0 + 2.0**-30, 4.0 + 2.0**-30)
    assert health.flushed_mass_fraction(ref, obs) == (1.0 + 2.0**-30) / (4.0 + 2.0**-30)
    assert health.flushed_mass_fraction(f32(0.0), f32(0.0)) == 0.0
    with pytest.raises(ValueError, match="same tensor of both runs"):
        health.flushed_mass(f32(1.0), f32(1.0, 2.0))


def test_mass_fraction_bound_scales_with_the_value_and_the_length():
    assert health.mass_fraction_bound(1, 0.0) == 0.0
    assert health.mass_fraction_bound(2**20, 0.5) == 0.5 * (2.0 * (2**20 - 1) * 2.0**-53 + 2.0**-52)
