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


def test_low_precision_kernels_round_a_python_scalar_to_float32_not_to_the_storage_format():
    from reference import lowprec

    s = 1 + 2**-8 + 2**-20  # bf16 would round it to 1 + 2^-7
    # 3 * s = 3.01172 rounds to 3.015625; with s in bf16, 3.0234375 is a tie that RNE takes to 3.03125
    assert float(lowprec.mul_scalar(np.array(3.0, BF16), s)) == 3.015625


def test_none_is_modelled_where_covered_and_refused_naming_the_pair_elsewhere():
    from reference import lowprec

    row = spec("SGD")
    cfg = row.make_config(lr=2**-10)
    s = mw.init_master_state("none", np.array([1.0], BF16), row, cfg)
    (t,), (e,) = mw.master_step("none", row, "for-loop", [s], [np.array([1.0], BF16)], cfg)
    assert float(t.weight[0]) == 1.0 and e.tolist() == [-(2**-10)]  # lost: 1 - 2^-10 rounds back to 1
    assert lowprec.COVERED["AdamW"] == ("for-loop", "foreach", "fused")
    moment = row.make_config(lr=2**-10, momentum=0.9)
    with pytest.raises(NotImplementedError, match=r"SGD \(fused\) on low-precision parameters with momentum 0.9"):
        mw.master_step("none", row, "fused", [s], [np.array([1.0], BF16)], moment)
    ada = spec("Adafactor")
    one, empty = (mw.init_master_state("none", w, ada, ada.make_config()) for w in (np.ones(1, BF16), np.ones(0, BF16)))
    with pytest.raises(NotImplementedError, match=r"Adafactor \(fused\) on low-precision parameters"):
        mw.master_step("none", ada, "fused", [one], [np.ones(1, BF16)], ada.make_config())
    # reference.optim.adafactor rule 10 on S (lowprec rule 16): torch raises ZeroDivisionError, the spec names it
    with pytest.raises(ValueError, match=r"params\[1\] is empty \(shape \(0,\)\).*ZeroDivisionError"):
        mw.master_step("none", ada, "foreach", [one, empty], [np.ones(1, BF16), np.ones(0, BF16)], ada.make_config())


@pytest.mark.parametrize("storage", [BF16, np.dtype(np.float16)])
def test_fused_sgd_on_16_bit_parameters_keeps_the_weights_of_its_vector_loop(storage):
    """``reference.lowprec`` rule 15: torch's fused SGD kernel on S never stores the weights of its
    vector loop (the first ``n - n % 16`` of 33): they keep their values; the tail steps,
    ``1 - 1 * 2**-4`` exactly; a 0-d parameter is all tail."""
    from reference import lowprec

    row = spec("SGD")
    cfg = row.make_config(lr=2**-4)
    (w, z), _ = lowprec.step(row, "fused", [np.ones(33, storage), np.array(1.0, storage)],
                             [np.ones(33, storage), np.array(1.0, storage)], [row.init_state(np.ones(1), cfg)] * 2, cfg)
    assert w.dtype == storage and w[:32].tolist() == [1.0] * 32 and float(w[32]) == 1 - 2**-4
    assert z.shape == () and float(z) == 1 - 2**-4


def test_fused_adagrad_rounds_its_hyperparameters_to_the_storage_format_in_the_vector_loop_only():
    """``reference.lowprec`` rule 15: with p = 1, g = 0 and weight decay w = 1 + 2**-8 + 2**-20,
    ``d = p * w`` and the stored sum is ``S(d * d)``: the vector loop (16 elements) takes
    bf16(w) = 1 + 2**-7, whose square 1.01568... rounds to 1.015625; the tail takes float32 w,
    whose square 1.00783 rounds to 1.0078125."""
    from reference import lowprec

    row = spec("Adagrad")
    cfg = row.make_config(lr=0.01, weight_decay=1 + 2**-8 + 2**-20)
    w = np.ones(17, BF16)
    state = mw.init_master_state("none", w, row, cfg).opt
    _, (s,) = lowprec.step(row, "fused", [w], [np.zeros(17, BF16)], [state], cfg)
    assert s.sum[:16].tolist() == [1.015625] * 16 and float(s.sum[16]) == 1.0078125 and float(s.step) == 1.0


def test_foreach_multiplies_by_a_scalar_rounded_to_the_storage_format():
    from reference import lowprec

    # lowprec rule 7: the in-place _foreach_mul_ by 0.9 multiplies by bf16(0.9) = 0.8984375: 3 * that is
    # 2.6953125, a tie between 2.6875 (even) and 2.703125; Tensor.mul by float32 0.9 gives 2.7 -> 2.703125
    assert float(lowprec.mul_scalar_foreach(np.array(3.0, BF16), 0.9)) == 2.6875
    assert float(lowprec.mul_scalar(np.array(3.0, BF16), 0.9)) == 2.703125


def test_low_precision_add_of_a_python_scalar_rounds_the_scalar_to_the_storage_format_first():
    from reference import lowprec

    # bf16(0.001) = 0.00099945068359375; the sum 0.001880645751953125 is the tie between 0.0018768310546875
    # (even) and 0.00188446044921875, so RNE keeps 0.0018768...; with 0.001 in float32 it rounds up
    x = np.array(0.000881195068359375, BF16)
    assert float(lowprec.add_scalar(x, 0.001)) == 0.0018768310546875


def test_every_registry_pair_is_modelled_on_16_bit_tensors_or_refused_naming_it():
    """``reference.lowprec`` rule 10: each (optimizer, implementation) of the registry either steps
    bf16 parameters (conformance/test_master_weights.py compares it with torch) or raises
    NotImplementedError naming the pair; docs/training.md's table says the same of each pair."""
    from pathlib import Path

    from reference import lowprec, optim

    table = Path(__file__).resolve().parent.parent.joinpath("docs", "training.md").read_text()
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[1:] != ["for-loop", "foreach", "fused"]:
            for name in cells[0].split(", "):
                rows[name] = dict(zip(("for-loop", "foreach", "fused"), cells[1:]))
    for name, row in optim.SPECS.items():
        cfg = row.make_config()
        w = np.array([1.0, -2.0], BF16)
        state = mw.init_master_state("none", w, row, cfg)
        for impl in row.steps:
            documented = rows[name][impl]
            if lowprec.covered(name, impl):
                (s,), _ = mw.master_step("none", row, impl, [state], [np.array([0.5, 0.25], BF16)], cfg)
                assert s.weight.dtype == BF16 and documented.startswith("bit for bit"), (name, impl, documented)
            else:
                with pytest.raises(NotImplementedError, match=rf"{name} \({impl}\) on low-precision parameters"):
                    mw.master_step("none", row, impl, [state], [np.array([0.5, 0.25], BF16)], cfg)
                assert documented.startswith("not modelled"), (name, impl, documented)


def test_docs_kernels_table_states_each_capability_as_rule_13_does():
    """``reference.lowprec`` rule 13: docs/training.md's kernels table has a row for each capability
    of ``KERNELS`` (scalar for DEFAULT), "bit for bit" for the for-loop/foreach and fused SGD/Adagrad
    columns, and fused Adam/AdamW within the bound `bound` gives (bit for bit where it is 0)."""
    from pathlib import Path

    from reference import lowprec

    table = Path(__file__).resolve().parent.parent.joinpath("docs", "training.md").read_text()
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0].split(" ")[0] in ("scalar", "AVX2", "AVX512"):
            rows[{"scalar": "DEFAULT"}.get(cells[0].split(" ")[0], cells[0].split(" ")[0])] = cells[1:]
    assert sorted(rows) == sorted(lowprec.KERNELS), (sorted(rows), sorted(lowprec.KERNELS))
    for kernels, (loops, fused_adam, fused_16) in rows.items():
        assert loops == fused_16 == "bit for bit", (kernels, loops, fused_16)
        ulps = lowprec.bound("AdamW", "fused", kernels)
        assert fused_adam == ("bit for bit" if ulps == 0 else f"within {ulps} ULPs of bf16/fp16 at `x_abs`"), kernels
        assert lowprec.bound("SGD", "for-loop", kernels) == lowprec.bound("Adagrad", "fused", kernels) == 0
