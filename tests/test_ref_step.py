"""The step contract of the reference: order, skip rules, schedule, records and replay."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from reference import optim, scaling
from reference.step import (
    LRSchedule,
    ParamGroup,
    StepConfig,
    StepRecord,
    accumulate_gradients,
    init_train_state,
    replay,
    scaled_microbatch_loss,
    train_step,
)


def _sgd_config(**kw) -> StepConfig:
    base = dict(
        optimizer=optim.SGDConfig(lr=0.1),
        scaler=scaling.ScalerConfig(init_scale=1024.0, growth_interval=3),
    )
    base.update(kw)
    return StepConfig(**base)


def _params():
    return [np.array([1.0, -2.0, 0.5], dtype=np.float32), np.array([[0.25, 3.0]], dtype=np.float32)]


def test_inf_in_microbatch_2_of_4_skips_the_step_and_keeps_the_schedule():
    cfg = _sgd_config(schedule=LRSchedule(base_lr=0.1, kind="cosine", warmup_steps=2, total_steps=10))
    state = init_train_state(_params(), cfg)
    scale = state.scaler.scale
    mbs = [[np.full(p.shape, 0.5 * scale, np.float32) for p in state.params] for _ in range(4)]
    mbs[1][0] = mbs[1][0].copy()
    mbs[1][0][1] = np.inf
    result = train_step(state, accumulate_gradients(mbs), cfg, microbatches=4)
    rec = result.record
    assert rec.found_inf and not rec.applied
    assert rec.microbatches == 4
    for before, after in zip(state.params, result.state.params):
        np.testing.assert_array_equal(before, after)
    assert result.state.applied_steps == 0, "a skipped step must not advance the schedule"
    assert result.state.step == 1
    assert cfg.lr_at(result.state.applied_steps) == rec.lr, "the next step must use the same learning rate"
    assert rec.scale_after == float(scale) / 2


def test_clipping_sees_unscaled_gradients_at_the_unchanged_threshold():
    cfg = _sgd_config(clip_norm=1.0, optimizer=optim.SGDConfig(lr=0.0))
    state = init_train_state([np.zeros(2, np.float32)], cfg)
    grads = [np.array([3.0, 4.0], np.float32) * state.scaler.scale]
    result = train_step(state, grads, cfg)
    assert result.record.grad_norm == pytest.approx(5.0, rel=1e-7), "the norm must be of the unscaled gradients"
    assert result.record.clip_coef == pytest.approx(0.2, rel=1e-6)
    np.testing.assert_allclose(result.grads[0], [0.6, 0.8], rtol=1e-6)


def test_clean_steps_apply_and_grow_the_scale_on_the_interval():
    cfg = _sgd_config()
    state = init_train_state(_params(), cfg)
    scales = []
    for _ in range(3):
        grads = [np.ones_like(p) * state.scaler.scale for p in state.params]
        result = train_step(state, grads, cfg)
        assert result.record.applied
        state = result.state
        scales.append(result.record.scale_after)
    assert scales == [1024.0, 1024.0, 2048.0]
    assert state.applied_steps == 3
    # SGD lr 0.1 on unit gradients, three times, in float32.
    expected = np.float32(1.0)
    for _ in range(3):
        expected = np.float32(expected - np.float32(0.1))
    assert state.params[0][0] == expected


def test_the_inputs_are_not_modified():
    cfg = _sgd_config(clip_norm=0.5)
    state = init_train_state(_params(), cfg)
    grads = [np.full(p.shape, 7.0 * state.scaler.scale, np.float32) for p in state.params]
    copies = [g.copy() for g in grads]
    params_before = [p.copy() for p in state.params]
    train_step(state, grads, cfg)
    for g, c in zip(grads, copies):
        np.testing.assert_array_equal(g, c)
    for p, c in zip(state.params, params_before):
        np.testing.assert_array_equal(p, c)


def test_without_a_scaler_the_scale_is_one_and_non_finite_gradients_still_skip():
    cfg = _sgd_config(use_scaler=False)
    state = init_train_state(_params(), cfg)
    assert state.scaler.scale == 1.0
    grads = [np.array([np.nan, 0.0, 0.0], np.float32), np.zeros((1, 2), np.float32)]
    result = train_step(state, grads, cfg)
    assert result.record.found_inf and not result.record.applied
    assert result.record.scale_before == result.record.scale_after == 1.0
    np.testing.assert_array_equal(result.state.params[0], state.params[0])


def test_scaled_microbatch_loss_divides_by_the_real_window_size():
    state = scaling.initial_state(scaling.ScalerConfig(init_scale=8.0))
    assert scaled_microbatch_loss(3.0, 4, state) == np.float32(6.0)
    # A short last window of 3 microbatches divides by 3, in float32.
    assert scaled_microbatch_loss(1.0, 3, state) == np.float32(np.float32(1.0) / np.float32(3.0)) * np.float32(8.0)
    with pytest.raises(ValueError, match="microbatches"):
        scaled_microbatch_loss(1.0, 0, state)


def test_accumulation_rounds_low_precision_gradients_after_each_addition():
    bf16 = ml_dtypes.bfloat16
    one = np.array([1.0], bf16)
    tiny = np.array([2.0**-9], bf16)  # below half a bf16 ulp at 1.0: each addition rounds it away
    total = accumulate_gradients([[one], [tiny], [tiny]])
    assert total[0].dtype == bf16
    assert float(total[0][0]) == 1.0
    f32 = accumulate_gradients([[one.astype(np.float32)], [tiny.astype(np.float32)], [tiny.astype(np.float32)]])
    assert f32[0][0] == np.float32(1.0 + 2.0**-8)


def test_accumulation_rejects_mismatched_microbatches():
    with pytest.raises(ValueError, match="microbatch 1"):
        accumulate_gradients([[np.zeros(2)], [np.zeros(2), np.zeros(2)]])
    with pytest.raises(ValueError, match="empty"):
        accumulate_gradients([])


def test_lr_schedule_warmup_then_cosine():
    s = LRSchedule(base_lr=1.0, kind="cosine", warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [s.lr_at(n) for n in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr_at(4) == 1.0
    assert s.lr_at(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.lr_at(14) == pytest.approx(0.1)
    assert s.lr_at(100) == pytest.approx(0.1)
    assert LRSchedule(base_lr=0.3).lr_at(1000) == 0.3


def test_lr_schedule_step_is_the_chained_product_not_a_power():
    s = LRSchedule(base_lr=0.1, kind="step", step_size=2, gamma=0.1)
    assert [s.lr_at(n) for n in range(5)] == [0.1, 0.1, 0.1 * 0.1, 0.1 * 0.1, 0.1 * 0.1 * 0.1]
    # The chained float64 product differs from the closed form in the last bit here.
    chained = LRSchedule(base_lr=0.3, kind="step", step_size=1, gamma=0.7)
    assert chained.lr_at(2) == 0.3 * 0.7 * 0.7 == 0.147 != 0.3 * 0.7 ** 2
    with pytest.raises(ValueError, match="no warmup"):
        LRSchedule(base_lr=0.1, kind="step", warmup_steps=1)
    with pytest.raises(ValueError, match="step_size"):
        LRSchedule(base_lr=0.1, kind="step", step_size=0)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(base_lr=-1.0), "base_lr"),
        (dict(base_lr=1.0, kind="linear"), "kind"),
        (dict(base_lr=1.0, warmup_steps=-1), "warmup_steps"),
        (dict(base_lr=1.0, kind="cosine"), "total_steps"),
        (dict(base_lr=1.0, min_lr_ratio=2.0), "min_lr_ratio"),
    ],
)
def test_lr_schedule_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LRSchedule(**kwargs)


def test_step_config_rejects_bad_arguments():
    with pytest.raises(ValueError, match="clip_norm"):
        _sgd_config(clip_norm=0.0)
    with pytest.raises(ValueError, match="optimizer_kind"):
        _sgd_config(optimizer_kind="magic")
    with pytest.raises(ValueError, match="optimizer"):
        StepConfig(optimizer="sgd")


def test_train_step_rejects_gradients_that_do_not_match_the_parameters():
    cfg = _sgd_config()
    state = init_train_state(_params(), cfg)
    with pytest.raises(ValueError, match="2 parameters"):
        train_step(state, [np.zeros(3, np.float32)], cfg)
    with pytest.raises(ValueError, match="gradient 1"):
        train_step(state, [np.zeros(3, np.float32), np.zeros(2, np.float32)], cfg)


def test_fused_adamw_skip_leaves_gradients_scaled():
    cfg = StepConfig(
        optimizer=optim.adamw_config(lr=1e-3),
        scaler=scaling.ScalerConfig(init_scale=1000.0),
        optimizer_kind="fused",
        unscale="kernel",
    )
    state = init_train_state([np.ones(3, np.float32)], cfg)
    grads = [np.array([1.0, np.inf, 2.0], np.float32)]
    result = train_step(state, grads, cfg)
    assert not result.record.applied
    np.testing.assert_array_equal(result.grads[0], grads[0])
    np.testing.assert_array_equal(result.state.params[0], state.params[0])
    clean = train_step(result.state, [np.array([1000.0, 2000.0, 3000.0], np.float32)], cfg)
    assert clean.record.applied
    # True division by the scale, not a multiply by its reciprocal.
    np.testing.assert_array_equal(clean.grads[0], np.array([1000.0, 2000.0, 3000.0], np.float32) / np.float32(500.0))


def _trace(n_steps: int, inf_at: set[int]) -> tuple[list[StepRecord], scaling.ScalerConfig]:
    cfg = _sgd_config()
    state = init_train_state(_params(), cfg)
    records = []
    for i in range(n_steps):
        grads = [np.ones_like(p) * state.scaler.scale for p in state.params]
        if i in inf_at:
            grads[0][0] = np.inf
        result = train_step(state, grads, cfg)
        records.append(result.record)
        state = result.state
    return records, cfg.scaler


def test_replay_agrees_with_its_own_trace_and_round_trips_through_dicts():
    records, scaler_cfg = _trace(12, {2, 5, 6})
    assert replay(records, scaler_cfg).ok
    dicts = [r.to_dict() for r in records]
    assert [StepRecord.from_dict(d) for d in dicts] == records
    assert replay(dicts, scaler_cfg).steps_checked == 12


def test_replay_names_the_first_divergent_step_and_field():
    records, scaler_cfg = _trace(12, {2, 5})
    tampered = [r.to_dict() for r in records]
    tampered[7]["scale_after"] = tampered[7]["scale_after"] * 2
    result = replay(tampered, scaler_cfg)
    assert result.first_divergence == 7
    assert result.field == "scale_after"
    assert "step 7" in result.describe()
    flipped = [r.to_dict() for r in records]
    flipped[5]["found_inf"] = False
    assert replay(flipped, scaler_cfg).first_divergence == 5


def test_replay_of_a_resumed_trace_trusts_its_first_record():
    records, scaler_cfg = _trace(12, {2, 9})
    tail = records[4:]
    result = replay(tail, scaler_cfg)
    assert result.ok and result.steps_checked == len(tail) - 1


def test_step_record_from_dict_names_missing_fields():
    with pytest.raises(ValueError, match="scale_after"):
        StepRecord.from_dict({"step": 0})


# --- parameter groups, the fused optimizer and the sync-free mode ---------------------------------


def _adamw_step_config(**kw) -> StepConfig:
    base = dict(optimizer=optim.adamw_config(lr=0.1, weight_decay=0.5),
                scaler=scaling.ScalerConfig(init_scale=1024.0, growth_interval=3))
    base.update(kw)
    return StepConfig(**base)


def test_a_parameter_group_overrides_weight_decay_for_its_parameters_only():
    groups = (ParamGroup((1,)), ParamGroup((0,), {"weight_decay": 0.0}))
    cfg = _adamw_step_config(param_groups=groups)
    plain = _adamw_step_config()
    state = init_train_state(_params(), cfg)
    grads = [np.ones_like(p) * state.scaler.scale for p in state.params]
    grouped = train_step(state, grads, cfg).state.params
    decayed = train_step(init_train_state(_params(), plain), grads, plain).state.params
    no_decay = _adamw_step_config(optimizer=optim.adamw_config(lr=0.1, weight_decay=0.0))
    undecayed = train_step(init_train_state(_params(), no_decay), grads, no_decay).state.params
    np.testing.assert_array_equal(grouped[0], undecayed[0])
    np.testing.assert_array_equal(grouped[1], decayed[1])
    assert not np.array_equal(grouped[0], decayed[0]), "weight decay 0.5 must change parameter 0"


def test_parameter_groups_give_each_parameter_its_own_state_kind():
    cfg = _adamw_step_config(param_groups=(ParamGroup((0,), {"amsgrad": True}), ParamGroup((1,))))
    state = init_train_state(_params(), cfg)
    assert state.opt_state[0].max_exp_avg_sq is not None and state.opt_state[1].max_exp_avg_sq is None


@pytest.mark.parametrize(
    "groups, match",
    [
        ((ParamGroup((0,)),), r"missing \[1\]"),
        ((ParamGroup((0, 1, 2)),), r"out of range \[2\]"),
    ],
)
def test_parameter_groups_must_cover_every_parameter(groups, match):
    cfg = _adamw_step_config(param_groups=groups)
    with pytest.raises(ValueError, match=match):
        init_train_state(_params(), cfg)


def test_parameter_groups_reject_bad_options():
    with pytest.raises(ValueError, match="'lr'"):
        ParamGroup((0,), {"lr": 0.5})
    with pytest.raises(ValueError, match="momentum"):
        _adamw_step_config(param_groups=(ParamGroup((0, 1), {"momentum": 0.9}),))
    with pytest.raises(ValueError, match="weight_decay"):
        _adamw_step_config(param_groups=(ParamGroup((0, 1), {"weight_decay": -1.0}),))
    with pytest.raises(ValueError, match="parameter 1 is in param_groups 0 and 1"):
        _adamw_step_config(param_groups=(ParamGroup((0, 1)), ParamGroup((1,))))
    with pytest.raises(ValueError, match="twice"):
        ParamGroup((0, 0))
    with pytest.raises(ValueError, match="indices"):
        ParamGroup((-1,))


def test_fused_with_clipping_runs_the_fused_kernel_on_the_unscaled_clipped_gradients():
    cfg = _adamw_step_config(optimizer_kind="fused", clip_norm=0.5)
    state = init_train_state(_params(), cfg)
    grads = [np.full(p.shape, 3.0, np.float32) * state.scaler.scale for p in state.params]
    result = train_step(state, grads, cfg)
    clipped = train_step(state, grads, _adamw_step_config(clip_norm=0.5)).grads
    for a, b in zip(result.grads, clipped):
        np.testing.assert_array_equal(a, b)
    expected, _, _ = optim.fused_adam_step(list(state.params), list(clipped), state.opt_state, cfg.optimizer, lr=0.1)
    for a, b in zip(result.state.params, expected):
        np.testing.assert_array_equal(a, b)
    assert result.record.clip_coef < 1.0


def test_sync_free_rate_is_float32_and_stands_still_on_a_skipped_step():
    schedule = LRSchedule(base_lr=0.1, kind="cosine", warmup_steps=1, total_steps=6, min_lr_ratio=0.1)
    cfg = _adamw_step_config(optimizer_kind="fused", sync_free=True, schedule=schedule)
    assert cfg.lr_at(3) == float(np.float32(schedule.lr_at(3))) != schedule.lr_at(3)
    state = init_train_state(_params(), cfg)
    lrs = []
    for bad in (False, True, False):
        grads = [np.ones_like(p) * state.scaler.scale for p in state.params]
        if bad:
            grads[1] = grads[1].copy()
            grads[1][0, 0] = np.nan
        result = train_step(state, grads, cfg)
        assert result.record.applied is not bad
        if bad:
            # Skipped inside the kernel: parameters, moments and the step counter are unchanged.
            for a, b in zip(result.state.params, state.params):
                np.testing.assert_array_equal(a, b)
            assert [s.step for s in result.state.opt_state] == [s.step for s in state.opt_state]
        lrs.append(result.record.lr)
        state = result.state
    assert lrs == [cfg.lr_at(0), cfg.lr_at(1), cfg.lr_at(1)], "a skipped step must not advance the schedule"


def test_fused_and_sync_free_options_are_validated():
    with pytest.raises(ValueError, match="sync_free needs optimizer_kind 'fused'"):
        _adamw_step_config(sync_free=True)
    with pytest.raises(ValueError, match="SGD with momentum"):
        _sgd_config(optimizer=optim.SGDConfig(lr=0.1, momentum=0.9), optimizer_kind="fused", sync_free=True)
    with pytest.raises(ValueError, match="SGD with momentum"):
        _sgd_config(optimizer_kind="fused", sync_free=True,
                    param_groups=(ParamGroup((0,), {"momentum": 0.9}), ParamGroup((1,))))
    _sgd_config(optimizer_kind="fused", sync_free=True)  # plain SGD: the kernel's skip is safe
    with pytest.raises(ValueError, match="unscale 'kernel'"):
        _adamw_step_config(optimizer_kind="fused", unscale="kernel", clip_norm=1.0)
    with pytest.raises(ValueError, match="unscale must be one of"):
        _adamw_step_config(unscale="optimizer")
