"""torchimpl.train.scaler: the loss scaler's presets, exactness against torch, state and syncs."""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import pickle
import random
import types
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchimpl.train.scaler import (
    PRESETS,
    DynamicLossScaler,
    ScaleAtMinimumError,
    ScalerConfig,
    make_grad_scaler,
)

INF = float("inf")
FLT_MAX = 3.4028234663852886e38


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float32 tensor, so NaN payloads and signed zeros compare exactly."""
    return t.detach().contiguous().view(torch.int32)


def _scaler(**config) -> DynamicLossScaler:
    return DynamicLossScaler("cpu", ScalerConfig(**config))


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).float())


class _Ticker:
    """Drives a scaler one optimizer step at a time with a chosen overflow decision."""

    def __init__(self, scaler: DynamicLossScaler, n_optimizers: int = 1) -> None:
        self.scaler = scaler
        self.params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(n_optimizers)]
        self.opts = [torch.optim.SGD([p], lr=0.0) for p in self.params]

    def tick(self, *overflow: bool) -> list[bool]:
        """One iteration; ``overflow[i]`` plants an inf in optimizer i's gradient."""
        flags = overflow if len(overflow) == len(self.opts) else overflow * len(self.opts)
        self.scaler.scale(torch.ones(()))  # creates the state on the first call
        applied = []
        for p, opt, bad in zip(self.params, self.opts, flags):
            p.grad = torch.ones(3)
            if bad:
                p.grad[1] = INF
            applied.append(bool(self.scaler.step(opt)))
        self.scaler.update()
        return applied

    def state(self) -> tuple[float, int, int]:
        s = self.scaler
        return s.get_scale(), s._get_growth_tracker(), s.get_hysteresis_left()


# --- configuration -------------------------------------------------------------------------


def test_presets_resolve_to_their_documented_values():
    torch_ = ScalerConfig().resolved()
    assert (torch_.init_scale, torch_.growth_factor, torch_.backoff_factor) == (2.0**16, 2.0, 0.5)
    assert (torch_.growth_interval, torch_.hysteresis) == (2000, 1)
    assert (torch_.min_scale, torch_.max_scale, torch_.raise_at_min_scale) == (None, None, False)
    assert torch_.is_plain_torch

    meg = ScalerConfig(preset="megatron").resolved()
    assert (meg.init_scale, meg.growth_interval, meg.hysteresis) == (2.0**32, 1000, 2)
    assert (meg.min_scale, meg.max_scale, meg.raise_at_min_scale) == (1.0, None, False)
    assert not meg.is_plain_torch

    ds = ScalerConfig(preset="deepspeed").resolved()
    assert (ds.init_scale, ds.growth_interval, ds.hysteresis) == (2.0**16, 1000, 2)
    assert (ds.min_scale, ds.raise_at_min_scale, ds.consecutive_hysteresis) == (1.0, True, False)
    assert set(PRESETS) == {"torch", "megatron", "deepspeed", "deepspeed_fp16", "apex", "jmp", "static"}
    f = ScalerConfig(preset="deepspeed_fp16").resolved()
    assert (f.hysteresis, f.min_scale, f.raise_at_min_scale, f.growth_since_overflow) == (1, 1.0, False, True)
    a = ScalerConfig(preset="apex").resolved()
    assert (a.growth_interval, a.min_scale, a.max_scale) == (2000, None, 2.0**24)
    j = ScalerConfig(preset="jmp").resolved()
    assert (j.init_scale, j.growth_interval, j.min_scale) == (2.0**15, 2000, 1.0)
    st = ScalerConfig(preset="static").resolved()
    assert not st.dynamic and st.skip_on_overflow and not st.is_plain_torch


def test_explicit_values_override_the_preset():
    r = ScalerConfig(preset="megatron", init_scale=8.0, growth_interval=5, hysteresis=3).resolved()
    assert (r.init_scale, r.growth_interval, r.hysteresis, r.min_scale) == (8.0, 5, 3, 1.0)
    r = ScalerConfig(hysteresis=2).resolved()
    assert r.preset == "torch" and r.hysteresis == 2 and not r.is_plain_torch


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": INF}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.0}, "growth_interval"),
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": -1.0}, "init_scale"),
        ({"init_scale": math.nan}, "init_scale"),
        ({"init_scale": 1e39}, "init_scale"),  # finite in float64, inf in float32
        ({"hysteresis": 0}, "hysteresis"),
        ({"hysteresis": True}, "hysteresis"),
        ({"min_scale": -1.0}, "min_scale"),
        ({"max_scale": INF}, "max_scale"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, "min_scale must be <= max_scale"),
        ({"max_scale": 2.0**10}, "init_scale must be <= max_scale"),
        ({"min_scale": 2.0**20}, "init_scale must be >= min_scale"),
        ({"raise_at_min_scale": True}, "needs a min_scale"),
        ({"preset": "fairseq"}, "preset"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ScalerConfig(**kwargs)


def test_config_reports_every_problem_in_one_error():
    with pytest.raises(ValueError) as info:
        ScalerConfig(
            preset="x", growth_factor=0.5, backoff_factor=2.0, growth_interval=0, hysteresis=0
        )
    msg = str(info.value)
    for name in ("preset", "growth_factor", "backoff_factor", "growth_interval", "hysteresis"):
        assert name in msg, f"{name} missing from {msg!r}"


# --- the torch preset is torch.amp.GradScaler ---------------------------------------------


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=False)
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


@pytest.mark.parametrize("kind", ["sgd", "fused_adamw"])
@pytest.mark.parametrize(
    "factors",
    [
        {"init_scale": 2.0**16, "growth_interval": 3},
        {"init_scale": 1000.3, "growth_factor": 1.7, "backoff_factor": 0.3, "growth_interval": 2},
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_preset_equals_gradscaler_bit_for_bit(kind, factors, seed):
    rng = random.Random(seed)
    ours_m, ref_m = _model(seed), _model(seed)
    ours_opt, ref_opt = _optimizer(kind, ours_m.parameters()), _optimizer(kind, ref_m.parameters())
    ours = _scaler(**factors)
    assert ours.policy.is_plain_torch
    ref = torch.amp.GradScaler("cpu", **factors)
    torch.manual_seed(100 + seed)
    for it in range(30):
        x = torch.randn(6, 4)
        plant = rng.random() < 0.3
        where = (rng.randrange(4), rng.choice([INF, -INF, math.nan]))
        unscale_first = rng.random() < 0.5
        for scaler, model, opt in ((ours, ours_m, ours_opt), (ref, ref_m, ref_opt)):
            opt.zero_grad()
            scaler.scale(model(x).square().mean()).backward()
            if plant:
                list(model.parameters())[where[0]].grad.view(-1)[0] = where[1]
            if unscale_first:
                scaler.unscale_(opt)
        applied = ours.step(ours_opt)
        ref.step(ref_opt)
        ref_found = sum(v.item() for v in ref._found_inf_per_device(ref_opt).values())
        assert bool(applied) == (ref_found == 0), f"iteration {it}: skip decision differs"
        for (name, p), q in zip(ours_m.named_parameters(), ref_m.parameters()):
            assert torch.equal(_bits(p.grad), _bits(q.grad)), f"iteration {it}: {name}.grad bits"
            assert torch.equal(_bits(p), _bits(q)), f"iteration {it}: {name} bits"
        ours.update()
        ref.update()
        assert torch.equal(_bits(ours._scale), _bits(ref._scale)), f"iteration {it}: scale"
        assert ours._get_growth_tracker() == ref._get_growth_tracker(), f"iteration {it}: tracker"
    sd = ours.state_dict()
    assert {k: sd[k] for k in ref.state_dict()} == ref.state_dict()


@pytest.mark.parametrize("seed", range(4))
def test_tensor_update_equals_torch_kernel(seed):
    # A floor that never binds forces the device-tensor update; it must reproduce torch's
    # kernel bit for bit, including f32(f64(S) * factor) and the refused growth to inf.
    rng = random.Random(seed)
    init = rng.choice([_f32(3e38), 1000.3, 2.0**100 * 1.37])
    factors = {
        "init_scale": init,
        "growth_factor": rng.choice([2.0, 1.3, 3.7]),
        "backoff_factor": rng.choice([0.5, 0.77, 0.1]),
        "growth_interval": rng.randint(1, 3),
    }
    ours = _scaler(**factors, min_scale=1e-30)
    assert not ours.policy.is_plain_torch
    ref = torch.amp.GradScaler("cpu", **factors)
    a, b = _Ticker(ours), _Ticker(ref)
    for it in range(40):
        bad = rng.random() < 0.25
        a.tick(bad)
        b.tick(bad)
        assert torch.equal(_bits(ours._scale), _bits(ref._scale)), (
            f"tick {it}: scale {ours.get_scale()!r} != torch {ref.get_scale()!r}"
        )
        assert ours._get_growth_tracker() == ref._get_growth_tracker(), f"tick {it}: tracker"


# --- megatron and deepspeed against hand-computed schedules ------------------------------------


def test_megatron_schedule():
    s = _scaler(preset="megatron", init_scale=8.0, growth_interval=3)
    t = _Ticker(s)
    # (overflow, applied, scale, tracker, hysteresis_left) after each step
    expected = [
        (True, False, 8.0, 0, 1),  # first overflow: hysteresis absorbs it, step skipped
        (True, False, 4.0, 0, 0),  # second: back off
        (False, True, 4.0, 1, 0),
        (False, True, 4.0, 2, 0),
        (False, True, 8.0, 0, 2),  # grow; hysteresis refilled only here
        (True, False, 8.0, 0, 1),
        (False, True, 8.0, 1, 1),  # a clean step does not refill it
        (True, False, 4.0, 0, 0),
        (True, False, 2.0, 0, 0),
        (True, False, 1.0, 0, 0),
        (True, False, 1.0, 0, 0),  # floor: clamped, keeps skipping, no error
        (True, False, 1.0, 0, 0),
    ]
    for i, (bad, applied, scale, tracker, hyst) in enumerate(expected):
        assert t.tick(bad) == [applied], f"step {i}: applied"
        assert t.state() == (scale, tracker, hyst), f"step {i}: (scale, tracker, hysteresis)"


def test_deepspeed_schedule_and_raise_at_floor():
    s = _scaler(preset="deepspeed", init_scale=8.0, growth_interval=2)
    t = _Ticker(s)
    expected = [
        (False, 8.0, 1, 2),
        (False, 8.0, 2, 2),
        (False, 16.0, 1, 2),  # grows on the clean step after `interval` clean steps
        (False, 16.0, 2, 2),
        (False, 32.0, 1, 2),  # then every `interval` clean steps
        (True, 32.0, 0, 1),  # hysteresis absorbs the first overflow
        (False, 32.0, 1, 1),
        (True, 16.0, 0, 0),
        (True, 8.0, 0, 0),
        (True, 4.0, 0, 0),
        (True, 2.0, 0, 0),
        (True, 1.0, 0, 0),  # reaching the floor is fine
    ]
    for i, (bad, scale, tracker, hyst) in enumerate(expected):
        assert t.tick(bad) == [not bad], f"step {i}: applied"
        assert t.state() == (scale, tracker, hyst), f"step {i}: (scale, tracker, hysteresis)"
    before = s.state_dict()
    with pytest.raises(ScaleAtMinimumError, match="minimum"):
        t.tick(True)  # overflow at the floor
    assert s.state_dict() == before, "a raising update must leave the state unchanged"


def test_deepspeed_growth_matches_its_counter_over_a_long_run():
    # DeepSpeed: stable = iter - last_overflow_iter - 1; grow when stable > 0 and
    # stable % window == 0 (hysteresis 1 here, no floor reached).
    window = 3
    s = DynamicLossScaler(
        "cpu",
        ScalerConfig(
            preset="deepspeed", init_scale=2.0**10, growth_interval=window, hysteresis=1
        ),
    )
    t = _Ticker(s)
    rng = random.Random(7)
    scale, last_overflow = 2.0**10, -1
    for it in range(60):
        bad = rng.random() < 0.15
        t.tick(bad)
        if bad:
            scale, last_overflow = max(scale / 2, 1.0), it
        else:
            stable = it - last_overflow - 1
            if stable > 0 and stable % window == 0:
                scale *= 2
        assert s.get_scale() == scale, f"iteration {it}"


def test_deepspeed_consecutive_hysteresis_refills_on_every_clean_step():
    cfg = ScalerConfig(
        preset="deepspeed", init_scale=8.0, growth_interval=100, consecutive_hysteresis=True
    )
    t = _Ticker(DynamicLossScaler("cpu", cfg))
    for _ in range(5):
        t.tick(True)
        assert t.state()[0] == 8.0, "an isolated overflow must not back off"
        t.tick(False)
    t.tick(True)
    t.tick(True)
    assert t.state() == (4.0, 0, 0)


def test_growth_past_float32_range_lands_on_the_ceiling():
    t = _Ticker(_scaler(init_scale=_f32(3e38), growth_interval=1, max_scale=FLT_MAX))
    t.tick(False)
    assert t.state()[:2] == (FLT_MAX, 0)


def test_ceiling_clamps_growth():
    t = _Ticker(_scaler(init_scale=4.0, growth_interval=1, max_scale=10.0))
    scales = [(t.tick(False), t.state()[:2])[1] for _ in range(3)]
    assert scales == [(8.0, 0), (10.0, 0), (10.0, 0)]


@pytest.mark.parametrize("start", [_f32(3e38), FLT_MAX])
def test_growth_to_inf_is_refused(start):
    t = _Ticker(_scaler(preset="megatron", init_scale=start, growth_interval=1))
    t.tick(False)
    assert t.state()[:2] == (start, 0), "a growth to inf must be refused and the tracker reset"


def test_floor_clamps_a_backoff_that_jumps_past_it():
    t = _Ticker(_scaler(preset="megatron", init_scale=4.0, min_scale=3.0, hysteresis=1))
    t.tick(True)
    assert t.state()[0] == 3.0


def test_growth_is_a_float64_product_rounded_once():
    # Find S where f32(f64(S) * 1.1) differs from f32(S) * f32(1.1) so the test can tell them apart.
    for k in range(1, 10_000):
        s = _f32(1000.0 + k / 7)
        wide = _f32(s * 1.1)
        f32 = torch.float32
        narrow = float(torch.tensor(s, dtype=f32) * torch.tensor(1.1, dtype=f32))
        if wide != narrow:
            break
    else:
        pytest.fail("no discriminating scale found")
    t = _Ticker(
        _scaler(preset="megatron", init_scale=s, growth_factor=1.1, growth_interval=1)
    )
    t.tick(False)
    got = t.state()[0]
    assert got == wide, f"scale {got!r}: expected f32(f64(S)*1.1)={wide!r}, not {narrow!r}"


@pytest.mark.parametrize("preset", ["torch", "megatron"])
def test_several_optimizers_back_off_once(preset):
    s = _scaler(preset=preset, init_scale=1024.0, hysteresis=1)
    t = _Ticker(s, n_optimizers=3)
    assert t.tick(True, False, True) == [False, True, False]
    assert t.state()[0] == 512.0
    assert t.tick(False, False, False) == [True, True, True]
    assert t.state()[:2] == (512.0, 1)


def test_several_optimizers_spend_one_hysteresis():
    t = _Ticker(_scaler(preset="megatron", init_scale=1024.0), n_optimizers=2)
    t.tick(True, True)
    assert t.state() == (1024.0, 0, 1), "two optimizers overflowing together are one overflow"


# --- step, found_inf_tensor ---------------------------------------------------------------


def test_step_returns_a_device_bool_tensor():
    s = _scaler(init_scale=8.0)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    assert s.last_step_applied() is None
    s.scale(torch.ones(()))
    p.grad = torch.tensor([INF, 8.0])
    skipped = s.step(opt)
    assert isinstance(skipped, torch.Tensor) and skipped.dtype == torch.bool and skipped.dim() == 0
    assert skipped.device == s._scale.device
    assert not bool(skipped) and torch.equal(p.detach(), torch.ones(2)), "a skipped step changed p"
    assert s.last_step_applied() is skipped
    s.update()
    p.grad = torch.tensor([4.0, 8.0])  # scale is now 4
    applied = s.step(opt)
    assert bool(applied) and torch.equal(p.detach(), torch.tensor([0.0, -1.0]))
    assert s.last_step_applied() is applied


def test_found_inf_tensor_sums_optimizers_without_touching_them():
    s = DynamicLossScaler("cpu")
    t = _Ticker(s, n_optimizers=2)
    s.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match="no inf checks"):
        s.found_inf_tensor()
    for p, opt, bad in zip(t.params, t.opts, (True, True)):
        p.grad = torch.full((3,), INF if bad else 1.0)
        s.unscale_(opt)
    fi = s.found_inf_tensor()
    assert fi.dtype == torch.float32 and fi.dim() == 0 and float(fi) == 2.0
    s.step(t.opts[0])
    s.step(t.opts[1])
    s.update()
    assert float(fi) == 2.0, "the returned tensor must not alias torch's in-place accumulation"
    assert s.get_scale() == 2.0**15


def test_found_inf_tensor_writes_the_sum_into_out():
    s = DynamicLossScaler("cpu")
    t = _Ticker(s, n_optimizers=2)
    s.scale(torch.ones(()))
    out = torch.full((), 7.0)
    for p, opt in zip(t.params, t.opts):
        p.grad = torch.full((3,), INF)
        s.unscale_(opt)
    # Both optimizers overflowed: their flags add up (a max or the last flag alone gives 1).
    assert s.found_inf_tensor(out=out) is out and float(out) == 2.0
    assert torch.equal(out, s.found_inf_tensor())
    disabled = _scaler(enabled=False)
    assert disabled.found_inf_tensor(out=out) is out and float(out) == 0.0


def _grads_for_unscale(plant: str | None) -> list[torch.nn.Parameter]:
    """Parameters of two dtypes, one without a gradient; ``plant`` puts inf or NaN in one."""
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in
              ((7, torch.float32), (5, torch.bfloat16), (3, torch.float32), (4, torch.float32))]
    for p in params[:3]:
        p.grad = (torch.randn(p.shape, generator=g) * 3e4).to(p.dtype)
    if plant is not None:
        params[1].grad[2] = float(plant)
    return params


@pytest.mark.parametrize("preset", ["torch", "megatron"])
@pytest.mark.parametrize("plant", [None, "inf", "nan"])
def test_unscale_into_found_inf_matches_torchs_path(preset, plant):
    """``unscale_(opt, found_inf)``: the same gradient bits, flag, skip and scale update as
    ``unscale_(opt)`` followed by ``found_inf_tensor``, with the flag in the caller's tensor."""
    runs = []
    for into in (False, True):
        s = _scaler(preset=preset, init_scale=3.0)
        params = _grads_for_unscale(plant)
        opt = torch.optim.SGD(params, lr=0.5)
        s.scale(torch.ones(()))
        found = torch.zeros(())
        if into:
            s.unscale_(opt, found)
            assert s.found_inf_tensor().data_ptr() != found.data_ptr()
            assert float(s.found_inf_tensor()) == float(found)
        else:
            s.unscale_(opt)
            found = s.found_inf_tensor()
        applied = bool(s.step(opt))
        s.update()
        runs.append(([p.detach().clone() for p in params], [None if p.grad is None else p.grad.clone()
                                                             for p in params], float(found), applied,
                     s.get_scale(), s._get_growth_tracker()))
    (p0, g0, *rest0), (p1, g1, *rest1) = runs
    assert rest1 == rest0 and rest0[0] == (0.0 if plant is None else 1.0)
    for i, (a, b) in enumerate(zip(g0 + p0, g1 + p1)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32)), i


def test_unscale_into_found_inf_allocates_and_copies_no_flag():
    s = DynamicLossScaler("cpu")
    params = _grads_for_unscale(None)
    opt = torch.optim.SGD(params, lr=0.5)
    s.scale(torch.ones(()))
    found = torch.zeros(())

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        s.unscale_(opt, found)
    # The float64 reciprocal of the scale, rounded to float32 (torch's inv_scale), then one
    # check-and-unscale per gradient dtype.
    assert ops.names == ["_to_copy.default", "reciprocal.default", "_to_copy.default"] + [
        "_amp_foreach_non_finite_check_and_unscale_.default"] * 2


def test_unscale_into_found_inf_keeps_torchs_errors():
    s = DynamicLossScaler("cpu")
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s.scale(torch.ones(()))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match=r"found_inf.*0-d float32.*shape \(1,\)"):
        s.unscale_(opt, torch.zeros(1))
    with pytest.raises(ValueError, match="found_inf.*torch.float64"):
        s.unscale_(opt, torch.zeros((), dtype=torch.float64))
    s.unscale_(opt, torch.zeros(()))
    with pytest.raises(RuntimeError, match="already been called"):
        s.unscale_(opt, torch.zeros(()))
    s.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        s.unscale_(opt, torch.zeros(()))
    s.update()
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    half.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="FP16 gradients"):
        s.unscale_(torch.optim.SGD([half], lr=0.1), torch.zeros(()))


def test_unscale_into_found_inf_sparse_takes_torchs_path():
    s = DynamicLossScaler("cpu", ScalerConfig(init_scale=4.0))
    emb = torch.nn.Embedding(5, 2, sparse=True)
    emb(torch.tensor([1, 3])).sum().mul(4.0).backward()
    dense = torch.nn.Parameter(torch.zeros(2))
    dense.grad = torch.tensor([8.0, INF])
    opt = torch.optim.SGD([emb.weight, dense], lr=0.1)
    s.scale(torch.ones(()))
    found = torch.zeros(())
    s.unscale_(opt, found)
    assert float(found) == 1.0
    assert torch.equal(emb.weight.grad.to_dense()[[1, 3]], torch.ones(2, 2))
    assert dense.grad[0].item() == 2.0


def test_update_leaves_a_callers_found_inf_unchanged_with_two_optimizers():
    s = DynamicLossScaler("cpu")
    t = _Ticker(s, n_optimizers=2)
    s.scale(torch.ones(()))
    mine = torch.zeros(())
    t.params[0].grad = torch.full((3,), INF)
    t.params[1].grad = torch.full((3,), INF)
    s.unscale_(t.opts[0], mine)
    s.unscale_(t.opts[1])
    assert float(s.found_inf_tensor()) == 2.0
    s.step(t.opts[0])
    s.step(t.opts[1])
    s.update()
    # torch's update adds the second flag into the first record; the caller's stays 1.0.
    assert float(mine) == 1.0 and s.get_scale() == 2.0**15


def test_disabled_scaler_is_a_passthrough():
    s = _scaler(enabled=False)
    x = torch.ones(2)
    assert s.scale(x) is x
    p = torch.nn.Parameter(torch.ones(1))
    p.grad = torch.tensor([INF])
    assert bool(s.step(torch.optim.SGD([p], lr=1.0)))
    assert s.state_dict() == {}


# --- state -------------------------------------------------------------------------------------


def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_round_trip_through_torch_save_resumes_identically():
    cfg = ScalerConfig(
        preset="megatron", init_scale=1000.3, growth_factor=1.7, growth_interval=3, max_scale=1e6
    )
    a = DynamicLossScaler("cpu", cfg)
    ta = _Ticker(a)
    schedule = [True, False, False, True, True, False, False, False, False, True, False, False]
    for bad in schedule[:5]:
        ta.tick(bad)
    sd = a.state_dict()
    assert all(isinstance(v, (bool, int, float, str, type(None))) for v in sd.values())
    b = DynamicLossScaler("cpu")  # a torch-preset scaler takes the saved policy
    b.load_state_dict(_roundtrip(sd))
    assert b.state_dict() == sd
    # The loaded scale becomes the policy's starting scale, as torch's _init_scale does.
    assert b.policy == dataclasses.replace(a.policy, init_scale=sd["scale"])
    tb = _Ticker(b)
    for i, bad in enumerate(schedule[5:]):
        ta.tick(bad)
        tb.tick(bad)
        assert torch.equal(_bits(a._scale), _bits(b._scale)), f"step {i}: scale"
        assert ta.state() == tb.state(), f"step {i}: (scale, tracker, hysteresis)"


def test_state_before_first_scale_round_trips_and_loads_lazily():
    a = _scaler(preset="deepspeed")
    sd = _roundtrip(a.state_dict())
    b = DynamicLossScaler("cpu")
    b.load_state_dict(sd)
    assert b.state_dict() == sd
    tb = _Ticker(b)
    tb.tick(True)
    assert tb.state() == (2.0**16, 0, 1)


def test_loads_a_plain_gradscaler_state():
    ref = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=5)
    tr = _Ticker(ref)
    tr.tick(False)
    tr.tick(False)
    s = _scaler(preset="megatron", init_scale=8.0)
    s.load_state_dict(_roundtrip(ref.state_dict()))
    assert (s.get_scale(), s._get_growth_tracker(), s.get_hysteresis_left()) == (64.0, 2, 2)
    assert s.policy.growth_interval == 5 and s.policy.preset == "megatron"


def _bad_states():
    good = _scaler(preset="megatron", init_scale=64.0, growth_interval=10).state_dict()
    cases = []

    def case(label, field, **changes):
        sd = dict(good)
        for k, v in changes.items():
            if v is _DROP:
                del sd[k]
            else:
                sd[k] = v
        cases.append(pytest.param(sd, field, id=label))

    case("missing-key", "hysteresis_left", hysteresis_left=_DROP)
    case("unknown-key", "extra", extra=1)
    case("scale-str", "scale", scale="64.0")
    case("scale-negative", "scale", scale=-64.0)
    case("scale-zero", "scale", scale=0.0)
    case("scale-nan", "scale", scale=math.nan)
    case("scale-inf", "scale", scale=INF)
    case("scale-below-floor", "scale must be >= min_scale", scale=0.5)
    case("growth-factor", "growth_factor", growth_factor=1.0)
    case("backoff-factor", "backoff_factor", backoff_factor=1.5)
    case("interval-float", "growth_interval", growth_interval=10.0)
    case("tracker-negative", "_growth_tracker", _growth_tracker=-1)
    case("tracker-past-interval", "_growth_tracker", _growth_tracker=10)
    case("tracker-bool", "_growth_tracker", _growth_tracker=True)
    case("hysteresis-left", "hysteresis_left", hysteresis_left=3)
    case("preset", "preset", preset="fairseq")
    case("min-over-max", "min_scale must be <= max_scale", min_scale=2.0, max_scale=1.5)
    case("raise-str", "raise_at_min_scale", raise_at_min_scale="yes")
    case("empty", "empty", **{k: _DROP for k in good})
    return cases


_DROP = object()


@pytest.mark.parametrize("bad, field", _bad_states())
@pytest.mark.parametrize("initialised", [False, True])
def test_rejected_state_changes_nothing(bad, field, initialised):
    s = _scaler(preset="deepspeed", init_scale=32.0, growth_interval=4)
    t = _Ticker(s)
    if initialised:
        t.tick(False)
        t.tick(True)
    before, policy = s.state_dict(), s.policy
    with pytest.raises(ValueError, match=field):
        s.load_state_dict(bad)
    assert s.state_dict() == before, "a rejected load changed the state"
    assert s.policy == policy, "a rejected load changed the policy"


def test_rejection_lists_every_problem():
    s = DynamicLossScaler("cpu")
    sd = s.state_dict()
    sd.update(scale=-1.0, backoff_factor=2.0, _growth_tracker=-3)
    with pytest.raises(ValueError) as info:
        s.load_state_dict(sd)
    for name in ("scale", "backoff_factor", "_growth_tracker"):
        assert name in str(info.value)


def test_pickle_keeps_hysteresis():
    s = _scaler(preset="megatron", init_scale=8.0)
    _Ticker(s).tick(True)
    clone = pickle.loads(pickle.dumps(s))
    assert clone.state_dict() == s.state_dict()
    assert copy.deepcopy(s).state_dict() == s.state_dict()


def test_setters_validate():
    s = DynamicLossScaler("cpu")
    with pytest.raises(ValueError, match="growth_factor"):
        s.set_growth_factor(0.5)
    s.set_growth_interval(7)
    assert s.get_growth_interval() == 7 and s.policy.growth_interval == 7


# --- host syncs ----------------------------------------------------------------------------------


class _CountScalarReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: every ``.item()``-style read of a tensor value."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _reads_per_step(preset: str, kind: str, steps: int = 3) -> list[int]:
    model = _model(0)
    if kind == "fused_adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        assert opt._step_supports_amp_scaling
    else:
        # SGD's for-loop step reads nothing itself, so every count belongs to the scaler.
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=False)
    s = _scaler(preset=preset, init_scale=1024.0)
    x = torch.randn(5, 4)
    counts = []
    for i in range(steps):
        opt.zero_grad()
        with _CountScalarReads() as mode:
            s.scale(model(x).square().mean()).backward()
            if i == 1:
                model[0].weight.grad[0, 0] = INF
            s.step(opt)
            s.found_inf_tensor()
            s.update()
        counts.append(mode.count)
    return counts


@pytest.mark.parametrize(
    "preset, kind, per_step",
    [
        ("torch", "fused_adamw", 0),
        ("megatron", "fused_adamw", 0),
        ("torch", "for_loop_sgd", 1),
        ("megatron", "for_loop_sgd", 1),
        ("deepspeed", "fused_adamw", 1),  # the documented raise-at-floor read
        ("deepspeed", "for_loop_sgd", 2),
    ],
)
def test_host_reads_per_step(preset, kind, per_step):
    assert _reads_per_step(preset, kind) == [per_step] * 3


# --- make_grad_scaler ---------------------------------------------------------------------


def _plan(mode: str, use_scaler: bool, device_type: str):
    return types.SimpleNamespace(mode=mode, use_scaler=use_scaler, device_type=device_type)


def test_make_grad_scaler_only_for_fp16_on_cuda():
    assert make_grad_scaler(_plan("fp16", False, "cpu")) is None
    assert make_grad_scaler(_plan("bf16", False, "cuda")) is None
    assert make_grad_scaler(_plan("fp32", False, "cuda")) is None
    assert make_grad_scaler(_plan("fp16", True, "mps")) is None
    with warnings.catch_warnings():
        # Without CUDA torch disables a "cuda" scaler with a warning; that is torch's rule.
        warnings.simplefilter("ignore", UserWarning)
        s = make_grad_scaler(_plan("fp16", True, "cuda"), ScalerConfig(preset="megatron"))
    assert isinstance(s, DynamicLossScaler) and s._device == "cuda"
    assert s.policy.preset == "megatron"
    assert s.is_enabled() == torch.cuda.is_available()


def test_make_grad_scaler_force():
    s = make_grad_scaler(_plan("fp32", False, "cpu"), force=True)
    assert isinstance(s, DynamicLossScaler) and s.is_enabled() and s._device == "cpu"
    assert s.policy.is_plain_torch


def test_make_grad_scaler_rejects_a_non_plan():
    with pytest.raises(ValueError, match="use_scaler"):
        make_grad_scaler(object())


@pytest.mark.parametrize("preset", ["torch", "megatron"])
def test_state_tensors_are_the_live_scale_and_tracker_without_a_read(preset):
    s = _scaler(preset=preset, init_scale=1024.0, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    (s.scale(p.sum())).backward()
    with _CountScalarReads() as mode:
        scale, tracker = s.state_tensors()
    assert mode.count == 0
    assert (scale.dtype, tracker.dtype, scale.shape, tracker.shape) == (torch.float32, torch.int32, (), ())
    s.step(opt)
    s.update()
    # The same tensors, changed in place by update(): one clean step counted.
    assert s.state_tensors()[0] is scale and s.state_tensors()[1] is tracker
    assert (float(scale), int(tracker)) == (s.get_scale(), 1) == (1024.0, 1)


def test_state_tensors_of_a_disabled_scaler_raise():
    with pytest.raises(RuntimeError, match="disabled"):
        _scaler(enabled=False).state_tensors()


def test_make_grad_scaler_disabled_means_no_scaler():
    off = ScalerConfig(enabled=False)
    assert make_grad_scaler(_plan("bf16", False, "cpu"), off) is None
    with pytest.warns(UserWarning, match="scaler.enabled is false"):
        assert make_grad_scaler(_plan("fp16", True, "cuda"), off) is None
    with pytest.warns(UserWarning, match="2\\*\\*-24"):
        assert make_grad_scaler(_plan("fp32", False, "cpu"), off, force=True) is None


# --- static scales ------------------------------------------------------------------------------


def _overflowing_step(scaler: DynamicLossScaler, value: float) -> tuple[torch.Tensor, bool]:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.scale(torch.ones(()))
    p.grad = torch.tensor([value, 1.0])
    applied = scaler.step(opt)
    scaler.update()
    return p.detach(), bool(applied)


def test_a_static_scale_never_moves_and_skips_overflowing_steps():
    s = _scaler(preset="static", init_scale=8.0, growth_interval=1)
    for value in (float("inf"), 1.0, 1.0, float("nan")):
        param, applied = _overflowing_step(s, value)
        assert applied == math.isfinite(value)
        assert s.get_scale() == 8.0 and s._get_growth_tracker() == 0
    assert s.state_dict()["dynamic"] is False and "skip_on_overflow" not in s.state_dict()


def test_a_static_scale_that_does_not_skip_steps_with_non_finite_gradients():
    s = _scaler(preset="static", init_scale=4.0, skip_on_overflow=False)
    param, applied = _overflowing_step(s, float("inf"))
    assert applied and math.isinf(param[0].item()) and param[1].item() == 1.0 - 0.25
    fused = torch.optim.Adam([torch.nn.Parameter(torch.ones(1))], fused=True)
    fused.param_groups[0]["params"][0].grad = torch.ones(1)
    s.scale(torch.ones(()))
    with pytest.raises(ValueError, match="skip_on_overflow=False needs an optimizer"):
        s.step(fused)


def test_states_saved_before_static_scales_existed_still_load():
    s = _scaler(preset="megatron", init_scale=8.0)
    sd = s.state_dict()
    assert "dynamic" not in sd and "skip_on_overflow" not in sd
    t = _scaler()
    t.load_state_dict(sd)
    assert t.policy.preset == "megatron" and t.policy.dynamic and t.policy.skip_on_overflow
