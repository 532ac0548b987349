"""reference.master_weights: the four options on values whose answers are known by hand."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from reference import health
from reference import master_weights as mw
from reference.optim import spec

BF16 = ml_dtypes.bfloat16


def u16(x: np.ndarray) -> list[int]:
    return np.asarray(x).view(np.uint16).ravel().tolist()


def test_stochastic_rounding_goes_away_from_zero_when_the_bits_are_below_the_low_half():
    x = np.array([1 + 2**-8, 1 + 2**-8, -(1 + 2**-8), 1.0], np.float32)  # low 16 bits 0x8000, 0x8000, 0x8000, 0
    out = mw.stochastic_round_bf16(x, np.array([0x7FFF, 0x8000, 0, 0]))
    assert u16(out) == [0x3F81, 0x3F80, 0xBF81, 0x3F80]  # 1 + 2^-7, 1, -(1 + 2^-7), 1 exactly (never rounds)


def test_stochastic_rounding_past_the_largest_float32_gives_inf_and_nan_is_canonical():
    x = np.array([np.finfo(np.float32).max, np.nan], np.float32)
    assert u16(mw.stochastic_round_bf16(x, np.array([0, 0]))) == [0x7F80, 0x7FC0]


def test_stochastic_rounding_refuses_bits_outside_16_bits_or_of_another_shape():
    with pytest.raises(ValueError, match=r"\[0, 2\*\*16\)"):
        mw.stochastic_round_bf16(np.ones(2, np.float32), np.array([0, 1 << 16]))
    with pytest.raises(ValueError, match="shape"):
        mw.stochastic_round_bf16(np.ones(2, np.float32), np.array([0]))


def test_kahan_carries_what_rounding_lost_into_the_next_step():
    w, c = np.array([1.0], BF16), np.zeros(1, BF16)
    u = np.array([2**-9], np.float32)  # a quarter of bf16's spacing above 1
    w, c = mw.kahan_add(w, c, u)
    assert (float(w[0]), float(c[0])) == (1.0, 2**-9)  # lost to rounding, kept in c
    w, c = mw.kahan_add(w, c, u)
    assert (float(w[0]), float(c[0])) == (1.0, 2**-8)  # 1 + 2^-8 is a tie: RNE keeps the even 1
    w, c = mw.kahan_add(w, c, u)
    assert (float(w[0]), float(c[0])) == (1 + 2**-7, -(2**-9))  # 3 quarters: taken, the overshoot owed


def _sgd(lr: float, **kw):
    row = spec("SGD")
    return row, row.make_config(lr=lr, **kw)


def test_fp32_master_accumulates_updates_the_bf16_weight_cannot_show():
    row, cfg = _sgd(2**-10)
    s = mw.init_master_state("fp32", np.array([1.0], BF16), row, cfg)
    g = np.array([1.0], BF16)
    for k in range(1, 5):
        before = s.weight
        (s,), (exact,) = mw.master_step("fp32", row, "for-loop", [s], [g], cfg)
        assert float(s.master[0]) == 1 - k * 2**-10
        assert exact.tolist() == [-(2**-10)]
        if k < 2:  # 1 - 2^-10 rounds back to 1 (bf16's spacing below 1 is 2^-8): a lost update
            assert health.applied_lost_count(before, s.weight, exact) == (1, 1)
    assert float(s.weight[0]) == 1 - 2**-8  # the master reached a bf16 value


def test_kahan_and_stochastic_step_from_the_stored_weight_in_float32():
    row, cfg = _sgd(2**-10)
    g = np.array([1.0], BF16)
    k = mw.init_master_state("kahan", np.array([1.0], BF16), row, cfg)
    (k,), (u,) = mw.master_step("kahan", row, "for-loop", [k], [g], cfg)
    assert u.tolist() == [-(2**-10)] and float(k.weight[0]) == 1.0 and float(k.compensation[0]) == -(2**-10)
    s = mw.init_master_state("stochastic", np.array([1.0], BF16), row, cfg)
    # q = 1 - 2^-10 = 0x3F7FC000: truncated 0x3F7F = 1 - 2^-8; bits below the low half 0xC000 round
    # away from zero, to 0x3F80 = 1 (probability 3/4: the expected value is q)
    (a,), _ = mw.master_step("stochastic", row, "for-loop", [s], [g], cfg, bits=[np.array([0xBFFF])])
    (b,), _ = mw.master_step("stochastic", row, "for-loop", [s], [g], cfg, bits=[np.array([0xC000])])
    assert float(a.weight[0]) == 1.0 and float(b.weight[0]) == 1 - 2**-8


def test_state_lives_in_the_storage_format_but_for_the_float32_counters():
    row = spec("AdamW")
    cfg = row.make_config(lr=1e-3)
    for option, dtype in (("fp32", np.float32), ("kahan", BF16), ("stochastic", BF16)):
        s = mw.init_master_state(option, np.ones(3, BF16), row, cfg)
        (s,), _ = mw.master_step(option, row, "foreach", [s], [np.ones(3, BF16)], cfg, bits=[np.zeros(3, np.int32)])
        assert s.opt.exp_avg.dtype == dtype and s.opt.exp_avg_sq.dtype == dtype
        assert isinstance(s.opt.step, np.float32) and s.opt.step == 1


def test_a_parameter_without_a_gradient_keeps_everything():
    row, cfg = _sgd(0.5, momentum=0.9)
    for option in ("fp32", "kahan", "stochastic"):
        s = mw.init_master_state(option, np.array([3.0], BF16), row, cfg)
        (t,), (e,) = mw.master_step(option, row, "for-loop", [s], [None], cfg, bits=[None])
        assert t == s and e is None


def test_bytes_per_parameter_of_adamw_by_option():
    row = spec("AdamW")
    cfg = row.make_config()
    step = 4 / (64 * 64)  # the float32 step counter
    assert mw.bytes_per_parameter("none", row, cfg) == 2 + 2 + 2 + step
    assert mw.bytes_per_parameter("fp32", row, cfg) == 2 + 4 + 4 + 4 + step
    assert mw.bytes_per_parameter("kahan", row, cfg) == 2 + 2 + 2 + 2 + step
    assert mw.bytes_per_parameter("stochastic", row, cfg) == 2 + 2 + 2 + step
    sgd, plain = spec("SGD"), spec("SGD").make_config(lr=0.1)
    assert [mw.bytes_per_parameter(o, sgd, plain) for o in mw.OPTIONS] == [2, 6, 4, 2]  # no momentum buffer
    assert mw.bytes_per_parameter("fp32", sgd, sgd.make_config(lr=0.1, momentum=0.9), storage="float16") == 10


def test_bad_options_are_refused_naming_the_fix():
    row, cfg = _sgd(0.1)
    with pytest.raises(ValueError, match="one of none, fp32, kahan, stochastic"):
        mw.init_master_state("fp64", np.ones(1, BF16), row, cfg)
    with pytest.raises(ValueError, match="bfloat16 storage only"):
        mw.init_master_state("stochastic", np.ones(1, np.float16), row, cfg, storage="float16")
    with pytest.raises(ValueError, match="must be stored in bfloat16"):
        mw.init_master_state("fp32", np.ones(1, np.float32), row, cfg)
    s = mw.init_master_state("stochastic", np.ones(1, BF16), row, cfg)
    with pytest.raises(ValueError, match="random bits as an input"):
        mw.master_step("stochastic", row, "for-loop", [s], [np.ones(1, BF16)], cfg)
